"""Dry runs of the Gluon launch plans on CPU tensors: grids, block sizes, descriptors.

``plan(problem, capability)`` touches no GPU, so every case below runs anywhere; what it
checks is what the kernels rely on: descriptor global shapes and strides (2-D views of the
packed token axis), block shapes, grids over (sequence, v-head, V-block), the layout and
tail flags.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch.device import assumed_device  # noqa: E402
from gdn_dispatch.testing import random_problem  # noqa: E402

from gdn_dispatch.backends.gluon_common.launch_plan import (  # noqa: E402
    PLAN_CACHE_SIZE,
    DescPlan,
    LruCache,
    has_tails,
    index_limits_reason,
)
from gdn_dispatch.backends.gluon_common.plan import PLAN_COUNTS, clear_plan_cache, compute_plan, plan  # noqa: E402

SM90, SM100 = (9, 0), (10, 0)


def _problem(K=128, V=128, ht=True, **kwargs):
    return random_problem(K=K, V=V, ht=ht, **kwargs)


SCATTER_ROWS = {"wy_fwd": ("w_rows_desc", "u_rows_desc"), "state_output_fwd": ("o_rows_desc",)}


@pytest.mark.parametrize("capability", [SM90, SM100], ids=["sm90", "sm100"])
@pytest.mark.parametrize("shape", [dict(lengths=[1, 63, 64, 65, 130, 0]), dict(batch=(2, 128))], ids=["tails", "whole"])
def test_scatter_row_descriptors_only_where_the_kernel_scatters(shape, capability):
    from gdn_dispatch.backends.gluon_common.state_output import plan_state_output
    from gdn_dispatch.backends.gluon_common.wy import plan_wy

    p = _problem(**shape, H=2, HV=4)
    device = assumed_device(f"sm_{capability[0]}{capability[1]}")
    scatters = capability == SM100 and has_tails(p)
    for planner in (plan_wy, plan_state_output):
        launch = planner(p, device)
        rows = SCATTER_ROWS[launch.kernel]
        built = {d.arg for d in launch.descriptors}
        assert all((arg in built) == scatters for arg in rows), launch.kernel
        assert all((arg in launch.constexprs) != scatters for arg in rows), launch.kernel
        assert all(launch.constexprs[arg] is None for arg in rows if not scatters)
        for d in launch.descriptors:
            assert d.scatter == (d.arg in rows)
            if d.scatter:
                # A [1, BN] box carrying the staged [64, BN] tile's layout, over the tile descriptor's tensor.
                tile = launch.desc(d.arg.replace("_rows", ""))
                assert d.block_shape == (1, tile.block_shape[1]) and d.layout == tile.layout
                assert (d.tensor, d.shape, d.strides) == (tile.tensor, tile.shape, tile.strides)


def test_forward_plan_has_every_gluon_stage_in_launch_order():
    fp = plan(_problem(lengths=[1, 63, 64, 65, 130, 0]), SM90)
    assert [s.kernel for s in fp.stages] == ["wy_fwd", "state_output_fwd"]
    assert all(s.constexprs["ENGINE"].is_sm100 is False for s in fp.stages if s.kernel != "qk_rnorm_fwd")
    assert len({s.constexprs["HAS_TAILS"] for s in fp.stages}) == 1


def test_tails_flag():
    assert has_tails(_problem(lengths=[1, 63]))
    assert not has_tails(_problem(lengths=[64, 128]))
    assert has_tails(_problem(batch=(2, 100)))
    assert not has_tails(_problem(batch=(2, 128)))


@pytest.mark.parametrize("h0, ht, l2", [(True, True, True), (False, False, False)])
def test_state_plan_flags(h0, ht, l2):
    st = plan(_problem(lengths=[5, 70], h0=h0, ht=ht, l2=l2), SM90).stage("state_output_fwd")
    assert (st.constexprs["USE_H0"], st.constexprs["STORE_HT"], st.constexprs["USE_L2NORM"]) == (h0, ht, l2)


def test_plan_follows_the_device_sm_count():
    p = _problem(batch=(8, 64), H=16, HV=64)  # N * HV = 512 (sequence, v-head) pairs
    # The two-launch pipeline's V-block (the warp-specialized path would take these calls).
    few = plan(p, SM90, device=assumed_device("sm_90").__class__(kind="cuda", capability=SM90, sm_count=8), fused=False)
    assert few.stage("state_output_fwd").blocks["BV"] == 128  # the fewest waves (K = 128)
    many = plan(p, SM90, device=assumed_device("sm_90").__class__(kind="cuda", capability=SM90, sm_count=4096),
                fused=False)
    # Every narrow program fits at once: the narrowest block.
    assert many.stage("state_output_fwd").blocks["BV"] == 32 and many.stage("state_output_fwd").num_warps == 4


def test_zero_length_sequences_plan():
    p = _problem(lengths=[0, 0, 3])
    st = plan(p, SM90).stage("state_output_fwd")
    assert st.grid == (3 * 4 * (128 // st.blocks["BV"]),)
    # w/u: the call's chunk slots (T // 64 + N, most of them idle here) x HV.
    assert plan(p, SM90).stage("wy_fwd").grid == ((3 // 64 + 3) * 4,)


def test_index_limits():
    assert index_limits_reason(_problem(lengths=[3, 70])) is None


def test_backend_packages_plan_and_reason():
    from gdn_dispatch.backends import gluon_sm90, gluon_sm100

    p = _problem(lengths=[3, 70])
    assert gluon_sm90.plan(p).capability == SM90 and not gluon_sm90.plan(p).is_sm100
    assert gluon_sm100.plan(p).is_sm100
    # The engine is the one the backend passes, not re-derived from the capability.
    assert not gluon_sm90.plan(p, SM100).is_sm100 and gluon_sm100.plan(p, SM90).is_sm100
    assert plan(p, SM100, engine=gluon_sm90.ENGINE).stage("wy_fwd").constexprs["ENGINE"] is gluon_sm90.ENGINE
    assert "needs CUDA tensors" in gluon_sm90.unsupported_reason(p)
    assert "needs CUDA tensors" in gluon_sm100.unsupported_reason(p)
    with pytest.raises(ValueError, match="gluon_sm90 compiles for"):
        gluon_sm90.kernels_for_aot((10, 0))


@pytest.mark.parametrize("capability", [SM90, SM100], ids=["sm90", "sm100"])
def test_every_planned_descriptor_builds_on_its_tensor(capability):
    """Host TMA descriptors accept the planned shapes/strides/blocks (alignment, block rules)."""
    p = _problem(lengths=[1, 63, 64, 65, 130, 0], H=2, HV=4)
    for stage in plan(p, capability).stages:
        for d in stage.descriptors:
            t = torch.empty(d.shape, dtype=d.dtype)
            desc = d.build(t)
            assert list(desc.block_shape) == list(d.block_shape) and desc.layout == d.layout


# ---------------------------------------------------------------------------------------
# Host cost: memoized plans and layouts


MEMO_CASES = [
    pytest.param(dict(lengths=[1, 63, 64, 65, 130, 0]), "kv", False, id="varlen-tails-kv"),
    pytest.param(dict(lengths=[64, 128, 0]), "vk", True, id="varlen-no-tails-vk-l2"),
    pytest.param(dict(lengths=[31]), "vk", False, id="varlen-31-vk"),
    pytest.param(dict(batch=(3, 100)), "kv", True, id="B3-T100-tails-kv-l2"),
    pytest.param(dict(batch=(2, 128)), "vk", False, id="B2-T128-vk"),
]


@pytest.mark.parametrize("capability", [SM90, SM100], ids=["sm90", "sm100"])
@pytest.mark.parametrize("shape, layout, l2", MEMO_CASES)
def test_memoized_plan_equals_a_fresh_plan(shape, layout, l2, capability):
    clear_plan_cache()
    p = _problem(**shape, layout=layout, l2=l2)
    fresh = compute_plan(p, assumed_device(f"sm_{capability[0]}{capability[1]}"))
    first = plan(p, capability)
    assert first == fresh
    # The second call, and a new call with the same key (new tensors), hit the cache: the
    # same shared launch plans (and the kernels kept on them), the same counts.
    assert plan(p, capability) is first
    assert plan(_problem(**shape, layout=layout, l2=l2), capability) is first
    # compute_plan, then the first plan(): each planned the class once.
    assert PLAN_COUNTS["computed"] == 2 and PLAN_COUNTS["hits"] == 2


def test_plan_cache_keys_every_planned_input():
    clear_plan_cache()
    base = dict(lengths=[5, 70], H=2, HV=4, layout="kv", h0=True, ht=True, l2=False)
    variants = {
        "no-tails": dict(lengths=[64, 128]),
        "HV": dict(HV=8),
        "H": dict(H=4),
        "layout": dict(layout="vk"),
        "h0": dict(h0=False),
        "ht": dict(ht=False),
        "l2": dict(l2=True),
        "dtype": dict(dtype=torch.float16),
        "K-V": dict(K=64, V=64),
    }
    reference = plan(_problem(**base), SM90)
    for name, change in variants.items():
        p = _problem(**{**base, **change})
        fp = plan(p, SM90)
        assert fp.cls is not reference.cls and fp != reference, name
        assert fp == compute_plan(p, assumed_device("sm_90")), name
    assert plan(_problem(**base), SM100) != reference
    # The SM count sizes blocks, so it is part of the key.
    p = _problem(batch=(8, 64), H=16, HV=64)
    info = assumed_device("sm_90")
    few = plan(p, device=info.__class__(kind="cuda", capability=SM90, sm_count=8), fused=False)
    many = plan(p, device=info.__class__(kind="cuda", capability=SM90, sm_count=4096), fused=False)
    assert few.stage("state_output_fwd").blocks["BV"] != many.stage("state_output_fwd").blocks["BV"]
    # ... and whether the warp-specialized path is taken (sm_90a: N * HV against the SMs).
    assert plan(p, device=info.__class__(kind="cuda", capability=SM90, sm_count=8)).fused
    assert not plan(p, device=info.__class__(kind="cuda", capability=SM90, sm_count=4096)).fused


@pytest.mark.parametrize("capability", [SM90, SM100], ids=["sm90", "sm100"])
def test_calls_of_any_length_share_the_plans_of_their_class(capability):
    """Token and sequence counts are not in the key: calls of one class with other lengths,
    other sequence counts, or uniform (with tails) share its plans, each seen with its own
    counts (grids, descriptor rows); only the fused kernel's configuration follows N (and,
    on sm_90a, whether the warp-specialized path runs: the 40-sequence call takes it)."""
    clear_plan_cache()
    device = assumed_device(f"sm_{capability[0]}{capability[1]}")
    shapes = [dict(lengths=[5, 70]), dict(lengths=[1, 63, 64, 65, 130, 0]), dict(lengths=[3000]),
              dict(batch=(3, 100)), dict(lengths=[17] * 40)]
    problems = [_problem(**shape, H=2, HV=4) for shape in shapes]
    plans = [plan(p, capability, fused=False) for p in problems]
    assert PLAN_COUNTS["computed"] == 1 and PLAN_COUNTS["hits"] == len(shapes) - 1
    assert all(fp.cls is plans[0].cls for fp in plans)
    assert plan(problems[-1], capability).fused == (capability == SM90)
    for shape, p, fp in zip(shapes, problems, plans):
        assert fp == compute_plan(p, device, fused=False), shape
        rows = p.B * p.T
        wy = fp.stage("wy_fwd")
        assert wy.grid == ((rows // 64 + p.N) * 4,) and wy.shared is fp.launches[0]
        so = fp.stage("state_output_fwd")
        assert so.grid == (p.N * 4 * so.blocks["NV"],)
        assert all(d.shape[0] == rows for s in fp.stages for d in s.descriptors)
        assert all(d.shape[0] is None for s in fp.launches for d in s.descriptors)
    # Every configuration the class can pick was planned with it; N picks one.
    assert {c[0] for c in plans[0].cls.state_outputs} == {32, 64, 128}
    assert plans[0].stage("state_output_fwd").blocks["BV"] == 32  # 8 (sequence, head) pairs
    assert plans[-1].stage("state_output_fwd").blocks["BV"] > 32  # 160 pairs


def test_plan_cache_shares_plans_across_equal_keys_only():
    """Different lengths with the same N and T plan identically (whatever their chunk
    counts: the w/u kernel runs over chunk slots); whole chunks only are another class."""
    clear_plan_cache()
    a, b, c = _problem(lengths=[1, 63, 64]), _problem(lengths=[63, 1, 64]), _problem(lengths=[126, 1, 1])
    assert plan(a, SM90) is plan(b, SM90) is plan(c, SM90)
    assert plan(a, SM90) == compute_plan(c, assumed_device("sm_90"))
    assert plan(_problem(lengths=[64, 64, 64]), SM90).cls is not plan(a, SM90).cls


@pytest.mark.parametrize("seed", range(4))
def test_tails_flag_agrees_with_the_host_lengths(seed):
    """has_tails reads NT, not cu_seqlens: check it against the lengths themselves."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(25):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        # Multiples of 64 (and zeros) half the time, so both answers occur.
        scale = 64 if bool(torch.rand(1, generator=gen) < 0.5) else 1
        lengths = (torch.randint(0, 4, (n,), generator=gen) * scale).tolist()
        if sum(lengths) == 0:
            lengths[0] = 64
        p = _problem(lengths=lengths, K=64, V=64)
        assert has_tails(p) == any(length % 64 for length in lengths), lengths


def test_lru_cache_drops_the_least_recently_used():
    cache = LruCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the oldest
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3
    assert len(cache) == 2
    assert cache.get("missing", "default") == "default"
    assert PLAN_CACHE_SIZE >= 16


def test_descriptor_layouts_are_computed_once_per_tile():
    from triton.experimental.gluon import language as gl

    a = DescPlan("w_desc", "w", (128, 512), (512, 1), (64, 128), torch.bfloat16)
    b = DescPlan("u_desc", "u", (256, 256), (256, 1), (64, 128), torch.bfloat16)
    assert a.layout is b.layout
    assert a.layout == gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    scatter = DescPlan("w_rows_desc", "w", (128, 512), (512, 1), (1, 128), torch.float16, (64, 128))
    assert scatter.layout == gl.NVMMASharedLayout.get_default_for([64, 128], gl.float16)


def test_built_descriptor_is_the_one_triton_builds():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d = DescPlan("w_desc", "w", (128, 512), (512, 1), (64, 128), torch.bfloat16)
    t = torch.empty(128, 4, 128, dtype=torch.bfloat16)
    expected = TensorDescriptor(t, [128, 512], [512, 1], [64, 128], d.layout)
    for _ in range(2):
        desc = d.build(t)
        assert type(desc) is TensorDescriptor and desc.base is t
        assert {k: v for k, v in vars(desc).items() if k != "base"} == \
            {k: v for k, v in vars(expected).items() if k != "base"}


