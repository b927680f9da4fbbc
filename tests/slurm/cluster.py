"""The local test Slurm cluster (tests/slurm/start.sh) as a Python object, for the pytest fixture.

``get_cluster()`` reuses a running lab named by ``SAILOR_SLURM_LAB`` (never stopping it), or
installs the packages (install.sh) and starts a fresh cluster in a new temporary lab directory
on free ports (start.sh), which ``SlurmCluster.stop()`` stops again by PID (stop.sh).
Problems raise :class:`ClusterUnavailable` with a reason a person can act on.

Environment:
  SAILOR_SLURM_LAB=<dir>    reuse the cluster running in <dir> (started by hand with start.sh)
  SAILOR_SKIP_SLURM=1       do not try to start a cluster (tests that need one are skipped)
  SAILOR_REQUIRE_SLURM=1    (read by conftest) a cluster that cannot start fails the tests
  SAILOR_SLURM_KEEP=1       leave the cluster that the tests started running at the end
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
INSTALL_SH = HERE / "install.sh"
START_SH = HERE / "start.sh"
STOP_SH = HERE / "stop.sh"
# Several labs run side by side (pytest-xdist workers, two sessions): each takes a free *slot* i, which gives
# it the daemon ports DEFAULT_PORT_BASE + 200 i + PORT_OFFSETS and the job ids from 1 + JOB_ID_SLOT i on
# (FirstJobId, as on a big site whose ids are large). A job's rendezvous port follows from its id
# (sailor_hpc.core.dist_env.job_port: 20000 + id % 12000), so two labs that both numbered from 1 would meet on
# one port; slots keep every lab's ids apart modulo 12000 (10 slots of 1200), and the daemons' ports below
# 20000, out of every job's rendezvous range. Slot 0 is start.sh's defaults (a lab started by hand, numbering
# from 1 as labs did before slots): the tests' labs take slots 1 to 9.
DEFAULT_PORT_BASE = 16800
PORT_OFFSETS = (6, 17, 19, 101, 102, 103, 104)   # mariadbd, slurmctld, slurmdbd, 4 x slurmd (see start.sh)
LAB_SLOTS = 10
JOB_ID_SLOT = 1200
PORT_LOCK = Path(tempfile.gettempdir()) / "sailor-slurm-ports.lock"
# variables of an enclosing Slurm job that would confuse the clients of this cluster
_JOB_VARS = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTERS", "SLURM_CONF")


class ClusterUnavailable(Exception):
    """The test cluster cannot be used here; the message says why and what to do."""


OPERATOR = "nobody"  # the Slurm operator of SlurmCluster.as_operator: another user than the tests'


@dataclass
class SlurmCluster:
    lab: Path
    env: dict[str, str]
    started_here: bool
    remove_lab: bool = False          # delete the lab directory after a clean stop (temporary labs)
    start_seconds: float | None = None
    stop_seconds: float | None = None
    _stopped: bool = field(default=False, repr=False)
    _operator: bool = field(default=False, repr=False)

    @property
    def slurm_conf(self) -> Path:
        return self.lab / "etc" / "slurm.conf"

    @property
    def shared(self) -> Path:
        """A directory to submit jobs from (jobs run in the submit directory)."""
        return self.lab / "shared"

    def run(self, cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """``subprocess.run`` with this cluster's environment; text output captured, cwd = ``shared``.

        Keyword arguments override the defaults (``check=False``, ``timeout=120``); ``env`` given
        here is laid over the cluster environment.
        """
        extra = kw.pop("env", None)
        env = dict(self.env)
        if extra:
            env.update(extra)
        kw.setdefault("cwd", self.shared)
        kw.setdefault("timeout", 120)
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(list(cmd), env=env, **kw)

    def as_operator(self, cmd: Sequence[str]) -> subprocess.CompletedProcess:
        """A Slurm client command run as a Slurm operator who is not the tests' user (``OPERATOR``, made one in
        accounting on first use): another user's ``scancel``, as an administrator's or a site's tooling's is.
        Needs root and setpriv (util-linux), as the tests that use it check."""
        setpriv = shutil.which("setpriv")
        if setpriv is None or os.geteuid() != 0:
            raise ClusterUnavailable("running a command as another user needs root and setpriv (util-linux)")
        if not self._operator:
            for args in (["add", "user", OPERATOR, "account=root"], ["modify", "user", OPERATOR, "set",
                                                                     "adminlevel=operator"]):
                self.run(["sacctmgr", "-i", *args])
            self._operator = True
        return self.run([setpriv, "--reuid", OPERATOR, "--regid", "nogroup", "--clear-groups", *cmd])

    # -- small conveniences for tests ----------------------------------------------------------------

    @contextlib.contextmanager
    def slurmctld_stopped(self) -> Iterator[float]:
        """slurmctld stopped (SIGTERM by PID: it saves its state) for the block, then started again; yields
        the wall time it was gone. Running jobs keep running on their slurmd meanwhile, as on a real site
        whose controller restarts; clients get "Unable to contact slurm controller" after ~10 s."""
        pid_file = self.lab / "run" / "slurmctld.pid"
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _alive(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurmctld pid {pid} still alive 30 s after SIGTERM")
            time.sleep(0.05)
        try:
            yield time.time()
        finally:
            proc = self.run(["slurmctld"], cwd=self.lab)
            if proc.returncode != 0:
                raise RuntimeError(f"slurmctld did not start again: {proc.stderr.strip()}")
            deadline = time.monotonic() + 60
            while self.run(["scontrol", "ping"]).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("slurmctld does not answer 60 s after it was started again")
                time.sleep(0.1)
            new_pid = pid_file.read_text().split()[0]
            pids = self.lab / "pids"  # stop.sh stops the daemons it finds there, by PID
            if pids.exists():
                lines = [f"slurmctld {new_pid}" if line.split()[:1] == ["slurmctld"] else line
                         for line in pids.read_text().splitlines()]
                pids.write_text("\n".join(lines) + "\n")

    def sbatch(self, args: Sequence[str], script: str | None = None) -> str:
        """Submit (``sbatch --parsable ARGS``, script text on stdin if given); returns the job id."""
        proc = self.run(["sbatch", "--parsable", *args], input=script)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def job_states(self, job_id: str) -> list[str]:
        """``squeue -t all`` states of a job (one per het component); [] once slurmctld forgot it."""
        proc = self.run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T"])
        return proc.stdout.split() if proc.returncode == 0 else []

    def wait_job(self, job_id: str, timeout: float = 60.0) -> list[str]:
        """Wait until every component of the job reached a final state; returns the states."""
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                 "BOOT_FAIL", "DEADLINE"}
        deadline = time.monotonic() + timeout
        states: list[str] = []
        while time.monotonic() < deadline:
            states = self.job_states(job_id)
            if states and all(s in final for s in states):
                return states
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} not finished after {timeout} s (states {states})")

    def sacct_once(self, args: Sequence[str], settled: Callable[[str], bool], timeout: float = 60.0) -> str:
        """``sacct ARGS`` output once ``settled(output)`` holds, or as it stands after ``timeout`` seconds.

        slurmctld sends accounting to slurmdbd in the background, so sacct can lag squeue and the controller's
        journal by seconds (more so after a slurmctld restart, or on a loaded machine)."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.run(["sacct", *args])
            if proc.returncode != 0:
                raise RuntimeError(f"sacct {' '.join(args)} failed: {proc.stderr.strip()}")
            if settled(proc.stdout) or time.monotonic() > deadline:
                return proc.stdout
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the cluster if this process started it (by PID, via stop.sh); idempotent."""
        if self._stopped or not self.started_here:
            return
        self._stopped = True
        if os.environ.get("SAILOR_SLURM_KEEP") == "1":
            print(f"\nSAILOR_SLURM_KEEP=1: cluster left running; use it with SAILOR_SLURM_LAB={self.lab}, "
                  f"stop it with: bash {STOP_SH} {self.lab}", file=sys.stderr)
            return
        t0 = time.monotonic()
        proc = subprocess.run(["bash", str(STOP_SH), str(self.lab)], capture_output=True, text=True, timeout=120)
        self.stop_seconds = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"stop.sh {self.lab} failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        if self.remove_lab:
            shutil.rmtree(self.lab, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- helpers

def cluster_env(lab: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for clients of the cluster in ``lab`` (and for ``sailor-hpc`` subprocesses)."""
    env = {k: v for k, v in (base if base is not None else os.environ).items() if k not in _JOB_VARS}
    env["SLURM_CONF"] = str(lab / "etc" / "slurm.conf")
    env["SAILOR_SLURM_LAB"] = str(lab)
    # the venv's bin (sailor-hpc console script, python) first; /usr/sbin for the Slurm daemons
    path = [str(Path(sys.executable).parent), *env.get("PATH", os.defpath).split(os.pathsep), "/usr/bin", "/usr/sbin"]
    seen: list[str] = []
    for p in path:
        if p and p not in seen:
            seen.append(p)
    env["PATH"] = os.pathsep.join(seen)
    return env


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def lab_is_running(lab: Path) -> tuple[bool, str]:
    """Whether ``lab`` holds a running cluster started by start.sh (and why not)."""
    lab = Path(lab)
    if not (lab / "etc" / "slurm.conf").is_file():
        return False, f"{lab}/etc/slurm.conf does not exist"
    pids_file = lab / "pids"
    try:
        entries = [line.split() for line in pids_file.read_text().splitlines() if line.strip()]
    except OSError:
        return False, f"{pids_file} does not exist"
    dead = [name for name, pid, *_ in entries if not _alive(int(pid))]
    if not entries or dead:
        return False, f"daemons not running in {lab}: {', '.join(dead) or 'none recorded'}"
    env = cluster_env(lab)
    try:
        ping = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"scontrol ping failed: {exc}"
    if "is UP" not in ping.stdout:
        return False, f"slurmctld of {lab} does not answer: {ping.stdout.strip()} {ping.stderr.strip()}"
    return True, "running"


