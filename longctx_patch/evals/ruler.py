"""RULER's synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", github.com/NVIDIA/RULER), generated offline from a seed.

Tasks, as RULER's `synthetic.yaml` configures them
----------------------------------------------------
- ``niah_single_1``: one 7-digit number under an adjective-noun key, in repeated filler sentences ("noise").
- ``niah_single_2``: the same in essay text; ``niah_single_3``: a UUID in essay text.
- ``niah_multikey_1``: four needles with different keys in essay text; one key is asked.
- ``niah_multikey_2``: the haystack is made of needles (numbers under other keys), one of them asked.
- ``niah_multikey_3``: the same with UUID keys and UUID values.
- ``niah_multivalue``: four values under one key, all asked.
- ``niah_multiquery``: four keys, all asked.
- ``vt``: variable tracking: one chain of 4 hops ``VAR B = VAR A`` from ``VAR A = 12345`` hidden in filler lines,
  after one worked example of about 500 tokens; the answer is every variable of the chain.
- ``cwe``: common words extraction: a numbered list where 10 words appear 30 times and the others 3 times (6 and 1
  below 4k tokens), after one worked example; the answer is the 10 common words.
- ``fwe``: frequent words extraction: random 6-letter "coded words" drawn with Zipf frequencies (alpha 2; the most
  frequent one is '...', the noise); the answer is the next three.

Prompts are RULER's templates and answer prefixes. A sample of length L is RULER's "sequence length": its prompt
(chat template and answer prefix included, measured with the model's tokenizer) plus the task's generation
budget (RULER's tokens_to_generate: niah 128, vt 30, cwe 120, fwe 50) is at most L tokens, as long as it can be
made by whole units of haystack (tokens of essay text, filler lines, needle lines, list entries). With a chat
template, the answer prefix follows the assistant header (RULER's model templates do the same) and the worked
example of cwe is a previous user/assistant turn; without one, the text is RULER's 'base' template.

Scoring is RULER's `string_match_all`: the fraction of the expected strings found (case-insensitive substring) in
the answer, after RULER's clean-up of the prediction; a task's score is the mean over its samples, in percent. A
sample counts as correct in the paired comparison of methods (`niah.paired`) when it scores 1.

Differences from RULER's generator: essay haystacks start at a random paragraph of the text (RULER starts every
sample at the beginning of its essays) and needles go to the sentence boundary nearest to their depth (RULER picks
among nltk sentences); keys are adjective-noun pairs from a list of 64 x 64 words (RULER: wonderwords' lists);
cwe's words come from the packaged Shakespeare text (RULER: wonderwords' lists and a list of English words).
"""

from __future__ import annotations

import math
import os
import random
import re
import string
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import ConfigError
from ..generation import has_chat_template
from ..texts import binary_reason, read_text
from . import niah

TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3",
    "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery",
    "vt", "cwe", "fwe",
)
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}
HAYSTACKS = ("shakespeare", "stdlib")
STDLIB_CHARS = 2_000_000  # the Python standard library haystack: its first files, about this many characters
NOISE = niah.FILLER.strip()  # RULER's filler: "The grass is green. ... There and back again."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 needle depths, in percent


@dataclass(frozen=True)
class NiahConfig:
    haystack: str  # noise | essay | needle (the haystack is other needles)
    key: str  # words | uuids
    value: str  # numbers | uuids
    num_k: int = 1  # keys (needles of distinct keys)
    num_v: int = 1  # values per key
    num_q: int = 1  # keys asked


NIAH = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_v=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_k=4, num_q=4),
}

# RULER's task templates and answer prefixes (scripts/data/synthetic/constants.py)
NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
                "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots "
                "'....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

VT_HOPS, VT_ICL_TOKENS = 4, 500
CWE_COMMON, FWE_ALPHA, FWE_WORD_LEN = 10, 2.0, 6


def family(task: str) -> str:
    return "niah" if task.startswith("niah_") else task


def max_new_tokens(task: str) -> int:
    return TOKENS_TO_GENERATE[family(task)]


