"""FedSplitX (Shin et al.) and local-loss SFL (AccSFL), its one-level special case.

Depth levels are the partition points c_1..c_M (`[algorithm.fedsplitx] cuts`, default the
model's cuts); the coordinator gives each client a level from the capability it declares at
Join. A client at level m trains blocks `[:c_m]` and heads a_1..a_m on `sum_{i<=m} l(a_i, y)`
and uploads its detached activation at c_m with the labels, never waiting for a gradient. The
worker's replica holds everything after c_1 and trains a batch from level m on
`sum_{i>m} l(a_i, y) + l(output, y)`, starting at the batch's cut. Aggregation is heteroavg
(below). Local-loss SFL has one level, the job's cut (`model.cut`), and no server heads.

Blobs: `client/global` holds the blocks up to c_M (a client loads them all and trains its own),
`server/global` the blocks after c_1 with the heads of c_2..c_M (the replica), `aux/global` the
heads of every level; how a tensor held by both sides is averaged: `FedSplitXSection.aggregation`.

The math, for a client at level m:
- client loss: `sum_{i<=m} l(a_i(z_i), y)`, z_i the activation at c_i (`local_loss`);
- server loss for a batch from level m: `sum_{i>m} l(a_i(z_i), y) + l(f(x), y)` (`server_loss`);
- heteroavg: each tensor is the weighted mean over those that trained it this round (a client
  holding it, a shard replica that ran batches through it), weighted by the samples each
  trained it on; a tensor nobody trained keeps its previous value (`heteroavg`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Literal, Self

import torch
from pydantic import Field
from torch import Tensor, nn

from models.flops import flops_by_layer, forward_flops
from models.parts import ServerModel
from models.split import SplitNet, evaluating, forward_heads
from models.state import client_state, head_state, load_partial, server_state
from services.algorithms.averaging import heteroavg
from services.algorithms.base import (
    AUX,
    CLIENT,
    SERVER,
    ClientUpdate,
    CohortBatch,
    LocalRound,
    Params,
    RoundResult,
    ServerSide,
    ShardReplica,
    State,
    StepResults,
    StrategyBase,
    Traits,
    VersionWeights,
    algorithm,
)
from services.algorithms.recipe import LossFn, cross_entropy

Holding = tuple[State, float]  # a state and the samples it was trained on


class FedSplitXSection(Params):
    # Partition points, comma-separated cut names shallow to deep ("block1,block2,block3"); a
    # client at level m holds the blocks up to the m-th. Empty: the model's cuts. (local_loss_sfl
    # ignores it: its one level is the job's cut, model.cut.)
    cuts: str = Field(default="", pattern=r"^\s*([A-Za-z0-9_]+\s*(,\s*[A-Za-z0-9_]+\s*)*)?$")
    # Level assigned when a client declares no capability (Join.capability = 0) and has none in
    # clients.capability_mix; capped at the number of levels.
    default_level: int = Field(default=1, ge=1)
    # "merged": a tensor in two blobs (a middle block on the clients and on the server) is one
    # tensor, the heteroavg of all its holders. "separate": the paper's "aggregates the
    # client-side model and server-side model separately" (fed server and main server), so
    # w^c (blocks to c_M and heads, from the clients) and w^s (blocks after c_1 and the server's
    # heads, from the replicas) are two models that share no value; the full model of level m
    # is w^c[:c_m] followed by w^s[c_m:].
    aggregation: Literal["merged", "separate"] = "merged"


def parse_cuts(text: str) -> tuple[str, ...]:
    """`"block1, block2"` → ("block1", "block2"); empty text gives ()."""
    cuts = tuple(part.strip() for part in text.split(",") if part.strip())
    if len(set(cuts)) != len(cuts):
        raise ValueError(f"partition points must be distinct, got {text!r}")
    return cuts


def local_loss(head_logits: Sequence[Tensor], y: Tensor, loss: LossFn = cross_entropy) -> Tensor:
    """The client's loss `sum_{i<=m} l(a_i(z_i), y)` over its heads' logits."""
    if not head_logits:
        raise ValueError("a client trains at least one head")
    return torch.stack([loss(logits, y) for logits in head_logits]).sum()


def server_loss(
    head_logits: Sequence[Tensor], output: Tensor, y: Tensor, loss: LossFn = cross_entropy
) -> Tensor:
    """The server's loss for one batch: `sum_{i>m} l(a_i(z_i), y) + l(output, y)`."""
    return torch.stack([loss(t, y) for t in (*head_logits, output)]).sum()


