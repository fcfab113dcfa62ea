"""`longctx`: patch Hugging Face causal LMs for long contexts, generate, evaluate and fine-tune."""

from __future__ import annotations

import sys

import click

from .common import InputError, device_dtype_options, friendly_errors, load, method_and_config, model_option


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.version_option(package_name="longctx-patch")
def main(debug: bool) -> None:
    """Patch a Hugging Face causal LM's attention in place for cheap long contexts.

    Embedded models (--model, offline): smollm2-135m (the default) and qwen2.5-coder-0.5b (its install command:
    longctx info); any llama, mistral, qwen2 or qwen3 checkpoint too.

    \b
    Examples:
      longctx info
      longctx patch --method sliding-window --set window=256
      longctx generate --method sliding-window --set window=256 --prompt "Tell me a story"
      longctx generate --model qwen2.5-coder-0.5b --prompt "Write a Python function that reverses a list"
      longctx patch --model meta-llama/Llama-3.2-1B --method muse --output llama-muse/
      longctx calibrate --method muse --text calib.txt --length 8192 --target-error 0.01 --output smollm2-muse/
      longctx eval niah --method exact --method sliding-window --set sliding-window.window=256 --lengths 1k,2k
      longctx finetune recipes/linearize.yaml --text longctx_patch/evals/data/shakespeare.txt --quick
    """
    # --debug is read back by friendly_errors from this command's params (no global state)


# --------------------------------------------------------------------------------------------- info
@main.command()
@click.argument("methods", nargs=-1, metavar="[METHOD]...")
@friendly_errors
def info(methods) -> None:
    """List methods (with their config fields and defaults), supported architectures, the embedded models
    (smollm2-135m, qwen2.5-coder-0.5b) with their install commands, and whether Triton and CUDA are available here.
    With METHOD names: only those methods and their options.

    \b
    Examples:
      longctx info
      longctx info muse
    """
    import torch

    from longctx_patch import __version__
    from longctx_patch.architectures import supported_model_types
    from longctx_patch.methods import get_method, list_methods
    from longctx_patch.models import EMBEDDED

    if methods:
        for m in [get_method(name.strip()) for name in methods]:  # an unknown name fails before anything prints
            _describe_method(m)
        return
    click.echo(f"longctx-patch {__version__}  (torch {torch.__version__})")
    cuda = torch.cuda.is_available()
    click.echo(f"CUDA: {'yes (' + torch.cuda.get_device_name(0) + ')' if cuda else 'no'}")
    try:
        import triton

        tri = f"triton {triton.__version__}" + (": the methods' GPU kernels run on it" if cuda else
                                                 ", unused here: Triton kernels need CUDA, so PyTorch references run")
    except ImportError:
        tri = ("not installed: the methods' GPU kernels need it, PyTorch references run instead (pip install triton)"
               if cuda else "not installed; not needed here (Triton kernels need CUDA; without it PyTorch references run)")
    click.echo(f"Triton: {tri}")
    click.echo(f"Architectures: {', '.join(supported_model_types())}")
    click.echo("Embedded models (--model NAME; each install command brings that model's weights, nothing else):\n"
               + "\n".join(_describe_embedded(m) for m in EMBEDDED))
    click.echo("Methods:")
    for name in list_methods():
        _describe_method(get_method(name))


def _describe_embedded(m) -> str:
    """Two lines: the names and the model, then its install command and what that brings."""
    from longctx_patch.evals.common import format_bytes
    from longctx_patch.models import cache_dir

    n = len(m.parts)
    dists = m.parts[0][0] if n == 1 else f"{n} packages, {m.parts[0][0]} to {m.parts[-1][0]} (the parts of one file)"
    return (f"  {', '.join((m.name, *m.aliases))}: {m.description}\n"
            f"      install: {m.install}\n"
            f"      (brings {m.description.split(' (')[0]} as a {format_bytes(m.size)} GGUF in {dists}; the first "
            f"load dequantises it once into {cache_dir()})")


def _describe_method(m) -> None:
    click.echo(f"  {m.name}: {m.description}")
    for f in m.config_cls.describe():
        click.echo(f"      {f['name']} = {f['default']!r}  ({f['allowed']}) {f['help']}")


# --------------------------------------------------------------------------------------------- patch
def sample_text() -> str:
    """Built-in fidelity sample: Python standard library source (present on every machine)."""
    import argparse
    import inspect
    import textwrap

    return inspect.getsource(textwrap) + inspect.getsource(argparse)


def _load_and_patch(model, method, sets, layers, device, dtype):
    import longctx_patch as lp

    if method:
        method, config, layers = method_and_config(method, sets, layers)  # fails before the model loads
    elif sets or layers:
        raise click.UsageError("--set/--layers need --method")
    m, tok = load(model, device, dtype, layer_specs=[layers] if method else None)
    if method:
        lp.patch(m, method, layers=layers, **config)
        for src in _weight_sources(m):
            click.echo(f"method weights: {src}", err=True)
    return m, tok


