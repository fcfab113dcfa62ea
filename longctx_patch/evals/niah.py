"""Needle-in-a-haystack retrieval (RULER style).

Tasks
-----
- ``s-niah-1``: one 7-digit number hidden in repeated filler sentences.
- ``s-niah-2``: one 7-digit number hidden in essay text.
- ``s-niah-3``: one UUID hidden in essay text.
- ``mk-niah``: one 7-digit number hidden in essay text among several distractor needles that carry
  other keys and other numbers; the question asks for one key.

A needle reads "One of the special magic numbers for KEY is: VALUE." and the question "What is the
special magic number for KEY mentioned in the provided text?". Prompts are built to a token length
measured with the model's tokenizer on the whole prompt (chat template included), the needle is put at
a sentence boundary nearest to the requested depth (fraction of the haystack's tokens), decoding is
greedy and a sample is correct when the value appears verbatim in the generated answer.
"""

from __future__ import annotations

import bisect
import math
import random
import re
import uuid
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError
from ..generation import has_chat_template
from .common import (
    RESULTS_DEFAULT,
    output_dir,
    MethodRun,
    applied,
    begin_run,
    default_name,
    format_p,
    format_table,
    load_model,
    pyplot,
    size_label,
    write_result,
)

TASKS = ("s-niah-1", "s-niah-2", "s-niah-3", "mk-niah")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
DEFAULT_HAYSTACK = Path(__file__).parent / "data" / "shakespeare.txt"
MK_DISTRACTORS = 3

_ADJECTIVES = (
    "amber ancient bitter brave bright calm clever cold crimson curious daring distant dusty eager elegant "
    "empty fancy fierce gentle golden hollow humble icy jolly lazy little lively lonely lucky misty modern "
    "narrow noble odd pale polite proud quiet rapid rare rough royal rustic shiny silent silver sleepy smooth "
    "solemn spicy steady stormy sturdy sunny swift tame tender tidy tiny vivid wild windy wise wooden young"
).split()
_NOUNS = (
    "anchor apple badger basket beacon bicycle blanket bottle bridge candle canyon castle cherry cloud "
    "compass cottage crystal desert dolphin dragon drum falcon feather forest fountain garden glacier "
    "harbor helmet island jacket kettle lantern lemon meadow mirror mountain needle orchard otter palace "
    "pebble pencil piano pillow planet pumpkin rabbit ribbon river saddle shadow spider statue teapot "
    "thunder tiger tower trumpet tunnel violin walnut whistle window wizard"
).split()


@dataclass
class NiahSample:
    """One prompt: token ids, the expected value and where the needle was put."""

    task: str
    length: int  # requested prompt length in tokens
    depth: float  # requested depth (fraction of the haystack's tokens)
    index: int  # sample number within its (task, length, depth) cell
    key: str
    value: str
    prompt_tokens: int  # measured length of the whole prompt
    needle_depth: float  # measured depth of the queried needle, in haystack tokens
    input_ids: list[int] = field(repr=False)
    distractors: list[dict[str, Any]] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("input_ids")
        return d


# ----------------------------------------------------------------------------------------------- haystack
def load_haystack(source: str | Path | None = None) -> str:
    """Text of a haystack: a text file, or the text files of a folder (as `ppl.load_texts` reads them) joined by
    blank lines."""
    from .ppl import load_texts

    path = Path(source) if source is not None else DEFAULT_HAYSTACK
    text = "\n\n".join(d.strip() for d in load_texts(path, option="--haystack"))
    if len(text) < 200:
        raise ConfigError(f"haystack {path} is too short ({len(text)} characters); give at least a few paragraphs")
    return text


