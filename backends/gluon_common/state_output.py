"""Stages 4 and 5 fused on the matrix engine: the chunk-state recurrence and the output of
every chunk in one serial walk per (sequence, v-head, V-block of BV columns), so that
neither the per-chunk state h nor v_new ever reaches global memory. This module holds the
kernel's entry and its host side (plan, launch, AOT list); the walks are:

* the one-warpgroup walk (two warpgroups at BV = 128; :mod:`.state_output_walk`, whose
  docstring gives the chunk step, its issue order, barriers and budget), on both engines;
* the warp-specialized walk (``WS``, sm_90a, one warpgroup of state;
  :data:`STATE_OUTPUT_WS`): the serial chain in one partition, everything hanging off it
  in others (:mod:`.state_output_ws`);
* chained segments (``CHAIN``, :mod:`.segment_chain`): a program takes its (segment
  slot, v-head, V-block) from a ticket instead of its program id and runs the
  one-warpgroup walk over the slot's chunks, from the previous slot's hand-over.
"""

from __future__ import annotations

import dataclasses

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gdn_dispatch.aot import AotKernel
from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem, StateLayout, empty_final_state
from gdn_dispatch.device import SMEM_OPTIN, SMEM_RESERVED_PER_BLOCK, shared_memory_per_block
from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.gluon_common.compat import arg_names
from gdn_dispatch.backends.gluon_common.launch import launch_planned
from gdn_dispatch.backends.gluon_common.pick import picked_elsewhere
from gdn_dispatch.backends.gluon_common.launch_plan import (
    MAX_STATE_TILE, NUM_WARPS, BoundLaunch, GridRule, LaunchPlan, as_device, drop_unused_scatter, has_tails,
    pointer_attrs, resolve_engine, sig_dtype, tile_desc)
from gdn_dispatch.backends.gluon_common.qk_norm import l2_flags, plan_qk_rnorm_rows, qk_rnorm_fwd
from gdn_dispatch.backends.gluon_common.recurrence import walk_program
from gdn_dispatch.backends.gluon_common.segment_chain import chain_walk
from gdn_dispatch.backends.gluon_common.state_io import state_block
from gdn_dispatch.backends.gluon_common import state_output_ws
from gdn_dispatch.backends.gluon_common.state_output_walk import state_output_walk, state_tile_per_warpgroup
from gdn_dispatch.backends.gluon_common.state_output_ws import state_output_ws_walk

#: Most slots of the w/k/q and u rings (the kernel's ``NUM_BUF``: chunk t computes while
#: chunks t + 1 .. t + NUM_BUF - 1 land): a plan takes up to this many where they fit the
#: shared memory without fewer programs per SM (:func:`state_output_ring_slots`). Three
#: slots against two on the H200 (``python benchmarks/flag_ab.py ring_slots``, outputs
#: bit-equal): H16-HV64 1 x 8192 (K = V = 128, BV = 64: 216 KB, one program per SM as with
#: two) 265 -> 247 µs of this kernel, context parallelism's pass 2 at 2/4 67.3 -> 65.8,
#: unchanged at 4/8, 2/8 and 8/16. Not where the registers are already full
#: (:func:`_register_bound`): a third slot spilled 8 bytes there.
RING_SLOTS_MAX = 3
#: V-blocks the fused kernel is built for, on both engines: the state tile and three more
#: [64, *] accumulators must fit the sm_90a register file, the rings and tiles shared
#: memory (:func:`state_output_smem_bytes`). BV = 128 runs on two warpgroups
#: (:func:`state_output_warps`), each holding half of every tile's columns.
BLOCK_V = (32, 64, 128)
#: Shared memory the compiler adds to a program's own tiles (layout-conversion scratch), bytes.
SMEM_SCRATCH = 1024
#: Walk the chunks warp-specialized on sm_90a (:mod:`.state_output_ws`: the serial chain
#: in one warpgroup, the output in others: :data:`.state_output_ws.OUTPUT_PARTITIONS`)
#: wherever the state fits one warpgroup at K = 128 (BV of 32 or 64). H200, bf16, K = V =
#: 128, one output partition, ``python benchmarks/flag_ab.py state_output_ws``
#: (``logs/h200_state_output_ws.log``; two rounds, alternating
#: processes, outputs bit-equal): this kernel 0.767 -> 0.723 / 0.742 ms at 16/32 x 32768
#: (BV = 32), 0.198 -> 0.189 / 0.190 at 16/32 x 8192, 0.244 -> 0.233 / 0.233 at 16/64 x
#: 8192 (BV = 64), 0.818 -> 0.762 / 0.771 with the qk l2 norm, context parallelism's pass 2
#: at 2/4 x 32768 (BV = 64) 0.066 -> 0.060 / 0.061; BV = 128 (two warpgroups of state)
#: unchanged, as it keeps the one-warpgroup walk.
STATE_OUTPUT_WS = True


# ----------------------------------------------------------------------------------------
# Kernel


