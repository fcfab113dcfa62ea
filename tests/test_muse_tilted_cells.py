"""MuSe's tilted-cells far field (kernels/muse/reference_tilted_cells.py): degenerate configurations equal exact attention, the
Triton forward and backward equal the PyTorch reference (interpreter on the CPU; fp32 and bf16, GQA with 7 query
heads per kv head, odd lengths, a left-padded row), the plan's query clusters and sort, the dispatcher."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.errors import ConfigError  # noqa: E402
from longctx_patch.kernels.muse import MuseOptions, muse_attention  # noqa: E402
from longctx_patch.kernels.muse.reference_cells import cells_reference  # noqa: E402
from longctx_patch.kernels.muse.reference_tilted_cells import (  # noqa: E402
    cluster_queries, make_tilt_plan, tilted_cells_reference, tilted_summaries)
from longctx_patch.kernels.muse.triton_tilted import head_chunk, tilted_cells_forward, tilted_cells_fwd  # noqa: E402
from longctx_patch.kernels.muse.triton_tilted_bwd import tilted_cells_bwd  # noqa: E402
from longctx_patch.kernels.softmax import softmax_attention  # noqa: E402

from conftest import rand_qkv as qkv, rel  # noqa: E402


CELLS = dict(block_size=128, k_clusters=4, topk_blocks=1, peak_blocks=1, sink_blocks=1, backend="torch")


def test_a_cluster_per_query_is_exact():
    """With one query per cluster the tilt point is the query (d = 0): every tilted summary is exact, so the far
    field adds no error whatever the cells."""
    q, k, v = qkv(1, 2, 1, 300, 16, dtype=torch.float64, seed=1)
    plan = make_tilt_plan(q, k, scale=0.3, q_clusters=384, **CELLS)
    torch.testing.assert_close(tilted_cells_reference(q, k, v, plan, scale=0.3),
                               softmax_attention(q, k, v, scale=0.3), atol=1e-6, rtol=1e-6)


def test_one_cluster_at_the_origin_is_the_cells_far_field_up_to_the_tilt():
    """The tilted summary at c = 0 is the cell's plain mean (w = 1): with the centroid forced to 0 the far field is
    the cells' (log n + s q.mu, mean value)."""
    q, k, v = qkv(1, 2, 1, 400, 16, dtype=torch.float64, seed=2)
    plan = make_tilt_plan(q, k, scale=0.3, q_clusters=1, **CELLS)
    plan.centroids.zero_()
    torch.testing.assert_close(tilted_cells_reference(q, k, v, plan, scale=0.3),
                               cells_reference(q, k, v, plan.cells, scale=0.3), atol=1e-10, rtol=1e-10)


def test_summaries_are_the_tilted_means():
    q, k, v = qkv(1, 2, 1, 256, 8, dtype=torch.float64, seed=3)
    plan = make_tilt_plan(q, k, scale=0.5, q_clusters=3, **CELLS)
    lse, kt, vt = tilted_summaries(k, v, plan, scale=0.5)
    cp = plan.cells
    h, i, m, j = 1, 2, 1, 3
    sel = (cp.k_assign[0, 0, m * 128:(m + 1) * 128] == j).nonzero()[:, 0] + m * 128
    w = torch.exp(0.5 * k[0, 0, sel] @ plan.centroids[0, h, i])
    cell = m * cp.k_clusters + j
    torch.testing.assert_close(lse[0, h, i, cell], w.sum().log())
    torch.testing.assert_close(kt[0, h, i, cell], (w[:, None] * k[0, 0, sel]).sum(0) / w.sum())
    torch.testing.assert_close(vt[0, h, i, cell], (w[:, None] * v[0, 0, sel]).sum(0) / w.sum())


