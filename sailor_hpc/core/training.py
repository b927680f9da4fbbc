"""A training run's options as they travel from the CLI to the ranks: schedule, data blend and split,
evaluation, logs (torch-free, so login nodes check them before a job is rendered or submitted).

One table (:data:`FLAGS`) names every option once: ``megatron_patch.launch`` builds its argparse options
from it, the click CLI (``sailor-hpc run``, ``sbatch``, ``submit``, ``plan --sbatch``) its own, and the
CLI hands what a user gave to the job as launch arguments (:func:`launch_args`), so the flag, its help
and its check exist in one place.

The learning-rate schedule is Megatron's ``OptimizerParamScheduler`` (linear warm-up from 0, then
constant / linear / cosine decay to ``min_lr``) evaluated at the *consumed samples* before a step, as
Megatron does (it counts warm-up and decay in samples; ``--lr-*-iters`` are multiplied by the global
batch). Being a pure function of ``consumed_samples``, which the checkpoint stores, a resumed or resized
run continues the schedule exactly; the resolved schedule is also stored, to refuse a resume with
another one. One difference from Megatron, on purpose: an fp16 step skipped for an overflow still
advances the schedule (Megatron holds it back), so the rate needs no counter beside the data position.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from sailor_hpc.core.errors import SailorError

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Flag:
    """One option of a training run: its launch flag, type, runtime default and help."""

    flag: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None  # values below are refused (inclusive bound)
    above: float | None = None  # values at or below are refused (exclusive bound: "positive" is above=0)
    maximum: float | None = None  # values above are refused (inclusive bound)
    required: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def range_text(self) -> str:
        """The values the flag takes, for a person: ``an integer >= 1``, ``an integer from 0 to 4294967295``."""
        kind = "an integer" if self.type is int else "a number"
        if self.minimum is not None and self.maximum is not None:
            return f"{kind} from {_number(self.minimum)} to {_number(self.maximum)}"
        bounds = [f"{op} {_number(v)}" for op, v in ((">=", self.minimum), (">", self.above), ("<=", self.maximum))
                  if v is not None]
        return f"{kind} {' and '.join(bounds)}" if bounds else kind


def _number(value: float) -> str:
    """A bound as a person writes it: 4294967295, not 4.29497e+09."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


OPTIMIZER_FLAGS: tuple[Flag, ...] = (
    Flag("--lr", float, 1e-3, "peak learning rate", above=0.0),
    Flag("--min-lr", float, 0.0, "learning rate at the end of the decay", minimum=0.0),
    Flag("--lr-decay-style", str, "constant", "decay after the warm-up", choices=DECAY_STYLES),
    Flag("--lr-warmup-iters", int, 0, "linear warm-up from 0 over this many steps", minimum=0),
    Flag("--lr-warmup-samples", int, 0, "linear warm-up over this many samples (instead of steps)", minimum=0),
    Flag("--lr-decay-iters", int, None, "steps from 0 to the end of the decay (default: --steps)", minimum=1),
    Flag("--lr-decay-samples", int, None, "samples from 0 to the end of the decay (instead of steps)", minimum=1),
    Flag("--weight-decay", float, 0.01, "decoupled weight decay (AdamW; none on biases and norms)", minimum=0.0),
    Flag("--clip-grad", float, 1.0, "clip the global gradient norm (all stages and replicas) to this; 0: off",
         minimum=0.0),
    Flag("--adam-eps", float, 1e-8, "Adam's epsilon", above=0.0),
)
DATA_FLAGS: tuple[Flag, ...] = (
    Flag("--split", str, "100,0,0", "train,valid,test weights over each dataset's documents (Megatron's "
                                    "--split, e.g. 949,50,1)"),
    Flag("--eval-interval", int, 0, "validation loss every N steps and at the end (0: none)", minimum=0),
    Flag("--eval-iters", int, 1, "global batches of the valid split per evaluation", minimum=1),
)
LOG_FLAGS: tuple[Flag, ...] = (
    Flag("--log-interval", int, 1, "a human log line (rank 0, stderr) every N steps", minimum=1),
    Flag("--metrics-file", str, None, "JSON-lines metrics of rank 0 (default: SAVE/metrics.jsonl)"),
    Flag("--tensorboard-dir", str, None, "also write TensorBoard scalars here (needs the tensorboard package)"),
)
FLAGS: tuple[Flag, ...] = OPTIMIZER_FLAGS + DATA_FLAGS + LOG_FLAGS
DEFAULTS: dict[str, Any] = {f.dest: f.default for f in FLAGS}


