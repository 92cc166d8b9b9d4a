"""The tools of one Responses request, as the chat template sees them and as the client
named them.

Agents send more than `function` tools (Codex: `namespace`, `custom`, `web_search`,
`image_generation`, `tool_search`, ...). Each tool the model can call becomes one
template function with a flat, collision-safe name, and the per-request map turns a
generated call back into what the client sent:

- `function`: offered as is; its calls come back as `function_call`;
- `namespace`: each member (function or custom) is offered as `<namespace>__<name>`; its
  calls come back with the bare `name` and `namespace`;
- `custom` (freeform input, maybe a Lark or regex grammar): offered as a function with one
  string argument `input`, the grammar in its description (a regex is also the argument's
  `pattern`, which a forced call enforces); calls come back as
  `custom_tool_call {call_id, name, input}`;
- hosted tools this server cannot run (`web_search`, `image_generation`, `tool_search`,
  `local_shell`, `file_search`, `code_interpreter`, `mcp`, ...) and unknown types: left out
  of the prompt, named in a debug log. A call of one (models trained with a search tool
  call it anyway), or of any name not offered, has no client tool behind it: the builder
  writes it out as text.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from server.tools import FunctionTool, ToolChoice

log = logging.getLogger("mlx_headroom.server.responses")

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
MAX_NAME = 64


@dataclass(frozen=True)
class ToolRef:
    """A callable tool as the client named it."""

    kind: Literal["function", "custom"]
    name: str
    namespace: str | None = None


def flat_name(name: str, namespace: str | None = None) -> str:
    """The template name of a tool: `namespace__name`, characters outside [A-Za-z0-9_-]
    replaced by `_`. Deterministic, so history and tools flatten alike."""
    base = _UNSAFE.sub("_", name) or "tool"
    if namespace:
        base = f"{_UNSAFE.sub('_', namespace).rstrip('_')}__{base}"
    return base


def _custom_function(name: str, tool: dict[str, Any]) -> FunctionTool:
    description = str(tool.get("description") or "")
    fmt = tool.get("format") if isinstance(tool.get("format"), dict) else {}
    field: dict[str, Any] = {"type": "string", "description": "The tool's input."}
    if fmt.get("type") == "grammar" and fmt.get("definition"):
        syntax = fmt.get("syntax") or "lark"
        description += (f"\n\nThe `input` argument is free text (not JSON) that follows this "
                        f"{syntax} grammar:\n{fmt['definition']}")
        if syntax == "regex":  # a forced call enforces it, as a JSON Schema pattern
            field["pattern"] = f"^(?:{fmt['definition']})$"
    parameters = {"type": "object", "properties": {"input": field},
                  "required": ["input"], "additionalProperties": False}
    return FunctionTool(name, description.strip() or None, parameters)


@dataclass
class Toolset:
    """Template functions in order, and the map from their names back to the client's."""

    functions: list[FunctionTool] = field(default_factory=list)
    refs: dict[str, ToolRef] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)  # tool types left out, for the log

    @classmethod
    def build(cls, tools: Iterable[Any]) -> Toolset:
        toolset = cls()
        for tool in tools:
            toolset.add(tool)
        return toolset

    def add(self, tool: Any, namespace: str | None = None) -> None:
        if not isinstance(tool, dict):
            self.ignored.append(type(tool).__name__)
            return
        kind = tool.get("type")
        name = tool.get("name")
        if kind == "namespace" and namespace is None and isinstance(name, str):
            for member in tool.get("tools") or []:
                self.add(member, namespace=name)
            return
        if kind == "function" and not isinstance(name, str) and isinstance(tool.get("function"), dict):
            tool = tool["function"]  # the chat completions shape, sent here by mistake
            name = tool.get("name")
        if kind not in ("function", "custom") or not isinstance(name, str) or not name:
            self.ignored.append(str(kind))
            return
        flat = self._unique(flat_name(name, namespace))
        self.refs[flat] = ToolRef(kind, name, namespace)
        if kind == "custom":
            self.functions.append(_custom_function(flat, tool))
        else:
            parameters = tool.get("parameters")
            self.functions.append(FunctionTool(
                flat, tool.get("description") or None,
                parameters if isinstance(parameters, dict) else None, bool(tool.get("strict"))))

    def _unique(self, flat: str) -> str:
        flat = flat[:MAX_NAME]
        if flat not in self.refs:
            return flat
        n = 2
        while f"{flat[:MAX_NAME - 4]}_{n}" in self.refs:
            n += 1
        return f"{flat[:MAX_NAME - 4]}_{n}"

    def template_name(self, name: str, namespace: str | None = None) -> str:
        """The flat name a call in history goes by: the tool's own when it is offered."""
        for flat, ref in self.refs.items():
            if ref.name == name and ref.namespace == namespace:
                return flat
        return flat_name(name, namespace)

    def ref(self, flat: str) -> ToolRef | None:
        """What a generated call names, as the client knows it; None for a tool the request
        did not offer (a hosted tool left out of the prompt, or a made-up name)."""
        return self.refs.get(flat)

    def choice(self, raw: Any) -> ToolChoice:
        """tool_choice as sent -> the plan's choice. Choices naming a hosted tool, or
        shapes this server does not know, fall back to `auto` (logged)."""
        if raw is None or raw == "auto":
            return ToolChoice("auto" if self.functions else "none")
        if raw in ("none", "required"):
            return ToolChoice(raw)
        if isinstance(raw, dict):
            kind = raw.get("type")
            if kind in ("function", "custom") and isinstance(raw.get("name"), str):
                namespace = raw.get("namespace")
                return ToolChoice("named", self._named(raw["name"], namespace))
            if kind == "allowed_tools" and raw.get("mode") in ("auto", "required"):
                return ToolChoice(raw["mode"] if self.functions else "none")
            self.ignored.append(f"tool_choice:{kind}")
        else:
            self.ignored.append("tool_choice")
        return ToolChoice("auto" if self.functions else "none")

    def _named(self, name: str, namespace: Any) -> str:
        if isinstance(namespace, str) and namespace:
            return self.template_name(name, namespace)
        if name in self.refs:
            return name
        bare = [flat for flat, ref in self.refs.items() if ref.name == name]
        return bare[0] if bare else name  # an unknown name is refused by check_tools


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments of its template function."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        try:  # cut off by max_output_tokens inside the string: what there is of it
            parsed = json.loads(arguments + '"}')
        except json.JSONDecodeError:
            return arguments
    if isinstance(parsed, dict) and isinstance(parsed.get("input"), str):
        return parsed["input"]
    return arguments
