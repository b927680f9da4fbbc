"""Program for test_hf_llama.py: the transformers side of the round trip, and every comparison.

``make OUT``: a random tiny-llama ``LlamaForCausalLM`` (fp32, weights far from the usual 0.02 init so
that attention is not uniform and a mis-mapped head shows) saved with ``save_pretrained``.
``compare ROOT DATA ADAM...``: first the single-process reference (``megatron_patch.reference``, in this
process: it needs the same one-rank torch.distributed) trains 2 steps from ROOT/imported into ROOT/ref;
then one JSON line of measurements over what the test left under ROOT (see the test).
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from megatron_patch.hf_llama import hf_config  # noqa: E402
from megatron_patch.launch import exit_now  # noqa: E402
from megatron_patch.local import free_port  # noqa: E402
from sailor_hpc.core.models import get_model  # noqa: E402

SPEC = get_model("tiny-llama")
SEED = 1234  # the runtime's and the reference's default --seed: the data order of the loss comparison
GLOBAL_BATCH = 4


def make(out: Path) -> None:
    torch.manual_seed(5)
    cfg = {k: v for k, v in hf_config(SPEC).items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)
    model.save_pretrained(out.with_name(out.name + "_sharded"), safe_serialization=True, max_shard_size="100KB")


def megatron_logits(ckpt: Path, tokens: torch.Tensor, naive_qkv: bool = False) -> torch.Tensor:
    """Logits of megatron-core's GPTModel (the runtime's single-process reference) holding ``ckpt``."""
    from megatron_patch.checkpoint_io import CheckpointReader
    from megatron_patch.reference import gpt_model
    model = gpt_model(SPEC, SEED).eval()
    reader = CheckpointReader(str(ckpt))
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = reader.tensors(name)["param"]
            if naive_qkv and name.endswith("linear_qkv.weight"):  # control: [q; k; v] with no per-group order
                g, hd = SPEC.num_kv_heads or SPEC.num_heads, SPEC.head_dim
                q, k, v = t.reshape(g, -1, SPEC.hidden_size).split([SPEC.num_heads // g * hd, hd, hd], dim=1)
                t = torch.cat([x.reshape(-1, SPEC.hidden_size) for x in (q, k, v)])
            p.copy_(t)
        s = tokens.shape[1]
        pos = torch.arange(s).unsqueeze(0).expand_as(tokens)
        return model(tokens, pos, torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None])


def hf_logits(folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, LlamaForCausalLM]:
    model = LlamaForCausalLM.from_pretrained(folder).float().eval()
    with torch.no_grad():
        return model(tokens).logits, model


def compare(root: Path, data: str, adam: list[str]) -> dict[str, float]:
    from megatron.core import parallel_state

    from megatron_patch import patch, reference
    from megatron_patch.checkpoint_io import CheckpointReader
    from megatron_patch.data import GlobalSamples
    from megatron_patch.hf_llama import export_hf, import_hf
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    reference.train(reference.parse_args([
        "--model", SPEC.name, "--data", data, "--global-batch", str(GLOBAL_BATCH), "--steps", "2",
        "--out", str(root / "ref"), "--load", str(root / "imported"), *adam]))
    patch.apply(cpu=True)
    patch.seed_model_parallel_rng(SEED, 0)
    batch = GlobalSamples(data, SPEC.seq_len, SEED).batch(0, GLOBAL_BATCH)  # the runtime's first global batch
    tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    out: dict[str, float] = {}
    diff = lambda a, b: float((a - b).abs().max())  # noqa: E731
    # 1. Hugging Face -> import -> megatron-core: the same function
    hf0, original = hf_logits(root / "hf", tokens)
    imported = root / "imported" / "step_00000000"
    out["imported_vs_hf_logits"] = diff(megatron_logits(imported, tokens), hf0)
    out["control_naive_qkv_logits"] = diff(megatron_logits(imported, tokens, naive_qkv=True), hf0)
    out["hf_loss_batch0"] = float(torch.nn.functional.cross_entropy(hf0.reshape(-1, SPEC.vocab_size), labels.reshape(-1)))
    out["logits_scale"] = float(hf0.abs().max())
    sharded = import_hf(root / "hf_sharded", SPEC.name, root / "imported_sharded")
    out["sharded_files"] = float(len(list((root / "hf_sharded").glob("*.safetensors"))))
    one, many = CheckpointReader(str(imported)).full_state(), CheckpointReader(str(sharded)).full_state()
    out["sharded_vs_single_import"] = max(diff(one[n]["param"], many[n]["param"]) for n in one)
    # 2. import -> export (the CLI wrote it) -> transformers: the very same tensors and function
    hf1, back = hf_logits(root / "roundtrip", tokens)
    a, b = original.state_dict(), back.state_dict()
    out["roundtrip_same_keys"] = float(set(a) == set(b))
    out["roundtrip_state_dict"] = max(diff(a[k], b[k]) for k in a)
    out["roundtrip_logits"] = diff(hf1, hf0)
    # 3. trained by the runtime (TP 2 + 2 stages) -> export -> transformers == megatron-core on that checkpoint
    trained = root / "trained"
    export_hf(trained, root / "trained_hf")
    hf2, _ = hf_logits(root / "trained_hf", tokens)
    out["trained_export_vs_megatron_logits"] = diff(hf2, megatron_logits(trained / "step_00000002", tokens))
    out["trained_moved_from_import"] = diff(hf2, hf0)
    ref = torch.load(root / "ref" / "ref_step_2.pt", weights_only=True)
    got = CheckpointReader(str(trained)).full_state()
    out["trained_vs_reference_params"] = max(diff(got[n]["param"], ref[n]["param"]) for n in ref)
    out["trained_vs_reference_exp_avg_sq"] = max(diff(got[n]["exp_avg_sq"], ref[n]["exp_avg_sq"]) for n in ref)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]))
    else:
        print(json.dumps(compare(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])), flush=True)
        exit_now(0)  # as launch does: gloo threads freed at interpreter exit abort a finished rank (SIGABRT)
