"""Context parallelism with chained segments, pass 2: every segment walked from the state
the segment before it hands over, with no segment map and no scan.

    f_start, flags = forgetting starts, flags zeroed       # segment_map_fwd(..., chain_flags=)
    seg_cu, N      = pass 1: N over each forgetting suffix  #   (no M; nothing where none)
    h, v_new, S    = chained_state_fwd(...)                 # this module
    o              = output_fwd(q, k, v_new, h, g_cum, segments)

One program per (segment slot, v-head, BV columns of V), the state kernel's walk
(:func:`.state._walk_chunks`) over the slot's tokens. Segment ``j`` of sequence ``n``
starts from:

* the call's initial state (or pool row) where ``j`` is ``n``'s first slot;
* else pass 1's ``N`` of slot ``j - 1`` where that segment forgets its start
  (``f_start >= 0``, :func:`.segment_map._forgetting_start_kernel`): its end state to
  2^:data:`.segment_map.MAP_NEGLIGIBLE_LOG2` of whatever it started from, known before pass 2;
* else the end state of slot ``j - 1``: its programs store their columns into that slot's
  row of ``N`` (unused there: the segment does not forget), then each adds one to the
  slot's hand-over count (release, after a barrier of the program's threads); slot ``j``'s
  program waits (acquire) until every V block of its head has counted.

The last slot of a sequence writes its final state (and pool row); a slot past a sequence's
tail is empty and passes its start state on. Under gates that forget, every segment starts
at once; under gates that never do, the walk is as serial as the unsegmented one plus a
hand-over per segment.

Programs wait only on programs that already run: each program takes its work item from a
ticket (an atomic counter, zeroed by the launch before, like the hand-over counts), in slot
order, so every item a program waits on was taken by a program that took its ticket
earlier and is therefore resident; a resident program is never descheduled for one that
has not started, so every wait ends. The hand-over loads bypass L1 (``.cg``), which is not
coherent between SMs.
"""

from __future__ import annotations

import torch
import triton.language as tl

from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.triton_generic._jit import interpreting, jit
from gdn_dispatch.backends.triton_generic.configs import LaunchConfig, device_facts, launch, state_block_k, state_config
from gdn_dispatch.backends.triton_generic.kkt_solve import dot_precisions, interp_bf16_dots
from gdn_dispatch.backends.triton_generic.segment_map import _slot_sequence
from gdn_dispatch.backends.triton_generic.state import (
    _state_ptrs, _state_row, _store_final_state, _walk_chunks, state_buffers)
from gdn_dispatch.backends.triton_generic.strides import token_stride


