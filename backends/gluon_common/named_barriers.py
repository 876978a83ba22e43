"""Hardware named barriers shared by two warp-specialized partitions (PTX ``bar.sync`` /
``bar.arrive`` with a barrier id and a thread count), where an mbarrier would not do: a
partition that waits on an mbarrier while one of its wgmma accumulating into registers is in
flight (the wait is a loop of ``try_wait``) makes ptxas serialize every wgmma of the kernel
(its note C7512), while a named barrier is one instruction.

Ids :data:`FIRST_ID` and up; Triton's own partition barriers take the low ids (0 for the
whole CTA, then one per partition), so a kernel's compile test checks its PTX for the ids
it uses (``tests/test_state_halves.py``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

#: The first id these helpers hand out (of the 16 a CTA has).
FIRST_ID = gl.constexpr(12)


@gluon.constexpr_function
def _asm(op, ID, THREADS):
    # The instruction, and a result the inline asm must have.
    return f"bar.{op} {int(ID)}, {int(THREADS)}; mov.b32 $0, 0;"


@gluon.jit
def _one(NUM_WARPS: gl.constexpr):
    # A one-element tensor every thread holds: an inline asm over it runs once a thread.
    return gl.full([1], 0, gl.int32, gl.BlockedLayout([1], [32], [NUM_WARPS], [0]))


@gluon.jit
def named_sync(ID: gl.constexpr, THREADS: gl.constexpr):
    """Wait at named barrier ``ID`` until ``THREADS`` threads (this partition's and the
    other's, which may only arrive) are there."""
    gl.static_assert(ID >= FIRST_ID and ID < 16, "named barrier ids FIRST_ID .. 15")
    ASM: gl.constexpr = _asm("sync", ID, THREADS)
    gl.inline_asm_elementwise(ASM, "=r,r", [_one(gl.num_warps())], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def named_arrive(ID: gl.constexpr, THREADS: gl.constexpr):
    """Arrive at named barrier ``ID`` (of ``THREADS`` threads) without waiting."""
    gl.static_assert(ID >= FIRST_ID and ID < 16, "named barrier ids FIRST_ID .. 15")
    ASM: gl.constexpr = _asm("arrive", ID, THREADS)
    gl.inline_asm_elementwise(ASM, "=r,r", [_one(gl.num_warps())], dtype=gl.int32, is_pure=False, pack=1)
