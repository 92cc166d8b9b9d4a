"""Logit shaping in the batched sampler: constraints, penalties, logit_bias, per row."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from engine.grammar import Grammar, GrammarCompiler, GrammarError
from engine.logits_processor import LogitsProcessor
from engine.request import SamplingParams
from engine.sampling import BatchSampler

VOCAB = 70  # not a multiple of 32: the last bitmask word is partial


class OnlyTokens:
    """A constraint that allows a fixed set of tokens and records what it was fed."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.seen: list[int] = []

    def fill_bitmask(self, out: np.ndarray) -> None:
        out[:] = 0
        for t in self.allowed:
            out[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def accept(self, token: int) -> None:
        self.seen.append(token)


def logits(rows: int, seed: int = 0) -> mx.array:
    return mx.random.normal((rows, VOCAB), key=mx.random.key(seed)) * 3


def test_constrained_rows_sample_only_allowed_tokens_beside_free_rows():
    allowed = {3, 33, 64, 69}
    x = logits(3)
    free_best = mx.argmax(x, axis=-1).tolist()
    constraint = OnlyTokens(allowed)
    params = [SamplingParams(temperature=0), SamplingParams(
        temperature=1.0, processor=LogitsProcessor(constraint=constraint)), SamplingParams(temperature=0)]
    sampler = BatchSampler(params)
    assert sampler.needs_feedback
    for step in range(20):
        tokens = sampler.sample(x, [step] * 3).tokens.tolist()
        assert tokens[1] in allowed
        assert tokens[0] == free_best[0] and tokens[2] == free_best[2]
        sampler.accept(tokens)
    assert len(constraint.seen) == 20 and set(constraint.seen) <= allowed


def test_a_batch_without_processors_needs_no_feedback():
    assert not BatchSampler([SamplingParams(), SamplingParams(temperature=0)]).needs_feedback


def test_logit_bias_forces_and_bans_tokens():
    x = logits(2, seed=1)
    best = mx.argmax(x, axis=-1).tolist()
    sampler = BatchSampler([SamplingParams(temperature=0, logit_bias=((7, 100.0),)),
                            SamplingParams(temperature=0, logit_bias=((best[1], -100.0),))])
    tokens = sampler.sample(x, [0, 0]).tokens.tolist()
    assert tokens[0] == 7 and tokens[1] != best[1]


def test_presence_penalty_stops_a_greedy_row_repeating_itself():
    x = logits(1, seed=2)
    plain = BatchSampler([SamplingParams(temperature=0)])
    assert len({plain.sample(x, [i]).tokens.item() for i in range(5)}) == 1
    sampler = BatchSampler([SamplingParams(temperature=0, processor=LogitsProcessor(presence_penalty=100.0))])
    seen = []
    for i in range(5):
        token = sampler.sample(x, [i]).tokens.item()
        sampler.accept([token])
        seen.append(token)
    assert len(set(seen)) == 5


@pytest.fixture(scope="module")
def compiler():
    from mlx_lm.tokenizer_utils import load

    from engine.tiny_model import ensure_default_model

    tok = load(ensure_default_model())
    return tok, GrammarCompiler(tok, 259, sorted(tok.eos_token_ids))


def test_llguidance_grammar_drives_random_logits_to_a_valid_document(compiler):
    tok, comp = compiler
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    eos = sorted(tok.eos_token_ids)[0]
    compiled = comp.compile(Grammar.json_schema(schema))
    processor = LogitsProcessor(constraint=compiled.new_constraint())
    sampler = BatchSampler([SamplingParams(temperature=1.0, seed=3, processor=processor)])
    out: list[int] = []
    for i in range(60):
        token = sampler.sample(mx.random.normal((1, 259), key=mx.random.key(i)), [i]).tokens.item()
        sampler.accept([token])
        if token == eos:
            break
        out.append(token)
    assert token == eos
    doc = json.loads(tok.decode(out))
    assert isinstance(doc["ok"], bool) and 0 <= doc["n"] <= 9 and set(doc) == {"ok", "n"}


def test_an_uncompilable_schema_names_the_problem(compiler):
    _, comp = compiler
    with pytest.raises(GrammarError, match="strin"):
        comp.compile(Grammar.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}))


def test_a_repeated_schema_is_compiled_once_and_copies_are_independent(compiler):
    tok, comp = compiler
    grammar = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    first, again = comp.compile(grammar), comp.compile(grammar)
    assert first is again
    one, two = first.new_constraint(), first.new_constraint()
    for t in tok.encode('{"a":1}'):
        one.accept(t)
    assert one.done and not two.done
