"""Fill-in-the-middle detection, table-driven over each family's real token spellings:
the byte tokenizer of the tiny model with a family's markers added, read through
mlx-lm's tokenizer wrapper as the server reads a loaded model's."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from engine.fim import detect, encode_text
from engine.tiny_model import SPECIAL_TOKENS, tokenizer_json

BASE = 256 + len(SPECIAL_TOKENS)
ENDOFTEXT = 256 + SPECIAL_TOKENS.index("<|endoftext|>")
IM_END = 256 + SPECIAL_TOKENS.index("<|im_end|>")


def _tokenizer(added: tuple[str, ...], *, bos: str | None = None) -> TokenizerWrapper:
    """The byte tokenizer plus `added` (special, ids from BASE on); with `bos`, that one
    is put in front of every encoding, as Llama's and Gemma's tokenizers do."""
    spec = tokenizer_json()
    for i, token in enumerate(added):
        spec["added_tokens"].append({  # type: ignore[union-attr]
            "id": BASE + i, "content": token, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True})
    if bos is not None:
        bos_id = BASE + added.index(bos)
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   eos_token="<|im_end|>", bos_token=bos)
    return TokenizerWrapper(fast)


CASES = [
    # family, added tokens (prefix, suffix, middle first), expected end-of-middle tokens
    ("qwen", ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>",
              "<|file_sep|>"), {"<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}),
    ("qwen", ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_separator|>"),  # CodeGemma
     {"<|endoftext|>", "<|file_separator|>"}),
    ("starcoder", ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<file_sep>"),
     {"<|endoftext|>", "<fim_pad>", "<file_sep>"}),
    ("starcoder", ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"), {"<|endoftext|>"}),  # SantaCoder
    ("deepseek", ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "<|EOT|>"),
     {"<|EOT|>"}),
    ("codellama", ("▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"), {"▁<EOT>"}),
]


@pytest.mark.parametrize(("family", "added", "ends"), CASES)
def test_each_family_is_found_with_its_markers_and_ends(family, added, ends):
    tokenizer = _tokenizer(added)
    fim = detect(tokenizer)
    assert fim is not None and fim.family == family
    assert (fim.prefix_id, fim.suffix_id, fim.middle_id) == (BASE, BASE + 1, BASE + 2)
    names = {**{t: BASE + i for i, t in enumerate(added)}, "<|endoftext|>": ENDOFTEXT}
    assert fim.end_ids == {names[t] for t in ends} | {IM_END}  # and the tokenizer's EOS
    assert fim.bos_id is None
    assert fim.prompt([1, 2], [3]) == [BASE, 1, 2, BASE + 1, 3, BASE + 2]
    assert fim.prefix_span(6, 1) == (1, 3)


def test_a_tokenizer_without_all_three_markers_has_no_fim():
    assert detect(_tokenizer(())) is None
    assert detect(_tokenizer(("<|fim_prefix|>", "<|fim_suffix|>"))) is None  # no middle
    assert detect(_tokenizer(("<fim_prefix>", "<|fim_suffix|>", "<MID>"))) is None  # mixed


def test_bos_goes_before_the_markers_when_the_tokenizer_adds_one():
    tokenizer = _tokenizer(("<s>", "▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"), bos="<s>")
    assert tokenizer.encode("a") == [BASE, 97]
    fim = detect(tokenizer)
    assert fim is not None and fim.bos_id == BASE
    prompt = fim.prompt([97], [98, 99])
    assert prompt == [BASE, BASE + 1, 97, BASE + 2, 98, 99, BASE + 3]
    assert fim.prefix_span(len(prompt), 2) == (2, 3)
    assert encode_text(tokenizer, "a") == [97]  # the parts get no BOS of their own


def test_marker_spellings_in_text_are_encoded_as_text():
    tokenizer = _tokenizer(("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    text = "x<|fim_middle|>y"
    assert encode_text(tokenizer, text) == list(text.encode())
    assert tokenizer.encode(text) == [120, BASE + 2, 121]  # what a plain encode would do
