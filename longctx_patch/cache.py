"""transformers Cache integration for patched models.

`LongctxCache` is a `DynamicCache` whose layer list holds, for each patched layer, the cache layer its
module asked for (`PatchedAttention.make_cache_layer()`), and for every other layer what a plain
`DynamicCache(config=...)` would hold. `patch()` makes `model.generate()` and `model(..., use_cache=True)`
create it, so no extra argument is needed.

`LongctxLayer` (methods/cache_layer.py, importable from here too) is the base of method-specific cache layers: it
tracks how many tokens it has seen (what transformers reads for position ids and masks) independently of how many
it stores.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .methods.cache_layer import LongctxLayer
from .patch_state import patched_modules

__all__ = ["LongctxCache", "LongctxLayer", "cache_argument", "check_croppable"]


def cache_argument(forward) -> str:
    """The name under which a model's forward takes its cache: `cache` where transformers has it (newer 5.x, where
    `past_key_values` is deprecated), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class LongctxCache(DynamicCache):
    """One cache layer per decoder layer: method layers where patched, transformers' defaults elsewhere."""

    def __init__(self, model=None, *, layers: list | None = None):
        if layers is None:
            from .architectures import model_config

            cfg = model_config(model)
            base_layers = DynamicCache(config=cfg).layers
            n = cfg.num_hidden_layers
            if len(base_layers) != n:
                base_layers = [DynamicLayer() for _ in range(n)]
            mods = patched_modules(model)
            layers = [mods[i].make_cache_layer() if i in mods else base_layers[i] for i in range(n)]
        super(DynamicCache, self).__init__(layers=layers)
        # (any padding, left padding) read from the first forward's attention mask (patcher._padding_facts)
        self.padding_facts: tuple[bool, bool] | None = None

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """What transformers sizes the model's 4-D attention mask by. Patched modules never read that mask (they read
        the 2-D padding mask), so when every layer is a method's own the mask serves nobody: report the queries
        alone, and transformers skips it (SDPA's causal skip) or builds a `q x q` one, instead of a `q x (past + q)`
        mask per forward: a chunked prefill of 4 x 128k tokens built a 4.3 GB mask for its last chunk (peak memory
        grew with the context while the state did not). With unpatched layers (a hybrid) they get the real sizes."""
        if self.layers and all(isinstance(layer, LongctxLayer) for layer in self.layers):
            return query_length, 0
        return super().get_mask_sizes(query_length, layer_idx)

    def nbytes(self) -> int:
        """Bytes held by every layer's state tensors."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, LongctxLayer):
                total += layer.nbytes()
            else:
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, torch.Tensor):
                        total += t.numel() * t.element_size()
        return total


def check_croppable(model, cache) -> None:
    """Assisted decoding (an `assistant_model`, or `prompt_lookup_num_tokens`) drafts tokens and takes the rejected
    ones back out of the cache (`crop`): a ConfigError naming the methods whose cache layers cannot (their
    `crop_refusal`), before the prefill, instead of transformers' error after it. Layers that keep their tokens (the
    K/V buffers of exact, sliding-window, muse, token-gated moba; transformers' own) can."""
    from .errors import ConfigError
    from .methods.base import format_layers

    mods = patched_modules(model)
    refused: dict[tuple[str, str], list[int]] = {}
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if not getattr(layer, "is_croppable", True) and i in mods:
            why = getattr(layer, "crop_refusal", "its state is not a list of tokens")
            refused.setdefault((mods[i].method_name, why), []).append(i)
    if refused:
        which = "; ".join(f"{m} on layers {format_layers(idx)}: {why}" for (m, why), idx in refused.items())
        raise ConfigError(
            f"generate: assisted decoding (assistant_model=, prompt_lookup_num_tokens=) takes drafted tokens back out of "
            f"the cache, which this patch's cache cannot do ({which}); generate without an assistant, or patch with a "
            "method that keeps a K/V cache (exact, sliding-window, muse, moba with gating='token')")
