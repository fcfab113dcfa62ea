"""The guard's estimate as it was first written (longctx_patch/methods/muse/guard.py before its per-call path was
made cheap on CUDA): `sampled_rows`, `exact_rows` and `estimate_errors` built the sample from host lists copied to
the device, and measured the sampled rows through SDPA with a dense boolean mask, one batch row at a time. Kept here
as the reference the current implementation is tested against (tests/test_muse_guard_fast.py): the same rows, the
same weights and the same estimates up to floating-point rounding."""

from __future__ import annotations

import torch

from longctx_patch.methods.muse.guard import sample_ranks, top_rows


def _real_counts(km, B: int, S: int) -> list[int]:
    return [S] * B if km is None else km.sum(1).tolist()


def sampled_rows(o, km, first: int, rows: int):
    """The sample of a call: (positions [B, Hq, m] long, weights [B, Hq, m] fp32, per-row counts), m the most rows a
    batch row samples, or (None, None, counts) when no row has an approximated row. o [B, S, Hq, D] is MuSe's output.

    Per batch row, among its approximated rows (ranks >= first among its real tokens: key_mask True, all S without
    one), of A rows: all of them (weight 1) when A <= rows; else, per head, the `top_rows(rows)` rows of largest
    |o_t| (weight 1: a take-all stratum, since a few rows of large output carry much of a head's error and of its
    norm), and `rows - top_rows(rows)` rows stratified over all A (`sample_ranks`, shared by the heads) standing for
    the other rows: a stratified row that is one of the head's top rows is dropped and the rest scaled to count
    A - top rows. Padding's weight is 0."""
    B, S, Hq, D = o.shape
    dev = o.device
    n_real = _real_counts(km, B, S)
    A = [max(0, n - first) for n in n_real]
    if max(A, default=0) == 0:
        return None, None, [0] * B
    top = top_rows(rows)
    tops = [0 if a <= rows else top for a in A]
    per_row = [sample_ranks(n, first, rows if t == 0 else rows - t) for n, t in zip(n_real, tops)]
    ms, k = max(len(r) for r, _ in per_row), max(tops)
    ranks = torch.tensor([r + [first] * (ms - len(r)) for r, _ in per_row], dtype=torch.long, device=dev)
    w = torch.tensor([w + [0] * (ms - len(w)) for _, w in per_row], dtype=torch.float32, device=dev)
    cum = None if km is None else km.to(torch.int32).cumsum(1)
    pos = ranks if cum is None else torch.searchsorted(cum, (ranks + 1).to(torch.int32)).clamp_(max=S - 1)
    pos, w = pos[:, None, :].expand(B, Hq, ms), w[:, None, :].expand(B, Hq, ms)
    if k:
        rank = torch.arange(S, device=dev).expand(B, S) if cum is None else cum - 1
        approx = rank >= first if km is None else (rank >= first) & km
        norms = o.detach().float().pow(2).sum(-1).masked_fill(~approx[:, :, None], -1.0)  # [B, S, Hq]
        best = norms.topk(k, dim=1).indices.transpose(1, 2)  # [B, Hq, k]
        has = torch.tensor([t > 0 for t in tops], device=dev)[:, None, None]
        taken = (pos[..., None] == best[:, :, None, :]).any(-1) & has  # a stratified row among the top rows
        w = w.masked_fill(taken, 0.0)
        rest = torch.tensor([a - t for a, t in zip(A, tops)], dtype=torch.float32, device=dev)[:, None]
        w = w * torch.where(has[..., 0], rest / w.sum(-1).clamp_min(1.0), 1.0)[..., None]
        pos = torch.cat([pos, best], -1)
        w = torch.cat([w, has.float().expand(B, Hq, k)], -1)
    return pos, w, [len(r) + t for (r, _), t in zip(per_row, tops)]


def exact_rows(q, k, v, pos, km, *, scale: float) -> torch.Tensor:
    """Exact causal attention of the query rows `pos` [B, Hq, m] (columns of q, per query head) against their keys:
    key j for row t when j <= t (and key_mask[b, j]), through SDPA in the inputs' dtype (fp32 softmax and
    accumulation: what a head made exact computes). q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, Hq, m, D] fp32 (a row
    with no key: 0). A kv group's query heads are one query block of G m rows over the kv head's keys (no repeated
    keys); one batch row at a time."""
    import torch.nn.functional as F

    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G, m = Hq // Hkv, pos.shape[2]
    qs = q.gather(2, pos[..., None].expand(B, Hq, m, D)).reshape(B, Hkv, G * m, D)
    keys = torch.arange(S, device=q.device)
    out = torch.empty(B, Hkv, G * m, D, dtype=q.dtype, device=q.device)
    for b in range(B):
        allowed = keys <= pos[b, :, :, None]  # [Hq, m, S]
        if km is not None:
            allowed = allowed & km[b]
        mask = allowed.reshape(1, Hkv, G * m, S)  # rows in (group head, row) order
        out[b] = F.scaled_dot_product_attention(qs[b:b + 1], k[b:b + 1].to(q.dtype), v[b:b + 1].to(q.dtype),
                                                attn_mask=mask, scale=scale)[0]
    return out.view(B, Hq, m, D).float().nan_to_num_(0.0)


def estimate_errors(o, q, k, v, km, *, scale: float, first: int, rows: int, heads=None):
    """The guard's estimates for one call: (errors [B, Hq] fp32 (NaN where a row samples nothing), per-row sampled
    counts). o [B, S, Hq, D] is MuSe's output; `heads` the query heads to measure (default all; others NaN)."""
    B, Hq, S, D = q.shape
    with torch.no_grad():
        err = torch.full((B, Hq), float("nan"), device=q.device)
        hs = list(range(Hq)) if heads is None else list(heads)
        pos, w, counts = sampled_rows(o, km, first, rows) if hs else (None, None, [0] * B)
        if pos is None:
            return err, counts
        ref = exact_rows(q, k, v, pos, km, scale=scale)  # [B, Hq, m, D]
        got = o.detach().transpose(1, 2).gather(2, pos[..., None].expand(B, Hq, pos.shape[2], D)).float()
        num = torch.where(w > 0, (got - ref).pow(2).sum(-1) * w, 0.0).sum(-1)  # [B, Hq]
        den = torch.where(w > 0, ref.pow(2).sum(-1) * w, 0.0).sum(-1)
        e = torch.where(den > 0, (num / den.clamp_min(torch.finfo(torch.float32).tiny)).sqrt(),
                        torch.where(num > 0, torch.full_like(num, float("inf")), torch.zeros_like(num)))
        sel = torch.tensor(hs, device=q.device)
        err[:, sel] = e[:, sel]
        none = torch.tensor([c == 0 for c in counts], device=q.device)
        err[none] = float("nan")
    return err, counts
