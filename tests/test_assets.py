"""Packaged linearized weights (`checkpoint=auto`), checkpoint folders with a PEFT adapter, unpatch after a merge."""

import json

import pytest
import torch

import longctx_patch as lp
from longctx_patch import assets
from longctx_patch.checkpoint import patch_record
from longctx_patch.patcher import method_state_dict, patch_groups, patched_modules

from conftest import REPO, TEST_DATA, tiny_model

ASSET = REPO / "longctx_patch" / "assets" / "smollm2-135m-instruct-lolcats"


def _record(model):
    """The patch record save_patched() writes for `model`."""
    return patch_record([g.to_record() for g in patch_groups(model)])


def _trained_run_dir(tmp_path, ids, seed=0):
    """A `trainable/` folder as `longctx finetune` writes it, from a tiny model: lolcats weights (perturbed
    away from the fresh init so that loading is visible) + a PEFT LoRA adapter with non-zero B.
    Returns (folder, the trained model's logits on `ids`)."""
    from peft import LoraConfig

    from conftest import get_peft_model
    from safetensors.torch import save_file

    model = tiny_model()
    lp.patch(model, "lolcats", checkpoint="none", window=4, chunk=4)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "feature_map" in n or "window_factors" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    d = tmp_path / "trainable"
    d.mkdir()
    save_file({k: v.contiguous() for k, v in method_state_dict(model).items()}, str(d / "longctx_patch.safetensors"))
    (d / "longctx_patch.json").write_text(json.dumps(_record(model)))
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(str(d / "adapter"))
    with torch.no_grad():
        return d, peft_model(ids).logits


