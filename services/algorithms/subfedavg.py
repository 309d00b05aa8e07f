"""Sub-FedAvg (Vahidian et al.): personalised subnetworks by pruning, averaged where they meet.

Client: its binary mask lives in `ClientContext.memory` across rounds (all ones at first). The
assigned weights are masked with it, gradients are masked so pruned weights stay exactly zero,
and candidate masks are derived after the first and the last local epoch (`pruning`,
`prune_layout`). A new mask is tried when the two differ by more than `dist_thresh` and the
sparsity is below `target`, and kept when the pruned model's local accuracy exceeds
`acc_thresh`. The client uploads its masked weights and its masks.

Server: intersection averaging (`masked_averaging`); each participant's personalised model,
the new global model under its mask, is published as its personal blob so that the
aggregator's personalised accuracy evaluates the model the client will train from.

Scope "full": FL on the whole model, as in the paper. Scope "client": the client side of a
split model, the server side trained as in SFL (SFL-V2 with one shard).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from broker.messages import ConfigValue
from broker.store import CLIENT_PART, GLOBAL_OWNER, BlobRef
from models.split import SplitNet
from models.state import client_state
from services.algorithms.averaging import weighted_average
from services.algorithms.base import (
    ClientContext,
    ClientUpdate,
    CohortBatch,
    Hyper,
    RoundResult,
    ShardReplica,
    SmashedChannel,
    VersionWeights,
)
from services.algorithms.fedavg import full_state
from services.algorithms.flops import count_flops
from services.algorithms.masked_averaging import intersection_average
from services.algorithms.prune_layout import PruneLayout, build_layout
from services.algorithms.pruning import (
    AdoptionRule,
    Masks,
    apply_masks,
    channel_mask,
    flat_hamming,
    hamming_distance,
    mask_gradients,
    masked_state,
    param_reduction,
    percentile_mask,
    step_percent,
)
from services.algorithms.sfl import SERVER, SFL, split_initial_weights
from services.config.algorithms import SubFedAvgSection

CLIENT = BlobRef(CLIENT_PART)
WEIGHT_KEY = "subfedavg.weights."  # + weight name: the |w| masks in ClientContext.memory
CHANNEL_KEY = "subfedavg.channels."  # + BN module name: the hybrid's channel masks
Shapes = Mapping[str, torch.Size]


@dataclass(frozen=True)
class MaskSet:
    """A client's masks: per pruned weight (|w|), and per conv unit (hybrid channels)."""

    weights: Masks
    channels: Masks

    @classmethod
    def recall(
        cls, memory: Mapping[str, torch.Tensor], layout: PruneLayout, shapes: Shapes
    ) -> MaskSet:
        """The masks kept in `memory`; all ones for what it lacks (a first round, a new cut)."""
        weights = {n: _kept(memory.get(WEIGHT_KEY + n), shapes[n]) for n in layout.weights}
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

    def elements(self, layout: PruneLayout, shapes: Shapes) -> Masks:
        return layout.element_masks(self.weights, self.channels, shapes)


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


