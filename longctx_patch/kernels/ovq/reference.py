"""PyTorch reference of online vector-quantised (OVQ) attention.

Shapes (``B`` batch, ``Hq`` query heads, ``H`` key/value heads, ``D`` head dim, ``N`` max centroids):

* queries ``q``: ``[B, Hq, S, D]``, already unit-normalised and multiplied by the inverse temperature
  (the caller owns ``beta``);
* keys ``k`` / values ``v``: ``[B, H, S, D]`` (``Hq % H == 0``, GQA groups share one dictionary);
* dictionary state (:class:`OVQState`): ``keys [B, H, N, D]``, ``values [B, H, N, Dv]``,
  ``counts [B, H, N]`` (float, 0 for empty rows), ``n_active [B]`` and ``seen [B]`` (real tokens
  absorbed so far).  Active rows are always ``0 .. n_active-1``.

The dictionary update is split into a discrete part (growth, spread-maximisation init, assignments;
never differentiated) and a linear part (count-weighted means; differentiable in the chunk's keys
and values and in the previous dictionary).  See ``docs/ovq.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass
class OVQState:
    """Dictionary state, stored as per-row sums: the row means are ``key_sums / counts``.

    Sums make the update a pure scatter-add (count-weighted running means come out exactly) and let
    the Triton kernels update rows with atomic adds.  ``n_active`` always equals
    ``target_centroids(seen)``.
    """
    key_sums: Tensor    # [B, H, N, D]   float32
    value_sums: Tensor  # [B, H, N, Dv]  float32
    counts: Tensor      # [B, H, N]      float32
    n_active: Tensor    # [B] int64
    seen: Tensor        # [B] int64

    @staticmethod
    def empty(batch: int, heads: int, max_centroids: int, head_dim: int, value_dim: int | None = None,
              device=None, dtype=torch.float32) -> "OVQState":
        value_dim = head_dim if value_dim is None else value_dim
        return OVQState(
            key_sums=torch.zeros(batch, heads, max_centroids, head_dim, device=device, dtype=dtype),
            value_sums=torch.zeros(batch, heads, max_centroids, value_dim, device=device, dtype=dtype),
            counts=torch.zeros(batch, heads, max_centroids, device=device, dtype=dtype),
            n_active=torch.zeros(batch, device=device, dtype=torch.long),
            seen=torch.zeros(batch, device=device, dtype=torch.long),
        )

    @property
    def max_centroids(self) -> int:
        return self.key_sums.shape[2]

    @property
    def keys(self) -> Tensor:
        """Row means of the keys (D_k), zeros for empty rows."""
        return self.key_sums / self.counts.clamp_min(1.0)[..., None]

    @property
    def values(self) -> Tensor:
        """Row means of the values (D_v), zeros for empty rows."""
        return self.value_sums / self.counts.clamp_min(1.0)[..., None]

    def detach(self) -> "OVQState":
        return replace(self, key_sums=self.key_sums.detach(), value_sums=self.value_sums.detach())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.key_sums, self.value_sums, self.counts, self.n_active, self.seen))

    def bias(self) -> Tensor:
        """log(count) per row, -inf for empty rows: ``[B, H, N]`` float32."""
        c = self.counts.float()
        return torch.where(c > 0, torch.log(c.clamp_min(1e-30)), torch.full_like(c, float("-inf")))


# ----------------------------------------------------------------------------------------------
# growth schedule
# ----------------------------------------------------------------------------------------------
def target_centroids(seen: Tensor, max_centroids: int, growth: float) -> Tensor:
    """Saturating size of the dictionary after ``seen`` real tokens.

    Dirichlet-process-like: ``N(T) = min(N_max, T, ceil(a * ln(1 + T / a)))`` with concentration
    ``a = growth`` (the expected number of clusters of a DP after T draws, capped at ``N_max``).  Early
    tokens almost all open rows, later ones ever fewer.  ``growth == 0`` stands for the limit
    ``a -> inf``: every token its own row until the dictionary is full.
    """
    t = seen.to(torch.float64)
    if growth <= 0:
        n = t
    else:
        n = torch.ceil(growth * torch.log1p(t / growth) - 1e-9)
    n = torch.minimum(n, t).clamp(max=max_centroids)
    return n.to(torch.long)


def target_int(seen: int, max_centroids: int, growth: float) -> int:
    """Host-side version of :func:`target_centroids` (upper bound on the active rows)."""
    if growth <= 0:
        n = seen
    else:
        n = math.ceil(growth * math.log1p(seen / growth) - 1e-9) if seen > 0 else 0
    return int(min(n, seen, max_centroids))


def plan_growth(seen: Tensor, n_active: Tensor, n_real: Tensor, max_centroids: int, growth: float) -> Tensor:
    """Number of new centroids taken from a chunk with ``n_real`` real tokens: ``[B]`` int64."""
    target = target_centroids(seen + n_real, max_centroids, growth)
    return torch.minimum((target - n_active).clamp_min(0), n_real)


# ----------------------------------------------------------------------------------------------
# dictionary update (vectorised reference)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def select_and_assign(state: OVQState, k: Tensor, valid: Tensor, n_new: Tensor,
                      old_stats: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Discrete part of the update for one chunk.

    ``k``: ``[B, H, C, D]``; ``valid``: ``[B, C]`` bool; ``n_new``: ``[B]``.
    ``old_stats`` optionally gives, per token, (max dot product with the active rows, best active row
    by squared distance, as ``(maxdot [B,H,C] f32, best_score [B,H,C] f32, best_idx [B,H,C] i64)``) computed
    by a kernel; otherwise they are computed here.
    Returns the row each token goes to, ``[B, H, C]`` int64, -1 for padding tokens.
    """
    B, H, C, D = k.shape
    N = state.max_centroids
    kf = k.float()
    dk = state.keys.float()  # row means
    ar_n = torch.arange(N, device=k.device)
    active = ar_n[None, :] < state.n_active[:, None]                      # [B, N]
    if old_stats is None:
        dots = kf @ dk.transpose(-1, -2)                                  # [B, H, C, N]
        neg = torch.tensor(float("-inf"), device=k.device)
        dots = torch.where(active[:, None, None, :], dots, neg)
        maxdot = dots.max(-1).values                                      # -inf when empty
        score_old = dots - 0.5 * (dk * dk).sum(-1)[:, :, None, :]
        best_old, idx_old = score_old.max(-1)
    else:
        maxdot, best_old, idx_old = old_stats
    validh = valid[:, None, :].expand(B, H, C)
    # spread maximisation: smallest maximal dot product with the existing rows (ties: earliest token)
    spread = torch.where(validh, maxdot, torch.full_like(maxdot, float("inf")))
    order = torch.sort(spread, dim=-1, stable=True).indices               # [B, H, C]
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(C, device=k.device).expand(B, H, C).contiguous())
    selected = (rank < n_new[:, None, None]) & validh
    new_row = state.n_active[:, None, None] + rank                        # row of a selected token
    # candidates among the new rows: the selected tokens' own keys
    kk = kf @ kf.transpose(-1, -2)                                        # [B, H, C, C] (token i, token j)
    sq = (kf * kf).sum(-1)                                                # [B, H, C]
    score_new = kk - 0.5 * sq[:, :, None, :]
    score_new = torch.where(selected[:, :, None, :], score_new, torch.full_like(score_new, float("-inf")))
    # tie-break among new rows by row index (= rank order), then old rows win ties (lower index)
    key_rank = torch.where(selected, rank, torch.full_like(rank, C))
    best_new = score_new.max(-1, keepdim=True).values
    is_best = (score_new == best_new) & selected[:, :, None, :]
    cand_rank = torch.where(is_best, key_rank[:, :, None, :], torch.full_like(kk, C, dtype=torch.long))
    j_new = cand_rank.min(-1).values                                      # rank of best new row
    best_new = best_new.squeeze(-1)
    idx_new = state.n_active[:, None, None] + j_new
    use_new = (best_new > best_old) & (j_new < C)
    assign = torch.where(use_new, idx_new, idx_old)
    assign = torch.where(selected, new_row, assign)
    assign = torch.where(validh, assign, torch.full_like(assign, -1))
    return assign


