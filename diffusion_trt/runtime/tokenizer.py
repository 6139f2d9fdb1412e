"""CLIP tokenization from the artifact's ``tokenizer.json``, through the ``tokenizers`` library alone.

Importing transformers costs seconds on a host with a large site-packages (its version checks read the metadata of
every installed distribution: 4-5 s of the first image on the H200 host, benchmarks/results/README.md, seventh
session), so the runtime does not import it to tokenize. The artifact's tokenizer folder holds the ``tokenizer.json``
that transformers serialises for ``CLIPTokenizer`` (written by ``compile``,
:func:`diffusion_trt.compiler.pipeline.ensure_tokenizer_json`, when the model's folder has none): since
transformers 5, ``CLIPTokenizer`` *is* that ``tokenizers`` BPE (NFC, whitespace collapsed, lower case; CLIP's split
pattern; byte-level BPE with ``</w>``; ``[BOS] ids [EOS]``), so the ids are the ones diffusers gets, text for text.
(transformers 4's Python ``CLIPTokenizer`` without ftfy put spaces around CJK characters and could differ on such
text.)

:class:`ClipTokenizer` answers the calls the runtime makes of a ``CLIPTokenizer`` (``tok(text,
add_special_tokens=..., truncation=..., padding="max_length", max_length=..., return_tensors="pt").input_ids``,
``model_max_length``, ``bos/eos/pad_token_id``) and nothing else. An artifact compiled before ``tokenizer.json``
was written loads transformers' ``CLIPTokenizer`` as before (:func:`load_tokenizer`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ArtifactError


@dataclass(frozen=True)
class Encoding:
    """What a tokenizer call returns: ``input_ids``, a list of ids (one text), a list of lists (several), or an int64
    tensor [N, L] (``return_tensors="pt"``)."""

    input_ids: Any


class ClipTokenizer:
    """A CLIP tokenizer over a ``tokenizers.Tokenizer`` (see the module docstring).

    Args:
        backend: the ``tokenizers.Tokenizer`` of the artifact's ``tokenizer.json``.
        config: the folder's ``tokenizer_config.json`` (``model_max_length``, ``bos_token``, ``eos_token``,
            ``pad_token``: strings, or transformers 4's ``{"content": ...}`` objects).

    Raises:
        ArtifactError: a special token the vocabulary lacks, or a missing/invalid ``model_max_length``.
    """

    def __init__(self, backend: Any, config: Mapping[str, Any]) -> None:
        self._backend = backend
        self.model_max_length = _max_length(config)
        self.bos_token_id = self._token_id(config, "bos_token", "<|startoftext|>")
        self.eos_token_id = self._token_id(config, "eos_token", "<|endoftext|>")
        self.pad_token_id = self._token_id(config, "pad_token", "<|endoftext|>")

    def _token_id(self, config: Mapping[str, Any], key: str, default: str) -> int:
        token = config.get(key, default)
        token = token.get("content") if isinstance(token, Mapping) else token
        token_id = self._backend.token_to_id(token) if isinstance(token, str) else None
        if token_id is None:
            raise ArtifactError(f"tokenizer_config.json's {key} {token!r} is not in tokenizer.json's vocabulary; "
                                "recompile the artifact")
        return int(token_id)

    def __call__(self, text: str | Sequence[str], *, add_special_tokens: bool = True, truncation: bool = False,
                 padding: bool | str = False, max_length: int | None = None, return_tensors: str | None = None,
                 verbose: bool = True) -> Encoding:
        """``CLIPTokenizer``'s call for the arguments the runtime uses: truncation to ``max_length`` (default
        ``model_max_length``) keeps ``[BOS] ... [EOS]``; ``padding="max_length"`` pads with ``pad_token_id``.

        Raises:
            ValueError: another ``padding`` or ``return_tensors`` value, or ``return_tensors="pt"`` on rows of
                different lengths.
        """
        del verbose  # transformers' flag for its over-length warning; the callers warn themselves
        if padding not in (False, "max_length") or return_tensors not in (None, "pt"):
            raise ValueError(f"ClipTokenizer supports padding='max_length' and return_tensors='pt' only, got "
                             f"padding={padding!r}, return_tensors={return_tensors!r}")
        texts = [text] if isinstance(text, str) else list(text)
        length = self.model_max_length if max_length is None else int(max_length)
        rows = [self._row(t, add_special_tokens, truncation, padding == "max_length", length) for t in texts]
        if return_tensors == "pt":
            if len({len(r) for r in rows}) > 1:
                raise ValueError("return_tensors='pt' needs rows of one length: pass padding='max_length'")
            return Encoding(torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1))
        return Encoding(rows[0] if isinstance(text, str) else rows)

    def _row(self, text: str, specials: bool, truncation: bool, pad: bool, length: int) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if truncation:
            ids = ids[: max(0, length - (2 if specials else 0))]
        row = [self.bos_token_id, *ids, self.eos_token_id] if specials else list(ids)
        return row + [self.pad_token_id] * (length - len(row)) if pad else row


def _max_length(config: Mapping[str, Any]) -> int:
    value = config.get("model_max_length")
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= 4096:
        raise ArtifactError(f"tokenizer_config.json's model_max_length {value!r} is not a sequence length; "
                            "recompile the artifact")
    return value


def load_tokenizer(reader: Any, rel: str, what: str) -> Any:
    """The tokenizer of the artifact folder ``rel`` (e.g. "tokenizer"): a :class:`ClipTokenizer` from its hashed
    ``tokenizer.json`` and ``tokenizer_config.json`` when the manifest lists both, else transformers'
    ``CLIPTokenizer`` loaded from a private copy of the folder (artifacts of before ``tokenizer.json``).

    Args:
        reader: the open :class:`~diffusion_trt.artifact.reader.ArtifactReader`.
        what: the tokenizer's name in messages ("tokenizer", "SDXL tokenizer_2").

    Raises:
        ArtifactError: a file fails its check, or the tokenizer cannot be built from the files.
    """
    json_rel, config_rel = f"{rel}/tokenizer.json", f"{rel}/tokenizer_config.json"
    if not (reader.lists(json_rel) and reader.lists(config_rel)):
        return _transformers_tokenizer(reader, rel, what)
    from tokenizers import Tokenizer

    config = reader.json(config_rel)
    data = reader.read(json_rel)  # its own errors as they are (an altered file; a folder replaced meanwhile)
    try:
        backend = Tokenizer.from_str(bytes(data).decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception on a bad file
        raise ArtifactError(f"cannot load the {what} from {reader.root / json_rel} ({type(e).__name__}: {e}); "
                            "recompile the artifact") from None
    if not isinstance(config, Mapping):
        raise ArtifactError(f"{reader.root / config_rel} is not a JSON object; recompile the artifact")
    return ClipTokenizer(backend, config)


def _transformers_tokenizer(reader: Any, rel: str, what: str) -> Any:
    from transformers import CLIPTokenizer

    with reader.private_copy(rel) as folder:
        try:
            return CLIPTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ArtifactError(f"cannot load the {what} from {reader.root / rel} ({e}); recompile the artifact"
                                ) from None
