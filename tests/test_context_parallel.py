"""Context parallelism: the planner, the argument through the contract and the op, its
line in ``explain``, and the segmented math (the float32 reference's segment maps and scan)
against the unsegmented computation."""

from __future__ import annotations

import pytest
import torch

from gdn_dispatch import GDNInputError, chunk_gated_delta_rule, reference
from gdn_dispatch import context_parallel
from gdn_dispatch.context_parallel import (PICKING, CPTuning, auto_segment_chunks, context_parallel_reason,
                                           plan_context_parallel, plan_for_problem)
from gdn_dispatch import contract
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import assumed_device
from gdn_dispatch.op import context_parallel_arg, context_parallel_str
from gdn_dispatch.registry import CallSpec, call_reason, explain, load_registry
from gdn_dispatch.testing import padded_pool, poison_cuda_allocator, pooled_call, random_call, rel_rms_error

H200_SMS = 132


# --- the planner ----------------------------------------------------------------------------

def _auto(**over):
    args = dict(T_total=32768, N=1, HV=4, V=128, sm_count=H200_SMS, max_len=32768)
    args.update(over)
    return plan_context_parallel("auto", **args)


def test_auto_turns_on_for_a_long_prompt_on_few_heads():
    plan = _auto()
    # 6 * sqrt(4 * 512 / 132) = 23.6 -> 2^round(4.56) = 32 chunks of 64 tokens.
    assert plan.enabled and plan.seg_len == 2048
    assert plan.num_segments == 32768 // 2048 + 1
    assert "8 programs < 0.25 x 132 SMs" in plan.reason


def test_auto_stays_off_when_the_heads_fill_the_device():
    plan = _auto(N=8, HV=32, T_total=8 * 4096, max_len=4096)
    assert not plan.enabled and "512 programs >= 0.25 x 132 SMs" in plan.reason
    assert "forced count" not in plan.reason  # a program per SM and more: nothing to fill
    # A quarter of the SMs is enough for segments with maps: 2 sequences x 16 v-heads x 2 V
    # blocks = 64 programs (unsegmented was faster at every segment count on the H200 under
    # gates that never forget); by default off there too, picked on the device (the warm
    # chain or "off") up to half of them where a caller's tuning asks for it.
    quarter = _auto(N=2, HV=16, T_total=2 * 32768)
    assert not quarter.enabled and quarter.reason.endswith("a forced count gains only where the gates forget")
    quarter = _auto(N=2, HV=16, T_total=2 * 32768, tuning=PICKING)
    assert quarter.enabled and quarter.chained and quarter.picked
    assert "64 programs in [0.25, 0.5) x 132 SMs" in quarter.reason
    half = _auto(N=2, HV=17, T_total=2 * 32768, tuning=PICKING)
    assert not half.enabled and half.reason.endswith("a forced count gains only where the gates forget")
    assert _auto(N=1, HV=16).enabled and not _auto(N=1, HV=16).chained


def test_a_picked_plan_is_off_where_the_backend_cannot_pick():
    from gdn_dispatch.context_parallel import CPTuning

    assert not _auto(N=1, HV=32, T_total=32768).enabled  # picked plans are a caller's opt-in
    picked = _auto(N=1, HV=32, T_total=32768, tuning=PICKING)
    # 4 segments: 2^round(log2(2 x 132 / 64)); the slot past the tail makes 5.
    assert picked.picked and picked.seg_len == 8192 and picked.num_segments == 5
    assert "picked on the device: off, or chained segments of 8192 tokens" in picked.describe()
    off = picked.unpicked("a warm chain")
    assert not off.enabled and off.reason == picked.reason + "; picked segments need a warm chain"
    mapped = _auto(N=1, HV=8, T_total=32768, tuning=PICKING)
    assert mapped.unpicked("a warm chain") is mapped
    # A picked plan needs 128 chunks: shorter walks gain too little against its launches.
    short = _auto(N=1, HV=32, T_total=127 * 64, max_len=127 * 64, tuning=PICKING)
    assert not short.enabled and "127 chunks < 128 for a picked plan" in short.reason
    assert _auto(N=1, HV=32, T_total=128 * 64, max_len=128 * 64, tuning=PICKING).picked
    # No band with pick_fill at the fill; the chained band (a caller's opt-in) comes first.
    assert not _auto(N=1, HV=32, T_total=32768, tuning=CPTuning(pick_fill=0.25)).enabled
    chained = _auto(N=1, HV=32, T_total=32768, tuning=CPTuning(chain_fill=1.0))
    assert chained.chained and not chained.picked


def test_auto_stays_off_for_short_sequences_and_without_sms():
    short = _auto(T_total=900, max_len=900)
    assert not short.enabled and "15 chunks < 16" in short.reason
    assert not _auto(sm_count=0).enabled
    assert "no tokens" in _auto(T_total=0, max_len=0).reason
    # Two segments at least: 24 chunks against segments of 16 (6 * sqrt(2 * 24 / 12) = 12).
    two = _auto(T_total=24 * 64, max_len=24 * 64, HV=2, V=64, sm_count=12)
    assert not two.enabled and "fewer than 2 segments" in two.reason, two.reason
    # Enough chunks per program: 32 programs need 128 chunks (4 each), 16 programs 64.
    few = _auto(HV=16, T_total=4096, max_len=4096)
    assert not few.enabled and "64 chunks < 4 per program x 32 programs" in few.reason
    assert not _auto(HV=16, T_total=127 * 64, max_len=127 * 64).enabled
    assert _auto(HV=8, T_total=4096, max_len=4096).enabled
    assert _auto(HV=16, T_total=8192, max_len=8192).enabled


def test_auto_without_a_host_copy_uses_the_mean_length():
    plan = _auto(N=2, T_total=2 * 16384, max_len=None)
    assert plan.enabled and "mean sequence of 256 chunks" in plan.reason
    assert plan.num_segments == 2 * 16384 // plan.seg_len + 2


def test_segment_rule_and_its_constants():
    assert auto_segment_chunks(1, 32, 512, 132) == 64  # 6 * sqrt(32 * 512 / 132) = 66.8
    assert auto_segment_chunks(1, 16, 512, 132) == 64  # 47.2 -> 2^round(5.56)
    assert auto_segment_chunks(1, 8, 512, 132) == 32  # 33.4
    assert auto_segment_chunks(1, 4, 128, 132) == 16  # 11.8
    assert auto_segment_chunks(1, 1, 16, 132) == 4  # the floor
    assert auto_segment_chunks(1, 1, 16, 132, CPTuning(min_seg_chunks=2)) == 2
    assert auto_segment_chunks(1, 4, 512, 132, CPTuning(seg_factor=3.0)) == 16  # FlashQLA's factor
    assert _auto(sm_count=1000).seg_len == 512  # 6 * sqrt(4 * 512 / 1000) = 8.6 -> 8 chunks
    assert not _auto(HV=4, sm_count=16, V=64).enabled  # 4 programs >= 0.25 x 16
    assert _auto(HV=4, sm_count=16, V=64, tuning=PICKING).picked  # below half of them: picked on the device
    assert _auto(HV=4, sm_count=16, V=64, tuning=CPTuning(fill=1.0)).enabled


@pytest.mark.parametrize("n, max_len, seg_len", [(1, 700, 704), (2, 700, 384), (11, 700, 64), (50, 700, 64),
                                                 (4, None, 1024)])
def test_forced_segment_count(n, max_len, seg_len):
    plan = plan_context_parallel(n, T_total=4096, N=3, HV=64, V=128, sm_count=H200_SMS, max_len=max_len)
    assert plan.enabled and plan.seg_len == seg_len and plan.num_segments == 4096 // seg_len + 3
    assert plan_context_parallel("off", T_total=4096, N=1, HV=1, V=128, sm_count=H200_SMS).enabled is False


@pytest.mark.parametrize("value, match", [
    (0, "a segment count >= 1, got 0"), (-2, "got -2"), ("on", "'auto', 'off' or a segment count >= 1, got 'on'"),
    (True, "got True"), (2.0, "got 2.0"), (None, "got None"),
])
def test_invalid_requests(value, match):
    assert match in context_parallel_reason(value)
    call = random_call(batch=(1, 8), dtype=torch.float32)
    with pytest.raises(GDNInputError, match="context_parallel: .*" + match.replace("(", r"\(")):
        chunk_gated_delta_rule(**call, context_parallel=value)
    with pytest.raises(ValueError, match="context_parallel"):
        plan_context_parallel(value, T_total=8, N=1, HV=1, V=8, sm_count=1)


def test_invalid_request_raises_under_compile():
    """A bad non-tensor argument is seen while tracing: dynamo runs the frame eagerly, which
    raises the contract's error."""
    call = random_call(batch=(1, 8), dtype=torch.float32)
    fn = torch.compile(lambda c: chunk_gated_delta_rule(**c, context_parallel="on"), backend="aot_eager")
    with pytest.raises(GDNInputError, match="context_parallel: expected 'auto', 'off'"):
        fn(call)
    good = torch.compile(lambda c: chunk_gated_delta_rule(**c, context_parallel=2), fullgraph=True,
                         backend="aot_eager")
    torch.testing.assert_close(good(call)[0], chunk_gated_delta_rule(**call, context_parallel=2)[0])


@pytest.mark.parametrize("value", ["auto", "off", 1, 7, 123])
def test_op_string_round_trip(value):
    assert context_parallel_arg(context_parallel_str(value)) == value


