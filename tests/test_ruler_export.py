"""RULER samples for another program (the kvpress peers, benchmarks/quality/bench_peers_kvpress.py): the samples file, the
context / question split, scoring another program's predictions, a method's decode-state fraction, and
`longctx eval ruler --export-samples / --samples-file`."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from conftest import tiny_model

from longctx_patch.errors import ConfigError
from longctx_patch.evals import ruler, ruler_export, ruler_report, speed_model
from longctx_patch.evals.common import MethodRun, applied


@pytest.fixture(scope="module")
def tok():
    from longctx_patch.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def tiny(tok):
    return tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048), tok


QUESTION_STARTS = {"niah_single_1": "What is the special magic number", "niah_multivalue": "What are all the special",
                   "vt": "Question: Find all variables", "cwe": "Question: What are the 10 most common",
                   "fwe": "Question: Do not provide any explanation"}


@pytest.mark.parametrize("task", list(QUESTION_STARTS))
def test_context_tokens_split_the_prompt_after_the_haystack(tok, task):
    s = ruler.build_sample(tok, task, 900, seed=2)
    assert 0 < s.context_tokens < s.prompt_tokens - 10
    question = tok.decode(s.input_ids[s.context_tokens:])
    assert question.lstrip("\n").startswith(QUESTION_STARTS[task]), question[:80]
    assert question.count(QUESTION_STARTS[task]) == 1  # cwe's worked example asks it too: that one stays in context
    context = tok.decode(s.input_ids[:s.context_tokens])
    if task.startswith("niah"):
        needles = sum(context.count(a) for a in s.answers)
        assert needles == len(s.answers)  # every needle is in the context, none in the question


def test_samples_file_round_trip(tok, tmp_path):
    samples = ruler.make_samples(tok, ["niah_single_1", "vt"], [800, 900], 2, seed=5)
    path = ruler_export.write_samples(tmp_path / "s.jsonl", samples, model="smol", vocab_size=len(tok), seed=5,
                                      haystack="none", chat_template=True)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0] == {"kind": "longctx-ruler-samples", "version": 1, "model": "smol", "vocab_size": len(tok),
                        "seed": 5, "haystack": "none", "chat_template": True, "tasks": ["niah_single_1", "vt"],
                        "lengths": [800, 900], "samples_per_cell": 2}
    assert len(lines) == 1 + 8
    for row, s in zip(lines[1:], samples):
        assert row["input_ids"] == s.input_ids and row["answers"] == s.answers and row["seed"] == 5
        assert row["context_tokens"] == s.context_tokens and row["prompt_tokens"] == len(row["input_ids"])
        assert (row["task"], row["length"], row["index"]) == (s.task, s.length, s.index)
    header, back = ruler_export.read_samples(path, tokenizer=tok)
    assert back == samples and header["seed"] == 5

    class Other:
        def __len__(self):
            return 1000

    with pytest.raises(ConfigError, match="export the samples with this model"):
        ruler_export.read_samples(path, tokenizer=Other())
    (tmp_path / "bad.jsonl").write_text('{"kind": "something else"}\n')
    with pytest.raises(ConfigError, match="not a RULER samples file"):
        ruler_export.read_samples(tmp_path / "bad.jsonl")


def test_predictions_of_another_program_are_scored_as_run_ruler_scores(tok, tmp_path):
    samples = ruler.make_samples(tok, ["niah_multivalue", "vt"], [900], 1, seed=1)
    mv, vt = samples
    assert len(mv.answers) == 4 and len(vt.answers) == 5
    preds = [
        {"method": "press(0.1)", "task": "niah_multivalue", "length": 900, "index": 0,
         "answer": " " + ", ".join(mv.answers[:3]).upper() + "\x07.", "state_fraction": 0.1},
        {"method": "press(0.1)", "task": "vt", "length": 900, "index": 0, "answer": " ".join(vt.answers),
         "state_fraction": 0.11},
        {"method": "press(0.5)", "task": "vt", "length": 900, "index": 0, "answer": "no idea"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"kind": "longctx-ruler-predictions", "version": 1,
                                                       "device": "x"}] + preds) + "\n")
    header, rows = ruler_export.read_predictions(path)
    assert header["device"] == "x" and len(rows) == 3
    recs = ruler_export.score_predictions(samples, rows)
    assert [r["score"] for r in recs] == [0.75, 1.0, 0.0]
    assert [r["correct"] for r in recs] == [False, True, False]
    for r, p in zip(recs, preds):
        s = mv if p["task"] == "niah_multivalue" else vt
        assert r["score"] == round(ruler.score(p["answer"], s.answers), 4)
        assert r["answers"] == s.answers and r["prompt_tokens"] == s.prompt_tokens and r["method"] == p["method"]
    assert recs[0]["state_fraction"] == 0.1 and "state_fraction" not in recs[2]
    figures = ruler_report.summarize(recs, ["press(0.1)"], ["niah_multivalue", "vt"], [900])
    assert figures["score"]["press(0.1)"]["niah_multivalue"]["900"] == 75.0
    assert figures["average"]["press(0.1)"]["900"] == 87.5
    with pytest.raises(ConfigError, match="has no sample"):
        ruler_export.score_predictions(samples, [{**preds[0], "index": 3}])
    with pytest.raises(ConfigError, match="two predictions"):
        ruler_export.score_predictions(samples, [preds[0], preds[0]])


def test_state_fraction_is_state_bytes_over_the_exact_kv_cache(tiny):
    import torch

    from longctx_patch.methods.kv_layer import kv_buffer_bytes

    model, _ = tiny
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    hkv = cfg.num_key_value_heads
    full = speed_model.full_kv_bytes(model, 1000)
    assert full == 2 * hkv * 1000 * hd * 4 * cfg.num_hidden_layers  # float32
    assert ruler_export.state_fraction(model, 1000) == 1.0  # unpatched: the exact K/V cache
    with applied(model, MethodRun("sliding-window", {"window": 100})):
        got = ruler_export.state_fraction(model, 1000)
        layer = kv_buffer_bytes(1000, 1, hkv, hd, torch.float32, window=100)
        assert got == pytest.approx(cfg.num_hidden_layers * layer / full, rel=1e-12)
        assert 0.1 < got < 0.11  # 100 of 1000 slots, plus the slots' validity bytes
        assert ruler_export.state_fraction(model, 4000) == pytest.approx(got / 4, rel=0.02)
    assert ruler_export.state_fraction(model, 1000) == 1.0


def test_cli_exports_samples_and_answers_them_from_the_file(tiny, tmp_path, one_thread, monkeypatch):
    from longctx_patch.cli.main import main

    monkeypatch.setitem(ruler.TOKENS_TO_GENERATE, "niah", 4)
    d = tmp_path / "tiny"
    tiny[0].save_pretrained(d)
    tiny[1].save_pretrained(d)
    f = tmp_path / "samples.jsonl"
    r = CliRunner().invoke(main, ["eval", "ruler", "--model", str(d), "--tasks", "niah_single_1", "--lengths", "300",
                                  "--samples", "2", "--seed", "3", "--export-samples", str(f)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "wrote 2 samples" in r.output and not (tmp_path / "out").exists()
    header, samples = ruler_export.read_samples(f)
    assert header["model"] == str(d) and header["seed"] == 3 and [s.index for s in samples] == [0, 1]
    assert samples == ruler.make_samples(tiny[1], ["niah_single_1"], [300], 2, seed=3)
    r = CliRunner().invoke(main, ["eval", "ruler", "--model", str(d), "--samples-file", str(f), "--method", "exact",
                                  "--method", "sliding-window(window=16)", "--out-dir", str(tmp_path / "out"),
                                  "--name", "r", "--no-progress", "--device", "cpu"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rec = json.loads((tmp_path / "out" / "r.json").read_text())
    assert rec["tasks"] == ["niah_single_1"] and rec["lengths"] == [300] and rec["seed"] == 3
    assert rec["samples_per_cell"] == 2 and str(f) in rec["haystack"]
    rows = rec["samples"]
    assert len(rows) == 4 and {r["prompt_tokens"] for r in rows} == {s.prompt_tokens for s in samples}
    import torch

    from longctx_patch.methods.kv_layer import kv_buffer_bytes

    cfg = tiny[0].config
    hd, hkv = cfg.hidden_size // cfg.num_attention_heads, cfg.num_key_value_heads
    for row in rows:  # exact's buffer holds its headroom slots; the window's holds 16
        P = row["prompt_tokens"]
        layer = kv_buffer_bytes(P, 1, hkv, hd, torch.float32, window=None if row["method"] == "exact" else 16)
        assert row["state_fraction"] == round(layer / (2 * hkv * P * hd * 4), 6)


def test_the_kvpress_runner_scores_and_matches_fractions_as_the_project_does():
    """benchmarks/quality/bench_peers_kvpress.py runs in kvpress's environment with its own copy of RULER's scorer (it
    imports nothing of longctx_patch; its module level is the standard library only): the copy must agree."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "quality" / "bench_peers_kvpress.py"
    spec = importlib.util.spec_from_file_location("bench_peers_kvpress", path)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    import re

    assert not re.search(r"^\s*(import|from)\s+(longctx_patch|cli|benchmarks)\b", path.read_text(), re.M)
    cases = [(" 1234567.", ["1234567"]), ("\x07 ABC-def\n", ["abc-DEF", "x"]), ("", ["1"]), ("a b c", ["a", "b", "c"]),
             ("\tVAR QQ = 1\x1f", ["qq", "var", "2"])]
    for answer, refs in cases:
        assert runner.score(answer, refs) == ruler.score(answer, refs)
        assert runner.postprocess(answer) == ruler.postprocess(answer)
    for frac, prompt, context in [(0.1, 4000, 3950), (0.25, 16000, 15900), (0.5, 900, 860)]:
        r = runner.ratio_for(frac, prompt, context)
        assert (1 - r) * context + (prompt - context) == pytest.approx(frac * prompt)
    assert runner.ratio_for(0.01, 1000, 900) == 0.999  # the question alone is over 1%: as much as kvpress allows
    assert runner.ratio_for(1.0, 1000, 900) == 0.0