@jit
def _chain_start(h0, hand, f_start, chain_flags, slot, first, i_row, k_rows, i_h, o_k, o_v, HV: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, NV: tl.constexpr, USE_H0: tl.constexpr, STATE_VK: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """The start state ``[BK, BV]`` (fp32, "kv") of segment slot ``slot`` for v-head ``i_h``
    whose sequence's first slot is ``first`` (module docstring): the initial state's row
    ``i_row`` (``k_rows`` of K admitted), or slot ``slot - 1``'s row of ``hand``, after
    waiting for its hand-over where that segment does not forget."""
    later = slot != first
    prev = tl.maximum(slot - 1, 0) * HV + i_h
    waiting = later & (tl.load(f_start + prev) < 0)
    if INTERPRET:
        # Programs run one at a time in ticket order there: a hand-over not counted yet
        # never would be, so it fails here instead of spinning.
        counted = tl.atomic_add(chain_flags + prev, 0, sem="acquire") >= NV
        tl.device_assert(counted | (waiting == 0), "chained segments: the previous segment's hand-over is missing")
    else:
        while waiting:
            waiting = tl.atomic_add(chain_flags + prev, 0, sem="acquire") < NV
    # Row limits folded into comparisons (a block mask & a scalar bool is not a bool mask
    # under every Triton interpreter).
    p_prev = hand + prev * (K * V) + o_k[:, None] * V + o_v[None, :]
    m_prev = (o_k < tl.where(later, K, 0))[:, None] & (o_v < V)[None, :]
    b_s = tl.load(p_prev, mask=m_prev, other=0.0, cache_modifier=".cg")
    if USE_H0:
        p_0, m_0 = _state_ptrs(h0 + (i_row * HV + i_h) * K * V, o_k, o_v, K, V, STATE_VK,
                               tl.where(later, 0, k_rows))
        b_0 = tl.load(p_0, mask=m_0, other=0.0).to(tl.float32)
        if STATE_VK:
            b_0 = tl.trans(b_0)
        b_s = tl.where(later, b_s, b_0)
    return b_s


@jit(do_not_specialize=("P", "N", "NSEG", "L"))
def _chained_state_fwd_kernel(
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
    f_start,
    hand,
    chain_flags,
    s_k: tl.constexpr,
    P,
    N,
    NSEG,
    L,
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
    NV: tl.constexpr = (V + BV - 1) // BV
    # The work item: (slot, v-head, V block) in slot order, the V block fastest.
    ticket = tl.atomic_add(chain_flags + NSEG * HV, 1).to(tl.int64)
    i_v = ticket % NV
    i_sh = ticket // NV
    i_h = i_sh % HV
    slot = i_sh // HV
    i_n, seq_bos, seq_eos = _slot_sequence(cu_seqlens, N, L, slot)
    first = seq_bos // L + i_n
    start = seq_bos + (slot - first) * L
    bos = tl.minimum(start, seq_eos)
    eos = tl.minimum(start + L, seq_eos)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    i_row, k_rows = _state_row(state_indices, P, i_n, K, USE_POOL)
    b_h = _chain_start(h0, hand, f_start, chain_flags, slot, first, i_row, k_rows, i_h, o_k, o_v, HV, K, V, NV,
                       USE_H0, STATE_VK, INTERPRET)
    # The segment is sequence ``slot`` of the segment table: its chunk slots start there.
    b_h = _walk_chunks(k, w, u, g_cum, k_rnorm, h, v_new, b_h, s_k, bos, eos, bos // BT + slot, i_h, o_k, o_v, V,
                       i_v, 1, H, HV, K, V, BT, True, USE_L2NORM, LOAD_RNORM, DOT_PREC, INTERP_BF16, INTERPRET, 0)
    if slot == seq_eos // L + i_n:
        _store_final_state(h0, ht, b_h, i_n * HV + i_h, i_row, i_h, k_rows, o_k, o_v, HV, K, V, INPLACE, STORE_HT,
                           STATE_VK)
    elif tl.load(f_start + i_sh) < 0:
        m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
        tl.store(hand + i_sh * (K * V) + o_k[:, None] * V + o_v[None, :], b_h, mask=m_kv)
        # Every thread's part of the state is stored before the count says so.
        tl.debug_barrier()
        tl.atomic_add(chain_flags + i_sh, 1, sem="release")


def chain_buffers(num_segments: int, HV: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The int32 forgetting starts ``[NSEG * HV]`` and the hand-over counts with the ticket
    ``[NSEG * HV + 1]`` of a chained call (pass 1 writes the first and zeroes the second),
    where the caller did not allocate them."""
    return (torch.empty(num_segments * HV, dtype=torch.int32, device=device),
            torch.empty(num_segments * HV + 1, dtype=torch.int32, device=device))


def chained_state_fwd(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g_cum: torch.Tensor,
    cu_seqlens: torch.Tensor,
    segments: ChunkTable,
    seg_len: int,
    f_start: torch.Tensor,
    hand: torch.Tensor,
    chain_flags: torch.Tensor,
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
    """The recurrence over every segment of the call, chained (module docstring).

    Parameters
    ----------
    k, w, u, g_cum : as :func:`.state.state_fwd` takes them.
    cu_seqlens : int Tensor ``[N + 1]``, the call's sequence offsets.
    segments : ChunkTable of the segment slots (:func:`.context_parallel.segment_table`).
    seg_len : int, ``L``, the segment length (a multiple of the 64-token chunk).
    f_start : int32 or float32 Tensor ``[NSEG * HV]``: the forgetting starts pass 1 read.
    hand : float32 Tensor ``[NSEG, HV, K, V]``: pass 1's N, where the segments that do not
        forget hand their end states over.
    chain_flags : int32 Tensor ``[NSEG * HV + 1]``, zeroed by the forgetting-start launch of
        this call: the hand-over counts and the ticket.
    initial_state, output_final_state, state_vk, use_qk_l2norm, k_rnorm, state_indices,
    inplace_final_state : as :func:`.state.state_fwd` takes them, for the call's sequences.
    sm_count : int or None, the SMs the state kernel's configuration fills.
    config : LaunchConfig override; default: the state kernel's for ``N * HV`` (one segment
        slot's programs of each sequence: the unsegmented call's V blocks).
    out : (h, v_new, final state) allocated by the caller, or None.

    Returns
    -------
    h : Tensor ``[NS, HV, K, V]``, k's dtype: the state at every chunk start, by the
        segments' chunk slots.
    v_new : Tensor ``[B, T, HV, V]``, k's dtype.
    final_state : float32 Tensor ``[N, HV, K, V]`` or ``[N, HV, V, K]``, or None.
    """
    H, K = k.shape[-2], k.shape[-1]
    HV, V = u.shape[-2], u.shape[-1]
    N, NSEG = cu_seqlens.shape[0] - 1, segments.num_seqs
    h, v_new, final_state = state_buffers(k, u, segments.num_slots, N, output_final_state, state_vk, out)
    if NSEG * HV == 0:
        return h, v_new, final_state
    capability, device_sms = device_facts(k.device)
    cfg = config or state_config(K, V, N * HV, k.element_size(), capability,
                                 device_sms if sm_count is None else sm_count)
    launch(_chained_state_fwd_kernel, (NSEG * HV * -(-V // cfg.BV),), cfg, **chained_state_launch_args(
        cfg, k.dtype, k, w, u, g_cum, k_rnorm if k_rnorm is not None else g_cum, h, v_new,
        initial_state if initial_state is not None else g_cum, final_state if final_state is not None else g_cum,
        cu_seqlens, state_indices if state_indices is not None else cu_seqlens, f_start, hand, chain_flags,
        token_stride("k", k), initial_state.shape[0] if state_indices is not None else 0, N, NSEG, seg_len, H, HV,
        K, V, use_h0=initial_state is not None, use_pool=state_indices is not None,
        inplace=state_indices is not None and inplace_final_state, store_ht=final_state is not None,
        state_vk=state_vk, use_qk_l2norm=use_qk_l2norm, load_rnorm=use_qk_l2norm and k_rnorm is not None))
    return h, v_new, final_state


def chained_state_launch_args(cfg, dtype, k, w, u, g_cum, k_rnorm, h, v_new, h0, ht, cu_seqlens, state_indices,
                              f_start, hand, chain_flags, s_k, P, num_seqs, num_segments, seg_len, H, HV, K, V, *,
                              use_h0, use_pool, inplace, store_ht, state_vk, use_qk_l2norm, load_rnorm) -> dict:
    """Every argument of one ``_chained_state_fwd_kernel`` launch by name (grid ``NSEG * HV
    * ceil(V / BV)``), unused pointers already replaced by a stand-in."""
    dot_prec, _ = dot_precisions(dtype)
    return dict(
        k=k, w=w, u=u, g_cum=g_cum, k_rnorm=k_rnorm, h=h, v_new=v_new, h0=h0, ht=ht, cu_seqlens=cu_seqlens,
        state_indices=state_indices, f_start=f_start, hand=hand, chain_flags=chain_flags, s_k=s_k, P=P, N=num_seqs,
        NSEG=num_segments, L=seg_len, H=H, HV=HV, K=K, V=V, BT=64, BK=state_block_k(K), BV=cfg.BV, USE_H0=use_h0,
        USE_POOL=use_pool, INPLACE=inplace, STORE_HT=store_ht, STATE_VK=state_vk, USE_L2NORM=use_qk_l2norm,
        LOAD_RNORM=load_rnorm, DOT_PREC=dot_prec, INTERP_BF16=interp_bf16_dots(dtype), INTERPRET=interpreting())
