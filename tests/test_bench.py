"""`diffusion-trt bench` on the CPU: the tiny artifact against diffusers on its source folder; JSON schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from diffusion_trt.bench import SCHEMA, STAGES, plot_result, validate_result
from diffusion_trt.cli import main


def test_bench_cpu_json_schema_and_plot(tiny_artifact: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = [
        "bench",
        str(tiny_artifact),
        "--steps",
        "2",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--stage-iters",
        "1",
        "--batch-size",
        "1,2",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    validate_result(data)
    assert data["schema"] == SCHEMA and data["env"]["timing"] == "wall_clock"
    runs = {(r["system"], r["batch_size"]): r for r in data["runs"]}
    for system in ("ours", "diffusers_eager"):
        for b in (1, 2):
            run = runs[(system, b)]
            assert run["status"] == "ok" and run["e2e_s"] > 0 and all(run["stages_ms"][s] > 0 for s in STAGES)
            assert run["images_per_s"] == pytest.approx(b / run["e2e_s"])
            lo, med, hi = run["stages_spread_ms"]["unet_step"]
            assert lo <= med <= hi and med == run["stages_ms"]["unet_step"]
            assert run["stage_sum_s"] > 0 and run["stage_sum_ratio"] == pytest.approx(run["stage_sum_s"] / run["e2e_s"])
    assert runs[("diffusers_cuda_graph", 1)]["status"] == "skipped"
    assert runs[("ours_multi_gpu", 2)]["reason"] == "needs --devices with 2+ GPUs"
    assert {(q["system"], q["baseline"]) for q in data["ratios"]} == {("ours", "diffusers_eager")}
    assert "ours" in result.output and "speedups" in result.output
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 100


def test_schema_validation_names_the_bad_key(tmp_path: Path) -> None:
    data = {"schema": SCHEMA, "env": {"device": "cpu"}}
    with pytest.raises(ValueError, match=r"env: missing key 'gpu'"):
        validate_result(data)
    with pytest.raises(ValueError, match=r"result: missing key 'runs'"):
        validate_result(
            {
                "schema": SCHEMA,
                "env": {k: "x" for k in ("device", "timing", "torch", "onnxruntime", "diffusers", "python")}
                | {"gpu": None, "gpu_count": 0},
                "config": _config(),
            }
        )
    # the plot copes with a result that has no ok run
    plot_result({"runs": [], "config": _config(), "env": {"device": "cpu"}}, tmp_path / "empty.png")


def _config() -> dict[str, object]:
    return {
        "artifact": "a",
        "model_dir": None,
        "backend": "ort",
        "precision": "fp32",
        "profile": {},
        "steps": 1,
        "height": 64,
        "width": 64,
        "guidance_scale": 7.5,
        "seed": 0,
        "scheduler": "pndm",
        "batch_sizes": [1],
        "devices": [],
        "iters": 1,
        "warmup": 0,
        "stage_iters": 1,
        "baseline": "none",
        "cuda_graph": None,
    }


def test_bench_rejects_bad_options(tiny_artifact: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--batch-size", "1,x"])
    assert result.exit_code == 2 and "'1,x' is not a comma-separated list of integers" in result.output
    # "1,,2" ran batch sizes 1 and 2 (the empty item skipped); --plot out.json wrote a PNG named out.json
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--batch-size", "1,,2"])
    assert result.exit_code == 2 and "'1,,2' is not a comma-separated list of integers" in result.output
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--plot", str(tmp_path / "out.json")])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[0] == (f"error: Invalid value for --plot: '{tmp_path / 'out.json'}' does not "
                                             "end in .png (the chart is a PNG); use e.g. bench.png"), result.output
    assert not (tmp_path / "out.json").exists()
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--device", "cpu", "--devices", "0,1"])
    assert result.exit_code == 2 and "--devices 0,1 needs CUDA" in result.output


def test_baseline_on_other_weights_is_flagged(tiny_artifact: Path, tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """The diffusers baselines must run the artifact's weights: another folder (or a merged LoRA) is said so."""
    import shutil

    from diffusion_trt.artifact.folder import load_verified
    from diffusion_trt.artifact.manifest import Manifest
    from diffusion_trt.bench import baseline_mismatch as _baseline_mismatch

    raw = load_verified(tiny_artifact)
    manifest = Manifest.from_json(raw)
    assert _baseline_mismatch(tiny_pipeline_dir, manifest) is None
    other = tmp_path / "other"
    shutil.copytree(tiny_pipeline_dir, other)
    (other / "scheduler" / "scheduler_config.json").write_text('{"_class_name": "DDIMScheduler"}')
    assert "is not the folder the artifact was compiled from" in _baseline_mismatch(other, manifest)
    with_lora = Manifest.from_json({**raw, "loras": [{"name": "ink.safetensors", "sha256": "0" * 64, "scale": 1.0}]})
    assert "LoRAs merged in" in _baseline_mismatch(tiny_pipeline_dir, with_lora)


