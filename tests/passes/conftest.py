"""Real exports of the tiny pipeline for whole-model pass tests: raw TorchScript exports + infer_shapes only
(no fold_constants: its per-partition gs copies take ~10 s on the UNet), dynamic and static, cached per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest

#: Static export shapes per component (the UNet latent is odd, as the product traces it).
STATIC_SHAPES: dict[str, dict[str, list[int]]] = {
    "unet": {"sample": [2, 4, 9, 7], "timestep": [2], "encoder_hidden_states": [2, 77, 32]},
    "text_encoder": {"input_ids": [2, 77]},
    "vae_decoder": {"latent_sample": [1, 4, 9, 7]},
}


@pytest.fixture(scope="session")
def tiny_torch_models(tiny_pipeline_dir: Path) -> dict[str, Any]:
    from diffusion_trt.compiler import export

    return export.load_models(export.check_model_folder(tiny_pipeline_dir), "fp32", "cpu")


#: Symbol ranges of the default (dynamic) profile of `compile` for the tiny pipeline (64x64, batch 1..4).
TINY_RANGES: dict[str, tuple[int, int, int]] = {"B": (1, 1, 4), "B2": (1, 2, 8), "h": (4, 8, 16), "w": (4, 8, 16),
                                                "H": (32, 64, 128), "W": (32, 64, 128)}


@pytest.fixture(scope="session")
def tiny_raw_onnx(tiny_torch_models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
                  ) -> Callable[[str], Path]:
    """``tiny_raw_onnx(component)``: the path of the raw fp32 export at the default profile, exactly as ``compile``
    and scripts/pass_goldens.py export it; exported once per session (do not modify the file)."""
    from diffusion_trt.compiler import export
    from diffusion_trt.compiler.components import component_specs

    specs = component_specs(text_hidden=32, text_len=77, unet_in=4, unet_out=4, latent=4)
    folder = tmp_path_factory.mktemp("tiny_raw_onnx")
    paths: dict[str, Path] = {}

    def get(component: str) -> Path:
        if component not in paths:
            path = folder / component / "model.onnx"
            export.onnx_from_component(component, tiny_torch_models, specs[component], path, precision="fp32",
                                       profile_ranges=TINY_RANGES, opset=17, device="cpu")
            paths[component] = path
        return paths[component]

    return get


@pytest.fixture(scope="session")
def tiny_onnx(tiny_torch_models: dict[str, Any], tiny_raw_onnx: Callable[[str], Path],
              tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], onnx.ModelProto]:
    """``tiny_onnx(component, static)``: the exported fp32 model with shapes inferred (a fresh copy each call)."""
    from diffusion_trt.compiler import export
    from diffusion_trt.compiler.components import ComponentSpec, TensorSpec, component_specs
    from diffusion_trt.passes import PassContext, optimize_model
    from diffusion_trt.passes.infer_shapes import infer_shapes

    specs = component_specs(text_hidden=32, text_len=77, unet_in=4, unet_out=4, latent=4)
    ranges = TINY_RANGES
    cache: dict[tuple[str, bool], bytes] = {}
    folder = tmp_path_factory.mktemp("tiny_onnx")

    def get(component: str, static: bool) -> onnx.ModelProto:
        key = (component, static)
        if key not in cache:
            spec = specs[component]
            if static:
                shapes = STATIC_SHAPES[component]
                out_shape = {"unet": (2, 4, 9, 7), "text_encoder": (2, 77, 32), "vae_decoder": (1, 3, 72, 56)}
                spec = ComponentSpec(component, tuple(TensorSpec(t.name, t.dtype, tuple(shapes[t.name]))
                                                      for t in spec.inputs),
                                     tuple(TensorSpec(t.name, t.dtype, out_shape[component]) for t in spec.outputs))
            path = folder / f"{component}_static.onnx"
            if static:
                export.onnx_from_component(component, tiny_torch_models, spec, path, precision="fp32",
                                           profile_ranges=ranges, opset=17, device="cpu")
            else:
                path = tiny_raw_onnx(component)
            ctx = PassContext(component=component, backend="ort", device="cpu", precision="fp32")
            model, _ = optimize_model(onnx.load(str(path)), [infer_shapes], ctx)
            cache[key] = model.SerializeToString()
        return onnx.load_from_string(cache[key])

    return get
