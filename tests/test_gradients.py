"""Gradients: the reference backend backpropagates; kernel backends and the custom ops are
forward-only, and say so when a backward reaches them (never silently detached outputs)."""

import dataclasses
import types

import pytest
import torch

from gdn_dispatch import chunk_gated_delta_rule, op, reference
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import CPU
from gdn_dispatch.registry import load_registry, select
from gdn_dispatch.testing import random_call, rel_rms_error

H, HV, K, V = 2, 6, 8, 12
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")
#: float32 chunked reference against a float64 token recurrence, per gradient.
GRAD_TOL = 1e-4


def _grad_call(seed, lengths=(5, 0, 70), layout="kv"):
    call = random_call(lengths=list(lengths), H=H, HV=HV, K=K, V=V, dtype=torch.float32, seed=seed,
                       state_layout=layout)
    return {n: t.clone().requires_grad_(True) if n in GRAD_NAMES else t for n, t in call.items()}


def _loss_weights(o, ht, seed):
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)


def _recurrent_float64(call, scale):
    """The contract's semantics token by token in float64, with autograd: ``(o, ht)`` "kv"/"vk"."""
    q, k, v, g, beta, h0 = (call[n].double() for n in GRAD_NAMES)
    vk = call["state_layout"] == "vk"
    cu = call["cu_seqlens_cpu"].tolist()
    group = HV // H
    o_rows, states = [], []
    for n in range(len(cu) - 1):
        heads = []
        for j in range(HV):
            s = h0[n, j].transpose(0, 1) if vk else h0[n, j]
            for t in range(cu[n], cu[n + 1]):
                kt, qt = k[0, t, j // group], q[0, t, j // group]
                s = s * torch.exp(g[0, t, j])
                u = beta[0, t, j] * (v[0, t, j] - s.transpose(0, 1) @ kt)
                s = s + torch.outer(kt, u)
                o_rows.append((t, j, scale * (s.transpose(0, 1) @ qt)))
            heads.append(s.transpose(0, 1) if vk else s)
        states.append(torch.stack(heads))
    o = torch.zeros(v.shape, dtype=torch.float64)
    for t, j, row in o_rows:
        o = o.index_put((torch.tensor(0), torch.tensor(t), torch.tensor(j)), row)
    return o, torch.stack(states)


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_reference_backend_gradients_match_a_float64_recurrence(layout):
    call = _grad_call(seed=11, lengths=(5, 0, 70), layout=layout)
    o, ht = chunk_gated_delta_rule(**call, output_final_state=True, backend="reference")
    w_o, w_ht = _loss_weights(o, ht, seed=11)
    grads = torch.autograd.grad((o * w_o).sum() + (ht * w_ht).sum(), [call[n] for n in GRAD_NAMES])

    exact = {n: call[n].detach().clone().double().requires_grad_(True) for n in GRAD_NAMES}
    o64, ht64 = _recurrent_float64({**call, **exact}, K ** -0.5)
    assert rel_rms_error(o, o64) <= GRAD_TOL and rel_rms_error(ht, ht64) <= GRAD_TOL
    expected = torch.autograd.grad((o64 * w_o.double()).sum() + (ht64 * w_ht.double()).sum(),
                                   [exact[n] for n in GRAD_NAMES])
    for name, got, want in zip(GRAD_NAMES, grads, expected):
        assert want.abs().max() > 0, name
        assert rel_rms_error(got, want) <= GRAD_TOL, name


@pytest.fixture
def kernel_backend(monkeypatch):
    """The registry's choice replaced by a stand-in for a kernel backend (triton_generic's
    row): it computes the reference's values and, like a kernel writing into fresh
    buffers, returns them with no autograd history. Its calls are counted."""
    calls = []

    def forward(problem, selection=None):
        calls.append(problem)
        with torch.no_grad():
            return reference.forward(problem)

    spec = next(r for r in load_registry() if r.name == "triton_generic")
    stand_in = types.SimpleNamespace(forward=forward)
    real = select(CPU, make_problem(**random_call(batch=(1, 8), K=8, V=8, dtype=torch.float32)), env={})
    selection = dataclasses.replace(real, spec=spec, module=stand_in)
    monkeypatch.setattr(op, "select", lambda device, problem: selection)
    # Routes keep their own registry choice (once the native layer is built, as the slow
    # tier builds it): every call must reach the stand-in.
    monkeypatch.setenv("GDN_DISPATCH_ROUTES", "0")
    return calls


def test_kernel_backend_runs_forward_and_refuses_backward(kernel_backend):
    call = _grad_call(seed=21)
    o, ht = chunk_gated_delta_rule(**call, output_final_state=True)
    assert len(kernel_backend) == 1
    plain = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in call.items()}
    o_ref, ht_ref = reference.forward(make_problem(**plain, output_final_state=True))
    assert rel_rms_error(o, o_ref) == 0 and rel_rms_error(ht, ht_ref) == 0
    assert o.requires_grad and ht.requires_grad and o.grad_fn is not None
    message = (r"gdn_dispatch's triton_generic backend is forward-only: .* torch.no_grad\(\) or "
               r"torch.inference_mode\(\), .*\(backend='reference' or GDN_BACKEND=reference\)")
    with pytest.raises(RuntimeError, match=message):
        o.sum().backward()
    o, ht = chunk_gated_delta_rule(**call, output_final_state=True)
    with pytest.raises(RuntimeError, match=message):
        torch.autograd.grad(ht.sum(), [call["initial_state"]])
    assert all(call[n].grad is None for n in GRAD_NAMES)


