"""Named errors. Every failure a user can cause raises one of these, with a message that says what to do."""


class LongctxError(Exception):
    """Base class of every error raised on purpose by longctx-patch."""


class ConfigError(LongctxError, ValueError):
    """A method config key is unknown or has a bad value."""


class MissingHookError(ConfigError, NotImplementedError):
    """A method lacks a hook of `methods.base.Method` that the feature asked for needs (the fidelity check's
    `approximation_start`, the training plan's `attention_profile`, calibration's `calibration`): the message names
    the method, the hook and what a method implements there, instead of a guess."""


class UnsupportedModelError(LongctxError):
    """The model's architecture has no adapter."""


class AlreadyPatchedError(LongctxError):
    """patch() was called on layers that are already patched."""


class NotPatchedError(LongctxError):
    """unpatch()/save_patched() was called on a model that is not patched."""


class ModelLoadError(LongctxError):
    """A model, GGUF file or embedded model could not be found or loaded."""


class CheckpointError(LongctxError):
    """A checkpoint has missing, unexpected or mis-shaped keys, does not match its record, or cannot be read or
    written; the message names the file (or the folder being written)."""


class DeviceError(LongctxError):
    """The requested work needs a device (e.g. CUDA) that is not available, or weights that are not materialised
    (a model on the `meta` device)."""


class MemoryBudgetError(LongctxError, MemoryError):
    """What was asked cannot fit the memory available on its device, found before anything allocates it: a
    fine-tune's estimated peak (raised before the model loads where its config can be read without it), or the decode
    state a patch's options make one sequence allocate from its first token (raised by patch()); the message names
    the settings that shrink it."""


class NumericalError(LongctxError, FloatingPointError):
    """A patched model computed NaN or inf where the answer needs numbers (the logits after generate()'s prefill):
    the message names the methods and what to check, instead of an empty or garbled answer."""


class LongctxWarning(UserWarning):
    """Warnings of longctx-patch (e.g. a sequence longer than the model's trained context)."""


__all__ = [
    "LongctxError",
    "ConfigError",
    "MissingHookError",
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
