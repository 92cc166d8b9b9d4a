"""Compare constrained-decoding libraries on what the engine pays: compile time and the
per-token cost of computing a mask and consuming a token.

    python -m bench.constraint_libs [--tokens 200] [--batch 8 --vocab 259,128256]

Runs on the embedded tiny model's byte tokenizer (259 tokens). xgrammar is reported as
unavailable when it cannot be imported (it imports torch at import time).

Then the engine's own cost: one `BatchSampler` step (sample, read back, accept) for a batch
of B rows, plain and with every row under a JSON schema, at each vocabulary width (the
mask is as wide as the logits: 128256 is Llama 3's), so the per-token overhead of
constrained decoding is measured apart from the model.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import numpy as np

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _allowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab]
    return np.nonzero(bits)[0]


def bench_llguidance(tokenizer: Any, vocab: int, eos: int, tokens: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - t0
    mask = lnp.allocate_token_bitmask(1, vocab)
    rng = random.Random(0)
    n, t0 = 0, time.perf_counter()
    while n < tokens:
        if matcher.is_stopped():
            matcher.reset()
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        matcher.consume_token(int(rng.choice(_allowed(mask, vocab))))
        n += 1
    return {"compile_ms": compile_s * 1e3, "us_per_token": (time.perf_counter() - t0) / n * 1e6}


def bench_outlines(tokenizer: Any, vocab: int, eos: int, tokens: int) -> dict[str, float]:
    import outlines_core as oc

    words: dict[str, list[int]] = {}
    for token_id in range(vocab):
        if token_id == eos:
            continue
        text = tokenizer.decode([token_id])
        words.setdefault(text, []).append(token_id)
    t0 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = oc.Index(regex, oc.Vocabulary(eos, words))
    compile_s = time.perf_counter() - t0
    guide = oc.Guide(index)
    mask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    rng = random.Random(0)
    n, t0 = 0, time.perf_counter()
    while n < tokens:
        if guide.is_finished():
            guide.reset()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        guide.advance(int(rng.choice(_allowed(mask, vocab))), False)
        n += 1
    return {"compile_ms": compile_s * 1e3, "us_per_token": (time.perf_counter() - t0) / n * 1e6}


def bench_sampler(wrapper: Any, batch: int, vocab: int, steps: int) -> dict[str, float]:
    import mlx.core as mx

    from engine.grammar import Grammar, GrammarCompiler
    from engine.logits_processor import LogitsProcessor
    from engine.request import SamplingParams
    from engine.sampling import BatchSampler

    compiler = GrammarCompiler(wrapper, vocab, sorted(wrapper.eos_token_ids))
    compiled = compiler.compile(Grammar.json_schema(
        {"type": "object", "properties": {"v": {"type": "array", "minItems": 100000,
                                                "items": {"type": "integer"}}}, "required": ["v"]}))
    logits = mx.random.normal((batch, vocab))
    mx.eval(logits)
    out: dict[str, float] = {}
    for name in ("plain", "schema"):
        params = [SamplingParams(temperature=1.0, processor=LogitsProcessor(
            constraint=compiled.new_constraint()) if name == "schema" else None) for _ in range(batch)]
        sampler = BatchSampler(params)
        for warm in (True, False):
            t0 = time.perf_counter()
            for i in range(steps if not warm else 5):
                tokens = sampler.sample(logits, [i] * batch).tokens.tolist()
                if sampler.needs_feedback:
                    sampler.accept(tokens)
            if not warm:
                out[f"{name}_ms_per_step"] = round((time.perf_counter() - t0) / steps * 1e3, 3)
    extra_ms = out["schema_ms_per_step"] - out["plain_ms_per_step"]
    out["overhead_us_per_token"] = round(extra_ms * 1e3 / batch, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", default="259,128256")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    from mlx_lm.tokenizer_utils import load

    from engine.tiny_model import ensure_default_model

    wrapper = load(ensure_default_model())
    hf = wrapper._tokenizer
    vocab, eos = len(hf), wrapper.eos_token_id
    results: dict[str, Any] = {}
    for name, fn in (("llguidance", bench_llguidance), ("outlines-core", bench_outlines)):
        try:
            results[name] = fn(hf, vocab, eos, args.tokens)
        except Exception as exc:  # report, keep comparing
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        import xgrammar  # noqa: F401

        results["xgrammar"] = {"error": "installed; not measured here"}
    except Exception as exc:
        results["xgrammar"] = {"error": f"import failed: {type(exc).__name__}: {exc}"}
    sampler = {f"B{args.batch}-V{v}": bench_sampler(wrapper, args.batch, int(v), args.steps)
               for v in args.vocab.split(",")}
    print(json.dumps({"vocab": vocab, "tokens": args.tokens, "results": results, "sampler_step": sampler},
                     indent=2))


if __name__ == "__main__":
    main()
