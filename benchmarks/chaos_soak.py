"""A longer chaos soak on the local Slurm cluster (tests/controller/chaos.py; ``make test`` runs a small one):
a seeded random sequence of faults while tiny-gpt trains under ``sailor-hpc run``, each injected once the run
handled the one before; then the run is stopped and compared with the uninterrupted reference run to the same step.

Prints, per fault, how long the run took to answer it and train past a checkpoint saved after it, the
controller's own recovery time where the fault moved the run, and the jobs used; then the steps trained (and
trained twice, after rollbacks) and the largest parameter and Adam-moment difference from the reference.

Run: ``python benchmarks/chaos_soak.py [--seed 7] [--faults 7] [--workdir DIR] [--mixed]`` (as root, with setpriv: an
operator's cancel runs scancel as another user; it starts a local cluster, or uses SAILOR_SLURM_LAB's).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sailor_hpc.core.checkpoint import step_dir  # noqa: E402
from tests.controller.chaos import FAULTS, Soak, describe, final_step, step_account  # noqa: E402
from tests.controller.scenario import Scenario, build_inputs, one_gpu_site, start_reference  # noqa: E402
from tests.slurm.cluster import get_cluster  # noqa: E402

TOLERANCE = 5e-6  # as the tests: the reference and the runs differ only in reduction order


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--faults", type=int, default=len(FAULTS), help=f"how many (kinds: {', '.join(FAULTS)})")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the run here (journal: WORKDIR/run)")
    ap.add_argument("--mixed", action="store_true",
                    help="one GPU per node, a100-2 held from the start: the run trains 1 A100 + 2 V100 as a bundle "
                         "of one job per het component, and every fault meets that bundle")
    args = ap.parse_args(argv)
    from tests.megatron_patch.conftest import max_diff
    cluster = get_cluster()
    with tempfile.TemporaryDirectory(prefix="chaos-soak-") as tmp:
        root = args.workdir.absolute() if args.workdir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        data, archive = build_inputs(None, root)
        if args.mixed:
            sc = Scenario(cluster, root, data, archive, steps=1_000_000, save_interval=5, site=one_gpu_site(root),
                          extra_args=["--max-gpus", "3", "--min-gain", "1%", "--restart-cost", "0"])
            soak = Soak(sc, args.seed, hold=("a100-2",))
        else:
            sc = Scenario(cluster, root, data, archive, steps=1_000_000, save_interval=5)
            soak = Soak(sc, args.seed)
        try:
            results = soak.run(args.faults)
            step = final_step(sc)
            seen, twice = step_account(sc.save)
        finally:
            sc.cleanup()
            cluster.stop()
        reference = start_reference(root, data, step)
        if reference.wait(timeout=1800) != 0:
            print((root / "reference.log").read_text()[-3000:], file=sys.stderr)
            return 1
        final = step_dir(sc.save, step)
        diff = max_diff(final, root / "ref" / f"ref_step_{step}.pt")
    print(describe(results, args.seed))
    skipped = sorted(set(range(1, step + 1)) - seen)
    print(f"steps: {step} trained, {len(twice)} twice after rollbacks, {len(skipped)} skipped")
    print("max |delta| vs the uninterrupted reference: " + ", ".join(f"{k} {v:.2e}" for k, v in diff.items()))
    ok = not skipped and all(v <= TOLERANCE for v in diff.values())
    print("result: " + ("every fault survived, parameters equal the reference" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
