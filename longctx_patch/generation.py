"""generate(): prompt in, text out, with the chat template when the tokenizer has one."""

from __future__ import annotations

import contextlib
import math
import numbers
import sys
import threading
from typing import Iterator

import torch

from .errors import ConfigError, NumericalError

PROGRESS_MIN_TOKENS = 1024  # prompts at least this long get a prefill progress bar when progress=True


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


PROMPT_FORMS = "pass a string, or a non-empty list of strings (a left-padded batch)"


def _shown(x) -> str:
    text = repr(x)
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(x).__name__})"


def check_prompt(prompt) -> list[str]:
    """The prompts of `prompt` (a string, or a list or tuple of strings) as a list; ConfigError saying what is
    accepted for anything else: None, another type, an empty list, an item that is not a string, an empty string."""
    if isinstance(prompt, str):
        if not prompt:
            raise ConfigError(f"generate: the prompt is empty; {PROMPT_FORMS}")
        return [prompt]
    if not isinstance(prompt, (list, tuple)):
        raise ConfigError(f"generate: prompt: got {_shown(prompt)}; {PROMPT_FORMS}")
    if not prompt:
        raise ConfigError(f"generate: prompt: got an empty {type(prompt).__name__}; {PROMPT_FORMS}")
    for i, p in enumerate(prompt):
        if not isinstance(p, str):
            raise ConfigError(f"generate: prompt {i} of the {type(prompt).__name__} is {_shown(p)}, not a string; "
                              f"{PROMPT_FORMS}")
        if not p:
            raise ConfigError(f"generate: prompt {i} of the {type(prompt).__name__} is empty; {PROMPT_FORMS}")
    return list(prompt)


MAX_NEW_TOKENS = 2**31 - 1  # generate()'s max_new_tokens at most (as the methods' int options: 32-bit positions)


def _whole(name: str, value, low: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ConfigError(f"generate: {name}={_shown(value)} is not a whole number; pass an int in "
                          f"{low}..{MAX_NEW_TOKENS}")
    if not low <= int(value) <= MAX_NEW_TOKENS:
        raise ConfigError(f"generate: {name}={int(value)} is out of range; pass an int in {low}..{MAX_NEW_TOKENS}")
    return int(value)


def _number(name: str, value, ok, allowed: str) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(float(value)) \
            or not ok(float(value)):
        raise ConfigError(f"generate: {name}={_shown(value)} is not allowed; pass {allowed}")
    return float(value)


def _flag(name: str, value, none_ok: bool = False) -> None:
    if not (isinstance(value, bool) or (none_ok and value is None)):
        raise ConfigError(f"generate: {name}={_shown(value)} is not True or False"
                          + (" (or None)" if none_ok else ""))


def check_generate_options(chat, max_new_tokens, stream, progress, generate_kwargs: dict) -> None:
    """generate()'s own arguments, and the decoding options most often passed through to transformers' generate(),
    checked by name (a ConfigError saying what is allowed) before the model runs: transformers lets a NaN
    max_new_tokens loop for ever and answers 0, -1 or '5' with errors naming none of this."""
    _flag("chat", chat, none_ok=True)
    _flag("stream", stream)
    _flag("progress", progress)
    _whole("max_new_tokens", max_new_tokens, 1)
    kw = generate_kwargs
    if kw.get("min_new_tokens") is not None:
        _whole("min_new_tokens", kw["min_new_tokens"], 0)
    if kw.get("num_beams") is not None:
        _whole("num_beams", kw["num_beams"], 1)
    if kw.get("top_k") is not None:
        _whole("top_k", kw["top_k"], 0)
    if kw.get("do_sample") is not None:
        _flag("do_sample", kw["do_sample"])
    if kw.get("temperature") is not None:
        _number("temperature", kw["temperature"], lambda t: t > 0, "a finite number > 0")
    if kw.get("top_p") is not None:
        _number("top_p", kw["top_p"], lambda p: 0 < p <= 1, "a number in (0, 1]")
    if kw.get("repetition_penalty") is not None:
        _number("repetition_penalty", kw["repetition_penalty"], lambda r: r > 0, "a finite number > 0")


def check_prefill_logits(model, logits: torch.Tensor) -> None:
    """NumericalError when the logits generate()'s prefill gives a patched model for its last position hold NaN or
    inf: every next token would be garbage (an empty or garbled answer). One host read per generate() call; called
    by the prefill installed on a patched model (decode_graphs.PrefillThenCapture)."""
    if logits.numel() == 0 or bool(torch.isfinite(logits[:, -1]).all()):
        return
    from .patch_state import find_state

    st = find_state(model)
    rows = (~torch.isfinite(logits[:, -1])).any(-1).nonzero().flatten().tolist()
    which = "; ".join(f"{g.method} on layers {_layers(g.layers)}" for g in st.groups) if st is not None else "none"
    raise NumericalError(
        f"generate: the logits after the prefill hold NaN or inf (row{'s' if len(rows) > 1 else ''} "
        f"{', '.join(map(str, rows[:8]))}{' ...' if len(rows) > 8 else ''} of the batch), so the answer would be empty "
        f"or garbled; patch: {which}. Check the method's options and the weights it loaded (a checkpoint of another "
        "model, or one holding huge values), or a half-precision dtype that overflows (try float32); the unpatched "
        "model on the same prompt tells whether the patch is the cause"
    )


def _layers(idx) -> str:
    from .methods.base import format_layers

    return format_layers(idx)


def build_inputs(tokenizer, prompt: str | list[str], chat: bool | None = None, device=None) -> dict:
    """Tokenise one prompt or a batch (left padded), applying the chat template when `chat` (default: when
    the tokenizer has one). A prompt `check_prompt` refuses, or one that gives no tokens, is a ConfigError."""
    prompts = check_prompt(prompt)
    use_chat = has_chat_template(tokenizer) if chat is None else chat
    if use_chat and not has_chat_template(tokenizer):
        raise ConfigError("chat=True but this tokenizer has no chat template; use chat=False (or --no-chat)")
    if use_chat:
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
        add_special = False
    else:
        texts, add_special = prompts, True
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special)
    finally:
        tokenizer.padding_side = side
    lengths = enc["attention_mask"].sum(-1).tolist() if "attention_mask" in enc else [enc["input_ids"].shape[-1]]
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
        which = "the prompt gives" if isinstance(prompt, str) else f"prompt {empty[0]} of the list gives"
        raise ConfigError(f"generate: {which} no tokens with this tokenizer; {PROMPT_FORMS} of text")
    if device is not None:
        enc = {k: v.to(device) for k, v in enc.items()}
    return dict(enc)


