"""Textual-inversion embeddings (runtime/embeddings.py, the text encoder's ``embedding_vectors`` input): parity with
diffusers' ``load_textual_inversion`` on the same file, nothing changed without one, the file forms, bad input."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from transformers import CLIPTokenizer

from diffusion_trt.cli import main
from diffusion_trt.config import CompileConfig
from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.denoise import encode_prompt_embeds
from diffusion_trt.runtime.embeddings import Embedding, EmbeddingTable, read_embedding
from diffusion_trt.runtime.prompt_encoding import PromptReader

HIDDEN = 32  # the tiny text encoder's hidden size


def _vectors(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One file per form: A1111 .safetensors (emb_params, 3 vectors), A1111 .pt (string_to_param, 8 vectors, as
    EasyNegative), diffusers' single {token: [D]} .safetensors (1 vector) and .bin."""
    d = tmp_path_factory.mktemp("embeddings")
    save_file({"emb_params": _vectors(3, 1)}, str(d / "inkstyle.safetensors"))
    torch.save({"string_to_token": {"*": 265}, "string_to_param": {"*": torch.nn.Parameter(_vectors(8, 2))},
                "name": "easynegative", "step": 1000}, d / "easynegative.pt")
    save_file({"<cat-toy>": _vectors(1, 3)[0]}, str(d / "cattoy.safetensors"))
    torch.save({"<fox>": _vectors(1, 4)[0]}, d / "foxy.bin")
    return {p.stem: p for p in d.iterdir()}


@pytest.fixture(scope="module")
def pipe(tiny_artifact: Path) -> Iterator[EnginePipeline]:
    with EnginePipeline.from_artifacts(tiny_artifact) as p:
        yield p


