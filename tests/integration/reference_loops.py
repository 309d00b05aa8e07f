"""Split training written out by hand, to hold the real roles to (tests/integration/
test_exactness.py).

One loop covers both algorithms the exactness tests check, because with one client and one
shard MiniBatch-SFL's equation (3) *is* SFL-V2's sequential step: per step i every client n
computes `z_n = phi(x_n)`; the server takes one step on `sum_n p_n grad h(w_s; z_n) / sum p_n`
(p_n = |D_n|); each client gets `dh/dz_n` at the pre-update `w_s`, backpropagates it and steps;
after the round the client sides are averaged with p_n.

Deliberately independent of `services.algorithms` (no `sfl.weighted_step`, no `averaging`): the
gradients come from `torch.autograd.grad` and the optimizers are plain `torch.optim.SGD`, so
the roles' math is checked, not re-used. What the reference must share with the service is
only what the architecture doc fixes: the seeded initial model (`job_model`, as the
aggregator builds version 1), the partition, `ClientBatches` with epochs numbered
`round * local_epochs + e` and capped at `max_steps_per_round`, fresh client and server
optimizers every round (a new version is a new model), and the cohort in sorted client order
(BatchNorm's running statistics depend on the order the server sees the clients' batches in).

A job with a training recipe (`[optimizer]`, `[schedule]`, `[loss]`) runs the same loop with the
`Recipe` the test writes out for it: its own torch optimizers, the lr of each step computed by
the test, and its loss, on both sides.

A U-shaped job (`model.tail`) runs the same loop with the loss moved to the client: the server's
blocks stop before the tail, each client's tail computes `L_n` on the server's output `o_n`, and
the server steps on `sum_n p_n J_n^T dL_n/do_n / sum p` (`_u_step`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from models.state import client_state, load_partial, server_state
from services.client.data import JobData
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.data.batches import ClientBatches
from services.data.loaders import Dataset

Tensors = dict[str, torch.Tensor]
Batches = list[tuple[torch.Tensor, torch.Tensor]]
Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Recipe:
    """What the reference trains with: optimizers built afresh each round, the lr of step i
    of round r on either side, and the loss."""

    client: Make
    server: Make
    client_lr: Callable[[int, int], float]
    server_lr: Callable[[int, int], float]
    loss: Loss = F.cross_entropy


def sgd_recipe(settings: Settings) -> Recipe:
    """`[algorithm]`'s plain SGD at a constant lr: the recipe of a job without one."""
    a = settings.algorithm
    return Recipe(
        client=lambda ps: torch.optim.SGD(ps, lr=a.lr, momentum=a.momentum),
        server=lambda ps: torch.optim.SGD(ps, lr=a.effective_server_lr, momentum=a.momentum),
        client_lr=lambda _r, _i: a.lr,
        server_lr=lambda _r, _i: a.effective_server_lr,
    )


@dataclass(frozen=True)
class ReferenceResult:
    """The weights of the final version: what `client/global` and `server/global` must hold."""

    client: Tensors
    server: Tensors
    steps: int  # server steps taken over all rounds
    initial: Tensors  # client and server side of the seeded model: version 1


def reference_run(
    settings: Settings, dataset: Dataset, rounds: int, recipe: Recipe | None = None
) -> ReferenceResult:
    """`rounds` sync rounds of every client of the job, in-process (`recipe`: the SGD of
    `[algorithm]` when None)."""
    cut = settings.model.cut
    recipe = recipe or sgd_recipe(settings)
    data = JobData(settings, dataset)
    clients = range(settings.clients.count)
    p = [float(len(data.indices(n))) for n in clients]

    initial = job_model(settings, seed=settings.job.seed)
    global_client = _cloned(client_state(initial, cut))
    version_1 = {**global_client, **_cloned(server_state(initial, cut))}
    server_net = copy.deepcopy(initial)
    server = server_net.server_blocks(cut)
    server.train()
    models = [copy.deepcopy(initial) for _ in clients]
    bodies = [m.client_blocks(cut) for m in models]
    u_shaped = initial.tail is not None
    tails = [m.tail_blocks() for m in models] if u_shaped else []
    steps_taken = 0
    for r in range(rounds):
        # A new version is a new model: every optimizer starts afresh (architecture doc).
        server_opt = recipe.server(list(server.parameters()))
        client_opts = []
        for n, (model, body) in enumerate(zip(models, bodies, strict=True)):
            load_partial(model, global_client)
            body.train()
            params = list(body.parameters())
            if u_shaped:
                tails[n].train()
                params += list(tails[n].parameters())
            client_opts.append(recipe.client(params))
        batches = [round_batches(settings, data, n, r) for n in clients]
        steps = {len(b) for b in batches}
        assert len(steps) == 1, f"clients with different step counts {steps}: no full cohort steps"
        for i in range(steps.pop()):
            xs = [b[i][0] for b in batches]
            ys = [b[i][1] for b in batches]
            zs = [body(x) for body, x in zip(bodies, xs, strict=True)]
            for opt in client_opts:
                opt.zero_grad()
                _set_lr(opt, recipe.client_lr(r, i))
            _set_lr(server_opt, recipe.server_lr(r, i))
            if u_shaped:
                grads = _u_step(server, server_opt, tails, zs, ys, p, recipe.loss)
            else:
                grads = _server_step(server, server_opt, zs, ys, p, recipe.loss)
            for z, g, opt in zip(zs, grads, client_opts, strict=True):
                z.backward(g)
                opt.step()
            steps_taken += 1
        global_client = _average([client_state(m, cut) for m in models], p)
    server_final = _cloned(server_state(server_net, cut))
    return ReferenceResult(global_client, server_final, steps_taken, version_1)


