"""envvars.getenv reads the environment as os.environ.get does, at every call."""

from __future__ import annotations

import os

import pytest

from gdn_dispatch.envvars import getenv


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
