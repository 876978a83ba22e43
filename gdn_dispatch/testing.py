"""Random GDN calls and the error metric, shared by the tests, the CLI and the benchmarks.

Inputs are drawn the way a Qwen3.5 layer produces them, so that decays, step sizes and
state magnitudes are realistic: k (and q) unit-norm, g = logsigmoid(randn) (a decay in
(0, 1) per token), beta = sigmoid(randn), a small random initial state.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F


def rel_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (fla's relative RMS metric).

    NaN or Inf anywhere in ``actual`` gives ``inf``, so an unwritten (NaN-poisoned) or
    blown-up output never passes a tolerance.
    """
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(a.device, torch.float64)
    if a.shape != e.shape:
        raise ValueError(f"rel_rms_error: shapes differ, {tuple(a.shape)} vs {tuple(e.shape)}")
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    denom = e.norm()
    if denom == 0:
        return float((a - e).norm())
    return float((a - e).norm() / denom)


def random_call(
    *,
    lengths: list[int] | None = None,
    batch: tuple[int, int] | None = None,
    H: int = 2,
    HV: int = 4,
    K: int = 32,
    V: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    initial_state: bool = True,
    state_layout: str = "kv",
    normalize_qk: bool = True,
    key_cosine: float = 0.0,
) -> dict:
    """Keyword arguments for one random ``chunk_gated_delta_rule`` call.

    Give either ``lengths`` (a packed ragged batch: B = 1 with cu_seqlens and
    cu_seqlens_cpu) or ``batch = (B, T)`` (a uniform batch). ``normalize_qk=False`` leaves
    q and k un-normalized, for calls that ask the kernel to l2-normalize them.
    ``key_cosine`` > 0 draws strongly correlated keys, as neighbouring tokens of a real
    layer have: each k row is ``key_cosine * d + (1 - key_cosine) * noise`` for one random
    direction ``d`` per (batch row, head), with beta in (0.5, 1) and gates close to 1
    (``|g| < 0.01``), the regime where ``(I + A)^-1`` has its largest entries.
    Returns q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g, beta ``[B, T, HV]`` float32;
    initial_state float32 in ``state_layout`` (or None); cu_seqlens / cu_seqlens_cpu; and
    state_layout.
    """
    if (lengths is None) == (batch is None):
        raise ValueError("random_call: give exactly one of lengths or batch")
    gen = torch.Generator().manual_seed(seed)
    if lengths is not None:
        B, T = 1, int(sum(lengths))
        cu_host = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        N = len(lengths)
    else:
        B, T = batch
        cu_host = None
        N = B

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if key_cosine:
        direction = F.normalize(randn(B, 1, H, K), dim=-1) * K ** 0.5
        k = key_cosine * direction + (1.0 - key_cosine) * k
    if normalize_qk:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    call = dict(
        q=q.to(dtype),
        k=k.to(dtype),
        v=randn(B, T, HV, V).to(dtype),
        g=F.logsigmoid(randn(B, T, HV)) if not key_cosine else -0.01 * torch.rand(B, T, HV, generator=gen),
        beta=torch.sigmoid(randn(B, T, HV)) if not key_cosine else 0.5 + 0.5 * torch.rand(B, T, HV, generator=gen),
        initial_state=None,
        state_layout=state_layout,
    )
    if initial_state:
        dims = (K, V) if state_layout == "kv" else (V, K)
        call["initial_state"] = 0.1 * randn(N, HV, *dims)
    if cu_host is not None:
        call["cu_seqlens"] = cu_host
        call["cu_seqlens_cpu"] = cu_host
    out = {}
    for name, value in call.items():
        out[name] = value.to(device) if isinstance(value, torch.Tensor) and name != "cu_seqlens_cpu" else value
    return out


class StandInProbe:
    """A device probe for tests: stand-in GPUs of the given architectures (``"sm_90"``...),
    indexed in order, and the CPU; none means a machine without a CUDA driver. Install it
    with ``gdn_dispatch.device.use_probe``."""

    def __init__(self, *archs: str):
        import dataclasses

        from gdn_dispatch.device import assumed_device

        self.devices = [dataclasses.replace(assumed_device(a), index=i) for i, a in enumerate(archs)]
        self.unavailable_reason = None if archs else "no CUDA driver"

    def count(self) -> int:
        return len(self.devices)

    def info(self, index: int):
        return self.devices[index]

    def all(self) -> list:
        from gdn_dispatch.device import CPU

        return [*self.devices, CPU]

    def for_torch_device(self, device):
        from gdn_dispatch.device import CPU

        return CPU if device.type == "cpu" else self.devices[device.index or 0]


