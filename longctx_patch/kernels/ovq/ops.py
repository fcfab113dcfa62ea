"""Chunk-parallel OVQ attention driver (dispatches to Triton or the PyTorch reference).

:func:`ovq_attention` processes new tokens on top of a dictionary state and an open (incomplete)
chunk: the open chunk's keys are prepended so that chunks always start at multiples of
``chunk_size`` of the absolute (cache) position.  Every complete chunk is absorbed into the
dictionary after its queries have attended; an incomplete last chunk is returned as the new open
chunk.  The same code path serves training forwards, prefill and token-by-token decode, so that
prefill-then-decode equals one forward over the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import ConfigError
from ..backend import resolve_backend as _resolve
from .options import DEFAULT_OPTIONS, OvqKernelOptions
from .reference import (OVQState, apply_assignments, chunk_attention_ref, merge_keys, plan_growth,
                        select_and_assign, target_int, update_state)


@dataclass
class OpenChunk:
    """Keys / values / key mask of the tokens of the current, not yet absorbed chunk."""
    keys: Tensor    # [B, H, b, D]
    values: Tensor  # [B, H, b, Dv]
    valid: Tensor   # [B, b] bool

    @property
    def length(self) -> int:
        return self.keys.shape[2]


def _is_pow2(n: int) -> bool:
    return n >= 16 and (n & (n - 1)) == 0


def resolve_backend(backend: str, q: Tensor, k: Tensor, v: Tensor) -> str:
    """'triton' or 'torch' (`kernels.backend.resolve_backend`), with the OVQ kernels' shape limits."""
    be = _resolve(backend, q, k, v, what="ovq")
    if be == "torch":
        return "torch"
    # head_dim * itemsize <= 256 bytes: the fused prefill kernel holds [128, D] tiles; at bf16 D = 256 or fp32
    # D = 128 it asks for more shared memory than an H100/H200 block has (tests/compile_sm90.py)
    width = max(q.shape[-1], v.shape[-1]) * q.element_size()
    shapes_ok = _is_pow2(q.shape[-1]) and _is_pow2(v.shape[-1]) and q.shape[-1] >= 16 and width <= 256
    if shapes_ok:
        return "triton"
    if backend == "triton":
        raise ConfigError(f"backend='triton': the Triton OVQ kernels need power-of-two head dims from 16 to "
                          f"{256 // q.element_size()} in {q.dtype}, got {q.shape[-1]} / {v.shape[-1]}; use "
                          "backend='auto' or 'torch'")
    return "torch"


class OVQChunkAttention(torch.autograd.Function):
    """The Triton chunk attention (`triton_attn`): `reference.chunk_attention_ref` with the same arguments, its
    backward for q, k and v."""

    @staticmethod
    def forward(ctx, q, k, v, bias, n_dict: int, q_off: int):
        from .triton_attn import attn_fwd

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        bias = bias.contiguous().float()
        o, lse = attn_fwd(q, k, v, bias, n_dict, q_off)
        ctx.save_for_backward(q, k, v, bias, o, lse)
        ctx.n_dict, ctx.q_off = n_dict, q_off
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        from .triton_attn import attn_bwd

        q, k, v, bias, o, lse = ctx.saved_tensors
        dq, dk, dv = attn_bwd(q, k, v, bias, o, lse, do.contiguous().to(q.dtype), ctx.n_dict, ctx.q_off)
        return dq, dk, dv, None, None, None


def chunk_attention_triton(q, k, v, bias, n_dict: int, q_off: int):
    """Triton version of :func:`reference.chunk_attention_ref` (same arguments)."""
    return OVQChunkAttention.apply(q, k, v, bias, n_dict, q_off)


def _check_options(options) -> None:
    if not isinstance(options, OvqKernelOptions):
        raise ConfigError(f"ovq: options must be an OvqKernelOptions (kernels.ovq.options), got "
                          f"{type(options).__name__}")


