"""The command line: the README's main job, and every bad input giving a message with the value and the fix."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from diffusion_trt.cli import main
from diffusion_trt.runtime.png import read_png_parameters

REPO = Path(__file__).resolve().parents[1]


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def readme_main_job() -> list[list[str]]:
    """The `diffusion-trt ...` steps of the README's first command, in order."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Set up and run.*?```bash\n(.*?)\n```", text, re.S)
    assert block, "README lacks the 'Set up and run' command"
    steps = [shlex.split(part.strip()) for part in block.group(1).split("&&")]
    return [s for s in steps if s and s[0] == "diffusion-trt"]


def test_readme_main_job_runs(tmp_path: Path) -> None:
    steps = readme_main_job()
    assert [s[1] for s in steps] == ["dummy-pipeline", "compile", "run"]
    exe = shutil.which("diffusion-trt") or str(Path(sys.executable).parent / "diffusion-trt")
    out = ""
    for step in steps:
        proc = subprocess.run([exe, *step[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = proc.stdout
    assert "image: out.png" in out
    params = read_png_parameters(tmp_path / "out.png")
    assert params["prompt"] == "an ink painting of a mountain"


def test_help_has_examples() -> None:
    for cmd in ("compile", "run", "dummy-pipeline"):
        code, out = _invoke(cmd, "--help")
        assert code == 0 and "Examples:" in out


def test_compile_help_names_the_controlnet_components() -> None:
    """--components takes unet_controlnet, cond_embed_NAME and controlnet_NAME with --controlnet; its help named the
    four plain components only."""
    code, out = _invoke("compile", "--help")
    text = " ".join(out.split())
    assert code == 0 and "with --controlnet also unet_controlnet, cond_embed_NAME and controlnet_NAME" in text, out


def test_dummy_lora_onto_an_existing_file_names_its_argument(tmp_path: Path) -> None:
    """dummy-lora's OUT is positional: "choose another -o" named an option it does not have."""
    (tmp_path / "ink.safetensors").write_bytes(b"x")
    code, out = _invoke("dummy-lora", tmp_path, tmp_path / "ink.safetensors")
    assert code == 2 and out.strip() == (f"error: {tmp_path / 'ink.safetensors'} already exists; pass --overwrite "
                                         "to replace it, or choose another OUT"), out


def test_run_writes_png_with_parameters(tiny_artifact: Path, tmp_path: Path) -> None:
    code, out = _invoke("run", tiny_artifact, "-p", "a guohua landscape", "--steps", "3", "--seed", "5",
                        "--batch-size", "2", "-o", tmp_path / "img.png")
    assert code == 0, out
    assert "image: " + str(tmp_path / "img.png") in out and "img-1.png" in out
    params = read_png_parameters(tmp_path / "img-1.png")
    assert params["seed"] == 5 and params["num_inference_steps"] == 3 and params["index"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], r"Invalid value for .--steps.: 0 is not in the range x>=1"),
        (["--guidance", "-1"], r"error: --guidance -1\.0 must be a finite number >= 0"),
        (["--scheduler", "nope"], r"error: --scheduler nope is unknown; use one of pndm, ddim"),
        (["--height", "60"], r"--height 60 is not a positive multiple of 8; use 56 or 64 \(engine profile allows 32"),
        # 300 and 99999999999999999999 suggested 296 or 304 / 99999999999999999992 or 10^20: both outside the profile
        (["--height", "300"], r"error: --height 300 is not a positive multiple of 8; use 128 \(engine profile allows "
                              r"32\.\.128\)$"),
        (["--width", "99999999999999999999"], r"error: --width 99999999999999999999 is not a positive multiple of 8; "
                                              r"use 128 \("),
        (["--width", "33"], r"error: --width 33 is not a positive multiple of 8; use 32 or 40 \("),
        (["--width", "256"], r"--width 256 is outside the engine profile 32\.\.128; .* --min-width/--max-width"),
        # --batch-size 9 now runs in chunks (tests/runtime/test_batching.py)
        (["--device", "cpu", "--devices", "0,1"], r"--devices 0,1 needs CUDA; drop it or use --device cuda"),
        (["--devices", "0,x"], r"'x' is not a CUDA device index|this host has no CUDA device"),
    ],
)
def test_run_bad_input(tiny_artifact: Path, tmp_path: Path, args: list[str], message: str) -> None:
    code, out = _invoke("run", tiny_artifact, "-p", "x", "-o", tmp_path / "o.png", *args)
    assert code != 0
    assert re.search(message, out), out
    assert not (tmp_path / "o.png").exists()


def test_messages_name_the_options_the_user_typed() -> None:
    """A library message names the Python API's arguments (``name=value``); the CLI writes those the error names
    (DiffusionTrtError.arguments) as the options of the command: flags, values, lists, the --x/--no-x pair."""
    from diffusion_trt.cli import _as_typed
    from diffusion_trt.errors import RuntimeInputError

    @click.command()
    @click.option("--refittable", is_flag=True)
    @click.option("--cuda-graph/--no-cuda-graph", default=None)
    @click.option("--backend")
    @click.option("--compute-capability", "compute_capabilities")
    @click.option("--steps", type=int)
    @click.option("-p", "--prompt")
    def cmd(**kwargs: object) -> None:
        pass

    ctx = click.Context(cmd)
    error = RuntimeInputError("")
    error.arguments = frozenset({"refittable", "cuda_graph", "backend", "compute_capabilities",
                                 "num_inference_steps", "prompt", "height"})
    cases = {
        "refittable=True with backend='tensorrt-rtx'": "--refittable with --backend tensorrt-rtx",
        "(got refittable=False, cuda_graph=False, backend=None)":
            "(got no --refittable, --no-cuda-graph, no --backend)",
        "compute_capabilities=['8.6', '8.9'] are": "--compute-capability 8.6,8.9 are",
        "num_inference_steps=5000 is more": "--steps 5000 is more",  # the API name of run's --steps
        # named without a value: ``name=``, or a bare snake_case name; a bare one-word name is prose
        "drop refittable= or raise num_inference_steps.": "drop --refittable or raise --steps.",
        "cuda_graph is on; prompt and backend=, compute_capabilities)": "--cuda-graph is on; prompt and --backend, "
                                                                       "--compute-capability)",
        "a/num_inference_steps, num_inference_steps.onnx, num_inference_steps=<x>, refittable=x":
            "a/num_inference_steps, num_inference_steps.onnx, num_inference_steps=<x>, refittable=x",
        "prompt='a cat' and prompt='x'": "--prompt 'a cat' and --prompt x",
        # not an option of this command / not named by the error / not a value / inside a word or option
        "height=70, precision='fp16', backend=<object>, --pass-option x_backend=1, refittable=true":
            "height=70, precision='fp16', backend=<object>, --pass-option x_backend=1, refittable=true",
    }
    for message, typed in cases.items():
        assert _as_typed(message, error, ctx) == typed
    assert _as_typed("refittable=True", RuntimeInputError("refittable=True"), ctx) == "refittable=True"  # no names
    wrapped = RuntimeInputError("compile failed at model check: refittable=True")
    wrapped.__cause__ = error  # a stage wrapper re-raises with a prefix: the names of the cause count
    assert _as_typed(str(wrapped), wrapped, ctx) == "compile failed at model check: --refittable"


@pytest.mark.parametrize(
    ("command", "args", "message"),
    [
        (["compile"], ["--refit-convs"], "error: --refit-convs needs --refittable: it makes the spatial Conv weights "
                                         "of a refittable ONNX Runtime artifact graph inputs too; add --refittable"),
        (["compile"], ["--precision", "fp16"], "error: --precision fp16 with --device cpu is not supported: ONNX "
                                               "Runtime's CPU provider has no fp16 kernels for most UNet ops; use "
                                               "--precision fp32 or --device cuda"),
        (["compile"], ["--precision", "fp8"], "error: --precision fp8 is for TensorRT only (ONNX Runtime has no fp8 "
                                              "kernels for these ops); use --backend tensorrt-rtx (or --backend "
                                              "tensorrt) with --device cuda, or --precision int8"),
        (["compile"], ["--compute-capability", "8.6"],
         "error: --compute-capability 8.6 are TensorRT-RTX build targets, but --backend ort builds for the GPU it "
         "runs on; use --backend tensorrt-rtx, or no --compute-capability"),
        (["run", "-p", "x"], ["--scheduler", "nope"], "error: --scheduler nope is unknown; use one of pndm"),
        (["run", "-p", "x"], ["--size-buckets", ""], "error: --size-buckets '' is empty; give 'auto'"),
        (["bench", "--baseline", "none"], ["--iters", "0"], "error: --iters 0 must be >= 1"),
        (["bench", "--baseline", "none"], ["--warmup", "-1"], "error: --warmup -1 must be >= 0"),
    ],
    ids=["refit-convs", "fp16-cpu", "fp8-ort", "cc-ort", "run-scheduler", "run-empty-buckets", "bench-iters",
         "bench-warmup"],
)
def test_wrong_flags_are_refused_naming_the_flags(tiny_pipeline_dir: Path, tiny_artifact: Path, tmp_path: Path,
                                                  command: list[str], args: list[str], message: str) -> None:
    where, out_args = {"compile": (tiny_pipeline_dir, ["-o", tmp_path / "a"]),
                       "run": (tiny_artifact, ["-o", tmp_path / "a.png"]), "bench": (tiny_artifact, [])}[command[0]]
    code, out = _invoke(command[0], where, *command[1:], *args, *out_args)
    assert code == 2, out
    assert [line for line in out.splitlines() if line.startswith("error:")] == [out.strip().splitlines()[-1]]
    assert out.strip().splitlines()[-1].startswith(message), out
    assert not list(tmp_path.iterdir())


