"""Helpers used by several scripts of benchmarks/.

Where results go: `results_dir(task, out)` and `result_file(task, name, out)` (`write_bench_result` writes one) (the task's folder of the default
results folder unless --out or $OUT says otherwise; benchmarks/README.md, Results), with the file names' device and
model parts from `device_token` and `model_token`.

The studies that rebuild MuSe's cells selection use the package's own `kernels.muse.reference_cells.take_top` and
`kernels.muse.plan.block_view`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import torch

from longctx_patch.errors import LongctxError
from longctx_patch.evals import common
from longctx_patch.evals.common import slug

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"  # the results committed with the checkout (results/INDEX.md)
# the method labels of a RULER comparison that keep the whole K/V cache (plot_peers' full-cache line, the index's headline)
FULL_CACHE_METHODS = ("none", "exact", "kvpress-none")
DATA_ENV = "LONGCTX_DATA"  # the folder of texts a benchmark reads (pg_essays/ ...), when no --data is given


class DataFolderError(LongctxError, FileNotFoundError):
    """A benchmark's text folder was not given, or is not a folder: pass --data or set $LONGCTX_DATA."""


def data_dir(arg: str | os.PathLike | None = None, need: str | None = None) -> Path:
    """The folder of texts a benchmark reads: `arg` (its --data) when given, else $LONGCTX_DATA. `need`: a subfolder
    it must hold (e.g. 'pg_essays'). Raises DataFolderError, naming what to pass or set, when there is none."""
    given = arg or os.environ.get(DATA_ENV)
    if not given:
        raise DataFolderError(f"no text folder: pass --data DIR or set ${DATA_ENV} to a folder"
                              + (f" that holds {need}/" if need else ""))
    d = Path(given).expanduser()
    where = "--data" if arg else f"${DATA_ENV}"
    if not d.is_dir():
        raise DataFolderError(f"{where} is {d}, which is not a folder: pass --data DIR or set ${DATA_ENV}")
    if need and not (d / need).is_dir():
        raise DataFolderError(f"{where} is {d}, which has no {need}/ folder: point it at the folder that holds {need}/")
    return d


def device_token(name: str | None = None) -> str:
    """The device part of a result file's name: 'cpu', or the GPU's name without its vendor, lower case
    ('NVIDIA H200' -> 'h200'). `name` is a device's name or a torch device ('cpu', 'cuda', 'cuda:1'); it defaults
    to this machine's first CUDA device ('cpu' without one)."""
    if name is None or re.fullmatch(r"cuda(:\d+)?", name.strip()):
        index = int(name.split(":")[1]) if name and ":" in name else 0
        name = torch.cuda.get_device_name(index) if torch.cuda.is_available() else "cpu"
    name = name.strip()
    if name.lower().startswith("cpu"):
        return "cpu"
    return slug(re.sub(r"^(cuda:\s*)?(nvidia|amd)\s+", "", name, flags=re.IGNORECASE)).lower()


def results_dir(task: str, out: str | os.PathLike | None = None) -> Path:
    """The folder a script writes its result files to, made if missing: `out` when given (its --out, or $OUT on
    the device machine, whose files come back from there), else the task's folder of the default results folder:
    $LONGCTX_RESULTS/<task> when set, else this checkout's benchmarks/results/<task> (the benchmarks' results are
    the project's record; `longctx eval` writes elsewhere by default, `common.default_results_dir`)."""
    env = os.environ.get(common.RESULTS_ENV)
    d = Path(out) if out else (Path(env).expanduser() if env else RESULTS) / task
    d.mkdir(parents=True, exist_ok=True)
    return d


