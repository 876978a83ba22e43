"""What the w/u and output kernels do to rows and columns of a chunk, independent of the
matrix engine: where a chunk starts and how many of its 64 rows are its sequence's, the
causal mask with the gate folded in, the fused l2 norm, and the store of a tile whose last
rows belong to the next sequence.

The causal mask is a bitmask per 16 columns (FlashAttention-3's trick, also in Triton's
Gluon attention example): for row ``i`` and the 16-column group starting at column ``c``
the allowed columns form the 16-bit word ``(1 << clamp(i + 1 - c, 0, 16)) - 1``; element
``(i, c + b)`` is kept when bit ``b`` of its row's word is set. ``gl.map_elementwise`` runs
the scalar test once per element, interleaved, so ptxas turns the word into predicates
(R2P) instead of materialising a 64 x 64 comparison tile. The gate ``2^(g_i - g_j)`` is
applied inside the same scalar function, and masked elements are *selected* to 0, never
multiplied by a 0/1 mask: above the diagonal ``2^(g_i - g_j)`` may overflow to inf, and
``inf * 0`` is NaN.

Tails of a chunk (rows past its sequence's end) read as whatever the next sequence holds;
kernels zero them in registers where they would leak into valid rows (w/u inputs) and
never write them:

* sm_100a: ``tma.async_scatter`` with row index ``0x7FFFFFFF`` (out of bounds, so dropped)
  for the rows past the end (``gluon_sm100.engine.store_tail_rows``);
* sm_90a (no TMA scatter): the staged tile is read back from shared memory in a
  coalesced register layout and written with masked ``gl.store``
  (``gluon_sm90.engine.store_tail_rows``). Only a sequence's last chunk takes this path;
  full chunks use one TMA store on both archs. (A device-side
  descriptor bounded to the sequence would also work, but needs ``triton.set_allocator``
  for its 128-byte tensormap scratch at every launch: global state we keep out of the
  library.)
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gdn_dispatch.backends.gluon_common.compat import tma_store

#: eps of the fused q/k l2-normalization (gdn_dispatch.reference.L2NORM_EPS).
L2NORM_EPS = gl.constexpr(1e-6)


@gluon.constexpr_function
def tile_layout(rows, cols, num_warps):
    """Coalesced register layout of a ``[rows, cols]`` 16-bit tile: 16-byte vectors along
    columns, a warp spanning whole rows, warps stacked down the rows."""
    vec = min(8, cols)
    tpw_col = min(32, max(cols // vec, 1))
    return gl.BlockedLayout([1, vec], [32 // tpw_col, tpw_col], [num_warps, 1], [1, 0])


@gluon.jit
def slot_rows(cu_seqlens, num_seqs, i_s, BT: gl.constexpr):
    """First packed row of chunk slot ``i_s`` and how many of its ``BT`` rows its sequence
    owns, ``<= 0`` at an idle slot (the chunk slots of :mod:`gdn_dispatch.varlen`).

    Sequence ``n`` owns slots from ``s_n = cu[n] // BT + n``; slot ``i_s`` belongs to the
    largest ``n`` with ``s_n <= i_s``, found by bisection over ``cu_seqlens`` (int32 or
    int64; ``log2(N)`` loads) with the invariant ``s_lo <= i_s < s_hi`` (``s_N`` is the slot
    count). Rows come back int32: TMA coordinates are (``B * T < 2^31``, checked on the host).
    """
    lo = num_seqs * 0
    hi = num_seqs + 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = gl.load(cu_seqlens + mid).to(gl.int32) // BT + mid <= i_s
        lo = gl.where(below, mid, lo)
        hi = gl.where(below, hi, mid)
    bos = gl.load(cu_seqlens + lo).to(gl.int32)
    eos = gl.load(cu_seqlens + lo + 1).to(gl.int32)
    row0 = bos + (i_s - (bos // BT + lo)) * BT
    return row0, gl.minimum(eos - row0, BT)


@gluon.jit
def chunk_rows(cu_seqlens, num_seqs, i_c, BT: gl.constexpr, HAS_TAILS: gl.constexpr):
    """First packed row of program ``i_c``'s chunk and how many of its ``BT`` rows its
    sequence owns (``<= 0``: an idle chunk slot, nothing to do).

    With tails, ``i_c`` is a chunk slot (:func:`slot_rows`). Without (every sequence length
    a multiple of ``BT``, uniform batch or varlen) chunks tile the packed rows back to back:
    chunk ``i_c`` starts at row ``i_c * BT`` and is full, so nothing is read.
    """
    if HAS_TAILS:
        row0, n_valid = slot_rows(cu_seqlens, num_seqs, i_c, BT)
    else:
        row0 = i_c * BT
        n_valid = BT
    return row0, n_valid


@gluon.jit
def row_vector(ptr, row0, n_valid, i_h, stride, BT: gl.constexpr, layout: gl.constexpr):
    """``ptr[(row0 + r) * stride + i_h]`` for the chunk's ``BT`` rows (a ``[B, T, HV]``
    tensor of token stride ``stride``: g, beta) as fp32 in ``layout`` (a row SliceLayout);
    0 for rows past the end."""
    r = gl.arange(0, BT, layout=layout)
    x = gl.load(ptr + (row0 + r).to(gl.int64) * stride + i_h, mask=r < n_valid, other=0.0)
    return x.to(gl.float32)


@gluon.jit
def _causal_gate_scalar(s, g_row, g_col, n_allowed, group, bit):
    # n_allowed = i + 1 columns of row i are causal; this element is bit `bit` of the
    # 16-column group starting at `group`. The word of allowed bits of (row, group):
    word = (1 << gl.minimum(gl.maximum(n_allowed - group, 0), 16)) - 1
    keep = ((word >> bit) & 1) != 0
    return gl.where(keep, s * gl.exp2(g_row - g_col), 0.0)


@gluon.jit
def _opaque(x):
    # A move the compiler may not look through or hoist (an asm with effects): what is
    # formed from its result stays where it is used.
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def causal_gate(s, g_row, g_col, n_valid=None):
    """``P[i, j] = s[i, j] * 2^(g_i - g_j)`` for ``j <= i``, exactly 0 above the diagonal.

    Parameters
    ----------
    s : fp32 ``[BT, BT]`` register tile (any distributed layout ``L``).
    g_row : fp32 ``[BT]`` in ``SliceLayout(1, L)``: log2 gate cumsum of the rows.
    g_col : fp32 ``[BT]`` in ``SliceLayout(0, L)``: the same values, for the columns.
    n_valid : int32 scalar or None: the chunk's valid rows; columns from it on are 0 too
        (rows from it on are the caller's to drop). Given, the mask is formed where it is
        used, from row and column ids the compiler may not hoist: a few integer operations
        a chunk, where a loop over chunks would otherwise hold the mask's words across it
        (sm_90a's one-kernel build spilled them and waited on their reloads every chunk).
    """
    BT: gl.constexpr = s.shape[0]
    layout: gl.constexpr = s.type.layout
    rows = gl.arange(0, BT, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BT, layout=gl.SliceLayout(0, layout))
    if n_valid is None:
        n_allowed = gl.expand_dims(rows + 1, 1)
    else:
        rows = _opaque(rows)
        cols = _opaque(cols)
        n_allowed = gl.expand_dims(gl.minimum(rows + 1, n_valid), 1)
    group = gl.expand_dims(cols & ~15, 0)
    bit = gl.expand_dims(cols & 15, 0)
    return gl.map_elementwise(_causal_gate_scalar, s, gl.expand_dims(g_row, 1), gl.expand_dims(g_col, 0),
                              n_allowed, group, bit)


@gluon.jit
def row_rnorm(x_smem, layout: gl.constexpr, PARTS: gl.constexpr = 1):
    """``1 / sqrt(sum_k x[i, k]^2 + 1e-6)`` of every row of a 16-bit shared tile, fp32
    ``[rows]`` in ``SliceLayout(1, layout)`` (the fused qk l2 norm). With ``PARTS`` > 1
    the columns are summed in that many slices (``layout`` then for one slice), holding a
    slice's registers at a time."""
    if PARTS == 1:
        x = x_smem.load(layout).to(gl.float32)
        ss = gl.sum(x * x, axis=1)
    else:
        W: gl.constexpr = x_smem.shape[1] // PARTS
        x = x_smem.slice(0, W, dim=1).load(layout).to(gl.float32)
        ss = gl.sum(x * x, axis=1)
        for i in gl.static_range(1, PARTS):
            x = x_smem.slice(i * W, W, dim=1).load(layout).to(gl.float32)
            ss += gl.sum(x * x, axis=1)
    return gl.rsqrt(ss + L2NORM_EPS)


@gluon.jit
def store_chunk_tile(desc, rows_desc, ptr, row_stride, smem, row0, col0, n_valid,
                     HAS_TAILS: gl.constexpr, ENGINE: gl.constexpr):
    """Write the staged ``[BT, BN]`` tile to rows ``row0 .. row0 + n_valid`` at column ``col0``.

    The caller has stored ``smem`` and issued ``fence_async_shared()`` (the TMA unit reads
    it through the async proxy), and waits with ``tma.store_wait`` before reusing it.

    Parameters
    ----------
    desc : descriptor of the 2-D ``[rows, cols]`` destination, block ``[BT, BN]``.
    rows_desc : the same tensor with block ``[1, BN]`` (sm_100a scatter; unused on sm_90a).
    ptr, row_stride : the destination's base pointer and row stride in elements (sm_90a
        tails only; unused on sm_100a).
    ENGINE : the launching backend's engine; its ``store_tail_rows`` writes a partial chunk.
    """
    BT: gl.constexpr = smem.shape[0]
    if HAS_TAILS:
        if n_valid < BT:
            ENGINE.store_tail_rows(rows_desc, ptr, row_stride, smem, row0, col0, n_valid)
        else:
            tma_store(desc, [row0, col0], smem)
    else:
        tma_store(desc, [row0, col0], smem)


@gluon.jit
def add(a, b):
    """``a + b``: the combine function of a ``gl.associative_scan`` sum (a cumulative sum)."""
    return a + b
