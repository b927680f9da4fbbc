"""``sailor-hpc models``: the catalog, each entry named for what the runtime builds from it."""
from __future__ import annotations

import click

from sailor_hpc.cli.app import main
from sailor_hpc.cli.output import echo_json, json_option, table
from sailor_hpc.core.models import CATALOG


@main.command("models")
@json_option
def models_cmd(as_json: bool) -> None:
    """List the models --model accepts: name, aliases, what is built, shape.

    OPT and GPT-Neo entries are pre-LN GPTs of those shapes (their published weights do not load);
    Llama entries are Llama and exchange weights with Hugging Face (sailor-hpc checkpoint)."""
    rows = [{"name": m.name, "aliases": list(m.aliases), "model": m.display_name, "architecture": m.architecture,
             "layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads,
             "kv_heads": m.num_kv_heads or m.num_heads, "ffn": m.ffn_hidden_size, "vocab": m.vocab_size,
             "seq_len": m.seq_len} for m in CATALOG]
    if as_json:
        echo_json(rows)
        return
    click.echo(table(("--model", "aliases", "what it is", "layers", "hidden", "heads/kv", "ffn", "vocab"),
                     [(m.name, ",".join(m.aliases) or "-", m.display_name, m.num_layers, m.hidden_size,
                       f"{m.num_heads}/{m.num_kv_heads or m.num_heads}", m.ffn_hidden_size, m.vocab_size)
                      for m in CATALOG]))
    click.echo()
    for m in CATALOG:
        click.echo(f"{m.display_name}: {m.architecture}")
