"""Compile the LoLA, MuSe, OVQ, decode and sliding-window Triton kernels for sm_90 without a GPU; run as a script (the interpreter must be off).

    python tests/compile_sm90.py [--jobs N]   # prints one JSON object: kernel case -> {"shared": bytes} or {"error": ...}

Used by tests/test_kernels_compile.py, which runs it in a subprocess because the test session itself runs
Triton through the interpreter (TRITON_INTERPRET=1 is read when triton is imported).
"""

import json
import os
import re
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from longctx_patch.kernels.decode import triton_decode as dk  # noqa: E402
from longctx_patch.kernels.lola import triton_evict as le  # noqa: E402
from longctx_patch.kernels.lola import triton_feature_map_bwd as lfb  # noqa: E402
from longctx_patch.kernels.lola import triton_hybrid as lh  # noqa: E402
from longctx_patch.kernels.lola import triton_hybrid_bwd as lhb  # noqa: E402
from longctx_patch.kernels.lola import triton_state as ls  # noqa: E402
from longctx_patch.kernels.muse import support as msup  # noqa: E402
from longctx_patch.kernels.muse import triton_cells as mc  # noqa: E402
from longctx_patch.kernels.muse import triton_cluster as mcl  # noqa: E402
from longctx_patch.kernels.muse import triton_guard as mg  # noqa: E402
from longctx_patch.kernels.muse import triton_planned as mk  # noqa: E402
from longctx_patch.kernels.muse import triton_tilted as mt  # noqa: E402
from longctx_patch.kernels.muse import triton_tilted_bwd as mtb  # noqa: E402
from longctx_patch.kernels.ovq import triton_attn as oa  # noqa: E402
from longctx_patch.kernels.ovq import triton_dict as od  # noqa: E402
from longctx_patch.kernels.ovq import triton_fast as of  # noqa: E402
from longctx_patch.kernels.model_ops import triton_model_ops as tf  # noqa: E402
from longctx_patch.kernels.window import triton_window as tw  # noqa: E402

FLOAT_SCALARS = {"eps", "scale_log2"}
F32, BF16, I8, I32, I64 = "*fp32", "*bf16", "*i8", "*i32", "*i64"


def compile_kernel(kernel, consts: dict, ptrs: dict, options: dict):
    """ptrs: every pointer argument and its type (and "fp32" for a float scalar outside FLOAT_SCALARS); other
    runtime arguments are i32 (fp32 for FLOAT_SCALARS). The interpreter flags UP / UPCAST default to False."""
    names = kernel.arg_names
    consts = dict(consts)
    for flag in ("UP", "UPCAST"):
        if flag in names:
            consts.setdefault(flag, False)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in FLOAT_SCALARS else "i32") for n in names}
    unknown = set(ptrs) - set(names)
    if unknown:
        raise ValueError(f"not arguments of {kernel.fn.__name__}: {sorted(unknown)}")
    # pointers 16-byte aligned, as the launches' fresh tensors are: Triton then pipelines the loads (more shared
    # memory); without it the build here can fit where the GPU's does not
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    src = ASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def bf16(*names, **other):
    return {**{n: BF16 for n in names}, **other}


