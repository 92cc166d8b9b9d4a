"""Every rank runs the same engine step, in lockstep, from what rank 0 decides.

Rank 0 owns the HTTP side and the inbox; every rank owns an `EngineCore` over its shard of
the model and its shard of the KV store. The cores stay identical because everything that
steers one comes from rank 0:

- **The step plan.** Before each step every rank `all_gather`s one row: its memory reading
  and a digest of its engine state after the previous step. Rank 0's row also carries the
  plan: the requests that joined its inbox and the aborts, in arrival order, and its clock
  (wait timeouts are measured on it). The others apply the plan, then all step. Idle,
  every rank waits `IDLE_S` between steps (rank 0 on its inbox, the others asleep), so they
  meet at the next exchange together: a rank that arrives first waits inside MLX's ring
  collective, which polls its sockets and spins a core (a follower that stepped
  back to back burned one whole core on an idle server). A request that arrives meanwhile
  waits at most `IDLE_S` for the others. Rank 0 so sends a row many times a second even
  when idle, and silence means trouble (see `watchdog`).
- **Admission.** Rank 0 decides on the tightest rank's reading (`GroupProbe`); each
  decision, at the point the scheduler asks for it, is broadcast, and the other ranks act
  on that decision instead of asking their own guard. A refusal therefore happens on all
  ranks or none, and a prefill chunk is halved on all of them alike.
- **Tokens.** The sampled tokens of each decode step are rank 0's, broadcast inside the
  step's graph (`agree_tokens`, one small `all_sum`): a constrained or randomly sampled
  row cannot drift apart on another rank, and the others need no grammar.
- **The digest.** Rank 0 compares the digests every step; ranks that drifted apart anyway
  (an out-of-memory caught on one rank only) fail the group rather than compute garbage.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from engine.admission import Admission
from engine.distributed.channel import ROW_WORDS, Channel, words_for
from engine.distributed.probe import GroupProbe, snapshot_from_json, snapshot_to_json
from engine.distributed.watchdog import GroupFailedError
from engine.request import EngineRequest
from engine.sampling import SampledStep
from memory import AdmissionQuery, Decision, Outcome
from memory.probes.base import Probe

if TYPE_CHECKING:
    from engine.core import EngineCore

log = logging.getLogger("mlx_headroom.distributed")

IDLE_S = 0.05  # every rank's wait between idle steps (the first request after idle waits as long)
PLAN_INLINE_WORDS = ROW_WORDS - 256  # room left in rank 0's row after its reading
DECISION_WORDS = 1024


def _request_to_json(request: EngineRequest) -> dict[str, Any]:
    # Sampling stays on rank 0 (tokens are agreed in the graph): the others need the
    # tokens to run, the length and the stop ids to end the request on the same step.
    return {"id": request.request_id, "prompt": list(request.prompt_tokens),
            "max_tokens": request.max_tokens, "stop": sorted(request.stop_token_ids)}


def _request_from_json(data: dict[str, Any]) -> EngineRequest:
    return EngineRequest(request_id=data["id"], prompt_tokens=tuple(data["prompt"]),
                         max_tokens=int(data["max_tokens"]), stop_token_ids=frozenset(data["stop"]))


def decision_to_json(decision: Decision) -> dict[str, Any]:
    return dataclasses.asdict(decision) | {"outcome": decision.outcome.value}


def decision_from_json(data: dict[str, Any]) -> Decision:
    return Decision(**(data | {"outcome": Outcome(data["outcome"])}))


def digest(core: EngineCore) -> list[int]:
    """What every rank's core must agree on after a step (cheap counters, no lists)."""
    c = core._counters
    return [len(core.prefilling), len(core.batch), c["prefill_chunks"], c["decode_steps"],
            c["generated_tokens"], c["prompt_tokens"], c["preemptions"]]


