"""Models with their own sliding windows (mistral, qwen2, qwen3): `exact` reproduces them, `sliding-window`
keeps the smaller window, the approximating methods refuse the windowed layers."""

import dataclasses

import pytest
import torch

import longctx_patch as lp
from longctx_patch.architectures import get_adapter, model_config
from longctx_patch.train.transfer import attention_transfer

from conftest import tiny_model

W = 32
# family -> (config, the per-layer window transformers applies)
CASES = {
    "llama": ({}, [None, None, None]),
    "mistral": ({"sliding_window": W}, [W, W, W]),
    "qwen2": ({"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1}, [None, W, W]),
    "qwen3": ({"use_sliding_window": True, "sliding_window": W,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}, [W, None, W]),
}


def _model(family, **extra):
    return tiny_model(family, **{**CASES[family][0], **extra})


def _ids(batch, length, seed=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _windows(model):
    cfg = model_config(model)
    return [get_adapter(model).spec(cfg, i).sliding_window for i in range(cfg.num_hidden_layers)]


@pytest.mark.parametrize("family", list(CASES))
def test_spec_reads_the_window_transformers_applies(family):
    assert _windows(_model(family)) == CASES[family][1]


def test_spec_windows_follow_the_config_rules():
    assert _windows(tiny_model("mistral", sliding_window=None)) == [None] * 3
    # qwen2 / qwen3: no window unless use_sliding_window, whatever layer_types or max_window_layers say
    assert _windows(tiny_model("qwen2", sliding_window=W, max_window_layers=0)) == [None] * 3
    assert _windows(tiny_model("qwen3", sliding_window=W, layer_types=["sliding_attention"] * 3)) == [None] * 3
    qwen3 = tiny_model("qwen3", use_sliding_window=True, sliding_window=W, max_window_layers=2)
    assert _windows(qwen3) == [None, None, W]


@pytest.mark.parametrize("family", list(CASES))
def test_exact_forward_equals_unpatched_beyond_the_window(family, one_thread):
    model = _model(family)
    x = _ids(1, 300)
    with torch.no_grad():
        ref = model(x).logits
        lp.patch(model, "exact")
        out = model(x).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if family != "llama":  # the model's window changes its output at this length: the test sees it
        full = tiny_model(family)  # same weights (same seed), no window
        with torch.no_grad():
            assert (full(x).logits - ref).abs().max() > 1e-2


@pytest.mark.parametrize("family", list(CASES))
def test_exact_cached_generate_and_left_padded_batch_equal_unpatched(family, one_thread):
    """A left-padded batch (rows of 290 and 250 tokens) crossing the window: prefill logits of the real
    tokens, then greedy generate() with the cache, tokens and each step's logits."""
    model = _model(family)
    x = _ids(2, 290, seed=2)
    am = torch.ones_like(x)
    am[1, :40] = 0
    gen = dict(attention_mask=am, max_new_tokens=12, do_sample=False, pad_token_id=0,
               return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ref = model(x, attention_mask=am).logits
        ref_gen = model.generate(x, **gen)
        lp.patch(model, "exact")
        out = model(x, attention_mask=am).logits
        out_gen = model.generate(x, **gen)
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 40:], ref[1, 40:], atol=1e-5, rtol=1e-5)
    assert torch.equal(out_gen.sequences, ref_gen.sequences)
    torch.testing.assert_close(torch.stack(out_gen.logits), torch.stack(ref_gen.logits), atol=1e-5, rtol=1e-5)
    # a windowed layer's cache is a ring of window slots (window - 1 past tokens and the current one)
    cache = lp.LongctxCache(model)
    for i, w in enumerate(CASES[family][1]):
        assert cache.layers[i].window == w


def test_attention_transfer_teacher_keeps_the_window(one_thread):
    model = _model("qwen3")
    lp.patch(model, "exact")
    with torch.no_grad(), attention_transfer(model) as tr:
        model(_ids(1, 100), use_cache=False)
    assert len(tr.losses) == 3 and tr.loss().item() < 1e-10


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_takes_the_smaller_window(family, one_thread):
    model = _model(family)
    x = _ids(1, 100)  # a window of 100 on a full-attention layer is then no restriction
    with torch.no_grad():
        ref = model(x).logits
        lp.patch(model, "sliding-window", window=100)  # wider than the model's window: the model's stays
        assert [layer.self_attn.window for layer in model.model.layers] == [w or 100 for w in CASES[family][1]]
        torch.testing.assert_close(model(x).logits, ref, atol=1e-5, rtol=1e-5)
        lp.unpatch(model)
        lp.patch(model, "sliding-window", window=8)  # narrower: 8 everywhere
        assert [layer.self_attn.window for layer in model.model.layers] == [8, 8, 8]
        narrow = model(x).logits
        lp.unpatch(model)
        lp.patch(model, "exact")
        for layer in model.model.layers:  # exact under a window of 8 on every layer: the same function
            layer.self_attn.spec = dataclasses.replace(layer.self_attn.spec, sliding_window=8)
        torch.testing.assert_close(model(x).logits, narrow, atol=1e-5, rtol=1e-5)


REFUSING = [("muse", {"backend": "torch"}), ("lolcats", {"checkpoint": "none"}),
            ("lola", {"checkpoint": "none"}), ("ovq", {})]


@pytest.mark.parametrize("method,config", REFUSING)
def test_approximating_methods_refuse_windowed_layers(method, config):
    model = _model("qwen2")  # layers 1-2 windowed, layer 0 full
    with pytest.raises(lp.ConfigError) as e:
        lp.patch(model, method, **config)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"layers 1-2 of this qwen2 model attend only to their last {W} tokens" in msg
    assert msg.endswith(f"patch only layers='0' with {method}")
    assert not lp.is_patched(model)  # nothing was swapped
    lp.patch(model, method, layers=[0], **config)  # the full-attention layer is fine
    assert lp.patched_layers(model) == {0: method}
    # every layer windowed: the message points to exact / sliding-window
    with pytest.raises(lp.ConfigError, match=r"layers 0-2 .*mistral.*exact or sliding-window"):
        lp.patch(_model("mistral"), method, **config)
