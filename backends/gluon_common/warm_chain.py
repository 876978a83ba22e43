"""Chained segments warmed up from their forgetting suffix: the one-kernel fused walk over
the segment slots of a call, each program starting exactly without a pass 1.

A program takes its work item (segment slot, v-head) from a ticket in slot order, as
:mod:`.segment_chain`'s do. Segment ``j`` of a sequence starts from the call's initial
state (or pool row) where ``j`` is the sequence's first slot. Otherwise its program looks
at the :data:`WARM_CHUNKS` chunks before its segment (inside its sequence) for the shortest
suffix whose map on the state is provably below 2^:data:`MAP_NEGLIGIBLE_LOG2` in norm
(:func:`warm_row`, the bound of :mod:`.segment_map`'s forgetting start: the gates' sum,
``beta >= 0`` and ``beta ||k||^2 <= 2``). Where there is one, the program walks that suffix
again from a zero state, its outputs not stored (the program of the segment before stores
them), then its own segment: the state it reaches at its segment's start differs from the
exact one by less than 2^-40 of that state's norm, far under the float32 rounding of the
walk. Where there is none, it waits for the program of segment ``j - 1`` to hand its end
state over through ``hand`` (its count released after a barrier of its threads; the
waiter acquires it), which that program always does unless its segment is its sequence's
last. Programs wait only on programs with an earlier ticket, which are already running.

So under gates that forget within the window the segments run in parallel, for one more
chunk a segment under the bench's gates (about -75 bits a chunk); under gates that never
forget the walk is as serial as one program per sequence, plus a hand-over per segment.
No segment map, no scan and no first launch: the hand-over counts and the ticket are
zeroed on the stream before the launch.

The pick between this chain and the unsegmented pipeline is made on the device, where the
gates are (:func:`warm_census_fwd`): a census kernel runs :func:`warm_row` for every work
item the chain would run and counts the items that would wait into a pick word. The chain's
launch (``PICK``) leaves at once unless the count is 0 (every segment warms up, so they all
run in parallel); the pipeline's launches (their ``PICK``) leave at once unless it is not
(gates that keep the start state: the pipeline walks at its own pace, where the one-kernel
walk is about twice as slow). Exactly one of the two writes o and the final state, so a
state pool is read and written back once. Nothing is read back to the host.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gdn_dispatch.contract import CHUNK_SIZE

from gdn_dispatch.backends.gluon_common.launch import launch_planned
from gdn_dispatch.backends.gluon_common.launch_plan import NUM_WARPS, GridRule, LaunchPlan, token_stride
from gdn_dispatch.backends.gluon_common.masks import add
from gdn_dispatch.backends.gluon_common.pick import PICK_WORD
from gdn_dispatch.backends.gluon_common.recurrence import slot_sequence
from gdn_dispatch.backends.gluon_common.segment_chain import chain_last_slot
from gdn_dispatch.backends.gluon_common.wy import GATE_FLOOR, LOG2E
from gdn_dispatch.backends.triton_generic.segment_map import MAP_NEGLIGIBLE_LOG2

#: Chunks before a segment its program may walk again instead of waiting for the segment
#: before it: the forgetting suffix is looked for among these (2048 tokens).
WARM_CHUNKS = gl.constexpr(32)
NEGLIGIBLE_LOG2 = gl.constexpr(MAP_NEGLIGIBLE_LOG2)


@gluon.jit
def chain_item(ticket, cu_seqlens, N, L, HV):
    """The work item of ``ticket`` (slot order, the v-head fastest): segment slot, v-head,
    the sequence ``n`` that owns the slot and its first row, and the segment's rows ``bos
    .. eos`` (empty past the sequence's tail)."""
    i_h = ticket % HV
    slot = ticket // HV
    n, seq_bos, seq_eos = slot_sequence(cu_seqlens, N, L, slot)
    start = seq_bos + (slot - (seq_bos // L + n)) * L
    return slot, i_h, n, seq_bos, gl.minimum(start, seq_eos), gl.minimum(start + L, seq_eos)


@gluon.jit
def _suffix_keys_bound(k_ptr, s_k, col_k, row0, bos, K: gl.constexpr, BT: gl.constexpr):
    """The largest squared row norm of k (token stride ``s_k``, columns ``col_k ..``) over
    the rows ``row0 .. bos`` (whole chunks); a NaN norm counts as infinite."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, layout))
    cols = col_k + gl.arange(0, K, layout=gl.SliceLayout(0, layout))
    x_rows = gl.zeros([BT], gl.float32, gl.SliceLayout(1, layout))
    for row in range(row0, bos, BT):
        rows = (row + r).to(gl.int64)
        kt = gl.load(k_ptr + gl.expand_dims(rows * s_k, 1) + gl.expand_dims(cols, 0)).to(gl.float32)
        x = gl.sum(kt * kt, 1)
        # max drops a NaN operand: a NaN norm counts as infinite.
        x_rows = gl.maximum(x_rows, gl.where(x == x, x, float("inf")))
    return gl.max(x_rows, 0)


@gluon.jit
def warm_row(g, s_g, beta, s_beta, k_ptr, s_k, col_k, i_h, seq_bos, bos, K: gl.constexpr, BT: gl.constexpr,
             UNIT_KEYS: gl.constexpr):
    """The first row of the shortest suffix of the :data:`WARM_CHUNKS` chunks before ``bos``
    (rows of the sequence, which starts at ``seq_bos``) whose map on the state is provably
    below 2^:data:`NEGLIGIBLE_LOG2` in norm, or -1 where none is.

    The map of a suffix is the product over its tokens of ``2^g_t (I - beta_t k_t k_t^T)``
    (g in log2 units, floored as the walk floors it), at most 2^(its gates' sum) where ``0
    <= beta_t ||k_t||^2 <= 2``. The suffix is found from the gates alone, then the condition
    checked over its tokens: ``min beta >= 0`` and ``max beta * max ||k||^2 <= 2``
    (``||k||^2 <= 1`` with ``UNIT_KEYS``, the qk l2 norm on chip). A NaN beta or key fails
    it. ``g``, ``beta``: [tokens, HV] fp32 (token strides ``s_g``, ``s_beta``); ``k_ptr``:
    k's rows (token stride ``s_k``) read at columns ``col_k .. col_k + K``."""
    W: gl.constexpr = WARM_CHUNKS
    tile: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [gl.num_warps(), 1], [1, 0])
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    c = gl.arange(0, W, layout=gl.SliceLayout(1, tile))
    # Chunk c of the window starts (W - c) chunks before bos; segments start on chunk
    # boundaries of their sequence, so a chunk lies in it whole or not at all.
    rows = gl.expand_dims(bos - (W - c) * BT, 1) + gl.expand_dims(gl.arange(0, BT, layout=gl.SliceLayout(0, tile)), 0)
    inside = rows >= seq_bos
    x = gl.load(g + rows.to(gl.int64) * s_g + i_h, mask=inside, other=0.0)
    x = gl.where(inside, gl.maximum(x, GATE_FLOOR) * LOG2E, 0.0)
    sums = gl.convert_layout(gl.sum(x, 1), flat)
    cf = gl.arange(0, W, layout=flat)
    suffix = gl.associative_scan(sums, 0, add, reverse=True)
    live = bos - (W - cf) * BT >= seq_bos
    c0 = gl.max(gl.where(live & (suffix < NEGLIGIBLE_LOG2), cf, -1), 0)
    start = c0 * 0 - 1
    if c0 >= 0:
        row0 = bos - (W - c0) * BT
        in_suffix = rows >= row0
        b = gl.load(beta + rows.to(gl.int64) * s_beta + i_h, mask=in_suffix, other=0.0).to(gl.float32)
        # min and max drop a NaN operand: a NaN beta counts as negative.
        b = gl.where(b == b, b, -1.0)
        b_min = gl.min(gl.min(gl.where(in_suffix, b, 0.0), 1), 0)
        b_max = gl.max(gl.max(gl.where(in_suffix, b, 0.0), 1), 0)
        if UNIT_KEYS:
            x_max = b_min * 0.0 + 1.0
        else:
            x_max = _suffix_keys_bound(k_ptr, s_k, col_k, row0, bos, K, BT)
        start = gl.where((b_min >= 0.0) & (b_max * x_max <= 2.0), row0, -1)
    return start


@gluon.jit
def wait_hand_over(chain_flags, prev):
    """Spin until the program of slot-head ``prev`` has handed its end state over."""
    waiting = gl.atomic_add(chain_flags + prev, 0, sem="acquire") < 1
    while waiting:
        waiting = gl.atomic_add(chain_flags + prev, 0, sem="acquire") < 1


@gluon.jit(do_not_specialize=["s_g", "s_beta", "s_k", "N", "L", "NSEG", "HV", "GROUP"])
def _warm_census_kernel(g, beta, k_ptr, cu_seqlens, chain_flags, s_g, s_beta, s_k, N, L, NSEG, HV, GROUP,
                        K: gl.constexpr, BT: gl.constexpr, UNIT_KEYS: gl.constexpr):
    # Work item = program id: the ticket order of the chain, the same items.
    slot, i_h, i_n, seq_bos, bos, eos = chain_item(gl.program_id(0), cu_seqlens, N, L, HV)
    if bos > seq_bos:
        warm = warm_row(g, s_g, beta, s_beta, k_ptr, s_k, (i_h // GROUP) * K, i_h, seq_bos, bos, K, BT, UNIT_KEYS)
        if warm < 0:
            gl.atomic_add(chain_flags + NSEG * HV + 1, 1)


# ----------------------------------------------------------------------------------------
# Host side

#: Chained plans (``CPPlan.chained``) of a call class that has the one-kernel build run it
#: warmed up (this module) instead of the pipeline's pass 1 and chained pass 2 (a caller's
#: tuning asks for chained plans, ``context_parallel.TUNING.chain_fill``; the automatic
#: rule makes picked ones, which need this chain: off, they run "off"). H100
#: 80GB HBM3, triton 3.6.0, CUDA-graph GPU time of the public call at H16-HV32 1 x 32768
#: (``python benchmarks/cp_crossover.py --chain-fill 1.0 --warm-chain --gates G --shapes
#: 16/32/1/32768``, ``logs/h100_warm_chain.log``): 0.499 ms against 0.945 off under the
#: bench's gates (4 chained segments of 8192 tokens, each warmed up one chunk), 1.877
#: against 0.935 under gates that never forget (the walk serial on the one-kernel build,
#: 3.9 us a chunk on 32 programs, where "off" runs the pipeline's walk at BV = 32); the
#: pipeline's chained passes measured 1.1-1.2x and 0.37-0.57x of "off" there. On.
WARM_CHAIN = True


def warm_chain_plan(launch: LaunchPlan) -> LaunchPlan:
    """``launch`` (a one-kernel fused plan) over chained segments: ``CHAIN`` on, its
    compiled kernels its own; the grid rule's sequence count is then the slot count."""
    return dataclasses.replace(launch, constexprs={**launch.constexprs, "CHAIN": True}, compiled={},
                               notes=launch.notes + "; " + WARM_NOTE)


#: What a warm chain's plan notes.
WARM_NOTE = "chained segments warmed up from their forgetting suffix, slots in ticket order"


@functools.lru_cache(maxsize=64)
def census_plan(K: int, HV: int, unit_keys: bool) -> LaunchPlan:
    """The census launch at head dim ``K`` over ``HV`` v-heads (``unit_keys``: the qk l2
    norm is on chip, so no key is read): one program per work item of the chain, ``NSEG x
    HV`` (the launch's ``num_seqs`` is the slot count)."""
    return LaunchPlan(
        kernel="warm_census",
        grid_rule=GridRule(per_seq=1, times=HV),
        num_warps=NUM_WARPS,
        blocks={"K": K, "BT": CHUNK_SIZE},
        constexprs={"K": K, "BT": CHUNK_SIZE, "UNIT_KEYS": unit_keys},
        notes="NSEG x HV chain items, each its warm-up bound; counts the items that would wait",
    )


def warm_census_fwd(g: torch.Tensor, beta: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, num_seqs: int,
                    seg_len: int, num_segments: int, chain_flags: torch.Tensor, launch) -> torch.Tensor:
    """Count the work items of a chained call that cannot warm up into its pick word.

    Parameters
    ----------
    g, beta : Tensors ``[B, T, HV]`` in token rows (any float dtype, any token stride).
    k : Tensor ``[B, T, H, K]``: the keys the chain's kernel reads (read unless the plan's
        ``UNIT_KEYS``), in token rows.
    cu_seqlens : the call's offsets ``[N + 1]`` (int32 or int64); ``num_seqs``: N.
    seg_len, num_segments : the chained plan's ``L`` and slot count ``NSEG``.
    chain_flags : int32 ``[NSEG * HV + 2]``, zeroed on the stream; its last word
        (:data:`.pick.PICK_WORD`) receives the count (0: every segment that does not start its
        sequence warms up from its forgetting suffix).
    launch : :func:`census_plan` of the call (or its bound stage).

    Returns ``chain_flags[PICK_WORD:]``: the pick word, as the picked launches read it."""
    HV = g.shape[2]
    if tuple(chain_flags.shape) != (num_segments * HV + 2,) or chain_flags.dtype != torch.int32:
        raise ValueError(f"chain_flags: expected int32 [{num_segments * HV + 2}], got {chain_flags.dtype} "
                         f"{tuple(chain_flags.shape)}")
    args = dict(g=g, beta=beta, k_ptr=k, cu_seqlens=cu_seqlens, chain_flags=chain_flags,
                s_g=token_stride(g), s_beta=token_stride(beta), s_k=token_stride(k), N=num_seqs,
                L=seg_len, NSEG=num_segments, HV=HV, GROUP=HV // k.shape[2])
    launch_planned(_warm_census_kernel, launch.shared, {}, args, rows=0, num_seqs=num_segments)
    return chain_flags[PICK_WORD:]
