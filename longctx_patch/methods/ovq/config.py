"""`ovq`'s config: chunks, dictionary size and growth, temperature, kernels (docs/ovq.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import MethodConfig, option


@dataclass
class OVQConfig(MethodConfig):
    chunk_size: int = option(512, "tokens per chunk: exact causal attention inside a chunk, dictionary update after it", min=1)
    max_centroids: int = option(1024, "maximum dictionary rows per key/value head (N)", min=1)
    growth: float = option(
        256.0,
        "Dirichlet-process-like growth: after T tokens the dictionary has min(N, T, ceil(growth*ln(1+T/growth))) "
        "rows; 0 = every token its own row until N",
        min=0.0,
    )
    beta: float = option(12.0, "initial inverse temperature of the unit-normalised q.k logits (qk_norm=true; "
                         "with qk_norm=false the temperature starts at the model's own 1/sqrt(head_dim)); at most "
                         "10000: the logits lie in [-beta, beta], attention is one-hot long before, and a half-precision "
                         "model's logits overflow at 65504", min=1e-3, max=1e4)
    learn_beta: bool = option(True, "learn the inverse temperature (one per query head) during fine-tuning")
    qk_norm: bool = option(False, "unit-normalise q and k as in the OVQ paper (needs a fine-tune); false keeps the "
                           "model's raw post-rotary q/k, so the patched model works before any training")
    backend: str = option("auto", "kernels: auto (Triton on CUDA), triton, or torch (reference)",
                          choices=("auto", "triton", "torch"))
    exact_assign: bool = option(False, "Triton dictionary assignment with exact float32 dot products "
                                "(false: bf16 tensor-core dots; near ties may resolve differently)")
    train_path: str = option("auto", "training forward: parallel (every chunk's dictionary at once, 8-12x faster on "
                             "an H200, ~3x the memory), loop (chunk by chunk), or auto (parallel on CUDA, loop on CPU); "
                             "both give the same result", choices=("auto", "parallel", "loop"))


__all__ = ["OVQConfig"]