def test_plan_for_problem_reads_the_longest_sequence():
    call = random_call(lengths=[5, 2000, 30], dtype=torch.float32, HV=2)
    problem = make_problem(**call, context_parallel=4)
    plan = plan_for_problem(problem, H200_SMS)
    assert plan.seg_len == 512 and plan.num_segments == 2035 // 512 + 3
    uniform = make_problem(**random_call(batch=(2, 1500), dtype=torch.float32), context_parallel=3)
    assert plan_for_problem(uniform, H200_SMS).seg_len == 512


def test_registry_feature_and_explain_line():
    rows = {r.name: r for r in load_registry()}
    forced = CallSpec(context_parallel=True)
    assert call_reason(rows["reference"], forced) is None
    for name, row in rows.items():
        if "context_parallel" not in row.features:
            assert call_reason(row, forced) == "does not support context parallel"
    call = random_call(batch=(1, 4096), H=1, HV=2, K=16, V=16, dtype=torch.bfloat16)
    problem = make_problem(**call)
    text = explain(assumed_device("sm_90"), CallSpec.from_problem(problem), problem=problem).format()
    assert "context parallel: on, segments of" in text
    off = make_problem(**call, context_parallel="off")
    assert "context parallel: off (context_parallel='off')" in explain(
        assumed_device("sm_90"), CallSpec.from_problem(off), problem=off).format()


# --- the segmented math (float32 reference) --------------------------------------------------

def _mild(call: dict, factor: float) -> dict:
    """The call with its gates scaled: small factors keep the initial state alive across
    many segments, so the maps M carry it and the scan is tested."""
    return {**call, "g": call["g"] * factor}


LENGTHS = [
    pytest.param([300, 0, 1, 64, 128, 129, 700], id="ragged-0.1.64.128.129"),
    pytest.param([256, 255, 257], id="tails-at-segment-boundaries"),
    pytest.param([1, 0, 0], id="short-and-empty"),
]


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 12])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_reference_segmented_equals_unsegmented(lengths, n, layout):
    call = _mild(random_call(lengths=lengths, H=2, HV=4, K=16, V=24, dtype=torch.float32, seed=n,
                             state_layout=layout), 0.01)
    o, ht = reference.forward(make_problem(**call, output_final_state=True, context_parallel="off"))
    o_cp, ht_cp = reference.forward(make_problem(**call, output_final_state=True, context_parallel=n))
    assert rel_rms_error(o_cp, o) <= 1e-6
    assert rel_rms_error(ht_cp, ht) <= 1e-6


def test_reference_segmented_with_decays_that_underflow():
    """Gates of -30 per token: exp of a segment's cumulative gate is 0 in float32, M is 0
    and each segment starts from its own N."""
    call = random_call(lengths=[200, 129], H=1, HV=2, K=16, V=16, dtype=torch.float32, seed=3)
    call["g"] = torch.where(torch.arange(329)[None, :, None] % 7 == 0, -30.0, call["g"])
    o, ht = reference.forward(make_problem(**call, output_final_state=True))
    o_cp, ht_cp = reference.forward(make_problem(**call, output_final_state=True, context_parallel=4))
    k = call["k"][0, 64:128].float().repeat_interleave(2, dim=1)
    M, _ = reference.segment_map(k, *(call[name][0, 64:128].float() for name in ("g", "beta", "v")), 64)
    assert bool((M == 0).all())
    assert rel_rms_error(o_cp, o) <= 1e-6 and rel_rms_error(ht_cp, ht) <= 1e-6


def test_reference_segment_map_is_the_affine_map():
    """M S + N equals the walk from S, for a random S (M, N from one segment)."""
    call = _mild(random_call(batch=(1, 150), H=1, HV=2, K=8, V=12, dtype=torch.float32, seed=5), 0.05)
    k, v, g, beta = (call[name][0].float() for name in ("k", "v", "g", "beta"))
    k = k.repeat_interleave(2, dim=1)
    M, N = reference.segment_map(k, g, beta, v, 64)
    s = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(1))
    _, walked = reference._chunked_sequence(torch.zeros_like(k), k, v, g, beta, s, 1.0, 64)
    assert rel_rms_error(M @ s + N, walked) <= 1e-6
    assert rel_rms_error(M, torch.eye(8).expand(2, 8, 8)) > 1e-2  # M is not trivially the identity


def test_reference_pool_with_segments():
    call = _mild(random_call(lengths=[130, 0, 70], H=1, HV=2, K=8, V=8, dtype=torch.float32, seed=7), 0.01)
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(5, 2, 8, 8, generator=gen)
    idx = torch.tensor([3, 0, -1], dtype=torch.int32)
    h0 = torch.stack([pool[3], pool[0], torch.zeros(2, 8, 8)])
    _, ht = reference.forward(make_problem(**{**call, "initial_state": h0}, output_final_state=True))
    written = pool.clone()
    pool_call = {**call, "initial_state": written}
    _, ht_cp = reference.forward(make_problem(**pool_call, state_indices=idx, inplace_final_state=True,
                                              output_final_state=True, context_parallel=3))
    assert rel_rms_error(ht_cp, ht) <= 1e-6
    assert rel_rms_error(written[3], ht[0]) <= 1e-6 and rel_rms_error(written[0], ht[1]) <= 1e-6
    assert torch.equal(written[[1, 2, 4]], pool[[1, 2, 4]])


# --- triton_generic: the segment kernels and the segmented forward ---------------------------

import importlib  # noqa: E402

from gdn_dispatch.backends.triton_generic import output as tg_output, state as tg_state  # noqa: E402
from gdn_dispatch.backends.triton_generic import segment_map as tg_map, segment_scan as tg_scan  # noqa: E402

TG_CP = importlib.import_module("gdn_dispatch.backends.triton_generic.context_parallel")
TG_FORWARD = importlib.import_module("gdn_dispatch.backends.triton_generic.forward")
HAS_GPU = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU; the CPU runs the same cases "
                                                                  "under TRITON_INTERPRET=1")]),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3, torch.float16: 5e-3}


@pytest.fixture
def device(request, monkeypatch):
    """CPU tensors run in triton's interpreter, CUDA ones compiled; every buffer the
    segmented path allocates starts NaN-filled, so an element left unwritten fails."""
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    real_empty = torch.empty

    class Poisoned:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            t = real_empty(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2 ** 30))

        @staticmethod
        def empty_like(t, **kwargs):
            return Poisoned.empty(t.shape, dtype=kwargs.get("dtype", t.dtype), device=t.device)

    for module in (tg_map, tg_scan, tg_state, tg_output, TG_CP):
        monkeypatch.setattr(module, "torch", Poisoned())
    return torch.device(request.param)


