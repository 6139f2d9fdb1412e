"""Every argument of ``EnginePipeline.from_artifacts`` is checked, with one RuntimeInputError naming it and what it
takes (issue 24, item 11). Before: ``io_binding='no'``, ``cuda_graph='yes'``, ``device_id='0'`` / ``-1``,
``vram_request='x'``, ``memory_facts=5``, ``runtime_cache_dir=5`` were taken silently (a string as true, an ordinal
for ONNX Runtime to fail on), and ``path=None`` / ``provider_options='x'`` raised bare TypeErrors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline

PROVIDER = ("must be a mapping of ONNX Runtime CUDA provider option names to values (str, int, float or bool), e.g. "
            "{'arena_extend_strategy': 'kSameAsRequested'}, or None")
VRAM_REQUEST = ("must be (height, width, batch): height and width in pixels or None (the artifact's default size), "
                "batch an integer >= 1; e.g. (512, 512, 1), or None")
DEVICE_ID = "must be an integer >= 0 (a CUDA device ordinal, as torch.device('cuda', device_id))"

BAD: list[tuple[str, dict[str, Any], str]] = [
    ("io_binding-no", {"io_binding": "no"}, "io_binding='no' must be True, False or None (None: on for CUDA, off on "
                                            "the CPU)"),
    ("cuda_graph-yes", {"cuda_graph": "yes"}, "cuda_graph='yes' must be True, False or None (None: on for CUDA "
                                              "artifacts with a static profile and for TensorRT ones)"),
    ("cuda_graph-1", {"cuda_graph": 1}, "cuda_graph=1 must be True, False or None"),
    ("device_id-str", {"device_id": "0"}, f"device_id='0' {DEVICE_ID}"),
    ("device_id-minus-1", {"device_id": -1}, f"device_id=-1 {DEVICE_ID}"),
    ("device_id-true", {"device_id": True}, f"device_id=True {DEVICE_ID}"),
    ("vram_request-str", {"vram_request": "x"}, f"vram_request='x' {VRAM_REQUEST}"),
    ("vram_request-two", {"vram_request": (512, 512)}, f"vram_request=(512, 512) {VRAM_REQUEST}"),
    ("vram_request-batch-0", {"vram_request": (None, None, 0)}, f"vram_request=(None, None, 0) {VRAM_REQUEST}"),
    ("memory_facts-5", {"memory_facts": 5},
     "memory_facts=5 must be the path of a memory facts file (a str or os.PathLike) or None"),
    ("runtime_cache_dir-5", {"runtime_cache_dir": 5},
     "runtime_cache_dir=5 must be the path of a folder (a str or os.PathLike) or None"),
    ("runtime_cache_dir-empty", {"runtime_cache_dir": ""},
     "runtime_cache_dir='' must be the path of a folder (a str or os.PathLike) or None"),
    ("provider_options-str", {"provider_options": "x"}, f"provider_options='x' {PROVIDER}"),
    ("provider_options-list-value", {"provider_options": {"a": [1]}}, f"provider_options={{'a': [1]}} {PROVIDER}"),
    ("provider_options-int-key", {"provider_options": {1: "1"}}, f"provider_options={{1: '1'}} {PROVIDER}"),
    ("verify-no", {"verify": "no"}, "verify='no' must be True or False (False skips the sha256 of each file only)"),
    ("device-0", {"device": 0}, "device=0 is not supported; use 'cpu' or 'cuda'"),
    ("device-empty", {"device": ""}, "device='' is not supported; use 'cpu' or 'cuda'"),
]


@pytest.mark.parametrize(("options", "message"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_bad_argument_is_one_error_naming_it_before_anything_is_read(tmp_path: Path, options: dict[str, Any],
                                                                       message: str) -> None:
    """Checked before the folder is opened: a folder that does not exist is not what the error is about."""
    with pytest.raises(RuntimeInputError) as e:
        EnginePipeline.from_artifacts(tmp_path / "no-such-artifact", **options)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("path", [None, 5, b"artifacts/x", ""], ids=["None", "int", "bytes", "empty"])
def test_a_path_that_is_no_path(path: Any) -> None:
    with pytest.raises(RuntimeInputError) as e:
        EnginePipeline.from_artifacts(path)
    assert str(e.value) == (f"path={path!r} must be the artifact folder (the one with manifest.json), as a str or "
                            "os.PathLike")


def test_good_values_of_every_option_still_load(toy_artifact: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    with EnginePipeline.from_artifacts(
        str(toy_artifact), device="cpu", verify=False, device_id=0, io_binding=False, cuda_graph=False,
        provider_options={"arena_extend_strategy": "kSameAsRequested", "gpu_mem_limit": 1 << 30},
        runtime_cache_dir=tmp_path, memory_facts=None, vram_request=[64, None, 1],
    ) as pipe:
        assert pipe("a cat", num_inference_steps=1, progress=False, output_type="np").images.shape == (1, 64, 64, 3)
    assert "vram_request=[64, None, 1]: no effect without vram_budget" in caplog.text


def test_a_cuda_ordinal_this_machine_lacks(toy_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It failed inside torch / ONNX Runtime; refused once the device is known (a stand-in for a 1-GPU host)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeInputError) as e:
        EnginePipeline.from_artifacts(toy_artifact, device="cuda", device_id=1)
    assert str(e.value) == "device_id=1 but this machine has 1 CUDA device(s); use 0..0"
