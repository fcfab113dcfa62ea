"""The fine-tune runner (`longctx finetune`): recipes, data, the training loop, LoRA, checkpoints, resume."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from longctx_patch.errors import CheckpointError, ConfigError

# ----------------------------------------------------------------------------------------------- fixtures
pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one intra-op thread


TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair.\n"
)


def byte_tokenizer():
    """A byte-level tokenizer with 259 ids (3 specials + 256 bytes), no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (GQA 4/2 heads, 2 layers) with a byte tokenizer, saved as a local model dir."""
    from conftest import tiny_model

    d = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama", vocab_size=260, num_hidden_layers=2)
    model.save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "book.txt"
    p.write_text(TEXT * 12)  # ~3.9k bytes = ~3.9k tokens
    return p


# A real trainable method for the tests: exact attention with a learnable per-head inverse temperature,
# started away from 1 so that attention transfer has something to learn (the optimum is log_t = 0).
TEMP_METHOD = "test-temperature"


def register_temp_method() -> str:
    from longctx_patch.methods import base, list_methods
    from longctx_patch.methods.base import Method, MethodConfig, PatchedAttention, register_method
    from longctx_patch.kernels.softmax import key_mask_for, softmax_attention

    if TEMP_METHOD in base._REGISTRY:
        return TEMP_METHOD

    @dataclass
    class TempConfig(MethodConfig):
        init: float = base.option(0.5, "initial log inverse temperature")
        noise: float = base.option(0.0, "training forwards scale the queries by 1 + noise * N(0, 1) (draws from the "
                                        "RNG, as a dropout would)", min=0.0)

    class TempAttention(PatchedAttention):
        method_name = TEMP_METHOD

        def __init__(self, orig, spec, config, adapter):
            super().__init__(orig, spec, config, adapter)
            self.log_t = nn.Parameter(torch.full((spec.num_heads,), float(config.init)))

        def attend(self, q, k, v, cache_layer, padding):
            if cache_layer is not None:
                k, v = cache_layer.update(k, v)
            q = q * self.log_t.exp().to(q.dtype)[None, :, None, None]
            if self.training and self.method_config.noise:
                q = q * (1 + self.method_config.noise * torch.randn_like(q))
            return softmax_attention(q, k, v, scale=self.scaling, key_mask=key_mask_for(padding, k.shape[2]))

    class TempMethod(Method):
        name = TEMP_METHOD
        description = "exact attention with a learnable per-head temperature (tests only)"
        config_cls = TempConfig
        module_cls = TempAttention

        def attention_profile(self, config, head_dim, seq_len, kernels):  # the fine-tune's plan asks (exact's)
            return seq_len / 2, 4 * head_dim

    list_methods()  # load the built-ins first
    register_method(TempMethod)
    return TEMP_METHOD


@pytest.fixture(scope="module")
def temp_method():
    from longctx_patch.methods import base

    yield register_temp_method()
    base._REGISTRY.pop(TEMP_METHOD, None)


def recipe_dict(model_dir, text, method="test-temperature", **stage_kw):
    transfer = dict(
        name="transfer", objective="attention_transfer", lr=5e-2, steps=6, batch_size=4, seq_len=64, warmup=1,
        schedule="constant", log_every=1, eval_every=3, eval_batches=1, save_every=0,
    )
    lora = dict(
        name="lora", objective="next_token", lora={"r": 4, "alpha": 8, "dropout": 0.1}, lr=1e-2, steps=4,
        batch_size=4, seq_len=64, warmup=0, schedule="cosine", log_every=1, eval_every=0, eval_batches=1,
    )
    transfer.update(stage_kw.pop("transfer", {}))
    lora.update(stage_kw.pop("lora", {}))
    return {
        "model": str(model_dir),
        "method": method,
        "method_config": {},
        "seed": 3,
        "data": {"text": str(text), "eval_fraction": 0.1},
        "stages": [transfer, lora],
        "output": {"keep_checkpoints": 0},
    }


def write_recipe(path: Path, d: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(d))
    return path


# ----------------------------------------------------------------------------------------------- recipes
REPO = Path(__file__).resolve().parent.parent


def test_linearize_extend_recipe_continues_from_trained_weights():
    from longctx_patch.train import load_recipe

    r = load_recipe(REPO / "recipes" / "linearize-extend.yaml")
    assert [s.objective for s in r.stages] == ["attention_transfer"] and r.stages[0].trainable == ["method"]
    assert r.stages[0].seq_len == 4096 and r.method == "lolcats" and r.method_config == {"checkpoint": "auto"}
    assert load_recipe(REPO / "recipes" / "linearize-extend.yaml", ["method_config.checkpoint=/x"]).method_config == {
        "checkpoint": "/x"}


def test_linearize_recipe_is_valid_and_overridable():
    from longctx_patch.train import load_recipe

    r = load_recipe(REPO / "recipes" / "linearize.yaml")
    assert [s.objective for s in r.stages] == ["attention_transfer", "next_token"]
    assert r.method == "lolcats"
    t, l = r.stages
    assert t.trainable == ["method"] and t.lr == pytest.approx(1e-2) and t.seq_len == 1024
    assert l.trainable == ["lora"] and l.lora.r == 8 and l.lora.alpha == 16
    assert l.lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
    r2 = load_recipe(
        REPO / "recipes" / "linearize.yaml",
        ["stages.0.lr=1e-3", "stages.lora.steps=7", "stages.*.seq_len=128", "method_config.window=32",
         "data.text=/x", "layers=[0, 2]"],
    )
    assert r2.stages[0].lr == pytest.approx(1e-3) and r2.stages[1].steps == 7
    assert [s.seq_len for s in r2.stages] == [128, 128]
    assert r2.method_config == {"window": 32, "init_window_factor": -2.197, "checkpoint": "none"} and r2.data.text == "/x" and r2.layers == [0, 2]
    assert r2.fingerprint() != r.fingerprint()
    assert load_recipe(REPO / "recipes" / "linearize.yaml", ["stages.0.lr=5e-3"]).fingerprint() == r.fingerprint()


@pytest.mark.parametrize(
    "override, words",
    [
        ("stages.0.lrr=1", "stages.0.lrr"),
        ("bogus=1", "bogus"),
        ("stages.0.objective=distill", "attention_transfer"),
        ("stages.1.trainable=[lora, full]", "exclude"),
        ("stages.0.steps=0", ">= 1"),
        ("stages.0.lr=-1", "lr"),
        ("stages.0.warmup=-1", "warmup"),
        ("stages.nosuch.lr=1", "no entry named"),
        ("stages.9.lr=1", "out of range"),
        ("method=none", "attention_transfer"),
        ("data.dataset=x", "both set"),
        ("stages.0.schedule=step", "cosine"),
        ("layers=abc", "layer indices"),
        ("stages.1.lora.targets=[]", "targets"),
        ("noequals", "KEY=VALUE"),
    ],
)
def test_recipe_errors_name_the_key(override, words):
    from longctx_patch.train import load_recipe

    extra = ["data.text=/x"] if "dataset" in override else []
    with pytest.raises(ConfigError, match=None) as e:
        load_recipe(REPO / "recipes" / "linearize.yaml", extra + [override])
    assert words in str(e.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("stages.0.lr=.nan", "stages.0.lr: nan is not a finite number; allowed: a number > 0"),
        ("stages.0.lr=.inf", "stages.0.lr: inf is not a finite number; allowed: a number > 0"),
        ("stages.0.lr=nan", "stages.0.lr: nan is not a finite number"),  # the string form too
        ("stages.0.method_lr=-.inf", "stages.0.method_lr: -inf is not a finite number; allowed: a number > 0 or null"),
        ("stages.0.weight_decay=.nan", "stages.0.weight_decay: nan is not a finite number; allowed: a number >= 0.0"),
        ("stages.0.betas=[.nan, 0.999]", "stages.0.betas: nan is not a finite number; allowed: a number in 0.0..0.999999"),
        ("stages.0.min_lr_ratio=.nan", "stages.0.min_lr_ratio: nan is not a finite number"),
        ("stages.0.max_grad_norm=.inf", "stages.0.max_grad_norm: inf is not a finite number"),
        ("stages.0.max_time_s=.inf", "stages.0.max_time_s: inf is not a finite number; allowed: a number >= 0.0 or null"),
        ("stages.1.lora.alpha=.inf", "stages.1.lora.alpha: inf is not a finite number"),
        ("stages.1.lora.dropout=.nan", "stages.1.lora.dropout: nan is not a finite number"),
        ("data.eval_fraction=.nan", "data.eval_fraction: nan is not a finite number"),
        ("stages.0.steps=.nan", "stages.0.steps: expected int, got nan"),
        ("stages.0.steps=100000000000000000000", "stages.0.steps: 100000000000000000000 is too large; must be <= "
                                                 "2147483647 (2**31 - 1)"),
        ("stages.0.seq_len=1.0e+30", "stages.0.seq_len: 1e+30 is too large; must be <= 2147483647"),
        ("stages.1.lora.r=4294967296", "stages.1.lora.r: 4294967296 is too large"),
        ("seed=99999999999", "seed: 99999999999 is too large"),
        ("data.max_tokens=100000000000000000000", "data.max_tokens: 100000000000000000000 is too large; must be <= "
                                                  "9223372036854775807 (2**63 - 1"),
        ("method_config.window=.nan", "method: LolcatsConfig: bad value nan for window"),
        ("method_config.lora_alpha=.inf", "method: LolcatsConfig: lora_alpha=inf is not a finite number"),
    ],
)
def test_recipe_refuses_non_finite_and_overflowing_values(override, message):
    from longctx_patch.train import load_recipe

    with pytest.raises(ConfigError) as e:
        load_recipe(REPO / "recipes" / "linearize.yaml", [override])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_nan_lr_fails_the_dry_run_and_the_run_before_any_model_loads(tmp_path):
    from click.testing import CliRunner

    from longctx_patch.cli.finetune_cmd import finetune_cmd

    raw = (REPO / "recipes" / "linearize.yaml").read_text()
    assert "lr: 1.0e-2" in raw
    rec = tmp_path / "nan.yaml"
    rec.write_text(raw.replace("lr: 1.0e-2", "lr: .nan", 1))
    plan = CliRunner().invoke(finetune_cmd, [str(rec), "--dry-run"])
    assert plan.exit_code != 0 and "stages.0.lr: nan is not a finite number" in plan.output, plan.output
    assert "# total tokens" not in plan.output
    # a model that does not exist: the recipe is refused before the load is tried
    run = CliRunner().invoke(finetune_cmd, [str(rec), "--model", str(tmp_path / "no-model"), "--output", str(tmp_path / "o")])
    assert run.exit_code != 0 and "stages.0.lr: nan is not a finite number" in run.output, run.output
    assert not (tmp_path / "o").exists()


def test_recipe_missing_file_and_no_stages(tmp_path):
    from longctx_patch.train import load_recipe

    with pytest.raises(ConfigError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="no stages"):
        load_recipe(write_recipe(tmp_path / "r.yaml", {"model": "m"}))


# ----------------------------------------------------------------------------------------------- data
def test_text_dir_reading_packing_and_order(tmp_path):
    from longctx_patch.train.data import BatchOrder, local_slice, make_packed, read_text_documents, text_files, tokenize_documents

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "sub" / "b.py").write_text("def f():\n    return 1\n" * 10)
    (tmp_path / "c.bin").write_bytes(b"\x00\x01" * 10)
    (tmp_path / "d.txt").write_bytes(b"abc\x00def")  # binary content with a text suffix
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "e.txt").write_text("secret")
    files = text_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a.txt", "sub/b.py"]
    docs = read_text_documents(tmp_path)
    tok = byte_tokenizer()
    ids = tokenize_documents(docs, tok)
    # every document ends with EOS and the stream is the concatenation
    assert ids.numel() == sum(len(tok(d)["input_ids"]) + 1 for d in docs)
    assert (ids == tok.eos_token_id).sum() == 2
    data = make_packed(ids, 32, eval_fraction=0.2)
    n = ids.numel() // 32
    assert data.train.shape[1] == 32 and data.train.shape[0] + data.eval.shape[0] == n
    assert data.eval.shape[0] == round(n * 0.2)
    assert torch.equal(torch.cat([data.train, data.eval]).flatten(), ids[: n * 32])
    assert tokenize_documents(docs, tok, max_tokens=100).numel() == 100
    # documents are tokenised in batches: the same stream as one at a time, across batch boundaries and with a stop
    many = [f"doc {i} " * (1 + i % 7) for i in range(150)]
    one_by_one = torch.cat([torch.tensor(tok(d)["input_ids"] + [tok.eos_token_id]) for d in many])
    assert torch.equal(tokenize_documents(many, tok), one_by_one)
    assert torch.equal(tokenize_documents(iter(many), tok, max_tokens=2000), one_by_one[:2000])
    with pytest.raises(ConfigError, match="seq_len"):
        make_packed(ids, 10_000, 0.0)

    order = BatchOrder(10, 4, seed=1)
    seen = [i for m in range(5) for i in order.indices(m)]  # 20 positions = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # a new permutation per epoch
    assert BatchOrder(10, 4, seed=1).indices(3) == order.indices(3)  # random access: exact resume
    b = torch.arange(8).view(4, 2)
    assert torch.equal(torch.cat([local_slice(b, r, 2) for r in range(2)]), b)
    with pytest.raises(ConfigError, match="divisible"):
        local_slice(b, 0, 3)
    with pytest.raises(ConfigError, match="no such file"):
        text_files(tmp_path / "missing")


def test_binary_training_text_is_refused_before_the_model_loads(tiny_dir, tmp_path):
    from click.testing import CliRunner

    from longctx_patch.cli.finetune_cmd import finetune_cmd

    binary = tmp_path / "x.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    d = recipe_dict(tmp_path / "no-model", tmp_path / "unused.txt", method=None)
    d["stages"] = d["stages"][1:]  # a next-token LoRA stage of the unpatched model
    rec = write_recipe(tmp_path / "r.yaml", d)
    r = CliRunner().invoke(finetune_cmd, [str(rec), "--text", str(binary), "--output", str(tmp_path / "o")])
    assert r.exit_code != 0
    assert f"error: --text {str(binary)!r}: {binary} is not text (a NUL byte at offset 0)" in r.output, r.output
    assert "Traceback" not in r.output and not (tmp_path / "o").exists()


def test_dataset_sources(tmp_path):
    import datasets

    from longctx_patch.train.data import load_documents

    ds = datasets.Dataset.from_dict({"body": ["first doc", "second doc", ""], "n": [1, 2, 3]})
    ds.save_to_disk(str(tmp_path / "ds"))
    assert load_documents(None, str(tmp_path / "ds"), "train", "body") == ["first doc", "second doc"]
    datasets.DatasetDict({"valid": ds}).save_to_disk(str(tmp_path / "dd"))
    assert load_documents(None, str(tmp_path / "dd"), "valid", "body") == ["first doc", "second doc"]
    with pytest.raises(ConfigError, match="no split"):
        load_documents(None, str(tmp_path / "dd"), "train", "body")
    jl = tmp_path / "rows.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t}) for t in ["x y z", "u v"]))
    assert load_documents(None, str(jl), "train", "text") == ["x y z", "u v"]
    with pytest.raises(ConfigError, match="body, n"):
        load_documents(None, str(tmp_path / "ds"), "train", "text")
    with pytest.raises(ConfigError, match="could not be loaded"):
        load_documents(None, "no-such-dataset-name-here", "train", "text")
    with pytest.raises(ConfigError, match="no training text"):
        load_documents(None, None, "train", "text")


def test_lr_schedule_shapes():
    from longctx_patch.train.recipe import Stage
    from longctx_patch.train.stage_loop import lr_lambda

    s = Stage(steps=10, warmup=2, schedule="cosine", min_lr_ratio=0.1)
    f = lr_lambda(s)
    assert f(0) == pytest.approx(0.5) and f(1) == pytest.approx(1.0) and f(2) == pytest.approx(1.0)
    assert f(10) == pytest.approx(0.1) and f(6) == pytest.approx(0.55)
    assert lr_lambda(Stage(steps=10, warmup=0, schedule="linear", min_lr_ratio=0.0))(5) == pytest.approx(0.5)
    assert lr_lambda(Stage(steps=10, warmup=0, schedule="constant"))(9) == 1.0
    assert lr_lambda(Stage(steps=4, warmup=20, schedule="constant"))(3) == 1.0  # warm-up capped at steps


# ----------------------------------------------------------------------------------------------- the loop
def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_two_stage_run_saves_and_reloads(tiny_dir, text_file, temp_method, tmp_path):
    import longctx_patch
    from longctx_patch.train import Finetuner, apply_trained, recipe_from_dict

    r = recipe_from_dict(recipe_dict(tiny_dir, text_file))
    ft = Finetuner(r, tmp_path / "out", progress=False, results=str(tmp_path / "res.json"))
    log = ft.run()
    t, l = log["stages"]
    # attention transfer learns the temperature back: its loss falls (to near 0)
    assert t["steps_done"] == 6 and t["trainable_params"] == 2 * 4  # 2 layers x 4 heads
    assert t["loss"][-1][1] < 0.5 * t["loss"][0][1]
    assert [e[0] for e in t["eval_loss"]] == [0, 3, 6] and t["eval_loss"][-1][1] < t["eval_loss"][0][1]
    assert t["tokens"] == 6 * 4 * 64 and log["tokens"] == (6 + 4) * 4 * 64
    lt = torch.stack([m.log_t.detach() for m in longctx_patch.patcher.patched_modules(ft.model).values()])
    assert lt.abs().max() < 0.45  # moved from 0.5 towards 0
    # LoRA stage trains adapters only (r=4 on q/k/v/o of 2 layers)
    assert l["trainable"] == ["lora"] and l["trainable_params"] > 0 and l["final_eval_loss"] is not None

    out = tmp_path / "out"
    saved = json.loads((out / "train_log.json").read_text())
    assert saved["stages"][0]["loss"] == t["loss"] and saved["world_size"] == 1
    res = json.loads((tmp_path / "res.json").read_text())
    assert {"device", "date", "commit", "command"} <= set(res) and res["task"] == "finetune"
    assert (out / "trainable" / "longctx_patch.safetensors").exists()
    assert (out / "trainable" / "adapter" / "adapter_model.safetensors").exists()
    assert (out / "recipe.yaml").exists()

    ids = torch.randint(3, 259, (2, 40))
    final = _logits(ft.model, ids)  # LoRA merged into the projections
    # model/ is a self-contained save_patched() checkpoint
    m2, _ = longctx_patch.load_model(str(out / "model"), dtype="float32", device="cpu")
    torch.testing.assert_close(_logits(m2, ids), final, rtol=1e-5, atol=1e-5)
    # trainable/ (a few small files) applied to the untouched base model gives the same model
    base, _ = longctx_patch.load_model(str(tiny_dir), dtype="float32", device="cpu")
    before = _logits(base, ids)
    m3 = apply_trained(base, out)
    torch.testing.assert_close(_logits(m3, ids), final, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, final, atol=1e-3)  # training changed the model

    # a second run into the same folder must not silently mix with the old checkpoints
    with pytest.raises(CheckpointError, match="--resume"):
        Finetuner(r, out, progress=False).run()


def test_resume_is_exact(tiny_dir, text_file, temp_method, tmp_path):
    """Interrupted runs (mid attention-transfer, and mid LoRA stage with dropout) resume bit-exactly."""
    from longctx_patch.train import Finetuner, recipe_from_dict
    from longctx_patch.train import runner as runner_mod

    d = recipe_dict(tiny_dir, text_file, transfer={"save_every": 2}, lora={"save_every": 2})
    d["output"]["save_model"] = False
    ref = Finetuner(recipe_from_dict(d), tmp_path / "ref", progress=False)
    ref_log = ref.run()

    class Interrupt(Exception):
        pass

    orig = runner_mod.Finetuner.save_checkpoint
    for stop_at in [(0, 4), (1, 2)]:
        out = tmp_path / f"run{stop_at[0]}"

        def save_then_stop(self, si, step, *a, _stop=stop_at, **kw):
            orig(self, si, step, *a, **kw)
            if (si, step) == _stop:
                raise Interrupt

        runner_mod.Finetuner.save_checkpoint = save_then_stop
        try:
            with pytest.raises(Interrupt):
                Finetuner(recipe_from_dict(d), out, progress=False).run()
        finally:
            runner_mod.Finetuner.save_checkpoint = orig
        ft = Finetuner(recipe_from_dict(d), out, resume=True, progress=False)
        log = ft.run()
        for a, b in zip(log["stages"], ref_log["stages"]):
            assert a["loss"] == b["loss"], (stop_at, a["name"])
            assert a["eval_loss"] == b["eval_loss"]
        assert log["stages"][stop_at[0]]["resumed_from_step"] == stop_at[1]
        ref_sd = dict(ref.root.named_parameters())
        for n, p in ft.root.named_parameters():
            assert torch.equal(p, ref_sd[n]), n

    # a checkpoint from a structurally different recipe is refused
    d2 = recipe_dict(tiny_dir, text_file, transfer={"seq_len": 32})
    with pytest.raises(CheckpointError, match="different recipe"):
        Finetuner(recipe_from_dict(d2), tmp_path / "run0", resume=True, progress=False).run()


def test_stop_after_then_resume_equals_one_run(tiny_dir, text_file, temp_method, tmp_path):
    """A run split at a stage boundary (stop_after, then resume) trains what one run trains, and the first half
    writes no outputs beyond its checkpoint and log."""
    from longctx_patch.errors import ConfigError
    from longctx_patch.train import Finetuner, recipe_from_dict, run_finetune

    d = recipe_dict(tiny_dir, text_file)
    d["output"]["save_model"] = False
    ref = Finetuner(recipe_from_dict(d), tmp_path / "ref", progress=False)
    ref_log = ref.run()
    out = tmp_path / "split"
    first = run_finetune(recipe_from_dict(d), out, progress=False, stop_after="transfer")
    assert first["stopped_after"] == "transfer" and [s["name"] for s in first["stages"]] == ["transfer"]
    assert not (out / "trainable").exists()
    assert json.loads((out / "train_log.json").read_text())["stopped_after"] == "transfer"
    ft = Finetuner(recipe_from_dict(d), out, resume=True, progress=False)
    log = ft.run()
    assert "stopped_after" not in log and (out / "trainable").exists()
    for a, b in zip(log["stages"], ref_log["stages"], strict=True):
        assert a["loss"] == b["loss"] and a["eval_loss"] == b["eval_loss"], a["name"]
    ref_sd = dict(ref.root.named_parameters())
    for n, p in ft.root.named_parameters():
        assert torch.equal(p, ref_sd[n]), n
    with pytest.raises(ConfigError, match="no such stage.*transfer, lora"):
        Finetuner(recipe_from_dict(d), tmp_path / "x", progress=False, stop_after="warmup")


def test_each_stage_records_its_text_and_a_mid_stage_resume_refuses_other_text(tiny_dir, text_file, temp_method,
                                                                                 tmp_path):
    """Two texts in one run (stop after the first stage, resume with the second, as recipes/linearize-qwen.yaml is
    run): each stage's log keeps the text it read and the commands that ran it; a run stopped inside a stage and
    resumed with other text is refused, naming both texts."""
    from longctx_patch.train import Finetuner, recipe_from_dict, run_finetune
    from longctx_patch.train import runner as runner_mod

    other = tmp_path / "other.txt"
    other.write_text(TEXT[::-1] * 12)
    d = recipe_dict(tiny_dir, text_file, transfer={"save_every": 2})
    d["output"]["save_model"] = False
    out = tmp_path / "two-texts"
    run_finetune(recipe_from_dict(d), out, progress=False, stop_after="transfer", command="first")
    d_b = {**d, "data": {**d["data"], "text": str(other)}}
    log = run_finetune(recipe_from_dict(d_b), out, resume=True, progress=False, command="second")
    a, b = log["stages"]
    assert a["text"]["source"] == str(text_file) and b["text"]["source"] == str(other)
    assert a["text"]["sha256"] != b["text"]["sha256"] and a["text"]["documents"] == b["text"]["documents"] == 1
    assert a["text"]["tokens"] > 3000 and a["commands"] == ["first"] and b["commands"] == ["second"]

    class Interrupt(Exception):
        pass

    orig = runner_mod.Finetuner.save_checkpoint

    def save_then_stop(self, si, step, *args, **kw):
        orig(self, si, step, *args, **kw)
        if (si, step) == (0, 2):
            raise Interrupt

    out = tmp_path / "cut"
    runner_mod.Finetuner.save_checkpoint = save_then_stop
    try:
        with pytest.raises(Interrupt):
            run_finetune(recipe_from_dict(d), out, progress=False)
    finally:
        runner_mod.Finetuner.save_checkpoint = orig
    with pytest.raises(CheckpointError, match=r"middle of stage 'transfer', which read .*book.txt.*this run reads "
                                              r".*other.txt.*resume with the text the stage started with"):
        Finetuner(recipe_from_dict(d_b), out, resume=True, progress=False).run()
    log = run_finetune(recipe_from_dict(d), out, resume=True, progress=False, command="again")
    assert log["stages"][0]["resumed_from_step"] == 2 and len(log["stages"][0]["commands"]) == 2


def test_rng_state_survives_json():
    """The RNG states a checkpoint stores (python, numpy with a cached gaussian, torch) come back exactly
    after the JSON round trip."""
    import random

    import numpy as np

    from longctx_patch.train.resume import _rng_state, _set_rng_state

    random.gauss(0, 1), np.random.standard_normal()  # leave a cached gaussian in both states
    st = json.loads(json.dumps(_rng_state()))
    assert st["python"][2] is not None and st["numpy"][3] == 1

    def draw():
        return random.gauss(0, 1), random.random(), np.random.standard_normal(), np.random.rand(3).tolist(), torch.rand(4)

    a = draw()
    _set_rng_state(st)
    b = draw()
    assert a[:4] == b[:4] and torch.equal(a[4], b[4])
    with pytest.raises(RuntimeError):  # a truncated torch state (load_resume_state makes it a CheckpointError)
        _set_rng_state({**st, "torch": st["torch"][:10]})


class _WritesMarker:
    """Unpickling this writes a marker file: a stand-in for a crafted checkpoint that runs code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_resume_refuses_pickled_code(tiny_dir, text_file, temp_method, tmp_path):
    """Resuming reads optimizer.pt with torch.load(weights_only=True) and the scheduler and RNG states as JSON:
    a crafted pickle planted in a run folder is refused with a one-line CheckpointError and never runs."""
    import pickle
    import shutil

    from longctx_patch.train import Finetuner, recipe_from_dict
    from longctx_patch.train import runner as runner_mod

    d = recipe_dict(tiny_dir, text_file, transfer={"steps": 4, "save_every": 2, "eval_every": 0})
    d["stages"] = d["stages"][:1]
    d["output"]["save_model"] = False

    class Interrupt(Exception):
        pass

    orig = runner_mod.Finetuner.save_checkpoint

    def save_then_stop(self, si, step, *a, **kw):
        orig(self, si, step, *a, **kw)
        raise Interrupt

    out = tmp_path / "run"
    runner_mod.Finetuner.save_checkpoint = save_then_stop
    try:
        with pytest.raises(Interrupt):
            Finetuner(recipe_from_dict(d), out, progress=False).run()
    finally:
        runner_mod.Finetuner.save_checkpoint = orig
    ckpt = out / "checkpoints" / "stage0-step0000002"
    assert sorted(f.name for f in ckpt.iterdir()) == [
        "optimizer.pt", "rng.json", "scheduler.json", "state.json", "trained.safetensors"
    ]
    # what the runner wrote needs no unpickling beyond tensors and plain values
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert opt["state"] and all(type(v) is torch.Tensor for st in opt["state"].values() for v in st.values())
    rng = json.loads((ckpt / "rng.json").read_text())
    assert len(rng) == 1 and {"python", "numpy", "torch"} <= set(rng[0])
    assert json.loads((ckpt / "scheduler.json").read_text())["last_epoch"] == 2
    pristine = tmp_path / "pristine"
    shutil.copytree(ckpt, pristine)

    # the payload is live: plain unpickling runs it
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_WritesMarker(probe)))
    assert probe.read_text() == "ran"

    marker = tmp_path / "marker"
    evil = _WritesMarker(marker)
    plants = {
        "optimizer.pt (torch.save)": ("optimizer.pt", lambda f: torch.save(evil, f)),
        "optimizer.pt (pickle)": ("optimizer.pt", lambda f: f.write_bytes(pickle.dumps(evil))),
        "optimizer.pt (in the state)": (
            "optimizer.pt", lambda f: torch.save({"state": {0: {"step": evil}}, "param_groups": opt["param_groups"]}, f)
        ),
        "scheduler.json": ("scheduler.json", lambda f: f.write_bytes(pickle.dumps(evil))),
        "rng.json": ("rng.json", lambda f: f.write_bytes(pickle.dumps(evil))),
    }
    for what, (name, plant) in plants.items():
        shutil.rmtree(ckpt)
        shutil.copytree(pristine, ckpt)
        plant(ckpt / name)
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as e:
            Finetuner(recipe_from_dict(d), out, resume=True, progress=False).run()
        assert "\n" not in str(e.value), what
        assert not marker.exists(), what
    assert "unpickling them could run code" in str(e.value) or "cannot be read" in str(e.value)

    # a checkpoint in the older pickled format (rng.pt, scheduler.pt) is refused, not unpickled
    shutil.rmtree(ckpt)
    shutil.copytree(pristine, ckpt)
    (ckpt / "rng.json").unlink()
    (ckpt / "rng.pt").write_bytes(pickle.dumps(evil))
    with pytest.raises(CheckpointError, match="older format") as e:
        Finetuner(recipe_from_dict(d), out, resume=True, progress=False).run()
    assert "\n" not in str(e.value) and not marker.exists()

    # the untouched checkpoint still resumes to the end
    shutil.rmtree(ckpt)
    shutil.copytree(pristine, ckpt)
    log = Finetuner(recipe_from_dict(d), out, resume=True, progress=False).run()
    assert log["stages"][0]["resumed_from_step"] == 2 and log["stages"][0]["steps_done"] == 4