def _segment_starts(cu: list[int], L: int) -> list[int]:
    """The segment-slot offsets, written out from the definition."""
    out = []
    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        for j in range(eos // L - bos // L + 1):
            out.append(min(bos + j * L, eos))
    return out + [cu[-1]]


def _segment_table(cu: list[int], L: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The segment offsets pass 1 writes for the offsets ``cu`` (its maps, of random
    16-wide rows, not read)."""
    T, N = cu[-1], len(cu) - 1
    gen = torch.Generator().manual_seed(T + N + L)
    k = torch.randn(1, T, 1, 16, generator=gen).to(device)
    w, u = torch.randn(1, T, 1, 16, generator=gen).to(device), torch.randn(1, T, 1, 16, generator=gen).to(device)
    g_cum = torch.randn(1, T, 1, generator=gen).to(device)
    seg_cu, *_ = tg_map.segment_map_fwd(k, w, u, g_cum, torch.tensor(cu, dtype=dtype, device=device), L)
    return seg_cu


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("lengths, L", [
    ([300, 0, 1, 64, 128, 129, 700], 128), ([5], 64), ([0, 0, 0], 64), ([64] * 9, 64), ([1000, 3, 2000], 256),
    (list(range(0, 400, 7)), 192),
])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_segment_map_writes_the_segment_table(lengths, L, dtype, device):
    """Pass 1's programs find their slot by bisection over cu_seqlens and write the slot
    offsets for the launches after it: every entry (outputs poisoned first), in
    cu_seqlens's dtype, equal to the definition."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    seg_cu = _segment_table(cu, L, dtype, device)
    assert seg_cu.dtype == dtype and seg_cu.tolist() == _segment_starts(cu, L)
    assert len(_segment_starts(cu, L)) == cu[-1] // L + len(lengths) + 1


def test_segment_map_refuses_a_forgetting_starts_buffer_it_cannot_fill():
    """``f_start`` must hold NSEG x HV float32 or int32 entries, contiguous; the error names it."""
    call = random_call(lengths=[300, 129], H=1, HV=2, K=16, V=16, dtype=torch.float32, device="cpu", seed=2)
    problem = make_problem(**call)
    B, T = problem.q.shape[:2]
    w, u = torch.zeros(B, T, 2, 16), torch.zeros(B, T, 2, 16)
    g_cum = torch.zeros(B, T, 2)
    nseg = 429 // 128 + 2
    for bad in (torch.zeros(nseg * 2 - 1), torch.zeros(nseg * 2, dtype=torch.float64),
                torch.zeros(nseg * 2, 2)[:, 0]):
        with pytest.raises(ValueError, match="f_start: expected a contiguous float32 or int32 tensor of at least "
                                             f"NSEG x HV = {nseg * 2} entries"):
            tg_map.segment_map_fwd(problem.k, w, u, g_cum, problem.chunks.cu_seqlens, 128, beta=problem.beta,
                                   f_start=bad)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype, l2, gate_scale, k_scale", [
    pytest.param(torch.bfloat16, False, 1.0, 1.0, id="bf16-bench-gates"),  # the last chunk alone forgets
    pytest.param(torch.float32, False, 0.25, 1.0, id="fp32-weaker-gates"),  # suffixes of 3-4 chunks, or none
    pytest.param(torch.float32, True, 0.25, 3.0, id="fp32-l2-raw-keys"),  # ||k||^2 <= 1 after the l2 norm
    pytest.param(torch.float32, False, 1.0, 2.0, id="fp32-keys-of-norm-2"),  # beta ||k||^2 may pass 2: none
])
def test_segment_map_kernel_drops_what_a_segment_forgets(dtype, l2, gate_scale, k_scale, device):
    """With beta, a launch before pass 1 writes each (segment, v-head)'s forgetting start
    (the Gluon pass 1's rule, modelled on the host by :func:`gdn_dispatch.testing.forgetting_start`),
    and pass 1 drops what it forgets: there M is exact zeros and N (the suffix's walk from
    zeros) equals the exact maps' N to float32 rounding; elsewhere both maps are bit-equal
    to the exact ones (beta None). The starts' buffer is poisoned first."""
    from gdn_dispatch.backends.triton_generic._jit import LOG2E
    from gdn_dispatch.backends.triton_generic.cumsum import chunk_cumsum_fwd
    from gdn_dispatch.backends.triton_generic.wu import wu_fwd
    from gdn_dispatch.testing import forgetting_start

    lengths, L, K, V = [300, 0, 129, 513], 256, 32, 32
    call = random_call(lengths=lengths, H=1, HV=2, K=K, V=V, dtype=dtype, device=device, seed=6,
                       normalize_qk=not l2)
    call = {**call, "g": call["g"] * gate_scale, "k": (call["k"].float() * k_scale).to(dtype)}
    problem = make_problem(**call, use_qk_l2norm_in_kernel=l2)
    g_cum = chunk_cumsum_fwd(problem.g, problem.chunks, scale=LOG2E)
    k_rnorm = torch.empty_like(g_cum) if l2 else None
    w, u = wu_fwd(problem.k, problem.v, g_cum, problem.beta, problem.chunks, use_qk_l2norm=l2, k_rnorm=k_rnorm)
    cu = problem.chunks.cu_seqlens
    nseg = sum(lengths) // L + len(lengths)
    f_start = torch.full((nseg * 2 + 3,), -7.0, device=device)
    seg_cu, m_hi, m_lo, n = tg_map.segment_map_fwd(problem.k, w, u, g_cum, cu, L, use_qk_l2norm=l2, k_rnorm=k_rnorm,
                                                   beta=problem.beta, f_start=f_start)
    _, e_hi, e_lo, e_n = tg_map.segment_map_fwd(problem.k, w, u, g_cum, cu, L, use_qk_l2norm=l2, k_rnorm=k_rnorm)
    assert bool((f_start[:nseg * 2] != -7.0).all()) and bool((f_start[nseg * 2:] == -7.0).all())
    k_all = call["k"][0].float()
    if l2:
        k_all = reference.l2_normalize(k_all)
    k_norm2 = k_all.pow(2).sum(-1).repeat_interleave(2, dim=1)
    g, beta = call["g"][0].float(), call["beta"][0].float()
    starts = seg_cu.tolist()
    zeros = partial = walked = 0
    for s in range(len(starts) - 1):
        a, b = starts[s], starts[s + 1]
        if b > a:
            assert rel_rms_error(n[s], e_n[s]) <= 1e-5, (s, a, b)
        for h in range(2):
            f0, near = forgetting_start(g[a:b, h].cpu(), beta[a:b, h].cpu(), k_norm2[a:b, h].cpu(),
                                        tg_map.MAP_NEGLIGIBLE_LOG2)
            if near:
                continue
            assert int(f_start[s * 2 + h]) == f0, (s, h)
            if f0 >= 0:
                assert bool((m_hi[s, h] == 0).all()) and bool((m_lo[s, h] == 0).all()), (s, h)
                zeros += 1
                partial += f0 > 0
            else:
                assert torch.equal(m_hi[s, h], e_hi[s, h]) and torch.equal(m_lo[s, h], e_lo[s, h]), (s, h)
                assert torch.equal(n[s, h], e_n[s, h]), (s, h)
                walked += 1
    assert walked > 0  # the empty slots' identities at least
    if k_scale == 1.0 or l2:
        assert zeros > 0 and partial > 0


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype, K, V, l2, bf16_maps", [
    pytest.param(torch.float32, 16, 24, False, False, id="fp32-K16-V24"),
    pytest.param(torch.float32, 40, 16, True, False, id="fp32-K40-V16-l2"),
    pytest.param(torch.bfloat16, 32, 32, False, False, id="bf16-K32-V32"),
    pytest.param(torch.bfloat16, 32, 32, False, True, id="bf16-K32-V32-bf16-maps"),
    pytest.param(torch.float32, 16, 24, False, True, id="fp32-K16-V24-bf16-maps-off-for-fp32"),
])
def test_segment_map_kernel_matches_the_reference_maps(dtype, K, V, l2, bf16_maps, device, monkeypatch):
    """Pass 1's maps against the reference's, in the split it stores: TF32-exact fp32 and
    a bf16 rest; with :data:`.segment_map.BF16_MAPS` a bf16 leading part for 16-bit calls
    (float32 calls keep the finer split)."""
    from gdn_dispatch.backends.triton_generic._jit import LOG2E
    from gdn_dispatch.backends.triton_generic.cumsum import chunk_cumsum_fwd
    from gdn_dispatch.backends.triton_generic.wu import wu_fwd

    monkeypatch.setattr(tg_map, "BF16_MAPS", bf16_maps)

    lengths, L = [200, 0, 64, 129], 128
    call = _mild(random_call(lengths=lengths, H=1, HV=2, K=K, V=V, dtype=dtype, device=device, seed=4,
                             normalize_qk=not l2), 0.02)
    problem = make_problem(**call, use_qk_l2norm_in_kernel=l2)
    g_cum = chunk_cumsum_fwd(problem.g, problem.chunks, scale=LOG2E)
    k_rnorm = torch.empty_like(g_cum) if l2 else None
    w, u = wu_fwd(problem.k, problem.v, g_cum, problem.beta, problem.chunks, use_qk_l2norm=l2, k_rnorm=k_rnorm)
    seg_cu, M_hi, M_lo, N = tg_map.segment_map_fwd(problem.k, w, u, g_cum, problem.chunks.cu_seqlens, L,
                                                   use_qk_l2norm=l2, k_rnorm=k_rnorm)
    assert M_lo.dtype == torch.bfloat16
    if bf16_maps and dtype != torch.float32:
        # A bf16 leading part and a bf16 rest within half its last place (2^-8 of it).
        assert M_hi.dtype == torch.bfloat16
        assert bool((M_lo.float().abs() <= M_hi.float().abs() * 2 ** -8 + 1e-30).all())
    else:
        # A TF32-exact fp32 part and a bf16 rest below its last bit.
        assert M_hi.dtype == torch.float32
        assert bool((M_hi.view(torch.int32) & 0x1FFF == 0).all())
        assert bool((M_lo.float().abs() <= M_hi.abs() * 2 ** -10 + 1e-30).all())
    M = M_hi.float() + M_lo.float()
    starts = seg_cu.tolist()
    k_all = call["k"][0].float()
    if l2:
        k_all = reference.l2_normalize(k_all)
    k_all = k_all.repeat_interleave(2, dim=1)
    for s in range(len(starts) - 1):
        a, b = starts[s], starts[s + 1]
        M_ref, N_ref = reference.segment_map(k_all[a:b], call["g"][0, a:b].float(), call["beta"][0, a:b].float(),
                                             call["v"][0, a:b].float(), 64)
        tol = TOL[dtype] * (2 if dtype != torch.float32 else 1)
        assert rel_rms_error(M[s], M_ref) <= tol, (s, a, b)
        if b > a:
            assert rel_rms_error(N[s], N_ref) <= tol, (s, a, b)
        else:
            assert bool((N[s] == 0).all())


@pytest.mark.parametrize("arch, depth", [("sm_90", 2), ("sm_80", 0), ("sm_100", 0)])
def test_pass_one_prefetches_into_l2_where_measured(arch, depth):
    """Pass 1 asks the L2 for w, k and u two chunks ahead on sm_90 (where the H200 measured
    the gain) and nowhere else; its sm_90 builds keep every register (no spills) with it."""
    from gdn_dispatch.aot import compile_kernel, kernels_for_target
    from gdn_dispatch.device import assumed_device

    capability = assumed_device(arch).capability
    assert tg_map.l2_prefetch_chunks(capability) == depth
    kernels = [k for k in kernels_for_target(capability, ["triton_generic"]) if k.kernel == "segment_map_fwd"]
    assert kernels and all(k.constexprs["PREFETCH"] == depth for k in kernels)
    if arch == "sm_90":
        for kernel in kernels:
            report = compile_kernel(kernel, capability)
            assert report.ptx.count("prefetch.global.L2") >= 3 * depth, kernel.specialization
            assert report.spill_bytes == 0, kernel.specialization
    assert tg_map.l2_prefetch_chunks(None) == 0  # the interpreter


