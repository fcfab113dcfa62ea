"""Where `lola` loses the needle: per layer, after the prefill of S-NIAH prompts, how many of the needle's pairs it
holds exactly, how much of its attention the answer's query gives them against the exact model, and whether it answers.

    python3 -m benchmarks.quality.bench_lola_needle_study --model qwen2.5-coder-0.5b --device cuda \\
        --lengths 16k --haystack CORPUS/heldout/prose --samples 4 \\
        --method 'lola(window=1024,sparse_cache=1024,combine=shifted)' \\
        --method 'lola(window=1024,sparse_cache=1024,combine=unshifted)'
    python3 -m benchmarks.quality.bench_lola_needle_study --model smollm2-135m --lengths 1k --samples 1 \\
        --method 'lola(window=256,sparse_cache=256)'                    # CPU, fp32: ~5 s a prompt and method

The prompts are `longctx eval niah`'s (`evals.niah.make_samples`: same tasks, lengths, depths, sample indices, seed,
haystack and chat template give the same prompts as its cells), the needle is the value's digits
(`evals.niah.value_span`), and every prompt is answered as `eval niah` answers it (`generate_answer`: greedy, the
patched model's own prefill in chunks and decode steps), while probes around each patched layer's attention measure:

- the exact model (`exact`: the unpatched projections, softmax attention), once per prompt: at the last prompt
  position, each query head's softmax mass on the needle's tokens (`exact_needle`; the heads with most are the
  ones that retrieve it) and on the first prompt token (`exact_sink`);
- each `--method` (`lola`, or `lolcats` for exact attention with its weights), at the same position: the state the
  last prompt token meets (the layer's real cache: the sparse cache's keys are found among the prompt's keys by
  value), and from it
  - `needle_held`: the share of the needle's (sparse head, token) pairs held exactly (in the window or the sparse
    cache) against `random_held`, the share of all the prompt's pairs held exactly (what a random token gets);
    `needle_held_after_prefill`: the same in the cache the decode steps start from (one more eviction where the
    prompt ends a chunk; the pairs that left the window since the last chunk boundary are attended linearly until
    that eviction scores them);
  - per query head: `softmax_needle`, the softmax mass on the needle of this layer's own q and k (what exact
    attention would give on `lola`'s inputs); `needle_exact`, the share of `lola`'s normaliser on the needle's exact
    pairs; `needle_linear`, on its pairs attended linearly; `linear_share`, the linear term's share of the whole
    normaliser (all under the method's `combine`);
  - checks: `unmatched` (sparse slots whose key is not a prompt key: 0 unless the probe is wrong) and `fold_check`
    (the relative difference between the linear state's normaliser phi(q).s and the sum of phi(q).phi(k) over the
    pairs the probe counts as folded: rounding only, ~1e-7 in fp32 on the CPU; more in bf16, where the model's
    own phi(k) is rounded to bf16 before it is folded);
  - the same for the first prompt token (`sink_*`; `exact_sink`: the exact model's mass on it), which many heads
    attend heavily (an attention sink): attended linearly (out of the window and the sparse cache) it can cost the
    answer where every needle pair is exact (docs/lola.md, "Where Qwen loses the needle");
- the answer and whether it holds the value (`evals.niah.score`).

Each record lists every layer (`layers`: a list per figure; each layer's figures of its head that retrieves most in
the exact model) and the five (layer, head) pairs with the most exact mass (`top_heads`); `summary` averages them
per method, task and length, and apart for right and wrong answers. To read each layer's last query at the state it
meets, the call that holds the last prompt token is run in pieces (before it, it, after it): the result of one piece
up to rounding (kernels/lola/sparse_cache.py: a prefill cut anywhere gives the token-by-token result).

Result: `lola/needle-study-<model>-<device>.json` (device, date, commit, command; `--out FILE`, or a folder for that
name); it is rewritten after every prompt, so a run cut short keeps what it measured. A method that fails is named
with its error in `failed` and the next one runs (exit status 1). Progress on stderr. One prompt at a time (batch 1).
CPU in float32 (default there), CUDA in bfloat16 (default there).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.shared import REPO_ROOT, device_token, model_token, result_file
from longctx_patch.evals.common import (
    MethodRun, applied, format_table, parse_fractions, parse_methods, parse_sizes, size_label, write_result)
from longctx_patch.evals.niah import answer_tokens, generate_answer, load_haystack, make_samples, score, value_span
from longctx_patch.generation import has_chat_template
from longctx_patch.kernels.lola.reference import expand_kv
from longctx_patch.methods.lola import HybridAttention
from longctx_patch.patch_state import patched_modules
from longctx_patch.provenance import device_description, git_commit

TASKS = ("s-niah-1", "s-niah-2", "mk-niah")  # a number as the value: one token per digit
DEFAULT_HAYSTACK = REPO_ROOT / "tests" / "data" / "pg_essays"
DEFAULT_METHODS = ("lola(window=1024,sparse_cache=1024,combine=shifted)",
                   "lola(window=1024,sparse_cache=1024,combine=unshifted)")
EXACT = MethodRun("exact")
TOP = 5  # (layer, head) pairs of most exact mass per record
HEAD_FIELDS = ("softmax_needle", "needle_exact", "needle_linear", "linear_share", "softmax_sink", "sink_exact",
               "sink_linear")
# a record's `layers` (what a record keeps of `layer_rows`; the checks and the shares common to every layer are kept
# once per record)
LAYER_COLUMNS = ("layer", "head", "exact_needle", *HEAD_FIELDS, "exact_sink", "needle_held", "needle_held_head",
                 "needle_held_after_prefill", "sink_held", "sink_held_after_prefill", "linear_share_mean")
OPTIONS = ("window", "sparse_heads", "combine", "chunk", "feature_dim", "linear_scale", "affine_factors")


# ----------------------------------------------------------------------------------------------- the probes
def slot_positions(slot_k: torch.Tensor, valid: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The prompt position of each sparse-cache slot, found by its key's value among the layer's keys.

    slot_k [Hs, L, D] (Hs the kv heads, or the query heads: a multiple of them), valid [Hs, L] bool, keys [Hkv, N, D]
    in the same dtype. Returns (positions [Hs, L] int64, -1 for an empty or unmatched slot; the number of valid
    slots whose key is not among the keys). Keys are hashed by their bits (a weighted sum, no overflow), then each
    match is checked element by element."""
    Hs, L, D = slot_k.shape
    Hkv, N = keys.shape[0], keys.shape[1]
    if L == 0 or N == 0:
        return torch.full((Hs, L), -1, dtype=torch.long, device=slot_k.device), 0
    itype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[keys.element_size()]
    w = torch.randint(1, 1 << 20, (D,), generator=torch.Generator().manual_seed(0)).to(keys.device)

    def hashed(x):
        bits = x.contiguous().view(itype).long()
        if itype is torch.int64:
            bits = bits % (1 << 31)
        return (bits * w).sum(-1)

    hk = expand_kv(hashed(keys)[None], Hs)[0]  # [Hs, N]
    hs = hashed(slot_k.to(keys.dtype))  # [Hs, L]
    srt, order = hk.sort(-1)
    i = torch.searchsorted(srt, hs).clamp_max(N - 1)
    pos = torch.gather(order, 1, i)
    kx = expand_kv(keys[None], Hs)[0]  # [Hs, N, D]
    same = (torch.gather(kx, 1, pos[..., None].expand(-1, -1, D)) == slot_k.to(keys.dtype)).all(-1)
    ok = valid & same
    return torch.where(ok, pos, -1), int((valid & ~ok).sum())


