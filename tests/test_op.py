"""The custom op behind chunk_gated_delta_rule: schema, fake shapes, torch.compile (fullgraph,
dynamic T, one compilation), errors under compile, and CUDA-graph capture on a GPU."""

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from gdn_dispatch import GDNInputError, chunk_gated_delta_rule
from gdn_dispatch.op import INPLACE_OP_NAME, OP_NAME
from gdn_dispatch.testing import random_call, rel_rms_error, runnable_gpu_backends

# Sizes chosen so that no two dims coincide: dynamo's duck sizing would otherwise tie them
# (e.g. HV == N + 1) and a later call that breaks the tie would recompile.
H, HV, K, V = 2, 6, 8, 12
TOL = 1e-6  # float32, same reference computation traced and eager


def _op_args(call, output_final_state=True, layout="kv"):
    return (call["q"], call["k"], call["v"], call["g"], call["beta"], None, call.get("initial_state"),
            output_final_state, call.get("cu_seqlens"), call.get("cu_seqlens_cpu"), False, layout, None, None)


def varlen(lengths, seed=0, **over):
    return random_call(lengths=lengths, H=H, HV=HV, K=K, V=V, dtype=torch.float32, seed=seed, **over)


def uniform(B, T, seed=0, **over):
    return random_call(batch=(B, T), H=H, HV=HV, K=K, V=V, dtype=torch.float32, seed=seed, **over)


def test_ops_are_registered_with_their_schema():
    schema = str(torch.ops.gdn_dispatch.chunk_gated_delta_rule.default._schema)
    assert schema.startswith(OP_NAME + "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale")
    assert "str state_layout, str? backend" in schema and schema.endswith("-> (Tensor, Tensor)")
    inplace = str(torch.ops.gdn_dispatch.chunk_gated_delta_rule_inplace.default._schema)
    assert inplace.startswith(INPLACE_OP_NAME) and "!) initial_state" in inplace


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_op_matches_the_public_function(layout):
    call = varlen([3, 0, 70], state_layout=layout)
    o, ht = chunk_gated_delta_rule(**call, output_final_state=True)
    o_op, ht_op = torch.ops.gdn_dispatch.chunk_gated_delta_rule(*_op_args(call, layout=layout))
    torch.testing.assert_close(o_op, o, rtol=0, atol=0)
    torch.testing.assert_close(ht_op, ht, rtol=0, atol=0)
    _, none = torch.ops.gdn_dispatch.chunk_gated_delta_rule(*_op_args(call, output_final_state=False, layout=layout))
    assert none.shape == (0,) and none.dtype == torch.float32


def test_op_raises_the_contract_error():
    call = varlen([3, 0, 70])
    call["cu_seqlens_cpu"] = torch.tensor([0, 3, 3, 71], dtype=torch.int32)
    with pytest.raises(GDNInputError, match=r"cu_seqlens_cpu: expected to end at T = 73 \(q.shape\[1\]\), got 71"):
        torch.ops.gdn_dispatch.chunk_gated_delta_rule(*_op_args(call))


@pytest.mark.parametrize("layout, varlen_call, final", [
    pytest.param("kv", True, True, id="varlen-kv-ht"),
    pytest.param("vk", True, True, id="varlen-vk-ht"),
    pytest.param("kv", False, True, id="uniform-kv-ht"),
    pytest.param("vk", False, False, id="uniform-vk-no-ht"),
])
def test_fake_implementation_gives_exact_shapes_and_dtypes(layout, varlen_call, final):
    call = varlen([5, 9, 0, 17], state_layout=layout) if varlen_call else uniform(3, 31, state_layout=layout)
    call = {**call, "q": call["q"].bfloat16(), "k": call["k"].bfloat16(), "v": call["v"].bfloat16()}
    o, ht = torch.ops.gdn_dispatch.chunk_gated_delta_rule(*_op_args(call, final, layout))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {name: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for name, t in call.items()}
        o_fake, ht_fake = torch.ops.gdn_dispatch.chunk_gated_delta_rule(*_op_args(fake, final, layout))
    for real, f in ((o, o_fake), (ht, ht_fake)):
        assert (f.shape, f.dtype, f.stride()) == (real.shape, real.dtype, real.stride())
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32


