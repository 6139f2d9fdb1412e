"""How a request of B images is cut into engine-sized chunks, and across devices.

The engines are built for a batch range ``lo..hi`` (the manifest profile; a static profile has ``lo == hi``).
A request of ``B = prompts x num_images_per_prompt`` images larger than ``hi`` runs as several chunks, each
inside ``lo..hi``, in order; images keep their order (prompt-major, as diffusers).

Seeds: the pipeline draws the latents of the **whole** request once (``randn_tensor`` over ``[B, C, h, w]``
with the caller's generator, exactly what diffusers draws for one call of B images) and hands each chunk its
rows, so the initial noise of image ``i`` does not depend on the chunking. Schedulers that draw noise in
``step`` (euler_a, ddpm, dpm++_sde, ...) draw ``[chunk, ...]`` per step: with one generator the chunks consume
its stream one after another, so such images are deterministic for a given seed and chunking but differ
from an unchunked run; pass a list of B generators (one per image) to make them chunk-independent (each
chunk gets its own generators). Deterministic schedulers (pndm, ddim, euler, dpm++, ...) give the same
images chunked or not (up to the engines' batch-size-dependent rounding).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import RuntimeInputError


def plan_chunks(total: int, lo: int, hi: int) -> list[range]:
    """Split ``total`` images into the fewest contiguous chunks whose sizes lie in ``lo..hi``, sizes balanced.

    Args:
        total: images in the request, >= 1.
        lo, hi: the engines' batch range (images per call), ``1 <= lo <= hi``.

    Returns:
        Contiguous ranges covering ``0..total`` in order, e.g. ``plan_chunks(10, 1, 4)`` -> sizes 4, 3, 3.

    Raises:
        RuntimeInputError: ``total < lo``, or no split fits (a static profile ``lo == hi`` and a ``total`` that
            is not a multiple of it); the message names the sizes and the fix.
    """
    if not 1 <= lo <= hi:
        raise ValueError(f"batch range {lo}..{hi} must satisfy 1 <= lo <= hi")
    if total < lo:
        raise RuntimeInputError(
            f"batch of {total} image(s) is below the engine profile's min batch {lo} (profile {lo}..{hi}); "
            f"ask for more images or recompile with --min-batch-size {total}"
        )
    n = -(-total // hi)  # fewest chunks
    while n * lo <= total:
        base, extra = divmod(total, n)
        sizes = [base + 1] * extra + [base] * (n - extra)
        if lo <= min(sizes) and max(sizes) <= hi:
            out, start = [], 0
            for size in sizes:
                out.append(range(start, start + size))
                start += size
            return out
        n += 1
    raise RuntimeInputError(
        f"batch of {total} images cannot be split into chunks of {lo}..{hi} images (the engine profile's batch "
        f"range); ask for a multiple of {hi} images (e.g. {max(hi, total // hi * hi)} or {-(-total // hi) * hi}) "
        f"or recompile with a batch range (--min-batch-size/--max-batch-size)"
    )


def split_across(total: int, parts: int, lo: int, hi: int) -> list[range]:
    """Split ``total`` images over up to ``parts`` devices, contiguous and balanced, each share chunkable.

    First tries an even split over ``min(parts, total // lo)`` devices (every share must be splittable by
    :func:`plan_chunks`); when the profile forbids that (static batch), it plans the chunks of the whole
    request and gives each device a balanced run of whole chunks. Devices beyond the returned ranges get no
    work.

    Args:
        total: images, >= 1; parts: devices, >= 1; lo, hi: the engines' batch range.

    Returns:
        Non-empty contiguous ranges in order, at most ``parts`` of them, covering ``0..total``.

    Raises:
        RuntimeInputError: as :func:`plan_chunks` for the whole request.
    """
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1")
    k = min(parts, max(1, total // lo))
    base, extra = divmod(total, k)
    sizes = [base + 1] * extra + [base] * (k - extra)
    try:
        for size in set(sizes):
            plan_chunks(size, lo, hi)
    except RuntimeInputError:
        chunks = plan_chunks(total, lo, hi)  # raises for an impossible request
        groups = even_groups(len(chunks), min(parts, len(chunks)))
        return [range(chunks[g.start].start, chunks[g.stop - 1].stop) for g in groups]
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def even_groups(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous groups whose sizes differ by at most one (larger first)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def per_image(items: Sequence[str], num_images_per_prompt: int) -> list[str]:
    """Each of P items repeated N times in a row: the prompt of every image, prompt-major (as diffusers)."""
    return [item for item in items for _ in range(num_images_per_prompt)]
