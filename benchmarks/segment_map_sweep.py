"""Context parallelism's pass 1 (the segment maps) alone, in several launch configs.

Usage (a CUDA machine, repository root): ``python benchmarks/segment_map_sweep.py``
(``--quick``: the shipped config and the next best alone); with ``--cpu`` (under
``TRITON_INTERPRET=1``) it runs two configs at a small size to check the script.

Each row is one launch config of triton_generic's ``segment_map_fwd`` (the column block
BC, warps, pipeline stages) or, on a GPU, of the Gluon backends' pass 1
(:mod:`gdn_dispatch.backends.gluon_common.segment_map`: BC, warps, ring slots; rows
"gluon ...") on the segmented calls of the tensor-parallel shards: one sequence of 32768
tokens, K = V = 128, bf16, segments of 2048 tokens (4096 at 8/16), as ``"auto"`` cuts
them. Inputs are seeded random tensors of the shapes ``wu_fwd`` returns (the time does not
depend on their values). "err" is the relative RMS difference of M and N against the
shipped config's (a config that computes something else shows here); the time is GPU µs
per call (a CUDA graph of 10 calls, median of 15 replays); "regs" the registers and spill
bytes per thread of the compiled kernel. Prints a markdown table last.
"""
import sys

import torch

from md_table import print_table
from gdn_dispatch.backends.triton_generic import segment_map
from gdn_dispatch.backends.triton_generic.configs import LaunchConfig
from gdn_dispatch.testing import rel_rms_error

CPU = "--cpu" in sys.argv
DEVICE = "cpu" if CPU else "cuda"
K = V = 128
#: (H, HV, tokens, segment length)
SHAPES = [(1, 2, 256, 128)] if CPU else [(2, 4, 32768, 2048), (4, 8, 32768, 2048), (2, 8, 32768, 2048),
                                           (8, 16, 32768, 4096)]
CONFIGS = [LaunchConfig(num_warps=w, num_stages=s, BK=128, BV=bc)
           for bc, w, s in ([(64, 4, 2), (32, 4, 2)] if CPU else
                            [(64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3), (32, 4, 2), (32, 4, 3), (32, 2, 2),
                             (32, 8, 2), (16, 4, 2), (16, 2, 2), (128, 8, 2), (128, 8, 3)])]
if "--quick" in sys.argv:  # the shipped config and the next best
    CONFIGS = CONFIGS[:1] + CONFIGS[-2:-1]


def compiled_regs() -> dict:
    """(registers, spill bytes) of every compiled pass-1 kernel, by its cache key."""
    out = {}
    for cache in segment_map._segment_map_fwd_kernel.device_caches.values():
        for key, kernel in cache[0].items():
            kernel._init_handles()
            out[key] = (kernel.n_regs, kernel.n_spills)
    return out


