"""Short scheduler names -> diffusers scheduler classes (and config overrides), built from the artifact's config.

The artifact stores the model's ``scheduler_config.json`` (betas, timestep spacing...). A named scheduler is
``Class.from_config(that config, **overrides)``, exactly what a diffusers user writes to swap schedulers
(``EulerDiscreteScheduler.from_config(pipe.scheduler.config)``), so images match diffusers with the same
swap. They are built by :func:`build_scheduler`, which gives what ``from_config`` gives without importing every
"compatible" scheduler module first (diffusers does, to list keys that belong to other classes: that import pulled
in ``scipy.stats`` for UniPC, 3.9 s of a 9.4 s ``from_artifacts`` on the 2-core CPU machine).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..artifact.values import scheduler_config_problems
from ..errors import ArtifactError, DiffusionTrtError, MissingPackageError, RuntimeInputError, names_arguments
from .deferred_dynamo import deferred_dynamo

logger = logging.getLogger(__name__)

#: name -> (diffusers class name, config overrides). Names follow common UI usage (A1111 / ComfyUI).
SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "pndm": ("PNDMScheduler", {}),
    "ddim": ("DDIMScheduler", {}),
    "ddpm": ("DDPMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "lms": ("LMSDiscreteScheduler", {}),
    "dpm2": ("KDPM2DiscreteScheduler", {}),
    "dpm2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    # DPMSolverMultistep defaults to algorithm "dpmsolver++", order 2: "DPM++ 2M"
    "dpm++": ("DPMSolverMultistepScheduler", {}),
    "dpm++_karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    # "DPM++ 2M SDE": the multistep solver's SDE variant (needs no torchsde, unlike DPMSolverSDEScheduler)
    "dpm++_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    "dpm++_sde_karras": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True},
    ),
    "unipc": ("UniPCMultistepScheduler", {}),
    "deis": ("DEISMultistepScheduler", {}),
}

#: Scheduler classes that need scipy (the ``schedulers`` extra).
_SCIPY_SCHEDULERS = ("LMSDiscreteScheduler",)

#: diffusers class name -> short name, for reporting the artifact's default scheduler.
_NAME_OF_CLASS: dict[str, str] = {}
for _name, (_cls, _over) in SCHEDULERS.items():
    if not _over:
        _NAME_OF_CLASS.setdefault(_cls, _name)


def scheduler_names() -> list[str]:
    """Every name :func:`make_scheduler` accepts, in table order."""
    return list(SCHEDULERS)


def short_name(class_name: str) -> str:
    """The short name of a diffusers scheduler class ("EulerDiscreteScheduler" -> "euler"), else the class name."""
    return _NAME_OF_CLASS.get(class_name, class_name)


def name_of(class_name: str, config: Mapping[str, Any]) -> str:
    """The short name of a scheduler of ``class_name`` with ``config``: the name whose class it is and whose overrides
    the config holds, the most specific first ("dpm++_sde_karras" before "dpm++"); else the class name."""
    fits = [(len(over), name) for name, (cls, over) in SCHEDULERS.items()
            if cls == class_name and all(config.get(k) == v for k, v in over.items())]
    return max(fits)[1] if fits else class_name


@names_arguments("scheduler")
def resolve_scheduler(name: str) -> tuple[str, dict[str, Any]]:
    """(diffusers class name, overrides) of a short name.

    Raises:
        RuntimeInputError: unknown name, or not a string; the message lists the valid ones.
    """
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in SCHEDULERS:
        raise RuntimeInputError(f"scheduler={name!r} is unknown; use one of {', '.join(SCHEDULERS)}")
    cls, overrides = SCHEDULERS[key]
    return cls, dict(overrides)


def _scheduler_class(class_name: str) -> type[Any]:
    import diffusers

    return getattr(diffusers, class_name)  # every class of the allow-list is one diffusers has (test_schedulers)


def scheduler_for(config: Mapping[str, Any], name: str | None = None, class_name: str | None = None
                  ) -> tuple[str, dict[str, Any]]:
    """(class name, overrides) that :func:`make_scheduler` builds, checked against the allow-list and the values that
    class accepts (:func:`~diffusion_trt.artifact.values.scheduler_config_problems`), before anything loads. Imports
    no diffusers.

    Raises:
        RuntimeInputError: unknown ``name``, or a chosen scheduler that cannot run this config (naming the value).
        ArtifactError: the artifact's own class (``name`` None) is not one the runtime runs, or its config holds a
            value that class does not accept.
    """
    if name is None:
        cls_name = class_name or str(config.get("_class_name", ""))
        overrides: dict[str, Any] = {}
    else:
        cls_name, overrides = resolve_scheduler(name)
    problems = scheduler_config_problems({**config, **overrides}, "scheduler_config.json", cls_name)
    if problems and name is None:
        raise ArtifactError(
            f"the artifact's scheduler cannot run: {'; '.join(problems)}; pick another with scheduler= (one of "
            f"{', '.join(SCHEDULERS)}), or restore the original scheduler/scheduler_config.json and manifest"
        )
    if problems:
        raise RuntimeInputError(
            f"scheduler={name!r} ({cls_name}) cannot run this artifact's scheduler config: {'; '.join(problems)}; "
            "choose another scheduler"
        )
    return cls_name, overrides


def check_step_count(num_inference_steps: int, class_name: str, config: Mapping[str, Any]) -> None:
    """Refuse more steps than the scheduler's training timesteps (``config["num_train_timesteps"]``, diffusers'
    default 1000): what :func:`~.denoise.set_schedule` checks before ``set_timesteps`` (10**9 steps would allocate
    gigabytes there), here from the class name and config alone, so a caller can check before anything loads.

    Args:
        class_name: the diffusers class that runs (:func:`scheduler_for`'s); config: its config, overrides applied.

    Raises:
        RuntimeInputError: naming the steps, the timesteps and the most steps the scheduler takes.
    """
    train = int(config.get("num_train_timesteps", 1000) or 1000)
    if num_inference_steps > train:
        raise RuntimeInputError(f"num_inference_steps={num_inference_steps} is more than the {train} timesteps "
                                f"{class_name} was trained with; use at most {train}")


#: Whether :func:`start_scheduler_import` imports diffusers with ``torch._dynamo`` deferred
#: (:func:`~.deferred_dynamo.deferred_dynamo`); a switch for ``benchmarks/cold_start.py`` to compare both.
DEFER_DYNAMO = True


class SchedulerImport(threading.Thread):
    """The daemon thread of :func:`start_scheduler_import`; ``started_at`` / ``ended_at``: ``time.perf_counter()``
    when the import began and ended (``None`` until then), for the load's timeline."""

    def __init__(self, cls_name: str | None) -> None:
        super().__init__(daemon=True, name="diffusion-trt-scheduler-import")
        self._cls_name = cls_name
        self.started_at: float | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        self.started_at = time.perf_counter()
        try:
            if self._cls_name is not None:
                with contextlib.suppress(ImportError, AttributeError), \
                        deferred_dynamo() if DEFER_DYNAMO else contextlib.nullcontext():
                    _scheduler_class(self._cls_name)
        finally:
            self.ended_at = time.perf_counter()


def start_scheduler_import(config: Mapping[str, Any], name: str | None = None,
                           class_name: str | None = None) -> SchedulerImport:
    """Import the diffusers class :func:`make_scheduler` will build, on a daemon thread of its own (started; join
    it before the scheduler is built), so that ``from_artifacts`` pays diffusers' import (seconds: it checks the
    versions of dozens of packages) while its engines load and its own thread captures their CUDA graphs; without
    importing ``torch._dynamo`` (:mod:`~.deferred_dynamo`: most of that import). A failure is left for
    :func:`make_scheduler` to report."""
    cls_name: str | None = None
    with contextlib.suppress(DiffusionTrtError):
        cls_name = (class_name or str(config.get("_class_name", ""))) if name is None else resolve_scheduler(name)[0]
    thread = SchedulerImport(cls_name)
    thread.start()
    return thread


def make_scheduler(config: Mapping[str, Any], name: str | None = None, class_name: str | None = None) -> Any:
    """Build a diffusers scheduler from the artifact's scheduler config.

    Args:
        config: the contents of ``scheduler/scheduler_config.json``.
        name: a short name from :data:`SCHEDULERS`; ``None`` = ``class_name`` (the model's own scheduler).
        class_name: the artifact's scheduler class (``manifest["scheduler"]["class_name"]``); default the
            config's ``_class_name``.

    Returns:
        A fresh scheduler instance. It is stateful (step counters, past outputs): use one per generation,
        e.g. ``type(s).from_config(s.config)``.

    Raises:
        RuntimeInputError, ArtifactError: as :func:`scheduler_for` (a class outside the allow-list, or a value
            its class does not accept).
        MissingPackageError: a scheduler whose optional dependency is missing (``lms``: scipy).
    """
    cls_name, overrides = scheduler_for(config, name, class_name)
    cls = _scheduler_class(cls_name)
    clean = {k: v for k, v in config.items() if not k.startswith("_")}
    try:
        return build_scheduler(cls, clean, overrides)
    except ImportError as e:
        reason = " ".join(str(e).split())  # diffusers' message spans lines and names the package
        fix = ("pip install 'diffusion-trt[schedulers]' (scipy), or choose another scheduler"
               if cls_name in _SCIPY_SCHEDULERS else "install it or choose another scheduler")
        raise MissingPackageError(
            f"scheduler={name or cls_name!r} ({cls_name}) needs an optional package that is not installed "
            f"({reason}); {fix}"
        ) from None


def build_scheduler(cls: type[Any], config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> Any:
    """``cls.from_config(config, **overrides)`` (diffusers ``ConfigMixin``), built the same way but without importing
    every class in ``cls._compatibles`` first.

    diffusers' ``extract_init_dict`` imports the compatible classes only to drop their keys from the config before it
    picks ``cls``'s own ``__init__`` keys, so the instance is the same: the ``__init__`` arguments are the config's
    (``overrides`` win) for the names ``cls.__init__`` takes, less ``_use_default_values`` and private keys; the
    other keys are registered in ``config`` as diffusers does. Not handled: a class's ``_deprecated_kwargs``, which
    no class of :data:`SCHEDULERS` declares (``tests/runtime/test_schedulers.py`` checks that, and compares both ways
    for every name).

    Args:
        cls: a diffusers scheduler class (or the dummy diffusers puts in its place when a backend is missing: its
            constructor raises ``ImportError``).
        config: a scheduler config (``scheduler_config.json``'s contents, or ``scheduler.config``).
        overrides: values for ``__init__`` arguments, taking precedence over ``config``.

    Returns:
        A new scheduler instance.
    """
    overrides = dict(overrides or {})
    defaults = set(config.get("_use_default_values", []))
    original = {k: v for k, v in config.items() if k not in defaults and k != "_use_default_values"}
    keys = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"} - set(
        getattr(cls, "ignore_for_config", ()))
    given = {k: v for k, v in original.items() if not k.startswith("_") and k != "quantization_config"}
    init = {k: overrides[k] if k in overrides else given[k] for k in keys if k in overrides or k in given}
    scheduler = cls(**init)
    hidden = {k: v for k, v in original.items() if k not in init}
    if "_class_name" in hidden:
        hidden["_class_name"] = cls.__name__
    scheduler.register_to_config(**hidden)
    return scheduler
