"""Stages 2 and 3 in one kernel on the matrix engine: the WY vectors of every chunk,

    A = strictly-lower(beta_i r_i r_j (k_i . k_j) 2^(g_i - g_j))        [64, 64]
    T = (I + A)^-1
    w = T diag(beta 2^g r) k      [64, K]        u = T diag(beta) v      [64, V]

(``r = 1 / ||k||`` under the fused qk l2 norm, else 1; g in log2 units). T never leaves the
program: one kernel reads k and v once and writes w and u.

The inverse uses only whole-tile [64, 64] products, so it runs on the engine (wgmma or
tcgen05) instead of in scalar registers. With ``x`` the inverse of A's block diagonal at
block size ``b`` and ``n`` the blocks of A just below it inside each pair of blocks,

    (I + d)^-1 = (I - d)(I + d^2)               for the 4 x 4 diagonal blocks d (d^4 = 0)
    x <- x - x (n x)                            for b = 4, 8, 16, 32: the inverse at 2b

(``[[P, 0], [C, Q]]^-1 = [[P^-1, 0], [-Q^-1 C P^-1, Q^-1]]``, all pairs of one level in one
product). Ten products, each an fp32 x fp32 MMA (tf32 inputs, fp32 accumulate; T is rounded
to the 16-bit type right after). Every intermediate is a block of T or of A, so it stays as
small as T: the shorter product formula ``(I - d)(I + d^2)(I + d^4)(I + d^8)`` on 16 x 16
blocks builds powers with entries up to C(14, 7) = 3432 for strongly correlated keys, and
tf32 then loses T to cancellation (3e-2 relative error at key cosine 0.9, against 1e-3
here; ``tests/test_numerics.py``). tf32 MMA operands must be K-major on Hopper: the left
operand is stored row-major, the right one into a buffer whose NVMMA layout is transposed
(the store writes it column-major).

Two ways to feed those products (``plan_wy(..., variant=)``, the kernel's ``LHS_REGS``):

* "smem": each product stores both fp32 operands to shared memory (20 [64, 64] tile
  stores per program, each behind a fence and a CTA barrier).
* "regs": the left operand comes from registers (sm_90a wgmma; sm_100a stages it, as
  tcgen05 reads shared memory only) and every right operand is either ``a`` (stored once)
  or the level's ``x`` (stored once per level, while the level's first product runs):
  ``x`` is block diagonal, so ``x n`` is ``(x a)`` with the other blocks selected away,
  and the 4 x 4 diagonal inverse is ``I - d + d^2 - d^3`` with ``d^2 = (d a)`` and
  ``d^3 = (d^2 a)`` on the diagonal blocks; ``x <- x - (x n) x``. The same blocks of T and
  A as "smem" (no powers beyond d^3), 5 tile stores, and the operands go in a k order
  where a product's result already is wgmma's register operand (no shuffles).
* "f16" (sm_90a; elsewhere as "regs"): "regs" with fp16 operands, fp32 accumulation
  (:func:`_unit_lower_inverse_regs` with ``F16``). fp16 has tf32's 11 significant bits
  (rounded, where tf32 inputs are truncated) at twice the MMA rate and half the operand
  bytes, but not its range: a program whose T has an entry beyond 32768 or one not
  finite (any operand entry beyond 65504 ends there) forms A again and redoes the inverse
  in tf32, so no call loses range. On the H200 it made the T kernel 3% (4 x 8192) to 8%
  (ragged) faster and the w/u kernel 3-5%, at 3e-5 from the tf32 result: the programs are
  bound by instruction issue (masks, conversions, stores), not by the tensor cores.
* "blocked" (sm_90a, the default; elsewhere as "regs"): no 64 x 64 products at all: A's
  16 x 16 blocks are taken out of the k k^T accumulator and inverted one warp per block
  row on mma.sync (:mod:`.blocked_inverse`: sixteen 16 x 16 x 16 products per warp on
  fp16 operands with its redo past fp16's range as shipped, fifteen on tf32; tables in
  one fp32 tile's bytes, which then hold both scaled T tiles: 48 KB of shared memory, no
  spills at 168 registers). On the H200 (tf32 products) the w/u kernel 12-14% faster than
  "regs" (1 x 32768, H16-HV32: 0.505 -> 0.443 ms), outputs within 7e-5
  (``benchmarks/flag_ab.py wy_inverse``). Then w and u are formed in [64, 64] blocks of
  columns, one 32-register accumulator at a time (:data:`WY_SPLIT_WU`), at 128 registers:
  four programs per SM, another 14-15% (1 x 32768: 0.449 -> 0.384 ms; the fp16 inverse
  keeps a few bytes in local memory there, :data:`WY_SPLIT_F16_SPILL_BYTES_SM90`).

Rows past the sequence's end (the last chunk of a sequence only): their A rows and columns
are selected to 0, so T is the identity there; beta reads 0 there, so T's scaled columns
are 0 and those k / v rows (the next sequence's tokens) contribute nothing; w / u rows past
the end are not written (see :mod:`masks`).

Budget (K = V = 128, 16-bit): shared memory k 16 + v 16 + two fp32 operands 32 KB (the
scaled T tiles reuse the operands' bytes) = 64 KB, and 168 registers per thread on sm_90a:
three programs per SM ("regs" needs 155-159 uncapped; "blocked" with w and u in blocks
takes 48 KB and 128 registers, four programs); TMEM 2 x 64 + K + V columns on
sm_100a, where "regs" adds the staged left operand (16 KB).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from gdn_dispatch.contract import CHUNK_SIZE, GATE_FLOOR as _GATE_FLOOR, GDNProblem
from gdn_dispatch.device import DeviceInfo
from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.gluon_common import engine as E
from gdn_dispatch.backends.gluon_common.blocked_inverse import (
    blocked_inverse_diagonals, blocked_unit_lower_inverse, diagonals_lost_half_range, fp16_products, inverse_layout,
    lost_half_range, redo_from_buffer, redone_diagonals, table_layout, unit_lower_inverse_by_rows, warp_squares)
from gdn_dispatch.backends.gluon_common.compat import arg_names, reinterpret, thread_barrier, tma_load
from gdn_dispatch.backends.gluon_common.launch import launch_planned
from gdn_dispatch.backends.gluon_common.launch_plan import (
    NUM_WARPS, BoundLaunch, GridRule, LaunchPlan, as_device, chunks_have_tails, drop_unused_scatter,
    has_tails, pointer_attrs, resolve_engine, sig_dtype, tile_desc, token_stride)
from gdn_dispatch.backends.gluon_common.pick import picked_elsewhere
from gdn_dispatch.backends.gluon_common.qk_norm import l2_flags
from gdn_dispatch.backends.gluon_common.scopes import enter, leave
from gdn_dispatch.backends.gluon_common.masks import (
    add, chunk_rows, row_rnorm, row_vector, store_chunk_tile, tile_layout)


#: log2(e): the gates are summed in natural-log units and used as powers of 2 (exp2).
LOG2E = gl.constexpr(1.4426950408889634)
#: :data:`gdn_dispatch.contract.GATE_FLOOR` inside the kernels (gates below it count as it).
GATE_FLOOR = gl.constexpr(_GATE_FLOOR)

#: The one-kernel build's row vectors (a chunk's gate cumsum and beta) handed between
#: layouts through shared memory (:func:`row_vector_slots`): stored once in the plain
#: layout they are scanned and loaded in, then read back in each layout that uses them (A's
#: rows and columns, T_u's column scale, the last row's cumsum), one barrier in all. Each
#: ``convert_layout`` of a [64] vector between those layouts is a shared-memory round trip
#: with two barriers of the warpgroup, on the chain of the aux partition that forms the
#: chunk inverses (:func:`chunk_t_u_on_chip`), and the last row's cumsum reduced across
#: the warps three more: sm_90a's aux partition has 22 barriers instead of 35 (29 instead
#: of 43 with the qk l2 norm on chip), 1 KB more shared memory. H100 80GB HBM3, triton
#: 3.6.0, bf16 K = V = 128 (``python benchmarks/flag_ab.py shared_row_vectors``,
#: ``logs/h100_shared_row_vectors_ab.log``, two rounds, call ms off -> on): H16-HV32 4 x
#: 8192 0.556 -> 0.518, HV 64 4 x 8192 1.073 -> 1.019, 4 x 8192 with the qk l2 norm on chip
#: 0.714 -> 0.639; the ragged16 mix 0.977 -> 1.004 (kernel 0.988 -> 1.000, the off arm's
#: two rounds 2.3% apart; its tails' build spills 16 bytes more in the state partition).
#: Outputs o bit-equal; the final state of a sequence whose last chunk is a tail within
#: 4.1e-5 (g_last is the scan's row 63, which repeats row ``n_valid - 1``'s sum in another
#: order of fp32 additions).
SHARED_ROW_VECTORS = gl.constexpr(True)


@gluon.constexpr_function
def shared_row_vectors():
    """Whether :func:`chunk_t_u_on_chip`'s callers hand it :func:`row_vector_slots`
    (:data:`SHARED_ROW_VECTORS`, as set when the kernel compiles)."""
    return bool(SHARED_ROW_VECTORS)


#: Slots of :func:`row_vector_slots`: a chunk's two vectors alternate between two, so that
#: a chunk's stores never meet the reads of the chunk before it.
ROW_VECTOR_SLOTS = gl.constexpr(2)


@gluon.jit
def row_vector_slots(BT: gl.constexpr):
    """The fp32 ``[2 * ROW_VECTOR_SLOTS, BT]`` shared memory :func:`chunk_t_u_on_chip` keeps
    a chunk's gate cumsum (row ``2 s``) and beta rows (row ``2 s + 1``) in, slot ``s`` =
    chunk % :data:`ROW_VECTOR_SLOTS` (:data:`SHARED_ROW_VECTORS`)."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    return gl.allocate_shared_memory(gl.float32, [2 * ROW_VECTOR_SLOTS, BT], plain)


