"""A pipeline stage of a megatron-core GPT, built layer by layer from megatron's own modules.

Why not ``GPTModel`` itself: GPTModel derives the layers of a stage from one homogeneous pipeline
split (``get_transformer_layer_offset``) and ties the final norm to the output layer, while a plan
gives every stage an arbitrary range of *pipeline layers* (0 = embedding, 1..T = blocks, then the
tail; Llama's final norm is a layer of its own). A stage here is a list of pipeline-layer modules,
each made of the megatron-core modules GPTModel uses (``LanguageModelEmbedding``,
``TransformerLayer`` from the local layer spec, SDPA attention, with its *global* layer number,
the spec's norm, ``ColumnParallelLinear``), with the same parameter names, so a stage holding every
layer at TP=1 is a GPTModel (``tests/megatron_patch`` checks that the losses agree).

The profiler times exactly these modules (``build_stage_module`` on one process, ``tp_size=1``, or
under torchrun with a TP group).
"""
from __future__ import annotations

import importlib.util
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_patch.attention import SdpaAttention
from megatron_patch.init_weights import init_shard
from megatron_patch.layout import (
    Arch,
    arch_of,
    final_norm_layer,
    head_layer,
    local_shape,
    param_layout,
    params_of_layers,
)
from megatron_patch.options import check_layer_spec
from megatron_patch.patch import cross_entropy
from sailor_hpc.core.models import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VOCAB_DIVISOR = 128  # megatron's make_vocab_size_divisible_by default


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def fusions(arch: Arch, cuda: bool) -> dict[str, bool]:
    """megatron's kernel fusions this device can run: all off on the CPU (they are CUDA/jit kernels).

    persist_layer_norm needs apex's FusedLayerNorm, masked softmax fusion megatron's compiled softmax
    kernels (only the unfused DotProductAttention uses it; SDPA replaces it), rope fusion TE's kernel.
    gradient_accumulation_fusion stays off: it writes the weight gradient into ``main_grad`` itself
    and needs apex, while megatron_patch.main_grad accumulates through hooks.
    """
    if not cuda:
        return dict(bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                    bias_dropout_fusion=False, apply_rope_fusion=False)
    return dict(
        bias_activation_fusion=arch.activation == "swiglu" or (arch.activation == "gelu" and arch.bias),
        masked_softmax_fusion=_importable("scaled_upper_triang_masked_softmax_cuda"),
        persist_layer_norm=arch.norm == "LayerNorm" and _importable("apex"),
        bias_dropout_fusion=True,
        apply_rope_fusion=arch.position == "rope" and _importable("transformer_engine"))


def transformer_config(spec: ModelSpec, *, tp: int, dtype: torch.dtype, cuda: bool, recompute: bool = False) -> Any:
    """megatron-core TransformerConfig for one stage (pipeline size 1: the plan does the pipelining)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    a = arch_of(spec)
    act = {"gelu": F.gelu, "relu": F.relu, "swiglu": F.silu}[a.activation]
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, ffn_hidden_size=spec.ffn_hidden_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        hidden_dropout=0.0, attention_dropout=0.0,  # exact across layouts: no layout-dependent RNG streams
        normalization=a.norm, add_bias_linear=a.bias, gated_linear_unit=a.glu, activation_func=act,
        **fusions(a, cuda), gradient_accumulation_fusion=False,
        use_cpu_initialization=not cuda, perform_initialization=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, pipeline_dtype=dtype,
        deallocate_pipeline_outputs=True, batch_p2p_comm=True, batch_p2p_sync=False,
        recompute_granularity=None, layernorm_epsilon=a.norm_eps,
    )


ATTENTIONS = ("sdpa", "megatron")  # megatron's unfused DotProductAttention: the tests' comparison only


def layer_spec(spec: ModelSpec, attention: str = "sdpa") -> Any:
    """megatron's local GPT layer spec, with SDPA as its core attention (megatron_patch.attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}")
    out = get_gpt_layer_local_spec(normalization=arch_of(spec).norm)
    if attention == "sdpa":
        out.submodules.self_attention.submodules.core_attention = SdpaAttention
    return out


