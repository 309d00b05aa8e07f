"""FedAvg (McMahan et al.), the no-split baseline: each client trains the whole model and the
aggregator takes `w = sum_k alpha_k w_k`. The whole model travels as the `client` blob."""

from __future__ import annotations

from services.algorithms.base import (
    LocalRound,
    RoundResult,
    StrategyBase,
    algorithm,
    block_parameters,
    full_state,
)


@algorithm("fedavg", shards="one")
class FedAvg(StrategyBase):
    name: str = "fedavg"

    def client_round(self, r: LocalRound) -> RoundResult:
        model = r.model
        model.train()
        optimizer = r.hyper.client_optimizer(block_parameters(model).values())
        samples = 0
        for x, y in r.batches:
            loss = r.hyper.loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            samples += int(y.shape[0])
        return RoundResult(full_state(model), metrics={"train_samples": float(samples)})