def tensor_depth(name: str, cut_index: Mapping[str, int]) -> int | None:
    """Where a state-dict name sits in the chain: block i for `blocks.<i>.*`, and for the head
    of cut c (`heads.<c>.*`) the index of the block c follows; None for other names."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "blocks" and parts[1].isdigit():
        return int(parts[1])
    if len(parts) >= 2 and parts[0] == "heads" and parts[1] in cut_index:
        return cut_index[parts[1]]
    return None


def replica_holdings(
    weights: State,
    cut_samples: Mapping[str, int],
    cut_index: Mapping[str, int],
    trained_heads: Collection[str],
) -> list[Holding]:
    """A shard replica as heteroavg holders: its tensors grouped by the samples that went
    through them. A batch from cut c trains the blocks after c and the heads in `trained_heads`
    after c, so a tensor at depth d was trained on the rows of every cut before d; tensors no
    batch reached (weight 0) are not held."""
    unknown = sorted(set(cut_samples) - set(cut_index))
    if unknown:
        raise ValueError(f"replica trained on batches from unknown cuts {unknown}")
    groups: dict[float, dict[str, Tensor]] = {}
    for name, tensor in weights.items():
        depth = tensor_depth(name, cut_index)
        if depth is None:
            continue
        if name.startswith("heads.") and name.split(".")[1] not in trained_heads:
            continue
        samples = float(sum(n for c, n in cut_samples.items() if cut_index[c] < depth))
        if samples > 0:
            groups.setdefault(samples, {})[name] = tensor
    return [(state, samples) for samples, state in groups.items()]


def check_levels(model: SplitNet, levels: Sequence[str]) -> tuple[str, ...]:
    """`levels` if they are cuts of `model` in block order; `ValueError` otherwise."""
    if not levels:
        raise ValueError("FedSplitX needs at least one partition point")
    indices = [model.cut_index(c) for c in levels]  # ModelSpecError (a ValueError) if unknown
    if indices != sorted(set(indices)):
        raise ValueError(f"partition points must be distinct and shallow to deep: {levels}")
    return tuple(levels)


@dataclass(frozen=True)
class LevelCost:
    """Forward FLOPs per sample on each side for a client at one level (see models.flops)."""

    level: int
    cut: str
    client_flops: int  # blocks up to the cut and the heads a_1..a_m
    server_flops: int  # blocks after the cut, heads a_{m+1}..a_M and the output


def level_costs(model: SplitNet, levels: Sequence[str]) -> list[LevelCost]:
    """Client and server forward FLOPs per sample for each level of `levels` (for local-loss SFL
    at cut c: `level_costs(model, [c])`)."""
    levels = check_levels(model, levels)
    per_block = [0] * len(model.block_names)
    for name, flops in flops_by_layer(model, model.input_shape).items():
        per_block[int(name.split(".")[1])] += flops  # "blocks.<i>...."
    heads = {c: forward_flops(model.head(c), model.cut_shape(c)) for c in levels}
    costs = []
    for m, cut in enumerate(levels, start=1):
        split = model.cut_index(cut) + 1
        costs.append(
            LevelCost(
                level=m,
                cut=cut,
                client_flops=sum(per_block[:split]) + sum(heads[c] for c in levels[:m]),
                server_flops=sum(per_block[split:]) + sum(heads[c] for c in levels[m:]),
            )
        )
    return costs


@dataclass(frozen=True)
class Structure:
    """What aggregation and reporting need of the model (`FedSplitX.for_model`)."""

    levels: tuple[str, ...]
    cut_index: Mapping[str, int]
    costs: tuple[LevelCost, ...]


def level_cuts(
    model: SplitNet, cut: str, cuts: tuple[str, ...], one_level: bool
) -> tuple[str, ...]:
    """The depth levels' cuts, shallow to deep: `cuts` (the model's when empty), or `cut`,
    the job's, alone for local-loss SFL (`one_level`)."""
    return check_levels(model, (cut,) if one_level else (cuts or model.cuts))


