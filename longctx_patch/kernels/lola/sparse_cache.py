"""The LoLA sparse-cache state machine (docs/lola.md, "Chunks and eviction order") on a `LolaState`.

Tokens are processed in pieces that never cross a multiple of `chunk` (the token index from the row's first real
token: the rows of a left-padded batch keep their own grids, `padded.RowPhases`); each time the index reaches a
multiple of `chunk`, the pairs that have left the window (everything older than the last `window` tokens) are
scored together with the sparse cache and the `lam` best stay exact, the others are folded into (H, s). Until then
they are attended linearly by phi(q) . phi(k) from the window buffer, exactly as LoLCATs would, so lam = 0 is
LoLCATs exactly and a prefill cut anywhere gives the same result as token-by-token decoding.
"""

from __future__ import annotations

import dataclasses

import torch

from ..graphs import capturing
from . import ops, padded, prefill
from .state import (LolaRun, LolaState, StateSizes, append_window, attend_piece, attend_step, drop_front,
                    ensure_fk, ensure_mask, lola_evict, repack)


def lola_process(st: LolaState, q, k, v, fq, g, lf, run: LolaRun, *, key_mask_new=None):
    """Attend the S new tokens (q [B,Hq,S,D], k/v [B,Hkv,S,D], fq [B,Hq,S,F2]; g/lf [Hq]) and update `st` in place.

    run (`state.LolaRun`, the layer's settings, the same for every call): the key feature map `phi_k`, keys
    [B, Hx, N, D] -> [B, Hq, N, F2] (kv heads repeated), called on buffered keys and eviction candidates; window,
    chunk, lam, scale, backend, combine and tuning. key_mask_new [B, S] bool or None. Returns o [B, S, Hq, D] in
    q.dtype.
    With Triton, a prefill of at least two chunks runs in two passes (`prefill.lola_parallel`, same result): a fresh
    one, or one that continues an in-place state whose rows share one eviction grid (`prefill.parallel_ok`).
    Otherwise the tokens go through the chunk loop; on CUDA a loop of at least 4 chunks captures the work of
    one full chunk (append, attend, score, select, fold) in a CUDA graph and replays it for every later full
    chunk: same kernels, same order, same result, without the per-chunk launch overhead.

    Left padding (lam > 0): each row evicts on the grid of its own real tokens, so a padded row gets the result
    of its prompt alone. A fresh prefill whose paddings are not all whole chunks runs once per phase group
    (`process_padded_fresh`) and leaves `st.phases`; later calls evict, at each row's boundary, the rows due
    (`evict_rows` on the sub-batch). No padding (key_mask_new None) or padding of whole chunks only: the plain
    grid, no extra work.

    One new token on an in-place state whose rows share one grid takes `decode_step` (device state only: what a
    CUDA graph of a decode step replays). After every call made outside a capture `st.nb_t` equals `st.nb`.

    run.combine: how the exact and linear terms meet in every attention (`reference._finish`): "shifted" (LoLCATs,
    as trained) or "unshifted" (the LoLA authors'). The state (evictions, folds) does not depend on it. run.tuning:
    the kernels' launch settings and the prefill's paths (`tuning.LolaTuning`: the two-pass prefill, graph replay).
    """
    o = _dispatch(st, q, k, v, fq, g, lf, run, key_mask_new)
    if st.inplace and st.nb_t is not None and not capturing(q.device):
        st.nb_t.fill_(st.nb)
    return o


def _dispatch(st: LolaState, q, k, v, fq, g, lf, run: LolaRun, key_mask_new):
    if run.lam > 0:
        S = q.shape[2]
        if key_mask_new is not None and st.pos == 0 and st.nb == 0 and st.phases is None:
            return process_padded_fresh(st, q, k, v, fq, g, lf, run, key_mask_new)
        if st.phases is not None and st.phases.pending:
            padded.resolve_pending(st, key_mask_new, S, run.chunk)
    return _process(st, q, k, v, fq, g, lf, run, key_mask_new)


