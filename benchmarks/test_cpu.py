"""Where a test run's CPU goes: process accounting of one command (``make test``, a pytest run), by process kind.

    sudo .venv/bin/python benchmarks/test_cpu.py --out /tmp/cpu -- .venv/bin/python -m pytest -n 3 --dist loadfile tests

The suite's processes are not one tree: Slurm job ranks are children of the lab's ``slurmstepd``, not of
pytest. So the command runs with ``SAILOR_CPU_RUN=<id>`` in its environment, which every descendant inherits
(Slurm jobs too: ``sbatch`` exports the submitter's environment); a sampler notes each process that carries
it (``/proc/PID/environ``, every 0.25 s), and Linux's process accounting (``acct(2)``, root only, system-wide
while it runs) gives each process's CPU at its exit. A process too short-lived for the sampler counts as its
parent does (pid and lifetime). Prints the run's CPU by kind: new interpreters vs children forked without
exec (the runtime's zygote), by their ancestry (``python>slurmstepd``: a Slurm job's rank;
``python>python>python``: a process a pytest worker started). Figures: docs/tests.md.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ACCT_V3 = "<BBHIIIIIIf8H16s"  # struct acct_v3 (linux/acct.h)
AFORK = 0x01  # forked, never exec'd
MARK = "SAILOR_CPU_RUN"
TEST_VAR = "PYTEST_CURRENT_TEST"  # pytest's name of the running test, inherited by what the test starts


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    btime: int  # start, epoch seconds
    etime: float  # lifetime, seconds
    cpu: float  # user + system, seconds
    forked: bool
    comm: str


def _comp(v: int) -> int:
    """comp_t: 13-bit mantissa, 3-bit base-8 exponent."""
    return (v & 0x1FFF) << (3 * (v >> 13))


def read_acct(path: Path) -> list[Proc]:
    data, size = path.read_bytes(), struct.calcsize(ACCT_V3)
    out = []
    for off in range(0, len(data) - size + 1, size):
        f = struct.unpack_from(ACCT_V3, data, off)
        out.append(Proc(pid=f[6], ppid=f[7], btime=f[8], etime=f[9] / 100, cpu=(_comp(f[10]) + _comp(f[11])) / 100,
                        forked=bool(f[0] & AFORK), comm=f[18].split(b"\0")[0].decode(errors="replace")))
    return out


def acct(path: Path | None) -> None:
    """Process accounting on (into ``path``) or off (``None``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(path).encode() if path else None) != 0:
        raise SystemExit(f"acct: {os.strerror(ctypes.get_errno())} (process accounting needs root)")


def program(cmdline: bytes) -> str:
    """What a process runs, in a few words: ``-m MODULE``, ``-c CODE...``, a script and its first two arguments."""
    args = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    if not args:
        return "?"
    for flag in ("-m", "-c"):
        if flag in args[1:-1]:
            i = args.index(flag)
            return f"{flag} {args[i + 1][:40] if flag == '-c' else args[i + 1]}"
    script = next((a for a in args[1:] if not a.startswith("-")), args[0]) if Path(args[0]).name.startswith(
        "python") else args[0]
    rest = args[args.index(script) + 1:] if script in args else []
    return " ".join([Path(script).name, *[a for a in rest if not a.startswith(("-", "/"))][:2]])


def test_file(current_test: str) -> str:
    """The test file of a ``PYTEST_CURRENT_TEST`` value (``tests/x.py::test (call)``), or "" outside a test."""
    return current_test.split("::", 1)[0]


