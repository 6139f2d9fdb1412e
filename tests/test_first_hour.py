"""What a user hits in the first hour (issue 15, item 5): the top-level EnginePipeline, every scheduler name in the
help, warnings with their prefix, the negative prompt named when truncated, quiet library output in the CLI."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from diffusion_trt.cli import main
from diffusion_trt.runtime.schedulers import scheduler_names


def test_engine_pipeline_at_the_top_level_lazily() -> None:
    code = ("import sys, diffusion_trt; assert 'diffusion_trt.runtime.pipeline' not in sys.modules; "
            "from diffusion_trt import EnginePipeline; from diffusion_trt.runtime import EnginePipeline as E; "
            "assert EnginePipeline is E; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
    import diffusion_trt

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        diffusion_trt.Nope  # noqa: B018


@pytest.mark.parametrize("command", ["run", "bench", "serve"])
def test_scheduler_help_lists_every_name(command: str) -> None:
    out = " ".join(CliRunner().invoke(main, [command, "--help"]).output.split())
    assert all(f" {name}," in out or f" {name} (" in out for name in scheduler_names()), out


def test_lms_scheduler_builds_with_scipy(tiny_artifact: Path) -> None:
    import json

    from diffusion_trt.runtime.schedulers import make_scheduler

    config = json.loads((tiny_artifact / "scheduler" / "scheduler_config.json").read_text())
    assert type(make_scheduler(config, "lms")).__name__ == "LMSDiscreteScheduler"


def test_negative_prompt_truncation_is_named(caplog: pytest.LogCaptureFixture, tiny_pipeline_dir: Path) -> None:
    import torch
    from transformers import CLIPTokenizer

    from diffusion_trt.runtime.text_embeddings import tokenize

    tok = CLIPTokenizer.from_pretrained(tiny_pipeline_dir / "tokenizer", local_files_only=True)
    long = "word " * 100
    with caplog.at_level(logging.WARNING, logger="diffusion_trt"):
        tokenize(tok, ["short", long], torch.device("cpu"), negatives={long})
    assert [r.getMessage().split(" to ")[0] for r in caplog.records] == ["negative prompt truncated"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffusion_trt"):
        tokenize(tok, [long], torch.device("cpu"))
    assert caplog.records[0].getMessage().startswith("prompt truncated to 77 of its 102 CLIP tokens")


def test_cli_output_has_no_library_chatter_nor_progress_bars(tmp_path: Path) -> None:
    """Non-TTY output (a pipe): our lines only, warnings prefixed, no carriage-return progress bars."""
    exe = str(Path(sys.executable).parent / "diffusion-trt")
    out = subprocess.run([exe, "dummy-pipeline", "--arch", "tiny", str(tmp_path / "m")], capture_output=True,
                         text=True, check=True)
    text = out.stdout + out.stderr
    assert "torchvision" not in text and "[transformers]" not in text and "\r" not in text and "shards" not in text
    assert out.stderr.splitlines() == [f"wrote tiny pipeline (seed 0, UNet 827,476 parameters) to {tmp_path / 'm'}"]
    assert out.stdout.splitlines() == [str(tmp_path / "m")]


def test_warnings_carry_the_prefix(tiny_pipeline_dir: Path, tiny_artifact: Path) -> None:
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tiny_artifact), "--min-psnr",
                                       "10"])
    assert result.exit_code == 2
    assert "warning: --min-psnr: no effect with --precision fp32" in result.output
