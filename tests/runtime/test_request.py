"""The checked request (runtime/request.py), the latent geometry (runtime/geometry.py) and the modes' conditioning
interface (runtime/conditioning.py), on their own: no artifact, no engine runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diffusion_trt.artifact.manifest import Manifest
from diffusion_trt.config import Range, ShapeProfile
from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime.conditioning import Conditioning, PreparedLatents, TextToImage
from diffusion_trt.runtime.geometry import LatentGeometry
from diffusion_trt.runtime.image_inputs import ImageToImage, Inpainting, read_image_file
from diffusion_trt.runtime.request import Request, RequestSpec
from diffusion_trt.runtime.sdxl import SdxlConditioning

PROFILE = ShapeProfile(batch=Range(1, 1, 2), height=Range(32, 64, 128), width=Range(32, 48, 128))
SPEC = RequestSpec(PROFILE, LatentGeometry())


def test_geometry_reads_the_manifest_once() -> None:
    manifest = {"model": {"vae_scale_factor": 8, "vae_scaling_factor": 0.13025, "unet_in_channels": 9,
                          "latent_channels": 4}}
    geo = LatentGeometry.from_manifest(Manifest.from_json(manifest))
    assert (geo.scale_factor, geo.scaling_factor, geo.channels, geo.unet_in_channels) == (8, 0.13025, 4, 9)
    assert geo.latent_shape(3, 64, 48) == (3, 4, 8, 6)
    assert geo.derived_dims == {"H": ("h", 8), "W": ("w", 8)}
    # without the model entry: SD's VAE, and the UNet engine's channels
    assert LatentGeometry.from_manifest(Manifest.from_json({}), unet_in_channels=9) == LatentGeometry(8, 0.18215, 4, 9)


def test_geometry_checks_requested_and_image_sizes() -> None:
    geo = LatentGeometry()
    assert geo.check_size(np.int64(64), 48, PROFILE) == (64, 48)
    # the suggestions stay inside the profile: 696 or 704 would be refused too
    with pytest.raises(RuntimeInputError, match=r"height=700 is not a positive multiple of 8; use 128 \(engine"):
        geo.check_size(700, 48, PROFILE)
    with pytest.raises(RuntimeInputError, match=r"height=30 is not a positive multiple of 8; use 32 \(engine"):
        geo.check_size(30, 48, PROFILE)
    with pytest.raises(RuntimeInputError, match=r"width=256 is outside the engine profile 32..128"):
        geo.check_size(64, 256, PROFILE)
    with pytest.raises(RuntimeInputError, match=r"height=64.0 must be an integer number of pixels"):
        geo.check_size(64.0, 48, PROFILE)
    with pytest.raises(RuntimeInputError, match=r"image= width 50 is not a multiple of 8 .*to 48 or 56"):
        geo.check_size(64, 50, PROFILE, image="image")
    # another VAE factor: the same check, its multiples
    with pytest.raises(RuntimeInputError, match=r"height=72 is not a positive multiple of 16; use 64 or 80"):
        LatentGeometry(scale_factor=16).check_size(72, 64, PROFILE)


def test_build_checks_once_into_a_frozen_request() -> None:
    req = Request.build(SPEC, {}, ["a fox", "a cat"], negative_prompt="blurry", num_inference_steps=3, seed=4,
                        output_type="np", progress=False)
    assert req.prompts == ("a fox", "a cat") and req.negative_prompts == ("blurry", "blurry")
    assert (req.height, req.width) == (64, 48)  # the profile's opt size
    assert req.latent_shape == (2, 4, 8, 6) and req.batch == 2 and req.do_cfg and req.guidance_scale == 7.5
    assert req.chunks == (range(0, 2),) and req.seed == 4 and isinstance(req.generator, torch.Generator)
    assert isinstance(req.conditioning, TextToImage) and req.conditioning.mode == "txt2img"
    assert req.given == {"prompt": ["a fox", "a cat"], "negative_prompt": "blurry"}
    with pytest.raises(AttributeError):
        req.height = 32  # type: ignore[misc]
    # above the profile's max batch: engine-sized chunks
    assert Request.build(SPEC, {}, "a", num_images_per_prompt=3, seed=0).chunks == (range(0, 2), range(2, 3))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt": 3}, "prompt=3 must be a string"),
    ({"num_inference_steps": 0}, "num_inference_steps=0 must be an integer >= 1"),
    ({"guidance_scale": -1}, "guidance_scale=-1 must be a finite number >= 0"),
    ({"prompt_2": "x"}, "prompt_2 apply to SDXL artifacts only"),
    ({"strength": 0.5}, "strength=0.5 needs image="),
    ({"height": 20}, "height=20 is not a positive multiple of 8"),
    ({"output_type": "jpg"}, "output_type='jpg' is unknown"),
    ({"seed": 1, "generator": torch.Generator()}, "pass either seed= or generator=, not both"),
    ({"latents": torch.zeros(1, 4, 4, 4)}, r"latents have shape \(1, 4, 4, 4\)"),
    ({"image": torch.zeros(3, 64, 48)}, "no vae_encoder component"),
    ({"callback": 5}, "callback=5 is not callable"),
])
def test_build_refuses_with_the_value_and_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(RuntimeInputError, match=message):
        Request.build(SPEC, {}, **{"prompt": "a fox", **kwargs})


def test_build_refuses_a_batch_the_host_memory_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The latents are drawn for the whole call at once (parity with diffusers): a huge batch is refused here, with
    the bytes needed and available, not deep inside randn_tensor."""
    from diffusion_trt.runtime.memory import host_memory

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 10 * 2**20)
    # per image at 64x48: latents 4 x 8 x 6 float32 = 768 B; 'pil' images 64 x 48 x 3 uint8, buffer + PIL copy
    per_image = 768 + 64 * 48 * 3 * 2
    with pytest.raises(RuntimeInputError) as e:
        Request.build(SPEC, {}, "a fox", num_images_per_prompt=1000, seed=0)
    assert str(e.value) == (
        "batch = 1 prompt(s) x num_images_per_prompt=1000 = 1000 images at 48x64 (WxH) needs at least 18 MiB of "
        "host memory: 0.7 MiB for its latents (drawn for the whole call at once) and 18 MiB for its output images "
        f"('pil'), but 10 MiB is available; ask for at most {10 * 2**20 // per_image} images per call and call again"
    )
    # 'latent' results stay on the device: only the latents count
    assert Request.build(SPEC, {}, "a fox", num_images_per_prompt=1000, seed=0, output_type="latent").batch == 1000
    assert Request.build(SPEC, {}, "a fox", num_images_per_prompt=500, seed=0).batch == 500
    monkeypatch.undo()  # this machine's real figure: 10**8 images need ~1.8 TB
    with pytest.raises(RuntimeInputError, match=r"num_images_per_prompt=100000000 = 100000000 images .* available"):
        Request.build(SPEC, {}, "a fox", num_images_per_prompt=100_000_000, seed=0)


