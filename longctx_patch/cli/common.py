"""Options and error handling shared by every `longctx` verb."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import traceback
import warnings

import click

DEBUG_ENV = "LONGCTX_DEBUG"

# The exit codes of every verb (README.md, "Command line"):
EXIT_FAILED = 1  # the run failed: a model or checkpoint that cannot be loaded, a device, memory, NaN ..., or a
#                  ConfigError that only shows once the work has begun (e.g. layers past the loaded model's count)
EXIT_USAGE = 2  # the command line is wrong: click's usage errors, an InputError, or a ConfigError raised before the
#                 verb's work begins (work_started): a bad option value, an unknown method, an input file named on the
#                 command line that is missing or not text, a recipe that is not text or not valid
WORK_STARTED = "longctx.work_started"  # click's ctx.meta key set by work_started()


def work_started() -> None:
    """Marks where a verb's work begins (a model loads, a training starts): a ConfigError raised before this point
    is the command line's (exit EXIT_USAGE), after it the run's (EXIT_FAILED)."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[WORK_STARTED] = True


def _exit_code(e: Exception) -> int:
    from longctx_patch.errors import ConfigError

    ctx = click.get_current_context(silent=True)
    started = ctx is None or ctx.meta.get(WORK_STARTED, False)
    return EXIT_USAGE if isinstance(e, ConfigError) and not started else EXIT_FAILED


class InputError(click.ClickException):
    """Bad command-line input, found before anything is loaded: one `error: ...` line, exit code 2 (EXIT_USAGE, as
    click's usage errors)."""

    exit_code = EXIT_USAGE

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def check_layers_spec(spec: str | None, where: str | None = None, example: str = "--layers 0-7,12") -> None:
    """Layer selections on the command line are 0-based: a negative index (which the Python API counts from the
    end) is refused instead of silently meaning a layer counted from the end. `where` names the input in the
    message (default: `--layers SPEC`)."""
    if spec is None:
        return
    for part in str(spec).replace("+", ",").replace(" ", "").split(","):
        if re.match(r"-\d", part) or re.search(r"\d--\d", part):
            raise InputError(f"{where or f'--layers {spec!r}'}: layers are numbered from 0 and cannot be negative "
                             f"(a model with N layers has layers 0 to N-1); write e.g. {example}")


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

    check_layers_spec(layers)
    name, items = split_method_spec(method)
    name = name.strip()
    config = parse_sets(sets)
    meth = lp.get_method(name)
    for item in items:
        k, v = (x.strip() for x in item.split("=", 1))
        if k == "layers" and "layers" not in meth.config_cls.__dataclass_fields__:
            if layers is not None:
                raise click.UsageError(f"--method {method!r} gives layers= and --layers is given too; keep one")
            check_layers_spec(v, f"--method {method!r}", "layers=0-7+12")
            layers = v
        else:
            config[k] = v
    meth.parse_config(config)  # fail on a bad key or value before loading the model
    if layers is not None:
        layers = inline_layers(layers)  # the syntax now ('+' or ','); the range when the model is patched
    return name, config, layers


def check_architecture(model: str) -> None:
    """Before loading: when MODEL's config can be read without its weights (a local directory, or a hub id whose
    config.json is in the local Hugging Face cache) and names an architecture no adapter supports, raise the
    UnsupportedModelError that patching would raise after the load. Anything else is left to the load."""
    from types import SimpleNamespace

    from longctx_patch.errors import UnsupportedModelError
    from longctx_patch.models import ALIASES

    model = str(model)
    if model in ALIASES or model.endswith(".gguf"):
        return
    if os.path.isdir(model):
        config_dir = model
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")  # no network
        except Exception:  # noqa: BLE001 - not a hub id; the load says so
            return
        if not isinstance(cached, str):
            return
        config_dir = os.path.dirname(cached)
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        return
    from transformers import AutoConfig

    from longctx_patch.architectures import get_adapter

    try:
        config = AutoConfig.from_pretrained(config_dir)
        get_adapter(SimpleNamespace(config=config))
    except UnsupportedModelError:
        raise
    except Exception:  # noqa: BLE001 - an unreadable config is reported by the load itself
        return


def check_patchable(model, layer_specs=(None,), name: str | None = None) -> None:
    """After loading, before any forward pass: the model's architecture has an adapter, every layer selection
    fits its layer count and none selects a layer that a saved patched model (`name`) already patches (the errors
    patch() would raise later, after a reference pass or another method's run; the last one in command-line terms)."""
    from longctx_patch.architectures import get_adapter
    from longctx_patch.errors import AlreadyPatchedError
    from longctx_patch.patcher import parse_layers, patched_layers

    n = len(get_adapter(model).decoder_layers(model))
    wanted: set[int] = set()
    for spec in layer_specs:
        wanted.update(parse_layers(spec, n))
    have = patched_layers(model)
    if wanted & set(have):
        raise AlreadyPatchedError(_saved_patched_advice(name or "the model", have, n))


