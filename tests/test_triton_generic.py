"""triton_generic against the float32 reference, stage by stage and end to end.

On a machine without a GPU every case runs on CPU tensors under triton's interpreter
(``TRITON_INTERPRET=1``, set per test: the backend's kernels decide compiled-or-interpreted
at launch, so import order does not matter); with a GPU the same cases also run compiled,
at real sizes. Every buffer the backend allocates starts NaN-filled, so an element a kernel
forgets to write poisons the compared outputs (``rel_rms_error`` is ``inf`` on NaN).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import gdn_dispatch.backends.triton_generic as tg
from gdn_dispatch.backends.triton_generic import cumsum, kkt_solve, output, state, wu
import triton.language as tl

from gdn_dispatch.backends.triton_generic._jit import LOG2E, _slot_rows
from gdn_dispatch.backends.triton_generic._jit import jit as tg_jit
from gdn_dispatch.backends.triton_generic.configs import LaunchConfig
from gdn_dispatch.backends.triton_generic.state import _longest_first
from gdn_dispatch import chunk_gated_delta_rule, contract, reference
from gdn_dispatch.contract import make_problem
from gdn_dispatch.testing import random_call, random_walk_lengths, rel_rms_error, triton_shaped_launcher
from gdn_dispatch.varlen import num_slots, slot_starts, walk_order

ORCHESTRATOR = importlib.import_module("gdn_dispatch.backends.triton_generic.forward")  # tg.forward is the function

#: Relative RMS error per output tensor, by q/k/v dtype. float32 runs every product at
#: fp32 accuracy ("ieee" in the interpreter, 3xTF32 on tensor cores); 16-bit calls round
#: w, u, h and v_new to 16 bits between stages, as fla does.
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3, torch.float16: 5e-3}

HAS_GPU = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU; the CPU runs the same cases "
                                               "under TRITON_INTERPRET=1"),
    ]),
]


@pytest.fixture
def device(request, monkeypatch):
    """The device under test; CPU tensors run in triton's interpreter, CUDA ones compiled."""
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return torch.device(request.param)


