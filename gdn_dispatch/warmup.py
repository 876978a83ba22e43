"""Warm-up: compile, before serving, every kernel specialization a stream of ragged calls
with given head dims can hit on a device, so that no later call compiles.

:mod:`gdn_dispatch.warmup_plan` decides which calls cover every specialization (from the
backends' own launch planners, per call class: a pool call may run on another backend than
a plain one); :func:`warmup` runs those calls on the device (small inputs, a progress bar on
stderr) and reports what it compiled and how long it took. Specializations outside the
spec's variants (another input layout, a forced ``context_parallel`` count) are warmed by
handing one real call as ``example``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass

import torch

from gdn_dispatch.contract import StateLayout
from gdn_dispatch.envvars import getenv
from gdn_dispatch.device import default_probe
from gdn_dispatch.progress import Progress
from gdn_dispatch.warmup_plan import (
    INPUT_LAYOUTS, OFFSET_DTYPES, WarmupCall, WarmupPlan, WarmupSpec, make_call, plan_warmup,
)


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warmup` did: the backends its calls ran on, the device, calls run,
    specializations covered, compiles (or loads from Triton's disk cache), call classes no
    backend admits, seconds."""

    backends: tuple[str, ...]
    device: str
    calls: int
    keys: int
    compiles: int
    seconds: float
    unadmitted: int = 0
    #: The native host layer after the warmup (:func:`gdn_dispatch.native.status`), or "".
    native: str = ""

    def format(self) -> str:
        names = ", ".join(self.backends) or "no backend"
        skipped = f"; {self.unadmitted} call classes no backend admits" if self.unadmitted else ""
        native = f"; native host layer {self.native}" if self.native else ""
        return (f"warmup: {names} on {self.device}: {self.calls} calls covering {self.keys} kernel "
                f"specializations, {self.compiles} compiled (or loaded from Triton's cache), "
                f"{self.seconds:.1f} s{skipped}{native}")


class CompileCounter:
    """Counts ``triton.compile`` runs (a compile or a load from Triton's disk cache) through
    ``triton.knobs.compilation.listener``, chaining any listener already set; ``kernels``
    names each one's kernel, in order, with its constexprs where Triton states them."""

    def __init__(self):
        self.count = 0
        self.kernels: list[str] = []
        self._previous = None

    def __enter__(self):
        from triton import knobs

        self._previous = knobs.compilation.listener
        knobs.compilation.listener = self
        return self

    def __call__(self, *args, **kwargs):
        self.count += 1
        self.kernels.append(_describe_source(kwargs.get("src", args[0] if args else None)))
        if self._previous is not None:
            self._previous(*args, **kwargs)

    def __exit__(self, *exc):
        from triton import knobs

        knobs.compilation.listener = self._previous


def _describe_source(src) -> str:
    """A compiled source's kernel name and constexprs (Triton keys them by argument path)."""
    name = getattr(src, "name", None) or type(src).__name__
    constants = getattr(src, "constants", None) or {}
    arg_names = getattr(getattr(src, "fn", None), "arg_names", ())

    def label(path):
        if isinstance(path, tuple) and len(path) == 1 and path[0] < len(arg_names):
            return arg_names[path[0]]
        return str(path)

    shown = ", ".join(f"{label(path)}={value}" for path, value in constants.items()
                      if isinstance(value, (bool, int, float, str)))
    return f"{name}({shown})"