def sample(run: str, seen: dict[tuple[int, int], tuple[str, str]], stop: threading.Event) -> None:
    """Note (pid, start second) and the program of every process whose environment carries this run's mark."""
    boot = next(int(x.split()[1]) for x in open("/proc/stat") if x.startswith("btime"))
    tick = os.sysconf("SC_CLK_TCK")
    known: set[tuple[int, int]] = set()
    needle = f"{MARK}={run}".encode()
    while not stop.is_set():
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                start = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[19])
                if (int(d), start) in known:
                    continue
                known.add((int(d), start))
                environ = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
                if needle in environ:
                    test = next((v[len(TEST_VAR) + 1:].decode(errors="replace") for v in environ
                                 if v.startswith(TEST_VAR.encode() + b"=")), "")
                    seen[(int(d), boot + start // tick)] = (program(open(f"/proc/{d}/cmdline", "rb").read()),
                                                            test_file(test))
            except OSError:
                continue
        stop.wait(0.25)


def report(procs: list[Proc], seen: dict[tuple[int, int], tuple[str, str]], root_pid: int) -> str:
    by_pid: dict[int, list[Proc]] = collections.defaultdict(list)
    for p in procs:
        by_pid[p.pid].append(p)

    def parent(p: Proc) -> Proc | None:
        return next((q for q in by_pid.get(p.ppid, []) if q is not p and q.btime - 1 <= p.btime <= q.btime + q.etime + 1),
                    None)

    memo: dict[int, bool] = {}

    def ours(p: Proc, depth: int = 0) -> bool:
        if id(p) not in memo:
            q = parent(p)
            memo[id(p)] = (p.pid == root_pid or any((p.pid, p.btime + dt) in seen for dt in (0, -1, 1))
                           or (q is not None and depth < 60 and ours(q, depth + 1)))
        return memo[id(p)]

    def chain(p: Proc) -> str:
        names: list[str] = []
        q: Proc | None = p
        while q is not None and len(names) < 3:
            names.append(q.comm)
            q = parent(q)
        return ">".join(names)

    mine = [p for p in procs if ours(p)]
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for p in mine:
        k = kinds[("forked " if p.forked else "new ") + chain(p)]
        k[0] += p.cpu
        k[1] += 1
    def is_python(p: Proc) -> bool:
        return p.comm.startswith("python") or p.comm == "sailor-hpc"

    python = [p for p in mine if is_python(p)]
    lines = [f"CPU of the run: {sum(p.cpu for p in mine):.0f} s in {len(mine)} processes; Python: "
             f"{sum(1 for p in python if not p.forked)} new interpreters "
             f"({sum(p.cpu for p in python if not p.forked):.0f} s), {sum(1 for p in python if p.forked)} forked "
             f"({sum(p.cpu for p in python if p.forked):.0f} s)", f"{'CPU s':>7} {'procs':>6}  kind>parent>grandparent"]
    for name, (cpu, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:20]:
        lines.append(f"{cpu:7.0f} {n:6d}  {name}")

    def noted(p: Proc) -> tuple[str, str] | None:
        return next((seen[(p.pid, p.btime + dt)] for dt in (0, -1, 1) if (p.pid, p.btime + dt) in seen), None)

    # the new interpreters by what they ran (a process the sampler never saw alive: "?"), and the run's
    # processes by the test file that started them (a short-lived one counts for its nearest noted ancestor)
    programs: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for p in mine:
        own = noted(p)
        note, q, depth = own, parent(p), 0
        while note is None and q is not None and depth < 60:
            note, q, depth = noted(q), parent(q), depth + 1
        if is_python(p) and not p.forked:
            k = programs[(own or ("?", ""))[0]]
            k[0] += p.cpu
            k[1] += 1
        k = files[(note or ("", ""))[1] or "(outside a test)"]
        k[0] += p.cpu
        k[1] += 1
    for title, table, top in (("new interpreters by program", programs, 25), ("processes by test file", files, 40)):
        lines += ["", f"{'CPU s':>7} {'procs':>6}  {title}"]
        for name, (cpu, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"{cpu:7.0f} {n:6d}  {name}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for acct.bin, seen.json and report.txt")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to measure")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to measure after --")
    args.out.mkdir(parents=True, exist_ok=True)
    run, stop = uuid.uuid4().hex, threading.Event()
    seen: dict[tuple[int, int], tuple[str, str]] = {}
    acct_file = args.out / "acct.bin"
    acct_file.write_bytes(b"")
    acct(acct_file)
    sampler = threading.Thread(target=sample, args=(run, seen, stop), daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(command, env={**os.environ, MARK: run})
        rc = proc.wait()
    finally:
        time.sleep(1)  # the last exits' records
        acct(None)
        stop.set()
    (args.out / "seen.json").write_text(json.dumps(sorted([pid, t, *what] for (pid, t), what in seen.items())))
    text = f"{' '.join(command)}: exit {rc}, {time.monotonic() - t0:.0f} s wall\n" + report(
        read_acct(acct_file), seen, proc.pid)
    (args.out / "report.txt").write_text(text + "\n")
    print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
