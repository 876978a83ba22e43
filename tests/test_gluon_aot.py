"""Ahead-of-time compiles of the Gluon backends (no GPU needed): sm_100a and sm_90a.

Every ``kernels_for_aot`` entry of gluon_sm100 / gluon_sm90 is compiled for its target with
``gdn_dispatch.aot.compile_kernel``; the PTX must hold the instructions the design relies on
(tcgen05 MMA/TMEM/TMA/scatter on sm_100a, wgmma/TMA on sm_90a), with no spills, shared memory
within the part's 232448 bytes and (sm_100a) at most 512 TMEM columns. A tiny probe kernel
checks the two matrix engines (backends/gluon_sm100/engine.py, backends/gluon_sm90/engine.py) on their targets.
"""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")
gluon_mod = pytest.importorskip("triton.experimental.gluon")

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma  # noqa: E402

from gdn_dispatch.backends.gluon_common import blocked_inverse, engine as E  # noqa: E402
from gdn_dispatch.backends.gluon_common.compat import tma_load, tma_store  # noqa: E402
from gdn_dispatch.aot import AotKernel, compile_kernel  # noqa: E402
from gdn_dispatch.device import SMEM_OPTIN, assumed_device  # noqa: E402

from gdn_dispatch.backends import gluon_sm90, gluon_sm100  # noqa: E402
from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache, plan  # noqa: E402

SM100, SM90 = (10, 0), (9, 0)
TMEM_COLUMNS = 512


@gluon.jit
def _engine_probe_kernel(a_desc, b_desc, c_desc, ENGINE: gl.constexpr):
    """c = a^T b + 0.5 (a b): one overwrite MMA, a register round trip, one accumulate MMA."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [BM, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [BK, BN], b_desc.layout)
    load_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mma_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(load_bar, count=1)
    mbarrier.init(mma_bar, count=1)
    mbarrier.expect(load_bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [0, 0], load_bar, a_smem)
    tma_load(b_desc, [0, 0], load_bar, b_smem)
    mbarrier.wait(load_bar, 0)
    acc = ENGINE.acc_alloc(BM, BN)
    acc = ENGINE.mma(a_smem, b_smem, acc, False, mma_bar)
    acc = ENGINE.mma_wait(acc, mma_bar, 0)
    acc = ENGINE.acc_write(acc, ENGINE.acc_read(acc) * 0.5)
    acc = ENGINE.mma(a_smem.permute((1, 0)), b_smem, acc, True, mma_bar)
    acc = ENGINE.mma_wait(acc, mma_bar, 1)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
    c_smem.store(ENGINE.acc_read(acc).to(c_desc.dtype))
    fence_async_shared()  # generic smem writes -> TMA (async proxy) read
    tma_store(c_desc, [0, 0], c_smem)
    tma.store_wait(0)
    mbarrier.invalidate(load_bar)
    mbarrier.invalidate(mma_bar)


def _probe(capability, BM, BN):
    la = E.smem_layout([BM, BM], gl.bfloat16)
    lb = E.smem_layout([BM, BN], gl.bfloat16)
    sig = {"a_desc": f"tensordesc<bf16[{BM}, {BM}],{la!r}>", "b_desc": f"tensordesc<bf16[{BM}, {BN}],{lb!r}>",
           "c_desc": f"tensordesc<bf16[{BM}, {BN}],{lb!r}>", "ENGINE": "constexpr"}
    return AotKernel(backend="probe", kernel="engine", specialization=f"M{BM}-N{BN}", fn=_engine_probe_kernel,
                     signature=sig, constexprs={"ENGINE": (gluon_sm100 if capability == SM100 else gluon_sm90).ENGINE},
                     dialect="gluon")


@pytest.mark.slow
@pytest.mark.parametrize("BM, BN", [(64, 64), (128, 32)], ids=["M64-N64", "M128-N32"])
@pytest.mark.parametrize("capability", [SM100, SM90], ids=["sm100a", "sm90a"])
def test_engine_probe_compiles(capability, BM, BN):
    report = compile_kernel(_probe(capability, BM, BN), capability)
    ptx = report.ptx
    if capability == SM100:
        for needle in ("tcgen05.mma", "tcgen05.ld", "tcgen05.st", "tcgen05.alloc", "tcgen05.commit"):
            assert needle in ptx, needle
        assert "wgmma" not in ptx
    else:
        assert "wgmma.mma_async" in ptx and "tcgen05" not in ptx
    assert report.spill_bytes == 0
    assert report.shared_bytes <= SMEM_OPTIN[capability]


@gluon.jit
def _ws_probe_loader(a_desc, b_desc, a_ring, b_ring, ready, empty, NT: gl.constexpr):
    """Worker partition (one warp): TMA loads into a two-stage ring, each stage waited free."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    for i in range(NT):
        s = i % 2
        mbarrier.wait(empty.index(s), ((i // 2) & 1) ^ 1)  # a fresh ring's stages start free
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma_load(a_desc, [i * BM, 0], ready.index(s), a_ring.index(s))
        tma_load(b_desc, [0, 0], ready.index(s), b_ring.index(s))


@gluon.jit
def _ws_probe_math(c_desc, a_ring, b_ring, ready, empty, mma_bar, ENGINE: gl.constexpr, NT: gl.constexpr):
    """Default partition (one warpgroup): c = sum_i a_i b, each stage released after its MMA."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    acc = ENGINE.acc_alloc(BM, BN)
    for i in range(NT):
        s = i % 2
        mbarrier.wait(ready.index(s), (i // 2) & 1)
        acc = ENGINE.mma(a_ring.index(s), b_ring.index(s), acc, i > 0, mma_bar)
        acc = ENGINE.mma_wait(acc, mma_bar, i & 1)
        mbarrier.arrive(empty.index(s), count=1)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
    c_smem.store(ENGINE.acc_read(acc).to(c_desc.dtype))
    fence_async_shared()
    tma_store(c_desc, [0, 0], c_smem)
    tma.store_wait(0)


@gluon.jit
def _ws_probe_kernel(a_desc, b_desc, c_desc, ENGINE: gl.constexpr, NT: gl.constexpr):
    """A warp-specialized pipeline in the shape the fused kernels need: a TMA loader warp
    feeding the matrix engine's warpgroup through a ring of mbarrier pairs."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [2, BM, BK], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [2, BK, BN], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mma_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(mma_bar, count=1)
    gl.warp_specialize([(_ws_probe_math, (c_desc, a_ring, b_ring, ready, empty, mma_bar, ENGINE, NT)),
                        (_ws_probe_loader, (a_desc, b_desc, a_ring, b_ring, ready, empty, NT))], [1], [24])


@pytest.mark.slow
@pytest.mark.parametrize("capability", [SM100, SM90], ids=["sm100a", "sm90a"])
def test_warp_specialized_probe_compiles(capability):
    """gl.warp_specialize with the engine's MMA in the default partition and a TMA loader
    warp compiles for both targets: registers are split per partition (setmaxnreg), the
    engine's instructions and the TMA copies are there, nothing spills."""
    BM = BN = 64
    layout = E.smem_layout([BM, BN], gl.bfloat16)
    desc = f"tensordesc<bf16[{BM}, {BN}],{layout!r}>"
    kernel = AotKernel(backend="probe", kernel="warp_specialized", specialization=f"M{BM}-N{BN}",
                       fn=_ws_probe_kernel, signature={"a_desc": desc, "b_desc": desc, "c_desc": desc,
                                                       "ENGINE": "constexpr", "NT": "constexpr"},
                       constexprs={"ENGINE": (gluon_sm100 if capability == SM100 else gluon_sm90).ENGINE, "NT": 4},
                       dialect="gluon")
    report = compile_kernel(kernel, capability)
    ptx = report.ptx
    assert "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx
    assert ("tcgen05.mma" if capability == SM100 else "wgmma.mma_async") in ptx
    assert report.spill_bytes == 0
    assert report.shared_bytes <= SMEM_OPTIN[capability]


# ---------------------------------------------------------------------------------------
# Every kernels_for_aot entry of both backends

def _entries(module, capability):
    return [pytest.param(k, id=f"{k.kernel}-{k.specialization}") for k in module.kernels_for_aot(capability)]


#: Kernels with no matrix engine and no TMA: the qk l2 norms are a row reduction.
PLAIN_KERNELS = {"qk_rnorm_fwd", "qk_l2norm_fwd"}


def _check_common(report, capability):
    # Only gluon_sm90's warp-specialized kernel allows any (its list says why).
    allowed = report.kernel.spill_bytes_allowed
    assert report.spill_bytes <= allowed, f"{report.spill_bytes} bytes of spills (at most {allowed})"
    assert report.shared_bytes <= SMEM_OPTIN[capability], f"{report.shared_bytes} B of shared memory"
    ptx = report.ptx
    if report.kernel.kernel in PLAIN_KERNELS:
        # 16-byte global loads of the 16-bit rows, and no matrix instructions.
        assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "expected 16-byte loads"
        assert "wgmma" not in ptx and "tcgen05" not in ptx
        if report.kernel.kernel == "qk_l2norm_fwd":
            assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx), "expected 16-byte stores of the rows"
        return False
    assert "cp.async.bulk.tensor" in ptx
    assert "mbarrier.try_wait" in ptx
    return True


@pytest.mark.slow
@pytest.mark.parametrize("kernel", _entries(gluon_sm100, SM100))
def test_gluon_sm100_kernel_compiles(kernel):
    report = compile_kernel(kernel, SM100)
    if not _check_common(report, SM100):
        return
    ptx = report.ptx
    for needle in ("tcgen05.mma", "tcgen05.ld", "tcgen05.alloc"):
        assert needle in ptx, needle
    if kernel.constexprs.get("HAS_TAILS"):
        assert "tile::scatter4" in ptx, "a kernel storing varlen tails must use the TMA scatter"
    assert "trap;" not in ptx  # TMEM over-subscription compiles into a trap-only kernel
    assert report.tmem_columns <= TMEM_COLUMNS


@pytest.mark.slow
@pytest.mark.parametrize("kernel", _entries(gluon_sm90, SM90))
def test_gluon_sm90_kernel_compiles(kernel):
    report = compile_kernel(kernel, SM90)
    if not _check_common(report, SM90):
        return
    assert "wgmma.mma_async" in report.ptx
    assert "tcgen05" not in report.ptx
    # ptxas keeps every shipped build's wgmma in flight (no note C7512).
    assert not report.wgmma_serialized, "ptxas serialized the kernel's wgmma"
    if kernel.kernel == "fused_fwd":
        # Two partitions with their own register budgets: the aux warpgroup's, the
        # state's (the rest; one state warpgroup at V = 64), and the 64-row register
        # operand of the chain's MMAs.
        budgets = _register_budgets(report.ptx)
        assert _fused_budgets(kernel) <= budgets, budgets
        assert re.search(r"wgmma\.mma_async[^;]*\}, \{%r", report.ptx), "no register left operand"


@pytest.fixture
def build_flags(monkeypatch):
    """Sets module flags of a build (``(module, name, value)`` each) with the plan cache
    cleared around them: a plan cached under other flags would carry their constexprs."""
    def apply(*settings):
        for module, name, value in settings:
            monkeypatch.setattr(module, name, value)
        clear_plan_cache()
    yield apply
    clear_plan_cache()


@pytest.mark.slow
@pytest.mark.parametrize("tails", [False, True], ids=["dense", "varlen"])
def test_sm90_fused_kernel_with_two_v_slots(tails, build_flags):
    """The fused kernel with a two-slot v ring (:data:`fused.V_SLOTS`) and both T tiles
    (:data:`wy_t.WY_T_SINGLE_TILE` off: w and u formed in the aux partition): 16 KB more
    shared memory than one slot, as planned and within the 227 KB opt-in limit; the register
    budgets, the wgmma count and the spill allowance as with one slot."""
    from gdn_dispatch.backends.gluon_common import wy_t
    from gdn_dispatch.backends.gluon_sm90 import fused

    build_flags((fused, "V_SLOTS", 2), (wy_t, "WY_T_SINGLE_TILE", False))
    kernel = next(k for k in fused.fused_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)
                  if k.constexprs["HAS_TAILS"] == tails)
    assert kernel.constexprs["V_SLOTS"] == 2
    report = compile_kernel(kernel, SM90)
    assert report.spill_bytes <= kernel.spill_bytes_allowed
    planned = fused.fused_smem_bytes(128, 128, 2, v_slots=2)
    assert planned <= report.shared_bytes <= planned + 1024 and report.shared_bytes <= SMEM_OPTIN[SM90]
    budgets = _register_budgets(report.ptx)
    assert {120, 192} <= budgets, budgets
    # The state's P^T (8 k-steps), update (4), O^T (8), v_new^T scores^T (4); the aux's
    # q k^T (8), two w and two u halves (4 each).
    assert len(re.findall(r"wgmma\.mma_async", report.ptx)) == 48


@pytest.mark.slow
def test_sm90_t_u_alone_and_the_chain_that_forms_v_new(build_flags):
    """With :data:`wy_t.WY_T_SINGLE_TILE` the T kernel stores one [64, 64] tile per program
    (T_u) from the inverse's registers (its ``DIRECT_STORE`` with the blocked inverse: no
    TMA store), and the fused kernel forms ``v_new^T = (v^T - P^T diag(2^g)) T_u^T`` in its
    state partition: 36 wgmma (the state's P^T 8, v_new^T 4, update 4, O^T 8 + 4; the aux's q k^T
    8), the aux partition left with q k^T alone and no TMA load (the state partition refills
    v and T), T ring, w and u rings gone from shared memory as planned; within the spill
    allowances. (The two-launch build: :data:`fused.AUX_T` off.)"""
    from gdn_dispatch.backends.gluon_common import wy_t
    from gdn_dispatch.backends.gluon_sm90 import fused

    build_flags((wy_t, "WY_T_SINGLE_TILE", True), (wy_t, "WY_T_BLOCK_TMA", False), (fused, "AUX_T", False))
    t_kernel = next(k for k in wy_t.wy_t_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)
                    if k.constexprs["HAS_TAILS"])
    assert t_kernel.constexprs["SINGLE_T"] is True and t_kernel.constexprs["DIRECT_STORE"] is True
    report = compile_kernel(t_kernel, SM90)
    assert report.spill_bytes <= t_kernel.spill_bytes_allowed
    assert "cp.async.bulk.tensor" in report.ptx  # k's load
    assert "cp.async.bulk.tensor.2d.global.shared" not in report.ptx
    assert re.search(r"st\.global(\.\w+)*\.b(16|32)", report.ptx)

    kernel = next(k for k in fused.fused_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)
                  if k.constexprs["HAS_TAILS"])
    assert kernel.constexprs["SINGLE_T"] is True and kernel.constexprs["AUX_T"] is False
    report = compile_kernel(kernel, SM90)
    assert report.spill_bytes <= kernel.spill_bytes_allowed
    planned = fused.fused_smem_bytes(128, 128, 2, v_slots=fused.V_SLOTS, single_t=True)
    assert planned <= report.shared_bytes <= planned + 1024
    assert len(re.findall(r"wgmma\.mma_async", report.ptx)) == 36
    dot, load = "ttng.warp_group_dot ", "ttng.async_tma_copy_global_to_local"
    ops = _partition_ops(report.ttgir, (dot, load))
    assert ops["partition0"][dot] == 1 and load not in ops["partition0"], ops
    assert ops["default"][dot] == 5 and ops["default"][load] >= 4, ops