def warmup(
    *,
    num_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    state_layout: str = "kv",
    device: torch.device | str | None = None,
    use_qk_l2norm: bool = True,
    backend: str | None = None,
    max_num_seqs: int = 64,
    g_dtype: torch.dtype = torch.float32,
    beta_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype = torch.float32,
    pool_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    pool_inplace: tuple[bool, ...] = (True,),
    pool_size: int | None = None,
    index_dtype: torch.dtype = torch.int32,
    input_layouts: tuple[str, ...] = INPUT_LAYOUTS,
    host_offsets: tuple[bool, ...] = (True, False),
    offset_dtypes: tuple[torch.dtype, ...] = OFFSET_DTYPES,
    example: dict | None = None,
    progress: bool = True,
) -> WarmupReport:
    """Compile every kernel specialization that calls with these dims can hit on ``device``.

    Parameters
    ----------
    num_heads, num_v_heads, head_k_dim, head_v_dim : ``H``, ``HV``, ``K``, ``V``.
    dtype : dtype of q, k, v. ``g_dtype``, ``beta_dtype`` (None: ``dtype``) and
        ``state_dtype``: the gate's, beta's and initial state's, as the model passes them.
    state_layout : "kv" or "vk". ``use_qk_l2norm``: the model's ``use_qk_l2norm_in_kernel``.
    device : the CUDA device (default: the current one); on a CPU device there is nothing
        to compile.
    backend : force a backend for every call (default: the registry's choice per call).
    max_num_seqs : the most sequences one call will carry.
    pool_dtypes : dtypes of the state pools ``[P, HV, K, V]`` / ``[P, HV, V, K]`` passed
        with ``state_indices`` (``()``: the server passes no pools). ``pool_inplace``: the
        ``inplace_final_state`` values used with them. ``pool_size``: P (None: any; no
        kernel specializes on it). ``index_dtype``: dtype of ``state_indices`` (int32 or int64).
    input_layouts : "contiguous" and/or "fused_qkv" (q, k, v views of one
        ``[B, T, 2 H K + HV V]`` projection, in that order).
    host_offsets : varlen calls with ``cu_seqlens_cpu`` (True), without it (False), or both.
    offset_dtypes : dtypes of ``cu_seqlens`` the server passes (int32 and/or int64; each is
        a compile of every kernel a varlen call runs).
    example : optional keyword arguments of one real call (any other layout or argument):
        run once after the plan, on the backend the registry picks for it.
    progress : progress on stderr.

    Returns
    -------
    WarmupReport : backends, device, calls run, specializations covered, compiles, seconds.
    """
    started = time.perf_counter()
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", default_probe().for_torch_device(device).index)
    spec = WarmupSpec(num_heads, num_v_heads, head_k_dim, head_v_dim, dtype, StateLayout.parse(state_layout).value,
                      use_qk_l2norm, g_dtype, beta_dtype, state_dtype, max_num_seqs,
                      pool_dtypes=tuple(pool_dtypes), pool_inplace=tuple(pool_inplace), pool_size=pool_size,
                      index_dtype=index_dtype, input_layouts=tuple(input_layouts), host_offsets=tuple(host_offsets),
                      offset_dtypes=tuple(offset_dtypes))
    info = default_probe().for_torch_device(device)
    if device.type != "cuda":
        from gdn_dispatch.warmup_plan import call_keys

        chosen, _ = call_keys(spec, WarmupCall((64, 1), None, True, True), info, backend)
        return WarmupReport((chosen,) if chosen else (), str(device), 0, 0, 0, time.perf_counter() - started)
    native = build_native(progress)  # before the calls: their launchers are made at their first launch
    with torch.inference_mode():
        plan = plan_warmup(spec, info, backend, tensor_device=device)
    report = run_plan(plan, device, example=example, backend=backend, progress=progress, started=started)
    return dataclasses.replace(report, native=native)


def build_native(progress: bool = True) -> str:
    """Build (once per machine) and load the native host layer unless it is turned off
    (:mod:`gdn_dispatch.native`); its status line. A machine that cannot build it (no C++
    compiler or ninja) keeps the Python launchers: the line says why."""
    from gdn_dispatch import native

    if getenv(native.NATIVE_ENV) == "0":
        return native.status()
    try:
        native.build(log=(lambda message: print(message, file=sys.stderr)) if progress else (lambda message: None))
    except RuntimeError as exc:
        return f"not built ({exc}); the Python launchers serve"
    return native.status()


def run_plan(plan: WarmupPlan, device: torch.device, *, example: dict | None = None, backend: str | None = None,
             progress: bool = True, started: float | None = None) -> WarmupReport:
    """Run ``plan``'s calls (each on its backend) and ``example`` on ``device``, counting
    compiles."""
    from gdn_dispatch.api import chunk_gated_delta_rule

    started = time.perf_counter() if started is None else started
    runs = [(f"{name}: {call.label()}", call, name) for call, name in plan.calls]
    if example is not None:
        runs.append(("example call", None, backend))
    bar = Progress(len(runs), "warmup") if progress else None
    with CompileCounter() as counter, torch.inference_mode():
        for i, (label, call, name) in enumerate(runs):
            kwargs = example if call is None else make_call(plan.spec, call, device, random=True, seed=i)
            chunk_gated_delta_rule(**(kwargs if name is None else {**kwargs, "backend": name}))
            if bar:
                bar.step(label)
        torch.cuda.synchronize(device)
    if bar:
        bar.close()
    return WarmupReport(plan.backends, str(device), len(runs), len(plan.keys), counter.count,
                        time.perf_counter() - started, len(plan.unadmitted))


# --- command line -----------------------------------------------------------------------

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}
_INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}
_HOST_OFFSETS = {"both": (True, False), "given": (True,), "absent": (False,)}


