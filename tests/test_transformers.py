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
registry admits, bfloat16, head dims 128, against the same model in float32: ours may be
off it by at most twice what transformers' own bfloat16 run is (a state 2% off is not).
"""

import copy
import functools
import inspect

import pytest
import torch

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.testing import rel_rms_error, runnable_gpu_backends

transformers = pytest.importorskip("transformers", reason="needs the [integration] extra (transformers >= 5)")
qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5",
                           reason="needs transformers with Qwen3.5 (>= 5.0)")

#: Relative RMS error of the logits per tier: CPU, ours vs transformers' torch path (both
#: float32); GPU (bfloat16), ours vs the float32 model at most twice transformers' own
#: bfloat16 run's error against it.
TOLERANCE = {"cpu": 1e-5, "gpu": ("x", 2.0)}


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


def _compare(monkeypatch, device, dtype, head_dim, backend, tolerance, state_factor=1.0):
    """Logits of the model with transformers' GDN function and with ours (``backend``), on
    one cache each. ``tolerance``: a float bounds ours against transformers' at ``dtype``;
    ``("x", f)`` bounds ours against the float32 model by ``f`` times the error of
    transformers' own ``dtype`` run against it (a 16-bit model's logits carry its rounding
    everywhere; transformers' GDN runs in float32 inside, ours in 16-bit MMAs)."""
    torch.manual_seed(0)
    model32 = qwen.Qwen3_5ForCausalLM(tiny_config(head_dim)).to(device=device, dtype=torch.float32).eval()
    model = copy.deepcopy(model32).to(dtype=dtype)
    ids = torch.randint(0, 256, (2, 101), device=device)
    split, steps = 70, 4
    with torch.no_grad():
        expected = _run(model, ids, split, steps)
        truth = _run(model32, ids, split, steps) if isinstance(tolerance, tuple) else None

        calls = []
        ours = functools.partial(chunk_gated_delta_rule, backend=backend)

        @functools.wraps(chunk_gated_delta_rule)
        def counted(*args, **kwargs):
            calls.append(kwargs.get("initial_state") is not None)
            o, final_state = ours(*args, **kwargs)
            return o, final_state * state_factor

        monkeypatch.setattr(qwen, "torch_chunk_gated_delta_rule", counted)
        actual = _run(model, ids, split, steps)
    # 3 GDN layers x (a prefill from zeros, a continuation from the cached state).
    assert calls == [False] * 3 + [True] * 3, calls
    names = ["prefill", "continuation"] + [f"decode{i}" for i in range(steps)]

    def errors(got, want):
        return {name: rel_rms_error(a.float(), e.float()) for name, a, e in zip(names, got, want)}

    if truth is None:
        assert max(errors(actual, expected).values()) <= tolerance, errors(actual, expected)
        return
    ours_err, theirs_err = errors(actual, truth), errors(expected, truth)
    bound = tolerance[1] * max(theirs_err.values())
    print(f"logits vs float32: ours {max(ours_err.values()):.2e}, transformers {max(theirs_err.values()):.2e}")
    assert max(ours_err.values()) <= bound, f"ours vs float32 {ours_err}; transformers {dtype} vs float32 {theirs_err}"


def test_qwen35_on_the_reference_backend_matches_transformers(monkeypatch):
    _compare(monkeypatch, "cpu", torch.float32, head_dim=16, backend="reference", tolerance=TOLERANCE["cpu"])


def test_a_wrong_final_state_fails_the_comparison(monkeypatch):
    """Negative control: the comparison sees a final state 2% off (through the continuation
    and the decode steps)."""
    with pytest.raises(AssertionError, match="continuation"):
        _compare(monkeypatch, "cpu", torch.float32, head_dim=16, backend="reference",
                 tolerance=TOLERANCE["cpu"], state_factor=1.02)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", runnable_gpu_backends())
def test_qwen35_on_each_gpu_backend_matches_transformers(monkeypatch, backend):
    _compare(monkeypatch, "cuda", torch.bfloat16, head_dim=128, backend=backend, tolerance=TOLERANCE["gpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_wrong_final_state_fails_the_bfloat16_comparison(monkeypatch):
    """Negative control of the GPU tier's bound: a final state 2% off fails it."""
    with pytest.raises(AssertionError, match="ours vs float32"):
        _compare(monkeypatch, "cuda", torch.bfloat16, head_dim=128, backend=runnable_gpu_backends()[0],
                 tolerance=TOLERANCE["gpu"], state_factor=1.02)
