"""The contract every method keeps, checked for each name `list_methods()` returns.

A method registered without an entry in `SETTINGS` fails every test here with a message saying to add one:
the settings make its approximate path run at 40-100 tokens on the tiny model (blocks, chunks and windows
of 8-16 tokens), so the checks below exercise the method itself, not a short-sequence fallback.

For each method:
1. patch then unpatch gives back the original model bit for bit (logits `torch.equal`, same state dict);
2. save_patched / load_patched round trip (method parameters moved off their initial values): the same logits
   (`torch.equal`) and the same patch record;
3. cached decode equals recomputation: greedy `generate()` with the method's cache gives the tokens (and,
   closely, the logits) of recomputing the whole sequence at every step with no cache (`use_cache=False`).
   muse approximates the prefill only (decode is exact by design), so a no-cache forward of the whole
   sequence, which would apply MuSe to the generated tokens too, is not its recomputation: for muse (and any
   method listed in `PREFILL_ONLY`) each step recomputes the prompt's prefill into a fresh cache and then the
   whole continuation in one forward over it;
4. a left-padded batch gives, row by row, the logits (1e-4, fp32) and greedy tokens of each prompt alone, for
   any padding (here 0, 6, 13 and 32 tokens: none a multiple of the chunks / blocks of 8 and 16), in the
   prefill (with and without position ids) and at every decode step;
5. `state_bytes` is what the cache holds: after a prefill of S tokens at batch 1, `past_key_values.nbytes()`
   equals the sum over patched layers of `state_bytes(S, batch=1, dtype=model dtype)`;
6. a copy of a patched model, by `copy.deepcopy` or through pickle, is a correct and independent model: taken after
   a padded forward of the original, it runs a padded batch of another size as the original does (the same logits,
   `torch.equal`), its padded rows equal their prompts alone (prefill and decode steps, 1e-4), its patch, modules
   and context are its own, and unpatching it gives back the unpatched model bit for bit and leaves the original
   patched and unchanged;
7. two patched models generating in two threads of one process give the tokens each gives alone (left-padded
   batches of different shapes, so that each model's padding state is exercised); one patched model shared by
   several threads: tests/test_concurrency.py (which takes its settings from SETTINGS here).
"""

from __future__ import annotations

import copy
import json
import pickle
import threading

import pytest
import torch

import longctx_patch as lp
from conftest import assert_padded_batch_exact, left_padded_prompts, padded_batch_gap, tiny_model
from longctx_patch.patch_state import patch_context

# method -> config: small settings under which the method's own path runs at 40-100 tokens
SETTINGS: dict[str, dict] = {
    "exact": {},
    "sliding-window": dict(window=8),
    "muse": dict(block_size=8, min_seq_len=16, k_clusters=2, q_clusters=2, topk_blocks=1, topk_clusters=1,
                 exact_tail=8),
    "moba": dict(block_size=8, top_k=2, gating="token"),  # block gating: tests/test_moba_block.py
    "lolcats": dict(window=8, chunk=8),
    "lola": dict(window=8, chunk=8, sparse_cache=4),
    # growth=4: the dictionary still grows at 40-100 tokens (7 rows after the first chunk, 13 after the sixth)
    "ovq": dict(chunk_size=16, max_centroids=16, growth=4.0),
}

# methods whose approximation applies to a prompt's prefill only (decode and continued prefill are exact)
PREFILL_ONLY = {"muse"}

METHODS = lp.list_methods()


def _settings(name: str) -> dict:
    if name not in SETTINGS:
        pytest.fail(f"method {name!r} has no entry in SETTINGS of tests/test_method_contract.py: add one (its config "
                    "for a tiny model at 40-100 tokens)")
    return SETTINGS[name]


def _patched(name: str, seed: int = 0):
    config = _settings(name)
    model = tiny_model("llama", seed=seed)
    lp.patch(model, name, **config)
    return model


def _patched_modules(model) -> list:
    return [model.model.layers[i].self_attn for i in sorted(lp.patched_layers(model))]


def _ids(B: int, S: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (B, S), generator=torch.Generator().manual_seed(seed))


def test_every_settings_entry_is_a_method():
    assert set(SETTINGS) <= set(METHODS), set(SETTINGS) - set(METHODS)


@pytest.mark.parametrize("name", METHODS)
def test_unpatch_restores_the_model_bit_for_bit(name):
    config = _settings(name)
    model = tiny_model("llama")
    ids = _ids(2, 64, seed=1)
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(ids).logits
        lp.patch(model, name, **config)
        patched = model(ids).logits
        model.generate(ids[:1, :40], max_new_tokens=3, do_sample=False, pad_token_id=0)  # use the method's cache
        lp.unpatch(model)
        after = model(ids).logits
    assert not lp.is_patched(model)
    if name != "exact":
        assert not torch.equal(patched, before), "the method changed nothing: its settings do not exercise it"
    assert torch.equal(after, before)
    sd_after = model.state_dict()
    assert sd_after.keys() == sd_before.keys()
    assert all(torch.equal(sd_after[k], sd_before[k]) for k in sd_before)


