"""The float32 torch oracle, and the ``reference`` backend.

Two independent formulations of the same function:

* :func:`forward_recurrent` walks the tokens one by one, exactly as the contract states
  the semantics (``S = S * exp(g_t); u = beta_t (v_t - S^T k_t); S = S + k_t u^T;
  o_t = scale * S^T q_t``).
* :func:`forward` (the backend entry point) walks chunks of ``C`` tokens in the WY form
  that the GPU kernels use, with the triangular system solved exactly.

Agreement of the two (to relative error 1e-5) is what lets the chunked one serve as the
oracle for every kernel at sizes where the per-token walk would be too slow.

With context parallelism planned for the call (:mod:`gdn_dispatch.context_parallel`), the
chunked form runs the segmented computation the kernels run: each segment's affine map
``S -> M S + N`` (:func:`segment_map`), the serial scan over a sequence's segments
(:func:`scan_segments`), then every segment's chunk walk from its exact start state. It
agrees with the unsegmented walk to float32 rounding, which the tests hold it to.
"""

from __future__ import annotations

import torch

from gdn_dispatch.context_parallel import plan_for_problem
from gdn_dispatch.contract import GATE_FLOOR, GDNProblem, StateLayout

L2NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, in x's dtype (fla's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _pool_slot(problem: GDNProblem, slots: list[int] | None, n: int) -> int | None:
    """Sequence ``n``'s pool row, or None (no pool, or an index outside [0, P): zeros in,
    nothing written back)."""
    if slots is None:
        return None
    slot = slots[n]
    return slot if 0 <= slot < problem.initial_state.shape[0] else None


def _sequence_inputs(problem: GDNProblem, n: int, bos: int, eos: int, slot: int | None = None):
    """Float32 inputs of sequence ``n`` (tokens ``bos:eos`` of the packed axis), q/k heads
    expanded to the v-heads. Returns q, k ``[L, HV, K]``, v ``[L, HV, V]``, g, beta
    ``[L, HV]``, and the initial state ``[HV, K, V]`` (zeros when none; with a state pool,
    pool row ``slot``, zeros when ``slot`` is None)."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, *t.shape[2:])[bos:eos].float()

    group = problem.HV // problem.H
    q, k = rows(problem.q), rows(problem.k)
    g = rows(problem.g).clamp_min(GATE_FLOOR)
    if problem.use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q.repeat_interleave(group, dim=1)
    k = k.repeat_interleave(group, dim=1)
    row = slot if problem.uses_state_pool else n
    if problem.initial_state is None or row is None:
        s0 = q.new_zeros(problem.HV, problem.K, problem.V)
    else:
        s0 = problem.initial_state[row].float()
        if problem.state_layout is StateLayout.VK:
            s0 = s0.transpose(-1, -2)
    return q, k, rows(problem.v), g, rows(problem.beta), s0.clone()


def _recurrent_sequence(q, k, v, g, beta, s, scale: float):
    """Per-token walk; shapes as :func:`_sequence_inputs`. Returns o ``[L, HV, V]`` and S."""
    o = v.new_empty(v.shape)
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], s))
        s = s + k[t][:, :, None] * u[:, None, :]
        o[t] = scale * torch.einsum("hk,hkv->hv", q[t], s)
    return o, s


def _chunked_sequence(q, k, v, g, beta, s, scale: float, chunk_size: int):
    """WY-form chunk walk; shapes as :func:`_sequence_inputs`. Returns o ``[L, HV, V]`` and S."""
    o = v.new_empty(v.shape)
    for c0 in range(0, q.shape[0], chunk_size):
        # [HV, C, *] per chunk so that every product below is a batched matmul over v-heads.
        qc, kc, vc = (x[c0:c0 + chunk_size].transpose(0, 1) for x in (q, k, v))
        gc = g[c0:c0 + chunk_size].transpose(0, 1).cumsum(-1)
        bc = beta[c0:c0 + chunk_size].transpose(0, 1)
        L = gc.shape[-1]
        decay = torch.exp(gc[:, :, None] - gc[:, None, :])
        strict = torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-1)
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        a = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).masked_fill(~strict, 0)
        eye = torch.eye(L, device=q.device).expand_as(a)
        w = torch.linalg.solve_triangular(eye + a, (bc * torch.exp(gc))[..., None] * kc, upper=False)
        u = torch.linalg.solve_triangular(eye + a, bc[..., None] * vc, upper=False)
        v_new = u - w @ s
        attn = ((qc @ kc.transpose(-1, -2)) * decay).masked_fill(~causal, 0)
        oc = scale * ((qc @ s) * torch.exp(gc)[..., None] + attn @ v_new)
        o[c0:c0 + chunk_size] = oc.transpose(0, 1)
        g_last = gc[:, -1:]
        s = s * torch.exp(g_last)[..., None] + kc.transpose(-1, -2) @ (v_new * torch.exp(g_last - gc)[..., None])
    return o, s


def segment_map(k, g, beta, v, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine map of a segment of tokens on the state: ``S_out = M @ S_in + N``.

    Parameters
    ----------
    k : float32 Tensor ``[L, HV, K]`` (normalized when the call asks), v ``[L, HV, V]``,
        g, beta ``[L, HV]``: the segment's tokens, ``L`` a multiple of ``chunk_size`` or the
        sequence's tail.

    Returns
    -------
    M : float32 Tensor ``[HV, K, K]``: the recurrence run from the identity with v = 0
        (the product of the tokens' ``exp(g_t) (I - beta_t k_t k_t^T)``).
    N : float32 Tensor ``[HV, K, V]``: the recurrence run from zeros (the segment's final
        state from a zero start).
    """
    HV, K = k.shape[1], k.shape[2]
    eye = torch.eye(K, dtype=torch.float32, device=k.device).expand(HV, K, K)
    q_unused = torch.zeros_like(k)
    _, M = _chunked_sequence(q_unused, k, torch.zeros_like(k), g, beta, eye.clone(), 1.0, chunk_size)
    _, N = _chunked_sequence(q_unused, k, v, g, beta, v.new_zeros(HV, K, v.shape[2]), 1.0, chunk_size)
    return M, N


