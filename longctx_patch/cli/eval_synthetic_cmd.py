"""`longctx eval icr` and `longctx eval icl`: synthetic long-context benchmarks trained from scratch.

Every selected sequence mixer is trained in the same small model with the same budget (steps, learning
rates, seeds, tokens per step), evaluated at every length, and compared on accuracy (ICR) or regression
error (ICL) against its decode-state size. Results: NAME.json + NAME-length.png + NAME-state.png in the results
folder's synthetic/ (`longctx-results/` of the working directory, or $LONGCTX_RESULTS) or --out-dir.
"""

from __future__ import annotations

import warnings

import click

from .common import friendly_errors, work_started
from .eval_options import effective_command

MIXER_HELP = ("Mixers to train, comma-separated or repeated; NAME or NAME(KEY=VALUE,...), as --method takes "
              "(softmax, sliding, linear, hedgehog, vq, ovq, lolcats, lola; e.g. 'ovq(max_centroids=128,growth=64)'; "
              "a bad key is an error naming the mixer's keys). Default: all of them.")


def _floats(text: str, what: str, example: str = "1e-3,3e-3") -> tuple[float, ...]:
    from longctx_patch.errors import ConfigError

    try:
        vals = tuple(float(s) for s in str(text).split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"bad {what} {text!r}; write comma-separated numbers, e.g. {example}") from None
    if not vals:
        raise ConfigError(f"no {what} given")
    return vals


def _ints(text: str, what: str, example: str = "0,1,2") -> tuple[int, ...]:
    vals = _floats(text, what, example)
    from longctx_patch.errors import ConfigError

    if any(v != int(v) for v in vals):
        raise ConfigError(f"bad {what} {text!r}; write whole numbers")
    return tuple(int(v) for v in vals)


def training_options(*, steps: int, curriculum: str, tokens_per_step: int):
    """The training options both commands share; the defaults given are each task's measured working setting
    (README, "Synthetic long-context benchmarks": without the curriculum every mixer, softmax included, stayed at
    chance / the predict-0 plateau)."""
    return lambda f: _add_training_options(f, steps, curriculum, tokens_per_step)


def _add_training_options(f, steps, curriculum, tokens_per_step):
    opts = [
        click.option("--workers", default=1, show_default=True, type=click.IntRange(1),
                     help="Parallel training processes (several small models share one GPU well)."),
        click.option("--device", default=None, metavar="DEVICE", help="cpu | cuda | cuda:N (default: cuda when available)."),
        click.option("--eval-sequences", default=64, show_default=True, type=click.IntRange(1),
                     help="Held-out sequences per length for the evaluation."),
        click.option("--tokens-per-step", default=tokens_per_step, show_default=True, type=click.IntRange(1),
                     help="Tokens per training step (batch = tokens // length)."),
        click.option("--seeds", default="0", show_default=True, help="Comma-separated training seeds."),
        click.option("--lrs", default="1e-3,3e-3,5e-3", show_default=True,
                     help="Comma-separated learning rates (the best one per mixer is reported)."),
        click.option("--steps", default=steps, show_default=True, type=click.IntRange(1), help="Training steps per run."),
        click.option("--curriculum", default=curriculum, show_default=True, metavar="LENGTH:FRACTION|none",
                     help="Train the first FRACTION of the steps at LENGTH tokens only, then cycle through --lengths "
                          "(the task is learned on short sequences first; without it, or with 128- and 256-token "
                          "curricula, every mixer stayed at chance). 'none': no curriculum."),
        click.option("--conv", default=4, show_default=True, type=click.IntRange(0), help="Short causal convolution width (0 = none)."),
        click.option("--heads", default=2, show_default=True, type=click.IntRange(1), help="Heads per mixer."),
        click.option("--layers", default=2, show_default=True, type=click.IntRange(1), help="Blocks."),
        click.option("--d-model", default=128, show_default=True, type=click.IntRange(8), help="Model width."),
        click.option("--mixers", "mixer_items", multiple=True, metavar="SPEC", help=MIXER_HELP),
        click.option("--name", default=None, metavar="NAME", help="Base name of the result files (default: the task and variant)."),
        click.option("--out-dir", default=None, type=click.Path(file_okay=False),
                     help="Folder for NAME.json and the plots (default: the results folder's synthetic/, as for "
                          "'longctx eval': $LONGCTX_RESULTS when set, else longctx-results/ in the working "
                          "directory)."),
        click.option("--no-plots", is_flag=True, help="Write the JSON only."),
        click.option("--quiet", "-q", is_flag=True, help="No progress bars."),
    ]
    for o in opts:
        f = o(f)
    return f


