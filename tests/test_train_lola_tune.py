"""recipes/linearize-qwen-lola.yaml's way on a tiny random qwen2 (14 query heads over 2 kv heads, as Qwen2.5-Coder-0.5B):
a packaged lolcats asset (feature maps and window factors off their fresh values, a PEFT LoRA adapter with non-zero
A and B, measured lola defaults) is what `checkpoint: auto` finds; a `lola` next-token stage with `lora.init:
checkpoint` takes its adapter back out of the projections the patch merged it into and trains it on from its values,
the feature maps frozen; the run packaged on top of the asset loads back (checkpoint=auto and by path) to the trained
model's logits. A stop and `--resume` redo the same start, and the settings that cannot continue an adapter are
refused by name."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
import yaml

import longctx_patch as lp
from longctx_patch.assets import ENV_PATH, write_asset
from longctx_patch.assets.training import ASSET_NAMES, package_run
from longctx_patch.checkpoint import read_adapter_weights, read_method_weights, write_patch
from longctx_patch.errors import CheckpointError, ConfigError
from longctx_patch.patcher import method_state_dict, patch_groups, patched_modules

from conftest import REPO, get_peft_model, tiny_model
from test_train import TEXT, byte_tokenizer

NAME = ASSET_NAMES["qwen2.5-coder-0.5b"]
RECIPE = REPO / "recipes" / "linearize-qwen-lola.yaml"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
OPTS = dict(window=8, sparse_cache=8, combine="unshifted", chunk=4, feature_dim=8)  # the recipe's, shrunk
DEFAULTS = {"lola": {"window": 8, "sparse_cache": 8, "combine": "unshifted"}}


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one intra-op thread


def tiny_qwen():
    return tiny_model("qwen2", vocab_size=300, hidden_size=112, num_attention_heads=14, num_key_value_heads=2,
                      num_hidden_layers=2, intermediate_size=64, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen")
    tiny_qwen().save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "book.txt"
    p.write_text(TEXT * 12)
    return p


@pytest.fixture(scope="module")
def asset(tmp_path_factory):
    """The tiny model's asset as the shipped Qwen one is made: lolcats (window 8) feature maps and window factors, a
    LoRA adapter (r 4, alpha 8, q/k/v/o), measured lola defaults; float32 so that values compare exactly."""
    from peft import LoraConfig

    tmp = tmp_path_factory.mktemp("asset")
    model = tiny_qwen()
    lp.patch(model, "lolcats", checkpoint="none", window=8, chunk=4, feature_dim=8)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "feature_map" in n or "window_factors" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    tdir = tmp / "run" / "trainable"
    peft_model.save_pretrained(str(tdir / "adapter"))
    write_patch(tdir, [gr.to_record() for gr in patch_groups(model)], method_state_dict(model))
    return write_asset(tdir, tiny_qwen(), tmp / "assets" / NAME, name=NAME, description="the tiny asset",
                       dtype=torch.float32, extra={"commit": "abc1234", "recipe": "recipes/linearize-qwen.yaml",
                                                   "training": {"tokens": 123}, "method_defaults": DEFAULTS,
                                                   "method_defaults_why": "chosen on a sweep"})


def overrides(model_dir, text_file, *more):
    """The recipe on the tiny model: its options and the asset's LoRA shrunk, 3 steps of 2 x 48 tokens."""
    return [f"model={model_dir}", f"data.text={text_file}", "data.eval_fraction=0.1",
            *(f"method_config.{k}={v}" for k, v in OPTS.items()),
            "stages.lola_16k.lora.r=4", "stages.lola_16k.lora.alpha=8", "stages.*.seq_len=48",
            "stages.*.batch_size=2", "stages.*.steps=3", "stages.*.warmup=1", "stages.*.lr=1e-2",
            "stages.*.log_every=1", "stages.*.eval_every=3", "stages.*.eval_batches=1", "stages.*.save_every=0", *more]


def logits(model, ids):
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    model.train(was)
    return out


def asset_patched(checkpoint, **kw):
    """A fresh tiny model patched with lola and `checkpoint` (the adapter merged, as users get it)."""
    m = tiny_qwen()
    lp.patch(m, "lola", checkpoint=str(checkpoint), **{**OPTS, **kw})
    return m


