"""The attention module of `lolcats`: the LoLCATs hybrid of methods/lola/attention.py without a sparse cache."""

from __future__ import annotations

from ..lola.attention import HybridAttention


class LolcatsAttention(HybridAttention):
    method_name = "lolcats"
