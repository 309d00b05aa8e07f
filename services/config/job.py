"""What a training job is: model, data, algorithm, clients, rounds, workers, evaluation.

One TOML file holds these sections beside `[broker]` and `[store]` (see `settings.py`); the
same file drives `splitmq run` (embedded), `splitmq up` (local processes) and every role of a
deployment, so all processes of a job agree on it.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from services.algorithms.hints import did_you_mean
from services.algorithms.registry import REGISTRY
from services.algorithms.training import LossSection, OptimizerSection, ScheduleSection
from services.config.settings import _Section

P = TypeVar("P", bound=BaseModel)


class JobSection(_Section):
    name: str = Field(default="splitmq", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    seed: int = 0
    rounds: int = Field(default=5, ge=1)
    # The same config and seed give the same model, bit for bit (docs/reproducibility.md):
    # workers serve a round's batches in one canonical order (step by step, clients in cohort
    # order) whatever order they arrive in, shards follow the clients' partitions, and
    # `splitmq run` waits for all its clients before round 1. false: batches are served as
    # they arrive (a little faster on a loaded machine; every run is still recorded and
    # replayable with `splitmq replay`).
    deterministic: bool = True


# Builder parameters that the job sets itself, not through [model.options].
_SET_ELSEWHERE = {
    "num_classes": "set model.num_classes instead",
    "in_channels": "the dataset's image shape sets it",
    "input_size": "the dataset's image shape sets it",
    "input_shape": "the dataset's image shape sets it",
    "head_factory": "the auxiliary heads are not configurable from the job file",
    "head_pool": "the auxiliary heads are not configurable from the job file",
}


def _is_option_value(value: object) -> bool:
    if isinstance(value, list):
        return all(_is_option_value(item) for item in value)
    return isinstance(value, bool | int | float | str)


class ModelSection(_Section):
    # A built-in name (cnn5, lenet5, vgg_small, vgg_mini, resnet18), "package.module:factory"
    # or "path/to/file.py:factory" (docs/models.md).
    name: str = "cnn5"
    # Cut point name (e.g. "block1", "layer1"); ignored by FedAvg.
    cut: str = "block1"
    # U-shaped split (label privacy): the first block of a tail the client runs after the
    # server's part (e.g. "classifier"), so the labels never leave the client; "": none.
    # The server keeps at least one block between the cut and the tail (checked when the
    # model is built); only algorithms whose strategy supports it (docs/algorithms.md).
    tail: str = Field(default="", pattern=r"^[A-Za-z0-9_]{0,128}$")
    num_classes: int = Field(default=10, ge=2)
    # Keyword options for the model's builder or factory ([model.options], e.g. width = 32):
    # TOML strings, numbers, booleans and lists of them; checked against its parameters when
    # the model is built. Every role reads them from its own job file, as it reads `name`.
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("options")
    @classmethod
    def _option_values(cls, options: dict[str, Any]) -> dict[str, Any]:
        for key, value in options.items():
            if not key.isidentifier():
                raise ValueError(f"model.options.{key}: an option name must be an identifier")
            if key in _SET_ELSEWHERE:
                raise ValueError(f"model.options.{key}: {_SET_ELSEWHERE[key]}")
            if not _is_option_value(value):
                raise ValueError(
                    f"model.options.{key}: {value!r} is not a string, number, boolean or a "
                    "list of them"
                )
        return options

    @model_validator(mode="after")
    def _tail_after_cut(self) -> ModelSection:
        if self.tail and self.tail == self.cut:
            raise ValueError(
                f"model.tail {self.tail!r} is the cut's own block: the client's tail starts "
                "after the server's part, at least two blocks after the cut"
            )
        return self


class AugmentSection(_Section):
    """Random transforms of the clients' training batches (never of test or evaluation data)."""

    # Pad by this many black pixels a side, then crop back at a random offset (0: no crop).
    # Unset (here and below): the dataset's own default, which is none for the built-ins.
    crop_padding: int | None = Field(default=None, ge=0, le=64)
    # Mirror half of the images left to right.
    horizontal_flip: bool | None = None


