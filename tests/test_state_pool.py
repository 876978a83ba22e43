"""State pools: sequences read their initial state from, and write their final state back
to, rows of a serving engine's pool picked by ``state_indices`` (-1: zeros, no write-back).

Each backend that admits pools must equal gather + call + scatter: ``h0 = pool[idx]`` (zeros
for -1), an ordinary call, ``pool[idx] = final_state`` in the pool's dtype; rows no
sequence names stay bitwise untouched. CPU: the reference and triton_generic under the
interpreter; GPU (``-m gpu``): every GPU backend whose registry row admits pools and that
runs on the GPU at hand (gluon_sm90 on sm_90, gluon_sm100 on sm_100/sm_103, triton_generic).
"""

from __future__ import annotations

import pytest
import torch

from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import default_probe
from gdn_dispatch.registry import CallSpec, explain, load_registry, select
from gdn_dispatch.testing import random_call, rel_rms_error, runnable_gpu_backends

TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3, torch.float16: 5e-3}
HAS_GPU = torch.cuda.is_available()
RUNNABLE_ON_GPU = runnable_gpu_backends() + ["reference"] if HAS_GPU else []


def _pool_backends():
    rows = {r.name: r for r in load_registry()}
    admitting = [name for name, r in rows.items() if "state_pool" in r.features]
    params = []
    for name in admitting:
        if name in ("reference", "triton_generic"):
            params.append(pytest.param(name, "cpu", id=f"{name}-cpu"))
        params.append(pytest.param(name, "cuda", id=f"{name}-cuda", marks=[
            pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU"),
            pytest.mark.skipif(HAS_GPU and name not in RUNNABLE_ON_GPU,
                               reason=f"{name} does not run on this GPU's architecture")]))
    return params


def _run(backend, device, call, **flags):
    problem = make_problem(**call, **flags, backend=backend)
    selection = select(default_probe().for_torch_device(problem.device), problem)
    return selection.module.forward(problem, selection)


@pytest.mark.parametrize("backend, device", _pool_backends())
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
def test_pool_equals_gather_call_scatter(backend, device, layout, pool_dtype, monkeypatch):
    if device == "cpu" and backend == "triton_generic":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    small = device == "cpu"
    lengths = [1, 63, 0, 130, 65] if small else [1, 63, 0, 1000, 65, 4096]
    H, HV, K, V = (1, 2, 16, 32) if small else (4, 8, 128, 128)
    call = random_call(lengths=lengths, H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, device=device,
                       seed=11, state_layout=layout, initial_state=False)
    N, P = len(lengths), len(lengths) + 3
    dims = (K, V) if layout == "kv" else (V, K)
    gen = torch.Generator().manual_seed(5)
    pool = (0.1 * torch.randn(P, HV, *dims, generator=gen)).to(pool_dtype).to(device)
    # Both index dtypes a server passes (int32 with "kv", int64 with "vk").
    idx = torch.tensor([5, -1, 0, 2, 7, 3][:N], dtype=torch.int32 if layout == "kv" else torch.int64, device=device)

    # gather + call + scatter, the way servers do it without pool support
    h0 = torch.zeros(N, HV, *dims, device=device)
    live = idx >= 0
    h0[live] = pool[idx[live].long()].float()
    o_ref, ht_ref = _run("reference", device, {**call, "initial_state": h0}, output_final_state=True)
    pool_ref = pool.clone()
    pool_ref[idx[live].long()] = ht_ref[live].to(pool_dtype)

    before = pool.clone()
    o, ht = _run(backend, device, {**call, "initial_state": pool}, state_indices=idx,
                 inplace_final_state=True, output_final_state=True)
    tol = TOL[torch.bfloat16]
    assert rel_rms_error(o, o_ref) <= tol
    assert rel_rms_error(ht, ht_ref) <= tol
    assert rel_rms_error(pool, pool_ref) <= tol
    untouched = torch.ones(P, dtype=torch.bool, device=device)
    untouched[idx[live].long()] = False
    assert torch.equal(pool[untouched], before[untouched]), "rows no sequence names must stay untouched"


@pytest.mark.parametrize("backend, device", _pool_backends())
def test_pool_without_write_back_leaves_the_pool_alone(backend, device, monkeypatch):
    if device == "cpu" and backend == "triton_generic":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    D = 16 if device == "cpu" else 64  # the head dims every GPU backend runs (Gluon: 64 or 128)
    call = random_call(lengths=[70, 1], H=1, HV=2, K=D, V=D, dtype=torch.bfloat16, device=device,
                       seed=3, initial_state=False)
    pool = torch.randn(4, 2, D, D, device=device)
    before = pool.clone()
    idx = torch.tensor([3, 1], device=device)
    o, ht = _run(backend, device, {**call, "initial_state": pool}, state_indices=idx, output_final_state=True)
    o_ref, ht_ref = _run("reference", device, {**call, "initial_state": pool[[3, 1]].clone()},
                         output_final_state=True)
    assert torch.equal(pool, before)
    assert rel_rms_error(o, o_ref) <= TOL[torch.bfloat16] and rel_rms_error(ht, ht_ref) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("backend, device", _pool_backends())
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
def test_pool_call_without_tokens(backend, device, pool_dtype, monkeypatch):
    """Every sequence empty (no kernel walks a chunk): the final states are the named pool
    rows (zeros for -1 and for an index past the pool), and the pool is left bit for bit."""
    if device == "cpu" and backend == "triton_generic":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    K, V = (16, 32) if device == "cpu" else (128, 64)
    call = random_call(lengths=[0, 0, 0, 0], H=1, HV=2, K=K, V=V, dtype=torch.bfloat16, device=device, seed=6,
                       state_layout="vk", initial_state=False)
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(5, 2, V, K, generator=gen).to(pool_dtype).to(device)
    before = pool.clone()
    idx = torch.tensor([4, -1, 1, 9], dtype=torch.int64, device=device)
    o, ht = _run(backend, device, {**call, "initial_state": pool}, state_indices=idx, inplace_final_state=True,
                 output_final_state=True)
    expected = torch.zeros(4, 2, V, K, device=device)
    expected[0], expected[2] = pool[4].float(), pool[1].float()
    assert o.shape == (1, 0, 2, V)
    assert torch.equal(ht, expected)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("arch, chosen", [("sm_90", "gluon_sm90"), ("sm_100", "gluon_sm100"),
                                          ("sm_80", "triton_generic")])
def test_pool_calls_go_to_the_fastest_backend(arch, chosen):
    from gdn_dispatch.device import assumed_device

    explanation = explain(assumed_device(arch), CallSpec(state_pool=True), env={})
    assert explanation.selected == chosen
    assert all("state pool" not in v.reason for v in explanation.verdicts if v.name != "reference")
