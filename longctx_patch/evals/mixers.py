"""A small from-scratch sequence model with pluggable sequence mixers, and the trainer of the synthetic tasks.

Mixers (``MIXERS``; each a ``Mixer`` with q/k/v/o projections and ``H`` heads of ``d_model // H``):

============  ====================================================================================  =====================
name          what it computes                                                                        decode state / layer
============  ====================================================================================  =====================
softmax       exact causal softmax attention (``methods.exact.softmax_attention``; unit q/k, learned    ``L`` keys + values
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

A mixer is chosen by a spec string ``NAME`` or ``NAME:key=value,key=value`` (e.g. ``ovq:max_centroids=128``).

The model (``SyntheticLM``): token embedding (plus a linear map of continuous features for ICL), ``n_layers``
blocks of ``x += conv(norm x)`` (depthwise causal convolution of width 4, the short convolution Zoology
uses; it gives every mixer the same local token mixing), ``x += mixer(norm x)``, ``x += mlp(norm x)``, and a
linear head. No positional embedding: order comes from causality and the convolution.

``run_sweep`` trains every mixer with the same budget (steps, learning rates, seeds, tokens per step) on a
task of :mod:`.icr` / :mod:`.icl`, evaluates at every length and reports state bytes; ``write_report``
writes the JSON, the tables and the plots.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

KV_BYTES = 2  # decode-time keys / values / features counted in bf16; accumulators and dictionaries in fp32
# initial inverse temperature of the unit-normalised q.k logits (softmax, sliding, vq, ovq). From scratch, 4 learned
# ICR much faster than 12 (the ovq method's default for patching pretrained models) for softmax and ovq alike:
# evals/results/synthetic-cpu-ovq-ablation.json
BETA0 = 4.0


# ================================================================================================ references
def causal_linear_attention(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, *, chunk: int = 64,
                            eps: float = 1e-6) -> torch.Tensor:
    """Normalised causal linear attention, chunked: ``o_i = sum_{j<=i} (fq_i . fk_j) v_j / sum_{j<=i} fq_i . fk_j``.

    ``fq``, ``fk``: ``[B, H, S, F]`` (non-negative features), ``v``: ``[B, H, S, D]``. Returns ``[B, H, S, D]``
    float32. Inside a chunk the quadratic form, across chunks the running state ``sum fk v^T`` (exclusive
    prefix sums over chunks).
    """
    B, H, S, Fd = fq.shape
    D = v.shape[-1]
    C = max(1, min(chunk, S))
    n = -(-S // C)
    pad = n * C - S
    fq, fk, v = fq.float(), fk.float(), v.float()
    if pad:
        fq = F.pad(fq, (0, 0, 0, pad))
        fk = F.pad(fk, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
    qc, kc, vc = fq.view(B, H, n, C, Fd), fk.view(B, H, n, C, Fd), v.view(B, H, n, C, D)
    kv = kc.transpose(-1, -2) @ vc                       # [B, H, n, F, D]
    ks = kc.sum(3)                                       # [B, H, n, F]
    kv_prev = kv.cumsum(2) - kv
    ks_prev = ks.cumsum(2) - ks
    num = qc @ kv_prev
    den = (qc * ks_prev[:, :, :, None, :]).sum(-1, keepdim=True)
    a = (qc @ kc.transpose(-1, -2)).tril()               # [B, H, n, C, C]
    num = num + a @ vc
    den = den + a.sum(-1, keepdim=True)
    o = num / (den + eps)
    return o.reshape(B, H, n * C, D)[:, :, :S]


def linear_attention_ref(fq, fk, v, eps: float = 1e-6) -> torch.Tensor:
    """Quadratic reference of :func:`causal_linear_attention` (``[B, H, S, D]`` float32)."""
    a = (fq.float() @ fk.float().transpose(-1, -2)).tril()
    return (a @ v.float()) / (a.sum(-1, keepdim=True) + eps)


def vq_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, codebook: torch.Tensor, *,
                 chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformer-VQ style attention with a static codebook, chunked.

    ``q`` ``[B, H, S, D]`` (scaled), ``k`` ``[B, H, S, D]``, ``v`` ``[B, H, S, Dv]``, ``codebook`` ``[H, K, D]``.
    A query of chunk ``c`` attends with one softmax to the keys of its own chunk (exact, causal) and to every
    key of the chunks before ``c`` *replaced by its code* ``codebook[argmax_j k . codebook_j]``. Grouped by code,
    the older keys are ``K`` super-keys with logit ``q . code + log(count)`` and value ``mean of their values``:
    the decode state is the per-code counts and value sums. Returns ``(o [B, H, S, Dv] float32, assign [B, H, S])``.
    """
    B, H, S, D = q.shape
    Dv = v.shape[-1]
    K = codebook.shape[1]
    C = max(1, min(chunk, S))
    n = -(-S // C)
    pad = n * C - S
    q, k, v, cb = q.float(), k.float(), v.float(), codebook.float()
    assign = (k @ cb.transpose(-1, -2)[None]).argmax(-1)                 # [B, H, S]
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        assign_p = F.pad(assign, (0, pad))
    else:
        assign_p = assign
    onehot = F.one_hot(assign_p, K).float()
    if pad:
        onehot[:, :, S:] = 0.0
    oh = onehot.view(B, H, n, C, K)
    vc = v.view(B, H, n, C, Dv)
    cnt = oh.sum(3)                                                        # [B, H, n, K]
    vs = oh.transpose(-1, -2) @ vc                                         # [B, H, n, K, Dv]
    cnt_prev = cnt.cumsum(2) - cnt
    vs_prev = vs.cumsum(2) - vs
    qc, kc = q.view(B, H, n, C, D), k.view(B, H, n, C, D)
    s_code = qc @ cb[None, :, None].transpose(-1, -2)                     # [B, H, n, C, K]
    logc = torch.where(cnt_prev > 0, cnt_prev.clamp_min(1e-30).log(), torch.full_like(cnt_prev, float("-inf")))
    s_code = s_code + logc[:, :, :, None, :]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    s_loc = (qc @ kc.transpose(-1, -2)).masked_fill(~causal, float("-inf"))
    p = torch.softmax(torch.cat([s_code, s_loc], -1), -1)
    vmean = vs_prev / cnt_prev.clamp_min(1.0)[..., None]
    o = p[..., :K] @ vmean + p[..., K:] @ vc
    return o.reshape(B, H, n * C, Dv)[:, :, :S], assign


def vq_attention_ref(q, k, v, codebook, *, chunk: int) -> torch.Tensor:
    """Quadratic reference of :func:`vq_attention`: one masked softmax over per-token keys."""
    B, H, S, D = q.shape
    q, k, v, cb = q.float(), k.float(), v.float(), codebook.float()
    assign = (k @ cb.transpose(-1, -2)[None]).argmax(-1)
    kq = torch.gather(cb[None].expand(B, -1, -1, -1), 2, assign[..., None].expand(B, H, S, D))
    pos = torch.arange(S, device=q.device)
    same = (pos[:, None] // chunk) == (pos[None, :] // chunk)
    causal = pos[None, :] <= pos[:, None]
    s = torch.where(same, q @ k.transpose(-1, -2), q @ kq.transpose(-1, -2))
    s = s.masked_fill(~causal, float("-inf"))
    return torch.softmax(s, -1) @ v


# ================================================================================================ mixers
class Mixer(nn.Module):
    """Base: ``H`` heads, q/k/v/o projections; subclasses implement ``attend`` and ``state_bytes``."""

    name = ""
    defaults: dict[str, Any] = {}

    def __init__(self, d_model: int, n_heads: int, **opts):
        super().__init__()
        if d_model % n_heads:
            raise ConfigError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.H, self.D = n_heads, d_model // n_heads
        self.opts = {**self.defaults, **opts}
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
        be = self.opts.get("backend", "auto")
        return "torch" if (be == "auto" and not t.is_cuda) else be


class SoftmaxMixer(Mixer):
    """Exact softmax. ``qknorm`` (default on): unit-normalised q, k and a learned inverse temperature per head,
    as ``vq`` and ``ovq`` use, so that the comparison isolates what those compress; off: ``q.k / sqrt(D)``."""

    name = "softmax"
    defaults = {"qknorm": True, "beta": BETA0}

    def __init__(self, d_model, n_heads, **opts):
        super().__init__(d_model, n_heads, **opts)
        if self.opts["qknorm"]:
            self.log_beta = nn.Parameter(torch.full((self.H,), math.log(float(self.opts["beta"]))))

    def _qk(self, q, k):
        if not self.opts["qknorm"]:
            return q, k, self.D ** -0.5
        beta = self.log_beta.exp()[None, :, None, None]
        return (F.normalize(q.float(), dim=-1) * beta).to(q.dtype), F.normalize(k.float(), dim=-1).to(k.dtype), 1.0

    def window(self) -> int | None:
        return None

    def attend(self, q, k, v):
        from ..methods.exact import softmax_attention

        q, k, scale = self._qk(q, k)
        return softmax_attention(q, k, v, scale=scale, window=self.window())

    def state_bytes(self, length):
        return length * self.H * 2 * self.D * KV_BYTES


class SlidingMixer(SoftmaxMixer):
    name = "sliding"
    defaults = {"window": 64, "qknorm": True, "beta": BETA0}

    def window(self) -> int | None:
        return int(self.opts["window"])

    def state_bytes(self, length):
        return min(length, int(self.opts["window"])) * self.H * 2 * self.D * KV_BYTES


class LinearMixer(Mixer):
    name = "linear"
    defaults = {"chunk": 64}

    def features(self, q, k):
        return F.elu(q.float()) + 1, F.elu(k.float()) + 1

    def attend(self, q, k, v):
        fq, fk = self.features(q, k)
        return causal_linear_attention(fq, fk, v, chunk=int(self.opts["chunk"])).transpose(1, 2)

    def feature_width(self) -> int:
        return self.D

    def state_bytes(self, length):
        return self.H * self.feature_width() * (self.D + 1) * 4


def _hedgehog_init(H: int, D: int, Fd: int) -> torch.Tensor:
    return torch.randn(H, D, Fd) / math.sqrt(D)


class HedgehogMixer(LinearMixer):
    name = "hedgehog"
    defaults = {"chunk": 64, "feature_dim": 32}

    def __init__(self, d_model, n_heads, **opts):
        super().__init__(d_model, n_heads, **opts)
        Fd = int(self.opts["feature_dim"])
        self.wq = nn.Parameter(_hedgehog_init(self.H, self.D, Fd))
        self.wk = nn.Parameter(_hedgehog_init(self.H, self.D, Fd))

    def features(self, q, k):
        from ..kernels.lola import hedgehog_feature_map

        return hedgehog_feature_map(q, self.wq, out_dtype=torch.float32), hedgehog_feature_map(k, self.wk, out_dtype=torch.float32)

    def feature_width(self) -> int:
        return 2 * int(self.opts["feature_dim"])


class _NormedMixin:
    """Unit-normalised q and k with a learned inverse temperature per head (as the ovq method does)."""

    def _init_beta(self, beta: float):
        self.log_beta = nn.Parameter(torch.full((self.H,), math.log(beta)))

    def _scaled(self, q, k):
        beta = self.log_beta.exp()[None, :, None, None]
        return F.normalize(q.float(), dim=-1) * beta, F.normalize(k.float(), dim=-1)


class VQMixer(_NormedMixin, Mixer):
    name = "vq"
    defaults = {"codes": 256, "chunk": 64, "beta": BETA0, "commit": 0.25}

    def __init__(self, d_model, n_heads, **opts):
        super().__init__(d_model, n_heads, **opts)
        self._init_beta(float(self.opts["beta"]))
        self.codebook = nn.Parameter(torch.randn(self.H, int(self.opts["codes"]), self.D))

    def attend(self, q, k, v):
        qs, ks = self._scaled(q, k)
        cb = F.normalize(self.codebook, dim=-1)
        o, assign = vq_attention(qs, ks, v, cb, chunk=int(self.opts["chunk"]))
        B, H, S, D = ks.shape
        picked = torch.gather(cb[None].expand(B, -1, -1, -1), 2, assign[..., None].expand(B, H, S, D))
        # VQ-VAE losses: move the codes to the keys, and the keys toward their codes
        self.aux_loss = ((ks.detach() - picked) ** 2).sum(-1).mean() + float(self.opts["commit"]) * (
            (ks - picked.detach()) ** 2).sum(-1).mean()
        return o.transpose(1, 2)

    def state_bytes(self, length):
        K, C = int(self.opts["codes"]), int(self.opts["chunk"])
        return self.H * K * (self.D + 1) * 4 + min(length, C - 1) * self.H * 2 * self.D * KV_BYTES


class OVQMixer(_NormedMixin, Mixer):
    name = "ovq"
    defaults = {"max_centroids": 512, "growth": 256.0, "chunk": 64, "beta": BETA0, "backend": "auto"}

    def __init__(self, d_model, n_heads, **opts):
        super().__init__(d_model, n_heads, **opts)
        self._init_beta(float(self.opts["beta"]))

    def attend(self, q, k, v):
        from ..kernels.ovq import ovq_attention

        qs, ks = self._scaled(q, k)
        o, _, _, _ = ovq_attention(qs, ks, v.float(), None, None, None, chunk_size=int(self.opts["chunk"]),
                                   max_centroids=int(self.opts["max_centroids"]), growth=float(self.opts["growth"]),
                                   backend=self.backend(q), exact_assign=False)  # as the ovq method: bf16 assignment dots
        return o.transpose(1, 2)

    def state_bytes(self, length):
        N, C = int(self.opts["max_centroids"]), int(self.opts["chunk"])
        from ..kernels.ovq import target_int

        rows = target_int(length, N, float(self.opts["growth"]))
        return self.H * rows * (2 * self.D + 1) * 4 + min(length, C - 1) * self.H * 2 * self.D * KV_BYTES


class LolcatsMixer(Mixer):
    name = "lolcats"
    defaults = {"window": 64, "feature_dim": 32, "chunk": 64, "backend": "auto"}

    def __init__(self, d_model, n_heads, **opts):
        super().__init__(d_model, n_heads, **opts)
        Fd = int(self.opts["feature_dim"])
        self.wq = nn.Parameter(_hedgehog_init(self.H, self.D, Fd))
        self.wk = nn.Parameter(_hedgehog_init(self.H, self.D, Fd))
        self.window_factor = nn.Parameter(torch.zeros(self.H))

    def _phi(self, x, w):
        from ..kernels.lola import hedgehog_feature_map

        return hedgehog_feature_map(x, w, out_dtype=x.dtype)

    def _factors(self):
        g = torch.sigmoid(self.window_factor.float())
        return g, torch.ones_like(g)

    def attend(self, q, k, v):
        from ..kernels.lola import hybrid_attention

        fq, fk = self._phi(q, self.wq), self._phi(k, self.wk)
        g, lf = self._factors()
        return hybrid_attention(q, k, v, fq, fk, g, lf, window=int(self.opts["window"]), scale=self.D ** -0.5,
                                chunk=int(self.opts["chunk"]), backend=self.backend(q))

    def state_bytes(self, length):
        W, C, F2 = int(self.opts["window"]), int(self.opts["chunk"]), 2 * int(self.opts["feature_dim"])
        buf = min(length, W + C - 1)
        return buf * self.H * 2 * self.D * KV_BYTES + self.H * F2 * (self.D + 1) * 4 + self._sparse_bytes()

    def _sparse_bytes(self) -> int:
        return 0


class LolaMixer(LolcatsMixer):
    name = "lola"
    defaults = {"window": 64, "feature_dim": 32, "chunk": 64, "sparse": 64, "backend": "auto"}

    def attend(self, q, k, v):
        """Training forwards (gradients on) are the LoLCATs hybrid: LoLA is training-free, its cache manager
        runs on a LoLCATs model at inference. Evaluation forwards run the LoLA manager (sparse cache)."""
        from ..kernels.lola import LolaState, lola_process

        if torch.is_grad_enabled():
            return super().attend(q, k, v)
        fq = self._phi(q, self.wq)
        g, lf = self._factors()
        B, H, S, D = q.shape
        lam = int(self.opts["sparse"])
        st = LolaState.empty(B, H, H, D, fq.shape[-1], lam, q.dtype, q.device)
        return lola_process(st, q, k, v, fq, g, lf, phi_k=lambda x: self._phi(x, self.wk),
                            window=int(self.opts["window"]), chunk=int(self.opts["chunk"]), lam=lam, scale=D ** -0.5,
                            backend=self.backend(q))

    def _sparse_bytes(self) -> int:
        return int(self.opts["sparse"]) * self.H * (2 * self.D * KV_BYTES + 4)


MIXERS: dict[str, type[Mixer]] = {c.name: c for c in (SoftmaxMixer, SlidingMixer, LinearMixer, HedgehogMixer, VQMixer,
                                                      OVQMixer, LolcatsMixer, LolaMixer)}
DEFAULT_MIXERS = ("softmax", "sliding", "linear", "hedgehog", "vq", "ovq", "lolcats", "lola")


@dataclass(frozen=True)
class MixerSpec:
    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.options)

    def build(self, d_model: int, n_heads: int) -> Mixer:
        return MIXERS[self.name](d_model, n_heads, **dict(self.options))


def parse_mixer(text: str) -> MixerSpec:
    """``"ovq"`` or ``"ovq:max_centroids=128,growth=64"`` -> :class:`MixerSpec` (values typed like the defaults)."""
    name, _, rest = str(text).strip().partition(":")
    name = name.strip().lower()
    if name not in MIXERS:
        raise ConfigError(f"unknown mixer {name!r}; choose from: {', '.join(MIXERS)}")
    cls = MIXERS[name]
    opts = []
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or key not in cls.defaults:
            raise ConfigError(f"mixer {name!r}: bad option {item!r}; write KEY=VALUE with KEY one of: "
                              f"{', '.join(cls.defaults) or '(none)'}")
        default = cls.defaults[key]
        try:
            value = type(default)(val.strip()) if not isinstance(default, bool) else val.strip().lower() in ("1", "true", "yes")
        except ValueError:
            raise ConfigError(f"mixer {name!r}: {key} must be a {type(default).__name__}, got {val!r}") from None
        if key == "backend" and value not in ("auto", "torch", "triton"):
            raise ConfigError(f"mixer {name!r}: backend must be auto, torch or triton, got {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"mixer {name!r}: {key} must be >= 0, got {value}")
        opts.append((key, value))
    return MixerSpec(name, tuple(opts))


def parse_mixers(items: str | Sequence[str]) -> list[MixerSpec]:
    if isinstance(items, str):
        items = [items]
    out: list[MixerSpec] = []
    for it in items:
        # commas separate mixers unless they follow an option list ("ovq:a=1,b=2" stays one spec)
        parts: list[str] = []
        for piece in str(it).split(","):
            piece = piece.strip()
            if not piece:
                continue
            if parts and "=" in piece and ":" not in piece:
                parts[-1] += "," + piece
            else:
                parts.append(piece)
        out.extend(parse_mixer(p) for p in parts)
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"a mixer is given twice: {', '.join(labels)}")
    if not out:
        raise ConfigError(f"no mixer given; choose from: {', '.join(MIXERS)}")
    return out


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


# ================================================================================================ training
@dataclass
class TrainConfig:
    steps: int = 200
    lrs: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    seeds: tuple[int, ...] = (0,)
    tokens_per_step: int = 16384  # batch = max(1, tokens_per_step // length)
    warmup: float = 0.05  # fraction of the steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_sequences: int = 64
    eval_tokens_per_batch: int = 65536
    device: str = "cpu"
    log_every: int = 10
    # curriculum: the first `curriculum_fraction` of the steps train at `curriculum_length` only (short
    # sequences, where the recall circuit forms), the rest cycle through the run's lengths
    curriculum_length: int | None = None
    curriculum_fraction: float = 0.0

    def validate(self) -> "TrainConfig":
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if self.curriculum_length is not None and self.curriculum_length < 1:
            raise ConfigError(f"curriculum length must be >= 1 token, got {self.curriculum_length}")
        if not 0.0 <= self.curriculum_fraction < 1.0:
            raise ConfigError(f"curriculum fraction must be in [0, 1), got {self.curriculum_fraction}")
        if not self.lrs or any(lr <= 0 for lr in self.lrs):
            raise ConfigError(f"learning rates must be > 0, got {self.lrs}")
        if not self.seeds:
            raise ConfigError("give at least one seed")
        if self.tokens_per_step < 1 or self.eval_sequences < 1:
            raise ConfigError("tokens_per_step and eval_sequences must be >= 1")
        return self


def curriculum_at(step: int, tcfg: TrainConfig) -> int | None:
    """The curriculum's sequence length at ``step``, or None once the curriculum is over (or without one)."""
    if tcfg.curriculum_length and step < int(tcfg.curriculum_fraction * tcfg.steps):
        return int(tcfg.curriculum_length)
    return None


def parse_curriculum(text: str | None) -> tuple[int | None, float]:
    """``'64:0.25'`` -> (64, 0.25): the first 25% of the steps at 64 tokens. None / '' / 'none' -> no curriculum."""
    if not text or str(text).strip().lower() == "none":
        return None, 0.0
    from .common import parse_size

    length, sep, frac = str(text).partition(":")
    try:
        fraction = float(frac) if sep else float("nan")
    except ValueError:
        fraction = float("nan")
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"bad curriculum {text!r}; write LENGTH:FRACTION, e.g. 64:0.25 (the first 25% of the "
                          "steps at 64 tokens)")
    return parse_size(length), fraction


