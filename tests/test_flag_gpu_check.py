"""benchmarks/flag_gpu_check.py's commands (no GPU, nothing run): every timing study's flag
is one ``--build-flag`` that :func:`gdn_dispatch.testing.set_build_flags` takes, and each
step's command carries the study's and the ``--with`` studies' flags."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def check():
    pytest.importorskip("triton.experimental.gluon")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import flag_gpu_check
        yield flag_gpu_check
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_every_settable_study_names_a_flag_the_build_flags_take(check, monkeypatch):
    import importlib

    from gdn_dispatch.testing import set_build_flags

    settable = 0
    for study, (module_name, flag, (_, on), _) in sorted(check.STUDIES.items()):
        try:
            [setting] = check.build_flags(study)
        except SystemExit:
            continue
        settable += 1
        module = importlib.import_module(module_name)
        # set_build_flags sets a module global: put it back once the study is checked.
        monkeypatch.setattr(module, flag, getattr(module, flag))
        assert list(set_build_flags([setting])) == [setting.split("=")[0]], study
        held = getattr(module, flag)
        assert getattr(held, "value", held) == getattr(on, "value", on), study
    assert settable >= len(check.STUDIES) - 1


def test_a_string_valued_flag_is_refused(check):
    with pytest.raises(SystemExit, match="wy_inverse"):
        check.build_flags("wy_inverse")


def test_each_step_carries_the_study_and_its_companions(check):
    commands = check.steps("scores_behind_v_new", ["shared_row_vectors", "half_tables"], 4)
    flags = ["gluon_sm90.fused.SCORES_BEHIND_V_NEW=1", "gluon_common.wy.SHARED_ROW_VECTORS=1",
             "gluon_common.blocked_inverse.HALF_TABLES=1"]
    for name in ("tests", "fuzz", "sanitize"):
        given = [commands[name][i + 1] for i, arg in enumerate(commands[name]) if arg == "--build-flag"]
        assert given == flags, name
    assert commands["ab"][-3:] == ["scores_behind_v_new", "--with", "shared_row_vectors,half_tables"]
    assert commands["fuzz"][-2:] == ["-k", "gluon_sm90"]


def test_a_group_sets_each_members_flag(check):
    commands = check.steps("scores_behind_v_new", ["fp16_inverse"], 4)
    given = [commands["tests"][i + 1] for i, arg in enumerate(commands["tests"]) if arg == "--build-flag"]
    assert given == ["gluon_sm90.fused.SCORES_BEHIND_V_NEW=1"] + [s for name in check.GROUPS["fp16_inverse"]
                                                                  for s in check.build_flags(name)]
    assert len(given) == 1 + len(check.GROUPS["fp16_inverse"])
