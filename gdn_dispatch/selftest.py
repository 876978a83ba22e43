"""Self-test: each backend on a fixed set of calls, against the reference, in a child process.

``python -m gdn_dispatch selftest [--device N] [--backend NAME] [--quick]`` runs every
backend the device admits (or the one named), each in its own child process with a time
limit, so that a hang or a fault in a kernel cannot take the caller down, and prints a
table: backend, cases passed, worst relative RMS error, seconds. It exits 0 only when
every backend the registry would pick on that device passes.

The calls cover what a kernel gets wrong first: ragged tails (1, 63, 65, 130 tokens),
zero-length sequences, grouped value heads, both state layouts, the in-kernel qk l2 norm,
initial state on and off, the final state asked or not, K = V, K < V and K > V, from the
head dims, dtypes and features the backend's registry row admits. The quick set (three
calls) is what the self-test gate (:mod:`gdn_dispatch.gate`) runs before an unverified
backend's first call; this command records its verdicts there too.

On the CPU the reference backend runs; triton_generic runs there under
``TRITON_INTERPRET=1`` (at small sizes) only when named with ``--backend``. The reference
backend is checked against the per-token recurrence, every other backend against the
reference's chunked form.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib
from dataclasses import dataclass

from gdn_dispatch import gate
from gdn_dispatch.device import CPU, default_probe
from gdn_dispatch.progress import Progress
from gdn_dispatch.registry import CallSpec, device_reason, explain, load_registry, version_reason
from gdn_dispatch.usage import UsageError, backend_arg, cuda_index, device_arg, seconds_arg

#: Relative RMS error per output tensor, by q/k/v dtype (DESIGN.md's bounds).
TOL = {"float32": 1e-5, "bfloat16": 5e-3, "float16": 5e-3}
#: Default time limit of one child, seconds: the quick set and the full set.
TIMEOUT_S = {True: gate.DEFAULT_TIMEOUT_S, False: 900.0}


@dataclass(frozen=True)
class Case:
    """One self-test call.

    Attributes
    ----------
    id : str, names the call ("ragged-zero-K128-V128-bfloat16-kv-h0").
    lengths : list of int or None, a packed ragged batch (B = 1, cu_seqlens).
    batch : (B, T) or None, a uniform batch.
    H, HV, K, V : int, heads, value heads, head dims.
    dtype : str, q/k/v dtype name.
    layout : "kv" or "vk", the state layout.
    l2 : bool, the in-kernel qk l2 norm.
    h0 : bool, an initial state.
    ht : bool, the final state asked.
    pool : bool, the initial states in a pool of N + 2 rows picked by ``state_indices``
        (one index -1), final states written back in place.
    """

    id: str
    lengths: tuple[int, ...] | None
    batch: tuple[int, int] | None
    H: int
    HV: int
    K: int
    V: int
    dtype: str
    layout: str
    l2: bool
    h0: bool
    ht: bool
    pool: bool = False

    def call_spec(self) -> CallSpec:
        """The registry's view of this call."""
        return CallSpec(dtype=self.dtype, K=self.K, V=self.V, varlen=self.lengths is not None,
                        grouped_value_heads=self.HV != self.H, state_layout=self.layout,
                        initial_state=self.h0, final_state=self.ht, qk_l2norm=self.l2, state_pool=self.pool)


#: (K, V) pairs for a row without an exact head_dims list: K = V, K < V, K > V (one of them
#: not a power of two); the small ones for CPU runs.
FREE_HEAD_DIMS = {False: [(128, 128), (32, 128), (128, 48)], True: [(48, 48), (16, 48), (48, 16)]}


def head_dim_pairs(spec, small: bool) -> list[tuple[int, int]]:
    """(K, V) pairs the row admits: K = V, then K < V, then K > V.

    ``small`` (CPU runs) keeps them at 48 and below.
    """
    if spec.head_dims is not None:
        low, high = min(spec.head_dims), max(spec.head_dims)
        return [(high, high), (low, high), (high, low)]
    return [(min(k, spec.max_head_dim), min(v, spec.max_head_dim)) for k, v in FREE_HEAD_DIMS[small]]


