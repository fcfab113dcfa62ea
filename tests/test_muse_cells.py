"""MuSe's linear-cost far field (kernels/muse/cells.py): degenerate configurations equal exact attention, the
Triton forward equals the PyTorch reference (interpreter on the CPU), gradients of the reference, causality."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.kernels.muse.cells import cells_reference, cells_triton, make_cells_plan  # noqa: E402
from longctx_patch.methods.exact import softmax_attention  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def qkv(B, Hq, Hkv, S, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, h, S, D, generator=g).to(dtype)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_every_block_retrieved_is_exact(path):
    q, k, v = qkv(2, 4, 2, 517, 32, seed=1)
    plan = make_cells_plan(q, k, scale=0.2, block_size=128, k_clusters=16, topk_blocks=100)
    assert plan.retrieved.any()
    f = cells_reference if path == "reference" else cells_triton
    torch.testing.assert_close(f(q, k, v, plan, scale=0.2), softmax_attention(q, k, v, scale=0.2), atol=2e-6,
                               rtol=2e-5)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_one_key_per_cell_is_exact(path):
    """k_clusters = block_size: every cell holds one key (distinct random keys), so each super-key is its key."""
    q, k, v = qkv(1, 2, 1, 300, 16, seed=2)
    plan = make_cells_plan(q, k, scale=0.3, block_size=128, k_clusters=128, topk_blocks=0)
    assert int(plan.counts.max()) == 1
    f = cells_reference if path == "reference" else cells_triton
    torch.testing.assert_close(f(q, k, v, plan, scale=0.3), softmax_attention(q, k, v, scale=0.3), atol=2e-6,
                               rtol=2e-5)


def test_far_field_approximates_and_improves_with_cells():
    """Keys near a few directions: the cells summarise them well, and more cells / more retrieval is closer."""
    g = torch.Generator().manual_seed(3)
    S, D = 1024, 16
    centers = torch.randn(6, D, generator=g) * 2
    k = (centers[torch.randint(0, 6, (S,), generator=g)] + 0.1 * torch.randn(S, D, generator=g))[None, None]
    q = torch.randn(1, 2, S, D, generator=g)
    v = torch.randn(1, 1, S, D, generator=g)
    ref = softmax_attention(q, k, v, scale=0.25)
    errs = [rel(cells_reference(q, k, v, make_cells_plan(q, k, scale=0.25, block_size=128, k_clusters=c,
                                                         topk_blocks=t), scale=0.25), ref)
            for c, t in ((2, 0), (8, 0), (8, 2))]
    assert 0 < errs[2] < errs[1] < errs[0] and errs[1] < 0.05, errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [(2, 4, 2, 1000, 32, 128, 16, 2), (1, 2, 1, 700, 64, 256, 32, 1),
                                  (1, 3, 3, 389, 16, 128, 8, 1)])
def test_triton_matches_reference(case, dtype):
    B, Hq, Hkv, S, D, L, Ck, tb = case
    q, k, v = qkv(B, Hq, Hkv, S, D, dtype, seed=S)
    km = torch.ones(B, S, dtype=torch.bool)
    km[-1, :37] = False  # a left-padded row
    plan = make_cells_plan(q, k, scale=D**-0.5, block_size=L, k_clusters=Ck, topk_blocks=tb, key_mask=km)
    assert plan.retrieved.any() or tb == 0
    o = cells_triton(q, k, v, plan, scale=D**-0.5)
    r = cells_reference(q.float(), k.float(), v.float(), plan, scale=D**-0.5)
    assert o.dtype == dtype and o.shape == (B, S, Hq, D)
    o, r = o.float()[:, :, :], r.clone()
    o[-1, :37] = 0  # rows without a key: not compared (the patched module ignores them)
    r[-1, :37] = 0
    assert rel(o, r) < (2e-6 if dtype == torch.float32 else 1e-2)


def test_reference_gradcheck():
    q, k, v = (t.double().requires_grad_(True) for t in qkv(1, 2, 1, 45, 8, seed=5))
    plan = make_cells_plan(q, k, scale=0.4, block_size=8, k_clusters=3, topk_blocks=1)
    torch.autograd.gradcheck(lambda a, b, c: cells_reference(a, b, c, plan, scale=0.4), (q, k, v))


def test_later_keys_do_not_change_earlier_outputs():
    q, k, v = qkv(1, 2, 1, 640, 16, seed=6)
    plan = make_cells_plan(q, k, scale=0.25, block_size=128, k_clusters=8, topk_blocks=1)
    o = cells_triton(q, k, v, plan, scale=0.25)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 512:] += 3.0
    v2[:, :, 512:] -= 5.0
    plan2 = make_cells_plan(q, k2, scale=0.25, block_size=128, k_clusters=8, topk_blocks=1)
    o2 = cells_triton(q, k2, v2, plan2, scale=0.25)
    assert torch.equal(o[:, :512], o2[:, :512]) and not torch.allclose(o[:, 512:], o2[:, 512:])