class Lockstep:
    """The hooks `EngineCore` calls on a tensor-parallel rank."""

    def __init__(self, channel: Channel, local_probe: Probe, group_probe: GroupProbe | None = None) -> None:
        self.channel = channel
        self.rank = channel.rank
        self.local_probe = local_probe
        self.group_probe = group_probe  # rank 0 only
        self.now = time.monotonic()
        self._ops: list[list[Any]] = []  # rank 0: ["submit", request] / ["abort", id], in order
        self._digest: list[int] = []
        self.steps = 0
        self.idle_s = IDLE_S

    def clock(self) -> float:
        return self.now

    # ---- rank 0: what the inbox gave -------------------------------------------------
    def took(self, item: Any) -> None:
        from engine.core import _Abort, _Submit

        if isinstance(item, _Submit):
            self._ops.append(["submit", _request_to_json(item.request)])
        elif isinstance(item, _Abort):
            self._ops.append(["abort", item.request_id])

    # ---- every step ------------------------------------------------------------------
    def initial_sync(self) -> None:
        """Once, before the cores are built: every rank's reading, so that rank 0 measures
        the idle footprint admission starts from on the tightest rank."""
        self._sync(None, stop=False)

    def before_step(self, core: EngineCore) -> bool:
        """Exchange rows and apply the plan; False when rank 0 said stop."""
        return self._sync(core, stop=False)

    def after_step(self, core: EngineCore) -> None:
        self._digest = digest(core)
        self.steps += 1

    def stop(self, core: EngineCore) -> None:
        """Rank 0, leaving its loop: tell the others to leave theirs."""
        self._sync(core, stop=True)

    def _sync(self, core: EngineCore | None, *, stop: bool) -> bool:
        try:
            reading: dict[str, Any] | None = snapshot_to_json(self.local_probe.read())
        except Exception:  # no reading on this rank: rank 0 decides on the others'
            reading = None
        row: dict[str, Any] = {"snap": reading, "digest": self._digest}
        plan: dict[str, Any] | None = None
        if self.rank == 0:
            plan = {"clock": time.monotonic(), "ops": self._ops, "stop": stop}
            self._ops = []
            words = words_for(plan)
            if words <= PLAN_INLINE_WORDS:
                row["plan"] = plan
            else:
                row["plan_words"] = words
        rows = self.channel.gather(row)
        head = rows[0]
        plan = head["plan"] if "plan" in head else self.channel.broadcast(plan, head["plan_words"])
        assert plan is not None
        if self.rank == 0:
            self._check(rows)
        # Rank 0's clock on every rank: only differences of it are used (wait timeouts).
        self.now = float(plan["clock"])
        if plan["stop"]:
            return False
        if self.rank != 0 and core is not None:
            for op, arg in plan["ops"]:
                if op == "submit":
                    core.submit_now(_request_from_json(arg))
                else:
                    core._abort(arg)
        return True

    def _check(self, rows: list[dict[str, Any]]) -> None:
        mine = rows[0]["digest"]
        for rank, row in enumerate(rows[1:], start=1):
            if row["digest"] != mine:
                raise GroupFailedError(
                    f"rank {rank} diverged from rank 0 (engine state {row['digest']} vs {mine})")
        if self.group_probe is not None:
            self.group_probe.update({
                rank: snapshot_from_json(row["snap"])
                for rank, row in enumerate(rows) if row["snap"] is not None
            })

    # ---- admission -------------------------------------------------------------------
    def share_decision(self, decision: Decision | None) -> Decision:
        """Rank 0's decision on every rank (`decision` is None on the others)."""
        payload = decision_to_json(decision) if decision is not None else None
        return decision_from_json(self.channel.broadcast(payload, DECISION_WORDS))

    # ---- tokens ----------------------------------------------------------------------
    def agree_tokens(self, step: SampledStep) -> SampledStep:
        """Rank 0's tokens on every rank, inside the graph (no wait on the host)."""
        # The others' zeros still depend on their own sampled tokens: a contribution that
        # did not would leave the step's forward pass (and its all_sums) unevaluated there.
        mine = step.tokens.astype(mx.int32) * (1 if self.rank == 0 else 0)
        agreed = mx.distributed.all_sum(mine, group=self.channel.group).astype(mx.uint32)
        return dataclasses.replace(step, tokens=agreed)


class LockstepAdmission(Admission):
    """Admission whose every decision is rank 0's, made on the tightest rank's reading."""

    lockstep: Lockstep  # set right after construction (Admission's own init asks nothing)

    def _ask(self, query: AdmissionQuery) -> Decision:
        if self.lockstep.rank == 0:
            decision = self._annotate(super()._ask(query))
            return self.lockstep.share_decision(decision)
        decision = self.lockstep.share_decision(None)
        self._follow(decision)
        self.checks += 1
        return decision

    def _annotate(self, decision: Decision) -> Decision:
        probe = self.lockstep.group_probe
        if probe is None or decision.outcome is Outcome.ADMIT:
            return decision
        readings = probe.readings()
        rank = probe.binding_rank(readings)
        note = f" (tensor parallel: rank {rank} of {len(readings)} has the least room)"
        return dataclasses.replace(decision, reason=decision.reason + note)

    def upkeep(self, committed: int) -> Decision:
        """Each rank's own upkeep (its cache limit, its hand-backs): no decision to share."""
        self._last_upkeep = time.monotonic()
        return Admission._ask(self, AdmissionQuery(predicted_bytes=0, committed_bytes=committed,
                                                   baseline_bytes=self.baseline_bytes))
