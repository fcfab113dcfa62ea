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

from ..base import Method, register_method
from .attention import HybridAttention, LolaAttention
from .cache import LolaLayer
from .config import HybridConfig, LolaConfig
from .weights import asset_defaults, export_lolcats_checkpoint, load_lolcats_checkpoint, load_method_weights


@register_method
class Lola(Method):
    name = "lola"
    description = ("LoLA: LoLCATs hybrid + a sparse cache of lambda exact pairs chosen by self-recall error "
                   "(training-free; loads LoLCATs checkpoints)")
    config_cls = LolaConfig
    module_cls = LolaAttention
    window_conflict = "attends linearly (and through its sparse cache) to every token older than its own window"
    bounded_state = True
    state_options = ("window", "chunk", "sparse_cache", "feature_dim")

    def model_defaults(self, model, values) -> dict:
        """The asset's measured lola options (window, sparse cache, combination) for the model it was trained for,
        where the caller set none: `patch(qwen, "lola")` runs what the asset's measurements chose."""
        return asset_defaults(model, self.name, self.parse_config(values), values)

    def after_patch(self, model, modules, config) -> None:
        source = load_method_weights(model, modules, config)
        chosen = asset_defaults(model, self.name, config, {})
        if chosen:
            opts = ", ".join(f"{k}={v}" for k, v in chosen.items())
            for m in modules.values():
                m.weights_source = f"{source}; its measured lola defaults {opts} (options passed take precedence)"


__all__ = ["HybridAttention", "HybridConfig", "LolaAttention", "LolaConfig", "LolaLayer", "export_lolcats_checkpoint",
           "load_lolcats_checkpoint", "load_method_weights"]