def test_build_rejects_a_tensor_the_plan_does_not_describe():
    d = DescPlan("w_desc", "w", (128, 512), (512, 1), (64, 128), torch.bfloat16)
    d.build(torch.empty(128, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="w_desc: planned torch.bfloat16"):
        d.build(torch.empty(128, 512, dtype=torch.float16))
    with pytest.raises(ValueError, match="w_desc: planned"):
        d.build(torch.empty(128, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous=False"):
        d.build(torch.empty(512, 128, dtype=torch.bfloat16).t())
    with pytest.raises(AssertionError, match="16-byte aligned"):
        d.build(torch.empty(128 * 512 + 1, dtype=torch.bfloat16)[1:])  # triton's own check


# ---------------------------------------------------------------------------------------
# Inputs read in place: fused-projection views


def _fused(H, HV, K=128, V=128, **shape):
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.testing import fused_projection_views, random_call

    call = random_call(**shape, H=H, HV=HV, K=K, V=V, seed=4)
    return make_problem(**{**call, **fused_projection_views(call)}, output_final_state=True), call


def test_fused_views_are_read_in_place_at_their_row_stride():
    from gdn_dispatch.contract import INPUT_COPIES, make_problem
    from gdn_dispatch.backends.gluon_common.forward import tma_readable

    p, call = _fused(H=2, HV=4, lengths=[1, 63, 0, 130])
    stride = p.q.stride(1)
    assert stride == 2 * 2 * 128 + 4 * 128 + 2 * 4 and stride * 2 % 16 == 0
    before = sum(INPUT_COPIES.values())
    assert tma_readable(p) is p
    assert sum(INPUT_COPIES.values()) == before
    fp = plan(p, SM90)
    # The plan does not depend on the stride: the dense call shares it.
    assert fp is plan(make_problem(**call, output_final_state=True), SM90)
    for stage in fp.stages:
        for d in stage.descriptors:
            if d.tensor in ("q", "k", "v"):
                t = getattr(p, d.tensor)
                assert d.token_rows and d.strides_for(t) == [stride, 1]
                desc = d.build(t)
                assert list(desc.strides) == [stride, 1] and desc.base is t
            else:
                assert not d.token_rows


def test_views_tma_cannot_address_are_copied_once_counted():
    from gdn_dispatch.contract import INPUT_COPIES
    from gdn_dispatch.backends.gluon_common.forward import tma_readable
    from gdn_dispatch.backends.gluon_common.launch_plan import tma_rows_reason

    p, _ = _fused(H=1, HV=1, batch=(2, 70))  # rows of 2 * 128 + 128 + 2 = 386 bf16: 772 bytes
    assert "token stride of a multiple of 16 bytes, got 386 elements of 2 bytes" in tma_rows_reason("q", p.q)
    before = dict(INPUT_COPIES)
    moved = tma_readable(p)
    assert {n: INPUT_COPIES[n] - before.get(n, 0) for n in ("q", "k", "v", "g", "beta")} == \
        {"q": 1, "k": 1, "v": 1, "g": 0, "beta": 0}
    for name in ("q", "k", "v"):
        assert getattr(moved, name).is_contiguous() and torch.equal(getattr(moved, name), getattr(p, name))
    assert moved.g is p.g and moved.beta is p.beta
    k_desc = plan(moved, SM90).stage("wy_fwd").desc("k_desc")
    with pytest.raises(ValueError, match="k_desc: k: TMA needs a token stride of a multiple of 16 bytes"):
        k_desc.strides_for(p.k)


def test_misaligned_base_is_a_tma_reason():
    from gdn_dispatch.backends.gluon_common.launch_plan import tma_rows_reason

    buf = torch.randn(1 + 64 * 256, dtype=torch.float32).to(torch.bfloat16)
    q = buf[1:].view(1, 64, 2, 128)
    assert q.is_contiguous() and q.data_ptr() % 16
    assert "16-byte-aligned base" in tma_rows_reason("q", q)
    assert tma_rows_reason("q", buf[:-1].view(1, 64, 2, 128)) is None
    heads_major = torch.randn(1, 2, 64, 128).transpose(1, 2)
    assert "not in token rows" in tma_rows_reason("q", heads_major)


def test_wy_and_the_norms_take_the_token_strides_of_g_beta_q_k(monkeypatch):
    from gdn_dispatch.testing import LaunchRecorder
    from gdn_dispatch.backends.gluon_common import qk_norm, wy

    p, _ = _fused(H=2, HV=4, lengths=[1, 63, 0, 130])
    stride = p.q.stride(1)
    recorder = LaunchRecorder(wy._wy_fwd_kernel)
    monkeypatch.setattr(wy, "_wy_fwd_kernel", recorder)
    monkeypatch.setenv("GDN_DISPATCH_JIT_LAUNCH", "1")
    wy.wy_fwd(p.k, p.v, p.g, p.beta, p.chunks, wy.plan_wy(p, SM90))
    assert recorder.launched["g"] is p.g and recorder.launched["beta"] is p.beta
    assert recorder.launched["s_g"] == recorder.launched["s_beta"] == stride
    assert list(recorder.launched["k_desc"].strides) == [stride, 1]
    norms = LaunchRecorder(qk_norm._qk_rnorm_fwd_kernel)
    monkeypatch.setattr(qk_norm, "_qk_rnorm_fwd_kernel", norms)
    qk_norm.qk_rnorm_fwd(p.q, p.k, qk_norm.plan_qk_rnorm(p, SM90))
    assert (norms.launched["s_q"], norms.launched["s_k"], norms.launched["H"]) == (stride, stride, 2)
    assert norms.launched["q"] is p.q
    rows = LaunchRecorder(qk_norm._qk_l2norm_fwd_kernel)
    monkeypatch.setattr(qk_norm, "_qk_l2norm_fwd_kernel", rows)
    q_hat, k_hat = qk_norm.qk_l2norm_fwd(p.q, p.k, qk_norm.plan_qk_l2norm(p, SM90))
    assert (rows.launched["s_q"], rows.launched["s_k"], rows.launched["rows"]) == (stride, stride, 2 * p.B * p.T)
    assert rows.launched["out"].shape == (2, *p.q.shape) and q_hat.is_contiguous() and k_hat.is_contiguous()
