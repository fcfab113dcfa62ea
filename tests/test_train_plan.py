"""The fine-tune's plan (longctx_patch/train/plan.py): its memory estimate against a measured peak, the refusal of a
run too large for the machine before the model loads, --quick, and progress lines without a terminal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from longctx_patch.errors import MemoryBudgetError
from longctx_patch.train import load_recipe, recipe_from_dict, run_finetune
from longctx_patch.train import plan as plan_mod

REPO = Path(__file__).resolve().parent.parent
FACTOR = 2.0  # the estimate of a stage's peak (above what the process held before) is within this factor


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one intra-op thread


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small random llama (2 layers, 128 wide) with a byte tokenizer: at 2 x 2048 tokens per step its
    activations, not the process, make the peak."""
    from conftest import tiny_model
    from test_train import byte_tokenizer

    d = tmp_path_factory.mktemp("plan-llama")
    tiny_model("llama", vocab_size=260, num_hidden_layers=2, hidden_size=128, intermediate_size=512,
               max_position_embeddings=4096).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from test_train import TEXT

    p = tmp_path_factory.mktemp("plan-text") / "book.txt"
    p.write_text(TEXT * 60)  # ~20k byte tokens
    return p


def recipe(model_dir, text, **stage_kw) -> dict:
    common = dict(steps=2, batch_size=2, seq_len=2048, log_every=1, eval_every=0, eval_batches=0, warmup=0)
    common.update(stage_kw)
    return {
        "model": str(model_dir), "method": "lolcats", "method_config": {"checkpoint": "none"}, "seed": 0,
        "data": {"text": str(text), "eval_fraction": 0.05},
        "stages": [dict(name="transfer", objective="attention_transfer", lr=1e-2, **common),
                   dict(name="lora", objective="next_token", lora={"r": 4, "alpha": 8}, lr=1e-3, **common)],
        "output": {"save_model": False},
    }


