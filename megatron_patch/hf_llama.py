"""Llama weights to and from Hugging Face: ``config.json`` + safetensors that ``LlamaForCausalLM`` loads.

Both sides are the same network (pre-RMSNorm, SwiGLU, RoPE, grouped-query attention, untied head, no
biases); what differs is how tensors are stored:

- attention: megatron fuses Q, K and V into one ``linear_qkv`` whose rows go per query group,
  ``[q_1 .. q_{n/g}, k, v]`` for each of the g KV groups (so a TP shard holds whole groups);
  Hugging Face keeps ``q_proj`` / ``k_proj`` / ``v_proj``, with query head j using KV head j // (n/g);
- MLP: megatron's ``linear_fc1`` is ``[gate; up]``, Hugging Face has ``gate_proj`` and ``up_proj``;
- RoPE: megatron's rotary embedding (non-interleaved, rotary_percent 1) rotates the halves of each
  head, as Hugging Face's ``rotate_half`` does, with the same frequencies: Q and K rows map as they
  are (Meta's original checkpoints interleave, and their conversion to Hugging Face permutes once;
  nothing is permuted here).

Import writes a checkpoint as the runtime writes one (layer files, manifest, atomic rename) at step 0
with ``"optimizer_state": false``: there are no Adam moments, and a run resuming from it starts
Adam fresh (``checkpoint_io.CheckpointReader`` reads zero moments and step 0, Adam's initial state),
under any plan. Export takes the master (fp32) weights of any checkpoint of a Llama-family model.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import torch

from megatron_patch import safetensors_io
from megatron_patch.checkpoint_io import CheckpointReader, layer_file, write_layer
from megatron_patch.data import ORDER
from megatron_patch.layout import ParamInfo, arch_of, param_layout
from megatron_patch.model import DTYPES
from sailor_hpc.core import checkpoint as ck
from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.fields import read_json
from sailor_hpc.core.models import ModelSpec, get_model

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"  # sharded checkpoints: {"weight_map": {tensor: file}}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer older transformers versions saved; recomputed
_FIX_MODEL = "import with the catalog model of these shapes (sailor-hpc models), or add one to sailor_hpc/core/models.py"

# megatron name (after "decoder.layers.<i>.") -> Hugging Face names (after "model.layers.<i>."), in fused order
_BLOCK = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
_TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}


def require_llama(spec: ModelSpec, where: object | None = None) -> None:
    if spec.family != "llama":
        raise SailorError(f"{spec.name} is not a Llama ({spec.architecture}): only Llama-architecture models "
                          "exchange weights with Hugging Face", file=where, field="model",
                          fix="use a Llama model of the catalog (sailor-hpc models)")


def hf_names(name: str) -> tuple[str, ...]:
    """The Hugging Face tensors one canonical (megatron) parameter is made of."""
    if name in _TOP:
        return (_TOP[name],)
    _, _, index, rest = name.split(".", 3)  # decoder.layers.<i>.<rest>
    return tuple(f"model.layers.{index}.{n}" for n in _BLOCK[rest])


def _split_sizes(spec: ModelSpec, name: str) -> tuple[int, ...]:
    """Rows of each Hugging Face part within one group of the fused tensor (one group unless QKV)."""
    if name.endswith("linear_qkv.weight"):
        kv = spec.num_kv_heads or spec.num_heads
        return (spec.num_heads // kv * spec.head_dim, spec.head_dim, spec.head_dim)
    if name.endswith("linear_fc1.weight"):
        return (spec.ffn_hidden_size, spec.ffn_hidden_size)
    return ()


def _groups(spec: ModelSpec, name: str) -> int:
    return (spec.num_kv_heads or spec.num_heads) if name.endswith("linear_qkv.weight") else 1


def to_hf(spec: ModelSpec, info: ParamInfo, full: torch.Tensor) -> list[torch.Tensor]:
    """Split a canonical tensor into its Hugging Face tensors (views where possible)."""
    sizes = _split_sizes(spec, info.name)
    if not sizes:
        return [full]
    g = _groups(spec, info.name)
    grouped = full.reshape(g, sum(sizes), *full.shape[1:])  # [group, rows per group, hidden]
    return [part.reshape(-1, *full.shape[1:]) for part in grouped.split(sizes, dim=1)]


def to_megatron(spec: ModelSpec, info: ParamInfo, parts: list[torch.Tensor]) -> torch.Tensor:
    """The canonical tensor from its Hugging Face tensors (inverse of :func:`to_hf`)."""
    if not _split_sizes(spec, info.name):
        return parts[0]
    g = _groups(spec, info.name)
    grouped = [p.reshape(g, -1, *p.shape[1:]) for p in parts]
    return torch.cat(grouped, dim=1).reshape(info.shape)


def hf_layout(spec: ModelSpec) -> list[tuple[ParamInfo, dict[str, tuple[int, ...]]]]:
    """Every canonical parameter with its Hugging Face tensors and their shapes, in the layout's order."""
    out = []
    for info in param_layout(spec, spec.vocab_size):
        parts = to_hf(spec, info, torch.empty(info.shape, device="meta"))
        out.append((info, {n: tuple(p.shape) for n, p in zip(hf_names(info.name), parts, strict=True)}))
    return out


