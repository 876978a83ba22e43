"""The chunk inverse ``T = (I + A)^-1`` of a strictly lower fp32 [64, 64] tile in 16 x 16
blocks, one warp per block row, on ``mma_v2`` (mma.sync; fp16 operands with
:data:`F16_OPERANDS`, the default, tf32 ones without) instead of ten 64 x 64 products.

A 4-warp program holds A as a wgmma accumulator, where warp ``r`` owns rows ``16 r .. 16 r
+ 15``: its blocks ``A[r, r - d]`` come out into a rank-3 ``[4, 16, 16]`` mma.sync layout
(batch = warp) by a reshape and a select over the column blocks, with no data moving between
threads; T goes back the same way. Per warp:

* the diagonal block ``X_r = (I + D_r)^-1``, D_r = A[r, r], by the doubling of
  :mod:`.wy` at block sizes 4 -> 8 -> 16: ``I - d + d^2 - d^3`` on the 4 x 4 diagonal
  blocks ``d``, then ``x <- x - (x n) x`` with ``n`` the blocks just below x's diagonal
  blocks, ``(x n)`` read off ``(x D)``. Six products; every intermediate is a block of T
  or of A (the power product ``(I - D)(I + D^2)(I + D^4)(I + D^8)`` grows entries to
  C(14, 7) for correlated keys and loses T to tf32 cancellation).
* the blocks below the diagonal by diagonals, from ``(I + A) T = I``::

      T[r, c] = -sum_{m = c .. r - 1} M[r, r - m] T[m, c]       (c = r - 1, r - 2, r - 3)
      M[r, d] = X_r A[r, r - d]

  The three products ``M[r, d]`` read only the warp's own blocks, so they run beside the
  first table's barrier; then each diagonal waits on one product of the diagonal above
  it (its other terms are issued a barrier earlier), the diagonal's blocks exchanged
  through a shared-memory table (slot = block row) and read back by the warp below. Nine
  products: ten dependent ones per warp in all, where ``-X_r (sum_m A[r, m] T[m, c])``
  chained fifteen.

Fifteen 16 x 16 x 16 products per warp, three CTA barriers: 60 mma.sync m16n8k8 on tf32
operands (30 m16n8k16 on fp16 with :data:`F16_OPERANDS`). With :data:`DIAGONAL_SERIES`
the diagonal blocks take a series in 4 x 4 blocks instead of the doubling past size 4:
sixteen products, nine dependent ones. As shipped (:data:`F16_OPERANDS`,
:data:`HALF_TABLES`, :data:`DIAGONAL_SERIES`): 32 mma.sync m16n8k16, the tables in fp16.
On fp16 operands a result past fp16's range is redone in fp32 by the caller
(:func:`lost_half_range`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from gdn_dispatch.backends.gluon_common.compat import reinterpret, thread_barrier

BLOCKS = gl.constexpr(4)
BLOCK = gl.constexpr(16)
#: The block products' operands in fp16 (m16n8k16 mma.sync, fp32 accumulators) instead of
#: tf32 (m16n8k8), in every kernel that runs the inverse (on sm_90a: the one-kernel fused
#: build's aux partition, the pipeline's w/u kernel, the T kernel). fp16 keeps tf32's 10-bit
#: mantissa, so each product rounds its inputs alike (the CPU model's error is tf32's at key
#: cosines 0 to 0.99); a product's fp32 accumulator becomes the next one's lhs by packing
#: pairs in place (tf32's lhs fragment is not the accumulator's: the T kernel's inverse had
#: 128 shuffles, 24 now), and each product is one k-step where tf32 chained two. Its range
#: is fp16's: unit keys with beta in [0, 1] keep A and T inside it (|A| <= 1, and |T| <= 1
#: at key cosines up to 0.999 in the CPU model), but the contract takes any keys, so every
#: kernel checks T (:func:`lost_half_range`) and redoes a chunk that left the range in fp32
#: by rows (:func:`inverse_by_rows`) from A formed again, or, in sm_90a's one-kernel fused
#: build, from A kept in 16 KB of shared memory (:func:`redo_buffer`;
#: tests/test_numerics.py: keys 300 times unit length). A redo by the blocked inverse in
#: tf32 instead spilled the one-kernel build's aux loop (sm_90a 172 -> 420 bytes, 196 -> 656
#: with the norm on chip) and cost it 35% on the H100 (0.499 -> 0.674 ms at H16-HV32 4 x
#: 8192, ``logs/h100_bench_f16_redo.log``); with the redo by rows the loop spills 172 bytes,
#: as without a redo (320 with the norm on chip). H100, triton 3.6.0, `flag_ab.py
#: f16_inverse` without a redo: the T kernel 0.392-0.402 -> 0.365 ms on ragged16; the
#: one-kernel build (fused.AUX_T with STATE_SCORES) 0.593-0.598 -> 0.551-0.553 ms at 4 x
#: 8192; outputs within 2.2e-4 of tf32's. With the redo by rows, :data:`HALF_TABLES` and
#: :data:`DIAGONAL_SERIES` (``flag_ab.py f16_inverse --with
#: aux_t,state_scores,half_tables,diagonal_series``, ``logs/h100_f16_redo_rows_ab.log``)
#: that build's calls took 0.552 ms at H16-HV32 4 x 8192 against 0.663 with tf32 products,
#: 0.975 against 1.084 on ragged16, 1.074 against 1.282 at HV 64, o within 2.7e-4, and the
#: GPU tests passed on it (1354; its 3 failures a planning fault of every build, since
#: fixed; ``logs/h100_gpu_tests_f16_redo_rows.log``): on, with :data:`HALF_TABLES`,
#: :data:`DIAGONAL_SERIES` and the one-kernel build (:data:`..gluon_sm90.fused.AUX_T` says
#: what the default rests on).
F16_OPERANDS = gl.constexpr(True)
#: The tables the warps hand T's block diagonals down through hold fp16 (with
#: :data:`F16_OPERANDS`), in the caller's fp32 buffer's first 6 KB: a block goes in by one
#: stmatrix and each slot a warp reads as the next product's rhs comes out by one ldmatrix
#: (:func:`_shifted`), where fp32 slots take scalar loads and a conversion to fp16 per
#: element. X, Y and W come back rounded to fp16 before T is assembled (T leaves as bf16 /
#: fp16 in every caller). sm_90a, triton 3.6.0: the T kernel's shared loads 91 -> 7 PTX
#: instructions and spills 40 -> 0 bytes; the one-kernel fused build's inverse 666 -> 571
#: SASS instructions per warp and chunk. H100, the one-kernel build with the fp16 inverse
#: (``flag_ab.py half_tables --with aux_t,state_scores``, ``logs/h100_half_tables_ab.log``):
#: the fused kernel 0.581 -> 0.509 ms at 4 x 8192, 1.059-1.061 -> 0.928-0.930 on ragged16, 1.151-1.153
#: -> 1.016-1.019 at HV 64. Needs :data:`F16_OPERANDS` (fp32 tables without it): on with it.
HALF_TABLES = gl.constexpr(True)
#: Each diagonal block's inverse from its 4 x 4 blocks' by the series of
#: :func:`_diagonal_block_inverse` (``(I - L + L^2 - L^3) x``: L x and L^2 side by side,
#: then L^2 x and L^2 (L x)) instead of doubling to 8 and 16: five dependent products
#: instead of six (seven products instead of six), so ten dependent ones per warp become
#: nine. The terms stay small: in the CPU model (fp16 inputs) its error is the doubling's
#: within 10% up to key cosine 0.999 with beta = 1 and no decay. H100, the one-kernel build
#: with the fp16 inverse and :data:`HALF_TABLES` (``flag_ab.py diagonal_series --with
#: aux_t,state_scores,half_tables``, ``logs/h100_diagonal_series_ab.log``): the fused kernel
#: 0.503-0.509 -> 0.506 ms at 4 x 8192, 0.927-0.937 -> 0.922-0.923 on ragged16, 0.983-1.001
#: -> 0.992-0.997 at HV 64: within noise but for ragged16. On with :data:`F16_OPERANDS`
#: (timed with it above); it applies to tf32 products too, where it was not timed: the
#: tf32 build is all three flags off.
DIAGONAL_SERIES = gl.constexpr(True)

#: The block products' PTX instruction on fp16 operands and on tf32 ones (the only
#: mma.sync of the kernels that run the inverse; compile checks count them).
PRODUCT_PTX = {"f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
               "tf32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"}


def ptx_products(ptx: str) -> dict:
    """Block products in ``ptx`` by operand type: ``{"f16": n, "tf32": m}`` (one inverse
    is 60 tf32 ones, or 30 fp16 ones with :data:`F16_OPERANDS`, 32 with
    :data:`DIAGONAL_SERIES` too, as shipped)."""
    return {kind: ptx.count(spelling) for kind, spelling in PRODUCT_PTX.items()}


def inverse_products() -> dict:
    """:func:`ptx_products` of a kernel that forms one inverse with the flags as set: 15
    products per warp (16 with :data:`DIAGONAL_SERIES`), two mma.sync each on fp16, four
    on tf32 (the redo of :func:`lost_half_range` runs on the CUDA cores)."""
    per_warp = 16 if DIAGONAL_SERIES else 15
    return {"f16": 2 * per_warp, "tf32": 0} if F16_OPERANDS else {"f16": 0, "tf32": 4 * per_warp}


@gluon.constexpr_function
def block_mma_layout():
    """The rank-3 mma.sync accumulator layout: one warp per 16 x 16 block of the batch."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])