@dataclass(frozen=True)
class LevelServer(ServerSide):
    """The replica of FedSplitX (and local-loss SFL): it trains each batch from the batch's own
    level's cut on the server loss and sends no gradient back."""

    waits_for_gradient: bool = False
    cuts: tuple[str, ...] = ()
    one_level: bool = False

    def batch_cuts(self, model: SplitNet, cut: str) -> tuple[str, ...]:
        return level_cuts(model, cut, self.cuts, self.one_level)

    def cut_label(self, cut: str) -> str:
        if self.one_level:
            return cut
        return f"levels {','.join(self.cuts) or 'at every cut'}"

    def step(
        self,
        server: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Sequence[CohortBatch],
        *,
        loss: LossFn = cross_entropy,
    ) -> StepResults:
        """One step on the rows-weighted mean of the batches' server losses, each batch run
        from its own cut; no gradient goes back."""
        if not isinstance(server, ServerModel):
            raise TypeError(f"FedSplitX's server trains a ServerModel, not {type(server).__name__}")
        if not batches:
            raise ValueError("no batches to train on")
        device = next(server.parameters()).device
        total = float(sum(int(b.labels.shape[0]) for b in batches))
        heads = () if self.one_level else (self.cuts or None)  # None: every head of the replica
        objective = torch.zeros((), device=device)
        results: StepResults = []
        for b in batches:
            z = b.activations.detach().to(device=device, dtype=torch.float32)
            y = b.labels.to(device=device, dtype=torch.long)
            output, aux = server.forward_from(z, b.cut or server.cut, heads)
            objective = objective + server_loss(list(aux.values()), output, y, loss) * (
                int(y.shape[0]) / total
            )
            with torch.no_grad():
                batch_loss = float(loss(output, y))
                hits = int((output.argmax(dim=1) == y).sum())
            # No gradient goes back: the client does not wait for one.
            results.append((torch.empty(0), batch_loss, hits))
        if not bool(torch.isfinite(objective.detach())):
            # No step; the worker checks the reported losses, so a head's non-finite loss must
            # show there too (it rolls the replica back and dead-letters the batches).
            return [(g, float("nan"), c) for g, _, c in results]
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        optimizer.step()
        return results


