"""The Triton backward of the whole-sequence LoLCATs hybrid (`ops.HybridAttentionFn`: `hybrid_fwd(stats=True)` +
`triton_hybrid_bwd.hybrid_bwd`) against autograd through `reference.hybrid_attention_quadratic`
(TRITON_INTERPRET=1 on the CPU, small shapes; blocks and state chunks small enough for several state slots)."""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.kernels.lola import ops  # noqa: E402
from longctx_patch.kernels.lola import reference as ref  # noqa: E402
from longctx_patch.kernels.lola.reference import HybridSpec  # noqa: E402
from longctx_patch.kernels.lola.tuning import LolaTuning  # noqa: E402

pytest.importorskip("longctx_patch.kernels.lola.triton_kernels")

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
NAMES = ("q", "k", "v", "fq", "fk", "g", "lf")


def _inputs(B, Hq, Hkv, S, D=16, F=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=gen)
    k = torch.randn(B, Hkv, S, D, generator=gen)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    fq = ref.hedgehog_feature_map(q, torch.randn(Hq, D, F, generator=gen) * D ** -0.25)
    fk = ref.hedgehog_feature_map(k, torch.randn(Hq, D, F, generator=gen) * D ** -0.25)
    g = torch.sigmoid(torch.randn(Hq, generator=gen))
    lf = torch.rand(Hq, generator=gen) + 0.5
    do = torch.randn(B, S, Hq, D, generator=gen).to(dtype).float()  # the output's gradient, as q.dtype holds it
    xs = [x.to(DEV, dtype) for x in (q, k, v, fq, fk)] + [g.to(DEV), lf.to(DEV)]
    return [x.requires_grad_() for x in xs], do.to(DEV)


def _left_pad(B, S, pads):
    m = torch.ones(B, S, dtype=torch.bool)
    for b, p in enumerate(pads):
        m[b, :p] = False
    return m.to(DEV)


def _grads(fn, xs, do):
    for x in xs:
        x.grad = None
    o = fn(*xs)
    (o.float() * do).sum().backward()
    return o.detach(), [x.grad.detach().float().clone() for x in xs]


def _tiles(block: int) -> LolaTuning:
    """The training pass's tiles, forward and backward: `block` queries and keys."""
    return LolaTuning(train_block_m=block, train_block_n=block)


def _reference(xs, do, *, window, scale, key_mask):
    def fn(*a):  # fp32 maths on the same (rounded) input values
        a = [x.float() for x in a]
        return ref.hybrid_attention_quadratic(*a, HybridSpec(window=window, scale=scale),
                                              key_mask=key_mask).transpose(1, 2)

    return _grads(fn, xs, do)


# (dtype, B, Hkv, G, S, window, state_chunk, block, pads): several state slots at every S; block 64 = the
# production tiles (a query block then straddles state chunks of 64)
CASES = [
    (torch.float32, 2, 2, 1, 37, 16, 16, 16, (0, 9)),
    (torch.float32, 2, 1, 3, 130, 16, 32, 16, (5, 0)),
    (torch.float32, 1, 1, 7, 300, 64, 64, 64, None),
    (torch.float32, 2, 1, 3, 130, 64, 64, 64, (0, 70)),
    (torch.float32, 1, 1, 3, 70, 21, 32, 16, (4,)),
    (torch.bfloat16, 2, 1, 3, 130, 16, 32, 16, (0, 11)),
    (torch.bfloat16, 1, 2, 1, 300, 64, 64, 64, (3,)),
]


@pytest.mark.parametrize("dtype,B,Hkv,G,S,window,cs,blk,pads", CASES,
                         ids=[f"{str(c[0])[6:]}-S{c[4]}-w{c[5]}-G{c[3]}" for c in CASES])
def test_hybrid_backward_matches_autograd_through_reference(dtype, B, Hkv, G, S, window, cs, blk, pads):
    xs, do = _inputs(B, G * Hkv, Hkv, S, dtype=dtype, seed=S + G)
    km = _left_pad(B, S, pads) if pads is not None else None
    scale = 0.3

    def tri(*a):
        spec = HybridSpec(window=window, scale=scale, state_chunk=cs, tuning=_tiles(blk))
        return ops.hybrid_attention_triton(*a, spec, key_mask=km)

    o, got = _grads(tri, xs, do)
    o_ref, want = _reference(xs, do, window=window, scale=scale, key_mask=km)
    assert o.dtype == dtype and o.shape == (B, S, G * Hkv, 16)
    for name, a, b in zip(NAMES, got, want):
        assert torch.isfinite(a).all(), name
        assert a.abs().sum() > 0, name
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, n=name: f"d{n}: {m}")
        else:  # bf16 operands of the products (p, ds, da) and bf16 gradients: a relative error of the whole tensor
            err = (a - b).norm() / b.norm()
            assert err < 2e-2, (name, err.item())
    if km is not None:  # padded keys get no gradient
        pad = ~km
        for name, a in zip(("k", "v"), got[1:3]):
            assert (a.permute(0, 2, 1, 3)[pad] == 0).all(), name
        assert (got[4].permute(0, 2, 1, 3)[pad] == 0).all()