@gluon.constexpr_function
def inverse_layout():
    """The fp32 [64, 64] layout :func:`blocked_unit_lower_inverse` takes A in: Hopper's
    4-warp wgmma accumulator (warp r: rows 16 r .. 16 r + 15, instr N = 64). A tile held in
    another layout (sm_100a's tensor-memory loads) is converted into it first."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])


@gluon.constexpr_function
def table_layout(rank=3):
    """Rows g and g + 2 of an mma.sync fragment 8 banks apart (a 32-byte swizzle every two
    rows of a 16 x 16 block): the accumulator's 8-byte stores and the rhs operand's 4-byte
    loads are free of bank conflicts (unswizzled, both took twice their ideal wavefronts:
    a third of the T kernel's shared-memory traffic). ``rank`` 2: the same bytes as [64,
    16] rows, where the swizzle's phase is the row's within its block."""
    return gl.SwizzledSharedLayout(8, 2, 2, list(range(rank - 1, -1, -1)))


@gluon.constexpr_function
def half_table_layout(rank=3):
    """fp16 slots (:data:`HALF_TABLES`): 32-byte rows, four to a 128-byte line, their two
    16-byte halves swapped every four rows, so that the eight rows one ldmatrix / stmatrix
    phase touches fall in distinct banks. ``rank`` 2: the same bytes as rows."""
    return gl.SwizzledSharedLayout(8, 4, 2, list(range(rank - 1, -1, -1)))


@gluon.constexpr_function
def _operand_layout(index, f16):
    """A block product's operand ``index`` (0: lhs, 1: rhs): fp16 pairs or tf32 singles."""
    return gl.DotOperandLayout(operand_index=index, parent=block_mma_layout(), k_width=2 if f16 else 1)


