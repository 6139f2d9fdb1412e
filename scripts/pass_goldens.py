"""Op-count goldens: what the pass pipeline makes of a config-built SD pipeline, per component.

    python scripts/pass_goldens.py --arch tiny --backend ort --device cuda --precision fp16
    python scripts/pass_goldens.py --arch sd15 --backend ort --device cuda --precision fp16   # ~4 GB, minutes

writes ``tests/goldens/<arch>_<backend>_<device>_<precision>.json``::

    {"arch": "sd15", "backend": "ort", "device": "cuda", "precision": "fp16", "seed": 0,
     "profiles": {"static": {"shape": {...}, "components": {"unet": {"ops": {"com.microsoft.GroupNorm": 61, ...},
                                                                      "passes": {"fuse_group_norm": {...}, ...}}}},
                  "dynamic": {...}},
     "tools": {...}}

``ops`` counts the node op types of the main graph after the pipeline (non-default domains prefixed:
``com.microsoft.MultiHeadAttention``); ``passes`` are the counts each pass reported (seconds left out). Both
profiles of ``compile`` are covered: ``static`` (min = opt = max: batch 1 / CFG batch 2 at the model's default
size; ``specialize_shapes`` runs first) and ``dynamic`` (the default profile of ``compile``). ``tools`` is for the
reader: a golden is exact only for the exporter that made it (torch's TorchScript exporter decides the raw ops).

The stages are those of :func:`diffusion_trt.compiler.pipeline.compile_pipeline` (same export call, same
``pass_options``, same ``pipeline_for``) without the engine build, so every (backend, device, precision) runs
on a CPU-only machine, TensorRT included. Each component is exported once and both profiles' pipelines run on
copies of it. tests/passes/test_goldens.py compares fresh counts with the checked-in files.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx

from diffusion_trt.compiler import export
from diffusion_trt.compiler.components import component_specs
from diffusion_trt.compiler.pipeline import model_facts, pass_options, tool_versions
from diffusion_trt.config import CompileConfig, ShapeProfile
from diffusion_trt.passes import PassContext, optimize_model, pipeline_for

logger = logging.getLogger("pass_goldens")

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "tests" / "goldens"
COMPONENTS: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder", "vae_encoder")
PROFILES: tuple[str, ...] = ("static", "dynamic")


def golden_path(arch: str, backend: str, device: str, precision: str) -> Path:
    """``tests/goldens/<arch>_<backend>_<device>_<precision>.json``."""
    return GOLDEN_DIR / f"{arch}_{backend}_{device}_{precision}.json"


def op_type_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Node op types of the main graph, sorted by name; non-default domains as ``domain.op``."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def profiles_for(default_size: int) -> dict[str, ShapeProfile]:
    """The two profiles a golden covers, from the model's default image size (pixels)."""
    static = CompileConfig(height=default_size, width=default_size, min_height=default_size,
                           max_height=default_size, min_width=default_size, max_width=default_size,
                           max_batch_size=1)
    return {"static": static.resolve_profile(default_size), "dynamic": CompileConfig().resolve_profile(default_size)}


def raw_exports(model_dir: Path, work_dir: Path, components: tuple[str, ...] = COMPONENTS
                ) -> Iterator[tuple[str, Path, dict[str, Any]]]:
    """Export each component fp32 on the CPU, as ``compile`` does; yields (component, onnx path, spec info).

    The export depends only on the profile's opt shape, which both profiles of :func:`profiles_for` share.
    """
    folder = export.check_model_folder(model_dir)
    facts = model_facts(folder)
    specs = component_specs(text_hidden=facts["text_hidden_size"], text_len=facts["text_max_length"],
                            unet_in=facts["unet_in_channels"], unet_out=facts["unet_out_channels"],
                            latent=facts["latent_channels"])
    profiles = profiles_for(facts["default_height"])
    models = export.load_models(folder, "fp32", "cpu")
    try:
        for name in components:
            path = work_dir / name / "model.onnx"
            start = time.perf_counter()
            export.onnx_from_component(name, models, specs[name], path, precision="fp32",
                                       profile_ranges=export.export_ranges(profiles["dynamic"]), opset=17,
                                       device="cpu")
            logger.info("%s: exported in %.1f s", name, time.perf_counter() - start)
            yield name, path, {"spec": specs[name], "profiles": profiles}
    finally:
        del models
        gc.collect()


