"""Issue 27: every TensorRT / TensorRT-RTX call checked, every message true, one test per item.

Two kinds of test, both on a machine without a GPU:

* **real calls** (marked ``rtx_builder``): NVIDIA's ``tensorrt_rtx_bindings`` 1.7.1.116 builds plans and creates
  ``Runtime``s here, and ``get_engine_validity`` / ``deserialize_cuda_engine`` run (and fail, for want of a GPU);
  items 3 and 4 are shown with those, and the fakes below are held to the real classes' names and signatures;
* **fakes where a GPU is needed** (items 1, 2, 5, 6): a deserialised engine, its runtime configs and contexts exist
  only on a GPU TensorRT-RTX supports. :class:`FakeEngine` and its companions have only methods and properties the
  real classes have (checked by ``test_the_fakes_only_use_the_real_api``), return ``False`` / ``None`` where the
  real method returns ``bool`` / may return null, and refuse a property the way the real binding was seen to
  (``test_a_refused_setting_shows_as_the_real_binding_shows_it``): the setter's ``bool`` never reaches Python; the
  library logs an error and keeps the old value. The engine is opened through the real ``TrtEngine._open`` with the
  real library module, whose ``Runtime`` alone is replaced.

What only a supported GPU can prove is listed in the closing note of issue 27 (deserialising, contexts, the runtime
config and cache, WHOLE_GRAPH_CAPTURE across activation-memory moves).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from diffusion_trt import trt_compat
from diffusion_trt.compiler import build_trt
from diffusion_trt.compiler.build_trt import TrtBuildConfig
from diffusion_trt.config import CompileConfig
from diffusion_trt.errors import ArtifactError, RuntimeInputError
from diffusion_trt.runtime.engines import runtime_cache as rc
from diffusion_trt.runtime.engines.trt_engine import SharedActivationMemory, TrtEngine
from diffusion_trt.runtime.engines.trt_memory import engine_memory_facts
from tests.graphs import make_model, tensor_info

VERSION = "1.7.1.116"
#: y[B,4] = relu(x): one dynamic profile (B 1..4) and the static one at B=2
ENTRY: dict[str, Any] = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": ["B", 4], "min": [1, 4], "opt": [2, 4], "max": [4, 4]}],
    "outputs": [{"name": "y", "dtype": "float32", "shape": ["B", 4], "min": [1, 4], "opt": [2, 4], "max": [4, 4]}],
}
PROFILES = [((1, 4), (2, 4), (4, 4)), ((2, 4), (2, 4), (2, 4))]  # dynamic, static
BUILD: dict[str, Any] = {
    "engine": "tensorrt-rtx", "library": "tensorrt-rtx", "tensorrt": VERSION, "compute_capabilities": ["8.9"],
    "compute_capability": None, "gpu": None, "runtime_cache": "unet.runtime-cache",
    "profiles": [{"kind": k, "inputs": {"x": {"min": list(lo), "opt": list(o), "max": list(hi)}}}
                 for k, (lo, o, hi) in zip(("dynamic", "static"), PROFILES, strict=True)],
}
RTX_GPU = trt_compat.TrtHost("", "8.9", "NVIDIA GeForce RTX 4090")


@pytest.fixture
def trt() -> Any:
    return pytest.importorskip("tensorrt_rtx_bindings")


# --- fakes of what exists only on a supported GPU -----------------------------------------------------------------


class FakeStream:
    cuda_stream = 0x5100

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


class FakeRuntimeCache:  # IRuntimeCache
    def __init__(self) -> None:
        self.loaded: bytes | None = None

    def deserialize(self, blob: bytes) -> bool:
        self.loaded = bytes(blob)
        return True

    def serialize(self) -> bytes:
        return b"kernels compiled here"


def _refusal(owner: FakeEngine, what: str) -> None:
    """What the real binding does with a refused property value (seen on Runtime.max_threads): an API usage error
    through the library's logger (unless the fake is told to stay silent) and the old value kept."""
    if owner.log_refusals:
        trt_compat.make_trt_logger(owner._trt).log(owner._trt.ILogger.Severity.ERROR,
                                                   f"{what}: Error Code 3: API Usage Error (the fake's refusal)")


