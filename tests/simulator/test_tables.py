"""Prefix-sum tables and the errors for profile points the archive lacks."""
from __future__ import annotations

import numpy as np
import pytest

from sailor_hpc.core.archive import ComputeEntry
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from simulator.tables import ProfileTables
from tests.simulator.conftest import TINY_FWD, TINY_PARAMS, TINY_UPDATE, tiny_archive


def test_prefix_sums_equal_direct_sums(sailor_archive):
    t = ProfileTables(sailor_archive, get_model("OPT-350M"))
    c = t.compute("GH-96", 8, 4)
    raw = sailor_archive.compute[("OPT-350M", "GH-96", "fp32")][(8, 4)].times
    for a, b in [(0, 25), (0, 4), (5, 11), (19, 25), (7, 7)]:
        assert c.fwd(a, b) == pytest.approx(raw[a:b + 1, 0].sum(), rel=1e-12)
        assert c.bwd(a, b) == pytest.approx(raw[a:b + 1, 1].sum(), rel=1e-12)
    m = t.memory(4)
    rows = sailor_archive.memory["OPT-350M"][4].table
    assert m.params(5, 11) == pytest.approx(rows[5:12, 0].sum())
    assert m.max_layer_act(19, 25) == rows[19:26, 3].max()


def test_update_scales_with_the_stage_share_of_parameters(tiny):
    t = ProfileTables(tiny, get_model("tiny-gpt"))
    c = t.compute("G1", 1, 1)
    profiled = TINY_PARAMS[0] + TINY_PARAMS[1] + TINY_PARAMS[2] + TINY_PARAMS[5]  # embedding, 2 blocks, tail
    assert c.update_params == profiled
    assert t.update_seconds(c, 0, 5) == pytest.approx(TINY_UPDATE * TINY_PARAMS.sum() / profiled)
    # SGD with momentum streams 5 fp32 words per parameter where Adam streams 7
    assert t.update_seconds(c, 0, 5, "sgd") == pytest.approx(TINY_UPDATE * 5 / 7 * TINY_PARAMS.sum() / profiled)
    assert c.fwd(1, 4) == pytest.approx(TINY_FWD[1:5].sum())


def test_missing_point_names_the_entry_and_the_fix(tiny):
    t = ProfileTables(tiny, get_model("tiny-gpt"))
    with pytest.raises(SailorError) as exc:
        t.compute("G1", 4, 1)
    assert exc.value.field == "compute/tiny-gpt/G1/mbs4_tp1"
    assert "sailor-hpc profile" in exc.value.fix and "mbs1/tp1" in exc.value.message
    with pytest.raises(SailorError) as exc:
        t.compute("G9", 1, 1)
    assert "G9" in exc.value.message
    with pytest.raises(SailorError) as exc:
        t.memory(8)
    assert exc.value.field == "memory/tiny-gpt/tp8"


def test_failed_point_and_dtype_mismatch():
    a = tiny_archive()
    a.add(ComputeEntry("tiny-gpt", "G1", 8, 1, np.zeros((6, 3)), {}, status="failed", reason="CUDA out of memory"))
    t = ProfileTables(a, get_model("tiny-gpt"))
    with pytest.raises(SailorError, match="out of memory"):
        t.compute("G1", 8, 1)
    with pytest.raises(SailorError, match="bf16") as exc:
        t.compute("G1", 1, 1, dtype="bf16")
    assert "--dtype bf16" in exc.value.fix


def test_malformed_entry_is_rejected():
    a = tiny_archive()
    a.add(ComputeEntry("tiny-gpt", "G1", 4, 1, np.ones((5, 3)), {}))
    with pytest.raises(SailorError, match="shape"):
        ProfileTables(a, get_model("tiny-gpt")).compute("G1", 4, 1)


def test_a_layer_never_takes_longer_on_fewer_samples():
    """A point slower than a larger micro-batch's point of the same layer is noise: the table keeps the
    running minimum over the larger profiled sizes (per layer, forward and backward apart)."""
    archive = tiny_archive()
    noisy = archive.compute[("tiny-gpt", "G1", "fp32")][(1, 1)].times.copy()
    noisy[5, 0] = 0.050  # head forward at mbs 1 slower than at mbs 2 (0.008)
    noisy[2, 1] = 0.030  # a block's backward too (mbs 2: 0.040 -> kept, it is larger)
    archive.add(ComputeEntry("tiny-gpt", "G1", 1, 1, noisy, {"source": "test"}))
    c = ProfileTables(archive, get_model("tiny-gpt")).compute("G1", 1, 1)
    assert c.fwd(5, 5) == pytest.approx(2 * TINY_FWD[5])
    assert c.bwd(2, 2) == pytest.approx(0.030)
    assert c.fwd(0, 4) == pytest.approx(TINY_FWD[:5].sum())


