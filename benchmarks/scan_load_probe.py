"""Whether the context-parallel scan's step waits on M's bytes: the whole-M step with M
loaded by TMA (host tensor descriptors) instead of pointer loads, and with M in one fp32
part (a ``tf32x3`` or ``ieee`` product) instead of pass 1's TF32 + bf16 split.

Usage (an sm_90 GPU, repository root): ``python benchmarks/scan_load_probe.py``. Inputs as
``benchmarks/scan_variants.py``: one sequence of ``NSEG`` slots, K = V = 128, random
contracting maps and random N; error: relative RMS of every slot's start state against a
float64 scan; time: GPU µs per call (a CUDA graph of 10 calls, median of 15 replays),
beside the shipped ``segment_scan_fwd`` on the same maps (its last slot is the empty one
past the sequence's end, so it makes one product fewer). Each probe kernel walks one
v-head's slots for one BV slice of V, as the shipped whole-M step does.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from md_table import print_table
from scan_variants import scan64
from gdn_dispatch.backends.triton_generic import segment_scan
from gdn_dispatch.backends.triton_generic.segment_scan import _split_product
from gdn_dispatch.bench_host import graph_replay_us
from gdn_dispatch.testing import rel_rms_error

K = V = 128
SHAPES = [(4, 16), (8, 16), (16, 8), (4, 32)]  # (HV, NSEG)


@triton.jit
def _probe_kernel(m_hi, m_hi_d, m_lo_d, n, seg_h0, NSEG, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BV: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
                  PREC: tl.constexpr):
    i_v = tl.program_id(0) % (V // BV)
    i_h = tl.program_id(0) // (V // BV)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    b_s = tl.zeros([K, BV], tl.float32)
    for s in tl.range(0, NSEG, num_stages=STAGES):
        row = (s * HV + i_h) * K
        tl.store(seg_h0 + row * V + o_k[:, None] * V + o_v[None, :], b_s)
        b_n = tl.load(n + row * V + o_k[:, None] * V + o_v[None, :])
        if TMA:
            b_m = m_hi_d.load([row, 0])
        else:
            b_m = tl.load(m_hi + row * K + o_k[:, None] * K + o_k[None, :])
        if SPLIT:
            b_s = _split_product(b_m, m_lo_d.load([row, 0]), b_s, b_n, False)
        else:
            b_s = tl.dot(b_m, b_s, b_n, input_precision=PREC)


#: (name, BV, warps, stages, M split as pass 1 stores it, TMA loads, product precision of a fp32 M)
FORMS = [
    ("split M, TMA, BV 8, 8 warps, 2 stages", 8, 8, 2, True, True, None),
    ("split M, TMA, BV 8, 8 warps, 3 stages", 8, 8, 3, True, True, None),
    ("split M, TMA, BV 8, 4 warps, 2 stages", 8, 4, 2, True, True, None),
    ("split M, TMA, BV 16, 8 warps, 2 stages", 16, 8, 2, True, True, None),
    ("fp32 M, TMA, tf32x3, BV 8, 8 warps, 3 stages", 8, 8, 3, False, True, "tf32x3"),
    ("fp32 M, TMA, ieee, BV 8, 8 warps, 3 stages", 8, 8, 3, False, True, "ieee"),
    ("fp32 M, pointer loads, ieee, BV 8, 8 warps, 2 stages", 8, 8, 2, False, False, "ieee"),
]


def probe(m_hi, m_lo, n, BV, warps, stages, split, tma, prec):
    NSEG, HV = m_hi.shape[:2]
    seg_h0 = torch.empty_like(n)
    hi_d = TensorDescriptor.from_tensor(m_hi.view(-1, K), [K, K])
    lo_d = TensorDescriptor.from_tensor(m_lo.view(-1, K), [K, K])
    return _probe_kernel[(HV * (V // BV),)](m_hi, hi_d, lo_d, n, seg_h0, NSEG, HV, K, V, BV, stages, split, tma,
                                            prec or "tf32", num_warps=warps), seg_h0


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for HV, NSEG in SHAPES:
        m = 0.9 * torch.randn(NSEG, HV, K, K, device="cuda", dtype=torch.float64) / K ** 0.5
        n64 = torch.randn(NSEG, HV, K, V, device="cuda", dtype=torch.float64)
        want = scan64(m, n64)
        n = n64.float().contiguous()
        m_hi, m_lo = segment_scan.split_maps(m.float(), bf16=False)
        m32 = m.float().contiguous()
        cu = torch.tensor([0, (NSEG - 1) * 64], device="cuda", dtype=torch.int32)
        cfg = segment_scan.segment_scan_config(K, V, (9, 0), HV, torch.cuda.get_device_properties(0).multi_processor_count)
        shipped = lambda: segment_scan.segment_scan_fwd(m_hi, m_lo, n, cu, 64, config=cfg)
        err = rel_rms_error(shipped()[0].double(), want)
        us = graph_replay_us(lambda: [shipped() for _ in range(10)], replays=1, windows=15) / 10
        rows.append((HV, NSEG, f"shipped (BV {cfg.BV}, {cfg.num_warps} warps, {cfg.num_stages} stages)", f"{err:.1e}",
                     f"{us:.1f}", "-"))
        print(rows[-1], flush=True)
        for name, BV, warps, stages, split, tma, prec in FORMS:
            mh, ml = (m_hi, m_lo) if split else (m32, m_lo)
            try:
                kernel, got = probe(mh, ml, n, BV, warps, stages, split, tma, prec)
                err = rel_rms_error(got.double(), want)
                us = graph_replay_us(lambda: [probe(mh, ml, n, BV, warps, stages, split, tma, prec)
                                              for _ in range(10)], replays=1, windows=15) / 10
                rows.append((HV, NSEG, name, f"{err:.1e}", f"{us:.1f}", f"{kernel.n_regs} / {kernel.n_spills}"))
            except Exception as exc:  # a form that does not fit here is a row, not a stop
                rows.append((HV, NSEG, name, "-", f"{type(exc).__name__}: {str(exc)[:60]}", "-"))
            print(rows[-1], flush=True)
    print_table(["HV", "segments", "step form", "rel. error", "µs per call", "regs / spill bytes"], "rrlrrl", rows)


if __name__ == "__main__":
    main()
