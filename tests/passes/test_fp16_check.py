"""fp16_check: the activation range check around convert_fp16 (islands, re-check, refusal)."""

from __future__ import annotations

import numpy as np
import pytest

from diffusion_trt.errors import PassError
from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes._ort import activation_peaks, open_session
from diffusion_trt.passes.convert_fp16 import convert_fp16
from diffusion_trt.passes.fp16_check import FP16_SAFE_MAX, optimize_fp16_checked
from diffusion_trt.passes.infer_shapes import infer_shapes
from tests import graphs

PASSES = (infer_shapes, convert_fp16)


def _ctx(**options: object) -> PassContext:
    return PassContext(component="block", backend="tensorrt", device="cuda", precision="fp16", options=dict(options))


def _feeds(model) -> list[dict[str, np.ndarray]]:
    return [graphs.random_feeds(model, seed=1)]


def test_overflow_is_kept_fp32_and_the_graph_is_finite() -> None:
    model = graphs.overflow_model(gain=5e4)
    feeds = _feeds(model)
    fp16, records, check = optimize_fp16_checked(model, PASSES, _ctx(), feeds)
    assert check is not None and check.finite is True
    assert "h" in check.hot and check.hot["h"] > FP16_SAFE_MAX
    assert check.islands == ["norm", "proj"]  # the producer and the reader of the hot tensor
    assert records[-1].name == "convert_fp16" and records[-1].counts["fp32_range_islands"] == 2
    y = open_session(fp16).run(feeds[0])["y"]  # casts the fp32 feeds to the graph's fp16 input
    (want,) = graphs.run(model, feeds[0])
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y.astype(np.float32), want, atol=2e-2)


def test_without_the_check_the_same_graph_overflows() -> None:
    """What the check prevents: convert_fp16 alone stores h in fp16, where it is inf."""
    model = graphs.overflow_model(gain=5e4)
    fp16, _ = optimize_model(model, PASSES, _ctx())
    peaks, _ = activation_peaks(fp16, _feeds(model))
    assert not np.isfinite(peaks["h"])


def test_a_healthy_graph_gets_no_islands() -> None:
    model = graphs.overflow_model(gain=1.0)
    _, _, check = optimize_fp16_checked(model, PASSES, _ctx(), _feeds(model))
    assert check is not None and check.hot == {} and check.islands == [] and check.finite is True


def test_refuses_a_graph_it_cannot_make_finite() -> None:
    model = graphs.huge_output_model(gain=1e5)
    with pytest.raises(PassError, match=r"cannot make this graph finite.*'amplify' \(already fp32\)"):
        optimize_fp16_checked(model, PASSES, _ctx(), _feeds(model))


def test_off_by_option_and_without_convert_fp16() -> None:
    model = graphs.overflow_model()
    assert optimize_fp16_checked(model, PASSES, _ctx(convert_fp16_range_check=False), _feeds(model))[2] is None
    assert optimize_fp16_checked(model, (infer_shapes,), _ctx(), _feeds(model))[2] is None


def test_a_graph_above_the_size_limit_is_converted_unchecked_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Real-size UNets (3.4 GB fp32) go unchecked: the check's memory and ORT's 2 GiB proto limit (measured: 22 GB RSS
    on the CPU machine, a serialisation failure on the H200) - with a warning naming the limit's option."""
    model = graphs.overflow_model(gain=5e4)
    with caplog.at_level("WARNING"):
        fp16, records, check = optimize_fp16_checked(model, PASSES, _ctx(convert_fp16_range_check_max_bytes=1),
                                                     _feeds(model))
    assert check is None and records[-1].name == "convert_fp16"
    assert "block: fp16 range check skipped" in caplog.text and "convert_fp16_range_check_max_bytes" in caplog.text
    peaks, _ = activation_peaks(fp16, _feeds(model))
    assert not np.isfinite(peaks["h"])  # what skipping costs: the overflow is not caught


def test_a_graph_over_the_inline_limit_runs_from_one_weight_file_and_is_not_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The big-graph path (weights written once, every exposure group a light graph beside them) gives the peaks and
    outputs of the in-memory path and leaves the caller's proto as it was."""
    from diffusion_trt.passes import _ort

    model = graphs.overflow_model(gain=5e4)
    model, _ = optimize_model(model, (infer_shapes,), _ctx())
    feeds = _feeds(model)
    small_peaks, _ = activation_peaks(model, feeds)
    small_out = open_session(model).run(feeds[0])
    before = model.SerializeToString()
    monkeypatch.setattr(_ort, "INLINE_LIMIT_BYTES", 0)
    monkeypatch.setattr(_ort, "EXTERNAL_MIN_BYTES", 1)  # every weight of this tiny graph goes to the file
    monkeypatch.setattr(_ort, "EXPOSE_PER_RUN", 1)  # one session per tensor: several light graphs, one weight file
    groups: list[int] = []
    monkeypatch.setattr(_ort, "_session", lambda source, providers, real=_ort._session: (
        groups.append(1), real(source, providers))[1])
    big_peaks, _ = activation_peaks(model, feeds)
    assert len(groups) == len(big_peaks) > 1  # one light graph per tensor, all reading the one weight file
    big_out = open_session(model).run(feeds[0])
    assert big_peaks == small_peaks
    assert big_out.keys() == small_out.keys()
    for name in small_out:
        np.testing.assert_array_equal(big_out[name], small_out[name])
    assert model.SerializeToString() == before
