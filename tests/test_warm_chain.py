"""Chained segments warmed up from their forgetting suffix on gluon_sm90's one-kernel build
(``fused.plan_fused(..., chain=True)``, backends/gluon_common/warm_chain.py): its plan and
argument checks, its sm_90a compile (slow tier), and on an sm_90 GPU the kernel over the
segment slots of ragged calls against the float32 reference and the unsegmented kernel,
its outputs poisoned first, under gates that forget within the warm-up window (the warm
path), gates that never do (every segment waits for the hand-over) and both mixed by
v-head."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch import chunk_gated_delta_rule  # noqa: E402
from gdn_dispatch.contract import make_problem  # noqa: E402
from gdn_dispatch.device import DeviceInfo, assumed_device  # noqa: E402
from gdn_dispatch.testing import poison_cuda_allocator, pooled_call, random_call, rel_rms_error  # noqa: E402

from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache  # noqa: E402
from gdn_dispatch.backends.gluon_common.warm_chain import WARM_CHUNKS  # noqa: E402
from gdn_dispatch.backends.gluon_sm90 import fused  # noqa: E402

SM90 = (9, 0)


def _engine():
    from gdn_dispatch.backends import gluon_sm90

    return gluon_sm90.ENGINE


def _device(sm_count=132):
    info = assumed_device("sm_90")
    return DeviceInfo(kind="cuda", index=0, name=info.name, capability=SM90, sm_count=sm_count,
                      smem_optin=info.smem_optin)


def _problem(**over):
    call = random_call(lengths=[300, 0, 700], H=2, HV=4, K=128, V=128, seed=1)
    return make_problem(**{**call, **over}, output_final_state=True)


# --- the plan ----------------------------------------------------------------------------------

def test_the_chain_plan_is_the_one_kernel_build_over_segment_slots():
    p = _problem()
    plain = fused.plan_fused(p, _device(), engine=_engine())
    chained = fused.plan_fused(p, _device(), engine=_engine(), chain=True)
    assert plain.constexprs["CHAIN"] is False and chained.constexprs["CHAIN"] is True
    assert {k: v for k, v in chained.constexprs.items() if k != "CHAIN"} == \
        {k: v for k, v in plain.constexprs.items() if k != "CHAIN"}
    assert "forgetting suffix" in chained.notes and "forgetting suffix" not in plain.notes
    # One program per (slot, v-head): the grid's sequence count is the slot count.
    assert chained.grid_rule(1000, 7) == (7 * p.HV,)


def test_the_chain_needs_the_one_kernel_build(monkeypatch):
    monkeypatch.setattr(fused, "AUX_T", False)
    clear_plan_cache()
    try:
        with pytest.raises(ValueError, match=r"one-kernel build \(fused\.AUX_T\) alone"):
            fused.plan_fused(_problem(), _device(), engine=_engine(), chain=True)
    finally:
        clear_plan_cache()


def test_a_chain_plan_and_its_arguments_go_together():
    p = _problem()
    chained = fused.plan_fused(p, _device(), engine=_engine(), chain=True)
    plain = fused.plan_fused(p, _device(), engine=_engine())
    stand_in = torch.empty(0)
    with pytest.raises(ValueError, match=r"a CHAIN plan needs \(hand, chain_flags, seg_len, NSEG\)"):
        fused.fused_fwd(p, stand_in, stand_in, chained)
    with pytest.raises(ValueError, match="another plan none"):
        fused.fused_fwd(p, stand_in, stand_in, plain, chain=(stand_in, stand_in, 64, 3))


@pytest.fixture
def warm_routes(monkeypatch):
    """Chained plans from the automatic rule (the band up to the whole device) and the
    warm chain's route on; plans computed afresh."""
    from gdn_dispatch import context_parallel as cp_module
    from gdn_dispatch.backends.gluon_common import warm_chain
    from gdn_dispatch.context_parallel import CPTuning

    monkeypatch.setattr(cp_module, "TUNING", CPTuning(chain_fill=1.0))
    clear_plan_cache()
    yield lambda on: monkeypatch.setattr(warm_chain, "WARM_CHAIN", on)
    clear_plan_cache()