@pytest.fixture(scope="module")
def old_artifact(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline compiled with the text encoder of before (no ``embedding_vectors`` input)."""
    from diffusion_trt.compiler.pipeline import compile_pipeline

    return compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp("old") / "tiny",
                            CompileConfig(max_embedding_vectors=0))


def _diffusers(folder: Path, files: dict[str, Path], names: list[str]) -> diffusers.StableDiffusionPipeline:
    ref = diffusers.StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    for name in names:
        ref.load_textual_inversion(str(files[name]), token=name)
    return ref


@pytest.mark.parametrize("name", ["cattoy", "inkstyle", "easynegative"])  # 1, 3 and 8 vectors
def test_embeds_match_diffusers_load_textual_inversion(pipe: EnginePipeline, tiny_pipeline_dir: Path,
                                                       files: dict[str, Path], name: str) -> None:
    ref = _diffusers(tiny_pipeline_dir, files, [name])
    prompts, negatives = [f"a {name} fox, ink", "a fox"], [f"{name}, lowres", ""]
    with torch.no_grad():
        want_pos, want_neg = ref.encode_prompt(prompts, "cpu", 1, True, negatives)
    pipe.load_textual_inversion(files[name])
    try:
        engines = pipe.loop_engines()
        reader = PromptReader(engines.tokenizer, "a1111", 1, 0, engines.embeddings)
        pos, neg = encode_prompt_embeds(engines.text_encoder, reader, prompts, negatives, torch.float32)
    finally:
        pipe.unload_textual_inversion()
    assert (pos - want_pos).abs().max() <= 1e-5 and (neg - want_neg).abs().max() <= 1e-5
    plain, _ = encode_prompt_embeds(engines.text_encoder, engines.tokenizer, prompts, None, torch.float32)
    assert (plain[0] - want_pos[0]).abs().max() > 1e-2  # unloaded: the name is plain text again


def test_image_matches_diffusers_with_a_negative_embedding(pipe: EnginePipeline, tiny_pipeline_dir: Path,
                                                           files: dict[str, Path]) -> None:
    ref = _diffusers(tiny_pipeline_dir, files, ["easynegative", "cattoy"])
    kwargs = {"prompt": "a cattoy on a hill", "negative_prompt": "easynegative, lowres", "num_inference_steps": 3}
    want = ref(**kwargs, generator=torch.Generator("cpu").manual_seed(3), output_type="np").images
    pipe.load_textual_inversion([files["easynegative"], files["cattoy"]])
    try:
        got = pipe(**kwargs, seed=3, output_type="np", progress=False).images
    finally:
        pipe.unload_textual_inversion()
    assert np.abs(got - want).max() < 1e-4
    plain = pipe(**kwargs, seed=3, output_type="np", progress=False).images
    assert np.abs(plain - got).max() > 1e-3


def test_nothing_changes_without_an_embedding(pipe: EnginePipeline, old_artifact: Path,
                                              files: dict[str, Path]) -> None:
    kwargs = {"prompt": "(a fox:1.2) in the snow", "negative_prompt": "lowres", "num_inference_steps": 2, "seed": 5,
              "output_type": "np", "progress": False}
    with EnginePipeline.from_artifacts(old_artifact) as old:
        want = old(**kwargs).images
        old_unet = old.engines["unet"].spec
        old_text = old.engines["text_encoder"].spec
    assert np.array_equal(pipe(**kwargs).images, want)  # bit for bit
    pipe.load_textual_inversion(files["inkstyle"])
    try:
        assert np.array_equal(pipe(**kwargs).images, want)  # loaded but not named in the prompt
    finally:
        pipe.unload_textual_inversion()
    # the speed path: the UNet is the same engine, the text encoder's batch profile is as before and the new input
    # follows it (batch B2 like input_ids, the rest fixed: a static artifact stays one shape / one CUDA graph)
    new_text = pipe.engines["text_encoder"].spec
    assert pipe.engines["unet"].spec.inputs == old_unet.inputs
    assert new_text.input("input_ids") == old_text.input("input_ids")
    vectors = new_text.input("embedding_vectors")
    ids = new_text.input("input_ids")
    assert vectors.shape == ("B2", 128, HIDDEN) and vectors.min == (ids.min[0], 128, HIDDEN)
    assert vectors.max == (ids.max[0], 128, HIDDEN)


def test_names_are_split_as_words_before_tokenizing(tiny_pipeline_dir: Path, files: dict[str, Path]) -> None:
    tok = CLIPTokenizer.from_pretrained(tiny_pipeline_dir / "tokenizer", local_files_only=True)
    table = EmbeddingTable(16, HIDDEN).add(read_embedding(files["inkstyle"])).add(read_embedding(files["cattoy"]))
    reader = PromptReader(tok, "a1111", 1, embeddings=table)
    assert table.token_ids("inkstyle") == [-16, -15, -14] and table.token_ids("CatToy") == [-13]
    chunk = reader.chunks("(InkStyle:1.3) inkstyles, cattoy")
    plain = tok(" inkstyles, ", add_special_tokens=False).input_ids
    ids = chunk.ids[0].tolist()
    assert ids[1:4] == [-16, -15, -14] and chunk.weights[0, 1:4].tolist() == pytest.approx([1.3] * 3)
    n = len(plain)
    assert ids[4 : 4 + n] == plain  # "inkstyles" is another word: tokenized as text
    assert ids[4 + n] == -13 and chunk.weights[0, 4 + n] == 1.0 and ids[5 + n] == tok.eos_token_id


def test_an_embedding_is_never_split_across_chunks(tiny_pipeline_dir: Path, files: dict[str, Path]) -> None:
    """A1111 moves an embedding that would cross a chunk's end to the next chunk; its 8 vectors were cut 2 + 6 and
    encoded in two unrelated contexts."""
    tok = CLIPTokenizer.from_pretrained(tiny_pipeline_dir / "tokenizer", local_files_only=True)
    table = EmbeddingTable(16, HIDDEN).add(read_embedding(files["easynegative"]))  # 8 vectors: ids -16..-9
    reader = PromptReader(tok, "a1111", 3, embeddings=table)
    word = tok("fox", add_special_tokens=False).input_ids
    assert len(word) == 1
    chunks = reader.chunks("fox " * 73 + "easynegative fox")
    ids = chunks.ids.tolist()
    assert chunks.chunks == 2
    assert ids[0][1:74] == word * 73 and ids[0][74] == tok.eos_token_id  # the 2 places left stay padding
    assert ids[1][1:11] == [*range(-16, -8), word[0], tok.eos_token_id]
    fits = reader.chunks("fox " * 67 + "easynegative")  # 67 + 8 = 75: fills the chunk
    assert fits.chunks == 1 and fits.ids[0, 68:76].tolist() == list(range(-16, -8))


@pytest.mark.parametrize("name", ["inkstyle", "easynegative", "cattoy", "foxy"])
def test_file_forms(files: dict[str, Path], name: str) -> None:
    emb = read_embedding(files[name])
    assert emb.name == name and emb.vectors.dtype == torch.float32
    assert emb.count == {"inkstyle": 3, "easynegative": 8, "cattoy": 1, "foxy": 1}[name]
    assert emb.vectors.shape == (emb.count, HIDDEN)


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pwned",))


def _bad_files(d: Path) -> dict[str, Path]:
    save_file({"emb_params": torch.zeros(2, 768)}, str(d / "wide.safetensors"))
    with open(d / "evil.pt", "wb") as f:
        pickle.dump({"string_to_param": {"*": _Evil()}}, f)
    save_file({"clip_l": torch.zeros(1, 768), "clip_g": torch.zeros(1, 1280)}, str(d / "xl.safetensors"))
    (d / "other").mkdir()
    save_file({"emb_params": torch.zeros(1, HIDDEN)}, str(d / "other" / "inkstyle.safetensors"))
    save_file({"a": torch.zeros(1, HIDDEN), "b": torch.zeros(1, HIDDEN)}, str(d / "twokeys.safetensors"))
    save_file({"emb_params": torch.zeros(200, HIDDEN)}, str(d / "many.safetensors"))
    save_file({"emb_params": torch.ones(2, HIDDEN, dtype=torch.int64)}, str(d / "ints.safetensors"))
    save_file({"text_encoder.x.q_proj.lora_A.weight": torch.zeros(2, HIDDEN),
               "text_encoder.x.q_proj.lora_B.weight": torch.zeros(HIDDEN, 2)}, str(d / "lora.safetensors"))
    return {"lora": d / "lora.safetensors", "wide": d / "wide.safetensors", "evil": d / "evil.pt",
            "xl": d / "xl.safetensors", "many": d / "many.safetensors",
            "clash": d / "other" / "inkstyle.safetensors", "twokeys": d / "twokeys.safetensors",
            "missing": d / "nope.safetensors", "folder": d / "other", "ints": d / "ints.safetensors"}


@pytest.mark.parametrize(("case", "message"), [
    ("wide", "has vectors of size 768; this artifact's text encoder takes 32"),
    ("evil", "is refused by torch's weights-only loader"),
    ("xl", "is an SDXL embedding (clip_l/clip_g)"),
    ("clash", "embedding name 'inkstyle'"),
    ("many", "embedding 'many' has 200 vectors and the loaded ones fill 3 of the artifact's 128 rows"),
    ("twokeys", "none of the textual-inversion forms"),
    # a LoRA given as --embedding listed its first keys and "none of the textual-inversion forms"
    ("lora", "is a LoRA (lora_* keys), not a textual-inversion embedding: pass it with --lora"),
    ("missing", "nope.safetensors does not exist"),
    ("ints", "the vectors are int64 values; textual-inversion vectors are floats"),  # ran as vectors before
    ("folder", "other is a directory; pass one embedding file in it (.safetensors, or .pt/.bin"),
])
def test_bad_embedding_is_one_error_line(tiny_artifact: Path, files: dict[str, Path], tmp_path: Path, case: str,
                                         message: str, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before any engine loads: the vector size and a name taken were refused after the load (the
    manifest's text encoder spec has what they need)."""
    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    bad = _bad_files(tmp_path)[case]
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "inkstyle", "--steps", "1",
                                       "--embedding", str(files["inkstyle"]), "--embedding", str(bad),
                                       "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.output
    assert not (tmp_path / "x.png").exists() and "pwned" not in capsys.readouterr().out + result.output


def test_a_pickle_refused_says_it_in_one_line_without_torchs_warning(tmp_path: Path) -> None:
    """`run --embedding evil.pt` (pickle protocol 4, the default) printed torch's two-line `UserWarning: Detected
    pickle protocol 4 ...` above the error: line."""
    from diffusion_trt.runtime.embeddings import check_embedding_file

    path = _bad_files(tmp_path)["evil"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning escaping the loader fails here
        with pytest.raises(RuntimeInputError, match="is refused by torch's weights-only loader"):
            check_embedding_file(path, False)


def test_a_pickle_refused_names_what_the_loader_refused(tmp_path: Path) -> None:
    """The message quoted the first line of torch's error: for a torch.save file 'Weights only load failed. This file
    can still be loaded, to do so you have two options, \\x1b[1mdo those steps ...\\x1b[0m.' (the options not shown,
    bold codes escaped by the CLI), for a plain pickle three sentences on weights_only's default; it now quotes what
    the loader refused."""
    from diffusion_trt.runtime.embeddings import check_embedding_file

    saved = tmp_path / "saved.pt"
    torch.save({"string_to_param": {"*": torch.zeros(1, HIDDEN)}, "x": _Evil()}, saved)
    for path, refused in ((saved, "(Unsupported global: GLOBAL print was not an allowed global by default)"),
                          (_bad_files(tmp_path)["evil"], "(Unsupported operand 149)")):
        with pytest.raises(RuntimeInputError) as info:
            check_embedding_file(path, False)
        assert refused in str(info.value) and "\x1b" not in str(info.value), str(info.value)


def test_a_safetensors_file_named_bin_is_read_as_safetensors(tmp_path: Path) -> None:
    """A hub embedding saved with safetensors under ``learned_embeds.bin``: torch's weights-only loader refused it as
    an unsafe pickle ("loading it fully would run arbitrary code"), which it is not."""
    path = tmp_path / "learned_embeds.bin"
    save_file({"<ink>": _vectors(1, 2)[0]}, str(path))
    emb = read_embedding(path)
    assert emb.name == "learned_embeds" and emb.count == 1
    torch.testing.assert_close(emb.vectors[0], _vectors(1, 2)[0].float())


def test_old_artifact_runs_and_refuses_embeddings(old_artifact: Path, files: dict[str, Path], tmp_path: Path) -> None:
    ok = CliRunner().invoke(main, ["run", str(old_artifact), "-p", "a fox", "--steps", "1", "-o",
                                   str(tmp_path / "a.png")])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(main, ["run", str(old_artifact), "-p", "a fox", "-n", "easynegative", "--steps", "1",
                                    "--embedding", str(files["easynegative"]), "-o", str(tmp_path / "b.png")])
    assert bad.exit_code == 2
    assert "error:" in bad.output and "recompile it (compile --max-embedding-vectors 128)" in bad.output


def test_run_with_embeddings(tiny_artifact: Path, files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "e.png"
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "a cattoy", "-n", "easynegative, lowres",
                                       "--embedding", str(files["easynegative"]), "--embedding", str(files["cattoy"]),
                                       "--steps", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file()
    assert result.output.count("embedding 'easynegative': ") == 1  # the check before the load says nothing
    assert "changes nothing" not in result.output
    # a misspelt name: the embedding would change nothing, and the run says so (it still runs: plain text is valid)
    typo = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "a fox", "-n", "easy_negative, lowres",
                                     "--embedding", str(files["easynegative"]), "--steps", "1", "-o",
                                     str(tmp_path / "t.png")])
    assert typo.exit_code == 0, typo.output
    assert "warning: --embedding: 'easynegative' is named in neither --prompt nor --negative-prompt, so it changes " \
        "nothing" in typo.output


def test_run_warns_of_an_embedding_name_the_prompt_syntax_reads_as_weights(files: dict[str, Path], tiny_artifact: Path,
                                                                          tmp_path: Path) -> None:
    """`neg(v2)` in an A1111 prompt is `neg` and a weighted `v2`, so the embedding `neg(v2).safetensors` changed
    nothing, and no warning said so (the check read the raw text, where the name is)."""
    path = tmp_path / "neg(v2).safetensors"
    path.write_bytes(files["inkstyle"].read_bytes())

    def run(negative: str, *args: str) -> str:
        result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "a fox", "-n", negative, "--embedding",
                                           str(path), "--steps", "1", "-o", str(tmp_path / "o.png"), "--overwrite",
                                           *args])
        assert result.exit_code == 0, result.output
        return result.output

    assert "warning: --embedding: 'neg(v2)' is written in the prompts, but the A1111 prompt syntax reads its " \
        "brackets as weights (or BREAK as a chunk break), so it changes nothing; write it neg\\(v2\\), or pass " \
        "--prompt-syntax plain" in run("neg(v2), lowres")
    assert "changes nothing" not in run("neg\\(v2\\), lowres")
    assert "changes nothing" not in run("neg(v2), lowres", "--prompt-syntax", "plain")