def test_baseline_folder_of_the_same_architecture_passes(tiny_artifact: Path, tiny_pipeline_dir: Path,
                                                         tiny_sd21_dir: Path, tmp_path: Path) -> None:
    """architecture_mismatch refuses only what StableDiffusionPipeline cannot run next to the artifact: other weights
    of the same architecture (SD-2.1 for SD-1.5) are baseline_mismatch's note, not an error."""
    import shutil

    from diffusion_trt.artifact.manifest import Manifest
    from diffusion_trt.bench import architecture_mismatch

    manifest = Manifest.read(tiny_artifact)
    assert architecture_mismatch(tiny_pipeline_dir, manifest) is None
    assert architecture_mismatch(tiny_sd21_dir, manifest) is None
    no_unet = tmp_path / "no-unet"
    shutil.copytree(tiny_pipeline_dir, no_unet, ignore=shutil.ignore_patterns("unet"))
    index = json.loads((no_unet / "model_index.json").read_text())
    del index["unet"]
    (no_unet / "model_index.json").write_text(json.dumps(index))
    assert architecture_mismatch(no_unet, manifest) == (
        "a StableDiffusionPipeline folder (architecture sd, UNet in_channels unknown, no unet)",
        "a StableDiffusionPipeline (architecture sd, UNet in_channels 4)",
    )


def test_wide_spread_and_contradicting_stages_are_warned() -> None:
    from diffusion_trt.bench import Run, trust_notes

    run = Run("ours", 1, stage_batch=1, e2e_s=1.0, e2e_spread_s=[0.9, 1.0, 1.1])
    run.stages_ms = {"text_encoder": 10.0, "unet_step": 60.9, "vae_decode": 50.0, "scheduler_glue": 1.0}
    run.stages_spread_ms = {"text_encoder": [9.0, 10.0, 11.0], "unet_step": [11.8, 60.9, 159.5],
                            "vae_decode": None, "scheduler_glue": None}
    lines = trust_notes(run, steps=20)
    assert lines[0].startswith("warning: ours b=1 unet_step varied 11.8..159.5 ms (median 60.9; slowest/fastest "
                               "x13.5 > x1.5)")
    assert run.stage_sum_s == pytest.approx((10 + 20 * 61.9 + 50) / 1e3)
    assert lines[1].startswith("warning: ours b=1: the stages add up to 1.298 s, x1.30 the measured end to end")
    assert len(lines) == 2  # text_encoder 9..11 and e2e 0.9..1.1 are within x1.5
    run.e2e_s = 10.0
    assert trust_notes(run, steps=20)[-1].startswith("ours b=1: the stages explain 13% of the end to end")


