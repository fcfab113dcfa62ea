"""kernels/window/: banded sliding-window attention equals the dense-mask reference (forward and backward)."""

import pytest
import torch
import torch.nn.functional as F

from longctx_patch.kernels.softmax import attention_mask, softmax_attention
from longctx_patch.kernels.window import band_block, banded_bytes, banded_window_attention, use_banded


def dense(q, k, v, *, scale, window, key_mask=None, q_offset=None):
    G = q.shape[1] // k.shape[1]
    mask = attention_mask(q.shape[2], k.shape[2], device=q.device, key_mask=key_mask, q_offset=q_offset, window=window)
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask,
                                       scale=scale)
    return o.transpose(1, 2)


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("B,Hq,Hkv,S,D,W", [
    (1, 4, 2, 300, 16, 64), (2, 7, 1, 517, 8, 1), (2, 14, 2, 333, 16, 5), (1, 2, 2, 700, 8, 300),
    (3, 4, 4, 129, 8, 200),
])
def test_prefill_equals_the_dense_mask(B, Hq, Hkv, S, D, W):
    q, k, v = _inputs(B, Hq, Hkv, S, S, D)
    want = dense(q, k, v, scale=D**-0.5, window=W)
    got = banded_window_attention(q, k, v, scale=D**-0.5, window=W)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("block", [64, 100])
def test_left_padding_and_queries_after_a_past(block):
    B, Hq, Hkv, Sq, Sk, D, W = 3, 6, 2, 211, 390, 16, 77
    q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, D, seed=1)
    km = torch.ones(B, Sk, dtype=torch.bool)
    km[1, :13] = False
    km[2, :250] = False  # padding reaching into the queries
    for q_offset in (None, 120):
        want = dense(q, k, v, scale=0.3, window=W, key_mask=km, q_offset=q_offset)
        got = banded_window_attention(q, k, v, scale=0.3, window=W, key_mask=km, q_offset=q_offset, block=block)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_gradients_equal_the_dense_mask():
    q, k, v = _inputs(2, 4, 2, 301, 301, 16, seed=2)
    km = torch.ones(2, 301, dtype=torch.bool)
    km[0, :40] = False
    grads = []
    for fn in (dense, banded_window_attention):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fn(*x, scale=0.25, window=50, key_mask=km)
        (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
        grads.append([t.grad for t in x])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_bf16_is_close_to_fp32():
    q, k, v = _inputs(1, 4, 2, 400, 400, 32, seed=3)
    ref = dense(q, k, v, scale=32**-0.5, window=128)
    got = banded_window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=32**-0.5, window=128)
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() < 3e-2


def test_softmax_attention_routes_long_windowed_calls_to_the_bands():
    assert use_banded(4096, 4096, 256) and not use_banded(1, 4096, 256) and not use_banded(4096, 4096, None)
    assert not use_banded(300, 300, 256)  # a single band: the dense mask is as small
    q, k, v = _inputs(1, 4, 2, 1000, 1000, 8, seed=4)
    torch.testing.assert_close(softmax_attention(q, k, v, scale=0.3, window=40),
                               dense(q, k, v, scale=0.3, window=40), atol=2e-6, rtol=1e-5)


def test_memory_is_linear_in_the_sequence():
    a = banded_bytes(1, 32, 8, 65536, 64, 256, 2)
    b = banded_bytes(1, 32, 8, 131072, 64, 256, 2)
    assert b == 2 * a
    assert a < 65536 * 65536 / 4  # a quarter of one S x S boolean mask at 64k (and half that share at 128k)
    assert band_block(16) == 64 and band_block(256) == 256 and band_block(4096) == 256


def test_queries_outside_the_keys_are_refused():
    q, k, v = _inputs(1, 2, 2, 10, 8, 8)
    with pytest.raises(ValueError, match="do not lie within"):
        banded_window_attention(q, k, v, scale=1.0, window=4)


def test_patched_model_through_the_bands_equals_the_dense_mask(monkeypatch):
    import longctx_patch as lp
    import longctx_patch.kernels.softmax.ops as sm
    from conftest import assert_padded_batch_exact, tiny_model

    model = lp.patch(tiny_model("llama"), "sliding-window", window=16)
    ids = torch.randint(3, 128, (2, 300), generator=torch.Generator().manual_seed(0))
    calls = []
    real = sm.banded_window_attention
    monkeypatch.setattr(sm, "banded_window_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
        assert calls, "the 300-token prefill did not take the banded path"
        monkeypatch.setattr(sm, "use_banded", lambda *a: False)
        want = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    monkeypatch.undo()
    assert_padded_batch_exact(model, (300, 211, 290), max_new_tokens=5)
