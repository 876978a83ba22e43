"""registry.toml is found at run time from a source checkout and from a built wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import gdn_dispatch
from gdn_dispatch.registry import load_registry, registry_path

ROOT = Path(__file__).resolve().parents[1]


def test_checkout_finds_root_registry():
    if Path(gdn_dispatch.__file__).resolve().parent != ROOT / "gdn_dispatch":
        pytest.skip("gdn_dispatch is not imported from this checkout (not an editable install)")
    assert registry_path() == ROOT / "registry.toml"
    assert [r.name for r in load_registry()][-1] == "reference"


@pytest.mark.slow
def test_wheel_ships_registry_and_backends_inside_the_package(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("gdn_dispatch-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(tmp_path / "site")
    assert "gdn_dispatch/registry.toml" in names
    assert "gdn_dispatch/native/host_layer.cpp" in names  # the native host layer is built from it
    assert "gdn_dispatch/backends/__init__.py" in names and "gdn_dispatch/backends/triton_generic/__init__.py" in names
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"gdn_dispatch"}, f"the wheel installs other top-level packages: {top_level}"
    probe = ("from gdn_dispatch.registry import registry_path, load_registry; "
             "print(registry_path()); print(','.join(r.name for r in load_registry()))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    path, names_line = done.stdout.split()
    assert Path(path) == tmp_path / "site" / "gdn_dispatch" / "registry.toml"
    assert names_line.split(",")[-1] == "reference"
