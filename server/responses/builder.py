"""The Responses API's output, built as the text arrives: the response object, its output
items (`reasoning`, `message`, `function_call`, `custom_tool_call`), and, for streaming, the
documented events in order, each numbered with its `sequence_number`.

The model's thinking (server/reasoning.py) is a `reasoning` item whose `content` is one
`reasoning_text` part, streamed as `response.reasoning_text.delta` / `.done`; its
`summary` is empty (this server writes no summaries) and it carries no
`encrypted_content`.

Generated calls name the request's template functions; `Toolset.ref` turns each back into
what the client sent: a namespaced function as its bare `name` plus `namespace`, a custom
tool as a `custom_tool_call` whose `input` is the text the model wrote. A call naming a tool
the request did not offer (a hosted tool such as `web_search`, left out of the prompt, or a
made-up name) is output text, `{"name": ..., "arguments": ...}`, and a log line: as a
`function_call` it would name a function the client does not have (Codex answers
"unsupported call", the Agents SDK raises), while as text the turn ends with the attempt in
sight, as a call block that chat completions cannot parse stays text there."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from server.errors import APIError
from server.reasoning import OutputParser, ReasoningText, TextParser
from server.responses.items import with_reasoning
from server.responses.schemas import ResponsesRequest
from server.responses.toolset import Toolset, custom_input
from server.tools import ArgumentsDelta, CallDone, CallStarted, ContentText, ToolCall

log = logging.getLogger("mlx_headroom.server.responses")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The response object and its output items, built as the text arrives; with
    `events` on, also the stream's events in order, numbered."""

    def __init__(self, body: ResponsesRequest, model: str, parser: TextParser | None,
                 toolset: Toolset | None = None, *,
                 reasoning_tokens: Callable[[], int] = lambda: 0) -> None:
        self.body = body
        self.model = model
        self.parser = parser or OutputParser(None)
        self.toolset = toolset or Toolset()
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self._message: dict[str, Any] | None = None  # the open message item, if any
        self._reasoning: dict[str, Any] | None = None  # the open reasoning item, if any
        self._reasoning_tokens = reasoning_tokens
        self._calls: dict[str, dict[str, Any]] = {}  # call items still streaming
        self._custom_arguments: dict[str, str] = {}  # a custom call's JSON arguments so far
        self._unoffered: set[str] = set()  # ids of calls naming a tool not offered: text when done
        self.status = "in_progress"
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None

    # -- the response object -------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": False,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": [dict(item) for item in self.output],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None, **(body.reasoning or {})},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": body.text.format.public()},
            "tool_choice": body.tool_choice,
            "tools": [_echo_tool(t) for t in body.tools],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": self.usage,
            "metadata": body.metadata or {},
            "user": body.user,
        }

    def output_text(self) -> str:
        return "".join(
            part["text"] for item in self.output if item["type"] == "message" for part in item["content"]
        )

    def conversation(self) -> list[dict[str, Any]]:
        """This output as chat messages, for a later previous_response_id."""
        calls = []
        for item in self.output:
            if item["type"] == "function_call":
                arguments = item["arguments"]
            elif item["type"] == "custom_tool_call":
                arguments = json.dumps({"input": item["input"]}, ensure_ascii=False)
            else:
                continue
            name = self.toolset.template_name(item["name"], item.get("namespace"))
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": name, "arguments": arguments}})
        message: dict[str, Any] = {"role": "assistant", "content": self.output_text()}
        if calls:
            message["tool_calls"] = calls
        reasoning = "\n\n".join(part["text"] for item in self.output if item["type"] == "reasoning"
                                for part in item["content"])
        if reasoning:  # as a reasoning item sent back would be: the template decides
            with_reasoning(message, reasoning)
        return [message]

    # -- events ----------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.snapshot()),
                self._event("response.in_progress", response=self.snapshot())]

    def feed(self, text: str, *, final: bool = False) -> list[dict[str, Any]]:
        piece = self.parser.feed(text)
        if final:
            piece.extend(self.parser.finish())
        events: list[dict[str, Any]] = []
        for item in piece.events:
            if isinstance(item, ReasoningText):
                events += self._close_message()
                events += self._reasoning_text(item.text)
                continue
            events += self._close_reasoning()
            if isinstance(item, ContentText):
                events += self._text(item.text)
            elif isinstance(item, CallStarted):
                events += self._call_started(item)
            elif isinstance(item, ArgumentsDelta):
                events += self._arguments(item)
            else:
                events += self._call_done(item)
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._message = {"type": "message", "id": _new_id("msg"), "status": "in_progress",
                             "role": "assistant", "content": []}
            self.output.append(self._message)
            index = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=index,
                                      item={**self._message, "content": []}))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._message["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=self._message["id"],
                                      output_index=index, content_index=0, part=dict(part)))
        self._message["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                  output_index=self.output.index(self._message), content_index=0,
                                  delta=text, logprobs=[]))
        return events

    def _reasoning_text(self, text: str) -> list[dict[str, Any]]:
        events = []
        item = self._reasoning
        if item is None:
            item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}
            self._reasoning = item
            self.output.append(item)
            index = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=index,
                                      item={**item, "content": []}))
            part = {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0, part=dict(part)))
        item["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=self.output.index(item), content_index=0, delta=text))
        return events

    def _close_reasoning(self) -> list[dict[str, Any]]:
        item = self._reasoning
        if item is None:
            return []
        self._reasoning = None
        index = self.output.index(item)
        part = item["content"][0]
        item["status"] = "completed"
        return [
            self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                        content_index=0, text=part["text"]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=dict(part)),
            self._event("response.output_item.done", output_index=index,
                        item={**item, "content": [dict(part)]}),
        ]

    def _close_message(self) -> list[dict[str, Any]]:
        message = self._message
        if message is None:
            return []
        self._message = None
        index = self.output.index(message)
        part = message["content"][0]
        message["status"] = "completed"
        return [
            self._event("response.output_text.done", item_id=message["id"], output_index=index,
                        content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", item_id=message["id"], output_index=index,
                        content_index=0, part=dict(part)),
            self._event("response.output_item.done", output_index=index,
                        item={**message, "content": [dict(part)]}),
        ]

    def _call_started(self, started: CallStarted) -> list[dict[str, Any]]:
        ref = self.toolset.ref(started.name)
        if ref is None:
            self._unoffered.add(started.call_id)
            return []
        events = self._close_message()
        item: dict[str, Any]
        if ref.kind == "custom":
            item = {"type": "custom_tool_call", "id": _new_id("ctc"), "call_id": started.call_id,
                    "name": ref.name, "input": "", "status": "in_progress"}
            self._custom_arguments[started.call_id] = ""
        else:
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": started.call_id,
                    "name": ref.name, "arguments": "", "status": "in_progress"}
        if ref.namespace is not None:
            item["namespace"] = ref.namespace
        self.output.append(item)
        self._calls[started.call_id] = item
        events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                  item=dict(item)))
        return events

    def _unoffered_call(self, call: ToolCall) -> list[dict[str, Any]]:
        """A call of a tool the request did not offer, as text (see the module's docstring)."""
        self._unoffered.discard(call.id)
        log.info("/v1/responses: the model called '%s', which the request did not offer; "
                 "returned as text", call.name)
        try:
            arguments: Any = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = call.arguments
        text = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
        if self._message is not None and self._message["content"][0]["text"]:
            text = "\n" + text  # the parser took the newline before the call as markup
        return self._text(text)

    def _arguments(self, delta: ArgumentsDelta) -> list[dict[str, Any]]:
        if delta.call_id in self._unoffered:  # written out whole when the call is done
            return []
        if delta.call_id in self._custom_arguments:  # the input is known once the JSON is whole
            self._custom_arguments[delta.call_id] += delta.delta
            return []
        item = self._calls[delta.call_id]
        item["arguments"] += delta.delta
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self.output.index(item), delta=delta.delta)]

    def _call_done(self, done: CallDone) -> list[dict[str, Any]]:
        if done.call.id in self._unoffered:
            return self._unoffered_call(done.call)
        item = self._calls.pop(done.call.id)
        item["status"] = "completed"
        index = self.output.index(item)
        if item["type"] == "custom_tool_call":
            self._custom_arguments.pop(done.call.id, None)
            item["input"] = custom_input(done.call.arguments)
            return [
                self._event("response.custom_tool_call_input.delta", item_id=item["id"],
                            output_index=index, delta=item["input"]),
                self._event("response.custom_tool_call_input.done", item_id=item["id"],
                            output_index=index, input=item["input"]),
                self._event("response.output_item.done", output_index=index, item=dict(item)),
            ]
        return [
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def heartbeat(self) -> dict[str, Any]:
        """`response.in_progress` again: a long prefill is not silence to the client."""
        return self._event("response.in_progress", response=self.snapshot())

    def fail(self, exc: APIError) -> list[dict[str, Any]]:
        """`response.failed`, the error's code as agents read it (Codex retries
        `rate_limit_exceeded` and compacts on `context_length_exceeded`)."""
        error = exc.body()["error"]
        message = error["message"]
        if exc.status in (429, 507):
            code = "rate_limit_exceeded"
            retry = (exc.headers or {}).get("Retry-After")
            if retry is not None:
                message += f" Please try again in {retry}s."
        elif error.get("code") == "context_length_exceeded":
            code = "context_length_exceeded"
        else:
            code = "server_error"
        self.status, self.error = "failed", {"code": code, "message": message}
        return [self._event("response.failed", response=self.snapshot())]

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close_reasoning() + self._close_message()
        prompt = usage["prompt_tokens"]
        self.usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
            "total_tokens": usage["total_tokens"],
        }
        for key in ("max_tokens_clamped", "speculative"):
            if key in usage:
                self.usage[key] = usage[key]
        if finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            events.append(self._event("response.incomplete", response=self.snapshot()))
        else:
            self.status = "completed"
            events.append(self._event("response.completed", response=self.snapshot()))
        return events


def _echo_tool(tool: Any) -> Any:
    if isinstance(tool, dict) and tool.get("type") == "function":
        return {**tool, "strict": bool(tool.get("strict"))}
    return tool
