"""Runtime fixtures: the toy artifact (hand-built graphs, milliseconds) and a loaded pipeline on it; the tiny
ControlNets and the artifacts compiled with them that several test modules share (session-scoped: compiled once)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime.toy import write_toy_artifact


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder the real CLIP tokenizer is written to once and copied from."""
    return tmp_path_factory.mktemp("clip_tokenizer")


@pytest.fixture(scope="session")
def toy_artifact(tmp_path_factory: pytest.TempPathFactory, tokenizer_cache: Path) -> Path:
    """Toy artifact: batch 1..4, height and width 32..128 (default 64)."""
    return write_toy_artifact(tmp_path_factory.mktemp("toy") / "art", tokenizer_cache=tokenizer_cache)


@pytest.fixture(scope="module")
def toy_pipe(toy_artifact: Path) -> Iterator[object]:
    from diffusion_trt.runtime import EnginePipeline

    with EnginePipeline.from_artifacts(toy_artifact) as pipe:
        yield pipe


@pytest.fixture(scope="session")
def old_sdxl_artifact(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sdxl compiled with the text encoders of before SDXL clip skip and textual inversion (no
    ``clip_skip_states`` output, no ``embedding_vectors`` input)."""
    from diffusion_trt.compiler.pipeline import compile_pipeline
    from diffusion_trt.config import CompileConfig

    return compile_pipeline(tiny_sdxl_dir, tmp_path_factory.mktemp("old-sdxl") / "tiny-sdxl",
                            CompileConfig(max_clip_skip=0, max_embedding_vectors=0))


# -- ControlNets (tests/runtime/test_controlnet_parity.py, test_controlnet_serve.py) -----------------------------

#: The components of the --refittable ControlNet artifacts (and of their merged-LoRA reference).
CN_LORA_COMPONENTS = ("text_encoder", "unet", "vae_decoder")


@pytest.fixture(scope="session")
def controlnet_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffusion_trt.compiler.dummy_controlnet import write_dummy_controlnet

    root = tmp_path_factory.mktemp("controlnets")
    return {"a": write_dummy_controlnet(root / "a", "tiny", seed=0), "b": write_dummy_controlnet(root / "b", "tiny",
                                                                                                   seed=5)}


@pytest.fixture(scope="session")
def controlnet_artifact(tiny_pipeline_dir: Path, controlnet_dirs: dict[str, Path],
                        tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusion_trt.compiler.pipeline import compile_pipeline
    from diffusion_trt.config import CompileConfig

    config = CompileConfig(components=("text_encoder", "unet", "vae_decoder", "vae_encoder"),
                           controlnets=tuple((n, str(p)) for n, p in controlnet_dirs.items()))
    return compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp("cn-artifact") / "tiny-cn", config)


@pytest.fixture(scope="session")
def cn_lora(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A peft-key LoRA on the tiny UNet's attention q/k/v/out (Linear) and proj_in (1x1 Conv: the channels-last
    MatMul of --refittable) and the text encoder's q/v; tests/compiler/test_lora.py's, less its 3x3 conv1 layers."""
    pytest.importorskip("peft", reason="the merged compile needs peft (pip install -e '.[test]')")
    from safetensors.torch import load_file, save_file

    from tests.compiler.test_lora import make_lora

    d = tmp_path_factory.mktemp("cn-lora")
    full = make_lora(tiny_pipeline_dir, d / "full.safetensors", "peft", seed=1)
    path = d / "style.safetensors"
    save_file({k: v for k, v in load_file(str(full)).items() if ".conv1." not in k}, str(path))
    return path


@pytest.fixture(scope="session")
def refittable_controlnet_artifact(tiny_pipeline_dir: Path, controlnet_dirs: dict[str, Path],
                                   tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline compiled with --refittable --controlnet a=... (ORT CPU): unet_controlnet binds unet's
    LoRA weight inputs."""
    from diffusion_trt.compiler.pipeline import compile_pipeline
    from diffusion_trt.config import CompileConfig

    config = CompileConfig(components=CN_LORA_COMPONENTS, refittable=True,
                           controlnets=(("a", str(controlnet_dirs["a"])),))
    return compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp("cn-refit") / "art", config)
