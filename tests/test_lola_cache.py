"""LoLA cache manager on plain tensors: chunking invariance, lam = 0 == LoLCATs, SRE keeps colliding keys."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.kernels.lola import reference as ref  # noqa: E402
from longctx_patch.kernels.lola import (HybridSpec, LolaRun, LolaState, StateSizes, hybrid_attention,  # noqa: E402
                                        lola_process)

B, HQ, HKV, D, F = 2, 4, 2, 16, 8


def _seq(S, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, S, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    Wq = torch.randn(HQ, D, F, generator=g) * D ** -0.25
    Wk = torch.randn(HQ, D, F, generator=g) * D ** -0.25
    gw = torch.sigmoid(torch.randn(HQ, generator=g))
    return (q.to(dtype), k.to(dtype), v.to(dtype), ref.hedgehog_feature_map(q, Wq).to(dtype),
            ref.hedgehog_feature_map(k, Wk).to(dtype), gw, torch.ones(HQ), Wk)


def _run(splits, seq, *, window, chunk, lam, mask=None, backend="torch", sparse_heads=HKV):
    q, k, v, fq, fk, g, lf, Wk = seq
    st = LolaState.empty(StateSizes(B, HQ, HKV, D, 2 * F, lam, sparse_heads=sparse_heads), q.dtype, q.device)
    phi_k = lambda x: ref.hedgehog_feature_map(x, Wk, out_dtype=q.dtype)  # noqa: E731
    run = LolaRun(phi_k=phi_k, window=window, chunk=chunk, lam=lam, scale=D ** -0.5, backend=backend)
    outs, i = [], 0
    for n in splits:
        sl = slice(i, i + n)
        outs.append(lola_process(st, q[:, :, sl], k[:, :, sl], v[:, :, sl], fq[:, :, sl], g, lf, run,
                                 key_mask_new=None if mask is None else mask[:, sl]))
        i += n
    return torch.cat(outs, 1), st


@pytest.mark.parametrize("backend,sparse_heads", [("torch", HKV), ("torch", HQ), ("triton", HKV), ("triton", HQ)])
def test_chunked_prefill_equals_token_by_token_and_full(backend, sparse_heads):
    S = 41 if backend == "torch" else 22  # the interpreter is slow
    seq = _seq(S)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :6] = False  # left padding of row 1
    kw = dict(window=6, chunk=4, lam=5, mask=mask, backend=backend, sparse_heads=sparse_heads)
    full, st_full = _run([S], seq, **kw)
    steps, st_steps = _run([1] * S, seq, **kw)
    mixed, st_mixed = _run([13, 1, 1, S - 15], seq, **kw)
    real = mask[:, :, None, None].expand_as(full)
    torch.testing.assert_close(steps[real], full[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[real], full[real], atol=1e-4, rtol=1e-4)
    for a, b in [(st_full, st_steps), (st_full, st_mixed)]:
        torch.testing.assert_close(a.H, b.H, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.sp_score, b.sp_score, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.sp_k, b.sp_k)
        assert a.pos == b.pos == S
    # the sparse cache is really used: some slots hold pairs, padding never enters it
    assert st_full.sp_valid.any() and st_full.sp_k.shape[1] == sparse_heads
    # buffer: a fixed block of window + chunk rows, fewer tokens in it
    assert st_full.win_k.shape[2] == 6 + 4 and st_full.nb < 6 + 4


@pytest.mark.parametrize("sparse_heads", [HKV, HQ])
def test_triton_manager_matches_torch_manager(sparse_heads):
    S = 30
    seq = _seq(S, seed=1)
    a, sa = _run([S], seq, window=5, chunk=8, lam=3, backend="torch", sparse_heads=sparse_heads)
    b, sb = _run([S], seq, window=5, chunk=8, lam=3, backend="triton", sparse_heads=sparse_heads)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sa.H, sb.H, atol=1e-4, rtol=1e-4)
    assert torch.equal(sa.sp_k, sb.sp_k)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("sparse_heads", [HKV, HQ])
def test_eviction_equals_select_and_fold_reference(backend, sparse_heads):
    """One eviction of the manager (scores summed over the query heads of a sparse head, top-lambda, fold)
    against `reference.select_and_fold` written from the definition, with padding among the candidates."""
    window, chunk, lam = 5, 8, 4
    q, k, v, fq, fk, g, lf, Wk = _seq(2 * chunk, seed=11)
    mask = torch.ones(B, 2 * chunk, dtype=torch.bool)
    mask[0, :chunk] = False  # a whole chunk of padding (one eviction grid); candidates 3-7 of eviction 2 are padding
    phi_k = lambda x: ref.hedgehog_feature_map(x, Wk)  # noqa: E731
    st = LolaState.empty(StateSizes(B, HQ, HKV, D, 2 * F, lam, sparse_heads=sparse_heads), q.dtype, q.device)
    run = LolaRun(phi_k=phi_k, window=window, chunk=chunk, lam=lam, scale=D ** -0.5, backend=backend)
    lola_process(st, q[:, :, :chunk], k[:, :, :chunk], v[:, :, :chunk], fq[:, :, :chunk], g, lf, run,
                 key_mask_new=mask[:, :chunk])
    assert st.sp_valid.any()  # the first eviction filled slots; the second one competes with them
    lola_process(st, q[:, :, chunk:-1], k[:, :, chunk:-1], v[:, :, chunk:-1], fq[:, :, chunk:-1], g, lf, run,
                 key_mask_new=mask[:, chunk:-1])
    n_ev = st.nb + 1 - window
    Hs = sparse_heads
    cand_k = torch.cat([st.sp_k, ref.expand_kv(st.win_k[:, :, :n_ev], Hs)], 2)
    cand_v = torch.cat([st.sp_v, ref.expand_kv(st.win_v[:, :, :n_ev], Hs)], 2)
    ev_valid = torch.ones(B, n_ev, dtype=torch.bool) if st.win_mask is None else st.win_mask[:, :n_ev]
    cand_valid = torch.cat([st.sp_valid, ev_valid[:, None].expand(B, Hs, n_ev)], 2)
    want = ref.select_and_fold(cand_k, cand_v, phi_k(cand_k), cand_valid, st.H, st.s, lam)
    lola_process(st, q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], fq[:, :, -1:], g, lf, run, key_mask_new=mask[:, -1:])
    assert st.nb == window
    torch.testing.assert_close(st.sp_k, want[0])
    torch.testing.assert_close(st.sp_v, want[1])
    torch.testing.assert_close(st.sp_score, want[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st.H, want[3], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st.s, want[4], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lambda_zero_is_lolcats(backend):
    S = 37
    seq = _seq(S, seed=2)
    q, k, v, fq, fk, g, lf, _ = seq
    want = hybrid_attention(q, k, v, fq, fk, g, lf, HybridSpec(window=7, scale=D ** -0.5, chunk=8, backend="torch"))
    quad = ref.hybrid_attention_quadratic(q, k, v, fq, fk, g, lf, HybridSpec(window=7)).transpose(1, 2)
    torch.testing.assert_close(want, quad, atol=1e-5, rtol=1e-5)
    for splits in ([S], [10, 3, 24]) if backend == "triton" else ([S], [1] * S, [10, 3, 24]):
        got, st = _run(splits, seq, window=7, chunk=4, lam=0, backend=backend)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the final state is the sum over everything older than the buffer
    nb = st.nb
    He, se = ref.fold(fk[:, :, : S - nb], ref.expand_kv(v, HQ)[:, :, : S - nb], torch.ones(B, HQ, S - nb),
                      torch.zeros(B, HQ, 2 * F, D), torch.zeros(B, HQ, 2 * F))
    torch.testing.assert_close(st.H, He, atol=1e-4, rtol=1e-4)


def test_bf16_manager_close_to_fp32():
    S = 33
    seq32 = _seq(S, seed=3)
    seq16 = tuple(x.to(torch.bfloat16) if x.dim() == 4 else x for x in seq32)  # Wk stays fp32
    a, _ = _run([S], seq32, window=6, chunk=4, lam=4)
    b, _ = _run([S], seq16, window=6, chunk=4, lam=4, backend="triton")
    assert b.dtype == torch.bfloat16
    torch.testing.assert_close(b.float(), a, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_colliding_key_is_kept_in_sparse_cache(backend):
    """Many pairs (k0, v0) are folded into (H, s); a later pair (k0, v1) with the same key collides in
    the linear state (phi(k0)^T H / phi(k0)^T s == v0), so its self-recall error is large and it must
    stay exact, while the well-recalled copies of (k0, v0) are folded."""
    S, lam = 40, 2
    g = torch.Generator().manual_seed(0)
    k0 = torch.randn(D, generator=g)
    v0 = torch.randn(D, generator=g)
    v1 = -3 * v0
    k = k0.expand(B, HKV, S, D).clone()
    v = v0.expand(B, HKV, S, D).clone()
    k[:, :, 25:] = torch.randn(B, HKV, S - 25, D, generator=g)  # later tokens: unrelated keys...
    v[:, :, 25:] = 0.1 * torch.randn(B, HKV, S - 25, D, generator=g)
    v[:, :, 20] = v1  # ...and the colliding pair at index 20
    q = torch.randn(B, HQ, S, D, generator=g)
    W = torch.randn(HQ, D, F, generator=g)
    seq = (q, k, v, ref.hedgehog_feature_map(q, W), ref.hedgehog_feature_map(k, W), torch.full((HQ,), 0.5),
           torch.ones(HQ), W)
    _, st = _run([S], seq, window=4, chunk=4, lam=lam, backend=backend)
    # index 20 left the window (S - window = 36 > 20): it must be one of the exact pairs of every kv head
    hit = (st.sp_v - v1).abs().amax(-1) < 1e-5  # [B, HKV, lam]
    assert hit.any(-1).all(), st.sp_score
    # and the folded state recalls v0 for k0 (the copies of (k0, v0) were folded, not (k0, v1))
    fk0 = ref.hedgehog_feature_map(k0.expand(B, HKV, 1, D), W)
    pred = (fk0 @ st.H) / ((fk0 * st.s[:, :, None]).sum(-1, keepdim=True))
    assert (pred[:, :, 0] - v0).abs().max() < 0.5


def test_state_bytes_do_not_grow():
    def run(S):
        seq = _seq(S, seed=4)
        _, st = _run([S], seq, window=64, chunk=512, lam=8)
        return st.nbytes()

    assert run(1024) == run(8192)


def test_lolcats_parallel_prefill_with_padding_matches_torch():
    """lam = 0 on the Triton backend takes one parallel pass (chunk_states + hybrid_fwd) per call."""
    S = 22
    seq = _seq(S, seed=6)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :5] = False
    want, st_want = _run([S], seq, window=6, chunk=4, lam=0, mask=mask, backend="torch")
    real = mask[:, :, None, None].expand_as(want)
    for splits in ([S], [13, 1, 8]):
        got, st = _run(splits, seq, window=6, chunk=4, lam=0, mask=mask, backend="triton")
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(st.H, st_want.H, atol=1e-4, rtol=1e-4)
        assert st.nb == st_want.nb and torch.equal(st.wmask, st_want.wmask)


@pytest.mark.parametrize("S,window,chunk,lam,sparse_heads,dtype", [
    (100, 16, 32, 8, HKV, torch.float32),   # window < chunk, ends mid-chunk
    (77, 48, 16, 8, HQ, torch.float32),     # window > chunk: the first evictions have nothing to evict
    (64, 32, 32, 40, HKV, torch.float32),   # lam > pairs evicted so far: slots stay empty
    (96, 16, 32, 8, HKV, torch.bfloat16),
    (37, 48, 16, 8, HKV, torch.float32),    # window longer than the sequence: block 0 belongs to no chunk
    (150, 32, 16, 40, HKV, torch.float32),  # several evictions keep every pair: the state stays exactly 0
])
def test_parallel_prefill_equals_chunk_loop(S, window, chunk, lam, sparse_heads, dtype, monkeypatch):
    """A fresh Triton prefill of >= 2 chunks runs in two passes (all evictions, then all chunks at once);
    output, state and the decode steps after it equal the torch chunk loop, with left padding."""
    from longctx_patch.kernels.lola import prefill

    calls = []
    real_parallel = prefill.lola_parallel
    monkeypatch.setattr(prefill, "lola_parallel", lambda *a, **kw: calls.append(1) or real_parallel(*a, **kw))
    seq = _seq(S + 3, seed=7, dtype=dtype)
    mask = torch.ones(B, S + 3, dtype=torch.bool)
    mask[1, :9] = False
    kw = dict(window=window, chunk=chunk, lam=lam, mask=mask, sparse_heads=sparse_heads)
    want, st_want = _run([S, 1, 1, 1], seq, backend="torch", **kw)
    got, st = _run([S, 1, 1, 1], seq, backend="triton", **kw)
    # one fresh prefill per phase group (row 1's padding of 9 is no whole chunk): rows 0 (S tokens) and 1 (S - 9)
    assert calls == [1] * sum(n >= 2 * chunk for n in (S, S - 9))
    real = mask[:, :, None, None].expand_as(want)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(st.H, st_want.H, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st.s, st_want.s, atol=1e-5, rtol=1e-5)
    # slots are filled once a pair has left the window (never, when the window is longer than the sequence)
    assert torch.equal(st.sp_valid, st_want.sp_valid) and bool(st.sp_valid.any()) == (S + 3 > window)
    ok = st.sp_valid[..., None]
    assert torch.equal(torch.where(ok, st.sp_k, 0), torch.where(ok, st_want.sp_k, 0))
    assert torch.equal(torch.where(ok, st.sp_v, 0), torch.where(ok, st_want.sp_v, 0))
    torch.testing.assert_close(st.sp_score[st.sp_valid], st_want.sp_score[st_want.sp_valid], atol=1e-4, rtol=1e-5)
    assert st.nb == st_want.nb and st.pos == st_want.pos == S + 3
    assert torch.equal(st.wk, st_want.wk) and torch.equal(st.wmask, st_want.wmask)


def test_parallel_prefill_equals_chunk_loop_with_tied_scores():
    """The first eviction sees a state of 0, where a pair's SRE is ||v||^2 (summed over the group): positions
    8-15 repeat the values of 0-7 (other keys), so 11 slots for 8 pairs of equal scores split a tie at the
    threshold. Every path keeps the lowest candidate index among equal scores (a stable sort in the reference
    and the chunk loop, the radix select in the two-pass prefill), so they keep the same pairs; `torch.topk`
    leaves that order to the device and build (the reason the loop does not use it)."""
    S = 96
    q, k, v, fq, fk, gw, lf, Wk = _seq(S, seed=11)
    v = v.clone()
    v[:, :, 8:16] = v[:, :, 0:8]
    seq = (q, k, v, fq, fk, gw, lf, Wk)
    kw = dict(window=16, chunk=16, lam=11, sparse_heads=HKV)
    want, st_want = _run([S], seq, backend="torch", **kw)
    got, st = _run([S], seq, backend="triton", **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st.H, st_want.H, atol=1e-5, rtol=1e-5)
    assert torch.equal(st.sp_k, st_want.sp_k)


@pytest.mark.parametrize("select_bits", [8, 4])
def test_prefill_evictions_match_select_and_fold_with_ties(select_bits):
    """The eviction kernels of the two-pass prefill (score, radix top-lambda with 8- and 4-bit digits, fold),
    eviction by eviction, against `reference.select_and_fold` on the same candidates, with duplicated pairs
    (exactly equal scores at the threshold) and a first eviction with fewer valid pairs than slots."""
    from longctx_patch.kernels.lola import triton_kernels as tk

    from longctx_patch.kernels.lola.tuning import LolaTuning

    g = torch.Generator().manual_seed(5)
    S, W, C, lam = 96, 16, 32, 12
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    k[:, :, 40:48], v[:, :, 40:48] = k[:, :, 30:38].clone(), v[:, :, 30:38].clone()  # 8 duplicated pairs
    Wk = torch.randn(HQ, D, F, generator=g) * D ** -0.25
    fk = ref.hedgehog_feature_map(k, Wk)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :5] = False
    plan = tk.EvictionPlan(window=W, chunk=C, lam=lam, sparse_heads=HKV, n_ev=S // C)
    ev = tk.PrefillEvictions(fk, v, mask, plan, tuning=LolaTuning(ev_select_bits=select_bits))
    ev.run()
    H, s = torch.zeros(B, HQ, 2 * F, D), torch.zeros(B, HQ, 2 * F)
    sp_idx = torch.full((B, HKV, lam), -1)
    for c in range(S // C):
        pos = torch.arange(c * C - W, (c + 1) * C - W)
        ok = pos >= 0
        pos = pos.clamp_min(0)
        idx = torch.cat([sp_idx, pos.expand(B, HKV, C)], -1)
        valid = torch.cat([sp_idx >= 0, (ok[None] & mask[:, pos])[:, None].expand(B, HKV, C)], -1)
        gi = idx.clamp_min(0)[..., None]
        ck, cv = torch.gather(k, 2, gi.expand(-1, -1, -1, D)), torch.gather(v, 2, gi.expand(-1, -1, -1, D))
        cfk = torch.gather(fk, 2, ref.expand_kv(gi, HQ).expand(-1, -1, -1, 2 * F))
        _, _, sc, H, s = ref.select_and_fold(ck, cv, cfk, valid, H, s, lam)
        kept = torch.topk(ref.group_sum(ref.sre_scores(cfk, cv, ev.H_all[c], ev.s_all[c]), HKV)
                          .masked_fill(~valid, float("-inf")), lam, -1).indices
        sp_idx = torch.where(torch.isfinite(sc), torch.gather(idx, -1, kept), -1)
        torch.testing.assert_close(ev.H_all[c + 1], H, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ev.s_all[c + 1], s, atol=1e-5, rtol=1e-5)
        got = ev.SPIDX[c + 1].long()
        assert torch.equal((got >= 0).sum(-1), (sp_idx >= 0).sum(-1))
        # same kept pairs (duplicates are interchangeable: compare the keys, not the positions)
        for t in (k, v):
            a = torch.gather(t, 2, got.clamp_min(0)[..., None].expand(-1, -1, -1, D)) * (got >= 0)[..., None]
            b = torch.gather(t, 2, sp_idx.clamp_min(0)[..., None].expand(-1, -1, -1, D)) * (sp_idx >= 0)[..., None]
            assert torch.equal(a.sort(2).values, b.sort(2).values)
        H, s = ev.H_all[c + 1], ev.s_all[c + 1]
        sp_idx = got
    assert (ev.SPIDX[1] < 0).any() and (ev.SPIDX[-1] >= 0).all()  # first eviction: free slots; last: full


def test_decode_after_parallel_prefill_crosses_evictions_like_the_loop(monkeypatch):
    """The state the two-pass prefill leaves (sparse slots sorted by score, window buffer, (H, s)) carries on
    through decode steps and two more evictions exactly like the state of the chunk loop."""
    from longctx_patch.kernels.lola import prefill

    calls = []
    real_parallel = prefill.lola_parallel
    monkeypatch.setattr(prefill, "lola_parallel", lambda *a, **kw: calls.append(1) or real_parallel(*a, **kw))
    S, steps = 80, 40  # prefill ends mid-chunk; decode crosses the evictions at 96 and 112
    seq = _seq(S + steps, seed=9)
    mask = torch.ones(B, S + steps, dtype=torch.bool)
    mask[0, :7] = False
    kw = dict(window=16, chunk=16, lam=6, mask=mask, sparse_heads=HKV)
    want, st_want = _run([S] + [1] * steps, seq, backend="torch", **kw)
    got, st = _run([S] + [1] * steps, seq, backend="triton", **kw)
    assert calls == [1, 1]  # one per phase group (row 0's padding of 7 is no whole chunk)
    real = mask[:, :, None, None].expand_as(want)
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st.H, st_want.H, atol=1e-5, rtol=1e-5)
    assert torch.equal(st.sp_valid, st_want.sp_valid)
    torch.testing.assert_close(st.sp_k, st_want.sp_k)
    assert st.nb == st_want.nb and st.pos == S + steps
