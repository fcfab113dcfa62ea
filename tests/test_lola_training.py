"""LoLA's training path (sparse sets chosen without gradients, then one differentiable pass) against the
differentiable chunk loop: same outputs and gradients, on random inputs and through a patched model."""

import pytest
import torch

import longctx_patch as lp
from longctx_patch.kernels.lola import reference as ref
from longctx_patch.kernels.lola import LolaRun, LolaState, StateSizes, lola_process
from longctx_patch.kernels.lola.training import PrefillSets, SetsSpec, lola_attention_sets, sparse_positions
from longctx_patch.patch_state import patched_modules

from conftest import tiny_model


def _inputs(B, Hq, Hkv, S, D, F, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g).requires_grad_()
    k = torch.randn(B, Hkv, S, D, generator=g).requires_grad_()
    v = torch.randn(B, Hkv, S, D, generator=g).requires_grad_()
    Wq = (torch.randn(Hq, D, F, generator=g) * D ** -0.25).requires_grad_()
    Wk = (torch.randn(Hq, D, F, generator=g) * D ** -0.25).requires_grad_()
    gw = torch.randn(Hq, generator=g).requires_grad_()
    return q, k, v, Wq, Wk, gw


@pytest.mark.parametrize("sparse_heads,S,block", [("kv", 203, 48), ("query", 203, 1024), ("kv", 64, 16)])
def test_sets_path_equals_the_chunk_loop(sparse_heads, S, block):
    """Odd length (203: a partial last chunk), GQA (6 query / 2 kv heads), left padding in row 1, a sparse cache
    per kv head or per query head, query blocks of several chunks or one."""
    B, Hq, Hkv, D, F = 2, 6, 2, 16, 8
    W, C, lam = 12, 16, 5
    Hs = Hkv if sparse_heads == "kv" else Hq
    q, k, v, Wq, Wk, gw = _inputs(B, Hq, Hkv, S, D, F)
    km = torch.ones(B, S, dtype=torch.bool)
    # a whole chunk of padding: both paths on one eviction grid (lola_process gives a row padded by a partial
    # chunk its own grid; the method splits the sets path by phase group: tests/test_lola_padding.py)
    km[1, :16] = False
    weights = torch.linspace(-1, 1, D)

    def run(sets_path):
        fq = ref.hedgehog_feature_map(q, Wq)
        g = torch.sigmoid(gw)
        lf = 1 - g
        phi_k = lambda x: ref.hedgehog_feature_map(x, Wk)  # noqa: E731
        if sets_path:
            fk = phi_k(k)
            sets = sparse_positions(fk.detach(), v.detach(), km, window=W, chunk=C, lam=lam, sparse_heads=Hs)
            o = lola_attention_sets(q, k, v, fq, fk, g, lf, PrefillSets(sets, km),
                                    SetsSpec(window=W, chunk=C, scale=D ** -0.5, block=block))
        else:
            st = LolaState.empty(StateSizes(B, Hq, Hkv, D, 2 * F, lam, sparse_heads=Hs), torch.float32, "cpu",
                                 capacity=W + C, inplace=False)
            run = LolaRun(phi_k=phi_k, window=W, chunk=C, lam=lam, scale=D ** -0.5, backend="torch")
            o = lola_process(st, q, k, v, fq, g, lf, run, key_mask_new=km)
        o = o * km[:, :, None, None]
        return o.detach(), torch.autograd.grad((o * weights).sum(), [q, k, v, Wq, Wk, gw])

    want, gwant = run(False)
    got, ggot = run(True)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    for a, b in zip(ggot, gwant):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=5e-6 * float(b.abs().max()), rtol=1e-4)


