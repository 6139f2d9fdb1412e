"""The A1111 prompt parser (runtime/prompt_syntax.py): a table of cases, each with its expected parts and warnings."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from diffusion_trt.cli import main
from diffusion_trt.runtime.prompt_syntax import ATTENTION, MAX_WEIGHT, Segment, overweight, parse_prompt

A = ATTENTION
#: (prompt, expected parts as lists of (text, weight), number of warnings)
CASES = [
    ("a fox", [[("a fox", 1.0)]], 0),
    ("", [[]], 0),
    ("(fox)", [[("fox", A)]], 0),
    ("((fox))", [[("fox", A * A)]], 0),
    ("[fox]", [[("fox", 1 / A)]], 0),
    ("[[fox]]", [[("fox", 1 / A / A)]], 0),
    ("a (red:1.3) fox", [[("a ", 1.0), ("red", 1.3), (" fox", 1.0)]], 0),
    ("(red: 0.5 )", [[("red", 0.5)]], 0),
    ("(red:.5)", [[("red", 0.5)]], 0),
    ("((red:1.5) fox)", [[("red", 1.5 * A), (" fox", A)]], 0),
    ("([fox])", [[("fox", A / A)]], 0),
    ("[fox:1.3]", [[("fox:1.3", 1 / A)]], 0),  # only round brackets take a number
    ("(a:b)", [[("a:b", A)]], 0),
    ("12:30 (x)", [[("12:30 ", 1.0), ("x", A)]], 0),
    (r"\(fox\)", [[("(fox)", 1.0)]], 0),
    (r"(\(fox\))", [[("(fox)", A)]], 0),
    (r"a \\ b", [[("a \\ b", 1.0)]], 0),
    ("a BREAK b", [[("a ", 1.0)], [(" b", 1.0)]], 0),
    ("(a BREAK b)", [[("a ", A)], [(" b", A)]], 0),
    ("aBREAK BREAKING Break", [[("aBREAK BREAKING Break", 1.0)]], 0),
    ("BREAK", [[], []], 0),
    ("Blue (sky)", [[("Blue ", 1.0), ("sky", A)]], 0),
    # unbalanced: kept as text, one warning each, never an exception
    ("(fox", [[("(fox", 1.0)]], 1),
    ("fox)", [[("fox)", 1.0)]], 1),
    ("fox:1.2)", [[("fox:1.2)", 1.0)]], 1),
    ("((fox)", [[("(", 1.0), ("fox", A)]], 1),
    ("(fox]", [[("(fox]", 1.0)]], 2),
    ("[(fox])", [[("[", 1.0), ("fox]", A)]], 2),
    ("[fox)", [[("[fox)", 1.0)]], 2),
    ("(", [[("(", 1.0)]], 1),
    ("\\", [[("\\", 1.0)]], 0),
    # a weight that is not a finite number: the default factor, ':WEIGHT' kept as text (as A1111), one warning
    ("(a:nan)", [[("a:nan", A)]], 1),
    ("(a:inf)", [[("a:inf", A)]], 1),
    ("(a: -Infinity )", [[("a: -Infinity ", A)]], 1),
    ("((a:NaN) b)", [[("a:NaN", A * A), (" b", A)]], 1),
    ("(a:" + "9" * 400 + ")", [[("a:" + "9" * 400, A)]], 1),  # float() overflows to inf
    ("(a:1" + "0" * 39 + ")", [[("a:1" + "0" * 39, A)]], 1),  # finite as a float, inf as the float32 weight
    ("a:nan)", [[("a:nan)", 1.0)]], 1),  # closes nothing: the usual warning only
    # a misspelt number (a decimal comma, two points): the same, with a warning (it was silently 1.1 before)
    ("(a:1,3)", [[("a:1,3", A)]], 1),
    ("(a: 1.2.3 ) (b:2)", [[("a: 1.2.3 ", A), (" ", 1.0), ("b", 2.0)]], 1),
    ("(a, 1, 2)", [[("a, 1, 2", A)]], 0),  # no colon: text in a bracket, as ever
    ("(a:1e-1) (b:2E+1)", [[("a:1e-1", A), (" ", 1.0), ("b:2E+1", A)]], 2),  # an exponent: A1111 reads none
]


def test_a_misspelt_weight_warns_naming_it() -> None:
    assert parse_prompt("x (a:1,3)").warnings == (
        "prompt: weight '1,3' at character 4 is not a number (write a decimal point, e.g. 1.3); the bracket keeps "
        "its default factor 1.1 and ':1,3' stays text",)


def test_a_weight_with_an_exponent_warns_naming_the_fix() -> None:
    """``(a:1e-1)`` was silently 'a:1e-1' at 1.1 (A1111's reading, which takes no exponent): the 0.1 meant was lost
    without a word, where ``(a:1,3)`` warns."""
    assert parse_prompt("(a:1e-1)").warnings == (
        "prompt: weight '1e-1' at character 2 is not a number (write it in digits, e.g. 0.1: A1111 reads no "
        "exponent); the bracket keeps its default factor 1.1 and ':1e-1' stays text",)


@pytest.mark.parametrize(("prompt", "expected", "n_warnings"), CASES)
def test_parse_prompt_table(prompt: str, expected: list[list[tuple[str, float]]], n_warnings: int) -> None:
    parsed = parse_prompt(prompt)
    assert [[(s.text, pytest.approx(s.weight)) for s in part] for part in parsed.parts] == expected
    assert len(parsed.warnings) == n_warnings, parsed.warnings


def test_warning_names_the_bracket_and_position() -> None:
    parsed = parse_prompt("a (fox")
    assert parsed.warnings == ("prompt: '(' at character 2 is never closed; kept as text",)
    assert "')' at character 3 closes no bracket" in parse_prompt("fox) x").warnings[0]


def test_plain_syntax_reads_everything_as_text() -> None:
    parsed = parse_prompt("a (red:1.3) BREAK fox", syntax="plain")
    assert parsed.parts == ((Segment("a (red:1.3) BREAK fox"),),)
    assert not parsed.weighted and parse_prompt("(x)").weighted


def test_unknown_syntax_is_refused() -> None:
    with pytest.raises(ValueError, match="syntax='compel'"):
        parse_prompt("x", syntax="compel")


@pytest.mark.parametrize("prompt", ["(a:nan)", "(a:inf)", "(a:-inf)", "(a:" + "9" * 400 + ")", "(a:1" + "0" * 39 + ")"])
def test_a_non_finite_weight_warns_and_no_weight_is_non_finite(prompt: str) -> None:
    parsed = parse_prompt(prompt)
    assert all(math.isfinite(s.weight) for part in parsed.parts for s in part)
    (line,) = parsed.warnings
    assert line.startswith("prompt: weight '") and "at character 2 is not a finite number" in line
    assert "keeps its default factor 1.1" in line


def test_a_non_finite_weight_is_one_warning_line_of_run(tiny_artifact: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "(a:nan) fox", "--steps", "1",
                                       "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("warning:")]
    assert lines == ["warning: prompt: weight 'nan' at character 2 is not a finite number; the bracket keeps its "
                     "default factor 1.1 and ':nan' stays text"], result.output
    assert (tmp_path / "x.png").is_file()


def test_a_weight_beyond_float32_is_one_warning_and_a_finite_image(tiny_artifact: Path, tmp_path: Path) -> None:
    """``(a:1000...0)`` (1e39: finite in Python, inf as the float32 token weight) gave a black image and only the
    NaN/Inf warning; now it is read as no weight, with the non-finite weight's warning."""
    weight = "1" + "0" * 39
    out = tmp_path / "x.png"
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", f"(a:{weight}) fox", "--steps", "1",
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("warning:")]
    assert len(lines) == 1 and "at character 2 is not a finite number" in lines[0], result.output
    pixels = np.asarray(Image.open(out))
    assert pixels.std() > 0  # not the black image of NaN latents