class DataSection(_Section):
    # A built-in (mnist, fashion_mnist, cifar10, fashion_mnist_sample), "npz" or
    # "image_folder" (read from `path`), or a plugin's name (docs/data.md).
    dataset: str = "fashion_mnist_sample"
    # Where full datasets live; empty: $SPLITMQ_DATA_DIR, else only the shipped sample.
    dir: str = ""
    # npz: the .npz file; image_folder: the folder. Relative: to `dir` when it is set, else to
    # the working directory. Clients read it themselves, so it must exist where they run.
    path: str = ""
    # npz: a second file with the test split (else `path` holds both, or `test_fraction`).
    test_path: str = ""
    # The share held out as the test split (seeded by job.seed) when the data has none.
    test_fraction: float = Field(default=0.2, gt=0, lt=1)
    # image_folder: resize every image to this square side (0: all must have one size).
    image_size: int = Field(default=0, ge=0)
    # One sample's shape, [C, H, W] or [F]: the model is built from it without reading the
    # data (for workers on machines that lack it); empty: read from the data, checked there.
    input_shape: tuple[int, ...] = ()
    # Per-channel normalisation (x - mean) / std on the [0, 1] pixel scale; mean/std empty:
    # the dataset's own constants (the built-ins'), else measured on its training split.
    normalize: bool = True
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    augment: AugmentSection = AugmentSection()
    partition: Literal["iid", "dirichlet", "shards", "label_ratio"] = "iid"
    alpha: float = Field(default=0.5, gt=0)
    shards_per_client: int = Field(default=2, ge=1)
    shard_size: int = Field(default=250, ge=1)
    # Whether a client's shards are always of different labels; false deals them at random, as
    # Sub-FedAvg's text ("randomly assign two shards to each client") and reference code do,
    # where a client now and then holds two shards of one label.
    distinct_shards: bool = True
    ratio: float = Field(default=0.0, ge=0, le=1)
    # Cap on the test samples used per evaluation (0: the whole test set).
    eval_samples: int = Field(default=0, ge=0)
    # Train on this many rows of the training split, a seeded sample (job.seed) taken before
    # partitioning (0: all of it); and at most this many per client after it (0: no cap).
    train_samples: int = Field(default=0, ge=0)
    client_samples: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> DataSection:
        if len(self.mean) != len(self.std):
            raise ValueError(
                f"data.mean has {len(self.mean)} values, data.std {len(self.std)}: give one "
                "per channel in each (or neither)"
            )
        if any(s <= 0 for s in self.std):
            raise ValueError(f"data.std must be > 0, got {list(self.std)}")
        if self.input_shape and (len(self.input_shape) not in (1, 3) or min(self.input_shape) < 1):
            raise ValueError(
                f"data.input_shape {list(self.input_shape)}: expected [C, H, W] or [F]"
            )
        return self


def _param_problem(key: str, kind: type[BaseModel], error: ErrorDetails) -> str:
    """`algorithm.KEY.FIELD: what is wrong`, with the nearest field for an unknown one."""
    where = ".".join(map(str, (key, *error["loc"])))
    near = did_you_mean(str(error["loc"][-1]), kind.model_fields)
    return f"algorithm.{where}: {error['msg']}" + (
        near if error["type"] == "extra_forbidden" else ""
    )


