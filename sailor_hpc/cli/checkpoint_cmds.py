"""``sailor-hpc checkpoint``: move a run's checkpoints in and out of the project (Hugging Face Llama).

Thin: the conversion is ``megatron_patch.hf_llama`` (torch), imported inside the commands so this
module, like the whole CLI, imports on a login node without torch.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

import click

from sailor_hpc.cli.app import main
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.precision import DTYPES


def _converter() -> ModuleType:
    """``megatron_patch.hf_llama``, or a clear error on a machine without the runtime extra."""
    try:
        from megatron_patch import hf_llama
    except ImportError as exc:
        raise SailorError(f"checkpoint conversion needs torch ({exc})", field="environment",
                          fix="run it where the runtime extra is installed: pip install 'sailor-hpc[runtime]'") \
            from None
    return hf_llama


@main.group("checkpoint")
def checkpoint() -> None:
    """Export checkpoints to Hugging Face and import Hugging Face weights (Llama-architecture models)."""


@checkpoint.command("export")
@click.argument("ckpt", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--to", "fmt", type=click.Choice(["hf"]), required=True,
              help="Target format: hf = config.json + model.safetensors that transformers' LlamaForCausalLM loads.")
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True,
              help="Dtype of the exported weights (the checkpoint holds fp32 masters).")
def export_cmd(ckpt: Path, out: Path, fmt: str, dtype: str) -> None:
    """Write checkpoint CKPT (a step_* folder, or a --save root: its newest complete one) to folder OUT.

    Only Llama-architecture models export (sailor-hpc models); OUT must be new or empty."""
    done = _converter().export_hf(ckpt, out, dtype)
    for line in done.choice.warnings():  # an older step exported is said, never silent
        click.echo(f"warning: {line}", err=True)
    click.echo(f"exported step {done.step} ({done.checkpoint}) to {done.path} ({fmt}, {dtype})")


@checkpoint.command("import")
@click.argument("hf_dir", type=click.Path(path_type=Path))
@click.option("--model", required=True, help="Catalog Llama whose shapes the weights have (sailor-hpc models).")
@click.option("--save", required=True, type=click.Path(path_type=Path),
              help="New checkpoint root; train with --load (or --auto-resume --save) on it under any plan.")
def import_cmd(hf_dir: Path, model: str, save: Path) -> None:
    """Import a Hugging Face Llama folder (config.json + safetensors) as a step-0 checkpoint.

    The checkpoint has no optimizer state (manifest "optimizer_state": false): a run loading it starts
    Adam fresh, at step 0 and sample 0, under any plan."""
    path = _converter().import_hf(hf_dir, model, save)
    click.echo(f"imported {hf_dir} as {path}")
