"""Documents, deduplication, the held-out/training split, writing a corpus folder, and its checks.

A corpus folder (`build_corpus build --out DIR`):

    corpus.json          what was built: settings, tokenizer, pack, environment, every document (set, name,
                         source, kind, sha256, tokens, files), totals per source, what was dropped and why
    train-a/*.txt        training text of the attention-transfer stages (one file a document, named by hash)
    train-b/*.txt        training text of the LoRA stages (disjoint from train-a)
    heldout/code/*.txt   held-out code: packages the training never reads, files concatenated in path order
    heldout/prose/*.txt  held-out prose of other kinds than the training prose (essays, drama, scripture)

The rules that make "no text more than twice" hold:
- every file is deduplicated by content hash, and every block (text between blank lines) of at least
  `MIN_BLOCK` characters by the hash of its words: a block seen earlier (held-out first, then training in a
  fixed order) is cut, so no such block appears twice in the training text, nor in training and held-out text;
- train-a and train-b share nothing (`split_halves`), and the recipe (recipes/linearize-qwen.yaml) reads train-a in its two
  transfer stages and train-b in its two LoRA stages, each stage less than one epoch of its folder: every
  token is drawn at most once a stage, so at most twice in all (`check_plan`).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Sequence

from longctx_patch.errors import ConfigError

MIN_BLOCK = 200  # characters: shorter blocks (a heading, `return x`, `else:`) repeat naturally and are kept
BLOCK_SPLIT = re.compile(r"(\n[ \t]*\n)")
SETS = ("train-a", "train-b", "heldout/code", "heldout/prose")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class Doc:
    name: str  # unique: "<source>/<folder>#k" or "<source>-NNN"
    kind: str  # "code" or "prose"
    source: str  # package or source name
    text: str
    files: list[str] = field(default_factory=list)  # sha256 of the files it was made of
    tokens: int = 0

    @property
    def sha256(self) -> str:
        return sha256_text(self.text)


def block_key(block: str) -> str | None:
    """Hash of a block's words (whitespace runs as one space), or None for a block under MIN_BLOCK characters."""
    words = " ".join(block.split())
    if len(words) < MIN_BLOCK:
        return None
    return hashlib.sha256(words.encode("utf-8")).hexdigest()[:32]


def block_keys(text: str) -> list[str]:
    return [k for k in (block_key(b) for b in BLOCK_SPLIT.split(text)[::2]) if k is not None]


def _whole(text: str) -> str:
    """What `BlockDedupe.filter` returns for `text` when it cuts nothing: its blank lines at either end trimmed to one
    final newline ("" for a text of newlines)."""
    kept = text.strip("\n")
    return kept + "\n" if kept else ""


class BlockDedupe:
    """Cuts every block of MIN_BLOCK characters or more whose words were seen before (by any earlier call)."""

    def __init__(self):
        self.seen: set[str] = set()
        self.dropped_blocks = 0
        self.dropped_chars = 0

    def add(self, text: str) -> None:
        """Marks the blocks of `text` as seen without cutting anything (the held-out text)."""
        self.seen.update(block_keys(text))

    def filter(self, text: str) -> str:
        pieces = BLOCK_SPLIT.split(text)
        out: list[str] = []
        for i in range(0, len(pieces), 2):
            b = pieces[i]
            k = block_key(b)
            if k is not None and k in self.seen:
                self.dropped_blocks += 1
                self.dropped_chars += len(b)
                continue
            if k is not None:
                self.seen.add(k)
            if out:
                out.append(pieces[i - 1])  # the blank-line separator before a kept block
            out.append(b)
        return _whole("".join(out))