@dataclass
class StageContext:
    """What every layer of a stage shares: config, groups, shapes."""

    spec: ModelSpec
    arch: Arch
    config: Any
    tp_group: Any
    pg_collection: Any
    tp: int
    tp_rank: int
    padded_vocab: int
    device: torch.device


class PipelineLayer(torch.nn.Module):
    """One pipeline layer of a stage: its index in the plan's layer numbering and its megatron name prefix."""

    index: int
    prefix: str

    def local_params(self) -> dict[str, torch.nn.Parameter]:
        """This layer's parameters by their names under ``prefix`` (megatron's GPTModel names)."""
        raise NotImplementedError


class EmbeddingLayer(PipelineLayer):
    """Pipeline layer 0: word (+ learned position) embeddings -> hidden states [s, b, h]."""

    def __init__(self, ctx: StageContext) -> None:
        super().__init__()
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        self.index = 0
        self.prefix = "embedding."
        self.embedding = LanguageModelEmbedding(config=ctx.config, vocab_size=ctx.padded_vocab,
                                                max_sequence_length=ctx.spec.seq_len,
                                                position_embedding_type=ctx.arch.position, tp_group=ctx.tp_group)

    def local_params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.embedding.named_parameters())

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids=tokens, position_ids=position_ids)


class BlockLayer(PipelineLayer):
    """Pipeline layer b (1..T): megatron's TransformerLayer with global layer number b."""

    def __init__(self, ctx: StageContext, index: int, layer_spec: Any, recompute: bool) -> None:
        super().__init__()
        from megatron.core.transformer.spec_utils import build_module
        self.index = index
        self.prefix = f"decoder.layers.{index - 1}."
        self.recompute = recompute
        self.layer = build_module(layer_spec, config=ctx.config, layer_number=index, pg_collection=ctx.pg_collection)

    def local_params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.layer.named_parameters())

    def _run(self, h: torch.Tensor, mask: torch.Tensor, rotary: torch.Tensor | None) -> torch.Tensor:
        return self.layer(hidden_states=h, attention_mask=mask, rotary_pos_emb=rotary)[0]

    def forward(self, h: torch.Tensor, mask: torch.Tensor, rotary: torch.Tensor | None) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._run, h, mask, rotary, use_reentrant=False)
        return self._run(h, mask, rotary)


class FinalNormLayer(PipelineLayer):
    """The final norm (megatron's ``decoder.final_layernorm``)."""

    def __init__(self, ctx: StageContext) -> None:
        super().__init__()
        from megatron.core.transformer.spec_utils import build_module
        self.index = final_norm_layer(ctx.spec)
        self.prefix = "decoder.final_layernorm."
        if ctx.config.persist_layer_norm:  # apex's, as the blocks' norms (torch's refuses the flag)
            from megatron.core.fusions.fused_layer_norm import FusedLayerNorm as norm_cls
        else:
            from megatron.core.transformer.torch_norm import WrappedTorchNorm as norm_cls
        self.norm = build_module(norm_cls, config=ctx.config, hidden_size=ctx.spec.hidden_size,
                                 eps=ctx.config.layernorm_epsilon)

    def local_params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.norm.named_parameters())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


