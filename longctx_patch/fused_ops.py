"""Fused kernels for the model's own small ops at inference (`patch(..., fused_ops=...)`, `set_fused_ops`).

An eager decode step of a llama-style layer issues about seven PyTorch kernels per RMSNorm (two per layer), ten for
the rotary embedding of q and k, and two for SiLU(gate) * up; replayed from a CUDA graph (decode_graphs.py) a step is
then bound by the count of those tiny kernels, not by bytes. With fused ops on:

- the decoder's RMSNorms (`input_layernorm`, `post_attention_layernorm` of every layer, the final `norm`, and
  qwen3's `q_norm` / `k_norm`) run one Triton kernel each: their instance's `forward` is replaced by a
  `FusedForward` that takes the kernel or calls the class's own forward;
- the MLP's `act_fn(gate_proj(x)) * up_proj(x)` (SiLU) is one kernel after the two GEMMs, the same way;
- the rotary embedding of the patched layers' q and k is one kernel (`ArchAdapter.project`, reading the mode off
  the patch's `PatchContext.fused_ops`).

Only on modules of the standard classes of the family's transformers modeling module (LlamaRMSNorm, Qwen2RMSNorm,
MistralRMSNorm, Qwen3RMSNorm; LlamaMLP ... with a SiLU activation; the module's own `apply_rotary_pos_emb`), whose
forward nobody replaced. Each call takes the kernel only where `kernels/model_ops/` allows it (CUDA tensors, or CPU
tensors under TRITON_INTERPRET=1 in mode "triton"; no gradient needed; not under torch.compile; dtypes and shapes
the kernel takes), else the original ops. The kernels round as the original code does.

Default (`fused_ops=None`): on for a model on CUDA with Triton installed (on an H200 they cut a replayed
batch-16 decode step of a 1B-shaped llama from 716 kernels to 325 and from 3.01 to 2.05 ms; docs/PERFORMANCE.md,
"Fused model ops"), off elsewhere and on a tensor-parallel model; `LONGCTX_FUSED_OPS=0` at patch time makes the
default off. In fp32 a fused model's logits match the original ops' to ~4e-5; in bf16 a norm's sum can round one
ulp apart from PyTorch's reduction, as any kernel of another reduction order does. A runtime option: it is not
written to the patch record (save_patched); loading a patched model decides it again.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .architectures import ArchAdapter, base_model
from .errors import ConfigError
from .kernels.backend import on_device, require_triton, triton_installed
from .kernels.model_ops import rms_norm, rms_norm_missing, silu_mul, silu_mul_missing

ENV = "LONGCTX_FUSED_OPS"

# model_type -> the standard classes of its modeling module (Gemma-style `1 + weight` norms are not among them)
NORM_CLASSES = {"llama": "LlamaRMSNorm", "mistral": "MistralRMSNorm", "qwen2": "Qwen2RMSNorm",
                "qwen3": "Qwen3RMSNorm"}
MLP_CLASSES = {"llama": "LlamaMLP", "mistral": "MistralMLP", "qwen2": "Qwen2MLP", "qwen3": "Qwen3MLP"}


def env_enabled() -> bool:
    """False when the environment turns the default off (`LONGCTX_FUSED_OPS=0`)."""
    return os.environ.get(ENV, "1") != "0"


def parse_mode(fused_ops) -> str | None:
    """`fused_ops` as a mode: True / "auto" -> "auto" (kernels on CUDA tensors), "triton" (also on the CPU under
    TRITON_INTERPRET=1: tests), False -> None (off)."""
    if fused_ops is True or fused_ops == "auto":
        return "auto"
    if fused_ops is False:
        return None
    if fused_ops == "triton":
        return "triton"
    raise ConfigError(f"fused_ops must be True, False, 'auto' or 'triton', not {fused_ops!r}")


def default_mode(model: nn.Module) -> str | None:
    """The default of `fused_ops=None`: "auto" for a model on CUDA with Triton installed unless the environment
    turns it off (`LONGCTX_FUSED_OPS=0`); else None."""
    if not env_enabled() or not triton_installed():
        return None
    p = next(model.parameters(), None)
    return "auto" if p is not None and p.is_cuda else None


def _standard(mod: nn.Module | None, adapter: ArchAdapter, names: dict[str, str]) -> bool:
    """`mod` is exactly the family's class `names[model_type]` of its modeling module, with the class's own forward."""
    name = names.get(adapter.model_type)
    cls = type(mod)
    return (mod is not None and name is not None and cls.__module__ == adapter.modeling_module
            and cls.__name__ == name and getattr(cls.forward, "__qualname__", None) == f"{name}.forward"
            and "forward" not in mod.__dict__)


def _silu(act: nn.Module) -> bool:
    t = type(act)
    return t is nn.SiLU or (t.__name__ == "SiLUActivation" and t.__module__ == "transformers.activations")


class FusedForward:
    """The forward installed on one norm or MLP module: the fused kernel where it can run, else the class's own."""

    def __init__(self, module: nn.Module, kind: str, mode: str):
        self.module = module
        self.kind = kind  # "norm" or "mlp"
        self.mode = mode
        self.orig = type(module).forward

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        m = self.module
        if len(args) != 1 or kwargs:  # not the decoder's own call (one tensor, positional): the original
            return self.orig(m, *args, **kwargs)
        x = args[0]
        if self.kind == "norm":
            if rms_norm_missing(x, m.weight, self.mode) is None:
                with on_device(x):  # Triton launches on the current device: a model split over GPUs
                    return rms_norm(x, m.weight, m.variance_epsilon)
            return self.orig(m, x)
        if torch.compiler.is_compiling() or (self.mode == "auto" and not x.is_cuda):
            return self.orig(m, x)
        g, u = m.gate_proj(x), m.up_proj(x)
        if silu_mul_missing(g, u, self.mode) is not None:
            return m.down_proj(m.act_fn(g) * u)
        with on_device(g):
            h = silu_mul(g, u)
        return m.down_proj(h)


