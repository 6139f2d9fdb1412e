"""diffusers' scheduler import without torch._dynamo (runtime/deferred_dynamo.py): each case in a fresh interpreter,
since this test process has imported both already."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _python(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_the_scheduler_imports_without_dynamo_and_diffusers_still_gets_the_real_decorator() -> None:
    out = _python("""
        import sys, torch
        from diffusion_trt.runtime.deferred_dynamo import deferred_dynamo
        with deferred_dynamo() as deferred:
            from diffusers import PNDMScheduler
        print("deferred", deferred)
        print("dynamo after the block", "torch._dynamo" in sys.modules, "torch._dynamo.eval_frame" in sys.modules)
        PNDMScheduler.from_config(PNDMScheduler().config).set_timesteps(5)
        from diffusers.utils.torch_utils import maybe_allow_in_graph

        class Block:
            pass

        print("decorated", maybe_allow_in_graph(Block) is Block)
        import torch._dynamo
        from diffusion_trt.runtime.deferred_dynamo import _StandIn
        print("real", type(sys.modules["torch._dynamo"]).__name__, isinstance(torch._dynamo, _StandIn),
              "torch._dynamo.eval_frame" in sys.modules)
        from diffusers.models.attention import BasicTransformerBlock  # decorated at its import: the real dynamo
        print("attention", BasicTransformerBlock.__name__)
    """)
    assert "deferred True" in out
    assert "dynamo after the block False False" in out
    assert "decorated True" in out
    assert "real module False True" in out
    assert "attention BasicTransformerBlock" in out


def test_nothing_is_deferred_once_dynamo_is_imported_and_other_names_reach_the_real_module() -> None:
    out = _python("""
        import sys, torch
        from diffusion_trt.runtime.deferred_dynamo import deferred_dynamo, _StandIn
        with deferred_dynamo() as deferred:
            stand_in = sys.modules["torch._dynamo"]
            print("stand-in", isinstance(stand_in, _StandIn), deferred)
            import torch._dynamo.config as config  # a submodule: found through the stand-in's __path__
            print("submodule", config.__name__, isinstance(sys.modules["torch._dynamo"], _StandIn))
            reset = stand_in.reset  # any other name: the real module, imported now; the stand-in leaves
            print("other name", callable(reset), isinstance(sys.modules["torch._dynamo"], _StandIn))
        print("after", type(sys.modules["torch._dynamo"]).__name__)
        with deferred_dynamo() as deferred:
            print("again", deferred, isinstance(sys.modules["torch._dynamo"], _StandIn))
    """)
    assert "stand-in True True" in out
    assert "submodule torch._dynamo.config True" in out
    assert "other name True False" in out
    assert "after module" in out
    assert "again False False" in out