def held_mask(positions: torch.Tensor, n: int, first_in_window: int) -> torch.Tensor:
    """[Hs, n] bool: the prompt positions held exactly per sparse head, those >= first_in_window (the window) and the
    sparse slots' (positions [Hs, L], -1 for none)."""
    Hs = positions.shape[0]
    pos = torch.arange(n, device=positions.device)
    held = torch.zeros(Hs, n + 1, dtype=torch.bool, device=positions.device)
    held.scatter_(1, torch.where(positions >= 0, positions, n), True)
    return held[:, :n] | (pos >= first_in_window)[None]


def _state(layer, Hs: int, Hq: int, D: int, F2: int, device, dtype) -> dict:
    """The parts of a `LolaLayer` the probe reads, copied (the cache is updated in place)."""
    if getattr(layer, "sp_k", None) is None:  # nothing processed yet
        return dict(sp_k=torch.zeros(Hs, 0, D, device=device, dtype=dtype),
                    sp_valid=torch.zeros(Hs, 0, dtype=torch.bool, device=device),
                    s=torch.zeros(Hq, F2, device=device), nb=0)
    return dict(sp_k=layer.sp_k[0].clone(), sp_valid=torch.isfinite(layer.sp_score[0]), s=layer.s[0].float().clone(),
                nb=int(layer.nb))