def test_query_clusters_and_order():
    q, _, _ = qkv(2, 3, 1, 500, 8, seed=4)
    valid = torch.ones(2, 500, dtype=torch.bool)
    valid[1, :77] = False
    cent, a = cluster_queries(q, valid, 16, 2)
    assert cent.shape == (2, 3, 16, 8) and a.shape == (2, 3, 500)
    assert (a[1, :, :77] == 0).all()
    # each centroid is the mean of its real members, and each member's nearest centroid (Lloyd's fixed point after
    # the final assignment)
    for b in range(2):
        for c in a[b, 0, valid[b]].unique():
            sel = (a[b, 0] == c) & valid[b]
            torch.testing.assert_close(cent[b, 0, c], q[b, 0, sel].mean(0), atol=1e-5, rtol=1e-5)
    plan = make_tilt_plan(q, q[:, :1], scale=0.3, q_clusters=16, key_mask=valid, **CELLS)
    o = plan.order.long()
    for b in range(2):
        key = torch.where(plan.cells.key_valid[b, None], plan.assign[b], 16).gather(1, o[b])
        assert (key[:, 1:] >= key[:, :-1]).all()  # sorted by cluster, padding last
        assert sorted(o[b, 0].tolist()) == list(range(plan.cells.padded_len))  # a permutation


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (14, 2)])
def test_triton_forward_equals_reference(dtype, tol, Hq, Hkv):
    q, k, v = qkv(1, Hq, Hkv, 645, 32, dtype=dtype, seed=5)
    plan = make_tilt_plan(q, k, scale=32**-0.5, q_clusters=8, **CELLS)
    o = tilted_cells_fwd(q, k, v, plan, 32**-0.5)
    r = tilted_cells_reference(q, k, v, plan, scale=32**-0.5)
    assert rel(o, r) < tol
    assert o.dtype == dtype and o.shape == (1, 645, Hq, 32)


def test_triton_forward_left_padded_row():
    """A batch whose second row is left-padded by whole blocks (what the patched module gives MuSe): the padding rows
    output 0 and the real rows equal the reference's."""
    q, k, v = qkv(2, 4, 2, 700, 16, seed=6)
    km = torch.ones(2, 700, dtype=torch.bool)
    km[1, :256] = False
    plan = make_tilt_plan(q, k, scale=0.25, q_clusters=8, key_mask=km, **CELLS)
    o = tilted_cells_fwd(q, k, v, plan, 0.25)
    r = tilted_cells_reference(q, k, v, plan, scale=0.25)
    assert rel(o[1, 256:], r[1, 256:]) < 2e-6 and rel(o[0], r[0]) < 2e-6
    assert o[1, :256].abs().max() == 0


def test_more_clusters_err_less_on_clustered_queries():
    """Queries drawn around a few directions: the tilt at their clusters' centroids beats the untilted cells."""
    g = torch.Generator().manual_seed(7)
    dirs = torch.randn(6, 32, generator=g) * 2
    q = (dirs[torch.randint(0, 6, (1, 4, 1024), generator=g)] + 0.3 * torch.randn(1, 4, 1024, 32, generator=g))
    k = torch.randn(1, 2, 1024, 32, generator=g) * 1.5
    v = torch.randn(1, 2, 1024, 32, generator=g)
    ex = softmax_attention(q, k, v, scale=32**-0.5)
    plan = make_tilt_plan(q, k, scale=32**-0.5, q_clusters=8, **dict(CELLS, topk_blocks=0, peak_blocks=0))
    e_tilt = rel(tilted_cells_reference(q, k, v, plan, scale=32**-0.5), ex)
    e_cells = rel(cells_reference(q, k, v, plan.cells, scale=32**-0.5), ex)
    assert e_tilt < 0.5 * e_cells


def test_dispatcher():
    q, k, v = qkv(1, 4, 2, 600, 16, seed=8)
    opts = MuseOptions(far_field="tilted-cells", block_size=128, q_clusters=8, k_clusters=4, topk_blocks=1,
                       peak_blocks=1)
    kw = dict(scale=0.25, options=opts)
    o = muse_attention(q, k, v, backend="torch", **kw)
    o2 = muse_attention(q, k, v, backend="triton", **kw)
    assert rel(o2, o) < 2e-6
    grads = []
    for be in ("torch", "triton"):  # both train, to the same gradients
        qg = q.clone().requires_grad_(True)
        muse_attention(qg, k, v, backend=be, **kw).square().sum().backward()
        grads.append(qg.grad)
    assert grads[0].abs().sum() > 0 and rel(grads[1], grads[0]) < 2e-6
    with pytest.raises(ConfigError, match="multiple of 128"):
        muse_attention(q, k, v, scale=0.25, options=opts.replace(block_size=64), backend="triton")


def test_triton_forward_many_blocks_odd_cells():
    """More than 32 blocks (the retrieved blocks' bits span two words) and 3 cells per block (a tile of cells
    straddles blocks and words)."""
    q, k, v = qkv(1, 2, 1, 4500, 16, seed=9)
    plan = make_tilt_plan(q, k, scale=0.25, q_clusters=4, **dict(CELLS, k_clusters=3, topk_blocks=3, peak_blocks=2))
    assert plan.cells.num_blocks > 32 and plan.cells.retrieved[..., 32:].any()
    assert rel(tilted_cells_fwd(q, k, v, plan, 0.25), tilted_cells_reference(q, k, v, plan, scale=0.25)) < 2e-6


