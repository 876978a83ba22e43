"""Routes (:mod:`gdn_dispatch.routes`) on a GPU: the call a route runs returns what the
Python path returns for it.

The GPU differential fuzz calls each form once, and a form's first calls never take a
route (they bind its kernels and build its program), so this test repeats each call of a
fuzz of forms (``test_call_program._random_form``: ragged tails 0/1/17/63/64/65, grouped
heads, K < V and K > V, both layouts, bf16/fp16, float32/bfloat16/float16 initial states,
state pools read and written back in place, and projection views, which a route leaves to
the Python path): three calls with routes on, one with routes off (the expected result),
one more with routes on from the same pool rows, which must be taken exactly when the
program takes the form and agree with the expected result to 1e-6 relative RMS (the same
kernels on the same inputs), the final states and written pool rows too. Needs the native
layer built (``python -m gdn_dispatch warmup``).
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")]

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch import api, native  # noqa: E402
from gdn_dispatch.routes import ROUTE_CALLS  # noqa: E402
from gdn_dispatch import reference  # noqa: E402
from gdn_dispatch.context_parallel import plan_for_problem  # noqa: E402
from gdn_dispatch.contract import make_problem  # noqa: E402
from gdn_dispatch.testing import poison_cuda_allocator, random_call, rel_rms_error  # noqa: E402

from test_call_program import _random_form  # noqa: E402


def _to_gpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the GPU with its strides (``.cuda()`` makes a view with gaps, such as the
    form's projection views, contiguous, and then a program takes a call it should not)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
    out.copy_(t)
    return out


def _on_gpu(call: dict) -> dict:
    """The call on the GPU, its keys l2-normalized where the kernel does not normalize them
    (the form draws raw normal keys: with |k|^2 ~ K the recurrence overflows fp16)."""
    call = {name: _to_gpu(value) if isinstance(value, torch.Tensor) and name != "cu_seqlens_cpu" else value
            for name, value in call.items()}
    if not call["use_qk_l2norm_in_kernel"]:
        call["k"] = torch.nn.functional.normalize(call["k"].float(), dim=-1).to(call["k"].dtype)
    return call


@pytest.mark.parametrize("backend", ["gluon_sm90", "triton_generic"])
def test_routed_calls_return_what_the_python_path_returns(backend):
    if native.for_calls() is None:
        pytest.skip("the native layer is not built (python -m gdn_dispatch warmup)")
    if backend == "gluon_sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("gluon_sm90 runs on sm_90 only")
    rng = random.Random(8642)
    routed = 0
    for i in range(30):
        call, takes = _random_form(rng)
        call = dict(_on_gpu(call), backend=backend)
        for _ in range(3):  # binds the form's kernels, builds its program and its route
            api.chunk_gated_delta_rule(**call)
        # A pool written back in place: both calls start from the same rows, and must leave the same.
        pool = call["initial_state"] if call.get("inplace_final_state") else None
        start = None if pool is None else pool.clone()
        with mock.patch.object(api, "routed_call", lambda *a: None):
            expected = api.chunk_gated_delta_rule(**call)
        if pool is not None:
            expected_pool = pool.clone()
            pool.copy_(start)
        before = ROUTE_CALLS["taken"]
        got = api.chunk_gated_delta_rule(**call)
        taken = ROUTE_CALLS["taken"] - before
        if pool is not None:
            assert rel_rms_error(pool.float(), expected_pool.float()) <= 1e-6, f"call {i}: pool rows"
        assert taken == int(takes), f"call {i}: routed {taken}, expected {int(takes)}"
        routed += taken
        assert all(t is None or bool(t.isfinite().all()) for t in got), f"call {i}: not finite"
        assert rel_rms_error(got[0], expected[0]) <= 1e-6, f"call {i}: o"
        assert (got[1] is None) == (expected[1] is None)
        if expected[1] is not None:
            assert rel_rms_error(got[1], expected[1]) <= 1e-6, f"call {i}: final state"
    assert routed >= 10


@pytest.mark.parametrize("backend", ["gluon_sm90", "triton_generic"])
def test_segmented_calls_routed_return_what_the_python_path_returns(backend):
    """Long prompts on few heads, which ``"auto"`` segments, through their route and call
    program (wy, pass 1, scan, pass 2 in one native call): one packed sequence with and
    without a host copy of its offsets, a uniform batch, ragged batches with and without a
    host copy. The routed call (outputs
    on a NaN-poisoned allocator) must agree with routes off to 1e-6 and with the float32
    reference to 5e-3, the final states and written pool rows too."""
    if native.for_calls() is None:
        pytest.skip("the native layer is not built (python -m gdn_dispatch warmup)")
    if backend == "gluon_sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("gluon_sm90 runs on sm_90 only")
    rng = random.Random(2211)
    # (lengths or uniform batch, host copy, H, HV, routed)
    cases = [([9000], True, 2, 4, 1), ([8192], False, 1, 2, 1), ((2, 4160), None, 1, 2, 1),
             ([3000, 0, 6500], False, 1, 1, 1), ([3000, 6000], True, 1, 2, 1)]
    for i, (shape, host_copy, H, HV, routed) in enumerate(cases * 2):
        K, V = rng.choice([(128, 128), (64, 128), (128, 64), (64, 64)])
        shaped = dict(batch=shape) if isinstance(shape, tuple) else dict(lengths=shape)
        call = random_call(**shaped, H=H, HV=HV, K=K, V=V, dtype=rng.choice([torch.bfloat16, torch.float16]),
                           device="cuda", seed=300 + i, state_layout=rng.choice(["kv", "vk"]))
        if host_copy is False:
            call.pop("cu_seqlens_cpu")
        N = call["initial_state"].shape[0]
        if i % 3 == 1:  # a state pool read and written back in place
            pool = torch.randn(N + 2, *call["initial_state"].shape[1:], device="cuda") * 0.1
            call.update(initial_state=pool, state_indices=torch.randperm(N + 2, device="cuda")[:N],
                        inplace_final_state=True)
        elif i % 3 == 2:
            call["initial_state"] = call["initial_state"].to(torch.bfloat16)
        call.update(output_final_state=True, backend=backend)
        problem = make_problem(**call)
        assert plan_for_problem(problem, torch.cuda.get_device_properties(0).multi_processor_count).enabled
        pool = call["initial_state"] if call.get("inplace_final_state") else None
        start = None if pool is None else pool.clone()
        for _ in range(3):  # binds the form's kernels, builds its program and its route
            api.chunk_gated_delta_rule(**call)
            if pool is not None:
                pool.copy_(start)
        with mock.patch.object(api, "routed_call", lambda *a: None):
            expected = api.chunk_gated_delta_rule(**call)
        if pool is not None:
            expected_pool = pool.clone()
            pool.copy_(start)
        want = reference.forward(make_problem(**{**call, "backend": "reference", "initial_state": (
            start if pool is not None else call["initial_state"]).clone()}))
        poison_cuda_allocator()
        before = ROUTE_CALLS["taken"]
        got = api.chunk_gated_delta_rule(**call)
        assert ROUTE_CALLS["taken"] - before == routed, f"case {i}"
        assert all(bool(t.isfinite().all()) for t in got), f"case {i}: not finite"
        assert rel_rms_error(got[0], expected[0]) <= 1e-6, f"case {i}: o"
        assert rel_rms_error(got[1], expected[1]) <= 1e-6, f"case {i}: final state"
        assert rel_rms_error(got[0].float(), want[0].float()) <= 5e-3, f"case {i}: o against the reference"
        assert rel_rms_error(got[1], want[1].float()) <= 5e-3, f"case {i}: final state against the reference"
        if pool is not None:
            assert rel_rms_error(pool.float(), expected_pool.float()) <= 1e-6, f"case {i}: pool rows"
