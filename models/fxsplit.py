"""Split any traceable `nn.Module` at named submodules into `SplitNet` blocks, with torch.fx.

A cut names a submodule by its qualified name (`"layer2"`, `"layer3.1"`) and means "after the
call of that module". The module is traced with the cut modules, and every module that holds no
cut, kept whole (fx leaves): only the forwards of the root and of the cuts' ancestors are traced,
so the rest may do anything fx cannot follow. The traced graph is cut after each cut module's
call; each segment becomes a `GraphModule` block holding the original submodules under their
own qualified names, so block `i`'s state names are `blocks.<i>.<name in the module>`, the same
in every process that builds the model.

A split is refused when it would change the model: a value other than the cut module's output
used after the cut (a skip connection around it), a parameter or buffer used on both sides of a
cut, or one the forward never uses (it would be dropped). The chain's output is checked against
the module's own forward on a random batch, in eval mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from models.errors import ModelSpecError
from models.heads import HeadFactory, default_head
from models.split import SplitNet, evaluating

_CHECK_BATCH = 2
_CHECK_SEED = 0
_FALLBACK = (
    "make that forward traceable (no Python control flow on tensor values), or have the "
    "factory return (name, nn.Module) blocks that the model applies in order"
)


def split_module(
    module: nn.Module,
    cuts: Sequence[str],
    *,
    input_shape: Sequence[int],
    num_classes: int,
    head_factory: HeadFactory | None = default_head,
) -> SplitNet:
    """`module` as a `SplitNet` cut after each submodule named in `cuts` (in call order).

    Block `i` ends with the call of `cuts[i]` and is named after it, dots made underscores
    (`"layer3.1"` gives the block and cut `layer3_1`); the last block is named after the last
    module it calls (`"output"` when it calls none).
    """
    if isinstance(cuts, str) or not cuts:
        raise ModelSpecError(f"the cuts must be a non-empty list of module names, got {cuts!r}")
    kind = type(module).__name__
    _check_cut_names(module, list(cuts))
    graph = _trace(module, set(cuts))
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    result = nodes[-1].args[0]
    if len(inputs) != 1 or not isinstance(result, fx.Node):
        raise ModelSpecError(f"{kind}.forward must take one tensor and return one tensor")
    ends = _cut_nodes(kind, nodes, list(cuts))
    segment = _segments(nodes, ends)
    _check_crossings(nodes, ends, segment, list(cuts))
    if segment[result] != len(ends):
        raise ModelSpecError(f"cannot cut after {cuts[-1]!r}: it leaves the server nothing to run")
    starts = [inputs[0], *ends]
    blocks = [
        _block(module, nodes, segment, index, start, end)
        for index, (start, end) in enumerate(zip(starts, [*ends, result], strict=True))
    ]
    _check_state(kind, module, blocks, list(cuts))
    names = [cut.replace(".", "_") for cut in cuts] + [_last_name(nodes, segment, len(ends))]
    net = SplitNet(
        list(zip(names, blocks, strict=True)),
        input_shape=input_shape,
        num_classes=num_classes,
        cuts=names[:-1],
        head_factory=head_factory,
    )
    _check_same_forward(module, net)
    return net


def _check_cut_names(module: nn.Module, cuts: list[str]) -> None:
    known = dict(module.named_modules())
    for cut in cuts:
        if not cut or cut not in known:
            children = [name for name, _ in module.named_children()]
            raise ModelSpecError(
                f"{cut!r} is not a submodule of {type(module).__name__}; name one by its "
                f"qualified name (e.g. 'layer2' or 'layer3.1'); its children are {children}"
            )
    for cut in cuts:
        outer = [other for other in cuts if cut.startswith(other + ".")]
        if outer:
            raise ModelSpecError(f"cut {cut!r} lies inside cut {outer[0]!r}: cut at one of them")
    if len(set(cuts)) != len(cuts):
        raise ModelSpecError(f"the cuts must be distinct, got {cuts}")


class _CutTracer(fx.Tracer):
    """Keeps whole every module but the root and the ancestors of the cuts."""

    def __init__(self, cuts: set[str]) -> None:
        super().__init__()
        self.cuts = cuts

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        name = module_qualified_name
        return not any(cut.startswith(name + ".") for cut in self.cuts)


def _trace(module: nn.Module, cuts: set[str]) -> fx.Graph:
    try:
        return _CutTracer(cuts).trace(module)
    except Exception as exc:
        raise ModelSpecError(
            f"torch.fx cannot trace {type(module).__name__} to split it at {sorted(cuts)} "
            f"(only its forward and those of the cuts' enclosing modules are traced): {exc!r}; "
            + _FALLBACK
        ) from exc


def _cut_nodes(kind: str, nodes: list[fx.Node], cuts: list[str]) -> list[fx.Node]:
    ends = []
    for cut in cuts:
        calls = [n for n in nodes if n.op == "call_module" and n.target == cut]
        if len(calls) != 1:
            times = "never" if not calls else f"{len(calls)} times"
            raise ModelSpecError(
                f"{kind}.forward calls cut module {cut!r} {times}; a cut must be called once"
            )
        ends.append(calls[0])
    order = [nodes.index(end) for end in ends]
    if order != sorted(order):
        called = [cut for _, cut in sorted(zip(order, cuts, strict=True))]
        raise ModelSpecError(f"the cuts must be in call order: {called}, not {cuts}")
    return ends


def _segments(nodes: list[fx.Node], ends: list[fx.Node]) -> dict[fx.Node, int]:
    """The block each computing node falls in (parameter reads go with their users)."""
    segment: dict[fx.Node, int] = {}
    index = 0
    for node in nodes:
        if node.op == "get_attr":
            continue
        segment[node] = len(ends) if node.op == "output" else index
        if index < len(ends) and node is ends[index]:
            index += 1
    return segment


def _check_crossings(
    nodes: list[fx.Node], ends: list[fx.Node], segment: dict[fx.Node, int], cuts: list[str]
) -> None:
    for node in nodes:
        if node not in segment or node.op == "output":
            continue
        home = segment[node]
        last_use = max((segment[user] for user in node.users if user in segment), default=home)
        allowed = home + 1 if home < len(ends) and node is ends[home] else home
        if last_use > allowed:
            crossed = cuts[home + 1] if node is ends[home] else cuts[home]
            raise ModelSpecError(
                f"{_describe(node)} is used after the cut {crossed!r}: only the cut module's "
                "output may cross a cut (a skip connection around it?); cut where the only "
                "value alive is one module's output"
            )


def _describe(node: fx.Node) -> str:
    if node.op == "placeholder":
        return f"the input {node.name!r}"
    if node.op == "call_module":
        return f"the output of module {node.target!r}"
    return f"the result of {node.name!r}"


def _block(
    module: nn.Module,
    nodes: list[fx.Node],
    segment: dict[fx.Node, int],
    index: int,
    start: fx.Node,
    end: fx.Node,
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {start: graph.placeholder(start.name)}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:  # a parameter read: copied into each block that uses it
            env[node] = graph.node_copy(node, lookup)
        return env[node]

    for node in nodes:
        if segment.get(node) == index and node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lookup)
    graph.output(env[end])
    return fx.GraphModule(module, graph, class_name=f"Block{index}")


def _check_state(
    kind: str, module: nn.Module, blocks: list[fx.GraphModule], cuts: list[str]
) -> None:
    owner: dict[str, int] = {}
    for index, block in enumerate(blocks):
        for name in block.state_dict():
            if name in owner and owner[name] != index:
                raise ModelSpecError(
                    f"{kind}'s {name!r} is used on both sides of the cut {cuts[owner[name]]!r}; "
                    "a split keeps each parameter on one side"
                )
            owner[name] = index
    unused = sorted(set(module.state_dict()) - set(owner))
    if unused:
        raise ModelSpecError(
            f"{kind}.forward never uses {unused[:5]}{' ...' if len(unused) > 5 else ''}: "
            "the split would drop them; remove them from the module"
        )


def _last_name(nodes: list[fx.Node], segment: dict[fx.Node, int], last: int) -> str:
    called = [n.target for n in nodes if n.op == "call_module" and segment.get(n) == last]
    return str(called[-1]).replace(".", "_") if called else "output"


def _check_same_forward(module: nn.Module, net: SplitNet) -> None:
    tensors: list[Any] = [*module.parameters(), *module.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    generator = torch.Generator(device=device).manual_seed(_CHECK_SEED)
    x = torch.randn((_CHECK_BATCH, *net.input_shape), generator=generator, device=device)
    with evaluating([module, net]):
        expected, got = module(x), net(x)
    if not (
        isinstance(expected, torch.Tensor)
        and expected.shape == got.shape
        and torch.allclose(expected, got, rtol=1e-4, atol=1e-5)
    ):
        raise ModelSpecError(
            f"the blocks split from {type(module).__name__} compute something else than its "
            "forward (does it use self.training, or randomness in eval mode?); " + _FALLBACK
        )
