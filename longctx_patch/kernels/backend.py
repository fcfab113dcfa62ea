"""Where the Triton kernels can run, and the one backend choice every kernel family makes.

Triton is optional: without it (a CPU-only install of PyTorch brings none) every method runs its PyTorch
reference. Nothing here imports Triton at module level; the files that define kernels (`triton_*.py`, the
helpers of `triton_lib.py` among them) are imported only once `resolve_backend` chose "triton"
(tests/test_layering.py checks this).

`backend` (every method's option of that name):
- "auto": the Triton kernels on CUDA tensors when Triton is installed (and the caller's shape checks pass),
  the PyTorch reference otherwise;
- "triton": the kernels, or a `DeviceError` that names what is missing (Triton, or a CUDA device; on a CPU,
  TRITON_INTERPRET=1 runs them through Triton's interpreter, for tests);
- "torch": the reference.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

from ..errors import ConfigError, DeviceError

BACKENDS = ("auto", "triton", "torch")

# the Triton interpreter runs the kernels on the CPU (tests); read once, as Triton reads it
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    """Whether `import triton` works (without importing it: its import costs about a second)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken install
        return False


def triton_missing(*tensors: torch.Tensor | None) -> str | None:
    """None when the Triton kernels can run on `tensors`, else what is missing, in words."""
    if not triton_installed():
        return ("Triton is not installed (it comes with PyTorch's CUDA builds on Linux, or `pip install triton`) "
                "and the kernels need it")
    devices = {t.device.type for t in tensors if t is not None}
    if devices - {"cuda"} and not (INTERPRET and devices <= {"cpu", "cuda"}):
        where = ", ".join(sorted(devices))
        return (f"the tensors are on {where}, and the Triton kernels run on CUDA GPUs (on a CPU only under "
                "TRITON_INTERPRET=1, Triton's slow interpreter for tests)")
    return None


def attention_kernel_missing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """What the inference-only attention kernels (decode split-key, sliding window) have in common: None when Triton
    can run them on these tensors (fp16/bf16/fp32 alike, head_dim a power of two in 16..256, no gradient), else why
    not. Each kernel adds its own limits."""
    why = triton_missing(q, k, v)  # Triton installed, CUDA tensors (or the CPU under TRITON_INTERPRET=1)
    if why is not None:
        return why
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}: fp16, bf16 or fp32, all alike"
    D = q.shape[-1]
    if D < 16 or D > 256 or D & (D - 1):
        return f"head_dim {D}: a power of two in 16..256"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "no backward: these kernels serve inference"
    return None


def on_device(t: torch.Tensor):
    """A context that makes `t`'s CUDA device the current one for the calls inside it, when it is not already.
    Triton launches a kernel on the current device, not on its tensors' device: in a model split over GPUs
    (`device_map`) a layer on cuda:1 called while cuda:0 is current would run its kernels on the wrong GPU (an
    illegal address, or silently wrong values). A no-op for CPU tensors, the current device, and under torch.compile."""
    if not t.is_cuda or torch.compiler.is_compiling() or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will want a gradient through any of `tensors` (None entries ignored)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors if t is not None)


def check_backend(backend: str, what: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"{what}: backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    return backend


def require_triton(what: str, *tensors: torch.Tensor | None) -> None:
    """Raise DeviceError when backend='triton' cannot run on `tensors`."""
    why = triton_missing(*tensors)
    if why is not None:
        raise DeviceError(f"{what} backend='triton' cannot run here: {why}; use backend='auto' (the kernels where "
                          "they can run, the PyTorch reference elsewhere) or backend='torch'")


def resolve_backend(backend: str, *tensors: torch.Tensor | None, what: str) -> str:
    """'triton' or 'torch' for this call (see the module docstring); the caller adds its own shape checks."""
    check_backend(backend, what)
    if backend == "torch":
        return "torch"
    if backend == "triton":
        require_triton(what, *tensors)
        return "triton"
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    return "triton" if on_cuda and triton_installed() else "torch"


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (as triton.next_power_of_2, for host code that must not import Triton)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
