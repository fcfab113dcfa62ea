"""MuSe's linear-cost far field (kernels/muse/reference_cells.py): degenerate configurations equal exact attention, the
Triton forward equals the PyTorch reference (interpreter on the CPU), gradients of the reference, causality."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.errors import ConfigError  # noqa: E402
from longctx_patch.kernels.muse.reference_cells import cells_reference, make_cells_plan  # noqa: E402
from longctx_patch.kernels.muse.ops import cells_triton  # noqa: E402
from longctx_patch.kernels.softmax import softmax_attention  # noqa: E402

from conftest import rand_qkv as qkv, rel  # noqa: E402


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


def test_sink_blocks_are_exact_for_every_far_query_block():
    """The first `sink_blocks` blocks holding a real key are exact for every query block they are far from, in
    addition to (not instead of) the `topk_blocks` retrieved ones; with a left-padded row, its first real block."""
    B, Hq, L, nb, tb = 2, 4, 128, 9, 2
    q, k, v = qkv(B, Hq, 2, nb * L - 5, 16, seed=4)
    km = torch.ones(B, nb * L - 5, dtype=torch.bool)
    km[1, :300] = False  # row 1: blocks 0 and 1 are padding, block 2 holds its first real keys
    for backend, dt in (("torch", torch.float32), ("triton", torch.bfloat16)):  # the Triton plan takes bf16
        for sinks in (0, 1, 2):
            plan = make_cells_plan(q.to(dt), k.to(dt), scale=0.25, block_size=L, k_clusters=8, topk_blocks=tb, sink_blocks=sinks,
                                   key_mask=km, backend=backend)
            R = plan.retrieved
            assert plan.max_retrieved == tb + sinks
            for b, first in ((0, 0), (1, 2)):
                for m in range(first, first + sinks):
                    assert R[b, :, m + 2:, m].all() and not R[b, :, :m + 2, m].any()  # far (local_blocks 1) only
                # every query block with enough far blocks retrieves tb besides its sinks
                n = nb - 1
                far_non_sink = [m for m in range(n - 1) if not first <= m < first + sinks]
                assert int(R[b, :, n].sum(-1).min()) == min(tb, len(far_non_sink)) + sinks
    o = cells_triton(q, k, v, plan, scale=0.25)
    r = cells_reference(q, k, v, plan, scale=0.25)
    o[1, :300] = 0
    r[1, :300] = 0
    assert rel(o, r) < 2e-6


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
                                  (1, 3, 3, 389, 16, 128, 8, 1), (1, 2, 1, 512, 32, 128, 8, 1)])
@pytest.mark.parametrize("masked", [True, False], ids=["key_mask", "no_mask"])
def test_triton_matches_reference(case, dtype, masked):
    """With a key mask (a left-padded row: the kernels mask the listed blocks) and without one (they do not); a
    length that fills whole blocks (the kernels read the inputs in place)."""
    B, Hq, Hkv, S, D, L, Ck, tb = case
    q, k, v = qkv(B, Hq, Hkv, S, D, dtype, seed=S)
    km = torch.ones(B, S, dtype=torch.bool)
    km[-1, :37] = False  # a left-padded row
    plan = make_cells_plan(q, k, scale=D**-0.5, block_size=L, k_clusters=Ck, topk_blocks=tb,
                           key_mask=km if masked else None)
    assert plan.key_masked == masked
    assert plan.retrieved.any() or tb == 0
    o = cells_triton(q, k, v, plan, scale=D**-0.5)
    r = cells_reference(q.float(), k.float(), v.float(), plan, scale=D**-0.5)
    assert o.dtype == dtype and o.shape == (B, S, Hq, D)
    o, r = o.float()[:, :, :], r.clone()
    o[-1, :37] = 0  # rows without a key: not compared (the patched module ignores them)
    r[-1, :37] = 0
    assert rel(o, r) < (2e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [(2, 4, 2, 700, 32, 128, 16, 2), (1, 2, 1, 600, 64, 256, 32, 1)])
@pytest.mark.parametrize("masked", [True, False], ids=["key_mask", "no_mask"])
def test_triton_backward_matches_reference(case, dtype, masked):
    B, Hq, Hkv, S, D, L, Ck, tb = case
    g = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(B, h, S, D, generator=g).to(dtype).requires_grad_(True) for h in (Hq, Hkv, Hkv))
    km = torch.ones(B, S, dtype=torch.bool)
    km[-1, :37] = False
    plan = make_cells_plan(q, k, scale=D**-0.5, block_size=L, k_clusters=Ck, topk_blocks=tb,
                           key_mask=km if masked else None)
    assert plan.retrieved.any()
    o = cells_triton(q, k, v, plan, scale=D**-0.5)
    do = torch.randn(o.shape, generator=g).to(dtype)
    do[-1, :37] = 0  # rows without a key
    got = torch.autograd.grad(o, (q, k, v), do)
    qr, kr, vr = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    want = torch.autograd.grad(cells_reference(qr, kr, vr, plan, scale=D**-0.5), (qr, kr, vr), do.float())
    for a, b in zip(got, want):
        assert a.dtype == dtype and rel(a, b) < (2e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backward_splits_the_blocks_read_by_many(dtype):
    """7 query heads per kv head over 5 blocks (the last one partial): the sink block is read by 35 (head, query
    block) pairs, more than one program of the dK/dV kernel takes (`READERS_CHUNK`, 32), so its sums are split over
    programs and added; the other blocks' are stored by one program. Both against the reference."""
    from longctx_patch.kernels.muse.triton_cells import READERS_CHUNK, exact_readers

    g = torch.Generator().manual_seed(21)
    S, D = 600, 16
    q, k, v = (torch.randn(1, h, S, D, generator=g).to(dtype).requires_grad_(True) for h in (14, 2, 2))
    plan = make_cells_plan(q, k, scale=0.25, block_size=128, k_clusters=4, topk_blocks=1, sink_blocks=1)
    readers, counts = exact_readers(plan.retrieved, plan.local_blocks, 2)
    assert plan.num_blocks == 5 and counts.max() > READERS_CHUNK and (counts <= READERS_CHUNK).any()
    far = plan.num_blocks - 1 - plan.local_blocks  # blocks before the last query block's local ones
    assert not plan.retrieved[..., -1, :far].bool().all()  # some of them are far: read through their cells
    o = cells_triton(q, k, v, plan, scale=0.25)
    do = torch.randn(o.shape, generator=g).to(dtype)
    got = torch.autograd.grad(o, (q, k, v), do)
    qr, kr, vr = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    want = torch.autograd.grad(cells_reference(qr, kr, vr, plan, scale=0.25), (qr, kr, vr), do.float())
    for a, b in zip(got, want):
        assert rel(a, b) < (2e-6 if dtype == torch.float32 else 1e-2)