def test_chained_calls_take_the_warm_chain_where_it_is_on(warm_routes):
    """With chained plans, a class with the one-kernel build runs it over the segment slots
    (one launch, no pass 1) once the warm chain is on, and the pipeline's passes before;
    sm_100a (no one-kernel build routed) keeps the passes; warm-up keys name the launch."""
    from gdn_dispatch.backends.gluon_common import forward
    from gdn_dispatch.warmup_plan import specialization_keys

    call = random_call(lengths=[4096], H=1, HV=32, K=128, V=128, seed=1, state_layout="vk")
    problem = make_problem(**call, output_final_state=True)
    device = assumed_device("sm_90")
    passes = ("wy_fwd", "segment_map_fwd", "state_output_fwd")
    warm_routes(False)
    assert forward.plan_call(problem, device).kernels == passes
    warm_routes(True)
    planned = forward.plan_call(problem, device)
    cp = planned.context_parallel
    assert cp.chained and planned.kernels == ("fused_fwd",) and planned.segment_map is None
    two = planned.state_output
    plain = fused.plan_fused(problem, device, engine=_engine())
    assert two.constexprs == {**plain.constexprs, "CHAIN": True}
    assert two.grid == (cp.num_segments * 32,) and "forgetting suffix" in two.notes
    assert forward.plan_call(problem, assumed_device("sm_100")).kernels == passes
    keys = {(key[1][0], dict(key[1][3]).get("CHAIN")) for key in specialization_keys("gluon_sm90", problem, device)}
    assert keys == {("fused_fwd", True)}


@pytest.mark.slow
@pytest.mark.parametrize("l2", [False, True], ids=["plain", "l2"])
def test_the_chain_build_compiles_for_sm90a(l2):
    """The chained build of the base case (with the qk l2 norm on chip too): within the
    one-kernel build's spill allowance, every wgmma pipelined, its shared memory the plan's,
    the ticket and the hand-over's acquire and release in its PTX."""
    import functools

    sys.path.insert(0, str(Path(__file__).parent))
    from test_gluon_aot import SM90 as AOT_SM90, compile_kernel

    from gdn_dispatch.backends.gluon_common.fused_aot import BASE_CASE, fused_aot_kernels

    plan = functools.partial(fused.plan_fused, chain=True)
    (kernel,) = fused_aot_kernels([{**BASE_CASE, "l2": l2}], AOT_SM90, "gluon_sm90", engine=_engine(),
                                  plan_fused=plan, fn=fused._fused_fwd_kernel,
                                  spill_bytes_allowed=fused.aux_t_spill_bytes(fused.STATE_SCORES))
    assert kernel.constexprs["CHAIN"] is True
    report = compile_kernel(kernel, AOT_SM90)
    assert report.spill_bytes <= kernel.spill_bytes_allowed
    assert not report.wgmma_serialized
    ptx = report.ptx
    # The ticket (acq_rel), the wait for a hand-over (an acquire load: Triton's form of an
    # acquiring add of 0) and the hand-over's count (release; a reduction where its result
    # is unused, as triton 3.9 emits it).
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert "ld.global.gpu.acquire" in ptx
    assert "atom.global.gpu.release.add" in ptx or "red.global.gpu.release.add" in ptx


# --- on the GPU --------------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != SM90,
                                reason="needs an sm_90 GPU")


def _gates(call: dict, per_head: list[float]) -> dict:
    """v-head h's gates scaled by ``per_head[h % len(per_head)]``: 0.002 keeps a state alive
    through the warm-up window (about -6 bits over its 2048 tokens: hand-overs), 40 makes
    each chunk forget (the warm-up of one chunk), 0.25 forgets in about three chunks."""
    HV = call["g"].shape[-1]
    scale = torch.tensor([per_head[h % len(per_head)] for h in range(HV)], dtype=call["g"].dtype,
                         device=call["g"].device)
    return {**call, "g": call["g"] * scale}


def _launch(problem, chain: bool):
    from gdn_dispatch.device import default_probe

    return fused.plan_fused(problem, default_probe().for_torch_device(problem.device), engine=_engine(), chain=chain)


def _plain(problem):
    """``problem`` through the unsegmented one-kernel build (one program per sequence and
    v-head), o poisoned; returns (o, final state)."""
    stand_in = torch.empty(1, device=problem.device)
    poison_cuda_allocator()
    return fused.fused_fwd(problem, stand_in, stand_in, _launch(problem, False))


