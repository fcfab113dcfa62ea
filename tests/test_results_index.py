"""benchmarks/results/INDEX.md is what `python -m benchmarks.index` writes from the result files (it cannot go stale), it
lists every result JSON, every result says where, when and from what it came, and the files follow the layout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import index

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
FOLDERS = {"approx", "decode", "finetune", "gpu-integration", "lola", "moba", "multigpu", "muse", "niah", "ovq", "peers",
           "ppl", "racecheck", "ruler", "speed", "speed-op", "synthetic"}
# result files that lack one of index.REQUIRED (task, device, date, commit, command); this list may only shrink
LACKING: dict[str, tuple[str, ...]] = {}
# figures and logs that belong to several runs (no JSON of their own stem)
STANDALONE = {"synthetic/h200-icr-sweep-best.png"}


def result_jsons() -> list[Path]:
    return sorted(RESULTS.rglob("*.json"))


def test_committed_index_is_what_the_results_give(tmp_path):
    out = tmp_path / "INDEX.md"
    assert index.main(["--results", str(RESULTS), "--out", str(out)]) == 0
    committed = (RESULTS / "INDEX.md").read_text()
    assert out.read_text() == committed, "benchmarks/results/INDEX.md is stale: run python -m benchmarks.index"
    assert index.main(["--results", str(RESULTS), "--check"]) == 0


def test_every_result_json_is_listed_once():
    text = (RESULTS / "INDEX.md").read_text()
    linked = re.findall(r"\]\(([^)]+\.json)\)", text)
    files = sorted(p.relative_to(RESULTS).as_posix() for p in result_jsons())
    assert len(files) > 200
    assert sorted(linked) == files
    assert f"{len(files)} result files" in text


def test_every_result_says_task_device_date_commit_and_command():
    lacking = {}
    for p in result_jsons():
        d = json.loads(p.read_text())
        missing = tuple(k for k in index.REQUIRED if not d.get(k))
        if missing:
            lacking[p.relative_to(RESULTS).as_posix()] = missing
        else:
            assert re.match(r"\d{4}-\d{2}-\d{2}", str(d["date"])), p
            assert re.match(r"[0-9a-f]{7,40}(\s|$)", str(d["commit"])), p
    assert lacking == {k: v for k, v in LACKING.items() if k in lacking}, "a result file lacks a required field"
    assert set(lacking) <= set(LACKING), f"new result files without {index.REQUIRED}: {sorted(set(lacking) - set(LACKING))}"


def test_every_result_spells_its_device_one_way():
    """One spelling (longctx_patch.provenance.device_description): a GPU's name, "CPU (...)", "N x ..." for a run of
    N processes; no "cuda: " prefix, no lower-case "cpu", no notes."""
    from longctx_patch.provenance import DEVICE_SPELLING

    bad = {p.relative_to(RESULTS).as_posix(): d["device"] for p in result_jsons()
           if not DEVICE_SPELLING.fullmatch(str((d := json.loads(p.read_text())).get("device")))}
    assert bad == {}, bad


def test_the_index_shows_unknown_for_what_a_file_does_not_say(tmp_path):
    (tmp_path / "niah").mkdir()
    rec = {"task": "niah", "device": "cpu", "date": "2026-12-01T00:00:00Z", "command": "longctx eval niah",
           "model": "m", "method": ["exact"], "overall": {"exact": 0.5}}
    (tmp_path / "niah" / "m-exact-cpu.json").write_text(json.dumps(rec))
    (tmp_path / "lola").mkdir()
    (tmp_path / "lola" / "speed-h200-abc1234.json").write_text(json.dumps({"device": "NVIDIA H200", "commit": "abc1234"}))
    rows = index.collect(tmp_path)
    assert [r.file for r in rows] == ["lola/speed-h200-abc1234.json", "niah/m-exact-cpu.json"]
    speed, niah = rows
    assert (niah.task, niah.commit, niah.headline, niah.missing) == ("niah", "unknown", "accuracy: exact 0.50", ("commit",))
    # the task is what the file says, never guessed from its place
    assert (speed.task, speed.date, speed.model, speed.method, speed.headline) == ("unknown", "unknown", "-", "-", "-")
    assert speed.missing == ("task", "date", "command")
    text = index.render(rows)
    assert "- `niah/m-exact-cpu.json`: no commit" in text
    assert "- `lola/speed-h200-abc1234.json`: no task, date, command" in text


def test_files_are_laid_out_by_task():
    """Every file in benchmarks/results/<folder>/; in a folder that holds several tasks, a file whose task is
    `<folder>-<kind>` is named `<kind>-...` (lola/speed-h200-34dbded.json says lola-speed)."""
    tasks: dict[str, set[str]] = {}
    for p in result_jsons():
        tasks.setdefault(p.relative_to(RESULTS).parts[0], set()).add(json.loads(p.read_text()).get("task", ""))
    for p in RESULTS.rglob("*"):
        rel = p.relative_to(RESULTS)
        if p.is_dir():
            assert len(rel.parts) == 1 and rel.name in FOLDERS, f"unexpected folder {rel}"
            continue
        if rel.as_posix() == "INDEX.md":
            continue
        assert len(rel.parts) == 2 and rel.parts[0] in FOLDERS, f"{rel}: results go in benchmarks/results/<task>/"
        assert p.suffix in (".json", ".png", ".log"), rel
        assert re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", rel.stem, re.IGNORECASE), rel
        if p.suffix == ".json":
            folder, task = rel.parts[0], json.loads(p.read_text()).get("task", "")
            kind = task.removeprefix(folder + "-")
            if len(tasks[folder]) > 1 and kind != task:
                assert rel.stem == kind or rel.stem.startswith(kind + "-"), \
                    f"{rel}: its task is {task}: names of {folder}/'s {task} files start with {kind}-"
            device = r"(cpu|h100|h200)(x[0-9]+)?"
            if rel.parts[0] == "synthetic":
                assert re.match(device + "-", rel.stem), f"{rel}: synthetic/<device>-<run>-<task>.json"
            else:
                assert re.search(r"-" + device + r"(-[0-9a-f]{7})?$", rel.stem), f"{rel}: ...-<device>[-<commit>].json"


@pytest.mark.parametrize("ext", [".png", ".log"])
def test_plots_and_logs_sit_beside_their_json(ext):
    stems = {p.relative_to(RESULTS).with_suffix("").as_posix() for p in result_jsons()}
    for p in RESULTS.rglob("*" + ext):
        s = p.relative_to(RESULTS).with_suffix("").as_posix()
        if p.relative_to(RESULTS).as_posix() in STANDALONE:
            continue
        beside = any(s == j or s.startswith(j + "-") for j in stems)  # <json-stem>[-<plot>]
        run_log = ext == ".log" and any(j.startswith(s + "-") for j in stems)  # a run's log: <device>-<run>.log
        assert beside or run_log, f"{p.relative_to(RESULTS)} has no JSON of its stem"


REPO = RESULTS.parents[1]
DOCS = ["README.md", "benchmarks/README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]
# a results path as the docs write it: benchmarks/results/<folder>/<file>, or <folder>/<file> with a folder of FOLDERS;
# {a,b} and {1..8} alternatives and * globs allowed; placeholders (NAME, METHOD, <task>) are not paths
CITED = re.compile(r"(?<![\w/.-])(?:benchmarks/results/)?(?:" + "|".join(sorted(FOLDERS, key=len, reverse=True))
                   + r")/[\w.{},*+-]*\.(?:json|png|log)\b")


def expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    alts = m.group(1).split(",")
    if len(alts) == 1 and re.fullmatch(r"\d+\.\.\d+", alts[0]):
        lo, hi = map(int, alts[0].split(".."))
        alts = [str(i) for i in range(lo, hi + 1)]
    return [x for alt in alts for x in expand(path[:m.start()] + alt + path[m.end():])]


def cited_paths() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = (REPO / doc).read_text()
        for m in CITED.finditer(text):
            path = m.group(0).removeprefix("benchmarks/results/")
            if re.search(r"[A-Z]{3,}|<|\.\.\.", path) and not re.search(r"\{\d+\.\.\d+\}", path):
                continue
            out += [(doc, p) for p in expand(path)]
    return out


def test_every_results_file_the_docs_name_exists():
    """README.md, benchmarks/README.md and docs/*.md name result files as benchmarks/results/<folder>/<file> or
    <folder>/<file>; each one (each alternative of a {a,b} and at least one match of a glob) is in the tree."""
    cited = cited_paths()
    assert len(cited) > 150  # the pattern still finds the docs' citations
    missing = sorted({f"{doc}: {p}" for doc, p in cited if not list(RESULTS.glob(p))})
    assert not missing, "results named in the docs but not in benchmarks/results:\n" + "\n".join(missing)


def test_the_citation_check_finds_what_it_should(tmp_path):
    text = ("see `benchmarks/results/muse/a-{b,c}-h200.json`, `ppl/x-h200.json`, niah/y-{1..2}-h200.json, "
            "`lola/*.json` and `benchmarks/results/TASK/NAME.json`, docs/PERFORMANCE.md")
    found = [p for m in CITED.finditer(text) for p in expand(m.group(0).removeprefix("benchmarks/results/"))
             if not re.search(r"[A-Z]{3,}", p)]
    assert found == ["muse/a-b-h200.json", "muse/a-c-h200.json", "ppl/x-h200.json", "niah/y-1-h200.json",
                     "niah/y-2-h200.json", "lola/*.json"]


def test_a_file_its_rule_cannot_read_is_named(tmp_path):
    """A layout a rule knows to carry none of its figures takes the fallback figure; any other layout its rule cannot
    read stops the index with an error naming the file (no silent fallback)."""
    (tmp_path / "speed").mkdir()
    calls = {"task": "speed", "device": "CPU", "results": {"exact": {"b1": {"1k": {"decode_ms": 2.0}}}}}
    (tmp_path / "speed" / "calls-cpu.json").write_text(json.dumps(calls))  # no reference among its methods
    assert index.collect(tmp_path)[0].headline == "fastest 2 ms"
    (tmp_path / "niah").mkdir()
    (tmp_path / "niah" / "odd-cpu.json").write_text(json.dumps({"task": "niah", "overall": [0.5]}))
    with pytest.raises(index.ResultLayoutError, match=r"niah/odd-cpu\.json: the 'niah' headline cannot be read"):
        index.collect(tmp_path)


# dicts of the scripts that carry a device and a commit but are no result (a file's header read back by another script)
NOT_RESULTS = {("benchmarks/quality/bench_peers_kvpress.py", "info")}


def untasked_records(path: Path) -> list[str]:
    """The dicts a script builds with a `device` and a `commit` (what a result file holds: a dict literal, `dict(...)`,
    `x.update({...})`) but no `task`, as `<name or line>`: the index reads a result's task from the file only."""
    import ast

    tree = ast.parse(path.read_text())
    names = {id(n.value): t.id for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Dict):
            keys = {k.value for k in n.keys if isinstance(k, ast.Constant)}
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "dict":
            keys = {k.arg for k in n.keywords}
        else:
            continue
        if {"device", "commit"} <= keys and "task" not in keys:
            out.append(names.get(id(n), f"line {n.lineno}"))
    return out


def test_every_script_writes_its_task():
    bench = REPO / "benchmarks"
    found = {(p.relative_to(REPO).as_posix(), name) for p in sorted(bench.rglob("*.py")) for name in untasked_records(p)}
    assert found - NOT_RESULTS == set(), f"result records without a task (the index reads it from the file): {found}"
    assert NOT_RESULTS <= found, f"gone: drop from NOT_RESULTS {NOT_RESULTS - found}"


def test_the_record_check_finds_each_form(tmp_path):
    (tmp_path / "b.py").write_text('rec = {"device": 1, "commit": 2}\nok = {"task": "t", "device": 1, "commit": 2}\n'
                                   'RES = dict(device=None, commit="x")\nres = {}\nres.update({"device": 1, "commit": 2})\n')
    assert untasked_records(tmp_path / "b.py") == ["rec", "RES", "line 5"]
