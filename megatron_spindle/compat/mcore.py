"""The differences between the supported megatron-core lines, in one place.

Supported: megatron-core **0.16.1** (the newest for Python 3.11; the wheel has no ``megatron.training``, which
comes from a Megatron-LM checkout at tag ``core_v0.16.1``) and **0.19.x** (Python >= 3.12; 0.19.2 tested;
its wheel ships ``megatron.training``; Megatron-LM tag ``core_v0.19.0`` for the scripts). Anything the code
needs that changed between them is decided here by looking at the installed package (feature detection),
so 0.17 and 0.18, which sit between, take whichever branch they match.

Differences handled:

1. ``megatron.training.training.pretrain``: 0.16.1 takes ``(datasets_provider, model_provider, model_type,
   forward_step, extra_args_provider=, args_defaults=)`` and parses the flags itself; 0.19 takes a
   ``PretrainConfigContainer`` first and the model provider as a keyword, and the caller parses the flags
   (``parse_and_validate_args``) and builds the container (``pretrain_cfg_container_from_args``).
   :func:`run_pretrain` calls either.
2. ``megatron.training.initialize._initialize_distributed``: 0.19 adds ``skip_model_parallel_init``; the
   CPU stand-in (:mod:`.megatron_lm`) passes through whatever it is given.

3. Not a difference between the lines but a defect of both (0.16.1 and 0.19.2) that selective recompute
   reaches without TransformerEngine: ``tensor_parallel.CheckpointWithoutOutput(fp8=False)`` sets
   ``self.fp8 = fp8 is not None`` (always true), so its forward calls TransformerEngine's
   ``FP8GlobalStateManager`` and fails with ``NameError`` where TE is not installed (the local specs, CPU).
   :func:`fix_checkpoint_without_te` makes ``fp8`` false there (without TE there is no fp8); with TE it does
   nothing.

Everything else our code touches (``TransformerConfig``, the layer specs, ``ProcessGroupCollection``,
``dist_checkpointing``, ``get_forward_backward_func``, ``get_megatron_optimizer_config`` returning
``(config, overrides)``, ``train_step`` keywords) is the same in both lines.
"""
from __future__ import annotations

import inspect
import warnings
from importlib import metadata
from typing import Callable

from megatron.core.tensor_parallel import random as mrandom

#: Oldest and newest megatron-core lines that run the test suite.
SUPPORTED = ("0.16.1", "0.19.2")


def mcore_version() -> str:
    """The installed megatron-core version ("unknown" when it is a source checkout without metadata)."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        try:
            from megatron.core.package_info import __version__  # optional: a source checkout's version
            return str(__version__)
        except ImportError:
            return "unknown"


def pretrain_takes_config_container(pretrain: Callable | None = None) -> bool:
    """Whether ``megatron.training.training.pretrain`` wants a config container first (0.19 and later)."""
    if pretrain is None:
        from megatron.training.training import pretrain  # optional: megatron.training (Megatron-LM's loop)
    params = list(inspect.signature(pretrain).parameters)
    return bool(params) and params[0] == "cfg_container"


def run_pretrain(datasets_provider, model_provider, model_type, forward_step, *,
                 extra_args_provider: Callable | None = None, args_defaults: dict | None = None):
    """Megatron-LM's ``pretrain`` with our providers, on whichever signature is installed."""
    from megatron.training import training  # optional: megatron.training (Megatron-LM's loop)

    if not pretrain_takes_config_container(training.pretrain):
        return training.pretrain(datasets_provider, model_provider, model_type, forward_step,
                                 extra_args_provider=extra_args_provider, args_defaults=args_defaults or {})
    from megatron.training.argument_utils import pretrain_cfg_container_from_args  # optional: megatron.training (Megatron-LM's loop)
    from megatron.training.arguments import parse_and_validate_args  # optional: megatron.training (Megatron-LM's loop)

    args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=args_defaults or {})
    with warnings.catch_warnings():  # "use a ModelConfig": a Spindle model comes from a model provider
        warnings.simplefilter("ignore")
        container = pretrain_cfg_container_from_args(args)
    return training.pretrain(container, datasets_provider, model_type, forward_step, model_provider=model_provider)


_NO_TE_FIXED = False


def fix_checkpoint_without_te() -> None:
    """Difference 3 above: ``CheckpointWithoutOutput`` usable without TransformerEngine (idempotent; a no-op
    where megatron.core found TE)."""
    global _NO_TE_FIXED
    if _NO_TE_FIXED or getattr(mrandom, "HAVE_TE", True):
        return
    cls = mrandom.CheckpointWithoutOutput
    original = cls.__init__

    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = False  # megatron sets ``fp8 is not None``; without TE no fp8 can be on

    cls.__init__ = __init__
    _NO_TE_FIXED = True
