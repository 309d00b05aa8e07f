"""Split-able networks: a model as named blocks with cut points and auxiliary heads.

Pure PyTorch: no I/O, no training loops. `build_model` gives a `SplitNet`; `ClientModel` and
`ServerModel` run its two sides at a cut; the `*_state` helpers slice its state dict by the
full model's names, which every part of the system uses to line weights up.
"""

from models.custom import load_factory, split_module
from models.errors import ModelError, ModelSpecError, StateDictError
from models.heads import AuxHead, HeadFactory, default_head, pooled_head
from models.parts import ClientModel, ServerModel
from models.registry import MODEL_NAMES, build_model
from models.split import SplitNet
from models.state import client_state, head_state, load_partial, range_state, server_state

__all__ = [
    "MODEL_NAMES",
    "AuxHead",
    "ClientModel",
    "HeadFactory",
    "ModelError",
    "ModelSpecError",
    "ServerModel",
    "SplitNet",
    "StateDictError",
    "build_model",
    "client_state",
    "default_head",
    "head_state",
    "load_factory",
    "load_partial",
    "pooled_head",
    "range_state",
    "server_state",
    "split_module",
]
