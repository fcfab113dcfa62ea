"""MoBA with block gating (kernels/moba, gating="block"): the gate against a naive per-block loop, the attention
against a naive per-query loop (float64), the block-list Triton kernels (MuSe's cells kernels without a far field,
run by the interpreter) against the reference, forward and gradients, the decode rule (a step's gate is the one a
prefill ending at that token gives it) and the patched model (padding, cache size, chunked prefill)."""

from __future__ import annotations

import pytest
import torch

import longctx_patch as lp
from longctx_patch.errors import ConfigError
from longctx_patch.kernels.moba import moba_attention, moba_reference
from longctx_patch.kernels.moba.reference import block_gate, block_means, key_positions, query_positions
from longctx_patch.kernels.softmax import softmax_attention

from conftest import assert_padded_batch_exact, tiny_model


def qkv(B, Hq, Hkv, S, D, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, h, S, D, generator=g).to(dtype).requires_grad_(grad)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


def left_mask(B, S, pads):
    km = torch.ones(B, S, dtype=torch.bool)
    for r, p in enumerate(pads):
        km[r, :p] = False
    return km


def naive_blocks(q, k, km, bs, top_k, min_seq_len=0):
    """{(b, h, query block): sorted earlier blocks}: a loop over the real tokens of each row; the gate of a query
    block is the mean of its real queries (all of them: a whole sequence)."""
    B, Hq, S, D = q.shape
    G = Hq // k.shape[1]
    out = {}
    for b in range(B):
        R = [j for j in range(S) if km[b, j]]
        nb = -(-len(R) // bs)
        for h in range(Hq):
            for n in range(nb):
                if n <= top_k - 1 or n * bs < min_seq_len:
                    out[b, h, n] = list(range(n))
                    continue
                qbar = q[b, h, R[n * bs:(n + 1) * bs]].mean(0)
                scores = [float(qbar @ k[b, h // G, R[m * bs:(m + 1) * bs]].mean(0)) for m in range(n)]
                out[b, h, n] = sorted(sorted(range(n), key=lambda m: -scores[m])[:top_k - 1])
    return out


def naive_block_moba(q, k, v, *, scale, bs, top_k, km, min_seq_len=0):
    """Block-gated MoBA one query at a time over a whole sequence; a padded query returns its own value."""
    B, Hq, S, D = q.shape
    G = Hq // k.shape[1]
    sel = naive_blocks(q, k, km, bs, top_k, min_seq_len)
    out = torch.zeros(B, S, Hq, D, dtype=q.dtype)
    for b in range(B):
        R = [j for j in range(S) if km[b, j]]
        for h in range(Hq):
            kh, vh = k[b, h // G], v[b, h // G]
            for t in range(S):
                if not km[b, t]:
                    out[b, t, h] = vh[t]
                    continue
                p = R.index(t)
                keys = [R[j] for m in sel[b, h, p // bs] for j in range(m * bs, (m + 1) * bs)] \
                    + R[(p // bs) * bs:p + 1]
                w = torch.softmax((kh[keys] @ q[b, h, t]) * scale, 0)
                out[b, t, h] = w @ vh[keys]
    return out


def test_block_gate_equals_a_naive_loop():
    bs, top_k = 8, 3
    q, k, _ = qkv(2, 6, 2, 61, 8, seed=1)
    km = left_mask(2, 61, [0, 11])
    kpos, valid = key_positions(km, 2, 61, q.device)
    qpos, qreal, _ = query_positions(kpos, valid, 61, None)
    sel = block_gate(q, block_means(k, kpos, valid, bs), qpos, qreal, block_size=bs, top_k=top_k, min_seq_len=20)
    want = naive_blocks(q, k, km, bs, top_k, min_seq_len=20)
    for (b, h, n), blocks in want.items():
        assert torch.nonzero(sel[b, h, n]).flatten().tolist() == blocks, (b, h, n)


@pytest.mark.parametrize("S,bs,top_k,pads", [(53, 8, 2, [0]), (61, 8, 3, [0, 5, 19]), (33, 5, 4, [2])])
def test_reference_equals_the_naive_loop_and_differs_from_exact(S, bs, top_k, pads):
    q, k, v = qkv(len(pads), 14, 2, S, 8, seed=S + bs)  # GQA 14 / 2, lengths not multiples of the block
    km = left_mask(len(pads), S, pads)
    o = moba_attention(q, k, v, scale=0.35, block_size=bs, top_k=top_k, key_mask=km, gating="block")
    torch.testing.assert_close(o, naive_block_moba(q, k, v, scale=0.35, bs=bs, top_k=top_k, km=km),
                               atol=1e-12, rtol=1e-10)
    assert (o - softmax_attention(q, k, v, scale=0.35, key_mask=km)).abs().max() > 1e-3
    tok = moba_attention(q, k, v, scale=0.35, block_size=bs, top_k=top_k, key_mask=km, gating="token")
    assert (o - tok).abs().max() > 1e-3  # the two gatings choose differently


def test_no_later_key_changes_an_output():
    """Block gating reads later queries of the own block (its mean query), never a later key or value."""
    q, k, v = qkv(1, 4, 2, 50, 8, seed=4)
    o = moba_attention(q, k, v, scale=0.35, block_size=8, top_k=2)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:] = 10 * torch.randn_like(k2[:, :, 30:])
    v2[:, :, 30:] = 10 * torch.randn_like(v2[:, :, 30:])
    o2 = moba_attention(q, k2, v2, scale=0.35, block_size=8, top_k=2)
    assert torch.equal(o[:, :30], o2[:, :30])


def test_a_decode_step_is_gated_as_a_prefill_ending_at_it():
    """A prefill of P tokens, then one token at a time over a preallocated buffer (as MobaLayer: `query_sum` carried
    in place): every step equals the last row of a one-call prefill ending at that token, with left padding, and
    across block boundaries; a continued prefill (several queries after cached keys) equals the one-call rows."""
    bs, P, S, cap = 8, 21, 45, 64
    pads = [0, 7]
    q, k, v = qkv(2, 6, 2, S, 8, seed=9)
    km = left_mask(2, S, pads)
    kw = dict(scale=0.35, block_size=bs, top_k=2, gating="block")
    qs = torch.zeros(2, 6, 8, dtype=torch.float64)
    kb, vb = torch.zeros(2, 2, cap, 8, dtype=q.dtype), torch.zeros(2, 2, cap, 8, dtype=q.dtype)
    mb = torch.zeros(2, cap, dtype=torch.bool)
    kb[:, :, :P], vb[:, :, :P], mb[:, :P] = k[:, :, :P], v[:, :, :P], km[:, :P]
    moba_attention(q[:, :, :P], k[:, :, :P], v[:, :, :P], key_mask=km[:, :P], query_sum=qs, **kw)
    for t in range(P, S):
        kb[:, :, t], vb[:, :, t], mb[:, t] = k[:, :, t], v[:, :, t], True
        step = moba_attention(q[:, :, t:t + 1], kb, vb, key_mask=mb, q_offset=cap, query_sum=qs, **kw)
        alone = moba_reference(q[:, :, :t + 1], k[:, :, :t + 1], v[:, :, :t + 1], key_mask=km[:, :t + 1], **kw)
        torch.testing.assert_close(step, alone[:, -1:], atol=1e-12, rtol=1e-10)
    # the gate really is the block's mean query: token gating gives another step somewhere
    tok = moba_reference(q, k, v, key_mask=km, **dict(kw, gating="token"))
    blk = moba_reference(q, k, v, key_mask=km, **kw)
    assert (tok[:, P:] - blk[:, P:]).abs().max() > 1e-3
    # a continued prefill whose chunks end at block boundaries equals one call (row 0: no padding)
    qs2 = torch.zeros(1, 6, 8, dtype=torch.float64)
    first = moba_attention(q[:1, :, :24], k[:1, :, :24], v[:1, :, :24], query_sum=qs2, **kw)
    rest = moba_attention(q[:1, :, 24:], k[:1], v[:1], query_sum=qs2, **kw)
    one = moba_attention(q[:1], k[:1], v[:1], **kw)
    torch.testing.assert_close(torch.cat([first, rest], 1), one, atol=1e-12, rtol=1e-10)


# the Triton path (interpreter on the CPU): GQA 7 / 1 and 4 / 2, odd lengths, a left-padded row, min_seq_len
TRITON_CASES = [
    dict(B=2, Hq=7, Hkv=1, S=300, D=16, top_k=2, pads=[0, 37], min_seq_len=0),
    dict(B=1, Hq=4, Hkv=2, S=389, D=32, top_k=3, pads=[0], min_seq_len=200),
]


def _tol(dtype):
    return dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(TRITON_CASES)))
def test_triton_forward_and_gradients_match_the_reference(case, dtype):
    c = TRITON_CASES[case]
    q, k, v = qkv(c["B"], c["Hq"], c["Hkv"], c["S"], c["D"], dtype=dtype, seed=case, grad=True)
    km = left_mask(c["B"], c["S"], c["pads"]) if any(c["pads"]) else None
    kw = dict(scale=c["D"] ** -0.5, block_size=128, top_k=c["top_k"], key_mask=km, min_seq_len=c["min_seq_len"],
              gating="block")
    sums = [torch.zeros(c["B"], c["Hq"], c["D"]) for _ in range(2)]  # what a prefill leaves for the decode steps
    o = moba_attention(q, k, v, backend="triton", query_sum=sums[0], **kw)
    ref = moba_reference(q, k, v, query_sum=sums[1], **kw)
    assert o.dtype == dtype and o.shape == (c["B"], c["S"], c["Hq"], c["D"])
    torch.testing.assert_close(o.float(), ref.float(), **_tol(dtype))
    torch.testing.assert_close(sums[0], sums[1], atol=1e-4, rtol=1e-5)
    assert sums[0].abs().min() > 0  # every row ends inside a block (300 - 37, 389 tokens)
    assert (ref.float() - softmax_attention(q, k, v, scale=kw["scale"], key_mask=km).float()).abs().max() > 0.05
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = torch.autograd.grad(o, (q, k, v), do)
    want = torch.autograd.grad(ref, (q, k, v), do)
    for name, a, b in zip("qkv", got, want):
        scale = b.float().abs().max()
        err = (a.float() - b.float()).abs().max() / scale
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (name, float(err))


def test_triton_path_errors_say_what_to_change():
    q, k, v = qkv(1, 2, 1, 300, 16, dtype=torch.float32)
    with pytest.raises(ConfigError, match="gating='block'"):
        moba_attention(q, k, v, scale=0.25, block_size=128, top_k=2, gating="token", backend="triton")
    with pytest.raises(ConfigError, match="multiple of 128"):
        moba_attention(q, k, v, scale=0.25, block_size=64, top_k=2, backend="triton")
    with pytest.raises(ConfigError, match="gating must be one of"):
        moba_attention(q, k, v, scale=0.25, gating="query")


def test_patched_model_block_gating_padding_cache_and_chunks(one_thread):
    model = tiny_model("llama")
    lp.patch(model, "moba", block_size=8, top_k=2)  # gating="block" by default
    assert_padded_batch_exact(model, [56, 50, 43, 24], max_new_tokens=6, atol=1e-4)
    mods = [model.model.layers[i].self_attn for i in sorted(lp.patched_layers(model))]
    for S in (40, 100):
        with torch.no_grad():
            cache = model(torch.randint(3, 128, (1, S)), use_cache=True).past_key_values
        assert cache.nbytes() == sum(m.state_bytes(S, batch=1, dtype=torch.float32) for m in mods)
        with pytest.raises(NotImplementedError, match="gating='token'"):
            cache.crop(-1)


def test_patched_model_triton_backend_equals_torch():
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    out = {}
    for be in ("torch", "triton"):
        model = tiny_model("llama")
        lp.patch(model, "moba", block_size=128, top_k=2, backend=be)
        with torch.no_grad():
            out[be] = model(ids).logits
    torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)
    exact = tiny_model("llama")
    with torch.no_grad():
        assert (exact(ids).logits - out["torch"]).abs().max() > 1e-4
