"""Resumable checkpoints of a fine-tune run (see runner.py's docstring for the folder layout).

A checkpoint `checkpoints/stage{i}-step{n}` is written whole or not at all: into `stage{i}-step{n}.tmp`, every file
flushed to disk, then renamed (older checkpoints are renamed to `*.old` before they are removed). A run killed at any
point resumes from the newest complete checkpoint, to the weights an uninterrupted run ends with (tests/
test_interruptions.py). Reading one, any damaged or malformed file is a CheckpointError naming it and saying what to
do (delete that checkpoint: --resume then continues from the one before it, or from the start).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import dtype_name, fsync_path, fsync_tree, read_weights_file, same_kind
from ..errors import CheckpointError


CKPT_DIR = "checkpoints"
OPTIMIZER_FILE = "optimizer.pt"  # tensors and plain values only: read with torch.load(weights_only=True)
SCHEDULER_FILE = "scheduler.json"
RNG_FILE = "rng.json"  # one entry per process
STATE_FILE = "state.json"
TRAINED_FILE = "trained.safetensors"
CKPT_NAME = re.compile(r"stage(\d+)-step(\d+)")  # a complete checkpoint; `.tmp` / `.old` suffixes are not


def redo(d: Path) -> str:
    """What to do with a damaged checkpoint `d`, for the messages."""
    return (f"delete {d} and run the same command with --resume (it continues from the checkpoint before it, or from "
            "the start), or start without --resume")


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_state(d: Path, stages: int | None = None) -> dict[str, Any]:
    """The state.json of checkpoint `d`, checked (an object with a stage index below `stages`, a step count, a
    completed flag, a list of stage logs): anything else is a CheckpointError naming the file."""
    p = d / STATE_FILE
    try:
        state = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {d} lacks {STATE_FILE}; {redo(d)}") from None
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{p} cannot be read ({type(e).__name__}: {msg}); {redo(d)}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{p} holds {json.dumps(state)[:40]}, not the object a checkpoint writes; {redo(d)}")
    lacking = [k for k in ("stage", "step", "completed", "logs") if k not in state]
    if lacking:
        raise CheckpointError(f"{p} lacks {', '.join(json.dumps(k) for k in lacking)}; {redo(d)}")
    problem = None
    if not _count(state["stage"]):
        problem = f"\"stage\" is {state['stage']!r}, not a stage index (0, 1, ...)"
    elif stages is not None and state["stage"] >= stages:
        problem = f"\"stage\" is {state['stage']}, but the recipe has {stages} stage{'s' if stages != 1 else ''}"
    elif not _count(state["step"]):
        problem = f"\"step\" is {state['step']!r}, not a step count"
    elif not isinstance(state["completed"], bool):
        problem = f"\"completed\" is {state['completed']!r}, not true or false"
    elif not isinstance(state["logs"], list) or not all(isinstance(x, dict) for x in state["logs"]):
        problem = f"\"logs\" is {json.dumps(state['logs'])[:40]}, not a list of stage logs"
    elif not isinstance(state.get("stage_name", ""), str):
        problem = f"\"stage_name\" is {state['stage_name']!r}, not a stage name"
    if problem:
        raise CheckpointError(f"{p}: {problem}; {redo(d)}")
    return state


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


class CheckpointMixin:
    """Resumable checkpoints of a `Finetuner` run: the trained tensors, the optimizer (tensors and plain values,
    read with torch.load(weights_only=True)), the scheduler and the RNG states as JSON."""

    def _ckpt_root(self) -> Path:
        return self.out / CKPT_DIR

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint (by the stage and step its name holds), or None. Folders of interrupted
        writes (`.tmp`) and of interrupted removals (`.old`) are not checkpoints."""
        root = self._ckpt_root()
        if not root.is_dir():
            return None
        found = [(tuple(int(x) for x in m.groups()), d) for d in root.iterdir()
                 if d.is_dir() and (m := CKPT_NAME.fullmatch(d.name))]
        return max(found)[1] if found else None

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

        # collectives: every process takes part (under FSDP they gather the full tensors)
        rng = gather_object([_rng_state()])
        trained, opt_state = self._named_trained(), self._optimizer_state(optimizer)
        if self.is_main:
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
            self._write_checkpoint(f"stage{si}-step{step:07d}", trained, opt_state, scheduler.state_dict(), rng, state)
            self._prune_checkpoints(keep)
        self.accelerator.wait_for_everyone()

    def _write_checkpoint(self, name: str, trained, opt_state, sched_state, rng, state) -> None:
        """checkpoints/NAME, whole or not at all: written into NAME.tmp, flushed to disk, renamed."""
        from safetensors.torch import save_file

        root = self._ckpt_root()
        root.mkdir(parents=True, exist_ok=True)
        for p in root.iterdir():  # what interrupted writes and removals left
            if p.is_dir() and p.suffix in (".tmp", ".old") and CKPT_NAME.fullmatch(p.stem):
                shutil.rmtree(p, ignore_errors=True)
        d = root / name
        tmp = d.with_name(name + ".tmp")
        tmp.mkdir()
        save_file(trained, str(tmp / TRAINED_FILE))
        # nothing here needs pickle to read back: tensors and plain values (torch.load(weights_only=True)),
        # the scheduler and the RNG states as JSON
        torch.save(opt_state, tmp / OPTIMIZER_FILE)
        (tmp / SCHEDULER_FILE).write_text(json.dumps(sched_state, allow_nan=True))
        (tmp / RNG_FILE).write_text(json.dumps(rng))
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        fsync_tree(tmp)
        if d.exists():  # the same step written again: the old one out of the way first
            d.rename(d.with_name(name + ".old"))
        tmp.rename(d)
        fsync_path(root)
        shutil.rmtree(d.with_name(name + ".old"), ignore_errors=True)

    def _prune_checkpoints(self, keep: int) -> None:
        """Keeps the `keep` newest checkpoints (0: all); each older one is renamed NAME.old (no longer a checkpoint)
        before it is removed, so an interruption never leaves a half-removed one that looks complete."""
        if keep <= 0:
            return
        root = self._ckpt_root()
        found = sorted((tuple(int(x) for x in m.groups()), p) for p in root.iterdir()
                       if p.is_dir() and (m := CKPT_NAME.fullmatch(p.name)))
        for _, old in found[:-keep]:
            gone = old.with_name(old.name + ".old")
            old.rename(gone)
            shutil.rmtree(gone, ignore_errors=True)

    def read_checkpoint(self, d: Path) -> dict[str, Any]:
        """The checked state of checkpoint `d` (`read_state`), written by this recipe."""
        state = read_state(d, len(self.recipe.stages))
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

    def load_rng_state(self, d: Path) -> int:
        """The RNG states checkpoint `d` saved, when as many processes wrote it as run now; returns how many did."""
        rng = self._read_ckpt_file(d, RNG_FILE)
        if not isinstance(rng, list):
            raise CheckpointError(f"checkpoint {d}: {RNG_FILE} does not hold the expected state; {redo(d)}")
        if len(rng) != self.world:
            return len(rng)
        try:
            _set_rng_state(rng[self.rank])
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {d}: {RNG_FILE} holds a malformed RNG state ({type(e).__name__}); "
                                  f"{redo(d)}") from None
        return len(rng)

    def load_resume_state(self, d: Path, optimizer, scheduler, start_step: int) -> None:
        """Optimizer, scheduler and RNG states of checkpoint `d` (the RNG reseeded when the number of processes
        changed)."""
        opt_sd = self._read_ckpt_file(d, OPTIMIZER_FILE)
        sched_sd = self._read_ckpt_file(d, SCHEDULER_FILE)
        if not (isinstance(opt_sd, dict) and {"state", "param_groups"} <= set(opt_sd)):
            raise CheckpointError(f"checkpoint {d}: {OPTIMIZER_FILE} is not an optimizer state dict; {redo(d)}")
        if not isinstance(sched_sd, dict):
            raise CheckpointError(f"checkpoint {d}: {SCHEDULER_FILE} does not hold the expected state; {redo(d)}")
        try:
            self._load_optimizer_state(optimizer, opt_sd)
            scheduler.load_state_dict(sched_sd)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(
                f"checkpoint {d}: the optimizer or scheduler state does not fit this stage ({type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); {redo(d)}"
            ) from None
        wrote = self.load_rng_state(d)
        if wrote != self.world:
            self._log(f"note: checkpoint written by {wrote} processes, resuming with {self.world}; RNG reseeded")
            torch.manual_seed(self.recipe.seed + 104729 * start_step + self.rank)

    def load_trained_state(self, d: Path) -> None:
        path = d / TRAINED_FILE
        if not path.exists():
            raise CheckpointError(f"checkpoint {d} lacks {TRAINED_FILE}; {redo(d)}")
        sd = read_weights_file(path, advice=redo(d))  # a damaged file or NaN: named, with what to do
        self._load_trained(sd, str(path), redo(d))

    def _load_trained(self, sd: dict[str, torch.Tensor], source: str, advice: str | None = None) -> None:
        params = dict(self.root.named_parameters())
        then = f"; {advice}" if advice else ""
        unknown = sorted(set(sd) - set(params))
        if unknown:
            raise CheckpointError(f"{source} holds parameters the model lacks: {unknown[:5]}{then}")
        for n, t in sd.items():
            if params[n].shape != t.shape:
                raise CheckpointError(f"{source}: {n} has shape {tuple(t.shape)}, model {tuple(params[n].shape)}{then}")
            if not same_kind(t, params[n]):
                raise CheckpointError(f"{source}: holds {n} as {dtype_name(t.dtype)} where the model has "
                                      f"{dtype_name(params[n].dtype)}{then}")
        with torch.no_grad():
            for n, t in sd.items():
                params[n].copy_(t.to(params[n].device, params[n].dtype))
                self.trained[id(params[n])] = params[n]

    # ------------------------------------------------------------------------------------------- FSDP
