"""Fill-in-the-middle: which tokens a model's tokenizer has for it, and the prompt they make.

A code model trained for infilling reads `prefix`, then `suffix`, then writes the middle,
with three control tokens marking the parts (prefix-suffix-middle order, the one every
family below was trained on and that llama.cpp's /infill builds):

    [BOS] <PRE> prefix <SUF> suffix <MID>   ->  middle ... <end>

Whether a model can do it is read from its tokenizer, as llama.cpp does from the
vocabulary: a family counts when all three of its markers are tokens of the vocabulary
(a model whose tokenizer lacks them was never trained to infill, whatever its name). The
markers go into the prompt as ids, never as text to be parsed, and the prefix and suffix
are encoded with special tokens split, so a `<|fim_middle|>` written in the user's code
is code, not a marker.

Generation ends on the tokenizer's EOS and on what each family writes after a middle
(`<|endoftext|>` for Qwen2.5-Coder and StarCoder, `<EOT>` for CodeLlama,
`<|file_separator|>` for CodeGemma), plus the repository and file markers that would
start another document, which llama.cpp counts as end of generation too.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FimFamily:
    """One family's marker tokens, as the vocabulary spells them."""

    name: str
    prefix: tuple[str, ...]  # spellings of the prefix marker, the first found wins
    suffix: tuple[str, ...]
    middle: tuple[str, ...]
    ends: tuple[str, ...] = ()  # tokens that end a middle, when the vocabulary has them


# Order matters only where vocabularies share spellings: none of these do.
FAMILIES: tuple[FimFamily, ...] = (
    # Qwen2.5-Coder and CodeGemma (CodeGemma's ending is `<|file_separator|>`).
    FimFamily("qwen", ("<|fim_prefix|>",), ("<|fim_suffix|>",), ("<|fim_middle|>",),
              ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
               "<|file_separator|>")),
    # StarCoder / StarCoder2, SantaCoder (dashes), Granite code.
    FimFamily("starcoder", ("<fim_prefix>", "<fim-prefix>"), ("<fim_suffix>", "<fim-suffix>"),
              ("<fim_middle>", "<fim-middle>"),
              ("<|endoftext|>", "<fim_pad>", "<fim-pad>", "<reponame>", "<file_sep>",
               "<filename>")),
    # DeepSeek-Coder: begin / hole / end are prefix / suffix / middle.
    FimFamily("deepseek", ("<｜fim▁begin｜>",), ("<｜fim▁hole｜>",), ("<｜fim▁end｜>",),
              ("<|EOT|>", "<｜end▁of▁sentence｜>")),
    # CodeLlama: SentencePiece spells its markers with the word-start mark.
    FimFamily("codellama", ("▁<PRE>", "<PRE>"), ("▁<SUF>", "<SUF>"), ("▁<MID>", "<MID>"),
              ("▁<EOT>", "<EOT>")),
)


@dataclass(frozen=True)
class FimTokens:
    """A model's infilling tokens: the three markers, what ends a middle, and the BOS its
    tokenizer puts in front of every prompt (None when it adds none)."""

    family: str
    prefix_id: int
    suffix_id: int
    middle_id: int
    end_ids: frozenset[int]
    bos_id: int | None

    def prompt(self, prefix: Sequence[int], suffix: Sequence[int]) -> list[int]:
        """The prefix-suffix-middle prompt, from the two parts' ids."""
        head = [self.bos_id] if self.bos_id is not None else []
        return [*head, self.prefix_id, *prefix, self.suffix_id, *suffix, self.middle_id]

    def prefix_span(self, prompt_len: int, suffix_len: int) -> tuple[int, int]:
        """Where the prefix's tokens lie, [start, end), in a `prompt(...)` of `prompt_len`
        ids made with a suffix of `suffix_len`."""
        start = 2 if self.bos_id is not None else 1
        return start, prompt_len - suffix_len - 2


def _vocab_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` when it is one token of the vocabulary (not an unknown-token
    fallback)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        token_id = inner.convert_tokens_to_ids(token)
    except Exception:  # a tokenizer without a vocabulary lookup
        return None
    if not isinstance(token_id, int) or token_id < 0:
        return None
    if inner.convert_ids_to_tokens(token_id) != token:  # the unknown token came back
        return None
    return token_id


def _first(tokenizer: Any, spellings: tuple[str, ...]) -> int | None:
    for spelling in spellings:
        token_id = _vocab_id(tokenizer, spelling)
        if token_id is not None:
            return token_id
    return None


def _bos(tokenizer: Any) -> int | None:
    """The BOS id when the tokenizer adds one to a plain encode (Llama, Gemma,
    DeepSeek); the markers go after it, as in their training data."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    bos = getattr(inner, "bos_token_id", None)
    if bos is None:
        return None
    ids = list(inner.encode("a"))
    return bos if ids and ids[0] == bos else None


def detect(tokenizer: Any) -> FimTokens | None:
    """The tokenizer's fill-in-the-middle tokens, or None when it has none."""
    for family in FAMILIES:
        ids = [_first(tokenizer, s) for s in (family.prefix, family.suffix, family.middle)]
        if any(i is None for i in ids):
            continue
        prefix_id, suffix_id, middle_id = (int(i) for i in ids)  # type: ignore[arg-type]
        ends = {i for i in (_vocab_id(tokenizer, t) for t in family.ends) if i is not None}
        ends |= set(getattr(tokenizer, "eos_token_ids", ()) or ())
        return FimTokens(family.name, prefix_id, suffix_id, middle_id, frozenset(ends),
                         _bos(tokenizer))
    return None


_detected: weakref.WeakKeyDictionary[Any, FimTokens | None] = weakref.WeakKeyDictionary()


def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """`detect`, once per tokenizer object (it lives as long as its model)."""
    try:
        return _detected[tokenizer]
    except KeyError:
        found = _detected[tokenizer] = detect(tokenizer)
        return found
    except TypeError:  # not weakly referenceable
        return detect(tokenizer)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """`text` as plain text: no BOS or EOS added, and special-token spellings inside it
    split into ordinary tokens, so user code cannot forge a marker."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return list(inner.encode(text, add_special_tokens=False, split_special_tokens=True))
    except TypeError:  # a tokenizer without split_special_tokens
        return list(inner.encode(text, add_special_tokens=False))