def result_file(task: str, name: str, out: str | os.PathLike | None = None) -> Path:
    """The file a script writes one result to: `out` when given (its --out FILE; the folder is made), else
    `name` in the task's folder of the default results folder (`results_dir(task)`)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        return Path(out)
    return results_dir(task) / name


def timed_ms(fn, device: torch.device, *, warmup: int = 5, rep: int = 50) -> float:
    """Milliseconds of fn: `triton.testing.do_bench`'s median on CUDA (warmup / rep in its milliseconds), the best
    of 3 wall times elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def qwen_layer_arguments(p, lengths: str) -> None:
    """The options of a one-layer benchmark at Qwen2.5-Coder-0.5B's attention shapes (14 query / 2 kv heads, D 64,
    bf16, CUDA): --lengths (default `lengths`), --heads, --kv-heads, --head-dim, --dtype, --device, --out."""
    p.add_argument("--lengths", default=lengths)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)


def bench_command(module: str, argv) -> str:
    """A benchmark's command line as its result records it: `python -m MODULE` and its arguments (`argv`, default
    this process's)."""
    return shlex.join([sys.executable, "-m", module, *(argv if argv is not None else sys.argv[1:])])


def write_bench_result(folder: str, name: str, out, *, task: str, module: str, argv, device, **fields) -> Path:
    """One benchmark's result JSON: `task`, `provenance.result_header` (its device, date, commit and command: `python
    -m MODULE` with `argv`), then `fields`; written to `result_file(folder, name, out)`, which it prints and returns."""
    from longctx_patch.provenance import result_header

    res = {"task": task, **result_header(device=device, command=bench_command(module, argv)), **fields}
    path = result_file(folder, name, out)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def model_token(model: str) -> str:
    """The model part of a result file's name: an alias as is ('smollm2-135m'), a path by its last part without
    the extension ('/tmp/smollm2.gguf' -> 'smollm2')."""
    return slug(Path(model).stem if ("/" in model or os.sep in model) else model).lower()


def llama_1b_shaped(device: str, dtype: torch.dtype):
    """A Llama-3.2-1B-shaped model with random weights (16 layers, hidden 2048, 32 q / 8 kv heads, head_dim 64,
    MLP 8192, vocabulary 128256, tied embeddings): timings at scale need no checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                      rope_theta=500000.0, tie_word_embeddings=True, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


# kinds of profiled kernels and ops, by name (kernel_kind)
_GEMM = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::bmm", "aten::addmm", "aten::linear")
_ATTENTION = ("flash", "fmha", "cudnn", "scaled_dot_product", "_attn")
_COPY = ("copy", "_to_copy", "cast", "fill")
_REDUCTION = ("reduce", "sum", "mean", "norm", "softmax", "cross_entropy", "nll", "scan")


def kernel_kind(name: str) -> str:
    """The kind of a profiled kernel or op, by its name: gemm, attention, then PyTorch's own kernels and ops
    (copy / cast, reduction, elementwise), other C++ kernels, and "triton" for a kernel named as a Python function
    (the package's or Inductor's)."""
    low = name.lower()
    if any(x in low for x in _GEMM):
        return "gemm"
    if any(x in low for x in _ATTENTION):
        return "attention"
    if "at::native" in low or low.startswith("aten::"):
        if any(x in low for x in _COPY):
            return "copy / cast"
        return "reduction" if any(x in low for x in _REDUCTION) else "elementwise"
    if low.startswith("memcpy") or low.startswith("memset"):
        return "copy / cast"
    if low.startswith("void ") or "::" in low or low.startswith("cuda") or " " in low or "backward" in low:
        return "other"  # other C++ kernels, runtime calls, autograd nodes (a CPU profile)
    return "triton"


def lora_stage_only(recipe_path: str | os.PathLike, stage: str = "finetune") -> str:
    """The recipe override (`stages=[...]`) that keeps only `stage` of the recipe, training only its LoRA: the
    unpatched model's reference for a method's fine-tune (no method parameters, no attention to transfer)."""
    import json

    import yaml

    found = next(s for s in yaml.safe_load(Path(recipe_path).read_text())["stages"] if s["name"] == stage)
    found["trainable"] = ["lora"]
    return "stages=" + json.dumps([found])
