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
from gdn_dispatch.testing import padded_pool, poison_cuda_allocator, random_call, rel_rms_error  # noqa: E402

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
        N, dims = len(lengths), tuple(call["initial_state"].shape[2:])
        rows, idx, ref_call["initial_state"] = padded_pool(N, call["v"].shape[2], dims, pool, seed=9, device="cuda")
        extra = dict(state_indices=idx, inplace_final_state=True)
        call = {**call, "initial_state": rows}
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