@pytest.mark.parametrize("final", [True, False], ids=["ht", "no-ht"])
def test_opcheck(final):
    call = varlen([5, 0, 70])
    torch.library.opcheck(torch.ops.gdn_dispatch.chunk_gated_delta_rule.default, _op_args(call, final),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


class TinyGDNLayer(torch.nn.Module):
    """Projections around the op, as a model layer calls it."""

    def __init__(self, hidden=24):
        super().__init__()
        self.qkv = torch.nn.Linear(hidden, 2 * H * K + HV * V)
        self.gb = torch.nn.Linear(hidden, 2 * HV)
        self.out = torch.nn.Linear(HV * V, hidden)

    def forward(self, x, initial_state, cu_seqlens, cu_seqlens_cpu):
        B, T, _ = x.shape
        q, k, v = torch.split(self.qkv(x), [H * K, H * K, HV * V], dim=-1)
        a, b = self.gb(x).chunk(2, dim=-1)
        o, ht = chunk_gated_delta_rule(
            q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V),
            torch.nn.functional.logsigmoid(a), b.sigmoid(), initial_state=initial_state,
            output_final_state=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            use_qk_l2norm_in_kernel=True,
        )
        return self.out(o.reshape(B, T, HV * V)), ht


def _layer_inputs(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return (torch.randn(1, sum(lengths), 24, generator=gen), torch.randn(len(lengths), HV, K, V, generator=gen) * 0.1,
            cu, cu.clone())


@torch.no_grad()
def test_compiled_model_traces_fullgraph_once_for_two_lengths():
    torch.manual_seed(0)
    layer = TinyGDNLayer().eval()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    for lengths, seed in (([3, 70, 0, 9], 1), ([130, 1, 17, 40, 2], 2)):
        inputs = _layer_inputs(lengths, seed)
        y, ht = compiled(*inputs)
        y_ref, ht_ref = layer(*inputs)
        assert rel_rms_error(y, y_ref) <= TOL and rel_rms_error(ht, ht_ref) <= TOL
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times for two lengths"


def test_compiled_model_with_parameters_that_require_grad_runs_forward_only():
    """The op is forward only: parameters that require grad compile (AOTAutograd traces
    the op's refusing backward, which raises only when it runs) and the forward matches
    eager; a backward through the call raises."""
    torch.manual_seed(0)
    layer = TinyGDNLayer()
    inputs = _layer_inputs([3, 70, 0, 9], 1)
    y, ht = torch.compile(layer, fullgraph=True, backend="aot_eager")(*inputs)
    _, ht_eager = layer(*inputs)
    assert rel_rms_error(ht, ht_eager) <= TOL
    assert ht.requires_grad and ht.grad_fn is not None
    with pytest.raises(RuntimeError, match=r"custom op gdn_dispatch::chunk_gated_delta_rule .* is forward-only"):
        y.sum().backward()


@torch.no_grad()
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_compiled_uniform_call_with_dynamic_T_compiles_once(layout):
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, dynamic=True, backend=counter)
    def fn(q, k, v, g, beta, initial_state):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                       state_layout=layout)
        return o * 2, ht

    for T, seed in ((37, 1), (130, 2)):
        call = uniform(3, T, seed=seed, state_layout=layout)
        args = [call[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
        o, ht = fn(*args)
        o_ref, ht_ref = chunk_gated_delta_rule(*args[:5], initial_state=args[5], output_final_state=True,
                                               state_layout=layout)
        assert rel_rms_error(o, 2 * o_ref) <= TOL and rel_rms_error(ht, ht_ref) <= TOL
    assert counter.frame_count == 1


@torch.no_grad()
def test_compiled_call_without_final_state_returns_none():
    fn = torch.compile(lambda c: chunk_gated_delta_rule(**c), fullgraph=True, backend="aot_eager")
    o, ht = fn(varlen([4, 20]))
    assert ht is None and o.shape == (1, 24, HV, V)


@torch.no_grad()
def test_bad_input_raises_the_contract_error_under_compile():
    fn = torch.compile(lambda c: chunk_gated_delta_rule(**c), fullgraph=True, backend="aot_eager")
    call = varlen([4, 20])
    call["cu_seqlens_cpu"] = torch.tensor([0, 4, 23], dtype=torch.int32)
    with pytest.raises(GDNInputError, match=r"cu_seqlens_cpu: expected to end at T = 24 \(q.shape\[1\]\), got 23"):
        fn(call)
    # A bad non-tensor argument is seen while tracing: dynamo runs the frame eagerly, which
    # raises; with fullgraph=True dynamo reports the same message as the exception it met.
    bad_layout = {**varlen([4, 20]), "state_layout": "kvv"}
    message = r"state_layout: expected one of \['kv', 'vk'\], got 'kvv'"
    with pytest.raises(GDNInputError, match=message):
        torch.compile(lambda c: chunk_gated_delta_rule(**c), backend="aot_eager")(bad_layout)
    with pytest.raises(Exception, match=message):
        fn(bad_layout)


def _fake_call(mode, call):
    return {name: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for name, t in call.items()}


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), np.int64(1), 2], ids=str)
def test_traced_call_takes_any_real_scale_as_eager_does(scale):
    call = varlen([5, 0, 70], seed=3)
    o, _ = chunk_gated_delta_rule(**call, scale=scale)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        o_fake, _ = chunk_gated_delta_rule(**_fake_call(mode, call), scale=scale)
    assert (o_fake.shape, o_fake.dtype) == (o.shape, o.dtype)
    as_float = float(scale)
    with torch.no_grad():
        o_compiled, _ = torch.compile(lambda c: chunk_gated_delta_rule(**c, scale=as_float), fullgraph=True,
                                      backend="aot_eager")(call)
    assert rel_rms_error(o_compiled, o) <= TOL


