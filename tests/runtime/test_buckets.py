"""Size buckets (runtime/engines/buckets.py): static sessions specialised per shape for a dynamic-profile ORT artifact.

The toy artifact (hand-built graphs) checks selection, preloading, fallback, limits and that nothing is written; the
compiled tiny pipeline checks that ORT really folds the shape arithmetic and that the images are the dynamic ones.
"""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from diffusion_trt.artifact.folder import read_manifest
from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.engines.buckets import (
    BucketedEngine,
    BucketTimings,
    SizeBuckets,
    parse_size_buckets,
    static_spec,
)
from diffusion_trt.runtime.engines.engine import EngineSpec
from diffusion_trt.runtime.engines.ort_engine import OrtEngine

FAST: dict[str, Any] = {"prompt": "a cat", "num_inference_steps": 2, "progress": False, "output_type": "np",
                        "seed": 3}


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("auto", None), ("512x512, 768X768,640x384", ((512, 512), (768, 768), (640, 384))), ("64x64,64x64", ((64, 64),))],
)
def test_parse_size_buckets(text: str, expected: Any) -> None:
    buckets = parse_size_buckets(text)
    assert buckets is not None and buckets.sizes == expected
    assert parse_size_buckets("off") is None and parse_size_buckets("None") is None and parse_size_buckets(None) is None


@pytest.mark.parametrize(("text", "piece"), [
    ("512", "--size-buckets: '512' in '512' is not HEIGHTxWIDTH with positive sides; use e.g. --size-buckets 512x512"),
    ("512x512,big", "'big'"), ("0x512", "positive sides"),
    ("", "size_buckets='' is empty; give 'auto', sizes HxW"), (" ", "is empty; .* or 'off' for no buckets")])
def test_parse_size_buckets_refuses(text: str, piece: str) -> None:
    with pytest.raises(RuntimeInputError, match=piece):
        parse_size_buckets(text)


def test_size_outside_the_profile_is_refused_at_load(toy_artifact: Path) -> None:
    """One cause per message: 512 was 'not a multiple of 8 inside the artifact's profile 32..128'."""
    with pytest.raises(RuntimeInputError, match=r"^size bucket 512x64: height 512 is outside the artifact's profile "
                                                r"32\.\.128; list sizes HxW that are multiples of 8 inside the profile "
                                                r"\(32\.\.128\), e\.g\. 64x64$"):
        EnginePipeline.from_artifacts(toy_artifact, size_buckets="512x64")
    with pytest.raises(RuntimeInputError, match=r"^size bucket 64x60: width 60 is not a multiple of 8; list sizes"):
        EnginePipeline.from_artifacts(toy_artifact, size_buckets="64x60")


def test_listed_sizes_are_preloaded_and_other_sizes_fall_back(toy_artifact: Path) -> None:
    before = _files(toy_artifact)
    with EnginePipeline.from_artifacts(toy_artifact) as plain:
        ref64 = plain(**FAST, height=64, width=64).images
        ref48 = plain(**FAST, height=48, width=80).images
    buckets = SizeBuckets(sizes=((64, 64),), background=False)
    with EnginePipeline.from_artifacts(toy_artifact, size_buckets=buckets) as pipe:
        unet, vae = pipe.engines["unet"], pipe.engines["vae_decoder"]
        assert isinstance(unet, BucketedEngine) and isinstance(vae, BucketedEngine)
        text = pipe.engines["text_encoder"]
        assert isinstance(text, BucketedEngine) and text.specialised_shapes == [{"B2": 2}]  # per batch, any size
        # opened while loading, at the opt batch (the UNet at the CFG batch 2)
        assert unet.specialised_shapes == [{"B2": 2, "h": 8, "w": 8}]
        assert vae.specialised_shapes == [{"B": 1, "h": 8, "w": 8}]
        assert not unet.dynamic_open
        out = pipe(**FAST, height=64, width=64).images
        assert unet.last_path == "static" and vae.last_path == "static" and not unet.dynamic_open
        np.testing.assert_allclose(out, ref64, atol=1e-5, rtol=0)
        out48 = pipe(**FAST, height=48, width=80).images  # in the profile, in no bucket: the dynamic session
        assert unet.last_path == "dynamic" and unet.dynamic_open
        np.testing.assert_allclose(out48, ref48, atol=1e-5, rtol=0)
        assert len(unet.specialised_shapes) == 1
    assert _files(toy_artifact) == before  # nothing written: no second copy of any weights