def _offsets(tokenizer, text: str) -> list[tuple[int, int]]:
    """Character span of each token of `text` (no special tokens); needs a fast (Rust) tokenizer."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise ConfigError(
            f"niah needs a fast tokenizer (with offset mapping); {type(tokenizer).__name__} has none. "
            "Save the model with a tokenizer.json, or load it with use_fast=True"
        ) from None
    return [tuple(o) for o in enc["offset_mapping"]]


class _Corpus:
    """A haystack text tokenised once, with the character span of every token.

    The text repeats without end: token `t` is token `t % n` of copy `t // n`, so a prompt of any length
    can start at any paragraph of the text.
    """

    def __init__(self, tokenizer, text: str, paragraph_starts: bool = True):
        self.base = text.rstrip() + "\n\n"
        self.offsets = _offsets(tokenizer, self.base)
        if not self.offsets:
            raise ConfigError("the haystack text has no tokens")
        self.n = len(self.offsets)
        self.starts = [a for a, _ in self.offsets]
        cand = [0] + ([m.end() for m in re.finditer(r"\n\s*\n", self.base)] if paragraph_starts else [])
        self.candidate_tokens = sorted({bisect.bisect_left(self.starts, c) for c in cand if c < len(self.base)} - {self.n})

    def start_char(self, t: int) -> int:
        c, i = divmod(t, self.n)
        return c * len(self.base) + self.offsets[i][0]

    def end_char(self, t: int) -> int:
        c, i = divmod(t, self.n)
        return c * len(self.base) + self.offsets[i][1]

    def text(self, a: int, b: int) -> str:
        """Characters [a, b) of the endlessly repeated text."""
        L = len(self.base)
        c0, c1 = a // L, (b - 1) // L
        full = self.base * (c1 - c0 + 1)
        return full[a - c0 * L : b - c0 * L]


@lru_cache(maxsize=8)
def _corpus(tokenizer, text: str, paragraph_starts: bool) -> _Corpus:
    return _Corpus(tokenizer, text, paragraph_starts)


def window(corpus: _Corpus, start: int, n_hay: int):
    """`(text, char_at)`: `n_hay` tokens of `corpus` from token `start`, stripped, and the function that maps a depth
    (a fraction of those tokens) to a character position in that text."""
    n_hay = max(n_hay, 0)
    if n_hay == 0:
        return "", lambda d: 0
    a, b = corpus.start_char(start), corpus.end_char(start + n_hay - 1)
    raw = corpus.text(a, b)
    lead = len(raw) - len(raw.lstrip())
    hay = raw.strip()

    def char_at(d: float) -> int:
        tok = start + min(int(round(d * n_hay)), n_hay)
        pos = (corpus.start_char(tok) if tok < start + n_hay else b) - a - lead
        return min(max(pos, 0), len(hay))

    return hay, char_at


_BOUNDARY = re.compile(r"(?<=[.!?;:])[\"')\]]*\s+|\n\s*\n")


def _boundaries(text: str) -> list[int]:
    """Character positions where a sentence starts (0 and len(text) included)."""
    pos = {0, len(text)}
    for m in _BOUNDARY.finditer(text):
        pos.add(m.end())
    return sorted(pos)


def _insert(text: str, needles: list[tuple[float, str]], char_at_depth) -> str:
    """Puts each (depth, sentence) at the sentence boundary nearest to its depth; later ones first."""
    bounds = _boundaries(text)
    placed: list[tuple[int, str]] = []
    for depth, sentence in needles:
        target = char_at_depth(depth)
        b = min(bounds, key=lambda p: (abs(p - target), p))
        placed.append((b, sentence))
    placed.sort(key=lambda t: t[0], reverse=True)
    for b, sentence in placed:
        if b == 0:
            text = sentence + " " + text
        elif b >= len(text):
            text = text.rstrip() + " " + sentence
        else:
            text = text[:b] + sentence + " " + text[b:]
    return text


# ----------------------------------------------------------------------------------------------- prompts
def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind}s for {key} is: {value}."


def _prompt_text(tokenizer, context: str, kind: str, key: str, chat: bool) -> str:
    instruction = (
        f"Some special magic {kind}s are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kind}s afterwards."
    )
    question = f"What is the special magic {kind} for {key} mentioned in the provided text?"
    answer_prefix = f"The special magic {kind} for {key} mentioned in the provided text is"
    user = f"{instruction}\n{context}\n{question}"
    if chat:
        head = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
        return head + answer_prefix
    return f"{user}\n{answer_prefix}"


def _encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    # a chat template writes its own special tokens; a plain prompt gets the tokenizer's (BOS)
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])


def _value(rng: random.Random, kind: str) -> str:
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return str(rng.randint(1_000_000, 9_999_999))


def _keys(rng: random.Random, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in keys:
            keys.append(k)
    return keys


def build_sample(
    tokenizer,
    task: str,
    length: int,
    depth: float,
    *,
    seed: int = 0,
    index: int = 0,
    haystack: str | None = None,
    chat: bool | None = None,
) -> NiahSample:
    """Builds one prompt of `length` tokens (or a few fewer when sentence/token joins do not allow exact
    length) for `task` with the queried needle at `depth`. Same arguments give the same prompt."""
    if task not in TASKS:
        raise ConfigError(f"unknown niah task {task!r}; choose from {', '.join(TASKS)}")
    chat = has_chat_template(tokenizer) if chat is None else chat
    rng = random.Random(f"{seed}|{task}|{length}|{depth:.6f}|{index}")
    kind = "uuid" if task == "s-niah-3" else "number"
    n_needles = 1 + (MK_DISTRACTORS if task == "mk-niah" else 0)
    keys = _keys(rng, n_needles)
    values: list[str] = []
    while len(values) < n_needles:
        v = _value(rng, kind)
        if v not in values:
            values.append(v)
    needle_depths = [depth] + [rng.random() for _ in range(n_needles - 1)]
    needles = [(d, _needle(kind, k, v)) for d, k, v in zip(needle_depths, keys, values)]
    key, value = keys[0], values[0]

    if task == "s-niah-1":
        corpus = _corpus(tokenizer, FILLER * 64, False)
        start = 0
    else:
        if haystack is None:
            haystack = load_haystack(None)
        corpus = _corpus(tokenizer, haystack, True)
        start = rng.choice(corpus.candidate_tokens)

    def build(n_hay: int) -> tuple[str, list[int], str]:
        hay, char_at = window(corpus, start, n_hay)
        context = _insert(hay, needles, char_at) if hay else " ".join(s for _, s in needles)
        text = _prompt_text(tokenizer, context, kind, key, chat)
        return context, _encode_prompt(tokenizer, text, chat), text

    overhead = len(build(0)[1])
    if overhead >= length:
        raise ConfigError(
            f"length {length} is too short for task {task}: the template and needles alone take {overhead} tokens"
        )
    n_hay = length - overhead
    best = None
    for _ in range(6):  # token joins shift the count by a few; settle on the longest prompt <= length
        context, ids, text = build(n_hay)
        if len(ids) <= length and (best is None or len(ids) > len(best[1])):
            best = (context, ids, text)
        if len(ids) == length:
            break
        n_hay += length - len(ids)
    if best is None:
        raise ConfigError(f"could not fit task {task} into {length} tokens")  # pragma: no cover - defensive
    context, ids, text = best
    distractors = [
        {"key": k, "value": v, "depth": round(d, 4)} for d, k, v in zip(needle_depths[1:], keys[1:], values[1:])
    ]
    return NiahSample(
        task=task,
        length=length,
        depth=depth,
        index=index,
        key=key,
        value=value,
        prompt_tokens=len(ids),
        needle_depth=round(measure_depth(tokenizer, text, context, needles[0][1]), 4),
        input_ids=ids,
        distractors=distractors,
    )


def measure_depth(tokenizer, prompt_text: str, context: str, needle: str) -> float:
    """Depth of `needle` inside `context` (both within `prompt_text`), counted in tokens of the prompt."""
    c0 = prompt_text.index(context)
    n0 = prompt_text.index(needle, c0)
    starts = [a for a, _ in _offsets(tokenizer, prompt_text)]
    t_ctx0 = bisect.bisect_left(starts, c0)
    t_ctx1 = bisect.bisect_left(starts, c0 + len(context))
    t_needle = bisect.bisect_left(starts, n0)
    n_tok = len(tokenizer(needle, add_special_tokens=False)["input_ids"])
    hay = (t_ctx1 - t_ctx0) - n_tok  # tokens of the haystack around the needle
    return 0.0 if hay <= 0 else min(max((t_needle - t_ctx0) / hay, 0.0), 1.0)


def make_samples(
    tokenizer,
    tasks: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    seed: int = 0,
    haystack: str | None = None,
    chat: bool | None = None,
) -> list[NiahSample]:
    """Every (task, length, depth, index) prompt of a run, in a fixed order."""
    if samples < 1:
        raise ConfigError(f"--samples must be >= 1 (got {samples})")
    needs_text = any(t != "s-niah-1" for t in tasks)
    if needs_text and haystack is None:
        haystack = load_haystack(None)
    return [
        build_sample(tokenizer, t, L, d, seed=seed, index=i, haystack=haystack, chat=chat)
        for t in tasks
        for L in lengths
        for d in depths
        for i in range(samples)
    ]


def value_span(tokenizer, sample: NiahSample) -> slice:
    """Token positions of the sample's value in its prompt (the passkey's digits, one token each, as the Llama
    tokenizers split numbers); ValueError if the prompt does not hold it that way."""
    want = [tokenizer.convert_tokens_to_ids(c) for c in sample.value]
    ids = sample.input_ids
    for i in range(len(ids) - len(want) + 1):
        if ids[i:i + len(want)] == want:
            return slice(i, i + len(want))
    raise ValueError(f"the value {sample.value!r} is not in the prompt as one token per character; "
                     "these needle diagnostics need a tokenizer that splits numbers into digits")


# ----------------------------------------------------------------------------------------------- scoring
def score(answer: str, value: str) -> bool:
    """Exact match: the value appears verbatim in the answer (numbers not as part of a longer number)."""
    if re.fullmatch(r"\d+", value):
        return re.search(rf"(?<!\d){re.escape(value)}(?!\d)", answer) is not None
    return value.lower() in answer.lower()


def answer_tokens(task: str) -> int:
    """The new tokens an answer of `task` may take (greedy decoding stops there): 64 for a UUID, 16 for a number."""
    return 64 if task == "s-niah-3" else 16


def generate_answer(model, tokenizer, input_ids: list[int], max_new_tokens: int) -> str:
    """Greedy continuation of `input_ids`, decoded (special tokens dropped)."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------- run
