"""The text encoder's ``embedding_vectors`` input (compile --max-embedding-vectors): ids -N..-1 read its rows, ids
>= 0 the model's own table; what diffusers' load_textual_inversion does by growing the table (ids V..V+N-1)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from diffusion_trt.compiler import export
from diffusion_trt.compiler.components import component_specs


@pytest.fixture(scope="module")
def text_encoder(tiny_pipeline_dir: Path) -> torch.nn.Module:
    return export.load_models(export.check_model_folder(tiny_pipeline_dir), "fp32", "cpu")["text_encoder"]


@torch.no_grad()
def test_negative_ids_read_the_vectors_as_a_grown_table_would(text_encoder: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    n, vocab = 6, text_encoder.get_input_embeddings().num_embeddings
    vectors = torch.randn(3, n, 32, generator=g)  # each text row its own vectors
    ids = torch.randint(0, vocab, (3, 77), generator=g)
    ids[:, 3:7] = torch.tensor([-6, -1, -3, -6])
    got_last, got_skip = export._TextEncoder(text_encoder, clip_skip=1, vectors=n)(ids, vectors)
    for row in range(3):  # diffusers' way: the new tokens are rows V..V+n-1 of a larger table
        grown = copy.deepcopy(text_encoder)
        grown.resize_token_embeddings(vocab + n)
        grown.get_input_embeddings().weight[vocab:] = vectors[row]
        ids_row = torch.where(ids[row : row + 1] < 0, ids[row : row + 1] + n + vocab, ids[row : row + 1])
        want_last, want_skip = export._TextEncoder(grown, clip_skip=1)(ids_row)
        assert (got_last[row] - want_last[0]).abs().max() <= 1e-6
        assert (got_skip[row] - want_skip[0]).abs().max() <= 1e-6
    plain = export._TextEncoder(text_encoder, clip_skip=1)(ids.clamp(min=0))[0]
    assert (plain - got_last).abs().max() > 1e-3  # the vectors are read, not the table's row 0


@torch.no_grad()
def test_ids_of_the_vocabulary_give_the_states_of_before_bit_for_bit(text_encoder: torch.nn.Module) -> None:
    ids = torch.randint(0, 1000, (2, 77), generator=torch.Generator().manual_seed(1))
    vectors = torch.randn(2, 4, 32)
    with_vectors = export._TextEncoder(text_encoder, vectors=4)(ids, vectors)
    assert torch.equal(with_vectors, export._TextEncoder(text_encoder)(ids))
    assert text_encoder.get_input_embeddings().__class__ is torch.nn.Embedding  # the wrapper put the table back


def test_the_input_is_in_the_sd_table_only() -> None:
    sd = component_specs(text_hidden=32, text_len=77, unet_in=4, unet_out=4, latent=4, embedding_vectors=16)
    assert [(t.name, t.shape) for t in sd["text_encoder"].inputs] == [("input_ids", ("B2", 77)),
                                                                       ("embedding_vectors", ("B2", 16, 32))]
    none = component_specs(text_hidden=32, text_len=77, unet_in=4, unet_out=4, latent=4)
    assert [t.name for t in none["text_encoder"].inputs] == ["input_ids"]