@pytest.mark.slow
def test_sm90_t_u_in_sixteen_tma_boxes(build_flags):
    """With :data:`wy_t.WY_T_BLOCK_TMA` the T kernel stages T_u's blocks in shared memory and
    sends them with sixteen 2-D TMA stores, and no plain global store writes T (the one
    left is g_cum's); the inverse's table swizzle keeps the build within its register cap
    and spill allowance."""
    from gdn_dispatch.backends.gluon_common import wy_t

    build_flags((wy_t, "WY_T_SINGLE_TILE", True), (wy_t, "WY_T_BLOCK_TMA", True))
    for t_kernel in wy_t.wy_t_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)[:2]:
        assert t_kernel.constexprs["BLOCK_TMA"] is True
        report = compile_kernel(t_kernel, SM90)
        assert report.spill_bytes <= t_kernel.spill_bytes_allowed
        assert report.registers <= wy_t.WY_T_MAXNREG_SM90
        assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", report.ptx)) == 16
        assert not re.search(r"st\.global(\.\w+)*\.b16", report.ptx)


@pytest.mark.slow
@pytest.mark.parametrize("aux_t", [True, False], ids=["one-launch", "t-kernel"])
def test_sm90_qk_norm_on_chip(aux_t, build_flags):
    """With :data:`fused.QK_NORM_ON_CHIP` the backend's AOT list holds the T kernel on raw k
    (USE_L2NORM) and the fused kernel with QK_NORM for every bf16 core case (fp16 calls with
    the norm run on normalized copies), the fused kernel forming the chunk inverses itself
    (:data:`fused.AUX_T`) or not; they compile within
    their spill allowances, the fused kernel's shared memory as planned (four gate vectors
    a slot), and its reciprocal norms are reduced in the kernel (rsqrt)."""
    from gdn_dispatch.backends.gluon_sm90 import fused

    # K = V = 128 (test_sm90_path_kernels_at_small_heads takes the K or V = 64 builds).
    build_flags((fused, "QK_NORM_ON_CHIP", True), (fused, "AUX_T", aux_t))
    l2 = [k for k in gluon_sm90.kernels_for_aot(SM90) if k.specialization.endswith("-l2") and not _small_heads(k)]
    t_kernels = [k for k in l2 if k.kernel == "wy_t_fwd"]
    fused_kernels = [k for k in l2 if k.kernel == "fused_fwd"]
    assert len(fused_kernels) == 4 and len(t_kernels) == 8
    assert all("bf16" in k.specialization for k in l2)
    assert all(k.constexprs["USE_L2NORM"] for k in t_kernels) and all(k.constexprs["QK_NORM"] for k in fused_kernels)
    assert all(k.constexprs["AUX_T"] is aux_t for k in fused_kernels)
    for kernel in t_kernels[:2] + fused_kernels[:2]:
        report = compile_kernel(kernel, SM90)
        assert report.spill_bytes <= kernel.spill_bytes_allowed
        assert "rsqrt.approx" in report.ptx
        if kernel.kernel == "fused_fwd":
            planned = fused.fused_smem_bytes(128, 128, 2, v_slots=fused.V_SLOTS, single_t=True, qk_norm=True,
                                             aux_t=kernel.constexprs["AUX_T"],
                                             state_scores=kernel.constexprs["STATE_SCORES"])
            assert planned <= report.shared_bytes <= planned + 1024


@pytest.mark.slow
@pytest.mark.parametrize("state_scores", [False, True], ids=["aux-scores", "state-scores"])
@pytest.mark.parametrize("l2", [False, True], ids=["plain", "qk-l2-on-chip"])
def test_sm90_fused_kernel_forms_the_inverses_itself(l2, state_scores, build_flags):
    """With :data:`fused.AUX_T` the fused kernel forms T_u in its aux partition: the plan
    has no T descriptor, the aux partition issues k k^T beside q k^T (44 wgmma in all, 8
    more than the T_u-alone build; q k^T in the state partition with
    :data:`fused.STATE_SCORES`, whose P^T and S_old^T q^T then go out as one product with
    :data:`fused.WIDE_KQ`: 8 wgmma fewer) and the blocked inverse's block products (:func:`.blocked_inverse.inverse_products`), and reads
    the raw gate and beta rows itself; the state partition refills k / q and v only (no T
    load anywhere); shared memory as planned (the inverse's 16 KB of tables more), the
    register budgets as without it, spills within the allowance."""
    from gdn_dispatch.backends.gluon_sm90 import fused

    build_flags((fused, "AUX_T", True), (fused, "QK_NORM_ON_CHIP", True), (fused, "STATE_SCORES", state_scores))
    kernel = next(k for k in fused.fused_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)
                  if k.constexprs["HAS_TAILS"] and k.constexprs["QK_NORM"] == l2)
    assert kernel.constexprs["AUX_T"] is True and kernel.constexprs["t_desc"] is None
    assert kernel.constexprs["STATE_SCORES"] is state_scores
    assert kernel.spill_bytes_allowed == fused.aux_t_spill_bytes(state_scores)
    report = compile_kernel(kernel, SM90)
    assert report.spill_bytes <= kernel.spill_bytes_allowed
    planned = fused.fused_smem_bytes(128, 128, 2, v_slots=fused.V_SLOTS, single_t=True, qk_norm=l2, aux_t=True,
                                     state_scores=kernel.constexprs["STATE_SCORES"])
    assert planned <= report.shared_bytes <= planned + 1024 and report.shared_bytes <= SMEM_OPTIN[SM90]
    wide = state_scores and _wide_kq()
    assert len(re.findall(r"wgmma\.mma_async", report.ptx)) == (36 if wide else 44)
    assert blocked_inverse.ptx_products(report.ptx) == blocked_inverse.inverse_products()
    budgets = _register_budgets(report.ptx)
    assert {120, 192} <= budgets, budgets
    dot, load, plain = "ttng.warp_group_dot ", "ttng.async_tma_copy_global_to_local", "tt.load "
    ops = _partition_ops(report.ttgir, (dot, load, plain))
    aux_dots = 1 if state_scores else 2
    assert ops["partition0"][dot] == aux_dots and load not in ops["partition0"] and ops["partition0"][plain] >= 4, ops
    # k, q and v (T was the fourth), and the prologue's two chunks of them.
    # The state's dots: one fewer with P^T and S_old^T q^T as one (WIDE_KQ).
    state_dots = 7 - aux_dots - (1 if wide else 0)
    assert ops["default"][dot] == state_dots and ops["default"][load] == 3 and ops["outside"][load] == 6, ops


def one_kernel_builds() -> list[dict]:
    """The one-kernel fused builds (``AUX_T``; sm_90a with and without ``STATE_SCORES`` and
    with the qk l2 norm on chip, sm_100a), each compile report in numbers: in a process of
    its own with the blocked inverse's flags set (they are jit globals, fixed at their
    first compile)."""
    from gdn_dispatch.backends.gluon_sm90 import fused as fused90
    from gdn_dispatch.backends.gluon_sm100 import fused as fused100

    fused90.AUX_T, fused90.QK_NORM_ON_CHIP, fused100.AUX_T = True, True, True
    picks = []
    for state_scores, l2 in ((False, False), (True, False), (True, True)):
        fused90.STATE_SCORES = state_scores
        clear_plan_cache()
        kernels = fused90.fused_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)
        picks.append(("sm90", SM90, next(k for k in kernels
                                         if k.constexprs["HAS_TAILS"] and k.constexprs["QK_NORM"] == l2)))
    picks.append(("sm100", SM100, next(k for k in fused100.fused_kernels_for_aot(SM100, "gluon_sm100",
                                                                                 engine=gluon_sm100.ENGINE)
                                       if k.constexprs["HAS_TAILS"])))
    builds = []
    for arch, capability, kernel in picks:
        report = compile_kernel(kernel, capability)
        builds.append({"arch": arch, "spec": kernel.specialization, "spills": report.spill_bytes,
                       "allowed": kernel.spill_bytes_allowed, "serialized": report.wgmma_serialized,
                       "products": blocked_inverse.ptx_products(report.ptx), "ldmatrix": report.ptx.count("ldmatrix"),
                       "trap": "trap;" in report.ptx, "aux_t": kernel.constexprs["AUX_T"]})
    return builds


