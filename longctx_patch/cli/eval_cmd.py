"""`longctx eval`: needle-in-a-haystack, long-text perplexity, attention fidelity, speed and memory."""

from __future__ import annotations

import sys

import click

from .common import (check_device_dtype, check_layers_spec, device_dtype_options, friendly_errors, model_option,
                     work_started)
from .eval_options import (effective_command, eval_docs, load_for_runs, method_options, method_runs, output_options,
                           text_options)
from .eval_ruler_cmd import ruler_cmd
from .eval_synthetic_cmd import icl_cmd, icr_cmd


@click.group("eval", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def eval_group() -> None:
    """Evaluate methods: retrieval (niah), RULER's synthetic tasks (ruler), perplexity (ppl), attention fidelity
    (approx), speed and memory (speed); and train small models from scratch on synthetic recall (icr) and
    regression (icl) with every sequence mixer.

    Every task compares the methods given with --method on the same inputs, prints a table and writes
    OUT_DIR/NAME.json (device, date, commit, command, model, method, config + figures) and a PNG plot.

    \b
    Example:
      longctx eval niah --method exact --method sliding-window \\
          --set sliding-window.window=256 --lengths 1k,2k --samples 4
    """


# --------------------------------------------------------------------------------------------- niah
@eval_group.command("niah")
@model_option
@method_options(default=("exact",))
@click.option("--tasks", default="s-niah-1,s-niah-2,s-niah-3,mk-niah", show_default=True,
              help="Comma-separated tasks: s-niah-1 (number in filler), s-niah-2 (number in essay), "
                   "s-niah-3 (UUID in essay), mk-niah (one of several keys, with distractors).")
@click.option("--lengths", default="1k,2k,4k,8k", show_default=True,
              help="Prompt lengths in tokens (whole prompt, chat template included).")
@click.option("--depths", default="0,0.25,0.5,0.75,1", show_default=True,
              help="Needle depths as fractions of the haystack (0 = start, 1 = end).")
@click.option("--samples", default=1, show_default=True, type=click.IntRange(1),
              help="Prompts per (task, length, depth) cell.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of keys, values, distractors and text offsets.")
@click.option("--haystack", default=None, type=click.Path(), metavar="FILE|DIR",
              help="Essay text: a .txt file or a folder of .txt files (e.g. Paul Graham's essays). "
                   "Default: the packaged Shakespeare text.")
@click.option("--progress/--no-progress", default=True,
              help="Show progress on stderr: a bar on a terminal, else a line every 10 s (a log file, CI).")
@output_options
@device_dtype_options
@friendly_errors
def niah_cmd(model, methods, sets, tasks, lengths, depths, samples, seed, haystack, progress, out_dir, name, device, dtype):
    """Needle-in-a-haystack retrieval (RULER-style), greedy decoding, exact-match scoring.

    Prints accuracy by task, needle depth and length for each method and writes a depth x length heatmap. With
    several methods, each is compared with the first on the same prompts: how many only one of them answers, and
    the exact McNemar p-value of that difference (the JSON's "paired"); put the unpatched model first (--method
    exact).

    \b
    Examples:
      longctx eval niah --lengths 1k,2k --samples 4        # haystack: the packaged Shakespeare text
      longctx eval niah --method none --method sliding-window --set window=256 --tasks s-niah-2
    """
    from longctx_patch.errors import ConfigError
    from longctx_patch.evals.common import parse_fractions, parse_sizes
    from longctx_patch.evals.niah import TASKS, load_haystack, run_niah

    check_device_dtype(device, dtype)
    runs = method_runs(methods, sets)
    task_list = [t.strip().lower() for t in tasks.split(",") if t.strip()]
    bad = [t for t in task_list if t not in TASKS]
    if bad or not task_list:
        raise ConfigError(f"--tasks {tasks!r}: {'unknown task(s) ' + ', '.join(bad) if bad else 'no task given'}; "
                          f"choose from {', '.join(TASKS)} (comma-separated)")
    length_list, depth_list = parse_sizes(lengths), parse_fractions(depths)
    if haystack is not None:
        load_haystack(haystack)  # fail on a bad path before loading the model
    pair = load_for_runs(model, dtype, device, runs)
    run_niah(pair, runs, tasks=task_list, lengths=length_list, depths=depth_list, samples=samples, seed=seed,
             haystack=haystack, out_dir=out_dir, name=name, model_name=model, command=effective_command(), progress=progress,
             echo=click.echo)


# --------------------------------------------------------------------------------------------- ppl
@eval_group.command("ppl")
@model_option
@method_options(default=("exact",))
@text_options
@click.option("--context", "contexts", default="2k,8k", show_default=True, help="Context lengths (window sizes) in tokens.")
@click.option("--windows", default=4, show_default=True, type=click.IntRange(1), help="Windows scored per context.")
@click.option("--buckets", default=8, show_default=True, type=click.IntRange(1), help="Position buckets per window.")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Add 'exact' as the reference when neither exact nor none is among the methods.")
@click.option("--progress/--no-progress", default=True,
              help="Show progress on stderr: a bar on a terminal, else a line every 10 s (a log file, CI).")
@output_options
@device_dtype_options
@friendly_errors
def ppl_cmd(model, methods, sets, texts, dataset, split, field, max_docs, contexts, windows, buckets, baseline,
            progress, out_dir, name, device, dtype):
    """Perplexity on long text and mean loss by position bucket (does the model use far context?).

    \b
    Example:
      longctx eval ppl --method sliding-window --set window=256 --context 2k,4k    # the packaged Shakespeare text
    """
    from longctx_patch.evals.common import parse_sizes
    from longctx_patch.evals.ppl import run_ppl

    check_device_dtype(device, dtype)
    runs = method_runs(methods, sets, baseline=baseline)
    ctx_list = parse_sizes(contexts)
    docs, source = eval_docs(texts, dataset, split, field, max_docs)
    pair = load_for_runs(model, dtype, device, runs)
    run_ppl(pair, runs, docs, contexts=ctx_list, max_windows=windows, buckets=buckets, out_dir=out_dir, name=name,
            model_name=model, source=source, command=effective_command(), progress=progress, echo=click.echo)


# --------------------------------------------------------------------------------------------- approx
@eval_group.command("approx")
@model_option
@method_options(default=("exact",))
@text_options
@click.option("--length", default="2k", show_default=True, help="Tokens of text whose real q/k/v are captured.")
@click.option("--lengths", default="", show_default=False,
              help="Also measure on random N(0,1) q/k/v at these lengths (e.g. 1k,4k); default: none.")
@click.option("--no-real", is_flag=True, help="Skip the real-text capture (synthetic inputs only).")
@click.option("--layers", default=None, metavar="SPEC", help="Layers to measure, e.g. '0-7,12' (default: all).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the synthetic inputs.")
@output_options
@device_dtype_options
@friendly_errors
def approx_cmd(model, methods, sets, texts, dataset, split, field, max_docs, length, lengths, no_real, layers, seed,
               out_dir, name, device, dtype):
    """Relative error ||O_method - O_exact||_F / ||O_exact||_F of each layer's attention output on real
    post-rotary q/k/v captured from the model, and on random inputs.

    \b
    Example:
      longctx eval approx --method muse --method sliding-window --set sliding-window.window=512 --length 4k --lengths 1k,8k
    """
    from longctx_patch.evals.approx import run_approx
    from longctx_patch.evals.common import parse_size, parse_sizes
    from longctx_patch.patcher import parse_layers

    check_device_dtype(device, dtype)
    runs = method_runs(methods, sets)
    synth = parse_sizes(lengths) if lengths.strip() else []
    if no_real and not synth:
        raise click.UsageError("--no-real needs --lengths (random inputs), or there is nothing to measure")
    real_length = parse_size(length)
    if layers is not None:
        check_layers_spec(layers)
        parse_layers(layers, sys.maxsize)  # the syntax now; the range once the model is loaded
    docs, source = (None, "") if no_real else eval_docs(texts, dataset, split, field, max_docs)
    pair = load_for_runs(model, dtype, device, runs, extra_layers=[layers])
    run_approx(pair, runs, docs, length=real_length, lengths=synth, layers=layers, seed=seed, out_dir=out_dir,
               name=name, model_name=model, source=source, command=effective_command(), echo=click.echo)


# --------------------------------------------------------------------------------------------- speed
@eval_group.command("speed")
@model_option
@method_options(default=("exact",))
@click.option("--context", "contexts", default="1k,4k", show_default=True, help="Model level: prompt lengths in tokens.")
@click.option("--batch", "batches", default="1", show_default=True,
              help="Model level: batch sizes, comma-separated (e.g. 1,16,64): random prompts of the same length.")
@click.option("--decode-tokens", "calls", default="32", show_default=True, metavar="N[,N...]",
              help="Model level: one generate() call of N new tokens per entry (e.g. 64,256), each timed from its "
                   "first decode step: tokens/s over the call's whole decode, the mean ms of steps 1-16, 17-64, "
                   "65-128, 129-256, the steady state, peak memory.")
@click.option("--static", is_flag=True,
              help="Model level: add plain transformers with its static cache (compiled by transformers on CUDA), "
                   "the fastest decode without this package.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1), help="Model level: prefill repeats (median).")
@click.option("--prefill-chunk", default=None, type=click.IntRange(1),
              help="Model level: feed the prompt in chunks of this many tokens (generate()'s prefill_chunk_size), so "
                   "that peak memory shows the decode state rather than one long prefill's activations.")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Model level: add 'exact' as the reference when neither exact nor none is among the methods.")
@click.option("--op", is_flag=True, help="Op level (CUDA only): time the attention op alone against SDPA cuDNN/flash.")
@click.option("--lengths", default="4k,16k,64k,128k", show_default=True, help="Op level: sequence lengths.")
@click.option("--heads", default=32, show_default=True, type=click.IntRange(1), help="Op level: query heads.")
@click.option("--kv-heads", default=8, show_default=True, type=click.IntRange(1), help="Op level: key/value heads.")
@click.option("--head-dim", default=64, show_default=True, type=click.IntRange(1), help="Op level: head dimension.")
@click.option("--modes", default="fwd,fwd+bwd", show_default=True, help="Op level: fwd and/or fwd+bwd.")
@output_options
@device_dtype_options
@friendly_errors
def speed_cmd(model, methods, sets, contexts, batches, calls, static, repeats, prefill_chunk, baseline, op, lengths,
              heads, kv_heads, head_dim, modes, out_dir, name, device, dtype):
    """Prefill time, generate()'s decode tokens/s, the bytes floor of a step and memory vs context and batch (model
    level), or the attention op alone (--op, CUDA).

    \b
    Examples:
      longctx eval speed --method sliding-window --set window=1024 --context 1k,4k,16k
      longctx eval speed --method none --method lola --method ovq --static --batch 1,16 --context 16k,32k \\
          --decode-tokens 64,256 --device cuda
      longctx eval speed --method lola --batch 16 --context 16k,32k,64k,128k --prefill-chunk 8192 --device cuda
      longctx eval speed --op --method muse --lengths 4k,16k,64k,128k --heads 32 --kv-heads 8 --head-dim 128
    """
    from longctx_patch.evals.common import parse_sizes
    from longctx_patch.evals.speed import run_op_speed, run_speed

    if op:
        runs = method_runs(methods, sets)
        work_started()
        run_op_speed(runs, lengths=parse_sizes(lengths), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype or "bfloat16", modes=[m.strip() for m in modes.split(",") if m.strip()],
                     out_dir=out_dir, name=name, command=effective_command(), echo=click.echo)
        return
    check_device_dtype(device, dtype)
    runs = method_runs(methods, sets, baseline=baseline)
    ctx_list = parse_sizes(contexts)
    try:
        batch_list = [int(b) for b in batches.split(",") if b.strip()]
    except ValueError:
        raise click.BadParameter(f"{batches!r}: write batch sizes as integers, e.g. 1,16,64", param_hint="--batch")
    pair = load_for_runs(model, dtype, device, runs)
    try:
        call_list = [int(n) for n in calls.split(",") if n.strip()]
    except ValueError:
        raise click.BadParameter(f"{calls!r}: write new-token counts as integers, e.g. 64,256",
                                 param_hint="--decode-tokens")
    run_speed(pair, runs, contexts=ctx_list, batches=batch_list, calls=call_list, static=static,
              repeats=repeats, prefill_chunk=prefill_chunk, out_dir=out_dir, name=name,
              model_name=model, command=effective_command(), echo=click.echo)


eval_group.add_command(ruler_cmd)
eval_group.add_command(icr_cmd)
eval_group.add_command(icl_cmd)


__all__ = ["eval_group"]