@algorithm("local_loss_sfl", params=FedSplitXSection, section="fedsplitx")
@algorithm("fedsplitx", params=FedSplitXSection)
class FedSplitX(StrategyBase):
    name: str = "fedsplitx"
    # `personal_metrics`: each level's client model (blocks up to c_m, head a_m) on its own.
    traits = Traits(
        uses_heads=True,
        report_plots=MappingProxyType({"client model per level": ("level*.client_accuracy",)}),
    )
    cuts: tuple[str, ...] = ()  # the partition points; (): the model's cuts
    one_level: bool = False  # local-loss SFL: the job's cut is the only level
    default_level: int = 1
    aggregation: Literal["merged", "separate"] = "merged"
    structure: Structure | None = field(default=None, compare=False)

    @classmethod
    def create(cls, name: str, params: Params | None) -> Self:
        """Local-loss SFL: one level at the job's cut; `[algorithm.fedsplitx]` is validated,
        not used."""
        assert isinstance(params, FedSplitXSection)
        if name == "local_loss_sfl":
            return cls(name=name, one_level=True)
        return cls(
            name=name,
            cuts=parse_cuts(params.cuts),
            default_level=params.default_level,
            aggregation=params.aggregation,
        )

    @cached_property
    def server(self) -> ServerSide | None:
        # A client uploads only the blocks up to its own level (the aggregator's gate allows it).
        return LevelServer(
            cuts=self.cuts,
            one_level=self.one_level,
            default_level=self.default_level,
            partial_client_updates=not self.one_level,
        )

    # --- structure ----------------------------------------------------------------------------
    def for_model(self, model: Callable[[], SplitNet], cut: str) -> Self:
        built = model()
        levels = level_cuts(built, cut, self.cuts, self.one_level)
        structure = Structure(
            levels=levels,
            cut_index={c: built.cut_index(c) for c in built.cuts},
            costs=tuple(level_costs(built, levels)),
        )
        return replace(self, structure=structure)

    def _bound(self) -> Structure:
        if self.structure is None:
            raise RuntimeError(f"{self.name}: call for_model(model, cut) before aggregating")
        return self.structure

    # --- roles --------------------------------------------------------------------------------
    def initial_weights(self, model: SplitNet, cut: str) -> VersionWeights:
        levels = level_cuts(model, cut, self.cuts, self.one_level)
        return {
            CLIENT: client_state(model, levels[-1]),
            SERVER: {**server_state(model, levels[0]), **head_state(model, levels[1:])},
            AUX: head_state(model, levels),
        }

    def client_round(self, r: LocalRound) -> RoundResult:
        model, cut = r.model, r.cut
        levels = level_cuts(model, cut, self.cuts, self.one_level)
        if cut not in levels:
            raise ValueError(f"{self.name}: cut {cut!r} is not one of the levels {levels}")
        own = levels[: levels.index(cut) + 1]
        body = model.client_blocks(cut)
        heads = {model.cut_index(c): (c, model.head(c)) for c in own}
        modules = [body, *(head for _, head in heads.values())]
        for module in modules:
            module.train()
        optimizer = r.hyper.client_optimizer([p for m in modules for p in m.parameters()])
        samples, correct, loss_sum, last_sum = 0, 0, 0.0, 0.0
        for step, (x, y) in enumerate(r.batches):
            z, aux = forward_heads(body, heads, x)
            logits = list(aux.values())
            smashed = self.smashed(r, x, z, step)
            # Out first, so the server works on it while this client r.steps.
            r.channel.send(smashed.wire(), y, step, r.steps)
            objective = smashed.with_penalty(local_loss(logits, y, r.hyper.loss))
            optimizer.zero_grad(set_to_none=True)
            objective.backward()
            optimizer.step()
            rows = int(y.shape[0])
            with torch.no_grad():
                last_sum += float(r.hyper.loss(logits[-1], y)) * rows
                correct += int((logits[-1].argmax(dim=1) == y).sum())
            loss_sum += float(objective.detach()) * rows
            samples += rows
        cost = level_costs(model, levels)[len(own) - 1]
        metrics = {
            "train_samples": float(samples),
            "level": float(len(own)),
            # Per-client report columns (services.aggregator.metrics, `report.` prefix): the
            # level, and the forward FLOPs per sample the server spends on this client's data.
            "report.level": float(len(own)),
            "report.server_flops": float(cost.server_flops),
        }
        if samples:
            # The client's own prediction is its deepest head's: that is its train loss.
            metrics.update(
                train_loss=last_sum / samples,
                train_accuracy=correct / samples,
                local_loss=loss_sum / samples,
            )
        return RoundResult(
            client_weights=client_state(model, cut),
            aux_weights=head_state(model, own),
            metrics=metrics,
        )

    def aggregate(
        self,
        previous: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
    ) -> VersionWeights:
        """heteroavg over the clients (by samples trained) and the replicas (by the samples that
        reached each tensor); every blob gets the averaged values of its tensors."""
        if not updates:
            raise ValueError("no client updates to aggregate")
        structure = self._bound()
        holdings: list[Holding] = [
            ({**u.client_weights, **u.aux_weights}, u.trained_samples) for u in updates
        ]
        for r in replicas:
            cut_samples = dict(r.cut_samples) or {structure.levels[0]: r.samples}
            holdings += replica_holdings(
                r.weights, cut_samples, structure.cut_index, structure.levels
            )
        if self.aggregation == "separate":
            return separate_heteroavg(previous, holdings[: len(updates)], holdings[len(updates) :])
        merged: dict[str, torch.Tensor] = {}
        for state in previous.values():
            merged.update(state)
        averaged = heteroavg(holdings, merged)
        return {ref: {n: averaged[n] for n in state} for ref, state in previous.items()}

    # --- report -------------------------------------------------------------------------------
    def personal_metrics(
        self,
        model: SplitNet,
        blobs: VersionWeights,
        x: torch.Tensor,
        y: torch.Tensor,
        clients: Mapping[str, Sequence[int]],
    ) -> dict[str, float]:
        """Per level m, for the report: the client model's accuracy (blocks up to c_m with head
        a_m) on the test rows (x, y), and the forward FLOPs per sample on each side."""
        structure = self._bound()
        client = {**blobs.get(CLIENT, {}), **blobs.get(AUX, {})}
        out: dict[str, float] = {}
        for cost in structure.costs:
            key = f"level{cost.level}"
            # The full model of this level: the server side from c_m on, the client side to c_m
            # (the same for every level when the blobs share their tensors, "merged").
            depth = structure.cut_index[cost.cut]
            load_partial(model, blobs.get(SERVER, {}))
            load_partial(model, {n: v for n, v in client.items() if below(n, depth, structure)})
            out[f"{key}.full_accuracy"] = accuracy(model, x, y)
            # The client model as it predicts on its own: blocks up to c_m and head a_m, the
            # clients' copies.
            load_partial(model, client)
            early_exit = nn.Sequential(model.client_blocks(cost.cut), model.head(cost.cut))
            out[f"{key}.client_accuracy"] = accuracy(early_exit, x, y)
            out[f"{key}.client_flops"] = float(cost.client_flops)
            out[f"{key}.server_flops"] = float(cost.server_flops)
        return out


