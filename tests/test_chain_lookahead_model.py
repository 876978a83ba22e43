"""benchmarks/chain_lookahead_model.py: the state chain's next ``k S`` formed one or two
chunks ahead is the same walk in exact arithmetic, and no less accurate in bf16 than the
shipped order beyond the model's own spread."""

from __future__ import annotations

from pathlib import Path

import pytest

from gdn_dispatch.testing import script_module

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "chain_lookahead_model.py"


@pytest.fixture(scope="module")
def model():
    return script_module(SCRIPT, "chain_lookahead_model_under_test")


@pytest.mark.parametrize("form", ["ahead1", "ahead2"])
@pytest.mark.parametrize("seed", [1, 2])
def test_forms_ahead_are_the_walk_in_exact_arithmetic(model, form, seed):
    x = model.inputs(0.0, length=1024, seed=seed)
    o_ref, s_ref = model.walk(*x, "shipped", model.exact)
    o, s = model.walk(*x, form, model.exact)
    assert model.rel_rms(o, o_ref) < 1e-5 and model.rel_rms(s, s_ref) < 1e-5


@pytest.mark.parametrize("form", ["ahead1", "ahead2"])
def test_forms_ahead_keep_the_shipped_orders_error_in_bf16(model, form):
    x = model.inputs(0.0, length=2048, seed=4)
    o_ref, s_ref = model.walk(*x, "shipped", model.exact)
    o_shipped, s_shipped = model.walk(*x, "shipped")
    o, s = model.walk(*x, form)
    assert 0 < model.rel_rms(o, o_ref) < 1.25 * model.rel_rms(o_shipped, o_ref)
    assert 0 < model.rel_rms(s, s_ref) < 1.25 * model.rel_rms(s_shipped, s_ref)