def test_full_finetune_unpatched_and_cli(tiny_dir, text_file, tmp_path):
    """Full fine-tune of the unpatched model through the click command."""
    from click.testing import CliRunner

    from longctx_patch.cli.finetune_cmd import finetune_cmd

    d = recipe_dict(tiny_dir, text_file, method=None)
    d["stages"] = [d["stages"][1]]
    d["stages"][0].pop("lora")
    d["stages"][0].update(lr=3e-3, steps=5)
    rec = write_recipe(tmp_path / "full.yaml", d)
    res = CliRunner().invoke(
        finetune_cmd,
        [str(rec), "--model", str(tiny_dir), "--text", str(text_file), "--output", str(tmp_path / "o"),
         "--set", "stages.0.steps=6", "--set", "stages.0.gradient_checkpointing=true", "--results", str(tmp_path / "r.json")],
    )
    assert res.exit_code == 0, res.output
    # without a terminal, progress is one plain line per log_every steps, then a summary
    assert "lora step 6/6: loss" in res.output and "tok/s" in res.output
    assert "lora: 6 steps, 1536 tokens" in res.output
    log = json.loads((tmp_path / "o" / "train_log.json").read_text())
    s = log["stages"][0]
    assert s["trainable"] == ["full"] and s["steps_done"] == 6 and log["method"] is None
    assert s["loss"][-1][1] < s["loss"][0][1]  # the model learns the repeated text
    assert (tmp_path / "o" / "model" / "config.json").exists() and (tmp_path / "r.json").exists()

    plan = CliRunner().invoke(finetune_cmd, [str(REPO / "recipes" / "linearize.yaml"), "--dry-run", "--set", "stages.lora.steps=50"])
    assert plan.exit_code == 0, plan.output
    assert "# transfer       attention_transfer   method           300         8192  2457600" in plan.output
    assert "# lora           next_token           lora              50         8192  409600" in plan.output
    # --dry-run checks the method and its config too (before any model is loaded)
    for item, needle in (("method=nope", "unknown method 'nope'"), ("method_config.window=abc", "bad value 'abc'"),
                         ("method_config.foo=1", "unknown key(s) foo"), ("noequals", "expected KEY=VALUE")):
        bad = CliRunner().invoke(finetune_cmd, [str(REPO / "recipes" / "linearize.yaml"), "--dry-run", "--set", item])
        assert bad.exit_code != 0 and needle in bad.output, (item, bad.output)

    # user errors become one-line messages, not tracebacks
    bad = CliRunner().invoke(finetune_cmd, [str(rec), "--model", str(tiny_dir), "--set", "stages.0.lr=-2"])
    assert bad.exit_code == 2 and bad.output.startswith("error: stages.0.lr: -2.0 is too small") \
        and "Traceback" not in bad.output  # the one-line style of every other verb
    nodata = CliRunner().invoke(finetune_cmd, [str(rec), "--set", "data.text=null", "--output", str(tmp_path / "x")])
    assert nodata.exit_code != 0 and "--text" in nodata.output
    sw = CliRunner().invoke(
        finetune_cmd, [str(rec), "--set", "method=sliding-window", "--set", "stages.0.trainable=[method]",
                       "--output", str(tmp_path / "y")],
    )
    assert sw.exit_code != 0 and "has none" in sw.output


