"""A bench result for people: the fixed-width table printed by ``diffusion-trt bench`` and the ``--plot`` PNG."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .result import STAGES, SYSTEMS

_NUM = (int, float)


def format_table(result: Mapping[str, Any]) -> str:
    """A fixed-width text table of the runs (one line per system and batch size), then the per-stage memory, the
    cost of a VRAM budget, the speedups, the first calls and the repeatability check."""
    lines = _run_lines(result["runs"])
    lines += _stage_memory_lines(result["runs"])
    lines += _budget_lines(result)
    lines += _ratio_lines(result["ratios"])
    lines += _first_call_lines(result)
    for q in result.get("repeatability", []):
        lines.append(f"two identical calls at {q['height']}x{q['width']} b={q['batch_size']}: max abs difference "
                     f"{q['max_abs_diff']:.3g}{' (identical)' if q['identical'] else ''}")
    return "\n".join(lines)


def _num(v: Any, fmt: str) -> str:
    """``v`` formatted, or a right-aligned "-" of the same width when it is not a number."""
    width = fmt.split(".")[0]
    return format(v, fmt) if isinstance(v, _NUM) else format("-", f">{width}" if width else "")


def _run_lines(runs: list[dict[str, Any]]) -> list[str]:
    head = (
        f"{'system':<22}{'size':>10}{'batch':>6}{'text ms':>9}{'unet ms':>9}{'unet min..max':>16}{'vae ms':>9}"
        f"{'glue ms':>9}"
        f"{'e2e s':>9}{'s/img':>8}{'img/s':>8}{'peak MiB':>10}  status"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        st = r["stages_ms"]
        mem = r["memory_mb"].get("device_used") or r["memory_mb"].get("torch_peak_allocated")
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
        unet_spread = (r.get("stages_spread_ms") or {}).get("unet_step")
        spread_text = f"{unet_spread[0]:.2f}..{unet_spread[2]:.2f}" if unet_spread else "-"
        lines.append(
            f"{r['system']:<22}{_size(r):>10}{r['batch_size']:>6}{_num(st['text_encoder'], '9.2f')}"
            f"{_num(st['unet_step'], '9.2f')}{spread_text:>16}"
            f"{_num(st['vae_decode'], '9.2f')}{_num(st['scheduler_glue'], '9.3f')}{_num(r['e2e_s'], '9.3f')}"
            f"{_num(r['s_per_image'], '8.3f')}{_num(r['images_per_s'], '8.2f')}{_num(mem, '10.0f')}  {status}"
        )
    return lines


def _stage_memory_lines(runs: list[dict[str, Any]]) -> list[str]:
    mem_rows = [r for r in runs if any(v is not None for v in (r.get("stage_memory_mb") or {}).values())]
    if not mem_rows:
        return []
    lines = ["", "peak device memory per stage, MiB (cudaMemGetInfo, whole device):"]
    for r in mem_rows:
        m = r["stage_memory_mb"]
        lines.append(f"  {r['system']:<22} {_size(r):>9} b={r['batch_size']:<3} text {_num(m.get('text'), '.0f')}"
                     f"  unet {_num(m.get('unet'), '.0f')}  vae {_num(m.get('vae'), '.0f')}"
                     + (f"  [{r['vram_plan']}]" if r.get("vram_plan") else ""))
    return lines


def _size(row: Mapping[str, Any]) -> str:
    """``row``'s image size as "HxW", "-" for a row without one (results from before ``--sizes``)."""
    return f"{row['height']}x{row['width']}" if row.get("height") else "-"


