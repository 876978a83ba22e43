"""Chained segments (context parallelism without segment maps or a scan): the planner's
band, the Gluon dry run, and the chained pass 2 against the unsegmented call and the
reference, every buffer poisoned first (triton_generic under the interpreter; both
backends on a GPU)."""

from __future__ import annotations

import importlib

import pytest
import torch

from gdn_dispatch import chunk_gated_delta_rule, reference
from gdn_dispatch import context_parallel as cp_module
from gdn_dispatch.context_parallel import CPPlan, CPTuning, plan_context_parallel
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import assumed_device
from gdn_dispatch.registry import CallSpec, explain
from gdn_dispatch.testing import pooled_call, random_call, rel_rms_error

from gdn_dispatch.backends.gluon_common import state_output as so
from gdn_dispatch.backends.gluon_common.state_output import state_output_config
from gdn_dispatch.backends.triton_generic.configs import state_config

TG_FORWARD = importlib.import_module("gdn_dispatch.backends.triton_generic.forward")
GLUON_FORWARD = importlib.import_module("gdn_dispatch.backends.gluon_common.forward")
H200_SMS = 132
CHAIN = CPTuning(chain_fill=1.0)


# --- the planner ----------------------------------------------------------------------------

def _auto(tuning=CHAIN, **over):
    args = dict(T_total=32768, N=1, HV=32, V=128, sm_count=H200_SMS, max_len=32768)
    args.update(over)
    return plan_context_parallel("auto", tuning=tuning, **args)


def test_the_chain_band_is_empty_by_default():
    # And the picked band too: the call runs "off" unless a caller's tuning asks for a plan
    # the device picks (chained only where it finds that every segment warms up).
    plan = _auto(tuning=None)
    assert not plan.enabled and not plan.chained
    assert cp_module.TUNING.chain_fill == 0.0 and cp_module.TUNING.pick_fill == 0.0
    picked = _auto(tuning=cp_module.PICKING)
    assert picked.chained and picked.picked


def test_chained_segments_between_a_quarter_of_the_sms_and_chain_fill():
    # 32 v-heads x 2 V blocks = 64 programs: 2^round(log2(2 x 132 / 64)) = 4 segments of
    # 512 / 4 = 128 chunks.
    plan = _auto()
    assert plan.enabled and plan.chained and plan.seg_len == 128 * 64
    assert plan.num_segments == 32768 // 8192 + 1
    assert "64 programs in [0.25, 1) x 132 SMs" in plan.reason
    assert plan.describe().startswith("on, chained segments of 8192 tokens")
    # More waves, more segments; never fewer than 2, never under min_seg_chunks chunks.
    assert _auto(tuning=CPTuning(chain_fill=1.0, chain_waves=4.0)).seg_len == 64 * 64
    assert _auto(tuning=CPTuning(chain_fill=1.0, chain_waves=0.5)).num_segments == 2 + 1
    short = _auto(T_total=7 * 64, max_len=7 * 64)
    assert not short.enabled and "fewer than 2 chained segments of 4" in short.reason
    # Outside the band: below a quarter of the SMs the mapped segments, at chain_fill the
    # heads fill the device.
    below = _auto(HV=4)
    assert below.enabled and not below.chained
    assert not _auto(N=3, HV=32, T_total=3 * 32768, max_len=32768).enabled  # 192 programs >= 132


def test_forced_counts_stay_mapped():
    plan = plan_context_parallel(4, T_total=32768, N=1, HV=32, V=128, sm_count=H200_SMS, max_len=32768,
                                 tuning=CHAIN)
    assert plan.enabled and not plan.chained


def _band_call(seed: int) -> dict:
    """One 4096-token sequence on 32 v-heads of 128 columns: 64 programs, between a quarter
    of the H200's SMs and all of them."""
    return random_call(lengths=[4096], H=1, HV=32, K=128, V=128, dtype=torch.bfloat16, seed=seed)


