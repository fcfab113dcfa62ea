"""kvpress's KV-cache compression presses on the RULER samples `longctx eval ruler --export-samples` writes.

Runs in kvpress's own environment (kvpress 0.5.5 with the transformers it pins, < 5.3), apart from this project's:
it imports nothing of longctx_patch and reads only the samples file (docs/peers.md). For each press and each
decode-state fraction F it answers every sample with kvpress's own pipeline code
(`KVPressTextGenerationPipeline._forward`: the context prefilled under the press, then the question and greedy
decoding over the compressed cache), given the samples' token ids: the context is ``input_ids[:context_tokens]``
(chat template head and haystack), the question the rest (question, end of the user turn, assistant header, answer
prefix), as kvpress's RULER benchmark splits them.

Matched state: F is the fraction of the exact K/V cache a press keeps at the end of the prompt. The press compresses
only the context, so each sample gets the compression ratio r = 1 - (F * prompt - question) / context (kvpress's
`compression_ratio`, the share of context pairs removed): kept pairs (1 - r) * context + question = F * prompt. Each
prediction records r, F and the fraction measured in the cache afterwards (pairs in the cache less those a
head-wise press masks, over layers x kv heads x prompt tokens).

Writes OUT (a predictions file, `longctx_patch.evals.ruler_export` format: a header line, then one prediction a
line) and OUT.runs.json (every invocation: device, date, commit from $LONGCTX_COMMIT, command, versions). A
rerun appends only the predictions missing from OUT, so a run cut by --max-seconds (or a time limit) goes on where
it stopped. Scores are RULER's string_match_all, as longctx_patch.evals.ruler scores (`plot_peers.py` rescores
with the project's own code).

    python benchmarks/quality/bench_peers_kvpress.py --self-check
    python benchmarks/quality/bench_peers_kvpress.py --model /tmp/qwen --samples S.jsonl --out P.jsonl \\
        --presses streaming_llm,snapkv,expected_attention,kvzip,knorm --fractions 0.05,0.1,0.15,0.25,0.5
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

SAMPLES_KIND, PREDICTIONS_KIND, VERSION = "longctx-ruler-samples", "longctx-ruler-predictions", 1
FRACTIONS = (0.05, 0.1, 0.15, 0.25, 0.5)
PRESSES = ("streaming_llm", "snapkv", "expected_attention", "kvzip", "knorm")
MAX_RATIO = 0.999  # kvpress asserts compression_ratio < 1


def make_press(name: str):
    """A kvpress press by short name, with its defaults (the compression ratio is set per sample).

    kvzip: KVzipPress (scores pairs by how much the model attends to them while it reconstructs the context: the
    query-agnostic method of Kim et al. 2025, with head-wise eviction across layers). kvpress 0.5.5's other KVzip
    variant, FastKVzipPress, needs gate weights trained for the model and fetched from a hub (none exist for
    Qwen2.5-Coder, and the GPU machine is offline). kvzip_plus: KVzipPress with its KVzip+ normalisation."""
    import kvpress

    table = {
        "streaming_llm": lambda: kvpress.StreamingLLMPress(),
        "snapkv": lambda: kvpress.SnapKVPress(),
        "expected_attention": lambda: kvpress.ExpectedAttentionPress(),
        "kvzip": lambda: kvpress.KVzipPress(),
        "kvzip_plus": lambda: kvpress.KVzipPress(kvzip_plus_normalization=True),
        "knorm": lambda: kvpress.KnormPress(),
        "tova": lambda: kvpress.TOVAPress(),
        "pyramidkv": lambda: kvpress.PyramidKVPress(),
    }
    if name not in table:
        raise SystemExit(f"unknown press {name!r}; choose from {', '.join(table)}")
    return table[name]()


# ----------------------------------------------------------------------------------------------- scoring
def postprocess(pred: str) -> str:
    """RULER's clean-up of a prediction (the same as longctx_patch.evals.ruler.postprocess)."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def score(answer: str, refs) -> float:
    """RULER's string_match_all of one sample: the fraction of `refs` in the answer (case-insensitive)."""
    p = postprocess(answer).lower()
    return sum(r.lower() in p for r in refs) / len(refs)


