"""Issue 24 item 1: external data is found wherever the protobuf can hold a tensor, and refused unless listed.

Each case plants a tensor whose data is "external" at ``outside_<case>.bin`` in one place ONNX allows, inside one
chain of containers (the main graph, an If branch, a GRAPHS attribute, a model function's nodes, a function's
attribute default, ``training_info``), nested in each other. The walk (:func:`artifacts.onnx_model_tensors`) must
find each location; ``verify``, the artifact reader (what a run loads through) and ``optimize``'s input must refuse
every one of them, with the location named.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import AttributeProto, GraphProto, TensorProto, helper

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.artifact.reader import ArtifactReader
from diffusion_trt.cli import main
from diffusion_trt.errors import ArtifactError, ModelFileError
from diffusion_trt.optimize import load_model


def _external(name: str, location: str) -> TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _sparse(location: str) -> onnx.SparseTensorProto:
    """A sparse tensor whose values and indices are both external (two places the walk must reach)."""
    indices = _external("i", location + ".indices")
    indices.data_type = TensorProto.INT64
    return helper.make_sparse_tensor(_external("v", location), indices, [4])


def _attr(name: str, kind: str, location: str) -> AttributeProto:
    """An attribute of type ``kind`` (t, tensors, sparse_tensor, sparse_tensors) holding external data."""
    if kind == "t":
        return helper.make_attribute(name, _external("v", location))
    if kind == "tensors":
        return helper.make_attribute(name, [_external("v", location)])
    if kind == "sparse_tensor":
        return helper.make_attribute(name, _sparse(location))
    return helper.make_attribute(name, [_sparse(location)])


def _locations(location: str, leaf: str) -> set[str]:
    return {location, location + ".indices"} if "sparse" in leaf else {location}


# -- leaves: where a graph holds a tensor ------------------------------------------------------------------

NODE_LEAVES = ("t", "tensors", "sparse_tensor", "sparse_tensors")
LEAVES = ("initializer", "sparse_initializer", *NODE_LEAVES)


def _leaf_node(leaf: str, location: str, out: str) -> onnx.NodeProto:
    node = helper.make_node("Holder", [], [out], domain="test.walk")
    node.attribute.append(_attr("value", leaf, location))
    return node


def _plant(graph: GraphProto, leaf: str, location: str, out: str) -> None:
    if leaf == "initializer":
        graph.initializer.append(_external(out, location))
    elif leaf == "sparse_initializer":
        graph.sparse_initializer.append(_sparse(location))
    else:
        graph.node.append(_leaf_node(leaf, location, out))


# -- containers: what holds a graph ------------------------------------------------------------------------


def _in_if(outer: GraphProto, inner: GraphProto, out: str) -> None:
    outer.node.append(helper.make_node("If", ["cond"], [out], then_branch=inner, else_branch=GraphProto(name="e")))


def _in_graphs_attr(outer: GraphProto, inner: GraphProto, out: str) -> None:
    node = helper.make_node("Holder", [], [out], domain="test.walk")
    node.attribute.append(helper.make_attribute("bodies", [GraphProto(name="first"), inner]))
    outer.node.append(node)


SUBGRAPHS: dict[str, Callable[[GraphProto, GraphProto, str], None]] = {"if": _in_if, "graphs": _in_graphs_attr}


def _function(model: onnx.ModelProto, name: str) -> onnx.FunctionProto:
    function = helper.make_function("test.walk", name, [], ["o"], [], [helper.make_opsetid("", 17)])
    model.functions.append(function)
    return model.functions[-1]


def _graph_holder(model: onnx.ModelProto, top: str, case: str) -> GraphProto:
    """A graph inside the top-level container ``top`` of ``model``, where the rest of the chain goes."""
    if top == "graph":
        return model.graph
    if top == "function":  # a function's node: If(then_branch=graph)
        function = _function(model, f"F_{case}")
        inner = GraphProto(name=f"fn_{case}")
        function.node.append(helper.make_node("If", ["cond"], ["o"], then_branch=inner, else_branch=GraphProto()))
        return function.node[-1].attribute[0].g
    if top == "function_default":  # a function's attribute default of type GRAPH (used through ref_attr_name)
        function = _function(model, f"D_{case}")
        function.attribute_proto.append(helper.make_attribute("body", GraphProto(name=f"fd_{case}")))
        return function.attribute_proto[-1].g
    info = model.training_info.add()
    return info.initialization if top == "training_initialization" else info.algorithm


TOPS = ("graph", "function", "function_default", "training_initialization", "training_algorithm")
#: Chains of subgraphs below the top container: none, one, two nested.
CHAINS: tuple[tuple[str, ...], ...] = ((), ("if",), ("graphs",), ("if", "graphs"), ("graphs", "if", "if"))


def _plant_case(model: onnx.ModelProto, top: str, chain: tuple[str, ...], leaf: str, prefix: str = "") -> set[str]:
    case = "-".join((top, *chain, leaf))
    location = f"{prefix}outside_{case}.bin"
    graph = _graph_holder(model, top, case)
    for depth, kind in enumerate(chain):
        inner = GraphProto(name=f"{case}-{depth}")
        SUBGRAPHS[kind](graph, inner, f"{case}-{depth}-out")
        graph = _last_subgraph(graph)
    _plant(graph, leaf, location, f"{case}-out")
    return _locations(location, leaf)


def _last_subgraph(graph: GraphProto) -> GraphProto:
    attr = graph.node[-1].attribute[0]
    return attr.g if attr.type == AttributeProto.GRAPH else attr.graphs[-1]


def _plant_function_direct(model: onnx.ModelProto, where: str, leaf: str, prefix: str = "") -> set[str]:
    """A tensor attribute on a function's own node, or a tensor-typed attribute default of a function."""
    case = f"{where}-{leaf}"
    location = f"{prefix}outside_{case}.bin"
    function = _function(model, f"X_{case.replace('-', '_')}")
    if where == "function_node":
        function.node.append(_leaf_node(leaf, location, "o"))
    else:
        function.attribute_proto.append(_attr("default", leaf, location))
    return _locations(location, leaf)


