"""ovq: reference maths (degenerate == exact attention, update == per-token loop, chunked == streamed)
and the patched method (prefill + decode == one forward, generate, padding, state size, save/load, hybrids)."""

import math

import pytest
import torch
import torch.nn.functional as F

import longctx_patch as lp
from longctx_patch.errors import ConfigError
from longctx_patch.kernels.ovq import (OVQState, exact_causal_attention, ovq_attention, target_centroids,
                                       update_state, update_state_loop)
from longctx_patch.kernels.ovq.reference import target_int

from conftest import tiny_model


def _qkv(B, Hq, H, S, D, seed, beta=4.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, Hq, S, D, generator=g), dim=-1) * beta
    k = F.normalize(torch.randn(B, H, S, D, generator=g), dim=-1)
    v = torch.randn(B, H, S, D, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# --------------------------------------------------------------------------------------- growth schedule
def test_growth_schedule_saturates():
    T = torch.arange(0, 20000, 37)
    for growth in (0.0, 60.0, 100.0):
        n = target_centroids(T, 256, growth)
        assert (n[1:] >= n[:-1]).all() and (n <= T).all() and (n <= 256).all()
        assert int(n[-1]) == 256
        assert [target_int(int(t), 256, growth) for t in T[:50]] == n[:50].tolist()
    assert target_centroids(T, 256, 0.0).tolist() == torch.clamp(T, max=256).tolist()
    # the expected number of clusters of a Dirichlet process with concentration `growth`
    for t in (1, 10, 100, 1000, 5000):
        assert int(target_centroids(torch.tensor([t]), 10**6, 100.0)) == math.ceil(100 * math.log1p(t / 100) - 1e-9)
    assert int(target_centroids(torch.tensor([3]), 10**6, 100.0)) == 3  # early tokens all open rows


# --------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("S,C", [(1, 4), (23, 4), (37, 8), (16, 16), (19, 1)])
def test_degenerate_config_equals_exact_attention(S, C):
    q, k, v = _qkv(2, 4, 2, S, 16, seed=S + C)
    valid = torch.ones(2, S, dtype=torch.bool)
    valid[1, : S // 3] = False  # left padding
    o, st, op, _ = ovq_attention(q, k, v, None, None, valid, chunk_size=C, max_centroids=S + 5, growth=0.0,
                                 backend="torch")
    ref = exact_causal_attention(q, k, v, valid)
    real = valid[:, None, :, None].expand_as(ref)
    torch.testing.assert_close(o[real], ref[real], atol=2e-6, rtol=1e-5)
    # every absorbed real token is its own row with count 1
    absorbed = (S // C) * C
    assert st.n_active.tolist() == [int(valid[b, :absorbed].sum()) for b in range(2)]
    assert set(st.counts[st.counts > 0].unique().tolist()) <= {1.0}


def test_degenerate_bf16():
    q, k, v = _qkv(1, 4, 1, 29, 16, seed=3, dtype=torch.bfloat16)
    o, *_ = ovq_attention(q, k, v, None, None, None, chunk_size=8, max_centroids=64, growth=0.0, backend="torch")
    ref = exact_causal_attention(q.double(), k.double(), v.double())
    assert ((o.double() - ref).norm() / ref.norm()) < 1e-2


# --------------------------------------------------------------------------------------- dictionary update
@pytest.mark.parametrize("growth,N", [(0.0, 12), (6.0, 10), (40.0, 64), (3.0, 5)])
def test_update_equals_per_token_loop(growth, N):
    g = torch.Generator().manual_seed(int(growth) + N)
    B, H, C, D = 2, 2, 7, 8
    st_vec = OVQState.empty(B, H, N, D)
    st_loop = OVQState.empty(B, H, N, D)
    for t in range(5):
        k = F.normalize(torch.randn(B, H, C, D, generator=g), dim=-1)
        v = torch.randn(B, H, C, D, generator=g)
        valid = torch.rand(B, C, generator=g) > 0.25
        if t == 2:
            valid[0] = False  # a chunk of padding only
        st_vec = update_state(st_vec, k, v, valid, N, growth)
        st_loop = update_state_loop(st_loop, k, v, valid, N, growth)
        assert st_vec.n_active.tolist() == st_loop.n_active.tolist()
        assert st_vec.seen.tolist() == st_loop.seen.tolist()
        torch.testing.assert_close(st_vec.counts, st_loop.counts)
        torch.testing.assert_close(st_vec.keys, st_loop.keys, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(st_vec.values, st_loop.values, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(st_vec.key_sums, st_loop.key_sums, atol=1e-5, rtol=1e-5)
        # one row per token: counts add up to the real tokens absorbed
        assert torch.allclose(st_vec.counts.sum(-1), st_vec.seen[:, None].float())
    assert int(st_vec.n_active.max()) <= N


def test_new_rows_are_the_least_covered_tokens():
    """Spread maximisation: a token far from every row becomes a new row, a near-duplicate does not."""
    D = 4
    st = OVQState.empty(1, 1, 8, D)
    e = torch.eye(D)
    k0 = torch.stack([e[0], e[1]])[None, None]
    st = update_state(st, k0, k0.clone(), torch.ones(1, 2, dtype=torch.bool), 8, 0.0)
    assert int(st.n_active) == 2
    # chunk: a near copy of e0 and a new direction e2; growth allows one new row
    k1 = torch.stack([F.normalize(e[0] + 0.01 * e[1], dim=0), e[2]])[None, None]
    st2 = update_state(st, k1, k1.clone(), torch.ones(1, 2, dtype=torch.bool), 8, 2.0)
    n_new = int(st2.n_active) - 2
    assert n_new >= 1
    torch.testing.assert_close(st2.keys[0, 0, 2], e[2])
    assert float(st2.counts[0, 0, 0]) == 2.0  # the near copy joined row 0 (count-weighted mean)


# --------------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("pieces", [[1] * 30, [7, 1, 1, 13, 1, 7], [30], [9, 21]])
def test_chunked_forward_equals_streamed(pieces):
    q, k, v = _qkv(2, 4, 2, 30, 16, seed=11)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[0, :5] = False
    kw = dict(chunk_size=6, max_centroids=9, growth=5.0, backend="torch")
    full, st_full, _, _ = ovq_attention(q, k, v, None, None, valid, **kw)
    st, op, sb, outs, s = None, None, None, [], 0
    for n in pieces:
        o, st, op, sb = ovq_attention(q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n], st, op,
                                      valid[:, s:s + n], seen_bound=sb, **kw)
        outs.append(o)
        s += n
    torch.testing.assert_close(torch.cat(outs, 2), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st.key_sums, st_full.key_sums)
    assert st.n_active.tolist() == st_full.n_active.tolist()


def test_gradients_reach_earlier_chunks_through_dictionary():
    q, k, v = _qkv(1, 2, 1, 24, 16, seed=5)
    k.requires_grad_(True)
    v.requires_grad_(True)
    o, *_ = ovq_attention(q, k, v, None, None, None, chunk_size=8, max_centroids=4, growth=4.0, backend="torch")
    o[:, :, 16:].sum().backward()  # only the last chunk's outputs
    assert v.grad[:, :, :8].abs().sum() > 0 and k.grad[:, :, :8].abs().sum() > 0
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def _parallel_vs_loop(backend, S, C, N, growth, dtype=torch.float32, with_state=False, seed=0, exact_assign=True):
    """Output, final state and gradients (q, k, v and the initial sums) of the chunk-parallel training path
    against the chunk-by-chunk loop on the same inputs."""
    q, k, v = _qkv(2, 4, 2, S, 16, seed=seed, dtype=dtype)
    valid = torch.ones(2, S, dtype=torch.bool)
    valid[0, : min(11, S - 1)] = False  # left padding, across a chunk boundary
    kw = dict(chunk_size=C, max_centroids=N, growth=growth, backend=backend, exact_assign=exact_assign)
    st0, sb = None, None
    if with_state:
        qa, ka, va = _qkv(2, 4, 2, 2 * C, 16, seed=seed + 1, dtype=dtype)
        _, st0, _, sb = ovq_attention(qa, ka, va, None, None, None, **kw)
    g = torch.Generator().manual_seed(seed + 2)
    do = torch.randn(2, 4, S, 16, generator=g)
    res = []
    for parallel in (False, True):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        st = None
        if st0 is not None:
            st = OVQState(st0.key_sums.clone().requires_grad_(), st0.value_sums.clone().requires_grad_(),
                          st0.counts.clone(), st0.n_active.clone(), st0.seen.clone())
        o, st_out, op, sb_out = ovq_attention(qq, kk, vv, st, None, valid, seen_bound=sb, parallel=parallel, **kw)
        loss = (o.float() * do).sum() + st_out.key_sums.square().sum() + (st_out.value_sums * 0.5).sum()
        leaves = [qq, kk, vv] + ([st.key_sums, st.value_sums] if st is not None else [])
        grads = torch.autograd.grad(loss, leaves)
        res.append((o.detach(), st_out, op, sb_out, grads))
    (o_a, st_a, op_a, sb_a, g_a), (o_b, st_b, op_b, sb_b, g_b) = res
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(o_b, o_a, **tol)
    torch.testing.assert_close(st_b.key_sums, st_a.key_sums, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st_b.value_sums, st_a.value_sums, atol=1e-4, rtol=1e-4)
    assert torch.equal(st_b.counts, st_a.counts)
    assert st_b.n_active.tolist() == st_a.n_active.tolist() and st_b.seen.tolist() == st_a.seen.tolist()
    assert sb_a == sb_b and (op_a is None) == (op_b is None)
    if op_a is not None:
        assert torch.equal(op_a.keys, op_b.keys) and torch.equal(op_a.valid, op_b.valid)
    for a, b in zip(g_a, g_b):
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, a, **tol)


@pytest.mark.parametrize("S,C,N,growth", [(45, 8, 12, 4.0), (48, 8, 64, 0.0), (7, 8, 12, 4.0), (40, 4, 6, 2.0)])
def test_parallel_training_path_equals_loop(S, C, N, growth):
    _parallel_vs_loop("torch", S, C, N, growth)


def test_parallel_training_path_equals_loop_from_a_state():
    _parallel_vs_loop("torch", 29, 8, 16, 4.0, with_state=True, seed=3)


# --------------------------------------------------------------------------------------- method
def _patched(chunk=4, N=16, growth=6.0, family="llama", **kw):
    model = tiny_model(family, **kw)
    lp.patch(model, "ovq", chunk_size=chunk, max_centroids=N, growth=growth, backend="torch")
    return model


def test_config_validation():
    model = tiny_model("llama")
    with pytest.raises(ConfigError):
        lp.patch(model, "ovq", chunk_size=0)
    with pytest.raises(ConfigError):
        lp.patch(model, "ovq", backend="cuda")
    with pytest.raises(ConfigError):
        lp.patch(model, "ovq", growth=-1)
    with pytest.raises(ConfigError):
        lp.patch(model, "ovq", centroids=3)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefill_then_decode_equals_one_forward(family):
    model = _patched(chunk=4, N=6, growth=3.0, family=family)
    ids = torch.randint(3, 128, (2, 27), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :10], use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for t in range(10, 27):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, atol=1e-4, rtol=1e-4)
    layer = cache.layers[0]
    assert layer.open_len == 27 % 4 and layer.open_keys.shape[2] == 4 and int(layer.n_active.max()) <= 6


def test_left_padding_by_whole_chunks_equals_single_prompt():
    """Chunks are aligned to cache positions: a row padded by a multiple of chunk_size is unchanged."""
    C = 4
    model = _patched(chunk=C, N=8, growth=4.0)
    g = torch.Generator().manual_seed(9)
    long_p, short_p = torch.randint(3, 128, (13,), generator=g), torch.randint(3, 128, (5,), generator=g)
    ids = torch.zeros(2, 13, dtype=torch.long)
    am = torch.zeros_like(ids)
    ids[0], am[0] = long_p, 1
    ids[1, 8:], am[1, 8:] = short_p, 1  # 8 pad tokens = 2 chunks
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=am, max_new_tokens=7, do_sample=False, pad_token_id=0)
        for r, p in enumerate((long_p, short_p)):
            one = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=7, do_sample=False, pad_token_id=0)
            gen = one[0, len(p):]  # may stop early at EOS; the batch row is then padded
            assert torch.equal(batch[r, 13:13 + len(gen)], gen), f"row {r}"
            assert (batch[r, 13 + len(gen):] == 0).all()


