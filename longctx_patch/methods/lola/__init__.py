"""`lola`: LoLCATs hybrid + a sparse cache of exact key/value pairs chosen by self-recall error (LoLA).

Training-free on top of a `lolcats` model: same parameters (feature maps, window factors; load them with
`checkpoint=PATH`), plus `sparse_cache` (lambda) exact pairs per kv head (`sparse_heads=kv`, the default) or
per query head. Pairs leaving the window and pairs already in the sparse cache are scored by
SRE(k, v) = ||phi(k)^T H / (phi(k)^T s) - v||^2 against the current linear state every `chunk` tokens (summed
over the query heads sharing a kv head); the lambda highest stay exact, the rest are folded into (H, s).
`sparse_cache = 0` is `lolcats` exactly. Details: docs/lola.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError, NotPatchedError
from ..base import Method, option, register_method
from ..lolcats import LolcatsAttention, LolcatsConfig, load_method_weights


@dataclass
class LolaConfig(LolcatsConfig):
    sparse_cache: int = option(256, "lambda: exact key/value pairs kept per sparse head, chosen by self-recall error",
                               min=0)
    sparse_heads: str = option("kv", "one sparse cache per kv head, shared by its query heads and scored by the sum "
                                     "of their errors (kv), or one per query head (query: Hq/Hkv times the memory)",
                               choices=("kv", "query"))


class LolaAttention(LolcatsAttention):
    method_name = "lola"

    @property
    def sparse_cache(self) -> int:
        return self.method_config.sparse_cache

    @property
    def sparse_heads(self) -> str:
        return self.method_config.sparse_heads


@register_method
class Lola(Method):
    name = "lola"
    description = ("LoLA: LoLCATs hybrid + a sparse cache of lambda exact pairs chosen by self-recall error "
                   "(training-free; loads LoLCATs checkpoints)")
    config_cls = LolaConfig
    module_cls = LolaAttention
    window_conflict = "attends linearly (and through its sparse cache) to every token older than its own window"

    def after_patch(self, model, modules, config) -> None:
        load_method_weights(model, modules, config)


def convert_to_lola(model, sparse_cache: int = 256, **overrides):
    """Turn a model patched with `lolcats` into a `lola` model in place, keeping its feature maps and
    window factors (and any merged LoRA weights). `overrides`: other lola keys (window, chunk, backend ...).

    Equivalent to saving the lolcats parameters, `unpatch()`, `patch(model, "lola", ...)` on the same layers
    with the same config, and loading the parameters back. Returns the model.
    """
    from ...patcher import _state, load_method_state_dict, method_state_dict, patch, unpatch

    try:
        st = _state(model)
    except NotPatchedError:
        raise NotPatchedError("convert_to_lola needs a model patched with lolcats; call "
                              "longctx_patch.patch(model, 'lolcats', ...) first") from None
    methods = sorted({g.method for g in st.groups})
    if methods != ["lolcats"]:
        raise ConfigError(f"convert_to_lola converts models patched only with lolcats; this one has {methods}. "
                          "Unpatch and patch the layers with lola directly instead")
    groups = [(g.layers, g.config.to_dict()) for g in st.groups]
    sd = {k: v.clone() for k, v in method_state_dict(model).items()}
    # weights a checkpoint merged LoRA deltas into stay merged; unpatch() of the lola model restores them
    saved = dict(st.saved_weights)
    st.saved_weights.clear()
    unpatch(model)
    for layers, cfg in groups:
        cfg = {**cfg, "checkpoint": None, "sparse_cache": sparse_cache, **overrides}
        patch(model, "lola", layers=layers, **cfg)
    _state(model).saved_weights.update(saved)
    load_method_state_dict(model, sd, source="the lolcats parameters")
    return model


__all__ = ["LolaAttention", "LolaConfig", "convert_to_lola"]