@pytest.mark.slow
@pytest.mark.parametrize("series", [False, True], ids=["doubling", "series"])
def test_one_kernel_builds_compile_with_half_tables(series):
    """:data:`.blocked_inverse.HALF_TABLES` (with :data:`.blocked_inverse.F16_OPERANDS`) in
    the one-kernel fused builds (sm_90a and sm_100a), with the diagonal blocks by doubling
    or by the series (:data:`.blocked_inverse.DIAGONAL_SERIES`): the inverse's 30 (32) fp16
    products reading the tables by ldmatrix (twelve more than their other ldmatrix at
    least), its redo by rows on the CUDA cores (no tf32 product), sm_90a's wgmma in flight,
    no trap, spills within the builds' allowance (sm_90a's aux keeps A for the redo in
    shared memory, where forming it again spilled 276-612 bytes)."""
    from pathlib import Path

    from gdn_dispatch.testing import call_in_fresh_process

    flags = [f"gluon_common.blocked_inverse.{name}={int(value)}"
             for name, value in (("F16_OPERANDS", True), ("HALF_TABLES", True), ("DIAGONAL_SERIES", series))]
    builds = call_in_fresh_process(Path(__file__), "m.one_kernel_builds()", flags, timeout=1800)
    assert [b["arch"] for b in builds] == ["sm90", "sm90", "sm90", "sm100"] and all(b["aux_t"] for b in builds)
    for b in builds:
        assert b["products"] == {"f16": 32 if series else 30, "tf32": 0}, b
        assert b["ldmatrix"] >= 12 and not b["serialized"] and not b["trap"], b
        assert b["spills"] <= b["allowed"], b


def aux_partition_builds() -> list[dict]:
    """sm_90a's one-kernel fused builds as shipped (``AUX_T``, ``STATE_SCORES``; plain and
    with the qk l2 norm on chip), compiled in this process with its jit globals as set:
    the aux partition's barriers (its warpgroup is the kernel's one group of 128 threads),
    the wgmma waits by the groups they leave in flight, spills and their allowance, wgmma
    serialization, shared memory and its plan."""
    from gdn_dispatch.backends.gluon_sm90 import fused

    fused.AUX_T, fused.QK_NORM_ON_CHIP, fused.STATE_SCORES = True, True, True
    builds = []
    for l2 in (False, True):
        kernel = next(k for k in fused.fused_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)
                      if k.constexprs["HAS_TAILS"] and k.constexprs["QK_NORM"] == l2)
        report = compile_kernel(kernel, SM90)
        aux_barriers = re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+\d+, 128;", report.ptx)
        waits = re.findall(r"\bwgmma\.wait_group\.sync\.aligned\s+(\d+);", report.ptx)
        builds.append({"l2": l2, "aux_barriers": len(aux_barriers),
                       "mbarriers": len(re.findall(r"\bmbarrier\.init\b", report.ptx)),
                       "wgmma_waits": {n: waits.count(n) for n in sorted(set(waits))},
                       "spills": report.spill_bytes, "allowed": kernel.spill_bytes_allowed,
                       "serialized": report.wgmma_serialized, "shared": report.shared_bytes,
                       "planned": fused.fused_smem_bytes(128, 128, 2, v_slots=fused.V_SLOTS, single_t=True, qk_norm=l2,
                                                         aux_t=True, state_scores=True)})
    return builds


def aux_builds_with(settings: list[str]) -> list[dict]:
    """:func:`aux_partition_builds` in a fresh process with the build flags ``settings``
    (``MODULE.NAME=VALUE``) set."""
    from pathlib import Path

    from gdn_dispatch.testing import call_in_fresh_process

    return call_in_fresh_process(Path(__file__), "m.aux_partition_builds()", settings, timeout=1800)


@pytest.mark.slow
def test_scores_behind_v_new_take_the_state_scores_off_its_chain():
    """:data:`fused.SCORES_BEHIND_V_NEW` in sm_90a's one-kernel builds: the state's q k^T
    issued behind v_new^T's product and waited for with the state update in flight (two
    waits that leave one group in flight, none in the other order), fewer waits in all, no
    wgmma serialized, spills within the allowance, shared memory unchanged (on rings of two
    slots: :data:`fused.AUX_RING_SLOTS` past two needs this order). On as shipped; the test
    compiles both."""
    off = aux_builds_with(["gluon_sm90.fused.SCORES_BEHIND_V_NEW=0"])
    on = aux_builds_with(["gluon_sm90.fused.SCORES_BEHIND_V_NEW=1", "gluon_sm90.fused.AUX_RING_SLOTS=2"])
    for before, after in zip(off, on):
        assert "1" not in before["wgmma_waits"] and after["wgmma_waits"]["1"] == 2, (before, after)
        assert sum(after["wgmma_waits"].values()) < sum(before["wgmma_waits"].values()), (before, after)
        assert after["shared"] == before["shared"] and after["planned"] == before["planned"], (before, after)
        for build in (before, after):
            assert build["spills"] <= build["allowed"] and not build["serialized"], build


@pytest.mark.slow
def test_aux_ring_slots_let_the_aux_partition_run_two_chunks_ahead():
    """:data:`fused.AUX_RING_SLOTS` in sm_90a's one-kernel builds: a third slot of the k/q,
    T_u and gate rings (and of the state's gate rows) and its four mbarriers (k/q ready and
    empty, the aux's chunk ready and done): 32 KB of k/q, 8 KB of T_u and the slot's gate
    vectors more, as planned and within the SM's 227 KB; spills within the allowance, no
    wgmma serialized. The test compiles two and three."""
    two = aux_builds_with(["gluon_sm90.fused.AUX_RING_SLOTS=2"])
    three = aux_builds_with(["gluon_sm90.fused.AUX_RING_SLOTS=3"])
    for before, after in zip(two, three):
        gates = 4 if after["l2"] else 3
        slot = 2 * 64 * 128 * 2 + 64 * 64 * 2 + (gates + 2) * 64 * 4 + 4 * 8
        assert after["planned"] - before["planned"] == slot, (before, after)
        assert after["mbarriers"] == before["mbarriers"] + 4, (before, after)
        for build in (before, after):
            assert build["planned"] <= build["shared"] <= min(build["planned"] + 1024, SMEM_OPTIN[SM90]), build
            assert build["spills"] <= build["allowed"] and not build["serialized"], build


@pytest.mark.slow
def test_swizzled_redo_buffer_keeps_the_one_kernel_build():
    """:data:`.blocked_inverse.SWIZZLED_REDO_BUFFER` in sm_90a's one-kernel builds: A's copy
    for the fp16 inverse's redo in the swizzled layout (the redo loads it back into the
    tables) compiles to the same shared memory and barriers, spills within the allowance,
    no wgmma serialized; the build with the qk l2 norm on chip keeps the row-major buffer
    (its spills as without the flag). On as shipped; the test compiles both, against the
    row-major buffer (:data:`.blocked_inverse.PADDED_REDO_BUFFER` off in both)."""
    off = aux_builds_with(["gluon_common.blocked_inverse.SWIZZLED_REDO_BUFFER=0",
                           "gluon_common.blocked_inverse.PADDED_REDO_BUFFER=0"])
    on = aux_builds_with(["gluon_common.blocked_inverse.SWIZZLED_REDO_BUFFER=1",
                          "gluon_common.blocked_inverse.PADDED_REDO_BUFFER=0"])
    for before, after in zip(off, on):
        assert after["shared"] == before["shared"] and after["mbarriers"] == before["mbarriers"], (before, after)
        if after["l2"]:
            assert after["spills"] == before["spills"], (before, after)
        for build in (before, after):
            assert build["spills"] <= build["allowed"] and not build["serialized"], build


