"""The policy modules on the request path, compiled with mypyc where the build could (``setup.py``).

The same source runs either way: mypyc compiles these typed modules to C extensions that make the
same decisions at about half the cost (``kvgate bench policy`` prints which ran).  A build
without a C compiler or mypy installs them as plain Python.

An extension module is imported before its ``.py`` beside it, so a module compiled from another
source (edited since the build, or after a ``git pull``) would run the old code.  The build
records a digest of each source it compiled (``_native_build.py``, written by ``setup.py``), and
``use_source`` (run when ``policies/__init__`` imports this module, before anything else) checks
it: when any compiled module's source differs from the one recorded, the group's library does
not load, or ``KVGATE_PURE=1``, every module of the group is imported from source (they call
each other natively: all or none), with a warning unless asked for.  ``make`` rebuilds them when
their sources change.  (Digests, not file times: an installed wheel writes its files in any
order.)

Standard library only: ``setup.py`` loads this file on its own, before any dependency is there.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path

PACKAGE = "policies"
RECORD = "_native_build.py"  # written by setup.py with the compiled modules
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


def pure() -> bool:
    """Whether ``KVGATE_PURE`` asks for the source (the build skips compiling, the import the
    compiled modules)."""
    return os.environ.get("KVGATE_PURE", "") not in ("", "0")


def _extension(pkg_dir: Path, name: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = pkg_dir / f"{name}{suffix}"
        if path.exists():
            return path
    return None


def digests(pkg_dir: Path) -> dict[str, str]:
    """Each compiled module's source, by a digest of its bytes."""
    return {name: hashlib.sha256((pkg_dir / f"{name}.py").read_bytes()).hexdigest()[:16]
            for name in COMPILED}  # fmt: skip


def record_text(pkg_dir: Path) -> str:
    """The build record for the sources as they are (setup.py writes it beside them)."""
    return f"# Written by setup.py: the sources the compiled modules were built from.\nSOURCES = {digests(pkg_dir)!r}\n"


def recorded(pkg_dir: Path) -> dict[str, str]:
    """The digests the build recorded (none without a record)."""
    try:
        text = (pkg_dir / RECORD).read_text()
        return ast.literal_eval(text.split("SOURCES = ", 1)[1])
    except (OSError, IndexError, ValueError, SyntaxError):
        return {}


def stale(pkg_dir: Path) -> list[str]:
    """Compiled modules whose source is not the one they were built from."""
    built = recorded(pkg_dir)
    now = digests(pkg_dir)
    return [name for name in COMPILED
            if _extension(pkg_dir, name) is not None and built.get(name) != now[name]]  # fmt: skip


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
            f"compiled policy modules built from another source ({', '.join(old)}): running the "
            "source; `make` (or `pip install -e .`) rebuilds them",
            stacklevel=2,
        )
    elif not pure():
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


if __name__ == f"{PACKAGE}.native":  # imported by the package (setup.py loads it under another name)
    use_source(Path(__file__).parent)
