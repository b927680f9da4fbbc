"""``sailor-hpc profiles ...``: the HDF5 profile archive."""
from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np

from profiler.monotonic import DIRECTIONS, MONOTONIC, ModelTotals, violations
from profiler.noise import NOISY, NOISY_SPREAD, flag_parts, noisy
from sailor_hpc.cli.app import main
from sailor_hpc.cli.columns import fitted_table, terminal_width
from sailor_hpc.cli.output import echo_json, json_option, table
from sailor_hpc.core.archive import ComputeEntry, archive_files, compact, litter, open_archive, read_archive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.locking import group_shared, mount_locks
from sailor_hpc.core.models import get_model
from sailor_hpc.core.precision import DTYPES
from sailor_hpc.core.sailor_compat.profiles import import_sailor

if TYPE_CHECKING:
    Points = dict[tuple[int, int], ComputeEntry]

archive_option = click.option("--archive", type=click.Path(dir_okay=False, path_type=Path), default=None,
                              help="Profile archive (default: $SAILOR_PROFILES, else the embedded Sailor profiles).")


@main.group()
def profiles() -> None:
    """Profile archives (per-layer times, memory, network)."""


@profiles.command("import-sailor")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--archive", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Archive to create or merge into.")
@json_option
def import_sailor_cmd(directory: Path, archive: Path, as_json: bool) -> None:
    """Convert Sailor's published profiles (DIRECTORY has profiles/ and network/) into ARCHIVE."""

    skipped: dict[str, str] = {}
    n = import_sailor(directory, archive, skipped)
    if as_json:
        echo_json({"archive": str(archive), "entries": n, "skipped": skipped})
    else:
        click.echo(f"wrote {n} entries into {archive}")
        for reason in skipped.values():
            click.echo(f"skipped: {reason}")


def _open(archive: Path | None):
    return read_archive(archive) if archive else open_archive()


def _pair_row(model: str, gpu: str, dtype: str, points: Points, failed: Points) -> dict[str, Any]:
    """One (model, GPU, dtype) profile of ``profiles list``: measured points, and the failed ones with their reasons,
    so a pair whose every point failed still shows that profiling was tried, and why it failed."""
    grid = {**failed, **points}
    status = "ok" if not failed else ("failed" if not points else "partly failed")
    return {"model": model, "gpu": gpu, "dtype": dtype, "status": status, "mbs": sorted({b for b, _ in grid}),
            "tp": sorted({t for _, t in grid}), "points": len(points), "failed": len(failed),
            "failed_points": [{"mbs": b, "tp": t, "reason": e.reason} for (b, t), e in sorted(failed.items())],
            "source": next(iter(grid.values())).provenance.get("source", "")}


def _reasons(row: dict[str, Any], width: int = 80) -> str:
    """The distinct reasons of a row's failed points, on one line."""
    text = "; ".join(dict.fromkeys(f["reason"] or "no reason recorded" for f in row["failed_points"]))
    return text if len(text) <= width else text[:width - 3] + "..."


@profiles.command("list")
@archive_option
@json_option
def list_cmd(archive: Path | None, as_json: bool) -> None:
    """List (model, GPU, dtype) profiles with their micro-batch sizes and TP degrees (failed ones included)."""
    a = _open(archive)
    rows = [_pair_row(model, gpu, dtype, a.compute.get((model, gpu, dtype), {}), a.failed.get((model, gpu, dtype), {}))
            for model, gpu, dtype in sorted(set(a.compute) | set(a.failed))]
    if as_json:
        echo_json({"archive": a.where, "profiles": rows, "memory": {m: sorted(t) for m, t in a.memory.items()},
                   "overhead": sorted(a.overhead), "network": {s: len(v) for s, v in a.network.items()}})
        return
    click.echo(f"archive: {a.where}")
    click.echo(table(("model", "gpu", "dtype", "mbs", "tp", "points", "failed", "status", "why failed"),
                     [(r["model"], r["gpu"], r["dtype"], ",".join(map(str, r["mbs"])), ",".join(map(str, r["tp"])), r["points"],
                       r["failed"], r["status"], _reasons(r) or "-") for r in rows]))


def _pct(spread: dict[str, Any] | None, direction: str) -> str:
    """A spread as a percentage, "-" where the profile recorded none (Sailor's, older archives)."""
    return "-" if spread is None else f"{100 * spread[direction]:.1f} %"


@dataclass(frozen=True)
class OrderBreak:
    """Two points of one TP degree whose times are out of order: the larger micro-batch size is faster."""

    tp: int
    small: int
    large: int
    why: str