def test_sparse_positions_keep_the_highest_recall_errors():
    """Every set holds lam distinct earlier positions (padding never), empty until the first eviction."""
    B, Hq, Hkv, S, D, F = 2, 4, 2, 150, 8, 4
    W, C, lam = 8, 16, 6
    q, k, v, Wq, Wk, gw = _inputs(B, Hq, Hkv, S, D, F, seed=3)
    km = torch.ones(B, S, dtype=torch.bool)
    km[0, :20] = False
    fk = ref.hedgehog_feature_map(k, Wk)
    sets = sparse_positions(fk, v, km, window=W, chunk=C, lam=lam, sparse_heads=Hkv)
    assert sets.shape == (-(-S // C), B, Hkv, lam)
    assert (sets[0] == -1).all()
    for c in range(1, sets.shape[0]):
        full = sets[c][sets[c] >= 0]
        assert (full < c * C - W).all()  # evicted keys only: older than the window of the chunk's first query
        assert km[0, sets[c][0][sets[c][0] >= 0]].all()
        for b in range(B):
            for h in range(Hkv):
                row = sets[c, b, h]
                row = row[row >= 0]
                assert len(set(row.tolist())) == len(row)
    assert (sets[-1] >= 0).all()  # by the end every slot is taken


@pytest.mark.parametrize("sparse_heads", ["kv", "query"])
def test_patched_model_trains_through_sets_like_the_chunk_loop(sparse_heads):
    """Through a patched model with a left-padded batch: the loss and the maps' gradients of the sets path equal
    those of the chunk loop."""
    kw = dict(window=5, feature_dim=8, chunk=4, backend="torch", sparse_cache=3, sparse_heads=sparse_heads)
    x = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[1, :6] = 0
    res = {}
    for sets_path in (False, True):
        model = tiny_model("llama")
        lp.patch(model, "lola", **kw)
        for m in patched_modules(model).values():
            m.train_with_sets = sets_path
        labels = x.masked_fill(mask == 0, -100)
        out = model(x, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        attn = model.model.layers[1].self_attn
        res[sets_path] = (out.loss.detach(), attn.feature_map_q.mlp.layer.grad, attn.feature_map_k.mlp.layer.grad,
                          attn.window_factors.grad, model.model.layers[0].self_attn.q_proj.weight.grad)
    for a, b in zip(res[True], res[False]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_sparse_positions_equal_the_prefill_eviction_kernels():
    """The positions chosen by `sparse_positions` are the slots of the two-pass prefill's eviction kernels
    (PrefillEvictions.SPIDX, Triton through the interpreter), chunk by chunk, as sets."""
    from longctx_patch.kernels.lola import triton_kernels as tk

    B, Hq, Hkv, S, D, F = 2, 4, 2, 96, 16, 8
    W, C, lam = 16, 32, 12
    q, k, v, Wq, Wk, gw = _inputs(B, Hq, Hkv, S, D, F, seed=7)
    k, v = k.detach(), v.detach()
    fk = ref.hedgehog_feature_map(k, Wk.detach())
    km = torch.ones(B, S, dtype=torch.bool)
    km[0, :5] = False
    ev = tk.PrefillEvictions(fk, v, km, tk.EvictionPlan(window=W, chunk=C, lam=lam, sparse_heads=Hkv, n_ev=S // C))
    ev.run()
    sets = sparse_positions(fk, v, km, window=W, chunk=C, lam=lam, sparse_heads=Hkv, kernels=False)
    assert (sets[1] < 0).any() and (sets[-1] >= 0).all()
    for c in range(sets.shape[0]):
        assert torch.equal(sets[c].sort(-1).values, ev.SPIDX[c].long().sort(-1).values)


@pytest.mark.parametrize("B,Hq,Hkv,Hs,S,W,C,lam,dtype,pad", [
    (1, 7, 1, 1, 301, 32, 16, 16, torch.float32, 0),    # 7 query heads a kv head, a partial last chunk
    (2, 4, 2, 4, 203, 16, 32, 9, torch.bfloat16, 40),   # a sparse cache per query head, bf16, left padding
    (2, 4, 2, 2, 40, 16, 16, 200, torch.float32, 16),   # more slots than candidates; two chunks and a half
    (1, 2, 2, 2, 12, 16, 16, 4, torch.float32, 0),      # shorter than a chunk: no eviction
])
def test_sparse_positions_through_the_eviction_kernels_equal_the_loop(B, Hq, Hkv, Hs, S, W, C, lam, dtype, pad):
    """`sparse_positions` on the prefill's eviction kernels (its default where they run) chooses the loop's sets,
    chunk by chunk; where they do not run (window or chunk not a multiple of 16, no sparse cache) the loop runs."""
    from longctx_patch.kernels.lola.training import evictions_kernels_run

    q, k, v, Wq, Wk, gw = _inputs(B, Hq, Hkv, S, 16, 8, seed=S)
    fk = ref.hedgehog_feature_map(k.detach(), Wk.detach()).to(dtype)
    v = v.detach().to(dtype)
    km = None
    if pad:
        km = torch.ones(B, S, dtype=torch.bool)
        km[-1, :pad] = False
    assert evictions_kernels_run(fk, v, window=W, chunk=C, lam=lam)
    got = sparse_positions(fk, v, km, window=W, chunk=C, lam=lam, sparse_heads=Hs)
    want = sparse_positions(fk, v, km, window=W, chunk=C, lam=lam, sparse_heads=Hs, kernels=False)
    assert got.shape == want.shape == (-(-S // C), B, Hs, lam) and got.dtype == torch.long
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert not evictions_kernels_run(fk, v, window=12, chunk=16, lam=lam)
    assert not evictions_kernels_run(fk, v, window=W, chunk=C, lam=0)


def test_patched_model_trains_through_the_kernels_sets_as_through_the_loops(monkeypatch):
    """A patched model on the 16-token grid (backend auto: the eviction kernels choose its training sets): the loss
    and the gradients equal those with the sets from the PyTorch loop (backend torch keeps the loop)."""
    from longctx_patch.kernels.lola import training

    calls = []
    real = training._sparse_positions_kernels
    monkeypatch.setattr(training, "_sparse_positions_kernels", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kw = dict(window=16, feature_dim=8, chunk=16, backend="auto", sparse_cache=4)
    x = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(x)
    mask[1, :16] = 0
    res = {}
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(training, "evictions_kernels_run", lambda *a, **kw: False)
        model = tiny_model("llama")
        lp.patch(model, "lola", **kw)
        for m in patched_modules(model).values():
            m.train_with_sets = True
        out = model(x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100), use_cache=False)
        out.loss.backward()
        attn = model.model.layers[1].self_attn
        res[kernels] = (out.loss.detach(), attn.feature_map_k.mlp.layer.grad, attn.window_factors.grad,
                        model.model.layers[0].self_attn.q_proj.weight.grad)
    n = len(calls)
    assert n >= 2  # the set choices of the patched layers, with the kernels only
    for a, b in zip(res[True], res[False]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    model = tiny_model("llama")
    lp.patch(model, "lola", **{**kw, "backend": "torch"})
    for m in patched_modules(model).values():
        m.train_with_sets = True
    model(x, attention_mask=mask, labels=x, use_cache=False).loss.backward()
    assert len(calls) == n


@pytest.mark.parametrize("Hq,Hkv,S,W,C,lam,block,combine,dtype", [
    (7, 1, 301, 40, 16, 9, 64, "unshifted", torch.float32),    # 7 query heads a kv head, window past a block
    (6, 2, 203, 12, 16, 5, 48, "shifted", torch.float32),      # several blocks, a partial last chunk
    (4, 2, 130, 7, 8, 200, 32, "unshifted", torch.float32),    # every evicted key kept: no row has a linear key
    (4, 4, 97, 16, 8, 6, 1024, "shifted", torch.bfloat16),     # one block, bf16 inputs
])
def test_linear_time_blocks_equal_the_dense_pass(Hq, Hkv, S, W, C, lam, block, combine, dtype):
    """`lola_attention_sets` (band, prefix state and gathered sets a block) against `dense=True` (one masked pass
    over every earlier key): outputs and gradients of q, k, v and the key map, left padding in one row."""
    B, D, F = 2, 16, 8
    g0 = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, S, D, generator=g0)
    k = torch.randn(B, Hkv, S, D, generator=g0)
    if lam >= S:  # every exact score far below 0 (Qwen's biased q/k): where the linear sums less the sets leave
        q, k = q - 6, k + 6  # a rounding residue instead of 0, the unshifted combination would underflow (`_finish`)
    q, k = q.to(dtype).requires_grad_(), k.to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, S, D, generator=g0).to(dtype).requires_grad_()
    Wq = torch.randn(Hq, D, F, generator=g0) * D ** -0.25
    Wk = (torch.randn(Hq, D, F, generator=g0) * D ** -0.25).requires_grad_()
    km = torch.ones(B, S, dtype=torch.bool)
    km[1, :2 * C] = False
    fq = ref.hedgehog_feature_map(q.float(), Wq)
    fk = ref.hedgehog_feature_map(ref.expand_kv(k.float(), Hq), Wk)
    g = torch.sigmoid(torch.randn(Hq, generator=g0))
    sets = sparse_positions(fk.detach(), v.detach().float(), km, window=W, chunk=C, lam=lam, sparse_heads=Hkv)
    if lam >= S:
        assert int((sets[-1] >= 0).sum(-1).min()) > 0  # the sets hold keys, and every evicted key is in them
    weights = torch.linspace(-1, 1, D)
    got = []
    for dense in (False, True):
        spec = SetsSpec(window=W, chunk=C, scale=D ** -0.5, combine=combine, block=block, dense=dense)
        o = lola_attention_sets(q, k, v, fq, fk, g, 1 - g, PrefillSets(sets, km), spec).float() * km[:, :, None, None]
        got.append((o.detach(), torch.autograd.grad((o * weights).sum(), [q, k, v, Wk], retain_graph=True)))
    (o, grads), (want, gwant) = got
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(o, want, atol=tol, rtol=tol)
    for a, b in zip(grads, gwant):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a.float(), b.float(), atol=5e-6 * float(b.abs().max()) if dtype == torch.float32
                                   else 2e-2 * float(b.abs().max()), rtol=1e-4 if dtype == torch.float32 else 2e-2)