def check_value(flag: Flag, value: Any) -> None:
    """Refuse a value outside the flag's range or choices (naming the flag and the fix)."""
    if value is None:
        return
    if flag.choices is not None and value not in flag.choices:
        raise SailorError(f"unknown value {value!r}", field=flag.flag, fix=f"use one of {', '.join(flag.choices)}")
    if flag.type not in (int, float):
        return
    fix = f"give {flag.flag} {flag.range_text()}"
    if not math.isfinite(value):
        raise SailorError(f"must be a finite number, got {value!r}", field=flag.flag, fix=fix)
    for bound, what, outside in ((flag.minimum, "at least", value.__lt__), (flag.above, "more than", value.__le__),
                                 (flag.maximum, "at most", value.__gt__)):
        if bound is not None and outside(bound):
            raise SailorError(f"must be {what} {_number(bound)}, got {value!r}", field=flag.flag, fix=fix)


def check_values(values: Mapping[str, Any]) -> None:
    """Check every given option (by dest name) and how they combine; raises :class:`SailorError`."""
    for f in FLAGS:
        check_value(f, values.get(f.dest))
    merged = {**DEFAULTS, **{k: v for k, v in values.items() if v is not None}}
    for unit in ("warmup", "decay"):
        if merged[f"lr_{unit}_iters"] and merged[f"lr_{unit}_samples"]:
            raise SailorError(f"both --lr-{unit}-iters and --lr-{unit}-samples given", field=f"--lr-{unit}-samples",
                              fix="count the schedule in steps or in samples, not both")
    if merged["min_lr"] > merged["lr"]:
        raise SailorError(f"--min-lr {merged['min_lr']} exceeds --lr {merged['lr']}", field="--min-lr",
                          fix="the decay ends at --min-lr: give it a value no larger than the peak --lr")
    split = parse_split(merged["split"])
    if merged["eval_interval"] and split[1] == 0:
        raise SailorError("--eval-interval needs a valid split", field="--split",
                          fix="give the valid split a weight, e.g. --split 949,50,1")


def launch_args(values: Mapping[str, Any]) -> list[str]:
    """``megatron_patch.launch`` arguments for the options a user gave (None: not given, the default)."""
    check_values(values)
    out: list[str] = []
    for f in FLAGS:
        v = values.get(f.dest)
        if v is not None:
            out += [f.flag, repr(v) if f.type is float else str(v)]
    return out


# -- learning-rate schedule

@dataclass(frozen=True)
class LrSchedule:
    """Megatron's schedule in samples: warm-up from 0 to ``lr``, then decay to ``min_lr`` by sample ``decay``."""

    lr: float
    min_lr: float = 0.0
    style: str = "constant"
    warmup: int = 0  # samples
    decay: int = 0  # samples from 0 to the end of the decay (0 for a constant schedule)

    @classmethod
    def resolve(cls, values: Mapping[str, Any], global_batch: int, steps: int) -> LrSchedule:
        """The schedule of a run training to step ``steps`` at ``global_batch`` samples per step."""
        v = {**DEFAULTS, **{k: x for k, x in values.items() if x is not None}}
        warmup = v["lr_warmup_samples"] or v["lr_warmup_iters"] * global_batch
        if v["lr_decay_samples"] is not None:
            decay = v["lr_decay_samples"]
        else:
            decay = (v["lr_decay_iters"] if v["lr_decay_iters"] is not None else steps) * global_batch
        if v["lr_decay_style"] != "constant" and decay <= warmup:
            raise SailorError(f"the decay ends at sample {decay}, not after the warm-up's {warmup}",
                              field="--lr-decay-iters", fix="decay over more steps than the warm-up")
        if v["lr_decay_style"] == "constant":
            decay = 0  # unused: a constant schedule is the same whatever step the run goes to
        return cls(lr=v["lr"], min_lr=v["min_lr"], style=v["lr_decay_style"], warmup=warmup, decay=decay)

    def lr_at(self, samples: int) -> float:
        """Learning rate of the step that starts after ``samples`` consumed samples (Megatron's get_lr)."""
        if self.warmup > 0 and samples <= self.warmup:
            return self.lr * samples / self.warmup
        if self.style == "constant":
            return self.lr
        if samples > self.decay:
            return self.min_lr
        ratio = (samples - self.warmup) / (self.decay - self.warmup)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- data: blend of prefixes, train/valid/test split

SPLITS = ("train", "valid", "test")


