"""Triton kernels of the LoLCATs hybrid / LoLA manager against their PyTorch references (TRITON_INTERPRET=1)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.kernels.lola import reference as ref  # noqa: E402
from longctx_patch.kernels.lola.tuning import LolaTuning  # noqa: E402

tk = pytest.importorskip("longctx_patch.kernels.lola.triton_kernels")

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _inputs(B=2, Hq=4, Hkv=2, S=37, D=16, F=8, dtype=torch.float32, seed=0, N=None):
    g = torch.Generator().manual_seed(seed)
    N = S if N is None else N
    q = torch.randn(B, Hq, S, D, generator=g)
    k = torch.randn(B, Hkv, N, D, generator=g)
    v = torch.randn(B, Hkv, N, D, generator=g)
    Wq = torch.randn(Hq, D, F, generator=g) * D ** -0.25
    Wk = torch.randn(Hq, D, F, generator=g) * D ** -0.25
    fq = ref.hedgehog_feature_map(q, Wq)
    fk = ref.hedgehog_feature_map(k, Wk)
    gw = torch.sigmoid(torch.randn(Hq, generator=g))
    lf = torch.ones(Hq)
    to = lambda x: x.to(DEV, dtype)  # noqa: E731
    return to(q), to(k), to(v), to(fq), to(fk), gw.to(DEV), lf.to(DEV)


def _left_pad_mask(B, N, pads):
    m = torch.ones(B, N, dtype=torch.bool)
    for b, p in enumerate(pads):
        m[b, :p] = False
    return m.to(DEV)


def test_feature_map_matches_definition():
    x = torch.randn(2, 2, 5, 8)
    W = torch.randn(4, 8, 3)  # 4 query heads over 2 kv heads
    phi = ref.hedgehog_feature_map(x, W)
    xr = x.repeat_interleave(2, dim=1)
    for h in range(4):
        p = xr[:, h] @ W[h]
        want = torch.cat([torch.softmax(p, -1), torch.softmax(-p, -1)], -1)
        torch.testing.assert_close(phi[:, h], want)
    assert phi.shape == (2, 4, 5, 6)


@pytest.mark.parametrize("window,chunk", [(8, 16), (20, 16), (5, 4)])
def test_chunked_reference_equals_quadratic(window, chunk):
    q, k, v, fq, fk, g, lf = _inputs(S=45)
    km = _left_pad_mask(2, 45, [0, 7])
    a = ref.hybrid_attention_quadratic(q, k, v, fq, fk, g, lf, ref.HybridSpec(window=window), key_mask=km)
    b = ref.hybrid_attention_chunked(q, k, v, fq, fk, g, lf, ref.HybridSpec(window=window, chunk=chunk), key_mask=km)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_chunked_reference_gradients_match_quadratic():
    q, k, v, fq, fk, g, lf = _inputs(S=29)
    W = torch.randn(4, 16, 8, requires_grad=True)
    gw = torch.zeros(4, requires_grad=True)

    def run(fn, **kw):
        fqq = ref.hedgehog_feature_map(q, W)
        fkk = ref.hedgehog_feature_map(k, W)
        o = fn(q, k, v, fqq, fkk, torch.sigmoid(gw), lf, ref.HybridSpec(window=6, **kw))
        (o ** 2).sum().backward()
        grads = (W.grad.clone(), gw.grad.clone())
        W.grad = None
        gw.grad = None
        return grads

    ga = run(ref.hybrid_attention_quadratic)
    gb = run(ref.hybrid_attention_chunked, chunk=8)
    for x, y in zip(ga, gb):
        assert x.abs().sum() > 0
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_chunk_states_match_cumsum():
    q, k, v, fq, fk, g, lf = _inputs(S=53)
    km = _left_pad_mask(2, 53, [3, 0])
    H0 = torch.randn(2, 4, 16, 16, device=DEV)
    s0 = torch.rand(2, 4, 16, device=DEV)
    Hs, Ss = tk.chunk_states(fk, v, 16, key_mask=km, H0=H0, s0=s0)
    assert Hs.shape == (2, 4, 4, 16, 16)
    vx = ref.expand_kv(v, 4)
    for n in range(4):
        w = km[:, None, : n * 16].float().expand(2, 4, -1)
        He, se = ref.fold(fk[:, :, : n * 16], vx[:, :, : n * 16], w, H0, s0)
        torch.testing.assert_close(Hs[:, :, n], He, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(Ss[:, :, n], se, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,S", [(8, 45), (21, 70)])
def test_hybrid_fwd_per_block_matches_reference(dtype, window, S):
    q, k, v, fq, fk, g, lf = _inputs(S=S, dtype=dtype)
    km = _left_pad_mask(2, S, [0, 5])
    want = ref.hybrid_attention_quadratic(q, k, v, fq, fk, g, lf, ref.HybridSpec(window=window, scale=0.3), key_mask=km)
    Hs, Ss = tk.chunk_states(fk, v, 16, key_mask=km)
    got = tk.hybrid_fwd(q, fq, ref.HybridKeys(k, v, fk, Hs, Ss, key_mask=km, q_offset=0, state_chunk=16),
                        ref.HybridRule(window, g, lf, 0.3), block_m=16, block_n=16)
    assert got.dtype == dtype and got.shape == (2, S, 4, 16)
    real = km[:, :, None, None].expand_as(got)  # padded query rows are ignored
    torch.testing.assert_close(got.float()[real], want.transpose(1, 2)[real], **TOL[dtype])


@pytest.mark.parametrize("dtype,hs", [(torch.float32, 4), (torch.float32, 2), (torch.bfloat16, 2)])
def test_hybrid_fwd_with_sparse_and_state_matches_lola_attention(dtype, hs):
    """Sparse cache per query head (hs = 4) or per kv head (hs = 2); key features only for the keys some
    query attends linearly (the manager stores no phi(k))."""
    S, N, L = 19, 40, 11
    q, k, v, fq, fk, g, lf = _inputs(S=S, N=N, dtype=dtype, seed=3)
    fk = fk[:, :, : N - 9]  # window 9: queries at N - S .. N - 1 attend keys < N - 9 linearly
    gen = torch.Generator().manual_seed(9)
    spk = torch.randn(2, hs, L, 16, generator=gen).to(DEV, dtype)
    spv = torch.randn(2, hs, L, 16, generator=gen).to(DEV, dtype)
    valid = (torch.rand(2, hs, L, generator=gen) > 0.3).to(DEV)
    H = torch.rand(2, 4, 16, 16, generator=gen).to(DEV)
    s = torch.rand(2, 4, 16, generator=gen).to(DEV) * 3
    km = _left_pad_mask(2, N, [4, 0])
    lf = torch.tensor([1.0, 0.5, 0.7, 1.0], device=DEV)
    keys = ref.HybridKeys(k, v, fk, H, s, key_mask=km, q_offset=N - S, sparse=ref.SparseSet(spk, spv, valid))
    rule = ref.HybridRule(9, g, lf, 0.25)
    want = ref.lola_attention(q, fq, keys, rule)
    got = tk.hybrid_fwd(q, fq, keys, rule, block_m=16, block_n=16)
    torch.testing.assert_close(got.float(), want.transpose(1, 2), **TOL[dtype])
    short = ref.HybridKeys(k, v, fk[:, :, :-1], H, s, q_offset=N - S)  # one linear key short
    with pytest.raises(ValueError, match="attended linearly"):
        tk.hybrid_fwd(q, fq, short, rule)
    with pytest.raises(ValueError, match="attended linearly"):
        ref.lola_attention(q, fq, short, ref.HybridRule(9, g, lf))


@pytest.mark.parametrize("dtype,hs", [(torch.float32, 4), (torch.float32, 2), (torch.bfloat16, 2)])
def test_decode_step_matches_reference(dtype, hs):
    N, L = 23, 6
    q, k, v, fq, fk, g, lf = _inputs(S=1, N=N, dtype=dtype, seed=5)
    fk = fk[:, :, : N - 7]  # window 7: only the keys older than the window need features
    gen = torch.Generator().manual_seed(2)
    spk = torch.randn(2, hs, L, 16, generator=gen).to(DEV, dtype)
    spv = torch.randn(2, hs, L, 16, generator=gen).to(DEV, dtype)
    valid = (torch.rand(2, hs, L, generator=gen) > 0.4).to(DEV)
    H = torch.rand(2, 4, 16, 16, generator=gen).to(DEV)
    s = torch.rand(2, 4, 16, generator=gen).to(DEV)
    km = _left_pad_mask(2, N, [0, 3])
    rule = ref.HybridRule(7, g, lf, 0.25)
    keys = ref.HybridKeys(k, v, fk, H, s, key_mask=km, sparse=ref.SparseSet(spk, spv, valid))
    want = ref.lola_attention(q, fq, keys, rule)
    got = tk.decode_step(q, fq, keys, rule)
    torch.testing.assert_close(got.float(), want.transpose(1, 2), **TOL[dtype])
    # the same sparse cache read through its scores (-inf: an empty slot)
    score = torch.rand(valid.shape, generator=gen).to(DEV).masked_fill(~valid, float("-inf"))
    scored = ref.HybridKeys(k, v, fk, H, s, key_mask=km, sparse=ref.SparseSet(spk, spv, score=score))
    assert torch.equal(tk.decode_step(q, fq, scored, rule), got)
    torch.testing.assert_close(ref.lola_attention(q, fq, scored, rule), want, atol=0, rtol=0)
    # no sparse cache, no padding
    keys = ref.HybridKeys(k, v, fk, H, s)
    want = ref.lola_attention(q, fq, keys, rule)
    got = tk.decode_step(q, fq, keys, rule)
    torch.testing.assert_close(got.float(), want.transpose(1, 2), **TOL[dtype])
    # nothing older than the window: no features at all
    keys, rule = ref.HybridKeys(k, v, fk[:, :, :0], H, s), ref.HybridRule(N, g, lf, 0.25)
    want = ref.lola_attention(q, fq, keys, rule)
    got = tk.decode_step(q, fq, keys, rule)
    torch.testing.assert_close(got.float(), want.transpose(1, 2), **TOL[dtype])
    # the query is the last local key; one state, one sparse set
    for bad in (dict(q_offset=N - 1), dict(state_chunk=16), dict(sparse_chunk=16)):
        with pytest.raises(ValueError, match="decode_step: the query is the last local key"):
            tk.decode_step(q, fq, ref.HybridKeys(k, v, fk, H, s, **bad), rule)
    with pytest.raises(ValueError, match="one of them"):
        ref.HybridKeys(k, v, fk, H, s, sparse=ref.SparseSet(spk, spv))


@pytest.mark.parametrize("dtype,n_keys", [(torch.float32, 23), (torch.float32, 9), (torch.bfloat16, 17)])
def test_decode_step_with_the_count_on_the_device_matches_reference(dtype, n_keys):
    """`n_keys` (a decode step replayed from a graph): the buffer's first n_keys rows are the local keys, the rest are
    garbage the step must not read; one launch for every count. Against the reference on the first n_keys rows
    (7 query heads per kv head, a left-padded row, a sparse cache)."""
    N, L, window = 30, 6, 7
    gen = torch.Generator().manual_seed(11)
    B, Hq, Hkv, D, F2 = 2, 7, 1, 16, 16
    q = torch.randn(B, Hq, 1, D, generator=gen).to(DEV, dtype)
    k = torch.randn(B, Hkv, N, D, generator=gen).to(DEV, dtype)
    v = torch.randn(B, Hkv, N, D, generator=gen).to(DEV, dtype)
    fq = torch.softmax(torch.randn(B, Hq, 1, F2, generator=gen), -1).to(DEV, dtype)
    fk = torch.softmax(torch.randn(B, Hq, N - window, F2, generator=gen), -1).to(DEV, dtype)
    g, lf = torch.rand(Hq, generator=gen).to(DEV), torch.rand(Hq, generator=gen).to(DEV)
    spk = torch.randn(B, Hkv, L, D, generator=gen).to(DEV, dtype)
    spv = torch.randn(B, Hkv, L, D, generator=gen).to(DEV, dtype)
    score = torch.randn(B, Hkv, L, generator=gen).to(DEV).masked_fill(torch.rand(B, Hkv, L, generator=gen).to(DEV) > 0.6,
                                                                       float("-inf"))
    H = torch.rand(B, Hq, F2, D, generator=gen).to(DEV)
    s = torch.rand(B, Hq, F2, generator=gen).to(DEV)
    km = _left_pad_mask(B, N, [0, 2])
    n = n_keys
    sparse = ref.SparseSet(spk, spv, score.isfinite())
    rule = ref.HybridRule(window, g, lf, 0.25)
    want = ref.lola_attention(q, fq, ref.HybridKeys(k[:, :, :n], v[:, :, :n], fk[:, :, :max(n - window, 0)], H, s,
                                                    key_mask=km[:, :n], sparse=sparse), rule)
    count = torch.full((B,), n, dtype=torch.long, device=DEV)
    keys = ref.HybridKeys(k, v, fk, H, s, key_mask=km, sparse=ref.SparseSet(spk, spv, score=score))
    got = tk.decode_step(q, fq, keys, rule, n_keys=count)
    torch.testing.assert_close(got.float(), want.transpose(1, 2), **TOL[dtype])
    # the reference's own device-count form (the torch backend's decode step) agrees
    dev = ref.lola_attention(q, fq, ref.HybridKeys(k, v, torch.nn.functional.pad(fk, (0, 0, 0, window)), H, s,
                                                   key_mask=km, q_offset=count[:1] - 1, sparse=sparse), rule)
    torch.testing.assert_close(dev, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sre_score_and_fold_match_reference(dtype):
    gen = torch.Generator().manual_seed(4)
    B, Hq, Hkv, N, D, F2 = 2, 4, 2, 37, 16, 16
    fk = torch.softmax(torch.randn(B, Hq, N, F2, generator=gen), -1).to(DEV, dtype)
    v = torch.randn(B, Hkv, N, D, generator=gen).to(DEV, dtype)
    H = torch.randn(B, Hq, F2, D, generator=gen).to(DEV)
    s = torch.rand(B, Hq, F2, generator=gen).to(DEV) + 0.1
    valid = (torch.rand(B, Hq, N, generator=gen) > 0.2).to(DEV)
    vx = ref.expand_kv(v, Hq)
    want = ref.sre_scores(fk, vx, H, s).masked_fill(~valid, float("-inf"))
    got = tk.sre_score(fk, v, H, s, valid)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    # fp32-accurate for bf16 features too (three bf16 dots against H split in three bf16 parts): one bf16
    # part alone would be off by ~1e-3 relative
    want32 = ref.sre_scores(fk.float(), vx.float(), H, s).masked_fill(~valid, float("-inf"))
    torch.testing.assert_close(got, want32, atol=1e-6, rtol=2e-5)
    w = valid.float() * torch.rand(B, Hq, N, generator=gen).to(DEV)
    He, se = ref.fold(fk, vx, w, H, s)
    for block in (None, 16):  # default tiles, and the smaller ones that give more programs
        H2, s2 = H.clone(), s.clone()
        tk.fold_into_state(fk, v, w, H2, s2, tuning=LolaTuning(fold_block=block))
        torch.testing.assert_close(H2, He, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s2, se, atol=1e-4, rtol=1e-4)
    # weights per kv head (query head h reads those of h // 2), and one row of weights for every head
    for wg in (w[:, ::2], w[:, :1]):
        He, se = ref.fold(fk, vx, ref.expand_kv(wg, Hq) if wg.shape[1] > 1 else wg.expand(B, Hq, N), H, s)
        H2, s2 = H.clone(), s.clone()
        tk.fold_into_state(fk, v, wg, H2, s2)
        torch.testing.assert_close(H2, He, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s2, se, atol=1e-4, rtol=1e-4)


@pytest.fixture(params=["ieee", "tf32x3"], ids=["fmap-ieee", "fmap-tf32x3"])
def fmap_prec(request):
    """The feature map's projection precision for fp32 weights (LolaTuning.fmap_prec, passed to the kernels): both
    settings must match."""
    return LolaTuning(fmap_prec=request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_feature_map_kernel_matches_reference(dtype, fmap_prec):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 2, 45, 16, generator=gen).to(DEV, dtype)
    W = (torch.randn(4, 16, 8, generator=gen) * 0.7).to(DEV, dtype)  # 4 heads over 2 kv heads
    want = ref.hedgehog_feature_map(x, W, out_dtype=torch.float32)
    got = tk.feature_map(x, W, out_dtype=torch.float32, tuning=fmap_prec)
    torch.testing.assert_close(got, want, **TOL[dtype])
    got16 = tk.feature_map(x, W, tuning=fmap_prec)
    assert got16.dtype == dtype and got16.shape == (2, 4, 45, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hx,H", [(4, 4), (2, 4), (1, 7)])  # one query head per input, 2, and 7 per kv head
@pytest.mark.parametrize("need", ["both", "dx", "dw"])
def test_feature_map_backward_matches_reference(dtype, Hx, H, need, fmap_prec):
    """`ops.feature_map` under grad on the Triton path (FeatureMapFn) gives the reference's value and gradients,
    odd length, several row tiles per program, a kv-head input summed over its group; the clamp's gradient
    included (a sharp map puts some softmax entries below eps)."""
    from longctx_patch.kernels.lola.ops import feature_map

    gen = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, Hx, 83, 16, generator=gen).to(DEV, dtype)
    W0 = torch.randn(H, 16, 8, generator=gen).to(DEV) * 1.5
    up = torch.randn(2, H, 83, 16, generator=gen).to(DEV, dtype)
    eps = 1e-4

    def run(backend):
        x = x0.clone().requires_grad_(need != "dw")
        W = W0.clone().requires_grad_(need != "dx")
        phi = feature_map(x, W, eps=eps, out_dtype=dtype, backend=backend, tuning=fmap_prec)
        (phi.float() * up.float()).sum().backward()
        return phi, x.grad, W.grad

    phi_t, dx_t, dw_t = run("triton")
    phi_r, dx_r, dw_r = run("torch")
    assert phi_t.grad_fn is not None and type(phi_t.grad_fn).__name__ == "FeatureMapFnBackward"
    tol = TOL[dtype]
    torch.testing.assert_close(phi_t.float(), phi_r.float(), **tol)
    if need != "dw":
        assert dx_t.dtype == dtype
        scale = dx_r.float().abs().max()
        torch.testing.assert_close(dx_t.float() / scale, dx_r.float() / scale, **tol)
    else:
        assert dx_t is None
    if need != "dx":
        assert dw_t.dtype == torch.float32
        scale = dw_r.abs().max()
        torch.testing.assert_close(dw_t / scale, dw_r / scale, **tol)
    else:
        assert dw_t is None
    # several row tiles per program and several programs: the same gradients
    x = x0.clone()
    dphi = torch.randn(2, H, 83, 16, generator=gen).to(DEV, dtype)
    a = tk.feature_map_bwd(x, W0, dphi, eps, True, True, rows_per_program=32, tuning=fmap_prec)
    b = tk.feature_map_bwd(x, W0, dphi, eps, True, True, rows_per_program=128, tuning=fmap_prec)
    torch.testing.assert_close(a[0].float(), b[0].float(), **tol)
    torch.testing.assert_close(a[1], b[1], atol=1e-4, rtol=1e-4)
