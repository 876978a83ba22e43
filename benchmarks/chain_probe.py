"""Where a chunk step of context parallelism's pass 1 spends its time: the shipped
``segment_map_fwd`` beside probe kernels that walk the same chain (``v = u - w S``, then
``S = 2^g_last S + k^T (d v)``) with the loads changed.

Usage (an sm_90 GPU, repository root): ``python benchmarks/chain_probe.py``.

Rows per shard (one sequence of 32768 tokens, K = V = 128, bf16, segments of 2048 tokens as
``"auto"`` cuts them at 2/4 and 4/8; pass 1's grid: (segment, v-head, 64-column block of
N and of M), 4 warps, 2 stages):

* shipped: ``segment_map_fwd`` itself (masked loads, M and N programs).
* chain, loads per chunk: the probe's copy of the step, unmasked (every chunk full).
* chain, one chunk reloaded: the same loads every step from the segment's first chunk (its
  tiles stay in L2: the loads' latency without DRAM or L2 traffic).
* chain, tiles loaded once: the chunk's tiles loaded before the walk, the loop is the
  chain of products and their register work alone.
* loads alone: every chunk's tiles loaded and folded into S by row and column sums, no
  products (on the H200 the sums' cross-thread reductions took longer than the whole
  walk: this row bounds nothing, it only shows the loads are not free of register work).

GPU µs per call (a CUDA graph of 10 calls, median of 15 replays). Prints a markdown table
last.
"""
import torch
import triton
import triton.language as tl

from md_table import print_table
from gdn_dispatch.backends.triton_generic import segment_map
from gdn_dispatch.bench_host import graph_replay_us

K = V = 128
BT, BC = 64, 64
#: (H, HV, tokens, segment length)
SHAPES = [(2, 4, 32768, 2048), (4, 8, 32768, 2048)]
MODES = {"chain, loads per chunk": 0, "chain, one chunk reloaded": 1, "chain, tiles loaded once": 2,
         "loads alone": 3}


@triton.jit
def _tiles(k, w, u, g_cum, t0, i_h, o_k, o_c, u_cols, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
           V: tl.constexpr, BT: tl.constexpr):
    o_i = tl.arange(0, BT)
    b_w = tl.load(w + (t0 * HV + i_h) * K + o_i[:, None] * (HV * K) + o_k[None, :])
    b_u = tl.load(u + (t0 * HV + i_h) * V + o_i[:, None] * (HV * V) + o_c[None, :],
                  mask=(o_c < u_cols)[None, :], other=0.0).to(tl.float32)
    p_g = g_cum + t0 * HV + i_h
    b_g_last = tl.load(p_g + (BT - 1) * HV)
    b_d = tl.exp2(b_g_last - tl.load(p_g + o_i * HV))
    b_kt = tl.load(k + t0 * (H * K) + (i_h // (HV // H)) * K + o_i[None, :] * (H * K) + o_k[:, None])
    return b_w, b_u, b_d, tl.exp2(b_g_last), b_kt


@triton.jit
def _step(b_s, b_w, b_u, b_d, b_r, b_kt, F32_DOTS: tl.constexpr):
    b_sc = b_s.to(b_w.dtype)
    if F32_DOTS:  # the interpreter multiplies bf16 bit patterns: products of the rounded values
        b_v = b_u - tl.dot(b_w.to(tl.float32), b_sc.to(tl.float32), input_precision="ieee")
        return tl.dot(b_kt.to(tl.float32), (b_v * b_d[:, None]).to(b_w.dtype).to(tl.float32), b_s * b_r,
                      input_precision="ieee")
    b_v = b_u - tl.dot(b_w, b_sc)
    return tl.dot(b_kt, (b_v * b_d[:, None]).to(b_w.dtype), b_s * b_r)


@triton.jit
def _probe_kernel(k, w, u, g_cum, out, L: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, MODE: tl.constexpr,
                  F32_DOTS: tl.constexpr = False):
    NCB: tl.constexpr = V // BC + K // BC
    pid = tl.program_id(0).to(tl.int64)
    i_cb, i_sh = pid % NCB, pid // NCB
    i_h = i_sh % HV
    bos = (i_sh // HV) * L
    is_m = i_cb >= V // BC
    o_k = tl.arange(0, K)
    o_c = tl.where(is_m, i_cb - V // BC, i_cb) * BC + tl.arange(0, BC)
    u_cols = tl.where(is_m, 0, V)
    b_s = tl.where((o_k[:, None] == o_c[None, :]) & is_m, 1.0, 0.0)
    if MODE == 2:
        b_w, b_u, b_d, b_r, b_kt = _tiles(k, w, u, g_cum, bos, i_h, o_k, o_c, u_cols, H, HV, K, V, BT)
    for i_t in range(L // BT):
        if MODE == 0:
            b_w, b_u, b_d, b_r, b_kt = _tiles(k, w, u, g_cum, bos + i_t * BT, i_h, o_k, o_c, u_cols, H, HV, K, V, BT)
            b_s = _step(b_s, b_w, b_u, b_d, b_r, b_kt, F32_DOTS)
        elif MODE == 1:
            b_w, b_u, b_d, b_r, b_kt = _tiles(k, w, u, g_cum, bos, i_h, o_k, o_c, u_cols, H, HV, K, V, BT)
            b_s = _step(b_s, b_w, b_u, b_d, b_r, b_kt, F32_DOTS)
        elif MODE == 2:
            b_s = _step(b_s, b_w, b_u, b_d, b_r, b_kt, F32_DOTS)
        else:
            b_w, b_u, b_d, b_r, b_kt = _tiles(k, w, u, g_cum, bos + i_t * BT, i_h, o_k, o_c, u_cols, H, HV, K, V, BT)
            b_s += (tl.sum(b_w.to(tl.float32), axis=0)[:, None] + tl.sum(b_kt.to(tl.float32), axis=1)[:, None]
                    + tl.sum(b_u * b_d[:, None], axis=0)[None, :] * b_r)
    tl.store(out + pid * (K * BC) + o_k[:, None] * BC + tl.arange(0, BC)[None, :], b_s)


def main() -> None:
    from segment_map_sweep import inputs

    torch.manual_seed(0)
    rows = []
    for H, HV, T, L in SHAPES:
        k, w, u, g_cum, cu = inputs(H, HV, T)
        programs = (T // L) * HV * (V // BC + K // BC)
        out = torch.empty(programs, K, BC, device="cuda")
        cfg = segment_map.segment_map_config(K, V)
        us = graph_replay_us(lambda: [segment_map.segment_map_fwd(k, w, u, g_cum, cu, L) for _ in range(10)],
                             replays=1, windows=15) / 10
        rows.append((f"{H}/{HV}", "shipped", f"{us:.1f}"))
        print(rows[-1], flush=True)
        for name, mode in MODES.items():
            def call():
                for _ in range(10):
                    _probe_kernel[(programs,)](k, w, u, g_cum, out, L, H, HV, K, V, BT, BC, mode,
                                               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            call()
            us = graph_replay_us(call, replays=1, windows=15) / 10
            rows.append((f"{H}/{HV}", name, f"{us:.1f}"))
            print(rows[-1], flush=True)
    print_table(["H/HV", "walk", "µs per call"], "llr", rows)


if __name__ == "__main__":
    main()
