"""`generate()` speed of one method on a Llama-3.2-1B-shaped model (random weights, bf16), as a user meets it: per
batch x context, the prefill, then a 64- and a 256-token generate() call (`--calls`), each timed from its first decode
step: tokens/s over the whole decode of the call, the ms per step of steps 1-16, 17-64, 65-128, 129-256, the steady
state against the bytes floor, peak memory; with `--static` plain transformers and its compiled static cache in the
same run. One method per process (benchmarks/generate/bench_generate.sh runs them all, so that one kernel crash does
not end the others).

    python3 -m benchmarks.generate.bench_generate --method lola --batches 1,16 --contexts 16k,32k --out-dir $OUT
    python3 -m benchmarks.generate.bench_generate --method none --static ...   (plain transformers, and its static cache)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.shared import device_token, llama_1b_shaped, results_dir
from longctx_patch.evals.common import MethodRun, parse_sizes
from longctx_patch.evals.speed import run_speed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", required=True, help="a method name, or none (the unpatched model)")
    ap.add_argument("--config", default="{}", help="the method's config as JSON (default: its defaults)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--contexts", default="16k,32k")
    ap.add_argument("--cells", default=None,
                    help="only these batch x context pairs, e.g. 16x32k,1x64k (instead of every --batches x --contexts)")
    ap.add_argument("--calls", default="64,256",
                    help="one generate() call of N new tokens per entry, each timed from its first decode step "
                         "(tokens/s over the whole decode, ms per step by range, peak memory)")
    ap.add_argument("--decode-graphs", choices=("on", "off"), default="on",
                    help="off: every decode step eager (passed to the speed runner as decode_graphs=False); the file "
                         "stem gets -eager")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="feed the prompt in chunks of this many tokens (generate()'s prefill_chunk_size)")
    ap.add_argument("--static", action="store_true", help="also plain transformers with its static cache")
    ap.add_argument("--out-dir", default=None, help="folder (default benchmarks/results/speed)")
    ap.add_argument("--name", default=None, help="file stem (default llama-3.2-1b-shaped-generate-METHOD-<gpu>)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device (a 1B-shaped model at 16k-128k tokens)")
    runs = [MethodRun(args.method, json.loads(args.config))]
    cells = None
    if args.cells:
        cells = [(int(b), parse_sizes(c)[0]) for b, c in (x.split("x") for x in args.cells.split(","))]
    model = llama_1b_shaped("cuda", torch.bfloat16)
    run_speed((model, None), runs, contexts=parse_sizes(args.contexts),
              batches=[int(b) for b in args.batches.split(",")], calls=[int(n) for n in args.calls.split(",")],
              cells=cells, prefill_chunk=args.prefill_chunk, decode_graphs=args.decode_graphs == "on",
              repeats=args.repeats, static=args.static, out_dir=results_dir("speed", args.out_dir),
              name=args.name or (f"llama-3.2-1b-shaped-generate-{args.method}"
                                 f"{'-eager' if args.decode_graphs == 'off' else ''}-{device_token()}"),
              model_name="llama-3.2-1b-shaped-random",
              command="python3 -m benchmarks.generate.bench_generate " + " ".join(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
