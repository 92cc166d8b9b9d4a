"""Grammars for constrained decoding, compiled with llguidance.

`GrammarCompiler` is built once per tokenizer (the token trie costs up to a second on a
150k vocabulary) and compiles a `Grammar` into a `CompiledGrammar`: a validated matcher
that each request copies (`new_constraint`), so compilation happens once per request on
the HTTP side's worker thread and never on the engine thread. A grammar llguidance
cannot compile raises `GrammarError` with llguidance's message, before any prefill.

docs/structured-output.md says why llguidance rather than xgrammar or outlines-core.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

# Compact JSON: no free whitespace, so a weak model cannot loop on spaces forever.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


CACHE_ENTRIES = 64


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled; the message says why."""


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's serialized form, with a short description for errors."""

    source: str
    what: str

    @staticmethod
    def json_schema(schema: dict[str, Any]) -> Grammar:
        try:
            import llguidance

            source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema is not valid: {exc}") from exc
        return Grammar(source, "JSON schema")

    @staticmethod
    def json_object() -> Grammar:
        return Grammar.json_schema({"type": "object"})

    @staticmethod
    def lark(text: str, what: str = "grammar") -> Grammar:
        import llguidance

        return Grammar(llguidance.LLMatcher.grammar_from_lark(text), what)


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule body that matches compact JSON valid against `schema`."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, separators=(",", ":"))


def lark_literal(text: str) -> str:
    return json.dumps(text)


class LLGuidanceConstraint:
    """One request's grammar state (a copy of the compiled matcher)."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, out: np.ndarray) -> None:
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.size * out.itemsize)

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    @property
    def done(self) -> bool:
        return bool(self._matcher.is_stopped())


@dataclass(frozen=True)
class CompiledGrammar:
    grammar: Grammar
    _matcher: Any

    def new_constraint(self) -> LLGuidanceConstraint:
        return LLGuidanceConstraint(self._matcher.deep_copy())


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary size (the logits' width)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._ll

    def special_token(self, text: str) -> str | None:
        """Lark syntax for `text` when the tokenizer holds it as one special token."""
        ids = self._hf.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self._tokenizer().is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return None

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """Blocking (milliseconds, up to a second for huge schemas): call it in a thread.

        Agents send the same tools and schemas turn after turn, so the last
        `CACHE_ENTRIES` compiled grammars are kept (each request still gets its own copy
        of the matcher from `new_constraint`)."""
        import llguidance

        with self._lock:
            hit = self._cache.get(grammar.source)
            if hit is not None:
                self._cache.move_to_end(grammar.source)
                return hit
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar.source, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {grammar.what} cannot be compiled: {matcher.get_error()}")
        compiled = CompiledGrammar(grammar, matcher)
        with self._lock:
            self._cache[grammar.source] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled
