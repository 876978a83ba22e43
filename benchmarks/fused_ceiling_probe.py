"""How much faster the one-kernel build of gluon_sm90's fused kernel would run with less on
either partition's chain: a diagnostic, whose outputs are wrong by design (never a build).

    python benchmarks/fused_ceiling_probe.py [--rounds N] [--shapes A,B]   # every variant, N rounds (2)
    python benchmarks/fused_ceiling_probe.py VARIANT [--shapes A,B]        # one variant in this process
    python benchmarks/fused_ceiling_probe.py --build-flag MODULE.NAME=VALUE  # every variant on another build

Variants, each compiled in its own process with one function of the kernel swapped:

* ``base``: as shipped.
* ``no_vn``: the state partition's ``v_new^T = z T_u^T`` product left out (``v_new^T = z``):
  the chain one dependent [V, 64] x [64, 64] product shorter, of the order of what a state
  chain that forms its next ``k S`` ahead (``benchmarks/chain_lookahead_model.py``) takes
  off it (one chunk ahead the update leaves the chain; two ahead the update and the
  ``S [q; k]`` product both do, more than this variant).
* ``light_aux``: the aux partition's chunk inverse left out (T_u from k k^T alone: no A, no
  blocked inverse, no copy of A, no range check), its loads, k k^T, gate cumsum, stores
  and barriers kept: the state's pace with the aux nearly free.
* ``no_vn+light_aux``: both.

Shapes: H16-HV32 4 x 8192 and the ragged16 mix (bf16, K = V = 128, initial + final state),
timed as ``flag_ab.py`` times them (public call and kernel medians). ``--build-flag
MODULE.NAME=VALUE`` (repeatable, :func:`gdn_dispatch.testing.set_build_flags`): every variant
on a build not shipped (its ``light_aux`` row is then that build's pace with the aux nearly
free).
"""
import argparse
import subprocess
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma

from ab_timing import run_variant
from flag_ab import STUDIES, calls
from gdn_dispatch.backends.gluon_common.wy import chunk_kk_and_cumsum
from gdn_dispatch.backends.gluon_sm90 import fused
from gdn_dispatch.backends.gluon_sm90.fused import _chain_products_done, _v_new_operand, wgmma_layout

VARIANTS = ("base", "no_vn", "light_aux", "no_vn+light_aux")
SHAPES = ("H16-HV32-4x8192", "H16-HV32-ragged16")


@gluon.jit
def v_new_without_product(p, o1, v_slot, v_bar, t_slot, e_g_slot, phase, acc_c: gl.constexpr, k_tile, q_tile,
                          WIDE: gl.constexpr = False):
    """``fused._v_new_then_scores`` with ``v_new^T = z`` (``no_vn``)."""
    BT: gl.constexpr = v_slot.shape[0]
    acc_bt: gl.constexpr = wgmma_layout(BT, BT, gl.num_warps())
    p, o1 = _chain_products_done(p, o1, acc_c, WIDE)
    z = _v_new_operand(p, v_slot, v_bar, e_g_slot, phase, acc_c, False)
    vn = gl.convert_layout(z, acc_c).to(gl.float32)
    qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_bt),
                       use_acc=False, is_async=True)
    return vn, o1, qk


@gluon.jit
def t_u_without_inverse(k_smem, beta, s_beta, row0, n_valid, i_h, g_raw, b_raw, tables, kk_bar,
                        KK_PHASE: gl.constexpr, USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr, r_k=None,
                        a_save=None, vectors=None, vector_row=0, LATE_CHECK: gl.constexpr = False):
    """``wy.chunk_t_u_on_chip`` with ``T_u = k k^T / 1000`` (``light_aux``): its first steps
    (:func:`~gdn_dispatch.backends.gluon_common.wy.chunk_kk_and_cumsum`) and nothing after."""
    kk, c = chunk_kk_and_cumsum(k_smem, g_raw, b_raw, kk_bar, KK_PHASE, ENGINE, vectors, vector_row)
    return kk * 0.001, c, c


def swap(variant: str) -> None:
    """Put ``variant``'s functions in the fused kernel's module (before its first compile)."""
    if "no_vn" in variant:
        fused._v_new_then_scores = v_new_without_product
    if "light_aux" in variant:
        fused.chunk_t_u_on_chip = t_u_without_inverse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variant", nargs="?", choices=VARIANTS, help="run this variant in this process")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--build-flag", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="every variant on this build flag (repeatable)")
    args = parser.parse_args()
    picked = args.shapes.split(",")
    if set(picked) - set(SHAPES):
        parser.error(f"--shapes: {sorted(set(picked) - set(SHAPES))} not among {SHAPES}")
    shapes = {name: STUDIES["wide_kq"][3][name] for name in picked}
    if args.variant:
        from gdn_dispatch.testing import set_build_flags

        set_build_flags(args.build_flag)
        swap(args.variant)
        run_variant("ceiling", args.variant, calls(shapes))
        return
    print("| variant | shape | call ms | enqueue µs | kernels ms |", flush=True)
    flags = [arg for setting in args.build_flag for arg in ("--build-flag", setting)]
    for _ in range(args.rounds):
        for variant in VARIANTS:
            run = subprocess.run([sys.executable, __file__, variant, "--shapes", args.shapes] + flags,
                                 stderr=subprocess.PIPE, text=True)
            if run.returncode:
                sys.exit(f"{variant} failed:\n" + "\n".join(run.stderr.splitlines()[-25:]))


if __name__ == "__main__":
    main()