@dataclass
class RulerSample:
    """One prompt: token ids, the expected strings, and how it was made."""

    task: str
    length: int  # requested sequence length (prompt + generation budget)
    index: int  # sample number within its (task, length) cell
    answers: list[str]
    prompt_tokens: int
    max_new_tokens: int
    query: str  # what the question asks for (keys, a value)
    units: int  # haystack units in the prompt (essay tokens, filler or needle lines, list words, coded words)
    input_ids: list[int] = field(repr=False)
    depths: list[float] = field(default_factory=list)  # of the needles / chain lines, as fractions of the haystack
    # prompt tokens up to the end of the haystack: what a KV-cache compression method compresses; the rest is the
    # question, the end of the user turn and the answer prefix (kvpress's context / question split)
    context_tokens: int = 0

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("input_ids")
        return d


# ----------------------------------------------------------------------------------------------- haystacks
def python_source(root: str | Path | None = None, max_chars: int = STDLIB_CHARS) -> str:
    """Python source as a haystack: the .py files under `root` (default: the standard library's folder), in sorted
    order of their paths (site-packages, dist-packages, __pycache__ and hidden folders skipped), joined by blank
    lines, until about `max_chars` characters."""
    root = Path(root) if root is not None else Path(os.path.dirname(os.__file__))
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
                             and not d.startswith("."))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).parts)
    docs, n = [], 0
    for f in files:
        if binary_reason(f) is not None:  # the one rule of text inputs (texts.py): a folder's binary files are skipped
            continue
        text = read_text(f).strip()
        if text:
            docs.append(text)
            n += len(text) + 2
        if n >= max_chars:
            break
    if not docs:
        raise ConfigError(f"{root} holds no .py files")
    return "\n\n".join(docs)


def load_ruler_haystack(source: str | Path | None = None) -> tuple[str, str]:
    """`(text, description)` of the essay haystack: 'shakespeare' (default, the packaged text), 'stdlib' (the Python
    standard library's source), a text file, a folder of .txt/.md files, or a folder of Python source."""
    if source is None or str(source) == "shakespeare":
        return niah.load_haystack(None), f"package default ({niah.DEFAULT_HAYSTACK.name})"
    if str(source) == "stdlib":
        root = os.path.dirname(os.__file__)
        return python_source(root), f"Python standard library source ({root}, first {STDLIB_CHARS} characters)"
    p = Path(source)
    if p.is_dir() and not any(f.is_file() and f.suffix.lower() in (".txt", ".md") for f in p.iterdir()):
        return python_source(p), f"Python source under {p}"
    if not p.exists():
        raise ConfigError(f"haystack {source}: no such file or folder; use shakespeare, stdlib, a text file, a folder "
                          "of .txt files or a folder of Python source")
    return niah.load_haystack(p), str(p)


@lru_cache(maxsize=1)
def cwe_words() -> tuple[str, ...]:
    """The word list of cwe: the distinct lowercase words (3 to 12 letters) of the packaged Shakespeare text."""
    text = niah.DEFAULT_HAYSTACK.read_text(encoding="utf-8")
    return tuple(sorted(set(re.findall(r"\b[a-z]{3,12}\b", text))))


# ----------------------------------------------------------------------------------------------- prompts
@dataclass
class _Prompt:
    user: str
    prefix: str
    answers: list[str]
    query: str
    depths: list[float]
    shots: list[tuple[str, str]] = field(default_factory=list)  # earlier (user, assistant) turns
    question: str = ""  # the user text after the haystack (the template's part after {context})


def _render(tokenizer, p: _Prompt, chat: bool) -> str:
    if chat:
        msgs = []
        for u, a in p.shots:
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": p.user})
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + p.prefix
    return "".join(u + a + "\n" for u, a in p.shots) + p.user + p.prefix


def _tail(template: str, **kw) -> str:
    """The part of a task template after its {context}, filled in."""
    return template.split("{context}", 1)[1].format(**kw)


def _singular(text: str) -> str:
    """RULER's rewording of the niah template when one value is asked ('Some ... are' -> 'A ... is')."""
    for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(a, b)
    return text


def _word_keys() -> list[str]:
    return [f"{a}-{n}" for a in niah._ADJECTIVES for n in niah._NOUNS]


def _random(rng: random.Random, kind: str, keys: Sequence[str]) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return niah._value(rng, "uuid")
    return rng.choice(keys)


