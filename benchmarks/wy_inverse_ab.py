"""A/B of the w/u kernel's inverse (the pipeline's ``wy_fwd``, also context parallelism's
first pass): ``plan_wy``'s default variant set to "blocked" (16 x 16 blocks on tf32
mma.sync) against "regs" (64 x 64 wgmma doubling), each in its own process, alternating.

    python benchmarks/wy_inverse_ab.py          # runs both twice, prints one table

Public calls, bf16, K = V = 128, initial + final state: the calls the pipeline (and
context parallelism) runs on the H200; call time and per-kernel GPU time
(:mod:`ab_timing`); outputs compared between the two.
"""
import subprocess
import sys

import torch

from ab_timing import compare_outputs, run_variant

SHAPES = (("H16-HV32-1x8192", 16, 32, 8192), ("H16-HV32-1x32768", 16, 32, 32768), ("H16-HV64-1x8192", 16, 64, 8192),
          ("H2-HV4-1x32768", 2, 4, 32768), ("H8-HV16-1x32768", 8, 16, 32768))


def calls() -> dict:
    from gdn_dispatch.testing import random_call

    out = {}
    for name, H, HV, T in SHAPES:
        out[name] = random_call(lengths=[T], H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=3)
        out[name]["output_final_state"] = True
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1:
        from gdn_dispatch.backends.gluon_common import wy

        wy.WY_DEFAULT_VARIANT = sys.argv[1]
        run_variant("wy_inverse_ab", sys.argv[1], calls())
        sys.exit(0)
    print("| inverse | shape | call ms | enqueue µs | kernels ms |")
    for variant in ("regs", "blocked", "regs", "blocked"):
        subprocess.run([sys.executable, __file__, variant], check=True, stderr=subprocess.DEVNULL)
    compare_outputs("wy_inverse_ab", [name for name, *_ in SHAPES], "regs", "blocked")
