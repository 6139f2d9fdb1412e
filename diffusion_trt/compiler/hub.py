"""``compile org/name``: a Hugging Face model id, resolved to a local pipeline folder as diffusers'
``from_pretrained`` resolves it.

:func:`snapshot_for` asks diffusers' own ``DiffusionPipeline.download`` (what ``from_pretrained`` calls: the files
``model_index.json`` names, ``--variant`` files picked as diffusers picks them, ``--revision`` a branch, tag or
commit). With ``HF_HUB_OFFLINE=1`` (or ``local_files_only``) nothing is fetched: the revision is read from the local
Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; layout
``models--org--name/snapshots/<commit>/...``, ``refs/<branch>``). The snapshot's folder name is the resolved commit.

A ``--variant fp16`` snapshot holds ``diffusion_pytorch_model.fp16.safetensors`` (and ``model.fp16.safetensors``);
:func:`plain_folder` links it into a temporary folder under the names a plain folder has (the variant file where
there is one, else the plain file, as diffusers falls back), which the compile reads like any other folder. The
manifest's ``source.hub`` records ``{"id", "revision", "commit", "variant"}``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelFolderError

logger = logging.getLogger(__name__)

#: ``org/name`` as the Hub spells repository ids (one slash; letters, digits, ``-``, ``_``, ``.``).
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


@dataclass(frozen=True)
class HubModel:
    """A model id resolved to a local snapshot.

    Attributes:
        id: ``org/name``.
        revision: what was asked (``None`` = ``main``).
        commit: the snapshot's commit (40 hex digits).
        variant: ``"fp16"`` or ``None``.
        snapshot: the snapshot folder in the Hugging Face cache.
    """

    id: str
    revision: str | None
    commit: str
    variant: str | None
    snapshot: Path

    def record(self) -> dict[str, Any]:
        """The manifest's ``source.hub``."""
        return {"id": self.id, "revision": self.revision or "main", "commit": self.commit, "variant": self.variant}


def is_model_id(model: str | os.PathLike[str]) -> bool:
    """Whether ``model`` is to be read as a Hub id: ``org/name`` and no such path exists here."""
    text = os.fspath(model)
    return bool(MODEL_ID.match(text)) and not Path(text).exists()


def snapshot_for(model_id: str, revision: str | None = None, variant: str | None = None) -> HubModel:
    """The local snapshot of ``model_id`` at ``revision`` (downloaded unless offline), as ``from_pretrained`` finds it.

    Raises:
        ModelFolderError: not in the cache when offline (naming the cache folder and the fix), not found on the
            Hub, or not a diffusers pipeline (no ``model_index.json``).
    """
    from diffusers import DiffusionPipeline
    from huggingface_hub import constants

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        path = Path(DiffusionPipeline.download(model_id, revision=revision, variant=variant,
                                               local_files_only=offline))
    except (OSError, ValueError) as e:
        where = f"the Hugging Face cache {constants.HF_HUB_CACHE}"
        hint = ("HF_HUB_OFFLINE=1: download it first (huggingface-cli download "
                f"{model_id}{' --revision ' + revision if revision else ''}) or unset HF_HUB_OFFLINE"
                if offline else "check the id and --revision, and that the Hub is reachable")
        # an id is also a relative path: a mistyped folder lands here, so say that no such folder exists either
        raise ModelFolderError(f"model {model_id!r}: there is no folder {os.path.abspath(model_id)}, and as a Hugging "
                               f"Face model id (revision {revision or 'main'}) it is not in {where}"
                               f"{'' if offline else ' and could not be downloaded'}: {hint}") from e
    if not (path / "model_index.json").is_file():
        raise ModelFolderError(f"model {model_id!r}: {path} has no model_index.json; it is not a diffusers pipeline")
    commit = path.name if _COMMIT.match(path.name) else ""
    if not commit:
        raise ModelFolderError(f"model {model_id!r}: {path} is not a Hugging Face cache snapshot (snapshots/<commit>)")
    return HubModel(model_id, revision, commit, variant, path)


@contextlib.contextmanager
def plain_folder(model: HubModel) -> Iterator[Path]:
    """The snapshot as a plain diffusers folder: the snapshot itself without a variant; with one, a temporary
    folder of hard links (copies across file systems) named as a plain folder names them, removed afterwards.

    A component without variant files keeps its plain ones (diffusers' fallback); one with neither fails in the
    compile's folder check, naming the folder.
    """
    if model.variant is None:
        yield model.snapshot
        return
    tmp = Path(tempfile.mkdtemp(prefix="diffusion-trt-hub-"))
    try:
        dest = tmp / model.id.replace("/", "--")
        for src in sorted(p for p in model.snapshot.rglob("*") if p.is_file()):
            rel = src.relative_to(model.snapshot)
            name = _plain_name(rel.name, model.variant)
            target = dest / rel.parent / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if name != rel.name:  # the variant file: it wins over the plain one (from_pretrained's pick)
                target.unlink(missing_ok=True)
            elif target.exists():
                continue
            _link(src.resolve(), target)
        yield dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _plain_name(name: str, variant: str) -> str:
    """``x.fp16.safetensors`` -> ``x.safetensors``; other names as they are."""
    for suffix in _WEIGHT_SUFFIXES:
        if name.endswith(f".{variant}{suffix}"):
            return name.removesuffix(f".{variant}{suffix}") + suffix
    return name


def _link(src: Path, target: Path) -> None:
    try:
        os.link(src, target)
    except OSError:
        shutil.copy2(src, target)