@pytest.mark.parametrize("scale, message", [
    pytest.param(True, r"scale: expected a real number \(float, int, NumPy scalar\) or None, got bool", id="bool"),
    pytest.param(float("nan"), r"scale: expected a finite number, got nan", id="nan"),
    pytest.param(np.float32("inf"), r"scale: expected a finite number, got inf", id="np-inf"),
    pytest.param(torch.tensor(0.5), r"scale: .* got Tensor \(reading a tensor's value would synchronize", id="tensor"),
])
def test_traced_call_refuses_the_scales_eager_refuses(scale, message):
    call = varlen([5, 0, 70], seed=4)
    with pytest.raises(GDNInputError, match=message):
        chunk_gated_delta_rule(**call, scale=scale)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, pytest.raises(GDNInputError, match=message):
        chunk_gated_delta_rule(**_fake_call(mode, call), scale=scale)


@torch.no_grad()
def test_compiled_call_takes_a_scale_that_changes_between_calls():
    """A float argument that changes between calls is traced symbolically on the
    recompile; the scale check must take it."""
    call = varlen([5, 0, 70], seed=8)
    fn = torch.compile(lambda c, s: chunk_gated_delta_rule(**c, scale=s), fullgraph=True, backend="aot_eager")
    for scale in (0.5, 0.25, 0.125):
        assert rel_rms_error(fn(call, scale)[0], chunk_gated_delta_rule(**call, scale=scale)[0]) <= TOL