def test_sailor_profile_is_monotone_in_micro_batch_size(sailor_archive):
    t = ProfileTables(sailor_archive, get_model("OPT-350M"))
    sizes = sorted(b for b, tp in sailor_archive.compute[("OPT-350M", "GH-96", "fp32")] if tp == 4)
    for small, large in zip(sizes, sizes[1:]):
        a, b = t.compute("GH-96", small, 4), t.compute("GH-96", large, 4)
        for x, y in ((a.cum_fwd, b.cum_fwd), (a.cum_bwd, b.cum_bwd)):
            assert (np.diff(x) <= np.diff(y) + 1e-12).all()  # cumsum round-off
    raw = sailor_archive.compute[("OPT-350M", "GH-96", "fp32")][(1, 4)].times
    assert t.compute("GH-96", 1, 4).fwd(0, 25) < raw[:, 0].sum()  # the published mbs-1 point is not monotone


def test_chain_timing_turns_into_a_saving_per_layer_boundary():
    """A point whose measured layers (embedding, blocks 1-2, head: 4 layers) ran as one chain 3 ms faster
    forward and 1.5 ms slower backward than alone: 1 ms saved / 0.5 ms lost per boundary in any stage."""
    archive = tiny_archive()
    base = archive.compute[("tiny-gpt", "G1", "fp32")][(1, 1)]
    measured = [0, 1, 2, 5]
    fwd_alone, bwd_alone = TINY_FWD[measured].sum(), 2 * TINY_FWD[measured].sum()
    prov = {"source": "test", "stack_layers": 4, "stack_fwd_s": fwd_alone - 0.003, "stack_bwd_s": bwd_alone + 0.0015}
    archive.add(ComputeEntry("tiny-gpt", "G1", 1, 1, base.times, prov))
    assert ProfileTables(archive, get_model("tiny-gpt")).compute("G1", 1, 1).fwd(1, 4) == pytest.approx(
        TINY_FWD[1:5].sum())  # not asked for: isolated sums
    c = ProfileTables(archive, get_model("tiny-gpt")).compute("G1", 1, 1, chain_timing=True)
    assert (c.boundary_fwd, c.boundary_bwd) == pytest.approx((0.001, -0.0005))
    assert c.fwd(3, 3) == pytest.approx(TINY_FWD[3])  # one layer: no boundary
    assert c.fwd(1, 4) == pytest.approx(TINY_FWD[1:5].sum() - 3 * 0.001)
    assert c.bwd(0, 5) == pytest.approx(2 * TINY_FWD.sum() + 5 * 0.0005)
    first, last = np.array([0, 1, 2]), np.array([5, 1, 4])  # vectorised ranges give the same numbers
    assert np.allclose(c.fwd(first, last), [c.fwd(0, 5), c.fwd(1, 1), c.fwd(2, 4)])
    # a saving never takes a stage below a third of its isolated sum (no extrapolation to zero)
    big = {**prov, "stack_fwd_s": 0.0}
    archive.add(ComputeEntry("tiny-gpt", "G1", 1, 1, base.times, big))
    c = ProfileTables(archive, get_model("tiny-gpt")).compute("G1", 1, 1, chain_timing=True)
    assert c.fwd(0, 5) == pytest.approx(TINY_FWD.sum() / 3)


def test_a_point_of_all_zero_times_is_refused_not_divided_by():
    a = tiny_archive()
    a.add(ComputeEntry("tiny-gpt", "G1", 4, 1, np.zeros((6, 3)), {}))
    with pytest.raises(SailorError, match="no forward or no backward time") as exc:
        ProfileTables(a, get_model("tiny-gpt")).compute("G1", 4, 1)
    assert exc.value.field == "compute/tiny-gpt/G1/mbs4_tp1" and "re-profile" in exc.value.fix
