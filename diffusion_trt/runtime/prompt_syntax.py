"""The A1111 prompt dialect: attention weights and ``BREAK``, parsed into weighted text segments.

:func:`parse_prompt` turns ``"a (red:1.3) fox BREAK [blurry] sky"`` into parts (split at ``BREAK``) of
``(text, weight)`` segments. The semantics are those AUTOMATIC1111's stable-diffusion-webui documents
("Attention/emphasis" in its wiki), re-implemented here:

* ``(text)`` multiplies the weight of ``text`` by 1.1, ``[text]`` divides it by 1.1; nesting multiplies
  (``((text))`` = 1.1 ** 2 = 1.21);
* ``(text:1.3)`` sets the factor of that round bracket to 1.3 instead of 1.1 (``[text:1.3]`` is plain text:
  only round brackets take a number, as in A1111);
* ``\\(`` ``\\)`` ``\\[`` ``\\]`` ``\\\\`` are the literal characters;
* ``BREAK`` (upper case, a word of its own) ends the current 75-token chunk (see :mod:`.prompt_encoding`);
* a weight written like a number that is none (``(fox:1,3)`` with a decimal comma, ``(fox:1.2.3)``, ``(fox:1e-1)``
  in exponent notation, which A1111 does not read) is no weight either: the bracket keeps its default factor 1.1
  and ``:1,3`` stays text, as in A1111, with a warning;
* a bracket without its partner is kept as literal text, and reported in :attr:`ParsedPrompt.warnings` (A1111
  instead weights the rest of the prompt by an unclosed bracket); never an exception;
* a weight that is not a finite number (``(fox:nan)``, ``(fox:inf)``, a number too large for a float32, the weights'
  dtype: ``(fox:1e39)`` written out in digits) is no weight:
  the bracket keeps its default factor 1.1 and ``:nan`` stays text, with a warning. That is what A1111 does with
  ``nan``/``inf`` (its weight pattern takes digits and dots only), so a prompt copied from it encodes the same; a
  NaN or Inf factor would turn the whole prompt's embeddings to NaN (a black or noise image), never what was meant;
* a token whose factors multiply beyond ``±``:data:`MAX_WEIGHT` (100: ``((x:100))`` = 110, ``(((x:10):10):10)`` =
  1000, fifty ``(( ))`` levels = 117) is found by :func:`overweight`, and the request refuses it
  (:func:`~.request.check_prompt_weights`) before any engine runs. A1111 caps nothing, but products grow
  geometrically: twenty nested ``(x:100)`` are 1e40, inf as the float32 weight, a NaN (black) image. Why 100: it is
  two orders above the weights prompts use (the A1111 wiki's examples are 0.25..1.5, its editor steps by 0.1; a token
  weighted by tens already drowns the rest of its chunk), and it keeps a weighted chunk that is not rescaled
  (:mod:`.prompt_encoding`) inside fp16, the UNet engines' dtype: SD's final-layer-normed text states are bounded by
  sqrt(D - 1) |gamma| + |beta| (about 28 |gamma| for CLIP-L, D = 768), and 100 times that stays below fp16's 65504
  for layer-norm gains under ~23. Not covered by that bound: SDXL's states (not layer-normed) and a rescale that
  grows the chunk; a weight under the limit that still overflows gets the loop's NaN warning.

Syntax ``"plain"`` reads the whole prompt as one segment of weight 1.0 (no brackets, no ``BREAK``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .float_range import finite_in_float32

#: The factor of one ``( )`` level; ``[ ]`` divides by it.
ATTENTION = 1.1
#: The largest weight magnitude a token may get, its brackets' factors multiplied (why 100: the module docstring).
MAX_WEIGHT = 100.0
SYNTAXES: tuple[str, ...] = ("a1111", "plain")

_TOKEN = re.compile(
    r"\\[\\()\[\]]"                              # an escaped bracket or backslash
    r"|\(|\[|\]"                                 # an opening bracket, or a closing square one
    r"|:\s*([+-]?(?:\d+\.?\d*|\.\d+))\s*\)"      # ':1.3)': closes a round bracket with its own factor
    r"|:\s*((?i:[+-]?(?:nan|inf(?:inity)?)))\s*\)"  # ':nan)', ':inf)': closes one with a non-finite "factor"
    r"|:\s*([+-]?[\d.,]*\d[\d.,]*(?:[eE][+-]?\d+)?)\s*\)"  # ':1,3)', ':1.2.3)', ':1e-1)': a misspelt number
    r"|\)"                                       # a closing round bracket
    r"|\bBREAK\b"                                # a chunk break
    r"|[^\\()\[\]:B]+|."                         # text (one character at a time where it could start a token)
)


@dataclass(frozen=True)
class Segment:
    """A run of text and its attention weight (1.0 = unweighted)."""

    text: str
    weight: float = 1.0


@dataclass(frozen=True)
class ParsedPrompt:
    """A parsed prompt.

    Attributes:
        parts: the prompt split at ``BREAK``: each part a tuple of segments (adjacent equal weights merged, empty
            text dropped); at least one part, which may be empty.
        warnings: one line per bracket kept as text because it had no partner, and per non-finite weight read
            as the default 1.1, naming it and its position.
    """

    parts: tuple[tuple[Segment, ...], ...]
    warnings: tuple[str, ...] = ()

    @property
    def weighted(self) -> bool:
        """Any segment has a weight other than 1.0."""
        return any(s.weight != 1.0 for part in self.parts for s in part)


def overweight(parsed: ParsedPrompt) -> Segment | None:
    """The first segment of ``parsed`` whose weight is beyond ``±``:data:`MAX_WEIGHT` (or NaN: ``(a:0)`` inside
    factors whose product overflowed to inf), or ``None``."""
    return next((s for part in parsed.parts for s in part if not abs(s.weight) <= MAX_WEIGHT), None)


def overweight_problem(name: str, segment: Segment) -> str:
    """The message for ``segment``, a token of argument ``name`` weighted beyond ``±``:data:`MAX_WEIGHT`
    (:func:`overweight`): its text, its weight, why, and the fix."""
    word = segment.text.strip()
    word = word if len(word) <= 40 else word[:37] + "..."
    return (
        f"{name} gives {word!r} the weight {segment.weight:.4g}, beyond ±{MAX_WEIGHT:g} (nested brackets multiply: "
        "((x:100)) is 110, each ( ) 1.1): text states weighted that far drown the rest of the prompt and can "
        f"overflow fp16 engines (a black image); use weights within ±{MAX_WEIGHT:g}, e.g. (x:1.5)"
    )


def parse_prompt(text: str, syntax: str = "a1111", name: str = "prompt") -> ParsedPrompt:
    """Parse ``text`` in ``syntax`` ("a1111" or "plain", see the module docstring); ``name`` (the argument the text
    came from: "prompt", "negative prompt") begins each warning.

    Raises:
        ValueError: an unknown ``syntax`` (a programming error: the request checks it first).
    """
    if syntax not in SYNTAXES:
        raise ValueError(f"syntax={syntax!r}; use one of {', '.join(SYNTAXES)}")
    if syntax == "plain":
        return ParsedPrompt(((Segment(text),),) if text else ((),))
    # items: [text, weight] lists, or None for a BREAK; open brackets are items too until closed
    items: list[list | None] = []
    stack: list[tuple[str, int, int]] = []  # (bracket, index of its item, position in text)
    warnings: list[str] = []
    for m in _TOKEN.finditer(text):
        tok = m.group(0)
        if len(tok) == 2 and tok.startswith("\\"):
            items.append([tok[1], 1.0])
        elif tok in "([":
            stack.append((tok, len(items), m.start()))
            items.append([tok, 1.0])
        elif tok == "]" or tok == ")" or any(m.group(g) is not None for g in (1, 2, 3)):
            want = "[" if tok == "]" else "("
            if stack and stack[-1][0] == want:
                factor, literal = _closing_factor(m, want, warnings)
                if literal:
                    items.append([literal, 1.0])
                _, at, _ = stack.pop()
                items[at] = ["", 1.0]
                for item in items[at + 1:]:
                    if item is not None:
                        item[1] *= factor
            else:
                warnings.append(f"{tok.strip()!r} at character {m.start()} closes no bracket; kept as text")
                items.append([tok, 1.0])
        elif tok == "BREAK":
            items.append(None)
        else:
            items.append([tok, 1.0])
    for bracket, _, pos in stack:
        warnings.append(f"{bracket!r} at character {pos} is never closed; kept as text")
    return ParsedPrompt(_parts(items), tuple(f"{name}: {line}" for line in warnings))


def _closing_factor(m: re.Match[str], want: str, warnings: list[str]) -> tuple[float, str]:
    """The factor a closing bracket token ``m`` applies, and the text it leaves behind ("" unless its weight is not
    a finite number: then the factor is :data:`ATTENTION`, ``:WEIGHT`` stays text and a warning is appended)."""
    if want == "[":
        return 1 / ATTENTION, ""
    weight = m.group(1) or m.group(2) or m.group(3)
    if weight is None:
        return ATTENTION, ""
    shown = weight if len(weight) <= 24 else weight[:20] + "..."
    if m.group(3) is not None:
        fix = "write it in digits, e.g. 0.1: A1111 reads no exponent" if "e" in weight.lower() else \
            "write a decimal point, e.g. 1.3"
        warnings.append(f"weight {shown!r} at character {m.start()} is not a number ({fix}); the bracket "
                        f"keeps its default factor {ATTENTION} and ':{shown}' stays text")
        return ATTENTION, m.group(0)[:-1]
    factor = float(weight)
    if finite_in_float32(factor):  # the token weights are float32 (:mod:`.prompt_encoding`)
        return factor, ""
    warnings.append(f"weight {shown!r} at character {m.start()} is not a finite number; the bracket keeps "
                    f"its default factor {ATTENTION} and ':{shown}' stays text")
    return ATTENTION, m.group(0)[:-1]


def _parts(items: list[list | None]) -> tuple[tuple[Segment, ...], ...]:
    """Items split at BREAK (None), adjacent equal weights merged, empty text dropped."""
    parts: list[tuple[Segment, ...]] = []
    current: list[Segment] = []
    for item in [*items, None]:
        if item is None:
            parts.append(tuple(current))
            current = []
        elif item[0]:
            if current and current[-1].weight == item[1]:
                current[-1] = Segment(current[-1].text + item[0], item[1])
            else:
                current.append(Segment(item[0], item[1]))
    return tuple(parts)