def assert_flag_fits_its_plan(setting: str, extra_bytes, others: tuple[str, ...] = ()) -> None:
    """The one-kernel builds (:func:`aux_builds_with`) with the boolean build flag
    ``setting`` (``MODULE.NAME``) off and on, ``others`` (``MODULE.NAME=VALUE``) set in both:
    on plans ``extra_bytes`` more shared memory (a number, or a function of the build's
    record) and the same mbarriers; each build's shared memory within its plan, its spills
    within the allowance, no wgmma serialized."""
    off = aux_builds_with([*others, f"{setting}=0"])
    on = aux_builds_with([*others, f"{setting}=1"])
    for before, after in zip(off, on):
        extra = extra_bytes(after) if callable(extra_bytes) else extra_bytes
        assert after["planned"] == before["planned"] + extra, (before, after)
        assert after["mbarriers"] == before["mbarriers"], (before, after)
        for build in (before, after):
            assert build["planned"] <= build["shared"] <= build["planned"] + 1024, build
            assert build["spills"] <= build["allowed"] and not build["serialized"], build


@pytest.mark.slow
def test_padded_redo_buffer_fits_its_plan():
    """:data:`.blocked_inverse.PADDED_REDO_BUFFER` in sm_90a's one-kernel builds (with and
    without the qk l2 norm on chip), off and on: 32 bytes of padding a row of A's copy where
    the copy is not swizzled (the builds with the norm on chip, as shipped), 2 KB more shared
    memory there as planned and none elsewhere, the same barriers, spills within the
    allowance, no wgmma serialized; and with the swizzled buffer off, padded in every build."""
    assert_flag_fits_its_plan("gluon_common.blocked_inverse.PADDED_REDO_BUFFER",
                              lambda build: 64 * 8 * 4 if build["l2"] else 0)
    assert_flag_fits_its_plan("gluon_common.blocked_inverse.PADDED_REDO_BUFFER", 64 * 8 * 4,
                              others=("gluon_common.blocked_inverse.SWIZZLED_REDO_BUFFER=0",))


@pytest.mark.slow
def test_late_range_check_fits_its_plan():
    """:data:`.blocked_inverse.LATE_RANGE_CHECK` in sm_90a's one-kernel builds (with and
    without the qk l2 norm on chip): the warps' sums of T's squares through 16 bytes of
    shared memory, as planned, the same mbarriers, spills within the allowance, no wgmma
    serialized. Off as shipped; the test compiles both."""
    assert_flag_fits_its_plan("gluon_common.blocked_inverse.LATE_RANGE_CHECK", 16)


def _sass_counts():
    """``benchmarks/sass_counts.py`` as a module (it compiles the fused kernel and reads its SASS)."""
    from pathlib import Path

    from gdn_dispatch.testing import script_module

    return script_module(Path(__file__).resolve().parents[1] / "benchmarks" / "sass_counts.py",
                         "sass_counts_of_the_fused_kernel")


def _wide_kq() -> bool:
    """Whether the one-kernel build with the state's scores issues P^T and S_old^T q^T as one
    product (:data:`.gluon_sm90.fused.WIDE_KQ`, which needs :data:`.fused.SCORES_BEHIND_V_NEW`)."""
    from gdn_dispatch.backends.gluon_sm90 import fused

    return bool(fused.SCORES_BEHIND_V_NEW.value and fused.WIDE_KQ.value)


def state_loop_local_loads(dense: bool) -> dict:
    """sm_90a's one-kernel fused build as shipped (with ragged tails unless ``dense``),
    compiled in this process with its jit globals as set: the local loads (reloads of
    spilled values) in the state partition's chunk loop, the loop that holds its update
    (``benchmarks/sass_counts.py``'s reading of nvdisasm), and the kernel's spill bytes."""
    counts = _sass_counts()
    _, report, sass = counts.fused_sass(dense=dense)
    instructions = counts.attribute(sass)
    for start, end in counts.loops(sass):
        if any(start <= at <= end and owner == "fused.py:_update_then_scores" for at, owner, _ in instructions):
            return {"local_loads": counts.local_loads(instructions, start, end), "spills": report.spill_bytes}
    raise AssertionError("no chunk loop holds the state partition's update")


@pytest.mark.slow
@pytest.mark.parametrize("dense", [False, True], ids=["tails", "dense"])
def test_state_loop_forms_its_scores_mask_in_the_loop(dense):
    """:data:`.gluon_sm90.fused.SCORES_MASK_IN_LOOP` (on): the state partition forms its
    scores' causal mask in each chunk, so the kernel spills fewer bytes than the build that
    hoists the mask before the walk and, under triton 3.6.0 (the toolchain the flag was
    timed on), its chunk loop reloads fewer spilled values (the hoisted mask's words were
    spilled and reloaded every chunk: 17-18 local loads in the loop against 5-7 as
    shipped). Under 3.9.0 ptxas places the spills otherwise: with ragged tails the two
    loops' reloads came within one of each other (25 against 24), while the spills stayed
    fewer (132 bytes against 204)."""
    from pathlib import Path

    from gdn_dispatch.testing import call_in_fresh_process

    call = f"m.state_loop_local_loads({dense})"
    shipped = call_in_fresh_process(Path(__file__), call, [], timeout=900)
    hoisted = call_in_fresh_process(Path(__file__), call, ["gluon_sm90.fused.SCORES_MASK_IN_LOOP=0"], timeout=900)
    assert shipped["spills"] < hoisted["spills"], (shipped, hoisted)
    if triton.__version__.startswith("3.6."):
        assert shipped["local_loads"] < hoisted["local_loads"], (shipped, hoisted)
        assert shipped["local_loads"] <= 8 and hoisted["local_loads"] >= 15, (shipped, hoisted)


def state_products(l2: bool) -> dict:
    """sm_90a's one-kernel fused build as shipped (with ragged tails, with the qk l2 norm on
    chip under ``l2``), compiled in this process with its jit globals as set: its wgmma by
    shape (``m64nNk16`` -> count), shared bytes, spills and whether ptxas serialized them."""
    import collections

    _, report, _ = _sass_counts().fused_sass(l2=l2)
    shapes = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", report.ptx))
    return {"shapes": dict(shapes), "shared": report.shared_bytes, "spills": report.spill_bytes,
            "allowed": report.kernel.spill_bytes_allowed, "serialized": report.wgmma_serialized}


@pytest.mark.slow
@pytest.mark.parametrize("l2", [False, True], ids=["raw", "l2"])
def test_state_issues_its_register_products_as_one(l2):
    """:data:`.gluon_sm90.fused.WIDE_KQ` (on): the state's ``P^T = S^T k^T`` and ``S_old^T
    q^T`` go out as one product over the k/q slot's rows (k's then q's in one tile): eight
    m64n128k16 wgmma in place of sixteen m64n64k16 (K = 128 in steps of 16), every other
    product as before, the same shared memory, nothing serialized, spills within the
    kernel's allowance."""
    from pathlib import Path

    from gdn_dispatch.testing import call_in_fresh_process

    call = f"m.state_products({l2})"
    wide = call_in_fresh_process(Path(__file__), call, [], timeout=900)
    narrow = call_in_fresh_process(Path(__file__), call, ["gluon_sm90.fused.WIDE_KQ=0"], timeout=900)
    moved = {shape: wide["shapes"].get(shape, 0) - narrow["shapes"].get(shape, 0)
             for shape in set(wide["shapes"]) | set(narrow["shapes"])}
    assert {shape: n for shape, n in moved.items() if n} == {"m64n128k16": 8, "m64n64k16": -16}, (wide, narrow)
    assert wide["shared"] == narrow["shared"], (wide, narrow)
    for build in (wide, narrow):
        assert not build["serialized"] and build["spills"] <= build["allowed"], build