class OutputLayer(PipelineLayer):
    """LM head + loss: vocab-parallel logits, padded vocabulary masked (P6), per-token loss [b, s]."""

    pad_mask: torch.Tensor  # a buffer: follows the module's device

    def __init__(self, ctx: StageContext, shares_embedding: bool) -> None:
        super().__init__()
        from megatron.core import tensor_parallel
        self.index = head_layer(ctx.spec)
        self.prefix = "output_layer."
        self.tied = ctx.spec.tied_embeddings
        self.tp_group = ctx.tp_group
        self.linear = tensor_parallel.ColumnParallelLinear(
            ctx.spec.hidden_size, ctx.padded_vocab, config=ctx.config, init_method=ctx.config.init_method,
            bias=False, gather_output=False, skip_weight_param_allocation=shares_embedding, tp_group=ctx.tp_group)
        part = ctx.padded_vocab // ctx.tp
        ids = torch.arange(ctx.tp_rank * part, (ctx.tp_rank + 1) * part, device=ctx.device)
        self.register_buffer("pad_mask", ids >= ctx.spec.vocab_size, persistent=False)
        self.has_padding = bool(self.pad_mask.any())

    def local_params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.linear.named_parameters())

    def forward(self, h: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        logits, _ = self.linear(h, weight=weight)
        if self.has_padding:
            logits = logits.masked_fill(self.pad_mask, float("-inf"))
        loss = cross_entropy(logits, labels.transpose(0, 1).contiguous(), self.tp_group)
        return loss.transpose(0, 1).contiguous()


class StageModule(torch.nn.Module):
    """Pipeline layers ``first..last`` of a model on one TP rank; forward as megatron's schedule expects."""

    def __init__(self, ctx: StageContext, first: int, last: int, recompute: bool) -> None:
        super().__init__()
        from megatron.core.transformer.enums import ModelType
        spec = ctx.spec
        self.ctx = ctx
        self.config = ctx.config  # read by megatron's schedules (get_model_config)
        self.model_type = ModelType.encoder_or_decoder
        self.first_layer, self.last_layer = first, last
        self.input_tensor: torch.Tensor | None = None
        layers: list[PipelineLayer] = []
        block_spec = layer_spec(spec) if first <= spec.num_layers and last >= 1 else None
        for i in range(first, last + 1):
            if i == 0:
                layers.append(EmbeddingLayer(ctx))
            elif i <= spec.num_layers:
                layers.append(BlockLayer(ctx, i, block_spec, recompute))
            elif i == final_norm_layer(spec):
                layers.append(FinalNormLayer(ctx))
            if i == head_layer(spec):
                layers.append(OutputLayer(ctx, shares_embedding=spec.tied_embeddings and first == 0))
        self.layers = torch.nn.ModuleList(layers)  # registers them (parameters, .to, state_dict)
        self.pipeline_layers: tuple[PipelineLayer, ...] = tuple(layers)  # the same modules, typed
        self.rotary = None
        if ctx.arch.position == "rope" and any(isinstance(m, BlockLayer) for m in layers):
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
            self.rotary = RotaryEmbedding(kv_channels=spec.head_dim, rotary_percent=1.0,
                                          rotary_base=ctx.arch.rotary_base,
                                          use_cpu_initialization=ctx.device.type == "cpu",
                                          cp_group=ctx.pg_collection.cp)
        self._masks: dict[int, torch.Tensor] = {}

    # -- megatron schedule interface
    def set_input_tensor(self, input_tensor: Any) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def _causal_mask(self, s: int) -> torch.Tensor:
        if s not in self._masks:  # megatron convention: True = masked out
            self._masks[s] = torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.ctx.device), 1)[None, None]
        return self._masks[s]

    def forward(self, tokens: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [s, b, h] to the next stage, or the per-token loss [b, s] on the last stage."""
        return self.run_layers(self.pipeline_layers, self.input_tensor, tokens, labels)

    def run_layers(self, layers: Sequence[PipelineLayer], h: torch.Tensor | None, tokens: torch.Tensor | None,
                   labels: torch.Tensor | None) -> torch.Tensor:
        """``layers`` (this stage's, in order) on input ``h``: the forward, and the profiler's one layer at a time."""
        rotary = None
        for layer in layers:
            if isinstance(layer, EmbeddingLayer):
                if tokens is None:
                    raise ValueError("the stage holding the embedding needs tokens")
                pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
                h = layer(tokens, pos)
                continue
            if h is None:
                raise ValueError(f"pipeline layer {layer.index} needs an input: set_input_tensor() first")
            if isinstance(layer, BlockLayer):
                if self.rotary is not None and rotary is None:
                    rotary = self.rotary(h.shape[0])
                h = layer(h, self._causal_mask(h.shape[0]), rotary)
            elif isinstance(layer, FinalNormLayer):
                h = layer(h)
            elif isinstance(layer, OutputLayer):
                if labels is None:
                    raise ValueError("the stage holding the LM head needs labels")
                h = layer(h, labels, self._tied_weight() if layer.linear.weight is None else None)
        if h is None:
            raise ValueError("a stage without layers has no output")
        return h

    def _tied_weight(self) -> torch.Tensor:
        """The embedding's weight, for an output layer that shares it (on the stage holding both)."""
        first = self.pipeline_layers[0]
        if not isinstance(first, EmbeddingLayer):
            raise RuntimeError("a tied output layer without the embedding on its stage")
        return first.embedding.word_embeddings.weight

    # -- canonical parameters
    def canonical_params(self) -> OrderedDict[str, torch.nn.Parameter]:
        """Megatron (GPTModel) name -> local parameter; a tied output weight is named after the embedding."""
        out: OrderedDict[str, torch.nn.Parameter] = OrderedDict()
        for layer in self.pipeline_layers:
            for local, p in layer.local_params().items():
                name = layer.prefix + local
                if isinstance(layer, OutputLayer) and layer.tied:
                    name = "embedding.word_embeddings.weight"
                out.setdefault(name, p)
        return out


def padded_vocab_size(spec: ModelSpec, tp_degrees: tuple[int, ...], divisor: int = VOCAB_DIVISOR) -> int:
    return spec.padded_vocab_size(tuple(tp_degrees), divisor)


def build_stage_module(spec: ModelSpec, first_layer: int, last_layer: int, *, tp_group: Any = None,
                       pg_collection: Any = None, dtype: str | torch.dtype = "fp32",
                       padded_vocab: int | None = None, device: str | torch.device | None = None,
                       seed: int | None = 1234, te: bool = False, recompute: bool = False,
                       init: bool = True) -> StageModule:
    """Build pipeline layers ``first_layer..last_layer`` of ``spec`` on this process.

    ``pg_collection``: the stage's process groups (the trainer's, from ``groups.plan_groups``). Without it,
    ``tp_group`` is this stage's TP group (None: a TP group of this process alone, the profiler's
    single-process case; torch.distributed must be initialised either way), and unless that group is of
    one rank, the call is collective (every rank creates every rank's group of one). ``seed`` gives the
    canonical layout-independent initialisation; ``None`` leaves a fast random init (profiling). ``init=False``
    leaves the values as megatron made them: a rank that loads a checkpoint next overwrites every one (drawing
    the canonical values is most of building a stage: 0.28 of 0.33 s for tiny-gpt).
    ``te=True`` (TransformerEngine's layer spec) is refused: it is untested here.
    """
    from megatron_patch.groups import collection, groups_of_one
    if te:
        check_layer_spec("te")
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    dev = torch.device(device) if device is not None else torch.device(
        f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    if pg_collection is None:
        alone = tp_group if tp_group is not None and dist.get_world_size(tp_group) == 1 else groups_of_one()
        pg_collection = collection(tp_group if tp_group is not None else alone, alone)
    tp_group = pg_collection.tp
    tp, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    padded = padded_vocab or padded_vocab_size(spec, (tp,))
    config = transformer_config(spec, tp=tp, dtype=dt, cuda=dev.type == "cuda")
    ctx = StageContext(spec=spec, arch=arch_of(spec), config=config, tp_group=tp_group,
                       pg_collection=pg_collection, tp=tp, tp_rank=tp_rank, padded_vocab=padded, device=dev)
    module = StageModule(ctx, first_layer, last_layer, recompute=recompute).to(dev)
    if dt != torch.float32:
        module.to(dtype=dt)  # as megatron's Float16Module: every float parameter and buffer (norms too)
    layout = {p.name: p for p in params_of_layers(param_layout(spec, padded), first_layer, last_layer)}
    params = module.canonical_params()
    if set(params) != set(layout):
        raise RuntimeError(f"megatron built parameters {sorted(set(params) ^ set(layout))} that megatron_patch.layout "
                           "does not describe (or the reverse): update layout.param_layout")
    with torch.no_grad():
        for name, p in params.items():
            info = layout[name]
            if tuple(p.shape) != local_shape(info, tp):
                raise RuntimeError(f"{name}: megatron shape {tuple(p.shape)} != layout {local_shape(info, tp)}")
            if not init:
                continue
            if seed is None:
                p.normal_(0.0, 0.02) if info.init_std is not None else p.fill_(info.init_value)
            else:
                p.copy_(init_shard(info, seed, spec.vocab_size, tp, tp_rank))  # this rank's shard only
    return module
