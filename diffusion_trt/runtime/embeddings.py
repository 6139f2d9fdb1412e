"""Textual-inversion embeddings the way A1111 users keep them: a file per embedding, used by its name in the prompt.

A file (``.safetensors``, or ``.pt`` / ``.bin`` through torch's weights-only loader, never a full unpickle; a ``.bin``
that is a safetensors file is read as one) holds one embedding of n >= 1 vectors of the text encoder's hidden size D, in
one of the key forms diffusers' ``load_textual_inversion`` reads: A1111's ``string_to_param`` {"*": [n, D]} (``.pt``;
flattened ``string_to_param.*`` in a ``.safetensors``) or ``emb_params`` [n, D], or diffusers' single ``{token: [D] or
[n, D]}``. SDXL's two-encoder form holds ``clip_l`` [n, 768] (for ``text_encoder``) and ``clip_g`` [n, 1280] (for
``text_encoder_2``): each encoder gets its own :class:`EmbeddingTable`, as diffusers' ``load_textual_inversion`` called
once per encoder with ``state_dict["clip_l"]`` / ``state_dict["clip_g"]``. An SDXL artifact takes that form only, an SD
1.x/2.x artifact the others only. One difference kept on purpose: SDXL's ``text_encoder_2`` config has transformers'
legacy ``eos_token_id=2``, with which ``CLIPTextModelWithProjection`` pools at ``input_ids.argmax()``, i.e. on the first
token diffusers added for an embedding (ids above the vocabulary) when a prompt names one; here the embedding ids are
negative, so the pooled ``text_embeds`` come from the EOS as for every other prompt (A1111's result, which keeps the
prompt's own token ids).

Its name is the file's stem (A1111's rule): ``easynegative.safetensors`` is written ``easynegative`` in a prompt,
matched as a whole word, case-insensitively (CLIP lowercases prompts). The tokenizer is not touched: each segment
text is split on the names first, the text pieces tokenized as before, and every name replaced by its n token ids.

The text-encoder engine gets them through its ``embedding_vectors`` input [B2, N, D] (``compile
--max-embedding-vectors``, see ``compiler/export.py``; every text row gets the same [N, D] here; SDXL: each of the
two text encoders has its own): embedding vectors are rows of it, in load order, and the token id of row r is
``r - N`` (negative; ids >= 0 are the model's own tokens and read its own table exactly as before). An artifact
without that input refuses embeddings.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import RuntimeInputError
from ..lora import looks_like_lora

logger = logging.getLogger(__name__)

#: The text-encoder input the embedding vectors are fed through.
INPUT = "embedding_vectors"
#: Files read with safetensors; the others with ``torch.load(..., weights_only=True)``.
SAFETENSORS = (".safetensors",)
WEIGHTS_ONLY = (".pt", ".bin")
#: SDXL's two-encoder form: the key of each text encoder's vectors, in encoder order.
SDXL_KEYS = ("clip_l", "clip_g")


@dataclass(frozen=True)
class Embedding:
    """One textual-inversion embedding.

    Attributes:
        name: the word that stands for it in a prompt (the file stem, or the ``token`` given at load).
        vectors: [n, D] float32, n >= 1.
        source: the file it was read from.
    """

    name: str
    vectors: torch.Tensor
    source: Path

    @property
    def count(self) -> int:
        return int(self.vectors.shape[0])


def read_embedding(path: str | Path, token: str | None = None) -> Embedding:
    """The one-encoder (SD 1.x/2.x) embedding in ``path`` (see the module docstring for the file forms), named
    ``token`` or the file stem.

    Raises:
        RuntimeInputError: as :func:`read_embeddings`, or an SDXL (clip_l/clip_g) file.
    """
    found = read_embeddings(path, token)
    if len(found) != 1:
        raise RuntimeInputError(_wrong_family(path, sdxl=False))
    return found[0]


def _check_is_file(path: Path) -> None:
    """Raise RuntimeInputError unless ``path`` is an existing regular file (the message says what it is instead)."""
    if path.is_file():
        return
    if path.is_dir():
        raise RuntimeInputError(f"embedding file {path} is a directory; pass one embedding file in it (.safetensors, "
                                "or .pt/.bin read with torch's weights-only loader), once per --embedding")
    if path.exists():
        raise RuntimeInputError(f"embedding file {path} is not a regular file; pass a .safetensors (or .pt/.bin) file")
    raise RuntimeInputError(f"embedding file {path} does not exist")


def read_embeddings(path: str | Path, token: str | None = None) -> tuple[Embedding, ...]:
    """The embedding in ``path``, named ``token`` or the file stem: one :class:`Embedding` for the one-encoder forms,
    two for SDXL's (``clip_l`` for ``text_encoder``, then ``clip_g`` for ``text_encoder_2``; module docstring).

    Raises:
        RuntimeInputError: no such file (or a directory, or another non-file, there), an unknown suffix, a file the
            weights-only loader or safetensors refuses,
            keys of no known form (an SDXL file with only one of clip_l/clip_g), or vectors that are not [D] /
            [n, D].
    """
    path = Path(path)
    _check_is_file(path)
    suffix = path.suffix.lower()
    if suffix in SAFETENSORS or (suffix in WEIGHTS_ONLY and _holds_safetensors(path)):  # a .bin saved as safetensors
        state = _read_safetensors(path)
    elif suffix in WEIGHTS_ONLY:
        state = _read_weights_only(path)
    else:
        raise RuntimeInputError(f"embedding file {path} has suffix {path.suffix!r}; use a .safetensors file "
                                "(or .pt/.bin, read with torch's weights-only loader)")
    name = token if token is not None else path.stem
    if not name or not name.strip() or name != name.strip():
        raise RuntimeInputError(f"embedding name {name!r} (from {path}) must be a non-empty word without surrounding "
                                "spaces")
    if any(key in state for key in SDXL_KEYS):
        pair = tuple(Embedding(name, _sdxl_vectors(path, state, key), path) for key in SDXL_KEYS)
        counts = [int(e.vectors.shape[0]) for e in pair]
        if counts[0] != counts[1]:  # one name must stand for the same number of tokens in both encoders
            raise RuntimeInputError(f"embedding file {path}: {SDXL_KEYS[0]} has {counts[0]} vector(s) but "
                                    f"{SDXL_KEYS[1]} has {counts[1]}; an SDXL embedding has one count for both")
        return pair
    return (Embedding(name, _vectors(path, state), path),)


def _holds_safetensors(path: Path) -> bool:
    """Whether ``path`` starts as a safetensors file does: an 8-byte little-endian header length that fits in the
    file, then the header's ``{`` (the format's layout, huggingface/safetensors README). Hub embeddings named
    ``learned_embeds.bin`` are sometimes safetensors files; torch's loader would call them unsafe pickles."""
    try:
        with path.open("rb") as f:
            head = f.read(9)
            size = path.stat().st_size
    except OSError:
        return False
    return len(head) == 9 and int.from_bytes(head[:8], "little") <= size - 8 and head[8:] == b"{"


