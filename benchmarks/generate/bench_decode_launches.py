"""Kernels one lola / lolcats decode step issues per layer, counted on the CPU (no GPU needed).

Counts, inside the patched attention's `attend` (the cache update and the attention; not the projections), every
aten op that reaches a kernel (TorchDispatchMode; views, reshapes and other metadata-only ops left out, allocations
counted apart: `allocs`; before the fused-ops change they were counted among the ops: a plain lola step then
read 8, now 5 with 3 allocations) and every
Triton launch (the interpreter's launches, TRITON_INTERPRET=1, with the torch ops the interpreter itself issues
not counted). One layer of the Llama-3.2-1B shape (32 / 8 heads, D = 64, F = 64), batch 1, window = chunk = 64:
a prefill of `--prompt` tokens, then `chunk` decode steps (one eviction cycle); prints the mean per step, the
step without eviction and the eviction step.

`--scope layer` counts the whole decoder layer instead (its norms, projections, rotary embedding, attention and MLP:
what a layer adds to a replayed step), with the fused model ops (fused_ops.py) on, off or both (`--fused-ops`).

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/generate/bench_decode_launches.py --backend triton
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/generate/bench_decode_launches.py --scope layer --methods lolcats \
        --feature-cache default --steps 4
"""

from __future__ import annotations

import argparse
import collections
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

VIEWS = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "transpose", "t", "permute", "unsqueeze",
         "squeeze", "as_strided", "alias", "detach", "lift_fresh", "split", "unbind", "_reshape_alias", "diagonal",
         "unflatten", "flatten", "narrow", "view_as", "expand_as", "_to_copy_noop", "is_same_size", "sym_size",
         "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "dim", "numel", "is_nonzero", "item",
         "_local_scalar_dense", "empty_like_noop", "promote_types"}
ALLOCS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}  # memory, no kernel: apart


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in VIEWS:
            self.ops["(allocations)" if name in ALLOCS else name] += 1
        return func(*args, **(kwargs or {}))


def count(method: str, backend: str, feature_cache: bool | None, prompt: int, steps: int | None,
          scope: str = "attend", fused: bool = False, dtype: str = "float32"):
    import longctx_patch as lp
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=128, hidden_size=2048, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval().to(getattr(torch, dtype))
    kw = dict(window=64, chunk=64, feature_dim=64, backend=backend, checkpoint="none")
    if method == "lola":
        kw["sparse_cache"] = 64
    if feature_cache is not None:
        kw["feature_cache"] = feature_cache
    lp.patch(model, method, decode_graphs=False, fused_ops="triton" if fused else False, **kw)
    layer = model.model.layers[0]
    target = layer.self_attn if scope == "attend" else layer
    name = "attend" if scope == "attend" else "forward"
    counter = Counter()
    per_step = []
    orig_attend = getattr(target, name)
    state = {"on": False, "inside": False}

    def attend(*a, **k):
        if not state["on"]:
            return orig_attend(*a, **k)
        state["inside"] = True
        try:
            with counter:
                return orig_attend(*a, **k)
        finally:
            state["inside"] = False

    setattr(target, name, attend)
    launches = collections.Counter()
    import triton.runtime.interpreter as ti

    orig_run = ti.InterpretedFunction.run

    def run(self, *a, **k):
        if state["inside"]:
            launches[self.fn.__name__] += 1
        counter.paused += 1
        try:
            return orig_run(self, *a, **k)
        finally:
            counter.paused -= 1

    ti.InterpretedFunction.run = run
    try:
        ids = torch.randint(3, 100, (1, prompt))
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache = out.past_key_values
            for i in range(steps or kw["chunk"]):
                counter.ops.clear()
                launches.clear()
                state["on"] = True
                out = model(torch.randint(3, 100, (1, 1)), past_key_values=cache, use_cache=True)
                state["on"] = False
                cache = out.past_key_values
                allocs = counter.ops.pop("(allocations)", 0)
                per_step.append({"seen": cache.get_seq_length(), "aten": sum(counter.ops.values()), "allocs": allocs,
                                 "triton": sum(launches.values()), "ops": dict(counter.ops),
                                 "kernels": dict(launches)})
    finally:
        ti.InterpretedFunction.run = orig_run
    chunk = kw["chunk"]
    total = [p["aten"] + p["triton"] for p in per_step]
    ev = [t for t, p in zip(total, per_step) if p["seen"] % chunk == 0]
    plain = [t for t, p in zip(total, per_step) if p["seen"] % chunk != 0]
    return {"method": method, "backend": backend, "feature_cache": feature_cache, "scope": scope, "fused_ops": fused,
            "dtype": dtype,
            "mean_per_step": sum(total) / len(total), "plain_step": sorted(set(plain)), "eviction_step": sorted(set(ev)),
            "plain_example": next(p for p in per_step if p["seen"] % chunk != 0 and p["seen"] % chunk > 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="triton", choices=("triton", "torch"))
    ap.add_argument("--methods", default="lola,lolcats")
    ap.add_argument("--feature-cache", default="both", choices=("both", "on", "off", "default"))
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--scope", default="attend", choices=("attend", "layer"))
    ap.add_argument("--fused-ops", default="off", choices=("both", "on", "off"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = ap.parse_args()
    fcs = {"both": [True, False], "on": [True], "off": [False], "default": [None]}[a.feature_cache]
    fused = {"both": [False, True], "on": [True], "off": [False]}[a.fused_ops]
    for m in a.methods.split(","):
        for fc in fcs:
            for f in fused:
                r = count(m, a.backend, fc, a.prompt, a.steps, a.scope, f, a.dtype)
                print(json.dumps(r))


if __name__ == "__main__":
    main()
