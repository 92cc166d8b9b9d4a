"""Structured output on the HTTP side: from a request's format or forced tool call to a
compiled grammar, and from there to each engine request's `LogitsProcessor`.

Compilation runs in a worker thread before anything is submitted, so a schema that
cannot be compiled is a 400 naming the problem before any prefill, and the engine
thread never compiles.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.grammar import CompiledGrammar, Grammar, GrammarCompiler, GrammarError
from engine.logits_processor import LogitsProcessor
from server.errors import BadRequest
from server.state import ServerState

ProcessorFactory = Callable[[], LogitsProcessor | None]


def grammar_compiler(state: ServerState) -> GrammarCompiler:
    """One compiler per loaded model (it caches llguidance's view of the tokenizer)."""
    tokenizer = state.tokenizer
    compiler = state.grammar_compiler
    if compiler is None or compiler.tokenizer is not tokenizer:
        compiler = GrammarCompiler(tokenizer, state.vocab_size, sorted(tokenizer.eos_token_ids))
        state.grammar_compiler = compiler
    return compiler


def response_format_grammar(kind: str, schema: dict[str, Any] | None, *, param: str) -> Grammar | None:
    """`text` -> None; `json_object` -> any JSON object; `json_schema` -> that schema."""
    try:
        if kind == "json_object":
            return Grammar.json_object()
        if kind == "json_schema":
            return Grammar.json_schema(schema if schema is not None else {"type": "object"})
    except GrammarError as exc:
        raise BadRequest(str(exc), code="invalid_json_schema", param=param) from exc
    return None


async def compile_grammar(state: ServerState, grammar: Grammar, *, param: str) -> CompiledGrammar:
    compiler = grammar_compiler(state)
    try:
        return await asyncio.to_thread(compiler.compile, grammar)
    except GrammarError as exc:
        raise BadRequest(str(exc), code="invalid_json_schema", param=param) from exc


@dataclass(frozen=True)
class Shaping:
    """What each choice's `LogitsProcessor` is made of; `factory` makes a fresh one."""

    grammar: CompiledGrammar | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def factory(self) -> ProcessorFactory:
        if self.grammar is None and not self.frequency_penalty and not self.presence_penalty:
            return lambda: None
        grammar = self.grammar

        def make() -> LogitsProcessor:
            return LogitsProcessor(
                constraint=grammar.new_constraint() if grammar is not None else None,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty,
            )

        return make


def check_logit_bias(state: ServerState, pairs: tuple[tuple[int, float], ...]) -> None:
    vocab = state.vocab_size
    bad = next((t for t, _ in pairs if t >= vocab), None)
    if bad is not None:
        raise BadRequest(f"logit_bias names token id {bad}, outside the vocabulary (size {vocab})",
                         param="logit_bias")