def _weight_sources(model) -> list[str]:
    """Where the patched layers' trained weights came from (methods that load weights set `weights_source`)."""
    from longctx_patch.patcher import patched_modules

    seen = []
    for mod in patched_modules(model).values():
        src = getattr(mod, "weights_source", None)
        if src and src not in seen:
            seen.append(src)
    return seen


@main.command()
@model_option
@click.option("--method", required=True, metavar="METHOD",
              help="Method name (see 'longctx info'), optionally with its config inline: 'lola(window=256,sparse_cache=256)'.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Method config value, repeatable (e.g. --set window=256). See 'longctx info' for keys.")
@click.option("--layers", default=None, metavar="SPEC", help="Layers to patch, e.g. '0-7,12' (default: all).")
@click.option("--output", "-o", default=None, type=click.Path(file_okay=False),
              help="Save the patched model here (HF checkpoint + longctx_patch.json + method weights).")
@click.option("--fidelity-tokens", default=None, type=click.IntRange(8), metavar="N",
              help="Length of the built-in sample text for the fidelity check (default: 1024, or longer where the "
                   "method approximates only past 1024 tokens and that is affordable on this device: 4k on a CPU).")
@device_dtype_options
@friendly_errors
def patch(model, method, sets, layers, output, fidelity_tokens, device, dtype) -> None:
    """Load MODEL, patch it with METHOD, print a summary and a fidelity check, optionally save it.

    The summary lists the patched layers, the parameters the method adds and the decode-time state
    (per token and at 8k/32k/128k tokens) against a full KV cache. The fidelity check compares logits
    with the unpatched model on a built-in sample text (Python standard library source): mean/max
    absolute logit difference and next-token (argmax) agreement, over every position and over the
    positions the method approximates. A method approximates only past some length (muse: past its
    exact blocks, 5888 tokens by default; moba: past top_k blocks); the default length reaches it where
    that is affordable here, else the check says that it ran exactly and which --fidelity-tokens tests it.

    \b
    Examples:
      longctx patch --model smollm2-135m --method sliding-window --set window=256
      longctx patch --method muse --fidelity-tokens 8192      # muse's far field (minutes on a CPU)
    """
    import torch

    import longctx_patch as lp
    from longctx_patch.evals.common import format_bytes
    from longctx_patch.patcher import patch_groups, patched_modules

    from .fidelity import approximation_start, check_length, report

    method, config, layers = method_and_config(method, sets, layers)  # fails before the model loads
    if output:
        from longctx_patch.checkpoint import check_replaceable

        check_replaceable(output)  # a folder save_patched would refuse to replace: refused before the load too
    parsed = lp.get_method(method).parse_config(dict(config))
    m, tok = load(model, device, dtype, layer_specs=[layers])  # an unsupported model fails before the reference pass
    dev = next(m.parameters()).device
    head_dim = getattr(m.config, "head_dim", None) or m.config.hidden_size // m.config.num_attention_heads
    start, first, why = approximation_start(lp.get_method(method).name, parsed, dev.type, head_dim)
    all_ids = tok(sample_text(), return_tensors="pt").input_ids
    limit = min(all_ids.shape[1], int(getattr(m.config, "max_position_embeddings", None) or all_ids.shape[1]))
    if fidelity_tokens is None:
        fidelity_tokens = check_length(start, dev, limit)
    ids = all_ids[:, :fidelity_tokens].to(dev)
    with torch.no_grad():
        ref = m(ids, use_cache=False).logits.float()
    lp.patch(m, method, layers=layers, **config)
    with torch.no_grad(), lp.get_method(method).call_report() as report_lines:
        out = m(ids, use_cache=False).logits.float()

    mods = patched_modules(m)
    cfg = m.config
    n_layers = cfg.num_hidden_layers
    added = sum(v.numel() for mod in mods.values() for v in mod.method_parameters().values())
    total = sum(p.numel() for p in m.parameters())
    kv_dtype = next(m.parameters()).dtype
    ex = next(iter(mods.values()))
    full_layer = lambda L: 2 * ex.num_key_value_heads * ex.head_dim * L * torch.tensor([], dtype=kv_dtype).element_size()  # noqa: E731

    def state(L):
        return sum(mods[i].state_bytes(L, 1, kv_dtype) if i in mods else full_layer(L) for i in range(n_layers))

    groups = "; ".join(f"{g.method} on layers {_ranges(g.layers)} with {g.config.to_dict()}" for g in patch_groups(m))
    click.echo(f"patched: {groups}")
    for src in _weight_sources(m):
        click.echo(f"method weights: {src}")
    click.echo(f"layers patched: {len(mods)}/{n_layers}")
    click.echo(f"parameters added: {added:,} ({100 * added / max(total - added, 1):.3f}% of {total - added:,})")
    click.echo(f"decode state ({kv_dtype}, batch 1) vs full KV cache:")
    per_tok_full = n_layers * full_layer(1)
    click.echo(f"  {'tokens':>8}  {'patched':>12}  {'full KV':>12}  ratio")
    for L in (1, 8192, 32768, 131072):
        s, f = state(L), n_layers * full_layer(L)
        click.echo(f"  {L:>8}  {format_bytes(s):>12}  {format_bytes(f):>12}  {s / f:.4f}")
    click.echo(f"  (full KV: {format_bytes(per_tok_full)} per token)")
    report(out, ref, lp.get_method(method).name, start, first, why, dev, limit, click.echo)
    for line in report_lines():  # what the method decided in the check's forward (muse: its run-time guard)
        click.echo(f"  {line}")
    if output:
        lp.save_patched(m, output, tokenizer=tok)
        click.echo(f"saved to {output}")


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(f"{start}-{prev}" if prev > start else f"{start}")
        if i is not None:
            start = prev = i
    return ",".join(runs)