def test_table_rows_are_bounded_and_loading_is_all_or_nothing(pipe: EnginePipeline, files: dict[str, Path]) -> None:
    full = EmbeddingTable(10, HIDDEN).add(read_embedding(files["easynegative"]))
    with pytest.raises(RuntimeInputError, match="fill 8 of the artifact's 10 rows; recompile with a larger"):
        full.add(read_embedding(files["inkstyle"]))
    with pytest.raises(RuntimeInputError, match="does not exist"):
        pipe.load_textual_inversion([files["cattoy"], files["cattoy"].with_name("gone.safetensors")])
    assert pipe.embeddings is None  # the first file of the failed call is not loaded either
    assert pipe.load_textual_inversion(files["cattoy"], token="<cat-toy>") == ["<cat-toy>"]
    pipe.unload_textual_inversion()
    with pytest.raises(RuntimeInputError, match="does not pair"):
        pipe.load_textual_inversion([files["cattoy"], files["foxy"]], token="x")
    assert Embedding("a", torch.zeros(2, 4), Path("a.pt")).count == 2


def test_compile_refuses_a_bad_max_embedding_vectors(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"),
                                       "--max-embedding-vectors", "2000"])
    assert result.exit_code == 2 and "error: --max-embedding-vectors 2000 must be in 0..1024" in result.output


