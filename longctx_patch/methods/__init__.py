"""Method registry. Every folder of methods/ is a method: its `__init__.py` registers its `Method` with
`@register_method` on import. The shared modules of the methods (base.py, cache_layer.py, kv_layer.py, padding.py) are
plain files, so the folders are the methods; they are found and imported on first use of the registry (import cost
stays off `import longctx_patch`)."""

from __future__ import annotations

import importlib
import pkgutil
import threading

from ..errors import ConfigError
from .base import Method, MethodConfig, PatchedAttention, _REGISTRY, option, register_method

_loaded = False
_lock = threading.Lock()  # two threads asking first must not see a half-filled registry


def method_packages() -> list[str]:
    """The method folders under methods/ (package names, e.g. 'sliding_window'), sorted."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        for name in method_packages():
            importlib.import_module(f"{__name__}.{name}")
        _loaded = True


def list_methods() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_method(name: str) -> Method:
    _load_builtins()
    key = name.replace("_", "-")
    if key not in _REGISTRY:
        if "(" in name:
            base, items = split_method_spec(name)
            kw = ", ".join(f"{i.split('=', 1)[0].strip()}={i.split('=', 1)[1].strip()}" for i in items)
            raise ConfigError(f"method {name!r}: in Python the options are keyword arguments, e.g. "
                              f"patch(model, {base.strip()!r}, {kw}); the NAME(KEY=VALUE,...) form is the CLI's "
                              f"--method syntax")
        raise ConfigError(f"unknown method {name!r}; available methods: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[key]


UNPATCHED = ("none", "unpatched")  # the names that stand for no method: the model as it is


def is_unpatched(name: str | None) -> bool:
    """Whether `name` stands for no method (None, "", or one of UNPATCHED in any case): the model unpatched."""
    return name is None or str(name).strip().lower() in ("", *UNPATCHED)


def reference_method() -> str:
    """The registered method whose attention is the model's own (`Method.exact_reference`): what the evaluations add
    as their baseline and what stands for the unpatched model's attention; a ConfigError when none (or several) says
    so."""
    found = [name for name in list_methods() if _REGISTRY[name].exact_reference]
    if len(found) != 1:
        which = f"several registered methods ({', '.join(found)})" if found else "no registered method"
        raise ConfigError(f"{which} declare Method.exact_reference (the model's own attention, the evaluations' "
                          "baseline); exactly one must")
    return found[0]


def split_method_spec(raw: str) -> tuple[str, list[str]]:
    """The CLI's inline method syntax: 'lola(window=64,sparse_cache=64)' -> ('lola', ['window=64',
    'sparse_cache=64']); 'lola' -> ('lola', [])."""
    raw = raw.strip()
    if "(" not in raw:
        return raw, []
    if not raw.endswith(")"):
        raise ConfigError(f"bad method {raw!r}: write NAME or NAME(KEY=VALUE,...), e.g. 'lola(window=64,sparse_cache=64)'")
    name, inner = raw[:-1].split("(", 1)
    items = [i.strip() for i in inner.split(",") if i.strip()]
    for i in items:
        if "=" not in i:
            raise ConfigError(f"bad method {raw!r}: {i!r} is not KEY=VALUE")
    return name, items


__all__ = [
    "UNPATCHED",
    "Method",
    "MethodConfig",
    "PatchedAttention",
    "get_method",
    "is_unpatched",
    "list_methods",
    "method_packages",
    "option",
    "reference_method",
    "register_method",
    "split_method_spec",
]