def apply_assignments(state: OVQState, k: Tensor, v: Tensor, assign: Tensor, n_new: Tensor,
                      n_real: Tensor) -> OVQState:
    """Linear part: each token adds its key / value to its row's sums and 1 to its count.

    Differentiable in ``k``, ``v`` and the previous sums."""
    B, H, C, D = k.shape
    N = state.max_centroids
    ok = assign >= 0
    idx = torch.where(ok, assign, torch.zeros_like(assign))
    w = ok.to(torch.float32)
    m = torch.zeros(B, H, N, device=k.device, dtype=torch.float32).scatter_add_(-1, idx, w)
    sk = state.key_sums.scatter_add(2, idx[..., None].expand(B, H, C, D), k.float() * w[..., None])
    Dv = v.shape[-1]
    sv = state.value_sums.scatter_add(2, idx[..., None].expand(B, H, C, Dv), v.float() * w[..., None])
    return OVQState(key_sums=sk, value_sums=sv, counts=state.counts + m,
                    n_active=state.n_active + n_new, seen=state.seen + n_real)


def update_state(state: OVQState, k: Tensor, v: Tensor, valid: Tensor, max_centroids: int, growth: float,
                 old_stats=None) -> OVQState:
    """Absorb one chunk (``k``, ``v``: ``[B, H, C, D]``, ``valid``: ``[B, C]``) into the dictionary."""
    n_real = valid.sum(-1).to(torch.long)
    n_new = plan_growth(state.seen, state.n_active, n_real, max_centroids, growth)
    assign = select_and_assign(state, k.detach(), valid, n_new, old_stats)
    return apply_assignments(state, k, v, assign, n_new, n_real)


