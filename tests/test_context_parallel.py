"""Context parallelism: the planner, the argument through the contract and the op, its
line in ``explain``, and the segmented math (the float32 reference's segment maps and scan)
against the unsegmented computation."""

from __future__ import annotations

import pytest
import torch

from gdn_dispatch import GDNInputError, chunk_gated_delta_rule, reference
from gdn_dispatch.context_parallel import (CPTuning, auto_segment_chunks, context_parallel_reason,
                                           plan_context_parallel, plan_for_problem)
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import assumed_device
from gdn_dispatch.op import context_parallel_arg, context_parallel_str
from gdn_dispatch.registry import CallSpec, call_reason, explain, load_registry
from gdn_dispatch.testing import random_call, rel_rms_error

H200_SMS = 132


# --- the planner ----------------------------------------------------------------------------

def _auto(**over):
    args = dict(T_total=32768, N=1, HV=4, V=128, sm_count=H200_SMS, max_len=32768)
    args.update(over)
    return plan_context_parallel("auto", **args)


def test_auto_turns_on_for_a_long_prompt_on_few_heads():
    plan = _auto()
    # 3 * sqrt(4 * 512 / 132) = 11.8 -> 2^round(3.56) = 16 chunks of 64 tokens.
    assert plan.enabled and plan.seg_len == 1024
    assert plan.num_segments == 32768 // 1024 + 1
    assert "8 programs < 132 SMs" in plan.reason


def test_auto_stays_off_when_the_heads_fill_the_device():
    plan = _auto(N=8, HV=32, T_total=8 * 4096, max_len=4096)
    assert not plan.enabled and "512 programs fill 132 SMs" in plan.reason


def test_auto_stays_off_for_short_sequences_and_without_sms():
    short = _auto(T_total=900, max_len=900)
    assert not short.enabled and "15 chunks < 16" in short.reason
    assert not _auto(sm_count=0).enabled
    assert "no tokens" in _auto(T_total=0, max_len=0).reason
    # Two segments at least: 24 chunks against segments of 16 (3 * sqrt(100 * 24 / 132) = 12.8).
    two = _auto(T_total=24 * 64, max_len=24 * 64, HV=100, V=64)
    assert not two.enabled and "fewer than 2 segments" in two.reason


def test_auto_without_a_host_copy_uses_the_mean_length():
    plan = _auto(N=4, T_total=4 * 8192, max_len=None)
    assert plan.enabled and "mean sequence of 128 chunks" in plan.reason
    assert plan.num_segments == 4 * 8192 // plan.seg_len + 4


def test_segment_rule_and_its_constants():
    assert auto_segment_chunks(1, 32, 512, 132) == 32
    assert auto_segment_chunks(1, 1, 16, 132) == 4  # the floor
    assert auto_segment_chunks(1, 1, 16, 132, CPTuning(min_seg_chunks=2)) == 2
    assert _auto(sm_count=1000).seg_len == 256  # 3 * sqrt(4 * 512 / 1000) = 4.3 -> 4 chunks
    assert not _auto(HV=4, sm_count=4, V=64).enabled  # 4 programs fill 4 SMs


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
