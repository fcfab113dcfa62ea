"""The fine-tune loop behind `longctx finetune`: stages of attention transfer and next-token training.

One `Accelerator` drives the run, so the same code runs on one CPU/GPU and under several processes
(gloo on CPU, NCCL on GPUs; run from the repository root):

    accelerate launch --multi_gpu --num_processes 2 -m cli.finetune_cmd RECIPE.yaml --model ... --text ...
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 \
        --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer \
        --fsdp_reshard_after_forward true -m cli.finetune_cmd RECIPE.yaml --model ... --text ...

The first is data parallel (DDP, through accelerate.prepare). The second is FSDP2: the runner applies
`fully_shard` itself, on CPU too, where accelerate does no FSDP (`_shard`). Each decoder layer is a unit,
the rest sits in the root unit, and the method's own parameters stay replicated with their gradients
averaged. After each stage the model is reloaded unsharded with the trained tensors (`_rebuild`). FSDP1,
DeepSpeed, param offload, FSDP activation checkpointing and fp16 are refused. A stage's `batch_size` is
the global micro-batch: every process builds the same batch from the seeded chunk order and takes its own
rows, so N processes follow the optimisation of one process with the same recipe (up to reduction order).
Only the main process writes files. Checkpoints and outputs hold full tensors in the single-process
format in every mode (gathered from the shards under FSDP).

Output directory:
    train_log.json              tokens, steps, time, loss and eval curves per stage
    recipe.yaml                 the resolved recipe
    trainable/                  the small trained state: longctx_patch.json + longctx_patch.safetensors
                                (method weights) and adapter/ (peft LoRA adapter) when a stage used LoRA
    model/                      save_patched() of the final model, LoRA merged (output.save_model)
    checkpoints/stage{i}-step{n}/  resumable: state.json (stage, step, logs), trained.safetensors,
                                optimizer.pt (read with torch.load(weights_only=True)), scheduler.json, rng.json;
                                resuming never unpickles anything but tensors and plain values
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import pickle
import platform
import random
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError, LongctxError
from ..evals.common import git_commit
from .data import BatchOrder, PackedData, load_documents, local_slice, make_packed, tokenize_documents
from .recipe import LoraSpec, Recipe, Stage
from .trained import TRAINABLE_DIR

LOG_FILE = "train_log.json"
CKPT_DIR = "checkpoints"
MODEL_DIR = "model"
OPTIMIZER_FILE = "optimizer.pt"  # tensors and plain values only: read with torch.load(weights_only=True)
SCHEDULER_FILE = "scheduler.json"
RNG_FILE = "rng.json"  # one entry per process


# ----------------------------------------------------------------------------------------------- helpers
def device_description(device: torch.device, world: int) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"{world} x {name}" if world > 1 else name
    cpu = platform.processor() or platform.machine()
    return f"{world} CPU processes ({cpu})" if world > 1 else f"CPU ({cpu}, {os.cpu_count()} cores)"


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in sys.argv)


def _full(t):
    """A DTensor (an FSDP shard) as the full tensor (collective); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as plain JSON values (lists of ints), so that a checkpoint stores them
    without pickling and resuming reads them without unpickling."""
    import numpy as np

    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    st = {
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    """Restores what `_rng_state` returned (after a JSON round trip). Raises TypeError/ValueError on a
    malformed state (RuntimeError from torch)."""
    import numpy as np

    version, internal, gauss_next = st["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), None if gauss_next is None else float(gauss_next)))
    kind, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((str(kind), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        with contextlib.suppress(Exception):
            torch.cuda.set_rng_state_all([torch.tensor(c, dtype=torch.uint8) for c in st["cuda"]])


def _env_flag(name: str) -> bool:
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env(name, default=False)


@contextlib.contextmanager
def _env_set(name: str, value: str | None):
    """Sets an environment variable for the duration of the block (None: leaves it alone)."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _refuse_unsupported(recipe: Recipe, fsdp: bool, mixed_precision: str, given_model) -> None:
    """Launch modes and recipe/FSDP combinations the runner cannot run, refused before anything is loaded."""
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        raise ConfigError(
            "accelerate's DeepSpeed mode is not supported by longctx finetune; use data parallel "
            "(accelerate launch --num_processes N) or FSDP2 (--use_fsdp --fsdp_version 2), see recipes/README.md"
        )
    if not fsdp:
        return
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ConfigError(
            f"longctx finetune supports FSDP2 only (fully_shard), not FSDP{version} (which also cannot run on CPU); "
            "pass --fsdp_version 2 to accelerate launch (fsdp_version: 2 in an accelerate config file)"
        )
    if given_model is not None:
        raise ConfigError(
            "FSDP needs the model loaded from the recipe (model: / --model), not a model object: after each stage "
            "the sharded model is reloaded unsharded"
        )
    if mixed_precision == "fp16":
        raise ConfigError("FSDP with fp16 is not supported (no sharded grad scaler); set mixed_precision: bf16 or no")
    for i, st in enumerate(recipe.stages):
        if st.objective == "attention_transfer" and set(st.trainable or ["method"]) != {"method"}:
            raise ConfigError(
                f"stages.{i} ({st.name}): under FSDP an attention_transfer stage trains the method's parameters only "
                f"(trainable: [method], not {st.trainable}): the transfer loss bypasses the layers' outputs, where "
                "FSDP reduces the gradients of sharded weights; train LoRA in a next_token stage, or use DDP"
            )


def lr_lambda(stage: Stage) -> Callable[[int], float]:
    """Multiplier of the base lr after `step` optimizer steps: linear warm-up, then the schedule."""
    warm, total, floor = min(stage.warmup, stage.steps), stage.steps, stage.min_lr_ratio

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if stage.schedule == "constant":
            return 1.0
        span = max(1, total - warm)
        t = min(1.0, (step - warm) / span)
        if stage.schedule == "linear":
            return 1.0 - (1.0 - floor) * t
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

    return f


