"""A ``tokenizers`` tokenizer built from a GGUF's ``tokenizer.ggml.*`` metadata.

Two vocabularies are understood, as llama.cpp names them in ``tokenizer.ggml.model``:

- ``llama``: SentencePiece BPE (Gemma, Llama 2, Mistral). No merges are stored: they are
  rebuilt from the vocabulary, a pair ranked by its merged piece's score (llama.cpp's SPM
  merges the best-scoring adjacent pair first). Spaces become ``▁``, unknown bytes fall back
  to ``<0xNN>`` tokens.
- ``gpt2``: byte-level BPE with stored merges (Llama 3, Qwen 2/3, Mistral's Tekken), split
  first by the regex ``tokenizer.ggml.pre`` names. Qwen's own tokenizer NFC-normalizes first
  (llama.cpp does not): so does the conversion, to give the source model's tokens. Llama 3 and
  Tekken vocabularies take a whole pre-token that is in the vocabulary as is (``ignore_merges``)
  and start with BOS unless the file says otherwise, as llama.cpp reads them.

Control tokens (type 3) are special tokens; user-defined ones (type 4: Gemma's runs of
spaces, tabs and newlines, ``<think>``) are matched whole in the raw text, as llama.cpp does.
"""

from __future__ import annotations

from typing import Any

from engine.gguf.reader import GGUFError, GGUFFile

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (  # the regex of Mistral's tokenizer.json, which llama.cpp rewrites without \p{Lu}
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "tekken": _TEKKEN_SPLIT,
}
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "tekken"})
_NFC = frozenset({"qwen2", "deepseek-r1-qwen"})


def build_tokenizer(g: GGUFFile) -> Any:
    """The tokenizer the file describes, as a ``tokenizers.Tokenizer``."""
    kind = g.metadata.get("tokenizer.ggml.model")
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{g.path}: no tokenizer.ggml.tokens vocabulary in the metadata")
    types = [int(t) for t in g.metadata.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    if len(types) != len(tokens):
        raise GGUFError(f"{g.path}: {len(tokens)} tokens but {len(types)} token types")
    if kind == "llama":
        tok = _sentencepiece_bpe(g, tokens, types)
    elif kind == "gpt2":
        tok = _byte_level_bpe(g, tokens)
    else:
        raise GGUFError(f"{g.path}: tokenizer model {kind!r} cannot be converted "
                        f"(supported: 'llama' (SentencePiece BPE), 'gpt2' (byte-level BPE))")
    _add_special_tokens(tok, tokens, types)
    _set_post_processor(g, tok, tokens)
    return tok


def _sentencepiece_bpe(g: GGUFFile, tokens: list[str], types: list[int]) -> Any:
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    scores = list(g.metadata.get("tokenizer.ggml.scores", [-float(i) for i in range(len(tokens))]))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    mergeable = {t for t, ty in zip(tokens, types, strict=True) if ty in (NORMAL, UNUSED)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[i], i, vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(r[4], r[5]) for r in ranked]
    unk_id = g.metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and unk_id < len(tokens) else None
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True,
                        dropout=None))
    steps = [normalizers.Replace(" ", "▁")]
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if g.metadata.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
        decode.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(decode)
    return tok


def _byte_level_bpe(g: GGUFFile, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    pre = g.metadata.get("tokenizer.ggml.pre", "default")
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        raise GGUFError(f"{g.path}: byte-level pre-tokenizer {pre!r} is not known to the converter "
                        f"(known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))})")
    merges_raw = g.metadata.get("tokenizer.ggml.merges", [])  # none: every token is one byte
    if not isinstance(merges_raw, list):
        raise GGUFError(f"{g.path}: tokenizer.ggml.merges is not a list of strings")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False, byte_fallback=False,
                        ignore_merges=pre in _IGNORE_MERGES))
    if pre in _NFC:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_special_tokens(tok: Any, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    special = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types, strict=True) if ty in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types, strict=True) if ty == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)


def _set_post_processor(g: GGUFFile, tok: Any, tokens: list[str]) -> None:
    from tokenizers import processors

    bos_id = g.metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = g.metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = adds_bos(g)
    add_eos = g.metadata.get("tokenizer.ggml.add_eos_token", False)
    pre = [(tokens[bos_id], bos_id)] if add_bos and isinstance(bos_id, int) else []
    post = [(tokens[eos_id], eos_id)] if add_eos and isinstance(eos_id, int) else []
    if not pre and not post:
        return
    head = " ".join(t for t, _ in pre)
    tail = " ".join(t for t, _ in post)
    single = " ".join(x for x in (head, "$A", tail) if x)
    pair = " ".join(x for x in (head, "$A", tail, head, "$B:1", tail) if x)
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=sorted(set(pre + post)))


def adds_bos(g: GGUFFile) -> bool:
    """Whether a prompt starts with BOS: the file's ``add_bos_token``, else llama.cpp's default
    (yes for SentencePiece, Llama 3 and Tekken vocabularies, no for other byte-level ones)."""
    default = (g.metadata.get("tokenizer.ggml.model") == "llama"
               or g.metadata.get("tokenizer.ggml.pre") in _IGNORE_MERGES)
    return bool(g.metadata.get("tokenizer.ggml.add_bos_token", default))


def tokenizer_config(g: GGUFFile, chat_template: str | None, extra_eos: tuple[str, ...],
                     context_length: int) -> tuple[dict[str, Any], list[int]]:
    """``tokenizer_config.json``'s fields and the EOS ids (the file's EOS, then extra_eos)."""
    tokens: list[str] = g.metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = g.metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    eos = token("eos")
    index = {t: i for i, t in enumerate(tokens)}
    eos_ids = [index[t] for t in (eos, *extra_eos) if t is not None and t in index]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context_length,
        "bos_token": token("bos"),
        "eos_token": eos,
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": adds_bos(g),
        "add_eos_token": bool(g.metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    template = g.metadata.get("tokenizer.chat_template") or chat_template
    if template:
        config["chat_template"] = template
    return config, list(dict.fromkeys(eos_ids))
