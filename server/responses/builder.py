"""The Responses API's output, built as the text arrives: the response object, its output
items (`message`, `function_call`), and, for streaming, the documented events in order,
each numbered with its `sequence_number`."""

from __future__ import annotations

import time
import uuid
from typing import Any

from server.responses.schemas import ResponsesRequest
from server.tools import ArgumentsDelta, CallDone, CallStarted, ContentText, ParseEvent, ToolCallParser


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The response object and its output items, built as the text arrives; with
    `events` on, also the stream's events in order, numbered."""

    def __init__(self, body: ResponsesRequest, model: str, parser: ToolCallParser | None) -> None:
        self.body = body
        self.model = model
        self.parser = parser
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self._message: dict[str, Any] | None = None  # the open message item, if any
        self._calls: dict[str, dict[str, Any]] = {}  # function_call items still streaming
        self.status = "in_progress"
        self.incomplete: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None

    # -- the response object -------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        body = self.body
        choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": False,
            "error": None,
            "incomplete_details": self.incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": [dict(item) for item in self.output],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": body.text.format.public()},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [{**t.model_dump(), "strict": bool(t.strict)} for t in body.tools],
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
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": self.output_text()}
        if calls:
            message["tool_calls"] = calls
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
        if self.parser is None:
            parsed: list[ParseEvent] = [ContentText(text)] if text else []
        else:
            piece = self.parser.feed(text)
            if final:
                piece.extend(self.parser.finish())
            parsed = piece.events
        events: list[dict[str, Any]] = []
        for item in parsed:
            if isinstance(item, ContentText):
                events += self._text(item.text)
            elif isinstance(item, CallStarted):
                events += self._close_message()
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
        item = {"type": "function_call", "id": _new_id("fc"), "call_id": started.call_id,
                "name": started.name, "arguments": "", "status": "in_progress"}
        self.output.append(item)
        self._calls[started.call_id] = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item=dict(item))]

    def _arguments(self, delta: ArgumentsDelta) -> list[dict[str, Any]]:
        item = self._calls[delta.call_id]
        item["arguments"] += delta.delta
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self.output.index(item), delta=delta.delta)]

    def _call_done(self, done: CallDone) -> list[dict[str, Any]]:
        item = self._calls.pop(done.call.id)
        item["status"] = "completed"
        index = self.output.index(item)
        return [
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close_message()
        prompt = usage["prompt_tokens"]
        self.usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
        if finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            events.append(self._event("response.incomplete", response=self.snapshot()))
        else:
            self.status = "completed"
            events.append(self._event("response.completed", response=self.snapshot()))
        return events