def _batch_to(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _lr_at(step: int, steps: int, lr: float, warmup: float) -> float:
    w = max(1, int(warmup * steps))
    if step < w:
        return lr * (step + 1) / w
    t = (step - w) / max(1, steps - w)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def evaluate(model: SyntheticLM, task, length: int, n_seq: int, tokens_per_batch: int, device, seed: int = 10 ** 9) -> dict:
    model.eval()
    bs = max(1, min(n_seq, tokens_per_batch // length))
    sums: dict[str, float] = {}
    done = 0
    with torch.no_grad():
        while done < n_seq:
            b = min(bs, n_seq - done)
            batch = _batch_to(task.sample(length, b, seed + 7919 * length + done), device)
            out = model(**task.model_inputs(batch))
            for k, v in task.metric_sums(out, batch).items():
                sums[k] = sums.get(k, 0.0) + v
            done += b
    model.train()
    return task.finish(sums)


def train_one(task, spec: MixerSpec, lengths: Sequence[int], mcfg: ModelConfig, tcfg: TrainConfig, lr: float, seed: int,
              progress: bool = False, eval_lengths: Sequence[int] | None = None,
              deadline: float | None = None) -> dict[str, Any]:
    """Trains one model from scratch and evaluates it at every length. Returns a JSON-ready record.

    Steps cycle through ``lengths`` (after the curriculum's steps at ``curriculum_length``, if any); a step at
    length ``L`` uses ``max(1, tokens_per_step // L)`` sequences.
    ``deadline`` (a ``time.time()`` value): training stops there even if ``steps`` are not done; the record's
    ``steps_done`` says how many ran (a guard for time-limited runs, reported, never silent).
    """
    device = torch.device(tcfg.device)
    torch.manual_seed(seed)
    model = SyntheticLM(task.vocab_size, task.feat_dim, task.out_dim, spec, mcfg).to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n and "codebook" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n and "codebook" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))
    losses: list[tuple[int, float]] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=tcfg.steps, desc=f"{task.name} {spec.label} lr={lr:g} seed={seed}", leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()
    diverged = False
    running = None
    steps_done = 0
    for step in range(tcfg.steps):
        if deadline is not None and time.time() > deadline:
            break
        L = curriculum_at(step, tcfg) or lengths[step % len(lengths)]
        bs = max(1, tcfg.tokens_per_step // L)
        batch = _batch_to(task.sample(L, bs, 1_000_003 * (seed + 1) + step), device)
        for gr in opt.param_groups:
            gr["lr"] = _lr_at(step, tcfg.steps, lr, tcfg.warmup)
        out = model(**task.model_inputs(batch))
        loss = task.loss(out, batch)
        aux = model.aux_loss()
        total = loss + aux if aux is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        if tcfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        if step % tcfg.log_every == 0 or step == tcfg.steps - 1:
            val = float(loss.detach())
            if not math.isfinite(val):
                diverged = True
                losses.append((step, val))
                break
            losses.append((step, val))
            running = val
            if bar is not None:
                bar.set_postfix(loss=f"{val:.3f}")
        steps_done = step + 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    train_s = time.perf_counter() - t0
    evals = {}
    if not diverged:
        for L in (eval_lengths or lengths):
            evals[str(L)] = evaluate(model, task, L, tcfg.eval_sequences, tcfg.eval_tokens_per_batch, device)
    return {
        "mixer": spec.label, "lr": lr, "seed": seed, "diverged": diverged, "final_loss": running, "steps_done": steps_done,
        "losses": losses, "train_seconds": round(train_s, 2), "eval": evals,
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": {str(L): model.state_bytes(L) for L in (eval_lengths or lengths)},
    }


def _job(args):
    task, spec, lengths, mcfg, tcfg, lr, seed, eval_lengths = args[:8]
    deadline = args[8] if len(args) > 8 else None
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.set_num_threads(max(1, int(os.environ.get("LONGCTX_SYNTH_THREADS", "1"))))
    try:
        return train_one(task, spec, lengths, mcfg, tcfg, lr, seed, progress=False, eval_lengths=eval_lengths,
                         deadline=deadline)
    except Exception as e:  # noqa: BLE001 - one failing mixer must not lose the others' results
        return {"mixer": spec.label, "lr": lr, "seed": seed, "error": f"{type(e).__name__}: {e}"}


def run_sweep(task, specs: Sequence[MixerSpec], lengths: Sequence[int], mcfg: ModelConfig, tcfg: TrainConfig, *,
              workers: int = 1, progress: bool = True, eval_lengths: Sequence[int] | None = None,
              on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Trains every (mixer, lr, seed) with the same budget. ``workers > 1`` runs jobs in parallel processes
    (several small models share one GPU well). Returns the run records (``error`` set on failure)."""
    tcfg.validate()
    mcfg.validate()
    curriculum = [tcfg.curriculum_length] if tcfg.curriculum_length else []
    task.check_lengths(list(lengths) + list(eval_lengths or []) + curriculum)
    jobs = [(task, s, list(lengths), mcfg, tcfg, lr, seed, list(eval_lengths) if eval_lengths else None)
            for s in specs for lr in tcfg.lrs for seed in tcfg.seeds]
    records: list[dict] = []
    if workers <= 1:
        from tqdm.auto import tqdm

        outer = tqdm(jobs, desc=f"{task.name} runs", disable=not progress, dynamic_ncols=True)
        for j in outer:
            try:
                rec = train_one(*j[:7], progress=progress, eval_lengths=j[7])
            except (ConfigError, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001
                rec = {"mixer": j[1].label, "lr": j[5], "seed": j[6], "error": f"{type(e).__name__}: {e}"}
            records.append(rec)
            if on_result:
                on_result(rec)
        return records
    import concurrent.futures as cf
    import multiprocessing as mp

    from tqdm.auto import tqdm

    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(_job, j) for j in jobs]
        for f in tqdm(cf.as_completed(futs), total=len(futs), desc=f"{task.name} runs", disable=not progress,
                      dynamic_ncols=True):
            rec = f.result()
            records.append(rec)
            if on_result:
                on_result(rec)
    return records


# ================================================================================================ reporting
def summarize(task, specs: Sequence[MixerSpec], records: Sequence[dict], lengths: Sequence[int]) -> dict[str, Any]:
    """Best learning rate per mixer (mean of the primary metric over lengths and seeds) and its figures."""
    key = task.primary
    better = max if task.higher_is_better else min
    out: dict[str, Any] = {}
    for s in specs:
        recs = [r for r in records if r.get("mixer") == s.label and not r.get("error") and not r.get("diverged")]
        by_lr: dict[float, list[dict]] = {}
        for r in recs:
            by_lr.setdefault(r["lr"], []).append(r)

        def score(rs):
            vals = [r["eval"][str(L)][key] for r in rs for L in lengths if str(L) in r["eval"]]
            return sum(vals) / len(vals) if vals else None

        scored = {lr: score(rs) for lr, rs in by_lr.items() if score(rs) is not None}
        errors = [r["error"] for r in records if r.get("mixer") == s.label and r.get("error")]
        entry: dict[str, Any] = {"spec": s.label, "errors": errors,
                                 "diverged_lrs": sorted({r["lr"] for r in records if r.get("mixer") == s.label and r.get("diverged")})}
        if scored:
            best_lr = better(scored, key=scored.get)
            rs = by_lr[best_lr]
            entry["best_lr"] = best_lr
            entry["by_length"] = {str(L): sum(r["eval"][str(L)][key] for r in rs) / len(rs) for L in lengths}
            entry["state_bytes"] = rs[0]["state_bytes"]
            entry["score_by_lr"] = {str(lr): v for lr, v in scored.items()}
            entry["eval"] = rs[0]["eval"] if len(rs) == 1 else [r["eval"] for r in rs]
        out[s.label] = entry
    return out


def tables(task, summary: dict[str, Any], lengths: Sequence[int]) -> str:
    from .common import format_bytes, format_table, size_label

    key = task.primary
    ref = summary.get("softmax", {}).get("state_bytes", {})
    Lmax = str(max(lengths))
    header = ["mixer", "best lr"] + [f"{key}@{size_label(L)}" for L in lengths] + [f"state@{size_label(int(Lmax))}", "vs softmax"]
    rows = []
    for label, e in summary.items():
        if "by_length" not in e:
            rows.append([label, None] + [None] * len(lengths) + [None, ("error: " + e["errors"][0][:60]) if e["errors"] else "diverged"])
            continue
        sb = e["state_bytes"].get(Lmax)
        ratio = f"{100 * sb / ref[Lmax]:.1f}%" if ref.get(Lmax) else None
        row = [label, e["best_lr"]] + [round(e["by_length"][str(L)], 4) for L in lengths] + [format_bytes(sb) if sb is not None else None, ratio]
        ev = e["eval"] if isinstance(e["eval"], dict) else e["eval"][0]
        if "functions_learned" in ev.get(Lmax, {}):
            row.append(f"{ev[Lmax]['functions_learned']}/{ev[Lmax]['functions_measured']}")
        rows.append(row)
    if any(len(r) > len(header) for r in rows):
        header.append(f"learned@{size_label(int(Lmax))}")
        rows = [r + [None] * (len(header) - len(r)) for r in rows]
    return format_table(header, rows)


def plot(task, summary: dict[str, Any], lengths: Sequence[int], stem: str, title: str) -> list[str]:
    """``<stem>-length.png`` (metric vs length), ``<stem>-state.png`` (metric vs state bytes at each length) and,
    for ICL, ``<stem>-shots.png`` (error vs earlier examples of the same function, at the longest length)."""
    from .common import pyplot

    plt = pyplot()
    key = task.primary
    paths = []

    def save(fig, ax, suffix: str, xlabel: str, ylabel: str, ylog: bool, plot_title: str) -> None:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ylog:
            ax.set_yscale("log")
        ax.set_title(plot_title)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
        fig.tight_layout()
        p = f"{stem}-{suffix}.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, e in summary.items():
        if "by_length" in e:
            ax.plot(lengths, [e["by_length"][str(L)] for L in lengths], marker="o", label=label)
    ax.set_xscale("log", base=2)
    save(fig, ax, "length", "sequence length (tokens)", key, not task.higher_is_better, title)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    markers = "os^vD<>ph*"
    for i, (label, e) in enumerate(summary.items()):
        if "by_length" in e:
            xs = [e["state_bytes"][str(L)] for L in lengths]
            ys = [e["by_length"][str(L)] for L in lengths]
            ax.plot(xs, ys, marker=markers[i % len(markers)], linestyle=":", label=label)
    ax.set_xscale("log")
    save(fig, ax, "state", "decode state (bytes, all layers, batch 1; points = lengths)", key,
         not task.higher_is_better, title)
    Lmax = str(max(lengths))
    curves = {}
    for label, e in summary.items():
        ev = e.get("eval")
        ev = ev[0] if isinstance(ev, list) else ev
        if ev and "mse_by_shots" in ev.get(Lmax, {}):
            pts = [(c["shots_from"], c["mse"]) for c in ev[Lmax]["mse_by_shots"] if c["mse"] is not None]
            if pts:
                curves[label] = pts
    if curves:  # ICL: error against the number of earlier examples of the same function
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label, pts in curves.items():
            ax.plot([x + 1 for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        save(fig, ax, "shots", "1 + earlier examples of the same function (bin start)", "mse (1.0 = predicting 0)",
             True, f"{title} (length {Lmax})")
    return paths


def write_report(path, task, specs: Sequence[MixerSpec], records: Sequence[dict], lengths: Sequence[int],
                 mcfg: ModelConfig, tcfg: TrainConfig, *, label: str = "", command: str | None = None,
                 plots: bool = True, extra: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """Writes the result JSON (common fields device/date/commit/command) and the PNG plots; returns the tables."""
    from pathlib import Path

    from .common import MethodRun, device_description, write_result

    path = Path(path)
    summary = summarize(task, specs, records, lengths)
    text = tables(task, summary, lengths)
    figures: dict[str, Any] = {
        "label": label,
        "mixer_options": {s.label: {**MIXERS[s.name].defaults, **dict(s.options)} for s in specs}, "lengths": list(lengths), "task_config": task.describe(), "model_config": asdict(mcfg),
        "train_config": asdict(tcfg), "primary_metric": task.primary, "summary": summary, "runs": list(records),
        "table": text,
    }
    if extra:
        figures.update(extra)
    if plots:
        stem = str(path.with_suffix(""))
        path.parent.mkdir(parents=True, exist_ok=True)
        figures["plots"] = [os.path.basename(p) for p in plot(task, summary, lengths, stem, f"{task.name} {label}".strip())]
    runs = [MethodRun(s.label) for s in specs]
    write_result(path, task=task.name, model=f"from-scratch {mcfg.n_layers}x{mcfg.d_model} (heads {mcfg.n_heads})",
                 runs=runs, figures=figures, command=command, device=device_description(tcfg.device))
    return text, summary


__all__ = ["MIXERS", "DEFAULT_MIXERS", "MixerSpec", "parse_mixer", "parse_mixers", "SyntheticLM", "ModelConfig",
           "TrainConfig", "train_one", "run_sweep", "summarize", "tables", "plot", "write_report",
           "causal_linear_attention", "linear_attention_ref", "vq_attention", "vq_attention_ref", "evaluate"]