class FakeRuntimeConfig:  # IRuntimeConfig
    def __init__(self, owner: FakeEngine) -> None:
        self._owner = owner
        self._graph: Any = None
        self._dyn: Any = None
        self.caches: list[Any] = []

    def set_execution_context_allocation_strategy(self, strategy: Any) -> None:
        self.allocation = strategy

    @property
    def dynamic_shapes_kernel_specialization_strategy(self) -> Any:
        return self._dyn

    @dynamic_shapes_kernel_specialization_strategy.setter
    def dynamic_shapes_kernel_specialization_strategy(self, value: Any) -> None:  # binding: -> None
        self._dyn = value

    @property
    def cuda_graph_strategy(self) -> Any:
        return self._graph

    @cuda_graph_strategy.setter
    def cuda_graph_strategy(self, value: Any) -> None:  # C++ -> bool, which the binding's setter drops
        if value.name in self._owner.refuse_graph:
            _refusal(self._owner, "IRuntimeConfig::setCudaGraphStrategy")
            return
        self._graph = value

    def create_runtime_cache(self) -> FakeRuntimeCache | None:  # nullptr -> None
        return None if self._owner.no_cache else FakeRuntimeCache()

    def set_runtime_cache(self, cache: Any) -> bool:
        self.caches.append(cache)
        return True


class FakeContext:  # IExecutionContext
    def __init__(self, owner: FakeEngine, config: FakeRuntimeConfig) -> None:
        self._owner = owner
        self.config = config
        self.addresses: dict[str, int] = {}
        self.runs = 0

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        return True

    def set_input_shape(self, name: str, shape: Any) -> bool:
        return True

    def set_device_memory(self, memory: int, size: int) -> None:
        pass

    def set_tensor_address(self, name: str, memory: int) -> bool:  # binding: -> bool
        if name in self._owner.refuse_address:
            return False
        self.addresses[name] = memory
        return True

    def execute_async_v3(self, stream: int) -> bool:
        self.runs += 1
        return True


class FakeEngine:  # ICudaEngine, with the attributes TensorRT-RTX 1.7.1's has (no device_memory_size)
    num_io_tensors = 2
    num_optimization_profiles = 2
    refittable = True

    def __init__(self, trt: Any, *, refuse_graph: tuple[str, ...] = (), refuse_address: tuple[str, ...] = (),
                 no_cache: bool = False, streamable: int = 0, refuse_budget: bool = False,
                 log_refusals: bool = True) -> None:
        self._trt = trt
        self.refuse_graph, self.refuse_address, self.no_cache = refuse_graph, refuse_address, no_cache
        self.log_refusals = log_refusals
        self.streamable_weights_size = streamable
        self._budget, self._refuse_budget = -1, refuse_budget
        self.configs: list[FakeRuntimeConfig] = []
        self.contexts: list[FakeContext] = []

    def get_tensor_name(self, i: int) -> str:
        return ("x", "y")[i]

    def get_tensor_mode(self, name: str) -> Any:
        return self._trt.TensorIOMode.INPUT if name == "x" else self._trt.TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> Any:
        return self._trt.DataType.FLOAT

    def is_shape_inference_io(self, name: str) -> bool:
        return False

    def get_tensor_profile_shape(self, name: str, index: int) -> list[tuple[int, ...]]:
        return list(PROFILES[index])

    def get_device_memory_size_for_profile_v2(self, index: int) -> int:
        return 1024

    device_memory_size_v2 = 1024

    @property
    def weight_streaming_budget_v2(self) -> int:
        return self._budget

    @weight_streaming_budget_v2.setter
    def weight_streaming_budget_v2(self, value: int) -> None:  # C++ -> bool, which the binding's setter drops
        if self._refuse_budget:
            _refusal(self, "ICudaEngine::setWeightStreamingBudgetV2")
            return
        self._budget = value

    def create_runtime_config(self) -> FakeRuntimeConfig:
        self.configs.append(FakeRuntimeConfig(self))
        return self.configs[-1]

    def create_execution_context(self, config: FakeRuntimeConfig) -> FakeContext:
        self.contexts.append(FakeContext(self, config))
        return self.contexts[-1]


