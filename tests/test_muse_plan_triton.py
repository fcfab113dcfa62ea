"""The Triton plan kernels of MuSe (kernels/muse/triton_cluster.py) against the PyTorch plan (interpreter on the CPU):
Lloyd clustering per block, the cells' block-retrieval scores and top-k, on random, well-separated and real inputs,
with padding, empty blocks, fewer valid tokens than clusters, and cluster counts that are not powers of two."""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.errors import ConfigError  # noqa: E402
from longctx_patch.kernels.muse.reference_cells import block_peaks, make_cells_plan  # noqa: E402
from longctx_patch.kernels.muse.triton_cluster import block_peaks_triton, block_scores_triton  # noqa: E402
from longctx_patch.kernels.muse.plan import lloyd  # noqa: E402


def objective(x, valid, cent, assign):
    """Within-cluster sum of squares of the valid tokens."""
    d = ((x.float() - torch.gather(cent, 1, assign[..., None].expand(-1, -1, x.shape[-1]))) ** 2).sum(-1)
    return float((d * valid).sum())


def separated(N, L, D, C, seed):
    """Tokens around C well-separated centres per block, every centre among any C consecutive tokens (no
    near-ties, even in a padded block): both backends must agree exactly."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(N, C, D, generator=g) * 10
    lab = (torch.arange(L) + torch.randint(0, C, (N, 1), generator=g)) % C
    return torch.gather(centres, 1, lab[..., None].expand(-1, -1, D)) + 0.01 * torch.randn(N, L, D, generator=g)


@pytest.mark.parametrize("L,D,C,iters", [(128, 64, 16, 2), (96, 32, 8, 1), (256, 16, 32, 2), (64, 32, 5, 3)])
def test_lloyd_equals_torch_on_separated_clusters(L, D, C, iters):
    x = separated(3, L, D, C, seed=L + C).bfloat16()
    valid = torch.ones(3, L, dtype=torch.bool)
    valid[1, L // 3:] = False  # a padded tail
    valid[2] = False  # an empty block
    ref = lloyd(x, valid, C, iters, backend="torch")
    tri = lloyd(x, valid, C, iters, backend="triton")
    assert torch.equal(tri[1][valid], ref[1][valid])
    torch.testing.assert_close(tri[2], ref[2], rtol=0, atol=0)
    torch.testing.assert_close(tri[0], ref[0], rtol=1e-5, atol=1e-5)
    assert tri[0][2].abs().max() == 0 and tri[2][2].sum() == 0  # empty block: zero centroids and counts


def test_lloyd_matches_torch_on_random_keys():
    """Gaussian keys have near-ties; allow a few tokens to change cluster, but the objective must agree."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 256, 64, generator=g).bfloat16()
    valid = torch.ones(4, 256, dtype=torch.bool)
    valid[3, 200:] = False
    valid[2, 20:] = False  # 20 valid tokens for 32 clusters: the init repeats tokens
    ref = lloyd(x, valid, 32, 2, backend="torch")
    tri = lloyd(x, valid, 32, 2, backend="triton")
    agree = (tri[1] == ref[1])[valid].float().mean().item()
    assert agree > 0.98, agree
    assert tri[2].sum(-1).tolist() == valid.sum(-1).float().tolist()
    ro, to = objective(x, valid, ref[0], ref[1]), objective(x, valid, tri[0], tri[1])
    assert abs(ro - to) / ro < 1e-3, (ro, to)


def test_lloyd_fewer_valid_tokens_than_clusters():
    x = torch.randn(1, 128, 32).bfloat16()
    valid = torch.zeros(1, 128, dtype=torch.bool)
    valid[0, [3, 50, 77]] = True
    ref = lloyd(x, valid, 16, 2, backend="torch")
    tri = lloyd(x, valid, 16, 2, backend="triton")
    assert torch.equal(tri[1][valid], ref[1][valid]) and torch.equal(tri[2], ref[2])
    torch.testing.assert_close(tri[0], ref[0])
    assert sorted(tri[2][0][tri[2][0] > 0].tolist()) == [1.0, 1.0, 1.0]


