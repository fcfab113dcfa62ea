"""The patcher spine: patch/unpatch identity, errors, save/load, layer selection, cache plumbing."""

import json

import pytest
import torch

import longctx_patch as lp
from longctx_patch.patcher import parse_layers, patch_context, patch_groups, patched_modules

from conftest import tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def _ids(batch=2, length=37, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method,config", [("exact", {}), ("sliding-window", {"window": 9})])
def test_patch_unpatch_bit_identical(family, method, config):
    model = tiny_model(family)
    x = _ids()
    with torch.no_grad():
        before = model(x).logits.clone()
        lp.patch(model, method, **config)
        patched = model(x).logits
        assert lp.patched_layers(model) == {0: method, 1: method, 2: method}
        lp.unpatch(model)
        after = model(x).logits
    assert torch.equal(before, after)
    assert not lp.is_patched(model)
    if method == "exact":  # our reference path computes the same function as the model's own attention
        torch.testing.assert_close(patched, before, atol=1e-5, rtol=1e-5)
    else:
        assert not torch.allclose(patched, before, atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_projections_are_shared(family):
    model = tiny_model(family)
    orig = model.model.layers[1].self_attn
    lp.patch(model, "exact", layers=[1])
    new = model.model.layers[1].self_attn
    assert new is not orig
    assert new.q_proj.weight is orig.q_proj.weight and new.o_proj.weight is orig.o_proj.weight
    if family == "qwen3":
        assert new.q_norm is orig.q_norm
    keys = set(model.state_dict())
    lp.unpatch(model)
    assert keys == set(model.state_dict())


def test_exact_matches_with_padding_and_fp32_tolerance():
    model = tiny_model("llama")
    x = _ids(2, 23)
    am = torch.ones_like(x)
    am[0, :7] = 0  # left padding on row 0
    with torch.no_grad():
        ref = model(x, attention_mask=am).logits
        lp.patch(model, "exact")
        out = model(x, attention_mask=am).logits
    torch.testing.assert_close(out[0, 7:], ref[0, 7:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], ref[1], atol=1e-5, rtol=1e-5)


def _left_padded(B=3, S=23, pads=(0, 7, 12), seed=2):
    x = _ids(B, S, seed=seed)
    am = torch.ones_like(x)
    for r, p in enumerate(pads):
        am[r, :p] = 0
    return x, am


def _positions(am, S):
    return (am.cumsum(-1) - 1).clamp_min(0)[:, am.shape[1] - S:]


@pytest.mark.parametrize("method,config", [("lolcats", dict(window=5, feature_dim=8, chunk=4, backend="torch")),
                                           ("exact", {})])
def test_left_padded_forward_without_position_ids(method, config):
    """The pre-hook gives a left-padded forward without position_ids the ids generate() passes (each row counted
    from its first real token), also when a cache holds earlier tokens (the mask covers past + new): lolcats' feature
    maps of rotated q/k see the row's own positions (before: 3.9e-3 on this tiny model, 2.7-5.9 on real ones),
    exact the same inputs bit for bit."""
    model = tiny_model("llama")
    lp.patch(model, method, **config)
    x, am = _left_padded()
    nxt, am2 = _ids(3, 4, seed=5), torch.cat([am, torch.ones(3, 4, dtype=am.dtype)], 1)
    with torch.no_grad():
        ref = model(x, attention_mask=am, position_ids=_positions(am, 23), use_cache=False).logits
        out = model(x, attention_mask=am, use_cache=False).logits
        c = model(x, attention_mask=am, position_ids=_positions(am, 23)).past_key_values
        ref2 = model(nxt, attention_mask=am2, position_ids=_positions(am2, 4), past_key_values=c).logits
        c = model(x, attention_mask=am).past_key_values
        out2 = model(nxt, attention_mask=am2, past_key_values=c).logits
    if method == "exact":
        assert torch.equal(out, ref) and torch.equal(out2, ref2)
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(out2, ref2, atol=1e-5, rtol=0)


def test_position_ids_only_for_left_padding():
    """Without padding, with right padding, or with position_ids given, the decoder gets exactly what was passed;
    after unpatch a left-padded forward without position_ids is the unpatched model's again, bit for bit."""
    model = tiny_model("llama")
    x, am = _left_padded()
    with torch.no_grad():
        before = model(x, attention_mask=am).logits
    lp.patch(model, "exact")
    seen = []
    h = model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("position_ids")), with_kwargs=True)
    right = torch.ones_like(am)
    right[1, -5:] = 0
    given = torch.arange(23)[None].expand(3, 23)
    with torch.no_grad():
        model(x)
        model(x, attention_mask=torch.ones_like(am))
        model(x, attention_mask=right)
        model(x, attention_mask=am, position_ids=given)
        model(x, attention_mask=am)
    h.remove()
    assert seen[:3] == [None, None, None] and seen[3] is given
    assert torch.equal(seen[4], _positions(am, 23))
    lp.unpatch(model)
    with torch.no_grad():
        after = model(x, attention_mask=am).logits
    assert torch.equal(before, after)


