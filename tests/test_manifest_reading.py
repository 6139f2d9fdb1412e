"""Issue 24 item 4: one manifest reader with one size cap for every command, no traceback for any JSON a manifest
can hold, and nothing from an artifact reaches the terminal unescaped.

Every case is a copy of the tiny artifact with its manifest changed (resealed where the change allows): ``verify``,
``inspect`` and ``run`` must each exit 3 with one ``error:`` line (verify: ``problem:`` lines) and no traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.artifact.reader import ArtifactReader
from diffusion_trt.artifact.values import printable
from diffusion_trt.cli import main
from diffusion_trt.errors import ArtifactError


def _cli(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def _run_cmd(art: Path, tmp: Path) -> Result:
    return _cli("run", art, "--prompt", "x", "--steps", "1", "-o", tmp / "x.png")


def _fails_with_one_line(result: Result, pattern: str) -> None:
    assert result.exit_code == 3, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith(("error:", "problem:"))]
    assert (lines and all(line.startswith("problem:") for line in lines)) or len(lines) == 1, result.output
    assert pattern in result.output, result.output


@pytest.fixture
def art(tiny_artifact: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "art"
    shutil.copytree(tiny_artifact, dest)
    return dest


def _manifest(root: Path) -> dict[str, Any]:
    return json.loads((root / "manifest.json").read_text())


def _all_commands(art: Path, tmp: Path, pattern: str) -> None:
    for result in (_cli("verify", art), _cli("inspect", art), _cli("inspect", art, "--json"), _run_cmd(art, tmp)):
        _fails_with_one_line(result, pattern)
    with pytest.raises(ArtifactError, match=re.escape(pattern)):
        ArtifactReader.open(art)


def test_a_lone_surrogate_escape_in_a_key_is_one_error_line(art: Path, tmp_path: Path) -> None:
    text = (art / "manifest.json").read_text()
    (art / "manifest.json").write_text('{"\\ud800": 1, ' + text.lstrip()[1:])
    _all_commands(art, tmp_path, r"holds a lone surrogate escape ('\ud800')")


def test_a_manifest_over_the_cap_is_refused_unread_by_every_command(art: Path, tmp_path: Path) -> None:
    path = art / "manifest.json"
    with path.open("r+b") as f:  # sparse: the cap is checked on the size, before a byte is read
        f.truncate(artifacts.MAX_MANIFEST_BYTES + 1)
    _all_commands(art, tmp_path, f"more than {artifacts.MAX_MANIFEST_BYTES}")


def test_a_fifo_in_place_of_the_manifest_does_not_hang(art: Path, tmp_path: Path) -> None:
    (art / "manifest.json").unlink()
    os.mkfifo(art / "manifest.json")
    for result in (_cli("verify", art), _cli("inspect", art)):
        _fails_with_one_line(result, "manifest.json")


def test_a_nul_in_an_unknown_key_is_refused(art: Path, tmp_path: Path) -> None:
    manifest = _manifest(art)
    manifest["note\0hidden"] = "x"
    artifacts.write_manifest(art, manifest)
    _all_commands(art, tmp_path, r"has a key with a NUL character ('note\x00hidden')")


ESCAPES = "\x1b]0;pwned\x07\x1b[2J\r\x1b[32mok\x1b[0m\u202e"


def test_inspect_and_verify_print_terminal_escapes_escaped(art: Path) -> None:
    manifest = _manifest(art)
    manifest["note"] = ESCAPES
    manifest[f"key{ESCAPES}"] = 1
    artifacts.write_manifest(art, manifest)
    result = _cli("inspect", art)
    assert result.exit_code == 0, result.output
    assert printable(ESCAPES) in result.output
    assert not any(c in result.output for c in "\x1b\x07\r\u202e"), ascii(result.output)
    manifest["files"][f"tokenizer/{ESCAPES}"] = {"sha256": "0" * 64, "size": 1}
    artifacts.write_manifest(art, manifest)
    for result in (_cli("verify", art), _run_cmd(art, art.parent)):  # the file is missing: exit 3, naming it
        assert result.exit_code == 3, result.output
        assert f"tokenizer/{printable(ESCAPES)}" in result.output, result.output
        assert not any(c in result.output for c in "\x1b\x07\r\u202e"), ascii(result.output)


def test_printable_escapes_controls_and_keeps_our_newlines() -> None:
    assert printable("a\x1b[2Jb\nc\x9b\u200bd") == "a\\x1b[2Jb\\nc\\x9b\\u200bd"
    assert printable("one\n  two\x07", newlines=True) == "one\n  two\\x07"
    assert printable("plain é 😀 text") == "plain é 😀 text"
