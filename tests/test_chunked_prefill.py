"""generate()'s chunked prefill (`prefill_chunk_size`) on patched models, and the 4-D mask transformers builds.

Patched modules read the 2-D padding mask, never the model's 4-D one, so a fully patched model's cache reports the
queries alone as the mask's size (`LongctxCache.get_mask_sizes`): a chunked prefill then builds no
`q x (past + q)` mask per chunk, which grew with the context (4.3 GB at 4 x 128k on the H200) while the state did
not. A hybrid with unpatched layers keeps the real sizes for them."""

import pytest
import torch

import longctx_patch as lp

from conftest import tiny_model

CONFIGS = {
    "exact": {},
    "sliding-window": {"window": 8},
    "lola": {"window": 4, "chunk": 4, "sparse_cache": 4, "feature_dim": 8, "checkpoint": "none"},
    "lolcats": {"window": 4, "chunk": 4, "feature_dim": 8, "checkpoint": "none"},
    "ovq": {"chunk_size": 8, "max_centroids": 12, "growth": 4.0},
    "muse": {},
    "moba": {"block_size": 8, "top_k": 2},
}


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_chunked_prefill_equals_one_prefill(method):
    model = tiny_model("llama").eval()
    lp.patch(model, method, **CONFIGS[method])
    ids = torch.randint(3, 100, (2, 45), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    one = model.generate(ids, **kw)
    chunked = model.generate(ids, prefill_chunk_size=16, **kw)
    assert torch.equal(one.sequences, chunked.sequences)
    torch.testing.assert_close(torch.stack(chunked.scores, 1), torch.stack(one.scores, 1), atol=1e-5, rtol=1e-5)


def _forwards(model):
    """The lengths of the inputs of every forward of `model` (a list the hook fills)."""
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    return seen


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_bounded_state_methods_prefill_in_chunks_by_default(method, monkeypatch):
    """A model whose every layer keeps a bounded decode state (sliding-window, lolcats, lola, ovq) prefills a long
    prompt in chunks unless the call says otherwise (its activations stay bounded like its state); a full KV cache
    (exact, muse, moba) or a hybrid with unpatched layers prefills in one pass. The tokens are the one-pass ones."""
    from longctx_patch import patcher

    monkeypatch.setattr(patcher, "DEFAULT_PREFILL_CHUNK", 16)
    model = tiny_model("llama").eval()
    lp.patch(model, method, **CONFIGS[method])
    ids = torch.randint(3, 100, (2, 45), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    seen = _forwards(model)
    out = model.generate(ids, **kw)
    bounded = lp.get_method(method).bounded_state
    assert bounded == (method in ("sliding-window", "lolcats", "lola", "ovq"))
    assert seen[:-2] == ([16, 16, 13] if bounded else [45])  # then two decode steps
    seen.clear()
    assert torch.equal(model.generate(ids, prefill_chunk_size=64, **kw), out)  # the call's own value wins
    assert seen[0] == 45
    lp.set_prefill_chunk(model, None)
    seen.clear()
    assert torch.equal(model.generate(ids, **kw), out)
    assert seen[0] == 45
    lp.set_prefill_chunk(model, 9)
    seen.clear()
    model.generate(ids, **kw)
    assert seen[:-2] == [9] * 5


def test_a_hybrid_with_unpatched_layers_prefills_in_one_pass(monkeypatch):
    from longctx_patch import patcher

    monkeypatch.setattr(patcher, "DEFAULT_PREFILL_CHUNK", 16)
    model = tiny_model("llama").eval()
    lp.patch(model, "lolcats", layers=[0], **CONFIGS["lolcats"])
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(1))
    seen = _forwards(model)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert seen[0] == 40
    lp.patch(model, "sliding-window", layers=[1, 2], window=8)  # now every layer is bounded
    seen.clear()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert seen[:-1] == [16, 16, 8]
    with pytest.raises(lp.ConfigError, match="prefill_chunk"):
        lp.set_prefill_chunk(model, -1)
    with pytest.raises(lp.ConfigError, match="prefill_chunk"):
        lp.patch(tiny_model("llama"), "lola", prefill_chunk="big")


def test_mask_sizes_of_a_patched_cache():
    model = tiny_model("llama").eval()
    lp.patch(model, "lola", **CONFIGS["lola"])
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    assert cache.get_seq_length() == 20
    assert cache.get_mask_sizes(16, 0) == (16, 0)  # nobody reads the 4-D mask: the queries alone
    # a hybrid: layer 0 unpatched keeps transformers' full-length mask for it
    hybrid = tiny_model("llama").eval()
    lp.patch(hybrid, "lola", layers=[1], **CONFIGS["lola"])
    with torch.no_grad():
        cache = hybrid(ids, use_cache=True).past_key_values
    assert cache.get_mask_sizes(16, 0) == (36, 0)


def test_hybrid_chunked_prefill_equals_one_prefill():
    model = tiny_model("llama").eval()
    lp.patch(model, "ovq", layers=[1], **CONFIGS["ovq"])
    ids = torch.randint(3, 100, (2, 37), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    am[1, :5] = 0  # a left-padded row: the unpatched layer needs the real mask
    kw = dict(attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, prefill_chunk_size=12, **kw))
