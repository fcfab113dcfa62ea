"""`longctx finetune` under `accelerate launch --num_processes 2` on CPU (gloo), as data parallel (DDP) and as
FSDP2: both ranks step on their half of each global batch, the losses and weights match a single-process run
with the same global batch, only rank 0 writes checkpoints, outputs and results, and (FSDP) `--resume` continues
from a checkpoint to the same weights."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_train import recipe_dict, temp_method, text_file, tiny_dir, write_recipe  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread_module")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# Runs `longctx_patch.cli.finetune_cmd` in each launched process with an audit hook that records every write-like
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
        # a rename writes its destination too (folders are written beside their place, then renamed into it)
        ends = args[:2] if event in ("os.rename", "os.replace") else args[:1]
        for end in ends:
            if isinstance(end, (str, bytes, os.PathLike)) and under(end):
                events.append([event, os.fsdecode(end)])

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
    runpy.run_module("longctx_patch.cli.finetune_cmd", run_name="__main__")
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


def _launch(tmp_path: Path, rec: Path, out: Path, res: Path, launch_args: list[str], tag: str, *extra: str) -> dict:
    """Runs the recipe in 2 processes under the audit worker; returns {rank: audit log}."""
    audit = tmp_path / f"audit-{tag}"
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    res.parent.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
        AUDIT_WATCH=os.pathsep.join([str(out), str(res.parent)]), AUDIT_LOG=str(audit),
        AUDIT_REPO=str(REPO), AUDIT_TESTS=str(HERE), PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]),
    )
    cmd = _accelerate() + [
        "launch", *launch_args, "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(worker),
        str(rec), "--output", str(out), "--results", str(res), "-q", *extra,
    ]
    p = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return {r: json.loads(Path(f"{audit}.{r}").read_text()) for r in (0, 1)}


def _check_against_one(d: dict, one: dict, one_dir: Path, out: Path, res: Path, logs: dict, tmp_path: Path) -> dict:
    """The 2-process run in `out` followed the single-process run `one`; only rank 0 wrote."""
    from safetensors.torch import load_file

    two = json.loads((out / "train_log.json").read_text())
    assert two["world_size"] == 2 and json.loads(res.read_text())["world_size"] == 2
    for a, b in zip(two["stages"], one["stages"]):
        assert a["steps_done"] == b["steps_done"] and a["tokens"] == b["tokens"]
        assert a["grad_accum"] == b["grad_accum"]
        # relative: the attention-transfer losses of the tiny model are ~1e-7
        la, lb = torch.tensor(a["loss"])[:, 1], torch.tensor(b["loss"])[:, 1]
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-12)
        ea, eb = torch.tensor(a["final_eval_loss"]), torch.tensor(b["final_eval_loss"])
        torch.testing.assert_close(ea, eb, rtol=1e-4, atol=1e-12)
    for f in ("longctx_patch.safetensors", "adapter/adapter_model.safetensors"):
        wa, wb = load_file(str(out / "trainable" / f)), load_file(str(one_dir / "trainable" / f))
        assert wa.keys() == wb.keys()
        for k in wa:
            assert wa[k].shape == wb[k].shape and wa[k].dtype == wb[k].dtype, k  # full tensors, not shards
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)

    # both ranks ran every micro-step on half of the global batch (plus the eval batches)
    steps = sum(s["steps"] * s.get("grad_accum", 1) for s in d["stages"])
    for r in (0, 1):
        assert len(logs[r]["rows"]) >= steps and set(logs[r]["rows"]) == {2}
    assert len(logs[0]["rows"]) == len(logs[1]["rows"])
    # only rank 0 touched the output folder and the results file
    assert logs[1]["events"] == [], logs[1]["events"][:5]
    written = {Path(e[1]).relative_to(tmp_path).parts[:2] for e in logs[0]["events"]}
    assert (out.name, "checkpoints") in written and (out.name, "trainable") in written
    assert (res.parent.name, res.name) in written
    ck = sorted(p.name for p in (out / "checkpoints").iterdir())
    want = [
        f"stage{i}-step{n:07d}"
        for i, st in enumerate(d["stages"])
        for n in range(1, st["steps"] + 1)
        if n == st["steps"] or (st.get("save_every") and n % st["save_every"] == 0)
    ]
    assert ck == want
    return two


def _dist_recipe(model_dir, text) -> dict:
    return recipe_dict(
        model_dir, text,
        transfer={"steps": 3, "eval_every": 0, "save_every": 2},
        lora={"steps": 3, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "save_every": 2, "grad_accum": 2},
    )


def test_two_processes_match_one(tiny_dir, text_file, temp_method, tmp_path):
    from longctx_patch.train import Finetuner, recipe_from_dict

    d = _dist_recipe(tiny_dir, text_file)
    rec = write_recipe(tmp_path / "r.yaml", d)
    # single process, same global batch (4 sequences per step)
    one = Finetuner(recipe_from_dict(d), tmp_path / "one", progress=False).run()

    out, res = tmp_path / "two", tmp_path / "results" / "two.json"
    logs = _launch(tmp_path, rec, out, res, ["--multi_gpu"], "ddp")
    two = _check_against_one(d, one, tmp_path / "one", out, res, logs, tmp_path)
    assert two["parallel"] == "ddp"


# FSDP2 as a user passes it to accelerate launch (the same flags as on GPUs); cpu_ram_efficient_loading is
# accelerate's default (true) and is overridden by the runner, which loads the whole model in every process.
FSDP_ARGS = [
    "--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer", "--fsdp_reshard_after_forward", "true",
    "--fsdp_state_dict_type", "FULL_STATE_DICT",
]


def test_fsdp_two_processes_match_one_and_resume(tiny_dir, text_file, temp_method, tmp_path):
    """FSDP2 (fully_shard of each decoder layer + the root) on CPU/gloo: the attention-transfer stage (frozen
    model, trained feature parameters, teacher hooks) and the LoRA stage (grad_accum 2) follow the
    single-process run; the saved method weights and adapter are full tensors equal to the single-process
    ones; a run resumed from a mid-LoRA checkpoint (sharded optimizer state reloaded) ends with the same
    weights as the uninterrupted one."""
    from safetensors.torch import load_file

    from longctx_patch.train import Finetuner, recipe_from_dict

    d = _dist_recipe(tiny_dir, text_file)
    rec = write_recipe(tmp_path / "r.yaml", d)
    one = Finetuner(recipe_from_dict(d), tmp_path / "one", progress=False).run()

    out, res = tmp_path / "fsdp", tmp_path / "results" / "fsdp.json"
    logs = _launch(tmp_path, rec, out, res, FSDP_ARGS, "fsdp")
    two = _check_against_one(d, one, tmp_path / "one", out, res, logs, tmp_path)
    assert two["parallel"] == "fsdp2"
    # the checkpoints hold full tensors too (same names and shapes as a single process writes)
    ck = load_file(str(out / "checkpoints" / "stage1-step0000003" / "trained.safetensors"))
    ck1 = load_file(str(tmp_path / "one" / "checkpoints" / "stage1-step0000003" / "trained.safetensors"))
    assert ck.keys() == ck1.keys() and all(ck[k].shape == ck1[k].shape for k in ck)
    opt = torch.load(out / "checkpoints" / "stage1-step0000002" / "optimizer.pt", weights_only=True)
    opt1 = torch.load(tmp_path / "one" / "checkpoints" / "stage1-step0000002" / "optimizer.pt", weights_only=True)
    assert opt["param_groups"] == opt1["param_groups"] and opt["state"].keys() == opt1["state"].keys()
    for i, st in opt["state"].items():
        for k, v in st.items():
            assert type(v) is torch.Tensor and v.shape == opt1["state"][i][k].shape, (i, k)
            torch.testing.assert_close(v, opt1["state"][i][k], rtol=1e-3, atol=1e-6)

    # interrupted after stage1 step 2: drop what came later and resume under FSDP
    before = {f: load_file(str(out / "trainable" / f)) for f in ("longctx_patch.safetensors", "adapter/adapter_model.safetensors")}
    shutil.rmtree(out / "checkpoints" / "stage1-step0000003")
    shutil.rmtree(out / "trainable")
    (out / "train_log.json").unlink()
    logs = _launch(tmp_path, rec, out, res, FSDP_ARGS, "resume", "--resume")
    again = json.loads((out / "train_log.json").read_text())
    assert again["stages"][1]["resumed_from_step"] == 2 and again["stages"][1]["steps_done"] == 3
    assert again["stages"][1]["loss"] == two["stages"][1]["loss"][:2] + again["stages"][1]["loss"][2:]
    torch.testing.assert_close(
        torch.tensor(again["stages"][1]["loss"])[:, 1], torch.tensor(two["stages"][1]["loss"])[:, 1], rtol=1e-5, atol=1e-7
    )
    for f, wb in before.items():
        wa = load_file(str(out / "trainable" / f))
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-7)
    assert logs[1]["events"] == [], logs[1]["events"][:5]


def test_fsdp_backward_through_frozen_layers_and_full_stage(tiny_dir, text_file, temp_method, tmp_path):
    """FSDP2 where the backward of attention transfer needs the frozen (sharded) weights, which FSDP's hooks on
    the layers' outputs do not gather there: no teacher forcing (gradients cross the layers) with gradient
    checkpointing (layers recomputed); then a full fine-tune stage whose embeddings/head live in the root
    unit, checkpointed after an evaluation (which leaves the root unit gathered). Both follow one process."""
    from longctx_patch.train import Finetuner, recipe_from_dict

    d = _dist_recipe(tiny_dir, text_file)
    d["stages"][0].update(teacher_forcing=False, gradient_checkpointing=True)
    d["stages"].append(dict(
        d["stages"][1], name="full", trainable=["full"], lora=None, steps=2, grad_accum=1, save_every=0, lr=1e-3,
    ))
    d["output"]["save_model"] = False
    rec = write_recipe(tmp_path / "r.yaml", d)
    one = Finetuner(recipe_from_dict(d), tmp_path / "one", progress=False).run()
    out, res = tmp_path / "fsdp", tmp_path / "results" / "fsdp.json"
    logs = _launch(tmp_path, rec, out, res, FSDP_ARGS, "fsdp")
    _check_against_one(d, one, tmp_path / "one", out, res, logs, tmp_path)
    # the full stage trained every weight: the checkpoint holds them all, full-size, close to one process's
    from safetensors.torch import load_file

    last = "stage2-step0000002/trained.safetensors"
    ck, ck1 = load_file(str(out / "checkpoints" / last)), load_file(str(tmp_path / "one" / "checkpoints" / last))
    assert ck.keys() == ck1.keys() and "base_model.model.lm_head.weight" in ck
    for k in ck:
        torch.testing.assert_close(ck[k], ck1[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("env", "stage0", "match"),
    [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, {}, "--fsdp_version 2"),
        ({"ACCELERATE_USE_FSDP": "true"}, {}, "--fsdp_version 2"),  # accelerate's default version is 1
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, {"trainable": ["method", "lora"]}, "trainable: \\[method\\]"),
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, {}, "DeepSpeed mode is not supported"),
    ],
)
def test_unsupported_launch_modes_are_refused(tiny_dir, text_file, temp_method, tmp_path, monkeypatch, env, stage0, match):
    """Refused before the Accelerator is built (on CPU accelerate would silently fall back to data parallel)."""
    from longctx_patch.errors import ConfigError
    from longctx_patch.train import Finetuner, recipe_from_dict

    d = _dist_recipe(tiny_dir, text_file)
    d["stages"][0].update(stage0)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if "FSDP_VERSION" not in env:
        monkeypatch.delenv("FSDP_VERSION", raising=False)
    with pytest.raises(ConfigError, match=match):
        Finetuner(recipe_from_dict(d), tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()