# ----------------------------------------------------------------------------------------
# Kernel


@gluon.constexpr_function
def _f32_layout(transposed):
    """NVMMA layout of an fp32 [64, 64] MMA operand; ``transposed`` stores it column-major
    (a K-major right-hand operand, which tf32 MMAs require)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2, transposed=transposed)


@gluon.jit
def _alias(smem, dtype: gl.constexpr, layout: gl.constexpr):
    """A [rows, cols] ``dtype`` view of the first bytes of ``smem`` (same shape, narrower type)."""
    shape: gl.constexpr = smem.shape
    return reinterpret(smem, dtype, shape, layout)


@gluon.jit
def _f32_product(x, y, lhs_smem, rhs_smem, acc, bar, PHASE: gl.constexpr, ENGINE: gl.constexpr):
    """``x @ y`` for fp32 [64, 64] register tiles through the engine (tf32 inputs); the
    result in ``x``'s layout. ``PHASE``: completions of ``bar`` before this call, mod 2."""
    lhs_smem.store(x)
    rhs_smem.store(y)
    # The MMA reads both operands through the async proxy.
    fence_async_shared()
    acc = ENGINE.mma(lhs_smem, rhs_smem, acc, False, bar)
    acc = ENGINE.mma_wait(acc, bar, PHASE)
    return gl.convert_layout(ENGINE.acc_read(acc), x.type.layout), acc


@gluon.jit
def _block_mask(x, i, j, level: gl.constexpr, BELOW: gl.constexpr):
    """``x`` where ``(i, j)`` lies in a diagonal block of size ``2^level`` (``BELOW``: in the
    block just below one, inside each pair of those blocks), else 0."""
    if BELOW:
        keep = (i >> level == (j >> level) + 1) & (i >> (level + 1) == j >> (level + 1))
    else:
        keep = i >> level == j >> level
    return gl.where(keep, x, 0.0)


@gluon.jit
def _unit_lower_inverse(a, lhs_smem, rhs_smem, bar, ENGINE: gl.constexpr):
    """``(I + a)^-1`` of a strictly lower fp32 [64, 64] tile (see the module docstring)."""
    BT: gl.constexpr = a.shape[0]
    layout: gl.constexpr = a.type.layout
    i = gl.expand_dims(gl.arange(0, BT, layout=gl.SliceLayout(1, layout)), 1)
    j = gl.expand_dims(gl.arange(0, BT, layout=gl.SliceLayout(0, layout)), 0)
    eye = gl.where(i == j, 1.0, 0.0)
    acc = ENGINE.acc_alloc_tf32(BT, BT)
    # a is read again at every level: on sm_100a it waits in TMEM, not in 32 registers per
    # thread (uncapped there, the l2 specializations spilled); on sm_90a this is a no-op.
    a_kept = ENGINE.acc_write(ENGINE.acc_alloc(BT, BT), a)
    # 4 x 4 diagonal blocks: (I + d)^-1 = (I - d)(I + d^2), as d^4 = 0.
    d = _block_mask(a, i, j, 2, False)
    p, acc = _f32_product(d, d, lhs_smem, rhs_smem, acc, bar, 0, ENGINE)
    x, acc = _f32_product(eye - d, eye + p, lhs_smem, rhs_smem, acc, bar, 1, ENGINE)
    # Blocks of 4 -> 8 -> 16 -> 32 -> 64 (2^level -> 2^(level + 1)): x <- x - x (n x), n = a's
    # blocks just below the diagonal blocks of x inside each pair.
    for level in gl.static_range(2, 6):
        a = gl.convert_layout(ENGINE.acc_read(a_kept), layout)
        n = _block_mask(a, i, j, level, True)
        y, acc = _f32_product(n, x, lhs_smem, rhs_smem, acc, bar, 0, ENGINE)
        y, acc = _f32_product(x, y, lhs_smem, rhs_smem, acc, bar, 1, ENGINE)
        x = x - y
    return x


@gluon.jit
def _operand_store(x, F16: gl.constexpr):
    """``x`` (fp32 registers) as an inverse product's right operand is stored: fp16, or
    fp32 in the k order of :func:`E.tf32_rhs_order` (tf32)."""
    if F16:
        y = x.to(gl.float16)
    else:
        y = E.tf32_rhs_order(x)
    return y


@gluon.jit
def _operand_lhs(x, F16: gl.constexpr):
    """``x`` as an inverse product's left operand (registers): as it is for fp16, in the k
    order of :func:`E.tf32_lhs_order` for tf32 (a product's result then needs no shuffle)."""
    if F16:
        y = x
    else:
        y = E.tf32_lhs_order(x)
    return y


@gluon.jit
def _unit_lower_inverse_regs(a, a_smem, x_smem, lhs_smem, bar, ENGINE: gl.constexpr, pin=0,
                             F16: gl.constexpr = False):
    """``(I + a)^-1`` of a strictly lower fp32 [64, 64] tile: :func:`_unit_lower_inverse`'s
    blocks, with the left operand of every product in registers (``lhs_smem`` stages it on
    sm_100a only) and the right one either ``a`` (stored once) or ``x`` (once per level).

    ``x`` is block diagonal, so ``(x a)`` restricted to the blocks of ``n`` is ``x n``
    exactly (a select drops the rest), and on the 4 x 4 diagonal blocks ``(d a) = d^2``:
    every product reads the same stored ``a``. Both operands go in the k order of
    :func:`E.tf32_lhs_order`, where a product's result is already a left operand.

    ``F16`` (sm_90a): fp16 operands, fp32 accumulation, through fp16 views of the first
    bytes of ``a_smem`` / ``x_smem`` (``lhs_smem`` unused): the same products and blocks at
    twice tf32's MMA rate and half its operand bytes. fp16 keeps tf32's 11 significant bits
    (rounded, where tf32 inputs are truncated) but not its range: an operand entry beyond
    65504 becomes inf, which reaches the result (``inf * 0`` is NaN in every column it
    meets, and x only ever has y's subtracted), so :func:`chunk_t` checks the result and
    redoes the inverse in tf32 where it is not finite and small.

    ``pin``: 0, added to the row indices. Inside a loop over chunks, pass a zero the
    compiler cannot prove (one computed from a loop value): the block masks are then
    rebuilt per chunk instead of hoisted out of the loop, where their predicates would
    stay live across it (they took the registers of a warp-specialized partition).
    """
    BT: gl.constexpr = a.shape[0]
    layout: gl.constexpr = a.type.layout
    if F16:
        gl.static_assert(not ENGINE.IS_SM100, "fp16 inverse operands: sm_90a only")
        f16_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float16)
        a_op = _alias(a_smem, gl.float16, f16_layout)
        x_op = _alias(x_smem, gl.float16, f16_layout)
        lhs_op = a_op
        acc = ENGINE.acc_alloc(BT, BT)
    else:
        a_op = a_smem
        x_op = x_smem
        lhs_op = lhs_smem
        acc = ENGINE.acc_alloc_tf32(BT, BT)
    i = gl.expand_dims(gl.arange(0, BT, layout=gl.SliceLayout(1, layout)) + pin, 1)
    j = gl.expand_dims(gl.arange(0, BT, layout=gl.SliceLayout(0, layout)), 0)
    a_op.store(_operand_store(a, F16))
    # Every product reads a through the async proxy.
    fence_async_shared()
    # 4 x 4 diagonal blocks: (I + d)^-1 = I - d + d^2 - d^3, as d^4 = 0.
    d = _block_mask(a, i, j, 2, False)
    acc = ENGINE.mma_reg_a(_operand_lhs(d, F16), lhs_op, a_op, acc, False, bar)
    acc = ENGINE.mma_wait(acc, bar, 0)
    p = _block_mask(gl.convert_layout(ENGINE.acc_read(acc), layout), i, j, 2, False)
    acc = ENGINE.mma_reg_a(_operand_lhs(p, F16), lhs_op, a_op, acc, False, bar)
    x = gl.where(i == j, 1.0, 0.0) - d + p
    acc = ENGINE.mma_wait(acc, bar, 1)
    x = x - _block_mask(gl.convert_layout(ENGINE.acc_read(acc), layout), i, j, 2, False)
    # Blocks of 4 -> 8 -> 16 -> 32 -> 64 (2^level -> 2^(level + 1)): x <- x - (x n) x.
    for level in gl.static_range(2, 6):
        acc = ENGINE.mma_reg_a(_operand_lhs(x, F16), lhs_op, a_op, acc, False, bar)
        # x's buffer is free (the product that read it was waited on): store x while x a runs.
        x_op.store(_operand_store(x, F16))
        fence_async_shared()
        acc = ENGINE.mma_wait(acc, bar, 0)
        y = _block_mask(gl.convert_layout(ENGINE.acc_read(acc), layout), i, j, level, True)
        acc = ENGINE.mma_reg_a(_operand_lhs(y, F16), lhs_op, x_op, acc, False, bar)
        acc = ENGINE.mma_wait(acc, bar, 1)
        x = x - gl.convert_layout(ENGINE.acc_read(acc), layout)
    return x


