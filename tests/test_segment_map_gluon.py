"""Context parallelism's pass 1 on the matrix engine (:mod:`gdn_dispatch.backends.gluon_common.segment_map`).

CPU: the plan's choices and the sm_90a / sm_100a builds within their limits. GPU: the maps
and the segment table against the reference's and triton_generic's pass 1, every output
poisoned first.
"""

from __future__ import annotations

import pytest
import torch

from gdn_dispatch import reference
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import SMEM_OPTIN
from gdn_dispatch.testing import forgetting_start, random_call, rel_rms_error

from gdn_dispatch.backends.gluon_common import segment_map as gm
from gdn_dispatch.backends.triton_generic._jit import LOG2E

HAS_GPU = torch.cuda.is_available()


def _problem(K: int, V: int, l2: bool = False, H: int = 2, HV: int = 4, device="cpu", lengths=(64, 65), seed=0):
    call = random_call(lengths=list(lengths), H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, device=device,
                       seed=seed, normalize_qk=not l2)
    # Mild gates keep M away from zero over a segment (about -12 bits over 1024 tokens, far
    # above the negligible bound), so every M is walked and its comparison means something.
    call = {**call, "g": call["g"] * 0.01}
    return call, make_problem(**call, use_qk_l2norm_in_kernel=l2)


def _engine(capability):
    if capability[0] == 10:
        from gdn_dispatch.backends.gluon_sm100 import ENGINE
    else:
        from gdn_dispatch.backends.gluon_sm90 import ENGINE
    return ENGINE


@pytest.mark.parametrize("K, V, want", [
    # K = 128: two programs per SM with two slots (104 KB each); a third slot would leave one.
    (128, 128, (64, 4, 2)),
    (128, 64, (64, 4, 2)),
    # K = 64: two programs per SM (by registers) hold three slots (88 KB each), not four.
    (64, 128, (64, 4, 3)),
    (64, 64, (64, 4, 3)),
])
def test_plan_picks_the_column_block_and_the_deepest_ring_that_fits(K, V, want):
    _, problem = _problem(K, V)
    launch = gm.plan_segment_map(problem, (9, 0))
    assert (launch.blocks["BC"], launch.num_warps, launch.constexprs["NUM_BUF"]) == want
    smem = launch.blocks["smem_bytes"] + gm.SMEM_SCRATCH
    assert smem <= SMEM_OPTIN[(9, 0)]
    # Two programs per SM (their registers allow no more); one ring slot more would fit fewer.
    assert gm._programs_by_smem(K, want[0], 2, want[2], SMEM_OPTIN[(9, 0)]) >= 2
    assert want[2] == gm.RING_SLOTS_MAX or gm._programs_by_smem(K, want[0], 2, want[2] + 1, SMEM_OPTIN[(9, 0)]) < 2
    # (segment slot, v-head, column block) programs: NSEG slots are the launch's num_seqs.
    assert launch.grid_for(4096, 17) == (17 * problem.HV * (K + V) // want[0],)


def test_plan_refuses_what_cannot_run():
    _, problem = _problem(128, 64)
    with pytest.raises(ValueError, match="block_c"):
        gm.plan_segment_map(problem, (9, 0), block_c=128)  # does not divide V
    _, problem = _problem(128, 128)
    with pytest.raises(ValueError, match="num_warps"):
        gm.plan_segment_map(problem, (9, 0), block_c=128, num_warps=4)  # 128 fp32 a thread
    with pytest.raises(ValueError, match="slots"):
        gm.plan_segment_map(problem, (9, 0), slots=6)  # 240 KB of rings alone


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)], ids=["sm_90a", "sm_100a"])
@pytest.mark.parametrize("K, V, l2", [(128, 128, False), (128, 128, True), (64, 128, True), (128, 64, False)])
def test_builds_within_limits(capability, K, V, l2):
    """Every default plan compiles without spills, within the shared memory it planned
    (and the TMEM of S and P on sm_100a), with its MMAs on the part's engine."""
    from gdn_dispatch.aot import compile_kernel

    _, problem = _problem(K, V, l2)
    launch = gm.plan_segment_map(problem, capability, engine=_engine(capability))
    report = compile_kernel(gm.segment_map_aot_kernel("test", launch, torch.bfloat16, "t"), capability)
    assert report.spill_bytes == 0
    assert report.shared_bytes <= launch.blocks["smem_bytes"] + gm.SMEM_SCRATCH
    assert report.shared_bytes <= SMEM_OPTIN[capability]
    if capability[0] == 10:
        assert "tcgen05.mma" in report.ptx and report.tmem_columns <= 512
    else:
        assert "wgmma.mma_async" in report.ptx
    assert "cp.async.bulk.tensor" in report.ptx


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)], ids=["sm_90a", "sm_100a"])
@pytest.mark.parametrize("config", [(64, 4, 3), (128, 8, 2), (128, 8, 3)], ids=str)
def test_override_configs_build(capability, config):
    """The plan's overrides the sweep and the GPU tests launch (two warpgroups at BC 128,
    a third ring slot) compile without spills: every layout of the kernel holds at 8 warps."""
    from gdn_dispatch.aot import compile_kernel

    _, problem = _problem(128, 128)
    block_c, warps, slots = config
    launch = gm.plan_segment_map(problem, capability, block_c=block_c, num_warps=warps, slots=slots,
                                 engine=_engine(capability))
    report = compile_kernel(gm.segment_map_aot_kernel("test", launch, torch.bfloat16, "t"), capability)
    assert report.spill_bytes == 0
    assert report.shared_bytes <= SMEM_OPTIN[capability]


