"""The ordered pass lists, one per (backend, precision): explicit tuples, nothing registers itself.

Ordering rules (keep them next to the tuples they constrain):
  * eliminate_dead_nodes first: every later pass, folding included, then works on the live graph only, and
    merged duplicate constants are read once.
  * fold_constants before infer_shapes: folding turns shape computations into constants, which lets
    inference resolve more shapes (Reshape / Expand targets); fold_constants itself folds Shape nodes only
    where the exporter left shapes.
  * infer_shapes last in BASE: the fusions that will follow it match on shapes and ranks.
  * (later) fusions before convert_fp16: the Casts it inserts break the patterns.
"""

from __future__ import annotations

from .base import Pass
from .eliminate_dead_nodes import eliminate_dead_nodes
from .fold_constants import fold_constants
from .infer_shapes import infer_shapes

#: The backends a pipeline exists for (same values as diffusion_trt.config.BACKENDS; passes/ may not import it).
BACKENDS: tuple[str, ...] = ("ort", "tensorrt")

#: Clean-up every pipeline starts with.
BASE: tuple[Pass, ...] = (
    eliminate_dead_nodes,  # first: later passes see only live nodes, duplicate constants merged
    fold_constants,  # before infer_shapes: folded shape subgraphs let inference resolve more shapes
    infer_shapes,  # last: the fusions added after BASE match on shapes
)


def pipeline_for(backend: str, device: str, precision: str, component: str) -> tuple[Pass, ...]:
    """The passes to run, in order, for one component built for ``backend`` on ``device`` at ``precision``.

    Every combination gets :data:`BASE` for now; fusions per (backend, precision) come later.

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} has no pass pipeline; use one of {', '.join(BACKENDS)}")
    del device, precision, component  # not yet used: every combination runs BASE
    return BASE