def test_state_size_constant_from_1k_to_16k():
    model = tiny_model("llama", num_hidden_layers=1, max_position_embeddings=20000)
    lp.patch(model, "ovq", chunk_size=256, max_centroids=64, growth=64.0, backend="torch")
    sizes = []
    with torch.no_grad():
        for n in (1024 + 100, 4096 + 100, 16384 + 100):
            ids = torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n))
            out = model(ids, use_cache=True, logits_to_keep=1)
            sizes.append(out.past_key_values.nbytes())
            assert int(out.past_key_values.layers[0].n_active) == 64
    assert sizes[0] == sizes[1] == sizes[2]
    mod = model.model.layers[0].self_attn
    assert mod.state_bytes(1024) == mod.state_bytes(16384) == mod.state_bytes(1 << 20)
    # the state the layer reports is what the cache holds (same dtype of the open chunk)
    assert mod.state_bytes(16384 + 100, dtype=torch.float32) == sizes[2]


def test_hybrid_with_sliding_window():
    model = tiny_model("llama")
    lp.patch(model, "ovq", layers=[0, 2], chunk_size=4, max_centroids=8, growth=4.0, backend="torch")
    lp.patch(model, "sliding-window", layers=[1], window=5)
    assert lp.patcher.patched_layers(model) == {0: "ovq", 1: "sliding-window", 2: "ovq"}
    ids = torch.randint(3, 128, (1, 21), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :9], use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for t in range(9, 21):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, atol=1e-4, rtol=1e-4)


