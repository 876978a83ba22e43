"""A real client: transformers' Qwen3.5 with its chunked GDN function replaced by ours.

``transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule`` is swapped for
:func:`gdn_dispatch.chunk_gated_delta_rule` as is: transformers calls it with its own
arguments (q, k, v split out of one projection after a transposed causal conv, so their
last dim is strided; ``g=, beta=, initial_state=, output_final_state=,
use_qk_l2norm_in_kernel=True, cu_seqlens=None`` and ``use_cache``). A prefill, a second
prefill continuing from the cache (our final state as its initial state) and teacher-forced
single-token decode steps (transformers' own recurrent step reading the state we left in
the cache) give logits that match transformers' torch path on the same weights.

CPU tier: the reference backend in float32, tight tolerance. GPU tier: every GPU backend the
registry admits, bfloat16, head dims 128, within fla's own error on the same test (when fla
is importable) or 2e-2, whichever is larger; a final state 25% off fails it.
"""

import functools
import inspect

import pytest
import torch

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.testing import rel_rms_error, runnable_gpu_backends

transformers = pytest.importorskip("transformers", reason="needs the [integration] extra (transformers >= 5)")
qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5",
                           reason="needs transformers with Qwen3.5 (>= 5.0)")

#: Relative RMS error of the logits, ours vs transformers' torch path, per tier (on the GPU
#: the larger of this and fla's own error on the same test).
TOLERANCE = {"cpu": 1e-5, "gpu": 2e-2}


def tiny_config(head_dim: int):
    """3 linear-attention layers and 1 full-attention layer, HV = 2 H."""
    return transformers.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=4 * head_dim, intermediate_size=8 * head_dim, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim + (8 if head_dim < 64 else 0),
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.1,
    )


#: The cache keyword of the model's forward: ``cache`` from transformers 5.2x, ``past_key_values``
#: before (an unknown name is swallowed by ``**kwargs``, and the model silently runs uncached).
CACHE_ARG = "cache" if "cache" in inspect.signature(qwen.Qwen3_5ForCausalLM.forward).parameters else "past_key_values"


def _run(model, ids, split, steps):
    """Logits of a prefill of ids[:, :split], a continuation prefill up to ids[:, :-steps], and
    ``steps`` teacher-forced single-token decode steps, all on one cache."""
    out = model(input_ids=ids[:, :split], use_cache=True)
    cache = out.past_key_values
    logits = [out.logits]
    out = model(input_ids=ids[:, split:-steps], **{CACHE_ARG: cache}, use_cache=True)
    logits.append(out.logits)
    for t in range(ids.shape[1] - steps, ids.shape[1]):
        out = model(input_ids=ids[:, t:t + 1], **{CACHE_ARG: out.past_key_values}, use_cache=True)
        logits.append(out.logits)
    return logits


def _model(device, dtype, head_dim):
    torch.manual_seed(0)
    model = qwen.Qwen3_5ForCausalLM(tiny_config(head_dim)).to(device=device, dtype=dtype).eval()
    return model, torch.randint(0, 256, (2, 101), device=device)


#: transformers' own torch functions. The module-level names are wrappers that resolve, once
#: at import, to fla's kernels when fla is importable; the expected side must not be fla.
TORCH_CHUNK = inspect.unwrap(qwen.torch_chunk_gated_delta_rule)
TORCH_RECURRENT = inspect.unwrap(qwen.torch_recurrent_gated_delta_rule)

SPLIT, STEPS = 70, 4
NAMES = ["prefill", "continuation"] + [f"decode{i}" for i in range(STEPS)]


