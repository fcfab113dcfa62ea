"""The patch kept on the model (longctx_patch/patch_state.py): copies of a patched model carry a state of their own.

A deep copy (or a pickle) of a patched model once kept running the original's state: the forward pre-hook was a
closure over the original's PatchState, so a copy's padded rows read no padding (up to 4.0 off in the logits), a
copy taken after a padded forward kept that batch's mask (the next batch of another size raised), and pickling
failed on the closure. tests/test_method_contract.py checks copies for every method; here, `exact` and the parts
of the patch besides the modules: the hook, generate()'s cache, the decode-graph forward, the fused ops.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import left_padded_prompts, padded_batch_gap, tiny_model

import longctx_patch as lp
from longctx_patch.cache import LongctxCache
from longctx_patch.decode_graphs import DecodeGraphs
from longctx_patch.fused_ops import FusedForward
from longctx_patch.kernels.backend import triton_installed
from longctx_patch.patch_state import STATE_ATTR, find_state, patch_context, patched_modules
from longctx_patch.patcher import PrepareCache

COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m))}


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_runs_padded_batches_with_its_own_state(how, one_thread):
    model = lp.patch(tiny_model("llama"), "exact")
    c = COPIES[how](model)  # taken before any forward
    gap, same = padded_batch_gap(c, [30, 22, 9])
    assert same and gap <= 1e-5, gap
    # a forward's padding travels with the call (patch_state.CallState): neither context keeps it
    _, ids, am = left_padded_prompts([30, 22, 9])
    with torch.no_grad():
        c(ids, attention_mask=am)
    assert patch_context(c) is not patch_context(model)
    assert not hasattr(patch_context(c), "key_mask") and not hasattr(patch_context(model), "key_mask")


def test_a_copy_after_a_padded_forward_takes_batches_of_other_sizes(one_thread):
    model = lp.patch(tiny_model("llama"), "exact")
    _, ids, am = left_padded_prompts([30, 22, 9])
    with torch.no_grad():
        model(ids, attention_mask=am)
        c = copy.deepcopy(model)
        for B, S in ((1, 12), (5, 30)):
            x = torch.randint(3, 128, (B, S), generator=torch.Generator().manual_seed(B))
            assert torch.equal(c(x).logits, model(x).logits)


@pytest.mark.parametrize("how", list(COPIES))
def test_the_copy_owns_every_entry_point(how):
    """The hook finds the copy's state on the copy; generate()'s cache override, the decode-graph forward and the
    cache it builds are the copy's."""
    model = lp.patch(tiny_model("llama"), "exact")
    c = COPIES[how](model)
    base = c.model
    st = find_state(c)
    assert st is getattr(base, STATE_ATTR) and st is not find_state(model)
    assert isinstance(c.__dict__["_prepare_cache_for_generation"], PrepareCache)
    assert c._prepare_cache_for_generation.model is c
    assert isinstance(c.__dict__["forward"], DecodeGraphs) and c.forward.model is c
    assert c.forward.orig.__self__ is c and st.decode_graphs is c.forward and st.generate_owner is c
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = c.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        want = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert isinstance(out.past_key_values, LongctxCache) and torch.equal(out.sequences, want)
    assert list(patched_modules(c)) == [0, 1, 2]


@pytest.mark.parametrize("how", list(COPIES))
def test_unpatching_one_leaves_the_other_patched(how, one_thread):
    model = lp.patch(tiny_model("llama"), "exact")
    c = COPIES[how](model)
    lp.unpatch(model)
    assert lp.is_patched(c) and not lp.is_patched(model)
    assert "_prepare_cache_for_generation" in c.__dict__ and "forward" in c.__dict__
    assert not model.model._forward_pre_hooks and c.model._forward_pre_hooks
    gap, same = padded_batch_gap(c, [30, 22, 9], max_new_tokens=2)  # the copy's hook still runs
    assert same and gap <= 1e-5, gap
    lp.unpatch(c)
    assert not c.model._forward_pre_hooks and "forward" not in c.__dict__


@pytest.mark.skipif(not triton_installed(), reason="needs Triton (its interpreter runs the fused kernels)")
def test_a_copy_keeps_its_fused_forwards():
    model = lp.patch(tiny_model("llama"), "exact", fused_ops="triton")
    c = copy.deepcopy(model)
    fused = [m for m in c.modules() if isinstance(m.__dict__.get("forward"), FusedForward)]
    assert fused and all(m.forward.module is m for m in fused)
    assert {id(m) for m in fused}.isdisjoint(id(m) for m in model.modules())
    lp.unpatch(c)
    assert not any(isinstance(m.__dict__.get("forward"), FusedForward) for m in c.modules())
    assert any(isinstance(m.__dict__.get("forward"), FusedForward) for m in model.modules())
