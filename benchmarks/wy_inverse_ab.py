"""A/B of the w/u kernel's inverse (the pipeline's ``wy_fwd``, also context parallelism's
first pass): ``plan_wy``'s default variant set to "blocked" (16 x 16 blocks on tf32
mma.sync) against "regs" (64 x 64 wgmma doubling), each in its own process (a kernel's
constexpr globals are fixed at its first compile), alternating.

    python benchmarks/wy_inverse_ab.py          # runs both twice, prints one table

Public calls, bf16, K = V = 128, initial + final state: the calls the pipeline (and
context parallelism) runs on the H200; call time (triton.testing.do_bench median) and
per-kernel GPU time (torch.profiler over 20 calls); outputs compared between the two.
"""
import subprocess
import sys

import torch

SHAPES = (("H16-HV32-1x8192", 16, 32, 8192), ("H16-HV32-1x32768", 16, 32, 32768), ("H16-HV64-1x8192", 16, 64, 8192),
          ("H2-HV4-1x32768", 2, 4, 32768), ("H8-HV16-1x32768", 8, 16, 32768))


def one(variant: str) -> None:
    import triton
    from torch.profiler import ProfilerActivity, profile

    from gdn_dispatch import chunk_gated_delta_rule
    from gdn_dispatch.backends.gluon_common import wy
    from gdn_dispatch.testing import random_call

    wy.WY_DEFAULT_VARIANT = variant
    for name, H, HV, T in SHAPES:
        call = random_call(lengths=[T], H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=3)
        call["output_final_state"] = True
        o, s = chunk_gated_delta_rule(**call)
        torch.save((o.cpu(), s.cpu()), f"/tmp/wy_inverse_ab_{name}_{variant}.pt")
        ms = triton.testing.do_bench(lambda: chunk_gated_delta_rule(**call), warmup=10, rep=200)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                chunk_gated_delta_rule(**call)
            torch.cuda.synchronize()
        per = {e.key.split("(")[0][:22]: e.device_time_total / 20 / 1e3 for e in prof.key_averages()
               if "kernel" in e.key}
        print(f"| {variant} | {name} | {ms:.4f} | " + ", ".join(f"{k} {v:.4f}" for k, v in per.items()) + " |",
              flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1])
        sys.exit(0)
    print("| inverse | shape | call ms | kernels ms |")
    for variant in ("regs", "blocked", "regs", "blocked"):
        subprocess.run([sys.executable, __file__, variant], check=True, stderr=subprocess.DEVNULL)
    from gdn_dispatch.testing import rel_rms_error
    for name, *_ in SHAPES:
        a, b = (torch.load(f"/tmp/wy_inverse_ab_{name}_{v}.pt") for v in ("regs", "blocked"))
        print(f"{name}: o differs by {rel_rms_error(b[0].float(), a[0].float()):.2e}, "
              f"state by {rel_rms_error(b[1], a[1]):.2e}")
