"""A/B of the T kernel's inverse on the warp-specialized path (sm_90): the blocked inverse
(``wy_t.WY_T_BLOCKED_INVERSE = True``) against the 64 x 64 wgmma doubling on fp16 operands,
each in its own process (a kernel's constexpr globals are fixed at its first compile).

    python benchmarks/t_inverse_ab.py          # runs both, prints one table

Public calls, bf16, H = 16, HV = 32, K = V = 128, initial + final state: 4 x 8192 and the
bench's ragged16; call time (triton.testing.do_bench median) and per-kernel GPU time
(torch.profiler over 20 calls); outputs compared between the two (relative RMS).
"""
import subprocess
import sys

import torch


def one(blocked: bool) -> None:
    import triton
    from torch.profiler import ProfilerActivity, profile

    from gdn_dispatch import chunk_gated_delta_rule
    from gdn_dispatch.backends.gluon_common import wy_t
    from gdn_dispatch.bench_shapes import ragged_lengths
    from gdn_dispatch.testing import random_call

    wy_t.WY_T_BLOCKED_INVERSE = blocked
    for name, kw in (("4x8192", dict(batch=(4, 8192))), ("ragged16", dict(lengths=list(ragged_lengths())))):
        call = random_call(**kw, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=3)
        call["output_final_state"] = True
        o, s = chunk_gated_delta_rule(**call)
        torch.save((o.cpu(), s.cpu()), f"/tmp/t_inverse_ab_{name}_{int(blocked)}.pt")
        ms = triton.testing.do_bench(lambda: chunk_gated_delta_rule(**call), warmup=10, rep=200)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                chunk_gated_delta_rule(**call)
            torch.cuda.synchronize()
        per = {e.key[:20]: e.device_time_total / 20 / 1e3 for e in prof.key_averages() if "kernel" in e.key}
        print(f"| {'blocked' if blocked else 'wgmma f16'} | {name} | {ms:.4f} | "
              + ", ".join(f"{k} {v:.4f}" for k, v in per.items()) + " |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1] == "1")
        sys.exit(0)
    print("| inverse | shape | call ms | kernels ms |")
    for flag in ("0", "1", "0", "1"):
        subprocess.run([sys.executable, __file__, flag], check=True)
    from gdn_dispatch.testing import rel_rms_error
    for name in ("4x8192", "ragged16"):
        a, b = torch.load(f"/tmp/t_inverse_ab_{name}_0.pt"), torch.load(f"/tmp/t_inverse_ab_{name}_1.pt")
        print(f"{name}: o differs by {rel_rms_error(b[0].float(), a[0].float()):.2e}, "
              f"state by {rel_rms_error(b[1], a[1]):.2e}")
