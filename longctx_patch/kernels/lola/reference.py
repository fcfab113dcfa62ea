"""PyTorch references of the LoLCATs hybrid attention and of the LoLA sparse-cache manager.

Everything here is differentiable (plain torch ops) and runs on any device; the Triton kernels
(`triton_hybrid.py`, `triton_state.py`, `triton_evict.py`) must match these functions. Maths and every
convention: docs/lola.md. The settings of a whole-sequence hybrid call travel as one `HybridSpec`, what one
attention call reads as `HybridKeys` and `HybridRule`.

Shapes (the convention of the whole package):
  q, fq          [B, Hq, S, D] / [B, Hq, S, F2]   queries and their features (F2 = 2 * feature_dim)
  k, v           [B, Hkv, N, D]                   keys / values (GQA: Hq % Hkv == 0)
  fk             [B, Hq, N, F2]                   key features: one map per *query* head (keys repeated)
  g, lf          [Hq]                             weights of the exact (softmax) and linear terms
  H, s           [B, Hq, F2, D] / [B, Hq, F2]     linear state, fp32
  key_mask       [B, N] bool (True = real token) or None
  sparse_k/v     [B, Hs, L, D]                    LoLA sparse cache: Hs = Hkv (one cache per kv head, shared by
                                                  its query heads) or Hq (one per query head); Hq % Hs == 0
"""

from __future__ import annotations

import math
import numbers
from collections import namedtuple
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..backend import check_backend
from .tuning import DEFAULT_TUNING, LolaTuning

EPS_SRE = 1e-6  # denominator guard of the self-recall prediction phi(k)^T H / (phi(k)^T s + EPS_SRE)
NEG = -1.0e30  # finite "minus infinity" for running maxima (keeps exp(m_old - m_new) finite)


def expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    """[B, Hkv, ...] -> [B, Hq, ...] (query head h reads kv head h // (Hq // Hkv))."""
    if x.shape[1] == hq:
        return x
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def linear_rows(q_offset: int, S: int, window: int) -> int:
    """Local keys that some of the S queries (at key indices q_offset .. q_offset + S - 1) attend linearly:
    the first max(q_offset + S - window, 0). Only these need phi(k)."""
    return max(q_offset + S - window, 0)


def feature_rows(fk: torch.Tensor, q_offset: int, S: int, window: int) -> int:
    """NF, the local keys fk [B, H, NF, F2] has features of; refuses fewer than the keys attended linearly."""
    NF, needed = fk.shape[2], linear_rows(q_offset, S, window)
    if NF < needed:
        raise ValueError(f"key features cover {NF} local keys but {needed} are attended linearly")
    return NF


def pad_features(fk: torch.Tensor, N: int, q_offset, S: int, window: int) -> torch.Tensor:
    """fk [B, H, NF, F2] -> [B, H, N, F2] with zero rows after NF (checked by `feature_rows` when q_offset is a host
    integer; a device q_offset (a decode step on device state) takes features of every row)."""
    if fk.shape[2] >= N:
        return fk
    NF = feature_rows(fk, q_offset, S, window)
    return torch.nn.functional.pad(fk, (0, 0, 0, N - NF))


