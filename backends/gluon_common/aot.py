"""The ahead-of-time kernel list of a Gluon backend: every specialization it can launch."""

from __future__ import annotations

from gdn_dispatch.aot import AotKernel

from backends.gluon_common.output import output_kernels_for_aot
from backends.gluon_common.state import state_kernels_for_aot
from backends.gluon_common.state_output import state_output_kernels_for_aot
from backends.gluon_common.wu import wu_kernels_for_aot


def backend_kernels_for_aot(backend: str, capabilities: tuple[tuple[int, int], ...],
                            capability: tuple[int, int] | None) -> list[AotKernel]:
    """w/u, state, output and fused state + output kernels of ``backend`` for ``capability``
    (default: its first)."""
    capability = tuple(capability or capabilities[0])
    if capability not in capabilities:
        raise ValueError(f"{backend} compiles for {capabilities}, got {capability}")
    return (wu_kernels_for_aot(capability, backend) + state_kernels_for_aot(capability, backend)
            + output_kernels_for_aot(capability, backend) + state_output_kernels_for_aot(capability, backend))
