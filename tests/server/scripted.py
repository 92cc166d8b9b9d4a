"""A real server, in this process, whose model writes what the test says.

The tiny models' weights are random; a test that needs a particular output (thinking, a
call, an answer that ends) wraps the loaded model in `ScriptedModel`: it forwards each
call to the real model, so the caches fill as usual, and returns logits that pick the
script's next token. A prompt starts the script over; after it, the model writes EOS.

`build_thinking_model` is the tiny model with `<think>` and `</think>` as added tokens (so
mlx-lm's tokenizer reports `has_thinking`) and a template that opens the block in its
generation prompt, as Qwen3's thinking models and the DeepSeek-R1 distills do;
`build_harmony_model` the tiny model with gpt-oss's Harmony markers and layout.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn

from engine import LoadedModel, load_model
from engine.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS, TinyModelShape, _config, _weights, tokenizer_json
from server.app import create_app
from server.settings import Settings
from tests.conftest import free_port

THINK = ("<think>", "</think>")
EOS = 256 + SPECIAL_TOKENS.index("<|im_end|>")
OPEN = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
TEMPLATE = CHAT_TEMPLATE.replace(OPEN, (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is not defined or enable_thinking %}{{- '<think>\n' }}{%- endif %}"
    "{%- endif %}"))
# gpt-oss's Harmony markers, and a template in its layout: tools in a developer message,
# calls and results as commentary messages, the generation prompt `<|start|>assistant`.
HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
           "<|constrain|>")
HARMONY_TEMPLATE = (
    "{%- if tools %}{{- '<|start|>developer<|message|># Tools\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\n' }}{%- endfor %}{{- '<|end|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{{- '<|start|>functions.tool to=assistant<|channel|>commentary<|message|>' + m['content'] + '<|end|>' }}"
    "{%- elif m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{%- for c in m['tool_calls'] %}"
    "{{- '<|start|>assistant to=functions.' + c['function']['name'] + '<|channel|>commentary json<|message|>'"
    " + (c['function']['arguments'] | tojson) + '<|call|>' }}"
    "{%- endfor %}"
    "{%- elif m['role'] == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + (m['content'] or '') + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + m['role'] + '<|message|>' + (m['content'] or '') + '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
HARMONY_EOS = tuple(256 + len(SPECIAL_TOKENS) + HARMONY.index(t) for t in ("<|return|>", "<|call|>"))


def build_marked_model(path: Path, markers: tuple[str, ...], template: str, *,
                       shape: TinyModelShape | None = None, eos: tuple[int, ...] = (EOS,)) -> Path:
    """The tiny model's weights and byte tokenizer, with `markers` as added tokens (ids
    from 256 + the tiny model's special tokens on) and `template` as its chat template."""
    from safetensors.numpy import save_file

    shape = shape or TinyModelShape()
    vocab = 256 + len(SPECIAL_TOKENS) + len(markers)
    path.mkdir(parents=True)
    save_file(_weights(shape, vocab), str(path / "model.safetensors"))
    tok = tokenizer_json()
    for i, marker in enumerate(markers):
        tok["added_tokens"].append({  # type: ignore[union-attr]
            "id": 256 + len(SPECIAL_TOKENS) + i, "content": marker, "single_word": False,
            "lstrip": False, "rstrip": False, "normalized": False, "special": False})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": shape.max_position_embeddings,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": template}))
    (path / "config.json").write_text(json.dumps({**_config(shape, vocab), "eos_token_id": list(eos)}))
    return path


def build_thinking_model(path: Path, shape: TinyModelShape | None = None) -> Path:
    """The tiny model with `<think>` and `</think>`, its template opening the block."""
    assert OPEN in CHAT_TEMPLATE
    return build_marked_model(path, THINK, TEMPLATE, shape=shape)


def build_harmony_model(path: Path) -> Path:
    """The tiny model with Harmony's markers and template; `<|return|>` and `<|call|>` end."""
    return build_marked_model(path, HARMONY, HARMONY_TEMPLATE, eos=HARMONY_EOS)


def token_ids(text: str, markers: tuple[str, ...] = THINK) -> list[int]:
    """The byte tokenizer's ids, the markers as their added tokens."""
    ids: list[int] = []
    for part in re.split("(" + "|".join(re.escape(m) for m in markers) + ")", text):
        if part in markers:
            ids.append(256 + len(SPECIAL_TOKENS) + markers.index(part))
        else:
            ids += list(part.encode())
    return ids


class ScriptedModel:
    """Forwards to the real model; the logits pick the script's tokens, then `eos`."""

    def __init__(self, model: Any, eos: int, encode: Callable[[str], list[int]]) -> None:
        self._model = model
        self._eos = eos
        self._encode = encode
        self.script: list[int] = []
        self._step = 0
        self._forced = -1

    def say(self, text: str) -> None:
        self.script = self._encode(text)

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        import mlx.core as mx

        logits = self._model(inputs, *args, **kwargs)
        # A decode step's input is the token forced last; anything else is (the end of) a
        # prompt, whose logits are the first the request samples.
        if inputs.shape[1] > 1 or self._step == 0 or inputs[0, -1].item() != self._forced:
            self._step = 0
        token = self.script[self._step] if self._step < len(self.script) else self._eos
        self._step += 1
        self._forced = token
        row = np.full(logits.shape[-1], -1e4, np.float32)
        row[token] = 1e4
        return logits * 0 + mx.array(row)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@contextmanager
def scripted_server(path: Path, model_id: str, eos: int, encode: Callable[[str], list[int]],
                    **settings: Any) -> Iterator[tuple[str, ScriptedModel]]:
    """(base URL, the scripted model) of a server on a free port, until the block ends."""
    holder: dict[str, ScriptedModel] = {}

    def load() -> LoadedModel:
        loaded = load_model(str(path), model_id=model_id)
        holder["model"] = ScriptedModel(loaded.model, eos, encode)
        return LoadedModel(**{**loaded.__dict__, "model": holder["model"]})

    port = free_port()
    app = create_app(Settings(model=str(path), served_model_name=model_id, **settings), load=load)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for readiness
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}", holder["model"]
    finally:
        server.should_exit = True
        thread.join(30)
