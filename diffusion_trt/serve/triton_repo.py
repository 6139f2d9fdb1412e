"""``diffusion-trt export-triton``: a Triton model repository for a stock Triton Inference Server.

::

    REPO_DIR/
      <prefix>text_encoder/config.pbtxt   1/model.onnx (or model.plan)    one model per engine
      <prefix>unet/ ...
      <prefix>vae_decoder/ ...
      <prefix>pipeline/config.pbtxt       Python backend (BLS): 1/model.py, 1/pipeline.json,
                                          1/tokenizer/, 1/scheduler_config.json, 1/prompts/ (the runtime's
                                          float_range.py, prompt_syntax.py and prompt_encoding.py, copied: long
                                          and weighted prompts)

Engine models: ``platform: "onnxruntime_onnx"`` for ``ort`` artifacts, ``"tensorrt_plan"`` for ``tensorrt``
ones; inputs and outputs with the manifest's dtypes and dims. Every SD engine has its batch symbol (``B``
or ``B2``) first on every tensor, so it is exported with ``max_batch_size`` = that symbol's profile maximum,
the batch dim left out of ``dims`` and ``dynamic_batching`` on (Triton merges concurrent calls of equal
shapes); other symbols become ``-1``. A model whose tensors do not share a leading batch symbol gets
``max_batch_size: 0`` and full dims. ``instance_group`` is ``KIND_GPU`` for ``cuda`` artifacts and ``KIND_CPU``
for ``cpu`` ones; the pipeline model runs its loop on the CPU and calls the engines through BLS.

The artifact is verified (sha256 and all) before anything is copied; files are hard-linked when the
repository is on the same file system, else copied.

Models are written into a staging folder and moved into place at the end, so a failure part way leaves the
repository as it was. Triton takes every sub-folder of the repository for a model, hidden ones too (its repository
poll lists directories and skips none by name), so the staging folder is *outside* it:
``.<REPO_DIR name>.diffusion-trt-export-<pid>-<random>`` beside ``REPO_DIR``, on the same file system (one rename per
model). Only when ``REPO_DIR`` is a mount point (its parent on another file system) or its parent cannot be written
is it staged inside (``REPO_DIR/.diffusion-trt-export-<pid>-<random>``), with a warning. What a killed export left
in either place is removed by the next export (a ``warning:`` line names it) unless its pid still runs.

TensorRT-RTX artifacts are refused (exit 2): Triton's TensorRT backend (``tensorrt_plan``) deserializes plans with
TensorRT's ``libnvinfer``, and a TensorRT-RTX plan loads only in the TensorRT-RTX runtime, which no Triton backend
links; serve them with ``diffusion-trt serve`` (the runtime inside PyTriton), or compile with ``--backend tensorrt``
or ``ort`` for a Triton repository.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePath
from typing import Any

from ..artifact import folder as artifacts
from ..artifact.manifest import Backend, Manifest
from ..errors import ArtifactError, OutputPathError, RuntimeInputError
from . import triton_model

logger = logging.getLogger(__name__)

#: Manifest dtype -> Triton model-config data type.
TRITON_TYPES: dict[str, str] = {
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "bfloat16": "TYPE_BF16",
    "int64": "TYPE_INT64",
    "int32": "TYPE_INT32",
    "int8": "TYPE_INT8",
    "uint8": "TYPE_UINT8",
    "bool": "TYPE_BOOL",
}
PLATFORMS: dict[str, str] = {"ort": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}
#: The staging folder's name: beside REPO_DIR (``.<repo name>`` first) or, failing that, inside it (see the module
#: docstring); ``<pid>`` is absent in those of versions before the pid was recorded.
STAGING_PREFIX = ".diffusion-trt-export-"
BATCH_SYMBOLS = ("B", "B2")
#: Engines the text-to-image pipeline model calls.
PIPELINE_ENGINES: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder")


def _quote(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid protobuf text-format string


def batch_symbol(entry: Mapping[str, Any]) -> str | None:
    """The batch symbol every input and output of an engine starts with, or ``None`` if they do not share one."""
    firsts = {t["shape"][0] if t["shape"] else None for t in [*entry["inputs"], *entry["outputs"]]}
    if len(firsts) == 1:
        (first,) = firsts
        if first in BATCH_SYMBOLS:
            return str(first)
    return None


def _tensor_block(t: Mapping[str, Any], batched: bool) -> str:
    dims = [d if isinstance(d, int) else -1 for d in t["shape"]]
    reshape = ""
    if batched:
        dims = dims[1:]
        if not dims:  # a [B] tensor: Triton wants dims [1], reshaped to [] for the model
            dims, reshape = [1], " reshape: { shape: [ ] }"
    dtype = TRITON_TYPES.get(t["dtype"])
    if dtype is None:
        raise ArtifactError(f"tensor {t['name']!r} has dtype {t['dtype']!r}, which Triton has no type for")
    return (f"  {{ name: {_quote(t['name'])} data_type: {dtype} dims: [ {', '.join(map(str, dims))} ]"
            f"{reshape} }}")


def engine_config(name: str, entry: Mapping[str, Any], backend: str, device: str, *, instances: int = 1,
                  max_queue_delay_us: int = 2000) -> str:
    """``config.pbtxt`` text of one engine model.

    Args:
        name: the Triton model name.
        entry: the manifest's component entry (``inputs``/``outputs`` with ``shape`` and ``max``).
        backend: "ort" or "tensorrt"; device: "cpu" or "cuda".
        instances: model instances (per GPU for KIND_GPU).
        max_queue_delay_us: how long the dynamic batcher waits to merge requests.
    """
    symbol = batch_symbol(entry)
    max_batch = 0
    if symbol is not None:
        max_batch = int(entry["inputs"][0]["max"][0])
    lines = [
        f"name: {_quote(name)}",
        f"platform: {_quote(PLATFORMS[backend])}",
        f"max_batch_size: {max_batch}",
        "input [",
        ",\n".join(_tensor_block(t, symbol is not None) for t in entry["inputs"]),
        "]",
        "output [",
        ",\n".join(_tensor_block(t, symbol is not None) for t in entry["outputs"]),
        "]",
        f"instance_group [ {{ count: {instances} kind: {'KIND_GPU' if device == 'cuda' else 'KIND_CPU'} }} ]",
    ]
    if max_batch:
        lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {max_queue_delay_us} }}")
    return "\n".join(lines) + "\n"


def pipeline_config(name: str, *, instances: int = 1, max_queue: int = 64, queue_timeout_s: float = 60.0) -> str:
    """``config.pbtxt`` text of the Python-backend pipeline model (request layout: :mod:`.triton_model`).

    Its queue is bounded (``dynamic_batching`` with a ``default_queue_policy``; with ``max_batch_size: 0`` each
    execution still gets one request): beyond ``max_queue`` waiting requests Triton answers UNAVAILABLE (HTTP 503),
    and a request that waited ``queue_timeout_s`` (0 = no limit; a client's ``timeout`` parameter overrides it) is
    rejected with UNAVAILABLE instead of being run. The engine models need no bound of their own: only the
    pipeline's ``instances`` call them.
    """
    timeout_us = int(queue_timeout_s * 1e6)
    inputs = []
    for field, (_kinds, triton_type) in triton_model.FIELDS.items():
        dtype = "TYPE_STRING" if triton_type == "BYTES" else f"TYPE_{triton_type}"
        optional = "" if field == "prompt" else " optional: true"
        inputs.append(f"  {{ name: {_quote(field)} data_type: {dtype} dims: [ 1 ]{optional} }}")
    return "\n".join([
        f"name: {_quote(name)}",
        'backend: "python"',
        "max_batch_size: 0",
        "input [",
        ",\n".join(inputs),
        "]",
        "output [",
        '  { name: "image" data_type: TYPE_UINT8 dims: [ -1, -1, 3 ] }',
        "]",
        f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]",
        "dynamic_batching {",
        f"  default_queue_policy {{ timeout_action: REJECT default_timeout_microseconds: {timeout_us}"
        f" allow_timeout_override: true max_queue_size: {int(max_queue)} }}",
        "}",
    ]) + "\n"


def request_facts(manifest: Manifest, limits: Mapping[str, float] | None = None) -> dict[str, Any]:
    """What :func:`~.triton_model.parse_request` checks a request against (its ``config``): the model facts, the
    profile, the bounds (``limits`` over :data:`~.triton_model.DEFAULT_LIMITS`) and the defaults of the artifact's
    pipeline kind (:func:`~diffusion_trt.runtime.generation_args.serve_defaults`: SDXL's guidance is 5.0)."""
    from ..runtime.generation_args import serve_defaults

    return {
        "model": manifest.model_json,
        "profile": manifest.profile_json,
        "limits": {**triton_model.DEFAULT_LIMITS, **(limits or {})},
        "defaults": serve_defaults(manifest.model.architecture),
    }


def pipeline_facts(manifest: Manifest, models: Mapping[str, str],
                   limits: Mapping[str, float] | None = None) -> dict[str, Any]:
    """``pipeline.json`` for the pipeline model: model facts, profile, engine model names and tensor dtypes, and
    the request bounds and defaults (:func:`request_facts`)."""
    return {
        "artifact": manifest.name,
        "manifest_sha256": manifest.seal,
        **request_facts(manifest, limits),
        "models": dict(models),
        "dtypes": {c: manifest.components[c].dtypes for c in PIPELINE_ENGINES},
        "embedding_vectors": _embedding_rows(manifest),
        **_prompt_facts(manifest),
    }


def _prompt_facts(manifest: Manifest) -> dict[str, Any]:
    """How the BLS loop chunks prompts: ``max_prompt_chunks`` (the UNet's ``encoder_hidden_states`` takes 77 * k
    tokens for k up to it) and ``text_encoder_rows`` (the text encoder's batch range [min, max], which the chunks'
    rows are split and padded to)."""
    unet, text = manifest.component("unet"), manifest.component("text_encoder")
    context = next(t for t in unet.spec["inputs"] if t["name"] == "encoder_hidden_states")  # type: ignore[union-attr]
    ids = next(t for t in text.spec["inputs"] if t["name"] == "input_ids")  # type: ignore[union-attr]
    length = int(ids["shape"][1])
    return {"max_prompt_chunks": max(1, int(context["max"][1]) // length),
            "text_encoder_rows": [int(ids["min"][0]), int(ids["max"][0])]}


def _embedding_rows(manifest: Manifest) -> list[int] | None:
    """The text encoder's textual-inversion rows ``[N, D]`` per text (the BLS loop feeds zeros: it takes no
    embeddings); ``None`` for artifacts compiled without them."""
    text_encoder = manifest.component("text_encoder")
    inputs = text_encoder.spec.get("inputs", []) if text_encoder is not None else []
    return next((list(t["shape"][1:]) for t in inputs if t["name"] == "embedding_vectors"), None)


def _place(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _refuse_overlap(root: Path, repo: Path, folders: Iterable[Path]) -> None:
    """Refuse a repository inside the artifact, or inside any other artifact (they are sealed: verify then fails on the
    files their manifest does not list), or a model folder that is or holds the artifact (it would be deleted before
    the engines are copied out of it).

    Raises:
        OutputPathError: naming both folders and the fix.
    """
    artifact = root.resolve()
    inside = repo.resolve() == artifact or artifact in repo.resolve().parents
    if inside or any(f.resolve() == artifact or f.resolve() in artifact.parents for f in folders):
        raise OutputPathError(f"REPO_DIR {repo} overlaps the artifact {root}; write the Triton repository elsewhere "
                              "(e.g. model_repository)")
    other = artifacts.enclosing_artifact(repo)
    if other is not None:
        raise OutputPathError(f"REPO_DIR {repo} lies inside the artifact folder {other}, which is sealed: its manifest "
                              "lists every file, and verify reports any other; write the Triton repository elsewhere "
                              "(e.g. model_repository)")


def _write_engine_models(root: Path, manifest: Manifest, folders: Mapping[str, Path], names: Mapping[str, str],
                         instances: int, max_queue_delay_us: int) -> None:
    """One model folder per engine (``folders[names[component]]``): ``1/`` with the engine file(s) and a config."""
    backend, device = manifest.backend, manifest.device
    for component, entry in manifest.components.items():
        folder = folders[names[component]]
        engine_rel = str(entry.plan if backend is Backend.TENSORRT else entry.onnx)
        version = folder / "1"
        _place(artifacts.safe_join(root, engine_rel), version / PurePath(engine_rel).name)
        if backend is Backend.ORT:  # external data sits beside the model under the name the model refers to
            for rel in entry.files:
                if rel != engine_rel and not rel.endswith(".plan"):
                    _place(artifacts.safe_join(root, rel), version / PurePath(rel).name)
        text = engine_config(names[component], entry.spec, backend, device, instances=instances,
                             max_queue_delay_us=max_queue_delay_us)
        (folder / "config.pbtxt").write_text(text, encoding="utf-8")


def _write_pipeline_model(root: Path, manifest: Manifest, folder: Path, names: Mapping[str, str],
                          max_queue: int, queue_timeout_s: float) -> None:
    """The BLS pipeline model in ``folder``: ``1/`` with model.py, prompts/, tokenizer/, scheduler_config.json,
    pipeline.json."""
    from ..runtime import float_range, prompt_encoding, prompt_syntax

    version = folder / "1"
    (version / triton_model.PROMPT_MODULES).mkdir(parents=True)
    shutil.copy2(Path(triton_model.__file__), version / "model.py")
    for module in (float_range, prompt_syntax, prompt_encoding):  # the runtime's own code: prompts read alike
        shutil.copy2(Path(module.__file__), version / triton_model.PROMPT_MODULES / Path(module.__file__).name)
    shutil.copytree(artifacts.safe_join(root, manifest.tokenizer), version / "tokenizer")
    shutil.copy2(artifacts.safe_join(root, manifest.scheduler_config), version / "scheduler_config.json")
    facts = pipeline_facts(manifest, {c: names[c] for c in PIPELINE_ENGINES})
    (version / "pipeline.json").write_text(json.dumps(facts, indent=2) + "\n", encoding="utf-8")
    text = pipeline_config(folder.name, max_queue=max_queue, queue_timeout_s=queue_timeout_s)
    (folder / "config.pbtxt").write_text(text, encoding="utf-8")


def _refuse_backend(root: Path, manifest: Manifest) -> None:
    """Refuse an artifact whose engines no Triton backend loads (see the module docstring).

    Raises:
        RuntimeInputError: a TensorRT-RTX artifact, or any backend without a Triton platform (exit 2).
    """
    backend = manifest.backend
    if backend is Backend.TENSORRT_RTX:
        raise RuntimeInputError(
            f"{root} is a TensorRT-RTX artifact: Triton's TensorRT backend loads plans with TensorRT (libnvinfer), "
            "and a TensorRT-RTX plan needs the TensorRT-RTX runtime, which no Triton backend has; serve it with "
            "`diffusion-trt serve`, or compile with --backend tensorrt (or ort) for a Triton repository"
        )
    if backend not in PLATFORMS:
        raise RuntimeInputError(f"{root} has backend {backend!r}, which no Triton platform serves; export an "
                                f"artifact of backend {' or '.join(PLATFORMS)}")


def _refuse_in_the_way(folders: Iterable[Path], overwrite: bool) -> None:
    """Refuse, before anything is changed, what stands where a model folder goes: a file, a symbolic link or a
    folder that is no Triton model (no ``config.pbtxt``: with ``--overwrite`` too: a model folder is replaced whole,
    never written through a link or swapped for one, and never replaces a folder of something else, such as a
    diffusers folder's ``unet/``), and existing model folders without ``overwrite``.

    Raises:
        OutputPathError: naming every such path and the fix.
    """
    folders = list(folders)
    links = [f"{p} (to {os.readlink(p)})" for p in folders if p.is_symlink()]
    if links:
        raise OutputPathError(f"{', '.join(links)}: a symbolic link where a model folder goes; export-triton replaces "
                              "model folders whole and does not replace links: remove the link or use --prefix "
                              "(nothing was changed)")
    in_the_way = [str(p) for p in folders if p.exists() and not p.is_dir()]
    if in_the_way:
        raise OutputPathError(f"{', '.join(in_the_way)}: a file where a model folder goes; remove it or use --prefix")
    clash = [str(p) for p in folders if p.exists()]
    if clash and not overwrite:
        raise OutputPathError(f"model folder(s) {', '.join(clash)} exist; pass --overwrite or use --prefix")
    foreign = [str(p) for p in folders if p.is_dir() and any(p.iterdir()) and not (p / "config.pbtxt").is_file()]
    if foreign:  # REPO_DIR a diffusers folder: --overwrite replaced its unet/ and text_encoder/ (the weights) whole
        raise OutputPathError(f"{', '.join(foreign)}: a folder that is no Triton model (no config.pbtxt) where a "
                              "model folder goes; --overwrite replaces only models (is REPO_DIR the right folder?): "
                              "choose another REPO_DIR or use --prefix (nothing was changed)")


def _staging_folder(repo: Path) -> Path:
    """A new staging folder for ``repo``'s models, beside it on the same file system (Triton ignores it there), else
    inside it with a warning; the leftovers of killed exports in both places are removed first."""
    real = repo.resolve()
    inside = re.compile(rf"{re.escape(STAGING_PREFIX)}(?:(?P<pid>\d+)-)?[A-Za-z0-9_]+")
    beside = re.compile(rf"\.{re.escape(real.name)}{re.escape(STAGING_PREFIX)}(?P<pid>\d+)-[A-Za-z0-9_]+")
    what = "an interrupted export-triton (Triton would try to load a folder inside the repository as a model)"
    artifacts.remove_dead_leftovers(real, inside, what)
    artifacts.remove_dead_leftovers(real.parent, beside, what)
    parent = real.parent
    try:
        if parent.stat().st_dev == real.stat().st_dev:
            return Path(tempfile.mkdtemp(prefix=f".{real.name}{STAGING_PREFIX}{os.getpid()}-", dir=parent))
        why = f"{real} is a mount point: its parent {parent} is another file system"
    except OSError as e:
        why = f"{parent} cannot be written ({e.strerror})"
    logger.warning("staging the models inside %s (%s): if this export is killed, remove %s%s* from it before "
                   "starting tritonserver (the next export removes it)", real, why, STAGING_PREFIX, os.getpid())
    return Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=real))


def export_triton_repository(
    artifact_dir: str | os.PathLike[str],
    repo_dir: str | os.PathLike[str],
    *,
    prefix: str = "",
    instances: int = 1,
    max_queue_delay_us: int = 2000,
    overwrite: bool = False,
    max_queue: int = 64,
    queue_timeout_s: float = 60.0,
) -> dict[str, Path]:
    """Write a Triton model repository serving the artifact (see the module docstring).

    Args:
        artifact_dir: a compiled artifact (verified first).
        repo_dir: the repository; created, or added to (models of other artifacts stay) when it exists.
        prefix: prepended to every model name, so one repository can hold several artifacts.
        instances: instances per engine model.
        max_queue_delay_us: the engines' dynamic-batching delay.
        overwrite: replace models of the same names that already exist.
        max_queue, queue_timeout_s: the pipeline model's queue bound (see :func:`pipeline_config`).

    Returns:
        Model name -> model folder.

    Raises:
        ArtifactError: the artifact fails verification or lacks an engine.
        RuntimeInputError: an SDXL or inpainting artifact (the Triton pipeline model runs the SD text-to-image loop);
            a TensorRT-RTX artifact (no Triton backend loads its plans).
        OutputPathError: a model folder exists without ``overwrite``; a file or a symbolic link stands where a model
            folder goes;
            ``repo_dir`` is or lies inside the artifact, or a model folder holds it. Nothing is changed then, nor
            when writing fails part way (models are written aside and moved into place at the end).
    """
    root = Path(artifact_dir)
    repo = Path(repo_dir)
    manifest = Manifest.from_json(artifacts.load_verified(root))
    _refuse_backend(root, manifest)
    if manifest.model.architecture != "sd":  # a usage error (exit 2), not a damaged artifact
        raise RuntimeInputError(
            f"{root} is an {manifest.model.architecture} artifact; the Triton pipeline model runs the SD 1.x/2.x "
            "loop only: run SDXL artifacts with EnginePipeline (Python) or diffusion-trt run"
        )
    model = manifest.model
    if model.is_inpainting:
        raise RuntimeInputError(
            f"{root} is an inpainting artifact (UNet with {model.unet_in_channels} input channels); the Triton "
            "pipeline model runs text-to-image only: serve it with EnginePipeline (Python) or diffusion-trt run"
        )
    if prefix and not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):  # a model name is one folder of the repository
        raise RuntimeInputError(f"prefix={prefix!r} would make model names Triton cannot load; use letters, digits, "
                                "'_', '.' or '-' (e.g. sd15_ink_)")
    names = {c: f"{prefix}{c}" for c in manifest.components}
    pipeline_name = f"{prefix}pipeline"
    folders = {n: repo / n for n in [*names.values(), pipeline_name]}
    _refuse_overlap(root, repo, folders.values())
    _refuse_in_the_way(folders.values(), overwrite)
    repo.mkdir(parents=True, exist_ok=True)
    # every model is written into a staging folder outside the repository (Triton would load one inside), then moved
    # into place: a failure part way leaves the repository as it was
    staging = _staging_folder(repo)
    try:
        staged = {n: staging / n for n in folders}
        _write_engine_models(root, manifest, staged, names, instances, max_queue_delay_us)
        _write_pipeline_model(root, manifest, staged[pipeline_name], names, max_queue, queue_timeout_s)
        for name, folder in folders.items():
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(staged[name], folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("wrote Triton models %s to %s", ", ".join(folders), repo)
    return folders