def ovq_attention(q: Tensor, k: Tensor, v: Tensor, state: OVQState | None, open_chunk: OpenChunk | None,
                  key_valid: Tensor | None, *, chunk_size: int, max_centroids: int, growth: float,
                  backend: str = "auto", seen_bound: int | None = None, exact_assign: bool = True,
                  parallel: bool | None = None, options: OvqKernelOptions = DEFAULT_OPTIONS):
    """OVQ attention of new tokens.

    ``q``: ``[B, Hq, S, D]`` (unit-normalised, times beta); ``k``, ``v``: ``[B, H, S, D]``;
    ``key_valid``: ``[B, S]`` bool (True = real token) or None.
    ``seen_bound``: host-side upper bound of the tokens already absorbed (avoids a device sync);
    when None it is read from the state.
    Returns ``(o [B, Hq, S, Dv], state, open_chunk, seen_bound)``.

    With the Triton backend and no gradient needed, the fused path of ``triton_fast`` runs and
    updates ``state`` in place; otherwise the state is never modified (a new one is returned).
    When a gradient is needed and the call starts at a chunk boundary (no open chunk: every training
    forward), ``parallel`` selects the chunk-parallel path (:func:`_ovq_parallel`); ``parallel=False``
    runs the chunk-by-chunk loop, which gives the same result. ``None`` (default): parallel on CUDA, where
    the loop is bound by kernel launches; the loop on the CPU, where it is the faster of the two.
    ``options``: how the Triton kernels run (`options.OvqKernelOptions`: whether the fused path replays its runs of
    chunks from a CUDA graph and reads row means kept beside the sums, and the launch tiles), never what they compute
    (up to rounding); benchmarks pass others to measure them.
    """
    B, Hq, S, D = q.shape
    H = k.shape[1]
    Dv = v.shape[-1]
    C = chunk_size
    be = resolve_backend(backend, q, k, v)
    _check_options(options)
    if state is None:
        state = OVQState.empty(B, H, max_centroids, D, Dv, device=q.device)
        seen_bound = 0
    if seen_bound is None:
        seen_bound = int(state.seen.max().item()) if B > 0 else 0
    if key_valid is None:
        key_valid = torch.ones(B, S, dtype=torch.bool, device=q.device)
    if open_chunk is not None and open_chunk.length > 0:
        kk = torch.cat([open_chunk.keys.to(k.dtype), k], dim=2)
        vv = torch.cat([open_chunk.values.to(v.dtype), v], dim=2)
        valid = torch.cat([open_chunk.valid, key_valid], dim=1)
        off = open_chunk.length
    else:
        kk, vv, valid, off = k, v, key_valid, 0
    L = off + S
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                              or state.key_sums.requires_grad or state.value_sums.requires_grad)
    if be == "triton" and not needs_grad:
        from .triton_fast import ovq_forward_fast
        if not (state.key_sums.is_contiguous() and state.value_sums.is_contiguous() and state.counts.is_contiguous()):
            state = OVQState(state.key_sums.contiguous(), state.value_sums.contiguous(), state.counts.contiguous(),
                             state.n_active, state.seen)
        o, state, start, seen_bound = ovq_forward_fast(q, kk, vv, valid, off, state, seen_bound,
                                                       chunk_size=C, max_centroids=max_centroids, growth=growth,
                                                       exact_assign=exact_assign, options=options)
        new_open = OpenChunk(kk[:, :, start:], vv[:, :, start:], valid[:, start:]) if start < L else None
        return o, state, new_open, seen_bound
    attn = chunk_attention_triton if be == "triton" else chunk_attention_ref
    if parallel is None:
        parallel = q.is_cuda
    if needs_grad and parallel and off == 0 and S > 0:
        return _ovq_parallel(q, k, v, key_valid, state, seen_bound, attn, be, chunk_size=C,
                             max_centroids=max_centroids, growth=growth, exact_assign=exact_assign,
                             options=options)
    outs = []
    new_open = None
    for s0 in range(0, L, C):
        e = min(s0 + C, L)
        qs = max(s0, off)
        kc, vc, validc = kk[:, :, s0:e], vv[:, :, s0:e], valid[:, s0:e]
        n_dict = target_int(seen_bound, max_centroids, growth)
        if e > qs:
            k_all, v_all, bias = merge_keys(state, kc, vc, validc, n_dict, q.dtype)
            outs.append(attn(q[:, :, qs - off:e - off], k_all, v_all, bias, n_dict, qs - s0))
        if e - s0 == C:
            if be == "triton":
                from .triton_fast import assign_rows_triton
                n_real = validc.sum(-1).to(torch.long)
                n_new = plan_growth(state.seen, state.n_active, n_real, max_centroids, growth)
                assign = assign_rows_triton(kc.detach(), validc, state, n_new, n_dict, exact_assign=exact_assign,
                                            options=options)
                state = apply_assignments(state, kc, vc, assign, n_new, n_real)
            else:
                state = update_state(state, kc, vc, validc, max_centroids, growth)
            seen_bound += C
        else:
            new_open = OpenChunk(kc.detach(), vc.detach(), validc)
    o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return o, state, new_open, seen_bound


