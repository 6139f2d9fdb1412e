"""The image-size half of the alignment policy: config.snap_image_size and ``--snap`` on compile / run."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from diffusion_trt.cli import main
from diffusion_trt.config import IMAGE_ALIGNMENT, check_image_size, snap_image_size


@pytest.mark.parametrize(("value", "lo", "hi", "want"), [
    (512, None, None, 512), (700, None, None, 696), (701, None, None, 704), (3, None, None, 8),
    (0, None, None, 8), (1100, 256, 1024, 1024), (100, 256, 1024, 256), (61, 32, 128, 64),
])
def test_snap_image_size(value: int, lo: int | None, hi: int | None, want: int) -> None:
    got = snap_image_size(value, lo, hi)
    assert got == want and got % IMAGE_ALIGNMENT == 0
    check_image_size("height", got, lo, hi)  # a snapped size always passes the check


def test_run_snaps_to_the_profile_and_logs(tiny_artifact: Path, tmp_path: Path) -> None:
    """61 is no multiple of 8 and 250 is above the tiny artifact's 32..128: both snap; without --snap, both fail."""
    args = ["run", str(tiny_artifact), "-p", "x", "--steps", "1", "--height", "61", "--width", "250",
            "-o", str(tmp_path / "o.png")]
    result = CliRunner().invoke(main, [*args, "--snap"])
    assert result.exit_code == 0, result.output
    assert "--snap: height 61 -> 64 (multiples of 8, profile 32..128)" in result.output
    assert "--snap: width 250 -> 128" in result.output
    assert (tmp_path / "o.png").exists()
    result = CliRunner().invoke(main, [*args, "--overwrite"])  # o.png exists: without --overwrite run stops there
    assert result.exit_code != 0 and "--height 61 is not a positive multiple of 8" in result.output, result.output


def test_snap_logs_the_change(caplog: pytest.LogCaptureFixture) -> None:
    from diffusion_trt.cli import _snap

    with caplog.at_level(logging.WARNING, logger="diffusion_trt"):
        assert _snap("min_height", 700) == 696 and _snap("height", 64) == 64 and _snap("width", None) is None
    assert [r.getMessage() for r in caplog.records] == ["--snap: min-height 700 -> 696 (multiples of 8)"]


def test_compile_snap_reaches_the_config(tiny_pipeline_dir: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """compile --snap hands snapped sizes to CompileConfig (compile_pipeline itself is stubbed: fast)."""
    seen: dict[str, object] = {}

    def fake_compile(model_dir: Path, out_dir: Path, config: object, **kwargs: object) -> Path:
        seen["config"] = config
        raise SystemExit(0)

    monkeypatch.setattr("diffusion_trt.compiler.pipeline.compile_pipeline", fake_compile)
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"), "--snap",
                                       "--height", "70", "--width", "60", "--max-height", "130"])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.height, config.width, config.max_height) == (72, 56, 128)  # type: ignore[attr-defined]
