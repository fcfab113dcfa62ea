"""Parallel prefills on the Triton kernels, same results as the chunk loop (`sparse_cache.py`): `lolcats_parallel`
(lam = 0, continuing any state: one pass over [window buffer, new tokens] from (H, s)) and `lola_parallel` (a LoLA
prefill in two passes: every eviction, then every chunk's attention at once; fresh, or continuing a state).
"""

from __future__ import annotations

import math

import torch

from . import ops
from . import reference as ref
from .state import LolaRun, LolaState, StateSizes, append_window, ensure_mask, phi_into
from .tuning import DEFAULT_TUNING, LolaTuning


def lolcats_parallel(st, q, k, v, fq, g, lf, run: LolaRun, key_mask_new):
    """lam == 0, many new tokens, Triton: one parallel pass over [window buffer, new tokens] started
    from (H, s), then fold what the sequential manager would have folded by now."""
    window, chunk, phi_k, tuning = run.window, run.chunk, run.phi_k, run.tuning
    tk = ops.triton_ops()
    S = q.shape[2]
    cap = window + chunk
    if st.nb == 0 and key_mask_new is None and st.win_mask is None:
        lk, lv, lm = k, v, None  # nothing buffered: the new tokens are the local keys
    else:
        append_window(st, k, v, key_mask_new)  # no phi_k: the feature cache is made anew below
        lk, lv, lm = st.wk, st.wv, st.wmask
    lfk = phi_k(lk)
    nb = lk.shape[2]
    cs = ops.STATE_CHUNK
    Hs, Ss = tk.chunk_states(lfk, lv, cs, key_mask=lm, H0=st.H, s0=st.s)
    o = tk.hybrid_fwd(q, fq, ref.HybridKeys(lk, lv, lfk, Hs, Ss, key_mask=lm, q_offset=nb - S, state_chunk=cs),
                      run.rule(g, lf), tuning=tuning)
    del Hs, Ss
    st.pos += S
    start_pos = max((st.pos // chunk) * chunk - window, 0)  # first position the buffer keeps
    n_fold = nb - (st.pos - start_pos)
    B, Hq = st.H.shape[:2]
    if n_fold > 0:
        w = (torch.ones(B, n_fold, dtype=torch.bool, device=q.device) if lm is None else lm[:, :n_fold])
        H, s = st.H.contiguous(), st.s.contiguous()
        tk.fold_into_state(lfk[:, :, :n_fold], lv[:, :, :n_fold], w[:, None, :].float(), H, s, tuning=tuning)
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


# the two passes hold O(S) buffers (the state after every eviction, the state of every key block, phi(k) of
# every key, the sparse set of every chunk); above this share of the free GPU memory the chunk loop runs
PARALLEL_PREFILL_MEMORY_SHARE = 0.5


def _block_m(chunk: int) -> int:
    """Query rows per program of pass 2: a power of two that divides the chunk (query blocks never straddle one)."""
    return min(64, chunk & -chunk)


def extended_rows(pos: int, nb: int, S: int, *, chunk: int) -> tuple[int, int, int, int]:
    """Where a continued prefill lays its tokens out (`lola_parallel`): the row of the extended sequence X that holds
    position t is t - x0, with x0 the multiple of `chunk` at or before the first buffered token (pos - nb), so X's
    chunks are the stream's and its evictions fall on X's multiples of chunk. Returns (x0, first, n_real, q_pad):
    first = X's chunk of position pos (the evictions before it are done), n_real = the rows up to the last new token
    (pos + S - x0; the sparse pairs follow), q_pad = the rows of zero queries put before the new ones so that the
    queries start on a multiple of pass 2's query block."""
    x0 = (pos - nb) // chunk * chunk
    q_off = pos - x0
    return x0, (pos // chunk * chunk - x0) // chunk, pos + S - x0, q_off % _block_m(chunk)


def parallel_prefill_bytes(sizes: StateSizes, S: int, *, window: int, chunk: int, itemsize: int, pos: int = 0,
                           nb: int = 0) -> int:
    """Transient bytes of `lola_parallel` for one layer (the O(S) buffers; fp32 states) on a state of `sizes`
    (`state.StateSizes`) and S new tokens, keys and features of `itemsize` bytes. pos / nb: the state it continues
    (tokens seen, tokens buffered): the same buffers over the extended sequence, plus its keys and values (the window
    buffer, the new tokens and lam pairs per sparse head), phi(k) of the sparse pairs and, when the new tokens do not
    start on a query block, copies of q and phi(q)."""
    B, Hq, Hkv, D, F2 = sizes.batch, sizes.q_heads, sizes.kv_heads, sizes.head_dim, sizes.features
    lam, sparse_heads = sizes.lam, sizes.sparse_head_count
    cs = math.gcd(math.gcd(window, chunk), 256)
    extra = 0
    if pos or nb:
        _, _, n_real, q_pad = extended_rows(pos, nb, S, chunk=chunk)
        n_sp = lam * sparse_heads // Hkv  # rows of sparse pairs per kv head
        extra = (2 * B * Hkv * (n_real + n_sp) * D + B * Hq * n_sp * F2) * itemsize
        if q_pad:
            extra += B * Hq * (S + q_pad) * (D + F2) * itemsize
        S = n_real
    states = (S // chunk + 1 + -(-S // cs)) * B * Hq * F2 * (D + 1) * 4
    feats = B * Hq * S * F2 * itemsize
    sparse = B * sparse_heads * -(-S // chunk) * lam * (2 * D * itemsize + 1)
    return states + feats + sparse + extra


def parallel_ok(st: LolaState, q, k, *, window: int, chunk: int, lam: int,
                tuning: LolaTuning = DEFAULT_TUNING) -> bool:
    """Whether `lola_parallel` takes this prefill: Triton (the caller checks), `tuning.parallel_prefill`, lam > 0, at
    least two chunks of new tokens, window and chunk multiples of 16, and either a fresh state or an in-place one whose
    rows share one eviction grid (no `phases`) with the fixed window buffer; on the GPU its buffers within
    PARALLEL_PREFILL_MEMORY_SHARE of the free memory."""
    B, Hq, S, D = q.shape
    if not (tuning.parallel_prefill and lam > 0 and S >= 2 * chunk and window > 0 and window % 16 == 0
            and chunk % 16 == 0):
        return False
    fresh = st.pos == 0 and st.nb == 0
    if not fresh and not (st.inplace and st.phases is None and st.win_k.shape[2] >= window + chunk):
        return False
    if not q.is_cuda:
        return True
    sizes = StateSizes(B, Hq, k.shape[1], D, st.H.shape[2], lam, sparse_heads=st.sp_k.shape[1])
    need = parallel_prefill_bytes(sizes, S, window=window, chunk=chunk, itemsize=q.element_size(), pos=st.pos,
                                  nb=st.nb)
    free, _ = torch.cuda.mem_get_info(q.device)
    free += torch.cuda.memory_reserved(q.device) - torch.cuda.memory_allocated(q.device)
    return need <= PARALLEL_PREFILL_MEMORY_SHARE * free


def _extend(st: LolaState, q, k, v, fq, key_mask_new, *, chunk: int, phi_k):
    """A continued prefill's extended sequence X (`extended_rows`): [padding up to the first buffered token, the
    window buffer, the new tokens, the sparse pairs], each as rows of keys and values per kv head. The sparse pairs
    come last (past every query and every eviction's range, so nothing attends them or takes them as candidates:
    the slots point at them); per kv head lam rows per sparse head of its group (sparse head hs in rows
    n_real + (hs % R) * lam .., R = Hs / Hkv). Returns (kx, vx, fkx, km, sp_idx, first, n_real, q, fq): km [B, N]
    masks the padding and the sparse rows (None when nothing is masked), sp_idx [B, Hs, lam] the slots' rows
    (-1 = empty), q / fq with q_pad zero rows in front."""
    B, Hq, S, D = q.shape
    Hkv, Hs, lam = k.shape[1], st.sp_k.shape[1], st.sp_k.shape[2]
    R = Hs // Hkv
    nb = st.nb
    x0, first, n_real, q_pad = extended_rows(st.pos, nb, S, chunk=chunk)
    gap = st.pos - nb - x0
    N = n_real + R * lam
    kx = k.new_empty(B, Hkv, N, D)
    vx = v.new_empty(B, Hkv, N, D)
    for x, buf, new, sp in ((kx, st.wk, k, st.sp_k), (vx, st.wv, v, st.sp_v)):
        x[:, :, :gap] = 0
        x[:, :, gap:gap + nb] = buf
        x[:, :, gap + nb:n_real] = new
        x[:, :, n_real:] = sp.reshape(B, Hkv, R * lam, D)  # sparse head h * R + r: rows r * lam ..
    fk_sp = phi_k(st.sp_k)  # [B, Hq, lam, F2]: phi of each query head's sparse pairs, as an eviction computes it
    fkx = fk_sp.new_empty(B, Hq, N, fk_sp.shape[-1])
    phi_into(phi_k, kx[:, :, :n_real], fkx[:, :, :n_real])
    if R == 1:
        fkx[:, :, n_real:] = fk_sp
    else:  # one sparse head per query head: query head h * R + r reads rows r * lam .. of its kv head
        fkx[:, :, n_real:] = 0
        fx, fs = fkx.view(B, Hkv, R, N, -1), fk_sp.reshape(B, Hkv, R, lam, -1)
        for r in range(R):
            fx[:, :, r, n_real + r * lam:n_real + (r + 1) * lam] = fs[:, :, r]
    km = None
    if gap or st.win_mask is not None or key_mask_new is not None:
        km = torch.ones(B, N, dtype=torch.bool, device=k.device)
        km[:, :gap] = False
        if st.win_mask is not None:
            km[:, gap:gap + nb] = st.wmask
        if key_mask_new is not None:
            km[:, gap + nb:n_real] = key_mask_new.bool()
        km[:, n_real:] = False
    rows = n_real + (torch.arange(Hs, device=k.device) % R).view(1, Hs, 1) * lam + torch.arange(lam, device=k.device)
    sp_idx = torch.where(st.sp_valid, rows, -1)
    if q_pad:
        q = torch.cat([q.new_zeros(B, Hq, q_pad, D), q], 2)
        fq = torch.cat([fq.new_zeros(B, Hq, q_pad, fq.shape[-1]), fq], 2)
    return kx, vx, fkx, km, sp_idx, first, n_real, q, fq


def lola_parallel(st, q, k, v, fq, g, lf, run: LolaRun, key_mask_new):
    """A LoLA prefill (lam > 0, Triton) in two passes, same result as the chunk loop.

    The output of chunk c depends on the stream only through the state left by eviction c - 1: (H, s) and the
    sparse set. Pass 1 runs every eviction (score, select, fold: three kernels each, replayed from one CUDA
    graph) and keeps the state after each; pass 2 attends all chunks at once with the parallel hybrid kernel,
    each block of queries reading the sparse set of its chunk and a linear state made of its chunk's H plus
    the local keys folded since the chunk's first buffered key (block sums, summed within the chunk).

    A state with tokens already (a prefill cut into calls: transformers' `prefill_chunk_size`) is continued on the
    extended sequence of `_extend`: the window buffer and the new tokens at their positions on the chunk grid, the
    sparse pairs as rows that only the slots point at; pass 1 starts at the current chunk from the state's (H, s)
    and slots (`PrefillEvictions.start`), pass 2 attends the new tokens' queries only.
    Needs window and chunk multiples of 16 and, on the GPU, `parallel_prefill_bytes` within
    PARALLEL_PREFILL_MEMORY_SHARE of the free memory (`parallel_ok`); otherwise the chunk loop runs. The evictions
    are replayed from a CUDA graph when `run.tuning.graph_prefill`.
    """
    window, chunk, lam, phi_k, tuning = run.window, run.chunk, run.lam, run.phi_k, run.tuning
    tk = ops.triton_ops()
    B, Hq, S, _ = q.shape
    Hkv = k.shape[1]
    Hs = st.sp_k.shape[1]
    C, W = chunk, window
    fresh = st.pos == 0 and st.nb == 0
    if fresh:
        km = key_mask_new.bool() if key_mask_new is not None else None
        kx, vx, fkx = k, v, phi_k(k)  # [B, Hq, S, F2]: every key is an eviction candidate or attended linearly
        first, n_real, keep_mask = 0, S, km is not None
    else:
        keep_mask = st.win_mask is not None or key_mask_new is not None
        kx, vx, fkx, km, sp_idx, first, n_real, q, fq = _extend(st, q, k, v, fq, key_mask_new, chunk=C, phi_k=phi_k)
    n_ev = n_real // C
    plan = tk.EvictionPlan(window=W, chunk=C, lam=lam, sparse_heads=Hs, n_ev=n_ev, first=first, eps=ref.EPS_SRE)
    ev = tk.PrefillEvictions(fkx, vx, km, plan, tuning=tuning)
    if not fresh:
        ev.start(st.H, st.s, sp_idx, st.sp_score)
    ev.run(graph=tuning.graph_prefill)
    # Overlapping pass 2 with the evictions (pass 2 in 4 segments on a low-priority stream, evictions on a
    # high-priority one) measured the same on the H200 (5.98 vs 5.64 ms, 8.23 vs 8.52 ms at 32k, D = 64:
    # benchmarks/results/lola/speed-h200-34dbded.json): the attention blocks fill the SMs whenever they run. One pass.

    # pass 2 reads the rows up to the last new token (the sparse pairs after them only through the slots)
    kr, vr, fkr = kx[:, :, :n_real], vx[:, :, :n_real], fkx[:, :, :n_real]
    kmr = km[:, :n_real] if km is not None else None
    # each block of keys' linear state: its chunk's H plus the keys since the chunk's first buffered key
    cs = math.gcd(math.gcd(W, C), 256)  # a multiple of 16 that divides both: chunk starts fall on blocks
    Hs_eff, Ss_eff = tk.local_states(fkr, vr, kmr, ev.H_all, ev.s_all, state_chunk=cs, chunk=C, window=W)
    # every chunk's sparse set, gathered from the keys by position
    nch = -(-n_real // C)
    idx = ev.SPIDX[:nch].permute(1, 2, 0, 3).long()  # [B, Hs, nch, lam]
    bi = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    hi = (torch.arange(Hs, device=q.device) * Hkv // Hs).view(1, Hs, 1, 1)
    spk, spv = kx[bi, hi, idx.clamp_min(0)], vx[bi, hi, idx.clamp_min(0)]
    M = q.shape[2]  # the new tokens' queries (after q_pad zero rows when continuing) sit at X's last M rows
    keys = ref.HybridKeys(kr, vr, fkr, Hs_eff, Ss_eff, key_mask=kmr, q_offset=n_real - M, state_chunk=cs,
                          sparse=ref.SparseSet(spk, spv, idx >= 0), sparse_chunk=C)
    o = tk.hybrid_fwd(q, fq, keys, run.rule(g, lf), block_m=_block_m(C), block_n=min(64, cs),
                      tuning=tuning)  # query blocks never straddle a chunk
    del Hs_eff, Ss_eff, spk, spv
    if M > S:
        o = o[:, M - S:]

    # the state the chunk loop would have left: after eviction n_ev, window buffer from the last chunk start
    sc = ev.SPSC[n_ev]
    order = torch.argsort(sc, dim=-1, descending=True, stable=True)
    sc = torch.gather(sc, -1, order)
    fin = torch.gather(ev.SPIDX[n_ev].long(), -1, order)
    ok = (fin >= 0)[..., None]
    sk = torch.where(ok, kx[bi[..., 0], hi[..., 0], fin.clamp_min(0)], 0).to(st.sp_k.dtype)
    sv = torch.where(ok, vx[bi[..., 0], hi[..., 0], fin.clamp_min(0)], 0).to(st.sp_v.dtype)
    start = max(n_ev * C - W, 0)  # X's row of the first token the buffer keeps (never a padding row of `_extend`)
    nb = n_real - start
    if st.inplace:  # same storage, as the chunk loop keeps it
        st.sp_k.copy_(sk)
        st.sp_v.copy_(sv)
        st.sp_score.copy_(sc)
        st.H.copy_(ev.H_all[n_ev])
        st.s.copy_(ev.s_all[n_ev])
        st.win_k[:, :, :nb] = kx[:, :, start:n_real]
        st.win_v[:, :, :nb] = vx[:, :, start:n_real]
        if st.win_fk is not None:  # phi of the buffered keys older than the window
            nl = max(nb - W, 0)
            st.win_fk[:, :, :nl] = fkx[:, :, start:start + nl]
        if keep_mask:
            ensure_mask(st, B, q.device)
            st.win_mask[:, :nb] = km[:, start:n_real]
    else:  # a fresh prefill only (`parallel_ok`)
        st.sp_k, st.sp_v, st.sp_score = sk, sv, sc
        st.H, st.s = ev.H_all[n_ev].clone(), ev.s_all[n_ev].clone()
        st.win_k, st.win_v = k[:, :, start:].to(st.win_k.dtype), v[:, :, start:].to(st.win_v.dtype)
        if km is not None:
            st.win_mask = km[:, start:]
    st.nb = nb
    st.pos += S
    return o
