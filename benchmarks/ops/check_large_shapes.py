"""Each Triton kernel family once at a shape where some tensor has >= 2^31 elements (docs/PERFORMANCE.md, "Large
shapes: 64-bit offsets and grid limits"): the crash of 2026-12-02 ("an illegal memory access", lola at batch
16 x 32k) and its neighbours. Each case runs in its own subprocess, so a crash ends only that case; optionally
under `compute-sanitizer --tool memcheck` (`--memcheck`; slow: pick one case with `--only`).

    python3 -m benchmarks.ops.check_large_shapes                         # every case, < 8 min on an H200 (the timeouts)
    python3 -m benchmarks.ops.check_large_shapes --only lola_prefill --memcheck
    python3 -m benchmarks.ops.check_large_shapes --list                  # the cases and their shapes (no GPU needed)

Cases (Llama-3.2-1B heads unless said: 32 q / 8 kv heads):
  lola_prefill    LoLA fresh Triton prefill (`prefill.lola_parallel`), batch 16 x 32k, D 64, feature dim 64 (F2 128):
                  phi(k) has B Hq S F2 = 2^31 elements, H_all 513 slots of 2^22
  lolcats_hybrid  LoLCATs hybrid prefill, batch 16 x 32k, D 64, F2 128: phi(q), phi(k) 2^31 elements
  decode_exact    exact few-query decode kernel on a batch 64 x 32k cache, D 128: k, v have 2^31 elements
  lola_decode     LoLA decode steps at batch 64 after a 2-chunk prefill (the decode kernel's batch x head bases)
  muse_prefill    MuSe forward at 128k, batch 4, D 128: q has 2^31 elements
  ovq_prefill     OVQ fused prefill at 128k, batch 4, D 128: q has 2^31 elements

Check of each case: the inputs of the last batch row are a copy of the first's, so its output must equal the
first row's (an offset that wrapped reads or writes another row: a crash, or a mismatch). Status per case: ok,
mismatch, nonfinite, oom, error (a Python exception), crash (the process died: rc < 0 or a CUDA error),
timeout. Writes <out>/large-shapes-<device>.json (default benchmarks/results/racecheck/; $OUT on the device
machine) with device, date, commit ($LONGCTX_COMMIT or git), command and the cases.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# --smoke (tests/test_evals.py): every case at tiny shapes on the CPU under the Triton interpreter, to check the
# script itself; the children read it from the environment
SMOKE = os.environ.get("LARGE_SHAPES_SMOKE") == "1"
DEV = "cpu" if SMOKE else "cuda"


def sz(full: int, small: int) -> int:
    return small if SMOKE else full

# name -> (shape description, default per-case timeout in seconds)
CASES = {
    "lola_prefill": ("B16 Hq32 Hkv8 S32k D64 F2=128 chunk64 window64 lam64 bf16", 120),
    "lolcats_hybrid": ("B16 Hq32 Hkv8 S32k D64 F2=128 window64 bf16", 60),
    "decode_exact": ("B64 Hq32 Hkv8 Sk32k Sq1 D128 bf16", 45),
    "lola_decode": ("B64 Hq32 Hkv8 S128+4 steps D64 F2=128 chunk64 lam64 bf16", 45),
    "muse_prefill": ("B4 Hq32 Hkv8 S128k D128 bf16, defaults (cells far field)", 90),
    "ovq_prefill": ("B4 Hq32 Hkv8 S128k D128 bf16 chunk512 max_centroids4096", 120),
}


def _mirror_row(*xs):
    """Copies batch row 0 into the last row of each tensor (in place)."""
    for x in xs:
        if x is not None:
            x[-1].copy_(x[0])


def _compare(o, dim: int = 0) -> dict:
    """Row 0 against the last row of o along `dim`, and whether o is finite."""
    import torch

    a, b = o.select(dim, 0).double(), o.select(dim, o.shape[dim] - 1).double()
    rel = float((a - b).norm() / a.norm().clamp_min(1e-30))
    return {"finite": bool(torch.isfinite(o).all()), "row_rel_diff": rel}


def _sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def _randn(g, *shape, dtype):
    import torch

    return torch.randn(*shape, device=DEV, generator=g).to(dtype)


def _lola_inputs(B, S, Hq=32, Hkv=8, D=64, F=64, seed=0):
    import torch
    from longctx_patch.kernels.lola import reference as ref

    g = torch.Generator(device=DEV).manual_seed(seed)
    dt = torch.bfloat16
    q, k, v = _randn(g, B, Hq, S, D, dtype=dt), _randn(g, B, Hkv, S, D, dtype=dt), _randn(g, B, Hkv, S, D, dtype=dt)
    _mirror_row(q, k, v)
    Wq = torch.randn(Hq, D, F, device=DEV, generator=g) * D ** -0.25
    Wk = torch.randn(Hq, D, F, device=DEV, generator=g) * D ** -0.25
    fq = ref.hedgehog_feature_map(q, Wq, out_dtype=dt)
    gw = torch.sigmoid(torch.randn(Hq, device=DEV, generator=g))
    lf = torch.ones(Hq, device=DEV)
    return q, k, v, fq, Wk, gw, lf


def case_lola_prefill() -> dict:
    import torch
    from longctx_patch.kernels.lola import reference as ref
    from longctx_patch.kernels.lola import LolaRun, LolaState, StateSizes, lola_process

    B, S, Hq, Hkv, D = 16, sz(32768, 192), sz(32, 4), sz(8, 2), 64
    q, k, v, fq, Wk, gw, lf = _lola_inputs(B if not SMOKE else 2, S, Hq, Hkv)
    B = q.shape[0]
    phi_k = lambda x: ref.hedgehog_feature_map(x, Wk, out_dtype=q.dtype)  # noqa: E731
    st = LolaState.empty(StateSizes(B, Hq, Hkv, D, 2 * Wk.shape[-1], 64), q.dtype, DEV)
    run = LolaRun(phi_k=phi_k, window=64, chunk=64, lam=64, scale=D ** -0.5, backend="triton")
    with torch.no_grad():
        o = lola_process(st, q, k, v, fq, gw, lf, run)
    _sync()
    return {**_compare(o), "state_H": _compare(st.H)}


def case_lolcats_hybrid() -> dict:
    import torch
    from longctx_patch.kernels.lola import reference as ref
    from longctx_patch.kernels.lola.ops import hybrid_attention

    B, S, D = sz(16, 2), sz(32768, 192), 64
    q, k, v, fq, Wk, gw, lf = _lola_inputs(B, S, sz(32, 4), sz(8, 2), seed=1)
    fk = ref.hedgehog_feature_map(k, Wk, out_dtype=q.dtype)
    with torch.no_grad():
        o = hybrid_attention(q, k, v, fq, fk, gw, lf, ref.HybridSpec(window=64, scale=D ** -0.5, backend="triton"))
    _sync()
    return _compare(o)


def case_decode_exact() -> dict:
    import torch
    from longctx_patch.kernels.decode.ops import masked_few_query_attention

    B, Hq, Hkv, Sk, D = sz(64, 2), sz(32, 4), sz(8, 2), sz(32768, 300), 128
    g = torch.Generator(device=DEV).manual_seed(2)
    dt = torch.bfloat16
    q = _randn(g, B, Hq, 1, D, dtype=dt)
    k = torch.empty(B, Hkv, Sk, D, device=DEV, dtype=dt).normal_(generator=g)
    v = torch.empty(B, Hkv, Sk, D, device=DEV, dtype=dt).normal_(generator=g)
    _mirror_row(q, k, v)
    km = torch.ones(B, Sk, dtype=torch.bool, device=DEV)
    with torch.no_grad():
        o = masked_few_query_attention(q, k, v, scale=D ** -0.5, key_mask=km)
        o_many = masked_few_query_attention(q, k, v, scale=D ** -0.5, splits=sz(512, 4))  # more split partials
    _sync()
    return {**_compare(o), "splits_512": _compare(o_many)}


def case_lola_decode() -> dict:
    import torch
    from longctx_patch.kernels.lola import reference as ref
    from longctx_patch.kernels.lola import LolaRun, LolaState, StateSizes, lola_process

    B, S, steps, Hq, Hkv, D = sz(64, 2), 128, sz(4, 2), sz(32, 4), sz(8, 2), 64
    q, k, v, fq, Wk, gw, lf = _lola_inputs(B, S + steps, Hq, Hkv, seed=3)
    phi_k = lambda x: ref.hedgehog_feature_map(x, Wk, out_dtype=q.dtype)  # noqa: E731
    st = LolaState.empty(StateSizes(B, Hq, Hkv, D, 2 * Wk.shape[-1], 64), q.dtype, DEV)
    run = LolaRun(phi_k=phi_k, window=64, chunk=64, lam=64, scale=D ** -0.5, backend="triton")
    outs = []
    with torch.no_grad():
        lola_process(st, q[:, :, :S], k[:, :, :S], v[:, :, :S], fq[:, :, :S], gw, lf, run)
        for i in range(S, S + steps):
            sl = slice(i, i + 1)
            outs.append(lola_process(st, q[:, :, sl], k[:, :, sl], v[:, :, sl], fq[:, :, sl], gw, lf, run))
    _sync()
    return _compare(torch.cat(outs, 1))


def case_muse_prefill() -> dict:
    import torch
    from longctx_patch.kernels.muse import MuseOptions, muse_attention

    B, Hq, Hkv, S, D = sz(4, 2), sz(32, 4), sz(8, 2), sz(131072, 300), sz(128, 64)
    g = torch.Generator(device=DEV).manual_seed(4)
    dt = torch.bfloat16
    q, k, v = _randn(g, B, Hq, S, D, dtype=dt), _randn(g, B, Hkv, S, D, dtype=dt), _randn(g, B, Hkv, S, D, dtype=dt)
    _mirror_row(q, k, v)
    with torch.no_grad():
        o = muse_attention(q, k, v, scale=D ** -0.5, options=MuseOptions(far_field="cells"), backend="triton")
    _sync()
    return _compare(o)


def case_ovq_prefill() -> dict:
    import torch
    from longctx_patch.kernels.ovq import ovq_attention

    B, Hq, Hkv, S, D = sz(4, 2), sz(32, 4), sz(8, 2), sz(131072, 200), sz(128, 64)
    g = torch.Generator(device=DEV).manual_seed(5)
    dt = torch.bfloat16
    q = torch.nn.functional.normalize(_randn(g, B, Hq, S, D, dtype=torch.float32), dim=-1).to(dt) * 4
    k, v = _randn(g, B, Hkv, S, D, dtype=dt), _randn(g, B, Hkv, S, D, dtype=dt)
    _mirror_row(q, k, v)
    with torch.no_grad():
        o, *_ = ovq_attention(q, k, v, None, None, None, chunk_size=sz(512, 64), max_centroids=sz(4096, 96),
                              growth=sz(1024, 32),
                              backend="triton")
    _sync()
    return _compare(o)


def _status(res: dict) -> str:
    """ok / nonfinite / mismatch from a case's comparisons (nested ones included)."""
    comps = [res] + [v for v in res.values() if isinstance(v, dict)]
    if not all(c.get("finite", True) for c in comps):
        return "nonfinite"
    if any(c.get("row_rel_diff", 0.0) > 1e-2 for c in comps):
        return "mismatch"
    return "ok"