def group_by_folder(items: Iterable[tuple[str, str, str, str]], max_chars: int = 400_000) -> list[tuple[str, str, str, list[str]]]:
    """(source, name, text, file hashes) per document from (source, rel, text, sha256) files: one source's files
    of one folder, in path order, each after a `# <source>/<rel>` line and a blank line (so
    that the file's own blocks keep their hashes); split at file boundaries past
    `max_chars`."""
    by_dir: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
    for source, rel, text, h in items:
        d = rel.rsplit("/", 1)[0] if "/" in rel else ""
        by_dir.setdefault((source, d), []).append((rel, text, h))
    out = []
    for (source, d), group in sorted(by_dir.items()):
        part: list[str] = []
        hashes: list[str] = []
        size = k = 0
        for rel, text, h in sorted(group):
            block = f"# {source}/{rel}\n\n{text}"
            if part and size + len(block) > max_chars:
                out.append((source, f"{source}/{d}#{k}", "\n".join(part), hashes))
                part, hashes, size, k = [], [], 0, k + 1
            part.append(block)
            hashes.append(h)
            size += len(block)
        if part:
            out.append((source, f"{source}/{d}#{k}", "\n".join(part), hashes))
    return out


def long_documents(
    files: Sequence[tuple[str, str, str, str]], counter, min_tokens: int, kind: str
) -> list[Doc]:
    """Held-out documents of at least `min_tokens` tokens (by `counter`'s exact count): each source's files in path
    order, each after a `# <source>/<rel>` line, cut into documents at block boundaries (blank lines) once the
    count is reached; a document that starts inside a file repeats its line with ` (continued)`, and a shorter
    remainder joins the source's last document. So a long book gives several documents and short essays are
    concatenated, and corpus.json lists the files each document holds. A source that cannot fill one document
    gives none."""
    docs: list[Doc] = []
    by_source: dict[str, list[tuple[str, str, str]]] = {}
    for source, rel, text, h in files:
        by_source.setdefault(source, []).append((rel, text, h))
    for source in sorted(by_source):
        made: list[Doc] = []
        part: list[str] = []
        hashes: list[str] = []
        approx = 0
        for rel, text, h in sorted(by_source[source]):
            blocks = BLOCK_SPLIT.split(text)[::2]
            for i, b in enumerate(blocks):
                if i == 0 or not part:  # a file's first block, or a document starting inside a file
                    part.append(f"# {source}/{rel}{' (continued)' if i else ''}")
                if not hashes or hashes[-1] != h:
                    hashes.append(h)
                part.append(b)
                approx += counter.count(b) + 2
                if approx >= min_tokens:
                    text_now = "\n\n".join(part)
                    n = counter.count(text_now)
                    if n >= min_tokens:
                        made.append(Doc(f"{source}-{len(made):03d}", kind, source, text_now + "\n", hashes, n))
                        part, hashes, approx = [], [], 0
                    else:
                        approx = n
        if part and made:
            last = made[-1]
            last.text = last.text + "\n" + "\n\n".join(part) + "\n"
            last.files += [x for x in hashes if x not in last.files]
            last.tokens = counter.count(last.text)
        docs += made
    return docs


def split_halves(docs: Sequence[Doc]) -> dict[str, list[Doc]]:
    """train-a and train-b: each kind's documents in hash order, each to the half holding fewer tokens of that
    kind so far (train-a on ties), so both halves get the same mix and differ by less than one document."""
    out: dict[str, list[Doc]] = {"train-a": [], "train-b": []}
    for kind in sorted({d.kind for d in docs}):
        n = {"train-a": 0, "train-b": 0}
        for d in sorted((d for d in docs if d.kind == kind), key=lambda d: d.sha256):
            half = "train-a" if n["train-a"] <= n["train-b"] else "train-b"
            out[half].append(d)
            n[half] += d.tokens
    return out


AHEAD_MARGIN = 1.25  # take_fair's first pass picks documents for this many times the budget (see there)
AHEAD_SAMPLE, AHEAD_SAMPLE_CHARS = 64, 1 << 18  # at most these many documents and characters (once passed) set the
# first pass's characters per token


class _Chars:
    """Counts tokens as characters / `per_token` (take_fair's first pass)."""

    def __init__(self, per_token: float):
        self.per_token = per_token

    def count(self, text: str) -> int:
        return max(1, round(len(text) / self.per_token))


def _fair(by_src: dict[str, list[Doc]], budget: float, dedupe: BlockDedupe, count) -> list[tuple[Doc, str, int]]:
    """take_fair's loop: (document as given, text kept, its count) in the order taken; count(src, i, doc, text)."""
    heap = [(0, src, 0) for src in sorted(by_src)]
    heapq.heapify(heap)
    taken: list[tuple[Doc, str, int]] = []
    total = 0
    while heap and total < budget:
        n, src, i = heapq.heappop(heap)
        d = by_src[src][i]
        text = dedupe.filter(d.text)
        if text.strip():
            c = count(src, i, d, text)
            taken.append((d, text, c))
            total += c
            n += c
        if i + 1 < len(by_src[src]):
            heapq.heappush(heap, (n, src, i + 1))
    return taken


