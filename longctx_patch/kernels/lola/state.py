"""The LoLA decode state (`LolaState`) and the operations on it: appending to the window buffer, attending a piece
of new tokens, evicting (score with self-recall error, keep the `lam` best, fold the rest into the linear state)
and dropping the front of the buffer. The state machine that sequences them is `sparse_cache.py`.

Feature cache: an in-place state (no gradients: decode, no-grad prefill) keeps phi(k) of the buffered keys that
have left the window (the first nb - window rows of the buffer, at most `chunk`) in `win_fk`, computed once per
key when it leaves the window (`phi_k`, the layer's key feature map), shifted with the window buffer; the linear
attention to buffered keys and an eviction's window candidates read it instead of recomputing phi of up to
`chunk` keys per step. An out-of-place state (gradients) keeps no feature cache and recomputes phi(k) where it is
needed, differentiably. Phi of the sparse cache's keys is recomputed at each eviction. The sparse cache has one
slot set per kv head (shared by its query heads, scored by the sum of their SRE) or per query head.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

from ..backend import check_backend
from . import ops
from . import reference as ref
from .tuning import DEFAULT_TUNING, LolaTuning


@dataclass(frozen=True)
class StateSizes:
    """The sizes of one layer's LoLA state (`LolaState.empty`, `prefill.parallel_prefill_bytes`): `batch` rows,
    `q_heads` query heads and `kv_heads` kv heads (q_heads a multiple of kv_heads), `head_dim` (D), `features` (F2 =
    2 * feature_dim, the width of phi), `lam` sparse pairs per sparse head (0: LoLCATs) and `sparse_heads`, the
    heads of the sparse cache: kv_heads (None, the default: one cache per kv head) or q_heads. Refused when built
    (ValueError): a size that is no int in range, q_heads no multiple of kv_heads, sparse_heads neither head count."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    features: int
    lam: int
    sparse_heads: int | None = None

    def __post_init__(self):
        ref.check_ints(self, batch=0, q_heads=1, kv_heads=1, head_dim=1, features=1, lam=0)
        if self.q_heads % self.kv_heads:
            raise ValueError(f"StateSizes: q_heads={self.q_heads} must be a multiple of kv_heads={self.kv_heads}")
        hs = self.sparse_heads
        if hs is not None and (isinstance(hs, bool) or hs not in (self.kv_heads, self.q_heads)):
            raise ValueError(f"StateSizes.sparse_heads={hs!r}: allowed None or the kv heads ({self.kv_heads}), or "
                             f"the query heads ({self.q_heads})")

    @property
    def sparse_head_count(self) -> int:
        """Hs: the heads of the sparse cache (kv_heads when `sparse_heads` is None)."""
        return self.kv_heads if self.sparse_heads is None else int(self.sparse_heads)