def test_available_host_bytes_reads_meminfo_and_the_cgroup_limit(tmp_path: Path) -> None:
    from diffusion_trt.runtime.memory import host_memory

    available = host_memory.available_host_bytes()
    assert available is None or available > 0
    (tmp_path / "meminfo").write_text("MemTotal:  100 kB\nMemAvailable:   2048 kB\n")
    assert host_memory._meminfo_available(tmp_path / "meminfo") == 2048 * 1024
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("400\n")
    assert host_memory._cgroup_left(tmp_path) == 600
    (tmp_path / "memory.max").write_text("max\n")
    assert host_memory._cgroup_left(tmp_path) is None


def test_an_inpainting_unet_needs_an_image() -> None:
    spec = RequestSpec(PROFILE, LatentGeometry(unet_in_channels=9))
    with pytest.raises(RuntimeInputError, match=r"inpainting UNet .*pass image= and mask_image="):
        Request.build(spec, {}, "a fox")


def test_every_mode_implements_the_conditioning_interface() -> None:
    for mode, name in ((TextToImage, "txt2img"), (ImageToImage, "img2img"), (Inpainting, "inpaint"),
                       (SdxlConditioning, "sdxl")):
        assert mode.mode == name
        assert all(callable(getattr(mode, m)) for m in ("start", "prepare", "encode")), mode
    assert issubclass(ImageToImage, TextToImage) and issubclass(SdxlConditioning, TextToImage)
    cond: Conditioning = TextToImage()
    t = torch.tensor([901, 601, 301, 1])
    assert cond.start(None, 4, t) == (t, None)


