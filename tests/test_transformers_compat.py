"""The package calls transformers by the names the installed version has (5.17, the oldest supported, to the newest
5.x): the cache argument (`cache` from 5.24, `past_key_values` before), activation checkpointing; and the suite fails
on a deprecation warning caused by this package's own calls (pyproject.toml's filterwarnings)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import longctx_patch as lp
from longctx_patch.cache import cache_argument
from longctx_patch.train.stage_loop import activation_checkpointing

from conftest import tiny_model


def _current_name(model) -> str:
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def test_cache_argument_is_the_installed_transformers_name():
    model = tiny_model("llama")
    assert cache_argument(model.forward) == _current_name(model)
    lp.patch(model, "sliding-window", window=8)
    assert cache_argument(model.forward) == _current_name(model)  # the patched top forward keeps the signature


@pytest.mark.parametrize("method,config", [("sliding-window", {"window": 8}), ("lolcats", {"checkpoint": "none"})])
def test_patched_model_decodes_without_deprecation_warnings(method, config):
    """A cached forward, a continuation passing the cache back under the current name or the older one, and
    generate(): no FutureWarning or DeprecationWarning comes out of the calls this package makes into transformers."""
    model = tiny_model("llama")
    lp.patch(model, method, **config)
    ids = torch.randint(3, 128, (1, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache = out[1]  # (logits, cache): the output field's name changed with the argument's
            nxt = out.logits[:, -1:].argmax(-1)
            a = model(nxt, use_cache=True, **{cache_argument(model.forward): cache}).logits
            cache2 = model(ids, use_cache=True)[1]
            b = model(nxt, use_cache=True, past_key_values=cache2).logits  # the older name: taken as the current one
            gen = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b) and gen.shape == (1, 15)


def test_activation_checkpointing_by_the_installed_name():
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        activation_checkpointing(model, True)
        assert all(layer.gradient_checkpointing for layer in model.model.layers)
        activation_checkpointing(model, False)
        assert not any(layer.gradient_checkpointing for layer in model.model.layers)


def test_the_suite_fails_on_a_deprecation_caused_by_this_package():
    """pyproject.toml's filters, as pytest installed them for this test: a deprecation warning that points at
    longctx_patch (its CLI included) fails, as do transformers' renamed forward keywords and checkpointing methods (which point at
    torch's or transformers' own frames) and `is_gradient_checkpointing` (read by peft when it wraps a model: our
    wrapping hides it, longctx_patch.train.trained.peft_wrapping); one from inside another library only warns."""
    with pytest.raises(FutureWarning):
        warnings.warn_explicit("`x` is deprecated", FutureWarning, "longctx_patch/patcher.py", 1,
                               module="longctx_patch.patcher")
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("old", DeprecationWarning, "longctx_patch/cli/main.py", 1,
                               module="longctx_patch.cli.main")
    with pytest.raises(FutureWarning):
        warnings.warn_explicit("`past_key_values` is deprecated and will be removed in version 5.40.0 for "
                               "`LlamaForCausalLM.forward`. Use `cache` instead.", FutureWarning,
                               "torch/nn/modules/module.py", 1, module="torch.nn.modules.module")
    with pytest.raises(FutureWarning):
        warnings.warn_explicit("`gradient_checkpointing_enable` is deprecated and will be removed in v6.",
                               FutureWarning, "transformers/modeling_utils.py", 1, module="transformers.modeling_utils")
    with pytest.raises(FutureWarning):
        warnings.warn_explicit("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning,
                               "transformers/modeling_utils.py", 2, module="transformers.modeling_utils")
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit("old", DeprecationWarning, "click/core.py", 1, module="click.core")
        from longctx_patch.train.trained import peft_wrapping

        with peft_wrapping():  # the one warning it hides; any other still reaches the filters
            warnings.warn_explicit("`is_gradient_checkpointing` is deprecated and will be removed in v6.",
                                   FutureWarning, "transformers/modeling_utils.py", 3,
                                   module="transformers.modeling_utils")
            warnings.warn_explicit("old", DeprecationWarning, "click/core.py", 2, module="click.core")
    assert len(seen) == 2