def test_run_batch_beyond_host_memory_is_refused_up_front(tiny_artifact: Path, tmp_path: Path) -> None:
    """--batch-size 100000000 crashed inside prepare_latents (102 GB for the latents); now one line, exit 2."""
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1", "--batch-size", "100000000",
                        "-o", tmp_path / "o.png")
    assert code == 2, out
    assert re.search(r"^error: batch = 1 prompt\(s\) x --batch-size 100000000 = 100000000 images at 64x64 "
                     r"\(WxH\) needs at least [\d.]+ GiB of host memory: .* is available; ask for at most \d+ images "
                     r"per call and call again$", out, re.M), out
    assert "Traceback" not in out and not (tmp_path / "o.png").exists()


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--height", "60"], r"--height 60 is not a positive multiple of 8; use 56 or 64 "
                             r"\(engine profile allows 32\.\.128\)"),
        (["--width", "256"], r"--width 256 is outside the engine profile 32\.\.128; .* --min-width/--max-width"),
        (["--guidance", "nan"], r"--guidance nan must be a finite number >= 0; use e\.g\. 7\.5 .*"),
        (["--guidance", "1e39"], r"--guidance 1e\+39 is beyond float32 \(at most 3\.403e\+38\): on the engines' "
                                 r"tensors it is inf; use e\.g\. 7\.5 .*"),
        (["--batch-size", "0"], r"--batch-size 0 must be an integer >= 1; use 1 or more"),
        (["--batch-size", "100000000"], r"batch = 1 prompt\(s\) x --batch-size 100000000 = 100000000 "
                                        r"images at 64x64 \(WxH\) needs at least .* is available; .*"),
    ],
    ids=["height-60", "width-256", "guidance-nan", "guidance-1e39", "batch-0", "batch-10**8"],
)
def test_run_refuses_what_the_artifact_cannot_honour_before_any_engine_opens(
        tiny_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], line: str) -> None:
    """The request is checked against the manifest's facts before the load (it was refused after 15-18 s of it): one
    error line, exit 2, and no ONNX Runtime session was ever made."""
    import onnxruntime as ort

    from diffusion_trt.runtime import EnginePipeline

    opened: list[str] = []
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: opened.append("session") or pytest.fail("opened"))
    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: opened.append("load") or pytest.fail("load"))
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1", "-o", tmp_path / "o.png", *args)
    assert code == 2, out
    assert len(out.splitlines()) == 1 and re.fullmatch(f"error: {line}", out.strip()), out
    assert opened == [] and not (tmp_path / "o.png").exists()


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--image", "{rgb64}", "--strength", "0"], r"--strength 0\.0 must be a number in \(0, 1\]: .*"),
        (["--image", "{rgb64}", "--strength", "nan"], r"--strength nan must be a number in \(0, 1\]: .*"),
        # named the Python arguments: "raise strength to >= 1 or num_inference_steps to >= 10"
        (["--image", "{rgb64}", "--strength", "0.1"],
         r"--strength 0\.1 with --steps 1 leaves int\(1 \* 0\.1\) = 0 denoising steps; raise it to e\.g\. "
         r"--strength 1 or --steps 10"),
        (["--image", "{rgb60}", "--strength", "1"],
         r"--image width 60 is not a multiple of 8 .*; resize or crop the image to 56 or 64 .*"),
        (["--image", "{rgb64}", "--strength", "1", "--height", "32"],
         r"--height 32 but the image is 64x64 \(WxH\); with --image the size is the image's: drop --height or "
         r"resize the image \(it is never resized here\)"),  # said "with image= ...: drop height="
        (["--image", "{rgb64}", "--mask", "{mask32}"],
         r"--mask is 32x32 \(WxH\) but the image is 64x64; pass a mask of the image's size"),  # said "mask_image"
        (["--clip-skip", "5"], r"--clip-skip 5 is more than this artifact's text encoder serves \(up to 1; .*"),
        (["--controlnet", "canny", "--control-image", "{rgb64}"],
         r"--controlnet: this artifact has no ControlNet; compile it with --controlnet \[NAME=\]FOLDER"),
        # said "0 --control-image for 1 --controlnet; give one control image per ControlNet": adding one then
        # met "this artifact has no ControlNet"
        (["--controlnet", "canny"],
         r"--controlnet: this artifact has no ControlNet; compile it with --controlnet \[NAME=\]FOLDER"),
        (["--control-image", "{rgb64}"],
         r"--control-image: this artifact has no ControlNet; compile it with --controlnet \[NAME=\]FOLDER"),
    ],
    ids=["strength-0", "strength-nan", "strength-no-step", "image-width-60", "height-not-the-image's", "mask-size",
         "clip-skip-5", "no-controlnet", "controlnet-without-image-no-controlnet", "control-image-alone-no-controlnet"],
)
def test_run_refuses_bad_image_clip_skip_and_controlnet_arguments_before_any_engine_opens(
        tiny_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], line: str) -> None:
    """These were refused after the engines loaded (15-18 s for SD): the manifest has every fact they need."""
    from PIL import Image

    from diffusion_trt.runtime import EnginePipeline

    files = {"rgb64": tmp_path / "rgb64.png", "rgb60": tmp_path / "rgb60.png", "mask32": tmp_path / "mask32.png"}
    Image.new("RGB", (64, 64), "red").save(files["rgb64"])
    Image.new("RGB", (60, 64), "red").save(files["rgb60"])
    Image.new("L", (32, 32), 255).save(files["mask32"])
    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1", "-o", tmp_path / "o.png",
                        *(a.format(**files) for a in args))
    assert code == 2, out
    assert len(out.splitlines()) == 1 and re.fullmatch(f"error: {line}", out.strip()), out
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize("args", [["--guess-mode"], ["--control-guidance-start", "0.2"],
                                  ["--control-guidance-end", "0.5"], ["--control-preprocess", "canny"]])
def test_controlnet_options_without_a_controlnet_are_refused(args: list[str], tiny_artifact: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """--guess-mode, --control-guidance-start/-end and --control-preprocess without --controlnet did nothing, silently:
    one error line naming the flag, exit 2, before the load."""
    from diffusion_trt.runtime import EnginePipeline

    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    code, out = _invoke("run", tiny_artifact, "-p", "x", *args, "-o", tmp_path / "o.png")
    assert code == 2, out
    assert out.splitlines() == [f"error: {args[0]} needs --controlnet NAME --control-image FILE: it sets how "
                                f"ControlNets act, and none is given; add one, or drop {args[0]}",
                                "try 'main run --help'"], out


@pytest.mark.parametrize("command", ["run", "bench"])
def test_empty_devices_is_refused(command: str, tiny_artifact: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`--devices ''` (an unset shell variable) ran on one device, silently, as if --devices were not given."""
    from diffusion_trt.runtime import EnginePipeline

    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    rest = ["-p", "x", "-o", tmp_path / "o.png"] if command == "run" else ["--baseline", "none"]
    code, out = _invoke(command, tiny_artifact, *rest, "--devices", "")
    assert code == 2 and out.splitlines() == ["error: Invalid value for '--devices': '' is empty; give CUDA devices, "
                                              "e.g. 0,1 or all, or drop --devices to run on one device",
                                              f"try 'main {command} --help'"], out
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize(("args", "name"), [
    (["run", "ART", "-p", "x", "-o", ""], "'-o' / '--output'"),  # said "'.' does not end in .png"
    (["run", "ART", "-p", "x", "-o", "OUT/o.png", "--runtime-cache", ""], "'--runtime-cache'"),  # ran, cache in .
    (["run", "ART", "-p", "x", "-o", "OUT/o.png", "--embedding", ""], "'--embedding'"),  # "embedding file . is a ..."
    (["inspect", ""], "'ARTIFACT_DIR'"),  # read the current folder as the artifact
    (["compile", "", "-o", "OUT/art"], "'MODEL_DIR'"),  # ". has no model_index.json"
])
def test_an_empty_path_is_refused_naming_it(args: list[str], name: str, tiny_artifact: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty path (an unset shell variable) was read as Path(''), the current folder."""
    from diffusion_trt.runtime import EnginePipeline

    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    code, out = _invoke(*(a.replace("ART", str(tiny_artifact)).replace("OUT", str(tmp_path)) for a in args))
    assert code == 2 and out.splitlines() == [f"error: Invalid value for {name}: '' is empty; give a path",
                                              f"try 'main {args[0]} --help'"], out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("which", ["empty", "artifact"])
def test_verify_source_that_is_no_model_folder_is_refused(which: str, tiny_artifact: Path, tmp_path: Path) -> None:
    """verify --source EMPTY_DIR (or the artifact itself): "problem: --source ...: its weights differ from the ones
    compiled (sha256 e3b0c44298fc... != ...)", exit 3, as if the model had changed; it is no model folder (exit 2)."""
    source = tmp_path if which == "empty" else tiny_artifact
    code, out = _invoke("verify", tiny_artifact, "--no-host", "--source", source)
    assert code == 2 and out.splitlines() == [f"error: Invalid value for --source: '{source}' has no model_index.json: "
                                              "it is not a diffusers pipeline folder; pass the folder (or "
                                              ".safetensors file) the artifact was compiled from",
                                              "try 'main verify --help'"], out


def test_library_warnings_name_the_options_the_user_typed(tiny_artifact: Path, tmp_path: Path) -> None:
    """run --cudnn-algo-search exhaustive --runtime-cache DIR on a CPU artifact warned "cudnn_conv_algo_search=
    EXHAUSTIVE: no effect ..." and "runtime_cache_dir: no effect ...": the Python arguments, not the flags typed."""
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1", "-o", tmp_path / "o.png",
                        "--cudnn-algo-search", "exhaustive", "--runtime-cache", tmp_path / "rc")
    assert code == 0, out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: --runtime-cache: no effect on a 'ort' artifact (TensorRT-RTX caches its kernels)",
                        "warning: --cudnn-algo-search EXHAUSTIVE: no effect on a 'ort' artifact on cpu (it picks ONNX "
                        "Runtime CUDA's convolution algorithms)"], out


