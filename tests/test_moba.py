"""MoBA (kernels/moba, methods/moba/), token gating: the gating and the attention against a naive per-query loop
(float64, with gradients), exact attention when every block is selected, causality, GQA, odd lengths, padding, the
decode convention, the method's config and CLI entry. Block gating and its Triton kernels: tests/test_moba_block.py.
The model-level contract: tests/test_method_contract.py -k moba (token gating)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import longctx_patch as lp
from longctx_patch.errors import ConfigError
from longctx_patch.kernels.moba import moba_attention, moba_reference
from longctx_patch.kernels.moba.reference import block_means, gate, key_positions, query_positions
from longctx_patch.kernels.softmax import softmax_attention

from conftest import tiny_model


def qkv(B, Hq, Hkv, S, D, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, h, S, D, generator=g).to(dtype).requires_grad_(grad)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


def naive_selection(qv, kh, real, t, bs, top_k, min_seq_len=0):
    """The earlier blocks (sorted) a query `qv` [D] at key index t selects: a loop over the row's real keys."""
    R = [j for j in range(kh.shape[0]) if real[j]]
    p = R.index(t)
    own = p // bs
    if own <= top_k - 1 or p < min_seq_len:
        return list(range(own))
    scores = [float(qv @ kh[R[n * bs:(n + 1) * bs]].mean(0)) for n in range(own)]
    return sorted(sorted(range(own), key=lambda n: -scores[n])[:top_k - 1])


