"""The fp32 state tile between global memory and a pipeline kernel's accumulator.

A program's state is the ``[K, BV]`` tile (columns ``i_v * BV ...``) of one (sequence,
v-head) of the initial / final state ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk"),
or of a state pool ``[P, HV, K, V]`` / ``[P, HV, V, K]`` (float32 or bfloat16) whose row a
sequence reads (and, in place, writes back) is ``state_indices[n]``.
Global memory is read and written coalesced (16-byte vectors along the contiguous axis of
the layout in memory); the tile changes register layout, and for "vk" is transposed, by a
round trip through shared memory: the w/k ring of the kernel, idle before the first chunk's
loads and after the last chunk's MMAs. So "vk" needs no transpose kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from gdn_dispatch.backends.gluon_common.compat import reinterpret, thread_barrier


@gluon.constexpr_function
def _io_layout(rows, cols, num_warps):
    """Coalesced fp32 register layout of a [rows, cols] state tile: 16-byte vectors along
    the contiguous columns."""
    tpc = min(32, max(cols // 4, 1))
    return gl.BlockedLayout([1, 4], [32 // tpc, tpc], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _staging_layout():
    """Shared layout of the fp32 state staging tile (read back transposed for "vk")."""
    return gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])


@gluon.jit
def _tile_offsets(R: gl.constexpr, C: gl.constexpr, stride, r0, c0, layout: gl.constexpr):
    """``(r0 + r) * stride + c0 + c`` over an [R, C] tile in ``layout``."""
    r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    return gl.expand_dims((r0 + r) * stride, 1) + gl.expand_dims(c0 + c, 0)


@gluon.jit
def _staging(ring, rows: gl.constexpr, cols: gl.constexpr):
    """An fp32 [rows, cols] view of the w/k ring's bytes, for moving a state tile between
    layouts while the ring is idle (rows * cols * 4 <= the ring's bytes: BV <= 128)."""
    return reinterpret(ring, gl.float32, [rows, cols], _staging_layout())


@gluon.jit
def state_block(state_indices, i_n, i_h, HV, P, USE_POOL: gl.constexpr):
    """The [K, V] block of ``h0`` (initial states, or the pool) that sequence ``i_n``,
    v-head ``i_h`` reads and writes back, as ``row * HV + i_h``; -1 when there is none.

    Without a pool, row ``i_n``; with one, pool row ``state_indices[i_n]``, and an index
    outside ``[0, P)`` (-1 pads CUDA graphs) has no block: zeros in, nothing out. One int32
    lives across the chunk loop (the largest sm_90a tiles have no register to spare);
    ``P * HV`` blocks of at least 4096 elements fit it for any pool that fits a GPU.
    """
    if USE_POOL:
        i_slot = gl.load(state_indices + i_n)
        block = gl.where((i_slot >= 0) & (i_slot < P), i_slot.to(gl.int32) * HV + i_h, -1)
    else:
        block = i_n * HV + i_h
    return block


@gluon.jit
def _block_base(h0, block, K: gl.constexpr, V: gl.constexpr):
    """(pointer to block ``block`` of ``h0``, element limit: K * V, or 0 for block -1)."""
    base = h0 + gl.maximum(block, 0).to(gl.int64) * (K * V)
    # Offsets run over [0, K * V) of the block: a limit of 0 masks them all.
    return base, gl.where(block >= 0, K * V, 0)


@gluon.jit
def state_in(h0, ring, block, i_v, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
             STATE_VK: gl.constexpr, USE_POOL: gl.constexpr, layout: gl.constexpr, OUT_VK: gl.constexpr = False,
             BYPASS_L1: gl.constexpr = False):
    """The [K, BV] tile (columns ``i_v * BV ...``) of block ``block`` (:func:`state_block`)
    of the initial states or pool ``h0`` (fp32 or bf16 in memory) as fp32 in ``layout``,
    staged through the idle ``ring``; zeros for block -1 (pools only). "vk" tiles are read
    coalesced as [BV, K] and read back through a transposed view (no transpose kernel).
    ``OUT_VK`` returns the tile transposed, [BV, K] (a kernel holding the state as S^T).
    ``BYPASS_L1`` reads past L1 (``.cg``): a tile another SM stored during this launch."""
    base, limit = _block_base(h0, block, K, V)
    if STATE_VK:
        io_vk: gl.constexpr = _io_layout(BV, K, gl.num_warps())
        offs = _tile_offsets(BV, K, K, i_v * BV, 0, io_vk)
        stage = _staging(ring, BV, K)
    else:
        io_kv: gl.constexpr = _io_layout(K, BV, gl.num_warps())
        offs = _tile_offsets(K, BV, V, 0, i_v * BV, io_kv)
        stage = _staging(ring, K, BV)
    if USE_POOL:
        x = gl.load(base + offs, mask=offs < limit, other=0.0)
    elif BYPASS_L1:
        x = gl.load(base + offs, cache_modifier=".cg")
    else:
        x = gl.load(base + offs)
    stage.store(x.to(gl.float32))
    if STATE_VK != OUT_VK:
        s = stage.permute((1, 0)).load(layout)
    else:
        s = stage.load(layout)
    return s


@gluon.jit
def state_out(ht, i_nh, h0, block, i_v, s, ring, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
              STATE_VK: gl.constexpr, STORE_HT: gl.constexpr, INPLACE: gl.constexpr, IN_VK: gl.constexpr = False):
    """Write the fp32 [K, BV] register tile ``s`` in the state layout, staged through the
    idle ``ring`` (the mirror of :func:`state_in`): to block ``i_nh`` (sequence * HV +
    v-head) of the float32 final state ``ht`` with ``STORE_HT``, and back to block
    ``block`` of the pool ``h0``, in the pool's dtype, with ``INPLACE`` (not for block -1).
    ``IN_VK``: ``s`` is the tile transposed, [BV, K]."""
    if STATE_VK:
        stage = _staging(ring, BV, K)
        if IN_VK:
            stage.store(s)
        else:
            stage.permute((1, 0)).store(s)
        io_vk: gl.constexpr = _io_layout(BV, K, gl.num_warps())
        offs = _tile_offsets(BV, K, K, i_v * BV, 0, io_vk)
        x = stage.load(io_vk)
    else:
        stage = _staging(ring, K, BV)
        if IN_VK:
            stage.permute((1, 0)).store(s)
        else:
            stage.store(s)
        io_kv: gl.constexpr = _io_layout(K, BV, gl.num_warps())
        offs = _tile_offsets(K, BV, V, 0, i_v * BV, io_kv)
        x = stage.load(io_kv)
    if STORE_HT:
        gl.store(ht + i_nh.to(gl.int64) * (K * V) + offs, x)
    if INPLACE:
        # A branch, not a mask: the tile's mask bits, next to the tile and its offsets,
        # spilled on sm_90a at the largest state tiles.
        if block >= 0:
            gl.store(h0 + block.to(gl.int64) * (K * V) + offs, x.to(h0.dtype.element_ty))


@gluon.jit
def state_init(S, h0, ring, block, i_v, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
               STATE_VK: gl.constexpr, USE_H0: gl.constexpr, USE_POOL: gl.constexpr, ENGINE: gl.constexpr):
    """Write the initial state's [K, BV] tile (zeros without one, or for a pool index
    without a row) into the accumulator ``S``, staged through the idle ``ring``
    (:func:`state_in`); returns ``S``."""
    s_layout: gl.constexpr = ENGINE.acc_layout(K, BV, gl.num_warps())
    if USE_H0:
        s0 = state_in(h0, ring, block, i_v, K, V, BV, STATE_VK, USE_POOL, s_layout)
        # The staging reads (generic proxy) must precede chunk 0's TMA writes into the same
        # bytes (async proxy), in every thread, before the one issuing thread starts them.
        fence_async_shared()
        thread_barrier()
    else:
        s0 = gl.zeros([K, BV], gl.float32, layout=s_layout)
    return ENGINE.acc_write(S, s0)