def test_run_snap_without_a_size_warns(tiny_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run --snap without --height/--width (e.g. with --image, never resized) did nothing, silently."""
    from PIL import Image

    from diffusion_trt.runtime import EnginePipeline

    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    Image.new("RGB", (64, 64), "red").save(tmp_path / "in.png")
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--snap", "--image", tmp_path / "in.png", "--steps", "1",
                        "-o", tmp_path / "o.png")  # refused after it: --strength 0.8 leaves no step of 1
    warning = ("warning: --snap: no effect without --height/--width (it rounds those to sizes the artifact allows; "
               "an --image is never resized)")
    assert code == 2 and out.splitlines()[0] == warning, out


@pytest.mark.parametrize("command", ["run", "compile"])
def test_lora_without_a_file_is_one_error_line(command: str, tiny_artifact: Path, tiny_pipeline_dir: Path,
                                               tmp_path: Path) -> None:
    """`--lora ''` said 'LoRA path . is a folder' (the empty path read as the current folder)."""
    source, rest = {"run": (tiny_artifact, ["-p", "x", "-o", tmp_path / "o.png"]),
                    "compile": (tiny_pipeline_dir, ["-o", tmp_path / "art"])}[command]
    code, out = _invoke(command, source, *rest, "--lora", "")
    assert code == 2 and out == ("error: --lora '' names no file; pass FILE or FILE:SCALE, e.g. "
                                 "style.safetensors:0.8\n"), out
    assert not (tmp_path / "o.png").exists() and not (tmp_path / "art").exists()


def test_run_lora_on_an_artifact_that_cannot_take_one_is_refused_before_any_engine_opens(
        tiny_artifact: Path, tiny_pipeline_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run --lora` on an artifact compiled without --refittable was refused after the engines loaded."""
    from diffusion_trt.compiler.dummy_lora import write_dummy_lora
    from diffusion_trt.runtime import EnginePipeline

    lora = tmp_path / "ink.safetensors"
    write_dummy_lora(tiny_pipeline_dir, lora, rank=2, seed=0)
    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1", "--lora", f"{lora}:0.8",
                        "-o", tmp_path / "o.png")
    assert code == 2, out
    assert out.strip() == ("error: LoRA ink.safetensors: this 'ort' artifact was compiled without --refittable (its "
                           "weights are constants of the ONNX Runtime sessions); recompile with `diffusion-trt compile "
                           "MODEL --refittable`, or merge the LoRA at compile time with `diffusion-trt compile MODEL "
                           "--lora ink.safetensors:0.8`"), out
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "ART"], "error: Missing option '-p' / '--prompt'."),
        (["run", "ART", "-p", "x", "--steps", "0"], "error: Invalid value for '--steps': 0 is not in the range x>=1."),
        (["run", "ART", "-p", "x", "--mask", "ART/manifest.json"],
         "error: --mask needs --image: the image to inpaint (the mask marks what to repaint)"),
        (["verify", "ART", "--tensorrt", "10.8.0.43"], "error: --tensorrt and --compute-capability go together"),
        # 'abc' came out as one 'problem:' per plan of a TensorRT artifact, exit 3, and passed on an ORT one
        (["verify", "ART", "--tensorrt", "10.8.0.43", "--compute-capability", "abc"],
         "error: Invalid value for '--compute-capability': compute capability 'abc' is not understood"),
        (["verify", "ART", "--tensorrt", "ten", "--compute-capability", "9.0"],
         "error: Invalid value for '--tensorrt': 'ten' is not a version"),
        (["nope"], "error: No such command 'nope'."),
        (["--bogus", "run"], "error: No such option '--bogus'"),
        (["compile", "ART", "--backend", "onnx"],
         "error: Invalid value for '--backend': 'onnx' is not one of 'ort', 'tensorrt', 'tensorrt-rtx'."),
    ],
)
def test_click_usage_errors_are_one_error_line(tiny_artifact: Path, args: list[str], message: str) -> None:
    """click's three lines (Usage / Try / Error) become one ``error:`` line and where the help is; exit 2."""
    code, out = _invoke(*[a.replace("ART", str(tiny_artifact)) for a in args])
    command = f" {args[0]}" if args[0] in ("run", "verify", "compile") else ""
    assert code == 2, out
    assert out.splitlines()[0].startswith(message) and out.splitlines()[1:] == [f"try 'main{command} --help'"], out


def test_verify_of_an_ort_artifact_against_a_tensorrt_target_says_it_checked_this_machine(
        tiny_artifact: Path) -> None:
    """An ONNX Runtime artifact has no plans to check against ``--tensorrt/--compute-capability``: it printed 'runs on
    the target' having checked this machine's providers."""
    code, out = _invoke("verify", tiny_artifact, "--tensorrt", "10.8.0.43", "--compute-capability", "9.0")
    assert code == 0, out
    assert ("warning: --tensorrt / --compute-capability: not used: an ONNX Runtime artifact holds no TensorRT "
            "plans") in out
    assert "runs on this machine" in out and "runs on the target" not in out


@pytest.mark.parametrize(
    ("args", "option", "value", "fix"),
    [
        (["compile", "MODEL", "-o", "OUT"], "--min-cosine", "nan", " (0<=x<=1), e.g. 0.98 (the default)"),
        (["compile", "MODEL", "-o", "OUT"], "--min-psnr", "-inf", ", e.g. 20 (the default)"),
        (["compile", "MODEL", "-o", "OUT"], "--smooth-quant-alpha", "nan", " (0<=x<=1)"),
        (["compile", "MODEL", "-o", "OUT"], "--cache-max-gb", "inf", " (x>0), e.g. 20 (the default)"),
        (["compile", "MODEL", "-o", "OUT"], "--lock-timeout", "1e400", " (x>=0), e.g. 0 (the default)"),
        (["run", "ART", "-p", "x", "-o", "OUT.png"], "--control-guidance-start", "nan", ", e.g. 0 (the default)"),
        (["run", "ART", "-p", "x", "-o", "OUT.png"], "--control-guidance-end", "inf", ", e.g. 1 (the default)"),
        (["export-triton", "ART", "OUT"], "--queue-timeout-s", "nan", " (x>=0), e.g. 60 (the default)"),
        (["serve", "ART"], "--max-queue-delay-ms", "inf", " (x>=0), e.g. 10 (the default)"),
    ],
)
def test_float_options_refuse_nan_and_inf(tiny_pipeline_dir: Path, tiny_artifact: Path, tmp_path: Path,
                                          args: list[str], option: str, value: str, fix: str) -> None:
    """click's float takes nan and inf, and NaN passes every FloatRange bound: `compile --min-cosine nan` wrote an
    artifact whose manifest is not JSON (exit 3), --cache-max-gb nan ended in a traceback. One error line, exit 2."""
    where = {"MODEL": str(tiny_pipeline_dir), "ART": str(tiny_artifact), "OUT": str(tmp_path / "out")}
    code, out = _invoke(*[where.get(a, a.replace("OUT", where["OUT"])) for a in args], option, value)
    assert code == 2, out
    assert out.splitlines()[0] == (f"error: Invalid value for '{option}': '{value}' is not a finite number; use a "
                                   f"finite one{fix}"), out
    assert "Traceback" not in out and not list(tmp_path.iterdir())


