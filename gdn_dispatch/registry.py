"""Backend selection: registry.toml rows, checked against a device and a call.

Each check is a *reason function*: it returns the first reason a row cannot serve, or
None. Automatic selection walks rows by priority and takes the first with no reason; an
explicit choice (the ``backend=`` argument or ``GDN_BACKEND``) turns the reason into an
error instead of moving on. Backend modules are imported only when a row is about to be
taken; an import failure becomes that row's reason, verbatim.

A row with ``verified_on`` capabilities passes the self-test gate (:mod:`gdn_dispatch.gate`)
on any other capability before automatic selection takes it; a forced choice is not gated.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from gdn_dispatch import gate
from gdn_dispatch.context_parallel import plan_for_problem
from gdn_dispatch.device import DeviceInfo, default_probe
from gdn_dispatch.envvars import getenv

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ENV_VAR = "GDN_BACKEND"
_FEATURES = ("varlen", "grouped_value_heads", "initial_state", "final_state", "qk_l2norm", "state_pool",
             "context_parallel")


class GDNDispatchError(RuntimeError):
    """No backend can run this call, or an explicit backend choice cannot be honoured."""


@dataclass(frozen=True)
class BackendSpec:
    """One registry.toml row. Field meanings are documented at the top of registry.toml."""

    name: str
    module: str
    priority: int
    device: str
    capabilities: tuple[tuple[int, int], ...] | None
    min_capability: tuple[int, int] | None
    interpreter_on_cpu: bool
    requires: tuple[tuple[str, str], ...]
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...] | None
    max_head_dim: int
    features: frozenset[str]
    state_layouts: tuple[str, ...]
    verified_on: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class CallSpec:
    """The parts of a call that decide which backend may run it."""

    dtype: str = "bfloat16"
    K: int = 128
    V: int = 128
    varlen: bool = True
    grouped_value_heads: bool = True
    state_layout: str = "kv"
    initial_state: bool = True
    final_state: bool = True
    qk_l2norm: bool = False
    state_pool: bool = False
    #: A segment count forced (``context_parallel=n``); "auto" and "off" need no support.
    context_parallel: bool = False

    @classmethod
    def from_problem(cls, problem) -> "CallSpec":
        return cls(
            dtype=str(problem.dtype).removeprefix("torch."),
            K=problem.K,
            V=problem.V,
            varlen=problem.is_varlen,
            grouped_value_heads=problem.HV != problem.H,
            state_layout=problem.state_layout.value,
            initial_state=problem.initial_state is not None,
            final_state=problem.output_final_state,
            qk_l2norm=problem.use_qk_l2norm,
            state_pool=problem.uses_state_pool,
            context_parallel=isinstance(problem.context_parallel, int),
        )


#: A Qwen3.5-shaped call (the one `info` explains when no call is given).
QWEN35_CALL = CallSpec()


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str  # "selected", "rejected", "passed over", "not available"
    reason: str


@dataclass(frozen=True)
class Explanation:
    """Every row's verdict for one device and call, and the row chosen (or None)."""

    device: DeviceInfo
    call: CallSpec
    verdicts: tuple[Verdict, ...]
    selected: str | None
    forced: str | None = None
    forced_by: str | None = None
    #: The context-parallel decision for the explained call (only with a problem).
    context_parallel: str | None = None
    #: What the chosen backend launches for the call, where it can say (only with a problem).
    launches: str | None = None

    def format(self) -> str:
        lines = []
        if self.forced:
            lines.append(f"  forced: {self.forced} (by {self.forced_by})")
        width = max(len(v.name) for v in self.verdicts)
        for v in self.verdicts:
            lines.append(f"  {v.name:<{width}}  {v.status:<13}  {v.reason}")
        if self.context_parallel is not None:
            lines.append(f"  context parallel: {self.context_parallel}")
        if self.launches is not None:
            lines.append(f"  launches: {self.launches}")
        lines.append(f"selected: {self.selected or 'NONE'}")
        return "\n".join(lines)


def _parse_capability(text: str) -> tuple[int, int]:
    major, minor = str(text).split(".")
    return int(major), int(minor)