def forgetting_start(g: torch.Tensor, beta: torch.Tensor, k_norm2: torch.Tensor, negligible_log2: float,
                     chunk: int = 64) -> tuple[int, bool]:
    """The host's model of context parallelism's forgetting rule (pass 1 drops what a
    segment provably forgets) on one segment and v-head: ``g`` the natural-log gates,
    ``beta``, ``k_norm2`` the keys' squared norms (after the l2 norm where the call asks
    for it), each ``[n]``; ``negligible_log2`` the backends' bound (their
    ``MAP_NEGLIGIBLE_LOG2``). Returns the first chunk of the shortest suffix of
    ``chunk``-token chunks whose gates sum below ``negligible_log2`` bits and whose tokens
    hold ``min beta >= 0`` and ``max beta * max ||k||^2 <= 2`` (or -1), and whether a sum
    or that product sits within float32-rounding reach of its threshold (a kernel may then
    decide either way)."""
    n = g.shape[0]
    log2e = math.log2(math.e)
    sums = [float(g[c:c + chunk].double().sum()) * log2e for c in range(0, n, chunk)]
    suffix = [sum(sums[c:]) for c in range(len(sums))]
    near = any(abs(x - negligible_log2) < 2 for x in suffix)
    f0 = max((c for c, x in enumerate(suffix) if x < negligible_log2), default=-1)
    if f0 >= 0:
        b, x = beta[chunk * f0:].double(), k_norm2[chunk * f0:].double()
        product = float(b.max()) * float(x.max())
        near |= abs(product - 2) < 1e-2
        if not (float(b.min()) >= 0 and product <= 2):
            f0 = -1
    return f0, near


def random_walk_lengths(gen: torch.Generator, n: int) -> list[int]:
    """``n`` sequence lengths that exercise the longest-first walk order: a few distinct
    chunk counts (ties), empty sequences, tails, and one long sequence at a random place."""
    pool = torch.tensor([0, 1, 63, 64, 65, 200, 640, 641, 4000])
    lengths = pool[torch.randint(0, len(pool), (n,), generator=gen)].tolist()
    lengths[int(torch.randint(0, n, (1,), generator=gen))] = 9000
    return lengths


def runnable_gpu_backends() -> list[str]:
    """The kernel backends the registry lets run a Qwen3.5-shaped bf16 varlen call on the
    current CUDA device (forced one by one), for GPU tests parametrized per backend; [] with
    no GPU."""
    if not torch.cuda.is_available():
        return []
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.device import default_probe
    from gdn_dispatch.registry import GDNDispatchError, select

    call = random_call(lengths=[70, 31], H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, device="cuda")
    device = default_probe().for_torch_device(torch.device("cuda"))
    names = []
    for name in ("gluon_sm100", "gluon_sm90", "triton_generic"):
        try:
            select(device, make_problem(**call, backend=name))
            names.append(name)
        except GDNDispatchError:
            pass
    return names


def fused_projection_views(call: dict) -> dict:
    """q, k, v, g, beta of ``call`` as views of one ``[B, T, 2 H K + HV V + 2 HV]`` tensor in
    q's dtype, as a model splits one fused projection: token rows whose token stride is wider
    than each tensor's own row (``contract.token_rows_stride``)."""
    B, T, H, K = call["q"].shape
    HV, V = call["v"].shape[2:]
    parts = [call["q"].reshape(B, T, H * K), call["k"].reshape(B, T, H * K), call["v"].reshape(B, T, HV * V),
             call["g"].to(call["q"].dtype), call["beta"].to(call["q"].dtype)]
    views = torch.split(torch.cat(parts, dim=-1), [p.shape[-1] for p in parts], dim=-1)
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, HV, V), (B, T, HV), (B, T, HV)]
    return {name: view.view(shape) for name, view, shape in zip(("q", "k", "v", "g", "beta"), views, shapes)}