def test_the_recipe_validates_and_dry_runs(monkeypatch):
    from click.testing import CliRunner

    from longctx_patch.cli.main import main
    from longctx_patch.train import load_recipe

    r = load_recipe(RECIPE)
    assert r.method == "lola" and r.method_config == {"window": 1024, "sparse_cache": 1024, "combine": "unshifted",
                                                      "checkpoint": "auto"}
    (st,) = r.stages
    assert (st.objective, st.trainable, st.seq_len) == ("next_token", ["lora"], 16384)
    assert (st.lora.r, st.lora.alpha, sorted(st.lora.targets), st.lora.init) == (8, 16.0, sorted(TARGETS), "checkpoint")
    monkeypatch.chdir(REPO)
    res = CliRunner().invoke(main, ["finetune", str(RECIPE), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "lola_16k" in res.output and "init: checkpoint" in res.output


def test_the_stage_starts_from_the_assets_adapter(model_dir, text_file, asset, tmp_path, monkeypatch):
    """Before the first step: the projections are the base model's again, the adapter holds the asset's A and B, only
    LoRA trains, and the model computes what the asset patched as users get it computes."""
    from longctx_patch.train import Finetuner, load_recipe

    monkeypatch.setenv(ENV_PATH, str(asset.parent))
    r = load_recipe(RECIPE, overrides(model_dir, text_file))
    ft = Finetuner(r, tmp_path / "o", progress=False)
    ft.load()
    base = tiny_qwen()
    for layer, orig in zip(ft.model.model.layers, base.model.layers):
        for n in TARGETS:
            assert torch.equal(getattr(layer.self_attn, n).weight, getattr(orig.self_attn, n).weight)
    params = dict(ft.setup_stage(r.stages[0]))
    assert params and all("lora_" in n for n in params)
    assert len(params) == 2 * len(TARGETS) * 2  # 2 layers x 4 projections x (A, B)
    saved = read_adapter_weights(asset)
    assert len(saved) == len(params)
    for k, v in saved.items():
        assert torch.equal(params[k.replace(".weight", ".default.weight")].detach(), v), k
    assert patched_modules(ft.model)[0].weights_source.startswith(f"packaged asset {NAME} ({asset})")
    ids = torch.randint(3, 259, (1, 40))
    torch.testing.assert_close(logits(ft.root, ids), logits(asset_patched(asset), ids), rtol=1e-5, atol=1e-5)


def test_the_adapter_trains_on_and_the_packaged_result_loads(model_dir, text_file, asset, tmp_path, monkeypatch):
    from longctx_patch.train import Finetuner, apply_trained, load_recipe

    monkeypatch.setenv(ENV_PATH, str(asset.parent))
    out = tmp_path / "run"
    ft = Finetuner(load_recipe(RECIPE, overrides(model_dir, text_file)), out, progress=False)
    log = ft.run()
    (st,) = log["stages"]
    assert st["trainable"] == ["lora"] and st["steps_done"] == 3
    assert math.isfinite(st["first_loss"]) and math.isfinite(st["final_loss"])
    assert [e[0] for e in st["eval_loss"]] == [0, 3] and all(math.isfinite(e[1]) for e in st["eval_loss"])
    assert log["weights_source"][0].startswith(f"packaged asset {NAME} ({asset})")
    start, end = read_adapter_weights(asset), read_adapter_weights(out / "trainable")
    assert start.keys() == end.keys()
    assert all(not torch.equal(start[k], end[k]) for k in start if "lora_B" in k)  # every B moved
    frozen = read_method_weights(asset)
    assert all(torch.equal(frozen[k], v) for k, v in read_method_weights(out / "trainable").items())
    ids = torch.randint(3, 259, (1, 40))
    trained = logits(ft.root, ids)
    assert not torch.allclose(trained, logits(asset_patched(asset), ids), atol=1e-4)
    torch.testing.assert_close(logits(apply_trained(tiny_qwen(), out), ids), trained, rtol=1e-5, atol=1e-5)

    new = package_run(out, tiny_qwen(), tmp_path / "new" / NAME, name=NAME, description="tuned",
                      dtype=torch.float32, extra={"recipe": "recipes/linearize-qwen-lola.yaml"}, based_on=asset)
    info = json.loads((new / "asset.json").read_text())
    assert info["based_on"]["name"] == NAME and info["based_on"]["commit"] == "abc1234"
    assert info["based_on"]["training"] == {"tokens": 123} and info["training"]["tokens"] == st["tokens"]
    assert info["method_defaults"] == DEFAULTS and info["method_defaults_why"].startswith("carried over from the asset")
    # by path, and by checkpoint=auto ahead of the asset it continued (its lola defaults carried over)
    torch.testing.assert_close(logits(asset_patched(new), ids), trained, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(ENV_PATH, str(new.parent) + os.pathsep + str(asset.parent))
    auto = tiny_qwen()
    lp.patch(auto, "lola", chunk=4, feature_dim=8)
    assert patched_modules(auto)[0].weights_source.startswith(f"packaged asset {NAME} ({new}); its measured lola")
    torch.testing.assert_close(logits(auto, ids), trained, rtol=1e-5, atol=1e-5)


TRANSFER = REPO / "recipes" / "linearize-qwen-lola-transfer.yaml"


def test_the_maps_transfer_under_lola_and_ship_with_the_assets_adapter(model_dir, text_file, asset, tmp_path,
                                                                       monkeypatch):
    """recipes/linearize-qwen-lola-transfer.yaml on the tiny asset: the feature maps and window factors train by
    attention transfer under lola while the asset's LoRA stays merged and frozen; the run packaged on top of the
    asset keeps that adapter, and loads back to the trained model's logits."""
    from longctx_patch.train import Finetuner, load_recipe

    r = load_recipe(TRANSFER)
    (st,) = r.stages
    assert (r.method, st.name, st.objective, st.trainable, st.seq_len) == (
        "lola", "lola_16k", "attention_transfer", ["method"], 16384)
    assert r.method_config == {"window": 1024, "sparse_cache": 1024, "combine": "unshifted", "checkpoint": "auto"}
    monkeypatch.setenv(ENV_PATH, str(asset.parent))
    more = [o for o in overrides(model_dir, text_file) if not o.startswith("stages.lola_16k.lora")]
    out = tmp_path / "run"
    ft = Finetuner(load_recipe(TRANSFER, more), out, progress=False)
    log = ft.run()
    (st,) = log["stages"]
    assert st["trainable"] == ["method"] and st["steps_done"] == 3
    assert math.isfinite(st["first_loss"]) and math.isfinite(st["final_loss"])
    start, end = read_method_weights(asset), read_method_weights(out / "trainable")
    assert start.keys() == end.keys() and any(not torch.equal(start[k], end[k]) for k in start)
    assert not (out / "trainable" / "adapter").exists()
    ids = torch.randint(3, 259, (1, 40))
    trained = logits(ft.root, ids)
    new = package_run(out, tiny_qwen(), tmp_path / "new" / NAME, name=NAME, description="transferred",
                      dtype=torch.float32, extra={"recipe": "recipes/linearize-qwen-lola-transfer.yaml"},
                      based_on=asset)
    theirs, ours = read_adapter_weights(asset), read_adapter_weights(new)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    torch.testing.assert_close(logits(asset_patched(new), ids), trained, rtol=1e-5, atol=1e-5)


def test_the_package_command_continues_the_lineage_and_checks_its_own_asset(model_dir, text_file, asset, tmp_path,
                                                                           monkeypatch, capsys):
    """`python -m longctx_patch.train.package RUN --based-on ASSET --check`: the new asset, of the same name as the
    one it continues, is the one checkpoint=auto loads back."""
    from longctx_patch.train import Finetuner, load_recipe
    from longctx_patch.train import package

    monkeypatch.setenv(ENV_PATH, str(asset.parent))
    run = tmp_path / "run"
    Finetuner(load_recipe(RECIPE, overrides(model_dir, text_file, "stages.*.steps=1", "stages.*.eval_every=0")),
              run, progress=False).run()
    out = tmp_path / "out"
    assert package.main([str(run), "--model", str(model_dir), "--out", str(out), "--name", NAME, "--recipe",
                         "recipes/linearize-qwen-lola.yaml", "--based-on", str(asset), "--check"]) == 0
    said = capsys.readouterr().out
    assert f"packaged asset {NAME} ({(out / NAME).resolve()})" in said
    info = json.loads((out / NAME / "asset.json").read_text())
    assert info["description"].startswith(f"the asset {NAME} (its record: based_on) with its training continued by "
                                          "recipes/linearize-qwen-lola.yaml on ")
    assert str(model_dir) not in info["description"]  # the folder the model was read from says nothing to a user
    assert info["method_defaults"] == DEFAULTS and info["based_on"]["recipe"] == "recipes/linearize-qwen.yaml"


def test_a_resumed_run_starts_from_the_same_adapter(model_dir, text_file, asset, tmp_path, monkeypatch):
    """Two stages, stopped after the first and resumed: the resumed run takes the adapter out of the projections
    again, redoes the first stage's start and loads what it trained: it ends where the uninterrupted run ends."""
    from longctx_patch.train import Finetuner, load_recipe, recipe_from_dict

    monkeypatch.setenv(ENV_PATH, str(asset.parent))
    raw = load_recipe(RECIPE, overrides(model_dir, text_file, "stages.*.steps=2", "stages.*.eval_every=0")).to_dict()
    second = {**copy.deepcopy(raw["stages"][0]), "name": "lola_more", "lora": {**raw["stages"][0]["lora"],
                                                                                "init": "fresh"}}
    raw["stages"].append(second)
    whole = Finetuner(recipe_from_dict(raw), tmp_path / "whole", progress=False)
    whole.run()
    Finetuner(recipe_from_dict(raw), tmp_path / "split", progress=False, stop_after="lola_16k").run()
    split = Finetuner(recipe_from_dict(raw), tmp_path / "split", progress=False, resume=True)
    split.run()
    a, b = read_adapter_weights(tmp_path / "whole" / "trainable"), read_adapter_weights(tmp_path / "split" / "trainable")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _raw(**kw):
    raw = yaml.safe_load(RECIPE.read_text())
    raw["stages"][0].update(kw.pop("stage", {}))
    raw.update(kw)
    return raw


@pytest.mark.parametrize("change,match", [
    ({"method_config": {"checkpoint": "none"}}, "method_config.checkpoint, which is none"),
    ({"method": "sliding-window", "method_config": {}}, "continues the LoRA adapter of the method's checkpoint"),
    ({"stage": {"trainable": ["method"], "objective": "attention_transfer"}}, "add lora to its trainable"),
    ({"stage": {"lora": {"init": "asset"}}}, r"lora.init: bad value 'asset'; allowed: 'fresh', 'checkpoint'"),
])
def test_recipes_that_cannot_continue_an_adapter_are_refused(change, match):
    from longctx_patch.train import recipe_from_dict

    with pytest.raises(ConfigError, match=match):
        recipe_from_dict(_raw(**change))


def test_a_later_stage_cannot_start_the_adapter():
    from longctx_patch.train import recipe_from_dict

    raw = _raw(stage={"lora": {"init": "fresh"}, "name": "first"})
    raw["stages"].append({**copy.deepcopy(raw["stages"][0]), "name": "second", "lora": {"init": "checkpoint"}})
    with pytest.raises(ConfigError, match=r"stages.1.lora.init: the adapter is added by the first LoRA stage "
                                          r"\('first', fresh\).*set stages.0.lora.init: checkpoint"):
        recipe_from_dict(raw)


def test_fresh_adapters_keep_the_fingerprint_checkpoints_were_written_with():
    """`init: fresh` (the default) is left out of the fingerprint: a run checkpointed before the key existed resumes."""
    import hashlib

    from longctx_patch.train import load_recipe

    r = load_recipe(REPO / "recipes" / "linearize-qwen.yaml")
    d = r.to_dict()
    old = {k: d[k] for k in ("model", "method", "method_config", "layers", "rest_method", "rest_config", "dtype")}
    old["stages"] = [{k: s[k] for k in ("name", "objective", "trainable", "lora", "batch_size", "seq_len", "grad_accum")}
                     for s in d["stages"]]
    for s in old["stages"]:
        if s["lora"] is not None:
            s["lora"] = {k: v for k, v in s["lora"].items() if k != "init"}
    want = hashlib.sha256(json.dumps(old, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert r.fingerprint() == want
    assert load_recipe(RECIPE).fingerprint() != load_recipe(RECIPE, ["stages.0.lora.init=fresh"]).fingerprint()


@pytest.mark.parametrize("more,error,match", [
    (["stages.lola_16k.lora.r=2"], ConfigError, r"continues the adapter of .*r 4.*the stage's lora block says r 2"),
    (["layers=[0]"], CheckpointError, r"covers layers \[1\], which are not patched"),
    ([], CheckpointError, "checkpoint=auto found no packaged asset for this model"),
])
def test_a_checkpoint_without_the_adapter_the_stage_continues_is_refused(model_dir, text_file, asset, tmp_path,
                                                                           monkeypatch, more, error, match):
    from longctx_patch.train import Finetuner, load_recipe

    if more:
        monkeypatch.setenv(ENV_PATH, str(asset.parent))
    else:
        monkeypatch.delenv(ENV_PATH, raising=False)
    r = load_recipe(RECIPE, overrides(model_dir, text_file, *more))
    ft = Finetuner(r, tmp_path / "o", progress=False)
    with pytest.raises(error, match=match):
        ft.load()
        ft.setup_stage(r.stages[0])