def generate(
    model,
    tokenizer,
    prompt: str | list[str],
    *,
    chat: bool | None = None,
    max_new_tokens: int = 64,
    stream: bool = False,
    progress: bool = False,
    **generate_kwargs,
) -> str | list[str] | Iterator[str]:
    """Generate a continuation of `prompt` (a string, or a list for a left-padded batch; anything else, an empty
    string or list, is a ConfigError saying what is accepted).

    Greedy unless sampling arguments are given. Returns the new text (a list for a batch), or with
    `stream=True` an iterator over text pieces as they are produced (single prompt only). `progress=True`
    shows on stderr how many decoder layers the prefill of a prompt of at least PROGRESS_MIN_TOKENS tokens has
    done (a long prefill on a CPU takes minutes); the computation is the same.
    """
    check_prompt(prompt)  # before anything else: a bad prompt is refused by name
    check_generate_options(chat, max_new_tokens, stream, progress, generate_kwargs)
    if stream and not isinstance(prompt, str):
        raise ConfigError("stream=True takes a single prompt (a string); generate a batch without stream")
    device = next(model.parameters()).device
    enc = build_inputs(tokenizer, prompt, chat=chat, device=device)
    kw = {"max_new_tokens": max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    if "do_sample" not in generate_kwargs and not any(k in generate_kwargs for k in ("temperature", "top_p", "top_k")):
        kw["do_sample"] = False
    kw.update(generate_kwargs)
    n_in = enc["input_ids"].shape[1]
    show = progress and n_in >= PROGRESS_MIN_TOKENS
    if stream:
        return _stream(model, tokenizer, enc, kw, show)
    with torch.no_grad(), _prefill_progress(model, n_in, show):
        out = model.generate(**enc, **kw)
    texts = tokenizer.batch_decode(out[:, n_in:], skip_special_tokens=True)
    return texts[0] if isinstance(prompt, str) else texts


@contextlib.contextmanager
def _prefill_progress(model, n_tokens: int, enabled: bool):
    """A bar of the decoder layers done by the next forward pass (generate's prefill), from forward hooks on
    the layers; the hooks go once every layer has run (the decode steps run without them) or on exit."""
    layers = None
    if enabled:
        from .architectures import base_model

        with contextlib.suppress(Exception):  # a model whose layers are not found runs without a bar
            layers = list(base_model(model).layers)
    if not layers:
        yield
        return
    from tqdm import tqdm

    bar = tqdm(total=len(layers), desc=f"prefill {n_tokens:,} tokens", unit="layer", file=sys.stderr, leave=False,
               mininterval=0)  # one refresh per layer: every layer shown
    handles: list = []

    def remove():
        while handles:
            handles.pop().remove()
        bar.close()

    def layer_done(*_):
        bar.update(1)
        if bar.n >= len(layers):
            remove()

    handles += [layer.register_forward_hook(layer_done) for layer in layers]
    try:
        yield
    finally:
        remove()


def _stream(model, tokenizer, enc, kw, progress: bool = False) -> Iterator[str]:
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    err: list[BaseException] = []

    def run():
        try:
            with torch.no_grad(), _prefill_progress(model, enc["input_ids"].shape[1], progress):
                model.generate(**enc, **kw, streamer=streamer)
        except BaseException as e:  # surfaced in the consumer
            err.append(e)
            streamer.end()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    for piece in streamer:
        if piece:
            yield piece
    t.join()
    if err:
        raise err[0]
