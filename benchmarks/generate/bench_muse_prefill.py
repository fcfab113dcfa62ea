"""Model-level prefill of a Llama-3.2-1B-shaped model with random weights: unpatched (sdpa) vs MuSe.

The shape of the MuSe issue's model-level target (16 layers, hidden 2048, 32 query / 8 kv heads, head_dim 64,
MLP 8192, vocabulary 128256), random weights (no checkpoint is needed for a timing), bf16, batch 1. Timed by
`longctx_patch.evals.speed.run_speed` (median of `--repeats` prefills, last-position logits as in
`generate()`); writes NAME.json and NAME.png.

    python3 -m benchmarks.generate.bench_muse_prefill --contexts 16k,64k --out-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.shared import device_token, llama_1b_shaped, results_dir
from longctx_patch.evals.common import MethodRun, parse_sizes
from longctx_patch.evals.speed import run_speed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16k,64k")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=2,
                    help="the new tokens of the timed generate() call (at least 2: a prefill and a decode step)")
    ap.add_argument("--muse", default="{}", help="MuSe config as JSON (default: the package defaults)")
    ap.add_argument("--out-dir", default=None, help="folder (default benchmarks/results/speed)")
    ap.add_argument("--name", default=None, help="file stem (default llama-3.2-1b-shaped-muse-<gpu>)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device (MuSe's Triton kernels; a 64k prefill of a 1B model)")
    model = llama_1b_shaped("cuda", torch.bfloat16)
    runs = [MethodRun("none"), MethodRun("muse", json.loads(args.muse))]
    run_speed((model, None), runs, contexts=parse_sizes(args.contexts), calls=[args.decode_tokens],
              repeats=args.repeats,
              out_dir=results_dir("speed", args.out_dir), name=args.name or f"llama-3.2-1b-shaped-muse-{device_token()}",
              model_name="llama-3.2-1b-shaped-random",
              command="python3 -m benchmarks.generate.bench_muse_prefill " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
