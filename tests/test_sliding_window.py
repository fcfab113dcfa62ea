"""sliding-window: equals exact attention under a window mask; cached decode == recompute; padding."""

import pytest
import torch

import longctx_patch as lp
from longctx_patch.kernels.softmax import attention_mask, softmax_attention

from conftest import assert_left_padded_batch_matches_single, tiny_model


def _naive(q, k, v, scale, window, key_mask=None):
    """Dense fp64 reference: explicit scores, -inf outside the causal window."""
    B, H, S, D = q.shape
    rep = H // k.shape[1]
    k = k.repeat_interleave(rep, 1).double()
    v = v.repeat_interleave(rep, 1).double()
    s = q.double() @ k.transpose(-1, -2) * scale
    i = torch.arange(S)[:, None]
    j = torch.arange(S)[None]
    ok = (j <= i) & (j > i - window)
    ok = ok[None, None].expand(B, H, S, S)
    if key_mask is not None:
        ok = (ok & key_mask[:, None, None, :]) | (i == j)[None, None]
    s = s.masked_fill(~ok, float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("S,window", [(1, 4), (17, 4), (33, 33), (40, 1), (29, 100)])
def test_window_equals_masked_exact(S, window):
    g = torch.Generator().manual_seed(S)
    q = torch.randn(2, 4, S, 16, generator=g)
    k = torch.randn(2, 2, S, 16, generator=g)
    v = torch.randn(2, 2, S, 16, generator=g)
    km = torch.ones(2, S, dtype=torch.bool)
    km[1, : S // 3] = False
    for mask in (None, km):
        out = softmax_attention(q, k, v, scale=0.25, window=window, key_mask=mask)
        torch.testing.assert_close(out.double(), _naive(q, k, v, 0.25, window, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("Sq", [1, 7, 30])
def test_queries_after_a_cache(Sq):
    """The last Sq of S tokens (a decode step, a prefill's tail, a chunk after a cache): the last Sq rows of the
    dense reference (the branches: bottom-right causal without padding or window, the query heads of a kv head
    stacked when Sq * G <= S, the cache repeated otherwise), with and without a window and a left-padding key
    mask, 3 query heads per kv head; and with one query head per kv head (the branches without GQA)."""
    g = torch.Generator().manual_seed(Sq)
    S = 50
    q = torch.randn(2, 6, S, 16, generator=g)
    k = torch.randn(2, 2, S, 16, generator=g)
    v = torch.randn(2, 2, S, 16, generator=g)
    km = torch.ones(2, S, dtype=torch.bool)
    km[1, :11] = False
    for window in (None, S, 9):  # None without a key mask: a decode step's query takes SDPA without a mask
        for mask in (None, km):
            out = softmax_attention(q[:, :, S - Sq:], k, v, scale=0.25, window=window, key_mask=mask)
            ref = _naive(q, k, v, 0.25, window or S, mask)[:, S - Sq:]
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
            k1, v1 = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)  # G = 1
            out = softmax_attention(q[:, :, S - Sq:], k1, v1, scale=0.25, window=window, key_mask=mask)
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_mask_rows_never_empty():
    km = torch.zeros(1, 6, dtype=torch.bool)
    m = attention_mask(6, 6, device="cpu", key_mask=km, window=2)
    assert m.any(-1).all()


# llama: every method in tests/test_method_contract.py
@pytest.mark.parametrize("family", ["qwen3"])
def test_greedy_generate_with_cache_equals_recompute(family):
    model = tiny_model(family)
    lp.patch(model, "sliding-window", window=7)
    x = torch.randint(3, 128, (1, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False, pad_token_id=0)
        seq = x
        for _ in range(12):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(got, seq)
    # the cache never holds more than window slots per layer (a ring: window - 1 past tokens and the current one)
    out = model(seq, use_cache=True)
    assert all(layer.keys.shape[2] == 7 for layer in out.past_key_values.layers)


def test_left_padded_batch_equals_single_prompts():
    model = tiny_model("llama")
    lp.patch(model, "sliding-window", window=5)
    assert_left_padded_batch_matches_single(model, (11, 4, 8), max_new_tokens=9)


def test_state_bytes_bounded():
    model = tiny_model("llama")
    lp.patch(model, "sliding-window", window=1024)
    mod = model.model.layers[0].self_attn
    assert mod.state_bytes(32) < mod.state_bytes(10_000) == mod.state_bytes(100_000)