def registry_path() -> Path:
    """registry.toml: inside the package in a wheel, at the project root in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "registry.toml", here.parent / "registry.toml"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"registry.toml not found next to {here} or in {here.parent}")


@functools.cache
def load_registry(path: Path | None = None) -> tuple[BackendSpec, ...]:
    """Parse registry.toml into BackendSpec rows, highest priority first."""
    with open(path or registry_path(), "rb") as f:
        data = tomllib.load(f)
    rows = []
    for raw in data.get("backend", []):
        caps = raw.get("capabilities")
        floor = raw.get("min_capability")
        verified = raw.get("verified_on")
        rows.append(BackendSpec(
            name=raw["name"],
            module=raw["module"],
            priority=int(raw["priority"]),
            device=raw["device"],
            capabilities=None if caps is None else tuple(_parse_capability(c) for c in caps),
            min_capability=None if floor is None else _parse_capability(floor),
            interpreter_on_cpu=bool(raw.get("interpreter_on_cpu", False)),
            requires=tuple(sorted(raw.get("requires", {}).items())),
            dtypes=tuple(raw["dtypes"]),
            head_dims=None if "head_dims" not in raw else tuple(raw["head_dims"]),
            max_head_dim=int(raw["max_head_dim"]),
            features=frozenset(f for f in _FEATURES if raw.get(f, False)),
            state_layouts=tuple(raw["state_layouts"]),
            verified_on=None if verified is None else tuple(_parse_capability(c) for c in verified),
        ))
    names = [r.name for r in rows]
    if len(set(names)) != len(names):
        raise ValueError(f"registry.toml: duplicate backend names in {names}")
    return tuple(sorted(rows, key=lambda r: -r.priority))


def backend_names(rows: tuple[BackendSpec, ...] | None = None) -> list[str]:
    return [r.name for r in (rows or load_registry())]


def interpreter_enabled(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_reason(spec: BackendSpec, device: DeviceInfo, *, explicit: bool = False,
                  interpret: bool = False) -> str | None:
    """Why ``spec`` cannot run on ``device``, or None."""
    if device.kind == "cpu":
        if spec.device == "any":
            return None
        if spec.interpreter_on_cpu and interpret and explicit:
            return None
        if spec.interpreter_on_cpu:
            return "needs a CUDA device (CPU only when chosen explicitly under TRITON_INTERPRET=1)"
        return "needs a CUDA device"
    cap = device.capability
    if spec.capabilities is not None and cap not in spec.capabilities:
        wanted = ", ".join(f"sm_{a}{b}" for a, b in spec.capabilities)
        return f"needs compute capability in {{{wanted}}}, device is {device.arch}"
    if spec.min_capability is not None and cap < spec.min_capability:
        a, b = spec.min_capability
        return f"needs compute capability >= sm_{a}{b}, device is {device.arch}"
    return None


@functools.cache
def _installed_version(pkg: str) -> str | None:
    # importlib.metadata scans sys.path (about a millisecond): once per process, not per call.
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_versions(packages) -> dict[str, str | None]:
    return {pkg: _installed_version(pkg) for pkg in packages}


def version_reason(spec: BackendSpec, versions: dict[str, str | None] | None = None) -> str | None:
    """Why the installed packages do not meet ``spec.requires``, or None.

    ``versions`` maps package name to version (None: not installed); by default the
    installed versions are read with importlib.metadata.
    """
    if versions is None:
        versions = installed_versions(p for p, _ in spec.requires)
    for pkg, spec_text in spec.requires:
        have = versions.get(pkg)
        if have is None:
            return f"needs {pkg}{spec_text}, which is not installed"
        try:
            ok = Version(have) in SpecifierSet(spec_text, prereleases=True)
        except (InvalidSpecifier, InvalidVersion) as exc:
            return f"cannot check {pkg}{spec_text} against {have}: {exc}"
        if not ok:
            return f"needs {pkg}{spec_text}, found {have}"
    return None


def call_reason(spec: BackendSpec, call: CallSpec) -> str | None:
    """Why ``spec`` does not support this call's dtype, head dims or features, or None."""
    if call.dtype not in spec.dtypes:
        return f"q/k/v dtype {call.dtype} not in {list(spec.dtypes)}"
    for dim, size in (("K", call.K), ("V", call.V)):
        if spec.head_dims is not None and size not in spec.head_dims:
            return f"needs {dim} in {set(spec.head_dims)}, got {size}"
        if size > spec.max_head_dim:
            return f"needs {dim} <= {spec.max_head_dim}, got {size}"
    if call.state_layout not in spec.state_layouts:
        return f"state layout {call.state_layout!r} not in {list(spec.state_layouts)}"
    for feature in _FEATURES:
        if getattr(call, feature) and feature not in spec.features:
            return f"does not support {feature.replace('_', ' ')}"
    return None