def test_lloyd_triton_refuses_unsupported_inputs():
    ones = torch.ones(2, 64, dtype=torch.bool)
    with pytest.raises(ConfigError, match="power of two"):
        lloyd(torch.randn(2, 64, 24).bfloat16(), ones, 4, 1, backend="triton")
    with pytest.raises(ConfigError, match="bf16"):
        lloyd(torch.randn(2, 64, 32), ones, 4, 1, backend="triton")
    x = torch.randn(2, 64, 32)  # fp32 on "auto" (and any device without CUDA) takes the PyTorch code
    assert torch.equal(lloyd(x, ones, 4, 1)[1], lloyd(x, ones, 4, 1, backend="torch")[1])


def test_block_scores_equal_the_torch_formula():
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, nb, Ck, D, loc = 2, 6, 2, 37, 16, 32, 1
    qbar = torch.randn(B, Hq, nb, D, generator=g)
    cent = torch.randn(B, Hkv, nb, Ck, D, generator=g)
    cnt = torch.randint(0, 5, (B, Hkv, nb, Ck), generator=g).float()
    logn = torch.where(cnt > 0, cnt.clamp_min(1).log(), torch.full_like(cnt, -math.inf))
    logn[0, 1, 4] = -math.inf  # a block with no valid key
    bs = block_scores_triton(qbar, cent, logn, scale=0.3, local_blocks=loc)
    sc = 0.3 * torch.einsum("bhnd,bhmcd->bhnmc", qbar, cent.repeat_interleave(Hq // Hkv, 1))
    ref = torch.logsumexp(sc + logn.repeat_interleave(Hq // Hkv, 1)[:, :, None], -1)
    ar = torch.arange(nb)
    far = ar[None, :] < ar[:, None] - loc
    ref = ref.masked_fill(~far, -math.inf)
    assert torch.equal(torch.isinf(bs), torch.isinf(ref))
    torch.testing.assert_close(bs[torch.isfinite(ref)], ref[torch.isfinite(ref)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L,D,nb", [(128, 32, 37), (256, 128, 9)])
def test_block_peaks_equal_the_brute_force_max(L, D, nb):
    """The peak score of block m for query block n, max_j scale * qbar_n . k_j over m's real keys (qbar rounded to
    the keys' bf16), from both backends against a direct max over every (n, m, j): GQA with 3 query heads per kv
    head (padded to 4 in the kernel's rows), a padding mask (an empty block), local blocks, more key blocks than
    one Triton program takes (37 > 16), more query blocks than one program's tile (37 > 32)."""
    g = torch.Generator().manual_seed(L)
    B, Hq, Hkv, loc = 2, 6, 2, 1
    qbar = torch.randn(B, Hq, nb, D, generator=g)
    kb = torch.randn(B, Hkv, nb, L, D, generator=g).bfloat16()
    valid = torch.rand(B, nb * L, generator=g) > 0.3
    valid[1, 2 * L:3 * L] = False  # block 2 of row 1 holds no real key
    s = 0.25 * torch.einsum("bhnd,bhmld->bhnml", qbar.bfloat16().float(), kb.float().repeat_interleave(Hq // Hkv, 1))
    ref = s.masked_fill(~valid.view(B, 1, 1, nb, L), -math.inf).amax(-1)
    ar = torch.arange(nb)
    ref = ref.masked_fill(~(ar[None, :] < ar[:, None] - loc), -math.inf)
    assert torch.isinf(ref[1, :, :, 2]).all() and torch.isfinite(ref).any()
    for got in (block_peaks(qbar, kb, valid, scale=0.25, local_blocks=loc, chunk_elems=5000),
                block_peaks_triton(qbar, kb, valid, scale=0.25, local_blocks=loc)):
        assert torch.equal(torch.isinf(got), torch.isinf(ref))
        torch.testing.assert_close(got[torch.isfinite(ref)], ref[torch.isfinite(ref)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_peak_blocks_retrieve_the_block_of_one_matching_key(backend):
    """Block 2 holds one key that matches every query of block 7; block 4 holds many keys that match it a little.
    The mass score ranks block 4 first (more total weight, and the cell means blur block 2's key), so one retrieved
    block misses block 2; one peak block more retrieves it. Block 0 is the sink, block 6 the local block."""
    g = torch.Generator().manual_seed(0)
    L, nb, D = 128, 8, 32
    u = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    k = torch.randn(1, 1, nb * L, D, generator=g) * 0.3
    k[0, 0, 4 * L:5 * L] += 0.8 * u
    k[0, 0, 2 * L + 5] = 4 * u
    q = torch.randn(1, 1, nb * L, D, generator=g)
    q[0, 0, 7 * L:] = 3 * u
    q, k = q.bfloat16(), k.bfloat16()  # the Triton clustering takes bf16 keys
    kw = dict(scale=D**-0.5, block_size=L, k_clusters=16, topk_blocks=1, backend=backend)
    mass_only = make_cells_plan(q, k, **kw).retrieved[0, 0, 7]
    with_peak = make_cells_plan(q, k, peak_blocks=1, **kw)
    assert mass_only.nonzero().flatten().tolist() == [0, 4]
    assert with_peak.retrieved[0, 0, 7].nonzero().flatten().tolist() == [0, 2, 4]
    assert with_peak.max_retrieved == 3 and int(with_peak.retrieved.sum(-1).max()) <= 3


@pytest.mark.parametrize("N,k", [(37, 4), (300, 10), (6, 5)])
def test_mark_top_equals_torch_take_top(N, k):
    """The retrieval's top-k in one kernel marks what PyTorch's top-k marks: the k best unmarked entries above -inf
    (rows with marked entries, -inf entries, fewer candidates than k; random scores: no ties)."""
    from longctx_patch.kernels.muse.reference_cells import take_top

    g = torch.Generator().manual_seed(N)
    scores = torch.randn(3, 4, N, generator=g)
    scores[scores < -1] = -math.inf
    marked = torch.rand(3, 4, N, generator=g) < 0.1
    want, got = marked.clone(), marked.clone()
    take_top(want, scores, k)
    take_top(got, scores, k, triton=True)
    assert torch.equal(got, want) and (want.sum(-1) <= marked.sum(-1) + k).all() and (want & ~marked).any()


@pytest.mark.parametrize("S,Ck,tb,pb,mask", [(1100, 16, 2, 0, False), (811, 32, 3, 0, True), (1100, 16, 1, 3, True)])
def test_cells_plan_triton_equals_torch(S, Ck, tb, pb, mask):
    """The whole plan on clustered keys (exact agreement) with GQA, an odd length and a padding mask. Every block
    has at least Ck valid keys: with fewer, the init repeats a token and the tie between the two equal centroids
    may fall either way (test_lloyd_fewer_valid_tokens_than_clusters covers that case)."""
    g = torch.Generator().manual_seed(S)
    D, Hq, Hkv, L = 32, 4, 2, 128
    nb = math.ceil(S / L)
    k = separated(2 * Hkv * nb, L, D, Ck, seed=S).view(2, Hkv, nb * L, D)[:, :, :S].bfloat16()
    q = torch.randn(2, Hq, S, D, generator=g).bfloat16()
    km = None
    if mask:
        km = torch.ones(2, S, dtype=torch.bool)
        km[1, :40] = False  # left padding
    kw = dict(scale=D**-0.5, block_size=L, k_clusters=Ck, topk_blocks=tb, peak_blocks=pb, key_mask=km)
    ref = make_cells_plan(q, k, backend="torch", **kw)
    tri = make_cells_plan(q, k, backend="triton", **kw)
    assert torch.equal(tri.retrieved, ref.retrieved) and tri.retrieved.any()
    kv = tri.key_valid[:, None].expand_as(tri.k_assign)
    assert torch.equal(tri.k_assign[kv], ref.k_assign[kv]) and torch.equal(tri.counts, ref.counts)


@pytest.mark.slow
def test_cells_plan_triton_on_smollm2_keys(smollm2):
    """Real post-rotary keys of SmolLM2 (layer 5): the retrieved blocks agree; the cells nearly do."""
    from longctx_patch.evals.approx import capture

    model, tok = smollm2
    text = "The history of the river valley begins with farmers who planted barley along its banks. " * 60
    q, k, _, _ = capture(model, tok(text, return_tensors="pt").input_ids[:, :900], layers=[5])[5]
    q, k = q.bfloat16(), k.bfloat16()
    kw = dict(scale=0.125, block_size=128, k_clusters=16, topk_blocks=2)
    ref = make_cells_plan(q, k, backend="torch", **kw)
    tri = make_cells_plan(q, k, backend="triton", **kw)
    assert (tri.k_assign == ref.k_assign).float().mean() > 0.98
    assert (tri.retrieved == ref.retrieved).float().mean() > 0.99
