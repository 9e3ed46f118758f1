"""The policy modules on the request path, compiled with mypyc where the build could (``setup.py``).

The same source runs either way: mypyc compiles these typed modules to C extensions that make the
same decisions at about half the cost (``kvgate bench policy`` prints which ran).  A build
without a C compiler or mypy installs them as plain Python.

An extension module is imported before its ``.py`` beside it, so a compiled module older than its
source (edited since the build, or after a ``git pull``) would run the old code.  ``use_source``
(called first thing by ``policies/__init__``) checks: when any compiled module is older than its
source, or ``KVGATE_PURE=1``, every module of the group is imported from source (they call each
other natively: all or none), with a warning for the stale case.  ``make`` rebuilds them when
their sources change.

Standard library only: ``setup.py`` loads this file on its own, before any dependency is there.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path

PACKAGE = "policies"
COMPILED = (
    "cache_aware",
    "cache_aware_scores",
    "demand",
    "index_capacity",
    "index_events",
    "index_parts",
    "prefix_index",
    "pulls",
    "scoring",
    "sessions",
    "slots",
    "warming",
)


def _extension(pkg_dir: Path, name: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = pkg_dir / f"{name}{suffix}"
        if path.exists():
            return path
    return None


def stale(pkg_dir: Path) -> list[str]:
    """Compiled modules older than their source."""
    out = []
    for name in COMPILED:
        ext = _extension(pkg_dir, name)
        if ext is not None and ext.stat().st_mtime < (pkg_dir / f"{name}.py").stat().st_mtime:
            out.append(name)
    return out


class _SourceFinder:
    """Finds the group's modules as their ``.py`` files (ahead of the extension finder)."""

    def __init__(self, pkg_dir: Path) -> None:
        self._names = {f"{PACKAGE}.{name}": pkg_dir / f"{name}.py" for name in COMPILED}

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        source = self._names.get(fullname)
        return None if source is None else importlib.util.spec_from_file_location(fullname, source)


def use_source(pkg_dir: Path) -> None:
    """Import the group from source when it must be (see the module docstring)."""
    if any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        return
    if not any(_extension(pkg_dir, name) for name in COMPILED):
        return  # never compiled: the plain import finds the sources
    old = stale(pkg_dir)
    if old:
        warnings.warn(
            f"compiled policy modules older than their source ({', '.join(old)}): running the "
            "source; `make` (or `pip install -e .`) rebuilds them",
            stacklevel=2,
        )
    elif os.environ.get("KVGATE_PURE", "") in ("", "0"):
        try:  # a leaf of the group: it loads their shared library
            importlib.import_module(f"{PACKAGE}.index_parts")
            return
        except ImportError as exc:  # built for another interpreter, or the library is gone
            warnings.warn(f"compiled policy modules unusable ({exc}): running the source",
                          stacklevel=2)  # fmt: skip
            for name in COMPILED:
                sys.modules.pop(f"{PACKAGE}.{name}", None)
    sys.meta_path.insert(0, _SourceFinder(pkg_dir))


def compiled() -> bool:
    """Whether the policies in use are the compiled ones."""
    mod = sys.modules.get(f"{PACKAGE}.cache_aware")
    return mod is not None and not (getattr(mod, "__file__", "") or "").endswith(".py")


use_source(Path(__file__).parent)