def test_exact_readers_is_the_transpose_of_the_exact_lists():
    from longctx_patch.kernels.muse.triton_cells import exact_lists, exact_readers

    q, k, _ = qkv(2, 6, 2, 1500, 16, torch.float32, seed=22)
    plan = make_cells_plan(q, k, scale=0.25, block_size=128, k_clusters=4, topk_blocks=2, sink_blocks=1)
    lists = exact_lists(plan)  # [B, Hq, n, entries]: the earlier blocks n reads exactly
    readers, counts = exact_readers(plan.retrieved, plan.local_blocks, 2)
    nb = plan.num_blocks
    for b in range(2):
        for hk in range(2):
            for m in range(nb):
                got = readers[b, hk, m, :counts[b, hk, m]].tolist()
                want = sorted(g * nb + n for g in range(3) for n in range(nb)
                              if n == m or m in lists[b, hk * 3 + g, n].tolist())
                assert got == want
    by_row = exact_readers(plan.retrieved, plan.local_blocks, 2, chunk_elems=1)  # built one batch row at a time
    assert torch.equal(by_row[0], readers) and torch.equal(by_row[1], counts)

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


def test_muse_attention_dispatch_and_errors():
    from longctx_patch.kernels.muse import MuseOptions, muse_attention

    q, k, v = qkv(1, 4, 2, 300, 32, seed=7)
    opts = MuseOptions(block_size=128, k_clusters=16, topk_blocks=1, far_field="cells")
    kw = dict(scale=0.2, options=opts)
    torch.testing.assert_close(muse_attention(q, k, v, backend="triton", **kw),
                               muse_attention(q, k, v, backend="torch", **kw), atol=1e-5, rtol=1e-4)
    with pytest.raises(ConfigError, match="far_field='tilted'"):
        opts.replace(dipole=True)
    with pytest.raises(ConfigError, match="multiple of 128"):
        muse_attention(q, k, v, scale=0.2, options=opts.replace(block_size=64), backend="triton")
    with pytest.raises(ConfigError, match="far_field"):
        MuseOptions(far_field="global")
    with pytest.raises(ConfigError, match="MuseOptions"):
        muse_attention(q, k, v, scale=0.2, options=dict(far_field="cells"))
    with pytest.raises(ValueError, match="not MuSe options: blocks"):
        opts.replace(blocks=3)
    # gradients through both backends: the Triton backward equals autograd through the reference
    grads = {}
    for backend in ("torch", "triton"):
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        muse_attention(qg, kg, vg, backend=backend, **kw).pow(2).sum().backward()
        grads[backend] = (qg.grad, kg.grad, vg.grad)
    for a, b in zip(grads["triton"], grads["torch"]):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("D", [24, 8])
def test_head_dims_off_the_kernel_grid_run_zero_padded(D):
    """A head_dim that is not a power of two in 16..128 runs the Triton path zero-padded (24 -> 32, 8 -> 16): the
    same output and gradients as the reference at the real head_dim; above 128 the Triton path says what to do."""
    from longctx_patch.kernels.muse import MuseOptions, muse_attention

    q, k, v = (t.requires_grad_(True) for t in qkv(1, 4, 2, 300, D, seed=D))
    kw = dict(scale=D**-0.5, options=MuseOptions(block_size=128, k_clusters=8, topk_blocks=1, peak_blocks=1,
                                                 far_field="cells"))
    got = muse_attention(q, k, v, backend="triton", **kw)
    ref = muse_attention(q, k, v, backend="torch", **kw)
    assert got.shape == ref.shape == (1, 300, 4, D)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    do = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    big = torch.zeros(1, 1, 300, 160)
    with pytest.raises(ConfigError, match="<= 128"):
        muse_attention(big, big, big, backend="triton", **dict(kw, scale=0.1))


