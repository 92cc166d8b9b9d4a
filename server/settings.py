"""Settings: environment variables with the prefix MLX_HEADROOM_, a .env file, CLI flags."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

GiB = 1 << 30
DEFAULT_RESERVE_TOKENS = 8192  # load admission's reserve without --context-length


@dataclass(frozen=True)
class BackendDefaults:
    prefill_step_size: int
    max_concurrency: int
    step_chunks: int = 1  # the step's token budget, in chunks, unless max_step_tokens is set
    max_decode_stall_ms: float = 100.0  # a step's time while rows decode and prompts prefill


def backend_defaults() -> BackendDefaults:
    """Engine defaults per MLX backend. Apple Silicon shares its memory with the whole
    machine, so a chunk's activations stay small (512 tokens, as before). On CUDA the H200
    ran 1k-token prompts at C=32 at 864 tok/s with 512 against 1,640-1,880 with 2048
    (docs/throughput.md), and a card's memory is the server's alone; the guard
    still checks every chunk, so the larger chunk and cap are admitted only where they fit.

    The step budget on CUDA is four chunks: in two runs each on the H200, 8,192
    tokens per step raised C=64 by 15 % (3,006-3,226 tok/s against 2,491-2,888 with one
    chunk) and left C=32 within the one-chunk runs' spread. On the CPU four chunks did
    not help (docs/throughput.md).

    The decode-stall target is 100 ms on GPUs, and 250 on the CPU: there a prefill token of
    even the tiny model costs 2-4 ms at a few thousand tokens of context (two cores), so at
    100 ms the smallest chunk alone overruns the target past about 2,000 tokens, and a long
    prompt's prefill took up to 2.5 times the steps it took at 250, where the prefill keeps
    most of each step beside a 20-55 ms decode step (docs/throughput.md has the figures)."""
    from engine.loader import backend_name

    backend = backend_name()
    if backend == "cuda":
        return BackendDefaults(prefill_step_size=2048, max_concurrency=64, step_chunks=4)
    if backend == "cpu":
        return BackendDefaults(prefill_step_size=512, max_concurrency=32, max_decode_stall_ms=250.0)
    return BackendDefaults(prefill_step_size=512, max_concurrency=32)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MLX_HEADROOM_", env_file=".env", extra="ignore")

    model: str = Field("default", description="mlx-lm model directory, hub id, .gguf file, 'tiny' "
                       "(the embedded random model), 'gemma-3-270m', or 'default' (Gemma 3 270M "
                       "when the [gemma] extra is installed, else tiny)")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="'dummy': random weights of a preset's or config.json's shape (`model`)"
    )
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="weight dtype of a dummy model (default: the config's, else bfloat16)"
    )
    served_model_name: str | None = None
    model_aliases: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="requested model name -> served name; a name may be a glob ('claude-*', '*'). "
        "From 'NAME=served' items (repeatable flag, comma-separated env) or a JSON object",
    )
    context_length: int | None = Field(
        None, ge=1, description="serve the model at this context instead of its own: lower, or "
        "higher where its RoPE scaling reaches (engine.context); `model` only. The load reserve "
        "is then this context unless reserve_context_tokens is set",
    )
    host: str = "127.0.0.1"
    port: int = 8000

    # engine
    max_concurrency: int = Field(
        default_factory=lambda: backend_defaults().max_concurrency, ge=1,
        description="sequences prefilling or decoding at once (default: 64 on CUDA, 32 elsewhere)",
    )
    max_queue: int = Field(256, ge=0, description="requests waiting beyond max_concurrency")
    prefill_step_size: int = Field(
        default_factory=lambda: backend_defaults().prefill_step_size, ge=16,
        description="prompt tokens per prefill chunk (default: 2048 on CUDA, 512 elsewhere)",
    )
    min_prefill_chunk: int = Field(32, ge=1)
    # throughput: tokens per engine step, decode rows included, and the most
    # prompts' chunks one prefill model call takes
    max_step_tokens: int | None = Field(
        None, ge=16, description="tokens per engine step, decode rows included "
        "(default: 4 x prefill_step_size on CUDA, 1 x elsewhere)",
    )
    prefill_batch: int = Field(8, ge=1)
    max_decode_stall_ms: float = Field(
        default_factory=lambda: backend_defaults().max_decode_stall_ms, ge=0,
        description="while streams decode, bound each step's prefill so that the step takes about "
        "this long, by the measured cost of a prefill token at its context (engine.step_budget; "
        "0: only max_step_tokens bounds it; default: 100 on GPUs, 250 on the CPU)",
    )
    compile_decode: bool | None = Field(
        None, description="replay decode steps from traced graphs, mx.compile (None: on CUDA only)"
    )
    prefill_key_bucket: int | None = Field(
        None, ge=0, description="pad a prefill call's keys to a power of two below this many, or a "
        "multiple of it, so that attention planned per shape (cuDNN) reuses its plans "
        "(engine.kv.buckets; None: 4096 on CUDA, 0 elsewhere; 0: never)",
    )
    prefill_plan_ms: float | None = Field(
        None, ge=0, description="what a new shape of prefill attention costs to plan (cuDNN), in ms: "
        "a call whose padded keys would cost more than that attends its exact keys, causal "
        "(engine.kv.buckets.KeyLengths; None: timed by the warm-up on CUDA, else 35 there)",
    )
    plan_ahead: bool = Field(
        True, description="while a lone prompt's prefill chunk runs, plan the next chunk's "
        "attention shape (cuDNN) so that it attends its exact keys, causal (engine.kv.plan_ahead; "
        "only where shapes are planned, CUDA); false: as an A/B",
    )
    paged_windows: bool = Field(
        True, description="hold sliding-window layers in the paged KV store at their window, in "
        "layer groups (memory.paged); false: serve such models through mlx-lm's own caches "
        "(engine.dense), as an A/B",
    )
    paged_gather: bool = Field(
        True, description="hold caches of other shapes than the config's heads (MLA: DeepSeek, "
        "Kimi, GLM-4.7-Flash) in the paged KV store, the model's own attention run on each decode "
        "row's gathered K/V; false: serve them through mlx-lm's own caches, as an A/B",
    )
    paged_states: bool = Field(
        True, description="hold hybrids' attention layers (Qwen3-Next, Qwen3.5, LFM2, Nemotron-H…) in "
        "the paged KV store, their recurrent state beside it (engine.kv.state); false: serve them "
        "through mlx-lm's own caches, as an A/B",
    )
    slice_decode: bool | None = Field(
        None, description="attend a lone decoding row on consecutive KV blocks as one slice of "
        "the pool, by MLX's fused SDPA, stepped eagerly (engine.kv.attention.run_decode; None: "
        "always where decode steps are eager, and where they are replayed, whichever of the two "
        "paths steps faster on the first lone rows, timed again when the kept one slows, "
        "engine.slice_choice)",
    )
    warm_up: bool | None = Field(
        None, description="run a few small requests before serving (None: on CUDA; engine.warmup)"
    )
    fuse_projections: bool = Field(
        True, description="one matmul for q/k/v and one for gate/up per layer, fused at load (engine.fusion)"
    )
    small_m_kernel: bool = Field(
        False, description="on CUDA, quantized products of up to 64 rows take the project's kernel "
        "where it times faster than MLX's at load and agrees with it (engine.qmm_choice)",
    )
    kv_bits: Literal[4, 8] | None = Field(
        None, description="quantize the KV store to 8 or 4 bits per value, with a scale and a bias "
        "per kv_group_size values of a head (engine.kv.quant; None: the model's dtype)",
    )
    kv_group_size: Literal[32, 64, 128] = Field(
        64, description="values per scale and bias of quantized KV; must divide the model's head_dim",
    )
    speculative: Literal["off", "prompt-lookup", "draft-model"] = Field(
        "off", description="speculative decoding: prompt-lookup drafts from each request's own prompt "
        "and output, draft-model from --draft-model; verified exactly while the batch is small "
        "(engine.speculative); off: none",
    )
    draft_model: str | None = Field(
        None, description="a smaller model with the same tokenizer whose greedy tokens are the drafts "
        "(a path, hub id or named model); implies --speculative draft-model",
    )
    num_speculative_tokens: int = Field(4, ge=1, le=64, description="drafts per request and step, at most")
    speculative_max_rows: int | None = Field(
        None, ge=1, description="speculate only while at most this many requests decode "
        "(default: 8 on CUDA, 2 on the CPU, 4 on Metal)",
    )
    gil_switch_interval_ms: float = Field(
        1.0, gt=0, le=100,
        description="Python's thread switch interval while the engine runs (sys.setswitchinterval), "
        "in ms: the engine thread and the HTTP thread share one GIL, and a thread waiting for it "
        "waits up to this long before the holder is made to let go",
    )
    malloc: Literal["auto", "system"] = Field(
        "auto", description="auto: on Linux, serve on jemalloc where it is installed (the process "
        "re-executes itself once with it in LD_PRELOAD; server.malloc); system: the C library's",
    )
    default_max_tokens: int = Field(512, ge=1)
    max_tokens_cap: int = Field(32768, ge=1)
    shutdown_grace_s: float = Field(30.0, ge=0)

    # memory guard
    memory_guard: bool = True
    memory_tier: Literal["safe", "balanced", "aggressive", "custom"] = "balanced"
    memory_ceiling_bytes: int | None = Field(None, gt=0)
    memory_probe: Literal["auto", "macos", "linux", "cuda", "allocator"] = "auto"
    memory_wait_timeout_s: float = Field(30.0, ge=0)
    memory_probe_grace_s: float = Field(
        5.0, ge=0, description="how long the last good memory reading stands in for a failing probe"
    )
    memory_reading_max_age_s: float = Field(
        2.0, gt=0, description="an older probe reading is read again, and never refuses a request"
    )
    prefix_cache_bytes: int | None = Field(
        None, ge=0, description="cap the prefix cache at this many bytes (0: off); unset, it fills "
        "what admission leaves free under the memory ceiling, and admission takes it back first",
    )
    prefix_cache_dir: str | None = Field(
        None, description="a directory for the prefix cache's disk tier: blocks evicted from memory "
        "are written there and read back on a later hit (engine.prefix.disk); unset: no disk tier",
    )
    prefix_cache_disk_bytes: int = Field(16 * GiB, ge=0, description="the disk tier's size, at most")

    # tensor parallel (engine.distributed): N ranks started by MLX's launcher, rank 0 serves
    tensor_parallel: int = Field(1, ge=1, description="ranks the model is split across (1: one device)")
    hostfile: str | None = Field(None, description="MLX hostfile: ranks on several machines")
    backend: Literal["auto", "ring", "jaccl", "nccl"] = Field(
        "auto", description="mx.distributed backend ('auto': nccl on CUDA, else ring)")
    tp_port: int = Field(32323, ge=1, le=65535, description="first port of the ranks' connections")
    tp_timeout_s: float = Field(
        60.0, gt=0, description="a collective that has not returned by then fails the group")

    # Responses API: the in-memory store behind `previous_response_id` (requests with store=true)
    responses_store_entries: int = Field(256, ge=0, description="stored responses kept, at most")
    responses_store_bytes: int = Field(64 << 20, ge=0, description="bytes of stored responses, at most")

    # load admission
    reserve_context_tokens: int | None = Field(
        None, ge=1, description="context to reserve KV for when admitting the model at load "
        "(capped at the served context; default: context_length when set, else 8192)"
    )
    force_load: bool = Field(False, description="load even when the reserve does not fit")

    # several models in one budget (docs/multi-model.md)
    extra_models: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="models loaded at start besides `model`"
    )
    allowed_models: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="models (or directories of models) loadable on demand"
    )
    pin: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="models never unloaded to make room or when idle"
    )
    idle_unload_s: float | None = Field(
        None, gt=0, description="unload a model after this many seconds without requests"
    )

    # service
    api_key: str | None = None
    admin_key: str | None = None
    allow_unauthenticated: bool = False
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="origins allowed by CORS (JSON list or comma-separated)"
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Host names served besides localhost and the bound address ('*': any; unsafe)",
    )
    max_body_bytes: int = Field(4 << 20, ge=1024)
    max_messages: int = Field(1024, ge=1)
    max_prompt_chars: int = Field(1 << 21, ge=1)
    request_timeout_s: float = Field(600.0, gt=0)
    log_prompts: bool = False
    log_level: str = "info"

    @field_validator("cors_origins", "allowed_hosts", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [o.strip() for o in text.split(",") if o.strip()]
        return value

    @field_validator("extra_models", "allowed_models", "pin", mode="before")
    @classmethod
    def _split_models(cls, value: object) -> object:
        """A JSON list, or comma-separated names (in one string or in each repeated flag)."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            value = [text]
        if isinstance(value, list):
            return [part.strip() for item in value for part in str(item).split(",") if part.strip()]
        return value

    @field_validator("model_aliases", mode="before")
    @classmethod
    def _parse_aliases(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                return json.loads(text)
            value = [item for item in text.split(",") if item.strip()]
        if isinstance(value, list):
            pairs: dict[str, str] = {}
            for item in value:
                name, sep, served = str(item).partition("=")
                if not sep or not name.strip() or not served.strip():
                    raise ValueError(f"a model alias is NAME=served, not {item!r}")
                pairs[name.strip()] = served.strip()
            return pairs
        return value

    @model_validator(mode="after")
    def _draft_model_method(self) -> Settings:
        if self.draft_model is not None and self.speculative == "off":
            self.speculative = "draft-model"
        if (self.speculative == "draft-model") != (self.draft_model is not None):
            raise ValueError("--speculative draft-model drafts from --draft-model, and --draft-model "
                             f"needs it (not {self.speculative!r})")
        return self

    @model_validator(mode="after")
    def _step_budget_from_the_backend(self) -> Settings:
        if self.max_step_tokens is None:
            self.max_step_tokens = backend_defaults().step_chunks * self.prefill_step_size
        return self

    @model_validator(mode="after")
    def _aliases_name_the_served_model(self) -> Settings:
        served = {self.public_model_name, self.model}
        wrong = {name: to for name, to in self.model_aliases.items() if to not in served}
        if wrong:
            raise ValueError(
                f"model aliases must point at the served model ({self.public_model_name!r}); "
                f"these do not: {wrong}"
            )
        return self

    @model_validator(mode="after")
    def _one_model_when_split(self) -> Settings:
        several = self.extra_models or self.allowed_models or self.idle_unload_s
        if several and (self.tensor_parallel > 1 or self.hostfile):
            raise ValueError("several models (--model repeated, --allowed-models, "
                             "--idle-unload-s) are not supported with tensor parallelism yet")
        return self

    @property
    def load_reserve_tokens(self) -> int:
        """The context load admission reserves KV for: what the operator set, else the whole
        of a context they chose (so the guard admits the memory for it), else 8192."""
        if self.reserve_context_tokens is not None:
            return self.reserve_context_tokens
        return self.context_length or DEFAULT_RESERVE_TOKENS

    @property
    def public_model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        from engine.named_models import public_name

        return public_name(self.model)
