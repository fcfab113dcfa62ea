"""Options of the LoLCATs hybrid (`HybridConfig`, shared with `lolcats`) and of LoLA's sparse cache (`LolaConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..base import MethodConfig, option

LOLCATS_INIT_WINDOW_FACTOR = -2.1972245773362196  # sigmoid = 0.1, the value of the released LoLCATs recipes
DEFAULT_INIT_WINDOW_FACTOR = 2.0  # sigmoid = 0.88: an untrained patch stays much closer to the original (docs/lola.md)


@dataclass
class HybridConfig(MethodConfig):
    """The options of the LoLCATs hybrid, shared by `lolcats` and `lola`."""

    window: int = option(64, "tokens (the current one included) attended with exact softmax; older ones linearly",
                         min=1)
    feature_dim: int = option(64, "feature map width F per head (phi has 2F features; at most 1024: the feature maps "
                                  "hold head_dim x F weights per head, query and key, and the linear state 2F x head_dim "
                                  "per head, of every patched layer)", min=1, max=1024)
    checkpoint: Optional[str] = option("auto", "weights to load: auto (the packaged linearized weights when the model "
                                               "is one we ship them for, else fresh feature maps; lola then also "
                                               "takes the options the asset's measurements chose, e.g. window, "
                                               "sparse_cache and combine for Qwen2.5-Coder, where none is given), "
                                               "none (fresh), a "
                                               "LoLCATs model.pt (comma-separate several, e.g. distill,ft-lora), our "
                                               "longctx_patch.safetensors, or a linearize run's trainable/ folder")
    lora_alpha: float = option(16.0, "LoRA alpha of a LoLCATs checkpoint's q/k/v/o adapters (merged as alpha/r * B A; "
                               "at most 10000: past it the merged delta swamps the projection it is added to)",
                               min=0.0, max=1e4)
    feature_init: str = option("softmax-rf", "fresh feature maps: softmax-rf (random features of exp(q.k/sqrt(d))) "
                                             "or kaiming (the LoLCATs code's default)",
                               choices=("softmax-rf", "kaiming"))
    init_window_factor: float = option(DEFAULT_INIT_WINDOW_FACTOR, "initial window factor of fresh layers (g = sigmoid "
                                       "of it; LoLCATs' recipes start at -2.197, g = 0.1; at +-100 g is already 1 or 0 "
                                       "in float32)", min=-100.0, max=100.0)
    affine_factors: bool = option(False, "weight the linear term by 1 - g instead of 1 (LoLCATs affine_attention_factors)")
    linear_scale: float = option(1.0, "multiplies the linear term's weight (numerator and normaliser); below 1 the exact "
                                      "window and sparse pairs weigh more against the far past (docs/lola.md, "
                                      "'Weighing the linear term down'); 1 = as trained; at most 1e6: the linear "
                                      "term's float32 sums it multiplies overflow to NaN long before 1e300, and past "
                                      "1e6 the exact terms weigh nothing next to it anyway", min=0.0, max=1e6)
    combine: str = option("shifted", "how the exact (window and sparse) and linear terms meet under the one "
                                     "normaliser: shifted (LoLCATs, as its checkpoints and ours were trained: exact "
                                     "term exp(s - m) with m the query's max exact score, linear term as is) or "
                                     "unshifted (the LoLA authors' code: exact term exp(s), i.e. the linear term "
                                     "weighed down by exp(-m) per query; docs/lola.md, 'Against the authors' code')",
                          choices=("shifted", "unshifted"))
    chunk: int = option(64, "cache granularity: pairs leaving the window are folded every `chunk` tokens", min=1)
    feature_cache: bool = option(False, "keep phi(k) of the buffered keys older than the window in the cache (chunk "
                                        "rows of 2F per query head) instead of recomputing it every decode step; "
                                        "opt-in until its decode speed is measured on a GPU (docs/lola.md, "
                                        "'Feature cache')")
    seed: int = option(0, "seed of the fresh feature-map initialisation (layer i uses seed + i)", min=0)
    backend: str = option("auto", "kernels: auto (Triton on CUDA without grad), triton, or torch (reference)",
                          choices=("auto", "triton", "torch"))


@dataclass
class LolaConfig(HybridConfig):
    sparse_cache: int = option(256, "lambda: exact key/value pairs kept per sparse head, chosen by self-recall error",
                               min=0)
    sparse_heads: str = option("kv", "one sparse cache per kv head, shared by its query heads and scored by the sum "
                                     "of their errors (kv), or one per query head (query: Hq/Hkv times the memory)",
                               choices=("kv", "query"))