CASES = {
    "chunk_sums": (ls._chunk_sums_kernel, dict(HQ=32, CS=256, BT=64, BK=64, BV=64, NV=1, HAS_KM=True, PREC="tf32"),
                   bf16("FK", "V", KM=I8, OUT=F32, OUTS=F32), {}),
    "hybrid_fwd_lola_D128": (lh._hybrid_fwd_kernel,
                             dict(HQ=32, BM=64, BN=64, BD=128, BF=128, BKS=32, CS=256, PER_BLOCK=True, HAS_KM=True,
                                  HAS_SP=True, PREC="tf32", STATS=False, UNSHIFTED=False),
                             bf16("Q", "K", "V", "FQ", "FK", "SPK", "SPV", "O", KM=I8, SPM=I8, GW=F32, LFW=F32,
                                  HS=F32, SS=F32, MST=F32, RST=F32, AMST=I32), {"num_stages": 2}),
    "hybrid_fwd_fp32": (lh._hybrid_fwd_kernel,
                        dict(HQ=8, BM=64, BN=64, BD=64, BF=64, BKS=32, CS=1, PER_BLOCK=False, HAS_KM=False,
                             HAS_SP=False, PREC="ieee", STATS=False, UNSHIFTED=False),
                        {**{n: F32 for n in ("Q", "K", "V", "FQ", "FK", "O", "GW", "LFW", "HS", "SS", "SPK", "SPV",
                                             "MST", "RST")}, "KM": I8, "SPM": I8, "AMST": I32}, {"num_stages": 2}),
    # the whole-sequence training case (ops.HybridAttentionFn): the forward with the backward's statistics, the
    # backward's three kernels (warps and stages as hybrid_bwd picks them at D = 64: 4 warps, 1 stage)
    "hybrid_fwd_stats_D64": (lh._hybrid_fwd_kernel,
                             dict(HQ=9, BM=64, BN=64, BD=64, BF=128, BKS=32, CS=256, PER_BLOCK=True, HAS_KM=True,
                                  HAS_SP=False, PREC="tf32", STATS=True, UNSHIFTED=False),
                             bf16("Q", "K", "V", "FQ", "FK", "SPK", "SPV", "O", KM=I8, SPM=I8, GW=F32, LFW=F32,
                                  HS=F32, SS=F32, MST=F32, RST=F32, AMST=I32), {"num_stages": 2}),
    "hybrid_bwd_dq_D64": (lhb._dq_kernel,
                          dict(HQ=9, BM=64, BN=64, BD=64, BF=128, BKD=32, CS=256, HAS_KM=True, PREC="tf32"),
                          bf16("Q", "K", "V", "FQ", "FK", "DO", "DQ", "DFQ", KM=I8, GW=F32, LFW=F32, HS=F32, SS=F32,
                               O=F32, MS=F32, RS=F32, AM=I32, DL=F32, DMR=F32, DGL=F32, PH=F32, PS=F32, scale="fp32"),
                          {"num_stages": 1, "num_warps": 4}),
    "hybrid_bwd_state_D64": (lhb._state_grad_kernel, dict(HQ=9, BM=64, CS=256, TF=32, TD=64, ND=1),
                             dict(PH=F32, PS=F32, GH=F32, GS=F32), {"num_warps": 4}),
    "hybrid_bwd_dkv_D64": (lhb._dkv_kernel,
                           dict(HQ=9, HKV=3, BM=64, BN=64, BD=64, BF=128, BKD=32, BKS=32, CS=256, HAS_KM=True,
                                PREC="tf32"),
                           bf16("Q", "K", "V", "FQ", "FK", "DO", "DK", "DV", "DFK", KM=I8, GW=F32, LFW=F32, MS=F32,
                                RS=F32, DL=F32, AM=I32, DMR=F32, GH=F32, GS=F32, scale="fp32"),
                           {"num_stages": 1, "num_warps": 4}),
    "hybrid_bwd_dq_fp32": (lhb._dq_kernel,
                           dict(HQ=9, BM=64, BN=64, BD=64, BF=128, BKD=32, CS=256, HAS_KM=True, PREC="ieee"),
                           {**{n: F32 for n in ("Q", "K", "V", "FQ", "FK", "DO", "GW", "LFW", "HS", "SS", "O", "MS",
                                                "RS", "DL", "DQ", "DFQ", "DMR", "DGL", "PH", "PS")}, "KM": I8,
                            "AM": I32, "scale": "fp32"},
                           {"num_stages": 1, "num_warps": 4}),
    "hybrid_bwd_dkv_fp32": (lhb._dkv_kernel,
                            dict(HQ=9, HKV=3, BM=64, BN=64, BD=64, BF=128, BKD=32, BKS=32, CS=256, HAS_KM=True,
                                 PREC="ieee"),
                            {**{n: F32 for n in ("Q", "K", "V", "FQ", "FK", "DO", "GW", "LFW", "MS", "RS", "DL", "DMR",
                                                 "GH", "GS", "DK", "DV", "DFK")}, "KM": I8, "AM": I32, "scale": "fp32"},
                            {"num_stages": 1, "num_warps": 4}),
    "sre": (le._sre_kernel, dict(HQ=32, BN=64, BD=128, BK=64, HAS_VALID=True, PREC="ieee"),
            bf16("FK", "V", VALID=I8, H=F32, S=F32, OUT=F32), {}),
    "sre_bf16x3": (le._sre_kernel, dict(HQ=32, BN=64, BD=128, BK=64, HAS_VALID=True, PREC="bf16x3"),
                   bf16("FK", "V", VALID=I8, H=F32, S=F32, OUT=F32), {}),
    "fold": (ls._fold_kernel, dict(HQ=32, BN=64, BK=32, BV=32, PREC="ieee"), bf16("FK", "V", W=F32, H=F32, S=F32), {}),
    "decode": (lh._decode_kernel, dict(HQ=32, BN=64, BD=128, BK=64, HAS_KM=True, HAS_SP=True, SP_SCORE=False,
                                        DEV_N=False, UNSHIFTED=False),
               bf16("Q", "K", "V", "FQ", "FK", "SPK", "SPV", "O", KM=I8, SPM=I8, GW=F32, LFW=F32, H=F32, S=F32,
                    NK=I64), {}),
    "decode_device_count": (lh._decode_kernel, dict(HQ=32, BN=64, BD=128, BK=64, HAS_KM=True, HAS_SP=True,
                                                     SP_SCORE=True, DEV_N=True, UNSHIFTED=False),
                            bf16("Q", "K", "V", "FQ", "FK", "SPK", "SPV", "O", KM=I8, SPM=F32, GW=F32, LFW=F32, H=F32,
                                 S=F32, NK=I64), {}),
    # combine="unshifted" (the LoLA authors' combination): the prefill's and the replayed decode step's variants
    "hybrid_fwd_lola_D128_unshifted": (lh._hybrid_fwd_kernel,
                                       dict(HQ=32, BM=64, BN=64, BD=128, BF=128, BKS=32, CS=256, PER_BLOCK=True,
                                            HAS_KM=True, HAS_SP=True, PREC="tf32", STATS=False, UNSHIFTED=True),
                                       bf16("Q", "K", "V", "FQ", "FK", "SPK", "SPV", "O", KM=I8, SPM=I8, GW=F32,
                                            LFW=F32, HS=F32, SS=F32, MST=F32, RST=F32, AMST=I32), {"num_stages": 2}),
    "decode_device_count_unshifted": (lh._decode_kernel, dict(HQ=32, BN=64, BD=128, BK=64, HAS_KM=True, HAS_SP=True,
                                                               SP_SCORE=True, DEV_N=True, UNSHIFTED=True),
                                      bf16("Q", "K", "V", "FQ", "FK", "SPK", "SPV", "O", KM=I8, SPM=F32, GW=F32,
                                           LFW=F32, H=F32, S=F32, NK=I64), {}),
    "feature_map": (lh._feature_map_kernel, dict(H=32, BM=64, BD=128, BF=64, PREC="tf32"), bf16("X", "W", "O"), {}),
    "feature_map_fp32w_tf32x3": (lh._feature_map_kernel, dict(H=9, BM=64, BD=64, BF=64, PREC="tf32x3"),
                                 bf16("X", "O", W=F32), {}),
    "feature_map_bwd_tf32x3": (lfb._feature_map_bwd_kernel,
                               dict(H=9, BM=64, BD=64, BF=64, PREC="tf32x3", GPREC="tf32", LOWP=True, NEED_DX=True,
                                    NEED_DW=True),
                               {**bf16("X", "DO", "DX"), "W": F32, "DWP": F32}, {"num_warps": 8}),
    "feature_map_bwd": (lfb._feature_map_bwd_kernel,
                        dict(H=9, BM=64, BD=64, BF=64, PREC="ieee", GPREC="tf32", LOWP=True, NEED_DX=True,
                             NEED_DW=True),
                        {**bf16("X", "DO", "DX"), "W": F32, "DWP": F32}, {"num_warps": 8}),
    "feature_map_bwd_fp32": (lfb._feature_map_bwd_kernel,
                             dict(H=9, BM=64, BD=64, BF=64, PREC="ieee", GPREC="ieee", LOWP=False, NEED_DX=True,
                                  NEED_DW=True),
                             {**{n: F32 for n in ("X", "DO", "DX", "W", "DWP")}}, {"num_warps": 8}),
    "ev_score": (le._ev_score_kernel, dict(HQ=32, BN=128, BD=128, BK=64, HAS_KM=True, PREC="bf16x3"),
                 bf16("FK", "V", CNT=I32, SPIDX=I32, KM=I8, HALL=F32, SALL=F32, SC=F32), {}),
    "ev_score_fp32": (le._ev_score_kernel, dict(HQ=32, BN=64, BD=128, BK=64, HAS_KM=True, PREC="ieee"),
                      {**{n: F32 for n in ("FK", "V", "HALL", "SALL", "SC")}, "CNT": I32, "SPIDX": I32, "KM": I8}, {}),
    "ev_select": (le._ev_select_kernel, dict(HS=8, GS=4, NCP=2048, HAS_KM=True, RB=8, NBIN=256),
                  dict(CNT=I32, SPIDX=I32, KM=I8, SPSC=F32, SC=F32, NFOLD=I32), {"num_warps": 16}),
    "ev_select_4bit": (le._ev_select_kernel, dict(HS=8, GS=4, NCP=2048, HAS_KM=True, RB=4, NBIN=16),
                       dict(CNT=I32, SPIDX=I32, KM=I8, SPSC=F32, SC=F32, NFOLD=I32), {"num_warps": 8}),
    "ev_fold": (le._ev_fold_kernel, dict(HQ=32, BN=128, BK=32, BV=32, PREC="tf32"),
                bf16("FK", "V", CNT=I32, SPIDX=I32, HALL=F32, SALL=F32, PH=F32, PS=F32, NFOLD=I32), {}),
    "local_states": (ls._local_states_kernel,
                     dict(HQ=32, CS=256, BT=64, BK=64, BV=64, NV=2, HAS_KM=True, PREC="tf32"),
                     bf16("FK", "V", KM=I8, HALL=F32, SALL=F32, HS=F32, SS=F32), {}),
}


