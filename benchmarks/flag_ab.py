"""A/B of one kernel flag, off against on, each in its own process, alternating (a
kernel's constexpr globals are fixed at its first compile).

    python benchmarks/flag_ab.py t_inverse   # wy_t.WY_T_BLOCKED_INVERSE: T's inverse in 16 x 16 blocks
    python benchmarks/flag_ab.py wy_inverse  # wy.WY_DEFAULT_VARIANT "regs" -> "blocked"
    python benchmarks/flag_ab.py split_wu    # wy.WY_SPLIT_WU: w and u in [64, 64] blocks
    python benchmarks/flag_ab.py v_slots --with t_pair  # fused.V_SLOTS 1 -> 2: v loaded a chunk earlier (T_w and T_u:
                                             # with T_u alone the state refills v itself, in two slots)
    python benchmarks/flag_ab.py early_rows  # wy.WY_EARLY_ROWS: gate / beta rows loaded before k lands
    python benchmarks/flag_ab.py t_u_chain   # wy_t.WY_T_SINGLE_TILE: T_u alone, v_new = T_u (v - 2^g k S)
    python benchmarks/flag_ab.py t_pair      # the same flag on -> off: T_w and T_u, w and u formed in the aux partition
    python benchmarks/flag_ab.py t_regs      # wy_t.WY_T_MAXNREG_SM90 128 -> 96: five T programs per SM
    python benchmarks/flag_ab.py aux_regs    # fused.AUX_REGS 120 -> 96: the state's warpgroups 192 -> 200
    python benchmarks/flag_ab.py qk_norm_on_chip  # fused.QK_NORM_ON_CHIP: no normalized copies of q, k
    python benchmarks/flag_ab.py qk_norm_group  # fused.QK_NORM_ON_CHIP_MAX_GROUP 2 -> 4
    python benchmarks/flag_ab.py t_block_tma  # wy_t.WY_T_BLOCK_TMA: T_u in 16 x 16 TMA boxes
    python benchmarks/flag_ab.py bf16_maps    # segment_map.BF16_MAPS: the scan on bf16 parts of M
    python benchmarks/flag_ab.py ring_slots   # state_output.RING_SLOTS_MAX 2 -> 3: loads two chunks ahead
    python benchmarks/flag_ab.py state_output_ws  # state_output.STATE_OUTPUT_WS: chain and output warpgroups
    python benchmarks/flag_ab.py ws_outputs   # state_output_ws.OUTPUT_PARTITIONS 1 -> 2: alternate chunks
    python benchmarks/flag_ab.py ws_hv_slots  # state_output_ws.HV_SLOTS_MAX 2 -> 3: the chain three chunks ahead
    python benchmarks/flag_ab.py load_warp    # fused.LOAD_WARP: a load warp refills the fused kernel's slots
    python benchmarks/flag_ab.py aux_t        # fused.AUX_T: the inverses in the aux partition, one launch
    python benchmarks/flag_ab.py small_heads  # fused.SMALL_HEADS: K or V of 64 on the path, not the pipeline
    python benchmarks/flag_ab.py early_o1     # fused.EARLY_O1: S_old q^T issued with P^T; wgmma not serialized
    python benchmarks/flag_ab.py state_scores  # fused.STATE_SCORES: q k^T in the state, not the aux (under aux_t)
    python benchmarks/flag_ab.py f16_inverse  # blocked_inverse.F16_OPERANDS: the inverse's products on fp16
    python benchmarks/flag_ab.py half_tables  # blocked_inverse.HALF_TABLES: fp16 tables, ldmatrix (fp16 products)
    python benchmarks/flag_ab.py diagonal_series  # blocked_inverse.DIAGONAL_SERIES: 9 dependent products, not 10
    python benchmarks/flag_ab.py shared_row_vectors  # wy.SHARED_ROW_VECTORS: the aux's row vectors through shared
                                             # memory, one barrier instead of six layout converts
    python benchmarks/flag_ab.py scores_behind_v_new  # fused.SCORES_BEHIND_V_NEW: the state's q k^T off its chain
    python benchmarks/flag_ab.py aux_ring_slots  # fused.AUX_RING_SLOTS 2 -> 3: the aux two chunks ahead
    python benchmarks/flag_ab.py swizzled_redo_buffer  # blocked_inverse.SWIZZLED_REDO_BUFFER: A's copy for the
                                             # fp16 inverse's redo without bank conflicts
    python benchmarks/flag_ab.py padded_redo_buffer  # blocked_inverse.PADDED_REDO_BUFFER: the same buffer's
                                             # rows padded where it is not swizzled (qk l2 norm on chip;
                                             # every build --without swizzled_redo_buffer)
    python benchmarks/flag_ab.py late_range_check  # blocked_inverse.LATE_RANGE_CHECK: the fp16 range check's
                                             # reduction across the warps behind the gate vectors' barrier
    python benchmarks/flag_ab.py fp16_inverse  # f16_inverse, half_tables and diagonal_series together (GROUPS):
                                             # the inverse on fp16 as shipped against tf32

Public calls, bf16, K = V = 128 (unless a shape names its own), initial + final state, on the shapes the flag changes:
call time and per-kernel GPU time (:mod:`ab_timing`); outputs compared between the two.
``--shapes NAME[,NAME...]`` times those of the study's shapes alone.
Every other flag keeps its default in both arms: the studies of the one-kernel build
(``aux_t``, ``state_scores``, ``f16_inverse``, ``half_tables``, ``diagonal_series``,
``shared_row_vectors``, ``scores_behind_v_new``, ``aux_ring_slots``,
``swizzled_redo_buffer``, ``padded_redo_buffer``, ``late_range_check``) measure a flag on
top of the others as shipped. ``--with OTHER[,OTHER...]`` turns other studies' flags on in
both arms (a flag measured on top of another one not shipped), e.g. ``python
benchmarks/flag_ab.py v_slots --with t_pair``; ``--without OTHER[,OTHER...]`` turns them off
in both arms (a flag measured on top of a build without another), e.g. ``python
benchmarks/flag_ab.py aux_t --without f16_inverse,half_tables,diagonal_series``: the chunk
inverses in the fused kernel or in the T kernel, both on tf32 products. The studies of the
two-launch build (:data:`TWO_LAUNCH_STUDIES`) add ``--without aux_t`` themselves.
"""
import argparse
import importlib
import subprocess
import sys

