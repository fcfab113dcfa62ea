"""`longctx eval ruler`: RULER's synthetic tasks (retrieval, variable tracking, word extraction) on a real model."""

from __future__ import annotations

import click

from .common import check_device_dtype, device_dtype_options, friendly_errors, model_option
from .eval_options import effective_command, load_for_runs, method_options, method_runs, output_options

TASKS_HELP = (
    "Comma-separated RULER tasks, or 'all': niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery "
    "(needles in filler, essay or other needles), vt (variable tracking), cwe (common words), fwe (frequent words)."
)


@click.command("ruler")
@model_option
@method_options(default=("exact",))
@click.option("--tasks", default="all", show_default=True, help=TASKS_HELP)
@click.option("--lengths", default="4k,8k,16k,32k", show_default=True,
              help="Sequence lengths in tokens: prompt (chat template included) + the task's generation budget, "
                   "as RULER counts them.")
@click.option("--samples", default=4, show_default=True, type=click.IntRange(1), help="Prompts per (task, length).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of every generated prompt.")
@click.option("--haystack", default="shakespeare", show_default=True, metavar="shakespeare|stdlib|PATH",
              help="Text of the essay tasks (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery): the "
                   "packaged Shakespeare, the Python standard library's source (suits code models), a text file, a "
                   "folder of .txt files (e.g. Paul Graham's essays, RULER's own) or a folder of Python source.")
@click.option("--export-samples", "export_path", default=None, type=click.Path(dir_okay=False), metavar="PATH",
              help="Write the prompts (token ids, the context / question split, answers) to a JSONL file for another "
                   "program and stop; only the tokenizer is loaded (docs/peers.md).")
@click.option("--samples-file", default=None, type=click.Path(exists=True, dir_okay=False), metavar="PATH",
              help="Answer the prompts of a file --export-samples wrote (its tasks, lengths, samples and seed replace "
                   "those options).")
@click.option("--progress/--no-progress", default=True,
              help="Show progress on stderr: a bar on a terminal, else a line every 10 s (a log file, CI).")
@output_options
@device_dtype_options
@friendly_errors
def ruler_cmd(model, methods, sets, tasks, lengths, samples, seed, haystack, export_path, samples_file, progress, out_dir,
              name, device, dtype):
    """RULER's synthetic tasks, generated offline from --seed; greedy decoding, RULER's string_match_all score.

    Prints the score (%) of each method by task x length and the average over tasks, and writes a task x length
    heatmap. Every method answers the same prompts; each one after the first is compared with the first on them
    (a sample counts as solved when every expected string is in the answer): the JSON's "paired".

    \b
    Examples:
      longctx eval ruler --model qwen2.5-coder-0.5b --lengths 4k,8k --tasks niah_single_1,vt,cwe
      longctx eval ruler --model qwen2.5-coder-0.5b --haystack stdlib --method exact \\
          --method sliding-window --set window=2048 --lengths 8k,16k,32k --samples 20
    """
    from longctx_patch.errors import ConfigError
    from longctx_patch.evals.common import parse_sizes
    from longctx_patch.evals.ruler import TASKS, load_ruler_haystack
    from longctx_patch.evals.ruler_run import run_ruler

    check_device_dtype(device, dtype)
    runs = method_runs(methods, sets)
    task_list = list(TASKS) if tasks.strip().lower() == "all" else [t.strip().lower() for t in tasks.split(",") if t.strip()]
    bad = [t for t in task_list if t not in TASKS]
    if bad or not task_list:
        raise ConfigError(f"unknown ruler task(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(TASKS)}")
    length_list = parse_sizes(lengths)
    load_ruler_haystack(haystack)  # fail on a bad path before loading the model
    if export_path is not None:
        from longctx_patch.evals.ruler_export import export_samples
        from longctx_patch.models import load_tokenizer

        path = export_samples(export_path, load_tokenizer(model), model=model, tasks=task_list, lengths=length_list,
                              samples=samples, seed=seed, haystack=haystack)
        click.echo(f"wrote {len(task_list) * len(length_list) * samples} samples to {path}")
        return
    pair = load_for_runs(model, dtype, device, runs)
    run_ruler(pair, runs, tasks=task_list, lengths=length_list, samples=samples, seed=seed, haystack=haystack,
              out_dir=out_dir, name=name, model_name=model, command=effective_command(), progress=progress, echo=click.echo,
              samples_file=samples_file)


__all__ = ["ruler_cmd"]
