"""The from-scratch model of the synthetic suite (``SyntheticLM``): token embedding (plus a linear map of
continuous features for ICL), ``n_layers`` blocks of ``x += conv(norm x)`` (depthwise causal convolution of
width 4, the short convolution Zoology uses; it gives every mixer the same local token mixing),
``x += mixer(norm x)``, ``x += mlp(norm x)``, and a linear head. No positional embedding: order comes from
causality and the convolution."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import ConfigError
from .registry import MixerSpec


# ================================================================================================ model
class CausalConv(nn.Module):
    """Depthwise causal convolution over the sequence (``[B, S, C]`` -> same)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1)

    def forward(self, x):
        S = x.shape[1]
        return self.conv(x.transpose(1, 2))[..., :S].transpose(1, 2)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, spec: MixerSpec, mlp_ratio: int, conv: int):
        super().__init__()
        self.conv = CausalConv(d_model, conv) if conv > 0 else None
        self.n0 = nn.LayerNorm(d_model) if conv > 0 else None
        self.n1 = nn.LayerNorm(d_model)
        self.mixer = spec.build(d_model, n_heads)
        self.n2 = nn.LayerNorm(d_model) if mlp_ratio > 0 else None
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model)) if mlp_ratio > 0 else None

    def forward(self, x):
        if self.conv is not None:
            x = x + self.conv(self.n0(x))
        x = x + self.mixer(self.n1(x))
        if self.mlp is not None:
            x = x + self.mlp(self.n2(x))
        return x


@dataclass
class ModelConfig:
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 2
    mlp_ratio: int = 2
    conv: int = 4

    def validate(self) -> "ModelConfig":
        if self.d_model < 1 or self.n_layers < 1 or self.n_heads < 1:
            raise ConfigError(f"model sizes must be >= 1: {self}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.mlp_ratio < 0 or self.conv < 0:
            raise ConfigError(f"mlp_ratio and conv must be >= 0: {self}")
        return self


class SyntheticLM(nn.Module):
    """Token embedding (+ linear map of ``feats``) -> blocks -> norm -> linear head ``[B, S, out_dim]``."""

    def __init__(self, vocab_size: int, feat_dim: int, out_dim: int, spec: MixerSpec, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        d = cfg.d_model
        self.embed = nn.Embedding(vocab_size, d)
        self.feat = nn.Linear(feat_dim, d) if feat_dim else None
        self.blocks = nn.ModuleList(Block(d, cfg.n_heads, spec, cfg.mlp_ratio, cfg.conv) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, out_dim)

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        if self.feat is not None:
            x = x + self.feat(feats.to(x.dtype))
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))

    def aux_loss(self) -> torch.Tensor | None:
        parts = [b.mixer.aux_loss for b in self.blocks if b.mixer.aux_loss is not None]
        return sum(parts) if parts else None

    def state_bytes(self, length: int) -> int:
        return sum(b.mixer.state_bytes(length) for b in self.blocks)


__all__ = ["SyntheticLM", "ModelConfig", "Block", "CausalConv"]