import torch
from triton.experimental.gluon import language as gl

from ab_timing import compare_outputs, run_variant

#: The w/u kernel's calls: the pipeline's (fewer programs than the warp-specialized path
#: takes) and context parallelism's first pass.
_WY_SHAPES = {
    "H16-HV32-1x8192": (16, 32, [8192], False), "H16-HV32-1x32768": (16, 32, [32768], False),
    "H16-HV64-1x8192": (16, 64, [8192], False), "H2-HV4-1x32768": (2, 4, [32768], False),
    "H8-HV16-1x32768": (8, 16, [32768], False)}

#: The warp-specialized path's calls.
_WS_SHAPES = {
    "H16-HV32-4x8192": (16, 32, (4, 8192), False), "H16-HV32-8x4096": (16, 32, (8, 4096), False),
    "H16-HV32-ragged16": (16, 32, "ragged16", False), "H16-HV64-4x8192": (16, 64, (4, 8192), False),
    "H16-HV32-4x8192-l2": (16, 32, (4, 8192), True)}

#: The one-kernel build's aux partition (the chunk inverses) at a uniform batch, the ragged
#: mix, HV 64 and with the qk l2 norm on chip.
_ONE_KERNEL_SHAPES = {name: _WS_SHAPES[name] for name in ("H16-HV32-4x8192", "H16-HV32-ragged16", "H16-HV64-4x8192",
                                                          "H16-HV32-4x8192-l2")}

#: The blocked chunk inverse's calls: the path's (the T kernel, or the fused kernel's aux
#: partition in the one-kernel build) and the w/u kernel's.
_INVERSE_SHAPES = {**_ONE_KERNEL_SHAPES, **_WY_SHAPES}