def test_auto_specialises_each_new_shape_up_to_the_limit(toy_artifact: Path) -> None:
    with EnginePipeline.from_artifacts(toy_artifact, size_buckets=SizeBuckets(max_shapes=2, background=False)) as pipe:
        unet = pipe.engines["unet"]
        assert unet.specialised_shapes == []  # auto: nothing until a call
        pipe(**FAST, height=64, width=64)
        pipe(**FAST, height=32, width=96)
        assert unet.specialised_shapes == [{"B2": 2, "h": 8, "w": 8}, {"B2": 2, "h": 4, "w": 12}]
        assert unet.last_path == "static"
        pipe(**FAST, height=64, width=64, num_images_per_prompt=2)  # a third shape (batch 2): over the limit
        assert unet.last_path == "dynamic" and len(unet.specialised_shapes) == 2
        pipe(**FAST, height=32, width=96)  # an old shape: its static session again
        assert unet.last_path == "static"


def _toy_unet(toy_artifact: Path) -> tuple[EngineSpec, OrtEngine]:
    spec = EngineSpec.from_manifest("unet", read_manifest(toy_artifact)["components"]["unet"])
    return spec, OrtEngine(toy_artifact / "unet" / "model.onnx", spec)


def _feeds(spec: EngineSpec, symbols: dict[str, int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {t.name: torch.randn(tuple(d if isinstance(d, int) else symbols[d] for d in t.shape), generator=gen)
            .to(t.torch_dtype) for t in spec.inputs}


def test_background_a_new_shape_runs_on_the_dynamic_session_until_its_static_one_is_ready(toy_artifact: Path) -> None:
    spec, base = _toy_unet(toy_artifact)
    gate, made = threading.Event(), []

    def make(s: EngineSpec, free: Any) -> Any:
        if free is None:
            return base
        assert gate.wait(30), "the test never opened the gate"
        made.append(dict(free))
        return base.variant(s, free_dimensions=free, cuda_graph=False)

    symbols = {"B2": 2, "h": 8, "w": 8}
    feeds = _feeds(spec, symbols)
    engine = BucketedEngine(spec, make, device=torch.device("cpu"), buckets=SizeBuckets(), latent_sizes=None,
                            prime=True)
    with engine:
        first = {k: v.clone() for k, v in engine.run(feeds).items()}  # no wait for a session: the dynamic one
        assert engine.last_path == "dynamic" and engine.dynamic_open
        assert engine.pending_shapes == [symbols] and engine.specialised_shapes == []
        engine.run(feeds)  # still being made: the dynamic session again, and no second request for it
        assert engine.last_path == "dynamic" and engine.pending_shapes == [symbols]
        gate.set()
        engine.settle()
        assert engine.specialised_shapes == [symbols] and engine.pending_shapes == [] and made == [symbols]
        again = engine.run(feeds)
        assert engine.last_path == "static"
        for name, value in first.items():
            torch.testing.assert_close(again[name], value, atol=1e-5, rtol=0)  # the same graph, fixed dimensions
        engine.run(feeds)
        timings = engine.timings.snapshot()
    assert not engine.dynamic_open and engine.specialised_shapes == []
    # where the seconds went: two dynamic runs, the static session made once, its first run counted once
    assert timings["dynamic_runs"] == 2 and timings["dynamic_run_s"] > 0
    assert list(timings["session_s"]) == ["dynamic", "B2=2, h=8, w=8"]  # the dynamic one opened while entering
    assert timings["session_s"]["B2=2, h=8, w=8"] > 0
    assert list(timings["first_static_run_s"]) == ["B2=2, h=8, w=8"]
    assert list(timings["prime_s"]) == ["B2=2, h=8, w=8"]  # primed on the worker, before the caller's first run


def test_prime_runs_a_static_engine_once_on_zeros_and_skips_a_dynamic_one(toy_artifact: Path) -> None:
    """OrtEngine.prime: one run at the static shapes (the same session and outputs after it), none for a dynamic
    spec, and a closed engine refused."""
    spec, base = _toy_unet(toy_artifact)
    symbols = {"B2": 2, "h": 8, "w": 8}
    static = base.variant(static_spec(spec, symbols), free_dimensions=symbols, cuda_graph=False)
    with pytest.raises(RuntimeError, match="is not open"):
        static.prime()
    feeds = _feeds(spec, symbols)
    with static:
        want = {k: v.clone() for k, v in static.run(feeds).items()}
        assert static.prime() is True
        for name, value in static.run(feeds).items():
            torch.testing.assert_close(value, want[name], atol=0, rtol=0)
    with base:
        assert base.prime() is False  # a dynamic spec: no shape to prime at


def test_bucket_timings_since_is_what_was_added_and_bench_reports_it() -> None:
    """BucketTimings.since: sessions and first static runs of shapes new since the copy, the dynamic parts' sums
    added; bench's bucket_parts is its snapshot per engine, engines that did nothing left out."""
    from diffusion_trt.bench.ours import bucket_parts

    timings = BucketTimings(session_s={"dynamic": 0.5}, dynamic_wait_s=0.25, dynamic_runs=1, dynamic_run_s=0.125)
    before = timings.copy()
    timings.session_s["B2=2, h=8, w=8"] = 2.0
    timings.first_static_run_s["B2=2, h=8, w=8"] = 0.75
    timings.dynamic_runs += 2
    timings.dynamic_run_s += 0.5
    assert before.session_s == {"dynamic": 0.5} and before.first_static_run_s == {}  # the copy kept as it was
    assert timings.since(before) == BucketTimings(session_s={"B2=2, h=8, w=8": 2.0}, dynamic_wait_s=0.0,
                                                  dynamic_runs=2, dynamic_run_s=0.5,
                                                  first_static_run_s={"B2=2, h=8, w=8": 0.75})
    idle = BucketTimings(session_s={"dynamic": 0.5})
    parts = bucket_parts({"unet": before, "vae_decoder": idle}, {"unet": timings, "vae_decoder": idle.copy(),
                                                                 "text_encoder": BucketTimings(dynamic_runs=1)})
    assert parts == {"unet": timings.since(before).snapshot(), "text_encoder": BucketTimings(dynamic_runs=1).snapshot()}


def test_background_a_failed_static_session_leaves_the_dynamic_one_serving(toy_artifact: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    spec, base = _toy_unet(toy_artifact)
    calls = []

    def make(s: EngineSpec, free: Any) -> Any:
        if free is None:
            return base
        calls.append(free)
        raise RuntimeError("no memory for it")

    engine = BucketedEngine(spec, make, device=torch.device("cpu"), buckets=SizeBuckets(), latent_sizes=None)
    feeds = _feeds(spec, {"B2": 2, "h": 8, "w": 8})
    with engine, caplog.at_level("WARNING"):
        engine.run(feeds)
        engine.settle()
        engine.run(feeds)
        assert engine.last_path == "dynamic" and engine.specialised_shapes == [] and len(calls) == 1  # not retried
    assert "the specialised session for B2=2, h=8, w=8 failed (no memory for it); the dynamic session serves it" \
        in caplog.text


def test_background_images_equal_the_synchronous_ones(toy_artifact: Path) -> None:
    with EnginePipeline.from_artifacts(toy_artifact, size_buckets=SizeBuckets(background=False)) as sync:
        ref = [sync(**FAST, height=h, width=w).images for h, w in ((64, 64), (48, 80), (64, 64))]
    with EnginePipeline.from_artifacts(toy_artifact, size_buckets="auto") as pipe:
        got = [pipe(**FAST, height=h, width=w).images for h, w in ((64, 64), (48, 80), (64, 64))]
        assert pipe.engines["unet"].dynamic_open  # opened while loading, for the new shapes
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_static_spec_pins_every_tensor(toy_artifact: Path) -> None:
    entry = read_manifest(toy_artifact)["components"]["vae_decoder"]
    spec = static_spec(EngineSpec.from_manifest("vae_decoder", entry), {"B": 2, "h": 6, "w": 10})
    assert spec.input("latent_sample").min == spec.input("latent_sample").max == (2, 4, 6, 10)
    assert spec.output("sample").min == spec.output("sample").max == (2, 3, 48, 80)


# --- the compiled tiny pipeline: ORT folds the shape arithmetic, images equal the dynamic path ---------------------


def test_free_dimensions_fold_every_shape_op(tiny_artifact: Path, tmp_path: Path) -> None:
    entry = read_manifest(tiny_artifact)["components"]["unet"]
    symbols = {"B2": 2, "h": 8, "w": 8, "S": 77}  # S: the UNet context (77 * prompt chunks)
    counts = {}
    for label, free in (("dynamic", None), ("static", symbols)):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        so.optimized_model_filepath = str(tmp_path / f"{label}.onnx")
        spec = EngineSpec.from_manifest("unet", entry)
        engine = OrtEngine(tiny_artifact / "unet" / "model.onnx", static_spec(spec, symbols) if free else spec,
                           session_options=so, free_dimensions=free)
        with engine:
            pass
        graph = onnx.load(str(tmp_path / f"{label}.onnx"), load_external_data=False).graph
        counts[label] = collections.Counter(n.op_type for n in graph.node)["Shape"]
    assert counts["dynamic"] > 0 and counts["static"] == 0, counts


def test_bucketed_images_equal_the_dynamic_ones(tiny_artifact: Path) -> None:
    call = {**FAST, "height": 64, "width": 96}
    with EnginePipeline.from_artifacts(tiny_artifact) as plain:
        ref = plain(**call).images
    with EnginePipeline.from_artifacts(tiny_artifact, size_buckets=SizeBuckets(((64, 96),), background=False)) as pipe:
        out = pipe(**call).images
        assert pipe.engines["unet"].last_path == "static" and not pipe.engines["unet"].dynamic_open
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


def test_deterministic_mode_gives_identical_images_and_restores_torch(tiny_artifact: Path) -> None:
    before = torch.are_deterministic_algorithms_enabled()
    with EnginePipeline.from_artifacts(tiny_artifact, deterministic=True, size_buckets="auto") as pipe:
        unet = pipe.engines["unet"]
        assert not unet.buckets.background  # else the first call runs dynamic and the second static: other low bits
        a = pipe(**FAST).images
        assert unet.last_path == "static"
        b = pipe(**FAST).images
    assert float(np.abs(a - b).max()) == 0.0
    assert torch.are_deterministic_algorithms_enabled() == before



def test_background_the_vae_decodes_a_new_size_on_the_session_made_during_the_loop(tiny_artifact: Path) -> None:
    """A call at a new size asks the VAE decoder's buckets for that shape's session at its start
    (BucketedEngine.expect), so the decode, after the UNet loop, runs static: no dynamic VAE run at all."""
    call = {**FAST, "height": 64, "width": 96}
    with EnginePipeline.from_artifacts(tiny_artifact, size_buckets="auto") as pipe:
        vae = pipe.engines["vae_decoder"]
        assert vae.buckets.background
        made = threading.Event()
        opened = vae._timed_open

        def slow_open(key: Any, prime: bool = False) -> Any:
            engine = opened(key, prime)
            made.set()
            return engine

        vae._timed_open = slow_open
        real_run = vae.run

        def run(feeds: Any) -> Any:
            assert made.wait(30), "the VAE's session for this size was never asked for"
            vae.settle()  # the session asked for at the call's start: adopt it (made long before, on a GPU)
            return real_run(feeds)

        vae.run = run
        pipe(**call)
        assert vae.last_path == "static" and vae.timings.dynamic_runs == 0
        assert vae.specialised_shapes == [{"B": 1, "h": 8, "w": 12}]
        # the VAE's session was primed on the worker (PRIMED_COMPONENTS), the UNet's not
        assert list(vae.timings.prime_s) == ["B=1, h=8, w=12"] and pipe.engines["unet"].timings.prime_s == {}
        assert not vae.expect({"latent_sample": (1, 4, 8)})  # a shape that binds no symbol set: nothing asked