def run_niah(
    model,
    methods: Sequence[MethodRun],
    *,
    tasks: Sequence[str] = TASKS,
    lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    samples: int = 1,
    seed: int = 0,
    haystack: str | Path | None = None,
    out_dir=RESULTS_DEFAULT,
    name: str | None = None,
    model_name: str | None = None,
    command: str | None = None,
    progress: bool = True,
    echo=print,
) -> dict[str, Any]:
    """Runs every task at every length/depth for each method and writes `<name>.json` + `<name>.png`.

    `model` is a name/path for `longctx_patch.load_model` or a loaded `(model, tokenizer)` pair.
    Returns the result record (also written to disk when `out_dir` is not None).
    """
    from ..progress import progress_iter

    tasks = list(tasks)
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ConfigError(f"unknown niah task(s) {', '.join(bad)}; choose from {', '.join(TASKS)}")
    model_name = begin_run(model, model_name)
    hay_text = load_haystack(haystack) if any(t != "s-niah-1" for t in tasks) else None
    mdl, tok = load_model(model)
    chat = has_chat_template(tok)
    prompts = make_samples(tok, tasks, lengths, depths, samples, seed=seed, haystack=hay_text, chat=chat)

    records: list[dict[str, Any]] = []
    was_training = mdl.training
    mdl.eval()
    try:
        for run in methods:
            with applied(mdl, run):
                bar = progress_iter(prompts, f"niah {run.label}", enabled=progress, unit="prompts")
                for s in bar:
                    answer = generate_answer(mdl, tok, s.input_ids, answer_tokens(s.task))
                    records.append({"method": run.label, **s.record(), "answer": answer, "correct": score(answer, s.value)})
    finally:
        mdl.train(was_training)

    figures = summarize(records, [r.label for r in methods], tasks, lengths, depths)
    figures.update(
        {
            "tasks": tasks,
            "lengths": list(lengths),
            "depths": list(depths),
            "samples_per_cell": samples,
            "seed": seed,
            "haystack": str(haystack) if haystack is not None else f"package default ({DEFAULT_HAYSTACK.name})",
            "chat_template": chat,
            "samples": records,
        }
    )
    echo(accuracy_table(figures, [r.label for r in methods], tasks, lengths, depths))
    if figures["paired"]:
        echo(paired_lines(figures))
    result = {"figures": figures}
    out_dir = output_dir(out_dir, "niah")
    if out_dir is not None:
        stem = name or default_name("niah", model_name, methods)
        path = write_result(
            Path(out_dir) / f"{stem}.json", task="niah", model=model_name, runs=methods, figures=figures, command=command
        )
        png = plot_heatmap(figures, [r.label for r in methods], tasks, lengths, depths, Path(out_dir) / f"{stem}.png")
        echo(f"wrote {path} and {png}")
        result.update({"json": str(path), "png": str(png)})
    return result


