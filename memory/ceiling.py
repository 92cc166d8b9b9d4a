"""The hard ceiling: the most this process may use, and which limit sets it.

Three independent limits, each a reason to stop:

- **static**  = total − reserve(tier): leave the OS and other apps a fixed reserve
  (4 GiB on machines under 24 GiB, where 6–8 GiB would leave little to use);
- **dynamic** = own footprint + free + inactive + active × reclaim_ratio(tier): what we
  could reach given what the rest of the machine is doing right now; the tier says how much
  of other processes' active memory we are willing to push out;
- **device**  = the device cap (wired limit / recommended working set on Metal, the GPU
  total on CUDA, the cgroup limit on Linux).

The hard ceiling is the smallest positive one. ``Tier.CUSTOM`` replaces static and dynamic
with the user's number, but still never exceeds the device cap.

The **fixed** ceiling leaves the dynamic limit out: it is what this process could have on a
machine where nothing else runs. Whether a request can *ever* fit is judged against it,
never against the dynamic limit, which moves with whatever the rest of the machine (or a
not-yet-returned CUDA pool) holds at the moment of reading.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

from ._units import GiB, format_bytes
from .snapshot import MemorySnapshot


class Tier(str, Enum):
    SAFE = "safe"
    BALANCED = "balanced"
    AGGRESSIVE = "aggressive"
    CUSTOM = "custom"


DEFAULT_RESERVE_BYTES: Mapping[Tier, int] = MappingProxyType(
    {Tier.SAFE: 8 * GiB, Tier.BALANCED: 6 * GiB, Tier.AGGRESSIVE: 4 * GiB}
)
DEFAULT_RECLAIM_RATIO: Mapping[Tier, float] = MappingProxyType(
    {Tier.SAFE: 0.2, Tier.BALANCED: 0.5, Tier.AGGRESSIVE: 0.8}
)


@dataclass(frozen=True)
class CeilingConfig:
    """Named constants behind the tiers; settings may override any of them."""

    reserve_bytes: Mapping[Tier, int] = field(default_factory=lambda: DEFAULT_RESERVE_BYTES)
    small_machine_bytes: int = 24 * GiB
    small_machine_reserve_bytes: int = 4 * GiB
    reclaim_ratio: Mapping[Tier, float] = field(default_factory=lambda: DEFAULT_RECLAIM_RATIO)

    def reserve_for(self, tier: Tier, total_bytes: int) -> int:
        if total_bytes < self.small_machine_bytes:
            return self.small_machine_reserve_bytes
        return self.reserve_bytes[tier]


@dataclass(frozen=True)
class Ceiling:
    """The hard ceiling, which component binds, and every component considered."""

    hard_bytes: int
    binding: str  # "static" | "dynamic" | "device" | "custom"
    components: Mapping[str, int]
    tier: Tier

    @property
    def fixed_binding(self) -> str:
        """The smallest component that does not depend on current free memory (static,
        custom, device); the binding one if there is none."""
        fixed = {name: v for name, v in self.components.items() if name != "dynamic"}
        return min(fixed, key=lambda name: fixed[name]) if fixed else self.binding

    @property
    def fixed_bytes(self) -> int:
        return self.components.get(self.fixed_binding, self.hard_bytes)

    def describe(self) -> str:
        """One line naming the binding limit and every component, e.g.
        ``dynamic ceiling 12.3 GiB (static 18.0 GiB, dynamic 12.3 GiB, device 16.0 GiB)``.
        """
        parts = ", ".join(f"{name} {format_bytes(v)}" for name, v in self.components.items())
        return f"{self.binding} ceiling {format_bytes(self.hard_bytes)} ({parts})"


def compute_ceiling(
    snapshot: MemorySnapshot,
    tier: Tier,
    config: CeilingConfig = CeilingConfig(),
    custom_bytes: int | None = None,
) -> Ceiling:
    """Compute the hard ceiling for ``tier`` from one snapshot (pure).

    Raises ``ValueError`` for ``Tier.CUSTOM`` without a positive ``custom_bytes``.
    """
    candidates: dict[str, int] = {}
    if tier is Tier.CUSTOM:
        if custom_bytes is None or custom_bytes <= 0:
            raise ValueError("tier 'custom' needs a positive custom ceiling in bytes")
        candidates["custom"] = custom_bytes
    else:
        reserve = config.reserve_for(tier, snapshot.total_bytes)
        candidates["static"] = snapshot.total_bytes - reserve
        candidates["dynamic"] = (
            snapshot.footprint_bytes
            + snapshot.free_bytes
            + snapshot.inactive_bytes
            + int(snapshot.active_bytes * config.reclaim_ratio[tier])
        )
    if snapshot.device_cap_bytes is not None:
        candidates["device"] = snapshot.device_cap_bytes

    components = {name: v for name, v in candidates.items() if v > 0}
    if not components:
        # Nothing positive (e.g. a 2 GiB machine with a 4 GiB reserve): admit nothing.
        first = next(iter(candidates))
        return Ceiling(0, first, MappingProxyType({first: 0}), tier)
    # min() keeps the first on ties, so the order above is the tie-break order.
    binding = min(components, key=lambda name: components[name])
    return Ceiling(components[binding], binding, MappingProxyType(components), tier)