def take_fair(docs: Sequence[Doc], budget: float, dedupe: BlockDedupe, counter) -> list[Doc]:
    """Documents up to `budget` tokens, shared fairly among sources: the next document always comes from the source
    with the fewest tokens taken so far (ties by name), each source's in hash order. Each is deduplicated
    (`dedupe.filter`) and counted as it is taken (the given documents are not changed), so small sources come
    whole and large ones share the rest; the last document taken may pass the budget.

    With a counter that counts many texts at once (`counts`: the tokenizer's threads), a first pass on a copy of
    `dedupe` counts characters for tokens (at the characters per token of the first documents of the first
    sources) to pick the documents the budget will likely reach (AHEAD_MARGIN times it); the texts that pass kept
    are counted exactly in batches. The pass that decides then takes a document's batch count where its text is the
    one counted (the same number: one tokenizer, one text; the deduplication cuts the same blocks unless the two
    passes took other documents before it) and counts any other text alone: the result is that of counting one
    text at a time."""
    by_src: dict[str, list[Doc]] = {}
    for d in sorted(docs, key=lambda d: (d.source, d.sha256)):
        by_src.setdefault(d.source, []).append(d)
    counted: dict[tuple[str, int], tuple[str, int]] = {}  # (source, index): a text of the document and its count
    many = getattr(counter, "counts", None)

    def count_all(items: dict[tuple[str, int], str]) -> None:
        counted.update((k, (t, c)) for (k, t), c in zip(items.items(), many(list(items.values()))))

    if many is not None and by_src:
        sample, size = {}, 0
        for src in sorted(by_src):  # each source's first document: the first ones the loop takes
            if len(sample) == AHEAD_SAMPLE or size >= AHEAD_SAMPLE_CHARS:
                break
            sample[(src, 0)] = _whole(by_src[src][0].text)
            size += len(sample[(src, 0)])
        count_all(sample)
        chars = _Chars(sum(map(len, sample.values())) / max(1, sum(counted[k][1] for k in sample)))
        trial = BlockDedupe()
        trial.seen = set(dedupe.seen)
        reached: dict[tuple[str, int], str] = {}

        def guess(src, i, d, text):
            if counted.get((src, i), ("",))[0] != text:
                reached[(src, i)] = text
            return chars.count(text)

        _fair(by_src, AHEAD_MARGIN * budget, trial, guess)
        count_all(reached)

    def count(src, i, d, text):
        t, c = counted.get((src, i), (None, 0))
        return c if t == text else counter.count(text)

    return [replace(d, text=text, tokens=c) for d, text, c in _fair(by_src, budget, dedupe, count)]


# ----------------------------------------------------------------------------------------------- writing
def doc_filename(doc: Doc, set_name: str) -> str:
    if set_name.startswith("heldout"):
        return f"{doc.name}.txt"
    return f"{doc.sha256[:20]}.txt"