def _order_breaks(points: Points) -> list[OrderBreak]:
    """Pairs of points whose larger micro-batch size is faster: more samples never take less time, so one of
    the two is a measurement gone wrong. Named where the gap is wider than the two spreads
    (:mod:`profiler.monotonic`, for archives its check did not write: Sailor's, older ones), and where either
    spread is too wide to trust (:mod:`profiler.noise`): a busy node's spreads would allow any gap. A gap
    inside two quiet spreads is noise the medians cannot resolve, as the profiler holds."""
    out = []
    for tp in sorted({t for _, t in points}):
        totals = {b: ModelTotals.of(b, e.times, e.spread) for (b, t), e in points.items() if t == tp}
        for small, large in ((s, big) for s in sorted(totals) for big in sorted(totals) if big > s):
            a, b = totals[small], totals[large]
            below = [d for d in range(len(DIRECTIONS)) if b.seconds[d] < a.seconds[d]]
            loud = any(noisy(points[(m, tp)].spread) for m in (small, large))
            if not below or not (loud or violations((a, b))):
                continue
            times = " and ".join(f"{DIRECTIONS[d]} {b.seconds[d] * 1e3:.3g} ms (mbs {small}: {a.seconds[d] * 1e3:.3g} ms)"
                                 for d in below)
            why = f"mbs {large} is faster than mbs {small}: {times}; a larger micro-batch cannot take less time"
            why += ", and the spreads are too wide to tell which is wrong: measure both again on a quiet node" if loud else ""
            out.append(OrderBreak(tp, small, large, why))
    return out


def _flag_words(entry: ComputeEntry, out_of_order: bool) -> str:
    """The flag column: the kinds of doubt about a point, from its archive flag and from what show checks."""
    kinds = set(flag_parts(entry.flag))
    if noisy(entry.spread):
        kinds.add(NOISY)
    if out_of_order:
        kinds.add(MONOTONIC)
    return ", ".join(k.upper() if k == MONOTONIC else (k or "flagged") for k in sorted(kinds)) or "-"


@profiles.command("show")
@click.argument("model")
@click.argument("gpu")
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True)
@archive_option
@json_option
def show_cmd(model: str, gpu: str, dtype: str, archive: Path | None, as_json: bool) -> None:
    """Per-(mbs, TP) totals of one model on one GPU type in one dtype, with provenance; a point measured on a
    busy node (spread above 20 %) or out of order with a smaller micro-batch size is marked and explained."""

    a = _open(archive)
    name = get_model(model).name
    key = (name, gpu, dtype)
    failed_only = key in a.failed and key not in a.compute
    points = {} if failed_only else a.compute_points(name, gpu, dtype)  # a profile never taken is an error
    breaks = _order_breaks(points)
    rows = []
    for (mbs, tp), e in sorted(points.items()):
        spread = None if e.spread is None else {"fwd": e.spread.model[0], "bwd": e.spread.model[1],
                                                "repetitions": e.spread.repetitions}
        mine = [o.why for o in breaks if o.tp == tp and mbs in (o.small, o.large)]
        rows.append({"mbs": mbs, "tp": tp, "fwd_s": float(np.sum(e.times[:, 0])), "bwd_s": float(np.sum(e.times[:, 1])),
                     "update_s": float(np.max(e.times[:, 2])), "layers": int(e.times.shape[0]), "spread": spread,
                     "flag": e.flag, "noisy": noisy(e.spread), "out_of_order": mine,
                     "flags": _flag_words(e, bool(mine)), "provenance": e.provenance})
    failed = [{"mbs": b, "tp": t, "reason": e.reason} for (b, t), e in sorted(a.failed.get(key, {}).items())]
    if as_json:
        echo_json({"model": name, "gpu": gpu, "dtype": dtype, "points": rows, "failed": failed,
                   "noisy_spread": NOISY_SPREAD})
        return
    click.echo(f"{name} on {gpu} in {dtype} ({a.where}); whole-model seconds per micro-batch, "
               "± their interquartile range over the repetitions")
    click.echo(fitted_table(("mbs", "tp", "fwd s", "fwd ±", "bwd s", "bwd ±", "update s", "layers", "reps", "flag",
                             "source"),
                            [(r["mbs"], r["tp"], r["fwd_s"], _pct(r["spread"], "fwd"), r["bwd_s"], _pct(r["spread"], "bwd"),
                              r["update_s"], r["layers"], r["spread"]["repetitions"] if r["spread"] else "-", r["flags"],
                              r["provenance"].get("source", "")) for r in rows], terminal_width(), shrink=10))
    for r in rows:
        if r["flag"]:
            click.echo(f"flagged: mbs {r['mbs']} tp {r['tp']}: {r['flag']}")
        elif r["noisy"]:  # an archive written before the profiler flagged noisy points
            click.echo(f"warning: mbs {r['mbs']} tp {r['tp']}: {r['noisy']}")
    for o in breaks:
        click.echo(f"warning: tp {o.tp}: {o.why}")
    if any(r["noisy"] for r in rows):
        click.echo(f"noisy: a spread above {100 * NOISY_SPREAD:.0f} % means other work shared the node while the point "
                   "was measured; its time may be off by as much. Measure it again where nothing else runs "
                   "(sailor-hpc profile gives each measuring job its nodes alone).")
    for f in failed:
        click.echo(f"failed: mbs {f['mbs']} tp {f['tp']}: {f['reason']}")


