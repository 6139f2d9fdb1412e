"""runtime/tokenizer.py: the ``tokenizers`` CLIP tokenizer gives transformers' ``CLIPTokenizer`` ids, and loading an
artifact imports no transformers."""

from __future__ import annotations

import json
import random
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from diffusion_trt.artifact.reader import ArtifactReader
from diffusion_trt.compiler.dummy import write_clip_tokenizer
from diffusion_trt.compiler.pipeline import ensure_tokenizer_json
from diffusion_trt.errors import ArtifactError
from diffusion_trt.runtime.tokenizer import ClipTokenizer, load_tokenizer

from .toy import write_toy_artifact

TEXTS = [
    "", "a photo of an astronaut riding a horse", "(ink wash:1.3), misty mountains, [lowres]", "Hello,   World!!  it's",
    "a\tb\nc  ", "<|endoftext|> x <|startoftext|>", "don't stop'em 123 4.5e6", "中国山水画, 水墨", "café naïve Ünïcode",
    "emoji 😀 ok", "\x07bell\x00", "word " * 120,
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    alphabet = string.printable + "中文山水éüß😀"
    return TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 90))) for _ in range(600)]


@pytest.fixture(scope="module", params=["<|endoftext|>", "!"], ids=["sd1-pad", "openclip-pad"])
def both(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[ClipTokenizer, object]:
    from transformers import CLIPTokenizer

    folder = tmp_path_factory.mktemp("tok")
    write_clip_tokenizer(folder, pad_token=request.param)
    reference = CLIPTokenizer.from_pretrained(folder, local_files_only=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    return ClipTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")), config), reference


def test_ids_equal_transformers_clip_tokenizer(both: tuple[ClipTokenizer, object]) -> None:
    ours, ref = both
    assert (ours.model_max_length, ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        ref.model_max_length, ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    for text in _corpus():
        assert ours(text, add_special_tokens=False, truncation=False).input_ids == ref(
            text, add_special_tokens=False, truncation=False).input_ids, text
        assert ours(text, truncation=False).input_ids == ref(text, truncation=False).input_ids, text


def test_padded_truncated_batch_equals_transformers(both: tuple[ClipTokenizer, object]) -> None:
    ours, ref = both
    texts = _corpus()[:64]
    got = ours(texts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    want = ref(texts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    assert got.dtype == torch.int64 and got.shape == (64, 77)
    assert torch.equal(got, want)


def test_unsupported_arguments_are_refused(both: tuple[ClipTokenizer, object]) -> None:
    ours, _ = both
    with pytest.raises(ValueError, match="padding='max_length'"):
        ours("a", padding="longest")
    with pytest.raises(ValueError, match="one length"):
        ours(["a", "a b c"], return_tensors="pt")


def test_ensure_tokenizer_json_writes_the_transformers_bpe(tmp_path: Path) -> None:
    from transformers import CLIPTokenizer

    write_clip_tokenizer(tmp_path)
    written = (tmp_path / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").unlink()  # an SD-1.5 repository's folder: vocab.json + merges.txt only
    ensure_tokenizer_json(tmp_path)
    rebuilt = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ref = CLIPTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in _corpus()[:200]:
        assert rebuilt.encode(text, add_special_tokens=False).ids == ref(text, add_special_tokens=False).input_ids
    (tmp_path / "tokenizer.json").write_text(written)
    ensure_tokenizer_json(tmp_path)  # one that exists is kept
    assert (tmp_path / "tokenizer.json").read_text() == written


def test_artifact_without_tokenizer_json_loads_transformers_tokenizer(tmp_path: Path) -> None:
    from transformers import CLIPTokenizer

    cache = tmp_path / "cache"
    write_clip_tokenizer(cache)
    (cache / "tokenizer.json").unlink()
    art = write_toy_artifact(tmp_path / "art", tokenizer_cache=cache)
    with ArtifactReader.open(art) as reader:
        assert not reader.lists("tokenizer/tokenizer.json")
        assert isinstance(load_tokenizer(reader, "tokenizer", "tokenizer"), CLIPTokenizer)


def test_artifact_tokenizer_json_that_does_not_parse_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    write_clip_tokenizer(cache)
    (cache / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    art = write_toy_artifact(tmp_path / "art", tokenizer_cache=cache)
    with ArtifactReader.open(art) as reader, pytest.raises(ArtifactError, match="cannot load the tokenizer from"):
        load_tokenizer(reader, "tokenizer", "tokenizer")


def test_loading_an_artifact_imports_no_transformers(toy_artifact: Path) -> None:
    code = ("import sys; from diffusion_trt.runtime.pipeline import EnginePipeline\n"
            f"pipe = EnginePipeline.from_artifacts({str(toy_artifact)!r}, device='cpu')\n"
            "assert type(pipe.tokenizer).__name__ == 'ClipTokenizer', type(pipe.tokenizer)\n"
            "pipe(prompt='a cat', num_inference_steps=1, output_type='latent')\n"
            "print(sorted(m for m in sys.modules if m == 'transformers' or m.startswith('transformers.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
