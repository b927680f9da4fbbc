"""The model catalog: transformer shapes that the profiler measures, the simulator prices and
megatron_patch trains.

A model is cut into *pipeline layers*, the unit a plan assigns to stages (Sailor's convention, kept so
its profiles stay usable): layer 0 is the embedding, layers 1..T the transformer blocks, then the
model's tail (final norm + LM head + loss; Llama keeps the final RMSNorm as its own layer, as in
Sailor's profiles).

Names are keys (profile archive, Sailor's data, plans), so they stay; what the runtime builds from an
entry is said by :attr:`ModelSpec.display_name` and :attr:`ModelSpec.architecture`. The ``opt`` and
``gpt-neo`` entries are pre-LN GPTs of those models' shapes, not OPT (post-LN, embedding projection) or
GPT-Neo (local attention): published weights of those models do not load into them. ``llama`` is
Llama's architecture, and exchanges weights with Hugging Face (``megatron_patch.hf_llama``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from sailor_hpc.core.errors import SailorError

_SHAPE_ONLY = ("opt", "gpt-neo")  # families the runtime trains as a pre-LN GPT of their shape
_ARCHITECTURES = {
    "gpt": "GPT: pre-LN, LayerNorm, GELU, learned positions, tied embeddings",
    "opt": "GPT of OPT's shape: pre-LN, LayerNorm, ReLU, learned positions, tied embeddings "
           "(not OPT's post-LN with embedding projection)",
    "gpt-neo": "GPT of GPT-Neo's shape: pre-LN, LayerNorm, GELU, learned positions, global attention in "
               "every block (not GPT-Neo's alternating local attention)",
    "llama": "Llama: pre-RMSNorm, SwiGLU, RoPE, grouped-query attention, untied head, no biases "
             "(Hugging Face import/export)",
}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer."""

    name: str
    num_layers: int  # transformer blocks T
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_len: int
    family: str  # "opt", "gpt-neo", "llama", "gpt"
    num_kv_heads: int | None = None
    tail_layers: int = 1  # pipeline layers after the blocks
    tied_embeddings: bool = True
    aliases: tuple[str, ...] = field(default_factory=tuple)

    @property
    def display_name(self) -> str:
        """What the runtime trains under this name: "GPT (OPT-350M shape)" where it is not the real one."""
        return f"GPT ({self.name} shape)" if self.family in _SHAPE_ONLY else self.name

    @property
    def architecture(self) -> str:
        """One line on the network the runtime builds (listings, ``--model`` help)."""
        return _ARCHITECTURES[self.family]

    @property
    def num_pipeline_layers(self) -> int:
        """L: embedding + blocks + tail; plans assign layers 0..L-1 to stages."""
        return 1 + self.num_layers + self.tail_layers

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def padded_vocab_size(self, tp_degrees: tuple[int, ...] = (1,), divisor: int = 128) -> int:
        """Vocabulary padded so every TP degree in a plan shards it evenly (one size for all pipelines)."""
        lcm = 1
        for t in tp_degrees:
            lcm = lcm * t // math.gcd(lcm, t)
        multiple = divisor * lcm
        return -(-self.vocab_size // multiple) * multiple

    def block_params(self) -> int:
        """Parameters of one transformer block (weights + biases + norms), for sanity checks."""
        h, f = self.hidden_size, self.ffn_hidden_size
        kv = self.num_kv_heads or self.num_heads
        qkv = h * (h + 2 * kv * self.head_dim)
        if self.family == "llama":
            return qkv + h * h + 3 * h * f + 2 * h
        return qkv + (h + 2 * kv * self.head_dim) + h * h + h + 2 * h * f + f + h + 4 * h


CATALOG: tuple[ModelSpec, ...] = (
    ModelSpec("OPT-350M", num_layers=24, hidden_size=1024, num_heads=16, ffn_hidden_size=4096,
              vocab_size=50272, seq_len=2048, family="opt", aliases=("OPT-350", "opt-350m")),
    ModelSpec("GPT-Neo-2.7B", num_layers=32, hidden_size=2560, num_heads=20, ffn_hidden_size=10240,
              vocab_size=50257, seq_len=2048, family="gpt-neo", aliases=("GPT-Neo-2.7", "gpt-neo-2.7b")),
    ModelSpec("Llama-3-8B", num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=14336,
              vocab_size=128256, seq_len=8192, family="llama", num_kv_heads=8, tail_layers=2,
              tied_embeddings=False, aliases=("LLAMA-3-8", "llama-3-8b")),
    ModelSpec("OPT-30B", num_layers=48, hidden_size=7168, num_heads=56, ffn_hidden_size=28672,
              vocab_size=50272, seq_len=2048, family="opt", aliases=("OPT-30", "opt-30b")),
    # GPT-3 XL's shape (Brown et al. 2020): the ~1B model of benchmarks/gpu_check.sh
    ModelSpec("GPT-1.3B", num_layers=24, hidden_size=2048, num_heads=16, ffn_hidden_size=8192,
              vocab_size=50257, seq_len=2048, family="gpt", aliases=("gpt-1.3b", "gpt3-xl")),
    ModelSpec("tiny-gpt", num_layers=4, hidden_size=64, num_heads=4, ffn_hidden_size=256,
              vocab_size=256, seq_len=32, family="gpt", aliases=("tiny",)),
    # a Llama small enough for CPU tests of the Hugging Face round trip (4 query heads over 2 KV groups)
    ModelSpec("tiny-llama", num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=96,
              vocab_size=256, seq_len=32, family="llama", num_kv_heads=2, tail_layers=2,
              tied_embeddings=False),
)

_BY_KEY = {key.lower(): m for m in CATALOG for key in (m.name, *m.aliases)}


def model_names() -> list[str]:
    return [m.name for m in CATALOG]


def get_model(name: str) -> ModelSpec:
    """Look a model up by its name or one of its aliases (case-insensitive)."""
    try:
        return _BY_KEY[name.lower()]
    except KeyError:
        raise SailorError(f"unknown model {name!r}", field="model",
                          fix=f"use one of {', '.join(model_names())}") from None
