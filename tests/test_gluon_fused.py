"""gluon_sm90's warp-specialized path: the fused recurrence + output kernel
(backends/gluon_sm90/fused.py), forming the chunk inverses itself as shipped, or fed by the
T kernel (backends/gluon_common/wy_t.py) in its two-launch build (``fused.AUX_T`` off).

CPU: when the planner takes the path (programs against the SM count, head dims, context
parallelism, the engine; with the l2 norm, on normalized copies of q and k), its launches as dry runs (grids over chunk slots
and (sequence, v-head) pairs, descriptors, the T tiles' rows), and that the kernel's chunk
slots are the ones the T kernel writes. The compiles for sm_90a run in
tests/test_gluon_aot.py (both kernels are in gluon_sm90's AOT list).

GPU (sm_90 only): the public call on this path against the float32 reference, with
NaN-poisoned memory, over lengths with tails and empty sequences, both state layouts,
grouped heads, fp16, the qk l2 norm, strided inputs and state pools.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch import chunk_gated_delta_rule  # noqa: E402
from gdn_dispatch.contract import CHUNK_SIZE, make_problem  # noqa: E402
from gdn_dispatch.device import DeviceInfo, assumed_device  # noqa: E402
from gdn_dispatch.testing import (  # noqa: E402
    fused_projection_views, padded_pool, poison_cuda_allocator, random_call, random_problem, rel_rms_error)
from gdn_dispatch.varlen import slot_starts  # noqa: E402

from gdn_dispatch.backends.gluon_common.blocked_inverse import fp16_products  # noqa: E402
from gdn_dispatch.backends.gluon_common.wy import shared_row_vectors  # noqa: E402
from gdn_dispatch.backends.gluon_common.forward import plan_call  # noqa: E402
from gdn_dispatch.backends.gluon_common.launch_plan import has_tails  # noqa: E402
from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache, plan  # noqa: E402
from gdn_dispatch.backends.gluon_common.wy_t import WY_T_BLOCKED_INVERSE, WY_T_F16_INVERSE, t_tile_rows  # noqa: E402
from gdn_dispatch.backends.gluon_sm90.fused import fused_smem_bytes  # noqa: E402

SM90, SM100 = (9, 0), (10, 0)


def _engines():
    from gdn_dispatch.backends import gluon_sm90, gluon_sm100

    return gluon_sm90.ENGINE, gluon_sm100.ENGINE


#: The path's build variants the tests run besides the default: (name, [(module, constant,
#: value), ...]).
_WY_T = "gdn_dispatch.backends.gluon_common.wy_t"
_FUSED = "gdn_dispatch.backends.gluon_sm90.fused"
#: The two-launch build: the T kernel forms the chunk inverses.
_T_KERNEL = (_FUSED, "AUX_T", False)
VARIANTS = [("default", []),
            ("v-1-slot", [(_FUSED, "V_SLOTS", 1), (_WY_T, "WY_T_SINGLE_TILE", False)]),
            ("late-rows", [("gdn_dispatch.backends.gluon_common.wy", "WY_EARLY_ROWS", False), _T_KERNEL]),
            ("t-pair", [(_WY_T, "WY_T_SINGLE_TILE", False)]),
            ("t-u-direct", [(_WY_T, "WY_T_SINGLE_TILE", True), (_WY_T, "WY_T_BLOCK_TMA", False), _T_KERNEL]),
            ("t-kernel", [_T_KERNEL]),
            ("aux-scores", [(_FUSED, "STATE_SCORES", False)]),
            ("late-o1", [(_FUSED, "EARLY_O1", False), _T_KERNEL])]


@pytest.fixture(params=VARIANTS, ids=[name for name, _ in VARIANTS])
def kernel_variant(request, monkeypatch):
    """The path as shipped (one launch: the chunk inverses formed in the fused kernel's aux
    partition, :data:`fused.AUX_T`, its causal scores in the state partition,
    :data:`fused.STATE_SCORES`), and its builds left off: with the T kernel forming the
    inverses, two launches (:data:`fused.AUX_T` off), alone, with its gate and beta rows
    loaded after k k^T (:data:`wy.WY_EARLY_ROWS` off), with T_u's blocks stored from the
    inverse's registers instead of sent as 16 x 16 TMA boxes (:data:`wy_t.WY_T_BLOCK_TMA`
    off), and with the state chain's output product issued after the update
    (:data:`fused.EARLY_O1` off); with T_w and T_u both written and w, u formed in the aux
    partition (:data:`wy_t.WY_T_SINGLE_TILE` off: the T kernel), also with one v slot
    (:data:`fused.V_SLOTS`, the form that has it); and the one launch with its scores formed
    in the aux partition (:data:`fused.STATE_SCORES` off); plans computed afresh."""
    import importlib

    name, settings = request.param
    for module, constant, value in settings:
        monkeypatch.setattr(importlib.import_module(module), constant, value)
    clear_plan_cache()
    yield name
    clear_plan_cache()


def _device(sm_count=132, capability=SM90):
    info = assumed_device(f"sm_{capability[0]}{capability[1]}")
    return DeviceInfo(kind="cuda", index=0, name=info.name, capability=capability, sm_count=sm_count,
                      smem_optin=info.smem_optin)


# ---------------------------------------------------------------------------------------
# Plans


@pytest.mark.parametrize("N, taken", [(2, False), (3, False), (4, True), (9, True)])
def test_the_path_is_taken_where_the_programs_fill_the_sms(N, taken):
    """(sequence, v-head) programs against 3/4 of 132 SMs (99): HV = 32 takes the path
    from 4 sequences (128 programs), not at 3 (96)."""
    sm90, _ = _engines()
    p = random_problem(lengths=[70] * N, H=4, HV=32, K=128, V=128, ht=True)
    call = plan_call(p, _device(132), engine=sm90)
    assert call.kernels == (("fused_fwd",) if taken else ("wy_fwd", "state_output_fwd"))
    assert call.launches.fused == taken


@pytest.mark.parametrize("shape", [dict(lengths=[1, 63, 0, 64, 65, 130]), dict(batch=(2, 128)),
                                   dict(batch=(3, 100)), dict(lengths=[64, 128, 0])],
                         ids=["varlen-tails", "uniform", "uniform-tails", "varlen-whole-chunks"])
def test_launches_of_the_path(shape, kernel_variant):
    from gdn_dispatch.backends.gluon_common import wy as wy_module
    from gdn_dispatch.backends.gluon_common import wy_t as wy_t_module
    from gdn_dispatch.backends.gluon_sm90 import fused as fused_module

    sm90, _ = _engines()
    p = random_problem(**shape, H=2, HV=4, K=128, V=128, ht=True, layout="vk")
    fp = plan(p, device=_device(4), engine=sm90)  # 4 SMs: N * HV >= 3 programs
    on_chip = kernel_variant in ("default", "aux-scores")
    assert fp.fused and fp.inverses_on_chip == on_chip
    rows, tails = p.B * p.T, has_tails(p)
    slots = rows // CHUNK_SIZE + (p.N if tails else 0)
    if on_chip:
        # One launch: no T kernel, no T tiles.
        (fused,) = fp.stages
        assert fused.kernel == "fused_fwd"
    else:
        wy_t, fused = fp.stages
        assert (wy_t.kernel, fused.kernel) == ("wy_t_fwd", "fused_fwd")
        assert wy_t.grid == (slots * 4,)
        assert wy_t.constexprs == {"HAS_TAILS": tails, "USE_L2NORM": False, "ENGINE": sm90,
                                   "F16_INVERSE": WY_T_F16_INVERSE and not WY_T_BLOCKED_INVERSE,
                                   "BLOCKED_INVERSE": WY_T_BLOCKED_INVERSE,
                                   "EARLY_ROWS": WY_T_BLOCKED_INVERSE and wy_module.WY_EARLY_ROWS,
                                   "SINGLE_T": wy_t_module.WY_T_SINGLE_TILE,
                                   "DIRECT_STORE": wy_t_module.WY_T_SINGLE_TILE and WY_T_BLOCKED_INVERSE,
                                   "BLOCK_TMA": wy_t_module.WY_T_SINGLE_TILE and WY_T_BLOCKED_INVERSE
                                   and wy_t_module.WY_T_BLOCK_TMA}
        # The T kernel's descriptor: a [16, 16] box of T_u, or a [64, 64] tile (unused by
        # the direct stores).
        assert {d.arg: d.block_shape for d in wy_t.descriptors}["t_desc"] == (
            (64, 64) if kernel_variant in ("v-1-slot", "t-pair", "t-u-direct") else (16, 16))
        # One program per chunk slot and v-head writes 2 x 64 rows of T tiles (64: T_u alone).
        tiles = 1 if wy_t_module.WY_T_SINGLE_TILE else 2
        assert t_tile_rows(rows, p.N, 4, tails, tiles) == wy_t.grid[0] * tiles * CHUNK_SIZE
    assert fused.grid == (p.N * 4,)
    expected = {"USE_H0": True, "STORE_HT": True, "STATE_VK": True, "HAS_TAILS": tails, "ENGINE": sm90,
                "USE_POOL": False, "INPLACE": False, "V_SLOTS": fused_module.V_SLOTS,
                "SINGLE_T": wy_t_module.WY_T_SINGLE_TILE, "QK_NORM": False, "AUX_T": on_chip,
                "EARLY_O1": kernel_variant != "late-o1" and wy_t_module.WY_T_SINGLE_TILE,
                "STATE_SCORES": kernel_variant == "default", "CHAIN": False, "PICK": False}
    if on_chip:
        expected["t_desc"] = None  # no descriptor built or encoded
    assert fused.constexprs == expected
    assert (fused_module.V_SLOTS, wy_module.WY_EARLY_ROWS, wy_t_module.WY_T_SINGLE_TILE,
            wy_t_module.WY_T_BLOCK_TMA) == {
        "v-1-slot": (1, True, False, True), "late-rows": (2, False, True, True),
        "t-pair": (2, True, False, True), "t-u-direct": (2, True, True, False)}.get(
        kernel_variant, (2, True, True, True))
    assert fused.num_warps == 8 and fused.scalars == {"HV": 4, "GROUP": 2}
    descriptors = {"q_desc": ("q", (64, 128)), "k_desc": ("k", (64, 128)), "v_desc": ("v", (64, 128)),
                   "t_desc": ("t", (64, 64)), "o_desc": ("o", (64, 128))}
    if on_chip:
        del descriptors["t_desc"]
    assert {d.arg: (d.tensor, d.block_shape) for d in fused.descriptors} == descriptors
    assert fused.blocks["smem_bytes"] <= 227 * 1024
    # T_u alone: two T tiles, two w and two u tiles fewer; on chip, the inverse's 16 KB of
    # tables and its barrier (with the fp16 inverse, the 16 KB A waits in for a redo; with
    # the shared row vectors, two slots of two; with the scores in the state, two slots'
    # gate rows, and with fused.AUX_RING_SLOTS past two each slot more of k/q, T_u, the gate
    # vectors and rows and four barriers).
    tiles = 1 if wy_t_module.WY_T_SINGLE_TILE else 2
    extra_slots = fused_module.ring_slots(kernel_variant == "default") - 2
    assert fused.blocks["smem_bytes"] == fused_smem_bytes(128, 128, 2, v_slots=1) + \
        (fused_module.V_SLOTS - 1) * (64 * 128 * 2 + 8) - (2 - tiles) * (2 * 64 * 64 + 4 * 64 * 128) * 2 + \
        (16 * 16 * 16 * 4 + 8 + (64 * 64 * 4 if fp16_products() else 0)
         + (2 * 2 * 64 * 4 if shared_row_vectors() else 0) if on_chip else 0) + \
        (2 * 2 * 64 * 4 if kernel_variant == "default" else 0) + \
        extra_slots * (2 * 64 * 128 * 2 + 64 * 64 * 2 + (3 + 2) * 64 * 4 + 4 * 8)


@pytest.mark.parametrize("K, V", [(64, 64), (64, 128), (128, 64)])
def test_small_heads_take_the_path_with_their_flag(K, V, monkeypatch):
    """K or V of 64: the pipeline runs them (the reason names the head dims) unless
    :data:`fused.SMALL_HEADS` is on; then the fused kernel with one state warpgroup per 64
    rows of S^T (V), its tiles, shared memory and the aux's registers at that size, and
    in the two-launch build (:data:`fused.AUX_T` off) the T kernel at K before it."""
    from gdn_dispatch.backends.gluon_sm90 import fused as fused_module

    sm90, _ = _engines()
    p = random_problem(lengths=[100, 0, 300] * 2, H=16, HV=32, K=K, V=V, ht=True)
    monkeypatch.setattr(fused_module, "SMALL_HEADS", False)
    clear_plan_cache()
    assert fused_module.fused_reason(p) == f"head dims K = V = 128 only, got K = {K}, V = {V}"
    assert plan_call(p, _device(132), engine=sm90).kernels == ("wy_fwd", "state_output_fwd")
    monkeypatch.setattr(fused_module, "SMALL_HEADS", True)
    clear_plan_cache()
    assert fused_module.fused_reason(p) is None
    assert fused_module.fused_reason(random_problem(lengths=[64], H=1, HV=2, K=32, V=64)) == \
        "head dims K, V in (64, 128) only, got K = 32, V = 64"
    call = plan_call(p, _device(132), engine=sm90)
    assert call.kernels == ("fused_fwd",)
    (fused,) = call.launches.stages
    assert fused.num_warps == fused_module.state_warps(V) == (8 if V == 128 else 4)
    assert {d.arg: d.block_shape for d in fused.descriptors} == {
        "q_desc": (64, K), "k_desc": (64, K), "v_desc": (64, V), "o_desc": (64, V)}
    assert fused.blocks["smem_bytes"] == fused_smem_bytes(K, V, 2, v_slots=fused_module.V_SLOTS, single_t=True,
                                                          aux_t=True, state_scores=True)
    assert fused_module._aux_regs(V) == (120 if V == 128 else 232)
    monkeypatch.setattr(fused_module, "AUX_T", False)
    clear_plan_cache()
    call = plan_call(p, _device(132), engine=sm90)
    assert call.kernels == ("wy_t_fwd", "fused_fwd")
    wy_t, fused = call.launches.stages
    assert {d.arg: d.block_shape for d in wy_t.descriptors}["k_desc"] == (64, K)
    assert fused.num_warps == fused_module.state_warps(V)
    assert {d.arg: d.block_shape for d in fused.descriptors} == {
        "q_desc": (64, K), "k_desc": (64, K), "v_desc": (64, V), "t_desc": (64, 64), "o_desc": (64, V)}
    assert fused.blocks["smem_bytes"] == fused_smem_bytes(K, V, 2, v_slots=fused_module.V_SLOTS, single_t=True)
    # T_w and T_u both (w and u formed in 128-wide halves): K = V = 128 only.
    monkeypatch.setattr("gdn_dispatch.backends.gluon_common.wy_t.WY_T_SINGLE_TILE", False)
    assert fused_module.fused_reason(p) is not None
    clear_plan_cache()


@pytest.mark.parametrize("seed", range(3))
def test_the_kernel_reads_the_slots_the_t_kernel_writes(seed):
    """The fused kernel reads chunk t of sequence n at slot ``cu[n] // 64 + n + t`` (with
    tails) or ``cu[n] // 64 + t`` (whole chunks): the varlen chunk slots the T kernel's
    programs find by bisection (gdn_dispatch.varlen.slot_starts)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 300, (7,), generator=gen).tolist()
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    starts = slot_starts(cu, CHUNK_SIZE)
    for n, (bos, eos) in enumerate(zip(cu, cu[1:])):
        assert bos // CHUNK_SIZE + n == starts[n], (lengths, n)
    whole = [64 * x for x in lengths]
    cu = [0, *torch.tensor(whole).cumsum(0).tolist()]
    for n, (bos, eos) in enumerate(zip(cu, cu[1:])):
        # Without tails, chunks tile the rows back to back: slot = row // 64.
        assert all((bos + t * 64) // 64 == bos // 64 + t for t in range((eos - bos) // 64))


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_a_call_without_tokens_returns_its_initial_state(layout):
    """Every sequence empty: nothing is launched (the CPU has no GPU to launch on), o is
    empty and the final state is the initial one."""
    from gdn_dispatch.backends.gluon_sm90.fused import fused_fwd

    sm90, _ = _engines()
    p = random_problem(lengths=[0, 0, 0], H=2, HV=4, K=128, V=128, ht=True, layout=layout)
    launch = plan(p, device=_device(4), engine=sm90).stage("fused_fwd")
    o, ht = fused_fwd(p, torch.empty(0, 64, dtype=p.dtype), torch.empty(0, 0, 4), launch)
    assert o.shape == (1, 0, 4, 128) and torch.equal(ht, p.initial_state)


def test_calls_the_path_leaves_to_the_pipeline(monkeypatch):
    sm90, sm100 = _engines()
    many = dict(lengths=[70] * 8, H=4, HV=32)
    device = _device(132)
    # Head dims other than 64 and 128, Blackwell's engine: the two-launch pipeline.
    assert not plan(random_problem(**many, K=32, V=128), device=device, engine=sm90).fused
    assert plan(random_problem(**many, K=64, V=128), device=device, engine=sm90).fused
    assert not plan(random_problem(**many, K=128, V=128), device=_device(132, SM100), engine=sm100).fused
    assert not plan(random_problem(**many, K=128, V=128), device=device, engine=sm90, fused=False).fused
    from gdn_dispatch.backends.gluon_sm90.fused import fused_reason

    assert fused_reason(random_problem(**many, K=128, V=128, l2=True)) is None
    monkeypatch.setattr("gdn_dispatch.backends.gluon_sm90.fused.QK_L2NORM", False)
    assert "qk l2 norm" in fused_reason(random_problem(**many, K=128, V=128, l2=True))
    # T tile rows are int32 TMA coordinates: 2 HV tiles of 64 rows per chunk slot.
    huge = make_problem(torch.empty(1, 2 ** 24, 1, 128, device="meta"), torch.empty(1, 2 ** 24, 1, 128, device="meta"),
                        torch.empty(1, 2 ** 24, 64, 128, device="meta"), torch.empty(1, 2 ** 24, 64, device="meta"),
                        torch.empty(1, 2 ** 24, 64, device="meta"))
    assert "past int32" in fused_reason(huge)
    assert "K, V in (64, 128)" in fused_reason(random_problem(**many, K=128, V=32))
    # Without fused.SMALL_HEADS, K = V = 128 alone.
    monkeypatch.setattr("gdn_dispatch.backends.gluon_sm90.fused.SMALL_HEADS", False)
    assert "K = V = 128" in fused_reason(random_problem(**many, K=64, V=64))


def _set_l2_switch(monkeypatch, on: bool):
    """fused.QK_L2NORM set for one test, with the plan cache cleared (its key does not hold
    the switch)."""
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
    from gdn_dispatch.backends.gluon_sm90 import fused

    clear_plan_cache()
    monkeypatch.setattr(fused, "QK_L2NORM", on)


@pytest.fixture
def l2_on_path(monkeypatch):
    """The qk l2 norm on the path (fused.QK_L2NORM) on normalized copies of q and k
    (fused.QK_NORM_ON_CHIP off), whatever the defaults."""
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
    from gdn_dispatch.backends.gluon_sm90 import fused

    monkeypatch.setattr(fused, "QK_NORM_ON_CHIP", False)
    _set_l2_switch(monkeypatch, True)
    yield
    clear_plan_cache()


@pytest.fixture(params=["norm-copies", "norm-on-chip"])
def l2_path_variant(request, monkeypatch):
    """The qk l2 norm on the path, on normalized copies of q and k or folded into the
    path's two kernels (fused.QK_NORM_ON_CHIP)."""
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
    from gdn_dispatch.backends.gluon_sm90 import fused

    monkeypatch.setattr(fused, "QK_NORM_ON_CHIP", request.param == "norm-on-chip")
    _set_l2_switch(monkeypatch, True)
    yield request.param
    clear_plan_cache()


@pytest.mark.parametrize("aux_t", [True, False], ids=["one-launch", "t-kernel"])
def test_the_qk_l2_norm_runs_the_path_on_normalized_copies(l2_on_path, aux_t, monkeypatch):
    """With the qk l2 norm the path launches the row norms first (normalized q and k rows)
    and plans its kernels (the fused kernel, and the T kernel before it with
    :data:`fused.AUX_T` off) as for a call without the norm: they read the copies and
    normalize nothing."""
    from gdn_dispatch.backends.gluon_sm90 import fused as fused_module

    sm90, _ = _engines()
    monkeypatch.setattr(fused_module, "AUX_T", aux_t)
    clear_plan_cache()
    p = random_problem(lengths=[70, 300, 1] * 3, H=4, HV=32, K=128, V=128, l2=True, ht=True)
    launches = plan(p, device=_device(132), engine=sm90)
    assert launches.fused and launches.inverses_on_chip is aux_t
    assert [s.kernel for s in launches.stages] == ["qk_l2norm_fwd"] + ([] if aux_t else ["wy_t_fwd"]) + ["fused_fwd"]
    plain = plan(random_problem(lengths=[70, 300, 1] * 3, H=4, HV=32, K=128, V=128, ht=True), device=_device(132),
                 engine=sm90)
    assert launches.stages[1:] == plain.stages
    assert launches.stage("fused_fwd").constexprs["QK_NORM"] is False
    if not aux_t:
        assert launches.stage("wy_t_fwd").constexprs["USE_L2NORM"] is False
    norms = launches.stage("qk_l2norm_fwd")
    # (token, head) rows of q and of k: B * T * H rows, 64 per program, two grid columns.
    assert norms.grid == (-(-p.B * p.T * p.H // 64), 2)
    # The pipeline's norms stay reciprocal norms, folded into its kernels.
    pipe = plan(p, device=_device(132), engine=sm90, fused=False)
    assert [s.kernel for s in pipe.stages] == ["wy_fwd", "qk_rnorm_fwd", "state_output_fwd"]


@pytest.mark.parametrize("aux_t", [True, False], ids=["one-launch", "t-kernel"])
def test_the_qk_l2_norm_on_chip_launches_no_norm_kernel(monkeypatch, aux_t):
    """With fused.QK_NORM_ON_CHIP the path runs its kernels alone on raw q and k for groups
    of up to fused.QK_NORM_ON_CHIP_MAX_GROUP v-heads: the fused kernel's aux partition
    reduces q's and k's norms (QK_NORM: four gate vectors a slot, 64 x 4 bytes more per
    scores slot; in the one-launch build the fp16 inverse's redo buffer padded instead of
    swizzled, 2 KB more), and in the two-launch build (:data:`fused.AUX_T` off) the T kernel
    k's (USE_L2NORM). Larger groups, whose v-heads would each reduce the same norms again,
    run on normalized copies."""
    from gdn_dispatch.backends.gluon_common import blocked_inverse
    from gdn_dispatch.backends.gluon_sm90 import fused as fused_module

    sm90, _ = _engines()
    monkeypatch.setattr(fused_module, "QK_NORM_ON_CHIP", True)
    monkeypatch.setattr(fused_module, "QK_NORM_ON_CHIP_MAX_GROUP", 2)
    monkeypatch.setattr(fused_module, "AUX_T", aux_t)
    _set_l2_switch(monkeypatch, True)
    t_kernel = [] if aux_t else ["wy_t_fwd"]
    try:
        for H, on_chip in ((32, True), (16, True), (8, False)):
            p = random_problem(lengths=[70, 300, 1] * 3, H=H, HV=32, K=128, V=128, l2=True, ht=True)
            launches = plan(p, device=_device(132), engine=sm90)
            if not on_chip:
                assert [s.kernel for s in launches.stages] == ["qk_l2norm_fwd", *t_kernel, "fused_fwd"], H
                if not aux_t:
                    assert launches.stage("wy_t_fwd").constexprs["USE_L2NORM"] is False
                assert launches.stage("fused_fwd").constexprs["QK_NORM"] is False
                continue
            assert [s.kernel for s in launches.stages] == [*t_kernel, "fused_fwd"], H
            fused = launches.stage("fused_fwd")
            assert fused.constexprs["QK_NORM"] is True
            if not aux_t:
                assert launches.stage("wy_t_fwd").constexprs["USE_L2NORM"] is True
            plain = plan(random_problem(lengths=[70, 300, 1] * 3, H=H, HV=32, K=128, V=128, ht=True),
                         device=_device(132), engine=sm90).stage("fused_fwd")
            redo = 0
            if aux_t and blocked_inverse.fp16_products():
                redo = blocked_inverse.redo_buffer_bytes(64, True) - blocked_inverse.redo_buffer_bytes(64, False)
                assert redo == 64 * blocked_inverse.REDO_ROW_PADDING * 4
            assert fused.blocks["smem_bytes"] == plain.blocks["smem_bytes"] + 2 * 64 * 4 + redo
            # The pipeline keeps its reciprocal norms.
            pipe = plan(p, device=_device(132), engine=sm90, fused=False)
            assert [s.kernel for s in pipe.stages] == ["wy_fwd", "qk_rnorm_fwd", "state_output_fwd"]
    finally:
        from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
        clear_plan_cache()


@pytest.mark.parametrize("on_chip", [True, False], ids=["norm-on-chip", "norm-copies"])
def test_fp16_calls_with_the_qk_l2_norm_run_on_normalized_copies(monkeypatch, on_chip):
    """fp16 calls with the qk l2 norm normalize q and k first on every path (products of
    raw rows can leave fp16's range: tests/test_extreme_inputs.py): the warp-specialized
    path (even where bf16 folds the norm in on chip), the pipeline and both kinds of
    context parallelism launch qk_l2norm_fwd first, then the launches of the same call
    without the norm; bf16 keeps the norm in its kernels."""
    from gdn_dispatch.backends.gluon_sm90 import fused as fused_module

    sm90, _ = _engines()
    monkeypatch.setattr(fused_module, "QK_NORM_ON_CHIP", on_chip)
    _set_l2_switch(monkeypatch, True)
    device = _device(132)
    try:
        for lengths, fused, cp in (([70, 300, 1] * 3, True, "off"), ([70, 300, 1], False, "off"),
                                   ([3000, 700], False, 4)):
            shape = dict(lengths=lengths, H=16, HV=32, K=128, V=128)
            calls = {(dtype, l2): make_problem(**random_call(**shape, dtype=dtype, seed=5, normalize_qk=not l2,
                                                             initial_state=True),
                                               output_final_state=True, use_qk_l2norm_in_kernel=l2,
                                               context_parallel=cp)
                     for dtype in (torch.float16, torch.bfloat16) for l2 in (False, True)}
            half, half_plain = (plan_call(calls[torch.float16, l2], device, engine=sm90) for l2 in (True, False))
            assert half.launches.fused == fused and half.context_parallel.enabled == (cp != "off"), lengths
            assert half.launches.norm_copies
            assert half.kernels == ("qk_l2norm_fwd", *half_plain.kernels), lengths
            assert half.launches.stages[1:] == half_plain.launches.stages, lengths
            assert half.state_output == half_plain.state_output
            assert half.segment_map == half_plain.segment_map
            assert all(not s.constexprs.get("USE_L2NORM") and not s.constexprs.get("QK_NORM")
                       for s in half.launches.stages)
            brain = plan_call(calls[torch.bfloat16, True], device, engine=sm90)
            if fused and on_chip:
                # The norm folded into the path's kernels: no norm kernel.
                assert brain.launches.stage("fused_fwd").constexprs["QK_NORM"] is True, lengths
                assert not {"qk_l2norm_fwd", "qk_rnorm_fwd"} & set(brain.kernels), lengths
            else:
                assert ("qk_l2norm_fwd" if fused else "qk_rnorm_fwd") in brain.kernels, lengths
            assert brain.launches.norm_copies == (fused and not on_chip), lengths
    finally:
        clear_plan_cache()


def test_one_v_slot_needs_both_t_tiles(monkeypatch):
    """With T_u alone the state partition reads v slot t % 2 and refills it itself: a
    one-slot ring is refused by name, not built to read past its end; with T_w and T_u
    (the aux partition refills v) one slot plans."""
    from gdn_dispatch.backends.gluon_common import wy_t as wy_t_module
    from gdn_dispatch.backends.gluon_sm90 import fused as fused_module

    sm90, _ = _engines()
    p = random_problem(lengths=[70] * 4, H=4, HV=32, K=128, V=128, ht=True)
    monkeypatch.setattr(fused_module, "V_SLOTS", 1)
    clear_plan_cache()
    try:
        with pytest.raises(ValueError, match=r"fused\.V_SLOTS = 1.*needs 2 slots"):
            plan_call(p, _device(132), engine=sm90)
        monkeypatch.setattr(wy_t_module, "WY_T_SINGLE_TILE", False)
        clear_plan_cache()
        fused = plan_call(p, _device(132), engine=sm90).launches.stage("fused_fwd").shared
        assert (fused.constexprs["V_SLOTS"], fused.constexprs["SINGLE_T"]) == (1, False)
    finally:
        clear_plan_cache()


def test_context_parallel_calls_stay_on_the_pipeline():
    """Segments run the pipeline's pass 2 (over w and u); a segmented call never takes the
    path, whatever its program count."""
    sm90, _ = _engines()
    call = random_call(lengths=[4096] * 4, H=4, HV=32, K=128, V=128)
    p = make_problem(**call, output_final_state=True, context_parallel=4)
    planned = plan_call(p, _device(132), engine=sm90)
    assert planned.context_parallel.enabled
    assert planned.kernels == ("wy_fwd", "segment_map_fwd", "segment_scan", "state_output_fwd")


# ---------------------------------------------------------------------------------------
# GPU

needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != SM90,
                                reason="needs an sm_90 GPU")


def _on_path(call: dict) -> None:
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.device import default_probe

    p = make_problem(**call)
    device = default_probe().for_torch_device(p.device)
    assert plan_call(p, device, engine=gluon_sm90.ENGINE).launches.fused, "the call must take the fused path"


def _check(call: dict, tol: float = 5e-3):
    _on_path(call)
    expected = chunk_gated_delta_rule(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in call.items()},
                                      backend="reference")
    poison_cuda_allocator()
    o, ht = chunk_gated_delta_rule(**call, backend="gluon_sm90")
    assert rel_rms_error(o.float().cpu(), expected[0].float()) < tol
    if call.get("output_final_state"):
        assert rel_rms_error(ht.float().cpu(), expected[1].float()) < tol
    return o, ht


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("shape", [dict(lengths=[1, 63, 0, 64, 65, 700, 130, 1]), dict(batch=(2, 300)),
                                   dict(batch=(4, 256))], ids=["varlen", "uniform-tails", "uniform"])
@pytest.mark.parametrize("seed", range(2))
def test_path_matches_the_reference(shape, layout, dtype, seed, kernel_variant):
    call = random_call(**shape, H=32, HV=64, K=128, V=128, dtype=dtype, device="cuda", seed=seed,
                       state_layout=layout)
    _check({**call, "output_final_state": True})


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("shape", [dict(lengths=[1, 63, 0, 64, 65, 700, 130, 1]), dict(batch=(4, 256))],
                         ids=["varlen", "uniform"])
def test_path_with_the_qk_l2_norm(shape, layout, dtype, l2_path_variant):
    """Raw q and k (rows of norm ~11): the path normalizes copies of them, or folds their
    norms into its two kernels; strided views of one projection too."""
    call = random_call(**shape, H=32, HV=64, K=128, V=128, dtype=dtype, device="cuda", seed=7, state_layout=layout,
                       normalize_qk=False)
    call = {**call, "use_qk_l2norm_in_kernel": True, "output_final_state": True}
    _check(call)
    _check({**call, **fused_projection_views(call)})


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("aux_t", [False, True], ids=["t-kernel", "aux-t"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K, V", [(64, 64), (64, 128), (128, 64)])
def test_path_with_small_heads(K, V, layout, aux_t, monkeypatch):
    """K or V of 64 on the path (:data:`fused.SMALL_HEADS`), with the T kernel or the
    inverses formed in the fused kernel (:data:`fused.AUX_T`): tails, an empty sequence,
    grouped heads; the qk l2 norm on chip on the first layout."""
    from gdn_dispatch.backends.gluon_sm90 import fused as fused_module

    monkeypatch.setattr(fused_module, "SMALL_HEADS", True)
    monkeypatch.setattr(fused_module, "AUX_T", aux_t)
    clear_plan_cache()
    l2 = layout == "kv"
    call = random_call(lengths=[1, 63, 0, 64, 65, 700, 130, 1], H=32, HV=64, K=K, V=V, device="cuda", seed=K + V,
                       state_layout=layout, normalize_qk=not l2)
    try:
        _check({**call, "output_final_state": True, "use_qk_l2norm_in_kernel": l2})
    finally:
        clear_plan_cache()


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("seed", range(2))
def test_path_without_states_and_with_strided_inputs(seed):
    call = random_call(lengths=[200, 5, 333], H=16, HV=64, K=128, V=128, device="cuda", seed=seed,
                       initial_state=False)
    _check(call)
    _check({**call, **fused_projection_views(call), "output_final_state": True})


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("form", ["int64-offsets", "no-host-copy", "one-v-head-per-k-head"])
def test_path_with_other_call_forms(form):
    """int64 cu_seqlens (read as given), no host copy of them (the kernels then assume
    tails and find each chunk's slot themselves), and H == HV (no grouped heads)."""
    H = 128 if form == "one-v-head-per-k-head" else 32
    call = random_call(lengths=[64, 1, 191, 0, 320], H=H, HV=128, K=128, V=128, device="cuda", seed=5)
    if form == "int64-offsets":
        call["cu_seqlens"] = call["cu_seqlens"].to(torch.int64)
    if form == "no-host-copy":
        call.pop("cu_seqlens_cpu")
    _check({**call, "output_final_state": True})


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_path_with_a_state_pool(pool_dtype):
    lengths = [100, 0, 257, 64]
    call = random_call(lengths=lengths, H=32, HV=64, K=128, V=128, device="cuda", seed=3, initial_state=False)
    call.pop("initial_state", None)
    pool, indices, h0 = padded_pool(len(lengths), 64, (128, 128), pool_dtype, seed=4, device="cuda")
    before = pool.clone()
    expected = chunk_gated_delta_rule(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in call.items()},
                                      initial_state=h0.cpu(), output_final_state=True, backend="reference")
    pooled = {**call, "initial_state": pool, "state_indices": indices, "inplace_final_state": True,
              "output_final_state": True}
    _on_path(pooled)
    poison_cuda_allocator()
    o, ht = chunk_gated_delta_rule(**pooled, backend="gluon_sm90")
    assert rel_rms_error(o.float().cpu(), expected[0].float()) < 5e-3
    live = indices >= 0
    assert rel_rms_error(ht[live].cpu(), expected[1][live.cpu()]) < 5e-3
    tol = 5e-3 if pool_dtype == torch.float32 else 1e-2
    assert rel_rms_error(pool[indices[live].long()].float().cpu(), expected[1][live.cpu()]) < tol
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[indices[live].long().cpu()] = False
    assert torch.equal(pool[untouched.to(pool.device)], before[untouched.to(pool.device)])


_LOAD_WARP_BUILD = """
import json, sys
from triton.experimental.gluon import language as gl
from gdn_dispatch.backends.gluon_sm90 import fused
fused.LOAD_WARP = gl.constexpr(sys.argv[1] == "1")
fused.AUX_T = False  # the load warp refills the T slots of the two-launch build
from gdn_dispatch.aot import compile_kernel
from gdn_dispatch.backends import gluon_sm90
kernels = fused.fused_kernels_for_aot((9, 0), "gluon_sm90", engine=gluon_sm90.ENGINE)
out = []
for kernel in kernels[::max(1, len(kernels) // 6)]:
    report = compile_kernel(kernel, (9, 0))
    out.append([kernel.specialization, report.spill_bytes, kernel.spill_bytes_allowed,
                report.ptx.count("mbarrier.try_wait")])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_load_warp_build_compiles():
    """:data:`fused.LOAD_WARP` is read by the kernel at compile time (fixed per process):
    the setting not shipped builds in a child process, a sample of the AOT list within the
    kernel's spill allowance, in the two-launch build (:data:`fused.AUX_T` off: the load
    warp refills k / q, v and the T slots there); with it on, the state partition's wait
    for the aux's k / q release moves into the load warp, which also waits for the state's
    own release (one ``mbarrier.try_wait`` more in all)."""
    import json
    import subprocess
    import sys

    from gdn_dispatch.backends.gluon_sm90 import fused

    runs = {}
    for on in (False, True):
        done = subprocess.run([sys.executable, "-c", _LOAD_WARP_BUILD, "1" if on else "0"], capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[on] = json.loads(done.stdout.strip().splitlines()[-1])
    assert bool(fused.LOAD_WARP.value) in runs
    for (name, spills, allowed, waits), (_, spills_on, _, waits_on) in zip(runs[False], runs[True]):
        assert spills <= allowed and spills_on <= allowed, name
        assert waits_on == waits + 1, name


def _sanitize_module():
    """tests/sanitize.py as a module (it is a script, not a package module)."""
    from pathlib import Path

    from gdn_dispatch.testing import script_module

    return script_module(Path(__file__).resolve().parent / "sanitize.py", "sanitize_under_test")


def test_the_sanitizer_names_the_warp_specialized_kernel():
    """tests/sanitize.py leaves the warp-specialized kernel to memcheck and synccheck while
    racecheck fails its control: the name it excludes must be the kernel's, and the
    control must be there."""
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.backends.gluon_sm90 import fused

    sanitize = _sanitize_module()
    names = {k.fn.__name__ for k in fused.fused_kernels_for_aot((9, 0), "gluon_sm90", engine=gluon_sm90.ENGINE)}
    assert set(sanitize.WARP_SPECIALIZED["gluon_sm90"]) == names == {"_fused_fwd_kernel"}
    assert sanitize.CONTROL.is_file()
    assert set(sanitize.WARP_SPECIALIZED) <= set(sanitize.CALLS)


def test_the_sanitizer_keeps_the_shipped_builds_for_other_calls(monkeypatch):
    """A build flag on before the sanitizer's first call (as once a build ships) stays on
    for the calls that do not name it, and after a call that turned others on; a call
    naming it False turns it off for that call alone."""
    from gdn_dispatch.backends.gluon_sm90 import fused

    sanitize = _sanitize_module()
    for flag in sanitize.PATH_BUILDS.values():
        monkeypatch.setattr(fused, flag, flag == "EARLY_O1")
    sanitize._path_builds({"aux_t": True})
    assert (fused.AUX_T, fused.SMALL_HEADS, fused.EARLY_O1) == (True, False, True)
    sanitize._path_builds({})
    assert (fused.AUX_T, fused.SMALL_HEADS, fused.EARLY_O1) == (False, False, True)
    sanitize._path_builds({"early_o1": False, "small_heads": True})
    assert (fused.AUX_T, fused.SMALL_HEADS, fused.EARLY_O1) == (False, True, False)
    sanitize._path_builds({})
    assert (fused.AUX_T, fused.SMALL_HEADS, fused.EARLY_O1) == (False, False, True)
    clear_plan_cache()


def test_the_sanitizer_runs_the_path_builds_left_off():
    """tests/sanitize.py's "aux_t", "small_heads", "early_o1" and "state_scores" calls (the
    norm on chip and pools among them; K < V and K > V) take the path with the flags their
    child sets per call and clears after: between them, at K = V = 128 and at a head dim of
    64, the one launch with the scores in the state (as shipped) or in the aux partition
    and the two launches with the T kernel; the chain's early output product and the
    state's scores in the plan's constexprs; without their flags, the shipped builds."""
    from gdn_dispatch.backends.gluon_sm90 import fused

    sanitize = _sanitize_module()
    shipped = {name: getattr(fused, flag) for name, flag in sanitize.PATH_BUILDS.items()}
    calls = [c for c in sanitize.CALLS["gluon_sm90"] if len(c) > 8 and (set(sanitize.PATH_BUILDS) & set(c[8]))]
    assert len(calls) == 7 and any(c[7] for c in calls) and sum("pool" in c[8] for c in calls) == 2
    assert {(c[3], c[4]) for c in calls if c[8].get("small_heads")} == {(64, 128), (128, 64), (64, 64)}
    # The chain in both orders: the shipped one and the one it replaced.
    assert sorted(c[8]["early_o1"] for c in calls if "early_o1" in c[8]) == [False, True]
    sm90, _ = _engines()
    builds = set()
    try:
        for on in (True, False):
            for lengths, H, HV, K, V, dtype, layout, l2, extras in calls:
                sanitize._path_builds(extras if on else {})
                wanted = {name: bool(extras[name]) if on and name in extras else shipped[name]
                          for name in sanitize.PATH_BUILDS}
                assert {name: getattr(fused, flag) for name, flag in sanitize.PATH_BUILDS.items()} == wanted
                p = random_problem(lengths=lengths, H=H, HV=HV, K=K, V=V, dtype=getattr(torch, dtype),
                                   layout=layout, l2=l2, ht=True)
                call = plan_call(p, _device(132), engine=sm90)
                if (K, V) != (128, 128) and not wanted["small_heads"]:
                    assert not call.launches.fused
                    continue
                assert call.launches.fused and call.launches.inverses_on_chip is wanted["aux_t"]
                assert call.kernels == (("fused_fwd",) if wanted["aux_t"] else ("wy_t_fwd", "fused_fwd"))
                constexprs = call.launches.stage("fused_fwd").shared.constexprs
                assert constexprs["EARLY_O1"] is wanted["early_o1"]
                scores = wanted["aux_t"] and wanted["early_o1"] and wanted["state_scores"]
                assert constexprs["STATE_SCORES"] is scores
                if on:
                    builds.add(((K, V) != (128, 128), wanted["aux_t"], scores))
    finally:
        sanitize._path_builds({})
        clear_plan_cache()
    # Every build of the path, at K = V = 128 and at a head dim of 64.
    assert builds == {(small, aux_t, scores) for small in (False, True)
                      for aux_t, scores in ((False, False), (True, False), (True, True))}, builds


@pytest.mark.parametrize("shape, extra, expected", [
    (dict(batch=(4, 256), HV=32), {}, "fused_fwd (warp-specialized: 128 (sequence, v-head) programs on 132 SMs)"),
    (dict(batch=(1, 256), HV=32), {}, "wy_fwd, state_output_fwd (state kernel V-blocks of 32 on 4 warps; not the "
                                      "warp-specialized path: 32 (sequence, v-head) programs, it needs 99)"),
    (dict(batch=(4, 256), HV=32), dict(use_qk_l2norm_in_kernel=True),
     "fused_fwd (warp-specialized: 128 (sequence, v-head) programs on 132 SMs; the qk l2 norm reduced "
     "in its kernels)"),
    (dict(batch=(4, 256), HV=64), dict(use_qk_l2norm_in_kernel=True),
     "qk_l2norm_fwd, fused_fwd (warp-specialized: 256 (sequence, v-head) programs on 132 SMs; the qk "
     "l2 norm on normalized copies (4 v-heads per q/k head))"),
    (dict(batch=(4, 256), HV=32), dict(context_parallel=2),
     "wy_fwd, segment_map_fwd, segment_scan, state_output_fwd (state kernel V-blocks of 128 on 8 warps; "
     "not the warp-specialized path: segmented calls run the pipeline)"),
    (dict(batch=(4, 256), HV=32, dtype=torch.float16), dict(use_qk_l2norm_in_kernel=True),
     "qk_l2norm_fwd, fused_fwd (warp-specialized: 128 (sequence, v-head) programs on 132 SMs; the qk "
     "l2 norm on normalized copies (fp16))"),
    (dict(batch=(1, 256), HV=32, dtype=torch.float16), dict(use_qk_l2norm_in_kernel=True),
     "qk_l2norm_fwd, wy_fwd, state_output_fwd (state kernel V-blocks of 32 on 4 warps; the qk l2 norm on "
     "normalized copies (fp16); not the warp-specialized path: 32 (sequence, v-head) programs, it needs 99)"),
])
def test_explain_names_the_launches_and_why(shape, extra, expected, monkeypatch):
    """``explain`` with a call says what gluon_sm90 launches for it and why it takes (or
    not) the warp-specialized path, from the same dry run the forward plans with. (The
    call's tensors are on the CPU here: the backend's check of them is stubbed out.)"""
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.registry import CallSpec, explain

    call = random_call(**{"dtype": torch.bfloat16, **shape}, H=16, K=128, V=128, seed=1)
    p = make_problem(**call, output_final_state=True, **extra)
    assert gluon_sm90.describe_launches(p, _device(132)) == expected
    monkeypatch.setattr(gluon_sm90, "unsupported_reason", lambda problem: None)
    text = explain(_device(132), CallSpec.from_problem(p), problem=p, backend="gluon_sm90").format()
    assert f"  launches: {expected}" in text.splitlines(), text
    assert text.splitlines()[-1] == "selected: gluon_sm90"


@pytest.mark.parametrize("switch, H, copied", [(True, 8, 0), (True, 16, 1), (False, 16, 1)],
                         ids=["path-norm-copies", "path-norm-on-chip", "pipeline"])
def test_the_norm_reads_q_and_k_where_tma_cannot(switch, H, copied, monkeypatch):
    """q and k at a 2-byte offset (no TMA read in place): on the path with normalized
    copies (groups of 4 v-heads) the qk l2 norm reads them by pointer and the TMA reads its
    copies, so they are not copied first; with the norm on chip (groups of 2) the path's
    kernels, and the pipeline, read q and k through the TMA and copy each once
    (contract.INPUT_COPIES). The host path runs with its launches stubbed
    (tests/test_gluon_host_path.py)."""
    from test_gluon_host_path import stubbed_launches  # tests/ is on sys.path (pytest's rootdir-less import)

    from gdn_dispatch.contract import INPUT_COPIES
    from gdn_dispatch.backends.gluon_common import forward as F
    from gdn_dispatch.backends.gluon_common.launch_plan import tma_rows_reason
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache

    _set_l2_switch(monkeypatch, switch)
    sm90, _ = _engines()
    call = random_call(batch=(4, 64), H=H, HV=32, K=128, V=128, dtype=torch.bfloat16, seed=2, normalize_qk=False)
    for name in ("q", "k"):
        odd = torch.empty(call[name].numel() + 1, dtype=torch.bfloat16)[1:].view_as(call[name])
        call[name] = odd.copy_(call[name])
        assert "aligned base" in tma_rows_reason(name, call[name])
    p = make_problem(**call, output_final_state=True, use_qk_l2norm_in_kernel=True)
    try:
        assert plan_call(p, _device(132), engine=sm90).launches.fused is switch
        before = dict(INPUT_COPIES)
        with stubbed_launches() as launches:
            for _ in range(2):
                o, _ = F.forward(p, _device(132), engine=sm90)
        assert o.shape == (4, 64, 32, 128) and launches.binds and launches.runs
        assert {n: INPUT_COPIES[n] - before.get(n, 0) for n in ("q", "k", "v")} == \
            {"q": 2 * copied, "k": 2 * copied, "v": 0}
    finally:
        clear_plan_cache()


@pytest.mark.parametrize("batch, switch, expected", [
    ((4, 256), True, "fused_fwd (warp-specialized: 128 (sequence, v-head) programs on 132 SMs; the qk "
                     "l2 norm reduced in its kernels)"),
    ((4, 256), False, "wy_fwd, qk_rnorm_fwd, state_output_fwd (state kernel V-blocks of 128 on 8 warps; not the "
                      "warp-specialized path: the qk l2 norm (fused.QK_L2NORM is off))"),
    ((2, 256), True, "wy_fwd, qk_rnorm_fwd, state_output_fwd (state kernel V-blocks of 64 on 4 warps; not the "
                     "warp-specialized path: 64 (sequence, v-head) programs, it needs 99)"),
])
def test_explain_names_the_l2_launches_on_the_path(batch, switch, expected, monkeypatch):
    """With the switch on, l2 calls that fill the SMs take the path (H16-HV32: the norm on
    chip); with it off, or too few programs, the pipeline with its reciprocal norms."""
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache

    _set_l2_switch(monkeypatch, switch)
    call = random_call(batch=batch, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16, seed=1, normalize_qk=False)
    p = make_problem(**call, output_final_state=True, use_qk_l2norm_in_kernel=True)
    try:
        assert gluon_sm90.describe_launches(p, _device(132)) == expected
    finally:
        clear_plan_cache()


def test_explain_survives_a_backend_that_cannot_describe(monkeypatch):
    """select() may explain a call with its problem: a backend's failing dry run becomes a
    note, never an exception of the call."""
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.registry import CallSpec, explain

    def broken(problem, device):
        raise RuntimeError("no plan")

    monkeypatch.setattr(gluon_sm90, "unsupported_reason", lambda problem: None)
    monkeypatch.setattr(gluon_sm90, "describe_launches", broken)
    p = make_problem(**random_call(batch=(1, 64), H=2, HV=4, K=128, V=128, dtype=torch.bfloat16))
    text = explain(_device(132), CallSpec.from_problem(p), problem=p, backend="gluon_sm90").format()
    assert "  launches: not planned here (RuntimeError: no plan)" in text.splitlines()