def _errors(device, dtype, head_dim, fn, state_factor=1.0) -> dict[str, float]:
    """Relative RMS error of the logits (per step of :func:`_run`) with transformers' GDN
    function replaced by ``fn``, called exactly as transformers calls it, against
    transformers' own torch path on the same weights (its decode steps on both sides); the
    final states ``fn`` returns are scaled by ``state_factor`` (1: untouched)."""
    model, ids = _model(device, dtype, head_dim)
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("initial_state") is not None)
        o, final_state = fn(*args, **kwargs)
        return o, final_state * state_factor

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(qwen, "torch_recurrent_gated_delta_rule", TORCH_RECURRENT)
        patch.setattr(qwen, "torch_chunk_gated_delta_rule", TORCH_CHUNK)
        expected = _run(model, ids, SPLIT, STEPS)
        patch.setattr(qwen, "torch_chunk_gated_delta_rule", counted)
        actual = _run(model, ids, SPLIT, STEPS)
    # 3 GDN layers x (a prefill from zeros, a continuation from the cached state).
    assert calls == [False] * 3 + [True] * 3, calls
    return {name: rel_rms_error(a.float(), e.float()) for name, a, e in zip(NAMES, actual, expected)}


def _compare(device, dtype, head_dim, backend, tolerance, state_factor=1.0):
    errors = _errors(device, dtype, head_dim, functools.partial(chunk_gated_delta_rule, backend=backend), state_factor)
    print(f"{backend}: worst {max(errors.values()):.4g} (bound {tolerance:.4g}) {errors}")
    assert max(errors.values()) <= tolerance, errors


@functools.lru_cache(maxsize=1)
def _fla_error() -> float | None:
    """fla's own error on the GPU test (its ``chunk_gated_delta_rule`` swapped in the same
    way), or None without fla."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        return None
    accepted = set(inspect.signature(fla_chunk).parameters)

    def fla_fn(*args, **kwargs):
        return fla_chunk(*args, **{k: v for k, v in kwargs.items() if k in accepted})

    return max(_errors("cuda", torch.bfloat16, 128, fla_fn).values())


def _gpu_tolerance() -> float:
    """The GPU tier's bound: fla's own error on the same test, or 2e-2, whichever is larger."""
    fla = _fla_error()
    print(f"transformers GPU tier: fla's error {fla}")
    return max(TOLERANCE["gpu"], fla or 0.0)


def test_qwen35_on_the_reference_backend_matches_transformers():
    _compare("cpu", torch.float32, head_dim=16, backend="reference", tolerance=TOLERANCE["cpu"])


def test_the_expected_side_is_transformers_torch_path_whatever_the_module_name_resolves_to(monkeypatch):
    """With fla importable, transformers binds its GDN names to fla's kernels; the expected
    logits must still come from transformers' own torch functions. A module-level name bound
    to a wrong function must leave the comparison unchanged."""
    def wrong(*args, **kwargs):
        o, final_state = TORCH_CHUNK(*args, **kwargs)
        return o * 1.5, final_state

    monkeypatch.setattr(qwen, "torch_chunk_gated_delta_rule", wrong)
    assert TORCH_CHUNK.__module__ == qwen.__name__ and TORCH_RECURRENT.__module__ == qwen.__name__
    _compare("cpu", torch.float32, head_dim=16, backend="reference", tolerance=TOLERANCE["cpu"])


def test_a_wrong_final_state_fails_the_comparison():
    """Negative control: the comparison sees a final state 2% off (through the continuation
    and the decode steps)."""
    with pytest.raises(AssertionError, match="continuation"):
        _compare("cpu", torch.float32, head_dim=16, backend="reference",
                 tolerance=TOLERANCE["cpu"], state_factor=1.02)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", runnable_gpu_backends())
def test_qwen35_on_each_gpu_backend_matches_transformers(backend):
    _compare("cuda", torch.bfloat16, head_dim=128, backend=backend, tolerance=_gpu_tolerance())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_wrong_final_state_fails_the_bfloat16_comparison():
    """Negative control of the GPU tier's bound: a final state 25% off fails it. (In bf16
    the logits of this model differ from the torch path by about 2e-2 for fla and for us
    alike, which hides small errors of the state: on the H200 the first decode step's error
    went from 0.011 to 0.015 with a state 2% off and to 0.021 with 10% off, against a bound
    of 0.020.)"""
    with pytest.raises(AssertionError, match="decode0"):
        _compare("cuda", torch.bfloat16, head_dim=128, backend=runnable_gpu_backends()[0],
                 tolerance=_gpu_tolerance(), state_factor=1.25)
