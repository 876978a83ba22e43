"""What :func:`gdn_dispatch.aot` compiles for this backend: every kernel at the
specializations a Qwen3-Next/Qwen3.5 layer launches (bf16, K = V = 128, 16 q/k heads and
32 value heads, l2-norm fused), the state kernel in both layouts and at both V slice
widths, and an fp16 build at K = 100, V = 60 so that the masked (non-power-of-two) paths
compile too. float32 calls are a correctness path (3xTF32 products): their kernels
compile and run but spill registers, so they are not in this list.
"""

from __future__ import annotations

import torch

from gdn_dispatch.aot import AotKernel

from gdn_dispatch.backends.triton_generic.configs import fuse_solve_into_wu, intra_config, output_config, state_config
from gdn_dispatch.backends.triton_generic.kkt_solve import _kkt_solve_fwd_kernel
from gdn_dispatch.backends.triton_generic.output import _output_fwd_kernel
from gdn_dispatch.backends.triton_generic.segment_map import (
    FORGETTING_CONFIG, MAP_NEGLIGIBLE_LOG2, _forgetting_start_kernel, _segment_map_fwd_kernel, l2_prefetch_chunks,
    maps_dtype, segment_map_config)
from gdn_dispatch.backends.triton_generic.segment_chain import _chained_state_fwd_kernel
from gdn_dispatch.backends.triton_generic.segment_scan import (
    _segment_scan_fwd_kernel, scan_block_kc, segment_scan_config)
from gdn_dispatch.backends.triton_generic.state import _state_fwd_kernel
from gdn_dispatch.backends.triton_generic.wu import _wu_fwd_kernel

BACKEND = "triton_generic"
_TYPES = {"bf16": ("*bf16", 2, "tf32"), "fp16": ("*fp16", 2, "tf32"), "fp32": ("*fp32", 4, "tf32x3")}


def _kernel(name, spec, fn, pointers, constexprs, cfg) -> AotKernel:
    signature = {**pointers, **{key: "constexpr" for key in constexprs}}
    # A launch specializes 16-byte-aligned pointers (every torch allocation is); without the
    # hint the compiler must assume unaligned rows and loses vectorized loads.
    attrs = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]]
             for arg, kind in pointers.items() if kind.startswith("*")}
    return AotKernel(backend=BACKEND, kernel=name, specialization=spec, fn=fn, signature=signature,
                     constexprs=constexprs, dialect="triton", num_warps=cfg.num_warps,
                     num_stages=cfg.num_stages, attrs=attrs)


