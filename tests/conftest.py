"""Project-wide pytest setup: the ``slurm`` marker and the session-scoped ``slurm_cluster`` fixture.

``slurm_cluster`` starts a real local Slurm cluster (tests/slurm/start.sh: partitions a100 and
v100 with fake GPUs, slurmdbd for sacct) on first use and stops it, by PID, at the end of the
session; it reuses a running one named by ``SAILOR_SLURM_LAB`` without stopping it. Where no
cluster can be started (not root, no apt, ...) the tests using it are skipped with the reason,
or fail when ``SAILOR_REQUIRE_SLURM=1``. See tests/slurm/cluster.py for the other variables.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from tests.data import SITE_CONFIGS
from tests.fuzz.harness import CASES, REFUSED
from tests.slurm.cluster import ClusterUnavailable, SlurmCluster, get_cluster, get_second_cluster


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: needs the real local Slurm test cluster (fixture slurm_cluster)")


# the longest files, longest first (seconds of test time per file in a `make test` run, summed from
# `pytest --durations=80`: docs/tests.md): under pytest-xdist (make test) they start first, each on a worker of
# its own, so that no worker begins one of them while the others run out of work (tests/longest_first.py)
LONG_FILES = (
    "tests/profiler/test_profile_sweep.py", "tests/controller/test_resize_cluster.py",
    "tests/controller/test_startable_cluster.py", "tests/controller/test_lifecycle_cluster.py",
    "tests/controller/test_deepspeed_run_cluster.py", "tests/controller/test_time_run_cluster.py",
    "tests/test_readme_walkthrough.py", "tests/controller/test_chaos_soak_cluster.py",
    "tests/controller/test_inplace_cluster.py", "tests/controller/test_quiet_logs_cluster.py",
    "tests/controller/test_cosched_clusters.py", "tests/controller/test_slurm_outage_cluster.py",
    "tests/slurm/test_site_states_cluster.py", "tests/planner/test_planner.py", "tests/test_gpu_check.py",
    "tests/deepspeed/test_ds_runtime.py", "tests/megatron_patch/test_checkpoint_faults.py",
    "tests/controller/test_geo_outage_cluster.py", "tests/profiler/test_local_sweep.py",
    "tests/jobs/test_container_cluster.py", "tests/megatron_patch/test_init_weights.py",
    "tests/megatron_patch/test_hf_llama.py", "tests/cli/test_site_doctor_cluster.py", "tests/jobs/test_slurm_jobs.py",
    "tests/deepspeed/test_pipeline_memory.py", "tests/profiler/test_sweep_stops_cluster.py",
    "tests/megatron_patch/test_precision.py", "tests/slurm/test_start_estimate.py", "tests/slurm/test_slurm_errors.py",
)

# the files whose time is mostly waits on Slurm's clock (reservations, time limits, blockers ending), with little
# CPU of their own: with 4 workers or more, the last one runs only these (tests/longest_first.py)
WAITING_FILES = (
    "tests/slurm/test_site_states_cluster.py", "tests/controller/test_startable_cluster.py",
    "tests/controller/test_time_run_cluster.py", "tests/slurm/test_start_estimate.py",
)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201 - pytest-xdist's hook
    """``--dist loadfile`` in the workers' order (LONG_FILES first), not xdist's by-test-count order."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.longest_first import LongestFirst
    return LongestFirst(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # a test that uses the fixture is a slurm test, marked or not (so `-m "not slurm"` leaves it out)
    for item in items:
        names = getattr(item, "fixturenames", ())
        if {"slurm_cluster", "slurm_two_clusters"} & set(names) and item.get_closest_marker("slurm") is None:
            item.add_marker(pytest.mark.slurm)
    if hasattr(config, "workerinput"):   # a pytest-xdist worker (every worker sorts alike); serial runs keep the order
        rank = {f: i for i, f in enumerate(LONG_FILES)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_sessionfinish(session: pytest.Session) -> None:
    # a pytest-xdist worker hands its fuzz counts to the controller, which prints the summary
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["fuzz"] = {"cases": dict(CASES), "refused": dict(REFUSED)}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ANN001 - pytest-xdist's hook (a WorkerController)
    fuzz = getattr(node, "workeroutput", {}).get("fuzz") or {}
    for name, n in fuzz.get("cases", {}).items():
        CASES[name] = CASES.get(name, 0) + n
    for name, n in fuzz.get("refused", {}).items():
        REFUSED[name] = REFUSED.get(name, 0) + n


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """``fuzz: site TOML 250 cases (201 refused), ...``: the mutated inputs each loader met in this session, and
    how many it refused (the rest loaded: a suite of only refusals would test the first check alone)."""
    if CASES:
        counts = ", ".join(f"{name} {n} cases ({REFUSED.get(name, 0)} refused)" for name, n in CASES.items())
        terminalreporter.write_line(f"fuzz: {counts}; {sum(CASES.values())} in all")


def slurm_missing(reason: str, *, module: bool = False) -> NoReturn:
    """Skip a test (``module``: a whole test module) for a part this machine lacks that CI installs (Slurm,
    the runtime and DeepSpeed extras), with ``reason``; under ``SAILOR_REQUIRE_SLURM=1`` (CI) fail it
    instead, so a broken set-up cannot pass as skips."""
    if os.environ.get("SAILOR_REQUIRE_SLURM") == "1":
        pytest.fail(f"{reason} (SAILOR_REQUIRE_SLURM=1)", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


_SESSION_LABS: list[SlurmCluster] = []  # the session's lab, once a test started it
LEFT_JOB_GRACE_S = 10.0  # how long a job a test file cancelled may take to leave the queue before it counts as left


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The running test cluster: ``.lab``, ``.env`` (SLURM_CONF, PATH, ...), ``.run([...])``. Its jobs' ranks
    fork from this session's fork server (``megatron_patch.fork_server``) unless ``SAILOR_FORK_RANKS=0``."""
    try:
        cluster = get_cluster()
    except ClusterUnavailable as exc:
        slurm_missing(f"no local Slurm test cluster: {exc}")
    _SESSION_LABS.append(cluster)
    try:
        with contextlib.nullcontext() if os.environ.get("SAILOR_FORK_RANKS") == "0" else fork_server(
                tmp_path_factory, cluster.env):
            yield cluster
    finally:
        _SESSION_LABS.remove(cluster)
        cluster.stop()


@pytest.fixture(scope="module", autouse=True)
def lab_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test file, the session lab as every file expects to find it: its nodes up and no job left. A
    file that leaves a node down or drained, or a job, has a clean-up to mend: it is named in a warning (the
    run's warnings summary), and the lab is put back, so that its leftovers do not fail the files after it."""
    yield
    for cluster in _SESSION_LABS:
        nodes = cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split("\n")
        taken = sorted({n for n, _, st in (line.partition(" ") for line in nodes if line.strip())
                        if st.rstrip("*~#!%$@^-").lower() in ("down", "drain", "drng", "fail", "failg")})
        jobs = cluster.run(["squeue", "-h", "-o", "%i %j"]).stdout.split()
        deadline = time.monotonic() + LEFT_JOB_GRACE_S  # jobs the file cancelled take a moment to end
        while jobs and time.monotonic() < deadline:
            time.sleep(0.5)
            jobs = cluster.run(["squeue", "-h", "-o", "%i %j"]).stdout.split()
        if not taken and not jobs:
            continue
        for node in taken:
            cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"])
        for job in jobs[::2]:
            cluster.run(["scancel", job])
        warnings.warn(f"{request.module.__name__} left the lab with nodes {taken or 'up'} and jobs "
                      f"{' '.join(jobs) or 'none'}: put back", stacklevel=1)


@contextlib.contextmanager
def ranks_as_new_interpreters(cluster: SlurmCluster) -> Iterator[None]:
    """The jobs submitted with ``cluster.env`` meanwhile start their ranks as on a real site: no fork server."""
    from megatron_patch.fork_server import FORK_SERVER_ENV

    server = cluster.env.pop(FORK_SERVER_ENV, None)
    try:
        yield
    finally:
        if server is not None:
            cluster.env[FORK_SERVER_ENV] = server


@contextlib.contextmanager
def fork_server(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Iterator[Path]:
    """A fork server for the ranks of the jobs submitted with ``env`` (and of ``tests/slurm/ranks.py``'s look-ups:
    this process's environment names it too), stopped at the end."""
    from megatron_patch.fork_server import FORK_SERVER_ENV

    path = tmp_path_factory.mktemp("fork-server") / "socket"
    log = open(path.with_name("server.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "megatron_patch.fork_server", str(path)], stdin=subprocess.PIPE,
                              stdout=log, stderr=log, env=env)
    deadline = time.monotonic() + 60
    while not path.exists() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not path.exists():
        server.kill()
        log.close()
        raise RuntimeError(f"the fork server did not start (exit {server.wait()}): "
                           f"{path.with_name('server.log').read_text()[-2000:]}")
    before = os.environ.get(FORK_SERVER_ENV)  # the session's, around a test module's own server
    env[FORK_SERVER_ENV] = os.environ[FORK_SERVER_ENV] = str(path)
    try:
        yield path
    finally:
        env.pop(FORK_SERVER_ENV, None)
        if before is None:
            os.environ.pop(FORK_SERVER_ENV, None)
        else:
            os.environ[FORK_SERVER_ENV] = before
        assert server.stdin is not None
        server.stdin.close()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture(scope="session")
def slurm_two_clusters(slurm_cluster: SlurmCluster) -> Iterator[tuple[SlurmCluster, SlurmCluster]]:
    """Two clusters on this machine, ``lab`` (the session's) and ``lab2`` (partitions a100_lab2 and v100_lab2, own slurmctld,
    slurmd, ports and state; the first one's munged and slurmdbd, so ``sacctmgr`` knows both)."""
    try:
        second = get_second_cluster(slurm_cluster)
    except ClusterUnavailable as exc:
        slurm_missing(f"no second local Slurm test cluster: {exc}")
    try:
        yield slurm_cluster, second
    finally:
        second.stop()


@pytest.fixture()
def lab_site(tmp_path: Path) -> Path:
    """A private copy of local-lab.toml that tests may edit."""
    dst = tmp_path / "site.toml"
    shutil.copy(SITE_CONFIGS / "local-lab.toml", dst)
    return dst


@pytest.fixture(scope="session")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An interpreter with no package installed (a venv without pip or site packages): the interpreter a user
    may pass by mistake, on any machine (the system's python may have torch or submitit)."""
    venv = tmp_path_factory.mktemp("bare-venv")
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True, timeout=120)
    return venv / "bin" / "python"
