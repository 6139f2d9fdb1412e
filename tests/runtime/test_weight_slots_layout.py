"""WeightSlots (runtime/lora_slots.py) per refit-map layout: a 1x1 Conv bound as ``[C, O]`` (``pointwise``, the
channels-last MatMul of compiler/pointwise_convs.py) and as ``[O, C, 1, 1]`` (maps written before ``pointwise``,
or without ``transpose``: both read as false), a Linear as ``[in, out]``. No compile: the slots alone, CPU."""

from __future__ import annotations

import pytest
import torch

from diffusion_trt.runtime.lora_slots import WeightSlots

O, C = 6, 4  # noqa: E741 (O: the output channels, as in the docs)


def _conv_weight() -> torch.Tensor:
    return torch.randn(O, C, 1, 1, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("entry,layout", [
    ({"initializer": "w", "transpose": True, "pointwise": True}, lambda w: w[:, :, 0, 0].T.contiguous()),
    ({"initializer": "w", "transpose": False}, lambda w: w),  # an artifact made before the [C, O] rewrite
    ({"initializer": "w"}, lambda w: w),  # no layout keys at all: as it was bound
])
def test_a_1x1_conv_delta_lands_in_the_bound_layout(entry: dict, layout: object) -> None:
    w = _conv_weight()
    base = layout(w)  # type: ignore[operator]
    slots = WeightSlots("unet", {"weights": {"proj_in.weight": entry}}, {"w": base}, torch.device("cpu"))
    assert tuple(slots.torch_shapes()["proj_in.weight"].shape) == (O, C, 1, 1)  # what lora_deltas sees
    up, down = torch.randn(O, 2, 1, 1), torch.randn(2, C, 1, 1)
    delta = (up.squeeze(3).squeeze(2) @ down.squeeze(3).squeeze(2))[:, :, None, None]  # peft's 1x1 delta
    merged = slots.merged([{"proj_in.weight": delta}], "test")["w"]
    assert merged.shape == base.shape and merged.dtype == base.dtype
    torch.testing.assert_close(merged, layout(w + delta), rtol=0, atol=1e-6)  # type: ignore[operator]
    slots.bind({"w": merged})
    assert slots["w"] is merged
    slots.bind({})
    assert torch.equal(slots["w"], base)  # unload: the base again, bit for bit


def test_a_pointwise_slot_keeps_the_graphs_dtype() -> None:
    w = _conv_weight()
    base = w[:, :, 0, 0].T.contiguous().half()
    slots = WeightSlots("unet", {"weights": {"c.weight": {"initializer": "w", "transpose": True, "pointwise": True}}},
                        {"w": base}, torch.device("cpu"))
    merged = slots.merged([{"c.weight": torch.ones(O, C, 1, 1)}], "test")["w"]
    assert merged.dtype == torch.float16 and merged.shape == (C, O)
    assert torch.equal(merged, (base.float() + 1).half())  # summed in fp32 over the stored base, cast once


def test_unet_controlnet_of_its_own_file_takes_the_loras_unet_layers(tmp_path: object) -> None:
    """apply_loras reads a LoRA's ``unet.`` layers for every component whose weights are the UNet's
    (``WeightSlots.source``): unet_controlnet with a base file of its own (compiled without unet, or where the bytes
    differ) gets the same merged values as unet, and one shared WeightSlots is merged and bound once."""
    from pathlib import Path

    from safetensors.torch import save_file

    from diffusion_trt.lora import check_lora_file
    from diffusion_trt.runtime.lora_slots import apply_loras

    w = torch.randn(O, C, generator=torch.Generator().manual_seed(1))
    rmap = {"weights": {"down_blocks.0.attentions.0.proj_out.weight": {"initializer": "w", "transpose": True}}}
    lora = Path(str(tmp_path)) / "l.safetensors"
    save_file({"unet.down_blocks.0.attentions.0.proj_out.lora_A.weight": torch.randn(2, C),
               "unet.down_blocks.0.attentions.0.proj_out.lora_B.weight": torch.randn(O, 2)}, str(lora))
    cpu = torch.device("cpu")
    unet = WeightSlots("unet", rmap, {"w": w.T.contiguous()}, cpu)
    own = WeightSlots("unet_controlnet", rmap, {"w": w.T.contiguous()}, cpu)
    assert (unet.source, own.source) == ("unet", "unet")
    changed = apply_loras({"unet": unet, "unet_controlnet": own}, [check_lora_file(lora, 0.5)])
    assert changed == {"unet": 1, "unet_controlnet": 1}
    assert torch.equal(unet["w"], own["w"]) and not torch.equal(unet["w"], w.T)
    shared = WeightSlots("unet", rmap, {"w": w.T.contiguous()}, cpu)
    changed = apply_loras({"unet": shared, "unet_controlnet": shared}, [check_lora_file(lora, 0.5)])
    assert changed == {"unet": 1, "unet_controlnet": 1} and torch.equal(shared["w"], unet["w"])