class AlgorithmSection(_Section):
    # Each algorithm's own parameters are tables of this one, [algorithm.splitgp],
    # [algorithm.fedsplitx], ...: the sections its registration declares (`section()`).
    model_config = ConfigDict(extra="allow", frozen=True)

    # A registered algorithm (services/algorithms/registry.py), built-in or a plugin's.
    name: str = "sfl_v2"
    # S, the number of server replicas; the algorithm's shard rule may force it (sfl_v2 and
    # minibatch_sfl use 1, sfl_v1 one per client; "sfl" uses this value, the middle ground).
    shards: int = Field(default=1, ge=1)
    local_epochs: int = Field(default=1, ge=1)
    batch_size: int = Field(default=64, ge=1)
    lr: float = Field(default=0.01, gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    server_lr: float = Field(default=0.0, ge=0)  # 0: same as lr
    # Cap on local steps per round (0: whole local epochs) — keeps demo rounds short.
    max_steps_per_round: int = Field(default=0, ge=0)
    smashed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        # A built-in's name is checked in the index, without torch: `splitmq check` loads the
        # config too. A plugin is imported now, so that its failure shows at load time.
        REGISTRY.check(name)
        return name

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data: Any) -> Any:
        """Each table that is not a field: an algorithm's parameter section, validated."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for key, value in data.items():
            if key in cls.model_fields:
                continue
            kind = REGISTRY.section(key)
            if kind is None and isinstance(value, dict):
                near = did_you_mean(key, REGISTRY.names())
                raise ValueError(
                    f"algorithm.{key}: no algorithm has such a parameter section{near}"
                )
            if kind is None:  # a mistyped setting (batch_szie), not a table
                near = did_you_mean(key, cls.model_fields)
                raise ValueError(f"algorithm.{key}: Extra inputs are not permitted{near}")
            try:
                out[key] = kind.model_validate(value)
            except ValidationError as exc:
                problems = "; ".join(_param_problem(key, kind, e) for e in exc.errors())
                raise ValueError(problems) from None
        return out

    @property
    def effective_server_lr(self) -> float:
        return self.server_lr or self.lr

    def section(self, kind: type[P]) -> P:
        """The job's values of one parameter section (its defaults when the file has none)."""
        for value in (self.model_extra or {}).values():
            if isinstance(value, kind):
                return value
        return kind()

    def params(self) -> dict[str, str | int | float | bool]:
        """The chosen algorithm's own parameters (empty for those without any)."""
        kind = REGISTRY.get(self.name).params
        return {} if kind is None else self.section(kind).model_dump()


class ClientsSection(_Section):
    count: int = Field(default=4, ge=1)
    # Each sync round's cohort, sampled from the live members with training samples (seeded by
    # job.seed, the round and the attempt): `per_round` of them, or, when it is 0, `fraction` of
    # them (rounded half up). At least one, at most all; set one of the two, not both. Async
    # mode has no cohorts: every member trains (docs/async.md).
    fraction: float = Field(default=1.0, gt=0, le=1)
    per_round: int = Field(default=0, ge=0)
    # Round 1, and the first round of a resumed job, start when this many clients have joined
    # (or start_timeout_s passed with >= 1).
    min_to_start: int = Field(default=1, ge=1)
    start_timeout_s: float = Field(default=60.0, gt=0)
    heartbeat_s: float = Field(default=2.0, gt=0)
    # A member whose heartbeats stop is dropped after this long.
    heartbeat_ttl_s: float = Field(default=10.0, gt=0)
    # How long a client waits for one gradient before republishing the batch.
    reply_timeout_s: float = Field(default=30.0, gt=0)
    # What this client declares at Join (FedSplitX: the deepest depth level it can run, from
    # which the coordinator assigns its level); 0: declare nothing.
    capability: int = Field(default=0, ge=0)
    # Simulated clients' capabilities by data partition, as counts per capability 1, 2, ...:
    # "16,16,18" gives partitions 0-15 capability 1, 16-31 capability 2, 32-49 capability 3.
    # The counts must add up to `count`. Used when `capability` is 0; empty: none.
    capability_mix: str = ""

    @model_validator(mode="after")
    def _one_cohort_size(self) -> ClientsSection:
        if self.per_round and self.fraction < 1.0:
            raise ValueError(
                f"clients.per_round ({self.per_round}) and clients.fraction ({self.fraction:g}) "
                "both size the cohort: set one of them (per_round = 0 uses the fraction)"
            )
        if self.per_round > self.count:
            raise ValueError(
                f"clients.per_round ({self.per_round}) exceeds clients.count ({self.count})"
            )
        return self

    @model_validator(mode="after")
    def _mix_fits(self) -> ClientsSection:
        counts = self.mix_counts()
        if counts and sum(counts) != self.count:
            raise ValueError(
                f"clients.capability_mix {self.capability_mix!r} covers {sum(counts)} "
                f"clients, clients.count is {self.count}"
            )
        return self

    def cohort_size(self, live: int) -> int:
        """How many of `live` members a round samples (0 when there are none)."""
        wanted = self.per_round or math.floor(self.fraction * live + 0.5)
        return min(live, max(1, wanted))

    def mix_counts(self) -> tuple[int, ...]:
        """The counts of `capability_mix` (ValueError when it is not a list of counts)."""
        text = self.capability_mix.strip()
        if not text:
            return ()
        try:
            counts = tuple(int(part) for part in text.split(","))
        except ValueError:
            raise ValueError(
                f"clients.capability_mix {text!r}: expected counts like '16,16,18'"
            ) from None
        if any(c < 0 for c in counts):
            raise ValueError(f"clients.capability_mix {text!r}: counts must be >= 0")
        return counts

    def declared_capability(self, partition: int | None) -> int:
        """The capability a client declares: `capability`, else its partition's in the mix,
        else 0 (none)."""
        if self.capability or partition is None:
            return self.capability
        ends = accumulate(self.mix_counts())
        return next((level for level, end in enumerate(ends, start=1) if partition < end), 0)


