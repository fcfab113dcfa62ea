"""RULER's synthetic tasks: seeded generation, prompt lengths, answers recoverable from the prompt text alone,
RULER's scorers, haystacks, the run + result files, `longctx eval ruler`; and the real Qwen2.5-Coder on one sample
(marked slow + qwen: not in the default suite, run it with -m qwen)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from click.testing import CliRunner

from conftest import tiny_model

from longctx_patch.errors import ConfigError
from longctx_patch.evals import niah, ruler, ruler_run
from longctx_patch.evals.common import MethodRun

RESULT_FIELDS = {"device", "date", "commit", "command", "model", "method", "config"}
# how far below the length a prompt may end: about one haystack unit (a token of essay, a filler line, a needle
# line, a list word and its repeats, a zipf step), measured with the SmolLM2 tokenizer
TOLERANCE = {"niah_single_1": 30, "niah_multikey_2": 40, "niah_multikey_3": 100, "vt": 30, "cwe": 40, "fwe": 40}
ESSAY_TOLERANCE = 8


@pytest.fixture(scope="module")
def tok():
    from longctx_patch.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


def _text(tok, s):
    return tok.decode(s.input_ids)


# ----------------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("task", ruler.TASKS)
def test_samples_are_deterministic_from_the_seed(tok, task):
    L = 1200
    a = ruler.build_sample(tok, task, L, seed=3, index=1)
    b = ruler.build_sample(tok, task, L, seed=3, index=1)
    assert a == b and a.input_ids == b.input_ids
    c = ruler.build_sample(tok, task, L, seed=4, index=1)
    d = ruler.build_sample(tok, task, L, seed=3, index=2)
    assert c.input_ids != a.input_ids and d.input_ids != a.input_ids
    assert c.answers != a.answers and d.answers != a.answers


@pytest.mark.parametrize("length", [1200, 4096])
@pytest.mark.parametrize("task", ruler.TASKS)
def test_prompt_plus_generation_budget_fills_the_length(tok, task, length):
    s = ruler.build_sample(tok, task, length, seed=0)
    assert s.max_new_tokens == ruler.TOKENS_TO_GENERATE[ruler.family(task)]
    assert len(s.input_ids) == s.prompt_tokens
    total = s.prompt_tokens + s.max_new_tokens
    essay = task in ruler.NIAH and ruler.NIAH[task].haystack == "essay"
    assert length - (ESSAY_TOLERANCE if essay else TOLERANCE[task]) <= total <= length, (task, total)
    assert s.units > 0


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_2", "vt", "cwe", "fwe"])
def test_32k_prompts(tok, task):
    s = ruler.build_sample(tok, task, 32768, seed=1)
    total = s.prompt_tokens + s.max_new_tokens
    assert 32768 - (ESSAY_TOLERANCE if task == "niah_single_2" else TOLERANCE[task]) <= total <= 32768


def _niah_solve(text: str, task: str) -> tuple[list[str], dict[str, list[str]]]:
    """The values the question asks for, read off the prompt: the keys after 'for' in the question, and the
    needles 'One of the special magic ... for KEY is: VALUE.'."""
    kind = ruler.NIAH[task].value
    singular = kind[:-1]
    q = re.findall(rf"What (?:is|are all) the special magic (?:{kind}|{singular}) for (.+?) mentioned in the "
                   r"provided text\?", text)
    assert len(q) == 1, q
    keys = re.split(r", and |, ", q[0])
    found: dict[str, list[str]] = {}
    for k, v in re.findall(rf"One of the special magic {kind} for (\S+) is: (\S+?)\.(?=\s|$)", text):
        found.setdefault(k, []).append(v)
    return [v for k in keys for v in found.get(k, [])], found


@pytest.mark.parametrize("task", [t for t in ruler.TASKS if t.startswith("niah_")])
def test_niah_answers_are_recoverable_from_the_prompt(tok, task):
    cfg = ruler.NIAH[task]
    s = ruler.build_sample(tok, task, 2048, seed=5)
    text = _text(tok, s)
    want, needles = _niah_solve(text, task)
    assert sorted(want) == sorted(s.answers) and len(s.answers) == cfg.num_v * cfg.num_q
    assert text.rstrip().endswith("mentioned in the provided text " + ("is" if cfg.num_v * cfg.num_q == 1 else "are"))
    asked = re.split(r", and |, ", s.query)
    assert len(asked) == cfg.num_q and all(len(needles[k]) == cfg.num_v for k in asked)
    if cfg.haystack == "needle":  # every line is a needle (the asked key's only once, checked above)
        assert sum(len(v) for v in needles.values()) == s.units + 1
    else:
        assert len(needles) == max(cfg.num_k, cfg.num_q) and sum(map(len, needles.values())) == len(s.depths)
    if cfg.haystack == "noise":
        assert text.count(ruler.NOISE) == s.units
    if cfg.key == "uuids":
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", s.query)
    if cfg.value == "numbers":
        assert all(re.fullmatch(r"\d{7}", v) for v in s.answers)


def _vt_solve(section: str, value: str) -> set[str]:
    """Every variable whose chain of assignments leads to `value`."""
    assign = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)", section))
    out = set()
    for name in assign:
        seen, v = set(), assign[name]
        while v.startswith("VAR ") and v[4:] not in seen:
            seen.add(v[4:])
            v = assign.get(v[4:], "")
        if v == value:
            out.add(name)
    return out


def test_vt_answers_are_recoverable_and_the_worked_example_is_right(tok):
    s = ruler.build_sample(tok, "vt", 3000, seed=2)
    text = _text(tok, s)
    parts = text.split("Memorize and track the chain(s) of variable assignment hidden in the following text.")
    assert len(parts) == 3  # the worked example, then the task
    example, task = parts[1], parts[2]
    q = re.search(r"Question: Find all variables that are assigned the value (\d+) in the text above\.", task)
    assert q and q.group(1) == s.query
    assert _vt_solve(task, s.query) == set(s.answers) and len(s.answers) == ruler.VT_HOPS + 1
    assert all(re.fullmatch(r"[A-Z]{5}", n) for n in s.answers)
    ex_value = re.search(r"assigned the value (\d+), they are:  ([A-Z ]+)\n", example)
    assert ex_value, example[-300:]
    assert _vt_solve(example, ex_value.group(1)) == set(ex_value.group(2).split())
    assert len(tok(example)["input_ids"]) <= ruler.VT_ICL_TOKENS + 5
    assert text.rstrip().endswith(f"{ruler.VT_HOPS + 1} variables are assigned the value {s.query}, they are:")


@pytest.mark.parametrize("length,reps", [(2000, (6, 1)), (4096, (30, 3))])
def test_cwe_answers_are_the_most_common_words_of_the_last_list(tok, length, reps):
    s = ruler.build_sample(tok, "cwe", length, seed=1)
    text = _text(tok, s)
    lists = re.findall(r"Memorize the ones that appear most often\.\n(.*?)\nQuestion:", text, flags=re.S)
    assert len(lists) == 2  # the worked example, then the task
    entries = re.findall(r"(\d+)\. ([a-z]+)", lists[1])
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    top = counts.most_common()
    assert {w for w, _ in top[:10]} == set(s.answers)
    assert {c for _, c in top[:10]} == {reps[0]} and {c for _, c in top[10:]} == {reps[1]}
    ex_answer = re.search(r"appear most often in the list are: ((?:\d+\. [a-z]+ ?){10})", text)
    ex_counts = Counter(re.findall(r"\d+\. ([a-z]+)", lists[0]))
    assert {w for w, _ in ex_counts.most_common(10)} == set(re.findall(r"\d+\. ([a-z]+)", ex_answer.group(1)))


def test_fwe_answers_are_the_three_most_frequent_coded_words(tok):
    s = ruler.build_sample(tok, "fwe", 3000, seed=4)
    text = _text(tok, s)
    body = re.search(r"Find the three most frequently appeared coded words\. (.*?)\nQuestion:", text, flags=re.S)
    counts = Counter(body.group(1).split())
    ranked = counts.most_common()
    assert ranked[0][0] == "..."
    assert [w for w, _ in ranked[1:4]] == s.answers and ranked[3][1] > ranked[4][1]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in s.answers)


def test_plain_prompt_without_chat_template(tok):
    s = ruler.build_sample(tok, "niah_single_2", 900, seed=0, chat=False)
    text = _text(tok, s)
    assert "<|im_start|>" not in text and text.startswith("A special magic number is hidden")
    assert text.endswith("What is the special magic number for " + s.query + " mentioned in the provided text? "
                         "The special magic number for " + s.query + " mentioned in the provided text is")
    assert 900 - ESSAY_TOLERANCE <= s.prompt_tokens + 128 <= 900


def test_too_short_and_unknown_task(tok):
    with pytest.raises(ConfigError, match="too short for ruler task niah_single_1"):
        ruler.build_sample(tok, "niah_single_1", 150)
    with pytest.raises(ConfigError, match="unknown ruler task"):
        ruler.build_sample(tok, "niah_single_4", 1000)
    with pytest.raises(ConfigError, match="samples must be"):
        ruler.make_samples(tok, ["vt"], [1000], 0)


# ----------------------------------------------------------------------------------------------- scoring
def test_scores_are_rulers_on_known_strings():
    preds = ["The numbers are 1234567 and 7654321.", "  apple\tBANANA\x00cherry ", "nothing here", ""]
    refs = [["1234567", "7654321", "1111111"], ["banana", "Cherry"], ["x"], ["a"]]
    assert ruler.string_match_all(preds, refs) == round(100 * (2 / 3 + 1 + 0 + 0) / 4, 2) == 41.67
    assert ruler.string_match_part(preds, refs) == 50.0
    assert ruler.postprocess("  apple\tBANANA\x00cherry \n") == "apple\nBANANA\ncherry"
    assert ruler.score(" 12345678 ", ["1234567"]) == 1.0  # RULER matches substrings, inside longer numbers too
    assert ruler.score("ABCDE, FGHIJ", ["abcde", "fghij", "klmno", "pqrst"]) == 0.5
    assert ruler.match_part("no", ["yes", "no"]) == 1.0 and ruler.match_part("maybe", ["yes", "no"]) == 0.0
    assert ruler.zeta(2.0) == pytest.approx(3.14159265358979 ** 2 / 6, rel=1e-12)


# ----------------------------------------------------------------------------------------------- haystacks
def test_stdlib_haystack_is_sorted_source(tmp_path):
    import os

    text, desc = ruler.load_ruler_haystack("stdlib")
    assert "standard library" in desc and os.path.dirname(os.__file__) in desc
    assert abs(len(text) - ruler.STDLIB_CHARS) < 300_000 and "def " in text and "import " in text
    assert text == ruler.python_source()
    assert text.startswith(open(os.path.join(os.path.dirname(os.__file__), "__future__.py")).read().strip()[:200])
    (tmp_path / "pkg").mkdir()
    (tmp_path / "b.py").write_text("B = 2\n")
    (tmp_path / "a.py").write_text("A = 1\n")
    (tmp_path / "pkg" / "c.py").write_text("C = 3\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "x.py").write_text("X = 0\n")
    assert ruler.python_source(tmp_path) == "A = 1\n\nB = 2\n\nC = 3"
    assert ruler.load_ruler_haystack(tmp_path) == ("A = 1\n\nB = 2\n\nC = 3", f"Python source under {tmp_path}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no .py files"):
        ruler.python_source(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no such file or folder"):
        ruler.load_ruler_haystack(tmp_path / "missing")


def test_text_haystacks_and_a_code_haystack_in_a_prompt(tok, tmp_path):
    default, desc = ruler.load_ruler_haystack(None)
    assert default == niah.load_haystack(None) and "shakespeare" in desc
    d = tmp_path / "docs"
    d.mkdir()
    (d / "one.txt").write_text("First essay. " * 80)
    assert ruler.load_ruler_haystack(d)[0] == niah.load_haystack(d)
    code = ruler.python_source()
    s = ruler.build_sample(tok, "niah_single_2", 1500, seed=0, haystack=code)
    text = _text(tok, s)
    lines = [ln for ln in text.splitlines() if len(ln) > 40 and "special magic" not in ln]
    assert sum(ln in code for ln in lines) >= 0.9 * len(lines) > 10  # the haystack is the source itself
    assert _niah_solve(text, "niah_single_2")[0] == s.answers


# ----------------------------------------------------------------------------------------------- run
@pytest.fixture(scope="module")
def tiny(tok):
    return tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048), tok


def test_run_ruler_writes_json_and_png_with_paired_samples(tiny, tmp_path, one_thread, monkeypatch):
    for fam in ("niah", "fwe"):  # a random model never stops: short answers keep the test fast
        monkeypatch.setitem(ruler.TOKENS_TO_GENERATE, fam, 6)
    runs = [MethodRun("exact"), MethodRun("sliding-window", {"window": 32})]
    res = ruler_run.run_ruler(tiny, runs, tasks=["niah_single_1", "fwe"], lengths=[400], samples=2, seed=1,
                          out_dir=tmp_path, name="r", model_name="tiny", command="test", progress=False,
                          echo=lambda *_: None)
    rec = json.loads((tmp_path / "r.json").read_text())
    assert RESULT_FIELDS <= set(rec) and rec["task"] == "ruler" and rec["command"] == "test"
    assert rec["method"] == ["exact", "sliding-window(window=32)"] and (tmp_path / "r.png").stat().st_size > 0
    rows = rec["samples"]
    assert len(rows) == 2 * 2 * 2
    by = {}
    for r in rows:
        by.setdefault((r["task"], r["length"], r["index"]), []).append(r)
    for pair in by.values():  # the same prompt under both methods
        a, b = pair
        assert {a["method"], b["method"]} == set(rec["method"])
        assert a["answers"] == b["answers"] and a["prompt_tokens"] == b["prompt_tokens"]
        for r in pair:
            assert r["max_new_tokens"] == 6 and r["prompt_tokens"] + 6 <= 400
            assert r["score"] == round(ruler.score(r["answer"], r["answers"]), 4) and r["correct"] == (r["score"] == 1)
    exact = [r for r in rows if r["method"] == "exact" and r["task"] == "fwe" and r["length"] == 400]
    assert rec["score"]["exact"]["fwe"]["400"] == round(100 * sum(r["score"] for r in exact) / 2, 2)
    assert rec["average"]["exact"]["400"] == round((rec["score"]["exact"]["fwe"]["400"]
                                                    + rec["score"]["exact"]["niah_single_1"]["400"]) / 2, 2)
    p = rec["paired"]["sliding-window(window=32)"]["all"]
    assert p["both"] + p["only_reference"] + p["only_method"] + p["neither"] == 4
    assert rec["haystack"] == "none (no essay task)" and rec["samples_per_cell"] == 2
    assert res["json"] == str(tmp_path / "r.json")


def test_cli_eval_ruler(tiny, tmp_path, one_thread, monkeypatch):
    from longctx_patch.cli.main import main

    monkeypatch.setitem(ruler.TOKENS_TO_GENERATE, "niah", 6)

    d = tmp_path / "tiny"
    tiny[0].save_pretrained(d)
    tiny[1].save_pretrained(d)
    src = tmp_path / "src"
    src.mkdir()
    (src / "mod.py").write_text("".join(f'def f{i}(x):\n    """Return x plus {i}."""\n    return x + {i}\n\n\n'
                                        for i in range(200)))
    r = CliRunner().invoke(main, ["eval", "ruler", "--model", str(d), "--method", "exact", "--tasks", "niah_single_2",
                                  "--lengths", "400", "--samples", "1", "--haystack", str(src),
                                  "--out-dir", str(tmp_path / "out"), "--no-progress", "--device", "cpu"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "niah_single_2" in r.output and "average" in r.output
    rec = json.loads(next((tmp_path / "out").glob("ruler-*.json")).read_text())
    assert rec["tasks"] == ["niah_single_2"] and rec["lengths"] == [400]
    assert rec["haystack"] == f"Python source under {src}" and rec["samples"][0]["prompt_tokens"] > 200
    assert rec["command"].startswith("longctx eval ruler ") and f"--haystack {src}" in rec["command"]
    bad = CliRunner().invoke(main, ["eval", "ruler", "--model", str(d), "--tasks", "niah_single_9"])
    assert bad.exit_code == 2 and "unknown ruler task" in bad.output  # the command line's: before the model loads
    assert CliRunner().invoke(main, ["eval", "ruler", "--help"]).exit_code == 0


# ----------------------------------------------------------------------------------------------- real model
@pytest.mark.slow
@pytest.mark.qwen
def test_real_qwen_answers_a_short_ruler_sample():
    """Qwen2.5-Coder-0.5B-Instruct from its six PyPI parts: without them this fails with the install command."""
    import longctx_patch as lp

    model, tok = lp.load_model("qwen2.5-coder-0.5b", dtype="float32", device="cpu")
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (14, 2)
    s = ruler.build_sample(tok, "niah_single_1", 1024, seed=0)
    answer = niah.generate_answer(model, tok, s.input_ids, s.max_new_tokens)
    assert ruler.score(answer, s.answers) == 1.0, (answer, s.answers)