def test_peer_points_average_tasks_and_fractions_and_the_index_heads_them():
    from benchmarks import index
    from benchmarks.quality import plot_peers

    recs = [{"method": "kvpress-snapkv(0.1)", "task": "niah_single_1", "length": 4096, "score": s, "state_fraction": f}
            for s, f in ((1.0, 0.09), (0.0, 0.11), (1.0, 0.10), (1.0, 0.10))]
    recs += [{"method": "kvpress-snapkv(0.1)", "task": "niah_single_2", "length": 4096, "score": 0.5, "state_fraction": 0.1}]
    recs += [{"method": "none", "task": t, "length": 4096, "score": 1.0} for t in ("niah_single_1", "niah_single_2")]
    pts = plot_peers.points(recs)
    p = pts[4096]["kvpress-snapkv(0.1)"]
    assert p["by_task"] == {"niah_single_1": 75.0, "niah_single_2": 50.0}
    assert p["score"] == 62.5 and p["samples"] == 5 and p["fraction"] == 0.1  # mean of the tasks, not of the samples
    assert pts[4096]["none"] == {"fraction": 1.0, "score": 100.0, "by_task": {"niah_single_1": 100.0, "niah_single_2": 100.0},
                                 "tasks": ["niah_single_1", "niah_single_2"], "samples": 2}
    head = index.headline("peers", {"points": {"4096": pts[4096]}})
    assert head == "RULER @4096: full 100.0, best <=15% kvpress-snapkv(0.1) 62.5 (0.10)"


