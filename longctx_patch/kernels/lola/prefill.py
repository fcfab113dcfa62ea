"""Parallel prefills on the Triton kernels, same results as the chunk loop (`sparse_cache.py`): `lolcats_parallel`
(lam = 0, continuing any state: one pass over [window buffer, new tokens] from (H, s)) and `lola_parallel` (a fresh
LoLA prefill in two passes: every eviction, then every chunk's attention at once).
"""

from __future__ import annotations

import math

import torch

from . import ops
from . import reference as ref
from .state import LolaState, append_window, ensure_mask


def lolcats_parallel(st, q, k, v, fq, g, lf, *, window, chunk, scale, key_mask_new, phi_k):
    """lam == 0, many new tokens, Triton: one parallel pass over [window buffer, new tokens] started
    from (H, s), then fold what the sequential manager would have folded by now."""
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


PARALLEL_PREFILL = True  # a fresh Triton prefill of >= 2 chunks takes `lola_parallel` (two passes)
# the two passes hold O(S) buffers (the state after every eviction, the state of every key block, phi(k) of
# every key, the sparse set of every chunk); above this share of the free GPU memory the chunk loop runs
PARALLEL_PREFILL_MEMORY_SHARE = 0.5


def parallel_prefill_bytes(B, Hq, Hkv, S, D, F2, *, window, chunk, lam, sparse_heads, itemsize) -> int:
    """Transient bytes of `lola_parallel` for one layer (the O(S) buffers; fp32 states)."""
    cs = math.gcd(math.gcd(window, chunk), 256)
    states = (S // chunk + 1 + -(-S // cs)) * B * Hq * F2 * (D + 1) * 4
    feats = B * Hq * S * F2 * itemsize
    sparse = B * sparse_heads * -(-S // chunk) * lam * (2 * D * itemsize + 1)
    return states + feats + sparse


def parallel_ok(st: LolaState, q, k, *, window: int, chunk: int, lam: int) -> bool:
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


def lola_parallel(st, q, k, v, fq, g, lf, *, window, chunk, lam, scale, key_mask_new, phi_k, graph: bool = True):
    """A fresh prefill (empty state, lam > 0, Triton) in two passes, same result as the chunk loop.

    The output of chunk c depends on the stream only through the state left by eviction c - 1: (H, s) and the
    sparse set. Pass 1 runs every eviction (score, select, fold: three kernels each, replayed from one CUDA
    graph) and keeps the state after each; pass 2 attends all chunks at once with the parallel hybrid kernel,
    each block of queries reading the sparse set of its chunk and a linear state made of its chunk's H plus
    the local keys folded since the chunk's first buffered key (block sums, summed within the chunk).
    Needs window and chunk multiples of 16 and, on the GPU, `parallel_prefill_bytes` within
    PARALLEL_PREFILL_MEMORY_SHARE of the free memory (`parallel_ok`); otherwise the chunk loop runs.
    """
    tk = ops.triton_ops()
    B, Hq, S, _ = q.shape
    Hkv = k.shape[1]
    Hs = st.sp_k.shape[1]
    C, W = chunk, window
    km = key_mask_new.bool() if key_mask_new is not None else None
    fk = phi_k(k)  # [B, Hq, S, F2]: every key is an eviction candidate or attended linearly at some point
    n_ev = S // C
    ev = tk.PrefillEvictions(fk, v, km, n_ev=n_ev, lam=lam, chunk=C, window=W, sparse_heads=Hs, eps=ref.EPS_SRE)
    ev.run(graph=graph)
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
            ensure_mask(st, B, q.device)
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