def _chained(problem, seg_len: int):
    """``problem`` through the chained build over segments of ``seg_len`` tokens, o and the
    hand-over buffer poisoned; returns (o, final state, the counts and the ticket)."""
    launch = _launch(problem, True)
    NSEG = problem.B * problem.T // seg_len + problem.N
    hand = torch.full((NSEG * problem.HV, problem.K, problem.V), float("nan"), device=problem.device)
    flags = torch.full((NSEG * problem.HV + 1,), -(2 ** 30), dtype=torch.int32, device=problem.device)
    stand_in = torch.empty(1, device=problem.device)
    poison_cuda_allocator()
    o, ht = fused.fused_fwd(problem, stand_in, stand_in, launch, chain=(hand, flags, seg_len, NSEG))
    return o, ht, flags


CASES = [
    # (lengths, dtype, segment length, gate factors per v-head, layout, initial state, l2, pool)
    pytest.param([3000, 0, 1, 64, 700, 4097], torch.bfloat16, 256, [0.002, 40.0], "kv", True, False, None,
                 id="ragged-bf16-kv-mixed"),
    pytest.param([3000, 0, 1, 64, 700, 4097], torch.bfloat16, 256, [40.0], "vk", True, False, None,
                 id="ragged-bf16-vk-forget"),
    pytest.param([3000, 0, 1, 64, 700, 4097], torch.float16, 256, [0.002], "kv", False, False, None,
                 id="ragged-fp16-kv-kept-no-h0"),
    pytest.param([2048, 2048, 2048], torch.bfloat16, 512, [40.0, 0.002], "kv", True, True, None,
                 id="uniform-bf16-l2-mixed"),
    # About -18 bits a chunk: suffixes of three chunks.
    pytest.param([5000, 0, 333], torch.bfloat16, 1024, [0.25, 0.002], "vk", True, False, torch.bfloat16,
                 id="pool-bf16-vk-slow-forget"),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("lengths, dtype, L, factors, layout, h0, l2, pool", CASES)
def test_warm_chain_matches_the_reference(lengths, dtype, L, factors, layout, h0, l2, pool):
    call = _gates(random_call(lengths=lengths, H=2, HV=4, K=128, V=128, dtype=dtype, device="cuda", seed=3,
                              initial_state=h0, state_layout=layout, normalize_qk=not l2), factors)
    flags = dict(use_qk_l2norm_in_kernel=l2, output_final_state=True)
    extra, ref_call = {}, dict(call)
    if pool is not None:
        call, extra, ref_call = pooled_call(call, pool)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in ref_call.items()}
    o_ref, ht_ref = chunk_gated_delta_rule(**cpu, **flags, backend="reference")
    off_call = {**call, "initial_state": call["initial_state"].clone()} if pool is not None else call
    o_off, ht_off = _plain(make_problem(**off_call, **flags, **extra, backend="gluon_sm90"))
    problem = make_problem(**call, **flags, **extra, backend="gluon_sm90")
    o, ht, counts = _chained(problem, L)
    torch.cuda.synchronize()
    assert rel_rms_error(o.float().cpu(), o_ref.float()) < 5e-3
    assert rel_rms_error(ht.float().cpu(), ht_ref.float()) < 5e-3
    if pool is not None:
        # The pool rows written back in place (the final states in the pool's dtype).
        live = extra["state_indices"] >= 0
        rows = extra["state_indices"][live].long()
        assert rel_rms_error(call["initial_state"][rows].float().cpu(), ht_ref[live.cpu()].float()) < 5e-3
    NSEG = problem.B * problem.T // L + problem.N
    HV = problem.HV
    assert counts[NSEG * HV].item() == NSEG * HV, "every ticket taken once"
    # A hand-over from every slot but its sequence's last one (counts zeroed by the call).
    last = {(int(problem.chunks.cu_seqlens[n + 1]) // L + n) for n in range(problem.N)}
    handed = [0 if slot in last else 1 for slot in range(NSEG) for _ in range(HV)]
    assert counts[:NSEG * HV].tolist() == handed
    if max(factors) <= 0.002:
        # Nothing forgets within the window: the same chunk steps as the unsegmented kernel,
        # the state handed over in float32.
        assert torch.equal(o, o_off) and torch.equal(ht, ht_off)
    else:
        assert rel_rms_error(o.float(), o_off.float()) < 2e-3
        assert rel_rms_error(ht.float(), ht_off.float()) < 2e-3


@pytest.mark.gpu
@needs_sm90
def test_the_warm_up_window_bounds_what_a_segment_walks_again():
    """At -0.02 bits a token (0.014 nats) a suffix needs 31 chunks to forget: inside the
    window of :data:`WARM_CHUNKS` chunks, so each segment of 32 chunks walks 31 again."""
    assert WARM_CHUNKS.value * 64 >= 2048
    call = random_call(lengths=[8192], H=1, HV=2, K=128, V=128, device="cuda", seed=4)
    call = {**call, "g": torch.full_like(call["g"], -0.014)}
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in call.items()}
    o_ref, ht_ref = chunk_gated_delta_rule(**cpu, output_final_state=True, backend="reference")
    o, ht, _ = _chained(make_problem(**call, output_final_state=True, backend="gluon_sm90"), 2048)
    assert rel_rms_error(o.float().cpu(), o_ref.float()) < 5e-3
    assert rel_rms_error(ht.float().cpu(), ht_ref.float()) < 5e-3


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("factors", [[40.0, 0.002], [0.002]], ids=["mixed", "kept"])
def test_the_public_call_on_the_warm_chain(factors, warm_routes):
    """The public call routed to the warm chain (a chained plan on the one-kernel build)
    against the reference, with the final state, its buffers poisoned first."""
    from gdn_dispatch.backends.gluon_common import forward
    from gdn_dispatch.device import default_probe

    warm_routes(True)
    # 3 x 16 v-heads x 2 V-blocks = 96 programs: inside the chained band (chain_fill = 1).
    call = _gates(random_call(lengths=[4096, 100, 2000], H=1, HV=16, K=128, V=128, device="cuda", seed=8),
                  factors)
    problem = make_problem(**call, output_final_state=True, backend="gluon_sm90")
    planned = forward.plan_call(problem, default_probe().for_torch_device(problem.device))
    assert planned.context_parallel.chained and planned.kernels == ("fused_fwd",)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in call.items()}
    o_ref, ht_ref = chunk_gated_delta_rule(**cpu, output_final_state=True, backend="reference")
    poison_cuda_allocator()
    o, ht = chunk_gated_delta_rule(**call, output_final_state=True, backend="gluon_sm90")
    assert rel_rms_error(o.float().cpu(), o_ref.float()) < 5e-3
    assert rel_rms_error(ht.float().cpu(), ht_ref.float()) < 5e-3