@functools.cache
def _import_backend(module: str) -> tuple[ModuleType | None, str | None]:
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # every import failure is the row's reason, verbatim
        return None, f"{type(exc).__name__}: {exc}"


def parse_override(value: str, names: list[str]) -> dict[str, str]:
    """Parse GDN_BACKEND: "name" (every device) or "cuda:0=a,cuda:1=b,cpu=c".

    Returns a map from device key ("*", "cpu", "cuda", "cuda:N") to backend name.
    """
    text = value.strip()
    if not text:
        return {}
    entries = {}
    if "=" not in text and "," not in text:
        entries["*"] = text
    else:
        for part in text.split(","):
            key, sep, name = (s.strip() for s in part.partition("="))
            if not sep or not key or not name:
                raise GDNDispatchError(
                    f"{ENV_VAR}={value!r}: malformed entry {part.strip()!r}; expected a backend name "
                    f"or a map like 'cuda:0=gluon_sm100,cuda:1=triton_generic,cpu=reference'"
                )
            if not (key in ("cpu", "cuda") or (key.startswith("cuda:") and key[5:].isdigit())):
                raise GDNDispatchError(
                    f"{ENV_VAR}={value!r}: unknown device {key!r}; expected 'cpu', 'cuda' or 'cuda:N'"
                )
            if key in entries:
                raise GDNDispatchError(f"{ENV_VAR}={value!r}: device {key!r} given twice")
            entries[key] = name
    for key, name in entries.items():
        if name not in names:
            raise GDNDispatchError(
                f"{ENV_VAR}={value!r}: unknown backend {name!r}; valid names: {', '.join(names)}"
            )
    return entries


def override_for(device: DeviceInfo, env: dict[str, str] | None = None,
                 names: list[str] | None = None) -> str | None:
    """The backend GDN_BACKEND forces on ``device``, or None. Read at call time."""
    env = os.environ if env is None else env
    value = env.get(ENV_VAR)
    if value is None:
        return None
    entries = parse_override(value, names or backend_names())
    return entries.get(device.label) or entries.get(device.kind) or entries.get("*")


def device_info(device) -> DeviceInfo:
    """``device`` as the registry sees it: a DeviceInfo as is; a torch.device or its string
    ("cpu", "cuda", "cuda:1") through the device probe. ValueError for a device the probe
    does not know; TypeError for anything else."""
    if isinstance(device, DeviceInfo):
        return device
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r} ({exc})") from None
    if not isinstance(device, torch.device):
        raise TypeError(f"device: expected a DeviceInfo, a torch.device or a device string like 'cuda:0', "
                        f"got {type(device).__name__}")
    return default_probe().for_torch_device(device)


