"""The chunk inverses alone: per (chunk, v-head) the scaled T tile(s) the fused kernel
multiplies by, and the gates' chunk-local cumsum.

    A   = strictly-lower(beta_i r_i r_j (k_i . k_j) 2^(g_i - g_j))      [64, 64]
    T   = (I + A)^-1
    T_w = T diag(beta 2^g r)          T_u = T diag(beta)                  (q's dtype)

(:mod:`.wy` forms the same T and goes on to ``w = T_w k``, ``u = T_u v``.) The fused
kernel then needs 8 KB per chunk and head from here (T_u alone; 16 KB with T_w) instead
of w and u (32 KB each at K = V = 128): the inverse is a chain of ten dependent
products, which many small programs per SM run side by side here, while the fused
kernel's one aux warpgroup per SM takes them one chunk at a time. sm_90a's fused kernel
does form them itself by default (on fp16 products, :data:`..gluon_sm90.fused.AUX_T`):
this kernel runs with that flag off, and for the sm_100a twin. On sm_90a the inverse
runs in 16 x 16 blocks on mma.sync (:mod:`.blocked_inverse`,
:data:`WY_T_BLOCKED_INVERSE`); turned off, on fp16 operands with a tf32 redo where T
leaves fp16's range (the "f16" inverse of :mod:`.wy`).

Layout of ``t_tiles``: with :data:`WY_T_SINGLE_TILE` (the default on sm_90a)
``[slots * HV * 64, 64]`` rows, T_u of chunk slot ``c`` (:func:`.wy.wy_chunks`: with tails
a sequence's chunks start at slot ``cu[n] // 64 + n``) and v-head ``h`` at rows ``(c * HV
+ h) * 64`` (sent as sixteen 16 x 16 TMA boxes, :data:`WY_T_BLOCK_TMA`); else ``[slots *
HV * 128, 64]``, T_w then T_u at rows ``(c * HV + h) * 128``. Idle slots are not written.
Rows of T past a sequence's end are 0 in both tiles (beta reads 0 there).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem
from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.gluon_common.compat import arg_names, reinterpret, tma_load, tma_store
from gdn_dispatch.backends.gluon_common.launch import launch_planned
from gdn_dispatch.backends.gluon_common.launch_plan import (
    NUM_WARPS, BoundLaunch, GridRule, LaunchPlan, as_device, has_tails, pointer_attrs, resolve_engine, sig_dtype,
    tile_desc, token_stride)
from gdn_dispatch.backends.gluon_common import wy
from gdn_dispatch.backends.gluon_common.blocked_inverse import BLOCK, BLOCKS, block_ids, block_mma_layout, fp16_products
from gdn_dispatch.backends.gluon_common.qk_norm import l2_flags
from gdn_dispatch.backends.gluon_common.wy import (
    _f32_layout, chunk_program, chunk_rows_early, chunk_t, chunk_t_blocked, chunk_t_diagonals, regs_inverse_smem,
    t_tile_pair, wy_chunks)


@gluon.jit(do_not_specialize=["HV", "GROUP", "s_g", "s_beta", "N"])
def _wy_t_fwd_kernel(k_desc, t_desc, t_ptr, g, g_cum, beta, cu_seqlens, N, HV, GROUP, s_g, s_beta,
                     HAS_TAILS: gl.constexpr, USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr,
                     F16_INVERSE: gl.constexpr, BLOCKED_INVERSE: gl.constexpr, EARLY_ROWS: gl.constexpr,
                     SINGLE_T: gl.constexpr, DIRECT_STORE: gl.constexpr, BLOCK_TMA: gl.constexpr):
    BT: gl.constexpr = k_desc.block_type.shape[0]
    K: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    i_c, i_h, row0, n_valid = chunk_program(cu_seqlens, N, HV, BT, HAS_TAILS)
    if n_valid <= 0:
        return

    k_smem = gl.allocate_shared_memory(dtype, [BT, K], k_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], _f32_layout(True))
    t_layout: gl.constexpr = t_desc.layout
    if BLOCKED_INVERSE:
        # Both scaled T tiles fit in x's bytes, free once the inverse's tables are: 32 KB a
        # program, so the register cap alone bounds the programs per SM.
        tw_smem, tu_smem = t_tile_pair(x_smem, dtype, t_layout)
    else:
        a_smem, lhs_smem, tw_smem, tu_smem = regs_inverse_smem(x_smem, dtype, t_layout, ENGINE)
    bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(bars.index(i), count=1)

    mbarrier.expect(bars.index(0), k_desc.block_type.nbytes)
    tma_load(k_desc, [row0, (i_h // GROUP) * K], bars.index(0), k_smem)
    rows_early = chunk_rows_early(g, s_g, beta, s_beta, row0, n_valid, i_h, BT, EARLY_ROWS)
    mbarrier.wait(bars.index(0), 0)
    if DIRECT_STORE:
        X, Y, W, Vb = chunk_t_diagonals(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, x_smem,
                                        bars.index(1), USE_L2NORM, ENGINE, rows_early)
        if BLOCK_TMA:
            # Diagonal d's batch in slots 4 d .. 4 d + 3 (x_smem's bytes, free after the
            # inverse), each slot one 16 x 16 TMA box: block r goes to T's block (r, (r - d)
            # mod 4), so the batch's zero blocks (r < d) land on the six above the diagonal.
            slots = reinterpret(x_smem, dtype, [BLOCKS * BLOCKS, BLOCK, BLOCK], _block_slots_layout())
            _stage_t_u_diagonal(slots.slice(0, BLOCKS), X, 0, beta, s_beta, row0, n_valid, i_h)
            _stage_t_u_diagonal(slots.slice(BLOCKS, BLOCKS), Y, 1, beta, s_beta, row0, n_valid, i_h)
            _stage_t_u_diagonal(slots.slice(2 * BLOCKS, BLOCKS), W, 2, beta, s_beta, row0, n_valid, i_h)
            _stage_t_u_diagonal(slots.slice(3 * BLOCKS, BLOCKS), Vb, 3, beta, s_beta, row0, n_valid, i_h)
            # The TMA stores read the slots through the async proxy.
            fence_async_shared()
            boxes = reinterpret(x_smem, dtype, [BLOCKS * BLOCKS * BLOCK, BLOCK], t_layout)
            tile_row32 = (i_c * HV + i_h) * BT
            for d in gl.static_range(BLOCKS):
                for r in gl.static_range(BLOCKS):
                    tma_store(t_desc, [tile_row32 + BLOCK * r, BLOCK * ((r - d + BLOCKS) % BLOCKS)],
                              boxes.slice(BLOCK * (BLOCKS * d + r), BLOCK))
            tma.store_wait(0)
        else:
            tile_row = (i_c * HV + i_h).to(gl.int64) * BT
            for d in gl.static_range(1, BLOCKS):
                _store_zero_blocks(t_ptr, tile_row, -d)
            _store_t_u_diagonal(t_ptr, tile_row, X, 0, beta, s_beta, row0, n_valid, i_h)
            _store_t_u_diagonal(t_ptr, tile_row, Y, 1, beta, s_beta, row0, n_valid, i_h)
            _store_t_u_diagonal(t_ptr, tile_row, W, 2, beta, s_beta, row0, n_valid, i_h)
            _store_t_u_diagonal(t_ptr, tile_row, Vb, 3, beta, s_beta, row0, n_valid, i_h)
    elif BLOCKED_INVERSE:
        t, w_scale, u_scale = chunk_t_blocked(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, x_smem,
                                              bars.index(1), USE_L2NORM, ENGINE, rows_early)
    else:
        t, w_scale, u_scale = chunk_t(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV,
                                      a_smem, x_smem, lhs_smem, bars.index(1), bars.index(2), True, USE_L2NORM,
                                      ENGINE, F16_INVERSE)
    if not DIRECT_STORE:
        if not SINGLE_T:
            tw_smem.store((t * gl.expand_dims(w_scale, 0)).to(dtype))
        tu_smem.store((t * gl.expand_dims(u_scale, 0)).to(dtype))
        # The TMA stores read the tiles through the async proxy.
        fence_async_shared()
        if SINGLE_T:
            tma_store(t_desc, [(i_c * HV + i_h) * BT, 0], tu_smem)
        else:
            base = (i_c * HV + i_h) * (2 * BT)
            tma_store(t_desc, [base, 0], tw_smem)
            tma_store(t_desc, [base + BT, 0], tu_smem)
        tma.store_wait(0)
    for i in gl.static_range(3):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _t_u_diagonal(blk, d: gl.constexpr, beta, s_beta, row0, n_valid, i_h):
    """Block diagonal ``d`` of T (a :func:`.blocked_inverse.blocked_inverse_diagonals`
    batch: block r is T's block (r, r - d), zero where r < d) scaled by beta's columns, as
    T_u's blocks (r, (r - d) mod 4): fp32 in the mma.sync layout, with each element's block
    row ``b``, row ``i`` within it and T_u column ``col`` (the zero blocks' columns those of
    the blocks above the diagonal)."""
    b, i, j = block_ids(block_mma_layout())
    col = BLOCK * ((b - d + BLOCKS) % BLOCKS) + j
    beta_col = gl.load(beta + (row0 + col).to(gl.int64) * s_beta + i_h, mask=(b >= d) & (col < n_valid), other=0.0)
    return blk * beta_col.to(gl.float32), b, i, col


@gluon.jit
def _store_t_u_diagonal(t_ptr, tile_row, blk, d: gl.constexpr, beta, s_beta, row0, n_valid, i_h):
    """:func:`_t_u_diagonal`'s blocks r >= d into the T_u tile at row ``tile_row`` of
    ``t_ptr``, straight from the mma.sync registers: no select builds the [64, 64] tile and
    no shared memory stages it."""
    t_u, b, i, col = _t_u_diagonal(blk, d, beta, s_beta, row0, n_valid, i_h)
    rows = tile_row + BLOCK * b + i
    gl.store(t_ptr + rows * (BLOCKS * BLOCK) + col, t_u.to(t_ptr.dtype.element_ty), mask=b >= d)


@gluon.constexpr_function
def _block_slots_layout():
    """The staged T_u blocks as ``[16, 16, 16]`` slots, each laid out as a [16, 16] TMA box
    of 16-bit elements with the 32-byte swizzle its descriptor takes (16-byte vectors, the
    phase turning every 4 rows)."""
    return gl.SwizzledSharedLayout(8, 4, 2, [2, 1, 0])


@gluon.jit
def _stage_t_u_diagonal(slots, blk, d: gl.constexpr, beta, s_beta, row0, n_valid, i_h):
    """:func:`_t_u_diagonal`'s four blocks into the shared slots ``slots``, block r in slot
    r, for the TMA box of T_u's block (r, (r - d) mod 4)."""
    t_u, _, _, _ = _t_u_diagonal(blk, d, beta, s_beta, row0, n_valid, i_h)
    slots.store(t_u.to(slots.dtype))


@gluon.jit
def _store_zero_blocks(t_ptr, tile_row, d: gl.constexpr):
    """Zeros into the T_u tile's blocks (r, r - d) above the diagonal (``d < 0``; r - d <= 3):
    the fused kernel reads the whole tile."""
    b, i, j = block_ids(block_mma_layout())
    col = BLOCK * (b - d) + j
    rows = tile_row + BLOCK * b + i
    zero = gl.zeros([BLOCKS, BLOCK, BLOCK], gl.float32, block_mma_layout())
    gl.store(t_ptr + rows * (BLOCKS * BLOCK) + col, zero.to(t_ptr.dtype.element_ty),
             mask=b - d < BLOCKS)


@gluon.jit
def first_t_slot(bos, i_n, BT: gl.constexpr, HAS_TAILS: gl.constexpr):
    """The chunk slot of sequence ``i_n``'s first chunk (it starts at row ``bos``) in
    ``t_tiles``: with tails every sequence starts a new slot (:func:`.wy.wy_chunks`)."""
    if HAS_TAILS:
        slot = bos // BT + i_n
    else:
        slot = bos // BT
    return slot


def t_tile_rows(rows: int, num_seqs: int, HV: int, tails: bool, tiles: int = 2) -> int:
    """Rows of ``t_tiles`` for a call of ``rows = B * T`` tokens in ``num_seqs`` sequences,
    ``tiles`` per chunk slot and v-head (1: T_u alone, :data:`WY_T_SINGLE_TILE`)."""
    return wy_chunks(rows, num_seqs, tails) * HV * tiles * CHUNK_SIZE


def planned_t_tile_rows(launch: LaunchPlan, rows: int, num_seqs: int) -> int:
    """Rows of ``t_tiles`` that :func:`wy_t_fwd` writes under ``launch`` (its shared plan)
    for a call of ``rows = B * T`` tokens in ``num_seqs`` sequences."""
    return t_tile_rows(rows, num_seqs, launch.scalars["HV"], launch.constexprs["HAS_TAILS"],
                       1 if launch.constexprs["SINGLE_T"] else 2)


def t_tiles_per_chunk(engine) -> int:
    """T tiles the T kernel writes per chunk slot and v-head for ``engine``'s fused kernel."""
    return 1 if WY_T_SINGLE_TILE and not engine.is_sm100 else 2


#: Without the blocked inverse, the 64 x 64 one on fp16 operands on sm_90a
#: (:func:`.wy._unit_lower_inverse_regs` with ``F16``; 3-8% faster than tf32 on the H200,
#: equal to 3e-5).
WY_T_F16_INVERSE = True

#: The inverse in 16 x 16 blocks on mma.sync (:mod:`.blocked_inverse`; sm_90a, 4 warps)
#: instead of ten 64 x 64 wgmma products on fp16 operands with a tf32 redo. H200, triton
#: 3.6.0, H16-HV32: the T kernel 0.314 -> 0.286 ms at 4 x 8192, 0.632 -> 0.520 on ragged16
#: (outputs within 2.2e-4 of each other). The sm_100a build keeps the 64 x 64 inverse: its
#: A tile lives in tensor memory, not in the wgmma layout the block extraction reads.
WY_T_BLOCKED_INVERSE = True

#: Register cap of the sm_90a launch with the blocked inverse and T_u alone (the defaults):
#: five programs per SM. H200, triton 3.6.0, ``python benchmarks/flag_ab.py t_regs`` (two
#: rounds, bf16, K = V = 128): the T kernel 0.213 / 0.214 -> 0.204 / 0.205 ms at H16-HV32
#: 4 x 8192 against 128 registers and four programs, 0.415 / 0.414 -> 0.406 / 0.403 on
#: ragged16; outputs bit-equal. (Before the inverse's table was swizzled the two caps
#: measured equal; at 80 registers, six programs, 0.321 against 0.290 ms.)
WY_T_MAXNREG_SM90 = 96
#: Spill bytes the sm_90a build keeps at :data:`WY_T_MAXNREG_SM90`
#: (``AotKernel.spill_bytes_allowed``) with the tf32 inverse: 16-64 per specialization with
#: triton 3.6.0, none with 3.9.0 (0-16 with 3.6.0 before the inverse formed its off-diagonal
#: factors first: the kernel's time on the H100 unchanged by it, outputs within 7e-5).
WY_T_SPILL_BYTES_SM90 = 64
#: Spill bytes the same build keeps with the fp16 inverse
#: (:data:`.blocked_inverse.F16_OPERANDS`, the default), whose redo of chunks past fp16's
#: range (A formed again, T by rows) sits beside it: 96-160 by specialization with triton
#: 3.6.0 with fp16 tables and the series, as shipped (the varlen bf16 build 120-192 over
#: fp16 or fp32 tables, series or doubling).
WY_T_F16_SPILL_BYTES_SM90 = 320
#: The cap of the other sm_90a builds (the wgmma inverse, or T_w and T_u both): four
#: programs per SM. With the wgmma inverse (49 KB of shared memory) ptxas keeps some bytes
#: per thread in local memory (:data:`WY_T_PAIR_SPILL_BYTES_SM90`) and the kernel is still
#: faster than at 168 registers and three programs (H200, triton 3.6.0, 4 x 8192 HV 32:
#: 0.319 against 0.351 ms; ragged16: 0.635 against 0.658; outputs bit-equal).
WY_T_PAIR_MAXNREG_SM90 = 128
#: Spill bytes those builds keep at :data:`WY_T_PAIR_MAXNREG_SM90`: 248-304 per
#: specialization with triton 3.6.0, 232-352 with 3.9.0 (not timed on a GPU).
WY_T_PAIR_SPILL_BYTES_SM90 = 384


def t_kernel_caps(engine, blocked: bool, single: bool) -> tuple[int, int]:
    """(register cap, spill bytes allowed) of the T kernel's build on ``engine`` with the
    blocked inverse or not and T_u alone or not."""
    if engine.is_sm100:
        return 255, 0
    if blocked and single:
        return WY_T_MAXNREG_SM90, WY_T_F16_SPILL_BYTES_SM90 if fp16_products() else WY_T_SPILL_BYTES_SM90
    return WY_T_PAIR_MAXNREG_SM90, WY_T_PAIR_SPILL_BYTES_SM90

#: The T kernel writes T_u alone, and sm_90a's fused kernel takes its state partition's
#: v_new as ``T_u (v - diag(2^g) k S)`` (``u - w S`` regrouped), so that neither T_w nor
#: w and u are formed: half the T tiles' bytes through global memory (16 -> 8 KB per chunk
#: and v-head), and the aux partition keeps only the scores and gate vectors
#: (:mod:`..gluon_sm90.fused`). (The sm_100a twin reads both tiles.) H200, triton 3.6.0,
#: ``python benchmarks/flag_ab.py t_u_chain`` (two rounds, bf16, K = V = 128): calls 0.646 /
#: 0.639 -> 0.639 / 0.639 ms at H16-HV32 4 x 8192, 0.658 / 0.656 -> 0.647 / 0.647 at 8 x 4096,
#: 1.200 / 1.193 -> 1.184 / 1.180 on ragged16, 1.267 / 1.270 -> 1.250 / 1.252 at HV 64; the
#: kernels' times alike (the fused kernel paced by its state partition, the T kernel by its
#: L1), o within 8e-4 of the pair's. Against the float32 reference with correlated keys
#: (cosine 0.9 / 0.99) o's error 1.36e-2 / 1.80e-2 -> 1.22e-2 / 1.80e-2, the state's
#: 1.30e-2 / 1.93e-2 -> 1.09e-2 / 1.62e-2 (fla 0.6.0: o 1.26e-2 / 1.59e-2). Measured
#: before, and removed: T_w formed from T_u in the aux partition (the T kernel 0.287 ->
#: 0.267 ms, the fused kernel 0.360 -> 0.414 at H16-HV32 4 x 8192).
#: With the blocked inverse the T kernel then stores T_u's 16 x 16 blocks from the
#: inverse's mma.sync registers with plain global stores (beta's column scale loaded per
#: block), instead of selecting them into the [64, 64] tile and sending that through
#: shared memory and a TMA store (the kernel's ``DIRECT_STORE``).
WY_T_SINGLE_TILE = True

#: With :data:`WY_T_SINGLE_TILE`, T_u's sixteen 16 x 16 blocks staged in shared memory and
#: sent by sixteen TMA stores (a [16, 16] box each; the inverse's zero blocks fill the six
#: above the diagonal) instead of plain global stores from the mma.sync registers, whose
#: 4-byte writes fill half of each 32-byte sector: the T kernel is bound by its L1's
#: wavefronts. H200, triton 3.6.0, ``python benchmarks/flag_ab.py t_block_tma`` (two
#: rounds): the T kernel 0.225 -> 0.215 ms at H16-HV32 4 x 8192, 0.426 -> 0.413 on
#: ragged16, 0.448 -> 0.425 at HV 64; calls 0.591 / 0.593 -> 0.579 / 0.578 ms, 1.109 /
#: 1.108 -> 1.095 / 1.095, 1.173 / 1.174 -> 1.153 / 1.146; outputs bit-equal.
WY_T_BLOCK_TMA = True


def plan_wy_t(problem: GDNProblem, device, *, engine=None) -> BoundLaunch:
    """Launch plan of :func:`wy_t_fwd` for ``problem`` (a dry run: no GPU, no tensor read):
    one program per (chunk slot, v-head), v-head fastest; 4 warps."""
    info = as_device(device)
    engine = resolve_engine(info, engine)
    tails = has_tails(problem)
    H, HV, K = problem.H, problem.HV, problem.K
    BT = CHUNK_SIZE
    dtype = problem.dtype
    blocked = WY_T_BLOCKED_INVERSE and not engine.is_sm100
    single = t_tiles_per_chunk(engine) == 1
    block_tma = single and blocked and WY_T_BLOCK_TMA
    launch = LaunchPlan(
        kernel="wy_t_fwd",
        grid_rule=GridRule(row_block=BT, per_seq=1 if tails else 0, times=HV),
        num_warps=NUM_WARPS,
        blocks={"BT": BT, "K": K, "smem_bytes": BT * K * torch.finfo(dtype).bits // 8 + (1 if blocked else 2) * BT * BT * 4},
        constexprs={"HAS_TAILS": tails, "USE_L2NORM": problem.use_qk_l2norm, "ENGINE": engine,
                    "F16_INVERSE": WY_T_F16_INVERSE and not engine.is_sm100 and not blocked,
                    "BLOCKED_INVERSE": blocked, "EARLY_ROWS": blocked and wy.WY_EARLY_ROWS,
                    "SINGLE_T": single, "DIRECT_STORE": single and blocked, "BLOCK_TMA": block_tma},
        descriptors=(tile_desc("k_desc", "k", dtype, H * K, (BT, K), token_rows=True),
                     tile_desc("t_desc", "t", dtype, BT, (16, 16) if block_tma else (BT, BT))),
        scalars={"HV": HV, "GROUP": HV // H},
        notes=f"{'B*T // 64 + N chunk slots' if tails else 'B*T / 64 chunks'} x {HV} v-heads: "
              f"{'T_u' if single else 'T_w, T_u'} only",
        maxnreg=t_kernel_caps(engine, blocked, single)[0],
    )
    return launch.bind(problem.B * problem.T, problem.N)


def wy_t_fwd(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunks: ChunkTable,
             launch: LaunchPlan | BoundLaunch, out: tuple[torch.Tensor, torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scaled chunk inverses and the gates' chunk-local cumsum (one launch).

    Parameters
    ----------
    k : Tensor ``[B, T, H, K]``, bf16/fp16, in token rows the TMA unit reads in place.
    g, beta : Tensor ``[B, T, HV]``, any float dtype (read as fp32), in token rows.
    chunks : ChunkTable of the call.
    launch : the call class's :func:`plan_wy_t` plan.
    out : (t_tiles, g_cum) allocated by the caller (contiguous; t_tiles of
        :func:`planned_t_tile_rows` rows), or None to allocate them here.

    Returns
    -------
    t_tiles : Tensor ``[slots * HV * 128, 64]`` (``[slots * HV * 64, 64]`` with
        :data:`WY_T_SINGLE_TILE`) in k's dtype (module docstring).
    g_cum : float32 Tensor ``[B, T, HV]``: ``log2(e)`` times the chunk-local inclusive
        cumsum of g (rows of every sequence written).
    """
    B, T, H, K = k.shape
    launch = launch.shared
    HV = launch.scalars["HV"]
    if out is None:
        t_tiles = torch.empty(planned_t_tile_rows(launch, B * T, chunks.num_seqs), CHUNK_SIZE, dtype=k.dtype,
                              device=k.device)
        g_cum = torch.empty(B, T, HV, dtype=torch.float32, device=k.device)
    else:
        t_tiles, g_cum = out
    if B * T == 0 or HV == 0:
        return t_tiles, g_cum
    tensors, args = wy_t_launch_args(launch, k, t_tiles, g, g_cum, beta, chunks.cu_seqlens, chunks.num_seqs,
                                     token_stride(g), token_stride(beta))
    launch_planned(_wy_t_fwd_kernel, launch, tensors, args, rows=B * T, num_seqs=chunks.num_seqs)
    return t_tiles, g_cum


def wy_t_launch_args(launch: LaunchPlan, k, t_tiles, g, g_cum, beta, cu_seqlens, num_seqs, s_g, s_beta
                     ) -> tuple[dict, dict]:
    """The descriptor tensors and runtime arguments of one ``_wy_t_fwd_kernel`` launch (what
    :func:`wy_t_fwd` launches with; :mod:`.call_program` binds the same lists)."""
    return {"k": k, "t": t_tiles}, dict(
        t_ptr=t_tiles, g=g, g_cum=g_cum, beta=beta, cu_seqlens=cu_seqlens, N=num_seqs,
        HV=launch.scalars["HV"], GROUP=launch.scalars["GROUP"], s_g=s_g, s_beta=s_beta)


def wy_t_kernels_for_aot(capability: tuple[int, int], backend: str, *, engine, l2_on_chip: bool = False,
                         head_dims: tuple[int, ...] = (128,)) -> list:
    """Every specialization :func:`wy_t_fwd` launches with the fused kernel of ``backend``:
    K = 128, bf16/fp16, tails or not, (g, beta) in (fp32, fp32), (fp32, q's dtype) or
    (q's dtype, q's dtype), int32 cu_seqlens; then bf16 with int64 cu_seqlens; with
    ``l2_on_chip`` the bf16 ones again on raw k, the qk l2 norm reduced in the kernel
    (:data:`..gluon_sm90.fused.QK_NORM_ON_CHIP`). Other K of ``head_dims``: the bf16 cases
    with fp32 gates, with and without tails (and on raw k with ``l2_on_chip``)."""
    from gdn_dispatch.aot import AotKernel
    from gdn_dispatch.backends.gluon_common.wy import aot_problem

    device = as_device(capability)
    cases = [(dtype, g_dtype, beta_dtype, torch.int32) for dtype in (torch.bfloat16, torch.float16)
             for g_dtype, beta_dtype in ((torch.float32, torch.float32), (torch.float32, dtype), (dtype, dtype))]
    cases.append((torch.bfloat16, torch.float32, torch.float32, torch.int64))
    # With the qk l2 norm on chip the T kernel reduces k's norms itself (USE_L2NORM).
    norms = (False, True) if l2_on_chip else (False,)
    # fp16 calls with the norm run on normalized copies (qk_norm.l2_flags).
    builds = [(128, case, l2) for l2 in norms for case in cases if l2 in l2_flags(case[0])]
    builds += [(K, cases[0], l2) for K in head_dims if K != 128 for l2 in norms]
    kernels = []
    for K, (dtype, g_dtype, beta_dtype, cu_dtype), l2 in builds:
        for tails in (False, True):
            launch = plan_wy_t(aot_problem(K, 128, dtype, tails, l2), device, engine=engine)
            sig = {d.arg: d.signature for d in launch.descriptors}
            sig.update(t_ptr="*" + sig_dtype(dtype), g="*" + sig_dtype(g_dtype), g_cum="*fp32",
                       beta="*" + sig_dtype(beta_dtype), cu_seqlens="*" + sig_dtype(cu_dtype), N="i32", HV="i32",
                       GROUP="i32", s_g="i32", s_beta="i32")
            sig.update({name: "constexpr" for name in launch.constexprs})
            tag = (f"K{K}-{'varlen' if tails else 'dense'}-{sig_dtype(dtype)}-g{sig_dtype(g_dtype)}"
                   f"-beta{sig_dtype(beta_dtype)}{'-cu64' if cu_dtype == torch.int64 else ''}{'-l2' if l2 else ''}")
            kernels.append(AotKernel(
                backend=backend, kernel="wy_t_fwd", specialization=tag, fn=_wy_t_fwd_kernel,
                signature={name: sig[name] for name in arg_names(_wy_t_fwd_kernel)},
                constexprs=dict(launch.constexprs), dialect="gluon", num_warps=launch.num_warps,
                maxnreg=launch.maxnreg,
                spill_bytes_allowed=t_kernel_caps(engine, launch.constexprs["BLOCKED_INVERSE"],
                                                  launch.constexprs["SINGLE_T"])[1],
                attrs=pointer_attrs(_wy_t_fwd_kernel, ["t_ptr", "g", "g_cum", "beta", "cu_seqlens"])))
    return kernels