def test_unsupported_model_names_supported_types():
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(lp.UnsupportedModelError, match="llama.*mistral.*qwen2.*qwen3"):
        lp.patch(m, "exact")


def test_bad_inputs_raise_named_errors(tiny_llama):
    with pytest.raises(lp.ConfigError, match="unknown method 'nope'.*exact"):
        lp.patch(tiny_llama, "nope")
    with pytest.raises(lp.ConfigError, match="unknown key.*windw.*allowed keys: window"):
        lp.patch(tiny_llama, "sliding-window", windw=3)
    with pytest.raises(ValueError, match="window.*allowed: int >= 1"):
        lp.patch(tiny_llama, "sliding-window", window=0)
    with pytest.raises(lp.ConfigError, match="bad value 'abc' for window"):
        lp.patch(tiny_llama, "sliding-window", window="abc")
    with pytest.raises(lp.ConfigError, match="out of range.*0-2"):
        lp.patch(tiny_llama, "exact", layers=[5])
    with pytest.raises(lp.NotPatchedError):
        lp.unpatch(tiny_llama)
    assert not lp.is_patched(tiny_llama)
    lp.patch(tiny_llama, "exact", layers="0-1")
    with pytest.raises(lp.AlreadyPatchedError, match=r"layers \[1\] are already patched"):
        lp.patch(tiny_llama, "sliding-window", layers=[1, 2], window=4)
    lp.patch(tiny_llama, "sliding-window", layers=[2], window=4)  # disjoint layers: a hybrid
    assert lp.patched_layers(tiny_llama) == {0: "exact", 1: "exact", 2: "sliding-window"}


def test_what_the_patcher_hands_out(tiny_llama):
    """patched_modules / patch_groups / patch_context: the patch as the cache, the methods, train/ and the CLI see
    it (NotPatchedError on an unpatched model, as LongctxCache(model))."""
    from transformers.cache_utils import DynamicLayer

    from longctx_patch.methods.kv_layer import KVBufferLayer
    from longctx_patch.patch_state import patched_modules as patched_modules_for_methods

    for ask in (patched_modules, patch_groups, patch_context, patched_modules_for_methods, lp.LongctxCache):
        with pytest.raises(lp.NotPatchedError, match="not patched by longctx-patch"):
            ask(tiny_llama)
    lp.patch(tiny_llama, "sliding-window", layers=[2], window=4)
    lp.patch(tiny_llama, "exact", layers=[0])
    mods = patched_modules(tiny_llama)
    assert list(mods) == [0, 2] and all(mods[i] is tiny_llama.model.layers[i].self_attn for i in mods)
    assert patched_modules_for_methods(tiny_llama) == mods
    assert [g.to_record() for g in patch_groups(tiny_llama)] == [
        {"method": "sliding-window", "config": {"window": 4}, "layers": [2]},
        {"method": "exact", "config": {}, "layers": [0]},
    ]
    ctx = patch_context(tiny_llama)
    assert all(m._ctx is ctx for m in mods.values())
    cache = lp.LongctxCache(tiny_llama)
    assert [type(layer) for layer in cache.layers] == [KVBufferLayer, DynamicLayer, KVBufferLayer]
    assert cache.layers[0].window is None and cache.layers[2].window == 4
    lp.unpatch(tiny_llama)
    with pytest.raises(lp.NotPatchedError):
        patched_modules(tiny_llama)


