"""Trust checks of a run's figures: a wide spread between samples, stage sums that contradict the end to end.

* spread: a stage or end-to-end figure whose slowest sample is more than :data:`WIDE_SPREAD` (1.5x) its fastest is
  reported on a ``warning`` line and in ``notes`` (a busy machine: its medians are not to be trusted);
* stage sums: ``stage_sum_s`` = text encoder + chunks x (steps x (UNet step + glue) + VAE decode), what the stages
  predict for one call. More than :data:`STAGES_OVER_E2E` (1.25x) the measured end to end contradicts it (a stage
  figure is inflated, or the runs saw different machine loads): a warning. Under :data:`STAGES_UNDER_E2E` (0.5x) is
  a note (time outside the measured stages: tokenizer, image conversion, host copies, small-model overheads).
"""

from __future__ import annotations

from .result import STAGES, Run

#: A figure whose slowest sample is more than this times its fastest is warned about (the median is unreliable).
WIDE_SPREAD = 1.5
#: Stage sums above this times the end-to-end figure contradict it (warned).
STAGES_OVER_E2E = 1.25
#: Stage sums below this times the end-to-end figure: a note (unmeasured overheads dominate).
STAGES_UNDER_E2E = 0.5


def trust_notes(run: Run, steps: int) -> list[str]:
    """Fill ``run``'s stage sum; one line per figure too noisy (:data:`WIDE_SPREAD`) or contradicting the end to end
    (:data:`STAGES_OVER_E2E`), prefixed "warning:", and a note when the stages explain little of it."""
    out = []
    label = f"{run.system} b={run.batch_size}"
    figures = {f"{k} ms": v for k, v in run.stages_spread_ms.items() if v}
    if run.e2e_spread_s:
        figures["end to end s"] = run.e2e_spread_s
    for name, (lo, med, hi) in figures.items():
        if lo > 0 and hi / lo > WIDE_SPREAD:
            out.append(f"warning: {label} {name.rsplit(' ', 1)[0]} varied {lo:.4g}..{hi:.4g} {name.rsplit(' ', 1)[1]} "
                       f"(median {med:.4g}; slowest/fastest x{hi / lo:.1f} > x{WIDE_SPREAD}): the machine is busy, "
                       "this figure is unreliable; rerun on an idle machine or with more --iters/--stage-iters")
    st = run.stages_ms
    if run.e2e_s and all(st.get(k) is not None for k in STAGES):
        chunks = -(-run.batch_size // (run.stage_batch or run.batch_size))
        total_ms = st["text_encoder"] + chunks * (steps * (st["unet_step"] + st["scheduler_glue"]) + st["vae_decode"])
        run.stage_sum_s = total_ms / 1e3
        run.stage_sum_ratio = run.stage_sum_s / run.e2e_s
        if run.stage_sum_ratio > STAGES_OVER_E2E:
            out.append(f"warning: {label}: the stages add up to {run.stage_sum_s:.3f} s, x{run.stage_sum_ratio:.2f} "
                       f"the measured end to end {run.e2e_s:.3f} s (> x{STAGES_OVER_E2E}): the figures contradict each "
                       "other (a busy machine between the two measurements?); rerun before quoting either")
        elif run.stage_sum_ratio < STAGES_UNDER_E2E:
            out.append(f"{label}: the stages explain {100 * run.stage_sum_ratio:.0f}% of the end to end "
                       f"{run.e2e_s:.3f} s (tokenizer, image conversion, host copies and call overheads are outside "
                       "them)")
    return out
