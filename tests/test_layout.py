"""The import directions of README.md's Layout section, read from the source with ``ast`` and checked at run time.

Parts (``diffusion_trt/<part>``): the shared base (errors, config, trt_compat, lora, data and the ``artifact``
package: folder, manifest, reader, values, facts, digests, verify, summary), passes, runtime, compiler, optimize,
bench, serve, cli. Each may import the parts :data:`ALLOWED` lists and no other; nothing imports ``cli``. Every
import counts, also those inside functions (lazy imports are the rule here).

The runtime's rule on diffusers and transformers (a serving host loads no model class, STYLE.md 21): from diffusers
it may import the top-level package (scheduler classes are looked up on it by name, ``runtime/schedulers.py``
accepts only names ending in "Scheduler"), ``diffusers.schedulers``, ``diffusers.utils`` (``randn_tensor``, the
LoRA state-dict conversions), ``diffusers.image_processor`` and ``diffusers.loaders.lora_conversion_utils`` (kohya
key conversion: functions on dicts); ``from diffusers import X`` only for a scheduler (``X`` ends in "Scheduler")
or ``VaeImageProcessor``. From transformers only tokenizers (``from transformers import X`` with ``X`` ending in
"Tokenizer"/"TokenizerFast", or a ``transformers.models.*.tokenization_*`` module). Never peft.

Inside the runtime no import circle: counting every import (module level, inside functions and under
``TYPE_CHECKING``), no runtime module reaches itself again (the loop ``denoise`` imports the request and the modes;
they import the prompt and latent helpers of ``text_embeddings`` and ``latents``, not the loop).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "diffusion_trt"
SHARED = frozenset({"errors", "config", "trt_compat", "artifact", "lora", "data"})
#: part -> the parts it may import (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    **{p: SHARED for p in SHARED},
    "passes": SHARED,
    "runtime": SHARED,
    "compiler": SHARED | {"passes", "runtime"},
    "optimize": SHARED | {"passes"},
    "bench": SHARED | {"runtime"},
    "serve": SHARED | {"runtime"},
    "__init__": SHARED | {"runtime"},
    "cli": SHARED | {"passes", "runtime", "compiler", "optimize", "bench", "serve"},
}
DIFFUSERS_MODULES = ("diffusers.schedulers", "diffusers.utils", "diffusers.image_processor",
                     "diffusers.loaders.lora_conversion_utils")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module: str | None = None) -> Iterator[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in ``path`` (the module ``module``, default its name
    in the package); relative imports resolved."""
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
                if not node.module:  # from . import x: each name is a module
                    for name in names:
                        yield node.lineno, f"{target}.{name}", []
                    continue
                yield node.lineno, target, names
            else:
                yield node.lineno, str(node.module), names


