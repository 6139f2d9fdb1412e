"""The pass framework: what a pass is, what it is told, what it returns, and who runs it.

A pass is a plain function ``def fuse_gelu(graph: gs.Graph, ctx: PassContext) -> PassResult`` that changes
``graph`` in place (UNet weights are gigabytes: never copy them) and returns what it did as counts. Its name is
its ``__name__``. :class:`PassManager` runs an ordered tuple of passes (see :mod:`.pipelines`) and does the
chores once: cleanup + toposort after a modifying pass, one INFO line per pass, an optional dump of the graph
after each pass, and errors that name the pass and the passes before it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import onnx
import onnx_graphsurgeon as gs

from diffusion_trt.errors import PassError

from ._dump import GraphDumper
from ._export import export_model
from ._external import exported_with_data, import_graph
from ._match import Tally, collect_rejections, rejection_reasons

logger = logging.getLogger(__name__)

#: The lowest default-domain opset the passes are written against (LayerNormalization exists from 17).
MIN_OPSET = 17


OptionsT = TypeVar("OptionsT")


def _static_shapes(value: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    return {str(name): tuple(int(d) for d in dims) for name, dims in dict(value).items()}


#: How :meth:`PassContext.options_for` converts a value of each kind of :func:`option`.
_CONVERT: dict[Any, Callable[[Any], Any]] = {bool: bool, int: int, float: float, list: tuple, dict: _static_shapes}


def option(key: str, default: Any, kind: Any, *, user: bool = True, convert: Callable[[Any], Any] | None = None
           ) -> Any:
    """A field of a pass's options dataclass, read from ``PassContext.options[key]`` by :meth:`PassContext.options_for`.

    Args:
        key: the option's name in ``PassContext.options`` and on the command line (``--pass-option KEY=VALUE``),
            prefixed by the pass that reads it: ``"fuse_gelu_raise_opset"``.
        default: the value when the key is not given (None: the pass's own default, which its docstring names).
        kind: what a user's value must be (:func:`.options.check_pass_options`): ``bool``, ``int`` (positive),
            ``list`` (of names; the field holds a tuple), a tuple of allowed strings, or ``dict`` (static shapes).
        user: whether ``--pass-option`` may set it; False for the keys compile derives itself.
        convert: how a given value becomes the field's value; by default from ``kind`` (``list`` -> ``tuple``, a
            tuple of choices -> ``str``).
    """
    convert = convert or _CONVERT.get(kind, str)
    return field(default=default, metadata={"key": key, "kind": kind, "user": user, "convert": convert})


@dataclass
class PassContext:
    """What a pass may know about the graph it rewrites; passes read it and never change it.

    Attributes:
        component: pipeline component the graph comes from: "unet", "text_encoder", "vae_decoder",
            "vae_encoder", or any other name (used in logs, errors and dump paths).
        backend: engine the graph is optimized for: "ort" or "tensorrt".
        device: "cpu" or "cuda".
        precision: "fp32" or "fp16": the precision of the engine that will be built.
        opset: default-domain ONNX opset of the graph; :func:`optimize_model` sets it from the model.
        dump_dir: if set, the graph is written before the first pass as ``{dump_dir}/{component}/00_input.onnx``
            and after each pass as ``{NN}_{pass}.onnx`` next to it (NN from 01), with the weights stored once
            per run in ``weights.bin`` there; see :mod:`._dump`.
        external_data_dir: the folder the model's external-data weights are read from, one at a time, when a pass or
            the export reads them (:mod:`._external`: the model was loaded with ``load_external_data=False``); None:
            the model holds all its data.
        options: per-pass options by key, as ``--pass-option KEY=VALUE`` and ``CompileConfig.pass_options`` give
            them, e.g. ``{"fold_constants_size_threshold_bytes": 1 << 20}``; a pass reads its own as a typed, frozen
            dataclass with :meth:`options_for` (each field of it names its key: :func:`option`).
    """

    component: str
    backend: str
    device: str
    precision: str
    opset: int = MIN_OPSET
    dump_dir: Path | None = None
    options: dict[str, Any] = field(default_factory=dict)
    external_data_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.dump_dir is not None:
            self.dump_dir = Path(self.dump_dir)  # a str from a CLI flag is fine too

    def options_for(self, cls: type[OptionsT]) -> OptionsT:
        """The options of one pass: ``cls`` (a frozen dataclass of :func:`option` fields) with the value of each
        field's key in :attr:`options` where given (and not None), converted to the field's type; defaults else.

        Raises:
            ValueError, TypeError: a given value does not convert (``int("abc")``); the command line's values are
                checked before, with messages that name the key (:func:`.options.check_pass_options`).
        """
        given = {}
        for spec in dataclasses.fields(cls):  # type: ignore[arg-type]
            value = self.options.get(spec.metadata["key"])
            if value is not None:
                given[spec.name] = spec.metadata["convert"](value)
        return cls(**given)

    def describe(self) -> str:
        """One line for logs and errors: ``unet (backend=tensorrt, device=cuda, precision=fp16, opset=17)``."""
        return (
            f"{self.component} (backend={self.backend}, device={self.device}, precision={self.precision}, "
            f"opset={self.opset})"
        )


@dataclass(frozen=True)
class PassResult:
    """What a pass did: ``modified`` says whether the graph changed; ``counts`` says how, e.g. ``{"Gelu": 16}``."""

    modified: bool
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, tally: Tally, *keys: str, skipped: bool = True) -> PassResult:
        """The result of a fusion run with :func:`._match.fuse_each`: the counts of ``keys``, then ``rejected`` and
        (unless ``skipped=False``) ``skipped_for_target``; modified when any of ``keys`` is non-zero."""
        return cls(modified=any(tally.counts[key] for key in keys), counts=tally.record(*keys, skipped=skipped))


#: A pass rewrites the graph in place and reports what it did. Its name is its ``__name__``.
Pass = Callable[[gs.Graph, PassContext], PassResult]


@dataclass
class PassRecord:
    """One pass run by :class:`PassManager`: kept in manifest.json to show what shaped an engine.

    ``seconds`` is wall time of the pass plus the cleanup/toposort after it (not the dump). ``rejections`` are
    the candidates the pass turned down, grouped by reason (:func:`._match.rejection_reasons`).
    """

    name: str
    modified: bool
    counts: dict[str, int]
    seconds: float
    rejections: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict: ``{"name": ..., "modified": ..., "counts": {...}, "seconds": 0.123}``, plus
        ``"rejections": {reason: count}`` when the pass turned candidates down."""
        data: dict[str, Any] = {"name": self.name, "modified": self.modified, "counts": dict(self.counts),
                                "seconds": round(self.seconds, 3)}
        if self.rejections:
            data["rejections"] = dict(self.rejections)
        return data

    def summary(self) -> str:
        """The INFO line: ``fuse_group_norm: GroupNormalization=61 (0.8 s)``; ``fold_constants: no change (0.1 s)``.
        """
        if self.modified or any(self.counts.values()):
            what = ", ".join(f"{key}={value}" for key, value in self.counts.items()) or "modified"
        else:
            what = "no change"
        return f"{self.name}: {what} ({self.seconds:.1f} s)"


