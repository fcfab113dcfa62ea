"""`ovq`: online vector-quantised attention (docs/ovq.md)."""

from .attention import OVQ, OVQAttention, OVQConfig, OVQLayer, row_phases

__all__ = ["OVQ", "OVQAttention", "OVQConfig", "OVQLayer", "row_phases"]