class FakeRefitter:  # Refitter
    def __init__(self, engine: Any, logger: Any) -> None:
        self.weights: dict[str, Any] = {}

    def set_named_weights(self, name: str, weights: Any) -> bool:
        self.weights[name] = weights
        return True

    def get_missing_weights(self) -> list[str]:  # as if TensorRT fused a weight "fused" with the others
        return [] if "fused" in self.weights else ["fused"]

    def refit_cuda_engine(self) -> bool:
        return True


def test_the_fakes_only_use_the_real_api(trt: Any) -> None:
    """Every public name a fake defines exists on the real class; the calls this issue is about are what the fakes
    mimic: two property setters whose C++ ``bool`` is documented (and dropped, see the next test), a
    ``set_tensor_address`` that returns ``bool``, a ``create_runtime_cache`` returning an object (``None`` when null);
    RTX 1.7.1's engine has ``device_memory_size_v2`` but no ``device_memory_size``."""
    pairs = [(FakeRuntimeCache, trt.IRuntimeCache), (FakeRuntimeConfig, trt.IRuntimeConfig),
             (FakeContext, trt.IExecutionContext), (FakeEngine, trt.ICudaEngine), (FakeRefitter, trt.Refitter)]
    own = {"caches", "config", "addresses", "runs", "configs", "contexts", "loaded", "allocation", "weights",
           "refuse_graph", "refuse_address", "no_cache", "log_refusals"}
    for fake, real in pairs:
        names = {n for n in vars(fake) if not n.startswith("_")} - own
        assert names <= set(dir(real)), (fake.__name__, sorted(names - set(dir(real))))
    assert trt.IRuntimeConfig.cuda_graph_strategy.fset.__doc__.strip().endswith("-> bool")
    assert trt.ICudaEngine.weight_streaming_budget_v2.fset.__doc__.strip().endswith("-> bool")
    assert trt.IExecutionContext.set_tensor_address.__doc__.splitlines()[0].endswith("-> bool")
    assert trt.IRuntimeConfig.create_runtime_cache.__doc__.splitlines()[0].endswith("-> nvinfer1::IRuntimeCache")
    assert hasattr(trt.ICudaEngine, "device_memory_size_v2") and not hasattr(trt.ICudaEngine, "device_memory_size")


@pytest.mark.rtx_builder
def test_a_refused_setting_shows_as_the_real_binding_shows_it(trt: Any) -> None:
    """Real calls, no GPU: ``Runtime.max_threads`` and ``IEinsumLayer.equation`` have setters documented ``-> bool``
    like ``cuda_graph_strategy``; refused, ``fset`` still returns ``None`` (pybind11 drops a setter's result), the
    library logs an error and the old value stays. ``trt_compat.assign`` reads exactly that."""
    logger = trt_compat.make_trt_logger(trt)
    runtime = trt.Runtime(logger)
    assert trt.Runtime.max_threads.fset.__doc__.strip().endswith("-> bool")
    assert trt_compat.assign(runtime, "max_threads", 2, logger) is None and runtime.max_threads == 2
    assert trt.Runtime.max_threads.fset(runtime, 0) is None  # refused, and no False comes back
    refused = trt_compat.assign(runtime, "max_threads", 0, logger)
    assert refused is not None and "maxThreads > 0" in refused and runtime.max_threads == 2
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    einsum = network.add_einsum([network.add_input("x", trt.float32, (2, 2))], "ij->ji")
    assert trt_compat.assign(einsum, "equation", "ij->ij", logger) is None and einsum.equation == "ij->ij"
    refused = trt_compat.assign(einsum, "equation", "ij->k", logger)
    assert refused is not None and "subscript k" in refused and einsum.equation == "ij->ij"
    # without the logger, the value read back still tells
    assert trt_compat.assign(runtime, "max_threads", -1) == "it still reads 2"