def padded_pool(num_seqs: int, num_v_heads: int, dims: tuple[int, ...], dtype: torch.dtype, seed: int,
                device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A state pool as a server holds one, for tests: ``N + 2`` rows of ``0.1 * randn`` in
    ``dtype`` (``[N + 2, HV, *dims]``), int32 indices ``[N]`` drawn without repeats with
    index 1 set to -1 (CUDA-graph padding) when ``N > 1``, and the float32 initial states
    ``[N, HV, *dims]`` they gather (zeros for -1), all on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    pool = (0.1 * torch.randn(num_seqs + 2, num_v_heads, *dims, generator=gen)).to(dtype).to(device)
    idx = torch.randperm(num_seqs + 2, generator=gen)[:num_seqs].to(torch.int32)
    if num_seqs > 1:
        idx[1] = -1
    idx = idx.to(device)
    live = idx >= 0
    gathered = torch.zeros(num_seqs, num_v_heads, *dims, device=device)
    gathered[live] = pool[idx[live].long()].float()
    return pool, idx, gathered


def pooled_call(call: dict, dtype: torch.dtype, seed: int = 9) -> tuple[dict, dict, dict]:
    """``call`` (a :func:`random_call` with an initial state) on a :func:`padded_pool` of
    ``dtype`` instead: ``(the call reading and writing back the pool's rows, its extra
    keywords state_indices and inplace_final_state, the call the reference takes: the
    gathered float32 initial states)``."""
    N, HV, *dims = call["initial_state"].shape
    rows, idx, gathered = padded_pool(N, HV, tuple(dims), dtype, seed=seed, device=call["v"].device)
    extra = dict(state_indices=idx, inplace_final_state=True)
    return {**call, "initial_state": rows}, extra, {**call, "initial_state": gathered}


def random_problem(*, layout: str = "kv", h0: bool = True, ht: bool = False, l2: bool = False, **call):
    """A validated GDNProblem of one :func:`random_call` (``call``: its shape, head, dtype,
    device and seed keywords), with the initial state ``h0`` in ``layout``, the final
    state asked when ``ht`` and the in-kernel qk l2 norm when ``l2`` (q and k then raw)."""
    from gdn_dispatch.contract import make_problem

    kwargs = random_call(initial_state=h0, state_layout=layout, normalize_qk=not l2, **call)
    return make_problem(**kwargs, output_final_state=ht, use_qk_l2norm_in_kernel=l2)


#: (shape keywords of :func:`random_problem`, test id) of the plan tests: varlen with every
#: kind of chunk (1, 63, 64, 65, 130 tokens and an empty sequence), a uniform batch, a
#: uniform batch with tails, varlen whose lengths are whole chunks.
PLAN_SHAPES = (
    (dict(lengths=[1, 63, 64, 65, 130, 0]), "varlen-1-63-64-65-130-0"),
    (dict(batch=(2, 128)), "B2-T128"),
    (dict(batch=(3, 100)), "B3-T100-tails"),
    (dict(lengths=[64, 128]), "varlen-no-tails"),
)


def poison_cuda_allocator() -> None:
    """Fill the CUDA caching allocator's free blocks with NaN: an output element a kernel
    leaves unwritten then reads as NaN (an infinite error) instead of stale data."""
    blocks = [torch.full((1 << 18,), float("nan"), device="cuda") for _ in range(16)]
    blocks.append(torch.full((1 << 24,), float("nan"), device="cuda"))
    del blocks


class LaunchRecorder:
    """Stands in for a JIT kernel in CPU tests of a host wrapper: ``recorder[grid](**kwargs)``
    records the launch instead of running it.

    Attributes
    ----------
    arg_names : the replaced kernel's parameter names (what a launch must bind).
    launched : the last launch's ``grid`` and keyword arguments (launch options included).
    """

    def __init__(self, kernel):
        self.arg_names = kernel.arg_names
        self.launched: dict = {}

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.launched.update(grid=grid, **kwargs)
        return launch


def triton_shaped_launcher(launch):
    """An object that runs like Triton 3.6's ``CudaLauncher`` (its own ``__call__``; no
    scratch buffers, no cooperative or PDL launch) around the C launch ``launch``: for CPU
    tests of the direct launch paths, which read it as they read Triton's
    (``gluon_common.compat.raw_launch``)."""
    from triton.backends.nvidia.driver import CudaLauncher

    class Launcher:
        num_ctas, launch_cooperative_grid, launch_pdl = 1, False, False
        global_scratch_size = profile_scratch_size = 0
        global_scratch_align = profile_scratch_align = 1
        __call__ = CudaLauncher.__call__

    launcher = Launcher()
    launcher.launch = launch
    return launcher


@contextlib.contextmanager
def hang_guard(seconds: float, fd: int | None = None):
    """Ends the process (exit status 1, every thread's Python stack written to file
    descriptor ``fd``, stderr's by default) if the block is still running after
    ``seconds``; nothing when it finishes in time, or when ``seconds`` <= 0. A GPU kernel
    that never finishes (a deadlocked mbarrier protocol) holds its thread in a CUDA wait
    that no exception reaches, so a test run would stall until its job's limit instead of
    failing on the stuck test; the watchdog is faulthandler's C thread, which needs no GIL."""
    if seconds <= 0:
        yield
        return
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr if fd is None else fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


#: Values a build flag setting may read as a boolean (:func:`set_build_flags`).
_FLAG_WORDS = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}