def component_counts(path: Path, name: str, backend: str, device: str, precision: str, spec: Any,
                     profile: ShapeProfile) -> dict[str, Any]:
    """Run the pipeline of (backend, device, precision) for ``profile`` on the export at ``path``; the counts."""
    model = onnx.load(str(path))
    static = profile.is_static()
    ctx = PassContext(component=name, backend=backend, device=device, precision=precision,
                      options=pass_options(spec, profile))
    start = time.perf_counter()
    model, records = optimize_model(model, pipeline_for(backend, device, precision, name, static=static), ctx)
    ops = op_type_counts(model)
    del model
    gc.collect()
    logger.info("%s (%s): passes in %.1f s", name, "static" if static else "dynamic", time.perf_counter() - start)
    return {"ops": ops, "passes": {r.name: dict(r.counts) for r in records}}


def make_golden(model_dir: Path, arch: str, backend: str, device: str, precision: str, *, seed: int = 0,
                components: tuple[str, ...] = COMPONENTS, profiles: tuple[str, ...] = PROFILES) -> dict[str, Any]:
    """The golden document for a pipeline folder (see the module docstring)."""
    out: dict[str, Any] = {"arch": arch, "backend": backend, "device": device, "precision": precision,
                           "seed": seed, "profiles": {p: {"components": {}} for p in profiles}}
    with tempfile.TemporaryDirectory(prefix="pass_goldens_") as tmp:
        for name, path, info in raw_exports(model_dir, Path(tmp), components):
            for kind in profiles:
                profile: ShapeProfile = info["profiles"][kind]
                out["profiles"][kind]["shape"] = profile.to_json()
                out["profiles"][kind]["components"][name] = component_counts(
                    path, name, backend, device, precision, info["spec"], profile)
            path.unlink()
    out["tools"] = tool_versions()
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring; ``--check`` compares instead of writing (exit 1 on a diff)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("tiny", "sd15"), default="tiny")
    parser.add_argument("--backend", choices=("ort", "tensorrt"), default="ort")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--precision", choices=("fp32", "fp16"), default="fp16")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dummy pipeline (counts do not depend on it)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="an existing pipeline folder of that arch [default: write a dummy one to a temp dir]")
    parser.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated subset of static,dynamic")
    parser.add_argument("--out", type=Path, default=None, help="[default: tests/goldens/<arch>_<b>_<d>_<p>.json]")
    parser.add_argument("--check", action="store_true", help="compare with the golden file instead of writing it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("transformers", "diffusers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    profiles = tuple(p for p in args.profiles.split(",") if p)
    if not set(profiles) <= set(PROFILES):
        parser.error(f"--profiles {args.profiles!r}: use a subset of {','.join(PROFILES)}")
    out_path = args.out or golden_path(args.arch, args.backend, args.device, args.precision)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pass_goldens_model_") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from diffusion_trt.compiler.dummy import write_dummy_pipeline

            model_dir = write_dummy_pipeline(Path(tmp) / args.arch, arch=args.arch, seed=args.seed)
            logger.info("wrote the %s dummy pipeline in %.1f s", args.arch, time.perf_counter() - start)
        golden = make_golden(model_dir, args.arch, args.backend, args.device, args.precision, seed=args.seed,
                             profiles=profiles)
    text = json.dumps(golden, indent=1, sort_keys=False) + "\n"
    if args.check:
        want = json.loads(out_path.read_text())
        diff = diff_goldens(want, golden)
        for line in diff:
            print(line)
        return 1 if diff else 0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text)
    logger.info("wrote %s in %.1f s", out_path, time.perf_counter() - start)
    return 0


def diff_goldens(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Human-readable differences of the counts (``tools`` and ``seed`` ignored); empty when equal."""
    lines: list[str] = []
    for kind in sorted(set(want["profiles"]) | set(got["profiles"])):
        wp, gp = want["profiles"].get(kind, {}), got["profiles"].get(kind, {})
        if wp.get("shape") != gp.get("shape"):
            lines.append(f"{kind}: profile {wp.get('shape')} -> {gp.get('shape')}")
        wc, gc_ = wp.get("components", {}), gp.get("components", {})
        for comp in sorted(set(wc) | set(gc_)):
            for section in ("ops", "passes"):
                a, b = wc.get(comp, {}).get(section, {}), gc_.get(comp, {}).get(section, {})
                for key in sorted(set(a) | set(b)):
                    if a.get(key) != b.get(key):
                        lines.append(f"{kind}/{comp}/{section}/{key}: {a.get(key)} -> {b.get(key)}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
