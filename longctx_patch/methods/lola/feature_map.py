"""The hedgehog feature map phi(x) = [softmax(x W), softmax(-x W)] per head (LoLCATs), as a module whose state-dict
keys are LoLCATs' (`mlp.layer`), and the initialisation of fresh maps."""

from __future__ import annotations

import math

import torch
from torch import nn

from ...kernels.lola.ops import feature_map
from ...kernels.lola.tuning import DEFAULT_TUNING, LolaTuning


class FeatureMapMLP(nn.Module):
    """Holds `layer` [heads, head_dim, feature_dim] (the LoLCATs `untied_head_einsum` parameter)."""

    def __init__(self, layer: torch.Tensor):
        super().__init__()
        self.layer = nn.Parameter(layer)


class HedgehogFeatureMap(nn.Module):
    """phi(x) = [softmax(x W), softmax(-x W)] per head; state-dict key `mlp.layer` as in LoLCATs."""

    def __init__(self, layer: torch.Tensor, eps: float = 1e-12):
        super().__init__()
        self.mlp = FeatureMapMLP(layer)
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype=None, backend: str = "auto", out=None,
                tuning: LolaTuning = DEFAULT_TUNING) -> torch.Tensor:
        return feature_map(x, self.mlp.layer, eps=self.eps, out_dtype=out_dtype, backend=backend, out=out,
                           tuning=tuning)


def init_feature_weight(heads: int, head_dim: int, feature_dim: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """softmax-rf: columns are orthogonal Gaussian directions (norms of chi(head_dim) samples) times
    head_dim**-1/4, so that E[exp(q.w) exp(k.w)] = exp(q.k / sqrt(d)) (times per-token factors): phi(q).phi(k)
    starts as a positive random-feature estimate of the softmax kernel. kaiming: LoLCATs' init."""
    if kind == "kaiming":
        w = torch.empty(heads, head_dim, feature_dim)
        bound = math.sqrt(6.0 / (head_dim * feature_dim))  # kaiming_uniform_(a=0) on a 3-D tensor: fan_in = D * F
        return w.uniform_(-bound, bound, generator=generator)
    # the random draws in the order of a per-head loop (blocks of D directions, then the norms), and one batched
    # QR over all blocks: hundreds of tiny QR calls cost tens of seconds on a busy 2-core CPU
    blocks = -(-feature_dim // head_dim)
    gauss, norms = [], []
    for _ in range(heads):
        gauss += [torch.randn(head_dim, head_dim, generator=generator) for _ in range(blocks)]
        norms.append(torch.randn(head_dim, feature_dim, generator=generator).norm(dim=0))  # chi(D)
    qm, _ = torch.linalg.qr(torch.stack(gauss))  # [heads * blocks, D, D]
    dirs = qm.reshape(heads, blocks, head_dim, head_dim).transpose(1, 2).reshape(heads, head_dim, blocks * head_dim)
    # contiguous: the QR's column-major output would make every feature-map call copy the weight first
    return (dirs[:, :, :feature_dim] * torch.stack(norms)[:, None, :] * head_dim ** -0.25).contiguous()
