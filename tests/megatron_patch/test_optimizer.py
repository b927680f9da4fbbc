"""``StageOptimizer`` is torch's AdamW, bit for bit, without importing ``torch._dynamo``.

The optimizer keeps the Adam state itself and calls torch's functional AdamW; the reference is
``torch.optim.AdamW`` itself (foreach, as on the CPU), stepped on copies of the same parameters with the same
gradients, learning rates and clip. Both keep fp32 parameters (and bf16 ones through fp32 masters). A fresh
interpreter checks what the change is for: building and stepping the optimizer imports no dynamo.
"""
from __future__ import annotations

import json
from collections import OrderedDict

import pytest

from megatron_patch.layout import ParamInfo
from megatron_patch.options import AdamConfig
from tests.megatron_patch.conftest import python

torch = pytest.importorskip("torch")

from megatron_patch.optimizer import StageOptimizer  # noqa: E402

CFG = AdamConfig(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip_grad=1.0)
SHAPES = {"w1": (8, 4), "b1": (8,), "norm": (4,), "w2": (3, 8)}
NO_DECAY = {"b1", "norm"}  # biases and norms, as the layout marks them


def _params(dtype: torch.dtype) -> OrderedDict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return OrderedDict((n, torch.nn.Parameter(torch.randn(s, generator=g).to(dtype))) for n, s in SHAPES.items())


def _infos() -> dict[str, ParamInfo]:
    return {n: ParamInfo(n, 0, s, None, decay=n not in NO_DECAY) for n, s in SHAPES.items()}


def _reference(params: OrderedDict[str, torch.nn.Parameter]) -> tuple[OrderedDict[str, torch.Tensor], torch.optim.AdamW]:
    """fp32 copies of ``params`` under torch.optim.AdamW, grouped as the runtime groups them."""
    ref = OrderedDict((n, p.detach().float().clone().requires_grad_(True)) for n, p in params.items())
    groups = [{"params": [ref[n] for n in ref if n not in NO_DECAY], "weight_decay": CFG.weight_decay},
              {"params": [ref[n] for n in ref if n in NO_DECAY], "weight_decay": 0.0}]
    return ref, torch.optim.AdamW(groups, lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, foreach=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_equal_torchs_adamw_bit_for_bit(dtype: torch.dtype) -> None:
    params = _params(dtype)
    opt = StageOptimizer(params, _infos(), CFG)
    ref, adamw = _reference(params)
    g = torch.Generator().manual_seed(1)
    for step, (lr, clip) in enumerate([(1e-2, 1.0), (5e-3, 0.3), (2e-3, 1.0), (1e-3, 0.7)]):
        grads = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
        skip = "w2" if step == 1 else None  # a parameter without a gradient is left alone, state and all
        for n, m in opt.master.items():
            m.grad = None if n == skip else grads[n].clone()
            ref[n].grad = None if n == skip else grads[n].clone()
        opt.step(clip, lr)
        for group in adamw.param_groups:
            group["lr"] = lr
        with torch.no_grad():
            torch._foreach_mul_([r.grad for r in ref.values() if r.grad is not None], clip)
        adamw.step()
        for n in SHAPES:
            st, want = opt.state_of(n), adamw.state[ref[n]]
            assert torch.equal(st["param"], ref[n].detach()), (step, n)
            assert torch.equal(st["exp_avg"], want["exp_avg"]) and torch.equal(st["exp_avg_sq"], want["exp_avg_sq"])
            assert torch.equal(params[n].detach(), ref[n].detach().to(dtype))  # the model's copy follows
    assert opt.adam_steps() == int(adamw.state[ref["w1"]]["step"]) == 4
    assert int(adamw.state[ref["w2"]]["step"]) == 3 and int(opt.state["w2"].step) == 3


def test_a_loaded_state_steps_on_as_torchs_adamw_would() -> None:
    params = _params(torch.float32)
    opt = StageOptimizer(params, _infos(), CFG)
    ref, adamw = _reference(params)
    g = torch.Generator().manual_seed(2)
    moments = {n: (torch.rand(s, generator=g), torch.rand(s, generator=g)) for n, s in SHAPES.items()}
    for n, (m1, m2) in moments.items():
        opt.load_state(n, params[n].detach(), m1, m2, steps=7)
        adamw.state[ref[n]] = {"step": torch.tensor(7.0), "exp_avg": m1.clone(), "exp_avg_sq": m2.clone()}
    for n in SHAPES:
        opt.master[n].grad = ref[n].grad = torch.full(SHAPES[n], 0.5)
    opt.step(1.0)
    adamw.step()
    assert all(torch.equal(opt.master[n].detach(), ref[n].detach()) for n in SHAPES)
    assert opt.adam_steps() == 8


def test_building_and_stepping_imports_no_dynamo() -> None:
    """A new interpreter, as a rank (the zygote preloads dynamo for the reference runs, so not forked)."""
    code = ("import json, sys\nfrom collections import OrderedDict\nimport torch\n"
            "from megatron_patch.layout import ParamInfo\nfrom megatron_patch.optimizer import StageOptimizer\n"
            "from megatron_patch.options import AdamConfig\n"
            "p = OrderedDict(w=torch.nn.Parameter(torch.ones(3)))\n"
            "opt = StageOptimizer(p, {'w': ParamInfo('w', 0, (3,), None)}, AdamConfig(lr=0.1, weight_decay=0.5))\n"
            "opt.main_grads()\nopt.step(1.0)\n"
            "print(json.dumps([float(p['w'][0]), 'torch._dynamo' in sys.modules]))")
    res = python("-c", code)
    assert res.returncode == 0, res.stderr[-3000:]
    moved, dynamo = json.loads(res.stdout.strip().splitlines()[-1])
    assert moved != 1.0 and dynamo is False
