"""How much the pipeline's two kernels could gain from running at once: gluon_sm90's
``wy_fwd`` (bandwidth-bound: reads k, v, writes w, u) and its state kernel
``state_output_fwd`` (latency-bound: one program per v-head and V block walks every chunk)
timed alone, one after the other on one stream (as a call runs them), and on two streams at
once. The state kernel reads w and u a first ``wy_fwd`` wrote, so both launches do their
usual work; the concurrent ``wy_fwd`` rewrites the same values. Timing only (no result is
checked): the two-stream time bounds what one launch that overlaps them, the walk consuming
each chunk's w and u as they are published, could reach. Inputs: cp_crossover's (bf16, K =
V = 128, the bench's gates, an initial state). Eager launches, CUDA events
(``bench_ceiling.median_event_ms``: median of 20 after 3), no input rotation. A CUDA
machine, repository root:

    python benchmarks/overlap_probe.py [--shapes 16/32/1/32768,...] [--light]

``--light`` builds the state kernel with two ring slots and one output partition (as
shipped it takes three slots and two partitions: at one program per SM its shared memory
and registers leave no room for a ``wy_fwd`` program beside it), to see whether a walk that
leaves room for one runs the two at once.
"""
import argparse

import torch

from cp_crossover import GATE_DIVISORS, call_for
from gdn_dispatch.bench_ceiling import median_event_ms
from gdn_dispatch.backends import gluon_sm90
from gdn_dispatch.backends.gluon_common import forward
from gdn_dispatch.backends.gluon_common.buffers import call_buffers
from gdn_dispatch.backends.gluon_common.state_output import state_output_fwd
from gdn_dispatch.backends.gluon_common.wy import wy_fwd
from gdn_dispatch.context_parallel import plan_context_parallel
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import default_probe

#: (H, HV, N, tokens per sequence): shapes the registry runs on the pipeline ("off").
SHAPES = [(16, 32, 1, 32768), (16, 32, 1, 8192), (16, 64, 1, 8192), (8, 16, 1, 32768)]


def probe(H: int, HV: int, N: int, L: int, device) -> str:
    """One table row for the shape, or why it has none."""
    problem = make_problem(**call_for(H, HV, N, L, GATE_DIVISORS["bench"]))
    off = plan_context_parallel("off", T_total=N * L, N=N, HV=HV, V=128, sm_count=device.sm_count)
    cp, launches, _ = forward.call_launches(problem, off, device, gluon_sm90.ENGINE)
    if launches.fused:
        return f"| {H}/{HV} | {N} x {L} | the one-kernel path: no pipeline |"
    buffers = call_buffers(problem, launches, cp)
    chunks = problem.chunks

    def wy():
        wy_fwd(problem.k, problem.v, problem.g, problem.beta, chunks, launches.stage("wy_fwd"), out=buffers[:3])

    def state():
        state_output_fwd(problem.q, problem.k, *buffers[:3], chunks, launches.stage("state_output_fwd"),
                         scale=problem.scale, initial_state=problem.initial_state, output_final_state=True,
                         out=buffers[3:])

    side = torch.cuda.Stream()

    def both():
        side.wait_stream(torch.cuda.current_stream())
        state()  # the walkers first, as a walk that waits on published chunks would start
        with torch.cuda.stream(side):
            wy()
        torch.cuda.current_stream().wait_stream(side)

    wy()
    t_wy, t_state = median_event_ms(wy, iters=20), median_event_ms(state, iters=20)
    serial, overlapped = median_event_ms(lambda: (wy(), state()), iters=20), median_event_ms(both, iters=20)
    return (f"| {H}/{HV} | {N} x {L} | {t_wy:.3f} | {t_state:.3f} | {serial:.3f} | {overlapped:.3f} | "
            f"{serial / overlapped:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=lambda x: [tuple(int(n) for n in s.split("/")) for s in x.split(",")],
                        default=SHAPES, help="comma-separated H/HV/N/tokens")
    parser.add_argument("--light", action="store_true",
                        help="state kernel with two ring slots and one output partition")
    args = parser.parse_args()
    if args.light:
        from triton.experimental.gluon import language as gl
        from gdn_dispatch.backends.gluon_common import state_output, state_output_ws
        state_output.RING_SLOTS_MAX = 2
        state_output_ws.OUTPUT_PARTITIONS = gl.constexpr(1)
    device = default_probe().for_torch_device(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}"
          f"{', state kernel light (two slots, one output partition)' if args.light else ''}")
    print("| H/HV | N x tokens | wy ms | state ms | one stream ms | two streams ms | one / two |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for shape in args.shapes:
        print(probe(*shape, device), flush=True)


if __name__ == "__main__":
    main()
