"""The corpus builder (benchmarks/data): deterministic code selection, deduplication, the held-out/training split,
the repetition rule and the manifest, on small fixtures (a fake environment, local prose, a tiny sdist)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from benchmarks.data import build_corpus, corpus, prose, pycode
from longctx_patch.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
LETTERS = str.maketrans("0123456789", "ghijklmnop")  # fixture words have no digits (digits mark data files)


def word_tokenizer(path: Path) -> Path:
    """A whitespace/punctuation word-level tokenizer.json (every unknown word one [UNK] token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<eos>": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def para(seed: str, words: int = 60) -> str:
    """A paragraph of distinct-looking words (over MIN_BLOCK characters), the same for the same seed."""
    h = hashlib.sha256(seed.encode()).hexdigest().translate(LETTERS)
    return " ".join(f"w{h[i % 60:i % 60 + 4]}{str(i).translate(LETTERS)}" for i in range(words)) + "."


def code_file(seed: str, funcs: int = 6) -> str:
    return "\n\n".join(f"def f_{seed}_{i}(x):\n    '''{para(seed + str(i), 12)}'''\n    return x + y\n"
                       for i in range(funcs))


def make_env(root: Path, order: int = 1) -> tuple[Path, Path]:
    """A fake standard library and site-packages. `order` reverses the creation order of files (the selection must
    not depend on it)."""
    stdlib, site = root / "stdlib", root / "site"
    files = {
        stdlib / "json" / "decoder.py": code_file("dec"),
        stdlib / "json" / "encoder.py": code_file("enc"),
        stdlib / "site-packages" / "x.py": code_file("nested"),
        site / "alpha" / "__init__.py": "",
        site / "alpha" / "core.py": code_file("core"),
        site / "alpha" / "util.py": code_file("util"),
        site / "alpha" / "_vendor" / "six.py": code_file("six"),
        site / "alpha" / "msg_pb2.py": code_file("pb"),
        site / "alpha" / "gen.py": "# This file was automatically generated. Do not edit.\n" + code_file("gen"),
        site / "alpha" / "mini.py": "x = [" + ", ".join(str(i) for i in range(400)) + "]\n" + "y" * 3000 + "\n",
        site / "beta" / "copy_of_core.py": code_file("core").replace("\n", "  \r\n"),
        site / "beta" / "graph.py": code_file("graph"),
        site / "beta" / "sub" / "deep.py": code_file("deep"),
        site / "heldpkg" / "algo.py": code_file("algo", 30),
        site / "heldpkg" / "more.py": code_file("more", 30),
        site / "heldpkg" / "a" / "inner.py": code_file("inner"),  # walked after algo.py, sorted before it
        site / "solo.py": code_file("solo"),
        site / "alpha-1.0.dist-info" / "x.py": code_file("meta"),
    }
    items = list(files.items())
    for path, text in items[::order]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    (site / "alpha" / "latin.py").write_bytes(("# caf\xe9\n" + code_file("latin")).encode("latin-1"))
    return stdlib, site


def roots(stdlib: Path, site: Path):
    return [("stdlib", stdlib), ("site", site)]


# ----------------------------------------------------------------------------------------------- selection
def test_code_selection_is_deterministic_and_skips(tmp_path):
    a = pycode.select_files(roots(*make_env(tmp_path / "a")))
    b = pycode.select_files(roots(*make_env(tmp_path / "b", order=-1)))
    key = lambda s: [(f.package, f.rel, f.sha256) for f in s.files]  # noqa: E731
    assert key(a) == key(b)
    assert a.skipped == b.skipped
    kept = {(f.package, f.rel) for f in a.files}
    assert kept == {
        ("stdlib", "json/decoder.py"), ("stdlib", "json/encoder.py"),
        ("alpha", "alpha/core.py"), ("alpha", "alpha/util.py"),
        ("beta", "beta/graph.py"), ("beta", "beta/sub/deep.py"),
        ("heldpkg", "heldpkg/algo.py"), ("heldpkg", "heldpkg/more.py"), ("heldpkg", "heldpkg/a/inner.py"),
        ("solo", "solo.py"),
    }
    assert a.skipped == {"vendored": 1, "generated": 2, "too small": 1, "long lines (minified or data)": 1,
                         "not utf-8": 1}
    # beta/copy_of_core.py is alpha/core.py with CRLF newlines and trailing spaces: one content, kept once
    assert a.duplicates == 1
    docs_a = corpus.group_by_folder([(f.package, f.rel, f.text, f.sha256) for f in a.files])
    docs_b = corpus.group_by_folder([(f.package, f.rel, f.text, f.sha256) for f in b.files])
    assert docs_a == docs_b
    assert [d[1] for d in docs_a][:3] == ["alpha/alpha#0", "beta/beta#0", "beta/beta/sub#0"]
    assert docs_a[0][2].startswith("# alpha/alpha/core.py\n\ndef f_core_0")


def test_selection_by_package_names_and_seen_hashes(tmp_path):
    env = roots(*make_env(tmp_path))
    sel = pycode.select_files(env, include=["alpha", "beta"])
    assert set(sel.packages) == {"alpha", "beta"}
    sel = pycode.select_files(env, exclude=["heldpkg", "stdlib"])
    assert "heldpkg" not in sel.packages and "stdlib" not in sel.packages
    core = next(f for f in sel.files if f.rel == "alpha/core.py")
    # a hash seen elsewhere (a held-out file) is dropped, and then beta's copy of it too
    sel2 = pycode.select_files(env, exclude=["heldpkg"], seen={core.sha256})
    assert all(f.sha256 != core.sha256 for f in sel2.files)
    assert sel2.duplicates == 2


# ----------------------------------------------------------------------------------------------- dedupe
def test_block_dedupe_cuts_long_repeats_only():
    d = corpus.BlockDedupe()
    long1, long2 = para("one"), para("two")
    held = para("held")
    d.add(held)
    t1 = d.filter(f"Title\n\n{long1}\n\nshort line\n\n{long2}\n")
    assert t1 == f"Title\n\n{long1}\n\nshort line\n\n{long2}\n"
    # the same long paragraph with other spacing, a held-out one, and short blocks that repeat
    spaced = long1.replace(" ", "  ", 3)
    t2 = d.filter(f"Title\n\n{spaced}\n\n{held}\n\nshort line\n\nnew {long2} more\n")
    assert t2 == f"Title\n\nshort line\n\nnew {long2} more\n"
    assert d.dropped_blocks == 2
    assert d.filter(f"{long1}\n\n\n{held}\n") == ""


def test_take_fair_and_split_halves():
    docs = [corpus.Doc(f"big/{i}", "code", "big", para(f"big{i}", 100)) for i in range(10)]
    docs += [corpus.Doc(f"small/{i}", "code", "small", para(f"small{i}", 10)) for i in range(3)]
    docs += [corpus.Doc(f"mid/{i}", "prose", "mid", para(f"mid{i}", 30)) for i in range(6)]
    taken = corpus.take_fair(docs, 400, corpus.BlockDedupe(), WordCounter())
    by = {s: sum(d.tokens for d in taken if d.source == s) for s in ("big", "small", "mid")}
    # the source with the fewest tokens so far goes next: small (3 x 10) comes whole, mid and big share the rest
    assert by["small"] == 30 and abs(by["big"] - by["mid"]) <= 100
    assert 400 <= sum(by.values()) < 400 + 100
    assert [d.name for d in corpus.take_fair(docs, 400, corpus.BlockDedupe(), WordCounter())] == [d.name for d in taken]
    halves = corpus.split_halves(taken)
    assert sorted(d.name for h in halves.values() for d in h) == sorted(d.name for d in taken)
    for kind, biggest in (("code", 100), ("prose", 30)):
        n = [sum(d.tokens for d in halves[h] if d.kind == kind) for h in ("train-a", "train-b")]
        assert abs(n[0] - n[1]) <= biggest


class WordCounter:
    def count(self, text: str) -> int:
        return len(text.split())


class BatchWordCounter(WordCounter):
    """Counts many texts at once as the tokenizer's Counter does (`counts`), recording what it was asked."""

    def __init__(self):
        self.batches: list[int] = []
        self.singles = 0

    def counts(self, texts):
        self.batches.append(len(texts))
        return [len(t.split()) for t in texts]

    def count(self, text: str) -> int:
        self.singles += 1
        return super().count(text)


@pytest.mark.parametrize("guess", ["chars", "too high"])
def test_take_fair_counts_ahead_in_batches_with_the_same_result(guess, monkeypatch):
    """A counter with `counts`: the documents taken, their texts and counts are those of one count at a time. The
    counts come in two batches (a sample, what the first pass reaches: a document the deduplication cuts counted as
    cut); where the first pass's guess stops short of the budget, the rest are counted one at a time."""
    docs = [corpus.Doc(f"big/{i}", "code", "big", para(f"big{i}", 100)) for i in range(80)]
    docs += [corpus.Doc(f"mid/{i}", "prose", "mid", para(f"mid{i}", 30)) for i in range(6)]
    # a source's first document (in the sample, counted whole) that the deduplication cuts
    docs += [corpus.Doc("dup/0", "prose", "dup", para("held", 100) + "\n\n" + para("own", 30))]
    if guess == "too high":  # tokens guessed 1000x: the first pass stops after one document, so dup/0 keeps the
        monkeypatch.setattr(corpus._Chars, "count", lambda self, text: 1000 * len(text.split()))  # sample's count

    def dedupe():  # the held-out paragraph dup/0 repeats
        d = corpus.BlockDedupe()
        d.add(para("held", 100))
        return d

    one = corpus.take_fair(docs, 5000, dedupe(), WordCounter())
    batch = BatchWordCounter()
    got = corpus.take_fair(docs, 5000, dedupe(), batch)
    assert [(d.name, d.text, d.tokens) for d in got] == [(d.name, d.text, d.tokens) for d in one]
    given = {d.name: d.text for d in docs}
    cut = [d for d in got if d.text != given[d.name] + "\n"]
    assert [(d.name, d.tokens) for d in cut] == [("dup/0", 30)]  # cut to its own block
    assert len(batch.batches) == 2
    if guess == "chars":
        assert batch.singles == 0
    else:
        assert batch.singles > len(got) / 2


def test_long_documents_cut_books_and_join_essays():
    book = "\n\n".join(para(f"book{j}", 20) for j in range(40))  # 40 blocks of 21 words
    essays = [("e", f"e{i}.txt", "\n\n".join(para(f"e{i}-{j}", 20) for j in range(2)), f"h{i}") for i in range(5)]
    docs = corpus.long_documents([("b", "book.txt", book, "hb")] + essays, WordCounter(), 100, "prose")
    by = {s: [d for d in docs if d.source == s] for s in ("b", "e")}
    assert all(d.tokens >= 100 and d.tokens == len(d.text.split()) for d in docs)
    assert len(by["b"]) == 8  # 40 x 21 words + headers cut at >= 100 words
    assert by["b"][0].text.startswith("# b/book.txt\n\n")
    assert all(d.text.startswith("# b/book.txt (continued)\n\n") for d in by["b"][1:])
    assert all(d.files == ["hb"] for d in by["b"])
    # five essays of 2 + 42 words: the first document ends inside e2 (after 111 words), the second goes on
    # from there ("continued") and takes the remainder (e4's last block, too short for a third)
    assert [d.files for d in by["e"]] == [["h0", "h1", "h2"], ["h2", "h3", "h4"]]
    assert by["e"][1].text.startswith("# e/e2.txt (continued)\n\n")
    for i in range(5):
        assert sum(d.text.count(f"# e/e{i}.txt\n") for d in by["e"]) == 1
    # every block of the sources is in exactly one document
    keys = [k for d in docs for k in corpus.block_keys(d.text)]
    assert len(keys) == len(set(keys)) == sum(len(corpus.block_keys(t)) for t in [book] + [e[2] for e in essays])
    # a source too short for one document gives none
    assert corpus.long_documents([("s", "x.txt", para("short", 20), "hs")], WordCounter(), 100, "prose") == []


# ----------------------------------------------------------------------------------------------- end to end
def make_sources(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """A manifest with a local held-out prose folder, an environment held-out code source, a training prose
    folder and a training sdist in the cache; returns (sources.json, cache, stdlib, site)."""
    stdlib, site = make_env(tmp_path / "env")
    essays = tmp_path / "essays"
    essays.mkdir()
    for i in range(4):
        (essays / f"e{i}.txt").write_text("\n\n".join(para(f"essay{i}-{j}") for j in range(6)) + "\n")
    (essays / "SOURCE-LICENSE.txt").write_text("MIT " * 200)
    docs = tmp_path / "docs"
    (docs / "guide").mkdir(parents=True)
    shared = para("shared-between-docs")
    for i in range(6):
        (docs / "guide" / f"p{i}.rst").write_text(f"Page {i}\n======\n\n{para(f'doc{i}')}\n\n{shared}\n\n{para(f'doc{i}b')}\n")
    (docs / "guide" / "copy.rst").write_text((docs / "guide" / "p0.rst").read_text())  # a duplicate file
    (docs / "guide" / "AUTHORS.rst").write_text("\n".join(f"Name {i}" for i in range(300)))
    (docs / "guide" / "table.rst").write_text("| 1 | 2 | 3 |\n" * 200)
    (docs / "guide" / "quote.rst").write_text(f"Quoted\n\n{para('essay0-0')}\n\n{para('doc-quote')}\n")  # held-out text
    cache = tmp_path / "cache"
    cache.mkdir()
    tgz = cache / "pkgdoc-1.0.tar.gz"
    with tarfile.open(tgz, "w:gz") as t:
        for name, text in {"pkgdoc-1.0/docs/intro.md": "\n\n".join(para(f"intro{j}") for j in range(5)),
                           "pkgdoc-1.0/docs/api/ref.txt": "\n\n".join(para(f"ref{j}") for j in range(5)),
                           "pkgdoc-1.0/docs/api/skip.txt": "\n\n".join(para(f"skip{j}") for j in range(5)),
                           "pkgdoc-1.0/src/pkgdoc.py": code_file("pkgdoc")}.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    manifest = {
        "heldout_code_packages": ["heldpkg"],
        "sources": [
            {"name": "essays", "dist": "local", "path": str(essays), "include": ["*.txt"],
             "exclude": ["SOURCE-LICENSE.txt"], "format": "files", "role": "heldout", "kind": "prose",
             "licence": "MIT"},
            {"name": "heldpkg", "dist": "environment", "packages": ["heldpkg"], "format": "python",
             "role": "heldout", "kind": "code", "licence": "BSD-3-Clause"},
            {"name": "localdocs", "dist": "local", "path": str(docs), "include": ["**/*.rst"], "format": "files",
             "role": "train", "kind": "prose", "licence": "CC0-1.0"},
            {"name": "pkgdoc", "version": "1.0", "dist": "sdist", "file": tgz.name,
             "sha256": prose.sha256_file(tgz), "include": ["docs/**/*.md", "docs/**/*.txt"],
             "exclude": ["docs/api/skip.txt"], "format": "files", "role": "train", "kind": "prose",
             "licence": "MIT"},
        ],
    }
    src = tmp_path / "sources.json"
    src.write_text(json.dumps(manifest))
    return src, cache, stdlib, site


def run_cli(*args) -> int:
    return build_corpus.main([str(a) for a in args])


def build_small(tmp_path: Path, train_tokens: int = 100_000) -> tuple[Path, Path]:
    src, cache, stdlib, site = make_sources(tmp_path)
    tok = word_tokenizer(tmp_path / "tok")
    common = ["--sources", src, "--tokenizer", tok]
    assert run_cli(*common, "pack", "--cache", cache, "--out", tmp_path / "pack", "--record", "--piece-mib", 0.002,
                   "--stdlib", stdlib, "--site", site) == 0
    out = tmp_path / "corpus"
    assert run_cli(*common, "build", "--pack", tmp_path / "pack", "--out", out, "--train-tokens", train_tokens,
                   "--heldout-min-tokens", 150, "--stdlib", stdlib, "--site", site) == 0
    return src, out


def test_build_splits_and_never_repeats(tmp_path):
    src, out = build_small(tmp_path)
    m = json.loads((out / "corpus.json").read_text())
    manifest = json.loads(src.read_text())
    # the manifest now records every source's measured counts and content hash, and the pack's pieces
    assert [s["name"] for s in manifest["sources"]] == ["essays", "heldpkg", "localdocs", "pkgdoc"]
    assert all(s["measured"]["tokens"] >= s["measured"]["distinct_tokens"] > 0 for s in manifest["sources"])
    assert len(manifest["pack"]["pieces"]) >= 2  # 2 KiB pieces
    localdocs = next(s for s in manifest["sources"] if s["name"] == "localdocs")
    assert localdocs["measured"]["files"] == 8  # p0..p5, copy, quote (AUTHORS and the table are no prose)
    assert localdocs["measured"]["distinct_tokens"] < localdocs["measured"]["tokens"]
    sets = m["sets"]
    held_sources = {d["source"] for s in ("heldout/code", "heldout/prose") for d in sets[s]["documents"]}
    train_sources = {d["source"] for s in ("train-a", "train-b") for d in sets[s]["documents"]}
    assert m["tokenizer"]["same_as_sources_json"] is True
    assert held_sources == {"essays", "heldpkg"}
    assert "heldpkg" not in train_sources and "essays" not in train_sources
    assert {"localdocs", "pkgdoc", "stdlib", "alpha", "beta", "solo"} <= train_sources
    assert all(d["tokens"] >= 150 for s in ("heldout/code", "heldout/prose") for d in sets[s]["documents"])
    assert sets["train-a"]["documents"] and sets["train-b"]["documents"]
    for kind in ("code", "prose"):  # both halves get the same mix, within one document
        per = {s: sum(d["tokens"] for d in sets[s]["documents"] if d["kind"] == kind) for s in ("train-a", "train-b")}
        biggest = max(d["tokens"] for s in ("train-a", "train-b") for d in sets[s]["documents"] if d["kind"] == kind)
        assert abs(per["train-a"] - per["train-b"]) <= biggest
    summary = corpus.check_corpus(out)
    assert summary["train-a"]["documents"] == len(sets["train-a"]["documents"])
    texts = [p.read_text() for s in ("train-a", "train-b") for p in sorted((out / s).iterdir())]
    train_text = "\n".join(texts)
    # the paragraph shared by six pages is there once; the held-out essay paragraph quoted in the docs is gone;
    # the excluded and non-prose members are absent
    assert train_text.count(para("shared-between-docs")) == 1
    assert para("essay0-0") not in train_text and para("doc-quote") in train_text
    assert para("skip0") not in train_text and "Name 12" not in train_text and para("intro3") in train_text
    keys = [k for t in texts for k in corpus.block_keys(t)]
    assert len(keys) == len(set(keys))


def test_build_is_reproducible(tmp_path):
    src1, out1 = build_small(tmp_path / "one")
    src2, out2 = build_small(tmp_path / "two")
    m1 = json.loads((out1 / "corpus.json").read_text())
    m2 = json.loads((out2 / "corpus.json").read_text())
    # other folders, same files: the same pack (content hashes are over paths inside each source) and documents
    assert json.loads(src1.read_text())["pack"] == json.loads(src2.read_text())["pack"]
    assert m1["sets"] == m2["sets"]
    assert m1["dropped_blocks"] == m2["dropped_blocks"] > 0


def test_token_budget_is_shared_by_packages(tmp_path):
    _, full = build_small(tmp_path / "full")
    src, cache, stdlib, site = make_sources(tmp_path / "part")
    tok = word_tokenizer(tmp_path / "tok")
    out = tmp_path / "part" / "corpus"
    assert run_cli("--sources", src, "--tokenizer", tok, "pack", "--cache", cache, "--out", tmp_path / "part" / "pack",
                   "--record", "--stdlib", stdlib, "--site", site) == 0
    assert run_cli("--sources", src, "--tokenizer", tok, "build", "--pack", tmp_path / "part" / "pack", "--out", out,
                   "--train-tokens", 500, "--max-prose-fraction", 0, "--heldout-min-tokens", 150,
                   "--stdlib", stdlib, "--site", site) == 0
    m = json.loads((out / "corpus.json").read_text())
    mf = json.loads((full / "corpus.json").read_text())
    train = [d for s in ("train-a", "train-b") for d in m["sets"][s]["documents"]]
    assert m["train_tokens"]["prose"] == 0 and all(d["kind"] == "code" for d in train)
    code = m["train_tokens"]["code"]
    assert 500 <= code < mf["train_tokens"]["code"]
    assert code - max(d["tokens"] for d in train) < 500  # it stopped at the first document past the budget
    assert len({d["source"] for d in train}) >= 2  # shared among packages, not the first one alone


def test_check_corpus_finds_tampering(tmp_path):
    _, out = build_small(tmp_path)
    corpus.check_corpus(out)
    victim = next((out / "train-a").iterdir())
    good = victim.read_text()
    victim.write_text(good + "x")
    with pytest.raises(ConfigError, match="does not match its sha256"):
        corpus.check_corpus(out)
    victim.write_text(good)
    (out / "train-b" / "extra.txt").write_text("extra")
    with pytest.raises(ConfigError, match="files not in corpus.json"):
        corpus.check_corpus(out)
    (out / "train-b" / "extra.txt").unlink()
    # a held-out document copied into training, listed as such
    m = json.loads((out / "corpus.json").read_text())
    h = m["sets"]["heldout/prose"]["documents"][0]
    shutil.copy(out / "heldout/prose" / h["file"], out / "train-b" / "leak.txt")
    m["sets"]["train-b"]["documents"].append(dict(h, file="leak.txt"))
    (out / "corpus.json").write_text(json.dumps(m))
    with pytest.raises(ConfigError, match="both training and held-out"):
        corpus.check_corpus(out)


def test_pack_is_checked_against_the_manifest(tmp_path):
    src, out = build_small(tmp_path)
    manifest = json.loads(src.read_text())
    pack_dir = tmp_path / "pack"
    pieces = sorted(pack_dir.iterdir())
    assert [p.name for p in pieces] == [p["file"] for p in manifest["pack"]["pieces"]]  # the pieces alone
    records = build_corpus.read_pack(pack_dir, manifest)
    whole = tmp_path / build_corpus.PACK_NAME  # `cat` of the pieces: the same records
    whole.write_bytes(b"".join(p.read_bytes() for p in pieces))
    assert prose.sha256_file(whole) == manifest["pack"]["sha256"]
    assert build_corpus.read_pack(whole, manifest) == records
    assert {r["source"] for r in records} == {"essays", "heldpkg", "localdocs", "pkgdoc"}
    bad = dict(manifest, sources=[dict(s, content_sha256="0" * 64) if s["name"] == "pkgdoc" else s
                                  for s in manifest["sources"]])
    with pytest.raises(ConfigError, match="pkgdoc"):
        build_corpus.read_pack(pack_dir, bad)
    first = pack_dir / manifest["pack"]["pieces"][0]["file"]
    first.write_bytes(first.read_bytes()[:-1] + b"\0")
    with pytest.raises(ConfigError, match="sha256 differs"):
        build_corpus.read_pack(pack_dir, manifest)
    # a source changed after it was recorded, and an archive that is not the recorded one
    essays = Path(next(s for s in manifest["sources"] if s["name"] == "essays")["path"])
    (essays / "e0.txt").write_text(para("changed") * 3)
    with pytest.raises(ConfigError, match="essays"):
        build_corpus.read_sources(manifest, tmp_path / "cache", [tmp_path / "env" / "site"])
    sdist = next(s for s in manifest["sources"] if s["name"] == "pkgdoc")
    with pytest.raises(ConfigError, match="sha256"):
        prose.fetch(dict(sdist, sha256="1" * 64), tmp_path / "cache")


def test_content_hash_is_of_the_selection_not_its_order():
    files = [prose.TextFile("s", "b/x.txt", "one"), prose.TextFile("s", "a.txt", "two")]
    assert prose.content_sha256(files) == prose.content_sha256(files[::-1])
    assert prose.content_sha256(files) != prose.content_sha256([files[0], prose.TextFile("s", "a.txt", "two!")])
    assert prose.content_sha256(files) != prose.content_sha256([files[0], prose.TextFile("s", "c.txt", "two")])


def test_globs():
    assert prose.selected("docs/a/b/c.rst", ["docs/**/*.rst"])
    assert prose.selected("docs/c.rst", ["docs/**/*.rst"])
    assert not prose.selected("src/docs/c.rst", ["docs/**/*.rst"])
    assert not prose.selected("docs/a/c.rst", ["docs/*.rst"])
    assert not prose.selected("docs/releases/1.0.txt", ["docs/**/*.txt"], ["docs/releases/**"])


# ----------------------------------------------------------------------------------------------- plan
def test_check_plan():
    sets = {"train-a": 1_000_000, "train-b": 1_000_000}
    st = lambda name, s, steps, seq=4096, b=16: {"name": name, "set": s, "seq_len": seq, "batch_size": b,  # noqa: E731
                                                 "grad_accum": 1, "steps": steps}
    rows = corpus.check_plan([st("t4", "train-a", 14), st("t16", "train-a", 3, 16384, 4),
                              st("l4", "train-b", 14), st("l16", "train-b", 3, 16384, 4)], sets, 0.02)
    assert [r["epoch_fraction"] for r in rows] == [round(224 / 239, 4), round(12 / 60, 4)] * 2
    with pytest.raises(ConfigError, match="repeat within the stage"):
        corpus.check_plan([st("t4", "train-a", 15)], sets, 0.02)  # 240 chunks > 239
    with pytest.raises(ConfigError, match="more than two stages"):
        corpus.check_plan([st("a", "train-a", 1), st("b", "train-a", 1), st("c", "train-a", 1)], sets, 0.02)
    with pytest.raises(ConfigError, match="does not have"):
        corpus.check_plan([st("a", "train-c", 1)], sets, 0.02)


def test_the_qwen_recipe_fits_a_corpus_of_two_12m_halves():
    stages, eval_fraction = build_corpus.recipe_stages(str(REPO / "recipes" / "linearize-qwen.yaml"),
                                                       build_corpus.DEFAULT_PHASES)
    assert [(s["name"], s["set"], s["seq_len"]) for s in stages] == [
        ("transfer_4k", "train-a", 4096), ("transfer_16k", "train-a", 16384),
        ("lora_4k", "train-b", 4096), ("lora_16k", "train-b", 16384)]
    rows = corpus.check_plan(stages, {"train-a": 12_000_000, "train-b": 12_000_000}, eval_fraction)
    assert sum(r["tokens"] for r in rows) >= 40_000_000
    assert all(0.8 < r["epoch_fraction"] < 0.9 for r in rows)
    with pytest.raises(ConfigError, match="repeat within the stage"):
        corpus.check_plan(stages, {"train-a": 10_000_000, "train-b": 12_000_000}, eval_fraction)


def test_heldout_only_build(tmp_path):
    src, _ = build_small(tmp_path)
    tok = tmp_path / "tok" / "tokenizer.json"
    out = tmp_path / "heldout-only"
    env = tmp_path / "env"
    assert run_cli("--sources", src, "--tokenizer", tok, "build", "--pack", tmp_path / "pack", "--out", out,
                   "--train-tokens", 0, "--heldout-min-tokens", 150, "--stdlib", env / "stdlib",
                   "--site", env / "site") == 0
    m = json.loads((out / "corpus.json").read_text())
    assert m["sets"]["train-a"]["documents"] == [] and m["sets"]["train-b"]["documents"] == []
    full = json.loads((tmp_path / "corpus" / "corpus.json").read_text())
    for s in ("heldout/code", "heldout/prose"):  # the same held-out sets as the full build
        assert m["sets"][s] == full["sets"][s]
    corpus.check_corpus(out)
