"""Hugging Face ``config.json``: tiny-llama's config as export writes it, mutated, through the reader
``sailor-hpc checkpoint import`` uses (``read_config`` + ``check_config``) and through the command itself,
which must refuse before it writes anything under ``--save``."""
from __future__ import annotations

import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_patch.hf_llama import CONFIG, check_config, hf_config, read_config
from sailor_hpc.core.models import get_model
from tests.fuzz.harness import Doc, cli_exits_cleanly, count, examples, loads_or_refuses, mutated_bytes, mutated_doc, scratch

MODEL = get_model("tiny-llama")
CONFIG_DOC: Doc = hf_config(MODEL)
CONFIG_BYTES = json.dumps(CONFIG_DOC, indent=2).encode()

config_files = st.one_of(mutated_doc(CONFIG_DOC).map(lambda d: json.dumps(d, indent=2).encode()),
                         mutated_bytes(CONFIG_BYTES))


@settings(max_examples=examples(250))
@given(config_files)
@example(json.dumps({**CONFIG_DOC, "rope_scaling": []}).encode())  # was an AttributeError
@example(json.dumps({**CONFIG_DOC, "rope_theta": ""}).encode())  # was a ValueError
@example(json.dumps({**CONFIG_DOC, "head_dim": None, "hidden_size": None}).encode())  # was a TypeError
def test_hf_config_loads_or_names_the_file(data: bytes) -> None:
    count("HF config.json")
    with scratch({CONFIG: data}) as root, loads_or_refuses("HF config.json", root / CONFIG):
        check_config(MODEL, read_config(root), root / CONFIG)


@settings(max_examples=examples(40))
@given(config_files)
def test_checkpoint_import_exits_2_and_writes_nothing(data: bytes) -> None:
    count("HF config.json (CLI)")
    # no weights beside it: a config that passes is refused for the missing safetensors, naming the folder;
    # either way nothing is written under --save (scratch checks that no file appeared)
    with scratch({f"hf/{CONFIG}": data}) as root:
        cli_exits_cleanly("HF config.json (CLI)", ["checkpoint", "import", str(root / "hf"), "--model", MODEL.name,
                                                   "--save", str(root / "ckpt")], root / "hf")
