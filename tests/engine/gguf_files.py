"""Tiny models, and GGUF files written from them the way llama.cpp's converter writes them.

`source_model(family, directory)` builds a tiny random mlx-lm model directory of one family
(float32, norms and biases random so that a misplaced one shows), with a byte-level BPE
tokenizer that has a few merges and that family's pre-tokenizer regex, so the split matters.
`write_gguf(source, path, writer)` then writes it (or any mlx-lm Llama/Qwen directory with a
byte-level tokenizer, such as the embedded tiny model) as ``convert_hf_to_gguf.py`` does:

- the metadata of ``TextModel.set_gguf_parameters`` (block count, context length, widths, head
  counts, RoPE base, RMS epsilon; key/value length when the config has ``head_dim``), and for
  ``LlamaModel`` the vocabulary size and RoPE dimension count too;
- the vocabulary as ``get_vocab_base`` lists it: ids the tokenizer lacks up to the config's
  ``vocab_size`` become ``[PAD<id>]`` (unused), added special tokens control tokens; then
  gguf-py's own ``SpecialVocab`` adds the merges, the BOS/EOS/padding ids, ``add_bos_token``
  and the chat template, and gguf-py's own tensor name map names the tensors;
- ``LlamaModel``'s q/k row permutation (weights and biases) for llama.cpp's interleaved RoPE.
  Mistral models (``MistralForCausalLM``) go through ``LlamaModel``: architecture ``llama``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.tiny_model import CHAT_TEMPLATE as CHATML_TEMPLATE
from engine.tiny_model import byte_chars

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Merges that tell the splits apart: "1 2" / "12 3" join digits only where the regex keeps
# them together (Llama 3's \p{N}{1,3}, not Qwen's or Tekken's \p{N}); "e L" joins inside
# "HeLLo" only where an upper-case run does not start a new piece (Qwen, not Tekken).
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
          ("Ġ", "w"), ("1", "2"), ("12", "3"), ("e", "L"), ("L", "L"), ("eL", "L"), ("Ã", "©"))
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class LlamaCppWriter:
    """What llama.cpp's converter class for an architecture does differently."""

    gguf_arch: str  # general.architecture as llama.cpp writes it
    permute_qk: bool  # LlamaModel.undo_permute
    llama_keys: bool  # LlamaModel adds vocab_size and rope_dimension_count
    pre: str  # tokenizer.ggml.pre: the name llama.cpp gives the tokenizer's split regex


QWEN2_WRITER = LlamaCppWriter("qwen2", permute_qk=False, llama_keys=False, pre="qwen2")
QWEN3_WRITER = LlamaCppWriter("qwen3", permute_qk=False, llama_keys=False, pre="qwen2")
MISTRAL_WRITER = LlamaCppWriter("llama", permute_qk=True, llama_keys=True, pre="tekken")
LLAMA3_WRITER = LlamaCppWriter("llama", permute_qk=True, llama_keys=True, pre="llama-bpe")


@dataclass(frozen=True)
class Family:
    """A tiny source model of one Hugging Face architecture, and how llama.cpp writes it."""

    name: str
    config: dict[str, Any]  # the source's config.json (model_type, shape, special ids)
    writer: LlamaCppWriter
    split: str  # the tokenizer's split regex (what writer.pre names)
    specials: tuple[str, ...]
    bos: str | None  # tokenizer_config's bos_token
    eos: str
    add_bos: bool
    chat_template: str
    nfc: bool = False  # the tokenizer normalizes to NFC first (Qwen's does)
    ignore_merges: bool = False
    padding: int = 0  # embedding rows past the tokenizer's last id (Qwen pads its vocabulary)
    extra: dict[str, Any] = field(default_factory=dict)
    user_tokens: tuple[str, ...] = ()  # added tokens that are not special (Qwen 3's <think>)


