"""Host enqueue per public call, for comparing two checkouts on one GPU host.

One process times one checkout (whichever ``gdn_dispatch`` the import finds: put the
checkout's root, with its ``registry.toml``, first on ``PYTHONPATH``): per case, 9 rounds
of 20 back-to-back calls of gluon_sm90 (initial and final state, bf16, K = V = 128), the
median and the best round's µs per call, after the host reference line of ``bench --host``
(the same fixed host work timed in this process). The GPU hosts lent here run the same
Python up to 1.6x apart within a lease, so run the two arms in alternating processes,
several pairs, and compare the rounds of like speed::

    for i in 1 2 3; do
      PYTHONPATH=/path/to/a python benchmarks/host_enqueue_ab.py a
      PYTHONPATH=/path/to/b python benchmarks/host_enqueue_ab.py b
    done

The arms can be settings of one checkout as well, e.g. the native host layer off and
required (``GDN_DISPATCH_NATIVE=0`` / ``=1``, after ``python -m gdn_dispatch warmup`` or
``gdn_dispatch.native.build()`` built it).
"""
from __future__ import annotations

import statistics
import sys

import torch

import gdn_dispatch
from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.bench_host import per_call_us
from gdn_dispatch.testing import random_call

#: (name, random_call shape, heads (H, HV), drop the host copy of cu_seqlens, qk l2 norm)
CASES = [("uniform-1x64", dict(batch=(1, 64)), (16, 32), False, False),
         ("varlen-1x64", dict(lengths=[64]), (16, 32), False, False),
         ("varlen-1x64-no-cpu", dict(lengths=[64]), (16, 32), True, False),
         ("varlen-1x64-l2", dict(lengths=[64]), (16, 32), False, True),
         ("varlen-4x2048", dict(lengths=[2048] * 4), (16, 32), False, False),
         ("varlen-4x2048-l2", dict(lengths=[2048] * 4), (16, 32), False, True),
         ("uniform-1x8192", dict(batch=(1, 8192)), (16, 32), False, False),
         ("H2-HV4-varlen-1x32768", dict(lengths=[32768]), (2, 4), False, False),
         ("H2-HV4-varlen-1x32768-no-cpu", dict(lengths=[32768]), (2, 4), True, False)]


def case_calls(backend: str = "gluon_sm90"):
    """``(name, f)`` per case: ``f`` makes the case's public call once on ``backend``."""
    for name, shape, (H, HV), no_host_copy, l2 in CASES:
        call = random_call(**shape, H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=1)
        if no_host_copy:
            call.pop("cu_seqlens_cpu", None)
        yield name, (lambda call=call, l2=l2: chunk_gated_delta_rule(**call, output_final_state=True,
                                                                      use_qk_l2norm_in_kernel=l2, backend=backend))


def main() -> None:
    arm = sys.argv[1] if len(sys.argv) > 1 else "arm"
    print(f"{arm}: gdn_dispatch from {gdn_dispatch.__file__}", flush=True)
    try:  # the host's speed in this process (checkouts without it just skip the line)
        from gdn_dispatch.bench_host import format_reference, host_reference_us
        print(f"{arm}: {format_reference(host_reference_us('cuda'))}", flush=True)
    except ImportError:
        pass
    for name, f in case_calls():
        rounds = [per_call_us(f, 20, sync=torch.cuda.synchronize, warmup=3 if i == 0 else 0) for i in range(9)]
        print(f"{arm:6s} {name:30s} enqueue µs per call: median {statistics.median(rounds):7.1f}  "
              f"best {min(rounds):7.1f}", flush=True)


if __name__ == "__main__":
    main()