def _stage_kernels(dtype: str, H: int, HV: int, K: int, V: int, l2: bool, capability) -> list[AotKernel]:
    ptr, elem, prec = _TYPES[dtype]
    interp_bf16 = False
    tag = f"H{H}-HV{HV}-K{K}-V{V}-{dtype}" + ("-l2" if l2 else "")
    out = []
    cfg = intra_config(K, V, elem, capability)
    # The kernel forming T forms the gate cumsum too (the forward launches no cumsum kernel):
    # the w/u kernel where it forms T, else kkt_solve.
    fused = fuse_solve_into_wu(capability)
    qk = {"k": ptr, "g": "*fp32", "g_cum": "*fp32", "beta": "*fp32"}
    out.append(_kernel("kkt_solve_fwd", tag, _kkt_solve_fwd_kernel,
                       {**qk, "A_inv": ptr, "cu_seqlens": "*i32", "N": "i32"},
                       {"s_k": H * K, "s_g": HV, "s_b": HV, "H": H, "HV": HV, "K": K, "BT": 64, "BK": cfg.BK,
                        "FORM_G_CUM": not fused, "USE_L2NORM": l2, "DOT_PREC": prec, "SOLVE_PREC": prec,
                        "INTERP_BF16": interp_bf16}, cfg))
    out.append(_kernel("wu_fwd", tag + ("-fused" if fused else "-stored-inverse"), _wu_fwd_kernel,
                       {"k": ptr, "v": ptr, "g": "*fp32", "g_cum": "*fp32", "beta": "*fp32", "A_inv": ptr, "w": ptr,
                        "u": ptr, "k_rnorm": "*fp32", "cu_seqlens": "*i32", "N": "i32"},
                       {"s_k": H * K, "s_v": HV * V, "s_g": HV, "s_b": HV, "H": H, "HV": HV, "K": K, "V": V, "BT": 64,
                        "BK": cfg.BK, "BV": cfg.BV, "FUSED_SOLVE": fused, "FORM_G_CUM": fused, "USE_L2NORM": l2,
                        "STORE_RNORM": l2, "DOT_PREC": prec, "SOLVE_PREC": prec, "INTERP_BF16": interp_bf16}, cfg))
    # The state kernel in both layouts and at both V slice widths; with a state pool read
    # and written in place ("vk", as serving engines keep it) at the Qwen3.5 shape only
    # (at K = 100, fp16 the pool variant spills 8 bytes on sm_80).
    variants = [("kv", HV, False), ("vk", HV, False), ("kv", 4096 * HV, False)]
    if dtype == "bf16":
        variants.append(("vk", HV, True))
    for layout, nhv, pool in variants:
        cfg = state_config(K, V, nhv, elem, capability)
        out.append(_kernel("state_fwd", f"{tag}-{layout}-BV{cfg.BV}" + ("-pool" if pool else ""), _state_fwd_kernel,
                           {"k": ptr, "w": ptr, "u": ptr, "g_cum": "*fp32", "k_rnorm": "*fp32", "h": ptr,
                            "v_new": ptr,
                            "h0": "*fp32", "ht": "*fp32", "cu_seqlens": "*i32", "state_indices": "*i32",
                            "P": "i32"},
                           {"s_k": H * K, "H": H, "HV": HV, "K": K, "V": V, "BT": 64, "BK": cfg.BK, "BV": cfg.BV,
                            "USE_H0": True, "USE_POOL": pool, "INPLACE": pool, "STORE_HT": True,
                            "STATE_VK": layout == "vk",
                            "USE_L2NORM": l2, "LOAD_RNORM": l2, "DOT_PREC": prec, "INTERP_BF16": interp_bf16,
                            "INTERPRET": False}, cfg))
    cfg = output_config(K, V, elem, capability)
    out.append(_kernel("output_fwd", tag, _output_fwd_kernel,
                       {"q": ptr, "k": ptr, "v_new": ptr, "h": ptr, "g_cum": "*fp32", "k_rnorm": "*fp32", "o": ptr,
                        "cu_seqlens": "*i32", "N": "i32", "scale": "fp32"},
                       {"s_q": H * K, "s_k": H * K, "H": H, "HV": HV, "K": K, "V": V, "BT": 64, "BK": cfg.BK, "BV": cfg.BV,
                        "USE_L2NORM": l2, "LOAD_RNORM": l2, "DOT_PREC": prec, "INTERP_BF16": interp_bf16}, cfg))
    out += _context_parallel_kernels(dtype, H, HV, K, V, l2, ptr, prec, tag, capability)
    return out


