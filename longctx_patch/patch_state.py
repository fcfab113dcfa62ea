"""The patch of a model, kept on the model itself: what the patcher, the methods and the cache read of it.

`patch()` (patcher.py) puts one `PatchState` on the model's decoder stack (`architectures.base_model(model)`, the
attribute `STATE_ATTR`): the patched modules by layer, the originals they replaced, the patches applied (`groups`),
the `PatchContext` the modules share, the entry points installed on the model. Being an attribute of the model, it
travels with it: `copy.deepcopy(model)` and pickling carry a state of the copy's own, whose modules and context are
the copy's, and the forward pre-hook of patcher.py finds it from the module it is called on, never from a closure.

This module only reads the state and keeps original weights; the patcher creates, changes and removes it. Methods
and the cache import it plainly (it sits below them: it imports nothing of methods/ or the API).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .architectures import base_model, shared_weight
from .errors import NotPatchedError

STATE_ATTR = "_longctx_patch_state"  # the attribute of the decoder stack that holds its PatchState


CALL_ARG = "longctx_call"  # the keyword argument of the decoder layers that carries a forward's CallState


class CallState:
    """What one forward call of a patched model tells its patched layers: its batch's padding, and what a method
    computes once per call for all its layers. The decoder stack's forward pre-hook (patcher.py) makes one per call
    and hands it to the decoder layers as the keyword argument CALL_ARG, which they pass on to their attention
    module (and keep for a recomputation under gradient checkpointing). Nothing of it is kept on the model, so
    calls running at once on one model (a server's request threads) are as independent as on an unpatched one."""

    __slots__ = ("key_mask", "memo")

    def __init__(self, key_mask: torch.Tensor | None = None) -> None:
        self.key_mask = key_mask  # [B, L_past + S] bool, True = real token; None = no padding
        self.memo: dict[str, Any] = {}  # per-call results a method shares between its layers (muse's row groups)


class PatchContext:
    """Per-model settings its patched modules share (`PatchedAttention._ctx`): the same for every call. What differs
    from one call to the next is the call's own (CallState)."""

    def __init__(self) -> None:
        # what each patched module hands its attention's q, k, v (post-rotary), padding and output to: an object whose
        # .record(module, q, k, v, padding, o) returns the output the layer passes on (train/transfer.py's
        # objective, calibration.py's measurements); None: nothing records
        self.recorder = None
        # recompute each patched attention in the backward instead of keeping its intermediates (forwards with
        # gradients and no cache; set by the fine-tune runner, `attention_checkpointing`)
        self.recompute = False
        # the patch's fused-ops mode (longctx_patch/fused_ops.py): None = off, "auto" / "triton" = the fused rotary
        # kernel of `ArchAdapter.project` where it can run
        self.fused_ops: str | None = None


@dataclass
class PatchGroup:
    """One patch() call: the method, its validated config (a methods.base.MethodConfig) and its layers."""

    method: str
    config: Any
    layers: list[int]

    def to_record(self) -> dict[str, Any]:
        """{method, config, layers}: this group as the patch record (checkpoint.patch_record) writes it."""
        return {"method": self.method, "config": self.config.to_dict(), "layers": self.layers}


@dataclass
class PatchState:
    ctx: PatchContext = field(default_factory=PatchContext)
    groups: list[PatchGroup] = field(default_factory=list)
    modules: dict[int, nn.Module] = field(default_factory=dict)  # layer -> its PatchedAttention
    originals: dict[int, nn.Module] = field(default_factory=dict)  # layer -> the attention module it replaced
    hooks: list[Any] = field(default_factory=list)  # torch hook handles
    generate_owner: nn.Module | None = None  # the model whose _prepare_cache_for_generation we overrode
    cache_arg: str = "cache"
    # {(layer, submodule name): original weight on the CPU}, kept when a checkpoint merges a delta (e.g. LoRA)
    # into a projection shared with the original module, so that unpatch() puts the weight back
    saved_weights: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    context_warned: bool = False  # a sequence past max_position_embeddings was warned about (once per patch)
    decode_graphs: Any = None  # the DecodeGraphs forward installed on generate_owner
    fused: Any = None  # fused_ops.FusedOps: the fused norm / MLP forwards installed on the model (set_fused_ops)
    fused_decided: bool = False  # fused ops were set (by default or explicitly) since the first patch
    prefill_chunk: int | str | None = "auto"  # generate()'s default prefill_chunk_size (patcher.set_prefill_chunk)
    # the calibration that chose the groups' settings (longctx_patch.calibration: Calibration.to_record()), saved
    # with the patch record; None: not calibrated
    calibration: dict[str, Any] | None = None


def find_state(model: nn.Module) -> PatchState | None:
    """The PatchState of `model` (a *ForCausalLM, a PEFT wrapper or the decoder stack), or None when unpatched."""
    return getattr(base_model(model), STATE_ATTR, None)


def state_of(model: nn.Module) -> PatchState:
    """The PatchState of `model`; NotPatchedError when it is not patched."""
    st = find_state(model)
    if st is None:
        raise NotPatchedError("this model is not patched by longctx-patch; call longctx_patch.patch(model, method) first")
    return st


def is_patched(model: nn.Module) -> bool:
    return find_state(model) is not None


def patched_layers(model: nn.Module) -> dict[int, str]:
    """{layer index: method name} of the patched layers ({} when unpatched)."""
    st = find_state(model)
    if st is None:
        return {}
    return {i: m.method_name for i, m in sorted(st.modules.items())}


def patched_modules(model: nn.Module) -> dict[int, nn.Module]:
    """{layer index: patched module (a PatchedAttention)} of `model`, by layer; NotPatchedError when unpatched."""
    return dict(sorted(state_of(model).modules.items()))


def patch_context(model: nn.Module) -> PatchContext:
    """The PatchContext the patched modules of `model` share (the recorder of train/transfer.py and calibration.py,
    the recomputation, the fused-ops mode); NotPatchedError when unpatched."""
    return state_of(model).ctx


def patch_groups(model: nn.Module) -> list[PatchGroup]:
    """The patches of `model` in the order patch() applied them (a hybrid has several); NotPatchedError when
    unpatched."""
    return list(state_of(model).groups)


def keep_original_weight(model: nn.Module, layer: int, name: str) -> torch.Tensor:
    """Call before changing the weight of the shared projection `name` (q_proj ...) of patched layer `layer`
    in place (e.g. merging a LoRA delta): keeps a CPU copy (once) that unpatch() restores. Returns the weight."""
    st = state_of(model)
    w = shared_weight(getattr(st.modules[layer], name))
    if (layer, name) not in st.saved_weights:
        st.saved_weights[(layer, name)] = w.detach().to("cpu", copy=True)
    return w


def restore_original_weight(model: nn.Module, layer: int, name: str) -> bool:
    """Puts back the weight of projection `name` of patched layer `layer` that keep_original_weight kept (undoing the
    delta merged since, e.g. a checkpoint's LoRA that is to train as an adapter instead) and forgets it; False when
    none was kept."""
    st = state_of(model)
    saved = st.saved_weights.pop((layer, name), None)
    if saved is None:
        return False
    w = shared_weight(getattr(st.modules[layer], name))
    with torch.no_grad():
        w.copy_(saved.to(device=w.device, dtype=w.dtype))
    return True


def take_original_weights(model: nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    """Removes and returns the original weights kept by keep_original_weight ({(layer, projection name): CPU copy}):
    unpatch() then leaves those projections as they are now (e.g. with a LoRA delta merged). For patching the same
    layers again with another method (convert_to_lola), which hands them back with keep_original_weights."""
    st = state_of(model)
    saved = dict(st.saved_weights)
    st.saved_weights.clear()
    return saved


def keep_original_weights(model: nn.Module, saved: dict[tuple[int, str], torch.Tensor]) -> None:
    """Has unpatch() put back `saved` ({(layer, projection name): original weight}, from take_original_weights) as
    if keep_original_weight had kept them."""
    state_of(model).saved_weights.update(saved)


__all__ = ["CALL_ARG", "CallState", "PatchContext", "PatchGroup", "PatchState", "STATE_ATTR", "find_state", "is_patched",
           "keep_original_weight", "keep_original_weights", "patch_context", "patch_groups", "patched_layers", "patched_modules",
           "restore_original_weight", "state_of", "take_original_weights"]