def _dtypes(spec) -> tuple[str, str]:
    """The main dtype (bfloat16 where admitted) and a second one (float16 where admitted)."""
    main = "bfloat16" if "bfloat16" in spec.dtypes else spec.dtypes[0]
    second = "float16" if "float16" in spec.dtypes else main
    return main, second


def cases_for(spec, *, quick: bool, small: bool) -> list[Case]:
    """The fixed calls for ``spec`` (a registry row); ``quick``: the first three only.

    ``small`` scales the lengths down for CPU runs (the interpreter walks every program).
    """
    (k1, v1), (k2, v2), (k3, v3) = head_dim_pairs(spec, small)
    main, second = _dtypes(spec)
    long = (300, 1) if small else (2049, 1)

    def case(name, lengths=None, batch=None, H=2, HV=4, K=k1, V=v1, dtype=main, layout="kv",
             l2=False, h0=True, ht=True, pool=False):
        flags = "-".join(f for f, on in (("l2", l2), ("h0", h0), ("ht", ht), ("pool", pool)) if on)
        tag = f"{name}-H{H}-HV{HV}-K{K}-V{V}-{dtype}-{layout}" + (f"-{flags}" if flags else "")
        return Case(tag, None if lengths is None else tuple(lengths), batch, H, HV, K, V, dtype, layout, l2, h0, ht,
                    pool)

    cases = [
        case("ragged-zero", lengths=[1, 63, 65, 130, 0]),
        case("ragged", lengths=[15, 64, 0, 70], K=k2, V=v2, dtype=second, layout="vk", l2=True),
        case("uniform-tails", batch=(2, 100), HV=2, K=k3, V=v3, h0=False),
    ]
    if quick:
        return cases
    cases += [
        case("all-empty", lengths=[0, 0, 7], H=1, HV=2, layout="vk"),
        case("no-final", lengths=[64, 129], HV=8, l2=True, ht=False),
        case("long", lengths=list(long), H=1, HV=2, layout="vk"),
    ]
    if "float32" in spec.dtypes:
        cases.append(case("fp32", lengths=[33, 100], HV=2, K=k2, V=v2, dtype="float32", l2=True))
    if "state_pool" in spec.features:
        cases.append(case("pool", lengths=[1, 63, 65, 0], layout="vk", pool=True))
    if not small:
        # Enough (sequence, v-head) pairs to fill any GPU's SMs: the calls a server batches,
        # where gluon_sm90 takes its warp-specialized path.
        cases.append(case("many-heads", lengths=[100, 37, 64], H=32, HV=128))
    return cases


def _pool_inputs(call: dict) -> tuple[dict, dict]:
    """A pool of N + 2 float32 rows and indices (the rows reversed, one -1) for ``call``;
    returns the backend's extra arguments (pool, state_indices, inplace_final_state) and
    the initial states the indices gather (zeros for -1), for the oracle."""
    import torch

    state = call["initial_state"]
    N, device = state.shape[0], state.device
    pool = 0.1 * torch.randn(N + 2, *state.shape[1:], generator=torch.Generator().manual_seed(N)).to(device)
    indices = torch.arange(N + 1, 1, -1, dtype=torch.int32)
    indices[1 % N] = -1
    indices = indices.to(device)
    live = indices >= 0
    gathered = torch.zeros_like(state)
    gathered[live] = pool[indices[live].long()]
    return {"initial_state": pool, "state_indices": indices, "inplace_final_state": True}, {"initial_state": gathered}


