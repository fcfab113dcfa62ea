"""Tensor parallelism on the CPU: transformers' `tp_plan="auto"` over two gloo processes, every method.

One tiny Llama (4 query heads, 2 kv heads: one kv head and its GQA group per rank) is run patched in this process,
its method tensors moved away from their initial values so that each head's differ; two spawned ranks load the
same checkpoint with `tp_plan="auto"`, patch it, load those method tensors (the full record: each rank keeps its
heads) and must give the same logits (1e-4, fp32) and the same greedy tokens. A rank's modules hold its heads only;
the method tensors gathered back equal the full ones; a fresh patch gathers to the single-process fresh patch;
`save_patched` on both ranks writes one full record that loads in one process and back on two.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

import longctx_patch as lp
from longctx_patch.patcher import apply_patch_record, load_method_state_dict, method_state_dict, patched_modules
from conftest import tiny_model
from test_method_contract import SETTINGS

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with the gloo backend is not available in this torch build")

WORLD = 2
NEW_TOKENS = 4
SAVED = "lola"  # the method whose save_patched the ranks exercise
# no packaged weights for a random model: fresh feature maps, deterministic (their seed)
EXTRA = {"lolcats": dict(checkpoint="none"), "lola": dict(checkpoint="none"), "muse": dict(backend="torch")}


def _config(method: str) -> dict:
    return {**SETTINGS[method], **EXTRA.get(method, {})}


def _ids() -> torch.Tensor:
    return torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(7))


def _run(model, method: str, state: dict | None, save_to: str | None = None) -> dict:
    """Patch `model`, load `state` (when given), return what the ranks are compared on (and save_patched to
    `save_to`), unpatch."""
    lp.patch(model, method, **_config(method))
    fresh = {k: v.clone() for k, v in method_state_dict(model).items()}  # (unsharded, they alias the parameters)
    if state is not None:
        load_method_state_dict(model, state)
    ids = _ids()
    with torch.no_grad():
        logits = model(ids).logits
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    mod = patched_modules(model)[0]
    out = dict(fresh=fresh, logits=logits, seq=seq, state=method_state_dict(model),
               heads=(mod.num_heads, mod.num_key_value_heads), q_proj=type(mod.q_proj.weight).__name__)
    if save_to is not None:
        lp.save_patched(model, save_to)
    lp.unpatch(model)
    return out


def _rank(rank: int, base: str, port: int, ref_path: str, work: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, tp_plan="auto", dtype=torch.float32).eval()
        ref = torch.load(ref_path, weights_only=True)
        results = {m: _run(model, m, ref[m]["state"], os.path.join(work, "saved") if m == SAVED else None)
                   for m in SETTINGS}
        dist.barrier()  # the saved directory is written (rank 0): load it tensor-parallel, as docs/tensor-parallel.md
        saved = AutoModelForCausalLM.from_pretrained(os.path.join(work, "saved"), tp_plan="auto",
                                                     dtype=torch.float32).eval()
        apply_patch_record(saved, os.path.join(work, "saved"))
        with torch.no_grad():
            results["reloaded"] = saved(_ids()).logits
        torch.save(results, os.path.join(work, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process results, [rank 0 results, rank 1 results], work dir)."""
    work = tmp_path_factory.mktemp("tp")
    base = str(work / "base")
    tiny_model("llama", num_hidden_layers=2).save_pretrained(base)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ref = {}
    for method in SETTINGS:
        lp.patch(model, method, **_config(method))
        # every method tensor away from its (often constant) initial value: each head's differ
        state = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(n))
                 if v.is_floating_point() else v
                 for n, (k, v) in enumerate(method_state_dict(model).items())}
        lp.unpatch(model)
        ref[method] = _run(model, method, state)
        ref[method]["state"] = state
    ref_path = str(work / "ref.pt")
    torch.save({m: {"state": r["state"]} for m, r in ref.items()}, ref_path)
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(base, _free_port(), ref_path, str(work)), nprocs=WORLD, join=True)
    ranks = [torch.load(work / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    return ref, ranks, work


@pytest.mark.parametrize("method", list(SETTINGS))
def test_ranks_match_one_process(runs, method):
    ref, ranks, _ = runs
    want = ref[method]
    assert want["heads"] == (4, 2)
    for r, got in enumerate(ranks):
        got = got[method]
        assert got["q_proj"] == "DTensor", "the model was not loaded tensor-parallel"
        assert got["heads"] == (2, 1), f"rank {r}: the patched module does not hold its rank's heads alone"
        torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-4, atol=1e-4)
        assert torch.equal(got["seq"], want["seq"]), f"rank {r}: greedy tokens differ"
        assert got["state"].keys() == want["state"].keys()
        for k, v in want["state"].items():  # the gathered record is the full one
            assert torch.equal(got["state"][k], v), f"rank {r}: gathered {k} differs"
        for k, v in want["fresh"].items():  # a fresh patch: the single-process initial tensors, cut and gathered
            torch.testing.assert_close(got["fresh"][k], v, rtol=0, atol=0)


def test_save_patched_writes_the_full_record(runs):
    ref, ranks, work = runs
    for got in ranks:  # loaded back tensor-parallel (from_pretrained(tp_plan) + apply_patch_record)
        torch.testing.assert_close(got["reloaded"], ref[SAVED]["logits"], rtol=1e-4, atol=1e-4)
    loaded = lp.load_patched(work / "saved", dtype=torch.float32, device="cpu").eval()
    assert lp.patched_layers(loaded) == {0: SAVED, 1: SAVED}
    state = method_state_dict(loaded)
    for k, v in ref[SAVED]["state"].items():
        assert torch.equal(state[k], v), k
    with torch.no_grad():
        logits = loaded(_ids()).logits
    torch.testing.assert_close(logits, ref[SAVED]["logits"], rtol=1e-5, atol=1e-5)


def test_heads_a_group_cannot_share_are_refused():
    from longctx_patch.architectures import ADAPTERS
    from longctx_patch.errors import UnsupportedModelError
    from longctx_patch.tensor_parallel import HeadShard, local_spec

    attn = tiny_model("llama", num_hidden_layers=1).model.layers[0].self_attn
    spec = ADAPTERS["llama"].spec(attn.config, 0)
    with pytest.raises(UnsupportedModelError, match="3 ranks cannot share"):
        local_spec(attn, spec, HeadShard(rank=0, world=3, group=None))
    with pytest.raises(UnsupportedModelError, match="holds 64 output rows"):  # whole projections: not split
        local_spec(attn, spec, HeadShard(rank=0, world=2, group=None))
