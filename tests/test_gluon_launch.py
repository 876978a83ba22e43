"""The planned-launch path (backends/gluon_common/launch.py): which launches reuse a kept
kernel, and that a direct launch hands Triton's launcher exactly what ``fn[grid]`` would.

CPU tests drive a stand-in JIT function whose "compiled kernel" records its launcher call;
the GPU test compares the direct path with Triton's own on real kernels.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch.testing import random_problem, rel_rms_error, triton_shaped_launcher  # noqa: E402

from gdn_dispatch.backends.gluon_common import compat  # noqa: E402
from gdn_dispatch.backends.gluon_common import launch as L  # noqa: E402
from gdn_dispatch.backends.gluon_common import wy  # noqa: E402

SM90 = (9, 0)


class _Compiled:
    """A compiled kernel's launch interface, recording each launcher call."""

    function, packed_metadata = "fn-handle", "packed"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _Jit:
    """Stands in for a ``@gluon.jit`` function: ``fn[grid](**kwargs)`` records the binding
    and returns one kept _Compiled (or ``compiled``)."""

    def __init__(self, kernel, compiled=None):
        self.arg_names = kernel.arg_names
        self.do_not_specialize = kernel.do_not_specialize
        self.bound = []
        self.compiled = _Compiled() if compiled is None else compiled

    def __getitem__(self, grid):
        def bind(**kwargs):
            missing = set(self.arg_names) - set(kwargs)
            assert not missing, missing
            self.bound.append((grid, kwargs))
            return self.compiled
        return bind


class _Runtime(L._Runtime):
    """Triton's real knobs; device 0 and a made-up stream (no driver here)."""

    def current_device(self):
        return 0

    def stream(self, device):
        return 1234


@pytest.fixture
def runtime(monkeypatch):
    rt = _Runtime()
    monkeypatch.setattr(L, "_RUNTIME", rt)
    return rt


@pytest.fixture
def direct(runtime):
    if not runtime.direct:
        pytest.skip(f"direct launches are verified for Triton {compat.DIRECT_LAUNCH_TRITON} only")


@pytest.fixture
def setup(monkeypatch, runtime):
    monkeypatch.delenv(L.JIT_LAUNCH_ENV, raising=False)
    p = random_problem(lengths=[1, 63, 64, 65, 130, 0], H=2, HV=4, K=128, V=64, seed=3)
    launch = wy.plan_wy(p, SM90)
    B, T, H, K = p.k.shape
    w = torch.empty(B, T, p.HV, K, dtype=p.k.dtype)
    u = torch.empty_like(p.v)
    g_cum = torch.empty(B, T, p.HV)
    tensors = {"k": p.k, "v": p.v, "w": w, "u": u}

    def args(**over):
        a = dict(w_ptr=w, u_ptr=u, g=p.g, g_cum=g_cum, beta=p.beta, cu_seqlens=p.chunks.cu_seqlens,
                 pick=p.chunks.cu_seqlens, N=p.N, HV=launch.scalars["HV"],
                 GROUP=launch.scalars["GROUP"], s_g=p.HV, s_beta=p.HV)
        a.update(over)
        return a
    return launch, tensors, args


def _launch(fn, launch, tensors, args):
    """launch_planned of a dry run's plan, with the counts it was bound to."""
    L.launch_planned(fn, launch.shared, tensors, args, rows=launch.rows, num_seqs=launch.num_seqs)


def test_first_launch_binds_then_the_kept_kernel_runs_directly(setup, direct):
    launch, tensors, args = setup
    fn = _Jit(wy._wy_fwd_kernel)
    _launch(fn, launch, tensors, args())
    assert len(fn.bound) == 1 and fn.compiled.calls == []
    grid, bound = fn.bound[0]
    assert grid == launch.grid and bound["num_warps"] == launch.num_warps and bound["maxnreg"] == launch.maxnreg

    _launch(fn, launch, tensors, args())
    assert len(fn.bound) == 1 and len(fn.compiled.calls) == 1
    call = fn.compiled.calls[0]
    assert call[:9] == (launch.grid[0], 1, 1, 1234, "fn-handle", "packed", None, None, None)
    values = dict(zip(fn.arg_names, call[9:], strict=True))
    # Every argument the binder saw, in the kernel's order; descriptors as the four fields
    # Triton's launcher reads of a TensorDescriptor.
    for name, value in bound.items():
        if name in ("num_warps", "maxnreg"):
            continue
        direct = values[name]
        if name in {d.arg for d in launch.descriptors}:
            assert (direct.base is value.base and list(direct.shape) == list(value.shape)
                    and list(direct.strides) == list(value.strides) and direct.padding == value.padding), name
        elif isinstance(value, torch.Tensor):  # pointers go to the launcher as addresses
            assert direct == value.data_ptr(), name
        else:
            assert direct is value or direct == value, name


