"""A method added to transformers' `PreTrainedModel` as soon as transformers defines it, at once where it has.

Imports neither torch nor transformers (`import hf_parallel` stays light): where `transformers.modeling_utils` is
not imported yet, a finder on `sys.meta_path` wraps that module's loader, and adds the method once the module
has run, which it must before any model exists.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable

MODELING = "transformers.modeling_utils"  # where PreTrainedModel is defined (5.17, 5.25)


def add_method_on_import(name: str, method: Callable) -> None:
    """`PreTrainedModel.<name> = method`, now where transformers has defined `PreTrainedModel`, else as soon as it
    does (once per name, however often this is called).

    Relies on: `PreTrainedModel` being defined in `transformers.modeling_utils`, which every model class
    imports (5.17, 5.25)."""
    if MODELING in sys.modules:
        _add(sys.modules[MODELING], name, method)
    elif not any(isinstance(finder, _AddMethodOnImport) and finder.name == name for finder in sys.meta_path):
        sys.meta_path.insert(0, _AddMethodOnImport(name, method))


def _add(modeling_utils, name: str, method: Callable) -> None:
    setattr(modeling_utils.PreTrainedModel, name, method)


class _AddMethodOnImport(importlib.abc.MetaPathFinder):
    """Adds the method once `transformers.modeling_utils` has run.

    A finder on `sys.meta_path` that finds nothing itself: for that one module it takes the spec the other
    finders give and wraps its loader; it removes itself once the module is found.
    """

    def __init__(self, name: str, method: Callable):
        self.name, self.method = name, method

    def find_spec(self, fullname, path, target=None):
        if fullname != MODELING:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _AddMethodLoader(spec.loader, self.name, self.method)
                return spec
        return None


class _AddMethodLoader(importlib.abc.Loader):
    """The module's own loader, and the method added once the module has run."""

    def __init__(self, loader, name: str, method: Callable):
        self.loader, self.name, self.method = loader, name, method

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _add(module, self.name, self.method)

    def __getattr__(self, name: str):  # get_source, get_resource_reader, ...: the module's own loader's
        return getattr(self.loader, name)