def muse_ptrs(*out, **other):
    """MuSe: bf16 q/k/v and outputs, the plan's tables (int8 masks, int32 assignments, fp32 centroids)."""
    return bf16("Q", "K", "V", *out, KVAL=I8, QA=I32, KA=I32, CQ=F32, RB=I8, RC=I8, ANY=I8, LSE=F32, scale="fp32",
                **other)


# MuSe (_launch): 8 warps for L * D > 64 * 64; 2 stages up to L * D = 64 * 128, else 1; dk/dv always 1 stage.
# triton_supported: [L, D] tiles of at most 32 KB (forward) / 16 KB (backward) of the input dtype; the cases
# below are the largest accepted tiles (bf16 128 x 128 and 64 x 256 forward, 128 x 64 and 64 x 128 backward;
# fp32 128 x 64 forward, 64 x 64 and 32 x 128 backward).
# MuSe's guard (kernels/muse/triton_guard.py) at Qwen's shapes: 14 query heads, D 64, 16 top rows of 64
CASES.update({
    "guard_norm_candidates_D64": (mg._norm_candidates, dict(HQ=14, D=64, DC=16, BLOCK=mg._BLOCK, K=16, KP=16),
                                  dict(O=BF16, CV=F32, CI=I64), {}),
    "guard_select_top": (mg._select_top, dict(HQ=14, K=16, KP=16, MSP=64, CHUNK=mg._CHUNK),
                         dict(CV=F32, CI=I64, RANKS=I64, POS=I64), {}),
    "guard_weighted_error_tops_D64": (mg._weighted_error, dict(HQ=14, D=64, TOPS=True, HAS_HM=True, RB=mg._RB, TP=16),
                                      dict(O=BF16, REF=BF16, POS=I64, W=F32, HM="*u8", ERR=F32, rest="fp32"), {}),
    "guard_weighted_error_fp32_D128": (mg._weighted_error,
                                       dict(HQ=7, D=128, TOPS=False, HAS_HM=False, RB=mg._RB, TP=1),
                                       dict(O=F32, REF=F32, POS=I64, W=F32, HM="*u8", ERR=F32, rest="fp32"), {}),
})
CASES.update({
    "muse_fwd_L128_D64": (mk._muse_fwd, dict(L=128, D=64, NQ=8, NK=4), muse_ptrs("O"),
                          {"num_warps": 8, "num_stages": 2}),
    "muse_fwd_L128_D128": (mk._muse_fwd, dict(L=128, D=128, NQ=8, NK=4), muse_ptrs("O"),
                           {"num_warps": 8, "num_stages": 1}),
    "muse_bwd_dq_L128_D64": (mk._muse_bwd_dq, dict(L=128, D=64, NQ=8, NK=4), muse_ptrs("DO", "DQ", DELTA=F32),
                             {"num_warps": 8, "num_stages": 2}),
    "muse_bwd_dkdv_L128_D64": (mk._muse_bwd_dkdv, dict(L=128, D=64, NQ=8, NK=4),
                               muse_ptrs("DO", "DK", "DV", DELTA=F32), {"num_warps": 8, "num_stages": 1}),
    "muse_bwd_dq_L64_D128": (mk._muse_bwd_dq, dict(L=64, D=128, NQ=8, NK=4), muse_ptrs("DO", "DQ", DELTA=F32),
                             {"num_warps": 8, "num_stages": 2}),
    "muse_bwd_dkdv_L64_D128": (mk._muse_bwd_dkdv, dict(L=64, D=128, NQ=8, NK=4),
                               muse_ptrs("DO", "DK", "DV", DELTA=F32), {"num_warps": 8, "num_stages": 1}),
})

