"""Evaluation harness: method selection, NIAH prompts and scoring, ppl, approx, speed, the `longctx eval` CLI."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from click.testing import CliRunner

from conftest import tiny_model

from longctx_patch.errors import ConfigError, DeviceError
from longctx_patch.evals import approx, niah, ppl, speed, speed_model
from longctx_patch.evals.common import MethodRun, parse_fractions, parse_methods, parse_size, parse_sizes

RESULT_FIELDS = {"device", "date", "commit", "command", "model", "method", "config"}


@pytest.fixture(scope="module")
def tok():
    from longctx_patch.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def tiny(tok):
    """A tiny random llama that speaks the SmolLM2 tokenizer's vocabulary."""
    return tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048), tok


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tiny[0].save_pretrained(d)
    tiny[1].save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def essays(pg_essays_dir):
    return niah.load_haystack(pg_essays_dir)


# ----------------------------------------------------------------------------------------------- parsing
def test_parse_methods_targets_keys():
    runs = parse_methods(["exact", "sliding-window"], ["sliding-window.window=256"])
    assert [(r.name, r.config) for r in runs] == [("exact", {}), ("sliding-window", {"window": 256})]
    assert runs[1].label == "sliding-window(window=256)"
    # a plain key goes to every selected method that has it
    runs = parse_methods(["none", "exact", "sliding-window"], ["window=64"])
    assert [r.config for r in runs] == [{}, {}, {"window": 64}]
    assert not runs[0].patched and runs[0].name == "none"
    assert parse_methods(["unpatched"])[0].name == "none"


def test_parse_methods_inline_configs_compare_a_method_with_itself():
    runs = parse_methods(["lolcats", "lola(window=64,sparse_cache=64)", "lola(window=256, sparse_cache=256)", "lola"],
                         ["lola.chunk=32", "lola.window=128"])
    assert [r.label for r in runs] == [
        "lolcats", "lola(chunk=32,window=64,sparse_cache=64)", "lola(chunk=32,window=256,sparse_cache=256)",
        "lola(chunk=32,window=128)"]  # --set reaches every lola entry; inline values win
    assert runs[1].config == {"chunk": 32, "window": 64, "sparse_cache": 64}


def test_parse_methods_layers_patch_only_those_layers():
    """layers=RANGES in an inline config patches only those decoder layers (lp.patch's syntax, ranges joined by
    '+' because ',' separates the inline items); the others stay exact."""
    from conftest import tiny_model

    from longctx_patch.evals.common import applied

    runs = parse_methods(["lola(window=64,layers=1-2)", "lola(window=64)", "lola(layers=0+2)"])
    assert runs[0].layers == "1-2" and runs[0].config == {"window": 64} and runs[1].layers is None
    assert runs[0].label == "lola(window=64,layers=1-2)" and runs[2].label == "lola(layers=0+2)"
    model = tiny_model("llama")
    for run, patched in ((runs[0], [False, True, True]), (runs[2], [True, False, True])):
        base = [type(layer.self_attn) for layer in tiny_model("llama").model.layers]
        with applied(model, run):
            got = [type(layer.self_attn) is not b for layer, b in zip(model.model.layers, base)]
        assert got == patched
    with pytest.raises(ConfigError, match="out of range"):
        with applied(model, parse_methods(["lola(layers=0-5)"])[0]):
            pass


