"""Sub-FedAvg (Vahidian et al.): personalised subnetworks by pruning, averaged where they meet.

Client: its binary mask lives in `ClientContext.memory` across rounds (all ones at first). The
assigned weights are masked with it, gradients are masked so pruned weights stay exactly zero,
and candidate masks are derived after the first and the last local epoch (`pruning`). A new
mask is tried when the two differ by more than `dist_thresh` and the sparsity is below
`target`, and kept when the pruned model's local accuracy exceeds `acc_thresh`. The client
uploads its masked weights and its masks.

Server: intersection averaging (`intersection_average`); each participant's personalised model,
the new global model under its mask, is published as its personal blob so that the
aggregator's personalised accuracy evaluates the model the client will train from.

Scope "full": FL on the whole model, as in the paper. Scope "client": the client side of a
split model, the server side trained as in SFL (SFL-V2 with one shard).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Self

import torch
from pydantic import Field
from torch import nn

from broker.store import CLIENT_PART, GLOBAL_OWNER, BlobRef
from models.state import client_state
from services.algorithms.averaging import normalised, weighted_average
from services.algorithms.base import (
    CLIENT,
    ClientUpdate,
    LocalRound,
    Params,
    RoundResult,
    ServerSide,
    ShardReplica,
    SmashedChannel,
    State,
    StrategyBase,
    VersionWeights,
    algorithm,
    average_replicas,
    full_state,
)
from services.algorithms.pruning import (
    AdoptionRule,
    Masks,
    PruneLayout,
    apply_masks,
    build_layout,
    channel_mask,
    count_flops,
    flat_hamming,
    gradient_masker,
    hamming_distance,
    masked_state,
    param_reduction,
    percentile_mask,
    step_percent,
)
from services.algorithms.sfl import SFLServer

WEIGHT_KEY = "subfedavg.weights."  # + weight name: the |w| masks in ClientContext.memory
CHANNEL_KEY = "subfedavg.channels."  # + BN module name: the hybrid's channel masks


class SubFedAvgSection(Params):
    mode: Literal["unstructured", "hybrid"] = "unstructured"
    # Fraction of the live weights pruned each time a new mask is adopted.
    prune_percent: float = Field(default=0.1, gt=0, lt=1)
    # Final sparsity the client stops pruning at.
    target: float = Field(default=0.5, ge=0, lt=1)
    # Adopt a new mask only if the mean Hamming distance exceeds this...
    dist_thresh: float = Field(default=0.0001, ge=0)
    # ...and the local accuracy exceeds this.
    acc_thresh: float = Field(default=0.5, ge=0, le=1)
    # Apply to the full model (FL, as in the paper) or the client side of a split model.
    scope: Literal["full", "client"] = "full"
    # Hybrid: fraction of a conv layer's alive channels pruned (by |BN scale|) per adoption...
    channel_percent: float = Field(default=0.45, gt=0, lt=1)
    # ...adopted if the channel masks of the first and last epoch differ by more than this...
    channel_dist_thresh: float = Field(default=0.01, ge=0)
    # ...and never below this fraction of a layer's channels (the reference's cfg_prune).
    channel_floor: float = Field(default=0.5, gt=0, le=1)
    # Intersection averaging weights: equal (the paper) or the clients' sample counts.
    sample_weighted: bool = False


@dataclass(frozen=True)
class MaskSet:
    """A client's masks: per pruned weight (|w|), and per conv unit (hybrid channels)."""

    weights: Masks
    channels: Masks

    @classmethod
    def recall(cls, memory: Mapping[str, torch.Tensor], layout: PruneLayout) -> MaskSet:
        """The masks kept in `memory`; all ones for what it lacks (a first round, a new cut)."""
        weights = {n: _kept(memory.get(WEIGHT_KEY + n), layout.shapes[n]) for n in layout.weights}
        channels = {
            u.bn: _kept(memory.get(CHANNEL_KEY + u.bn), torch.Size([u.channels]))
            for u in layout.units
        }
        return cls(weights, channels)

    def remember(self, memory: MutableMapping[str, torch.Tensor]) -> None:
        for name, mask in self.weights.items():
            memory[WEIGHT_KEY + name] = mask
        for name, mask in self.channels.items():
            memory[CHANNEL_KEY + name] = mask

    def elements(self, layout: PruneLayout) -> Masks:
        return layout.element_masks(self.weights, self.channels)