@torch.no_grad()
def test_numpy_scale_under_fullgraph_compile_says_how_to_pass_it():
    """dynamo traces a NumPy scalar argument as a 0-d array with no known value; without
    fullgraph the frame falls back to eager, which takes it."""
    call = varlen([5, 0, 70], seed=5)
    o, _ = chunk_gated_delta_rule(**call, scale=np.float32(0.3))
    fn = lambda c, s: chunk_gated_delta_rule(**c, scale=s)  # noqa: E731
    with pytest.raises(Exception, match=r"scale: .* got ndarray \(torch.compile traces a NumPy scalar as an array"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(call, np.float32(0.3))
    o_compiled, _ = torch.compile(fn, backend="aot_eager")(call, np.float32(0.3))
    assert rel_rms_error(o_compiled, o) <= TOL


def _meta(t):
    return t.to("meta") if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize("lengths, batch, offsets, layout, final, pool", [
    pytest.param([5, 0, 70], None, "device", "kv", True, None, id="varlen-kv-ht"),
    pytest.param([5, 0, 70], None, "host-copy", "vk", False, None, id="varlen-host-copy-vk-no-ht"),
    pytest.param([5, 0, 70], None, "list", "vk", True, None, id="varlen-list-vk-ht"),
    pytest.param(None, (3, 31), None, "vk", True, None, id="uniform-vk-ht"),
    pytest.param([9, 64, 1], None, "device", "kv", True, (torch.float32, True), id="pool-f32-inplace-ht"),
    pytest.param([9, 64, 1], None, "host-copy", "vk", False, (torch.bfloat16, True), id="pool-bf16-inplace-no-ht"),
    pytest.param([9, 64, 1], None, "list", "kv", True, (torch.bfloat16, True), id="pool-list-bf16-inplace-ht"),
    pytest.param(None, (3, 31), None, "vk", True, (torch.bfloat16, False), id="pool-bf16-read-only-ht"),
])
def test_meta_tensors_give_the_outputs_shapes_and_dtypes(lengths, batch, offsets, layout, final, pool):
    call = random_call(lengths=lengths, batch=batch, H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, seed=6,
                       state_layout=layout)
    if lengths is not None:
        call["cu_seqlens_cpu"] = {"device": None, "host-copy": call["cu_seqlens_cpu"], "list": None}[offsets]
        if offsets == "list":
            call["cu_seqlens"] = call["cu_seqlens"].tolist()
    if pool is not None:
        dtype, inplace = pool
        gen = torch.Generator().manual_seed(7)
        rows = torch.randn(7, HV, *((K, V) if layout == "kv" else (V, K)), generator=gen).to(dtype)
        N = len(lengths) if lengths is not None else batch[0]
        call.update(initial_state=rows, state_indices=torch.tensor([4, -1, 0, 2][:N]), inplace_final_state=inplace)
    meta = {name: (t if name == "cu_seqlens_cpu" else _meta(t)) for name, t in call.items()}
    o_meta, ht_meta = chunk_gated_delta_rule(**meta, output_final_state=final)
    o, ht = chunk_gated_delta_rule(**call, output_final_state=final)
    assert o_meta.is_meta and (o_meta.shape, o_meta.dtype, o_meta.stride()) == (o.shape, o.dtype, o.stride())
    if final:
        assert ht_meta.is_meta and (ht_meta.shape, ht_meta.dtype, ht_meta.stride()) == (ht.shape, ht.dtype, ht.stride())
    else:
        assert ht_meta is None and ht is None
    if pool is not None:
        assert (meta["initial_state"].shape, meta["initial_state"].dtype) == (call["initial_state"].shape, pool[0])


def test_pass_through_keywords_are_ignored_and_others_raise():
    call = varlen([4, 20])
    o, _ = chunk_gated_delta_rule(**call, use_cache=True, cu_seq_lens_k=None, max_length_q=20)
    torch.testing.assert_close(o, chunk_gated_delta_rule(**call)[0], rtol=0, atol=0)
    with pytest.raises(GDNInputError, match=r"output_final_sate: not an argument of chunk_gated_delta_rule"):
        chunk_gated_delta_rule(**call, output_final_sate=True)


@torch.no_grad()
@pytest.mark.parametrize("over, message", [
    pytest.param(dict(inplace_final_state=True), r"inplace_final_state: needs state_indices", id="inplace-no-idx"),
    pytest.param(dict(initial_state=None, state_indices=torch.tensor([0, 1])),
                 r"state_indices: needs initial_state to be the state pool \[P, HV, K, V\]", id="idx-no-pool"),
])
def test_pool_argument_errors_under_compile_match_eager(over, message):
    call = {**varlen([4, 20]), **over}
    with pytest.raises(GDNInputError, match=message):
        chunk_gated_delta_rule(**call)
    with pytest.raises(GDNInputError, match=message):
        torch.compile(lambda c: chunk_gated_delta_rule(**c), backend="aot_eager")(call)


# --- GPU tier ---------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


GPU_BACKENDS = runnable_gpu_backends()


def _gpu_call(lengths, seed):
    return random_call(lengths=lengths, H=4, HV=8, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=seed)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_capture_and_replay(backend):
    """Capture a varlen call (cu_seqlens + cu_seqlens_cpu), replay it on new values of the
    same lengths: the replay matches an eager call, through the public function and the op."""
    lengths = [200, 63, 1, 321]
    static = _gpu_call(lengths, seed=1)
    for through_op in (False, True):
        def step():
            if through_op:
                return torch.ops.gdn_dispatch.chunk_gated_delta_rule(*_op_args(static)[:12], backend, None)
            return chunk_gated_delta_rule(**static, output_final_state=True, backend=backend)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_graph, ht_graph = step()
        fresh = _gpu_call(lengths, seed=2)
        for name in ("q", "k", "v", "g", "beta", "initial_state"):
            static[name].copy_(fresh[name])
        graph.replay()
        torch.cuda.synchronize()
        o_ref, ht_ref = chunk_gated_delta_rule(**fresh, output_final_state=True, backend=backend)
        assert rel_rms_error(o_graph, o_ref) <= 1e-6 and rel_rms_error(ht_graph, ht_ref) <= 1e-6


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@torch.no_grad()
def test_compiled_gpu_call_with_dynamic_T_compiles_once(backend):
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(fullgraph=True, dynamic=True, backend=counter)
    def fn(c):
        o, ht = chunk_gated_delta_rule(**c, output_final_state=True, backend=backend)
        return o.float() * 2, ht

    # N = 5 then 2: neither equals H = 4 or HV = 8 (duck sizing would tie them).
    for lengths, seed in (([200, 63, 1, 321, 17], 1), ([64, 1000], 2)):
        call = _gpu_call(lengths, seed)
        o, ht = fn(call)
        o_ref, ht_ref = chunk_gated_delta_rule(**call, output_final_state=True, backend=backend)
        assert rel_rms_error(o, 2 * o_ref.float()) <= 1e-6 and rel_rms_error(ht, ht_ref) <= 1e-6
    assert counter.frame_count == 1


@torch.no_grad()
def test_compiled_call_writes_the_state_pool_in_place():
    """inplace_final_state under compile is the _inplace op: the pool is written as in eager."""
    counter = CompileCounterWithBackend("aot_eager")

    def fn(call, pool, idx):
        return chunk_gated_delta_rule(**{**call, "initial_state": pool}, state_indices=idx, inplace_final_state=True,
                                      output_final_state=True)

    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    call = varlen([5, 70, 9], seed=1)
    pool = torch.randn(7, HV, K, V)
    idx = torch.tensor([4, -1, 0])
    pool_compiled, pool_eager = pool.clone(), pool.clone()
    o, ht = compiled(call, pool_compiled, idx)
    o_ref, ht_ref = fn(call, pool_eager, idx)
    torch.testing.assert_close(pool_compiled, pool_eager, rtol=0, atol=0)
    assert not torch.equal(pool_compiled[4], pool[4]) and torch.equal(pool_compiled[1], pool[1])
    assert rel_rms_error(o, o_ref) <= TOL and rel_rms_error(ht, ht_ref) <= TOL
    assert counter.frame_count == 1
