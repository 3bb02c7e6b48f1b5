"""Modules that load on first use, so `researcher --help` does not pay for the study runtime.

The study runtime (LangGraph graphs, the MLflow client, the launcher) costs seconds of imports.
Commands that only parse arguments, print help or list folders need none of it. `lazy_module(name)`
returns the module object at once and runs its code at the first attribute access, through the
standard library's `importlib.util.LazyLoader` (the recipe in the `importlib` docs). It changes when
a module loads, never what it contains; a module already imported is returned as it is. It is not
a way around an import cycle: the modules it defers import nothing from the command line.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_module(name: str) -> ModuleType:
    """`name`, imported now only as far as finding it; its code runs when an attribute is first used."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}")
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