def _distinct(rng: random.Random, kind: str, n: int, keys: Sequence[str], avoid=()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = _random(rng, kind, keys)
        if v not in out and v not in avoid:
            out.append(v)
    return out


def _insert_lines(lines: list[str], items: Sequence[str], rng: random.Random, keep_order: bool) -> list[float]:
    """Inserts `items` between the lines at random places (in their order when `keep_order`); their depths."""
    n = len(lines)
    pos = sorted(rng.randint(0, n) for _ in items)
    if keep_order:  # item j goes after items 0..j-1: RULER's chains
        for j, (p, it) in enumerate(zip(pos, items)):
            lines.insert(p + j, it)
    else:
        for p, it in sorted(zip(pos, items), key=lambda t: -t[0]):
            lines.insert(p, it)
    return [round(p / n, 4) if n else 0.0 for p in pos]


def _niah_builder(tokenizer, task: str, rng_seed: str, haystack: str | None) -> tuple[Callable[[int], _Prompt], int]:
    cfg = NIAH[task]
    word_keys = _word_keys()
    v_kind = cfg.value

    def build(n: int) -> _Prompt:
        rng = random.Random(rng_seed)
        num_k = max(cfg.num_k, cfg.num_q)
        keys = _distinct(rng, cfg.key, num_k, word_keys)
        values = [_distinct(rng, v_kind, cfg.num_v, word_keys) for _ in keys]
        needles = [NEEDLE.format(type_needle_v=v_kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        asked = rng.sample(range(num_k), cfg.num_q)
        queries = [keys[i] for i in asked]
        answers = [v for i in asked for v in values[i]]
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        if cfg.haystack == "essay":
            corpus = niah._corpus(tokenizer, haystack, True)
            start = rng.choice(corpus.candidate_tokens)
            depths = [d / 100 for d in rng.sample(DEPTHS, len(needles))]
            hay, char_at = niah.window(corpus, start, n)
            context = niah._insert(hay, list(zip(depths, needles)), char_at) if hay else " ".join(needles)
        else:
            if cfg.haystack == "noise":
                lines = [NOISE] * n
            else:  # other needles, under other keys
                lines = [NEEDLE.format(type_needle_v=v_kind, key=_distinct(rng, cfg.key, 1, word_keys, keys)[0],
                                       value=_random(rng, v_kind, word_keys)) for _ in range(n)]
            depths = _insert_lines(lines, needles, rng, keep_order=False)
            context = "\n".join(lines)
        template, prefix, type_v = NIAH_TEMPLATE, NIAH_PREFIX, v_kind
        if cfg.num_q * cfg.num_v == 1:
            template, prefix, type_v = _singular(template), _singular(prefix), v_kind[:-1]
        return _Prompt(template.format(type_needle_v=type_v, context=context, query=query),
                       prefix.format(type_needle_v=type_v, query=query), answers, query, depths,
                       question=_tail(template, type_needle_v=type_v, query=query))

    return build, (64 if cfg.haystack == "essay" else 4)


def _vt_context(rng: random.Random, n: int, name_len: int) -> tuple[str, str, list[str], list[float]]:
    """`n` filler lines with one chain inserted in order: (context, the chain's value, its names, their depths)."""
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if v not in names:
            names.append(v)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(VT_HOPS)]
    lines = [NOISE] * n
    depths = _insert_lines(lines, chain, rng, keep_order=True)
    return "\n".join(lines).replace(". \n", ".\n"), value, names, depths


def _vt_builder(tokenizer, task: str, rng_seed: str, haystack: str | None) -> tuple[Callable[[int], _Prompt], int]:
    # the worked example (RULER's): 3-letter names, filler lines up to VT_ICL_TOKENS tokens, the answer after the
    # prefix; it opens the user's message
    def icl(n: int) -> str:
        context, value, names, _ = _vt_context(random.Random(rng_seed + "|icl"), n, 3)
        return (VT_TEMPLATE.format(context=context, query=value) + VT_PREFIX.format(num_v=VT_HOPS + 1, query=value)
                + " " + " ".join(names) + "\n")

    n_icl = _fit(lambda n: len(tokenizer(icl(n), add_special_tokens=False)["input_ids"]), VT_ICL_TOKENS, 5)
    example = icl(n_icl)

    def build(n: int) -> _Prompt:
        context, value, names, depths = _vt_context(random.Random(rng_seed), n, 5)
        user = example + "\n" + VT_TEMPLATE.format(context=context, query=value)
        return _Prompt(user, VT_PREFIX.format(num_v=VT_HOPS + 1, query=value), names, value, depths,
                       question=_tail(VT_TEMPLATE, query=value))

    return build, 4


def _cwe_list(rng: random.Random, words: Sequence[str], n: int, common_rep: int, rare_rep: int) -> tuple[str, list[str]]:
    chosen = rng.sample(words, n)
    common, rare = chosen[:CWE_COMMON], chosen[CWE_COMMON:]
    items = common * common_rep + rare * rare_rep
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common


def _cwe_builder(tokenizer, task: str, rng_seed: str, haystack: str | None, length: int):
    words = list(cwe_words())
    short = length < 4096  # RULER: fewer repeats below 4k tokens
    ex_words, ex_rep, main_rep = (20, (3, 1), (6, 1)) if short else (40, (10, 3), (30, 3))

    def build(n: int) -> _Prompt:
        rng = random.Random(rng_seed)
        ex_context, ex_answer = _cwe_list(rng, words, ex_words, *ex_rep)
        shot = (CWE_TEMPLATE.format(context=ex_context),
                CWE_PREFIX + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer)))
        context, answer = _cwe_list(rng, words, CWE_COMMON + n, *main_rep)
        return _Prompt(CWE_TEMPLATE.format(context=context), CWE_PREFIX, answer, "", [], shots=[shot],
                       question=_tail(CWE_TEMPLATE))

    return build, 16