CASES = [*itertools.product(TOPS, CHAINS, LEAVES)]
DIRECT = [*itertools.product(("function_node", "function_attribute_default"), NODE_LEAVES)]


def _empty_model() -> onnx.ModelProto:
    graph = helper.make_graph([], "g", [], [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("test.walk", 1)])


def _plant_all(model: onnx.ModelProto) -> set[str]:
    """Every case of :data:`CASES` and :data:`DIRECT` in one model; the locations planted."""
    planted: set[str] = set()
    for top, chain, leaf in CASES:
        planted |= _plant_case(model, top, chain, leaf)
    for where, leaf in DIRECT:
        planted |= _plant_function_direct(model, where, leaf)
    return planted


@pytest.mark.parametrize(("top", "chain", "leaf"), CASES, ids=["-".join((t, *c, f)) for t, c, f in CASES])
def test_the_walk_finds_external_data_in_every_place(top: str, chain: tuple[str, ...], leaf: str) -> None:
    model = _empty_model()
    planted = _plant_case(model, top, chain, leaf)
    model = onnx.load_from_string(model.SerializeToString())  # what a reader parses
    assert set(artifacts.external_data_locations(model)) == planted


@pytest.mark.parametrize(("where", "leaf"), DIRECT, ids=[f"{w}-{f}" for w, f in DIRECT])
def test_the_walk_finds_external_data_on_function_nodes_and_defaults(where: str, leaf: str) -> None:
    model = _empty_model()
    planted = _plant_function_direct(model, where, leaf)
    assert set(artifacts.external_data_locations(model)) == planted


def test_the_walk_keeps_order_and_skips_inline_tensors() -> None:
    model = _empty_model()
    model.graph.initializer.append(helper.make_tensor("inline", TensorProto.FLOAT, [1], [1.0]))
    model.graph.initializer.append(_external("a", "a.bin"))
    model.graph.initializer.append(_external("b", "b.bin"))
    model.graph.initializer.append(_external("a2", "a.bin"))
    assert artifacts.external_data_locations(model) == ["a.bin", "b.bin"]
    assert [t.name for t in artifacts.onnx_model_tensors(model)] == ["inline", "a", "b", "a2"]