def ovq_open_attention(q: Tensor, state: OVQState, buffer: OpenChunk, n_dict: int, *, backend: str = "auto",
                       options: OvqKernelOptions = DEFAULT_OPTIONS) -> Tensor:
    """Attention of queries that come after every key of an open-chunk buffer (a decode step whose new key is
    already written into it): one softmax over the first ``n_dict`` dictionary rows and the buffer's valid slots.

    ``buffer``: ``[B, H, C, D]`` keys / values and ``[B, C]`` validity; slots not in use are invalid, whatever
    they hold. The launch depends on ``n_dict`` and the shapes only, not on how many slots are in use, so a CUDA
    graph captured once replays every step of a chunk (methods/ovq: ``OVQLayer``, decode_graphs.py). Equals
    :func:`ovq_attention` of the same queries over the open tokens (bit for bit on Triton; the reference adds
    the masked slots' exact zeros in another order). No gradient. ``options``: the kernels' launch tiles
    (`options.OvqKernelOptions`). Returns ``[B, Hq, M, Dv]``."""
    be = resolve_backend(backend, q, buffer.keys, buffer.values)
    _check_options(options)
    if be == "triton":
        from .triton_fast import ovq_open_attention_fast

        return ovq_open_attention_fast(q, buffer.keys, buffer.values, buffer.valid, state, n_dict, options)
    kk, vv, bias = merge_keys(state, buffer.keys, buffer.values, buffer.valid, n_dict, q.dtype)
    return chunk_attention_ref(q, kk, vv, bias, n_dict, buffer.length - 1)


# ----------------------------------------------------------------------------------------------
# chunk-parallel training path
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def _assign_all(k: Tensor, v: Tensor, valid: Tensor, state: OVQState, seen_bound: int, be: str, *, chunk_size: int,
                max_centroids: int, growth: float, exact_assign: bool,
                options: OvqKernelOptions = DEFAULT_OPTIONS) -> tuple[Tensor, OVQState]:
    """The discrete pass: the row of every token of every complete chunk, ``[T, B, H, C]`` int64 (-1 for
    padding), and the state after the last complete chunk (its sums are not used: the differentiable
    pass recomputes them). ``state`` is not modified."""
    B, H, L = k.shape[:3]
    C = chunk_size
    T = L // C
    rows = torch.full((T, B, H, C), -1, dtype=torch.long, device=k.device)
    st = OVQState(state.key_sums.detach().clone().contiguous(), state.value_sums.detach().clone().contiguous(),
                  state.counts.clone().contiguous(), state.n_active.clone(), state.seen.clone())
    if T == 0:
        return rows, st
    if be == "triton":
        from .triton_fast import ovq_forward_fast

        _, st, _, _ = ovq_forward_fast(None, k.detach(), v.detach(), valid, 0, st, seen_bound, chunk_size=C,
                                       max_centroids=max_centroids, growth=growth, exact_assign=exact_assign,
                                       rows_out=rows, options=options)
        return rows, st
    for t in range(T):
        kc, vc, vd = k[:, :, t * C:(t + 1) * C], v[:, :, t * C:(t + 1) * C], valid[:, t * C:(t + 1) * C]
        n_real = vd.sum(-1).to(torch.long)
        n_new = plan_growth(st.seen, st.n_active, n_real, max_centroids, growth)
        rows[t] = select_and_assign(st, kc, vd, n_new)
        st = apply_assignments(st, kc, vc, rows[t], n_new, n_real)
    return rows, st


