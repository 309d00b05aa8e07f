"""The training recipe in torch: optimizers and lr schedules by name, and the loss
(the config side, without torch: `services.algorithms.training`; the keys: docs/training.md).

A schedule never lives on the optimizer it drives: optimizers are rebuilt every round on a
client and every version on a worker, while a schedule's position runs through the job. A
`Pacer` steps the schedule on a scratch optimizer of the same class and arguments over one
dummy parameter, fast-forwarded to the position, and copies its group's hyper-parameters
(lr, and momentum or betas for the cyclic ones) into the real optimizer, again after each of
the real one's steps when the schedule is per step. The lr of a position is thus the one a
scheduler stepped that many times gives, whichever process computes it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim import lr_scheduler

from services.algorithms.hints import did_you_mean
from services.algorithms.training import (
    CROSS_ENTROPY,
    LossSection,
    OptimizerSection,
    ScheduleChoice,
    ScheduleSection,
    TorchChoice,
)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Classes of torch that the config cannot drive, and why.
_REFUSED = {
    "Optimizer": "is the base class, not an optimizer",
    "LBFGS": "needs a closure re-evaluating the loss at each step, which split training has not",
    "LRScheduler": "is the base class, not a schedule",
    "_LRScheduler": "is the base class, not a schedule",
    "LambdaLR": "takes a Python function, which a config file cannot give",
    "MultiplicativeLR": "takes a Python function, which a config file cannot give",
    "SequentialLR": "takes other scheduler objects, which a config file cannot give",
    "ChainedScheduler": "takes other scheduler objects, which a config file cannot give",
    "ReduceLROnPlateau": "steps on a validation metric, which clients and workers do not see",
}
# Arguments the recipe sets itself.
_OWN = {"last_epoch": "the schedule's position"}
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def _classes(module: object, base: type) -> dict[str, type]:
    """Lower-cased name -> the public subclasses of `base` that `module` exports."""
    return {
        name.lower(): cls
        for name, cls in vars(module).items()
        if inspect.isclass(cls) and issubclass(cls, base) and not name.startswith("_")
    }


def _lookup(kind: str, name: str, known: Mapping[str, type]) -> type:
    cls = known.get(name.lower())
    if cls is None:
        usable = sorted(n for n, c in known.items() if c.__name__ not in _REFUSED)
        raise ValueError(
            f"{kind}.name: torch has no {name!r}{did_you_mean(name.lower(), usable)} "
            f"(one of {', '.join(usable)})"
        )
    why = _REFUSED.get(cls.__name__)
    if why is not None:
        raise ValueError(f"{kind}.name: {cls.__name__} {why}; choose another")
    return cls


def optimizer_class(name: str, kind: str = "optimizer") -> type[torch.optim.Optimizer]:
    """The `torch.optim` class called `name`, in any case (`ValueError` when none)."""
    cls = _lookup(kind, name, _classes(torch.optim, torch.optim.Optimizer))
    assert issubclass(cls, torch.optim.Optimizer)
    return cls


def scheduler_class(name: str, kind: str = "schedule") -> type[lr_scheduler.LRScheduler]:
    """The `torch.optim.lr_scheduler` class called `name`, in any case."""
    cls = _lookup(kind, name, _classes(lr_scheduler, lr_scheduler.LRScheduler))
    assert issubclass(cls, lr_scheduler.LRScheduler)
    return cls


def check_arguments(
    kind: str, call: Callable[..., object], arguments: Mapping[str, object]
) -> None:
    """`ValueError` for a keyword that `call` does not take (listing those it does) or a
    required one missing; its first two parameters (logits and labels, or the parameters or
    optimizer and nothing else) are SplitMQ's to pass."""
    params = list(inspect.signature(call).parameters.values())
    positional = 1 if inspect.isclass(call) else 2
    named = [p for p in params[positional:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    accepted = [p.name for p in named if p.name not in _OWN]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    name = getattr(call, "__name__", repr(call))
    for key in arguments:
        if key in _OWN:
            raise ValueError(f"{kind}.{key}: set by SplitMQ ({_OWN[key]}), not by the config")
        if key not in accepted and not takes_any:
            raise ValueError(
                f"{kind}.{key}: {name} takes no argument {key!r}{did_you_mean(key, accepted)}; "
                f"it takes {', '.join(accepted) or 'none'}"
            )
    missing = [p.name for p in named if p.default is p.empty and p.name not in arguments]
    if missing:
        raise ValueError(f"{kind}: {name} needs {', '.join(missing)}: add to [{kind}]")


def optimizer_factory(choice: TorchChoice, kind: str = "optimizer") -> OptimizerFactory:
    """Builds the optimizer `choice` names with its arguments over the parameters given."""
    cls, arguments = optimizer_class(choice.name, kind), choice.arguments()
    return lambda params: cls(params, **arguments)


@dataclass(eq=False)
class Pacer:
    """A schedule at a position, driving the hyper-parameters of `target` (see module doc)."""

    target: torch.optim.Optimizer
    scratch: torch.optim.Optimizer
    scheduler: lr_scheduler.LRScheduler

    def sync(self) -> None:
        paced = {k: v for k, v in self.scratch.param_groups[0].items() if k != "params"}
        for group in self.target.param_groups:
            group.update(paced)

    def step(self) -> None:
        self.scheduler.step()
        self.sync()


def paced(
    make: OptimizerFactory,
    params: Iterable[nn.Parameter],
    schedule: ScheduleChoice | None,
    position: int,
    kind: str = "schedule",
) -> torch.optim.Optimizer:
    """`make(params)` with its hyper-parameters those of `schedule` after `position` steps; a
    per-step schedule goes on after each of its steps. No schedule: as made."""
    optimizer = make(params)
    if schedule is None or not schedule.name:
        return optimizer
    scratch = make([nn.Parameter(torch.zeros(2, 2))])
    scheduler = scheduler_class(schedule.name, kind)(scratch, **schedule.arguments())
    # No gradient, so no change; but torch warns of a schedule stepped before its optimizer.
    scratch.step()
    for _ in range(position):
        scheduler.step()
    pacer = Pacer(optimizer, scratch, scheduler)
    pacer.sync()
    if schedule.every == "step":
        # The hook holds the pacer: it lives as long as the optimizer.
        optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: pacer.step())
    return optimizer


def loss_function(loss: LossSection) -> LossFn:
    """`loss(logits, labels)`: cross-entropy with the section's arguments, or the user's
    function (`ValueError` when it cannot be imported)."""
    # A partial, not a lambda: the function is called per batch, and nothing of ours runs
    # between the step and torch's (or the user's) loss.
    arguments = loss.arguments()
    fn = F.cross_entropy if loss.name == CROSS_ENTROPY else _user_function(loss.name)
    return partial(fn, **arguments)


def _user_function(name: str) -> Callable[..., torch.Tensor]:
    module_name, _, attr = name.partition(":")
    if not attr:
        raise ValueError(
            f"loss.name: {name!r} is neither {CROSS_ENTROPY!r} nor 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"loss.name: cannot import {module_name!r} ({exc}); is its directory on "
            "PYTHONPATH (or the package installed) in every client's and worker's environment?"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"loss.name: {module_name} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def check_recipe(optimizer: OptimizerSection, schedule: ScheduleSection, loss: LossSection) -> None:
    """`ValueError` with what is wrong, for names and arguments torch would refuse: each side's
    optimizer is built with its schedule once over a dummy parameter, the loss imported."""
    sides = (
        ("optimizer", optimizer.client_side, "schedule", schedule.client_side),
        ("optimizer.server", optimizer.server_side, "schedule.server", schedule.server_side),
    )
    for kind, choice, plan_kind, plan in sides:
        make: OptimizerFactory = _default
        if choice is not None:
            check_arguments(kind, optimizer_class(choice.name, kind), choice.arguments())
            make = optimizer_factory(choice, kind)
        if plan is not None:
            check_arguments(plan_kind, scheduler_class(plan.name, plan_kind), plan.arguments())
        if choice is None and plan is None:
            continue
        try:
            paced(make, [nn.Parameter(torch.zeros(2, 2))], plan, 1, plan_kind)
        except (TypeError, ValueError, RuntimeError) as exc:
            where = kind if plan is None else plan_kind
            raise ValueError(f"{where}: torch refuses it: {exc}") from None
    if loss.name == CROSS_ENTROPY:
        check_arguments("loss", F.cross_entropy, loss.arguments())
    else:
        check_arguments("loss", _user_function(loss.name), loss.arguments())


def _default(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """A stand-in for the SGD of `[algorithm]`, for checking a schedule over it."""
    return torch.optim.SGD(params, lr=0.01)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The default loss (`[loss]` unset)."""
    return F.cross_entropy(logits, labels)


def optimizer_state(
    optimizer: torch.optim.Optimizer, module: nn.Module
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The optimizer's per-parameter state as flat tensors `<param>.<key>` (`module`'s
    parameter names; a checkpoint stores them beside the weights), and the names of those
    that were Python numbers rather than tensors."""
    tensors: dict[str, torch.Tensor] = {}
    numbers: list[str] = []
    for name, param in module.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            flat = f"{name}.{key}"
            if isinstance(value, torch.Tensor):
                tensors[flat] = value.detach().to("cpu", copy=True)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                tensors[flat] = torch.tensor(value)
                numbers.append(flat)
            elif value is not None:
                raise TypeError(f"optimizer state {flat} is a {type(value).__name__}: not a tensor")
    return tensors, numbers


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    numbers: Iterable[str] = (),
) -> None:
    """Put `optimizer_state`'s tensors back into `optimizer` over `module`'s parameters
    (its hyper-parameters stay as built: they are the schedule's); `ValueError` when a
    tensor names no parameter."""
    names = dict(module.named_parameters())
    as_number = set(numbers)
    by_param: dict[nn.Parameter, dict[str, Any]] = {}
    for flat, tensor in tensors.items():
        name, _, key = flat.rpartition(".")
        if name not in names:
            raise ValueError(f"optimizer state {flat!r} names no parameter of the replica")
        by_param.setdefault(names[name], {})[key] = tensor.item() if flat in as_number else tensor
    index = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    saved = optimizer.state_dict()
    saved["state"] = {index[p]: state for p, state in by_param.items() if p in index}
    optimizer.load_state_dict(saved)
