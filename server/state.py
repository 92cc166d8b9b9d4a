"""What the routes share: settings, the engine client, the memory guard, the tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from fastapi import Request

from engine import EngineClient
from memory import MemoryGuard
from server.errors import BadRequest, ServiceUnavailable
from server.model_fit import LoadAdmission
from server.settings import Settings


@dataclass
class ServerState:
    settings: Settings
    engine: EngineClient
    guard: MemoryGuard
    load_admission: LoadAdmission | None = None  # the start-up fit verdict (serve only)
    started_at: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    grammar_compiler: Any = None  # server.structured.grammar_compiler builds it on first use

    @property
    def ready(self) -> bool:
        return self.engine.loaded is not None and self.engine.alive

    @property
    def model_name(self) -> str:
        return self.settings.public_model_name

    @property
    def model_names(self) -> set[str]:
        return {self.model_name, self.settings.model}

    def serves(self, name: str) -> bool:
        """Whether a request naming this model is for us: its own names, or an alias."""
        return name in self.model_names or any(
            fnmatchcase(name, pattern) for pattern in self.settings.model_aliases
        )

    @property
    def tokenizer(self) -> Any:
        if not self.ready or self.engine.loaded is None:
            raise ServiceUnavailable("the model is not loaded", code="engine_unavailable")
        return self.engine.loaded.tokenizer

    @property
    def context_length(self) -> int:
        return self._loaded().context_length

    @property
    def vocab_size(self) -> int:
        return int(self._loaded().geometry.vocab_size)

    def _loaded(self) -> Any:
        """The loaded model, or 503: a dead engine must not be mistaken for bad input (a
        vocabulary of size 0 would make every token id a 400)."""
        if not self.ready or self.engine.loaded is None:
            raise ServiceUnavailable("the model is not loaded", code="engine_unavailable")
        return self.engine.loaded

    def check_prompt_size(self, messages: int, chars: int) -> None:
        if messages > self.settings.max_messages:
            raise BadRequest(
                f"{messages} messages, above this server's limit of {self.settings.max_messages}",
                code="too_many_messages", param="messages",
            )
        if chars > self.settings.max_prompt_chars:
            raise BadRequest(
                f"the prompt has {chars} characters, above this server's limit of "
                f"{self.settings.max_prompt_chars}",
                code="prompt_too_long", param="messages",
            )


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state
