"""Speed and memory.

Model level (any device): `speed_model.py` (`run_speed` here is `speed_model.run_model_speed`): prefill, the
decode speed of whole `generate()` calls, the bytes floor of a step and memory, per method, batch and context.

Op level (CUDA only): the method's attention op against torch SDPA with the cuDNN and flash backends
(and flash-linear-attention's chunked linear attention when `fla` is installed) on random
`[1, heads, L, head_dim]` inputs, forward and forward+backward, timed with `triton.testing.do_bench`
(median) in the same process; ratios are method time / baseline time.

A method takes part in op-level timing through a classmethod of its `PatchedAttention` subclass:
``op(q, k, v, *, scale, config) -> o`` with q `[B, Hq, S, D]`, k/v `[B, Hkv, S, D]` (causal attention
over one whole sequence, no cache, no padding) returning `[B, S, Hq, D]`, differentiable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import ConfigError, DeviceError
from .common import RESULTS_DEFAULT, output_dir, MethodRun, begin_run, format_table, size_label, write_result
from .speed_model import run_model_speed as run_speed


# ----------------------------------------------------------------------------------------------- op level
def method_op(name: str) -> Callable:
    """The `op(q, k, v, *, scale, config)` classmethod of a method's module, or ConfigError."""
    from ..methods import get_method

    op = getattr(get_method(name).module_cls, "op", None)
    if op is None:
        raise ConfigError(
            f"method {name!r} has no op-level entry point; its PatchedAttention subclass needs a classmethod "
            "op(q, k, v, *, scale, config) returning [B, S, Hq, D]"
        )
    return op


def baselines(q, k, v, scale: float) -> dict[str, Callable[[], Any]]:
    """Exact causal attention baselines available on this GPU: torch SDPA (cuDNN, flash), fla if installed.

    K/V are expanded to the query heads once, outside the timed region (SDPA kernels then run plain MHA).
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = q.shape[1] // k.shape[1]
    ke = k.repeat_interleave(rep, 1).detach().requires_grad_(k.requires_grad)
    ve = v.repeat_interleave(rep, 1).detach().requires_grad_(v.requires_grad)
    out: dict[str, Callable[[], Any]] = {}
    for label, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):

        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, ke, ve, is_causal=True, scale=scale)

        out[label] = fn
    try:  # flash-linear-attention's chunked linear attention, the usual linear-time baseline
        from fla.ops.linear_attn import chunk_linear_attn

        qt, kt, vt = (t.transpose(1, 2) for t in (q, ke, ve))  # fla wants [B, T, H, D]

        def fla_fn():
            return chunk_linear_attn(qt, kt, vt, normalize=False)[0]

        out["fla-linear"] = fla_fn
    except Exception:  # noqa: BLE001 - optional: absent or a different API version
        pass
    return out


def time_ops(
    ops: dict[str, tuple[Callable, Any]],
    lengths: Sequence[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype,
    modes: Sequence[str],
    device,
    bench: Callable[[Callable[[], Any]], float],
    check: bool = True,
    echo=print,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Times each `ops[label] = (op, config)` and the exact baselines at each length and mode with
    `bench(fn) -> ms`. Returns {length: {mode: {label: {"ms", "ratio_vs_<baseline>", ...}}}}; a baseline
    or op that fails records its error instead of a time. With `check`, the forward output of each op is
    compared with the first exact baseline that ran (relative Frobenius error)."""
    import torch

    scale = head_dim**-0.5
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for L in lengths:
        gen = torch.Generator(device=device).manual_seed(L)
        q = torch.randn(1, heads, L, head_dim, device=device, dtype=dtype, generator=gen)
        k = torch.randn(1, kv_heads, L, head_dim, device=device, dtype=dtype, generator=gen)
        v = torch.randn(1, kv_heads, L, head_dim, device=device, dtype=dtype, generator=gen)
        for mode in modes:
            bwd = mode == "fwd+bwd"
            qq, kk, vv = (t.detach().requires_grad_(bwd) for t in (q, k, v))
            fns: dict[str, Callable[[], Any]] = {}
            for lab, (op, cfg) in ops.items():
                fns[lab] = lambda op=op, cfg=cfg: op(qq, kk, vv, scale=scale, config=cfg)
            fns.update(baselines(qq, kk, vv, scale))
            row: dict[str, Any] = {}
            ref_out = None
            for lab, fn in fns.items():
                try:
                    if bwd:
                        with torch.no_grad():
                            g = torch.randn_like(fn())

                        def step(fn=fn, g=g):
                            fn().backward(g)
                            qq.grad = kk.grad = vv.grad = None

                        ms = bench(step)
                    else:
                        with torch.no_grad():
                            ms = bench(fn)
                            if check and ref_out is None and lab.startswith("sdpa-"):
                                ref_out = fn().transpose(1, 2).float()  # [B, S, H, D] like the ops
                    row[lab] = {"ms": round(float(ms), 4)}
                except Exception as e:  # noqa: BLE001 - one failing backend must not hide the others
                    row[lab] = {"ms": None, "error": (str(e).strip().splitlines() or [type(e).__name__])[0][:200]}
                finally:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            if ref_out is not None:
                with torch.no_grad():
                    for lab, (op, cfg) in ops.items():
                        if row[lab]["ms"] is not None:
                            o = op(qq, kk, vv, scale=scale, config=cfg).float()
                            row[lab]["rel_error_vs_exact"] = round(float((o - ref_out).norm() / ref_out.norm()), 6)
            exact_ms = [(r["ms"], b) for b, r in row.items() if b.startswith("sdpa-") and r["ms"] is not None]
            best = min(exact_ms) if exact_ms else None
            for lab in ops:
                if row[lab]["ms"] is None:
                    continue
                for b in row:
                    if b not in ops and row[b]["ms"]:
                        row[lab][f"ratio_vs_{b}"] = round(row[lab]["ms"] / row[b]["ms"], 4)
                if best is not None:
                    row[lab]["ratio_vs_best_exact"] = round(row[lab]["ms"] / best[0], 4)
                    row[lab]["best_exact"] = best[1]
            results.setdefault(size_label(L), {})[mode] = row
            echo(f"  L={size_label(L)} {mode}: " + ", ".join(f"{b} {r['ms']}" for b, r in row.items()))
            del qq, kk, vv, fns, ref_out
        del q, k, v
    return results