@gluon.jit
def _mm(x, y, acc):
    """``acc + x @ y`` over the batch of [16, 16] fp32 blocks, mma.sync on tf32 operands
    (fp16 with :data:`F16_OPERANDS`)."""
    lhs: gl.constexpr = _operand_layout(0, F16_OPERANDS)
    rhs: gl.constexpr = _operand_layout(1, F16_OPERANDS)
    if F16_OPERANDS:
        out = mma_v2(gl.convert_layout(x.to(gl.float16), lhs), gl.convert_layout(y.to(gl.float16), rhs), acc)
    else:
        out = mma_v2(gl.convert_layout(x, lhs), gl.convert_layout(y, rhs), acc, input_precision="tf32")
    return out


@gluon.jit
def block_ids(layout: gl.constexpr):
    """Block row, row and column indices of a [4, 16, 16] tensor in ``layout``, each
    broadcastable to it."""
    b = gl.arange(0, BLOCKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    i = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    j = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    return (gl.expand_dims(gl.expand_dims(b, 1), 2), gl.expand_dims(gl.expand_dims(i, 0), 2),
            gl.expand_dims(gl.expand_dims(j, 0), 1))


@gluon.jit
def _column_ids(layout: gl.constexpr):
    """Block row and block column indices of a [4, 16, 4, 16] tensor in ``layout``."""
    r = gl.arange(0, BLOCKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
    c = gl.arange(0, BLOCKS, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))
    return (gl.expand_dims(gl.expand_dims(gl.expand_dims(r, 1), 2), 3),
            gl.expand_dims(gl.expand_dims(gl.expand_dims(c, 0), 1), 3))


@gluon.jit
def _diagonal(a4, d: gl.constexpr):
    """Blocks ``A[r, r - d]`` of the [4, 16, 4, 16] view ``a4`` (zeros for r < d), as a
    [4, 16, 16] batch in the mma.sync layout."""
    L4: gl.constexpr = a4.type.layout
    r, c = _column_ids(L4)
    blk = gl.sum(gl.where(r - d == c, a4, 0.0), axis=2)
    return gl.convert_layout(blk, block_mma_layout())


@gluon.jit
def _shifted(slots, first: gl.constexpr, s: gl.constexpr):
    """The batch whose block r is the table at slot ``first`` of ``slots``' slot r - s
    (zeros for r < s), as the rhs operand of :func:`_mm` (in fp16 with :data:`F16_OPERANDS`): each warp reads the slots in the operand's layout (a load
    replicated over the warps), then keeps its own, so that no layout conversion follows.
    (A view of the slots shifted by s is not one: a sub-view's offset must be a multiple of
    its size, and Triton 3.9 rejects a one-slot view widened to four.) From fp16 tables
    (:data:`HALF_TABLES`) a slot is one ldmatrix, kept by a packed fp16 multiply-add with
    the warp's 0 / 1 weight (exact on the finite entries the tables hold; a select of fp16
    halves took twice the instructions)."""
    RHS: gl.constexpr = _operand_layout(1, F16_OPERANDS)
    b, _, _ = block_ids(RHS)
    dtype: gl.constexpr = gl.float16 if F16_OPERANDS else gl.float32
    HALF: gl.constexpr = slots.dtype == gl.float16
    ROWS: gl.constexpr = half_table_layout(2) if HALF else table_layout(2)
    rows = reinterpret(slots, slots.dtype, [slots.shape[0] * BLOCK, BLOCK], ROWS)
    out = gl.zeros([BLOCKS, BLOCK, BLOCK], dtype, RHS)
    for k in gl.static_range(BLOCKS - s):
        blk = gl.expand_dims(rows.slice(BLOCK * (first + k), BLOCK).load(gl.SliceLayout(0, RHS)).to(dtype), 0)
        if HALF:
            out = out + blk * (b == k + s).to(gl.float16)
        else:
            out = gl.where(b == k + s, blk, out)
    return out


@gluon.jit
def _table_slots(tables):
    """``tables`` (fp32 ``[16, 16, 16]``) as the slots the three tables live in: itself,
    or its bytes as fp16 ``[32, 16, 16]`` with :data:`HALF_TABLES` (fp16 products only)."""
    if HALF_TABLES and F16_OPERANDS:
        slots = reinterpret(tables, gl.float16, [2 * BLOCKS * BLOCKS, BLOCK, BLOCK], half_table_layout())
    else:
        slots = tables
    return slots


@gluon.jit
def _diagonal_block_inverse(D, zero):
    """``(I + D)^-1`` of every block of the batch D (strictly lower [16, 16] blocks)."""
    MMA: gl.constexpr = block_mma_layout()
    _, i, j = block_ids(MMA)
    four = i // 4 == j // 4
    d = gl.where(four, D, 0.0)
    # On the 4 x 4 diagonal blocks (d D) = d^2 and (d^2 D) = d^3, and d^4 = 0.
    p = gl.where(four, _mm(d, D, zero), 0.0)
    q = gl.where(four, _mm(p, D, zero), 0.0)
    x = gl.where(i == j, 1.0, 0.0) - d + p - q
    if DIAGONAL_SERIES:
        # I + D = (I + d)(I + L), L = x (D - d) strictly lower in 4 x 4 blocks (L^4 = 0):
        # (I + D)^-1 = (I - L + L^2 - L^3) x, its two last terms from L^2 and L x.
        L = gl.where(four, 0.0, _mm(x, D, zero))
        Lx = _mm(L, x, zero)
        L2 = _mm(L, L, zero)
        x = x - Lx + _mm(L2, x, zero) - _mm(L2, Lx, zero)
    else:
        # 4 -> 8 -> 16: x is block diagonal at size b; (x D) on the blocks just below its
        # diagonal blocks inside each pair is x n exactly.
        for level in gl.static_range(2, 4):
            below = (i // (2 << level) == j // (2 << level)) & (i // (1 << level) != j // (1 << level))
            y = gl.where(below, _mm(x, D, zero), 0.0)
            x = x - _mm(y, x, zero)
    return x


@gluon.jit
def blocked_unit_lower_inverse(a, tables):
    """``(I + a)^-1`` of a strictly lower fp32 [64, 64] tile ``a`` held as a 4-warp wgmma
    accumulator (warp r: rows 16 r .. 16 r + 15), returned in ``a``'s layout.

    ``tables``: fp32 shared memory ``[16, 16, 16]`` (:func:`table_layout`; free on entry
    and exit; the first 12 KB used, 6 KB with :data:`HALF_TABLES`) for the diagonals of T
    the warps hand down.
    """
    X, Y, W, Vb = blocked_inverse_diagonals(a, tables)
    # Back to the [64, 64] tile: block (r, c) is the diagonal r - c's block of row r.
    L4: gl.constexpr = gl.reshape(a, [BLOCKS, BLOCK, BLOCKS, BLOCK]).type.layout
    r, c = _column_ids(L4)
    blk: gl.constexpr = gl.SliceLayout(2, L4)
    t4 = gl.where(r == c, gl.expand_dims(gl.convert_layout(X, blk), 2), 0.0)
    t4 = gl.where(r - 1 == c, gl.expand_dims(gl.convert_layout(Y, blk), 2), t4)
    t4 = gl.where(r - 2 == c, gl.expand_dims(gl.convert_layout(W, blk), 2), t4)
    t4 = gl.where(r - 3 == c, gl.expand_dims(gl.convert_layout(Vb, blk), 2), t4)
    return gl.convert_layout(gl.reshape(t4, [BLOCKS * BLOCK, BLOCKS * BLOCK]), a.type.layout)


#: :func:`inverse_by_rows`' rows of A read per step (and rows of T with them).
ROW_STEP = gl.constexpr(8)


@gluon.constexpr_function
def row_major_layout(rank=2):
    """Unswizzled row-major shared memory: the layout :func:`inverse_by_rows` works in."""
    return gl.SwizzledSharedLayout(1, 1, 1, list(range(rank - 1, -1, -1)))


#: The redo buffer (:func:`redo_buffer`) swizzled: each 32-byte piece of a row moved by the
#: row's index mod 8. A stored from the wgmma accumulator into unswizzled 256-byte rows put
#: the eight rows a warp's store touches on the same banks: eight wavefronts a store where
#: two carry its 256 bytes. Proton (H100, one-kernel build, H16-HV32 4 x 8192): that store
#: took ~700 cycles per aux warp and chunk, 14% of its inverse phase. The redo (rare) then
#: loads A back and runs by rows in the inverse's tables (:func:`unit_lower_inverse_by_rows`).
#: The same 16 STS.64 a thread, at addresses no longer a base and immediates. H100 80GB
#: HBM3, triton 3.6.0 (``python benchmarks/flag_ab.py swizzled_redo_buffer``,
#: ``logs/h100_swizzled_redo_buffer.log``, two rounds, outputs bit-equal): calls 0.523 ->
#: 0.498 ms at H16-HV32 4 x 8192, 0.939 -> 0.925 on ragged16, 1.019 -> 0.974 at HV 64, but
#: 0.647 -> 0.681 with the qk l2 norm on chip, whose aux loop spills 64 bytes more for the
#: swizzled addresses (240 -> 304 on sm_90a): on, but not in builds with the norm on chip
#: (:func:`redo_layout`).
SWIZZLED_REDO_BUFFER = gl.constexpr(True)
#: The redo buffer's rows padded, where it is not swizzled (the builds with the qk l2 norm
#: on chip; every build with :data:`SWIZZLED_REDO_BUFFER` off): 32 bytes after each 256-byte
#: row, so that a warp's eight rows fall on distinct banks four at a time (two wavefronts a
#: store, as swizzled) while its 16 stores keep one base and immediate offsets. 2 KB more
#: shared memory; sm_90a spills (triton 3.6.0) as row-major without the norm (swizzled +8
#: bytes), +24 with it (swizzled +64). H100 80GB HBM3, triton 3.6.0, padded in every build
#: against the shipped layouts (``python benchmarks/flag_gpu_check.py padded_redo_buffer
#: --steps ab,tests``, ``logs/h100_padded_redo_buffer.log``, two rounds, outputs bit-equal;
#: the fused path's and the numerics' GPU tests passed with it, 242): 4 x 8192 with the
#: norm on chip 0.649 / 0.650 -> 0.627 / 0.629 ms; where it replaces the swizzled buffer
#: 0.497 / 0.499 -> 0.499 / 0.499 at 4 x 8192, 0.923 / 0.923 -> 0.929 / 0.930 on ragged16,
#: 0.969 / 0.975 -> 0.978 / 0.977 at HV 64. So on, under the swizzled buffer where that is.
PADDED_REDO_BUFFER = gl.constexpr(True)
#: fp32 elements of padding after each row of the padded redo buffer.
REDO_ROW_PADDING = 8


@gluon.constexpr_function
def redo_layout(BT, l2_norm_on_chip):
    """The shared layout of :func:`redo_buffer` in a one-kernel build with or without the
    qk l2 norm on chip: swizzled (:data:`SWIZZLED_REDO_BUFFER`, not with the norm on chip),
    else padded (:data:`PADDED_REDO_BUFFER`), else row-major."""
    if SWIZZLED_REDO_BUFFER and not l2_norm_on_chip:
        return gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    if PADDED_REDO_BUFFER:
        return gl.PaddedSharedLayout.with_identity_for([[BT, REDO_ROW_PADDING]], [BT, BT], [1, 0])
    return row_major_layout()


@gluon.constexpr_function
def redo_in_place(BT, l2_norm_on_chip):
    """Whether :func:`redo_from_buffer` runs in the buffer itself: :func:`redo_layout` is
    row-major."""
    return redo_layout(BT, l2_norm_on_chip) == row_major_layout()


def redo_buffer_bytes(BT: int, l2_norm_on_chip: bool = False) -> int:
    """Shared memory of :func:`redo_buffer` in a build with or without the qk l2 norm on
    chip (its rows padded where :func:`redo_layout` pads them)."""
    padded = isinstance(redo_layout(BT, l2_norm_on_chip), gl.PaddedSharedLayout)
    return BT * (BT + (REDO_ROW_PADDING if padded else 0)) * 4


@gluon.jit
def redo_buffer(BT: gl.constexpr, L2: gl.constexpr = False):
    """An fp32 [BT, BT] buffer (16 KB, :func:`redo_layout` with the qk l2 norm on chip or
    not: ``L2``) a loop keeps each chunk's A in (:func:`.wy.chunk_t_of_kk`'s ``a_save``) for
    :func:`redo_from_buffer`, so that a chunk the fp16 inverse lost (:func:`fp16_products`)
    needs A formed again no more."""
    return gl.allocate_shared_memory(gl.float32, [BT, BT], redo_layout(BT, L2))


@gluon.jit
def redo_from_buffer(a_save, tables, layout: gl.constexpr, L2: gl.constexpr):
    """``(I + A)^-1`` by rows (:func:`inverse_by_rows`) of the A kept in ``a_save``
    (:func:`redo_buffer`, ``L2`` as allocated), in ``layout``: in place when the buffer is
    row-major (:func:`redo_in_place`), else from A loaded back in ``layout`` into ``tables``
    (as for :func:`blocked_unit_lower_inverse`; free on entry and exit)."""
    if redo_in_place(a_save.shape[0], L2):
        t = inverse_by_rows(a_save, layout)
    else:
        t = unit_lower_inverse_by_rows(a_save.load(layout), tables)
    return t


@gluon.jit
def unit_lower_inverse_by_rows(a, tables):
    """:func:`inverse_by_rows` of ``a`` (``a`` and ``tables`` as for
    :func:`blocked_unit_lower_inverse`), A stored first into the tables' 16 KB: the redo
    of a result that :func:`lost_half_range`, for a caller that holds A in registers."""
    BT: gl.constexpr = a.shape[0]
    buffer = reinterpret(tables, gl.float32, [BT, BT], row_major_layout())
    thread_barrier()
    buffer.store(a)
    layout: gl.constexpr = a.type.layout
    return inverse_by_rows(buffer, layout)


@gluon.jit
def inverse_by_rows(buffer, layout: gl.constexpr):
    """``(I + A)^-1`` of the strictly lower A held in ``buffer`` (row-major fp32 [64, 64],
    :func:`row_major_layout`) by forward substitution in fp32 on the CUDA cores, ``T[i] =
    e_i - sum_{j < i} A[i, j] T[j]``, a row at a time in place: row i of T overwrites row i
    of A (later rows read A's rows below i only). The fp16 inverse's redo
    (:func:`lost_half_range`): a few registers per thread matter more than its 64 steps
    (held beside a partition's loop, the blocked inverse in tf32 spilled that loop's
    registers: the one-kernel fused build 0.499 -> 0.674 ms on the H100). Returns T in
    ``layout``; the buffer is free again."""
    BT: gl.constexpr = buffer.shape[0]
    STEPS: gl.constexpr = BT // ROW_STEP
    # Views of the same bytes; a leading dim that is indexed stays out of the layout.
    rows = reinterpret(buffer, gl.float32, [BT, BT], row_major_layout(1))
    a_steps = reinterpret(buffer, gl.float32, [BT * STEPS, ROW_STEP], row_major_layout(1))
    t_steps = reinterpret(buffer, gl.float32, [STEPS, ROW_STEP, BT], row_major_layout(2))
    # Each thread one column of an [8, 64] step, its 8 rows in registers (two threads a column).
    STEP: gl.constexpr = gl.BlockedLayout([ROW_STEP, 1], [1, 32], [1, gl.num_warps()], [1, 0])
    ROW: gl.constexpr = gl.SliceLayout(0, STEP)
    thread_barrier()
    col = gl.arange(0, BT, layout=ROW)
    for i in range(BT):
        acc = gl.zeros([BT], gl.float32, ROW)
        for step in range(0, (i + ROW_STEP - 1) // ROW_STEP):
            # A[i, j] is 0 for j >= i, so the rows of the step not yet T add nothing.
            a_ij = a_steps.index(i * STEPS + step).load(gl.SliceLayout(1, STEP))
            acc += gl.sum(gl.expand_dims(a_ij, 1) * t_steps.index(step).load(STEP), axis=0)
        t_i = gl.where(col == i, 1.0, 0.0) - acc
        # Every thread has read A's row i before it becomes T's.
        thread_barrier()
        rows.index(i).store(t_i)
        thread_barrier()
    t = buffer.load(layout)
    thread_barrier()
    return t


@gluon.jit
def redone_diagonals(a, tables):
    """The four block diagonals of :func:`blocked_inverse_diagonals` from
    :func:`unit_lower_inverse_by_rows` (its redo)."""
    t4 = gl.reshape(unit_lower_inverse_by_rows(a, tables), [BLOCKS, BLOCK, BLOCKS, BLOCK])
    return _diagonal(t4, 0), _diagonal(t4, 1), _diagonal(t4, 2), _diagonal(t4, 3)


@gluon.jit
def blocked_inverse_diagonals(a, tables):
    """The four block diagonals of ``(I + a)^-1`` (``a`` and ``tables`` as for
    :func:`blocked_unit_lower_inverse`): ``[4, 16, 16]`` batches in :func:`block_mma_layout`
    whose block r is T's block ``(r, r - d)`` for diagonal d = 0, 1, 2, 3 (zeros for r < d)."""
    gl.static_assert(gl.num_warps() == 4, "one warp per 16-row block of the 64-row tile")
    a4 = gl.reshape(a, [BLOCKS, BLOCK, BLOCKS, BLOCK])
    zero = gl.zeros([BLOCKS, BLOCK, BLOCK], gl.float32, block_mma_layout())
    D = _diagonal(a4, 0)
    S1 = _diagonal(a4, 1)
    S2 = _diagonal(a4, 2)
    S3 = _diagonal(a4, 3)
    X = _diagonal_block_inverse(D, zero)

    slots = _table_slots(tables)
    MMA: gl.constexpr = block_mma_layout()
    XS: gl.constexpr = 0
    YS: gl.constexpr = BLOCKS
    WS: gl.constexpr = 2 * BLOCKS
    xs = slots.slice(XS, BLOCKS)
    ys = slots.slice(YS, BLOCKS)
    ws = slots.slice(WS, BLOCKS)
    # The warp's own factors of the three diagonals while the other warps reach the table;
    # X, Y and W are read back from the tables at the end, not held across the products.
    xs.store(X.to(slots.dtype))
    M1 = _mm(X, S1, zero)
    M2 = _mm(X, S2, zero)
    M3 = _mm(X, S3, zero)
    thread_barrier()
    # T[r, r-1] = -M1 X_{r-1}, and the first terms of the two diagonals below.
    Y = -_mm(M1, _shifted(slots, XS, 1), zero)
    W = _mm(M2, _shifted(slots, XS, 2), zero)
    Vb = _mm(M3, _shifted(slots, XS, 3), zero)
    ys.store(Y.to(slots.dtype))
    thread_barrier()
    # T[r, r-2] = -(M2 X_{r-2} + M1 T[r-1, r-2])
    W = -_mm(M1, _shifted(slots, YS, 1), W)
    Vb = _mm(M2, _shifted(slots, YS, 2), Vb)
    ws.store(W.to(slots.dtype))
    thread_barrier()
    # T[r, r-3] = -(M3 X_{r-3} + M2 T[r-2, r-3] + M1 T[r-1, r-3])
    Vb = -_mm(M1, _shifted(slots, WS, 1), Vb)
    X = xs.load(MMA).to(gl.float32)
    Y = ys.load(MMA).to(gl.float32)
    W = ws.load(MMA).to(gl.float32)
    # The tables are read above by other warps: free only after every warp is past them.
    thread_barrier()
    return X, Y, W, Vb


#: Largest |T| entry kept from fp16 products (:func:`lost_half_range`): half fp16's
#: range, so that an entry that only grew near its top is redone too.
HALF_RANGE = gl.constexpr(32768.0)


@gluon.constexpr_function
def fp16_products():
    """Whether the inverse runs on fp16 products (:data:`F16_OPERANDS`, as set when the
    kernel compiles), so that its callers check its result and redo (:func:`lost_half_range`)."""
    return bool(F16_OPERANDS)


@gluon.jit
def _squares_in_range(total):
    """Whether a sum of squares stays under :data:`HALF_RANGE` squared: false where an
    entry reached it, and where one was inf or NaN (the sum is then inf or NaN, which
    compares false); true sums past it with every entry under it only redo a chunk."""
    return total < HALF_RANGE * HALF_RANGE


@gluon.jit
def lost_half_range(t):
    """Whether the inverse on fp16 operands (:func:`fp16_products`; callers check that
    first, at compile time) lost fp16's range: an entry of its [64, 64] result ``t`` is not
    finite or reaches :data:`HALF_RANGE`, read off the sum of t's squares (one multiply-add
    an entry, one reduction; T of unit keys has ||T||^2 <= 4096, far under the bound).
    Entries of A or T past 65504 become inf on the way, which reaches the result: each
    product's rhs carries an identity block or a T block (x's diagonal is 1), so an inf
    meets a 1 (inf) or a 0 (NaN) in every column it enters, and no select drops a column
    of T. The caller then redoes the inverse by rows (:func:`inverse_by_rows`)."""
    return not _squares_in_range(gl.sum(gl.sum(t * t, 1), 0))


#: The one-kernel build's range check without its reduction across the warps on the aux's
#: chain: each warp sums its own rows' squares (:func:`warp_squares`, no shared memory), the
#: four sums go to shared memory before the barrier the gate vectors' stores already take,
#: and the decision (:func:`squares_lost_half_range`) and a redo come after it, T_u stored
#: again then. Proton (H100, H16-HV32 4 x 8192): the check took ~490 cycles per aux warp and
#: chunk, 10% of its inverse phase. Not yet timed: off.
LATE_RANGE_CHECK = gl.constexpr(False)


@gluon.constexpr_function
def late_range_check_set():
    """:data:`LATE_RANGE_CHECK` as set when the kernel compiles (read by name here, so that
    Triton's cache key of every kernel calling this follows the flag)."""
    return bool(LATE_RANGE_CHECK)


@gluon.jit
def warp_squares(t):
    """The sums of squares of each warp's 16 rows of the [64, 64] ``t``
    (:func:`inverse_layout`: warp r holds rows 16 r .. 16 r + 15): fp32 [4], each reduced
    within its warp."""
    t3 = gl.reshape(t, [BLOCKS, BLOCK, t.shape[1]])
    return gl.sum(gl.sum(t3 * t3, 2), 1)


@gluon.jit
def squares_lost_half_range(squares):
    """:func:`lost_half_range` from :func:`warp_squares`' four sums (any 1-D layout)."""
    return not _squares_in_range(gl.sum(squares, 0))


@gluon.jit
def diagonals_lost_half_range(X, Y, W, Vb):
    """:func:`lost_half_range` of the four diagonals :func:`blocked_inverse_diagonals`
    returns."""
    squares = X * X + Y * Y + W * W + Vb * Vb
    return not _squares_in_range(gl.sum(gl.sum(gl.sum(squares, 2), 1), 0))