def run_case(case: Case, backend: str, device) -> dict:
    """Run ``case`` on ``backend`` (forced) on the torch ``device`` and compare with the
    oracle. Returns the case's report: id, ok, error (the worse of o and the final
    state), message, seconds."""
    import torch

    from gdn_dispatch import chunk_gated_delta_rule, reference
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.testing import poison_cuda_allocator, random_call, rel_rms_error

    shape = {"lengths": list(case.lengths)} if case.lengths is not None else {"batch": case.batch}
    call = random_call(**shape, H=case.H, HV=case.HV, K=case.K, V=case.V, dtype=getattr(torch, case.dtype),
                       device=device, seed=zlib.crc32(case.id.encode()), initial_state=case.h0,
                       state_layout=case.layout, normalize_qk=not case.l2)
    flags = dict(output_final_state=case.ht, use_qk_l2norm_in_kernel=case.l2)
    backend_call, oracle_call = dict(call), dict(call)
    if case.pool:
        pool_args, gathered = _pool_inputs(call)
        backend_call.update(pool_args)
        oracle_call.update(gathered)
        expected_pool = pool_args["initial_state"].clone()
    start = time.perf_counter()
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                poison_cuda_allocator()
        o, ht = chunk_gated_delta_rule(**backend_call, **flags, backend=backend)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        oracle = reference.forward_recurrent if backend == "reference" else reference.forward
        o_ref, ht_ref = oracle(make_problem(**oracle_call, **{**flags, "output_final_state": True}))
        error = rel_rms_error(o, o_ref)
        if case.ht:
            error = max(error, rel_rms_error(ht, ht_ref))
        if case.pool:
            live = pool_args["state_indices"] >= 0
            expected_pool[pool_args["state_indices"][live].long()] = ht_ref[live]
            error = max(error, rel_rms_error(pool_args["initial_state"], expected_pool))
    except Exception as exc:  # a backend's exception is a failed case, reported verbatim
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        oom = isinstance(exc, torch.cuda.OutOfMemoryError)
        return {"id": case.id, "ok": False, "error": math.inf, "oom": oom, "seconds": time.perf_counter() - start,
                "message": f"{type(exc).__name__}: {first}"}
    tol = TOL[case.dtype]
    ok = error <= tol
    return {"id": case.id, "ok": ok, "error": error, "seconds": time.perf_counter() - start,
            "message": "" if ok else f"rel. RMS error {error:.2e} > {tol:.0e}"}


def _emit(marker: str, payload: dict) -> None:
    print(marker + json.dumps(payload, default=str), flush=True)


def child_main(backend: str, device_label: str, quick: bool) -> int:
    """The child: run ``backend``'s cases on ``device_label`` and print one JSON line per
    case and a result line (the parent, :func:`gdn_dispatch.gate.run_child`, reads them).
    Exit 0 when every case passed."""
    import torch

    spec = next((r for r in load_registry() if r.name == backend), None)
    if spec is None:
        _emit(gate.RESULT_MARKER, {"status": "failed", "total": 0, "reason": f"unknown backend {backend!r}"})
        return 1
    if device_label.startswith("cuda") and not torch.cuda.is_available():
        _emit(gate.RESULT_MARKER, {"status": "inconclusive", "total": 0,
                                   "reason": f"torch sees no CUDA device for {device_label}"})
        return 1
    device = torch.device(device_label)
    cases = cases_for(spec, quick=quick, small=device.type == "cpu")
    print(gate.START_MARKER, flush=True)
    reports = []
    for case in cases:
        report = run_case(case, backend, device)
        reports.append(report)
        _emit(gate.CASE_MARKER, report)
    failed = [r for r in reports if not r["ok"]]
    if failed and all(r.get("oom") for r in failed):
        status, reason = "inconclusive", f"out of memory in case {failed[0]['id']}"
    else:
        status = "failed" if failed else "passed"
        reason = f"case {failed[0]['id']}: {failed[0]['message']}" if failed else ""
    _emit(gate.RESULT_MARKER, {"status": status, "total": len(cases), "reason": reason})
    return 0 if status == "passed" else 1


def admitted_backends(device, rows=None) -> list[str]:
    """Backends whose row admits ``device`` (capability, versions), highest priority first."""
    return [r.name for r in rows or load_registry()
            if device_reason(r, device) is None and version_reason(r) is None]


