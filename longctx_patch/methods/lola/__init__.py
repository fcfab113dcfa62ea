"""`lola`: LoLCATs hybrid + a sparse cache of exact key/value pairs chosen by self-recall error (LoLA).

Training-free on top of a `lolcats` model: same parameters (feature maps, window factors; load them with
`checkpoint=PATH`), plus `sparse_cache` (lambda) exact pairs per kv head (`sparse_heads=kv`, the default) or
per query head. Pairs leaving the window and pairs already in the sparse cache are scored by
SRE(k, v) = ||phi(k)^T H / (phi(k)^T s + 1e-6) - v|| against the current linear state every `chunk` tokens (summed
over the query heads sharing a kv head); the lambda highest stay exact, the rest are folded into (H, s).
`sparse_cache = 0` is `lolcats` exactly. This folder holds the hybrid for both methods: config.py (the options),
attention.py (the module), cache.py (`LolaLayer`, the decode state), feature_map.py (phi), weights.py (LoLCATs
checkpoints and the packaged weights). Details: docs/lola.md.
"""

from __future__ import annotations

import math

from ..base import Approximation, Method, register_method
from .attention import HybridAttention, LolaAttention
from .cache import LolaLayer
from .config import HybridConfig, LolaConfig
from .weights import asset_defaults, export_lolcats_checkpoint, load_lolcats_checkpoint, load_method_weights


KERNEL_KEY_TILE = 64  # keys per tile of the training pass's kernels (ops.HybridAttentionFn: tuning.train_block_n or 64)


def hybrid_approximation(config) -> Approximation:
    """`Method.approximation_start` of lolcats and lola: the window is exact, the older keys linear."""
    w = int(config.window)
    return Approximation(w + 1, w, f"keys more than window={w} tokens back are attended through the linear part")


def hybrid_attention_profile(config, head_dim: int, seq_len: int, kernels: bool) -> tuple[float, float]:
    """`Method.attention_profile` of lolcats and lola (train/plan.py): the Triton training pass holds the window, a
    key tile and the features; the chunked reference the scores, masks and weights of (P + 1) key blocks per query
    block, local copies of the keys, values and key features, each block's prefix state (calibrated on SmolLM2 on the
    CPU: ~110 KB per token and layer kept without attention_checkpointing)."""
    D = head_dim
    window, chunk = int(config.window), int(config.chunk)
    f2 = 2 * int(config.feature_dim)
    if kernels:
        return window + KERNEL_KEY_TILE + f2, 2 * D + 2 * f2
    blocks = math.ceil(window / chunk) + 1
    return 2 * blocks * chunk + f2, 8 * blocks * chunk + 2 * blocks * (2 * D + f2) + 3 * f2 * D / chunk + 2 * f2


@register_method
class Lola(Method):
    name = "lola"
    description = ("LoLA: LoLCATs hybrid + a sparse cache of lambda exact pairs chosen by self-recall error "
                   "(training-free; loads LoLCATs checkpoints)")
    config_cls = LolaConfig
    module_cls = LolaAttention
    window_conflict = "attends linearly (and through its sparse cache) to every token older than its own window"
    bounded_state = True
    lolcats_layout = True
    converts_from = ("lolcats",)  # the same feature maps and window factors (convert.convert_to_lola)
    state_options = ("window", "chunk", "sparse_cache", "feature_dim")

    def model_defaults(self, model, config, given) -> dict:
        """The asset's measured lola options (window, sparse cache, combination) for the model it was trained for,
        where the caller set none: `patch(qwen, "lola")` runs what the asset's measurements chose."""
        return asset_defaults(model, self.name, config, given)

    def after_patch(self, model, modules, config) -> None:
        load_method_weights(model, modules, config, method=self.name)

    def approximation_start(self, config, device_type="cpu", head_dim=64) -> Approximation:
        return hybrid_approximation(config)

    def attention_profile(self, config, head_dim, seq_len, kernels) -> tuple[float, float]:
        return hybrid_attention_profile(config, head_dim, seq_len, kernels)


__all__ = ["KERNEL_KEY_TILE", "HybridAttention", "HybridConfig", "LolaAttention", "LolaConfig", "LolaLayer",
           "export_lolcats_checkpoint", "hybrid_approximation", "hybrid_attention_profile", "load_lolcats_checkpoint",
           "load_method_weights"]
