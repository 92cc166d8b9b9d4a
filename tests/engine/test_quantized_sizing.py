"""Load admission and the doctor size quantized weights from the files alone
(engine.model_spec over memory.weights), affine and MXFP4 alike: the bytes are the bytes
mlx-lm loads, the quantizable elements the matrices' own (each layer at its own group
size: gpt-oss's router at 8 bits, group 64; its experts in mxfp4, group 32), and the
quantization as the model states it, gpt-oss's original `*_blocks` checkpoints included."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

from engine import EngineRequest, SamplingParams
from engine import load_model as engine_load
from engine.model_spec import spec_from_directory
from engine.quantized import FlatQuantizedSwitchLinear, flatten_quantized
from memory.weights import Quantization
from tests.engine import tiny_archs
from tests.engine.test_quantized_moe import PROMPTS, _loaded, _mlx_lm_greedy, _prompt

MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
SCHEMES: dict[str, dict[str, Any]] = {
    # gpt-oss's own quant_predicate keeps its router at 8 bits, group 64
    "affine4": dict(group_size=32, bits=4),
    "mxfp4": dict(group_size=None, bits=None, mode="mxfp4"),
    # as mlx-community ships gpt-oss: experts in mxfp4, everything else affine 8-bit
    "mixed": dict(group_size=64, bits=8,
                  quant_predicate=lambda _, m: dict(MXFP4) if isinstance(m, SwitchLinear) else True),
}
STATED = {
    "affine4": "4-bit (group 32), some layers 8-bit (group 64)",
    "mxfp4": "mxfp4 (4-bit, group 32), some layers 8-bit (group 64)",
    "mixed": "8-bit (group 64), some layers mxfp4 (4-bit, group 32)",
    "openai": "mxfp4 (4-bit, group 32)",
}


def _matrix_elements(model: Any) -> int:
    """What mlx-lm loaded: each quantized matrix's logical elements (its packed words ×
    32 / its bits), plus the unquantized matrices nn.quantize would take (2-D, rows of a
    multiple of 64)."""
    n = 0
    for _, module in model.named_modules():
        if hasattr(module, "bits") and "scales" in module:
            w = module["weight"]
            n += math.prod(w.shape[:-1]) * w.shape[-1] * 32 // module.bits
    for name, p in tree_flatten(model.parameters()):
        if name.endswith(".weight") and p.ndim == 2 and p.dtype != mx.uint32 and p.shape[-1] % 64 == 0:
            n += p.size
    return n


def _save_mlx_community(path: Path, scheme: str) -> None:
    model = tiny_archs.build("gpt_oss")
    model, config = quantize_model(model, dict(tiny_archs.CONFIGS["gpt_oss"]), **SCHEMES[scheme])
    save_model(path, model)
    save_config(config, path / "config.json")


def _interleave(a: mx.array, b: mx.array, axis: int) -> mx.array:
    """Rows of a and b alternating along `axis` (gpt-oss's fused gate_up layout)."""
    both = mx.stack([a, b], axis=axis + 1)
    return both.reshape(*a.shape[:axis], 2 * a.shape[axis], *a.shape[axis + 1:])


def _save_openai(path: Path) -> None:
    """gpt-oss as OpenAI ships it: experts as mxfp4 `*_blocks` (uint8, two values a byte,
    16 bytes a group) and `*_scales`, gate and up fused, everything else unquantized, and
    a config that names the method only."""
    model = tiny_archs.build("gpt_oss")
    params = dict(tree_flatten(model.parameters()))
    weights: dict[str, mx.array] = {}
    for name, p in params.items():
        if ".experts." not in name:
            weights[name] = p
    for layer in range(tiny_archs.CONFIGS["gpt_oss"]["num_hidden_layers"]):
        stem = f"model.layers.{layer}.mlp.experts"
        packed = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w, s = mx.quantize(params[f"{stem}.{proj}.weight"], group_size=32, bits=4, mode="mxfp4")
            packed[proj] = (w.view(mx.uint8).reshape(*w.shape[:-1], -1, 16), s)
        weights[f"{stem}.gate_up_proj_blocks"] = _interleave(packed["gate_proj"][0], packed["up_proj"][0], 1)
        weights[f"{stem}.gate_up_proj_scales"] = _interleave(packed["gate_proj"][1], packed["up_proj"][1], 1)
        weights[f"{stem}.gate_up_proj_bias"] = _interleave(params[f"{stem}.gate_proj.bias"],
                                                           params[f"{stem}.up_proj.bias"], 1)
        weights[f"{stem}.down_proj_blocks"], weights[f"{stem}.down_proj_scales"] = packed["down_proj"]
        weights[f"{stem}.down_proj_bias"] = params[f"{stem}.down_proj.bias"]
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {**tiny_archs.CONFIGS["gpt_oss"],
              "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}}
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def openai_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("openai")
    _save_openai(path)
    return path


@pytest.fixture(scope="module", params=[*SCHEMES, "openai"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          openai_path: Path) -> tuple[str, Path]:
    if request.param == "openai":
        return "openai", openai_path
    path = tmp_path_factory.mktemp(request.param)
    _save_mlx_community(path, request.param)
    return request.param, path


def test_the_files_size_the_weights_mlx_lm_loads(saved: tuple[str, Path]):
    scheme, path = saved
    spec = spec_from_directory(path, scheme)
    model, _ = load_model(path)
    mx.eval(model.parameters())
    assert spec.weights.total_bytes == sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    assert spec.weights.quantizable_elements == _matrix_elements(model)
    assert str(spec.weights.quantization) == STATED[scheme]


def test_a_checkpoint_that_names_its_method_only_is_mxfp4(openai_path: Path):
    assert spec_from_directory(openai_path, "openai").weights.quantization == Quantization(4, 32, "mxfp4")


def test_openais_mxfp4_checkpoint_is_served_as_mlx_lm_serves_it(openai_path: Path, make_engine):
    reference, _ = load_model(openai_path)
    expected = {f"q{i}": _mlx_lm_greedy(reference, _prompt(i, n), m) for i, (n, m) in enumerate(PROMPTS)}
    served, _ = load_model(openai_path)
    assert flatten_quantized(served) > 0
    h = make_engine(loaded=_loaded(served, "openai"), prefix_cache_bytes=0)
    for i, (n, m) in enumerate(PROMPTS):
        h.submit(EngineRequest(f"q{i}", _prompt(i, n), m, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.out.finished) == len(PROMPTS))
    assert h.out.tokens == expected


def test_the_loader_flattens_a_quantized_moe_and_serves_it_as_mlx_lm_does(tiny_model_path: Path,
                                                                          make_engine,
                                                                          tmp_path: Path):
    """Through the engine's `load_model` (fusion, then flattening) on an mlx-community-style
    gpt-oss: its mxfp4 experts become flat, and no token changes."""
    _save_mlx_community(tmp_path, "mixed")
    for f in tiny_model_path.iterdir():  # a tokenizer for the loader; the test speaks in ids
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / f.name)
    reference, _ = load_model(tmp_path)
    expected = {f"q{i}": _mlx_lm_greedy(reference, _prompt(i, n), m) for i, (n, m) in enumerate(PROMPTS)}
    loaded = engine_load(str(tmp_path), model_id="gpt-oss-mxfp4")
    experts = [m for _, m in loaded.model.named_modules() if isinstance(m, FlatQuantizedSwitchLinear)]
    assert len(experts) == 3 * 2 and {m.mode for m in experts} == {"mxfp4"}
    h = make_engine(loaded=loaded, prefix_cache_bytes=0)
    for i, (n, m) in enumerate(PROMPTS):
        h.submit(EngineRequest(f"q{i}", _prompt(i, n), m, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.out.finished) == len(PROMPTS))
    assert h.out.tokens == expected
