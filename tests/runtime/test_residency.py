"""A VRAM budget on the tiny artifact (ORT CPU): plans chosen at load and per call, engines opened per stage and
released, the same images as without a budget, the tiled VAE when the plan asks for it, refusals up front, and
``run/bench --vram-budget`` at the command line (exit 2 with the figures / the accepted forms)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from diffusion_trt.artifact.folder import write_manifest
from diffusion_trt.artifact.manifest import Manifest
from diffusion_trt.cli import main
from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.memory.plan import GiB, MiB, facts_path, load_memory_facts, record_memory_facts

KW = {"num_inference_steps": 2, "seed": 0, "output_type": "np", "progress": False}


@pytest.fixture(scope="module")
def reference(tiny_artifact: Path) -> dict[int, np.ndarray]:
    with EnginePipeline.from_artifacts(tiny_artifact) as pipe:
        return {s: pipe("a cat", height=s, width=s, **KW).images for s in (64, 128)}


@pytest.fixture()
def no_recorded_facts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DIFFUSION_TRT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _smallest(tiny_artifact: Path, request: tuple[int, int, int] | None = None) -> int:
    with pytest.raises(RuntimeInputError) as e:
        EnginePipeline.from_artifacts(tiny_artifact, vram_budget=1, vram_request=request)
    return int(str(e.value).split("--vram-budget ")[1].split("MiB")[0]) * MiB


class _Recorder:
    """A stage hook recording, when each stage's engines are open, which planned engines are open."""

    def __init__(self, pipe: EnginePipeline) -> None:
        self.pipe, self.events = pipe, []

    def stage_entered(self, stage: str) -> None:
        pass

    def stage_opened(self, stage: str) -> None:
        res = self.pipe.residency
        self.events.append((stage, sorted(n for n, s in res.staged.items() if s.is_open)))

    def stage_left(self, stage: str) -> None:
        pass


def test_a_roomy_budget_keeps_every_engine_resident(tiny_artifact: Path, reference: dict[int, np.ndarray],
                                                    no_recorded_facts: Path) -> None:
    with EnginePipeline.from_artifacts(tiny_artifact, vram_budget="16GB") as pipe:
        assert pipe.residency is not None and pipe.residency.plan.name == "all_resident"
        assert all(s.is_open for s in pipe.residency.staged.values())  # opened with the pipeline
        np.testing.assert_array_equal(pipe("a cat", **KW).images, reference[64])
        assert {n: s.opens for n, s in pipe.residency.staged.items()} == dict.fromkeys(pipe.residency.staged, 1)


def test_the_smallest_budget_runs_per_stage_with_the_same_images(tiny_artifact: Path,
                                                                 reference: dict[int, np.ndarray],
                                                                 no_recorded_facts: Path) -> None:
    smallest = _smallest(tiny_artifact)
    with EnginePipeline.from_artifacts(tiny_artifact, vram_budget=smallest) as pipe:
        res = pipe.residency
        assert res is not None and res.plan.name == "per_stage"
        assert not any(s.is_open for s in res.staged.values())  # nothing opens before a call
        for _ in range(2):
            np.testing.assert_array_equal(pipe("a cat", **KW).images, reference[64])
            assert not any(s.is_open for s in res.staged.values())  # released after every call
        assert {n: s.opens for n, s in res.staged.items()} == {"text_encoder": 2, "unet": 2, "vae_decoder": 2}


def test_the_loop_enters_each_stage_and_per_stage_opens_only_its_engines(tiny_artifact: Path,
                                                                         no_recorded_facts: Path) -> None:
    """The loop enters "text", then "unet" and "vae" per chunk (5 images in chunks of 4 + 1): under per_stage only
    the stage's engine is open there, the others were released; the engines are the real ones, no proxy."""
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine

    with EnginePipeline.from_artifacts(tiny_artifact, vram_budget=_smallest(tiny_artifact, (64, 64, 4)),
                                       vram_request=(64, 64, 4)) as pipe:
        res = pipe.residency
        assert res is not None and res.plan.name == "per_stage" and pipe.stages is res
        assert all(type(pipe.engines[n]) is OrtEngine for n in ("text_encoder", "unet", "vae_decoder"))
        assert res.tiled is not None and res.tiled.engine is pipe.engines["vae_decoder"]  # one layer when tiling
        recorder = _Recorder(pipe)
        res.hooks.append(recorder)
        images = pipe("a cat", num_images_per_prompt=5, **KW).images
    assert images.shape[0] == 5
    assert recorder.events == [("text", ["text_encoder"]), ("unet", ["unet"]), ("vae", ["vae_decoder"]),
                               ("unet", ["unet"]), ("vae", ["vae_decoder"])]
    assert {n: s.opens for n, s in res.staged.items()} == {"text_encoder": 1, "unet": 2, "vae_decoder": 2}