class RoundsSection(_Section):
    # "sync": rounds (cohort, deadline, quorum); "async": no rounds, a new version whenever
    # [asynchronous] buffer_size updates have arrived (FedBuff; docs/async.md).
    mode: Literal["sync", "async"] = "sync"
    # A round closes when every participant reported, or at the deadline with a quorum.
    deadline_s: float = Field(default=120.0, gt=0)
    quorum: float = Field(default=0.5, gt=0, le=1)
    # A round's version waits for every shard's replica however long it takes (without it the
    # round's server training would be lost); every this many seconds of waiting the aggregator
    # says which shards it waits for and whether a live worker holds them.
    replica_timeout_s: float = Field(default=60.0, gt=0)
    # A round that got no valid update is reopened with a new cohort; this many such attempts
    # in a row fail the job, with their reasons (e.g. every model diverged: NaN updates are
    # refused). An attempt whose whole cohort left does not count. 0: reopen for ever.
    max_empty_attempts: int = Field(default=3, ge=0)


class AsynchronousSection(_Section):
    """FedBuff-style asynchronous mode (`rounds.mode = "async"`); ignored in sync mode."""

    # K: the aggregator folds the buffered updates into a new version when this many arrived
    # (at most clients.count).
    buffer_size: int = Field(default=4, ge=1)
    # s(tau) of services/algorithms/staleness.py: constant, polynomial (1+tau)^-a, hinge.
    staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
    a: float = Field(default=0.5, ge=0)
    b: int = Field(default=4, ge=0)  # hinge: no discount up to b versions
    # An update more than this many versions behind is refused (Error "too_stale").
    max_staleness: int = Field(default=4, ge=0)
    # Workers drop smashed data computed with client weights more than this many versions
    # behind (GradientReply "rejected", reason "too_stale: ..."); the client fetches newer ones.
    worker_max_staleness: int = Field(default=4, ge=0)
    # The job fails when this many local rounds per client (times clients.count) in a row come
    # to nothing, with no update buffered in between: dropped by their client (RoundDropped,
    # e.g. a diverged model) or refused as unusable. Async's counterpart of
    # rounds.max_empty_attempts; too-stale updates do not count. 0: never.
    max_fruitless_per_client: int = Field(default=3, ge=0)


