"""Build a model by name: a built-in one, or `"package.module:factory"` for your own."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any

from models.custom import load_factory
from models.errors import ModelSpecError
from models.heads import AuxHead, HeadFactory, default_head
from models.split import SplitNet
from models.zoo import cnn5, lenet5, resnet18, vgg_mini, vgg_small

Builder = Callable[..., SplitNet]

BUILTIN_MODELS: Mapping[str, Builder] = MappingProxyType(
    {
        "cnn5": cnn5,
        "lenet5": lenet5,
        "vgg_small": vgg_small,
        "vgg_mini": vgg_mini,
        "resnet18": resnet18,
    }
)
MODEL_NAMES: tuple[str, ...] = tuple(sorted(BUILTIN_MODELS))
# What every builder takes from the job itself (its classes and its dataset's images).
_SET_BY_THE_JOB = frozenset({"num_classes", "in_channels", "input_size", "input_shape"})


def build_model(
    name: str,
    *,
    num_classes: int = 10,
    in_channels: int | None = None,
    input_size: int | None = None,
    input_shape: tuple[int, ...] | None = None,
    head_pool: int | None = None,
    head_factory: HeadFactory | None = None,
    heads: bool = True,
    **options: Any,
) -> SplitNet:
    """Build model `name` (one of `MODEL_NAMES`, or a `"package.module:factory"` spec).

    `in_channels` and `input_size` (square inputs) default to the built-in model's own
    (1x28x28 for cnn5 and vgg_mini, 3x32x32 for the others); a custom factory needs both, or
    `input_shape` instead: any one sample's shape, (C, H, W) or (F,), which built-in models
    take only as square images.
    `head_pool` sets the auxiliary heads' pooled size (see `models.heads`); `head_factory`
    replaces the default head altogether; `heads=False` builds none (an algorithm that trains
    no auxiliary head). Other options go to the builder or factory as keywords.
    """
    factory = _head_factory(head_pool, head_factory)
    if not heads and (head_pool is not None or head_factory is not None):
        raise ModelSpecError("heads=False builds no head: give no head_pool or head_factory")
    head_factory = factory if heads else None
    if input_shape is not None and ":" not in name:
        in_channels, input_size = _square(name, input_shape)
    if ":" in name:
        if input_shape is None:
            if in_channels is None or input_size is None:
                raise ModelSpecError(f"custom model {name!r} needs in_channels and input_size")
            input_shape = (in_channels, input_size, input_size)
        return load_factory(
            name,
            input_shape=input_shape,
            num_classes=num_classes,
            head_factory=head_factory,
            **options,
        )
    builder = BUILTIN_MODELS.get(name)
    if builder is None:
        raise ModelSpecError(
            f"unknown model {name!r}; built-in models are {MODEL_NAMES}, "
            "or give a 'package.module:factory' spec"
        )
    kwargs: dict[str, Any] = {**options, "num_classes": num_classes, "head_factory": head_factory}
    if in_channels is not None:
        kwargs["in_channels"] = in_channels
    if input_size is not None:
        kwargs["input_size"] = input_size
    accepted = inspect.signature(builder).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        allowed = sorted(set(accepted) - {*_SET_BY_THE_JOB, "head_factory"})
        raise ModelSpecError(
            f"model {name!r} has no options {unknown}; its options are {allowed or 'none'}"
        )
    return builder(**kwargs)


def _square(name: str, input_shape: tuple[int, ...]) -> tuple[int, int]:
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ModelSpecError(
            f"built-in model {name!r} takes square images [C, H, H]; these inputs are "
            f"{list(input_shape)}: give your own model as 'package.module:factory' (it gets "
            "input_shape), see docs/data.md"
        )
    return input_shape[0], input_shape[1]


def _head_factory(head_pool: int | None, head_factory: HeadFactory | None) -> HeadFactory:
    if head_pool is not None and head_factory is not None:
        raise ModelSpecError("give head_pool or head_factory, not both")
    if head_factory is not None:
        return head_factory
    # `head_pool` x `head_pool` pooled feature maps (1 gives global average pooling).
    return default_head if head_pool is None else partial(AuxHead, pool=head_pool)