class _PoisonedTorch:
    """``torch`` as the backend modules see it, with empty/empty_like filled with NaN."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


@pytest.fixture(autouse=True)
def nan_poison(monkeypatch):
    for module in (cumsum, kkt_solve, wu, state, output):
        monkeypatch.setattr(module, "torch", _PoisonedTorch())


def _case(case_id, dtype, cpu, gpu, layout="kv", h0=True, l2=False, marks=()):
    return pytest.param(dtype, cpu, gpu, layout, h0, l2, id=case_id, marks=marks)


# (q/k/v dtype, CPU shape, GPU shape, state layout, initial state, fused l2-norm). Lengths
# 1, 63, 64, 65, 130 and 0 in one packed batch; HV / H of 1, 2 and 4; K, V not powers of two.
VARLEN = [1, 63, 64, 65, 130, 0]
CASES = [
    _case("varlen-1.63.64.65.130.0-H2-HV4-K32-kv-h0-fp32", torch.float32,
          dict(lengths=VARLEN, H=2, HV=4, K=32, V=32),
          dict(lengths=VARLEN + [4096, 1000], H=16, HV=32, K=128, V=128)),
    _case("varlen-1.63.64.65.130.0-H2-HV4-K32-vk-h0-l2-bf16", torch.bfloat16,
          dict(lengths=VARLEN, H=2, HV=4, K=32, V=32),
          dict(lengths=VARLEN + [4096, 1000], H=16, HV=32, K=128, V=128), layout="vk", l2=True),
    _case("T63-H1-HV4-K32-vk-h0-bf16", torch.bfloat16,
          dict(batch=(1, 63), H=1, HV=4, K=32, V=32),
          dict(batch=(2, 2047), H=4, HV=16, K=128, V=128), layout="vk"),
    _case("B2-T65-H1-HV1-K32-kv-l2-fp32", torch.float32,
          dict(batch=(2, 65), H=1, HV=1, K=32, V=32),
          dict(batch=(3, 1025), H=8, HV=8, K=128, V=128), h0=False, l2=True),
    _case("T130-H1-HV2-K24-V40-vk-h0-l2-bf16", torch.bfloat16,
          dict(batch=(1, 130), H=1, HV=2, K=24, V=40),
          dict(batch=(1, 3000), H=8, HV=16, K=60, V=100), layout="vk", l2=True),
    _case("T64-H2-HV2-K60-V100-kv-h0-fp32", torch.float32,
          dict(batch=(1, 64), H=2, HV=2, K=60, V=100),
          dict(batch=(2, 1500), H=4, HV=8, K=60, V=100)),
    _case("T65-H1-HV2-K32-kv-fp16", torch.float16,
          dict(batch=(1, 65), H=1, HV=2, K=32, V=32),
          dict(batch=(1, 4096), H=16, HV=32, K=128, V=128), h0=False),
    _case("B3-T1-H2-HV2-K16-vk-h0-bf16", torch.bfloat16,
          dict(batch=(3, 1), H=2, HV=2, K=16, V=16),
          dict(batch=(64, 1), H=16, HV=32, K=128, V=128), layout="vk"),
    _case("varlen-130.1.0-H1-HV2-K256-V256-kv-h0-bf16", torch.bfloat16,
          dict(lengths=[130, 1, 0], H=1, HV=2, K=256, V=256),
          dict(lengths=[2000, 1, 0, 777], H=4, HV=8, K=256, V=256), marks=pytest.mark.slow),
]


def _problem(dtype, shape, layout, h0, l2, device, seed=0):
    call = random_call(**shape, dtype=dtype, device=device, seed=seed, initial_state=h0,
                       state_layout=layout, normalize_qk=not l2)
    return make_problem(**call, output_final_state=True, use_qk_l2norm_in_kernel=l2)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype, cpu_shape, gpu_shape, layout, h0, l2", CASES)
def test_forward_matches_reference(device, dtype, cpu_shape, gpu_shape, layout, h0, l2):
    problem = _problem(dtype, cpu_shape if device.type == "cpu" else gpu_shape, layout, h0, l2, device)
    o, ht = tg.forward(problem)
    o_ref, ht_ref = reference.forward(problem)
    assert o.shape == o_ref.shape and o.dtype == dtype
    assert ht.shape == problem.state_shape and ht.dtype == torch.float32
    assert rel_rms_error(o, o_ref) <= TOL[dtype]
    assert rel_rms_error(ht, ht_ref) <= TOL[dtype]


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_forward_with_stored_inverse(device, monkeypatch):
    """The unfused orchestration (kkt_solve_fwd stores T in bf16, wu_fwd reads it back)."""
    monkeypatch.setattr(ORCHESTRATOR, "fuse_solve_into_wu", lambda capability=None: False)
    shape = dict(lengths=VARLEN, H=2, HV=4, K=32, V=32) if device.type == "cpu" else \
        dict(lengths=VARLEN + [4096], H=16, HV=32, K=128, V=128)
    problem = _problem(torch.bfloat16, shape, "kv", True, True, device)
    o, ht = tg.forward(problem)
    o_ref, ht_ref = reference.forward(problem)
    assert rel_rms_error(o, o_ref) <= TOL[torch.bfloat16]
    assert rel_rms_error(ht, ht_ref) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_zero_length_sequences_keep_their_state(device):
    problem = _problem(torch.bfloat16, dict(lengths=[0, 0, 0], H=1, HV=2, K=16, V=16), "vk", True, False,
                       device)
    o, ht = tg.forward(problem)
    assert o.shape == (1, 0, 2, 16)
    torch.testing.assert_close(ht, problem.initial_state.float(), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_no_final_state_requested(device):
    call = random_call(batch=(1, 70), H=1, HV=2, K=16, V=16, dtype=torch.float32, device=device)
    problem = make_problem(**call)
    o, ht = tg.forward(problem)
    assert ht is None
    assert rel_rms_error(o, reference.forward(problem)[0]) <= TOL[torch.float32]


@tg_jit
def _slot_probe_kernel(cu_seqlens, t0_out, n_out, N, BT: tl.constexpr):
    i_s = tl.program_id(0)
    t0, n_t = _slot_rows(cu_seqlens, i_s, N, BT)
    tl.store(t0_out + i_s, t0)
    tl.store(n_out + i_s, n_t)


@tg_jit
def _walk_order_probe_kernel(cu_seqlens, out, BT: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    tl.store(out + p, _longest_first(cu_seqlens, tl.num_programs(0).to(tl.int64), p, BT))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 2, 9, 256, 257])
def test_programs_walk_the_sequences_longest_first(device, cu_dtype, n):
    """Program position p takes the p-th sequence of gdn_dispatch.varlen.walk_order (ties,
    empty sequences, tails; batch order past LONGEST_FIRST_SEQS)."""
    gen = torch.Generator().manual_seed(2000 + n)
    lengths = random_walk_lengths(gen, n)
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(cu_dtype).to(device)
    out = torch.full((n,), -1, dtype=torch.int64, device=device)
    _walk_order_probe_kernel[(n,)](cu, out, BT=64)
    got = out.tolist()
    assert sorted(got) == list(range(n)), "not a permutation of the batch"
    assert got == walk_order(lengths, 64)


def _expected_slots(lengths: list[int], C: int = 64) -> dict[int, tuple[int, int]]:
    """Slot -> (first token, rows) of every chunk, from the definition in gdn_dispatch.varlen."""
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    starts = slot_starts(cu, C)
    expected = {}
    for n, length in enumerate(lengths):
        assert starts[n + 1] - starts[n] >= -(-length // C)
        for j in range(-(-length // C)):
            expected[starts[n] + j] = (cu[n] + j * C, min(C, length - j * C))
    assert starts[-1] == num_slots(cu[-1], len(lengths), C)
    return expected


SLOT_LENGTHS = [
    pytest.param([0, 1, 63, 64, 65, 0, 127, 128, 129, 1, 0], id="edges"),
    pytest.param([1], id="one-token"),
    pytest.param([0, 0, 0], id="all-empty"),
    pytest.param(torch.randint(0, 200, (97,), generator=torch.Generator().manual_seed(5)).tolist(), id="97-random"),
]


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lengths", SLOT_LENGTHS)
def test_slot_rows_find_every_chunk_once(device, cu_dtype, lengths):
    """The in-kernel bisection maps each slot to its chunk; every other slot is idle."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=cu_dtype, device=device)
    NS = num_slots(int(cu[-1]), len(lengths), 64)
    t0 = torch.full((NS,), -7, dtype=torch.int64, device=device)
    rows = torch.full((NS,), -7, dtype=torch.int32, device=device)
    _slot_probe_kernel[(NS,)](cu, t0, rows, len(lengths), BT=64)
    expected = _expected_slots(lengths)
    got_t0, got_rows = t0.tolist(), rows.tolist()
    for slot in range(NS):
        if slot in expected:
            assert (got_t0[slot], got_rows[slot]) == expected[slot], slot
        else:
            assert got_rows[slot] <= 0, slot


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_ragged_batch_without_host_offsets_matches_reference(device, cu_dtype, monkeypatch):
    """Many sequences (lengths 0, 1, 63, 64, 65, ...) from a device cu_seqlens alone, in
    either index dtype: every output element written (buffers start NaN) and right."""
    lengths = [0, 1, 63, 64, 65, 0, 127, 128, 129, 1, 2, 0, 66, 5, 64, 3]
    call = random_call(lengths=lengths, H=1, HV=2, K=16, V=16, dtype=torch.float32, device=device, seed=3,
                       state_layout="vk")
    call.pop("cu_seqlens_cpu")
    call["cu_seqlens"] = call["cu_seqlens"].to(cu_dtype)
    # On the CPU the offsets would be their own host copy: they stand for device ones here.
    monkeypatch.setattr(contract, "_in_host_memory", lambda t: False)
    problem = make_problem(**call, output_final_state=True)
    assert problem.chunks.cu_seqlens_host is None
    o, ht = tg.forward(problem)
    o_ref, ht_ref = reference.forward(problem)
    assert rel_rms_error(o, o_ref) <= TOL[torch.float32]
    assert rel_rms_error(ht, ht_ref) <= TOL[torch.float32]