def test_parse_layers():
    assert parse_layers(None, 4) == [0, 1, 2, 3]
    assert parse_layers("0-1,3", 4) == [0, 1, 3]
    assert parse_layers([-1], 4) == [3]
    with pytest.raises(lp.ConfigError, match="cannot read"):
        parse_layers("a-b", 4)
    with pytest.raises(lp.ConfigError, match="empty"):
        parse_layers([], 4)


def test_config_coercion_from_strings(tiny_llama):
    lp.patch(tiny_llama, "sliding-window", window="1k")
    assert tiny_llama.model.layers[0].self_attn.method_config.window == 1024


def test_save_load_round_trip(tmp_path, tiny_llama):
    x = _ids()
    lp.patch(tiny_llama, "sliding-window", layers="1-2", window=5)
    with torch.no_grad():
        ref = tiny_llama(x).logits
    lp.save_patched(tiny_llama, tmp_path)
    rec = json.loads((tmp_path / "longctx_patch.json").read_text())
    assert rec["method"] == "sliding-window" and rec["layers"] == [1, 2] and rec["config"] == {"window": 5}
    assert rec["version"] == lp.__version__
    # the HF checkpoint is plain: no patched modules inside
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not lp.is_patched(plain)
    loaded = lp.load_patched(tmp_path, device="cpu")
    assert lp.patched_layers(loaded) == {1: "sliding-window", 2: "sliding-window"}
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, ref)


@pytest.fixture
def temperature_method():
    """A real method with a trainable parameter: exact attention with a learnable per-head log-temperature."""
    from dataclasses import dataclass

    from longctx_patch.methods.base import _REGISTRY, Method, MethodConfig, option, register_method
    from longctx_patch.methods.exact import ExactAttention

    @dataclass
    class TempConfig(MethodConfig):
        init: float = option(0.0, "initial log-temperature")

    class TempAttention(ExactAttention):
        method_name = "test-temperature"

        def __init__(self, orig, spec, config, adapter):
            super().__init__(orig, spec, config, adapter)
            self.log_temp = torch.nn.Parameter(torch.full((spec.num_heads, 1, 1), config.init))

        def attend(self, q, k, v, cache_layer, padding):
            return super().attend(q * self.log_temp.exp(), k, v, cache_layer, padding)

    @register_method
    class Temp(Method):
        name = "test-temperature"
        config_cls = TempConfig
        module_cls = TempAttention

    yield "test-temperature"
    _REGISTRY.pop("test-temperature")


def test_method_weights_round_trip_and_bad_weights(tmp_path, temperature_method):
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    lp.patch(model, temperature_method, layers=[0, 2], init=0.1)
    with torch.no_grad():
        model.model.layers[2].self_attn.log_temp.normal_()
        x = _ids()
        ref = model(x).logits
    lp.save_patched(model, tmp_path)
    sd = load_file(str(tmp_path / "longctx_patch.safetensors"))
    assert sorted(sd) == ["layers.0.log_temp", "layers.2.log_temp"]
    loaded = lp.load_patched(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, ref)
    # mis-shaped, missing and unexpected keys are all listed
    sd["layers.0.log_temp"] = torch.zeros(3)
    del sd["layers.2.log_temp"]
    sd["layers.1.bogus"] = torch.zeros(1)
    save_file(sd, str(tmp_path / "longctx_patch.safetensors"))
    with pytest.raises(lp.CheckpointError) as e:
        lp.load_patched(tmp_path)
    msg = str(e.value)
    assert "missing keys: ['layers.2.log_temp']" in msg
    assert "unexpected keys: ['layers.1.bogus']" in msg
    assert "layers.0.log_temp: expected (4, 1, 1), got (3,)" in msg


def test_load_patched_rejects_foreign_directories(tmp_path, tiny_llama):
    with pytest.raises(lp.CheckpointError, match="not written by save_patched"):
        lp.load_patched(tmp_path)
    plain = tmp_path / "plain"  # what Trainer.save_model writes: a plain checkpoint, no patch record
    tiny_llama.save_pretrained(plain)
    with pytest.raises(lp.CheckpointError, match=r"plain HF checkpoint.*save_patched\(trainer.model, DIR\)"):
        lp.load_patched(plain)
    (tmp_path / "longctx_patch.json").write_text("{not json")
    with pytest.raises(lp.CheckpointError, match="not valid JSON"):
        lp.load_patched(tmp_path)


