"""SDXL's prompt encoding and added conditioning on compiled engines, step for step as diffusers' SDXL pipeline.

Reproduces ``diffusers.StableDiffusionXLPipeline`` (diffusers 0.42, ``pipeline_stable_diffusion_xl.py``):

* ``encode_prompt``: each of the two CLIP tokenizers pads/truncates to its ``model_max_length`` (77); each text
  encoder gives ``hidden_states[-2]`` (the penultimate layer, no final layer norm: the engines' output
  ``penultimate_hidden_state``), concatenated on the last axis into ``prompt_embeds`` [P, 77, D1 + D2];
  ``text_encoder_2`` (``CLIPTextModelWithProjection``) also gives the pooled, projected ``text_embeds`` [P, E].
  ``prompt_2`` (the text for the second encoder) defaults to ``prompt``. Long and weighted prompts go beyond
  diffusers as A1111's SDXL conditioner does (:meth:`SdxlConditioning.encode`): 77-token chunks on both encoders
  (:mod:`.prompt_encoding`), concatenated per chunk, pooled ``text_embeds`` of the first chunk; one unweighted
  chunk is diffusers' encoding exactly. ``prompt_embeds`` needs ``pooled_prompt_embeds`` (as diffusers).
* ``clip_skip=c``: each encoder gives ``hidden_states[-(c + 2)]`` instead ("2" because SDXL always indexes from the
  penultimate layer; no final layer norm), the engines' ``clip_skip_states`` row c-1; the pooled ``text_embeds``
  stay the last layer's. One deliberate difference, as for SD (:class:`~.prompt_encoding.PromptReader`): diffusers
  gives the negative prompt ``hidden_states[-2]`` whatever the clip skip; here prompts and negative prompts alike
  take the skipped layer (A1111's behaviour, the one fine-tunes are tuned for).
* textual inversion: an SDXL embedding file's ``clip_l`` vectors go to ``text_encoder``, its ``clip_g`` vectors to
  ``text_encoder_2`` (:mod:`.embeddings`), as diffusers' ``load_textual_inversion`` called once per encoder.
* negative prompt: with ``negative_prompt=None`` and the model's ``force_zeros_for_empty_prompt`` (true for
  SDXL base), the negative embeddings and pooled embeddings are **zeros**; otherwise the negative prompt ("" by
  default; ``negative_prompt_2`` defaults to it) is encoded like the prompt.
* ``_get_add_time_ids``: ``time_ids = list(original_size + crops_coords_top_left + target_size)``, six numbers
  (height, width pairs), defaults ``original_size = target_size = (height, width)`` and ``(0, 0)``. The negative
  row uses ``negative_original_size``/``negative_crops_coords_top_left``/``negative_target_size`` only when both
  ``negative_original_size`` and ``negative_target_size`` are given, else the same ids as the prompt.
* CFG: ``[negative; positive]`` for ``encoder_hidden_states``, ``text_embeds`` and ``time_ids`` (repeated per
  image), fed to the UNet every step as ``added_cond_kwargs``. One deliberate difference: diffusers builds
  ``time_ids`` as the two rows ``[negative; positive]`` ``.repeat(B, 1)``, i.e. alternating, while its embeddings
  are ``[negative x B; positive x B]``; with B >= 2 images and negative sizes that differ from the positive ones,
  diffusers thus gives some negative rows the positive ids. Here every row gets its own ids (identical results
  whenever the negative and positive ids are equal, i.e. unless ``negative_original_size`` is given).

Shapes: P prompts; ``text_embeds`` [B2, E]; ``time_ids`` [B2, 6] float32 (the UNet engine's dtype for it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RuntimeInputError
from .conditioning import TextToImage
from .cuda import nvtx_range
from .embeddings import EmbeddingTable, engine_feed
from .engines.engine import Engine, run_rows_outputs
from .prompt_encoding import PromptReader, TokenChunks, apply_weights, pad_chunks, warn_truncated
from .text_embeddings import EmbeddingCache

logger = logging.getLogger(__name__)

#: The engines an SDXL artifact's text-to-image loop opens.
SDXL_COMPONENTS: tuple[str, ...] = ("text_encoder", "text_encoder_2", "unet", "vae_decoder")
#: The UNet inputs SDXL adds to the SD ones (diffusers' ``added_cond_kwargs``).
ADDED_INPUTS: tuple[str, ...] = ("text_embeds", "time_ids")
HIDDEN_OUTPUT = "penultimate_hidden_state"
POOLED_OUTPUT = "text_embeds"
#: The text encoders' output for ``clip_skip`` c >= 1: [B2, C, 77, D], row c-1 = ``hidden_states[-(c + 2)]``.
SKIP_OUTPUT = "clip_skip_states"
#: The largest size or crop coordinate of the micro-conditioning: float32 (the ``time_ids`` tensor) holds every
#: integer up to 2**24 exactly; beyond, they round, and from about 3.4e38 they are inf (a NaN, black image).
MAX_TIME_ID = 2**24


def add_time_ids(
    original_size: Sequence[int], crops_coords_top_left: Sequence[int], target_size: Sequence[int], prefix: str = ""
) -> torch.Tensor:
    """SDXL's micro-conditioning row: ``original_size + crops_coords_top_left + target_size``.

    As diffusers' ``StableDiffusionXLPipeline._get_add_time_ids`` (``list(original_size + crops_coords_top_left +
    target_size)``); each argument is a (height, width) / (top, left) pair in pixels. ``prefix``: "negative_" for
    the negative row's, as the messages name them.

    Returns:
        float32 CPU tensor [6].

    Raises:
        RuntimeInputError: an argument is not a pair of integers (sizes > 0, crop coordinates >= 0, all at most
            :data:`MAX_TIME_ID`).
    """
    values: list[float] = []
    for name, pair, least in (("original_size", original_size, 1), ("crops_coords_top_left", crops_coords_top_left, 0),
                              ("target_size", target_size, 1)):
        ok = isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and least <= v <= MAX_TIME_ID for v in pair)
        if not ok:
            raise RuntimeInputError(
                f"{prefix}{name}={pair!r} must be a pair of integers >= {least} and <= {MAX_TIME_ID} (pixels, "
                "(height, width) or (top, left)), e.g. (1024, 1024) or (0, 0)"
            )
        values += [float(v) for v in pair]
    return torch.tensor(values, dtype=torch.float32)


def sdxl_conditioning(
    prompts: Sequence[str],
    negatives: Sequence[str],
    negative_prompt: Any,
    height: int,
    width: int,
    text_encoder_2: Engine,
    tokenizer_2: Any,
    *,
    zero_negative: bool,
    prompt_2: Sequence[str] | None = None,
    negative_prompt_2: Sequence[str] | None = None,
    original_size: Any = None,
    crops_coords_top_left: Any = (0, 0),
    target_size: Any = None,
    negative_original_size: Any = None,
    negative_crops_coords_top_left: Any = (0, 0),
    negative_target_size: Any = None,
    embeddings_2: EmbeddingTable | None = None,
) -> SdxlConditioning:
    """The SDXL part of a request, checked (the module docstring gives diffusers' rules it follows).

    Args:
        prompts, negatives: the P checked prompts and negative prompts.
        negative_prompt: the ``negative_prompt`` as given (``None`` matters: see ``zero_negative``).
        height, width: the output size in pixels (the default original and target sizes).
        zero_negative: negative embeddings are zeros (``negative_prompt is None`` and the model's
            ``force_zeros_for_empty_prompt``).
        prompt_2, negative_prompt_2: the P checked second-encoder texts (the request checks them, see
            :func:`~.request.per_prompt`), or ``None``: the prompts / negative prompts.
        original_size ... negative_target_size: as :meth:`~.pipeline.EnginePipeline.__call__`.

    Raises:
        RuntimeInputError: a size or crop that is not a pair of integers.
    """
    prompts_2 = list(prompts) if prompt_2 is None else list(prompt_2)
    negatives_2 = list(negatives) if negative_prompt_2 is None else list(negative_prompt_2)
    time_ids = add_time_ids(original_size or (height, width), crops_coords_top_left, target_size or (height, width))
    negative_time_ids = time_ids
    if negative_original_size is not None and negative_target_size is not None:
        negative_time_ids = add_time_ids(negative_original_size, negative_crops_coords_top_left, negative_target_size,
                                         "negative_")
    return SdxlConditioning(text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, prompts_2=prompts_2,
                            negative_prompts_2=negatives_2, zero_negative=zero_negative, time_ids=time_ids,
                            negative_time_ids=negative_time_ids, embeddings_2=embeddings_2)


@dataclass(frozen=True)
class SdxlConditioning(TextToImage):
    """What one SDXL request adds to the SD loop: the second encoder, its texts and the time ids (the schedule and
    the initial latents are text-to-image's).

    Attributes:
        text_encoder_2: the ``text_encoder_2`` engine (outputs ``text_embeds`` and ``penultimate_hidden_state``).
        tokenizer_2: its ``CLIPTokenizer``.
        prompts_2: P texts for ``text_encoder_2`` (diffusers' ``prompt_2``; the prompts when not given).
        negative_prompts_2: P negative texts for ``text_encoder_2`` (the negative prompts when not given).
        zero_negative: negative embeddings are zeros (``negative_prompt is None`` and the model's
            ``force_zeros_for_empty_prompt``), the negative texts are not encoded.
        time_ids: [6] float32, see :func:`add_time_ids`.
        negative_time_ids: [6] float32 for the negative (unconditional) rows.
        embeddings_2: the textual-inversion embeddings' ``clip_g`` vectors for ``text_encoder_2`` (the ``clip_l``
            ones ride in the reader given to :meth:`encode`); ``None`` = none.
    """

    text_encoder_2: Engine
    tokenizer_2: Any
    prompts_2: Sequence[str]
    negative_prompts_2: Sequence[str]
    zero_negative: bool
    time_ids: torch.Tensor
    negative_time_ids: torch.Tensor
    embeddings_2: EmbeddingTable | None = None

    mode = "sdxl"

    def encode(
        self,
        text_encoder: Engine,
        tokenizer: Any,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        dtype: torch.dtype,
        cache: EmbeddingCache | None = None,
        min_chunks: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor | None, AddedConditioning]:
        """Per-prompt SDXL embeddings: long and weighted prompts on both encoders, each distinct text's chunks run
        once per encoder (negatives cached).

        As :mod:`.prompt_encoding` for SD, per encoder (A1111's SDXL conditioner): each text is read into 77-token
        chunks by the reader's syntax (``text_encoder_2`` with ``tokenizer_2``), each encoder's penultimate states
        weighted chunk by chunk; the two are concatenated per chunk on the feature axis ([77 k, D1 + D2]; an
        encoder with fewer chunks of a pair is padded with its empty chunk's states), and the pooled ``text_embeds``
        is ``text_encoder_2``'s of the text's first chunk. Every text is padded to the request's largest k with the
        empty chunk pair. One unweighted chunk is exactly diffusers' ``encode_prompt``.

        Args:
            tokenizer: ``text_encoder``'s ``CLIPTokenizer``, or a :class:`~.prompt_encoding.PromptReader` holding it
                (its syntax and chunk limit apply to both encoders; a tokenizer alone = A1111 syntax, one chunk).
            prompts: P prompts (for ``text_encoder``); negative_prompts: P negatives, or ``None`` (no CFG).
            dtype: the UNet's ``encoder_hidden_states`` / ``text_embeds`` dtype.
            min_chunks: pad every text to at least this many chunks (the chunks of given ``prompt_embeds``).

        Returns:
            (positive [P, 77 k, D1+D2], negative [P, 77 k, D1+D2] or ``None``, the pooled ``text_embeds`` [P, E]
            and time ids), fresh tensors on the engines' device.
        """
        reader = tokenizer if isinstance(tokenizer, PromptReader) else PromptReader(tokenizer)
        readers = (reader, dataclasses.replace(reader, tokenizer=self.tokenizer_2, embeddings=self.embeddings_2))
        device = text_encoder.device
        # host->device copies of pageable memory synchronise the stream: made before any engine work is queued
        time_ids, negative_time_ids = self.time_ids.to(device), self.negative_time_ids.to(device)
        encode_negatives = negative_prompts is not None and not self.zero_negative
        pairs = list(zip(prompts, self.prompts_2, strict=True))
        neg_pairs = (list(zip(negative_prompts, self.negative_prompts_2, strict=True))  # type: ignore[arg-type]
                     if encode_negatives else [])
        keys = {p: self._key(text_encoder, p, dtype, reader) for p in neg_pairs}
        got: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        if cache is not None:
            for pair, key in keys.items():
                hidden, pooled = cache.get((*key, "hidden")), cache.get((*key, "pooled"))
                if hidden is not None and pooled is not None:
                    got[pair] = (hidden, pooled)
        todo = [p for p in dict.fromkeys([*neg_pairs, *pairs]) if p not in got]
        if todo:
            with nvtx_range("text_encoders", device):
                got.update(self._encode_pairs((text_encoder, self.text_encoder_2), readers, todo,
                                              {p for p in neg_pairs if p not in pairs}, got, dtype))
            for pair in keys.keys() & set(todo):
                if cache is not None:
                    cache.put((*keys[pair], "hidden"), got[pair][0].clone())
                    cache.put((*keys[pair], "pooled"), got[pair][1].clone())
        k = max(min_chunks, *(got[p][0].shape[0] for p in [*pairs, *neg_pairs]))
        if _EMPTY_PAIR not in got and any(got[p][0].shape[0] < k for p in [*pairs, *neg_pairs]):
            # every text came from the cache: "" on both encoders is exactly the empty chunk pair
            got.update(self._encode_pairs((text_encoder, self.text_encoder_2), readers, [("", "")], set(), {},
                                          dtype))
            got[_EMPTY_PAIR] = got[("", "")]
        empty = got.get(_EMPTY_PAIR, (None,))[0]
        positive = torch.stack([pad_chunks(got[p][0], k, _first(empty)) for p in pairs])
        pooled = torch.stack([got[p][1] for p in pairs])
        negative = pooled_negative = None
        if negative_prompts is not None:
            if self.zero_negative:
                negative, pooled_negative = torch.zeros_like(positive), torch.zeros_like(pooled)
            else:
                negative = torch.stack([pad_chunks(got[p][0], k, _first(empty)) for p in neg_pairs])
                pooled_negative = torch.stack([got[p][1] for p in neg_pairs])
        added = AddedConditioning(pooled, pooled_negative, time_ids, negative_time_ids)
        return positive, negative, added

    @staticmethod
    def _encode_pairs(engines: tuple[Engine, Engine], readers: tuple[PromptReader, PromptReader],
                      todo: Sequence[tuple[str, str]], negatives: set[tuple[str, str]],
                      cached: Mapping[tuple[str, str], tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
                      ) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
        """Each pair of ``todo``: (hidden [k, 77, D1+D2] in ``dtype``, pooled [E]); one run per encoder over the
        chunks of its distinct texts, with the empty chunk pair (under :data:`_EMPTY_PAIR`) when a text is padded."""
        texts = [list(dict.fromkeys(p[i] for p in todo)) for i in (0, 1)]
        neg_texts = [{p[i] for p in negatives} - {p[i] for p in todo if p not in negatives} for i in (0, 1)]
        chunks = [{t: r.chunks(t, _text_name(t, neg_texts[i], texts[:i])) for t in texts[i]}
                  for i, r in enumerate(readers)]
        warn_truncated(texts[0], list(chunks[0].values()), neg_texts[0], readers[0])
        rest = [t for t in texts[1] if t not in chunks[0]]
        warn_truncated(rest, [chunks[1][t] for t in rest], neg_texts[1], readers[1])
        counts = [(chunks[0][a].chunks, chunks[1][b].chunks) for a, b in todo]
        counts += [(h.shape[0], h.shape[0]) for h, _ in cached.values()]
        k = max(max(c) for c in counts)
        with_empty = any(c1 != c2 or max(c1, c2) < k for c1, c2 in counts)
        states, pooled, empties = [], None, []
        for i, (engine, reader) in enumerate(zip(engines, readers, strict=True)):
            rows, empty, first = _encode_texts(engine, reader, chunks[i], with_empty, with_pooled=i == 1)
            states.append(rows)
            empties.append(empty)
            pooled = first if i else pooled
        device = engines[0].device
        out: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for a, b in todo:
            h1, h2 = states[0][a], states[1][b].to(device)
            kp = max(h1.shape[0], h2.shape[0])
            if h1.shape[0] != h2.shape[0]:
                h1 = pad_chunks(h1, kp, empties[0]).reshape(kp, *h1.shape[1:])  # type: ignore[arg-type]
                h2 = pad_chunks(h2, kp, empties[1].to(device)).reshape(kp, *h2.shape[1:])  # type: ignore[union-attr]
            out[(a, b)] = (torch.cat([h1, h2], dim=-1).to(dtype), pooled[b].to(device=device, dtype=dtype))
        if with_empty:
            out[_EMPTY_PAIR] = (torch.cat([empties[0], empties[1].to(device)], dim=-1)[None].to(dtype),
                                torch.empty(0))  # type: ignore[union-attr]
        return out

    def encode_given(self, text_encoder: Engine, reader: PromptReader, embeds: Sequence[torch.Tensor | None],
                     negative_prompts: Sequence[str] | None, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor | None, AddedConditioning]:
        """The caller's embeddings as diffusers' SDXL ``encode_prompt`` takes them.

        Args:
            embeds: ``prompt_embeds`` [P, 77 k, D1+D2], ``pooled_prompt_embeds`` [P, E], ``negative_prompt_embeds``
                and ``negative_pooled_prompt_embeds`` (both ``None`` or both given), checked by the request.
            negative_prompts: P negatives with CFG, or ``None``: without negative embeddings they are zeros
                (:attr:`zero_negative`) or encoded as :meth:`encode` does, padded or cut to k chunks.

        Returns:
            as :meth:`encode`, in ``dtype`` on the engines' device.
        """
        device = text_encoder.device
        positive, pooled, negative, pooled_negative = (None if e is None else e.to(device=device, dtype=dtype)
                                                       for e in embeds)
        added = AddedConditioning(pooled, None, self.time_ids.to(device), self.negative_time_ids.to(device))
        if negative_prompts is None:
            return positive, None, added  # type: ignore[return-value]
        if negative is None and self.zero_negative:
            negative, pooled_negative = torch.zeros_like(positive), torch.zeros_like(pooled)
        elif negative is None:
            k = positive.shape[1] // reader.length  # type: ignore[union-attr]
            of_negatives = dataclasses.replace(self, prompts_2=self.negative_prompts_2)
            negative, _, encoded = of_negatives.encode(text_encoder, dataclasses.replace(reader, max_chunks=k),
                                                       negative_prompts, None, dtype, min_chunks=k)
            pooled_negative = encoded.pooled
        return positive, negative, dataclasses.replace(added, pooled_negative=pooled_negative)  # type: ignore

    def _key(self, text_encoder: Engine, pair: tuple[str, str], dtype: torch.dtype, reader: PromptReader
             ) -> tuple[Any, ...]:
        return ("sdxl", id(text_encoder), id(self.text_encoder_2), *pair, dtype, reader.syntax, reader.max_chunks,
                reader.clip_skip)


#: Where :meth:`SdxlConditioning._encode_pairs` returns the empty chunk pair's states (not a pair of texts: texts
#: are strings).
_EMPTY_PAIR: tuple[Any, Any] = (None, None)


def _text_name(text: str, negatives: set[str], read: Sequence[Sequence[str]]) -> str | None:
    """The argument ``text`` came from, for its parse warnings ("prompt", "negative prompt"); ``None`` when the
    first encoder's reader has read it already (its warnings are out)."""
    if any(text in texts for texts in read):
        return None
    return "negative prompt" if text in negatives else "prompt"


def _first(empty: torch.Tensor | None) -> torch.Tensor:
    """The empty chunk pair [77, D1+D2] from its [1, 77, D1+D2] entry (a placeholder when no text is padded)."""
    return empty[0] if empty is not None else torch.empty(0)


def _encode_texts(engine: Engine, reader: PromptReader, chunks: Mapping[str, TokenChunks], with_empty: bool,
                  with_pooled: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, dict[str, torch.Tensor]]:
    """One encoder run over every text's chunks (and an empty chunk when ``with_empty``), the reader's embedding
    vectors fed: each text's weighted states [k_i, 77, D] (penultimate, or ``reader.clip_skip`` layers before it;
    float32 where weighted, the engine's dtype otherwise), the empty chunk's [77, D] (or ``None``) and, with
    ``with_pooled``, each text's first-chunk :data:`POOLED_OUTPUT` [E]."""
    ids = torch.cat([c.ids for c in chunks.values()] + ([reader.empty_chunk()] if with_empty else []))
    name = SKIP_OUTPUT if reader.clip_skip else HIDDEN_OUTPUT
    names = (POOLED_OUTPUT, name) if with_pooled else (name,)
    out = run_rows_outputs(engine, "input_ids", ids.to(engine.device), names, engine_feed(engine, reader.embeddings))
    hidden = out[name][:, reader.clip_skip - 1] if reader.clip_skip else out[name]
    rows: dict[str, torch.Tensor] = {}
    pooled: dict[str, torch.Tensor] = {}
    start = 0
    for text, c in chunks.items():
        z = hidden[start : start + c.chunks]
        rows[text] = apply_weights(z, c.weights) if c.weighted else z
        if POOLED_OUTPUT in out:
            pooled[text] = out[POOLED_OUTPUT][start]
        start += c.chunks
    return rows, hidden[-1] if with_empty else None, pooled


@dataclass(frozen=True)
class AddedConditioning:
    """SDXL's per-image ``text_embeds`` and the time ids, sliced per chunk into the UNet's extra inputs.

    Attributes:
        pooled: [B, E] positive pooled text embeddings (one row per image after :meth:`repeat_interleave`).
        pooled_negative: [B, E] negative ones, or ``None`` without CFG.
        time_ids, negative_time_ids: [6] float32 on the device.
    """

    pooled: torch.Tensor
    pooled_negative: torch.Tensor | None
    time_ids: torch.Tensor
    negative_time_ids: torch.Tensor

    def repeat_interleave(self, n: int) -> AddedConditioning:
        """One row per image: each prompt's row ``n`` times in a row (diffusers' ``repeat(1, n).view``)."""
        neg = self.pooled_negative.repeat_interleave(n, dim=0) if self.pooled_negative is not None else None
        return AddedConditioning(self.pooled.repeat_interleave(n, dim=0), neg, self.time_ids, self.negative_time_ids)

    def unet_inputs(self, rows: range, unet: Engine) -> dict[str, torch.Tensor]:
        """``text_embeds`` [b2, E] and ``time_ids`` [b2, 6] for images ``rows``: ``[negative; positive]`` with CFG."""
        b = len(rows)
        embeds = self.pooled[rows.start : rows.stop]
        ids = self.time_ids.expand(b, -1)
        if self.pooled_negative is not None:
            embeds = torch.cat([self.pooled_negative[rows.start : rows.stop], embeds])
            ids = torch.cat([self.negative_time_ids.expand(b, -1), ids])
        return {
            "text_embeds": embeds.to(unet.spec.input("text_embeds").torch_dtype).contiguous(),
            "time_ids": ids.to(unet.spec.input("time_ids").torch_dtype).contiguous(),
        }