def test_plans_read_the_replaced_tuning(monkeypatch):
    problem = make_problem(**_band_call(0), backend="triton_generic")
    # 64 chunks: too short for a picked plan.
    assert not cp_module.plan_for_problem(problem, H200_SMS).enabled
    monkeypatch.setattr(cp_module, "TUNING", CHAIN)
    plan = cp_module.plan_for_problem(problem, H200_SMS)
    assert plan.chained and not plan.picked and plan.seg_len == 1024


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_gluon_plan_call_runs_chained_segments(arch, monkeypatch):
    """The dry run of a chained call on the pipeline (the warm chain off, as for a class
    without the one-kernel build): wy, pass 1 with N's blocks alone, and the fused kernel
    in the unsegmented call's configuration with the call's own state flags (a "vk" pool
    written back in place, the final state) over the segment slots; no scan."""
    monkeypatch.setattr(cp_module, "TUNING", CHAIN)
    _pipeline_chain(monkeypatch)
    call = random_call(lengths=[4096], H=1, HV=32, K=128, V=128, dtype=torch.bfloat16, seed=1, state_layout="vk")
    idx = torch.tensor([0], dtype=torch.int32)
    problem = make_problem(**call, output_final_state=True, state_indices=idx, inplace_final_state=True)
    device = assumed_device(arch)
    planned = GLUON_FORWARD.plan_call(problem, device)
    cp = planned.context_parallel
    assert cp.chained and cp.seg_len == 1024 and cp.num_segments == 4096 // 1024 + 1
    assert planned.kernels == ("wy_fwd", "segment_map_fwd", "state_output_fwd")
    one = planned.segment_map
    assert one.constexprs["CHAIN"] and one.grid[0] == cp.num_segments * 32 * 128 // one.blocks["BC"]
    two = planned.state_output
    unsegmented = GLUON_FORWARD.plan_call(make_problem(**call, output_final_state=True, state_indices=idx,
                                                       inplace_final_state=True, context_parallel="off"), device)
    base = unsegmented.state_output
    # The one-warpgroup walk in the call's configuration and ring slots (with its own o
    # deferral and shared memory where the call's plan walks warp-specialized).
    assert {**two.blocks, "smem_bytes": 0} == {**base.blocks, "smem_bytes": 0} and two.num_warps == base.num_warps
    assert two.blocks["smem_bytes"] == so.state_output_smem_bytes(128, two.blocks["BV"], 2,
                                                                  slots=two.constexprs["NUM_BUF"])
    assert two.grid[0] == cp.num_segments * 32 * two.blocks["NV"]
    assert two.constexprs == {**base.constexprs, "CHAIN": True, "WS": False,
                              "DEFER_OUT": so.state_output_defers(128, two.blocks["BV"], arch == "sm_100",
                                                                  two.num_warps)}
    assert "warp-specialized" not in two.notes
    flags = two.constexprs
    assert (flags["USE_H0"], flags["STORE_HT"], flags["STATE_VK"], flags["USE_POOL"], flags["INPLACE"]) == \
        (True, True, True, True, True)
    assert not base.constexprs["CHAIN"]


def test_explain_names_chained_segments(monkeypatch):
    monkeypatch.setattr(cp_module, "TUNING", CHAIN)
    problem = make_problem(**_band_call(2))
    text = explain(assumed_device("sm_90"), CallSpec.from_problem(problem), problem=problem).format()
    assert "context parallel: on, chained segments of 1024 tokens" in text, text


# --- triton_generic under the interpreter -----------------------------------------------------

def _gates(call: dict, per_head: list[float]) -> dict:
    """The call with v-head h's gates scaled by ``per_head[h % len(per_head)]``: small
    factors keep a state alive through every segment (hand-overs), large ones make
    segments forget their start (pass 1's N)."""
    HV = call["g"].shape[-1]
    scale = torch.tensor([per_head[h % len(per_head)] for h in range(HV)], dtype=call["g"].dtype,
                         device=call["g"].device)
    return {**call, "g": call["g"] * scale}


