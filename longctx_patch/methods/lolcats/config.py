"""Options of `lolcats`: the LoLCATs hybrid's (`HybridConfig`), no sparse cache."""

from __future__ import annotations

from dataclasses import dataclass

from ..lola.config import HybridConfig


@dataclass
class LolcatsConfig(HybridConfig):
    """LoLCATs: hedgehog linear attention + sliding-window softmax under one normaliser (no sparse cache)."""
