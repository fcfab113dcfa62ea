"""Options and error handling shared by every `longctx` verb."""

from __future__ import annotations

import functools
import os
import sys
import traceback

import click

DEBUG_ENV = "LONGCTX_DEBUG"


def parse_sets(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """['window=256', 'k=v'] -> {'window': '256', 'k': 'v'}; values stay strings (configs coerce them)."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise click.BadParameter(f"{item!r} is not key=value (example: --set window=256)", param_hint="--set")
        k, v = item.split("=", 1)
        if not k.strip():
            raise click.BadParameter(f"{item!r} has an empty key", param_hint="--set")
        out[k.strip()] = v.strip()
    return out


def method_and_config(method: str, sets, layers):
    """`--method NAME` or `NAME(KEY=VALUE,...)` (eval's syntax) plus `--set KEY=VALUE` items -> (name, config,
    layers), validated before any model is loaded. Inline values win over --set ones; an inline `layers=RANGES`
    (ranges joined by '+': layers=0-3+26-29) is --layers."""
    import longctx_patch as lp
    from longctx_patch.evals.common import inline_layers
    from longctx_patch.methods import split_method_spec

    name, items = split_method_spec(method)
    name = name.strip()
    config = parse_sets(sets)
    meth = lp.get_method(name)
    for item in items:
        k, v = (x.strip() for x in item.split("=", 1))
        if k == "layers" and "layers" not in meth.config_cls.__dataclass_fields__:
            if layers is not None:
                raise click.UsageError(f"--method {method!r} gives layers= and --layers is given too; keep one")
            layers = v
        else:
            config[k] = v
    meth.parse_config(config)  # fail on a bad key or value before loading the model
    if layers is not None:
        layers = inline_layers(layers)  # the syntax now ('+' or ','); the range when the model is patched
    return name, config, layers


def device_dtype_options(f):
    f = click.option("--dtype", default=None, metavar="DTYPE",
                     help="float32 | bfloat16 | float16 (default: the checkpoint's; float32 for GGUF/the embedded model).")(f)
    f = click.option("--device", default=None, metavar="DEVICE",
                     help="cpu | cuda | cuda:N (default: cuda when available, else cpu).")(f)
    return f


def model_option(f):
    return click.option("--model", "-m", default="smollm2-135m", show_default=True, metavar="MODEL",
                        help="Alias 'smollm2-135m' (embedded, offline), a local directory (plain or saved by "
                             "'longctx patch --output'), a .gguf file, or a hub id in the local HF cache.")(f)


def _debug() -> bool:
    """--debug on the root command, or LONGCTX_DEBUG=1 in the environment."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and root.params.get("debug")) or os.environ.get(DEBUG_ENV) == "1"


def friendly_errors(f):
    """Print one readable line for expected failures (exit 1); --debug or LONGCTX_DEBUG=1 shows the traceback."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - the CLI boundary
            if _debug():
                traceback.print_exc()
            else:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                click.echo(f"error: {msg}  (for the traceback: longctx --debug VERB ..., or LONGCTX_DEBUG=1)", err=True)
            sys.exit(1)

    return wrapper
