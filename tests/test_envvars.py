"""envvars.getenv reads the environment as os.environ.get does, at every call; envvars.flag
reads an on/off switch and refuses any other value."""

from __future__ import annotations

import os
import re

import pytest
import torch

from gdn_dispatch.envvars import flag, getenv


@pytest.mark.parametrize("value", ["1", "0", "", "gluon_sm90,cuda:1=triton_generic", "ü"])
def test_getenv_follows_the_environment(monkeypatch, value):
    name = "GDN_DISPATCH_ENVVARS_TEST"
    monkeypatch.delenv(name, raising=False)
    assert getenv(name) is None and getenv(name, "d") == "d"
    monkeypatch.setenv(name, value)
    assert getenv(name) == value == os.environ.get(name)
    monkeypatch.delenv(name)
    assert getenv(name) is None


def test_getenv_reads_a_replaced_environ(monkeypatch):
    monkeypatch.setattr(os, "environ", {"GDN_DISPATCH_ENVVARS_TEST": "x"})
    assert getenv("GDN_DISPATCH_ENVVARS_TEST") == "x"


@pytest.mark.parametrize("value, on", [(None, False), ("", False), ("0", False), ("1", True)])
def test_flag_reads_on_and_off(monkeypatch, value, on):
    name = "GDN_DISPATCH_ENVVARS_TEST"
    monkeypatch.delenv(name, raising=False)
    if value is not None:
        monkeypatch.setenv(name, value)
    assert flag(name) is on


@pytest.mark.parametrize("value", ["true", "2", "yes", "on", " 1", "off"])
def test_flag_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("GDN_DISPATCH_ENVVARS_TEST", value)
    message = f"GDN_DISPATCH_ENVVARS_TEST={value!r}: expected 1 (on), 0 or unset (off)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        flag("GDN_DISPATCH_ENVVARS_TEST")


@pytest.mark.parametrize("value", ["true", "2"])
def test_debug_checks_refuse_a_value_that_is_neither_on_nor_off(monkeypatch, value):
    """GDN_DEBUG_CHECKS=true is not silently off: the call raises, naming the variable."""
    from gdn_dispatch import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(17)
    q, k = torch.randn(1, 31, 2, 16, generator=gen), torch.randn(1, 31, 2, 16, generator=gen)
    v = torch.randn(1, 31, 4, 16, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 31, 4, generator=gen))
    beta = torch.rand(1, 31, 4, generator=gen)
    monkeypatch.setenv("GDN_DEBUG_CHECKS", "0")
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, backend="reference")
    assert bool(torch.isfinite(o).all())
    monkeypatch.setenv("GDN_DEBUG_CHECKS", value)
    message = f"GDN_DEBUG_CHECKS={value!r}: expected 1 (on), 0 or unset (off)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        chunk_gated_delta_rule(q, k, v, g, beta, backend="reference")
