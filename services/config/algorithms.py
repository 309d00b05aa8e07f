"""Each algorithm's own parameters, one section per algorithm under `[algorithm.<name>]`.

Only the section of the job's algorithm is used; the coordinator sends its values to clients
as `params.<key>` entries of the Welcome/WeightsAssignment config, so every participant trains
with the service's values (`services.algorithms.registry.build_strategy` validates them again
with the same section class).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.config.settings import _Section


class SplitGPSection(_Section):
    # Weight of the client head's loss in F_k = gamma*l(phi,h) + (1-gamma)*l(phi,theta).
    gamma: float = Field(default=0.5, ge=0, le=1)
    # Personalisation: phi_k <- lam*phi_k + (1-lam)*mean_i phi_i (lam=0: multi-exit, shared).
    lam: float = Field(default=0.2, ge=0, le=1)
    # Split inference: predict at the client when the entropy of its head's softmax <= this.
    entropy_threshold: float = Field(default=0.5, ge=0)


class FedSplitXSection(_Section):
    # Partition points, comma-separated cut names shallow to deep ("block1,block2,block3"); a
    # client at level m holds the blocks up to the m-th. Empty: the model's cuts. (local_loss_sfl
    # ignores it: its one level is the job's cut, model.cut.)
    cuts: str = Field(default="", pattern=r"^\s*([A-Za-z0-9_]+\s*(,\s*[A-Za-z0-9_]+\s*)*)?$")
    # Level assigned when a client declares no capability (Join.capability = 0) and has none in
    # clients.capability_mix; capped at the number of levels.
    default_level: int = Field(default=1, ge=1)


class FedDeperSection(_Section):
    # Proximal pull of the personalised model v towards the round's global model x.
    rho: float = Field(default=0.1, ge=0)
    # Upload y = u - lam*(v - x).
    lam: float = Field(default=0.5, ge=0)
    # The documented, swappable depersonalisation rule (services/algorithms/feddeper.py).
    rule: Literal["proximal"] = "proximal"


class SubFedAvgSection(_Section):
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


# Which parameter section each algorithm reads (attribute of `AlgorithmSection`).
PARAMS_SECTION = {
    "splitgp": "splitgp",
    "fedsplitx": "fedsplitx",
    "local_loss_sfl": "fedsplitx",
    "feddeper": "feddeper",
    "subfedavg": "subfedavg",
}
