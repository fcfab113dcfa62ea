"""longctx-patch: patch Hugging Face causal LMs in place for cheap long contexts.

    model, tok = longctx_patch.load_model("smollm2-135m")
    longctx_patch.patch(model, "sliding-window", window=256)
    print(longctx_patch.generate(model, tok, "Hello"))
    longctx_patch.unpatch(model)
"""

from ._version import __version__
from .errors import (
    AlreadyPatchedError,
    CheckpointError,
    ConfigError,
    DeviceError,
    LongctxError,
    LongctxWarning,
    MemoryBudgetError,
    MissingHookError,
    ModelLoadError,
    NotPatchedError,
    NumericalError,
    UnsupportedModelError,
)
from .generation import generate
from .models import load_model, load_patched
from .methods import get_method, list_methods
from .patcher import (is_patched, patch, patched_layers, save_patched, set_decode_graphs, set_fused_ops,
                      set_prefill_chunk, unpatch)
from .cache import LongctxCache
from .convert import convert_to_lola
from .calibration import calibrate

__all__ = [
    "__version__",
    "patch",
    "unpatch",
    "is_patched",
    "patched_layers",
    "set_decode_graphs",
    "set_fused_ops",
    "set_prefill_chunk",
    "load_model",
    "save_patched",
    "load_patched",
    "calibrate",
    "generate",
    "get_method",
    "list_methods",
    "LongctxCache",
    "convert_to_lola",
    "LongctxError",
    "ConfigError",
    "UnsupportedModelError",
    "AlreadyPatchedError",
    "NotPatchedError",
    "ModelLoadError",
    "CheckpointError",
    "DeviceError",
    "MemoryBudgetError",
    "MissingHookError",
    "NumericalError",
    "LongctxWarning",
]
