"""The calibration cache: ``<component>.json`` (format, key, settings, ranges sha256) beside
``<component>.ranges.json``, reused by a later compile whose settings hash to the same key."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CACHE_FORMAT = 1


def cache_key(settings: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of everything the ranges depend on."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def find_cache(location: str | Path | None, component: str) -> Path | None:
    """The cache metadata file for ``component`` at ``location``: a ``<component>.json`` file, or a folder holding
    ``<component>.json`` or ``calibration/<component>.json`` (an artifact folder). ``None`` if there is none."""
    if location is None:
        return None
    p = Path(location).expanduser()
    if p.is_file():
        return p
    for cand in (p / f"{component}.json", p / "calibration" / f"{component}.json"):
        if cand.is_file():
            return cand
    return None


def _load_cache(meta_path: Path, key: str, settings: Mapping[str, Any]) -> tuple[Path | None, str]:
    """(ranges file, reason) when the cache at ``meta_path`` matches ``key``; (None, why not) otherwise."""
    from ...artifact.folder import sha256_file

    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: not UTF-8 (a PNG given as the cache), or not JSON
        return None, f"unreadable ({e})"
    if not isinstance(meta, dict):
        return None, f"not a calibration cache (JSON {type(meta).__name__}, not an object)"
    if meta.get("format") != CACHE_FORMAT or meta.get("key") != key:
        old = meta.get("settings", {})
        differ = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        return None, f"settings differ: {', '.join(differ) or 'format'}"
    ranges = meta_path.parent / str(meta.get("ranges", ""))
    if not ranges.is_file():
        return None, f"its ranges file {ranges} is missing"
    if sha256_file(ranges) != meta.get("ranges_sha256"):
        return None, f"{ranges} does not match its recorded sha256"
    return ranges, "key matches"


def write_cache(cache_out: Path, component: str, key: str, settings: Mapping[str, Any], ranges: Path) -> str:
    """Store ``ranges`` as ``cache_out/<component>.ranges.json`` with its metadata ``<component>.json``.

    Returns:
        The metadata file relative to ``cache_out``'s parent (``calibration/unet.json``), as the manifest records it.
    """
    import shutil

    from ...artifact.folder import sha256_file, write_json_atomic

    cache_out.mkdir(parents=True, exist_ok=True)
    ranges_dst = cache_out / f"{component}.ranges.json"
    shutil.copyfile(ranges, ranges_dst)
    write_json_atomic(cache_out / f"{component}.json", {
        "format": CACHE_FORMAT, "key": key, "settings": settings,
        "ranges": ranges_dst.name, "ranges_sha256": sha256_file(ranges_dst),
    })
    return f"{cache_out.name}/{component}.json"
