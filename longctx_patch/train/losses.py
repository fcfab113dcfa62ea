"""Fused losses of the fine-tune stages: neither keeps a large fp32 tensor for the backward.

`next_token_loss`: the next-token cross-entropy from the final hidden states and the output embedding, over row
chunks, never holding the `[B*S, vocab]` logits of the whole batch (in fp32 they are 6.4 GB for 8 x 4096 tokens of
a 49k vocabulary, plus their gradient). Each chunk's logits are made, reduced to the loss and turned into the
gradient of its hidden states at once; the backward only scales that gradient. Same value as transformers'
`ForCausalLMLoss` (logits upcast to fp32, mean over the labels that are not -100).

`transfer_mse`: the attention-transfer MSE of one layer, which keeps the student's and the teacher's outputs in their
own dtype for the backward instead of their fp32 difference.

`lm_head_bypassed(model)`: while active, the model's output embedding returns its input, so a forward returns the
final hidden states as `logits` (through the model's own `__call__`: DDP's hooks stay in place).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
CHUNK_BYTES = 1 << 30  # fp32 logits held at once by next_token_loss


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, rows):
        # h [N, hidden], weight [vocab, hidden], targets [N] (IGNORE_INDEX: not counted)
        valid = targets != IGNORE_INDEX
        count = valid.sum().clamp_min(1).float()
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h) if h.requires_grad else None
        for i in range(0, h.shape[0], rows):
            hc, t, ok = h[i : i + rows], targets[i : i + rows], valid[i : i + rows]
            if hc.dtype != weight.dtype and not torch.is_autocast_enabled(hc.device.type):
                hc = hc.to(weight.dtype)  # the lm_head's dtype (e.g. fp32 hidden states of a bf16 model's norm)
            logits = F.linear(hc, weight).float()  # in the autocast dtype when autocast is on, as the lm_head
            lse = torch.logsumexp(logits, -1)
            tc = t.clamp_min(0)
            picked = logits.gather(1, tc[:, None])[:, 0]
            total += ((lse - picked) * ok).sum()
            if grad is not None:
                p = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                p[torch.arange(p.shape[0], device=p.device), tc] -= 1.0
                p.mul_(ok[:, None])
                # under autocast the product runs in its dtype, as the lm_head's backward would
                grad[i : i + rows] = torch.mm(p.to(weight.dtype), weight)
        ctx.save_for_backward(grad, count)
        return total / count

    @staticmethod
    def backward(ctx, go):
        grad, count = ctx.saved_tensors
        if grad is None:
            return None, None, None, None
        return grad * (go / count).to(grad.dtype), None, None, None


def next_token_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Mean cross-entropy of predicting `labels[:, t + 1]` from `hidden[:, t]` through `weight` (the output
    embedding, `[vocab, hidden]`, frozen: no gradient reaches it). hidden `[B, S, hidden]`, labels `[B, S]`."""
    if weight.requires_grad:
        raise ValueError("next_token_loss gives no gradient to the output embedding; freeze it or use the model's loss")
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    return _ChunkedCrossEntropy.apply(h, weight, targets, rows)


class _TransferMSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, teacher, w):
        # o, teacher [B, S, H, D]; w [B, S, 1, 1] (weights of real query tokens) or None; fp32 sums
        diff = o.float() - teacher.float()
        if w is None:
            denom = torch.tensor(float(diff.numel()), device=o.device)
            loss = diff.square().sum() / denom
        else:
            denom = (w.sum() * diff.shape[2] * diff.shape[3]).clamp_min(1)
            loss = (diff.square() * w).sum() / denom
        ctx.save_for_backward(o, teacher, w, denom)
        return loss

    @staticmethod
    def backward(ctx, go):
        o, teacher, w, denom = ctx.saved_tensors
        g = (o.float() - teacher.float()).mul_(2.0 * go / denom)
        if w is not None:
            g.mul_(w)
        return g.to(o.dtype), None, None


def transfer_mse(o: torch.Tensor, teacher: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """Mean squared error of the student's output `o` against `teacher` (no gradient), `[B, S, H, D]`, over
    the real query tokens of `padding` (`[B, >= S]` bool, True = real; None: every token)."""
    w = None if padding is None else padding[:, -o.shape[1] :].float()[:, :, None, None]
    return _TransferMSE.apply(o, teacher.detach(), w)


def _head(model: nn.Module):
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def fusable_head(model: nn.Module) -> bool:
    """Whether `next_token_loss` can replace the model's loss: a bias-free, frozen nn.Linear output embedding."""
    head = _head(model)
    return isinstance(head, nn.Linear) and head.bias is None and not head.weight.requires_grad


@contextlib.contextmanager
def lm_head_bypassed(model: nn.Module):
    """The output embedding of `model` (a transformers causal LM) returns its input while active; yields its
    weight."""
    head = _head(model)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise TypeError(f"fused next-token loss needs a bias-free nn.Linear output embedding, found {type(head).__name__}")
    head.forward = _identity
    try:
        yield head.weight
    finally:
        del head.forward


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


__all__ = ["fusable_head", "lm_head_bypassed", "next_token_loss", "transfer_mse"]