def f32(*names, **other):
    return {**{n: F32 for n in names}, **other}


def muse_ptrs_fp32(*out, **other):
    return {**muse_ptrs(*out, **other), **f32("Q", "K", "V", *out)}


CASES.update({
    "muse_fwd_L64_D256": (mk._muse_fwd, dict(L=64, D=256, NQ=8, NK=4), muse_ptrs("O"),
                          {"num_warps": 8, "num_stages": 1}),
    "muse_fwd_fp32_L128_D64": (mk._muse_fwd, dict(L=128, D=64, NQ=8, NK=4), muse_ptrs_fp32("O"),
                               {"num_warps": 8, "num_stages": 2}),
    "muse_bwd_dq_fp32_L64_D64": (mk._muse_bwd_dq, dict(L=64, D=64, NQ=8, NK=4),
                                 muse_ptrs_fp32("DO", "DQ", DELTA=F32), {"num_warps": 4, "num_stages": 2}),
    "muse_bwd_dkdv_fp32_L64_D64": (mk._muse_bwd_dkdv, dict(L=64, D=64, NQ=8, NK=4),
                                   muse_ptrs_fp32("DO", "DK", "DV", DELTA=F32), {"num_warps": 4, "num_stages": 1}),
    "muse_bwd_dkdv_fp32_L32_D128": (mk._muse_bwd_dkdv, dict(L=32, D=128, NQ=8, NK=4),
                                    muse_ptrs_fp32("DO", "DK", "DV", DELTA=F32), {"num_warps": 4, "num_stages": 1}),
})

# OVQ (resolve_backend: head_dim * itemsize <= 256 bytes): bf16 up to D = 128 (below), fp32 up to D = 64.
CASES.update({
    "ovq_fwd_split_fp32_D64_BM128": (of._ovq_fwd_split, dict(D=64, DV=64, BM=128, BN=64, DEV_T=True, MEAN=False),
                                     f32("Q", "KC", "VC", KS=F32, VS=F32, CNT=F32, VALID=I8, PACC=F32, PM=F32,
                                         PL=F32, TPTR=I32, NACT=I32), {"num_warps": 8}),
})

# OVQ: chunk attention (training, _blocks: BM = BN = 64, default warps/stages, fp32 O), the fused no-grad path
# at chunk 512 (_blk: BM 128 / 8 warps; decode BM 16 / 4 warps) and its assignment kernels (exact_assign -> IEEE).
OVQ_STATS = bf16("K", DK=F32, CNT=F32, NACT=I32, MAXDOT=F32, BEST=F32, IDX=I64, TPTR=I32, KH=F32)
for D in (64, 128):
    CASES.update({
        f"ovq_attn_fwd_D{D}": (oa._ovq_attn_fwd, dict(D=D, DV=D, BM=64, BN=64),
                               bf16("Q", "K", "V", BIAS=F32, O=F32, LSE=F32), {}),
        f"ovq_attn_bwd_dq_D{D}": (oa._ovq_attn_bwd_dq, dict(D=D, DV=D, BM=64, BN=64),
                                  bf16("Q", "K", "V", "DO", "DQ", BIAS=F32, LSE=F32, DELTA=F32), {}),
        f"ovq_attn_bwd_dkdv_D{D}": (oa._ovq_attn_bwd_dkdv, dict(D=D, DV=D, BM=64, BN=64),
                                    bf16("Q", "K", "V", "DO", "DK", "DV_", BIAS=F32, LSE=F32, DELTA=F32), {}),
        f"ovq_fwd_split_D{D}_BM128": (of._ovq_fwd_split, dict(D=D, DV=D, BM=128, BN=64, DEV_T=True, MEAN=False),
                                      bf16("Q", "KC", "VC", KS=F32, VS=F32, CNT=F32, VALID=I8, PACC=F32, PM=F32,
                                           PL=F32, TPTR=I32, NACT=I32), {"num_warps": 8}),
        f"ovq_chunk_stats_D{D}_ieee": (od._ovq_chunk_stats,
                                       dict(D=D, BM=128, BN=64, IEEE=True, DEV_T=True, MEAN=False), OVQ_STATS,
                                       {"num_warps": 8}),
    })
