"""Context parallelism: the scan that stitches segments together.

Segment slots (:mod:`gdn_dispatch.context_parallel`): with segments of ``L`` tokens,
sequence ``n`` owns the slots ``[cu[n] // L + n, cu[n + 1] // L + n + 1)``, in order
(:mod:`.segment_map` writes their offsets ``seg_cu`` during pass 1; with them the segments
are "sequences" the unchanged pipeline runs over in pass 2).

:func:`segment_scan_fwd` is the serial part: per (sequence, v-head, V block) a program
walks its sequence's slots in order with the state in registers, fp32::

    seg_h0[s] = S;  S = M[s] S + N[s]

starting from the sequence's initial state (zeros, ``h0[n]``, or pool row
``state_indices[n]``), and ends with the sequence's final state (returned, or written back
into the pool row). M comes split from pass 1 (:mod:`.segment_map`: ``M_hi`` TF32-exact
fp32, ``M_lo`` bf16) and the step splits S the same way, so the product is three tensor-core
products with no conversion of M::

    M S ~ M_lo bf16(S) + M_hi (S - tf32(S)) + M_hi tf32(S)       (about 2^-19 relative)

With M_hi in bf16 (:data:`.segment_map.BF16_MAPS`, calls on 16-bit data) S is split into
two bf16 parts too, and the three products are bf16 ones::

    M S ~ M_lo S_hi + M_hi S_lo + M_hi S_hi,  S_hi = bf16(S), S_lo = bf16(S - S_hi)   (about 2^-17)

On sm_90 up to K = 128 a step is those products over the whole M with ``S`` held in
registers, the software pipeliner streaming ``M[s + 1]`` and ``N[s + 1]`` (they do not
depend on ``S``) into shared memory while step ``s`` multiplies; as everywhere for K <= 32
(one column block is the whole M). Elsewhere the step contracts over 32-wide column blocks
of M: the program reads ``S`` back from ``seg_h0[s]``, which it has just stored (a CTA
barrier orders the store before the loads of other threads), so no ``[K, K]`` tile is
held in registers.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from gdn_dispatch.contract import empty_final_state

from gdn_dispatch.backends.triton_generic._jit import (
    _bf16_round, _cast, _dot, _tf32_round, interpreting, jit, next_pow2)
from gdn_dispatch.backends.triton_generic.configs import LaunchConfig, MIN_TILE, device_facts, launch, state_block_k
from gdn_dispatch.backends.triton_generic.state import _sequence_program, _start_state, _store_final_state


@jit
def _split_product(m_hi, m_lo, b_s, acc, INTERPRET: tl.constexpr):
    """``acc + M b_s`` from M's two parts (M_hi TF32-exact fp32 or bf16), the small terms
    first."""
    if m_hi.dtype == tl.bfloat16:
        s_hi = _bf16_round(b_s)
        s_lo = _cast(b_s - s_hi, tl.bfloat16, INTERPRET)
        b_hi = s_hi.to(tl.bfloat16)  # exact
        acc = _dot(m_lo, b_hi, acc, "tf32", INTERPRET)
        acc = _dot(m_hi, s_lo, acc, "tf32", INTERPRET)
        acc = _dot(m_hi, b_hi, acc, "tf32", INTERPRET)
    else:
        s_hi = _tf32_round(b_s)
        acc = _dot(m_lo, b_s.to(tl.bfloat16), acc, "tf32", INTERPRET)
        acc = _dot(m_hi, b_s - s_hi, acc, "tf32", False)
        acc = _dot(m_hi, s_hi, acc, "tf32", False)
    return acc


@jit
def _store_start(seg_h0, b_s, o_sh, o_k, o_v, m_kv, V: tl.constexpr):
    """``seg_h0``'s rows of slot ``o_sh`` (its row offset ``(slot * HV + h) * K``): the
    state ``b_s`` the slot starts from, in the program's V columns ``o_v``."""
    tl.store(seg_h0 + o_sh * V + o_k[:, None] * V + o_v[None, :], b_s, mask=m_kv)


