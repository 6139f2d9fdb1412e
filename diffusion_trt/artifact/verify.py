"""``diffusion-trt verify``: can this artifact folder be trusted, and does it run on this machine?

Two halves, each returning one line per problem (nothing raised for a problem found, so a report lists them
all):

* :func:`integrity_problems`: the manifest (JSON, schema, seal), every listed file (inside the folder,
  present, size, sha256), every component file listed, ONNX external data inside the folder (every tensor the
  ONNX spec allows, functions and subgraphs included), no symbolic link leading out, no file the manifest does
  not list, and the scheduler config's values (types, ranges).
* :func:`host_problems`: the machine: ONNX Runtime and the execution provider of the artifact's device for
  ``ort`` artifacts; for ``tensorrt`` and ``tensorrt-rtx`` artifacts, the library (importable, the plan's
  release) and the GPU's compute capability for each plan (:func:`~diffusion_trt.trt_compat.check_host`: the
  plan's one compute capability for full TensorRT; for TensorRT-RTX, one the library supports and the plan was
  built for). A target host can be given instead of this machine (checking, on a build box, what will load on a
  serving host: ``--tensorrt 1.7.1.116 --compute-capability 8.9`` needs no GPU).

Imports neither torch (except to read the GPU's facts, lazily) nor the compiler: a serving host runs it with
the runtime's dependencies alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import trt_compat
from ..errors import ArtifactError, DiffusionTrtError
from . import folder
from .manifest import control_component_problems, embedding_shape_problems
from .values import parse_json, scheduler_config_problems

logger = logging.getLogger(__name__)

#: The ONNX Runtime execution provider an ``ort`` artifact needs, per device it was compiled for.
DEVICE_PROVIDERS: dict[str, str] = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


@dataclass
class VerifyReport:
    """What :func:`verify_artifact` found.

    Attributes:
        problems: one line per problem; the artifact passes when empty.
        warnings: things that load but deserve a look (another GPU of the same compute capability...).
        checked_files: files whose size (and sha256) were checked.
        target_checked: the plans were checked against the ``trt_host`` given, not this machine.
    """

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked_files: int = 0
    #: the plans were checked against the given target host (a TensorRT artifact and ``trt_host``), not this machine
    target_checked: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


def load_manifest_json(root: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """Read ``manifest.json`` without raising: ``(manifest or None, problems)``; schema and seal checked.

    Untrusted bytes: larger than :data:`~diffusion_trt.artifact.folder.MAX_MANIFEST_BYTES`, not UTF-8, not JSON, nested
    too deep, a huge integer, a lone surrogate... are one problem line each (:func:`~diffusion_trt.artifact.folder.
    read_manifest_bytes`, :func:`~diffusion_trt.artifact.values.parse_json`), never a traceback.
    """
    path = root / folder.MANIFEST_NAME
    if root.exists() and not root.is_dir():
        return None, [f"{root}: a file, not an artifact folder; pass the folder `diffusion-trt compile` wrote"]
    if not root.is_dir():
        return None, [f"{root}: artifact folder does not exist"]
    if not path.is_file():
        return None, [f"{path}: missing; the folder is not a compiled artifact (run `diffusion-trt compile`)"]
    try:
        manifest = folder.parse_manifest(folder.read_manifest_bytes(path), path)
    except ArtifactError as e:
        return None, [str(e)]
    return manifest, folder.manifest_problems(manifest)


def scheduler_problems(root: Path, manifest: dict[str, Any]) -> list[str]:
    """The shipped scheduler config is readable JSON whose values the runtime can use with the artifact's scheduler
    class (:func:`~diffusion_trt.artifact.values.scheduler_config_problems`); one line per problem."""
    sched = manifest.get("scheduler")
    rel = sched.get("config") if isinstance(sched, dict) else None
    if not isinstance(rel, str):
        return []  # the schema problems say so
    try:
        path = folder.safe_join(root, rel)
        if not path.is_file():
            return []  # verify_files reports a missing listed file
        config = parse_json(path.read_bytes(), rel)
    except ArtifactError as e:
        return [f"scheduler: {e}"]
    except OSError as e:
        return [f"scheduler: {rel} cannot be read ({e.strerror})"]
    named = sched.get("class_name")  # the class the runtime builds (the manifest's schema: a string or null)
    class_name = named if isinstance(named, str) else None
    return [f"{p}; restore the original file or recompile" for p in scheduler_config_problems(config, rel, class_name)]


def integrity_problems(root: str | os.PathLike[str], check_hashes: bool = True) -> tuple[dict[str, Any] | None,
                                                                                          list[str], int]:
    """Everything about the folder itself, independent of the machine.

    Returns:
        ``(manifest or None when unreadable, problems, number of listed files checked)``.
    """
    root = Path(root)
    manifest, problems = load_manifest_json(root)
    if manifest is None:
        return None, problems, 0
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
        for e in files.values()
    ):
        return manifest, problems, 0  # the schema problems already say what is wrong
    problems += folder.verify_files(root, manifest, check_hashes=check_hashes)
    if isinstance(manifest.get("components"), dict) and all(
        isinstance(e, dict) for e in manifest["components"].values()
    ):
        problems += folder.component_file_problems(root, manifest)
        problems += control_component_problems({
            name: [t.get("name") for t in entry["inputs"] if isinstance(t, dict)] if isinstance(entry.get("inputs"),
                                                                                             list) else []
            for name, entry in manifest["components"].items()})
        problems += embedding_shape_problems(manifest["components"])
    problems += folder.link_problems(root)
    for rel in folder.unlisted_files(root, manifest):
        problems.append(f"{rel}: not listed in the manifest (added after compile?); remove it or recompile")
    problems += scheduler_problems(root, manifest)
    for key, rel in (("tokenizer", manifest.get("tokenizer")), ("tokenizer_2", manifest.get("tokenizer_2")),
                     ("scheduler", manifest.get("scheduler", {}).get(
            "config") if isinstance(manifest.get("scheduler"), dict) else None)):
        if isinstance(rel, str):
            try:
                folder.safe_join(root, rel)
            except ArtifactError as e:
                problems.append(f"{key}: {e}")
    return manifest, list(dict.fromkeys(problems)), len(files)


def host_problems(
    manifest: dict[str, Any],
    *,
    providers: Sequence[str] | None = None,
    trt_host: trt_compat.TrtHost | None = None,
) -> tuple[list[str], list[str]]:
    """Can this machine (or the given target) run the artifact?

    Args:
        manifest: a schema-valid manifest.
        providers: ONNX Runtime providers to assume instead of ``onnxruntime.get_available_providers()``.
        trt_host: TensorRT (or TensorRT-RTX) version and GPU to assume instead of this machine's.

    Returns:
        ``(problems, warnings)``.
    """
    backend, device = manifest.get("backend"), manifest.get("device")
    problems: list[str] = []
    warnings: list[str] = []
    if backend == "ort":
        if trt_host is not None:
            warnings.append("--tensorrt / --compute-capability: not used: an ONNX Runtime artifact holds no TensorRT "
                            "plans; this machine's ONNX Runtime providers are checked instead")
        if device == "cpu" and manifest.get("precision") == "fp16":
            problems.append("precision fp16 with device cpu: ONNX Runtime's CPU provider cannot run it; recompile")
        need = DEVICE_PROVIDERS.get(str(device))
        if providers is None:
            try:
                import onnxruntime as ort
            except ImportError:
                extra = "gpu" if device == "cuda" else "cpu"
                return [f"onnxruntime is not installed; pip install 'diffusion-trt[{extra}]'"], warnings
            providers = ort.get_available_providers()
        if need and need not in providers:
            fix = "install onnxruntime-gpu with a matching CUDA" if device == "cuda" else "install onnxruntime"
            problems.append(
                f"the artifact runs on {device} with ONNX Runtime's {need}, which this machine lacks "
                f"(available: {', '.join(providers) or 'none'}); {fix}, or recompile for --device "
                f"{'cpu' if device == 'cuda' else 'cuda'}"
            )
    elif backend in trt_compat.LIBRARIES:
        lib = trt_compat.library(str(backend))
        host = trt_host or _this_trt_host(lib, problems)
        if host is None:
            return problems, warnings
        for name, entry in sorted(manifest.get("components", {}).items()):
            if "plan" not in entry:
                continue
            where = f"engine {name!r} ({entry['plan']})"
            try:
                warnings += trt_compat.check_host(lib, entry.get("build") or {}, host, where)
            except DiffusionTrtError as e:  # ArtifactError; BuildError for an unreadable compute capability
                problems.append(str(e))
    return problems, warnings


def _this_trt_host(lib: trt_compat.TrtLibrary, problems: list[str]) -> trt_compat.TrtHost | None:
    """This machine's library version and GPU; ``None`` (with the problems noted) when nothing can be checked.

    A library that builds for named targets (TensorRT-RTX) still gets its compute-capability check when it is not
    importable here (``tensorrt`` is then ""): an unsupported GPU is the more useful news.
    """
    version = ""
    try:
        version = str(lib.import_module(ArtifactError).__version__)
    except ArtifactError as e:
        problems.append(
            f"{lib.display} is not importable here ({e.__cause__.__class__.__name__}: {e.__cause__}); plans load "
            f"only with {lib.display} on a CUDA GPU: {lib.install}, run verify on the serving host, or pass "
            "--tensorrt/--compute-capability to check against one"
        )
    facts = trt_compat.gpu_facts()
    if facts is None:
        problems.append(
            f"no CUDA GPU is visible (torch.cuda.is_available() is False); {lib.display} plans need one"
        )
        return None
    if not version and not lib.compute_capability_targets:
        return None
    return trt_compat.TrtHost(version, facts.compute_capability, facts.gpu)


def source_problems(manifest: dict[str, Any], source: str | os.PathLike[str]) -> list[str]:
    """Whether ``source`` holds the weights the artifact was compiled from: a diffusers folder's
    :func:`~diffusion_trt.artifact.folder.folder_hash` against ``source.sha256``, or a single ``.safetensors`` file's
    sha256 against ``source.single_file.sha256``. Merged LoRAs are not part of the source (the manifest lists them)."""
    src = Path(source)
    recorded = manifest.get("source", {})
    if src.is_file():
        want = recorded.get("single_file", {}).get("sha256")
        if want is None:
            return [f"--source {src} is a file, but the artifact was compiled from a diffusers folder "
                    f"({recorded.get('path', 'unknown')}); pass that folder"]
        got, what = folder.sha256_file(src), "file"
    elif src.is_dir():
        want, got, what = recorded.get("sha256"), folder.folder_hash(src), "folder"
        if recorded.get("single_file"):
            return [f"--source {src} is a folder, but the artifact was compiled from the single file "
                    f"{recorded.get('path')}; pass that file"]
    else:
        return [f"--source {src} does not exist; pass the model folder or file the artifact was compiled from"]
    if got != want:
        return [f"--source {src}: its weights differ from the ones compiled (sha256 {got[:12]}… != {str(want)[:12]}… "
                f"in the manifest); recompile from this {what}, or pass the {what} the artifact came from"]
    return []


def verify_artifact(
    root: str | os.PathLike[str],
    *,
    check_hashes: bool = True,
    check_host: bool = True,
    providers: Sequence[str] | None = None,
    trt_host: trt_compat.TrtHost | None = None,
    expect_sha256: str | None = None,
    source: str | os.PathLike[str] | None = None,
) -> VerifyReport:
    """Check an artifact folder: integrity always, this machine's compatibility unless ``check_host`` is false.

    Args:
        root: the artifact folder.
        check_hashes: compute every file's sha256 (seconds per GB); sizes are always checked.
        check_host: also check :func:`host_problems`.
        providers, trt_host: a target host to check against instead of this machine.
        expect_sha256: the manifest digest a service trusts (``manifest_sha256``); another one is a problem even
            when sealed correctly (the seal is an unkeyed sha256: it catches accidents, not intent).
        source: also check that this model folder or file holds the compiled weights (:func:`source_problems`).

    Folders an interrupted compile left beside the artifact (``.NAME.staging-*``) are reported as warnings.
    """
    manifest, problems, checked = integrity_problems(root, check_hashes=check_hashes)
    if manifest is not None:
        problems += folder.pin_problems(manifest, expect_sha256)
    report = VerifyReport(problems=problems, checked_files=checked, warnings=folder.leftover_warnings(root))
    schema_ok = manifest is not None and not folder.manifest_problems(manifest)
    if source is not None and schema_ok and manifest is not None:
        report.problems += source_problems(manifest, source)
    if check_host and schema_ok and manifest is not None:
        host, warnings = host_problems(manifest, providers=providers, trt_host=trt_host)
        report.problems += host
        report.warnings += warnings
        report.target_checked = trt_host is not None and manifest.get("backend") in trt_compat.LIBRARIES
    return report
