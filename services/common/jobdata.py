"""The job's dataset as every role sees it: loaded, its input shape, its augmentation.

One translation of `[data]` into the data layer's `DataRequest`, so clients, the aggregator's
evaluator and every process building the model read the same data the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace

from services.config.root import Settings
from services.data.augment import Augmenter
from services.data.errors import DataFormatError
from services.data.loaders import Dataset, input_shape, load_data
from services.data.registry import DatasetInfo
from services.data.request import DataRequest


def data_request(settings: Settings) -> DataRequest:
    # A request's fields are the [data] keys of the same names, and the job's seed.
    keys = {f.name for f in fields(DataRequest)} - {"seed"}
    return DataRequest(**settings.data.model_dump(include=keys), seed=settings.job.seed)


def check_fits(settings: Settings, info: DatasetInfo) -> None:
    """`DataFormatError` when the model cannot take the data: another class count, or a
    declared `data.input_shape` the data does not have."""
    classes = settings.model.num_classes
    if info.num_classes != classes:
        raise DataFormatError(
            info.name,
            f"the dataset has {info.num_classes} classes but model.num_classes is {classes}: "
            f"set [model] num_classes = {info.num_classes}",
        )
    declared = settings.data.input_shape
    if declared and declared != info.input_shape:
        raise DataFormatError(
            info.name,
            f"samples are {list(info.input_shape)} but data.input_shape says {list(declared)}",
        )


def load_job_dataset(settings: Settings, env: Mapping[str, str] | None = None) -> Dataset:
    """The job's dataset, checked against its model (`check_fits`)."""
    dataset = load_data(data_request(settings), env)
    check_fits(settings, dataset.info)
    return dataset


def job_input_shape(settings: Settings) -> tuple[int, ...]:
    """One sample's shape: `data.input_shape` when set, else read from the data's headers."""
    return settings.data.input_shape or input_shape(data_request(settings))


def job_augmentation(settings: Settings, info: DatasetInfo) -> Augmenter | None:
    """The clients' training-batch augmenter: `[data.augment]` over the dataset's defaults;
    None when nothing is augmented."""
    # [data.augment]'s keys are `Augmentation`'s fields; unset ones are None.
    params = replace(info.augment, **settings.data.augment.model_dump(exclude_none=True))
    return Augmenter.for_data(params, info) if params.active else None
