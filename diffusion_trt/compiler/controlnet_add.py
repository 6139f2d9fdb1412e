"""``add-controlnet``: add (or swap) ControlNets in an artifact that has ``unet_controlnet``, without rebuilding it.

::

    read + verify the artifact ──► same model? (source sha256) ──► compile only cond_embed_<name> and controlnet_<name>
    with the artifact's own CompileConfig (same backend, precision, profile) into a scratch artifact ──► copy the
    artifact, put the new components' files in, add their manifest entries and ``config.controlnets`` ──► reseal
    ──► swap into place

An artifact compiled before the conditioning-embedding split (its ControlNets take the image, no ``cond_embed_``)
gets split ControlNets beside its old ones; the runtime tells each apart by its input names.

The result is one sealed artifact, as if compiled with every ``--controlnet`` at once (``verify`` passes); a failure
leaves the artifact as it was.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..artifact import folder as artifacts
from ..artifact.manifest import Manifest
from ..config import CompileConfig
from ..errors import RuntimeInputError
from .controlnet import PREFIX, UNET_CONTROLNET

logger = logging.getLogger(__name__)


def add_controlnets(artifact: str | Path, model_dir: str | Path, controlnets: Sequence[tuple[str, str]], *,
                    replace: bool = False, progress: bool = False) -> Path:
    """Compile each ``(name, folder)`` as ``cond_embed_<name>`` and ``controlnet_<name>`` into ``artifact`` (resealed
    in place; a swap replaces both).

    Args:
        artifact: an artifact compiled with ``--controlnet`` (it has ``unet_controlnet``).
        model_dir: the diffusers folder the artifact was compiled from (its sha256 must match the manifest's).
        controlnets: ``(name, folder)`` pairs (:func:`~.controlnet.parse_controlnet_arg`).
        replace: swap a ControlNet the artifact has already (else refused).

    Raises:
        ArtifactError: the artifact is missing or damaged.
        RuntimeInputError: no ``unet_controlnet``, ``model_dir`` is not its source, or a name is taken and
            ``replace`` is false.
        ModelFolderError, ExportError, PassError, BuildError: as :func:`~.pipeline.compile_pipeline`.
    """
    from .pipeline import compile_pipeline

    root = Path(artifact)
    facts = Manifest.read(root)  # _merge amends a copy of its JSON (Manifest.to_json)
    comps = facts.components
    if UNET_CONTROLNET not in comps:
        raise RuntimeInputError(f"{root} has no {UNET_CONTROLNET} (the UNet with ControlNet residual inputs); "
                                "compile it once with --controlnet [NAME=]FOLDER, then add more with add-controlnet")
    taken = [n for n, _ in controlnets if PREFIX + n in comps]
    if taken and not replace:
        raise RuntimeInputError(f"{root} has the ControlNet(s) {', '.join(taken)} already; pass --replace to swap, "
                                "or choose another NAME=")
    source = facts.source_sha256
    if artifacts.folder_hash(model_dir) != source:
        raise RuntimeInputError(f"{model_dir} is not the model {root} was compiled from (source sha256 differs); pass "
                                f"that folder ({facts.source_path})")
    compiled = CompileConfig.from_json(facts.config_json)
    config = dataclasses.replace(compiled, controlnets=tuple(controlnets),
                                 components=tuple(PREFIX + n for n, _ in controlnets))
    with tempfile.TemporaryDirectory(prefix=".add-controlnet-", dir=root.parent) as scratch:
        built = compile_pipeline(model_dir, Path(scratch) / "cn", config, progress=progress, source_sha256=source)
        added = Manifest.read(built)
        with artifacts.staging_dir(root, overwrite=True) as staging:
            shutil.rmtree(staging)
            shutil.copytree(root, staging, symlinks=False)
            _merge(staging, facts, built, added, [*compiled.controlnets], controlnets)
    logger.info("added %s to %s", ", ".join(PREFIX + n for n, _ in controlnets), root)
    return root


def _merge(staging: Path, facts: Manifest, built: Path, added: Manifest, compiled: Sequence[tuple[str, str]],
           controlnets: Sequence[tuple[str, str]]) -> None:
    """Put the scratch artifact ``built``'s ControlNet components (files, entries) and ``config.controlnets`` into
    the copy ``staging`` of the artifact ``facts`` (its ControlNets so far: ``compiled``), and reseal it."""
    new = {k: v for k, v in facts.to_json().items() if k not in (artifacts.SEAL_KEY, "cache")}  # the amended copy
    for name, component in added.components.items():
        old = facts.component(name)
        if old is not None:  # a swap, in place: the previous files go
            for rel in old.files:
                new["files"].pop(rel, None)
            shutil.rmtree(staging / name, ignore_errors=True)
        shutil.copytree(built / name, staging / name)
        new["components"][name] = dict(component.spec)
        for rel in component.files:
            new["files"][rel] = artifacts.file_entry(staging, rel)
    names = {n for n, _ in controlnets}
    kept = [[n, p] for n, p in compiled if n not in names]
    new["config"] = {**facts.config_json, "controlnets": [*kept, *([n, str(p)] for n, p in controlnets)]}
    artifacts.write_manifest(staging, new)