#: Largest |T| entry :func:`chunk_t` keeps from the fp16 inverse: half fp16's range, so an
#: entry that only grew near the top of the range is redone in tf32 too.
F16_INVERSE_LIMIT = gl.constexpr(32768.0)


@gluon.jit
def _unsafe_entries(t):
    """How many entries of ``t`` are not finite or reach :data:`F16_INVERSE_LIMIT` (NaN
    compares false, so it counts)."""
    bad = gl.where(gl.abs(t) < F16_INVERSE_LIMIT, 0, 1)
    return gl.sum(gl.sum(bad, 1), 0)


@gluon.jit
def chunk_rows_early(g, s_g, beta, s_beta, row0, n_valid, i_h, BT: gl.constexpr, EARLY: gl.constexpr):
    """With ``EARLY``, the chunk's raw gate and beta rows (fp32 [BT] each, 0 past the end,
    in the flat layout :func:`_chunk_gates` scans in), loaded before the program waits for
    its k tile (:data:`WY_EARLY_ROWS`): their latency then runs under the tile's instead of
    after k k^T. Else None: :func:`_chunk_a_of_k` loads them itself."""
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    if EARLY:
        rows = (row_vector(g, row0, n_valid, i_h, s_g, BT, flat), row_vector(beta, row0, n_valid, i_h, s_beta, BT, flat))
    else:
        rows = None
    return rows


@gluon.jit
def chunk_rows_ahead(rows, g, s_g, beta, s_beta, row0, n_valid, i_h, BT: gl.constexpr):
    """For a loop over a sequence's chunks that keeps the raw rows a chunk ahead: this
    chunk's raw gate and beta rows (``rows``, as :func:`chunk_rows_early` loaded them a
    chunk early) and the next chunk's, loaded now (their latency then runs under this
    chunk's work). ``row0``, ``n_valid``: this chunk's first row and valid row count."""
    return rows[0], rows[1], chunk_rows_early(g, s_g, beta, s_beta, row0 + BT, n_valid - BT, i_h, BT, True)


@gluon.jit
def gate_cumsum(x):
    """The chunk-local inclusive cumsum of raw gate rows ``x`` (fp32 [BT] in a plain 1-D
    layout, 0 past the end) in log2 units: rows past the end repeat the last sum. Gates
    below :data:`GATE_FLOOR` count as it (its docstring says why)."""
    return gl.associative_scan(gl.maximum(x, GATE_FLOOR), 0, add) * LOG2E


@gluon.jit
def _chunk_gates(g, s_g, g_cum, row0, n_valid, i_h, HV, BT: gl.constexpr, layout: gl.constexpr, g_raw=None):
    """The chunk-local inclusive cumsum of the raw gates (token stride ``s_g``; or their
    rows ``g_raw`` as :func:`chunk_rows_early` loaded them) in log2 units, fp32 [BT] in
    ``layout`` (rows past the end repeat the last sum), also written to the contiguous
    ``g_cum`` for the recurrence kernel: this program owns these rows of this v-head, so no
    cumsum launch."""
    # The scan runs in a plain 1-D layout (Gluon scans no slice of an MMA layout).
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    if g_raw is None:
        x = row_vector(g, row0, n_valid, i_h, s_g, BT, flat)
    else:
        x = g_raw
    c = gate_cumsum(x)
    r = gl.arange(0, BT, layout=flat)
    gl.store(g_cum + (row0 + r).to(gl.int64) * HV + i_h, c, mask=r < n_valid)
    return gl.convert_layout(c, layout)


@gluon.jit
def _chunk_a(kk, k_smem, g_i, beta, s_beta, row0, n_valid, i_h, USE_L2NORM: gl.constexpr, b_raw=None, r_k=None,
             vectors=None, vector_row=0):
    """A from the raw ``k k^T`` (fp32 [64, 64] registers) and the rows' gate cumsum ``g_i``
    (in the row slice of kk's layout), and the fp32 [64] column scales of T for w
    (``beta 2^g r``) and for u (``beta``, token stride ``s_beta``; or its rows ``b_raw`` as
    :func:`chunk_rows_early` loaded them), in the column slice of kk's layout. With
    ``USE_L2NORM``, k's reciprocal row norms ``r_k`` (any 1-D layout), or None to reduce
    them from ``k_smem`` here. ``vectors``: :func:`row_vector_slots`, whose rows
    ``vector_row`` and ``vector_row + 1`` hold the chunk's gate cumsum and beta (stored and
    past a barrier), read instead of ``g_i`` and ``b_raw``."""
    BT: gl.constexpr = kk.shape[0]
    layout: gl.constexpr = kk.type.layout
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    cols: gl.constexpr = gl.SliceLayout(0, layout)
    if vectors is not None:
        g_i = vectors.index(vector_row).load(rows)
        g_j = vectors.index(vector_row).load(cols)
        b_i = vectors.index(vector_row + 1).load(rows)
        b_j = vectors.index(vector_row + 1).load(cols)
    else:
        g_j = gl.convert_layout(g_i, cols)
        if b_raw is None:
            b_i = row_vector(beta, row0, n_valid, i_h, s_beta, BT, rows)
            b_j = row_vector(beta, row0, n_valid, i_h, s_beta, BT, cols)
        else:
            b_i = gl.convert_layout(b_raw, rows)
            b_j = gl.convert_layout(b_raw, cols)
    if USE_L2NORM:
        if r_k is None:
            r = row_rnorm(k_smem, tile_layout(BT, k_smem.shape[1], gl.num_warps()))
        else:
            r = r_k
        r_i = gl.convert_layout(r, rows)
        r_j = gl.convert_layout(r, cols)
        kk = kk * gl.expand_dims(r_i, 1) * gl.expand_dims(r_j, 0)
        w_scale = b_j * gl.exp2(g_j) * r_j
    else:
        w_scale = b_j * gl.exp2(g_j)
    i = gl.expand_dims(gl.arange(0, BT, layout=rows), 1)
    j = gl.expand_dims(gl.arange(0, BT, layout=cols), 0)
    # select, not multiply: 2^(g_i - g_j) overflows above the diagonal, and rows past the
    # end hold the next sequence's tokens (or anything).
    keep = (i > j) & (i < n_valid)
    a = gl.where(keep, kk * gl.exp2(gl.expand_dims(g_i, 1) - gl.expand_dims(g_j, 0)), 0.0)
    return a * gl.expand_dims(b_i, 1), w_scale, b_j


@gluon.jit
def chunk_program(cu_seqlens, N, HV, BT: gl.constexpr, HAS_TAILS: gl.constexpr):
    """This program's chunk slot ``i_c`` and v-head ``i_h``, and the chunk's first row and
    valid row count (:func:`.masks.chunk_rows`; ``<= 0``: an idle slot, nothing to do).

    (chunk, v-head) flattened with the v-head fastest: programs sharing a k head run side
    by side and hit the same k rows in L2. With tails the chunks are chunk slots.
    """
    pid = gl.program_id(0)
    i_c = pid // HV
    i_h = pid % HV
    row0, n_valid = chunk_rows(cu_seqlens, N, i_c, BT, HAS_TAILS)
    return i_c, i_h, row0, n_valid