def _chunk_rows(problem):
    """Host list of (first token, rows) per chunk, in the ChunkTable's flat order."""
    chunks = problem.chunks
    bounds = chunks.cu_seqlens_host.tolist()
    out = []
    for n in range(problem.N):
        for t0 in range(bounds[n], bounds[n + 1], chunks.chunk_size):
            out.append((t0, min(chunks.chunk_size, bounds[n + 1] - t0)))
    return out


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_chunk_cumsum_is_chunk_local(device):
    problem = _problem(torch.float32, dict(lengths=VARLEN, H=1, HV=3, K=16, V=16), "kv", False, False, device)
    g_cum = tg.chunk_cumsum_fwd(problem.g, problem.chunks, scale=LOG2E)
    g = problem.g.reshape(-1, problem.HV).double()
    expected = torch.full_like(g, float("nan"))
    for t0, n in _chunk_rows(problem):
        expected[t0:t0 + n] = g[t0:t0 + n].cumsum(0) * LOG2E
    assert g_cum.shape == problem.g.shape and g_cum.dtype == torch.float32
    torch.testing.assert_close(g_cum.reshape(-1, problem.HV).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("l2", [False, True], ids=["raw-k", "l2"])
def test_kkt_solve_inverts_i_plus_a(device, l2):
    problem = _problem(torch.float32, dict(lengths=[65, 0, 130, 1], H=1, HV=2, K=24, V=8), "kv", False, l2,
                       device)
    g_cum = tg.chunk_cumsum_fwd(problem.g, problem.chunks, scale=LOG2E)
    a_inv = tg.kkt_solve_fwd(problem.k, g_cum, problem.beta, problem.chunks, use_qk_l2norm=l2,
                             out_dtype=torch.float32)
    assert a_inv.shape == (*problem.beta.shape, 64)
    k = problem.k.reshape(-1, problem.H, problem.K).double()
    if l2:
        k = reference.l2_normalize(k)
    k = k.repeat_interleave(problem.HV // problem.H, dim=1)
    gc = g_cum.reshape(-1, problem.HV).double() / LOG2E
    beta = problem.beta.reshape(-1, problem.HV).double()
    rows = a_inv.reshape(-1, problem.HV, 64).double()
    for t0, n in _chunk_rows(problem):
        for h in range(problem.HV):
            kc, gh = k[t0:t0 + n, h], gc[t0:t0 + n, h]
            a = (beta[t0:t0 + n, h, None] * (kc @ kc.T) * torch.exp(gh[:, None] - gh[None, :])).tril(-1)
            eye = torch.eye(n, dtype=a.dtype, device=a.device)
            x = rows[t0:t0 + n, h, :n]
            torch.testing.assert_close(x @ (eye + a), eye, rtol=0, atol=1e-5)
            assert bool((rows[t0:t0 + n, h, n:] == 0).all())


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("split", [False, True], ids=["fused-solve", "kkt-solve-first"])
def test_the_kernel_forming_t_forms_the_gate_cumsum(device, split):
    """Given g, the w/u kernel (or kkt_solve on the split form) writes every g_cum row the
    cumsum stage writes, with the same values, and w and u come out as from the stage's."""
    problem = _problem(torch.float32, dict(lengths=[70, 0, 64, 3, 129], H=1, HV=3, K=24, V=16), "kv", False, True,
                       device)
    chunks = problem.chunks
    # g with a token stride of its own (HV + 5), beta packed: the kernels read each by its stride.
    wide = torch.randn(*problem.g.shape[:-1], problem.HV + 5, device=problem.g.device)
    wide[..., :problem.HV] = problem.g
    g = wide[..., :problem.HV]
    expected = tg.chunk_cumsum_fwd(g, chunks, scale=LOG2E)
    w0, u0 = tg.wu_fwd(problem.k, problem.v, expected, problem.beta, chunks, use_qk_l2norm=True)
    g_cum = torch.full_like(expected, float("nan"))
    if split:
        a_inv = tg.kkt_solve_fwd(problem.k, g_cum, problem.beta, chunks, g=g, use_qk_l2norm=True,
                                 out_dtype=torch.float32)
        w1, u1 = tg.wu_fwd(problem.k, problem.v, g_cum, problem.beta, chunks, A_inv=a_inv, use_qk_l2norm=True)
    else:
        w1, u1 = tg.wu_fwd(problem.k, problem.v, g_cum, problem.beta, chunks, g=g, use_qk_l2norm=True)
    assert not g_cum.isnan().any(), "g_cum rows left unwritten"
    torch.testing.assert_close(g_cum, expected, rtol=1e-6, atol=1e-6)
    assert rel_rms_error(w1, w0) <= 1e-6 and rel_rms_error(u1, u0) <= 1e-6
    with pytest.raises(ValueError, match="g: "):
        tg.wu_fwd(problem.k, problem.v, g_cum, problem.beta, chunks, g=g, A_inv=torch.empty(0))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_wu_from_stored_inverse_matches_fused(device):
    problem = _problem(torch.float32, dict(lengths=[70, 64, 3], H=1, HV=2, K=40, V=24), "kv", False, True,
                       device)
    g_cum = tg.chunk_cumsum_fwd(problem.g, problem.chunks, scale=LOG2E)
    a_inv = tg.kkt_solve_fwd(problem.k, g_cum, problem.beta, problem.chunks, use_qk_l2norm=True,
                             out_dtype=torch.float32)
    w0, u0 = tg.wu_fwd(problem.k, problem.v, g_cum, problem.beta, problem.chunks, use_qk_l2norm=True)
    w1, u1 = tg.wu_fwd(problem.k, problem.v, g_cum, problem.beta, problem.chunks, A_inv=a_inv,
                       use_qk_l2norm=True)
    assert rel_rms_error(w1, w0) <= 1e-6 and rel_rms_error(u1, u0) <= 1e-6


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_state_and_output_v_slices_agree(device, layout):
    """Narrow V slices (several programs per head, a ragged last slice) give the same result."""
    problem = _problem(torch.float32, dict(lengths=[130, 0, 20], H=1, HV=2, K=32, V=40), layout, True, False,
                       device)
    chunks, vk = problem.chunks, layout == "vk"
    g_cum = tg.chunk_cumsum_fwd(problem.g, chunks, scale=LOG2E)
    w, u = tg.wu_fwd(problem.k, problem.v, g_cum, problem.beta, chunks)
    runs = []
    for bv in (None, 16):
        state_cfg = None if bv is None else LaunchConfig(num_warps=4, num_stages=2, BV=bv)
        out_cfg = None if bv is None else LaunchConfig(num_warps=4, num_stages=2, BK=16, BV=bv)
        h, v_new, ht = tg.state_fwd(problem.k, w, u, g_cum, chunks, initial_state=problem.initial_state,
                                    output_final_state=True, state_vk=vk, config=state_cfg)
        o = tg.output_fwd(problem.q, problem.k, v_new, h, g_cum, chunks, scale=problem.scale, config=out_cfg)
        runs.append((o, ht))
    o_ref, ht_ref = reference.forward(make_problem(**{**_call_of(problem), "output_final_state": True}))
    for o, ht in runs:
        assert rel_rms_error(o, o_ref) <= TOL[torch.float32]
        assert rel_rms_error(ht, ht_ref) <= TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_stored_k_rnorm_matches_reduced_k_rows(device):
    """With the fused l2-norm, state and output agree whether they read w/u's 1/||k|| or reduce k."""
    problem = _problem(torch.float32, dict(lengths=[70, 0, 9], H=1, HV=2, K=40, V=24), "kv", True, True,
                       device)
    chunks = problem.chunks
    g_cum = tg.chunk_cumsum_fwd(problem.g, chunks, scale=LOG2E)
    k_rnorm = torch.full_like(g_cum, float("nan"))
    w, u = tg.wu_fwd(problem.k, problem.v, g_cum, problem.beta, chunks, use_qk_l2norm=True, k_rnorm=k_rnorm)
    k_heads = problem.k.float().repeat_interleave(2, dim=2)
    expected = torch.rsqrt((k_heads * k_heads).sum(-1) + 1e-6)
    assert rel_rms_error(k_rnorm, expected) <= 1e-6
    outs = []
    for rnorm in (k_rnorm, None):
        h, v_new, ht = tg.state_fwd(problem.k, w, u, g_cum, chunks, initial_state=problem.initial_state,
                                    output_final_state=True, use_qk_l2norm=True, k_rnorm=rnorm)
        o = tg.output_fwd(problem.q, problem.k, v_new, h, g_cum, chunks, scale=problem.scale,
                          use_qk_l2norm=True, k_rnorm=rnorm)
        outs.append((o, ht))
    assert rel_rms_error(outs[0][0], outs[1][0]) <= 1e-6 and rel_rms_error(outs[0][1], outs[1][1]) <= 1e-6


def _call_of(problem):
    return dict(q=problem.q, k=problem.k, v=problem.v, g=problem.g, beta=problem.beta, scale=problem.scale,
                initial_state=problem.initial_state, cu_seqlens=problem.cu_seqlens,
                cu_seqlens_cpu=problem.chunks.cu_seqlens_host if problem.cu_seqlens is not None else None,
                state_layout=problem.state_layout)


def test_api_runs_triton_generic_on_cpu_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    call = random_call(lengths=[65, 1], H=1, HV=2, K=16, V=16, dtype=torch.bfloat16)
    o_api, ht_api = chunk_gated_delta_rule(**call, output_final_state=True, backend="triton_generic")
    monkeypatch.setenv("GDN_BACKEND", "cpu=triton_generic")
    o_env, ht_env = chunk_gated_delta_rule(**call, output_final_state=True)
    o, ht = tg.forward(make_problem(**call, output_final_state=True))
    torch.testing.assert_close(o_api, o, rtol=0, atol=0)
    torch.testing.assert_close(o_env, o, rtol=0, atol=0)
    torch.testing.assert_close(ht_api, ht, rtol=0, atol=0)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    problem = make_problem(**random_call(batch=(1, 4), H=1, HV=1, K=16, V=16))
    assert tg.unsupported_reason(problem) == "CPU tensors need TRITON_INTERPRET=1 (triton's interpreter)"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tg.unsupported_reason(problem) is None


def test_kkt_solve_rejects_other_output_dtypes():
    problem = make_problem(**random_call(batch=(1, 4), H=1, HV=1, K=16, V=16))
    g_cum = torch.zeros(problem.g.shape)
    with pytest.raises(ValueError, match=r"out_dtype: expected k's dtype torch.bfloat16 or torch.float32, "
                                         r"got torch.float16"):
        tg.kkt_solve_fwd(problem.k, g_cum, problem.beta, problem.chunks, out_dtype=torch.float16)


@pytest.mark.slow
@pytest.mark.parametrize("target", [(8, 0), (9, 0)], ids=["sm_80", "sm_90"])
def test_aot_kernels_compile_without_spills(target):
    """Every kernels_for_aot entry compiles without spills, within the part's shared memory."""
    from gdn_dispatch.aot import compile_kernel

    kernels = tg.kernels_for_aot(target)
    assert {k.kernel for k in kernels} == {"kkt_solve_fwd", "wu_fwd", "state_fwd", "output_fwd", "forgetting_start",
                                           "segment_map_fwd", "segment_scan_fwd", "chained_state_fwd"}
    for kernel in kernels:
        report = compile_kernel(kernel, target)
        assert report.spill_bytes == 0, f"{kernel.kernel} {kernel.specialization} spills"
        assert report.shared_bytes <= {(8, 0): 166912, (9, 0): 232448}[target]


# Unequal head dims whose compiled tiles once went wrong on sm_90 (K > V, small V, K < 16),
# each as a public call against the reference; the interpreter checks the same calls.
UNEQUAL_HEADS = [
    pytest.param([64], 1, 2, 32, 16, torch.bfloat16, "kv", False, id="T64-H1-HV2-K32-V16"),
    pytest.param([64], 1, 1, 32, 16, torch.bfloat16, "kv", False, id="T64-H1-HV1-K32-V16"),
    pytest.param([64], 1, 2, 64, 16, torch.bfloat16, "kv", False, id="T64-H1-HV2-K64-V16"),
    pytest.param([64], 1, 2, 128, 32, torch.bfloat16, "kv", False, id="T64-H1-HV2-K128-V32"),
    pytest.param([64], 1, 1, 64, 32, torch.bfloat16, "kv", False, id="T64-H1-HV1-K64-V32"),
    pytest.param([15], 4, 4, 96, 16, torch.float16, "vk", True, id="T15-H4-HV4-K96-V16-vk-l2-fp16"),
    pytest.param([64, 1], 1, 2, 8, 8, torch.bfloat16, "kv", False, id="T64.1-K8-V8"),
    pytest.param([70], 1, 2, 4, 24, torch.float32, "vk", True, id="T70-K4-V24-vk-l2-fp32"),
]


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("lengths, H, HV, K, V, dtype, layout, l2", UNEQUAL_HEADS)
def test_unequal_head_dims(device, lengths, H, HV, K, V, dtype, layout, l2):
    call = random_call(lengths=lengths, H=H, HV=HV, K=K, V=V, dtype=dtype, device=device, seed=7,
                       state_layout=layout, normalize_qk=not l2)
    o, ht = chunk_gated_delta_rule(**call, use_qk_l2norm_in_kernel=l2, output_final_state=True,
                                   backend="triton_generic")
    o_ref, ht_ref = reference.forward(make_problem(**call, use_qk_l2norm_in_kernel=l2, output_final_state=True))
    assert rel_rms_error(o, o_ref) <= TOL[dtype]
    assert rel_rms_error(ht, ht_ref) <= TOL[dtype]


def test_launch_takes_fewer_stages_when_shared_memory_runs_out(monkeypatch):
    """A JIT launch (configs._jit_launch, what configs.launch runs the first time) retries a
    launch whose stages overflow shared memory with one stage fewer, keeps the depth that
    fit for that launch key, and re-raises anything else."""
    from triton.runtime.errors import OutOfResources

    from gdn_dispatch.backends.triton_generic import configs

    class FakeKernel:
        def __init__(self, fits_at):
            self.fn, self.fits_at, self.tried = FakeKernel, fits_at, []

        def __getitem__(self, grid):
            def run(**kwargs):
                self.tried.append(kwargs["num_stages"])
                if kwargs["num_stages"] > self.fits_at:
                    raise OutOfResources(238600, 232448, "shared memory")
            return run

    monkeypatch.setattr(configs, "_FITTED_STAGES", {})
    cfg = LaunchConfig(num_warps=4, num_stages=3, BK=256, BV=32)
    kernel = FakeKernel(fits_at=1)
    configs._jit_launch(kernel, (1,), cfg, dict(x=torch.zeros(1), K=256))
    assert kernel.tried == [3, 2, 1]
    configs._jit_launch(kernel, (1,), cfg, dict(x=torch.zeros(1), K=256))
    assert kernel.tried == [3, 2, 1, 1]  # straight to the depth that fit
    other = FakeKernel(fits_at=0)
    with pytest.raises(OutOfResources):
        configs._jit_launch(other, (1,), cfg, dict(x=torch.zeros(1), K=128))
    assert other.tried == [3, 2, 1]


class _StandInCompiled:
    """What Triton's JIT returns: a compiled kernel whose launcher records its calls."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *args):
        self.launches.append(((g0, g1, g2), stream, args))


class _StandInRuntime:
    """direct_launch's view of Triton (verified release, no hooks) without a driver."""

    def __init__(self):
        from gdn_dispatch.backends.gluon_common import compat

        self.compat = compat

    def direct(self):
        import os
        return os.environ.get("GDN_DISPATCH_JIT_LAUNCH", "") != "1"

    @staticmethod
    def stream(device):
        return 1000 + device


@pytest.fixture
def stand_in_gpu(monkeypatch):
    from gdn_dispatch.backends import direct_launch

    monkeypatch.setattr(direct_launch, "_RUNTIME", _StandInRuntime())
    monkeypatch.setattr(direct_launch, "_CALL_SITES", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("GDN_DISPATCH_JIT_LAUNCH", raising=False)
    return direct_launch


def test_kept_launch_binds_once_per_specialization(stand_in_gpu):
    """The first launch of a specialization goes through the JIT; later ones call the kept
    kernel's launcher with every argument in the kernel's order, constexprs included, and
    tensors as their addresses."""
    compiled, jit_launches = {}, []

    def jit_launch(key):
        jit_launches.append(key)
        return compiled.setdefault(key, _StandInCompiled())

    chunks = make_problem(**random_call(lengths=[3, 70], K=16, V=16, dtype=torch.float32)).chunks
    g = torch.randn(1, 73, 4)
    g_cum = torch.full_like(g, float("nan"))

    def launch(g, grid=(4, 1), BH=4, N=2):
        kwargs = dict(scale=1.5, g_cum=g_cum, g=g, cu_seqlens=chunks.cu_seqlens, N=N, s_g=4, HV=4, BT=64, BH=BH)
        stand_in_gpu.launch_kept(cumsum._chunk_cumsum_fwd_kernel, grid, (2, 1), kwargs,
                                 lambda: jit_launch((BH, g.data_ptr() % 16 == 0)))

    launch(g)
    launch(g, grid=(9, 2), N=5)  # another grid and sequence count: the same kernel
    assert jit_launches == [(4, True)]
    (grid, stream, args), = compiled[(4, True)].launches
    assert grid == (9, 2, 1) and stream == 1000
    # The kernel's parameter order, tensors as their addresses.
    assert list(args) == [g.data_ptr(), g_cum.data_ptr(), chunks.cu_seqlens.data_ptr(), 5, 1.5, 4, 4, 64, 4]
    launch(g, BH=8)  # a constexpr changed: bound anew
    launch(torch.randn(1, 73, 4))  # other aligned inputs: the kept kernel
    assert len(compiled[(4, True)].launches) == 2
    misaligned = torch.randn(293)[1:].view(1, 73, 4)
    launch(misaligned)  # 4-byte aligned only: bound anew
    assert jit_launches == [(4, True), (8, True), (4, False)]


def test_kept_launch_calls_the_c_launch_as_tritons_launcher_would(stand_in_gpu):
    """With a launcher shaped as Triton 3.6's (its own CudaLauncher.__call__ around a C
    launch), the kept path calls the C launch itself with what that launcher would pass."""
    import triton

    if not stand_in_gpu._RUNTIME.compat.direct_launch_verified(triton.__version__):
        pytest.skip("kept kernels launch directly only on the Triton releases this was verified on")
    class Compiled:
        function, packed_metadata = "function", ("metadata",)

        def __init__(self):
            self.c_calls = []
            self.run = triton_shaped_launcher(lambda *a: self.c_calls.append(a))

    compiled = Compiled()
    g, g_cum = torch.randn(1, 73, 4), torch.empty(1, 73, 4)
    cu = torch.tensor([0, 3, 73], dtype=torch.int32)
    kwargs = dict(scale=1.5, g_cum=g_cum, g=g, cu_seqlens=cu, N=2, s_g=4, HV=4, BT=64, BH=4)
    for _ in range(2):
        stand_in_gpu.launch_kept(cumsum._chunk_cumsum_fwd_kernel, (4, 2), (2, 1), kwargs, lambda: compiled)
    direct, = compiled.c_calls
    ordered = [g.data_ptr(), g_cum.data_ptr(), cu.data_ptr(), 2, 1.5, 4, 4, 64, 4]
    compiled.run(4, 2, 1, 1000, "function", ("metadata",), None, None, None, *ordered)
    assert direct == compiled.c_calls[1]


@pytest.mark.parametrize("seed", range(3))
def test_straight_line_launchers_launch_as_the_key_lookup_does(stand_in_gpu, monkeypatch, seed):
    """Over a stream of launches of one kernel (other grids and buffers; now and then
    another constexpr, a 4-byte-aligned input, N = 1 or 16, another device), the C launches
    and the JIT launches are the same with the straight-line launchers
    (``direct_launch.fast_launcher``) as with the key lookup alone."""
    import triton

    if not stand_in_gpu._RUNTIME.compat.direct_launch_verified(triton.__version__):
        pytest.skip("kept kernels launch directly only on the Triton releases this was verified on")

    class Compiled:
        function, packed_metadata = "function", ("metadata",)

        def __init__(self, c_calls):
            self.c_calls = c_calls
            # A bound method, as Triton's C launch function: compat.raw_launch takes it.
            self.run = triton_shaped_launcher(self.record)

        def record(self, *args):
            self.c_calls.append(args)

    gen = torch.Generator().manual_seed(seed)
    buffers = [torch.randn(1, 73, 4, generator=gen) for _ in range(3)]
    misaligned = torch.randn(293, generator=gen)[1:].view(1, 73, 4)
    g_cum = torch.empty(1, 73, 4)
    cu = torch.tensor([0, 3, 73], dtype=torch.int32)
    stream = []
    for _ in range(30):
        pick = int(torch.randint(0, 6, (1,), generator=gen))
        stream.append(dict(g=misaligned if pick == 1 else buffers[int(torch.randint(0, 3, (1,), generator=gen))],
                           BH=8 if pick == 2 else 4, N=(1 if pick == 3 else 16) if pick in (3, 4) else 2,
                           device=1 if pick == 5 else 0, grid=(int(torch.randint(1, 9, (1,), generator=gen)), 2)))
    runs = {}
    for mode in ("lookup", "fast"):
        monkeypatch.setattr(stand_in_gpu, "_CALL_SITES", {})
        made = []
        real = stand_in_gpu.fast_launcher
        monkeypatch.setattr(stand_in_gpu, "fast_launcher",
                            (lambda *a: made.append(1) or real(*a)) if mode == "fast" else (lambda *a: None))
        c_calls, jit_keys = [], []
        for call in stream:
            monkeypatch.setattr(torch.cuda, "current_device", lambda d=call["device"]: d)
            kwargs = dict(scale=1.5, g_cum=g_cum, g=call["g"], cu_seqlens=cu, N=call["N"], s_g=4, HV=4, BT=64,
                          BH=call["BH"])
            key = (call["BH"], call["g"].data_ptr() % 16 == 0, call["N"], call["device"])
            stand_in_gpu.launch_kept(cumsum._chunk_cumsum_fwd_kernel, call["grid"], (2, 1), kwargs,
                                     lambda k=key: jit_keys.append(k) or Compiled(c_calls))
        runs[mode] = (jit_keys, c_calls, len(made))
        monkeypatch.setattr(stand_in_gpu, "fast_launcher", real)
    assert runs["fast"][:2] == runs["lookup"][:2]
    assert len(runs["fast"][1]) >= 15 and runs["fast"][2] >= 2


def test_kept_launch_goes_through_the_jit_when_asked(stand_in_gpu, monkeypatch):
    monkeypatch.setenv("GDN_DISPATCH_JIT_LAUNCH", "1")
    calls = []
    kwargs = dict(g=torch.zeros(1), g_cum=torch.zeros(1), cu_seqlens=torch.zeros(2, dtype=torch.int32), N=1,
                  scale=1.0, s_g=1, HV=1, BT=64, BH=1)
    for _ in range(3):
        stand_in_gpu.launch_kept(cumsum._chunk_cumsum_fwd_kernel, (1,), (2, 1), kwargs,
                                 lambda: calls.append(1) or _StandInCompiled())
    assert calls == [1, 1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (the direct launch path runs compiled kernels)")
def test_later_calls_launch_the_kept_kernels_directly(monkeypatch):
    """Calls after the first of a specialization skip Triton's binder (kept kernels) and
    still match the reference, at other lengths and sequence counts."""
    from gdn_dispatch.backends import direct_launch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(direct_launch.JIT_LAUNCH_ENV, raising=False)
    shape = dict(H=2, HV=4, K=64, V=64)
    for seed, lengths in enumerate([[100, 3], [1, 64, 65, 0, 300], [4000], [7, 7, 7, 7, 7, 7, 7, 7, 7]]):
        call = random_call(lengths=lengths, **shape, dtype=torch.bfloat16, device="cuda", seed=seed)
        call.pop("cu_seqlens_cpu")
        problem = make_problem(**call, output_final_state=True)
        o, ht = tg.forward(problem)
        o_ref, ht_ref = reference.forward(problem)
        assert rel_rms_error(o, o_ref) <= TOL[torch.bfloat16], lengths
        assert rel_rms_error(ht, ht_ref) <= TOL[torch.bfloat16], lengths
    kept = [k for site in direct_launch._CALL_SITES.values() for k in site.kept.values()]
    if direct_launch._RUNTIME.verified:
        assert kept and all(k is not None for k in kept)
