"""lower_einsum: batched-matmul Einsums (guided-diffusion attention) -> MatMul (+ Transpose)."""

from __future__ import annotations

import pytest

from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes.lower_einsum import lower_einsum
from tests import graphs
from tests.passes.fusion_helpers import fuse


def test_fires_on_the_einsum_attention_and_keeps_outputs() -> None:
    model = graphs.einsum_attention_model()
    out, counts = fuse(model, lower_einsum)
    assert counts == {"MatMul": 2, "Transpose": 2, "rejected": 0}
    assert "Einsum" not in graphs.op_counts(out)
    graphs.assert_same_outputs(model, out)


@pytest.mark.parametrize(("equation", "shapes", "out_shape", "transposes"), [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)], (2, 3, 5), 0),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)], (2, 2, 3, 5), 1),
    ("bjk,bij->bik", [(2, 4, 5), (2, 3, 4)], (2, 3, 5), 0),
    ("bij,bjk->bki", [(2, 3, 4), (2, 4, 5)], (2, 5, 3), 2),
])
def test_equations_in_any_letter_order(equation: str, shapes: list, out_shape: tuple, transposes: int) -> None:
    model = graphs.einsum_model(equation, shapes, out_shape)
    out, counts = fuse(model, lower_einsum)
    assert counts["MatMul"] == 1 and counts["Transpose"] == transposes
    graphs.assert_same_outputs(model, out)


@pytest.mark.parametrize(("equation", "shapes", "out_shape", "why"), [
    ("bii->bi", [(2, 3, 3)], (2, 3), "operands"),
    ("bij,bjk,bkl->bil", [(2, 3, 4), (2, 4, 5), (2, 5, 6)], (2, 3, 6), "operands"),
    ("bij,bij->bij", [(2, 3, 4), (2, 3, 4)], (2, 3, 4), "not a batched matrix product"),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)], (2, 3, 5), "ellipsis"),
    ("ibj,bjk->bik", [(3, 2, 4), (2, 4, 5)], (2, 3, 5), "do not lead"),
])
def test_must_not_fire(equation: str, shapes: list, out_shape: tuple, why: str) -> None:
    model = graphs.einsum_model(equation, shapes, out_shape)
    ctx = PassContext(component="unet", backend="ort", device="cpu", precision="fp32")
    out, records = optimize_model(model, [lower_einsum], ctx)
    assert records[0].counts["MatMul"] == 0 and records[0].counts["rejected"] == 1
    (reason,) = records[0].rejections  # the framework's aggregated reason, as the optimize table shows it
    assert why in reason and reason.startswith("Einsum: ")
    assert graphs.op_counts(out) == {"Einsum": 1}
