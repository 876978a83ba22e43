"""The warm chain (gluon_sm90's one-kernel build over chained segments,
backends/gluon_common/warm_chain.py) against the same build with one program per (sequence,
v-head) and the public call as routed, on one sequence of 32768 tokens per tensor-parallel
shard: eager calls timed with CUDA events (median of 20), the bench's gates (and x 0.02
once at 16/32), segments sized so that the slots' programs fill about 128 SMs. The last
column is the warm chain's largest relative RMS difference (o, final state) from the
one-program-per-head kernel. A CUDA machine, repository root:

    python benchmarks/warm_chain_timing.py
"""
import torch, statistics
from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.contract import make_problem
from gdn_dispatch.testing import random_call, rel_rms_error
from gdn_dispatch.device import default_probe
from gdn_dispatch.backends import gluon_sm90
from gdn_dispatch.backends.gluon_sm90 import fused

def timed(fn, iters=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)

rows = []
for H, HV, factor in [(16, 32, 1.0), (16, 32, 0.02), (8, 16, 1.0), (4, 8, 1.0), (2, 8, 1.0), (2, 4, 1.0)]:
    call = random_call(lengths=[32768], H=H, HV=HV, K=128, V=128, device="cuda", seed=0)
    call = {**call, "g": call["g"] * factor}
    p = make_problem(**call, output_final_state=True, backend="gluon_sm90")
    dev = default_probe().for_torch_device(p.device)
    plain = fused.plan_fused(p, dev, engine=gluon_sm90.ENGINE)
    chain = fused.plan_fused(p, dev, engine=gluon_sm90.ENGINE, chain=True)
    s = torch.empty(1, device="cuda")
    L = max(1024, 32768 * HV // 128 // 64 * 64)
    NSEG = 32768 // L + 1
    hand = torch.empty(NSEG * HV, 128, 128, device="cuda")
    flags = torch.empty(NSEG * HV + 1, dtype=torch.int32, device="cuda")
    t_pub = timed(lambda: chunk_gated_delta_rule(**call, output_final_state=True, backend="gluon_sm90"))
    t_plain = timed(lambda: fused.fused_fwd(p, s, s, plain))
    t_chain = timed(lambda: fused.fused_fwd(p, s, s, chain, chain=(hand, flags, L, NSEG)))
    o1, h1 = fused.fused_fwd(p, s, s, chain, chain=(hand, flags, L, NSEG))
    o0, h0 = fused.fused_fwd(p, s, s, plain)
    err = max(rel_rms_error(o1.float(), o0.float()), rel_rms_error(h1, h0))
    rows.append((f"H{H}-HV{HV} 1x32768 gates x{factor}", L, NSEG * HV, t_pub, t_plain, t_chain, err))
    print(rows[-1], flush=True)
print("| shape | L | programs | public call (auto) ms | one-kernel plain ms | warm chain ms | chain vs plain |")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.1e} |")
