"""Calls at the edges of the contract's ranges, against the float32 token recurrence
(:func:`gdn_dispatch.reference.forward_recurrent`, the contract's own definition):

* gates far below any decay float32 can hold (-1e4 down to -3e38, finite): exp(g) is 0
  either way, but the chunked form takes differences of chunk-local gate sums, which such a
  token would swallow every smaller gate after it into
  (:data:`gdn_dispatch.contract.GATE_FLOOR`);
* fp16 calls where every input and output lies inside fp16's range but a 16-bit
  intermediate need not: the raw ``q k^T`` of a call that asks the kernel for the l2 norm,
  or of long queries with a small ``scale``, and ``v_new`` rows scaled by ``1 / ||k||`` for
  long keys (fp16's subnormals).

On the CPU the reference backend and triton_generic (under the interpreter); with
``-m gpu``, every backend the registry offers on the device. Outputs of GPU calls start
as NaN.
"""

from __future__ import annotations

import pytest
import torch

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.contract import GATE_FLOOR, make_problem
from gdn_dispatch.reference import forward_recurrent
from gdn_dispatch.testing import poison_cuda_allocator, random_call, rel_rms_error, runnable_gpu_backends

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-3, torch.float16: 5e-3}


def _cases(cpu_backends: tuple[str, ...]):
    params = [pytest.param(name, "cpu", id=f"{name}-cpu") for name in cpu_backends]
    gpu = runnable_gpu_backends() if torch.cuda.is_available() else []
    params += [pytest.param(name, "cuda", id=f"{name}-cuda", marks=pytest.mark.gpu) for name in gpu]
    if not gpu:
        params.append(pytest.param("none", "cuda", id="gpu", marks=[
            pytest.mark.gpu, pytest.mark.skip(reason="needs a GPU with a runnable backend")]))
    return params


def _run(call: dict, backend: str, device: str, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The call on ``backend`` (tensors moved to ``device``) and the float32 token
    recurrence of the same call on the CPU (q, k, v widened to float32 exactly, so that
    its o is not rounded to 16 bits), o and final state of each (float32, CPU)."""
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        poison_cuda_allocator()
    on_device = {n: v.to(device) if torch.is_tensor(v) and n != "cu_seqlens_cpu" else v for n, v in call.items()}
    o, ht = chunk_gated_delta_rule(**on_device, output_final_state=True, backend=backend)
    wide = {n: v.float() if n in ("q", "k", "v") else v for n, v in call.items()}
    o_ref, ht_ref = forward_recurrent(make_problem(**wide, output_final_state=True))
    return (o.float().cpu(), ht.float().cpu()), (o_ref.float(), ht_ref.float())


@pytest.mark.parametrize("backend, device", _cases(("reference", "triton_generic")))
@pytest.mark.parametrize("spike", [-1e4, -1e30, -3e38])
def test_gates_below_the_floor_keep_the_later_decays(backend, device, spike, monkeypatch):
    """A few tokens of every sequence carry a gate of ``spike`` (at a chunk's first and last
    row, mid-chunk, a sequence's last token; drawn, not placed by hand): they reset the
    state, and every decay after them within their chunk is still the product of the
    gates between."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lengths = [130, 64, 1, 77]
    # Head dims every GPU backend is built for (the Gluon backends take 64 and 128).
    dim = 16 if device == "cpu" else 64
    call = random_call(lengths=lengths, H=1, HV=2, K=dim, V=dim, dtype=dtype, seed=11)
    gen = torch.Generator().manual_seed(int(-spike) % 1000)
    T = sum(lengths)
    rows = torch.randint(0, T, (5,), generator=gen).tolist() + [63, 64, 129, 130 + 64]
    heads = torch.randint(0, 2, (len(rows),), generator=gen).tolist()
    for t, h in zip(rows, heads):
        call["g"][0, t, h] = spike
    assert spike < GATE_FLOOR
    (o, ht), (o_ref, ht_ref) = _run(call, backend, device, monkeypatch)
    assert rel_rms_error(o, o_ref) < TOLERANCE[dtype]
    assert rel_rms_error(ht, ht_ref) < TOLERANCE[dtype]


def _long_raw_qk(call: dict, gen: torch.Generator) -> dict:
    # Raw q and k (the kernel normalizes them) with entries of 1e4 and more: ||q|| cos(q, k)
    # passes 65504, 1 / ||k|| is about 1e-5.
    call["q"] = (call["q"] * 3e4).clamp(-6e4, 6e4)
    call["k"] = (call["k"] * torch.empty_like(call["k"]).uniform_(5e3, 1.5e4, generator=gen)).clamp(-6e4, 6e4)
    call["use_qk_l2norm_in_kernel"] = True
    return call


def _short_raw_qk(call: dict, gen: torch.Generator) -> dict:
    # ||q|| cos(q, k) in fp16's subnormals (q itself too: the reference reads the same values).
    call["q"] = call["q"] * 1e-6
    call["k"] = call["k"] * 1e-3
    call["use_qk_l2norm_in_kernel"] = True
    return call


def _long_q_small_scale(call: dict, gen: torch.Generator) -> dict:
    # Unit keys, queries with entries up to 6e4: q k^T up to 2e5 before the scale.
    call["q"] = (call["q"] * 2e5).clamp(-6e4, 6e4)
    call["scale"] = 1e-3
    return call


@pytest.mark.parametrize("backend, device", _cases(("triton_generic",)))
@pytest.mark.parametrize("case", [_long_raw_qk, _short_raw_qk, _long_q_small_scale],
                         ids=["l2-long-q-k", "l2-short-q-k", "long-q-small-scale"])
def test_fp16_intermediates_stay_in_range(backend, device, case, monkeypatch):
    """fp16 calls whose inputs and outputs fit fp16 but whose raw products do not: o and
    the final state within the 16-bit tolerance of the float32 recurrence."""
    K = 16 if device == "cpu" else 128
    call = random_call(lengths=[100, 64, 30], H=1, HV=2, K=K, V=K, dtype=torch.float16, seed=13,
                       normalize_qk=case is _long_q_small_scale)
    call = {n: v.float() if n in ("q", "k") else v for n, v in call.items()}
    call = case(call, torch.Generator().manual_seed(13))
    call["q"], call["k"] = call["q"].half(), call["k"].half()
    assert call["q"].isfinite().all() and call["k"].isfinite().all()
    (o, ht), (o_ref, ht_ref) = _run(call, backend, device, monkeypatch)
    assert o_ref.abs().max() < 6e4 and o.isfinite().all()
    assert rel_rms_error(o, o_ref) < TOLERANCE[torch.float16]
    assert rel_rms_error(ht, ht_ref) < TOLERANCE[torch.float16]
