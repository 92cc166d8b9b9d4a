"""Projections that read the same input, fused into one matmul at load.

mlx-lm's attention calls ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` in turn, and its
MLP ``gate_proj(x)`` and ``up_proj(x)``: five matmuls per layer that each read ``x`` and
launch a kernel of their own. vLLM serves the same models with one QKV matmul and one
gate/up matmul per layer. On CUDA the decode step is host-bound (every op costs MLX host
time to encode, docs/throughput.md), and at small batches three thin matmuls also use
the device worse than one wide one.

How, without forking model files: the weights of a group are concatenated along their
output rows into one `nn.Linear` (or `nn.QuantizedLinear`: packed rows, scales and biases
concatenate the same way). The group's first projection becomes a `FusedLead` that runs
the one matmul and keeps its other outputs for the same input array; the rest become
`FusedPart`s that hand those outputs back. A part called with any other input (another
call order, another input) computes its own rows from a view of the fused weight, so the
result is always the projection's own: fusion changes how many kernels run, never what
they compute.

Only exact `nn.Linear` / `nn.QuantizedLinear` groups with the same input size, dtype, bias
and quantization are fused; sharded (tensor-parallel), LoRA or other linear layers are
left as they are.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# the same groups load admission counts while they fuse
from memory.weights import FUSED_GROUPS

_ROW_ARRAYS = ("weight", "scales", "biases", "bias")  # arrays with one row (or row block) per output


class _Outputs:
    """The lead's last input and its split outputs, for the parts to pick up."""

    def __init__(self) -> None:
        self.x: mx.array | None = None
        self.parts: list[mx.array] = []
        self.pending = 0

    def keep(self, x: mx.array, parts: list[mx.array]) -> None:
        self.x, self.parts, self.pending = x, parts, len(parts) - 1

    def take(self, x: mx.array, index: int) -> mx.array | None:
        if self.x is not x:
            return None
        out = self.parts[index]
        self.pending -= 1
        if self.pending == 0:  # the last part: drop the references
            self.x, self.parts = None, []
        return out


class FusedLead(nn.Module):
    """The group's first projection: runs the fused matmul, returns its own rows."""

    def __init__(self, fused: nn.Module, splits: list[int]) -> None:
        super().__init__()
        self.fused = fused
        # plain attributes (a list or tuple would become part of the parameter tree)
        object.__setattr__(self, "_splits", tuple(splits))  # where each later projection starts
        self._outputs = _Outputs()

    def __call__(self, x: mx.array) -> mx.array:
        parts = mx.split(self.fused(x), list(self._splits), axis=-1)
        self._outputs.keep(x, parts)
        return parts[0]


class FusedPart:
    """A later projection of the group. Not an `nn.Module` child: the fused weight is
    counted once, under the lead, so parameters and weight bytes stay what they were."""

    def __init__(self, lead: FusedLead, index: int, start: int, stop: int) -> None:
        self._lead = lead
        self._index = index
        self._rows = (start, stop)

    def __call__(self, x: mx.array) -> mx.array:
        out = self._lead._outputs.take(x, self._index)
        if out is not None:
            return out
        return _rows_of(self._lead.fused, *self._rows)(x)


@dataclass(frozen=True)
class FusionReport:
    groups: int  # groups fused
    skipped: int  # groups found but left unfused (mixed types, dtypes, quantization)


def fuse_projections(model: nn.Module) -> FusionReport:
    """Fuse every eligible projection group of `model` in place, one group at a time.

    Each group's concatenation is evaluated, its originals dropped and MLX's buffer cache
    cleared before the next group: freed buffers would otherwise stay in that cache (its
    limit is most of the device on CUDA and Metal, and the concatenations' sizes never
    reuse them), and the device would hold every original beside its fusion, about half
    the weights again. So loading holds at most one group twice (what load admission
    counts, `memory.weights.largest_fused_group_bytes`)."""
    fused = skipped = 0
    for module in _parents(model):
        for names in FUSED_GROUPS:
            projections = [module.get(n) for n in names]
            if any(p is None for p in projections):
                continue
            if not _fusable(projections):
                skipped += 1
                continue
            _fuse(module, names, projections)
            del projections  # the last references to the originals
            mx.clear_cache()
            fused += 1
    return FusionReport(fused, skipped)


def _parents(model: nn.Module) -> list[nn.Module]:
    """The modules holding a projection group: only those, so that no list here keeps the
    original projections alive once their group is fused."""
    inner = getattr(model, "_model", None)  # wrappers (tests' fault injectors) forward
    target = inner if isinstance(inner, nn.Module) else model
    firsts = {names[0] for names in FUSED_GROUPS}
    return [m for _, m in target.named_modules() if isinstance(m, dict) and firsts & m.keys()]


def _fusable(projections: list[Any]) -> bool:
    kind = type(projections[0])
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(p) is not kind for p in projections):
        return False
    first = projections[0]
    for p in projections[1:]:
        if set(p.keys()) != set(first.keys()) or p.weight.shape[1:] != first.weight.shape[1:]:
            return False
        if any(p[k].dtype != first[k].dtype for k in first if isinstance(first[k], mx.array)):
            return False
        if kind is nn.QuantizedLinear and (p.group_size, p.bits, p.mode) != (
            first.group_size, first.bits, first.mode
        ):
            return False
    return True


def _fuse(module: nn.Module, names: tuple[str, ...], projections: list[nn.Module]) -> None:
    rows = [p.weight.shape[0] for p in projections]
    fused = copy.copy(projections[0])
    for key in _ROW_ARRAYS:
        if key in fused:
            fused[key] = mx.concatenate([p[key] for p in projections], axis=0)
    mx.eval(fused.parameters())
    bounds = [sum(rows[:i]) for i in range(len(rows) + 1)]
    lead = FusedLead(fused, bounds[1:-1])
    module[names[0]] = lead
    for i, name in enumerate(names[1:], start=1):
        # not an array or module, so a plain attribute rather than a child: see FusedPart
        setattr(module, name, FusedPart(lead, i, bounds[i], bounds[i + 1]))


def _rows_of(fused: nn.Module, start: int, stop: int) -> nn.Module:
    """The projection of rows [start, stop) of `fused`, as views of its arrays."""
    part = copy.copy(fused)
    for key in _ROW_ARRAYS:
        if key in part:
            part[key] = fused[key][start:stop]
    return part
