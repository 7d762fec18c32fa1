"""Load a user's Python object named by a spec: ``"path/to/file.py:name"`` or ``"package.module:name"``.

A file is imported as a fresh module (its folder is put on ``sys.path`` first, so it may import its
neighbours); a module through ``importlib``. Every failure is a ``ValueError`` naming the spec, the
config key it came from (``what``) and the accepted forms.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

FORMS = "'path/to/file.py:name' or 'package.module:name'"


def load_object(spec: str, what: str):
    """The object ``spec`` names (module docstring); ``what`` is the config key, for errors."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{what}: {spec!r} is not {FORMS}")
    where, name = spec.split(":")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"{what}: no file {where} (from {spec!r}; expected {FORMS})")
        mod_name = f"arbor_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        module = sys.modules.get(mod_name)
        if module is None:
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            try:
                loader_spec.loader.exec_module(module)
            except Exception as e:
                raise ValueError(f"{what}: importing {where} failed: {type(e).__name__}: {e}") from e
            sys.modules[mod_name] = module
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise ValueError(f"{what}: cannot import module {where!r} (from {spec!r}): {type(e).__name__}: {e}; "
                             f"expected {FORMS}") from e
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(f"{what}: {where} has no {name!r} (its callables: {public})")
    return getattr(module, name)


def load_callable(spec: str, what: str):
    """``load_object`` that must be callable."""
    obj = load_object(spec, what)
    if not callable(obj):
        raise ValueError(f"{what}: {spec!r} is a {type(obj).__name__}, not a function")
    return obj
