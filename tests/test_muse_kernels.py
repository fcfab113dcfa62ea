"""MuSe kernels: reference vs exact attention (degenerate configs), gradcheck, Triton fwd/bwd vs reference."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.errors import ConfigError  # noqa: E402
from longctx_patch.kernels.muse import MuseOptions, make_plan, muse_attention, muse_reference_planned  # noqa: E402
from longctx_patch.kernels.softmax import softmax_attention  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def qkv(B, Hq, Hkv, S, D, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, h, S, D, generator=g).to(dtype).requires_grad_(grad)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


KW = dict(block_size=16, q_clusters=2, k_clusters=8, kmeans_iters=2)


@pytest.mark.parametrize("S", [16, 41, 77])
def test_retrieve_all_blocks_is_exact(S):
    q, k, v = qkv(2, 4, 2, S, 16, seed=S)
    o = muse_attention(q, k, v, scale=0.25, options=MuseOptions(topk_blocks=10_000, topk_clusters=0, **KW),
                       backend="torch")
    ref = softmax_attention(q, k, v, scale=0.25)
    assert o.shape == (2, S, 4, 16)
    torch.testing.assert_close(o, ref, atol=2e-6, rtol=2e-5)


def test_retrieve_all_cells_and_singletons_are_exact():
    q, k, v = qkv(1, 4, 1, 53, 16, seed=1)
    ref = softmax_attention(q, k, v, scale=0.25)
    o = muse_attention(q, k, v, scale=0.25, options=MuseOptions(topk_blocks=0, topk_clusters=10_000, **KW),
                       backend="torch")
    torch.testing.assert_close(o, ref, atol=2e-6, rtol=2e-5)
    # one key per cluster: every super-key is a single key, whose logit lse + scale (q - c).k is exact
    o = muse_attention(q, k, v, scale=0.25, options=MuseOptions(block_size=16, q_clusters=2, k_clusters=16,
                                                                topk_blocks=0, topk_clusters=0), backend="torch")
    torch.testing.assert_close(o, ref, atol=2e-6, rtol=2e-5)


def test_padding_mask_retrieve_all_is_exact():
    q, k, v = qkv(2, 4, 2, 45, 16, seed=3)
    km = torch.ones(2, 45, dtype=torch.bool)
    km[0, :7] = False  # left padding
    km[1, 40:] = False  # right padding
    o = muse_attention(q, k, v, scale=0.25, options=MuseOptions(topk_blocks=99, **KW), key_mask=km, backend="torch")
    ref = softmax_attention(q, k, v, scale=0.25, key_mask=km)
    torch.testing.assert_close(o[0, 7:], ref[0, 7:], atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(o[1, :40], ref[1, :40], atol=2e-6, rtol=2e-5)


def test_approximation_is_not_exact_and_improves_with_retrieval():
    """The approximate path is really used, and more exact retrieval lowers the error (monotone on average)."""
    errs = []
    for kb, kc in [(0, 0), (1, 2), (3, 8)]:
        e = 0.0
        for seed in range(3):
            q, k, v = qkv(1, 2, 1, 128, 16, seed=seed)
            ref = softmax_attention(q, k, v, scale=0.25)
            o = muse_attention(q, k, v, scale=0.25, options=MuseOptions(topk_blocks=kb, topk_clusters=kc, **KW),
                               backend="torch")
            e += rel(o, ref)
        errs.append(e / 3)
    assert errs[0] > 1e-3
    assert errs[0] > errs[1] > errs[2]


def test_dipole_reduces_error_on_clustered_data():
    g = torch.Generator().manual_seed(0)
    B, H, S, D = 1, 2, 96, 16
    centers = torch.randn(4, D, generator=g) * 1.5
    pick = torch.randint(0, 4, (B, H, S), generator=g)
    k = centers[pick] + 0.3 * torch.randn(B, H, S, D, generator=g)
    q = centers[torch.randint(0, 4, (B, H, S), generator=g)] + 0.3 * torch.randn(B, H, S, D, generator=g)
    v = torch.randn(B, H, S, D, generator=g)
    ref = softmax_attention(q, k, v, scale=0.25)
    opts = MuseOptions(**dict(KW, q_clusters=4, k_clusters=4, topk_blocks=0, topk_clusters=0))
    e0 = rel(muse_attention(q, k, v, scale=0.25, options=opts, backend="torch"), ref)
    e1 = rel(muse_attention(q, k, v, scale=0.25, options=opts.replace(dipole=True), backend="torch"), ref)
    assert 1e-3 < e0 < 0.1  # the monopole summaries are good but not exact on clustered data
    assert e1 < 0.2 * e0  # the first-order (dipole) term removes most of the remaining error


def test_singleton_query_clusters_are_exact():
    """With one query per cluster (d = q - c = 0) the tilted summaries are exact whatever the key clusters."""
    q, k, v = qkv(1, 2, 2, 64, 16, seed=4)
    ref = softmax_attention(q, k, v, scale=0.25)
    o = muse_attention(q, k, v, scale=0.25, options=MuseOptions(block_size=16, q_clusters=16, k_clusters=4,
                                                                topk_blocks=0, topk_clusters=0), backend="torch")
    torch.testing.assert_close(o, ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dipole", [False, True])
def test_reference_gradcheck(dipole):
    q, k, v = qkv(1, 2, 1, 15, 4, dtype=torch.float64, seed=5, grad=True)
    km = torch.ones(1, 15, dtype=torch.bool)
    km[0, :2] = False
    plan = make_plan(q.detach(), k.detach(), scale=0.3, block_size=4, q_clusters=2, k_clusters=2, kmeans_iters=1,
                     topk_clusters=1, topk_blocks=0, key_mask=km)
    assert plan.ret_cell.any() and plan.num_blocks == 4
    f = lambda q, k, v: muse_reference_planned(q, k, v, plan, scale=0.3, dipole=dipole)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5, fast_mode=True)


def test_reference_chunking_does_not_change_the_result():
    q, k, v = qkv(2, 4, 2, 61, 16, seed=11, grad=True)
    plan = make_plan(q.detach(), k.detach(), scale=0.25, topk_clusters=2, topk_blocks=1, **KW)
    a = muse_reference_planned(q, k, v, plan, scale=0.25)
    b = muse_reference_planned(q, k, v, plan, scale=0.25, chunk_elems=1)  # one query block at a time
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    ga = torch.autograd.grad(a.sum(), (q, k, v))
    gb = torch.autograd.grad(b.sum(), (q, k, v))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_plan_is_deterministic_and_causal_tables():
    q, k, _ = qkv(1, 2, 1, 70, 16, seed=9)
    a = make_plan(q, k, scale=0.25, topk_clusters=3, topk_blocks=1, **KW)
    b = make_plan(q.clone(), k.clone(), scale=0.25, topk_clusters=3, topk_blocks=1, **KW)
    for x, y in [(a.q_assign, b.q_assign), (a.k_assign, b.k_assign), (a.ret_block, b.ret_block), (a.ret_cell, b.ret_cell)]:
        assert torch.equal(x, y)
    nb = a.num_blocks
    later = torch.arange(nb)[None, :] >= torch.arange(nb)[:, None]  # m >= n: never retrieved
    assert not a.ret_block[..., later[:, None, :].expand(nb, 2, nb)].any()
    nblk = a.ret_block.sum(-1)  # [B, H, n, i]: the local block n-1 plus one retrieved block
    assert not nblk[:, :, 0].any() and nblk[:, :, 1].eq(1).all() and nblk[:, :, 2:].eq(2).all()
    assert a.ret_block[:, :, torch.arange(1, nb), :, torch.arange(0, nb - 1)].all()  # local block always exact
    assert (a.ret_cell.flatten(-2).sum(-1)[:, :, 3:] == 3).all()
    assert not (a.ret_cell & a.ret_block[..., None]).any()  # a cell of a retrieved block is not counted twice


def test_dispatcher_errors():
    q, k, v = qkv(1, 3, 2, 16, 16)
    with pytest.raises(ConfigError, match="multiple"):
        muse_attention(q, k, v, scale=0.25)
    q, k, v = qkv(1, 2, 1, 16, 16)
    with pytest.raises(ConfigError, match="backend"):
        muse_attention(q, k, v, scale=0.25, backend="cuda")
    with pytest.raises(ConfigError, match="dipole"):
        muse_attention(q, k, v, scale=0.25, options=MuseOptions(dipole=True, **KW), backend="triton")


# ------------------------------------------------------------------------------------- Triton vs reference
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_single_block_is_exact_attention(backend):
    """S <= block_size: one block, no summaries: both backends are exact causal attention."""
    q, k, v = qkv(2, 2, 1, 11, 16, seed=2)
    o = muse_attention(q, k, v, scale=0.25, options=MuseOptions(block_size=16, q_clusters=4, k_clusters=4),
                       backend=backend)
    torch.testing.assert_close(o, softmax_attention(q, k, v, scale=0.25), atol=1e-5, rtol=1e-4)


TRITON_CASES = [
    # B, Hq, Hkv, S, D, L, Cq, Ck, topk_blocks, topk_clusters, mask
    (1, 4, 2, 75, 16, 16, 2, 8, 1, 2, False),
    (2, 2, 1, 50, 32, 16, 4, 4, 0, 3, True),
    (1, 2, 2, 33, 16, 16, 4, 8, 0, 0, False),
]


@pytest.mark.parametrize("case", TRITON_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(case, dtype):
    B, Hq, Hkv, S, D, L, Cq, Ck, kb, kc, masked = case
    q, k, v = qkv(B, Hq, Hkv, S, D, dtype=dtype, seed=S + D, grad=True)
    km = None
    if masked:
        km = torch.ones(B, S, dtype=torch.bool)
        km[0, :5] = False
    opts = dict(block_size=L, q_clusters=Cq, k_clusters=Ck, kmeans_iters=2, topk_blocks=kb, topk_clusters=kc)
    plan = make_plan(q.detach(), k.detach(), scale=D**-0.5, key_mask=km, **opts)
    kw = dict(scale=D**-0.5, options=MuseOptions(**opts), key_mask=km, plan=plan)
    o_t = muse_attention(q, k, v, backend="triton", **kw)
    o_r = muse_attention(q, k, v, backend="torch", **kw)
    assert o_t.dtype == dtype and o_t.shape == (B, S, Hq, D)
    assert torch.isfinite(o_t).all()
    do = torch.randn(o_t.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    g_t = torch.autograd.grad(o_t, (q, k, v), do)
    g_r = torch.autograd.grad(o_r, (q, k, v), do)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rows = slice(None) if km is None else (slice(1, None))  # batch 0's padded rows are ignored below
    assert rel(o_t, o_r) < tol
    if km is not None:
        assert rel(o_t[0, 5:], o_r[0, 5:]) < tol
    for name, a, b in zip("qkv", g_t, g_r):
        assert a.dtype == dtype and a.shape == b.shape
        assert rel(a, b) < tol, name
    del rows