_SHAPE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096)
FAMILIES: dict[str, Family] = {
    "qwen2": Family(
        "qwen2", dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], **_SHAPE,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
        QWEN2_WRITER, _QWEN2_SPLIT, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        None, "<|im_end|>", False, CHATML_TEMPLATE, nfc=True, padding=5,
        extra={"bos_token_id": "<|endoftext|>"}),
    "qwen3": Family(
        "qwen3", dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], **_SHAPE, head_dim=32,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
        QWEN3_WRITER, _QWEN2_SPLIT, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        None, "<|im_end|>", False, CHATML_TEMPLATE, nfc=True, padding=3,
        extra={"bos_token_id": "<|endoftext|>"}, user_tokens=("<think>", "</think>")),
    "mistral": Family(
        "mistral", dict(model_type="mistral", architectures=["MistralForCausalLM"], **_SHAPE,
                        head_dim=16, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
                        tie_word_embeddings=False),
        MISTRAL_WRITER, _TEKKEN_SPLIT, ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
        "<s>", "</s>", True, MISTRAL_TEMPLATE, ignore_merges=True),
    # a Llama with q/k/v biases: llama.cpp permutes the q and k biases with their rows
    "llama-bias": Family(
        "llama-bias", dict(model_type="llama", architectures=["LlamaForCausalLM"], **_SHAPE,
                           attention_bias=True, rms_norm_eps=1e-5, rope_theta=500000.0,
                           tie_word_embeddings=False),
        LLAMA3_WRITER, _LLAMA3_SPLIT,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"),
        "<|begin_of_text|>", "<|eot_id|>", True, CHATML_TEMPLATE, ignore_merges=True),
    # Llama 3.2's RoPE scaling (llama.cpp stores it as rope_freqs.weight), head size 64 so that
    # three frequencies fall between the bounds, as in Llama 3.2 1B
    "llama3-rope": Family(
        "llama3-rope", dict(model_type="llama", architectures=["LlamaForCausalLM"], **_SHAPE,
                            head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                            rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_position_embeddings=8192)),
        LLAMA3_WRITER, _LLAMA3_SPLIT, ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"),
        "<|begin_of_text|>", "<|eot_id|>", True, CHATML_TEMPLATE, ignore_merges=True),
}


def tokens_of(family: Family) -> list[str]:
    """The tokenizer's tokens by id: the 256 bytes, the merged pieces, the added tokens."""
    return [*byte_chars(), *(a + b for a, b in MERGES), *family.specials, *family.user_tokens]


def _tokenizer_json(family: Family) -> dict[str, Any]:
    tokens = tokens_of(family)
    n_plain = len(tokens) - len(family.specials) - len(family.user_tokens)
    bos = [(family.bos, tokens.index(family.bos))] if family.add_bos and family.bos else []
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": t in family.specials}
            for i, t in enumerate(tokens) if i >= n_plain
        ],
        "normalizer": {"type": "NFC"} if family.nfc else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": family.split}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [*({"SpecialToken": {"id": t, "type_id": 0}} for t, _ in bos),
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [*({"SpecialToken": {"id": t, "type_id": 0}} for t, _ in bos),
                     {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in bos},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": family.ignore_merges,
                  "vocab": {t: i for i, t in enumerate(tokens[:n_plain])},
                  "merges": [f"{a} {b}" for a, b in MERGES]},
    }


