"""Strided inputs: views split out of one fused projection (token rows with a wider token
stride) and tensors whose last dim is not contiguous, per backend.

Token rows are read in place by every backend (no copy: the counter
``contract.INPUT_COPIES`` stays put): the Gluon kernels take q, k, v through TMA descriptors
at the view's row stride and g, beta through pointers with a token stride. Where TMA cannot
address a view (a token stride off the 16-byte grid), the Gluon forward copies q, k and v
once each, counted. A last dim that is not contiguous is copied once by the contract, for
every backend; so are strided ``cu_seqlens`` and ``state_indices`` (the kernels read entry
``n`` at ``base + n``). Every result equals the call on contiguous copies, bit for bit (the same
kernels on the same values).
"""

from __future__ import annotations

import pytest
import torch

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.contract import INPUT_COPIES, token_rows_stride
from gdn_dispatch.testing import fused_projection_views, random_call

HAS_GPU = torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")]


def _gluon_on_this_gpu() -> str | None:
    if not HAS_GPU:
        return None
    cap = torch.cuda.get_device_capability()
    return {(9, 0): "gluon_sm90", (10, 0): "gluon_sm100", (10, 3): "gluon_sm100"}.get(cap)


CASES = [
    pytest.param("reference", "cpu", True, id="reference-cpu"),
    pytest.param("triton_generic", "cpu", True, id="triton_generic-cpu"),
    pytest.param("triton_generic", "cuda", True, id="triton_generic-cuda", marks=GPU),
    pytest.param("gluon", "cuda", True, id="gluon-cuda", marks=GPU),
]


def _setup(backend, device, monkeypatch):
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    if device == "cpu" and backend == "triton_generic":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if backend == "gluon":
        backend = _gluon_on_this_gpu()
        if backend is None:
            pytest.skip("no Gluon backend for this GPU")
    return backend


@pytest.mark.parametrize("backend, device, in_place", CASES)
@pytest.mark.parametrize("shape", [dict(lengths=[1, 63, 0, 130]), dict(batch=(2, 70))], ids=["varlen", "uniform"])
def test_fused_projection_views(backend, device, in_place, shape, monkeypatch):
    backend = _setup(backend, device, monkeypatch)
    dims = dict(H=2, HV=4, K=32, V=16) if device == "cpu" else dict(H=2, HV=4, K=128, V=128)
    call = random_call(**shape, **dims, dtype=torch.bfloat16, device=device, seed=4)
    views = fused_projection_views(call)
    assert token_rows_stride(views["q"]) == views["q"].stride(1) > views["q"].shape[2] * views["q"].shape[3]
    dense = {n: t.contiguous() for n, t in views.items()}
    before = sum(INPUT_COPIES.values())
    o, ht = chunk_gated_delta_rule(**{**call, **views}, output_final_state=True, backend=backend)
    copies = sum(INPUT_COPIES.values()) - before
    assert copies == (0 if in_place else 5)
    assert views["q"].data_ptr() % 16 == 0 and views["q"].stride(1) * 2 % 16 == 0  # TMA reads them in place
    o_ref, ht_ref = chunk_gated_delta_rule(**{**call, **dense}, output_final_state=True, backend=backend)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)


@pytest.mark.parametrize("backend, device, in_place", CASES)
def test_last_dim_not_contiguous_is_copied_once(backend, device, in_place, monkeypatch):
    backend = _setup(backend, device, monkeypatch)
    dims = dict(H=1, HV=2, K=16, V=32) if device == "cpu" else dict(H=2, HV=4, K=128, V=128)
    call = random_call(lengths=[65, 2], **dims, dtype=torch.bfloat16, device=device, seed=8)
    # v as transformers' Qwen3.5 layer hands it in (from a transposed causal conv).
    v = call["v"].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    assert v.stride(-1) != 1
    before = INPUT_COPIES["v"]
    o, ht = chunk_gated_delta_rule(**{**call, "v": v}, output_final_state=True, backend=backend)
    assert INPUT_COPIES["v"] == before + 1
    o_ref, ht_ref = chunk_gated_delta_rule(**call, output_final_state=True, backend=backend)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)