def _patched_modules(model: nn.Module) -> dict[int, nn.Module]:
    from ..patcher import is_patched, patched_modules

    return patched_modules(model) if is_patched(model) else {}


def method_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter a method added (not the shared q/k/v/o/q_norm/k_norm)."""
    from ..architectures import SHARED_SUBMODULES

    mods = set(id(m) for m in _patched_modules(model).values())
    shared = tuple(f"{n}." for n in SHARED_SUBMODULES)
    out = []
    for mname, mod in model.named_modules():
        if id(mod) not in mods:
            continue
        for pname, p in mod.named_parameters():
            if not pname.startswith(shared):
                out.append((f"{mname}.{pname}", p))
    return out


# ----------------------------------------------------------------------------------------------- runner
@dataclass
class StageLog:
    name: str
    objective: str
    trainable: list[str]
    steps: int
    seq_len: int
    batch_size: int
    grad_accum: int
    lr: float
    trainable_params: int = 0
    train_chunks: int = 0
    eval_chunks: int = 0
    steps_done: int = 0
    tokens: int = 0
    time_s: float = 0.0  # wall time of the training steps (evaluations and checkpoint writes excluded)
    eval_time_s: float = 0.0
    tokens_per_s: float = 0.0
    steady_tokens_per_s: float | None = None  # tokens/s after the first log point (no compile or autotune)
    peak_memory_gib: float | None = None  # CUDA only: peak allocated memory of this process during the stage
    loss: list[list[float]] = field(default_factory=list)  # [step, mean loss since the last entry]
    eval_loss: list[list[float]] = field(default_factory=list)  # [step, held-out loss]
    lr_curve: list[list[float]] = field(default_factory=list)
    grad_norm: list[list[float]] = field(default_factory=list)
    first_loss: float | None = None
    final_loss: float | None = None
    final_eval_loss: float | None = None
    resumed_from_step: int | None = None
    stopped_early: str | None = None  # why the stage ended before `steps` (max_time_s)


class Finetuner:
    """Runs a `Recipe`. Use `run_finetune(...)`; the class is exposed for tests and scripts."""

    def __init__(
        self,
        recipe: Recipe,
        output_dir: str | os.PathLike,
        *,
        resume: bool = False,
        results: str | None = None,
        command: str | None = None,
        progress: bool = True,
        model=None,
        tokenizer=None,
    ):
        from accelerate import Accelerator

        self.recipe = recipe
        self.out = Path(output_dir)
        self.resume = resume
        self.results = results
        self.command = command if command is not None else command_line()
        self.progress = progress
        mp = recipe.mixed_precision
        if mp == "auto":
            mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
        # the launcher's choice, read before Accelerator(): on CPU accelerate drops FSDP (and DeepSpeed)
        # silently and runs plain data parallel, and builds an FSDP1 plugin that fails without a GPU
        want_fsdp = _env_flag("ACCELERATE_USE_FSDP")
        _refuse_unsupported(recipe, want_fsdp, mp, model)
        # cpu=True is what makes accelerate run several CPU processes (gloo) instead of one each
        self.accelerator = Accelerator(mixed_precision=mp, cpu=not torch.cuda.is_available())
        acc = self.accelerator
        if acc.distributed_type.name not in (
            "NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "FSDP"
        ):
            raise ConfigError(
                f"accelerate's {acc.distributed_type.name} mode is not supported by longctx finetune; use a single "
                "process, data parallel (accelerate launch --num_processes N) or FSDP2 (--use_fsdp --fsdp_version 2)"
            )
        self.rank, self.world = acc.process_index, acc.num_processes
        self.is_main = acc.is_main_process
        self.fsdp_requested = want_fsdp
        self.fsdp = self._fsdp_plugin() if want_fsdp and self.world > 1 else None
        self._given_model = (model, tokenizer)
        self.root: nn.Module | None = None  # the model forward is called on (PeftModel once LoRA is added)
        self.trained: dict[int, nn.Parameter] = {}  # every parameter trained by a stage so far, by identity
        self.stage_logs: list[StageLog] = []
        self._eval_time = 0.0
        self.wall_start = time.time()

    def _fsdp_plugin(self):
        """The accelerate FSDP2 settings of the launch (wrap policy, reshard_after_forward); the ones this runner
        cannot honour are refused."""
        from accelerate import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import CPUOffloadPolicy

        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is None:  # CPU: accelerate ran as MULTI_CPU; read the same settings from the environment
            plugin = FullyShardedDataParallelPlugin()
        if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
            raise ConfigError("--fsdp_offload_params true is not supported by longctx finetune; leave it false")
        if plugin.activation_checkpointing:
            raise ConfigError(
                "--fsdp_activation_checkpointing is not supported by longctx finetune; leave it false and set "
                "stages.N.gradient_checkpointing: true instead (it works under FSDP)"
            )
        return plugin

    # ------------------------------------------------------------------------------------------- setup
    def _log(self, msg: str) -> None:
        if self.is_main and self.progress:
            print(msg, file=sys.stderr, flush=True)

    def load(self) -> None:
        from accelerate.utils import set_seed

        r = self.recipe
        set_seed(r.seed)  # identical model init (method parameters) on every process
        model, tok = self._given_model
        if model is None:
            from ..models import load_model

            if not r.model:
                raise ConfigError("no model given; pass --model NAME|DIR (or set `model:` in the recipe)")
            # every process loads the whole model (transformers' FSDP "cpu_ram_efficient_loading" would leave
            # the other processes with empty weights, which only accelerate's own FSDP wrapping fills in)
            with _env_set("FSDP_CPU_RAM_EFFICIENT_LOADING", "false" if self.fsdp_requested else None):
                model, tok = load_model(r.model, dtype=r.dtype, device=self.accelerator.device)
            if r.method:
                from ..methods import get_method
                from ..patcher import is_patched, patch, patched_layers

                if is_patched(model):  # a save_patched() folder: keep its patches and weights
                    have = sorted(set(patched_layers(model).values()))
                    want = sorted({get_method(r.method).name} | ({get_method(r.rest_method).name} if r.rest_method else set()))
                    if have != want:
                        raise ConfigError(
                            f"{r.model} is already patched with {', '.join(have)} but the recipe asks for "
                            f"{r.method!r}; start from the base model or set method={have[0]}"
                        )
                    self._log(f"{r.model} is already patched ({', '.join(have)}): its patches and weights are kept, "
                              "the recipe's method_config and layers are not applied")
                else:
                    patch(model, r.method, layers=r.layers, **r.method_config)
                    if r.rest_method:
                        from ..architectures import get_adapter

                        n = len(get_adapter(model).decoder_layers(model))
                        rest = [i for i in range(n) if i not in set(r.layers or [])]
                        if rest:
                            patch(model, r.rest_method, layers=rest, **r.rest_config)
        elif tok is None:
            raise ConfigError("a tokenizer is needed with a given model")
        model.to(self.accelerator.device)
        if getattr(model, "config", None) is not None:
            model.config.use_cache = False
        self.model, self.tokenizer = model, tok
        self.root = model
        for p in model.parameters():
            p.requires_grad_(False)

    def load_data(self) -> None:
        d = self.recipe.data
        docs = load_documents(d.text, d.dataset, d.split, d.field)
        self.ids = tokenize_documents(docs, self.tokenizer, add_eos=d.add_eos, max_tokens=d.max_tokens)
        self._log(f"data: {len(docs)} documents, {self.ids.numel()} tokens")

    def packed(self, stage: Stage) -> PackedData:
        return make_packed(self.ids, stage.seq_len, self.recipe.data.eval_fraction, min_train=1)

    # ------------------------------------------------------------------------------------------- stage setup
    def _is_peft(self) -> bool:
        return hasattr(self.root, "peft_config")

    def _add_lora(self, spec: LoraSpec) -> None:
        from peft import LoraConfig, get_peft_model

        if self._is_peft():
            return  # a later LoRA stage keeps training the adapter added earlier
        cfg = LoraConfig(
            r=spec.r,
            lora_alpha=spec.alpha,
            lora_dropout=spec.dropout,
            target_modules=list(spec.targets),
            layers_to_transform=spec.layers,
            bias="none",
            task_type="CAUSAL_LM",
        )
        try:
            self.root = get_peft_model(self.root, cfg)
        except ValueError as e:
            raise ConfigError(f"LoRA targets {spec.targets} do not match the model's modules: {e}") from None
        self.root.to(self.accelerator.device)

    def setup_stage(self, stage: Stage) -> list[tuple[str, nn.Parameter]]:
        """Structural changes (LoRA) and requires_grad for the stage; returns its trainable parameters."""
        if "lora" in stage.trainable:
            self._add_lora(stage.lora or LoraSpec())
        for p in self.root.parameters():
            p.requires_grad_(False)
        chosen: dict[str, nn.Parameter] = {}
        if "full" in stage.trainable:
            for n, p in self.root.named_parameters():
                if "lora_" not in n:
                    chosen[n] = p
        if "lora" in stage.trainable:
            for n, p in self.root.named_parameters():
                if "lora_" in n:
                    chosen[n] = p
        if "method" in stage.trainable:
            ids = {id(p) for _, p in method_parameters(self.model)}
            for n, p in self.root.named_parameters():
                if id(p) in ids:
                    chosen[n] = p
            if not ids:
                raise ConfigError(
                    f"stage {stage.name!r} trains the method's parameters, but method {self.recipe.method!r} has none "
                    "on the patched layers; use a method with parameters (e.g. lolcats) or trainable: [lora]"
                )
        if not chosen:
            raise ConfigError(f"stage {stage.name!r} has nothing to train")
        for p in chosen.values():
            p.requires_grad_(True)
        self.trained.update({id(p): p for p in chosen.values()})
        return list(chosen.items())

    def param_groups(self, stage: Stage, params: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
        """AdamW groups: weight decay on matrices only; the method's own parameters at `method_lr` if set."""
        method_ids = {id(p) for _, p in method_parameters(self.model)} if stage.method_lr is not None else set()
        groups = []
        for is_method in (False, True):
            lr = stage.method_lr if is_method else stage.lr
            for decay in (True, False):
                ps = [p for _, p in params if (id(p) in method_ids) == is_method and (p.ndim >= 2) == decay]
                if ps:
                    groups.append({"params": ps, "lr": lr, "weight_decay": stage.weight_decay if decay else 0.0})
        return groups

    # ------------------------------------------------------------------------------------------- checkpoints
    def _ckpt_root(self) -> Path:
        return self.out / CKPT_DIR

    def latest_checkpoint(self) -> Path | None:
        root = self._ckpt_root()
        if not root.is_dir():
            return None
        best, best_key = None, None
        for d in root.iterdir():
            st = d / "state.json"
            if d.name.endswith(".tmp") or not st.exists():
                continue  # incomplete (interrupted while writing)
            try:
                s = json.loads(st.read_text())
            except json.JSONDecodeError:
                continue
            key = (s["stage"], s["step"])
            if best_key is None or key > best_key:
                best, best_key = d, key
        return best

    def _named_trained(self) -> dict[str, torch.Tensor]:
        """Every parameter trained so far, named as in the current root model, as full tensors on the CPU.
        Collective under FSDP (every process gathers the shards)."""
        if self.fsdp is not None:
            self._reshard_all(self.root)
        return {
            n: _full(p).detach().to("cpu").contiguous()
            for n, p in self.root.named_parameters()
            if id(p) in self.trained
        }

    def _optimizer_state(self, optimizer) -> dict[str, Any]:
        """optimizer.state_dict() with full tensors (collective under FSDP): the format of a single process."""
        sd = optimizer.state_dict()
        if self.fsdp is None:
            return sd
        state = {i: {k: _full(v) for k, v in sd["state"][i].items()} for i in sorted(sd["state"])}
        return {"state": state, "param_groups": sd["param_groups"]}

    def _load_optimizer_state(self, optimizer, sd: dict[str, Any]) -> None:
        """Loads a saved (full) optimizer state; under FSDP each state tensor is cut to its parameter's shard."""
        if self.fsdp is not None:
            from torch.distributed.tensor import DTensor, distribute_tensor

            saved = [i for g in sd["param_groups"] for i in g["params"]]
            now = [p for g in optimizer.param_groups for p in g["params"]]
            by_index = dict(zip(saved, now))
            state = {}
            for i, st in sd["state"].items():
                p = by_index.get(i)
                if isinstance(p, DTensor):
                    st = {
                        k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                        if k != "step" and torch.is_tensor(v) and v.shape == p.shape
                        else v
                        for k, v in st.items()
                    }
                state[i] = st
            sd = {"state": state, "param_groups": sd["param_groups"]}
        optimizer.load_state_dict(sd)

    def save_checkpoint(self, si: int, step: int, optimizer, scheduler, keep: int = 2, completed: bool = False) -> None:
        from accelerate.utils import gather_object
        from safetensors.torch import save_file

        # collectives: every process takes part (under FSDP they gather the full tensors)
        rng = gather_object([_rng_state()])
        trained, opt_state = self._named_trained(), self._optimizer_state(optimizer)
        if self.is_main:
            d = self._ckpt_root() / f"stage{si}-step{step:07d}"
            tmp = d.with_name(d.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file(trained, str(tmp / "trained.safetensors"))
            # nothing here needs pickle to read back: tensors and plain values (torch.load(weights_only=True)),
            # the scheduler and the RNG states as JSON
            torch.save(opt_state, tmp / OPTIMIZER_FILE)
            (tmp / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict(), allow_nan=True))
            (tmp / RNG_FILE).write_text(json.dumps(rng))
            state = {
                "stage": si,
                "stage_name": self.recipe.stages[si].name,
                "step": step,
                "completed": completed,
                "fingerprint": self.recipe.fingerprint(),
                "world_size": self.world,
                "logs": [l.__dict__ for l in self.stage_logs],
                "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
            shutil.rmtree(d, ignore_errors=True)
            tmp.rename(d)
            if keep > 0:
                found = []
                for p in self._ckpt_root().iterdir():
                    if not p.name.endswith(".tmp") and (p / "state.json").exists():
                        s = json.loads((p / "state.json").read_text())
                        found.append(((s["stage"], s["step"]), p))
                for _, old in sorted(found)[:-keep]:
                    shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def read_checkpoint(self, d: Path) -> dict[str, Any]:
        try:
            state = json.loads((d / "state.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint {d} cannot be read ({e}); delete it or start without --resume") from None
        if state.get("fingerprint") != self.recipe.fingerprint():
            raise CheckpointError(
                f"checkpoint {d} was written by a different recipe (model, method, layers or stage structure "
                "differ); resume with the same recipe and --set values, or use a new --output directory"
            )
        return state

    @staticmethod
    def _read_ckpt_file(d: Path, name: str) -> Any:
        """A checkpoint file, read without unpickling anything but tensors and plain values: JSON, or
        torch.load(weights_only=True). Any failure is a one-line CheckpointError."""
        p = d / name
        if not p.exists():
            legacy = {SCHEDULER_FILE: "scheduler.pt", RNG_FILE: "rng.pt"}.get(name)
            if legacy and (d / legacy).exists():
                raise CheckpointError(
                    f"checkpoint {d} is in the older format ({legacy}, a pickle, is not loaded: unpickling can run "
                    "code); resume it with the version that wrote it, or start without --resume"
                )
            raise CheckpointError(f"checkpoint {d} lacks {name}; delete it or start without --resume")
        try:
            if name.endswith(".json"):
                return json.loads(p.read_text())
            return torch.load(p, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise CheckpointError(
                f"checkpoint {d}: {name} holds objects other than tensors and plain values and is refused "
                "(unpickling them could run code); delete the checkpoint or start without --resume"
            ) from None
        except Exception as e:  # noqa: BLE001 - unreadable in any other way (truncated, not JSON ...)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CheckpointError(
                f"checkpoint {d}: {name} cannot be read ({type(e).__name__}: {msg}); delete it or start without --resume"
            ) from None

    def load_resume_state(self, d: Path, optimizer, scheduler, start_step: int) -> None:
        """Optimizer, scheduler and RNG states of checkpoint `d` (the RNG reseeded when the number of processes
        changed)."""
        opt_sd = self._read_ckpt_file(d, OPTIMIZER_FILE)
        sched_sd = self._read_ckpt_file(d, SCHEDULER_FILE)
        rng = self._read_ckpt_file(d, RNG_FILE)
        if not (isinstance(opt_sd, dict) and {"state", "param_groups"} <= set(opt_sd)):
            raise CheckpointError(f"checkpoint {d}: {OPTIMIZER_FILE} is not an optimizer state dict")
        if not isinstance(sched_sd, dict) or not isinstance(rng, list):
            bad = SCHEDULER_FILE if not isinstance(sched_sd, dict) else RNG_FILE
            raise CheckpointError(f"checkpoint {d}: {bad} does not hold the expected state")
        try:
            self._load_optimizer_state(optimizer, opt_sd)
            scheduler.load_state_dict(sched_sd)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(
                f"checkpoint {d}: the optimizer or scheduler state does not fit this stage ({type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})"
            ) from None
        if len(rng) == self.world:
            try:
                _set_rng_state(rng[self.rank])
            except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"checkpoint {d}: {RNG_FILE} holds a malformed RNG state ({type(e).__name__})") from None
        else:
            self._log(f"note: checkpoint written by {len(rng)} processes, resuming with {self.world}; RNG reseeded")
            torch.manual_seed(self.recipe.seed + 104729 * start_step + self.rank)

    def load_trained_state(self, d: Path) -> None:
        from safetensors.torch import load_file

        try:
            sd = load_file(str(d / "trained.safetensors"))
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {d}: trained.safetensors cannot be read ({e})") from None
        self._load_trained(sd, f"checkpoint {d}")

    def _load_trained(self, sd: dict[str, torch.Tensor], source: str) -> None:
        params = dict(self.root.named_parameters())
        unknown = sorted(set(sd) - set(params))
        if unknown:
            raise CheckpointError(f"{source} holds parameters the model lacks: {unknown[:5]}")
        with torch.no_grad():
            for n, t in sd.items():
                if params[n].shape != t.shape:
                    raise CheckpointError(f"{source}: {n} has shape {tuple(t.shape)}, model {tuple(params[n].shape)}")
                params[n].copy_(t.to(params[n].device, params[n].dtype))
                self.trained[id(params[n])] = params[n]

    # ------------------------------------------------------------------------------------------- FSDP
    def _shard(self, root: nn.Module, keep_gathered: bool = False) -> nn.Module:
        """FSDP2 (`fully_shard`) in place: one unit per decoder layer (plus the modules the accelerate wrap policy
        names), the rest (embeddings, final norm, head) in the root unit. Frozen and trainable parameters (the
        base model, LoRA) share a unit. Returns `root` (now an FSDPModule).

        The method's own parameters (feature maps, window factors, ...; small) are left out of the units and
        replicated, their gradients averaged by `_average_replicated_grads`: the attention-transfer loss reaches
        them only through per-layer side losses, not through the layers' outputs (teacher forcing detaches them),
        so FSDP's backward hooks, which hang on those outputs, would never reduce their gradients.

        `keep_gathered`: every unit keeps its gathered parameters from forward until `_reshard_all` (after the
        optimizer step). For attention transfer whose backward needs the frozen weights (no teacher forcing:
        gradients cross the layers; gradient checkpointing: layers are recomputed): FSDP would re-gather them
        only through the same output hooks."""
        import torch.distributed as dist
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from ..architectures import get_adapter

        plugin = self.fsdp
        # every process must shard the same values; a LoRA adapter is initialised from each process's own RNG
        # stream (DDP broadcasts rank 0's module states at wrapping; fully_shard does not)
        with torch.no_grad():
            for p in root.parameters():
                if p.requires_grad:
                    dist.broadcast(p.data, src=0)
        units = {id(m) for m in get_adapter(self.model).decoder_layers(self.model)}
        policy = fsdp2_prepare_auto_wrap_policy(plugin, root) if plugin.auto_wrap_policy is not None else None
        mesh = init_device_mesh(self.accelerator.device.type, (self.world,))
        replicated = {p for _, p in method_parameters(self.model)}
        trained = {n for n, p in root.named_parameters() if id(p) in self.trained}
        reshard = bool(plugin.reshard_after_forward) and not keep_gathered
        for m in reversed(list(root.modules())):  # children before their parents
            if m is not root and (id(m) in units or (policy is not None and policy(m))):
                fully_shard(m, mesh=mesh, reshard_after_forward=reshard, ignored_params=replicated)
        fully_shard(root, mesh=mesh, ignored_params=replicated, **({"reshard_after_forward": False} if keep_gathered else {}))
        if keep_gathered:
            root.set_reshard_after_backward(False)
        # the parameters are new (sharded) objects now; keep the bookkeeping by identity
        self.trained = {id(p): p for n, p in root.named_parameters() if n in trained}
        return root

    @staticmethod
    def _reshard_all(root: nn.Module) -> None:
        """Frees every FSDP unit's gathered parameters. A unit left gathered (after a forward without backward,
        e.g. evaluation, the root unit keeps them; `keep_gathered`) has them as the module's parameters, and
        they go stale once the optimizer steps the shards."""
        from torch.distributed.fsdp import FSDPModule

        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _average_replicated_grads(self, params: list[nn.Parameter]) -> None:
        """FSDP: the mean over processes of the gradients of the unsharded (method) parameters, as DDP takes it."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None and not isinstance(p, DTensor):
                groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in groups.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= self.world
            for g, v in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(v.view_as(g))

    def _rebuild(self, upto: int, trained: dict[str, torch.Tensor]) -> None:
        """After an FSDP stage: an FSDP2 model cannot be unwrapped, so the model is loaded afresh (unsharded) and
        given the structure of stages 0..upto (LoRA) and every trained tensor, as --resume does. The RNG state is
        carried over, so the next stage starts exactly as it would have without the reload."""
        rng = _rng_state()
        self.root = self.model = None
        self.trained = {}
        self.accelerator.free_memory()
        self.load()
        for stage in self.recipe.stages[: upto + 1]:
            self.setup_stage(stage)
        self._load_trained(trained, "the gathered FSDP state")
        _set_rng_state(rng)

    # ------------------------------------------------------------------------------------------- losses
    def _forward_loss(self, model, batch: torch.Tensor, stage: Stage, transfer) -> torch.Tensor:
        if self.fsdp is not None:  # the FSDP model is not prepared by accelerate, which adds autocast for DDP
            with self.accelerator.autocast():
                return self._forward_loss_inner(model, batch, stage, transfer)
        return self._forward_loss_inner(model, batch, stage, transfer)

    def _forward_loss_inner(self, model, batch: torch.Tensor, stage: Stage, transfer) -> torch.Tensor:
        if stage.objective == "attention_transfer":
            transfer.clear()
            model(input_ids=batch, use_cache=False, logits_to_keep=1)
            if not transfer.losses:
                raise LongctxError("attention transfer recorded no layer losses: are any layers patched?")
            return transfer.loss()
        out = model(input_ids=batch, labels=batch, use_cache=False)
        return out.loss

    @contextlib.contextmanager
    def _objective(self, stage: Stage):
        if stage.objective != "attention_transfer":
            yield None
            return
        from .transfer import attention_transfer

        with attention_transfer(self.model, teacher_forcing=stage.teacher_forcing) as tr:
            yield tr

    def evaluate(self, model, data: PackedData, stage: Stage, transfer) -> float | None:
        t = time.time()
        try:
            return self._evaluate(model, data, stage, transfer)
        finally:
            self._eval_time += time.time() - t

    @torch.no_grad()
    def _evaluate(self, model, data: PackedData, stage: Stage, transfer) -> float | None:
        n = min(stage.eval_batches * stage.batch_size, data.eval.shape[0])
        n = (n // self.world) * self.world
        if n == 0:
            return None
        rows = data.eval[:n][self.rank :: self.world]
        per = max(1, stage.batch_size // self.world)
        was = model.training
        model.eval()
        total = torch.zeros((), device=self.accelerator.device)
        for i in range(0, rows.shape[0], per):
            b = rows[i : i + per].to(self.accelerator.device)
            total += self._forward_loss(model, b, stage, transfer).float() * b.shape[0]
        model.train(was)
        mean = total / rows.shape[0]
        return float(self.accelerator.reduce(mean, reduction="mean"))

    # ------------------------------------------------------------------------------------------- a stage
    def run_stage(self, si: int, stage: Stage, start_step: int, ckpt: Path | None, log: StageLog) -> None:
        from tqdm.auto import tqdm

        acc = self.accelerator
        params = self.setup_stage(stage)
        if ckpt is not None:
            self.read_checkpoint(ckpt)
            self.load_trained_state(ckpt)
        if stage.gradient_checkpointing:
            self.root.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(self.root, "enable_input_require_grads"):
                self.root.enable_input_require_grads()
        data = self.packed(stage)
        log.train_chunks, log.eval_chunks = int(data.train.shape[0]), int(data.eval.shape[0])
        log.trainable_params = int(sum(p.numel() for _, p in params))
        if stage.batch_size % self.world:
            raise ConfigError(
                f"stages.{si}.batch_size={stage.batch_size} is not divisible by the {self.world} processes; "
                f"use a multiple of {self.world}"
            )
        order = BatchOrder(log.train_chunks, stage.batch_size, self.recipe.seed + 7919 * si)

        if self.fsdp is not None:  # shard first: the optimizer holds the sharded parameters
            self.root.train()
            keep = stage.objective == "attention_transfer" and (not stage.teacher_forcing or stage.gradient_checkpointing)
            model = self._shard(self.root, keep_gathered=keep)
            now = dict(model.named_parameters())
            params = [(n, now[n]) for n, _ in params]
        optimizer = torch.optim.AdamW(self.param_groups(stage, params), lr=stage.lr, betas=tuple(stage.betas))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(stage))
        if ckpt is not None:
            self.load_resume_state(ckpt, optimizer, scheduler, start_step)
        else:
            # dropout streams differ per process; the model itself was initialised identically everywhere
            torch.manual_seed(self.recipe.seed + 1_000 * si + self.rank)
        self.root.train()
        if self.fsdp is None:
            model, optimizer = acc.prepare(self.root, optimizer)
        # the scheduler is stepped by hand once per optimizer step (not prepared: no per-process scaling)

        trainable = [p for _, p in params]
        cuda = acc.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(acc.device)
        t0 = time.time()
        self._eval_time = 0.0
        show = self.is_main and self.progress
        bar = show and sys.stderr.isatty()  # logs (no terminal) get one plain line per log_every steps
        pbar = tqdm(
            total=stage.steps, initial=start_step, desc=f"{stage.name}", disable=not bar, dynamic_ncols=True,
            file=sys.stderr,
        )
        t_run, tok_run = time.time(), 0  # live tokens/s and the max_time_s budget (evaluations included)
        # losses and gradient norms stay on the device until a log point: a float() every step would make the
        # host wait for the device every step, and a small model's step is mostly launch time
        pending: list[tuple[int, torch.Tensor, Any, float]] = []  # (step, loss, grad norm, lr)
        window: list[float] = []
        gn = lr_now = float("nan")
        steady: list[float] | None = None  # [tokens, training time] at the first log point

        def flush() -> None:
            nonlocal gn
            if not pending:
                return
            losses = torch.stack([p[1] for p in pending])
            losses = acc.reduce(losses, reduction="mean").float().cpu().tolist()
            for (st, _, g, _lr), v in zip(pending, losses):
                if not math.isfinite(v):
                    raise LongctxError(
                        f"stage {stage.name!r}: the loss became {v} at step {st}; lower stages.{si}.lr "
                        f"or raise stages.{si}.warmup"
                    )
                if log.first_loss is None:
                    log.first_loss = v
                log.final_loss = v
                window.append(v)
            g = pending[-1][2]
            gn = float(_full(g)) if g is not None else float("nan")
            pending.clear()

        with self._objective(stage) as transfer:
            if start_step == 0 and stage.eval_every and data.eval.shape[0]:
                ev = self.evaluate(model, data, stage, transfer)
                if ev is not None:
                    log.eval_loss.append([0, ev])
            for step in range(start_step, stage.steps):
                local = torch.zeros((), device=acc.device)
                for micro in range(stage.grad_accum):
                    m = step * stage.grad_accum + micro
                    batch = data.train[order.indices(m)]
                    batch = local_slice(batch, self.rank, self.world).to(acc.device)
                    sync = micro == stage.grad_accum - 1
                    if self.fsdp is not None:  # reduce-scatter the accumulated gradients on the last micro-step
                        model.set_requires_gradient_sync(sync)
                        ctx = contextlib.nullcontext()
                    else:
                        ctx = contextlib.nullcontext() if sync else acc.no_sync(model)
                    with ctx:
                        loss = self._forward_loss(model, batch, stage, transfer)
                        acc.backward(loss / stage.grad_accum)
                    local += loss.detach().float() / stage.grad_accum
                if self.fsdp is not None:
                    self._average_replicated_grads(trainable)
                g = acc.clip_grad_norm_(trainable, stage.max_grad_norm) if stage.max_grad_norm else None
                lr_now = optimizer.param_groups[0]["lr"]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if self.fsdp is not None:
                    self._reshard_all(model)
                done = step + 1
                pending.append((done, local, g, lr_now))
                log.tokens += stage.tokens_per_step
                tok_run += stage.tokens_per_step
                log.steps_done = done
                at_log = done % stage.log_every == 0 or done == stage.steps
                if at_log or bar:  # a progress bar shows every step's loss (and so waits for it)
                    flush()
                tps = tok_run / max(time.time() - t_run, 1e-9)
                pbar.update(1)
                if window:
                    pbar.set_postfix(loss=f"{window[-1]:.4g}", lr=f"{lr_now:.2e}", tok_s=f"{tps:.0f}")
                if at_log:
                    if steady is None:
                        steady = [log.tokens, log.time_s + time.time() - t0 - self._eval_time]
                    mean = sum(window) / len(window)
                    log.loss.append([done, mean])
                    log.lr_curve.append([done, lr_now])
                    log.grad_norm.append([done, gn])
                    window = []
                    if show and not bar:
                        print(f"{stage.name} step {done}/{stage.steps}: loss {mean:.4g} lr {lr_now:.2e} "
                              f"grad-norm {gn:.3g} {tps:.0f} tok/s", file=sys.stderr, flush=True)
                if stage.eval_every and done % stage.eval_every == 0 and done != stage.steps:
                    ev = self.evaluate(model, data, stage, transfer)
                    if ev is not None:
                        log.eval_loss.append([done, ev])
                        if show:
                            pbar.write(f"{stage.name} step {done}: eval loss {ev:.4g}", file=sys.stderr)
                if stage.save_every and done % stage.save_every == 0 and done != stage.steps:
                    flush()  # a non-finite loss raises here, before it could be saved
                    log.time_s += time.time() - t0 - self._eval_time
                    log.eval_time_s += self._eval_time
                    self._eval_time = 0.0
                    self.save_checkpoint(si, done, optimizer, scheduler, keep=self.recipe.output.keep_checkpoints)
                    t0 = time.time()
                if stage.max_time_s is not None and done < stage.steps:
                    over = time.time() - t_run >= stage.max_time_s
                    if self.world > 1:  # one decision for every process (a single process need not wait for its device)
                        over = float(acc.reduce(torch.tensor(float(over), device=acc.device), reduction="sum")) > 0
                    if over:
                        flush()
                        if window:
                            log.loss.append([done, sum(window) / len(window)])
                            log.lr_curve.append([done, lr_now])
                            log.grad_norm.append([done, gn])
                        log.stopped_early = f"max_time_s={stage.max_time_s:g} reached after step {done}"
                        self._log(f"{stage.name}: {log.stopped_early}; ending the stage")
                        break
            ev = self.evaluate(model, data, stage, transfer)
            if ev is not None:
                log.eval_loss.append([log.steps_done, ev])
                log.final_eval_loss = ev
        pbar.close()
        flush()
        log.time_s += time.time() - t0 - self._eval_time
        log.eval_time_s += self._eval_time
        log.tokens_per_s = log.tokens / max(log.time_s, 1e-9)
        if cuda:  # this process's peak, training and evaluation of the stage
            log.peak_memory_gib = torch.cuda.max_memory_allocated(acc.device) / 2**30
        if steady is not None and log.tokens > steady[0]:
            # after the first log point: compilation and autotuning of the first steps left out
            log.steady_tokens_per_s = (log.tokens - steady[0]) / max(log.time_s - steady[1], 1e-9)
        if stage.gradient_checkpointing:
            self.root.gradient_checkpointing_disable()
        self.save_checkpoint(
            si, log.steps_done, optimizer, scheduler, keep=self.recipe.output.keep_checkpoints, completed=True
        )
        # back to the plain model for the next stage / the final save
        if self.fsdp is not None:
            trained = self._named_trained()
            del model, optimizer, scheduler, params, trainable
            self._rebuild(si, trained)
        else:
            self.root = acc.unwrap_model(model, keep_fp32_wrapper=False)
            acc.free_memory()
            del optimizer, scheduler
        self._log(
            f"{stage.name}: {log.steps_done} steps, {log.tokens} tokens, {log.time_s:.1f} s, "
            f"loss {log.first_loss if log.first_loss is None else round(log.first_loss, 4)} -> "
            f"{log.final_loss if log.final_loss is None else round(log.final_loss, 4)}"
            + (f", eval {log.final_eval_loss:.4f}" if log.final_eval_loss is not None else "")
        )

    # ------------------------------------------------------------------------------------------- the run
    def run(self) -> dict[str, Any]:
        r = self.recipe
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        self.accelerator.wait_for_everyone()
        ckpt, state = None, None
        if self.resume:
            ckpt = self.latest_checkpoint()
            if ckpt is None:
                self._log(f"--resume: no checkpoint under {self._ckpt_root()}; starting from the beginning")
            else:
                state = self.read_checkpoint(ckpt)
                self._log(f"resuming from {ckpt} (stage {state['stage_name']}, step {state['step']})")
        elif self._ckpt_root().exists() and any(self._ckpt_root().iterdir()):  # every process stops
            raise CheckpointError(
                f"{self._ckpt_root()} already holds checkpoints; pass --resume to continue that run, "
                "or choose another --output directory"
            )
        self.load()
        self.load_data()
        for si, stage in enumerate(r.stages):
            log = StageLog(
                name=stage.name, objective=stage.objective, trainable=list(stage.trainable or []), steps=stage.steps,
                seq_len=stage.seq_len, batch_size=stage.batch_size, grad_accum=stage.grad_accum, lr=stage.lr,
            )
            start, this_ckpt = 0, None
            if state is not None and si <= state["stage"]:
                saved = state["logs"][si] if si < len(state["logs"]) else None
                if saved is not None:
                    log = StageLog(**saved)
                if si < state["stage"] or state["completed"]:
                    # finished before the interruption: redo its structural changes (LoRA) only
                    self.setup_stage(stage)
                    self.stage_logs.append(log)
                    if si == state["stage"]:
                        self.load_trained_state(ckpt)
                    continue
                start, this_ckpt = state["step"], ckpt
                log.resumed_from_step = start
            self.stage_logs.append(log)
            self.run_stage(si, stage, start, this_ckpt, log)
        self.accelerator.wait_for_everyone()
        summary = self.summary()
        if self.is_main:
            self.save_outputs()
            (self.out / LOG_FILE).write_text(json.dumps(summary, indent=1) + "\n")
            if self.results:
                write_results(self.results, summary)
        self.accelerator.wait_for_everyone()
        return summary

    def summary(self) -> dict[str, Any]:
        r = self.recipe
        return {
            "device": device_description(self.accelerator.device, self.world),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": git_commit(),
            "command": self.command,
            "model": r.model,
            "method": r.method,
            "method_config": r.method_config,
            "layers": r.layers,
            "world_size": self.world,
            "parallel": "fsdp2" if self.fsdp is not None else ("ddp" if self.world > 1 else "none"),
            "mixed_precision": self.accelerator.mixed_precision,
            "data_tokens": int(self.ids.numel()),
            "tokens": int(sum(l.tokens for l in self.stage_logs)),
            "steps": int(sum(l.steps_done for l in self.stage_logs)),
            "time_s": float(sum(l.time_s for l in self.stage_logs)),
            "stages": [l.__dict__ for l in self.stage_logs],
            "output_dir": str(self.out),
            "recipe": r.to_dict(),
        }

    def export_lolcats(self, path: Path) -> Path:
        """The LoLCATs `model.pt` layout (feature maps, window factors, PEFT LoRA A/B unmerged). Reload with
        `patch(model, "lolcats", checkpoint=PATH, lora_alpha=ALPHA)`."""
        from ..methods.lolcats import export_lolcats_checkpoint

        return Path(export_lolcats_checkpoint(self.model, str(path)))

    def save_outputs(self) -> None:
        """trainable/ (method weights + adapter), recipe.yaml, and model/ (save_patched, LoRA merged)."""
        import yaml

        from ..checkpoint import ADAPTER_DIR, write_patch
        from ..patcher import is_patched, method_state_dict, patch_groups, save_patched

        (self.out / "recipe.yaml").write_text(yaml.safe_dump(self.recipe.to_dict(), sort_keys=False))
        tdir = self.out / TRAINABLE_DIR
        tdir.mkdir(parents=True, exist_ok=True)
        if is_patched(self.model):
            write_patch(tdir, [g.to_record() for g in patch_groups(self.model)], method_state_dict(self.model))
        if self._is_peft():
            self.root.save_pretrained(str(tdir / ADAPTER_DIR))
        if self.recipe.output.lolcats_export:
            self.export_lolcats(tdir / "lolcats" / "model.pt")
        if self.recipe.output.save_model:
            if self._is_peft():
                self.root = self.root.merge_and_unload()
                self.model = self.root
            mdir = self.out / MODEL_DIR
            if is_patched(self.model):
                save_patched(self.model, mdir, tokenizer=self.tokenizer)
            else:
                self.model.save_pretrained(str(mdir))
                self.tokenizer.save_pretrained(str(mdir))


def write_results(name: str, summary: dict[str, Any]) -> Path:
    """Writes `finetune/NAME.json` of the default results folder (`evals.common.default_results_dir`), or NAME
    itself when it is a path ending in .json."""
    from ..evals.common import default_results_dir

    p = Path(name)
    if p.suffix != ".json":
        p = default_results_dir() / "finetune" / f"{name}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    rec = {k: summary[k] for k in ("device", "date", "commit", "command")}
    rec["task"] = "finetune"
    rec.update({k: v for k, v in summary.items() if k not in rec})
    p.write_text(json.dumps(rec, indent=1) + "\n")
    return p


def run_finetune(
    recipe: Recipe,
    output_dir: str | os.PathLike | None = None,
    *,
    resume: bool = False,
    results: str | None = None,
    command: str | None = None,
    progress: bool = True,
    model=None,
    tokenizer=None,
) -> dict[str, Any]:
    """Runs every stage of `recipe` and writes the outputs; returns the training log (also in train_log.json)."""
    out = output_dir or recipe.output.dir
    if not out:
        raise ConfigError("no output directory; pass --output DIR (or set output.dir in the recipe)")
    return Finetuner(
        recipe, out, resume=resume, results=results, command=command, progress=progress, model=model, tokenizer=tokenizer
    ).run()