# --------------------------------------------------------------------------------------------- generate
@main.command()
@model_option
@click.option("--method", default=None, metavar="METHOD",
              help="Patch with this method first (default: none); NAME or NAME(KEY=VALUE,...), as for 'longctx patch'.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Method config value, repeatable.")
@click.option("--layers", default=None, metavar="SPEC", help="Layers to patch, e.g. '0-7,12' (default: all).")
@click.option("--prompt", "-p", default=None, help="The prompt text.")
@click.option("--prompt-file", "-f", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Read the prompt from this file (e.g. a long essay followed by a question).")
@click.option("--chat/--no-chat", default=None,
              help="Apply the tokenizer's chat template (default: when the tokenizer has one).")
@click.option("--max-new-tokens", "-n", default=128, show_default=True, type=click.IntRange(1),
              help="How many tokens to generate at most (fewer if the model ends its answer).")
@click.option("--stream/--no-stream", default=False, show_default=True, help="Print text as it is generated.")
@click.option("--progress/--no-progress", default=True,
              help="Show the progress of a long prompt's prefill (decoder layers done) on stderr: a bar on a "
                   "terminal, else a line every 10 s (a log file, CI).  [default: on]")
@device_dtype_options
@friendly_errors
def generate(model, method, sets, layers, prompt, prompt_file, chat, max_new_tokens, stream, progress, device,
             dtype) -> None:
    """Generate text from a prompt with an (optionally patched) model. Greedy decoding.

    A patched model answers from what its method keeps: sliding-window, the last `window` tokens only. In the
    example's 5k-token prompt dedent is defined 620 tokens before the question: exact attention answers, a 256-token
    window cannot see it (nor the prompt's start) and the model loops on the file's last lines.

    \b
    Examples:
      longctx generate --prompt "What is the capital of France?"
      python -c "import inspect, textwrap; print(inspect.getsource(textwrap), 'What does dedent do?')" > prompt.txt
      longctx generate --method exact --prompt-file prompt.txt --stream
      longctx generate --method sliding-window --set window=256 --prompt-file prompt.txt --stream
    """
    import longctx_patch as lp

    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt or --prompt-file")
    if prompt is None:
        from longctx_patch.errors import ConfigError
        from longctx_patch.texts import read_text

        try:
            prompt_text = read_text(prompt_file, option="--prompt-file")
        except ConfigError as e:  # a binary or unreadable file: a usage error, before anything loads
            raise InputError(str(e)) from None
    text = prompt if prompt is not None else prompt_text
    if not text.strip():
        source = "--prompt is empty" if prompt is not None else f"--prompt-file {prompt_file} holds no text"
        raise InputError(f"{source}; give the text to continue or answer, e.g. --prompt \"What is the capital of "
                         f"France?\", or a file of text with --prompt-file FILE")
    m, tok = _load_and_patch(model, method, sets, layers, device, dtype)
    kw = dict(chat=chat, max_new_tokens=max_new_tokens, progress=progress)
    if stream:
        for piece in lp.generate(m, tok, text, stream=True, **kw):
            click.echo(piece, nl=False)
        click.echo()
    else:
        click.echo(lp.generate(m, tok, text, **kw))


# --------------------------------------------------------------------------------------------- sub-verbs
from .calibrate_cmd import calibrate_cmd  # noqa: E402
from .eval_cmd import eval_group  # noqa: E402
from .finetune_cmd import finetune_cmd  # noqa: E402

main.add_command(calibrate_cmd)
main.add_command(eval_group)
main.add_command(finetune_cmd)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