def test_hybrid_attention_under_grad_dispatches_to_the_triton_function():
    xs, do = _inputs(2, 4, 2, 45)
    km = _left_pad(2, 45, (0, 6))
    spec = HybridSpec(window=16, scale=0.25, backend="triton")
    o = ops.hybrid_attention(*xs, spec, key_mask=km)
    assert type(o.grad_fn).__name__ == "HybridAttentionFnBackward"
    (o.float() * do).sum().backward()
    got = [x.grad.clone() for x in xs]
    _, want = _reference(xs, do, window=16, scale=0.25, key_mask=km)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, n=name: f"d{n}: {m}")
    # only the window factors trained (an attention transfer): still the Function
    with torch.no_grad():
        frozen = [x.detach() for x in xs[:5]]
    o = ops.hybrid_attention(*frozen, *xs[5:], spec, key_mask=km)
    assert type(o.grad_fn).__name__ == "HybridAttentionFnBackward"
    # no gradient: the inference forward, same values
    with torch.no_grad():
        o_inf = ops.hybrid_attention(*xs, spec, key_mask=km)
    assert o_inf.grad_fn is None
    torch.testing.assert_close(o_inf, o.detach(), atol=0, rtol=0)
    # torch backend (and auto off CUDA): the PyTorch chunked path
    o = ops.hybrid_attention(*xs, HybridSpec(window=16, scale=0.25, backend="torch"), key_mask=km)
    assert type(o.grad_fn).__name__ != "HybridAttentionFnBackward"


def test_training_settings_from_tune_reach_the_function(monkeypatch):
    """The tuning's train_state_chunk / train_block_m / train_block_n (what benchmarks.ops.bench_hybrid_bwd sweeps) set
    the training pass's state chunk and tiles when the caller names no state_chunk; the gradients stay the reference's."""
    seen = []
    real = ops.hybrid_attention_triton

    def spy(*a, **kw):
        spec = a[7]
        seen.append((spec.state_chunk, spec.tuning.train_block_m, spec.tuning.train_block_n))
        return real(*a, **kw)

    monkeypatch.setattr(ops, "hybrid_attention_triton", spy)
    tuning = LolaTuning(train_state_chunk=64, train_block_m=32, train_block_n=32)
    xs, do = _inputs(1, 2, 1, 150)
    spec = HybridSpec(window=16, scale=0.25, backend="triton", tuning=tuning)
    got = _grads(lambda *a: ops.hybrid_attention(*a, spec), xs, do)[1]
    _, want = _reference(xs, do, window=16, scale=0.25, key_mask=None)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, n=name: f"d{n}: {m}")
    ops.hybrid_attention(*xs, dataclasses.replace(spec, state_chunk=128))  # the caller's wins
    assert seen == [(64, 32, 32), (128, 32, 32)]


def test_backward_takes_the_forwards_keys_with_or_without_their_states():
    """`hybrid_bwd(q, fq, keys, rule, o, do, stats)`: keys without prefix states (H = s = None, what the Function
    passes: recomputed) and keys with the forward's states give the same gradients bit for bit; what the backward does
    not differentiate (a sparse cache, one state for every query, combine "unshifted") is refused, and the forward and
    the reference refuse keys without states."""
    from longctx_patch.kernels.lola import triton_kernels as tk

    (q, k, v, fq, fk, g, lf), do = _inputs(2, 4, 2, 70, seed=3)
    q, k, v, fq, fk, g, lf = (x.detach() for x in (q, k, v, fq, fk, g, lf))
    km = _left_pad(2, 70, (0, 5))
    Hs, Ss = tk.chunk_states(fk, v, 32, key_mask=km)
    rule = ref.HybridRule(9, g, lf, 0.3)
    with_states = ref.HybridKeys(k, v, fk, Hs, Ss, key_mask=km, q_offset=0, state_chunk=32)
    o, stats = tk.hybrid_fwd(q, fq, with_states, rule, block_m=16, block_n=16, stats=True,
                             out=torch.empty(2, 70, 4, 16))
    without = ref.HybridKeys(k, v, fk, None, None, key_mask=km, q_offset=0, state_chunk=32)
    a = tk.hybrid_bwd(q, fq, without, rule, o, do, stats, tuning=_tiles(16))
    b = tk.hybrid_bwd(q, fq, with_states, rule, o, do, stats, tuning=_tiles(16))
    for name, x, y in zip(NAMES, a, b):
        assert torch.equal(x, y), name
    sparse = ref.SparseSet(k[:, :, :3], v[:, :, :3], torch.ones(2, 2, 3, dtype=torch.bool))
    for keys, bad_rule in ((ref.HybridKeys(k, v, fk, None, None, state_chunk=32, sparse=sparse), rule),
                           (ref.HybridKeys(k, v, fk, None, None), rule),
                           (without, ref.HybridRule(9, g, lf, 0.3, "unshifted"))):
        with pytest.raises(AssertionError):
            tk.hybrid_bwd(q, fq, keys, bad_rule, o, do, stats, tuning=_tiles(16))
    with pytest.raises(ValueError, match="reads the linear state"):
        tk.hybrid_fwd(q, fq, without, rule, block_m=16, block_n=16)
    with pytest.raises(ValueError, match="reads the linear state"):
        ref.lola_attention(q, fq, ref.HybridKeys(k, v, fk, None, None), rule)


