"""LoLA's training path: the sparse sets chosen once without gradients, then one differentiable pass.

The chunk loop (`ops.lola_process` on the PyTorch backend) is differentiable but slow to train through: a
step of 2 x 4096 tokens on a SmolLM2-shaped model took 15.5 s on the H200 against 1.15 s for `lolcats`
(64-token chunks; benchmarks/results/lola/train-step-h200.json). Its selection is discrete, so no gradient flows
through it anyway. Here the selection runs first, without gradients, as the chunk loop makes it
(`sparse_positions`: which token positions each chunk's queries see in the sparse cache); then the output is one
masked hybrid attention per block of queries (`lola_attention_sets`): for query i of chunk c, the keys of its
window and of chunk c's sparse set are attended by softmax, every other earlier key linearly (folded into the
state, or still buffered), as in `reference.lola_attention`. Same value as the chunk loop, gradients through
q, k, v, the feature maps and the window factors; O(block x N) memory per block, recomputed in the backward.
"""
from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from . import reference as ref


@torch.no_grad()
def sparse_positions(fk, v, key_mask, *, window: int, chunk: int, lam: int, sparse_heads: int) -> torch.Tensor:
    """The sparse set each chunk attends, as the chunk loop builds it from an empty state.

    fk [B, Hq, S, F2] (phi(k) of every key under each query head's map), v [B, Hkv, S, D], key_mask [B, S] bool
    or None. Eviction c (at the end of chunk c) scores the lam slots followed by the pairs leaving the window
    (positions c*chunk - window .. (c+1)*chunk - window - 1) by self-recall error against the state of every
    query head, summed per sparse head; keeps the lam best (ties: lowest candidate index) and folds the other
    valid ones. Returns positions [n_chunks, B, sparse_heads, lam] int64 (-1: empty slot); row c is what
    chunk c attends (row 0 is empty)."""
    B, Hq, S, F2 = fk.shape
    D = v.shape[-1]
    Hs, C, W = sparse_heads, chunk, window
    nch = math.ceil(S / C)
    dev = fk.device
    H = torch.zeros(B, Hq, F2, D, device=dev, dtype=torch.float32)
    s = torch.zeros(B, Hq, F2, device=dev, dtype=torch.float32)
    sp = torch.full((B, Hs, lam), -1, device=dev, dtype=torch.long)
    vs = ref.expand_kv(v, Hs)
    valid_key = key_mask.bool() if key_mask is not None else torch.ones(B, S, dtype=torch.bool, device=dev)
    out = [sp]
    for c in range(nch - 1):
        pos = torch.arange(c * C - W, (c + 1) * C - W, device=dev)
        ok = (pos >= 0)[None, :] & valid_key[:, pos.clamp_min(0)]  # [B, C]
        cand = torch.cat([sp, pos.expand(B, Hs, C)], -1)  # [B, Hs, lam + C]
        cand_valid = torch.cat([sp >= 0, ok[:, None, :].expand(B, Hs, C)], -1)
        ci = cand.clamp_min(0)
        cfk = torch.gather(fk, 2, ref.expand_kv(ci, Hq)[..., None].expand(-1, -1, -1, F2))
        cv = torch.gather(vs, 2, ci[..., None].expand(-1, -1, -1, D))
        scores = ref.group_sum(ref.sre_scores(cfk, cv, H, s), Hs).masked_fill(~cand_valid, float("-inf"))
        top = ref.top_lam(scores, lam)
        w = cand_valid.float()
        w.scatter_(-1, top.indices, 0.0)
        H, s = ref.fold(cfk, cv, w, H, s)
        sp = torch.where(torch.isfinite(top.values), torch.gather(cand, -1, top.indices), -1)
        out.append(sp)
    return torch.stack(out)


def _block(q, k, v, fq, fk, g, lf, sets, key_mask, q0: int, *, window: int, chunk: int, scale: float,
           combine: str = "shifted"):
    """Output rows q0 .. q0 + q.shape[2] - 1 (whole chunks) against keys 0 .. N - 1 (N = q0 + rows)."""
    B, Hq, M, D = q.shape
    N = k.shape[2]
    Hs = sets.shape[2]
    qpos = torch.arange(M, device=q.device) + q0
    kpos = torch.arange(N, device=q.device)
    diff = qpos[:, None] - kpos[None, :]
    causal = diff >= 0
    win = (causal & (diff < window))[None, None]  # [1, 1, M, N]
    # sparse[b, hs, i, j]: key j is in the sparse set of query i's chunk
    rows = sets[qpos // chunk]  # [M, B, Hs, lam]
    sparse = torch.zeros(M, B, Hs, N + 1, dtype=torch.bool, device=q.device)
    sparse.scatter_(-1, torch.where(rows >= 0, rows, N), True)
    sparse = ref.expand_kv(sparse[..., :N].permute(1, 2, 0, 3), Hq)  # [B, Hq, M, N]
    soft = win | sparse
    lin = causal[None, None] & ~soft
    if key_mask is not None:
        km = key_mask.bool()[:, None, None, :N]
        soft, lin = soft & km, lin & km
    kx, vx = ref.expand_kv(k, Hq).float(), ref.expand_kv(v, Hq).float()
    sc = torch.einsum("bhsd,bhnd->bhsn", q.float(), kx) * scale
    sc = sc.masked_fill(~soft, float("-inf"))
    m = ref.row_max(sc, combine)
    p = torch.exp(sc - m)
    a = torch.einsum("bhsf,bhnf->bhsn", fq.float(), fk.float()) * lin
    return ref._finish(p @ vx, p.sum(-1, keepdim=True), a @ vx, a.sum(-1, keepdim=True), g, lf,
                       m if ref.check_combine(combine) else None)


def lola_attention_sets(q, k, v, fq, fk, g, lf, sets, *, window: int, chunk: int, scale: float, key_mask=None,
                        block: int = 1024, combine: str = "shifted") -> torch.Tensor:
    """The hybrid output of a fresh LoLA prefill given its sparse sets (`sparse_positions`), differentiable.

    q/fq [B, Hq, S, D/F2], k/v [B, Hkv, S, D], fk [B, Hq, S, F2], sets [n_chunks, B, Hs, lam]. Queries go in
    blocks of about `block` tokens (whole chunks), each recomputed in the backward when gradients are needed.
    combine: how the exact and linear terms meet (`reference._finish`).
    Returns [B, S, Hq, D] in q.dtype."""
    S = q.shape[2]
    rows = max(chunk, (block // chunk) * chunk)
    outs = []
    for q0 in range(0, S, rows):
        q1 = min(S, q0 + rows)
        args = (q[:, :, q0:q1], k[:, :, :q1], v[:, :, :q1], fq[:, :, q0:q1], fk[:, :, :q1], g, lf, sets,
                key_mask, q0)
        kw = dict(window=window, chunk=chunk, scale=scale, combine=combine)
        if torch.is_grad_enabled():
            outs.append(checkpoint(_block, *args, use_reentrant=False, **kw))
        else:
            outs.append(_block(*args, **kw))
    return torch.cat(outs, 2).transpose(1, 2).to(q.dtype)
