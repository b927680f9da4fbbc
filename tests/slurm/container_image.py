"""A Charliecloud image built from this host, for the container tests on the local Slurm cluster.

``ch-run`` runs a plain folder as an image. The folder made here holds only empty mount points, and
``/etc/passwd`` and ``/etc/group`` (ch-run writes its own user over them): the host's ``/usr``, the Python
installation and this checkout come in as the site file's mounts. The test's virtual environment is mounted
at ``/opt/venv``, a path that does not exist on the host, so an interpreter path there proves that a rank ran
inside the container.
"""
from __future__ import annotations

import getpass
import os
import shutil
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from sailor_hpc.core.toml_writer import dump_toml

VENV_INSIDE = "/opt/venv"
PYTHON_INSIDE = f"{VENV_INSIDE}/bin/python"
REPO = Path(__file__).resolve().parents[2]
LOCAL_LAB = REPO / "site_configs" / "local-lab.toml"


@dataclass(frozen=True)
class HostImage:
    folder: Path
    mounts: tuple[str, ...]

    def container(self) -> dict[str, object]:
        """The site file's ``[environment.container]`` table for this image."""
        return {"runtime": "charliecloud", "image": str(self.folder), "mounts": list(self.mounts)}


def why_no_charliecloud() -> str | None:
    """Why the container tests cannot run here (None: they can)."""
    if shutil.which("ch-run") is None:
        return "ch-run not found (Debian: apt-get install charliecloud-runtime; tests/slurm/install.sh installs it)"
    if sys.prefix == sys.base_prefix:
        return "the tests run outside a virtual environment, which the image mounts at /opt/venv"
    if Path(VENV_INSIDE).exists():
        return f"{VENV_INSIDE} exists on this host: the test could not tell a rank in the container from one outside"
    return None


def host_image(root: Path, *more: Path) -> HostImage:
    """The image folder under ``root``; ``more``: folders the ranks need beyond ``tempfile.gettempdir()``
    (which ch-run shares itself)."""
    folder = root / "image"
    for d in ("usr", "etc", "tmp", "dev", "proc", "sys", "home", "root", "run", "var", "mnt", "opt"):
        (folder / d).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "sbin", "lib", "lib64"):  # merged /usr, as on Debian
        target = Path("/") / link
        if target.is_symlink() and not (folder / link).exists():
            (folder / link).symlink_to(os.readlink(target))
    for f in ("passwd", "group", "hosts", "resolv.conf"):
        (folder / "etc" / f).touch()
    pairs = [("/usr", "/usr"), (sys.prefix, VENV_INSIDE), (sys.base_prefix, sys.base_prefix), (str(REPO), str(REPO))]
    tmp = Path(tempfile.gettempdir()).resolve()
    pairs += [(str(p), str(p)) for p in more if tmp not in Path(p).resolve().parents]
    mounts = []
    for src, dst in dict(pairs).items():
        if src != "/usr" and dst.startswith("/usr/"):
            continue  # inside the mounted /usr already
        (folder / dst.lstrip("/")).mkdir(parents=True, exist_ok=True)
        mounts.append(f"{src}:{dst}")
    return HostImage(folder, tuple(mounts))


def user_env() -> dict[str, str]:
    """What ch-run needs of the environment that a login shell sets and Slurm passes on: ``USER``."""
    return {"USER": os.environ.get("USER") or getpass.getuser()}


def local_lab_in_image(root: Path, *more: Path) -> Path:
    """site_configs/local-lab.toml with an ``[environment.container]`` of Charliecloud and :func:`host_image`,
    written under ``root``."""
    doc = tomllib.loads(LOCAL_LAB.read_text())
    doc["environment"]["container"] = host_image(root, *more).container()
    path = root / "site.toml"
    path.write_text(dump_toml(doc))
    return path
