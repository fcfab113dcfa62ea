"""RULER samples in a JSONL file, so that another program (a KV-cache compression library in its own environment)
answers the very prompts `longctx eval ruler` does; its predictions scored back with RULER's scorer; the
decode-state fraction that places a method beside such a library.

Samples file (`write_samples`): line 1 is a header ``{"kind": "longctx-ruler-samples", "version": 1, "model",
"vocab_size", "seed", "haystack", "chat_template", "tasks", "lengths", "samples_per_cell"}``; then one sample a line:
``RulerSample.record()`` (task, length, index, answers, prompt_tokens, max_new_tokens, query, units, depths,
context_tokens) plus "seed" and "input_ids". ``input_ids[:context_tokens]`` is the context (chat template head and
the haystack: what a compression method compresses); ``input_ids[context_tokens:]`` is the question, the end of
the user turn, the assistant header and the answer prefix. Generation is greedy, at most `max_new_tokens`.

Predictions file (`read_predictions`): line 1 a header ``{"kind": "longctx-ruler-predictions", ...}`` with
whatever describes the run (device, date, commit, command, versions); then one prediction a line with at least
"method", "task", "length", "index" and "answer" (the decoded continuation); other fields (e.g. "state_fraction")
are kept. `score_predictions` scores them as `ruler_run.run_ruler` scores its own answers (`ruler.score`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import ConfigError
from .ruler import RulerSample, context_tokens, score

SAMPLES_KIND = "longctx-ruler-samples"
PREDICTIONS_KIND = "longctx-ruler-predictions"
VERSION = 1
_SAMPLE_FIELDS = ("task", "length", "index", "answers", "prompt_tokens", "max_new_tokens", "query", "units",
                  "input_ids", "depths", "context_tokens")
_PREDICTION_FIELDS = ("method", "task", "length", "index", "answer")


def write_samples(path: str | Path, samples: Sequence[RulerSample], *, model: str, vocab_size: int, seed: int,
                  haystack: str, chat_template: bool) -> Path:
    """Writes `samples` (from `ruler.make_samples`) as a samples file; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tasks = list(dict.fromkeys(s.task for s in samples))
    lengths = list(dict.fromkeys(s.length for s in samples))
    header = {"kind": SAMPLES_KIND, "version": VERSION, "model": str(model), "vocab_size": int(vocab_size),
              "seed": seed, "haystack": haystack, "chat_template": bool(chat_template), "tasks": tasks,
              "lengths": lengths, "samples_per_cell": max((s.index + 1 for s in samples), default=0)}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for s in samples:
            f.write(json.dumps({**s.record(), "seed": seed, "input_ids": list(s.input_ids)}) + "\n")
    tmp.replace(path)
    return path


def export_samples(path: str | Path, tokenizer, *, model: str, tasks: Sequence[str], lengths: Sequence[int],
                   samples: int, seed: int = 0, haystack: str | Path | None = None) -> Path:
    """Builds the samples `ruler_run.run_ruler` would (same arguments, same prompts) and writes them as a samples file."""
    from ..generation import has_chat_template
    from .ruler import NIAH, TASKS, load_ruler_haystack, make_samples

    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ConfigError(f"unknown ruler task(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(TASKS)}")
    uses_essay = any(t in NIAH and NIAH[t].haystack == "essay" for t in tasks)
    hay_text, hay_name = load_ruler_haystack(haystack) if uses_essay else (None, "none (no essay task)")
    chat = has_chat_template(tokenizer)
    prompts = make_samples(tokenizer, tasks, lengths, samples, seed=seed, haystack=hay_text, chat=chat)
    return write_samples(path, prompts, model=model, vocab_size=len(tokenizer), seed=seed, haystack=hay_name,
                         chat_template=chat)


def _lines(path: Path, kind: str, what: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    if not path.is_file():
        raise ConfigError(f"{what} file {path}: no such file")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not JSON ({e.msg}); a {what} file has one JSON object a line") from None
    if not rows or not isinstance(rows[0], dict) or rows[0].get("kind") != kind:
        raise ConfigError(f"{path} is not a {what} file: its first line must be a header with \"kind\": \"{kind}\"")
    if rows[0].get("version") != VERSION:
        raise ConfigError(f"{path}: {what} file version {rows[0].get('version')!r}; this version reads {VERSION}")
    return rows[0], rows[1:]


def read_samples(path: str | Path, tokenizer=None) -> tuple[dict[str, Any], list[RulerSample]]:
    """`(header, samples)` of a samples file. With `tokenizer`, refuses a file written for another vocabulary."""
    path = Path(path)
    header, rows = _lines(path, SAMPLES_KIND, "RULER samples")
    if tokenizer is not None and header.get("vocab_size") != len(tokenizer):
        raise ConfigError(f"{path} holds token ids of {header.get('model')} (vocabulary {header.get('vocab_size')}); "
                          f"this tokenizer has {len(tokenizer)} tokens: export the samples with this model")
    out = []
    for n, r in enumerate(rows, 2):
        missing = [k for k in _SAMPLE_FIELDS if k not in r]
        if missing:
            raise ConfigError(f"{path}:{n}: a sample without {', '.join(missing)}")
        out.append(RulerSample(**{k: r[k] for k in _SAMPLE_FIELDS}))
    return header, out


def read_predictions(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`(header, predictions)` of a predictions file."""
    path = Path(path)
    header, rows = _lines(path, PREDICTIONS_KIND, "RULER predictions")
    for n, r in enumerate(rows, 2):
        missing = [k for k in _PREDICTION_FIELDS if k not in r]
        if missing:
            raise ConfigError(f"{path}:{n}: a prediction without {', '.join(missing)}")
    return header, rows


def score_predictions(samples: Iterable[RulerSample], predictions: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-sample records as `ruler_run.run_ruler` writes them (method, the sample's record, answer, score, correct) for
    predictions made by another program on `samples`; the predictions' other fields are kept. A prediction for a
    sample not in `samples`, or two for one sample and method, is an error."""
    by_key = {(s.task, s.length, s.index): s for s in samples}
    seen: set[tuple] = set()
    records = []
    for p in predictions:
        key = (p["task"], int(p["length"]), int(p["index"]))
        s = by_key.get(key)
        if s is None:
            raise ConfigError(f"a prediction of {p['method']} for {key} has no sample: score it against the samples "
                              "file it was made from")
        if (p["method"],) + key in seen:
            raise ConfigError(f"two predictions of {p['method']} for {key}")
        seen.add((p["method"],) + key)
        sc = score(p["answer"], s.answers)
        extra = {k: v for k, v in p.items() if k not in ("method", "answer", "score", "correct", *s.record())}
        records.append({"method": p["method"], **s.record(), "answer": p["answer"], "score": round(sc, 4),
                        "correct": sc == 1.0, **extra})
    return records


# ----------------------------------------------------------------------------------------------- state fraction
def state_fraction(model, tokens: int) -> float:
    """Decode-state bytes of `model` as patched now (`speed_model.state_bytes`: each patched layer's
    `state_bytes`, full K/V for the others) over the exact K/V cache's, after a prompt of `tokens` tokens."""
    from .speed_model import full_kv_bytes, state_bytes

    return state_bytes(model, tokens) / full_kv_bytes(model, tokens)


__all__ = ["PREDICTIONS_KIND", "SAMPLES_KIND", "context_tokens", "export_samples", "read_predictions", "read_samples",
           "score_predictions", "state_fraction", "write_samples"]