def naive_moba(q, k, v, *, scale, bs, top_k, key_mask=None, min_seq_len=0):
    """MoBA one query at a time (the queries are the last Sq keys): union of the selected earlier blocks and the own
    block up to the query, one softmax. Differentiable (indexing and a softmax per query)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out = torch.zeros(B, Sq, Hq, D, dtype=q.dtype)
    rows = []
    for b in range(B):
        real = [True] * Sk if key_mask is None else key_mask[b].tolist()
        R = [j for j in range(Sk) if real[j]]
        for h in range(Hq):
            kh, vh = k[b, h // G], v[b, h // G]
            for i in range(Sq):
                t = Sk - Sq + i
                if not real[t]:
                    rows.append(((b, i, h), vh[t]))
                    continue
                p = R.index(t)
                sel = naive_selection(q[b, h, i].detach(), kh.detach(), real, t, bs, top_k, min_seq_len)
                keys = sorted([R[j] for n in sel for j in range(n * bs, (n + 1) * bs)]
                              + R[(p // bs) * bs:p + 1])
                w = torch.softmax((kh[keys] @ q[b, h, i]) * scale, 0)
                rows.append(((b, i, h), w @ vh[keys]))
    out = out.index_put((torch.tensor([r[0][0] for r in rows]), torch.tensor([r[0][1] for r in rows]),
                         torch.tensor([r[0][2] for r in rows])), torch.stack([r[1] for r in rows]))
    return out


def test_gate_equals_a_naive_loop():
    bs, top_k = 8, 3
    q, k, _ = qkv(2, 6, 2, 61, 8, seed=1)
    km = torch.ones(2, 61, dtype=torch.bool)
    km[1, :11] = False  # a left-padded row
    kpos, valid = key_positions(km, 2, 61, q.device)
    qpos, qreal, qidx = query_positions(kpos, valid, 61, None)
    sel = gate(q, block_means(k, kpos, valid, bs), qpos, block_size=bs, top_k=top_k)
    for b in range(2):
        for h in range(6):
            for i in range(61):
                if not km[b, i]:
                    continue
                want = naive_selection(q[b, h, i], k[b, h // 3], km[b].tolist(), i, bs, top_k)
                got = torch.nonzero(sel[b, h, i]).flatten().tolist()
                assert got == want, (b, h, i, got, want)


@pytest.mark.parametrize("S", [16, 41, 77])
def test_top_k_covering_every_block_is_exact(S):
    q, k, v = qkv(2, 4, 2, S, 16, dtype=torch.float32, seed=S)
    ref = softmax_attention(q, k, v, scale=0.25)
    nb = -(-S // 8)
    for o in (moba_reference(q, k, v, scale=0.25, block_size=8, gating="token", top_k=nb),
              moba_attention(q, k, v, scale=0.25, block_size=8, gating="token", top_k=nb + 3),
              moba_reference(q, k, v, scale=0.25, block_size=8, gating="token", top_k=2, min_seq_len=S)):
        assert o.shape == (2, S, 4, 16)
        torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("S,bs,top_k", [(53, 8, 2), (53, 8, 3), (70, 16, 2), (33, 5, 4)])
def test_small_top_k_differs_from_exact_and_equals_the_naive_loop(S, bs, top_k):
    q, k, v = qkv(1, 14, 2, S, 8, seed=S + bs)  # GQA 14 / 2, lengths not multiples of the block
    o = moba_attention(q, k, v, scale=0.35, block_size=bs, gating="token", top_k=top_k)
    want = naive_moba(q, k, v, scale=0.35, bs=bs, top_k=top_k)
    torch.testing.assert_close(o, want, atol=1e-12, rtol=1e-10)
    assert (o - softmax_attention(q, k, v, scale=0.35)).abs().max() > 1e-3


def test_min_seq_len_keeps_the_first_positions_exact():
    q, k, v = qkv(1, 4, 2, 60, 8, seed=3)
    o = moba_attention(q, k, v, scale=0.35, block_size=8, gating="token", top_k=2, min_seq_len=30)
    torch.testing.assert_close(o, naive_moba(q, k, v, scale=0.35, bs=8, top_k=2, min_seq_len=30))
    torch.testing.assert_close(o[:, :30], softmax_attention(q, k, v, scale=0.35)[:, :30])
    assert (o[:, 30:] - softmax_attention(q, k, v, scale=0.35)[:, 30:]).abs().max() > 1e-3


def test_causal_no_future_block_or_key():
    q, k, v = qkv(1, 4, 2, 50, 8, seed=4)
    o = moba_attention(q, k, v, scale=0.35, block_size=8, gating="token", top_k=2)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:] = 10 * torch.randn_like(k2[:, :, 30:])  # the future of query 29 (and block 3's mean)
    v2[:, :, 30:] = 10 * torch.randn_like(v2[:, :, 30:])
    o2 = moba_attention(q, k2, v2, scale=0.35, block_size=8, gating="token", top_k=2)
    assert torch.equal(o[:, :30], o2[:, :30])
    kpos, valid = key_positions(None, 1, 50, q.device)
    qpos, _, _ = query_positions(kpos, valid, 50, None)
    sel = gate(q, block_means(k, kpos, valid, 8), qpos, block_size=8, top_k=4)
    own = (torch.arange(50) // 8)[None, None, :, None]
    assert not (sel & (torch.arange(7) >= own)).any()  # never the own block or a later one
    assert (sel.sum(-1) == torch.clamp(own[..., 0], max=3)).all()  # exactly min(top_k - 1, earlier blocks)


def test_gradients_equal_the_naive_loop():
    q, k, v = qkv(1, 4, 2, 37, 8, seed=5, grad=True)
    do = torch.randn(1, 37, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    grads = []
    for f in (lambda: moba_reference(q, k, v, scale=0.35, block_size=8, gating="token", top_k=2),
              lambda: naive_moba(q, k, v, scale=0.35, bs=8, top_k=2)):
        (f() * do).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    for a, b in zip(*grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_float32_gradients_are_finite_with_padding():
    q, k, v = qkv(2, 4, 2, 40, 8, dtype=torch.float32, seed=7, grad=True)
    km = torch.ones(2, 40, dtype=torch.bool)
    km[0, :13] = False
    moba_attention(q, k, v, scale=0.35, block_size=8, gating="token", top_k=2, key_mask=km).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_left_padded_rows_equal_each_row_alone():
    q, k, v = qkv(3, 4, 2, 58, 8, seed=8)
    pads = [0, 6, 21]
    km = torch.ones(3, 58, dtype=torch.bool)
    for r, p in enumerate(pads):
        km[r, :p] = False
    o = moba_attention(q, k, v, scale=0.35, block_size=8, gating="token", top_k=2, key_mask=km)
    torch.testing.assert_close(o, naive_moba(q, k, v, scale=0.35, bs=8, top_k=2, key_mask=km))
    for r, p in enumerate(pads):
        alone = moba_attention(q[r:r + 1, :, p:], k[r:r + 1, :, p:], v[r:r + 1, :, p:], scale=0.35, block_size=8,
                               gating="token", top_k=2)
        torch.testing.assert_close(o[r:r + 1, p:], alone, atol=1e-12, rtol=1e-10)


def test_queries_after_a_prefix_and_a_decode_buffer_equal_the_full_sequence():
    """A chunk of queries after cached keys (q_offset default), and a decode step over a preallocated buffer with
    empty slots (q_offset past every key, as KVBufferLayer's step) give the full sequence's rows."""
    q, k, v = qkv(2, 4, 2, 45, 8, seed=9)
    km = torch.ones(2, 45, dtype=torch.bool)
    km[1, :7] = False
    full = moba_attention(q, k, v, scale=0.35, block_size=8, gating="token", top_k=2, key_mask=km)
    tail = moba_attention(q[:, :, 30:], k, v, scale=0.35, block_size=8, gating="token", top_k=2, key_mask=km)
    torch.testing.assert_close(tail, full[:, 30:], atol=1e-12, rtol=1e-10)
    cap = 64
    kb = torch.zeros(2, 2, cap, 8, dtype=k.dtype)
    vb = torch.zeros_like(kb)
    kb[:, :, :45], vb[:, :, :45] = k, v
    mb = torch.zeros(2, cap, dtype=torch.bool)
    mb[:, :45] = km
    step = moba_attention(q[:, :, 44:], kb, vb, scale=0.35, block_size=8, gating="token", top_k=2, key_mask=mb, q_offset=cap)
    torch.testing.assert_close(step, full[:, 44:], atol=1e-12, rtol=1e-10)


def test_query_chunks_do_not_change_the_result():
    q, k, v = qkv(1, 4, 2, 50, 8, seed=10)
    a = moba_reference(q, k, v, scale=0.35, block_size=8, gating="token", top_k=2)
    b = moba_reference(q, k, v, scale=0.35, block_size=8, gating="token", top_k=2, chunk_elems=4 * 50 * 7)  # 7 queries a chunk
    torch.testing.assert_close(a, b, atol=1e-13, rtol=1e-12)


def test_config_defaults_and_bad_values():
    cfg = lp.methods.get_method("moba").parse_config({})
    assert (cfg.block_size, cfg.top_k, cfg.min_seq_len, cfg.gating, cfg.backend) == (512, 3, 0, "block", "auto")
    for bad in (dict(top_k=0), dict(block_size=0), dict(backend="cuda"), dict(gating="query"), dict(window=3)):
        with pytest.raises(ConfigError):
            lp.methods.get_method("moba").parse_config(bad)


def test_patched_model_runs_moba_and_the_op_entry():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        lp.patch(model, "moba", block_size=8, top_k=2)
        after = model(ids).logits
        lp.unpatch(model)
        lp.patch(model, "moba", block_size=8, top_k=6)  # 6 blocks of 8: every block selected
        covered = model(ids).logits
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(covered, before, atol=1e-5, rtol=1e-5)
    from longctx_patch.methods.moba import MobaAttention, MobaConfig

    q, k, v = qkv(1, 4, 2, 40, 8, dtype=torch.float32, seed=11)
    cfg = MobaConfig.from_dict(dict(block_size=8, top_k=2))
    torch.testing.assert_close(MobaAttention.op(q, k, v, scale=0.35, config=cfg),
                               moba_attention(q, k, v, scale=0.35, block_size=8, top_k=2))


def test_cli_info_moba():
    from longctx_patch.cli.main import main

    r = CliRunner().invoke(main, ["info", "moba"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith("  moba: ") and "block_size = 512" in r.output and "top_k = 3" in r.output
