"""GGUF files of qwen2, qwen3, Mistral and Llama 3 convert to the model they came from.

Each family's tiny random model (qwen2, qwen3, a Tekken Mistral, a Llama 3 with biases, a
Llama 3.2 with llama3 RoPE scaling) is written as llama.cpp writes it
(tests/engine/gguf_files.py) and converted by our converter. The checks: mlx-lm reads the same
config fields from the conversion as from the source, the weights are equal, the tokenizer gives
the same ids, EOS and chat prompt, mlx-lm's greedy tokens and logits are identical, a real
server started on the ``.gguf`` file completes prompts as mlx-lm does on the source, alone and
batched, and admission sizes the file from its header as from its conversion. Also: a Mistral
7B SentencePiece vocabulary tokenizes as ``sentencepiece`` does, a Q8_0 model converts to its
dequantized weights, Q8_0 and Q4_K blocks dequantize to the values they encode, a conversion by
an older converter is redone, and an architecture the converter does not know is refused by
name with nothing cached.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.gguf import CACHE_ENV, GGUFError, ensure_converted, open_gguf
from tests.engine.gguf_files import FAMILIES, Family, source_model, tokens_of, write_gguf

TEXTS = (
    "hello the world", "the 123 and 12345 in HeLLo", "caf\u00e9 and cafe\u0301", "  two  spaces\n\nnew",
    "<|im_start|>user\nhi<|im_end|>", "[INST] x [/INST]", "<|begin_of_text|>y<|eot_id|>",
    "<think>\nthe 123</think>\n\nhello",
)
PROMPTS = ("hello the world, in a tiny test", "the 123 HeLLo\n", "wait the wait")


@dataclasses.dataclass(frozen=True)
class Converted:
    family: Family
    source: Path
    gguf: Path
    converted: Path


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cache = tmp_path_factory.mktemp("gguf-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(cache))
        yield cache


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request: pytest.FixtureRequest, gguf_cache: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Converted:
    family = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(family.name)
    source = source_model(family, root / "source")
    gguf = write_gguf(source, root / f"{family.name}.gguf", family.writer)
    return Converted(family, source, gguf, ensure_converted(gguf, dtype="float32", progress=lambda _: None))


def _args(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The mlx-lm module a config loads and the fields its ModelArgs reads from it."""
    from mlx_lm.utils import MODEL_REMAPPING

    module = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    args = importlib.import_module(f"mlx_lm.models.{module}").ModelArgs.from_dict(config)
    fields = {k: v for k, v in dataclasses.asdict(args).items() if k != "model_type"}
    if "head_dim" in fields and fields["head_dim"] is None:  # Llama: None means hidden / heads
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return module, fields


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(t) for t, _ in steps]


def test_mlx_lm_reads_the_source_s_config_and_weights(converted: Converted) -> None:
    from safetensors.numpy import load_file

    source = json.loads((converted.source / "config.json").read_text())
    ours = json.loads((converted.converted / "config.json").read_text())
    assert _args(ours) == _args(source)
    assert ours["eos_token_id"] == [source["eos_token_id"]]
    assert json.loads((converted.converted / "mlx_headroom_gguf.json").read_text())["architecture"] \
        == converted.family.writer.gguf_arch
    expected = load_file(str(converted.source / "model.safetensors"))
    weights = load_file(str(converted.converted / "model.safetensors"))
    assert sorted(weights) == sorted(expected)
    for name, a in expected.items():
        assert np.array_equal(weights[name], a), name  # q/k permuted back, biases included


def test_the_tokenizer_gives_the_source_s_ids_eos_and_chat_prompt(converted: Converted) -> None:
    from mlx_lm.utils import load_tokenizer

    source = load_tokenizer(converted.source)
    ours = load_tokenizer(converted.converted)
    for text in TEXTS:
        assert ours.encode(text) == source.encode(text), text
        ids = source.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == source.decode(ids), text
    assert ours.eos_token_ids == source.eos_token_ids
    for token in (*converted.family.specials, *converted.family.user_tokens):  # matched whole
        assert ours.encode(token, add_special_tokens=False) == [tokens_of(converted.family).index(token)]
    chat = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and 123?"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            == source.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))