@gluon.jit
def _chunk_a_of_k(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, kk_bar, KK_PHASE: gl.constexpr,
                  USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr, g_raw=None, b_raw=None):
    """A and T's column scales (:func:`_chunk_a`) from the chunk's k tile: k k^T on the
    engine (``kk_bar``'s ``KK_PHASE``-th completion, mod 2) and the gate cumsum, which it
    writes to ``g_cum`` (:func:`_chunk_gates`). ``g_raw``, ``b_raw``: the gate and beta
    rows of :func:`chunk_rows_early`, or None to load them here."""
    BT: gl.constexpr = k_smem.shape[0]
    kk = ENGINE.mma(k_smem, k_smem.permute((1, 0)), ENGINE.acc_alloc(BT, BT), False, kk_bar)
    kk = ENGINE.acc_read(ENGINE.mma_wait(kk, kk_bar, KK_PHASE))
    g_i = _chunk_gates(g, s_g, g_cum, row0, n_valid, i_h, HV, BT, gl.SliceLayout(1, kk.type.layout), g_raw)
    return _chunk_a(kk, k_smem, g_i, beta, s_beta, row0, n_valid, i_h, USE_L2NORM, b_raw)


@gluon.jit
def chunk_t(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, op0, op1, lhs_smem, kk_bar, inv_bar,
            LHS_REGS: gl.constexpr, USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr,
            F16_INVERSE: gl.constexpr = False):
    """One chunk's ``T = (I + A)^-1`` (fp32 [64, 64] registers) from its k tile in
    ``k_smem`` (landed), and T's column scales for w (``beta 2^g r``) and u (``beta``) in
    T's column slice; writes the chunk's gate cumsum to ``g_cum`` (:func:`_chunk_gates`).

    ``LHS_REGS`` picks the inverse: :func:`_unit_lower_inverse_regs` with ``op0`` / ``op1``
    its a / x operand tiles (``lhs_smem`` stages left operands on sm_100a), else
    :func:`_unit_lower_inverse` with ``op0`` / ``op1`` its left / right operand tiles.
    ``F16_INVERSE`` (with ``LHS_REGS``, sm_90a): the inverse on fp16 operands, redone in
    tf32 where T leaves fp16's range. ``kk_bar`` and ``inv_bar``: the mbarriers of k k^T and
    of the inverse's products (fresh).
    """
    gl.static_assert(LHS_REGS or not F16_INVERSE, "the fp16 inverse is the register-operand one")
    a, w_scale, u_scale = _chunk_a_of_k(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, kk_bar, 0,
                                        USE_L2NORM, ENGINE)
    if LHS_REGS:
        # The scales wait out the inverse in one register each, not 16.
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        w_scale = gl.convert_layout(w_scale, flat)
        u_scale = gl.convert_layout(u_scale, flat)
        t = _unit_lower_inverse_regs(a, op0, op1, lhs_smem, inv_bar, ENGINE, F16=F16_INVERSE)
        if F16_INVERSE:
            if _unsafe_entries(t) > 0:
                # Rare (entries of A or T near fp16's range): the same T in tf32, from A (and
                # the gate cumsum, rewritten as it was) formed again rather than kept alive
                # across the fp16 inverse in 34 more registers, which spilled.
                a, _, _ = _chunk_a_of_k(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, kk_bar, 1,
                                        USE_L2NORM, ENGINE)
                t = _unit_lower_inverse_regs(a, op0, op1, lhs_smem, inv_bar, ENGINE)
        w_scale = gl.convert_layout(w_scale, gl.SliceLayout(0, t.type.layout))
        u_scale = gl.convert_layout(u_scale, gl.SliceLayout(0, t.type.layout))
    else:
        t = _unit_lower_inverse(a, op0, op1, inv_bar, ENGINE)
    return t, w_scale, u_scale


@gluon.jit
def regs_inverse_smem(x_smem, dtype: gl.constexpr, t_layout: gl.constexpr, ENGINE: gl.constexpr):
    """The "regs" inverse's shared tiles beside its per-level right operand ``x_smem`` (fp32
    [64, 64]): ``(a_smem, lhs_smem, tw_smem, tu_smem)``. ``a`` is its other right operand;
    left operands come from registers, staged in ``lhs_smem`` on sm_100a (tcgen05 reads
    shared memory only; sm_90a gets ``a_smem`` back and never touches it); the two scaled T
    tiles (``dtype``, ``t_layout``) reuse a's and x's bytes, free once the inverse is done."""
    BT: gl.constexpr = x_smem.shape[0]
    a_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], _f32_layout(True))
    if ENGINE.IS_SM100:
        lhs_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], _f32_layout(False))
    else:
        lhs_smem = a_smem
    return a_smem, lhs_smem, _alias(a_smem, dtype, t_layout), _alias(x_smem, dtype, t_layout)


@gluon.jit
def _chunk_a_blocked(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, kk_bar,
                     USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr, rows_early, KK_PHASE: gl.constexpr = 0):
    """:func:`_chunk_a_of_k` with the rows :func:`chunk_rows_early` loaded (or None), at
    ``kk_bar``'s ``KK_PHASE``-th completion."""
    if rows_early is None:
        g_raw = None
        b_raw = None
    else:
        g_raw = rows_early[0]
        b_raw = rows_early[1]
    return _chunk_a_of_k(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, kk_bar, KK_PHASE,
                         USE_L2NORM, ENGINE, g_raw, b_raw)


@gluon.jit
def chunk_t_blocked(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, x_smem, kk_bar,
                    USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr, rows_early=None):
    """:func:`chunk_t` with the inverse in 16 x 16 blocks on mma.sync
    (:func:`.blocked_inverse.blocked_unit_lower_inverse`; sm_90a, 4 warps), its three
    tables in the first 12 KB of the fp32 [64, 64] tile ``x_smem``, which is free again on
    return. ``rows_early``: what :func:`chunk_rows_early` returned."""
    a, w_scale, u_scale = _chunk_a_blocked(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, kk_bar,
                                           USE_L2NORM, ENGINE, rows_early)
    # The scales wait out the inverse in one register each.
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    w_scale = gl.convert_layout(w_scale, flat)
    u_scale = gl.convert_layout(u_scale, flat)
    tables = reinterpret(x_smem, gl.float32, [16, 16, 16], table_layout())
    t = blocked_unit_lower_inverse(a, tables)
    if fp16_products():
        if lost_half_range(t):
            # Rare (entries of A or T past fp16's range): A formed again (k k^T's second
            # completion of ``kk_bar``) rather than kept across the inverse, and T in fp32.
            a_again, _, _ = _chunk_a_blocked(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, kk_bar,
                                             USE_L2NORM, ENGINE, rows_early, 1)
            t = unit_lower_inverse_by_rows(a_again, tables)
    w_scale = gl.convert_layout(w_scale, gl.SliceLayout(0, t.type.layout))
    u_scale = gl.convert_layout(u_scale, gl.SliceLayout(0, t.type.layout))
    return t, w_scale, u_scale


