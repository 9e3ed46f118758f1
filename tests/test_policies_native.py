"""The compiled policy modules (policies/native.py, setup.py): same decisions as the source, and
the source whenever the build is stale or ``KVGATE_PURE=1``."""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import policies
from policies import native

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "policies"
BUILT = all(native._extension(PKG, name) for name in native.COMPILED)
needs_build = pytest.mark.skipif(not BUILT, reason="policies not compiled (no mypy or C compiler)")
CAN_BUILD = bool(shutil.which("cc")) and Path(sysconfig.get_paths()["include"], "Python.h").exists()


def _run(code: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> str:
    proc = subprocess.run([sys.executable, *code], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=120, check=True)  # fmt: skip
    return proc.stdout + proc.stderr


def test_stale_names_the_modules_whose_source_changed_since_the_build(tmp_path: Path) -> None:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for name in native.COMPILED:
        (tmp_path / f"{name}.py").write_text(f"# {name}\n")
        (tmp_path / f"{name}{suffix}").write_text("")
    assert native.stale(tmp_path) == list(native.COMPILED)  # no record: built from who knows what
    (tmp_path / native.RECORD).write_text(native.record_text(tmp_path))
    assert native.stale(tmp_path) == []
    (tmp_path / "warming.py").write_text("# warming, edited\n")
    assert native.stale(tmp_path) == ["warming"]
    (tmp_path / f"slots{suffix}").unlink()  # not compiled: the source is what runs anyway
    (tmp_path / "slots.py").write_text("# slots, edited\n")
    assert native.stale(tmp_path) == ["warming"]


def test_pure_runs_the_source() -> None:
    out = _run(["-c", "import policies; print(policies.native.compiled())"], {"KVGATE_PURE": "1"})
    assert out.strip() == "False"


@pytest.mark.skipif(not CAN_BUILD or native.pure(),
                    reason="no C compiler or Python headers, or KVGATE_PURE")  # fmt: skip
def test_the_install_compiled_the_policies() -> None:
    assert BUILT, "not compiled: `pip install -v -e .` says why ('kvgate: policies not compiled')"
    assert policies.native.compiled()  # and the test run imported them


@needs_build
@pytest.mark.parametrize("seed", [1, 2])
def test_compiled_and_source_make_the_same_decisions(seed: int) -> None:
    script = str(ROOT / "tests" / "replay_decisions.py")
    compiled = json.loads(_run([script, str(seed)], {"KVGATE_PURE": "0"}))
    source = json.loads(_run([script, str(seed)], {"KVGATE_PURE": "1"}))
    assert compiled["compiled"] and not source["compiled"]
    assert len(compiled["decisions"][0]) > 300
    assert compiled["decisions"] == source["decisions"]


@needs_build
def test_a_build_from_another_source_runs_the_source(tmp_path: Path) -> None:
    shutil.copytree(PKG, tmp_path / "policies", ignore=shutil.ignore_patterns("__pycache__"))
    for lib in ROOT.glob("*__mypyc*"):
        shutil.copy2(lib, tmp_path / lib.name)
    probe = ["-W", "always", "-c", "import policies; print(policies.native.compiled())"]
    env = {"PYTHONPATH": str(tmp_path)}
    assert _run(probe, env, tmp_path).strip() == "True"  # the copy is a working build
    with (tmp_path / "policies" / "warming.py").open("a") as f:
        f.write("# edited after the build\n")
    out = _run(probe, env, tmp_path)
    assert out.splitlines()[0] == "False"
    assert "built from another source (warming)" in out


@needs_build
def test_a_build_whose_library_does_not_load_runs_the_source(tmp_path: Path) -> None:
    shutil.copytree(PKG, tmp_path / "policies", ignore=shutil.ignore_patterns("__pycache__"))
    for lib in ROOT.glob("*__mypyc*"):
        (tmp_path / lib.name).write_bytes(b"")  # found first, and no shared object
    probe = ["-W", "always", "-c", "import policies; print(policies.native.compiled())"]
    out = _run(probe, {"PYTHONPATH": str(tmp_path)}, tmp_path)
    assert out.splitlines()[0] == "False"
    assert "unusable" in out
