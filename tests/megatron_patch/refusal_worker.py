"""One rank's pass over test_option_refusals.py's cases, in one process (a process per case would cost a Python
start each; the launchers' checks run before torch, so a case costs milliseconds).

``python refusal_worker.py CASES.json`` in the scratch folder the cases name, with the rank's environment. Each
case is an entry point's own ``main`` (``megatron_patch.launch``, ``megatron_patch.ds_runtime.launch``,
``megatron_patch.data``) under the case's environment variables; printed: one JSON line per case with its exit
code, stderr, what it wrote into the folder and whether torch was imported by then. The training loop's
``train`` is replaced: arguments that pass every check stop there with :data:`PASSED_CHECKS`, never train.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PASSED_CHECKS = 99


def snapshot(root: Path) -> dict[str, str]:
    """Every file (its checksum) and folder under ``root``: a refusal must leave both as they were."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(root.rglob("*"))}


def entry(name: str) -> Callable[[list[str]], int]:
    if name == "data":
        from megatron_patch import data  # imports torch: the data cases run last
        return data.main
    if name == "ds":
        from megatron_patch.ds_runtime import launch as ds_launch
        return ds_launch.main
    from megatron_patch import launch
    return launch.main


def run_case(case: dict[str, Any], root: Path) -> dict[str, Any]:
    saved = {k: os.environ.get(k) for k in case["env"]}
    for key, value in case["env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    before = snapshot(root)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = entry(case["entry"])(case["argv"])
            except SystemExit as exc:  # argparse
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001  (what a user would see: the test finds "Traceback")
                traceback.print_exc()
                code = 1
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    after = snapshot(root)
    written = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return {"code": code, "stderr": err.getvalue(), "written": written, "torch": "torch" in sys.modules}


def main() -> None:
    from megatron_patch import training_loop
    training_loop.train = lambda *_args: PASSED_CHECKS  # type: ignore[assignment]
    root = Path.cwd()
    for case in json.loads(Path(sys.argv[1]).read_text()):
        print(json.dumps(run_case(case, root)), flush=True)


if __name__ == "__main__":
    main()