def pass_name(pass_: Pass) -> str:
    """The name of a pass: its function ``__name__`` (a callable object falls back to its class name)."""
    return getattr(pass_, "__name__", type(pass_).__name__)


class PassManager:
    """Runs passes in the given order on one graph, in place.

    Args:
        passes: the passes, in order; usually a tuple from :mod:`.pipelines`.
    """

    def __init__(self, passes: Sequence[Pass]) -> None:
        self.passes: tuple[Pass, ...] = tuple(passes)

    def run(self, graph: gs.Graph, ctx: PassContext) -> list[PassRecord]:
        """Run every pass on ``graph`` (changed in place) and return one record per pass.

        After a pass that reports ``modified=True`` the graph is cleaned up (dead nodes removed) and
        topologically sorted, so the next pass can rely on both.

        Raises:
            PassError: a pass raised or returned something other than a PassResult; or the dump after a pass
                failed. The message names the pass, the component and the passes that ran before it, and the
                original exception is chained as ``__cause__``. The graph may then be half rewritten: discard it.
        """
        dumper = GraphDumper(ctx.dump_dir / ctx.component) if ctx.dump_dir is not None else None
        records: list[PassRecord] = []
        if dumper is not None:
            self._dump(dumper, graph, "00_input", ctx)
        for index, pass_ in enumerate(self.passes, start=1):
            name = pass_name(pass_)
            start = time.perf_counter()
            try:
                with collect_rejections() as rejected:
                    result = pass_(graph, ctx)
                if not isinstance(result, PassResult):
                    raise TypeError(f"pass returned {type(result).__name__}, expected PassResult")
                if result.modified:
                    graph.cleanup().toposort()
            except Exception as err:
                raise PassError(self._failure_message(name, ctx, records, err)) from err
            record = PassRecord(name, result.modified, dict(result.counts), time.perf_counter() - start,
                                rejection_reasons(rejected))
            records.append(record)
            logger.info("%s %s", ctx.component, record.summary())
            if dumper is not None:
                self._dump(dumper, graph, f"{index:02d}_{name}", ctx)
        return records

    @staticmethod
    def _dump(dumper: GraphDumper, graph: gs.Graph, stem: str, ctx: PassContext) -> None:
        try:
            path = dumper.dump(graph, stem)
        except Exception as err:
            raise PassError(
                f"could not dump the {ctx.component} graph as {stem}.onnx in {dumper.folder}: "
                f"{type(err).__name__}: {err}; free disk space or unset PassContext.dump_dir"
            ) from err
        logger.debug("dumped %s", path)

    @staticmethod
    def _failure_message(name: str, ctx: PassContext, records: list[PassRecord], err: BaseException) -> str:
        before = ", ".join(record.name for record in records) or "none"
        fix = (
            "set PassContext.dump_dir to save the graph after each pass and inspect the graph this pass got"
            if ctx.dump_dir is None
            else f"the graph this pass got is the last file in {ctx.dump_dir / ctx.component}"
        )
        return (
            f"pass {name} failed on component {ctx.describe()}; passes run before it: [{before}]: "
            f"{type(err).__name__}: {err}; {fix}"
        )


