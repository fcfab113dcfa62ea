"""What the `longctx eval` verbs share: the --method / --set / output / text options, the effective command line a
result records, the method runs and the model load. Every eval command module imports it; none imports another."""

from __future__ import annotations

import shlex

import click

from .common import check_layers_spec, load

METHOD_HELP = (
    "Method to evaluate, repeatable: several --method compare methods on the same inputs in one run "
    "(the model is loaded once). 'none' (or 'unpatched') is the unpatched model. NAME(KEY=VALUE,...) gives one "
    "entry its own config, so a method can be compared with itself: --method 'lola(window=64,sparse_cache=64)' "
    "--method lola. layers=RANGES patches only those decoder layers and leaves the others exact, e.g. "
    "--method 'lola(layers=0-23)' or 'lola(layers=0-3+26-29)'. See 'longctx info'."
)
SET_HELP = (
    "Method config, repeatable: METHOD.KEY=VALUE sets KEY of one method (e.g. --set sliding-window.window=256); "
    "a plain KEY=VALUE sets KEY on every selected method that has it."
)


def method_options(default=("exact",)):
    def deco(f):
        f = click.option("--set", "sets", multiple=True, metavar="[METHOD.]KEY=VALUE", help=SET_HELP)(f)
        f = click.option("--method", "methods", multiple=True, default=default, show_default=True, metavar="METHOD",
                         help=METHOD_HELP)(f)
        return f

    return deco


def _default_out_dir(ctx, param, value):
    """No --out-dir: the run_* functions' default results folder (resolved when they write)."""
    if value is not None:
        return value
    from longctx_patch.evals.common import RESULTS_DEFAULT

    return RESULTS_DEFAULT


def output_options(f):
    f = click.option("--name", default=None, metavar="NAME",
                     help="Base name of the result files (default: TASK-MODEL-METHODS).")(f)
    f = click.option("--out-dir", default=None, type=click.Path(file_okay=False), callback=_default_out_dir,
                     help="Folder for NAME.json and NAME.png (default: $LONGCTX_RESULTS/TASK when set, else "
                          "longctx-results/TASK in the working directory).")(f)
    return f


def text_options(f):
    f = click.option("--max-docs", default=None, type=click.IntRange(1), help="Use at most this many documents.")(f)
    f = click.option("--field", default="text", show_default=True, help="Dataset column holding the text.")(f)
    f = click.option("--split", default="test", show_default=True, help="Dataset split.")(f)
    f = click.option("--dataset", default=None, metavar="NAME",
                     help="A `datasets` dataset (hub name in the local cache, or a folder saved with save_to_disk).")(f)
    f = click.option("--text", "texts", multiple=True, type=click.Path(), metavar="FILE|DIR",
                     help="A text file or a folder of .txt files (repeatable). Default: the packaged Shakespeare text.")(f)
    return f


def effective_command() -> str:
    """The effective command line (every option, defaults included) of the running subcommand."""
    ctx = click.get_current_context()
    parts = ["longctx", "eval", ctx.info_name]
    for p in ctx.command.params:
        if not isinstance(p, click.Option) or p.name not in ctx.params:
            continue
        value = ctx.params[p.name]
        opt = max(p.opts, key=len)
        if p.is_flag:
            if p.secondary_opts and not value:
                parts.append(max(p.secondary_opts, key=len))
            elif value:
                parts.append(opt)
        elif value is None:
            continue
        elif p.multiple:
            for v in value:
                parts += [opt, str(v)]
        else:
            parts += [opt, str(value)]
    return shlex.join(parts)


def method_runs(methods, sets, baseline: bool = False):
    from longctx_patch.evals.common import MethodRun, parse_methods
    from longctx_patch.methods import reference_method, split_method_spec

    runs = parse_methods(methods, sets)
    for raw in methods:  # parse_methods has read them; the CLI's layer indices are 0-based
        for item in split_method_spec(raw)[1]:
            k, v = (x.strip() for x in item.split("=", 1))
            if k == "layers":
                check_layers_spec(v, f"--method {raw!r}", "layers=0-7+12")
    if baseline and not any(r.reference for r in runs):
        runs.insert(0, MethodRun(reference_method()))
    return runs


def load_for_runs(model, dtype, device, runs, extra_layers=()):
    """Loads MODEL; the layer selections of the patched runs (and `extra_layers`) are checked against it before
    any run starts, and an unsupported architecture fails before the load when its config can be read."""
    specs = [r.layers for r in runs if r.patched] + list(extra_layers)
    return load(model, device, dtype, layer_specs=specs or None)


def eval_docs(texts, dataset, split, field, max_docs):
    from longctx_patch.evals.niah import DEFAULT_HAYSTACK
    from longctx_patch.evals.ppl import load_texts

    if not texts and dataset is None:
        return load_texts(DEFAULT_HAYSTACK, max_docs=max_docs), f"{DEFAULT_HAYSTACK.name} (packaged)"
    docs = load_texts(list(texts) or None, dataset=dataset, split=split, field=field, max_docs=max_docs)
    source = ", ".join(texts) if texts else f"{dataset}:{split}:{field}"
    return docs, source


__all__ = ["METHOD_HELP", "SET_HELP", "effective_command", "eval_docs", "load_for_runs", "method_options", "method_runs",
           "output_options", "text_options"]
