"""Trim OpenAI's OpenAPI document to the operations the conformance test fuzzes.

    git -C <openai-openapi checkout> show <commit>:openapi.json > /tmp/openai.json
    python tests/openai_spec/trim.py /tmp/openai.json <commit> > tests/openai_spec/openai-trimmed.json

Keeps POST /chat/completions, POST /completions, GET /models and GET /models/{model},
every component they reference (transitively), and nothing else.
"""

from __future__ import annotations

import json
import sys
from typing import Any

KEEP = {"/chat/completions": ["post"], "/completions": ["post"], "/models": ["get"],
        "/models/{model}": ["get"]}


def refs(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/"):
            out.add(ref)
        for value in node.values():
            refs(value, out)
    elif isinstance(node, list):
        for value in node:
            refs(value, out)


def trim(spec: dict[str, Any], commit: str) -> dict[str, Any]:
    paths = {p: {m: spec["paths"][p][m] for m in methods} for p, methods in KEEP.items()}
    for path in paths.values():
        for op in path.values():
            op.pop("x-oaiMeta", None)
    wanted: set[str] = set()
    refs(paths, wanted)
    done: set[str] = set()
    while wanted - done:
        ref = (wanted - done).pop()
        done.add(ref)
        _, _, kind, name = ref.split("/", 3)
        refs(spec["components"][kind][name], wanted)
    components: dict[str, dict[str, Any]] = {}
    for ref in sorted(done):
        _, _, kind, name = ref.split("/", 3)
        components.setdefault(kind, {})[name] = spec["components"][kind][name]
    return {
        "openapi": spec["openapi"],
        "info": {**spec["info"], "x-source": f"github.com/openai/openai-openapi openapi.json @ {commit}, "
                 "trimmed by tests/openai_spec/trim.py"},
        "servers": [{"url": "/v1"}],
        "paths": paths,
        "components": components,
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        source = json.load(f)
    json.dump(trim(source, sys.argv[2]), sys.stdout, indent=1)