def zeta(s: float, terms: int = 1000) -> float:
    """Riemann zeta(s) for s > 1 (Euler-Maclaurin after `terms` terms)."""
    if s <= 1:
        raise ConfigError(f"the Zipf exponent must be > 1 (got {s})")
    n = terms
    head = math.fsum(k ** -s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12


def _fwe_builder(tokenizer, task: str, rng_seed: str, haystack: str | None, length: int):
    vocab_size = max((length - max_new_tokens(task)) // 50, 5)  # RULER's vocabulary size
    z = zeta(FWE_ALPHA)

    def build(n: int) -> _Prompt:
        rng = random.Random(rng_seed)
        vocab: set[str] = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN)))
        ranked = sorted(vocab)
        rng.shuffle(ranked)
        ranked[0] = "..."  # the most frequent "word" is noise
        counts = [int(n * k ** -FWE_ALPHA / z) for k in range(1, vocab_size + 1)]
        text = [w for w, c in zip(ranked, counts) for _ in range(c)]
        rng.shuffle(text)
        return _Prompt(FWE_TEMPLATE.format(context=" ".join(text)), FWE_PREFIX, ranked[1:4], "", [],
                       question=_tail(FWE_TEMPLATE))

    return build, 64


def _fit(size: Callable[[int], float], budget: int, probe: int, limit: int | None = None) -> int:
    """The largest n in [0, limit] with size(n) <= budget, for a size growing with n (by bracketing from a linear
    estimate, then bisection); ConfigError when even n = 0 does not fit."""
    memo: dict[int, float] = {}

    def fits(n: int) -> bool:
        if limit is not None and n > limit:
            return False
        if n not in memo:
            memo[n] = size(n)
        return memo[n] <= budget

    if not fits(0):
        raise ConfigError(f"needs {int(memo[0])} tokens without any haystack, more than the {budget} available")
    per = max((size(probe) - memo[0]) / probe, 1e-3)
    guess = max(1, int((budget - memo[0]) / per))
    if limit is not None:
        guess = min(guess, limit)
    step = max(1, guess // 64)
    if fits(guess):
        lo = guess
        while fits(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi = guess
        while not fits(max(hi - step, 0)):
            hi, step = max(hi - step, 0), step * 2
        lo = max(hi - step, 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def context_tokens(tokenizer, text: str, cut: int, chat: bool) -> int:
    """Tokens of the encoded prompt `text` that start before its character `cut` (a token across the cut is
    context): `RulerSample.context_tokens`, with `cut` where the question starts."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
        return sum(1 for a, _ in enc["offset_mapping"] if a < cut)
    return len(niah._encode_prompt(tokenizer, text[:cut], chat))


def build_sample(tokenizer, task: str, length: int, *, seed: int = 0, index: int = 0, haystack: str | None = None,
                 chat: bool | None = None) -> RulerSample:
    """One RULER prompt of `task` whose tokens plus the task's generation budget are at most `length` (as close to
    it as whole haystack units allow). Same arguments give the same prompt. `haystack`: the essay text (essay tasks;
    default: the packaged text)."""
    if task not in TASKS:
        raise ConfigError(f"unknown ruler task {task!r}; choose from {', '.join(TASKS)}")
    chat = has_chat_template(tokenizer) if chat is None else chat
    if task in NIAH and NIAH[task].haystack == "essay" and haystack is None:
        haystack = niah.load_haystack(None)
    rng_seed = f"ruler|{seed}|{task}|{length}|{index}"
    fam = family(task)
    if fam == "niah":
        build, probe = _niah_builder(tokenizer, task, rng_seed, haystack)
    elif fam == "vt":
        build, probe = _vt_builder(tokenizer, task, rng_seed, haystack)
    elif fam == "cwe":
        build, probe = _cwe_builder(tokenizer, task, rng_seed, haystack, length)
    else:
        build, probe = _fwe_builder(tokenizer, task, rng_seed, haystack, length)
    gen = max_new_tokens(task)

    def encode(n: int) -> list[int]:
        return niah._encode_prompt(tokenizer, _render(tokenizer, build(n), chat), chat)

    limit = len(cwe_words()) - CWE_COMMON if fam == "cwe" else None
    try:
        n = _fit(lambda n: len(encode(n)), length - gen, probe, limit)
    except ConfigError as e:
        raise ConfigError(f"length {length} is too short for ruler task {task}: it {e} (the generation budget "
                          f"takes {gen})") from None
    if fam == "cwe" and n == limit and len(encode(n)) + gen < length - 64:
        raise ConfigError(f"cwe at length {length} needs more than the {len(cwe_words())} distinct words of its list; "
                          "use a shorter length")
    p = build(n)
    text = _render(tokenizer, p, chat)
    ids = niah._encode_prompt(tokenizer, text, chat)
    context = context_tokens(tokenizer, text, text.rindex(p.question), chat)
    return RulerSample(task=task, length=length, index=index, answers=list(p.answers), prompt_tokens=len(ids),
                       max_new_tokens=gen, query=p.query, units=n, input_ids=ids, depths=p.depths,
                       context_tokens=context)


def make_samples(tokenizer, tasks: Sequence[str], lengths: Sequence[int], samples: int, seed: int = 0,
                 haystack: str | None = None, chat: bool | None = None) -> list[RulerSample]:
    """Every (task, length, index) prompt of a run, in a fixed order."""
    if samples < 1:
        raise ConfigError(f"--samples must be >= 1 (got {samples})")
    return [build_sample(tokenizer, t, L, seed=seed, index=i, haystack=haystack, chat=chat)
            for t in tasks for L in lengths for i in range(samples)]


# ----------------------------------------------------------------------------------------------- scoring
def postprocess(pred: str) -> str:
    """RULER's clean-up of a prediction: control characters become newlines, then whitespace is stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def match_all(pred: str, refs: Sequence[str]) -> float:
    """Fraction of `refs` found in `pred` (case-insensitive substrings): one sample of `string_match_all`."""
    p = pred.lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def match_part(pred: str, refs: Sequence[str]) -> float:
    """1 if any of `refs` is in `pred` (case-insensitive), else 0: one sample of `string_match_part`."""
    p = pred.lower()
    return float(any(r.lower() in p for r in refs))


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's metric of the synthetic tasks: the mean over samples of the fraction of references found, in percent
    (2 decimals)."""
    return round(100 * sum(match_all(postprocess(p), r) for p, r in zip(preds, refs)) / len(preds), 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's metric of its QA tasks: the share of samples where any reference is found, in percent (2 decimals)."""
    return round(100 * sum(match_part(postprocess(p), r) for p, r in zip(preds, refs)) / len(preds), 2)


def score(answer: str, answers: Sequence[str]) -> float:
    """A sample's score: string_match_all of its cleaned answer, as a fraction."""
    return match_all(postprocess(answer), answers)


__all__ = [
    "TASKS",
    "NIAH",
    "RulerSample",
    "build_sample",
    "make_samples",
    "load_ruler_haystack",
    "python_source",
    "postprocess",
    "string_match_all",
    "string_match_part",
    "score",
    "context_tokens",
]