def test_all_resident_keeps_every_engine_open_in_every_stage(tiny_artifact: Path, no_recorded_facts: Path) -> None:
    with EnginePipeline.from_artifacts(tiny_artifact, vram_budget="16GB") as pipe:
        recorder = _Recorder(pipe)
        pipe.stages.hooks.append(recorder)
        pipe("a cat", **KW)
    every = ["text_encoder", "unet", "vae_decoder"]
    assert recorder.events == [("text", every), ("unet", every), ("vae", every)]


def test_given_embeddings_without_cfg_do_not_open_the_text_encoder(tiny_artifact: Path,
                                                                   reference: dict[int, np.ndarray],
                                                                   no_recorded_facts: Path) -> None:
    """With ``prompt_embeds`` and no CFG the loop encodes nothing, so it does not enter the "text" stage: a per-stage
    text encoder stays closed (as when it was opened on its first run)."""
    import torch

    with EnginePipeline.from_artifacts(tiny_artifact, vram_budget=_smallest(tiny_artifact)) as pipe:
        width = int(pipe.engines["unet"].spec.input("encoder_hidden_states").shape[2])
        e = torch.randn(1, 77, width, generator=torch.Generator().manual_seed(3))
        out = pipe(prompt_embeds=e, guidance_scale=1.0, **KW).images
        assert {n: s.opens for n, s in pipe.residency.staged.items()} == {"text_encoder": 0, "unet": 1,
                                                                          "vae_decoder": 1}
    assert out.shape == reference[64].shape and np.isfinite(out).all()


def test_engine_under_a_per_stage_budget_opens_it_until_the_next_call_ends(tiny_artifact: Path,
                                                                          no_recorded_facts: Path) -> None:
    """``pipe.engine(name)`` returns an open engine also when the budget opens it per stage (the other stages'
    engines are released first); the next call's end releases it with the others."""
    import torch

    with EnginePipeline.from_artifacts(tiny_artifact, vram_budget=_smallest(tiny_artifact)) as pipe:
        staged = pipe.residency.staged
        vae = pipe.engine("vae_decoder")
        assert vae is pipe.engines["vae_decoder"] and staged["vae_decoder"].is_open
        out = vae.run({"latent_sample": torch.zeros(1, 4, 8, 8)})["sample"]
        assert tuple(out.shape) == (1, 3, 64, 64)
        pipe.engine("unet")
        assert staged["unet"].is_open and not staged["vae_decoder"].is_open  # another stage's: released
        pipe("a cat", **KW)
        assert not any(s.is_open for s in staged.values())


def test_a_budget_below_every_plan_is_refused_before_loading_and_per_call(tiny_artifact: Path,
                                                                          no_recorded_facts: Path) -> None:
    smallest = _smallest(tiny_artifact)
    with pytest.raises(RuntimeInputError, match=r"smallest plan, per_stage, peaks at .*estimated"):
        EnginePipeline.from_artifacts(tiny_artifact, vram_budget=smallest - MiB)
    # a budget that fits 64x64 but not batch 4 at 128x128: refused at that call, before anything runs
    with EnginePipeline.from_artifacts(tiny_artifact, vram_budget=smallest) as pipe:
        with pytest.raises(RuntimeInputError, match=r"at 128x128, batch 4: .*--vram-budget \d+MiB"):
            pipe("a cat", height=128, width=128, num_images_per_prompt=4, **KW)
        assert not any(s.is_open for s in pipe.residency.staged.values())


