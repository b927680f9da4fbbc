"""Resume memory: a TP rank reads only its shard of each checkpoint tensor, one layer file at a time.

Checkpoint files hold full tensors (any plan loads any checkpoint); a rank at TP t used to read its
layers' files whole (~44 GB per rank for a 6-layer OPT-30B stage). Files are now memory-mapped and
sliced, so the pages read (and resident) are ~1/t of a layer's bytes.
"""
from __future__ import annotations

import io
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from megatron_patch.checkpoint_io import FIELDS, CheckpointReader, layer_file, stored_shard  # noqa: E402
from megatron_patch.layout import ParamInfo, local_shape, shard_of  # noqa: E402
from sailor_hpc.core import checkpoint as ck  # noqa: E402
from tests.megatron_patch.conftest import memory_growth  # noqa: E402

VOCAB = 4000  # stored rows of the vocabulary-sized tensor; the plan pads it to 4096
# a column-parallel weight, a row-parallel one with 256 KiB rows, a padded vocabulary, a replicated norm
INFOS = (ParamInfo("col.weight", 1, (4096, 1024), 0), ParamInfo("row.weight", 1, (64, 65536), 1),
         ParamInfo("emb.weight", 1, (4096, 1024), 0, vocab_dim=0), ParamInfo("norm.weight", 1, (1024,), None))
INFOS_CODE = ("from megatron_patch.layout import ParamInfo\n"
              "INFOS = (ParamInfo('col.weight', 1, (4096, 1024), 0), ParamInfo('row.weight', 1, (64, 65536), 1),\n"
              "         ParamInfo('emb.weight', 1, (4096, 1024), 0, vocab_dim=0),\n"
              "         ParamInfo('norm.weight', 1, (1024,), None))\n")


def stored(info: ParamInfo, field: int) -> torch.Tensor:
    shape = list(info.shape)
    if info.vocab_dim is not None:
        shape[info.vocab_dim] = VOCAB
    return torch.arange(field, field + torch.Size(shape).numel(), dtype=torch.float32).view(shape) / 1e6


def padded(info: ParamInfo, t: torch.Tensor) -> torch.Tensor:
    if info.vocab_dim is None:
        return t
    return torch.cat([t, torch.zeros(info.shape[0] - t.shape[0], *t.shape[1:])])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One layer file as ``checkpoint_io.save`` writes it (full tensors, real vocabulary), published."""
    root = tmp_path_factory.mktemp("ckpt")
    tmp = ck.start_tmp(root, 1)
    buf = io.BytesIO()
    torch.save({i.name: {k: stored(i, f) for f, k in enumerate(FIELDS)} for i in INFOS}, buf)
    files = {layer_file(1): ck.write_file(tmp / layer_file(1), buf.getvalue())}
    params = {i.name: {"file": layer_file(1), "shape": list(stored(i, 0).shape)} for i in INFOS}
    return ck.publish(tmp, {"step": 1, "consumed_samples": 8, "files": files, "params": params})


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_read_from_the_mapped_file_are_the_padded_tensors_shards(checkpoint: Path, tp: int) -> None:
    reader = CheckpointReader(str(checkpoint))
    for r in range(tp):
        got = dict(reader.shards(INFOS, tp, r))
        for f, k in enumerate(FIELDS):
            for info in INFOS:
                expect = shard_of(padded(info, stored(info, f)), info, tp, r)
                assert torch.equal(got[info.name][k], expect), (info.name, k, tp, r)
                assert tuple(got[info.name][k].shape) == local_shape(info, tp)
    assert stored_shard(stored(INFOS[2], 0), INFOS[2], 4, 3)[VOCAB - 3072:].abs().sum() == 0  # padding rows


def test_a_tp4_rank_materialises_a_quarter_of_the_layer(checkpoint: Path) -> None:
    """TP rank 1 of 4 keeps its shards: ~1/4 of the file in private memory (the whole-file load: all of it).

    Private (anonymous) memory is what the rank materialises; the mapped file pages RSS also shows are
    page cache, shared by the node's ranks and reclaimable (the kernel maps whole folios around a
    touched page, so strided row-parallel slices map more than they copy)."""
    size = (checkpoint / layer_file(1)).stat().st_size
    setup = (INFOS_CODE + "import torch\nfrom megatron_patch.checkpoint_io import CheckpointReader\n"
             f"reader = CheckpointReader({str(checkpoint)!r}, deep=False)\n")
    tp4 = memory_growth(setup, "state = dict(reader.shards(INFOS, 4, 1))")
    whole = memory_growth(setup, f"state = torch.load({str(checkpoint / layer_file(1))!r}, weights_only=True)")
    print(f"resume of a {size / 2**20:.0f} MiB layer file, private memory kept: TP rank 1 of 4 "
          f"{tp4['private'] / 2**20:.1f} MiB (peak RSS incl. mapped page cache {tp4['peak'] / 2**20:.1f}), "
          f"whole-file load (before) {whole['private'] / 2**20:.1f} MiB")
    assert 0.2 * size < tp4["private"] < 0.3 * size
    assert whole["private"] > 0.95 * size