def _on_fake(trt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: FakeEngine,
             **kwargs: Any) -> TrtEngine:
    """A ``TrtEngine`` that opens (``with``) through the real ``_open`` and library module onto ``engine``: only
    ``Runtime`` (and ``Refitter``) is replaced, by one returning it; torch's CUDA calls by CPU stand-ins."""
    stream = FakeStream()

    class FakeRuntime:
        def __init__(self, logger: Any) -> None:
            self.logger = logger

        def get_engine_validity(self, plan: bytes) -> tuple[Any, int]:
            return trt.EngineValidity.VALID, 0

        def deserialize_cuda_engine(self, plan: bytes) -> FakeEngine:
            return engine

    monkeypatch.setattr(trt, "Runtime", FakeRuntime)
    monkeypatch.setattr(trt, "Refitter", FakeRefitter)
    monkeypatch.setattr(trt_compat, "gpu_facts", lambda device_id=0: RTX_GPU)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    plan = tmp_path / "unet" / "model.plan"
    plan.parent.mkdir(exist_ok=True)
    plan.write_bytes(b"a plan: only the fake runtime reads it")
    eng = TrtEngine(plan, {**ENTRY, "build": BUILD}, name="unet", backend="tensorrt-rtx", verify=False,
                    shared_memory=SharedActivationMemory("cpu"), **kwargs)
    eng._device = torch.device("cpu")  # buffers on the CPU; the fakes never read them
    return eng


# --- item 1: return values read ----------------------------------------------------------------------------------