def exact_measures(q_last: torch.Tensor, keys: torch.Tensor, scale: float, needle: slice) -> dict:
    """The softmax mass on the needle and on the first prompt token of the last query, per query head: q_last
    [Hq, D], keys [Hkv, n, D]."""
    kx = expand_kv(keys[None], q_last.shape[0])[0].float()
    p = torch.softmax(torch.einsum("hd,hnd->hn", q_last.float(), kx) * scale, -1)
    return {"exact_needle": p[:, needle].sum(-1).cpu(), "exact_sink": p[:, 0].cpu()}


def hybrid_measures(mod, q_last: torch.Tensor, keys: torch.Tensor, before: dict, after: dict, needle: slice) -> dict:
    """lolcats / lola at the last prompt position (q_last [Hq, D], keys [Hkv, n, D] of the whole prompt) from the
    layer's state before its last token (`before`) and after it (`after`): see the module's docstring."""
    cfg = mod.method_config
    Hq, D = q_last.shape
    n = keys.shape[1]
    W = cfg.window
    dev = q_last.device
    sp_before, miss_b = slot_positions(before["sp_k"], before["sp_valid"], keys[:, : n - 1])
    sp_after, miss_a = slot_positions(after["sp_k"], after["sp_valid"], keys)
    Hs = sp_before.shape[0]
    held = held_mask(sp_before, n, n - W)  # what the last prompt token attends exactly (its window: n - W .. n - 1)
    held_after = held_mask(sp_after, n, n - W + 1)  # what the first decode step attends exactly among the prompt
    exact = expand_kv(held[None], Hq)[0]  # [Hq, n]
    nd = torch.zeros(n, dtype=torch.bool, device=dev)
    nd[needle] = True
    kx = expand_kv(keys[None], Hq)[0].float()
    sc = torch.einsum("hd,hnd->hn", q_last.float(), kx) * mod.scaling
    p = torch.softmax(sc, -1)
    m = sc.masked_fill(~exact, float("-inf")).amax(-1, keepdim=True)  # the window always holds the query's own key
    e = torch.exp(sc - m) * exact
    fq = mod.feature_map_q(q_last[None, :, None], out_dtype=torch.float32, backend="torch")[0, :, 0]  # [Hq, F2]
    fk = mod.feature_map_k(keys[None], out_dtype=torch.float32, backend="torch")[0]  # [Hq, n, F2]
    a_all = torch.einsum("hf,hnf->hn", fq, fk)
    a = a_all * ~exact
    g, lf = (x.float().view(-1, 1) for x in mod.factors())
    if cfg.combine == "unshifted":  # kernels/lola/reference.py `_finish`: exact exp(s), linear as is
        g, lf = g * torch.exp(m.clamp_max(0.0)), lf * torch.exp(-m.clamp_min(0.0))
    E, A = g * e, lf * a
    den = E.sum(-1) + A.sum(-1)
    # the linear state holds phi(k) of every pair older than the buffer (positions < n - 1 - nb) not in the cache
    folded = (torch.arange(n, device=dev) < n - 1 - before["nb"])[None] & ~exact
    from_tokens = (a_all * folded).sum(-1)
    from_state = (fq * before["s"]).sum(-1)
    gap = (from_tokens - from_state).abs() / from_state.abs().clamp_min(1e-30)
    fold_check = float(torch.where((from_state == 0) & (from_tokens == 0), torch.zeros_like(gap), gap).max())
    return {
        "needle_held": float(held[:, nd].float().mean()),
        "needle_held_heads": held[:, nd].float().mean(-1).cpu(),  # per sparse head
        "needle_held_after_prefill": float(held_after[:, nd].float().mean()),
        "random_held": float(held.float().mean()),
        "needle_in_window": float((torch.arange(n, device=dev)[nd] >= n - W).float().mean()),
        "sink_held": float(held[:, 0].float().mean()),
        "sink_held_after_prefill": float(held_after[:, 0].float().mean()),
        "sparse_heads": Hs,
        "softmax_needle": p[:, nd].sum(-1).cpu(),
        "needle_exact": (E[:, nd].sum(-1) / den).cpu(),
        "needle_linear": (A[:, nd].sum(-1) / den).cpu(),
        "softmax_sink": p[:, 0].cpu(),
        "sink_exact": (E[:, 0] / den).cpu(),
        "sink_linear": (A[:, 0] / den).cpu(),
        "linear_share": (A.sum(-1) / den).cpu(),
        "fold_check": fold_check,
        "unmatched": miss_b + miss_a,
    }


