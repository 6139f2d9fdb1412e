"""`run` / `bench` engine options of issue 19: --sizes (first call per size, repeatability), --size-buckets,
--deterministic, --cudnn-algo-search; bad input exits 2 naming the value and the fix. On the toy artifact."""

from __future__ import annotations

from pathlib import Path

import pytest

# --- the command line: bench --sizes (first call per size, repeatability), bad input --------------------------------


def test_bench_sizes_first_calls_and_repeatability(toy_artifact: Path, tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from diffusion_trt.bench import validate_result
    from diffusion_trt.cli import main

    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, [
        "bench", str(toy_artifact), "--baseline", "none", "--steps", "2", "--iters", "1", "--warmup", "0",
        "--stage-iters", "1", "--sizes", "64x64,48x80", "--size-buckets", "auto", "--deterministic",
        "--cudnn-algo-search", "heuristic", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    validate_result(data)
    assert data["config"]["sizes"] == [[64, 64], [48, 80]] and data["config"]["deterministic"] is True
    assert data["config"]["cudnn_conv_algo_search"] == "HEURISTIC" and data["config"]["size_buckets"] == "auto"
    ours = [(r["height"], r["width"]) for r in data["runs"] if r["system"] == "ours"]
    assert ours == [(64, 64), (48, 80)]
    assert [(f["height"], f["width"]) for f in data["first_calls"]] == ours
    assert all(f["first_call_s"] > 0 and f["overhead_s"] is not None for f in data["first_calls"])
    for f in data["first_calls"]:  # the calls right after the first, and every one's time over warm, summed
        assert len(f["next_calls_s"]) == 2 and all(t > 0 for t in f["next_calls_s"])
        want = f["first_call_s"] + sum(f["next_calls_s"]) - 3 * f["warm_e2e_s"]
        assert f["overhead_total_s"] == pytest.approx(want)
    assert "next calls " in result.output and "overhead of all " in result.output
    for f in data["first_calls"]:  # deterministic: synchronous buckets, so each size's UNet session is made in its call
        unet = f["bucket_parts"]["unet"]
        assert unet["dynamic_runs"] == 0 and len(unet["session_s"]) == 1
        assert list(unet["first_static_run_s"]) == list(unet["session_s"])
    assert "unet: sessions opened: B2=2, h=" in result.output
    assert [q["identical"] for q in data["repeatability"]] == [True, True]
    assert data["load_s"] > 0 and "first call per size" in result.output
    assert any("size-bucket sessions" in n for n in data["notes"])


@pytest.mark.parametrize(
    ("args", "piece"),
    [
        (["--cudnn-algo-search", "FASTEST"], "'FASTEST' is not one of 'AUTO', 'EXHAUSTIVE', 'HEURISTIC', 'DEFAULT'"),
        (["--size-buckets", "512"], "--size-buckets: '512' in '512' is not HEIGHTxWIDTH with positive sides; "
                                    "use e.g. --size-buckets 512x512"),
        (["--sizes", "64x64,64"], "--sizes: '64' in '64x64,64' is not HEIGHTxWIDTH with positive sides; "
                                  "use e.g. --sizes 512x512"),
        # typed empty by mistake (an unset shell variable): refused, not taken for "off"
        (["--size-buckets", ""], "error: --size-buckets '' is empty; give 'auto', sizes HxW[,HxW...] such as "
                                 "512x512,768x768, or 'off' for no buckets"),
        (["--size-buckets", "  "], "is empty; give 'auto'"),
    ],
)
def test_bad_engine_options_exit_2(toy_artifact: Path, args: list[str], piece: str) -> None:
    from click.testing import CliRunner

    from diffusion_trt.cli import main

    for command in (["bench", str(toy_artifact), "--baseline", "none"], ["run", str(toy_artifact), "-p", "x"]):
        if args[0] == "--sizes" and command[0] == "run":
            continue  # --sizes is bench's
        result = CliRunner().invoke(main, [*command, *args])
        assert result.exit_code == 2, result.output
        assert piece.lower() in " ".join(result.output.split()).lower(), result.output


def test_run_with_engine_options(toy_artifact: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from diffusion_trt.cli import main

    out = tmp_path / "x.png"
    result = CliRunner().invoke(main, ["run", str(toy_artifact), "-p", "a cat", "--steps", "2", "--size-buckets",
                                       "64x64", "--deterministic", "--cudnn-algo-search", "DEFAULT", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file()


def test_size_buckets_off_is_documented_and_runs(toy_artifact: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from diffusion_trt.cli import main

    for command in ("run", "bench"):
        help_text = " ".join(CliRunner().invoke(main, [command, "--help"]).output.split())
        assert "--size-buckets auto|HxW[,HxW...]|off" in help_text
        assert "off: none (the default; an empty value is refused)" in help_text
    out = tmp_path / "x.png"
    result = CliRunner().invoke(main, ["run", str(toy_artifact), "-p", "a cat", "--steps", "2", "--size-buckets",
                                       "off", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file()
