"""racecheck's control for warp-specialized kernels (run by ``tests/sanitize.py``).

A ``gl.warp_specialize`` kernel whose partitions hand a two-slot ring of [256] fp32 over to
each other through mbarriers, the textbook way: the producer (4 warps) waits for a slot to
be empty, stores it with plain shared stores, orders its warps with a barrier, and one
thread arrives on the slot's "ready" mbarrier; the consumer (8 warps, the default
partition) waits for "ready", loads, barriers, and one thread arrives on "empty". The result
is checked exactly. The racecheck of the CUDA toolkit in the H200 image reports that
handoff as RAW hazards, and Triton's own partition start-up (the default partition writes
the workers' captured values to shared memory before a CTA-wide barrier) too: it does not
model mbarrier arrive/wait as ordering plain shared-memory accesses between partitions. Where racecheck reports hazards here,
``tests/sanitize.py`` cannot judge a warp-specialized kernel by it and leaves those kernels
to memcheck and synccheck; once racecheck passes this control, it checks them again.

    python tests/ws_racecheck_control.py      # prints "control ok" (exit 0) or "control WRONG"
"""

from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from gdn_dispatch.backends.gluon_common.compat import thread_barrier

N = gl.constexpr(256)
STEPS = 16


@gluon.jit
def _consumer(out, ring, ready, empty, STEPS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([2], [32], [gl.num_warps()], [0])
    acc = gl.zeros([N], gl.float32, layout)
    for t in range(STEPS):
        s = t % 2
        mbarrier.wait(ready.index(s), (t // 2) & 1)
        acc += ring.index(s).load(layout)
        thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
    gl.store(out + gl.arange(0, N, layout=layout), acc)


@gluon.jit
def _producer(ring, ready, empty, STEPS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([2], [32], [gl.num_warps()], [0])
    for t in range(STEPS):
        s = t % 2
        mbarrier.wait(empty.index(s), ((t // 2) & 1) ^ 1)
        ring.index(s).store(gl.arange(0, N, layout=layout).to(gl.float32) + (t + 1))
        thread_barrier()
        mbarrier.arrive(ready.index(s), count=1)


@gluon.jit
def _control_kernel(out, STEPS: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.float32, [2, N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([(_consumer, (out, ring, ready, empty, STEPS)), (_producer, (ring, ready, empty, STEPS))],
                       [4], [120])


def main() -> int:
    out = torch.empty(256, device="cuda")
    _control_kernel[(4,)](out, STEPS, num_warps=8, maxnreg=168)
    want = STEPS * torch.arange(256, device="cuda", dtype=torch.float32) + STEPS * (STEPS + 1) // 2
    ok = torch.equal(out, want)
    print("control ok" if ok else "control WRONG", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
