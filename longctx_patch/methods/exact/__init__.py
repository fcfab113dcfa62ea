"""`exact`: reference causal softmax attention (kernels/softmax/), the baseline every method is compared to; on a layer
the model itself windows, the same window."""

from ..base import Approximation, Method, register_method
from .attention import ExactAttention
from .config import ExactConfig


@register_method
class Exact(Method):
    name = "exact"
    description = "exact causal softmax attention (reference path; full KV cache)"
    config_cls = ExactConfig
    module_cls = ExactAttention
    keeps_model_window = True  # ExactAttention.window
    exact_reference = True  # the baseline of the evaluations and of the fine-tune plan's unpatched model

    def approximation_start(self, config, device_type="cpu", head_dim=64) -> Approximation:
        return Approximation(None, None, "exact attention")

    def attention_profile(self, config, head_dim, seq_len, kernels) -> tuple[float, float]:
        return seq_len / 2, 4 * head_dim  # SDPA (flash on the CPU too): output and row statistics only


__all__ = ["Exact", "ExactAttention", "ExactConfig"]