def scan_segments(s0: torch.Tensor, maps) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Start states of a sequence's segments, in order, from its initial state ``s0``
    ``[HV, K, V]`` and the segments' ``(M, N)`` maps: ``S_next = M @ S + N``. Returns the
    list of start states and the state after the last segment."""
    starts, s = [], s0
    for M, N in maps:
        starts.append(s)
        s = M @ s + N
    return starts, s


def _segmented_sequence(q, k, v, g, beta, s, scale: float, chunk_size: int, seg_len: int):
    """The chunk walk of one sequence cut into segments of ``seg_len`` tokens: maps, scan,
    then each segment's walk from its start state. Shapes as :func:`_chunked_sequence`."""
    cuts = [(a, min(a + seg_len, q.shape[0])) for a in range(0, q.shape[0], seg_len)]
    maps = [segment_map(k[a:b], g[a:b], beta[a:b], v[a:b], chunk_size) for a, b in cuts]
    starts, final = scan_segments(s, maps)
    o = v.new_empty(v.shape)
    for (a, b), start in zip(cuts, starts):
        o[a:b], _ = _chunked_sequence(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], start, scale, chunk_size)
    return o, final


def _run(problem: GDNProblem, walk, o_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    o = torch.empty(problem.B * problem.T, problem.HV, problem.V, dtype=torch.float32, device=problem.device)
    final = []
    bounds = problem.chunks.cu_seqlens_host
    if bounds is None:
        bounds = problem.chunks.cu_seqlens.cpu()
    slots = problem.state_indices.tolist() if problem.uses_state_pool else None
    for n in range(problem.N):
        bos, eos = int(bounds[n]), int(bounds[n + 1])
        slot = _pool_slot(problem, slots, n)
        q, k, v, g, beta, s = _sequence_inputs(problem, n, bos, eos, slot)
        o_seq, s = walk(q, k, v, g, beta, s, problem.scale)
        o[bos:eos] = o_seq
        final.append(s)
        if problem.inplace_final_state and slot is not None:
            pool_row = s.transpose(-1, -2) if problem.state_layout is StateLayout.VK else s
            problem.initial_state[slot].copy_(pool_row)
    o = o.reshape(problem.B, problem.T, problem.HV, problem.V).to(o_dtype or problem.dtype)
    if not problem.output_final_state:
        return o, None
    state = torch.stack(final) if final else o.new_zeros(0, problem.HV, problem.K, problem.V, dtype=torch.float32)
    if problem.state_layout is StateLayout.VK:
        state = state.transpose(-1, -2)
    return o, state.contiguous()


def forward_recurrent(problem: GDNProblem) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-token recurrence: the contract's semantics, literally.

    Returns o ``[B, T, HV, V]`` in q's dtype and, when asked, the final state float32
    ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk").
    """
    return _run(problem, _recurrent_sequence)


def forward(problem: GDNProblem, selection=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked (C = 64) float32 computation; the ``reference`` backend's entry point.

    ``selection`` (the registry's :class:`~gdn_dispatch.registry.Selection`) gives the SM
    count that ``context_parallel="auto"`` decides from (none without it: "auto" is then
    off); a forced segment count runs the segmented computation. The computation runs on
    the tensors' device either way.

    Returns o ``[B, T, HV, V]`` in q's dtype and, when asked, the final state float32
    ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk").
    """
    size = problem.chunks.chunk_size
    sm_count = selection.device.sm_count if selection is not None else 0
    # A picked plan is the device's choice of a kernel backend; here it is "off".
    decision = plan_for_problem(problem, sm_count).unpicked("a kernel backend")
    if decision.enabled:
        return _run(problem, lambda *args: _segmented_sequence(*args, chunk_size=size, seg_len=decision.seg_len))
    return _run(problem, lambda *args: _chunked_sequence(*args, chunk_size=size))


def oracle(problem: GDNProblem) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`forward` (unsegmented) with o left in float32: what the tests measure a
    kernel's error against. Rounding the oracle's o to a 16-bit dtype first would add its
    own rounding (up to half a bf16 step, about 1.6e-3 relative RMS) to every measurement.

    Returns float32 o ``[B, T, HV, V]`` and, when asked, the final state as :func:`forward`.
    """
    size = problem.chunks.chunk_size
    return _run(problem, lambda *args: _chunked_sequence(*args, chunk_size=size), o_dtype=torch.float32)


def kernels_for_aot() -> list:
    """The reference backend has no kernels to compile."""
    return []
