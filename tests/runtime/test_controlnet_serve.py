"""``serve`` with ControlNets: the ``controlnet`` / ``control_image`` inputs (:mod:`diffusion_trt.serve.control`)
parsed from base64 PNGs and run through serve's :class:`MicroBatcher` on the tiny two-ControlNet artifact, against
``EnginePipeline`` called directly. (PyTriton is not installed here: the Triton binding itself is covered by
tests/test_serve.py where it is.)"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.serve import control
from diffusion_trt.serve.server import MicroBatcher, ServeConfig
from diffusion_trt.serve.triton_model import RequestError
from tests.runtime.test_controlnet_parity import _image, pipe  # noqa: F401

STEPS = 3


def _b64(image: Image.Image, fmt: str = "PNG") -> np.ndarray:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return np.array([base64.b64encode(buf.getvalue())], dtype=object)


def _params(seed: int, cn: control.ControlRequest | None) -> dict:
    return {"prompt": "a guohua landscape", "negative_prompt": "", "seed": seed, "steps": STEPS,
            "guidance_scale": 7.5, "height": 64, "width": 64, "lora": None, "control": cn}


def test_serve_control_requests_equal_engine_pipeline_and_batch_by_controlnet(pipe: EnginePipeline) -> None:  # noqa: F811
    nets = control.ControlNets(["a", "b"])
    asks = [("a:0.8", 1, 1), ("a:0.8", 2, 2), (None, 0, 3), ("b", 3, 4)]  # (controlnet, image seed, seed)
    cns = [None if spec is None else nets.resolve({"controlnet": np.array([spec.encode()]),
                                                   "control_image": _b64(_image(img))}, 64, 64)
           for spec, img, _ in asks]
    batcher = MicroBatcher(pipe, max_batch_size=2, max_delay_s=0.5, max_queue=8)
    try:
        futures = [batcher.submit(_params(seed, cn)) for (_, _, seed), cn in zip(asks, cns, strict=True)]
        images = [f.result(timeout=600) for f in futures]
        batches = list(batcher.batches)
    finally:
        batcher.close()
    assert batches == [2, 1, 1]  # the two "a:0.8" requests ran together, each with its own image
    for (spec, img, seed), got in zip(asks, images, strict=True):
        kwargs = {} if spec is None else {"controlnet": spec.split(":")[0], "control_image": _image(img),
                                          "controlnet_conditioning_scale": float(spec.partition(":")[2] or 1.0)}
        want = np.asarray(pipe("a guohua landscape", num_inference_steps=STEPS, seed=seed, progress=False,
                               **kwargs).images[0])
        assert got.shape == want.shape == (64, 64, 3)
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1  # batched rows vs one-image calls (uint8)
    assert np.abs(images[0].astype(int) - images[2].astype(int)).max() > 2  # the ControlNet acted


def test_the_only_controlnet_is_the_default_and_jpeg_and_data_urls_are_read() -> None:
    nets = control.ControlNets(["canny"])
    assert nets.resolve({}, 64, 64) is None
    img = _image(0)
    jpeg = _b64(img, "JPEG")
    url = np.array([b"data:image/png;base64," + _b64(img)[0]], dtype=object)
    got = nets.resolve({"control_image": url}, 64, 64)
    assert got is not None and (got.name, got.scale) == ("canny", 1.0)
    assert got.image.shape == (3, 64, 64) and got.image.dtype == np.float32
    assert np.array_equal(got.image, np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0)
    assert nets.resolve({"controlnet": np.array([b":0.5"]), "control_image": jpeg}, 64, 64).scale == 0.5


def _turned(stored: np.ndarray) -> np.ndarray:
    """``stored`` as a PNG whose EXIF Orientation 6 shows it turned a quarter clockwise (a phone's portrait photo)."""
    im = Image.fromarray(stored)
    exif = im.getexif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    im.save(buf, format="PNG", exif=exif.tobytes())
    return np.array([base64.b64encode(buf.getvalue())], dtype=object)


def test_control_images_are_read_upright_as_run_reads_files() -> None:
    """The EXIF orientation is applied, as `run --control-image` and diffusers' load_image apply it; the size check
    is of the upright picture (the header's size either way round, before decoding)."""
    stored = np.zeros((64, 32, 3), np.uint8)
    stored[:, :16] = 255  # 32 wide, 64 high as stored: the left half white; shown 64 wide, 32 high, the top half white
    got = control.ControlNets(["a"]).resolve({"control_image": _turned(stored)}, 32, 64)
    assert got is not None and got.image.shape == (3, 32, 64)
    assert got.image[:, :12].min() == 1.0 and got.image[:, 20:].max() == 0.0
    with pytest.raises(RequestError, match=r"control image for 'a' is 64x32 \(WxH\) but the output is 32x64"):
        control.ControlNets(["a"]).resolve({"control_image": _turned(stored)}, 64, 32)  # stored size, not upright


@pytest.mark.parametrize(("fields", "message"), [
    ({"controlnet": b"a"}, "controlnet='a' was sent without control_image"),
    ({"controlnet": b"c", "control_image": "png"}, "ControlNet 'c' is not in this artifact; it has a, b"),
    ({"controlnet": b"a:lots", "control_image": "png"},
     "the scale 'lots' is not a finite number in float32's range; use e.g. a:0.8"),
    ({"controlnet": b"a:1e39", "control_image": "png"},
     "the scale '1e39' is not a finite number in float32's range; use e.g. a:0.8"),
    ({"controlnet": b"a:inf", "control_image": "png"}, "is not a finite number"),
    ({"control_image": "png"}, "this server has 2 ControlNets (a, b); name the one"),
    ({"controlnet": b"a", "control_image": "small"}, "control image for 'a' is 32x32 (WxH) but the output is 64x64"),
    ({"controlnet": b"a", "control_image": b"!!not base64!!"}, "control_image is not base64"),
    ({"controlnet": b"a", "control_image": base64.b64encode(b"GIF89a....")}, "control_image is not a PNG or JPEG"),
    ({"controlnet": np.array([1], dtype=np.int32), "control_image": "png"}, "controlnet must be one BYTES value"),
    # converted silently before: the alpha dropped, 16-bit values clipped to 255 (white)
    ({"controlnet": b"a", "control_image": "rgba"}, "control_image has transparency (mode RGBA), which would be"),
    ({"controlnet": b"a", "control_image": "16bit"}, "control_image is a I;16 (16-bit) image, whose values converting"),
])
def test_bad_control_inputs_are_refused_naming_the_field(fields: dict, message: str) -> None:
    encoded = {"png": _b64(_image(0)), "small": _b64(_image(0, size=32)), "rgba": _b64(_image(0).convert("RGBA")),
               "16bit": _b64(Image.fromarray(np.full((64, 64), 40000, np.uint16)))}
    data = {k: v if isinstance(v, np.ndarray) else encoded.get(v) if isinstance(v, str) else
            np.array([v], dtype=object) for k, v in fields.items()}
    with pytest.raises(RequestError) as e:
        control.ControlNets(["a", "b"]).resolve(data, 64, 64)
    assert message in str(e.value), str(e.value)
    assert str(e.value).startswith(e.value.field) and e.value.field in control.FIELDS


def test_the_body_and_input_bounds_make_room_for_one_control_image() -> None:
    config = ServeConfig()
    assert config.max_bytes()["control_image"] == control.MAX_IMAGE_BYTES
    plain, with_image = config.front_limits(), config.front_limits(control_images=True)
    assert with_image.max_body_bytes - plain.max_body_bytes > control.MAX_IMAGE_BYTES



def test_a_batch_the_runtime_refuses_logs_one_line_and_each_request_hears_why(
    pipe: EnginePipeline, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """A refusal of the client's making (here a control image of another size than the request's, which the runtime
    refuses: RuntimeInputError, a 400 for the client) is one WARNING line in the server's log, no traceback; an
    error of the server's own keeps its traceback (``logger.exception``)."""
    from diffusion_trt.errors import RuntimeInputError

    nets = control.ControlNets(["a", "b"])
    cn = nets.resolve({"controlnet": np.array([b"a"]), "control_image": _b64(_image(1))}, 64, 64)
    batcher = MicroBatcher(pipe, max_batch_size=1, max_delay_s=0.0, max_queue=8)
    try:
        with caplog.at_level("WARNING", logger="diffusion_trt.serve.server"):
            future = batcher.submit({**_params(0, cn), "height": 32, "width": 32})
            with pytest.raises(RuntimeInputError, match="control image"):
                future.result(timeout=300)
    finally:
        batcher.close()
    records = [r for r in caplog.records if r.name == "diffusion_trt.serve.server"]
    assert [r.levelname for r in records] == ["WARNING"], records
    assert records[0].exc_info is None and "refused a batch of 1 request(s): " in records[0].getMessage()


def test_serve_lora_dir_with_control_images(refittable_controlnet_artifact: Path, cn_lora: Path) -> None:
    """``serve --lora-dir`` on a --refittable ControlNet artifact: a request's LoRA reaches the control-image calls
    (unet_controlnet), and never the requests after it; each image equals EnginePipeline's own call."""
    from diffusion_trt.serve.loras import LoraLibrary

    library = LoraLibrary(cn_lora.parent)
    nets = control.ControlNets(["a"])
    cn = nets.resolve({"controlnet": np.array([b"a:0.8"]), "control_image": _b64(_image(1))}, 64, 64)
    asks = [("style:0.8", cn), (None, cn), ("style:0.8", None), ("style:0.8", cn)]
    with EnginePipeline.from_artifacts(refittable_controlnet_artifact) as p:
        direct = {"controlnet": "a", "control_image": _image(1), "controlnet_conditioning_scale": 0.8}
        call = {"prompt": "a guohua landscape", "num_inference_steps": STEPS, "seed": 7, "progress": False}
        base_cn = np.asarray(p(**call, **direct).images[0])
        p.load_lora(cn_lora, 0.8)
        lora_cn, lora_plain = np.asarray(p(**call, **direct).images[0]), np.asarray(p(**call).images[0])
        p.unload_lora()
        batcher = MicroBatcher(p, max_batch_size=1, max_delay_s=0.0, max_queue=8)
        try:
            images = [batcher.submit({**_params(7, c), "lora": library.resolve(
                None if lo is None else np.array([lo.encode()]))}).result(timeout=300) for lo, c in asks]
        finally:
            batcher.close()
    assert np.array_equal(images[0], lora_cn) and np.array_equal(images[3], lora_cn)
    assert np.array_equal(images[1], base_cn) and np.array_equal(images[2], lora_plain)
    assert np.abs(lora_cn.astype(int) - base_cn.astype(int)).max() > 2  # the LoRA acted under the ControlNet