@pytest.mark.parametrize(("prompt", "heavy"), [
    ("a (fox:100) cat", None),  # the limit itself
    ("(" * 48 + "fox" + ")" * 48, None),  # 1.1 ** 48 = 97.0
    ("(" * 49 + "fox" + ")" * 49, Segment("fox", A ** 49)),  # 106.7
    ("((fox:100))", Segment("fox", 110.0)),
    ("a (fox:-101)", Segment("fox", -101.0)),
    ("(((x:10):10):10) y", Segment("x", 1000.0)),
    ("[[[(fox:1000)]]]", Segment("fox", 1000 / A ** 3)),  # 751: square brackets divide
    ("((a:1000000) b:1000000)", Segment("a", 1e12)),  # the first of the two (no exponents: digits and dots)
])
def test_overweight_finds_the_first_token_beyond_the_limit(prompt: str, heavy: Segment | None) -> None:
    found = overweight(parse_prompt(prompt))
    if heavy is None:
        assert found is None
    else:
        assert found is not None and found.text == heavy.text and found.weight == pytest.approx(heavy.weight)
    assert overweight(parse_prompt(prompt, "plain")) is None  # plain: brackets are text
    assert MAX_WEIGHT == 100.0


def test_run_refuses_an_overweight_prompt_before_the_load(tiny_artifact: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Nested weights multiplying far beyond any use (((x:100):100) = 1e4) were encoded as given: a silently black
    image where they overflowed fp16. One error line naming the text, the token and its weight, exit 2, nothing
    loaded; --prompt-syntax plain reads the brackets as text."""
    from diffusion_trt.runtime import EnginePipeline

    real = EnginePipeline.from_artifacts
    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    tail = ("beyond ±100 (nested brackets multiply: ((x:100)) is 110, each ( ) 1.1): text states weighted that far "
            "drown the rest of the prompt and can overflow fp16 engines (a black image); use weights within ±100, "
            "e.g. (x:1.5), or --prompt-syntax plain to read brackets as text")
    for args, message in (
        (["-p", "a ((fox:100):100) cat"], f"error: prompt gives 'fox' the weight 1e+04, {tail}"),
        (["-p", "a fox", "-n", "(" * 60 + "blurry" + ")" * 60], f"error: --negative-prompt gives 'blurry' the weight "
                                                                 f"{A ** 60:.4g}, {tail}"),
    ):
        result = CliRunner().invoke(main, ["run", str(tiny_artifact), *args, "--steps", "1",
                                           "-o", str(tmp_path / "x.png")])
        assert result.exit_code == 2 and result.output == message + "\n", result.output
    monkeypatch.setattr(EnginePipeline, "from_artifacts", real)
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "a ((fox:100):100) cat", "--prompt-syntax",
                                       "plain", "--steps", "1", "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 0 and (tmp_path / "x.png").is_file(), result.output


@pytest.mark.parametrize("artifact", ["tiny_artifact", "tiny_sdxl_artifact"])
def test_parse_warnings_name_the_text_once(artifact: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """``run -p "(a" -n "b)"``: the negative prompt's warning began 'prompt:' (the user looked for a ')' at character 1
    of the prompt), and on SDXL every warning came twice (each text is read once per text encoder)."""
    result = CliRunner().invoke(main, ["run", str(request.getfixturevalue(artifact)), "-p", "(a", "-n", "b)",
                                       "--steps", "1", "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 0, result.output
    lines = sorted(ln for ln in result.output.splitlines() if ln.startswith("warning:"))
    assert lines == ["warning: negative prompt: ')' at character 1 closes no bracket; kept as text",
                     "warning: prompt: '(' at character 0 is never closed; kept as text"], result.output
