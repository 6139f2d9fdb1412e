"""``diffusion-trt inspect``: an artifact's manifest as a summary for people (text) and machines (JSON).

:func:`artifact_summary` distils the manifest: components with precision, engine file, bytes, I/O shapes
and ranges, passes that changed something (non-zero counts only), build facts; the profile; tool
versions; and any top-level key this module does not know (accuracy or speed figures added later are
shown, not dropped). :func:`format_summary` renders it as text.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manifest import Manifest

#: Manifest keys the summary presents itself; any other top-level key is listed under "other".
_KNOWN = {
    "schema_version", "name", "created_utc", "pipeline_class", "source", "backend", "device", "precision",
    "profile", "model", "scheduler", "tokenizer", "tokenizer_2", "components", "files", "config", "tools",
    "compile_seconds", "manifest_sha256", "partial",
}
#: Build facts worth a line (the rest stay in ``--json`` / the manifest).
_BUILD_KEYS = ("providers", "test_loaded", "library", "tensorrt", "compute_capability", "compute_capabilities", "gpu",
               "flags", "strongly_typed", "num_layers", "runtime_cache", "build_seconds", "plan_bytes")


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def _nonzero_passes(passes: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for rec in passes:
        counts = {k: v for k, v in (rec.get("counts") or {}).items() if v}
        if counts:
            out.setdefault(str(rec.get("name")), {}).update(counts)
    return out


def pass_table(manifest: Manifest) -> list[str]:
    """``compile``'s closing table: one line per component, its passes that changed something with their non-zero
    counts (``unet          fuse_gelu(Gelu=16); ...``), or ``no change``."""
    lines = []
    for name, component in manifest.components.items():
        parts = []
        for rec in component.spec.get("passes", []):
            counts = ", ".join(f"{k}={v}" for k, v in rec.get("counts", {}).items() if v)
            if counts:
                parts.append(f"{rec['name']}({counts})")
        lines.append(f"{name:<13} {'; '.join(parts) or 'no change'}")
    return lines


def _tensor(t: dict[str, Any]) -> dict[str, Any]:
    return {k: t.get(k) for k in ("name", "dtype", "shape", "min", "opt", "max")}


def artifact_summary(root: str | os.PathLike[str], manifest: dict[str, Any]) -> dict[str, Any]:
    """The JSON-ready summary of a (validated) manifest; ``root`` is only reported, not read."""
    files: dict[str, Any] = manifest.get("files", {})
    components = {}
    for name, entry in manifest.get("components", {}).items():
        own = list(dict.fromkeys([*entry.get("files", []), *(entry[k] for k in ("onnx", "plan") if k in entry)]))
        build = entry.get("build") or {}
        comp: dict[str, Any] = {
            "precision": entry.get("precision"),
            "engine": entry.get("plan") or entry.get("onnx"),
            "files": own,
            "bytes": sum(int(files.get(f, {}).get("size", 0)) for f in own),
            "inputs": [_tensor(t) for t in entry.get("inputs", [])],
            "outputs": [_tensor(t) for t in entry.get("outputs", [])],
            "passes": _nonzero_passes(entry.get("passes", [])),
            "build": {k: build[k] for k in _BUILD_KEYS if build.get(k) is not None},
        }
        if "profiles" in build:
            comp["build"]["profiles"] = len(build["profiles"])
        for key in ("quality", "quantization"):
            if key in entry:
                comp[key] = entry[key]
        components[name] = comp
    profile = manifest.get("profile", {})
    return {
        "path": str(Path(root)),
        "name": manifest.get("name"),
        "schema_version": manifest.get("schema_version"),
        "created_utc": manifest.get("created_utc"),
        "backend": manifest.get("backend"),
        "device": manifest.get("device"),
        "precision": manifest.get("precision"),
        "pipeline_class": manifest.get("pipeline_class"),
        "scheduler": (manifest.get("scheduler") or {}).get("class_name"),
        "profile": {k: dict(zip(("min", "opt", "max"), v, strict=False)) for k, v in profile.items()},
        "model": manifest.get("model", {}),
        "source_sha256": (manifest.get("source") or {}).get("sha256"),
        "compile_seconds": manifest.get("compile_seconds"),
        # compile --deterministic took effect: ORT CUDA with GroupNorm left unfused (CompileConfig.deterministic)
        "deterministic": bool((manifest.get("config") or {}).get("deterministic"))
        and (manifest.get("backend"), manifest.get("device")) == ("ort", "cuda"),
        "files": len(files),
        "total_bytes": sum(int(e.get("size", 0)) for e in files.values()),
        "components": components,
        "tools": manifest.get("tools", {}),
        "manifest_sha256": manifest.get("manifest_sha256"),
        "other": {k: v for k, v in manifest.items() if k not in _KNOWN},
    }


def _dims(values: Any) -> str:
    return "[" + ", ".join(str(v) for v in values or []) + "]"


def format_summary(s: dict[str, Any]) -> str:
    """Render :func:`artifact_summary` as an aligned text block (no trailing newline)."""
    p = s["profile"]

    def rng(key: str) -> str:
        r = p.get(key, {})
        return f"{key} {r.get('min')}..{r.get('max')} (opt {r.get('opt')})"

    lines = [
        f"artifact   {s['name']}  ({s['path']})",
        f"           schema {s['schema_version']}, created {s['created_utc']}, {human_bytes(s['total_bytes'])} in "
        f"{s['files']} files, manifest sha256 {str(s['manifest_sha256'])[:12]}…",
        f"backend    {s['backend']} on {s['device']}, {s['precision']}"
        + (" (--deterministic: GroupNorm unfused)" if s.get("deterministic") else "")
        + (f"; compiled in {s['compile_seconds']:.1f} s" if isinstance(s.get("compile_seconds"), int | float) else "")
        + (f" from {s['pipeline_class']}" if s.get("pipeline_class") else "")
        + (f" (source sha256 {s['source_sha256'][:12]}…)" if s.get("source_sha256") else ""),
        f"profile    {rng('batch')}, {rng('height')}, {rng('width')}; scheduler {s['scheduler']}",
        "components",
    ]
    for name, c in s["components"].items():
        lines.append(f"  {name:<13} {c['precision']:<5} {c['engine']}  {human_bytes(c['bytes'])}")
        for kind in ("inputs", "outputs"):
            for t in c[kind]:
                lines.append(
                    f"      {'in' if kind == 'inputs' else 'out':<6} {t['name']} {t['dtype']} {_dims(t['shape'])}"
                    f"  min {_dims(t['min'])} opt {_dims(t['opt'])} max {_dims(t['max'])}"
                )
        passes = "; ".join(
            f"{n}(" + ", ".join(f"{k}={v}" for k, v in counts.items()) + ")" for n, counts in c["passes"].items()
        )
        lines.append(f"      passes {passes or 'no change'}")
        if c["build"]:
            lines.append("      build  " + ", ".join(f"{k}={v}" for k, v in c["build"].items()))
        for key in ("quality", "quantization"):
            if key in c:
                lines.append(f"      {key} {c[key]}")
    if s.get("memory"):
        lines.extend(format_memory(s["memory"]))
    lines.append("tools      " + ", ".join(f"{k} {v}" for k, v in s["tools"].items()))
    for key, value in s["other"].items():
        lines.append(f"other      {key}: {value}")
    return "\n".join(lines)


def format_memory(m: dict[str, Any]) -> list[str]:
    """Lines for the ``memory`` part of the summary (``runtime.memory.residency.memory_summary``)."""
    mib = 2**20
    lines = [f"memory     per engine at opt {m['shapes']['opt']} / max {m['shapes']['max']} (batch x height x width); "
             f"facts: {m['facts']}"]
    for name, by in m["components"].items():
        o, x = by["opt"], by["max"]
        lines.append(
            f"  {name:<13} weights {o['weights_bytes'] / mib:.0f} MiB ({o['weights_source']}); activations "
            f"{o['activations_bytes'] / mib:.0f} / {x['activations_bytes'] / mib:.0f} MiB ({x['activations_source']})"
        )
    lines.append(f"  + {m['overhead_bytes'] / mib:.0f} MiB CUDA context and buffers (estimated unless measured)")
    return lines