def _setup(mixer_items, d_model, layers, heads, conv, steps, lrs, seeds, tokens_per_step, eval_sequences, device,
           curriculum=None):
    import torch

    from longctx_patch.errors import DeviceError
    from longctx_patch.evals.synthetic import DEFAULT_MIXERS, ModelConfig, TrainConfig, parse_curriculum, parse_mixers

    with warnings.catch_warnings(record=True) as caught:  # the deprecated NAME:KEY=VALUE form, once per spec
        warnings.simplefilter("always")
        specs = parse_mixers(list(mixer_items) or ",".join(DEFAULT_MIXERS))
    for w in caught:
        click.echo(f"warning: {w.message}", err=True)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"--device {device} was asked for but CUDA is not available; use --device cpu (small sizes)")
    mcfg = ModelConfig(d_model=d_model, n_layers=layers, n_heads=heads, conv=conv).validate()
    c_len, c_frac = parse_curriculum(curriculum)
    tcfg = TrainConfig(steps=steps, lrs=_floats(lrs, "learning rates"), seeds=_ints(seeds, "seeds"),
                       tokens_per_step=tokens_per_step, eval_sequences=eval_sequences, device=device,
                       curriculum_length=c_len, curriculum_fraction=c_frac).validate()
    return specs, mcfg, tcfg


def _run(task, specs, lengths, mcfg, tcfg, *, workers, out_dir, name, label, plots, quiet, extra=None):
    from pathlib import Path

    from longctx_patch.evals.synthetic import run_sweep, write_report

    work_started()
    records = run_sweep(task, specs, lengths, mcfg, tcfg, workers=workers, progress=not quiet)
    from longctx_patch.evals.common import default_results_dir

    path = (Path(out_dir) if out_dir is not None else default_results_dir() / "synthetic") / f"{name}.json"
    text, _ = write_report(path, task, specs, records, lengths, mcfg, tcfg, label=label, command=effective_command(),
                           plots=plots, extra=extra)
    click.echo(f"\n{task.name} {label}\n{text}\n-> {path}")
    failed = [r for r in records if r.get("error")]
    for r in failed:
        click.echo(f"warning: {r['mixer']} lr={r['lr']} seed={r['seed']} failed: {r['error']}", err=True)


@click.command("icr", context_settings={"help_option_names": ["-h", "--help"]},
               epilog="\b\nExamples:\n  longctx eval icr --workers 6                # the README's H200 settings (the defaults)\n"
                      "  longctx eval icr --lengths 1k,2k,4k,8k --num-keys 512 --num-values 512 --mixers softmax,ovq\n"
                      "  longctx eval icr --device cpu --lengths 128 --steps 100 --d-model 32 --mixers softmax,ovq")
@click.option("--variant", type=click.Choice(["basic", "positional", "both"]), default="both", show_default=True,
              help="basic: recall the value of a key; positional: the value at the key's FIRST or SECOND occurrence.")
@click.option("--lengths", default="512,1k,2k,4k", show_default=True,
              help="Sequence lengths; training cycles through them, every model is evaluated at each.")
@click.option("--tokens-per-pair", default=16, show_default=True, type=click.IntRange(6),
              help="Key/value pairs in a sequence = length // this.")
