"""Build hook: compile the policy modules on the request path with mypyc (``policies/native.py``).

Everything else is in pyproject.toml.  Without mypy or a C compiler, or with ``KVGATE_PURE=1``,
the package installs as plain Python and runs the same source.
"""

import importlib.util
from pathlib import Path

from setuptools import setup


def _compiled_modules() -> list:
    here = Path(__file__).parent
    spec = importlib.util.spec_from_file_location("kvgate_native", here / "policies/native.py")
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    if native.pure():
        return []
    for name in native.COMPILED:  # an earlier build's: if this one fails, the source must run
        for old in (here / "policies").glob(f"{name}.*.so"):
            old.unlink()
    try:
        from mypyc.build import mypycify

        # The modules they import stay Python and are not checked; installed packages (xxhash)
        # are not looked for: pip builds in an environment without them, and every build alike.
        flags = ["--follow-imports=silent", "--no-site-packages", "--ignore-missing-imports"]
        paths = [f"policies/{name}.py" for name in native.COMPILED]
        exts = mypycify([*flags, *paths], opt_level="3", debug_level="0")
    except (ImportError, SystemExit, Exception) as exc:  # mypy missing, or it rejected the types
        print(f"kvgate: policies not compiled ({exc!r}); installing them as plain Python")
        (here / "policies" / native.RECORD).unlink(missing_ok=True)
        return []
    # What they are built from: policies/native.py runs the source once it differs.
    (here / "policies" / native.RECORD).write_text(native.record_text(here / "policies"))
    names = {ext.name for ext in exts}
    for old in here.glob("*__mypyc*.so"):  # an earlier build's library (another set of modules)
        if old.name.split(".")[0] not in names:
            old.unlink()
    for ext in exts:
        ext.optional = True  # no C compiler: plain Python
    return exts


setup(ext_modules=_compiled_modules())
