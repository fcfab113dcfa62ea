"""`longctx finetune` under `accelerate launch --num_processes 2` on CPU (gloo): both ranks step on their
half of each global batch, the losses and weights match a single-process run with the same global batch,
and only rank 0 writes checkpoints, outputs and results."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from test_train import _one_thread, recipe_dict, temp_method, text_file, tiny_dir, write_recipe  # noqa: F401

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# Runs `cli.finetune_cmd` in each launched process with an audit hook that records every write-like
# file-system event under the watched folders, and the rows of every local batch the loss sees.
WORKER = r'''
import os, sys, json, runpy
rank = int(os.environ.get("RANK", "0"))
watch = [os.path.abspath(p) for p in os.environ["AUDIT_WATCH"].split(os.pathsep)]
events = []
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def under(p):
    try:
        p = os.path.abspath(os.fsdecode(p))
    except TypeError:
        return False
    return any(p == w or p.startswith(w + os.sep) for w in watch)

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        if isinstance(path, (str, bytes, os.PathLike)) and (flags or 0) & WRITE and under(path):
            events.append([event, os.fsdecode(path)])
    elif event in ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.replace", "shutil.copyfile"):
        if args and isinstance(args[0], (str, bytes, os.PathLike)) and under(args[0]):
            events.append([event, os.fsdecode(args[0])])

sys.path[:0] = [os.environ["AUDIT_REPO"], os.environ["AUDIT_TESTS"]]
import test_train
test_train.register_temp_method()
from longctx_patch.train import runner
rows = []
orig = runner.Finetuner._forward_loss
def counted(self, model, batch, stage, transfer):
    rows.append(int(batch.shape[0]))
    return orig(self, model, batch, stage, transfer)
runner.Finetuner._forward_loss = counted
sys.addaudithook(hook)
sys.argv = ["longctx finetune"] + sys.argv[1:]
code = 0
try:
    runpy.run_module("cli.finetune_cmd", run_name="__main__")
except SystemExit as e:
    code = e.code or 0
finally:
    with open(os.environ["AUDIT_LOG"] + f".{rank}", "x") as f:  # outside the watched folders
        json.dump({"rank": rank, "events": events, "rows": rows}, f)
sys.exit(code)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accelerate() -> list[str]:
    exe = Path(sys.executable).parent / "accelerate"
    return [str(exe)] if exe.exists() else [shutil.which("accelerate") or "accelerate"]


def test_two_processes_match_one(tiny_dir, text_file, temp_method, tmp_path):
    from safetensors.torch import load_file

    from longctx_patch.train import Finetuner, recipe_from_dict

    d = recipe_dict(
        tiny_dir, text_file,
        transfer={"steps": 3, "eval_every": 0, "save_every": 2},
        lora={"steps": 3, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "save_every": 2, "grad_accum": 2},
    )
    rec = write_recipe(tmp_path / "r.yaml", d)

    # single process, same global batch (4 sequences per step)
    one = Finetuner(recipe_from_dict(d), tmp_path / "one", progress=False).run()

    out, res, audit = tmp_path / "two", tmp_path / "results" / "two.json", tmp_path / "audit"
    (tmp_path / "results").mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
        AUDIT_WATCH=os.pathsep.join([str(out), str(tmp_path / "results")]), AUDIT_LOG=str(audit),
        AUDIT_REPO=str(REPO), AUDIT_TESTS=str(HERE), PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]),
    )
    cmd = _accelerate() + [
        "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(worker),
        str(rec), "--output", str(out), "--results", str(res), "-q",
    ]
    p = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    two = json.loads((out / "train_log.json").read_text())
    assert two["world_size"] == 2 and json.loads(res.read_text())["world_size"] == 2
    for a, b in zip(two["stages"], one["stages"]):
        assert a["steps_done"] == b["steps_done"] and a["tokens"] == b["tokens"]
        assert a["grad_accum"] == b["grad_accum"]
        la, lb = torch.tensor(a["loss"])[:, 1], torch.tensor(b["loss"])[:, 1]
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.tensor(a["final_eval_loss"]), torch.tensor(b["final_eval_loss"]), rtol=1e-4, atol=1e-6)
    for f in ("longctx_patch.safetensors", "adapter/adapter_model.safetensors"):
        wa, wb = load_file(str(out / "trainable" / f)), load_file(str(tmp_path / "one" / "trainable" / f))
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)

    logs = {r: json.loads(Path(f"{audit}.{r}").read_text()) for r in (0, 1)}
    # both ranks ran every micro-step on half of the global batch (plus the eval batches)
    steps = sum(s["steps"] * s.get("grad_accum", 1) for s in d["stages"])
    for r in (0, 1):
        assert len(logs[r]["rows"]) >= steps and set(logs[r]["rows"]) == {2}
    assert len(logs[0]["rows"]) == len(logs[1]["rows"])
    # only rank 0 touched the output folder and the results file
    assert logs[1]["events"] == [], logs[1]["events"][:5]
    written = {Path(e[1]).relative_to(tmp_path).parts[:2] for e in logs[0]["events"]}
    assert ("two", "checkpoints") in written and ("two", "trainable") in written and ("results", "two.json") in written
    ck = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ck == ["stage0-step0000002", "stage0-step0000003", "stage1-step0000002", "stage1-step0000003"]
