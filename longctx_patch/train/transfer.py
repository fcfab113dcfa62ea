"""Attention transfer, the `attention_transfer` objective of a fine-tune stage: each patched layer's output is
compared with exact softmax attention over the same q/k/v (the teacher).

A patched module calls the recorder its PatchContext holds (`ctx.recorder.record(module, q, k, v, padding, o)`, see
`PatchedAttention.forward`); `attention_transfer(model)` installs one for the duration of a `with` block.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..kernels.softmax import key_mask_for, softmax_attention
from ..methods.base import PatchedAttention
from ..patcher import patch_context
from .losses import transfer_mse


class AttentionTransfer:
    """Collects per-layer MSE between a patched module's output and exact softmax attention (the teacher).

    With `teacher_forcing`, each layer passes the teacher's output (not its own) on to the next layer, so
    every layer learns on the original model's hidden states and no gradient crosses layers (the LoLCATs
    attention-transfer procedure).
    """

    def __init__(self, teacher_forcing: bool = False) -> None:
        self.losses: list[torch.Tensor] = []
        self.teacher_forcing = teacher_forcing

    def record(self, module: PatchedAttention, q, k, v, padding, o) -> torch.Tensor:
        """Append this layer's loss; return the output the layer passes on."""
        with torch.no_grad():  # SDPA (flash on CUDA under bf16): no S x S matrix
            teacher = softmax_attention(q, k, v, scale=module.scaling, key_mask=key_mask_for(padding, k.shape[2]),
                                        window=module.spec.sliding_window)  # the original layer's window
        # only real query tokens count; the backward keeps o and the teacher, not their fp32 difference
        self.losses.append(transfer_mse(o, teacher, padding))
        return teacher.to(o.dtype) if self.teacher_forcing else o

    def loss(self) -> torch.Tensor:
        return torch.stack(self.losses).mean()

    def clear(self) -> None:
        self.losses.clear()


@contextlib.contextmanager
def attention_transfer(model: nn.Module, teacher_forcing: bool = False):
    """Under this context each patched module also records its MSE against exact attention.

    Yields an `AttentionTransfer`; call `.loss()` after a forward and `.clear()` before the next. Use without
    a cache (`use_cache=False`): the teacher attends over the tokens of the current call only.
    """
    ctx = patch_context(model)
    tr = AttentionTransfer(teacher_forcing)
    ctx.recorder = tr
    try:
        yield tr
    finally:
        ctx.recorder = None


__all__ = ["AttentionTransfer", "attention_transfer"]
