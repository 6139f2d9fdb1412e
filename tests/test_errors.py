"""errors.py: names_arguments records which arguments a message spells ``name=value`` (the Python API's names), so
that the CLI can write them as its options (tests/test_cli.py: test_messages_name_the_options_the_user_typed)."""

from __future__ import annotations

import pytest

from diffusion_trt.config import CompileConfig
from diffusion_trt.errors import RuntimeInputError, names_arguments, names_parameters


def test_names_arguments_records_the_names_and_the_outermost_call_wins() -> None:
    with pytest.raises(RuntimeInputError) as e, names_arguments("outer"), names_arguments("inner"):
        raise RuntimeInputError("inner=1 is wrong")
    assert e.value.arguments == frozenset({"outer"}) and str(e.value) == "inner=1 is wrong"  # the message as it was

    @names_parameters
    def call(height: int, *args: object, width: int = 0, **kwargs: object) -> None:
        raise RuntimeInputError(f"height={height} is wrong")

    with pytest.raises(RuntimeInputError) as e:
        call(70)
    assert e.value.arguments == frozenset({"height", "width"})
    with pytest.raises(ValueError, match="not ours"), names_arguments("x"):
        raise ValueError("not ours")  # only our errors are touched


def test_config_errors_name_the_fields_for_the_python_api() -> None:
    with pytest.raises(RuntimeInputError) as e:
        CompileConfig(refit_convs=True)
    assert str(e.value).startswith("refit_convs=True needs refittable=True: ") and "--" not in str(e.value)
    assert {"refit_convs", "refittable", "backend"} <= e.value.arguments
    with pytest.raises(RuntimeInputError) as e:
        CompileConfig(min_height=128, max_height=64).resolve_profile(512)
    assert str(e.value) == "min_height=128 is larger than max_height=64; swap them"
    assert "min_height" in e.value.arguments
