"""The VRAM budget's pure parts: size strings, the residency planner's choices and refusals, ORT arena options."""

from __future__ import annotations

import pytest

from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime.memory.plan import (
    EngineMemory,
    GiB,
    MiB,
    ort_arena_options,
    parse_size,
    plan_residency,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GB", 8 * 10**9), ("8GiB", 8 * 2**30), ("7.5G", 7_500_000_000), ("8000MB", 8 * 10**9),
        ("7680MiB", 7680 * 2**20), ("8589934592", 8589934592), (" 8 gib ", 8 * 2**30), (4096, 4096),
        (".5GiB", 2**29),
    ],
)
def test_parse_size_accepts_the_documented_forms(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["eight GB", "8 GBs", "8XB", "", "-1GB", "0", "0.0GiB", "8GB 2", "1e9"])
def test_parse_size_refuses_malformed_strings_naming_the_accepted_forms(text: str) -> None:
    with pytest.raises(RuntimeInputError) as e:
        parse_size(text)
    assert '"8GB"' in str(e.value) and '"8GiB"' in str(e.value) and "byte count" in str(e.value)


def _sd15(vae_act: int = 1200 * MiB, tiled: int | None = 300 * MiB) -> dict[str, EngineMemory]:
    """SD-1.5 fp16-like figures (made up for the planner, not measurements)."""
    return {
        "text_encoder": EngineMemory("text_encoder", 235 * MiB, 40 * MiB),
        "unet": EngineMemory("unet", 1640 * MiB, 600 * MiB),
        "vae_decoder": EngineMemory("vae_decoder", 95 * MiB, vae_act, tiled_activations=tiled),
    }


def test_a_roomy_budget_keeps_everything_resident_and_caps_each_arena() -> None:
    plan = plan_residency(_sd15(), 16 * GiB, overhead=512 * MiB)
    assert plan.name == "all_resident" and not plan.vae_tiled and plan.per_stage == ()
    total = 512 * MiB + 235 * MiB + 40 * MiB + 1640 * MiB + 600 * MiB + 95 * MiB + 1200 * MiB
    assert plan.peak == total  # ORT: every session keeps its arena: all counted in every stage
    # each arena may take what the others leave of the budget
    assert plan.arena_limits["unet"] == 16 * GiB - (total - 1640 * MiB - 600 * MiB)


def test_plans_degrade_in_order_as_the_budget_shrinks() -> None:
    engines = _sd15()
    seen = []
    for budget in (5 * GiB, 4 * GiB, 3.9 * GiB, 3.6 * GiB, 3.3 * GiB, 3.0 * GiB, 2.8 * GiB):
        plan = plan_residency(engines, int(budget), overhead=512 * MiB)
        assert plan.peak <= budget
        seen.append(plan.label)
    assert seen[0] == "all_resident"
    assert seen[-1].startswith("per_stage")
    order = [label for label, _ in plan.candidates]
    assert order[:4] == ["all_resident", "all_resident + tiled VAE", "text_encoder_offloaded",
                         "text_encoder_offloaded + tiled VAE"]
    assert [order.index(s) for s in seen] == sorted(order.index(s) for s in seen)  # never a slower plan first


def test_per_stage_opens_one_stage_at_a_time() -> None:
    plan = plan_residency(_sd15(), int(2.8 * GiB), overhead=512 * MiB)
    assert plan.name == "per_stage" and plan.resident == frozenset()
    assert plan.per_stage == ("text_encoder", "unet", "vae_decoder")
    assert plan.stage_peaks["unet"] == 512 * MiB + 1640 * MiB + 600 * MiB


def test_a_budget_below_every_plan_names_the_smallest_budget_and_the_figures() -> None:
    with pytest.raises(RuntimeInputError) as e:
        plan_residency(_sd15(), 2 * GiB, overhead=512 * MiB, what="512x512, batch 1")
    msg = str(e.value)
    smallest = 512 * MiB + 1640 * MiB + 600 * MiB  # the UNet stage of per_stage
    assert f"--vram-budget {-(-smallest // MiB)}MiB" in msg
    assert "at 512x512, batch 1" in msg and "unet: weights 1.60 GiB" in msg and "(estimated)" in msg


def test_tensorrt_shares_one_activation_buffer() -> None:
    plan = plan_residency(_sd15(), 16 * GiB, shared_activations=True, overhead=0)
    assert plan.peak == 235 * MiB + 1640 * MiB + 95 * MiB + 1200 * MiB  # weights + the largest activations
    assert plan.arena_limits == {}


def test_weight_streaming_is_the_last_resort_and_keeps_what_fits() -> None:
    engines = dict(_sd15())
    engines["unet"] = EngineMemory("unet", 1640 * MiB, 600 * MiB, streamable=1400 * MiB)
    budget = 2 * GiB
    plan = plan_residency(engines, budget, shared_activations=True, overhead=256 * MiB)
    assert plan.label == "per_stage + tiled VAE + weight streaming"
    kept = plan.weight_streaming["unet"]
    assert 240 * MiB <= kept < 1640 * MiB and plan.peak <= budget


def test_ort_arena_options_cap_and_grow_as_requested() -> None:
    assert ort_arena_options(3 * GiB) == {"gpu_mem_limit": str(3 * GiB), "arena_extend_strategy": "kSameAsRequested"}


class _FakeTrtEngine:
    """The ICudaEngine attributes trt_memory reads (TensorRT >= 10.1 names); no TensorRT needed."""

    num_optimization_profiles = 2
    device_memory_size_v2 = 300 * MiB
    streamable_weights_size = 1500 * MiB
    weight_streaming_budget_v2 = -1

    def get_device_memory_size_for_profile_v2(self, p: int) -> int:
        return (200 + 100 * p) * MiB


def test_tensorrt_memory_facts_and_weight_streaming_budget() -> None:
    from diffusion_trt.errors import ArtifactError
    from diffusion_trt.runtime.engines.trt_memory import apply_weight_streaming, engine_memory_facts

    engine = _FakeTrtEngine()
    apply_weight_streaming(engine, 2 * GiB, "unet")  # more than streamable: clamped to all of it
    assert engine.weight_streaming_budget_v2 == 1500 * MiB
    apply_weight_streaming(engine, 400 * MiB, "unet")
    facts = engine_memory_facts(engine)
    assert facts == {"device_memory_bytes": 300 * MiB, "device_memory_per_profile_bytes": [200 * MiB, 300 * MiB],
                     "streamable_weights_bytes": 1500 * MiB, "weight_streaming_budget_bytes": 400 * MiB}
    engine.streamable_weights_size = 0  # built without BuilderFlag.WEIGHT_STREAMING
    with pytest.raises(ArtifactError, match="no streamable weights"):
        apply_weight_streaming(engine, 400 * MiB, "unet")


def test_trt_build_config_weight_streaming_needs_a_strongly_typed_network() -> None:
    from diffusion_trt.compiler.build_trt import TrtBuildConfig

    assert TrtBuildConfig(weight_streaming=True).strongly_typed is True
    with pytest.raises(RuntimeInputError, match="strongly typed"):
        TrtBuildConfig(weight_streaming=True, strongly_typed=False)
