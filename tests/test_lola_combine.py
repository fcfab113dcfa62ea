"""`combine`: how the exact (window + sparse) and linear terms meet. "shifted" (LoLCATs, the default, as trained):
the exact term exp(s - m) with m the query's max exact score, the linear term as is. "unshifted" (the LoLA authors'
code): exp(s) as is, i.e. the linear term weighed by exp(-m). Every fast path (the hybrid forward kernel, the chunk
loop on Triton, the two-pass prefill, the decode step kernel) against the reference (TRITON_INTERPRET=1), the
reference against the plain formula, and the default unchanged. The reference against the authors' rule:
tests/test_lola_authors.py."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.errors import ConfigError  # noqa: E402
from longctx_patch.kernels.lola import (HybridSpec, LolaRun, LolaState, StateSizes, hybrid_attention,  # noqa: E402
                                        lola_process)
from longctx_patch.kernels.lola import reference as ref  # noqa: E402
from longctx_patch.kernels.lola.training import PrefillSets, SetsSpec, lola_attention_sets  # noqa: E402
from longctx_patch.methods.lola import LolaConfig  # noqa: E402
from longctx_patch.methods.lolcats import LolcatsConfig  # noqa: E402

tk = pytest.importorskip("longctx_patch.kernels.lola.triton_kernels")

B, HQ, HKV, D, F = 2, 7, 1, 16, 8  # 7 query heads per kv head
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _seq(S, seed=0, dtype=torch.float32, sharp=2.0, N=None):
    """Scores of several units (sharp): m far from 0, so the two combinations differ visibly."""
    g = torch.Generator().manual_seed(seed)
    N = S if N is None else N
    q = torch.randn(B, HQ, S, D, generator=g) * sharp
    k = torch.randn(B, HKV, N, D, generator=g)
    v = torch.randn(B, HKV, N, D, generator=g)
    Wq = torch.randn(HQ, D, F, generator=g) * D ** -0.25
    Wk = torch.randn(HQ, D, F, generator=g) * D ** -0.25
    gw = torch.sigmoid(torch.randn(HQ, generator=g))
    lf = torch.rand(HQ, generator=g) + 0.5
    return (q.to(dtype), k.to(dtype), v.to(dtype), ref.hedgehog_feature_map(q, Wq).to(dtype),
            ref.hedgehog_feature_map(k, Wk).to(dtype), gw, lf, Wk)


def _mask(N, pads):
    m = torch.ones(B, N, dtype=torch.bool)
    for b, p in enumerate(pads):
        m[b, :p] = False
    return m


def _plain(q, k, v, fq, fk, g, lf, H, s, *, window, scale, key_mask, q_offset, sparse_k=None, sparse_v=None,
           sparse_valid=None):
    """The authors' combination written out: (g sum exp(s) v + lf (linear)) / (g sum exp(s) + lf (linear)), no max
    taken anywhere (scores here are small enough for exp)."""
    S, N = q.shape[2], k.shape[2]
    kx, vx = ref.expand_kv(k, HQ).float(), ref.expand_kv(v, HQ).float()
    diff = torch.arange(S)[:, None] + q_offset - torch.arange(N)[None, :]
    km = key_mask[:, None, None, :]
    win, lin = ((diff >= 0) & (diff < window)) & km, (diff >= window) & km
    e = torch.exp(q.float() @ kx.transpose(-1, -2) * scale) * win
    num_e, den_e = e @ vx, e.sum(-1, keepdim=True)
    if sparse_k is not None:
        es = torch.exp(q.float() @ ref.expand_kv(sparse_k, HQ).float().transpose(-1, -2) * scale)
        es = es * ref.expand_kv(sparse_valid, HQ)[:, :, None, :]
        num_e, den_e = num_e + es @ ref.expand_kv(sparse_v, HQ).float(), den_e + es.sum(-1, keepdim=True)
    a = (fq.float() @ ref.pad_features(fk, N, q_offset, S, window).float().transpose(-1, -2)) * lin
    num_l = a @ vx + fq.float() @ H
    den_l = a.sum(-1, keepdim=True) + (fq.float() * s[:, :, None, :]).sum(-1, keepdim=True)
    g, lf = g.view(1, -1, 1, 1), lf.view(1, -1, 1, 1)
    den = g * den_e + lf * den_l
    return (g * num_e + lf * num_l) / torch.where(den > 0, den, torch.ones_like(den))  # padded rows: 0


def _state(seed=9):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(B, HQ, 2 * F, D, generator=gen), torch.rand(B, HQ, 2 * F, generator=gen) * 3


def test_reference_is_the_plain_formula_and_shifted_is_unchanged():
    """lola_attention with combine="unshifted" is the formula with exp(s) (no max subtracted); the default is the
    LoLCATs combination exactly as before (bit for bit against the formula the reference had: exp(s - m), the
    linear term as is); the two differ."""
    S, N, L, W = 13, 29, 5, 6
    q, k, v, fq, fk, g, lf, _ = _seq(S, N=N, seed=1)
    H, s = _state()
    gen = torch.Generator().manual_seed(3)
    spk, spv = torch.randn(B, HKV, L, D, generator=gen), torch.randn(B, HKV, L, D, generator=gen)
    valid = torch.rand(B, HKV, L, generator=gen) > 0.3
    km = _mask(N, [0, 4])
    kw = dict(window=W, scale=0.25, key_mask=km, q_offset=N - S, sparse_k=spk, sparse_v=spv, sparse_valid=valid)
    keys = ref.HybridKeys(k, v, fk, H, s, key_mask=km, q_offset=N - S, sparse=ref.SparseSet(spk, spv, valid))
    got = ref.lola_attention(q, fq, keys, ref.HybridRule(W, g, lf, 0.25, "unshifted"))
    torch.testing.assert_close(got, _plain(q, k, v, fq, fk, g, lf, H, s, **kw), atol=1e-5, rtol=1e-5)
    # shifted: the reference's former formula, inline
    sc = torch.cat([(q @ ref.expand_kv(spk, HQ).transpose(-1, -2) * 0.25).masked_fill(
        ~ref.expand_kv(valid, HQ)[:, :, None, :], float("-inf")),
        (q @ ref.expand_kv(k, HQ).transpose(-1, -2) * 0.25).masked_fill(
            ~(((torch.arange(S)[:, None] + N - S - torch.arange(N)[None, :]) >= 0)
              & ((torch.arange(S)[:, None] + N - S - torch.arange(N)[None, :]) < W) & km[:, None, None, :]),
            float("-inf"))], -1)
    m = sc.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(sc - m)
    vals = torch.cat([ref.expand_kv(spv, HQ), ref.expand_kv(v, HQ)], 2)
    diff = torch.arange(S)[:, None] + N - S - torch.arange(N)[None, :]
    a = (fq @ ref.pad_features(fk, N, N - S, S, W).transpose(-1, -2)) * ((diff >= W) & km[:, None, None, :])
    num_l = a @ ref.expand_kv(v, HQ) + fq @ H
    den_l = a.sum(-1, keepdim=True) + (fq * s[:, :, None, :]).sum(-1, keepdim=True)
    gg, ll = g.view(1, -1, 1, 1), lf.view(1, -1, 1, 1)
    num, den = gg * (p @ vals) + ll * num_l, gg * p.sum(-1, keepdim=True) + ll * den_l
    before = num / torch.where(den > 0, den, torch.ones_like(den))
    assert torch.equal(ref.lola_attention(q, fq, keys, ref.HybridRule(W, g, lf, 0.25)), before)
    assert torch.equal(ref.lola_attention(q, fq, keys, ref.HybridRule(W, g, lf, 0.25, "shifted")), before)
    assert (got - before).abs().max() > 0.1


def test_unshifted_is_stable_where_exp_of_the_scores_overflows():
    """Every exact score +200 or -200 (all keys along one direction): exp(s) or exp(-m) alone would overflow fp32.
    The exact term wins outright at m = +200 (the output is the exact term alone), the linear term at m = -200 (the
    linear term alone); the reference and the kernels give that, finite."""
    S, W = 9, 4
    _, _, v, fq, fk, g, lf, _ = _seq(S, seed=2)
    H, s = _state()
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(5)), dim=0)
    kk = (20.0 * u).expand(B, HKV, S, D).contiguous()
    for sign in (1.0, -1.0):
        qq = (sign * 40.0 * u).expand(B, HQ, S, D).contiguous()  # q.k / sqrt(16) = 20 * 40 / 4 = +-200
        keys = ref.HybridKeys(kk, v, fk, H, s, q_offset=0)
        unshifted = ref.HybridRule(W, g, lf, D ** -0.5, "unshifted")
        got = ref.lola_attention(qq, fq, keys, unshifted)
        assert torch.isfinite(got).all()
        if sign > 0:
            want = ref.lola_attention(qq, fq, keys, ref.HybridRule(W, g, torch.zeros(HQ), D ** -0.5))  # exact only
        else:
            want = ref.lola_attention(qq, fq, keys, ref.HybridRule(W, torch.zeros(HQ), lf, D ** -0.5))  # linear only
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        got_f = tk.hybrid_fwd(qq, fq, keys, unshifted, block_m=16, block_n=16)
        torch.testing.assert_close(got_f.float(), want.transpose(1, 2), atol=1e-5, rtol=1e-5)
        got_d = tk.decode_step(qq[:, :, -1:].contiguous(), fq[:, :, -1:].contiguous(), ref.HybridKeys(kk, v, fk, H, s),
                               unshifted)
        torch.testing.assert_close(got_d.float(), want[:, :, -1:].transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_unshifted_rows_far_below_zero_without_linear_keys_keep_their_exact_term_and_finite_gradients():
    """Every exact score -200 and no linear state: the first `window` rows have no linear key, so their output is
    the exact term alone (exp(-200) underflows fp32: a weight exp(min(m, 0)) taken as it is gave those rows 0, and
    at m just above -87 an inf / nan gradient through the normaliser, which stopped a fine-tune of a real model);
    the later rows are the linear term alone. The reference, its gradients, the training path and the kernels."""
    S, W = 9, 4
    _, _, v, fq, fk, g, lf, _ = _seq(S, seed=2)
    H, s = torch.zeros(B, HQ, 2 * F, D), torch.zeros(B, HQ, 2 * F)
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(5)), dim=0)
    kk = (20.0 * u).expand(B, HKV, S, D).contiguous()
    for score in (-200.0, -88.0, -80.0):
        qq = (score / 5.0 * u).expand(B, HQ, S, D).contiguous()  # q.k / sqrt(16) = score
        keys = ref.HybridKeys(kk, v, fk, H, s, q_offset=0)
        unshifted = ref.HybridRule(W, g, lf, D ** -0.5, "unshifted")
        got = ref.lola_attention(qq, fq, keys, unshifted)
        exact = ref.lola_attention(qq, fq, keys, ref.HybridRule(W, g, torch.zeros(HQ), D ** -0.5))
        linear = ref.lola_attention(qq, fq, keys, ref.HybridRule(W, torch.zeros(HQ), lf, D ** -0.5))
        torch.testing.assert_close(got[:, :, :W], exact[:, :, :W], atol=1e-5, rtol=1e-5)
        assert exact[:, :, :W].abs().amax() > 0.1  # the window's values, not 0
        torch.testing.assert_close(got[:, :, W:], linear[:, :, W:], atol=1e-5, rtol=1e-5)
        got_f = tk.hybrid_fwd(qq, fq, keys, unshifted, block_m=16, block_n=16)
        torch.testing.assert_close(got_f.float(), got.transpose(1, 2), atol=1e-5, rtol=1e-5)
        # a decode step early in a sequence (all its keys in the window, the state still 0): the exact term alone
        early = ref.HybridKeys(kk[:, :, :W].contiguous(), v[:, :, :W].contiguous(), fk[:, :, :0], H, s)
        got_d = tk.decode_step(qq[:, :, W - 1:W].contiguous(), fq[:, :, W - 1:W].contiguous(), early, unshifted)
        torch.testing.assert_close(got_d.float(), exact[:, :, W - 1:W].transpose(1, 2), atol=1e-5, rtol=1e-5)
        qg, vg, fqg = (x.clone().requires_grad_(True) for x in (qq, v, fq))
        out = ref.hybrid_attention_quadratic(qg, kk, vg, fqg, fk, g, lf,
                                             HybridSpec(window=W, scale=D ** -0.5, combine="unshifted"))
        torch.testing.assert_close(out, got, atol=1e-5, rtol=1e-5)
        out.square().sum().backward()
        assert all(torch.isfinite(x.grad).all() for x in (qg, vg, fqg)), score
        sets = torch.full((1, B, HKV, 2), -1, dtype=torch.long)  # no sparse key
        qt, vt = (x.clone().requires_grad_(True) for x in (qq, v))
        tr = lola_attention_sets(qt, kk, vt, fq, fk, g, lf, PrefillSets(sets),
                                 SetsSpec(window=W, chunk=16, scale=D ** -0.5, combine="unshifted"))
        torch.testing.assert_close(tr.float(), got.transpose(1, 2), atol=1e-5, rtol=1e-5)
        tr.float().square().sum().backward()
        assert torch.isfinite(qt.grad).all() and torch.isfinite(vt.grad).all(), score


@pytest.mark.parametrize("window,chunk", [(8, 16), (5, 4)])
def test_chunked_reference_equals_quadratic_and_gradients_need_no_term_through_m(window, chunk):
    """The chunked reference (lolcats' training path) equals the quadratic one with "unshifted"; its gradients are
    those of the plain formula (m only keeps exp finite: no gradient flows through it)."""
    S = 23
    q, k, v, fq, fk, g, lf, _ = _seq(S, seed=4, sharp=1.0)
    km = _mask(S, [0, 3])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, fq, fk, g, lf)]
    a = ref.hybrid_attention_quadratic(*leaves, HybridSpec(window=window, combine="unshifted"), key_mask=km)
    b = ref.hybrid_attention_chunked(*leaves, HybridSpec(window=window, combine="unshifted", chunk=chunk), key_mask=km)
    H0, s0 = torch.zeros(B, HQ, 2 * F, D), torch.zeros(B, HQ, 2 * F)
    c = _plain(*leaves, H0, s0, window=window, scale=D ** -0.5, key_mask=km, q_offset=0)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    real = km[:, None, :, None].float()
    w = torch.randn(a.shape, generator=torch.Generator().manual_seed(0)) * real
    for out in (b, c):
        grads = torch.autograd.grad((out * w).sum(), leaves, retain_graph=True)
        if out is b:
            want = grads
        else:
            for x, y in zip(want, grads):
                torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,S", [(8, 45), (21, 37)])
def test_hybrid_fwd_per_block_matches_reference(dtype, window, S):
    """The whole-sequence forward (lolcats' prefill) with prefix states per block, left padding."""
    q, k, v, fq, fk, g, lf, _ = _seq(S, dtype=dtype, seed=5)
    km = _mask(S, [0, 5])
    want = ref.hybrid_attention_quadratic(q, k, v, fq, fk, g, lf, HybridSpec(window=window, scale=0.3,
                                                                             combine="unshifted"), key_mask=km)
    Hs, Ss = tk.chunk_states(fk, v, 16, key_mask=km)
    got = tk.hybrid_fwd(q, fq, ref.HybridKeys(k, v, fk, Hs, Ss, key_mask=km, q_offset=0, state_chunk=16),
                        ref.HybridRule(window, g, lf, 0.3, "unshifted"), block_m=16, block_n=16)
    real = km[:, :, None, None].expand_as(got)
    torch.testing.assert_close(got.float()[real], want.transpose(1, 2)[real], **TOL[dtype])
    shifted = ref.hybrid_attention_quadratic(q, k, v, fq, fk, g, lf, HybridSpec(window=window, scale=0.3), key_mask=km)
    assert (shifted - want).abs().max() > 0.05


@pytest.mark.parametrize("dtype,hs", [(torch.float32, HQ), (torch.float32, HKV), (torch.bfloat16, HKV)])
def test_hybrid_fwd_with_sparse_and_state_matches_lola_attention(dtype, hs):
    """A piece of the chunk loop on Triton: sparse cache per query or kv head, a state, left padding."""
    S, N, L, W = 19, 41, 11, 9
    q, k, v, fq, fk, g, lf, _ = _seq(S, N=N, dtype=dtype, seed=3)
    fk = fk[:, :, : N - W]
    gen = torch.Generator().manual_seed(9)
    spk = torch.randn(B, hs, L, D, generator=gen).to(dtype)
    spv = torch.randn(B, hs, L, D, generator=gen).to(dtype)
    valid = torch.rand(B, hs, L, generator=gen) > 0.3
    H, s = _state()
    km = _mask(N, [4, 0])
    keys = ref.HybridKeys(k, v, fk, H, s, key_mask=km, q_offset=N - S, sparse=ref.SparseSet(spk, spv, valid))
    rule = ref.HybridRule(W, g, lf, 0.25, "unshifted")
    want = ref.lola_attention(q, fq, keys, rule)
    got = tk.hybrid_fwd(q, fq, keys, rule, block_m=16, block_n=16)
    torch.testing.assert_close(got.float(), want.transpose(1, 2), **TOL[dtype])


@pytest.mark.parametrize("dtype,n_keys", [(torch.float32, None), (torch.float32, 9), (torch.bfloat16, 17)])
def test_decode_step_matches_reference(dtype, n_keys):
    """The decode step kernel, with the count on the host or on the device (a replayed step), a sparse cache read
    through its scores, left padding."""
    N, L, W = 30, 6, 7
    q, k, v, fq, fk, g, lf, _ = _seq(1, N=N, dtype=dtype, seed=11)
    gen = torch.Generator().manual_seed(2)
    spk = torch.randn(B, HKV, L, D, generator=gen).to(dtype)
    spv = torch.randn(B, HKV, L, D, generator=gen).to(dtype)
    score = torch.randn(B, HKV, L, generator=gen).masked_fill(torch.rand(B, HKV, L, generator=gen) > 0.6,
                                                              float("-inf"))
    H, s = _state()
    km = _mask(N, [0, 2])
    n = N if n_keys is None else n_keys
    keys = ref.HybridKeys(k[:, :, :n], v[:, :, :n], fk[:, :, :max(n - W, 0)], H, s, key_mask=km[:, :n],
                          sparse=ref.SparseSet(spk, spv, score.isfinite()))
    want = ref.lola_attention(q, fq, keys, ref.HybridRule(W, g, lf, 0.25, "unshifted"))
    count = None if n_keys is None else torch.full((B,), n, dtype=torch.long)
    got = tk.decode_step(q, fq, ref.HybridKeys(k, v, fk[:, :, :N - W], H, s, key_mask=km,
                                               sparse=ref.SparseSet(spk, spv, score=score)),
                         ref.HybridRule(W, g, lf, 0.25, "unshifted"), n_keys=count)
    torch.testing.assert_close(got.float(), want.transpose(1, 2), **TOL[dtype])


def _run(splits, seq, *, window, chunk, lam, mask=None, backend="torch", combine="unshifted", sparse_heads=HKV):
    q, k, v, fq, fk, g, lf, Wk = seq
    st = LolaState.empty(StateSizes(B, HQ, HKV, D, 2 * F, lam, sparse_heads=sparse_heads), q.dtype, q.device)
    phi_k = lambda x: ref.hedgehog_feature_map(x, Wk, out_dtype=q.dtype)  # noqa: E731
    run = LolaRun(phi_k=phi_k, window=window, chunk=chunk, lam=lam, scale=D ** -0.5, backend=backend,
                  combine=combine)
    outs, i = [], 0
    for n in splits:
        sl = slice(i, i + n)
        outs.append(lola_process(st, q[:, :, sl], k[:, :, sl], v[:, :, sl], fq[:, :, sl], g, lf, run,
                                 key_mask_new=None if mask is None else mask[:, sl]))
        i += n
    return torch.cat(outs, 1), st


@pytest.mark.parametrize("S,window,chunk,lam,sparse_heads,dtype", [
    (67, 16, 16, 8, HKV, torch.float32),   # the two-pass prefill (window, chunk multiples of 16), decode after
    (69, 16, 32, 6, HQ, torch.bfloat16),
    (45, 7, 5, 6, HKV, torch.float32),     # off the 16-grid: the chunk loop on Triton (hybrid_fwd pieces)
    (41, 16, 16, 0, HKV, torch.float32),   # lam = 0: lolcats' parallel prefill
])
def test_every_triton_path_equals_the_torch_chunk_loop(S, window, chunk, lam, sparse_heads, dtype, monkeypatch):
    """A prefill then decode steps across an eviction, Triton against the torch chunk loop, left padding (a phase
    group per row). The two-pass prefill runs where it can (counted); the state is the same whatever combine."""
    from longctx_patch.kernels.lola import prefill

    calls = []
    real_parallel = prefill.lola_parallel
    monkeypatch.setattr(prefill, "lola_parallel", lambda *a, **kw: calls.append(1) or real_parallel(*a, **kw))
    steps = chunk + 2
    seq = _seq(S + steps, seed=7, dtype=dtype, sharp=1.5)
    mask = _mask(S + steps, [0, 3])
    kw = dict(window=window, chunk=chunk, lam=lam, mask=mask, sparse_heads=sparse_heads)
    splits = [S] + [1] * steps
    want, st_want = _run(splits, seq, backend="torch", **kw)
    got, st = _run(splits, seq, backend="triton", **kw)
    if lam and window % 16 == 0 and chunk % 16 == 0:
        assert calls == [1] * sum(n >= 2 * chunk for n in (S, S - 3))
        assert calls
    real = mask[:, :, None, None].expand_as(want)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(st.H, st_want.H, atol=1e-4, rtol=1e-4)
    shifted, st_shifted = _run(splits, seq, backend="torch", combine="shifted", **kw)
    assert (shifted[real].float() - want[real].float()).abs().max() > 0.05
    torch.testing.assert_close(st_shifted.H, st_want.H, atol=1e-5, rtol=1e-5)  # combine changes no state
    assert torch.equal(st_shifted.sp_valid, st_want.sp_valid)


def test_whole_sequence_hybrid_unshifted_on_triton():
    """lolcats' whole-sequence hybrid without gradients: Triton's forward equals the torch path's."""
    S = 37
    q, k, v, fq, fk, g, lf, _ = _seq(S, seed=8)
    km = _mask(S, [0, 6])
    kw = dict(window=9, scale=D ** -0.5, chunk=8, combine="unshifted")
    want = hybrid_attention(q, k, v, fq, fk, g, lf, HybridSpec(backend="torch", **kw), key_mask=km)
    got = hybrid_attention(q, k, v, fq, fk, g, lf, HybridSpec(backend="triton", state_chunk=64, **kw), key_mask=km)
    real = km[:, :, None, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], **TOL[torch.float32])


def test_training_with_unshifted_refuses_the_triton_backward_and_takes_the_torch_path():
    """The Triton backward differentiates the shifted combination only: backend='triton' under gradients is refused
    by name for "unshifted", and the torch path (what 'auto' takes) differentiates it."""
    S = 21
    q, k, v, fq, fk, g, lf, _ = _seq(S, seed=10, sharp=1.0)
    qg = q.clone().requires_grad_(True)
    kw = dict(window=6, scale=D ** -0.5, chunk=8)
    with pytest.raises(ConfigError, match="combine='unshifted'.*backend='auto'"):
        hybrid_attention(qg, k, v, fq, fk, g, lf, HybridSpec(backend="triton", combine="unshifted", **kw))
    out = hybrid_attention(qg, k, v, fq, fk, g, lf, HybridSpec(backend="auto", combine="unshifted", **kw))
    want = ref.hybrid_attention_quadratic(q, k, v, fq, fk, g, lf, HybridSpec(window=6, combine="unshifted"))
    want = want.transpose(1, 2)
    torch.testing.assert_close(out.detach(), want, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert torch.isfinite(qg.grad).all() and qg.grad.abs().sum() > 0


def test_the_option_is_checked_where_every_option_is():
    for cls in (LolaConfig, LolcatsConfig):
        assert cls().combine == "shifted"
        assert cls.from_dict({"combine": "unshifted"}).combine == "unshifted"
        with pytest.raises(ConfigError, match="combine.*'shifted', 'unshifted'"):
            cls.from_dict({"combine": "max"})
    with pytest.raises(ValueError, match="combine"):
        ref.HybridRule(2, torch.ones(HQ), torch.ones(HQ), combine="max")


@pytest.mark.parametrize("method,extra", [("lolcats", {}), ("lola", {"sparse_cache": 3})])
def test_a_patched_model_passes_the_option_to_every_path(method, extra):
    """On a tiny model: the full forward (lolcats' whole-sequence hybrid, lola's chunk loop) and cached generation
    (prefill then decode steps) agree under combine=unshifted, and differ from the default."""
    import longctx_patch as lp
    from conftest import tiny_model

    kw = dict(window=5, feature_dim=8, chunk=4, backend="torch", **extra)
    a, b = tiny_model("llama"), tiny_model("llama")
    lp.patch(a, method, combine="unshifted", **kw)
    lp.patch(b, method, **kw)
    x = torch.randint(3, 128, (1, 18), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (a(x, use_cache=False).logits - b(x, use_cache=False).logits).abs().max() > 1e-3
        got = a.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
        seq = x
        for _ in range(8):
            seq = torch.cat([seq, a(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, seq)
