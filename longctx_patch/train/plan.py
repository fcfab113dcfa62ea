"""Before a fine-tune starts: what it will cost. `plan_run` estimates each stage's tokens, steps, peak memory and
time on this device from the model's config (read without loading the weights where it can be: `peek_config`), and
`check_memory` refuses a run whose estimated peak exceeds the memory available here (`MemoryBudgetError`, naming
the settings that shrink it). `quick_overrides` turns a recipe into a short run that finishes on a laptop-class CPU.

The memory model counts, per stage and process: the weights; the trained parameters' gradients and AdamW state; the
activations autograd keeps for the backward (per token and decoder layer, from the model's widths, by what the
stage trains: attention transfer keeps only each patched attention's inputs and outputs, next-token training every
layer's, gradient checkpointing only each layer's input); the largest transient (one layer's attention working set,
the loss's logits chunk); and, on a CPU, the process itself. The attention's working set depends on the method and
on whether its Triton kernels or its PyTorch reference run (`attention_profile`: each method's own hook, from the
method's own config). It was checked against measured peaks on the CPU (tests/test_train_plan.py: within a factor of 2 on a tiny model; SmolLM2's linearization stages
within 25% on a CPU, and against the H200 figures of docs/PERFORMANCE.md within 20%: recipes/README.md).
The time is rougher: floating-point operations of the matrix products and the attention, at a rate measured here
with a short matrix product and a fixed efficiency; the run's own ETA replaces it once steps have been timed.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import MemoryBudgetError
from ..memory import available_memory
from .recipe import Recipe, Stage

GIB = 2**30
CPU_EFFICIENCY = 0.25  # share of the measured matrix-product rate a training step reaches on a CPU (small products,
GPU_EFFICIENCY = 0.2  # element-wise work, Python) / on a GPU (launch-bound at small batches): calibration, rough
# resident memory per byte of the layers' live activations on a CPU: a layer's freed temporaries stay in the
# allocator's free lists between the tensors kept for the backward (measured 1.9x for SmolLM2-shaped layers with
# exact attention, 2.4x with lolcats'; the attention's large working set is not fragmented); a CUDA allocator's
# caching: 1.1x
CPU_ALLOCATOR = 2.0
CUDA_ALLOCATOR = 1.1
QUICK_STEPS = 5
QUICK_SEQ_LEN = 256
QUICK_BATCH = 2


# ----------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelShape:
    """The widths of a decoder-only transformer that the estimate needs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        cfg = getattr(cfg, "text_config", None) or cfg
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        return cls(layers=int(cfg.num_hidden_layers), hidden=hidden, heads=heads,
                   kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
                   intermediate=int(getattr(cfg, "intermediate_size", None) or 4 * hidden),
                   vocab=int(cfg.vocab_size), tied=bool(getattr(cfg, "tie_word_embeddings", False)))

    @property
    def layer_matmul_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return emb + self.layers * (self.layer_matmul_params + 2 * self.hidden) + self.hidden


def peek_config(model: str | None):
    """The transformers config of `model` (an embedded alias, a local directory, a .gguf file or a hub id in the
    local cache) read without loading its weights; None when that is not possible (the estimate then waits for the
    load)."""
    if not model:
        return None
    try:
        from transformers import AutoConfig

        from .. import models

        name = str(model)
        if name in models.ALIASES:
            entry = models.ALIASES[name]
            done = models.cache_dir() / entry.cache_name
            if (done / "config.json").is_file():
                return AutoConfig.from_pretrained(done)
            parts = models.embedded_parts(name)
            if len(parts) == 1:  # the GGUF itself: its header holds the config
                return AutoConfig.from_pretrained(str(Path(parts[0]).parent), gguf_file=Path(parts[0]).name)
            return None
        if name.endswith(".gguf") and os.path.isfile(name):
            p = Path(name).resolve()
            return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        if os.path.isdir(name):
            return AutoConfig.from_pretrained(name) if os.path.isfile(os.path.join(name, "config.json")) else None
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
        return AutoConfig.from_pretrained(os.path.dirname(cached)) if isinstance(cached, str) else None
    except Exception:  # noqa: BLE001 - no estimate before the load; the load reports its own errors
        return None


