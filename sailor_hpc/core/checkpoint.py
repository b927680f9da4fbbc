"""Layout-independent checkpoints: directory protocol, manifest, verification (torch-free).

A checkpoint is a directory ``ROOT/step_NNNNNNNN/`` holding one file per pipeline layer
(``layer_LLL.pt``: full fp32 tensors under Megatron names, with their Adam moments) and
``manifest.json``. It is written as ``ROOT/.tmp-step_NNNNNNNN/``; the manifest, with the size and
SHA-256 of every file, is written last, and only then is the directory renamed into place. So:

- a directory named ``step_*`` without a readable manifest, or whose files do not match the
  manifest's sizes and checksums, is torn or corrupt and is never loaded;
- ``latest_complete(ROOT)`` returns the newest checkpoint that verifies, falling back to older ones;
  ``newest_usable(ROOT)`` also names every newer one it passed over and why, so no caller falls back
  without saying so;
- the manifest is JSON: step, consumed samples (the data position), seed, RNG, the plan that wrote it
  are readable without torch (the controller uses them).

The torch side (gathering shards, writing and loading tensors) is ``checkpoint_io``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.errors import SailorError

FORMAT = "sailor-hpc-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(SailorError):
    """A checkpoint that must not be loaded (torn, corrupt, wrong format)."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def step_of(path: str | Path) -> int | None:
    """The step a checkpoint directory's name says (``step_00000012`` -> 12; None for another name)."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def tmp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".tmp-step_{step:08d}"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


_DAMAGED = "the manifest is damaged: delete this step_* directory (an older checkpoint is used) or restore it"


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path`` (no file checks; see :func:`verify`).

    Every field a reader uses is checked here, so a damaged manifest is a :class:`CheckpointError` (which
    makes the loaders fall back to an older step, saying so) rather than a KeyError deep in a resume."""
    mpath = Path(path) / MANIFEST
    try:
        data = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CheckpointError("checkpoint has no manifest (torn write?)", file=mpath) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"manifest is not valid JSON: {exc}", file=mpath) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise CheckpointError(f"not a {FORMAT} v{VERSION} manifest", file=mpath)
    for key in ("step", "consumed_samples", "files", "params"):
        if key not in data:
            raise CheckpointError(f"manifest lacks {key!r}", file=mpath, field=key, fix=_DAMAGED)
    for key in ("step", "consumed_samples", "adam_steps", "seed"):
        if key in data:
            _count(data[key], mpath, key)
    files = _table(data["files"], mpath, "files")
    for name, meta in files.items():
        _file_name(name, mpath, f"files.{name}")
        meta = _table(meta, mpath, f"files.{name}")
        _count(meta.get("bytes"), mpath, f"files.{name}.bytes")
        if not isinstance(meta.get("sha256"), str):
            raise CheckpointError(f"has no SHA-256 text, got {meta.get('sha256')!r}", file=mpath,
                                  field=f"files.{name}.sha256", fix=_DAMAGED)
    for name, meta in _table(data["params"], mpath, "params").items():
        meta = _table(meta, mpath, f"params.{name}")
        _file_name(meta.get("file"), mpath, f"params.{name}.file")
        shape = meta.get("shape")
        if not isinstance(shape, list):
            raise CheckpointError(f"is not a list of dimensions, got {shape!r}", file=mpath,
                                  field=f"params.{name}.shape", fix=_DAMAGED)
        for i, dim in enumerate(shape):
            _count(dim, mpath, f"params.{name}.shape[{i}]")
    return data


def _count(value: Any, mpath: Path, field: str) -> None:
    """A step, sample count, size or dimension: a non-negative JSON integer (JSON's true is none)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"must be a non-negative integer, got {value!r}", file=mpath, field=field,
                              fix=_DAMAGED)


def _table(value: Any, mpath: Path, field: str) -> dict[str, Any]:
    """``value`` as the JSON object the manifest has there."""
    if not isinstance(value, dict):
        raise CheckpointError(f"must be a JSON object, got {type(value).__name__}", file=mpath, field=field,
                              fix=_DAMAGED)
    return value


def _file_name(name: Any, mpath: Path, field: str) -> None:
    """A file of the checkpoint is named by its plain name: a manifest never points outside its directory."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise CheckpointError(f"{name!r} is not the name of a file in the checkpoint directory", file=mpath,
                              field=field, fix=_DAMAGED)


def verify(path: str | Path, deep: bool = True) -> dict[str, Any]:
    """Return the manifest if every listed file exists with its size (and, ``deep``, its checksum)."""
    path = Path(path)
    manifest = read_manifest(path)
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError("file listed in the manifest is missing", file=f)
        if f.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"size {f.stat().st_size} != {meta['bytes']} in the manifest", file=f)
        if deep and sha256_file(f) != meta["sha256"]:
            raise CheckpointError("checksum does not match the manifest", file=f)
    missing = {m["file"] for m in manifest["params"].values()} - set(manifest["files"])
    if missing:
        raise CheckpointError(f"parameters point to unlisted files {sorted(missing)}", file=path / MANIFEST)
    return manifest


