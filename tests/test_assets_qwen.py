"""The Qwen2.5-Coder linearization's way into a packaged asset, on a tiny random qwen2 (attention bias on q/k/v, tied
embeddings, 14 query heads over 2 kv heads): a run folder as `longctx finetune recipes/linearize-qwen.yaml` leaves it
(trainable/ + train_log.json, two texts of a corpus), packaged with its training record; `checkpoint=auto` picks it
for that model only, and an asset folder passed to another model is refused by name. Nothing is trained."""

import json

import pytest
import torch

import longctx_patch as lp
from longctx_patch import assets
from longctx_patch.assets.training import ASSET_NAMES, package_run
from longctx_patch.checkpoint import write_patch
from longctx_patch.patcher import method_state_dict, patch_groups, patched_modules
from longctx_patch.train.stage_loop import StageLog

from conftest import tiny_model

NAME = ASSET_NAMES["qwen2.5-coder-0.5b"]
KW = dict(window=4, chunk=4)


def tiny_qwen(seed=0):
    # hidden 112 = 14 heads x 8: 7 query heads per kv head, as Qwen2.5-Coder-0.5B's 14 / 2
    return tiny_model("qwen2", seed=seed, vocab_size=300, hidden_size=112, num_attention_heads=14,
                      num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64, tie_word_embeddings=True)


def _corpus(tmp_path):
    """corpus.json as benchmarks.data.build_corpus writes it (the keys the record reads)."""
    def by_source(**kinds):
        return {f"{k}-src": {"kind": k, "documents": 2, "tokens": t} for k, t in kinds.items()}

    sets = {"train-a": {"documents": [{}] * 4, "tokens": 3000, "by_source": by_source(code=1600, prose=1400)},
            "train-b": {"documents": [{}] * 4, "tokens": 3100, "by_source": by_source(code=1500, prose=1600)},
            "heldout/code": {"documents": [{}] * 2, "tokens": 900, "by_source": by_source(code=900)},
            "heldout/prose": {"documents": [{}] * 2, "tokens": 800, "by_source": by_source(prose=800)}}
    corpus = {"built": "2026-01-01 00:00:00", "python": "3.12.3", "pack": {"sha256": "ab" * 32},
              "settings": {"train_tokens": 6100}, "code_selection": {"roots": ["stdlib:/x"]}, "sets": sets}
    p = tmp_path / "corpus" / "corpus.json"
    p.parent.mkdir()
    p.write_text(json.dumps(corpus))
    return p


def _run_folder(tmp_path, ids):
    """A finished run's folder: trainable/ (method weights perturbed away from the fresh ones, a LoRA adapter with
    non-zero B) and train_log.json with the four stages of recipes/linearize-qwen.yaml over train-a then train-b.
    Returns (folder, the run's logits on `ids`)."""
    from peft import LoraConfig

    from conftest import get_peft_model

    model = tiny_qwen()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    lp.patch(model, "lolcats", checkpoint="none", **KW)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "feature_map" in n or "window_factors" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    run = tmp_path / "run"
    tdir = run / "trainable"
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                    "o_proj"]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(str(tdir / "adapter"))
    write_patch(tdir, [gr.to_record() for gr in patch_groups(model)], method_state_dict(model))  # as save_outputs
    corpus_dir = tmp_path / "corpus"
    stages = []
    for name, objective, seq, folder, sha in [("transfer_4k", "attention_transfer", 64, "train-a", "a" * 64),
                                              ("transfer_16k", "attention_transfer", 128, "train-a", "a" * 64),
                                              ("lora_4k", "next_token", 64, "train-b", "b" * 64),
                                              ("lora_16k", "next_token", 128, "train-b", "b" * 64)]:
        log = StageLog(name=name, objective=objective, trainable=["method" if "transfer" in name else "lora"],
                       steps=3, seq_len=seq, batch_size=4, grad_accum=1, lr=1e-3)
        log.steps_done, log.tokens, log.time_s = 3, 3 * 4 * seq, 1.5
        tokens = 3004 if folder == "train-a" else 3104  # the set's tokens and one EOS per document
        log.text = {"source": str(corpus_dir / folder), "documents": 4, "tokens": tokens, "sha256": sha}
        log.commands = [f"longctx finetune recipes/linearize-qwen.yaml --text {corpus_dir / folder}"]
        stages.append(log.__dict__)
    (run / "train_log.json").write_text(json.dumps({
        "device": "NVIDIA H200", "date": "2026-01-02T03:04:05Z", "commit": "abc1234", "command": stages[-1]["commands"][0],
        "model": "/tmp/qwen-hf", "mixed_precision": "bf16", "stages": stages}))
    with torch.no_grad():
        return run, peft_model(ids).logits