def ceiling_variant(variant: str) -> dict:
    """sm_90a's one-kernel fused build with ``benchmarks/fused_ceiling_probe.py``'s
    ``variant`` swapped in (compiled in this process, whose jit globals it changes): its
    wgmma (HGMMA) and mma.sync (HMMA) SASS instructions and its spill bytes."""
    import collections
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fused_ceiling_probe

    fused_ceiling_probe.swap(variant)
    sass_counts = _sass_counts()
    _, report, sass = sass_counts.fused_sass()
    opcodes = collections.Counter(opcode for _, _, opcode in sass_counts.attribute(sass))
    return {"HGMMA": opcodes["HGMMA"], "HMMA": opcodes["HMMA"], "spills": report.spill_bytes}


@pytest.mark.slow
def test_ceiling_probe_variants_leave_out_what_they_name():
    """``benchmarks/fused_ceiling_probe.py``: ``no_vn`` drops the state's v_new^T product
    (its four m64n64k16 wgmma, K = 64) and nothing else of the tensor work, ``light_aux``
    the blocked inverse's mma.sync products and no wgmma; both compile within the
    shipped build's spills."""
    from pathlib import Path

    from gdn_dispatch.testing import call_in_fresh_process

    builds = {variant: call_in_fresh_process(Path(__file__), f"m.ceiling_variant({variant!r})", [], timeout=900)
              for variant in ("base", "no_vn", "light_aux")}
    base, no_vn, light = builds["base"], builds["no_vn"], builds["light_aux"]
    assert base["HMMA"] > 0, builds
    assert (no_vn["HGMMA"], no_vn["HMMA"]) == (base["HGMMA"] - 4, base["HMMA"]), builds
    assert (light["HGMMA"], light["HMMA"]) == (base["HGMMA"], 0), builds
    assert max(no_vn["spills"], light["spills"]) <= base["spills"], builds


@pytest.mark.slow
def test_aux_keeps_a_fits_its_plan():
    """:data:`.gluon_sm90.fused.AUX_KEEPS_A` in sm_90a's one-kernel builds (with and without
    the qk l2 norm on chip): A kept for the fp16 inverse's redo is the redo buffer's bytes
    (swizzled, or padded with the norm on chip) more than the build that forms A again for
    a redo; the same mbarriers, spills within the allowance, no wgmma serialized. On as
    shipped; the test compiles both."""
    assert_flag_fits_its_plan("gluon_sm90.fused.AUX_KEEPS_A",
                              lambda build: blocked_inverse.redo_buffer_bytes(64, build["l2"]))


@pytest.mark.slow
def test_shared_row_vectors_take_the_aux_partitions_converts_off_its_chain():
    """:data:`.wy.SHARED_ROW_VECTORS` in sm_90a's one-kernel builds: the gate cumsum and
    beta read in each layout from 1 KB of shared memory (in the plan) instead of six
    ``convert_layout`` round trips and a reduction across the warps: at least 12 barriers
    fewer in the aux partition's code (two a convert, three the reduction; the stores bring
    their own); spills within the allowance, wgmma in flight. On as shipped; the test
    compiles both."""
    off = aux_builds_with(["gluon_common.wy.SHARED_ROW_VECTORS=0"])
    on = aux_builds_with(["gluon_common.wy.SHARED_ROW_VECTORS=1"])
    for before, after in zip(off, on):
        assert after["aux_barriers"] <= before["aux_barriers"] - 12, (before, after)
        assert after["planned"] == before["planned"] + 1024, (before, after)
        for build in (before, after):
            assert build["planned"] <= build["shared"] <= build["planned"] + 1024, build
            assert build["spills"] <= build["allowed"] and not build["serialized"], build