def test_the_load_time_check_plans_for_the_size_a_call_gets(tiny_artifact: Path, tmp_path: Path,
                                                          no_recorded_facts: Path) -> None:
    """Without ``vram_request`` the budget is checked at load for the size a call without sizes gets, the profile's opt
    size (issue 23): it was the model's default size, so with an opt size above it a budget accepted at load was
    refused by the first call."""
    art = tmp_path / "opt-128"
    shutil.copytree(tiny_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["profile"]["height"][1] = manifest["profile"]["width"][1] = 128  # the model's default stays 64x64
    write_manifest(art, manifest)
    with pytest.raises(RuntimeInputError, match=r"at 128x128, batch 1"):
        EnginePipeline.from_artifacts(art, vram_budget=1)
    with EnginePipeline.from_artifacts(art, vram_budget=_smallest(art)) as pipe:  # the least the load accepts
        assert pipe("a cat", **KW).images.shape[1:3] == (128, 128)  # and the first call runs inside it


def test_measured_vae_facts_make_the_plan_tile_the_vae(tiny_artifact: Path, reference: dict[int, np.ndarray],
                                                      no_recorded_facts: Path) -> None:
    """Recorded (measured) figures replace the estimates; a VAE that needs 2 GiB at 128x128 but 0.5 GiB per
    64x64 tile gets decoded in tiles under a budget between the two."""
    manifest = Manifest.read(tiny_artifact)
    path = record_memory_facts(facts_path(manifest), manifest, "a test", {
        "vae_decoder": {"weights_bytes": 1 * MiB, "activations": [
            {"rows": 1, "height": 128, "width": 128, "bytes": 2 * GiB},
            {"rows": 1, "height": 64, "width": 64, "bytes": GiB // 2}]},
    })
    assert load_memory_facts(None, manifest)["engines"]["vae_decoder"]["weights_bytes"] == MiB
    with EnginePipeline.from_artifacts(tiny_artifact, vram_budget="1.5GiB", vram_request=(128, 128, 1)) as pipe:
        plan = pipe.residency.plan
        assert plan.vae_tiled and plan.name == "all_resident"
        vae = plan.engines["vae_decoder"]
        assert vae.activations == 2 * GiB and vae.activations_source == "measured at 1x128x128"
        assert vae.weights_source == "measured on a test"
        out = pipe("a cat", height=128, width=128, **KW).images
        assert pipe.residency.tiled is not None and pipe.residency.tiled.last_layout == "diffusers"
    assert out.shape == reference[128].shape and np.isfinite(out).all()
    # tiles blended: close to the whole decode but not equal (the seams are tiling's own; see test_vae_tiling)
    assert 0 < np.abs(out - reference[128]).max() < 1.0
    path.unlink()


def test_malformed_budget_and_facts_of_another_artifact(tiny_artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeInputError, match=r'"8GB" \(10\*\*9 bytes\), "8GiB"'):
        EnginePipeline.from_artifacts(tiny_artifact, vram_budget="8 gigs")
    other = tmp_path / "facts.json"
    other.write_text(json.dumps({"schema": "diffusion-trt/memory/1", "manifest_sha256": "0" * 64, "engines": {}}))
    with pytest.raises(RuntimeInputError, match="is for artifact manifest"):
        EnginePipeline.from_artifacts(tiny_artifact, vram_budget="8GB", memory_facts=other)


def test_cli_run_refuses_a_budget_no_plan_meets_naming_the_smallest(tiny_artifact: Path, tmp_path: Path,
                                                                    no_recorded_facts: Path) -> None:
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "x", "--steps", "1", "--vram-budget", "100MB",
                                       "-o", str(tmp_path / "o.png")])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "is below what this artifact needs at 64x64, batch 1" in result.output
    assert re.search(r"Use --vram-budget \d+MiB or more", result.output)
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize("command", ["run", "bench", "serve"])
def test_cli_malformed_budget_names_the_accepted_forms(tiny_artifact: Path, command: str) -> None:
    args = [command, str(tiny_artifact), "--vram-budget", "lots"] + (["-p", "x"] if command == "run" else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "--vram-budget" in result.output and '"8GiB"' in result.output and "byte count" in result.output


def test_cli_run_under_the_smallest_budget(tiny_artifact: Path, tmp_path: Path, no_recorded_facts: Path) -> None:
    smallest = _smallest(tiny_artifact)
    out = tmp_path / "o.png"
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "x", "--steps", "1", "--vram-budget",
                                       str(smallest), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.exists()



def test_bench_with_a_budget_reports_the_plan_and_its_cost(tiny_artifact: Path, tmp_path: Path,
                                                           no_recorded_facts: Path) -> None:
    from diffusion_trt.bench import validate_result

    smallest = _smallest(tiny_artifact)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--baseline", "none", "--steps", "2", "--iters",
                                       "1", "--warmup", "0", "--stage-iters", "1", "--vram-budget", str(smallest),
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    validate_result(data)
    runs = {r["system"]: r for r in data["runs"] if r["batch_size"] == 1}
    budget = runs["ours_vram_budget"]
    assert budget["status"] == "ok" and budget["e2e_s"] > 0 and budget["vram_plan"].startswith("per_stage")
    assert set(budget["stage_memory_mb"]) == {"text", "unet", "vae"}  # None on the CPU: not measured
    assert ("ours_vram_budget", "ours") in {(q["system"], q["baseline"]) for q in data["ratios"]}
    assert f"vram budget {smallest} costs b=1" in result.output


def test_inspect_shows_memory_per_engine_with_its_sources(tiny_artifact: Path, no_recorded_facts: Path) -> None:
    result = CliRunner().invoke(main, ["inspect", str(tiny_artifact), "--json"])
    assert result.exit_code == 0, result.output
    mem = json.loads(result.output[result.output.index("{"):])["memory"]
    assert mem["shapes"] == {"opt": "1x64x64", "max": "4x128x128"}
    unet = mem["components"]["unet"]
    assert unet["opt"]["weights_source"] == "estimated: initializer bytes" and unet["opt"]["weights_bytes"] > 0
    assert unet["max"]["activations_bytes"] > unet["opt"]["activations_bytes"]
    text = CliRunner().invoke(main, ["inspect", str(tiny_artifact)]).output
    assert "memory     per engine at opt 1x64x64 / max 4x128x128" in text and "none recorded" in text


def test_stage_memory_meter_off_cuda_reads_nothing() -> None:
    """The meter is a hook of the stage context (no engine wrapped): inside ``watch`` it follows the stages the loop
    enters, after it the stages no longer tell it; off CUDA it reads nothing."""
    import torch

    from diffusion_trt.runtime.memory.memory_meter import StageMemoryMeter
    from diffusion_trt.runtime.memory.stages import Stages

    meter, stages = StageMemoryMeter(torch.device("cpu")), Stages()
    with meter.watch(stages):
        assert stages.hooks == [meter]
        with stages.stage("unet"):
            assert meter.stage == "unet"
    assert stages.hooks == []
    with stages.stage("vae"):
        assert meter.stage == "unet"
    assert meter.peaks_mib() == {"text": None, "unet": None, "vae": None}


CPU_BUDGET_WARNING = ("warning: --vram-budget 16GB on the CPU plans as for a GPU (CUDA context included) and does not "
                      "cap host RAM (not measured): it only picks which engines stay open between stages")


@pytest.mark.parametrize(("command", "extra", "code"), [
    ("run", ["-p", "x", "--steps", "1", "-o", "{tmp}/o.png"], 0),
    ("bench", ["--json", "{tmp}"], 2),  # refused before the benchmark: the warning came first
    ("serve", ["--lora-dir", "{tmp}/missing"], 2),  # refused before the engines load and the server starts
])
def test_cli_warns_once_that_a_budget_does_nothing_on_the_cpu(tiny_artifact: Path, tmp_path: Path, command: str,
                                                               extra: list[str], code: int) -> None:
    args = [command, str(tiny_artifact), "--vram-budget", "16GB"] + [a.format(tmp=tmp_path) for a in extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, result.output
    warnings = [ln for ln in result.output.splitlines() if ln.startswith("warning: --vram-budget")]
    assert len(warnings) == 1 and warnings[0].startswith(CPU_BUDGET_WARNING), result.output
    assert len([ln for ln in result.output.splitlines() if ln.startswith("error:")]) == (code == 2)


def test_cli_run_on_the_cpu_warns_and_refuses_a_budget_without_contradiction(tiny_artifact: Path, tmp_path: Path,
                                                                             no_recorded_facts: Path) -> None:
    """`run --vram-budget 1B` on the CPU warned "no effect on the CPU", then a plan counting 768 MiB of CUDA context
    refused the budget: two lines that contradicted each other. The warning now says what the budget does there."""
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "x", "--steps", "1", "--vram-budget", "1B",
                                       "-o", str(tmp_path / "o.png")])
    lines = result.output.splitlines()
    assert result.exit_code == 2 and len(lines) == 2, result.output
    assert lines[0] == ("warning: --vram-budget 1B on the CPU plans as for a GPU (CUDA context included) and does not "
                        "cap host RAM (not measured): it only picks which engines stay open between stages; drop it, "
                        "or run on CUDA (--device cuda)"), result.output
    assert lines[1].startswith("error: vram budget 0.0 MiB (1 bytes) is below what this artifact needs"), result.output
    assert "CUDA context" in lines[1] and "no effect" not in result.output, result.output


def test_cli_run_without_a_budget_gives_no_budget_warning(tiny_artifact: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "x", "--steps", "1", "-o",
                                       str(tmp_path / "o.png")])
    assert result.exit_code == 0 and "--vram-budget" not in result.output, result.output