@gluon.jit
def chunk_t_u_on_chip(k_smem, beta, s_beta, row0, n_valid, i_h, g_raw, b_raw, tables, kk_bar, KK_PHASE: gl.constexpr,
                      USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr, r_k=None, a_save=None, vectors=None,
                      vector_row=0, LATE_CHECK: gl.constexpr = False):
    """One chunk's ``T_u = (I + A)^-1 diag(beta)`` (fp32 [64, 64] in the engine's
    accumulator layout) and its gate cumsum (:func:`gate_cumsum`, fp32 [64] in ``g_raw``'s
    layout), for a kernel that keeps both on chip: nothing is written to global memory.
    ``g_raw``, ``b_raw``: the chunk's raw gate and beta rows (:func:`chunk_rows_early`);
    ``tables``: fp32 shared memory ``[16, 16, 16]`` (:func:`.blocked_inverse.table_layout`; the first 12)
    for the blocked inverse (sm_90a, 4 warps), free on entry and exit; ``kk_bar``: the
    mbarrier of k k^T, at its ``KK_PHASE``-th completion (mod 2); ``r_k``: with
    ``USE_L2NORM``, k's reciprocal row norms as the caller reduced them (or None);
    ``a_save``: with the fp16 inverse (:func:`.blocked_inverse.fp16_products`), the
    :func:`.blocked_inverse.redo_buffer` A waits in for a redo (None: a redo forms A again
    from ``k_smem``, which stays in its slot until the caller is done); ``vectors``: with
    :data:`SHARED_ROW_VECTORS`, :func:`row_vector_slots`, whose rows ``vector_row`` and
    ``vector_row + 1`` (the chunk's slot; free on entry: their reads two chunks back are
    behind the caller's barriers) keep the gate cumsum and beta, also for the caller's
    reads after this returns. With ``LATE_CHECK``
    (:data:`.blocked_inverse.LATE_RANGE_CHECK`) the fp16 inverse's range is not checked
    here: the third value returned is T's :func:`.blocked_inverse.warp_squares`, for the
    caller's check (else it is not to be read)."""
    BT: gl.constexpr = k_smem.shape[0]
    # Profile phases (the fused kernel's aux partition): the gate cumsum, k k^T's wait
    # (:func:`chunk_kk_and_cumsum`), A, A's copy for the redo, the blocks, the range check.
    kk, c = chunk_kk_and_cumsum(k_smem, g_raw, b_raw, kk_bar, KK_PHASE, ENGINE, vectors, vector_row)
    t, _, u_scale = chunk_t_of_kk(kk, c, beta, s_beta, row0, n_valid, i_h, b_raw, tables, USE_L2NORM, k_smem, r_k,
                                  False, a_save, vectors, vector_row)
    squares = c  # not read unless LATE_CHECK
    if fp16_products():
        if LATE_CHECK:
            squares = warp_squares(t)
        else:
            enter("aux.check")
            if lost_half_range(t):
                if a_save is not None:
                    # Rare (entries of A or T past fp16's range): T in fp32 from the saved A.
                    t_layout: gl.constexpr = t.type.layout
                    t = redo_from_buffer(a_save, tables, t_layout, USE_L2NORM)
                else:
                    # The same from A formed again: k's tile is still in its slot.
                    kk = ENGINE.mma(k_smem, k_smem.permute((1, 0)), ENGINE.acc_alloc(BT, BT), False, kk_bar)
                    kk = ENGINE.acc_read(ENGINE.mma_wait(kk, kk_bar, KK_PHASE ^ 1))
                    t, _, _ = chunk_t_of_kk(kk, c, beta, s_beta, row0, n_valid, i_h, b_raw, tables, USE_L2NORM,
                                            k_smem, r_k, True, None, vectors, vector_row)
            leave("aux.check")
    cols: gl.constexpr = gl.SliceLayout(0, t.type.layout)
    if vectors is not None:
        u_scale = vectors.index(vector_row + 1).load(cols)
    else:
        u_scale = gl.convert_layout(u_scale, cols)
    return t * gl.expand_dims(u_scale, 0), c, squares


@gluon.jit
def chunk_kk_and_cumsum(k_smem, g_raw, b_raw, kk_bar, KK_PHASE: gl.constexpr, ENGINE: gl.constexpr, vectors=None,
                        vector_row=0):
    """The first steps of :func:`chunk_t_u_on_chip` (arguments as it takes them): the chunk's
    raw ``k k^T`` (fp32 [BT, BT], read from the engine's accumulator) and its gate cumsum
    (:func:`gate_cumsum`, in ``g_raw``'s layout), with the cumsum and beta stored into
    ``vectors`` under the product where it is given."""
    BT: gl.constexpr = k_smem.shape[0]
    kk = ENGINE.mma(k_smem, k_smem.permute((1, 0)), ENGINE.acc_alloc(BT, BT), False, kk_bar)
    enter("aux.cumsum")
    c = gate_cumsum(g_raw)
    if vectors is not None:
        vectors.index(vector_row).store(c)
        vectors.index(vector_row + 1).store(b_raw)
        # Under k k^T: every warp's part of both vectors is in before any warp reads them.
        thread_barrier()
    leave("aux.cumsum")
    enter("aux.kk")
    kk = ENGINE.acc_read(ENGINE.mma_wait(kk, kk_bar, KK_PHASE))
    leave("aux.kk")
    return kk, c


@gluon.jit
def chunk_t_of_kk(kk, c, beta, s_beta, row0, n_valid, i_h, b_raw, tables, USE_L2NORM: gl.constexpr, k_smem=None,
                  r_k=None, REDO: gl.constexpr = False, a_save=None, vectors=None, vector_row=0):
    """One chunk's unscaled ``T = (I + A)^-1`` from its raw ``k k^T`` (fp32 [64, 64]
    registers, any layout of 4 warps: converted to :func:`.blocked_inverse.inverse_layout`,
    which T comes back in) and its gate cumsum ``c`` (:func:`gate_cumsum`), by the blocked
    inverse in ``tables`` (as for :func:`chunk_t_u_on_chip`); with T's column scales for
    T_w (``beta 2^g r``) and T_u (``beta``), fp32 [64] in a plain 1-D layout, where they
    wait out the inverse in one register each. ``b_raw``: the chunk's raw beta rows
    (:func:`chunk_rows_early`); ``k_smem``, ``r_k``: with ``USE_L2NORM``, as
    :func:`_chunk_a` takes them; ``REDO``: the inverse's redo by rows
    (:func:`.blocked_inverse.lost_half_range`); ``a_save``: a buffer A is stored into
    before the inverse (:func:`.blocked_inverse.redo_buffer`), or None; ``vectors``,
    ``vector_row``: as :func:`_chunk_a` takes them (the scales then stay in the column slice of T's layout,
    where a caller that holds the vectors reads its scale again instead)."""
    enter("aux.a")
    kk = gl.convert_layout(kk, inverse_layout())
    if vectors is not None:
        a, w_scale, u_scale = _chunk_a(kk, k_smem, c, beta, s_beta, row0, n_valid, i_h, USE_L2NORM, b_raw, r_k,
                                       vectors, vector_row)
    else:
        a, w_scale, u_scale = _chunk_a(kk, k_smem, gl.convert_layout(c, gl.SliceLayout(1, kk.type.layout)), beta,
                                       s_beta, row0, n_valid, i_h, USE_L2NORM, b_raw, r_k)
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        w_scale = gl.convert_layout(w_scale, flat)
        u_scale = gl.convert_layout(u_scale, flat)
    leave("aux.a")
    if a_save is not None:
        enter("aux.save_a")
        a_save.store(a)
        leave("aux.save_a")
    enter("aux.blocks")
    if REDO:
        t = unit_lower_inverse_by_rows(a, tables)
    else:
        t = blocked_unit_lower_inverse(a, tables)
    leave("aux.blocks")
    return t, w_scale, u_scale


@gluon.jit
def chunk_t_diagonals(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, x_smem, kk_bar,
                      USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr, rows_early=None):
    """:func:`chunk_t_blocked`'s T left in its four block diagonals
    (:func:`.blocked_inverse.blocked_inverse_diagonals`), unscaled, for a caller that
    stores the blocks where they go instead of assembling the [64, 64] tile."""
    a, w_scale, u_scale = _chunk_a_blocked(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, kk_bar,
                                           USE_L2NORM, ENGINE, rows_early)
    tables = reinterpret(x_smem, gl.float32, [16, 16, 16], table_layout())
    diagonals = blocked_inverse_diagonals(a, tables)
    if fp16_products():
        if diagonals_lost_half_range(*diagonals):
            # As in :func:`chunk_t_blocked`.
            a_again, _, _ = _chunk_a_blocked(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, kk_bar,
                                             USE_L2NORM, ENGINE, rows_early, 1)
            diagonals = redone_diagonals(a_again, tables)
    return diagonals


@gluon.jit
def t_tile_pair(x_smem, dtype: gl.constexpr, layout: gl.constexpr):
    """The two scaled T tiles (``dtype`` [64, 64] each, ``layout``) in the bytes of the fp32
    [64, 64] tile ``x_smem``: where :func:`chunk_t_blocked` leaves them free."""
    BT: gl.constexpr = x_smem.shape[0]
    pair = reinterpret(x_smem, dtype, [2 * BT, BT], layout)
    return pair.slice(0, BT), pair.slice(BT, BT)


@gluon.jit
def _wy_epilogue(acc, smem, desc, rows_desc, ptr, row_stride, row0, col0, n_valid,
                 HAS_TAILS: gl.constexpr, ENGINE: gl.constexpr):
    """Accumulator -> ``smem`` (a free operand buffer of the same shape) -> global rows."""
    smem.store(ENGINE.acc_read(acc).to(smem.dtype))
    # TMA store / scatter read smem through the async proxy.
    fence_async_shared()
    store_chunk_tile(desc, rows_desc, ptr, row_stride, smem, row0, col0, n_valid, HAS_TAILS, ENGINE)