@dataclass
class LolaState:
    """Decode-time state of one layer. Sizes are fixed: the window buffer has room for window + chunk tokens.

    win_k/win_v [B, Hkv, cap, D], win_mask [B, cap] bool or None (no padding so far): the first `nb` rows are
    the buffered tokens, oldest first (positions pos - nb .. pos - 1);
    sp_k/sp_v [B, Hs, lam, D], sp_score [B, Hs, lam] fp32 (-inf = empty slot) with Hs = Hkv (one sparse cache
    per kv head) or Hq (one per query head); H [B, Hq, F2, D] fp32, s [B, Hq, F2] fp32; pos: tokens seen
    (padding included). win_fk [B, Hq, cap - window, F2] (in-place states with `feature_cache`, else None): phi(k)
    of the buffered keys older than the window, rows 0 .. nb - window - 1 (`ensure_fk`); None: `phi_k` recomputes
    it where it is needed.
    nb_t [B] int64 (in-place states): `nb` on the device, every row alike, what a decode step replayed from a CUDA
    graph reads and moves (`sparse_cache.decode_step`); equal to `nb` after every `lola_process` call made outside a
    capture (`sparse_cache.lola_process` refreshes it), moved on by the recorded steps themselves inside one.
    `inplace=False` (set when gradients flow) replaces every in-place buffer write by a concatenation.
    phases: None (every row evicts when `pos` reaches a multiple of `chunk`: no padding, or padding of whole
    chunks only) or the rows' own eviction grid (`RowPhases`, a left-padded batch; see `lola_process`).
    """

    win_k: torch.Tensor
    win_v: torch.Tensor
    win_mask: torch.Tensor | None
    sp_k: torch.Tensor
    sp_v: torch.Tensor
    sp_score: torch.Tensor
    H: torch.Tensor
    s: torch.Tensor
    win_fk: torch.Tensor | None = None
    nb_t: torch.Tensor | None = None
    feature_cache: bool = False
    pos: int = 0
    nb: int = 0
    inplace: bool = True
    phases: "RowPhases | None" = None  # noqa: F821 - padded.RowPhases (padded.py imports this module)

    @classmethod
    def empty(cls, sizes: StateSizes, dtype, device, *, capacity: int = 0, inplace: bool = True,
              feature_cache: bool = False):
        """An empty state of `sizes` (`StateSizes`: batch, heads, head dim, feature width, sparse pairs and heads),
        its keys and values in `dtype` on `device`. capacity: rows of the window buffer (in-place states; window +
        chunk, or 0: made by the first `lola_process` call). The feature cache is made by the first `lola_process`
        call (`ensure_fk`: its rows depend on the window)."""
        B, Hq, Hkv, D, F2, lam = sizes.batch, sizes.q_heads, sizes.kv_heads, sizes.head_dim, sizes.features, sizes.lam
        Hs = sizes.sparse_head_count
        z = lambda *shape, dt=dtype: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        cap = capacity if inplace else 0
        return cls(
            win_k=z(B, Hkv, cap, D), win_v=z(B, Hkv, cap, D), win_mask=None,
            sp_k=z(B, Hs, lam, D), sp_v=z(B, Hs, lam, D),
            sp_score=torch.full((B, Hs, lam), float("-inf"), dtype=torch.float32, device=device),
            H=z(B, Hq, F2, D, dt=torch.float32), s=z(B, Hq, F2, dt=torch.float32),
            win_fk=None, nb_t=torch.zeros(B, dtype=torch.long, device=device) if inplace else None,
            feature_cache=feature_cache, pos=0, nb=0, inplace=inplace,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def sp_valid(self) -> torch.Tensor:
        return torch.isfinite(self.sp_score)

    # views of the buffered tokens
    @property
    def wk(self):
        return self.win_k[:, :, : self.nb]

    @property
    def wv(self):
        return self.win_v[:, :, : self.nb]

    @property
    def wmask(self):
        return None if self.win_mask is None else self.win_mask[:, : self.nb]


PhiK = Callable[[torch.Tensor], torch.Tensor]  # keys [B, Hx, N, D] (Hq % Hx == 0) -> phi(k) [B, Hq, N, F2]


@dataclass(frozen=True)
class KeyFeatures:
    """A layer's key feature map that can also write phi(k) into a given buffer: `compute(k)` returns phi(k) (a PhiK);
    `write(k, out)` writes it into `out` (a [B, Hq, N, F2] view, e.g. rows of the feature cache) without a copy.
    Wherever the state machine takes a PhiK, a KeyFeatures may come instead (`phi_into` then writes directly)."""

    compute: PhiK
    write: Callable[[torch.Tensor, torch.Tensor], object]

    def __call__(self, k: torch.Tensor) -> torch.Tensor:
        return self.compute(k)


def phi_into(phi_k: PhiK, k, dst) -> None:
    """dst <- phi_k(k): written directly by a KeyFeatures, else computed and copied."""
    if isinstance(phi_k, KeyFeatures):
        phi_k.write(k, dst)
    else:
        dst.copy_(phi_k(k))


@dataclass(frozen=True)
class LolaRun:
    """What every step of one layer's LoLA attention runs with (the state machine of sparse_cache.py, the prefills of
    prefill.py, the operations here): the key feature map `phi_k` (a PhiK or a KeyFeatures), `window`, `chunk`,
    `lam` (sparse pairs per sparse head; 0: LoLCATs), `scale` (None: D ** -0.5), `backend` ("auto", "triton",
    "torch"), `combine` ("shifted" or "unshifted": `reference._finish`) and the kernels' `tuning`. The same for every
    call of a layer; what changes per call (the state, the new tokens, their padding) is passed beside it. Refused
    when built: a phi_k that is not callable or a tuning that is no LolaTuning (TypeError), a window, chunk or lam
    that is no int in range, a scale that is no positive number, an unknown combine (ValueError) or backend
    (ConfigError)."""

    phi_k: PhiK
    window: int
    chunk: int
    lam: int
    scale: float | None
    backend: str = "auto"
    combine: str = "shifted"
    tuning: LolaTuning = DEFAULT_TUNING

    def __post_init__(self):
        if not callable(self.phi_k):
            raise TypeError(f"LolaRun.phi_k: the key feature map, a callable (keys -> phi(k)) or a KeyFeatures, not "
                            f"{type(self.phi_k).__name__}")
        ref.check_ints(self, window=0, chunk=1, lam=0)
        ref.check_scale(self)
        ref.check_combine(self.combine)
        check_backend(self.backend, "lola/lolcats")
        if not isinstance(self.tuning, LolaTuning):
            raise TypeError(f"LolaRun.tuning: a LolaTuning (kernels/lola/tuning.py), not {type(self.tuning).__name__}")

    def rule(self, g, lf) -> ref.HybridRule:
        """The hybrid attention's rule (`reference.HybridRule`) of this run with the per-head weights g and lf."""
        return ref.HybridRule(self.window, g, lf, self.scale, self.combine)


def ensure_fk(st: LolaState, phi_k: PhiK, window: int) -> None:
    """An in-place state with `feature_cache` gets its feature cache: win_fk of (buffer rows - window) rows, phi(k)
    of its first nb - window buffered keys; any other state none. A no-op (host checks only) when it has the
    right one already, as on every decode step."""
    if not (st.inplace and st.feature_cache):
        st.win_fk = None
        return
    B, _, cap, _ = st.win_k.shape
    Hq, F2 = st.H.shape[1], st.H.shape[2]
    rows = max(cap - window, 0)
    if st.win_fk is not None and st.win_fk.shape == (B, Hq, rows, F2):
        return
    st.win_fk = st.win_k.new_zeros(B, Hq, rows, F2)
    nl = max(st.nb - window, 0)
    if nl > 0:
        phi_into(phi_k, st.win_k[:, :, :nl], st.win_fk[:, :, :nl])


def _select(scores, valid, lam):
    """The lam best valid candidates (`top`: indices and scores, sorted by score) and the fold weights `w`
    (1 for every other valid candidate, 0 otherwise), [B, Hs, Nc]."""
    scores = scores.masked_fill(~valid, float("-inf"))
    top = ref.top_lam(scores, min(lam, scores.shape[-1]))  # ties to the lowest index
    w = valid.float()
    w.scatter_(-1, top.indices, 0.0)
    return w, top


def lola_evict(st: LolaState, *, window: int, lam: int, phi_k: PhiK, backend: str = "auto",
               tuning: LolaTuning = DEFAULT_TUNING) -> None:
    """Score the pairs older than the last `window` tokens with the sparse cache; keep lam, fold the rest.

    Scores are SRE per query head against its (H, s), summed over the query heads of each sparse head. tuning: the
    fold kernel's tiles."""
    n_ev = st.nb - window
    if n_ev <= 0:
        return
    ev_k, ev_v = st.win_k[:, :, :n_ev], st.win_v[:, :, :n_ev]
    B = ev_k.shape[0]
    ev_valid = (torch.ones(B, n_ev, dtype=torch.bool, device=ev_k.device) if st.win_mask is None
                else st.win_mask[:, :n_ev])
    use_tk = ops.use_triton(backend, st.H, ev_k)
    ev_fk = None if st.win_fk is None else st.win_fk[:, :, :n_ev]  # the feature cache (in-place states)
    if lam == 0:
        cand_k, cand_v, w = ev_k, ev_v, ev_valid[:, None, :].float()  # fold every valid pair
        cand_fk = phi_k(cand_k) if ev_fk is None else ev_fk
    else:
        Hs = st.sp_k.shape[1]
        cand_k = torch.cat([st.sp_k, ref.expand_kv(ev_k, Hs).to(st.sp_k.dtype)], 2)
        cand_v = torch.cat([st.sp_v, ref.expand_kv(ev_v, Hs).to(st.sp_v.dtype)], 2)
        cand_valid = torch.cat([st.sp_valid, ev_valid[:, None, :].expand(B, Hs, n_ev)], 2)
        cand_fk = phi_k(cand_k) if ev_fk is None else torch.cat([phi_k(st.sp_k), ev_fk], 2)
    if lam > 0:
        # SRE per query head (one program per query head and block of candidates: a kernel that sums the
        # group in-program has a quarter of the programs and ran 2.8x slower on the H200), summed per sparse head
        if use_tk:
            scores = ops.triton_ops().sre_score(cand_fk, cand_v, st.H, st.s, eps=ref.EPS_SRE)
        else:
            scores = ref.sre_scores(cand_fk, cand_v, st.H, st.s)
        w, top = _select(ref.group_sum(scores, Hs), cand_valid, lam)
    if use_tk:
        H, s = st.H.contiguous(), st.s.contiguous()
        ops.triton_ops().fold_into_state(cand_fk, cand_v, w, H, s, tuning=tuning)
        st.H, st.s = H, s
    elif st.inplace:  # same storage, as above
        H, s = ref.fold(cand_fk, cand_v, w, st.H, st.s)
        st.H.copy_(H)
        st.s.copy_(s)
    else:
        st.H, st.s = ref.fold(cand_fk, cand_v, w, st.H, st.s)
    if lam > 0:
        idx = top.indices
        index = lambda x: idx[..., None].expand(-1, -1, -1, x.shape[-1])  # noqa: E731
        if st.inplace:  # same storage: a captured CUDA graph keeps reading the live state
            torch.gather(cand_k, 2, index(cand_k), out=st.sp_k)
            torch.gather(cand_v, 2, index(cand_v), out=st.sp_v)
            st.sp_score.copy_(top.values)
        else:
            st.sp_k, st.sp_v = torch.gather(cand_k, 2, index(cand_k)), torch.gather(cand_v, 2, index(cand_v))
            st.sp_score = top.values
    drop_front(st, n_ev)


def drop_front(st: LolaState, n: int) -> None:
    """Drop the n oldest buffered tokens (shift the rest to the front of the fixed buffer)."""
    keep = st.nb - n
    names = ["win_k", "win_v"] + (["win_mask"] if st.win_mask is not None else [])
    if st.win_fk is not None:  # its rows are the buffer's first rows: shift them alike (the valid ones and beyond)
        rows = st.win_fk.shape[2]
        if st.inplace:
            if n < rows:
                st.win_fk[:, :, : rows - n] = st.win_fk[:, :, n:].clone()
        else:
            st.win_fk = st.win_fk[:, :, n:]
    for name in names:
        t = getattr(st, name)
        src = t[:, :, n: st.nb] if t.dim() > 2 else t[:, n: st.nb]
        if st.inplace:
            if t.dim() > 2:
                t[:, :, :keep] = src.clone()
            else:
                t[:, :keep] = src.clone()
        else:
            setattr(st, name, src)
    st.nb = keep
    if st.inplace and st.nb_t is not None:
        st.nb_t.fill_(keep)  # in a graph: the count every replay of this step leaves (its key fixes `keep`)


def ensure_mask(st: LolaState, B: int, device) -> None:
    if st.win_mask is None:
        st.win_mask = torch.ones(B, st.win_k.shape[2], dtype=torch.bool, device=device)


def append_window(st: LolaState, k, v, mask_new, phi_k: PhiK | None = None, window: int = 0) -> None:
    """Append n tokens to the window buffer. With a feature cache (and phi_k given), phi of the buffered keys that
    this moves out of the window (rows max(nb - window, 0) .. nb + n - window - 1) goes into it; phi_k None: the
    caller rebuilds the feature cache."""
    B, n = k.shape[0], k.shape[2]
    fk_rows = None
    if st.win_fk is not None and phi_k is not None:
        fk_rows = (max(st.nb - window, 0), max(st.nb + n - window, 0))
    if mask_new is not None:
        ensure_mask(st, B, k.device)
    cap = st.win_k.shape[2]
    if st.inplace and st.nb + n <= cap:
        e = st.nb + n
        st.win_k[:, :, st.nb:e] = k
        st.win_v[:, :, st.nb:e] = v
        if st.win_mask is not None:
            st.win_mask[:, st.nb:e] = mask_new.bool() if mask_new is not None else True
        if fk_rows is not None and fk_rows[1] > fk_rows[0]:
            a, b = fk_rows
            phi_into(phi_k, st.win_k[:, :, a:b], st.win_fk[:, :, a:b])
        st.nb = e
        return
    # functional path (gradients) or more tokens than the buffer holds (one long parallel prefill)
    new = mask_new.bool() if mask_new is not None else torch.ones(B, n, dtype=torch.bool, device=k.device)
    st.win_k = torch.cat([st.wk, k.to(st.win_k.dtype)], 2)
    st.win_v = torch.cat([st.wv, v.to(st.win_v.dtype)], 2)
    if st.win_mask is not None:
        st.win_mask = torch.cat([st.wmask, new], 1)
    st.nb += n
    if fk_rows is not None:  # rows: the buffer's rows minus the window, as `ensure_fk` makes them
        a, b = fk_rows
        st.win_fk = torch.cat([st.win_fk[:, :, :a], phi_k(st.win_k[:, :, a:b]).to(st.win_fk.dtype)], 2)
    elif st.win_fk is not None:
        st.win_fk = None  # the caller rebuilds it


def repack(st: LolaState, cap: int) -> None:
    """After a long parallel prefill: move the buffered tokens back into a buffer of `cap` rows."""
    if not st.inplace or st.win_k.shape[2] == cap:
        return
    for name in ("win_k", "win_v", "win_mask"):  # the feature cache: `ensure_fk` makes it anew
        t = getattr(st, name)
        if t is None:
            continue
        shape = list(t.shape)
        shape[2 if t.dim() > 2 else 1] = cap
        buf = torch.ones(shape, dtype=t.dtype, device=t.device) if t.dim() == 2 else torch.zeros(shape, dtype=t.dtype,
                                                                                                 device=t.device)
        if t.dim() > 2:
            buf[:, :, : st.nb] = t[:, :, : st.nb]
        else:
            buf[:, : st.nb] = t[:, : st.nb]
        setattr(st, name, buf)


def attend_piece(st, q, fq, g, lf, run: LolaRun):
    """Attention of the newest q.shape[2] tokens (already appended to the window buffer). phi(k) of the buffered
    keys that some of these queries attend linearly (at most chunk - 1 + S of them): read from the feature cache
    (in-place states), else computed."""
    window, backend, phi_k, tuning = run.window, run.backend, run.phi_k, run.tuning
    nb = st.nb
    S = q.shape[2]
    lam = st.sp_k.shape[2]
    n_lin = ref.linear_rows(nb - S, S, window)
    if n_lin <= 0:
        fk = fq[:, :, :0]
    elif st.win_fk is not None:
        fk = st.win_fk[:, :, :n_lin]
    else:
        fk = phi_k(st.win_k[:, :, :n_lin])
    triton = ops.use_triton(backend, q, st.win_k, st.H)
    if triton and S == 1:  # the kernel reads the sparse slots' validity from their scores (no isfinite launches)
        keys = ref.HybridKeys(st.wk, st.wv, fk, st.H, st.s, key_mask=st.wmask,
                              sparse=ref.SparseSet(st.sp_k, st.sp_v, score=st.sp_score) if lam > 0 else None)
        return ops.triton_ops().decode_step(q, fq, keys, run.rule(g, lf), tuning=tuning)
    keys = ref.HybridKeys(st.wk, st.wv, fk, st.H, st.s, key_mask=st.wmask, q_offset=nb - S,
                          sparse=ref.SparseSet(st.sp_k, st.sp_v, st.sp_valid) if lam > 0 else None)
    if triton:
        return ops.triton_ops().hybrid_fwd(q, fq, keys, run.rule(g, lf), block_m=tuning.piece_block_m or 64,
                                           tuning=tuning)
    o = ref.lola_attention(q, fq, keys, run.rule(g, lf))
    return o.transpose(1, 2).to(q.dtype)


def attend_step(st: LolaState, q, fq, g, lf, run: LolaRun):
    """Attention of one new token (q [B, Hq, 1, D], already appended) over the whole window buffer, its length read
    from the device (`st.nb_t`): the same launches at every position (`sparse_cache.decode_step`). phi(k) covers the
    buffer rows that can ever be older than the window (the first cap - window): the feature cache, else computed."""
    window, phi_k = run.window, run.phi_k
    cap = st.win_k.shape[2]
    fk = st.win_fk if st.win_fk is not None else phi_k(st.win_k[:, :, : cap - window])
    lam = st.sp_k.shape[2]
    if ops.use_triton(run.backend, q, st.win_k, st.H):
        keys = ref.HybridKeys(st.win_k, st.win_v, fk, st.H, st.s, key_mask=st.win_mask,
                              sparse=ref.SparseSet(st.sp_k, st.sp_v, score=st.sp_score) if lam > 0 else None)
        return ops.triton_ops().decode_step(q, fq, keys, run.rule(g, lf), n_keys=st.nb_t, tuning=run.tuning)
    fk = torch.nn.functional.pad(fk, (0, 0, 0, cap - fk.shape[2]))  # rows past cap - window: never linear
    keys = ref.HybridKeys(st.win_k, st.win_v, fk, st.H, st.s, key_mask=st.win_mask, q_offset=st.nb_t[:1] - 1,
                          sparse=ref.SparseSet(st.sp_k, st.sp_v, st.sp_valid) if lam > 0 else None)
    o = ref.lola_attention(q, fq, keys, run.rule(g, lf))
    return o.transpose(1, 2).to(q.dtype)

