"""Calibration loops: batched prompts per UNet call, early stop, and the loop-driven calibrator (determinism,
memory bound, equivalence with capture-then-replay) on the tiny pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from diffusion_trt.compiler import calibrate, quantize

PROMPTS = ["a red fox in snow, watercolor", "a lighthouse at night", "a bowl of ramen, studio photo"]
SETTINGS = calibrate.LoopSettings(steps=2, seed=5, height=64, width=64)


@pytest.fixture(scope="module")
def generation(tiny_pipeline_dir: Path) -> calibrate.Generation:
    import json

    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    d = tiny_pipeline_dir
    models = {
        "text_encoder": CLIPTextModel.from_pretrained(d / "text_encoder").eval(),
        "unet": UNet2DConditionModel.from_pretrained(d / "unet").eval(),
        "vae": AutoencoderKL.from_pretrained(d / "vae").eval(),
    }
    return calibrate.Generation(models, CLIPTokenizer.from_pretrained(d / "tokenizer"),
                                json.loads((d / "scheduler" / "scheduler_config.json").read_text()),
                                models["vae"].config.scaling_factor)


@pytest.fixture(scope="module")
def unet_graph(tiny_artifact: Path) -> Path:
    """The tiny fp32 UNet graph (ORT CPU passes), as the quantize stage calibrates it."""
    return tiny_artifact / "unet" / "model.onnx"


def counting(fn: calibrate.UNetFn, calls: list[int]) -> calibrate.UNetFn:
    def run(sample: torch.Tensor, timestep: torch.Tensor, ehs: torch.Tensor) -> torch.Tensor:
        calls.append(sample.shape[0])
        return fn(sample, timestep, ehs)

    return run


def assert_feeds_close(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]], rtol: float,
                       atol: float) -> None:
    assert len(a) == len(b)
    for fa, fb in zip(a, b, strict=True):
        assert fa.keys() == fb.keys()
        if "timestep" in fa:
            np.testing.assert_array_equal(fa["timestep"], fb["timestep"])
        for k in fa:
            assert fa[k].shape == fb[k].shape
            # atol relative to the tensor's scale (the tiny model's latents grow to ~25)
            np.testing.assert_allclose(fa[k], fb[k], rtol=rtol, atol=atol * max(1.0, float(np.abs(fb[k]).max())))


def test_batched_prompts_give_the_unbatched_feeds(generation: calibrate.Generation) -> None:
    torch_unet = calibrate.torch_unet_fn(generation.models["unet"])
    calls1: list[int] = []
    calls2: list[int] = []
    one = generation.run(PROMPTS, SETTINGS, counting(torch_unet, calls1), keep_outputs=True)
    two = generation.run(PROMPTS, SETTINGS, counting(torch_unet, calls2), keep_outputs=True, batch_size=2)
    again = generation.run(PROMPTS, SETTINGS, keep_outputs=True)
    # PNDM: steps + 1 UNet calls per prompt; batch 2 CFG rows per prompt
    assert calls1 == [2] * 3 * 3 and calls2 == [4] * 3 + [2] * 3
    assert len(one.feeds["unet"]) == len(PROMPTS) * SETTINGS.steps == len(one.noise_preds)
    assert_feeds_close(one.feeds["unet"], two.feeds["unet"], rtol=1e-4, atol=1e-5)
    assert_feeds_close(one.feeds["vae_decoder"], two.feeds["vae_decoder"], rtol=1e-4, atol=1e-5)
    for a, b in zip(one.noise_preds, two.noise_preds, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(b).max())))
    # batch 1 is deterministic to the bit (the same scales for the same inputs)
    for fa, fb in zip(one.feeds["unet"], again.feeds["unet"], strict=True):
        assert all(np.array_equal(fa[k], fb[k]) for k in fa)
    with pytest.raises(Exception, match="batch_size=0"):
        generation.run(PROMPTS, SETTINGS, batch_size=0)


def test_loops_stop_after_the_last_captured_step(generation: calibrate.Generation) -> None:
    torch_unet = calibrate.torch_unet_fn(generation.models["unet"])
    full_calls: list[int] = []
    short_calls: list[int] = []
    captured: list[int] = []
    full = generation.run(PROMPTS[:2], SETTINGS, counting(torch_unet, full_calls))
    short = generation.run(PROMPTS[:2], SETTINGS, counting(torch_unet, short_calls), final_latents=False,
                           on_capture=lambda: captured.append(len(short_calls)))
    assert len(full_calls) == 2 * 3 and len(short_calls) == 2 * 2  # PNDM's last call captures nothing
    assert captured == [1, 2, 3, 4]  # after each captured call
    assert short.feeds["vae_decoder"] == [] and len(full.feeds["vae_decoder"]) == 2
    for fa, fb in zip(full.feeds["unet"], short.feeds["unet"], strict=True):
        assert all(np.array_equal(fa[k], fb[k]) for k in fa)


def loop_ranges(generation: calibrate.Generation, graph: Path, out: Path, batch_size: int,
                method: Any = None) -> tuple[Path, quantize.LoopCalibrator, calibrate.CapturedData]:
    from onnxruntime.quantization import CalibrationMethod

    loop = quantize.LoopCalibrator(graph, method or CalibrationMethod.MinMax, out.parent)
    data = generation.run(PROMPTS, SETTINGS, loop.unet_fn, batch_size=batch_size, final_latents=False,
                          on_capture=loop.fold)
    calls, folded = loop.calls, loop.folded
    path = loop.save(out)
    loop.calls, loop.folded = calls, folded
    return path, loop, data


def ranges_of(path: Path) -> dict[str, tuple[float, float]]:
    from onnxruntime.quantization.calibrate import load_tensors_data

    return {k: tuple(float(x) for x in np.ravel(v.range_value)) for k, v in load_tensors_data(path).items()}


def assert_ranges_close(a: dict[str, tuple[float, float]], b: dict[str, tuple[float, float]], rtol: float) -> None:
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=1e-5, err_msg=k)


def test_loop_calibration_is_deterministic_and_batching_keeps_the_ranges(
        generation: calibrate.Generation, unet_graph: Path, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    first, loop, data = loop_ranges(generation, unet_graph, tmp_path / "a" / "r.json", batch_size=1)
    assert loop.calls == loop.folded == len(PROMPTS) * SETTINGS.steps == len(data.feeds["unet"])
    second, _, _ = loop_ranges(generation, unet_graph, tmp_path / "b" / "r.json", batch_size=1)
    assert first.read_bytes() == second.read_bytes()  # byte-identical scales for the same inputs
    batched, loop2, data2 = loop_ranges(generation, unet_graph, tmp_path / "c" / "r.json", batch_size=2)
    assert loop2.calls == loop2.folded == 2 * SETTINGS.steps  # prompts {0, 1} then {2}
    assert_feeds_close(data.feeds["unet"], data2.feeds["unet"], rtol=1e-4, atol=1e-5)
    assert_ranges_close(ranges_of(first), ranges_of(batched), rtol=1e-4)


def test_loop_calibration_matches_capture_then_replay(generation: calibrate.Generation, unet_graph: Path,
                                                      tmp_path: Path) -> None:
    """One pass (the graph drives the loop) gives the ranges of two passes (torch loop, then the graph replayed on
    its captured inputs) within fp32 rounding; the replay's inputs are the one-pass loop's within rounding too."""
    from onnxruntime.quantization import CalibrationMethod

    loop_path, _, data = loop_ranges(generation, unet_graph, tmp_path / "loop.json", batch_size=1)
    captured = generation.run(PROMPTS, SETTINGS)
    assert_feeds_close(data.feeds["unet"], captured.feeds["unet"], rtol=1e-3, atol=1e-4)
    replay = quantize.calibrate_ranges(unet_graph, captured.feeds["unet"], tmp_path / "replay.json",
                                       CalibrationMethod.MinMax)
    assert_ranges_close(ranges_of(loop_path), ranges_of(replay), rtol=1e-3)


def test_histogram_calibration_holds_one_feed_at_a_time(generation: calibrate.Generation, unet_graph: Path,
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entropy/percentile keep every calibrated tensor of every feed until folded: one UNet call at most."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import HistogramCalibrater

    held: list[int] = []
    original = HistogramCalibrater.collect_data

    def spy(self: Any, data_reader: Any) -> None:
        n = 0
        while True:
            feed = data_reader.get_next()
            if not feed:
                break
            n += 1
        held.append(n)
        data_reader.rewind()
        original(self, data_reader)
        assert self.intermediate_outputs == []

    monkeypatch.setattr(HistogramCalibrater, "collect_data", spy)
    captured = generation.run(PROMPTS[:2], SETTINGS, final_latents=False)
    quantize.calibrate_ranges(unet_graph, captured.feeds["unet"], tmp_path / "replay.json",
                              CalibrationMethod.Entropy)
    assert held == [1] * len(captured.feeds["unet"])
    held.clear()
    (tmp_path / "loop").mkdir()
    path, loop, _ = loop_ranges(generation, unet_graph, tmp_path / "loop" / "r.json", batch_size=2,
                                method=CalibrationMethod.Entropy)
    assert held == [1] * loop.folded and path.is_file()



@pytest.mark.parametrize("batch_size", [1, 2])
def test_recorded_feeds_are_what_the_torch_unet_gets_in_diffusers_pipeline(
        generation: calibrate.Generation, batch_size: int) -> None:
    """The recording UNet changes nothing: its feeds (UNet, VAE decoder) are, bit for bit, what the real torch UNet
    receives in an unmodified ``StableDiffusionPipeline`` (a forward pre-hook) with the same prompts, seeds,
    steps and guidance, and what the pipeline returns. (The runtime-loop path it replaced gave the same data bit for
    bit: commit "calibrate: diffusers' StableDiffusionPipeline drives the calibration loop", its test
    test_diffusers_pipeline_records_the_runtime_loops_feeds.)"""
    from diffusers import StableDiffusionPipeline

    from diffusion_trt.runtime.schedulers import make_scheduler

    data = generation.run(PROMPTS, SETTINGS, batch_size=batch_size)
    m = generation.models
    pipe = StableDiffusionPipeline(vae=m["vae"], text_encoder=m["text_encoder"], tokenizer=generation.tokenizer,
                                   unet=m["unet"], scheduler=make_scheduler(generation.scheduler_config),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    seen: list[tuple[torch.Tensor, ...]] = []
    hook = m["unet"].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((args[0].clone(), args[1].clone(), kwargs["encoder_hidden_states"])),
        with_kwargs=True)
    wanted = calibrate.capture_indices(SETTINGS.num_inference_steps, SETTINGS.steps)
    feeds, vae = [], []
    try:
        for first in range(0, len(PROMPTS), batch_size):
            group, g = PROMPTS[first:first + batch_size], len(PROMPTS[first:first + batch_size])
            seen.clear()
            gens = [torch.Generator().manual_seed(SETTINGS.seed + first + j) for j in range(g)]
            latents = pipe(group, height=64, width=64, num_inference_steps=SETTINGS.num_inference_steps,
                           guidance_scale=SETTINGS.guidance_scale, generator=gens, output_type="latent",
                           return_dict=False)[0]
            for j in range(g):
                for i in wanted:
                    sample, t, ehs = seen[i]
                    feeds.append({"sample": sample[[j, g + j]], "timestep": t.float().expand(2),
                                  "encoder_hidden_states": ehs[[j, g + j]]})
                vae.append({"latent_sample": latents[j:j + 1] / generation.vae_scaling_factor})
    finally:
        hook.remove()
    for got, want in [(data.feeds["unet"], feeds), (data.feeds["vae_decoder"], vae)]:
        assert len(got) == len(want) > 0
        for fa, fb in zip(got, want, strict=True):
            assert fa.keys() == fb.keys()
            assert all(fa[k].dtype == fb[k].numpy().dtype and np.array_equal(fa[k], fb[k].numpy()) for k in fa)
