"""What a method (or the cache) asks of the patcher, which it cannot import: the patcher imports the methods, so an
import back would be a cycle. The patcher hands its functions over here when it is imported (`provide`), which
`import longctx_patch` does before anything can be patched.

- `patched_modules(model)`: {layer index: PatchedAttention} of a patched model, by layer; NotPatchedError when the
  model is not patched.
- `keep_original_weight(model, layer, name)`: call before changing the weight of the shared projection `name`
  (q_proj ...) of patched layer `layer` in place (e.g. merging a LoRA delta): the patcher keeps a copy of the
  original, which unpatch() puts back. Returns the weight.
"""

from __future__ import annotations

from typing import Callable

_PROVIDED: dict[str, Callable] = {}


def provide(*, patched_modules: Callable, keep_original_weight: Callable) -> None:
    """Called by the patcher on import."""
    _PROVIDED.update(patched_modules=patched_modules, keep_original_weight=keep_original_weight)


def _provided(name: str) -> Callable:
    if name not in _PROVIDED:
        raise RuntimeError(f"longctx_patch.patcher has not provided {name}(); import longctx_patch before using it")
    return _PROVIDED[name]


def patched_modules(model):
    return _provided("patched_modules")(model)


def keep_original_weight(model, layer: int, name: str):
    return _provided("keep_original_weight")(model, layer, name)


__all__ = ["keep_original_weight", "patched_modules", "provide"]
