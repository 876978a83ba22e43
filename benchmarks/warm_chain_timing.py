"""The warm chain (gluon_sm90's one-kernel build over chained segments,
backends/gluon_common/warm_chain.py) against the same build with one program per (sequence,
v-head) and the public call as routed, on one sequence of 32768 tokens per tensor-parallel
shard: eager calls timed with CUDA events (median of 20; the public call's host time
included where the GPU waits on it), the bench's gates (and x 0.02 once at 16/32, which
forget within the warm-up window after about 28 chunks), segments sized so that the slots'
programs fill about 128 SMs. The last column is the warm chain's largest relative RMS
difference (o, final state) from the one-program-per-head kernel. A CUDA machine,
repository root:

    python benchmarks/warm_chain_timing.py
"""
import statistics

import torch

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import default_probe
from gdn_dispatch.testing import random_call, rel_rms_error

from gdn_dispatch.backends import gluon_sm90
from gdn_dispatch.backends.gluon_sm90 import fused

TOKENS = 32768
#: (H, HV, gate factor) per row.
SHAPES = [(16, 32, 1.0), (16, 32, 0.02), (8, 16, 1.0), (4, 8, 1.0), (2, 8, 1.0), (2, 4, 1.0)]
#: Programs the segment length aims the slots at.
TARGET_PROGRAMS = 128


def cuda_ms(fn, iters: int = 20) -> float:
    """Median CUDA-event time of ``fn()`` over ``iters`` calls, after three untimed."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def row(H: int, HV: int, factor: float) -> tuple:
    """(shape, segment tokens, programs, public ms, one-program-per-head ms, warm chain ms,
    difference) of one shard."""
    call = random_call(lengths=[TOKENS], H=H, HV=HV, K=128, V=128, device="cuda", seed=0)
    call = {**call, "g": call["g"] * factor}
    problem = make_problem(**call, output_final_state=True, backend="gluon_sm90")
    device = default_probe().for_torch_device(problem.device)
    plain = fused.plan_fused(problem, device, engine=gluon_sm90.ENGINE)
    chained = fused.plan_fused(problem, device, engine=gluon_sm90.ENGINE, chain=True)
    unread = torch.empty(1, device="cuda")  # T tiles and g_cum: the one-kernel build reads neither
    L = max(1024, TOKENS * HV // TARGET_PROGRAMS // 64 * 64)
    NSEG = TOKENS // L + 1
    chain = (torch.empty(NSEG * HV, 128, 128, device="cuda"),
             torch.empty(NSEG * HV + 1, dtype=torch.int32, device="cuda"), L, NSEG)
    public = cuda_ms(lambda: chunk_gated_delta_rule(**call, output_final_state=True, backend="gluon_sm90"))
    one_per_head = cuda_ms(lambda: fused.fused_fwd(problem, unread, unread, plain))
    warm = cuda_ms(lambda: fused.fused_fwd(problem, unread, unread, chained, chain=chain))
    o1, h1 = fused.fused_fwd(problem, unread, unread, chained, chain=chain)
    o0, h0 = fused.fused_fwd(problem, unread, unread, plain)
    diff = max(rel_rms_error(o1.float(), o0.float()), rel_rms_error(h1, h0))
    return f"H{H}-HV{HV} 1x{TOKENS} gates x{factor}", L, NSEG * HV, public, one_per_head, warm, diff


def main() -> None:
    rows = []
    for shape in SHAPES:
        rows.append(row(*shape))
        print(rows[-1], flush=True)
    print("| shape | L | programs | public call (auto) ms | one-kernel plain ms | warm chain ms | chain vs plain |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.1e} |")


if __name__ == "__main__":
    main()