# ----------------------------------------------------------------------------------------------- attention
def attention_profile(method: str | None, config: dict[str, Any], shape: ModelShape, S: int, kernels: bool
                      ) -> tuple[float, float]:
    """(keys each query attends, for the FLOPs; elements one query token holds per head while the attention runs,
    kept for the backward unless the attention is recomputed: float32 in the PyTorch references, the compute dtype in
    the kernels) of the recipe's `method` with its `config` (the recipe's method_config, read as the method reads it:
    its defaults where the recipe gives none) over sequences of `S` tokens; `kernels`: the method's Triton kernels run
    (CUDA), else its PyTorch reference. The method's own `Method.attention_profile` (a method without it is refused
    by name); no method (None or "none"): the model's own attention, as `exact`'s."""
    from ..methods import get_method, is_unpatched, reference_method

    unpatched = is_unpatched(method)
    meth = get_method(reference_method() if unpatched else method)
    cfg = meth.parse_config({} if unpatched else config)
    return meth.attention_profile(cfg, shape.head_dim, S, kernels)


# ----------------------------------------------------------------------------------------------- the estimate
@dataclass
class StagePlan:
    name: str
    steps: int
    tokens: int
    parts: dict[str, int]  # bytes: weights, optimizer, activations, transient, process
    seconds: float
    recompute_attention: bool

    @property
    def peak(self) -> int:
        return sum(self.parts.values())

    def biggest(self) -> str:
        return max((k for k in self.parts if k != "process"), key=self.parts.__getitem__)


@dataclass
class RunPlan:
    device: str
    stages: list[StagePlan] = field(default_factory=list)
    available: int | None = None  # bytes this run may still take on the device (None: unknown)
    in_use: int = 0  # bytes the process holds already (CPU: its resident memory), counted in every stage's peak
    sharing: int = 1  # processes of the run drawing on the same memory (CPU processes of one host)

    @property
    def peak(self) -> int:
        return max((s.peak for s in self.stages), default=0)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.stages)

    @property
    def steps(self) -> int:
        return sum(s.steps for s in self.stages)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    def lines(self) -> list[str]:
        out = [f"plan on {self.device}: {len(self.stages)} stage(s), {self.steps:,} steps, {self.tokens:,} tokens; "
               f"estimated peak memory {format_gib(self.peak)}"
               + (f" of {format_gib(self.available + self.in_use)} available" if self.available is not None else "")
               + f", time ~{format_duration(self.seconds)} (rough; the run's ETA follows its measured steps)"]
        for s in self.stages:
            out.append(f"  {s.name}: {s.steps:,} steps, {s.tokens:,} tokens, peak ~{format_gib(s.peak)} ("
                       + ", ".join(f"{k} {format_gib(v)}" for k, v in s.parts.items() if v >= GIB / 100)
                       + f"), ~{format_duration(s.seconds)}")
        return out


def attention_recomputed(stage: Stage, device_type: str) -> bool:
    """Whether a stage recomputes each patched attention in the backward: `attention_checkpointing` true, `auto` off
    CUDA (the PyTorch references' working sets are tens of times their inputs: on the CPU, lolcats' kept 3.4 GB per
    1024-token sequence of SmolLM2 without it), or gradient checkpointing, which recomputes whole layers."""
    ac = stage.attention_checkpointing
    if stage.gradient_checkpointing:
        return True
    if ac == "auto":
        return device_type != "cuda"
    return bool(ac)