def picked_backends(device, rows=None, *, small: bool = False) -> set[str]:
    """Backends the registry picks on ``device`` for at least one self-test call of an
    admitted backend (automatic choice, without the self-test gate)."""
    rows = rows or load_registry()
    env = {k: v for k, v in os.environ.items() if k not in ("GDN_BACKEND", "TRITON_INTERPRET")}
    env[gate.ENV_VAR] = "0"
    specs = {case.call_spec() for r in rows if r.name in admitted_backends(device, rows)
             for case in cases_for(r, quick=False, small=small)}
    return {explain(device, call, env=env, rows=rows).selected for call in specs} - {None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``selftest`` subcommand's flags."""
    parser.add_argument("--device", type=device_arg, default=None, metavar="N",
                        help="CUDA device index (or cuda:N, cpu); default: cuda:0 if present, else cpu")
    parser.add_argument("--backend", type=backend_arg(lambda: [r.name for r in load_registry()]),
                        help="only this backend (on the CPU, triton_generic runs under TRITON_INTERPRET=1)")
    parser.add_argument("--quick", action="store_true",
                        help="the gate's three calls instead of the full set")
    parser.add_argument("--timeout", type=seconds_arg, default=None, metavar="S",
                        help="seconds per backend before its child is killed (default 300 with --quick, else 900)")


def _device(label: str | None):
    """DeviceInfo for ``--device`` (default: cuda:0 when there is one, else the CPU)."""
    probe = default_probe()
    if label is None:
        label = "cuda:0" if probe.count() > 0 else "cpu"
    index = cuda_index(label, probe)
    return CPU if index is None else probe.info(index)


def _backends(device, name: str | None) -> list[str]:
    """The backends to test: ``name`` (checked against the device) or every admitted one."""
    if name is None:
        return admitted_backends(device)
    spec = next(r for r in load_registry() if r.name == name)
    reason = device_reason(spec, device, explicit=True, interpret=True) or version_reason(spec)
    if reason:
        raise UsageError(f"argument --backend: {name} cannot run on {device.label} ({device.name}, "
                         f"{device.arch}): {reason}")
    return [name]


def format_table(results: list, picked: set[str]) -> str:
    """One row per backend: cases passed, worst error, seconds, verdict."""
    header = ["backend", "picked", "cases", "worst error", "seconds", "verdict"]
    rows = [header]
    for r in results:
        worst = "-" if math.isnan(r.worst_error) else f"{r.worst_error:.2e}"
        verdict = "PASS" if r.status == "passed" else f"{r.status.upper()}: {r.reason}"
        rows.append([r.backend, "yes" if r.backend in picked else "no", f"{r.passed}/{r.total}", worst,
                     f"{r.seconds:.1f}", verdict])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]).rstrip() for row in rows)


def run(args: argparse.Namespace) -> int:
    """``python -m gdn_dispatch selftest``: test, print the table, record the verdicts.

    Returns 0 when every backend the registry would pick passes (or, with ``--backend``,
    when that backend passes), else 1.
    """
    device = _device(args.device)
    names = _backends(device, args.backend)
    limit = args.timeout or TIMEOUT_S[args.quick]
    picked = picked_backends(device, small=device.kind == "cpu")
    print(f"self-test on {device.label} ({device.name}, {device.arch}): {', '.join(names)}; "
          f"{'quick' if args.quick else 'full'} set, {limit:g} s limit per backend", flush=True)
    results = []
    for name in names:
        spec = next(r for r in load_registry() if r.name == name)
        total = len(cases_for(spec, quick=args.quick, small=device.kind == "cpu"))
        progress = Progress(total, name)
        result = gate.run_child(name, device.label, quick=args.quick, timeout_s=limit,
                                on_case=lambda case, p=progress: p.step(f"{case['id']} "
                                                                         f"{'ok' if case['ok'] else 'FAIL'}"))
        progress.close()
        results.append(result)
        if device.kind == "cuda":
            gate.record_verdict(gate.verdict_key(name, device), result)
    print(format_table(results, picked))
    if device.kind == "cuda":
        print(f"verdicts recorded for the self-test gate in {gate.cache_dir()}")
    must_pass = set(names) if args.backend else picked & set(names)
    failed = [r.backend for r in results if r.backend in must_pass and r.status != "passed"]
    print(f"selftest: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}"
          + ("" if args.backend else f"; the registry picks {', '.join(sorted(picked)) or 'nothing'} here"))
    return 1 if failed or not must_pass else 0


def main(argv: list[str] | None = None) -> int:
    """The child's entry point: ``python -m gdn_dispatch.selftest --child NAME --device D``."""
    parser = argparse.ArgumentParser(prog="python -m gdn_dispatch.selftest",
                                     description="one backend's self-test cases (the child of selftest)")
    parser.add_argument("--child", required=True, metavar="BACKEND")
    parser.add_argument("--device", type=device_arg, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    return child_main(args.child, args.device, args.quick)


if __name__ == "__main__":
    sys.exit(main())