@jit
def _whole_m_step(m_hi, m_lo, n_in, seg_h0, b_s, o_sh, o_k, o_v, m_kv, m_kk, K: tl.constexpr, V: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Slot ``o_sh`` (its row offset ``(slot * HV + h) * K``): store its start state,
    return the next. M's parts and N feed the products straight from their loads, which
    the pipeliner moves ahead into shared memory."""
    _store_start(seg_h0, b_s, o_sh, o_k, o_v, m_kv, V)
    b_hi = tl.load(m_hi + o_sh * K + o_k[:, None] * K + o_k[None, :], mask=m_kk, other=0.0)
    b_lo = tl.load(m_lo + o_sh * K + o_k[:, None] * K + o_k[None, :], mask=m_kk, other=0.0)
    b_n = tl.load(n_in + o_sh * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
    return _split_product(b_hi, b_lo, b_s, b_n, INTERPRET)


@jit(do_not_specialize=("P", "L"))
def _segment_scan_fwd_kernel(
    m_hi,
    m_lo,
    n_in,
    cu_seqlens,
    h0,
    ht,
    seg_h0,
    state_indices,
    P,
    L,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    USE_POOL: tl.constexpr,
    INPLACE: tl.constexpr,
    STORE_HT: tl.constexpr,
    STATE_VK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    i_v, i_nh, i_n, i_h, bos, eos = _sequence_program(cu_seqlens, HV, V, BV, False)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    # The sequence's start state, as the state kernel reads it (pool rows, -1 = zeros).
    b_s, i_row, k_rows = _start_state(h0, state_indices, P, i_n, i_h, o_k, o_v, HV, K, V, BK, BV, USE_H0, USE_POOL,
                                      STATE_VK)

    i_s = bos // L + i_n
    s_end = eos // L + i_n + 1
    if BKC == BK:
        # The slots from s_busy on hold no token (the slot count rounds up): their maps are
        # the identity, so the state passes them unchanged and is only stored as their start.
        s_busy = i_s + (eos - bos + L - 1) // L
        m_kk = (o_k < K)[:, None] & (o_k < K)[None, :]
        if INTERPRET:
            # triton 3.6's interpreter cannot range() over a loaded bound (see state.py).
            while i_s < s_busy:
                b_s = _whole_m_step(m_hi, m_lo, n_in, seg_h0, b_s, (i_s * HV + i_h) * K, o_k, o_v, m_kv, m_kk, K, V,
                                    INTERPRET)
                i_s += 1
        else:
            for i_t in range(i_s, s_busy):
                b_s = _whole_m_step(m_hi, m_lo, n_in, seg_h0, b_s, (i_t * HV + i_h) * K, o_k, o_v, m_kv, m_kk, K, V,
                                    INTERPRET)
        i_e = s_busy
        while i_e < s_end:
            _store_start(seg_h0, b_s, (i_e * HV + i_h) * K, o_k, o_v, m_kv, V)
            i_e += 1
    else:
        # Every slot's map applied, the empty ones' identity too (skipping them here made
        # ptxas spill on sm_100 with triton 3.9).
        while i_s < s_end:
            o_sh = (i_s * HV + i_h) * K
            _store_start(seg_h0, b_s, o_sh, o_k, o_v, m_kv, V)
            tl.debug_barrier()  # the rows just stored are read below by other threads
            b_acc = tl.load(n_in + o_sh * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            for i_kc in tl.static_range(0, K, BKC):
                o_kc = i_kc + tl.arange(0, BKC)
                m_kc = (o_k < K)[:, None] & (o_kc < K)[None, :]
                b_hi = tl.load(m_hi + o_sh * K + o_k[:, None] * K + o_kc[None, :], mask=m_kc, other=0.0)
                b_lo = tl.load(m_lo + o_sh * K + o_k[:, None] * K + o_kc[None, :], mask=m_kc, other=0.0)
                b_sk = tl.load(seg_h0 + o_sh * V + o_kc[:, None] * V + o_v[None, :],
                               mask=(o_kc < K)[:, None] & (o_v < V)[None, :], other=0.0)
                b_acc = _split_product(b_hi, b_lo, b_sk, b_acc, INTERPRET)
            b_s = b_acc
            i_s += 1

    _store_final_state(h0, ht, b_s, i_nh, i_row, i_h, k_rows, o_k, o_v, HV, K, V, INPLACE, STORE_HT, STATE_VK)


#: Compute capabilities whose scan takes a step with the whole M (see segment_scan_config).
WHOLE_M_CAPABILITIES = ((9, 0),)


@functools.lru_cache(maxsize=1024)  # pairs follows the number of sequences
def segment_scan_config(K: int, V: int, capability: tuple[int, int] | None = None, pairs: int | None = None,
                        sm_count: int | None = None, bf16_maps: bool = False) -> LaunchConfig:
    """The scan, one program per (sequence, v-head, BV slice of V), 8 warps (the fp32
    products of 4 warps spill on mma.sync parts, sm_80). On sm_90 up to K = 128 the whole
    M per step (BKC = BK) with BV = 16, two pipeline stages: M's parts and N of the next
    slot, 104 KB at K = V = 128, stream into shared memory during the step (192 KB in all);
    on the H200 at K = V = 128 a step of 16 columns beat 32 columns over M's column blocks
    by 20% with M in fp32 (4-16 heads, 8-32 segments), and M split and pipelined beat that
    by 24% (43.5 against 57.2 µs at 4 heads x 16 segments). With few ``pairs`` (sequences x
    v-heads), BV = 8 where that many programs still fit one wave of ``sm_count`` SMs: the
    step's time is M's bytes into one SM, so more SMs per head shorten the chain (H200, 4
    heads: 37.4 against 50.6 µs at 16 segments, 71.2 against 98.0 at 32; 16 heads, whose
    256 programs at BV = 8 fill two waves: 44.7 against 31.0). Elsewhere (the form spills on
    mma.sync parts, and shared memory is smaller), and for larger K, M streams in [BK, 32]
    column blocks with BV = 32 (for K <= 32 that one block is the whole M, and the kernel
    takes the whole-M step). ``capability`` None (the interpreter, or any part) is treated
    as not sm_90. With ``bf16_maps`` (M_hi in bf16, :data:`.segment_map.BF16_MAPS`) a whole-M
    stage is 68 KB at K = V = 128, so three fit: the next two slots stream in while one
    multiplies."""
    BK = state_block_k(K)
    if BK <= 128 and capability is not None and tuple(capability) in WHOLE_M_CAPABILITIES:
        narrow = pairs is not None and sm_count is not None and pairs * -(-V // 8) <= sm_count
        BV = 8 if narrow else max(MIN_TILE, min(16, next_pow2(V)))
        return LaunchConfig(num_warps=8, num_stages=3 if bf16_maps else 2, BK=BK, BV=BV, BKC=BK)
    return LaunchConfig(num_warps=8, num_stages=1, BK=BK, BV=max(MIN_TILE, min(32, next_pow2(V))))


def scan_block_kc(cfg: LaunchConfig) -> int:
    """The scan's contraction block: ``BK`` (the whole M per step, S in registers) or a
    32-wide column block of M (S read back from ``seg_h0``)."""
    return cfg.BKC or min(32, cfg.BK)


def segment_scan_fwd(
    m_hi: torch.Tensor,
    m_lo: torch.Tensor,
    n_in: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seg_len: int,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_vk: bool = False,
    state_indices: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    config: LaunchConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every segment's start state, and every sequence's final state.

    Parameters
    ----------
    m_hi : float32 Tensor ``[NSEG, HV, K, K]`` (TF32-exact) or bfloat16 Tensor (the bf16
        split, :data:`.segment_map.BF16_MAPS`), m_lo : bfloat16 Tensor
        ``[NSEG, HV, K, K]``, n_in : float32 Tensor ``[NSEG, HV, K, V]``: the segments' maps
        ``S -> (m_hi + m_lo) S + n_in`` (:func:`.segment_map.segment_map_fwd`;
        :func:`split_maps` splits a float32 M).
    cu_seqlens : int Tensor ``[N + 1]``, the call's sequence offsets.
    seg_len : int, ``L``.
    initial_state : Tensor ``[N, HV, K, V]`` / ``[N, HV, V, K]`` (``state_vk``), any float
        dtype, or None (zeros); with ``state_indices`` the pool ``[P, HV, K, V]`` /
        ``[P, HV, V, K]``.
    output_final_state : also return each sequence's final state.
    state_vk : layout of initial_state and of the final state.
    state_indices : int Tensor ``[N]`` or None: pool rows (outside ``[0, P)``: zeros in,
        nothing written back).
    inplace_final_state : with ``state_indices``, write each final state into its pool row.
    out : (seg_h0, final_state) allocated by the caller (contiguous, as returned below; the
        final state None unless ``output_final_state``), or None to allocate them here.

    Returns
    -------
    seg_h0 : float32 Tensor ``[NSEG, HV, K, V]``, the state at each segment slot's start
        ("kv" layout).
    final_state : float32 Tensor ``[N, HV, K, V]`` or ``[N, HV, V, K]``, or None.
    """
    NSEG, HV, K, V = n_in.shape
    N = cu_seqlens.shape[0] - 1
    if out is not None:
        seg_h0, final_state = out
    else:
        seg_h0 = torch.empty(NSEG, HV, K, V, dtype=torch.float32, device=n_in.device)
        final_state = empty_final_state(output_final_state, N, HV, K, V, state_vk, n_in.device)
    if N * HV == 0:
        return seg_h0, final_state
    cfg = config
    if cfg is None:
        capability, sm_count = device_facts(n_in.device)
        cfg = segment_scan_config(K, V, capability, N * HV, sm_count, m_hi.dtype == torch.bfloat16)
    grid = (N * HV * -(-V // cfg.BV),)  # host ceil-div (triton.cdiv is a slow constexpr function)
    pool = state_indices is not None
    launch(_segment_scan_fwd_kernel, grid, cfg, **segment_scan_launch_args(
        cfg, m_hi, m_lo, n_in, cu_seqlens, initial_state if initial_state is not None else n_in,
        final_state if final_state is not None else n_in, seg_h0, state_indices if pool else cu_seqlens,
        initial_state.shape[0] if pool else 0, seg_len, HV, K, V, use_h0=initial_state is not None, use_pool=pool,
        inplace=pool and inplace_final_state, store_ht=final_state is not None, state_vk=state_vk))
    return seg_h0, final_state


def segment_scan_launch_args(cfg, m_hi, m_lo, n_in, cu_seqlens, h0, ht, seg_h0, state_indices, pool_size, seg_len,
                             HV, K, V, *, use_h0, use_pool, inplace, store_ht, state_vk) -> dict:
    """Every argument of one ``_segment_scan_fwd_kernel`` launch by name, the unused
    pointers (``h0``, ``ht``, ``state_indices``) already replaced by a stand-in (what
    :func:`segment_scan_fwd` launches with; a call program binds the same list,
    :mod:`gdn_dispatch.backends.gluon_common.call_program`)."""
    return dict(
        m_hi=m_hi, m_lo=m_lo, n_in=n_in, cu_seqlens=cu_seqlens, h0=h0, ht=ht, seg_h0=seg_h0,
        state_indices=state_indices, P=pool_size, L=seg_len, HV=HV, K=K, V=V, BK=cfg.BK, BKC=scan_block_kc(cfg),
        BV=cfg.BV, USE_H0=use_h0, USE_POOL=use_pool, INPLACE=inplace, STORE_HT=store_ht, STATE_VK=state_vk,
        INTERPRET=interpreting())


def split_maps(m: torch.Tensor, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 ``M`` as pass 1 stores it: (TF32-rounded fp32, the rest in bf16), the
    rounding of :func:`._jit._tf32_round` in torch; with ``bf16`` (bf16, the rest in bf16)
    (tests, benchmarks)."""
    if bf16:
        hi = m.to(torch.bfloat16)
        return hi, (m - hi.float()).to(torch.bfloat16)
    bits = m.contiguous().view(torch.int32)
    hi = ((bits + 0x1000) & -0x2000).view(torch.float32)
    return hi, (m - hi).to(torch.bfloat16)