def parse_split(text: str) -> tuple[float, float, float]:
    """``"949,50,1"`` -> normalised (train, valid, test) weights; missing parts are 0, as Megatron's."""
    try:
        parts = [float(x) for x in str(text).replace("/", ",").split(",")]
    except ValueError:
        raise SailorError(f"{text!r} is not comma-separated numbers", field="--split", fix="e.g. --split 949,50,1") from None
    if not 1 <= len(parts) <= 3 or any(not math.isfinite(p) or p < 0 for p in parts) or sum(parts) <= 0:
        raise SailorError(f"{text!r} needs 1 to 3 non-negative weights with a positive sum", field="--split",
                          fix="e.g. --split 949,50,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return parts[0] / total, parts[1] / total, parts[2] / total


def split_bounds(split: tuple[float, float, float], documents: int) -> list[tuple[int, int]]:
    """Document ranges of train/valid/test: Megatron's ``get_split_indices`` (rounded cumulative shares,
    the rounding error taken from the end)."""
    idx = [0]
    for share in split:
        idx.append(idx[-1] + int(round(share * documents)))
    diff = idx[-1] - documents
    idx = [idx[0]] + [i - diff for i in idx[1:]]
    return [(idx[k], idx[k + 1]) for k in range(3)]


@dataclass(frozen=True)
class DataBlend:
    """Dataset prefixes with weights, as Megatron's ``--data-path [W1] P1 [W2 P2 ...]``."""

    prefixes: tuple[str, ...]
    weights: tuple[str, ...]  # as given (decimal text): exact fractions decide the interleaving

    @classmethod
    def parse(cls, tokens: Sequence[str] | str, field: str = "--data") -> DataBlend:
        """A single prefix, or ``W1 P1 W2 P2 ...``. A string of several words starting with a number is a
        blend (split on whitespace), any other string one prefix (a path with spaces stays whole). One
        argument is read as that string, so ``--data '0.7 A 0.3 B'`` is the same blend on every command."""
        if not isinstance(tokens, str) and len(tokens) == 1:
            tokens = tokens[0]
        if isinstance(tokens, str):
            words = tokens.split()
            tokens = words if len(words) > 1 and _is_weight(words[0]) else [tokens]
        tokens = list(tokens)
        if len(tokens) == 1:
            if not tokens[0].strip():
                raise SailorError("empty dataset prefix", field=field)
            return cls((tokens[0],), ("1",))
        if not tokens or len(tokens) % 2 or not all(map(_is_weight, tokens[::2])):
            raise SailorError(f"{' '.join(tokens)!r} is neither one prefix nor weight-prefix pairs", field=field,
                              fix="e.g. --data PREFIX or --data '0.7 PREFIX_A 0.3 PREFIX_B'")
        weights, prefixes = tuple(tokens[::2]), tuple(tokens[1::2])
        if sum(Fraction(w) for w in weights) <= 0:
            raise SailorError("the blend's weights sum to 0", field=field, fix="give a dataset a positive weight")
        if len(set(prefixes)) != len(prefixes):
            raise SailorError("a prefix appears twice in the blend", field=field, fix="add up its weights instead")
        return cls(prefixes, weights)

    def tokens(self) -> list[str]:
        """The launch arguments: the prefix alone, or the pairs."""
        if len(self.prefixes) == 1:
            return [self.prefixes[0]]
        return [x for pair in zip(self.weights, self.prefixes) for x in pair]

    def text(self) -> str:
        return " ".join(self.tokens())

    def with_prefixes(self, prefixes: Sequence[str]) -> DataBlend:
        return DataBlend(tuple(prefixes), self.weights)

    def fractions(self) -> list[Fraction]:
        ws = [Fraction(w) for w in self.weights]
        return [w / sum(ws) for w in ws]


def check_dataset_prefix(prefix: str | Path, field: str = "--data") -> None:
    """``PREFIX.bin`` and ``PREFIX.idx`` both exist: the one check of a dataset path, login side and on every
    rank (megatron's reader otherwise fails an assert deep inside); a prefix given with its ``.bin``/``.idx``
    suffix is named with the fix."""
    text = str(prefix)
    missing = [p for p in (Path(text + ".bin"), Path(text + ".idx")) if not p.is_file()]
    if not missing:
        return
    stem, suffix = os.path.splitext(text)
    if suffix in (".bin", ".idx") and Path(stem + ".bin").is_file() and Path(stem + ".idx").is_file():
        raise SailorError(f"{text!r} is a file of the dataset, not its prefix", file=text, field=field,
                          fix=f"give the prefix without the suffix: {stem}")
    raise SailorError(f"no indexed dataset at this prefix ({', '.join(p.name for p in missing)} missing)", file=text,
                      field=field, fix="build one with `python -m megatron_patch.data PREFIX FILES...`, or check "
                                       "the path (a blend is '0.7 PREFIX_A 0.3 PREFIX_B')")


def _is_weight(text: str) -> bool:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return False
    return value >= 0


def eval_due(step: int, interval: int, last: int) -> bool:
    """Evaluate after ``step``: every ``interval`` steps and after the run's last step (0: never)."""
    return interval > 0 and (step % interval == 0 or step == last)