def summarize(records, labels, tasks, lengths, depths) -> dict[str, Any]:
    def acc(rows):
        return round(sum(r["correct"] for r in rows) / len(rows), 4) if rows else None

    accuracy: dict[str, Any] = {}
    by_depth: dict[str, Any] = {}
    overall: dict[str, Any] = {}
    for lab in labels:
        mine = [r for r in records if r["method"] == lab]
        overall[lab] = acc(mine)
        accuracy[lab] = {
            t: {size_label(L): acc([r for r in mine if r["task"] == t and r["length"] == L]) for L in lengths} for t in tasks
        }
        by_depth[lab] = {
            t: {
                size_label(L): {
                    f"{d:g}": acc([r for r in mine if r["task"] == t and r["length"] == L and r["depth"] == d]) for d in depths
                }
                for L in lengths
            }
            for t in tasks
        }
    return {"accuracy": accuracy, "accuracy_by_depth": by_depth, "overall": overall,
            "paired": paired(records, labels, tasks, lengths)}


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar test: the probability, under "both methods are equally good", of a split of the
    b + c discordant samples at least as uneven as (b, c) (a binomial test at 1/2)."""
    n, k = b + c, min(b, c)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def _sample_key(r: dict[str, Any]) -> tuple:
    """What makes a sample the same one under every method (records without a depth, as RULER's, have none)."""
    return r["task"], r["length"], r.get("depth"), r["index"]


def paired(records, labels, tasks, lengths) -> dict[str, Any]:
    """Each method after the first against the first (the reference, e.g. `exact`) on the same samples: how many
    both answer, only the reference, only the method, neither, and the exact McNemar p-value of the difference;
    over all samples and per task and length."""
    if len(labels) < 2:
        return {}

    def split(rows_ref, rows_m):
        got = {_sample_key(r): r["correct"] for r in rows_m}
        n = [0, 0, 0, 0]  # both, only the reference, only the method, neither
        for r in rows_ref:
            m = got[_sample_key(r)]
            n[(0 if m else 1) if r["correct"] else (2 if m else 3)] += 1
        return {"both": n[0], "only_reference": n[1], "only_method": n[2], "neither": n[3],
                "mcnemar_p": mcnemar_p(n[1], n[2])}

    ref = [r for r in records if r["method"] == labels[0]]
    out: dict[str, Any] = {"reference": labels[0]}
    for lab in labels[1:]:
        mine = [r for r in records if r["method"] == lab]
        out[lab] = {"all": split(ref, mine)}
        for t in tasks:
            for L in lengths:
                sel = lambda rows: [r for r in rows if r["task"] == t and r["length"] == L]  # noqa: E731
                out[lab][f"{t} {size_label(L)}"] = split(sel(ref), sel(mine))
    return out


def paired_lines(figures) -> str:
    """One line per method: its samples against the reference's, and the McNemar p-value."""
    p = figures.get("paired") or {}
    lines = []
    for lab, cells in p.items():
        if lab == "reference":
            continue
        a = cells["all"]
        lines.append(f"{lab} vs {p['reference']}: {a['only_reference']} samples only {p['reference']} answers, "
                     f"{a['only_method']} only {lab}, {a['both']} both, {a['neither']} neither "
                     f"(McNemar {format_p(a['mcnemar_p'])})")
    return "\n".join(lines)


def accuracy_table(figures, labels, tasks, lengths, depths=None) -> str:
    """Accuracy by method, task, needle depth (one row per depth given) and length, with the mean over the lengths;
    a row `all` per task (every depth) and per method (every sample)."""
    depths = list(figures.get("depths", []) if depths is None else depths)
    header = ["method", "task", "depth"] + [size_label(L) for L in lengths] + ["mean"]

    def mean(accs):
        known = [a for a in accs if a is not None]
        return sum(known) / len(known) if known else None

    rows = []
    for lab in labels:
        for t in tasks:
            by_depth = figures["accuracy_by_depth"][lab][t]
            for d in depths:
                accs = [by_depth[size_label(L)][f"{d:g}"] for L in lengths]
                rows.append([lab, t, f"{d:g}"] + accs + [mean(accs)])
            accs = [figures["accuracy"][lab][t][size_label(L)] for L in lengths]
            rows.append([lab, t, "all"] + accs + [mean(accs)])
        rows.append([lab, "all", "all"] + [""] * len(lengths) + [figures["overall"][lab]])
    return format_table(header, rows)


def plot_heatmap(figures, labels, tasks, lengths, depths, path) -> Path:
    """Accuracy heatmaps, depth (rows) x length (columns): one panel per method (rows) and task (columns)."""
    import numpy as np

    plt = pyplot()
    nr, nc = len(labels), len(tasks)
    w = max(2.4, 0.7 * len(lengths) + 1.0)
    h = max(1.8, 0.35 * len(depths) + 1.0)
    fig, axes = plt.subplots(nr, nc, figsize=(w * nc + 1.2, h * nr + 0.4), squeeze=False, layout="constrained")
    im = None
    for i, lab in enumerate(labels):
        for j, t in enumerate(tasks):
            ax = axes[i][j]
            cells = figures["accuracy_by_depth"][lab][t]
            grid = np.array(
                [[np.nan if (a := cells[size_label(L)][f"{d:g}"]) is None else a for L in lengths] for d in depths]
            )
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(lengths)), [size_label(L) for L in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
            for (y, x), v in np.ndenumerate(grid):
                if not np.isnan(v):
                    ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=7)
            if i == 0:
                ax.set_title(t, fontsize=9)
            if j == 0:
                ax.set_ylabel(f"{lab}\ndepth", fontsize=8)
            if i == nr - 1:
                ax.set_xlabel("length (tokens)", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label="accuracy")
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = [
    "TASKS",
    "NiahSample",
    "answer_tokens",
    "build_sample",
    "generate_answer",
    "make_samples",
    "load_haystack",
    "measure_depth",
    "score",
    "run_niah",
    "plot_heatmap",
    "value_span",
]