def test_checkpoint_folder_with_adapter_matches_the_trained_model_and_unpatch_restores(tmp_path):
    ids = torch.randint(3, 128, (2, 23))
    d, want = _trained_run_dir(tmp_path, ids)

    model = tiny_model()
    with torch.no_grad():
        before = model(ids).logits
    lp.patch(model, "lolcats", checkpoint=str(d), window=4, chunk=4)
    assert patched_modules(model)[0].weights_source == f"checkpoint {d}"
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, before, atol=1e-3)
    # convert_to_lola keeps the merged LoRA (lambda = 0: the same model) and its unpatch still restores
    from longctx_patch.convert import convert_to_lola

    convert_to_lola(model, sparse_cache=0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    lp.unpatch(model)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(after, before), "unpatch() must put back the weights the LoRA delta was merged into"


def test_auto_picks_an_asset_only_for_its_model(tmp_path, monkeypatch):
    ids = torch.randint(3, 128, (1, 19))
    d, want = _trained_run_dir(tmp_path, ids)
    base = tiny_model()
    out = assets.write_asset(d, base, tmp_path / "assets" / "tiny", name="tiny", description="test",
                             dtype=torch.float32)
    info = json.loads((out / "asset.json").read_text())
    assert info["model_shape"]["num_hidden_layers"] == 3 and info["method_config"]["feature_dim"] == 64
    monkeypatch.setenv(assets.ENV_PATH, str(tmp_path / "assets"))
    assert assets.search_dirs() == [tmp_path / "assets", assets.PACKAGE_DIR]  # user folders win over packaged ones

    same = tiny_model()  # same seed: the same base model
    lp.patch(same, "lolcats", window=4, chunk=4)
    assert patched_modules(same)[0].weights_source.startswith("packaged asset tiny")
    with torch.no_grad():
        torch.testing.assert_close(same(ids).logits, want, rtol=1e-5, atol=1e-5)
    lp.unpatch(same)

    lola = tiny_model()
    lp.patch(lola, "lola", window=4, chunk=4, sparse_cache=0)  # lambda = 0: the same model as lolcats
    with torch.no_grad():
        torch.testing.assert_close(lola(ids).logits, want, rtol=1e-5, atol=1e-5)

    other = tiny_model(seed=1)  # same shape, other weights: the fingerprint does not match
    lp.patch(other, "lolcats", window=4, chunk=4)
    assert patched_modules(other)[0].weights_source.startswith("fresh feature maps")

    narrow = tiny_model()
    lp.patch(narrow, "lolcats", window=4, chunk=4, feature_dim=16)  # the asset's feature maps would not fit
    assert patched_modules(narrow)[0].weights_source.startswith("fresh feature maps")

    some = tiny_model()  # a subset of the layers takes the asset's weights for those layers
    lp.patch(some, "lolcats", layers=[1], window=4, chunk=4)
    assert patched_modules(some)[1].weights_source.startswith("packaged asset tiny")


def test_an_assets_measured_lola_defaults_apply_where_the_caller_sets_none(tmp_path, monkeypatch):
    """asset.json `method_defaults.lola` (what the asset's measurements chose, e.g. Qwen2.5-Coder's window, sparse cache
    and combination) are lola's options for the model the asset was trained for, under the caller's own; they reach
    the saved record; another checkpoint, another model and lolcats take none; a malformed entry is refused by name."""
    ids = torch.randint(3, 128, (1, 21))
    d, _ = _trained_run_dir(tmp_path, ids)
    out = assets.write_asset(d, tiny_model(), tmp_path / "assets" / "tiny", name="tiny", description="test",
                             dtype=torch.float32)
    info = json.loads((out / "asset.json").read_text())
    info["method_defaults"] = {"lola": {"window": 6, "sparse_cache": 5, "combine": "unshifted"}}
    (out / "asset.json").write_text(json.dumps(info))
    monkeypatch.setenv(assets.ENV_PATH, str(tmp_path / "assets"))

    def cfg(model, layer=0):
        c = patched_modules(model)[layer].method_config
        return c.window, c.sparse_cache, c.combine

    m = tiny_model()
    lp.patch(m, "lola", chunk=4)
    assert cfg(m) == (6, 5, "unshifted")
    assert "measured lola defaults window=6, sparse_cache=5, combine=unshifted" in patched_modules(m)[0].weights_source
    with torch.no_grad():
        got = m(ids).logits
    want_cfg = dict(window=6, sparse_cache=5, combine="unshifted", chunk=4)
    assert _record(m)["config"] | want_cfg == _record(m)["config"]  # what save_patched writes
    lp.unpatch(m)
    lp.patch(m, "lola", checkpoint=str(out), **want_cfg)  # the same weights with the options spelt out
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, got, rtol=0, atol=0)
    lp.unpatch(m)

    lp.patch(m, "lola", chunk=4, window=3, combine="shifted")  # the caller's own options win, one by one
    assert cfg(m) == (3, 5, "shifted")
    lp.unpatch(m)
    lp.patch(m, "lola", chunk=4, checkpoint="none")  # another checkpoint: the config's own defaults
    assert cfg(m) == (64, 256, "shifted")
    lp.unpatch(m)
    lp.patch(m, "lolcats", chunk=4)  # the defaults are lola's alone
    assert patched_modules(m)[0].method_config.window == 64
    lp.unpatch(m)
    other = tiny_model(seed=1)  # a model the asset was not trained for
    lp.patch(other, "lola", chunk=4)
    assert cfg(other) == (64, 256, "shifted")

    info["method_defaults"] = {"lola": {"window": 0}}  # out of range: the option's own error
    (out / "asset.json").write_text(json.dumps(info))
    with pytest.raises(lp.ConfigError, match="window"):
        lp.patch(tiny_model(), "lola", chunk=4)
    info["method_defaults"] = {"lola": ["window", 6]}
    (out / "asset.json").write_text(json.dumps(info))
    with pytest.raises(lp.CheckpointError, match="method_defaults.lola"):
        lp.patch(tiny_model(), "lola", chunk=4)