def test_schema_rejects_a_bad_spread() -> None:
    from diffusion_trt.bench import Run

    run = Run("ours", 1, e2e_s=1.0, e2e_spread_s=[1.0, 2.0]).to_json()
    data = {"schema": SCHEMA, "env": {k: "x" for k in ("device", "timing", "torch", "onnxruntime", "diffusers",
                                                        "python")} | {"gpu": None, "gpu_count": 0},
            "config": _config(), "runs": [run], "ratios": [], "notes": []}
    with pytest.raises(ValueError, match=r"runs\[0\]\.e2e_spread_s = \[1\.0, 2\.0\]; expected \[min, median, max\]"):
        validate_result(data)


@pytest.mark.parametrize("scheduler_name", ["pndm", "euler"])
def test_glue_runs_the_runtime_loop(scheduler_name: str) -> None:
    """bench's scheduler-glue stage drives the runtime's loop (bench.glue.run_loop) with a UNet stand-in: the same
    latents as the CFG loop written out (concat, scale_model_input, combine, step), which bench timed before."""
    import torch
    from diffusers import EulerDiscreteScheduler, PNDMScheduler

    from diffusion_trt.bench.clock import Clock
    from diffusion_trt.bench.glue import FixedNoiseUNet, glue_ms, run_loop
    from diffusion_trt.runtime import denoise

    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(1, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    template = PNDMScheduler(skip_prk_steps=True) if scheduler_name == "pndm" else EulerDiscreteScheduler()

    def scheduled() -> tuple[object, torch.Tensor]:
        sched = denoise.fresh_scheduler(template)
        sched.set_timesteps(4)
        timesteps = denoise.host_timesteps(sched)
        return sched, timesteps

    sched, timesteps = scheduled()
    ours = run_loop(FixedNoiseUNet(noise), sched, latents, timesteps, 7.5)
    sched, timesteps = scheduled()
    denoise.pin_begin_index(sched, timesteps)
    x = latents
    for t in timesteps:
        sched.scale_model_input(torch.cat([x] * 2), t)
        uncond, text = noise.chunk(2)
        x = sched.step(uncond + 7.5 * (text - uncond), t, x, return_dict=False)[0]
    torch.testing.assert_close(ours, x, rtol=0, atol=0)
    for guidance in (7.5, 1.0):  # without CFG the loop runs on the first b rows
        assert glue_ms(Clock(torch.device("cpu")), template, latents, noise, guidance, 4, True, 1, 0) > 0


def test_budget_rows_are_compared_at_their_own_size(tiny_artifact: Path, tmp_path: Path) -> None:
    """With two sizes, ``ours_vram_budget`` runs at each and its cost line sets it against ``ours`` at the same size
    (the report keyed rows by system and batch: the 64x64 budget row was set against ours at 96x96)."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--baseline", "none", "--steps", "1", "--iters",
                                       "1", "--warmup", "0", "--stage-iters", "1", "--sizes", "64x64,96x96",
                                       "--vram-budget", "16GB", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    validate_result(data)
    e2e = {(r["system"], r["height"], r["width"]): r["e2e_s"] for r in data["runs"] if r["status"] == "ok"}
    assert {k for k in e2e if k[0] == "ours_vram_budget"} == {("ours_vram_budget", 64, 64),
                                                              ("ours_vram_budget", 96, 96)}
    for h in (64, 96):
        ours, budget = e2e[("ours", h, h)], e2e[("ours_vram_budget", h, h)]
        assert f"vram budget 16GB costs b=1 at {h}x{h}: e2e {ours:.3f} s -> {budget:.3f} s" in result.output


def test_budget_cost_line_uses_ours_at_the_same_size() -> None:
    from diffusion_trt.bench import Run, format_table

    rows = [Run("ours", 1, 64, 64, e2e_s=1.0), Run("ours", 1, 96, 96, e2e_s=4.0),
            Run("ours_vram_budget", 1, 64, 64, e2e_s=1.5), Run("ours_vram_budget", 1, 96, 96, e2e_s=5.0)]
    for r in rows[2:]:
        r.stage_memory_mb = {"text": 10.0, "unet": 20.0, "vae": 30.0}
    text = format_table({"runs": [r.to_json() for r in rows], "ratios": [], "config": {"vram_budget": "4GB"}})
    assert "vram budget 4GB costs b=1 at 64x64: e2e 1.000 s -> 1.500 s (+0.500 s per request)" in text
    assert "vram budget 4GB costs b=1 at 96x96: e2e 4.000 s -> 5.000 s (+1.000 s per request)" in text
    assert "  ours_vram_budget           64x64 b=1   text 10  unet 20  vae 30" in text


def _no_timing(*args: object, **kwargs: object) -> None:
    raise AssertionError("the benchmark started")


def test_bench_refuses_a_bad_json_path_before_any_work(tiny_artifact: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """--json/--plot are written at the end: a bad path is one error: line (exit 2) before anything is timed; the check
    creates no folder and leaves an existing file as it is."""
    import errno
    import os
    import tempfile

    import diffusion_trt.bench

    monkeypatch.setattr(diffusion_trt.bench, "run_bench", _no_timing)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    folder = f"{tmp_path} is a folder; pass a file path, e.g. {tmp_path}{os.sep}"
    cases = [
        (["--json", tmp_path], f"error: --json {folder}bench.json"),
        (["--plot", tmp_path], f"error: --plot {folder}bench.png"),
        (["--json", a_file / "sub" / "b.json"],
         f"error: --json {a_file / 'sub' / 'b.json'}: {a_file} is a file, not a folder; choose another path"),
    ]
    existing, missing = tmp_path / "old.json", tmp_path / "missing" / "sub" / "b.json"
    existing.write_text("keep me")
    cases.append((["--json", existing, "--plot", tmp_path], f"error: --plot {folder}bench.png"))  # neither touched
    for flag in ("--json", "--plot"):  # as run -o: a mistyped folder is refused, not made
        cases.append(([flag, missing], f"error: {flag} {missing}: the folder {tmp_path / 'missing'} does not exist; "
                                       f"create it first (mkdir -p {missing.parent}) or choose another path"))
    for args, message in cases:
        result = CliRunner().invoke(main, ["bench", str(tiny_artifact), *map(str, args)])
        assert result.exit_code == 2 and result.output == message + "\n", result.output
    assert existing.read_text() == "keep me" and not (tmp_path / "missing").exists()

    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkstemp", denied)  # as in a folder without write permission (tests run as root)
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--json", str(tmp_path / "b.json")])
    assert result.exit_code == 2
    assert result.output == (f"error: --json {tmp_path / 'b.json'}: cannot create a file in {tmp_path} (Permission "
                             "denied); no permission; choose a writable location or fix the permissions\n")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".diffusion-trt-probe")] == []


def test_bench_writes_json_and_plot_at_the_end(tiny_artifact: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--json and --plot are written once the benchmark is done, not when their paths are checked."""
    import diffusion_trt.bench

    out, png = tmp_path / "b.json", tmp_path / "b.png"
    fake = {"runs": [], "ratios": [], "config": _config(), "env": {"device": "cpu"}}

    def run_bench(*args: object, **kwargs: object) -> dict[str, object]:
        assert not out.exists() and not png.exists()  # nothing made at check time
        return fake

    monkeypatch.setattr(diffusion_trt.bench, "run_bench", run_bench)
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == fake and f"json: {out}" in result.output
    with Image.open(png) as image:
        assert image.format == "PNG"


def test_bench_refuses_a_size_outside_the_profile_before_any_work(tiny_artifact: Path) -> None:
    """--sizes 64x64,256x256 on a 32..128 artifact: one error line naming the size, exit 2, nothing timed (before,
    64x64 was timed first and the error came at 256x256's turn)."""
    from diffusion_trt.artifact.manifest import Manifest

    height = Manifest.read(tiny_artifact).profile.height
    lo, hi = height.min, height.max
    too_big = hi + 8
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--baseline", "none", "--steps", "1",
                                       "--sizes", f"64x64,{too_big}x64"])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        f"error: --sizes {too_big}x64: height={too_big} is outside the engine profile {lo}..{hi}; use a size in that "
        "range or recompile with --min-height/--max-height"], result.output


