"""Long and weighted prompts on a 77-token CLIP text encoder: A1111's chunking and emphasis.

A prompt, parsed by :func:`~.prompt_syntax.parse_prompt`, becomes k chunks of 75 tokens (``BREAK`` starts a new
one; as in A1111, a ``BREAK`` with no token after it adds no chunk); each chunk is laid out as diffusers lays out a
whole prompt, ``[BOS, t1..tn, EOS, pad...]`` to 77 (pad = ``tokenizer.pad_token_id``), so a prompt of one chunk is
encoded exactly as diffusers encodes it. The chunks are
encoded independently and concatenated along the sequence: ``[77 k, D]``. Every text of a request is padded to the
request's largest k with the embedding of an empty chunk (as A1111 pads the negative prompt), and k is capped at
what the UNet engine accepts (``encoder_hidden_states`` up to 77 * max_chunks, ``compile --max-prompt-chunks``).

Emphasis (A1111's "Original" method, re-implemented from its description): each chunk's states ``z`` [77, D] are
multiplied position-wise by the tokens' weights (1.0 for BOS/EOS/padding), then rescaled so that their mean over
the chunk is the mean before weighting: ``z' = z * w[:, None]; z' *= mean(z) / mean(z')``. A1111 takes that mean
over the whole batch of the chunk (one prompt's result then depends on its batch companions); here it is taken per
prompt. A chunk whose weights are all 1.0 is left as the encoder gave it, and one whose mean before or after
weighting is ~0 (below :data:`MEAN_FLOOR` of its mean absolute value, where the ratio is inf, NaN or wildly off) is
left weighted but not rescaled.

An embedding's vectors (:mod:`.embeddings`) stay in one chunk, as A1111 keeps them: one that would cross a chunk's
end starts the next chunk (the rest of the chunk is padding); only one longer than a chunk is split.

Differences from A1111 kept on purpose: no "comma backtrack" (A1111 moves a chunk break back to a comma within 20
tokens); the EOS follows the last token, not at position 76 (the same for SD 1.x, whose pad is EOS).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .prompt_syntax import ParsedPrompt, parse_prompt

if TYPE_CHECKING:  # annotations only: export-triton copies this file and prompt_syntax.py alone (serve/triton_model.py)
    from .embeddings import EmbeddingTable

logger = logging.getLogger(__name__)

#: Tokens of a chunk between its BOS and EOS (CLIP's 77 positions less the two).
CHUNK_TOKENS = 75
#: A chunk mean below this fraction of the chunk's mean absolute value counts as zero (no rescale, see above).
MEAN_FLOOR = 1e-3


@dataclass(frozen=True)
class TokenChunks:
    """A prompt's token ids and weights, chunk by chunk.

    Attributes:
        ids: [k, 77] int64 token ids, each row ``[BOS, tokens, EOS, pad...]``.
        weights: [k, 77] float32 per-position weights (1.0 for BOS/EOS/padding).
        truncated: tokens beyond ``max_chunks`` chunks were dropped.
    """

    ids: torch.Tensor
    weights: torch.Tensor
    truncated: bool = False

    @property
    def chunks(self) -> int:
        return int(self.ids.shape[0])

    @property
    def weighted(self) -> bool:
        return bool((self.weights != 1.0).any())


@dataclass(frozen=True)
class PromptReader:
    """How a request's texts become token chunks: the tokenizer, the syntax and the UNet's chunk limit.

    Attributes:
        tokenizer: a ``CLIPTokenizer`` (``model_max_length`` 77, ``bos_token_id``, ``eos_token_id``,
            ``pad_token_id``).
        syntax: "a1111" or "plain" (:data:`~.prompt_syntax.SYNTAXES`).
        max_chunks: the most chunks a text may have (>= 1); more are dropped with a warning.
        clip_skip: 0 = the text encoder's last hidden state; c >= 1 = diffusers' ``clip_skip=c``: the
            final-layer-normed ``hidden_states[-(c + 1)]`` (the engine's ``clip_skip_states`` row c-1). A1111's
            "Clip skip 2" is c = 1. SDXL reads its own outputs (:mod:`.sdxl`: ``hidden_states[-(c + 2)]``).
        embeddings: the loaded textual-inversion embeddings (their names become their token ids, see
            :mod:`.embeddings`); ``None`` = none.
    """

    tokenizer: Any
    syntax: str = "a1111"
    max_chunks: int = 1
    clip_skip: int = 0
    embeddings: EmbeddingTable | None = None

    def states(self, outputs: dict[str, Any]) -> Any:
        """The states this reader takes from the text encoder's ``outputs`` (see :attr:`clip_skip`)."""
        if not self.clip_skip:
            return outputs["last_hidden_state"]
        return outputs["clip_skip_states"][:, self.clip_skip - 1]

    @property
    def output(self) -> str:
        """The text-encoder output :meth:`states` reads."""
        return "clip_skip_states" if self.clip_skip else "last_hidden_state"

    @property
    def length(self) -> int:
        """Positions per chunk: ``tokenizer.model_max_length`` (77)."""
        return int(self.tokenizer.model_max_length)

    def parse(self, text: str, name: str | None = "prompt") -> ParsedPrompt:
        """``text`` parsed in this reader's syntax; unbalanced brackets and the like are logged as warnings naming
        ``name`` (the text's argument: "prompt", "negative prompt"), none when ``None`` (a text already read)."""
        parsed = parse_prompt(text, self.syntax, name or "prompt")
        for line in parsed.warnings if name is not None else ():
            logger.warning("%s", line)
        return parsed

    def chunks(self, text: str, name: str | None = "prompt") -> TokenChunks:
        """The token chunks of ``text`` (see the module docstring); ``name`` as :meth:`parse` takes it."""
        tok, body = self.tokenizer, self.length - 2
        parts: list[list[tuple[int, float]]] = []
        for part in self.parse(text, name).parts:
            rows: list[list[tuple[int, float]]] = [[]]
            for seg in part:
                for unit in self.token_units(seg.text):
                    if rows[-1] and len(rows[-1]) + len(unit) > body and len(unit) <= body:
                        rows.append([])  # an embedding that would cross the chunk's end starts the next one
                    for t in unit:
                        if len(rows[-1]) == body:
                            rows.append([])
                        rows[-1].append((t, seg.weight))
            parts.extend(rows)
        if len(parts) > 1 and not parts[-1]:  # "a BREAK": A1111 keeps no empty chunk after the last BREAK
            parts.pop()
        truncated = len(parts) > self.max_chunks
        ids = torch.full((min(len(parts), self.max_chunks), self.length), tok.pad_token_id, dtype=torch.int64)
        weights = torch.ones(ids.shape, dtype=torch.float32)
        for row, tokens in enumerate(parts[: self.max_chunks]):
            ids[row, 0] = tok.bos_token_id
            ids[row, len(tokens) + 1] = tok.eos_token_id
            if tokens:
                ids[row, 1 : len(tokens) + 1] = torch.tensor([t for t, _ in tokens])
                weights[row, 1 : len(tokens) + 1] = torch.tensor([w for _, w in tokens])
        return TokenChunks(ids, weights, truncated)

    def token_units(self, text: str) -> list[list[int]]:
        """The token ids of one segment text, without BOS/EOS, in the units a chunk must not split: one list per
        token, one per embedding named (its negative ids, :meth:`~.embeddings.EmbeddingTable.tokenize_units`)."""
        def tokenize(piece: str) -> list[int]:
            return self.tokenizer(piece, add_special_tokens=False, truncation=False, verbose=False).input_ids

        if self.embeddings is not None:
            return self.embeddings.tokenize_units(text, tokenize)
        return [[t] for t in tokenize(text)]

    def empty_chunk(self) -> torch.Tensor:
        """[1, 77] ids of an empty chunk ``[BOS, EOS, pad...]``: what shorter texts are padded with."""
        return self.chunks("", None).ids


def apply_weights(states: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A1111's emphasis on one text's chunks: ``states`` [k, 77, D] times ``weights`` [k, 77], each chunk rescaled to
    its mean before weighting (module docstring). Computed in float32; returns float32 [k, 77, D]."""
    z = states.float()
    w = weights.to(device=z.device, dtype=torch.float32)
    out = z * w[..., None]
    before = z.mean(dim=(1, 2), keepdim=True)
    after = out.mean(dim=(1, 2), keepdim=True)
    # a mean of (about) zero makes the ratio meaningless: layer-normed states without a bias average to ~0, and
    # dividing by it gives inf/NaN or shrinks the chunk to ~0 (A1111 divides anyway); such a chunk stays unscaled
    scale = MEAN_FLOOR * z.abs().mean(dim=(1, 2), keepdim=True)
    degenerate = (before.abs() <= scale) | (after.abs() <= scale)
    scaled = torch.where(degenerate, out, out * (before / torch.where(degenerate, torch.ones_like(after), after)))
    plain = (w == 1.0).all(dim=1)[:, None, None]  # unweighted chunks stay exactly as encoded
    return torch.where(plain, z, scaled)


def pad_chunks(states: torch.Tensor, chunks: int, empty: torch.Tensor) -> torch.Tensor:
    """``states`` [k, 77, D] padded to ``chunks`` chunks with ``empty`` [77, D]; returns [77 * chunks, D]."""
    k = states.shape[0]
    if k < chunks:
        states = torch.cat([states, empty[None].to(states.dtype).expand(chunks - k, *empty.shape)])
    return states.reshape(-1, states.shape[-1])


def warn_truncated(texts: Sequence[str], chunks: Sequence[TokenChunks], negatives: set[str], reader: PromptReader
                   ) -> None:
    """One warning line per text cut at ``reader.max_chunks`` chunks."""
    for text, c in zip(texts, chunks, strict=True):
        if c.truncated:
            logger.warning("%s truncated to %d chunk(s) of %d CLIP tokens (the UNet engine's limit, compile "
                           "--max-prompt-chunks): %.60r...", "negative prompt" if text in negatives else "prompt",
                           reader.max_chunks, CHUNK_TOKENS, text)