@gluon.jit
def _split_product(t_smem, x_smem, bar, desc, rows_desc, ptr, row_stride, row0, col0, n_valid,
                   HAS_TAILS: gl.constexpr, ENGINE: gl.constexpr):
    """``t x`` (``t_smem`` [64, 64], ``x_smem`` [64, N], N a multiple of 64) in [64, 64]
    blocks of columns, one 32-register accumulator at a time (``bar``: the MMAs' fresh
    mbarrier, its completions counted from 0): each block
    overwrites the columns of ``x_smem`` it was formed from, then the whole tile goes to
    global rows as :func:`_wy_epilogue` sends it."""
    BT: gl.constexpr = t_smem.shape[0]
    N: gl.constexpr = x_smem.shape[1]
    for b in gl.static_range(N // BT):
        block = x_smem.slice(b * BT, BT, dim=1)
        acc = ENGINE.mma(t_smem, block, ENGINE.acc_alloc(BT, BT), False, bar)
        acc = ENGINE.acc_read(ENGINE.mma_wait(acc, bar, b % 2))
        # Every warp's MMA has read the block before any warp overwrites it.
        thread_barrier()
        block.store(acc.to(x_smem.dtype))
    fence_async_shared()
    store_chunk_tile(desc, rows_desc, ptr, row_stride, x_smem, row0, col0, n_valid, HAS_TAILS, ENGINE)


@gluon.jit(do_not_specialize=["HV", "GROUP", "s_g", "s_beta", "N"])
def _wy_fwd_kernel(
    k_desc, v_desc, w_desc, u_desc, w_rows_desc, u_rows_desc, w_ptr, u_ptr,
    g, g_cum, beta, cu_seqlens, pick, N, HV, GROUP, s_g, s_beta,
    HAS_TAILS: gl.constexpr, USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr,
    LHS_REGS: gl.constexpr, F16_INVERSE: gl.constexpr, BLOCKED_INVERSE: gl.constexpr, SPLIT_WU: gl.constexpr,
    EARLY_ROWS: gl.constexpr, PICK: gl.constexpr,
):
    if PICK:
        # A picked call's pipeline (:mod:`.pick`): the census may have picked the warm chain.
        if picked_elsewhere(pick, False):
            return
    BT: gl.constexpr = k_desc.block_type.shape[0]
    K: gl.constexpr = k_desc.block_type.shape[1]
    V: gl.constexpr = v_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    i_c, i_h, row0, n_valid = chunk_program(cu_seqlens, N, HV, BT, HAS_TAILS)
    if n_valid <= 0:
        return

    k_smem = gl.allocate_shared_memory(dtype, [BT, K], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BT, V], v_desc.layout)
    t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], dtype)
    if BLOCKED_INVERSE:
        # The inverse's tables, then both scaled T tiles, in one fp32 tile's bytes: 48 KB.
        x_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], _f32_layout(True))
        tw_smem, tu_smem = t_tile_pair(x_smem, dtype, t_layout)
    elif LHS_REGS:
        # 66 KB in all on sm_90a, as for "smem".
        x_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], _f32_layout(True))
        a_smem, lhs_smem, tw_smem, tu_smem = regs_inverse_smem(x_smem, dtype, t_layout, ENGINE)
    else:
        lhs_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], _f32_layout(False))
        rhs_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], _f32_layout(True))
        # The scaled T tiles reuse the fp32 operand buffers' bytes (free once the inverse
        # is done): 66 KB in all, so that three programs fit an SM.
        tw_smem = _alias(lhs_smem, dtype, t_layout)
        tu_smem = _alias(rhs_smem, dtype, t_layout)
    # ready_bars[0]: k landed, [1]: v landed. mma_bars[0]: k k^T, [1]: the ten products of
    # the inverse (phases alternate, counted statically), [2]: w = T k, [3]: u = T v.
    ready_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mma_bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready_bars.index(i), count=1)
    for i in gl.static_range(4):
        mbarrier.init(mma_bars.index(i), count=1)

    i_k = i_h // GROUP
    mbarrier.expect(ready_bars.index(0), k_desc.block_type.nbytes)
    tma_load(k_desc, [row0, i_k * K], ready_bars.index(0), k_smem)
    mbarrier.expect(ready_bars.index(1), v_desc.block_type.nbytes)
    tma_load(v_desc, [row0, i_h * V], ready_bars.index(1), v_smem)

    rows_early = chunk_rows_early(g, s_g, beta, s_beta, row0, n_valid, i_h, BT, EARLY_ROWS)
    mbarrier.wait(ready_bars.index(0), 0)
    if BLOCKED_INVERSE:
        t, w_scale, u_scale = chunk_t_blocked(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV, x_smem,
                                              mma_bars.index(0), USE_L2NORM, ENGINE, rows_early)
    elif LHS_REGS:
        t, w_scale, u_scale = chunk_t(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV,
                                      a_smem, x_smem, lhs_smem, mma_bars.index(0), mma_bars.index(1), True,
                                      USE_L2NORM, ENGINE, F16_INVERSE)
    else:
        t, w_scale, u_scale = chunk_t(k_smem, g, s_g, g_cum, beta, s_beta, row0, n_valid, i_h, HV,
                                      lhs_smem, rhs_smem, lhs_smem, mma_bars.index(0), mma_bars.index(1), False,
                                      USE_L2NORM, ENGINE)

    # The token scales go on T's columns in fp32, so k and v enter the MMAs as stored (one
    # rounding, of the scaled T, per product). The inverse's last MMA was waited on, so the
    # operand bytes under tw/tu are free.
    tw_smem.store((t * gl.expand_dims(w_scale, 0)).to(dtype))
    tu_smem.store((t * gl.expand_dims(u_scale, 0)).to(dtype))
    fence_async_shared()
    if SPLIT_WU:
        _split_product(tw_smem, k_smem, mma_bars.index(2), w_desc, w_rows_desc, w_ptr, HV * K, row0, i_h * K, n_valid,
                       HAS_TAILS, ENGINE)
        mbarrier.wait(ready_bars.index(1), 0)
        _split_product(tu_smem, v_smem, mma_bars.index(3), u_desc, u_rows_desc, u_ptr, HV * V, row0, i_h * V, n_valid,
                       HAS_TAILS, ENGINE)
    else:
        w_acc = ENGINE.mma(tw_smem, k_smem, ENGINE.acc_alloc(BT, K), False, mma_bars.index(2))
        mbarrier.wait(ready_bars.index(1), 0)
        u_acc = ENGINE.mma(tu_smem, v_smem, ENGINE.acc_alloc(BT, V), False, mma_bars.index(3))
        w_acc = ENGINE.mma_wait_until(w_acc, mma_bars.index(2), 0, 1)
        # The w MMA is complete, so k_smem is free to stage w (u = T v may still run).
        # Row strides as HV * constexpr: the masked sm_90a tail stores then vectorize.
        _wy_epilogue(w_acc, k_smem, w_desc, w_rows_desc, w_ptr, HV * K, row0, i_h * K, n_valid, HAS_TAILS, ENGINE)
        u_acc = ENGINE.mma_wait(u_acc, mma_bars.index(3), 0)
        _wy_epilogue(u_acc, v_smem, u_desc, u_rows_desc, u_ptr, HV * V, row0, i_h * V, n_valid, HAS_TAILS, ENGINE)
    # Shared memory must outlive the bulk stores that read it.
    tma.store_wait(0)
    for i in gl.static_range(2):
        mbarrier.invalidate(ready_bars.index(i))
    for i in gl.static_range(4):
        mbarrier.invalidate(mma_bars.index(i))


# ----------------------------------------------------------------------------------------
# Host side: plan (dry run), launch, AOT list

#: Register cap of the sm_90a launch: 65536 / (3 programs x 128 threads), rounded down to 8
#: (every variant but "blocked" with :data:`WY_SPLIT_WU`, capped at
#: :data:`WY_SPLIT_MAXNREG_SM90`); none keeps anything in local memory at 168.
WY_MAXNREG_SM90 = 168

#: How the inverse feeds its products (the kernel's ``LHS_REGS``): "smem" stores both fp32
#: operands of each of the ten products (:func:`_unit_lower_inverse`); "regs" reads the left
#: one from registers on sm_90a and stores only a once and x once per level
#: (:func:`_unit_lower_inverse_regs`: 5 tile stores instead of 20, no layout shuffles).
WY_VARIANTS = ("smem", "regs", "f16", "blocked")
#: The variant plan_wy picks when none is asked for: "blocked" on sm_90a (12-14% faster than
#: "regs" on the H200, which was 1.26-1.35x faster than "smem"; all at the same error),
#: "regs" on sm_100a. The others stay selectable for comparisons.
WY_DEFAULT_VARIANT = "blocked"

