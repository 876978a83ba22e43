"""The native layer's admission of a call (:func:`gdn_dispatch.native.admission`, built:
slow tier) against the Python contract, over a fuzzed stream of calls: valid calls of
random sizes, dtypes, layouts and offsets, and the same calls each with one rule broken or
in another form (strided inputs, a list of offsets, a state pool).

For every call, ``make_problem`` with the layer gives the same problem, or raises the same
error, as without it (``GDN_DISPATCH_NATIVE=0``); every call ``admit`` accepts is one the
Python contract accepts, with the sizes ``admit`` returned; and every valid call of the
common form (contiguous inputs, a state pool or not) is admitted, so the native path is the
one taken.
"""

from __future__ import annotations

import random

import pytest
import torch

from gdn_dispatch import native
from gdn_dispatch import contract
from gdn_dispatch.contract import GDNProblem, make_problem

pytestmark = pytest.mark.slow

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _common_call(rng: random.Random) -> dict:
    """A valid call of the common form: contiguous inputs, maybe offsets (with or without
    a host copy), maybe an initial state in either layout."""
    H = rng.choice([1, 2, 3])
    HV = H * rng.choice([1, 2])
    K, V = rng.choice([8, 16, 24, 64]), rng.choice([8, 16, 32])
    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    varlen = rng.random() < 0.6
    if varlen:
        lengths = [rng.choice([0, 1, 5, 63, 64, 65, 128, 130]) for _ in range(rng.randint(1, 4))]
        B, T = 1, sum(lengths)
    else:
        lengths = None
        B, T = rng.randint(1, 3), rng.choice([1, 7, 64, 100, 128])
    call = dict(q=torch.randn(B, T, H, K).to(dtype), k=torch.randn(B, T, H, K).to(dtype),
                v=torch.randn(B, T, HV, V).to(dtype), g=-torch.rand(B, T, HV).to(rng.choice(FLOATS)),
                beta=torch.rand(B, T, HV).to(rng.choice(FLOATS)))
    N = B
    if varlen:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=rng.choice([torch.int32, torch.int64]))
        call["cu_seqlens"] = cu
        if rng.random() < 0.6:
            call["cu_seqlens_cpu"] = cu.clone()
        N = len(lengths)
    layout = rng.choice(["kv", "vk"])
    if layout == "vk" or rng.random() < 0.3:
        call["state_layout"] = layout
    if rng.random() < 0.7:
        dims = (N, HV, V, K) if layout == "vk" else (N, HV, K, V)
        call["initial_state"] = torch.randn(dims).to(rng.choice(FLOATS))
    call["output_final_state"] = rng.random() < 0.5
    return call


