"""`import_callable`: a `package.module:attr.path` spec -> the callable it names, or one error that says why.

Shared by the registries that take user code by spec (reward functions, environments). It imports nothing of
asyncflow, so every layer may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, cast


def import_callable(spec: str, *, label: str, error: type[Exception]) -> Callable[..., Any]:
    """Import `package.module` and walk `attr.path`; raises `error` naming `label` and `spec` when the spec is
    malformed, the module does not import, an attribute is missing or the object is not callable."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise error(f"{label} {spec!r} must look like 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # ModuleNotFoundError, or any error raised while importing it
        raise error(f"{label} {spec!r}: cannot import module {module_name!r}: {err!r}") from err
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise error(f"{label} {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        target = getattr(target, part)
    if not callable(target):
        raise error(f"{label} {spec!r}: {attr_path!r} is a {type(target).__name__}, not callable")
    return cast("Callable[..., Any]", target)