def _elem_bytes(recipe: Recipe, device_type: str) -> tuple[int, int]:
    """(bytes per weight as loaded, bytes per activation element)."""
    w = {"bfloat16": 2, "float16": 2}.get(recipe.dtype, 4)
    mp = recipe.mixed_precision
    if mp == "auto":
        mp = "bf16" if device_type == "cuda" else "no"
    return w, (2 if mp in ("bf16", "fp16") else w)


def _trained_params(stage: Stage, shape: ModelShape, method_params: int) -> int:
    trained = set(stage.trainable or (["method"] if stage.objective == "attention_transfer"
                                      else (["lora"] if stage.lora is not None else ["full"])))
    n = 0
    if "full" in trained:
        n += shape.params
    if "lora" in trained:
        lora = stage.lora
        r = lora.r if lora is not None else 8
        targets = lora.targets if lora is not None else ["q_proj", "k_proj", "v_proj", "o_proj"]
        q, kv, H, I = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.intermediate
        dims = {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H), "gate_proj": (H, I),
                "up_proj": (H, I), "down_proj": (I, H)}
        per_layer = sum(r * (a + b) for t, (a, b) in dims.items() if t in targets)
        layers = len(lora.layers) if lora is not None and lora.layers else shape.layers
        n += per_layer * layers
    if "method" in trained:
        n += method_params
    return n


