"""The attention forms of the synthetic mixers that have no kernel of their own, each with its quadratic reference:
chunked causal linear attention (``linear``, ``hedgehog``) and Transformer-VQ style attention with a static
codebook (``vq``). Plain tensors in, plain tensors out."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


__all__ = ["causal_linear_attention", "linear_attention_ref", "vq_attention", "vq_attention_ref"]