def source_model(family: Family, directory: Path, *, seed: int = 0, vocab_size: int | None = None) -> Path:
    """A tiny random mlx-lm model of ``family`` written to ``directory`` (float32);
    ``vocab_size``: embedding rows for a vocabulary other than the family's tokenizer."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import MODEL_REMAPPING

    tokens = tokens_of(family)
    ids = {t: i for i, t in enumerate(tokens)}
    config = {**family.config, "vocab_size": vocab_size or len(tokens) + family.padding,
              "torch_dtype": "float32", "eos_token_id": ids[family.eos],
              **{k: ids[v] for k, v in family.extra.items()}}
    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        a = np.array(p.astype(mx.float32))
        if name.endswith("norm.weight"):  # ones by default: a norm read from the wrong place would pass
            a = 1.0 + 0.2 * rng.standard_normal(a.shape)
        elif name.endswith(".bias"):  # zeros by default: likewise
            a = 0.1 * rng.standard_normal(a.shape)
        weights[name] = mx.array(a.astype(np.float32))
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "tokenizer.json").write_text(json.dumps(_tokenizer_json(family)))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config["max_position_embeddings"],
        "bos_token": family.bos, "eos_token": family.eos, "pad_token": None, "unk_token": None,
        "add_bos_token": family.add_bos, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": family.chat_template,
    }))
    return directory


def _vocabulary(source: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """``TextModel.get_vocab_base``: every id up to ``vocab_size``, with its token type."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    reverse = {i: t for t, i in tokenizer.vocab.items()}
    added = tokenizer.get_added_vocab()
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        special = token in added and tokenizer.added_tokens_decoder[i].special
        types.append(gguf.TokenType.CONTROL if special else
                     gguf.TokenType.USER_DEFINED if token in added else gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def train_sentencepiece(path: Path, lines: list[str], vocab_size: int = 400) -> Path:
    """A SentencePiece BPE model trained as Mistral 7B's was set up (byte fallback, digits
    split, whitespace kept, no normalization); ids 0-2 ``<unk>``, ``<s>``, ``</s>``, then the
    control tokens ``[INST]`` and ``[/INST]``."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(path.with_suffix("")), vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, split_digits=True,
        control_symbols=["[INST]", "[/INST]"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", minloglevel=2)
    return path.with_suffix(".model")


def _sentencepiece_vocabulary(w: Any, model: Path, vocab_size: int) -> None:
    """``TextModel._set_vocab_sentencepiece`` for a Mistral 7B: every piece with its score and
    type (ids past the model's pieces ``[PAD<id>]``), BOS 1 added, EOS 2."""
    import gguf
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):
        tokens[i], scores[i] = sp.id_to_piece(i), sp.get_score(i)
        types[i] = (gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL
                    if sp.is_control(i) else gguf.TokenType.UNUSED if sp.is_unused(i)
                    else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def write_gguf(source: Path, path: Path, writer: LlamaCppWriter, *, arch: str | None = None,
               types: dict[str, Any] | None = None, sentencepiece: Path | None = None) -> Path:
    """The model directory ``source`` written to ``path`` as ``writer`` says llama.cpp writes
    it, in float32. ``arch`` overrides the architecture written; ``types`` gives tensors a
    quantized type (by GGUF name): quantized by gguf-py, or zero blocks of a type it cannot
    quantize (IQ*); ``sentencepiece``: the vocabulary is that SentencePiece model's instead of
    the source's tokenizer (as for Mistral 7B, whose embedding is sized to it)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((source / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch or writer.gguf_arch)
    w.add_name(f"tiny {config['model_type']}")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if "head_dim" in config:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if writer.llama_keys:
        w.add_vocab_size(config["vocab_size"])
        w.add_rope_dimension_count(config.get("head_dim")
                                   or config["hidden_size"] // config["num_attention_heads"])
    if sentencepiece is not None:
        _sentencepiece_vocabulary(w, sentencepiece, config["vocab_size"])
    else:
        tokens, token_types = _vocabulary(source, config["vocab_size"])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(writer.pre)
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        gguf.SpecialVocab(source, load_merges=True).add_to_gguf(w, quiet=True)

    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == writer.gguf_arch)
    names = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for hf_name, a in load_file(str(source / "model.safetensors")).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if writer.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            a = permute(a, heads)
        elif writer.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            a = permute(a, kv_heads)
        qtype = (types or {}).get(name)
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        else:
            try:
                data = gguf.quants.quantize(a, qtype)
            except NotImplementedError:
                data = np.zeros(gguf.quant_shape_to_byte_shape(a.shape, qtype), np.uint8)
            w.add_tensor(name, data, raw_dtype=qtype)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        from engine.gguf.llama3_rope import llama3_factors

        dims = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        w.add_tensor("rope_freqs.weight", llama3_factors(scaling, config["rope_theta"], dims))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def permute(a: np.ndarray, heads: int) -> np.ndarray:
    """``LlamaModel.permute``: each head's two halves interleaved (rows of a weight or bias)."""
    return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