def _shape(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a budget row is compared on: (batch size, height, width); sizes ``None`` in results before ``--sizes``."""
    return row["batch_size"], row.get("height"), row.get("width")


def _budget_lines(result: Mapping[str, Any]) -> list[str]:
    """One line per ok ``ours_vram_budget`` row: its end to end next to ``ours`` at the same batch size and size."""
    ok = [r for r in result["runs"] if r["status"] == "ok"]
    ours = {_shape(r): r for r in ok if r["system"] == "ours"}
    lines = []
    for r in ok:
        base = ours.get(_shape(r))
        if r["system"] != "ours_vram_budget" or base is None or not (base["e2e_s"] and r["e2e_s"]):
            continue
        at = f" at {_size(r)}" if r.get("height") else ""
        lines.append(f"  vram budget {result['config'].get('vram_budget')} costs b={r['batch_size']}{at}: e2e "
                     f"{base['e2e_s']:.3f} s -> {r['e2e_s']:.3f} s ({r['e2e_s'] - base['e2e_s']:+.3f} s per request)")
    return lines


def _ratio_lines(ratios: list[dict[str, Any]]) -> list[str]:
    if not ratios:
        return []
    lines = ["", "speedups (baseline time / system time):"]
    for q in ratios:
        unet = q["stage_speedup"].get("unet_step")
        size = f"{q['height']}x{q['width']} " if q.get("height") else ""
        lines.append(
            f"  {size}b={q['batch_size']:<3} {q['system']:<22} vs {q['baseline']:<22}"
            f" e2e x{_num(q['e2e_speedup'], '.2f')}"
            f"  unet x{_num(unet, '.2f')}"
        )
    return lines


def _first_call_lines(result: Mapping[str, Any]) -> list[str]:
    if not result.get("first_calls"):
        return []
    lines = ["", f"first call per size (load {_num(result.get('load_s'), '.2f')} s):"]
    for f in result["first_calls"]:
        lines.append(
            f"  {f['system']:<6} {f['height']}x{f['width']} b={f['batch_size']:<3}"
            f" first {_num(f['first_call_s'], '.3f')} s"
            f"  warm {_num(f['warm_e2e_s'], '.3f')} s  overhead {_num(f['overhead_s'], '.3f')} s"
            + (f"; next calls {', '.join(_num(t, '.3f') for t in f['next_calls_s'])} s, overhead of all "
               f"{_num(f.get('overhead_total_s'), '.3f')} s" if f.get("next_calls_s") else "")
            + (f"  (static sessions ready {f['specialised_wait_s']:.3f} s later)" if "specialised_wait_s" in f else "")
        )
        lines.extend(_bucket_part_lines(f.get("bucket_parts", {})))
    return lines


def _bucket_part_lines(parts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per size-bucket engine: where its seconds went around a first call (host clock)."""
    def named(seconds: Mapping[str, float]) -> str:
        return ", ".join(f"{k} {v:.3f} s" for k, v in seconds.items()) or "none"

    return [f"      {name}: sessions opened: {named(p['session_s'])}; dynamic runs {p['dynamic_runs']} in "
            f"{p['dynamic_run_s']:.3f} s (waited {p['dynamic_wait_s']:.3f} s for the session); first static run: "
            f"{named(p['first_static_run_s'])}; primed: {named(p.get('prime_s', {}))}" for name, p in parts.items()]


def plot_result(result: Mapping[str, Any], path: str | Path) -> Path:
    """A bar chart PNG: seconds per image (end to end) and per-stage ms for each system, per batch size.

    Uses matplotlib when installed (``pip install diffusion-trt[plot]``), else draws with Pillow.
    """
    path = Path(path)
    rows = [r for r in result["runs"] if r["status"] == "ok"]
    title = (
        f"{result['config'].get('precision')} {result['config'].get('height')}x{result['config'].get('width')}, "
        f"{result['config'].get('steps')} steps, {result['env'].get('gpu') or result['env'].get('device')}"
    )
    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError:
        return _plot_pillow(rows, title, path)
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    batches = sorted({r["batch_size"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(systems))
    for k, system in enumerate(systems):
        xs, ys = [], []
        for i, b in enumerate(batches):
            r = next((r for r in rows if r["system"] == system and r["batch_size"] == b), None)
            if r is not None:
                xs.append(i + k * width)
                ys.append(r["s_per_image"])
        axes[0].bar(xs, ys, width, label=system)
        first = next((r for r in rows if r["system"] == system), None)
        if first is not None:
            vals = [first["stages_ms"].get(s) or 0.0 for s in STAGES]
            axes[1].bar([i + k * width for i in range(len(STAGES))], vals, width, label=system)
    axes[0].set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(batches))], [f"b={b}" for b in batches])
    axes[0].set_ylabel("seconds per image (end to end)")
    axes[1].set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(STAGES))], list(STAGES))
    axes[1].set_ylabel(f"ms per call (b={batches[0] if batches else '?'})")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_COLORS = [(66, 133, 244), (52, 168, 83), (234, 67, 53), (251, 188, 5)]


def _plot_pillow(rows: list[dict[str, Any]], title: str, path: Path) -> Path:
    from PIL import Image, ImageDraw

    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    batches = sorted({r["batch_size"] for r in rows})
    width, height, margin = 900, 420, 50
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((margin, 10), f"seconds per image (end to end): {title}", fill="black")
    values = [r["s_per_image"] for r in rows if isinstance(r["s_per_image"], _NUM)]
    top = max(values) if values else 1.0
    plot_h = height - 2 * margin - 30
    group_w = (width - 2 * margin) / max(1, len(batches))
    bar_w = group_w * 0.8 / max(1, len(systems))
    base_y = height - margin
    draw.line([(margin, base_y), (width - margin, base_y)], fill="black")
    for i, b in enumerate(batches):
        draw.text((margin + i * group_w + group_w * 0.35, base_y + 6), f"batch {b}", fill="black")
        for k, system in enumerate(systems):
            r = next((r for r in rows if r["system"] == system and r["batch_size"] == b), None)
            if r is None or not isinstance(r["s_per_image"], _NUM):
                continue
            x0 = margin + i * group_w + group_w * 0.1 + k * bar_w
            y0 = base_y - plot_h * r["s_per_image"] / top
            draw.rectangle([x0, y0, x0 + bar_w - 2, base_y], fill=_COLORS[k % len(_COLORS)])
            draw.text((x0, y0 - 12), f"{r['s_per_image']:.3g}", fill="black")
    for k, system in enumerate(systems):
        x = margin + k * 200
        draw.rectangle([x, 30, x + 12, 42], fill=_COLORS[k % len(_COLORS)])
        draw.text((x + 16, 30), system, fill="black")
    img.save(path, format="PNG")
    return path
