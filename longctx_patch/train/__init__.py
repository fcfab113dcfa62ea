"""Fine-tune runner used by `longctx finetune`: recipes, text data, the accelerate training loop.

    from longctx_patch.train import load_recipe, run_finetune
    recipe = load_recipe("recipes/linearize.yaml", ["model=smollm2-135m", "data.text=essays/"])
    log = run_finetune(recipe, "runs/linearize")
"""

from .data import BatchOrder, PackedData, load_documents, make_packed, pack, tokenize_documents
from .recipe import DataSpec, LoraSpec, OutputSpec, Recipe, Stage, apply_overrides, load_recipe, recipe_from_dict
from .runner import Finetuner, run_finetune, write_results
from .trained import apply_trained
from .transfer import AttentionTransfer, attention_transfer

__all__ = [
    "AttentionTransfer",
    "BatchOrder",
    "DataSpec",
    "Finetuner",
    "LoraSpec",
    "OutputSpec",
    "PackedData",
    "Recipe",
    "Stage",
    "apply_overrides",
    "apply_trained",
    "attention_transfer",
    "load_documents",
    "load_recipe",
    "make_packed",
    "pack",
    "recipe_from_dict",
    "run_finetune",
    "tokenize_documents",
    "write_results",
]
