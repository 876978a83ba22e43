"""The Gluon w/u and output stages without a GPU: launch plans on CPU tensors, and every
specialization compiled ahead of time for sm_100a (tcgen05/TMEM) and sm_90a (wgmma).

What a compile must show: sm_100a PTX holds tcgen05.mma, tcgen05.ld, TMA copies
(cp.async.bulk.tensor), mbarrier waits, and TMA scatter (tile::scatter4) exactly where
sequences may end inside a chunk; sm_90a PTX holds wgmma.mma_async and TMA copies and no
tcgen05; ptxas reports no spills; shared memory fits 232448 bytes; TMEM <= 512 columns.
Numerics run on a GPU only (benchmarks/h200_gluon_stages.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch.aot import SMEM_LIMIT, compile_kernel  # noqa: E402
from gdn_dispatch.contract import make_problem  # noqa: E402
from gdn_dispatch.device import DeviceInfo, assumed_device  # noqa: E402

from gdn_dispatch.backends.gluon_common.output import (  # noqa: E402
    _output_fwd_kernel, output_block_v, output_fwd, output_kernels_for_aot, plan_output)
from gdn_dispatch.backends.gluon_common.plan import has_tails  # noqa: E402
from gdn_dispatch.backends.gluon_common.wu import (  # noqa: E402
    _wu_fwd_kernel, chunks_have_tails, plan_wu, wu_fwd, wu_kernels_for_aot)

SM100, SM90 = (10, 0), (9, 0)
TMEM_COLUMNS = 512


def _problem(lengths=None, B=1, T=128, H=2, HV=4, K=128, V=64, dtype=torch.bfloat16, l2=False):
    """A CPU problem: ``lengths`` packs varlen sequences (B = 1), else B rows of T tokens."""
    cu = None
    if lengths is not None:
        B, T = 1, sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    v = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    g = torch.randn(B, T, HV, generator=gen)
    return make_problem(q, q.clone(), v, g, g.sigmoid(), cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)


# ---------------------------------------------------------------------------------------
# Plans


@pytest.mark.parametrize("capability", [SM100, SM90], ids=["sm100", "sm90"])
def test_plan_wu_uniform_batch(capability):
    p = _problem(B=2, T=128, H=2, HV=4, K=128, V=64)
    launch = plan_wu(p, assumed_device(f"sm_{capability[0]}{capability[1]}"))
    assert launch.kernel == "wu_fwd"
    assert launch.grid == (2 * 2 * 4,)  # chunks x v-heads
    assert launch.constexprs == {"HAS_TAILS": False, "USE_L2NORM": False, "IS_SM100": capability == SM100,
                                 "w_rows_desc": None, "u_rows_desc": None}
    assert launch.scalars == {"HV": 4, "GROUP": 2}
    a = launch.desc("a_desc")
    assert (a.tensor, a.shape, a.strides, a.block_shape) == ("A_inv", (256, 4 * 64), (256, 1), (64, 64))
    k = launch.desc("k_desc")
    assert (k.shape, k.block_shape) == ((256, 2 * 128), (64, 128))
    assert launch.desc("u_desc").block_shape == (64, 64)
    assert launch.desc("k_desc").signature.startswith("tensordesc<bf16[64, 128],NVMMASharedLayout(")


def test_plan_wu_varlen_tails_and_capability_tuple():
    p = _problem(lengths=[1, 63, 64, 65, 130, 0], HV=2, H=1, K=64, V=128, dtype=torch.float16, l2=True)
    launch = plan_wu(p, SM90)  # a bare capability: the representative part
    assert launch.grid == ((1 + 1 + 1 + 2 + 3) * 2,)
    assert launch.constexprs == {"HAS_TAILS": True, "USE_L2NORM": True, "IS_SM100": False,
                                 "w_rows_desc": None, "u_rows_desc": None}
    assert launch.desc("v_desc").signature.startswith("tensordesc<fp16[64, 128],")


@pytest.mark.parametrize("kw", [dict(B=2, T=128), dict(B=1, T=100), dict(lengths=[64, 0, 128]),
                                dict(lengths=[1, 63, 64, 65, 130, 0])], ids=["T128", "T100", "varlen64", "varlen"])
def test_tails_from_chunk_table_match_plan(kw):
    # wu_fwd / output_fwd without a launch plan decide HAS_TAILS from the ChunkTable.
    p = _problem(**kw)
    assert chunks_have_tails(p.chunks, p.T) == has_tails(p)


def test_plan_varlen_without_tails():
    # Every length a multiple of 64: chunk c starts at row 64 c, no row masks needed.
    p = _problem(lengths=[64, 0, 128])
    assert plan_wu(p, SM100).constexprs["HAS_TAILS"] is False
    assert plan_output(p, SM100).constexprs["HAS_TAILS"] is False


@pytest.mark.parametrize("capability", [SM100, SM90], ids=["sm100", "sm90"])
def test_plan_output(capability):
    p = _problem(B=2, T=200, H=1, HV=2, K=64, V=128)
    launch = plan_output(p, capability, block_v=64)
    NT = 2 * 4
    assert launch.grid == (NT * 2 * 2,)
    assert launch.blocks["BV"] == 64 and launch.scalars == {"HV": 2, "GROUP": 2, "NV": 2}
    rows_desc = {} if capability == SM100 else {"o_rows_desc": None}  # T = 200: tails
    assert launch.constexprs == {"HAS_TAILS": True, "USE_L2NORM": False, "IS_SM100": capability == SM100,
                                 **rows_desc}
    h = launch.desc("h_desc")
    assert (h.tensor, h.shape, h.strides, h.block_shape) == ("h", (NT * 2 * 64, 128), (128, 1), (64, 64))
    o = launch.desc("o_desc")
    assert (o.shape, o.block_shape) == ((400, 2 * 128), (64, 64))
    if capability == SM100:
        assert launch.desc("o_rows_desc").layout == o.layout
    assert launch.blocks["smem_bytes"] <= SMEM_LIMIT[capability]


def test_output_block_v_from_sm_count():
    busy = DeviceInfo(kind="cuda", index=0, capability=SM90, sm_count=132)
    small = _problem(B=1, T=128, HV=4, V=128)  # 2 chunks x 4 heads: 8 programs
    assert plan_output(small, busy).blocks["BV"] == 64
    assert output_block_v(128, 1000, 32, 132) == 128
    assert output_block_v(64, 1000, 32, 132) == 64


def test_plan_rejects():
    p = _problem(V=128)
    with pytest.raises(ValueError, match="sm_90 or sm_100"):
        plan_wu(p, (8, 0))
    with pytest.raises(ValueError, match="block_v: expected 64 or 128 dividing V = 128, got 32"):
        plan_output(p, SM90, block_v=32)


def test_empty_call_launches_nothing():
    # Every sequence empty: no chunk, so the wrappers return without touching a GPU.
    p = _problem(lengths=[0, 0], K=64, V=64)
    T_ = torch.empty(1, 0, p.HV, 64, dtype=p.dtype)
    w, u = wu_fwd(p.k, p.v, p.g, p.beta, T_, p.chunks, plan_wu(p, SM90))
    assert w.shape == (1, 0, p.HV, 64) and u.shape == p.v.shape
    h = torch.empty(0, p.HV, 64, 64, dtype=p.dtype)
    o = output_fwd(p.q, p.k, p.v, h, p.g, p.chunks, plan_output(p, SM90), scale=0.125)
    assert o.shape == p.v.shape


# ---------------------------------------------------------------------------------------
# Ahead-of-time compiles of every specialization


def _aot(capability):
    return wu_kernels_for_aot(capability) + output_kernels_for_aot(capability)


@pytest.mark.parametrize("capability", [SM100, SM90], ids=["sm100", "sm90"])
def test_aot_lists(capability):
    kernels = _aot(capability)
    assert len(kernels) == 64 + 32  # w/u: also beta in fp32 or q's dtype
    assert len({(k.kernel, k.specialization) for k in kernels}) == len(kernels)
    for k in kernels:
        assert list(k.signature) == list(k.fn.arg_names)
        assert k.backend == ("gluon_sm100" if capability == SM100 else "gluon_sm90")
    assert {k.fn for k in kernels} == {_wu_fwd_kernel, _output_fwd_kernel}




def _ids(capability):
    return [f"{k.kernel}-{k.specialization}" for k in _aot(capability)]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", _aot(SM100), ids=_ids(SM100))
def test_compiles_sm100a(kernel):
    report = compile_kernel(kernel, SM100)
    ptx = report.ptx
    for needle in ("tcgen05.mma", "tcgen05.ld", "cp.async.bulk.tensor", "mbarrier.try_wait"):
        assert needle in ptx, needle
    assert ("tile::scatter4" in ptx) == kernel.constexprs["HAS_TAILS"]
    assert "wgmma" not in ptx
    assert report.spill_bytes == 0
    assert report.shared_bytes <= SMEM_LIMIT[SM100]
    assert 0 < report.tmem_columns <= TMEM_COLUMNS


@pytest.mark.slow
@pytest.mark.parametrize("kernel", _aot(SM90), ids=_ids(SM90))
def test_compiles_sm90a(kernel):
    report = compile_kernel(kernel, SM90)
    ptx = report.ptx
    for needle in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait"):
        assert needle in ptx, needle
    assert "tcgen05" not in ptx and "scatter4" not in ptx
    # Tails: masked, vectorized register stores of the staged tile (Hopper has no TMA scatter).
    assert ("st.global.v4" in ptx) == kernel.constexprs["HAS_TAILS"]
    assert report.spill_bytes == 0
    assert report.shared_bytes <= SMEM_LIMIT[SM90]