def run_op_speed(
    methods: Sequence[MethodRun],
    *,
    lengths: Sequence[int] = (4096, 16384, 65536, 131072),
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 64,
    dtype: str = "bfloat16",
    modes: Sequence[str] = ("fwd", "fwd+bwd"),
    check: bool = True,
    out_dir=RESULTS_DEFAULT,
    name: str | None = None,
    command: str | None = None,
    echo=print,
) -> dict[str, Any]:
    """Op-level timing on CUDA: each method's op vs SDPA cuDNN/flash (+fla), fwd and fwd+bwd."""
    import torch

    if not torch.cuda.is_available():
        raise DeviceError(
            "op-level timing needs a CUDA GPU (it times attention kernels against cuDNN/flash SDPA); "
            "run it on a GPU machine, or drop --op to time the whole model on this device"
        )
    if heads % kv_heads:
        raise ConfigError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    bad_modes = set(modes) - {"fwd", "fwd+bwd"}
    if bad_modes:
        raise ConfigError(f"unknown mode(s) {', '.join(sorted(bad_modes))}; use fwd and/or fwd+bwd")
    from triton.testing import do_bench

    from ..methods import get_method
    from ..models import resolve_dtype

    dt = resolve_dtype(dtype)
    model_name = begin_run("(none: random tensors)", None)
    ops = {}
    for r in methods:
        if not r.patched:
            raise ConfigError("op-level timing compares patched methods; drop --method none")
        ops[r.label] = (method_op(r.name), get_method(r.name).parse_config(r.config))
    results = time_ops(
        ops, lengths, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dt, modes=modes,
        device=torch.device("cuda"), bench=lambda fn: do_bench(fn, return_mode="median"), check=check, echo=echo,
    )
    labels = [r.label for r in methods]
    figures = {
        "level": "op",
        "lengths": list(lengths),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": str(dt).replace("torch.", ""),
        "modes": list(modes),
        "timer": "triton.testing.do_bench median (ms)",
        "results": results,
    }
    header = ["L", "mode"] + [f"{lab} ms" for lab in labels] + ["sdpa-cudnn ms", "sdpa-flash ms"] + [f"{lab}/best" for lab in labels]
    table = []
    for L in lengths:
        for mode in modes:
            row = results[size_label(L)][mode]
            table.append(
                [size_label(L), mode]
                + [row[lab]["ms"] for lab in labels]
                + [row["sdpa-cudnn"]["ms"], row["sdpa-flash"]["ms"]]
                + [row[lab].get("ratio_vs_best_exact") for lab in labels]
            )
    echo(format_table(header, table))
    result = {"figures": figures}
    out_dir = output_dir(out_dir, "speed-op")
    if out_dir is not None:
        stem = name or "speed-op-" + "+".join(r.name for r in methods) + f"-h{heads}-kv{kv_heads}-d{head_dim}"
        path = write_result(
            Path(out_dir) / f"{stem}.json", task="speed-op", model=model_name, runs=methods, figures=figures, command=command
        )
        echo(f"wrote {path}")
        result["json"] = str(path)
    return result


__all__ = ["run_speed", "method_op", "baselines", "time_ops", "run_op_speed"]
