"""The command line that starts a rank in the site's container: one builder for every job sailor-hpc runs
(training, profiling, the site check, the preflight probe), so that they all start their ranks alike.

What each runtime relies on (``docs/site-and-formats.md`` says it for site administrators):

- **Apptainer / Singularity**: ``apptainer exec --nv --bind=SRC:DST --pwd=DIR IMAGE CMD``. ``--nv`` binds the
  host's NVIDIA driver libraries and ``nvidia-smi`` into the container (the GPUs Slurm gave the step stay
  the visible ones: the environment, ``CUDA_VISIBLE_DEVICES`` included, passes through).
- **pyxis** (enroot): options of the ``srun`` step itself, ``--container-image=IMAGE
  --container-mounts=SRC:DST[,SRC:DST] --container-workdir=DIR``; enroot's NVIDIA hook passes the step's
  GPUs, nothing to add to the command.
- **Charliecloud**: ``ch-run --bind=SRC:DST --cd=DIR IMAGE -- CMD``. ch-run shares the host's ``/dev``, so the
  GPU device files are there; the driver's user-space libraries must be in the image, put there once with
  ``ch-fromhost --nvidia IMAGE`` (ch-run injects nothing at run time). ch-run needs ``$USER`` set.

The environment passes through every runtime unchanged: ranks read ``SLURM_*`` and the rendezvous variables
inside the container as outside.
"""
from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from sailor_hpc.core.container import Container


@dataclass(frozen=True)
class RankWrapper:
    """How a rank starts in the container: options for the ``srun`` step that starts it (pyxis), and the
    words before the rank's own command (the other runtimes). Empty for a site without a container."""

    srun_options: tuple[str, ...] = ()
    prefix: tuple[str, ...] = ()

    def command(self, argv: Sequence[str]) -> list[str]:
        """The rank's command line, started in the container."""
        return [*self.prefix, *argv]

    @property
    def shell_prefix(self) -> str:
        """:attr:`prefix` as shell words (each quoted), followed by a space when not empty."""
        return "".join(f"{shlex.quote(w)} " for w in self.prefix)

    @property
    def shell_srun_options(self) -> str:
        """:attr:`srun_options` as shell words (each quoted), followed by a space when not empty."""
        return "".join(f"{shlex.quote(w)} " for w in self.srun_options)


NO_CONTAINER = RankWrapper()


def rank_wrapper(container: Container | None, workdir: str | None = None) -> RankWrapper:
    """The :class:`RankWrapper` of ``container`` (None: ranks run on the node's own system). ``workdir``: the
    folder the rank starts in inside the container (None: the runtime's choice), which must exist there."""
    if container is None:
        return NO_CONTAINER
    binds = [f"--bind={m.text}" for m in container.mounts]
    if container.runtime in ("apptainer", "singularity"):
        pwd = [f"--pwd={workdir}"] if workdir else []
        return RankWrapper(prefix=(container.runtime, "exec", "--nv", *binds, *pwd, container.image))
    if container.runtime == "charliecloud":
        cd = [f"--cd={workdir}"] if workdir else []
        return RankWrapper(prefix=("ch-run", *binds, *cd, container.image, "--"))
    if container.runtime == "pyxis":
        mounts = [f"--container-mounts={','.join(m.text for m in container.mounts)}"] if container.mounts else []
        wd = [f"--container-workdir={workdir}"] if workdir else []
        return RankWrapper(srun_options=(f"--container-image={container.image}", *mounts, *wd))
    raise ValueError(f"unknown container runtime {container.runtime!r}")  # the site loader admits none


def path_inside(container: Container | None, path: str) -> str:
    """Where a rank in the container finds the host's ``path``: under the target of the mount whose source holds
    it (the deepest one), else at the same path (what the runtime binds itself: Apptainer's home and
    working folder, Charliecloud's /tmp)."""
    if container is None:
        return path
    best = None
    for m in container.mounts:
        if path == m.source or path.startswith(m.source.rstrip("/") + "/"):
            if best is None or len(m.source) > len(best.source):
                best = m
    if best is None:
        return path
    rest = path[len(best.source.rstrip("/")):]
    return best.target.rstrip("/") + rest if rest else best.target