def _ovq_parallel(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, state: OVQState, seen_bound: int, attn, be: str, *,
                  chunk_size: int, max_centroids: int, growth: float, exact_assign: bool,
                  options: OvqKernelOptions = DEFAULT_OPTIONS):
    """Chunk-parallel OVQ for training: the same maths as the chunk-by-chunk loop, in two passes.

    1. Discrete (no gradient): the row every token joins (:func:`_assign_all`; the fused Triton
       update on CUDA). Assignments depend only on the detached keys, as in the loop.
    2. Differentiable: each chunk's contribution to the row sums is one scatter-add; an exclusive
       cumulative sum over chunks gives the dictionary every chunk attends to (the state before it
       absorbed anything), so the gradient reaches earlier chunks' keys and values exactly as through
       the loop. All chunks then attend at once: they are folded into the batch dimension of one
       chunk-attention call (dictionary rows + the chunk's own causal keys, one softmax).
    Memory: every chunk's dictionary at once, ``T x B x H x rows x (D + Dv)`` float32 (about 3x the
    loop's peak at 8k tokens on the H200, docs/PERFORMANCE.md); the ovq method's ``train_path=loop``
    trades the speed back for memory.
    """
    B, Hq, S, D = q.shape
    H = k.shape[1]
    Dv = v.shape[-1]
    C, N = chunk_size, max_centroids
    L = S
    T = L // C                       # complete chunks (absorbed)
    Tp = -(-L // C)                  # chunks with queries
    rows, st = _assign_all(k, v, valid, state, seen_bound, be, chunk_size=C, max_centroids=N, growth=growth,
                           exact_assign=exact_assign, options=options)
    Nu = min(N, target_int(seen_bound + T * C, N, growth))        # rows any complete chunk can reach
    Nd = min(Nu, target_int(seen_bound + (Tp - 1) * C, N, growth))  # rows any chunk's queries can see
    dev = q.device
    init_k = state.key_sums[:, :, :Nu].float()
    init_v = state.value_sums[:, :, :Nu].float()
    init_c = state.counts[:, :, :Nu].float()
    if T > 0:
        w = (rows >= 0).to(torch.float32)                                            # [T, B, H, C]
        idx = rows.clamp_min(0)
        kc = k[:, :, :T * C].reshape(B, H, T, C, D).permute(2, 0, 1, 3, 4).float() * w[..., None]
        vc = v[:, :, :T * C].reshape(B, H, T, C, Dv).permute(2, 0, 1, 3, 4).float() * w[..., None]
        ck = torch.zeros(T, B, H, Nu, D, device=dev).scatter_add(3, idx[..., None].expand(T, B, H, C, D), kc)
        cv = torch.zeros(T, B, H, Nu, Dv, device=dev).scatter_add(3, idx[..., None].expand(T, B, H, C, Dv), vc)
        cc = torch.zeros(T, B, H, Nu, device=dev).scatter_add(3, idx, w)
        cum_k, cum_v, cum_c = ck.cumsum(0), cv.cumsum(0), cc.cumsum(0)
    # dictionary before chunk t (t = 0 .. Tp-1): the initial state plus chunks 0 .. t-1
    if Tp > 1:
        bk = torch.cat([torch.zeros_like(init_k)[None], cum_k[:Tp - 1]], 0) + init_k[None]
        bv = torch.cat([torch.zeros_like(init_v)[None], cum_v[:Tp - 1]], 0) + init_v[None]
        bc = torch.cat([torch.zeros_like(init_c)[None], cum_c[:Tp - 1]], 0) + init_c[None]
    else:
        bk, bv, bc = init_k[None], init_v[None], init_c[None]
    bk, bv, bc = bk[..., :Nd, :], bv[..., :Nd, :], bc[..., :Nd]
    cnt = bc.clamp_min(1.0)[..., None]
    mu_k, mu_v = (bk / cnt).to(q.dtype), (bv / cnt).to(q.dtype)                      # [Tp, B, H, Nd, *]
    bias_d = torch.where(bc > 0, torch.log(bc.clamp_min(1e-30)), torch.full_like(bc, float("-inf")))
    pad = Tp * C - L
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad)).reshape(B, H, Tp, C, D).permute(2, 0, 1, 3, 4)
    vp = torch.nn.functional.pad(v, (0, 0, 0, pad)).reshape(B, H, Tp, C, Dv).permute(2, 0, 1, 3, 4)
    qp = torch.nn.functional.pad(q, (0, 0, 0, pad)).reshape(B, Hq, Tp, C, D).permute(2, 0, 1, 3, 4)
    vd = torch.nn.functional.pad(valid, (0, pad), value=False).reshape(B, Tp, C).permute(1, 0, 2)  # [Tp, B, C]
    bias_c = torch.where(vd, 0.0, float("-inf")).to(torch.float32)[:, :, None, :].expand(Tp, B, H, C)
    k_all = torch.cat([mu_k, kp.to(q.dtype)], 3).reshape(Tp * B, H, Nd + C, D)
    v_all = torch.cat([mu_v, vp.to(q.dtype)], 3).reshape(Tp * B, H, Nd + C, Dv)
    bias = torch.cat([bias_d, bias_c], 3).reshape(Tp * B, H, Nd + C).contiguous()
    qf = qp.reshape(Tp * B, Hq, C, D)
    step = max(1, 65535 // Hq)       # CUDA grid limit on the batch x heads axis of the Triton kernels
    outs = [attn(qf[i:i + step], k_all[i:i + step], v_all[i:i + step], bias[i:i + step], Nd, 0)
            for i in range(0, Tp * B, step)]
    o = torch.cat(outs, 0) if len(outs) > 1 else outs[0]
    o = o.reshape(Tp, B, Hq, C, Dv).permute(1, 2, 0, 3, 4).reshape(B, Hq, Tp * C, Dv)[:, :, :L]
    # the state after the complete chunks (differentiable sums), and the open chunk
    if T > 0:
        fk = torch.nn.functional.pad(init_k + cum_k[-1], (0, 0, 0, N - Nu))
        fv = torch.nn.functional.pad(init_v + cum_v[-1], (0, 0, 0, N - Nu))
        fc = torch.nn.functional.pad(init_c + cum_c[-1], (0, N - Nu))
        new_state = OVQState(key_sums=_keep_tail(fk, state.key_sums, Nu), value_sums=_keep_tail(fv, state.value_sums, Nu),
                             counts=_keep_tail(fc, state.counts, Nu), n_active=st.n_active, seen=st.seen)
    else:
        new_state = state
    new_open = OpenChunk(k[:, :, T * C:].detach(), v[:, :, T * C:].detach(), valid[:, T * C:]) if T * C < L else None
    return o, new_state, new_open, seen_bound + T * C


def _keep_tail(new: Tensor, old: Tensor, n: int) -> Tensor:
    """``new`` for rows ``< n``, ``old`` (the untouched rows of the initial state) for the rest."""
    if n >= old.shape[2]:
        return new
    return torch.cat([new[:, :, :n], old[:, :, n:].to(new.dtype)], 2)


# ----------------------------------------------------------------------------------------------
# rows with their own chunk grids (left-padded batches)
# ----------------------------------------------------------------------------------------------
def phase_open_len(phase: int, length: int, chunk_size: int) -> int:
    """Tokens of a row's open chunk after ``length`` positions when its chunks start at ``phase + j * C``
    (0 while its grid has not begun: the first ``phase`` positions are padding it never sees)."""
    return (length - phase) % chunk_size if length >= phase else 0


def _put(dst: Tensor, idx: Tensor, src: Tensor) -> Tensor:
    """``dst`` with rows ``idx`` replaced by ``src``; in place unless autograd records either."""
    src = src.to(dst.dtype)
    if torch.is_grad_enabled() and (dst.requires_grad or src.requires_grad):
        return dst.index_copy(0, idx, src)
    return dst.index_copy_(0, idx, src)


def ovq_attention_phased(q: Tensor, k: Tensor, v: Tensor, state: OVQState | None, open_chunk: OpenChunk | None,
                         key_valid: Tensor | None, phases: tuple[int, ...], past_len: int, *, chunk_size: int,
                         max_centroids: int, growth: float, backend: str = "auto", exact_assign: bool = True,
                         parallel: bool | None = None, keep_state: bool = True,
                         options: OvqKernelOptions = DEFAULT_OPTIONS):
    """:func:`ovq_attention` for a batch whose rows have their own chunk grids (a left-padded batch).

    Row ``r``'s chunks start at positions ``phases[r] + j * C`` (host ints in ``[0, C)``: its left padding
    modulo ``C``; the padding before ``phases[r]`` is dropped, the rest is whole chunks, which change nothing),
    so each row computes what it computes alone. ``past_len``: positions (padding included) before ``q``.
    ``open_chunk``: each row's open tokens, right-aligned (the last ``phase_open_len(phases[r], past_len, C)``
    columns; columns left of a row's own part are masked), its width the longest of them; the one returned
    has the same layout.

    Rows in phase form one call of :func:`ovq_attention` on their sub-batch (its state rows gathered, then
    written back). Rows that absorb no chunk in this call (most decode steps) share one call whatever their
    phase: without an absorb only the key mask matters. When that call holds every row (a decode step where
    no row reaches the end of its chunk), it is the plain call on the whole batch: no gather, no copy.
    ``keep_state=False`` (no cache): the state and open chunk are not assembled (returned as None).
    Returns ``(o [B, Hq, S, Dv], state, open_chunk)``; outputs at dropped padding columns are 0.
    """
    B, Hq, S, _ = q.shape
    H, D, Dv = k.shape[1], k.shape[-1], v.shape[-1]
    C = chunk_size
    dev = q.device
    kw = dict(chunk_size=C, max_centroids=max_centroids, growth=growth, backend=backend, exact_assign=exact_assign,
              parallel=parallel, options=options)
    if len(phases) != B:
        raise ValueError(f"ovq_attention_phased: {len(phases)} phases for a batch of {B}")
    if key_valid is None:
        key_valid = torch.ones(B, S, dtype=torch.bool, device=dev)
    width = open_chunk.length if open_chunk is not None else 0
    L0, L1 = past_len, past_len + S
    by_phase: dict[int, list[int]] = {}
    for r, p in enumerate(phases):
        by_phase.setdefault(int(p), []).append(r)
    # (rows, open columns to take, leading columns to drop, host bound of the tokens absorbed, absorbs)
    calls: list[tuple[list[int], int, int, int, bool]] = []
    idle: list[tuple[list[int], int, int, int, bool]] = []
    for p, rows in by_phase.items():
        o = phase_open_len(p, L0, C)
        trim = min(max(p - L0, 0), S)
        bound = L0 - p - o if L0 >= p else 0
        absorbs = o + S - trim >= C
        (calls if absorbs else idle).append((rows, o, trim, bound, absorbs))
    if idle:  # no absorb: one call; off + S - trim < C holds (a group with trim > 0 has no open tokens)
        rows = sorted(r for g in idle for r in g[0])
        calls.append((rows, max(g[1] for g in idle), min(g[2] for g in idle), max(g[3] for g in idle), False))
    o_all = None
    results = []
    for rows, off, trim, bound, absorbs in calls:
        whole = len(rows) == B
        idx = None if whole else torch.tensor(rows, device=dev, dtype=torch.long)
        if trim >= S:  # rows whose grid has not begun: padding only, nothing to attend or absorb
            results.append((idx, None, None))
            continue

        def take(x: Tensor, idx=idx) -> Tensor:
            return x if idx is None else x.index_select(0, idx.to(x.device))

        st = state if whole or state is None else OVQState(*(take(t) for t in (
            state.key_sums, state.value_sums, state.counts, state.n_active, state.seen)))
        op = None
        if off > 0:
            op = OpenChunk(take(open_chunk.keys[:, :, width - off:]), take(open_chunk.values[:, :, width - off:]),
                           take(open_chunk.valid[:, width - off:]))
        qs, ks, vs = (take(x[:, :, trim:]) for x in (q, k, v))
        vd = take(key_valid[:, trim:])
        o, st, op, _ = ovq_attention(qs, ks, vs, st, op, vd, seen_bound=bound, **kw)
        o = torch.nn.functional.pad(o, (0, 0, trim, 0)) if trim else o
        if idx is None:
            o_all = o
        else:
            if o_all is None:
                o_all = o.new_zeros(B, Hq, S, Dv)
            o_all = o_all.index_copy(0, idx, o)
        results.append((idx, st if absorbs else None, op))
    if o_all is None:
        o_all = q.new_zeros(B, Hq, S, Dv)
    if not keep_state:
        return o_all, None, None
    # the state: rows of the calls that absorbed written back (an idle call leaves its rows as they were)
    for idx, st, _ in results:
        if st is None:
            continue
        if idx is None:
            state = st
        else:
            if state is None:
                state = OVQState.empty(B, H, max_centroids, D, Dv, device=dev)
            state = OVQState(_put(state.key_sums, idx, st.key_sums), _put(state.value_sums, idx, st.value_sums),
                             _put(state.counts, idx, st.counts), _put(state.n_active, idx, st.n_active),
                             _put(state.seen, idx, st.seen))
    if state is None:  # no call absorbed and there was no state: the empty dictionary
        state = OVQState.empty(B, H, max_centroids, D, Dv, device=dev)
    # the open chunk: each row's open tokens right-aligned in the longest's width
    W = max(phase_open_len(int(p), L1, C) for p in phases)
    if W == 0:
        return o_all, state, None
    if len(results) == 1 and results[0][0] is None and results[0][2] is not None:
        op = results[0][2]
        return o_all, state, OpenChunk(op.keys[:, :, op.length - W:], op.values[:, :, op.length - W:],
                                       op.valid[:, op.length - W:])
    keys = k.new_zeros(B, H, W, D)
    values = v.new_zeros(B, H, W, Dv)
    valid = torch.zeros(B, W, dtype=torch.bool, device=dev)
    for idx, _, op in results:
        if op is None or op.length == 0:
            continue
        w = min(op.length, W)
        pad = W - w
        ok, ov, oval = op.keys[:, :, -w:], op.values[:, :, -w:], op.valid[:, -w:]
        if pad:
            ok = torch.nn.functional.pad(ok, (0, 0, pad, 0))
            ov = torch.nn.functional.pad(ov, (0, 0, pad, 0))
            oval = torch.nn.functional.pad(oval, (pad, 0), value=False)
        keys.index_copy_(0, idx, ok.to(keys.dtype))  # a call over every row was returned above
        values.index_copy_(0, idx, ov.to(values.dtype))
        valid.index_copy_(0, idx, oval)
    return o_all, state, OpenChunk(keys, values, valid)
