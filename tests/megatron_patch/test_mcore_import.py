"""megatron-core imported through ``mcore_import``: torch.compile deferred to a kernel's first call."""
from __future__ import annotations

import json
from typing import Any

import pytest

from tests.megatron_patch.conftest import python

torch = pytest.importorskip("torch")


def test_deferred_compile_compiles_once_at_the_first_call_with_the_same_arguments() -> None:
    from megatron_patch.mcore_import import deferred_compile
    calls: list[tuple[Any, dict]] = []

    def real(model: Any, **kwargs: Any) -> Any:  # stands for torch.compile: records, returns a marked function
        calls.append((model, kwargs))
        return lambda *a: ("compiled", model(*a)) if callable(model) else model

    lazy = deferred_compile(real)

    @lazy
    def plus_one(x: int) -> int:
        return x + 1

    @lazy(mode="max-autotune")
    def twice(x: int) -> int:
        return 2 * x

    assert calls == [] and plus_one.__name__ == "plus_one"  # nothing compiled at decoration
    assert plus_one(1) == ("compiled", 2) and plus_one(2) == ("compiled", 3)
    assert twice(4) == ("compiled", 8)
    assert [(m.__name__, kw) for m, kw in calls] == [("plus_one", {}), ("twice", {"mode": "max-autotune"})]
    module = torch.nn.Linear(2, 2)
    lazy(module)  # not a function: compiled at once, as torch.compile does
    assert calls[-1] == (module, {})


def test_the_runtime_imports_megatron_without_dynamo() -> None:
    """A fresh process importing the runtime and the reference: megatron's jit_fuser is the deferred
    compile, torch.compile is torch's again, and dynamo/inductor were never imported (1.6 s of CPU)."""
    code = ("import json, sys, torch\n"
            "import megatron_patch.engine, megatron_patch.reference\n"
            "from megatron.core import jit\n"
            "print(json.dumps([jit.jit_fuser.__name__, torch.compile.__module__,\n"
            "                  sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules)]))")
    res = python("-c", code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == ["compile_later", "torch", []]


def test_only_the_transformer_engine_and_apex_notices_are_filtered() -> None:
    code = ("from megatron_patch.mcore_import import import_megatron\nimport_megatron()\n"
            "import megatron.core.optimizer, megatron.core.optimizer.clip_grads\n"
            "import warnings\nwarnings.warn('another warning')\n")
    res = python("-c", code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Transformer Engine and Apex are not installed" not in res.stderr
    assert "UserWarning: another warning" in res.stderr
