"""A/B of the T kernel's inverse on the warp-specialized path (sm_90): the blocked inverse
(``wy_t.WY_T_BLOCKED_INVERSE = True``) against the 64 x 64 wgmma doubling on fp16 operands,
each in its own process, alternating.

    python benchmarks/t_inverse_ab.py          # runs both twice, prints one table

Public calls, bf16, H = 16, HV = 32, K = V = 128, initial + final state: 4 x 8192 and the
bench's ragged16; call time and per-kernel GPU time (:mod:`ab_timing`); outputs compared
between the two.
"""
import subprocess
import sys

import torch

from ab_timing import compare_outputs, run_variant

SHAPES = ("4x8192", "ragged16")


def calls() -> dict:
    from gdn_dispatch.bench_shapes import ragged_lengths
    from gdn_dispatch.testing import random_call

    out = {}
    for name, kw in zip(SHAPES, (dict(batch=(4, 8192)), dict(lengths=list(ragged_lengths())))):
        out[name] = random_call(**kw, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=3)
        out[name]["output_final_state"] = True
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1:
        from gdn_dispatch.backends.gluon_common import wy_t

        wy_t.WY_T_BLOCKED_INVERSE = sys.argv[1] == "blocked"
        run_variant("t_inverse_ab", sys.argv[1], calls())
        sys.exit(0)
    print("| inverse | shape | call ms | enqueue µs | kernels ms |")
    for variant in ("wgmma-f16", "blocked", "wgmma-f16", "blocked"):
        subprocess.run([sys.executable, __file__, variant], check=True, stderr=subprocess.DEVNULL)
    compare_outputs("t_inverse_ab", SHAPES, "wgmma-f16", "blocked")
