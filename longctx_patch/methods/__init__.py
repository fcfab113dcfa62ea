"""Method registry. Each method module registers itself with `@register_method` on import."""

from __future__ import annotations

import importlib
import importlib.util

from ..errors import ConfigError
from .base import Method, MethodConfig, PatchedAttention, _REGISTRY, attention_transfer, option, register_method

# Built-in method modules, imported on first use of the registry (import cost stays off `import longctx_patch`).
_BUILTIN = ("exact", "sliding_window", "muse", "lolcats", "lola", "ovq")
_loaded = False


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    for name in _BUILTIN:
        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            importlib.import_module(f"{__name__}.{name}")
    _loaded = True


def list_methods() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_method(name: str) -> Method:
    _load_builtins()
    key = name.replace("_", "-")
    if key not in _REGISTRY:
        raise ConfigError(f"unknown method {name!r}; available methods: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[key]


__all__ = [
    "Method",
    "MethodConfig",
    "PatchedAttention",
    "attention_transfer",
    "get_method",
    "list_methods",
    "option",
    "register_method",
]
