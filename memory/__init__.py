"""memory: the admission brain of mlx-headroom.

Pure, typed policy: probes read the machine into a frozen :class:`MemorySnapshot`;
:func:`compute_ceiling` turns it into a hard limit; :func:`decide` says ADMIT, EVICT,
WAIT or REJECT, and why; :func:`compute_fit` says whether a model fits before it is loaded,
and what fits beside it. Nothing here imports FastAPI, the engine or the server, and
``mlx.core`` is only imported lazily inside probe reads.
"""

from .ceiling import Ceiling, CeilingConfig, Tier, compute_ceiling
from .decision import AdmissionQuery, Decision, Outcome, cache_limit_bytes, decide
from .errors import ProbeError, ProbeUnavailableError
from .estimate import (
    KV_STEP,
    KVGroup,
    KVLayout,
    ModelGeometry,
    PrefillEstimate,
    estimate_decode_reservation,
    estimate_prefill,
    fused_attention_available,
    geometry_from_config,
    geometry_from_model,
    kv_cache_bytes,
)
from .fit import FitReport, LoadRequirement, ModelSpec, compute_fit
from .guard import GuardState, HandBackPolicy, MemoryGuard
from .probes import (
    AllocatorProbe,
    CudaProbe,
    LinuxProbe,
    MacOSProbe,
    NvmlReading,
    Probe,
    PynvmlReader,
    ResilientProbe,
    detect_probe,
)
from .snapshot import MemorySnapshot
from .tracker import TransientTracker
from .walk import EngineParams
from .weights import Quantization, TensorInfo, WeightInventory, inventory_from_tensors

__all__ = [
    "KV_STEP",
    "AdmissionQuery",
    "AllocatorProbe",
    "Ceiling",
    "CeilingConfig",
    "CudaProbe",
    "Decision",
    "EngineParams",
    "FitReport",
    "GuardState",
    "HandBackPolicy",
    "KVGroup",
    "KVLayout",
    "LinuxProbe",
    "LoadRequirement",
    "MacOSProbe",
    "MemoryGuard",
    "MemorySnapshot",
    "ModelGeometry",
    "ModelSpec",
    "NvmlReading",
    "Outcome",
    "PrefillEstimate",
    "Probe",
    "ProbeError",
    "ProbeUnavailableError",
    "PynvmlReader",
    "Quantization",
    "ResilientProbe",
    "TensorInfo",
    "Tier",
    "TransientTracker",
    "WeightInventory",
    "cache_limit_bytes",
    "compute_ceiling",
    "compute_fit",
    "decide",
    "detect_probe",
    "estimate_decode_reservation",
    "estimate_prefill",
    "fused_attention_available",
    "geometry_from_config",
    "geometry_from_model",
    "inventory_from_tensors",
    "kv_cache_bytes",
]