class FusedOps:
    """The fused forwards installed on one model (`install`), and their removal (`remove`)."""

    def __init__(self) -> None:
        self.installed: list[tuple[nn.Module, FusedForward]] = []

    def targets(self, model: nn.Module, adapter: ArchAdapter) -> list[tuple[nn.Module, str]]:
        """(module, kind) of every norm and MLP of `model` that takes a fused forward."""
        base = base_model(model)
        found: list[tuple[nn.Module, str]] = []
        for layer in adapter.decoder_layers(model):
            attn = getattr(layer, "self_attn", None)
            for mod in (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None),
                        getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
                if _standard(mod, adapter, NORM_CLASSES):
                    found.append((mod, "norm"))
            mlp = getattr(layer, "mlp", None)
            if _standard(mlp, adapter, MLP_CLASSES) and _silu(getattr(mlp, "act_fn", None)):
                found.append((mlp, "mlp"))
        norm = getattr(base, "norm", None)
        if _standard(norm, adapter, NORM_CLASSES):
            found.append((norm, "norm"))
        return found

    def install(self, model: nn.Module, adapter: ArchAdapter, mode: str | None) -> None:
        """Set the mode (None: off): removes the fused forwards, then installs them again for a mode."""
        if mode == "triton":
            require_triton("fused_ops", next(model.parameters(), None))
        self.remove()
        if mode is None:
            return
        for mod, kind in self.targets(model, adapter):
            fwd = FusedForward(mod, kind, mode)
            mod.forward = fwd
            self.installed.append((mod, fwd))

    def remove(self) -> None:
        """Every module's own forward back (only where the forward is still the one installed here)."""
        for mod, fwd in self.installed:
            if mod.__dict__.get("forward") is fwd:
                del mod.__dict__["forward"]
        self.installed = []
