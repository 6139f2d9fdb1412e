"""The A1111 prompt parser (runtime/prompt_syntax.py): a table of cases, each with its expected parts and warnings."""

from __future__ import annotations

import pytest

from diffusion_trt.runtime.prompt_syntax import ATTENTION, Segment, parse_prompt

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
]


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
