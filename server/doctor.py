"""`mlx-headroom doctor`: what this machine is, what the guard reads, and what fits.

It prints the backend and device (and whether Metal is usable: available, and a small
computation on the GPU returns; run it as the service's user, in the service's context, to
learn what the service gets), every probe's reading, the ceiling's components and
which binds (on a Mac, ``iogpu.wired_limit_mb`` beside MLX's recommended working set and
the ``sysctl`` to raise it when it binds), what ``serve`` would wire with
``mx.set_wired_limit`` (``engine.wired``; nothing where that is a no-op), and, for
``--model``, what fits, computed from
its config and weight headers without loading it. The numbers come from the same
computation load admission uses (``server.model_fit``), under the same settings
(environment, ``.env`` and the flags below), so what doctor promises, serve admits.

Exit status: 0 when every probe reads and the model (if given) fits at all; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from typing import Any

from memory import Ceiling, Tier, compute_ceiling, detect_probe
from memory._units import MiB
from memory._units import format_bytes as fb
from memory.fit import wired_limit_advice
from server.settings import Settings

_SETTING_FLAGS = ("load_format", "dtype", "memory_tier", "memory_ceiling_bytes", "memory_probe",
                  "reserve_context_tokens", "prefill_step_size", "max_step_tokens", "context_length")


def add_doctor_parser(sub: Any) -> None:
    doctor = sub.add_parser("doctor", help="check this machine and what fits on it")
    doctor.add_argument("--model", help="a model to size (as for serve; weights are not loaded)")
    doctor.add_argument("--load-format", choices=["auto", "dummy"])
    doctor.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    doctor.add_argument("--memory-tier", choices=["safe", "balanced", "aggressive", "custom"])
    doctor.add_argument("--memory-ceiling-bytes", type=int)
    doctor.add_argument("--memory-probe", choices=["auto", "macos", "linux", "cuda", "allocator"])
    doctor.add_argument("--reserve-context-tokens", type=int)
    doctor.add_argument("--context-length", type=int,
                        help="as for serve: size the model served at this context")
    doctor.add_argument("--prefill-step-size", type=int)
    doctor.add_argument("--max-step-tokens", type=int, help="as for serve: the step's token budget")
    doctor.add_argument("--max-tokens", type=int,
                        help="output tokens per request in the fit (default: the server's default)")
    doctor.add_argument("--json", action="store_true", help="print one JSON object")


def run_doctor(args: argparse.Namespace) -> int:
    overrides = {k: getattr(args, k) for k in _SETTING_FLAGS if getattr(args, k) is not None}
    settings = Settings(**overrides)
    report = collect(settings, model=args.model, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0 if report["ok"] else 1


def _probe_kinds(configured: str) -> list[str]:
    """The probes that should work on this machine: the configured one, the platform's,
    and the allocator's."""
    from memory.probes.detect import _cuda_available

    kinds = [configured]
    if _cuda_available():
        kinds.append("cuda")
    kinds.append("macos" if sys.platform == "darwin" else "linux")
    kinds.append("allocator")
    return list(dict.fromkeys(kinds))


def _backend() -> dict[str, Any]:
    import mlx.core as mx

    from engine import backend_name
    from engine.device_report import device_report

    info = {str(k): v for k, v in dict(mx.device_info()).items()}
    report = device_report()
    return {"name": backend_name(), "device": str(mx.default_device()), "device_info": info,
            "metal_available": report.metal_available, "metal_usable": report.metal_usable,
            "metal_problem": report.problem, "summary": report.describe()}


