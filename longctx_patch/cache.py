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

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .methods.cache_layer import LongctxLayer
from .methods.patch_access import patched_modules

__all__ = ["LongctxCache", "LongctxLayer"]


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