@pytest.mark.parametrize("C,D", [(70, 32), (140, 128)])  # one chunk of centroids per program; two at D 128
def test_nearest_with_sums_kernel(C, D):
    """A Lloyd round in one kernel: each token's nearest centroid, and each centroid's sum and count of real members
    (a left-padded row), over several chunks of tokens."""
    from longctx_patch.kernels.muse.triton_cluster import nearest_with_sums

    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 3, 300, D, generator=g).to(torch.bfloat16)
    cent = torch.randn(2, 3, C, D, generator=g)
    valid = torch.ones(2, 300, dtype=torch.bool)
    valid[1, :41] = False
    got, s, cnt = nearest_with_sums(x, cent, valid)
    sc = 2 * x.float() @ cent.to(torch.bfloat16).float().transpose(-1, -2) - (cent * cent).sum(-1)[:, :, None]
    # the kernel's products are the same bf16 products; only fp32 summation order may flip a near-tie
    picked = sc.gather(-1, got[..., None])[..., 0]
    assert (picked >= sc.amax(-1) - 1e-4).all() and (got == sc.argmax(-1)).float().mean() > 0.99
    members = torch.nn.functional.one_hot(got, C).float() * valid[:, None, :, None]  # [B, H, S, C]
    torch.testing.assert_close(cnt, members.sum(2), atol=0, rtol=0)
    torch.testing.assert_close(s, members.transpose(-1, -2) @ x.float(), atol=1e-4, rtol=1e-5)


def test_query_clusters_triton_equal_torch():
    """The clustering with its rounds in the kernel gives PyTorch's clusters and means (well-separated queries, runs
    of each centre's queries so that the evenly spaced initial centroids start one per centre: no near-ties for the
    bf16 products to flip)."""
    g = torch.Generator().manual_seed(13)
    centres = 4 * torch.randn(2, 12, 16, generator=g)
    q = (centres[:, torch.arange(400) * 12 // 400] + 0.1 * torch.randn(2, 400, 16, generator=g))
    q = q[None].to(torch.bfloat16)
    valid = torch.ones(1, 400, dtype=torch.bool)
    valid[0, :23] = False
    c0, a0 = cluster_queries(q, valid, 12, 2)
    c1, a1 = cluster_queries(q, valid, 12, 2, triton=True)
    assert torch.equal(a0, a1)
    torch.testing.assert_close(c1, c0, atol=1e-5, rtol=1e-5)


def _has_far_cells(plan) -> bool:
    """Some query block reads an earlier block through its cells (neither local nor retrieved): the summaries
    reach the output."""
    cp = plan.cells
    n = torch.arange(cp.num_blocks)
    far = n[None, :] < n[:, None] - cp.local_blocks  # [query block, key block]
    return bool((far & ~cp.retrieved.bool()).any())


def test_triton_forward_in_head_chunks():
    """Summaries held for one or two query heads at a time (a small memory budget; two, of 3 per kv head: a chunk
    straddles kv heads), batch 2, far cells read: the same output as all at once."""
    q, k, v = qkv(2, 6, 2, 520, 16, seed=12)
    plan = make_tilt_plan(q, k, scale=0.25, q_clusters=8, **dict(CELLS, peak_blocks=0))
    assert _has_far_cells(plan)
    whole = tilted_cells_fwd(q, k, v, plan, 0.25)
    per_head = 2 * 8 * plan.cells.num_blocks * 4 * (2 * 16 * 4 + 4)  # B * Cq * cells * (kt, vt, lse) bytes
    for heads in (1, 2):
        torch.testing.assert_close(tilted_cells_fwd(q, k, v, plan, 0.25, summary_bytes=heads * per_head), whole,
                                   atol=0, rtol=0)


def test_head_chunks_are_even():
    """Heads per chunk: as many as the budget holds, spread evenly over the chunks that takes."""
    per_head = 2 * 256 * 2048 * (2 * 64 * 2 + 4)  # B 2, 256 clusters, 2048 cells, D 64, bf16
    assert head_chunk(2, 32, 256, 2048, 64, 2, 31 * per_head) == 16  # 16 + 16, not 31 + 1
    assert head_chunk(2, 32, 256, 2048, 64, 2, 32 * per_head) == 32
    assert head_chunk(2, 6, 256, 2048, 64, 2, 4 * per_head) == 3
    assert head_chunk(2, 7, 256, 2048, 64, 2, 3 * per_head) == 3  # 3 + 3 + 1: three chunks either way
    assert head_chunk(2, 32, 256, 2048, 64, 2, per_head // 2) == 1  # at least one head
    assert head_chunk(2, 32, 256, 2048, 64, 2, 16 * per_head, arrays=2) == 8


def _grads(fn, q, k, v, g):
    """Gradients of sum(fn(q, k, v) * g) in q, k, v."""
    x = [t.clone().requires_grad_(True) for t in (q, k, v)]
    (fn(*x).float() * g).sum().backward()
    return [t.grad for t in x]


@pytest.mark.parametrize("dtype,Hq,Hkv,S,tol", [(torch.float32, 4, 2, 1100, 2e-6), (torch.bfloat16, 14, 2, 520, 1.5e-2)])
def test_triton_backward_equals_reference(dtype, Hq, Hkv, S, tol):
    """dq, dk, dv of the Triton kernels against autograd through the reference: a left-padded second row (its padding
    rows' output gradient 0, as a loss over real tokens gives), 3 cells per block, few blocks retrieved so that most
    earlier blocks are far. The summaries' backward carries a large share of dk and dv: without it (the reference
    with the summaries detached) dk and dv are off by 5-8% here."""
    q, k, v = qkv(2, Hq, Hkv, S, 16, dtype=dtype, seed=13)
    km = torch.ones(2, S, dtype=torch.bool)
    km[1, :256] = False
    plan = make_tilt_plan(q, k, scale=0.3, q_clusters=8, key_mask=km,
                          **dict(CELLS, k_clusters=3, topk_blocks=1, peak_blocks=0))
    g = torch.randn(2, S, Hq, 16, generator=torch.Generator().manual_seed(14))
    g[1, :256] = 0
    got = _grads(lambda *x: _apply(*x, plan, 0.3), q, k, v, g)
    want = _grads(lambda *x: tilted_cells_reference(*x, plan, scale=0.3), q, k, v, g)
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == b.shape
        assert rel(a, b) < tol


def _apply(q, k, v, plan, scale):
    from longctx_patch.kernels.muse.ops import tilted_cells_triton

    return tilted_cells_triton(q, k, v, plan, scale=scale)


def test_triton_backward_in_head_chunks():
    """The backward with the summaries of one or two query heads at a time (two, of 3 per kv head: a chunk straddles
    kv heads), batch 2, far cells read (no sink or peak block, so that the last query block of the 4 has one; their
    summaries carry gradient): the gradients of all heads at once."""
    q, k, v = qkv(2, 6, 2, 400, 16, seed=15)
    plan = make_tilt_plan(q, k, scale=0.25, q_clusters=8, **dict(CELLS, peak_blocks=0, sink_blocks=0))
    assert _has_far_cells(plan)
    do = torch.randn(2, 400, 6, 16, generator=torch.Generator().manual_seed(16))
    per_head = 2 * 2 * 8 * plan.cells.num_blocks * 4 * (2 * 16 * 4 + 4)  # two sets of summaries, batch 2

    def grads(nbytes):
        _, saved, meta = tilted_cells_forward(q, k, v, plan, 0.25, summary_bytes=nbytes)
        return tilted_cells_bwd(saved, meta, do)

    whole = grads(1 << 30)
    for heads in (1, 2):
        for a, b in zip(grads(heads * per_head), whole):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# every tile of the cells and tilted-cells kernels off its default (fp32, D 16; each divides block_size 128)
OTHER_TILES = dict(cells_fwd=(32, 64, 4, 1), cells_dkdv=(32, 64, 4, 1), tilted_far=(32, 32, 4, 1),
                   tilted_summ=(32, 16, 4), tilted_dq=(32, 32, 4), tilted_dsumm=(32, 32, 4), tilted_sbwd=(16, 16, 4))


@pytest.mark.parametrize("fields", [("cells_fwd", "tilted_far", "tilted_summ"),
                                    ("cells_dkdv", "tilted_dq", "tilted_dsumm", "tilted_sbwd")],
                         ids=["forward_tiles", "backward_tiles"])
def test_other_tiles_give_the_defaults_results(fields):
    """Launch tiles passed as `tiles=` (`MuseTiles`: the forward's, or the backward's, which the backward takes from
    its forward) through `muse_attention`: the defaults' output and gradients up to the order of the sums."""
    from longctx_patch.kernels.muse import MuseTiles

    q, k, v = qkv(1, 2, 1, 400, 16, seed=17)
    kw = dict(scale=0.25, options=MuseOptions(far_field="tilted-cells", block_size=128, q_clusters=8, k_clusters=3,
                                              topk_blocks=1, peak_blocks=0, sink_blocks=0), backend="triton")
    do = torch.randn(1, 400, 2, 16, generator=torch.Generator().manual_seed(18))
    runs = []
    for tiles in (None, MuseTiles(**{f: OTHER_TILES[f] for f in fields})):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = muse_attention(*x, tiles=tiles, **kw)
        o.backward(do)
        runs.append([o.detach()] + [t.grad for t in x])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_other_clustering_tiles_give_the_defaults_round():
    """A Lloyd round of the query clustering with other tiles (`MuseTiles.cluster_nearest`, `cluster_member`: more
    programs over the tokens and the centroids): the defaults' assignment, sums and counts."""
    from longctx_patch.kernels.muse import MuseTiles
    from longctx_patch.kernels.muse.triton_cluster import nearest_with_sums

    g = torch.Generator().manual_seed(19)
    x = torch.randn(1, 2, 300, 32, generator=g).to(torch.bfloat16)
    cent = torch.randn(1, 2, 70, 32, generator=g)
    valid = torch.ones(1, 300, dtype=torch.bool)
    valid[0, :17] = False
    a0, s0, c0 = nearest_with_sums(x, cent, valid)
    a1, s1, c1 = nearest_with_sums(x, cent, valid, MuseTiles(cluster_nearest=(64, 32, 4),
                                                             cluster_member=(32, 32, 4, 1, 4)))
    assert torch.equal(a1, a0) and torch.equal(c1, c0)
    torch.testing.assert_close(s1, s0, atol=1e-4, rtol=1e-5)


def test_tiles_are_checked():
    from longctx_patch.kernels.muse import MuseTiles

    for bad in (dict(cells_fwd=(64, 64, 4)), dict(tilted_dq=(48, 64, 4)), dict(tilted_sbwd=(32, 32, 3)),
                dict(cluster_member=(64, 64, 4, 0, 16)), dict(tilted_far=(64, 64, 4, True))):
        with pytest.raises(ValueError, match="allowed None or"):
            MuseTiles(**bad)
    with pytest.raises(ValueError, match="not MuSe tiles: far"):
        MuseTiles().replace(far=(64, 64, 4, 3))
    assert MuseTiles(tilted_dq=[64, 32, 4]).tilted_dq == (64, 32, 4)
    q, k, v = qkv(1, 2, 1, 256, 16, seed=20)
    with pytest.raises(ConfigError, match="MuseTiles"):
        muse_attention(q, k, v, scale=0.25, options=MuseOptions(far_field="cells", block_size=128), backend="torch",
                       tiles={"cells_fwd": (64, 64, 4, 3)})


def test_tiles_reach_the_tile_choices():
    from longctx_patch.kernels.muse import MuseTiles
    from longctx_patch.kernels.muse.triton_cells import cells_tiles
    from longctx_patch.kernels.muse.triton_cluster import member_tiles
    from longctx_patch.kernels.muse.triton_tilted import tilted_tiles
    from longctx_patch.kernels.muse.triton_tilted_bwd import tilted_bwd_tiles

    t = MuseTiles(**OTHER_TILES, cluster_member=(32, 32, 4, 1, 4))
    bf = torch.bfloat16
    assert cells_tiles(64, bf, 256) == cells_tiles(64, bf, 256, MuseTiles())
    assert (cells_tiles(64, bf, 256, t)["fwd"], cells_tiles(64, bf, 256, t)["dkdv"]) == ((32, 64, 4, 1), (32, 64, 4, 1))
    assert tilted_tiles(64, bf, t) == dict(summ=(32, 16, 4), far=(32, 32, 4, 1))
    assert tilted_bwd_tiles(64, bf, t) == dict(dq=(32, 32, 4), dsumm=(32, 32, 4), sbwd=(16, 16, 4))
    assert tilted_bwd_tiles(64, bf) == tilted_bwd_tiles(64, bf, MuseTiles(tilted_dsumm=None))
    assert member_tiles(64, 256, t) == (32, 32, 4, 1, 4) and member_tiles(64, 256) == (64, 64, 4, 3, 16)
