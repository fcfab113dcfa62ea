"""One patched model shared by several threads: each call gets the answer it gets alone.

A server may share one patched model between its request threads. The padding of a call was once kept on the model
(`PatchContext.key_mask`, written by the decoder's forward pre-hook and read by every patched layer), so a thread
running a padded batch and another running an unpadded one read each other's mask: wrong logits with no exception
(up to 4.4 off), or `padding mask covers 150 tokens but attention sees 180 keys`. The unpatched model with the same
inputs never differs. Now the state of a call travels with the call (the decoder layers' keyword arguments,
patch_state.CallState), and here, for every method, 6 threads run padded and unpadded forwards and generate() calls of
different shapes at once on one model, each giving what it gives alone (bit for bit, as the unpatched model does).

The default tests run a few rounds under a short thread switch interval (so that the threads interleave inside each
forward: on the code that kept the mask on the model every method failed in the first rounds); the `stress` test runs
100 rounds of each (not in the default suite: `python -m pytest -m stress tests/test_concurrency.py`). On a GPU, where
the Triton kernels, generate()'s decode graphs and the prefills' graph captures run too (each thread captures on a side
stream of its own, kernels/graphs.py): `python3 -m benchmarks.generate.check_threads`.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from conftest import left_padded_prompts, tiny_model
from test_method_contract import SETTINGS

import longctx_patch as lp

ROUNDS = 2
STRESS_ROUNDS = 100


def _jobs():
    """(name, kind, kwargs) of the calls the threads make: padded and unpadded, forward and generate(), of different
    batch sizes and lengths (right padding too, as a training or evaluation forward has it)."""
    _, pad_ids, pad_am = left_padded_prompts([44, 31, 12], seed=7)
    _, gen_ids, gen_am = left_padded_prompts([29, 17], seed=8)
    g = torch.Generator().manual_seed(9)
    plain = torch.randint(3, 128, (2, 38), generator=g)
    one = torch.randint(3, 128, (1, 23), generator=g)
    right = torch.randint(3, 128, (2, 26), generator=g)
    right_am = torch.ones_like(right)
    right_am[1, 19:] = 0
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    return [
        ("forward, left-padded", "forward", dict(input_ids=pad_ids, attention_mask=pad_am, use_cache=False)),
        ("forward, unpadded", "forward", dict(input_ids=plain, attention_mask=torch.ones_like(plain))),
        ("forward, right-padded", "forward", dict(input_ids=right, attention_mask=right_am, use_cache=False)),
        ("forward, no mask", "forward", dict(input_ids=one)),
        ("generate, left-padded", "generate", dict(input_ids=gen_ids, attention_mask=gen_am, **gen)),
        ("generate, unpadded", "generate", dict(input_ids=one, attention_mask=torch.ones_like(one), **gen)),
    ]


def _run(model, kind: str, kw: dict) -> torch.Tensor:
    with torch.no_grad():
        if kind == "forward":
            return model(**kw).logits
        return model.generate(**kw, output_logits=True, return_dict_in_generate=True)


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return torch.equal(got, want)
    return torch.equal(got.sequences, want.sequences) and all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


def concurrent_mismatches(model, rounds: int, jobs=None) -> list[str]:
    """Runs every job alone, then every job in a thread of its own, all at once, `rounds` times each, on `model`;
    returns the jobs (and rounds) whose result differed from the job alone. Errors in a thread are re-raised."""
    jobs = jobs or _jobs()
    model.generation_config.eos_token_id = None  # every row runs every step
    alone = [_run(model, kind, kw) for _, kind, kw in jobs]
    bad: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def work(j: int) -> None:
        name, kind, kw = jobs[j]
        try:
            start.wait()
            for r in range(rounds):
                if not _same(_run(model, kind, kw), alone[j]):
                    bad.append(f"{name} (round {r})")
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch inside every layer's forward, as on a busy server
    try:
        threads = [threading.Thread(target=work, args=(j,)) for j in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    return bad


@pytest.mark.filterwarnings("ignore:muse. the model is on the CPU")
@pytest.mark.parametrize("name", lp.list_methods())
def test_one_patched_model_in_six_threads_gives_each_call_its_own_answer(name, one_thread):
    if name not in SETTINGS:
        pytest.fail(f"method {name!r} has no entry in SETTINGS of tests/test_method_contract.py: add one")
    model = lp.patch(tiny_model("llama"), name, **SETTINGS[name])
    bad = concurrent_mismatches(model, ROUNDS)
    assert not bad, f"{name}: calls that differed from the same call alone: {', '.join(bad)}"


def test_the_unpatched_model_in_six_threads_as_alone(one_thread):
    """The baseline the patched models are held to."""
    assert concurrent_mismatches(tiny_model("llama"), ROUNDS) == []


def test_a_hybrid_in_threads_as_alone(one_thread):
    """Patched and unpatched layers in one model: the call's state reaches the patched layers through the unpatched
    ones."""
    model = tiny_model("llama")
    lp.patch(model, "sliding-window", layers=[0], window=8)
    lp.patch(model, "lola", layers=[2], **SETTINGS["lola"])
    assert concurrent_mismatches(model, ROUNDS) == []


@pytest.mark.stress
@pytest.mark.filterwarnings("ignore:muse. the model is on the CPU")
@pytest.mark.parametrize("name", lp.list_methods())
def test_many_rounds_in_six_threads(name, one_thread):
    model = lp.patch(tiny_model("llama"), name, **SETTINGS[name])
    bad = concurrent_mismatches(model, STRESS_ROUNDS)
    assert not bad, f"{name}: {len(bad)} calls differed from the same call alone: {', '.join(bad[:12])}"