def test_a_qwen_run_packaged_is_picked_by_auto_for_its_model_only(tmp_path, monkeypatch):
    ids = torch.randint(3, 300, (1, 21))
    run, want = _run_folder(tmp_path, ids)
    corpus = _corpus(tmp_path)
    out = package_run(run, tiny_qwen(), tmp_path / "assets" / NAME, name=NAME, description="test", corpus=corpus,
                      dtype=torch.float32, extra={"recipe": "recipes/linearize-qwen.yaml"})
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "asset.json", "longctx_patch.json",
                                                    "longctx_patch.safetensors"]
    info = json.loads((out / "asset.json").read_text())
    assert info["model_shape"] == {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 112,
                                   "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 8,
                                   "vocab_size": 300}
    assert info["commit"] == "abc1234" and info["recipe"] == "recipes/linearize-qwen.yaml"
    rec = info["training"]
    assert rec["tokens"] == 3 * 4 * (64 + 128) * 2 and rec["steps"] == 12 and rec["time_s"] == 6.0
    assert rec["device"] == "NVIDIA H200" and rec["date"] == "2026-01-02T03:04:05Z" and len(rec["commands"]) == 2
    assert [s["text"] for s in rec["stages"]] == [str(tmp_path / "corpus" / f) for f in
                                                  ("train-a", "train-a", "train-b", "train-b")]
    mix = rec["text"]
    assert sorted(mix["sets"]) == ["train-a", "train-b"] and mix["max_reads"] == 2
    assert mix["sets"]["train-a"]["kinds"] == {"code": 1600, "prose": 1400}
    assert [r["stage"] for r in mix["sets"]["train-b"]["read_by"]] == ["lora_4k", "lora_16k"]
    assert mix["sets"]["train-a"]["read_by"][1]["share"] == round(3 * 4 * 128 / 3004, 4)
    assert mix["distinct_tokens"] == 3004 + 3104
    assert mix["heldout"] == {"heldout/code": {"documents": 2, "tokens": 900},
                              "heldout/prose": {"documents": 2, "tokens": 800}}
    assert mix["corpus"]["pack"]["sha256"] == "ab" * 32 and mix["corpus"]["code_roots"] == ["stdlib:/x"]

    monkeypatch.setenv(assets.ENV_PATH, str(tmp_path / "assets"))
    for method, kw in (("lolcats", {}), ("lola", {"sparse_cache": 0})):  # lola with no sparse slots: the same model
        same = tiny_qwen()
        lp.patch(same, method, **KW, **kw)
        assert patched_modules(same)[0].weights_source == f"packaged asset {NAME} ({out})"
        with torch.no_grad():
            torch.testing.assert_close(same(ids).logits, want, rtol=1e-5, atol=1e-5)

    # the same shape with other weights: auto takes fresh feature maps, the asset passed by path is refused
    other = tiny_qwen(seed=1)
    lp.patch(other, "lolcats", **KW)
    assert patched_modules(other)[0].weights_source.startswith("fresh feature maps")
    lp.unpatch(other)
    with pytest.raises(lp.CheckpointError, match=rf"is the asset '{NAME}', not for this model: it was trained for a "
                                                 r"model of this shape with other weights \(embedding fingerprint"):
        lp.patch(other, "lolcats", checkpoint=str(out), **KW)
    # another architecture and shape: named by what differs
    llama = tiny_model("llama", num_hidden_layers=2)
    with pytest.raises(lp.CheckpointError, match=r"model_type 'qwen2' \(this model: 'llama'\).*num_attention_heads "
                                                 r"14 \(this model: 4\)"):
        lp.patch(llama, "lolcats", checkpoint=str(out), **KW)
    # an explicit path to the asset of this model loads as auto does
    same = tiny_qwen()
    lp.patch(same, "lolcats", checkpoint=str(out), **KW)
    with torch.no_grad():
        torch.testing.assert_close(same(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_package_refuses_an_unfinished_run(tmp_path):
    ids = torch.randint(3, 300, (1, 9))
    run, _ = _run_folder(tmp_path, ids)
    log = json.loads((run / "train_log.json").read_text())
    stopped = {**log, "stopped_after": "transfer_16k", "stages": log["stages"][:2]}
    (run / "train_log.json").write_text(json.dumps(stopped))
    with pytest.raises(lp.CheckpointError, match="stopped after stage 'transfer_16k'; finish it"):
        package_run(run, tiny_qwen(), tmp_path / "a", name=NAME, description="x")
    log["stages"][3]["steps_done"] = 1  # a run killed inside its last stage (train_log.json of an earlier command)
    (run / "train_log.json").write_text(json.dumps(log))
    with pytest.raises(lp.CheckpointError, match=r"stage\(s\) lora_16k did not run all their steps"):
        package_run(run, tiny_qwen(), tmp_path / "a", name=NAME, description="x")
    log["stages"][3].update(steps_done=3, text={**log["stages"][3]["text"], "sha256": "c" * 64})
    (run / "train_log.json").write_text(json.dumps(log))
    with pytest.raises(lp.CheckpointError, match="read train-b with different contents"):
        package_run(run, tiny_qwen(), tmp_path / "a", name=NAME, description="x", corpus=_corpus(tmp_path))


def test_the_package_command_writes_the_asset_and_checkpoint_auto_loads_it(tmp_path, monkeypatch, capsys):
    """`python -m longctx_patch.train.package RUN --model M --out DIR --check`: the asset under its embedded name, then
    loaded back by checkpoint=auto (its weights the run's)."""
    from longctx_patch.assets import ENV_PATH
    from longctx_patch.train import package

    monkeypatch.delenv(ENV_PATH, raising=False)
    run, _ = _run_folder(tmp_path, torch.randint(3, 300, (1, 9)))
    base = tmp_path / "qwen-hf"
    tiny_qwen().save_pretrained(str(base))
    out = tmp_path / "out"
    assert package.main([str(run), "--model", str(base), "--out", str(out), "--corpus", str(_corpus(tmp_path)),
                         "--check"]) == 0
    said = capsys.readouterr().out
    assert (out / NAME / "asset.json").is_file() and f"packaged asset {NAME} " in said
