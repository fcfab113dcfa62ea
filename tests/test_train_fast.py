"""The trainer's fast paths give the values of the plain ones: the chunked next-token loss, the transfer MSE, the
recomputed patched attention, the fused-loss forward of the runner (fp32, tiny models)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longctx_patch.train.losses import fusable_head, lm_head_bypassed, next_token_loss, transfer_mse


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _close(a, b, tol=1e-5):
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a - b).abs().max().item()


@pytest.mark.parametrize("ignore", [False, True])
def test_next_token_loss_matches_cross_entropy(ignore):
    g = torch.Generator().manual_seed(0)
    B, S, H, V = 2, 9, 16, 37
    hidden = torch.randn(B, S, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    if ignore:
        labels[0, 3:6] = -100
    logits = hidden @ weight.T
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
    (gref,) = torch.autograd.grad(ref * 3.0, hidden)
    # 3 rows per chunk: several chunks and a short last one
    loss = next_token_loss(hidden, weight, labels, chunk_bytes=3 * 4 * V)
    (got,) = torch.autograd.grad(loss * 3.0, hidden)
    _close(loss, ref)
    _close(got, gref)


def test_next_token_loss_takes_hidden_states_in_another_dtype():
    """fp32 hidden states against a bf16 output embedding without autocast (a bf16 model whose last norm returns
    fp32): the product runs in the embedding's dtype, as the lm_head would, and the gradient keeps the hidden
    states' dtype."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 7, 16, generator=g, requires_grad=True)
    weight = torch.randn(29, 16, generator=g).bfloat16()
    labels = torch.randint(0, 29, (2, 7), generator=g)
    ref = F.cross_entropy((hidden.bfloat16() @ weight.T)[:, :-1].reshape(-1, 29).float(), labels[:, 1:].reshape(-1))
    loss = next_token_loss(hidden, weight, labels)
    (got,) = torch.autograd.grad(loss, hidden)
    _close(loss, ref, 1e-4)
    assert got.dtype == torch.float32 and torch.isfinite(got).all() and got.abs().sum() > 0


def test_next_token_loss_refuses_a_trained_head():
    w = torch.randn(5, 4, requires_grad=True)
    with pytest.raises(ValueError, match="output embedding"):
        next_token_loss(torch.randn(1, 3, 4), w, torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("padded", [False, True])
def test_transfer_mse_matches_the_plain_formula(padded):
    g = torch.Generator().manual_seed(1)
    o = torch.randn(2, 7, 3, 4, generator=g, requires_grad=True)
    t = torch.randn(2, 7, 3, 4, generator=g)
    padding = None
    diff = (o - t) ** 2
    if padded:
        padding = torch.ones(2, 9, dtype=torch.bool)
        padding[1, :5] = False
        w = padding[:, -7:].float()[:, :, None, None]
        ref = (diff * w).sum() / (w.sum() * 3 * 4).clamp_min(1)
    else:
        ref = diff.mean()
    (gref,) = torch.autograd.grad(ref, o)
    loss = transfer_mse(o, t, padding)
    (got,) = torch.autograd.grad(loss, o)
    _close(loss, ref)
    _close(got, gref)


def _patched_tiny(seed=0):
    from conftest import tiny_model

    import longctx_patch as lp

    model = tiny_model("llama", vocab_size=64, num_hidden_layers=2)
    lp.patch(model, "lolcats", window=4, chunk=4, checkpoint="none", init_window_factor=0.0)
    model.train()
    return model


def _grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("how", ["attention", "whole layers"])
def test_recomputed_attention_gives_the_same_gradients(how, padded):
    """The patched attentions recomputed in the backward (`attention_checkpointing`), or whole decoder layers
    (transformers' gradient checkpointing, which replays a layer with the keyword arguments of its call: the call's
    padding, patch_state.CallState, among them), give the gradients of the plain backward, padded rows included."""
    from longctx_patch.patcher import patch_context
    from longctx_patch.train.params import method_parameters
    from longctx_patch.train.stage_loop import activation_checkpointing

    model = _patched_tiny()
    for p in model.parameters():
        p.requires_grad_(False)
    for _, p in method_parameters(model):
        p.requires_grad_(True)
    model.model.embed_tokens.weight.requires_grad_(True)  # gradients also cross the layers
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    kw = dict(input_ids=ids, labels=ids, use_cache=False)
    if padded:  # a left-padded row: its real tokens would see the padding's keys were the mask lost
        am = torch.ones_like(ids)
        am[1, :5] = 0
        kw.update(attention_mask=am, labels=ids.masked_fill(am == 0, -100))
    ctx = patch_context(model)
    plain = model(**kw).loss
    g_plain = _grads(model, plain)
    if how == "attention":
        ctx.recompute = True
    else:
        activation_checkpointing(model, True)
    try:
        again = model(**kw).loss
        g_again = _grads(model, again)
    finally:
        ctx.recompute = False
        if how != "attention":
            activation_checkpointing(model, False)
    _close(again, plain)
    assert len(g_plain) > 3
    for a, b in zip(g_again, g_plain):
        _close(a, b)


def test_bypassed_head_and_fused_loss_match_the_model_loss():
    model = _patched_tiny()
    for p in model.parameters():
        p.requires_grad_(False)
    lora_like = [model.model.layers[0].self_attn.q_proj.weight, model.model.layers[1].mlp.up_proj.weight]
    for p in lora_like:
        p.requires_grad_(True)
    assert fusable_head(model)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    ref = model(input_ids=ids, labels=ids, use_cache=False).loss
    g_ref = torch.autograd.grad(ref, lora_like)
    with lm_head_bypassed(model) as weight:
        hidden = model(input_ids=ids, use_cache=False).logits
    assert hidden.shape[-1] == model.config.hidden_size
    loss = next_token_loss(hidden, weight, ids, chunk_bytes=5 * 4 * 64)
    g = torch.autograd.grad(loss, lora_like)
    _close(loss, ref)
    for a, b in zip(g, g_ref):
        _close(a, b)
    # the head is itself again afterwards
    assert model(input_ids=ids, use_cache=False).logits.shape[-1] == 64
    model.lm_head.weight.requires_grad_(True)
    assert not fusable_head(model)