# --- picked on the device: the census, then the warm chain or the pipeline ------------------

@pytest.fixture
def picked_routes(monkeypatch):
    """The automatic rule's picked band over every program count below the SMs, for any
    sequence long enough for two chained segments; plans computed afresh."""
    from gdn_dispatch import context_parallel as cp_module
    from gdn_dispatch.context_parallel import CPTuning

    monkeypatch.setattr(cp_module, "TUNING", CPTuning(fill=0.0, pick_fill=1.0, pick_min_chunks=1))
    clear_plan_cache()
    yield
    clear_plan_cache()


@pytest.mark.parametrize("l2, dtype", [(False, torch.bfloat16), (True, torch.bfloat16), (True, torch.float16)],
                         ids=["plain", "l2-bf16", "l2-fp16"])
def test_a_picked_call_launches_the_census_both_plans_and_the_copies_once(l2, dtype, monkeypatch, request):
    """A 16/32-head call of 32768 tokens on the H200, "off" by default, is picked on the
    device under a tuning that asks for picked plans (``PICKING``): the census and
    the warm chain, then the pipeline, every launch ``PICK`` but the normalized copies (run
    once, read by both); its warm-up keys hold both plans'; sm_100 (no warm chain routed)
    and a class whose warm chain is off run "off"."""
    from gdn_dispatch import context_parallel as cp_module
    from gdn_dispatch.backends.gluon_common import forward, warm_chain
    from gdn_dispatch.warmup_plan import specialization_keys

    clear_plan_cache()
    call = random_call(lengths=[32768], H=16, HV=32, K=128, V=128, dtype=dtype, seed=1)
    problem = make_problem(**call, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    device = assumed_device("sm_90")
    assert not forward.plan_call(problem, device).context_parallel.enabled  # the default tuning
    monkeypatch.setattr(cp_module, "TUNING", cp_module.PICKING)
    request.addfinalizer(clear_plan_cache)
    clear_plan_cache()
    planned = forward.plan_call(problem, device)
    cp = planned.context_parallel
    assert cp.picked and cp.seg_len == 8192 and cp.num_segments == 5
    copies = ("qk_l2norm_fwd",) if dtype == torch.float16 else ()
    rnorm = ("qk_rnorm_fwd",) if l2 and dtype == torch.bfloat16 else ()
    assert planned.kernels == (*copies, "warm_census", "fused_fwd", "wy_fwd", *rnorm, "state_output_fwd")
    stages = (*planned.launches.stages, *planned.pipeline.stages)
    assert all(s.constexprs.get("PICK", False) is (s.kernel not in ("qk_l2norm_fwd", "warm_census")) for s in stages)
    census = planned.launches.stage("warm_census")
    assert census.grid == (5 * 32,) and census.constexprs["UNIT_KEYS"] is (l2 and dtype == torch.bfloat16)
    assert planned.launches.stage("fused_fwd").constexprs["CHAIN"] is True
    # The pipeline's state kernel over the call's own sequence (not the slots).
    assert planned.pipeline.stage("state_output_fwd").num_seqs == 1
    keys = {key[1][0] for key in specialization_keys("gluon_sm90", problem, device)}
    assert keys == {*copies, "warm_census", "fused_fwd", "wy_fwd", *rnorm, "state_output_fwd"}
    off = forward.plan_call(problem, assumed_device("sm_100"))
    assert not off.context_parallel.enabled and "picked segments need" in off.context_parallel.reason
    assert off.pipeline is None and "warm_census" not in off.kernels
    warm_chain.WARM_CHAIN = False
    try:
        clear_plan_cache()
        assert not forward.plan_call(problem, device).context_parallel.enabled
    finally:
        warm_chain.WARM_CHAIN = True
        clear_plan_cache()


def test_a_picked_plan_and_its_pick_word_go_together(monkeypatch, request):
    from gdn_dispatch import context_parallel as cp_module
    from gdn_dispatch.backends.gluon_common import forward

    monkeypatch.setattr(cp_module, "TUNING", cp_module.PICKING)
    request.addfinalizer(clear_plan_cache)
    clear_plan_cache()
    call = random_call(lengths=[32768], H=16, HV=32, K=128, V=128, seed=1)
    problem = make_problem(**call, output_final_state=True)
    planned = forward.plan_call(problem, assumed_device("sm_90"))
    from gdn_dispatch.backends.gluon_common.state_output import state_output_fwd
    from gdn_dispatch.backends.gluon_common.wy import wy_fwd

    with pytest.raises(ValueError, match="a PICK plan needs the pick word"):
        wy_fwd(problem.k, problem.v, problem.g, problem.beta, problem.chunks, planned.pipeline.stage("wy_fwd"))
    with pytest.raises(ValueError, match="a PICK plan needs the pick word"):
        state_output_fwd(problem.q, problem.k, problem.k, problem.v, problem.g, problem.chunks,
                         planned.pipeline.stage("state_output_fwd"), scale=1.0)


@pytest.mark.slow
def test_the_picked_launches_compile_for_sm90a():
    """The census (keys read and on chip) and the ``PICK`` builds of the warm chain, wy, the
    state kernel and the reciprocal norms compile for sm_90a, each within its plain build's
    spills; the census's count is an atomic add."""
    import dataclasses
    import functools

    sys.path.insert(0, str(Path(__file__).parent))
    from test_gluon_aot import SM90 as AOT_SM90, compile_kernel

    from gdn_dispatch.aot import AotKernel
    from gdn_dispatch.backends.gluon_common import qk_norm, state_output, warm_chain, wy
    from gdn_dispatch.backends.gluon_common.fused_aot import BASE_CASE, fused_aot_kernels
    from gdn_dispatch.backends.gluon_common.launch_plan import pointer_attrs

    def picked(kernel, pointer):
        return dataclasses.replace(kernel, constexprs={**kernel.constexprs, "PICK": True},
                                   signature={**kernel.signature, pointer: "*i32"})

    plan = functools.partial(fused.plan_fused, chain=True)
    (chain,) = fused_aot_kernels([BASE_CASE], AOT_SM90, "gluon_sm90", engine=_engine(), plan_fused=plan,
                                 fn=fused._fused_fwd_kernel,
                                 spill_bytes_allowed=fused.aux_t_spill_bytes(fused.STATE_SCORES))
    plain = [chain,
             next(k for k in wy.wy_kernels_for_aot(AOT_SM90, engine=_engine()) if k.specialization.startswith("K128-V128")),
             next(k for k in state_output.state_output_kernels_for_aot(AOT_SM90, "gluon_sm90", engine=_engine())
                  if k.constexprs.get("USE_L2NORM") is False),
             next(k for k in qk_norm.qk_norm_kernels_for_aot(AOT_SM90, "gluon_sm90") if k.kernel == "qk_rnorm_fwd")]
    pointers = {"fused_fwd": "chain_flags", "wy_fwd": "pick", "state_output_fwd": "chain_flags",
                "qk_rnorm_fwd": "pick"}
    for kernel in plain:
        report = compile_kernel(picked(kernel, pointers[kernel.kernel]), AOT_SM90)
        assert report.spill_bytes <= max(kernel.spill_bytes_allowed, compile_kernel(kernel, AOT_SM90).spill_bytes)
    fn = warm_chain._warm_census_kernel
    for unit in (False, True):
        signature = dict(g="*fp32", beta="*bf16", k_ptr="*bf16", cu_seqlens="*i32", chain_flags="*i32", s_g="i32",
                         s_beta="i32", s_k="i32", N="i32", L="i32", NSEG="i32", HV="i32", GROUP="i32",
                         K="constexpr", BT="constexpr", UNIT_KEYS="constexpr")
        census = AotKernel(backend="gluon_sm90", kernel="warm_census", specialization=f"unit-{unit}", fn=fn,
                           signature=signature, constexprs={"K": 128, "BT": 64, "UNIT_KEYS": unit}, dialect="gluon",
                           num_warps=4, attrs=pointer_attrs(fn, ["g", "beta", "k_ptr", "cu_seqlens", "chain_flags"]))
        report = compile_kernel(census, AOT_SM90)
        assert report.spill_bytes == 0
        assert "atom.global" in report.ptx or "red.global" in report.ptx


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("factors, warm", [([40.0], True), ([0.002], False), ([40.0, 0.002], False),
                                           ([0.25], True)], ids=["forget", "kept", "mixed", "slow-forget"])
@pytest.mark.parametrize("l2, dtype, pool", [(False, torch.bfloat16, None), (True, torch.bfloat16, torch.float32),
                                             (True, torch.float16, torch.bfloat16)],
                         ids=["bf16", "l2-bf16-pool", "l2-fp16-bf16-pool"])
def test_a_picked_call_matches_the_reference(factors, warm, l2, dtype, pool, picked_routes):
    """The public call under a picked plan against the reference, its buffers poisoned
    first, a pool written back in place: the census counts no waiting segment where every
    gate forgets within the window (the warm chain runs) and some where one does not (the
    pipeline runs); either way the result is the call's."""
    from gdn_dispatch.backends.gluon_common import forward
    from gdn_dispatch.backends.gluon_common.warm_chain import warm_census_fwd
    from gdn_dispatch.device import default_probe

    lengths = [3000, 0, 4097, 700]
    call = _gates(random_call(lengths=lengths, H=2, HV=4, K=128, V=128, dtype=dtype, device="cuda", seed=5,
                              initial_state=True, normalize_qk=not l2), factors)
    extra, ref_call = {}, dict(call)
    if pool is not None:
        call, extra, ref_call = pooled_call(call, pool)
    flags = dict(use_qk_l2norm_in_kernel=l2, output_final_state=True)
    problem = make_problem(**call, **flags, **extra, backend="gluon_sm90")
    planned = forward.plan_call(problem, default_probe().for_torch_device(problem.device))
    cp = planned.context_parallel
    assert cp.picked and planned.pipeline is not None, cp.describe()
    # The census alone, on the keys the chain reads: 0 where every segment warms up.
    census = planned.launches.stage("warm_census")
    k = problem.k
    if census.constexprs["UNIT_KEYS"] is False and l2:
        k = torch.nn.functional.normalize(k.float(), dim=-1).to(k.dtype)
    counts = torch.zeros(cp.num_segments * 4 + 2, dtype=torch.int32, device="cuda")
    word = warm_census_fwd(problem.g, problem.beta, k, problem.chunks.cu_seqlens, problem.N, cp.seg_len,
                           cp.num_segments, counts, census)
    assert (word.item() == 0) == warm, word.item()
    cpu = {k_: v.cpu() if torch.is_tensor(v) else v for k_, v in ref_call.items()}
    o_ref, ht_ref = chunk_gated_delta_rule(**cpu, **flags, backend="reference")
    poison_cuda_allocator()
    o, ht = chunk_gated_delta_rule(**call, **flags, **extra, backend="gluon_sm90")
    torch.cuda.synchronize()
    assert rel_rms_error(o.float().cpu(), o_ref.float()) < 5e-3
    assert rel_rms_error(ht.float().cpu(), ht_ref.float()) < 5e-3
    if pool is not None:
        live = extra["state_indices"] >= 0
        got = call["initial_state"][extra["state_indices"][live].long()].float().cpu()
        assert rel_rms_error(got, ht_ref[live.cpu()].float()) < 5e-3
