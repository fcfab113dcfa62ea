"""The fine-tune loop behind `longctx finetune`: stages of attention transfer and next-token training.

One `Accelerator` drives the run, so the same code runs on one CPU/GPU and under several processes
(gloo on CPU, NCCL on GPUs; run from the repository root):

    accelerate launch --multi_gpu --num_processes 2 -m longctx_patch.cli.finetune_cmd RECIPE.yaml --model ... --text ...
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 \
        --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer \
        --fsdp_reshard_after_forward true -m longctx_patch.cli.finetune_cmd RECIPE.yaml --model ... --text ...

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
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import write_text
from ..errors import CheckpointError, ConfigError, LongctxError
from ..provenance import command_line, result_header
from .losses import fusable_head, lm_head_bypassed, next_token_loss
from .lora_init import check_same_adapter, set_adapter
from .data import PackedData, load_documents, make_packed, text_files, text_record, tokenize_documents
from .recipe import LoraSpec, Recipe, Stage
from .trained import TRAINABLE_DIR, peft_wrapping
from .resume import CheckpointMixin, _rng_state, _set_rng_state
from .distributed import DistributedMixin, _env_flag, _env_set
from .params import method_parameters
from .plan import attention_recomputed, check_memory, peek_config, plan_run
from .stage_loop import StageLog, StageLoopMixin


LOG_FILE = "train_log.json"
MODEL_DIR = "model"


# ----------------------------------------------------------------------------------------------- helpers
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


class Finetuner(CheckpointMixin, DistributedMixin, StageLoopMixin):
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
        stop_after: str | None = None,
        memory_check: bool = True,
        log_seconds: float = 30.0,
    ):
        from accelerate import Accelerator

        self.recipe = recipe
        self.out = Path(output_dir)
        self.resume = resume
        self.stop_after = _stage_index(recipe, stop_after)
        self.results = results
        self.command = command if command is not None else command_line()
        self.progress = progress
        self.memory_check = memory_check  # refuse a run whose estimated peak exceeds the memory available (plan.py)
        self.log_seconds = log_seconds  # without a terminal: a progress line at least this often
        self.plan = None  # plan.RunPlan: the estimate printed before the run
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
        # (parameter, its weights as loaded) of the base parameters held in bf16 for the run (`frozen_dtype`)
        self._frozen_originals: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.trained: dict[int, nn.Parameter] = {}  # every parameter trained by a stage so far, by identity
        # lora.init: checkpoint: (the checkpoint's adapter tensors, its adapter_config, its folder) (_take_checkpoint_lora)
        self._checkpoint_lora: tuple[dict[str, torch.Tensor], dict[str, Any], str] | None = None
        self.stage_logs: list[StageLog] = []
        self._eval_time = 0.0
        self.wall_start = time.time()

    def _log(self, msg: str) -> None:
        if self.is_main and self.progress:
            print(msg, file=sys.stderr, flush=True)

    def make_plan(self, config) -> None:
        """Estimate every stage (tokens, steps, peak memory, time), print it, and refuse (MemoryBudgetError) when the
        estimated peak exceeds the memory available, unless `memory_check` is off."""
        self.plan = plan_run(self.recipe, config, device=self.accelerator.device, world=self.world)
        for line in self.plan.lines():
            self._log(line)
        if self.memory_check:
            check_memory(self.plan)  # every process raises: none waits for another

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
        self._take_checkpoint_lora()  # before the frozen weights are cast: they are the projections as they were
        self._hold_frozen_in_compute_dtype()

    def _take_checkpoint_lora(self) -> None:
        """`lora.init: checkpoint` on the first LoRA stage: the LoRA adapter of the method's checkpoint, which the
        patch merged into the q/k/v/o projections, is taken back out of them (their weights as they were are put
        back) and kept until that stage adds the adapter, which starts from its values (`_add_lora`). The model
        computes the same either way; only where the LoRA lives changes (and so what trains)."""
        from ..methods.lola.weights import take_checkpoint_lora

        self._checkpoint_lora = None
        first = next((s for s in self.recipe.stages if "lora" in s.trainable), None)
        if first is None or first.lora is None or first.lora.init != "checkpoint":
            return
        sd, cfg, folder = take_checkpoint_lora(self.model)
        self._checkpoint_lora = (sd, cfg, folder)
        self._log(f"LoRA: the adapter of {folder} trains on from its values (lora.init: checkpoint; r {cfg.get('r')}, "
                  f"alpha {cfg.get('lora_alpha')}, {len(sd) // 2} pairs)")

    def _hold_frozen_in_compute_dtype(self) -> None:
        """`frozen_dtype: auto` under bf16 mixed precision: the base model's floating-point parameters (no stage
        trains them) in bf16 for the run. With fp32 base weights under autocast the residual stream stays fp32 and
        every projection casts its fp32 input first (on an H200, copies and casts were 45% of a SmolLM2 transfer step).
        The method's parameters and LoRA's stay fp32 (their optimizer states and updates need it). The weights
        as loaded are kept on the host and put back when the stages end (`model/` and the model `run` leaves are
        the weights as loaded plus what the stages trained)."""
        r = self.recipe
        if (r.frozen_dtype != "auto" or self.accelerator.mixed_precision != "bf16" or self.fsdp_requested
                or any("full" in (s.trainable or []) for s in r.stages)):
            return
        method_ids = {id(p) for _, p in method_parameters(self.model)}
        for p in self.model.parameters():  # tied weights appear once
            if id(p) in method_ids or not p.is_floating_point() or p.dtype in (torch.bfloat16, torch.float16):
                continue
            self._frozen_originals.append((p, p.data.to("cpu", copy=True)))
            p.data = p.data.to(torch.bfloat16)

    def _restore_frozen(self) -> None:
        """The base parameters as loaded again (before `model/` is written)."""
        for p, orig in self._frozen_originals:
            p.data = orig.to(p.device)
        self._frozen_originals = []

    def load_data(self) -> None:
        d = self.recipe.data
        docs = load_documents(d.text, d.dataset, d.split, d.field)
        self.ids = tokenize_documents(docs, self.tokenizer, add_eos=d.add_eos, max_tokens=d.max_tokens)
        self.text = text_record(self.ids, d.text or d.dataset, len(docs))  # each stage's log keeps what it read
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
        if spec.init == "checkpoint":
            check_same_adapter(spec, *self._checkpoint_lora[1:])
        try:
            with peft_wrapping():
                self.root = get_peft_model(self.root, cfg)
        except ValueError as e:
            raise ConfigError(f"LoRA targets {spec.targets} do not match the model's modules: {e}") from None
        if spec.init == "checkpoint":
            self._set_checkpoint_lora()
        self.root.to(self.accelerator.device)

    def _set_checkpoint_lora(self) -> None:
        """The new adapter's weights set to the checkpoint's (`_take_checkpoint_lora`; `lora_init.set_adapter`)."""
        sd, _, folder = self._checkpoint_lora
        set_adapter(self.root, sd, folder)

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
        if stage.fused_loss and self.fsdp is None and fusable_head(self.model):
            # the final hidden states come out as `logits` (the model's own call: DDP's hooks stay), and the
            # loss is taken over row chunks through the frozen output embedding (losses.py); a trained output
            # embedding (trainable: [full]) or FSDP's sharded one take the model's own loss
            with lm_head_bypassed(self.model) as weight:
                hidden = model(input_ids=batch, use_cache=False).logits
            with self.accelerator.autocast():  # the head's products in the autocast dtype, as inside the model
                return next_token_loss(hidden, weight, batch)
        out = model(input_ids=batch, labels=batch, use_cache=False)
        return out.loss

    @contextlib.contextmanager
    def _objective(self, stage: Stage):
        """The stage's loss hooks for the duration of the stage: the attention-transfer recorder (yielded, else
        None) and the recomputation of the patched attentions in the backward (`attention_checkpointing`)."""
        from ..patcher import is_patched, patch_context

        ctx = patch_context(self.model) if is_patched(self.model) else None
        if ctx is not None:  # whole layers recomputed (gradient_checkpointing) recompute their attention anyway
            ctx.recompute = attention_recomputed(stage, self.accelerator.device.type) and not stage.gradient_checkpointing
        try:
            if stage.objective != "attention_transfer":
                yield None
                return
            from .transfer import attention_transfer

            with attention_transfer(self.model, teacher_forcing=stage.teacher_forcing) as tr:
                yield tr
        finally:
            if ctx is not None:
                ctx.recompute = False

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
    def run(self) -> dict[str, Any]:
        r = self.recipe
        if r.data.text:  # a missing or binary text source is refused before anything is written or loaded
            text_files(r.data.text)
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        self.accelerator.wait_for_everyone()
        ckpt, state, saved_logs = None, None, []
        if self.resume:
            ckpt = self.latest_checkpoint()
            if ckpt is None:
                self._log(f"--resume: no checkpoint under {self._ckpt_root()}; starting from the beginning")
            else:
                state = self.read_checkpoint(ckpt)
                saved_logs = self._saved_logs(ckpt, state)
                self._log(f"resuming from {ckpt} (stage {r.stages[state['stage']].name}, step {state['step']})")
        elif self._ckpt_root().exists() and any(self._ckpt_root().iterdir()):  # every process stops
            raise CheckpointError(
                f"{self._ckpt_root()} already holds checkpoints; pass --resume to continue that run, "
                "or choose another --output directory"
            )
        given = self._given_model[0]
        config = getattr(given, "config", None) if given is not None else peek_config(r.model)
        if config is not None:
            self.make_plan(config)  # before the load: a run too large for this machine stops here
        self.load()
        if self.plan is None:
            self.make_plan(self.model.config)
        self.load_data()
        for si, stage in enumerate(r.stages):
            if self.stop_after is not None and si > self.stop_after:
                break
            log = StageLog(
                name=stage.name, objective=stage.objective, trainable=list(stage.trainable or []), steps=stage.steps,
                seq_len=stage.seq_len, batch_size=stage.batch_size, grad_accum=stage.grad_accum, lr=stage.lr,
            )
            start, this_ckpt = 0, None
            if state is not None and si <= state["stage"]:
                if si < len(saved_logs):
                    log = saved_logs[si]
                if si < state["stage"] or state["completed"]:
                    # finished before the interruption: redo its structural changes (LoRA) only
                    self.setup_stage(stage)
                    self.stage_logs.append(log)
                    if si == state["stage"]:
                        self.load_trained_state(ckpt)
                        # the RNG as the stage left it: what the next stage's set-up (LoRA's initialisation) draws
                        # from in a run that was not interrupted
                        self.load_rng_state(ckpt)
                    continue
                start, this_ckpt = state["step"], ckpt
                log.resumed_from_step = start
            self.stage_logs.append(log)
            self.run_stage(si, stage, start, this_ckpt, log)
        self.accelerator.wait_for_everyone()
        self._restore_frozen()  # the model as loaded again (plus what the stages trained), saved or handed back
        summary = self.summary()
        stopped = self.stop_after is not None and self.stop_after < len(r.stages) - 1
        if stopped:
            summary["stopped_after"] = r.stages[self.stop_after].name
            self._log(f"stopped after stage {summary['stopped_after']} (its checkpoint is in {self._ckpt_root()}); "
                      "run the same command with --resume to continue")
        if self.is_main:
            if not stopped:
                self.save_outputs()
            write_text(self.out / LOG_FILE, json.dumps(summary, indent=1) + "\n")
            if self.results:
                write_results(self.results, summary)
        self.accelerator.wait_for_everyone()
        return summary

    def _saved_logs(self, ckpt: Path, state: dict[str, Any]) -> list[StageLog]:
        """The stage logs of a checkpoint's state; an entry that is not a stage log is a CheckpointError."""
        from .resume import STATE_FILE, redo

        logs = []
        for i, entry in enumerate(state["logs"]):
            try:
                logs.append(StageLog(**entry))
            except TypeError as e:
                raise CheckpointError(f"{ckpt / STATE_FILE}: \"logs\"[{i}] is not a stage log ({e}); {redo(ckpt)}") from None
        return logs

    def _weights_source(self) -> list[str]:
        """Where the patched layers' weights came from when the run started (the packaged asset `checkpoint: auto`
        found, a checkpoint path, fresh feature maps), as the methods that load weights record it."""
        from ..patcher import is_patched, patched_modules

        model = getattr(self, "model", None)
        if model is None or not is_patched(model):
            return []
        return sorted({m.weights_source for m in patched_modules(model).values() if hasattr(m, "weights_source")})

    def summary(self) -> dict[str, Any]:
        r = self.recipe
        return {
            **result_header(device=self.accelerator.device, world=self.world, command=self.command),
            "model": r.model,
            "method": r.method,
            "method_config": r.method_config,
            "weights_source": self._weights_source(),
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
        from ..methods.lola.weights import export_lolcats_checkpoint

        return Path(export_lolcats_checkpoint(self.model, str(path)))

    def save_outputs(self) -> None:
        """trainable/ (method weights + adapter), recipe.yaml, and model/ (save_patched, LoRA merged). Each folder is
        written beside its place and renamed into it when complete (checkpoint.replacing_folder): a run killed here
        leaves the previous folders whole, and --resume writes them again."""
        import yaml

        from ..checkpoint import ADAPTER_DIR, replacing_folder, write_patch
        from ..patcher import is_patched, method_state_dict, patch_groups, save_patched

        write_text(self.out / "recipe.yaml", yaml.safe_dump(self.recipe.to_dict(), sort_keys=False))
        with replacing_folder(self.out / TRAINABLE_DIR) as tdir:
            if self._is_peft():
                self.root.save_pretrained(str(tdir / ADAPTER_DIR))
            if self.recipe.output.lolcats_export:
                self.export_lolcats(tdir / "lolcats" / "model.pt")
            if is_patched(self.model):  # last: the record lists the folder's other files
                write_patch(tdir, [g.to_record() for g in patch_groups(self.model)], method_state_dict(self.model))
        if self.recipe.output.save_model:
            if self._is_peft():
                self.root = self.root.merge_and_unload()
                self.model = self.root
            mdir = self.out / MODEL_DIR
            if is_patched(self.model):
                save_patched(self.model, mdir, tokenizer=self.tokenizer)
            else:
                with replacing_folder(mdir) as work:
                    self.model.save_pretrained(str(work))
                    self.tokenizer.save_pretrained(str(work))


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
    stop_after: str | None = None,
    memory_check: bool = True,
    log_seconds: float = 30.0,
) -> dict[str, Any]:
    """Runs every stage of `recipe` and writes the outputs; returns the training log (also in train_log.json).
    `stop_after` (a stage's name or index) ends the run once that stage is done and checkpointed, before the outputs
    are written: the same call with `resume=True` continues with the next stage. Before anything loads where the model's
    config can be read without it, the run's estimate is printed (`plan.py`) and a run whose estimated peak memory
    exceeds what the device has available raises MemoryBudgetError (`memory_check=False`: run anyway). Without a
    terminal, progress is a line per log point and at least every `log_seconds`, with the stage's and the run's ETA."""
    out = output_dir or recipe.output.dir
    if not out:
        raise ConfigError("no output directory; pass --output DIR (or set output.dir in the recipe)")
    return Finetuner(
        recipe, out, resume=resume, results=results, command=command, progress=progress, model=model,
        tokenizer=tokenizer, stop_after=stop_after, memory_check=memory_check, log_seconds=log_seconds,
    ).run()


def _stage_index(recipe: Recipe, stage: str | int | None) -> int | None:
    """The index of the stage named (or numbered) `stage`; None for None."""
    if stage is None:
        return None
    names = [s.name for s in recipe.stages]
    if str(stage) in names:
        return names.index(str(stage))
    if str(stage).isdigit() and int(stage) < len(names):
        return int(stage)
    raise ConfigError(f"stop after {stage!r}: the recipe has no such stage; its stages are {', '.join(names)} "
                      f"(or their indices 0-{len(names) - 1})")
