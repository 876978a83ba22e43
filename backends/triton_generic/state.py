"""Stage 4: the chunk-state recurrence, the one serial stage.

Per sequence and value head, with S the [K, V] state at a chunk's start::

    h[c] = S;  v_new = u - w S;  S = 2^(g_last) S + k^T (2^(g_last - g) v_new)

One program owns one (sequence, v-head, BV slice of V) and walks the sequence's chunks with
its [BK, BV] fp32 slice of S in registers; the slices are independent because w S and
k^T v_new never mix columns of V. The loads of w, k, u and the gate do not depend on S, so
the software pipeliner (num_stages) fetches them ahead; what remains serial per chunk is
two MMAs. ``h`` (the state at every chunk start, for the output stage) is always stored
[K, V]; only the caller's initial and final states follow ``state_layout``, read and
written through a transposed view, never a copy.

The chunk step and the walk over a sequence's chunks are written once, here: context
parallelism's pass 1 (:mod:`.segment_map`) runs them on its own columns without storing,
and the scan (:mod:`.segment_scan`) reads and writes states with the helpers below.
"""

from __future__ import annotations

import torch
import triton.language as tl

from gdn_dispatch import varlen
from gdn_dispatch.contract import CHUNK_SIZE, empty_final_state
from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.triton_generic._jit import L2NORM_EPS, _cast, _dot, _prefetch_l2, interpreting, jit
from gdn_dispatch.backends.triton_generic.strides import token_stride
from gdn_dispatch.backends.triton_generic.configs import LaunchConfig, device_facts, launch, state_block_k, state_config
from gdn_dispatch.backends.triton_generic.kkt_solve import dot_precisions, interp_bf16_dots


@jit
def _state_ptrs(base, o_k, o_v, K: tl.constexpr, V: tl.constexpr, STATE_VK: tl.constexpr, k_rows):
    """Pointers and mask of a [BV, BK] ("vk") or [BK, BV] ("kv") tile of one [K, V] state;
    the mask admits the first ``k_rows`` rows of K (0: an empty mask, for a pool slot with
    no row: a scalar folded into the comparison, as a block mask & a scalar bool is not a
    bool mask under every Triton interpreter)."""
    if STATE_VK:
        p = base + o_v[:, None] * K + o_k[None, :]
        m = (o_v < V)[:, None] & (o_k < k_rows)[None, :]
    else:
        p = base + o_k[:, None] * V + o_v[None, :]
        m = (o_k < k_rows)[:, None] & (o_v < V)[None, :]
    return p, m


LONGEST_FIRST_SEQS = tl.constexpr(varlen.LONGEST_FIRST_SEQS)
CHUNK = tl.constexpr(CHUNK_SIZE)