#: The scan's error bound per split of the maps (relative RMS of every start and final
#: state against a float32 scan with unsplit maps, 9 segments): the TF32 + bf16 split
#: represents M to about 2^-19 of each entry, the bf16 + bf16 split (and the state's own
#: bf16 + bf16 split in its products) to about 2^-17, whose rounding over a few steps stays
#: within 3e-5; M's leading part alone (2^-9) would be off by ~1e-3.
SCAN_TOL = {"tf32-split": 1e-5, "bf16-split": 3e-5}


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("whole_m, stages", [(True, 1), (True, 2), (True, 3), (False, 1)],
                         ids=["whole-M", "whole-M-2-stages", "whole-M-3-stages", "column-blocks"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("split", ["tf32-split", "bf16-split"])
def test_segment_scan_kernel_matches_the_reference_scan(whole_m, stages, layout, split, device):
    """Both forms of the scan's step (the whole M with S in registers, the next map streamed
    in by the pipeliner with 2 or 3 stages as on sm_90; M in column blocks with S read back)
    against :func:`reference.scan_segments`, on random maps over ragged sequences (a
    0-length one, several segments per sequence), with M split as pass 1 stores it (TF32 +
    bf16, or bf16 + bf16 with :data:`.segment_map.BF16_MAPS`)."""
    from gdn_dispatch.backends.triton_generic.configs import LaunchConfig

    K, V = (32, 24) if device.type == "cpu" else (128, 128)
    lengths, L, HV = [300, 0, 64, 129, 513], 64, 2
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    starts = _segment_starts(cu, L)
    NSEG = len(starts) - 1
    gen = torch.Generator().manual_seed(11)
    # Maps near a decayed identity, as a segment's are, so states stay O(1) over 9 segments.
    M = (0.9 * torch.eye(K) + 0.3 * torch.randn(NSEG, HV, K, K, generator=gen) / K ** 0.5).to(device)
    N = torch.randn(NSEG, HV, K, V, generator=gen).to(device)
    # A slot that holds no token gets the identity and zeros, as pass 1 writes them (its
    # test checks that); the scan skips their products.
    empty = [s for s in range(NSEG) if starts[s] == starts[s + 1]]
    assert empty and len(empty) < NSEG // 2  # the 0-length sequence's slot and a rounded-up one
    M[empty], N[empty] = torch.eye(K, device=device), 0.0
    h0 = torch.randn(len(lengths), HV, K, V, generator=gen).to(device)
    h0_arg = h0.transpose(-1, -2).contiguous() if layout == "vk" else h0
    base = tg_scan.segment_scan_config(K, V)
    BKC = base.BK if whole_m else 16
    BV = 16 if stages > 1 else base.BV
    cfg = LaunchConfig(num_warps=base.num_warps, num_stages=stages, BK=base.BK, BV=BV, BKC=BKC)
    assert tg_scan.scan_block_kc(cfg) == BKC
    parts = tg_scan.split_maps(M, bf16=split == "bf16-split")
    assert parts[0].dtype == (torch.bfloat16 if split == "bf16-split" else torch.float32)
    seg_h0, final = tg_scan.segment_scan_fwd(*parts, N, cu_seqlens, L, initial_state=h0_arg,
                                             output_final_state=True,
                                             state_vk=layout == "vk", config=cfg)
    slot = 0
    for n in range(len(lengths)):
        slots = cu[n + 1] // L - cu[n] // L + 1
        maps = [(M[s], N[s]) for s in range(slot, slot + slots)]
        ref_starts, ref_final = reference.scan_segments(h0[n], maps)
        for j, ref in enumerate(ref_starts):
            assert rel_rms_error(seg_h0[slot + j], ref) <= SCAN_TOL[split], (n, j, starts[slot + j])
        got = final[n].transpose(-1, -2) if layout == "vk" else final[n]
        assert rel_rms_error(got, ref_final) <= SCAN_TOL[split], n
        slot += slots
    assert slot == NSEG


def test_scan_takes_narrow_v_blocks_where_they_fill_one_wave():
    """On sm_90 the whole-M step takes 8 value columns per program where that many programs
    still fit one wave of the SMs (the chain is bound by M's bytes into each SM), else 16;
    other parts stream M's column blocks with 32 columns."""
    from gdn_dispatch.backends.triton_generic.configs import LaunchConfig

    whole = dict(num_warps=8, num_stages=2, BK=128, BKC=128)
    for pairs, bv in ((1, 8), (4, 8), (8, 8), (9, 16), (16, 16)):
        assert tg_scan.segment_scan_config(128, 128, (9, 0), pairs, 132) == LaunchConfig(**whole, BV=bv), pairs
    assert tg_scan.segment_scan_config(128, 128, (9, 0)).BV == 16
    assert tg_scan.segment_scan_config(64, 64, (9, 0), 16, 132).BV == 8
    for capability in ((8, 0), (10, 0), None):
        cfg = tg_scan.segment_scan_config(128, 128, capability, 1, 132)
        assert (cfg.BV, tg_scan.scan_block_kc(cfg), cfg.num_stages) == (32, 32, 1)
        # bf16 maps change nothing off sm_90 (the column-block step streams no whole M).
        assert tg_scan.segment_scan_config(128, 128, capability, 1, 132, True) == cfg
    # With bf16 maps (68 KB a whole-M stage at K = V = 128) three stages.
    assert tg_scan.segment_scan_config(128, 128, (9, 0), 1, 132, True) == LaunchConfig(**{**whole, "num_stages": 3},
                                                                                        BV=8)


@pytest.mark.slow
def test_bf16_maps_kernels_compile_for_sm90_within_limits(monkeypatch):
    """With :data:`.segment_map.BF16_MAPS` the bf16 build's pass 1 stores M_hi in bf16 and
    the scan streams three 68 KB stages of the whole M (K = V = 128) on bf16 products: both
    compile for sm_90a without spills and within its shared memory, the scan's products on
    bf16 tensor-core instructions alone."""
    import re

    from gdn_dispatch.aot import compile_kernel
    from gdn_dispatch.device import SMEM_OPTIN
    from gdn_dispatch.backends.triton_generic import aot as tg_aot

    monkeypatch.setattr(tg_map, "BF16_MAPS", True)
    # (chained segments' pass 1 stores no M)
    kernels = [k for k in tg_aot.kernels_for_aot((9, 0))
               if k.kernel in SEGMENT_KERNELS and "bf16" in k.specialization and not k.constexprs.get("CHAIN")]
    scans = [k for k in kernels if k.kernel == "segment_scan_fwd"]
    assert len(kernels) == 1 + len(scans) and scans
    for kernel in kernels:
        assert kernel.signature["m_hi"] == "*bf16"
        report = compile_kernel(kernel, (9, 0))
        assert report.spill_bytes <= kernel.spill_bytes_allowed, (kernel.specialization, report.spill_bytes)
        assert report.shared_bytes <= SMEM_OPTIN[(9, 0)], (kernel.specialization, report.shared_bytes)
        if kernel.kernel == "segment_scan_fwd":
            assert kernel.num_stages == 3
            # wgmma at 16 value columns, mma.sync at 8: bf16 operands only, no TF32 product.
            assert re.search(r"(wgmma\.mma_async|mma\.sync)\S*\.bf16\.bf16", report.ptx), kernel.specialization
            assert not re.search(r"(wgmma\.mma_async|mma\.sync)\S*\.tf32", report.ptx), kernel.specialization


def _cp_case(case_id, dtype, cpu, gpu, layout="kv", h0=True, l2=False, pool=None, marks=()):
    return pytest.param(dtype, cpu, gpu, layout, h0, l2, pool, id=case_id, marks=marks)


# (dtype, CPU shape + segment count, GPU shape + segment count, layout, initial state, l2,
# pool dtype). Segment counts short enough that the CPU shapes cut into segments of 64-128.
CP_CASES = [
    _cp_case("varlen-300.0.1.64.128.129.700-H2-HV4-K16-V24-kv-h0-fp32-n11", torch.float32,
             dict(lengths=[300, 0, 1, 64, 128, 129, 700], H=2, HV=4, K=16, V=24, n=11),
             dict(lengths=[9000, 0, 1, 64, 4097, 129, 700], H=2, HV=8, K=128, V=128, n=16)),
    _cp_case("varlen-256.255.257-H1-HV2-K32-vk-h0-l2-bf16-n4", torch.bfloat16,
             dict(lengths=[256, 255, 257], H=1, HV=2, K=32, V=32, n=4),
             dict(lengths=[16384, 16383, 16385], H=2, HV=4, K=128, V=128, n=8), layout="vk", l2=True),
    _cp_case("B2-T200-H1-HV2-K24-V40-kv-fp16-n3", torch.float16,
             dict(batch=(2, 200), H=1, HV=2, K=24, V=40, n=3),
             dict(batch=(2, 8192), H=4, HV=8, K=64, V=128, n=8), h0=False),
    _cp_case("varlen-190.0.70-H1-HV2-K16-vk-pool-bf16-n3", torch.bfloat16,
             dict(lengths=[190, 0, 70], H=1, HV=2, K=16, V=16, n=3),
             dict(lengths=[20000, 0, 700], H=2, HV=4, K=128, V=128, n=12), layout="vk", pool=torch.bfloat16),
    _cp_case("varlen-130.65-H2-HV2-K16-kv-pool-fp32-n2", torch.float32,
             dict(lengths=[130, 65], H=2, HV=2, K=16, V=16, n=2),
             dict(lengths=[5000, 65, 3000], H=2, HV=2, K=128, V=64, n=5), pool=torch.float32),
]


def _cp_call(dtype, shape, layout, h0, l2, device, seed=0):
    shape = dict(shape)
    n = shape.pop("n")
    # float32: gates mild enough that a state lives through many segments; 16-bit data keeps
    # more decay, as its rounding of a long-lived state alone reaches the tolerance.
    call = _mild(random_call(**shape, dtype=dtype, device=device, seed=seed, initial_state=h0,
                             state_layout=layout, normalize_qk=not l2), 0.02 if dtype == torch.float32 else 0.1)
    return call, n


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype, cpu, gpu, layout, h0, l2, pool", CP_CASES)
def test_triton_generic_segmented_matches_the_reference(dtype, cpu, gpu, layout, h0, l2, pool, device):
    call, n = _cp_call(dtype, cpu if device.type == "cpu" else gpu, layout, h0, l2, device)
    flags = dict(use_qk_l2norm_in_kernel=l2, output_final_state=True)
    extra, ref_call = {}, dict(call)
    if pool is not None:
        call, extra, ref_call = pooled_call(call, pool)
        expected_pool = call["initial_state"].clone()
    o_ref, ht_ref = reference.forward(make_problem(**ref_call, **flags, context_parallel="off"))
    problem = make_problem(**call, **flags, **extra, context_parallel=n, backend="triton_generic")
    plan = plan_for_problem(problem, 1)
    assert plan.enabled and plan.num_segments > problem.N
    o, ht = TG_FORWARD.forward(problem)
    assert rel_rms_error(o, o_ref) <= TOL[dtype]
    assert rel_rms_error(ht, ht_ref) <= TOL[dtype]
    if pool is not None:
        idx = extra["state_indices"]
        live = idx >= 0
        expected_pool[idx[live].long()] = ht_ref[live].to(pool)
        assert rel_rms_error(call["initial_state"], expected_pool) <= max(TOL[dtype], TOL[pool])


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype, cpu, gpu, layout, h0, l2, pool",
                         [case for case in CP_CASES if case.values[0] != torch.float32])
def test_bf16_maps_agree_with_the_finer_split(dtype, cpu, gpu, layout, h0, l2, pool, device, monkeypatch):
    """A 16-bit segmented call with M stored as two bf16 parts (:data:`.segment_map.BF16_MAPS`)
    against the same call with the TF32 + bf16 split: the states the scan hands on differ
    by the splits' rounding (about 2^-17 of each map entry), far below the 16-bit data's
    own; both within the tolerance of the reference."""
    shape = cpu if device.type == "cpu" else gpu
    call, n = _cp_call(dtype, shape, layout, h0, l2, device)
    flags = dict(use_qk_l2norm_in_kernel=l2, output_final_state=True)
    if pool is not None:
        dims = tuple(call["initial_state"].shape[2:])
        rows, idx, _ = padded_pool(len(shape["lengths"]), call["v"].shape[2], dims, pool, seed=9, device=device)
        flags.update(state_indices=idx)
        call = {**call, "initial_state": rows}
    o_ref, ht_ref = reference.forward(make_problem(**call, **flags, context_parallel="off"))
    scanned = []  # (M_hi's dtype, whether a map carries a state) per call, as the scan got them

    def recording_scan(m_hi, m_lo, *args, **kwargs):
        m = (m_hi.float() + m_lo.float()).flatten(0, 1)  # [slots x v-heads, K, K]
        identity = (m == torch.eye(m.shape[-1], device=m.device)).flatten(1).all(1)  # empty slots
        # Carried: some segment hands on at least 0.1% of its start state (the CPU shapes'
        # least is 0.2%); below that a map's rounding need not reach the float32 states.
        scanned.append((m_hi.dtype, bool(((m.flatten(1).abs().amax(1) > 1e-3) & ~identity).any())))
        return tg_scan.segment_scan_fwd(m_hi, m_lo, *args, **kwargs)

    monkeypatch.setattr(importlib.import_module("gdn_dispatch.backends.triton_generic.context_parallel"),
                        "segment_scan_fwd", recording_scan)
    out = {}
    for bf16_maps in (False, True):
        monkeypatch.setattr(tg_map, "BF16_MAPS", bf16_maps)
        problem = make_problem(**call, **flags, context_parallel=n, backend="triton_generic")
        assert plan_for_problem(problem, 1).enabled
        out[bf16_maps] = TG_FORWARD.forward(problem)
    (o_fine, ht_fine), (o, ht) = out[False], out[True]
    assert [dtype for dtype, _ in scanned] == [torch.float32, torch.bfloat16]
    assert rel_rms_error(o, o_ref) <= TOL[dtype] and rel_rms_error(ht, ht_ref) <= TOL[dtype]
    # Within the scan's own bound of the finer split; and where a map carries a state
    # across a segment (on the CPU shapes always; the GPU shapes' 1024- to 2048-token
    # segments decay M below 1e-30) the states differ, i.e. the bf16 split did run.
    assert rel_rms_error(ht, ht_fine) <= SCAN_TOL["bf16-split"] and rel_rms_error(o, o_fine) <= 1e-3
    carried = scanned[1][1]
    assert carried or device.type != "cpu"
    if carried:
        assert rel_rms_error(ht, ht_fine) > 0


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_triton_generic_segmented_with_decays_that_underflow(device):
    call = random_call(lengths=[200, 129, 0], H=1, HV=2, K=16, V=16, dtype=torch.float32, seed=3, device=device)
    call["g"] = torch.where(torch.arange(329, device=device)[None, :, None] % 7 == 0, -30.0, call["g"])
    # These gates make the data ill-conditioned: the chunked walks (the reference's and the
    # unsegmented kernel's) sit near 1e-5 from the per-token recurrence; the segmented
    # kernel must match the unsegmented one far closer, and the recurrence within 1e-5.
    o_ref, ht_ref = reference.forward_recurrent(make_problem(**call, output_final_state=True))
    o, ht = chunk_gated_delta_rule(**call, output_final_state=True, context_parallel=4, backend="triton_generic")
    o_off, ht_off = chunk_gated_delta_rule(**call, output_final_state=True, context_parallel="off",
                                           backend="triton_generic")
    assert rel_rms_error(o, o_ref) <= 1e-5 and rel_rms_error(ht, ht_ref) <= 1e-5
    assert rel_rms_error(o, o_off) <= 1e-6 and rel_rms_error(ht, ht_off) <= 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("HV", [4, 8, 16])
def test_auto_engages_on_a_long_prompt_and_matches_off(HV, monkeypatch):
    """A 32k-token prompt on a tensor-parallel shard's heads: "auto" turns segments on (as
    explain says), and the result equals the unsegmented call to bf16 rounding."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    call = random_call(lengths=[32768], H=max(HV // 2, 1), HV=HV, K=128, V=128, dtype=torch.bfloat16,
                       device="cuda", seed=HV)
    problem = make_problem(**call, output_final_state=True, backend="triton_generic")
    assert plan_for_problem(problem, torch.cuda.get_device_properties(0).multi_processor_count).enabled
    o_auto, ht_auto = chunk_gated_delta_rule(**call, output_final_state=True, backend="triton_generic")
    o_off, ht_off = chunk_gated_delta_rule(**call, output_final_state=True, backend="triton_generic",
                                           context_parallel="off")
    o_ref, ht_ref = reference.forward(make_problem(**call, output_final_state=True))
    assert rel_rms_error(o_auto, o_ref) <= 5e-3 and rel_rms_error(ht_auto, ht_ref) <= 5e-3
    assert rel_rms_error(o_auto, o_off) <= 5e-3


# --- Gluon backends --------------------------------------------------------------------------

GLUON_FORWARD = importlib.import_module("gdn_dispatch.backends.gluon_common.forward")
from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache  # noqa: E402
from gdn_dispatch.backends.triton_generic._jit import LOG2E  # noqa: E402
from gdn_dispatch.backends.triton_generic.cumsum import chunk_cumsum_fwd  # noqa: E402
from gdn_dispatch.backends.triton_generic.wu import wu_fwd  # noqa: E402

#: The Gluon row the registry admits per compute capability major.
GLUON_BY_MAJOR = {9: "gluon_sm90", 10: "gluon_sm100"}


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("shape, request_, seg_len", [
    pytest.param(dict(batch=(1, 32768), H=2, HV=4), "auto", {"sm_90": 2048, "sm_100": 1024}, id="H2-HV4-1x32768-auto"),
    pytest.param(dict(batch=(1, 32768), H=8, HV=16), "auto", {"sm_90": 4096, "sm_100": 2048},
                 id="H8-HV16-1x32768-auto"),
    pytest.param(dict(batch=(8, 4096), H=2, HV=4), 4, {"sm_90": 1024, "sm_100": 1024}, id="H2-HV4-8x4096-n4"),
    pytest.param(dict(lengths=[5000, 0, 63, 2000], H=1, HV=2), 5, {"sm_90": 1024, "sm_100": 1024},
                 id="varlen-5000.0.63.2000-n5"),
])
def test_gluon_plan_call_runs_segments(arch, shape, request_, seg_len):
    """The dry run: with segments on, the segment kernels run between wy and the fused
    kernel, which walks NSEG segment "sequences" from fp32 "kv" start states in place of
    the call's sequences, with no final state and no pool of its own."""
    call = random_call(**shape, K=128, V=128, dtype=torch.bfloat16, seed=1, state_layout="vk")
    idx = torch.arange(call["v"].shape[0] if "batch" in shape else len(shape["lengths"]), dtype=torch.int32)
    problem = make_problem(**call, output_final_state=True, context_parallel=request_,
                           state_indices=idx, inplace_final_state=True)
    device = assumed_device(arch)
    planned = GLUON_FORWARD.plan_call(problem, device)
    cp = planned.context_parallel
    nseg = problem.B * problem.T // seg_len[arch] + problem.N
    assert (cp.enabled, cp.seg_len, cp.num_segments) == (True, seg_len[arch], nseg)
    assert planned.kernels == ("wy_fwd", "segment_map_fwd", "segment_scan", "state_output_fwd")
    # Pass 1 on the matrix engine: (segment slot, v-head, column block of V + K) programs.
    pass_one = planned.segment_map
    assert pass_one.kernel == "segment_map_fwd" and pass_one.constexprs["ENGINE"].is_sm100 == (arch == "sm_100")
    assert pass_one.grid[0] == nseg * problem.HV * (problem.K + problem.V) // pass_one.blocks["BC"]
    fused = planned.state_output
    assert fused.grid[0] == nseg * problem.HV * fused.blocks["NV"]
    flags = fused.constexprs
    assert (flags["USE_H0"], flags["STORE_HT"], flags["STATE_VK"], flags["USE_POOL"], flags["INPLACE"]) == \
        (True, False, False, False, False)
    # Segments end inside a chunk exactly where the call's sequences do.
    assert flags["HAS_TAILS"] == planned.launches.stage("state_output_fwd").constexprs["HAS_TAILS"]
    off = GLUON_FORWARD.plan_call(make_problem(**call, context_parallel="off"), device)
    assert off.segments is None and not off.context_parallel.enabled
    assert off.kernels == ("wy_fwd", "state_output_fwd")


@pytest.mark.parametrize("lengths, L, busy", [
    (None, 2048, 2 * 2),  # uniform 2 x 4096: 6 slots, the one past each sequence empty
    ([0, 4096, 100, 2049], 2048, 0 + 2 + 1 + 2),
    ([64, 0, 0], 64, 1),
    ([1, 2, 3], 1024, 3),
])
def test_segment_tables_count_the_slots_with_tokens(lengths, L, busy):
    """Pass 2's table (as the forward builds it, with the host segment offsets) counts the
    slots with tokens: a slot holds tokens where its offsets differ."""
    from gdn_dispatch.backends.triton_generic.context_parallel import segment_table
    from gdn_dispatch.context_parallel import CPPlan

    shape = dict(batch=(2, 4096)) if lengths is None else dict(lengths=lengths)
    chunks = make_problem(**random_call(**shape, H=1, HV=1, K=8, V=8, dtype=torch.float32)).chunks
    offsets = GLUON_FORWARD.segment_host_offsets(chunks, L).offsets
    cp = CPPlan(enabled=True, seg_len=L, num_segments=len(offsets) - 1, reason="forced")
    table = segment_table(chunks, int(chunks.cu_seqlens_host[-1]), cp, offsets, offsets)
    assert table.nonempty_seqs() == busy
    # What the forward reads of the offsets in one pass is what the table reads of them.
    host = GLUON_FORWARD.segment_host_offsets(chunks, L)
    assert torch.equal(host.offsets, offsets)
    assert (host.longest, host.aligned, host.nonempty) == (table.longest_length(), table.chunk_aligned(), busy)
    read = segment_table(chunks, int(chunks.cu_seqlens_host[-1]), cp, offsets, offsets, longest=host.longest,
                         aligned=host.aligned, nonempty=host.nonempty)
    assert (read.longest, read.aligned, read.nonempty_seqs()) == (host.longest, host.aligned, busy)
    offsets = offsets.tolist()
    assert sum(b > a for a, b in zip(offsets, offsets[1:])) == busy
    assert host.longest == max(b - a for a, b in zip(offsets, offsets[1:]))
    assert host.aligned == (not any(x % 64 for x in offsets))


def test_a_routes_segment_facts_are_the_segment_offsets():
    """What a route reads of a uniform batch's (or one packed sequence's) segments from its
    counts alone, and of a packed batch's from its host offsets, is what the segment
    offsets the forward computes give."""
    from gdn_dispatch.backends.gluon_common import segments

    rng = torch.Generator().manual_seed(11)
    for _ in range(300):
        B = int(torch.randint(1, 5, (), generator=rng))
        T = int(torch.randint(1, 5000, (), generator=rng))
        L = 64 * int(torch.randint(1, 40, (), generator=rng))
        host = segments._uniform_segment_offsets(B, T, L)
        assert segments.uniform_segment_facts(B, T, L) == segments.segment_facts(host), (B, T, L)
    assert segments.segment_facts(None) == (True, None)
    for _ in range(300):
        lengths = torch.randint(0, 3000, (int(torch.randint(1, 7, (), generator=rng)),), generator=rng)
        lengths[torch.rand(len(lengths), generator=rng) < 0.3] = 0
        lengths[torch.rand(len(lengths), generator=rng) < 0.3] = 64 * int(torch.randint(1, 20, (), generator=rng))
        offsets = [0, *lengths.cumsum(0).tolist()]
        L = 64 * int(torch.randint(1, 40, (), generator=rng))
        host = segments._offsets_read(segments._segment_offsets(offsets, L))
        assert segments.ragged_segment_facts(offsets, L) == segments.segment_facts(host), (offsets, L)


def test_slots_with_tokens_need_host_offsets(monkeypatch):
    monkeypatch.setattr(contract, "_in_host_memory", lambda t: False)  # the CPU offsets stand for device ones
    call = random_call(lengths=[4096, 100], H=1, HV=1, K=8, V=8, dtype=torch.float32)
    call.pop("cu_seqlens_cpu")
    chunks = make_problem(**call).chunks
    assert chunks.nonempty_seqs() is None and GLUON_FORWARD.segment_host_offsets(chunks, 2048) is None


@pytest.mark.parametrize("host", [True, False], ids=["host-offsets", "device-offsets-only"])
def test_pass_two_picks_its_v_block_on_the_slots_with_tokens(host, monkeypatch):
    """16 segments of one 32768-token sequence on 4 v-heads fill 17 slots on the H200's
    132 SMs: the 128 programs with tokens fit one wave at BV 64, where counting the empty
    slot (136 programs) took BV 128 (0.297 ms against 0.266 forced at BV 64,
    benchmarks/RESULTS.md). Without a host copy of the offsets, all slots count."""
    call = random_call(lengths=[32768], H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, seed=2)
    if not host:
        call.pop("cu_seqlens_cpu")
        monkeypatch.setattr(contract, "_in_host_memory", lambda t: False)  # the CPU offsets stand for device ones
    planned = GLUON_FORWARD.plan_call(make_problem(**call, output_final_state=True, context_parallel=16),
                                      assumed_device("sm_90"))
    assert planned.context_parallel.num_segments == 17
    assert planned.state_output.blocks["BV"] == (64 if host else 128)


def test_gluon_plan_call_stays_unsegmented_when_the_heads_fill_the_device():
    call = random_call(batch=(4, 8192), H=16, HV=32, K=128, V=128, dtype=torch.bfloat16)
    planned = GLUON_FORWARD.plan_call(make_problem(**call), assumed_device("sm_90"))
    assert not planned.context_parallel.enabled and planned.segments is None
    assert ">= 0.25 x 132 SMs" in planned.context_parallel.reason
    l2 = GLUON_FORWARD.plan_call(make_problem(**call, use_qk_l2norm_in_kernel=True, context_parallel=2),
                                 assumed_device("sm_90"))
    assert l2.kernels == ("wy_fwd", "qk_rnorm_fwd", "segment_map_fwd", "segment_scan",
                          "state_output_fwd")
    assert l2.segment_map.constexprs["USE_L2NORM"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("H, HV", [(2, 2), (1, 2), (1, 4), (2, 8)])
def test_gluon_segmented_stages_agree_on_the_qk_l2_norm(H, HV, K, dtype):
    """Every stage of a segmented l2 call is planned for the same norm: bf16 reads raw q
    and k (wy, pass 1 plain and chained, pass 2 with the reciprocal norms), fp16 the
    normalized copies (none of them normalizes). Groups above two, where the warp-
    specialized path plans its own call without the norm, once planned pass 1 without it
    too: k's rows unscaled, final states off by about ||k|| (7.3 relative RMS on the H100
    at K = 64)."""
    call = random_call(lengths=[4096, 65], H=H, HV=HV, K=K, V=128, dtype=dtype, seed=HV + K, normalize_qk=False)
    problem = make_problem(**call, use_qk_l2norm_in_kernel=True, output_final_state=True, context_parallel=4)
    planned = GLUON_FORWARD.plan_call(problem, assumed_device("sm_90"))
    in_kernels = dtype == torch.bfloat16
    assert planned.kernels[0] == ("wy_fwd" if in_kernels else "qk_l2norm_fwd")
    cls = planned.launches.cls
    flags = {"wy": planned.launches.stage("wy_fwd").constexprs["USE_L2NORM"],
             "pass 1": cls.segment_map.constexprs["USE_L2NORM"],
             "pass 1 chained": cls.segment_map_chain.constexprs["USE_L2NORM"],
             "pass 2": planned.state_output.constexprs["USE_L2NORM"]}
    assert flags == dict.fromkeys(flags, in_kernels), flags


@pytest.mark.parametrize("lengths, L", [([300, 0, 1, 64, 128, 129, 700], 128), ([0, 0], 64), ([5], 64),
                                        ([1000, 3, 2000], 256), ([4100], 1024)])
def test_segment_host_offsets_equal_the_table_kernel(lengths, L, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    call = random_call(lengths=lengths, H=1, HV=1, K=16, V=16, dtype=torch.float32)
    chunks = make_problem(**call).chunks
    host = GLUON_FORWARD.segment_host_offsets(chunks, L).offsets
    assert host.tolist() == _segment_table(chunks.cu_seqlens_host.tolist(), L, chunks.cu_seqlens.dtype, "cpu").tolist()
    assert host.tolist() == _segment_starts(chunks.cu_seqlens_host.tolist(), L)
    uniform = make_problem(**random_call(batch=(3, 700), H=1, HV=1, K=16, V=16, dtype=torch.float32)).chunks
    assert GLUON_FORWARD.segment_host_offsets(uniform, L).offsets.tolist() == _segment_starts([0, 700, 1400, 2100], L)
    monkeypatch.setattr(contract, "_in_host_memory", lambda t: False)  # the CPU offsets stand for device ones
    no_host = make_problem(**{**call, "cu_seqlens_cpu": None}).chunks
    assert GLUON_FORWARD.segment_host_offsets(no_host, L) is None


def test_gluon_rows_run_segments_and_auto_engages(monkeypatch):
    for name in GLUON_BY_MAJOR.values():
        # CPU tensors stand for CUDA ones here (the Gluon rows refuse others).
        monkeypatch.setattr(importlib.import_module(f"gdn_dispatch.backends.{name}"), "unsupported_reason",
                            lambda problem: None)
    rows = {r.name: r for r in load_registry()}
    for name in GLUON_BY_MAJOR.values():
        assert call_reason(rows[name], CallSpec(context_parallel=True)) is None
    call = random_call(batch=(1, 32768), H=2, HV=4, K=128, V=128, dtype=torch.bfloat16)
    problem = make_problem(**call)
    for arch in ("sm_90", "sm_100"):
        explanation = explain(assumed_device(arch), CallSpec.from_problem(problem), problem=problem)
        assert explanation.selected == GLUON_BY_MAJOR[int(arch[3:-1])]
        assert explanation.context_parallel.startswith("on, segments of ")
        assert "does not run segments" not in explanation.context_parallel
    # 16/32 heads: off by default; where a caller's tuning asks for picked plans, picked on
    # the device by gluon_sm90, while gluon_sm100 runs it "off" (no warm chain there), and
    # says so.
    wide = make_problem(**random_call(batch=(1, 32768), H=16, HV=32, K=128, V=128, dtype=torch.bfloat16))
    note = explain(assumed_device("sm_90"), CallSpec.from_problem(wide), problem=wide).context_parallel
    assert note.startswith("off (") and "gates forget" in note
    monkeypatch.setattr(context_parallel, "TUNING", PICKING)
    notes = {arch: explain(assumed_device(arch), CallSpec.from_problem(wide), problem=wide).context_parallel
             for arch in ("sm_90", "sm_100")}
    assert notes["sm_90"].startswith("on, picked on the device") and "cannot pick" not in notes["sm_90"]
    assert notes["sm_100"].endswith("gluon_sm100 cannot pick on the device, so this call runs unsegmented")


class _GluonStandIns:
    """The Gluon kernels replaced by triton_generic's (same math, under the interpreter),
    recording what the orchestrator hands them; the scan stays real."""

    def __init__(self):
        self.calls = []

    def wy_fwd(self, k, v, g, beta, chunks, launch, out=None):
        self.calls.append("wy_fwd")
        l2 = launch.constexprs["USE_L2NORM"]
        g_cum = chunk_cumsum_fwd(g, chunks, scale=LOG2E)
        results = (*wu_fwd(k, v, g_cum, beta, chunks, use_qk_l2norm=l2), g_cum)
        if out is not None:  # the orchestrator's buffers, written as the kernel writes them
            for buffer, result in zip(out, results):
                assert buffer.shape == result.shape and buffer.dtype == result.dtype
                buffer.copy_(result)
            results = tuple(out)
        self.wy = results
        return results

    def qk_rnorm_fwd(self, q, k, launch):
        self.calls.append("qk_rnorm_fwd")
        self.rnorm = torch.full((q.shape[0] * q.shape[1], q.shape[2], 2), float("nan"))
        return self.rnorm

    def segment_map_fwd(self, k, w, u, g_cum, beta, cu_seqlens, seg_len, launch, *, rnorm=None, out=None):
        self.calls.append("segment_map_fwd")
        assert all(a is b for a, b in zip((w, u, g_cum), self.wy)), "pass 1 must read the call's w, u, g_cum"
        l2 = launch.constexprs["USE_L2NORM"]
        assert rnorm is (self.rnorm if l2 else None)
        # (segment slot, v-head, column block) programs over the slots pass 1 writes.
        nseg = k.shape[0] * k.shape[1] // seg_len + cu_seqlens.shape[0] - 1
        assert launch.grid_for(k.shape[0] * k.shape[1], nseg)[0] == \
            nseg * u.shape[2] * (k.shape[3] + u.shape[3]) // launch.blocks["BC"]
        return tg_map.segment_map_fwd(k, w, u, g_cum, cu_seqlens, seg_len, use_qk_l2norm=l2, out=out)

    def state_output_fwd(self, q, k, w, u, g_cum, chunks, launch, *, scale, initial_state=None,
                         output_final_state=False, rnorm=None, state_indices=None, out=None):
        self.calls.append("state_output_fwd")
        flags = launch.constexprs
        self.segmented = chunks.num_seqs
        assert all(a is b for a, b in zip((w, u, g_cum), self.wy)), "pass 2 must read the call's w, u, g_cum"
        assert (flags["STATE_VK"], flags["USE_POOL"], flags["STORE_HT"]) == (False, False, False)
        assert not output_final_state and state_indices is None
        assert initial_state.dtype == torch.float32 and initial_state.shape[0] == chunks.num_seqs
        assert launch.grid[0] == chunks.num_seqs * u.shape[2] * launch.blocks["NV"]
        if flags["USE_L2NORM"]:
            assert rnorm is self.rnorm
        l2 = flags["USE_L2NORM"]
        h, v_new, _ = tg_state.state_fwd(k, w, u, g_cum, chunks, initial_state=initial_state, use_qk_l2norm=l2)
        o = tg_output.output_fwd(q, k, v_new, h, g_cum, chunks, scale=scale, use_qk_l2norm=l2)
        if out is not None:
            assert out[1] is None and out[0].shape == o.shape and out[0].dtype == o.dtype
            o = out[0].copy_(o)
        return o, None


@pytest.mark.parametrize("device", DEVICES[:1], indirect=True)
@pytest.mark.parametrize("lengths, layout, l2, pool, n", [
    pytest.param([300, 0, 1, 64, 129, 250], "kv", False, None, 3, id="varlen-300.0.1.64.129.250-kv-h0-n3"),
    pytest.param([250, 190], "vk", True, None, 4, id="varlen-250.190-vk-h0-l2-n4"),
    pytest.param([190, 0, 70], "vk", False, torch.bfloat16, 3, id="varlen-190.0.70-vk-pool-bf16-n3"),
])
def test_gluon_orchestration_matches_the_reference_on_cpu(lengths, layout, l2, pool, n, device, monkeypatch):
    """The segmented Gluon forward end to end on the CPU: the real scan (interpreted)
    between stand-ins for the Gluon kernels computing the same math (pass 1's writes the
    real segment table and maps, on triton_generic's kernel); one
    wy launch feeds both passes, pass 2 walks the segments, the scan gives the final state
    and the pool rows (the Python path: a call program, where the native layer is built,
    launches the kernels themselves, which this CPU has no driver for)."""
    from gdn_dispatch import native

    monkeypatch.setattr(native, "for_calls", lambda: None)
    stand_ins = _GluonStandIns()
    for name in ("wy_fwd", "qk_rnorm_fwd", "segment_map_fwd", "state_output_fwd"):
        monkeypatch.setattr(GLUON_FORWARD, name, getattr(stand_ins, name))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    call = _mild(random_call(lengths=lengths, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, seed=5,
                             state_layout=layout, normalize_qk=not l2), 0.1)
    flags = dict(use_qk_l2norm_in_kernel=l2, output_final_state=True)
    ref_call, extra = dict(call), {}
    if pool is not None:
        gen = torch.Generator().manual_seed(2)
        rows = (0.1 * torch.randn(len(lengths) + 1, *call["initial_state"].shape[1:], generator=gen)).to(pool)
        idx = torch.tensor([2, -1, 0], dtype=torch.int64)
        ref_call["initial_state"] = torch.where((idx >= 0).view(-1, 1, 1, 1), rows[idx.clamp(min=0)].float(), 0.0)
        expected_pool = rows.clone()
        call = {**call, "initial_state": rows}
        extra = dict(state_indices=idx, inplace_final_state=True)
    o_ref, ht_ref = reference.forward(make_problem(**ref_call, **flags, context_parallel="off"))
    problem = make_problem(**call, **flags, **extra, context_parallel=n)
    clear_plan_cache()
    o, ht = GLUON_FORWARD.forward(problem, assumed_device("sm_90"), engine=None)
    cp = plan_for_problem(problem, 132)
    assert stand_ins.calls == ["wy_fwd"] + (["qk_rnorm_fwd"] if l2 else []) + ["segment_map_fwd", "state_output_fwd"]
    assert stand_ins.segmented == cp.num_segments > problem.N
    assert rel_rms_error(o, o_ref) <= TOL[torch.bfloat16]
    assert rel_rms_error(ht, ht_ref) <= TOL[torch.bfloat16]
    if pool is not None:
        live = idx >= 0
        expected_pool[idx[live]] = ht_ref[live].to(pool)
        assert rel_rms_error(call["initial_state"], expected_pool) <= TOL[pool]
        assert torch.equal(call["initial_state"][1], rows[1])  # the row no index names


def _gluon_on_this_gpu() -> str | None:
    if not HAS_GPU:
        return None
    return GLUON_BY_MAJOR.get(torch.cuda.get_device_capability()[0])


GLUON_GPU = pytest.mark.skipif(_gluon_on_this_gpu() is None, reason="needs an sm_90 or sm_100 GPU (a Gluon row's device)")

# (dtype, shape + segment request, layout, initial state, l2, pool dtype) at the Gluon
# rows' head dims: ragged with 0- and 1-token sequences, segment cuts at sequence tails,
# grouped heads, both layouts, pools with -1.
GLUON_CP_CASES = [
    pytest.param(torch.bfloat16, dict(lengths=[9000, 0, 1, 64, 4097, 129, 700], H=2, HV=8, K=128, V=128, n=16),
                 "kv", True, False, None, id="varlen-9000.0.1.64.4097.129.700-H2-HV8-K128-V128-kv-h0-bf16-n16"),
    pytest.param(torch.bfloat16, dict(lengths=[16384, 16383, 16385], H=2, HV=4, K=128, V=128, n=8),
                 "vk", True, True, None, id="varlen-16384.16383.16385-H2-HV4-K128-vk-h0-l2-bf16-n8"),
    pytest.param(torch.float16, dict(batch=(2, 8192), H=4, HV=8, K=64, V=128, n=8),
                 "kv", False, False, None, id="B2-T8192-H4-HV8-K64-V128-kv-fp16-n8"),
    pytest.param(torch.bfloat16, dict(lengths=[20000, 0, 700], H=2, HV=4, K=128, V=128, n=12),
                 "vk", True, False, torch.bfloat16, id="varlen-20000.0.700-H2-HV4-K128-vk-pool-bf16-n12"),
    pytest.param(torch.bfloat16, dict(lengths=[5000, 65, 3000], H=2, HV=2, K=128, V=64, n=5),
                 "kv", True, False, torch.float32, id="varlen-5000.65.3000-H2-HV2-K128-V64-kv-pool-fp32-n5"),
    pytest.param(torch.bfloat16, dict(batch=(1, 32768), H=2, HV=4, K=128, V=128, n="auto"),
                 "kv", True, False, None, id="B1-T32768-H2-HV4-K128-kv-h0-bf16-auto"),
    pytest.param(torch.bfloat16, dict(lengths=[12000, 3], H=1, HV=2, K=64, V=64, n="auto"),
                 "vk", True, True, None, id="varlen-12000.3-H1-HV2-K64-vk-h0-l2-bf16-auto"),
    # Groups of four with the norm (the tensor-parallel shard 2/8 of Qwen3.5's 16/64 heads):
    # the warp-specialized path runs them on copies, the segmented pipeline on raw q and k.
    pytest.param(torch.bfloat16, dict(lengths=[20000, 65], H=2, HV=8, K=128, V=128, n="auto"),
                 "vk", True, True, None, id="varlen-20000.65-H2-HV8-K128-vk-h0-l2-bf16-auto"),
    pytest.param(torch.bfloat16, dict(lengths=[2049, 65, 63], H=1, HV=4, K=64, V=64, n=5),
                 "vk", True, True, None, id="varlen-2049.65.63-H1-HV4-K64-vk-h0-l2-bf16-n5"),
]


@pytest.mark.gpu
@GLUON_GPU
@pytest.mark.parametrize("dtype, shape, layout, h0, l2, pool", GLUON_CP_CASES)
@pytest.mark.usefixtures("compiled")
def test_gluon_segmented_matches_the_reference_and_off(dtype, shape, layout, h0, l2, pool):
    """The Gluon row of this GPU with segments (forced counts and auto) against the
    reference (context_parallel='off') and against its own unsegmented run, on
    NaN-poisoned memory; pools written back through the scan, -1 rows left alone."""
    backend = _gluon_on_this_gpu()
    call, n = _cp_call(dtype, shape, layout, h0, l2, "cuda", seed=11)
    flags = dict(use_qk_l2norm_in_kernel=l2, output_final_state=True)
    ref_call, extra, rows = dict(call), {}, None
    if pool is not None:
        HV, *dims = call["initial_state"].shape[1:]
        rows, idx, ref_call["initial_state"] = padded_pool(len(shape["lengths"]), HV, tuple(dims), pool, seed=9,
                                                           device="cuda")
        live = idx >= 0
        extra = dict(state_indices=idx, inplace_final_state=True)
    o_ref, ht_ref = reference.forward(make_problem(**ref_call, **flags, context_parallel="off"))
    problem = make_problem(**call, **flags, **extra, context_parallel=n, backend=backend)
    planned = GLUON_FORWARD.plan_call(problem, _gpu_device())
    assert planned.segments is not None and planned.context_parallel.num_segments > problem.N

    def run(cp):
        args = {**call, "initial_state": rows.clone()} if pool is not None else call
        poison_cuda_allocator()
        o, ht = chunk_gated_delta_rule(**args, **flags, **extra, context_parallel=cp, backend=backend)
        return o, ht, args["initial_state"]

    o, ht, pool_after = run(n)
    o_off, ht_off, pool_off = run("off")
    assert rel_rms_error(o, o_ref) <= TOL[dtype] and rel_rms_error(ht, ht_ref) <= TOL[dtype]
    assert rel_rms_error(o, o_off) <= TOL[dtype] and rel_rms_error(ht, ht_off) <= TOL[dtype]
    if pool is not None:
        expected = rows.clone()
        expected[idx[live].long()] = ht_ref[live].to(pool)
        assert rel_rms_error(pool_after, expected) <= max(TOL[dtype], TOL[pool])
        untouched = torch.ones(rows.shape[0], dtype=torch.bool, device="cuda")
        untouched[idx[live].long()] = False
        assert torch.equal(pool_after[untouched], rows[untouched])


#: The tensor-parallel shards of issue 16 (bf16, K = V = 128): (H, HV, lengths).
TP_SHARDS = [(2, 4, [32768]), (4, 8, [32768]), (2, 8, [32768]), (8, 16, [32768]), (16, 32, [32768]),
             (2, 4, [4096] * 8)]
#: The shards "auto" segments on a 132-SM H200: up to 32 programs (N x HV x 2 V blocks);
#: 16/32 heads and 8 sequences of 2/4 heads make 64, which run faster unsegmented.
TP_SEGMENTED = {(2, 4, 1), (4, 8, 1), (2, 8, 1), (8, 16, 1)}


@pytest.mark.parametrize("H, HV, lengths", [pytest.param(*s, id=f"H{s[0]}-HV{s[1]}-{len(s[2])}x{s[2][0]}")
                                            for s in TP_SHARDS])
@pytest.mark.gpu
@GLUON_GPU
@pytest.mark.usefixtures("compiled")
def test_gluon_auto_on_tensor_parallel_shards(H, HV, lengths):
    """The registry's own choice on the shards (a Gluon row on its GPU): "auto" cuts the
    prompt into segments where the rule says (on an H200: :data:`TP_SEGMENTED`) and matches
    both 'off' and the reference."""
    call = random_call(lengths=lengths, H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=HV)
    problem = make_problem(**call, output_final_state=True)
    explanation = explain(_gpu_device(), CallSpec.from_problem(problem), problem=problem)
    assert explanation.selected == _gluon_on_this_gpu()
    segmented = GLUON_FORWARD.plan_call(problem, _gpu_device()).segments is not None
    if _gpu_device().sm_count == H200_SMS:
        assert segmented == ((H, HV, len(lengths)) in TP_SEGMENTED)
    poison_cuda_allocator()
    o_auto, ht_auto = chunk_gated_delta_rule(**call, output_final_state=True)
    o_off, ht_off = chunk_gated_delta_rule(**call, output_final_state=True, context_parallel="off")
    o_ref, ht_ref = reference.forward(make_problem(**call, output_final_state=True, context_parallel="off"))
    assert rel_rms_error(o_auto, o_ref) <= 5e-3 and rel_rms_error(ht_auto, ht_ref) <= 5e-3
    assert rel_rms_error(o_auto, o_off) <= 5e-3 and rel_rms_error(ht_auto, ht_off) <= 5e-3


def _gpu_device():
    from gdn_dispatch.device import default_probe

    return default_probe().for_torch_device(torch.device("cuda", torch.cuda.current_device()))


@pytest.fixture
def compiled(monkeypatch):
    """Compiled kernels: the Gluon rows have no interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


#: The segment kernels the Gluon rows launch (triton_generic's; the older parts compile
#: them in the arch matrix, where triton_generic is chosen or listed).
SEGMENT_KERNELS = ("segment_map_fwd", "segment_scan_fwd")


def _segment_aot_cases():
    from gdn_dispatch.backends.triton_generic import kernels_for_aot

    for arch in ("sm_90", "sm_100", "sm_103"):
        for kernel in kernels_for_aot(assumed_device(arch).capability):
            if kernel.kernel in SEGMENT_KERNELS:
                yield pytest.param(arch, kernel, id=f"{arch}-{kernel.kernel}-{kernel.specialization}")


@pytest.mark.slow
@pytest.mark.parametrize("arch, kernel", list(_segment_aot_cases()))
def test_segment_kernels_compile_for_the_gluon_parts(arch, kernel):
    """The Gluon rows' segmented calls launch the plain-Triton segment kernels: they compile
    for Hopper and datacenter Blackwell without spills, within shared memory; on sm_90 the
    scan streams M's parts in with asynchronous copies into its products (both of its
    V-blocks)."""
    from gdn_dispatch.aot import compile_kernel
    from gdn_dispatch.device import SMEM_OPTIN

    device = assumed_device(arch)
    report = compile_kernel(kernel, device.capability)
    assert report.spill_bytes == 0, f"{report.spill_bytes} bytes of spills"
    assert report.shared_bytes <= SMEM_OPTIN[device.capability]
    assert f".target sm_{device.capability[0]}{device.capability[1]}" in report.ptx
    if arch == "sm_90" and kernel.kernel == "segment_scan_fwd":
        assert kernel.constexprs["BKC"] == kernel.constexprs["BK"] and kernel.num_stages == 2
        # The 16-column products on wgmma; the 8-column ones on mma.sync (Triton 3.6) or
        # wgmma (later releases).
        assert "cp.async" in report.ptx
        engines = ("wgmma.mma_async",) if kernel.constexprs["BV"] >= 16 else ("wgmma.mma_async", "mma.sync")
        assert any(engine in report.ptx for engine in engines), engines