# ----------------------------------------------------------------------------------------------- files
def read_samples(path: Path):
    """(header, samples) of a samples file; the header gains "sha256", the file's."""
    import hashlib

    data = Path(path).read_bytes()
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    if not rows or rows[0].get("kind") != SAMPLES_KIND or rows[0].get("version") != VERSION:
        raise SystemExit(f"{path} is not a RULER samples file (version {VERSION}): write one with "
                         "`longctx eval ruler --export-samples`")
    return {**rows[0], "sha256": hashlib.sha256(data).hexdigest()}, rows[1:]


def ratio_for(fraction: float, prompt: int, context: int) -> float:
    """kvpress's compression ratio that keeps `fraction` of a prompt's K/V pairs, the question's uncompressed."""
    question = prompt - context
    return min(max(1.0 - (fraction * prompt - question) / context, 0.0), MAX_RATIO)


def git_commit() -> str:
    return os.environ.get("LONGCTX_COMMIT") or "unknown (set LONGCTX_COMMIT)"


def device_name(device: str) -> str:
    """The device in the spelling of longctx_patch.provenance.device_description (this script cannot import it)."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    n = torch.get_num_threads()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {n} thread{'s' if n != 1 else ''})"


def versions() -> dict:
    import kvpress  # noqa: F401
    import torch
    import transformers
    from importlib.metadata import version

    return {"kvpress": version("kvpress"), "transformers": transformers.__version__, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version()}


# ----------------------------------------------------------------------------------------------- run
_LOADED: dict = {}


def load(model_dir: str, device: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    if (model_dir, device, dtype) in _LOADED:
        return _LOADED[model_dir, device, dtype]

    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    # sdpa: kvpress's head-wise presses (KVzip) patch the attention functions and refuse eager
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt, attn_implementation="sdpa").to(device).eval()
    _LOADED[model_dir, device, dtype] = model, AutoTokenizer.from_pretrained(model_dir)
    return _LOADED[model_dir, device, dtype]


def answer_one(pipe, model, press, sample: dict, device: str) -> tuple[str, float]:
    """kvpress's pipeline on one sample: (answer, measured decode-state fraction)."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([sample["input_ids"]], device=device)
    c = sample["context_tokens"]
    cache = DynamicCache()
    with torch.no_grad():
        answer = pipe._forward({"context_ids": ids[:, :c], "questions_ids": [ids[:, c:]]},
                               max_new_tokens=sample["max_new_tokens"], press=press, cache=cache)[0]
    kept = total = 0
    question = sample["prompt_tokens"] - c
    for i, layer in enumerate(model.model.layers):
        # [batch, kv heads, tokens, head dim]: the context after the press (the pipeline cuts the question and the
        # answer off again after generating), less the pairs a head-wise press masks; plus the question's pairs
        k = cache.layers[i].keys
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        kept += k.shape[1] * (k.shape[2] + question) - (0 if masked is None else int(masked[0].numel()))
        total += k.shape[1] * sample["prompt_tokens"]
        layer.self_attn.masked_key_indices = None  # not carried to the next sample's prefill
    return answer, kept / total