@pytest.mark.parametrize("name", METHODS)
def test_save_load_round_trip(name, tmp_path):
    model = _patched(name)
    with torch.no_grad():  # method parameters away from their initial values, so loading them matters
        for mod in _patched_modules(model):
            for p in mod.method_parameters().values():
                if p.is_floating_point():
                    p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ids = _ids(2, 64, seed=2)
    with torch.no_grad():
        want = model(ids).logits
    lp.save_patched(model, tmp_path / "a")
    loaded = lp.load_patched(tmp_path / "a", dtype=torch.float32, device="cpu").eval()
    assert lp.patched_layers(loaded) == lp.patched_layers(model)
    with torch.no_grad():
        got = loaded(ids).logits
    assert torch.equal(got, want)
    lp.save_patched(loaded, tmp_path / "b")
    rec_a = json.loads((tmp_path / "a" / "longctx_patch.json").read_text())
    rec_b = json.loads((tmp_path / "b" / "longctx_patch.json").read_text())
    assert rec_b == rec_a


def _recomputed_greedy(model, ids: torch.Tensor, n: int, prompt_prefill: bool) -> tuple[torch.Tensor, list]:
    """Greedy decoding that recomputes the whole sequence at every step: with no cache, or (prompt_prefill) the
    prompt's prefill into a fresh cache, then every token after the prompt in one forward."""
    P = ids.shape[1]
    seq, logits = ids, []
    for _ in range(n):
        if prompt_prefill:
            out = model(ids, use_cache=True)
            if seq.shape[1] > P:
                out = model(seq[:, P:], past_key_values=out.past_key_values, use_cache=True)
        else:
            out = model(seq, use_cache=False)
        last = out.logits[:, -1].float()
        logits.append(last)
        seq = torch.cat([seq, last.argmax(-1, keepdim=True)], 1)
    return seq, logits


@pytest.mark.parametrize("name", METHODS)
def test_cached_decode_equals_recomputation(name):
    model = _patched(name)
    ids = _ids(1, 40, seed=3)
    n = 10
    model.generation_config.eos_token_id = None  # n tokens whatever they are, as the recomputation
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, max_new_tokens=n, do_sample=False,
                                pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        seq, logits = _recomputed_greedy(model, ids, n, prompt_prefill=name in PREFILL_ONLY)
    assert torch.equal(cached.sequences, seq), (cached.sequences[0, 40:], seq[0, 40:])
    assert len(cached.logits) == n
    for step, (a, b) in enumerate(zip(cached.logits, logits)):
        torch.testing.assert_close(a.float(), b, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("name", METHODS)
def test_left_padded_batch_matches_single_prompts_for_any_padding(name, one_thread):
    model = _patched(name)
    assert_padded_batch_exact(model, [56, 50, 43, 24], max_new_tokens=6, atol=1e-4)  # paddings 0, 6, 13, 32


@pytest.mark.parametrize("name", METHODS)
def test_state_bytes_equal_the_cache(name):
    model = _patched(name)
    dtype = next(model.parameters()).dtype
    mods = _patched_modules(model)
    assert len(mods) == model.config.num_hidden_layers
    for S in (40, 64, 100):
        with torch.no_grad():
            cache = model(_ids(1, S, seed=S), use_cache=True).past_key_values
        want = sum(m.state_bytes(S, batch=1, dtype=dtype) for m in mods)
        assert cache.nbytes() == want, (S, cache.nbytes(), want)


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m))}


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("name", METHODS)
def test_copies_are_correct_and_independent(name, how, one_thread):
    model = _patched(name)
    unpatched = tiny_model("llama")  # the model _patched() patched, as it was
    _, ids, am = left_padded_prompts([56, 43, 24])  # paddings 0, 13, 32
    other = dict(input_ids=ids[:2, 8:], attention_mask=am[:2, 8:])  # another batch: 2 rows, paddings 0 and 5
    with torch.no_grad():
        model(ids, attention_mask=am)  # the original's last batch was padded: its mask must not reach the copy
        want = model(**other).logits
        plain = unpatched(**other).logits
    c = COPIES[how](model)
    assert lp.patched_layers(c) == lp.patched_layers(model)
    with torch.no_grad():
        assert torch.equal(c(**other).logits, want)
    gap, same = padded_batch_gap(c, [56, 50, 43, 24], max_new_tokens=3)  # paddings 0, 6, 13, 32
    assert same and gap <= 1e-4, f"padded rows differ from the prompts alone: max |dlogits| {gap:.3g}, tokens {same}"
    mods, ctx = _patched_modules(c), patch_context(c)
    assert ctx is not patch_context(model) and all(m._ctx is ctx for m in mods)
    assert not {id(p) for p in c.parameters()} & {id(p) for p in model.parameters()}
    lp.unpatch(c)
    assert not lp.is_patched(c) and lp.is_patched(model)
    with torch.no_grad():
        assert torch.equal(c(**other).logits, plain)
        assert torch.equal(model(**other).logits, want)
    lp.unpatch(model)  # and the original unpatches as it would have without a copy
    with torch.no_grad():
        assert torch.equal(model(**other).logits, plain)


@pytest.mark.parametrize("name", METHODS)
def test_two_models_generate_in_two_threads_as_alone(name, one_thread):
    models = [_patched(name, seed=s) for s in (0, 1)]
    batches = [left_padded_prompts([47, 30], seed=5)[1:], left_padded_prompts([41, 41, 22], seed=6)[1:]]
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    for m in models:
        m.generation_config.eos_token_id = None  # every row runs every step
    with torch.no_grad():
        alone = [m.generate(ids, attention_mask=am, **gen) for m, (ids, am) in zip(models, batches)]
    got: list[list] = [[], []]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(i: int) -> None:
        try:
            start.wait()
            ids, am = batches[i]
            with torch.no_grad():
                for _ in range(3):
                    got[i].append(models[i].generate(ids, attention_mask=am, **gen))
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for i in (0, 1):
        assert len(got[i]) == 3 and all(torch.equal(g, alone[i]) for g in got[i]), (name, i)