def _sysctl_int(name: str) -> int | None:
    exe = shutil.which("sysctl") or "/usr/sbin/sysctl"
    try:
        out = subprocess.run([exe, "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stdout.strip()
    return int(text) if out.returncode == 0 and text.lstrip("-").isdigit() else None


def macos_view(ceiling: Ceiling, wired_limit_mb: int | None, recommended: int | None) -> dict[str, Any]:
    """The GPU wired limit beside MLX's recommended working set, and when the wired limit
    (or, unset, the working set it defaults to) binds, the sysctl that raises it."""
    raise_to = wired_limit_advice(ceiling, 0, macos=True)
    return {
        "iogpu_wired_limit_mb": wired_limit_mb,
        "max_recommended_working_set_bytes": recommended,
        "wired_limit_binds": ceiling.binding == "device",
        "raise_wired_limit_mb": raise_to,
        "sysctl": f"sudo sysctl iogpu.wired_limit_mb={raise_to}" if raise_to else None,
    }


def wired_view(weight_bytes: int | None, working_set: int | None,
               ceiling: int | None) -> dict[str, Any]:
    """The wired limit `serve` would set for the model's weights, by the decision it makes
    after the load (``engine.wired``): null where ``mx.set_wired_limit`` is a no-op, or
    without ``--model``, whose weights are what gets wired."""
    from engine.wired import decide_wired_limit

    if not working_set:
        return {"limit_bytes": None, "reason": "mx.set_wired_limit is a no-op on this backend "
                "(no recommended working set): nothing is wired"}
    if weight_bytes is None:
        return {"limit_bytes": None, "reason": "serve wires a model's weights after loading it "
                "when the guard has room (--model sizes it)"}
    decision = decide_wired_limit(weight_bytes, working_set=working_set, ceiling=ceiling)
    return {"limit_bytes": decision.limit_bytes, "reason": decision.reason}


def collect(settings: Settings, *, model: str | None, max_tokens: int | None) -> dict[str, Any]:
    """Everything doctor reports, as one JSON-able dict (``ok`` and ``problems`` included)."""
    problems: list[str] = []
    backend = _backend()
    if backend["metal_available"] and not backend["metal_usable"]:
        problems.append(f"Metal is available but not usable: {backend['metal_problem']}")
    report: dict[str, Any] = {
        "backend": backend,
        "settings": {k: getattr(settings, k) for k in (
            "memory_probe", "memory_tier", "memory_ceiling_bytes", "context_length",
            "prefill_step_size", "max_step_tokens", "min_prefill_chunk", "default_max_tokens",
            "memory_guard")} | {"reserve_context_tokens": settings.load_reserve_tokens},
    }

    probes: dict[str, Any] = {}
    for kind in _probe_kinds(settings.memory_probe):
        try:
            probes[kind] = {"ok": True, "snapshot": asdict(detect_probe(kind).read())}
        except Exception as exc:  # a probe that cannot read is the finding
            probes[kind] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            problems.append(f"probe {kind!r} failed: {exc}")
    report["probes"] = probes

    configured = probes.get(settings.memory_probe, {})
    if not configured.get("ok"):
        report |= {"ceiling": None, "model": None, "ok": False, "problems": problems}
        return report
    from memory import MemorySnapshot

    snapshot = MemorySnapshot(**configured["snapshot"])
    from server.model_fit import ceiling_for, fit_for_settings, fit_json, read_spec

    ceiling = ceiling_for(settings, snapshot)
    report["ceiling"] = {
        "probe": settings.memory_probe,
        "tier": ceiling.tier.value,
        "hard_bytes": ceiling.hard_bytes,
        "binding": ceiling.binding,
        "components": dict(ceiling.components),
        "tiers": {
            t.value: compute_ceiling(snapshot, t).hard_bytes for t in Tier if t is not Tier.CUSTOM
        },
    }
    if snapshot.platform == "macos":
        recommended = report["backend"]["device_info"].get("max_recommended_working_set_size")
        report["macos"] = macos_view(ceiling, _sysctl_int("iogpu.wired_limit_mb"), recommended)

    report["model"] = None
    if model is not None:
        from engine.model_spec import ModelSpecError

        try:
            spec = read_spec(settings, model, settings.context_length)
        except (ModelSpecError, ValueError) as exc:
            problems.append(f"cannot size {model}: {exc}")
        else:
            fit = fit_for_settings(settings, spec, snapshot, max_tokens=max_tokens)
            report["model"] = {
                "name": spec.name,
                "weights_source": spec.weights_source,
                "weight_bytes": spec.weight_bytes,
                "quantization": str(spec.weights.quantization) if spec.weights.quantization else None,
                "context_length": spec.context_length,
                "kv_bytes_per_token": spec.geometry.kv_bytes_per_token,
                "geometry": asdict(spec.geometry),
                "fit": fit_json(fit),
                "max_concurrency": settings.max_concurrency,  # the server's own cap
            }
            if not fit.fits_at_all:
                problems.append(f"{spec.name} cannot fit at all: {fit.message()}")
    weights = report["model"]["weight_bytes"] if report["model"] else None
    working_set = report["backend"]["device_info"].get("max_recommended_working_set_size")
    report["wired_limit"] = wired_view(weights, working_set if backend["metal_available"] else None,
                                       ceiling.hard_bytes if settings.memory_guard else None)
    report["ok"] = not problems
    report["problems"] = problems
    return report


def render(report: dict[str, Any]) -> str:
    """The report for a terminal."""
    b = report["backend"]
    lines = [f"backend   {b['name']} ({b['device']})"]
    if "summary" in b:
        lines.append(f"          {b['summary']}")
    for key in ("device_name", "architecture", "memory_size", "total_memory"):
        if key in b["device_info"]:
            value = b["device_info"][key]
            lines.append(f"          {key}: {fb(value) if isinstance(value, int) else value}")
    lines.append("probes")
    for kind, p in report["probes"].items():
        if not p["ok"]:
            lines.append(f"  {kind:9} FAILED: {p['error']}")
            continue
        s = p["snapshot"]
        cap = fb(s["device_cap_bytes"]) if s["device_cap_bytes"] else "none"
        lines.append(
            f"  {kind:9} total {fb(s['total_bytes'])}, footprint {fb(s['footprint_bytes'])}, "
            f"free {fb(s['free_bytes'])}, inactive {fb(s['inactive_bytes'])}, "
            f"active {fb(s['active_bytes'])}, wired {fb(s['wired_bytes'])}, device cap {cap}"
        )
    c = report.get("ceiling")
    if c:
        parts = ", ".join(f"{k} {fb(v)}" for k, v in c["components"].items())
        lines.append(f"ceiling   {fb(c['hard_bytes'])}, {c['binding']} binds "
                     f"(tier {c['tier']}, probe {c['probe']}: {parts})")
    mac = report.get("macos")
    if mac:
        wired = mac["iogpu_wired_limit_mb"]
        rec = mac["max_recommended_working_set_bytes"]
        lines.append(
            f"macOS     iogpu.wired_limit_mb {wired if wired else '0 (default)'}; "
            f"MLX recommended working set {fb(rec) if rec else 'unknown'}"
        )
        if mac["sysctl"]:
            lines.append(f"          the wired limit binds; to raise it: {mac['sysctl']}"
                         f" ({fb(mac['raise_wired_limit_mb'] * MiB)})")
    wiring = report.get("wired_limit")
    if wiring:
        limit = wiring["limit_bytes"]
        lines.append(f"wired     mx.set_wired_limit {'none' if limit is None else fb(limit)}: "
                     f"{wiring['reason']}")
    m = report.get("model")
    if m:
        fit = m["fit"]
        lines.append(f"model     {m['name']}: {fb(m['weight_bytes'])} of weights "
                     f"({m['weights_source']}), context {m['context_length']}, "
                     f"KV {fb(m['kv_bytes_per_token'])}/token")
        lines.append(f"          {fit['message']}")
        bound = (" (the whole context)" if fit["max_prompt_tokens"] + fit["max_tokens"]
                 >= m["context_length"] else "")
        lines.append(f"          longest prompt at concurrency 1: {fit['max_prompt_tokens']} tokens "
                     f"(+ {fit['max_tokens']} output){bound}")
        for row in fit["concurrency"]:
            n = "beyond the context" if row["beyond_context"] else str(row["requests"])
            lines.append(f"          {row['prompt_tokens']:>6}-token prompts at once: {n}")
        lines.append(f"          (the server runs at most {m['max_concurrency']} at once: "
                     "--max-concurrency)")
    for problem in report["problems"]:
        lines.append(f"PROBLEM   {problem}")
    lines.append("ok" if report["ok"] else "not ok")
    return "\n".join(lines)
