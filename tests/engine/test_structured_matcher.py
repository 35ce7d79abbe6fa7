"""Per-sequence grammar state and the batched bitmask, with the real SmolLM2 tokenizer.

Outputs here come from constrained random walks (random logits through the real mask), no model:
many outputs per schema, cheaply, and every one that finishes must validate."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from qworker.engine.structured import (
    GrammarCompilerService,
    StructuredBitmask,
    StructuredOutputsParams,
    StructuredState,
    allowed_tokens,
    build_tokenizer_info,
)

from .structured_support import one_thread, tokenizer, tokenizer_info  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 49152
EOS = 2

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "city": {"type": "string", "maxLength": 10}},
            "required": ["zip"],
        },
        "nickname": {"type": "string", "maxLength": 8},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
}
LIST = {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 1000}, "ok": {"type": ["boolean", "null"]}}, "required": ["id"]}, "minItems": 2, "maxItems": 4}
CODE = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}, "level": {"type": "integer", "minimum": -3, "maximum": 3}}, "required": ["code", "level"]}


@pytest.fixture(scope="module")
def svc():
    return GrammarCompilerService(tokenizer_info())


@pytest.fixture(scope="module")
def bias() -> torch.Tensor:
    """64 rows of random logits, drawn once: Gumbel noise (argmax of logits + Gumbel samples
    their softmax, with no per-step softmax or multinomial, which are slow on busy cores) plus a
    bias towards tokens that close things and against pure whitespace, so that random walks end
    in a few dozen steps."""
    b = torch.zeros(VOCAB)
    for i, tok in enumerate(tokenizer_info().decoded_vocab[:VOCAB]):
        if any(c in tok for c in (b'"', b"}", b"]", b",")):
            b[i] = 6.0
        if tok and not tok.strip():
            b[i] = -6.0
        b[i] -= 0.5 * len(tok)
    b[EOS] = 8.0
    u = torch.rand((64, VOCAB), generator=torch.Generator().manual_seed(1234)).clamp_(1e-9, 1 - 1e-7)
    return -torch.log(-torch.log(u)) * 2 + b


def grammar(svc, **kw):
    return svc.validate(StructuredOutputsParams(**kw))


def walk(state: StructuredState, gen: random.Random, bank: torch.Tensor, max_steps: int = 200, bm: StructuredBitmask | None = None) -> tuple[list[int], bool]:
    """A constrained random walk: random logits through the real mask, one sample per step."""
    bm = bm or StructuredBitmask(VOCAB)
    out: list[int] = []
    for _ in range(max_steps):
        logits = bank[gen.randrange(bank.shape[0])].clone().unsqueeze(0)
        bm.apply(logits, [(0, state)])
        t = int(logits[0].argmax())
        assert state.accept(t), "a masked sample was refused"
        if state.is_terminated():
            assert t == EOS
            return out, True
        out.append(t)
    return out, False


@pytest.mark.parametrize("schema", [PERSON, LIST, CODE], ids=["person", "list", "code"])
@pytest.mark.parametrize("compact", [False, True], ids=["ws", "compact"])
def test_json_schema_walks_validate(svc, bias, schema, compact):
    g = grammar(svc, json=schema, disable_any_whitespace=compact)
    gen = random.Random(7)
    finished = 0
    for _ in range(4):
        ids, done = walk(StructuredState(g), gen, bias)
        if done:
            finished += 1
            text = tokenizer().decode(ids)  # decode as the engine would (special tokens skipped)
            jsonschema.validate(json.loads(text), schema)
    assert finished >= 2


def test_json_object_walks_parse_as_objects(svc, bias):
    g = grammar(svc, json_object=True)
    for seed in range(3):
        ids, done = walk(StructuredState(g), random.Random(seed), bias, max_steps=300)
        assert done
        assert isinstance(json.loads(tokenizer().decode(ids)), dict)
    assert not StructuredState(g).matcher.accept_string("[1]")  # an object, not any JSON value


@pytest.mark.parametrize("regex", [r"\d{3}-\d{4}", r"(cat|dog)s? [a-z]{2,5}!", r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6})?", r"-?(0|[1-9]\d{0,3})\.\d{2}"])
def test_regex_walks_fullmatch(svc, bias, regex):
    g = grammar(svc, regex=regex)
    gen = random.Random(11)
    for _ in range(3):
        ids, done = walk(StructuredState(g), gen, bias)
        assert done
        assert re.fullmatch(regex, tokenizer().decode(ids)), tokenizer().decode(ids)


def test_choice_walks_land_on_a_choice(svc, bias):
    choices = ["positive", "negative", "neutral", 'say "hi"', "back\\slash", "two\nlines", "café ☕"]
    g = grammar(svc, choice=choices)
    gen = random.Random(5)
    seen = set()
    for _ in range(12):
        ids, done = walk(StructuredState(g), gen, bias)
        assert done
        text = tokenizer().decode(ids)
        assert text in choices
        seen.add(text)
    assert len(seen) >= 3
    for c in choices:  # every choice is reachable, and nothing longer
        s = StructuredState(g)
        assert s.matcher.accept_string(c) and s.is_completed()


def test_ebnf_grammar(svc):
    g = grammar(svc, grammar='root ::= item ("," item)*\nitem ::= [0-9]+')
    s = StructuredState(g)
    for t in tokenizer().encode("12,3,456"):
        assert s.accept(t)
    assert s.is_completed() and s.accept(EOS) and s.is_terminated()


def test_eos_is_masked_until_the_grammar_can_end(svc):
    s = StructuredState(grammar(svc, regex=r"ab\d+"))
    bm = torch.empty((1, VOCAB // 32), dtype=torch.int32)
    seen = []
    for t in tokenizer().encode("ab12"):
        s.fill(bm, 0)
        seen.append((s.is_completed(), bool(allowed_tokens(bm[0], VOCAB)[EOS])))
        assert s.accept(t)
    assert seen[0] == (False, False)
    assert all(done == eos_open for done, eos_open in seen)  # EOS allowed exactly where it may end
    s.fill(bm, 0)
    allowed = allowed_tokens(bm[0], VOCAB)
    assert allowed[EOS] and allowed[tokenizer().encode("3")[0]]  # may end or go on
    s2 = StructuredState(grammar(svc, regex="ab"))
    assert not s2.accept(EOS) and s2.num_rejected == 1  # refused, state unchanged
    for t in tokenizer().encode("ab"):
        assert s2.accept(t)
    s2.fill(bm, 0)
    assert allowed_tokens(bm[0], VOCAB).nonzero().flatten().tolist() == [EOS]  # only stop is left
    assert s2.accept(EOS) and s2.is_terminated()
    s2.fill(bm, 0)  # a terminated state still fills: only its stop tokens
    assert allowed_tokens(bm[0], VOCAB).nonzero().flatten().tolist() == [EOS]


def test_special_tokens_never_allowed_inside_strings(svc):
    s = StructuredState(grammar(svc, json={"type": "string"}))
    assert s.matcher.accept_string('"')
    bm = torch.empty((1, VOCAB // 32), dtype=torch.int32)
    s.fill(bm, 0)
    allowed = allowed_tokens(bm[0], VOCAB)
    assert not allowed[:17].any()  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...
    assert allowed.sum() > 40000


def test_model_vocab_larger_than_tokenizer_masks_the_padding():
    ti = build_tokenizer_info(tokenizer(), VOCAB + 64, [EOS])
    assert ti.vocab_size == VOCAB + 64
    svc = GrammarCompilerService(ti)
    s = StructuredState(svc.validate(StructuredOutputsParams(json={"type": "string"})))
    logits = torch.zeros(1, VOCAB + 64)
    StructuredBitmask(VOCAB + 64).apply(logits, [(0, s)])
    assert torch.isinf(logits[0, VOCAB:]).all() and torch.isfinite(logits[0, :VOCAB]).any()


def test_fork_gives_independent_states(svc):
    g = grammar(svc, json=CODE, disable_any_whitespace=True)
    parent = StructuredState(g)
    prefix = tokenizer().encode('{"code": "AB-')
    for t in prefix:
        assert parent.accept(t)
    a, b = parent.fork(), parent.fork()
    assert a.num_accepted == b.num_accepted == len(prefix)
    for t in tokenizer().encode('123", "level": 2}'):
        assert a.accept(t)
    assert a.is_completed() and not b.is_completed() and not parent.is_completed()
    for t in tokenizer().encode('987", "level": -3}'):
        assert b.accept(t)
    assert b.is_completed() and not parent.is_completed()
    assert a.accept(EOS) and a.is_terminated() and not b.is_terminated()


def _mask(state: StructuredState) -> torch.Tensor:
    bm = torch.empty((1, VOCAB // 32), dtype=torch.int32)
    state.fill(bm, 0)
    return bm[0].clone()


def test_replay_after_preemption_restores_the_same_state(svc, bias):
    g = grammar(svc, json=PERSON)
    gen = random.Random(1)
    live = StructuredState(g)
    ids, _ = walk(live, gen, bias, max_steps=25)
    rebuilt = StructuredState.replay(g, ids)  # "recompute": the tokens are replayed, not re-sampled
    assert rebuilt.num_accepted == live.num_accepted == len(ids)
    assert torch.equal(_mask(rebuilt), _mask(live))
    # both continue identically from here
    gen_a, gen_b = random.Random(9), random.Random(9)
    assert walk(live, gen_a, bias, 30) == walk(rebuilt, gen_b, bias, 30)
    with pytest.raises(ValueError, match="does not fit"):
        StructuredState.replay(g, tokenizer().encode("nope"))


def test_rollback(svc):
    g = grammar(svc, regex=r"\d{2}x")
    s = StructuredState(g)
    before = _mask(s)
    for t in tokenizer().encode("12"):
        assert s.accept(t)
    s.rollback(s.num_accepted)
    assert s.num_accepted == 0 and torch.equal(_mask(s), before)
    with pytest.raises(ValueError):
        s.rollback(1)


def test_batched_apply_touches_only_constrained_rows(svc):
    gs = [grammar(svc, regex=r"\d+"), grammar(svc, choice=["alpha", "beta"]), grammar(svc, json=CODE)]
    states = [StructuredState(g) for g in gs]
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    bm = StructuredBitmask(VOCAB)
    rows = [(0, states[0]), (3, states[1]), (5, states[2])]
    bm.apply(logits, rows)
    for r in (1, 2, 4):
        assert torch.equal(logits[r], raw[r])  # unconstrained neighbours are bit-identical
    for r, s in rows:
        allowed = allowed_tokens(_mask(s), VOCAB)
        assert torch.equal(logits[r][allowed], raw[r][allowed])
        assert torch.isneginf(logits[r][~allowed]).all()
    assert bm.mask_steps == 1 and bm.masked_rows == 3 and bm.mask_seconds > 0
    # the batch fill (several rows) and the one-row fill agree
    one = StructuredBitmask(VOCAB)
    for r, s in rows:
        assert torch.equal(one.fill(6, [(r, s)])[r], bm.fill(6, rows)[r])
    with pytest.raises(ValueError, match="once"):
        bm.apply(logits, [(0, states[0]), (0, states[1])])


def test_fill_overlapped_with_the_forward_pass_gives_the_same_mask(svc):
    states = [StructuredState(grammar(svc, json={"type": "string", "maxLength": 8})), StructuredState(grammar(svc, regex=r"\d+"))]
    assert states[0].matcher.accept_string('"Jo')  # a state whose fill costs milliseconds
    rows = [(0, states[0]), (2, states[1])]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    sync = logits.clone()
    StructuredBitmask(VOCAB).apply(sync, rows)
    bm = StructuredBitmask(VOCAB)
    fut = bm.start_fill(3, rows)  # ... the model would run here ...
    bm.apply(logits, rows, filled=fut)
    assert torch.equal(logits, sync)


def test_masked_greedy_picks_the_best_allowed_token(svc):
    s = StructuredState(grammar(svc, choice=["yes", "no"]))
    logits = torch.zeros(1, VOCAB)
    logits[0, tokenizer().encode("Hello")[0]] = 50.0  # the model's favourite is not allowed
    no = tokenizer().encode("no")[0]
    logits[0, no] = 1.0
    StructuredBitmask(VOCAB).apply(logits, [(0, s)])
    assert int(logits.argmax()) == no


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path needs CUDA")
def test_cuda_apply_matches_cpu(svc):
    states = [StructuredState(grammar(svc, json=CODE)), StructuredState(grammar(svc, regex=r"\d+"))]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    cpu = logits.clone()
    StructuredBitmask(VOCAB).apply(cpu, [(1, states[0]), (2, states[1])])
    gpu = logits.cuda()
    bm = StructuredBitmask(VOCAB, device="cuda")
    bm.apply(gpu, [(1, states[0]), (2, states[1])])
    assert torch.equal(gpu.cpu(), cpu)


def test_tokenizer_info_is_built_once_per_tokenizer_folder(tmp_path):
    """An engine made again in the same process reuses the info of its tokenizer folder; other
    stops, another width, or a tokenizer file changed on disk build it again."""
    import shutil

    from transformers import AutoTokenizer

    src = tokenizer().name_or_path
    folder = tmp_path / "tok"
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf", "*.bin"))
    size = len(tokenizer())
    eos = [tokenizer().eos_token_id]
    first = build_tokenizer_info(AutoTokenizer.from_pretrained(folder), size, eos)
    assert build_tokenizer_info(AutoTokenizer.from_pretrained(folder), size, eos) is first
    assert build_tokenizer_info(AutoTokenizer.from_pretrained(folder), size, [0]) is not first
    assert build_tokenizer_info(AutoTokenizer.from_pretrained(folder), size + 64, eos) is not first
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")  # same tokens, but a file changed: not trusted
    again = build_tokenizer_info(AutoTokenizer.from_pretrained(folder), size, eos)
    assert again is not first and again.vocab_size == first.vocab_size