def candidates(root: str | Path) -> list[Path]:
    """``step_*`` directories under ``root``, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := step_of(p)) is not None and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


@dataclass(frozen=True)
class Skipped:
    """A checkpoint passed over because it does not verify."""

    path: Path
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"path": str(self.path), "reason": self.reason}

    def line(self, using: str | Path | None, verb: str = "using") -> str:
        """The human line that says so, and which checkpoint is ``verb``-ed instead (None: none verifies)."""
        instead = f"{verb} {Path(using).name}" if using is not None else "no older checkpoint verifies"
        return f"checkpoint {self.path} is unusable ({self.reason}); {instead}"


@dataclass(frozen=True)
class Choice:
    """The checkpoint a load or export uses, and the newer ones it passed over (newest first)."""

    path: Path | None
    skipped: tuple[Skipped, ...] = ()

    def warnings(self) -> list[str]:
        """One human line per checkpoint passed over: a fallback is never silent."""
        return [s.line(self.path) for s in self.skipped]


def newest_usable(root: str | Path, deep: bool = True) -> Choice:
    """The newest checkpoint under ``root`` that verifies (path None if none does), with every newer
    ``step_*`` directory that did not and why (a torn write, a truncated or corrupt file)."""
    skipped: list[Skipped] = []
    for path in candidates(root):
        try:
            verify(path, deep=deep)
        except CheckpointError as exc:
            where = Path(str(exc.file)).name if exc.file is not None else path.name
            skipped.append(Skipped(path, f"{where}: {exc.message}"))
            continue
        return Choice(path, tuple(skipped))
    return Choice(None, tuple(skipped))


def latest_complete(root: str | Path, deep: bool = True) -> Path | None:
    """The newest checkpoint under ``root`` that verifies, or None (see :func:`newest_usable`)."""
    return newest_usable(root, deep).path


def newest_step(root: str | Path) -> int:
    """The step of the newest complete checkpoint under ``root`` (0: none yet), checked shallowly."""
    path = latest_complete(root, deep=False)
    return int(read_manifest(path)["step"]) if path is not None else 0


def choose(path: str | Path, deep: bool = True) -> Choice:
    """``path`` itself if it names a checkpoint (which must verify: an explicit step never falls back),
    else the newest usable one under it, with the newer ones passed over."""
    path = Path(path)
    if (path / MANIFEST).exists() or _STEP_RE.match(path.name):
        verify(path, deep=deep)
        return Choice(path)
    choice = newest_usable(path, deep=deep)
    if choice.path is None:
        why = f" ({len(choice.skipped)} unusable: {choice.skipped[0].path.name}: {choice.skipped[0].reason})" \
            if choice.skipped else ""
        raise CheckpointError(f"no complete checkpoint found{why}", file=path,
                              fix="train without --load, or point --load at a directory with step_* checkpoints")
    return choice


def resolve(path: str | Path, deep: bool = True) -> Path:
    """``path`` itself if it is a checkpoint, else the newest complete one under it (see :func:`choose`)."""
    found = choose(path, deep).path
    assert found is not None  # choose raises instead
    return found


def start_tmp(root: str | Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of ``step`` (a stale one from a killed run is removed)."""
    tmp = tmp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def write_file(path: Path, data: bytes) -> dict[str, Any]:
    """Write one checkpoint file (fsynced) and return its manifest entry (size, checksum)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": len(data), "sha256": sha256_bytes(data)}


def _commit(tmp: Path, final: Path) -> None:
    """The commit point: the directory appears under its final name, complete."""
    os.replace(tmp, final)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(tmp: Path, manifest: dict[str, Any]) -> Path:
    """Write the manifest into ``tmp`` and rename ``tmp`` to its final ``step_*`` name (the commit point)."""
    manifest = {"format": FORMAT, "version": VERSION, **manifest}
    atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    _fsync_dir(tmp)
    final = step_dir(tmp.parent, manifest["step"])
    if final.exists():  # the same step saved again: move the old one aside first
        trash = tmp.parent / f".old-{final.name}"
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(final, trash)
        _commit(tmp, final)
        shutil.rmtree(trash)
    else:
        _commit(tmp, final)
    _fsync_dir(tmp.parent)
    return final


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (never the only complete one)."""
    complete = [p for p in candidates(root) if _quick_ok(p)]
    doomed = complete[max(keep, 1):]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def _quick_ok(path: Path) -> bool:
    try:
        verify(path, deep=False)
    except CheckpointError:
        return False
    return True
