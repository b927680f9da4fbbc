"""Our simulator against Sailor's on Sailor's measured runs: error per file and the means per set.

Sailor's estimates are the reference numbers of its own simulator on these files
(the project's reference notes on Sailor, section 4.3, full-precision list). Files kept out of our means
(documented anomalies, physically impossible memory readings) are kept out of Sailor's too, with the
reason printed; Sailor's mean over every file is shown as well. Every run is simulated as DeepSpeed's
pipeline engine ran it (``SimOptions.deepspeed_pipe()``).

The second table is the generalisation check: the two constants estimated from these runs
(:mod:`simulator.calibration`: replica jitter, allocator slack) re-estimated by their procedure from all
runs (in-sample) and from all runs but the one scored (leave-one-out), errors side by side.

    .venv/bin/python benchmarks/simulator_accuracy.py [--data DIR]  (default: the copy shipped in sailor_hpc/core/data/sailor)
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from pathlib import Path

from sailor_hpc.core.archive import ProfileArchive, open_archive
from sailor_hpc.core.sailor_compat import SAILOR_DATA
from sailor_hpc.core.site import Site, load_site
from simulator import SimOptions
from simulator.calibration import jitter_estimate, median_without, slack_estimate, with_jitter
from simulator.validation import ValidationReport, ValidationRow, find_runs, validate_file, validate_runs

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = SAILOR_DATA  # shipped with the package

# (set, site config, model, folder under validation/)
SETS = [("clariden/OPT-350", "clariden.toml", "OPT-350M", "clariden/OPT-350"),
        ("clariden/GPT-NEO", "clariden.toml", "GPT-Neo-2.7B", "clariden/GPT-NEO"),
        ("mit", "mit-mixed.toml", "OPT-350M", "mit")]

# Sailor's simulator on each file: (seconds per iteration, peak bytes), reference section 4.3
SAILOR = {
    "clariden/GPT-NEO/N16/plan_config_N16_D4.json": (6.4406416482, 35700923648),
    "clariden/GPT-NEO/N32/plan_config_N32_D16.json": (3.1690155748, 42564629760),
    "clariden/GPT-NEO/N4/plan_config_N4_D1.json": (2.3253908873, 15908494592),
    "clariden/GPT-NEO/N8/plan_config_N8_D4.json": (11.8135139437, 42564629760),
    "clariden/OPT-350/N1/plan_config_N1_D1_M4_G1.json": (0.0829590000, 10394447104),
    "clariden/OPT-350/N1/plan_config_N1_D1_M4_G32.json": (2.6408310000, 10394447104),
    "clariden/OPT-350/N16/plan_config_N16_D16.json": (1.8836671720, 30307358976),
    "clariden/OPT-350/N16/plan_config_N16_D4.json": (2.3032628996, 23913287936),
    "clariden/OPT-350/N16/plan_config_N16_D8.json": (2.2077434235, 25593245952),
    "clariden/OPT-350/N2/plan_config_N2_D1.json": (0.6248823881, 25593245952),
    "clariden/OPT-350/N2/plan_config_N2_D2.json": (0.7271154107, 13239148800),
    "clariden/OPT-350/N32/plan_config_N32_D16.json": (1.1668914576, 25593245952),
    "clariden/OPT-350/N32/plan_config_N32_D32.json": (0.9639720257, 30307358976),
    "clariden/OPT-350/N32/plan_config_N32_D8.json": (1.2436617477, 23913287936),
    "clariden/OPT-350/N4/plan_config_N4_D1.json": (1.5711832663, 7880249600),
    "clariden/OPT-350/N4/plan_config_N4_D2.json": (1.5230135232, 8671691008),
    "clariden/OPT-350/N4/plan_config_N4_D4.json": (1.0366874845, 18928552192),
    "clariden/OPT-350/N8/plan_config_N8_D2.json": (2.3000607076, 23913287936),
    "clariden/OPT-350/N8/plan_config_N8_D4.json": (2.2044977955, 25593245952),
    "mit/N2/plan_config_N2_D1.json": (120.9518126900, 15917172992),
    "mit/N2/plan_config_N2_D2.json": (81.3149802595, 20105208064),
    "mit/N4/plan_config_N4_D1.json": (81.4365654593, 8144684288),
    "mit/N4/plan_config_N4_D4.json": (65.9878998257, 9800352000),
    "mit/N6/plan_config_N6_D6.json": (51.4405985261, 9800352000),
}


def _err(est: float | None, real: float | None) -> float | None:
    return None if est is None or real is None else abs(est - real) / real * 100


def _tally(acc: dict[str, list[float]], what: str, excluded: str | None, ours: float | None,
           sailor: float | None) -> str:
    """Add one file's errors to the lists the means use; return the exclusion note (or "")."""
    if sailor is not None:
        acc["sailor_all"].append(sailor)
    if excluded:
        return f"{what} excluded: {excluded}"
    if ours is not None:
        acc["ours"].append(ours)
        if sailor is not None:
            acc["sailor"].append(sailor)
    return ""


def _mean(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):5.1f}" if xs else "    -"


def validation_dir(doc: str) -> Path:
    """The ``validation/`` folder of the Sailor data named by ``--data`` (the benchmarks' one option)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA, help="Sailor's data directory (with validation/)")
    return Path(ap.parse_args().data) / "validation"


def set_reports(val: Path) -> Iterator[tuple[str, ValidationReport]]:
    """Each set's validation report on the embedded archive, in :data:`SETS` order."""
    archive = open_archive()
    for name, site_file, model, folder in SETS:
        yield name, validate_runs([val / folder], load_site(ROOT / "site_configs" / site_file), model, archive)