def separate_heteroavg(
    previous: VersionWeights, clients: Sequence[Holding], replicas: Sequence[Holding]
) -> VersionWeights:
    """The paper's two aggregations: `client/global` and `aux/global` (w^c and its heads) the
    heteroavg of the clients' uploads alone, `server/global` (w^s) that of the replicas alone."""
    out = dict(previous)
    client_side = {**previous.get(CLIENT, {}), **previous.get(AUX, {})}
    averaged = heteroavg(clients, client_side)
    for ref in (CLIENT, AUX):
        if ref in previous:
            out[ref] = {n: averaged[n] for n in previous[ref]}
    if SERVER in previous:
        out[SERVER] = heteroavg(replicas, dict(previous[SERVER]))
    return out


def below(name: str, depth: int, structure: Structure) -> bool:
    """Whether state-dict `name` is a block at or before block `depth` (heads: never)."""
    return name.startswith("blocks.") and (tensor_depth(name, structure.cut_index) or 0) <= depth


def accuracy(module: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 512) -> float:
    """Accuracy of `module` (inputs -> logits) on (x, y), in eval mode without autograd."""
    if not len(y):
        return float("nan")
    correct = 0
    with evaluating([module]):
        for start in range(0, len(y), chunk):
            logits = module(x[start : start + chunk])
            correct += int((logits.argmax(dim=1) == y[start : start + chunk]).sum())
    return correct / len(y)
