"""Chained segments on the matrix engine: the fused kernel's (:mod:`.state_output`) walk of
one segment slot, its start state, and its hand-over (``CHAIN``).

The protocol is triton_generic's (:mod:`gdn_dispatch.backends.triton_generic.segment_chain`,
which documents it): a program takes its work item (segment slot, v-head, V block) from a
ticket in slot order; segment ``j`` of sequence ``n`` starts from the call's initial state
(or pool row) where ``j`` is ``n``'s first slot, else from row ``j - 1`` of ``hand``:
pass 1's N where segment ``j - 1`` forgets its start, else the end state segment ``j -
1``'s programs store there, waited for on its hand-over count (acquire; they add to it
with release after a barrier of their threads). The last slot of a sequence writes the
call's final state and pool row; a slot past a sequence's tail is empty and passes its
start on. Pass 1 (:mod:`.segment_map` with ``CHAIN``) writes the forgetting starts and
zeroes the counts and the ticket.

Here the start and end states move through :mod:`.state_io` (staged through the idle ring,
as the unsegmented kernel's), the hand-over as float32 "kv" tiles, read past L1.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from gdn_dispatch.backends.gluon_common.compat import thread_barrier
from gdn_dispatch.backends.gluon_common.recurrence import slot_sequence
from gdn_dispatch.backends.gluon_common.state_io import state_in, state_out


@gluon.jit
def chain_walk(chain_flags, cu_seqlens, N, L, NSEG, HV, GROUP, K: gl.constexpr, V: gl.constexpr,
               BV: gl.constexpr, BT: gl.constexpr):
    """This program's work item, taken from the ticket ``chain_flags[NSEG * HV]`` in slot
    order (the V block fastest): (slot, sequence ``n`` x HV + v-head, v-head, V-block), the
    slot's rows ``bos .. eos`` and chunk count, the tile columns of its w, k (q/k head
    ``i_h // GROUP``) and u / v blocks, and ``n`` and its first slot (its last:
    :func:`chain_last_slot`, read after the walk, so that no more than the slot lives
    across it)."""
    NV: gl.constexpr = V // BV
    ticket = gl.atomic_add(chain_flags + NSEG * HV, 1)
    i_v = ticket % NV
    i_sh = ticket // NV
    i_h = i_sh % HV
    slot = i_sh // HV
    n, seq_bos, seq_eos = slot_sequence(cu_seqlens, N, L, slot)
    first = seq_bos // L + n
    start = seq_bos + (slot - first) * L
    bos = gl.minimum(start, seq_eos)
    eos = gl.minimum(start + L, seq_eos)
    NT = gl.cdiv(eos - bos, BT)
    return slot, n * HV + i_h, i_h, i_v, bos, eos, NT, i_h * K, (i_h // GROUP) * K, i_h * V + i_v * BV, n, first


@gluon.jit
def chain_last_slot(cu_seqlens, n, L):
    """The last segment slot of sequence ``n``."""
    return gl.load(cu_seqlens + n + 1).to(gl.int32) // L + n


@gluon.jit
def chain_state_init(S, h0, hand, f_start, chain_flags, ring, block, slot, first, i_h, i_v, HV, K: gl.constexpr,
                     V: gl.constexpr, BV: gl.constexpr, STATE_VK: gl.constexpr, USE_H0: gl.constexpr,
                     USE_POOL: gl.constexpr, ENGINE: gl.constexpr):
    """The start state of slot ``slot`` (v-head ``i_h``, V-block ``i_v``) into the
    accumulator ``S``: block ``block`` of the call's initial states / pool ``h0`` for the
    sequence's first slot, else row ``slot - 1`` of ``hand`` once handed over (module
    docstring); returns ``S``."""
    s_layout: gl.constexpr = ENGINE.acc_layout(K, BV, gl.num_warps())
    NV: gl.constexpr = V // BV
    later = slot != first
    prev = gl.maximum(slot - 1, 0) * HV + i_h
    waiting = later & (gl.load(f_start + prev) < 0)
    while waiting:
        waiting = gl.atomic_add(chain_flags + prev, 0, sem="acquire") < NV
    if later:
        s0 = state_in(hand, ring, prev, i_v, K, V, BV, False, False, s_layout, BYPASS_L1=True)
    else:
        if USE_H0:
            s0 = state_in(h0, ring, block, i_v, K, V, BV, STATE_VK, USE_POOL, s_layout)
        else:
            s0 = gl.zeros([K, BV], gl.float32, layout=s_layout)
    # The staging reads (generic proxy) must precede chunk 0's TMA writes into the same
    # bytes (async proxy), in every thread, before the one issuing thread starts them.
    fence_async_shared()
    thread_barrier()
    return ENGINE.acc_write(S, s0)


@gluon.jit
def chain_state_out(s, ht, i_nh, h0, block, hand, f_start, chain_flags, ring, cu_seqlens, L, slot, i_n, i_sh, i_v,
                    K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, STATE_VK: gl.constexpr,
                    STORE_HT: gl.constexpr, INPLACE: gl.constexpr):
    """The end state ``s`` (fp32 [K, BV] registers) of slot ``slot`` of sequence ``i_n``:
    the call's final state (block ``i_nh`` of ``ht``) and pool row (``block`` of ``h0``)
    from the sequence's last slot; else, where the segment does not forget, row ``i_sh`` of
    ``hand`` and one more on its hand-over count."""
    if slot == chain_last_slot(cu_seqlens, i_n, L):
        if STORE_HT or INPLACE:
            state_out(ht, i_nh, h0, block, i_v, s, ring, K, V, BV, STATE_VK, STORE_HT, INPLACE)
    elif gl.load(f_start + i_sh) < 0:
        state_out(hand, i_sh, hand, -1, i_v, s, ring, K, V, BV, False, True, False)
        # Every thread's part of the state is stored before the count says so.
        thread_barrier()
        gl.atomic_add(chain_flags + i_sh, 1, sem="release")