def _kept(saved: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    if saved is None or saved.shape != shape:
        return torch.ones(shape, dtype=torch.bool)
    return saved.bool()


def first_checkpoint(steps: int, local_epochs: int) -> int:
    """The step after which the early candidate mask is derived: the end of the first of the
    round's `local_epochs` epochs (steps split evenly when `max_steps` caps the round); with one
    epoch, its middle, since a first and a last epoch that coincide could never differ."""
    if local_epochs > 1:
        return max(1, steps // local_epochs)
    return max(1, steps // 2)


@dataclass(frozen=True)
class Trial:
    """What the adoption step decided."""

    masks: MaskSet
    distance: float
    adopted: int  # masks adopted this round (hybrid: |w| and channel masks count apart)
    channel_distance: float = 0.0
    # The local accuracy of the model as the adoption step leaves it, when a trial measured
    # it (an accepted trial's model is the final one): not measured a second time.
    accuracy: float | None = None


@algorithm("subfedavg", params=SubFedAvgSection)
class SubFedAvg(StrategyBase):
    config: SubFedAvgSection = field(default_factory=SubFedAvgSection)
    name: str = "subfedavg"

    @classmethod
    def create(cls, name: str, params: Params | None) -> Self:
        assert isinstance(params, SubFedAvgSection)
        return cls(config=params, name=name)

    @cached_property
    def server(self) -> ServerSide | None:
        """Scope "client": the server side trains as in SFL; "full": no split."""
        return SFLServer() if self.config.scope == "client" else None

    @property
    def _splits(self) -> bool:
        return self.server is not None

    # --- client ---------------------------------------------------------------------------
    def client_round(self, r: LocalRound) -> RoundResult:
        model, cut = r.model, r.cut
        last = len(model.blocks) if not self._splits else model.cut_index(cut) + 1
        layout = build_layout(model, self.config.mode, range(last))
        current = MaskSet.recall(r.context.memory, layout)
        masks = current.elements(layout)
        apply_masks(model, masks)  # the assigned (global) weights, under this client's mask
        model.train()
        optimizer = r.hyper.client_optimizer(layout.params(model).values())
        first = first_checkpoint(r.steps, r.hyper.local_epochs)
        early: MaskSet | None = None
        samples = 0
        mask_gradients = gradient_masker(model, masks)
        for step, (x, y) in enumerate(r.batches):
            optimizer.zero_grad(set_to_none=True)
            self._backward(r, x, y, step)
            mask_gradients()
            optimizer.step()
            samples += int(y.shape[0])
            if step + 1 == first:
                early = self._candidates(model, layout, current, masks, self.config.prune_percent)
        late = self._candidates(model, layout, current, masks, self.config.prune_percent)
        trial = self._adopt(r, layout, current, early or current, late)
        trial.masks.remember(r.context.memory)
        final = trial.masks.elements(layout)
        weights = client_state(model, cut) if self._splits else full_state(model)
        return RoundResult(
            {n: t.detach().clone() for n, t in weights.items()},
            masks={n: m.clone() for n, m in final.items()},
            metrics=self._metrics(r, layout, final, trial, samples),
        )

    def _backward(self, r: LocalRound, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        if not self._splits:
            r.hyper.loss(r.model(x), y).backward()
            return
        smashed = self.smashed(r, x, r.model.client_blocks(r.cut)(x), step)
        smashed.backward(r.channel.exchange(smashed.wire(), y, step, r.steps))

    def _candidates(
        self, model: nn.Module, layout: PruneLayout, current: MaskSet, masks: Masks, percent: float
    ) -> MaskSet:
        """Masks derived from the weights as they are now (the model is not changed)."""
        state = model.state_dict()
        weights = {n: percentile_mask(state[n], masks[n], percent) for n in layout.weights}
        channels = {
            u.bn: channel_mask(
                state[f"{u.bn}.weight"],
                current.channels[u.bn],
                self.config.channel_percent,
                max(1, math.ceil(self.config.channel_floor * u.channels)),
            )
            for u in layout.units
        }
        return MaskSet(weights, channels)

    def _adopt(
        self,
        r: LocalRound,
        layout: PruneLayout,
        current: MaskSet,
        early: MaskSet,
        late: MaskSet,
    ) -> Trial:
        cfg, model = self.config, r.model
        params = layout.params(model)

        measured: list[float] = []  # the last trial's accuracy, while its model stands

        def accuracy() -> float:
            value = (
                reported_accuracy(r.channel) if self._splits else r.context.local_accuracy(model)
            )
            measured[:] = [value]
            return value

        chosen, adopted, known = current, 0, None
        distance = hamming_distance(early.weights, late.weights)
        masks = current.elements(layout)
        sparsity = param_reduction(params, masks)
        rule = AdoptionRule(cfg.dist_thresh, cfg.target, cfg.acc_thresh)
        if layout.weights and rule.should_try(distance, sparsity):
            percent = step_percent(cfg.prune_percent, sparsity, cfg.target)
            weights = (
                late.weights
                if percent == cfg.prune_percent
                else self._candidates(model, layout, current, masks, percent).weights
            )
            candidate = MaskSet(weights, current.channels)
            if self._trial(model, candidate.elements(layout), rule, accuracy):
                chosen, adopted, known = candidate, 1, measured[0]
        channel_distance = 0.0
        if layout.units:
            channel_distance = flat_hamming(
                list(early.channels.values()), list(late.channels.values())
            )
            sparsity = param_reduction(params, chosen.elements(layout))
            rule = AdoptionRule(cfg.channel_dist_thresh, cfg.target, cfg.acc_thresh)
            if rule.should_try(channel_distance, sparsity):
                candidate = MaskSet(chosen.weights, late.channels)
                if self._trial(model, candidate.elements(layout), rule, accuracy):
                    chosen, adopted, known = candidate, adopted + 1, measured[0]
        # A rejected trial restores the model it found, so `known` still describes it.
        return Trial(chosen, distance, adopted, channel_distance, None if self._splits else known)

    @staticmethod
    def _trial(
        model: nn.Module, masks: Masks, rule: AdoptionRule, accuracy: Callable[[], float]
    ) -> bool:
        """Prune `model` with `masks`; keep it if `rule` accepts its accuracy, else undo."""
        state = model.state_dict()
        before = {n: state[n].detach().clone() for n in masks}
        apply_masks(model, masks)
        if rule.accepts(accuracy()):
            return True
        with torch.no_grad():
            for name, value in before.items():
                state[name].copy_(value)
        return False

    def _metrics(
        self, r: LocalRound, layout: PruneLayout, final: Masks, trial: Trial, samples: int
    ) -> dict[str, float]:
        model = r.model
        metrics = {
            "train_samples": float(samples),
            "mask_distance": trial.distance,
            "mask_adopted": float(trial.adopted),
            # `report.*` metrics reach the run's report, per client and averaged.
            "report.param_reduction": param_reduction(layout.params(model), final),
            "report.flop_reduction": count_flops(model, layout.prefixes, final).reduction,
        }
        if layout.units:
            total = sum(u.channels for u in layout.units)
            kept = sum(int(m.sum()) for m in trial.masks.channels.values())
            metrics["channel_distance"] = trial.channel_distance
            metrics["report.channel_reduction"] = 1.0 - kept / total
        if not self._splits:
            # The client's own model after its round: the paper's personalised metric
            # (`personal_accuracy`, which the client would otherwise measure again) and the
            # cohort's per-client column.
            accuracy = r.context.local_accuracy(model) if trial.accuracy is None else trial.accuracy
            metrics["personal_accuracy"] = metrics["report.local_accuracy"] = accuracy
        return metrics

    # --- aggregator -------------------------------------------------------------------------
    def aggregate(
        self,
        previous: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
    ) -> VersionWeights:
        if not updates:
            raise ValueError("no client updates to aggregate")
        # Last round's personalised models are stale now: clients mask the new global model.
        out = {
            ref: w
            for ref, w in previous.items()
            if not (ref.part == CLIENT_PART and ref.owner != GLOBAL_OWNER)
        }
        weights = [float(u.samples) for u in updates] if self.config.sample_weighted else None
        merged = intersection_average(
            previous[CLIENT],
            [u.client_weights for u in updates],
            [u.masks for u in updates],
            weights,
        )
        out[CLIENT] = merged
        for u in updates:
            out[BlobRef(CLIENT_PART, u.client)] = masked_state(merged, u.masks)
        return average_replicas(out, replicas) if self._splits else out


def reported_accuracy(channel: SmashedChannel) -> float:
    """The round's training accuracy as the worker reported it; +inf when it reported none, so
    the accuracy gate does not block pruning.

    A split client holds no server side, so it cannot evaluate its pruned model locally; this
    is the best local evidence it has that its model is past the accuracy threshold.
    """
    return float(channel.tally.metrics().get("train_accuracy", math.inf))


def intersection_average(
    previous: State,
    states: Sequence[State],
    masks: Sequence[State],
    weights: Sequence[float] | None = None,
) -> dict[str, torch.Tensor]:
    """Average each element over the clients whose mask keeps it.

    For a tensor some client masks: `w = sum_k a_k m_k w_k / sum_k a_k m_k` per element, where
    `m_k` is 1 where client k keeps the element (a client without a mask for that tensor keeps
    all of it) and `a_k` its weight (`weights`; equal weights when None, as the paper and its
    reference code do); an element no client keeps (count 0) keeps its `previous` value.
    Tensors nobody masks are the plain `a_k`-weighted average (integer buffers: the maximum).
    """
    if not states:
        raise ValueError("no client states to average")
    if len(masks) != len(states):
        raise ValueError(f"{len(states)} states but {len(masks)} mask sets")
    alphas = normalised([1.0] * len(states) if weights is None else list(weights))
    masked = {name for m in masks for name in m}
    plain = [{n: t for n, t in s.items() if n not in masked} for s in states]
    out = weighted_average(plain, alphas)
    for name in sorted(masked):
        out[name] = _masked_mean(name, previous, states, masks, alphas)
    return out


def _masked_mean(
    name: str,
    previous: State,
    states: Sequence[State],
    masks: Sequence[State],
    alphas: Sequence[float],
) -> torch.Tensor:
    if name not in previous:
        raise ValueError(f"{name}: masked by a client but absent from the previous version")
    old = previous[name]
    num = torch.zeros(old.shape, dtype=torch.float64)
    den = torch.zeros(old.shape, dtype=torch.float64)
    for k, (state, mask_set) in enumerate(zip(states, masks, strict=True)):
        if name not in state:
            raise ValueError(f"state {k} lacks the masked tensor {name}")
        value = state[name].detach().to(torch.float64)
        if value.shape != old.shape:
            raise ValueError(
                f"{name}: shape {tuple(value.shape)} in state {k}, expected {tuple(old.shape)}"
            )
        mask = mask_set.get(name)
        keep = torch.ones_like(den) if mask is None else mask.to(torch.float64)
        if keep.shape != old.shape:
            raise ValueError(f"{name}: mask shape {tuple(keep.shape)} in state {k}")
        num.add_(keep * value, alpha=alphas[k])
        den.add_(keep, alpha=alphas[k])
    averaged = torch.where(den > 0, num / den.clamp_min(1e-300), old.detach().to(torch.float64))
    return averaged.to(old.dtype)