def _name_list(choices, allow_none: bool = True):
    """argparse type: a comma-separated list of names from ``choices`` ("none": empty,
    where ``allow_none``)."""
    import argparse

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        if names == ("none",) and allow_none:
            return ()
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {sorted(choices)}"
                                             f"{' or ' + repr('none') if allow_none else ''}, got {text!r}")
        return names

    return parse


def add_arguments(parser) -> None:
    from gdn_dispatch.contract import MAX_HEAD_DIM
    from gdn_dispatch.registry import backend_names
    from gdn_dispatch.usage import backend_arg, device_arg, int_arg

    parser.add_argument("--heads", type=int_arg(1), required=True, help="H, q/k heads (per device)")
    parser.add_argument("--v-heads", type=int_arg(1), required=True,
                        help="HV, value heads (per device), a multiple of H")
    parser.add_argument("--head-k-dim", type=int_arg(1, MAX_HEAD_DIM), default=128, help="K (default 128)")
    parser.add_argument("--head-v-dim", type=int_arg(1, MAX_HEAD_DIM), default=128, help="V (default 128)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="q/k/v dtype (default bf16)")
    parser.add_argument("--g-dtype", choices=sorted(_DTYPES), default="fp32", help="gate dtype (default fp32)")
    parser.add_argument("--beta-dtype", choices=sorted(_DTYPES), default=None, help="beta dtype (default: --dtype)")
    parser.add_argument("--state-layout", choices=["kv", "vk"], default="kv")
    parser.add_argument("--no-qk-l2norm", action="store_true", help="calls pass use_qk_l2norm_in_kernel=False")
    parser.add_argument("--max-seqs", type=int_arg(1), default=64, help="most sequences per call (default 64)")
    parser.add_argument("--pool-dtypes", type=_name_list(("fp32", "bf16")), default=("fp32", "bf16"),
                        help="dtypes of the state pools passed with state_indices, e.g. bf16, or none "
                             "(default fp32,bf16)")
    parser.add_argument("--pool-size", type=int_arg(1), default=None,
                        help="rows P of the state pool (default: warm P divisible by 16 and not)")
    parser.add_argument("--index-dtype", choices=sorted(_INDEX_DTYPES), default="int32",
                        help="dtype of state_indices (default int32)")
    parser.add_argument("--layouts", type=_name_list(INPUT_LAYOUTS, allow_none=False), default=INPUT_LAYOUTS,
                        help=f"input layouts: {', '.join(INPUT_LAYOUTS)} (default both)")
    parser.add_argument("--host-offsets", choices=sorted(_HOST_OFFSETS), default="both",
                        help="varlen calls pass cu_seqlens_cpu (given), do not (absent), or both (default)")
    parser.add_argument("--offset-dtypes", type=_name_list(tuple(_INDEX_DTYPES), allow_none=False),
                        default=tuple(_INDEX_DTYPES), help="dtypes of cu_seqlens, e.g. int32 (default int32,int64)")
    parser.add_argument("--device", type=device_arg, default=None,
                        help="cuda or cuda:N (default: the current CUDA device; cpu has nothing to compile)")
    parser.add_argument("--backend", type=backend_arg(backend_names), default=None,
                        help="force a backend (default: the registry's choice per call)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run(args) -> int:
    from gdn_dispatch.usage import UsageError, cuda_index

    if args.v_heads % args.heads:
        raise UsageError(f"argument --v-heads: expected a multiple of --heads {args.heads}, got {args.v_heads}")
    device = args.device
    if device is not None:
        index = cuda_index(device, default_probe())
        device = "cpu" if index is None else f"cuda:{index}"
    report = warmup(
        num_heads=args.heads, num_v_heads=args.v_heads, head_k_dim=args.head_k_dim, head_v_dim=args.head_v_dim,
        dtype=_DTYPES[args.dtype], g_dtype=_DTYPES[args.g_dtype],
        beta_dtype=_DTYPES[args.beta_dtype] if args.beta_dtype else None, state_layout=args.state_layout,
        use_qk_l2norm=not args.no_qk_l2norm, max_num_seqs=args.max_seqs, device=device, backend=args.backend,
        pool_dtypes=tuple(_DTYPES[d] for d in args.pool_dtypes), pool_size=args.pool_size,
        index_dtype=_INDEX_DTYPES[args.index_dtype], input_layouts=args.layouts,
        host_offsets=_HOST_OFFSETS[args.host_offsets],
        offset_dtypes=tuple(_INDEX_DTYPES[d] for d in args.offset_dtypes), progress=not args.quiet,
    )
    print(report.format())
    return 0


__all__ = ["CompileCounter", "WarmupReport", "run_plan", "warmup"]
