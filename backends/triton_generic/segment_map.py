"""Context parallelism, pass 1: the affine map of every segment on the state.

Per segment and value head the chunk recurrence maps a start state ``S`` ``[K, V]`` to
``M S + N``. ``N`` is the recurrence run from zeros; ``M`` ``[K, K]`` is the same
recurrence run on a ``K x K`` identity with ``u = 0`` (the columns of a state never mix, so
each of M's columns is one more "value" column whose update has no ``u`` term)::

    v_new = u - w S;  S = 2^(g_last) S + k^T (2^(g_last - g) v_new)     (u = 0 in M's columns)

One program owns one (segment slot, v-head, BC-wide block of the ``V + K`` columns): a
block in the first ``V`` columns walks ``N`` from zeros, one in the last ``K`` columns
walks ``M`` from the identity, both with the state kernel's own chunk walk
(:func:`.state._walk_chunks`, its stores off). Nothing per chunk is stored (no ``h``, no
``v_new``): the segment's chunks are walked again in pass 2 from the exact start state. An
empty segment's program stores the identity and zeros: the scan's whole-M step skips such
slots' products (they leave the state as it is) and pass 2 runs them as empty sequences.

Segment slots (:mod:`gdn_dispatch.context_parallel`): with segments of ``L`` tokens,
sequence ``n`` owns the slots ``[cu[n] // L + n, cu[n + 1] // L + n + 1)``; its segment
``j`` starts at token ``cu[n] + j * L`` (clamped to the sequence's end, so the slots past
its tail are empty segments). Each program finds its slot's sequence in ``cu_seqlens`` (a
bisection, :func:`_segment_bounds`), so pass 1 needs no table before it, and its programs
of column block 0 and v-head 0 write the slot starts as offsets ``seg_cu`` ``[NSEG + 1]``
for the launches after it (the scan reads the call's offsets; pass 2 runs the segments as
its sequences): from ``cu_seqlens`` alone, on the device, with no host copy and no sync.

With ``beta`` (the backend's segmented calls pass it) pass 1 drops what a segment
provably forgets, by the rule of the Gluon backends' pass 1
(:mod:`gdn_dispatch.backends.gluon_common.segment_map`): a launch before it
(:func:`_forgetting_start_kernel`, one program per segment slot and v-head) finds the
segment's shortest suffix of chunks whose map on the state is provably below
2^:data:`MAP_NEGLIGIBLE_LOG2` in norm (the gates summed per chunk from the back, then beta
and k's row norms over the suffix) and writes its first chunk, or -1. Where there is one,
pass 1 stores M as zeros without a walk and walks N over the suffix alone, from zeros: the
maps differ from the exact ones by under 2^-40 of the dropped state, and what the dropped
stretch holds, NaN included, does not reach the segment's end. The rule is a launch of its
own because pass 1's walk fills the register file: with the rule inlined, the qk-l2-norm
build spilled on sm_80 / sm_86 / sm_89 under triton 3.9, while one scalar load of the start
chunk leaves it as it was.

M is stored split for the scan's products: ``M_hi`` (fp32 values rounded to TF32) and
``M_lo = M - M_hi`` in bf16, 6 bytes per entry, together M to about 2^-19 of each entry.
With :data:`BF16_MAPS` a call on 16-bit data stores ``M_hi`` in bf16 too (4 bytes an
entry, M to about 2^-17; the scan then multiplies on bf16 parts alone).
The scan multiplies both parts on the tensor cores straight from shared memory (three
products per step with S's own split), where a fp32 M would be split in registers at
every step; the bf16 part keeps the two of them small enough for the scan to stream the
next segment's while it multiplies this one.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from gdn_dispatch.backends.triton_generic._jit import (
    _bf16_round, _cast, _tf32_round, interpreting, jit, next_pow2)
from gdn_dispatch.backends.triton_generic.configs import LaunchConfig, MIN_TILE, device_facts, launch, state_block_k
from gdn_dispatch.backends.triton_generic.kkt_solve import dot_precisions, interp_bf16_dots
from gdn_dispatch.backends.triton_generic.state import _walk_chunks
from gdn_dispatch.backends.triton_generic.strides import token_stride


@jit
def _slot_sequence(cu_seqlens, N, L, slot):
    """The sequence ``n`` that owns segment slot ``slot`` and its token bounds ``(n, bos,
    eos)``: the largest ``n`` with ``cu[n] // L + n <= slot``, found by bisection over ``[0,
    N)`` (``ceil(log2(N))`` halvings counted at run time, keeping ``cu[lo] // L + lo <=
    slot``). Its slots are ``bos // L + n .. eos // L + n``."""
    lo = slot * 0
    hi = lo + N
    span = N * 0 + 1
    while span < N:
        mid = (lo + hi) // 2
        below = tl.load(cu_seqlens + mid).to(tl.int64) // L + mid <= slot
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
        span *= 2
    seq_bos = tl.load(cu_seqlens + lo).to(tl.int64)
    seq_eos = tl.load(cu_seqlens + lo + 1).to(tl.int64)
    return lo, seq_bos, seq_eos


