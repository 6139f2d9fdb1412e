"""fp16 that never silently returns NaN: an activation range check around ``convert_fp16``.

``convert_fp16`` rewrites types; it does not know the values. A graph whose fp32 activations pass 65,504 (the
SDXL VAE decoder's late ResNet convs, a foreign UNet's time-embedding Gemm at 75,312) converts cleanly, passes
``onnx.checker`` and returns inf/NaN for every input. :func:`optimize_fp16_checked` runs a pipeline that ends in
``convert_fp16`` like this::

    model ─passes before convert_fp16─► fp32 graph ──run on calibration inputs (ORT)──► |max| per tensor
        tensors above FP16_SAFE_MAX: their producer and readers become fp32 islands (convert_fp16_fp32_nodes)
    ─convert_fp16 (islands)─► fp16 graph ──run again──► every output finite? ── yes ──► done, islands reported
                                                   └─ no: the first node writing inf/NaN joins the islands;
                                                      up to MAX_ROUNDS rounds, then PassError naming that node

Where the graphs run is :func:`._ort.open_session`'s choice (CPU, else CUDA). When the fp32 graph after the
fusions cannot run here (``ort-cuda`` contrib ops on a CPU machine), the graph the passes got is calibrated
instead and each hot tensor maps to the fused node that absorbed it. When the fp16 graph cannot run here, the
result says so (``finite=None``) and a WARNING is logged: it is written unchecked, never silently.

On the CPU provider, fp16 nodes without an fp16 kernel run in fp32 between Casts that ONNX Runtime inserts, and
it drops the Cast pairs between two such nodes: a chain of them keeps its overflowing value in fp32 and the fp16
graph looks finite on CPU while TensorRT (strongly typed fp16) writes inf there. The re-check therefore reads
every tensor back as a graph output, which makes ORT store each one in its fp16 type: an activation beyond
65,504 is then inf, as on the GPU (fp32 accumulation inside a kernel is what TensorRT and cuBLAS do too).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from diffusion_trt.errors import PassError

from . import _ort
from ._external import external_nbytes, with_external_data
from .base import Pass, PassContext, PassRecord, optimize_model, pass_name
from .convert_fp16 import ConvertFp16Options
from .parity import failures as parity_failures
from .parity import worst_parity

logger = logging.getLogger(__name__)

FP16_MAX = float(np.finfo(np.float16).max)  # 65504

#: Activations above this (in fp32, on the calibration inputs) are kept in fp32. Half of fp16's range (2**15,
#: one binade below 65,504): calibration sees a handful of inputs, real inputs reach further (the SDXL VAE's
#: peaks grow with image size and content), and a kernel's fp16 intermediates (a GEMM's partial sums, a
#: norm's x**2) exceed its output; a factor 2 of headroom covers that for the sites measured (the foreign UNet's
#: 75,312 Gemm, the SDXL VAE convs), while activations of healthy fp16 graphs stay far below (< 2,000 in SD 1.5).
FP16_SAFE_MAX = 32768.0

#: Re-check rounds after the first conversion (each adds the first nodes still writing inf/NaN).
MAX_ROUNDS = 4

#: Largest graph (bytes of weights) the check runs on. It keeps fp32 activations of many tensors in host memory per
#: run and hands ONNX Runtime a copy of the graph: on the SD-1.5 UNet (3.4 GB fp32) it took 22 GB of RAM on the 2-core
#: machine (killed) and failed to serialise the graph on the H200 host (protobuf's 2 GiB limit), so graphs above this
#: are converted unchecked, with a warning (the text encoders and VAEs, SDXL's included, stay below it).
MAX_CHECKED_WEIGHT_BYTES = 1 << 30


@dataclass
class Fp16Check:
    """What the range check found and did (kept in manifest.json as ``fp16_check``).

    Attributes:
        threshold: |x| above which an fp32 activation was kept in fp32.
        calibrated: which graph gave the ranges: "optimized" (the fp32 graph after the fusions), "input" (the graph
            the passes got: the fused one did not run here), or "none" (neither ran: no islands from ranges).
        provider: where the calibration ran ("CPUExecutionProvider" / "CUDAExecutionProvider"), or "".
        hot: the tensors above ``threshold`` and their |max| (fp32), highest first (at most 20 listed).
        islands: node names kept fp32 by the check (ranges, then re-check rounds).
        rounds: conversions made (1 when the first was finite).
        finite: every output that is finite in fp32 is finite in fp16 on the calibration inputs; None when the fp16
            graph cannot run here (``note`` says why).
        note: why something was not checked, else "".
        wide_constant_nodes: nodes ``convert_fp16`` kept fp32 because they read a weight beyond fp16's range (a
            BatchNorm variance of 4.8e7: clipped to 65,504 it made the output wrong).
        parity: the fp16 graph's outputs against the fp32 graph's on the calibration inputs
            (:func:`.parity.worst_parity`, JSON-ready), which must pass :mod:`.parity`'s verdict; empty when the
            graphs could not both run here.
        seconds: wall time of the check (calibration + conversions + re-checks), not of the other passes.
        rows: the leading (batch) dim of the first input in the calibration runs; 0 when nothing was calibrated.
    """

    threshold: float
    calibrated: str
    provider: str
    hot: dict[str, float] = field(default_factory=dict)
    islands: list[str] = field(default_factory=list)
    rounds: int = 0
    finite: bool | None = None
    note: str = ""
    wide_constant_nodes: int = 0
    parity: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    rows: int = 0

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict of the fields (``hot`` rounded)."""
        data = dataclasses.asdict(self)
        data["hot"] = {k: round(v, 1) if np.isfinite(v) else "inf" for k, v in list(self.hot.items())[:20]}
        data["hot_count"] = len(self.hot)  # ``hot`` lists the 20 highest
        data["seconds"] = round(self.seconds, 2)
        return data

    def summary(self) -> str:
        """One log line: ``fp16 range check: 3 tensor(s) > 32768 (max 75312 at 'x'), 6 node(s) kept fp32, ...``."""
        if self.hot:
            top, value = next(iter(self.hot.items()))
            found = f"{len(self.hot)} tensor(s) > {self.threshold:g} (max {value:.0f} at {top!r})"
        else:
            found = f"no tensor > {self.threshold:g}" if self.calibrated != "none" else "not calibrated"
        verdict = {True: "outputs finite", False: "outputs NOT finite", None: "fp16 graph not run"}[self.finite]
        kept = f"{len(self.islands)} node(s) kept fp32"
        if self.wide_constant_nodes:
            kept += f" (+{self.wide_constant_nodes} reading weights beyond +-65504)"
        if self.parity:
            cosine = min(p["cosine"] for p in self.parity)
            verdict += f", cosine >= {cosine:.6f} vs fp32"
        text = f"fp16 range check: {found}, {kept}, {verdict} ({self.seconds:.1f} s)"
        return f"{text}; {self.note}" if self.note else text