def test_bench_refuses_one_path_for_json_and_plot(tiny_artifact: Path, tmp_path: Path) -> None:
    """--json b.png --plot b.png printed "json: b.png" and "plot: b.png", and the chart replaced the JSON."""
    path = tmp_path / "b.png"
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--baseline", "none", "--steps", "1",
                                       "--json", str(path), "--plot", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[0] == (f"error: Invalid value for --plot: '{path}' is the --json file too; give "
                                             "each its own path, e.g. --json bench.json --plot bench.png")
    assert not path.exists()


@pytest.mark.parametrize(("args", "line"), [
    (["--height", "60"], "--height 60 is not a positive multiple of 8; use 56 or 64 (engine profile allows 32..128)"),
    (["--width", "256"], "--width 256 is outside the engine profile 32..128; use a size in that range or recompile "
                         "with --min-width/--max-width"),
    (["--scheduler", "nosuch"], "--scheduler nosuch is unknown; use one of pndm, ddim, ddpm, euler, euler_a, heun, "
                                "lms, dpm2, dpm2_a, dpm++, dpm++_karras, dpm++_sde, dpm++_sde_karras, unipc, deis"),
], ids=["height-60", "width-256", "scheduler-nosuch"])
def test_bench_refuses_a_bad_size_or_scheduler_before_the_load_naming_the_flag(
        tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], line: str) -> None:
    """bench --height 60 / --width 256 / --scheduler nosuch loaded the engines first, then said "height=60 ...",
    "scheduler='nosuch' is unknown" (the Python arguments): one line naming the flag, exit 2, nothing loaded."""
    from diffusion_trt.runtime import EnginePipeline

    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--baseline", "none", "--steps", "1", *args])
    assert result.exit_code == 2 and result.output == f"error: {line}\n", result.output