def test_a_new_specialization_binds_again(setup, direct):
    launch, tensors, args = setup
    fn = _Jit(wy._wy_fwd_kernel)
    _launch(fn, launch, tensors, args())
    # g one element into a buffer: 4-byte aligned, not 16 -> Triton specializes differently.
    g = args()["g"]
    shifted = torch.empty(g.numel() + 1, dtype=g.dtype)[1:].view_as(g)
    assert shifted.data_ptr() % 16
    _launch(fn, launch, tensors, args(g=shifted))
    _launch(fn, launch, tensors, args(beta=args()["beta"].to(torch.bfloat16)))
    assert len(fn.bound) == 3 and fn.compiled.calls == []
    _launch(fn, launch, tensors, args(g=shifted))
    assert len(fn.bound) == 3 and len(fn.compiled.calls) == 1


@pytest.mark.parametrize("seed", range(3))
def test_new_lengths_launch_the_kept_kernel_with_their_own_grid_and_rows(setup, direct, seed):
    """A call of the same class with other lengths and another sequence count binds nothing:
    its grid and descriptor rows are computed from its own counts."""
    launch, tensors, args = setup
    fn = _Jit(wy._wy_fwd_kernel)
    _launch(fn, launch, tensors, args())
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        lengths = torch.randint(0, 300, (n,), generator=gen).tolist()
        lengths[0] += 1  # some token, and a tail (the setup's class)
        if sum(lengths) % 64 == 0:
            lengths[0] += 1
        p = random_problem(lengths=lengths, H=2, HV=4, K=128, V=64, seed=seed)
        bound = wy.plan_wy(p, SM90)
        assert bound.shared == launch.shared
        rows = p.B * p.T
        w = torch.full((1, p.T, p.HV, 128), float("nan"), dtype=p.k.dtype)
        u = torch.full_like(p.v, float("nan"))
        before = len(fn.compiled.calls)
        L.launch_planned(fn, launch.shared, {"k": p.k, "v": p.v, "w": w, "u": u},
                         args(w_ptr=w, u_ptr=u, g=p.g, beta=p.beta, cu_seqlens=p.chunks.cu_seqlens,
                              pick=p.chunks.cu_seqlens, N=p.N),
                         rows=rows, num_seqs=p.N)
        assert len(fn.bound) == 1 and len(fn.compiled.calls) == before + 1
        call = fn.compiled.calls[-1]
        assert call[:3] == ((rows // 64 + p.N) * 4, 1, 1) == bound.grid + (1, 1)
        values = dict(zip(fn.arg_names, call[9:], strict=True))
        for arg in ("k_desc", "v_desc", "w_desc", "u_desc"):
            assert values[arg].shape == [rows, launch.desc(arg).shape[1]] == list(bound.desc(arg).shape), arg
        assert values["N"] == p.N and values["w_ptr"] == w.data_ptr()


def test_unspecialized_integers_are_keyed_by_type_only():
    unspecialized = L.unspecialized_args(wy._wy_fwd_kernel)
    assert unspecialized == {"HV", "GROUP", "s_g", "s_beta", "N"}
    keys = {L.launch_specialization(0, {"N": n}, unspecialized) for n in (1, 16, 17, 2**31 - 1)}
    assert len(keys) == 1
    assert L.launch_specialization(0, {"N": 2**31}, unspecialized) not in keys
    # A specialized integer: 1, multiples of 16 and the rest are three classes, as Triton keys them.
    assert len({L.launch_specialization(0, {"s_q": n}) for n in (1, 16, 32, 17, 18)}) == 3


def test_direct_launches_only_on_verified_tritons(setup, runtime, monkeypatch):
    assert compat.direct_launch_verified("3.6.0") and compat.direct_launch_verified("3.6.1+git1234")
    assert not compat.direct_launch_verified("3.9.0") and not compat.direct_launch_verified("3.5.1")
    assert not compat.direct_launch_verified("dev")
    launch, tensors, args = setup
    monkeypatch.setattr(runtime, "direct", False)
    fn = _Jit(wy._wy_fwd_kernel)
    for _ in range(2):
        _launch(fn, launch, tensors, args())
    assert len(fn.bound) == 2 and fn.compiled.calls == []


def test_env_and_kernels_without_the_interface_bind_every_time(setup, monkeypatch):
    launch, tensors, args = setup
    bare = _Jit(wy._wy_fwd_kernel, compiled=object())  # no run / function / packed_metadata
    for _ in range(3):
        _launch(bare, launch, tensors, args())
    assert len(bare.bound) == 3

    fn = _Jit(wy._wy_fwd_kernel)
    monkeypatch.setenv(L.JIT_LAUNCH_ENV, "1")
    for _ in range(2):
        _launch(fn, launch, tensors, args())
    assert len(fn.bound) == 2 and fn.compiled.calls == []


def test_a_registered_launch_hook_sends_launches_through_triton(setup, direct):
    from triton import knobs

    launch, tensors, args = setup
    fn = _Jit(wy._wy_fwd_kernel)
    _launch(fn, launch, tensors, args())
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton keeps one launch hook callable, not a HookChain")
    seen = []
    hook.add(seen.append)
    try:
        _launch(fn, launch, tensors, args())
    finally:
        hook.remove(seen.append)
    assert len(fn.bound) == 2 and fn.compiled.calls == []
    _launch(fn, launch, tensors, args())
    assert len(fn.bound) == 2 and len(fn.compiled.calls) == 1


def test_descriptor_tensors_are_checked_on_the_direct_path(setup, direct):
    launch, tensors, args = setup
    fn = _Jit(wy._wy_fwd_kernel)
    for _ in range(2):
        _launch(fn, launch, tensors, args())
    with pytest.raises(ValueError, match="w_desc: planned"):
        _launch(fn, launch, {**tensors, "w": tensors["w"].half()}, args())


def test_tma_arg_reads_like_a_tensor_descriptor_to_the_launcher(setup, direct):
    # Triton's own decomposition of a descriptor argument (the path without TMA metadata
    # reads the same fields as the encoding path) must not tell the two apart.
    make_tensordesc_arg = pytest.importorskip("triton.backends.nvidia.driver").make_tensordesc_arg
    launch, tensors, _ = setup
    for d in launch.descriptors:
        real = d.build(tensors[d.tensor])
        light = L.TmaArg(tensors[d.tensor], list(d.shape), list(d.strides))
        assert make_tensordesc_arg(light, None) == make_tensordesc_arg(real, None), d.arg


class _FillRecorder:
    """Stands in for the driver's ``fill_tma_descriptor``: a "map" is the tuple of what it
    was asked to encode, so maps compare by value; every encoding is counted."""

    def __init__(self):
        self.encoded = 0

    def fill_tma_descriptor(self, *args):
        self.encoded += 1
        return ("map",) + tuple(tuple(a) if isinstance(a, list) else a for a in args)


class _TritonShapedCompiled:
    """A compiled kernel whose launcher is shaped as Triton 3.6's: ``run`` is an object that
    Triton's own ``CudaLauncher.__call__`` runs, its ``launch`` Triton's own
    ``wrap_handle_tensordesc`` wrapper around a C launch that records its arguments."""

    function, packed_metadata = "fn-handle", ("packed",)

    def __init__(self, launch, dtype):
        from triton.backends.nvidia import driver as nvd

        self.c_calls = []
        signature = wy.wy_signature(launch, dtype)
        metas = [dict(swizzle=3, elem_size=2, elem_type=9 + i, block_size=list(launch.desc(name).block_shape),
                      fp4_padded=False)
                 for i, name in enumerate(n for n, t in signature.items() if t.startswith("tensordesc"))]
        self.run = triton_shaped_launcher(
            nvd.wrap_handle_tensordesc(lambda *a: self.c_calls.append(a), signature, metas))


@pytest.fixture
def fake_driver(monkeypatch):
    from triton.runtime.driver import driver

    recorder = _FillRecorder()
    monkeypatch.setattr(driver, "_active", type("Driver", (), {"utils": recorder})())
    return recorder


def test_the_c_launch_gets_what_tritons_launcher_hands_it(setup, direct, fake_driver, monkeypatch):
    """The C launch path and Triton's Python launcher (its CudaLauncher.__call__ and
    descriptor wrapper, fed TmaArgs) hand the C function the same arguments: flags, scratch,
    metadata, every argument in the kernel's order and each descriptor encoded alike."""
    launch, tensors, args = setup
    compiled = _TritonShapedCompiled(launch.shared, tensors["k"].dtype)
    fn = _Jit(wy._wy_fwd_kernel, compiled=compiled)
    _launch(fn, launch, tensors, args())  # binds
    for _ in range(2):
        _launch(fn, launch, tensors, args())
    assert fake_driver.encoded == len(launch.descriptors)  # encoded once, then kept by address and rows
    direct_calls = list(compiled.c_calls)
    # The same launch through Triton's Python launcher: kernels kept without their C launch.
    monkeypatch.setattr(compat, "raw_launch", lambda kernel: None)
    for key in [k for k in launch.shared.compiled if k != L._SLOTS]:
        del launch.shared.compiled[key]
    _launch(fn, launch, tensors, args())  # binds again
    _launch(fn, launch, tensors, args())
    assert len(fn.bound) == 2 and len(compiled.c_calls) == 3
    triton_call = compiled.c_calls[-1]
    assert direct_calls == [triton_call, triton_call]
    assert len(triton_call) == 13 + len(fn.arg_names) + 4 * len(launch.descriptors)


def test_new_rows_and_buffers_are_encoded_anew(setup, direct, fake_driver):
    launch, tensors, args = setup
    compiled = _TritonShapedCompiled(launch.shared, tensors["k"].dtype)
    fn = _Jit(wy._wy_fwd_kernel, compiled=compiled)
    _launch(fn, launch, tensors, args())
    _launch(fn, launch, tensors, args())
    encoded = fake_driver.encoded
    w2 = torch.empty_like(tensors["w"])
    _launch(fn, launch, {**tensors, "w": w2}, args(w_ptr=w2))
    assert fake_driver.encoded == encoded + 1
    maps = [a for a in compiled.c_calls[-1] if isinstance(a, tuple) and a[:1] == ("map",)]
    assert len(maps) == len(launch.descriptors) and any(m[1] == w2.data_ptr() for m in maps)
    # More buffers than are kept: the oldest are dropped, nothing grows without bound.
    for _ in range(L.TMA_MAPS_KEPT + 5):
        w3 = torch.empty_like(tensors["w"])
        _launch(fn, launch, {**tensors, "w": w3}, args(w_ptr=w3))
    kept = next(v for v in launch.shared.compiled.values() if isinstance(v, L._Kept))
    assert all(len(maps) <= L.TMA_MAPS_KEPT for *_, maps, _ in kept.descs)


def _varied_launches(setup, gen):
    """Launch arguments a stream of calls hands one plan: new buffers and lengths, and now
    and then a value class the first binding did not see (a 4-byte-aligned g, a bf16 beta,
    N = 1, a misaligned w buffer, another current device), each followed by the original
    class again."""
    launch, tensors, args = setup
    g = args()["g"]
    shifted = torch.empty(g.numel() + 1, dtype=g.dtype)[1:].view_as(g)
    w_odd = torch.empty(tensors["w"].numel() + 8, dtype=tensors["w"].dtype)[8:].view_as(tensors["w"])
    variants = [{}, {"g": shifted}, {"beta": args()["beta"].to(torch.bfloat16)}, {"N": 1}, {"w": w_odd},
                {"device": 1}]
    buffers = [tensors["w"]] + [torch.empty_like(tensors["w"]) for _ in range(3)]
    stream = []
    for _ in range(30):
        pick = dict(variants[int(torch.randint(0, len(variants), (1,), generator=gen))])
        w = pick.pop("w", buffers[int(torch.randint(0, len(buffers), (1,), generator=gen))])
        device = pick.pop("device", 0)
        stream.append(({**tensors, "w": w}, args(w_ptr=w, **pick), device))
    return stream


@pytest.mark.parametrize("seed", range(3))
def test_the_straight_line_launcher_hands_the_c_launch_what_binding_does(setup, direct, fake_driver, monkeypatch,
                                                                          seed):
    """Over a stream of launches of one plan (other buffers, other value classes now and
    then), the C launch gets the same arguments, and the same kernels are bound, with the
    straight-line launchers (:func:`.launch.fast_launcher`) as without them."""
    from triton.runtime.driver import driver

    launch, tensors, _ = setup
    stream = _varied_launches(setup, torch.Generator().manual_seed(seed))
    make = L.fast_launcher
    runs = {}
    for mode in ("generic", "fast"):
        monkeypatch.setattr(L, "fast_launcher", _counting(make, runs) if mode == "fast" else (lambda *a: None))
        monkeypatch.setattr(driver, "_active", type("Driver", (), {"utils": _FillRecorder()})())
        for key in list(launch.shared.compiled):
            del launch.shared.compiled[key]
        compiled = _TritonShapedCompiled(launch.shared, tensors["k"].dtype)
        fn = _Jit(wy._wy_fwd_kernel, compiled=compiled)
        for t, a, device in stream:
            monkeypatch.setattr(L._RUNTIME, "current_device", lambda d=device: d)
            _launch(fn, launch, t, a)
        runs[mode] = (len(fn.bound), compiled.c_calls)
    assert runs["fast"][0] == runs["generic"][0] >= 2
    assert len(runs["fast"][1]) == len(runs["generic"][1]) >= 12
    assert runs["fast"][1] == runs["generic"][1]
    assert runs["made"] >= 2  # launchers were made, for more than one kept kernel


def _counting(make, counts):
    def wrapped(*a):
        counts["made"] = counts.get("made", 0) + 1
        return make(*a)
    return wrapped


def test_the_straight_line_launcher_refuses_another_value_class(setup, direct, fake_driver):
    """The launcher made for one kept kernel launches nothing and says so for an argument
    of another class (alignment, dtype, integer class, bool), another device or another
    argument count; for its own class it launches."""
    launch, tensors, args = setup
    compiled = _TritonShapedCompiled(launch.shared, tensors["k"].dtype)
    fn = _Jit(wy._wy_fwd_kernel, compiled=compiled)
    _launch(fn, launch, tensors, args())
    _launch(fn, launch, tensors, args())
    fast = launch.shared.compiled[L._FAST]
    assert fast is not None
    device = L._runtime().current_device()  # what launch_planned passes
    calls = len(compiled.c_calls)
    assert fast(device, args(N=3), tensors, 1, 1, 1, 1234) is True
    g = args()["g"]
    shifted = torch.empty(g.numel() + 1, dtype=g.dtype)[1:].view_as(g)
    for other in (dict(g=shifted), dict(beta=g.to(torch.bfloat16)), dict(s_g=True), dict(N=2 ** 31), dict(N=1.0)):
        assert fast(device, args(**other), tensors, 1, 1, 1, 1234) is False, other
    assert fast("another device", args(), tensors, 1, 1, 1, 1234) is False
    assert fast(device, {**args(), "extra": 1}, tensors, 1, 1, 1, 1234) is False
    # The kernel's integers are do_not_specialize (keyed by type and range): N = 1 or 16
    # launches. Guarded as specialized, they are other classes than the bound N = 6.
    assert fast(device, args(N=1), tensors, 1, 1, 1, 1234) and fast(device, args(N=16), tensors, 1, 1, 1, 1234)
    kept = next(v for v in launch.shared.compiled.values() if isinstance(v, L._Kept))
    specialized = L.fast_launcher(kept, device, args(), frozenset())
    assert specialized(device, args(N=5), tensors, 1, 1, 1, 1234) is True
    for n in (1, 16):
        assert specialized(device, args(N=n), tensors, 1, 1, 1, 1234) is False, n
    # Four C launches (N = 3, 1, 16; the specialized launcher's N = 5), one kernel bound.
    assert len(compiled.c_calls) == calls + 4 and len(fn.bound) == 1


def test_launchers_of_another_shape_are_not_called_directly(setup, direct):
    launch, tensors, _ = setup
    compiled = _TritonShapedCompiled(launch.shared, tensors["k"].dtype)
    assert compat.raw_launch(compiled) is not None
    compiled.run.global_scratch_size = 256  # Triton allocates scratch per launch
    assert compat.raw_launch(compiled) is None
    compiled.run.global_scratch_size = 0
    compiled.run.launch = (lambda inner: lambda *a: inner(*a))(compiled.run.launch)  # an unknown wrapper
    assert compat.raw_launch(compiled) is None
    assert compat.raw_launch(_Compiled()) is None  # no launcher object at all


CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else None


@pytest.mark.gpu
@pytest.mark.skipif(CAPABILITY is None or CAPABILITY[0] not in (9, 10), reason="needs a CUDA GPU of compute capability 9.0 or 10.x")
@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 130, 0], [256, 256]], ids=["tails", "whole"])
def test_direct_launches_match_triton_launches_on_the_gpu(lengths, monkeypatch):
    """Forward through Triton's binder on every launch, then through the kept kernels: the
    same bits; then with g misaligned (a new specialization, compiled and kept)."""
    from gdn_dispatch import chunk_gated_delta_rule, reference

    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache

    if not L._runtime().direct:
        pytest.skip(f"direct launches are verified for Triton {compat.DIRECT_LAUNCH_TRITON} only")
    clear_plan_cache()  # fresh plans: no kernels kept by earlier tests
    backend = "gluon_sm90" if CAPABILITY[0] == 9 else "gluon_sm100"
    p = random_problem(lengths=lengths, H=2, HV=4, K=128, V=128, device="cuda", seed=11, ht=True)

    def call(g):
        return chunk_gated_delta_rule(p.q, p.k, p.v, g, p.beta, scale=p.scale, initial_state=p.initial_state,
                                      output_final_state=True, cu_seqlens=p.cu_seqlens,
                                      cu_seqlens_cpu=p.chunks.cu_seqlens_host, backend=backend)

    bound = []
    jit_launch = L._jit_launch
    monkeypatch.setattr(L, "_jit_launch", lambda fn, *a: bound.append(fn) or jit_launch(fn, *a))

    def check(g, binds):
        del bound[:]
        o, s = call(g)
        torch.testing.assert_close(o, o_jit, rtol=0, atol=0)
        torch.testing.assert_close(s, s_jit, rtol=0, atol=0)
        assert len(bound) == binds
        return o

    monkeypatch.setenv(L.JIT_LAUNCH_ENV, "1")
    o_jit, s_jit = call(p.g)
    monkeypatch.delenv(L.JIT_LAUNCH_ENV)
    check(p.g, 2)  # wy and state_output bind once and keep their kernels ...
    check(p.g, 0)  # ... which later calls launch directly
    check(p.g, 0)
    buffer = torch.empty(p.g.numel() + 1, dtype=p.g.dtype, device="cuda")
    g_odd = buffer[1:].view_as(p.g)
    g_odd.copy_(p.g)
    assert g_odd.data_ptr() % 16
    check(g_odd, 1)  # only wy reads g: a new specialization of it
    o = check(g_odd, 0)
    o_ref, _ = reference.forward(p)
    assert rel_rms_error(o, o_ref) <= 1e-2


