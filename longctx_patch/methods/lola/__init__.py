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


__all__ = ["LolaAttention", "LolaConfig"]