def group_sum(x: torch.Tensor, hs: int) -> torch.Tensor:
    """[B, Hq, ...] -> [B, hs, ...]: the sum over the Hq // hs query heads that share a head (h // (Hq // hs))."""
    B, Hq = x.shape[:2]
    if Hq == hs:
        return x
    return x.view(B, hs, Hq // hs, *x.shape[2:]).sum(2)


def hedgehog_feature_map(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-12, out_dtype=None) -> torch.Tensor:
    """phi(x) = [softmax(x W), softmax(-x W)] per head, clamped below at `eps` (as LoLCATs does).

    x [B, Hx, N, D] with Hx == H or H % Hx == 0 (kv heads are repeated), weight [H, D, F].
    Computed in fp32; returned in `out_dtype` (default x.dtype). Returns [B, H, N, 2F].
    """
    h = weight.shape[0]
    x = expand_kv(x, h)
    proj = torch.einsum("bhnd,hdf->bhnf", x.float(), weight.float())
    phi = torch.cat([torch.softmax(proj, dim=-1), torch.softmax(-proj, dim=-1)], dim=-1).clamp_min(eps)
    return phi.to(out_dtype or x.dtype)


COMBINES = ("shifted", "unshifted")


def row_max(sc, combine: str = "shifted"):
    """The row maximum m of the exact scores sc [..., N] (0 for a row without an exact key), [..., 1]. With
    combine="unshifted" the output does not depend on m (it only keeps exp finite): m is detached, so no gradient
    flows through it; with "shifted" (LoLCATs) the output depends on m and the gradient does."""
    m = sc.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m.detach() if combine == "unshifted" else m


def _finish(num_e, den_e, num_l, den_l, g, lf, m=None):
    """(g num_e + lf num_l) / (g den_e + lf den_l); rows with a zero normaliser (padding) give 0.

    num_e / den_e are the exact sums with the row max m subtracted (exp(s - m)). m None: combined as they are
    (`combine="shifted"`, LoLCATs' convention). m given [.., 1] (`combine="unshifted"`, the LoLA authors'): the exact
    term is exp(s) as is, i.e. the linear term weighs exp(-m) of the shifted one; computed as exact weight
    exp(min(m, 0)) and linear weight exp(-max(m, 0)) (their ratio is exp(m), neither overflows), both divided by the
    larger of the two that the row uses (a row without linear keys, den_l 0, uses the exact one alone): a row whose
    exact scores all lie far below 0 (m < -87) would otherwise get a normaliser that underflows fp32, an output of 0
    or, just above that, a gradient of inf / nan through den ** 2."""
    g = g.float().view(1, -1, 1, 1)
    lf = lf.float().view(1, -1, 1, 1)
    if m is not None:
        me, ml = m.float().clamp_max(0.0), -m.float().clamp_min(0.0)
        c = torch.where(den_l > 0, torch.maximum(me, ml), me).detach()  # the output does not depend on it
        g = g * torch.exp(me - c)
        lf = lf * torch.exp((ml - c).clamp_max(0.0))  # clamped only where den_l is 0 (no linear term to weigh)
    num = g * num_e + lf * num_l
    den = g * den_e + lf * den_l
    return num / torch.where(den > 0, den, torch.ones_like(den))


def check_combine(combine: str) -> bool:
    """Whether `combine` is "unshifted" (the LoLA authors' combination); ValueError for an unknown one."""
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, not {combine!r}")
    return combine == "unshifted"


def check_ints(spec, **least: int) -> None:
    """ValueError naming the first of the fields `least` of the settings object `spec` that is not an int at least
    its bound (`least`: field name -> the smallest value allowed)."""
    for name, low in least.items():
        n = getattr(spec, name)
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < low:
            raise ValueError(f"{type(spec).__name__}.{name}={n!r}: allowed an int >= {low}")


def check_scale(spec) -> None:
    """ValueError when `spec.scale` is neither None (D ** -0.5) nor a positive number."""
    x = spec.scale
    if x is not None and (not isinstance(x, numbers.Real) or isinstance(x, bool) or not x > 0):
        raise ValueError(f"{type(spec).__name__}.scale={x!r}: allowed None (D ** -0.5) or a number > 0")


@dataclass(frozen=True)
class HybridSpec:
    """The settings of one whole-sequence hybrid attention (`ops.hybrid_attention`, `ops.hybrid_attention_triton`,
    `hybrid_attention_quadratic`, `hybrid_attention_chunked`): the same for every call of a layer; the tensors (q, k,
    v, fq, fk, g, lf, key_mask) are passed beside it.

    window: keys less than `window` behind a query are attended by softmax, older ones linearly (an int >= 0).
    scale: the scores' factor (None: D ** -0.5). combine: how the exact and linear terms meet (`_finish`): "shifted"
    (LoLCATs) or "unshifted" (the LoLA authors'). chunk: queries per block of the PyTorch path
    (`hybrid_attention_chunked`). state_chunk: keys per prefix state of the Triton paths (None: `ops.STATE_CHUNK`,
    under gradients `tuning.train_state_chunk` first); `ops.hybrid_attention` rounds it down to a multiple of 64 (at
    least 64), `ops.hybrid_attention_triton` takes it as it is (a multiple of its key tile). backend: "auto"
    (Triton on CUDA, PyTorch elsewhere), "triton" or "torch" (`ops.hybrid_attention`'s choice; the references run
    PyTorch whatever it says). tuning: the kernels' launch settings (`tuning.LolaTuning`; the training pass's state
    chunk and tiles: `train_*`).

    Refused when built: a window, chunk or state_chunk that is no int in range, a scale that is no positive number
    (ValueError), an unknown combine (ValueError) or backend (ConfigError), a tuning that is no LolaTuning
    (TypeError)."""

    window: int
    scale: float | None = None
    combine: str = "shifted"
    chunk: int = 64
    state_chunk: int | None = None
    backend: str = "auto"
    tuning: LolaTuning = DEFAULT_TUNING

    def __post_init__(self):
        check_ints(self, window=0, chunk=1)
        if self.state_chunk is not None:
            check_ints(self, state_chunk=1)
        check_scale(self)
        check_combine(self.combine)
        check_backend(self.backend, "lola/lolcats")
        if not isinstance(self.tuning, LolaTuning):
            raise TypeError(f"HybridSpec.tuning: a LolaTuning (kernels/lola/tuning.py), not "
                            f"{type(self.tuning).__name__}")

    def rule(self, g, lf) -> HybridRule:
        """The hybrid attention's rule (`HybridRule`) of these settings with the per-head weights g and lf."""
        return HybridRule(self.window, g, lf, self.scale, self.combine)


def hybrid_attention_quadratic(q, k, v, fq, fk, g, lf, spec: HybridSpec, *, key_mask=None):
    """Ground truth of the LoLCATs hybrid, O(S * N) memory; returns [B, Hq, S, D] fp32.

    Query i sits at key index N - S + i (the queries are the last keys; `lola_attention` takes any offset and a
    linear state of tokens before key 0). Key j is in the softmax window of query i when 0 <= i' - j < window
    (i' = N - S + i), in the linear part when i' - j >= window. The exact term uses exp(score - m) with m the row
    maximum over the window keys (LoLCATs' convention: the linear term is *not* rescaled by m).
    spec.combine="unshifted": the exact term is exp(score) as is (the LoLA authors' code), `_finish`. spec: window,
    scale and combine (`HybridSpec`).
    """
    window, scale, combine = spec.window, spec.scale, spec.combine
    unshifted = check_combine(combine)
    B, Hq, S, D = q.shape
    N = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k, v = expand_kv(k, Hq).float(), expand_kv(v, Hq).float()
    qpos = torch.arange(S, device=q.device)[:, None] + (N - S)
    kpos = torch.arange(N, device=q.device)[None, :]
    diff = qpos - kpos
    win = (diff >= 0) & (diff < window)
    lin = diff >= window
    win, lin = win[None, None], lin[None, None]
    if key_mask is not None:
        km = key_mask.bool()[:, None, None, :]
        win, lin = win & km, lin & km
    sc = torch.einsum("bhsd,bhnd->bhsn", q.float(), k) * scale
    sc = sc.masked_fill(~win, float("-inf"))
    m = row_max(sc, combine)
    p = torch.exp(sc - m)
    a = torch.einsum("bhsf,bhnf->bhsn", fq.float(), fk.float()) * lin
    num_e, den_e = p @ v, p.sum(-1, keepdim=True)
    num_l, den_l = a @ v, a.sum(-1, keepdim=True)
    return _finish(num_e, den_e, num_l, den_l, g, lf, m if unshifted else None)


def hybrid_attention_chunked(q, k, v, fq, fk, g, lf, spec: HybridSpec, *, key_mask=None):
    """Same result as `hybrid_attention_quadratic` (S == N) in O(S * (window + chunk)) memory.

    Queries are cut into blocks of `chunk`; block n reads a prefix state (sum of phi(k) v^T over keys
    before (n - P) * chunk, P = ceil(window / chunk)) and the P + 1 key blocks n-P..n explicitly.
    Differentiable: this is the training / CPU path of `lolcats`. spec: window, scale, combine and chunk
    (`HybridSpec`). Returns [B, Hq, S, D] fp32.
    """
    window, scale, combine, chunk = spec.window, spec.scale, spec.combine, spec.chunk
    unshifted = check_combine(combine)
    B, Hq, S, D = q.shape
    F2 = fq.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    C = chunk
    P = max(1, math.ceil(window / C))
    NB = math.ceil(S / C)
    pad = NB * C - S
    kx, vx = expand_kv(k, Hq).float(), expand_kv(v, Hq).float()
    km = torch.ones(B, S, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.bool()

    def padr(x, front=0):  # pad the sequence dim (dim 2) to NB * C, plus `front` zero rows in front
        return torch.nn.functional.pad(x, (0, 0, front, pad))

    qf, fqf = padr(q.float()), padr(fq.float())
    kf, vf, fkf = padr(kx), padr(vx), padr(fk.float())
    kmf = torch.nn.functional.pad(km, (0, pad), value=False)
    fkm = fkf * kmf[:, None, :, None]
    # prefix states: Hc[n] = sum over blocks < n  -> [B, Hq, NB, F2, D]
    blk_h = torch.einsum("bhncf,bhncd->bhnfd", fkm.view(B, Hq, NB, C, F2), vf.view(B, Hq, NB, C, D))
    blk_s = fkm.view(B, Hq, NB, C, F2).sum(3)
    Hc = torch.cumsum(blk_h, 2) - blk_h
    sc_ = torch.cumsum(blk_s, 2) - blk_s
    idx = torch.arange(NB, device=q.device) - P
    valid = (idx >= 0)
    idxc = idx.clamp_min(0)
    Hn = Hc[:, :, idxc] * valid.view(1, 1, NB, 1, 1)
    sn = sc_[:, :, idxc] * valid.view(1, 1, NB, 1)
    # local keys: blocks n-P..n  -> [B, Hq, NB, (P+1)C, *]
    front = P * C

    def local(x):
        xp = torch.nn.functional.pad(x, (0, 0, front, 0))
        return xp.unfold(2, (P + 1) * C, C).transpose(-1, -2)  # [B, Hq, NB, (P+1)C, *]

    kl, vl, fkl = local(kf), local(vf), local(fkf)
    kml = torch.nn.functional.pad(kmf, (front, 0), value=False).unfold(1, (P + 1) * C, C)  # [B, NB, (P+1)C]
    qb = qf.view(B, Hq, NB, C, D)
    fqb = fqf.view(B, Hq, NB, C, F2)
    qpos = torch.arange(C, device=q.device)[:, None] + front  # query i of a block at local index P*C + i
    kpos = torch.arange((P + 1) * C, device=q.device)[None, :]
    diff = qpos - kpos
    win = ((diff >= 0) & (diff < window))[None, None, None] & kml[:, None, :, None, :]
    lin = (diff >= window)[None, None, None] & kml[:, None, :, None, :]
    sc = torch.einsum("bhncd,bhnkd->bhnck", qb, kl) * scale
    sc = sc.masked_fill(~win, float("-inf"))
    m = row_max(sc, combine)
    p = torch.exp(sc - m)
    a = torch.einsum("bhncf,bhnkf->bhnck", fqb, fkl) * lin
    num_e, den_e = p @ vl, p.sum(-1, keepdim=True)
    num_l = a @ vl + fqb @ Hn
    den_l = a.sum(-1, keepdim=True) + (fqb * sn[:, :, :, None, :]).sum(-1, keepdim=True)
    o = _finish(num_e.flatten(2, 3), den_e.flatten(2, 3), num_l.flatten(2, 3), den_l.flatten(2, 3), g, lf,
                m.flatten(2, 3) if unshifted else None)
    return o[:, :, :S]


# ----------------------------------------------------------------------------------------------- LoLA pieces
class SparseSet(NamedTuple):
    """A LoLA sparse cache as the hybrid attention reads it: k/v [B, Hs, L, D], Hq % Hs == 0 (query head h reads set
    h // (Hq // Hs)), and which slots hold a pair, one of: valid [B, Hs, L] bool (empty slots False), or score
    [B, Hs, L] fp32, the cache's own scores (`LolaState.sp_score`: -inf for an empty slot), which
    `triton_hybrid.decode_step` reads in the kernel (no conversion launched per step). `triton_hybrid.hybrid_fwd`
    also reads one set per chunk of keys, k/v [B, Hs, NC, L, D] and valid [B, Hs, NC, L] (`HybridKeys.sparse_chunk`).
    """

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor | None = None
    score: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """The slots that hold a pair: `valid` as given, else `score > -inf`."""
        return self.valid if self.valid is not None else self.score > float("-inf")


@dataclass(frozen=True, eq=False)
class HybridKeys:
    """What the queries of one hybrid attention call attend (`lola_attention`, `triton_hybrid.hybrid_fwd`).

    k/v [B, Hkv, N, D]: the local keys, query i at local key index `q_offset` + i (None: N - S, the queries are the
    last keys); a `lola_attention` q_offset may be a tensor of one element (a decode step whose buffered count is
    device state: keys past the query are then out of its reach). fk [B, Hq, NF, F2]: features of the first NF local
    keys; NF may be below N but must cover every key some query attends linearly (index < q_offset + S - window,
    `linear_rows`). key_mask [B, N] bool or None. H/s [B, Hq, F2, D] / [B, Hq, F2] fp32: the linear state of the
    tokens before key 0; with `state_chunk` > 0 (hybrid_fwd only) per-block prefix states [B, Hq, NS, F2, D] /
    [B, Hq, NS, F2]: a block of queries starting at key index a reads state max(a - window, 0) // state_chunk and
    explicit keys from there; None only for the whole-sequence backward (`triton_hybrid_bwd.hybrid_bwd`, which
    recomputes the prefix states). sparse: the sparse cache (None: none); with `sparse_chunk` > 0 (hybrid_fwd only) one
    set per chunk, the block of queries starting at key index a reading set a // sparse_chunk."""

    k: torch.Tensor
    v: torch.Tensor
    fk: torch.Tensor
    H: torch.Tensor | None
    s: torch.Tensor | None
    key_mask: torch.Tensor | None = None
    q_offset: "int | torch.Tensor | None" = None
    sparse: SparseSet | None = None
    state_chunk: int = 0
    sparse_chunk: int = 0

    def __post_init__(self):
        if self.sparse is not None and not isinstance(self.sparse, SparseSet):
            raise TypeError(f"HybridKeys.sparse: a SparseSet(k, v, valid) or None, not {type(self.sparse).__name__}")
        if self.sparse is not None and (self.sparse.valid is None) == (self.sparse.score is None):
            raise ValueError("HybridKeys.sparse: a SparseSet with its slots' valid mask or their scores (one of them)")
        for name in ("state_chunk", "sparse_chunk"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"HybridKeys.{name}={n!r}: an int >= 0 (0: one for every query)")

    def check_states(self, what: str) -> None:
        """`what` reads the linear state: a ValueError when H or s is None."""
        if self.H is None or self.s is None:
            raise ValueError(f"{what} reads the linear state: HybridKeys.H and .s are tensors (None only for "
                             "hybrid_bwd, which recomputes the prefix states)")

    @property
    def has_sparse(self) -> bool:
        return self.sparse is not None and self.sparse.k.shape[-2] > 0


@dataclass(frozen=True, eq=False)
class HybridRule:
    """How the hybrid attention makes its output of what the queries attend: local keys less than `window` behind a
    query by softmax of their scores times `scale` (None: D ** -0.5), older ones linearly through the features, the
    exact terms (window and sparse cache) weighed by g [Hq], the linear ones by lf [Hq], combined as `combine` says
    ("shifted", LoLCATs: the linear term against exp(s - m); "unshifted", the LoLA authors': against exp(s);
    `_finish`). `state.LolaRun.rule(g, lf)` gives a layer's."""

    window: int
    g: torch.Tensor
    lf: torch.Tensor
    scale: float | None = None
    combine: str = "shifted"

    def __post_init__(self):
        check_combine(self.combine)


def lola_attention(q, fq, keys: HybridKeys, rule: HybridRule):
    """Hybrid attention of the queries q/fq [B, Hq, S, D / F2] against `keys`: the local keys (window softmax /
    linear by distance), a sparse cache of exact keys (softmax, weight g) and a linear state (H, s), as `rule` says.
    One normaliser; the running max m is taken over all exact keys (window and sparse). Returns [B, Hq, S, D] fp32."""
    if keys.state_chunk or keys.sparse_chunk:
        raise ValueError("lola_attention reads one linear state and one sparse set (state_chunk = sparse_chunk = 0); "
                         "per-block states and per-chunk sets are hybrid_fwd's")
    keys.check_states("lola_attention")
    unshifted = check_combine(rule.combine)
    k, v, window = keys.k, keys.v, rule.window
    B, Hq, S, D = q.shape
    N = k.shape[2]
    scale = D ** -0.5 if rule.scale is None else rule.scale
    q_offset = N - S if keys.q_offset is None else keys.q_offset
    fk = pad_features(keys.fk, N, q_offset, S, window)
    kx, vx = expand_kv(k, Hq).float(), expand_kv(v, Hq).float()
    qpos = torch.arange(S, device=q.device)[:, None] + q_offset
    kpos = torch.arange(N, device=q.device)[None, :]
    diff = qpos - kpos
    win = ((diff >= 0) & (diff < window))[None, None]
    lin = (diff >= window)[None, None]
    if keys.key_mask is not None:
        km = keys.key_mask.bool()[:, None, None, :]
        win, lin = win & km, lin & km
    sc = torch.einsum("bhsd,bhnd->bhsn", q.float(), kx) * scale
    sc = sc.masked_fill(~win, float("-inf"))
    vals = vx
    if keys.has_sparse:
        sp = keys.sparse
        ss = torch.einsum("bhsd,bhld->bhsl", q.float(), expand_kv(sp.k, Hq).float()) * scale
        ss = ss.masked_fill(~expand_kv(sp.mask().bool(), Hq)[:, :, None, :], float("-inf"))
        sc = torch.cat([ss, sc], dim=-1)
        vals = torch.cat([expand_kv(sp.v, Hq).float(), vx], dim=2)
    m = row_max(sc, rule.combine)
    p = torch.exp(sc - m)
    a = torch.einsum("bhsf,bhnf->bhsn", fq.float(), fk.float()) * lin
    num_e, den_e = p @ vals, p.sum(-1, keepdim=True)
    num_l = a @ vx + fq.float() @ keys.H.float()
    den_l = a.sum(-1, keepdim=True) + (fq.float() * keys.s.float()[:, :, None, :]).sum(-1, keepdim=True)
    return _finish(num_e, den_e, num_l, den_l, rule.g, rule.lf, m if unshifted else None)


def sre_scores(fk, v, H, s, eps: float = EPS_SRE):
    """Self-recall error || phi(k)^T H / (phi(k)^T s + eps) - v || per pair (the norm, as LoLA's authors score it:
    per query head only the order matters, but one sparse cache per kv head sums it over its query heads).

    fk [B, Hq, N, F2], v [B, Hv, N, D] (Hq % Hv == 0), H [B, Hq, F2, D], s [B, Hq, F2] -> [B, Hq, N] fp32.
    """
    fk = fk.float()
    v = expand_kv(v, fk.shape[1])
    pred = (fk @ H.float()) / ((fk * s.float()[:, :, None, :]).sum(-1, keepdim=True) + eps)
    return ((v.float() - pred) ** 2).sum(-1).sqrt()


def fold(fk, v, w, H, s):
    """H + sum_j w_j phi(k_j) v_j^T, s + sum_j w_j phi(k_j) (fp32). fk [B,Hq,N,F2], v [B,Hv,N,D], w [B,Hw,N]
    (Hw = 1 or Hq % Hw == 0: query head h uses the weights of h // (Hq / Hw))."""
    v = expand_kv(v, fk.shape[1])
    if w.shape[1] != 1:
        w = expand_kv(w, fk.shape[1])
    fkw = fk.float() * w.float()[..., None]
    return H.float() + fkw.transpose(-1, -2) @ v.float(), s.float() + fkw.sum(2)


TopLam = namedtuple("TopLam", ["values", "indices"])


def top_lam(scores, lam: int) -> TopLam:
    """The lam highest scores along the last axis, sorted, ties to the lowest index (a stable sort:
    `torch.topk` leaves the order of equal scores to the device and build). Returns (values, indices).
    Equal SRE scores happen, e.g. for pairs with equal values while the state is still empty; every backend
    (this reference, the chunk loop, the radix select of the two-pass prefill) keeps the same pairs."""
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return TopLam(vals[..., :lam], idx[..., :lam])


def select_and_fold(cand_k, cand_v, cand_fk, cand_valid, H, s, lam: int):
    """One LoLA eviction step (reference of `ops.lola_evict`).

    Candidates = the sparse slots followed by the pairs leaving the window, per sparse head (Hs = Hkv or Hq):
    cand_k/v [B, Hs, Nc, D], cand_valid [B, Hs, Nc] bool, cand_fk [B, Hq, Nc, F2] (phi(k) under each query
    head's feature map). Every valid candidate is scored by SRE against the *current* (H, s) of each query
    head; a candidate's score is the sum over the query heads that read its sparse head. The `lam` highest
    stay exact (new sparse slots, sorted by score; empty slots have score -inf), the other valid ones are
    folded into (H, s) of every query head of the group.
    Returns (sparse_k, sparse_v, sparse_score, H, s) with lam slots (padded with empty ones).
    """
    Hq, Hs = cand_fk.shape[1], cand_k.shape[1]
    scores = group_sum(sre_scores(cand_fk, cand_v, H, s), Hs).masked_fill(~cand_valid, float("-inf"))
    lam_eff = min(lam, scores.shape[-1])
    top = top_lam(scores, lam_eff)
    keep = torch.zeros_like(cand_valid)
    keep.scatter_(-1, top.indices, True)
    w = expand_kv((cand_valid & ~keep).float(), Hq)
    H2, s2 = fold(cand_fk, cand_v, w, H, s)
    idx = top.indices
    gk = torch.gather(cand_k, 2, idx[..., None].expand(-1, -1, -1, cand_k.shape[-1]))
    gv = torch.gather(cand_v, 2, idx[..., None].expand(-1, -1, -1, cand_v.shape[-1]))
    gsc = top.values
    if lam_eff < lam:  # pad to lam empty slots
        padn = lam - lam_eff
        gk = torch.nn.functional.pad(gk, (0, 0, 0, padn))
        gv = torch.nn.functional.pad(gv, (0, 0, 0, padn))
        gsc = torch.nn.functional.pad(gsc, (0, padn), value=float("-inf"))
    return gk, gv, gsc, H2, s2
