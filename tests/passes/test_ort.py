"""_ort: the probe graphs and peaks of the range check's activation reads (issue 28: their memory and time)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from diffusion_trt.passes import _ort
from tests import graphs


def _chain() -> onnx.ModelProto:
    """y = Relu(x @ W1 + b1) @ W2 (graphs.mlp_model) with every tensor's dtype known to the probes."""
    return graphs.mlp_model()


def test_a_probe_outputs_its_group_and_keeps_only_the_nodes_it_needs() -> None:
    model = _chain()
    probe = _ort.probe_of(model, ["hb"], {"hb": TensorProto.FLOAT})
    assert [o.name for o in probe.graph.output] == ["hb"]
    assert [n.op_type for n in probe.graph.node] == ["MatMul", "Add"]  # Relu and the second MatMul dropped
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Add", "Relu", "MatMul"]  # the model is not changed
    feeds = graphs.random_feeds(model, seed=3)
    (hb,) = graphs.run(probe, feeds)
    x, w1, b1 = feeds["x"], *(onnx.numpy_helper.to_array(t) for t in model.graph.initializer[:2])
    np.testing.assert_allclose(hb, x @ w1 + b1, rtol=1e-5, atol=1e-5)


def test_a_probe_keeps_a_node_whose_subgraph_reads_a_wanted_tensors_ancestor() -> None:
    """An If whose branch reads ``h`` from the outer scope: ``h``'s producer stays although no input names it."""
    branch = helper.make_graph([helper.make_node("Neg", ["h"], ["n"])], "b", [],
                               [helper.make_tensor_value_info("n", TensorProto.FLOAT, [2])])
    model = graphs.make_model(
        [helper.make_node("Abs", ["x"], ["h"]),
         helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
         helper.make_node("Greater", ["m", "zero"], ["c"]),
         helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)],
        [graphs.tensor_info("x", [2])], [graphs.tensor_info("y", [2])], [graphs.const("zero", 0.0)])
    probe = _ort.probe_of(model, ["y"], {"y": TensorProto.FLOAT})
    assert [n.op_type for n in probe.graph.node] == ["Abs", "ReduceMax", "Greater", "If"]
    feeds = {"x": np.array([-1.0, 2.0], np.float32)}
    np.testing.assert_array_equal(graphs.run(probe, feeds)[0], [-1.0, -2.0])


def test_peak_is_max_abs_and_inf_for_any_nan_or_infinity() -> None:
    x = np.array([[0.5, -3.0], [2.0, 1.0]], np.float32)
    assert _ort.peak(x) == 3.0 and _ort.peak(x.astype(np.float16)) == 3.0
    assert _ort.peak(np.array([1.0, np.nan], np.float32)) == float("inf")
    assert _ort.peak(np.array([1.0, -np.inf], np.float16)) == float("inf")
    assert _ort.peak(np.zeros(0, np.float32)) == 0.0 and _ort.peak(np.arange(3)) == 0.0


def test_activation_peaks_read_every_tensor_group_by_group_with_the_values_of_one_run(monkeypatch) -> None:
    """One tensor a group (several pruned probes) gives the peaks of one session exposing everything."""
    model = _chain()
    feeds = [graphs.random_feeds(model, seed=4)]
    together, _ = _ort.activation_peaks(model, feeds)
    monkeypatch.setattr(_ort, "EXPOSE_PER_RUN", 1)
    apart, provider = _ort.activation_peaks(model, feeds)
    assert apart == together and set(apart) == {"h", "hb", "hr", "y"} and provider == "CPUExecutionProvider"
    names = ["h", "hb", "hr", "y"]
    values = _ort.open_session(_ort.probe_of(model, names, dict.fromkeys(names, TensorProto.FLOAT))).run(feeds[0])
    assert apart == {name: float(np.max(np.abs(value))) for name, value in values.items()}


def test_probe_sessions_run_without_the_cpu_arena() -> None:
    session = _ort.open_session(_chain())
    assert not isinstance(session, str)
    assert session.session.get_session_options().enable_cpu_mem_arena is False
