"""H200 sweep of the fused recurrence + output kernel's launch configurations.

Run from the repository root on an sm_90 GPU::

    PYTHONPATH=. python benchmarks/h200_state_output_configs.py [--budget S] [--l2] [--shapes a,b]

For every default bench shape (``gdn_dispatch.bench.default_shapes``): w, u and g_cum from
``wy_fwd``, then ``state_output_fwd`` alone at every (BV, warps, o stored a chunk late)
configuration that holds its state tile, timed as the median of CUDA events
(``bench.median_event_ms``, one input set: the kernel reads w / u / q / k once per V-block
program, far more than L2). Each configuration's output is checked against the chosen
configuration's (relative RMS <= 2e-3: the same roundings, a different summation split)
after NaN-poisoning it. Prints one table last: ms per configuration, ``*`` marking what
``state_output_config`` / ``state_output_defers`` pick, and the fastest.
"""

from __future__ import annotations

import argparse
import time
import traceback

import torch

T0 = time.time()
#: (BV, warps, defer): every configuration the kernel is built for, on sm_90a.
SWEEP = [(32, 4, False), (32, 4, True), (32, 8, True), (32, 8, False), (64, 4, False), (64, 8, True),
         (64, 8, False), (128, 8, False)]


def say(*args):
    print(*args, flush=True)


def sweep_shape(shape, device, info, l2):
    """{(BV, warps, defer): ms} and the chosen key for one bench shape."""
    from gdn_dispatch.bench import make_input_sets, median_event_ms
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.testing import rel_rms_error

    from gdn_dispatch.backends.gluon_common.state_output import plan_state_output, state_output_fwd, state_output_warps
    from gdn_dispatch.backends.gluon_common.wy import plan_wy, wy_fwd

    x = make_input_sets(shape, 1, device, seed=7, qk_l2norm=l2)[0]
    p = make_problem(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0, output_final_state=True,
                     cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu, use_qk_l2norm_in_kernel=l2)
    w, u, g_cum = wy_fwd(p.k, p.v, p.g, p.beta, p.chunks, plan_wy(p, info))
    chosen = plan_state_output(p, info)
    key = (chosen.blocks["BV"], chosen.num_warps, chosen.constexprs["DEFER_OUT"])

    def run(plan):
        return state_output_fwd(p.q, p.k, w, u, g_cum, p.chunks, plan, scale=p.scale,
                                initial_state=p.initial_state, output_final_state=True)

    o_ref, ht_ref = run(chosen)
    times = {}
    for BV, warps, defer in SWEEP:
        if warps < state_output_warps(p.K, BV):
            continue
        plan = plan_state_output(p, info, block_v=BV, num_warps=warps, defer_out=defer)
        torch.cuda.empty_cache()
        torch.full((1 << 26,), float("nan"), device=device)  # poison the allocator's free blocks
        o, ht = run(plan)
        err = max(rel_rms_error(o, o_ref), rel_rms_error(ht, ht_ref))
        if not err <= 2e-3:
            say(f"  MISMATCH {shape.name} BV={BV} warps={warps} defer={defer}: {err:.2e}")
            continue
        times[(BV, warps, defer)] = median_event_ms(lambda: run(plan), iters=20)
    return times, key


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=150.0)
    parser.add_argument("--l2", action="store_true")
    parser.add_argument("--shapes", default="", help="substrings of bench shape names to keep")
    args = parser.parse_args()
    from gdn_dispatch.bench import default_shapes
    from gdn_dispatch.device import default_probe

    device = torch.device("cuda")
    info = default_probe().for_torch_device(device)
    say(torch.cuda.get_device_name(), torch.__version__, "l2" if args.l2 else "")
    rows = []
    for shape in default_shapes():
        if args.shapes and not any(s in shape.name for s in args.shapes.split(",")):
            continue
        if time.time() - T0 > args.budget:
            say(f"SKIP {shape.name} and later (time budget)")
            break
        try:
            times, key = sweep_shape(shape, device, info, args.l2)
            rows.append((shape.name, times, key))
            say(shape.name, " ".join(f"{k}={v:.3f}" for k, v in times.items()), "chosen", key)
        except Exception as exc:
            traceback.print_exc()
            say(f"{shape.name} failed: {type(exc).__name__}: {exc}")
    cols = [c for c in SWEEP if any(c in t for _, t, _ in rows)]
    say("\nshape | " + " | ".join(f"BV{b}/w{w}{'/d' if d else ''}" for b, w, d in cols) + " | best")
    for name, times, key in rows:
        best = min(times, key=times.get) if times else None
        cells = [f"{times[c]:.3f}{'*' if c == key else ''}" if c in times else "-" for c in cols]
        say(f"{name} | " + " | ".join(cells) + f" | {best}")


if __name__ == "__main__":
    main()