def explain(device: DeviceInfo | torch.device | str, call: CallSpec | None = None, *, problem=None,
            backend: str | None = None, env: dict[str, str] | None = None,
            versions: dict[str, str | None] | None = None,
            rows: tuple[BackendSpec, ...] | None = None, run_selftest: bool = False) -> Explanation:
    """Every row's verdict for ``device`` and ``call``, and the one chosen.

    ``device``: a DeviceInfo, a torch.device or a device string (:func:`device_info`).
    ``call``: by default ``problem``'s (:meth:`CallSpec.from_problem`), or
    :data:`QWEN35_CALL` without a problem; given with a problem, it must be the problem's.
    ``backend`` (a call's explicit choice) wins over ``GDN_BACKEND`` in ``env``. Rows are
    imported only as far as needed to find the winner; ``problem`` (a GDNProblem), when
    given, is also offered to a backend module's ``unsupported_reason(problem)``. A row
    unverified on the device's capability needs a passed self-test to be chosen
    automatically: a recorded verdict decides; without one, ``run_selftest`` runs it now
    (what :func:`select` does), otherwise the row is chosen with a note that its first
    call will test it.
    """
    device = device_info(device)
    if problem is None:
        call = QWEN35_CALL if call is None else call
    elif call is None:
        call = CallSpec.from_problem(problem)
    elif call != CallSpec.from_problem(problem):
        raise ValueError(f"call: {call} is not the problem's {CallSpec.from_problem(problem)}; pass one of them")
    rows = rows or load_registry()
    names = backend_names(rows)
    env = os.environ if env is None else env
    forced, forced_by = backend, "backend= argument"
    if forced is None:
        forced, forced_by = override_for(device, env, names), f"{ENV_VAR}={env.get(ENV_VAR)!r}"
    if forced is not None and forced not in names:
        raise GDNDispatchError(f"backend {forced!r} is unknown; valid names: {', '.join(names)}")
    interpret = interpreter_enabled(env)

    verdicts, selected = [], None
    for spec in rows:
        if forced is not None and spec.name != forced:
            verdicts.append(Verdict(spec.name, "passed over", f"{forced} forced by {forced_by}"))
            continue
        reason = (device_reason(spec, device, explicit=forced is not None, interpret=interpret)
                  or version_reason(spec, None if versions is None else versions)
                  or call_reason(spec, call))
        if reason is not None:
            verdicts.append(Verdict(spec.name, "rejected", reason))
            continue
        if selected is not None:
            verdicts.append(Verdict(spec.name, "passed over", f"{selected} has higher priority"))
            continue
        module, reason = _import_backend(spec.module)
        if module is not None and not callable(getattr(module, "forward", None)):
            module, reason = None, f"module {spec.module} defines no forward(problem)"
        if reason is None and problem is not None and hasattr(module, "unsupported_reason"):
            reason = module.unsupported_reason(problem)
        if reason is not None:
            verdicts.append(Verdict(spec.name, "not available" if module is None else "rejected", reason))
            continue
        note = ""
        if forced is None:
            try:
                checked = gate.check(spec.name, spec.verified_on, device, run=run_selftest, env=env)
            except ValueError as exc:  # a malformed GDN_SELFTEST or GDN_SELFTEST_TIMEOUT
                raise GDNDispatchError(str(exc)) from None
            if not checked.allowed:
                verdicts.append(Verdict(spec.name, "rejected", checked.note))
                continue
            note = f"; {checked.note}" if checked.note else ""
        selected = spec.name
        verdicts.append(Verdict(spec.name, "selected", f"priority {spec.priority}{note}"))
    return Explanation(device=device, call=call, verdicts=tuple(verdicts), selected=selected,
                       forced=forced, forced_by=forced_by if forced else None,
                       context_parallel=None if problem is None else _context_parallel_note(problem, device, selected, rows),
                       launches=None if problem is None else _launches_note(problem, device, selected, rows))


def _launches_note(problem, device: DeviceInfo, selected: str | None, rows) -> str | None:
    """The chosen row's own account of its launches for ``problem`` (:func:`launches_of`)."""
    spec = next((r for r in rows if r.name == selected), None)
    if spec is None or device.kind != "cuda":
        return None
    return launches_of(_import_backend(spec.module)[0], problem, device)


def launches_of(module, problem, device: DeviceInfo) -> str | None:
    """A backend module's account of its launches for ``problem`` on ``device`` (its
    ``describe_launches``, a dry run), or None where it has none."""
    describe = getattr(module, "describe_launches", None)
    if describe is None:
        return None
    try:
        return describe(problem, device)
    except Exception as exc:  # an explanation must not stop the call it explains (select asks too)
        return f"not planned here ({type(exc).__name__}: {exc})"


def _context_parallel_note(problem, device: DeviceInfo, selected: str | None, rows) -> str:
    """The planner's decision for ``problem`` on ``device``, and whether the chosen row runs it."""
    decision = plan_for_problem(problem, device.sm_count)
    note = decision.describe()
    spec = next((r for r in rows if r.name == selected), None)
    if decision.enabled and spec is not None and "context_parallel" not in spec.features:
        note += f"; {selected} does not run segments, so this call runs unsegmented"
    elif decision.picked and spec is not None and selected not in PICKING_BACKENDS:
        note += f"; {selected} cannot pick on the device, so this call runs unsegmented"
    return note


