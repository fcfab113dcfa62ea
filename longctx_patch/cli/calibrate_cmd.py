"""`longctx calibrate`: per-layer budgets of an approximate method, measured on a text against an error target."""

from __future__ import annotations

import click

from .common import InputError, device_dtype_options, friendly_errors, load, method_and_config, model_option


def _ladder(items) -> list[dict[str, str]] | None:
    """--ladder 'topk_blocks=4,peak_blocks=4' items -> [{option: value}] (values stay strings: configs coerce them)."""
    if not items:
        return None
    out = []
    for item in items:
        over = {}
        for part in item.split(","):
            if "=" not in part or not part.split("=", 1)[0].strip():
                raise click.BadParameter(f"{item!r} is not KEY=VALUE,... (example: --ladder topk_blocks=4,peak_blocks=4)",
                                         param_hint="--ladder")
            k, v = part.split("=", 1)
            over[k.strip()] = v.strip()
        out.append(over)
    return out


@click.command("calibrate")
@model_option
@click.option("--method", default="muse", show_default=True, metavar="METHOD",
              help="The method whose budgets are calibrated (muse), optionally with its options inline: "
                   "'muse(far_field=tilted-cells)'. Its options are where every setting starts from.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="A method option every setting starts from, repeatable (e.g. --set block_size=128).")
@click.option("--layers", default=None, metavar="SPEC", help="Layers to calibrate and patch, e.g. '0-7,12' (default: all).")
@click.option("--text", required=True, type=click.Path(exists=True),
              help="The calibration text: a file, or a folder of text files (read in order, joined). Best at the "
                   "length the model will run: the error grows with the length.")
@click.option("--length", default=None, type=click.IntRange(1), metavar="TOKENS",
              help="Calibrate on the text's first TOKENS tokens (default: all of it).")
@click.option("--target-error", default=0.01, show_default=True, type=float, metavar="E",
              help="Relative error ||o - o_exact|| / ||o_exact|| a layer's attention output may have against exact "
                   "attention on the text, in (0, 1): 0.01 is 1%.")
@click.option("--objective", default="layer", show_default=True, type=click.Choice(["layer", "mean"]),
              help="layer: every layer meets the target; mean: the mean over the layers does (budget goes where it "
                   "removes the most error per unit of cost).")
@click.option("--cost", default="auto", show_default=True, type=click.Choice(["auto", "keys", "time"]),
              help="What a setting costs: keys (keys each query attends, counted: deterministic), time (op time "
                   "measured on CUDA), auto (time on CUDA, keys elsewhere).")
@click.option("--per-head/--no-per-head", default=True, show_default=True,
              help="Also try each setting with its worst query heads exact.")
@click.option("--ladder", multiple=True, metavar="KEY=VALUE,...",
              help="A setting to try instead of the built-in ladder, repeatable: --ladder topk_blocks=2,peak_blocks=2 "
                   "--ladder topk_blocks=8,peak_blocks=8 (the options as given are always tried too).")
@click.option("--output", "-o", default=None, type=click.Path(file_okay=False),
              help="Save the calibrated model here (as 'longctx patch --output'; the calibration is in "
                   "longctx_patch.json; load it with --model DIR or longctx_patch.load_patched).")
@device_dtype_options
@friendly_errors
def calibrate_cmd(model, method, sets, layers, text, length, target_error, objective, cost, per_head, ladder, output,
                  device, dtype) -> None:
    """Calibrate METHOD's budgets per layer on a text, patch the model with them, print a summary, optionally save.

    One forward over the text captures every layer's real queries, keys and values; on them each setting of the
    method's ladder (retrieved blocks, key cells; each also with its worst heads exact) and exact attention are
    measured: the attention error per layer and head against exact attention (fp32), and the cost (keys per query
    or op time). Each layer then takes the cheapest setting that meets the target (exact attention where none
    does), a second forward checks the choices, and the model is patched with them: layers that share a setting
    are one patch group. docs/muse.md, "Calibration", has the details.

    The summary lists per layer what it runs, its error before and after, and its cost (also as a fraction of
    exact attention's), then the totals against the target, the options as given and exact attention.

    \b
    Examples:
      python -c "import inspect, argparse, typing; print(inspect.getsource(argparse), inspect.getsource(typing))" > calib.txt
      longctx calibrate --text calib.txt --length 8192 --target-error 0.01
      longctx calibrate --model qwen.gguf --text calib.txt --length 32768 --device cuda --output qwen-muse/
      longctx calibrate --method 'muse(far_field=tilted-cells)' --text calib.txt --objective mean
      longctx generate --model qwen-muse/ --prompt-file prompt.txt      # the saved, calibrated model
    """
    import longctx_patch as lp
    from longctx_patch.calibration import check_target
    from longctx_patch.texts import text_files

    target = check_target(target_error)  # before anything is loaded
    name, config, layers = method_and_config(method, sets, layers)
    meth = lp.get_method(name)
    try:
        meth.calibration()  # a method without budgets to calibrate is refused before the model loads
    except lp.MissingHookError as e:
        raise InputError(f"--method {name}: {e}") from None
    steps = _ladder(ladder)
    for over in steps or ():
        meth.parse_config({**config, **over})  # a bad setting fails before the model loads
    files = text_files(text, option="--text", skip_meta=True)
    body = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    m, tok = load(model, device, dtype, layer_specs=[layers])
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    cal = lp.calibrate(m, name, body, tokenizer=tok, target_error=target, layers=layers, length=length,
                       objective=objective, cost=cost, per_head=per_head, ladder=steps, progress=say, **config)
    click.echo(cal.table())
    if output:
        lp.save_patched(m, output, tokenizer=tok)
        click.echo(f"saved to {output}")