def default_domain_opset(model: onnx.ModelProto) -> int | None:
    """The model's default-domain ("" or "ai.onnx") opset version, or None if it imports none."""
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return int(opset.version)
    return None


def check_opset(model: onnx.ModelProto, component: str) -> int:
    """Return the model's default-domain opset, or raise PassError if the passes cannot handle it.

    Raises:
        PassError: no default-domain opset, one below :data:`MIN_OPSET`, or one newer than the installed onnx
            package knows (``onnx.defs.onnx_opset_version()``).
    """
    highest = onnx.defs.onnx_opset_version()
    found = default_domain_opset(model)
    supported = f"the passes support opsets {MIN_OPSET}..{highest} (onnx {onnx.__version__})"
    if found is None:
        raise PassError(
            f"{component}: the model imports no default-domain ('' / 'ai.onnx') opset; {supported}; "
            f"re-export it with torch.onnx.export(..., opset_version={MIN_OPSET})"
        )
    if found < MIN_OPSET:
        raise PassError(
            f"{component}: the model uses ONNX opset {found}; {supported}; re-export it with "
            f"torch.onnx.export(..., opset_version={MIN_OPSET}) or newer, or convert it with "
            f"onnx.version_converter.convert_version(model, {MIN_OPSET})"
        )
    if found > highest:
        raise PassError(
            f"{component}: the model uses ONNX opset {found}, newer than the installed onnx {onnx.__version__} "
            f"knows; {supported}; upgrade the onnx package or re-export with opset_version<={highest}"
        )
    return found


def optimize_model(
    model: onnx.ModelProto, passes: Sequence[Pass], ctx: PassContext
) -> tuple[onnx.ModelProto, list[PassRecord]]:
    """Run ``passes`` on ``model`` and return the rewritten model and one record per pass.

    The graph goes through onnx-graphsurgeon: ``gs.import_onnx`` -> :meth:`PassManager.run` ->
    ``gs.export_onnx`` (as :func:`._export.export_model` writes it: the same bytes, each weight copied into the new
    model once, one at a time). The result keeps the model's ir_version and opset imports (all domains; plus any
    domain a pass added), producer, doc_string and metadata_props. ``model`` is only read (callers may run it again,
    as the fp16 range check does): the result is a new ModelProto with its own copy of the weights, so memory peaks
    at ``model`` + the result + the arrays the passes made and export has not yet written (convert_fp16's). Drop
    ``model`` after the call (``model, records = optimize_model(model, ...)``) to keep one copy. With
    ``ctx.external_data_dir`` a model loaded without its external data is imported with its weights left in their
    files (:func:`._external.import_graph`): then no second copy is held at all, only the arrays the passes made.
    ``ctx`` is not changed: the passes get a copy whose ``opset`` is the model's default-domain opset.

    Raises:
        PassError: the model's default-domain opset is below 17 or above what the installed onnx knows
            (message names the opset found, the supported range and the fix), or a pass failed.
    """
    opset = check_opset(model, ctx.component)
    if opset != ctx.opset:
        logger.debug("%s: PassContext.opset=%d but the model uses opset %d; passes see %d",
                     ctx.component, ctx.opset, opset, opset)
        ctx = dataclasses.replace(ctx, opset=opset)
    graph = import_graph(model, ctx.external_data_dir)
    with exported_with_data() if ctx.external_data_dir is not None else contextlib.nullcontext():
        records = PassManager(passes).run(graph, ctx)
    out = export_model(graph)
    # gs carries ir_version, the default-domain opset and the other imported domains (graph.import_domains);
    # a pass may add a domain or raise the opset, so merge rather than overwrite.
    out.ir_version = graph.ir_version or model.ir_version
    have = {opset_id.domain for opset_id in out.opset_import}
    out.opset_import.extend(opset_id for opset_id in model.opset_import if opset_id.domain not in have)
    out.doc_string = model.doc_string
    out.model_version = model.model_version
    out.domain = model.domain
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    return out, records
