"""longctx-patch: patch Hugging Face causal LMs in place for cheap long contexts.

    model, tok = longctx_patch.load_model("smollm2-135m")
    longctx_patch.patch(model, "sliding-window", window=256)
    print(longctx_patch.generate(model, tok, "Hello"))
    longctx_patch.unpatch(model)
"""

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    AlreadyPatchedError,
    CheckpointError,
    ConfigError,
    DeviceError,
    LongctxError,
    LongctxWarning,
    MemoryBudgetError,
    ModelLoadError,
    NotPatchedError,
    NumericalError,
    UnsupportedModelError,
)
from .generation import generate  # noqa: E402
from .models import load_model, load_patched  # noqa: E402
from .methods import get_method, list_methods  # noqa: E402
from .patcher import (is_patched, patch, patched_layers, save_patched, set_decode_graphs, set_fused_ops,  # noqa: E402
                      set_prefill_chunk, unpatch)
from .cache import LongctxCache  # noqa: E402
from .convert import convert_to_lola  # noqa: E402
from .calibration import calibrate  # noqa: E402

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
    "NumericalError",
    "LongctxWarning",
]
