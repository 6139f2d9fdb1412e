"""compile's prompt options: --max-prompt-chunks (the UNet's context axis) and --max-clip-skip (the text encoder's
extra output), decided per model and profile without compiling."""

from __future__ import annotations

import logging

import pytest

from diffusion_trt.compiler.components import component_specs, tensor_manifest
from diffusion_trt.compiler.pipeline import clip_skip_for, pass_options, prompt_chunks_for
from diffusion_trt.config import CompileConfig, ShapeProfile
from diffusion_trt.errors import RuntimeInputError

SD = {"architecture": "sd", "text_encoder_layers": 12}
SDXL = {"architecture": "sdxl", "text_encoder_layers": 12}
SIZES = {"text_hidden": 32, "text_len": 77, "unet_in": 4, "unet_out": 4, "latent": 4}


def _profile(static: bool) -> ShapeProfile:
    config = CompileConfig(**({"min_batch_size": 1, "max_batch_size": 1, "min_height": 64, "max_height": 64,
                               "min_width": 64, "max_width": 64} if static else {}))
    return config.resolve_profile(64)


@pytest.mark.parametrize("facts", [SD, SDXL])
def test_dynamic_profile_takes_the_chunks_asked(caplog: pytest.LogCaptureFixture, facts: dict) -> None:
    assert prompt_chunks_for(CompileConfig(), _profile(False), facts) == 3
    assert prompt_chunks_for(CompileConfig(max_prompt_chunks=5), _profile(False), facts) == 5


def test_sdxl_unet_context_is_77_k_with_chunks() -> None:
    unet = component_specs(**SIZES, text_hidden_2=48, text_embeds=40, prompt_chunks=3)["unet"]
    context = tensor_manifest(unet.inputs[2], "fp32", _profile(False), unet.symbols)
    assert (context["name"], context["min"][1:], context["max"][1:]) == ("encoder_hidden_states", [77, 80], [231, 80])
    assert component_specs(**SIZES, text_hidden_2=48, text_embeds=40)["unet"].inputs[2].shape[1] == 77


@pytest.mark.parametrize("facts", [SD, SDXL])
def test_static_profile_keeps_77_tokens(caplog: pytest.LogCaptureFixture, facts: dict) -> None:
    with caplog.at_level(logging.INFO, logger="diffusion_trt"):
        assert prompt_chunks_for(CompileConfig(), _profile(True), facts) == 1
        assert "77 tokens" not in caplog.text  # the default: said at DEBUG (INFO lines reach the CLI's output)
        assert prompt_chunks_for(CompileConfig(max_prompt_chunks=4), _profile(True), facts) == 1
    assert "max_prompt_chunks=4: the UNet takes 77 tokens only" in caplog.text


def test_static_profile_pins_the_context_of_a_one_chunk_unet() -> None:
    spec = component_specs(**SIZES, prompt_chunks=1)["unet"]
    options = pass_options(spec, _profile(True))
    assert options["static_shapes"]["encoder_hidden_states"] == [2, 77, 32]


def test_manifest_entry_of_a_long_context() -> None:
    spec = component_specs(**SIZES, prompt_chunks=3)["unet"]
    entry = tensor_manifest(spec.inputs[2], "fp32", _profile(False), spec.symbols)
    assert entry["shape"] == ["B2", "S", 32]
    assert [entry["min"][1], entry["opt"][1], entry["max"][1]] == [77, 77, 231]


def test_clip_skip_is_capped_at_the_layers_less_one(caplog: pytest.LogCaptureFixture) -> None:
    assert clip_skip_for(CompileConfig(), SD) == 2
    with caplog.at_level(logging.INFO, logger="diffusion_trt"):
        assert clip_skip_for(CompileConfig(), {"architecture": "sd", "text_encoder_layers": 2}) == 1
        assert "clip skip" not in caplog.text  # the default is capped quietly (INFO lines reach the CLI's output)
        assert clip_skip_for(CompileConfig(max_clip_skip=3), {"architecture": "sd", "text_encoder_layers": 2}) == 1
    assert "max_clip_skip=3: the text encoder has 2 layers; clip skip goes up to 1" in caplog.text
    assert [r.levelno for r in caplog.records if "max_clip_skip=3" in r.getMessage()] == [logging.WARNING]
    outputs = component_specs(**SIZES, clip_skip=2)["text_encoder"].outputs
    assert [(t.name, t.shape) for t in outputs] == [("last_hidden_state", ("B2", 77, 32)),
                                                     ("clip_skip_states", ("B2", 2, 77, 32))]


def test_sdxl_clip_skip_is_capped_by_the_smaller_encoder_and_given_by_both() -> None:
    sdxl = {"architecture": "sdxl", "text_encoder_layers": 12, "text_encoder_2_layers": 32}
    assert clip_skip_for(CompileConfig(), sdxl) == 2
    assert clip_skip_for(CompileConfig(max_clip_skip=11), sdxl) == 11  # hidden_states[-13]: text_encoder's [0]
    assert clip_skip_for(CompileConfig(), {**sdxl, "text_encoder_layers": 2}) == 1
    assert clip_skip_for(CompileConfig(max_clip_skip=0), sdxl) == 0
    specs = component_specs(**SIZES, text_hidden_2=48, text_embeds=24, clip_skip=2, embedding_vectors=4)
    assert [(t.name, t.shape) for t in specs["text_encoder"].outputs] == [
        ("penultimate_hidden_state", ("B2", 77, 32)), ("clip_skip_states", ("B2", 2, 77, 32))]
    assert [(t.name, t.shape) for t in specs["text_encoder_2"].outputs] == [
        ("text_embeds", ("B2", 24)), ("penultimate_hidden_state", ("B2", 77, 48)),
        ("clip_skip_states", ("B2", 2, 77, 48))]
    assert [(t.name, t.shape) for t in specs["text_encoder_2"].inputs] == [
        ("input_ids", ("B2", 77)), ("embedding_vectors", ("B2", 4, 48))]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_prompt_chunks", 0, "max_prompt_chunks=0 must be in 1..8"),
    ("max_prompt_chunks", "3", "max_prompt_chunks='3' must be an integer"),
    ("max_clip_skip", -1, "max_clip_skip=-1 must be in 0..11"),
    ("max_clip_skip", True, "max_clip_skip=True must be an integer"),
    ("max_embedding_vectors", -1, "max_embedding_vectors=-1 must be in 0..1024"),
    ("max_embedding_vectors", 1.5, "max_embedding_vectors=1.5 must be an integer"),
])
def test_config_refuses_bad_values(field: str, value: object, message: str) -> None:
    with pytest.raises(RuntimeInputError, match=message.replace("(", r"\(").replace(".", r"\.")):
        CompileConfig(**{field: value})