class WorkersSection(_Section):
    count: int = Field(default=1, ge=1)
    checkpoint_every_steps: int = Field(default=50, ge=1)
    checkpoint_every_s: float = Field(default=10.0, gt=0)
    # SFL variants: fold up to this many queued messages of a shard into one forward/backward
    # (1 = strictly sequential, the papers' semantics). MiniBatch-SFL always batches per step.
    batch_messages: int = Field(default=1, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Decode (and copy to the device) the next delivery on a thread of its own while a step
    # runs (workers/device_io.py); "auto": with a CUDA device only, where it hides the copies.
    prefetch: Literal["auto", "on", "off"] = "auto"
    lease_ttl_s: float = Field(default=10.0, gt=0)
    # MiniBatch-SFL: how long a step waits for missing participants before going on without them.
    step_barrier_timeout_s: float = Field(default=30.0, gt=0)


# `services.algorithms.defences.KEY_PREFIX`, which imports torch: the config must not.
PRIVACY_PREFIX = "privacy."


class PrivacySection(_Section):
    """`[privacy]`: the client-side defences on smashed data (docs/privacy.md "Defences"), off
    by default. Validated here at load time; the values travel to clients among the
    algorithm's parameters (`entries`), where `services.algorithms.defences` checks them again
    as it builds them (a client does not trust a malformed config map)."""

    # sigma of the Gaussian noise N(0, sigma^2 I) added to z (after the clip), in z's units.
    noise_scale: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    # C: each sample's z is scaled to an L2 norm of at most C before the noise; unset: none.
    clip_norm: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # alpha: the client's loss gains alpha * dCor(x, z') (NoPeek, Vepakomma et al. 2020).
    nopeek_weight: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    @property
    def active(self) -> bool:
        return bool(self.noise_scale or self.clip_norm is not None or self.nopeek_weight)

    def entries(self, seed: int) -> dict[str, float | int]:
        """The settings as algorithm parameters (`privacy.<key>`), with the job's `seed` for
        the noise; none when every defence is off, so an undefended job's config is as it was."""
        if not self.active:
            return {}
        values = {k: v for k, v in self.model_dump().items() if v is not None}
        return {f"{PRIVACY_PREFIX}{k}": v for k, v in {**values, "seed": seed}.items()}


class EvaluationSection(_Section):
    # false: versions are not evaluated on the test set (accuracy and test loss are n/a,
    # metrics.json has them null) and clients of whole-model algorithms do not report their
    # local accuracy: runs that measure speed pay for no evaluation. An algorithm that needs
    # an accuracy to train (Sub-FedAvg's pruning gate) still computes its own.
    enabled: bool = True


class ReportSection(_Section):
    dir: str = "runs"
    plots: bool = True
    # Each plot is written in every one of these formats (PDF and SVG: vector, for papers).
    plot_formats: tuple[Literal["png", "pdf", "svg"], ...] = ("png",)
    # Experiment trackers fed beside the run directory's files, each writing into it
    # (services/report/tracking.py): "tensorboard" (tensorboard/), "mlflow" (mlruns/, a file
    # store). Their libraries come with `pip install 'splitmq[tracking]'`.
    tracking: tuple[Literal["tensorboard", "mlflow"], ...] = ()
    # MLflow's tracking store ("sqlite:///mlflow.db", "http://host:5000"); "": a file store in
    # the run directory, which needs no server.
    mlflow_uri: str = ""


class JobConfig(_Section):
    job: JobSection = JobSection()
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    clients: ClientsSection = ClientsSection()
    rounds: RoundsSection = RoundsSection()
    asynchronous: AsynchronousSection = AsynchronousSection()
    workers: WorkersSection = WorkersSection()
    privacy: PrivacySection = PrivacySection()
    evaluation: EvaluationSection = EvaluationSection()
    report: ReportSection = ReportSection()
    # The training recipe (services/algorithms/training.py): no [optimizer] name is plain SGD
    # from algorithm.lr, momentum and server_lr.
    optimizer: OptimizerSection = OptimizerSection()
    schedule: ScheduleSection = ScheduleSection()
    loss: LossSection = LossSection()

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        if self.clients.min_to_start > self.clients.count:
            raise ValueError(
                f"clients.min_to_start ({self.clients.min_to_start}) exceeds clients.count "
                f"({self.clients.count})"
            )
        # Algorithms that need rounds (MiniBatch-SFL: a per-step barrier over the cohort,
        # docs/async.md) say so at registration (their module, with torch, imported only then).
        spec = REGISTRY.get(self.algorithm.name) if self.asynchronous_mode else None
        if spec is not None and spec.sync_only:
            refusal = spec.build(self.algorithm.params()).async_refusal()
            raise ValueError(
                f"rounds.mode = 'async': algorithm {spec.name} stays synchronous ({refusal}); "
                "use rounds.mode = 'sync'"
            )
        if self.model.tail:
            self._u_shaped_supported()
        self._one_optimizer_setting()
        o, s = self.optimizer, self.schedule  # a recipe other than plain SGD and cross-entropy
        if o.name or o.server or s.name or s.server or not self.loss.is_default:
            self._recipe_usable()
        return self

    def _one_optimizer_setting(self) -> None:
        """The SGD settings of [algorithm] and an [optimizer] must not both be given: one
        would silently lose. A default value is no clash: a written-out config (the run
        directory's) holds every field."""
        a, fields = self.algorithm, AlgorithmSection.model_fields
        owned = ("lr", "momentum", "server_lr") if self.optimizer.name else ("server_lr",)
        clashes = [k for k in owned if getattr(a, k) != fields[k].default]
        if clashes and (self.optimizer.name or self.optimizer.server):
            table = "[optimizer]" if self.optimizer.name else "[optimizer.server]"
            where = (
                "lr and momentum go into [optimizer] (the server's into [optimizer.server])"
                if self.optimizer.name
                else "the server's lr goes into [optimizer.server]"
            )
            raise ValueError(
                f"algorithm.{clashes[0]} and {table} both set the optimizer: {where}; remove "
                f"algorithm.{', algorithm.'.join(clashes)}"
            )

    def _recipe_usable(self) -> None:
        """Names and arguments checked against torch, imported only for a job that sets a
        recipe (`splitmq check` on a plain one stays without torch)."""
        from services.algorithms.recipe import check_recipe

        check_recipe(self.optimizer, self.schedule, self.loss)
        wanted = REGISTRY.get(self.algorithm.name).strategy.traits.client_optimizers
        chosen = self.optimizer.client_side
        if wanted is not None and chosen is not None and chosen.name.lower() not in wanted:
            raise ValueError(
                f"optimizer.name = {chosen.name!r}: algorithm {self.algorithm.name} is written "
                f"for the client optimizer {' or '.join(sorted(wanted))} (docs/training.md); "
                "use that, or put another one in [optimizer.server] only"
            )

    def _u_shaped_supported(self) -> None:
        server = REGISTRY.build(self.algorithm.name, self.algorithm.params()).server
        if server is None or not server.u_shaped:
            raise ValueError(
                f"model.tail = {self.model.tail!r}: algorithm {self.algorithm.name} has no "
                "U-shaped split (sfl, sfl_v1, sfl_v2 and minibatch_sfl have); unset model.tail"
            )
        if self.asynchronous_mode:
            raise ValueError(
                f"model.tail = {self.model.tail!r}: the U-shaped split runs in sync rounds "
                "only; use rounds.mode = 'sync' or unset model.tail"
            )

    @property
    def asynchronous_mode(self) -> bool:
        return self.rounds.mode == "async"

    @property
    def buffer_size(self) -> int:
        """K as the aggregator uses it: never more than the job's client slots (a buffer of
        more could never fill)."""
        return min(self.asynchronous.buffer_size, self.clients.count)

    @property
    def shards(self) -> int:
        """S after the algorithm's rule (design §1)."""
        spec = REGISTRY.get(self.algorithm.name)
        return spec.shards(self.algorithm.shards, self.clients.count)
