"""`muse`: multipole semantic attention (MuSe) for the prefill of Llama-family models.

The softmax kernel of each patched layer is replaced by MuSe (longctx_patch.kernels.muse) for prefill
without a past (q_len == k_len > block_size and >= min_seq_len); decode steps, continued prefill and
short sequences take exact softmax attention over a full KV cache, so `generate()` is exact after the
prompt; a prefill that fills a cache in eval mode recomputes its last `exact_tail` queries exactly. The
projections are the original ones: no new parameters. docs/muse.md explains every option.
"""

import warnings

from ..base import Method, register_method
from .attention import MuseAttention
from .config import FAR_FIELD_DEFAULTS, Q_CLUSTERS, MuseConfig


@register_method
class Muse(Method):
    name = "muse"
    description = ("multipole semantic attention for long prefills (clustered key summaries + exact retrieval of "
                   "blocks); exact decode")
    config_cls = MuseConfig
    module_cls = MuseAttention
    window_conflict = "approximates full causal attention (cluster summaries of every earlier block)"

    def after_patch(self, model, modules, config) -> None:
        dev = next((p.device for p in model.parameters()), None)
        if dev is not None and dev.type != "cuda" and config.backend != "torch":
            warnings.warn(
                "muse: the model is on the CPU, where MuSe runs its dense PyTorch reference, which is slower than "
                "exact attention (one SmolLM2 layer at 8k tokens: 6.4 s against 0.47 s on 2 cores). MuSe's speed "
                "comes from its Triton kernels on CUDA: move the model there (model.cuda(); CLI: --device cuda) for long "
                "prefills, or use the CPU for checks only. backend='torch' (CLI: --set backend=torch) silences this.", stacklevel=3)


__all__ = ["FAR_FIELD_DEFAULTS", "Muse", "MuseAttention", "MuseConfig", "Q_CLUSTERS"]
