"""Attention fidelity: how far a method's attention output is from exact softmax attention.

Real inputs: the model is patched with `exact`, one forward pass over `length` tokens of a text runs
without a cache, and each layer's post-rotary q, k, v (what `PatchedAttention.attend` receives) and its
exact output are kept. Each method is then patched in turn and its `attend` is called on the same
tensors (no cache, no padding). Per layer the relative error is
``||O_method - O_exact||_F / ||O_exact||_F`` over every position and head (nothing excluded).

Synthetic inputs: q, k, v drawn from N(0, 1) with the model's head layout at each of `lengths`,
fed to the `attend` of the method's first patched layer, compared with exact softmax attention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError
from .common import RESULTS_DEFAULT, output_dir, MethodRun, applied, begin_run, default_name, format_table, load_model, pyplot, size_label, write_result


def relative_error(o, ref) -> float:
    """||o - ref||_F / ||ref||_F, computed in float64."""
    o, ref = o.double(), ref.double()
    diff, denom = float((o - ref).norm()), float(ref.norm())
    if denom == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / denom


def _modules(model) -> dict[int, Any]:
    from ..patcher import patched_modules

    return patched_modules(model)


def capture(model, input_ids, layers=None) -> dict[int, tuple]:
    """{layer: (q, k, v, o_exact)} from one forward pass of `model` patched with `exact` on `layers`."""
    import torch

    import longctx_patch as lp

    captured: dict[int, tuple] = {}
    lp.patch(model, "exact", layers=layers)
    try:
        for idx, mod in _modules(model).items():
            orig = mod.attend

            def attend(q, k, v, cache_layer, padding, _orig=orig, _idx=idx):
                o = _orig(q, k, v, cache_layer, padding)
                captured[_idx] = (q.detach(), k.detach(), v.detach(), o.detach())
                return o

            mod.attend = attend
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for mod in _modules(model).values():
            mod.__dict__.pop("attend", None)
        lp.unpatch(model)
    return captured


def run_approx(
    model,
    methods: Sequence[MethodRun],
    docs: Sequence[str] | None,
    *,
    length: int = 2048,
    lengths: Sequence[int] = (),
    layers=None,
    seed: int = 0,
    out_dir=RESULTS_DEFAULT,
    name: str | None = None,
    model_name: str | None = None,
    source: str = "",
    command: str | None = None,
    echo=print,
) -> dict[str, Any]:
    """Per-layer relative error on real q/k/v (from `length` tokens of `docs`) and on random inputs at
    `lengths`, for each method; writes `<name>.json` + `<name>.png` (error per layer)."""
    import torch

    from .ppl import token_stream

    for r in methods:
        if not r.patched:
            raise ConfigError("approx compares patched methods with exact attention; drop --method none")
    model_name = begin_run(model, model_name)
    mdl, tok = load_model(model)
    device = next(mdl.parameters()).device
    was_training = mdl.training
    mdl.eval()
    labels = [r.label for r in methods]
    per_layer: dict[str, dict[str, float]] = {}
    mean_err: dict[str, float | None] = {}
    synthetic: dict[str, dict[str, float]] = {lab: {} for lab in labels}
    try:
        real_tokens = 0
        if docs is not None:
            stream = token_stream(tok, docs)
            if len(stream) < length:
                raise ConfigError(f"the text has {len(stream)} tokens, fewer than --length {length}; give more text")
            ids = torch.tensor([stream[:length]], device=device)
            real_tokens = length
            cap = capture(mdl, ids, layers=layers)
            for run in methods:
                with applied(mdl, run, layers=layers):
                    mods = _modules(mdl)
                    errs = {}
                    with torch.no_grad():
                        for idx, (q, k, v, o_exact) in cap.items():
                            errs[str(idx)] = relative_error(mods[idx].attend(q, k, v, None, None), o_exact)
                per_layer[run.label] = errs
                mean_err[run.label] = sum(errs.values()) / len(errs)
            del cap
        if lengths:
            from ..kernels.softmax import softmax_attention

            gen = torch.Generator(device="cpu").manual_seed(seed)
            dtype = next(mdl.parameters()).dtype
            shapes = None
            inputs = {}
            for run in methods:
                with applied(mdl, run, layers=layers):
                    mod = next(iter(_modules(mdl).values()))
                    if shapes is None:
                        shapes = (mod.num_heads, mod.num_key_value_heads, mod.head_dim)
                        hq, hkv, d = shapes
                        for L in lengths:
                            q = torch.randn(1, hq, L, d, generator=gen).to(device, dtype)
                            k = torch.randn(1, hkv, L, d, generator=gen).to(device, dtype)
                            v = torch.randn(1, hkv, L, d, generator=gen).to(device, dtype)
                            inputs[L] = (q, k, v, softmax_attention(q, k, v, scale=mod.scaling))
                    with torch.no_grad():
                        for L, (q, k, v, ref) in inputs.items():
                            synthetic[run.label][size_label(L)] = relative_error(mod.attend(q, k, v, None, None), ref)
    finally:
        mdl.train(was_training)

    figures: dict[str, Any] = {
        "text": source,
        "length": real_tokens or None,
        "synthetic_lengths": list(lengths),
        "seed": seed,
        "rel_error_per_layer": per_layer,
        "rel_error_mean": mean_err,
        "rel_error_synthetic": synthetic if lengths else {},
    }
    echo(approx_table(figures, labels, lengths))
    result = {"figures": figures}
    out_dir = output_dir(out_dir, "approx")
    if out_dir is not None:
        stem = name or default_name("approx", model_name, methods)
        path = write_result(Path(out_dir) / f"{stem}.json", task="approx", model=model_name, runs=methods, figures=figures, command=command)
        out = {"json": str(path)}
        if per_layer:
            out["png"] = str(plot_error_per_layer(figures, labels, Path(out_dir) / f"{stem}.png"))
        echo("wrote " + " and ".join(out.values()))
        result.update(out)
    return result


def approx_table(figures, labels, lengths) -> str:
    header = ["method"]
    if figures["rel_error_per_layer"]:
        header += ["mean (real)", "max layer (real)"]
    header += [f"synthetic@{size_label(L)}" for L in lengths]
    rows = []
    for lab in labels:
        row = [lab]
        if figures["rel_error_per_layer"]:
            errs = figures["rel_error_per_layer"][lab]
            worst = max(errs, key=errs.get)
            row += [figures["rel_error_mean"][lab], f"{errs[worst]:.4g} (layer {worst})"]
        row += [figures["rel_error_synthetic"][lab][size_label(L)] for L in lengths]
        rows.append(row)
    return format_table(header, rows)


def plot_error_per_layer(figures, labels, path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for lab in labels:
        errs = figures["rel_error_per_layer"][lab]
        ax.plot([int(i) for i in errs], list(errs.values()), marker="o", ms=3, label=lab)
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of attention output")
    ax.set_title(f"attention fidelity on {figures['length']} real tokens", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["relative_error", "capture", "run_approx", "plot_error_per_layer"]
