"""Where the attention of the answer goes: at the last prompt position of S-NIAH-1 prompts, per layer, the
exact model's softmax mass on the needle's tokens against `lola`'s (the share of its normaliser that the
needle gets, through the sparse cache or the linear term), and the share of `lola`'s normaliser that is its
linear term. The model runs `lola`; at each layer the same q, k, v give both attentions of the last query.

    python3 -m evals.studies.lola_mass --lengths 1k,2k,4k --out evals/results/lola/mass-smollm2-135m-cpu.json

The hybrid's exact terms are exp(s - m) with m their maximum and its linear term phi(q).phi(k) is not rescaled
(the LoLCATs normaliser), so the linear term's share grows with the number of keys it covers.
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
from longctx_patch.kernels.lola import reference as ref
from longctx_patch.kernels.lola.training import sparse_positions
from longctx_patch.methods.lolcats import LolcatsAttention, sparse_head_count
from longctx_patch.models import load_model


def last_query_masses(attn: LolcatsAttention, q, k, v, needle: slice) -> dict:
    """q [1, Hq, S, D], k/v [1, Hkv, S, D] (after RoPE): masses of the last query, per query head."""
    cfg = attn.method_config
    S, Hq = q.shape[2], q.shape[1]
    fq = attn.feature_map_q(q[:, :, -1:], out_dtype=torch.float32)[:, :, 0]  # [1, Hq, F2]
    fk = attn.feature_map_k(k, out_dtype=torch.float32)  # [1, Hq, S, F2]
    g, lf = attn.factors()
    hs = sparse_head_count(attn.sparse_heads, Hq, k.shape[1])
    sets = sparse_positions(fk, v, None, window=cfg.window, chunk=cfg.chunk, lam=attn.sparse_cache, sparse_heads=hs)
    row = ref.expand_kv(sets[(S - 1) // cfg.chunk], Hq)[0]  # [Hq, lam] positions in the last query's sparse set
    kx = ref.expand_kv(k, Hq)[0].float()
    s = torch.einsum("hd,hnd->hn", q[0, :, -1].float(), kx) * attn.scaling  # [Hq, S]
    teacher = torch.softmax(s, -1)
    pos = torch.arange(S)
    exact = (S - 1 - pos < cfg.window)[None].expand(Hq, S).clone()
    for h in range(Hq):
        exact[h, row[h][row[h] >= 0]] = True
    m = s.masked_fill(~exact, float("-inf")).amax(-1, keepdim=True)
    e = torch.exp(s - m) * exact * g.float()[:, None]
    a = torch.einsum("hf,hnf->hn", fq[0], fk[0]) * (~exact) * lf.float()[:, None]
    den = e.sum(-1) + a.sum(-1)
    nd = torch.zeros(S, dtype=torch.bool)
    nd[needle] = True
    return {
        "teacher_needle": teacher[:, nd].sum(-1),
        "lola_needle": (e[:, nd].sum(-1) + a[:, nd].sum(-1)) / den,
        "lola_needle_exact": e[:, nd].sum(-1) / den,
        "linear_share": a.sum(-1) / den,
        "needle_in_cache": torch.tensor([float(all(bool(exact[h, p]) for p in range(needle.start, needle.stop)))
                                         for h in range(Hq)]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="1k,2k,4k")
    ap.add_argument("--depths", default="0.5")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sparse-cache", type=int, default=256)
    ap.add_argument("--linear-scale", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="file (default evals/results/lola/mass-<model>-<device>.json)")
    a = ap.parse_args()
    out = result_file("lola", f"mass-{model_token(a.model)}-{device_token(a.device)}.json", a.out)
    model, tok = load_model(a.model, device=a.device)
    run = MethodRun("lola", dict(window=a.window, sparse_cache=a.sparse_cache, linear_scale=a.linear_scale))
    lp.patch(model, run.name, **run.config)
    model.eval()
    records = []
    orig = LolcatsAttention.attend
    for smp in make_samples(tok, ["s-niah-1"], parse_sizes(a.lengths), parse_fractions(a.depths), 1, seed=0):
        ids = smp.input_ids
        span = value_span(tok, smp)
        layers = []

        def attend(self, q, k, v, cache_layer, padding, _layers=layers, _span=span):
            with torch.no_grad():
                _layers.append(last_query_masses(self, q, k, v, _span))
            return orig(self, q, k, v, cache_layer, padding)

        LolcatsAttention.attend = attend
        try:
            with torch.no_grad():
                model(torch.tensor([ids], device=a.device), use_cache=False)
        finally:
            LolcatsAttention.attend = orig
        per_layer = []
        for li, d in enumerate(layers):
            h = int(d["teacher_needle"].argmax())  # the head that retrieves the needle most in the exact model
            per_layer.append(dict(layer=li, head=h, teacher_needle=round(float(d["teacher_needle"][h]), 4),
                                  lola_needle=round(float(d["lola_needle"][h]), 4),
                                  lola_needle_exact=round(float(d["lola_needle_exact"][h]), 4),
                                  needle_in_cache=bool(d["needle_in_cache"][h]),
                                  linear_share_mean=round(float(d["linear_share"].mean()), 4)))
        top = sorted(per_layer, key=lambda r: -r["teacher_needle"])[:5]
        rec = dict(length=smp.length, depth=smp.depth, prompt_tokens=len(ids), needle_at=span.start,
                   needle_tokens=span.stop - span.start,
                   linear_share_mean=round(sum(r["linear_share_mean"] for r in per_layer) / len(per_layer), 4),
                   top_retrieval_layers=top, layers=per_layer)
        print(json.dumps({k: v for k, v in rec.items() if k != "layers"}), flush=True)
        records.append(rec)
    write_result(out, task="lola-mass", model=a.model, runs=[run], figures={"records": records},
                 command="python3 -m evals.studies.lola_mass " + " ".join(sys.argv[1:]),
                 device=device_description(a.device))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