# ----------------------------------------------------------------------------------------
# GPU


def _maps(call, problem, L, launch, cu_dtype):
    """(seg_cu, M, N) of pass 1 on the Gluon kernel and on triton_generic's, from the same
    w, u and g_cum, every output NaN-poisoned first."""
    from gdn_dispatch.backends.gluon_common.qk_norm import plan_qk_rnorm_rows, qk_rnorm_fwd
    from gdn_dispatch.backends.triton_generic import segment_map as tm
    from gdn_dispatch.backends.triton_generic.cumsum import chunk_cumsum_fwd
    from gdn_dispatch.backends.triton_generic.wu import wu_fwd

    l2 = problem.use_qk_l2norm
    g_cum = chunk_cumsum_fwd(problem.g, problem.chunks, scale=LOG2E)
    w, u = wu_fwd(problem.k, problem.v, g_cum, problem.beta, problem.chunks, use_qk_l2norm=l2)
    cu = problem.chunks.cu_seqlens.to(cu_dtype)
    B, T, H, K = problem.k.shape
    NSEG = B * T // L + cu.shape[0] - 1
    HV, V = problem.HV, problem.V
    out = (torch.full((NSEG + 1,), -(2 ** 30), dtype=cu_dtype, device="cuda"),
           torch.full((NSEG, HV, K, K), float("nan"), device="cuda"),
           torch.full((NSEG, HV, K, K), float("nan"), dtype=torch.bfloat16, device="cuda"),
           torch.full((NSEG, HV, K, V), float("nan"), device="cuda"))
    rnorm = qk_rnorm_fwd(problem.q, problem.k, plan_qk_rnorm_rows(B * T * H, K)) if l2 else None
    seg_cu, m_hi, m_lo, n = gm.segment_map_fwd(problem.k, w, u, g_cum, problem.beta, cu, L, launch, rnorm=rnorm,
                                               out=out)
    t_cu, t_hi, t_lo, t_n = tm.segment_map_fwd(problem.k, w, u, g_cum, cu, L, use_qk_l2norm=l2)
    return (seg_cu, m_hi.double() + m_lo.double(), n), (t_cu, t_hi.double() + t_lo.double(), t_n)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("K, V, H, HV, lengths, L, l2, cu_dtype, config", [
    (128, 128, 2, 4, [4096], 512, False, torch.int32, None),
    (128, 128, 1, 4, [700, 0, 1500, 64, 33], 256, False, torch.int64, None),
    (128, 128, 2, 4, [1000, 333, 2048], 256, True, torch.int32, None),
    (128, 128, 2, 4, [1000, 333, 2048], 256, False, torch.int32, (64, 4, 3)),
    (128, 128, 2, 4, [1000, 333, 2048], 256, True, torch.int32, (128, 8, 2)),
    (128, 128, 2, 4, [1000, 333, 2048], 256, False, torch.int32, (128, 8, 3)),
    (64, 128, 2, 2, [900, 1, 640], 128, True, torch.int32, None),
    (128, 64, 1, 2, [640, 77], 128, True, torch.int64, None),
    (64, 64, 1, 1, [300, 5000], 1024, False, torch.int32, None),
])
def test_maps_match_the_reference_and_the_plain_triton_pass(K, V, H, HV, lengths, L, l2, cu_dtype, config):
    """Every slot's M and N against the reference's affine map of its tokens and against
    triton_generic's pass 1, every output element written (NaN-poisoned first), the
    segment table equal: ragged tails, empty sequences and empty slots, grouped heads, the
    qk l2 norm, both offset dtypes, K != V and the non-default launch configs."""
    from gdn_dispatch.backends.gluon_sm90 import ENGINE

    call, problem = _problem(K, V, l2, H, HV, "cuda", lengths, seed=sum(lengths) + L)
    block_c, warps, slots = config or (None, None, None)
    launch = gm.plan_segment_map(problem, torch.cuda.get_device_capability(), block_c=block_c, num_warps=warps,
                                 slots=slots, engine=ENGINE)
    (seg_cu, M, N), (t_cu, t_M, t_N) = _maps(call, problem, L, launch, cu_dtype)
    assert seg_cu.dtype == cu_dtype and seg_cu.tolist() == t_cu.tolist()
    assert not M.isnan().any() and not N.isnan().any()
    assert rel_rms_error(M, t_M) <= 2e-3 and rel_rms_error(N, t_N) <= 2e-3
    starts = seg_cu.tolist()
    k_all = call["k"][0].float()
    if l2:
        k_all = reference.l2_normalize(k_all)
    k_all = k_all.repeat_interleave(HV // H, dim=1)
    # Against the float32 reference: the walk rounds the state to bf16 for each of its L / 64
    # chunk steps, errors adding up like a random walk (both backends' pass 1 alike: they
    # agree to 2e-3 above), so the bound grows with the square root of the steps.
    tol = 5e-3 * max(2.0, (L / 64) ** 0.5)
    for s in range(len(starts) - 1):
        a, b = starts[s], starts[s + 1]
        M_ref, N_ref = reference.segment_map(k_all[a:b], call["g"][0, a:b].float(), call["beta"][0, a:b].float(),
                                             call["v"][0, a:b].float(), 64)
        assert rel_rms_error(M[s].float(), M_ref) <= tol, (s, a, b)
        if b > a:
            assert rel_rms_error(N[s], N_ref) <= tol, (s, a, b)
        else:
            assert bool((N[s] == 0).all()) and bool((M[s].float() == M_ref).all())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("l2, k_scale, beta_spike, gate_scale", [
    (False, 1.0, None, 1.0),  # normalized keys, beta in (0, 1): the last chunk alone forgets
    (False, 1.0, None, 0.25),  # weaker gates (about -19 bits a chunk): suffixes of 3-4 chunks or none
    (False, 2.0, None, 1.0),  # ||k||^2 = 4: beta ||k||^2 may pass 2, few suffixes hold
    (False, 1.0, 2.5, 1.0),  # one token's beta of 2.5 (token 10, in the first segment)
    (True, 3.0, None, 0.25),  # raw keys under the l2 norm: ||k||^2 <= 1 after it
])
def test_forgotten_stretches_are_dropped_and_the_rest_walked(l2, k_scale, beta_spike, gate_scale):
    """Pass 1 finds each segment's shortest suffix whose map is provably below
    2^MAP_NEGLIGIBLE_LOG2 (:func:`gdn_dispatch.testing.forgetting_start` models the rule on
    the host): there M is stored as exact zeros, and the reference's map of that suffix is
    indeed below the bound, and N (walked over the suffix alone) equals the reference's N
    of the whole segment; everywhere else M is walked and equals the reference's."""
    from gdn_dispatch.backends.gluon_sm90 import ENGINE

    lengths, L, H, HV = [700, 0, 1500, 64, 33, 1], 256, 1, 2
    call = random_call(lengths=lengths, H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, device="cuda",
                       seed=len(lengths) + int(k_scale) + l2, normalize_qk=not l2)
    call["k"] = (call["k"].float() * k_scale).to(torch.bfloat16)
    call["g"] = call["g"] * gate_scale
    if beta_spike is not None:
        call["beta"][0, 10, :] = beta_spike
    problem = make_problem(**call, use_qk_l2norm_in_kernel=l2)
    launch = gm.plan_segment_map(problem, torch.cuda.get_device_capability(), engine=ENGINE)
    (seg_cu, M, N), _ = _maps(call, problem, L, launch, torch.int32)
    starts = seg_cu.tolist()
    k_all = call["k"][0].float()
    if l2:
        k_all = reference.l2_normalize(k_all)
    k_norm2 = k_all.pow(2).sum(-1).repeat_interleave(HV // H, dim=1)  # [T, HV]
    k_all = k_all.repeat_interleave(HV // H, dim=1)
    g, beta, v = call["g"][0].float(), call["beta"][0].float(), call["v"][0].float()
    zeros, walked, partial = 0, 0, 0
    for s in range(len(starts) - 1):
        a, b = starts[s], starts[s + 1]
        M_ref, N_ref = reference.segment_map(k_all[a:b], g[a:b], beta[a:b], v[a:b], 64)
        if b > a:
            assert rel_rms_error(N[s], N_ref) <= 1e-2, (s, a, b)
        for h in range(HV):
            f0, near = forgetting_start(g[a:b, h], beta[a:b, h], k_norm2[a:b, h], gm.MAP_NEGLIGIBLE_LOG2)
            if near:
                continue  # too close to a threshold for the kernel's float32 sums to be asserted
            if f0 >= 0:
                assert bool((M[s, h] == 0).all()), (s, h, a, b)
                c = a + 64 * f0
                M_suffix, _ = reference.segment_map(k_all[c:b], g[c:b], beta[c:b], v[c:b], 64)
                assert float(torch.linalg.matrix_norm(M_suffix[h].double(), ord=2)) <= 2.0 ** gm.MAP_NEGLIGIBLE_LOG2
                zeros += 1
                partial += c > a
            else:
                assert rel_rms_error(M[s, h].float(), M_ref[h]) <= 1e-2, (s, h, a, b)
                walked += 1
    assert walked > 0  # the empty slots' identities at least
    if beta_spike is None and (k_scale == 1.0 or l2):
        assert zeros > 0 and partial > 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("poisoned", ["beta", "k", "v"])
@pytest.mark.parametrize("token", [300, 500])
def test_a_nan_in_a_forgotten_stretch_is_dropped_and_one_in_the_suffix_walks(poisoned, token):
    """Segment 1 (tokens 256 .. 511) forgets all but its last chunk (448 .. 511) under
    these gates. A NaN at token 300 lies in the forgotten stretch: M is stored as zeros and
    N (the suffix's walk) stays finite. At token 500, in the suffix: a NaN beta or key fails
    the bound's check (min / max must not drop it), so M is walked and NaN; a NaN value
    leaves the bound alone (M zeros) and reaches N. The other segments forget as before."""
    from gdn_dispatch.backends.gluon_sm90 import ENGINE

    L, H, HV = 256, 1, 2
    call = random_call(lengths=[1024], H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=7)
    g, beta = call["g"][0].float(), call["beta"][0].float()
    for h in range(HV):
        f0 = forgetting_start(g[256:512, h], beta[256:512, h], torch.ones(256), gm.MAP_NEGLIGIBLE_LOG2)
        assert f0 == (3, False)
    if poisoned == "k":
        call["k"][0, token, :, 5] = float("nan")
    else:
        call[poisoned][0, token] = float("nan")
    problem = make_problem(**call)
    launch = gm.plan_segment_map(problem, torch.cuda.get_device_capability(), engine=ENGINE)
    (seg_cu, M, N), _ = _maps(call, problem, L, launch, torch.int32)
    assert seg_cu.tolist()[:3] == [0, 256, 512]
    in_suffix = token >= 448
    if in_suffix and poisoned in ("beta", "k"):
        assert bool(M[1].isnan().any())
    else:
        assert bool((M[1] == 0).all())
    assert bool(N[1].isnan().any()) == in_suffix
    for s in (0, 2, 3):
        assert bool((M[s] == 0).all()) and not bool(N[s].isnan().any()), s
