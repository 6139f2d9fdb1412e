"""The runtime's import rules (STYLE.md): no compiler/, no passes/, tensorrt only in *_trt.py."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import diffusion_trt.runtime as runtime

RUNTIME = Path(runtime.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved), anywhere in the file."""
    package = ["diffusion_trt", "runtime", *path.parent.relative_to(RUNTIME).parts]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def test_runtime_never_imports_compiler_passes_or_tensorrt() -> None:
    files = sorted(RUNTIME.rglob("*.py"))
    assert {f.relative_to(RUNTIME).as_posix() for f in files} >= {"engines/engine.py", "engines/ort_engine.py",
                                                                   "denoise.py", "pipeline.py", "png.py"}
    for f in files:
        for name in imported_modules(f):
            assert not name.startswith(("diffusion_trt.compiler", "diffusion_trt.passes")), (f.name, name)
            if not (f.name.endswith("_trt.py") or f.name == "trt_engine.py"):  # STYLE.md names trt_engine.py
                assert name.split(".")[0] != "tensorrt", (f.name, name)


def test_importing_the_package_is_light() -> None:
    heavy = ("torch", "onnxruntime", "diffusers")
    code = f"import sys, diffusion_trt.runtime; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
