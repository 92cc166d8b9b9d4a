"""The engine: one thread owns every MLX call; the asyncio side talks to it by queues."""

from engine.client import EngineClient, RequestStream
from engine.core import EngineConfig, EngineCore, EngineStats
from engine.errors import (
    ContextLengthError,
    EngineDeadError,
    EngineError,
    EngineStepError,
    InsufficientMemoryError,
    MemoryProbeUnavailableError,
    QueueFullError,
)
from engine.loader import DEFAULT_MODEL, LoadedModel, backend_name, load_model
from engine.request import EngineRequest, RequestOutput, SamplingParams, Speculation, TokenLogprob

__all__ = [
    "DEFAULT_MODEL",
    "ContextLengthError",
    "EngineClient",
    "EngineConfig",
    "EngineCore",
    "EngineDeadError",
    "EngineError",
    "EngineRequest",
    "EngineStats",
    "EngineStepError",
    "InsufficientMemoryError",
    "LoadedModel",
    "MemoryProbeUnavailableError",
    "QueueFullError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "Speculation",
    "TokenLogprob",
    "backend_name",
    "load_model",
]