CASES.update({
    "ovq_fwd_split_D64_BM16": (of._ovq_fwd_split, dict(D=64, DV=64, BM=16, BN=64, DEV_T=False, MEAN=False),
                               bf16("Q", "KC", "VC", KS=F32, VS=F32, CNT=F32, VALID=I8, PACC=F32, PM=F32, PL=F32,
                                    TPTR=I32, NACT=I32), {"num_warps": 4}),
    "ovq_fwd_split_mean_D64_BN128": (of._ovq_fwd_split, dict(D=64, DV=64, BM=128, BN=128, DEV_T=True, MEAN=True),
                                     bf16("Q", "KC", "VC", "KS", "VS", CNT=F32, VALID=I8, PACC=F32, PM=F32, PL=F32,
                                          TPTR=I32, NACT=I32), {"num_warps": 8}),
    "ovq_fwd_split_mean_D128": (of._ovq_fwd_split, dict(D=128, DV=128, BM=128, BN=64, DEV_T=True, MEAN=True),
                                bf16("Q", "KC", "VC", "KS", "VS", CNT=F32, VALID=I8, PACC=F32, PM=F32, PL=F32,
                                     TPTR=I32, NACT=I32), {"num_warps": 8}),
    "ovq_chunk_stats_mean_D128": (od._ovq_chunk_stats, dict(D=128, BM=128, BN=64, IEEE=False, DEV_T=True, MEAN=True),
                                  bf16("K", "DK", CNT=F32, NACT=I32, MAXDOT=F32, BEST=F32, IDX=I64, TPTR=I32, KH=F32),
                                  {"num_warps": 8}),
    "ovq_means_rows_D128": (of._ovq_means, dict(D=128, DV=128, BI=64, FROM_ROWS=True, DEV_T=True, ROW_T=False),
                            bf16("KM", "VM", ROWS=I64, KS=F32, VS=F32, CNT=F32, KH=F32, TPTR=I32), {}),
    "ovq_means_all_fp32_D64": (of._ovq_means, dict(D=64, DV=64, BI=64, FROM_ROWS=False, DEV_T=False, ROW_T=False),
                               dict(KM=F32, VM=F32, ROWS=I64, KS=F32, VS=F32, CNT=F32, KH=F32, TPTR=I32), {}),
    "ovq_combine_D64": (of._ovq_combine, dict(DV=64, BM=64, DEV_T=True), bf16("O", PACC=F32, PM=F32, PL=F32, TPTR=I32),
                        {}),
    "ovq_chunk_stats_D64_bf16": (od._ovq_chunk_stats, dict(D=64, BM=128, BN=64, IEEE=False, DEV_T=True, MEAN=False),
                                 OVQ_STATS,
                                 {"num_warps": 8}),
    "ovq_chunk_stats_D64_BM64": (od._ovq_chunk_stats, dict(D=64, BM=64, BN=64, IEEE=True, DEV_T=False, MEAN=False),
                                 OVQ_STATS,
                                 {}),
    "ovq_rank": (of._ovq_rank, dict(BI=64, DEV_T=True),
                 dict(VALID=I8, PMAXDOT=F32, PBEST=F32, PIDX=I64, NNEW=I32, BEST=F32, IDX=I64, RANK=I32, TPTR=I32),
                 {}),
})
# _ovq_absorb: inference (ROW_OUT is the int32 rank buffer, unused), the training pass's STORE_ROWS,
# assign_rows_triton's ASSIGN_ONLY; each with exact (IEEE) and bf16 dot products.
for ieee in (True, False):
    for mode, ao, sr in (("infer", False, False), ("store_rows", False, True), ("assign_only", True, False)):
        CASES[f"ovq_absorb_{mode}_D64_{'ieee' if ieee else 'bf16'}"] = (
            of._ovq_absorb, dict(D=64, DV=64, BI=64, IEEE=ieee, ASSIGN_ONLY=ao, STORE_ROWS=sr, DEV_T=not ao,
                               ROW_T=sr),
            bf16("KC", "VC", VALID=I8, BEST=F32, IDX=I64, NNEW=I32, NACT=I32, RANK=I32, KS=F32, VS=F32, CNT=F32,
                 ROW_OUT=I64 if ao or sr else I32, TPTR=I32), {"num_warps": 4})


def branch_converts(ttgir: str) -> int:
    """How many layout conversions (`ttg.convert_layout`) the TTGIR has inside `scf.if` regions. One op per line;
    braces of attributes open and close on their line, so the net count per line tracks the regions."""
    depth, ifs, n = 0, [], 0
    for line in ttgir.splitlines():
        if ifs and "ttg.convert_layout" in line:
            n += 1
        if "scf.if" in line and line.rstrip().endswith("{"):
            ifs.append(depth)
        depth += line.count("{") - line.count("}")
        while ifs and depth <= ifs[-1]:
            ifs.pop()
    return n


_DEF = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*([\w.]+)\s*(.*)$")
_VAL = re.compile(r"%[\w.$-]+")
_LOC = re.compile(r"^(#loc\d*)\s*=\s*loc\((.*)\)\s*$")
_USE = re.compile(r"loc\((#loc\d*)\)\s*$")
_PASS = {"arith.addi", "arith.subi", "arith.muli", "arith.extsi", "tt.splat", "tt.broadcast", "tt.expand_dims",
         "tt.reshape", "ttg.convert_layout", "arith.select"}
SMALL_CONSTANT = 1 << 16


def i32_offset_products(ttir: str) -> list[list[str]]:
    """The 32-bit scalar products that reach a pointer offset: [variable, file:line, operands] of each `arith.muli
    ... : i32` (scalar, not a tensor) that a `tt.addptr` offset is built from (through adds, splats, broadcasts,
    selects, sign extensions and tensor products), unless one factor is a constant below 2^16 (`pid_k * BK`).

    Such a product is a base offset (batch x head index times a stride, a slot index times a slot stride): it
    overflows once the tensor passes 2^31 elements. Widening the index (`.to(tl.int64)`) makes the product 64-bit;
    the walk goes on through sign extensions (`arith.extsi`), so a product widened only after it was formed
    (`(b * s_b).to(tl.int64)`, or an i32 product added to a 64-bit one) is still flagged. Tensor products (the
    tile offsets `offs_n[:, None] * stride`) may stay 32-bit: they are bounded by a sequence length times a row
    stride (docs/PERFORMANCE.md, "Large shapes")."""
    defs, locs, offsets = {}, {}, []
    for line in ttir.splitlines():
        lm = _LOC.match(line.strip())
        if lm:
            locs[lm.group(1)] = lm.group(2)
            continue
        m = _DEF.match(line)
        if not m:
            continue
        name, op, rest = m.groups()
        use = _USE.search(rest)
        body = rest.split(" loc(")[0]
        operands, _, ty = body.rpartition(" : ")
        ops = _VAL.findall(operands)
        defs[name] = (op, ops, ty.strip(), body, use.group(1) if use else None)
        if op == "tt.addptr" and len(ops) >= 2:
            offsets.append(ops[1])

    def where(loc):
        """(variable name, file:line) of a location, following name locations to their file location."""
        var, seen = "", set()
        while loc and loc not in seen:
            seen.add(loc)
            text = locs.get(loc, "")
            nm = re.match(r'^"([^"]*)"\((#loc\d*)\)$', text)
            if nm:
                var = var or nm.group(1)
                loc = nm.group(2)
                continue
            fm = re.match(r'^"([^"]*)":(\d+):\d+', text)
            return var, (f"{fm.group(1).rsplit('/', 1)[-1]}:{fm.group(2)}" if fm else "")
        return var, ""

    def small_constant(v):
        d = defs.get(v)
        if d is None or d[0] != "arith.constant":
            return False
        c = re.match(r"(?:dense<)?(-?\d+)", d[3])
        return c is not None and abs(int(c.group(1))) < SMALL_CONSTANT

    bad, seen, stack = {}, set(), list(offsets)
    while stack:
        v = stack.pop()
        if v in seen or v not in defs:
            continue
        seen.add(v)
        op, ops, ty, body, loc = defs[v]
        if op not in _PASS:
            continue  # loads, program ids, casts (extsi: already 64-bit), divisions ... end the walk
        if op == "arith.muli" and ty == "i32" and not any(small_constant(o) for o in ops):
            bad[v] = [*where(loc), body]
        stack.extend(ops[1:] if op == "arith.select" else ops)
    return sorted({tuple(x) for x in bad.values()})


