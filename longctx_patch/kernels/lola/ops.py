"""Dispatchers and the LoLA cache manager on plain tensors.

`backend`: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch". Under gradients the whole-sequence
LoLCATs hybrid (`hybrid_attention`: `HybridAttentionFn`, the forward kernel and `triton_hybrid_bwd`'s backward) and
the feature map (`FeatureMapFn`: `triton_feature_map_bwd`) have Triton paths; every other piece (the LoLA chunk
loop, evictions, the training pass over sparse sets) takes the differentiable PyTorch path under grad with "auto"
and refuses "triton". Under TRITON_INTERPRET=1 "triton" runs the kernels on the CPU (tests).

The cache manager (`LolaState` + `lola_process`) implements docs/lola.md, "Chunks and eviction order":
tokens are processed in pieces that never cross a multiple of `chunk` (the token index from the row's first
real token: the rows of a left-padded batch keep their own grids, `RowPhases`); each time the index reaches a
multiple of `chunk`, the pairs that have left the window
(everything older than the last `window` tokens) are scored together with the sparse cache and the
`lam` best stay exact, the others are folded into (H, s). Until then they are attended linearly by
phi(q) . phi(k) from the window buffer, exactly as LoLCATs would, so lam = 0 is LoLCATs exactly and a
prefill cut anywhere gives the same result as token-by-token decoding.

Feature cache: an in-place state (no gradients: decode, no-grad prefill) keeps phi(k) of the buffered keys that
have left the window (the first nb - window rows of the buffer, at most `chunk`) in `win_fk`, computed once per
key when it leaves the window (`phi_k`, the layer's key feature map), shifted with the window buffer; the linear
attention to buffered keys and an eviction's window candidates read it instead of recomputing phi of up to
`chunk` keys per step. An out-of-place state (gradients) keeps no
feature cache and recomputes phi(k) where it is needed, differentiably, as before. Phi of the sparse cache's
keys is recomputed at each eviction. The sparse cache has one slot set per kv head (shared by its query heads,
scored by the sum of their SRE) or per query head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable

import torch

from ...errors import ConfigError
from ..backend import check_backend, needs_grad, resolve_backend
from . import reference as ref
from .tuning import TUNE


def _use_triton(backend: str, *tensors) -> bool:
    """Whether the forward-only Triton kernels run (`kernels.backend.resolve_backend`): `auto` takes the
    (differentiable) PyTorch path whenever one of `tensors` needs a gradient; pass every input that may be
    trained (q, k, v and the feature maps' outputs, the window factors). The whole-sequence hybrid
    (`hybrid_attention`) does not ask here under grad: it has a Triton backward (`HybridAttentionFn`)."""
    grad = refuse_forced_triton_under_grad(backend, *tensors)
    return resolve_backend(backend, *tensors, what="lola/lolcats") == "triton" and not grad


def refuse_forced_triton_under_grad(backend: str, *tensors) -> bool:
    """Raises ConfigError for backend='triton' when one of `tensors` needs a gradient and the piece about to run has
    no Triton backward (the LoLA chunk loop, its evictions, the training pass over sparse sets); returns whether a
    gradient is needed."""
    check_backend(backend, "lola/lolcats")
    grad = needs_grad(*tensors)
    if backend == "triton" and grad:
        raise ConfigError("backend='triton' was asked for while gradients are needed, but this LoLA/LoLCATs "
                          "Triton kernel has no backward (the LoLCATs whole-sequence hybrid attention and the "
                          "feature map have one; the LoLA chunk loop, its evictions and its training pass over sparse "
                          "sets do not); train with "
                          "backend='auto' (the Triton hybrid where it has a backward, the PyTorch path elsewhere) "
                          "or backend='torch'")
    return grad


def _tk():
    """The Triton entry points (`triton_kernels`), imported once the backend chose them."""
    from . import triton_kernels

    return triton_kernels


class FeatureMapFn(torch.autograd.Function):
    """The hedgehog feature map on the Triton kernels: forward `feature_map`, backward `feature_map_bwd` (it
    recomputes the projection and the softmaxes: nothing but x and W is kept)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _tk().feature_map(x, weight, eps=eps, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, dphi):
        x, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = _tk().feature_map_bwd(x, weight, dphi, ctx.eps, need_dx, need_dw)
        return dx, (dw.to(weight.dtype) if dw is not None else None), None, None


def feature_map(x, weight, eps: float = 1e-12, out_dtype=None, backend: str = "auto", out=None):
    """Hedgehog feature map [softmax(x W), softmax(-x W)]: Triton on CUDA (under grad `FeatureMapFn`, forward and
    backward kernels), else torch. out: write the result there (no grad; Triton writes it directly, torch copies)
    and return it."""
    check_backend(backend, "lola/lolcats")
    if x.stride(-1) == 1 and resolve_backend(backend, x, weight, what="lola/lolcats") == "triton":
        if not needs_grad(x, weight):
            return _tk().feature_map(x, weight, eps=eps, out_dtype=out_dtype, out=out)
        if out is None:
            return FeatureMapFn.apply(x, weight, float(eps), out_dtype)
        refuse_forced_triton_under_grad(backend, x, weight)  # writing into `out` under grad: the torch path only
    f = ref.hedgehog_feature_map(x, weight, eps=eps, out_dtype=out_dtype)
    if out is None:
        return f
    out.copy_(f)
    return out


# ------------------------------------------------------------------------------------------- lolcats forward
STATE_CHUNK = 256  # keys per materialised prefix state of the parallel pass (H200: 1.36 ms vs 1.72 ms with 64)


class HybridAttentionFn(torch.autograd.Function):
    """The whole-sequence hybrid on the Triton kernels: forward `hybrid_fwd` (the inference kernel, with the row
    statistics of the backward), backward `hybrid_bwd` (triton_hybrid_bwd.py); gradients for q, k, v, fq, fk, g, lf.
    The prefix states are recomputed in the backward (cheap), not saved."""

    @staticmethod
    def forward(ctx, q, k, v, fq, fk, g, lf, key_mask, window: int, scale: float, state_chunk: int,
                block_m: int, block_n: int):
        tk = _tk()
        q, k, v, fq, fk = (x.contiguous() for x in (q, k, v, fq, fk))
        Hs, Ss = tk.chunk_states(fk, v, state_chunk, key_mask=key_mask)
        B, Hq, S, D = q.shape
        # the output in fp32 (rounded to q.dtype below, as the kernel rounds it): the backward's
        # delta = do . o from the unrounded o (a bf16 o made dg / dlf, sums over every row, visibly noisier)
        o32 = torch.empty(B, S, Hq, D, device=q.device, dtype=torch.float32)
        o32, (m, r, am) = tk.hybrid_fwd(q, k, v, fq, fk, g, lf, Hs, Ss, window=window, scale=scale, q_offset=0,
                                        key_mask=key_mask, state_chunk=state_chunk, block_m=block_m,
                                        block_n=block_n, stats=True, out=o32)
        del Hs, Ss
        ctx.save_for_backward(q, k, v, fq, fk, g, lf, key_mask, o32, m, r, am)
        ctx.meta = dict(window=window, scale=scale, state_chunk=state_chunk, block_m=block_m, block_n=block_n)
        return o32.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, fq, fk, g, lf, key_mask, o, m, r, am = ctx.saved_tensors
        if do.stride(-1) != 1:
            do = do.contiguous()
        with torch.autocast(q.device.type, enabled=False):  # its few torch ops (prefix states' sums) stay fp32
            grads = _tk().hybrid_bwd(q, k, v, fq, fk, g, lf, o, do, (m, r, am), key_mask=key_mask, **ctx.meta)
        return (*grads, None, None, None, None, None, None)


def hybrid_attention_triton(q, k, v, fq, fk, g, lf, *, window: int, scale: float, key_mask=None,
                            state_chunk: int = STATE_CHUNK, block_m: int = 64, block_n: int = 64):
    """`HybridAttentionFn` (the Triton forward and backward): q [B,Hq,S,D], k/v [B,Hkv,S,D], fq/fk [B,Hq,S,F2] of
    one dtype, g/lf [Hq], key_mask [B, S] bool or None -> [B, S, Hq, D] in q.dtype. state_chunk: a multiple of
    block_n (tests pass small blocks to get several state slots at small S)."""
    return HybridAttentionFn.apply(q, k, v, fq, fk, g, lf, key_mask, int(window), float(scale), int(state_chunk),
                                   int(block_m), int(block_n))


def hybrid_attention(q, k, v, fq, fk, g, lf, *, window: int, scale: float, key_mask=None, chunk: int = 64,
                     backend: str = "auto", state_chunk: int | None = None):
    """LoLCATs hybrid over a whole sequence (no cache): q [B,Hq,S,D], k/v [B,Hkv,S,D], fq/fk [B,Hq,S,F2].

    Returns [B, S, Hq, D] in q.dtype. Differentiable on both backends: under grad the Triton backend runs
    `HybridAttentionFn` (Triton forward and backward), the torch backend `reference.hybrid_attention_chunked`.
    """
    cs = max(64, ((state_chunk or STATE_CHUNK) // 64) * 64)
    tensors = (q, k, v, fq, fk, g, lf)
    if needs_grad(*tensors):
        check_backend(backend, "lola/lolcats")
        if window >= 1 and resolve_backend(backend, *tensors, what="lola/lolcats") == "triton":
            # one dtype for the kernels: autocast's where it is on (a trainer's fp32 weights under bf16 autocast
            # hand over fp32 q/k after the rotary's fp32 cos/sin and bf16 v: the kernels would run fp32 "ieee"
            # products, far slower than bf16 ones), else q's
            dev = q.device.type
            dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype
            return hybrid_attention_triton(q.to(dt), k.to(dt), v.to(dt), fq.to(dt), fk.to(dt), g, lf, window=window,
                                           scale=scale, key_mask=key_mask,
                                           state_chunk=cs if state_chunk else (TUNE["train_state_chunk"] or cs),
                                           block_m=TUNE["train_block_m"] or 64, block_n=TUNE["train_block_n"] or 64)
    elif _use_triton(backend, *tensors):
        tk = _tk()
        Hs, Ss = tk.chunk_states(fk, v, cs, key_mask=key_mask)
        return tk.hybrid_fwd(q, k, v, fq, fk, g, lf, Hs, Ss, window=window, scale=scale, q_offset=0,
                             key_mask=key_mask, state_chunk=cs)
    o = ref.hybrid_attention_chunked(q, k, v, fq, fk, g, lf, window=window, scale=scale, key_mask=key_mask,
                                     chunk=chunk)
    return o.transpose(1, 2).to(q.dtype)


# ------------------------------------------------------------------------------------------- LoLA state
@dataclass
class LolaState:
    """Decode-time state of one layer. Sizes are fixed: the window buffer has room for window + chunk tokens.

    win_k/win_v [B, Hkv, cap, D], win_mask [B, cap] bool or None (no padding so far): the first `nb` rows are
    the buffered tokens, oldest first (positions pos - nb .. pos - 1);
    sp_k/sp_v [B, Hs, lam, D], sp_score [B, Hs, lam] fp32 (-inf = empty slot) with Hs = Hkv (one sparse cache
    per kv head) or Hq (one per query head); H [B, Hq, F2, D] fp32, s [B, Hq, F2] fp32; pos: tokens seen
    (padding included). win_fk [B, Hq, cap - window, F2] (in-place states with `feature_cache`, else None): phi(k)
    of the buffered keys older than the window, rows 0 .. nb - window - 1 (`_ensure_fk`); None: `phi_k` recomputes
    it where it is needed.
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
    feature_cache: bool = False
    pos: int = 0
    nb: int = 0
    inplace: bool = True
    phases: "RowPhases | None" = None

    @classmethod
    def empty(cls, B, Hq, Hkv, D, F2, lam, dtype, device, capacity: int = 0, inplace=True, sparse_heads=None,
              feature_cache: bool = False):
        """sparse_heads: heads of the sparse cache, Hkv (default) or Hq. The feature cache is made by the first
        `lola_process` call (`_ensure_fk`: its rows depend on the window)."""
        Hs = Hkv if sparse_heads is None else int(sparse_heads)
        if Hs not in (Hkv, Hq):
            raise ValueError(f"sparse_heads must be the kv heads ({Hkv}) or the query heads ({Hq}), not {Hs}")
        z = lambda *shape, dt=dtype: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        cap = capacity if inplace else 0
        return cls(
            win_k=z(B, Hkv, cap, D), win_v=z(B, Hkv, cap, D), win_mask=None,
            sp_k=z(B, Hs, lam, D), sp_v=z(B, Hs, lam, D),
            sp_score=torch.full((B, Hs, lam), float("-inf"), dtype=torch.float32, device=device),
            H=z(B, Hq, F2, D, dt=torch.float32), s=z(B, Hq, F2, dt=torch.float32),
            win_fk=None, feature_cache=feature_cache, pos=0, nb=0, inplace=inplace,
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
# a PhiK with the attribute `writes_out = True` also takes `out=` (a [B, Hq, N, F2] view) and writes phi(k) there


def _phi_into(phi_k: PhiK, k, dst) -> None:
    """dst <- phi_k(k): written directly by a PhiK that `writes_out`, else computed and copied."""
    if getattr(phi_k, "writes_out", False):
        phi_k(k, out=dst)
    else:
        dst.copy_(phi_k(k))


def _ensure_fk(st: LolaState, phi_k: PhiK, window: int) -> None:
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
        _phi_into(phi_k, st.win_k[:, :, :nl], st.win_fk[:, :, :nl])


def _select(scores, valid, lam):
    """The lam best valid candidates (`top`: indices and scores, sorted by score) and the fold weights `w`
    (1 for every other valid candidate, 0 otherwise), [B, Hs, Nc]."""
    scores = scores.masked_fill(~valid, float("-inf"))
    top = ref.top_lam(scores, min(lam, scores.shape[-1]))  # ties to the lowest index
    w = valid.float()
    w.scatter_(-1, top.indices, 0.0)
    return w, top


def lola_evict(st: LolaState, *, window: int, lam: int, phi_k: PhiK, backend: str = "auto") -> None:
    """Score the pairs older than the last `window` tokens with the sparse cache; keep lam, fold the rest.

    Scores are SRE per query head against its (H, s), summed over the query heads of each sparse head."""
    n_ev = st.nb - window
    if n_ev <= 0:
        return
    ev_k, ev_v = st.win_k[:, :, :n_ev], st.win_v[:, :, :n_ev]
    B = ev_k.shape[0]
    ev_valid = (torch.ones(B, n_ev, dtype=torch.bool, device=ev_k.device) if st.win_mask is None
                else st.win_mask[:, :n_ev])
    use_tk = _use_triton(backend, st.H, ev_k)
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
            scores = _tk().sre_score(cand_fk, cand_v, st.H, st.s, eps=ref.EPS_SRE)
        else:
            scores = ref.sre_scores(cand_fk, cand_v, st.H, st.s)
        w, top = _select(ref.group_sum(scores, Hs), cand_valid, lam)
    if use_tk:
        H, s = st.H.contiguous(), st.s.contiguous()
        _tk().fold_into_state(cand_fk, cand_v, w, H, s)
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
    _drop_front(st, n_ev)


def _drop_front(st: LolaState, n: int) -> None:
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


def _ensure_mask(st: LolaState, B: int, device) -> None:
    if st.win_mask is None:
        st.win_mask = torch.ones(B, st.win_k.shape[2], dtype=torch.bool, device=device)


def _append_window(st: LolaState, k, v, mask_new, phi_k: PhiK | None = None, window: int = 0) -> None:
    """Append n tokens to the window buffer. With a feature cache (and phi_k given), phi of the buffered keys that
    this moves out of the window (rows max(nb - window, 0) .. nb + n - window - 1) goes into it; phi_k None: the
    caller rebuilds the feature cache."""
    B, n = k.shape[0], k.shape[2]
    fk_rows = None
    if st.win_fk is not None and phi_k is not None:
        fk_rows = (max(st.nb - window, 0), max(st.nb + n - window, 0))
    if mask_new is not None:
        _ensure_mask(st, B, k.device)
    cap = st.win_k.shape[2]
    if st.inplace and st.nb + n <= cap:
        e = st.nb + n
        st.win_k[:, :, st.nb:e] = k
        st.win_v[:, :, st.nb:e] = v
        if st.win_mask is not None:
            st.win_mask[:, st.nb:e] = mask_new.bool() if mask_new is not None else True
        if fk_rows is not None and fk_rows[1] > fk_rows[0]:
            a, b = fk_rows
            _phi_into(phi_k, st.win_k[:, :, a:b], st.win_fk[:, :, a:b])
        st.nb = e
        return
    # functional path (gradients) or more tokens than the buffer holds (one long parallel prefill)
    new = mask_new.bool() if mask_new is not None else torch.ones(B, n, dtype=torch.bool, device=k.device)
    st.win_k = torch.cat([st.wk, k.to(st.win_k.dtype)], 2)
    st.win_v = torch.cat([st.wv, v.to(st.win_v.dtype)], 2)
    if st.win_mask is not None:
        st.win_mask = torch.cat([st.wmask, new], 1)
    st.nb += n
    if fk_rows is not None:  # rows: the buffer's rows minus the window, as `_ensure_fk` makes them
        a, b = fk_rows
        st.win_fk = torch.cat([st.win_fk[:, :, :a], phi_k(st.win_k[:, :, a:b]).to(st.win_fk.dtype)], 2)
    elif st.win_fk is not None:
        st.win_fk = None  # the caller rebuilds it


def _repack(st: LolaState, cap: int) -> None:
    """After a long parallel prefill: move the buffered tokens back into a buffer of `cap` rows."""
    if not st.inplace or st.win_k.shape[2] == cap:
        return
    for name in ("win_k", "win_v", "win_mask"):  # the feature cache: `_ensure_fk` makes it anew
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


def _attend_piece(st, q, fq, g, lf, *, window, scale, backend, phi_k: PhiK):
    """Attention of the newest q.shape[2] tokens (already appended to the window buffer). phi(k) of the buffered
    keys that some of these queries attend linearly (at most chunk - 1 + S of them): read from the feature cache
    (in-place states), else computed."""
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
    if _use_triton(backend, q, st.win_k, st.H):
        tk = _tk()
        if S == 1:  # the kernel reads the sparse slots' validity from their scores (no isfinite launches per step)
            sp = dict(sparse_k=st.sp_k, sparse_v=st.sp_v, sparse_score=st.sp_score) if lam > 0 else {}
            return tk.decode_step(q, st.wk, st.wv, fq, fk, g, lf, st.H, st.s, window=window,
                                  scale=scale, key_mask=st.wmask, **sp)
        sp = dict(sparse_k=st.sp_k, sparse_v=st.sp_v, sparse_valid=st.sp_valid) if lam > 0 else {}
        return tk.hybrid_fwd(q, st.wk, st.wv, fq, fk, g, lf, st.H, st.s, window=window, scale=scale,
                             q_offset=nb - S, key_mask=st.wmask, state_chunk=0,
                             block_m=TUNE["piece_block_m"] or 64, **sp)
    sp = dict(sparse_k=st.sp_k, sparse_v=st.sp_v, sparse_valid=st.sp_valid) if lam > 0 else {}
    o = ref.lola_attention(q, st.wk, st.wv, fq, fk, g, lf, st.H, st.s, window=window, scale=scale,
                           key_mask=st.wmask, q_offset=nb - S, **sp)
    return o.transpose(1, 2).to(q.dtype)


GRAPH_PREFILL = True  # replay full chunks of a long Triton prefill from one captured CUDA graph


# ------------------------------------------------------------------------------- left-padded rows (lam > 0)
@dataclass(eq=False)
class RowPhases:
    """The eviction grid of each row of a left-padded batch: row r evicts when pos - lead[r] is a positive
    multiple of `chunk` (its own count of real tokens), as the row alone would.

    lead[r]: position of the row's first real token, None while none has been seen (the row never evicts);
    groups: phase -> rows (sorted) of the rows that evict when pos % chunk == phase; index: the same rows as
    LongTensors on the state's device (views of one tensor, made once: no host-to-device copy per step)."""

    lead: tuple
    chunk: int
    groups: dict
    index: dict
    device: torch.device | None = None

    @property
    def pending(self) -> bool:
        return any(l is None for l in self.lead)

    def need(self, pos: int, window: int) -> int:
        """Buffer rows the batch needs at `pos`: per row its undecided real tokens (those since its last
        eviction's window start), at most window + chunk - 1 after an eviction; the most of any row."""
        n = 0
        for l in self.lead:
            if l is not None and pos > l:
                c = pos - l
                n = max(n, min(c, window + c % self.chunk))
        return n

    def next_boundary(self, pos: int) -> int:
        """Tokens until the next position (> pos) at which some row evicts; `chunk` when no row ever does."""
        if not self.groups:
            return self.chunk - pos % self.chunk
        return min((p - pos - 1) % self.chunk + 1 for p in self.groups)

    def select(self, rows) -> "RowPhases | None":
        """The phases of the batch rows `rows` (a list of indices: beam search, batch selection)."""
        return row_phases([self.lead[int(r)] for r in rows], self.chunk, self.device)


def row_phases(lead, chunk: int, device) -> RowPhases | None:
    """The `RowPhases` of rows whose first real tokens sit at `lead` (None: not seen yet); None when every row has
    a first token at a multiple of `chunk` (its padding is whole chunks, neutral: the plain grid is exact)."""
    lead = tuple(None if l is None else int(l) for l in lead)
    if all(l is not None and l % chunk == 0 for l in lead):
        return None
    groups: dict = {}
    for r, l in enumerate(lead):
        if l is not None:
            groups.setdefault(l % chunk, []).append(r)
    index = {}
    if groups:
        order = [r for p in sorted(groups) for r in groups[p]]
        flat = torch.tensor(order, dtype=torch.long, device=device)  # one host-to-device copy
        i = 0
        for p in sorted(groups):
            index[p] = flat[i:i + len(groups[p])]
            i += len(groups[p])
    return RowPhases(lead, chunk, {p: tuple(rs) for p, rs in groups.items()}, index, device)


def left_padding_counts(key_mask: torch.Tensor) -> list[int]:
    """Leading padding columns of each row of a [B, S] bool mask (S for a row of padding only); one host sync."""
    km = key_mask.bool()
    first = km.int().argmax(dim=1)
    return torch.where(km.any(dim=1), first, torch.full_like(first, km.shape[1])).tolist()


def _evict_rows(st: LolaState, idx: torch.Tensor, *, window: int, lam: int, phi_k: PhiK, backend: str) -> None:
    """`lola_evict` of the batch rows `idx` only (the rows at their chunk boundary); the other rows' sparse cache
    and state stay as they are. The evicted rows' candidates become decided: masked in the buffer, which keeps
    them while another row still needs those slots."""
    n_ev = st.nb - window
    if n_ev <= 0:
        return
    take = lambda t: t.index_select(0, idx)  # noqa: E731
    _ensure_mask(st, st.win_k.shape[0], st.win_k.device)
    sub = LolaState(win_k=take(st.win_k[:, :, :n_ev]), win_v=take(st.win_v[:, :, :n_ev]),
                    win_mask=take(st.win_mask[:, :n_ev]), sp_k=take(st.sp_k), sp_v=take(st.sp_v),
                    sp_score=take(st.sp_score), H=take(st.H), s=take(st.s),
                    win_fk=None if st.win_fk is None else take(st.win_fk[:, :, :n_ev]), pos=st.pos, nb=st.nb,
                    inplace=False)
    lola_evict(sub, window=window, lam=lam, phi_k=phi_k, backend=backend)
    for name in ("sp_k", "sp_v", "sp_score", "H", "s"):
        t, new = getattr(st, name), getattr(sub, name)
        if st.inplace:  # same storage (the layer's state)
            t.index_copy_(0, idx, new.to(t.dtype))
        else:
            setattr(st, name, t.index_copy(0, idx, new.to(t.dtype)))
    if not st.inplace:
        st.win_mask = st.win_mask.clone()
    st.win_mask[:, :n_ev].index_fill_(0, idx, False)


def _phased_step_end(st: LolaState, *, window: int, lam: int, phi_k: PhiK, backend: str) -> None:
    """After a piece of a batch with `RowPhases`: evict the rows at their boundary, then drop the front buffer
    rows no row needs any more (decided or padding in every row)."""
    ph = st.phases
    rows = ph.groups.get(st.pos % ph.chunk)
    if rows is not None:
        if len(rows) == st.win_k.shape[0]:
            lola_evict(st, window=window, lam=lam, backend=backend, phi_k=phi_k)
        else:
            _evict_rows(st, ph.index[st.pos % ph.chunk], window=window, lam=lam, phi_k=phi_k, backend=backend)
    drop = st.nb - ph.need(st.pos, window)
    if drop > 0:
        _drop_front(st, drop)


def _resolve_pending(st: LolaState, key_mask_new, S: int, chunk: int) -> None:
    """Rows with no real token so far get their first one from this call (its mask, or its first column)."""
    ph = st.phases
    pads = left_padding_counts(key_mask_new) if key_mask_new is not None else [0] * len(ph.lead)
    lead = [l if l is not None else (st.pos + p if p < S else None) for l, p in zip(ph.lead, pads)]
    st.phases = row_phases(lead, chunk, st.H.device)


def _process_padded_fresh(st: LolaState, q, k, v, fq, g, lf, *, key_mask_new, chunk: int, **kw):
    """A fresh prefill of a left-padded batch: one run per phase group (rows whose padding has the same remainder
    modulo `chunk`) on its rows with the `trim` leading columns dropped (padding in each of them), so every row
    keeps the eviction grid of its prompt alone; outputs scattered back (dropped columns: zeros) and the group
    states merged into one buffer (each group's tokens right-aligned, missing front rows masked)."""
    B, Hq, S, D = q.shape
    pads = left_padding_counts(key_mask_new)  # one host sync per layer and padded prefill
    lead = [p if p < S else None for p in pads]
    phases = sorted({p % chunk for p in pads if p < S})
    if not phases or phases == [0]:  # padding of whole chunks only (or rows of padding only): the plain grid
        o = _process(st, q, k, v, fq, g, lf, key_mask_new=key_mask_new, chunk=chunk, **kw)
        st.phases = row_phases(lead, chunk, q.device)
        return o
    if len(phases) == 1:  # one group: drop the common padding columns
        p = phases[0]
        o = _process(st, q[:, :, p:], k[:, :, p:], v[:, :, p:], fq[:, :, p:], g, lf, key_mask_new=key_mask_new[:, p:],
                     chunk=chunk, **kw)
        st.pos += p
        st.phases = row_phases(lead, chunk, q.device)
        return torch.nn.functional.pad(o, (0, 0, 0, 0, p, 0))
    # several groups; rows of padding only go with the first
    rows_of = {p: [r for r in range(B) if pads[r] < S and pads[r] % chunk == p] for p in phases}
    rows_of[phases[0]] += [r for r in range(B) if pads[r] >= S]
    Hkv, F2, Hs, lamn = k.shape[1], st.H.shape[2], st.sp_k.shape[1], st.sp_k.shape[2]
    window = kw["window"]
    cap = window + chunk
    o = q.new_zeros(B, S, Hq, D)
    done = []
    for p in phases:
        idx = torch.tensor(sorted(rows_of[p]), dtype=torch.long, device=q.device)
        take = lambda t: t.index_select(0, idx)[:, :, p:]  # noqa: E731
        sub = LolaState.empty(len(idx), Hq, Hkv, D, F2, lamn, st.win_k.dtype, q.device, capacity=cap,
                              inplace=st.inplace, sparse_heads=Hs)
        og = _process(sub, take(q), take(k), take(v), take(fq), g, lf,
                      key_mask_new=key_mask_new.index_select(0, idx)[:, p:], chunk=chunk, **kw)
        o = o.index_copy(0, idx, torch.nn.functional.pad(og, (0, 0, 0, 0, p, 0)))
        done.append((idx, sub))
    # merge: one buffer of nb rows, each group's newest token last
    nb = max(sub.nb for _, sub in done)
    size = max(cap, nb) if st.inplace else nb
    win_k = st.win_k.new_zeros(B, Hkv, size, D)
    win_v = st.win_v.new_zeros(B, Hkv, size, D)
    win_mask = torch.zeros(B, size, dtype=torch.bool, device=q.device)
    for idx, sub in done:
        m = sub.nb
        front, back = nb - m, size - nb
        win_k = win_k.index_copy(0, idx, torch.nn.functional.pad(sub.wk, (0, 0, front, back)))
        win_v = win_v.index_copy(0, idx, torch.nn.functional.pad(sub.wv, (0, 0, front, back)))
        sm = sub.wmask if sub.win_mask is not None else torch.ones(len(idx), m, dtype=torch.bool, device=q.device)
        win_mask = win_mask.index_copy(0, idx, torch.nn.functional.pad(sm, (front, back), value=False))
        for name in ("sp_k", "sp_v", "sp_score", "H", "s"):
            setattr(st, name, getattr(st, name).index_copy(0, idx, getattr(sub, name).to(getattr(st, name).dtype)))
    st.win_k, st.win_v, st.win_mask, st.win_fk = win_k, win_v, win_mask, None
    st.nb, st.pos = nb, S
    _ensure_fk(st, kw["phi_k"], window)  # phi of the merged buffer's keys older than the window
    st.phases = row_phases(lead, chunk, q.device)
    drop = st.nb - st.phases.need(S, window)
    if drop > 0:
        _drop_front(st, drop)
    return o


def lola_process(st: LolaState, q, k, v, fq, g, lf, *, phi_k: PhiK, window: int, chunk: int, lam: int,
                 scale: float, key_mask_new=None, backend: str = "auto"):
    """Attend the S new tokens (q [B,Hq,S,D], k/v [B,Hkv,S,D], fq [B,Hq,S,F2]) and update `st` in place.

    phi_k: the layer's key feature map, keys [B, Hx, N, D] -> [B, Hq, N, F2] (kv heads repeated), called on
    buffered keys and eviction candidates. key_mask_new [B, S] bool or None. Returns o [B, S, Hq, D] in q.dtype.
    With Triton, a fresh prefill of at least two chunks runs in two passes (`_lola_parallel`, same result).
    Otherwise the tokens go through the chunk loop; on CUDA a loop of at least 4 chunks captures the work of
    one full chunk (append, attend, score, select, fold) in a CUDA graph and replays it for every later full
    chunk: same kernels, same order, same result, without the per-chunk launch overhead.

    Left padding (lam > 0): each row evicts on the grid of its own real tokens, so a padded row gets the result
    of its prompt alone. A fresh prefill whose paddings are not all whole chunks runs once per phase group
    (`_process_padded_fresh`) and leaves `st.phases`; later calls evict, at each row's boundary, the rows due
    (`_evict_rows` on the sub-batch). No padding (key_mask_new None) or padding of whole chunks only: the plain
    grid, no extra work.
    """
    if lam > 0:
        S = q.shape[2]
        if key_mask_new is not None and st.pos == 0 and st.nb == 0 and st.phases is None:
            return _process_padded_fresh(st, q, k, v, fq, g, lf, phi_k=phi_k, window=window, chunk=chunk, lam=lam,
                                         scale=scale, key_mask_new=key_mask_new, backend=backend)
        if st.phases is not None and st.phases.pending:
            _resolve_pending(st, key_mask_new, S, chunk)
    return _process(st, q, k, v, fq, g, lf, phi_k=phi_k, window=window, chunk=chunk, lam=lam, scale=scale,
                    key_mask_new=key_mask_new, backend=backend)


def _process(st: LolaState, q, k, v, fq, g, lf, *, phi_k: PhiK, window: int, chunk: int, lam: int,
             scale: float, key_mask_new=None, backend: str = "auto"):
    """`lola_process` once the rows' phases are known (`st.phases`)."""
    S = q.shape[2]
    cap = window + chunk
    if st.inplace and st.win_k.shape[2] < cap and st.nb == 0:
        _repack(st, cap)
    _ensure_fk(st, phi_k, window)
    tri = _use_triton(backend, q, k, v, fq, g, lf, st.H)
    if not tri:  # every step below (attention pieces, evictions, phi(k)) on the same, differentiable, path
        backend = "torch"
    if lam == 0 and S > 1 and tri:
        return _lolcats_parallel(st, q, k, v, fq, g, lf, window=window, chunk=chunk, scale=scale,
                                 key_mask_new=key_mask_new, phi_k=phi_k)
    if tri and _parallel_ok(st, q, k, window=window, chunk=chunk, lam=lam):
        return _lola_parallel(st, q, k, v, fq, g, lf, window=window, chunk=chunk, lam=lam, scale=scale,
                              key_mask_new=key_mask_new, phi_k=phi_k)
    phased = st.phases is not None  # rows out of phase: each evicts on its own grid (no graph replay)
    use_graph = (GRAPH_PREFILL and tri and st.inplace and q.is_cuda and S >= 4 * chunk and not phased
                 and not torch.cuda.is_current_stream_capturing())
    outs = []
    graph = None
    steady_seen = False
    i = 0
    while i < S:
        t = st.pos
        n = min(S - i, st.phases.next_boundary(t) if phased else (t // chunk + 1) * chunk - t)
        sl = slice(i, i + n)
        mnew = key_mask_new[:, sl] if key_mask_new is not None else None
        steady = use_graph and n == chunk and t % chunk == 0 and st.nb == window
        if steady and steady_seen:
            if graph is None:
                try:
                    graph = _capture_piece(st, q, k, v, fq, mnew, sl, g, lf, window=window, scale=scale,
                                           lam=lam, backend=backend, phi_k=phi_k)
                except Exception:  # noqa: BLE001 - capture is an optimisation; fall back to eager chunks
                    use_graph = False
                    graph = None
            if graph is not None:
                gr, static, o_s = graph
                for dst, src in zip(static, (q, k, v, fq)):
                    dst.copy_(src[:, :, sl])
                if len(static) > 4:
                    static[4].copy_(mnew)
                gr.replay()
                st.nb = window
                outs.append(o_s.clone())
                st.pos += n
                i += n
                continue
        _append_window(st, k[:, :, sl], v[:, :, sl], mnew, phi_k, window)
        outs.append(_attend_piece(st, q[:, :, sl], fq[:, :, sl], g, lf, window=window, scale=scale, backend=backend,
                                  phi_k=phi_k))
        st.pos += n
        if phased:
            _phased_step_end(st, window=window, lam=lam, phi_k=phi_k, backend=backend)
        elif st.pos % chunk == 0:
            lola_evict(st, window=window, lam=lam, backend=backend, phi_k=phi_k)
        steady_seen = steady_seen or steady
        i += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def _capture_piece(st, q, k, v, fq, mnew, sl, g, lf, *, window, scale, lam, backend, phi_k):
    """Capture one steady full chunk (buffer holds `window` tokens before and after) into a CUDA graph."""
    static = [x[:, :, sl].clone() for x in (q, k, v, fq)]
    if mnew is not None:
        _ensure_mask(st, q.shape[0], q.device)
        static.append(mnew.clone())
    nb0 = st.nb

    def piece():
        _append_window(st, static[1], static[2], static[4] if mnew is not None else None, phi_k, window)
        o = _attend_piece(st, static[0], static[3], g, lf, window=window, scale=scale, backend=backend,
                          phi_k=phi_k)
        lola_evict(st, window=window, lam=lam, backend=backend, phi_k=phi_k)
        return o

    from ..graphs import capture_graph

    gr, o_s = capture_graph(piece, q.device)
    st.nb = nb0  # capture ran no GPU work: the state is still the one before this chunk
    return gr, static, o_s


def _lolcats_parallel(st, q, k, v, fq, g, lf, *, window, chunk, scale, key_mask_new, phi_k):
    """lam == 0, many new tokens, Triton: one parallel pass over [window buffer, new tokens] started
    from (H, s), then fold what the sequential manager would have folded by now."""
    tk = _tk()
    S = q.shape[2]
    cap = window + chunk
    if st.nb == 0 and key_mask_new is None and st.win_mask is None:
        lk, lv, lm = k, v, None  # nothing buffered: the new tokens are the local keys
    else:
        _append_window(st, k, v, key_mask_new)  # no phi_k: the feature cache is made anew below
        lk, lv, lm = st.wk, st.wv, st.wmask
    lfk = phi_k(lk)
    nb = lk.shape[2]
    cs = STATE_CHUNK
    Hs, Ss = tk.chunk_states(lfk, lv, cs, key_mask=lm, H0=st.H, s0=st.s)
    o = tk.hybrid_fwd(q, lk, lv, fq, lfk, g, lf, Hs, Ss, window=window, scale=scale, q_offset=nb - S, key_mask=lm,
                      state_chunk=cs)
    del Hs, Ss
    st.pos += S
    start_pos = max((st.pos // chunk) * chunk - window, 0)  # first position the buffer keeps
    n_fold = nb - (st.pos - start_pos)
    B, Hq = st.H.shape[:2]
    if n_fold > 0:
        w = (torch.ones(B, n_fold, dtype=torch.bool, device=q.device) if lm is None else lm[:, :n_fold])
        H, s = st.H.contiguous(), st.s.contiguous()
        tk.fold_into_state(lfk[:, :, :n_fold], lv[:, :, :n_fold], w[:, None, :].float(), H, s)
        st.H, st.s = H, s
    keep = nb - max(n_fold, 0)
    # the kept tokens go back into a fixed buffer of `cap` rows
    names = [("win_k", lk), ("win_v", lv)] + ([("win_mask", lm)] if lm is not None else [])
    for name, src in names:
        shape = list(src.shape)
        shape[2 if src.dim() > 2 else 1] = cap
        buf = src.new_zeros(shape) if src.dim() > 2 else torch.ones(shape, dtype=src.dtype, device=src.device)
        if src.dim() > 2:
            buf[:, :, :keep] = src[:, :, nb - keep:]
        else:
            buf[:, :keep] = src[:, nb - keep:]
        setattr(st, name, buf)
    st.nb = keep
    if st.inplace and st.feature_cache:  # phi of the kept keys older than the window: computed above
        nl = max(keep - window, 0)
        st.win_fk = lfk.new_zeros(B, Hq, cap - window, lfk.shape[-1])
        st.win_fk[:, :, :nl] = lfk[:, :, nb - keep: nb - keep + nl]
    else:
        st.win_fk = None
    return o


PARALLEL_PREFILL = True  # a fresh Triton prefill of >= 2 chunks takes `_lola_parallel` (two passes)
# the two passes hold O(S) buffers (the state after every eviction, the state of every key block, phi(k) of
# every key, the sparse set of every chunk); above this share of the free GPU memory the chunk loop runs
PARALLEL_PREFILL_MEMORY_SHARE = 0.5


def parallel_prefill_bytes(B, Hq, Hkv, S, D, F2, *, window, chunk, lam, sparse_heads, itemsize) -> int:
    """Transient bytes of `_lola_parallel` for one layer (the O(S) buffers; fp32 states)."""
    cs = math.gcd(math.gcd(window, chunk), 256)
    states = (S // chunk + 1 + -(-S // cs)) * B * Hq * F2 * (D + 1) * 4
    feats = B * Hq * S * F2 * itemsize
    sparse = B * sparse_heads * -(-S // chunk) * lam * (2 * D * itemsize + 1)
    return states + feats + sparse


def _parallel_ok(st: LolaState, q, k, *, window: int, chunk: int, lam: int) -> bool:
    B, Hq, S, D = q.shape
    if not (PARALLEL_PREFILL and lam > 0 and st.pos == 0 and st.nb == 0 and S >= 2 * chunk
            and window > 0 and window % 16 == 0 and chunk % 16 == 0):
        return False
    if not q.is_cuda:
        return True
    need = parallel_prefill_bytes(B, Hq, k.shape[1], S, D, st.H.shape[2], window=window, chunk=chunk, lam=lam,
                                  sparse_heads=st.sp_k.shape[1], itemsize=q.element_size())
    free, _ = torch.cuda.mem_get_info(q.device)
    free += torch.cuda.memory_reserved(q.device) - torch.cuda.memory_allocated(q.device)
    return need <= PARALLEL_PREFILL_MEMORY_SHARE * free


def _lola_parallel(st, q, k, v, fq, g, lf, *, window, chunk, lam, scale, key_mask_new, phi_k):
    """A fresh prefill (empty state, lam > 0, Triton) in two passes, same result as the chunk loop.

    The output of chunk c depends on the stream only through the state left by eviction c - 1: (H, s) and the
    sparse set. Pass 1 runs every eviction (score, select, fold: three kernels each, replayed from one CUDA
    graph) and keeps the state after each; pass 2 attends all chunks at once with the parallel hybrid kernel,
    each block of queries reading the sparse set of its chunk and a linear state made of its chunk's H plus
    the local keys folded since the chunk's first buffered key (block sums, summed within the chunk).
    Needs window and chunk multiples of 16 and, on the GPU, `parallel_prefill_bytes` within
    PARALLEL_PREFILL_MEMORY_SHARE of the free memory (`_parallel_ok`); otherwise the chunk loop runs.
    """
    tk = _tk()
    B, Hq, S, _ = q.shape
    Hkv = k.shape[1]
    Hs = st.sp_k.shape[1]
    C, W = chunk, window
    km = key_mask_new.bool() if key_mask_new is not None else None
    fk = phi_k(k)  # [B, Hq, S, F2]: every key is an eviction candidate or attended linearly at some point
    n_ev = S // C
    ev = tk.PrefillEvictions(fk, v, km, n_ev=n_ev, lam=lam, chunk=C, window=W, sparse_heads=Hs, eps=ref.EPS_SRE)
    ev.run(graph=GRAPH_PREFILL)
    # Overlapping pass 2 with the evictions (pass 2 in 4 segments on a low-priority stream, evictions on a
    # high-priority one) measured the same on the H200 (5.98 vs 5.64 ms, 8.23 vs 8.52 ms at 32k, D = 64:
    # benchmarks/results/lola/speed-h200-34dbded.json): the attention blocks fill the SMs whenever they run. One pass.

    # each block of keys' linear state: its chunk's H plus the keys since the chunk's first buffered key
    cs = math.gcd(math.gcd(W, C), 256)  # a multiple of 16 that divides both: chunk starts fall on blocks
    Hs_eff, Ss_eff = tk.local_states(fk, v, km, ev.H_all, ev.s_all, state_chunk=cs, chunk=C, window=W)
    # every chunk's sparse set, gathered from the keys by position
    nch = -(-S // C)
    idx = ev.SPIDX[:nch].permute(1, 2, 0, 3).long()  # [B, Hs, nch, lam]
    bi = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    hi = (torch.arange(Hs, device=q.device) * Hkv // Hs).view(1, Hs, 1, 1)
    spk, spv = k[bi, hi, idx.clamp_min(0)], v[bi, hi, idx.clamp_min(0)]
    o = tk.hybrid_fwd(q, k, v, fq, fk, g, lf, Hs_eff, Ss_eff, window=W, scale=scale, q_offset=0, key_mask=km,
                      state_chunk=cs, sparse_k=spk, sparse_v=spv, sparse_valid=idx >= 0, sparse_chunk=C,
                      block_m=min(64, C & -C), block_n=min(64, cs))  # query blocks never straddle a chunk
    del Hs_eff, Ss_eff, spk, spv

    # the state the chunk loop would have left: after eviction n_ev, window buffer from the last chunk start
    sc = ev.SPSC[n_ev]
    order = torch.argsort(sc, dim=-1, descending=True, stable=True)
    sc = torch.gather(sc, -1, order)
    fin = torch.gather(ev.SPIDX[n_ev].long(), -1, order)
    ok = (fin >= 0)[..., None]
    sk = torch.where(ok, k[bi[..., 0], hi[..., 0], fin.clamp_min(0)], 0).to(st.sp_k.dtype)
    sv = torch.where(ok, v[bi[..., 0], hi[..., 0], fin.clamp_min(0)], 0).to(st.sp_v.dtype)
    start = max(n_ev * C - W, 0)
    nb = S - start
    if st.inplace:  # same storage, as the chunk loop keeps it
        st.sp_k.copy_(sk)
        st.sp_v.copy_(sv)
        st.sp_score.copy_(sc)
        st.H.copy_(ev.H_all[n_ev])
        st.s.copy_(ev.s_all[n_ev])
        st.win_k[:, :, :nb] = k[:, :, start:]
        st.win_v[:, :, :nb] = v[:, :, start:]
        if st.win_fk is not None:  # phi of the buffered keys older than the window
            nl = max(nb - W, 0)
            st.win_fk[:, :, :nl] = fk[:, :, start:start + nl]
        if km is not None:
            _ensure_mask(st, B, q.device)
            st.win_mask[:, :nb] = km[:, start:]
    else:
        st.sp_k, st.sp_v, st.sp_score = sk, sv, sc
        st.H, st.s = ev.H_all[n_ev].clone(), ev.s_all[n_ev].clone()
        st.win_k, st.win_v = k[:, :, start:].to(st.win_k.dtype), v[:, :, start:].to(st.win_v.dtype)
        if km is not None:
            st.win_mask = km[:, start:]
    st.nb = nb
    st.pos = S
    return o
