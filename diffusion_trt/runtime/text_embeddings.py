"""Prompts -> text embeddings on the text encoder engine, as diffusers' ``encode_prompt``: :func:`tokenize`,
:func:`encode_prompt_embeds` (ONE text-encoder run over the distinct texts of a request, long and weighted prompts
as :mod:`.prompt_encoding` reads them), :func:`encode_prompt` (with the CFG concatenation) and the negative-prompt
cache :class:`EmbeddingCache`.

Shapes: P prompts; embeddings ``[P, 77 k, D]`` for k chunks of 77 tokens and the text encoder's width D.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any

import torch

from .cuda import nvtx_range
from .embeddings import engine_feed
from .engines.engine import Engine, run_rows
from .prompt_encoding import PromptReader, TokenChunks, apply_weights, pad_chunks, warn_truncated

logger = logging.getLogger(__name__)


def tokenize(tokenizer: Any, texts: Sequence[str], device: torch.device,
             negatives: Collection[str] = ()) -> torch.Tensor:
    """CLIP token ids [N, model_max_length] int64, as diffusers: pad to max length, truncate, warn on truncation
    (naming a text of ``negatives`` "negative prompt")."""
    max_length = tokenizer.model_max_length
    ids = tokenizer(
        list(texts), padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    ).input_ids
    # one line per truncated text (diffusers logs the decoded tail of every row, padding included)
    lengths = [len(tokenizer(t, truncation=False, verbose=False).input_ids) for t in texts]
    for text, n in zip(texts, lengths, strict=True):
        if n > max_length:
            logger.warning("%s truncated to %d of its %d CLIP tokens: %.60r...",
                           "negative prompt" if text in negatives else "prompt", max_length, n, text)
    return ids.to(device=device, dtype=torch.int64)


class EmbeddingCache:
    """A small LRU of text embeddings [k, 77, D] keyed by (engine, text, dtype, syntax, max chunks, clip skip): the
    negative prompts.

    The negative prompt ("" by default) is the same for most requests; caching it spares its text-encoder
    row. Entries are device tensors owned by the cache (clones). Belongs to one pipeline (keys hold the
    engine's ``id``): clear it when the engines close. Not thread-safe (one pipeline per thread).

    Args:
        maxsize: entries kept, >= 0 (0 disables caching).

    Attributes:
        hits, misses: lookups that found / did not find an entry.
    """

    def __init__(self, maxsize: int = 8) -> None:
        if maxsize < 0:
            raise ValueError(f"maxsize={maxsize} must be >= 0")
        self.maxsize = maxsize
        self._entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(engine: Engine, text: str, dtype: torch.dtype, syntax: str = "a1111", max_chunks: int = 1,
            clip_skip: int = 0) -> tuple[int, str, torch.dtype, str, int, int]:
        return (id(engine), text, dtype, syntax, max_chunks, clip_skip)

    def get(self, key: Hashable) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: Hashable, value: torch.Tensor) -> None:
        if self.maxsize == 0:
            return
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


def encode_prompt_embeds(
    text_encoder: Engine,
    tokenizer: Any,
    prompts: Sequence[str],
    negative_prompts: Sequence[str] | None,
    dtype: torch.dtype,
    cache: EmbeddingCache | None = None,
    min_chunks: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-prompt text embeddings with ONE text-encoder run over the chunks of the distinct texts not in ``cache``.

    Long and weighted prompts as :mod:`.prompt_encoding` describes: every text is k_i chunks of 77 tokens, encoded
    together, weighted, and padded with an empty chunk's states to the request's largest k.

    Args:
        tokenizer: a :class:`~.prompt_encoding.PromptReader`, or a ``CLIPTokenizer`` (= ``PromptReader(tokenizer)``:
            A1111 syntax, one chunk).
        prompts: P prompts; negative_prompts: P negative prompts, or ``None`` (no CFG).
        dtype: the UNet's ``encoder_hidden_states`` dtype.
        cache: negative-prompt cache; ``None`` = encode everything.
        min_chunks: pad every text to at least this many chunks (the chunks of given ``prompt_embeds``).

    Returns:
        (positive [P, 77 k, D], negative [P, 77 k, D] or ``None``), fresh tensors of ``dtype`` on the engine device.
    """
    reader = tokenizer if isinstance(tokenizer, PromptReader) else PromptReader(tokenizer)
    negatives = list(dict.fromkeys(negative_prompts)) if negative_prompts is not None else []
    keys = {t: EmbeddingCache.key(text_encoder, t, dtype, reader.syntax, reader.max_chunks, reader.clip_skip)
            for t in negatives}
    rows: dict[str, torch.Tensor] = {}  # text -> [k_i, 77, D]
    if cache is not None:
        rows = {t: hit for t in negatives if (hit := cache.get(keys[t])) is not None}
    todo = [t for t in dict.fromkeys([*negatives, *prompts]) if t not in rows]
    negative_only = set(negatives) - set(prompts)
    chunks = [reader.chunks(t, "negative prompt" if t in negative_only else "prompt") for t in todo]
    warn_truncated(todo, chunks, negative_only, reader)
    counts = {t: r.shape[0] for t, r in rows.items()} | {t: c.chunks for t, c in zip(todo, chunks, strict=True)}
    k = max(*counts.values(), min_chunks)
    short = min(counts.values()) < k  # some texts are padded to k chunks with an empty chunk's states
    run_empty = short and counts.get("") != 1  # "" is exactly one empty chunk: reuse it when it is at hand
    encoded, empty = _encode_chunks(text_encoder, reader, dict(zip(todo, chunks, strict=True)), run_empty, dtype)
    rows.update(encoded)
    if cache is not None:
        for text in encoded.keys() & keys.keys():  # the negatives just encoded
            cache.put(keys[text], encoded[text].clone())
    if short and empty is None:
        empty = rows[""][0]
    positive = torch.stack([pad_chunks(rows[p], k, empty) for p in prompts])
    negative = (torch.stack([pad_chunks(rows[n], k, empty) for n in negative_prompts])
                if negative_prompts is not None else None)
    return positive, negative


def _encode_chunks(text_encoder: Engine, reader: PromptReader, chunks: Mapping[str, TokenChunks], with_empty: bool,
                   dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """One text-encoder run over every text's chunks (and an empty chunk when ``with_empty``): each text's weighted
    states [k_i, 77, D] in ``dtype``, and the empty chunk's [77, D] (``None`` without it)."""
    if not chunks and not with_empty:
        return {}, None
    ids = torch.cat([c.ids for c in chunks.values()] + ([reader.empty_chunk()] if with_empty else []))
    with nvtx_range("text_encoder", text_encoder.device):
        states = run_rows(text_encoder, "input_ids", ids.to(text_encoder.device), reader.output,
                          engine_feed(text_encoder, reader.embeddings))
    states = reader.states({reader.output: states})
    rows: dict[str, torch.Tensor] = {}
    start = 0
    for text, c in chunks.items():
        z = states[start : start + c.chunks]
        start += c.chunks
        rows[text] = (apply_weights(z, c.weights) if c.weighted else z).to(dtype)
    return rows, states[-1].to(dtype) if with_empty else None


def encode_prompt(
    text_encoder: Engine,
    tokenizer: Any,
    prompts: Sequence[str],
    negative_prompts: Sequence[str] | None,
    num_images_per_prompt: int,
    dtype: torch.dtype,
    cache: EmbeddingCache | None = None,
) -> torch.Tensor:
    """Text embeddings for the UNet, diffusers' ``encode_prompt`` then the CFG concatenation.

    Args:
        prompts: P prompts.
        negative_prompts: P negative prompts, or ``None`` for no CFG.
        num_images_per_prompt: N; each prompt's embedding is repeated N times in a row.
        dtype: the UNet's ``encoder_hidden_states`` dtype.
        cache: negative-prompt cache (see :func:`encode_prompt_embeds`).

    Returns:
        [2*P*N, 77, D] ``[negative; positive]`` with CFG, [P*N, 77, D] without; a fresh tensor.
    """
    positive, negative = encode_prompt_embeds(text_encoder, tokenizer, prompts, negative_prompts, dtype, cache)
    # diffusers repeats along the sequence axis then views: row order prompt0 x N, prompt1 x N, ... (= interleave)
    positive = positive.repeat_interleave(num_images_per_prompt, dim=0)
    if negative is None:
        return positive
    return torch.cat([negative.repeat_interleave(num_images_per_prompt, dim=0), positive])