@jit
def _segment_bounds(cu_seqlens, N, L, slot):
    """``(bos, eos)`` of segment slot ``slot``: the segment starts ``slot - (cu[n] // L +
    n)`` lengths ``L`` into its sequence ``n`` (:func:`_slot_sequence`) and ends ``L``
    later, both clamped to the sequence's end."""
    n, seq_bos, seq_eos = _slot_sequence(cu_seqlens, N, L, slot)
    start = seq_bos + (slot - (seq_bos // L + n)) * L
    return tl.minimum(start, seq_eos), tl.minimum(start + L, seq_eos)


@jit
def _gate_suffix(g_cum, bos, eos, i_h, HV: tl.constexpr, BT: tl.constexpr, NEGLIGIBLE_LOG2: tl.constexpr,
                 CB: tl.constexpr):
    """The largest chunk ``c`` of the segment ``bos .. eos`` whose suffix of chunks ``c ..``
    sums its gates (log2 units) below ``NEGLIGIBLE_LOG2``, or -1. A chunk's sum is the last
    row of its chunk-local cumsum; chunks are read ``CB`` at a time from the back, the sum
    of the blocks after carried (while loops: the interpreter cannot range() over a loaded
    bound)."""
    NT = (eos - bos + BT - 1) // BT
    c0 = NT * 0 - 1
    carry = tl.sum(tl.zeros([CB], tl.float32), 0)
    blk = (NT + CB - 1) // CB
    while blk > 0:
        blk -= 1
        c = blk * CB + tl.arange(0, CB)
        live = c < NT
        last = bos + tl.minimum((c + 1) * BT, eos - bos) - 1
        g_c = tl.load(g_cum + last * HV + i_h, mask=live, other=0.0)
        suffix = tl.cumsum(g_c, 0, reverse=True) + carry
        c0 = tl.maximum(c0, tl.max(tl.where(live & (suffix < NEGLIGIBLE_LOG2), c, -1), 0))
        carry += tl.sum(g_c, 0)
    return c0


@jit(do_not_specialize=("N", "L"))
def _forgetting_start_kernel(
    g_cum,
    beta,
    k,
    cu_seqlens,
    f_start,
    chain_flags,
    N,
    L,
    s_b: tl.constexpr,
    s_k: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    NEGLIGIBLE_LOG2: tl.constexpr,
    CHAIN: tl.constexpr,
):
    """``f_start[slot * HV + h]``: the first chunk of segment slot ``slot``'s shortest suffix
    of chunks whose map on v-head ``h``'s state is provably below ``2^NEGLIGIBLE_LOG2`` in
    norm, or -1 (stored in ``f_start``'s dtype). The suffix from the gates, then over its
    tokens ``min beta >= 0`` and ``max beta * max ||k||^2 <= 2`` (``||k||^2 <= 1`` after
    the l2 norm): each token's factor ``I - beta k k^T`` then has norm at most 1, so the
    suffix's map is bounded by its decay. A NaN beta counts as negative and a NaN key norm
    as infinite, so a NaN in the suffix keeps the whole segment walked.

    With ``CHAIN`` (chained segments, :mod:`.segment_chain`) it also zeroes the hand-over
    count of its (slot, v-head), ``chain_flags[slot * HV + h]``, and program 0 the ticket
    after them, ``chain_flags[NSEG * HV]``: pass 2 starts from a clean slate on every call
    (a CUDA graph's replay included) without a launch of its own."""
    pid = tl.program_id(0).to(tl.int64)
    if CHAIN:
        tl.store(chain_flags + pid, 0)
        tl.store(chain_flags + tl.num_programs(0), 0, mask=pid == 0)
    i_h = pid % HV
    bos, eos = _segment_bounds(cu_seqlens, N, L, pid // HV)
    c0 = _gate_suffix(g_cum, bos, eos, i_h, HV, BT, NEGLIGIBLE_LOG2, 128)
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    b_min = tl.sum(tl.zeros([BT], tl.float32), 0)
    b_max = b_min
    if USE_L2NORM:
        x_max = b_min + 1.0
    else:
        x_max = b_min
    r = bos + tl.maximum(c0, 0) * BT
    while (c0 >= 0) & (r < eos):
        rows = r + o_i
        live = rows < eos
        b = tl.load(beta + rows * s_b + i_h, mask=live, other=0.0).to(tl.float32)
        b = tl.where(b == b, b, -1.0)  # min and max drop a NaN operand
        b_min = tl.minimum(b_min, tl.min(b, 0))
        b_max = tl.maximum(b_max, tl.max(b, 0))
        if not USE_L2NORM:
            kt = tl.load(k + rows[:, None] * s_k + (i_h // (HV // H)) * K + o_k[None, :],
                         mask=live[:, None] & (o_k < K)[None, :], other=0.0).to(tl.float32)
            x = tl.sum(kt * kt, 1)
            x_max = tl.maximum(x_max, tl.max(tl.where(live, tl.where(x == x, x, float("inf")), 0.0), 0))
        r += BT
    f0 = tl.where((c0 >= 0) & (b_min >= 0.0) & (b_max * x_max <= 2.0), c0, -1)
    tl.store(f_start + pid, f0.to(f_start.dtype.element_ty))


@jit(do_not_specialize=("N", "NSEG", "L"))
def _segment_map_fwd_kernel(
    k,
    w,
    u,
    g_cum,
    k_rnorm,
    f_start,
    cu_seqlens,
    seg_cu,
    N,
    NSEG,
    L,
    m_hi,
    m_lo,
    n_out,
    s_k: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BC: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    LOAD_RNORM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
    PREFETCH: tl.constexpr,
    FORGET: tl.constexpr,
    CHAIN: tl.constexpr,
):
    # Axis 0: (segment slot, v-head, column block), the column block fastest: the blocks of
    # one head stream the same w and k rows at the same time. CHAIN: N's blocks alone.
    NVB: tl.constexpr = (V + BC - 1) // BC
    NCB: tl.constexpr = NVB + (0 if CHAIN else (K + BC - 1) // BC)
    pid = tl.program_id(0).to(tl.int64)
    i_cb, i_sh = pid % NCB, pid // NCB
    i_h = i_sh % HV
    slot = i_sh // HV
    bos, eos = _segment_bounds(cu_seqlens, N, L, slot)
    # The table for the launches after this one (the last slot's end is the token axis's):
    # predicated stores, since a branch here kept values live into the walk (spills on sm_80).
    writer = (i_cb == 0) & (i_h == 0)
    tl.store(seg_cu + slot, bos.to(seg_cu.dtype.element_ty), mask=writer)
    tl.store(seg_cu + NSEG, eos.to(seg_cu.dtype.element_ty), mask=writer & (slot == NSEG - 1))
    is_m = i_cb >= NVB
    o_k = tl.arange(0, BK)
    o_c = tl.where(is_m, i_cb - NVB, i_cb) * BC + tl.arange(0, BC)
    # Column limits folded into comparisons (a block mask & a scalar bool is not a bool
    # mask under every Triton interpreter): M's columns are < K, N's < V, u feeds N only.
    m_cols = tl.where(is_m, K, 0)
    n_cols = tl.where(is_m, 0, V)
    # With FORGET, from the first chunk f0 of the segment's forgetting suffix (written by
    # _forgetting_start_kernel; -1: none) M is zeros, no walk, and N walks the suffix alone.
    if FORGET:
        f0 = tl.load(f_start + i_sh).to(tl.int64)
    else:
        f0 = bos * 0 - 1
    # CHAIN: a segment that does not forget is not walked (pass 2 hands its state on).
    start = tl.where(f0 < 0, eos if CHAIN else bos, tl.where(is_m, eos, bos + f0 * BT))
    b_s = tl.where((o_k[:, None] == o_c[None, :]) & (o_c < tl.where(f0 < 0, m_cols, 0))[None, :], 1.0, 0.0)

    # The state kernel's walk without its stores (h and v_new are not written: m_hi and
    # n_out stand in for them).
    b_s = _walk_chunks(k, w, u, g_cum, k_rnorm, m_hi, n_out, b_s, s_k, start, eos, 0, i_h, o_k, o_c, n_cols, i_cb,
                       NCB, H, HV, K, V, BT, False, USE_L2NORM, LOAD_RNORM, DOT_PREC, INTERP_BF16, INTERPRET,
                       PREFETCH)

    m_k = (o_k < K)[:, None]
    at_m = i_sh * (K * K) + o_k[:, None] * K + o_c[None, :]
    m_m = m_k & (o_c < m_cols)[None, :]
    if m_hi.dtype.element_ty == tl.bfloat16:
        b_hi = _bf16_round(b_s)  # exact in M_hi's bf16
    else:
        b_hi = _tf32_round(b_s)
    tl.store(m_hi + at_m, b_hi, mask=m_m)
    tl.store(m_lo + at_m, _cast(b_s - b_hi, tl.bfloat16, INTERPRET), mask=m_m)
    tl.store(n_out + i_sh * (K * V) + o_k[:, None] * V + o_c[None, :], b_s, mask=m_k & (o_c < n_cols)[None, :])


#: log2 of the norm below which a suffix's map forgets the state it starts from (pass 1's
#: ``FORGET`` rule, :func:`_forgetting_start_kernel`, and the Gluon pass 1's): below 2^-40
#: that state reaches the segment's end under 1e-12 of its norm, far under the float32
#: rounding of the walks. Gates that forget within one chunk (the bench's logsigmoid(randn)
#: gates, about -1.2 bits a token) leave M's programs nothing to walk and N's one chunk.
MAP_NEGLIGIBLE_LOG2 = -40.0

#: Calls on bf16/fp16 data store M's leading part in bf16 instead of TF32-rounded fp32
#: (:func:`maps_dtype`): the scan streams 64 KB of M per step and segment at K = 128
#: instead of 96 KB and multiplies on bf16 operands (three products per step as before,
#: half the k-steps of TF32's), with M and the state each split into two bf16 parts: about
#: 2^-17 of each entry against 2^-19, far below the 2^-9 to which pass 1 and pass 2 round
#: the state in their own products. float32 calls keep the finer split (their segmented
#: results agree with the unsegmented ones to 1e-6). Off: on the H200 it saves 10-14 µs of
#: scan per tensor-parallel segmented call (``python benchmarks/flag_ab.py bf16_maps``,
#: benchmarks/RESULTS.md) and a 16-bit call's segmented states would agree with the
#: unsegmented ones to about 1e-5 rather than float32 rounding (the public docstring of
#: ``context_parallel`` would then have to say so).
BF16_MAPS = False


#: Chunks ahead of its step at which each pass-1 program asks the L2 for w, k and u on sm_90
#: (its share of them: :func:`.state._prefetch_chunk`). On the H200 the chain with every
#: chunk's tiles already on chip takes 36 µs of pass 1's 63 at 2/4 (``python
#: benchmarks/chain_probe.py``): the walk waits on its loads. Two chunks ahead gave 66.1 ->
#: 61.5 µs at 2/4, 125.1 -> 118.7 at 4/8, 238.1 -> 232.4 at 8/16; 3, 4, 6 and 8 less
#: (benchmarks/RESULTS.md). Other parts have no measurement, and sm_80's l2-norm build
#: spills with it: none there (:func:`l2_prefetch_chunks`).
L2_PREFETCH_CHUNKS = 2


def l2_prefetch_chunks(capability: tuple[int, int] | None) -> int:
    """Pass 1's L2 prefetch distance in chunks on a part of ``capability`` (0: none; None,
    the interpreter: none)."""
    return L2_PREFETCH_CHUNKS if capability is not None and tuple(capability) == (9, 0) else 0


def maps_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``M_hi`` that pass 1 writes for a call on ``dtype`` data."""
    return torch.bfloat16 if BF16_MAPS and dtype != torch.float32 else torch.float32


@functools.lru_cache(maxsize=64)  # one per head shape: the segmented call's host path reads it per call
def segment_map_config(K: int, V: int) -> LaunchConfig:
    """Pass 1, one program per (segment, v-head, BC columns of V + K): the whole K extent
    in registers as in the state kernel, BC up to 64 with BK * BC <= 8192 (64 fp32
    registers per thread at 4 warps); the next chunk's tiles load during this one."""
    BK = state_block_k(K)
    BC = max(MIN_TILE, min(next_pow2(max(K, V)), 64, 8192 // BK))
    return LaunchConfig(num_warps=4, num_stages=2, BK=BK, BV=BC)


def segment_map_fwd(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g_cum: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seg_len: int,
    *,
    use_qk_l2norm: bool = False,
    k_rnorm: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    f_start: torch.Tensor | None = None,
    chain_flags: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The segment offsets, and the affine map ``S -> M S + N`` of every segment and value
    head, M split in two; with ``beta``, but for what a segment provably forgets (module
    docstring): where a suffix of its chunks maps the state below
    2^:data:`MAP_NEGLIGIBLE_LOG2` in norm, M is zeros and N the suffix's walk from zeros.

    Parameters
    ----------
    k : Tensor ``[B, T, H, K]``, bf16/fp16/fp32, in token rows (any token stride).
    w, u : Tensors ``[B, T, HV, K]``, ``[B, T, HV, V]``, k's dtype (from ``wu_fwd``).
    g_cum : float32 Tensor ``[B, T, HV]``, chunk-local gate cumsum in log2 units.
    cu_seqlens : int32/int64 Tensor ``[N + 1]``, the call's sequence offsets (device).
    seg_len : int, ``L``, a multiple of the 64-token chunk.
    use_qk_l2norm : k rows are l2-normalized (eps 1e-6) before use.
    k_rnorm : float32 Tensor ``[B, T, HV]`` from ``wu_fwd``, or None to reduce k's rows here.
    beta : Tensor ``[B, T, HV]``, the call's (any float dtype, token rows), or None for the
        exact maps (every chunk walked).
    f_start : with ``beta``, float32 or int32 Tensor of at least ``NSEG * HV`` contiguous
        entries for the forgetting starts (the launch before pass 1 writes them, pass 1
        reads them), or None to allocate them here. A segmented call lends its scan's start
        states, which the scan writes only after pass 1 has read them.
    chain_flags : int32 Tensor of at least ``NSEG * HV + 1`` contiguous entries, or None.
        Given, the maps of chained segments (:mod:`.segment_chain`; needs ``beta``): no M
        (``M_hi``, ``M_lo`` come back None), N only where a segment forgets its start (the
        other segments' N is pass 2's to write), and the flags zeroed for pass 2.
    config : LaunchConfig override (BV is the column block BC).
    out : (seg_cu, M_hi, M_lo, N) allocated by the caller (contiguous, as returned below;
        M_hi and M_lo None with ``chain_flags``), or None to allocate them here.

    Returns
    -------
    seg_cu : Tensor ``[NSEG + 1]`` of cu_seqlens's dtype, ``NSEG = B * T // L + N``:
        ``seg_cu[s]`` is the first token of segment slot ``s``, ``seg_cu[NSEG] = B * T``
        (every segment a whole number of chunks of its sequence, the last one its tail, or
        empty).
    M_hi : float32 Tensor ``[NSEG, HV, K, K]``, M rounded to TF32 (bfloat16, M rounded to
        bf16, where :func:`maps_dtype` says so); the identity for an empty segment; zeros
        (with ``beta``) where the segment forgets its start.
    M_lo : bfloat16 Tensor ``[NSEG, HV, K, K]``, ``M - M_hi`` rounded to bf16.
    N : float32 Tensor ``[NSEG, HV, K, V]``; zeros for an empty segment; with ``beta``,
        where the segment forgets its start, the walk of the forgetting suffix alone.
    """
    B, T, H, K = k.shape
    HV, V = u.shape[-2], u.shape[-1]
    N = cu_seqlens.shape[0] - 1
    chain = chain_flags is not None
    if chain and beta is None:
        raise ValueError("chain_flags: chained segments need beta (pass 1 maps only the segments that forget)")
    NSEG, (seg_cu, m_hi, m_lo, n_out) = maps_buffers(k, u, cu_seqlens, seg_len, out, chain=chain)
    if NSEG == 0:  # no sequence and no token: the table is [0]
        return seg_cu.zero_(), m_hi, m_lo, n_out
    cfg = config or segment_map_config(K, V)
    s_k = token_stride("k", k)
    forget = beta is not None
    if forget:
        f_start = checked_buffer("f_start", f_start, (torch.float32, torch.int32), NSEG * HV, "NSEG x HV", k.device)
        if chain:
            checked_buffer("chain_flags", chain_flags, (torch.int32,), NSEG * HV + 1, "NSEG x HV + 1", k.device)
        launch(_forgetting_start_kernel, (NSEG * HV,), FORGETTING_CONFIG, **forgetting_start_launch_args(
            g_cum, beta, k, cu_seqlens, f_start, chain_flags if chain else f_start, N, seg_len,
            token_stride("beta", beta), s_k, H, HV, K, cfg.BK, use_qk_l2norm=use_qk_l2norm, chain=chain))
    # Host ceil-divisions: triton.cdiv is a constexpr function, slow on a call's host path.
    grid = (NSEG * HV * segment_map_blocks(K, V, cfg, chain),)
    launch(_segment_map_fwd_kernel, grid, cfg, **segment_map_launch_args(
        cfg, k.dtype, k, w, u, g_cum, k_rnorm if k_rnorm is not None else g_cum, f_start if forget else g_cum,
        cu_seqlens, seg_cu, N, NSEG, seg_len, n_out if chain else m_hi, n_out if chain else m_lo, n_out, s_k, H, HV,
        K, V, use_qk_l2norm=use_qk_l2norm, load_rnorm=use_qk_l2norm and k_rnorm is not None,
        capability=device_facts(k.device)[0], forget=forget, chain=chain))
    return seg_cu, m_hi, m_lo, n_out


def checked_buffer(name: str, buf: torch.Tensor | None, dtypes: tuple, entries: int, what: str,
                    device: torch.device) -> torch.Tensor:
    """``buf`` where it is a contiguous tensor of one of ``dtypes`` with at least
    ``entries`` entries (else a ValueError naming it); a new one of ``dtypes[0]`` for None."""
    if buf is None:
        return torch.empty(entries, dtype=dtypes[0], device=device)
    if buf.dtype not in dtypes or not buf.is_contiguous() or buf.numel() < entries:
        kinds = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: expected a contiguous {kinds} tensor of at least {what} = {entries} entries, "
                         f"got {buf.dtype} {tuple(buf.shape)}")
    return buf


def maps_buffers(k: torch.Tensor, u: torch.Tensor, cu_seqlens: torch.Tensor, seg_len: int,
                 out: tuple | None = None, *, chain: bool = False) -> tuple[int, tuple]:
    """The segment slot count ``NSEG`` of a pass 1 over k ``[B, T, H, K]``, u ``[B, T, HV,
    V]`` and ``cu_seqlens``, with what it writes: (seg_cu, M_hi, M_lo, N) as
    :func:`segment_map_fwd` returns them (M_hi and M_lo None for ``chain``), ``out`` where
    the caller allocated them."""
    B, T, _, K = k.shape
    HV, V = u.shape[-2], u.shape[-1]
    NSEG = B * T // seg_len + cu_seqlens.shape[0] - 1
    if out is not None:
        return NSEG, tuple(out)
    maps = (None, None) if chain else (torch.empty(NSEG, HV, K, K, dtype=maps_dtype(k.dtype), device=k.device),
                                       torch.empty(NSEG, HV, K, K, dtype=torch.bfloat16, device=k.device))
    return NSEG, (torch.empty(NSEG + 1, dtype=cu_seqlens.dtype, device=k.device), *maps,
                  torch.empty(NSEG, HV, K, V, dtype=torch.float32, device=k.device))


def segment_map_blocks(K: int, V: int, cfg: LaunchConfig, chain: bool = False) -> int:
    """Pass 1's programs per (segment slot, v-head): the BC-wide blocks of N's ``V`` columns
    and, but for chained segments (``chain``), of M's ``K``."""
    return -(-V // cfg.BV) + (0 if chain else -(-K // cfg.BV))


def segment_map_launch_args(cfg, dtype, k, w, u, g_cum, k_rnorm, f_start, cu_seqlens, seg_cu, num_seqs,
                            num_segments, seg_len, m_hi, m_lo, n_out, s_k, H, HV, K, V, *, use_qk_l2norm, load_rnorm,
                            capability, forget, chain=False) -> dict:
    """Every argument of one ``_segment_map_fwd_kernel`` launch by name, unused ``k_rnorm``
    and ``f_start`` (without ``forget``) already replaced by a stand-in, for a part of
    ``capability`` (what :func:`segment_map_fwd` launches with; a call program binds the
    same list, :mod:`.call_program`)."""
    dot_prec, _ = dot_precisions(dtype)
    return dict(
        k=k, w=w, u=u, g_cum=g_cum, k_rnorm=k_rnorm, f_start=f_start, cu_seqlens=cu_seqlens, seg_cu=seg_cu,
        N=num_seqs, NSEG=num_segments, L=seg_len, m_hi=m_hi, m_lo=m_lo, n_out=n_out, s_k=s_k, H=H, HV=HV, K=K, V=V,
        BT=64, BK=cfg.BK, BC=cfg.BV, USE_L2NORM=use_qk_l2norm, LOAD_RNORM=load_rnorm, DOT_PREC=dot_prec,
        INTERP_BF16=interp_bf16_dots(dtype), INTERPRET=interpreting(), PREFETCH=l2_prefetch_chunks(capability),
        FORGET=forget, CHAIN=chain)


#: The forgetting-start launch: one program of 4 warps per (segment slot, v-head), reading
#: chunk totals and the suffix's beta and k rows (no pipelining to gain).
FORGETTING_CONFIG = LaunchConfig(num_warps=4, num_stages=1)


def forgetting_start_launch_args(g_cum, beta, k, cu_seqlens, f_start, chain_flags, num_seqs, seg_len, s_b, s_k, H,
                                 HV, K, BK, *, use_qk_l2norm, chain=False) -> dict:
    """Every argument of one ``_forgetting_start_kernel`` launch by name (grid ``NSEG * HV``
    programs; ``chain_flags`` a stand-in but for ``chain``), as :func:`segment_map_fwd`
    and the call programs launch it."""
    return dict(g_cum=g_cum, beta=beta, k=k, cu_seqlens=cu_seqlens, f_start=f_start, chain_flags=chain_flags,
                N=num_seqs, L=seg_len, s_b=s_b, s_k=s_k, H=H, HV=HV, K=K, BT=64, BK=BK, USE_L2NORM=use_qk_l2norm,
                NEGLIGIBLE_LOG2=MAP_NEGLIGIBLE_LOG2, CHAIN=chain)