def _weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the graph's initializers (each serialised alone: no 2 GiB limit on the whole), external data
    included (a model loaded without it: :mod:`._external`)."""
    return sum(t.ByteSize() + external_nbytes(t) for t in model.graph.initializer)


def optimize_fp16_checked(
    model: onnx.ModelProto, passes: Sequence[Pass], ctx: PassContext,
    feeds: Sequence[Mapping[str, np.ndarray]], input_feeds: Sequence[Mapping[str, np.ndarray]] | None = None,
) -> tuple[onnx.ModelProto, list[PassRecord], Fp16Check | None]:
    """:func:`.base.optimize_model`, with the range check around ``convert_fp16`` when ``passes`` contain it.

    Args:
        feeds: calibration inputs, one dict per run (names -> arrays; dtypes are cast to the graph's inputs).
        input_feeds: the calibration inputs of ``model`` itself, used when the fused fp32 graph cannot run here
            (default ``feeds``). ``compile`` passes the first sample of each batch: ``model`` is the export, whose
            batch dim is dynamic while the fused graph's is the static profile's, and a batch of 4 512x512 VAE
            decodes on ONNX Runtime CPU held 21 GB where one sample holds a quarter of it
            (:func:`diffusion_trt.compiler.fp16_calibration.first_sample`).

    Returns:
        The fp16 model, the pass records (``convert_fp16``'s counts gain ``fp32_range_islands``) and the check's
        result; ``None`` for the result when no ``convert_fp16`` is in ``passes`` or
        ``ctx.options["convert_fp16_range_check"]`` is False.

    Raises:
        PassError: the fp16 graph still writes inf/NaN after :data:`MAX_ROUNDS` rounds, or a node that does is
            already fp32 (the message names the node); the fp16 graph does not load in ONNX Runtime where the
            fp32 one ran (an inconsistent conversion); or a pass failed.
    """
    names = [pass_name(p) for p in passes]
    options = ctx.options_for(ConvertFp16Options)
    if "convert_fp16" not in names or not options.range_check:
        model, records = optimize_model(model, passes, ctx)
        return model, records, None
    limit = MAX_CHECKED_WEIGHT_BYTES if options.range_check_max_bytes is None else options.range_check_max_bytes
    weights = _weight_bytes(model)
    if weights > limit:
        logger.warning("%s: fp16 range check skipped: %.2f GB of weights is above its limit of %.2f GB (pass option "
                       "%s); converted without it", ctx.component, weights / 1e9, limit / 1e9,
                       "convert_fp16_range_check_max_bytes")
        model, records = optimize_model(model, passes, ctx)
        return model, records, None
    model = with_external_data(model, ctx.external_data_dir)  # ONNX Runtime runs it: its weights (<= limit) read
    start = time.perf_counter()
    split = names.index("convert_fp16")
    fp32, records = optimize_model(model, passes[:split], ctx)
    pre_seconds = sum(r.seconds for r in records)
    _name_nodes(fp32)
    threshold = FP16_SAFE_MAX if options.range_max is None else options.range_max
    check, fp32_peaks = _calibrate(model, fp32, feeds, threshold, feeds if input_feeds is None else input_feeds)
    islands = _islands_of(fp32, check.hot)
    fixed = list(options.fp32_nodes)
    fp32_names = {node.name for node in fp32.graph.node}
    convert_ctx = dataclasses.replace(ctx, dump_dir=ctx.dump_dir / f"{ctx.component}.fp16_checked"
                                      if ctx.dump_dir is not None else None)
    while True:
        check.rounds += 1
        with_islands = {**ctx.options, "convert_fp16_fp32_nodes": sorted({*fixed, *islands})}
        fp16, tail = optimize_model(fp32, passes[split:], dataclasses.replace(convert_ctx, options=with_islands))
        bad = _nonfinite_tensors(fp16, feeds, fp32_peaks, check, ctx.component)
        if not bad:
            break
        origins = _first_nonfinite_nodes(fp16, bad, fp32_names)
        new = [name for name in origins if name not in islands]
        if not new or check.rounds > MAX_ROUNDS:
            node = origins[0] if origins else "?"
            raise PassError(
                f"{ctx.component}: convert_fp16 cannot make this graph finite: {len(bad)} tensor(s) (e.g. "
                f"{sorted(bad)[0]!r}) hold inf/NaN on the calibration inputs in fp16 but not in fp32, after "
                f"{check.rounds} round(s) with {len(islands)} node(s) kept fp32; the first node writing inf/NaN is "
                f"{node!r}{' (already fp32)' if origins and not new else ''}; build this component in fp32, or "
                f"pass --pass-option convert_fp16_fp32_nodes='[\"{node}\"]' with the nodes feeding it"
            )
        logger.info("%s: fp16 round %d: %d tensor(s) not finite; keeping %s fp32 too", ctx.component,
                    check.rounds, len(bad), ", ".join(new))
        islands.extend(new)
    check.islands = sorted(islands)
    for record in tail:
        if record.name == "convert_fp16":
            record.counts["fp32_range_islands"] = len(check.islands)
            check.wide_constant_nodes = int(record.counts.get("fp32_wide_constants", 0))
    _check_parity(fp32, fp16, feeds, check, ctx.component)
    check.seconds = time.perf_counter() - start - pre_seconds
    log = logger.warning if check.finite is None else logger.info
    log("%s %s", ctx.component, check.summary())
    return fp16, [*records, *tail], check


def _check_parity(fp32: onnx.ModelProto, fp16: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]],
                  check: Fp16Check, component: str) -> None:
    """Compare the fp16 graph's outputs with the fp32 graph's on ``feeds`` and apply :mod:`.parity`'s verdict (the
    one ``optimize --check`` gives): finite outputs can still be wrong (a clipped weight: cosine 0.02).

    Raises:
        PassError: an output fails the verdict (the message names it, its figures and the thresholds).
    """
    ref, new = _ort.open_session(fp32), _ort.open_session(fp16)
    if isinstance(ref, str) or isinstance(new, str):
        logger.warning("%s: fp16 outputs not compared with fp32: %s", component, ref if isinstance(ref, str) else new)
        return
    outputs = worst_parity((ref.run(feed), new.run(feed)) for feed in feeds)
    check.parity = [o.to_json() for o in outputs]
    why = parity_failures(outputs, "fp16")
    if why:
        raise PassError(
            f"{component}: the fp16 graph does not match fp32 on the calibration inputs ({'; '.join(why)}), with "
            f"{len(check.islands)} node(s) kept fp32 for ranges and {check.wide_constant_nodes} for weights; build "
            "this component in fp32, or keep more of it fp32 (--pass-option convert_fp16_fp32_nodes='[\"NAME\"]')"
        )


def _name_nodes(model: onnx.ModelProto) -> None:
    """Give every unnamed node of the main graph a unique name (islands are named nodes)."""
    taken = {node.name for node in model.graph.node if node.name}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            name, k = f"{node.op_type}_{index}", 0
            while name in taken:
                k += 1
                name = f"{node.op_type}_{index}_{k}"
            node.name = name
            taken.add(name)


def _calibrate(model: onnx.ModelProto, fp32: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]],
               threshold: float, input_feeds: Sequence[Mapping[str, np.ndarray]],
               ) -> tuple[Fp16Check, dict[str, float] | None]:
    """The check's start and the fp32 peaks of the fused graph's tensors (None when it did not run here)."""
    found = _ort.activation_peaks(fp32, feeds)
    if not isinstance(found, str):
        peaks, provider = found
        return Fp16Check(threshold, "optimized", provider, _hot(peaks, threshold), rows=_rows(feeds)), peaks
    why_fused = found
    found = _ort.activation_peaks(model, input_feeds)
    if isinstance(found, str):
        return Fp16Check(threshold, "none", "", note=f"calibration skipped: the graph runs nowhere here "
                                                      f"(fused: {why_fused}; input: {found})"), None
    peaks, provider = found
    logger.info("fp16 range check: the fused fp32 graph does not run here (%s); calibrating the input graph",
                why_fused)
    hot = _map_to(model, fp32, _hot(peaks, threshold))
    return Fp16Check(threshold, "input", provider, hot, rows=_rows(input_feeds)), None


def _rows(feeds: Sequence[Mapping[str, np.ndarray]]) -> int:
    """The leading dim of the first input of the first feed (0 for none or a scalar)."""
    first = next(iter(feeds[0].values()), None) if feeds else None
    return int(first.shape[0]) if first is not None and first.ndim else 0


def _hot(peaks: Mapping[str, float], threshold: float) -> dict[str, float]:
    hot = {name: value for name, value in peaks.items() if value > threshold}
    return dict(sorted(hot.items(), key=lambda item: -item[1]))


def _map_to(source: onnx.ModelProto, target: onnx.ModelProto, hot: dict[str, float]) -> dict[str, float]:
    """Hot tensors of ``source`` as tensors of ``target``: the same name, or (a tensor a fusion absorbed) the
    first tensors downstream of it that ``target`` still has."""
    have = {name for node in target.graph.node for name in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in source.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    mapped: dict[str, float] = {}
    for name, value in hot.items():
        todo, seen = [name], {name}
        while todo:
            tensor = todo.pop()
            if tensor in have:
                mapped[tensor] = max(mapped.get(tensor, 0.0), value)
                continue
            for node in readers.get(tensor, []):
                for out in node.output:
                    if out and out not in seen:
                        seen.add(out)
                        todo.append(out)
    # the fused graph moves values around without changing them (ort-cuda's NHWC Transposes around GroupNorm): a
    # tensor such an op writes from a hot one is as hot
    target_readers: dict[str, list[onnx.NodeProto]] = {}
    for node in target.graph.node:
        for name in node.input:
            target_readers.setdefault(name, []).append(node)
    todo = list(mapped)
    while todo:
        tensor = todo.pop()
        for node in target_readers.get(tensor, []):
            if node.op_type in _SAME_VALUES and node.input and node.input[0] == tensor:
                for out in node.output:
                    if out and out not in mapped:
                        mapped[out] = mapped[tensor]
                        todo.append(out)
    return dict(sorted(mapped.items(), key=lambda item: -item[1]))


#: Ops whose output holds (a rearrangement of) the values of their first input.
_SAME_VALUES = frozenset({"Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Pad",
                          "Split", "Expand", "Tile", "Gather", "Cast", "MaxPool", "Resize", "DepthToSpace",
                          "SpaceToDepth"})


def _islands_of(model: onnx.ModelProto, hot: Mapping[str, float]) -> list[str]:
    """The producers and the readers of the hot tensors (both fp32: the Casts then sit on in-range tensors)."""
    names: list[str] = []
    for node in model.graph.node:
        if (hot.keys() & set(node.output)) or (hot.keys() & set(node.input)):
            names.append(node.name)
    return names


def _nonfinite_tensors(fp16: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]],
                       fp32_peaks: Mapping[str, float] | None, check: Fp16Check, component: str) -> set[str]:
    """The tensors that are inf/NaN in the fp16 graph and finite in fp32 (every tensor when the fp32 peaks are
    unknown). Every tensor is read back as a graph output, so each is stored in its fp16 type: ONNX Runtime CPU
    otherwise runs chains of nodes that lack an fp16 kernel in fp32 and would hide the overflow between them."""
    found = _ort.activation_peaks(fp16, feeds)
    if isinstance(found, str) and check.calibrated == "optimized" and "NotImplemented" not in found:
        raise PassError(  # the fp32 graph ran on this provider; the fp16 one is refused for a reason other than a
            # missing kernel: convert_fp16 wrote an invalid graph (types that do not match)
            f"{component}: the fp16 graph does not load in ONNX Runtime where its fp32 graph ran ({found}); "
            "convert_fp16 wrote an inconsistent graph: build this component in fp32, or keep the nodes named "
            "there fp32 with --pass-option convert_fp16_fp32_nodes='[...]'")
    if isinstance(found, str):
        check.finite = None
        check.note = "; ".join(filter(None, [check.note, f"the fp16 graph was not run (not checked): {found}"]))
        return set()
    peaks, _ = found
    bad = {name for name, value in peaks.items() if not np.isfinite(value)
           and (fp32_peaks is None or np.isfinite(fp32_peaks.get(_fp32_name(name, fp32_peaks), 0.0)))}
    if fp32_peaks is not None:
        skipped = sorted(name for name, value in fp32_peaks.items() if not np.isfinite(value))
        if skipped:
            check.note = f"{len(skipped)} tensor(s) are inf/NaN in fp32 already on these inputs (e.g. {skipped[0]!r})"
    check.finite = not bad
    for name in bad:
        check.hot.setdefault(name, float("inf"))
    return bad


#: The suffixes convert_fp16 gives the tensors it renames or adds: a graph output written in another type
#: (``y/float32``, then cast to ``y``) and an inserted Cast's output (``x/to_float16``).
_CONVERTED_SUFFIX = re.compile(r"/(to_)?float(16|32)$")


def _fp32_name(name: str, fp32_peaks: Mapping[str, float]) -> str:
    """The tensor of the fp32 graph that ``name`` of the fp16 graph holds the values of: itself, or, for one
    convert_fp16 renamed or added, the tensor it came from (``y/float32`` -> ``y``: a Sqrt output that is NaN in fp32
    already was taken for one the conversion made NaN, and the graph refused as "cannot make finite")."""
    while name not in fp32_peaks and _CONVERTED_SUFFIX.search(name):
        name = _CONVERTED_SUFFIX.sub("", name)
    return name


def _first_nonfinite_nodes(fp16: onnx.ModelProto, bad: set[str], fp32_names: set[str]) -> list[str]:
    """The nodes of the fp32 graph to keep fp32 next: those that write inf/NaN from finite inputs (where the
    overflow starts), in graph order; for a border Cast that convert_fp16 inserted (an fp32 island's value
    that does not fit fp16), the nodes that read the Cast."""
    readers: dict[str, list[str]] = {}
    producers = {out: node.name for node in fp16.graph.node for out in node.output}
    for node in fp16.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.name)
    origins: list[str] = []
    for node in fp16.graph.node:
        if bad & set(node.output) and not bad & set(node.input):
            if node.name in fp32_names:
                origins.append(node.name)
            else:  # an inserted Cast: its readers, or (a graph output) the fp32 node it casts
                after = [r for out in node.output for r in readers.get(out, []) if r in fp32_names]
                origins.extend(after or [producers[i] for i in node.input if producers.get(i) in fp32_names])
    return list(dict.fromkeys(origins))