def cells_ptrs(t, *out, **other):
    """Pointer arguments of the cells kernels: tensors of dtype t, the plan's tables and fp32 statistics."""
    base = dict(LOGN=F32, KVAL=I8, EXL=I32, RET=I8, TL=I32, TCNT=I32, LSE=F32, DELTA=F32, DQ=F32, DK=F32, DV=F32, DMU=F32, DVB=F32,
                scale="fp32")
    return {**{n: t for n in ("Q", "K", "V", "MU", "VB", "DO", "O")}, **base, **other}


def _cells_case(kernel, D, dtype, bwd, far=True):
    """The tiles `_CellsAttention` launches with (`cells_tiles`; block_size 256 with cells, 512 without: moba's
    block lists)."""
    import torch

    L = 256 if far else 512
    BM, BN, warps, stages_or_bmk = mc.cells_tiles(D, torch.float32 if dtype == F32 else torch.bfloat16, L)[
        "bwd" if bwd else "fwd"]
    if kernel is mc._cells_bwd_dcells:
        BM = stages_or_bmk
    if kernel is mc._cells_bwd_dkdv:
        BN, BM, warps, stages_or_bmk = mc.cells_tiles(D, torch.float32 if dtype == F32 else torch.bfloat16, L)["dkdv"]
        bwd = False  # its stages are its own
    consts = dict(L=L, CK=32 if far else 1, LOC=1 if far else 0, NE=9 if far else 2, NEP=16 if far else 2, PAD=0,
                  D=D, BM=BM, BN=BN, FAR=int(far), CH=mc.READERS_CHUNK)
    consts = {c: v for c, v in consts.items() if c in kernel.arg_names}
    ptrs = {n: t for n, t in cells_ptrs(dtype).items() if n in kernel.arg_names}
    return (kernel, consts, ptrs, {"num_warps": warps, "num_stages": 1 if bwd else stages_or_bmk})


for _D in (64, 128):
    for _t, _tn in ((BF16, ""), (F32, "_fp32")):
        CASES[f"cells_fwd{_tn}_D{_D}"] = _cells_case(mc._cells_fwd, _D, _t, False)
        CASES[f"cells_bwd_dq{_tn}_D{_D}"] = _cells_case(mc._cells_bwd_dq, _D, _t, True)
        CASES[f"cells_bwd_dkdv{_tn}_D{_D}"] = _cells_case(mc._cells_bwd_dkdv, _D, _t, True)
        CASES[f"cells_bwd_dcells{_tn}_D{_D}"] = _cells_case(mc._cells_bwd_dcells, _D, _t, True)
        CASES[f"lists_fwd{_tn}_D{_D}"] = _cells_case(mc._cells_fwd, _D, _t, False, far=False)
        CASES[f"lists_bwd_dq{_tn}_D{_D}"] = _cells_case(mc._cells_bwd_dq, _D, _t, True, far=False)