@pytest.mark.parametrize(
    "methods, sets, words",
    [
        (["nope"], [], "unknown method"),
        (["exact"], ["window=3"], "no selected method has a key"),
        (["exact"], ["sliding-window.window=3"], "not selected"),
        (["sliding-window"], ["sliding-window.windw=3"], "no key 'windw'"),
        (["sliding-window"], ["sliding-window.window=0"], "window"),
        (["sliding-window"], ["window"], "METHOD.KEY=VALUE"),
        (["exact", "exact"], [], "twice"),
        (["lola(window=64)", "lola(window=64)"], [], "twice"),
        (["lola(window=64"], [], "NAME(KEY=VALUE,...)"),
        (["lola(window)"], [], "is not KEY=VALUE"),
        (["lola(windw=3)"], [], "no key 'windw'"),
        (["lola(layers=a)"], [], "cannot read 'a'"),
        (["lola(layers=3-1)"], [], "reversed range; write it as '1-3'"),
        (["none(window=3)"], [], "has no config"),
        (["lola(window=0)"], [], "window"),
        ([], [], "no method"),
    ],
)
def test_parse_methods_rejects(methods, sets, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_methods(methods, sets)


def test_parse_sizes_and_depths():
    assert parse_sizes("1k, 2k,300") == [1024, 2048, 300]
    assert parse_size("1.5k") == 1536
    assert parse_fractions("0,0.5,1") == [0.0, 0.5, 1.0]
    for bad in ("abc", "0", "-1k", "1.3"):
        with pytest.raises(ConfigError):
            parse_size(bad)
    with pytest.raises(ConfigError):
        parse_fractions("0.5,1.5")


# ----------------------------------------------------------------------------------------------- niah
def test_niah_samples_are_deterministic(tok, essays):
    a = niah.build_sample(tok, "mk-niah", 600, 0.5, seed=3, index=1, haystack=essays)
    b = niah.build_sample(tok, "mk-niah", 600, 0.5, seed=3, index=1, haystack=essays)
    c = niah.build_sample(tok, "mk-niah", 600, 0.5, seed=4, index=1, haystack=essays)
    assert a.input_ids == b.input_ids and a.value == b.value and a.key == b.key
    assert c.input_ids != a.input_ids and c.value != a.value


@pytest.mark.parametrize("task", niah.TASKS)
def test_niah_prompt_length_and_needles(tok, essays, task):
    L = 700
    s = niah.build_sample(tok, task, L, 0.5, seed=0, haystack=essays)
    assert s.prompt_tokens == len(s.input_ids)
    assert L - 8 <= s.prompt_tokens <= L
    text = tok.decode(s.input_ids)
    assert text.count(s.value) == 1
    assert f"What is the special magic {'uuid' if task == 's-niah-3' else 'number'} for {s.key} " in text
    if task == "s-niah-3":
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", s.value)
    else:
        assert re.fullmatch(r"\d{7}", s.value)
    if task == "mk-niah":
        assert len(s.distractors) == niah.MK_DISTRACTORS
        keys = {d["key"] for d in s.distractors} | {s.key}
        values = {d["value"] for d in s.distractors} | {s.value}
        assert len(keys) == len(values) == niah.MK_DISTRACTORS + 1
        for d in s.distractors:
            assert f"One of the special magic numbers for {d['key']} is: {d['value']}." in text
    else:
        assert s.distractors == []
    if task == "s-niah-1":
        assert "The grass is green." in text
    if tok.chat_template:
        assert text.rstrip().endswith(f"The special magic {'uuid' if task == 's-niah-3' else 'number'} for {s.key} mentioned in the provided text is")


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_niah_needle_at_requested_depth(tok, essays, depth):
    """Tokenise the prompt back and count haystack tokens in front of the needle."""
    s = niah.build_sample(tok, "s-niah-2", 1024, depth, seed=1, haystack=essays)
    text = tok.decode(s.input_ids)
    needle = f"One of the special magic numbers for {s.key} is: {s.value}."
    head = "I will quiz you about the numbers afterwards.\n"
    c0 = text.index(head) + len(head)
    c1 = text.index("\nWhat is the special magic number for")
    n0 = text.index(needle)
    ntok = lambda t: len(tok(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    before = ntok(text[c0:n0].strip())
    total = ntok(text[c0:n0].strip()) + ntok(text[n0 + len(needle) : c1].strip())
    assert abs(before / total - depth) < 0.04, (before, total)
    assert abs(s.needle_depth - depth) < 0.04


@pytest.mark.parametrize("task", ["s-niah-1", "s-niah-2"])
def test_niah_value_span_points_at_the_value(tok, essays, task):
    s = niah.build_sample(tok, task, 700, 0.4, seed=2, haystack=essays)
    span = niah.value_span(tok, s)
    assert tok.decode(s.input_ids[span]) == s.value
    assert span.stop < len(s.input_ids) - 10  # the needle, not the question (which names the key, not the value)
    with pytest.raises(ValueError, match="not in the prompt"):
        niah.value_span(tok, niah.NiahSample(**{**s.__dict__, "value": "x9q"}))


def test_niah_filler_depth_is_tight(tok):
    for depth in (0.1, 0.6, 0.9):
        s = niah.build_sample(tok, "s-niah-1", 2048, depth, seed=0)
        assert abs(s.needle_depth - depth) < 0.01


def test_niah_too_short_and_bad_task(tok):
    with pytest.raises(ConfigError, match="too short"):
        niah.build_sample(tok, "s-niah-2", 40, 0.5)
    with pytest.raises(ConfigError, match="unknown niah task"):
        niah.build_sample(tok, "s-niah-9", 400, 0.5)
    with pytest.raises(ConfigError, match="--haystack '/nonexistent/dir': no such file or directory"):
        niah.load_haystack("/nonexistent/dir")


def test_niah_score_is_exact():
    assert niah.score(" 1234567.", "1234567")
    assert niah.score("The number is 1234567", "1234567")
    assert not niah.score("12345678", "1234567")
    assert not niah.score("01234567", "1234567")
    assert not niah.score("123 4567", "1234567")
    assert not niah.score("1234566", "1234567")
    u = "2a577eee-b3f8-4e87-b669-244cccd5a0af"
    assert niah.score(f": {u.upper()}.", u)
    assert not niah.score(": 2a577eee-b3f8-4e87-b669-244cccd5a0a", u)


def test_run_niah_writes_json_and_heatmap(tiny, tmp_path):
    runs = parse_methods(["exact", "sliding-window"], ["window=32"])
    res = niah.run_niah(tiny, runs, tasks=["s-niah-2"], lengths=[160, 200], depths=[1.0], samples=1,
                        out_dir=tmp_path, name="n", model_name="tiny", progress=False, echo=lambda *_: None)
    data = json.loads((tmp_path / "n.json").read_text())
    assert RESULT_FIELDS <= set(data)
    assert data["method"] == ["exact", "sliding-window(window=32)"]
    assert data["config"]["sliding-window(window=32)"] == {"window": 32}
    assert data["task"] == "niah" and data["model"] == "tiny"
    assert set(data["accuracy"]["exact"]) == {"s-niah-2"}
    assert set(data["accuracy"]["exact"]["s-niah-2"]) == {"160", "200"}
    assert set(data["accuracy_by_depth"]["exact"]["s-niah-2"]["200"]) == {"1"}
    assert len(data["samples"]) == 2 * 2
    for r in data["samples"]:
        assert r["correct"] == niah.score(r["answer"], r["value"])
    assert (tmp_path / "n.png").stat().st_size > 1000
    assert res["figures"]["overall"].keys() == {"exact", "sliding-window(window=32)"}
    pa = data["paired"]["sliding-window(window=32)"]
    assert pa["all"]["both"] + pa["all"]["only_reference"] + pa["all"]["only_method"] + pa["all"]["neither"] == 2


def test_niah_table_shows_depth_and_length():
    """The terminal table splits each task by needle depth as well as length (the heatmap's cells), with a row over
    every depth per task and one over every sample per method."""
    def rec(i, length, depth, ok):
        return dict(method="exact", task="s-niah-1", length=length, depth=depth, index=i, correct=ok)

    # depth 0.5 found at 1k only, depth 0.9 at both lengths
    records = [rec(0, 1024, 0.5, True), rec(0, 2048, 0.5, False), rec(0, 1024, 0.9, True), rec(0, 2048, 0.9, True)]
    figures = niah.summarize(records, ["exact"], ["s-niah-1"], [1024, 2048], [0.5, 0.9])
    lines = niah.accuracy_table(figures, ["exact"], ["s-niah-1"], [1024, 2048], [0.5, 0.9]).splitlines()
    assert lines[0].split() == ["method", "task", "depth", "1k", "2k", "mean"]
    rows = [line.split() for line in lines[2:]]
    assert rows == [["exact", "s-niah-1", "0.5", "1", "0", "0.5"],
                    ["exact", "s-niah-1", "0.9", "1", "1", "1"],
                    ["exact", "s-niah-1", "all", "1", "0.5", "0.75"],
                    ["exact", "all", "all", "0.75"]]


def test_niah_paired_counts_and_mcnemar():
    """The paired comparison matches samples by (task, length, depth, index) across methods, whatever their order
    in the records; the McNemar p-value is the exact binomial tail."""
    def rec(method, i, ok, task="s-niah-2"):
        return dict(method=method, task=task, length=100, depth=0.5, index=i, correct=ok)

    ref = [True, True, False, False, True, False]
    alt = [True, False, True, False, False, False]
    records = [rec("exact", i, ok) for i, ok in enumerate(ref)] + [rec("m", i, ok) for i, ok in reversed(list(enumerate(alt)))]
    p = niah.paired(records, ["exact", "m"], ["s-niah-2"], [100])
    assert p["reference"] == "exact"
    assert p["m"]["all"] == {"both": 1, "only_reference": 2, "only_method": 1, "neither": 2, "mcnemar_p": 1.0}
    assert p["m"]["s-niah-2 100"] == p["m"]["all"]
    assert niah.mcnemar_p(0, 0) == 1.0
    assert niah.mcnemar_p(0, 6) == pytest.approx(2 / 64)  # 6 discordant, all one way
    assert niah.mcnemar_p(1, 9) == pytest.approx(2 * 11 / 1024)
    assert niah.paired(records, ["exact"], ["s-niah-2"], [100]) == {}
    assert "2 samples only exact answers, 1 only m" in niah.paired_lines({"paired": p})
    assert "(McNemar p = 1)" in niah.paired_lines({"paired": p})


def test_p_values_print_as_a_bound_below_one_in_a_million():
    """One formatter prints every p-value: three significant digits, `p < 1e-6` where an exact tail is smaller (never
    `p = 0`); the JSON keeps the exact value."""
    from longctx_patch.evals.common import format_p

    assert format_p(1.0) == "p = 1" and format_p(0.03125) == "p = 0.0312" and format_p(2.4e-6) == "p = 2.4e-06"
    assert format_p(0.0) == "p < 1e-6" and format_p(9.3e-10) == "p < 1e-6"

    def rec(method, i, ok):
        return dict(method=method, task="s-niah-2", length=100, depth=0.5, index=i, correct=ok)

    records = [rec("exact", i, True) for i in range(40)] + [rec("m", i, False) for i in range(40)]
    p = niah.paired(records, ["exact", "m"], ["s-niah-2"], [100])
    assert p["m"]["all"]["mcnemar_p"] == pytest.approx(2 / 2**40)  # not rounded to 0
    assert "(McNemar p < 1e-6)" in niah.paired_lines({"paired": p}) and "p = 0" not in niah.paired_lines({"paired": p})


def test_smollm2_finds_needle_in_essays(smollm2, essays):
    """The real embedded model retrieves a 7-digit number from Paul Graham essays at 1k tokens."""
    model, tok = smollm2
    s = niah.build_sample(tok, "s-niah-2", 1024, 0.5, seed=0, haystack=essays)
    answer = niah.generate_answer(model, tok, s.input_ids, 16)
    assert niah.score(answer, s.value), answer


# ----------------------------------------------------------------------------------------------- approx
def _text_docs():
    return [niah.load_haystack(None)]


def test_approx_zero_for_exact_positive_for_perturbed(tiny, tmp_path):
    runs = parse_methods(["exact", "sliding-window"], ["window=8"])
    res = approx.run_approx(tiny, runs, _text_docs(), length=48, lengths=[33], out_dir=tmp_path, name="a",
                            model_name="tiny", echo=lambda *_: None)
    f = res["figures"]
    n_layers = tiny[0].config.num_hidden_layers
    assert list(f["rel_error_per_layer"]["exact"]) == [str(i) for i in range(n_layers)]
    assert all(e == 0.0 for e in f["rel_error_per_layer"]["exact"].values())
    assert all(e > 1e-3 for e in f["rel_error_per_layer"]["sliding-window(window=8)"].values())
    assert f["rel_error_synthetic"]["exact"]["33"] == 0.0
    assert f["rel_error_synthetic"]["sliding-window(window=8)"]["33"] > 1e-3
    data = json.loads((tmp_path / "a.json").read_text())
    assert RESULT_FIELDS <= set(data) and (tmp_path / "a.png").exists()


def test_approx_capture_matches_manual_attention(tiny):
    """The captured q/k/v reproduce the captured exact output, and a window >= length gives 0 error."""
    from longctx_patch.kernels.softmax import softmax_attention

    model, tok = tiny
    ids = torch.tensor([tok("one two three four five six seven eight nine ten")["input_ids"]])
    cap = approx.capture(model, ids, layers="1")
    assert list(cap) == [1]
    q, k, v, o = cap[1]
    assert q.shape[1] == 4 and k.shape[1] == 2 and q.shape[2] == ids.shape[1]
    torch.testing.assert_close(softmax_attention(q, k, v, scale=q.shape[-1] ** -0.5), o)
    res = approx.run_approx(tiny, parse_methods(["sliding-window"], ["window=64"]), _text_docs(), length=40,
                            out_dir=None, echo=lambda *_: None)
    assert max(res["figures"]["rel_error_per_layer"]["sliding-window(window=64)"].values()) < 1e-6


def test_approx_refuses_unpatched(tiny):
    with pytest.raises(ConfigError, match="drop --method none"):
        approx.run_approx(tiny, [MethodRun("none")], _text_docs(), length=16, out_dir=None, echo=lambda *_: None)


# ----------------------------------------------------------------------------------------------- ppl
def test_token_losses_match_hf_loss(tiny, monkeypatch):
    model, tok = tiny
    ids = torch.tensor([ppl.token_stream(tok, ["The quick brown fox jumps over the lazy dog. " * 6])[:50]])
    monkeypatch.setattr(ppl, "LOSS_CHUNK", 7)  # odd chunks across the sequence
    losses = ppl.token_losses(model, ids)
    assert losses.shape == (49,)
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(losses.mean(), ref.float(), rtol=1e-5, atol=1e-5)


def test_run_ppl_buckets_and_reference(tiny, tmp_path):
    runs = parse_methods(["none", "exact", "sliding-window"], ["window=16"])
    res = ppl.run_ppl(tiny, runs, _text_docs(), contexts=[64, 96], max_windows=2, buckets=4, out_dir=tmp_path,
                      name="p", model_name="tiny", progress=False, echo=lambda *_: None)
    f = res["figures"]
    assert f["reference"] == "none"
    assert f["windows"] == {"64": 2, "96": 2}
    d = f["loss_by_position"]["exact"]["64"]
    assert d["edges"] == [0, 16, 32, 48, 64] and sum(d["tokens"]) == 2 * 63
    # exact attention is the unpatched model's attention
    assert abs(f["nll_delta_vs_reference"]["exact"]["64"]) < 1e-4
    # within the window nothing changes, beyond it the loss does
    sw = f["loss_by_position"]["sliding-window(window=16)"]["64"]["loss"]
    assert abs(sw[0] - d["loss"][0]) < 1e-4 and abs(sw[3] - d["loss"][3]) > 1e-4
    data = json.loads((tmp_path / "p.json").read_text())
    assert RESULT_FIELDS <= set(data) and data["ppl"]["none"]["64"] > 1 and (tmp_path / "p.png").exists()
    # every option as the patch ran it, beside the ones given: the config's defaults (or an asset's) are on record
    eff = data["effective_config"]
    assert set(eff) == {"exact", "sliding-window(window=16)"} and eff["sliding-window(window=16)"]["window"] == 16
    from longctx_patch.methods import get_method

    assert eff["exact"] == get_method("exact").parse_config({}).to_dict()


def test_ppl_text_sources(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 10)
    (tmp_path / "b.txt").write_text("beta " * 10)
    (tmp_path / "LICENSE.txt").write_text("licence text")
    assert len(ppl.load_texts(tmp_path)) == 2
    # the same files as `longctx finetune --text`: source code too, sub-folders too (not the folder's notes)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def f():\n    return 1\n")
    (tmp_path / "pkg" / "blob.bin").write_bytes(b"\x00\x01")
    assert sorted(ppl.load_texts(tmp_path)) == sorted(["alpha " * 10, "beta " * 10, "def f():\n    return 1\n"])
    with pytest.raises(ConfigError, match="exactly one"):
        ppl.load_texts(None)
    with pytest.raises(ConfigError, match="no such file or directory"):
        ppl.load_texts(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no text files"):
        ppl.load_texts(tmp_path / "empty")


def test_ppl_dataset_source(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"body": ["x y z", "u v w"]}).save_to_disk(str(tmp_path / "ds"))
    assert ppl.load_texts(dataset=str(tmp_path / "ds"), field="body") == ["x y z", "u v w"]
    with pytest.raises(ConfigError, match="no field 'text'"):
        ppl.load_texts(dataset=str(tmp_path / "ds"))


# ----------------------------------------------------------------------------------------------- speed
def test_model_speed_fields(tiny, tmp_path):
    runs = parse_methods(["exact", "sliding-window"], ["window=16"])
    res = speed.run_speed(tiny, runs, contexts=[16, 64], batches=[1, 3], calls=[6, 20], repeats=2, static=True,
                          out_dir=tmp_path, name="s", model_name="tiny", echo=lambda *_: None)
    fig = res["figures"]
    r = fig["results"]
    labels = ("exact", "sliding-window(window=16)", speed_model.STATIC)
    for lab in labels:
        for b in ("b1", "b3"):
            for c in ("16", "64"):
                cell = r[lab][b][c]
                assert set(cell["calls"]) == {"6", "20"}
                for n, call in cell["calls"].items():
                    # tokens/s over the call's whole decode: batch x (N - 1) tokens in (N - 1) steps
                    want = int(b[1:]) * 1e3 / call["ms_per_step"]
                    assert call["decode_tok_s"] == pytest.approx(want, rel=1e-2) and call["generate_s"] > 0
                    assert set(call["step_ms"]) == ({"1-16"} if n == "6" else {"1-16", "17-64"})
                # the longest call: its steps 17-19 are the steady state, steps 1-16 against them the warm-up
                assert cell["decode_tok_s"] == cell["calls"]["20"]["decode_tok_s"]
                assert cell["steady_ms"] == cell["step_ms"]["17-64"] and cell["floor_ms"] > 0
                assert cell["warmup_ratio"] == pytest.approx(cell["step_ms"]["1-16"] / cell["steady_ms"], rel=1e-2)
                assert cell["floor_ratio"] == pytest.approx(cell["steady_ms"] / cell["floor_ms"], rel=1e-2)
                assert (cell["prefill_s"] is None) == (lab == speed_model.STATIC)
    from longctx_patch.methods.kv_layer import capacity_for

    cfg = tiny[0].config
    # the preallocated buffers (methods/kv_layer.py): K and V of the capacity, the validity mask, the write slot
    per_row = lambda cap: cfg.num_hidden_layers * (2 * cfg.num_key_value_heads * cap * 16 * 4 + cap + 8)  # noqa: E731
    full = per_row(capacity_for(64 + 20))  # fp32
    assert r["exact"]["b1"]["64"]["state_bytes"] == full and r["exact"]["b3"]["64"]["state_bytes"] == 3 * full
    assert r["sliding-window(window=16)"]["b1"]["64"]["state_bytes"] == per_row(16)
    # the floor: (weights + state) read once at the measured copy bandwidth (which counts read + written bytes)
    want = 1e3 * (fig["weights_bytes"] + full) / fig["copy_bandwidth_Bps"]
    assert r["exact"]["b1"]["64"]["floor_ms"] == pytest.approx(want, rel=1e-3)
    emb = tiny[0].get_input_embeddings().weight
    assert fig["weights_bytes"] == sum(p.numel() * 4 for p in tiny[0].parameters()) - emb.numel() * 4  # untied
    assert set(fig["speedup_vs_reference"]) == {"sliding-window(window=16)", speed_model.STATIC}
    assert fig["speedup_vs_reference"][speed_model.STATIC]["b3"]["64"]["prefill"] is None
    assert RESULT_FIELDS <= set(json.loads((tmp_path / "s.json").read_text()))
    assert (tmp_path / "s.png").is_file()


def test_decode_time_is_marked_inside_one_generate(tiny, monkeypatch):
    """Each forward of one generate() call is timed from the mark after the one before (the first from the call's
    start): the prefill first, then every decode step; the marks count every step."""
    model = tiny[0]
    ids = torch.randint(100, model.config.vocab_size, (2, 24))
    calls = []
    real = model.forward

    def counted(*a, **kw):
        calls.append(time.perf_counter())
        return real(*a, **kw)

    monkeypatch.setattr(model, "forward", counted)
    total, steps = speed_model.timed_generate(model, ids, 9, {}, marked=True)
    assert len(calls) == 9 and len(steps) == 9  # the prefill and 8 decode steps
    assert 0 < sum(steps) / 1e3 <= total
    decode = sum(steps[3:]) / 1e3
    # steps 3 .. 8 began after the end of step 2, so their span covers their six forwards and no earlier one
    assert decode <= calls[-1] - calls[2] + (total - (calls[-1] - calls[0]))
    assert decode >= calls[-1] - calls[3]
    assert speed_model.step_ranges([5.0] + [1.0] * 16 + [2.0] * 3) == {"1-16": 1.0, "17-64": 2.0}


def test_model_speed_cells(tiny, tmp_path):
    """`cells` times only the (batch, context) pairs asked for, not the product of batches and contexts; with
    `prefill_chunk` the prompt goes through the cache in chunks (prefill and generate())."""
    runs = parse_methods(["exact"], [])
    res = speed.run_speed(tiny, runs, cells=[(3, 16), (1, 64)], calls=[16], repeats=2, out_dir=tmp_path,
                          name="c", model_name="tiny", prefill_chunk=24, echo=lambda *_: None)
    assert res["figures"]["prefill_chunk"] == 24
    r = res["figures"]["results"]["exact"]
    assert {b: set(per) for b, per in r.items()} == {"b3": {"16"}, "b1": {"64"}}
    assert r["b3"]["16"]["prefill_s"] > 0 and r["b1"]["64"]["prefill_s"] > 0, r
    assert res["figures"]["batches"] == [1, 3] and res["figures"]["contexts"] == [16, 64]


def test_model_speed_keeps_finished_methods(tiny, tmp_path, monkeypatch):
    """A method that fails (a crash, a time limit) leaves the rows of the methods before it on disk."""
    runs = parse_methods(["exact", "sliding-window"], ["window=16"])
    real = speed_model.time_cell

    def cell(model, **kw):
        from longctx_patch.patcher import is_patched, patched_modules

        if is_patched(model) and patched_modules(model)[0].method_name == "sliding-window":
            raise RuntimeError("killed")
        return real(model, **kw)

    monkeypatch.setattr(speed_model, "time_cell", cell)
    with pytest.raises(RuntimeError, match="killed"):
        speed.run_speed(tiny, runs, cells=[(1, 16)], calls=[4], repeats=1, out_dir=tmp_path, name="p",
                        model_name="tiny", echo=lambda *_: None)
    rec = json.loads((tmp_path / "p.json").read_text())
    assert set(rec["results"]) == {"exact"} and rec["complete"] is False
    assert rec["results"]["exact"]["b1"]["16"]["prefill_s"] > 0


@pytest.mark.parametrize("decode_graphs,env,want", [(False, None, False), (True, "0", True), (None, "0", False),
                                                     (None, None, True)])
def test_model_speed_passes_decode_graphs_down(tiny, tmp_path, monkeypatch, decode_graphs, env, want):
    """`decode_graphs=` reaches patch() for every patched method, over the user's LONGCTX_DECODE_GRAPHS (a benchmark
    sets no environment variable); None keeps patch()'s default, that switch included; the result records the one in
    force."""
    from longctx_patch.patch_state import state_of

    if env is None:
        monkeypatch.delenv("LONGCTX_DECODE_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("LONGCTX_DECODE_GRAPHS", env)
    seen = []
    real = speed_model.time_cell

    def cell(model, **kw):
        seen.append(state_of(model).decode_graphs.enabled)
        return real(model, **kw)

    monkeypatch.setattr(speed_model, "time_cell", cell)
    res = speed.run_speed(tiny, parse_methods(["exact"], []), cells=[(1, 16)], calls=[2], repeats=1,
                          decode_graphs=decode_graphs, out_dir=tmp_path, name="g", model_name="tiny",
                          echo=lambda *_: None)
    assert seen == [want, want]  # the warm-up and the cell
    assert res["figures"]["decode_graphs"] is want
    with pytest.raises(ConfigError, match="decode_graphs must be True, False or None"):
        speed.run_speed(tiny, parse_methods(["exact"], []), decode_graphs="off", out_dir=None)


def test_cli_speed_refuses_a_bad_batch_before_loading(tmp_path):
    from longctx_patch.cli.eval_cmd import eval_group

    out = CliRunner().invoke(eval_group, ["speed", "--model", str(tmp_path / "nothing"), "--batch", "1,x"])
    assert out.exit_code != 0 and "--batch" in out.output and "integers" in out.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_op_speed_refuses_without_cuda():
    with pytest.raises(DeviceError, match="CUDA"):
        speed.run_op_speed(parse_methods(["exact"]), lengths=[64])


def test_time_ops_pipeline_on_cpu():
    """The op-level pipeline (baselines, fwd+bwd, ratios, output check) with a plain timer on the CPU."""
    import time

    from longctx_patch.methods import get_method

    def bench(fn):
        t0 = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - t0)

    ops = {
        "exact": (speed.method_op("exact"), get_method("exact").parse_config({})),
        "sw": (speed.method_op("sliding-window"), get_method("sliding-window").parse_config({"window": 4})),
    }
    res = speed.time_ops(ops, [16, 33], heads=4, kv_heads=2, head_dim=8, dtype=torch.float32, modes=["fwd", "fwd+bwd"],
                         device=torch.device("cpu"), bench=bench, echo=lambda *_: None)
    assert set(res) == {"16", "33"} and set(res["33"]) == {"fwd", "fwd+bwd"}
    for mode in ("fwd", "fwd+bwd"):
        row = res["33"][mode]
        assert row["exact"]["ms"] > 0 and row["sw"]["ms"] > 0
        assert {"sdpa-cudnn", "sdpa-flash"} <= set(row)
        for b in ("sdpa-cudnn", "sdpa-flash"):
            assert (row[b]["ms"] is None) == ("error" in row[b])
            if row[b]["ms"]:
                assert row["exact"][f"ratio_vs_{b}"] == pytest.approx(row["exact"]["ms"] / row[b]["ms"], rel=1e-3, abs=1e-4)
    fwd = res["33"]["fwd"]
    if any(fwd[b]["ms"] for b in ("sdpa-cudnn", "sdpa-flash")):
        assert fwd["exact"]["rel_error_vs_exact"] < 1e-5 < fwd["sw"]["rel_error_vs_exact"]
        assert fwd["exact"]["best_exact"].startswith("sdpa-")


def test_method_ops_match_reference():
    from longctx_patch.methods import get_method
    from longctx_patch.kernels.softmax import softmax_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 13, 8, generator=g), torch.randn(1, 2, 13, 8, generator=g), torch.randn(1, 2, 13, 8, generator=g)
    o = speed.method_op("exact")(q, k, v, scale=0.3, config=get_method("exact").parse_config({}))
    torch.testing.assert_close(o, softmax_attention(q, k, v, scale=0.3))
    o = speed.method_op("sliding-window")(q, k, v, scale=0.3, config=get_method("sliding-window").parse_config({"window": 4}))
    torch.testing.assert_close(o, softmax_attention(q, k, v, scale=0.3, window=4))


# ----------------------------------------------------------------------------------------------- CLI
def _cli(args):
    from longctx_patch.cli.eval_cmd import eval_group

    return CliRunner().invoke(eval_group, args, catch_exceptions=False)


def test_cli_niah_runs(tiny_dir, tmp_path):
    r = _cli(["niah", "--model", str(tiny_dir), "--method", "exact", "--method", "sliding-window", "--set",
              "sliding-window.window=32", "--tasks", "s-niah-1", "--lengths", "150", "--depths", "0.5",
              "--no-progress", "--out-dir", str(tmp_path), "--name", "c"])
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["command"].startswith("longctx eval niah --model")
    assert "--set sliding-window.window=32" in data["command"]
    assert "s-niah-1" in r.output and (tmp_path / "c.png").exists()


def test_cli_approx_and_ppl_run(tiny_dir, tmp_path):
    r = _cli(["approx", "--model", str(tiny_dir), "--method", "sliding-window", "--set", "window=8", "--length", "40",
              "--lengths", "20", "--out-dir", str(tmp_path), "--name", "a"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "a.json").read_text())["rel_error_mean"]["sliding-window(window=8)"] > 0
    r = _cli(["ppl", "--model", str(tiny_dir), "--method", "sliding-window", "--set", "window=8", "--context", "48",
              "--windows", "1", "--buckets", "2", "--no-progress", "--out-dir", str(tmp_path), "--name", "p"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "p.json").read_text())["method"] == ["exact", "sliding-window(window=8)"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["niah", "--lengths", "abc"], "bad length 'abc'"),
        (["niah", "--method", "nope"], "unknown method 'nope'"),
        (["niah", "--set", "window=3"], "no selected method has a key 'window'"),
        (["niah", "--depths", "2"], "bad depth"),
        (["niah", "--haystack", "/no/such/dir"], "--haystack '/no/such/dir': no such file or directory"),
        (["ppl", "--text", "/no/such/file.txt"], "--text '/no/such/file.txt': no such file or directory"),
        (["speed", "--op", "--lengths", "1k"], "CUDA"),
    ],
)
def test_cli_bad_input_one_line(args, words):
    if "--op" in args and torch.cuda.is_available():
        pytest.skip("the op-level refusal only happens without CUDA")
    r = CliRunner().invoke(__import__("longctx_patch.cli.eval_cmd", fromlist=["eval_group"]).eval_group, args)
    assert r.exit_code != 0
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], r.output
