"""`exact`: reference causal softmax attention (kernels/softmax/), the baseline every method is compared to; on a layer
the model itself windows, the same window."""

from ..base import Method, register_method
from .attention import ExactAttention
from .config import ExactConfig


@register_method
class Exact(Method):
    name = "exact"
    description = "exact causal softmax attention (reference path; full KV cache)"
    config_cls = ExactConfig
    module_cls = ExactAttention
    keeps_model_window = True  # ExactAttention.window


__all__ = ["Exact", "ExactAttention", "ExactConfig"]