#: study -> (module, flag, (off value, on value), shapes: name -> (H, HV, lengths or (B, T),
#: qk l2 norm[, K, V])).
STUDIES = {
    "t_inverse": ("gdn_dispatch.backends.gluon_common.wy_t", "WY_T_BLOCKED_INVERSE", (False, True), {
        "H16-HV32-4x8192": (16, 32, (4, 8192), False), "H16-HV32-ragged16": (16, 32, "ragged16", False)}),
    "wy_inverse": ("gdn_dispatch.backends.gluon_common.wy", "WY_DEFAULT_VARIANT", ("regs", "blocked"), _WY_SHAPES),
    "split_wu": ("gdn_dispatch.backends.gluon_common.wy", "WY_SPLIT_WU", (False, True), _WY_SHAPES),
    "v_slots": ("gdn_dispatch.backends.gluon_sm90.fused", "V_SLOTS", (1, 2), _WS_SHAPES),
    # Both kernels that form T: the warp-specialized path's T kernel and the pipeline's w/u kernel.
    "early_rows": ("gdn_dispatch.backends.gluon_common.wy", "WY_EARLY_ROWS", (False, True), {
        **{name: _WS_SHAPES[name] for name in ("H16-HV32-4x8192", "H16-HV32-ragged16")},
        **{name: _WY_SHAPES[name] for name in ("H16-HV32-1x8192", "H16-HV32-1x32768", "H2-HV4-1x32768")}}),
    "t_u_chain": ("gdn_dispatch.backends.gluon_common.wy_t", "WY_T_SINGLE_TILE", (False, True), _WS_SHAPES),
    # The same flag the other way: for --with (the builds that need T_w and T_u: one v slot).
    "t_pair": ("gdn_dispatch.backends.gluon_common.wy_t", "WY_T_SINGLE_TILE", (True, False), _WS_SHAPES),
    # The T kernel's register cap: four programs per SM at 128, five at 96.
    "t_regs": ("gdn_dispatch.backends.gluon_common.wy_t", "WY_T_MAXNREG_SM90", (128, 96), {
        name: _WS_SHAPES[name] for name in ("H16-HV32-4x8192", "H16-HV32-ragged16")}),
    # The fused kernel's aux warpgroup, light with T_u alone: 120 -> 96 registers, the state's
    # two warpgroups 192 -> 200 (spill bytes 12-20 -> 12-16 with triton 3.6.0).
    "aux_regs": ("gdn_dispatch.backends.gluon_sm90.fused", "AUX_REGS", (gl.constexpr(120), gl.constexpr(96)),
                 {name: _WS_SHAPES[name] for name in ("H16-HV32-4x8192", "H16-HV32-ragged16", "H16-HV64-4x8192")}),
    # The qk l2 norm folded into the path's two kernels instead of normalized copies (groups
    # of up to fused.QK_NORM_ON_CHIP_MAX_GROUP v-heads).
    "qk_norm_on_chip": ("gdn_dispatch.backends.gluon_sm90.fused", "QK_NORM_ON_CHIP", (False, True), {
        "H16-HV32-4x8192-l2": (16, 32, (4, 8192), True), "H16-HV32-ragged16-l2": (16, 32, "ragged16", True)}),
    # The group up to which the norm is folded in: 2 -> 4 (H16-HV64 too).
    "qk_norm_group": ("gdn_dispatch.backends.gluon_sm90.fused", "QK_NORM_ON_CHIP_MAX_GROUP", (2, 4), {
        "H16-HV64-4x8192-l2": (16, 64, (4, 8192), True)}),
    # With T_u alone (wy_t.WY_T_SINGLE_TILE, the default); only the T kernel changes.
    "t_block_tma": ("gdn_dispatch.backends.gluon_common.wy_t", "WY_T_BLOCK_TMA", (False, True), {
        name: _WS_SHAPES[name] for name in ("H16-HV32-4x8192", "H16-HV32-ragged16", "H16-HV64-4x8192")}),
    # Context parallelism's maps stored as two bf16 parts: pass 1 and the scan change (the
    # segmented calls of the tensor-parallel shards).
    "bf16_maps": ("gdn_dispatch.backends.triton_generic.segment_map", "BF16_MAPS", (False, True), {
        "H2-HV4-1x32768": (2, 4, [32768], False), "H4-HV8-1x32768": (4, 8, [32768], False),
        "H8-HV16-1x32768": (8, 16, [32768], False)}),
    # The state-output kernel's load rings up to 3 slots where they fit (chunk t + 2's tiles
    # issued at chunk t): context parallelism's pass 2 at the tensor-parallel shards, and a
    # pipeline call on that kernel.
    "ring_slots": ("gdn_dispatch.backends.gluon_common.state_output", "RING_SLOTS_MAX", (2, 3), {
        "H2-HV4-1x32768": (2, 4, [32768], False), "H4-HV8-1x32768": (4, 8, [32768], False),
        "H2-HV8-1x32768": (2, 8, [32768], False), "H8-HV16-1x32768": (8, 16, [32768], False),
        "H16-HV64-1x8192": (16, 64, [8192], False)}),
    # The state-output kernel's walk warp-specialized (the chain in one warpgroup, the output
    # in another): the pipeline's calls (BV = 32 and 64) and context parallelism's pass 2.
    "state_output_ws": ("gdn_dispatch.backends.gluon_common.state_output", "STATE_OUTPUT_WS", (False, True), {
        **_WY_SHAPES, "H4-HV8-1x32768": (4, 8, [32768], False), "H16-HV32-1x32768-l2": (16, 32, [32768], True)}),
    # The warp-specialized walk's output work in two partitions taking alternate chunks.
    "ws_outputs": ("gdn_dispatch.backends.gluon_common.state_output_ws", "OUTPUT_PARTITIONS",
                   (gl.constexpr(1), gl.constexpr(2)), {
                       name: _WY_SHAPES[name] for name in ("H16-HV32-1x8192", "H16-HV32-1x32768", "H16-HV64-1x8192",
                                                           "H2-HV4-1x32768")}),
    # The fused kernel's slots refilled by a warp of their own instead of the state partition.
    "load_warp": ("gdn_dispatch.backends.gluon_sm90.fused", "LOAD_WARP", (gl.constexpr(False), gl.constexpr(True)),
                  {name: _WS_SHAPES[name] for name in ("H16-HV32-4x8192", "H16-HV32-ragged16", "H16-HV64-4x8192")}),
    # The chunk inverses formed in the fused kernel's aux partition: no T kernel, one launch
    # (the qk l2 norm on chip at HV 32; at HV 64 its normalized copies come first).
    "aux_t": ("gdn_dispatch.backends.gluon_sm90.fused", "AUX_T", (False, True), {
        **_WS_SHAPES, "H16-HV64-4x8192-l2": (16, 64, (4, 8192), True)}),
    # Under aux_t: the causal scores formed by the state partition, not the aux.
    "state_scores": ("gdn_dispatch.backends.gluon_sm90.fused", "STATE_SCORES", (False, True), _ONE_KERNEL_SHAPES),
    # The chunk inverse's block products on fp16 operands, not tf32: the fused kernel's aux
    # partition (with --without aux_t: the T kernel), and the w/u kernel of the pipeline's
    # calls and of context parallelism's segmented ones (the 1 x 32768 shards).
    "f16_inverse": ("gdn_dispatch.backends.gluon_common.blocked_inverse", "F16_OPERANDS",
                    (gl.constexpr(False), gl.constexpr(True)), _INVERSE_SHAPES),
    # The inverse's tables in fp16: each warp's shifted read one ldmatrix (the same shapes).
    "half_tables": ("gdn_dispatch.backends.gluon_common.blocked_inverse", "HALF_TABLES",
                    (gl.constexpr(False), gl.constexpr(True)), _INVERSE_SHAPES),
    # The diagonal blocks' inverses by a series in 4 x 4 blocks: nine dependent products, not ten.
    "diagonal_series": ("gdn_dispatch.backends.gluon_common.blocked_inverse", "DIAGONAL_SERIES",
                        (gl.constexpr(False), gl.constexpr(True)), _INVERSE_SHAPES),
    # The one-kernel build's gate cumsum and beta read in each layout from shared memory
    # instead of converted between layouts (the aux partition's chain: 13 barriers fewer).
    "shared_row_vectors": ("gdn_dispatch.backends.gluon_common.wy", "SHARED_ROW_VECTORS",
                           (gl.constexpr(False), gl.constexpr(True)), _ONE_KERNEL_SHAPES),
    # The state's causal scores issued behind v_new^T's product, stored while the update runs.
    "scores_behind_v_new": ("gdn_dispatch.backends.gluon_sm90.fused", "SCORES_BEHIND_V_NEW",
                            (gl.constexpr(False), gl.constexpr(True)), _ONE_KERNEL_SHAPES),
    # The one-kernel build's A kept for the fp16 inverse's redo in a swizzled buffer.
    "swizzled_redo_buffer": ("gdn_dispatch.backends.gluon_common.blocked_inverse", "SWIZZLED_REDO_BUFFER",
                             (gl.constexpr(False), gl.constexpr(True)), _ONE_KERNEL_SHAPES),
    # The same buffer's rows padded instead (the qk l2 norm's build too).
    "padded_redo_buffer": ("gdn_dispatch.backends.gluon_common.blocked_inverse", "PADDED_REDO_BUFFER",
                           (gl.constexpr(False), gl.constexpr(True)), _ONE_KERNEL_SHAPES),
    # The warp-specialized walk's chain three chunks ahead of the output partitions (BV = 32;
    # at BV = 64 the ring's two slots keep two, a control).
    "ws_hv_slots": ("gdn_dispatch.backends.gluon_common.state_output_ws", "HV_SLOTS_MAX",
                    (gl.constexpr(2), gl.constexpr(3)), {
                        name: _WY_SHAPES[name] for name in ("H16-HV32-1x8192", "H16-HV32-1x32768", "H16-HV64-1x8192")}),
    # The fp16 inverse's range check decided after the gate vectors' barrier.
    "late_range_check": ("gdn_dispatch.backends.gluon_common.blocked_inverse", "LATE_RANGE_CHECK",
                         (gl.constexpr(False), gl.constexpr(True)), _ONE_KERNEL_SHAPES),
    # The one-kernel build's k/q, T_u and gate rings in three slots: the aux two chunks ahead.
    "aux_ring_slots": ("gdn_dispatch.backends.gluon_sm90.fused", "AUX_RING_SLOTS",
                       (gl.constexpr(2), gl.constexpr(3)), _ONE_KERNEL_SHAPES),
    # The state's causal mask of its scores formed in each chunk from its valid rows.
    "scores_mask_in_loop": ("gdn_dispatch.backends.gluon_sm90.fused", "SCORES_MASK_IN_LOOP",
                            (gl.constexpr(False), gl.constexpr(True)), _ONE_KERNEL_SHAPES),
    # The state's P^T and S_old^T q^T as one product of k's and q's rows together.
    "wide_kq": ("gdn_dispatch.backends.gluon_sm90.fused", "WIDE_KQ",
                (gl.constexpr(False), gl.constexpr(True)), _ONE_KERNEL_SHAPES),
    # The one-kernel build's fp16 redo from A formed again instead of A kept in shared memory.
    "redo_forms_a": ("gdn_dispatch.backends.gluon_sm90.fused", "AUX_KEEPS_A", (gl.constexpr(True), gl.constexpr(False)),
                     _ONE_KERNEL_SHAPES),
    # The fused kernel's state chain in the order ptxas keeps pipelined (the other order's
    # register peak makes it serialize every wgmma of the kernel).
    "early_o1": ("gdn_dispatch.backends.gluon_sm90.fused", "EARLY_O1", (False, True), _WS_SHAPES),
    # Head dims of 64 on the path instead of the pipeline (calls that fill the SMs).
    "small_heads": ("gdn_dispatch.backends.gluon_sm90.fused", "SMALL_HEADS", (False, True), {
        "H16-HV32-4x8192-K64-V64": (16, 32, (4, 8192), False, 64, 64),
        "H16-HV32-4x8192-K64-V128": (16, 32, (4, 8192), False, 64, 128),
        "H16-HV32-4x8192-K128-V64": (16, 32, (4, 8192), False, 128, 64),
        "H16-HV32-ragged16-K64-V64": (16, 32, "ragged16", False, 64, 64)}),
}