def test_lora_finetune_through_the_cli_prints_no_deprecation(tiny_dir, text_file, tmp_path):
    """A LoRA stage with gradient checkpointing through `longctx finetune`: nothing on its output says deprecated
    (peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps the model; pyproject.toml makes
    that warning an error in the suite)."""
    from click.testing import CliRunner

    from longctx_patch.cli.finetune_cmd import finetune_cmd

    d = recipe_dict(tiny_dir, text_file, method=None, lora=dict(steps=2, gradient_checkpointing=True))
    d["stages"] = [d["stages"][1]]
    rec = write_recipe(tmp_path / "lora.yaml", d)
    res = CliRunner().invoke(finetune_cmd, [str(rec), "--output", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "lora: 2 steps" in res.output and "deprecat" not in res.output.lower(), res.output


def test_muse_adapt_recipe_on_tiny_llama(tiny_dir, text_file, tmp_path):
    """recipes/muse-adapt.yaml on a tiny random Llama (CPU: the reference's backward), with blocks of 128 so that
    sequences of 640 tokens have cells: LoRA trains, the loss falls, and the saved model reloads patched with MuSe
    and its logits."""
    import longctx_patch
    from longctx_patch.train import Finetuner, load_recipe

    r = load_recipe(
        REPO / "recipes" / "muse-adapt.yaml",
        [f"model={tiny_dir}", f"data.text={text_file}", "method_config.block_size=128", "method_config.topk_blocks=1",
         "method_config.peak_blocks=0", "stages.*.seq_len=640", "stages.*.batch_size=1", "stages.*.grad_accum=1",
         "stages.*.warmup=1", "stages.*.log_every=1", "stages.*.eval_every=0", "stages.*.save_every=0",
         "stages.adapt.steps=6", "stages.adapt.lr=3e-3", "data.eval_fraction=0.2"],
    )
    ft = Finetuner(r, tmp_path / "muse", progress=False)
    log = ft.run()
    st = log["stages"][0]
    assert st["trainable_params"] > 0 and st["steps_done"] == 6
    assert st["loss"][-1][1] < st["loss"][0][1], st["loss"]
    ids = torch.randint(3, 259, (1, 640))
    final = _logits(ft.model, ids)
    m2, _ = longctx_patch.load_model(str(tmp_path / "muse" / "model"), dtype="float32", device="cpu")
    assert longctx_patch.patched_layers(m2) == {0: "muse", 1: "muse"}
    torch.testing.assert_close(_logits(m2, ids), final, rtol=1e-5, atol=1e-5)


def test_linearize_recipe_on_tiny_llama(tiny_dir, text_file, tmp_path):
    """recipes/linearize.yaml with lolcats on a tiny random Llama: the transfer loss falls, the saved weights
    reload to identical outputs, and the LoLCATs-layout export reloads through the lolcats checkpoint loader."""
    import longctx_patch
    from longctx_patch.train import Finetuner, load_recipe

    # sharper attention than the random init gives (q.k logits x 9), so the linear part has work to do
    tiny, tok = longctx_patch.load_model(str(tiny_dir), dtype="float32", device="cpu")
    with torch.no_grad():
        for layer in tiny.model.layers:
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.self_attn.k_proj.weight.mul_(3.0)
    tiny.save_pretrained(tmp_path / "sharp")
    tok.save_pretrained(tmp_path / "sharp")
    tiny_dir = tmp_path / "sharp"
    r = load_recipe(
        REPO / "recipes" / "linearize.yaml",
        [f"model={tiny_dir}", f"data.text={text_file}", "method_config.window=16", "method_config.feature_dim=8",
         "method_config.chunk=16",
         "stages.*.seq_len=64", "stages.*.batch_size=4", "stages.*.warmup=1", "stages.*.log_every=1",
         "stages.*.eval_every=12", "stages.*.save_every=0", "stages.transfer.steps=12", "stages.lora.steps=3",
         "stages.lora.lr=1e-2", "data.eval_fraction=0.1", "output.lolcats_export=true",
         "stages.transfer.gradient_checkpointing=true", "output.keep_checkpoints=1"],
    )
    ft = Finetuner(r, tmp_path / "lin", progress=False)
    log = ft.run()
    t = log["stages"][0]
    assert t["trainable_params"] == 2 * (2 * 4 * 16 * 8 + 4)  # 2 layers x (q and k maps [4, 16, 8] + 4 factors)
    assert t["loss"][-1][1] < 0.85 * t["loss"][0][1], t["loss"]
    (e0, ev0), (e1, ev1) = t["eval_loss"]  # the same held-out chunks before and after
    assert (e0, e1) == (0, 12) and ev1 < 0.8 * ev0, t["eval_loss"]
    assert log["stages"][1]["final_loss"] is not None

    out = tmp_path / "lin"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["stage1-step0000003"]  # keep_checkpoints=1
    ids = torch.randint(3, 259, (1, 48))
    final = _logits(ft.model, ids)
    m2, _ = longctx_patch.load_model(str(out / "model"), dtype="float32", device="cpu")
    assert longctx_patch.patched_layers(m2) == {0: "lolcats", 1: "lolcats"}
    torch.testing.assert_close(_logits(m2, ids), final, rtol=1e-5, atol=1e-5)
    # LoLCATs model.pt: feature maps + window factors + unmerged PEFT LoRA (alpha 16 as in the recipe)
    base, _ = longctx_patch.load_model(str(tiny_dir), dtype="float32", device="cpu")
    longctx_patch.patch(
        base, "lolcats", window=16, feature_dim=8, chunk=16, checkpoint=str(out / "trainable" / "lolcats" / "model.pt")
    )
    torch.testing.assert_close(_logits(base, ids), final, rtol=1e-4, atol=1e-4)

    # the saved model trains on: its patches and trained weights are kept (not re-patched)
    more = load_recipe(
        None,
        [f"model={out / 'model'}", "method=lolcats", f"data.text={text_file}",
         "stages=[{name: more, objective: next_token, lora: {r: 2}, steps: 1, batch_size: 2, seq_len: 32}]",
         "output.save_model=false"],
    )
    ft2 = Finetuner(more, tmp_path / "more", progress=False)
    ft2.run()
    assert ft2.stage_logs[0].first_loss is not None
    with pytest.raises(ConfigError, match="already patched with lolcats"):
        Finetuner(load_recipe(None, [f"model={out / 'model'}", "method=sliding-window", f"data.text={text_file}",
                                     "stages=[{objective: next_token, steps: 1}]"]), tmp_path / "x", progress=False).run()


def test_teacher_forcing_isolates_layers(tiny_llama):
    """Under attention transfer with teacher forcing every layer sees the exact model's hidden states: the
    logits equal the unpatched model's, and a layer's loss has no gradient into earlier layers' maps."""
    import longctx_patch
    from longctx_patch.train.transfer import attention_transfer
    from longctx_patch.train.params import _patched_modules

    ids = torch.randint(3, 128, (2, 40))
    exact = _logits(tiny_llama, ids)
    longctx_patch.patch(tiny_llama, "lolcats", window=8, feature_dim=4, chunk=8)
    mods = _patched_modules(tiny_llama)
    assert not torch.allclose(_logits(tiny_llama, ids), exact, atol=1e-4)  # the hybrid differs
    with attention_transfer(tiny_llama, teacher_forcing=True) as tr:
        out = tiny_llama(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(out.detach(), exact, rtol=1e-5, atol=1e-5)
    assert len(tr.losses) == 3
    last = tr.losses[-1]
    g = torch.autograd.grad(last, [mods[0].feature_map_q.mlp.layer, mods[2].feature_map_q.mlp.layer], allow_unused=True)
    assert g[0] is None and g[1] is not None and g[1].abs().sum() > 0
    # without teacher forcing the student's output flows on: layer 2's loss reaches layer 0's maps
    with attention_transfer(tiny_llama) as tr:
        tiny_llama(input_ids=ids, use_cache=False)
    g = torch.autograd.grad(tr.losses[-1], [mods[0].feature_map_q.mlp.layer], allow_unused=True)
    assert g[0] is not None and g[0].abs().sum() > 0


def test_param_groups_method_lr(tiny_llama, temp_method):
    """trainable [lora, method] with method_lr: the method's parameters get their own lr; decay on matrices only."""
    import longctx_patch
    from longctx_patch.train import Finetuner, recipe_from_dict

    longctx_patch.patch(tiny_llama, TEMP_METHOD)
    d = recipe_dict("unused", "unused")
    st = d["stages"][1]
    st.update(trainable=["lora", "method"], method_lr=3e-2, weight_decay=0.1)
    r = recipe_from_dict(d)
    ft = Finetuner(r, "unused", progress=False, model=tiny_llama, tokenizer=byte_tokenizer())
    ft.load()
    params = ft.setup_stage(r.stages[1])
    groups = ft.param_groups(r.stages[1], params)
    by = {(g["lr"], g["weight_decay"]): sum(p.numel() for p in g["params"]) for g in groups}
    lora_n = sum(p.numel() for n, p in params if "lora_" in n)
    assert by == {(1e-2, 0.1): lora_n, (3e-2, 0.0): 3 * 4}  # LoRA matrices; log_t of 3 layers x 4 heads


def test_max_time_ends_a_stage_early(tiny_dir, text_file, tmp_path):
    """max_time_s ends a stage after the step that used the budget; the run still writes everything and a
    resumed run treats the stage as finished."""
    from longctx_patch.train import Finetuner, recipe_from_dict

    d = recipe_dict(tiny_dir, text_file, method=None)
    d["stages"] = [dict(d["stages"][1], name="budget", steps=1000, max_time_s=0.0, eval_every=0),
                   dict(d["stages"][1], name="after", steps=2)]
    log = Finetuner(recipe_from_dict(d), tmp_path / "o", progress=False).run()
    b, a = log["stages"]
    assert b["steps_done"] == 1 and "max_time_s=0" in b["stopped_early"] and b["eval_loss"][-1][0] == 1
    assert b["loss"] == [[1, b["first_loss"]]] and b["tokens"] == 4 * 64
    assert a["steps_done"] == 2 and a["stopped_early"] is None
    state = json.loads((tmp_path / "o" / "checkpoints" / "stage0-step0000001" / "state.json").read_text())
    assert state["completed"] is True
    again = Finetuner(recipe_from_dict(d), tmp_path / "o", resume=True, progress=False).run()
    assert [s["steps_done"] for s in again["stages"]] == [1, 2]


def test_losses_logged_at_log_points_match_every_step_logging(tiny_dir, text_file, tmp_path):
    """Losses stay on the device between log points; the logged means, first/final losses and grad norms
    equal those of a run that logs every step, and tokens/s after the first log point is recorded."""
    from longctx_patch.train import Finetuner, recipe_from_dict

    logs = {}
    for every in (1, 3):
        d = recipe_dict(tiny_dir, text_file, method=None)
        d["stages"] = [dict(d["stages"][1], name="lm", steps=6, log_every=every, eval_every=0)]
        logs[every] = Finetuner(recipe_from_dict(d), tmp_path / f"o{every}", progress=False).run()["stages"][0]
    one, three = logs[1], logs[3]
    per_step = [v for _, v in one["loss"]]
    assert [s for s, _ in three["loss"]] == [3, 6]
    for (_, mean), chunk in zip(three["loss"], (per_step[:3], per_step[3:])):
        assert mean == pytest.approx(sum(chunk) / 3, rel=1e-6)
    assert three["first_loss"] == pytest.approx(per_step[0]) and three["final_loss"] == pytest.approx(per_step[-1])
    assert three["grad_norm"][-1][1] == pytest.approx(one["grad_norm"][-1][1], rel=1e-5)
    assert three["steady_tokens_per_s"] > 0 and three["tokens_per_s"] > 0


def test_non_finite_loss_stops_before_a_checkpoint_is_saved(tiny_dir, text_file, tmp_path, monkeypatch):
    """Losses are read at log points, but a save point reads them too: a NaN at step 2 (log_every 5,
    save_every 3) raises at the save of step 3, naming step 2, and no checkpoint of it is written."""
    from longctx_patch.errors import LongctxError
    from longctx_patch.train import Finetuner, recipe_from_dict

    d = recipe_dict(tiny_dir, text_file, method=None)
    d["stages"] = [dict(d["stages"][1], name="lm", steps=8, log_every=5, save_every=3, eval_every=0)]
    d["output"] = {"keep_checkpoints": 5}
    ft = Finetuner(recipe_from_dict(d), tmp_path / "o", progress=False)
    real = Finetuner._forward_loss
    calls = []

    def forward_loss(self, *a, **k):
        loss = real(self, *a, **k)
        calls.append(1)
        return loss * float("nan") if len(calls) == 2 else loss

    monkeypatch.setattr(Finetuner, "_forward_loss", forward_loss)
    with pytest.raises(LongctxError, match="at step 2"):
        ft.run()
    assert len(calls) == 3
    assert not list((tmp_path / "o").glob("checkpoints/*step0000003*"))


def test_hybrid_recipe_patches_the_other_layers(tiny_dir, text_file, tmp_path):
    """rest_method patches every layer not in `layers` (e.g. sliding-window beside ovq), and the saved
    model reloads with both methods on their layers."""
    import longctx_patch
    from longctx_patch.train import Finetuner, recipe_from_dict

    d = recipe_dict(tiny_dir, text_file, method="exact")
    d.update(layers=[1], rest_method="sliding-window", rest_config={"window": 8})
    d["stages"] = d["stages"][1:]  # the LoRA stage only
    d["stages"][0]["steps"] = 2
    ft = Finetuner(recipe_from_dict(d), tmp_path / "out", progress=False)
    ft.run()
    want = {0: "sliding-window", 1: "exact"}  # the tiny model has 2 layers
    assert longctx_patch.patched_layers(ft.model) == want
    m2, _ = longctx_patch.load_model(str(tmp_path / "out" / "model"), dtype="float32", device="cpu")
    assert longctx_patch.patched_layers(m2) == want
    with pytest.raises(ConfigError, match="rest_method.*layers"):
        recipe_from_dict({**d, "layers": None})


@pytest.mark.parametrize("frozen", ["auto", "keep"])
def test_frozen_weights_in_bf16_under_mixed_precision(tiny_dir, text_file, tmp_path, frozen, monkeypatch):
    """frozen_dtype=auto under bf16 autocast: the base model's parameters are bf16 while the stages run, the
    method's and LoRA's stay fp32, and model/ is written from the weights as loaded (the parts LoRA does not
    touch are bit-equal to them); keep: fp32 throughout."""
    import longctx_patch
    from longctx_patch.train import Finetuner, load_recipe
    from longctx_patch.train import runner as runner_mod

    r = load_recipe(
        REPO / "recipes" / "linearize.yaml",
        [f"model={tiny_dir}", f"data.text={text_file}", "method_config.window=16", "method_config.feature_dim=8",
         "method_config.chunk=16", "mixed_precision=bf16", f"frozen_dtype={frozen}",
         "stages.*.seq_len=64", "stages.*.batch_size=2", "stages.*.warmup=1", "stages.*.log_every=1",
         "stages.*.eval_every=0", "stages.*.save_every=0", "stages.*.steps=2", "data.eval_fraction=0.1",
         "output.keep_checkpoints=0"],
    )
    seen: list[dict[str, set]] = []
    orig = runner_mod.Finetuner.train_step

    def spy(self, model, *a, **k):
        kinds: dict[str, set] = {"base": set(), "method": set(), "lora": set()}
        method = {id(p) for _, p in runner_mod.method_parameters(self.model)}
        for n, p in self.root.named_parameters():
            kinds["lora" if "lora_" in n else "method" if id(p) in method else "base"].add(p.dtype)
        seen.append(kinds)
        return orig(self, model, *a, **k)

    monkeypatch.setattr(runner_mod.Finetuner, "train_step", spy)
    from accelerate.state import AcceleratorState

    # accelerate keeps one process-wide state: the earlier tests' Accelerator (mixed_precision "no") must go first
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        ft = Finetuner(r, tmp_path / "run", progress=False)
        log = ft.run()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert all(s["final_loss"] is not None and math.isfinite(s["final_loss"]) for s in log["stages"])
    base_dtype = torch.bfloat16 if frozen == "auto" else torch.float32
    assert len(seen) == 4 and all(s["base"] == {base_dtype} and s["method"] == {torch.float32} for s in seen), seen
    assert seen[-1]["lora"] == {torch.float32}
    assert {p.dtype for p in ft.model.parameters()} == {torch.float32}  # the run leaves the weights as loaded
    loaded, _ = longctx_patch.load_model(str(tiny_dir), dtype="float32", device="cpu")
    saved, _ = longctx_patch.load_model(str(tmp_path / "run" / "model"), dtype="float32", device="cpu")
    ref, out = dict(loaded.named_parameters()), dict(saved.named_parameters())
    untouched = [n for n in ref if not any(t in n for t in ("q_proj", "k_proj", "v_proj", "o_proj"))]
    assert len(untouched) > 5
    for n in untouched:
        assert out[n].dtype == torch.float32 and torch.equal(out[n], ref[n]), n