def test_training_step_updates_beta_and_projections():
    model = _patched(chunk=4, N=6, growth=3.0)
    model.train()
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    attn = model.model.layers[0].self_attn
    assert attn.ovq_log_beta.grad is not None and attn.ovq_log_beta.grad.abs().sum() > 0
    assert attn.v_proj.weight.grad.abs().sum() > 0 and attn.k_proj.weight.grad.abs().sum() > 0


def test_train_paths_give_the_same_loss_and_gradients():
    """train_path=parallel and train_path=loop through a patched model (left-padded batch, GQA)."""
    ids = torch.randint(3, 128, (2, 23), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    res = []
    for path in ("loop", "parallel"):
        model = tiny_model("llama")
        lp.patch(model, "ovq", chunk_size=4, max_centroids=6, growth=3.0, backend="torch", train_path=path)
        model.train()
        out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
        out.loss.backward()
        attn = model.model.layers[0].self_attn
        res.append((out.loss.detach(), attn.k_proj.weight.grad.clone(), attn.ovq_log_beta.grad.clone()))
    (la, ga, ba), (lb, gb, bb) = res
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
    assert ga.abs().sum() > 0
    torch.testing.assert_close(gb, ga, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(bb, ba, atol=1e-5, rtol=1e-4)


def test_triton_backend_rejects_odd_head_dim():
    q = torch.randn(1, 2, 5, 24)
    k = torch.randn(1, 1, 5, 24)
    with pytest.raises(ConfigError, match="power-of-two"):
        ovq_attention(q, k, k, None, None, None, chunk_size=4, max_centroids=8, growth=0.0, backend="triton")
    # auto falls back to the reference for such shapes
    o, *_ = ovq_attention(q, k, k, None, None, None, chunk_size=4, max_centroids=8, growth=0.0, backend="auto")
    assert o.shape == (1, 2, 5, 24)