def test_greedy_generation_is_token_identical(converted: Converted) -> None:
    import mlx_lm

    source, tokenizer = mlx_lm.load(str(converted.source))
    ours, _ = mlx_lm.load(str(converted.converted))
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        x = mx.array(ids)[None]
        assert mx.array_equal(ours(x), source(x)), prompt
        assert _greedy(ours, ids, 16) == _greedy(source, ids, 16), prompt


def test_a_server_on_the_gguf_completes_as_mlx_lm_on_the_source(converted: Converted, gguf_cache: Path,
                                                                 tmp_path: Path) -> None:
    """``serve --model file.gguf`` (converted already: the server finds it in the cache)."""
    import httpx
    import mlx_lm

    from tests.conftest import MODEL, ServerProcess

    source, tokenizer = mlx_lm.load(str(converted.source))

    def text(tokens: list[int]) -> str:  # as mlx-lm's generate spells tokens (its detokenizer)
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        for t in tokens:
            detokenizer.add_token(t)
        detokenizer.finalize()
        return str(detokenizer.text)

    def greedy_until_eos(prompt: str) -> list[int]:
        tokens = _greedy(source, tokenizer.encode(prompt), 8)
        ends = [i for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids]
        return tokens[:ends[0]] if ends else tokens

    expected = {p: text(greedy_until_eos(p)) for p in PROMPTS}
    listing = sorted(p.name for p in gguf_cache.iterdir())
    server = ServerProcess(converted.gguf, env={CACHE_ENV: str(gguf_cache)}).start(tmp_path)
    try:
        def complete(prompt: str) -> str:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        for prompt in PROMPTS:
            assert complete(prompt) == expected[prompt], prompt
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(complete, PROMPTS)) == [expected[p] for p in PROMPTS]
    finally:
        server.stop()
    assert sorted(p.name for p in gguf_cache.iterdir()) == listing  # no second conversion


def test_admission_sizes_the_gguf_from_its_header_as_from_its_conversion(
        converted: Converted, gguf_cache: Path, tmp_path: Path) -> None:
    from engine.model_spec import read_model_spec

    copy = tmp_path / "copy.gguf"
    copy.write_bytes(converted.gguf.read_bytes() + b"\0" * 32)  # another hash: not converted
    listing = sorted(p.name for p in gguf_cache.iterdir())
    header, conversion = read_model_spec(str(copy)), read_model_spec(str(converted.gguf))
    assert (header.weights_source, conversion.weights_source) == ("GGUF header", "safetensors headers")
    assert header.weight_bytes == conversion.weight_bytes
    assert header.geometry == conversion.geometry
    assert header.context_length == conversion.context_length == 4096
    assert sorted(p.name for p in gguf_cache.iterdir()) == listing


