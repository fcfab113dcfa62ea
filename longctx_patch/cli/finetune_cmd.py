"""`longctx finetune RECIPE.yaml --model M [--set key=value] [--text FILE|DIR] [--output DIR] [--resume]`.

Multi-process: `accelerate launch --num_processes N -m longctx_patch.cli.finetune_cmd RECIPE.yaml ...` (or
`accelerate launch $(which longctx) finetune ...`).
"""

from __future__ import annotations

import sys

import click

from .common import MODEL_HELP, check_architecture, friendly_errors, work_started


@click.command(
    "finetune",
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="\b\nRecipe format: recipes/README.md. Examples:\n"
    "  longctx finetune recipes/linearize.yaml --model smollm2-135m \\\n"
    "      --text longctx_patch/evals/data/shakespeare.txt --quick          # minutes on a CPU\n"
    "  longctx finetune recipes/linearize.yaml --model smollm2-135m \\\n"
    "      --text longctx_patch/evals/data/shakespeare.txt --dry-run        # the plan and its estimate only\n"
    "Several processes: accelerate launch --num_processes 2 -m longctx_patch.cli.finetune_cmd RECIPE ...",
)
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--model", "-m", "model", default=None, metavar="MODEL", help="Model to train (overrides the recipe's `model`). " + MODEL_HELP)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a recipe key by dotted path, e.g. stages.0.lr=1e-3, stages.lora.steps=50, method_config.window=128. Repeatable.")
@click.option("--text", default=None, type=click.Path(exists=True), help="Training text: a file or a folder of text files.")
@click.option("--dataset", default=None, help="Training text from a local Hugging Face dataset (save_to_disk folder, .jsonl/.csv/.parquet file, or a cached name).")
@click.option("--split", default=None, help="Dataset split (default: train).")
@click.option("--field", default=None, help="Dataset column holding the text (default: text).")
@click.option("--output", "-o", "output", default=None, type=click.Path(file_okay=False), help="Output directory (overrides output.dir).")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in the output directory.")
@click.option("--stop-after", default=None, metavar="STAGE", help="End the run once stage STAGE (a name or index) is "
              "done and checkpointed; the same command with --resume continues with the next stage. For runs split "
              "over time-limited jobs.")
@click.option("--results", default=None, metavar="NAME", help="Also write the training log as finetune/NAME.json of the results folder ($LONGCTX_RESULTS, "
              "else longctx-results/ in the working directory), or to NAME itself when it ends in .json.")
@click.option("--quick", is_flag=True, help="A short run of the recipe's stages that finishes in minutes on a "
              "laptop-class CPU: at most 5 steps of 2 x 256 tokens per stage, one held-out batch, a loss line every "
              "step, output folder OUTPUT-quick. Checks the set-up end to end; the full recipe is a GPU run.")
@click.option("--skip-memory-check", is_flag=True, help="Run even when the estimated peak memory exceeds the memory "
              "available here (the estimate is printed before the run either way).")
@click.option("--log-seconds", default=30.0, show_default=True, type=click.FloatRange(0),
              help="Without a terminal (a log file): a progress line (step, loss, tokens/s, ETA) at least this often, "
                   "besides one every log_every steps.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@click.option("--dry-run", is_flag=True, help="Validate the recipe and print the resolved recipe and the stage plan; train nothing.")
@friendly_errors
def finetune_cmd(recipe, model, sets, text, dataset, split, field, output, resume, stop_after, results, quick,
                 skip_memory_check, log_seconds, quiet, dry_run):
    """Fine-tune a patched model with a RECIPE (attention transfer and/or next-token stages, optional LoRA).

    Before it trains it prints its plan: tokens and steps per stage, the estimated peak memory and a rough time on
    this device; a run whose estimate exceeds the memory available stops there, before the model loads, with the
    settings that shrink it (--quick, a stage's batch_size or seq_len, attention or gradient checkpointing)."""
    from longctx_patch.methods import is_unpatched
    from longctx_patch.train import load_recipe, run_finetune
    from longctx_patch.train.plan import quick_overrides

    overrides = list(sets)
    # explicit options win over --set, which wins over the file
    if model is not None:
        overrides.append(f"model={model}")
    if text is not None:
        overrides += [f"data.text={text}", "data.dataset=null"]
    if dataset is not None:
        overrides += [f"data.dataset={dataset}", "data.text=null"]
    if split is not None:
        overrides.append(f"data.split={split}")
    if field is not None:
        overrides.append(f"data.field={field}")
    if text is not None and dataset is not None:
        raise click.UsageError("give one text source: --text or --dataset")
    r = load_recipe(recipe, _quote(overrides))  # errors: one `error: ...` line from friendly_errors, like every verb
    if quick:  # the recipe's stages made short; the --set items given still win
        r = load_recipe(recipe, quick_overrides(r) + _quote(overrides))
    if not is_unpatched(r.method) and r.model:
        check_architecture(r.model)  # an unsupported architecture fails now, not after the model loads
    if r.data.text:  # the text named on the command line (or in the recipe) is refused now, not after the load
        from longctx_patch.texts import text_files

        text_files(r.data.text, option="--text" if text is not None else "data.text")
    if dry_run:
        _print_plan(r, output)
        return
    work_started()
    log = run_finetune(r, output, resume=resume, results=results, progress=not quiet, stop_after=stop_after,
                       memory_check=not skip_memory_check, log_seconds=log_seconds)
    if not quiet:
        lines = [f"{s['name']}: {s['steps_done']} steps, {s['tokens']} tokens, {s['time_s']:.1f} s, loss "
                 f"{_fmt(s['first_loss'])} -> {_fmt(s['final_loss'])}"
                 + (f", eval {_fmt(s['final_eval_loss'])}" if s.get("final_eval_loss") is not None else "")
                 for s in log["stages"]]
        click.echo("\n".join(lines))
        if log.get("stopped_after"):
            click.echo(f"stopped after {log['stopped_after']}; continue with the same command and --resume")
        else:
            click.echo(f"saved to {log['output_dir']}")


def _print_plan(r, output) -> None:
    import yaml

    click.echo(yaml.safe_dump(r.to_dict(), sort_keys=False).rstrip())
    click.echo(f"# output: {output or r.output.dir}")
    click.echo("# stage          objective            trainable      steps  tokens/step  tokens")
    total = 0
    for s in r.stages:
        n = s.steps * s.tokens_per_step
        total += n
        click.echo(f"# {s.name:<14} {s.objective:<20} {','.join(s.trainable):<14} {s.steps:>5}  {s.tokens_per_step:>11}  {n}")
    click.echo(f"# total tokens: {total}")
    from longctx_patch.train.plan import peek_config, plan_run

    config = peek_config(r.model)
    if config is None:
        click.echo("# estimate: the model's config cannot be read without loading it; the run prints it after the load")
        return
    from longctx_patch.models import resolve_device

    for line in plan_run(r, config, device=resolve_device(None)).lines():
        click.echo(f"# {line}")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _quote(items: list[str]) -> list[str]:
    """Values given through options are literal strings (a path such as `1e3` or `null.txt` stays a string)."""
    out = []
    for it in items:
        if "=" not in it:  # left for apply_overrides to refuse with its KEY=VALUE message
            out.append(it)
            continue
        key, _, val = it.partition("=")
        if key in ("model", "data.text", "data.dataset", "data.split", "data.field") and val != "null":
            val = "'" + val.replace("'", "''") + "'"
        out.append(f"{key}={val}")
    return out


if __name__ == "__main__":  # `accelerate launch -m longctx_patch.cli.finetune_cmd ...`
    finetune_cmd(prog_name="longctx finetune", args=sys.argv[1:])