def round_batches(settings: Settings, data: JobData, index: int, round_index: int) -> Batches:
    """Client `index`'s batches of round `round_index`: `ClientBatches` seeded with the job's
    seed and the partition index, epochs numbered across rounds, capped per round."""
    a = settings.algorithm
    indices = data.indices(index)
    # The client drops a trailing batch of one sample (BatchNorm); keep the tests clear of it.
    assert len(indices) <= a.batch_size or len(indices) % a.batch_size != 1
    batches = ClientBatches(
        data.dataset.train.x,
        data.dataset.train.y,
        indices,
        batch_size=a.batch_size,
        seed=settings.job.seed,
        client=index,
    )
    epochs = [batches.epoch(round_index * a.local_epochs + e) for e in range(a.local_epochs)]
    chained = itertools.chain.from_iterable(epochs)
    return list(itertools.islice(chained, a.max_steps_per_round or None))


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _server_step(
    server: nn.Module,
    optimizer: torch.optim.Optimizer,
    zs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    p: Sequence[float],
    loss: Loss,
) -> list[torch.Tensor]:
    """Equation (3): one step on the p-weighted mean of the clients' losses; each client's
    `dh/dz_n` taken before the step."""
    inputs = [z.detach().requires_grad_(True) for z in zs]
    # One forward per client, in cohort order: h(w_s; z_n) sees client n's batch alone.
    losses = [loss(server(z), y) for z, y in zip(inputs, ys, strict=True)]
    objective = torch.stack([pn * loss for pn, loss in zip(p, losses, strict=True)]).sum() / sum(p)
    params = [q for q in server.parameters() if q.requires_grad]
    server_grads = torch.autograd.grad(objective, params, retain_graph=True)
    z_grads = [
        torch.autograd.grad(loss, z, retain_graph=True)[0]
        for loss, z in zip(losses, inputs, strict=True)
    ]
    for q, g in zip(params, server_grads, strict=True):
        q.grad = g
    optimizer.step()
    return z_grads


def _u_step(
    server: nn.Module,
    optimizer: torch.optim.Optimizer,
    tails: Sequence[nn.Module],
    zs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    p: Sequence[float],
    loss: Loss,
) -> list[torch.Tensor]:
    """The U-shaped step: the server's outputs `o_n` (one forward per client, in cohort order),
    each client's tail loss on them (its tail's gradients accumulate for the client's step),
    then the server's step on the p-weighted pullback of `dL_n/do_n`; each client's `dL_n/dz_n`
    taken before the step."""
    inputs = [z.detach().requires_grad_(True) for z in zs]
    outputs = [server(z) for z in inputs]
    output_grads = []
    for tail, out, y in zip(tails, outputs, ys, strict=True):
        seen = out.detach().requires_grad_(True)  # what the client receives
        loss(tail(seen), y).backward()
        assert seen.grad is not None
        output_grads.append(seen.grad)
    params = [q for q in server.parameters() if q.requires_grad]
    weighted = [g * (pn / sum(p)) for g, pn in zip(output_grads, p, strict=True)]
    server_grads = torch.autograd.grad(outputs, params, weighted, retain_graph=True)
    z_grads = [
        torch.autograd.grad(out, z, g, retain_graph=True)[0]
        for out, z, g in zip(outputs, inputs, output_grads, strict=True)
    ]
    for q, g in zip(params, server_grads, strict=True):
        q.grad = g
    optimizer.step()
    return z_grads


def _average(states: Sequence[Tensors], p: Sequence[float]) -> Tensors:
    """`sum_n p_n w_n / sum p`; integer buffers (BatchNorm's step counter) are equal anyway."""
    total = sum(p)
    out: Tensors = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            acc = sum(pn * s[name].double() for pn, s in zip(p, states, strict=True))
            assert isinstance(acc, torch.Tensor)
            out[name] = (acc / total).to(first.dtype)
        else:
            assert all(torch.equal(s[name], first) for s in states), name
            out[name] = first.clone()
    return out


def _cloned(state: Tensors) -> Tensors:
    return {k: v.detach().clone() for k, v in state.items()}


__all__ = ["ReferenceResult", "reference_run", "round_batches"]