def test_bench_warns_of_height_and_width_with_sizes(tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--height/--width with --sizes were dropped silently (--sizes is what is measured)."""
    import diffusion_trt.bench

    monkeypatch.setattr(diffusion_trt.bench, "run_bench", _no_timing)
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--sizes", "64x64", "--height", "32", "--width",
                                       "32"])
    assert result.output.splitlines()[0] == ("warning: --height and --width: no effect with --sizes (the sizes "
                                             "measured are those of --sizes); drop it"), result.output


def test_bench_takes_an_empty_prompt_as_given(tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--prompt '' was replaced by the default landscape prompt, silently (run takes '' as the empty prompt)."""
    import diffusion_trt.bench

    seen: list[str] = []
    monkeypatch.setattr(diffusion_trt.bench, "run_bench", lambda cfg, **k: seen.append(cfg.prompt) or _no_timing())
    CliRunner().invoke(main, ["bench", str(tiny_artifact), "--baseline", "none", "--prompt", ""])
    assert seen == [""]


def test_bench_warns_of_model_dir_without_a_baseline(tiny_artifact: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """--model-dir with --baseline none was dropped silently (even a folder that does not exist)."""
    import diffusion_trt.bench

    monkeypatch.setattr(diffusion_trt.bench, "run_bench", _no_timing)
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--baseline", "none", "--model-dir",
                                       str(tmp_path / "missing")])
    assert result.output.splitlines()[0] == ("warning: --model-dir: no effect with --baseline none (it is the "
                                             "diffusers baseline's folder); drop it"), result.output


@pytest.mark.parametrize("value", ["", " "])
def test_bench_refuses_empty_sizes_once(tiny_artifact: Path, value: str) -> None:
    """`--sizes ''` said "'' in '' is not HEIGHTxWIDTH" (the empty item inside the empty value)."""
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--baseline", "none", "--steps", "1",
                                       "--sizes", value])
    assert result.exit_code == 2 and result.output == (
        f"error: --sizes {value!r} is empty; give sizes HEIGHTxWIDTH, e.g. --sizes 512x512,768x768\n"), result.output