MEASURE = """
import json, sys
import torch
torch.set_num_threads(1)
from longctx_patch.train import recipe_from_dict
from longctx_patch.train.runner import Finetuner
ft = Finetuner(recipe_from_dict(json.loads(sys.argv[1])), sys.argv[2], progress=False)
log = ft.run()
base = ft.plan.in_use
print(json.dumps([[p.name, p.peak - base, g["peak_memory_gib"] * 2**30 - base, g["estimated_peak_gib"] * 2**30,
                   p.peak, p.parts] for p, g in zip(ft.plan.stages, log["stages"])]))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the CPU peak is read from Linux's /proc")
@pytest.mark.parametrize("attention_checkpointing", [True, False])
def test_estimate_within_a_factor_of_the_measured_peak(model_dir, text_file, tmp_path, attention_checkpointing):
    """Each stage's estimated peak above what the process held when the plan was made, against the measured one
    (the process's peak resident memory during the stage minus that same baseline), in a fresh process (memory an
    earlier run freed would be reused): within FACTOR either way, with the attention's working set kept for the
    backward and recomputed."""
    import json
    import os
    import subprocess
    import sys

    rec = recipe(model_dir, text_file, attention_checkpointing=attention_checkpointing)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(rec), str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    stages = json.loads(p.stdout.strip().splitlines()[-1])
    assert [s[0] for s in stages] == ["transfer", "lora"]
    for name, est, measured, logged, peak, parts in stages:
        assert logged == pytest.approx(peak, rel=1e-6)  # the stage's log keeps the estimate beside its peak
        assert measured > 50 * 2**20, (name, measured)  # the stage's own memory dominates the noise
        assert 1 / FACTOR <= est / measured <= FACTOR, (name, attention_checkpointing, est / 2**20, measured / 2**20,
                                                        parts)


def test_plan_counts_every_stage(model_dir, text_file):
    from transformers import AutoConfig

    r = recipe_from_dict(recipe(model_dir, text_file))
    p = plan_mod.plan_run(r, AutoConfig.from_pretrained(model_dir), device=torch.device("cpu"))
    assert [s.name for s in p.stages] == ["transfer", "lora"]
    assert p.steps == 4 and p.tokens == 4 * 2 * 2048
    assert all(s.seconds > 0 for s in p.stages) and p.peak == max(s.peak for s in p.stages)
    text = "\n".join(p.lines())
    assert "8,192 tokens" in text and "estimated peak memory" in text and "time ~" in text
    # what recomputing the attention saves is the lolcats reference's working set, kept otherwise
    kept = plan_mod.plan_run(recipe_from_dict(recipe(model_dir, text_file, attention_checkpointing=False)),
                             AutoConfig.from_pretrained(model_dir), device=torch.device("cpu"))
    assert kept.stages[0].parts["activations"] > 4 * p.stages[0].parts["activations"]


def test_auto_attention_checkpointing_recomputes_off_cuda():
    r = load_recipe(REPO / "recipes" / "linearize.yaml", ["model=smollm2-135m"])
    transfer = r.stages[0]
    assert transfer.attention_checkpointing == "auto"
    assert plan_mod.attention_recomputed(transfer, "cpu") and not plan_mod.attention_recomputed(transfer, "cuda")


def test_a_run_too_large_stops_before_the_model_loads(model_dir, text_file, tmp_path, monkeypatch):
    import longctx_patch.models as models

    monkeypatch.setattr(plan_mod, "available_memory", lambda device: 2**20)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", no_load)
    r = recipe_from_dict(recipe(model_dir, text_file))
    with pytest.raises(MemoryBudgetError) as e:
        run_finetune(r, tmp_path / "out", progress=False)
    msg = str(e.value)
    for words in ("needs about", "available", "--quick", "batch_size", "seq_len", "gradient_checkpointing",
                  "--skip-memory-check"):
        assert words in msg, msg
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_cli_refusal_is_one_line_and_can_be_skipped(model_dir, text_file, tmp_path, monkeypatch):
    from longctx_patch.cli.main import main

    monkeypatch.setattr(plan_mod, "available_memory", lambda device: 2**20)
    rec = tmp_path / "r.yaml"
    import yaml

    rec.write_text(yaml.safe_dump(recipe(model_dir, text_file, steps=1, seq_len=256)))
    r = CliRunner().invoke(main, ["finetune", str(rec), "--output", str(tmp_path / "o1")])
    assert r.exit_code == 1
    assert re.search(r"error: stage '(transfer|lora)' needs about .* available; shrink it with --quick", r.output), r.output
    r = CliRunner().invoke(main, ["finetune", str(rec), "--output", str(tmp_path / "o2"), "--skip-memory-check", "-q"])
    assert r.exit_code == 0, r.output


def test_quick_makes_every_stage_short_and_set_items_still_win():
    full = load_recipe(REPO / "recipes" / "linearize.yaml", ["model=smollm2-135m"])
    quick = load_recipe(REPO / "recipes" / "linearize.yaml",
                        plan_mod.quick_overrides(full) + ["model=smollm2-135m", "stages.lora.steps=3"])
    for st, orig in zip(quick.stages, full.stages):
        assert st.steps <= plan_mod.QUICK_STEPS and st.seq_len <= 256 and st.batch_size <= 2
        assert st.objective == orig.objective and st.trainable == orig.trainable and st.save_every == 0
    assert quick.stages[1].steps == 3
    assert quick.output.dir == "runs/linearize-quick" and quick.method == full.method


def test_progress_lines_without_a_terminal(model_dir, text_file, tmp_path, capfd):
    """No terminal (the test's stderr is captured): the plan first, then a line per step here (log_seconds=0) with
    the step, loss, tokens/s and the ETA of the stage and of the run."""
    r = recipe_from_dict(recipe(model_dir, text_file, seq_len=128, steps=3, log_every=3))
    run_finetune(r, tmp_path / "out", progress=True, log_seconds=0.0)
    err = capfd.readouterr().err
    assert err.index("plan on this CPU") < err.index("transfer step 1/3")
    lines = [line for line in err.splitlines() if re.match(r"(transfer|lora) step \d/3:", line)]
    assert len(lines) == 6, err
    for line in lines:
        assert re.search(r"loss \d[\d.e+-]*, \d+ tok/s, .*ETA stage \d+ s", line), line
    assert ", run " in lines[0] and ", run " not in lines[-1]  # the run's ETA while later stages remain
    assert re.search(r"transfer: 3 steps, .* peak memory \d+\.\d GiB \(estimated \d+\.\d\)", err), err
