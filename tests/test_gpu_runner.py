"""benchmarks/gpu_run.sh, the one GPU runner: every GPU script is one of its named phases, each phase's command
names a script that exists, wrong phases are refused before anything runs. The GPU work itself is not run here
(``DRY=1`` prints the commands)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "benchmarks" / "gpu_run.sh"
#: the helpers every script sources, and the runner itself: not phases
NOT_PHASES = {"gpu_lib.sh", "gpu_run.sh"}


def _run(*args: str, dry: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DRY": "1" if dry else "0"}
    return subprocess.run(["bash", str(RUNNER), *args], capture_output=True, text=True, check=False, env=env,
                          cwd="/")


def _phases() -> list[str]:
    listing = _run("--list")
    assert listing.returncode == 0, listing.stderr
    return [line.split()[0] for line in listing.stdout.splitlines()]


def _example(phase: str) -> str:
    """The phase with arguments where it needs them."""
    return {"vram": "vram:build:sd15", "cold-start": "cold-start:cold"}.get(phase, phase)


def test_every_gpu_script_is_a_phase_and_every_phase_a_script(tmp_path: Path) -> None:
    phases = _phases()
    result = _run(str(tmp_path / "out"), *map(_example, phases))
    assert result.returncode == 0, result.stderr
    commands = result.stdout.splitlines()
    assert len(commands) == len(phases)
    scripts = {w.removeprefix("benchmarks/") for c in commands for w in c.split() if w.startswith("benchmarks/")}
    assert all((REPO / "benchmarks" / s).is_file() for s in scripts), sorted(scripts)
    on_disk = {p.name for p in (REPO / "benchmarks").glob("gpu_*.sh")} - NOT_PHASES
    assert on_disk == scripts
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_no_script_is_named_after_a_session() -> None:
    assert not [p.name for p in (REPO / "benchmarks").iterdir() if "session" in p.name]


def test_phase_arguments_reach_the_script(tmp_path: Path) -> None:
    result = _run(str(tmp_path), "vram:measure:sdxl:8GB:facts,unbounded", "cold-start:compile-b1", "throughput")
    assert result.stdout.splitlines() == [
        f"env OUT={tmp_path}/vram bash benchmarks/gpu_vram.sh measure sdxl 8GB facts,unbounded",
        f"bash benchmarks/gpu_cold_start.sh compile-b1 {tmp_path}/cold-start",
        f"env PHASE=A bash benchmarks/gpu_throughput_budget.sh {tmp_path}/throughput",
    ]


@pytest.mark.parametrize(("phases", "message"), [
    (["runtime", "bogus"], "error: unknown phase 'bogus' in 'bogus'; use one of: tests passes"),
    (["vram"], "error: phase 'vram' needs arguments"),
    (["sdxl:fast"], "error: phase 'sdxl' takes no arguments; got 'sdxl:fast'"),
    ([], "error: usage: bash benchmarks/gpu_run.sh OUT PHASE [PHASE ...]"),
])
def test_wrong_phases_are_refused_before_anything_runs(tmp_path: Path, phases: list[str], message: str) -> None:
    result = _run(str(tmp_path / "out"), *phases, dry=False)
    assert result.returncode == 2
    assert result.stderr.startswith(message) and len(result.stderr.splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists() and result.stdout == ""


def test_a_failed_phase_is_recorded_and_the_next_still_runs(tmp_path: Path) -> None:
    """gpu_cold_start.sh refuses a phase it does not know (exit 2): the runner records it, runs on, exits 1."""
    result = _run(str(tmp_path), "cold-start:no-such-step", "cold-start:also-not", dry=False)
    assert result.returncode == 1
    records = [json.loads(line) for line in (tmp_path / "phases.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["rc"]) for r in records] == [("cold-start:no-such-step", 2), ("cold-start:also-not", 2)]
    assert "no-such-step" in (tmp_path / "cold-start_no-such-step.log").read_text()
