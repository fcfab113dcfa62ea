"""The LoLA, MuSe, OVQ, decode, window and fused-op Triton kernels compile for the H200 (sm_90) with the installed Triton, on a machine
without a GPU.

The interpreter (TRITON_INTERPRET=1, the other kernel tests) runs the kernels' Python semantics, not the
compiler: a constexpr re-declared in a loop, a dtype that changes across an `if`, or a tile that needs more
shared memory than the chip has pass there and fail only on the GPU. `tests/compile_sm90.py` compiles each
kernel to a cubin for sm_90 (front end, TTGIR, LLVM, ptxas: all shipped with Triton) in the configurations the
wrappers launch; it runs in a subprocess because this session has the interpreter on, in the background from the
start of the run (tests/compile_background.py: minutes of CPU).
"""

import pytest
import torch

SM90_SMEM = 232448  # bytes of shared memory one block may use on an H100/H200
NAMES = ["chunk_sums", "hybrid_fwd_lola_D128", "hybrid_fwd_fp32", "hybrid_fwd_stats_D64", "hybrid_bwd_dq_D64",
         "hybrid_bwd_state_D64", "hybrid_bwd_dkv_D64", "hybrid_bwd_dq_fp32", "hybrid_bwd_dkv_fp32", "sre", "sre_bf16x3", "fold", "decode", "decode_device_count",
         "hybrid_fwd_lola_D128_unshifted", "decode_device_count_unshifted", "feature_map", "feature_map_fp32w_tf32x3", "feature_map_bwd",
         "feature_map_bwd_tf32x3", "feature_map_bwd_fp32",
         "ev_score", "ev_score_fp32", "ev_select", "ev_select_4bit", "ev_fold", "local_states",
         "muse_fwd_L128_D64", "muse_fwd_L128_D128", "muse_bwd_dq_L128_D64", "muse_bwd_dkdv_L128_D64",
         "muse_bwd_dq_L64_D128", "muse_bwd_dkdv_L64_D128",
         "ovq_attn_fwd_D64", "ovq_attn_bwd_dq_D64", "ovq_attn_bwd_dkdv_D64", "ovq_attn_fwd_D128",
         "ovq_attn_bwd_dq_D128", "ovq_attn_bwd_dkdv_D128", "ovq_fwd_split_D64_BM128", "ovq_fwd_split_D128_BM128",
         "ovq_fwd_split_D64_BM16", "ovq_combine_D64", "ovq_chunk_stats_D64_ieee", "ovq_chunk_stats_D128_ieee",
         "ovq_chunk_stats_D64_bf16", "ovq_chunk_stats_D64_BM64", "ovq_rank",
         "ovq_absorb_infer_D64_ieee", "ovq_absorb_store_rows_D64_ieee", "ovq_absorb_assign_only_D64_ieee",
         "ovq_absorb_infer_D64_bf16", "ovq_absorb_store_rows_D64_bf16", "ovq_absorb_assign_only_D64_bf16",
         "muse_fwd_L64_D256", "muse_fwd_fp32_L128_D64", "muse_bwd_dq_fp32_L64_D64", "muse_bwd_dkdv_fp32_L64_D64",
         "muse_bwd_dkdv_fp32_L32_D128", "ovq_fwd_split_fp32_D64_BM128",
         "ovq_fwd_split_mean_D64_BN128", "ovq_fwd_split_mean_D128", "ovq_chunk_stats_mean_D128",
         "ovq_means_rows_D128", "ovq_means_all_fp32_D64"] \
    + [f"cells_{k}{t}_D{d}" for d in (64, 128) for t in ("", "_fp32") for k in ("fwd", "bwd_dq", "bwd_dkdv", "bwd_dcells")] \
    + [f"lists_{k}{t}_D{d}" for d in (64, 128) for t in ("", "_fp32") for k in ("fwd", "bwd_dq")] \
    + [f"tilt_{k}{t}_D{d}" for d in (64, 128) for t in ("", "_fp32") for k in ("summaries", "far_fwd", "far_dq", "far_dsumm",
                                                                          "summaries_bwd")] \
    + ["nearest_D64", "nearest_D128", "member_sums_D64", "member_sums_D128"] \
    + ["lloyd_cells_D64", "lloyd_cells_D128", "lloyd_tilted_q_D64", "lloyd_C16_D128", "block_scores_D64_C32",
       "block_scores_D128_C16", "block_peaks_D64", "block_peaks_D128", "mark_top_N256", "mark_top_N8192"] \
    + ["decode_split_D128_R4_bf16", "decode_split_D64_R512_bf16", "decode_split_D64_R4_fp32", "decode_combine_D128",
       "decode_split_rows_at_positions_D64_bf16"] \
    + ["guard_norm_candidates_D64", "guard_select_top", "guard_weighted_error_tops_D64",
       "guard_weighted_error_fp32_D128"] \
    + ["window_fwd_D64_G4_bf16", "window_fwd_D128_G4_bf16", "window_fwd_D256_G4_bf16", "window_fwd_D64_G7_bf16",
       "window_fwd_D64_G4_fp32", "window_fwd_D128_G4_fp32"] \
    + ["fused_rotary_D64_bf16", "fused_rotary_D80_fp32", "fused_rotary_D128_bf16", "fused_rmsnorm_N2048_bf16",
       "fused_rmsnorm_N2048_bf16_w32", "fused_rmsnorm_N8192_fp32", "fused_silu_mul_bf16"]
