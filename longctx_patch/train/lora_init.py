"""`lora.init: checkpoint`: a LoRA stage that continues the adapter of the method's checkpoint (a packaged asset's, a
run's trainable/) instead of a fresh one: the stage's LoRA block must describe that adapter, and the adapter the stage
adds takes its values. The runner (`Finetuner._take_checkpoint_lora`, `_add_lora`) calls these."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError, ConfigError
from .recipe import LoraSpec

PEFT_NO_BIAS = "none"  # PEFT's LoraConfig.bias value for no bias (an option's value, not a method's name)


def check_same_adapter(spec: LoraSpec, cfg: dict[str, Any], folder: str) -> None:
    """`lora.init: checkpoint`: the stage's LoRA block must describe the checkpoint's adapter (its
    adapter_config.json), which it continues: the same rank, alpha, target modules and layers, no bias."""
    targets = cfg.get("target_modules")
    have = {"r": cfg.get("r"), "alpha": cfg.get("lora_alpha"),
            "targets": sorted(targets) if isinstance(targets, (list, tuple, set)) else targets,
            "layers": cfg.get("layers_to_transform")}
    want = {"r": spec.r, "alpha": spec.alpha, "targets": sorted(spec.targets), "layers": spec.layers}
    if isinstance(have["layers"], int):
        have["layers"] = [have["layers"]]
    differ = [k for k in want if (float(want[k]) != float(have[k] or 0) if k == "alpha" else want[k] != have[k])]
    if cfg.get("bias", PEFT_NO_BIAS) != PEFT_NO_BIAS or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        differ.append("bias/rank_pattern/alpha_pattern")
    if differ:
        raise ConfigError(
            f"lora.init: checkpoint continues the adapter of {folder} ({', '.join(f'{k} {have.get(k)!r}' for k in have)}"
            f"), but the stage's lora block says {', '.join(f'{k} {want[k]!r}' for k in want)} ({', '.join(differ)} "
            "differ): give the stage's lora block the adapter's values")




def set_adapter(root, sd: dict[str, torch.Tensor], folder: str) -> None:
    """The PEFT model `root`'s new adapter set to the checkpoint's weights `sd`; every LoRA weight of the adapter must
    be among them and every one of them used (else a CheckpointError naming the keys)."""
    from peft import set_peft_model_state_dict

    res = set_peft_model_state_dict(root, sd)
    missing = [k for k in res.missing_keys if "lora_" in k]
    unused = list(res.unexpected_keys)
    if missing or unused:
        parts = [f"{what} {keys[:4]}{' ...' if len(keys) > 4 else ''}"
                 for what, keys in (("no value for", missing), ("no place for", unused)) if keys]
        raise CheckpointError(f"the LoRA adapter of {folder} does not fit the adapter the stage adds: " + "; ".join(parts))


__all__ = ["check_same_adapter", "set_adapter"]