def plan_stage(recipe: Recipe, stage: Stage, shape: ModelShape, *, device_type: str, world: int = 1,
               rate: float | None = None, method_params: int | None = None, patched_layers: int | None = None,
               in_use: int = 0) -> StagePlan:
    """The estimate of one stage on one process (see the module's docstring)."""
    from ..methods import is_unpatched

    L, H, I, V = shape.layers, shape.hidden, shape.intermediate, shape.vocab
    Hq, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    w_bytes, e = _elem_bytes(recipe, device_type)
    S = stage.seq_len
    rows = max(1, stage.batch_size // max(world, 1))
    n_tok = rows * S  # tokens of one micro-batch on this process
    kernels = device_type == "cuda"
    keys, held = attention_profile(recipe.method, dict(recipe.method_config), shape, S, kernels)
    patched = L if patched_layers is None else patched_layers
    if is_unpatched(recipe.method):
        patched = 0
    recompute = attention_recomputed(stage, device_type)
    if method_params is None:  # before the load: at most two D x D maps per head and layer (lolcats' feature maps)
        method_params = 2 * Hq * D * D * patched
    trained = _trained_params(stage, shape, method_params)
    q, kv = Hq * D, Hkv * D
    attn_in = q + 2 * kv  # what a recomputed attention keeps: q, k, v
    kept = 0 if recompute else Hq * held  # elements per token of an attention's working set kept
    held_bytes = e if kernels else 4  # the kernels run in autocast's dtype, the PyTorch references in fp32
    transfer = stage.objective == "attention_transfer"
    if transfer and stage.teacher_forcing and set(stage.trainable or ["method"]) == {"method"}:
        # each patched layer: its attention's inputs (or working set) and its output and the teacher's (the MSE)
        per_token, per_token_kept = patched * (attn_in + 2 * q), patched * kept
        loss = 0
    else:
        layer = 3 * H + attn_in + q + 3 * I + (H + I if "full" in (stage.trainable or []) else 0)
        per_token = L * (H if stage.gradient_checkpointing else layer)
        per_token_kept = 0 if stage.gradient_checkpointing else patched * kept
        if stage.gradient_checkpointing:
            per_token += layer  # one layer's activations, recomputed in the backward
        fused = stage.fused_loss and "full" not in (stage.trainable or [])
        loss = 0 if transfer else (min(n_tok * V * 4, 1 << 30) * 2 + 2 * n_tok * H * 4 if fused else 3 * n_tok * V * 4)
    alloc = CUDA_ALLOCATOR if kernels else CPU_ALLOCATOR
    activations = int(per_token * n_tok * e * alloc + per_token_kept * n_tok * held_bytes)
    # one layer's attention working set: its recompute and its gradients in the backward (recomputed), or the
    # gradients of the kept one
    attention_ws = int(n_tok * Hq * held * held_bytes * (2.0 if recompute else 0.5))
    teacher = int(n_tok * 2 * q * e) if transfer else 0
    parts = {
        "weights": shape.params * w_bytes,
        "optimizer": trained * 4 * 3,  # fp32 gradient + AdamW's two moments (the parameters are in the weights)
        "activations": activations,
        "transient": max(attention_ws + teacher, loss),
        "process": in_use,
    }
    seconds = 0.0
    if rate:
        seconds = stage_flops(recipe, stage, shape, keys, recompute, patched) / rate
    return StagePlan(stage.name, stage.steps, stage.steps * stage.tokens_per_step, parts, seconds, recompute)


def stage_flops(recipe: Recipe, stage: Stage, shape: ModelShape, keys: float, recompute: bool, patched: int) -> float:
    """Floating-point operations of a stage on every process together: training steps and evaluations."""
    lin = 2 * shape.layers * shape.layer_matmul_params  # per token, forward
    head = 2 * shape.vocab * shape.hidden
    att = 4 * shape.heads * shape.head_dim * keys * patched  # per token, forward, the patched layers
    exact = 4 * shape.heads * shape.head_dim * (stage.seq_len / 2) * (shape.layers - patched)
    full = "full" in (stage.trainable or [])
    if stage.objective == "attention_transfer":
        teacher = 4 * shape.heads * shape.head_dim * (stage.seq_len / 2) * patched
        train = lin + exact + teacher + att * (3 + recompute)
        fwd = lin + exact + teacher + att
    else:
        train = (lin + exact) * (3 if full else 2) + head * 2 + att * (3 + recompute)
        if stage.gradient_checkpointing:
            train += lin + exact + att
        fwd = lin + exact + att + head
    evals = (stage.steps // stage.eval_every + 1) if stage.eval_every else 1
    eval_tokens = evals * stage.eval_batches * stage.batch_size * stage.seq_len
    return train * stage.steps * stage.tokens_per_step + fwd * eval_tokens


def plan_run(recipe: Recipe, config, *, device: torch.device, world: int = 1, measure_rate: bool = True,
             method_params: int | None = None, patched_layers: int | None = None) -> RunPlan:
    """Every stage's estimate for `recipe` with the model of `config` on `device` (one of `world` processes)."""
    shape = ModelShape.from_config(config)
    dev = torch.device(device)
    rate = None
    if measure_rate:  # CPU processes of one host share its cores; GPUs add up
        rate = matmul_rate(dev) * (GPU_EFFICIENCY * world if dev.type == "cuda" else CPU_EFFICIENCY)
    in_use = process_memory() if dev.type != "cuda" else 0
    plan = RunPlan(device=_device_words(dev), available=available_memory(dev), in_use=in_use,
                   sharing=world if dev.type != "cuda" else 1)
    for st in recipe.stages:
        plan.stages.append(plan_stage(recipe, st, shape, device_type=dev.type, world=world, rate=rate,
                                      method_params=method_params, patched_layers=patched_layers, in_use=in_use))
    return plan


def check_memory(plan: RunPlan) -> None:
    """MemoryBudgetError when a stage's estimated peak exceeds what the device has available."""
    if plan.available is None:
        return
    worst = max(plan.stages, key=lambda s: s.peak, default=None)
    if worst is None or (worst.peak - plan.in_use) * plan.sharing <= plan.available:
        return
    advice = ["--quick (a short run sized for a CPU)", f"--set stages.{worst.name}.batch_size=N (now per step: "
              f"{worst.tokens // max(worst.steps, 1):,} tokens)", f"--set stages.{worst.name}.seq_len=N"]
    if not worst.recompute_attention:
        advice.append(f"--set stages.{worst.name}.attention_checkpointing=true")
    advice.append(f"--set stages.{worst.name}.gradient_checkpointing=true")
    raise MemoryBudgetError(
        f"stage {worst.name!r} needs about {format_gib(worst.peak)} at its peak"
        + (f" in each of {plan.sharing} processes" if plan.sharing > 1 else "")
        + f" (largest part: {worst.biggest()} "
        f"{format_gib(worst.parts[worst.biggest()])}) but {plan.device} has {format_gib(plan.available + plan.in_use)} "
        f"available; shrink it with " + ", ".join(advice) + ", or run on a larger machine (a GPU); "
        "--skip-memory-check runs it anyway")


# ----------------------------------------------------------------------------------------------- the device
def process_memory() -> int:
    """This process's resident memory in bytes (0 where /proc is missing)."""
    try:
        return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024
    except (OSError, AttributeError):
        return 0


def peak_memory_reset() -> bool:
    """Start a new CPU peak (Linux: the process's VmHWM is reset to its current resident memory); False where that is
    not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory() -> int | None:
    """This process's peak resident memory (VmHWM) since the start or the last `peak_memory_reset`, in bytes."""
    try:
        return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024
    except (OSError, AttributeError):
        return None


_RATES: dict[str, float] = {}


def matmul_rate(device: torch.device) -> float:
    """Floating-point operations per second of a square matrix product on `device` (fp32 on a CPU with its threads,
    bf16 on CUDA), timed for about a quarter of a second; cached per device."""
    dev = torch.device(device)
    key = str(dev)
    if key not in _RATES:
        n, dt = (1024, torch.float32) if dev.type != "cuda" else (4096, torch.bfloat16)
        a = torch.randn(n, n, device=dev, dtype=dt)
        b = torch.randn(n, n, device=dev, dtype=dt)
        torch.mm(a, b)
        reps, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            reps += 1
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if time.perf_counter() - t0 > 0.25:
                break
        _RATES[key] = 2 * n**3 * reps / (time.perf_counter() - t0)
    return _RATES[key]


def _device_words(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)}"
    return f"this CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def format_gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.0f} MiB"


def format_duration(s: float) -> str:
    s = max(0.0, float(s))
    if s < 90:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.0f} min"
    h, m = divmod(int(round(s / 60)), 60)
    return f"{h} h {m:02d} min"