def test_a_c_launch_that_does_not_match_the_plan_is_not_used(setup, direct, monkeypatch):
    """A C launch whose descriptor count differs from the plan's is not this plan's kernel:
    the kept kernel launches through its Python launcher (TmaArgs) instead."""
    launch, tensors, args = setup
    c_calls = []
    short = compat.RawLaunch(lambda *a: c_calls.append(a), ("fn-handle",) + (None,) * 8,
                             [{}] * (len(launch.descriptors) - 1))
    monkeypatch.setattr(compat, "raw_launch", lambda kernel: short)
    fn = _Jit(wy._wy_fwd_kernel)
    for _ in range(2):
        _launch(fn, launch, tensors, args())
    assert c_calls == [] and len(fn.compiled.calls) == 1
    assert sum(isinstance(a, L.TmaArg) for a in fn.compiled.calls[0]) == len(launch.descriptors)


def test_launch_hooks_set_reads_both_hooks_in_either_form():
    """Triton 3.6 keeps launch hooks in HookChains (``calls``, empty by default); older
    releases hold one callable or None. Either hook, enter or exit, counts."""
    from types import SimpleNamespace

    from gdn_dispatch.backends.gluon_common.compat import launch_hooks_set

    def knobs(enter, leave):
        return SimpleNamespace(launch_enter_hook=enter, launch_exit_hook=leave)

    empty, full = SimpleNamespace(calls=[]), SimpleNamespace(calls=[print])
    assert not launch_hooks_set(knobs(None, None)) and not launch_hooks_set(knobs(empty, empty))
    assert launch_hooks_set(knobs(full, empty)) and launch_hooks_set(knobs(empty, full))
    assert launch_hooks_set(knobs(print, None)) and launch_hooks_set(knobs(None, print))