def set_build_flags(settings: list[str]) -> dict:
    """Sets kernel build flags (module globals such as
    ``gluon_common.blocked_inverse.HALF_TABLES``) from ``MODULE.NAME=VALUE`` strings,
    MODULE under ``gdn_dispatch.backends``; VALUE 1/0, true/false, on/off or an integer.
    A flag held as a ``gl.constexpr`` stays one. For whole test or sanitizer runs on a build
    not shipped: call it before any kernel compiles (a jit function's globals are fixed at
    its first compile). Returns ``{setting's name: value set}``; raises ``ValueError``
    naming the setting on a malformed one, an unknown module or flag, or a value of
    another type than the flag's."""
    import importlib

    done = {}
    for setting in settings:
        name, sep, raw = setting.partition("=")
        module_name, _, flag = name.strip().rpartition(".")
        if not sep or not module_name or not flag:
            raise ValueError(f"build flag {setting!r}: expected MODULE.NAME=VALUE")
        try:
            module = importlib.import_module(f"gdn_dispatch.backends.{module_name}")
        except ModuleNotFoundError as err:
            raise ValueError(f"build flag {setting!r}: no module gdn_dispatch.backends.{module_name}") from err
        if not hasattr(module, flag):
            raise ValueError(f"build flag {setting!r}: {module.__name__} has no flag {flag}")
        current = getattr(module, flag)
        held = getattr(current, "value", current) if type(current).__name__ == "constexpr" else current
        word = raw.strip().lower()
        if isinstance(held, bool) and word in _FLAG_WORDS:
            value = _FLAG_WORDS[word]
        elif isinstance(held, int) and not isinstance(held, bool) and word.lstrip("-").isdigit():
            value = int(word)
        else:
            raise ValueError(f"build flag {setting!r}: {module.__name__}.{flag} holds {held!r}, "
                             f"which {raw.strip()!r} does not replace")
        setattr(module, flag, type(current)(value) if current is not held else value)
        done[name.strip()] = value
    return done


def script_module(path, name: str):
    """The script at ``path`` (a benchmark or tool, not a package module) loaded as a module
    named ``name``, registered under that name (a dataclass of the script looks its module
    up there)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def call_in_fresh_process(path, call: str, build_flags=(), timeout: float = 900.0):
    """The value of ``call``, a Python expression over the module at ``path`` (named ``m``
    in it), evaluated in a new interpreter with ``build_flags`` set first
    (:func:`set_build_flags`) and passed back as JSON (tuples come back as lists): the
    way to compile or run a build whose flags are jit globals, fixed in a process at its
    first compile. Raises ``RuntimeError`` with the child's stderr tail when it fails."""
    import json
    import subprocess
    import sys

    code = ("import json\n"
            "from gdn_dispatch.testing import script_module, set_build_flags\n"
            f"set_build_flags({list(build_flags)!r})\n"
            f"m = script_module({str(path)!r}, 'm')\n"
            f"print(json.dumps({call}))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(f"{call} in a fresh process (flags {list(build_flags)}) failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.splitlines()[-1])