@jit
def _longest_first(cu_seqlens, N, p, BT: tl.constexpr):
    """The sequence at position ``p`` of the batch walked longest first
    (:func:`gdn_dispatch.varlen.walk_order`, ``BT`` tokens a chunk): by chunk count, most
    first, ties in batch order; ``p`` itself for one sequence or more than
    ``LONGEST_FIRST_SEQS``.

    Each program finds its own entry: a bisection for the chunk count ``c`` at position
    ``p`` (the largest ``c`` more than ``p`` sequences reach; 25 halvings, unrolled), then
    the rank of ``p`` among the sequences of exactly ``c`` chunks by a prefix count.
    """
    # Straight-line code (no loop or branch around the search): the state kernels that call
    # this are at the register limit, and a loop here made ptxas spill their state tiles.
    r = tl.arange(0, LONGEST_FIRST_SEQS)
    live = r < N
    bos = tl.load(cu_seqlens + r, mask=live, other=0).to(tl.int32)
    eos = tl.load(cu_seqlens + r + 1, mask=live, other=0).to(tl.int32)
    nt = tl.where(live, (eos - bos + BT - 1) // BT, -1)
    p32 = p.to(tl.int32)
    # Invariant: more than p sequences reach lo chunks, at most p reach hi (chunk counts
    # stay below 2^25: B * T < 2^31, host-checked).
    lo = p32 * 0
    hi = lo + (1 << 25)
    for _ in tl.static_range(25):
        mid = (lo + hi) // 2
        reach = tl.sum(tl.where(nt >= mid, 1, 0), 0)
        lo = tl.where(reach > p32, mid, lo)
        hi = tl.where(reach > p32, hi, mid)
    tied = tl.where(nt == lo, 1, 0)
    q = p32 - tl.sum(tl.where(nt > lo, 1, 0), 0)
    rank = tl.cumsum(tied, 0) - 1
    found = tl.sum(tl.where((tied == 1) & (rank == q), r, 0), 0).to(tl.int64)
    i_n = tl.where((N > 1) & (N <= LONGEST_FIRST_SEQS), found, p)
    return i_n


@jit
def _sequence_program(cu_seqlens, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """This program's (V block, sequence x v-head, sequence, v-head) and its sequence's token
    bounds ``bos``, ``eos`` (int64). Axis 0 carries N * HV * NV, exactly (it may pass
    65535), the V block fastest: the blocks of one head stream the same rows at the same
    time, so L2 serves all but the first. With ``LONGEST_FIRST`` (the state kernel) the
    sequences are walked longest first (:func:`_longest_first`), else in batch order (the
    context-parallel scan, whose sequences are few and whose register budget the search
    overran with triton 3.9)."""
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_h = i_nh // HV, i_nh % HV
    if LONGEST_FIRST:
        i_n = _longest_first(cu_seqlens, tl.num_programs(0).to(tl.int64) // (HV * NV), i_n, CHUNK)
        i_nh = i_n * HV + i_h
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return i_v, i_nh, i_n, i_h, bos, eos


@jit
def _state_row(state_indices, P, i_n, K: tl.constexpr, USE_POOL: tl.constexpr):
    """Where sequence ``i_n``'s initial and final states live: its row of the initial /
    final states, or with a pool row ``state_indices[i_n]``, and the rows of K the row
    admits (K, or 0 for a pool index outside ``[0, P)``: no row)."""
    if USE_POOL:
        i_slot = tl.load(state_indices + i_n).to(tl.int64)
        has_row = (i_slot >= 0) & (i_slot < P)
        i_row = tl.where(has_row, i_slot, 0)
        k_rows = tl.where(has_row, K, 0)
    else:
        i_row = i_n
        k_rows = K
    return i_row, k_rows


@jit
def _start_state(h0, state_indices, P, i_n, i_h, o_k, o_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr, USE_POOL: tl.constexpr,
                 STATE_VK: tl.constexpr):
    """Sequence ``i_n``'s start state for v-head ``i_h``, a [BK, BV] fp32 tile ("kv" in
    registers whatever the layout), and where its final state goes back (``i_row``, and
    ``k_rows``: K, or 0 for no row).

    With a state pool the state lives in pool row ``state_indices[i_n]``; an index outside
    ``[0, P)`` (-1 marks CUDA-graph padding) starts from zeros and writes nothing back."""
    i_row, k_rows = _state_row(state_indices, P, i_n, K, USE_POOL)
    if USE_H0:
        p_s, m_s = _state_ptrs(h0 + (i_row * HV + i_h) * K * V, o_k, o_v, K, V, STATE_VK, k_rows)
        b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
        if STATE_VK:
            b_s = tl.trans(b_s)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    return b_s, i_row, k_rows


@jit
def _store_final_state(h0, ht, b_s, i_nh, i_row, i_h, k_rows, o_k, o_v, HV: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, INPLACE: tl.constexpr, STORE_HT: tl.constexpr, STATE_VK: tl.constexpr):
    """The final state ``b_s`` [BK, BV] in the caller's layout (transposed once for both
    destinations): into ``ht[i_nh]`` (fp32) with STORE_HT, into the pool row ``i_row`` (the
    pool's dtype; ``k_rows`` = 0: none) with INPLACE."""
    if STATE_VK:
        b_out = tl.trans(b_s)
    else:
        b_out = b_s
    if STORE_HT:
        p_s, m_s = _state_ptrs(ht + i_nh * K * V, o_k, o_v, K, V, STATE_VK, K)
        tl.store(p_s, b_out, mask=m_s)
    if INPLACE:
        p_s, m_s = _state_ptrs(h0 + (i_row * HV + i_h) * K * V, o_k, o_v, K, V, STATE_VK, k_rows)
        tl.store(p_s, b_out.to(h0.dtype.element_ty), mask=m_s)


@jit
def _chunk_step(k, w, u, g_cum, k_rnorm, h, v_new, b_s, s_k: tl.constexpr, t0, n_t, i_c, i_h, o_k, o_c, u_cols,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                STORE: tl.constexpr, USE_L2NORM: tl.constexpr, LOAD_RNORM: tl.constexpr, DOT_PREC: tl.constexpr,
                INTERP_BF16: tl.constexpr):
    """One chunk (first token ``t0``, ``n_t`` valid rows, chunk slot ``i_c``) of the
    recurrence on the [BK, BC] columns ``o_c`` of ``S``, ``u`` read in the columns below
    ``u_cols``: ``v_new = u - w S``; returns the next ``S``. With STORE (the state kernel,
    columns of V) ``h[i_c] = S`` and ``v_new`` are written; without (context parallelism's
    pass 1, whose columns may be M's) nothing is."""
    o_i = tl.arange(0, BT)
    m_t, m_k = o_i < n_t, o_k < K
    # S rounded to the data type, as h is stored, for the w S product.
    b_sc = _cast(b_s, k.dtype.element_ty, INTERP_BF16)
    if STORE:
        p_h = h + (i_c * HV + i_h) * (K * V) + o_k[:, None] * V + o_c[None, :]
        tl.store(p_h, b_sc, mask=m_k[:, None] & (o_c < V)[None, :])

    p_w = w + (t0 * HV + i_h) * K + o_i[:, None] * (HV * K) + o_k[None, :]
    b_w = tl.load(p_w, mask=m_t[:, None] & m_k[None, :], other=0.0)
    o_u = (t0 * HV + i_h) * V
    p_u = o_i[:, None] * (HV * V) + o_c[None, :]
    m_u = m_t[:, None] & (o_c < u_cols)[None, :]
    b_v = tl.load(u + o_u + p_u, mask=m_u, other=0.0).to(tl.float32)
    b_v -= _dot(b_w, b_sc, tl.zeros_like(b_v), DOT_PREC, INTERP_BF16)
    if STORE:
        tl.store(v_new + o_u + p_u, _cast(b_v, v_new.dtype.element_ty, INTERP_BF16), mask=m_u)

    # Decay to the chunk's last token: the state by 2^g_last, each token's update by
    # 2^(g_last - g_t) (and by 1/||k_t|| with the fused l2-norm).
    p_g = g_cum + t0 * HV + i_h
    b_g_last = tl.load(p_g + (n_t - 1) * HV)
    b_g = tl.load(p_g + o_i * HV, mask=m_t, other=0.0)
    b_d = tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)
    p_k = k + t0 * s_k + (i_h // (HV // H)) * K + o_i[None, :] * s_k + o_k[:, None]
    b_kt = tl.load(p_k, mask=m_k[:, None] & m_t[None, :], other=0.0)
    if LOAD_RNORM:
        b_rk = tl.load(k_rnorm + t0 * HV + i_h + o_i * HV, mask=m_t, other=0.0)
    elif USE_L2NORM:
        b_kf = b_kt.to(tl.float32)
        b_rk = tl.rsqrt(tl.sum(b_kf * b_kf, axis=0) + L2NORM_EPS)
    if (LOAD_RNORM or USE_L2NORM) and k.dtype.element_ty == tl.float16:
        # fp16: k's columns normalized, not v_new's rows scaled by 1/||k||, which for long
        # keys fall into fp16's subnormals when rounded (bf16 has float32's range).
        b_kt = _cast(b_kt.to(tl.float32) * b_rk[None, :], k.dtype.element_ty, INTERP_BF16)
    elif LOAD_RNORM or USE_L2NORM:
        b_d = b_d * b_rk
    b_v = _cast(b_v * b_d[:, None], k.dtype.element_ty, INTERP_BF16)
    return _dot(b_kt, b_v, b_s * tl.exp2(b_g_last), DOT_PREC, INTERP_BF16)


@jit
def _prefetch_chunk(k, w, u, t0, eos, i_h, i_pf, n_pf, s_k: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """Ask the L2 for the chunk at token ``t0``'s rows of w, k and u (none past ``eos``), two
    lines a row. The ``n_pf`` programs that walk the same rows (the column blocks of one
    head) share the work: program ``i_pf`` takes the tensors ``j`` with ``j % n_pf == i_pf``."""
    o_l = tl.arange(0, 2 * BT)
    row = tl.minimum(t0 + o_l // 2, eos - 1)
    live = t0 < eos
    mine = i_pf % n_pf
    _prefetch_l2(w + (row * HV + i_h) * K + (o_l % 2) * (K // 2),
                 tl.where(live & (mine == 0), 1, 0) + o_l * 0)
    _prefetch_l2(k + row * s_k + (i_h // (HV // H)) * K + (o_l % 2) * (K // 2),
                 tl.where(live & (mine == 1 % n_pf), 1, 0) + o_l * 0)
    _prefetch_l2(u + (row * HV + i_h) * V + (o_l % 2) * (V // 2),
                 tl.where(live & (mine == 2 % n_pf), 1, 0) + o_l * 0)


@jit
def _walk_chunks(k, w, u, g_cum, k_rnorm, h, v_new, b_s, s_k: tl.constexpr, bos, eos, i_c0, i_h, o_k, o_c, u_cols,
                 i_pf, n_pf, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 STORE: tl.constexpr, USE_L2NORM: tl.constexpr, LOAD_RNORM: tl.constexpr, DOT_PREC: tl.constexpr,
                 INTERP_BF16: tl.constexpr, INTERPRET: tl.constexpr, PREFETCH: tl.constexpr):
    """``S`` after the chunks of tokens ``[bos, eos)`` (chunk slots from ``i_c0``), from
    ``S = b_s``: :func:`_chunk_step` in order. The loads of w, k, u and the gate do not
    depend on S, so the software pipeliner (num_stages) fetches the next chunk's ahead; with
    ``PREFETCH = P > 0`` each step also asks the L2 for the rows ``P`` chunks ahead
    (:func:`_prefetch_chunk`, shared by the ``n_pf`` programs of one head, this one being
    ``i_pf``), for walks that wait on their loads with the pipeliner's one chunk of lead
    (:data:`.segment_map.L2_PREFETCH_CHUNKS`)."""
    NT = tl.cdiv(eos - bos, BT)
    if INTERPRET:
        # triton 3.6's interpreter cannot range() over a loaded bound under numpy >= 2.4
        # (int() of a 1-element array); a while loop reads the bound as a bool instead.
        i_t = 0
        while i_t < NT:
            t0 = bos + i_t * BT
            n_t = tl.minimum(eos - t0, BT).to(tl.int32)
            b_s = _chunk_step(k, w, u, g_cum, k_rnorm, h, v_new, b_s, s_k, t0, n_t, i_c0 + i_t, i_h, o_k, o_c,
                              u_cols, H, HV, K, V, BT, STORE, USE_L2NORM, LOAD_RNORM, DOT_PREC, INTERP_BF16)
            i_t += 1
    else:
        if PREFETCH > 0:
            for i_p in tl.static_range(1, PREFETCH):
                _prefetch_chunk(k, w, u, bos + i_p * BT, eos, i_h, i_pf, n_pf, s_k, H, HV, K, V, BT)
        for i_t in range(NT):
            t0 = bos + i_t * BT
            if PREFETCH > 0:
                _prefetch_chunk(k, w, u, t0 + PREFETCH * BT, eos, i_h, i_pf, n_pf, s_k, H, HV, K, V, BT)
            n_t = tl.minimum(eos - t0, BT).to(tl.int32)
            b_s = _chunk_step(k, w, u, g_cum, k_rnorm, h, v_new, b_s, s_k, t0, n_t, i_c0 + i_t, i_h, o_k, o_c,
                              u_cols, H, HV, K, V, BT, STORE, USE_L2NORM, LOAD_RNORM, DOT_PREC, INTERP_BF16)
    return b_s


@jit(do_not_specialize=("P",))
def _state_fwd_kernel(
    k,
    w,
    u,
    g_cum,
    k_rnorm,
    h,
    v_new,
    h0,
    ht,
    cu_seqlens,
    state_indices,
    s_k: tl.constexpr,
    P,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    USE_POOL: tl.constexpr,
    INPLACE: tl.constexpr,
    STORE_HT: tl.constexpr,
    STATE_VK: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    LOAD_RNORM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    i_v, i_nh, i_n, i_h, bos, eos = _sequence_program(cu_seqlens, HV, V, BV, True)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    b_h, i_row, k_rows = _start_state(h0, state_indices, P, i_n, i_h, o_k, o_v, HV, K, V, BK, BV, USE_H0, USE_POOL,
                                      STATE_VK)
    i_c0 = bos // BT + i_n  # the sequence's first chunk slot, where its h rows start
    # No L2 prefetch: with a program per (sequence, v-head, V slice) filling the GPU it made
    # the H200's state kernel slower (H16-HV32 4 x 8192: 419 -> 558 µs at 3 chunks ahead).
    b_h = _walk_chunks(k, w, u, g_cum, k_rnorm, h, v_new, b_h, s_k, bos, eos, i_c0, i_h, o_k, o_v, V, i_v, 1,
                       H, HV, K, V, BT, True, USE_L2NORM, LOAD_RNORM, DOT_PREC, INTERP_BF16, INTERPRET, 0)
    _store_final_state(h0, ht, b_h, i_nh, i_row, i_h, k_rows, o_k, o_v, HV, K, V, INPLACE, STORE_HT, STATE_VK)


def state_fwd(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g_cum: torch.Tensor,
    chunks: ChunkTable,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_vk: bool = False,
    use_qk_l2norm: bool = False,
    k_rnorm: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    sm_count: int | None = None,
    config: LaunchConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the recurrence over every sequence's chunks.

    Parameters
    ----------
    k : Tensor ``[B, T, H, K]``, bf16/fp16/fp32, in token rows (any token stride).
    w : Tensor ``[B, T, HV, K]``, k's dtype (from :func:`wu_fwd`).
    u : Tensor ``[B, T, HV, V]``, k's dtype (from :func:`wu_fwd`).
    g_cum : float32 Tensor ``[B, T, HV]``, chunk-local gate cumsum in log2 units.
    chunks : ChunkTable of the call.
    initial_state : Tensor ``[N, HV, K, V]`` (``state_vk=False``) or ``[N, HV, V, K]``
        (``state_vk=True``), any float dtype, contiguous; None means zeros. With
        ``state_indices``, the state pool ``[P, HV, K, V]`` / ``[P, HV, V, K]``.
    output_final_state : also return the state after each sequence's last token.
    state_vk : layout of initial_state and of the final state.
    use_qk_l2norm : k rows are l2-normalized (eps 1e-6) before use.
    k_rnorm : float32 Tensor ``[B, T, HV]`` from :func:`wu_fwd`, or None to reduce k's rows
        here (inside the serial chunk loop: slower).
    state_indices : int Tensor ``[N]`` or None: sequence ``n`` starts from pool row
        ``state_indices[n]`` (zeros for an index outside ``[0, P)``).
    inplace_final_state : with ``state_indices``, write each final state back to its pool
        row (in the pool's dtype; none for an index outside ``[0, P)``).
    sm_count : int or None, the multiprocessors the default config fills (the registry's
        device facts, as the context-parallel plan reads them); None: the tensors' device's.
    config : LaunchConfig override (BV, num_warps, num_stages); default from the table.

    Returns
    -------
    h : Tensor ``[NS, HV, K, V]``, k's dtype: the state at the start of every chunk, by
        chunk slot (:mod:`gdn_dispatch.varlen`; idle slots are not written), always [K, V].
    v_new : Tensor ``[B, T, HV, V]``, k's dtype: ``u - w h``.
    final_state : float32 Tensor ``[N, HV, K, V]`` or ``[N, HV, V, K]``, or None. A
        zero-length sequence's final state is its initial state.
    """
    H, K = k.shape[-2], k.shape[-1]
    HV, V, BT = u.shape[-2], u.shape[-1], chunks.chunk_size
    N = chunks.num_seqs
    h, v_new, final_state = state_buffers(k, u, chunks.num_slots, N, output_final_state, state_vk, out)
    if N * HV == 0:
        return h, v_new, final_state
    capability, device_sms = device_facts(k.device)
    cfg = config or state_config(K, V, N * HV, k.element_size(), capability,
                                 device_sms if sm_count is None else sm_count)
    grid = (N * HV * -(-V // cfg.BV),)
    launch(_state_fwd_kernel, grid, cfg, **state_launch_args(
        cfg, k.dtype, k, w, u, g_cum, k_rnorm if k_rnorm is not None else g_cum, h, v_new,
        initial_state if initial_state is not None else g_cum, final_state if final_state is not None else g_cum,
        chunks.cu_seqlens, state_indices if state_indices is not None else chunks.cu_seqlens, token_stride("k", k),
        initial_state.shape[0] if state_indices is not None else 0, H, HV, K, V, BT,
        use_h0=initial_state is not None, use_pool=state_indices is not None,
        inplace=state_indices is not None and inplace_final_state, store_ht=final_state is not None,
        state_vk=state_vk, use_qk_l2norm=use_qk_l2norm, load_rnorm=use_qk_l2norm and k_rnorm is not None))
    return h, v_new, final_state


def state_buffers(k: torch.Tensor, u: torch.Tensor, num_slots: int, N: int, output_final_state: bool, state_vk: bool,
                  out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What a state kernel writes: h ``[num_slots, HV, K, V]`` and v_new (u's shape) in k's
    dtype, the float32 final state of ``N`` sequences (None unless ``output_final_state``);
    ``out`` where the caller allocated them (as returned)."""
    if out is not None:
        return tuple(out)
    HV, K, V = u.shape[-2], k.shape[-1], u.shape[-1]
    return (torch.empty(num_slots, HV, K, V, dtype=k.dtype, device=k.device), torch.empty_like(u),
            empty_final_state(output_final_state, N, HV, K, V, state_vk, k.device))


def state_launch_args(cfg, dtype, k, w, u, g_cum, k_rnorm, h, v_new, h0, ht, cu_seqlens, state_indices, s_k, P,
                      H, HV, K, V, BT, *, use_h0, use_pool, inplace, store_ht, state_vk, use_qk_l2norm, load_rnorm
                      ) -> dict:
    """Every argument of one ``_state_fwd_kernel`` launch by name, the unused pointers
    already replaced by a stand-in (what :func:`state_fwd` launches with;
    :mod:`.call_program` binds the same list)."""
    dot_prec, _ = dot_precisions(dtype)
    return dict(
        k=k, w=w, u=u, g_cum=g_cum, k_rnorm=k_rnorm, h=h, v_new=v_new, h0=h0, ht=ht, cu_seqlens=cu_seqlens,
        state_indices=state_indices, s_k=s_k, P=P, H=H, HV=HV, K=K, V=V, BT=BT, BK=state_block_k(K),
        BV=cfg.BV, USE_H0=use_h0, USE_POOL=use_pool, INPLACE=inplace, STORE_HT=store_ht, STATE_VK=state_vk,
        USE_L2NORM=use_qk_l2norm, LOAD_RNORM=load_rnorm, DOT_PREC=dot_prec, INTERP_BF16=interp_bf16_dots(dtype),
        INTERPRET=interpreting())