@click.option("--num-keys", default=256, show_default=True, type=click.IntRange(1),
              help="Key vocabulary (at least the pairs of the longest length: 512 for 8k).")
@click.option("--num-values", default=256, show_default=True, type=click.IntRange(2), help="Value vocabulary.")
@training_options(steps=4000, curriculum="64:0.25", tokens_per_step=16384)
@friendly_errors
def icr_cmd(variant, lengths, tokens_per_pair, num_keys, num_values, mixer_items, d_model, layers, heads, conv, steps,
            curriculum, lrs, seeds, tokens_per_step, eval_sequences, device, workers, out_dir, name, no_plots, quiet):
    """In-context recall (MQAR): train every mixer from scratch, report accuracy vs length and state bytes."""
    from longctx_patch.evals.common import parse_sizes
    from longctx_patch.evals.synthetic.icr import IcrConfig, IcrTask

    Ls = parse_sizes(lengths)
    specs, mcfg, tcfg = _setup(mixer_items, d_model, layers, heads, conv, steps, lrs, seeds, tokens_per_step,
                               eval_sequences, device, curriculum)
    for var in (["basic", "positional"] if variant == "both" else [variant]):
        task = IcrTask(IcrConfig(variant=var, num_keys=num_keys, num_values=num_values, tokens_per_pair=tokens_per_pair))
        _run(task, specs, Ls, mcfg, tcfg, workers=workers, out_dir=out_dir, name=f"{name or 'icr'}-{var}",
             label=var, plots=not no_plots, quiet=quiet)


@click.command("icl", context_settings={"help_option_names": ["-h", "--help"]},
               epilog="\b\nExamples:\n  longctx eval icl --workers 6                # the README's H200 settings at F=16 (the defaults)\n"
                      "  longctx eval icl --functions 64 --lengths 2k,4k --mixers 'softmax,ovq(max_centroids=1024,growth=512)'\n"
                      "  longctx eval icl --device cpu --functions 4 --lengths 128 --steps 100 --d-model 32")
@click.option("--functions", default="16", show_default=True,
              help="Hidden functions per sequence (F, up to 128); a comma list runs one sweep per value. More "
                   "functions need longer sequences (each function needs more than 2 x --dim examples).")
@click.option("--dim", default=4, show_default=True, type=click.IntRange(1),
              help="Input dimension of the regression (at 8, 2500 steps left every mixer at the predict-0 plateau).")
@click.option("--segment", default=4, show_default=True, type=click.IntRange(1), help="Examples per segment (one function).")
@click.option("--noise", default=0.0, show_default=True, type=click.FloatRange(0), help="Std of the label noise.")
@click.option("--lengths", default="512,1k,2k", show_default=True,
              help="Sequence lengths (an example takes two positions).")
@training_options(steps=2500, curriculum="64:0.2", tokens_per_step=8192)
@friendly_errors
def icl_cmd(functions, dim, segment, noise, lengths, mixer_items, d_model, layers, heads, conv, steps, curriculum, lrs,
            seeds, tokens_per_step, eval_sequences, device, workers, out_dir, name, no_plots, quiet):
    """In-context regression with F hidden functions: per-function error as the context grows, every mixer."""
    from longctx_patch.evals.common import parse_sizes
    from longctx_patch.evals.synthetic.icl import IclConfig, IclTask

    Ls = parse_sizes(lengths)
    specs, mcfg, tcfg = _setup(mixer_items, d_model, layers, heads, conv, steps, lrs, seeds, tokens_per_step,
                               eval_sequences, device, curriculum)
    for F in _ints(functions, "function counts", "16,32"):
        task = IclTask(IclConfig(num_functions=F, dim=dim, segment=segment, noise=noise))
        _run(task, specs, Ls, mcfg, tcfg, workers=workers, out_dir=out_dir, name=f"{name or 'icl'}-F{F}",
             label=f"F={F}", plots=not no_plots, quiet=quiet)


__all__ = ["icr_cmd", "icl_cmd"]
