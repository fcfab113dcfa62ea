import os

# Triton kernels run on the CPU through the interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

MAX_WORKERS = 4  # pytest-xdist workers at most (each loads its own copy of the models: memory)


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity (a cpuset), within a cgroup's CPU quota (a container's
    --cpus) when one is set."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    for path, split in (("/sys/fs/cgroup/cpu.max", lambda t: t.split()),
                        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", None)):
        try:
            text = Path(path).read_text().strip()
            if split is not None:
                quota, period = split(text)
            else:
                quota, period = text, Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text().strip()
            if quota not in ("max", "-1") and int(period) > 0:
                n = min(n, max(1, -(-int(quota) // int(period))))
            break
        except (OSError, ValueError):
            continue
    return max(1, n)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml's addopts): one worker per available CPU, at most MAX_WORKERS
    ($PYTEST_XDIST_AUTO_NUM_WORKERS wins)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return min(MAX_WORKERS, available_cpus())


# Under pytest-xdist each worker gets its share of the CPUs (2 workers on 2 cores: one torch thread each), so that
# the workers do not oversubscribe the machine; without it, 2 threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
torch.set_num_threads(max(1, min(2, available_cpus() // _WORKERS)))

# the interpreter without its repeated patching of triton.language at every jit helper's call (same semantics)
from triton_interpreter import skip_repeated_language_patch  # noqa: E402

skip_repeated_language_patch()  # nothing where triton is not installed

# the sm_90 compile in the background from the start of the run (tests/compile_background.py), and the time budget
# of each test (tests/time_budget.py): their hooks, called from this conftest's
import compile_background  # noqa: E402
import time_budget  # noqa: E402
from compile_background import pytest_collection_finish, pytest_unconfigure  # noqa: E402, F401
from time_budget import pytest_runtest_call  # noqa: E402, F401


def pytest_configure(config):
    compile_background.pytest_configure(config)
    time_budget.pytest_configure(config)


def pytest_collection_modifyitems(config, items):
    time_budget.pytest_collection_modifyitems(items)
    # the tests reading the sm_90 compile last: it runs in the background beside the others until then
    last = [i for i in items if i.path.name == compile_background.MODULE]
    if last:
        items[:] = [i for i in items if i.path.name != compile_background.MODULE] + last


REPO = Path(__file__).resolve().parent.parent
TEST_DATA = Path(__file__).resolve().parent / "data"  # shipped with the repository (tests/data/README.md)


def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def rand_qkv(B, Hq, Hkv, S, D, dtype=torch.float32, seed=0):
    """Random q [B, Hq, S, D] and k, v [B, Hkv, S, D] (standard normal, drawn in float32, then cast)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, h, S, D, generator=g).to(dtype)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


def tiny_config(model_type: str = "llama", **kw):
    """A tiny random-weight config of a supported family (GQA: 4 q heads, 2 kv heads)."""
    from transformers import AutoConfig

    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if model_type == "qwen3":
        base["head_dim"] = 16
    base.update(kw)
    return AutoConfig.for_model(model_type, **base)


def tiny_model(model_type: str = "llama", seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **kw))
    return model.eval()


def get_peft_model(model, config):
    """peft.get_peft_model as the fine-tune runner calls it: inside `peft_wrapping`, which keeps peft's read of
    transformers' deprecated `is_gradient_checkpointing` from warning (pyproject.toml makes that warning an error)."""
    from peft import get_peft_model as wrap

    from longctx_patch.train.trained import peft_wrapping

    with peft_wrapping():
        return wrap(model, config)


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture
def simulate(monkeypatch):
    """Decode steps replayed from CUDA graphs on the CPU for the models patched in the test (LONGCTX_DECODE_GRAPHS=
    simulate at patch time, decode_graphs.DecodeGraphs.simulate: a replay re-runs the step with the host fields of its
    capture, which is what a CUDA graph bakes in)."""
    monkeypatch.setenv("LONGCTX_DECODE_GRAPHS", "simulate")


def greedy_with_scores(model, ids, n, **kw):
    """Exactly `n` greedy new tokens of an unpadded batch: (sequences, scores [B, n, vocab], the cache)."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.scores, 1), out.past_key_values


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (fp32, CPU), loaded once per test session."""
    import longctx_patch

    return longctx_patch.load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def pg_essays_dir():
    d = TEST_DATA / "pg_essays"
    if not d.is_dir():
        pytest.fail(f"test data {d} is missing: it ships with the repository (tests/data/README.md)")
    return d


def _one_intra_op_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_thread():
    """Tiny models: one intra-op thread avoids oversubscription stalls on a loaded 2-core machine."""
    yield from _one_intra_op_thread()


@pytest.fixture(scope="module")
def one_thread_module():
    """`one_thread` for a whole module of tiny models: `pytestmark = pytest.mark.usefixtures("one_thread_module")`."""
    yield from _one_intra_op_thread()


def left_padded_prompts(lens, seed: int = 4, vocab: int = 128):
    """Random prompts of lengths `lens` (token ids 3..vocab-1) and their left-padded batch: (prompts, ids, mask)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in lens]
    L = max(lens)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    am = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, L - len(p):] = p
        am[r, L - len(p):] = 1
    return prompts, ids, am


def assert_left_padded_batch_matches_single(model, lens, max_new_tokens: int, seed: int = 4) -> None:
    """Greedy generate() of a left-padded batch of random prompts (lengths `lens`) gives, row by row, the
    tokens (prompt and continuation) of generating each prompt alone."""
    prompts, ids, am = left_padded_prompts(lens, seed)
    L = max(lens)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=am, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        for r, p in enumerate(prompts):
            one = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            assert torch.equal(batch[r, L - len(p):], one[0]), (r, batch[r], one[0])


def padded_batch_gap(model, lens, max_new_tokens: int = 0, seed: int = 4, position_ids: bool = True,
                     vocab: int = 128) -> tuple[float, bool]:
    """A left-padded batch of random prompts (lengths `lens`) against each prompt alone: the largest |logit
    difference| over every real position of the prefill (a plain forward, with `position_ids` from the mask or
    without any) and, with `max_new_tokens`, over every greedy decode step's logits; and whether every row
    generated the tokens it generates alone."""
    prompts, ids, am = left_padded_prompts(lens, seed, vocab)
    L = max(lens)
    gap, same = 0.0, True
    with torch.no_grad():
        kw = {"position_ids": (am.cumsum(1) - 1).clamp_min(0)} if position_ids else {}
        logits = model(ids, attention_mask=am, use_cache=False, **kw).logits.float()
        for r, p in enumerate(prompts):
            alone = model(p[None], use_cache=False).logits.float()
            gap = max(gap, (logits[r, L - len(p):] - alone[0]).abs().max().item())
        if max_new_tokens:
            gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, output_scores=True,
                       return_dict_in_generate=True)
            batch = model.generate(ids, attention_mask=am, **gen)
            for r, p in enumerate(prompts):
                one = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **gen)
                # a row that ends (eos) earlier than the batch is continued with padding there
                row, alone = batch.sequences[r, L - len(p):], one.sequences[0]
                same = same and torch.equal(row[:len(alone)], alone) and bool((row[len(alone):] == 0).all())
                for sb, so in zip(batch.scores, one.scores):
                    gap = max(gap, (sb[r].float() - so[0].float()).abs().max().item())
    return gap, same


def assert_padded_batch_exact(model, lens, max_new_tokens: int = 6, atol: float = 1e-4, **kw) -> None:
    """Every row of a left-padded batch has the logits (within `atol`, fp32) and greedy tokens of its prompt alone."""
    gap, same = padded_batch_gap(model, lens, max_new_tokens, **kw)
    assert same and gap <= atol, f"padded rows differ from the prompts alone: max |dlogits| {gap:.3g}, tokens same: {same}"