def _saved_patched_advice(name: str, have: dict[int, str], n: int) -> str:
    """What to do, on the command line, when --method would patch layers a saved patched model already patches."""
    from longctx_patch.methods.base import format_layers

    runs = "; ".join(f"layers {format_layers([i for i in have if have[i] == m])} run {m}"
                     for m in sorted(set(have.values())))
    ctx = click.get_current_context(silent=True)
    verb = ctx.info_name if ctx is not None else ""
    if verb == "generate":
        use = "drop --method (and its --set/--layers) to run it as saved"
    elif verb == "patch":
        use = "longctx patch patches a model that is not patched yet"
    else:
        use = "--method none runs it as saved"
    free = [i for i in range(n) if i not in have]
    other = f"; or patch only the layers it leaves unpatched: --layers {format_layers(free)}" if free else ""
    return (f"{name} was saved patched ({runs}), and --method would patch those layers again: {use}; to try "
            f"another method, give the model it was made from (--model BASE){other}")


def check_device_dtype(device, dtype) -> None:
    """--device and --dtype, checked before anything is loaded."""
    from longctx_patch.models import resolve_device, resolve_dtype

    resolve_dtype(dtype)
    resolve_device(device)


def load(model: str, device, dtype, layer_specs=None):
    """`(model, tokenizer)` with a `loading MODEL ...` line. `layer_specs`: the layer selections that will be
    patched (None: nothing is patched); checked against the architecture before and after the load."""
    import longctx_patch as lp

    check_device_dtype(device, dtype)
    if layer_specs is not None:
        check_architecture(model)
    click.echo(f"loading {model} ...", err=True)
    work_started()
    pair = lp.load_model(model, dtype=dtype, device=device)
    if layer_specs is not None:
        check_patchable(pair[0], layer_specs, name=model)
    return pair


def device_dtype_options(f):
    f = click.option("--dtype", default=None, metavar="DTYPE",
                     help="float32 | bfloat16 | float16 (default: the checkpoint's; float32 for GGUF/the embedded "
                          "models). On a CPU use float32: bfloat16 runs slower there (2.3x on Qwen2.5-Coder-0.5B).")(f)
    f = click.option("--device", default=None, metavar="DEVICE",
                     help="cpu | cuda | cuda:N (default: cuda when available, else cpu).")(f)
    return f


# The embedded models' aliases (longctx_patch.models.EMBEDDED; written here so that --help imports no torch)
EMBEDDED_ALIASES = ("smollm2-135m", "qwen2.5-coder-0.5b")
MODEL_HELP = (f"Alias '{EMBEDDED_ALIASES[0]}' or '{EMBEDDED_ALIASES[1]}' (embedded, offline; see 'longctx info'), "
              "a local directory (plain or saved by 'longctx patch --output'), a .gguf file, or a hub id in the "
              "local HF cache.")


def model_option(f):
    return click.option("--model", "-m", default=EMBEDDED_ALIASES[0], show_default=True, metavar="MODEL",
                        help=MODEL_HELP)(f)


def _debug() -> bool:
    """--debug on the root command, or LONGCTX_DEBUG=1 in the environment."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and root.params.get("debug")) or os.environ.get(DEBUG_ENV) == "1"


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning for CLI users: `warning: MESSAGE` on one line of stderr, without the category and
    the source line (--debug keeps Python's format)."""
    text = " ".join(str(message).split())
    click.echo(f"warning: {text}", err=True)


@contextlib.contextmanager
def library_bars_off_in_logs():
    """Without a terminal on stderr (a log file, CI), transformers' own progress bars (`Loading weights`), redrawn
    with carriage returns into one unreadable line, are off while a verb runs; our own steps print progress lines
    there (longctx_patch.progress)."""
    from longctx_patch.progress import stderr_is_terminal

    if stderr_is_terminal():
        yield
        return
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def friendly_errors(f):
    """Print one readable line for expected failures, exit code EXIT_USAGE (2) for a ConfigError raised before the
    verb's work began (work_started), EXIT_FAILED (1) otherwise; --debug or LONGCTX_DEBUG=1 shows the traceback.
    Warnings raised while the verb runs print as one `warning: ...` line (--debug: Python's format)."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():  # puts showwarning back afterwards (several verbs in one process: tests)
            if not _debug():
                warnings.showwarning = show_warning
            try:
                with library_bars_off_in_logs():
                    return f(*args, **kwargs)
            except (click.ClickException, click.exceptions.Exit, click.Abort, KeyboardInterrupt):
                raise
            except BrokenPipeError:  # the reader went away (`longctx info | head`): nothing to report
                with contextlib.suppress(Exception):  # no second error when Python flushes stdout at exit
                    fd = sys.stdout.fileno()
                    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
                sys.exit(1)
            except Exception as e:  # noqa: BLE001 - the CLI boundary
                if _debug():
                    traceback.print_exc()
                else:
                    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    click.echo(f"error: {msg}  (for the traceback: longctx --debug VERB ..., or LONGCTX_DEBUG=1)", err=True)
                sys.exit(_exit_code(e))

    return wrapper
