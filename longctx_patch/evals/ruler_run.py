"""RULER's runner: every task at every length for each method on the same samples (built here, or read from a
samples file that `ruler_export.write_samples` wrote), scored with RULER's scorer (`ruler.score`), written as
`<name>.json` + `<name>.png` (`ruler_report`). The tasks, their prompts and the scorer are in `ruler.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError
from ..generation import has_chat_template
from . import niah
from .common import RESULTS_DEFAULT, MethodRun, applied, begin_run, default_name, load_model, output_dir, write_result
from .ruler import NIAH, TASKS, load_ruler_haystack, make_samples, score
from .ruler_export import read_samples, state_fraction
from .ruler_report import plot_scores, score_table, summarize


def run_ruler(
    model,
    methods: Sequence[MethodRun],
    *,
    tasks: Sequence[str] = TASKS,
    lengths: Sequence[int] = (4096, 8192),
    samples: int = 1,
    seed: int = 0,
    haystack: str | Path | None = None,
    out_dir=RESULTS_DEFAULT,
    name: str | None = None,
    model_name: str | None = None,
    command: str | None = None,
    progress: bool = True,
    echo=print,
    samples_file: str | Path | None = None,
) -> dict[str, Any]:
    """Runs every task at every length for each method on the same samples; writes `<name>.json` + `<name>.png`.

    `model` is a name/path for `longctx_patch.load_model` or a loaded `(model, tokenizer)` pair; `haystack`:
    'shakespeare' (default), 'stdlib', or a path (see `load_ruler_haystack`). `samples_file`: the samples of a
    file `ruler_export.write_samples` wrote (its tasks, lengths, samples and seed replace the arguments). Each
    sample's record has the method's decode-state fraction at its prompt (`ruler_export.state_fraction`).
    Returns the result record.
    """
    from ..progress import progress_iter

    tasks = list(tasks)
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ConfigError(f"unknown ruler task(s) {', '.join(bad)}; choose from {', '.join(TASKS)}")
    model_name = begin_run(model, model_name)
    if samples_file is not None:
        mdl, tok = load_model(model)
        header, prompts = read_samples(samples_file, tokenizer=tok)
        tasks, lengths, samples, seed = header["tasks"], header["lengths"], header["samples_per_cell"], header["seed"]
        hay_name, chat = f"{header['haystack']} (samples from {samples_file})", header["chat_template"]
    else:
        uses_essay = any(t in NIAH and NIAH[t].haystack == "essay" for t in tasks)
        hay_text, hay_name = load_ruler_haystack(haystack) if uses_essay else (None, "none (no essay task)")
        mdl, tok = load_model(model)
        chat = has_chat_template(tok)
        prompts = make_samples(tok, tasks, lengths, samples, seed=seed, haystack=hay_text, chat=chat)

    records: list[dict[str, Any]] = []
    was_training = mdl.training
    mdl.eval()
    try:
        for run in methods:
            with applied(mdl, run):
                bar = progress_iter(prompts, f"ruler {run.label}", enabled=progress, unit="prompts")
                for s in bar:
                    answer = niah.generate_answer(mdl, tok, s.input_ids, s.max_new_tokens)
                    sc = score(answer, s.answers)
                    records.append({"method": run.label, **s.record(), "answer": answer, "score": round(sc, 4),
                                    "correct": sc == 1.0,
                                    "state_fraction": round(state_fraction(mdl, s.prompt_tokens), 6)})
    finally:
        mdl.train(was_training)

    labels = [r.label for r in methods]
    figures = summarize(records, labels, tasks, lengths)
    figures.update({
        "tasks": tasks,
        "lengths": list(lengths),
        "samples_per_cell": samples,
        "seed": seed,
        "haystack": hay_name,
        "chat_template": chat,
        "length_accounting": "prompt tokens + the task's generation budget <= length (RULER's)",
        "samples": records,
    })
    echo(score_table(figures, labels, tasks, lengths))
    if figures["paired"]:
        echo(niah.paired_lines(figures))
    result = {"figures": figures}
    out_dir = output_dir(out_dir, "ruler")
    if out_dir is not None:
        stem = name or default_name("ruler", model_name, methods)
        path = write_result(Path(out_dir) / f"{stem}.json", task="ruler", model=model_name, runs=methods,
                            figures=figures, command=command)
        png = plot_scores(figures, labels, tasks, lengths, Path(out_dir) / f"{stem}.png")
        echo(f"wrote {path} and {png}")
        result.update({"json": str(path), "png": str(png)})
    return result


__all__ = ["run_ruler"]