def inputs(H: int, HV: int, T: int, strong: bool = False):
    """k, w, u (bf16), g_cum (float32, a chunk-local cumsum of log2 decays), beta (bf16,
    sigmoid) and the offsets. Weak gates (-0.0025 bits a token on average: -10 over 4096
    tokens) forget no suffix of any segment, so the Gluon pass 1's programs walk whole
    segments; ``strong``: the bench's logsigmoid(randn) gates, under which each segment
    forgets all but its last chunk (the Gluon pass 1 stores M as zeros and walks N over
    that chunk)."""
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=DEVICE), dim=-1).bfloat16()
    w = (0.1 * torch.randn(1, T, HV, K, device=DEVICE)).bfloat16()
    u = torch.randn(1, T, HV, V, device=DEVICE).bfloat16()
    if strong:
        g = torch.nn.functional.logsigmoid(torch.randn(1, T // 64, 64, HV, device=DEVICE)) * 1.4426950408889634
    else:
        g = -0.005 * torch.rand(1, T // 64, 64, HV, device=DEVICE)
    g_cum = g.cumsum(2).reshape(1, T, HV).contiguous()
    beta = torch.sigmoid(torch.randn(1, T, HV, device=DEVICE)).bfloat16()
    return k, w, u, g_cum, beta, torch.tensor([0, T], device=DEVICE, dtype=torch.int32)


#: The Gluon pass 1's configs (BC, warps, ring slots; None: its plan's choice).
GLUON_CONFIGS = [(None, None, None), (64, 4, 3), (128, 8, 2), (128, 8, 3)]


def gluon_rows(H: int, HV: int, T: int, L: int, k, w, u, g_cum, beta, cu, want, configs=GLUON_CONFIGS,
               l2: bool = False) -> list:
    """The Gluon pass 1 (:mod:`gdn_dispatch.backends.gluon_common.segment_map`) on the same
    inputs, in each of ``configs``; ``want`` None: strong gates (M zeros, N the last chunk's
    walk; no error column). ``l2``: its qk-l2-norm build (k's norms of 1 given, so the same maps), whose
    bound reads no k."""
    from gdn_dispatch.backends.gluon_common import segment_map as gm
    from gdn_dispatch.backends.gluon_sm90 import ENGINE
    from gdn_dispatch.bench_host import graph_replay_us
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.testing import random_call

    problem = make_problem(**random_call(lengths=[64], H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16),
                           use_qk_l2norm_in_kernel=l2)
    rnorm = torch.ones(T, H, 2, device=DEVICE) if l2 else None
    rows = []
    for block_c, warps, slots in configs:
        launch = gm.plan_segment_map(problem, (9, 0), block_c=block_c, num_warps=warps, slots=slots, engine=ENGINE)
        name = (f"gluon BC {launch.blocks['BC']}, {launch.num_warps} warps, {launch.constexprs['NUM_BUF']} slots"
                f"{' (plan)' if block_c is None else ''}{', strong gates' if want is None else ''}"
                f"{', l2' if l2 else ''}")
        try:
            _, m_hi, m_lo, n = gm.segment_map_fwd(k, w, u, g_cum, beta, cu, L, launch, rnorm=rnorm)
            got = torch.cat([(m_hi.double() + m_lo.double()).flatten(), n.double().flatten()])
            us = graph_replay_us(
                lambda: [gm.segment_map_fwd(k, w, u, g_cum, beta, cu, L, launch, rnorm=rnorm) for _ in range(10)],
                replays=1, windows=15) / 10
            err = "-" if want is None else f"{rel_rms_error(got, want):.1e}"
            rows.append((f"{H}/{HV}", T // L, name, err, f"{us:.1f}", "-"))
        except Exception as exc:
            rows.append((f"{H}/{HV}", T // L, name, "-", f"{type(exc).__name__}: {str(exc)[:60]}", "-"))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    if not CPU:
        from gdn_dispatch.bench_host import graph_replay_us
    torch.manual_seed(0)
    shipped = segment_map.segment_map_config(K, V)
    rows = []
    for H, HV, T, L in SHAPES:
        k, w, u, g_cum, beta, cu = inputs(H, HV, T)
        before = set(compiled_regs())
        _, m_hi, m_lo, n = segment_map.segment_map_fwd(k, w, u, g_cum, cu, L, config=shipped)
        shipped_regs = [f"{r} / {s}" for key, (r, s) in compiled_regs().items() if key not in before]
        want = torch.cat([(m_hi.double() + m_lo.double()).flatten(), n.double().flatten()])
        for cfg in CONFIGS:
            name = f"BC {cfg.BV}, {cfg.num_warps} warps, {cfg.num_stages} stages"
            try:
                before = set(compiled_regs())
                _, m_hi, m_lo, n = segment_map.segment_map_fwd(k, w, u, g_cum, cu, L, config=cfg)
                got = torch.cat([(m_hi.double() + m_lo.double()).flatten(), n.double().flatten()])
                err = rel_rms_error(got, want)
                us = None if CPU else graph_replay_us(
                    lambda: [segment_map.segment_map_fwd(k, w, u, g_cum, cu, L, config=cfg) for _ in range(10)],
                    replays=1, windows=15) / 10
                regs = (shipped_regs if cfg == shipped else
                        [f"{r} / {s}" for key, (r, s) in compiled_regs().items() if key not in before])
                rows.append((f"{H}/{HV}", T // L, name, f"{err:.1e}", "-" if us is None else f"{us:.1f}",
                             regs[0] if regs else "-"))
            except Exception as exc:  # a config that does not compile here is a row, not a stop
                rows.append((f"{H}/{HV}", T // L, name, "-", f"{type(exc).__name__}: {str(exc)[:60]}", "-"))
            print(rows[-1], flush=True)
        if not CPU:
            rows.extend(gluon_rows(H, HV, T, L, k, w, u, g_cum, beta, cu, want))
            strong = inputs(H, HV, T, strong=True)
            rows.extend(gluon_rows(H, HV, T, L, *strong, None, configs=GLUON_CONFIGS[:1]))
            rows.extend(gluon_rows(H, HV, T, L, *strong, None, configs=GLUON_CONFIGS[:1], l2=True))
    print(f"shipped: BC {shipped.BV}, {shipped.num_warps} warps, {shipped.num_stages} stages")
    print_table(["H/HV", "segments", "config", "err", "µs per call", "regs / spill B"], "lrlrrr", rows)


if __name__ == "__main__":
    main()