# ---------------------------------------------------------------------- doctor

@dataclass
class Finding:
    """One line of ``profiles doctor``: a problem (fixed or not) or a fact worth knowing (``problem`` False)."""

    what: str
    problem: bool
    fixed: bool = False


def _probe(folder: Path) -> Path | None:
    """A file written now in the archive's folder: temporary files are aged against its mtime (on NFS the
    server's clock for both), not against this host's clock. None where the folder is read-only to us."""
    try:
        fd, name = tempfile.mkstemp(prefix=".doctor.", dir=folder)
    except OSError:
        return None
    os.close(fd)
    return Path(name)


def _folding(path: Path, fix: bool) -> list[Finding]:
    files = archive_files(path)
    public = path.stat() if path.exists() else None
    folded = len(files.bases) == 1 and public is not None and os.path.samestat(public, files.bases[0].stat())
    if not files.shards and (not files.bases or folded):
        return [Finding(f"{len(files.bases)} base, no shards: folded", False)]
    what = f"{len(files.shards)} shards and {len(files.bases)} bases not folded into the public file"
    if not fix:
        return [Finding(what + " (readers merge them; --fix folds them)", True)]
    return [Finding(f"{what}: folded {compact(path)} files", True, True)]


def _litter(path: Path, fix: bool) -> list[Finding]:
    probe = _probe(path.parent)
    try:
        items = litter(path, probe)
    finally:
        if probe is not None:
            probe.unlink(missing_ok=True)
    out = []
    for item in items:
        if not item.removable:
            out.append(Finding(f"temporary file {item.path.name}: {item.why}, kept", False))
            continue
        if fix:
            with contextlib.suppress(FileNotFoundError):
                item.path.unlink()
        out.append(Finding(f"left by a killed writer: {item.path.name} ({item.why})", True, fix))
    return out


def _permissions(path: Path, fix: bool) -> list[Finding]:
    folder = path.parent
    if not group_shared(folder):
        return [Finding(f"folder {folder} is not group-shared: only its owner's group settings apply "
                        "(chmod g+ws on it to share the archive with a group)", False)]
    gid = folder.stat().st_gid
    files = archive_files(path)
    out = []
    for f in (files.path, *files.parts, *files.locks):
        with contextlib.suppress(FileNotFoundError):
            st = f.stat()
            if st.st_mode & 0o660 == 0o660 and st.st_gid == gid:
                continue
            mine = st.st_uid == os.getuid()
            if fix and mine:
                os.chmod(f, (st.st_mode & 0o7777) | 0o660)
                with contextlib.suppress(PermissionError):
                    os.chown(f, -1, gid)
            fixed = fix and mine and (f.stat().st_mode & 0o660 == 0o660) and f.stat().st_gid == gid
            who = "" if mine else f" (owned by uid {st.st_uid}: its owner must run --fix or chmod g+rw)"
            out.append(Finding(f"{f.name} is {oct(st.st_mode & 0o777)} group {st.st_gid}, the folder's group "
                               f"{gid} needs rw{who}", True, fixed))
    return out or [Finding(f"every file is readable and writable by the folder's group {gid}", False)]


@profiles.command("doctor")
@click.argument("archive", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--fix", is_flag=True, help="Fold shards, remove killed writers' temporary files, fix group modes.")
@json_option
def doctor_cmd(archive: Path, fix: bool, as_json: bool) -> None:
    """Check a shared ARCHIVE: shards not yet folded, killed writers' leftovers, group permissions and what
    the mount's locks are worth. Exit 0 healthy, 1 problems remain (after --fix: ones it could not fix),
    2 not an archive."""
    path = Path(os.path.realpath(archive))
    files = archive_files(path)
    if not path.exists() and not files.parts:
        raise SailorError("no profile archive here", file=archive, fix="check the path")
    read_archive(archive)  # a file that is not a (readable) archive is bad input: exit 2, naming it
    locks = mount_locks(path)
    findings = [Finding(f"mount {locks.mount} ({locks.fstype}): locks {locks.scope}: {locks.why}; the archive does "
                        "not rely on them", False)]
    findings += _folding(path, fix) + _litter(path, fix) + _permissions(path, fix)
    findings += [Finding(f"lock file {lk.name}", False) for lk in archive_files(path).locks]
    remaining = [f for f in findings if f.problem and not f.fixed]
    if as_json:
        echo_json({"archive": str(archive), "healthy": not remaining, "findings": [asdict(f) for f in findings]})
    else:
        for f in findings:
            click.echo(f"{'fixed' if f.fixed else 'PROBLEM' if f.problem else 'ok'}: {f.what}")
        click.echo("healthy" if not remaining else f"{len(remaining)} problems" + ("" if fix else " (--fix: what is safe)"))
    if remaining:
        raise SystemExit(1)