#: Studies of the path's two-launch build (the T kernel's inverse, rows, stores, register
#: cap and tiles, the load warp, and the fused kernel's chain order and aux registers as
#: they were measured there): they run with ``aux_t`` off in both arms unless ``--with
#: aux_t`` (with the chunk inverses in the fused kernel, as shipped, the T kernel's flags
#: change nothing on the path's shapes).
TWO_LAUNCH_STUDIES = {"t_inverse", "early_rows", "t_u_chain", "t_pair", "t_regs", "t_block_tma", "load_warp",
                      "early_o1", "aux_regs"}


def calls(shapes: dict) -> dict:
    from gdn_dispatch.bench_shapes import ragged_lengths
    from gdn_dispatch.testing import random_call

    out = {}
    for name, (H, HV, tokens, l2, *dims) in shapes.items():
        K, V = dims or (128, 128)
        shape = (dict(lengths=list(ragged_lengths())) if tokens == "ragged16" else
                 dict(batch=tokens) if isinstance(tokens, tuple) else dict(lengths=tokens))
        out[name] = random_call(**shape, H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, device="cuda", seed=3,
                                normalize_qk=not l2)
        out[name]["output_final_state"] = True
        out[name]["use_qk_l2norm_in_kernel"] = l2
    return out


#: Studies turned off and on together, by name: a group times its members' flags at once
#: (on its first member's shapes), e.g. the blocked inverse's three fp16 flags.
GROUPS = {"fp16_inverse": ("f16_inverse", "half_tables", "diagonal_series")}