#: "blocked" on sm_90a forms w and u in [64, 64] blocks of columns, one 32-register
#: accumulator at a time, under :data:`WY_SPLIT_MAXNREG_SM90`: four programs per SM (48 KB
#: of shared memory each) instead of three, each issuing its products one after another.
#: H200, triton 3.6.0, bf16 K = V = 128 (``python benchmarks/flag_ab.py split_wu``, outputs
#: bit-equal; ``logs/h200_wy_split.log``): the kernel 0.115 -> 0.099 ms at H16-HV32
#: 1 x 8192, 0.449 -> 0.384 at 1 x 32768, 0.226 -> 0.193 at H16-HV64 1 x 8192; context
#: parallelism's first pass 55 -> 49 µs at H2-HV4 1 x 32768, 222 -> 184 at H8-HV16.
WY_SPLIT_WU = True
#: "blocked" loads the chunk's gate and beta rows before waiting for its k tile
#: (:func:`chunk_rows_early`; the T kernel of :mod:`.wy_t` too), so that their global-load
#: latency overlaps the tile's instead of following k k^T. H200, triton 3.6.0, bf16 K = V =
#: 128 (``python benchmarks/flag_ab.py early_rows``, ``logs/h200_early_rows.log``; outputs
#: bit-equal at 4 x 8192): the T kernel 0.286 -> 0.266 ms at H16-HV32 4 x 8192, 0.525 ->
#: 0.504 on ragged16; the w/u kernel 0.098 -> 0.089 at 1 x 8192, 0.379 -> 0.328 at 1 x
#: 32768, 49 -> 43 µs at H2-HV4 1 x 32768; calls 0.651 -> 0.631, 1.199 -> 1.186, 0.298 ->
#: 0.286, 1.127 -> 1.081 ms.
WY_EARLY_ROWS = True

#: Register cap with :data:`WY_SPLIT_WU`: 65536 / (4 programs x 128 threads).
WY_SPLIT_MAXNREG_SM90 = 128
#: Spill bytes ptxas keeps there (``AotKernel.spill_bytes_allowed``) with the tf32 inverse:
#: 0-16 by specialization with triton 3.6.0.
WY_SPLIT_SPILL_BYTES_SM90 = 32
#: The same with the fp16 inverse (:data:`.blocked_inverse.F16_OPERANDS`, the default),
#: whose check and redo of chunks past fp16's range (A formed again, T by rows) sit beside
#: the products: 40-80 bytes by specialization with triton 3.6.0 (none at
#: :data:`WY_MAXNREG_SM90` without :data:`WY_SPLIT_WU`). The pipeline's calls on it against
#: the tf32 inverse (H100, ``logs/h100_one_kernel_f16_vs_shipped.log``, two runs): 3-7 µs
#: slower at H16-HV32 1 x 8192 (0.2446-0.2453 -> 0.2473-0.2483 ms) and 1 x 32768, 2-5 µs
#: faster at H16-HV64 1 x 8192 (0.3918 -> 0.3863-0.3899).
WY_SPLIT_F16_SPILL_BYTES_SM90 = 96


def split_spill_bytes() -> int:
    """The spill bytes the :data:`WY_SPLIT_WU` build keeps with the inverse as set
    (:func:`.blocked_inverse.fp16_products`)."""
    return WY_SPLIT_F16_SPILL_BYTES_SM90 if fp16_products() else WY_SPLIT_SPILL_BYTES_SM90


def wy_descriptors(H: int, HV: int, K: int, V: int, dtype: torch.dtype) -> tuple:
    """The k and v tiles the kernel reads (in place, in token rows) and the w and u tiles
    (and tail rows) it writes, whole [64, K] / [64, V] per (chunk, head); rows ``B * T``
    from the tensors at each launch."""
    BT = CHUNK_SIZE
    return (
        tile_desc("k_desc", "k", dtype, H * K, (BT, K), token_rows=True),
        tile_desc("v_desc", "v", dtype, HV * V, (BT, V), token_rows=True),
        tile_desc("w_desc", "w", dtype, HV * K, (BT, K)),
        tile_desc("u_desc", "u", dtype, HV * V, (BT, V)),
        tile_desc("w_rows_desc", "w", dtype, HV * K, (1, K), scatter=True),
        tile_desc("u_rows_desc", "u", dtype, HV * V, (1, V), scatter=True),
    )


def plan_wy(problem: GDNProblem, device, variant: str | None = None, *, engine=None) -> BoundLaunch:
    """Launch plan of :func:`wy_fwd` for ``problem`` (a dry run: no GPU, no tensor read).

    Parameters
    ----------
    problem : a validated call; K and V in {64, 128}, bf16/fp16.
    device : DeviceInfo, or a bare capability tuple (its representative part).
    variant : one of :data:`WY_VARIANTS` (how the inverse feeds its products; the results
        agree to rounding), or None for :data:`WY_DEFAULT_VARIANT`.
    engine : the matrix engine the launching backend passes (its ``ENGINE``); None: the
        one registry.toml admits on the device (:func:`~.launch_plan.resolve_engine`).

    Returns
    -------
    The shared plan of the call's class (:func:`wy_plan`) seen with the call's ``B * T``
    and ``N``. One program per (chunk, v-head), v-head fastest (chunks: :func:`wy_chunks`);
    whole K and V tiles; 4 warps (one warpgroup: wgmma's M = 64).
    """
    launch = wy_plan(problem.H, problem.HV, problem.K, problem.V, problem.dtype, has_tails(problem),
                     problem.use_qk_l2norm, as_device(device), variant, engine)
    return launch.bind(problem.B * problem.T, problem.N)


def wy_chunks(rows: int, num_seqs: int, tails: bool) -> int:
    """Chunks the w/u kernel launches over for ``rows = B * T`` packed tokens in ``num_seqs``
    sequences: with tails the chunk slots (``rows // 64 + N``, :mod:`gdn_dispatch.varlen`;
    each program finds its chunk by bisection over cu_seqlens, idle ones exit), without
    them the ``rows / 64`` whole chunks that tile the rows back to back. Known on the host
    from the shapes alone: no chunk table, no read of cu_seqlens (the plan's
    :class:`~.launch_plan.GridRule` computes the same at each launch)."""
    return rows // CHUNK_SIZE + (num_seqs if tails else 0)