def _pipeline_chain(monkeypatch) -> None:
    """Chained plans on the pipeline's passes (pass 1, the chained fused kernel) in every
    Gluon class: the warm chain of the one-kernel build off (tests/test_warm_chain.py runs
    it), plans computed afresh."""
    from gdn_dispatch.backends.gluon_common import warm_chain
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache

    monkeypatch.setattr(warm_chain, "WARM_CHAIN", False)
    clear_plan_cache()


def _chained_plan(problem, seg_len: int) -> CPPlan:
    """Chained segments of ``seg_len`` tokens for ``problem``."""
    return CPPlan(enabled=True, seg_len=seg_len, num_segments=problem.B * problem.T // seg_len + problem.N,
                  reason="chained for the test", chained=True)


def _poisoning(call_buffers, seen: dict):
    """``call_buffers`` with every buffer it returns poisoned (floats NaN, integers -2^30),
    the last ones kept in ``seen["buffers"]``."""
    def poisoned(*args):
        out = call_buffers(*args)
        for t in out:
            if t is not None:
                t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2 ** 30))
        seen["buffers"] = out
        return out

    return poisoned


def _chained_run(problem, seg_len: int, monkeypatch, backend: str = "triton_generic"):
    """``problem`` through ``backend``'s forward on chained segments of ``seg_len`` tokens,
    every buffer of the call poisoned first; returns (o, final state, forgetting starts
    ``[NSEG, HV]``, hand-over counts and ticket)."""
    plan = _chained_plan(problem, seg_len)
    if backend != "triton_generic":
        _pipeline_chain(monkeypatch)
    module = TG_FORWARD if backend == "triton_generic" else GLUON_FORWARD
    entry = TG_FORWARD.forward if backend == "triton_generic" else \
        importlib.import_module(f"gdn_dispatch.backends.{backend}").forward
    seen = {}
    with monkeypatch.context() as patch:
        patch.setattr(module, "plan_for_problem", lambda p, sms: plan)
        patch.setattr(module, "call_buffers", _poisoning(module.call_buffers, seen))
        o, ht = entry(problem)
    f_start, flags = seen["buffers"][5:7]
    return o, ht, f_start, flags


CASES = [
    # (shape, dtype, segment length, gate factors per v-head, layout, initial state, l2, pool)
    pytest.param(dict(lengths=[300, 0, 1, 64, 128, 129, 700], H=2, HV=4, K=16, V=24), torch.float32, 128,
                 [0.02], "kv", True, False, None, id="ragged-fp32-kv-h0-kept"),
    pytest.param(dict(lengths=[300, 0, 1, 64, 128, 129, 700], H=2, HV=4, K=16, V=24), torch.float32, 128,
                 [0.02, 40.0], "kv", True, False, None, id="ragged-fp32-kv-h0-half-forget"),
    pytest.param(dict(lengths=[256, 255, 257], H=1, HV=2, K=32, V=32), torch.bfloat16, 64, [0.1, 40.0], "vk",
                 True, True, None, id="tails-bf16-vk-l2"),
    pytest.param(dict(batch=(2, 200), H=1, HV=2, K=24, V=40), torch.float16, 64, [40.0, 0.1], "kv", False, False,
                 None, id="B2-fp16-no-h0"),
    pytest.param(dict(lengths=[190, 0, 70], H=1, HV=2, K=16, V=16), torch.bfloat16, 64, [0.1, 40.0], "vk", True,
                 False, torch.bfloat16, id="pool-bf16-vk"),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3, torch.float16: 5e-3}


