"""The fp32 state tile between global memory and a pipeline kernel's accumulator.

A program's state is the ``[K, BV]`` tile (columns ``i_v * BV ...``) of one (sequence,
v-head) of the initial / final state ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk").
Global memory is read and written coalesced (16-byte vectors along the contiguous axis of
the layout in memory); the tile changes register layout, and for "vk" is transposed, by a
round trip through shared memory: the w/k ring of the kernel, idle before the first chunk's
loads and after the last chunk's MMAs. So "vk" needs no transpose kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from gdn_dispatch.backends.gluon_common.compat import HAS_PUBLIC_REINTERPRET, thread_barrier


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
    if HAS_PUBLIC_REINTERPRET:
        view = ring.reinterpret(gl.float32, [rows, cols], _staging_layout())
    else:
        view = ring._reinterpret(gl.float32, [rows, cols], _staging_layout())
    return view


@gluon.jit
def state_in(h0, ring, i_nh, i_v, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
             STATE_VK: gl.constexpr, layout: gl.constexpr):
    """The initial state's [K, BV] tile (columns ``i_v * BV ...``) of (sequence, v-head)
    ``i_nh`` as fp32 in ``layout``, staged through the idle ``ring``. "vk" tiles are read
    coalesced as [BV, K] and read back through a transposed view (no transpose kernel)."""
    base = h0 + i_nh.to(gl.int64) * (K * V)
    if STATE_VK:
        io_vk: gl.constexpr = _io_layout(BV, K, gl.num_warps())
        stage = _staging(ring, BV, K)
        stage.store(gl.load(base + _tile_offsets(BV, K, K, i_v * BV, 0, io_vk)).to(gl.float32))
        s = stage.permute((1, 0)).load(layout)
    else:
        io_kv: gl.constexpr = _io_layout(K, BV, gl.num_warps())
        stage = _staging(ring, K, BV)
        stage.store(gl.load(base + _tile_offsets(K, BV, V, 0, i_v * BV, io_kv)).to(gl.float32))
        s = stage.load(layout)
    return s


@gluon.jit
def state_out(ht, s, ring, i_nh, i_v, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
              STATE_VK: gl.constexpr):
    """Write the fp32 [K, BV] register tile ``s`` into the final state in its layout,
    staged through the idle ``ring`` (the mirror of :func:`state_in`)."""
    base = ht + i_nh.to(gl.int64) * (K * V)
    if STATE_VK:
        stage = _staging(ring, BV, K)
        stage.permute((1, 0)).store(s)
        io_vk: gl.constexpr = _io_layout(BV, K, gl.num_warps())
        gl.store(base + _tile_offsets(BV, K, K, i_v * BV, 0, io_vk), stage.load(io_vk))
    else:
        stage = _staging(ring, K, BV)
        stage.store(s)
        io_kv: gl.constexpr = _io_layout(K, BV, gl.num_warps())
        gl.store(base + _tile_offsets(K, BV, V, 0, i_v * BV, io_kv), stage.load(io_kv))


@gluon.jit
def state_init(S, h0, ring, i_nh, i_v, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
               STATE_VK: gl.constexpr, USE_H0: gl.constexpr, ENGINE: gl.constexpr):
    """Write the initial state's [K, BV] tile (zeros without one) into the accumulator ``S``,
    staged through the idle ``ring`` (:func:`state_in`); returns ``S``."""
    s_layout: gl.constexpr = ENGINE.acc_layout(K, BV, gl.num_warps())
    if USE_H0:
        s0 = state_in(h0, ring, i_nh, i_v, K, V, BV, STATE_VK, s_layout)
        # The staging reads (generic proxy) must precede chunk 0's TMA writes into the same
        # bytes (async proxy), in every thread, before the one issuing thread starts them.
        fence_async_shared()
        thread_barrier()
    else:
        s0 = gl.zeros([K, BV], gl.float32, layout=s_layout)
    return ENGINE.acc_write(S, s0)