def test_1_a_refused_cuda_graph_strategy_is_an_error_naming_it(trt: Any, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine(trt, refuse_graph=("WHOLE_GRAPH_CAPTURE",))
    with pytest.raises(ArtifactError) as e:
        _on_fake(trt, tmp_path, monkeypatch, engine).__enter__()
    msg = str(e.value)
    assert msg.startswith(f"engine 'unet' ({tmp_path / 'unet' / 'model.plan'}): TensorRT-RTX refused "
                          "CudaGraphStrategy.WHOLE_GRAPH_CAPTURE for optimization profile 1 (static) "
                          "(IRuntimeConfig::setCudaGraphStrategy: Error Code 3: API Usage Error (the fake's refusal))")
    assert msg.endswith("; load it without CUDA graphs (cuda_graph=False, --no-cuda-graph)") and "\n" not in msg
    assert len(engine.contexts) == 1  # profile 0 (DISABLED) was taken; nothing was created for profile 1
    silent = FakeEngine(trt, refuse_graph=("WHOLE_GRAPH_CAPTURE",), log_refusals=False)  # the value read back tells
    with pytest.raises(ArtifactError, match=r"for optimization profile 1 \(static\) \(it still reads None\)"):
        _on_fake(trt, tmp_path, monkeypatch, silent).__enter__()
    with _on_fake(trt, tmp_path, monkeypatch, FakeEngine(trt, refuse_graph=("WHOLE_GRAPH_CAPTURE",)),
                  cuda_graphs=False) as ok:  # the fix the message names
        assert ok.is_open


def test_1_a_refused_weight_streaming_budget_is_an_error_naming_it(trt: Any, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine(trt, streamable=4096, refuse_budget=True)
    with pytest.raises(ArtifactError, match=r"^engine 'unet' \(.*\): TensorRT-RTX refused a weight-streaming budget "
                                            r"of 1000 bytes \(of 4096 streamable: ICudaEngine::setWeightStreaming"
                                            r"BudgetV2: Error Code 3: API Usage Error \(the fake's refusal\)\); give"):
        _on_fake(trt, tmp_path, monkeypatch, engine, weight_streaming_budget=1000).__enter__()
    assert engine.contexts == []  # refused before any execution context
    taken = FakeEngine(trt, streamable=4096)
    with _on_fake(trt, tmp_path, monkeypatch, taken, weight_streaming_budget=1000) as eng:
        assert taken.weight_streaming_budget_v2 == 1000 and eng.is_open


def test_1_a_refused_tensor_address_is_an_error_naming_the_tensor(trt: Any, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine(trt, refuse_address=("y",))
    with _on_fake(trt, tmp_path, monkeypatch, engine) as eng:
        for batch, profile in ((2, 1), (3, 0)):  # the static profile (owned input buffers) and the dynamic one
            with pytest.raises(RuntimeError) as e:
                eng.run({"x": torch.ones(batch, 4)})
            msg = str(e.value)
            assert msg.startswith("engine 'unet': TensorRT-RTX refused the address 0x")
            assert f"of tensor 'y' (torch.float32 ({batch}, 4)) on profile {profile}: no error logged" in msg
        assert all(ctx.runs == 0 for ctx in engine.contexts)  # nothing was enqueued on a wrong address
    fine = FakeEngine(trt)
    with _on_fake(trt, tmp_path, monkeypatch, fine) as eng:
        out = eng.run({"x": torch.ones(2, 4)})["y"]
        assert fine.contexts[1].addresses["y"] == out.data_ptr() and fine.contexts[1].runs == 1


# --- item 2: create_runtime_cache may return None ----------------------------------------------------------------


def test_2_no_runtime_cache_from_the_library_is_a_warning_and_the_file_is_left_alone(
    trt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "rc" / "unet.runtime-cache"
    key = rc.RuntimeCacheKey("tensorrt-rtx", VERSION, RTX_GPU.compute_capability, RTX_GPU.gpu)
    assert rc.save_runtime_cache(cache, key, b"kernels of an earlier run", "engine 'unet'")
    before = cache.read_bytes()
    engine = FakeEngine(trt, no_cache=True)
    with caplog.at_level(logging.WARNING, logger="diffusion_trt.runtime.engines.trt_engine"):
        with _on_fake(trt, tmp_path, monkeypatch, engine, runtime_cache=cache) as eng:
            assert eng.is_open and len(engine.contexts) == 2
            eng.run({"x": torch.ones(2, 4)})
    assert caplog.text.count("TensorRT-RTX created no runtime cache") == 1  # asked once, not per context
    assert "kernels are compiled for this GPU at every load" in caplog.text
    assert all(config.caches == [] for config in engine.configs)  # no None handed to set_runtime_cache
    assert cache.read_bytes() == before
    with _on_fake(trt, tmp_path, monkeypatch, FakeEngine(trt), runtime_cache=cache):
        pass  # a library that makes one: loaded from the file, one cache for both contexts, saved on close
    assert rc.load_runtime_cache(cache, key, "engine 'unet'") == b"kernels compiled here"


# --- item 3: messages quote this operation's errors only ---------------------------------------------------------


def _plan_89(trt: Any, path: Path) -> None:
    """A real TensorRT-RTX plan for compute capability 8.9 (ENTRY's I/O), built here without a GPU."""
    logger = trt_compat.make_trt_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    x = network.add_input("x", trt.float32, (-1, 4))
    y = network.add_activation(x, trt.ActivationType.RELU).get_output(0)
    y.name = "y"
    network.mark_output(y)
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", *PROFILES[0])
    config.add_optimization_profile(profile)
    config.num_compute_capabilities = 1
    config.set_compute_capability(trt.ComputeCapability.SM89, 0)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, logger.errors
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(memoryview(plan)))


def _open_real(path: Path, caplog: pytest.LogCaptureFixture) -> tuple[str, list[str]]:
    """Open ``path`` with the real library (no GPU: it fails); the message and the errors it logged meanwhile."""
    caplog.clear()
    engine = TrtEngine(path, {**ENTRY, "build": {**BUILD, "profiles": BUILD["profiles"][:1]}}, name=path.parent.name,
                       backend="tensorrt-rtx", verify=False)
    with caplog.at_level(logging.ERROR, logger="tensorrt_rtx_bindings"), pytest.raises(ArtifactError) as e:
        engine.__enter__()
    return str(e.value), [r.getMessage() for r in caplog.records if r.name == "tensorrt_rtx_bindings"]


@pytest.fixture
def no_gpu_rtx(trt: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    if torch.cuda.is_available():
        pytest.skip("these tests use the library's failures on a machine without a GPU")
    monkeypatch.setattr(trt_compat, "gpu_facts", lambda device_id=0: RTX_GPU)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return trt


@pytest.mark.rtx_builder
def test_3_a_failed_validity_check_quotes_its_own_errors_not_the_previous_engines(
    no_gpu_rtx: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Real calls: ``get_engine_validity`` of a real plan logs an error here (no GPU to read); of garbage, none."""
    _plan_89(no_gpu_rtx, tmp_path / "text_encoder" / "model.plan")
    first, first_errors = _open_real(tmp_path / "text_encoder" / "model.plan", caplog)
    assert first_errors and first_errors[0] in first  # the precondition: the first open logged an error
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "model.plan").write_bytes(b"garbage, not a plan" * 8)
    second, second_errors = _open_real(tmp_path / "unet" / "model.plan", caplog)
    assert second_errors == []
    assert "says the plan cannot run here (MALFORMED_ENGINE; no error logged (enable DEBUG logging of " \
           "'tensorrt_rtx_bindings' for its other messages))" in second
    assert not any(err in second for err in first_errors)


@pytest.mark.rtx_builder
def test_3_could_not_deserialize_quotes_this_engines_errors_from_the_first(
    no_gpu_rtx: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Real ``deserialize_cuda_engine`` (validity taken as VALID, as on a supported GPU): each message quotes the
    errors its own deserialisation logged, from the first, never the previous engine's last one."""
    trt = no_gpu_rtx

    class ValidRuntime(trt.Runtime):  # the real Runtime, whose validity check needs a GPU
        def get_engine_validity(self, plan: Any) -> tuple[Any, int]:
            return trt.EngineValidity.VALID, 0

    monkeypatch.setattr(trt, "Runtime", ValidRuntime)
    _plan_89(trt, tmp_path / "text_encoder" / "model.plan")
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "model.plan").write_bytes(b"garbage, not a plan" * 8)
    for name in ("text_encoder", "unet"):
        msg, errors = _open_real(tmp_path / name / "model.plan", caplog)
        assert errors, "deserialising without a GPU logs errors"
        head = f"TensorRT-RTX could not deserialize the plan: {' | '.join(errors[:3])}"
        assert head in msg and msg.endswith("; recompile it"), (msg, errors)


# --- item 4: one logger per library -------------------------------------------------------------------------------


def _relu_onnx(path: Path) -> Path:
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", ["B", 4])],
                       [tensor_info("y", ["B", 4])])
    onnx.save_model(model, str(path))
    return path


@pytest.mark.rtx_builder
def test_4_the_build_and_the_runtime_share_the_librarys_one_logger(
    no_gpu_rtx: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While a Builder lives, a Runtime with another logger makes TensorRT-RTX warn that the new logger "is ignored"
    (real calls); the build stage and the engine use the same one, so it never does."""
    trt = no_gpu_rtx
    builder, _network, _parser = build_trt.network_from_onnx(trt, _relu_onnx(tmp_path / "model.onnx"), True)
    assert builder.logger is trt_compat.make_trt_logger(trt)
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "model.plan").write_bytes(b"garbage, not a plan" * 8)
    with caplog.at_level(logging.WARNING):
        engine = TrtEngine(tmp_path / "unet" / "model.plan", {**ENTRY, "build": BUILD}, name="unet",
                           backend="tensorrt-rtx", verify=False)
        with pytest.raises(ArtifactError, match="MALFORMED_ENGINE"):
            engine.__enter__()  # the Runtime was created, then the garbage refused
    assert "differs from one already registered" not in caplog.text and "is ignored" not in caplog.text
    runtime = trt.Runtime(trt_compat.make_trt_logger(trt))
    assert runtime.logger is builder.logger
    del builder


# --- item 5: refit with a bfloat16 tensor --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (torch.zeros(4, 4, dtype=torch.bfloat16), "is a torch.bfloat16 tensor, which refit cannot hand to TensorRT"),
        (np.zeros((4, 4)), "(4, 4) float64: TensorRT-RTX has no weights type for float64"),
        (["a", "b"], "(2,) <U1: TensorRT-RTX has no weights type for <U1"),
    ],
    ids=["bfloat16", "float64", "strings"],
)
def test_5_refit_with_a_value_trt_cannot_take_is_the_documented_error(
    trt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: Any, said: str
) -> None:
    with _on_fake(trt, tmp_path, monkeypatch, FakeEngine(trt)) as eng:
        with pytest.raises(RuntimeInputError) as e:
            eng.refit({"w": value})
        assert str(e.value).startswith(f"engine 'unet': weight 'w' {said}"), str(e.value)
        assert "initializer's dtype" in str(e.value)
        with pytest.raises(RuntimeInputError, match=r"^engine 'unet': weight 'fused' "):
            eng.refit({"w": np.zeros((4, 4), np.float16)}, fill_missing=lambda names: {"fused": value})
        eng.refit({"w": torch.zeros(4, 4, dtype=torch.float16)},  # the initializer's dtype refits
                  fill_missing=lambda names: {n: np.zeros(4, np.float16) for n in names})


# --- item 6: memory sizes of a release without the older names ---------------------------------------------------


class OnlyV2:  # a release whose engine has dropped the older names (TensorRT-RTX 1.7.1 has no device_memory_size)
    device_memory_size_v2 = 0
    num_optimization_profiles = 1


class OnlyOld:  # TensorRT < 10.1
    device_memory_size = 4096


def test_6_memory_sizes_read_the_v2_name_first_and_keep_a_real_zero() -> None:
    assert TrtEngine._memory_size(OnlyV2(), 0) == 0
    assert engine_memory_facts(OnlyV2())["device_memory_bytes"] == 0
    assert TrtEngine._memory_size(OnlyOld(), 0) == 4096
    assert engine_memory_facts(OnlyOld())["device_memory_bytes"] == 4096
    with pytest.raises(ArtifactError, match="tells no activation-memory size"):
        TrtEngine._memory_size(object(), 0)


# --- item 7: refittable TensorRT-RTX through the lower level ------------------------------------------------------


def test_7_trt_build_config_refuses_a_refittable_rtx_build_as_compile_config_does() -> None:
    with pytest.raises(RuntimeInputError) as low:
        TrtBuildConfig(library="tensorrt-rtx", refittable=True)
    with pytest.raises(RuntimeInputError) as high:
        CompileConfig(backend="tensorrt-rtx", device="cuda", refittable=True)
    assert str(low.value) == str(high.value).replace("backend='tensorrt-rtx'", "library='tensorrt-rtx'")
    assert str(low.value).startswith("refittable=True with library='tensorrt-rtx': ")
    assert "--lora FILE[:SCALE]" in str(low.value)
    with pytest.raises(RuntimeInputError, match="library='tensorrt-rtx'"):
        TrtBuildConfig.from_json({**TrtBuildConfig(library="tensorrt-rtx").to_json(), "refittable": True})
    assert TrtBuildConfig(refittable=True).refittable  # full TensorRT still builds refittable plans
