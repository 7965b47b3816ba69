"""What a config names: a built-in of a registry, or `module.path:attribute` for one of
the user's own (a reward function, an environment class)."""
from __future__ import annotations

import importlib
from typing import Any, Mapping


def resolve(name: str, built_ins: Mapping[str, Any], field: str, kind: str, attribute_kind: str) -> Any:
    """`built_ins[name]`, or the attribute `module.path:attribute` names.

    field: the config field that gave `name` (each message names it); kind: what the
    registry holds ("reward"); attribute_kind: what `module.path:` should name
    ("function"). Raises ValueError, one line, for a name that is neither or a module
    without the attribute, and ImportError for a module that cannot be imported.
    """
    if name in built_ins:
        return built_ins[name]
    module_name, _, attribute = name.partition(":")
    if not (module_name and attribute):
        raise ValueError(f"{field}={name!r} is not a registered {kind} ({', '.join(sorted(built_ins))}) nor "
                         f"module.path:{attribute_kind} naming one of your own.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"{field}={name!r}: cannot import module {module_name!r} ({type(error).__name__}: "
                          f"{error}); check the module path, and that it is on PYTHONPATH.") from error
    if not hasattr(module, attribute):
        raise ValueError(f"{field}={name!r}: module {module_name!r} has no attribute {attribute!r}.")
    return getattr(module, attribute)