# ----------------------------------------------------------------------------------------------
# plain per-token loop reference of the update (for tests)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def update_state_loop(state: OVQState, k: Tensor, v: Tensor, valid: Tensor, max_centroids: int,
                      growth: float) -> OVQState:
    """Same update as :func:`update_state`, one token and one row at a time (float64, Python loops)."""
    B, H, C, D = k.shape
    keys = state.keys.double().clone()      # row means
    values = state.values.double().clone()
    counts = state.counts.double().clone()
    n_act = state.n_active.clone()
    seen = state.seen.clone()
    for b in range(B):
        real = [i for i in range(C) if bool(valid[b, i])]
        m = len(real)
        if m == 0:
            continue
        tgt = int(target_centroids(torch.tensor([int(seen[b]) + m]), max_centroids, growth)[0])
        n0 = int(n_act[b])
        n_new = max(0, min(tgt - n0, m))
        for h in range(H):
            kb = k[b, h].double()
            vb = v[b, h].double()
            # spread score of every real token against the existing rows
            spread = {}
            for i in real:
                best = float("-inf")
                for j in range(n0):
                    best = max(best, float(kb[i] @ keys[b, h, j]))
                spread[i] = best
            chosen = sorted(real, key=lambda i: (spread[i], i))[:n_new]
            row_of = {}
            for r, i in enumerate(chosen):
                row_of[i] = n0 + r
            # frozen rows for the assignment: old rows plus the new rows (their token's key)
            frozen = [keys[b, h, j].clone() for j in range(n0)] + [kb[i].clone() for i in chosen]
            for i in real:
                if i in row_of:
                    continue
                best, arg = float("-inf"), -1
                for j, d in enumerate(frozen):
                    s = float(kb[i] @ d) - 0.5 * float(d @ d)
                    if s > best:
                        best, arg = s, j
                row_of[i] = arg
            # incremental count-weighted means, one token at a time
            for i in real:
                j = row_of[i]
                c = counts[b, h, j] + 1.0
                keys[b, h, j] = keys[b, h, j] + (kb[i] - keys[b, h, j]) / c
                values[b, h, j] = values[b, h, j] + (vb[i] - values[b, h, j]) / c
                counts[b, h, j] = c
        n_act[b] = n0 + n_new
        seen[b] = seen[b] + m
    c = counts[..., None]
    return OVQState(key_sums=(keys * c).float(), value_sums=(values * c).float(), counts=counts.float(),
                    n_active=n_act, seen=seen)


