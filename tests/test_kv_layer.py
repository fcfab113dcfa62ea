"""The preallocated K/V cache of `exact` and `sliding-window` (methods/kv_layer.py `KVBufferLayer`) against the plain
model and against recomputation without a cache: prefill + 20 greedy decode steps, logits to 1e-5 (fp32), full
attention and windows smaller and larger than the prompt, unpadded and left-padded batches, GQA with 7 query heads per
kv head, odd lengths, a regrow in the middle of decoding, beam search, crop."""

import pytest
import torch

import longctx_patch as lp
from longctx_patch.methods import kv_layer
from longctx_patch.methods.kv_layer import KVBufferLayer, capacity_for

from conftest import left_padded_prompts, tiny_model

GQA7 = dict(num_attention_heads=14, num_key_value_heads=2, hidden_size=224)  # head_dim 16, G = 7


def _gen(model, ids, am, n=21, **kw):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, 1), out.past_key_values


def _recomputed(model, seq, am, prompt_len):
    """Each generated step's logits recomputed over the whole sequence, no cache."""
    full_am = torch.cat([am, torch.ones(am.shape[0], seq.shape[1] - am.shape[1], dtype=am.dtype)], 1)
    pos = (full_am.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(seq, attention_mask=full_am, position_ids=pos, use_cache=False).logits
    return logits[:, prompt_len - 1:-1]


@pytest.mark.parametrize("cfg", [{}, GQA7], ids=["gqa2", "gqa7"])
@pytest.mark.parametrize("padded", [False, True])
def test_exact_equals_the_plain_model(cfg, padded):
    model = tiny_model("llama", **cfg)
    if padded:
        _, ids, am = left_padded_prompts((13, 7, 10))
    else:
        ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(1))
        am = torch.ones_like(ids)
    seq_ref, lg_ref, _ = _gen(model, ids, am)
    lp.patch(model, "exact")
    seq, lg, cache = _gen(model, ids, am)
    assert all(isinstance(layer, KVBufferLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 13 + 20 and cache.layers[0].capacity == capacity_for(13)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(lg, lg_ref, atol=1e-5, rtol=1e-5)  # every generated position is a real token


@pytest.mark.parametrize("window", [5, 9, 40])  # smaller than the prompt, smaller than prompt + decode, larger
@pytest.mark.parametrize("padded", [False, True])
def test_sliding_window_equals_recompute(window, padded):
    model = tiny_model("llama", **GQA7)
    lp.patch(model, "sliding-window", window=window)
    if padded:
        _, ids, am = left_padded_prompts((13, 7, 10))
    else:
        ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(2))
        am = torch.ones_like(ids)
    seq, lg, cache = _gen(model, ids, am)
    assert cache.layers[0].capacity == min(window, capacity_for(13))
    torch.testing.assert_close(lg, _recomputed(model, seq, am, ids.shape[1]), atol=1e-5, rtol=1e-5)
    assert torch.equal(seq[:, ids.shape[1]:], lg.argmax(-1))


@pytest.mark.parametrize("method,config", [("exact", {}), ("sliding-window", {"window": 30})])
def test_a_regrow_in_the_middle_of_decoding(monkeypatch, method, config):
    monkeypatch.setattr(kv_layer, "ALIGN", 8)
    monkeypatch.setattr(kv_layer, "HEADROOM", 2)
    monkeypatch.setattr(kv_layer, "GROW", 8)
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    am = torch.ones_like(ids)
    lp.patch(model, method, **config)
    seq, lg, cache = _gen(model, ids, am)
    # 16 slots after the prefill (11 + 2, rounded to 8), 24 at token 16, then 30 (exact: 32) at token 24
    assert cache.layers[0].capacity == (32 if method == "exact" else 30)
    torch.testing.assert_close(lg, _recomputed(model, seq, am, 11), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method,config", [("exact", {}), ("sliding-window", {"window": 6})])
def test_beam_search(method, config):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, num_beams=2, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        if method == "exact":
            ref = model.generate(ids, **kw)
        lp.patch(model, method, **config)
        got = model.generate(ids, **kw)
        if method != "exact":  # the same search without a cache: a beam's reordered cache is its own past
            lp.unpatch(model)
            lp.patch(model, method, **config)
            ref = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(got, ref)


def test_chunks_after_decode_and_crop():
    """A multi-token call after decode steps (a full ring gathered in order), and crop on full attention."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    x = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    for method, config in (("exact", {}), ("sliding-window", {"window": 7})):
        lp.patch(model, method, **config)
        with torch.no_grad():
            whole = model(x, use_cache=False).logits
            cache = model(x[:, :11], use_cache=True).past_key_values
            parts = [model(x[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(11, 14)]
            parts.append(model(x[:, 14:], cache=cache, use_cache=True).logits)
        torch.testing.assert_close(torch.cat(parts, 1), whole[:, 11:], atol=1e-5, rtol=1e-5)
        lp.unpatch(model)
    lp.patch(model, "exact")
    with torch.no_grad():
        whole = model(x, use_cache=False).logits
        cache = model(x[:, :20], use_cache=True).past_key_values
        cache.crop(-6)
        assert cache.get_seq_length() == 14
        tail = model(x[:, 14:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(tail, whole[:, 14:], atol=1e-5, rtol=1e-5)
    lp.unpatch(model)
    lp.patch(model, "sliding-window", window=4)
    with torch.no_grad():
        cache = model(x[:, :20], use_cache=True).past_key_values
    with pytest.raises(NotImplementedError, match="cannot drop tokens"):
        cache.crop(-2)


@pytest.mark.parametrize("method,config", [("sliding-window", {"window": 4}), ("sliding-window", {"window": 8}),
                                           ("sliding-window", {"window": 40}), ("exact", {})])
def test_assisted_generation_crops_a_full_ring(method, config, monkeypatch):
    """Prompt-lookup assisted generation (transformers verifies 4 candidate tokens per forward, then crops the rejected
    ones) gives the tokens and logits of plain greedy decoding, also once the ring is full and its candidates have
    overwritten the oldest slots (window 4: a forward of 5 tokens overwrites the whole ring)."""
    model = tiny_model("llama")
    pattern = torch.randint(3, 128, (7,), generator=torch.Generator().manual_seed(0))
    ids = pattern.repeat(5)[None]  # repeats: prompt lookup finds candidates, some accepted, some not
    lp.patch(model, method, **config)
    crops = []
    crop = KVBufferLayer.crop

    def spy(self, n):
        crops.append((-n, self.ring and self.seen > self.capacity))
        return crop(self, n)

    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24, do_sample=False,
              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        plain = model.generate(ids, **kw)
        monkeypatch.setattr(KVBufferLayer, "crop", spy)
        assisted = model.generate(ids, prompt_lookup_num_tokens=4, **kw)
    assert torch.equal(assisted.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(assisted.logits, 1), torch.stack(plain.logits, 1), atol=1e-5, rtol=1e-5)
    dropped = [n for n, full in crops if n > 0]
    assert dropped, "no candidate token was rejected: the test does not exercise crop"
    if method == "sliding-window":
        assert any(n > 0 and full for n, full in crops), "no crop of a full ring"


def test_a_full_ring_drops_only_its_last_forward():
    """With past recording on, a full ring takes back the tokens of its last forward (to a state equal to never having
    seen them), not more; without it, none."""
    model = tiny_model("llama")
    x = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    lp.patch(model, "sliding-window", window=6)
    with torch.no_grad():
        whole = model(x, use_cache=False).logits
        cache = model(x[:, :20], use_cache=True).past_key_values
        cache.activate_past_recording()
        model(x[:, 20:25], cache=cache, use_cache=True)  # 5 tokens over the full ring of 6
        cache.crop(-3)  # back to 22 tokens
        assert cache.get_seq_length() == 22
        tail = [model(x[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(22, 25)]
        tail.append(model(x[:, 25:], cache=cache, use_cache=True).logits)
        torch.testing.assert_close(torch.cat(tail, 1), whole[:, 22:], atol=1e-5, rtol=1e-5)
        with pytest.raises(NotImplementedError, match=r"cannot drop tokens once it is full .*: 6 asked, it can drop "
                                                      "the 5 tokens of its last forward"):
            cache.crop(-6)
        plain = model(x[:, :20], use_cache=True).past_key_values
        model(x[:, 20:25], cache=plain, use_cache=True)
    with pytest.raises(NotImplementedError, match="once past recording is on"):
        plain.crop(-1)