def test_the_packaged_qwen_asset_records_its_training_and_measured_lola_defaults():
    """The shipped Qwen2.5-Coder-0.5B linearization: its record (the LoRA under lola, twice continued, from the 40M-token
    linearization at the end of its based_on chain: tokens, corpus mix, steps, commit of each) and lola's measured
    defaults, each a valid option, with the results they were chosen and judged on committed."""
    from longctx_patch.methods.lola import LolaConfig

    info = json.loads((REPO / "longctx_patch" / "assets" / "qwen2.5-coder-0.5b-instruct-lolcats" / "asset.json").read_text())
    assert info["model_shape"]["model_type"] == "qwen2" and info["model_shape"]["num_hidden_layers"] == 24
    prev = info["based_on"]
    t, t_prev, base = info["training"], prev["training"], prev["based_on"]["training"]
    assert info["recipe"] == prev["recipe"] == "recipes/linearize-qwen-lola.yaml"
    assert prev["based_on"]["recipe"] == "recipes/linearize-qwen.yaml"
    for rec, steps in ((t, 44), (t_prev, 27)):
        assert rec["stages"][0]["trainable"] == ["lora"] and rec["steps"] == steps and rec["tokens"] == steps * 16384
    assert base["tokens"] >= 40_000_000 and base["steps"] == 612
    for rec, sets in ((t, ("train-b",)), (t_prev, ("train-b",)), (base, ("train-a", "train-b"))):
        assert rec["commit"] and rec["date"].startswith("2026") and (REPO / rec["result"]).is_file()
        for name in sets:
            kinds = rec["text"]["sets"][name]["kinds"]
            assert kinds["code"] > 0 and kinds["prose"] > 0
    assert "/tmp/" not in info["description"]
    cfg = LolaConfig.from_dict(info["method_defaults"]["lola"])
    assert (cfg.window, cfg.sparse_cache, cfg.combine) == (1024, 1024, "unshifted")
    for f in ("ppl/qwen2.5-coder-0.5b-linearized-lola-sweep2-prose-h100.json",
              "niah/qwen2.5-coder-0.5b-linearized-lola-sweep2-niah-h100.json",
              "ppl/qwen2.5-coder-0.5b-lola-tuned2-heldout-code-h100.json",
              "ppl/qwen2.5-coder-0.5b-lola-tuned2-heldout-prose-h100.json",
              "niah/qwen2.5-coder-0.5b-lola-tuned2-niah-h100.json"):
        assert (REPO / "benchmarks" / "results" / f).is_file()
    assert "qwen2.5-coder-0.5b-lola-tuned2-heldout-{code,prose}-h100.json" in info["method_defaults_why"]