# ----------------------------------------------------------------------------------------------
# chunk attention (reference)
# ----------------------------------------------------------------------------------------------
def chunk_attention_ref(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, n_dict: int, q_off: int) -> Tensor:
    """One softmax over ``n_dict`` dictionary rows followed by the chunk's own keys (causal).

    ``q``: ``[B, Hq, M, D]`` (scaled); ``k``: ``[B, H, n_dict + L, D]``; ``v``: ``[B, H, n_dict + L, Dv]``;
    ``bias``: ``[B, H, n_dict + L]`` float (log counts for the dictionary, 0 / -inf for chunk keys).
    Query ``r`` sits at chunk position ``r + q_off`` and sees chunk keys at positions ``<= r + q_off``.
    Rows that see no key give 0.  Returns ``[B, Hq, M, Dv]`` in ``q.dtype`` (computed in float32).
    """
    B, Hq, M, D = q.shape
    H = k.shape[1]
    g = Hq // H
    kf = k.float().repeat_interleave(g, 1)
    vf = v.float().repeat_interleave(g, 1)
    bf = bias.float().repeat_interleave(g, 1)
    s = q.float() @ kf.transpose(-1, -2) + bf[:, :, None, :]
    L = k.shape[2] - n_dict
    pos_q = torch.arange(M, device=q.device)[:, None] + q_off
    pos_k = torch.arange(L, device=q.device)[None, :]
    allowed = torch.cat([torch.ones(M, n_dict, dtype=torch.bool, device=q.device), pos_k <= pos_q], dim=1)
    s = s.masked_fill(~allowed, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(s - mx)
    l = p.sum(-1, keepdim=True)
    o = (p @ vf) / l.clamp_min(1e-30)
    return o.to(q.dtype)


def exact_causal_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None = None) -> Tensor:
    """Plain causal softmax attention (scaled ``q``), GQA, key padding: ``[B, Hq, S, Dv]``."""
    B, Hq, S, D = q.shape
    g = Hq // k.shape[1]
    kf = k.float().repeat_interleave(g, 1)
    vf = v.float().repeat_interleave(g, 1)
    s = q.float() @ kf.transpose(-1, -2)
    allowed = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()[None, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(s - mx)
    return ((p @ vf) / p.sum(-1, keepdim=True).clamp_min(1e-30)).to(q.dtype)


def merge_keys(state: OVQState, k: Tensor, v: Tensor, valid: Tensor, n_dict: int, dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Concatenate the first ``n_dict`` dictionary rows (means) with a chunk's keys / values; build the bias."""
    bias_d = state.bias()[:, :, :n_dict]
    B, H = k.shape[:2]
    bias_c = torch.where(valid, 0.0, float("-inf")).to(torch.float32)[:, None, :].expand(B, H, -1)
    c = state.counts[:, :, :n_dict].clamp_min(1.0)[..., None]
    kk = torch.cat([(state.key_sums[:, :, :n_dict] / c).to(dtype), k.to(dtype)], dim=2)
    vv = torch.cat([(state.value_sums[:, :, :n_dict] / c).to(dtype), v.to(dtype)], dim=2)
    return kk, vv, torch.cat([bias_d, bias_c], dim=2).contiguous()