def _part(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _sources(part: str | None = None) -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    return [f for f in files if part is None or _part(_module_name(f)) == part]


def part_violations(path: Path, module: str | None = None) -> list[str]:
    """The imports of ``path`` that reach a part its own part may not import."""
    source = _part(module or _module_name(path))
    assert source in ALLOWED, f"{path}: part {source!r} is not in the layout; add it to ALLOWED and the README"
    wrong = []
    for line, target, _ in imports(path, module):
        if target.startswith("diffusion_trt.") and _part(target) != source and _part(target) not in ALLOWED[source]:
            wrong.append(f"{path.name}:{line} ({source}) imports {target}")
    return wrong


def test_parts_import_only_the_parts_below_them() -> None:
    wrong = [line for path in _sources() for line in part_violations(path)]
    assert not wrong, "\n".join(wrong)


def manifest_key_reads(path: Path) -> list[str]:
    """``"line: source"`` of every read of a manifest key by string in ``path``: a ``x["key"]`` load or ``x.get("key")``
    whose chain (through subscripts and ``.get`` calls) starts at an expression naming ``manifest`` (issue 23: outside
    ``artifact/`` the typed :class:`~diffusion_trt.artifact.manifest.Manifest` is read, and only the compiler, which
    writes and amends manifests, keeps the JSON)."""
    src = path.read_text(encoding="utf-8")
    found = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            base, key = node.value, node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:
            base, key = node.func.value, node.args[0]
        else:
            continue
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            continue
        while True:  # to the root of x["a"].get("b")["c"]
            if isinstance(base, ast.Subscript):
                base = base.value
            elif isinstance(base, ast.Call) and isinstance(base.func, ast.Attribute) and base.func.attr == "get":
                base = base.func.value
            else:
                break
        if not isinstance(base, ast.Call) and "manifest" in (ast.get_source_segment(src, base) or "").lower():
            found.append(f"{node.lineno}: {ast.get_source_segment(src, node)}")
    return found


#: String-key manifest reads the compiler keeps: none. It reads a sealed manifest's facts through the typed
#: ``Manifest`` and amends its ``source`` record through ``artifact.manifest.amend_source`` (14 reads in cache,
#: controlnet_add, export and frontend on 2026-12-02, then 3 amendments, then 0).
COMPILER_MANIFEST_KEY_READS = 0


def test_only_artifact_and_the_compiler_read_manifest_keys(tmp_path: Path) -> None:
    wrong = [f"{path.relative_to(PACKAGE.parent)}:{r}" for path in _sources()
             if _part(_module_name(path)) not in ("artifact", "compiler") for r in manifest_key_reads(path)]
    assert not wrong, "\n".join(wrong)
    compiler = [f"{path.relative_to(PACKAGE.parent)}:{r}" for path in _sources("compiler")
                for r in manifest_key_reads(path)]
    assert len(compiler) <= COMPILER_MANIFEST_KEY_READS, "\n".join(compiler)
    (tmp_path / "x.py").write_text("m = manifest['model']['architecture']\nb = reader.manifest.get('backend')\n"
                                   "ok = manifest.model.architecture\nt = tensor_manifest(t)['opt']\n")
    assert sorted(manifest_key_reads(tmp_path / "x.py")) == [
        "1: manifest['model']", "1: manifest['model']['architecture']", "2: reader.manifest.get('backend')"]


def _runtime_problem(module: str, names: list[str]) -> str | None:
    """Why the runtime may not import ``names`` from ``module``, or None (see the module docstring)."""
    top = module.split(".")[0]
    if top == "peft":
        return "peft (LoRA merging is compile time: compiler/lora.py)"
    if top == "diffusers":
        if module != "diffusers" and not module.startswith(DIFFUSERS_MODULES):
            return "a diffusers module outside schedulers/utils/image_processor/lora_conversion_utils"
        bad = [n for n in names if module == "diffusers" and not n.endswith("Scheduler") and n != "VaeImageProcessor"]
        return f"diffusers.{bad[0]} (not a scheduler)" if bad else None
    if top == "transformers":
        if module.startswith("transformers.models.") and ".tokenization_" in module:
            return None
        bad = [n for n in names if not n.endswith(("Tokenizer", "TokenizerFast"))]
        if module != "transformers" or bad or not names:
            return f"transformers {module} {bad or names} (only tokenizers)"
    return None


def test_runtime_imports_no_model_class() -> None:
    wrong = []
    for path in _sources("runtime"):
        for line, module, names in imports(path):
            problem = _runtime_problem(module, names)
            if problem:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {problem}")
    assert not wrong, "\n".join(wrong)


def import_graph(part: str) -> dict[str, set[str]]:
    """Module -> the modules of the same ``part`` it imports (every import; ``from . import x`` counts as ``x``)."""
    modules = {_module_name(path): path for path in _sources(part)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for _, target, names in imports(path):
            targets |= {t for t in (target, *(f"{target}.{n}" for n in names)) if t in modules and t != name}
        graph[name] = targets
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module, sorted."""
    reach = {m: _reachable(graph, m) for m in graph}
    circles = {tuple(sorted(m2 for m2 in reach[m] if m in reach[m2])) for m in graph if m in reach[m]}
    return sorted(list(c) for c in circles)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def test_runtime_has_no_import_circle() -> None:
    graph = import_graph("runtime")
    assert "diffusion_trt.runtime.denoise" in graph["diffusion_trt.runtime.pipeline"]  # the graph is read
    circles = import_circles(graph)
    assert not circles, "\n".join(" <-> ".join(m.removeprefix("diffusion_trt.runtime.") for m in c) for c in circles)


def test_the_rules_catch_what_they_forbid(tmp_path: Path) -> None:
    """The checks above are not vacuous: each forbidden import is reported."""
    assert _runtime_problem("diffusers", ["UNet2DConditionModel"])
    assert _runtime_problem("diffusers.models.unets", ["UNet2DConditionModel"])
    assert _runtime_problem("transformers", ["CLIPTextModel"])
    assert _runtime_problem("peft.tuners", ["LoraLayer"])
    assert _runtime_problem("diffusers", ["EulerDiscreteScheduler"]) is None
    assert _runtime_problem("transformers", ["CLIPTokenizer"]) is None
    (tmp_path / "x.py").write_text("from ..compiler import lora\nfrom ...diffusion_trt.cli import main\n"
                                   "from . import denoise\nimport diffusion_trt.passes.base\n")
    assert part_violations(tmp_path / "x.py", "diffusion_trt.runtime.x") == [
        "x.py:1 (runtime) imports diffusion_trt.compiler", "x.py:2 (runtime) imports diffusion_trt.cli",
        "x.py:4 (runtime) imports diffusion_trt.passes.base",
    ]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []
    assert "runtime" not in ALLOWED["passes"] and "compiler" not in ALLOWED["passes"]
    assert not any("cli" in allowed for allowed in ALLOWED.values())


@pytest.mark.parametrize("part", ["runtime", "passes", "artifact"])
def test_import_directions_hold_at_run_time(part: str) -> None:
    """Importing every module of ``part`` in a fresh interpreter loads none of the parts it may not import, and
    (runtime) no diffusers/transformers model module or peft."""
    code = (
        "import importlib, pkgutil, sys\n"
        f"import diffusion_trt.{part} as p\n"
        f"for m in pkgutil.walk_packages(p.__path__, 'diffusion_trt.{part}.'):\n"
        "    importlib.import_module(m.name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    modules = _modules_after(code)
    parts = {_part(m) for m in modules if m.startswith("diffusion_trt.")} - {part}
    assert parts <= ALLOWED[part], sorted(parts - ALLOWED[part])
    if part == "runtime":
        assert not _model_modules(modules)


def test_running_an_artifact_loads_no_model_class(tiny_artifact: Path) -> None:
    """Load the tiny artifact and make an image: the compiler, the passes, peft and every diffusers/transformers
    model module stay unimported."""
    code = (
        "import sys\n"
        "from diffusion_trt.runtime import EnginePipeline\n"
        f"with EnginePipeline.from_artifacts({str(tiny_artifact)!r}) as pipe:\n"
        "    pipe('a fox', num_inference_steps=1, output_type='np', progress=False)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    modules = _modules_after(code)
    assert not [m for m in modules if m.startswith(("diffusion_trt.compiler", "diffusion_trt.passes"))]
    assert not _model_modules(modules)
    assert "diffusion_trt.runtime.pipeline" in modules  # the probe ran


def _modules_after(code: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def _model_modules(modules: list[str]) -> list[str]:
    """diffusers/transformers model modules and peft among ``modules``."""
    return [m for m in modules if m.startswith(("diffusers.models", "diffusers.pipelines", "peft"))
            or (m.startswith("transformers.") and "modeling" in m)]