def run(args) -> int:
    import torch
    from kvpress import KVPressTextGenerationPipeline

    t_start = time.time()
    header, samples = read_samples(Path(args.samples))
    if args.tasks:
        samples = [s for s in samples if s["task"] in args.tasks.split(",")]
    if args.lengths:
        samples = [s for s in samples if str(s["length"]) in args.lengths.split(",")]
    if args.limit:
        samples = [s for s in samples if s["index"] < args.limit]
    if not samples:
        raise SystemExit("no samples left after --tasks / --lengths / --limit")
    out = Path(args.out)
    done: set[tuple] = set()
    if out.exists():
        with open(out, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if not rows or rows[0].get("kind") != PREDICTIONS_KIND:
            raise SystemExit(f"{out} exists and is not a predictions file; pick another --out")
        if rows[0].get("samples_sha256") != header["sha256"]:
            raise SystemExit(f"{out} holds predictions on other samples (sha256 {rows[0].get('samples_sha256')}); "
                             "pick another --out")
        done = {(r["method"], r["task"], r["length"], r["index"]) for r in rows[1:]}
    info = {"device": device_name(args.device), "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": git_commit(), "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            **versions(), "model": args.model, "dtype": args.dtype, "samples": str(args.samples)}
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"kind": PREDICTIONS_KIND, "version": VERSION, "program": "kvpress", **info,
                                   "samples_model": header.get("model"),
                                   "samples_sha256": header["sha256"]}) + "\n")
    runs_path = out.with_name(out.name + ".runs.json")
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else []
    runs_path.write_text(json.dumps(runs + [info], indent=1))

    model, tok = load(args.model, args.device, args.dtype)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=torch.device(args.device))
    presses = [p.strip() for p in args.presses.split(",") if p.strip()]
    fractions = [float(x) for x in args.fractions.split(",")]
    cells = ([("none", 1.0)] if args.baseline else []) + [(p, f) for p in presses for f in fractions]
    lengths = sorted({s["length"] for s in samples})
    left = 0
    with open(out, "a", encoding="utf-8") as f:
        for press_name, frac in cells:
            method = "kvpress-none" if press_name == "none" else f"kvpress-{press_name}({frac:g})"
            press = None if press_name == "none" else make_press(press_name)
            for L in lengths:
                todo = [s for s in samples if s["length"] == L and (method, s["task"], L, s["index"]) not in done]
                if not todo:
                    continue
                if args.max_seconds and time.time() - t_start > args.max_seconds:
                    left += len(todo)
                    continue
                t0, scores, n = time.time(), [], 0
                for s in todo:
                    if args.max_seconds and time.time() - t_start > args.max_seconds:
                        left += len(todo) - n
                        break
                    r = 0.0 if press is None else ratio_for(frac, s["prompt_tokens"], s["context_tokens"])
                    if press is not None:
                        press.compression_ratio = r
                    ts = time.time()
                    answer, measured = answer_one(pipe, model, press, s, args.device)
                    sc = score(answer, s["answers"])
                    scores.append(sc)
                    f.write(json.dumps({"method": method, "press": press_name, "fraction": frac,
                                        "task": s["task"], "length": L, "index": s["index"], "answer": answer,
                                        "score": round(sc, 4), "compression_ratio": round(r, 6),
                                        "state_fraction": round(measured, 6), "seconds": round(time.time() - ts, 3)})
                              + "\n")
                    f.flush()
                    n += 1
                if n:
                    print(f"[kvpress] {method:<32} L={L:<6} {n:>4} samples  score {100 * sum(scores) / n:6.2f}  "
                          f"{time.time() - t0:7.1f} s", flush=True)
    print(f"[kvpress] {'finished' if not left else f'{left} predictions left: run again to go on'} -> {out}",
          flush=True)
    return 0 if not left else 3


