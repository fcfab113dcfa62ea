"""The sequence mixers of the synthetic suite, each a ``Mixer`` with q/k/v/o projections and ``H`` heads of
``d_model // H``:

============  ====================================================================================  =====================
name          what it computes                                                                        decode state / layer
============  ====================================================================================  =====================
softmax       exact causal softmax attention (``kernels.softmax.softmax_attention``; unit q/k, learned  ``L`` keys + values
              temperature as in vq/ovq; ``qknorm=false``: plain ``1/sqrt(D)``)
sliding       softmax over the last ``window`` tokens                                                 ``window`` k/v
linear        linear attention, ``phi = elu + 1``                                                     ``D x (D + 1)``
hedgehog      linear attention with the hedgehog map ``[softmax(xW), softmax(-xW)]``                  ``2F x (D + 1)``
vq            Transformer-VQ style: a learned, static codebook of ``codes`` keys; the current chunk is     ``codes x (D + 1)`` +
              exact, older keys are replaced by their nearest code (per-code value sums and counts)    chunk buffer
ovq           online VQ attention (``kernels.ovq.ovq_attention``): dictionaries learned in the forward   ``N x (2D + 1)`` +
              pass, exact chunk                                                                        chunk buffer
lolcats       LoLCATs hybrid: softmax window + hedgehog linear attention under one normaliser          window + ``2F x (D+1)``
lola          ``lolcats`` trained as such; evaluated with LoLA's sparse cache of ``sparse`` pairs      + ``sparse`` pairs
              chosen by self-recall error (LoLA is training-free)
============  ====================================================================================  =====================

Each mixer's options are a ``MixerConfig`` dataclass of ``option(...)`` fields (``registry``); ``state_bytes(length)``
counts one layer's decode state at batch 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ...methods.base import option
from .attention import causal_linear_attention, vq_attention
from .registry import MixerConfig, register_mixer

KV_BYTES = 2  # decode-time keys / values / features counted in bf16; accumulators and dictionaries in fp32
# initial inverse temperature of the unit-normalised q.k logits (softmax, sliding, vq, ovq). From scratch, 4 learned
# ICR much faster than 12 (the ovq method's default for patching pretrained models) for softmax and ovq alike:
# benchmarks/results/synthetic/cpu-ovq-ablation-icr-basic.json
BETA0 = 4.0


# ================================================================================================ options
# the options several mixers share, one field per use (a dataclass field belongs to one class)
def _beta():
    return option(BETA0, "initial inverse temperature (one per head, learned) of the unit-normalised q.k logits",
                  min=1e-3)


def _chunk(help: str = "tokens per chunk of the chunked computation"):
    return option(64, help, min=1)


def _window():
    return option(64, "tokens (the current one included) attended with exact softmax", min=1)


def _feature_dim():
    return option(32, "hedgehog feature map width F per head (phi has 2F features)", min=1)


def _backend():
    return option("auto", "kernels: auto (Triton on CUDA, else torch), torch, or triton",
                  choices=("auto", "torch", "triton"))


@dataclass
class SoftmaxMixerConfig(MixerConfig):
    qknorm: bool = option(True, "unit-normalised q and k with a learned inverse temperature (as vq and ovq); "
                          "false: q.k / sqrt(D)")
    beta: float = _beta()


@dataclass
class SlidingMixerConfig(MixerConfig):
    window: int = _window()
    qknorm: bool = option(True, "as softmax's qknorm")
    beta: float = _beta()


@dataclass
class LinearMixerConfig(MixerConfig):
    chunk: int = _chunk()


@dataclass
class HedgehogMixerConfig(MixerConfig):
    chunk: int = _chunk()
    feature_dim: int = _feature_dim()


@dataclass
class VQMixerConfig(MixerConfig):
    codes: int = option(256, "codebook entries (keys) per head", min=1)
    chunk: int = _chunk("tokens per chunk: exact attention inside it, codes for the older keys")
    beta: float = _beta()
    commit: float = option(0.25, "weight of the commitment loss (keys toward their codes)", min=0.0)


@dataclass
class OVQMixerConfig(MixerConfig):
    max_centroids: int = option(512, "maximum dictionary rows per head (N)", min=1)
    growth: float = option(256.0, "dictionary growth: after T tokens min(N, T, ceil(growth*ln(1+T/growth))) rows; "
                           "0 = every token its own row until N", min=0.0)
    chunk: int = _chunk("tokens per chunk: exact attention inside it, dictionary update after it")
    beta: float = _beta()
    backend: str = _backend()


@dataclass
class LolcatsMixerConfig(MixerConfig):
    window: int = _window()
    feature_dim: int = _feature_dim()
    chunk: int = _chunk()
    backend: str = _backend()


@dataclass
class LolaMixerConfig(MixerConfig):
    window: int = _window()
    feature_dim: int = _feature_dim()
    chunk: int = _chunk()
    sparse: int = option(64, "exact key/value pairs of LoLA's sparse cache per head (evaluation only)", min=0)
    backend: str = _backend()


# ================================================================================================ mixers
class Mixer(nn.Module):
    """Base: ``H`` heads, q/k/v/o projections; subclasses implement ``attend`` and ``state_bytes``."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[MixerConfig]] = MixerConfig

    def __init__(self, d_model: int, n_heads: int, config: MixerConfig | None = None):
        super().__init__()
        if d_model % n_heads:
            raise ConfigError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        if config is None:
            config = self.config_cls.from_dict({})
        if type(config) is not self.config_cls:
            raise TypeError(f"mixer {self.name!r} takes a {self.config_cls.__name__}, got {type(config).__name__}")
        self.H, self.D = n_heads, d_model // n_heads
        self.config = config
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.H, self.D).permute(2, 0, 3, 1, 4)  # [B, H, S, D] each
        o = self.attend(q, k, v)  # [B, S, H, D]
        return self.o(o.reshape(B, S, self.H * self.D).to(x.dtype))

    def attend(self, q, k, v):  # pragma: no cover - abstract
        raise NotImplementedError

    def state_bytes(self, length: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def backend(self, t: torch.Tensor) -> str:
        be = getattr(self.config, "backend", "auto")
        return "torch" if (be == "auto" and not t.is_cuda) else be


@register_mixer
class SoftmaxMixer(Mixer):
    """Exact softmax. ``qknorm`` (default on): unit-normalised q, k and a learned inverse temperature per head,
    as ``vq`` and ``ovq`` use, so that the comparison isolates what those compress; off: ``q.k / sqrt(D)``."""

    name = "softmax"
    config_cls = SoftmaxMixerConfig

    def __init__(self, d_model, n_heads, config=None):
        super().__init__(d_model, n_heads, config)
        if self.config.qknorm:
            self.log_beta = nn.Parameter(torch.full((self.H,), math.log(self.config.beta)))

    def _qk(self, q, k):
        if not self.config.qknorm:
            return q, k, self.D ** -0.5
        beta = self.log_beta.exp()[None, :, None, None]
        return (F.normalize(q.float(), dim=-1) * beta).to(q.dtype), F.normalize(k.float(), dim=-1).to(k.dtype), 1.0

    def window(self) -> int | None:
        return None

    def attend(self, q, k, v):
        from ...kernels.softmax import softmax_attention

        q, k, scale = self._qk(q, k)
        return softmax_attention(q, k, v, scale=scale, window=self.window())

    def state_bytes(self, length):
        return length * self.H * 2 * self.D * KV_BYTES


@register_mixer
class SlidingMixer(SoftmaxMixer):
    name = "sliding"
    config_cls = SlidingMixerConfig

    def window(self) -> int | None:
        return self.config.window

    def state_bytes(self, length):
        return min(length, self.config.window) * self.H * 2 * self.D * KV_BYTES


@register_mixer
class LinearMixer(Mixer):
    name = "linear"
    config_cls = LinearMixerConfig

    def features(self, q, k):
        return F.elu(q.float()) + 1, F.elu(k.float()) + 1

    def attend(self, q, k, v):
        fq, fk = self.features(q, k)
        return causal_linear_attention(fq, fk, v, chunk=self.config.chunk).transpose(1, 2)

    def feature_width(self) -> int:
        return self.D

    def state_bytes(self, length):
        return self.H * self.feature_width() * (self.D + 1) * 4


def _hedgehog_init(H: int, D: int, Fd: int) -> torch.Tensor:
    return torch.randn(H, D, Fd) / math.sqrt(D)


@register_mixer
class HedgehogMixer(LinearMixer):
    name = "hedgehog"
    config_cls = HedgehogMixerConfig

    def __init__(self, d_model, n_heads, config=None):
        super().__init__(d_model, n_heads, config)
        Fd = self.config.feature_dim
        self.wq = nn.Parameter(_hedgehog_init(self.H, self.D, Fd))
        self.wk = nn.Parameter(_hedgehog_init(self.H, self.D, Fd))

    def features(self, q, k):
        from ...kernels.lola import hedgehog_feature_map

        return hedgehog_feature_map(q, self.wq, out_dtype=torch.float32), hedgehog_feature_map(k, self.wk, out_dtype=torch.float32)

    def feature_width(self) -> int:
        return 2 * self.config.feature_dim


class _NormedMixin:
    """Unit-normalised q and k with a learned inverse temperature per head (as the ovq method does)."""

    def _init_beta(self, beta: float):
        self.log_beta = nn.Parameter(torch.full((self.H,), math.log(beta)))

    def _scaled(self, q, k):
        beta = self.log_beta.exp()[None, :, None, None]
        return F.normalize(q.float(), dim=-1) * beta, F.normalize(k.float(), dim=-1)


@register_mixer
class VQMixer(_NormedMixin, Mixer):
    name = "vq"
    config_cls = VQMixerConfig

    def __init__(self, d_model, n_heads, config=None):
        super().__init__(d_model, n_heads, config)
        self._init_beta(self.config.beta)
        self.codebook = nn.Parameter(torch.randn(self.H, self.config.codes, self.D))

    def attend(self, q, k, v):
        qs, ks = self._scaled(q, k)
        cb = F.normalize(self.codebook, dim=-1)
        o, assign = vq_attention(qs, ks, v, cb, chunk=self.config.chunk)
        B, H, S, D = ks.shape
        picked = torch.gather(cb[None].expand(B, -1, -1, -1), 2, assign[..., None].expand(B, H, S, D))
        # VQ-VAE losses: move the codes to the keys, and the keys toward their codes
        self.aux_loss = ((ks.detach() - picked) ** 2).sum(-1).mean() + self.config.commit * (
            (ks - picked.detach()) ** 2).sum(-1).mean()
        return o.transpose(1, 2)

    def state_bytes(self, length):
        K, C = self.config.codes, self.config.chunk
        return self.H * K * (self.D + 1) * 4 + min(length, C - 1) * self.H * 2 * self.D * KV_BYTES


@register_mixer
class OVQMixer(_NormedMixin, Mixer):
    name = "ovq"
    config_cls = OVQMixerConfig

    def __init__(self, d_model, n_heads, config=None):
        super().__init__(d_model, n_heads, config)
        self._init_beta(self.config.beta)

    def attend(self, q, k, v):
        from ...kernels.ovq import ovq_attention

        qs, ks = self._scaled(q, k)
        o, _, _, _ = ovq_attention(qs, ks, v.float(), None, None, None, chunk_size=self.config.chunk,
                                   max_centroids=self.config.max_centroids, growth=self.config.growth,
                                   backend=self.backend(q), exact_assign=False)  # as the ovq method: bf16 assignment dots
        return o.transpose(1, 2)

    def state_bytes(self, length):
        N, C = self.config.max_centroids, self.config.chunk
        from ...kernels.ovq import target_int

        rows = target_int(length, N, self.config.growth)
        return self.H * rows * (2 * self.D + 1) * 4 + min(length, C - 1) * self.H * 2 * self.D * KV_BYTES


@register_mixer
class LolcatsMixer(Mixer):
    name = "lolcats"
    config_cls = LolcatsMixerConfig

    def __init__(self, d_model, n_heads, config=None):
        super().__init__(d_model, n_heads, config)
        Fd = self.config.feature_dim
        self.wq = nn.Parameter(_hedgehog_init(self.H, self.D, Fd))
        self.wk = nn.Parameter(_hedgehog_init(self.H, self.D, Fd))
        self.window_factor = nn.Parameter(torch.zeros(self.H))

    def _phi(self, x, w):
        from ...kernels.lola import hedgehog_feature_map

        return hedgehog_feature_map(x, w, out_dtype=x.dtype)

    def _factors(self):
        g = torch.sigmoid(self.window_factor.float())
        return g, torch.ones_like(g)

    def attend(self, q, k, v):
        from ...kernels.lola import HybridSpec, hybrid_attention

        fq, fk = self._phi(q, self.wq), self._phi(k, self.wk)
        g, lf = self._factors()
        spec = HybridSpec(window=self.config.window, scale=self.D ** -0.5, chunk=self.config.chunk,
                          backend=self.backend(q))
        return hybrid_attention(q, k, v, fq, fk, g, lf, spec)

    def state_bytes(self, length):
        W, C, F2 = self.config.window, self.config.chunk, 2 * self.config.feature_dim
        buf = min(length, W + C - 1)
        return buf * self.H * 2 * self.D * KV_BYTES + self.H * F2 * (self.D + 1) * 4 + self._sparse_bytes()

    def _sparse_bytes(self) -> int:
        return 0


@register_mixer
class LolaMixer(LolcatsMixer):
    name = "lola"
    config_cls = LolaMixerConfig

    def attend(self, q, k, v):
        """Training forwards (gradients on) are the LoLCATs hybrid: LoLA is training-free, its cache manager
        runs on a LoLCATs model at inference. Evaluation forwards run the LoLA manager (sparse cache)."""
        from ...kernels.lola import LolaRun, LolaState, StateSizes, lola_process

        if torch.is_grad_enabled():
            return super().attend(q, k, v)
        fq = self._phi(q, self.wq)
        g, lf = self._factors()
        B, H, S, D = q.shape
        lam = self.config.sparse
        st = LolaState.empty(StateSizes(B, H, H, D, fq.shape[-1], lam), q.dtype, q.device)
        run = LolaRun(phi_k=lambda x: self._phi(x, self.wk), window=self.config.window, chunk=self.config.chunk,
                      lam=lam, scale=D ** -0.5, backend=self.backend(q))
        return lola_process(st, q, k, v, fq, g, lf, run)

    def _sparse_bytes(self) -> int:
        return self.config.sparse * self.H * (2 * self.D * KV_BYTES + 4)




__all__ = ["Mixer", "KV_BYTES", "BETA0", "SoftmaxMixer", "SlidingMixer", "LinearMixer", "HedgehogMixer", "VQMixer",
           "OVQMixer", "LolcatsMixer", "LolaMixer", "SoftmaxMixerConfig", "SlidingMixerConfig", "LinearMixerConfig",
           "HedgehogMixerConfig", "VQMixerConfig", "OVQMixerConfig", "LolcatsMixerConfig", "LolaMixerConfig"]