def test_cache_is_created_for_plain_forward_and_generate(tiny_llama):
    lp.patch(tiny_llama, "sliding-window", window=6)
    x = _ids(1, 20)
    out = tiny_llama(x, use_cache=True)
    cache = out.past_key_values
    assert isinstance(cache, lp.LongctxCache)
    assert cache.layers[0].keys.shape[2] == 6  # a ring of window slots
    assert cache.get_seq_length() == 20
    # a non-empty foreign cache is refused with a clear message
    from transformers import DynamicCache

    lp.unpatch(tiny_llama)
    foreign = tiny_llama(x, use_cache=True).past_key_values
    assert type(foreign) is DynamicCache
    lp.patch(tiny_llama, "sliding-window", window=6)
    with pytest.raises(lp.ConfigError, match="pass no cache"):
        tiny_llama(x[:, -1:], past_key_values=foreign, use_cache=True)


def test_peft_lora_on_patched_model_and_unpatch_keeps_adapters():
    from peft import LoraConfig

    from conftest import get_peft_model

    model = tiny_model("llama")
    lp.patch(model, "sliding-window", window=8)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    x = _ids(2, 30)
    out = pm(input_ids=x, labels=x, use_cache=False)
    out.loss.backward()
    lora_grads = [n for n, p in pm.named_parameters() if p.requires_grad and p.grad is not None]
    assert len(lora_grads) == 3 * 4 * 2  # 3 layers x q/k/v/o x (A, B)
    g = pm.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert g.shape == (2, 34)
    lp.unpatch(pm)
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"
    assert type(model.model.layers[0].self_attn.q_proj).__module__.startswith("peft")


def test_op_level_entry_point_of_every_method():
    """`Method.module_cls.op` (used by `longctx eval speed --op`) runs every registered method on plain tensors."""
    from longctx_patch.methods import get_method, list_methods
    from longctx_patch.kernels.softmax import softmax_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 200, 64, generator=g)
    k = torch.randn(1, 2, 200, 64, generator=g)
    v = torch.randn(1, 2, 200, 64, generator=g)
    for name in list_methods():
        m = get_method(name)
        cfg = m.parse_config({"backend": "torch"} if any(f["name"] == "backend" for f in m.config_cls.describe()) else {})
        o = m.module_cls.op(q, k, v, scale=0.125, config=cfg)
        assert o.shape == (1, 200, 4, 64) and torch.isfinite(o).all(), name
    torch.testing.assert_close(get_method("exact").module_cls.op(q, k, v, scale=0.125, config=None),
                               softmax_attention(q, k, v, scale=0.125))


def test_save_patched_refuses_a_peft_model(tmp_path, tiny_llama):
    """PeftModel.save_pretrained writes only the adapter, so the directory could not be loaded back."""
    from peft import LoraConfig

    from conftest import get_peft_model

    lp.patch(tiny_llama, "sliding-window", window=4)
    pm = get_peft_model(tiny_llama, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(lp.ConfigError, match="merge_and_unload"):
        lp.save_patched(pm, tmp_path / "x")
    lp.save_patched(pm.merge_and_unload(), tmp_path / "y")
    assert lp.patched_layers(lp.load_patched(tmp_path / "y"))


@pytest.mark.parametrize("padded", [False, True])
def test_generate_reads_the_mask_once_not_per_decode_step(monkeypatch, padded):
    """The pre-hook reads the attention mask on the host at the prefill; decode steps reuse that reading (a read per
    step makes the host wait for the GPU's previous step)."""
    import longctx_patch.patcher as patcher

    model = lp.patch(tiny_model("llama"), "exact")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    if padded:
        am[1, :5] = 0
    with torch.no_grad():
        want = model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    reads = []
    real = patcher._read_mask
    monkeypatch.setattr(patcher, "_read_mask", lambda m: reads.append(1) or real(m))
    with torch.no_grad():
        got = model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    # generate() may drop a mask of ones before the model sees it: then nothing is read at all
    assert torch.equal(got, want)
    assert len(reads) == 1 if padded else len(reads) <= 1
    n = len(reads)
    with torch.no_grad():  # a plain forward still reads its mask
        model(ids, attention_mask=am)
    assert len(reads) == n + 1