def test_sdxl_artifact_refuses_one_encoder_embeddings(tiny_sdxl_artifact: Path, files: dict[str, Path]) -> None:
    """SDXL takes the two-encoder form (tests/runtime/test_sdxl_embeddings.py); an SD 1.x/2.x file is refused."""
    with EnginePipeline.from_artifacts(tiny_sdxl_artifact) as sdxl:
        with pytest.raises(RuntimeInputError, match=r"is a one-encoder \(SD 1\.x/2\.x\) embedding; an SDXL"):
            sdxl.load_textual_inversion(files["cattoy"])
        assert sdxl.embeddings is None and sdxl.embeddings_2 is None


def test_a_name_taken_by_token_says_to_change_the_token() -> None:
    """``load_textual_inversion([a, b], token=["foo", "foo"])`` said 'rename one of the files (the name is the file
    stem)': renaming a file changes nothing there; the file stems keep that fix."""
    def emb(name: str, file: str) -> Embedding:
        return Embedding(name, torch.zeros(1, 4), Path(file))

    table = EmbeddingTable(8, 4).add(emb("foo", "a.safetensors"))
    with pytest.raises(RuntimeInputError, match=r"is taken by a\.safetensors; give each its own token=$"):
        table.add(emb("foo", "b.safetensors"))
    with pytest.raises(RuntimeInputError, match=r"rename one of the files \(the name is the file stem\)$"):
        EmbeddingTable(8, 4).add(emb("a", "x/a.safetensors")).add(emb("a", "y/a.safetensors"))