def _restride(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a view of wider token rows (not contiguous; the contract reads it)."""
    wide = torch.empty(*t.shape[:-1], t.shape[-1] + 8, dtype=t.dtype)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


def _host_offsets_alone(call, change):
    """``call`` with its CPU cu_seqlens changed by ``change`` and no cu_seqlens_cpu: the
    offsets are their own host copy, checked on every call."""
    if "cu_seqlens" not in call:
        return call
    return {**{n: t for n, t in call.items() if n != "cu_seqlens_cpu"}, "cu_seqlens": _offsets(call, change)}


def _with(name, make):
    def mutate(rng, call):
        call = dict(call)
        value = make(rng, call)
        if value is _DROP:
            call.pop(name, None)
        else:
            call[name] = value
        return call
    return mutate


_DROP = object()


class _Marked(torch.Tensor):
    """A tensor subclass: the native layer leaves subclasses to the Python contract."""


def _state_of(call, dims=None, dtype=None, device=None):
    q, v = call["q"], call["v"]
    N = call["cu_seqlens"].numel() - 1 if "cu_seqlens" in call else q.shape[0]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    dims = dims or ((N, HV, V, K) if call.get("state_layout") == "vk" else (N, HV, K, V))
    return torch.randn(dims, dtype=dtype or torch.float32, device=device or "cpu")


def _pool_call(call, pool_rows=5, pool_dtype=None, indices=None):
    """``call`` on a state pool of ``pool_rows`` rows (float32 or bfloat16 unless
    ``pool_dtype``) through int32/int64 ``indices`` (default: valid ones, one -1)."""
    q, v = call["q"], call["v"]
    N = call["cu_seqlens"].numel() - 1 if "cu_seqlens" in call else q.shape[0]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    dims = (pool_rows, HV, V, K) if call.get("state_layout") == "vk" else (pool_rows, HV, K, V)
    dtype = pool_dtype or (torch.float32 if N % 2 else torch.bfloat16)
    if indices is None:
        indices = torch.randint(0, max(pool_rows, 1), (N,), dtype=torch.int64 if N % 3 else torch.int32)
        if N > 1:
            indices[0] = -1
    return {**call, "initial_state": torch.randn(dims).to(dtype), "state_indices": indices,
            "inplace_final_state": bool(N % 2)}


def _offsets(call, change):
    cu = call.get("cu_seqlens")
    if cu is None:
        return _DROP
    values = change(cu.tolist())
    return torch.tensor(values, dtype=cu.dtype)


#: (name, whether the call breaks a tensor rule or takes another form, the mutation). The
#: scalar ones (scale, context_parallel, backend, inplace_final_state) leave the tensors
#: valid: ``admit`` accepts them and the contract's scalar checks raise.
MUTATIONS = [
    ("q strided", True, _with("q", lambda rng, c: _restride(c["q"]))),
    ("v strided", True, _with("v", lambda rng, c: _restride(c["v"]))),
    ("g strided", True, _with("g", lambda rng, c: _restride(c["g"].unsqueeze(-1)).squeeze(-1))),
    ("k wider", True, _with("k", lambda rng, c: torch.randn(*c["k"].shape[:3], c["k"].shape[3] + 1).to(c["q"].dtype))),
    ("v shorter", True, _with("v", lambda rng, c: c["v"][:, : max(c["v"].shape[1] - 1, 0)].contiguous()
                              if c["v"].shape[1] else torch.randn(1, 1, *c["v"].shape[2:]).to(c["q"].dtype))),
    ("g heads", True, _with("g", lambda rng, c: torch.randn(*c["g"].shape[:2], c["g"].shape[2] + 1))),
    ("beta ndim", True, _with("beta", lambda rng, c: c["beta"].unsqueeze(-1))),
    ("beta int", True, _with("beta", lambda rng, c: torch.ones(c["beta"].shape, dtype=torch.int32))),
    ("q float64", True, _with("q", lambda rng, c: c["q"].to(torch.float64))),
    ("v dtype", True, _with("v", lambda rng, c: c["v"].to(torch.float16 if c["q"].dtype != torch.float16
                                                       else torch.bfloat16))),
    ("g meta", True, _with("g", lambda rng, c: torch.empty(c["g"].shape, device="meta"))),
    ("state meta", True, _with("initial_state", lambda rng, c: _state_of(c, device="meta"))),
    ("HV not a multiple", True, _with("v", lambda rng, c: torch.randn(*c["v"].shape[:2], 2 * c["q"].shape[2] + 1,
                                                                      c["v"].shape[3]).to(c["q"].dtype))),
    ("K too wide", True, lambda rng, c: {**c, "q": torch.randn(*c["q"].shape[:3], 257).to(c["q"].dtype),
                                         "k": torch.randn(*c["q"].shape[:3], 257).to(c["q"].dtype),
                                         "initial_state": None}),
    ("q not a tensor", True, _with("q", lambda rng, c: c["q"].tolist())),
    ("k a subclass", True, _with("k", lambda rng, c: c["k"].as_subclass(_Marked))),
    ("cu start", True, _with("cu_seqlens_cpu", lambda rng, c: _offsets(c, lambda x: [1] + x[1:]))),
    ("cu decreasing", True, _with("cu_seqlens_cpu", lambda rng, c: _offsets(
        c, lambda x: x[:1] + [x[-1] + 1] + x[1:] if len(x) > 1 else x))),
    ("cu end", True, _with("cu_seqlens_cpu", lambda rng, c: _offsets(c, lambda x: x[:-1] + [x[-1] + 3]))),
    ("cu start, no host copy", True, lambda rng, c: _host_offsets_alone(c, lambda x: [1] + x[1:])),
    ("cu decreasing, no host copy", True, lambda rng, c: _host_offsets_alone(
        c, lambda x: x[:1] + [x[-1] + 1] + x[1:] if len(x) > 1 else x)),
    ("cu end, no host copy", True, lambda rng, c: _host_offsets_alone(c, lambda x: x[:-1] + [x[-1] + 3])),
    ("cu_cpu entries", True, _with("cu_seqlens_cpu", lambda rng, c: _offsets(c, lambda x: x + [x[-1]]))),
    ("cu_cpu strided", True, _with("cu_seqlens_cpu", lambda rng, c: _offsets(
        c, lambda x: [v for v in x for _ in (0, 1)])[::2] if "cu_seqlens" in c else _DROP)),
    ("cu strided", True, _with("cu_seqlens", lambda rng, c: _offsets(
        c, lambda x: [v for v in x for _ in (0, 1)])[::2] if "cu_seqlens" in c else _DROP)),
    ("cu_cpu alone", True, lambda rng, c: {**{n: t for n, t in c.items() if n != "cu_seqlens"},
                                           "cu_seqlens_cpu": torch.tensor([0, c["q"].shape[1]])}),
    ("cu float", True, _with("cu_seqlens", lambda rng, c: torch.tensor([0.0, float(c["q"].shape[1])]))),
    ("cu one entry", True, _with("cu_seqlens", lambda rng, c: torch.zeros(1, dtype=torch.int32))),
    ("cu 2-d", True, _with("cu_seqlens", lambda rng, c: torch.tensor([[0, c["q"].shape[1]]]))),
    ("cu list", True, lambda rng, c: {**{n: t for n, t in c.items() if n != "cu_seqlens_cpu"},
                                      "cu_seqlens": c["cu_seqlens"].tolist() if "cu_seqlens" in c else None}),
    ("cu with B > 1", True, lambda rng, c: {**c, **{n: torch.cat([c[n]] * 2) for n in ("q", "k", "v", "g", "beta")},
                                            "cu_seqlens": torch.tensor([0, c["q"].shape[1]], dtype=torch.int32),
                                            "initial_state": None}),
    ("state rows", True, _with("initial_state", lambda rng, c: _state_of(
        c, dims=(c["q"].shape[0] + 5, c["v"].shape[2], c["q"].shape[3], c["v"].shape[3])))),
    ("state layout", True, lambda rng, c: {**c, "state_layout": "vk" if c.get("state_layout") != "vk" else "kv",
                                           "initial_state": _state_of(c)}),
    ("state int", True, _with("initial_state", lambda rng, c: _state_of(c).to(torch.int32))),
    ("state strided", True, _with("initial_state", lambda rng, c: _state_of(c).transpose(2, 3))),
    ("state a list", True, _with("initial_state", lambda rng, c: [1.0])),
    # A state pool is the common form too: admitted when valid.
    ("state pool", False, lambda rng, c: _pool_call(c)),
    ("pool float16", True, lambda rng, c: _pool_call(c, pool_dtype=torch.float16)),
    ("pool no rows", True, lambda rng, c: _pool_call(c, pool_rows=0)),
    ("pool rows strided", True, lambda rng, c: (lambda p: {**p, "initial_state": p["initial_state"].transpose(2, 3)
                                                           .contiguous().transpose(2, 3)})(_pool_call(c))),
    ("indices count", True, lambda rng, c: (lambda p: {**p, "state_indices": torch.cat(
        [p["state_indices"], p["state_indices"][:1]])})(_pool_call(c))),
    ("indices strided", True, lambda rng, c: (lambda p: {**p, "state_indices": torch.stack(
        [p["state_indices"]] * 2, 1)[:, 0]})(_pool_call(c))),
    ("indices float", True, lambda rng, c: (lambda p: {**p, "state_indices": p["state_indices"].float()})(
        _pool_call(c))),
    ("indices without pool", True, lambda rng, c: {**c, "initial_state": None, "state_indices": torch.zeros(
        c["cu_seqlens"].numel() - 1 if "cu_seqlens" in c else c["q"].shape[0], dtype=torch.int32)}),
    ("scale", False, _with("scale", lambda rng, c: "half")),
    ("context_parallel", False, _with("context_parallel", lambda rng, c: "sometimes")),
    ("backend", False, _with("backend", lambda rng, c: "no_such_backend")),
    ("inplace without pool", False, _with("inplace_final_state", lambda rng, c: True)),
]


def _outcome(call: dict, monkeypatch, layer: bool):
    monkeypatch.setenv(native.NATIVE_ENV, "1" if layer else "0")
    try:
        return make_problem(**call)
    except Exception as exc:  # the contract's error, compared below
        return (type(exc), str(exc))


def _same_tensor(a, b) -> bool:
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride()
            and (a.device.type == "meta" or torch.equal(a, b)))


def _same_problem(a: GDNProblem, b: GDNProblem) -> bool:
    for name, x in a.__dict__.items():
        y = b.__dict__[name]
        if name == "chunks":
            if x.__dict__.keys() != y.__dict__.keys():
                return False
            if not all(_same_tensor(u, y.__dict__[key]) if isinstance(u, torch.Tensor) else u == y.__dict__[key]
                       for key, u in x.__dict__.items()):
                return False
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not _same_tensor(x, y):
                return False
        elif x != y:
            return False
    return a.__dict__.keys() == b.__dict__.keys()


def _admit(call: dict):
    """``admit`` asked as make_problem asks it: CPU offsets without a host copy are their own."""
    admit = native.admission()
    cu, host = call.get("cu_seqlens"), call.get("cu_seqlens_cpu")
    if host is None and isinstance(cu, torch.Tensor) and contract._in_host_memory(cu):
        host = cu
    return admit(call.get("q"), call.get("k"), call.get("v"), call.get("g"), call.get("beta"),
                 call.get("initial_state"), cu, host, call.get("state_layout") == "vk", call.get("state_indices"))


def test_admission_agrees_with_the_python_contract(native_built, monkeypatch):
    rng = random.Random(11)
    torch.manual_seed(11)
    monkeypatch.setenv(native.NATIVE_ENV, "1")
    assert native.admission() is not None
    admitted = refused = pools_admitted = 0
    kinds_refused = set()
    for i in range(420):
        base = _common_call(rng)
        name, tensor_rule, mutate = ("none", False, None) if i % 3 == 0 else rng.choice(MUTATIONS)
        call = base if mutate is None else mutate(rng, base)
        facts = _admit(call)
        with_layer, without = _outcome(call, monkeypatch, True), _outcome(call, monkeypatch, False)
        monkeypatch.setenv(native.NATIVE_ENV, "1")
        if isinstance(without, tuple):
            assert with_layer == without, (name, call.keys())
        else:
            assert isinstance(with_layer, GDNProblem) and _same_problem(with_layer, without), name
        if mutate is None or name == "state pool":
            assert facts is not None, f"a valid call of the common form was not admitted ({name})"
            pools_admitted += name == "state pool"
        if facts is None:
            refused += 1
            kinds_refused.add(name)
            continue
        admitted += 1
        if tensor_rule:
            # Only calls of the common form that keep every rule may pass.
            assert not isinstance(without, tuple), (name, without)
        if isinstance(without, tuple):
            continue  # a scalar rule broken: the contract raised the same error with the layer
        q, v, chunks = without.q, without.v, without.chunks
        assert tuple(facts[:7]) == (*q.shape, v.shape[2], v.shape[3], chunks.num_seqs), name
        if chunks.cu_seqlens_host is not None and not chunks.uniform:
            assert (facts[7], facts[8]) == (chunks.longest_length(), chunks.chunk_aligned()), name
        else:
            assert facts[7:] == (None, None)
    assert admitted > 100 and refused > 50 and pools_admitted >= 3
    # Every tensor rule's mutation was seen refused at least once over the stream.
    assert {name for name, rule, _ in MUTATIONS if rule} <= kinds_refused


def test_tma_rows_ok_agrees_with_the_python_check(native_built):
    """``tma_rows_ok`` passes exactly the contiguous tensors ``tma_rows_reason`` passes (a
    16-byte-aligned base, token rows a multiple of 16 bytes), and nothing else: a strided
    view or a subclass is left to the Python check."""
    from gdn_dispatch.backends.gluon_common.launch_plan import tma_rows_reason

    module, _ = native_built
    rng = random.Random(5)
    passed = failed = 0
    for _ in range(400):
        dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
        shape = (rng.randint(1, 2), rng.randint(1, 9), rng.randint(1, 3), rng.choice([1, 3, 4, 8, 16, 24]))
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        offset = rng.choice([0, 0, 1, 2, 4, 8])
        t = torch.randn(numel + offset).to(dtype)[offset:].view(shape)
        kind = rng.random()
        if kind < 0.2:
            t = t.transpose(2, 3)
        elif kind < 0.3:
            t = t.as_subclass(_Marked)
        ok = module.tma_rows_ok((t,))
        python_ok = tma_rows_reason("x", t) is None
        if t.is_contiguous() and type(t) is torch.Tensor:
            assert ok == python_ok, (dtype, shape, offset)
        else:
            assert not ok
        passed += ok
        failed += not ok
        # A tuple passes only when each of its tensors does.
        other = torch.randn(2, 3, 4, 8).to(torch.bfloat16)
        assert module.tma_rows_ok((other, t)) == ok and module.tma_rows_ok((t, other)) == ok
    assert passed > 50 and failed > 50