# the tilted-cells forward as tilted_cells_fwd launches it (L 256, 8 cells), and its clustering's assignment
for _D in (64, 128):
    for _t, _tn in ((BF16, ""), (F32, "_fp32")):
        _dt = torch.float32 if _t == F32 else torch.bfloat16
        _BC, _BK, _sw = mt.tilted_tiles(_D, _dt)["summ"]
        CASES[f"tilt_summaries{_tn}_D{_D}"] = (
            mt._tilt_summaries, dict(L=256, CK=8, D=_D, BC=_BC, BK=_BK),
            dict(K=_t, V=_t, KORD=I32, CST=I32, C=_t, LSE=F32, KT=_t, VT=_t, scale="fp32"), {"num_warps": _sw})
        _BM, _BN, _fw, _fs = mt.tilted_tiles(_D, _dt)["far"]
        CASES[f"tilt_far_fwd{_tn}_D{_D}"] = (
            mt._tilt_far_fwd, dict(L=256, CK=8, LOC=1, D=_D, BM=_BM, BN=_BN),
            dict(Q=_t, ORD=I32, SCL=I32, C=_t, LSE=F32, KT=_t, VT=_t, RET=I32, O=_t, LSEE=F32, scale="fp32"),
            {"num_warps": _fw, "num_stages": _fs})
        _BM, _BN, _w = mtb.tilted_bwd_tiles(_D, _dt)["dq"]
        CASES[f"tilt_far_dq{_tn}_D{_D}"] = (
            mtb._tilt_far_dq, dict(L=256, CK=8, LOC=1, D=_D, BM=_BM, BN=_BN),
            dict(Q=_t, ORD=I32, SCL=I32, C=_t, LSE=F32, KT=_t, VT=_t, RET=I32, DO=_t, LSEM=F32, DELTA=F32, DQ=F32,
                 scale="fp32"), {"num_warps": _w})
        _BM, _BN, _w = mtb.tilted_bwd_tiles(_D, _dt)["dsumm"]
        CASES[f"tilt_far_dsumm{_tn}_D{_D}"] = (
            mtb._tilt_far_dsumm, dict(L=256, CK=8, LOC=1, D=_D, BM=_BM, BN=_BN),
            dict(Q=_t, ORD=I32, FIRST=I32, C=_t, LSE=F32, KT=_t, VT=_t, RET=I32, DO=_t, LSEM=F32, DELTA=F32, DKT=_t,
                 DVT=_t, A=F32, scale="fp32"), {"num_warps": _w})
        _BC, _BK, _w = mtb.tilted_bwd_tiles(_D, _dt)["sbwd"]
        CASES[f"tilt_summaries_bwd{_tn}_D{_D}"] = (
            mtb._tilt_summaries_bwd, dict(L=256, CK=8, D=_D, BC=_BC, BK=_BK),
            dict(K=_t, V=_t, KORD=I32, CST=I32, C=_t, LSE=F32, DKT=_t, DVT=_t, A=F32, DK=F32, DV=F32, scale="fp32"),
            {"num_warps": _w})
    CASES[f"nearest_D{_D}"] = (mcl._nearest, dict(D=_D, BM=128, BC=64), dict(X=BF16, C=BF16, C2=F32, A=I32),
                               {"num_warps": 8 if _D >= 128 else 4})
    _CA, _BM, _w, _s, _ = mcl.member_tiles(_D, 256)
    CASES[f"member_sums_D{_D}"] = (mcl._member_sums, dict(D=_D, BM=_BM, CA=_CA),
                                   dict(X=BF16, A=I32, VALID=I8, SUM=F32, CNT=F32), {"num_warps": _w, "num_stages": _s})