def test_text_to_image_prepares_diffusers_latents() -> None:
    class Scheduler:
        init_noise_sigma = 2.0

    prepared = TextToImage().prepare(Scheduler(), torch.tensor([1]), (2, 4, 8, 6), torch.float32, torch.device("cpu"),
                                     torch.Generator().manual_seed(3), None)
    from diffusers.utils.torch_utils import randn_tensor

    want = randn_tensor((2, 4, 8, 6), generator=torch.Generator().manual_seed(3), dtype=torch.float32) * 2.0
    assert torch.equal(prepared.latents, want)
    assert prepared.rows(range(0, 1), do_cfg=True) is None  # the steps add nothing


def test_inpainting_rows_double_the_unet_extra_with_cfg() -> None:
    prepared = PreparedLatents(latents=torch.zeros(2, 4, 2, 2), mask=torch.ones(2, 1, 2, 2),
                               masked_image_latents=torch.full((2, 4, 2, 2), 3.0))
    chunk = prepared.rows(range(1, 2), do_cfg=True)
    assert chunk is not None and chunk.unet_extra is not None and chunk.unet_extra.shape == (2, 5, 2, 2)
    assert chunk.unet_sample(torch.zeros(2, 4, 2, 2)).shape == (2, 9, 2, 2)


def test_read_image_file_refuses_with_the_reason(tmp_path: Path) -> None:
    from PIL import Image

    path = tmp_path / "a.png"
    Image.new("RGBA", (16, 8)).save(path)
    with pytest.raises(RuntimeInputError, match="has transparency"):
        read_image_file(path, "RGB")
    Image.new("RGB", (16, 8)).save(path)
    assert read_image_file(path, "RGB").size == (16, 8)
    with pytest.raises(RuntimeInputError, match=r"is 16x8 \(WxH\), larger than the 8x8"):
        read_image_file(path, "RGB", (8, 8))
    Image.fromarray(np.full((8, 16), 0.5, np.float32)).save(tmp_path / "depth.tiff")  # convert read it as black
    for mode in ("RGB", "L"):
        with pytest.raises(RuntimeInputError, match=r"is a 32-bit float image \(mode F\)"):
            read_image_file(tmp_path / "depth.tiff", mode)
    (tmp_path / "b.png").write_bytes(b"not an image")
    with pytest.raises(RuntimeInputError, match="cannot read"):
        read_image_file(tmp_path / "b.png", "L")


def test_read_image_file_applies_the_exif_orientation(tmp_path: Path) -> None:
    """A phone's portrait photo is stored on its side with an EXIF Orientation; it was read lying down (the size
    check and the pixels), where diffusers' load_image and every viewer turn it upright."""
    from PIL import Image

    stored = np.zeros((16, 32, 3), np.uint8)
    stored[:, :16] = 255  # 32 wide, 16 high as stored: the left half white
    im = Image.fromarray(stored)
    exif = im.getexif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise: 16 wide, 32 high, the top half white
    for name in ("photo.jpg", "photo.png"):
        im.save(tmp_path / name, exif=exif.tobytes())
        for mode in ("RGB", "L"):
            got = np.asarray(read_image_file(tmp_path / name, mode, (32, 16)))  # fits only upright
            assert got.shape[:2] == (32, 16), (name, mode)
            assert got[:12].min() > 200 and got[20:].max() < 50, (name, mode)
    with pytest.raises(RuntimeInputError, match=r"is 16x32 \(WxH\), larger than the 32x16"):
        read_image_file(tmp_path / "photo.png", "RGB", (16, 32))


def test_the_loop_runs_a_built_request_as_the_pipeline_does(tiny_artifact: Path) -> None:
    """``denoise.generate(request, engines, scheduler)``: the loop's entry point, driven without ``__call__``."""
    from diffusion_trt.runtime import EnginePipeline, denoise

    with EnginePipeline.from_artifacts(tiny_artifact) as pipe:
        want = pipe("a fox", num_inference_steps=3, seed=2, output_type="np", progress=False).images
        request = Request.build(pipe.request_spec, pipe.engines, "a fox", num_inference_steps=3, seed=2,
                                output_type="np", progress=False)
        got = denoise.generate(request, pipe.loop_engines(request.output_type), pipe.scheduler)
    np.testing.assert_array_equal(got, want)


