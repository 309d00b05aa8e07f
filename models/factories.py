"""Find the callable a model spec names: `"package.module:factory"` or `"path/file.py:factory"`.

A module spec is imported as any import is, so the module must be importable in the process of
every role that builds the model (clients, workers, aggregator, coordinator); the errors say
how to make it so. A file spec (the module part ends in `.py`) loads that one file, a relative
path from the current directory, without adding anything to `sys.path`; a file loaded once is
reused (`sys.modules`, under a name made from its absolute path), as an imported module is.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from models.errors import ModelSpecError

_SHOWN_PATHS = 4
_SHOWN_CALLABLES = 12


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The callable named by `spec` (the part after `:` may be dotted, e.g. `Cls.build`)."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ModelSpecError(
            f"model spec {spec!r} must look like 'package.module:factory' or 'path/file.py:factory'"
        )
    if module_name.endswith(".py"):
        module = _load_file(spec, Path(module_name))
    else:
        module = _import(spec, module_name)
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ModelSpecError(
                f"{module_name!r} has no attribute {attr_path!r} (model spec {spec!r}); "
                f"its callables are {_callables(module)}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ModelSpecError(f"{spec!r} names a {type(target).__name__}, not a callable")
    return target  # type: ignore[no-any-return]


def _import(spec: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not _is_parent_or_self(exc.name, module_name):
            raise _failed(spec, module_name, exc) from exc  # a dependency of it is missing
        raise ModelSpecError(
            f"cannot import module {module_name!r} of model spec {spec!r}: {exc}. It must be "
            "importable in the process of every role (clients, workers, aggregator, "
            "coordinator): put the folder holding it on PYTHONPATH (PYTHONPATH=/path/to/folder "
            "splitmq ...), install its package (pip install -e ...), or name its file instead "
            f"('path/to/{module_name.rsplit('.', 1)[-1]}.py:factory'). The current directory "
            f"is {os.getcwd()}; sys.path starts with {sys.path[:_SHOWN_PATHS]}"
        ) from exc
    except Exception as exc:
        raise _failed(spec, module_name, exc) from exc


def _is_parent_or_self(missing: str, module_name: str) -> bool:
    return module_name == missing or module_name.startswith(missing + ".")


def _failed(spec: str, module_name: str, exc: BaseException) -> ModelSpecError:
    return ModelSpecError(f"importing {module_name!r} for model spec {spec!r} failed: {exc!r}")


def _load_file(spec: str, path: Path) -> ModuleType:
    resolved = path.resolve()
    if not resolved.is_file():
        raise ModelSpecError(
            f"model file {str(path)!r} of model spec {spec!r} not found (relative paths are "
            f"from the current directory, {os.getcwd()}; every role needs the file there)"
        )
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    name = f"splitmq_model_{resolved.stem}_{digest}"
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    loader = importlib.util.spec_from_file_location(name, resolved)
    if loader is None or loader.loader is None:
        raise ModelSpecError(f"model file {str(path)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(loader)
    # Registered before it runs, as an import does: dataclasses and typing look a module up
    # by name while it executes.
    sys.modules[name] = module
    try:
        loader.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _failed(spec, str(path), exc) from exc
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _callables(module: ModuleType) -> list[str]:
    names = [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module.__name__
    ]
    return names[:_SHOWN_CALLABLES]