def test_kernel_backend_outputs_carry_no_history_without_grad(kernel_backend):
    call = _grad_call(seed=22)
    for context in (torch.no_grad(), torch.inference_mode()):
        with context:
            o, ht = chunk_gated_delta_rule(**call, output_final_state=True)
        assert o.grad_fn is None and ht.grad_fn is None
    plain = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in call.items()}
    o, ht = chunk_gated_delta_rule(**plain, output_final_state=True)
    assert o.grad_fn is None and not o.requires_grad
    assert len(kernel_backend) == 3


def test_kernel_backend_refuses_backward_for_one_input_that_requires_grad(kernel_backend):
    call = random_call(lengths=[9, 64], H=H, HV=HV, K=K, V=V, dtype=torch.float32, seed=23)
    call["beta"].requires_grad_(True)
    o, ht = chunk_gated_delta_rule(**call)
    assert ht is None and o.grad_fn is not None
    with pytest.raises(RuntimeError, match=r"triton_generic backend is forward-only"):
        o.sum().backward()


OP_MESSAGE = (r"gdn_dispatch's custom op gdn_dispatch::chunk_gated_delta_rule{} \(the torch.compile path\) "
              r"is forward-only")


def test_op_refuses_backward_when_it_runs():
    call = _grad_call(seed=31)
    o, ht = torch.ops.gdn_dispatch.chunk_gated_delta_rule(
        call["q"], call["k"], call["v"], call["g"], call["beta"], None, call["initial_state"], True,
        call["cu_seqlens"], call["cu_seqlens_cpu"], False, "kv", None, None)
    assert o.grad_fn is not None and ht.grad_fn is not None
    with pytest.raises(RuntimeError, match=OP_MESSAGE.format("")):
        (o.sum() + ht.sum()).backward()


@pytest.mark.parametrize("inplace", [False, True], ids=["op", "inplace-op"])
def test_compiled_call_with_inputs_that_require_grad_compiles_and_refuses_backward(inplace):
    call = _grad_call(seed=41)
    pool = torch.randn(7, HV, K, V, generator=torch.Generator().manual_seed(42))
    idx = torch.tensor([4, -1, 0])

    def fn(c, pool):
        if inplace:
            return chunk_gated_delta_rule(**{**c, "initial_state": pool}, state_indices=idx, inplace_final_state=True,
                                          output_final_state=True)
        return chunk_gated_delta_rule(**c, output_final_state=True)

    pool_compiled, pool_eager = pool.clone(), pool.clone()
    o, ht = torch.compile(fn, fullgraph=True, backend="aot_eager")(call, pool_compiled)
    with torch.no_grad():
        o_ref, ht_ref = fn(call, pool_eager)
    assert rel_rms_error(o, o_ref) <= 1e-6 and rel_rms_error(ht, ht_ref) <= 1e-6
    torch.testing.assert_close(pool_compiled, pool_eager, rtol=0, atol=0)
    assert o.requires_grad and o.grad_fn is not None
    with pytest.raises(RuntimeError, match=OP_MESSAGE.format("_inplace" if inplace else "")):
        o.sum().backward()
