"""Compile the LoLA Triton kernels for sm_90 without a GPU; run as a script (the interpreter must be off).

    python tests/compile_sm90.py        # prints one JSON object: kernel case -> {"shared": bytes} or {"error": ...}

Used by tests/test_kernels_compile.py, which runs it in a subprocess because the test session itself runs
Triton through the interpreter (TRITON_INTERPRET=1 is read when triton is imported).
"""

import json
import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from longctx_patch.kernels.lola import triton_kernels as tk  # noqa: E402

FLOAT_SCALARS = {"eps", "scale_log2"}
F32, BF16, I8, I32 = "*fp32", "*bf16", "*i8", "*i32"


def compile_kernel(kernel, consts: dict, ptrs: dict, options: dict):
    """ptrs: every pointer argument and its type; other runtime arguments are i32 (fp32 for FLOAT_SCALARS)."""
    names = kernel.arg_names
    consts = dict(consts)
    if "UPCAST" in names:
        consts.setdefault("UPCAST", False)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in FLOAT_SCALARS else "i32") for n in names}
    unknown = set(ptrs) - set(names)
    if unknown:
        raise ValueError(f"not arguments of {kernel.fn.__name__}: {sorted(unknown)}")
    src = ASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def bf16(*names, **other):
    return {**{n: BF16 for n in names}, **other}


CASES = {
    "chunk_sums": (tk._chunk_sums_kernel, dict(HQ=32, CS=256, BT=64, BK=64, BV=64, NV=1, HAS_KM=True, PREC="tf32"),
                   bf16("FK", "V", KM=I8, OUT=F32, OUTS=F32), {}),
    "hybrid_fwd_lola_D128": (tk._hybrid_fwd_kernel,
                             dict(HQ=32, BM=64, BN=64, BD=128, BF=128, BKS=32, CS=256, PER_BLOCK=True, HAS_KM=True,
                                  HAS_SP=True, PREC="tf32"),
                             bf16("Q", "K", "V", "FQ", "FK", "SPK", "SPV", "O", KM=I8, SPM=I8, GW=F32, LFW=F32,
                                  HS=F32, SS=F32), {"num_stages": 2}),
    "hybrid_fwd_fp32": (tk._hybrid_fwd_kernel,
                        dict(HQ=8, BM=64, BN=64, BD=64, BF=64, BKS=32, CS=1, PER_BLOCK=False, HAS_KM=False,
                             HAS_SP=False, PREC="ieee"),
                        {**{n: F32 for n in ("Q", "K", "V", "FQ", "FK", "O", "GW", "LFW", "HS", "SS", "SPK", "SPV")},
                         "KM": I8, "SPM": I8}, {"num_stages": 2}),
    "sre": (tk._sre_kernel, dict(HQ=32, BN=64, BD=128, BK=64, HAS_VALID=True, PREC="ieee"),
            bf16("FK", "V", VALID=I8, H=F32, S=F32, OUT=F32), {}),
    "fold": (tk._fold_kernel, dict(HQ=32, BN=64, BK=32, BV=32, PREC="ieee"), bf16("FK", "V", W=F32, H=F32, S=F32), {}),
    "decode": (tk._decode_kernel, dict(HQ=32, BN=64, BD=128, BK=64, HAS_KM=True, HAS_SP=True),
               bf16("Q", "K", "V", "FQ", "FK", "SPK", "SPV", "O", KM=I8, SPM=I8, GW=F32, LFW=F32, H=F32, S=F32), {}),
    "feature_map": (tk._feature_map_kernel, dict(H=32, BM=64, BD=128, BF=64, PREC="tf32"), bf16("X", "W", "O"), {}),
    "ev_score": (tk._ev_score_kernel, dict(HQ=32, BN=64, BD=128, BK=64, HAS_KM=True, PREC="ieee"),
                 bf16("FK", "V", CNT=I32, SPIDX=I32, KM=I8, HALL=F32, SALL=F32, SC=F32), {}),
    "ev_select": (tk._ev_select_kernel, dict(HS=8, GS=4, NCP=2048, HAS_KM=True),
                  dict(CNT=I32, SPIDX=I32, KM=I8, SPSC=F32, SC=F32, WF=F32), {"num_warps": 16}),
    "ev_fold": (tk._ev_fold_kernel, dict(HQ=32, BN=128, BK=32, BV=32, HAS_KM=True, PREC="tf32"),
                bf16("FK", "V", CNT=I32, SPIDX=I32, KM=I8, WF=F32, HALL=F32, SALL=F32), {}),
    "local_states": (tk._local_states_kernel,
                     dict(HQ=32, CS=256, BT=64, BK=64, BV=64, NV=2, HAS_KM=True, PREC="tf32"),
                     bf16("FK", "V", KM=I8, HALL=F32, SALL=F32, HS=F32, SS=F32), {}),
}


def main():
    out = {}
    for name, (kernel, consts, ptrs, options) in CASES.items():
        try:
            k = compile_kernel(kernel, consts, ptrs, options)
            out[name] = {"shared": int(k.metadata.shared), "cubin_bytes": len(k.asm.get("cubin", b""))}
        except Exception as e:  # noqa: BLE001 - reported per kernel
            out[name] = {"error": f"{type(e).__name__}: {e}"[-3000:], "trace": traceback.format_exc()[-2000:]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