class NeedleProbe:
    """Probes every patched layer's attention of `model` while a prompt of `n_prompt` tokens is processed (a prefill
    in one call or in chunks, then decode steps, as `generate` runs it; batch 1, a cache).

    `results[layer]` after the prompt: `exact_measures` for a layer patched with any method but lolcats / lola (run it
    with `exact` for the exact model), `hybrid_measures` for those. The call holding the last prompt token runs in
    pieces around it, so its state can be read before and after it."""

    def __init__(self, model, n_prompt: int, needle: slice):
        self.model, self.n, self.needle = model, n_prompt, needle
        self.results: dict[int, dict] = {}
        self.prompt_calls: dict[int, int] = {}  # per layer, the calls that brought prompt tokens
        self._keys: dict[int, list[torch.Tensor]] = {}
        self._seen: dict[int, int] = {}
        self._mods: dict[int, torch.nn.Module] = {}

    def __enter__(self):
        for i, mod in patched_modules(self.model).items():
            orig = mod.attend

            def attend(q, k, v, cache_layer, padding, _mod=mod, _orig=orig):
                return self._attend(_mod, _orig, q, k, v, cache_layer, padding)

            mod.attend = attend  # an instance attribute over the class's method: `attend_call` calls it
            self._mods[i] = mod
        return self

    def __exit__(self, *exc):
        for mod in self._mods.values():
            del mod.attend
        self._mods.clear()
        self._keys.clear()

    def _attend(self, mod, orig, q, k, v, cache_layer, padding):
        L, S = mod.layer_idx, q.shape[2]
        seen = self._seen.get(L, 0)
        if seen >= self.n:  # decode steps
            return orig(q, k, v, cache_layer, padding)
        if q.shape[0] != 1:
            raise ValueError("the needle probe measures one prompt at a time (batch 1)")
        self._seen[L] = seen + S
        self.prompt_calls[L] = self.prompt_calls.get(L, 0) + 1
        self._keys.setdefault(L, []).append(k.detach())
        if seen + S < self.n:
            return orig(q, k, v, cache_layer, padding)
        t = self.n - 1 - seen  # the last prompt token's index in this call
        keys = torch.cat(self._keys.pop(L), 2)[0, :, : self.n]
        q_last = q[0, :, t].detach()
        if not isinstance(mod, HybridAttention):
            self.results[L] = exact_measures(q_last, keys, mod.scaling, self.needle)
            return orig(q, k, v, cache_layer, padding)
        if cache_layer is None:
            raise ValueError("the needle probe reads lolcats / lola's cache: run the prompt with a cache (generate)")

        def piece(a, b):
            pad = None if padding is None else padding[:, : padding.shape[1] - (S - b)]
            return orig(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], cache_layer, pad)

        Hq, D, Hkv = q.shape[1], q.shape[3], k.shape[1]
        Hs = Hq if mod.sparse_heads == "query" else Hkv
        F2 = 2 * mod.method_config.feature_dim
        outs = [piece(0, t)] if t > 0 else []
        before = _state(cache_layer, Hs, Hq, D, F2, q.device, k.dtype)
        outs.append(piece(t, t + 1))
        after = _state(cache_layer, Hs, Hq, D, F2, q.device, k.dtype)
        if t + 1 < S:
            outs.append(piece(t + 1, S))
        with torch.no_grad():
            self.results[L] = hybrid_measures(mod, q_last, keys, before, after, self.needle)
        return torch.cat(outs, 1)


def _r(x, nd: int = 4):
    return round(float(x), nd)