def _context_parallel_kernels(dtype, H, HV, K, V, l2, ptr, prec, tag, capability) -> list[AotKernel]:
    """The segmented path's own kernels (pass 2 is the state and output kernels above): the
    forgetting starts, pass 1's maps (which write the segment table too), and the scan in
    the "vk" layout with a pool; for chained segments the forgetting starts zeroing the
    hand-over counts, pass 1 without M, and the chained state kernel (with a pool in the
    "vk" layout, as servers keep states, on 16-bit data)."""
    out = []
    bf16_maps = maps_dtype({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]) \
        == torch.bfloat16
    m_hi = "*bf16" if bf16_maps else "*fp32"
    cfg = segment_map_config(K, V)
    for chain in (False, True):
        suffix = "-chain" if chain else ""
        f_start = "*i32" if chain else "*fp32"
        out.append(_kernel("forgetting_start", f"{tag}-BK{cfg.BK}{suffix}", _forgetting_start_kernel,
                           {"g_cum": "*fp32", "beta": ptr, "k": ptr, "cu_seqlens": "*i32", "f_start": f_start,
                            "chain_flags": "*i32" if chain else f_start, "N": "i32", "L": "i32"},
                           {"s_b": HV, "s_k": H * K, "H": H, "HV": HV, "K": K, "BT": 64, "BK": cfg.BK,
                            "USE_L2NORM": l2, "NEGLIGIBLE_LOG2": MAP_NEGLIGIBLE_LOG2, "CHAIN": chain},
                           FORGETTING_CONFIG))
        out.append(_kernel("segment_map_fwd", f"{tag}-BC{cfg.BV}{suffix}", _segment_map_fwd_kernel,
                           {"k": ptr, "w": ptr, "u": ptr, "g_cum": "*fp32", "k_rnorm": "*fp32", "f_start": f_start,
                            "cu_seqlens": "*i32", "seg_cu": "*i32", "N": "i32", "NSEG": "i32", "L": "i32",
                            "m_hi": "*fp32" if chain else m_hi, "m_lo": "*fp32" if chain else "*bf16",
                            "n_out": "*fp32"},
                           {"s_k": H * K, "H": H, "HV": HV, "K": K, "V": V, "BT": 64, "BK": cfg.BK, "BC": cfg.BV,
                            "USE_L2NORM": l2, "LOAD_RNORM": l2, "DOT_PREC": prec, "INTERP_BF16": False,
                            "INTERPRET": False, "PREFETCH": l2_prefetch_chunks(capability), "FORGET": True,
                            "CHAIN": chain}, cfg))
    pool = dtype == "bf16"
    cfg = state_config(K, V, HV, _TYPES[dtype][1], capability)
    out.append(_kernel("chained_state_fwd", f"{tag}-BV{cfg.BV}" + ("-vk-pool" if pool else "-kv"),
                       _chained_state_fwd_kernel,
                       {"k": ptr, "w": ptr, "u": ptr, "g_cum": "*fp32", "k_rnorm": "*fp32", "h": ptr, "v_new": ptr,
                        "h0": "*bf16" if pool else "*fp32", "ht": "*fp32", "cu_seqlens": "*i32",
                        "state_indices": "*i32", "f_start": "*i32", "hand": "*fp32", "chain_flags": "*i32",
                        "P": "i32", "N": "i32", "NSEG": "i32", "L": "i32"},
                       {"s_k": H * K, "H": H, "HV": HV, "K": K, "V": V, "BT": 64, "BK": cfg.BK, "BV": cfg.BV,
                        "USE_H0": True, "USE_POOL": pool, "INPLACE": pool, "STORE_HT": True, "STATE_VK": pool,
                        "USE_L2NORM": l2, "LOAD_RNORM": l2, "DOT_PREC": prec, "INTERP_BF16": False,
                        "INTERPRET": False}, cfg))
    # The scan's configs: many (sequence, v-head) pairs, and one pair (narrower V blocks where
    # the part takes them).
    configs = {segment_scan_config(K, V, capability, pairs, 132, bf16_maps) for pairs in (10 ** 6, 1)}
    for cfg in sorted(configs, key=lambda c: -c.BV):
        out.append(_kernel("segment_scan_fwd", f"{tag}-BV{cfg.BV}" + ("-vk-pool" if pool else "-kv"),
                           _segment_scan_fwd_kernel,
                           {"m_hi": m_hi, "m_lo": "*bf16", "n_in": "*fp32", "cu_seqlens": "*i32",
                            "h0": "*bf16" if pool else "*fp32",
                            "ht": "*fp32", "seg_h0": "*fp32", "state_indices": "*i32", "P": "i32", "L": "i32"},
                           {"HV": HV, "K": K, "V": V, "BK": cfg.BK, "BKC": scan_block_kc(cfg), "BV": cfg.BV,
                            "USE_H0": True, "USE_POOL": pool, "INPLACE": pool, "STORE_HT": True, "STATE_VK": pool,
                            "INTERPRET": False}, cfg))
    return out


def kernels_for_aot(capability: tuple[int, int] | None = None) -> list[AotKernel]:
    """Every kernel of the backend at representative specializations.

    ``capability`` (e.g. ``(9, 0)``) picks the launch configs of that part (shared memory
    decides pipeline depth); None uses the sm_90 table. Signatures are ASTSource's:
    ``{"k": "*bf16", "scale": "fp32", "BK": "constexpr", ...}``.
    """
    kernels = _stage_kernels("bf16", 16, 32, 128, 128, True, capability)
    kernels += _stage_kernels("fp16", 2, 4, 100, 60, False, capability)
    return kernels
