"""``compile_model``: what ``diffusion-trt compile`` calls around :func:`~.pipeline.compile_pipeline`.

    MODEL (a diffusers folder, or one .safetensors checkpoint)
        ──identify: folder hash / file sha256 + detected architecture──► cache key (compiler/cache.py)
        ──hit──► the cached artifact, re-verified, written to OUT with a resealed manifest
        ──miss──► (single file: convert to a diffusers folder in a temporary folder, compiler/single_file.py)
                  ──compile_pipeline──► OUT ──► stored in the cache
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ..artifact import folder as artifacts
from ..artifact.manifest import amend_source
from ..config import CompileConfig
from ..errors import ModelFolderError, OutputPathError
from . import export, hub, pipeline
from .cache import CompileCache, UnprovenEntry, cache_key, mark_stored, uncacheable

logger = logging.getLogger(__name__)


def _source_identity(model: Path, config: CompileConfig, prediction_type: str) -> tuple[dict[str, Any], Any]:
    """(what identifies the weights, the CheckpointInfo of a single file or ``None``), after the cheap checks.

    Raises:
        ModelFolderError: as :func:`~.export.check_model_folder` / :func:`~.single_file.inspect_checkpoint`.
    """
    if model.is_file():
        from .single_file import inspect_checkpoint

        info = inspect_checkpoint(model, prediction_type)
        return {"kind": "single_file", "sha256": artifacts.sha256_file(model), "checkpoint": info.to_json()}, info
    folder = export.check_model_folder(model, trust_pickle=config.trust_pickle)
    if prediction_type != "auto":
        logger.warning("--prediction-type %s: no effect on a diffusers folder (its scheduler/scheduler_config.json "
                       "sets the prediction type; edit that instead)", prediction_type)
    return {"kind": "folder", "sha256": artifacts.folder_hash(folder.path)}, None


def _record_single_file(out: Path, model: Path, source: dict[str, Any]) -> None:
    """Name the single file an artifact came from in its manifest (resealed): the converted folder was temporary."""
    manifest = artifacts.read_manifest(out)
    amend_source(manifest, path=str(model.resolve()),
                 single_file={"sha256": source["sha256"], **source["checkpoint"]})
    artifacts.write_manifest(out, manifest)


def _compile_model_id(model_id: str, out: Path, config: CompileConfig | None, revision: str | None,
                      variant: str | None, **kwargs: Any) -> Path:
    """:func:`compile_model` of a Hub id: its snapshot compiled as a folder; ``source.hub`` and ``source.path`` (the
    snapshot) recorded in the manifest (resealed)."""
    resolved = hub.snapshot_for(model_id, revision, variant)
    logger.info("%s (revision %s%s): snapshot %s", model_id, revision or "main",
                f", variant {variant}" if variant else "", resolved.snapshot)
    with hub.plain_folder(resolved) as folder:
        compile_model(folder, out, config, **kwargs)
    manifest = artifacts.read_manifest(out)
    amend_source(manifest, path=str(resolved.snapshot), hub=resolved.record())
    artifacts.write_manifest(out, manifest)
    return out
def _materialize(cache: CompileCache, cached: Path, out: Path, key: str, model: Path, config: CompileConfig,
                 overwrite: bool, lock_timeout: float) -> bool:
    """Write the cache hit ``cached`` to ``out``; False (a warning, nothing written) when its entry no longer proves
    its origin: its manifest was replaced after :meth:`~.cache.CompileCache.lookup` proved it."""
    pipeline.deterministic_pass_options(config)  # its "no effect" warning, which compile_pipeline would log
    if model.is_dir():  # what compile_pipeline's prepare says of settings cut back or without effect, from the configs
        pipeline.replay_model_warnings(model, config)
    try:
        cache.materialize(cached, out, key, str(model.resolve()), overwrite=overwrite, lock_timeout=lock_timeout)
    except UnprovenEntry as e:
        logger.warning("compile cache entry %s %s: compiling anew", key[:12], e)
        return False
    return True


def compile_model(
    model: str | Path,
    out_dir: str | Path,
    config: CompileConfig | None = None,
    *,
    cache: CompileCache | None = None,
    prediction_type: str = "auto",
    overwrite: bool = False,
    progress: bool = False,
    lock_timeout: float = 0.0,
    revision: str | None = None,
    variant: str | None = None,
) -> Path:
    """Compile a diffusers folder, a single-file checkpoint or a Hugging Face model id, reusing an identical earlier
    compile from ``cache``.

    Args:
        model: a diffusers pipeline folder, an A1111 / ComfyUI ``.safetensors`` checkpoint (see
            :mod:`~.single_file`; converted offline into a temporary diffusers folder), or a Hugging Face model id
            ``org/name`` that is no path here (see :mod:`~.hub`; the local cache only with ``HF_HUB_OFFLINE=1``).
        revision, variant: model ids only: the branch / tag / commit, and the weights variant (``"fp16"``).
        out_dir, config, overwrite, progress, lock_timeout: as :func:`~.pipeline.compile_pipeline`.
        cache: the compile cache, or ``None`` for none (``--no-cache``).
        prediction_type: single files: "auto", "epsilon" or "v_prediction" (no effect on a folder: warned).

    Returns:
        ``out_dir`` as a Path; its manifest's ``cache`` says whether it came from the cache.

    Raises:
        ModelFolderError: the model folder or single file cannot be used (named, with the reason); a model id not
            found (offline: not in the cache); ``revision`` / ``variant`` with a path.
        RuntimeInputError: an unknown ``prediction_type``; and as :func:`~.pipeline.compile_pipeline`.
        ExportError, PassError, BuildError, ArtifactError: as :func:`~.pipeline.compile_pipeline`.
    """
    if hub.is_model_id(model):
        return _compile_model_id(str(model), Path(out_dir), config, revision, variant, cache=cache,
                                 overwrite=overwrite, progress=progress, lock_timeout=lock_timeout)
    if revision is not None or variant is not None:
        raise ModelFolderError(f"--revision / --variant apply to a Hugging Face model id (org/name); {model} is a "
                               "path: drop them")
    model, out = Path(model), Path(out_dir)
    config = config or CompileConfig()
    t0 = time.perf_counter()
    if model.is_file() and out.is_dir() and any(out.iterdir()) and not overwrite:  # before converting it
        raise OutputPathError(f"output folder {out} already exists; pass --overwrite or choose another -o")
    source, info = _source_identity(model, config, prediction_type)
    if info is None:
        pipeline.check_output_folder(out, model)
    why = uncacheable(config) if cache is not None else "--no-cache"
    key, facts = cache_key(source, config) if not why else ("", {})
    if why:
        logger.debug("compile cache not used: %s", why)
    cached = cache.lookup(key) if cache is not None and key else None
    if cached is not None and _materialize(cache, cached, out, key, model, config, overwrite, lock_timeout):
        logger.info("compile cache hit %s: reused %s in %.1f s (no export, passes or build)", key[:12], cached,
                    time.perf_counter() - t0)
        return out
    if info is None:  # the folder's hash is the cache key's: not read and hashed a second time
        pipeline.compile_pipeline(model, out, config, overwrite=overwrite, progress=progress,
                                  lock_timeout=lock_timeout, source_sha256=source["sha256"])
    else:
        from .single_file import folder_from_single_file

        pipeline.check_before_conversion(config, info.facts)  # not after minutes of conversion
        tmp = Path(tempfile.mkdtemp(prefix="diffusion-trt-single-file-"))
        try:
            folder = folder_from_single_file(model, info, tmp / model.stem)
            pipeline.compile_pipeline(folder, out, config, overwrite=overwrite, progress=progress,
                                      lock_timeout=lock_timeout, preflight_done=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _record_single_file(out, model, source)
    if cache is not None and key:
        mark_stored(out, key)
        cache.store(key, facts, out)
    return out
