"""Multi-device pieces that run on the CPU: --devices parsing, the split/merge, and DataParallelPipeline itself
over two CPU pipelines (the same threads and slicing as over two GPUs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.parallel import DataParallelPipeline, merge_outputs, parse_devices


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("0,1", [0, 1]),
        (" 1 , 0 ", [1, 0]),
        ("cuda:0,cuda:1", [0, 1]),
        ("all", [0, 1, 2, 3]),
        ([2], [2]),
        (None, []),
        ("", []),
    ],
)
def test_parse_devices(value: object, want: list[int]) -> None:
    assert parse_devices(value, available=4) == want  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "available", "piece"),
    [
        ("0,a", 2, "--devices 0,a: 'a' is not a CUDA device index; use comma-separated indices like 0,1"),
        ("0,-1", 2, "'-1' is not a CUDA device index"),
        ("0,,1", 2, "'' is not a CUDA device index"),
        ("1.5", 2, "'1.5' is not a CUDA device index"),
        ("0,2", 2, "device 2 does not exist; this host has 2 CUDA device(s), 0..1"),
        ("0,0", 2, "device 0 is listed twice"),
        ("0", 0, "this host has no CUDA device"),
    ],
)
def test_parse_devices_errors(value: str, available: int, piece: str) -> None:
    with pytest.raises(RuntimeInputError) as e:
        parse_devices(value, available=available)
    assert piece in str(e.value)


def test_merge_outputs() -> None:
    assert merge_outputs([["a"], ["b", "c"]], "pil") == ["a", "b", "c"]
    assert merge_outputs([np.zeros((1, 2)), np.ones((2, 2))], "np").shape == (3, 2)
    merged = merge_outputs([torch.zeros(1, 3), torch.ones(2, 3)], "pt")
    assert merged.shape == (3, 3) and merged[0].sum() == 0 and merged[1:].sum() == 6


def test_data_parallel_equals_one_pipeline(toy_artifact: Path, toy_pipe: EnginePipeline) -> None:
    pipes = [EnginePipeline.from_artifacts(toy_artifact, verify=False) for _ in range(2)]
    with DataParallelPipeline(pipes, warm_up=False) as multi:
        call = {"num_inference_steps": 2, "num_images_per_prompt": 2, "seed": 4, "output_type": "np"}
        got = multi(["a cat", "a dog", "a fox"], negative_prompt=["x", "y", "z"], **call)
        want = toy_pipe(["a cat", "a dog", "a fox"], negative_prompt=["x", "y", "z"], progress=False, **call)
        np.testing.assert_array_equal(got.images, want.images)  # 6 images: 3 per "device", in order
        assert got.parameters["device_shares"] == [3, 3] and got.seed == 4
        one = multi("a cat", num_inference_steps=2, seed=4, output_type="pil").images
        assert len(one) == 1  # fewer images than devices: one device works
    assert all(not p.engines["unet"].is_open for p in pipes)  # type: ignore[attr-defined]


def test_one_request_is_built_and_split_not_rebuilt_per_device(toy_artifact: Path, toy_pipe: EnginePipeline,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The call is checked once (one Request.build, on the first device's spec) and each device runs its share of
    that request; a bad argument is refused before any device runs."""
    from diffusion_trt.runtime import request as request_module

    built: list[int] = []
    real = request_module.Request.build.__func__  # type: ignore[attr-defined]

    def counting(cls: type, *args: object, **kwargs: object) -> object:
        built.append(1)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(request_module.Request, "build", classmethod(counting))
    pipes = [EnginePipeline.from_artifacts(toy_artifact, verify=False) for _ in range(2)]
    with DataParallelPipeline(pipes, warm_up=False) as multi:
        call = {"num_inference_steps": 2, "num_images_per_prompt": 3, "seed": 9, "output_type": "np"}
        got = multi(["a cat", "a dog"], negative_prompt="blurry", guidance_scale=6.0, **call)
        assert len(built) == 1 and got.parameters["device_shares"] == [3, 3]
        want = toy_pipe(["a cat", "a dog"], negative_prompt="blurry", guidance_scale=6.0, progress=False, **call)
        np.testing.assert_array_equal(got.images, want.images)
        assert {k: v for k, v in got.parameters.items() if k not in ("devices", "device_shares")} == want.parameters
        with pytest.raises(RuntimeInputError, match="num_inference_steps=0 must be an integer >= 1"):
            multi("a cat", num_inference_steps=0, seed=1)
        assert len(built) == 3  # toy_pipe's call, then the refused one: checked once, not per device