def test_the_peer_plot_keeps_its_dotted_name_and_leaves_out_unfinished_cells(tok, tmp_path, capsys):
    import hashlib

    from benchmarks.quality import plot_peers

    samples = ruler.make_samples(tok, ["niah_single_1"], [800], 2, seed=3)
    spath = ruler_export.write_samples(tmp_path / "s.jsonl", samples, model="smol", vocab_size=len(tok), seed=3,
                                       haystack="none", chat_template=True)
    sha = hashlib.sha256(spath.read_bytes()).hexdigest()
    head = {"kind": ruler_export.PREDICTIONS_KIND, "version": 1, "device": "cpu", "date": "2026-12-05",
            "commit": "abcdef0", "command": "x", "samples_sha256": sha}
    rows = [{"method": "kvpress-knorm(0.1)", "task": "niah_single_1", "length": 800, "index": i,
             "answer": samples[i].answers[0], "state_fraction": 0.1} for i in (0, 1)]
    rows += [{"method": "kvpress-knorm(0.5)", "task": "niah_single_1", "length": 800, "index": 0, "answer": "no",
              "state_fraction": 0.5}]
    ppath = tmp_path / "p.jsonl"
    ppath.write_text("".join(json.dumps(r) + "\n" for r in [head, *rows]))
    out = tmp_path / "peers-smol-0.5b-cpu"
    assert plot_peers.main(["--samples", str(spath), "--kvpress", str(ppath), "--out", str(out)]) == 0
    rec = json.loads((tmp_path / "peers-smol-0.5b-cpu.json").read_text())
    assert (tmp_path / "peers-smol-0.5b-cpu.png").stat().st_size > 0
    assert list(rec["points"]["800"]) == ["kvpress-knorm(0.1)"]
    assert rec["points"]["800"]["kvpress-knorm(0.1)"]["score"] == 100.0
    assert "kvpress-knorm(0.5) at 800: 1 of 2 samples answered" in capsys.readouterr().err