def test_mixed_dtypes_and_autocast():
    """Under autocast the rotary embedding hands over fp32 q/k with a bf16 v: the attention runs in the autocast
    dtype, as SDPA does (bf16 out), forward and backward; without autocast, k and v follow q's dtype."""
    from longctx_patch.kernels.muse import MuseOptions, muse_attention

    q, k, v = qkv(1, 4, 2, 300, 32, seed=11)
    kw = dict(scale=32**-0.5, options=MuseOptions(block_size=128, k_clusters=8, topk_blocks=1, peak_blocks=1,
                                                  far_field="cells"))
    ref = muse_attention(q, k, v, backend="torch", **kw)
    got = muse_attention(q, k, v.bfloat16(), backend="triton", **kw)
    assert got.dtype == torch.float32 and rel(got, ref) < 1e-2
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = muse_attention(qg, kg, vg.bfloat16(), backend="triton", **kw)
    assert out.dtype == torch.bfloat16 and rel(out, ref) < 1e-2
    out.float().pow(2).sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 and t.grad.abs().sum() > 0 for t in (qg, kg, vg))


def test_patched_model_with_cells_far_field():
    import longctx_patch as lp
    from longctx_patch.methods import get_method

    from conftest import tiny_model

    with pytest.raises(ConfigError, match="far_field"):
        get_method("muse").parse_config({"far_field": "cells", "dipole": "true"})
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 600), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits.clone()
    cfg = dict(far_field="cells", block_size=128, k_clusters=8, topk_blocks=0, peak_blocks=0, min_seq_len=0)
    out = {}
    for backend in ("torch", "triton"):
        for peak in (0, 1):  # one peak block: of the far blocks 1 and 2 of the last query block, one is exact
            lp.patch(model, "muse", backend=backend, **dict(cfg, peak_blocks=peak))
            with torch.no_grad():
                out[backend, peak] = model(ids).logits
            lp.unpatch(model)
    lp.patch(model, "muse", **dict(cfg, topk_blocks=99))
    with torch.no_grad():
        exact = model(ids).logits
        gen = model.generate(ids[:, :300], max_new_tokens=4, do_sample=False)
    lp.unpatch(model)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(after, before) and gen.shape == (1, 304)
    assert not torch.allclose(out["torch", 0], before, atol=1e-4)  # the far field really ran
    assert not torch.allclose(out["torch", 1], out["torch", 0], atol=1e-4)  # and the peak block changed it
    for peak in (0, 1):
        torch.testing.assert_close(out["triton", peak], out["torch", peak], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(exact, before, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("far_field,extra", [("cells", {}), ("tilted-cells", dict(q_clusters=4, sink_blocks=0))])
def test_training_step_through_cells_matches_between_backends(far_field, extra):
    """A next-token training step through a patched model: the Triton backward gives the reference's gradients
    (tilted-cells: 5 blocks without a sink, so that the last ones have far cells)."""
    import longctx_patch as lp

    from conftest import tiny_model

    ids = torch.randint(3, 128, (2, 300 if far_field == "cells" else 520), generator=torch.Generator().manual_seed(1))
    grads = {}
    for backend in ("torch", "triton"):
        model = tiny_model().train()
        lp.patch(model, "muse", [1] if extra else None, far_field=far_field, block_size=128, k_clusters=8,
                 topk_blocks=1, min_seq_len=0, backend=backend, **extra)  # tilted-cells: one layer (interpreter time)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["torch"].keys() == grads["triton"].keys() and any("q_proj" in n for n in grads["torch"])
    for n, g in grads["torch"].items():
        torch.testing.assert_close(grads["triton"][n], g, atol=1e-5, rtol=1e-3, msg=n)


@pytest.mark.slow
def test_triton_matches_reference_on_smollm2_qkv(smollm2):
    """Real post-rotary Q/K/V of SmolLM2 layer 5 (9 query / 3 kv heads, D=64), 389 tokens; fp32 and bf16."""
    from longctx_patch.evals.approx import capture

    model, tok = smollm2
    text = "The history of the river valley begins with farmers who planted barley along its banks. " * 30
    q0, k0, v0, _ = capture(model, tok(text, return_tensors="pt").input_ids[:, :389], layers=[5])[5]
    for dtype, tol in [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)]:
        q, k, v = (t.to(dtype) for t in (q0, k0, v0))
        plan = make_cells_plan(q, k, scale=0.125, block_size=128, k_clusters=16, topk_blocks=1)
        assert plan.retrieved.any()
        o = cells_triton(q, k, v, plan, scale=0.125)
        r = cells_reference(q.float(), k.float(), v.float(), plan, scale=0.125)
        assert rel(o, r) < tol