def _read_safetensors(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise RuntimeInputError(f"embedding file {path} is not a readable safetensors file: {e}") from e


def _read_weights_only(path: Path) -> dict[str, Any]:
    import pickle
    import warnings

    try:
        with warnings.catch_warnings():  # torch's "Detected pickle protocol 4" came out above the one error: line
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise RuntimeInputError(f"embedding file {path} is refused by torch's weights-only loader ({_reason(e)}); it "
                                "holds more than tensors and loading it fully would run arbitrary code: convert it "
                                "to .safetensors where you trust it") from e
    if not isinstance(state, Mapping):
        raise RuntimeInputError(f"embedding file {path} holds a {type(state).__name__}, not a dict of tensors")
    return dict(state)


def _reason(error: Exception) -> str:
    """What torch's weights-only loader refused in the file: the first line after its ``WeightsUnpickler error:``,
    first sentence (the error's first line only says the load failed, and in a ``torch.save`` file announces two
    options it lists below, with terminal bold codes), else the first line, else the error's type."""
    text = str(error)
    _, marker, after = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (after if marker else text).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[0].split(". ")[0] if marker else lines[0]


def _vectors(path: Path, state: Mapping[str, Any]) -> torch.Tensor:
    """The [n, D] float32 vectors of a file's ``state`` (diffusers' ``_retrieve_tokens_and_embeddings`` forms)."""
    params = state.get("string_to_param")
    if isinstance(params, Mapping) and len(params) == 1:
        value = next(iter(params.values()))
    elif "string_to_param.*" in state:
        value = state["string_to_param.*"]
    elif "emb_params" in state:
        value = state["emb_params"]
    elif len(state) == 1:
        value = next(iter(state.values()))
    elif looks_like_lora(state):  # named as compile's single-file check names it
        raise RuntimeInputError(f"embedding file {path} is a LoRA (lora_* keys), not a textual-inversion embedding: "
                                "pass it with --lora (an artifact compiled --refittable) or compile --lora")
    else:
        keys = ", ".join(sorted(map(str, state))[:6])
        raise RuntimeInputError(f"embedding file {path} has keys {keys}: none of the textual-inversion forms "
                                "(string_to_param, emb_params, one {token: vectors} entry)")
    return _checked(path, value, "the vectors")


def _sdxl_vectors(path: Path, state: Mapping[str, Any], key: str) -> torch.Tensor:
    """SDXL's ``state[key]`` (``clip_l`` or ``clip_g``) as [n, D] float32."""
    if key not in state:
        have = next(k for k in SDXL_KEYS if k in state)
        raise RuntimeInputError(f"embedding file {path} has {have} but no {key}: an SDXL embedding holds both "
                                f"({' and '.join(SDXL_KEYS)}, one per text encoder)")
    return _checked(path, state[key], key)


def _checked(path: Path, value: Any, what: str) -> torch.Tensor:
    """``value`` as [n, D] float32 vectors (a [D] vector is n = 1); refused unless a non-empty, finite [D] / [n, D]
    floating-point tensor (integer or bool values are token ids or masks, never learned vectors)."""
    if not isinstance(value, torch.Tensor) or value.ndim not in (1, 2) or value.numel() == 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise RuntimeInputError(f"embedding file {path}: {what} are {shape}; expected [D] or [n, D]")
    if not value.is_floating_point():
        raise RuntimeInputError(f"embedding file {path}: {what} are {str(value.dtype).removeprefix('torch.')} "
                                "values; textual-inversion vectors are floats (fp32, fp16 or bf16): it is not an "
                                "embedding")
    vectors = value.detach().reshape(-1, value.shape[-1]).to(torch.float32).contiguous()
    if not bool(torch.isfinite(vectors).all()):  # NaN/Inf rows would only give black images
        raise RuntimeInputError(f"embedding file {path}: {what} hold NaN/Inf values; the file is damaged or was "
                                "saved from a diverged training run")
    return vectors


@dataclass(frozen=True)
class EmbeddingTable:
    """The embeddings one pipeline has loaded, laid out as rows of the text encoder's ``embedding_vectors`` input.

    Attributes:
        rows: N, the input's rows (``compile --max-embedding-vectors``).
        hidden: D, the text encoder's hidden size.
        embeddings: in load order; embedding i takes the rows after those of embeddings 0..i-1.
        encoder: the text encoder it feeds, in messages ("text encoder"; SDXL "text_encoder (clip_l)"...).
    """

    rows: int
    hidden: int
    embeddings: tuple[Embedding, ...] = ()
    encoder: str = "text encoder"

    @classmethod
    def for_engine(cls, text_encoder: Any, encoder: str = "text encoder") -> EmbeddingTable | None:
        """An empty table sized from ``text_encoder``'s ``embedding_vectors`` input; ``None`` if it has none."""
        spec = next((t for t in text_encoder.spec.inputs if t.name == INPUT), None)
        if spec is None:
            return None
        return cls(int(spec.shape[1]), int(spec.shape[2]), encoder=encoder)

    @property
    def used(self) -> int:
        return sum(e.count for e in self.embeddings)

    def add(self, embedding: Embedding) -> EmbeddingTable:
        """This table with ``embedding`` appended.

        Raises:
            RuntimeInputError: its vector size is not the text encoder's, its name is taken (case-insensitive), or
                the rows are full.
        """
        size = int(embedding.vectors.shape[1])
        if size != self.hidden:
            raise RuntimeInputError(f"embedding {embedding.name!r} ({embedding.source}) has vectors of size {size}; "
                                    f"this artifact's {self.encoder} takes {self.hidden} (an embedding made for "
                                    "another model family)")
        clash = next((e for e in self.embeddings if e.name.lower() == embedding.name.lower()), None)
        if clash is not None and clash.source.resolve() == embedding.source.resolve():
            raise RuntimeInputError(f"embedding file {embedding.source} is given twice; give it once")
        if clash is not None:
            named = embedding.name == embedding.source.stem and clash.name == clash.source.stem
            fix = "rename one of the files (the name is the file stem)" if named else "give each its own token="
            raise RuntimeInputError(f"embedding name {embedding.name!r} ({embedding.source}) is taken by "
                                    f"{clash.source}; {fix}")
        if self.used + embedding.count > self.rows:
            raise RuntimeInputError(f"embedding {embedding.name!r} has {embedding.count} vectors and the loaded ones "
                                    f"fill {self.used} of the artifact's {self.rows} rows; recompile with a larger "
                                    "--max-embedding-vectors")
        return EmbeddingTable(self.rows, self.hidden, (*self.embeddings, embedding), self.encoder)

    def token_ids(self, name: str) -> list[int]:
        """The n token ids of the embedding ``name`` (matched case-insensitively): ``row - N``, all negative."""
        start = 0
        for e in self.embeddings:
            if e.name.lower() == name.lower():
                return [start + i - self.rows for i in range(e.count)]
            start += e.count
        raise KeyError(name)

    def tokenize_units(self, text: str, tokenize: Callable[[str], Sequence[int]]) -> list[list[int]]:
        """The token ids of ``text``: ``tokenize`` on the pieces between embedding names, each name (a whole word,
        case-insensitive) replaced by its :meth:`token_ids`; in the units a prompt chunk must not split: one list per
        token, and one for all the ids of each embedding named (A1111 moves an embedding that does not fit a chunk's
        end to the next chunk, :mod:`.prompt_encoding`)."""
        if not self.embeddings:
            return [[t] for t in tokenize(text)]
        units: list[list[int]] = []
        pieces = self._pattern().split(text)
        for i, piece in enumerate(pieces):  # re.split with one group: text, name, text, name, ..., text
            if i % 2:
                units.append(self.token_ids(piece))
            elif piece:
                units.extend([t] for t in tokenize(piece))
        return units

    def unused(self, texts: Sequence[str | None]) -> list[str]:
        """The names of the embeddings that no text of ``texts`` names (as :meth:`tokenize_units` matches them: a whole
        word, case-insensitive): they would change no image."""
        if not self.embeddings:
            return []
        named = {m.lower() for t in texts if t for m in self._pattern().findall(t)}
        return [e.name for e in self.embeddings if e.name.lower() not in named]

    def _pattern(self) -> re.Pattern[str]:
        names = sorted((e.name for e in self.embeddings), key=len, reverse=True)  # longest first: "bad" in "bad_v2"
        return re.compile(r"(?<!\w)(" + "|".join(map(re.escape, names)) + r")(?!\w)", re.IGNORECASE)

    def vectors(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The ``embedding_vectors`` feed [N, D] of ``dtype`` on ``device``: the embeddings' rows, then zeros."""
        out = torch.zeros(self.rows, self.hidden, dtype=torch.float32)
        if self.embeddings:
            used = torch.cat([e.vectors for e in self.embeddings])
            out[: used.shape[0]] = used
        return out.to(device=device, dtype=dtype)


def engine_feed(text_encoder: Any, table: EmbeddingTable | None) -> dict[str, torch.Tensor]:
    """The per-row inputs of a text-encoder run besides ``input_ids``: ``{"embedding_vectors": [N, D]}`` (every
    row's; the caller expands it to the rows) when the engine takes them (zeros without embeddings: ids >= 0 never
    read them), ``{}`` for an engine of before."""
    spec = next((t for t in text_encoder.spec.inputs if t.name == INPUT), None)
    if spec is None:
        return {}
    table = table if table is not None else EmbeddingTable(int(spec.shape[1]), int(spec.shape[2]))
    return {INPUT: table.vectors(spec.torch_dtype, text_encoder.device)}


#: SDXL's text encoders with the key of their vectors in a two-encoder file, as messages name them.
SDXL_ENCODERS = tuple(f"{name} ({key})" for name, key in zip(("text_encoder", "text_encoder_2"), SDXL_KEYS,
                                                               strict=True))


def refusal(artifact: str | Path, sdxl: bool) -> str:
    """The message for ``--embedding`` on an artifact whose text encoder(s) have no ``embedding_vectors`` input."""
    which = "text encoders take" if sdxl else "text encoder takes"
    since = "SDXL textual inversion" if sdxl else "textual inversion"
    return (f"{artifact}'s {which} no embedding vectors (compiled before {since}, or with "
            "--max-embedding-vectors 0); recompile it (compile --max-embedding-vectors 128) to use --embedding")


def load_embeddings(tables: Sequence[EmbeddingTable | None], text_encoders: Sequence[Any],
                    paths: str | Path | Sequence[str | Path], tokens: str | Sequence[str | None] | None,
                    artifact: str | Path, *, announce: bool = True) -> tuple[EmbeddingTable, ...]:
    """``tables`` (one per text encoder, ``None`` = an empty one sized from it) with the embeddings of ``paths``
    added, all or none: the arguments of diffusers' ``load_textual_inversion`` (one path or a list; ``tokens`` one
    name or one per path, ``None`` = the file stems). Two text encoders (SDXL) take two-encoder files, one the
    one-encoder forms. ``announce``: log one line per file (off for a check before the real load).

    Raises:
        RuntimeInputError: an engine takes no embeddings (:func:`refusal`), ``tokens`` do not pair with ``paths``,
            a file of the other family's form, or any file refused (:func:`read_embeddings`,
            :meth:`EmbeddingTable.add`).
    """
    sdxl = len(text_encoders) == 2
    names_of = SDXL_ENCODERS if sdxl else ("text encoder",)
    fresh = [t if t is not None else EmbeddingTable.for_engine(e, n)
             for t, e, n in zip(tables, text_encoders, names_of, strict=True)]
    if any(t is None for t in fresh):
        raise RuntimeInputError(refusal(artifact, sdxl))
    out: tuple[EmbeddingTable, ...] = tuple(fresh)  # type: ignore[arg-type]
    files = [paths] if isinstance(paths, str | Path) else list(paths)
    names = [tokens] * len(files) if tokens is None or isinstance(tokens, str) else list(tokens)
    if len(names) != len(files) or (isinstance(tokens, str) and len(files) > 1):
        raise RuntimeInputError(f"token={tokens!r} does not pair with {len(files)} embedding file(s); give one name "
                                "per file, or none (the file stems)")
    for path, name in zip(files, names, strict=True):
        found = read_embeddings(path, name)
        if len(found) != len(out):
            raise RuntimeInputError(_wrong_family(path, sdxl))
        out = tuple(t.add(e) for t, e in zip(out, found, strict=True))
        if announce:
            logger.info("embedding %r: %s vector(s) from %s", found[0].name, "+".join(str(e.count) for e in found),
                        path)
    return out


def check_embedding_file(path: str | Path, sdxl: bool | None = None) -> None:
    """Refuse ``path`` as :func:`read_embeddings` does and, with ``sdxl`` known (``None`` = not), when it is not of
    that family's form (two-encoder for SDXL, one-encoder otherwise).

    Raises:
        RuntimeInputError: see above.
    """
    found = read_embeddings(path)
    if sdxl is not None and len(found) != 1 + sdxl:
        raise RuntimeInputError(_wrong_family(path, sdxl))


def _wrong_family(path: str | Path, sdxl: bool) -> str:
    if sdxl:
        return (f"embedding file {path} is a one-encoder (SD 1.x/2.x) embedding; an SDXL artifact takes the "
                f"two-encoder form ({' and '.join(SDXL_KEYS)} tensors, one per text encoder)")
    return (f"embedding file {path} is an SDXL embedding ({'/'.join(SDXL_KEYS)}); an SD 1.x/2.x artifact takes "
            "one-encoder embeddings only")