def wy_plan(H, HV, K, V, dtype, tails, l2norm, info: DeviceInfo, variant: str | None = None,
            engine=None) -> LaunchPlan:
    """The shared ``wy_fwd`` LaunchPlan of a call class (no ``B * T``, no ``N`` in it)."""
    variant = WY_DEFAULT_VARIANT if variant is None else variant
    if variant not in WY_VARIANTS:
        raise ValueError(f"plan_wy: variant must be one of {WY_VARIANTS}, got {variant!r}")
    engine = resolve_engine(info, engine)
    is_sm100 = engine.is_sm100
    # The blocked inverse reads A in wgmma's accumulator layout: sm_90a only ("regs" on sm_100a).
    blocked = variant == "blocked" and not is_sm100
    lhs_regs = variant in ("regs", "f16") or (variant == "blocked" and is_sm100)
    split = blocked and WY_SPLIT_WU
    early = blocked and WY_EARLY_ROWS
    BT = CHUNK_SIZE
    descriptors, constexprs = drop_unused_scatter(
        wy_descriptors(H, HV, K, V, dtype),
        {"HAS_TAILS": tails, "USE_L2NORM": l2norm, "ENGINE": engine, "LHS_REGS": lhs_regs,
         "F16_INVERSE": variant == "f16" and not is_sm100, "BLOCKED_INVERSE": blocked, "SPLIT_WU": split,
         "EARLY_ROWS": early, "PICK": False})
    elem = torch.finfo(dtype).bits // 8
    return LaunchPlan(
        kernel="wy_fwd",
        # (chunk slots B * T // 64 + N with tails, else the B * T / 64 whole chunks) x HV.
        grid_rule=GridRule(row_block=BT, per_seq=1 if tails else 0, times=HV),
        num_warps=NUM_WARPS,
        # TMEM (sm_100a): M = 64 accumulators take 16 of each 32-lane quarter; k k^T (or a,
        # kept for the "smem" inverse) and the inverse's products (64 columns each), w (K),
        # u (V). Shared: k, v, two fp32 [64, 64] operands (plus the "regs" inverse's staged
        # left operand on sm_100a, where tcgen05 reads it from shared memory).
        blocks={"BT": BT, "K": K, "V": V,
                "smem_bytes": BT * (K + V) * elem + (1 if blocked else 3 if lhs_regs and is_sm100 else 2) * BT * BT * 4,
                "tmem_columns": (2 * BT + K + V) if is_sm100 else 0},
        constexprs=constexprs,
        descriptors=descriptors,
        scalars={"HV": HV, "GROUP": HV // H},
        notes=(f"{'B*T // 64 + N chunk slots' if tails else 'B*T / 64 chunks'} x {HV} v-heads, T formed in-kernel "
               f"({variant} inverse), whole [64, {K}] / [64, {V}] tiles"),
        # sm_90a: 168 registers (ptxas takes 183-198 uncapped for "smem", 155-159 for "regs",
        # and spills nothing at 168) and 66 KB of shared memory let three programs share an
        # SM (four for "blocked" with WY_SPLIT_WU, at 128): each program is a chain of
        # eleven dependent MMAs, so residency is what hides their latency. sm_100a: the
        # hardware's 255, stated (uncapped, ptxas spilled 8 bytes at K = 128, V = 64, l2).
        maxnreg=255 if is_sm100 else WY_SPLIT_MAXNREG_SM90 if split else WY_MAXNREG_SM90,
    )


def wy_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunks: ChunkTable,
    launch: LaunchPlan | BoundLaunch | None = None,
    *,
    use_qk_l2norm: bool = False,
    device_info: DeviceInfo | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    pick: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The WY vectors of each chunk, ``w = T (beta 2^g_cum k)``, ``u = T (beta v)`` with
    ``T = (I + A)^-1`` formed in the kernel, and the gates' chunk-local cumsum (one launch).

    Parameters
    ----------
    k : Tensor ``[B, T, H, K]``, bf16/fp16, in token rows the TMA unit reads in place
        (:func:`~.launch_plan.tma_rows_reason`: 16-byte aligned base and token stride) (raw:
        with the qk l2 norm the kernel normalizes k's rows itself); v-head ``j`` reads k
        head ``j // (HV // H)``. K in {64, 128}.
    v : Tensor ``[B, T, HV, V]``, k's dtype, in token rows as k. V in {64, 128}.
    g : Tensor ``[B, T, HV]``, any float dtype (read as fp32), in token rows (any token
        stride): the per-token log-decay, summed per chunk in the kernel.
    beta : Tensor ``[B, T, HV]``, any float dtype (read as fp32), in token rows.
    chunks : ChunkTable of the call.
    launch : the ``wy_fwd`` plan of the call's class (:func:`wy_plan`, or a dry run's
        :func:`plan_wy`: what the orchestrator passes); the grid and descriptor rows follow
        from the tensors given here. None plans from the tensors with ``use_qk_l2norm`` and
        ``device_info`` (then required), which are ignored when ``launch`` is given.
    out : (w, u, g_cum) allocated by the caller (contiguous, the shapes and dtypes below),
        or None to allocate them here.
    pick : with a ``PICK`` plan (:mod:`.pick`), the pick word: the launch leaves at once
        where it names the warm chain (nothing written).

    Returns
    -------
    w : Tensor ``[B, T, HV, K]``, k's dtype (from l2-normalized k when asked); every row of
        every chunk written.
    u : Tensor ``[B, T, HV, V]``, k's dtype; likewise.
    g_cum : float32 Tensor ``[B, T, HV]``: ``log2(e)`` times the chunk-local inclusive
        cumsum of g (triton_generic's ``chunk_cumsum_fwd(g, chunks, scale=log2(e))``).
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if out is None:
        w = torch.empty(B, T, HV, K, dtype=k.dtype, device=k.device)
        u = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
        g_cum = torch.empty(B, T, HV, dtype=torch.float32, device=k.device)
    else:
        w, u, g_cum = out
    if B * T == 0 or HV == 0:
        return w, u, g_cum
    if launch is None:
        if device_info is None:
            raise ValueError("wy_fwd: pass launch (a plan_wy plan) or device_info to plan one")
        launch = wy_plan(H, HV, K, V, k.dtype, chunks_have_tails(chunks, T), use_qk_l2norm, device_info)
    launch = launch.shared
    if launch.constexprs["PICK"] != (pick is not None):
        raise ValueError("pick: a PICK plan needs the pick word, another plan none")
    tensors, args = wy_launch_args(launch, k, v, w, u, g, g_cum, beta, chunks.cu_seqlens, chunks.num_seqs,
                                   token_stride(g), token_stride(beta), pick)
    launch_planned(_wy_fwd_kernel, launch, tensors, args, rows=B * T, num_seqs=chunks.num_seqs)
    return w, u, g_cum


def wy_launch_args(launch: LaunchPlan, k, v, w, u, g, g_cum, beta, cu_seqlens, num_seqs, s_g, s_beta, pick=None
                   ) -> tuple[dict, dict]:
    """The descriptor tensors and runtime arguments of one ``_wy_fwd_kernel`` launch (what
    :func:`wy_fwd` launches with; a call program binds the same lists to its call's values,
    :mod:`.call_program`). ``pick``: a ``PICK`` plan's pick word (:mod:`.warm_chain`); else
    ``cu_seqlens`` stands in."""
    return {"k": k, "v": v, "w": w, "u": u}, dict(
        w_ptr=w, u_ptr=u, g=g, g_cum=g_cum, beta=beta, cu_seqlens=cu_seqlens,
        pick=cu_seqlens if pick is None else pick, N=num_seqs,
        HV=launch.scalars["HV"], GROUP=launch.scalars["GROUP"], s_g=s_g, s_beta=s_beta)


def wy_signature(launch: LaunchPlan | BoundLaunch, dtype: torch.dtype, beta_dtype: torch.dtype | None = None,
                 g_dtype: torch.dtype = torch.float32, cu_dtype: torch.dtype = torch.int32) -> dict:
    """Argument types of ``_wy_fwd_kernel`` for ``launch``, as a launch would specialize
    (``cu_dtype``: of cu_seqlens, the caller's int32 or int64 offsets)."""
    sig = {d.arg: d.signature for d in launch.descriptors}
    ptr = "*" + sig_dtype(dtype)
    sig.update(w_ptr=ptr, u_ptr=ptr, g="*" + sig_dtype(g_dtype), g_cum="*fp32",
               beta="*" + sig_dtype(beta_dtype or dtype),
               cu_seqlens="*" + sig_dtype(cu_dtype), pick="*" + sig_dtype(cu_dtype), N="i32", HV="i32", GROUP="i32", s_g="i32", s_beta="i32")
    sig.update({name: "constexpr" for name in launch.constexprs})
    return {name: sig[name] for name in arg_names(_wy_fwd_kernel)}


def aot_problem(K: int, V: int, dtype: torch.dtype, tails: bool, l2: bool, H: int = 1, HV: int = 2):
    """A small CPU GDNProblem with these specializations (for plans of AOT entries)."""
    from gdn_dispatch.contract import make_problem

    T = 2 * CHUNK_SIZE + (17 if tails else 0)
    q = torch.zeros(1, T, H, K, dtype=dtype)
    v = torch.zeros(1, T, HV, V, dtype=dtype)
    g = torch.zeros(1, T, HV)
    return make_problem(q, q, v, g, g, use_qk_l2norm_in_kernel=l2)


def wy_kernels_for_aot(capability: tuple[int, int], backend: str | None = None, variant: str | None = None,
                       *, engine=None) -> list:
    """Every specialization launchable on ``capability``: K, V in {64, 128}, tails (varlen)
    on/off, qk l2norm on/off (bf16 only: :func:`.qk_norm.l2_flags`), bf16/fp16, and (g, beta) in (fp32, fp32), (fp32, q's dtype) or
    (q's dtype, q's dtype), the gate dtypes models pass, with int32 cu_seqlens; then bf16
    with fp32 gates and int64 cu_seqlens (the caller's offsets are read as they come); of
    the inverse ``variant`` (None: the one plan_wy picks by default), on ``engine`` (None:
    :func:`~.launch_plan.resolve_engine`)."""
    from gdn_dispatch.aot import AotKernel

    device = as_device(capability)
    engine = resolve_engine(device, engine)
    backend = backend or ("gluon_sm100" if engine.is_sm100 else "gluon_sm90")
    cases = [(dtype, g_dtype, beta_dtype, torch.int32) for dtype in (torch.bfloat16, torch.float16)
             for g_dtype, beta_dtype in ((torch.float32, torch.float32), (torch.float32, dtype), (dtype, dtype))]
    cases.append((torch.bfloat16, torch.float32, torch.float32, torch.int64))
    kernels = []
    for dtype, g_dtype, beta_dtype, cu_dtype in cases:
        for K in (64, 128):
            for V in (64, 128):
                for tails in (False, True):
                    for l2 in l2_flags(dtype):
                        launch = plan_wy(aot_problem(K, V, dtype, tails, l2), device, variant, engine=engine)
                        tag = (f"K{K}-V{V}-{'varlen' if tails else 'dense'}{'-l2' if l2 else ''}"
                               f"-{sig_dtype(dtype)}-g{sig_dtype(g_dtype)}-beta{sig_dtype(beta_dtype)}"
                               f"{'-cu64' if cu_dtype == torch.int64 else ''}")
                        kernels.append(AotKernel(
                            backend=backend, kernel="wy_fwd", specialization=tag, fn=_wy_fwd_kernel,
                            signature=wy_signature(launch, dtype, beta_dtype, g_dtype, cu_dtype),
                            constexprs=dict(launch.constexprs), dialect="gluon", num_warps=launch.num_warps,
                            maxnreg=launch.maxnreg, attrs=pointer_attrs(_wy_fwd_kernel, [
                                "w_ptr", "u_ptr", "g", "g_cum", "beta", "cu_seqlens", "pick"]),
                            spill_bytes_allowed=split_spill_bytes() if launch.constexprs["SPLIT_WU"] else 0,
                        ))
    return kernels
