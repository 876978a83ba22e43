"""Named phases of the warp-specialized kernels for Proton's intra-kernel profiler.

``enter("chain.wait_tiles")`` / ``leave("chain.wait_tiles")`` around a phase of a
partition's loop: when a Proton session in instrumentation mode compiles the kernel
(``benchmarks/partition_profile.py``), each pair records the cycles every warp spends in the
phase; in any other compile they emit nothing (the kernels' instructions are those of a
build without them). Names are ``partition.phase``, so that a profile reads per partition.
A Triton built without Proton gets no-ops.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:
    from triton.profiler import language as _proton
except ImportError:  # a Triton built without Proton
    _proton = None


if _proton is not None:
    @gluon.jit
    def enter(name: gl.constexpr):
        """Start phase ``name`` (a no-op outside an instrumented compile)."""
        _proton.enter_scope(name)

    @gluon.jit
    def leave(name: gl.constexpr):
        """End phase ``name`` (a no-op outside an instrumented compile)."""
        _proton.exit_scope(name)
else:
    @gluon.jit
    def enter(name: gl.constexpr):
        """Start phase ``name``: nothing to record without Proton."""
        pass

    @gluon.jit
    def leave(name: gl.constexpr):
        """End phase ``name``: nothing to record without Proton."""
        pass
