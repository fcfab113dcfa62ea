"""MuSe fidelity on real Q/K/V: relative error of the attention output vs exact, per layer of SmolLM2-135M.

Captures post-rotary Q/K/V of every layer on a real text (the essays of --data DIR/pg_essays, or of
$LONGCTX_DATA/pg_essays), then runs
the MuSe reference for each configuration of a small grid. CPU is enough (the Triton kernels compute the
same function from the same plan; tests/test_muse_kernels.py checks that).

    python -m benchmarks.quality.bench_muse_fidelity --seq-len 2048 --out benchmarks/results/muse/fidelity-smollm2-135m-2k-cpu.json
    python3 -m benchmarks.quality.bench_muse_fidelity --device cuda --backend auto --model /tmp/smollm2.gguf \
        --data .device-data --seq-len 65536 --grid '[{"block_size": 128}]'      # long contexts: Triton on a GPU
    (--dtype bfloat16: MuSe in bf16, as a bf16 model runs it, against the fp32 exact output; a row `{"exact":
    true}` gives the error of the bf16 rounding alone)

A grid row that names a `far_field` runs the method's defaults for it in every option it leaves out (the JSON records
the whole configuration). A grid row `{"method": "moba", "block_size": 512, "top_k": 8}` runs MoBA instead (`moba_attention`, block gating),
for the comparison at matched sparsity (`--matched KEYS`: MoBA, `cells` and `tilted` at about KEYS exactly attended
keys per query, the settings of benchmarks/ops/bench_moba.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

import longctx_patch
from benchmarks.shared import data_dir, device_token, model_token, result_file
from longctx_patch.evals.common import size_label
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.kernels.moba import moba_attention
from longctx_patch.kernels.muse import MuseOptions, muse_attention
from longctx_patch.kernels.softmax import softmax_attention
from longctx_patch.methods.muse import FAR_FIELD_DEFAULTS, MuseConfig

GRID = [
    dict(block_size=64, q_clusters=4, k_clusters=4, topk_blocks=0, topk_clusters=0),
    dict(block_size=64, q_clusters=4, k_clusters=4, topk_blocks=2, topk_clusters=4),
    dict(block_size=64, q_clusters=8, k_clusters=4, topk_blocks=2, topk_clusters=4),
    dict(block_size=64, q_clusters=16, k_clusters=4, topk_blocks=2, topk_clusters=4),
    dict(block_size=128, q_clusters=4, k_clusters=4, topk_blocks=2, topk_clusters=4),
    dict(block_size=128, q_clusters=8, k_clusters=4, topk_blocks=2, topk_clusters=4),
    dict(block_size=128, q_clusters=16, k_clusters=4, topk_blocks=2, topk_clusters=4),
    dict(block_size=128, q_clusters=16, k_clusters=4, topk_blocks=4, topk_clusters=8),
]


def real_text(root: Path, chars: int) -> str:
    d = root / "pg_essays"
    parts, n = [], 0
    for f in sorted(d.glob("*.txt")):
        if f.name.startswith("SOURCE"):
            continue
        t = f.read_text(errors="ignore")
        parts.append(t)
        n += len(t)
        if n >= chars:
            break
    return "\n\n".join(parts)


def capture_qkv(model, ids):
    """[(q, k, v)] per layer (post-rotary, [1, H, S, D], float32) and the attention scale, captured by the
    approx evaluation's hook on an exact-patched model."""
    from longctx_patch.evals.approx import capture

    got = capture(model, ids)
    return [tuple(t.float() for t in got[i][:3]) for i in sorted(got)], float(model.model.layers[0].self_attn.scaling)