def _process(st: LolaState, q, k, v, fq, g, lf, run: LolaRun, key_mask_new=None):
    """`lola_process` once the rows' phases are known (`st.phases`)."""
    window, chunk, lam = run.window, run.chunk, run.lam
    S = q.shape[2]
    cap = window + chunk
    if st.inplace and st.win_k.shape[2] < cap and st.nb == 0:
        repack(st, cap)
    ensure_fk(st, run.phi_k, window)
    tri = ops.use_triton(run.backend, q, k, v, fq, g, lf, st.H)
    if not tri:  # every step below (attention pieces, evictions, phi(k)) on the same, differentiable, path
        run = dataclasses.replace(run, backend="torch")
    if lam == 0 and S > 1 and tri:
        return prefill.lolcats_parallel(st, q, k, v, fq, g, lf, run, key_mask_new)
    if tri and prefill.parallel_ok(st, q, k, window=window, chunk=chunk, lam=lam, tuning=run.tuning):
        return prefill.lola_parallel(st, q, k, v, fq, g, lf, run, key_mask_new)
    phased = st.phases is not None  # rows out of phase: each evicts on its own grid (no graph replay)
    if S == 1 and st.inplace and not phased and st.nb_t is not None and st.win_k.shape[2] == cap:
        return decode_step(st, q, k, v, fq, g, lf, run, key_mask_new)
    use_graph = (run.tuning.graph_prefill and tri and st.inplace and q.is_cuda and S >= 4 * chunk and not phased
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
                    graph = capture_piece(st, q[:, :, sl], k[:, :, sl], v[:, :, sl], fq[:, :, sl], mnew, g, lf, run)
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
        append_window(st, k[:, :, sl], v[:, :, sl], mnew, run.phi_k, window)
        outs.append(attend_piece(st, q[:, :, sl], fq[:, :, sl], g, lf, run))
        st.pos += n
        if phased:
            padded.phased_step_end(st, run)
        elif st.pos % chunk == 0:
            lola_evict(st, window=window, lam=lam, backend=run.backend, phi_k=run.phi_k, tuning=run.tuning)
        steady_seen = steady_seen or steady
        i += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def decode_step(st: LolaState, q, k, v, fq, g, lf, run: LolaRun, key_mask_new):
    """One new token (S = 1) on device state: the write row and the attention's length come from `st.nb_t`, not from
    the host's `st.nb`, so one CUDA graph serves every position inside a chunk (decode_graphs.py); only the eviction
    at the end of a chunk reads host sizes (its step has a graph of its own: `LolaLayer.graph_key`). Same result as
    the chunk loop's piece of one token (`append_window`, `attend_piece`)."""
    window = run.window
    B = q.shape[0]
    if key_mask_new is not None:
        ensure_mask(st, B, q.device)
    row = st.nb_t[:1]
    st.win_k.index_copy_(2, row, k.to(st.win_k.dtype))
    st.win_v.index_copy_(2, row, v.to(st.win_v.dtype))
    if st.win_mask is not None:
        if key_mask_new is None:
            st.win_mask.index_fill_(1, row, True)
        else:
            st.win_mask.index_copy_(1, row, key_mask_new.bool())
    if st.win_fk is not None:  # the key this token pushes out of the window (row nb - window; row 0 before that)
        out_row = (row - window).clamp_min(0)
        st.win_fk.index_copy_(2, out_row, run.phi_k(st.win_k.index_select(2, out_row)).to(st.win_fk.dtype))
    st.nb_t.add_(1)
    st.nb += 1
    o = attend_step(st, q, fq, g, lf, run)
    st.pos += 1
    if st.pos % run.chunk == 0:
        lola_evict(st, window=window, lam=run.lam, backend=run.backend, phi_k=run.phi_k, tuning=run.tuning)
    return o


def capture_piece(st, q, k, v, fq, mnew, g, lf, run: LolaRun):
    """Capture one steady full chunk (buffer holds `window` tokens before and after) into a CUDA graph: q, k, v, fq
    and the padding mask mnew (or None) are the chunk's; their copies are the graph's inputs."""
    static = [x.clone() for x in (q, k, v, fq)]
    if mnew is not None:
        ensure_mask(st, q.shape[0], q.device)
        static.append(mnew.clone())
    nb0 = st.nb

    def piece():
        append_window(st, static[1], static[2], static[4] if mnew is not None else None, run.phi_k, run.window)
        o = attend_piece(st, static[0], static[3], g, lf, run)
        lola_evict(st, window=run.window, lam=run.lam, backend=run.backend, phi_k=run.phi_k, tuning=run.tuning)
        return o

    from ..graphs import capture_graph

    gr, o_s = capture_graph(piece, q.device)
    st.nb = nb0  # capture ran no GPU work: the state is still the one before this chunk
    return gr, static, o_s


def process_padded_fresh(st: LolaState, q, k, v, fq, g, lf, run: LolaRun, key_mask_new):
    """A fresh prefill of a left-padded batch: one run per phase group (rows whose padding has the same remainder
    modulo `chunk`) on its rows with the `trim` leading columns dropped (padding in each of them), so every row
    keeps the eviction grid of its prompt alone; outputs scattered back (dropped columns: zeros) and the group
    states merged into one buffer (each group's tokens right-aligned, missing front rows masked)."""
    B, Hq, S, D = q.shape
    chunk = run.chunk
    pads = padded.left_padding_counts(key_mask_new)  # one host sync per layer and padded prefill
    lead = [p if p < S else None for p in pads]
    phases = sorted({p % chunk for p in pads if p < S})
    if not phases or phases == [0]:  # padding of whole chunks only (or rows of padding only): the plain grid
        o = _process(st, q, k, v, fq, g, lf, run, key_mask_new)
        st.phases = padded.row_phases(lead, chunk, q.device)
        return o
    if len(phases) == 1:  # one group: drop the common padding columns
        p = phases[0]
        o = _process(st, q[:, :, p:], k[:, :, p:], v[:, :, p:], fq[:, :, p:], g, lf, run, key_mask_new[:, p:])
        st.pos += p
        st.phases = padded.row_phases(lead, chunk, q.device)
        return torch.nn.functional.pad(o, (0, 0, 0, 0, p, 0))
    # several groups; rows of padding only go with the first
    rows_of = {p: [r for r in range(B) if pads[r] < S and pads[r] % chunk == p] for p in phases}
    rows_of[phases[0]] += [r for r in range(B) if pads[r] >= S]
    Hkv, F2, Hs, lamn = k.shape[1], st.H.shape[2], st.sp_k.shape[1], st.sp_k.shape[2]
    window = run.window
    cap = window + chunk
    o = q.new_zeros(B, S, Hq, D)
    done = []
    for p in phases:
        idx = torch.tensor(sorted(rows_of[p]), dtype=torch.long, device=q.device)
        take = lambda t: t.index_select(0, idx)[:, :, p:]  # noqa: E731
        sub = LolaState.empty(StateSizes(len(idx), Hq, Hkv, D, F2, lamn, sparse_heads=Hs), st.win_k.dtype, q.device,
                              capacity=cap, inplace=st.inplace)
        og = _process(sub, take(q), take(k), take(v), take(fq), g, lf, run, key_mask_new.index_select(0, idx)[:, p:])
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
    ensure_fk(st, run.phi_k, window)  # phi of the merged buffer's keys older than the window
    st.phases = padded.row_phases(lead, chunk, q.device)
    drop = st.nb - st.phases.need(S, window)
    if drop > 0:
        drop_front(st, drop)
    return o
