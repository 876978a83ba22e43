"""The float32 oracle: per-token recurrence, chunked walk, and a two-token example by hand."""

import math

import pytest
import torch

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.contract import make_problem
from gdn_dispatch.reference import forward, forward_recurrent
from gdn_dispatch.testing import random_call, rel_rms_error

TOL = 1e-5  # both walks are float32; they differ only in summation order


def _hand_call(initial_state):
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.6, 0.8]]).reshape(1, 2, 1, 2)
    v = torch.tensor([[2.0], [1.0]]).reshape(1, 2, 1, 1)
    g = torch.full((1, 2, 1), math.log(0.5))
    beta = torch.tensor([0.5, 1.0]).reshape(1, 2, 1)
    return dict(q=q, k=k, v=v, g=g, beta=beta, scale=1.0, initial_state=initial_state, output_final_state=True)


@pytest.mark.parametrize("walk", [forward, forward_recurrent], ids=["chunked", "recurrent"])
@pytest.mark.parametrize(
    "h0, o_expected, s_expected",
    [
        # S0 = 0: u1 = 0.5 * 2 = 1, S = [1, 0]^T, o1 = 1; S *= 0.5, u2 = 1 - 0.3 = 0.7,
        # S = [0.5 + 0.42, 0.56]^T, o2 = 0.56.
        pytest.param(None, [1.0, 0.56], [0.92, 0.56], id="zero-state"),
        # S0 = [1, 1]^T: S = [.5, .5], u1 = .5 * (2 - .5) = .75, S = [1.25, .5], o1 = 1.25;
        # S = [.625, .25], u2 = 1 - .575 = .425, S = [.88, .59], o2 = .59.
        pytest.param(torch.ones(1, 1, 2, 1), [1.25, 0.59], [0.88, 0.59], id="unit-state"),
    ],
)
def test_two_tokens_by_hand(walk, h0, o_expected, s_expected):
    o, s = walk(make_problem(**_hand_call(h0)))
    torch.testing.assert_close(o.flatten(), torch.tensor(o_expected), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s.flatten(), torch.tensor(s_expected), rtol=1e-6, atol=1e-6)


CASES = [
    pytest.param(dict(lengths=[1, 63, 0, 64, 65, 130], H=2, HV=4), "kv", True, False, id="varlen-HV4-kv-h0"),
    pytest.param(dict(lengths=[130, 0, 1], H=2, HV=2), "vk", True, True, id="varlen-HV2-vk-h0-l2"),
    pytest.param(dict(batch=(2, 65), H=1, HV=1), "kv", False, True, id="B2-T65-HV1-kv-l2"),
    pytest.param(dict(batch=(1, 200), H=1, HV=4, K=24, V=40), "vk", True, False, id="T200-HV4-K24-V40-vk-h0"),
]


@pytest.mark.parametrize("shape, layout, h0, l2norm", CASES)
def test_chunked_matches_recurrent(shape, layout, h0, l2norm):
    call = random_call(**{"K": 16, "V": 8, **shape}, dtype=torch.float32, seed=7,
                       initial_state=h0, state_layout=layout, normalize_qk=not l2norm)
    problem = make_problem(**call, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    o_c, s_c = forward(problem)
    o_r, s_r = forward_recurrent(problem)
    assert rel_rms_error(o_c, o_r) <= TOL
    assert rel_rms_error(s_c, s_r) <= TOL
    assert s_c.shape == problem.state_shape and s_c.dtype == torch.float32


def test_zero_length_sequence_keeps_its_initial_state():
    call = random_call(lengths=[5, 0, 3], K=8, V=8, dtype=torch.float32, seed=3, state_layout="vk")
    _, s = chunk_gated_delta_rule(**call, output_final_state=True)
    torch.testing.assert_close(s[1], call["initial_state"][1])


def test_grouped_heads_read_their_qk_head():
    """HV = 4, H = 2: v-heads 0, 1 read q/k head 0 and v-heads 2, 3 read head 1."""
    call = random_call(batch=(1, 70), H=2, HV=4, K=8, V=8, dtype=torch.float32, seed=4)
    o, s = chunk_gated_delta_rule(**call, output_final_state=True)
    for j in range(4):
        one = dict(call)
        for name in ("q", "k"):
            one[name] = call[name][:, :, j // 2 : j // 2 + 1].contiguous()
        for name in ("v", "g", "beta"):
            one[name] = call[name][:, :, j : j + 1].contiguous()
        one["initial_state"] = call["initial_state"][:, j : j + 1].contiguous()
        o_j, s_j = chunk_gated_delta_rule(**one, output_final_state=True)
        torch.testing.assert_close(o[:, :, j : j + 1], o_j)
        torch.testing.assert_close(s[:, j : j + 1], s_j)


def test_uniform_batch_equals_packed_batch():
    call = random_call(batch=(3, 70), K=8, V=8, dtype=torch.float32, seed=5)
    o, s = chunk_gated_delta_rule(**call, output_final_state=True)
    packed = dict(call)
    for name in ("q", "k", "v", "g", "beta"):
        packed[name] = call[name].reshape(1, 210, *call[name].shape[2:])
    cu = torch.tensor([0, 70, 140, 210])
    o_p, s_p = chunk_gated_delta_rule(**packed, cu_seqlens=cu, cu_seqlens_cpu=cu, output_final_state=True)
    torch.testing.assert_close(o.reshape(o_p.shape), o_p)
    torch.testing.assert_close(s, s_p)


def test_layouts_are_transposes():
    call = random_call(lengths=[40, 90], K=8, V=16, dtype=torch.float32, seed=6)
    _, s_kv = chunk_gated_delta_rule(**call, output_final_state=True)
    vk = dict(call, state_layout="vk", initial_state=call["initial_state"].transpose(-1, -2).contiguous())
    _, s_vk = chunk_gated_delta_rule(**vk, output_final_state=True)
    torch.testing.assert_close(s_vk, s_kv.transpose(-1, -2))


def test_output_dtype_and_no_final_state():
    call = random_call(batch=(1, 20), K=8, V=8, dtype=torch.bfloat16, seed=8)
    o, s = chunk_gated_delta_rule(**call)
    assert o.dtype == torch.bfloat16 and s is None
    assert torch.isfinite(o.float()).all()
