"""Where a context-parallel call's GPU time goes, and what pass 2 would take on the
warp-specialized path.

Prints per-kernel GPU time (torch.profiler, 20 public calls after 3 warm-up calls) of

* the segmented calls of the tensor-parallel shards (one sequence of 32768 tokens, 2/4,
  4/8, 2/8 and 8/16 heads, ``context_parallel="auto"``): wy, pass 1 (segment maps), the
  scan, pass 2; then the same calls on raw q, k with the qk l2 norm in the kernel (as
  Qwen3.5 calls it: pass 1 finds what a segment forgets without reading k);
* calls shaped like those calls' pass 2 (the segments as sequences: 16 x 2048 tokens and
  the like, an initial state, no final state, ``context_parallel="off"``), once on the
  warp-specialized path (T kernel + fused kernel) and once on the two-launch pipeline
  (the plan's ``fused.MIN_SM_SHARE`` moved to force each).

Usage (an sm_90 GPU, repository root): ``python benchmarks/cp_kernel_split.py``. bf16,
K = V = 128, ``testing.random_call(seed=1)``.
"""
from __future__ import annotations

import torch

from ab_timing import kernel_ms
from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.testing import random_call
from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
from gdn_dispatch.backends.gluon_sm90 import fused

SHARDS = [("2/4", 2, 4), ("4/8", 4, 8), ("2/8", 2, 8), ("8/16", 8, 16)]
#: (name, H, HV, sequences, tokens each): the segments of the shards' calls as sequences.
SEGMENT_SHAPES = [("H4-HV8 16x2048", 4, 8, 16, 2048), ("H2-HV8 16x2048", 2, 8, 16, 2048),
                  ("H2-HV4 16x2048", 2, 4, 16, 2048), ("H2-HV4 32x1024", 2, 4, 32, 1024),
                  ("H8-HV16 8x4096", 8, 16, 8, 4096), ("H2-HV4 64x512", 2, 4, 64, 512)]


def kernel_times(fn) -> dict[str, float]:
    """µs per call of each kernel ``fn`` launches, after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return {name.strip("_"): ms * 1e3 for name, ms in kernel_ms(fn).items()}


def row(name: str, times: dict[str, float]) -> str:
    parts = ", ".join(f"{k.removesuffix('_kernel')} {v:.1f}" for k, v in sorted(times.items(), key=lambda x: -x[1]))
    return f"{name:28s} total {sum(times.values()):7.1f} us | {parts}"


def main() -> None:
    share = fused.MIN_SM_SHARE
    try:
        for l2 in (False, True):
            for name, H, HV in SHARDS:
                call = random_call(lengths=[32768], H=H, HV=HV, K=128, V=128, device="cuda", seed=1,
                                   normalize_qk=not l2)
                kwargs = {**call, "output_final_state": True, "backend": "gluon_sm90",
                          "use_qk_l2norm_in_kernel": l2}
                print(row(f"segmented {name} 1x32768{' l2' if l2 else ''}",
                          kernel_times(lambda: chunk_gated_delta_rule(**kwargs))), flush=True)
        for name, H, HV, B, T in SEGMENT_SHAPES:
            call = random_call(lengths=[T] * B, H=H, HV=HV, K=128, V=128, device="cuda", seed=1)
            kwargs = {**call, "output_final_state": False, "context_parallel": "off", "backend": "gluon_sm90"}
            for forced, tag in ((0.0, "path"), (1e9, "pipeline")):
                fused.MIN_SM_SHARE = forced
                clear_plan_cache()
                print(row(f"{name} {tag}", kernel_times(lambda: chunk_gated_delta_rule(**kwargs))), flush=True)
    finally:
        fused.MIN_SM_SHARE = share
        clear_plan_cache()


if __name__ == "__main__":
    main()
