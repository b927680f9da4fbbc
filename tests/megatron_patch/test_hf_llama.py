"""Hugging Face interop: tiny Llama weights round-trip through the runtime's checkpoints, exactly.

One pipeline as a user would run it: a random ``LlamaForCausalLM`` (transformers) -> ``sailor-hpc
checkpoint import`` -> the runtime trains 2 steps from it under a TP 2 + 2-stage plan (gloo ranks) and
the single-process reference trains the same 2 steps -> ``sailor-hpc checkpoint export`` of the import
and of the trained checkpoint -> transformers again. Training runs in its own ranks; the reference runs
in the process that compares (hf_worker.py, a one-rank torch.distributed); the two CLI commands run in
this one through click's runner (no torch.distributed, no megatron globals: the same command, without
one more torch start-up each).
The independent references are transformers' own forward and megatron-core's ``GPTModel``.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from megatron_patch import local
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from tests.megatron_patch.conftest import ADAM, events, python

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

MODEL = "tiny-llama"  # pipeline layers 0 embedding, 1..2 blocks, 3 final RMSNorm, 4 head
# TP 2 over the embedding and block 1 (KV groups split), then blocks, norm and head at TP 1
PLAN = Plan(MODEL, 4, (Pipeline(2, 2, (Stage(0, 1, 2, "A100-40"), Stage(2, 4, 1, "A100-40"))),))
FP32 = 1e-5  # fp32 tolerance for logits of magnitude ~10 (transformers and megatron order some sums differently)


@dataclass
class RoundTrip:
    measured: dict[str, float]
    first_loss: float  # the runtime's step-1 loss (before any update: the imported weights)
    ref_losses: list[float]


def _ok(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])


def _cli_ok(*args: str) -> None:
    res = _cli(*args)
    assert res.exit_code == 0, (res.output[-3000:], res.exception)


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory: pytest.TempPathFactory, shipped_data: str) -> RoundTrip:
    root = tmp_path_factory.mktemp("hf")
    data = shipped_data
    _ok(python("tests/megatron_patch/hf_worker.py", "make", str(root / "hf"), fork=True))
    _cli_ok("checkpoint", "import", str(root / "hf"), "--model", MODEL, "--save", str(root / "imported"))
    PLAN.save(root / "plan.json")
    ranks = local.run(["-m", "megatron_patch.launch", "--plan", str(root / "plan.json"), "--model", MODEL,
                       "--data", data, "--load", str(root / "imported"), "--save", str(root / "trained"),
                       "--steps", "2", *ADAM], PLAN.num_gpus, timeout=300, fork=True)
    for r in ranks:
        assert r.returncode == 0, (r.rank, r.stderr[-4000:])
    _cli_ok("checkpoint", "export", str(root / "imported"), "--to", "hf", str(root / "roundtrip"))
    res = python("tests/megatron_patch/hf_worker.py", "compare", str(root), data, *ADAM, fork=True)  # + the reference
    _ok(res)
    loaded = events(ranks[0], "loaded")
    assert loaded and loaded[0]["step"] == 0 and loaded[0]["consumed_samples"] == 0
    return RoundTrip(json.loads(res.stdout.strip().splitlines()[-1]), events(ranks[-1], "step")[0]["loss"],
                     json.loads((root / "ref" / "losses.json").read_text()))


def test_imported_weights_compute_transformers_logits(roundtrip: RoundTrip) -> None:
    m = roundtrip.measured
    print(m)
    assert m["logits_scale"] > 1  # weights far enough from init that the logits carry the mapping
    assert m["imported_vs_hf_logits"] <= FP32
    assert m["sharded_files"] > 1 and m["sharded_vs_single_import"] == 0.0  # an index of shards reads the same
    assert m["control_naive_qkv_logits"] > 1e-1  # the GQA layout matters, and the comparison sees it


def test_export_of_an_import_is_the_original_model(roundtrip: RoundTrip) -> None:
    m = roundtrip.measured
    assert m["roundtrip_same_keys"] == 1.0
    assert m["roundtrip_state_dict"] == 0.0  # bit-identical tensors
    assert m["roundtrip_logits"] == 0.0


def test_runtime_resumes_an_import_under_tp2_and_two_stages(roundtrip: RoundTrip) -> None:
    m = roundtrip.measured
    print(roundtrip.first_loss, roundtrip.ref_losses, m["hf_loss_batch0"])
    # step 1 trains from the imported weights: its loss is transformers' loss on the same first batch
    assert abs(roundtrip.first_loss - m["hf_loss_batch0"]) <= 1e-5
    assert abs(roundtrip.first_loss - roundtrip.ref_losses[0]) <= 1e-5
    # fresh Adam from the import, under the plan, equals the single-process reference from the import
    assert m["trained_vs_reference_params"] <= 1e-6
    assert m["trained_vs_reference_exp_avg_sq"] <= 1e-8


def test_export_of_a_trained_checkpoint_loads_in_transformers(roundtrip: RoundTrip) -> None:
    m = roundtrip.measured
    assert m["trained_moved_from_import"] > 1e-3  # the 2 steps changed the function
    assert m["trained_export_vs_megatron_logits"] <= FP32


# ---------------------------------------------------------------- the file format and bad input (in process)

def _hf_folder(path: Path, cfg: dict | None = None, shapes: dict | None = None) -> Path:
    """A Hugging Face folder for tiny-llama written without transformers (random weights)."""
    import torch

    from megatron_patch import hf_llama, safetensors_io
    from sailor_hpc.core.models import get_model
    spec = get_model(MODEL)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg or hf_llama.hf_config(spec)))
    shapes = shapes or {n: s for _, parts in hf_llama.hf_layout(spec) for n, s in parts.items()}
    safetensors_io.write(path / "model.safetensors", shapes, ((n, torch.randn(s)) for n, s in shapes.items()))
    return path


def _cli(*args: str) -> Result:
    from sailor_hpc.cli import main
    return CliRunner().invoke(main, list(args))


def test_safetensors_files_agree_with_the_safetensors_package(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_patch import safetensors_io
    tensors = {"a": torch.randn(3, 5), "b.c": torch.randn(7), "empty": torch.randn(0, 2), "d": torch.arange(4.0)}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ours = {k: v.to(dtype) for k, v in tensors.items()}
        safetensors_io.write(tmp_path / "ours.safetensors", {k: tuple(v.shape) for k, v in ours.items()},
                             ours.items(), dtype)
        theirs = load_file(tmp_path / "ours.safetensors")
        assert all(torch.equal(theirs[k], ours[k]) and theirs[k].dtype == dtype for k in ours)
        save_file(ours, tmp_path / "theirs.safetensors")
        reader = safetensors_io.Reader(tmp_path / "theirs.safetensors")
        assert all(torch.equal(reader.get(k), ours[k]) and reader.get(k).dtype == dtype for k in ours)


def test_bad_input_exits_2_naming_file_field_and_fix(tmp_path: Path) -> None:
    from megatron_patch import hf_llama
    from sailor_hpc.core.models import get_model
    spec = get_model(MODEL)
    good = _hf_folder(tmp_path / "good")
    save = tmp_path / "ckpt"
    cases = {
        "no config": (tmp_path, "config.json: file not found"),
        "model_type": (_hf_folder(tmp_path / "gpt2", {**hf_llama.hf_config(spec), "model_type": "gpt2"}),
                       "model_type: model_type is 'gpt2'"),
        "shape": (_hf_folder(tmp_path / "h32", {**hf_llama.hf_config(spec), "hidden_size": 32}),
                  "hidden_size: hidden_size is 32, tiny-llama has 64"),
        "rope": (_hf_folder(tmp_path / "rope", {**hf_llama.hf_config(spec),
                                                "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
                 "rope_scaling: RoPE scaling 'llama3'"),
        "tensor": (_hf_folder(tmp_path / "k", shapes={**{n: s for _, p in hf_llama.hf_layout(spec)
                                                           for n, s in p.items()},
                                                        "model.layers.1.self_attn.k_proj.weight": (16, 64)}),
                   "model.layers.1.self_attn.k_proj.weight: tensor model.layers.1.self_attn.k_proj.weight has "
                   "shape [16, 64], tiny-llama needs [32, 64]"),
    }
    for name, (folder, message) in cases.items():
        res = _cli("checkpoint", "import", str(folder), "--model", MODEL, "--save", str(save))
        assert res.exit_code == 2 and message in res.output and "fix:" in res.output, (name, res.output)
        assert not save.exists() or not any(save.iterdir()), name  # nothing half-written
    (good / "model.safetensors").write_bytes(b"\xff" * 12)
    res = _cli("checkpoint", "import", str(good), "--model", MODEL, "--save", str(save))
    assert res.exit_code == 2 and "model.safetensors: not a valid safetensors file" in res.output
    res = _cli("checkpoint", "import", str(good), "--model", "tiny-gpt", "--save", str(save))
    assert res.exit_code == 2 and "not a Llama" in res.output


def test_export_and_import_refuse_to_overwrite_or_convert_a_gpt(tmp_path: Path) -> None:
    from sailor_hpc.core import checkpoint as ck
    hf = _hf_folder(tmp_path / "hf")
    assert _cli("checkpoint", "import", str(hf), "--model", MODEL, "--save", str(tmp_path / "ckpt")).exit_code == 0
    manifest = ck.read_manifest(ck.resolve(tmp_path / "ckpt"))
    assert (manifest["step"], manifest["adam_steps"], manifest["optimizer_state"]) == (0, 0, False)
    res = _cli("checkpoint", "import", str(hf), "--model", MODEL, "--save", str(tmp_path / "ckpt"))
    assert res.exit_code == 2 and "already holds checkpoints" in res.output
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    res = _cli("checkpoint", "export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "out"))
    assert res.exit_code == 2 and "not an empty folder" in res.output
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    gpt = ck.publish(ck.start_tmp(tmp_path / "gpt", 3), {"step": 3, "consumed_samples": 0, "model": "tiny-gpt",
                                                        "files": {}, "params": {}})
    res = _cli("checkpoint", "export", str(gpt), "--to", "hf", str(tmp_path / "gpt_hf"))
    assert res.exit_code == 2 and "model: tiny-gpt is not a Llama (GPT: pre-LN" in res.output
    assert not (tmp_path / "gpt_hf").exists() and not list(tmp_path.glob(".gpt_hf*"))
    res = _cli("checkpoint", "export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "bf16"), "--dtype", "bf16")
    assert res.exit_code == 0 and json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_says_which_step_it_wrote_and_what_it_passed_over(tmp_path: Path) -> None:
    """A --save root whose newest checkpoint is torn exports the older one, and says so: never silently."""
    import shutil

    from sailor_hpc.core import checkpoint as ck
    hf = _hf_folder(tmp_path / "hf")
    assert _cli("checkpoint", "import", str(hf), "--model", MODEL, "--save", str(tmp_path / "ckpt")).exit_code == 0
    newest = ck.step_dir(tmp_path / "ckpt", 7)
    shutil.copytree(ck.step_dir(tmp_path / "ckpt", 0), newest)
    layer = sorted(newest.glob("layer_*.pt"))[-1]
    layer.write_bytes(layer.read_bytes()[:100])  # truncated by a full disk, say
    res = _cli("checkpoint", "export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "out"))
    assert res.exit_code == 0, res.output
    assert f"warning: checkpoint {newest} is unusable ({layer.name}: size 100 != " in res.output
    assert "using step_00000000" in res.output
    assert f"exported step 0 ({ck.step_dir(tmp_path / 'ckpt', 0)}) to {tmp_path / 'out'}" in res.output
    res = _cli("checkpoint", "export", str(newest), "--to", "hf", str(tmp_path / "explicit"))
    assert res.exit_code == 2 and layer.name in res.output and not (tmp_path / "explicit").exists()
