"""Loading what a fine-tune run saved under `OUTPUT/trainable/` onto a freshly loaded base model."""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

from torch import nn

from ..checkpoint import ADAPTER_DIR, PATCH_JSON, TRAINABLE_DIR, read_adapter_weights
from ..errors import CheckpointError


@contextlib.contextmanager
def peft_wrapping():
    """Around peft's wrapping of a model (get_peft_model, PeftModel.from_pretrained): peft reads the model's
    `is_gradient_checkpointing`, which transformers (5.x) deprecates for `is_activation_checkpointing` with a
    FutureWarning at every read. The call is peft's, not ours, and the value read is the same: that warning alone
    is not shown (any other warning is)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def apply_trained(model: nn.Module, directory: str | os.PathLike, merge: bool = True) -> nn.Module:
    """Re-applies the patches and method weights of a run's `trainable/` folder (or the run's output folder)
    to `model` (the unpatched base model the run started from), then adds its LoRA adapter, merged into the
    projections when `merge` (the default; otherwise the peft wrapper is returned). Returns the model. A damaged
    file, or an adapter saved as a pickle (refused unread), is a CheckpointError naming it."""
    from ..patcher import apply_patch_record

    d = Path(directory)
    if (d / TRAINABLE_DIR).is_dir():
        d = d / TRAINABLE_DIR
    has_patch = (d / PATCH_JSON).exists()
    has_adapter = (d / ADAPTER_DIR / "adapter_config.json").exists()
    if not (has_patch or has_adapter):
        raise CheckpointError(
            f"{d} holds neither {PATCH_JSON} nor {ADAPTER_DIR}/: pass the output folder of `longctx finetune` "
            "or its trainable/ subfolder"
        )
    if has_patch:
        apply_patch_record(model, d)
    if has_adapter:
        from peft import PeftModel

        read_adapter_weights(d)  # a pickled, damaged or non-finite adapter is refused by name, before peft reads it

        with peft_wrapping():
            wrapped = PeftModel.from_pretrained(model, str(d / ADAPTER_DIR))
        model = wrapped.merge_and_unload() if merge else wrapped
    return model