def _ports_free(base: int) -> bool:
    for off in PORT_OFFSETS:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # like the daemons: a port only in TIME_WAIT (a cluster stopped just before) is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", base + off))
            except OSError:
                return False
    return True


def choose_slot(preferred: int = DEFAULT_PORT_BASE, slots: int = LAB_SLOTS) -> int:
    """The first lab slot whose ports are free (a running lab holds its slot's ports; call under PORT_LOCK)."""
    for i in range(1, slots):
        if _ports_free(preferred + 200 * i):
            return i
    raise ClusterUnavailable(f"no free lab slot: the TCP ports of slots 1 to {slots - 1} from {preferred} on are taken "
                             f"(other test clusters running?)")


def _tail(text: str, n: int = 3000) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def install_packages(timeout: float = 600) -> None:
    if shutil.which("bash") is None:
        raise ClusterUnavailable("bash not found")
    try:
        proc = subprocess.run(["bash", str(INSTALL_SH)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterUnavailable(f"{INSTALL_SH} did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise ClusterUnavailable(f"installing the Slurm packages failed (tests/slurm/install.sh exit "
                                 f"{proc.returncode}): {_tail(proc.stderr or proc.stdout, 1500)}")


def start_cluster(lab: Path | None = None, port_base: int | None = None, install: bool = True, *,
                  join: SlurmCluster | None = None, name: str = "lab") -> SlurmCluster:
    """Install the packages if needed and start a fresh cluster (new temporary lab unless given); with
    ``join``, a second cluster ``name`` that uses ``join``'s munged and slurmdbd (multi-cluster)."""
    if sys.platform != "linux":
        raise ClusterUnavailable(f"the local Slurm test cluster needs Linux (this is {sys.platform})")
    if os.geteuid() != 0:
        raise ClusterUnavailable("the local Slurm test cluster needs root (apt-get install, mknod of fake GPU "
                                 "devices, daemons running as root); run the tests as root, or start one with "
                                 "tests/slurm/start.sh and point SAILOR_SLURM_LAB at it")
    if install:
        install_packages()
    temporary = lab is None
    lab = Path(lab) if lab is not None else Path(tempfile.mkdtemp(prefix="sailor-slurm-lab-"))
    lab.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    PORT_LOCK.touch(exist_ok=True)
    with open(PORT_LOCK) as lock:       # two test sessions starting at once must not pick the same ports
        fcntl.flock(lock, fcntl.LOCK_EX)
        slot = choose_slot() if port_base is None else 0
        base = port_base if port_base is not None else DEFAULT_PORT_BASE + 200 * slot
        env = {**os.environ, "SAILOR_SLURM_PORT_BASE": str(base), "SAILOR_SLURM_CLUSTER_NAME": name}
        if join is not None:    # job ids as the first cluster's (start.sh reads them there): ids are per cluster
            env["SAILOR_SLURM_JOIN"] = str(join.lab)
            env["SAILOR_SLURM_PARTITION_SUFFIX"] = f"_{name}"
        else:
            env["SAILOR_SLURM_FIRST_JOB_ID"] = str(1 + JOB_ID_SLOT * slot)
        for k in _JOB_VARS:
            env.pop(k, None)
        try:
            proc = subprocess.run(["bash", str(START_SH), str(lab)], env=env, capture_output=True, text=True,
                                  timeout=180)
        except subprocess.TimeoutExpired:
            subprocess.run(["bash", str(STOP_SH), str(lab)], capture_output=True, timeout=120)
            raise ClusterUnavailable(f"tests/slurm/start.sh {lab} did not finish within 180 s") from None
    if proc.returncode != 0:
        if temporary:      # start.sh already stopped what it started; its log tails are in the message
            shutil.rmtree(lab, ignore_errors=True)
        raise ClusterUnavailable(f"tests/slurm/start.sh {lab} failed (exit {proc.returncode}): "
                                 f"{_tail(proc.stderr + proc.stdout)}")
    cluster = SlurmCluster(lab=lab, env=cluster_env(lab), started_here=True,
                           remove_lab=temporary, start_seconds=time.monotonic() - t0)
    atexit.register(_stop_quietly, cluster)   # also when the session dies before fixture teardown
    return cluster


def _stop_quietly(cluster: SlurmCluster) -> None:
    try:
        cluster.stop()
    except Exception:   # noqa: BLE001 - at exit, nothing left to report to
        pass


def get_second_cluster(first: SlurmCluster, name: str = "lab2") -> SlurmCluster:
    """A second cluster ``name`` (partitions a100_NAME and v100_NAME, same fake nodes) sharing ``first``'s
    slurmdbd: always started fresh (packages are there), stopped before ``first`` (it needs its munged)."""
    if os.environ.get("SAILOR_SKIP_SLURM") == "1":
        raise ClusterUnavailable("SAILOR_SKIP_SLURM=1")
    return start_cluster(install=False, join=first, name=name)


def get_cluster() -> SlurmCluster:
    """The cluster for this test session: a running SAILOR_SLURM_LAB, or a freshly started one."""
    external = os.environ.get("SAILOR_SLURM_LAB")
    if external:
        lab = Path(external).resolve()
        ok, why = lab_is_running(lab)
        if not ok:
            raise ClusterUnavailable(f"SAILOR_SLURM_LAB={external} is not a running cluster ({why}); start it with "
                                     f"tests/slurm/start.sh {external}, or unset SAILOR_SLURM_LAB")
        return SlurmCluster(lab=lab, env=cluster_env(lab), started_here=False)
    if os.environ.get("SAILOR_SKIP_SLURM") == "1":
        raise ClusterUnavailable("SAILOR_SKIP_SLURM=1")
    return start_cluster()