# ----------------------------------------------------------------------------------------------- --quick
def quick_overrides(recipe: Recipe) -> list[str]:
    """`--set` items that make every stage of `recipe` a short run that finishes in minutes on a 2-core CPU:
    at most QUICK_STEPS steps of QUICK_BATCH x QUICK_SEQ_LEN tokens (the method, its config and the stages' objectives
    unchanged), one held-out batch at the end of each stage, a loss line every step, no checkpoint between steps, and
    `-quick` appended to the output folder. Given after the recipe, before the user's own --set items (which win)."""
    out = []
    for i, st in enumerate(recipe.stages):
        steps = min(st.steps, QUICK_STEPS)
        out += [f"stages.{i}.steps={steps}", f"stages.{i}.seq_len={min(st.seq_len, QUICK_SEQ_LEN)}",
                f"stages.{i}.batch_size={min(st.batch_size, QUICK_BATCH)}", f"stages.{i}.grad_accum=1",
                f"stages.{i}.warmup={min(st.warmup, max(1, steps // 4))}", f"stages.{i}.eval_every=0",
                f"stages.{i}.eval_batches=1", f"stages.{i}.save_every=0", f"stages.{i}.log_every=1"]
    if recipe.output.dir:
        out.append(f"output.dir={recipe.output.dir.rstrip('/')}-quick")
    return out


__all__ = [
    "MemoryBudgetError",
    "ModelShape",
    "RunPlan",
    "StagePlan",
    "attention_recomputed",
    "available_memory",
    "check_memory",
    "format_duration",
    "format_gib",
    "matmul_rate",
    "peak_memory",
    "peak_memory_reset",
    "peek_config",
    "plan_run",
    "plan_stage",
    "process_memory",
    "quick_overrides",
]