def test_hybrid_function_composes_with_checkpointing():
    """The trainer's `attention_checkpointing` recomputes the attention in the backward
    (torch.utils.checkpoint, non-reentrant): same gradients."""
    from torch.utils.checkpoint import checkpoint

    xs, do = _inputs(1, 3, 1, 40, seed=4)

    def tri(*a):
        return ops.hybrid_attention_triton(*a, HybridSpec(window=8, scale=0.25, state_chunk=16, tuning=_tiles(16)))

    _, plain = _grads(tri, xs, do)
    _, ckpt = _grads(lambda *a: checkpoint(tri, *a, use_reentrant=False), xs, do)
    for name, a, b in zip(NAMES, ckpt, plain):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


def test_lolcats_model_trains_through_the_triton_function(monkeypatch):
    """A patched model under gradients with backend=auto, the CUDA decision made here on the CPU (the interpreter
    runs the kernels): the layers take the Functions (the hybrid's and the feature maps'), and every trainable
    gradient (feature maps: dW; the projections below them: dx) matches the PyTorch path."""
    import longctx_patch as lp
    from conftest import tiny_model

    real = ops.resolve_backend
    real_fn = ops.hybrid_attention_triton
    calls = []

    def as_on_cuda(backend, *tensors, what):
        return "triton" if backend == "auto" else real(backend, *tensors, what=what)

    def counted(*a, **kw):
        calls.append(1)
        return real_fn(*a, **kw)

    monkeypatch.setattr(ops, "hybrid_attention_triton", counted)
    fmaps = []
    real_fmap = ops.FeatureMapFn.apply
    monkeypatch.setattr(ops.FeatureMapFn, "apply", lambda *a: fmaps.append(1) or real_fmap(*a))

    x = torch.randint(3, 128, (2, 41), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 41, dtype=torch.long)
    mask[1, :6] = 0
    grads = {}
    for name in ("triton", "torch"):
        model = tiny_model("llama")
        lp.patch(model, "lolcats", window=16, feature_dim=8, chunk=16, backend="auto")
        model.train()
        if name == "triton":
            monkeypatch.setattr(ops, "resolve_backend", as_on_cuda)
        else:
            monkeypatch.setattr(ops, "resolve_backend", real)
        model(x, attention_mask=mask, labels=x, use_cache=False).loss.backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(calls) == 3, "every layer takes the Function"  # tiny_model: 3 layers
    assert len(fmaps) == 6, "every layer's q and k maps take FeatureMapFn"
    assert grads["triton"].keys() == grads["torch"].keys()
    for n, want in grads["torch"].items():
        torch.testing.assert_close(grads["triton"][n], want, atol=1e-4, rtol=1e-3, msg=lambda m, n=n: f"{n}: {m}")


def test_hybrid_under_autocast_runs_the_kernels_in_its_dtype(monkeypatch):
    """A trainer's fp32 weights under bf16 autocast hand over fp32 q/k (the rotary's fp32 cos/sin) and bf16 v: the
    Function gets every input in autocast's dtype (fp32 inputs would run fp32 products), gradients in the inputs'."""
    xs, do = _inputs(1, 2, 1, 37)
    xs[2] = xs[2].detach().to(torch.bfloat16).requires_grad_(True)  # v as an autocast linear returns it
    seen = []
    real = ops.hybrid_attention_triton

    def spy(*a, **kw):
        seen.append({t.dtype for t in a[:5]})
        return real(*a, **kw)

    monkeypatch.setattr(ops, "hybrid_attention_triton", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = ops.hybrid_attention(*xs, HybridSpec(window=16, scale=0.25, backend="triton"))
    assert seen == [{torch.bfloat16}] and o.dtype == torch.bfloat16
    (o.float() * do).sum().backward()
    assert xs[0].grad.dtype == torch.float32 and xs[2].grad.dtype == torch.bfloat16
    seen.clear()
    ops.hybrid_attention(*xs, HybridSpec(window=16, scale=0.25, backend="triton"))  # no autocast: q's dtype
    assert seen == [{torch.float32}]