def test_write_asset_of_a_two_group_hybrid(tmp_path, monkeypatch):
    """A run patched in two groups (lolcats on layer 0, lola on layers 1-2) writes a multi-patch record; its weights
    make an asset that checkpoint=auto loads for every layer."""
    from safetensors.torch import save_file

    model = tiny_model()
    lp.patch(model, "lolcats", layers=[0], checkpoint="none", window=4, chunk=4)
    lp.patch(model, "lola", layers=[1, 2], checkpoint="none", window=4, chunk=4, sparse_cache=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "feature_map" in n or "window_factors" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    trained = {k: v.clone() for k, v in method_state_dict(model).items()}
    d = tmp_path / "trainable"
    d.mkdir()
    save_file(trained, str(d / "longctx_patch.safetensors"))
    rec = _record(model)
    assert [p["method"] for p in rec["patches"]] == ["lolcats", "lola"]
    (d / "longctx_patch.json").write_text(json.dumps(rec))

    out = assets.write_asset(d, tiny_model(), tmp_path / "assets" / "hybrid", name="hybrid", description="test",
                             dtype=torch.float32)
    info = json.loads((out / "asset.json").read_text())
    assert info["method_config"] == {"window": 4, "feature_dim": 64, "affine_factors": rec["patches"][0]["config"]
                                     ["affine_factors"]}
    monkeypatch.setenv(assets.ENV_PATH, str(tmp_path / "assets"))
    same = tiny_model()
    lp.patch(same, "lolcats", window=4, chunk=4)
    assert patched_modules(same)[2].weights_source.startswith("packaged asset hybrid")
    got = method_state_dict(same)
    assert sorted(got) == sorted(trained)
    for k in trained:
        assert torch.equal(got[k], trained[k]), k

    # a second group of another method is refused, naming both; so are groups of different feature_dim
    rec["patches"][1]["method"] = "sliding-window"
    (d / "longctx_patch.json").write_text(json.dumps(rec))
    with pytest.raises(lp.CheckpointError, match=r"\['lolcats', 'sliding-window'\]; assets hold lolcats/lola"):
        assets.write_asset(d, tiny_model(), tmp_path / "x", name="x", description="x")
    rec["patches"][1].update(method="lola", config={**rec["patches"][1]["config"], "feature_dim": 16})
    (d / "longctx_patch.json").write_text(json.dumps(rec))
    with pytest.raises(lp.CheckpointError, match=r"feature_dim \[16, 64\]; an asset holds feature maps of one"):
        assets.write_asset(d, tiny_model(), tmp_path / "x", name="x", description="x")
    (d / "longctx_patch.json").write_text("[1, 2]")  # a damaged record: the patcher's reader says so
    with pytest.raises(lp.CheckpointError, match="not the object save_patched"):
        assets.write_asset(d, tiny_model(), tmp_path / "x", name="x", description="x")


def test_write_asset_refuses_other_methods(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "longctx_patch.safetensors").write_bytes(b"")
    (d / "longctx_patch.json").write_text(json.dumps({"method": "ovq", "config": {}, "layers": [0]}))
    with pytest.raises(lp.CheckpointError, match="lolcats/lola weights only"):
        assets.write_asset(d, tiny_model(), tmp_path / "out", name="x", description="x")


def test_packaged_asset_is_found_for_the_embedded_model_and_is_trained(smollm2):
    """The shipped SmolLM2 asset: found by checkpoint=auto, close to the original model on held-out text
    at 768 tokens, far better than fresh feature maps, and unpatch is exact."""
    model, tok = smollm2
    assert (ASSET / "asset.json").exists() and (ASSET / "adapter" / "adapter_config.json").exists()
    # held out of the asset's training text (tests/data/README.md)
    essay = (TEST_DATA / "pg_essays_heldout" / "love.txt").read_text()
    ids = tok(essay, return_tensors="pt").input_ids[:, :768]
    with torch.no_grad():
        ref = model(ids, labels=ids)
    losses = {}
    for ck in ("auto", "none"):
        lp.patch(model, "lola", checkpoint=ck, window=64, sparse_cache=64)
        src = patched_modules(model)[0].weights_source
        assert src.startswith("packaged asset" if ck == "auto" else "fresh feature maps"), src
        with torch.no_grad():
            losses[ck] = model(ids, labels=ids).loss.item()
        lp.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref.logits)
    base = ref.loss.item()
    assert losses["auto"] < base + 0.2, (losses, base)  # measured: +0.07 nats at 768 tokens (fresh maps: +1.96)
    assert losses["none"] > losses["auto"] + 1.0, (losses, base)


def test_generate_cli_runs_lola_on_the_embedded_model(tmp_path):
    from click.testing import CliRunner

    from longctx_patch.cli.main import main

    prompt = tmp_path / "essay.txt"
    prompt.write_text((TEST_DATA / "pg_essays" / "avg.txt").read_text()[:3000] + "\n\nSummarise the essay in one sentence.")
    res = CliRunner().invoke(main, ["generate", "--model", "smollm2-135m", "--method", "lola", "--prompt-file",
                                   str(prompt), "--max-new-tokens", "8", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "method weights: packaged asset smollm2-135m-instruct-lolcats" in res.output, res.output


def test_the_asset_methods_are_those_of_the_lolcats_layout():
    """assets/ lies below the methods and names the methods whose weights it holds; they are the methods that declare
    LoLCATs' parameters (`Method.lolcats_layout`), and lola is made from them in place (`Method.converts_from`)."""
    layout = {m for m in lp.list_methods() if lp.get_method(m).lolcats_layout}
    assert set(assets.LOLCATS_LAYOUT) == layout
    assert set(lp.get_method("lola").converts_from) <= layout
