"""An independent reference for long and weighted prompts: transformers' CLIP on hand-built chunks, with the
arithmetic runtime/prompt_encoding.py documents (no code of the runtime is used here)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def chunk_rows(tokenizer, parts: Sequence[Sequence[tuple[str, float]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``parts`` (text split at BREAK by hand, each a list of (text, weight) runs) as [k, 77] ids and weights: 75
    tokens a chunk, ``[BOS, tokens, EOS, pad...]``."""
    ids, weights = [], []
    for part in parts:
        tokens = [(t, w) for text, w in part for t in tokenizer(text, add_special_tokens=False).input_ids]
        for start in range(0, max(len(tokens), 1), 75):
            chunk = tokens[start : start + 75]
            pad = 75 - len(chunk)
            ids.append([tokenizer.bos_token_id, *(t for t, _ in chunk), tokenizer.eos_token_id]
                       + [tokenizer.pad_token_id] * pad)
            weights.append([1.0, *(w for _, w in chunk), 1.0] + [1.0] * pad)
    return torch.tensor(ids), torch.tensor(weights)


@torch.no_grad()
def reference_states(text_encoder, tokenizer, parts: Sequence[Sequence[tuple[str, float]]],
                     chunks: int | None = None) -> torch.Tensor:
    """[77 k, D] float32: each chunk's last hidden state, weighted and rescaled to its mean, padded to ``chunks``
    chunks with the empty prompt's chunk."""
    ids, w = chunk_rows(tokenizer, parts)
    z = text_encoder(ids).last_hidden_state.float()
    weighted = z * w[..., None]
    rescaled = weighted * (z.mean(dim=(1, 2), keepdim=True) / weighted.mean(dim=(1, 2), keepdim=True))
    z = torch.where((w == 1).all(dim=1)[:, None, None], z, rescaled)
    if chunks is not None and chunks > z.shape[0]:
        empty_ids, _ = chunk_rows(tokenizer, [[]])
        empty = text_encoder(empty_ids).last_hidden_state.float()
        z = torch.cat([z, empty.expand(chunks - z.shape[0], -1, -1)])
    return z.reshape(-1, z.shape[-1])