def members(study: str) -> tuple[str, ...]:
    """The studies whose flags ``study`` (a study or a group) turns."""
    return GROUPS.get(study, (study,))


def repeated(studies: list[str]) -> list[str]:
    """The member studies that more than one of ``studies`` (studies or groups) turns."""
    named = [member for name in studies for member in members(name)]
    return sorted(name for name in set(named) if named.count(name) > 1)


def study_shapes(study: str) -> dict:
    return STUDIES[members(study)[0]][3]


def study_label(study: str) -> str:
    return " + ".join(STUDIES[name][1] for name in members(study))


def set_flag(study: str, arm: str) -> None:
    for name in members(study):
        module, flag, values, _ = STUDIES[name]
        setattr(importlib.import_module(module), flag, values[arm == "on"])


def shipped_on(study: str) -> bool:
    """Whether the study's flags hold their on values as shipped."""
    for name in members(study):
        module, flag, values, _ = STUDIES[name]
        shipped = getattr(importlib.import_module(module), flag)
        if getattr(shipped, "value", shipped) != getattr(values[1], "value", values[1]):
            return False
    return True


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", choices=sorted(STUDIES) + sorted(GROUPS))
    parser.add_argument("arm", nargs="?", choices=("off", "on"), help="run one arm in this process")
    parser.add_argument("--with", dest="also", default="", help="studies whose flags are on in both arms")
    parser.add_argument("--without", default="", help="studies whose flags are off in both arms")
    parser.add_argument("--shapes", default="", help="comma-separated: time these of the study's shapes only")
    args = parser.parse_args()
    also = [name for name in args.also.split(",") if name]
    without = [name for name in args.without.split(",") if name]
    for option, names in (("--with", also), ("--without", without)):
        for name in names:
            if name not in STUDIES and name not in GROUPS or set(members(name)) & set(members(args.study)):
                parser.error(f"{option}: {name!r} is not another study")
    if repeated(also + without):
        parser.error(f"--with / --without name a flag twice: {repeated(also + without)}")
    if set(also) & set(without):
        parser.error(f"--with and --without both name {sorted(set(also) & set(without))}")
    if args.study in TWO_LAUNCH_STUDIES and "aux_t" not in also + without:
        without.append("aux_t")
    f16_products = "f16_inverse" in [args.study] + also or (shipped_on("f16_inverse") and "f16_inverse" not in without)
    if "half_tables" in [args.study] + also and not f16_products:
        parser.error("half_tables: the fp16 tables need the fp16 products (f16_inverse on in both arms)")
    flag, shapes = study_label(args.study), study_shapes(args.study)
    if args.shapes:
        picked = args.shapes.split(",")
        unknown = [name for name in picked if name not in shapes]
        if unknown:
            parser.error(f"--shapes: {unknown} not among {args.study}'s shapes {sorted(shapes)}")
        shapes = {name: shapes[name] for name in picked}
    tag = "_".join([args.study] + also + [f"no_{name}" for name in without])
    if args.arm:
        for name in also:
            set_flag(name, "on")
        for name in without:
            set_flag(name, "off")
        set_flag(args.study, args.arm)
        run_variant(f"flag_ab_{tag}", args.arm, calls(shapes))
        sys.exit(0)
    print(f"| {flag}{' (with ' + ', '.join(also) + ' on)' if also else ''}"
          f"{' (with ' + ', '.join(without) + ' off)' if without else ''} | shape | call ms | enqueue µs | kernels ms |")
    for arm in ("off", "on", "off", "on"):
        run = subprocess.run([sys.executable, __file__, args.study, arm] + (["--with", args.also] if also else [])
                             + (["--without", ",".join(without)] if without else [])
                             + (["--shapes", args.shapes] if args.shapes else []), stderr=subprocess.PIPE, text=True)
        if run.returncode:
            sys.exit(f"the {arm} arm failed:\n" + "\n".join(run.stderr.splitlines()[-25:]))
    compare_outputs(f"flag_ab_{tag}", list(shapes), "off", "on")