def test_a_huge_batch_is_refused_before_any_chunk_is_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """10**8 images: the host-memory bound is checked first (it planned 5 * 10**7 chunks, 6.6 s and 3.3 GB, before)."""
    from diffusion_trt.runtime import request
    from diffusion_trt.runtime.memory import host_memory

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 10 * 2**20)
    monkeypatch.setattr(request, "plan_chunks", lambda *a: pytest.fail(f"chunks planned for {a}"))
    with pytest.raises(RuntimeInputError, match=r"= 100000000 images at 48x64 \(WxH\) needs at least .* available"):
        Request.build(SPEC, {}, "a fox", num_images_per_prompt=10**8, seed=0)


def test_guidance_is_checked_against_a_unet_built_for_the_cfg_batch_only() -> None:
    """A static profile's UNet takes 2 x batch rows: guidance <= 1 (batch rows) is refused in the request, not by the
    UNet engine mid-loop."""
    static = ShapeProfile(batch=Range(2, 2, 2), height=Range(64, 64, 64), width=Range(64, 64, 64))
    spec = RequestSpec(static, LatentGeometry(), unet_batch=(4, 4))
    assert Request.build(spec, {}, ["a", "b"], seed=0).guidance_scale == 7.5
    refused = r"guidance_scale=1 runs the UNet without classifier-free guidance \(2 rows for 2 image\(s\)\), but this "
    with pytest.raises(RuntimeInputError, match=refused + r"artifact's UNet takes 4..4 rows"):
        Request.build(spec, {}, ["a", "b"], guidance_scale=1.0, seed=0)


def test_request_spec_from_the_manifest_alone(toy_artifact: Path) -> None:
    """What a call may ask is read from the manifest, no engine open: the pipeline's spec is the same value."""
    from diffusion_trt.artifact.manifest import Manifest
    from diffusion_trt.runtime import EnginePipeline

    spec = RequestSpec.from_manifest(Manifest.read(toy_artifact))
    assert spec.architecture == "sd" and spec.latent_dtype == torch.float32 and spec.default_guidance_scale == 7.5
    assert spec.unet_batch == (spec.profile.batch.min, 2 * spec.profile.batch.max)
    with EnginePipeline.from_artifacts(toy_artifact, verify=False) as pipe:
        assert pipe.request_spec == spec


def test_build_refuses_a_token_weighted_beyond_the_limit_in_any_text() -> None:
    """A1111 weights multiplying beyond ±100 (runtime/prompt_syntax.py says why) are refused before any engine runs,
    naming the argument (and its index in a list), the token and the weight; plain syntax reads them as text."""
    fast = {"num_inference_steps": 1, "seed": 0, "progress": False}
    with pytest.raises(RuntimeInputError, match=r"^prompt\[1\] gives 'fox' the weight 110, beyond ±100 .*, or "
                                                r"prompt_syntax='plain' to read brackets as text$"):
        Request.build(SPEC, {}, ["a cat", "((fox:100))"], **fast)
    with pytest.raises(RuntimeInputError, match=r"^negative_prompt gives 'blurry' the weight -200, beyond ±100"):
        Request.build(SPEC, {}, ["a fox", "a cat"], negative_prompt="((blurry:-100):2)", **fast)  # one for both
    sdxl = RequestSpec(PROFILE, LatentGeometry(), "sdxl")
    with pytest.raises(RuntimeInputError, match=r"^prompt_2 gives 'ink' the weight 1e\+04, beyond ±100"):
        Request.build(sdxl, {}, "a fox", prompt_2="((ink:100):100)", **fast)
    req = Request.build(SPEC, {}, "((fox:100))", negative_prompt="(fox:100)", prompt_syntax="plain", **fast)
    assert req.prompts == ("((fox:100))",)
    Request.build(SPEC, {}, "(fox:100)", negative_prompt="[(fox:-100)]", **fast)  # at the limit, and within it