def layer_rows(exact: dict[int, dict], hybrid: dict[int, dict]) -> list[dict]:
    """One row per layer measured both ways: its head of most exact mass, and the layer's shares."""
    rows = []
    for L in sorted(set(exact) & set(hybrid)):
        x, h = exact[L]["exact_needle"], hybrid[L]
        head = int(x.argmax())
        group = x.shape[0] // h["sparse_heads"]
        rows.append({
            "layer": L, "head": head, "exact_needle": _r(x[head]), "exact_sink": _r(exact[L]["exact_sink"][head]),
            **{f: _r(h[f][head]) for f in HEAD_FIELDS},
            "needle_held": _r(h["needle_held"], 3), "needle_held_head": _r(h["needle_held_heads"][head // group], 3),
            "needle_held_after_prefill": _r(h["needle_held_after_prefill"], 3),
            "random_held": _r(h["random_held"], 3), "needle_in_window": _r(h["needle_in_window"], 3),
            "sink_held": _r(h["sink_held"], 3), "sink_held_after_prefill": _r(h["sink_held_after_prefill"], 3),
            "linear_share_mean": _r(h["linear_share"].mean()), "fold_check": float(f"{h['fold_check']:.2e}"),
            "unmatched": h["unmatched"],
        })
    return rows


def layer_columns(rows: list[dict]) -> dict[str, list]:
    """The layer rows as one list per figure (LAYER_COLUMNS, 3 decimals: a record of a 24-layer model stays ~4 kB)."""
    return {k: [round(r[k], 3) if isinstance(r[k], float) else r[k] for r in rows] for k in LAYER_COLUMNS}


def top_heads(exact: dict[int, dict], hybrid: dict[int, dict], k: int = TOP) -> list[dict]:
    """The k (layer, head) pairs with the most exact mass on the needle, with the method's figures there."""
    pairs = [(float(exact[L]["exact_needle"][h]), L, h) for L in sorted(set(exact) & set(hybrid))
             for h in range(exact[L]["exact_needle"].shape[0])]
    out = []
    for mass, L, h in sorted(pairs, reverse=True)[:k]:
        d = hybrid[L]
        group = d["softmax_needle"].shape[0] // d["sparse_heads"]
        out.append({"layer": L, "head": h, "exact_needle": _r(mass), "exact_sink": _r(exact[L]["exact_sink"][h]),
                    **{f: _r(d[f][h]) for f in HEAD_FIELDS},
                    "needle_held_head": _r(d["needle_held_heads"][h // group], 3)})
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def summarize(records: list[dict], labels: list[str]) -> dict:
    """Per method, task and length: accuracy, the mean held shares over every layer and over the top heads, the top
    heads' masses and shares; the same apart for right and wrong answers (`by_answer`)."""

    def figures(rows):
        if not rows:
            return None
        out = {"prompts": len(rows), "accuracy": _mean([float(r["correct"]) for r in rows])}
        if "layers" not in rows[0]:
            return out
        out.update({
            "needle_held": _mean([r["needle_held_mean"] for r in rows]),
            "random_held": _mean([r["random_held_mean"] for r in rows]),
            "needle_held_after_prefill": _mean([r["needle_held_after_prefill_mean"] for r in rows]),
            "sink_held": _mean([r["sink_held_mean"] for r in rows]),
            "sink_held_after_prefill": _mean([r["sink_held_after_prefill_mean"] for r in rows]),
            "linear_share": _mean([r["linear_share_mean"] for r in rows]),
        })
        for f in ("exact_needle", "exact_sink", *HEAD_FIELDS, "needle_held_head"):
            out[f"top_{f}"] = _mean([_mean([t[f] for t in r["top_heads"]]) for r in rows])
        return out

    out: dict = {}
    for lab in labels:
        mine = [r for r in records if r["method"] == lab]
        for task in dict.fromkeys(r["task"] for r in mine):
            for L in dict.fromkeys(r["length"] for r in mine if r["task"] == task):
                rows = [r for r in mine if r["task"] == task and r["length"] == L]
                cell = figures(rows)
                if lab != EXACT.label:
                    cell["by_answer"] = {"right": figures([r for r in rows if r["correct"]]),
                                         "wrong": figures([r for r in rows if not r["correct"]])}
                out.setdefault(lab, {}).setdefault(task, {})[size_label(L)] = cell
    return out


def summary_table(summary: dict) -> str:
    """One row per method, task and length: accuracy, the held shares, the top heads' figures."""
    header = ["method", "task", "length", "prompts", "right", "needle held", "random", "sink held (decode)",
              "top: exact mass", "softmax (own q,k)", "lola needle exact", "needle linear", "linear share",
              "held (head)"]
    keys = ("needle_held", "random_held", "sink_held_after_prefill", "top_exact_needle", "top_softmax_needle",
            "top_needle_exact", "top_needle_linear", "top_linear_share", "top_needle_held_head")
    rows = [[lab, task, L, c["prompts"], c["accuracy"], *(c.get(k) for k in keys)]
            for lab, tasks in summary.items() for task, cells in tasks.items() for L, c in cells.items()]
    return format_table(header, rows)


# ----------------------------------------------------------------------------------------------- the run
def probe_prompt(model, tok, ids: list[int], needle: slice, max_new_tokens: int) -> tuple[dict[int, dict], str]:
    """The patched `model` answers `ids` as `eval niah` does, probed: ({layer: measures}, the answer)."""
    with NeedleProbe(model, len(ids), needle) as probe, torch.no_grad():
        answer = generate_answer(model, tok, ids, max_new_tokens)
    missing = sorted(set(patched_modules(model)) - set(probe.results))
    if missing:
        raise RuntimeError(f"the probe measured no last prompt position in layers {missing}")
    return probe.results, answer


def exact_record(res: dict[int, dict]) -> tuple[dict, str]:
    """The exact run's figures of one prompt (each layer's most needle mass, the top heads) and its progress note."""
    x = torch.stack([res[L]["exact_needle"] for L in sorted(res)])  # [layers, Hq]
    best = sorted(((_r(x[L, h]), L, h) for L in range(x.shape[0]) for h in range(x.shape[1])), reverse=True)
    rec = {"exact_needle_by_layer": [_r(v, 3) for v in x.max(-1).values.tolist()],
           "top_heads": [{"layer": L, "head": h, "exact_needle": m} for m, L, h in best[:TOP]]}
    return rec, "top heads " + ", ".join(f"L{L}h{h} {m:.2f}" for m, L, h in best[:3])


def hybrid_record(name: str, exact: dict[int, dict], res: dict[int, dict]) -> tuple[dict, str]:
    """A lola / lolcats run's figures of one prompt against the exact run's, and its progress note."""
    rows, tops = layer_rows(exact, res), top_heads(exact, res)
    keys = ("needle_held", "needle_held_after_prefill", "random_held", "sink_held", "sink_held_after_prefill")
    rec = {f"{k}_mean": _mean([r[k] for r in rows]) for k in keys}
    rec["linear_share_mean"] = _mean([r["linear_share_mean"] for r in rows])
    rec.update({"needle_in_window": rows[0]["needle_in_window"], "unmatched": sum(r["unmatched"] for r in rows),
                "fold_check_max": max(r["fold_check"] for r in rows), "top_heads": tops, "layers": layer_columns(rows)})
    t = tops[0]
    return rec, (f"needle held {rec['needle_held_mean']:.2f} (random {rec['random_held_mean']:.2f}), sink held "
                 f"{rec['sink_held_mean']:.2f} / {rec['sink_held_after_prefill_mean']:.2f} after; top L{t['layer']}h"
                 f"{t['head']}: exact {t['exact_needle']:.2f}, own q/k {t['softmax_needle']:.2f}, {name} exact "
                 f"{t['needle_exact']:.3f} linear {t['needle_linear']:.3f}, linear share {t['linear_share']:.2f}")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b",
                    help="alias, .gguf file or model folder (default %(default)s)")
    ap.add_argument("--haystack", default=None, metavar="FILE|DIR",
                    help="essay text of s-niah-2 and mk-niah: a .txt file or a folder (default tests/data/pg_essays)")
    ap.add_argument("--tasks", default="s-niah-1,s-niah-2", help=f"of {', '.join(TASKS)} (default %(default)s)")
    ap.add_argument("--lengths", default="4k", help="prompt lengths in tokens (default %(default)s)")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths (default: eval niah's Qwen cells')")
    ap.add_argument("--samples", type=int, default=1, help="prompts per (task, length, depth): indices 0 .. N-1")
    ap.add_argument("--seed", type=int, default=0, help="eval niah's --seed (default %(default)s)")
    ap.add_argument("--method", dest="methods", action="append", default=None, metavar="METHOD",
                    help="a lola or lolcats configuration, inline options (repeatable; default: lola 1024 / 1024 "
                         "shifted and unshifted)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--out", default=None, help="result file, or a folder for the default name "
                                                "(default: lola/needle-study-<model>-<device>.json in the results)")
    a = ap.parse_args(argv)
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        ap.error(f"--tasks: choose from {', '.join(TASKS)} (the value must be a number)")
    lengths, depths = parse_sizes(a.lengths), parse_fractions(a.depths)
    runs = parse_methods(a.methods or list(DEFAULT_METHODS))
    wrong = [r.label for r in runs if r.name not in ("lola", "lolcats")]
    if wrong:
        ap.error(f"--method {', '.join(wrong)}: the study measures lola and lolcats (exact runs as the reference)")
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    name = f"needle-study-{model_token(a.model)}-{device_token(a.device)}.json"
    folder = a.out and (Path(a.out).is_dir() or a.out.endswith("/"))
    out = result_file("lola", name, Path(a.out) / name if folder else a.out)
    args = sys.argv[1:] if argv is None else argv
    command = "python3 -m benchmarks.quality.bench_lola_needle_study " + shlex.join(args)
    git_commit()  # the commit when the run starts

    import longctx_patch as lp

    t0 = time.time()
    model, tok = lp.load_model(a.model, dtype=dtype, device=a.device)
    model.eval()
    haystack = a.haystack or str(DEFAULT_HAYSTACK)
    text = load_haystack(haystack) if any(t != "s-niah-1" for t in tasks) else None
    chat = has_chat_template(tok)
    prompts = make_samples(tok, tasks, lengths, depths, a.samples, seed=a.seed, haystack=text, chat=chat)
    needles = [value_span(tok, s) for s in prompts]
    _log(f"{a.model} on {a.device} ({dtype}) loaded in {time.time() - t0:.0f} s; {len(prompts)} prompts, "
         f"{len(runs)} method(s) + exact")
    labels = [EXACT.label] + [r.label for r in runs]
    records: list[dict] = []
    exact_by_prompt: list[dict[int, dict]] = []
    weights: dict[str, str | None] = {}  # label -> where its method weights came from (options: effective_config)
    failed: dict[str, str] = {}  # method -> its error (the records it finished stay)

    def write():
        figures = {"tasks": tasks, "lengths": lengths, "depths": depths, "samples_per_cell": a.samples, "seed": a.seed,
                   "haystack": haystack if text is not None else None, "chat_template": chat, "dtype": dtype,
                   "weights_source": weights, "failed": failed, "summary": summarize(records, labels),
                   "records": records}
        write_result(out, task="lola-needle-study", model=a.model, runs=[EXACT, *runs], figures=figures,
                     command=command, device=device_description(a.device))

    total = len(prompts) * (1 + len(runs))
    done = 0
    for run in [EXACT, *runs]:
        try:
            with applied(model, run):
                if run.name != "exact":  # the options in force (an asset's defaults included) and the weights' source
                    mod = next(iter(patched_modules(model).values()))
                    weights[run.label] = getattr(mod, "weights_source", None)
                    shown = {k: run.effective[k] for k in OPTIONS if k in run.effective}
                    _log(f"{run.label}: {shown | {'sparse_cache': mod.sparse_cache}}; weights: {weights[run.label]}")
                else:
                    _log(f"{run.label}: the unpatched projections, softmax attention")
                for i, (s, needle) in enumerate(zip(prompts, needles)):
                    t1 = time.time()
                    res, answer = probe_prompt(model, tok, s.input_ids, needle, answer_tokens(s.task))
                    rec = {"method": run.label, "task": s.task, "length": s.length, "depth": s.depth, "index": s.index,
                           "prompt_tokens": s.prompt_tokens, "needle_depth": s.needle_depth, "needle_at": needle.start,
                           "needle_tokens": needle.stop - needle.start, "answer": answer,
                           "correct": score(answer, s.value)}
                    if run is EXACT:
                        exact_by_prompt.append(res)
                        more, msg = exact_record(res)
                    else:
                        more, msg = hybrid_record(run.name, exact_by_prompt[i], res)
                    rec.update(more)
                    records.append(rec)
                    done += 1
                    _log(f"[{done}/{total}] {s.task} {size_label(s.length)} depth {s.depth:g} #{s.index} {run.label}: "
                         f"{'right' if rec['correct'] else 'wrong'} ({answer.strip()[:24]!r}); {msg} "
                         f"({time.time() - t1:.1f} s)")
                    write()
        except Exception as e:  # noqa: BLE001 - one method's failure leaves the others' figures (not the reference's)
            if run is EXACT:
                raise
            failed[run.label] = f"{type(e).__name__}: {e}"
            _log(f"{run.label} failed: {failed[run.label]}\n{traceback.format_exc()}")
            write()
    summary = summarize(records, labels)
    print(summary_table(summary))
    print(f"wrote {out} ({time.time() - t0:.0f} s)")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