# the plan kernels as lloyd_triton / block_scores_triton launch them: cells keys (L 256, 32 or 16 cells) and the
# tilted design's query clusters (L 128, 8 clusters)
for _name, _t, _L, _D, _C in (("cells_D64", BF16, 256, 64, 32), ("cells_D128", BF16, 256, 128, 32),
                              ("tilted_q_D64", BF16, 128, 64, 8), ("C16_D128", BF16, 256, 128, 16)):
    CASES[f"lloyd_{_name}"] = (mcl._lloyd_kernel, dict(D=_D, LP=_L, CP=max(16, _C)),
                               dict(X=_t, VALID=I8, CENT=F32, ASSIGN=I64, COUNT=F32),
                               {"num_warps": max(4, min(16, _L * _D // 2048))})
for _D, _C in ((64, 32), (128, 16)):
    CASES[f"block_scores_D{_D}_C{_C}"] = (mcl._block_scores_kernel,
                                          dict(D=_D, CK=_C, NT=16, MT=msup.scores_tiles(_D, _C)[1]),
                                          dict(QBAR=F32, CENT=F32, LOGN=F32, BS=F32, scale="fp32"), {"num_warps": 4})

for _D in (64, 128):  # as block_peaks_triton launches it (L 256)
    _NT, _GP, _BL, _w, _st = msup.peaks_tiles(_D, 256, 4)
    CASES[f"block_peaks_D{_D}"] = (mcl._block_peaks_kernel, dict(L=256, D=_D, NT=_NT, GP=_GP, BL=_BL, MC=16),
                                   dict(QBAR=BF16, K=BF16, KVAL=I8, BS=F32, scale="fp32"),
                                   {"num_warps": _w, "num_stages": _st})
for _NP, _w in ((256, 1), (8192, 8)):  # as mark_top_triton launches it: 64k and 2M tokens of 256-token blocks
    CASES[f"mark_top_N{_NP}"] = (mcl._mark_top, dict(NP=_NP), dict(R=I8, SC=F32), {"num_warps": _w})

for _D, _t, _R, _tag in ((128, BF16, 4, "bf16"), (64, BF16, 512, "bf16"), (64, F32, 4, "fp32")):  # as launched
    _BR, _BN, _w = dk.decode_tiles(_D, _R)
    CASES[f"decode_split_D{_D}_R{_R}_{_tag}"] = (
        dk._split_kernel, dict(HKV=8, G=4, NRB=-(-_R // _BR), BR=_BR, BN=_BN, D=_D, HAS_KM=True, HAS_WIN=True,
                               HAS_POS=False, PREC="ieee" if _t == F32 else "tf32"),
        dict(Q=_t, K=_t, V=_t, KM=I8, POS=_t, PO=F32, PM=F32, PL=F32), {"num_warps": _w, "num_stages": 2})
_BR, _BN, _w = dk.decode_tiles(64, 7 * 64)  # as MuSe's guard launches it on Qwen2.5-Coder: 7 heads a kv head, 64 rows
CASES["decode_split_rows_at_positions_D64_bf16"] = (
    dk._split_kernel, dict(HKV=2, G=7, NRB=-(-448 // _BR), BR=_BR, BN=_BN, D=64, HAS_KM=True, HAS_WIN=False,
                           HAS_POS=True, PREC="tf32"),
    dict(Q=BF16, K=BF16, V=BF16, KM=I8, POS=I64, PO=F32, PM=F32, PL=F32), {"num_warps": _w, "num_stages": 2})
CASES["decode_combine_D128"] = (dk._combine_kernel, dict(HKV=8, G=4, NRB=1, BR=16, D=128),
                                dict(PO=F32, PM=F32, PL=F32, O=BF16), {"num_warps": 4})

for _D, _t, _G, _tag in ((64, BF16, 4, "bf16"), (128, BF16, 4, "bf16"), (256, BF16, 4, "bf16"), (64, BF16, 7, "bf16"),
                         (64, F32, 4, "fp32"), (128, F32, 4, "fp32")):  # as window_forward launches it
    _BR, _BN, _w, _st = tw.window_tiles(_D, torch.float32 if _t == F32 else torch.bfloat16)
    CASES[f"window_fwd_D{_D}_G{_G}_{_tag}"] = (
        tw._window_fwd_kernel, dict(HKV=8, G=_G, BR=_BR, BN=_BN, D=_D, HAS_KM=True,
                                    PREC="ieee" if _t == F32 else "tf32"),
        dict(Q=_t, K=_t, V=_t, KM=I8, O=_t), {"num_warps": _w, "num_stages": _st})

# the fused model ops (kernels/model_ops/), as their launches configure them: rotary of the 1B shape (32 / 8 heads,
# D = 64) and D = 80 / 128 in fp32; RMSNorm of hidden 2048 (bf16 x, bf16 or fp32 weight) and 8192; SiLU * up
CASES["fused_rotary_D64_bf16"] = (tf._rotary_kernel, dict(HALF=32, BHQ=32, BHK=8, BD=32, NQB=1, EMU=False),
                                  bf16("Q", "K", "QO", "KO", "C", "SN"), {"enable_fp_fusion": False})
CASES["fused_rotary_D80_fp32"] = (tf._rotary_kernel, dict(HALF=40, BHQ=32, BHK=8, BD=64, NQB=1, EMU=False),
                                  f32("Q", "K", "QO", "KO", "C", "SN"), {"enable_fp_fusion": False})
CASES["fused_rotary_D128_bf16"] = (tf._rotary_kernel, dict(HALF=64, BHQ=32, BHK=8, BD=64, NQB=1, EMU=False),
                                   bf16("Q", "K", "QO", "KO", "C", "SN"), {"enable_fp_fusion": False})
CASES["fused_rmsnorm_N2048_bf16"] = (tf._rmsnorm_kernel, dict(BN=2048, EMU=False), bf16("X", "W", "O"),
                                     {"num_warps": 4})
CASES["fused_rmsnorm_N2048_bf16_w32"] = (tf._rmsnorm_kernel, dict(BN=2048, EMU=False), bf16("X", W=F32, O=F32),
                                         {"num_warps": 4})
CASES["fused_rmsnorm_N8192_fp32"] = (tf._rmsnorm_kernel, dict(BN=8192, EMU=False), f32("X", "W", "O"),
                                     {"num_warps": 8})
CASES["fused_silu_mul_bf16"] = (tf._silu_mul_kernel, dict(BLOCK=1024, EMU=False), bf16("G", "U", "O"),
                                {"num_warps": 4})


# the 64-bit offset check's own cases: the same load with the batch x head program id 32-bit (as every LoLA and OVQ
# kernel had it before the large-shape audit: flagged) and widened (clean)
@triton.jit
def _canary_i32_base(X, O, s_b, s_h, s_n, HQ: tl.constexpr, BM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs = pid_m * BM + tl.arange(0, BM)
    x = tl.load(X + (pid_bh // HQ) * s_b + (pid_bh % HQ) * s_h + offs * s_n)
    tl.store(O + offs, x)


@triton.jit
def _canary_i64_base(X, O, s_b, s_h, s_n, HQ: tl.constexpr, BM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    offs = pid_m * BM + tl.arange(0, BM)
    x = tl.load(X + (pid_bh // HQ) * s_b + (pid_bh % HQ) * s_h + offs * s_n)
    tl.store(O + offs, x)


@triton.jit
def _canary_widened_late(X, O, s_b, s_h, s_n, HQ: tl.constexpr, BM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs = pid_m * BM + tl.arange(0, BM)
    base = ((pid_bh // HQ) * s_b).to(tl.int64) + (pid_bh % HQ) * s_h  # widened after the product: still flagged
    x = tl.load(X + base + offs * s_n)
    tl.store(O + offs, x)


CASES["canary_i32_base"] = (_canary_i32_base, dict(HQ=32, BM=64), f32("X", "O"), {})
CASES["canary_widened_late"] = (_canary_widened_late, dict(HQ=32, BM=64), f32("X", "O"), {})
CASES["canary_i64_base"] = (_canary_i64_base, dict(HQ=32, BM=64), f32("X", "O"), {})


def compile_case(name: str) -> tuple[str, dict]:
    """One case of CASES compiled: its shared memory, cubin size and the checks' findings, or its error."""
    kernel, consts, ptrs, options = CASES[name]
    try:
        k = compile_kernel(kernel, consts, ptrs, options)
        return name, {"shared": int(k.metadata.shared), "cubin_bytes": len(k.asm.get("cubin", b"")),
                      "branch_converts": branch_converts(k.asm["ttgir"]),
                      "i32_offsets": [list(x) for x in i32_offset_products(k.asm["ttir"])]}
    except Exception as e:  # noqa: BLE001 - reported per kernel
        return name, {"error": f"{type(e).__name__}: {e}"[-3000:], "trace": traceback.format_exc()[-2000:]}


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1,
                    help="compile the cases in this many processes (forked; each case is compiled the same way)")
    jobs = ap.parse_args(argv).jobs
    names = list(CASES)
    if jobs > 1:
        import multiprocessing as mp

        # the costliest cases (fp32 tiles: minutes each) first, so that the processes finish together
        order = sorted(names, key=lambda n: ("fp32" not in n and "ieee" not in n, names.index(n)))
        with mp.get_context("fork").Pool(jobs) as pool:
            found = dict(pool.imap_unordered(compile_case, order, chunksize=1))
    else:
        found = dict(map(compile_case, names))
    print(json.dumps({n: found[n] for n in names}))


if __name__ == "__main__":
    main()
