"""Ahead-of-time compilation of a backend's kernels for a named target, without a GPU.

A backend lists what it can launch as :class:`AotKernel` values (``kernels_for_aot``);
this module compiles each for a target such as sm_90a or sm_100a and reads back what the
hardware would be asked to do: the PTX, registers, spills, shared memory, and which of the
instructions we care about the PTX holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AotKernel:
    """One kernel at one specialization, ready to compile.

    Attributes
    ----------
    backend : str, registry name of the backend ("triton_generic", "gluon_sm100"...).
    kernel : str, the stage ("state_fwd", "output_fwd"...).
    specialization : str, a file-name-safe tag ("K128-V128-varlen-vk-bf16").
    fn : the ``@triton.jit`` or ``@gluon.jit`` function.
    signature : dict, argument name -> type string ("*bf16", "i32", "tensordesc<...>",
        "constexpr").
    constexprs : dict, argument name -> value for the constexpr arguments.
    dialect : "triton" or "gluon".
    num_warps, num_stages : launch options.
    """

    backend: str
    kernel: str
    specialization: str
    fn: object
    signature: dict
    constexprs: dict = field(default_factory=dict)
    dialect: str = "triton"
    num_warps: int = 4
    num_stages: int = 3