def test_click_usage_error_in_a_real_process() -> None:
    exe = Path(sys.executable).parent / "diffusion-trt"
    proc = subprocess.run([str(exe), "run", "nowhere"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["error: Missing option '-p' / '--prompt'.", "try 'diffusion-trt run --help'"]
    bare = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)  # no command: the help, as before
    assert "Commands:" in bare.stdout + bare.stderr


def test_run_refuses_to_overwrite_pngs_without_overwrite(tiny_artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "img.png"
    out.write_bytes(b"precious")
    args = ["run", tiny_artifact, "-p", "x", "--steps", "1", "-o", out]
    code, text = _invoke(*args)
    assert code == 2
    assert text.strip() == f"error: {out} already exists; pass --overwrite to replace it, or choose another -o"
    assert out.read_bytes() == b"precious"
    # several images: -1, -2 ... count too (img-3.png is no output of a batch of 3, img-01.png none of any)
    out.unlink()
    for name in ("img-1.png", "img-2.png", "img-3.png", "img-01.png"):
        (tmp_path / name).write_bytes(b"precious")
    code, text = _invoke(*args, "--batch-size", "3")
    assert code == 2 and text.strip() == (f"error: {tmp_path / 'img-1.png'} and 1 more of the 3 PNGs this run writes "
                                          "already exist; pass --overwrite to replace them, or choose another -o")
    assert not out.exists() and (tmp_path / "img-2.png").read_bytes() == b"precious"
    code, text = _invoke(*args, "--batch-size", "3", "--overwrite")
    assert code == 0, text
    assert read_png_parameters(tmp_path / "img-2.png")["index"] == 2
    assert (tmp_path / "img-3.png").read_bytes() == b"precious"
    code, text = _invoke(*args, "--batch-size", "1")  # img.png exists now
    assert code == 2 and "already exists; pass --overwrite" in text


def test_run_overwrite_refuses_a_folder_among_its_pngs_before_the_run(tiny_artifact: Path, tmp_path: Path) -> None:
    """A folder img-1.png where --batch-size 2 writes: refused up front (the run denoised, wrote img.png, then failed
    on the temporary file it made: ".img-1.png.XXXX.tmp: Is a directory")."""
    (tmp_path / "img-1.png").mkdir()
    code, text = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1", "--batch-size", "2", "-o",
                         tmp_path / "img.png", "--overwrite")
    assert code == 2, text
    assert text.splitlines() == [f"error: {tmp_path / 'img-1.png'} is a folder, where this run writes a PNG; "
                                 "--overwrite replaces files only: move the folder or choose another -o"], text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img-1.png"]


def test_run_missing_artifact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Named before the default -o out.png is checked: an out.png in the folder is not the problem to report."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out.png").write_bytes(b"")
    code, out = _invoke("run", tmp_path / "none", "-p", "x")
    assert code == 3 and "does not exist; run `diffusion-trt compile` first" in out