def _strided(t: torch.Tensor, step: int = 3) -> torch.Tensor:
    """``t``'s values as a 1-D view with element stride ``step`` (fresh random filler between)."""
    wide = torch.randint(-5, 1000, (t.numel() * step,), dtype=t.dtype, device=t.device)
    wide[::step] = t
    return wide[::step]


@pytest.mark.parametrize("backend, device, in_place", CASES)
@pytest.mark.parametrize("host_copy", [True, False], ids=["host-copy", "device-only"])
def test_strided_offsets_and_indices_are_copied_once(backend, device, in_place, host_copy, monkeypatch):
    backend = _setup(backend, device, monkeypatch)
    dims = dict(H=1, HV=2, K=16, V=32) if device == "cpu" else dict(H=2, HV=4, K=128, V=128)
    call = random_call(lengths=[70, 0, 5, 129], **dims, dtype=torch.bfloat16, device=device, seed=12)
    if not host_copy:
        del call["cu_seqlens_cpu"]
    N, (K, V) = 4, (dims["K"], dims["V"])
    gen = torch.Generator().manual_seed(13)
    pool = torch.randn(N + 3, dims["HV"], K, V, generator=gen).to(device)
    indices = torch.randperm(N + 3, generator=gen)[:N].to(torch.int32).to(device)
    indices[1] = -1
    strided = dict(cu_seqlens=_strided(call["cu_seqlens"]), state_indices=_strided(indices))
    assert not strided["cu_seqlens"].is_contiguous() and not strided["state_indices"].is_contiguous()
    before = dict(INPUT_COPIES)
    o, ht = chunk_gated_delta_rule(**{**call, "initial_state": pool, **strided}, output_final_state=True,
                                   backend=backend)
    assert INPUT_COPIES["cu_seqlens"] == before.get("cu_seqlens", 0) + 1
    assert INPUT_COPIES["state_indices"] == before.get("state_indices", 0) + 1
    o_ref, ht_ref = chunk_gated_delta_rule(**{**call, "initial_state": pool}, state_indices=indices,
                                           output_final_state=True, backend=backend)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)
    # Without a pool too (the common form the native admission checks).
    o, ht = chunk_gated_delta_rule(**{**call, "cu_seqlens": strided["cu_seqlens"]}, output_final_state=True,
                                   backend=backend)
    o_ref, ht_ref = chunk_gated_delta_rule(**call, output_final_state=True, backend=backend)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("l2", [False, True], ids=["plain", "l2"])
