"""`lolcats`: hedgehog linear attention + sliding-window softmax under one normaliser (LoLCATs).

Each patched layer keeps the original q/k/v/o projections and adds per-head feature maps
phi(x) = [softmax(x W), softmax(-x W)] for queries and keys and `window_factors` (g = sigmoid). Queries attend
exactly (softmax, weight g) to the last `window` tokens and linearly to everything older, with one shared
normaliser. Released LoLCATs checkpoints load with `checkpoint=PATH`. It is `lola` without a sparse cache: the module,
its cache layer and the weights' readers live in methods/lola. Maths, initialisation and cache layout: docs/lola.md.
"""

from __future__ import annotations

from ..base import Approximation, Method, register_method
from ..lola import hybrid_approximation, hybrid_attention_profile
from ..lola.weights import load_method_weights
from .attention import LolcatsAttention
from .config import LolcatsConfig


@register_method
class Lolcats(Method):
    name = "lolcats"
    description = ("LoLCATs: hedgehog linear attention + sliding-window softmax, one normaliser; trainable feature "
                   "maps; loads released LoLCATs checkpoints (checkpoint=PATH)")
    config_cls = LolcatsConfig
    module_cls = LolcatsAttention
    window_conflict = "attends linearly to every token older than its own window"
    bounded_state = True
    lolcats_layout = True
    state_options = ("window", "chunk", "feature_dim")

    def after_patch(self, model, modules, config) -> None:
        load_method_weights(model, modules, config)

    def approximation_start(self, config, device_type="cpu", head_dim=64) -> Approximation:
        return hybrid_approximation(config)

    def attention_profile(self, config, head_dim, seq_len, kernels) -> tuple[float, float]:
        return hybrid_attention_profile(config, head_dim, seq_len, kernels)


__all__ = ["LolcatsAttention", "LolcatsConfig"]