@pytest.mark.slow
@pytest.mark.parametrize("aux_t", [False, True], ids=["t-kernel", "aux-t"])
def test_sm90_fused_chain_order_keeps_the_wgmma_pipelined(aux_t, build_flags):
    """With :data:`fused.EARLY_O1` off (the state update and S_old^T q^T in flight together)
    ptxas serializes every wgmma of the fused kernel; with :data:`fused.EARLY_O1` (S_old^T
    q^T issued with P^T) none, the same wgmma count and shared memory, the register budgets
    as before, spills within the kernel's allowance."""
    from gdn_dispatch.backends.gluon_sm90 import fused

    def build(early):
        # The chain orders alone: the state's scores (fused.STATE_SCORES) need EARLY_O1.
        build_flags((fused, "AUX_T", aux_t), (fused, "EARLY_O1", early), (fused, "STATE_SCORES", False))
        kernel = next(k for k in fused.fused_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)
                      if k.constexprs["HAS_TAILS"] and not k.constexprs["QK_NORM"])
        assert kernel.constexprs["EARLY_O1"] is early and kernel.constexprs["AUX_T"] is aux_t
        return compile_kernel(kernel, SM90)

    late, early = build(False), build(True)
    assert late.wgmma_serialized and not early.wgmma_serialized
    assert max(early.spill_bytes, late.spill_bytes) <= late.kernel.spill_bytes_allowed
    assert len(re.findall(r"wgmma\.mma_async", early.ptx)) == len(re.findall(r"wgmma\.mma_async", late.ptx)) \
        == (44 if aux_t else 36)
    assert early.shared_bytes == late.shared_bytes
    budgets = _register_budgets(early.ptx)
    assert {120, 192} <= budgets, budgets


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["bf16-varlen-kv-h0-ht", "bf16-varlen-kv-h0-ht-l2", "K128-V64-bf16-varlen-kv-h0-ht"])
def test_sm90_state_scores_move_q_k_product_to_the_state(spec, build_flags):
    """:data:`fused.STATE_SCORES` (under AUX_T): the same wgmma count as the aux-scores
    build (8 fewer with :data:`fused.WIDE_KQ`, which the state's scores build takes: its P^T
    and S_old^T q^T as one product), one product fewer in the aux partition and one more in
    the state (q k^T moves),
    not serialized, 1 KB more shared memory (the gate rows) on two-slot rings, as planned, and the spills
    within the allowance."""
    from gdn_dispatch.backends.gluon_sm90 import fused

    def build(state_scores):
        build_flags((fused, "AUX_T", True), (fused, "SMALL_HEADS", True), (fused, "STATE_SCORES", state_scores))
        kernel = next(k for k in fused.fused_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)
                      if k.specialization == spec)
        assert kernel.constexprs["STATE_SCORES"] is state_scores
        return compile_kernel(kernel, SM90)

    aux, state = build(False), build(True)
    assert not aux.wgmma_serialized and not state.wgmma_serialized
    count = lambda ptx: len(re.findall(r"wgmma\.mma_async", ptx))  # noqa: E731
    assert count(aux.ptx) == count(state.ptx) + (8 if _wide_kq() else 0)
    K, V = (int(x) for x in re.match(r"K(\d+)-V(\d+)", spec).groups()) if spec.startswith("K") else (128, 128)
    planned = {scores: fused.fused_smem_bytes(K, V, 2, v_slots=fused.V_SLOTS, single_t=True,
                                              qk_norm=spec.endswith("l2"), aux_t=True, state_scores=scores)
               for scores in (False, True)}
    # The gate rows, on rings of two slots (with more, AUX_RING_SLOTS' slots come on top).
    assert fused.fused_smem_bytes(K, V, 2, v_slots=fused.V_SLOTS, single_t=True, qk_norm=spec.endswith("l2"),
                                  aux_t=True, state_scores=True, ring=2) - planned[False] == 2 * 2 * 64 * 4
    # Each build within its plan (the compiler's scratch for layout conversions, which the
    # plan does not count, differs between the two by a few bytes).
    for report, scores in ((aux, False), (state, True)):
        assert planned[scores] <= report.shared_bytes <= planned[scores] + 1024, (scores, report.shared_bytes)
    assert state.kernel.spill_bytes_allowed == fused.AUX_T_SPILL_BYTES
    assert aux.kernel.spill_bytes_allowed == fused.AUX_SCORES_SPILL_BYTES
    assert state.spill_bytes <= state.kernel.spill_bytes_allowed and aux.spill_bytes <= aux.kernel.spill_bytes_allowed
    # q k^T: the wgmma reading two shared tiles in the state partition's code, not the aux's.
    def partition_products(ptx):
        parts = re.split(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32", ptx)
        return [count(part) for part in parts]
    assert partition_products(aux.ptx) != partition_products(state.ptx)


@pytest.mark.slow
@pytest.mark.parametrize("aux_t", [False, True], ids=["t-kernel", "aux-t"])
def test_sm90_path_kernels_at_small_heads(aux_t, build_flags):
    """With :data:`fused.SMALL_HEADS` the backend's AOT list holds the T kernel at K = 64 and
    the fused kernel at every other pair of K, V in {64, 128}; they compile within their
    spill allowances (none for the T kernel's K = 64 builds beyond its own), with one state
    warpgroup and the aux at 232 registers where V = 64 and the usual 120 / 192 where
    V = 128, shared memory as planned."""
    from gdn_dispatch.backends.gluon_sm90 import fused

    build_flags((fused, "SMALL_HEADS", True), (fused, "AUX_T", aux_t), (fused, "QK_NORM_ON_CHIP", True))
    kernels = [k for k in gluon_sm90.kernels_for_aot(SM90) if k.kernel in ("wy_t_fwd", "fused_fwd")
               and _small_heads(k)]
    t_kernels = [k for k in kernels if k.kernel == "wy_t_fwd"]
    fused_kernels = [k for k in kernels if k.kernel == "fused_fwd"]
    # The T kernel at K = 64, with and without tails, on normalized and raw k (listed with or
    # without AUX_T, as the K = 128 ones are).
    assert len(t_kernels) == 4
    assert {k.specialization.split("-bf16")[0].split("-fp16")[0] for k in fused_kernels} == {
        "K64-V64", "K64-V128", "K128-V64"}
    assert len(fused_kernels) == 9
    for kernel in fused_kernels + t_kernels[:2]:
        report = compile_kernel(kernel, SM90)
        assert report.spill_bytes <= kernel.spill_bytes_allowed, kernel.specialization
        if kernel.kernel != "fused_fwd":
            continue
        K, V = (int(x) for x in re.match(r"K(\d+)-V(\d+)", kernel.specialization).groups())
        assert kernel.num_warps == (8 if V == 128 else 4)
        budgets = _register_budgets(report.ptx)
        assert _fused_budgets(kernel) <= budgets, (kernel.specialization, budgets)
        planned = fused.fused_smem_bytes(K, V, 2, v_slots=fused.V_SLOTS, single_t=True,
                                         qk_norm=kernel.constexprs["QK_NORM"], aux_t=aux_t,
                                         state_scores=kernel.constexprs["STATE_SCORES"])
        assert planned <= report.shared_bytes <= planned + 1024, kernel.specialization


def _small_heads(kernel) -> bool:
    """Whether an AOT entry is one of the path's K or V = 64 builds (:data:`fused.SMALL_HEADS`)."""
    return bool(re.match(r"K64|K128-V64", kernel.specialization))


def _fused_budgets(kernel) -> set[int]:
    """The setmaxnreg budgets the fused kernel's partitions ask for: aux 120 and state 192
    beside two state warpgroups (V = 128), 232 and 256 beside one (V = 64)."""
    return {232, 256} if re.match(r"K\d+-V64", kernel.specialization) else {120, 192}


def _register_budgets(ptx: str) -> set[int]:
    """The per-thread register counts a warp-specialized kernel's partitions ask for
    (setmaxnreg), as a set."""
    return {int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}


def _partition_ops(ttgir: str, names: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """How often each op of ``names`` occurs in each region of the kernel's one
    ``ttg.warp_specialize`` ("default", "partition0", ...; "outside" for the rest)."""
    counts, region = {}, "outside"
    for line in ttgir.splitlines():
        stripped = line.strip()
        if stripped.startswith("default {"):
            region = "default"
        elif re.match(r"partition\d+\(", stripped):
            region = stripped.split("(")[0]
        for name in names:
            if name in stripped:
                counts.setdefault(region, {}).setdefault(name, 0)
                counts[region][name] += 1
    return counts


def _sm100_twin_entries():
    from gdn_dispatch.backends.gluon_sm100 import fused

    return [pytest.param(k, id=k.specialization)
            for k in fused.fused_kernels_for_aot(SM100, "gluon_sm100", engine=gluon_sm100.ENGINE)]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", _sm100_twin_entries())
def test_sm100_fused_twin_compiles(kernel):
    """gluon_sm100's warp-specialized kernel (compiled only: never run, not routed): no
    spills; shared memory as planned, within the opt-in limit; all 512 TMEM columns and no
    more; every tcgen05 MMA and commit issued from the one MMA partition (the second
    worker), every TMA load from the load partition (the third), the state partition
    (default) and the aux one (the first) only reading and writing tensor memory; the
    registers split per partition (aux 152, the two one-warp partitions 24)."""
    from gdn_dispatch.backends.gluon_sm100 import fused
    from gdn_dispatch.testing import random_problem

    report = compile_kernel(kernel, SM100)
    assert report.spill_bytes == 0
    planned = fused.fused_smem_bytes(128, 128, 2)
    assert planned <= report.shared_bytes <= planned + 1024 and report.shared_bytes <= SMEM_OPTIN[SM100]
    assert report.tmem_columns == fused.TMEM_COLUMNS == TMEM_COLUMNS
    assert "trap;" not in report.ptx
    ops = _partition_ops(report.ttgir, ("ttng.tc_gen5_mma", "ttng.tc_gen5_commit", "ttng.async_tma_copy_global_to_local",
                                        "ttng.tmem_load", "ttng.tmem_store"))
    mma = {region: c["ttng.tc_gen5_mma"] for region, c in ops.items() if "ttng.tc_gen5_mma" in c}
    commits = {region for region, c in ops.items() if "ttng.tc_gen5_commit" in c}
    loads = {region for region, c in ops.items() if "ttng.async_tma_copy_global_to_local" in c}
    # qk, two w halves (one copy before the loop), u^T (one before the loop), P^T, O1^T,
    # the update and O2^T.
    assert mma == {"partition1": 11}, mma
    assert commits == {"partition1"}, commits
    assert loads == {"partition2"}, loads
    assert "ttng.tmem_load" in ops["default"] and "ttng.tmem_store" in ops["default"]
    assert "ttng.tmem_load" in ops["partition0"]
    budgets = _register_budgets(report.ptx)
    assert {int(fused.AUX_REGS), int(fused.WARP_REGS)} <= budgets, budgets
    # A tail chunk's o goes out through the TMA scatter.
    if kernel.constexprs["HAS_TAILS"]:
        assert "tile::scatter4" in report.ptx
    # Not offered to the forward: it has not run on a Blackwell GPU.
    assert getattr(gluon_sm100.ENGINE, "fused", None) is None
    p = random_problem(lengths=[70, 64], H=2, HV=4, K=128, V=128, dtype=torch.bfloat16)
    assert plan(p, device=assumed_device("sm_100")).fused is False


@pytest.mark.slow
@pytest.mark.parametrize("tails", [True, False], ids=["varlen", "dense"])
def test_sm100_fused_twin_forms_the_inverses_itself(tails, build_flags):
    """With the twin's :data:`AUX_T` (compiled only, as the whole twin) the call is one
    launch: the plan has no T descriptor; the MMA partition still issues every tcgen05 MMA
    and commit: 14 (k k^T, q k^T, both w halves and u^T each before the loop and in it, and
    the chain's four; the default has 11: its second w half only in the loop); the load
    partition loads k, q and v alone (no T load anywhere); the aux partition forms the
    inverse's block products (:func:`.blocked_inverse.inverse_products`) and reads the raw gate and beta rows; shared memory as the
    default's (the inverse's tables in the bytes of a w slot), within the opt-in limit, all
    512 TMEM columns and no more; spills within the build's allowance, none by default."""
    from gdn_dispatch.backends.gluon_sm100 import fused

    default = next(k for k in fused.fused_kernels_for_aot(SM100, "gluon_sm100", engine=gluon_sm100.ENGINE)
                   if k.constexprs["HAS_TAILS"] == tails)
    assert default.constexprs["AUX_T"] is False and default.spill_bytes_allowed == 0
    build_flags((fused, "AUX_T", True))
    kernel = next(k for k in fused.fused_kernels_for_aot(SM100, "gluon_sm100", engine=gluon_sm100.ENGINE)
                  if k.constexprs["HAS_TAILS"] == tails)
    assert kernel.constexprs["AUX_T"] is True and kernel.constexprs["t_desc"] is None
    assert kernel.signature["t_desc"] == "constexpr" and {"g", "beta", "s_g", "s_beta"} <= set(kernel.signature)
    assert kernel.spill_bytes_allowed == fused.AUX_T_SPILL_BYTES
    report = compile_kernel(kernel, SM100)
    assert report.spill_bytes <= kernel.spill_bytes_allowed
    planned = fused.fused_smem_bytes(128, 128, 2)
    assert planned <= report.shared_bytes <= planned + 1024 and report.shared_bytes <= SMEM_OPTIN[SM100]
    assert report.tmem_columns == fused.TMEM_COLUMNS == TMEM_COLUMNS
    assert "trap;" not in report.ptx
    assert blocked_inverse.ptx_products(report.ptx) == blocked_inverse.inverse_products()
    mma, commit, load, plain = ("ttng.tc_gen5_mma", "ttng.tc_gen5_commit", "ttng.async_tma_copy_global_to_local",
                                "tt.load ")
    ops = _partition_ops(report.ttgir, (mma, commit, load, plain))
    assert {region: c[mma] for region, c in ops.items() if mma in c} == {"partition1": 14}, ops
    assert {region for region, c in ops.items() if commit in c} == {"partition1"}, ops
    assert {region: c[load] for region, c in ops.items() if load in c} == {"partition2": 3}, ops
    # The raw gate and beta rows: before the loop and a chunk early in it.
    assert ops["partition0"][plain] >= 4, ops
    budgets = _register_budgets(report.ptx)
    assert {int(fused.AUX_REGS), int(fused.WARP_REGS)} <= budgets, budgets


def test_sm100_twin_plan_of_the_inverses_on_chip(build_flags):
    """The twin's plan with :data:`AUX_T`: no T descriptor (a None constexpr), the kernel's
    raw gate / beta arguments in its signature, the note saying where the inverses are
    formed; the default plan keeps its T descriptor."""
    from gdn_dispatch.backends.gluon_sm100 import fused
    from gdn_dispatch.testing import random_problem

    p = random_problem(lengths=[70, 64], H=2, HV=4, K=128, V=128, dtype=torch.bfloat16)
    device = assumed_device("sm_100")
    default = fused.plan_fused(p, device, engine=gluon_sm100.ENGINE)
    assert "t_desc" in {d.arg for d in default.shared.descriptors} and default.shared.constexprs["AUX_T"] is False
    build_flags((fused, "AUX_T", True))
    on_chip = fused.plan_fused(p, device, engine=gluon_sm100.ENGINE)
    assert "t_desc" not in {d.arg for d in on_chip.shared.descriptors}
    assert on_chip.shared.constexprs["t_desc"] is None and on_chip.shared.constexprs["AUX_T"] is True
    assert "inverses formed in the aux partition" in on_chip.shared.notes
    assert on_chip.shared.blocks["smem_bytes"] == default.shared.blocks["smem_bytes"]


def test_only_the_warp_specialized_path_may_spill():
    """sm_90a: the fused kernel (register reallocation between partitions), the T kernel
    and the w/u kernel (capped for five and four programs per SM); nothing else, and
    nothing on sm_100a."""
    from gdn_dispatch.backends.gluon_common import wy

    for module, cap in ((gluon_sm100, SM100), (gluon_sm90, SM90)):
        allowed = {k.kernel for k in module.kernels_for_aot(cap) if k.spill_bytes_allowed}
        expected = {"fused_fwd", "wy_t_fwd"} | ({"wy_fwd"} if wy.WY_SPLIT_WU else set())
        assert allowed == (expected if cap == SM90 else set())


def test_kernel_lists_cover_both_layouts_and_tails():
    for module, cap in ((gluon_sm100, SM100), (gluon_sm90, SM90)):
        kernels = module.kernels_for_aot(cap)
        # What the forward launches (fp16 calls with the qk l2 norm on normalized copies);
        # on sm_90a also the warp-specialized path.
        extra = {"wy_t_fwd", "fused_fwd"} if cap == SM90 else set()
        assert {k.kernel for k in kernels} == {"wy_fwd", "qk_rnorm_fwd", "qk_l2norm_fwd", "state_output_fwd",
                                               "segment_map_fwd"} | extra
        # Context parallelism's pass 1 at every head dim pair, dtype and norm flag (the norm
        # in bf16 alone), both offset dtypes.
        maps = [k for k in kernels if k.kernel == "segment_map_fwd"]
        assert {(k.signature["k_desc"].split("[")[0], k.constexprs["V"], k.constexprs["USE_L2NORM"],
                 k.signature["cu_seqlens"]) for k in maps} >= {
            (f"tensordesc<{d}", V, l2, "*i32") for d in ("bf16", "fp16") for V in (64, 128) for l2 in (False, True)
            if d == "bf16" or not l2}
        assert {k.signature["cu_seqlens"] for k in maps} == {"*i32", "*i64"}
        # The reciprocal norms of bf16 calls, the normalized copies of fp16's (and of bf16's
        # on the warp-specialized path).
        rnorms = {(k.constexprs["K"], k.signature["q"]) for k in kernels if k.kernel == "qk_rnorm_fwd"}
        assert rnorms == {(K, "*bf16") for K in (64, 128)}
        copies = {(k.constexprs["K"], k.signature["q"]) for k in kernels if k.kernel == "qk_l2norm_fwd"}
        assert copies == {(K, f"*{d}") for K in (64, 128) for d in (("bf16", "fp16") if cap == SM90 else ("fp16",))}
        # No stage after the norm is built for fp16 with the norm: those calls never reach one.
        assert not [k for k in kernels if k.constexprs.get("USE_L2NORM") and "fp16" in k.specialization], cap
        wy = [k for k in kernels if k.kernel == "wy_fwd"]
        assert {(k.constexprs["HAS_TAILS"], k.constexprs["USE_L2NORM"]) for k in wy} == {
            (False, False), (False, True), (True, False), (True, True)}
        state = [k for k in kernels if k.kernel == "state_output_fwd"]
        assert {k.constexprs["STATE_VK"] for k in state} == {False, True}
        assert {k.constexprs["HAS_TAILS"] for k in state} == {False, True}
        assert {k.constexprs["ENGINE"] for k in state} == {module.ENGINE}
        assert module.ENGINE.is_sm100 == (cap == SM100)
        assert {(k.signature["w_desc"].split("[")[1].split("]")[0]) for k in state} >= {"64, 64", "64, 128"}
        assert all(k.backend == module.BACKEND and k.dialect == "gluon" for k in state)