@pytest.mark.parametrize("shape, dtype, L, factors, layout, h0, l2, pool", CASES)
def test_chained_segments_match_off_and_the_reference(shape, dtype, L, factors, layout, h0, l2, pool, monkeypatch):
    """Under the interpreter (programs run one after another in ticket order, so every
    hand-over is stored before it is read): o and the final state against the reference
    and against the unsegmented kernels; bit-equal to those where no segment forgets (the
    same chunk steps, the state handed over in float32); every flag counted and the ticket
    at the program count."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    call = _gates(random_call(**shape, dtype=dtype, seed=5, initial_state=h0, state_layout=layout,
                              normalize_qk=not l2), factors)
    flags = dict(use_qk_l2norm_in_kernel=l2, output_final_state=True)
    extra, ref_call, expected_pool = {}, dict(call), None
    if pool is not None:
        call, extra, ref_call = pooled_call(call, pool)
        expected_pool = call["initial_state"].clone()
    o_ref, ht_ref = reference.forward(make_problem(**ref_call, **flags, context_parallel="off"))
    off_call = {**call, "initial_state": call["initial_state"].clone()} if pool is not None else call
    o_off, ht_off = chunk_gated_delta_rule(**off_call, **flags, **extra, context_parallel="off",
                                           backend="triton_generic")
    problem = make_problem(**call, **flags, **extra, backend="triton_generic")
    o, ht, f_start, counts = _chained_run(problem, L, monkeypatch)

    assert rel_rms_error(o, o_ref) <= TOL[dtype] and rel_rms_error(ht, ht_ref) <= TOL[dtype]
    forgot = f_start >= 0
    HV, NSEG = problem.HV, f_start.numel() // problem.HV
    NV = -(-problem.V // state_config(problem.K, problem.V, problem.N * HV, problem.q.element_size(), None, 1).BV)
    assert counts.numel() == (NSEG + 1) * HV and counts.view(-1)[NSEG * HV].item() == NSEG * HV * NV
    if any(f > 1.0 for f in factors):
        assert forgot.any(), "no segment forgot: the gates do not exercise pass 1's N"
    if not forgot.any():
        assert torch.equal(o, o_off) and torch.equal(ht, ht_off)
    else:
        assert rel_rms_error(o, o_off) <= (1e-6 if dtype == torch.float32 else 2e-3)
        assert rel_rms_error(ht, ht_off) <= (1e-6 if dtype == torch.float32 else 2e-3)
    # Hand-over counts: NV for each (slot, v-head) that handed its state on (not forgetting,
    # not its sequence's last slot), else still 0.
    handed = (~forgot.view(NSEG, HV)) & ~_last_slots(problem, L)[:, None]
    assert torch.equal(counts.view(-1)[:NSEG * HV].view(NSEG, HV), handed.to(torch.int32) * NV)
    if pool is not None:
        live = extra["state_indices"] >= 0
        expected_pool[extra["state_indices"][live].long()] = ht_ref[live].to(pool)
        assert rel_rms_error(call["initial_state"], expected_pool) <= TOL[dtype]


def _last_slots(problem, L: int) -> torch.Tensor:
    """Whether each segment slot is its sequence's last (bool ``[NSEG]``)."""
    if problem.chunks.uniform:
        cu = [n * problem.T for n in range(problem.B + 1)]
    else:
        cu = problem.chunks.cu_seqlens.tolist()
    last = []
    for n, (bos, eos) in enumerate(zip(cu, cu[1:])):
        slots = eos // L - bos // L + 1
        last += [False] * (slots - 1) + [True]
    return torch.tensor(last)