def test_run_artifact_missing_a_file(tiny_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default -o out.png: not the current folder's (the README's first command's)
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    (art / "vae_decoder" / "model.onnx").unlink()
    code, out = _invoke("run", art, "-p", "x")
    assert code == 3
    assert "vae_decoder/model.onnx: file is missing; copy the whole artifact folder or recompile" in out


def test_run_artifact_sha256_mismatch(tiny_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default -o out.png: not the current folder's (the README's first command's)
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    path = art / "unet" / "model.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out = _invoke("run", art, "-p", "x")
    assert code == 3
    assert re.search(r"unet/model\.onnx: sha256 \w+… != \w+… in the manifest; the file was altered", out), out


def test_compile_missing_model_folder(tmp_path: Path) -> None:
    code, out = _invoke("compile", tmp_path / "nope", "-o", tmp_path / "art")
    assert code == 2 and "does not exist; pass a folder written by StableDiffusionPipeline.save_pretrained" in out


def test_compile_incomplete_model_folder(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_pipeline_dir, broken)
    (broken / "scheduler" / "scheduler_config.json").unlink()
    code, out = _invoke("compile", broken, "-o", tmp_path / "art")
    assert code == 2 and "scheduler/scheduler_config.json is missing; re-save the whole pipeline" in out
    assert not (tmp_path / "art").exists()


def test_compile_truncated_weights_file_names_it(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """A half-copied weights file: one line naming it and the sizes (was: "could not load unet/ ...: Unable to load
    weights from checkpoint file ...", no fix)."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_pipeline_dir, broken)
    weights = broken / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, out = _invoke("compile", broken, "-o", tmp_path / "art", "--no-cache")
    assert code == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {weights} is truncated: its header places tensor data up to byte "
                      f"{2 * weights.stat().st_size:,}, but the file has {weights.stat().st_size:,} bytes; "
                      "re-download or re-save it"], out
    assert not (tmp_path / "art").exists()


def test_compile_weights_file_whose_header_does_not_match_its_data(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """A tensor's dtype F32 -> F16 in unet/'s header: "could not load unet/ ...: Unable to load weights ...", no cause,
    no fix."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_pipeline_dir, broken)
    weights = broken / "unet" / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    size = int.from_bytes(data[:8], "little")
    weights.write_bytes(data[:8] + data[8:8 + size].replace(b'"F32"', b'"F16"', 1) + data[8 + size:])
    code, out = _invoke("compile", broken, "-o", tmp_path / "art", "--no-cache")
    assert code == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith(
        "(SafetensorError: Error while deserializing header: invalid shape, data type, or offset for tensor); the "
        "file is damaged: re-download or re-save the pipeline"), out
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("flag", ["--cache-dir", "--dump-passes"])
def test_compile_refuses_a_folder_of_its_own_inside_the_model_folder(tiny_pipeline_dir: Path, tmp_path: Path,
                                                                     flag: str) -> None:
    """A cache (or pass dump) inside the model folder became part of its weights hash: every identical recompile
    missed the cache (which grew inside the model) and verify --source said the weights differ."""
    model = tmp_path / "model"
    shutil.copytree(tiny_pipeline_dir, model)
    inside = model / "sub"
    code, out = _invoke("compile", model, "-o", tmp_path / "art", flag, inside)
    assert code == 2, out
    what = "cache folder" if flag == "--cache-dir" else "dump folder"
    assert out.splitlines()[0] == (f"error: Invalid value for {flag}: the {what} {inside} lies inside the model "
                                   f"folder {model}, whose files are hashed as the model's weights; choose a folder "
                                   "outside it"), out
    assert not inside.exists() and not (tmp_path / "art").exists()


def test_compile_height_not_multiple_of_8(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "art", "--height", "700")
    assert code == 2
    assert "error: compile failed at model check: --height 700 is not a positive multiple of 8; use 696 or 704" in out
    assert not (tmp_path / "art").exists()


def test_compile_pickle_refused(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_pipeline_dir, pickled)
    st = pickled / "vae" / "diffusion_pytorch_model.safetensors"
    st.rename(st.with_suffix(".bin"))  # a pickle file by name is enough: the check refuses before loading
    code, out = _invoke("compile", pickled, "-o", tmp_path / "art")
    assert code == 2 and "is a pickle file and loading it runs arbitrary code" in out and "--trust-pickle" in out


def test_dummy_pipeline_bad_arch(tmp_path: Path) -> None:
    code, out = _invoke("dummy-pipeline", "--arch", "sdxxl", tmp_path / "m")
    assert code == 2 and "'sdxxl' is not one of 'tiny', 'sd15'" in out


def test_dummy_pipeline_refuses_non_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x").write_text("mine")
    code, out = _invoke("dummy-pipeline", tmp_path / "m")
    assert code == 2 and "exists and is not empty; choose another folder or pass --overwrite" in out


@pytest.mark.parametrize(("command", "marker", "what"), [("dummy-pipeline", "model_index.json", "diffusers pipeline"),
                                                        ("dummy-controlnet", "config.json", "ControlNet")])
def test_dummy_overwrite_refuses_a_folder_it_did_not_write(tiny_artifact: Path, tmp_path: Path, command: str,
                                                           marker: str, what: str) -> None:
    """`dummy-pipeline --overwrite ART` wrote a pipeline into the artifact (exit 0): a folder half artifact, half
    model. --overwrite now replaces only a folder of the writer's own kind, and deletes nothing else."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    before = sorted(p.relative_to(art) for p in art.rglob("*"))
    code, out = _invoke(command, "--overwrite", art)
    assert code == 2, out
    assert out.splitlines()[0] == (f"error: {art} is not empty and holds no {marker}: --overwrite only replaces a "
                                   f"{what} folder; choose an empty or new folder (nothing was deleted)"), out
    assert sorted(p.relative_to(art) for p in art.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no temporary folder left beside it


def test_dummy_controlnet_overwrite_refuses_a_models_unet(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """`dummy-controlnet MODEL/unet --overwrite`: a UNet folder has a config.json too, and was replaced by a random
    ControlNet (exit 0): the model's UNet weights were gone."""
    model = tmp_path / "model"
    shutil.copytree(tiny_pipeline_dir, model)
    weights = (model / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    code, out = _invoke("dummy-controlnet", "--overwrite", model / "unet")
    assert code == 2, out
    assert out.splitlines() == [f"error: {model / 'unet'} holds a UNet2DConditionModel (config.json _class_name), not "
                                "a ControlNetModel: --overwrite only replaces a ControlNet folder; choose an empty or "
                                "new folder (nothing was deleted)"], out
    assert (model / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == weights
    assert _invoke("dummy-controlnet", tmp_path / "cn")[0] == 0
    assert _invoke("dummy-controlnet", "--overwrite", tmp_path / "cn")[0] == 0  # its own kind: replaced


def test_dummy_lora_refuses_an_out_inside_the_model_folder(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """OUT the model's own UNet weights, with --overwrite: replaced by the LoRA (exit 0)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_pipeline_dir, model)
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    before = weights.read_bytes()
    code, out = _invoke("dummy-lora", model, weights, "--overwrite")
    assert code == 2, out
    assert out.splitlines()[0] == (f"error: Invalid value for OUT: the output file {weights} lies inside the model "
                                   f"folder {model}, whose files are hashed as the model's weights; choose a folder "
                                   "outside it"), out
    assert weights.read_bytes() == before


def test_dummy_lora_writes_whole_files_with_the_umask_mode(tiny_pipeline_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors' save_file wrote OUT in place with mode 0600: an interrupted write left a truncated LoRA where the
    old one was, and a LoRA for `serve --lora-dir` run by another user could not be read."""
    import os

    from safetensors import safe_open

    import diffusion_trt.artifact.folder as folder

    out = tmp_path / "l.safetensors"
    out.write_bytes(b"the old LoRA")
    real = os.replace

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(folder.os, "replace", interrupted)
    code, _ = _invoke("dummy-lora", tiny_pipeline_dir, out, "--overwrite")
    assert code == 130 and out.read_bytes() == b"the old LoRA" and sorted(p.name for p in tmp_path.iterdir()) == [
        "l.safetensors"]
    monkeypatch.setattr(folder.os, "replace", real)
    code, text = _invoke("dummy-lora", tiny_pipeline_dir, out, "--overwrite")
    assert code == 0, text
    assert out.stat().st_mode & 0o777 == folder.umask_mode("file")
    with safe_open(str(out), framework="pt") as f:
        assert len(list(f.keys())) > 0


def test_dummy_lora_in_a_missing_folder_is_refused(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """`dummy-lora MODEL typo/x.safetensors` made the mistyped folder (exit 0), where `run -o` refuses it."""
    code, out = _invoke("dummy-lora", tiny_pipeline_dir, tmp_path / "typo" / "x.safetensors")
    assert code == 2, out
    assert out.splitlines()[0] == (f"error: Invalid value for OUT: the folder {tmp_path / 'typo'} does not exist; "
                                   f"create it first (mkdir -p {tmp_path / 'typo'}) or choose another path"), out
    assert not (tmp_path / "typo").exists()


def test_dummy_pipeline_overwrite_replaces_the_folder_whole(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    """`dummy-pipeline --overwrite` of a tiny-sdxl folder with tiny kept text_encoder_2/ and tokenizer_2/ of the old
    pipeline beside the new one's files: the folder is now replaced whole."""
    model = tmp_path / "m"
    shutil.copytree(tiny_sdxl_dir, model)
    code, out = _invoke("dummy-pipeline", "--overwrite", model)
    assert code == 0, out
    assert sorted(p.name for p in model.iterdir()) == ["model_index.json", "scheduler", "text_encoder", "tokenizer",
                                                       "unet", "vae"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.parametrize("backend", ["tensorrt", "tensorrt-rtx"], ids=["full-trt", "rtx"])
def test_compile_tensorrt_needs_cuda_device(tiny_pipeline_dir: Path, tmp_path: Path, backend: str) -> None:
    """--device defaults to cuda for the TensorRT backends; an explicit cpu is refused."""
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "art", "--backend", backend, "--device", "cpu")
    assert code == 2
    assert f"error: --backend {backend} runs on CUDA only, not --device cpu; use --device cuda or --backend ort" in out


def test_compile_tensorrt_fails_before_export_without_gpu_or_tensorrt(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the preflight passes its first check")
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "art", "--backend", "tensorrt", "--device",
                        "cuda")
    assert code == 1 and "compile failed at TensorRT preflight" in out and "use --backend ort" in out
    assert not (tmp_path / "art").exists()


def test_overwrite_refuses_a_folder_that_is_no_artifact(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "thesis.txt").write_text("precious")
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", precious, "--overwrite")
    assert code == 2 and "holds no manifest.json: --overwrite only replaces an artifact" in out
    assert (precious / "thesis.txt").read_text() == "precious"


def test_output_inside_model_folder_is_refused(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_pipeline_dir, model)
    for target in (model, model / "art"):
        code, out = _invoke("compile", model, "-o", target, "--overwrite")
        assert code == 2 and "overlaps the model folder" in out
    assert (model / "model_index.json").is_file()


def test_zero_height_is_refused_not_defaulted(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "art", "--height", "0")
    assert code == 2 and "--height 0 must be a positive multiple of 8; use e.g. 512" in out


def test_file_given_for_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default -o out.png: not the current folder's (the README's first command's)
    f = tmp_path / "README.md"
    f.write_text("x")
    code, out = _invoke("run", f, "-p", "x")
    assert code == 3 and "is a file, not an artifact folder" in out
    code, out = _invoke("compile", f, "-o", tmp_path / "art")
    assert code == 2 and "is a file, not a folder" in out


def test_run_checks_output_path_before_work(tiny_artifact: Path, tmp_path: Path) -> None:
    code, out = _invoke("run", tiny_artifact, "-p", "x", "-o", tmp_path / "x.jpg")
    assert code == 2 and "does not end in .png; use e.g. out.png" in out
    code, out = _invoke("run", tiny_artifact, "-p", "x", "-o", "/proc/nope/x.png")
    assert code == 2 and "the folder /proc/nope does not exist" in out


@pytest.mark.parametrize(("command", "flag", "inside"),
                         [("run", "-o", "x.png"), ("run", "-o", "unet/x.png"), ("bench", "--json", "b.json"),
                          ("bench", "--plot", "vae_decoder/b.png")])
def test_outputs_inside_the_artifact_folder_are_refused(tiny_artifact: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch, command: str, flag: str,
                                                        inside: str) -> None:
    """`run -o ART/x.png` wrote the image into the artifact: a file its sealed manifest does not list, which verify
    then reports. Refused before the load, naming the path and the folder."""
    from diffusion_trt.runtime import EnginePipeline

    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    before = sorted(p.relative_to(art) for p in art.rglob("*"))
    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    rest = ["-p", "x", "--steps", "1"] if command == "run" else ["--steps", "1", "--iters", "1", "--baseline", "none"]
    code, out = _invoke(command, art, *rest, flag, art / inside)
    assert code == 2, out
    assert out.splitlines()[0] == (f"error: Invalid value for {flag}: the output file {art / inside} lies inside the "
                                   f"artifact folder {art}, which is sealed: its manifest lists every file, and "
                                   "verify reports any other; write it outside the artifact folder"), out
    assert sorted(p.relative_to(art) for p in art.rglob("*")) == before


@pytest.mark.parametrize(("args", "flag", "what", "inside"),
                         [(["dummy-lora", "MODEL", "ART/x.safetensors"], "OUT", "output file", "x.safetensors"),
                          (["optimize", "ART/text_encoder/model.onnx", "-o", "ART/text_encoder/opt.onnx"], "--output",
                           "output file", "text_encoder/opt.onnx"),
                          (["optimize", "ART/text_encoder/model.onnx", "-o", "OUT/o.onnx", "--json", "ART/p.json"],
                           "--json", "output file", "p.json"),
                          (["optimize", "ART/text_encoder/model.onnx", "-o", "OUT/o.onnx", "--dump-passes",
                            "ART/unet/dump"], "--dump-passes", "dump folder", "unet/dump"),
                          # run, compile: into an artifact other than the one they read or write
                          (["run", "TINY", "-p", "x", "-o", "ART/x.png"], "-o", "output file", "x.png"),
                          (["compile", "MODEL", "-o", "ART/sub"], "-o", "output folder", "sub")])
def test_files_written_inside_any_artifact_folder_are_refused(tiny_artifact: Path, tiny_pipeline_dir: Path,
                                                              tmp_path: Path, args: list[str], flag: str, what: str,
                                                              inside: str) -> None:
    """`dummy-lora MODEL ART/x.safetensors` and `optimize ART/unet/model.onnx -o ART/unet/opt.onnx` wrote into the
    sealed artifact (exit 0), a file its manifest does not list: verify then failed; so did `run OTHER -o ART/x.png`
    and `compile -o ART/sub`. The artifact is found by its manifest, whichever command writes; refused as `run -o`
    inside the artifact it runs is, and nothing is written."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    before = sorted(p.relative_to(art) for p in art.rglob("*"))
    subs = {"ART": str(art), "MODEL": str(tiny_pipeline_dir), "OUT": str(tmp_path), "TINY": str(tiny_artifact)}
    code, out = _invoke(*(re.sub("^(ART|MODEL|OUT|TINY)", lambda m: subs[m.group(1)], a) for a in args))
    assert code == 2, out
    assert out.splitlines()[0] == (f"error: Invalid value for {flag}: the {what} {art / inside} lies inside the "
                                   f"artifact folder {art}, which is sealed: its manifest lists every file, and "
                                   "verify reports any other; write it outside the artifact folder"), out
    assert sorted(p.relative_to(art) for p in art.rglob("*")) == before
    assert not list(tmp_path.glob("o.onnx*"))


def test_run_output_inside_the_artifact_folder_is_refused_through_a_relative_path(
        tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cd ART && diffusion-trt run . -p x` (the default -o out.png): the message names the folder it resolved to."""
    monkeypatch.chdir(tiny_artifact)
    code, out = _invoke("run", ".", "-p", "x")
    assert code == 2, out
    assert out.splitlines()[0].startswith(f"error: Invalid value for -o: the output file out.png lies inside the "
                                          f"artifact folder . ({tiny_artifact.resolve()}), which is sealed"), out
    assert not (tiny_artifact / "out.png").exists()


def test_run_output_folder_that_takes_no_file_is_refused_before_any_engine_opens(
        tiny_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run -o` checked its folder with os.access, which root passes everywhere (an NFS root_squash mount, /proc):
    the run denoised, then failed to save (`error: /proc/.x.png.402sca3j.tmp: No such file or directory`). The
    folder is now probed with a file made and removed, before the load."""
    import errno
    import os
    import tempfile

    from diffusion_trt.runtime import EnginePipeline

    squashed = tmp_path / "nfs"
    squashed.mkdir()
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args: object, dir: object = None, **kwargs: object) -> tuple[int, str]:
        if dir is not None and Path(str(dir)) == squashed:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1", "-o", squashed / "x.png")
    assert code == 2, out
    assert out.startswith(f"error: Invalid value for -o: the folder {squashed} is not writable (Permission denied); "
                          "no permission; choose a writable location or fix the permissions"), out
    assert list(squashed.iterdir()) == []


def test_run_refuses_an_output_folder_that_does_not_exist(tiny_artifact: Path, tmp_path: Path) -> None:
    """Issue 24, item 14: `run -o /nonexistent/dir/z.png` created the folders silently; diffusers' and PIL's
    image.save raise there, so a mistyped folder is refused (exit 2) naming the first missing folder."""
    out = tmp_path / "nonexistent" / "dir" / "z.png"
    code, text = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1", "-o", out)
    assert code == 2 and text.startswith("error: Invalid value for -o: "), text
    assert (f"the folder {tmp_path / 'nonexistent'} does not exist; create it first (mkdir -p {out.parent}) or "
            "choose another path") in text
    assert not (tmp_path / "nonexistent").exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, text = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1", "-o", blocker / "z.png")
    assert code == 2 and f"cannot create the folder {blocker}" in text


@pytest.mark.parametrize("what", ["serve", "lms", "lora"])
def test_a_missing_optional_package_exits_2(what: str, tiny_artifact: Path, tiny_pipeline_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24, item 14: a missing optional package exited 1 for `serve` but 2 for `lms` and LoRA. One rule: exit 2,
    one line naming the pip install (README's exit-code table)."""
    import sys

    import diffusers

    if what == "serve":
        monkeypatch.setitem(sys.modules, "pytriton", None)  # `import pytriton...` raises ImportError
        monkeypatch.setitem(sys.modules, "pytriton.triton", None)
        code, out = _invoke("serve", tiny_artifact)
        fix = "pip install 'diffusion-trt[serve]'"
    elif what == "lms":
        def no_scipy(*args: object, **kwargs: object) -> None:
            raise ImportError("LMSDiscreteScheduler requires the scipy library but it was not found")

        # diffusers' stand-in class without scipy raises from its constructor (build_scheduler calls it directly)
        monkeypatch.setattr(diffusers.LMSDiscreteScheduler, "__init__", no_scipy)
        code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1", "--scheduler", "lms",
                            "-o", tmp_path / "o.png")
        fix = "pip install 'diffusion-trt[schedulers]'"
    else:  # compile --lora: checked when the LoRAs are merged (a full compile is not needed to see the class)
        import diffusers.utils

        from diffusion_trt.compiler import lora
        from diffusion_trt.errors import MissingPackageError

        monkeypatch.setattr(diffusers.utils, "USE_PEFT_BACKEND", False)
        with pytest.raises(MissingPackageError) as e:
            lora._require_peft()
        assert e.value.exit_code == 2 and "pip install 'diffusion-trt[lora]'" in str(e.value)
        return
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and fix in errors[0], out
    assert "Traceback" not in out


@pytest.mark.parametrize("scheduler", ["dpm++", "dpm++_sde", "unipc", "deis"])
def test_steps_that_collapse_a_multistep_schedule_are_one_error_line(tiny_artifact: Path, tmp_path: Path,
                                                                     scheduler: str) -> None:
    """--steps 1000 ('leading' spacing: 1000 // 1001 = 0 apart) gave these one timestep for every step and a
    traceback (IndexError / AssertionError, exit 1); 999 was refused with "use at most 999"."""
    out = tmp_path / "o.png"
    code, text = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1000", "--scheduler", scheduler, "-o", out)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in text, text
    assert "step 1000 times at the one timestep 1" in errors[0] and errors[0].endswith("use at most 998"), text
    code, text = _invoke("run", tiny_artifact, "-p", "x", "--steps", "999", "--scheduler", scheduler, "-o", out)
    assert code == 2 and "step from timestep 1000" in text and "use at most 998" in text, text
    assert not out.exists()


def test_too_many_steps_for_the_scheduler(tiny_artifact: Path, tmp_path: Path) -> None:
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "5000", "--scheduler", "ddim",
                        "-o", tmp_path / "o.png")
    assert code == 2 and "error: --steps 5000 is more than the 1000 timesteps DDIMScheduler" in out
    assert "use at most 1000" in out
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1000", "-o", tmp_path / "o.png")  # PNDM, offset 1
    assert code == 2 and "step from timestep 1000, past its 1000 training timesteps" in out and "at most 999" in out
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", str(10**9), "-o", tmp_path / "o.png")
    assert code == 2 and "use at most 1000" in out  # refused before set_timesteps allocates anything


def test_an_absurd_step_count_is_refused_before_the_load(tiny_artifact: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`run --steps 100000000000` was refused by the loop's set_schedule, after the engines loaded: the scheduler's
    training timesteps are read from the artifact's scheduler config first (--scheduler's class, or the artifact's)."""
    import json

    from diffusion_trt.runtime import EnginePipeline

    real = EnginePipeline.from_artifacts
    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    for args, message in (
        (["--steps", str(10**11)], f"error: --steps {10**11} is more than the 1000 timesteps PNDMScheduler was "
                                   "trained with; use at most 1000"),
        (["--steps", "5000", "--scheduler", "ddim"], "error: --steps 5000 is more than the 1000 timesteps "
                                                     "DDIMScheduler was trained with; use at most 1000"),
    ):
        code, out = _invoke("run", tiny_artifact, "-p", "x", *args, "-o", tmp_path / "o.png")
        assert code == 2 and out == message + "\n", out
    monkeypatch.setattr(EnginePipeline, "from_artifacts", real)
    altered = tmp_path / "altered"  # a config that is not the manifest's file is not read before the load
    shutil.copytree(tiny_artifact, altered)
    config = altered / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_train_timesteps": 10}))
    code, out = _invoke("run", altered, "-p", "x", "--steps", "30", "-o", tmp_path / "o.png")
    assert code == 3 and "failed verification: scheduler/scheduler_config.json" in out and "timesteps" not in out, out


def test_artifact_files_respect_umask(tiny_artifact: Path) -> None:
    import os

    mask = os.umask(0)
    os.umask(mask)
    assert (tiny_artifact / "manifest.json").stat().st_mode & 0o777 == 0o666 & ~mask
    assert tiny_artifact.stat().st_mode & 0o777 == 0o777 & ~mask


def test_pass_options_parse_as_json_or_text() -> None:
    from diffusion_trt.cli import _parse_pass_options

    assert _parse_pass_options(("pack_qkv=false", "fuse_attention_emit=none", "n=3")) == {
        "pack_qkv": False, "fuse_attention_emit": "none", "n": 3}
    code, out = _invoke("compile", "nowhere", "--pass-option", "pack_qkv")
    assert code == 2 and "is not KEY=VALUE" in out


# -- images, OS errors, options without effect, exit codes -------------------------------------------------------


def test_16_bit_images_are_scaled_not_clipped(tiny_artifact: Path, tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    from diffusion_trt.cli import _read_image

    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    path = tmp_path / "g16.png"
    Image.fromarray(ramp).save(path)
    assert Image.open(path).mode.startswith("I")
    gray = np.asarray(_read_image(path, "--mask", "L")).astype(int)
    assert np.abs(gray - np.round(ramp / 257)).max() <= 1  # a plain convert("L") clips: 254.5 on average
    rgb = np.asarray(_read_image(path, "--image", "RGB"))
    assert rgb.shape == (64, 64, 3) and 120 < rgb.mean() < 135
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "2", "--image", path, "--mask", path,
                        "-o", tmp_path / "o.png")
    assert code == 0, out


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_transparent_images_are_refused(tiny_artifact: Path, tmp_path: Path, mode: str) -> None:
    """--image with alpha is refused (dropping it would change the picture); a --mask with alpha is read as diffusers
    reads it, alpha ignored with a warning (tests/runtime/test_img2img_inpaint.py)."""
    from PIL import Image

    alpha = tmp_path / "alpha.png"
    Image.new(mode, (64, 64)).save(alpha)
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--image", alpha, "-o", tmp_path / "o.png")
    assert code == 2
    assert f"'{alpha}' has transparency (mode {mode})" in out and "flatten it onto a background first" in out
    assert not (tmp_path / "o.png").exists()


def test_output_path_errors_are_one_line(tiny_pipeline_dir: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from diffusion_trt.artifact import folder as artifacts

    a_file = tmp_path / "somefile.txt"
    a_file.write_text("x")
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", a_file / "out")
    assert code == 2 and "Traceback" not in out
    assert f"error: {a_file}: File exists; a file stands where a folder is needed; choose another path" in out

    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "ro"))

    monkeypatch.setattr(artifacts.tempfile, "mkdtemp", denied)  # as for a folder without write permission
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "ro" / "art")
    assert code == 2 and "Traceback" not in out
    assert f"error: {tmp_path / 'ro'}: Permission denied; no permission; choose a writable location" in out



def test_read_only_file_system_is_said_once(tiny_pipeline_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """It read 'Read-only file system; read-only file system; choose another location'."""
    import errno
    import os

    from diffusion_trt.artifact import folder as artifacts

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "ro"))

    monkeypatch.setattr(artifacts.tempfile, "mkdtemp", read_only)
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "ro" / "art")
    assert code == 2
    fix = "choose a location on a writable file system"
    assert out.strip() == f"error: {tmp_path / 'ro'}: Read-only file system; {fix}"


@pytest.mark.parametrize("command", ["run", "dummy-pipeline", "bench"])
def test_seed_beyond_int64_is_refused(tiny_artifact: Path, tmp_path: Path, command: str) -> None:
    target = tmp_path / "m" if command == "dummy-pipeline" else tiny_artifact
    code, out = _invoke(command, target, *(["-p", "x"] if command == "run" else []), "--seed", "99999999999999999999")
    assert code == 2 and "99999999999999999999 is not in the range 0<=x<=9223372036854775807" in out


def test_bench_model_dir_without_model_index(tiny_artifact: Path, tmp_path: Path) -> None:
    code, out = _invoke("bench", tiny_artifact, "--model-dir", tmp_path, "--steps", "1", "--iters", "1")
    assert code == 2 and f"error: --model-dir {tmp_path} has no model_index.json" in out and "--baseline none" in out


def test_bench_model_dir_of_another_architecture(tiny_artifact: Path, tiny_sdxl_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An SDXL or inpainting folder for an SD text-to-image artifact is refused before anything is timed (the diffusers
    baseline crashed with a traceback after ours was measured)."""
    from diffusion_trt.bench import run as bench_run
    from diffusion_trt.compiler.dummy import write_dummy_pipeline

    def no_timing(*args: object, **kwargs: object) -> None:
        raise AssertionError("timing started")

    monkeypatch.setattr(bench_run, "_ours", no_timing)
    source = _source_path(tiny_artifact)
    code, out = _invoke("bench", tiny_artifact, "--model-dir", tiny_sdxl_dir, "--steps", "1", "--iters", "1")
    assert code == 2 and "Traceback" not in out and out.count("\n") == 1, out
    assert out.startswith(f"error: --model-dir {tiny_sdxl_dir} is a StableDiffusionXLPipeline folder (architecture "
                          f"sdxl, UNet in_channels 4); the artifact {tiny_artifact} is a StableDiffusionPipeline "
                          "(architecture sd, UNet in_channels 4): the diffusers baseline cannot run that folder next "
                          f"to it; pass the folder the artifact was compiled from ({source}) or --baseline none")
    inpaint = write_dummy_pipeline(tmp_path / "inpaint", arch="tiny-sd15-inpaint", seed=0)
    code, out = _invoke("bench", tiny_artifact, "--model-dir", inpaint, "--steps", "1", "--iters", "1")
    assert code == 2 and "Traceback" not in out
    assert f"error: --model-dir {inpaint} is a StableDiffusionInpaintPipeline folder (architecture sd, UNet " \
           "in_channels 9); the artifact" in out


def _source_path(artifact: Path) -> str:
    from diffusion_trt.artifact.folder import read_manifest

    return str(read_manifest(artifact)["source"]["path"])


def test_corrupt_model_config_names_the_file(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_pipeline_dir, broken)
    (broken / "vae" / "config.json").write_text("{")
    code, out = _invoke("compile", broken, "-o", tmp_path / "art")
    assert code == 2 and f"{broken / 'vae' / 'config.json'} is not valid JSON" in out and "Traceback" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--height", "100000"], "error: --height 100000 is above the limit of 4096 px; use 4096 or less"),
        (["--max-batch-size", "1000"], "error: --max-batch-size 1000 is above the limit of 64; use 64 or less"),
        (["--opset", "99"], "error: --opset 99 is newer than torch.onnx's exporter writes; use 17..20"),
        (["--max-batch-size", "0"], "error: --max-batch-size 0 must be >= 1"),  # was "... swap them"
        (["--min-batch-size", "0"], "error: --min-batch-size 0 must be >= 1"),
        # the tiny model is 64x64: --max-height defaults to 128, which the user never gave ("swap them" before)
        (["--min-height", "296"], "error: compile failed at model check: --min-height 296 is larger than the default "
                                  "--max-height 128 (2 x height); give --max-height 296 or more, or --min-height "
                                  "128 or less"),
        (["--max-width", "16"], "error: compile failed at model check: --max-width 16 is smaller than the default "
                                "--min-width 32 (width/2); give --min-width 16 or less, or --max-width 32 or more"),
    ],
)
def test_compile_limits_fail_at_once_in_one_line(tiny_pipeline_dir: Path, tmp_path: Path, args: list[str],
                                                 message: str) -> None:
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "art", *args)
    assert code == 2 and out.strip() == message


@pytest.mark.parametrize(("flag", "what", "inside"), [("--cache-dir", "cache folder", "art"),
                                                     ("--cache-dir", "cache folder", "art/cache"),
                                                     ("--dump-passes", "dump folder", "art/dump")])
def test_our_folders_inside_the_artifact_are_refused(tiny_pipeline_dir: Path, tmp_path: Path, flag: str, what: str,
                                                     inside: str) -> None:
    """--cache-dir: it compiled (exit 0) with the cache sealed into the artifact, which verify then failed (exit 3).
    --dump-passes: 'output folder art already exists' (the dump folder made it), or with --overwrite the dumps were
    deleted with the old artifact."""
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "art", flag, tmp_path / inside)
    assert code == 2
    assert (f"Invalid value for {flag}: the {what} {tmp_path / inside} lies inside the artifact folder "
            f"{tmp_path / 'art'}, which is sealed and replaced whole; choose a folder outside it") in out
    assert not (tmp_path / "art").exists()


def test_options_without_effect_warn(tiny_pipeline_dir: Path, tiny_artifact: Path, tmp_path: Path) -> None:
    # compiling onto an existing artifact stops after the checks (exit 2), once every warning was given
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tiny_artifact, "--calibration-size", "4", "--min-psnr",
                        "10", "--timing-cache", tmp_path / "tc", "--fp16-safe-vae")
    assert code == 2 and "already exists; pass --overwrite" in out
    assert "--calibration-size --min-psnr: no effect with --precision fp32" in out
    assert "--timing-cache: no effect with --backend ort" in out
    assert "--fp16-safe-vae: no effect on an SD 1.x/2.x model" in out
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tiny_artifact)
    assert code == 2 and "no effect" not in out
    # TensorRT's run-time LoRAs never reach unet_controlnet: said at compile, not first at the refused ControlNet
    # call; ONNX Runtime's unet_controlnet takes them (tests/runtime/test_controlnet_parity.py), so no warning there
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tiny_artifact, "--refittable", "--controlnet",
                        f"a={tmp_path / 'cn'}", "--backend", "tensorrt")
    # exit 1 without a GPU (TensorRT's preflight), 2 with one (the artifact exists): the warning came before either
    assert code in (1, 2) and "warning: --refittable with --controlnet: on --backend tensorrt run-time LoRAs " \
        "reach unet and the text encoders, not unet_controlnet" in out, out
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tiny_artifact, "--refittable", "--controlnet",
                        f"a={tmp_path / 'cn'}")
    assert code == 2 and "--refittable with --controlnet" not in out, out
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tiny_artifact, "--refittable")
    assert code == 2 and "--refittable with --controlnet" not in out
    code, out = _invoke("run", tiny_artifact, "-p", "x", "-n", "blurry", "--guidance", "1", "--steps", "1",
                        "-o", tmp_path / "o.png")
    assert code == 0 and "--negative-prompt: no effect with --guidance 1" in out
    code, out = _invoke("run", tiny_artifact, "-p", "x", "-n", "blurry", "--steps", "1", "-o", tmp_path / "o.png",
                        "--overwrite")
    assert code == 0 and "no effect" not in out


def test_exit_codes_are_documented() -> None:
    from diffusion_trt import errors

    code, out = _invoke("--help")
    assert code == 0
    documented = {int(m) for m in re.findall(r"^\s+(\d+)\s{2}", out.split("Exit codes:")[1], re.M)}
    assert documented == {0, 1, 2, 3, 4, 130, 143}  # 143: SIGTERM, handled like Ctrl-C
    readme = (REPO / "README.md").read_text()
    assert documented == {int(m) for m in re.findall(r"^\| (\d+) \|", readme, re.M)}
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.DiffusionTrtError)]
    assert {c.exit_code for c in classes} <= documented
    assert errors.OutputPathError.exit_code == errors.ModelFolderError.exit_code == 2  # "exists": one code


def test_bad_pass_option_fails_before_export(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "a", "--pass-option", "pack_qkv=no")
    assert code == 2 and "pass option pack_qkv='no' (pack_qkv): expects true or false" in out
    assert not (tmp_path / "a").exists()


def test_ctrl_c_exits_130(tiny_pipeline_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusion_trt.compiler.pipeline as pipeline

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "compile_pipeline", interrupted)
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "a")
    assert code == 130 and "interrupted" in out


def test_dump_passes_folder_checked_before_export(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "a", "--dump-passes", blocker / "dump")
    assert code == 2 and "--dump-passes" in out and "cannot create the folder" in out
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    ("options", "size"),
    [
        ({"height": 136, "width": 96, "min_height": 136, "max_height": 136, "min_width": 96, "max_width": 96},
         (136, 96)),
        ({"height": 128}, (128, 64)),
    ],
    ids=["static-136x96", "height-128"],
)
def test_default_size_is_the_artifact_opt_size(tiny_pipeline_dir: Path, tmp_path: Path, options: dict[str, int],
                                               size: tuple[int, int]) -> None:
    """No --height/--width: the profile's opt size (as --help says), not the model's 64x64 (issue 14, item 9)."""
    from PIL import Image

    from diffusion_trt.compiler.pipeline import compile_pipeline
    from diffusion_trt.config import CompileConfig
    from diffusion_trt.runtime import EnginePipeline

    art = compile_pipeline(tiny_pipeline_dir, tmp_path / "art", CompileConfig(**options))
    code, out = _invoke("run", art, "-p", "x", "--steps", "1", "-o", tmp_path / "o.png")
    assert code == 0, out
    assert Image.open(tmp_path / "o.png").size == (size[1], size[0])  # PIL: (width, height)
    with EnginePipeline.from_artifacts(art) as pipe:
        image = pipe("x", num_inference_steps=1, seed=0, progress=False, output_type="np").images
    assert image.shape == (1, *size, 3)


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG file whose header claims ``width`` x ``height`` (8-bit RGB) but holds one byte of image data: what Pillow
    reads lazily from a decompression bomb before anything is decoded."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0"))
                     + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("flag", ["--image", "--mask"])
@pytest.mark.parametrize("size", [100_000, 12_000])
def test_oversized_images_are_refused_before_decoding(tiny_artifact: Path, tmp_path: Path, flag: str, size: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A header claiming 100000x100000 (Pillow's DecompressionBombError) or 12000x12000 (1.4 GB decoded): exit 2, one
    line naming the file and the fix, and no pixel decoded (issue 14, item 8)."""
    from PIL import Image, ImageFile

    load = ImageFile.ImageFile.load

    def no_decoding(self: ImageFile.ImageFile) -> object:
        assert self.size != (size, size), "the image was decoded before its size was checked"
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    bomb = _png_header(tmp_path / "bomb.png", size, size)
    good = tmp_path / "good.png"
    Image.new("RGB", (64, 64)).save(good)
    args = ["--image", bomb] if flag == "--image" else ["--image", good, "--mask", bomb]
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "x", *map(str, args),
                                       "-o", str(tmp_path / "o.png")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert str(bomb) in result.output and ("resize it into the profile" in result.output
                                           or "decompression bomb" in result.output), result.output
    assert lines[-2].startswith(f"error: Invalid value for {flag}: ") and lines[-1].startswith("try '")
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize("option", ["-p", "-n"])
def test_non_utf8_prompt_is_one_line_exit_2(tiny_artifact: Path, tmp_path: Path, option: str) -> None:
    """``-p $'\\xff\\xfe'``: Python hands the bytes on as lone surrogates; the tokenizer raised a TypeError (item 8)."""
    args = ["-p", "\udcff\udcfe"] if option == "-p" else ["-p", "x", "-n", "ok \udcff"]
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), *args, "--steps", "1", "-o", str(tmp_path / "o.png")])
    assert result.exit_code == 2, (result.output, result.exception)
    name = "prompt" if option == "-p" else "negative_prompt"
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"error: {name} is not valid UTF-8 text: the bytes b'\\xff"), result.output
    assert "pass the prompt as UTF-8" in result.output and "Traceback" not in result.output


def test_non_utf8_prompt_in_a_real_process(tiny_artifact: Path, tmp_path: Path) -> None:
    """The same with real argv bytes (os.fsdecode's surrogateescape), stderr holds one line."""
    exe = Path(sys.executable).parent / "diffusion-trt"
    proc = subprocess.run([str(exe), "run", str(tiny_artifact), b"-p", b"\xff\xfe", "-o", str(tmp_path / "o.png")],
                          capture_output=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.decode(errors="replace").strip().splitlines() == [
        "error: prompt is not valid UTF-8 text: the bytes b'\\xff\\xfe' at character 0; pass the prompt as UTF-8 "
        "(e.g. re-encode it with iconv -t UTF-8)"
    ]


def test_a_sigterm_where_python_would_swallow_the_exception_is_raised_again_a_moment_later() -> None:
    """The fresh-clone suite once saw SIGTERM land in the import machinery's module-lock callback, where Python
    ignores exceptions ("Exception ignored in: <function _get_module_lock.<locals>.cb>"): the compile then ran on
    and exited 0 instead of 143. There the handler defers: a SIGALRM raises Terminated once outside it."""
    import signal
    import types

    from diffusion_trt.cli import Terminated, _sigterm_handler, _terminate_like_interrupt

    def frame(filename: str, name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(f_code=types.SimpleNamespace(co_filename=filename, co_name=name))

    with _terminate_like_interrupt():
        _sigterm_handler(signal.SIGTERM, frame("<frozen importlib._bootstrap>", "cb"))  # no raise: deferred
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0 and signal.getsignal(signal.SIGALRM) is _sigterm_handler
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second SIGTERM kills at once
        signal.setitimer(signal.ITIMER_REAL, 0)
        with pytest.raises(Terminated, match="signal 15"):
            _sigterm_handler(signal.SIGALRM, frame(__file__, "compile"))
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0 and signal.getsignal(signal.SIGALRM) is not _sigterm_handler


def test_sigma_schedulers_run_1000_steps_as_diffusers_does(tiny_artifact: Path, tmp_path: Path) -> None:
    """At 1000 steps SD-1.5's config ('leading', steps_offset=1) starts at timestep 1000. PNDM / DDIM / DDPM index
    past their tables there (refused above), but Euler, Euler a, Heun and DPM2 read their sigmas by interpolation,
    which holds the last one: diffusers runs them, and they were refused ("use at most 999"). LMS stays refused: its
    first two sigmas are then equal and its multistep coefficients divide by their gap (diffusers gives NaN)."""
    import diffusers

    from diffusion_trt.runtime.denoise import set_schedule
    from diffusion_trt.runtime.schedulers import SCHEDULERS

    config = json.loads((tiny_artifact / "scheduler" / "scheduler_config.json").read_text())
    for name in ("euler", "euler_a", "heun", "dpm2"):
        cls, extra = SCHEDULERS[name]
        ours, theirs = (getattr(diffusers, cls).from_config({**config, **extra}) for _ in range(2))
        theirs.set_timesteps(1000)
        assert torch.equal(set_schedule(ours, 1000, torch.device("cpu")), theirs.timesteps), name
        assert float(theirs.timesteps.max()) == 1000
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1000", "--scheduler", "euler",
                        "-o", tmp_path / "o.png")
    assert code == 0 and (tmp_path / "o.png").exists(), out
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--steps", "1000", "--scheduler", "lms",
                        "-o", tmp_path / "l.png")
    assert code == 2 and "zero gap between its first two sigmas" in out and "at most 999" in out, out


@pytest.mark.parametrize("command", ["run", "compile"])
def test_lora_scale_with_an_underscore_is_not_a_scale(command: str, tiny_artifact: Path, tiny_pipeline_dir: Path,
                                                      tmp_path: Path) -> None:
    """`--lora F:1_0` was read as scale 10 (float() takes Python's digit grouping)."""
    source, rest = {"run": (tiny_artifact, ["-p", "x", "-o", tmp_path / "o.png"]),
                    "compile": (tiny_pipeline_dir, ["-o", tmp_path / "art"])}[command]
    code, out = _invoke(command, source, *rest, "--lora", "style.safetensors:1_0")
    assert code == 2 and out == ("error: --lora 'style.safetensors:1_0': '1_0' is not a scale; use FILE or "
                                 "FILE:SCALE with a finite number, e.g. style.safetensors:0.8\n"), out


@pytest.mark.parametrize("command", ["run", "compile"])
def test_lora_scale_beyond_float32_is_refused_at_once(command: str, tiny_artifact: Path, tiny_pipeline_dir: Path,
                                                      tmp_path: Path) -> None:
    """`run --lora F:1e39` on an artifact without --refittable suggested `compile --lora F:1e+39`, which compile then
    refused (NaN/Inf in the merged weights)."""
    source, rest = {"run": (tiny_artifact, ["-p", "x", "-o", tmp_path / "o.png"]),
                    "compile": (tiny_pipeline_dir, ["-o", tmp_path / "art"])}[command]
    code, out = _invoke(command, source, *rest, "--lora", "style.safetensors:-1e39")
    assert code == 2 and out == ("error: --lora 'style.safetensors:-1e39': scale -1e+39 is beyond float32 (at most "
                                 "3.403e+38); use a scale such as style.safetensors:0.8\n"), out


@pytest.mark.parametrize(("command", "flag", "value"), [("run", "--width", "-8"), ("compile", "--min-height", "0")])
def test_snap_refuses_a_size_below_one(command: str, flag: str, value: str, tiny_artifact: Path,
                                       tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """`run --snap --width -8` snapped to the profile's 32 and ran (compile --snap: to 8, and compiled)."""
    source, rest = {"run": (tiny_artifact, ["-p", "x", "-o", tmp_path / "o.png"]),
                    "compile": (tiny_pipeline_dir, ["-o", tmp_path / "art"])}[command]
    code, out = _invoke(command, source, *rest, "--snap", flag, value)
    example = 32 if command == "run" else 512
    assert code == 2 and out == (f"error: {flag} {value} must be positive (--snap rounds a size to a multiple of 8, "
                                 f"it does not replace one below 1); use e.g. {example}\n"), out
    assert not (tmp_path / "o.png").exists() and not (tmp_path / "art").exists()


def test_image_size_not_a_multiple_of_8_names_the_option(tiny_artifact: Path, tmp_path: Path) -> None:
    """The message said 'image width 60' (the Python argument, as prose), not `--image`."""
    from PIL import Image

    Image.new("RGB", (60, 64), "red").save(tmp_path / "in.png")
    code, out = _invoke("run", tiny_artifact, "-p", "x", "--image", tmp_path / "in.png", "-o", tmp_path / "o.png")
    assert code == 2 and out == ("error: --image width 60 is not a multiple of 8 (the VAE downsamples by 8); resize "
                                 "or crop the image to 56 or 64 (engine profile allows 32..128)\n"), out
