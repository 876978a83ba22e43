"""The fused kkt + solve + w/u Gluon kernel (backends/gluon_common/wy.py) without a GPU:
launch plans on CPU tensors, the residency the plan promises, and the empty call.

Every specialization is compiled for sm_90a and sm_100a by tests/test_gluon_aot.py and
tests/test_arch_matrix.py (through the backends' AOT lists); its numerics run on a GPU
(tests/test_numerics.py, tests/test_gluon_state_output.py).
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch.aot import compile_kernel  # noqa: E402
from gdn_dispatch.device import SMEM_OPTIN, SMEM_RESERVED_PER_BLOCK, assumed_device  # noqa: E402
from gdn_dispatch.testing import random_problem  # noqa: E402

from gdn_dispatch.backends.gluon_common import blocked_inverse, wy  # noqa: E402
from gdn_dispatch.backends.gluon_common.launch_plan import has_tails  # noqa: E402
from gdn_dispatch.backends.gluon_common.plan import plan  # noqa: E402

SM100, SM90 = (10, 0), (9, 0)


def _engine(capability):
    """The matrix engine of the backend that runs ``capability`` (the plans' ``ENGINE``)."""
    from gdn_dispatch.backends import gluon_sm90, gluon_sm100

    return (gluon_sm100 if capability[0] == 10 else gluon_sm90).ENGINE


#: Shared memory of one H100 / H200 multiprocessor (bytes): the opt-in maximum per block
#: plus the 1 KB each resident block reserves.
SM90_SMEM_PER_SM = SMEM_OPTIN[SM90] + SMEM_RESERVED_PER_BLOCK


def _problem(lengths=None, B=1, T=128, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, l2=False):
    shape = dict(lengths=lengths) if lengths is not None else dict(batch=(B, T))
    return random_problem(**shape, H=H, HV=HV, K=K, V=V, dtype=dtype, seed=1, l2=l2)


@pytest.mark.parametrize("capability", [SM100, SM90], ids=["sm100", "sm90"])
def test_plan_wy_uniform_batch(capability):
    p = _problem(B=2, T=128, H=2, HV=4, K=128, V=64)
    launch = wy.plan_wy(p, capability)
    blocked = wy.WY_DEFAULT_VARIANT == "blocked" and capability == SM90
    assert launch.kernel == "wy_fwd" and launch.num_warps == 4
    assert launch.grid == (2 * 2 * 4,)  # chunks x v-heads
    # No tails: every chunk is a whole tile, so the scatter row descriptors are None constexprs.
    assert launch.constexprs == {"HAS_TAILS": False, "USE_L2NORM": False, "ENGINE": _engine(capability),
                                 "LHS_REGS": wy.WY_DEFAULT_VARIANT != "smem" and not blocked,
                                 "F16_INVERSE": wy.WY_DEFAULT_VARIANT == "f16" and capability == SM90,
                                 "BLOCKED_INVERSE": blocked, "SPLIT_WU": blocked and wy.WY_SPLIT_WU,
                                 "EARLY_ROWS": blocked and wy.WY_EARLY_ROWS, "PICK": False, "w_rows_desc": None,
                                 "u_rows_desc": None}
    assert launch.scalars == {"HV": 4, "GROUP": 2}
    k = launch.desc("k_desc")
    assert (k.tensor, k.shape, k.strides, k.block_shape) == ("k", (256, 2 * 128), (256, 1), (64, 128))
    v = launch.desc("v_desc")
    assert (v.tensor, v.shape, v.block_shape) == ("v", (256, 4 * 64), (64, 64))
    assert launch.desc("u_desc").shape == (256, 4 * 64)
    assert {d.arg for d in launch.descriptors} == {"k_desc", "v_desc", "w_desc", "u_desc"}


def test_plan_wy_varlen_tails_l2_fp16():
    p = _problem(lengths=[1, 63, 64, 65, 130, 0], H=1, HV=2, K=64, V=128, dtype=torch.float16, l2=True)
    launch = wy.plan_wy(p, SM90)
    # Chunk slots: T // 64 + N = 323 // 64 + 6 (the 8 chunks and 3 idle slots) x HV.
    assert launch.grid == ((323 // 64 + 6) * 2,)
    assert launch.constexprs == {"HAS_TAILS": True, "USE_L2NORM": True, "ENGINE": _engine(SM90),
                                 "LHS_REGS": wy.WY_DEFAULT_VARIANT in ("regs", "f16"),
                                 "F16_INVERSE": wy.WY_DEFAULT_VARIANT == "f16",
                                 "BLOCKED_INVERSE": wy.WY_DEFAULT_VARIANT == "blocked",
                                 "SPLIT_WU": wy.WY_DEFAULT_VARIANT == "blocked" and wy.WY_SPLIT_WU,
                                 "EARLY_ROWS": wy.WY_DEFAULT_VARIANT == "blocked" and wy.WY_EARLY_ROWS,
                                 "PICK": False, "w_rows_desc": None, "u_rows_desc": None}
    assert launch.constexprs["HAS_TAILS"] == has_tails(p)
    assert launch.desc("v_desc").signature.startswith("tensordesc<fp16[64, 128],")


@pytest.mark.parametrize("K, V", [(64, 64), (128, 128), (64, 128)])
def test_three_programs_fit_an_sm90_multiprocessor(K, V):
    """The residency the sm_90 launch is tuned for: shared memory and registers of three
    programs within one SM (the plan's budget, and the register cap it passes ptxas); four
    with w and u formed in blocks (:data:`wy.WY_SPLIT_WU`)."""
    for variant in wy.WY_VARIANTS:
        launch = wy.plan_wy(_problem(K=K, V=V), SM90, variant)
        programs = 4 if launch.constexprs["SPLIT_WU"] else 3
        assert programs * (launch.blocks["smem_bytes"] + SMEM_RESERVED_PER_BLOCK) <= SM90_SMEM_PER_SM
        assert launch.maxnreg == (wy.WY_SPLIT_MAXNREG_SM90 if programs == 4 else wy.WY_MAXNREG_SM90)
        assert programs * 128 * launch.maxnreg <= 65536
    assert wy.plan_wy(_problem(K=K, V=V), SM100).maxnreg == 255


@pytest.mark.parametrize("split", [False, True])
def test_blocks_of_w_and_u_are_planned_for_the_blocked_inverse_only(split, monkeypatch):
    monkeypatch.setattr(wy, "WY_SPLIT_WU", split)
    for variant in wy.WY_VARIANTS:
        for capability in (SM90, SM100):
            launch = wy.plan_wy(_problem(lengths=[65, 3]), capability, variant)
            planned = split and variant == "blocked" and capability == SM90
            assert launch.constexprs["SPLIT_WU"] is planned
            assert (launch.maxnreg == wy.WY_SPLIT_MAXNREG_SM90) is planned


def kernel_build(kind: str, spec: str) -> dict:
    """The compile report of the sm_90a AOT entry ``spec`` of the w/u kernel (``kind``
    "wy") or of the T kernel ("wy_t") in numbers, with the build flags as set (in a process
    of its own: :func:`_in_inverse_build`)."""
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.backends.gluon_common import wy_t

    kernels = (wy.wy_kernels_for_aot(SM90) if kind == "wy"
               else wy_t.wy_t_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE))
    kernel = next(k for k in kernels if k.specialization == spec)
    report = compile_kernel(kernel, SM90)
    return {"constexprs": {name: value for name, value in kernel.constexprs.items() if isinstance(value, int)},
            "maxnreg": kernel.maxnreg, "allowed": kernel.spill_bytes_allowed, "registers": report.registers,
            "spills": report.spill_bytes, "shared": report.shared_bytes,
            "products": blocked_inverse.ptx_products(report.ptx), "inverse": blocked_inverse.inverse_products(),
            "wgmma": re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.", report.ptx)}


#: The blocked inverse's builds the compile checks below take: as shipped (fp16 products,
#: fp16 tables, the diagonal blocks by the series) and on tf32 products (all three off).
INVERSE_BUILDS = {"fp16": (True, True, True), "tf32": (False, False, False)}


def _in_inverse_build(build: str, call: str, flags=()):
    """``call`` (an expression over this module, ``m``) in a process of its own with the
    inverse's build ``build`` of :data:`INVERSE_BUILDS` and ``flags`` set (the inverse's
    flags are jit globals, fixed at their first compile)."""
    from pathlib import Path

    from gdn_dispatch.testing import call_in_fresh_process

    inverse = [f"gluon_common.blocked_inverse.{name}={int(value)}"
               for name, value in zip(("F16_OPERANDS", "HALF_TABLES", "DIAGONAL_SERIES"), INVERSE_BUILDS[build])]
    return call_in_fresh_process(Path(__file__), call, inverse + list(flags))


def _k_k_t_steps(K: int, build: str) -> int:
    """wgmma steps of k k^T [64, 64] at head dim K: once, and once more with the fp16
    inverse, whose redo of a chunk past fp16's range forms A again."""
    return K // 16 * (2 if build == "fp16" else 1)


@pytest.mark.slow
@pytest.mark.parametrize("build", list(INVERSE_BUILDS))
@pytest.mark.parametrize("spec", ["K128-V128-varlen-l2-bf16-gfp32-betafp32", "K128-V64-dense-fp16-gfp32-betafp32"])
def test_w_and_u_in_blocks_compile_under_128_registers(spec, build):
    """With :data:`wy.WY_SPLIT_WU` the products w = T_w k and u = T_u v are [64, 64] wgmmas
    only (K / 64 + V / 64 of them, 4 k-steps each, beside k k^T's K / 16), the blocked
    inverse unchanged, at the 128-register cap within the spill allowance of the inverse's
    build (:func:`wy.split_spill_bytes`), in the same shared memory."""
    b = _in_inverse_build(build, f"m.kernel_build('wy', {spec!r})", ["gluon_common.wy.WY_SPLIT_WU=1"])
    assert b["constexprs"]["SPLIT_WU"] is True and b["maxnreg"] == wy.WY_SPLIT_MAXNREG_SM90
    allowed = wy.WY_SPLIT_F16_SPILL_BYTES_SM90 if build == "fp16" else wy.WY_SPLIT_SPILL_BYTES_SM90
    assert b["spills"] <= b["allowed"] == allowed, b
    assert b["registers"] <= wy.WY_SPLIT_MAXNREG_SM90
    K, V = 128, (128 if "V128" in spec else 64)
    assert {shape for shape, _ in b["wgmma"]} == {"m64n64k16"}
    assert len(b["wgmma"]) == _k_k_t_steps(K, build) + 4 * (K // 64 + V // 64)
    assert b["products"] == b["inverse"] == ({"f16": 32, "tf32": 0} if build == "fp16" else {"f16": 0, "tf32": 60})
    budget = 64 * (K + V) * 2 + 64 * 64 * 4
    assert budget <= b["shared"] <= budget + 1024


@pytest.mark.slow
@pytest.mark.parametrize("build", list(INVERSE_BUILDS))
@pytest.mark.parametrize("tails", [False, True], ids=["dense", "varlen"])
def test_early_rows_compile_without_spills(tails, build):
    """With :data:`wy.WY_EARLY_ROWS` the T kernel and the w/u kernel load the gate and beta
    rows before waiting for k: the same mma.sync and wgmma counts, registers under each
    kernel's cap; on tf32 products no spill bytes in the w/u kernel and no more than the T
    kernel's allowance (its cap of five programs per SM keeps up to 16 bytes in local
    memory); on fp16 products (whose redo of a chunk past fp16's range sits beside them)
    each kernel within its fp16 allowance."""
    from gdn_dispatch.backends.gluon_common import wy_t

    spec = f"K128-{'varlen' if tails else 'dense'}-bf16-gfp32-betafp32"
    early = ["gluon_common.wy.WY_EARLY_ROWS=1"]
    t_kernel = _in_inverse_build(build, f"m.kernel_build('wy_t', {spec!r})", early)
    wy_kernel = _in_inverse_build(build, f"m.kernel_build('wy', {spec.replace('K128', 'K128-V128')!r})", early)
    k_k_t = _k_k_t_steps(128, build)
    for b, wgmma in ((t_kernel, k_k_t), (wy_kernel, k_k_t + 4 * 4)):
        assert b["constexprs"]["EARLY_ROWS"] is True
        assert b["registers"] <= b["maxnreg"]
        assert b["products"] == b["inverse"]
        assert len(b["wgmma"]) == wgmma
    if build == "tf32":
        assert t_kernel["spills"] <= wy_t.WY_T_SPILL_BYTES_SM90 and wy_kernel["spills"] == 0
    else:
        assert t_kernel["spills"] <= wy_t.WY_T_F16_SPILL_BYTES_SM90
        assert wy_kernel["spills"] <= wy.WY_SPLIT_F16_SPILL_BYTES_SM90


def t_kernel_build() -> dict:
    """The varlen bf16 T kernel's compile report in numbers (in a process of its own with
    the build's flags set: :func:`_t_kernel_builds`)."""
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.backends.gluon_common import wy_t

    kernel = next(k for k in wy_t.wy_t_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)
                  if k.specialization == "K128-varlen-bf16-gfp32-betafp32")
    report = compile_kernel(kernel, SM90)
    products = blocked_inverse.ptx_products(report.ptx)
    return {"f16_mma": products["f16"], "tf32_mma": products["tf32"], "shfl": report.ptx.count("shfl.sync"),
            "wgmma": len(re.findall(r"wgmma\.mma_async", report.ptx)), "registers": report.registers,
            "maxnreg": kernel.maxnreg, "spills": report.spill_bytes, "ldmatrix": report.ptx.count("ldmatrix"),
            "ld_shared": len(re.findall(r"\bld\.shared", report.ptx))}


#: The blocked inverse's flags a T kernel build of :func:`_t_kernel_builds` sets, in order.
_INVERSE_FLAGS = ("F16_OPERANDS", "HALF_TABLES", "DIAGONAL_SERIES")


def _t_kernel_builds(*builds) -> list[dict]:
    """:func:`t_kernel_build` of each build in ``builds``, the values of
    :data:`_INVERSE_FLAGS` in order (those left out off), each in a process of its own (the
    flags are jit globals, fixed at their first compile)."""
    from pathlib import Path

    from gdn_dispatch.testing import call_in_fresh_process

    return [call_in_fresh_process(Path(__file__), "m.t_kernel_build()",
                                  [f"gluon_common.blocked_inverse.{name}={int(value)}"
                                   for name, value in zip(_INVERSE_FLAGS, build + (False,) * 3)])
            for build in builds]


@pytest.mark.slow
def test_f16_inverse_compiles_to_half_the_products():
    """With :data:`.blocked_inverse.F16_OPERANDS` the T kernel's inverse is 30 fp16
    mma.sync (m16n8k16: one k-step per product) and no tf32 one, with fewer shuffles than
    the tf32 build (no lhs conversions between products); its redo of a chunk past fp16's
    range (:func:`.blocked_inverse.lost_half_range`) forms A again (k k^T's 8 wgmma a second
    time) and inverts it by rows on the CUDA cores. Registers under the cap, spills within
    the allowance of each build."""
    from gdn_dispatch.backends.gluon_common import wy_t

    tf32, f16 = _t_kernel_builds((False, False), (True, False))
    assert (f16["f16_mma"], f16["tf32_mma"], tf32["f16_mma"], tf32["tf32_mma"]) == (30, 0, 0, 60)
    assert f16["shfl"] < tf32["shfl"], (f16, tf32)
    assert (tf32["wgmma"], f16["wgmma"]) == (8, 16), (tf32, f16)
    assert tf32["registers"] <= tf32["maxnreg"] and tf32["spills"] <= wy_t.WY_T_SPILL_BYTES_SM90, tf32
    assert f16["registers"] <= f16["maxnreg"] and f16["spills"] <= wy_t.WY_T_F16_SPILL_BYTES_SM90, f16


@pytest.mark.slow
def test_half_tables_read_each_warps_slot_by_ldmatrix():
    """With :data:`.blocked_inverse.HALF_TABLES` the T kernel's fp16 inverse reads its
    tables by ldmatrix, one per slot a shifted read takes (three of each table) and one per
    block read back (three), where the fp32 tables' reads took 84 scalar shared loads; the
    same products and wgmma, registers under the cap, spills within the allowance."""
    from gdn_dispatch.backends.gluon_common import wy_t

    fp32, half = _t_kernel_builds((True, False), (True, True))
    assert (half["f16_mma"], half["tf32_mma"], half["wgmma"]) == (30, 0, 16), half
    assert half["ldmatrix"] == fp32["ldmatrix"] + 12, (half, fp32)
    assert half["ld_shared"] <= fp32["ld_shared"] - 80, (half, fp32)
    assert half["registers"] <= half["maxnreg"] and half["spills"] <= wy_t.WY_T_F16_SPILL_BYTES_SM90, half


@pytest.mark.slow
def test_shorter_inverse_chains_compile():
    """With :data:`.blocked_inverse.DIAGONAL_SERIES` the T kernel's fp16 inverse is 32
    mma.sync (one 16 x 16 product more: L x, L^2, L^2 x and L^2 (L x) where doubling took
    two levels of two); with fp32 and with fp16 tables, the same 16 wgmma, registers under
    the cap, spills within the allowance."""
    from gdn_dispatch.backends.gluon_common import wy_t

    for build in _t_kernel_builds((True, False, True), (True, True, True)):
        assert (build["f16_mma"], build["tf32_mma"], build["wgmma"]) == (32, 0, 16), build
        assert build["registers"] <= build["maxnreg"] and build["spills"] <= wy_t.WY_T_F16_SPILL_BYTES_SM90, build


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != SM90,
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("split, early", [(False, False), (True, False), (True, True)],
                         ids=["whole", "blocks", "blocks-early-rows"])
def test_w_and_u_against_the_reference_both_ways(split, early, monkeypatch):
    """The pipeline's public call (few programs: no warp-specialized path) with w and u
    formed whole or in blocks, and with the gate and beta rows loaded early
    (:data:`wy.WY_EARLY_ROWS`), ragged lengths with tails, K = 128 and V = 64 / 128,
    against the float32 reference in NaN-poisoned memory."""
    from gdn_dispatch import chunk_gated_delta_rule
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
    from gdn_dispatch.testing import poison_cuda_allocator, random_call, rel_rms_error

    monkeypatch.setattr(wy, "WY_SPLIT_WU", split)
    monkeypatch.setattr(wy, "WY_EARLY_ROWS", early)
    clear_plan_cache()
    try:
        for V, seed in ((128, 0), (64, 1)):
            call = random_call(lengths=[1, 63, 200, 64, 130], H=2, HV=4, K=128, V=V, dtype=torch.bfloat16,
                               device="cuda", seed=seed)
            call["output_final_state"] = True
            ref = chunk_gated_delta_rule(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in call.items()},
                                         backend="reference")
            poison_cuda_allocator()
            o, ht = chunk_gated_delta_rule(**call, backend="gluon_sm90")
            assert rel_rms_error(o.float().cpu(), ref[0].float()) < 5e-3
            assert rel_rms_error(ht.float().cpu(), ref[1].float()) < 5e-3
    finally:
        clear_plan_cache()


@pytest.mark.slow
def test_compiled_shared_memory_matches_the_plan():
    """What ptxas reports for the largest sm_90a specialization is the plan's budget (plus
    barriers and scratch under 1 KB), with the registers capped and no more spilled than
    the kernel allows."""
    kernel = next(k for k in wy.wy_kernels_for_aot(SM90) if k.specialization == "K128-V128-varlen-l2-bf16-gfp32-betafp32")
    report = compile_kernel(kernel, SM90)
    budget = wy.plan_wy(_problem(lengths=[65], K=128, V=128, l2=True), SM90).blocks["smem_bytes"]
    assert budget <= report.shared_bytes <= budget + 1024
    assert report.registers <= kernel.maxnreg and report.spill_bytes <= kernel.spill_bytes_allowed


@pytest.mark.parametrize("capability", [SM100, SM90], ids=["sm100", "sm90"])
def test_plan_wy_variants(capability):
    """Both inverse variants plan the same launch but for the kernel's LHS_REGS and, on
    sm_100a, the left-operand staging buffer of "regs" (tcgen05 reads shared memory only)."""
    p = _problem(lengths=[65, 3], K=128, V=64)
    smem, regs = wy.plan_wy(p, capability, "smem"), wy.plan_wy(p, capability, "regs")
    assert smem.constexprs["LHS_REGS"] is False and regs.constexprs["LHS_REGS"] is True
    assert wy.plan_wy(p, capability) == wy.plan_wy(p, capability, wy.WY_DEFAULT_VARIANT)
    assert (regs.grid, regs.maxnreg, regs.descriptors) == (smem.grid, smem.maxnreg, smem.descriptors)
    staged = 64 * 64 * 4 if capability == SM100 else 0
    assert regs.blocks["smem_bytes"] == smem.blocks["smem_bytes"] + staged
    assert regs.blocks["tmem_columns"] == smem.blocks["tmem_columns"]


def test_plan_wy_rejects_an_unknown_variant():
    with pytest.raises(ValueError, match=r"variant must be one of \('smem', 'regs', 'f16', 'blocked'\), got 'tmem'"):
        wy.plan_wy(_problem(), SM90, "tmem")


@pytest.mark.slow
@pytest.mark.parametrize("capability", [SM100, SM90], ids=["sm100", "sm90"])
def test_regs_variant_compiles_to_register_operands(capability):
    """The "regs" inverse at its largest specialization: no spills, shared memory as
    planned, and on sm_90a all 80 tf32 wgmmas (10 products x 8 k-steps) take their left
    operand from registers with no layout shuffles on the way (the scan's one shfl.idx
    aside), in fewer registers than the cap: short of registers, ptxas serializes wgmmas
    with register operands (warning C7512) instead of spilling."""
    spec = "K128-V128-varlen-l2-bf16-gfp32-betafp32"
    kernel = next(k for k in wy.wy_kernels_for_aot(capability, variant="regs") if k.specialization == spec)
    assert kernel.constexprs["LHS_REGS"] is True
    report = compile_kernel(kernel, capability)
    budget = wy.plan_wy(_problem(lengths=[65], K=128, V=128, l2=True), capability, "regs").blocks["smem_bytes"]
    assert report.spill_bytes == 0 and budget <= report.shared_bytes <= budget + 1024
    if capability == SM90:
        assert report.registers < wy.WY_MAXNREG_SM90
        reg_a = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k8\.f32\.tf32\.tf32 \{[^}]*\}, \{", report.ptx)
        assert len(reg_a) == 80
        assert report.ptx.count("shfl.sync.idx") <= 1



@pytest.mark.slow
@pytest.mark.parametrize("build", list(INVERSE_BUILDS))
@pytest.mark.parametrize("spec", ["K128-V128-varlen-l2-bf16-gfp32-betafp32", "K64-V64-dense-fp16-gfp32-betafp32"])
def test_blocked_variant_inverts_on_mma_sync(spec, build):
    """The w/u kernel's default sm_90a inverse: 16 x 16 x 16 products per warp on mma.sync
    (:func:`.blocked_inverse.inverse_products`: 32 fp16 m16n8k16 as shipped, 60 tf32
    m16n8k8 on tf32 products), the 64 x 64 wgmmas left to k k^T (twice on fp16 products,
    whose redo forms A again), w and u (here as whole tiles, :data:`wy.WY_SPLIT_WU` off:
    the test above takes them in blocks), no spills at the 168-register cap, and one fp32
    tile of shared memory beside k and v (the tables, then the T tiles)."""
    assert wy.WY_DEFAULT_VARIANT == "blocked"
    b = _in_inverse_build(build, f"m.kernel_build('wy', {spec!r})", ["gluon_common.wy.WY_SPLIT_WU=0"])
    assert (b["constexprs"]["BLOCKED_INVERSE"], b["constexprs"]["LHS_REGS"]) == (True, False)
    K, V = (128, 128) if spec.startswith("K128") else (64, 64)
    budget = 64 * (K + V) * 2 + 64 * 64 * 4
    assert b["spills"] == 0 and b["registers"] <= wy.WY_MAXNREG_SM90
    assert budget <= b["shared"] <= budget + 1024
    assert b["products"] == b["inverse"] == ({"f16": 32, "tf32": 0} if build == "fp16" else {"f16": 0, "tf32": 60})
    # k k^T (n = 64, K / 16 steps), w = T k (n = K) and u = T v (n = V), 64 / 16 steps each.
    n = sorted(int(shape[len("m64n"):].split("k")[0]) for shape, _ in b["wgmma"] if shape.endswith("k16"))
    assert n == sorted([64] * _k_k_t_steps(K, build) + [K] * 4 + [V] * 4)
    # On sm_100a the variant is "regs" (A lives in tensor memory there).
    sm100 = next(k for k in wy.wy_kernels_for_aot(SM100) if k.specialization == spec)
    assert (sm100.constexprs["BLOCKED_INVERSE"], sm100.constexprs["LHS_REGS"]) == (False, True)

@pytest.mark.slow
@pytest.mark.parametrize("tails", [False, True], ids=["dense", "varlen"])
def test_t_kernel_inverts_on_fp16_operands_with_a_tf32_redo(tails, monkeypatch):
    """The T kernel's sm_90a inverse: its ten products as 40 fp16 wgmmas (k16 steps) with the
    left operand in registers, the tf32 redo's 80 beside them, and no more spill bytes at
    the cap than the kernel's measured allowance (four programs per SM paid for them)."""
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.backends.gluon_common import wy_t

    spec = f"K128-{'varlen' if tails else 'dense'}-bf16-gfp32-betafp32"
    monkeypatch.setattr(wy_t, "WY_T_BLOCKED_INVERSE", False)
    kernel = next(k for k in wy_t.wy_t_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)
                  if k.specialization == spec)
    assert kernel.constexprs["F16_INVERSE"] is True
    report = compile_kernel(kernel, SM90)
    assert kernel.spill_bytes_allowed == wy_t.WY_T_PAIR_SPILL_BYTES_SM90
    assert report.spill_bytes <= kernel.spill_bytes_allowed and report.registers <= wy_t.WY_T_PAIR_MAXNREG_SM90
    f16_reg_a = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.f16\.f16 \{[^}]*\}, \{", report.ptx)
    tf32 = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k8\.f32\.tf32\.tf32", report.ptx)
    assert (len(f16_reg_a), len(tf32)) == (40, 80)



@pytest.mark.slow
@pytest.mark.parametrize("build", list(INVERSE_BUILDS))
@pytest.mark.parametrize("tails", [False, True], ids=["dense", "varlen"])
def test_t_kernel_inverts_in_blocks_on_mma_sync(tails, build):
    """The T kernel's default sm_90a inverse: 16 x 16 x 16 products per warp on mma.sync
    (:func:`.blocked_inverse.inverse_products`: 32 fp16 m16n8k16 as shipped, 60 tf32
    m16n8k8 on tf32 products), no fp16 wgmma operands, the 64 x 64 wgmmas left to k k^T
    alone (twice on fp16 products, whose redo forms A again; no redo on tf32), and at its
    register cap (five programs per SM) no more spill bytes than the build's allowance."""
    from gdn_dispatch.backends.gluon_common import wy_t

    assert wy_t.WY_T_BLOCKED_INVERSE is True
    spec = f"K128-{'varlen' if tails else 'dense'}-bf16-gfp32-betafp32"
    b = _in_inverse_build(build, f"m.kernel_build('wy_t', {spec!r})")
    assert (b["constexprs"]["BLOCKED_INVERSE"], b["constexprs"]["F16_INVERSE"]) == (True, False)
    allowed = wy_t.WY_T_F16_SPILL_BYTES_SM90 if build == "fp16" else wy_t.WY_T_SPILL_BYTES_SM90
    assert (b["maxnreg"], b["allowed"]) == (wy_t.WY_T_MAXNREG_SM90, allowed)
    assert b["spills"] <= b["allowed"] and b["registers"] <= wy_t.WY_T_MAXNREG_SM90
    assert b["products"] == b["inverse"] == ({"f16": 32, "tf32": 0} if build == "fp16" else {"f16": 0, "tf32": 60})
    assert all(dtype != "f16" for _, dtype in b["wgmma"])
    assert {shape for shape, _ in b["wgmma"]} == {"m64n64k16"} and len(b["wgmma"]) == _k_k_t_steps(128, build)


def test_forward_plans_wy_first():
    fp = plan(_problem(lengths=[5, 70]), SM90)
    assert fp.stages[0].kernel == "wy_fwd" and fp.stages[0] == wy.plan_wy(_problem(lengths=[5, 70]), SM90)


def test_empty_call_launches_nothing():
    p = _problem(lengths=[0, 0], K=64, V=64)
    w, u, g_cum = wy.wy_fwd(p.k, p.v, p.g, p.beta, p.chunks, device_info=assumed_device("sm_90"))
    assert w.shape == (1, 0, p.HV, p.K) and u.shape == (1, 0, p.HV, p.V)
    assert g_cum.shape == (1, 0, p.HV) and g_cum.dtype == torch.float32


def test_aot_list_covers_every_flag():
    kernels = wy.wy_kernels_for_aot(SM90)
    # (g, beta) dtypes x K x V x tails x (bf16 with and without l2, fp16 without: its
    # calls with the norm run on normalized copies) with int32 offsets; bf16, fp32 gates,
    # int64 offsets x K x V x tails x l2.
    assert len(kernels) == 3 * 2 * 2 * 2 * 3 + 2 * 2 * 2 * 2
    assert not [k for k in kernels if k.constexprs["USE_L2NORM"] and "fp16" in k.specialization]
    assert {k.signature["cu_seqlens"] for k in kernels} == {"*i32", "*i64"}
    assert len({k.specialization for k in kernels}) == len(kernels)
    cap = wy.WY_SPLIT_MAXNREG_SM90 if wy.WY_SPLIT_WU else wy.WY_MAXNREG_SM90
    assert all(k.maxnreg == cap for k in kernels)
