"""Launch settings of the LoLA Triton kernels that benchmarks override (benchmarks/ops/bench_lola.py); None: the defaults
written in the wrappers. No Triton import: `ops.py` reads `piece_block_m` on any install."""

TUNE = {"hybrid_num_warps": None, "hybrid_num_stages": None, "fold_block": None, "piece_block_m": None,
        # the evictions of the two-pass prefill (PrefillEvictions)
        "score_prec": None, "ev_score_bn": None, "ev_score_warps": None, "ev_score_stages": None, "ev_select_bits": None, "ev_fold_block": None, "ev_fold_bn": None,
        "ev_fold_warps": None, "ev_select_warps": None,
        # decode (one token): the step kernel's key/feature tiles and warps; the feature map's row tile
        "decode_bn": None, "decode_bk": None, "decode_warps": None, "fmap_bm": None, "fmap_warps": None,
        # the feature map's projection with fp32 weights, forward and the backward's recomputation: "ieee" or
        # "tf32x3" (three tf32 tensor-core products, fp32's accuracy); None: triton_hybrid.fmap_precision's choice
        "fmap_prec": None,
        # the whole-sequence hybrid's backward (triton_hybrid_bwd.py): warps of its dq and dkv kernels, their stages
        "bwd_dq_warps": None, "bwd_dkv_warps": None, "bwd_stages": None,
        # the training pass (HybridAttentionFn): keys per prefix state and the forward/backward tiles
        "train_state_chunk": None, "train_block_m": None, "train_block_n": None}
