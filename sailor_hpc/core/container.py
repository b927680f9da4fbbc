"""The site's container (``[environment.container]``): the image every job's ranks run in.

HPC sites run training in containers: Apptainer/Singularity on most university and national centres,
enroot through Slurm's pyxis plugin on NVIDIA clusters, Charliecloud on some. The site file names the
runtime, the image and the host folders to mount; :mod:`sailor_hpc.slurm.container` turns that into the
command line of every rank. What is checked here is what can be checked on the machine reading the site
file: a known runtime, an image that exists where the runtime reads a file (sites keep images on the
shared filesystem, so a login node sees them too), mounts written ``"SRC:DST"`` with absolute paths.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sailor_hpc.core.fields import Fields

#: runtime -> what its ``image`` is
RUNTIMES = {
    "apptainer": "a SIF file or sandbox folder, or a URI (docker://, library://, oras://)",
    "singularity": "a SIF file or sandbox folder, or a URI (docker://, library://, oras://)",
    "pyxis": "an enroot image reference (nvcr.io#nvidia/pytorch:24.05-py3) or a squashfs file (.sqsh)",
    "charliecloud": "an image folder or a SquashFS file (.sqfs) that ch-run can run",
}
_URI = re.compile(r"^[a-z][a-z0-9+.-]*://")
# a mount path: absolute, and none of the characters the runtimes split a mount list on (':' between
# source and target, ',' between mounts for pyxis and apptainer), no white space
_MOUNT_PATH = re.compile(r"^/[^:,\s]*$")
_SQUASHFS = (".sqsh", ".squashfs", ".sqfs")


@dataclass(frozen=True)
class Mount:
    """A host folder seen inside the container (``source`` on the node, ``target`` in the image)."""

    source: str
    target: str

    @property
    def text(self) -> str:
        return f"{self.source}:{self.target}"


@dataclass(frozen=True)
class Container:
    """The image the ranks of every job run in, and how: ``runtime`` is the tool that starts it."""

    runtime: str
    image: str
    mounts: tuple[Mount, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"runtime": self.runtime, "image": self.image, "mounts": [m.text for m in self.mounts]}


def image_is_file(runtime: str, image: str) -> bool:
    """Whether the runtime reads ``image`` from the filesystem (else it is a registry reference or URI)."""
    if runtime in ("apptainer", "singularity"):
        return not _URI.match(image)
    if runtime == "pyxis":  # enroot takes a path when it looks like one, else pulls the reference
        return image.startswith(("/", "./", "../")) or image.endswith(_SQUASHFS)
    return True


def parse_container(f: Fields, source: object | None) -> Container:
    """``[environment.container]``; a relative image path is relative to the site file, as the archive is."""
    runtime = f.req("runtime", str)
    if runtime not in RUNTIMES:
        raise f.error("runtime", f"{runtime!r} is not a container runtime sailor-hpc can start ranks with",
                      fix=f"use one of {', '.join(RUNTIMES)}")
    image = f.req("image", str)
    if not image.strip() or any(c in image for c in "\n\r\x00"):
        raise f.error("image", f"{image!r} is not an image", fix=f"give {RUNTIMES[runtime]}")
    if image_is_file(runtime, image):
        path = Path(image).expanduser()
        if not path.is_absolute() and source is not None:
            path = Path(str(source)).parent / path
        path = path.absolute()
        if not path.exists():
            raise f.error("image", f"the {runtime} image {str(path)!r} does not exist",
                          fix=f"build or copy the image there ({RUNTIMES[runtime]}), or correct the path")
        image = str(path)
    raw = f.opt("mounts", list, [])
    mounts = tuple(_mount(f, i, m) for i, m in enumerate(raw))
    f.done()
    return Container(runtime=runtime, image=image, mounts=mounts)


def _mount(f: Fields, i: int, value: Any) -> Mount:
    parts = value.split(":") if isinstance(value, str) else []
    if len(parts) != 2 or not all(_MOUNT_PATH.match(p) for p in parts):
        raise f.error(f"mounts[{i}]", f"{value!r} is not a mount \"SRC:DST\" of two absolute paths",
                      fix='write "/host/path:/path/in/container" (no ",", ":" or spaces inside a path), '
                          'e.g. "/scratch:/scratch"')
    return Mount(parts[0], parts[1])