CANARIES = ["canary_i32_base", "canary_i64_base", "canary_widened_late"]


@pytest.fixture(scope="module")
def compiled():
    """The compile's result: it ran in the background beside the other tests from the start of the run
    (tests/compile_background.py); these tests come last."""
    import compile_background

    return compile_background.result()


def test_every_case_is_listed(compiled):
    assert sorted(compiled) == sorted(NAMES + CANARIES)


@pytest.mark.parametrize("name", NAMES)
def test_kernel_compiles_for_sm90(compiled, name):
    res = compiled[name]
    assert "error" not in res, res.get("error", "") + "\n" + res.get("trace", "")
    assert res["cubin_bytes"] > 0
    assert res["shared"] <= SM90_SMEM, f"{name} asks for {res['shared']} B of shared memory"


@pytest.mark.parametrize("name", ["fold", "ev_fold"])
def test_lola_folds_convert_no_layout_inside_a_branch(compiled, name):
    """The LoLA folds store s (the sum of phi(k)) without a layout conversion inside a branch. The earlier form, a
    [BK] slice-layout sum converted through shared memory under `if pid_v == 0`, raced on the H200 (racecheck
    hazards at that store; s_all depended on timing under load: docs/PERFORMANCE.md, LoLA). The CPU kernel tests
    cannot see a race, so this checks the compiled form."""
    assert compiled[name].get("branch_converts") == 0, compiled[name]


# 32-bit scalar products in pointer offsets that are bounded by construction, with the bound
I32_OFFSETS_ALLOWED = {
    # _ev_candidates: eviction c's first candidate position c * C - W, a token index (< S), times a row stride
    # only as a tile offset
    ("ev_", "%c, %C : i32"): "token position",
}


def _allowed(name, operands):
    return any(name.startswith(prefix) and operands == ops for prefix, ops in I32_OFFSETS_ALLOWED)


@pytest.mark.parametrize("name", NAMES)
def test_base_offsets_are_64_bit(compiled, name):
    """No pointer offset of the sm_90 build is built from a 32-bit scalar product (a batch x head program id, a slot
    or chunk index times a stride): at batch 16 x 32k tokens LoLA's phi(k) has 2^31 elements and its per-eviction
    states 513 x 2^22 (chunk 64), and an H200 run crashed with an illegal memory access; at batch 64 x 128k the
    q/k/v batch offsets alone pass 2^31. The check reads the TTIR (`compile_sm90.i32_offset_products`): robust to
    how the source spells the arithmetic (helpers are inlined, names do not matter), blind to tile offsets, which
    are tensors and may stay 32-bit (docs/PERFORMANCE.md, "Large shapes: 64-bit offsets and grid limits")."""
    bad = [x for x in compiled[name].get("i32_offsets", [None]) if x is None or not _allowed(name, x[2])]
    assert not bad, f"{name}: 32-bit scalar products in pointer offsets (variable, line, operands): {bad}"


def test_offset_check_flags_32_bit_base_offsets(compiled):
    """The check can fail: the canary written as the kernels were (32-bit batch x head id) is flagged at both
    products, the widened one is not, and one widened after the product (`(b * s_b).to(tl.int64)`) still is."""
    flagged = compiled["canary_i32_base"]["i32_offsets"]
    assert len(flagged) == 2 and all(ops.endswith(": i32") for _, _, ops in flagged), flagged
    assert compiled["canary_i64_base"]["i32_offsets"] == []
    late = compiled["canary_widened_late"]["i32_offsets"]  # the batch product is formed in 32 bits, then widened
    assert len(late) == 2 and all(ops.endswith(": i32") for _, _, ops in late), late


# one step past the largest compiled tiles above: the dispatchers must refuse these on the Triton path
# (compiled for sm_90 they ask for 245-410 KB of shared memory: MuSe bf16 128 x 256 forward 328 KB, fp32
# 128 x 128 forward 344 KB, fp32 128 x 64 backward 400 KB; OVQ bf16 D = 256 and fp32 D = 128 fused prefill)
@pytest.mark.parametrize("dtype,block,D,grad", [
    (torch.bfloat16, 128, 256, False), (torch.float32, 128, 128, False),
    (torch.float32, 128, 64, True), (torch.bfloat16, 128, 128, True),
])
def test_muse_refuses_tiles_beyond_shared_memory(dtype, block, D, grad):
    from longctx_patch.kernels.muse import triton_supported

    q = torch.zeros(1, 1, 1, D, dtype=dtype)
    why = triton_supported(q, block_size=block, q_clusters=8, k_clusters=4, dipole=False, needs_grad=grad)
    assert why is not None and "block_size" in why
    # and the largest accepted tiles (compiled above) are accepted
    q_ok = torch.zeros(1, 1, 1, D, dtype=dtype)
    assert triton_supported(q_ok, block_size=block // 2, q_clusters=8, k_clusters=4, dipole=False,
                            needs_grad=grad) is None


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 256), (torch.float32, 128)])
def test_ovq_refuses_head_dims_beyond_shared_memory(dtype, D):
    from longctx_patch.errors import ConfigError
    from longctx_patch.kernels.ovq.ops import resolve_backend

    x = torch.zeros(1, 1, 4, D, dtype=dtype)
    with pytest.raises(ConfigError, match="head dims"):
        resolve_backend("triton", x, x, x)
    y = torch.zeros(1, 1, 4, D // 2, dtype=dtype)
    assert resolve_backend("triton", y, y, y) == "triton"
