"""A folder that holds only diffusion-trt's dependency closure, as a user's virtual environment would (issue 28).

    python benchmarks/lean_site.py DEST [--extra onnxruntime-gpu ...]

The GPU host's system site-packages hold hundreds of distributions, and ``import diffusers`` walks all of them at
import time (``importlib.metadata.packages_distributions()`` in ``diffusers.utils.import_utils``: 2.8 s there in
the thirteenth and fourteenth sessions' profiles, 0.05 s in this project's own virtual environment). To measure
the cold start a user with a plain ``pip install`` would see, DEST gets a symlink per top-level module and
``.dist-info`` folder of each distribution in the closure of pyproject.toml's dependencies (plus ``--extra``),
resolved through ``importlib.metadata`` in this interpreter (markers evaluated, extras not followed). Run the
measured processes with ``python -S`` (no site-packages) and ``PYTHONPATH=DEST:<repo>``. A benchmark helper, not a
test.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement


def closure(roots: list[str]) -> dict[str, md.Distribution]:
    """Canonical name -> installed distribution, for ``roots`` and everything they require (no extras)."""
    found: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        req = Requirement(todo.pop())
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in found:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            print(f"not installed: {req.name}")
            continue
        found[key] = dist
        for dep in dist.requires or []:
            r = Requirement(dep)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(str(r))
    return found


def link(dist: md.Distribution, dest: Path) -> int:
    """Symlink the distribution's top-level entries (from its RECORD) and its metadata folder into ``dest``."""
    base = Path(dist.locate_file(""))
    tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    made = 0
    for top in sorted(tops):
        src, dst = base / top, dest / top
        if src.exists() and not dst.exists() and top != "__pycache__":
            dst.symlink_to(src)
            made += 1
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path)
    ap.add_argument("--extra", action="append", default=["onnxruntime-gpu"])
    args = ap.parse_args()
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    dists = closure(list(project["project"]["dependencies"]) + args.extra)
    args.dest.mkdir(parents=True, exist_ok=True)
    links = sum(link(d, args.dest) for d in dists.values())
    print(f"{len(dists)} distributions, {links} links in {args.dest}; all installed here: "
          f"{sum(1 for _ in md.distributions())}")


if __name__ == "__main__":
    main()
