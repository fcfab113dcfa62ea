"""`muse`: multipole semantic attention (MuSe) for the prefill of Llama-family models (docs/muse.md)."""

from .attention import FAR_FIELD_DEFAULTS, Q_CLUSTERS, Muse, MuseAttention, MuseConfig

__all__ = ["FAR_FIELD_DEFAULTS", "Q_CLUSTERS", "Muse", "MuseAttention", "MuseConfig"]