@gluon.jit(do_not_specialize=["HV", "GROUP", "pool_size", "N", "L", "NSEG"])
def _state_output_fwd_kernel(
    q_desc, k_desc, w_desc, u_desc, o_desc, o_rows_desc, o_ptr,
    g_cum, rnorm, h0, ht, state_indices, cu_seqlens, hand, f_start, chain_flags, scale, HV, GROUP, pool_size,
    N, L, NSEG,
    V: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr, STATE_VK: gl.constexpr,
    USE_L2NORM: gl.constexpr, HAS_TAILS: gl.constexpr, ENGINE: gl.constexpr, DEFER_OUT: gl.constexpr,
    USE_POOL: gl.constexpr, INPLACE: gl.constexpr, NUM_BUF: gl.constexpr, CHAIN: gl.constexpr, WS: gl.constexpr,
    PICK: gl.constexpr,
):
    if PICK:
        # A picked call's pipeline: ``chain_flags`` is the pick word (:mod:`.pick`).
        if picked_elsewhere(chain_flags, False):
            return
    BT: gl.constexpr = w_desc.block_type.shape[0]
    K: gl.constexpr = w_desc.block_type.shape[1]
    BV: gl.constexpr = u_desc.block_type.shape[1]
    # q shares k's head, so its tiles sit at col_k too.
    if CHAIN:
        # A segment slot of the call's sequence i_n (:mod:`.segment_chain`).
        slot, i_nh, i_h, i_v, bos, eos, NT, col_w, col_k, col_v, i_n, first = chain_walk(
            chain_flags, cu_seqlens, N, L, NSEG, HV, GROUP, K, V, BV, BT)
    else:
        i_n, i_nh, i_h, i_v, bos, eos, NT, col_w, col_k, col_v = walk_program(cu_seqlens, HV, GROUP, K, V, BV, BT,
                                                                              False)
        slot = 0  # not read
        first = False
    # The block of h0 (the initial states, or the pool) this program reads and writes back.
    block = state_block(state_indices, i_n, i_h, HV, pool_size, USE_POOL)

    if WS:
        gl.static_assert(not CHAIN, "chained segments take the one-warpgroup walk")
        state_output_ws_walk(q_desc, k_desc, w_desc, u_desc, o_desc, o_rows_desc, o_ptr, g_cum, rnorm, h0, ht,
                             i_nh, i_h, i_v, bos, eos, NT, col_w, col_k, col_v, block, scale, HV, GROUP, V, USE_H0,
                             STORE_HT, STATE_VK, USE_L2NORM, HAS_TAILS, ENGINE, USE_POOL, INPLACE, NUM_BUF)
    else:
        state_output_walk(q_desc, k_desc, w_desc, u_desc, o_desc, o_rows_desc, o_ptr, g_cum, rnorm, h0, ht,
                          i_nh, i_h, i_v, bos, eos, NT, col_w, col_k, col_v, block, scale, HV, GROUP,
                          cu_seqlens, hand, f_start, chain_flags, L, slot, first, V, USE_H0, STORE_HT, STATE_VK,
                          USE_L2NORM, HAS_TAILS, ENGINE, DEFER_OUT, USE_POOL, INPLACE, NUM_BUF, CHAIN)


# ----------------------------------------------------------------------------------------
# Host side: plan (dry run), launch, AOT list


def state_output_smem_bytes(K: int, BV: int, elem: int, BT: int = CHUNK_SIZE, slots: int = 2,
                            ws: bool = False, l2: bool = False) -> int:
    """Shared memory of the fused kernel with ``slots`` ring slots: the w/k/q ring (three
    tiles [BT, K] a slot, which also stages the fp32 initial/final state), the u ring, h,
    v_new, vs, o and A tiles and the barriers (the compiler's layout-conversion scratch
    comes on top). ``ws``: the warp-specialized walk (:mod:`.state_output_ws`), with more
    h and v_new tiles (:func:`.state_output_ws.hv_slots` in all), an A and o tile per output
    partition (their count depends on the qk l2 norm, ``l2``) and a third barrier per slot."""
    rings = slots * (3 * BT * K + BT * BV) * elem
    tiles = (K * BV + 3 * BT * BV + BT * BT) * elem
    if ws:
        more = state_output_ws.output_partitions(BV, l2) - 1
        hv = state_output_ws.hv_slots(slots)
        return (rings + tiles + ((hv - 1) * (K * BV + BT * BV) + more * (BT * BT + BT * BV)) * elem
                + (3 * slots + 2 * hv + 2 + 3 * (more + 1)) * 8)
    return rings + tiles + (2 * slots + 5) * 8


def _programs_by_smem(K: int, BV: int, elem: int, slots: int, smem_per_block: int, ws: bool = False,
                      l2: bool = False) -> int:
    """Programs with ``slots`` ring slots whose shared memory one SM holds (0: not one): an
    SM holds ``smem_per_block``, the device's opt-in maximum, plus the 1 KB each block
    reserves; a program takes its tiles, the compiler's scratch and that 1 KB."""
    need = state_output_smem_bytes(K, BV, elem, slots=slots, ws=ws, l2=l2) + SMEM_SCRATCH + SMEM_RESERVED_PER_BLOCK
    return (smem_per_block + SMEM_RESERVED_PER_BLOCK) // need


