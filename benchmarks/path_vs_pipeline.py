"""gluon_sm90's warp-specialized path against its two-launch pipeline: public calls in one
process, each shape timed on both (the plan's threshold ``fused.MIN_SM_SHARE`` moved to
force each, and ``fused.QK_L2NORM`` held on whatever its default, so that ``--qk-l2norm``
calls take the path when forced).

Usage (an sm_90 GPU, repository root): ``python benchmarks/path_vs_pipeline.py [--qk-l2norm]
[--t-kernel] [--shapes N]`` (the first N shapes; the path as shipped is one launch forming
the chunk inverses itself, ``fused.AUX_T``; ``--t-kernel``: the path with the T kernel
forming them in a launch of its own, ``fused.AUX_T`` off; the shapes with 64 and 32
(sequence, v-head) programs, at 8192 tokens and at 32768, are there for the crossover the
one launch moves). Inputs: ``testing.random_call(seed=1)``, bf16, H = 16, K = V = 128,
initial and final state, context parallelism off; varlen shapes with a host copy of
cu_seqlens. Times: ``triton.testing.do_bench`` medians (L2 flushed between calls), host
time included. Each shape first checks that the plan takes the path when forced.
"""
import argparse

from triton.testing import do_bench

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import default_probe
from gdn_dispatch.testing import random_call
from gdn_dispatch.backends import gluon_sm90
from gdn_dispatch.backends.gluon_common.forward import plan_call
from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
from gdn_dispatch.backends.gluon_sm90 import fused

SHAPES = [
    ("H16-HV32-4x8192", dict(batch=(4, 8192), HV=32)),
    ("H16-HV32-8x4096", dict(batch=(8, 4096), HV=32)),
    ("H16-HV64-4x8192", dict(batch=(4, 8192), HV=64)),
    ("H16-HV64-1x8192", dict(batch=(1, 8192), HV=64)),
    ("H16-HV32-16ragged", dict(lengths=[8, 7826, 3000, 5000, 2048, 4096, 100, 7000, 1500, 6000, 2500, 3500, 4500,
                                        900, 5500, 4000], HV=32)),
    ("H16-HV32-2x8192", dict(batch=(2, 8192), HV=32)),
    ("H16-HV32-1x8192", dict(batch=(1, 8192), HV=32)),
    # One long prompt on 32 and 64 (sequence, v-head) programs: the chain of 512 chunks,
    # where the pipeline splits V into blocks and the path does not.
    ("H16-HV32-1x32768", dict(batch=(1, 32768), HV=32)),
    ("H16-HV64-1x32768", dict(batch=(1, 32768), HV=64)),
]


def timed(kwargs: dict, share: float) -> tuple[float, bool]:
    """(ms, whether the plan took the path, and on it formed the inverses in the fused
    kernel exactly when ``fused.AUX_T`` asks) with ``fused.MIN_SM_SHARE = share``."""
    fused.MIN_SM_SHARE = share
    clear_plan_cache()
    problem = make_problem(**kwargs)
    launches = plan_call(problem, default_probe().for_torch_device(problem.device), engine=gluon_sm90.ENGINE).launches
    on_path = launches.fused and launches.inverses_on_chip == fused.AUX_T
    return do_bench(lambda: chunk_gated_delta_rule(**kwargs, backend="gluon_sm90"), warmup=5, rep=60), on_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qk-l2norm", action="store_true", help="raw q and k, use_qk_l2norm_in_kernel=True")
    parser.add_argument("--t-kernel", action="store_true", help="the path with fused.AUX_T off (two launches)")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="time the first N shapes")
    args = parser.parse_args()
    share, l2_switch, aux_t = fused.MIN_SM_SHARE, fused.QK_L2NORM, fused.AUX_T
    fused.QK_L2NORM = True
    fused.AUX_T = aux_t and not args.t_kernel
    try:
        for name, shape in SHAPES[:args.shapes]:
            call = random_call(**shape, H=16, K=128, V=128, device="cuda", seed=1, normalize_qk=not args.qk_l2norm)
            # Unsegmented: context parallelism would keep both arms on the pipeline's kernels.
            kwargs = {**call, "output_final_state": True, "use_qk_l2norm_in_kernel": args.qk_l2norm,
                      "context_parallel": "off"}
            t_path, on_path = timed(kwargs, 0.0)
            t_pipe, off_path = timed(kwargs, 1e9)
            assert on_path and not off_path, name

            print(f"{name:20s} path {t_path:.3f} ms   pipeline {t_pipe:.3f} ms   ratio {t_path / t_pipe:.2f}", flush=True)
    finally:
        fused.MIN_SM_SHARE, fused.QK_L2NORM, fused.AUX_T = share, l2_switch, aux_t
        clear_plan_cache()


if __name__ == "__main__":
    main()