def real_qkv(model_name: str, data: str, seq_len: int, device: str):
    """Load `model_name` in fp32 on `device`, tokenise the first `seq_len` tokens of the essays under `data` and
    capture every layer's post-rotary Q/K/V: ([(q, k, v)] per layer, attention scale). Exits if the text is short."""
    model, tok = longctx_patch.load_model(model_name, dtype="float32", device=device)
    ids = tok(real_text(Path(data), seq_len * 8), return_tensors="pt").input_ids[:, :seq_len]
    if ids.shape[1] < seq_len:
        sys.exit(f"the text under {data} has only {ids.shape[1]} tokens; --seq-len asks for {seq_len}")
    return capture_qkv(model, ids.to(model.device))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--data", default=None, help="folder holding pg_essays/ (default $LONGCTX_DATA)")
    ap.add_argument("--layers", default="all", help="'all' or a comma list")
    ap.add_argument("--out", default=None, help="file (default benchmarks/results/muse/fidelity-<model>-<seq>-<device>.json)")
    ap.add_argument("--grid", default=None, help="JSON list of configs (default: the built-in GRID); a config with "
                    "\"method\": \"moba\" runs MoBA with the rest as its options")
    ap.add_argument("--matched", type=int, default=None, metavar="KEYS",
                    help="instead of --grid: MoBA, MuSe cells and MuSe tilted at about KEYS exactly attended keys per "
                         "query (benchmarks/ops/bench_moba.py's settings), each row with its exact keys per query")
    ap.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or directory (load_model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the dtype MuSe runs in (the captured Q/K/V are rounded to it); the exact reference stays "
                         "fp32. bfloat16 adds a row `exact in bfloat16`: the error of rounding alone")
    ap.add_argument("--backend", default="torch",
                    help="MuSe backend: torch (the dense reference: CPU, a few thousand tokens) or auto/triton (CUDA)")
    args = ap.parse_args()
    if args.matched and args.grid:
        ap.error("--matched and --grid are alternatives: give one")
    data = data_dir(args.data, need="pg_essays")
    out = result_file("muse", f"fidelity-{model_token(args.model)}-{size_label(args.seq_len)}"
                      f"{'' if args.dtype == 'float32' else '-bf16'}-{device_token(args.device)}.json", args.out)
    torch.manual_seed(0)
    qkv, scale = real_qkv(args.model, data, args.seq_len, args.device)
    layers = range(len(qkv)) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    rows, refs = [], {}  # exact outputs, computed once per layer
    commit = git_commit()  # $LONGCTX_COMMIT on a copy of the tree, else git
    device = device_description(qkv[0][0].device)
    dt = getattr(torch, args.dtype)
    grid = json.loads(args.grid) if args.grid else GRID
    if args.matched:
        from benchmarks.ops.bench_moba import configs

        grid = [dict(cfg, exact_keys_per_query=keys, **({"method": "moba"} if name == "moba" else {}))
                for name, (cfg, keys) in configs(args.matched).items()]
    if dt != torch.float32:
        grid = [{"exact": True}] + grid
    for cfg in grid:
        if cfg.get("far_field") in FAR_FIELD_DEFAULTS:  # what the row leaves out: the method's defaults (recorded)
            defaults = MuseConfig(far_field=cfg["far_field"]).kernel_kwargs()
            defaults.pop("backend")
            cfg.update({k_: v_ for k_, v_ in defaults.items() if k_ not in cfg})
        errs, t0 = [], time.time()
        for i in layers:
            q, k, v = qkv[i]
            if i not in refs:
                refs[i] = softmax_attention(q, k, v, scale=scale)
            ref = refs[i]
            q, k, v = (t.to(dt) for t in (q, k, v))
            opts = {k_: v_ for k_, v_ in cfg.items() if k_ not in ("method", "exact_keys_per_query")}
            if cfg.get("exact"):
                o = softmax_attention(q, k, v, scale=scale)
            elif cfg.get("method") == "moba":
                o = moba_attention(q, k, v, scale=scale, backend=args.backend, **opts)
            else:
                o = muse_attention(q, k, v, scale=scale, options=MuseOptions(**{"kmeans_iters": 2, **opts}),
                                   backend=args.backend)
            errs.append(((o.float() - ref).norm() / ref.norm()).item())
        row = dict(config=cfg, mean_rel_err=sum(errs) / len(errs), max_rel_err=max(errs), per_layer=errs)
        rows.append(row)
        print(f"{json.dumps(cfg):110s} mean {row['mean_rel_err']:.4f} max {row['max_rel_err']:.4f} "
              f"({time.time() - t0:.0f}s)", flush=True)
        res = dict(task="muse-fidelity", device=device, backend=args.backend, dtype=args.dtype,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   commit=commit, command="python -m benchmarks.quality.bench_muse_fidelity " + " ".join(sys.argv[1:]),
                   layers=list(layers), model=args.model, seq_len=args.seq_len, text="pg_essays",
                   metric="||o - o_exact|| / ||o_exact||", results=rows)
        out.write_text(json.dumps(res, indent=1))  # after every configuration: a time limit loses none


if __name__ == "__main__":
    main()