def test_gluon_copies_views_tma_cannot_address(l2, monkeypatch):
    """One v-head: the fused row is 2 H K + V + 2 = 386 bf16 (772 bytes, not a multiple of
    16), so TMA cannot step through q, k or v in place: each is copied once, counted; g and
    beta are still read in place. The result equals the call on contiguous inputs."""
    backend = _setup("gluon", "cuda", monkeypatch)
    call = random_call(lengths=[1, 130, 0, 65], H=1, HV=1, K=128, V=128, dtype=torch.bfloat16, device="cuda",
                       seed=9, normalize_qk=not l2)
    views = fused_projection_views(call)
    assert views["q"].stride(1) * 2 % 16 != 0
    dense = {n: t.contiguous() for n, t in views.items()}
    before = dict(INPUT_COPIES)
    o, ht = chunk_gated_delta_rule(**{**call, **views}, output_final_state=True, use_qk_l2norm_in_kernel=l2,
                                   backend=backend)
    copied = {n: INPUT_COPIES[n] - before.get(n, 0) for n in ("q", "k", "v", "g", "beta")}
    assert copied == {"q": 1, "k": 1, "v": 1, "g": 0, "beta": 0}
    o_ref, ht_ref = chunk_gated_delta_rule(**{**call, **dense}, output_final_state=True,
                                           use_qk_l2norm_in_kernel=l2, backend=backend)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` whose base sits one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view_as(t).copy_(t)
    assert out.is_contiguous() and out.data_ptr() % 16
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("l2", [False, True], ids=["plain", "l2"])
@pytest.mark.parametrize("lengths", [[200], [1, 130, 64, 65]], ids=["32-programs", "128-programs"])
@pytest.mark.parametrize("HV", [32, 64], ids=["group-2", "group-4"])
def test_gluon_copies_contiguous_inputs_at_a_misaligned_base(l2, lengths, HV, monkeypatch):
    """Contiguous q, k, v whose base is 2 bytes off the 16-byte grid (slices of a flat
    buffer): TMA cannot read them in place, and contiguous() would return them unmoved, so
    each one TMA reads is copied to a new allocation; where the warp-specialized path runs on
    normalized copies of q and k (groups of more than two v-heads), the norm kernel reads them
    by pointer instead and only v is copied; where the norm runs in the path's kernels, q and
    k are copied like v. Equal bit for bit to the call on aligned inputs."""
    backend = _setup("gluon", "cuda", monkeypatch)
    call = random_call(lengths=lengths, H=16, HV=HV, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=21,
                       normalize_qk=not l2)
    odd = {n: _misaligned(call[n]) for n in ("q", "k", "v")}
    before = dict(INPUT_COPIES)
    o, ht = chunk_gated_delta_rule(**{**call, **odd}, output_final_state=True, use_qk_l2norm_in_kernel=l2,
                                   backend=backend)
    copied = {n: INPUT_COPIES[n] - before.get(n, 0) for n in ("q", "k", "v")}
    # Whether the call takes the warp-specialized path is the planner's decision, read from it.
    from gdn_dispatch.backends.gluon_common.forward import plan_call
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.device import default_probe

    problem = make_problem(**call, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    launches = plan_call(problem, default_probe().for_torch_device(problem.device)).launches
    qk = 0 if (l2 and launches.norm_copies) else 1
    assert copied == {"q": qk, "k": qk, "v": 1}, (backend, launches.fused, launches.norm_copies)
    o_ref, ht_ref = chunk_gated_delta_rule(**call, output_final_state=True, use_qk_l2norm_in_kernel=l2,
                                           backend=backend)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [dict(lengths=[1, 63, 0, 130, 700]), dict(batch=(3, 100))], ids=["varlen", "uniform"])
def test_gluon_reads_fused_views_with_the_qk_norm_and_a_pool(shape, monkeypatch):
    """A server's call: fused-projection views, the in-kernel qk l2 norm, grouped v-heads
    and a bf16 state pool written back in place; no input copied; equal to contiguous
    inputs on the same pool."""
    backend = _setup("gluon", "cuda", monkeypatch)
    call = random_call(**shape, H=2, HV=8, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=12,
                       normalize_qk=False, initial_state=False, state_layout="vk")
    views = fused_projection_views(call)
    dense = {n: t.contiguous() for n, t in views.items()}
    N = len(shape["lengths"]) if "lengths" in shape else shape["batch"][0]
    gen = torch.Generator().manual_seed(3)
    pool = (0.1 * torch.randn(N + 2, 8, 128, 128, generator=gen)).to(torch.bfloat16).cuda()
    pool_dense = pool.clone()
    idx = torch.tensor([N + 1, -1, *range(N - 2)], dtype=torch.int32, device="cuda")
    before = sum(INPUT_COPIES.values())
    o, _ = chunk_gated_delta_rule(**{**call, **views, "initial_state": pool}, state_indices=idx,
                                  inplace_final_state=True, use_qk_l2norm_in_kernel=True, backend=backend)
    assert sum(INPUT_COPIES.values()) == before
    o_ref, _ = chunk_gated_delta_rule(**{**call, **dense, "initial_state": pool_dense}, state_indices=idx,
                                      inplace_final_state=True, use_qk_l2norm_in_kernel=True, backend=backend)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(pool, pool_dense, rtol=0, atol=0)
