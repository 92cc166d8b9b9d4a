"""What a tensor-parallel group needs to know, as values: the server fills it from its
settings (`server.engine_config.group_config`); the ranks never read the server's settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupConfig:
    model: str  # a local directory or a hub id, as `serve --model` names it
    model_id: str  # the name the model is served under
    ranks: int  # `--tensor-parallel`; with a hostfile, the hostfile decides
    hostfile: str | None  # MLX hostfile: ranks on several machines
    backend: str  # "auto": nccl on CUDA, else ring
    port: int  # first port of the ranks' connections
    timeout_s: float  # a collective that has not returned by then fails the group
    memory_probe: str  # each rank's probe (`memory.detect_probe`)
    load_format: str  # "auto" or "dummy"
    dtype: str | None
    shutdown_grace_s: float  # rank 0's drain; the others leave this long after it
    log_level: str
    context_length: int | None = None  # `--context-length`: served instead of the model's own