# ---------------------------------------------------------------- config.json

def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` of ``LlamaForCausalLM`` for ``spec`` (what the runtime's network is)."""
    a = arch_of(spec)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads or spec.num_heads, "head_dim": spec.head_dim,
        "hidden_act": "silu", "max_position_embeddings": spec.seq_len, "rms_norm_eps": a.norm_eps,
        "rope_theta": float(a.rotary_base), "rope_scaling": None, "tie_word_embeddings": spec.tied_embeddings,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
    }


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, str]:
    """(theta, type) from a config of either transformers generation (``rope_parameters`` or ``rope_theta``)."""
    def table(key: str) -> dict[str, Any]:
        value = cfg.get(key) or {}
        if not isinstance(value, dict):
            raise SailorError(f"{key} is {value!r}, not a JSON object", file=path, field=key, fix=_FIX_CONFIG)
        return value

    params, scaling = table("rope_parameters"), table("rope_scaling")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not _finite(theta):
        raise SailorError(f"rope_theta is {theta!r}, not a number", file=path, field="rope_theta", fix=_FIX_CONFIG)
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), str(kind)


_FIX_CONFIG = "pass the config.json that save_pretrained wrote (a Llama's, unedited)"


def _positive_int(value: Any) -> TypeGuard[int]:
    """A positive JSON integer (JSON's true is no count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _finite(value: Any) -> TypeGuard[int | float]:
    """A JSON number a float can hold (not a bool, NaN, an infinity or an integer beyond float's range)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_config(spec: ModelSpec, cfg: dict[str, Any], path: Path) -> None:
    """Refuse a config whose network is not ``spec``'s, naming the first differing field."""
    want = hf_config(spec)
    if cfg.get("model_type") != "llama":
        raise SailorError(f"model_type is {cfg.get('model_type')!r}, not 'llama'", file=path, field="model_type",
                          fix="only Llama-architecture (LlamaForCausalLM) checkpoints import")
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    # head_dim is optional (hidden_size / heads); computed only from sane values, the comparison names the rest
    derived = hidden // heads if _positive_int(heads) and _positive_int(hidden) else None
    got = {**cfg, "num_key_value_heads": cfg.get("num_key_value_heads", heads),
           "head_dim": cfg.get("head_dim") or derived,
           "hidden_act": cfg.get("hidden_act", "silu"), "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
           "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
           "attention_bias": cfg.get("attention_bias", False), "mlp_bias": cfg.get("mlp_bias", False)}
    got["rope_theta"], kind = _rope(cfg, path)
    if kind != "default":
        raise SailorError(f"RoPE scaling {kind!r} is not supported (the runtime's RoPE is unscaled)", file=path,
                          field="rope_scaling", fix="import a checkpoint without rope_scaling (e.g. Llama 3, not 3.1)")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
                "tie_word_embeddings", "attention_bias", "mlp_bias"):
        a, b = got.get(key), want[key]
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(b, float) and _finite(a) else a == b
        if not same:
            raise SailorError(f"{key} is {a!r}, {spec.name} has {b!r}", file=path, field=key, fix=_FIX_MODEL)


def read_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / CONFIG
    cfg = read_json(path, missing_fix="point at a Hugging Face model folder, as save_pretrained writes it "
                                      "(config.json + *.safetensors)")
    if not isinstance(cfg, dict):
        raise SailorError("config.json is not a JSON object", file=path)
    return cfg


# ---------------------------------------------------------------- import

def open_weights(hf_dir: Path) -> dict[str, safetensors_io.Reader]:
    """Hugging Face tensor name -> the safetensors file holding it (one file, or an index of shards)."""
    if (hf_dir / INDEX).is_file():
        index = read_json(hf_dir / INDEX, missing_fix="")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise SailorError("no weight_map object", file=hf_dir / INDEX, field="weight_map",
                              fix="re-save the model with save_pretrained")
        readers = {f: safetensors_io.Reader(hf_dir / f) for f in sorted(set(weight_map.values()))}
        return {name: readers[f] for name, f in weight_map.items()}
    if (hf_dir / WEIGHTS).is_file():
        reader = safetensors_io.Reader(hf_dir / WEIGHTS)
        return dict.fromkeys(reader.entries, reader)
    raise SailorError(f"no {WEIGHTS} or {INDEX}", file=hf_dir,
                      fix="save the model with save_pretrained(..., safe_serialization=True); *.bin is not read")


def _check_tensors(spec: ModelSpec, found: dict[str, safetensors_io.Reader], hf_dir: Path) -> None:
    """Every tensor there with the right shape, and nothing else (all checked before anything is written)."""
    expected = {n: s for _, parts in hf_layout(spec) for n, s in parts.items()}
    for name, shape in expected.items():
        if name not in found:
            raise SailorError(f"tensor {name} is missing", file=hf_dir, field=name, fix=_FIX_MODEL)
        got = found[name].entries.get(name)
        if got is None:
            raise SailorError(f"the index maps {name} to a file without it", file=found[name].path, field=name)
        if got.shape != shape:
            raise SailorError(f"tensor {name} has shape {list(got.shape)}, {spec.name} needs {list(shape)}",
                              file=found[name].path, field=name, fix=_FIX_MODEL)
    extra = sorted(n for n in found if n not in expected and not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise SailorError(f"{len(extra)} tensors {spec.name} has no place for, e.g. {extra[0]}", file=hf_dir,
                          field=extra[0], fix=_FIX_MODEL)


def import_hf(hf_dir: str | Path, model: str, save: str | Path) -> Path:
    """Write Hugging Face Llama weights as a step-0 checkpoint of ``model`` under ``save``; its path."""
    hf_dir, root = Path(hf_dir), Path(save)
    spec = get_model(model)
    require_llama(spec)
    check_config(spec, read_config(hf_dir), hf_dir / CONFIG)
    found = open_weights(hf_dir)
    _check_tensors(spec, found, hf_dir)
    if ck.candidates(root):
        raise SailorError("already holds checkpoints (a run resuming there would not start from the import)",
                          file=root, field="--save", fix="import into a new, empty directory")
    layout = hf_layout(spec)
    tmp = ck.start_tmp(root, 0)
    try:
        files, params = {}, {}
        for layer in range(spec.num_pipeline_layers):
            entries = {}
            for info, parts in ((i, p) for i, p in layout if i.layer == layer):
                full = to_megatron(spec, info, [found[n].get(n).float() for n in parts])
                entries[info.name] = {"param": full.contiguous()}
                params[info.name] = {"file": layer_file(layer), "shape": list(full.shape)}
            files[layer_file(layer)] = write_layer(tmp, layer, entries)
        manifest = {"step": 0, "consumed_samples": 0, "adam_steps": 0, "optimizer_state": False,
                    "data_order": ORDER, "model": spec.name, "vocab_size": spec.vocab_size, "dtype": "fp32",
                    "torch": torch.__version__, "source": {"format": "huggingface", "path": str(hf_dir.resolve())},
                    "files": files, "params": params}
        return ck.publish(tmp, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
        raise


# ---------------------------------------------------------------- export

def _hf_tensors(spec: ModelSpec, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]]:
    for info, parts in hf_layout(spec):
        full = reader.tensors(info.name)["param"]
        yield from zip(parts, to_hf(spec, info, full), strict=True)


@dataclass(frozen=True)
class Exported:
    """What an export wrote, from which step, and the newer checkpoints it passed over (for the caller to say)."""

    path: Path
    step: int
    checkpoint: Path
    choice: ck.Choice


def export_hf(ckpt: str | Path, out: str | Path, dtype: str = "fp32") -> Exported:
    """Write checkpoint ``ckpt`` (a checkpoint, or a root: its newest complete one) as a Hugging Face folder.

    ``dtype``: fp32 (the checkpoint's master weights as they are), bf16 or fp16 (rounded)."""
    reader = CheckpointReader(str(ckpt))
    manifest_path = reader.path / ck.MANIFEST
    spec = get_model(str(reader.manifest.get("model")))
    require_llama(spec, manifest_path)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SailorError("exists and is not an empty folder", file=out, field="OUT",
                          fix="export into a new folder (nothing is overwritten)")
    layout = hf_layout(spec)
    shapes = {n: s for _, parts in layout for n, s in parts.items()}
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        safetensors_io.write(tmp / WEIGHTS, shapes, _hf_tensors(spec, reader), DTYPES[dtype],
                             metadata={"sailor_hpc_step": str(reader.manifest["step"])})
        cfg = {**hf_config(spec), "torch_dtype": str(DTYPES[dtype]).removeprefix("torch.")}
        atomic_write_text(tmp / CONFIG, json.dumps(cfg, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, int(reader.manifest["step"]), reader.path, reader.choice)
