"""`exact`: reference causal softmax attention (kernels/softmax/), the baseline every method is compared to."""

from .attention import Exact, ExactAttention, ExactConfig

__all__ = ["Exact", "ExactAttention", "ExactConfig"]