@pytest.fixture
def planted_artifact(tiny_artifact: Path, tmp_path: Path) -> tuple[Path, set[str]]:
    """A copy of the tiny artifact whose text encoder carries every case at once, resealed (as an attacker would)."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    path = art / "text_encoder" / "model.onnx"
    model = onnx.load(str(path))
    model.opset_import.append(helper.make_opsetid("test.walk", 1))
    planted = _plant_all(model)
    path.write_bytes(model.SerializeToString())
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"]["text_encoder/model.onnx"] = artifacts.file_entry(art, "text_encoder/model.onnx")
    artifacts.write_manifest(art, manifest)
    for location in planted:  # the files exist, in the component's folder but unlisted, and outside it
        (art / "text_encoder" / location).write_bytes(b"\0" * 16)
    return art, planted


def test_verify_and_the_reader_refuse_every_unlisted_location(planted_artifact: tuple[Path, set[str]]) -> None:
    art, planted = planted_artifact
    result = CliRunner().invoke(main, ["verify", str(art)])
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    for location in planted:
        assert f"external data 'text_encoder/{location}' is not listed in the manifest" in result.output, location
    with ArtifactReader.open(art, check_hashes=True) as reader, pytest.raises(ArtifactError) as err:
        reader.onnx("text_encoder/model.onnx")
    for location in planted:
        assert f"text_encoder/{location}" in str(err.value), location


PLANTERS: list[Callable[[onnx.ModelProto, str], set[str]]] = [
    *(lambda m, p, c=c: _plant_case(m, *c, prefix=p) for c in CASES),
    *(lambda m, p, c=c: _plant_function_direct(m, *c, prefix=p) for c in DIRECT),
]


def test_optimize_refuses_external_data_outside_the_models_folder(tmp_path: Path) -> None:
    """Each place on its own, its location ``../outside_*.bin`` an existing file beside the model's folder."""
    (tmp_path / "models").mkdir()
    path = tmp_path / "models" / "m.onnx"
    for plant in PLANTERS:
        model = _empty_model()
        planted = plant(model, "../")
        for location in planted:
            (tmp_path / "models" / location).write_bytes(b"\0" * 16)
        _write(path, model)
        with pytest.raises(ModelFileError, match=r"outside the model's folder") as err:
            load_model(path)
        assert any(repr(location) in str(err.value) for location in planted), (planted, err.value)


def test_optimize_never_reads_external_data_from_the_working_directory(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The locations exist in the working directory (where ONNX Runtime resolved them), not beside the model."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    path = tmp_path / "models" / "m.onnx"
    for plant in PLANTERS:
        model = _empty_model()
        for location in plant(model, ""):
            (tmp_path / location).write_bytes(b"\0" * 16)
        _write(path, model)
        with pytest.raises(ModelFileError, match=r"is missing"):
            load_model(path)


def test_optimize_reads_every_external_tensor_from_its_folder(tmp_path: Path) -> None:
    """Tensors in a function's attribute default and in training_info are read in (not left for ONNX Runtime to
    resolve against the working directory), like the main graph's."""
    model = _empty_model()
    planted = _plant_all(model)
    for location in planted:
        (tmp_path / location).write_bytes(np.arange(4, dtype=np.float32).tobytes())
    loaded = load_model(_write(tmp_path / "all.onnx", model))
    tensors = list(artifacts.onnx_model_tensors(loaded))
    assert len(tensors) >= len(planted)
    assert all(t.data_location == TensorProto.DEFAULT and len(t.raw_data) == 16 for t in tensors)


def test_optimize_cli_refuses_outside_external_data(tmp_path: Path) -> None:
    model = _empty_model()
    function = _function(model, "Evil")
    function.attribute_proto.append(_attr("default", "t", "../outside_rel.bin"))
    (tmp_path / "outside_rel.bin").write_bytes(b"\0" * 16)
    (tmp_path / "m").mkdir()
    path = _write(tmp_path / "m" / "in.onnx", model)
    result = CliRunner().invoke(main, ["optimize", str(path), "-o", str(tmp_path / "out.onnx"), "--target", "ort-cpu"])
    assert result.exit_code == 2, result.output
    assert "'../outside_rel.bin', outside the model's folder" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out.onnx").exists()


def _write(path: Path, model: onnx.ModelProto) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def test_the_walk_is_fast_on_a_unet_sized_graph() -> None:
    """~700 initializers and 6000 nodes with attributes (an SD-1.5 UNet has ~700 and ~5000): the walk must stay in
    the milliseconds next to the parse (it never touches the weights' bytes)."""
    model = _empty_model()
    for i in range(700):
        model.graph.initializer.append(helper.make_tensor(f"w{i}", TensorProto.FLOAT, [64], np.zeros(64)))
    for i in range(6000):
        model.graph.node.append(helper.make_node("Conv", [f"x{i}", f"w{i % 700}"], [f"x{i + 1}"], kernel_shape=[3, 3],
                                                 pads=[1, 1, 1, 1], strides=[1, 1]))
    model = onnx.load_from_string(model.SerializeToString())
    start = time.perf_counter()
    assert artifacts.external_data_locations(model) == []
    assert time.perf_counter() - start < 0.5