def test_a_conversion_by_an_older_converter_is_redone(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A Llama with biases converted before biases were handled: mlx-lm refused the directory.
    Its marker names the older converter, so the next start converts it again in its place."""
    import mlx_lm

    from engine.gguf.convert import CONVERTER_VERSION

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    family = FAMILIES["llama-bias"]
    path = write_gguf(source_model(family, tmp_path / "source"), tmp_path / "f.gguf", family.writer)
    target = ensure_converted(path, dtype="float32", progress=lambda _: None)
    marker = json.loads((target / "mlx_headroom_gguf.json").read_text())
    config = json.loads((target / "config.json").read_text())
    del config["attention_bias"]
    (target / "config.json").write_text(json.dumps(config))
    (target / "mlx_headroom_gguf.json").write_text(json.dumps(marker | {"converter_version": 1}))
    with pytest.raises(ValueError, match="parameters not in model"):
        mlx_lm.load(str(target))

    messages: list[str] = []
    assert ensure_converted(path, dtype="float32", progress=messages.append) == target
    assert any("converting" in m for m in messages)
    marker = json.loads((target / "mlx_headroom_gguf.json").read_text())
    assert marker["converter_version"] == CONVERTER_VERSION
    mlx_lm.load(str(target))
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] == [target.name]


CORPUS = (
    "The history of the city begins in the first century, when a small settlement grew up on an "
    "island in the middle of the river. Over the following centuries the town expanded onto both "
    "banks, and by the Middle Ages it had become one of the largest cities in Europe. Its "
    "university attracted students from many countries: 1,234 in 1250 and 56,789 by 1900.\n"
    "    def f(x):\n        return x * 2\n\tcaf\u00e9, na\u00efve, \u00fcber, r\u00e9sum\u00e9."
)
SPM_TEXTS = (
    "The city of the river", "hello  world", "  leading spaces", "trailing   ", "12345 and 3.14",
    "caf\u00e9 na\u00efve", "\u65e5\u672c\u8a9e \U0001f642", "line\n\nbreak\ttab", "HeLLo WORLD",
    "    def f(x):\n        return x * 2",
)


def test_a_mistral_7b_sentencepiece_vocabulary_tokenizes_as_sentencepiece(
        gguf_cache: Path, tmp_path: Path) -> None:
    """Mistral 7B's GGUFs carry a SentencePiece vocabulary (``tokenizer.ggml.model`` llama:
    pieces, scores, types): the conversion's merges, rebuilt from the scores, give the ids the
    SentencePiece library itself gives, after BOS; control tokens are matched whole."""
    import sentencepiece as spm
    from mlx_lm.utils import load_tokenizer

    from tests.engine.gguf_files import MISTRAL_WRITER, train_sentencepiece

    model = train_sentencepiece(tmp_path / "tokenizer.model", CORPUS.split("\n") * 4)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    family = FAMILIES["mistral"]
    source = source_model(family, tmp_path / "source", vocab_size=sp.vocab_size())
    path = write_gguf(source, tmp_path / "mistral-spm.gguf", MISTRAL_WRITER, sentencepiece=model)
    tokenizer = load_tokenizer(ensure_converted(path, dtype="float32", progress=lambda _: None))
    merged = 0
    for text in SPM_TEXTS:
        ids = sp.encode(text)
        assert tokenizer.encode(text) == [1, *ids], text
        assert tokenizer.decode(ids) == sp.decode(ids) == text, text
        merged += len(ids) < len(text.encode())
    assert merged >= 5  # the texts exercise the merges, not only byte fallback
    # llama.cpp prefixes a space to text that follows a special token, as SentencePiece does
    # to text at the start
    inst, end = sp.piece_to_id("[INST]"), sp.piece_to_id("[/INST]")
    assert tokenizer.encode("[INST] hi[/INST]") == [1, inst, *sp.encode(" hi"), end]
    assert tokenizer.eos_token_ids == {2}


def _q4_k_blocks(rng: np.random.Generator, n: int) -> tuple[bytes, np.ndarray]:
    """``n`` Q4_K blocks of random fields and the values they encode, from ggml's layout:
    a float16 ``d`` and ``dmin``, eight 6-bit scales and mins packed into 12 bytes, then 256
    4-bit quants; sub-block j of 32 values is ``d * scale_j * q - dmin * min_j``."""
    raw = b""
    values = []
    for _ in range(n):
        d, dmin = np.float16(rng.uniform(0.01, 0.1)), np.float16(rng.uniform(0.01, 0.1))
        sc, mn = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
        packed = bytearray(12)
        for j in range(4):
            packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
            packed[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6)
            packed[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4)
        q = rng.integers(0, 16, 256)  # value i of the block
        qs = bytearray(128)
        block = np.zeros(256, np.float32)
        for chunk in range(4):  # 64 values: low nibbles the first 32, high nibbles the next
            for i in range(32):
                lo, hi = q[64 * chunk + i], q[64 * chunk + 32 + i]
                qs[32 * chunk + i] = lo | (hi << 4)
        for j in range(8):
            block[32 * j:32 * j + 32] = (np.float32(d) * sc[j] * q[32 * j:32 * j + 32]
                                         - np.float32(dmin) * mn[j])
        raw += struct.pack("<ee", d, dmin) + bytes(packed) + bytes(qs)
        values.append(block)
    return raw, np.concatenate(values)


def test_quantized_tensors_dequantize_to_the_values_their_blocks_encode(tmp_path: Path) -> None:
    import gguf

    rng = np.random.default_rng(1)
    q8_source = rng.standard_normal((3, 64)).astype(np.float32)
    q8_raw = gguf.quants.quantize(q8_source, gguf.GGMLQuantizationType.Q8_0)
    blocks = q8_raw.reshape(-1, 34)  # a float16 scale, then 32 int8 values
    q8_values = (blocks[:, 2:].view(np.int8) * blocks[:, :2].copy().view("<f2").astype(np.float32))
    q4_raw, q4_values = _q4_k_blocks(rng, 4)

    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    w.add_tensor("q8", q8_raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q4k", np.frombuffer(q4_raw, np.uint8).reshape(2, -1),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.add_tensor("f16", q8_source.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    g = open_gguf(tmp_path / "q.gguf")
    assert [(t.type_name, t.shape) for t in g.tensors.values()] == [
        ("Q8_0", (3, 64)), ("Q4_K", (2, 512)), ("F16", (3, 64))]
    assert np.array_equal(g.tensor("q8"), q8_values.reshape(3, 64))
    assert np.abs(g.tensor("q8") - q8_source).max() < np.abs(q8_source).max() / 127
    assert np.allclose(g.tensor("q4k"), q4_values.reshape(2, 512), rtol=0, atol=1e-5)
    assert np.array_equal(g.tensor("f16"), q8_source.astype(np.float16).astype(np.float32))


def test_a_q8_0_mistral_converts_to_its_dequantized_weights(gguf_cache: Path, tmp_path: Path) -> None:
    """Every matrix of the Mistral stored Q8_0 (as ``--outtype q8_0`` writes it): the conversion
    holds gguf-py's dequantization of each, q/k rows permuted back after it."""
    import gguf
    from safetensors.numpy import load_file

    from tests.engine.gguf_files import permute

    family = FAMILIES["mistral"]
    source = source_model(family, tmp_path / "source")
    weights = load_file(str(source / "model.safetensors"))
    q8 = gguf.GGMLQuantizationType.Q8_0
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, family.config["num_hidden_layers"])
    quantized = {names.get_name(k, try_suffixes=(".weight",)): k for k, a in weights.items() if a.ndim == 2}
    path = write_gguf(source, tmp_path / "q8.gguf", family.writer, types=dict.fromkeys(quantized, q8))
    assert {t.type_name for t in open_gguf(path).tensors.values()} == {"Q8_0", "F32"}
    converted = load_file(str(ensure_converted(path, dtype="float32", progress=lambda _: None)
                              / "model.safetensors"))
    heads, kv_heads = family.config["num_attention_heads"], family.config["num_key_value_heads"]
    for name in quantized.values():
        a = weights[name]
        n = heads if "q_proj" in name else kv_heads if "k_proj" in name else 0
        stored = gguf.quants.dequantize(gguf.quants.quantize(permute(a, n) if n else a, q8), q8)
        expected = _permute_back(stored, n) if n else stored
        assert np.array_equal(converted[name], expected), name
        assert np.abs(converted[name] - a).max() <= np.abs(a).max() / 127 + 1e-7, name


def _permute_back(a: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's row order from llama.cpp's (what the converter does, written again)."""
    return a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def test_an_unknown_architecture_is_refused_by_name_and_nothing_is_cached(
        gguf_cache: Path, tmp_path: Path) -> None:
    from tests.conftest import ServerProcess

    family = FAMILIES["qwen2"]
    path = write_gguf(source_model(family, tmp_path / "source"), tmp_path / "rwkv.gguf", family.writer,
                      arch="rwkv6")
    listing = sorted(p.name for p in gguf_cache.iterdir())
    with pytest.raises(GGUFError, match=r"GGUF architecture 'rwkv6' cannot be converted "
                                        r"\(supported: gemma3, llama, mistral, qwen2, qwen3\)"):
        ensure_converted(path, dtype="float32", progress=lambda _: None)
    assert sorted(p.name for p in gguf_cache.iterdir()) == listing
    with pytest.raises(RuntimeError, match="server exited early") as refused:
        ServerProcess(path, env={CACHE_ENV: str(gguf_cache)}).start(tmp_path, timeout=120)
    assert "architecture 'rwkv6' cannot be converted" in str(refused.value)
    assert sorted(p.name for p in gguf_cache.iterdir()) == listing