#: Backends that run a picked plan (``CPPlan.picked``) as planned, where the call's class
#: has the one-kernel build; the others run it "off".
PICKING_BACKENDS = ("gluon_sm90",)


@dataclass(frozen=True)
class Selection:
    spec: BackendSpec
    module: ModuleType
    explanation: Explanation = field(repr=False)
    device: DeviceInfo


#: Static selections kept by :func:`select` (keys: device, call spec, forced backend and
#: the environment it reads; a process sees few).
SELECTIONS_KEPT = 256
_selections: dict[tuple, tuple[tuple[BackendSpec, ...], Selection]] = {}


def _call_key(problem) -> tuple:
    """Everything :meth:`CallSpec.from_problem` reads of ``problem``, as a plain tuple: the
    selection cache's key (a CallSpec costs ~6 µs per call to build and hash; this ~2)."""
    q, v = problem.q, problem.v
    return (q.dtype, q.shape[2], q.shape[3], v.shape[2], v.shape[3], problem.cu_seqlens is not None,
            problem.state_layout, problem.initial_state is not None, problem.output_final_state,
            problem.use_qk_l2norm, problem.state_indices is not None, isinstance(problem.context_parallel, int))


def _takes(selection: Selection, problem) -> bool:
    """Whether the chosen module's own per-call check (``unsupported_reason``: alignment,
    index limits) passes ``problem``."""
    check = getattr(selection.module, "unsupported_reason", None)
    return check is None or check(problem) is None


def confirm(selection: Selection, device: DeviceInfo, problem) -> Selection:
    """``selection``, a choice :func:`select` made for a call of ``problem``'s form on
    ``device``, where its module's per-call check passes ``problem``; else what
    :func:`select` answers for ``problem`` (another backend, or its error). For callers
    that keep a form's choice (:mod:`gdn_dispatch.routes`)."""
    return selection if _takes(selection, problem) else select(device, problem)


def select(device: DeviceInfo, problem, *, env: dict[str, str] | None = None) -> Selection:
    """The backend that runs ``problem`` on ``device``; GDNDispatchError when none can.

    An explicit choice that cannot run raises with its reason; it never falls back.

    The rows' verdicts depend on the device, the call's :class:`CallSpec`, the forced
    backend and the environment, except the chosen module's own ``unsupported_reason``
    (alignment, index limits), which looks at this problem's tensors. So the choice without
    the problem is kept per key, and only that check runs per call; when it objects, the
    full explanation (with the problem offered to every row) decides, as without the cache.
    """
    environ = os.environ if env is None else env
    read = getenv if env is None else env.get
    rows = load_registry()
    key = (id(rows), device, _call_key(problem), problem.backend, read(ENV_VAR), read("TRITON_INTERPRET"),
           read(gate.ENV_VAR))
    kept_rows, static = _selections.get(key, (None, None))
    call = None
    if kept_rows is not rows:
        static = None
        call = CallSpec.from_problem(problem)
        static_explanation = explain(device, call, backend=problem.backend, env=environ, rows=rows,
                                     run_selftest=True)
        if static_explanation.selected is not None:
            static = _selection(static_explanation, rows)
            if len(_selections) < SELECTIONS_KEPT:
                _selections[key] = (rows, static)
    if static is not None and _takes(static, problem):
        return static
    explanation = explain(device, call or CallSpec.from_problem(problem), problem=problem, backend=problem.backend,
                          env=environ, rows=rows, run_selftest=True)
    if explanation.selected is None:
        if explanation.forced is not None:
            verdict = next(v for v in explanation.verdicts if v.name == explanation.forced)
            raise GDNDispatchError(
                f"backend {explanation.forced!r} (forced by {explanation.forced_by}) cannot run this "
                f"call on {device.label} ({device.arch}): {verdict.reason}"
            )
        details = "; ".join(f"{v.name}: {v.reason}" for v in explanation.verdicts)
        raise GDNDispatchError(f"no backend can run this call on {device.label} ({device.arch}): {details}")
    return _selection(explanation, rows)


def _selection(explanation: Explanation, rows: tuple[BackendSpec, ...]) -> Selection:
    spec = next(r for r in rows if r.name == explanation.selected)
    module, _ = _import_backend(spec.module)
    return Selection(spec=spec, module=module, explanation=explanation, device=explanation.device)
