"""Does LoLA's sparse cache keep the needle? After the prefill of S-NIAH-1 prompts, the share of (sparse head,
needle token) pairs that each layer holds exactly in its sparse cache, against the share a random token
would get (lambda / tokens outside the window). Sparse heads are the kv heads (`--sparse-heads kv`, the
default) or the query heads.

    python3 -m evals.studies.lola_needle_in_cache --lengths 2k,4k --linear-scale 0.3 \\
        --out evals/results/lola/needle-in-cache-smollm2-135m-cpu.json

The positions of the kept pairs are followed by wrapping the cache manager's eviction step
(`kernels.lola.ops.lola_evict`) and the selection it makes (`kernels.lola.reference.top_lam`, which it calls
once per eviction); the model's outputs are unchanged. CPU or GPU (reference or Triton path: both go through
the same manager).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import longctx_patch as lp
from evals.shared import device_token, model_token, result_file
from longctx_patch.evals.common import (
    MethodRun, device_description, parse_fractions, parse_sizes, write_result)
from longctx_patch.evals.niah import make_samples, value_span
from longctx_patch.kernels.lola import ops
from longctx_patch.kernels.lola import reference as ref
from longctx_patch.models import load_model


class KeptPositions:
    """Follows the position of every sparse-cache slot through the manager's evictions, per layer call."""

    def __init__(self):
        self.pos: dict[int, torch.Tensor] = {}
        self._st, self._layer, self._top = None, -1, None
        self._top_lam, self._evict = ref.top_lam, ops.lola_evict

    def __enter__(self):
        def top_lam(scores, lam):
            top = self._top_lam(scores, lam)
            self._top = top
            return top

        def evict(st, *, window, lam, phi_k, backend="auto"):
            n_ev = st.nb - window
            if n_ev <= 0 or lam == 0:
                return self._evict(st, window=window, lam=lam, phi_k=phi_k, backend=backend)
            if self._st is not st:  # one LolaState per layer call: a new one is the next layer
                self._st, self._layer = st, self._layer + 1
            B, Hs = st.sp_score.shape[:2]
            start = st.pos - st.nb  # the buffer holds positions pos - nb .. pos - 1; the oldest n_ev leave
            sp = self.pos.get(self._layer, torch.full((B, Hs, lam), -1, dtype=torch.long, device=st.H.device))
            ev = torch.arange(start, start + n_ev, device=st.H.device)[None, None].expand(B, Hs, n_ev)
            cand = torch.cat([sp, ev], 2)
            self._top = None
            self._evict(st, window=window, lam=lam, phi_k=phi_k, backend=backend)
            if self._top is None:
                raise RuntimeError("lola_evict made no top_lam selection: the hook no longer sees the kept pairs")
            self.pos[self._layer] = torch.gather(cand, 2, self._top.indices)

        ref.top_lam, ops.lola_evict = top_lam, evict
        return self

    def __exit__(self, *exc):
        ref.top_lam, ops.lola_evict = self._top_lam, self._evict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="2k,4k")
    ap.add_argument("--depths", default="0.25,0.5,0.75")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sparse-cache", type=int, default=256)
    ap.add_argument("--linear-scale", type=float, default=1.0)
    ap.add_argument("--sparse-heads", choices=("kv", "query"), default="kv")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="file (default evals/results/lola/needle-in-cache-<model>-<device>.json)")
    a = ap.parse_args()
    out = result_file("lola", f"needle-in-cache-{model_token(a.model)}-{device_token(a.device)}.json", a.out)
    lengths, depths = parse_sizes(a.lengths), parse_fractions(a.depths)
    model, tok = load_model(a.model, device=a.device)
    run = MethodRun("lola", dict(window=a.window, sparse_cache=a.sparse_cache, linear_scale=a.linear_scale,
                                 sparse_heads=a.sparse_heads))
    lp.patch(model, run.name, **run.config)
    model.eval()
    records = []
    for s in make_samples(tok, ["s-niah-1"], lengths, depths, 1, seed=0):
        ids = s.input_ids
        span = value_span(tok, s)
        with KeptPositions() as kp, torch.no_grad():
            model(torch.tensor([ids], device=a.device), use_cache=True)
        by_layer = []
        for li in range(len(model.model.layers)):
            sp = kp.pos.get(li)
            held = torch.stack([(sp[0] == p).any(-1) for p in range(span.start, span.stop)]).float()  # [tokens, Hs]
            by_layer.append(round(float(held.mean()), 3))
        rec = dict(length=s.length, depth=s.depth, prompt_tokens=len(ids), needle_at=span.start,
                   needle_tokens=span.stop - span.start,
                   random_share=round(a.sparse_cache / max(1, len(ids) - a.window), 3),
                   mean_share=round(sum(by_layer) / len(by_layer), 3), share_by_layer=by_layer)
        print(json.dumps({k: v for k, v in rec.items() if k != "share_by_layer"}), flush=True)
        records.append(rec)
    write_result(out, task="lola-needle-in-cache", model=a.model, runs=[run], figures={"records": records},
                 command="python3 -m evals.studies.lola_needle_in_cache " + " ".join(sys.argv[1:]),
                 device=device_description(a.device))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