# ----------------------------------------------------------------------------------------------- self-check
def self_check(args) -> int:
    """Every press on a tiny random Qwen2 model and a few synthetic samples, on the device given: each one runs,
    keeps about the state fraction asked, and its answers are scored. Prints one line a press; exit 1 on a failure."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    print(f"[self-check] {json.dumps(versions())} on {device_name(args.device)}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="peers-kvpress-"))
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    tiny = Qwen2ForCausalLM(cfg)
    # Random queries point every way, and KVzip's head-wise eviction (kvpress's attention patch) needs a key that
    # every query of a head ignores: it exists when the queries share a half-space, as a trained model's do (their
    # large components sit in rope's slowest dimensions). Give the tiny model's queries such a common component.
    D = cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        for layer in tiny.model.layers:
            b = layer.self_attn.q_proj.bias.view(cfg.num_attention_heads, D)
            b[:, D // 2 - 1] += 4.0
    tiny.save_pretrained(tmp / "model")
    tok_src = args.model or None
    if tok_src is None:  # a tokenizer with no files to fetch: a word-level one over the model's 512 ids
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 512)}}
        t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="<eos>").save_pretrained(tmp / "model")
    else:
        AutoTokenizer.from_pretrained(tok_src).save_pretrained(tmp / "model")
    import random

    rng = random.Random(0)
    samples_path = tmp / "samples.jsonl"
    with open(samples_path, "w") as f:
        f.write(json.dumps({"kind": SAMPLES_KIND, "version": VERSION, "model": "tiny", "vocab_size": 512, "seed": 0,
                            "haystack": "random ids", "chat_template": False, "tasks": ["niah_single_1"],
                            "lengths": [512], "samples_per_cell": 2}) + "\n")
        for i in range(2):
            ids = [rng.randrange(2, 512) for _ in range(480)]
            f.write(json.dumps({"task": "niah_single_1", "length": 512, "index": i, "answers": ["w7"],
                                "prompt_tokens": 480, "max_new_tokens": 4, "query": "", "units": 0, "depths": [],
                                "context_tokens": 450, "seed": 0, "input_ids": ids}) + "\n")
    presses = [p for p in args.presses.split(",") if p]
    if args.presses == ",".join(PRESSES):
        presses.append("kvzip_plus")
    failed = []
    for name in presses:
        ns = argparse.Namespace(samples=samples_path, out=tmp / f"{name}.jsonl", model=str(tmp / "model"),
                                device=args.device, dtype="float32", presses=name, fractions="0.25", tasks=None,
                                lengths=None, limit=None, max_seconds=None, baseline=False)
        try:
            run(ns)
            rows = [json.loads(line) for line in open(ns.out)][1:]
            assert len(rows) == 2, f"{len(rows)} predictions, not 2"
            for r in rows:
                assert r["score"] == round(score(r["answer"], ["w7"]), 4)
                assert abs(r["state_fraction"] - 0.25) < 0.02, f"kept {r['state_fraction']:.3f} of the cache, not 0.25"
            print(f"[self-check] {name}: ok (kept {rows[0]['state_fraction']:.3f}, ratio "
                  f"{rows[0]['compression_ratio']:.3f}, answer {rows[0]['answer']!r})", flush=True)
        except Exception as e:  # noqa: BLE001 - every press is tried and its failure named
            failed.append(name)
            print(f"[self-check] {name}: FAILED {type(e).__name__}: {e}", flush=True)
    print(f"[self-check] {'all presses ran' if not failed else 'failed: ' + ', '.join(failed)}", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF model folder (the samples' model: the same tokenizer)")
    ap.add_argument("--samples", help="samples file from `longctx eval ruler --export-samples`")
    ap.add_argument("--out", help="predictions file (appended; a rerun goes on where it stopped)")
    ap.add_argument("--presses", default=",".join(PRESSES), help="comma-separated: %(default)s (also kvzip_plus, "
                                                                  "tova, pyramidkv)")
    ap.add_argument("--fractions", default=",".join(f"{x:g}" for x in FRACTIONS),
                    help="decode-state fractions to keep (of the exact K/V cache at the end of the prompt)")
    ap.add_argument("--baseline", action="store_true", help="also answer without a press (kvpress-none)")
    ap.add_argument("--tasks", help="only these tasks (comma-separated)")
    ap.add_argument("--lengths", help="only these lengths (comma-separated, as in the samples file)")
    ap.add_argument("--limit", type=int, help="only the first N samples of each (task, length)")
    ap.add_argument("--max-seconds", type=float, help="stop starting samples after this long (exit 3: run again)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--self-check", action="store_true", help="run every press on a tiny random model and exit")
    args = ap.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.self_check:
        return self_check(args)
    if not (args.model and args.samples and args.out):
        ap.error("--model, --samples and --out are needed (or --self-check)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
