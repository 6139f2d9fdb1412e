"""TensorRT compatibility rules, as pure functions over versions, compute capabilities and bytes.

Shared by the builder (``compiler/build_trt.py``) and the runtime (``runtime/engines/trt_engine.py``); neither
``tensorrt`` nor ``torch`` is imported at module level, so every rule here is unit-tested on a machine
without a GPU. Callers read the facts (``tensorrt.__version__``, the GPU's compute capability) and pass
them in.

Why these rules exist:

* A serialized TensorRT plan is tied to the TensorRT release that built it and to the GPU's compute
  capability (SM version). Loading it elsewhere fails inside ``deserialize_cuda_engine`` with an opaque
  version-tag assertion; :func:`check_plan_compat` turns that into a message naming both sides.
* Reduced-precision kernels need hardware: BF16 tensor cores from SM 8.0 (Ampere), FP8 from SM 8.9
  (Ada Lovelace, Hopper); source: the TensorRT support matrix, "Hardware and precision".
  :func:`check_precision_supported` refuses before any parsing or building.
* The builder's timing cache is only valid for the TensorRT release and GPU it was measured on. We key
  cache files by (TensorRT version, compute capability), frame them with a small header, and ignore a
  file whose header names another key (:func:`unpack_timing_cache`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .artifact.values import parse_json
from .errors import ArtifactError, BuildError

logger = logging.getLogger(__name__)

#: Minimum compute capability per builder precision flag (TensorRT support matrix: BF16 needs Ampere,
#: SM 8.0; FP8 needs Ada/Hopper, SM 8.9). Flags absent here (fp16, int8, tf32) run on every GPU that
#: TensorRT 10 supports (SM 7.5+).
PRECISION_MIN_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {"bf16": (8, 0), "fp8": (8, 9)}
_ARCH = {"bf16": "Ampere or newer", "fp8": "Ada Lovelace, Hopper or newer"}

#: ``tensorrt.DataType`` member names -> manifest dtype names.
TRT_DTYPES: dict[str, str] = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT64": "int64",
    "INT32": "int32",
    "INT8": "int8",
    "UINT8": "uint8",
    "BOOL": "bool",
}

#: First bytes of a timing-cache file written by :func:`pack_timing_cache`.
TIMING_CACHE_MAGIC = b"DTRT-TIMING-CACHE\n"
TIMING_CACHE_FORMAT = 1
_LEN = struct.Struct("<I")  # little-endian uint32: length of the JSON header that follows the magic
#: The largest timing-cache file read (TensorRT's timing caches are megabytes); a larger one is ignored.
MAX_TIMING_CACHE_BYTES = 1 << 30
#: A framed cache's JSON header is ~250 bytes (:func:`pack_framed`); a longer one is not ours and is not parsed.
MAX_FRAME_HEADER_BYTES = 64 << 10

#: Why a TensorRT-RTX plan cannot be built refittable here; ``CompileConfig`` and ``TrtBuildConfig`` both raise it
#: (:func:`rtx_refit_refusal`). Observed with 1.7.1.116 on a machine without a GPU: a refittable build of a graph
#: with weights fails inside the builder with ``MyelinCheckException ... CHECK(status == CUDA_SUCCESS)``.
_RTX_REFIT_REFUSAL = (
    "refittable=True with {field}='tensorrt-rtx': LoRAs swapped at run time (EnginePipeline.load_lora) work on "
    "full-TensorRT and ONNX Runtime artifacts only (no TensorRT-RTX refit could be run here to test it, and "
    "TensorRT-RTX 1.7.1 cannot build a refittable plan on a machine without a GPU); merge LoRAs at compile time "
    "with --lora FILE[:SCALE]"
)


def rtx_refit_refusal(field: str) -> str:
    """The one message refusing a refittable TensorRT-RTX build; ``field`` names the option that chose the library
    (``backend`` for ``CompileConfig``, ``library`` for ``TrtBuildConfig``)."""
    return _RTX_REFIT_REFUSAL.format(field=field)


# -- the two TensorRT libraries ------------------------------------------------------------------------


@dataclass(frozen=True)
class TrtLibrary:
    """What differs between full TensorRT and TensorRT for RTX: the one table the build and engine code read.

    Both libraries share the Python API (``Builder``, ``OnnxParser``, ``Runtime``, ``ICudaEngine``); the build
    stage (``compiler/build_trt.py``) and the engine (``runtime/engines/trt_engine.py``) take a :class:`TrtLibrary` and
    branch on its fields, never on the backend name.

    Attributes:
        backend: the ``--backend`` name, "tensorrt" or "tensorrt-rtx".
        module: the import name ("tensorrt"; "tensorrt_rtx_bindings" for the ``tensorrt-rtx-cu13-bindings`` wheel).
        display: the library's name in messages.
        install: how to install it (for messages).
        precision_flags: the builder has FP16/BF16/INT8/FP8 flags (full TensorRT 10). TensorRT-RTX has none:
            every network is strongly typed, its types come from the graph (fp16 from ``convert_fp16``).
        int8_calibrator: implicit int8 calibration exists (full TensorRT 10, deprecated); TensorRT-RTX has
            int8 only as weight-only GEMM quantization, so our int8 QDQ activations are refused for it.
        compute_capability_targets: plans are built for named compute capabilities
            (``IBuilderConfig.set_compute_capability``) on any machine, with or without a GPU (TensorRT-RTX's
            "CPU-only AOT" build). Full TensorRT builds for the GPU it runs on.
        runtime_config: ``ICudaEngine.create_runtime_config`` exists (TensorRT-RTX: CUDA-graph strategy, dynamic
            shape kernel specialisation, a runtime cache of kernels compiled on the user's GPU).
        supported: compute capabilities its engines run on; ``None`` = any the release supports (full TensorRT).
        portable: the targets of a build that names none (TensorRT-RTX's own default portable set).
    """

    backend: str
    module: str
    display: str
    install: str
    precision_flags: bool
    int8_calibrator: bool
    compute_capability_targets: bool
    runtime_config: bool
    supported: tuple[tuple[int, int], ...] | None
    portable: tuple[tuple[int, int], ...] = ()

    def import_module(self, error: type[Exception] = BuildError) -> Any:
        """Import the library's Python module.

        Raises:
            ``error`` (BuildError by default; the runtime passes ArtifactError): naming the module, the
            exception and the install line. The PyPI ``tensorrt`` stubs raise arbitrary errors on import.
        """
        import importlib

        try:
            return importlib.import_module(self.module)
        except Exception as e:  # stub wheels raise arbitrary errors
            other = "--backend tensorrt-rtx" if self.backend == "tensorrt" else "--backend ort"
            raise error(
                f"`import {self.module}` failed ({type(e).__name__}: {e}); {self.display} is needed: "
                f"{self.install}, or compile with {other}"
            ) from e

    def check_runs_on(self, cc: str | tuple[int, int], targets: Iterable[str | tuple[int, int]] | None,
                      gpu: str = "", where: str = "this artifact") -> None:
        """Refuse, before anything is deserialised, a GPU this library or the plan's targets do not cover.

        Args:
            cc: this GPU's compute capability ("9.0").
            targets: the plan's build targets (``build.compute_capabilities``); ``None`` = not recorded.
            gpu: device name for the message.
            where: what is being loaded, for the message.

        Raises:
            ArtifactError: naming the compute capability, the GPU, what is supported and the alternative
                (``--backend ort --device cuda``).
        """
        have = parse_compute_capability(cc)
        name = f"{format_compute_capability(have)}{f' ({gpu})' if gpu else ''}"
        if self.supported is not None and have not in self.supported:
            raise ArtifactError(
                f"{where} needs {self.display}, which does not support this GPU of compute capability {name}; "
                f"its engines run on compute capability {', '.join(map(format_compute_capability, self.supported))}: "
                "on this GPU compile with --backend ort --device cuda (or full TensorRT, --backend tensorrt)"
            )
        wanted = [parse_compute_capability(t) for t in targets or ()]
        if wanted and have not in wanted:
            raise ArtifactError(
                f"{where} was built for compute capability {', '.join(map(format_compute_capability, wanted))}, "
                f"not for this GPU's {name}; recompile with --compute-capability "
                f"{format_compute_capability(have)} (or `current` on this machine)"
            )


#: The libraries by ``--backend`` name. Sources: TensorRT-RTX support matrix (1.x: engines portable across
#: 8.0/8.6/8.9/12.0 by default, 7.5 only when named; FP8 from 8.9, BF16 from 8.0, INT8 weight-only GEMM only)
#: and ``tensorrt_rtx_bindings.ComputeCapability`` of 1.7.1 (SM75, SM80, SM86, SM89, SM120, SM121).
LIBRARIES: dict[str, TrtLibrary] = {
    "tensorrt": TrtLibrary(
        backend="tensorrt", module="tensorrt", display="TensorRT", install="`pip install tensorrt` (TensorRT 10+)",
        precision_flags=True, int8_calibrator=True, compute_capability_targets=False, runtime_config=False,
        supported=None,
    ),
    "tensorrt-rtx": TrtLibrary(
        backend="tensorrt-rtx", module="tensorrt_rtx_bindings", display="TensorRT-RTX",
        install="`pip install 'diffusion-trt[rtx]'` (tensorrt-rtx-cu13-libs and -bindings)",
        precision_flags=False, int8_calibrator=False, compute_capability_targets=True, runtime_config=True,
        supported=((7, 5), (8, 0), (8, 6), (8, 9), (12, 0), (12, 1)),
        portable=((8, 0), (8, 6), (8, 9), (12, 0)),
    ),
}


def library(backend: str) -> TrtLibrary:
    """The :class:`TrtLibrary` of a backend name.

    Raises:
        BuildError: not a TensorRT backend (the message lists them).
    """
    try:
        return LIBRARIES[backend]
    except KeyError:
        raise BuildError(f"backend {backend!r} is not a TensorRT library; use one of {', '.join(LIBRARIES)}") from None


def resolve_rtx_targets(requested: Iterable[str] | None, current: str | None) -> tuple[str, ...]:
    """TensorRT-RTX build targets as "major.minor" strings, checked against what the library supports.

    Args:
        requested: ``--compute-capability`` values ("8.6", "sm_89", "current"); ``None``/empty = the portable set.
        current: this machine's GPU compute capability, substituted for "current"; ``None`` keeps "current" as is
            (config validation, before the GPU is looked at).

    Raises:
        RuntimeInputError: a value that is not a compute capability, one TensorRT-RTX cannot build for (the message
            lists the supported ones), or "current" on a GPU it does not support.
    """
    from .errors import RuntimeInputError

    lib = LIBRARIES["tensorrt-rtx"]
    supported = ", ".join(map(format_compute_capability, lib.supported or ()))
    if not requested:
        return tuple(map(format_compute_capability, lib.portable))
    out: list[str] = []
    for value in requested:
        if str(value).strip().lower() == "current":
            if current is None:
                out.append("current")
                continue
            value = current
        try:
            cc = parse_compute_capability(value)
        except BuildError:
            raise RuntimeInputError(
                f"--compute-capability {value!r} is not a compute capability; write e.g. 8.9, or 'current' for "
                f"this machine's GPU (TensorRT-RTX builds for {supported})"
            ) from None
        if cc not in (lib.supported or ()):
            raise RuntimeInputError(
                f"--compute-capability {format_compute_capability(cc)}: TensorRT-RTX cannot build for it (it builds "
                f"for {supported}); for other GPUs (e.g. 9.0, H100/H200) use --backend ort --device cuda"
            )
        if format_compute_capability(cc) not in out:
            out.append(format_compute_capability(cc))
    return tuple(out)


# -- versions and compute capabilities ----------------------------------------------------------------


def parse_compute_capability(value: str | tuple[int, int] | list[int]) -> tuple[int, int]:
    """``"8.9"``, ``"sm_89"``, ``(8, 9)`` -> ``(8, 9)``.

    Raises:
        BuildError: anything else (the message shows the accepted forms).
    """
    if isinstance(value, tuple | list) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", value)
        if m:
            return int(m.group(1)), int(m.group(2))
        m = re.fullmatch(r"\s*sm_?(\d+)(\d)\s*", value, flags=re.IGNORECASE)
        if m:
            return int(m.group(1)), int(m.group(2))
    raise BuildError(f"compute capability {value!r} is not understood; write it as '8.9' (or 'sm_89', or (8, 9))")


def format_compute_capability(cc: tuple[int, int]) -> str:
    """``(9, 0)`` -> ``"9.0"`` (the form the manifest stores)."""
    return f"{cc[0]}.{cc[1]}"


def version_tuple(version: str) -> tuple[int, ...]:
    """``"10.8.0.43"`` -> ``(10, 8, 0, 43)``; non-numeric suffixes (``"10.9.0.34+cuda12"``) are dropped."""
    parts: list[int] = []
    for piece in version.split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group(0)))
        if m.end() != len(piece):
            break
    return tuple(parts)


def check_precision_supported(flags: Iterable[str], compute_capability: str | tuple[int, int]) -> None:
    """Refuse precision flags this GPU has no kernels for; call it before parsing or building anything.

    Args:
        flags: builder precision flags, lower case ("fp16", "bf16", "int8", "fp8").
        compute_capability: the build GPU's, e.g. "8.6".

    Raises:
        BuildError: naming the flag, the GPU's compute capability, the minimum and the fix.
    """
    cc = parse_compute_capability(compute_capability)
    for flag in flags:
        need = PRECISION_MIN_COMPUTE_CAPABILITY.get(flag)
        if need is not None and cc < need:
            raise BuildError(
                f"precision {flag} needs a GPU of compute capability >= {format_compute_capability(need)} "
                f"({_ARCH[flag]}) but this GPU is {format_compute_capability(cc)}; build on such a GPU or use "
                "--precision fp16"
            )


# -- plan compatibility (runtime) ---------------------------------------------------------------------


@dataclass(frozen=True)
class TrtHost:
    """What this machine offers: the facts a plan is checked against.

    Attributes:
        tensorrt: ``tensorrt.__version__``, e.g. "10.8.0.43".
        compute_capability: "9.0".
        gpu: device name, e.g. "NVIDIA H200" (informational: same compute capability loads).
    """

    tensorrt: str
    compute_capability: str
    gpu: str = ""


def check_plan_compat(build: Mapping[str, Any], host: TrtHost, where: str) -> list[str]:
    """Compare a plan's build facts with this host, before anything is deserialised.

    Rules: TensorRT major.minor.patch must be equal (a plan embeds its library version and TensorRT
    refuses others); the compute capability must be equal (kernels are compiled per SM). A different
    build number, or another GPU model of the same compute capability, only warns (tactics were timed on
    the other one).

    Args:
        build: the manifest component's ``build`` facts (``tensorrt``, ``compute_capability``, ``gpu``).
        host: this machine's facts.
        where: what is loaded, for messages ("engine 'unet' (unet/model.plan)").

    Returns:
        Warnings (already logged).

    Raises:
        ArtifactError: missing facts or a mismatch; the message names the manifest's value and this
            machine's, and the fix (rebuild here, or run where it was built).
    """
    try:
        built_trt = str(build["tensorrt"])
        built_cc = str(build["compute_capability"])
    except (KeyError, TypeError):
        raise ArtifactError(
            f"{where}: the manifest's build facts lack 'tensorrt' or 'compute_capability' ({dict(build or {})!r}); "
            "recompile the artifact with this diffusion-trt version"
        ) from None
    warnings: list[str] = []
    built_v, host_v = version_tuple(built_trt), version_tuple(host.tensorrt)
    if built_v[:3] != host_v[:3]:
        raise ArtifactError(
            f"{where} was built with TensorRT {built_trt} but this machine has TensorRT {host.tensorrt}; "
            f"plans only load on the TensorRT release that built them: install tensorrt=={built_trt} or "
            "recompile the artifact here (`diffusion-trt compile --backend tensorrt`)"
        )
    if built_v != host_v:
        warnings.append(f"{where} was built with TensorRT {built_trt}, this machine has {host.tensorrt} (same release)")
    if parse_compute_capability(built_cc) != parse_compute_capability(host.compute_capability):
        raise ArtifactError(
            f"{where} was built for compute capability {built_cc} ({build.get('gpu', 'unknown GPU')}) but this "
            f"GPU is {host.compute_capability} ({host.gpu or 'unknown GPU'}); TensorRT plans are specific to the "
            "GPU architecture: recompile the artifact on this GPU or run it on a "
            f"{built_cc} GPU"
        )
    built_gpu = build.get("gpu")
    if built_gpu and host.gpu and built_gpu != host.gpu:
        warnings.append(
            f"{where} was built on {built_gpu} and runs on {host.gpu} (same compute capability {built_cc}): "
            "it loads, but its tactics were timed on the other GPU; recompile here for best speed"
        )
    for w in warnings:
        logger.warning("%s", w)
    return warnings


def check_host(lib: TrtLibrary, build: Mapping[str, Any], host: TrtHost, where: str) -> list[str]:
    """Can ``host`` load this plan? The one check the engine and ``verify`` run, before anything is deserialised.

    Full TensorRT (``lib.compute_capability_targets`` false): :func:`check_plan_compat` (the plan's one compute
    capability and release). A library that builds for named targets (TensorRT-RTX): first
    :meth:`TrtLibrary.check_runs_on` against ``build["compute_capabilities"]`` (so a GPU the library does not
    support is refused with that reason even where the library is missing), then the release: major.minor.patch
    equal (an RTX plan "does not guarantee forward compatibility": one build per release), another build number
    warns.

    Args:
        lib: the artifact's library (``library(manifest["backend"])``).
        build: the component's ``build`` facts.
        host: this machine's (or a target's) library version and GPU; ``tensorrt`` may be "" when only the
            compute capability is to be checked (the library is not importable here).
        where: what is loaded, for messages.

    Returns:
        Warnings (already logged).

    Raises:
        ArtifactError: naming the manifest's value, this machine's, and the fix.
    """
    if not lib.compute_capability_targets:
        return check_plan_compat(build, host, where)
    targets = build.get("compute_capabilities")
    lib.check_runs_on(host.compute_capability, targets if isinstance(targets, list) else None, host.gpu, where)
    built = build.get("tensorrt")
    if not isinstance(built, str) or not version_tuple(built):
        raise ArtifactError(
            f"{where}: the manifest's build facts lack the {lib.display} version ('tensorrt'); recompile the artifact "
            "with this diffusion-trt version"
        )
    warnings: list[str] = []
    if host.tensorrt:
        built_v, host_v = version_tuple(built), version_tuple(host.tensorrt)
        if built_v[:3] != host_v[:3]:
            raise ArtifactError(
                f"{where} was built with {lib.display} {built} but this machine has {lib.display} {host.tensorrt}; "
                f"its plans load only on the release that built them: install {lib.display} {built} ({lib.install}) "
                f"or recompile the artifact (`diffusion-trt compile --backend {lib.backend}`)"
            )
        if built_v != host_v:
            warnings.append(f"{where} was built with {lib.display} {built}, this machine has {host.tensorrt} "
                            "(same release)")
    for w in warnings:
        logger.warning("%s", w)
    return warnings


# -- timing cache ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimingCacheKey:
    """What a TensorRT timing cache is valid for: one TensorRT release on one GPU architecture.

    Attributes:
        tensorrt: full ``tensorrt.__version__`` ("10.8.0.43").
        compute_capability: "9.0".
    """

    tensorrt: str
    compute_capability: str

    def __post_init__(self) -> None:
        if not version_tuple(self.tensorrt):
            raise BuildError(f"TensorRT version {self.tensorrt!r} is not of the form 10.8.0.43")
        parse_compute_capability(self.compute_capability)

    @property
    def filename(self) -> str:
        """File name inside the cache folder: ``trt-10.8.0.43_sm90.timing-cache``.

        Only ``[0-9A-Za-z._-]`` survive from the version, so the name is safe on every file system.
        """
        version = re.sub(r"[^0-9A-Za-z._-]", "_", self.tensorrt)
        major, minor = parse_compute_capability(self.compute_capability)
        return f"trt-{version}_sm{major}{minor}.timing-cache"

    def to_json(self) -> dict[str, str]:
        return {"tensorrt": self.tensorrt, "compute_capability": self.compute_capability}


def pack_framed(magic: bytes, fmt: int, key: Mapping[str, Any], payload: bytes) -> bytes:
    """Frame a library's serialized cache (timing cache, TensorRT-RTX runtime cache) with its key and checksum.

    Layout: ``magic``, uint32 little-endian header length, JSON header ``{"format", **key, "sha256", "size"}``, then
    ``payload`` as the library wrote it.
    """
    header = json.dumps(
        {"format": fmt, **key, "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}, sort_keys=True
    ).encode()
    return magic + _LEN.pack(len(header)) + header + bytes(payload)


def unpack_framed(data: bytes, magic: bytes, fmt: int, what: str,
                  key: Mapping[str, Any]) -> tuple[bytes | None, dict[str, Any] | str]:
    """The payload of a file written by :func:`pack_framed`, if its header holds ``key``.

    The file is untrusted (a user's cache folder): a header longer than :data:`MAX_FRAME_HEADER_BYTES` is not parsed,
    and the header is parsed by :func:`~diffusion_trt.artifact.values.parse_json` (bounded nesting and integers, no
    NaN), so no content raises.

    Returns:
        ``(payload, header)`` when usable; else ``(None, reason)``: not such a file (bad magic), truncated, an
        unreadable or oversized header, another format, checksum mismatch — or ``(None, header)`` when only the key
        differs (the caller words that reason, naming both keys; :func:`printable` its values).
    """
    if not data.startswith(magic):
        return None, f"not a diffusion-trt {what} (bad magic)"
    rest = data[len(magic) :]
    if len(rest) < _LEN.size:
        return None, "truncated header"
    (n,) = _LEN.unpack_from(rest)
    if n > MAX_FRAME_HEADER_BYTES:
        return None, f"a header of {n} bytes (ours are under {MAX_FRAME_HEADER_BYTES}): not a {what} this wrote"
    raw = rest[_LEN.size : _LEN.size + n]
    if len(raw) != n:
        return None, "truncated header"
    try:
        header = parse_json(raw, "the header")
    except ArtifactError as e:
        return None, f"unreadable header ({str(e).split('; ')[0].removeprefix('the header ')})"
    if not isinstance(header, dict) or header.get("format") != fmt:
        found = header.get("format") if isinstance(header, dict) else header
        return None, f"format {printable(found)} != {fmt}"
    if any(header.get(k) != v for k, v in key.items()):
        return None, header
    payload = rest[_LEN.size + n :]
    if len(payload) != header.get("size") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        return None, "payload checksum mismatch (truncated or altered file)"
    return payload, header


def printable(value: Any, limit: int = 80) -> str:
    """``value`` read from an untrusted file, safe for a log line: control characters escaped, at most ``limit``
    characters (``str`` of other values)."""
    text = str(value)
    if not text.isprintable():
        text = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def read_cache_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of a cache file that anyone with write access to the cache folder may have replaced: opened with
    ``O_NOFOLLOW | O_NONBLOCK`` (a symbolic link is refused, a FIFO does not block), required to be a regular file
    (not a device such as ``/dev/zero``, a FIFO or a folder) of at most ``limit`` bytes, and read with that bound
    (a file growing while it is read is refused too).

    Raises:
        FileNotFoundError: no file there (the caller's "no cache yet").
        OSError: anything else; its ``strerror`` (the system's own errors: no permission, I/O error) or, for ours,
            its text says why: a symbolic link, not a regular file, over ``limit``.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and Path(path).is_symlink():
            raise OSError("it is a symbolic link, which is not followed (replace it with the file itself)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"it is not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_size > limit:
            raise OSError(f"it has {st.st_size} bytes, more than the {limit} a cache may have")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(f"it grew past {limit} bytes while it was read")
    return data


def pack_timing_cache(key: TimingCacheKey, payload: bytes) -> bytes:
    """Frame a serialized TensorRT timing cache with its key and checksum (:func:`pack_framed`)."""
    return pack_framed(TIMING_CACHE_MAGIC, TIMING_CACHE_FORMAT, key.to_json(), payload)


def unpack_timing_cache(data: bytes, key: TimingCacheKey) -> tuple[bytes | None, str | None]:
    """The TensorRT payload of a file written by :func:`pack_timing_cache`, if it was made for ``key``.

    Returns:
        ``(payload, None)`` when usable, else ``(None, reason)``: not a cache file, truncated, corrupt
        (checksum), another format, or another TensorRT version / compute capability. The caller ignores
        the file with a warning and builds with a fresh cache.
    """
    payload, header = unpack_framed(data, TIMING_CACHE_MAGIC, TIMING_CACHE_FORMAT, "timing cache", key.to_json())
    if payload is not None:
        return payload, None
    if isinstance(header, str):
        return None, header
    return None, (
        f"made for TensorRT {header.get('tensorrt')} on compute capability {header.get('compute_capability')}, this "
        f"build is TensorRT {key.tensorrt} on {key.compute_capability}"
    )


# -- glue shared by the builder and the runtime (given the tensorrt module; never importing it) ---------


def gpu_facts(device_id: int = 0) -> TrtHost | None:
    """Name and compute capability of CUDA device ``device_id`` (through torch), or ``None`` without CUDA.

    ``tensorrt`` is left empty: the ``*_trt.py`` caller fills it from ``tensorrt.__version__``.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device_id)
    return TrtHost(tensorrt="", compute_capability=f"{major}.{minor}", gpu=torch.cuda.get_device_name(device_id))


_TRT_LOGGERS: dict[str, Any] = {}


def make_trt_logger(trt: Any, keep_errors: int = 20) -> Any:
    """The process's one ``trt.ILogger`` for the library ``trt`` (``tensorrt`` or ``tensorrt_rtx_bindings``), shared
    by its builders (Polygraphy's loaders take it as their TensorRT logger: ``build_trt.polygraphy_for``), runtimes
    and refitters, forwarding to Python logging (``logging.getLogger(trt.__name__)``).

    One instance per library: TensorRT-RTX 1.7.1 warns, when a ``Runtime`` is created with another logger while a
    ``Builder`` lives, that "the current new logger is ignored" (observed). TensorRT's INFO is chatty (every
    tactic), so it maps to DEBUG; VERBOSE too. The last ``keep_errors`` ERROR / INTERNAL_ERROR messages are kept in
    ``.errors``; an operation that quotes them takes :meth:`mark` first and reads :meth:`errors_since` (so a failed
    load never quotes the errors of an earlier one). ``.name`` is the Python logger's name, for messages.

    Args:
        trt: the imported library module (only ``*_trt.py`` modules import it).
    """
    name = str(trt.__name__).split(".")[0]
    if name in _TRT_LOGGERS:
        return _TRT_LOGGERS[name]
    log = logging.getLogger(name)
    sev = trt.ILogger.Severity
    levels = {
        sev.INTERNAL_ERROR: logging.CRITICAL,
        sev.ERROR: logging.ERROR,
        sev.WARNING: logging.WARNING,
        sev.INFO: logging.DEBUG,
        sev.VERBOSE: logging.DEBUG,
    }

    class _Logger(trt.ILogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.name = name
            self.errors: list[str] = []
            self.logged = 0  # errors ever logged: marks count from it

        def log(self, severity: Any, msg: str) -> None:
            if severity in (sev.INTERNAL_ERROR, sev.ERROR):
                self.errors = [*self.errors[-(keep_errors - 1) :], msg]
                self.logged += 1
            log.log(levels.get(severity, logging.INFO), "%s", msg)

        def mark(self) -> int:
            """A point to quote errors from (:meth:`errors_since`)."""
            return self.logged

        def errors_since(self, mark: int) -> list[str]:
            """The errors logged after ``mark`` (the last ``keep_errors`` of them), oldest first."""
            n = self.logged - mark
            return self.errors[-n:] if n > 0 else []

    _TRT_LOGGERS[name] = _Logger()
    return _TRT_LOGGERS[name]


def quote_errors(trt_logger: Any, mark: int, limit: int = 3) -> str:
    """The library's errors since ``mark`` for a message: the first ``limit`` (the cause comes first; later ones are
    often its consequences), and how many more; or that none was logged and where to look."""
    errors = trt_logger.errors_since(mark)
    if not errors:
        return f"no error logged (enable DEBUG logging of {trt_logger.name!r} for its other messages)"
    more = max(len(errors), trt_logger.logged - mark) - limit
    return " | ".join(errors[:limit]) + (f" | and {more} more (DEBUG logging of {trt_logger.name!r} shows them)"
                                         if more > 0 else "")


def assign(obj: Any, attr: str, value: Any, trt_logger: Any = None) -> str | None:
    """``obj.<attr> = value``, and whether the library took it: ``None`` when it did, else why not (for a message).

    The C++ setters behind ``IRuntimeConfig.cuda_graph_strategy`` and ``ICudaEngine.weight_streaming_budget_v2``
    return ``bool``, and their Python docstrings say ``(arg0, arg1) -> bool``, but a pybind11 property setter's
    result never reaches Python: with tensorrt_rtx_bindings 1.7.1.116, ``fset`` returns ``None`` even for a refused
    value (observed on ``Runtime.max_threads = 0`` and a bad ``IEinsumLayer.equation``, both ``-> bool``). What a
    refusal does leave (observed on both): an error the library logs, and the old value still read back. So the
    setting is refused when ``trt_logger`` (the library's, :func:`make_trt_logger`) got an error during the
    assignment, or when the attribute still reads its old value instead of ``value`` (a value the library adjusted
    to another one counts as taken).
    """
    before = getattr(obj, attr, None)
    mark = trt_logger.mark() if trt_logger is not None else 0
    setattr(obj, attr, value)
    if trt_logger is not None and trt_logger.errors_since(mark):
        return quote_errors(trt_logger, mark)
    after = getattr(obj, attr, None)
    if after != value and after == before:
        return f"it still reads {printable(getattr(after, 'name', after))}"
    return None