def write_corpus(out: Path, sets: dict[str, list[Doc]], info: dict) -> dict:
    """Writes the sets' documents and corpus.json (returned)."""
    out.mkdir(parents=True, exist_ok=True)
    if any((out / s).exists() for s in SETS):
        raise ConfigError(f"{out} already holds a corpus; pass an empty or new --out folder")
    manifest = dict(info)
    manifest["sets"] = {}
    for s in SETS:
        folder = out / s
        folder.mkdir(parents=True)
        rows = []
        for d in sets.get(s, []):
            fn = doc_filename(d, s)
            (folder / fn).write_text(d.text, encoding="utf-8")
            rows.append({"file": fn, "name": d.name, "source": d.source, "kind": d.kind, "sha256": d.sha256,
                         "tokens": d.tokens, "files": len(d.files)})
        manifest["sets"][s] = {"documents": rows, "tokens": sum(r["tokens"] for r in rows),
                               "by_source": _by_source(rows)}
    (out / "corpus.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _by_source(rows: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in rows:
        s = out.setdefault(r["source"], {"kind": r["kind"], "documents": 0, "tokens": 0})
        s["documents"] += 1
        s["tokens"] += r["tokens"]
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------------------------- checks
def check_corpus(out: Path) -> dict:
    """Checks a written corpus against its corpus.json and the rules; raises ConfigError naming the first
    violation, returns a summary. Checked: every listed file exists with its sha256 and no other file is there;
    no document, file hash or block is shared by training and held-out text; no block of MIN_BLOCK characters
    or more appears twice in the training text (train-a and train-b together)."""
    manifest = json.loads((out / "corpus.json").read_text())
    texts: dict[str, list[str]] = {}
    files_of: dict[str, set[str]] = {}
    for s in SETS:
        rows = manifest["sets"][s]["documents"]
        listed = {r["file"] for r in rows}
        present = {p.name for p in (out / s).iterdir()}
        if listed != present:
            extra, missing = sorted(present - listed), sorted(listed - present)
            raise ConfigError(f"{out / s}: files not in corpus.json {extra[:3]}, listed but missing {missing[:3]}")
        texts[s] = []
        for r in rows:
            t = (out / s / r["file"]).read_text(encoding="utf-8")
            if sha256_text(t) != r["sha256"]:
                raise ConfigError(f"{out / s / r['file']}: content does not match its sha256 in corpus.json")
            texts[s].append(t)
        files_of[s] = {r["sha256"] for r in rows}
    train = set(files_of["train-a"]) | set(files_of["train-b"])
    held = set(files_of["heldout/code"]) | set(files_of["heldout/prose"])
    if train & held:
        raise ConfigError(f"{len(train & held)} documents are both training and held-out text")
    if files_of["train-a"] & files_of["train-b"]:
        raise ConfigError("train-a and train-b share documents")
    held_blocks = {k for s in ("heldout/code", "heldout/prose") for t in texts[s] for k in block_keys(t)}
    seen: set[str] = set()
    for s in ("train-a", "train-b"):
        for t in texts[s]:
            for k in block_keys(t):
                if k in held_blocks:
                    raise ConfigError(f"a block of {s} is also in the held-out text")
                if k in seen:
                    raise ConfigError(f"a block appears twice in the training text ({s})")
                seen.add(k)
    return {s: {"documents": len(texts[s]), "tokens": manifest["sets"][s]["tokens"]} for s in SETS}


def check_plan(stages: Sequence[dict], set_tokens: dict[str, int], eval_fraction: float) -> list[dict]:
    """Each stage ({"name", "set", "seq_len", "batch_size", "grad_accum", "steps"}) draws its tokens from one
    training set; a stage drawing more chunks than its set's training chunks would repeat text within the stage,
    and a set read by more than two stages would show a text more than twice. Raises ConfigError; returns per
    stage the tokens, the set's training chunks and the fraction of an epoch drawn."""
    rows = []
    per_set: dict[str, int] = {}
    for st in stages:
        s = st["set"]
        if s not in set_tokens:
            raise ConfigError(f"stage {st['name']!r} reads {s!r}, which the corpus does not have")
        chunks = set_tokens[s] // st["seq_len"]
        n_eval = int(round(chunks * eval_fraction)) if eval_fraction > 0 else 0
        train_chunks = chunks - n_eval
        drawn = st["steps"] * st["batch_size"] * st["grad_accum"]
        epoch = drawn / max(train_chunks, 1)
        if drawn > train_chunks:
            raise ConfigError(
                f"stage {st['name']!r} draws {drawn} chunks of {st['seq_len']} tokens from {s}, which has "
                f"{train_chunks}: text would repeat within the stage; lower its steps or build a larger corpus"
            )
        per_set[s] = per_set.get(s, 0) + 1
        rows.append({"stage": st["name"], "set": s, "tokens": drawn * st["seq_len"], "train_chunks": train_chunks,
                     "epoch_fraction": round(epoch, 4)})
    over = {s: n for s, n in per_set.items() if n > 2}
    if over:
        raise ConfigError(f"{', '.join(over)} read by more than two stages: a text would be seen more than twice")
    return rows
