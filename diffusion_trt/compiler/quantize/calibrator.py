"""Tensor ranges from ONNX Runtime's calibrators: over captured feeds (:func:`calibrate_ranges`) or driven by the
denoising loop itself (:class:`LoopCalibrator`); both write ``save_tensors_data``'s ranges file."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import BuildError
from .exclusions import QUANTIZED_OP_TYPES

logger = logging.getLogger(__name__)

#: Calibration feeds run per ``collect_data`` call. The histogram calibrators (entropy, percentile, fp8's
#: distribution) hold every calibrated tensor of every feed of a call until it is folded (478 tensors of up to
#: [2, 320, 64, 64] for the SD-1.5 UNet at 512x512), so one feed per call. MinMax holds two scalars per tensor.
CALIBRATION_CHUNK = 1


def _data_reader(feeds: Sequence[Mapping[str, np.ndarray]]) -> Any:
    """A ``CalibrationDataReader`` over captured feeds (restartable, supports ORT's strided calibration)."""
    from onnxruntime.quantization import CalibrationDataReader

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.start, self.end = 0, len(feeds)
            self._it: Iterator[Mapping[str, np.ndarray]] | None = None

        def get_next(self) -> dict[str, np.ndarray] | None:
            if self._it is None:
                self._it = iter(feeds[self.start:self.end])
            return dict(next(self._it, None) or {}) or None

        def rewind(self) -> None:
            self._it = None

        def set_range(self, start_index: int, end_index: int) -> None:
            self.start, self.end, self._it = start_index, end_index, None

        def __len__(self) -> int:
            return len(feeds)

    return _Reader()


@contextlib.contextmanager
def _quiet_ort_quantization() -> Iterator[None]:
    """Drop onnxruntime.quantization's root-logger nags ("consider pre-processing") while it runs."""

    class _Filter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "pre-process" not in record.getMessage()

    f = _Filter()
    logging.getLogger().addFilter(f)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(f)


def calibrate_ranges(model_path: Path, feeds: Sequence[Mapping[str, np.ndarray]], out: Path, method: Any) -> Path:
    """Run ONNX Runtime's calibrator (``create_calibrator``, as ``quantize_static`` does) over ``feeds`` and save
    the tensor ranges with ``save_tensors_data`` (the cache format ``quantize_static(calibration_cache_path=...)``
    reads back). Deterministic: same graph and feeds give a byte-identical file.

    Raises:
        BuildError: no feeds.
    """
    from onnxruntime.quantization import create_calibrator
    from onnxruntime.quantization.calibrate import save_tensors_data

    if not feeds:
        raise BuildError(f"no calibration data for {model_path.name}: raise --calibration-size")
    with tempfile.TemporaryDirectory(prefix="dtrt-calib-") as tmp:
        calibrator = create_calibrator(
            model_path, list(QUANTIZED_OP_TYPES), augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=method, use_external_data_format=True,
        )
        # Feed in chunks to bound the memory of the intermediate outputs (every tensor of every feed, GBs for
        # SD-1.5); each collect_data call folds its chunk into the running ranges. Not ORT's own
        # max_intermediate_outputs: in onnxruntime 1.32 MinMaxCalibrater.collect_data clears the collected
        # outputs when that count is reached without computing their ranges ("No data is collected").
        for start in range(0, len(feeds), CALIBRATION_CHUNK):
            calibrator.collect_data(_data_reader(feeds[start:start + CALIBRATION_CHUNK]))
        ranges = calibrator.compute_data()
        del calibrator
    save_tensors_data(ranges, out)
    return out



class _ReplaySession:
    """Stands in for a calibrator's ``infer_session`` for one ``collect_data`` call: ``run`` returns outputs that
    were already computed for the very feed the reader gives (everything else goes to the real session)."""

    def __init__(self, session: Any, outputs: list[np.ndarray]) -> None:
        self._session = session
        self._outputs = outputs

    def run(self, output_names: Any, feeds: Any, *args: Any, **kwargs: Any) -> list[np.ndarray]:
        del output_names, feeds, args, kwargs
        return self._outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class LoopCalibrator:
    """ONNX Runtime's calibrator driven by the denoising loop itself: one run of the augmented fp32 UNet graph per
    UNet call both continues the loop (its ``noise_pred``) and yields that call's tensor statistics.

    ::

        prompts ──loop (Generation.run, unet_fn=this.unet_fn)──► augmented graph: noise_pred + statistics per call
                                     captured step: on_capture=this.fold ──► calibrator.collect_data (its own merge)

    Why: capturing the inputs with the torch UNet and then replaying them through the augmented graph runs the
    UNet twice per captured step. Here the graph being quantized denoises: same prompts, seeds, schedule, size and
    captured steps, half the UNet runs; its inputs differ from the torch loop's by fp32 rounding only (the same
    function, other kernels). The statistics are folded by the calibrator's own ``collect_data`` (one call's
    outputs replayed through :class:`_ReplaySession`), one UNet call at a time: memory holds one call's
    intermediate outputs at most (MinMax: two scalars per tensor; histogram methods: the tensors).

    Deterministic: same graph, prompts and settings give a byte-identical ranges file on the same machine and
    library versions (ONNX Runtime's CPU kernels do not depend on timing).

    Args:
        model_path: the fp32 graph to calibrate (inputs ``sample``, ``timestep``, ``encoder_hidden_states``).
        method: an ``onnxruntime.quantization.CalibrationMethod``.
        work_dir: where the augmented graph is written (a temporary folder; ~ the size of the graph).
        output_name: the graph output the loop continues with.
    """

    def __init__(self, model_path: Path, method: Any, work_dir: Path, output_name: str = "noise_pred") -> None:
        from onnxruntime.quantization import create_calibrator

        self.calibrator = create_calibrator(
            model_path, list(QUANTIZED_OP_TYPES), augmented_model_path=str(Path(work_dir) / "augmented.onnx"),
            calibrate_method=method, use_external_data_format=True,
        )
        self.session = self.calibrator.infer_session
        names = [o.name for o in self.session.get_outputs()]
        if output_name not in names:
            raise BuildError(f"{model_path}: no output {output_name!r} to continue the calibration loop with")
        self._index = names.index(output_name)
        self._last: tuple[dict[str, np.ndarray], list[np.ndarray]] | None = None
        self.calls = 0
        self.folded = 0

    def unet_fn(self, sample: Any, timestep: Any, encoder_hidden_states: Any) -> Any:
        """A :data:`~.calibrate.UNetFn`: run the augmented graph, keep the statistics until :meth:`fold`."""
        import torch

        feeds = {"sample": sample.numpy(), "timestep": timestep.numpy(),
                 "encoder_hidden_states": encoder_hidden_states.numpy()}
        outputs = self.session.run(None, feeds)
        self._last = (feeds, outputs)
        self.calls += 1
        return torch.from_numpy(outputs[self._index])

    def fold(self) -> None:
        """Fold the statistics of the last UNet call into the ranges (the loop's ``on_capture``)."""
        if self._last is None:
            raise BuildError("LoopCalibrator.fold called before any UNet call")
        feeds, outputs = self._last
        self._last = None
        self.calibrator.infer_session = _ReplaySession(self.session, outputs)
        try:
            self.calibrator.collect_data(_data_reader([feeds]))
        finally:
            self.calibrator.infer_session = self.session
        self.folded += 1

    def save(self, out: Path) -> Path:
        """Write the ranges (``save_tensors_data``, the format of :func:`calibrate_ranges`); free the session.

        Raises:
            BuildError: nothing was folded.
        """
        from onnxruntime.quantization.calibrate import save_tensors_data

        if not self.folded:
            raise BuildError("no calibration data: the loop captured no UNet call; raise --calibration-size")
        save_tensors_data(self.calibrator.compute_data(), out)
        self.close()
        return out

    def close(self) -> None:
        """Drop the calibrator and its session (GBs for SD-1.5)."""
        self.calibrator = None  # type: ignore[assignment]
        self.session = None