def test_each_pipeline_always_runs_on_its_own_thread(toy_artifact: Path) -> None:
    """ONNX Runtime's CUDA provider keeps per-thread state (the captured CUDA graph among it): warm-up and every
    later call of one pipeline must run on the same thread, and two pipelines on different threads."""
    import threading

    pipes = [EnginePipeline.from_artifacts(toy_artifact, verify=False) for _ in range(2)]
    seen: dict[int, set[int]] = {0: set(), 1: set()}
    for k, pipe in enumerate(pipes):
        run = pipe.engines["unet"].run

        def spy(feeds: dict, k: int = k, run=run) -> dict:  # a thin wrapper around Engine.run
            seen[k].add(threading.get_ident())
            return run(feeds)

        pipe.engines["unet"].run = spy  # type: ignore[method-assign]
    with DataParallelPipeline(pipes, warm_up=True) as multi:
        for _ in range(3):
            multi(["a", "b"], num_inference_steps=1, seed=0, output_type="np")
    assert len(seen[0]) == len(seen[1]) == 1 and seen[0] != seen[1]
    assert threading.get_ident() not in seen[0] | seen[1]


def test_cuda_default_provider_options() -> None:
    """Per-component CUDA defaults (each measured on an H200; see their constants): NHWC for the conv-heavy
    components, cuDNN flash attention everywhere (runs on every device of a process), no runtime-fused Conv bias
    (cuDNN compiles it at each shape's first run)."""
    from diffusion_trt.runtime.pipeline import cuda_layout_options

    assert cuda_layout_options("unet", "cpu") == {}
    assert cuda_layout_options("text_encoder", "cuda") == {"sdpa_kernel": "8"}
    assert cuda_layout_options("unet", "cuda") == {"sdpa_kernel": "8", "prefer_nhwc": "1"}
    assert cuda_layout_options("vae_decoder", "cuda") == {"sdpa_kernel": "8", "prefer_nhwc": "1"}
    # spatial Conv weights bound as inputs (--refittable --refit-convs): NCHW, since ORT's NHWC Conv misread them on
    # the H200; a default --refittable UNet (no such inputs) keeps NHWC (tests/runtime/test_lora_request.py)
    assert cuda_layout_options("unet", "cuda", spatial_conv_inputs=True) == {"sdpa_kernel": "8"}
    assert cuda_layout_options("unet", "cuda", spatial_conv_inputs=False) == {"sdpa_kernel": "8", "prefer_nhwc": "1"}
    # the ControlNets (their conditioning embedding too) and the residual-input UNet are UNet layers: NHWC too
    for name in ("unet_controlnet", "cond_embed_canny", "controlnet_canny"):
        assert cuda_layout_options(name, "cuda") == {"sdpa_kernel": "8", "prefer_nhwc": "1"}


def test_data_parallel_sdxl_shares_run_on_each_device_s_second_encoder(tiny_sdxl_artifact: Path) -> None:
    """SDXL: each share's conditioning runs on its own pipeline's text_encoder_2, one prompt_2 per image; the images
    are those of one pipeline."""
    pipes = [EnginePipeline.from_artifacts(tiny_sdxl_artifact, verify=False) for _ in range(3)]
    one = pipes.pop()
    with one, DataParallelPipeline(pipes, warm_up=False) as multi:
        call = {"num_inference_steps": 2, "num_images_per_prompt": 2, "seed": 3, "output_type": "np",
                "prompt_2": ["ink", "oil"]}
        got = multi(["a cat", "a dog"], **call)
        want = one(["a cat", "a dog"], progress=False, **call)
        np.testing.assert_array_equal(got.images, want.images)
        assert got.parameters["device_shares"] == [2, 2] and got.parameters["guidance_scale"] == 5.0
