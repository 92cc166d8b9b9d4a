"""One rank of a tensor-parallel group: rank 0 under the HTTP server, the others headless.

Rank 0 is the ordinary server with four things swapped in (`app_hooks`): a loader that
joins the group and loads its shard, a core that steps in lockstep, a guard probe that
reads the whole group (`GroupProbe`), and a death handler that fails the group. The other
ranks run `follow`: the same core, stepping whenever rank 0's plan arrives, until rank 0
says stop (exit 0) or the group breaks (exit non-zero).

Failure, either way: a collective that raises (ring: "connection to a peer was lost") or a
watchdog deadline ends the rank with `EXIT_GROUP_FAILED`; on rank 0, in-flight requests
first get a 503 `engine_unavailable` that names the cause, and /health answers 503 until
the process is gone (`Watchdog.grace_s`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from engine.core import EngineConfig, EngineCore
from engine.distributed.channel import Channel
from engine.distributed.config import GroupConfig
from engine.distributed.loading import load_sharded
from engine.distributed.lockstep import Lockstep, LockstepAdmission
from engine.distributed.probe import GroupProbe, rank_probe
from engine.distributed.watchdog import EXIT_GROUP_FAILED, GroupFailedError, Watchdog
from engine.errors import EngineDeadError
from engine.loader import LoadedModel
from engine.logs import configure_logging
from memory import MemoryGuard, Probe, detect_probe

log = logging.getLogger("mlx_headroom.distributed")


def attach(core: EngineCore, lockstep: Lockstep) -> EngineCore:
    core.lockstep = lockstep
    core.clock = lockstep.clock
    assert isinstance(core.admission, LockstepAdmission)
    core.admission.lockstep = lockstep
    core.batch.agree = lockstep.agree_tokens
    # A sharded model's forward holds collectives, whose tracing was never tried: its ranks
    # always step eagerly, whatever `compile_decode` says.
    core.batch.compiled = None
    return core


class Rank:
    def __init__(
        self,
        group: GroupConfig,
        backend: str,
        *,
        config: EngineConfig,
        make_guard: Callable[[Probe], MemoryGuard],
    ) -> None:
        self.group_config = group
        self.backend = backend
        self.config = config
        self.make_guard = make_guard
        self.rank = int(os.environ["MLX_RANK"])
        self.leader = self.rank == 0
        self.watchdog = Watchdog(group.timeout_s, on_fault=self._on_fault)
        self.local_probe = rank_probe(detect_probe(group.memory_probe), self.rank)
        # rank 0's guard reads the whole group through this (the engine thread feeds it)
        self.group_probe = GroupProbe(self.local_probe, 0) if self.leader else None
        self.lockstep: Lockstep | None = None
        self.engine: Any = None  # rank 0: the EngineClient, to fail its requests

    # ---- every rank ------------------------------------------------------------------
    def _join(self) -> LoadedModel:
        """Join the group, load this rank's shard, exchange the first readings."""
        group = mx.distributed.init(backend=self.backend, strict=True)
        if group.size() < 2:
            raise RuntimeError(f"rank {self.rank}: the {self.backend} group has one member")
        channel = Channel(group, beat=self.watchdog.beat)
        if self.group_probe is not None:
            self.group_probe.size = group.size()
        self.lockstep = Lockstep(channel, self.local_probe, self.group_probe)
        g = self.group_config
        loaded = load_sharded(g.model, group, model_id=g.model_id,
                              load_format=g.load_format, dtype=g.dtype,
                              context_length=g.context_length)
        self.lockstep.initial_sync()
        self.watchdog.start()
        return loaded

    def _make_core(self, loaded: LoadedModel, guard: MemoryGuard, config: EngineConfig,
                   publish: Callable[[list[Any]], None]) -> EngineCore:
        assert self.lockstep is not None
        # No prefix-cache disk tier: the ranks would share one folder, and a file that failed
        # its checks on one rank only would set their caches apart.
        config = dataclasses.replace(config, prefix_cache_dir=None)
        core = EngineCore(loaded, guard, config, publish, admission_cls=LockstepAdmission)
        run = core.run_forever

        def run_forever() -> None:
            # A collective that raised ("[ring] connection to a peer was lost") ends the
            # group, not only this engine: say so to the requests it fails.
            try:
                run()
            except Exception as exc:
                raise EngineDeadError(f"the tensor-parallel group failed: {exc}") from exc

        core.run_forever = run_forever  # type: ignore[method-assign]
        return attach(core, self.lockstep)

    def _on_fault(self, exc: GroupFailedError) -> None:
        if self.engine is not None:
            self.engine.fail(EngineDeadError(f"the tensor-parallel group failed: {exc}"))

    # ---- rank 0 ----------------------------------------------------------------------
    def app_hooks(self) -> dict[str, Any]:
        """What `create_app` takes from this rank (rank 0)."""
        return {
            "probe": self.group_probe,
            "load": self._join,
            "make_core": self._make_core,
            "group": self.group_probe,
            "on_engine_death": self._on_engine_death,
        }

    def _on_engine_death(self, exc: BaseException) -> None:
        self.watchdog.fail(GroupFailedError(f"rank 0's engine stopped: {exc}"))

    def attach(self, app: Any, server: Any) -> None:
        """Rank 0, before serving: policy-aware tightness, and the client to fail."""
        state = app.state.server
        guard = state.guard
        self.engine = state.engine
        assert self.group_probe is not None
        self.group_probe.headroom = lambda snap: guard.ceiling(snap).hard_bytes - snap.footprint_bytes

    # ---- the other ranks -------------------------------------------------------------
    def follow(self) -> int:
        """Step with rank 0 until it says stop (0) or the group breaks (non-zero)."""
        configure_logging(self.group_config.log_level)
        stopping = threading.Event()

        def on_term(signum: int, frame: Any) -> None:
            # Rank 0 drains and then tells us to stop; if it never does, leave anyway.
            if not stopping.is_set():
                stopping.set()
                threading.Timer(self.group_config.shutdown_grace_s + 10, os._exit, args=(0,)).start()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        try:
            loaded = self._join()
            core = self._make_core(loaded, self.make_guard(self.local_probe), self.config, lambda outs: None)
            idle = True
            while not core._stop:
                # rank 0's engine loop waits as long on its inbox: the two meet at the next step
                wait = core.inbox_wait_s(idle)
                if wait:
                    time.sleep(wait)
                idle = not core.step()
        except BaseException as exc:
            print(f"mlx-headroom: rank {self.rank}: the tensor-parallel group failed: {exc}",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_GROUP_FAILED)
        log.info("rank %d: rank 0 said stop", self.rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown racing MLX's thread-local destructors