def run_child(name: str) -> int:
    """Runs one case in this process; prints one JSON line (the parent reads the last such line)."""
    import torch

    t0 = time.perf_counter()
    try:
        res = globals()[f"case_{name}"]()
        rec = {"case": name, "status": _status(res), **res}
    except torch.cuda.OutOfMemoryError as e:
        rec = {"case": name, "status": "oom", "error": str(e)[:500]}
    except Exception as e:  # noqa: BLE001 - one line per case; a CUDA fault is "crash"
        msg = f"{type(e).__name__}: {e}"
        crash = "illegal memory access" in msg or "CUDA error" in msg or "unspecified launch" in msg
        rec = {"case": name, "status": "crash" if crash else "error", "error": msg[-1500:],
               "traceback": traceback.format_exc()[-2500:]}
    rec["case_s"] = round(time.perf_counter() - t0, 2)
    print("LARGE_SHAPES " + json.dumps(rec), flush=True)
    return 0 if rec["status"] == "ok" else 1


def child_command(name: str, memcheck: bool, sanitizer: str = "compute-sanitizer") -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.ops.check_large_shapes", "--child", name]
    return ([sanitizer, "--tool", "memcheck", "--error-exitcode", "99"] if memcheck else []) + cmd


def parse_child(name: str, rc: int | None, stdout: str, stderr: str, wall: float) -> dict:
    """A case's record from its process: its JSON line when it printed one, else crash / timeout."""
    rec = None
    for line in stdout.splitlines():
        if line.startswith("LARGE_SHAPES "):
            rec = json.loads(line[len("LARGE_SHAPES "):])
    if rc is None:
        rec = {**(rec or {}), "case": name, "status": "timeout"}
    elif rec is None:
        rec = {"case": name, "status": "crash"}
    elif rc != 0 and rec["status"] == "ok":
        rec["status"] = "memcheck" if rc == 99 else "crash"  # memcheck's error exit, or a fault after the check
    rec["rc"] = rc
    rec["wall_s"] = round(wall, 1)
    if rec["status"] != "ok":
        rec["stderr_tail"] = stderr[-2000:]
    return rec


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(CASES), help="comma-separated cases: " + ", ".join(CASES))
    ap.add_argument("--memcheck", action="store_true", help="run each case under compute-sanitizer --tool memcheck")
    ap.add_argument("--sanitizer", default="compute-sanitizer", help="the compute-sanitizer binary")
    ap.add_argument("--timeout", type=float, default=0, help="seconds per case (default: each case's own)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT, else "
                    "benchmarks/results/racecheck)")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter): checks the "
                    "script, not the kernels' offsets")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.cases = [c for c in a.only.split(",") if c]
    unknown = [c for c in a.cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        return run_child(a.child)
    if a.list:
        for name in a.cases:
            print(f"{name:15} {CASES[name][0]}  (timeout {CASES[name][1]} s)")
        return 0
    import torch

    from benchmarks.shared import device_token, results_dir
    from longctx_patch.provenance import device_description, git_commit

    if not torch.cuda.is_available() and not a.smoke:
        print("large_shapes needs a CUDA GPU (use --list to see the cases, --smoke for a CPU run)", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if a.smoke:
        env.update(LARGE_SHAPES_SMOKE="1", TRITON_INTERPRET="1")
    else:
        env.pop("TRITON_INTERPRET", None)
    cases = {}
    for name in a.cases:
        timeout = a.timeout or CASES[name][1] * (20 if a.memcheck else 1)
        t0 = time.perf_counter()
        try:
            r = subprocess.run(child_command(name, a.memcheck, a.sanitizer), cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=timeout)
            rc, out, err = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = None, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
                else (e.stdout or ""), (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) \
                else (e.stderr or "")
        cases[name] = parse_child(name, rc, out, err, time.perf_counter() - t0)
        cases[name]["shape"] = CASES[name][0]
        print(json.dumps({k: v for k, v in cases[name].items() if k != "stderr_tail"}), flush=True)
    argv_s = " ".join(shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    rec = {"task": "racecheck",
           "device": device_description("cpu" if a.smoke else "cuda"), "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
           "command": f"python3 -m benchmarks.ops.check_large_shapes {argv_s}".strip(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "memcheck": a.memcheck, "cases": cases}
    # letters, digits and '-' only: the results index's names, and what a device call hands back
    what = "all" if a.cases == list(CASES) else "-".join(c.replace("_", "-") for c in a.cases)
    tags = ("-memcheck" if a.memcheck else "") + ("-smoke" if a.smoke else "")
    name = f"large-shapes-{what}{tags}-{device_token(device)}.json"
    path = results_dir("racecheck", a.out) / name
    path.write_text(json.dumps(rec, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if all(c["status"] == "ok" for c in cases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