def test_the_forward_runs_chained_segments_where_the_tuning_plans_them(monkeypatch):
    """The planner's band reaches the backend: with the interpreter's 1 "SM" (the forward
    without a registry selection) a 600-token sequence on 2 v-heads falls in [0.25,
    chain_fill) and runs as 2 chained segments."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(cp_module, "TUNING", CPTuning(chain_fill=8.0))
    call = random_call(lengths=[600], H=1, HV=2, K=16, V=16, dtype=torch.float32, seed=11, initial_state=True)
    problem = make_problem(**call, output_final_state=True, backend="triton_generic")
    plan = cp_module.plan_for_problem(problem, 1)
    assert plan.chained and plan.num_segments == 600 // plan.seg_len + 1 and plan.seg_len == 320
    launched = []
    real = TG_FORWARD.chained_fwd
    monkeypatch.setattr(TG_FORWARD, "chained_fwd", lambda *a, **kw: launched.append(1) or real(*a, **kw))
    o, ht = TG_FORWARD.forward(problem)
    o_off, ht_off = chunk_gated_delta_rule(**call, output_final_state=True, context_parallel="off",
                                           backend="triton_generic")
    assert launched == [1]
    assert rel_rms_error(o, o_off) <= 1e-6 and rel_rms_error(ht, ht_off) <= 1e-6


GPU_CASES = [
    # Gates that never forget: every segment waits for the one before; 17 slots x 32 heads x
    # 4 V blocks = 2176 programs, many more than the GPU holds at once (the ticket order).
    pytest.param(dict(lengths=[16384], H=16, HV=32), 1024, 1024.0, id="H16-HV32-1x16384-weak-L1024"),
    # The bench's gates: every segment forgets, none waits.
    pytest.param(dict(lengths=[32768], H=16, HV=32), 8192, 1.0, id="H16-HV32-1x32768-bench-L8192"),
    # Some segments forget, some hand over; ragged, empty and one-token sequences.
    pytest.param(dict(lengths=[9000, 0, 1, 64, 4097, 129, 700], H=2, HV=8), 1024, 16.0,
                 id="H2-HV8-varlen-crossover-L1024"),
]


GPU_BACKENDS = ["triton_generic"] + (
    ["gluon_sm90"] if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("shape, L, divisor", GPU_CASES)
def test_chained_segments_on_the_gpu(shape, L, divisor, backend, monkeypatch):
    """Compiled, with programs resident at once and waiting on each other's hand-overs:
    against the reference and the unsegmented kernels, with the counts and the ticket as
    the interpreter test checks them. Gates ``logsigmoid(randn) / divisor`` as
    benchmarks/cp_crossover.py draws them."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    call = random_call(**shape, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=3, state_layout="vk")
    gen = torch.Generator(device="cuda").manual_seed(4)
    call["g"] = torch.nn.functional.logsigmoid(torch.randn(call["g"].shape, device="cuda", generator=gen)) / divisor
    flags = dict(output_final_state=True)
    o_ref, ht_ref = reference.forward(make_problem(**call, **flags, context_parallel="off"))
    o_off, ht_off = chunk_gated_delta_rule(**call, **flags, context_parallel="off", backend=backend)
    problem = make_problem(**call, **flags, backend=backend)
    for _ in range(2):  # a second call on fresh buffers: nothing carried over
        o, ht, f_start, counts = _chained_run(problem, L, monkeypatch, backend)
        assert rel_rms_error(o, o_ref) <= 5e-3 and rel_rms_error(ht, ht_ref) <= 5e-3
        assert rel_rms_error(o, o_off) <= 2e-3 and rel_rms_error(ht, ht_off) <= 1e-4
        HV, NSEG = problem.HV, f_start.numel() // problem.HV
        sms = torch.cuda.get_device_properties(0).multi_processor_count  # the forward's, without a selection
        if backend == "triton_generic":
            BV = state_config(problem.K, problem.V, problem.N * HV, 2, torch.cuda.get_device_capability(), sms).BV
        else:
            BV = state_output_config(problem.K, problem.V, problem.N * HV, sms)[0]
        NV = -(-problem.V // BV)
        forgot = (f_start >= 0).view(NSEG, HV)
        if divisor >= 1024:
            assert not forgot.any()
        if divisor <= 1:
            assert forgot.any()
        handed = ~forgot & ~_last_slots(problem, L)[:, None].cuda()
        assert counts.view(-1)[NSEG * HV].item() == NSEG * HV * NV
        assert torch.equal(counts.view(-1)[:NSEG * HV].view(NSEG, HV), handed.to(torch.int32) * NV)


def test_warmup_keys_name_the_chained_kernels(monkeypatch):
    """A warm-up planned under a tuning that chains keeps the chained kernels' call (its
    keys differ from the unsegmented and the mapped segments')."""
    from gdn_dispatch.warmup_plan import specialization_keys

    problem = make_problem(**_band_call(3), output_final_state=True)
    device = assumed_device("sm_90")
    plain = {key[1][0] for key in specialization_keys("triton_generic", problem, device)}
    monkeypatch.setattr(cp_module, "TUNING", CHAIN)
    chained = {key[1][0] for key in specialization_keys("triton_generic", problem, device)}
    assert "state_fwd" in plain and "chained_state_fwd" not in plain
    assert {"chained_state_fwd", "forgetting_start", "segment_map_fwd"} <= chained
    assert not {"state_fwd", "segment_scan_fwd"} & chained


def test_gluon_warmup_keys_name_the_chained_launches(monkeypatch):
    """A Gluon warm-up planned under a tuning that chains keeps the chained launches: pass 1
    and the fused kernel with CHAIN on (the unsegmented call's fused kernel is not among
    them), and no scan (the pipeline's chain: the warm chain off)."""
    from gdn_dispatch.warmup_plan import specialization_keys

    _pipeline_chain(monkeypatch)

    problem = make_problem(**_band_call(4), output_final_state=True)
    device = assumed_device("sm_90")

    def launches():
        return {(key[1][0], dict(key[1][3]).get("CHAIN")) for key in specialization_keys("gluon_sm90", problem, device)}

    assert launches() == {("wy_fwd", None), ("state_output_fwd", False)}
    monkeypatch.setattr(cp_module, "TUNING", CHAIN)
    assert launches() == {("wy_fwd", None), ("segment_map_fwd", True), ("state_output_fwd", True)}


class _ChainedGluonStandIns:
    """The Gluon kernels of a chained call replaced by triton_generic's (the same math and
    the same hand-over protocol, under the interpreter), checking what the orchestrator
    hands them: the call's w, u, g_cum, the chain's buffers and counts, the call's own
    state flags."""

    def __init__(self):
        self.calls = []

    def wy_fwd(self, k, v, g, beta, chunks, launch, out=None):
        from gdn_dispatch.backends.triton_generic._jit import LOG2E
        from gdn_dispatch.backends.triton_generic.cumsum import chunk_cumsum_fwd
        from gdn_dispatch.backends.triton_generic.wu import wu_fwd

        self.calls.append("wy_fwd")
        g_cum = chunk_cumsum_fwd(g, chunks, scale=LOG2E)
        results = (*wu_fwd(k, v, g_cum, beta, chunks), g_cum)
        for buffer, result in zip(out, results):
            buffer.copy_(result)
        self.wy = tuple(out)
        return self.wy

    def segment_map_fwd(self, k, w, u, g_cum, beta, cu_seqlens, seg_len, launch, *, rnorm=None, chain=None,
                        out=None):
        from gdn_dispatch.backends.triton_generic.segment_map import segment_map_fwd

        self.calls.append("segment_map_fwd")
        assert all(a is b for a, b in zip((w, u, g_cum), self.wy)), "pass 1 must read the call's w, u, g_cum"
        assert launch.constexprs["CHAIN"] and chain is not None and out[1] is None and out[2] is None
        nseg = k.shape[0] * k.shape[1] // seg_len + cu_seqlens.shape[0] - 1
        # N's blocks alone: (segment slot, v-head, V block) programs.
        assert launch.grid_for(k.shape[0] * k.shape[1], nseg)[0] == nseg * u.shape[2] * u.shape[3] // \
            launch.blocks["BC"]
        self.chain = chain
        result = segment_map_fwd(k, w, u, g_cum, cu_seqlens, seg_len, beta=beta, f_start=chain[0],
                                 chain_flags=chain[1], out=out)
        self.seg_cu = result[0]
        return result

    def state_output_fwd(self, q, k, w, u, g_cum, chunks, launch, *, scale, initial_state=None,
                         output_final_state=False, rnorm=None, state_indices=None, chain=None, out=None):
        from gdn_dispatch.backends.triton_generic.context_parallel import segment_table
        from gdn_dispatch.backends.triton_generic.output import output_fwd
        from gdn_dispatch.backends.triton_generic.segment_chain import chained_state_fwd

        self.calls.append("state_output_fwd")
        flags = launch.constexprs
        assert all(a is b for a, b in zip((w, u, g_cum), self.wy)), "pass 2 must read the call's w, u, g_cum"
        hand, f_start, chain_flags, seg_len, nseg = chain
        assert flags["CHAIN"] and (f_start, chain_flags) == self.chain
        assert launch.grid_for(q.shape[0] * q.shape[1], nseg)[0] == nseg * u.shape[2] * launch.blocks["NV"]
        self.state_flags = (flags["USE_H0"], flags["STORE_HT"], flags["STATE_VK"], flags["USE_POOL"],
                            flags["INPLACE"])
        plan = CPPlan(enabled=True, seg_len=seg_len, num_segments=nseg, reason="stand-in", chained=True)
        segments = segment_table(chunks, q.shape[0] * q.shape[1], plan, self.seg_cu)
        h, v_new, ht = chained_state_fwd(
            k, w, u, g_cum, chunks.cu_seqlens, segments, seg_len, f_start, hand, chain_flags,
            initial_state=initial_state, output_final_state=output_final_state, state_vk=flags["STATE_VK"],
            state_indices=state_indices, inplace_final_state=flags["INPLACE"])
        o = output_fwd(q, k, v_new, h, g_cum, segments, scale=scale)
        out[0].copy_(o)
        if out[1] is not None:
            out[1].copy_(ht)
        return out


@pytest.mark.parametrize("layout, pool", [("kv", None), ("vk", torch.bfloat16)])
def test_gluon_chained_orchestration_matches_the_reference_on_cpu(layout, pool, monkeypatch):
    """The chained Gluon forward end to end on the CPU, its kernels stood in for by
    triton_generic's under the interpreter: one wy launch, pass 1 with the chain's buffers,
    pass 2 with the call's own state flags (the pool read and written in place), no scan;
    every buffer of the call poisoned first, the result against the reference."""
    from gdn_dispatch import native
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(native, "for_calls", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    _pipeline_chain(monkeypatch)
    stand_ins = _ChainedGluonStandIns()
    for name in ("wy_fwd", "segment_map_fwd", "state_output_fwd"):
        monkeypatch.setattr(GLUON_FORWARD, name, getattr(stand_ins, name))
    lengths = [300, 0, 1, 129, 250]
    call = _gates(random_call(lengths=lengths, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, seed=6,
                              state_layout=layout), [0.1, 40.0])
    flags, extra, ref_call = dict(output_final_state=True), {}, dict(call)
    if pool is not None:
        call, extra, ref_call = pooled_call(call, pool, seed=3)
        expected_pool = call["initial_state"].clone()
    o_ref, ht_ref = reference.forward(make_problem(**ref_call, **flags, context_parallel="off"))
    problem = make_problem(**call, **flags, **extra)
    plan = _chained_plan(problem, 128)
    monkeypatch.setattr(GLUON_FORWARD, "plan_for_problem", lambda p, sms: plan)
    monkeypatch.setattr(GLUON_FORWARD, "call_buffers", _poisoning(GLUON_FORWARD.call_buffers, {}))
    clear_plan_cache()
    o, ht = GLUON_FORWARD.forward(problem, assumed_device("sm_90"), engine=None)
    assert stand_ins.calls == ["wy_fwd", "segment_map_fwd", "state_output_fwd"]
    assert stand_ins.state_flags == (True, True, layout == "vk", pool is not None, pool is not None)
    f_start = stand_ins.chain[0]
    assert (f_start >= 0).any() and (f_start < 0).any()  # some segments forget, some hand over
    assert rel_rms_error(o, o_ref) <= TOL[torch.bfloat16] and rel_rms_error(ht, ht_ref) <= TOL[torch.bfloat16]
    if pool is not None:
        idx = extra["state_indices"]
        live = idx >= 0
        expected_pool[idx[live].long()] = ht_ref[live].to(pool)
        assert rel_rms_error(call["initial_state"], expected_pool) <= TOL[pool]
