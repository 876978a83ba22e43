"""H200: the fused wy kernel's inverse variants side by side (``plan_wy(..., variant=)``).

Run from the repository root on an sm_90 GPU::

    PYTHONPATH=.:/tmp/site python3 benchmarks/h200_wy_variants.py [--budget 120] [--iters 20]

For each shape (gdn_dispatch.bench's H16-HV32-1x32768, H16-HV64-1x32768 and the ragged
H16-HV32 batch, whose random lengths leave tails; then H16-HV32-1x32768 with the qk l2 norm
in the kernel) and each variant of :data:`gdn_dispatch.backends.gluon_common.wy.WY_VARIANTS`:

1. correctness on input set 0, outputs NaN-poisoned first: w, u against float32 torch
   (``ref_wu`` of h200_gluon_sm90.py on triton_generic's float32 ``kkt_solve_fwd``), g_cum
   against triton_generic's cumsum; relative RMS <= 5e-3 (NaN anywhere fails);
2. the median CUDA-event time of ``wy_fwd`` (gdn_dispatch.bench.median_event_ms), each call
   on the next of ``rotation_count`` input sets, so no call reads its inputs from L2.

The table comes last: one row per shape, per variant ms, error, PASS/FAIL, and the speedup
of each variant over "smem" (the variant the kernel had before "regs").
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from h200_gluon_sm90 import poison_allocator, ref_wu  # noqa: E402

LOG2E = math.log2(math.e)
TOL = 5e-3
T0 = time.time()
#: (bench shape name, qk l2 norm in the kernel)
CASES = (("H16-HV32-1x32768", False), ("H16-HV64-1x32768", False), ("H16-HV32-ragged16", False),
         ("H16-HV32-1x32768", True))


def say(*args):
    print(*args, flush=True)


def problem_of(x, l2):
    from gdn_dispatch.contract import make_problem

    return make_problem(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, cu_seqlens=x.cu_seqlens,
                        cu_seqlens_cpu=x.cu_seqlens_cpu, use_qk_l2norm_in_kernel=l2)


def reference(p):
    """Float32 w, u ([B*T, HV, K] / [B*T, HV, V]) and g_cum ([B, T, HV]) of ``p``."""
    from gdn_dispatch.backends.triton_generic import chunk_cumsum_fwd, kkt_solve_fwd

    g_cum = chunk_cumsum_fwd(p.g, p.chunks, scale=LOG2E)
    A32 = kkt_solve_fwd(p.k, g_cum, p.beta, p.chunks, use_qk_l2norm=p.use_qk_l2norm, out_dtype=torch.float32)
    w_ref, u_ref = ref_wu(p, A32, g_cum)
    return w_ref, u_ref, g_cum


def check(p, launch, ref, device):
    """Relative RMS errors (w, u, g_cum) of one poisoned wy_fwd call against ``ref``."""
    from gdn_dispatch.testing import rel_rms_error

    from gdn_dispatch.backends.gluon_common.wy import wy_fwd

    w_ref, u_ref, g_ref = ref
    poison_allocator(device)
    w, u, g_cum = wy_fwd(p.k, p.v, p.g, p.beta, p.chunks, launch)
    torch.cuda.synchronize()
    return (rel_rms_error(w.reshape(w_ref.shape), w_ref), rel_rms_error(u.reshape(u_ref.shape), u_ref),
            rel_rms_error(g_cum, g_ref))


def run_case(name, l2, device, info, iters):
    """{variant: (ms, (err_w, err_u, err_g))} for one shape."""
    from gdn_dispatch.bench import default_shapes, make_input_sets, median_event_ms, rotation_count

    from gdn_dispatch.backends.gluon_common.wy import WY_VARIANTS, plan_wy, wy_fwd

    shape = next(s for s in default_shapes() if s.name == name)
    say(f"RUN  {name}{' l2' if l2 else ''}: {shape.describe()}")
    first = make_input_sets(shape, 1, device, seed=3, qk_l2norm=l2)
    set_bytes = sum(t.numel() * t.element_size() for t in (first[0].k, first[0].v, first[0].g, first[0].beta))
    sets = first + make_input_sets(shape, rotation_count(set_bytes) - 1, device, seed=4, qk_l2norm=l2)
    problems = [problem_of(x, l2) for x in sets]
    ref = reference(problems[0])
    out = {}
    for variant in WY_VARIANTS:
        launch = plan_wy(problems[0], info, variant)  # every set has the same shape and flags
        errs = check(problems[0], launch, ref, device)
        order = itertools.cycle(problems)

        def call():
            p = next(order)
            return wy_fwd(p.k, p.v, p.g, p.beta, p.chunks, launch)

        ms = median_event_ms(call, iters=iters, warmup=3)
        ok = all(e <= TOL for e in errs)
        say(f"{'PASS' if ok else 'FAIL'} {name}{' l2' if l2 else ''} {variant}: {ms:.3f} ms  "
            f"w={errs[0]:.1e} u={errs[1]:.1e} g={errs[2]:.1e}  ({len(problems)} input sets)")
        out[variant] = (ms, errs)
    del ref, problems, sets, first
    torch.cuda.empty_cache()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=120.0, help="seconds; later shapes are skipped")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    from gdn_dispatch.device import default_probe

    from gdn_dispatch.backends.gluon_common.wy import WY_DEFAULT_VARIANT, WY_VARIANTS

    device = torch.device("cuda")
    info = default_probe().for_torch_device(device)
    say(torch.cuda.get_device_name(), torch.__version__, f"variants {WY_VARIANTS}, default {WY_DEFAULT_VARIANT}")
    rows = []
    for name, l2 in CASES:
        # A case takes about 15 s (first compiles of each variant included).
        if time.time() - T0 > args.budget - 20:
            say(f"SKIP {name}{' l2' if l2 else ''} and later (time budget)")
            break
        try:
            rows.append((f"{name}{'-l2' if l2 else ''}", run_case(name, l2, device, info, args.iters)))
        except Exception as exc:
            traceback.print_exc()
            say(f"FAIL {name}: {type(exc).__name__}: {exc}")
            if "illegal" in str(exc).lower() or "device-side" in str(exc).lower():
                say("device fault: the CUDA context is lost, stopping")
                break
    say(f"\n== wy_fwd median ms (rel. RMS error max of w/u/g_cum, tolerance {TOL:g}); {time.time() - T0:.0f} s")
    say("shape | " + " | ".join(f"{v} ms | {v} err" for v in WY_VARIANTS) + " | "
        + " | ".join(f"smem/{v}" for v in WY_VARIANTS if v != "smem"))
    for name, res in rows:
        cells = []
        for v in WY_VARIANTS:
            ms, errs = res[v]
            cells.append(f"{ms:.3f} | {max(errs):.1e} {'PASS' if max(errs) <= TOL else 'FAIL'}")
        speed = [f"{res['smem'][0] / res[v][0]:.2f}x" for v in WY_VARIANTS if v != "smem"]
        say(f"{name} | " + " | ".join(cells) + " | " + " | ".join(speed))


if __name__ == "__main__":
    main()
