"""`moba`: Mixture of Block Attention, the block-sparse baseline MuSe is compared with (docs/moba.md)."""

from .attention import Moba, MobaAttention, MobaConfig, MobaLayer

__all__ = ["Moba", "MobaAttention", "MobaConfig", "MobaLayer"]
