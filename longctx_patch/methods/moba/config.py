"""`moba`'s config: blocks, top-k, gating, backend (docs/moba.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ...kernels.moba import BACKENDS, GATINGS
from ..base import MethodConfig, option


@dataclass
class MobaConfig(MethodConfig):
    block_size: int = option(512, "tokens per block (block boundaries at multiples of this in each row's real "
                             "positions); 512: the MoBA paper's block size with top_k 3", min=1)
    top_k: int = option(3, "blocks each query token attends, its own (causal) block included, as MoBA counts them: "
                        "the own block plus the top_k - 1 earlier blocks of highest q . mean key", min=1)
    min_seq_len: int = option(0, "query tokens at positions below this attend to every earlier key (exact); "
                              "positions below top_k * block_size are exact anyway", min=0)
    gating: str = option("block", "block: each block of block_size queries is gated by its mean query and all its "
                         "queries attend the same blocks (the Triton path); token: each query is gated by itself "
                         "(MoBA's reference rule, PyTorch only)", choices=list(GATINGS))
    backend: str = option("auto", "auto (Triton on CUDA where it runs: block gating over a whole sequence, "
                          "block_size a multiple of 128, head_dim <= 128; block gating's decode steps, head_dim a "
                          "power of two in 16..256; else PyTorch), torch, or triton", choices=list(BACKENDS))

    def check(self) -> None:
        if self.block_size < 1 or self.top_k < 1:
            raise ConfigError("MobaConfig: block_size and top_k must be >= 1")

    def kernel_kwargs(self) -> dict:
        return dict(block_size=self.block_size, top_k=self.top_k, min_seq_len=self.min_seq_len, gating=self.gating,
                    backend=self.backend)


__all__ = ["MobaConfig"]
