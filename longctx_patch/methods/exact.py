"""`exact`: reference causal softmax attention (kernels/softmax.py), the baseline every method is compared to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_layer import LongctxLayer
from ..kernels.softmax import key_mask_for, softmax_attention
from .base import Method, MethodConfig, PatchedAttention, register_method


@dataclass
class ExactConfig(MethodConfig):
    """No options: exact softmax attention."""


class RollingKVLayer(LongctxLayer):
    """Holds the K/V of the last `keep` tokens (`[B, Hkv, <=keep, D]`): the cache of a windowed layer."""

    state_names = ("keys", "values")

    def __init__(self, keep: int):
        super().__init__()
        self.keep = keep

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns past + new keys and values (the new ones last), then keeps the last `keep` of them."""
        if not self.is_initialized:
            self.lazy_initialization(k, v)
            self.keys, self.values = k[:, :, :0], v[:, :, :0]
        k_all = torch.cat([self.keys, k], dim=2)
        v_all = torch.cat([self.values, v], dim=2)
        start = max(0, k_all.shape[2] - self.keep)
        self.keys, self.values = k_all[:, :, start:], v_all[:, :, start:]
        self.seen += k.shape[2]
        return k_all, v_all


class ExactAttention(PatchedAttention):
    """Exact causal softmax attention; on a layer the original model windows (`spec.sliding_window`), the same
    window, with a rolling cache of `window - 1` tokens as transformers' own for such a layer."""

    method_name = "exact"

    @property
    def window(self) -> int | None:
        """Keys per query, its own included (None: all earlier keys)."""
        return self.spec.sliding_window

    @classmethod
    def op(cls, q, k, v, *, scale, config):
        """Op-level entry point (used by `longctx eval speed --op`): causal attention over one full sequence,
        q `[B, Hq, S, D]`, k/v `[B, Hkv, S, D]`, no cache or padding; returns `[B, S, Hq, D]`."""
        return softmax_attention(q, k, v, scale=scale)

    def attend(self, q, k, v, cache_layer, padding):
        if isinstance(cache_layer, RollingKVLayer):
            k, v = cache_layer.append(k, v)
        elif cache_layer is not None:
            k, v = cache_layer.update(k, v)
        # the queries are the last keys: a rolling cache returns the kept past and the new tokens
        return softmax_attention(q, k, v, scale=self.scaling, key_mask=key_mask_for(padding, k.shape[2]),
                                 window=self.window)

    def make_cache_layer(self):
        w = self.window
        return super().make_cache_layer() if w is None else RollingKVLayer(keep=w - 1)

    def state_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        w = self.window
        return super().state_bytes(context_len if w is None else min(context_len, w - 1), batch, dtype)


@register_method
class Exact(Method):
    name = "exact"
    description = "exact causal softmax attention (reference path; full KV cache)"
    config_cls = ExactConfig
    module_cls = ExactAttention
    keeps_model_window = True  # ExactAttention.window