def _rescored(path: Path, site: Site, model: str, archive: ProfileArchive, jitter: float | None,
              slack: float | None) -> ValidationRow:
    """One run scored with the two estimated constants set (None: no estimate, the shipped value)."""
    if jitter is not None:
        site = with_jitter(site, max(0.0, jitter))  # a spread cannot be negative
    options = SimOptions.deepspeed_pipe(**({} if slack is None else {"allocator_slack": slack}))
    return validate_file(path, site, model, archive, options)


def generalisation(val: Path, reports: dict[str, ValidationReport]) -> None:
    """Print in-sample and leave-one-out errors of the constants estimated from the runs themselves."""
    archive = open_archive()
    sites = {f: load_site(ROOT / "site_configs" / f) for _, f, _, _ in SETS}
    runs = [(name, site_file, model, path) for name, site_file, model, folder in SETS for path in find_runs([val / folder])]
    jitter = {site_file: {str(p): jitter_estimate(p, sites[site_file], model, archive)
                          for _, f, model, p in runs if f == site_file} for site_file in sites}
    slack = {r.file: slack_estimate(r.result, r.real_mem_bytes) for rep in reports.values() for r in rep.rows
             if r.result is not None and r.real_mem_bytes is not None and not r.mem_excluded}
    print("\nconstants estimated from these runs (simulator.calibration), in-sample = from every run:")
    for site_file, est in jitter.items():
        print(f"  replica_jitter {site_file:16s} shipped {max(p.replica_jitter for p in sites[site_file].partitions):6.2%}"
              f"  in-sample {max(0.0, median_without(est) or 0.0):6.2%}  ({sum(v is not None for v in est.values())} runs)")
    print(f"  allocator_slack (every site)    shipped {SimOptions().allocator_slack:6.2%}  in-sample "
          f"{median_without(slack) or 0.0:6.2%}  ({len(slack)} runs)")
    print(f"\n{'set':18s} {'time: shipped':>13s} {'in-sample':>9s} {'LOO':>6s}   {'memory: shipped':>15s} {'in-sample':>9s}"
          f" {'LOO':>6s}   mean |error| %")
    for name, site_file, model, _ in SETS:
        cols: dict[str, list[list[float]]] = {"in": [[], []], "loo": [[], []]}  # time, memory errors
        for path in (p for n, _, _, p in runs if n == name):
            key = str(path)
            for label, j, sl in (("in", median_without(jitter[site_file]), median_without(slack)),
                                 ("loo", median_without(jitter[site_file], key), median_without(slack, key))):
                row = _rescored(path, sites[site_file], model, archive, j, sl)
                if row.time_err_pct is not None and not row.time_excluded:
                    cols[label][0].append(row.time_err_pct)
                if row.mem_err_pct is not None and not row.mem_excluded:
                    cols[label][1].append(row.mem_err_pct)
        rep = reports[name]
        print(f"{name:18s} {_mean(rep.time_errors()):>13s} {_mean(cols['in'][0]):>9s} {_mean(cols['loo'][0]):>6s}   "
              f"{_mean(rep.mem_errors()):>15s} {_mean(cols['in'][1]):>9s} {_mean(cols['loo'][1]):>6s}")


def main() -> None:
    val = validation_dir(__doc__)
    print(f"{'file':52s} {'time err % ours':>15s} {'Sailor':>7s}   {'mem err % ours':>14s} {'Sailor':>7s}  note")
    summary = []
    reports = dict(set_reports(val))
    for name, report in reports.items():
        errs = {k: {"ours": [], "sailor": [], "sailor_all": []} for k in ("time", "memory")}
        for r in report.rows:
            rel = Path(r.file).resolve().relative_to(val.resolve()).as_posix()
            s_t, s_m = SAILOR.get(rel, (None, None))
            st, sm = _err(s_t, r.real_s), _err(s_m, r.real_mem_bytes)
            notes = [_tally(errs["time"], "time", r.time_excluded, r.time_err_pct, st),
                     _tally(errs["memory"], "memory", r.mem_excluded, r.mem_err_pct, sm)]
            fmt = lambda x: "      -" if x is None else f"{x:7.1f}"  # noqa: E731
            print(f"{rel:52s} {fmt(r.time_err_pct):>15s} {fmt(st)}   {fmt(r.mem_err_pct):>14s} {fmt(sm)}  "
                  f"{'; '.join(n for n in notes if n)}")
        t, m = errs["time"], errs["memory"]
        summary.append((name, t["ours"], t["sailor"], t["sailor_all"], m["ours"], m["sailor"], m["sailor_all"]))
    print()
    print(f"{'set':18s} {'time ours':>9s} {'Sailor':>7s} {'(all)':>6s}   {'memory ours':>11s} {'Sailor':>7s} {'(all)':>6s}"
          "   mean |error| %, over the files each mean uses")
    for name, ot, stt, sta, om, smm, sma in summary:
        print(f"{name:18s} {_mean(ot):>9s} {_mean(stt):>7s} {_mean(sta):>6s}   {_mean(om):>11s} {_mean(smm):>7s} "
              f"{_mean(sma):>6s}   (time {len(ot)} files, memory {len(om)} files)")
    generalisation(val, reports)


if __name__ == "__main__":
    main()