def state_output_programs_per_sm(K: int, BV: int = 64, elem: int = 2, warps: int = NUM_WARPS, *,
                                 smem_per_block: int = SMEM_OPTIN[(9, 0)]) -> int:
    """Programs of the fused kernel one SM holds at once, with two ring slots: by shared
    memory (:func:`_programs_by_smem`: 1 at K = 128, 2 at K = 64 and BV <= 64 on sm_90 /
    sm_100) and by registers (up to 255 per thread: two one-warpgroup programs or one
    two-warpgroup program in 64 K registers)."""
    by_smem = _programs_by_smem(K, BV, elem, 2, smem_per_block)
    return max(1, min(by_smem, 2 * NUM_WARPS // warps))


def _register_bound(K: int, BV: int, is_sm100: bool, warps: int, l2: bool, tails: bool) -> bool:
    """The specializations at the sm_90a register limit, where even the gate rows are
    loaded in their own chunk (:func:`.state_output_walk._gates_early`): the largest state
    tile on one warpgroup with the qk l2 norm and varlen tails."""
    return (not is_sm100 and warps == NUM_WARPS and state_tile_per_warpgroup(K, BV, warps) >= MAX_STATE_TILE
            and l2 and tails)


def state_output_ring_slots(K: int, BV: int, elem: int = 2, warps: int = NUM_WARPS, *,
                            smem_per_block: int = SMEM_OPTIN[(9, 0)], register_bound: bool = False,
                            ws: bool = False, l2: bool = False) -> int:
    """Ring slots (the kernel's ``NUM_BUF``) of a program: the most, up to
    :data:`RING_SLOTS_MAX`, whose shared memory fits ``smem_per_block`` with as many
    programs per SM as two slots allow; two where the build is ``register_bound``
    (:func:`_register_bound`: a third slot's addresses spilled there). ``ws``: of the
    warp-specialized walk (its own shared memory, no register bound of the one-warpgroup
    walk's; ``l2``: with the qk l2 norm, which sets its output partitions)."""
    if register_bound and not ws:
        return 2
    programs = max(1, _programs_by_smem(K, BV, elem, 2, smem_per_block, ws, l2)) if ws else \
        state_output_programs_per_sm(K, BV, elem, warps, smem_per_block=smem_per_block)
    return next((slots for slots in range(RING_SLOTS_MAX, 2, -1)
                 if _programs_by_smem(K, BV, elem, slots, smem_per_block, ws, l2) >= programs), 2)


def state_output_warps(K: int, BV: int) -> int:
    """Warps of one program: two warpgroups when the fp32 state tile ``K * BV`` exceeds what
    one holds in registers (:data:`MAX_STATE_TILE`), else one. Two warpgroups split every
    [*, BV] tile by columns and share the w / k / q ring, so a BV = 128 program does the
    work of two BV = 64 programs for one set of loads."""
    return NUM_WARPS * (2 if state_tile_per_warpgroup(K, BV, NUM_WARPS) > MAX_STATE_TILE else 1)


def state_output_defers(K: int, BV: int, is_sm100: bool, warps: int | None = None) -> bool:
    """Whether chunk t's A v_new is waited and stored under chunk t + 1's first MMAs
    (``DEFER_OUT``), taking that wait and o's store off the serial chain.

    sm_90a only: there its accumulator is a register value, while on sm_100a ``O`` is one
    TMEM tile that chunk t + 1's ``q h`` overwrites (deferring there needs a second one).
    Not at the largest state tile per thread, where the registers are already full
    (:func:`.state_output_walk._qk_late`).
    """
    warps = warps or state_output_warps(K, BV)
    return not is_sm100 and state_tile_per_warpgroup(K, BV, warps) < MAX_STATE_TILE


#: Launch configurations (BV, warps) the forward chooses from (:func:`state_output_config`).
#: Two warpgroups only at BV = 128: at BV = 32 and 64 they run slower on the H200 than one
#: warpgroup of the same columns per warpgroup.
CONFIGS = ((32, 4), (64, 4), (128, 8))


def state_output_config(K: int, V: int, num_heads: int, sm_count: int, elem: int = 2, *,
                        smem_per_block: int = SMEM_OPTIN[(9, 0)]) -> tuple[int, int]:
    """(BV, warps) of the fused kernel for ``num_heads`` (sequence, v-head) pairs on
    ``sm_count`` SMs of ``smem_per_block`` bytes of opt-in shared memory: the narrowest
    V-block among those that need the fewest waves of programs.

    Every program walks its sequence serially, so the time is (waves of programs) x (one
    walk), and a walk's per-chunk step grows with BV. Measured on the H200 (132 SMs, one
    program per SM at K = V = 128, bf16; ms of the kernel alone): one sequence of 32
    v-heads 0.73 at BV = 32 (128 programs) against 1.02 at 64; 64 v-heads 1.02 at BV = 64
    (128 programs) against 1.46 at 32 (two waves) and 1.55 at 128; 4 sequences of 32
    v-heads 0.40 at BV = 128 (128 programs on two warpgroups, one wave) against 0.53 at 64.
    """
    def cost(config):
        BV, warps = config
        programs = num_heads * (V // BV)
        capacity = max(sm_count, 1) * state_output_programs_per_sm(K, BV, elem, warps,
                                                                   smem_per_block=smem_per_block)
        return (-(-programs // capacity), BV)

    return min(state_output_configs(K, V), key=cost)


def state_output_configs(K: int, V: int) -> tuple[tuple[int, int], ...]:
    """The configurations (BV, warps) of :data:`CONFIGS` the fused kernel can run at K, V
    (BV divides V; enough warps to hold the state tile): those
    :func:`state_output_config` chooses from."""
    return tuple(c for c in CONFIGS if V % c[0] == 0 and c[1] >= state_output_warps(K, c[0]))


def state_constexprs(problem: GDNProblem, engine) -> dict:
    """The constexpr flags of the fused kernel that follow from the call and the engine."""
    return {
        "USE_H0": problem.initial_state is not None,
        "STORE_HT": problem.output_final_state,
        "STATE_VK": problem.state_layout is StateLayout.VK,
        "USE_L2NORM": problem.use_qk_l2norm,
        "HAS_TAILS": has_tails(problem),
        "ENGINE": engine,
        "USE_POOL": problem.uses_state_pool,
        "INPLACE": problem.inplace_final_state,
    }


#: What a plan's notes say of the warp-specialized walk.
_WS_NOTE = "warp-specialized: chain + output warpgroups"


def plan_state_output(problem: GDNProblem, device, *, block_v: int | None = None, num_warps: int | None = None,
                      defer_out: bool | None = None, ws: bool | None = None, engine=None) -> BoundLaunch:
    """Launch plan of :func:`state_output_fwd` for ``problem`` (a dry run: no GPU, no tensor
    read): the shared plan of the call's class in the chosen configuration, seen with the
    call's ``B * T`` and ``N`` (grid: ``N * HV * V / BV`` programs).

    Parameters
    ----------
    problem : a validated call; K and V in {64, 128}, bf16/fp16.
    device : DeviceInfo (``sm_count`` and the shared memory per block pick the V-block),
        or a bare capability tuple (its representative part).
    block_v : BV override, 32, 64 or 128 dividing V; default :func:`state_output_config`.
    num_warps : 4 or 8 (a state tile ``K * BV`` over 8192 needs 8); default the chosen
        configuration's, or :func:`state_output_warps` for an overridden BV.
    defer_out : override of :func:`state_output_defers` (sm_90a only).
    ws : walk warp-specialized (:mod:`.state_output_ws`; sm_90a, one warpgroup of state);
        default :data:`STATE_OUTPUT_WS` where it applies and ``defer_out`` is not asked for.
    engine : the matrix engine the launching backend passes (its ``ENGINE``); None: the
        one registry.toml admits on the device (:func:`~.launch_plan.resolve_engine`).
    """
    info = as_device(device)
    engine = resolve_engine(info, engine)
    is_sm100 = engine.is_sm100
    H, K, HV, V = problem.H, problem.K, problem.HV, problem.V
    N, dtype = problem.N, problem.dtype
    BT = CHUNK_SIZE
    elem = torch.finfo(dtype).bits // 8
    chosen_bv, chosen_warps = state_output_config(K, V, N * HV, info.sm_count, elem,
                                                  smem_per_block=shared_memory_per_block(info))
    BV = block_v or chosen_bv
    if BV not in BLOCK_V or V % BV:
        raise ValueError(f"block_v: expected 32, 64 or 128 dividing V = {V}, got {BV}")
    warps = num_warps or (chosen_warps if BV == chosen_bv else state_output_warps(K, BV))
    if warps not in (NUM_WARPS, 2 * NUM_WARPS) or state_tile_per_warpgroup(K, BV, warps) > MAX_STATE_TILE:
        raise ValueError(f"num_warps: expected 4 or 8 holding the [{K}, {BV}] state tile "
                         f"(at most {MAX_STATE_TILE} fp32 per warpgroup), got {warps}")
    if ws is None:
        # Not at K = 64, where two one-warpgroup programs share an SM: the walk's warpgroups
        # at the launch's registers would take it alone. Not where o's deferral is asked
        # for: that is the one-warpgroup walk's.
        ws = STATE_OUTPUT_WS and not is_sm100 and warps == NUM_WARPS and K == 128 and not defer_out
    elif ws and (is_sm100 or warps != NUM_WARPS):
        raise ValueError(f"ws: the warp-specialized walk runs on sm_90a with one warpgroup of state, "
                         f"not {'sm_100a' if is_sm100 else f'{warps} warps'}")
    elif ws and defer_out:
        raise ValueError("defer_out: the one-warpgroup walk's (the warp-specialized walk stores o in its "
                         "output partition)")
    # The warp-specialized walk stores o off the chain already.
    defer = False if ws else state_output_defers(K, BV, is_sm100, warps) if defer_out is None else bool(defer_out)
    if defer and is_sm100:
        raise ValueError("defer_out: sm_90a only (on sm_100a the A v_new accumulator is one TMEM tile)")
    NV = V // BV
    descriptors = (
        tile_desc("q_desc", "q", dtype, H * K, (BT, K), token_rows=True),
        tile_desc("k_desc", "k", dtype, H * K, (BT, K), token_rows=True),
        tile_desc("w_desc", "w", dtype, HV * K, (BT, K)),
        tile_desc("u_desc", "u", dtype, HV * V, (BT, BV)),
        tile_desc("o_desc", "o", dtype, HV * V, (BT, BV)),
        tile_desc("o_rows_desc", "o", dtype, HV * V, (1, BV), scatter=True),
    )
    slots = state_output_ring_slots(
        K, BV, elem, warps, smem_per_block=shared_memory_per_block(info),
        register_bound=_register_bound(K, BV, is_sm100, warps, problem.use_qk_l2norm, has_tails(problem)), ws=ws,
        l2=problem.use_qk_l2norm)
    descriptors, constexprs = drop_unused_scatter(
        descriptors, {**state_constexprs(problem, engine), "DEFER_OUT": defer, "NUM_BUF": slots, "CHAIN": False,
                      "WS": ws, "PICK": False})
    launch = LaunchPlan(
        kernel="state_output_fwd",
        # (sequence, v-head, V-block) programs.
        grid_rule=GridRule(per_seq=1, times=HV * NV),
        num_warps=warps,
        # TMEM: S [K, BV], P and O [64, BV], QK [64, 64]: at most 3 BV + 64 columns (the
        # compiler may pack M = 64 accumulators side by side in lanes, and take fewer).
        blocks={"BT": BT, "K": K, "BV": BV, "NV": NV,
                "smem_bytes": state_output_smem_bytes(K, BV, elem, slots=slots, ws=ws, l2=problem.use_qk_l2norm),
                "tmem_columns": 3 * BV + BT if is_sm100 else 0},
        constexprs=constexprs,
        descriptors=descriptors,
        scalars={"HV": HV, "GROUP": HV // H, "V": V},
        notes=(f"BV={BV}, {warps} warps: N x {HV} (sequence, v-head) pairs x {NV} V-blocks on "
               f"{info.sm_count} SMs; h and v_new stay on chip"
               f"{'; ' + _WS_NOTE if ws else '; o stored a chunk late' if defer else ''}"),
        # The hardware's cap, stated: uncapped, ptxas traded registers for spills on sm_100a.
        maxnreg=255 if is_sm100 else None,
    )
    return launch.bind(problem.B * problem.T, N)


def state_output_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g_cum: torch.Tensor,
    chunks: ChunkTable,
    launch: LaunchPlan | BoundLaunch,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    rnorm: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    chain: tuple | None = None,
    out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    pick: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence and the output of every chunk in one launch (stages 4 + 5 fused):
    per chunk ``v_new = u - w h``, ``o = scale (2^g (q h) + causal(q k^T 2^(g_i - g_j))
    v_new)``, ``h <- 2^g_last h + k^T (2^(g_last - g) v_new)``, with h and v_new kept on chip.

    Parameters
    ----------
    q, k : Tensor ``[B, T, H, K]``, bf16/fp16, in token rows the TMA unit reads in place
        (:func:`~.launch_plan.tma_rows_reason`) (raw: with the qk l2 norm the kernel scales
        by ``rnorm``); v-head ``j`` reads q/k head ``j // (HV // H)``. K in {64, 128}.
    w : Tensor ``[B, T, HV, K]``, k's dtype (stage 3; from l2-normalized k when asked).
    u : Tensor ``[B, T, HV, V]``, k's dtype (stage 3). V in {64, 128}.
    g_cum : float32 Tensor ``[B, T, HV]``, contiguous: chunk-local gate cumsum in log2 units.
    chunks : ChunkTable of the call.
    launch : the ``state_output_fwd`` plan of the call's class (:func:`plan_state_output`:
        BV, constexprs incl. the state layout and the l2 norm, descriptors); the grid and
        descriptor rows follow from ``chunks.num_seqs`` and the tensors given here.
    scale : float, the output scale.
    initial_state : Tensor ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk", as the
        plan's ``STATE_VK``), contiguous, any float dtype: float32 and bfloat16 are read in
        place, others converted to float32 once; None: zeros. With the plan's ``USE_POOL``,
        the state pool ``[P, HV, K, V]`` / ``[P, HV, V, K]``, float32 or bfloat16, read (and
        with ``INPLACE`` written) in place, never copied.
    output_final_state : also return the state after each sequence's last token.
    rnorm : with the qk l2 norm (the plan's ``USE_L2NORM``), float32 ``[B * T, H, 2]``, the
        reciprocal row norms of q and k from :func:`.qk_norm.qk_rnorm_fwd` (computed here
        when None); ignored without it.
    state_indices : with ``USE_POOL``, int32/int64 ``[N]``: sequence ``n`` starts from pool
        row ``state_indices[n]`` (zeros for an index outside ``[0, P)``); with ``INPLACE``
        its final state is written back there in the pool's dtype (nothing outside).
    chain : with a ``CHAIN`` plan (:func:`chained_plan`), ``(hand, f_start, chain_flags,
        seg_len, NSEG)``: the call's sequences walked as chained segments of ``seg_len``
        tokens in ``NSEG`` slots (:mod:`.segment_chain`; pass 1 wrote ``hand``'s N where a
        segment forgets, the forgetting starts and the zeroed counts); None otherwise.
    out : (o, final_state) allocated by the caller (contiguous, as returned below; the
        final state None unless ``output_final_state``), or None to allocate them here.
    pick : with a ``PICK`` plan (:mod:`.pick`), the pick word: the launch leaves at once
        where it names the warm chain (then o and the final state are the chain's).

    Returns
    -------
    o : Tensor ``[B, T, HV, V]`` in q's dtype.
    final_state : float32 Tensor ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk"), or
        None. A zero-length sequence's final state is its initial state (zeros without one).
    """
    B, T, HV, V = u.shape
    H, K = k.shape[2], k.shape[3]
    N = chunks.num_seqs
    launch = launch.shared
    use_pool = launch.constexprs["USE_POOL"]
    if use_pool and (state_indices is None or initial_state is None):
        raise ValueError("state_output_fwd: a USE_POOL plan needs initial_state (the pool) and state_indices")
    o, final_state, h0 = state_buffers(q, (B, T, HV, V), N, K, launch.constexprs["STATE_VK"], output_final_state,
                                       initial_state, use_pool, out)
    if B * T == 0 or N * HV == 0:
        return o, fill_final_state_of_empty_call(final_state, h0, use_pool, state_indices)
    if launch.constexprs["USE_L2NORM"]:
        if rnorm is None:
            rnorm = qk_rnorm_fwd(q, k, plan_qk_rnorm_rows(B * T * H, K))
        if rnorm.shape != (B * T, H, 2) or rnorm.dtype != torch.float32 or not rnorm.is_contiguous():
            raise ValueError(f"rnorm: expected contiguous float32 [{B * T}, {H}, 2], got {rnorm.dtype} "
                             f"{tuple(rnorm.shape)} contiguous={rnorm.is_contiguous()}")
    else:
        rnorm = g_cum  # not read
    if launch.constexprs["CHAIN"] != (chain is not None):
        raise ValueError("chain: a CHAIN plan needs (hand, f_start, chain_flags, seg_len, NSEG), another plan none")
    if launch.constexprs["PICK"] != (pick is not None):
        raise ValueError("pick: a PICK plan needs the pick word, another plan none")
    # Without a chain its pointers are stand-ins and its counts 0 (as the call programs bind
    # them); a picked launch reads its pick word where the chain's counts would be.
    hand, f_start, flags, seg_len, slots = chain if chain is not None else (g_cum, chunks.cu_seqlens,
                                                                            chunks.cu_seqlens if pick is None else pick,
                                                                            0, 0)
    tensors, args = state_output_launch_args(
        launch, q, k, w, u, o, g_cum, rnorm, h0 if h0 is not None else g_cum,
        final_state if final_state is not None else g_cum, state_indices if use_pool else chunks.cu_seqlens,
        chunks.cu_seqlens, float(scale), h0.shape[0] if use_pool else 0, hand, f_start, flags,
        N if chain is not None else 0, seg_len, slots)
    launch_planned(_state_output_fwd_kernel, launch, tensors, args, rows=B * T,
                   num_seqs=slots if chain is not None else N)
    return o, final_state


def state_output_launch_args(launch: LaunchPlan, q, k, w, u, o, g_cum, rnorm, h0, ht, state_indices, cu_seqlens,
                             scale, pool_size, hand, f_start, chain_flags, num_seqs, seg_len,
                             num_segments) -> tuple[dict, dict]:
    """The descriptor tensors and runtime arguments of one ``_state_output_fwd_kernel``
    launch, the unused pointers (``rnorm``, ``h0``, ``ht``, ``state_indices``; ``hand``,
    ``f_start``, ``chain_flags`` but for chained segments) already replaced by a stand-in
    (what :func:`state_output_fwd` launches with; :mod:`.call_program` binds the same
    lists)."""
    return {"q": q, "k": k, "w": w, "u": u, "o": o}, dict(
        o_ptr=o, g_cum=g_cum, rnorm=rnorm, h0=h0, ht=ht, state_indices=state_indices, cu_seqlens=cu_seqlens,
        hand=hand, f_start=f_start, chain_flags=chain_flags, scale=scale, HV=launch.scalars["HV"],
        GROUP=launch.scalars["GROUP"], pool_size=pool_size, N=num_seqs, L=seg_len, NSEG=num_segments,
        V=launch.scalars["V"])


def state_buffers(q: torch.Tensor, o_shape: tuple, N: int, K: int, vk: bool, output_final_state: bool,
                  initial_state: torch.Tensor | None, use_pool: bool, out: tuple | None = None):
    """What a recurrence kernel writes and reads: o ``o_shape`` in q's dtype, the float32
    final state (``[N, HV, V, K]`` with ``vk``, else ``[N, HV, K, V]``) or None, and the
    initial state as the kernels read it (float32 and bfloat16 in place, other dtypes
    converted to float32 once; a pool always in place). ``out``: (o, final state) the
    caller allocated, used as they are."""
    B, T, HV, V = o_shape
    if out is not None:
        o, final_state = out
    else:
        o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
        final_state = empty_final_state(output_final_state, N, HV, K, V, vk, q.device)
    h0 = initial_state
    if h0 is not None and not use_pool and h0.dtype not in (torch.float32, torch.bfloat16):
        h0 = h0.to(torch.float32)
    return o, final_state, h0


def fill_final_state_of_empty_call(final_state: torch.Tensor | None, h0: torch.Tensor | None, use_pool: bool,
                                   state_indices: torch.Tensor | None) -> torch.Tensor | None:
    """The final state of a call with no token to walk (every sequence empty): the initial
    one (zeros without one; a pool's rows through ``state_indices``). Nothing is written
    back to a pool: its rows would receive their own values."""
    if final_state is not None:
        if h0 is None:
            final_state.zero_()
        elif use_pool:
            final_state.copy_(pool_rows(h0, state_indices))
        else:
            final_state.copy_(h0)
    return final_state


def pool_rows(pool: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, ...]``: row ``state_indices[n]`` of ``pool`` ``[P, ...]``, zeros for an
    index outside ``[0, P)`` (on the device, no sync). For calls without a token, where no
    kernel runs; it reads N rows and copies nothing else of the pool."""
    live = (state_indices >= 0) & (state_indices < pool.shape[0])
    rows = pool.index_select(0, torch.where(live, state_indices, 0)).to(torch.float32)
    return torch.where(live.view(-1, *([1] * (pool.dim() - 1))), rows, 0.0)


_POINTERS = ("o_ptr", "g_cum", "rnorm", "h0", "ht", "state_indices", "cu_seqlens", "hand", "f_start", "chain_flags")


def state_output_signature(launch: LaunchPlan | BoundLaunch, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32,
                           index_dtype: torch.dtype = torch.int32,
                           cu_dtype: torch.dtype = torch.int32) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of ``_state_output_fwd_kernel`` for ``launch``, in
    argument order, as a launch of it would specialize (16-byte-aligned pointers).
    ``state_dtype``: of the initial state or pool (float32 or bfloat16; float32 stands in
    when there is none); ``index_dtype``: of ``state_indices`` with a pool (int32 or int64;
    without one, cu_seqlens stands in); ``cu_dtype``: of cu_seqlens (int32 or int64, as the
    caller passed it)."""
    constexprs = {"V": launch.scalars["V"], **launch.constexprs}
    sig = {d.arg: d.signature for d in launch.descriptors}
    pool = launch.constexprs["USE_POOL"]
    chain = launch.constexprs["CHAIN"]
    sig.update(o_ptr="*" + sig_dtype(dtype), g_cum="*fp32", rnorm="*fp32", h0="*" + sig_dtype(state_dtype),
               ht="*fp32", state_indices="*" + sig_dtype(index_dtype if pool else cu_dtype),
               cu_seqlens="*" + sig_dtype(cu_dtype), hand="*fp32",
               f_start="*i32" if chain else "*" + sig_dtype(cu_dtype),
               chain_flags="*i32" if chain else "*" + sig_dtype(cu_dtype),
               scale="fp32", HV="i32", GROUP="i32", pool_size="i32", N="i32", L="i32", NSEG="i32")
    sig.update({name: "constexpr" for name in constexprs})
    signature = {name: sig[name] for name in arg_names(_state_output_fwd_kernel)}
    return signature, constexprs, pointer_attrs(_state_output_fwd_kernel, _POINTERS)


def state_output_aot_kernel(backend: str, launch: LaunchPlan | BoundLaunch, dtype: torch.dtype, tag: str,
                            state_dtype: torch.dtype = torch.float32, index_dtype: torch.dtype = torch.int32,
                            cu_dtype: torch.dtype = torch.int32) -> AotKernel:
    """The AotKernel that compiles exactly what ``state_output_fwd`` launches for ``launch``
    (initial state / pool of ``state_dtype``, pool indices of ``index_dtype``, cu_seqlens
    of ``cu_dtype``)."""
    signature, constexprs, attrs = state_output_signature(launch, dtype, state_dtype, index_dtype, cu_dtype)
    return AotKernel(backend=backend, kernel="state_output_fwd", specialization=tag,
                     fn=_state_output_fwd_kernel, signature=signature, constexprs=constexprs,
                     dialect="gluon", num_warps=launch.num_warps, attrs=attrs, maxnreg=launch.maxnreg)


def _aot_problem(K: int, V: int, dtype: torch.dtype, tails: bool, vk: bool, h0: bool, ht: bool, l2: bool,
                 pool: bool = False, inplace: bool = False, **_dtypes):
    """A tiny CPU problem whose plan has the asked flags (only shapes and flags matter);
    with ``pool``, the initial state is a state pool of 3 rows read through state_indices."""
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.testing import random_call

    shape = dict(lengths=[64, 65]) if tails else dict(batch=(2, 128))
    call = random_call(**shape, H=2, HV=4, K=K, V=V, dtype=dtype, state_layout="vk" if vk else "kv",
                       initial_state=h0 and not pool, normalize_qk=not l2)
    if pool:
        call["initial_state"] = torch.zeros(3, 4, *((V, K) if vk else (K, V)))
        call["state_indices"] = torch.tensor([2, -1], dtype=torch.int32)
        call["inplace_final_state"] = inplace
    return make_problem(**call, output_final_state=ht, use_qk_l2norm_in_kernel=l2)


def _aot_tag(K: int, V: int, BV: int, warps: int, flags: dict) -> str:
    state = flags["state_dtype"]
    pool = (f"-pool-{sig_dtype(state)}-{sig_dtype(flags['index_dtype'])}{'-inplace' if flags['inplace'] else ''}"
            if flags["pool"] else (f"-h0{'' if state == torch.float32 else '-' + sig_dtype(state)}" if flags["h0"]
                                   else ""))
    return (f"K{K}-V{V}-BV{BV}-w{warps}-{sig_dtype(flags['dtype'])}-{'tails' if flags['tails'] else 'full'}-"
            f"{'vk' if flags['vk'] else 'kv'}{pool}{'-ht' if flags['ht'] else ''}{'-l2' if flags['l2'] else ''}"
            f"{'-cu64' if flags['cu_dtype'] == torch.int64 else ''}")


def state_output_kernels_for_aot(capability: tuple[int, int], backend: str, *,
                                 engine=None) -> list[AotKernel]:
    """The fused kernel at every specialization it can launch on ``capability``.

    Every (K, V) in {64, 128}^2 at every configuration of :data:`CONFIGS` that holds its
    state tile (o stored a chunk late where :func:`state_output_defers`) x bf16/fp16 x
    varlen tails or not x "kv"/"vk" x qk l2 norm on/off (bf16 only:
    :func:`.qk_norm.l2_flags`; with a float32 initial state and
    the final state); then K = V = 128 at BV = 128 without initial or final state, or with
    only one of them. State pools, at every configuration with tails and the l2 norm: a
    float32 "kv" pool with int32 indices written back in place (and the final state
    returned), a bfloat16 "vk" pool with int64 indices written back in place; then a
    bfloat16 pool only read (K = V = 128, BV = 128) and a bfloat16 initial state without a
    pool (K = V = 128, BV = 64). int64 cu_seqlens (read as the caller passes them) at
    K = V = 128 in every configuration, and there context parallelism's second pass (float32
    "kv" start states, no final state) with and without tails and the l2 norm.
    """
    from gdn_dispatch.device import assumed_device

    device = assumed_device(f"sm_{capability[0]}{capability[1]}")
    base = dict(dtype=torch.bfloat16, tails=True, vk=False, h0=True, ht=True, l2=True, pool=False, inplace=False,
                state_dtype=torch.float32, index_dtype=torch.int32, cu_dtype=torch.int32)
    configs = [(K, V, BV, warps) for K in (64, 128) for V in (64, 128) for BV, warps in CONFIGS
               if V % BV == 0 and warps >= state_output_warps(K, BV)]
    cases = []
    for K, V, BV, warps in configs:
        for dtype in (torch.bfloat16, torch.float16):
            for tails in (True, False):
                for vk in (False, True):
                    for l2 in l2_flags(dtype):
                        cases.append((K, V, BV, warps, {**base, "dtype": dtype, "tails": tails, "vk": vk, "l2": l2}))
    for flip in (dict(h0=False, ht=False), dict(h0=True, ht=False), dict(h0=False, ht=True)):
        cases.append((128, 128, 128, 8, {**base, **flip}))
    for K, V, BV, warps in configs:
        cases.append((K, V, BV, warps, {**base, "pool": True, "inplace": True}))
        cases.append((K, V, BV, warps, {**base, "pool": True, "inplace": True, "vk": True, "ht": False,
                                        "state_dtype": torch.bfloat16, "index_dtype": torch.int64}))
    cases.append((128, 128, 128, 8, {**base, "pool": True, "state_dtype": torch.bfloat16}))
    cases.append((128, 128, 64, 4, {**base, "state_dtype": torch.bfloat16}))
    for K, V, BV, warps in configs:
        if K == V == 128:
            cases.append((K, V, BV, warps, {**base, "cu_dtype": torch.int64}))
            # Context parallelism's second pass: the segments' float32 "kv" start states, no
            # final state (the scan gives it), either tail flag.
            for tails in (True, False):
                for l2 in (True, False):
                    cases.append((K, V, BV, warps, {**base, "ht": False, "tails": tails, "l2": l2}))
    seen, unique = set(), []
    for K, V, BV, warps, flags in cases:
        key = (K, V, BV, warps, tuple(sorted((name, str(value)) for name, value in flags.items())))
        if key not in seen:
            seen.add(key)
            unique.append((K, V, BV, warps, flags))
    # Chained segments' pass 2 (the call's own flags, CHAIN on) at K = V = 128 in every
    # configuration: a float32 "kv" initial and final state, and a bfloat16 "vk" pool
    # written back in place.
    chained = [(K, V, BV, warps, flags) for K, V, BV, warps in configs if K == V == 128
               for flags in (base, {**base, "pool": True, "inplace": True, "vk": True, "ht": False,
                                    "state_dtype": torch.bfloat16, "index_dtype": torch.int64})]
    kernels = []
    for K, V, BV, warps, flags, chain in [(*case, False) for case in unique] + [(*case, True) for case in chained]:
        launch = plan_state_output(_aot_problem(K, V, **flags), device, block_v=BV, num_warps=warps,
                                   engine=engine)
        tag = _aot_tag(K, V, BV, warps, flags)
        if chain:
            launch = chained_plan(launch.shared)
            tag += "-chain"
        state_dtype = flags["state_dtype"] if flags["h0"] or flags["pool"] else torch.float32
        kernels.append(state_output_aot_kernel(backend, launch, flags["dtype"], tag, state_dtype,
                                               flags["index_dtype"], flags["cu_dtype"]))
    return kernels


def chained_plan(launch: LaunchPlan) -> LaunchPlan:
    """``launch`` (a fused-kernel plan of a call) as chained segments' pass 2: the same
    configuration and flags with ``CHAIN`` on (and the one-warpgroup walk: ``WS`` off),
    over the segment slots (its launch's ``num_seqs``), with compiled kernels of its own."""
    flags, blocks, notes = {**launch.constexprs, "CHAIN": True, "WS": False}, launch.blocks, launch.notes
    if launch.constexprs["WS"]:
        # The one-warpgroup walk's own o deferral; the ring slots of the warp-specialized
        # walk fit it too (it needs less shared memory).
        K, BV = blocks["K"], blocks["BV"]
        flags["DEFER_OUT"] = state_output_defers(K, BV, launch.constexprs["ENGINE"].is_sm100, launch.num_warps)
        elem = launch.desc("u_desc").dtype.itemsize
        blocks = {**blocks, "smem_bytes": state_output_smem_bytes(K, BV, elem, slots=flags["NUM_BUF"])}
        notes = notes.replace("; " + _WS_NOTE, "; o stored a chunk late" if flags["DEFER_OUT"] else "")
    return dataclasses.replace(launch, constexprs=flags, blocks=blocks, compiled={},
                               notes=notes + "; chained segments: NSEG slots taken in slot order")