@dataclass(frozen=True)
class SubFedAvg:
    config: SubFedAvgSection
    name: str = "subfedavg"
    server_barrier: bool = False

    @classmethod
    def from_params(cls, params: Mapping[str, ConfigValue]) -> SubFedAvg:
        return cls(SubFedAvgSection.model_validate(dict(params)))

    @property
    def splits(self) -> bool:
        return self.config.scope == "client"

    @property
    def waits_for_gradient(self) -> bool:
        return self.splits

    def initial_weights(self, model: SplitNet, cut: str) -> VersionWeights:
        if self.splits:
            return split_initial_weights(model, cut)
        return {CLIENT: full_state(model)}

    # --- client ---------------------------------------------------------------------------
    def client_round(
        self,
        model: SplitNet,
        cut: str,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        steps: int,
        channel: SmashedChannel,
        hyper: Hyper,
        context: ClientContext,
    ) -> RoundResult:
        last = len(model.blocks) if not self.splits else model.cut_index(cut) + 1
        layout = build_layout(model, self.config.mode, range(last))
        shapes = {n: t.shape for n, t in model.state_dict().items()}
        current = MaskSet.recall(context.memory, layout, shapes)
        masks = current.elements(layout, shapes)
        apply_masks(model, masks)  # the assigned (global) weights, under this client's mask
        model.train()
        optimizer = hyper.client_optimizer(layout.params(model).values())
        first = first_checkpoint(steps, hyper.local_epochs)
        early: MaskSet | None = None
        samples = 0
        for step, (x, y) in enumerate(batches):
            optimizer.zero_grad(set_to_none=True)
            self._backward(model, cut, x, y, step, steps, channel)
            mask_gradients(model, masks)
            optimizer.step()
            samples += int(y.shape[0])
            if step + 1 == first:
                early = self._candidates(model, layout, current, masks, self.config.prune_percent)
        late = self._candidates(model, layout, current, masks, self.config.prune_percent)
        trial = self._adopt(
            model, layout, shapes, current, early or current, late, channel, context
        )
        trial.masks.remember(context.memory)
        final = trial.masks.elements(layout, shapes)
        weights = client_state(model, cut) if self.splits else full_state(model)
        return RoundResult(
            {n: t.detach().clone() for n, t in weights.items()},
            masks={n: m.clone() for n, m in final.items()},
            metrics=self._metrics(model, layout, final, trial, samples, context),
        )

    def _backward(
        self,
        model: SplitNet,
        cut: str,
        x: torch.Tensor,
        y: torch.Tensor,
        step: int,
        steps: int,
        channel: SmashedChannel,
    ) -> None:
        if not self.splits:
            F.cross_entropy(model(x), y).backward()
            return
        z = model.client_blocks(cut)(x)
        grad = channel.exchange(z.detach(), y, step, steps)
        z.backward(grad.to(dtype=z.dtype))

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
        model: SplitNet,
        layout: PruneLayout,
        shapes: Shapes,
        current: MaskSet,
        early: MaskSet,
        late: MaskSet,
        channel: SmashedChannel,
        context: ClientContext,
    ) -> Trial:
        cfg = self.config
        params = layout.params(model)

        def accuracy() -> float:
            if self.splits:
                return reported_accuracy(channel)
            return context.local_accuracy(model)

        chosen, adopted = current, 0
        distance = hamming_distance(early.weights, late.weights)
        sparsity = param_reduction(params, current.elements(layout, shapes))
        rule = AdoptionRule(cfg.dist_thresh, cfg.target, cfg.acc_thresh)
        if layout.weights and rule.should_try(distance, sparsity):
            percent = step_percent(cfg.prune_percent, sparsity, cfg.target)
            masks = current.elements(layout, shapes)
            weights = (
                late.weights
                if percent == cfg.prune_percent
                else self._candidates(model, layout, current, masks, percent).weights
            )
            candidate = MaskSet(weights, current.channels)
            if self._trial(model, candidate.elements(layout, shapes), rule, accuracy):
                chosen, adopted = candidate, 1
        channel_distance = 0.0
        if layout.units:
            channel_distance = flat_hamming(
                list(early.channels.values()), list(late.channels.values())
            )
            sparsity = param_reduction(params, chosen.elements(layout, shapes))
            rule = AdoptionRule(cfg.channel_dist_thresh, cfg.target, cfg.acc_thresh)
            if rule.should_try(channel_distance, sparsity):
                candidate = MaskSet(chosen.weights, late.channels)
                if self._trial(model, candidate.elements(layout, shapes), rule, accuracy):
                    chosen, adopted = candidate, adopted + 1
        return Trial(chosen, distance, adopted, channel_distance)

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
        self,
        model: SplitNet,
        layout: PruneLayout,
        final: Masks,
        trial: Trial,
        samples: int,
        context: ClientContext,
    ) -> dict[str, float]:
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
        if not self.splits:
            metrics["report.local_accuracy"] = context.local_accuracy(model)
        return metrics

    # --- worker -----------------------------------------------------------------------------
    def server_step(
        self, server: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[CohortBatch]
    ) -> list[tuple[torch.Tensor, float, int]]:
        if not self.splits:
            raise RuntimeError("Sub-FedAvg on the full model has no server side")
        return SFL().server_step(server, optimizer, batches)

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
        trained = [r for r in replicas if r.samples > 0]
        if self.splits and trained:
            out[SERVER] = weighted_average(
                [r.weights for r in trained], [r.samples for r in trained]
            )
        return out


def reported_accuracy(channel: SmashedChannel) -> float:
    """The round's training accuracy as the worker reported it, when the channel keeps a tally
    (the broker's does); +inf when unknown, so the accuracy gate does not block pruning.

    A split client holds no server side, so it cannot evaluate its pruned model locally; this
    is the best local evidence it has that its model is past the accuracy threshold.
    """
    tally = getattr(channel, "tally", None)
    metrics: Mapping[str, float] = tally.metrics() if tally is not None else {}
    return float(metrics.get("train_accuracy", math.inf))
