"""The saved nodes of a compiled graph: what made them, which modules they belong to, and where their pack and
unpack nodes go. What a saved node becomes is decided by ``decide.py`` (``node_rule``: the op table of
``rules.py`` read through these).

AOTAutograd inlines a save's pack nodes at the forward graph's end and its unpack nodes at the backward
graph's start. Left there, every saved tensor would be held in full until the forward ends and decoded in
full before the backward begins; :func:`hoist` and :func:`sink` move them next to what they read and what
reads them.
"""

from __future__ import annotations

import re

import torch

__all__ = ["PASS_THROUGH", "constant_nodes", "hoist", "module_name", "modules_of", "op_name", "sink", "source"]


def op_name(node) -> str:
    if node.op == "placeholder":
        return "input"
    target = getattr(node, "target", None)
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


# Ops that pass values through unchanged (aliases, views): a saved node made by one is its source's values.
PASS_THROUGH = {"detach", "alias", "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "expand",
                 "clone", "contiguous", "unsqueeze", "squeeze", "select", "slice"}  # fmt: skip


def source(node):
    """The node whose op made ``node``'s values, through aliases and views."""
    for _ in range(8):
        if op_name(node) not in PASS_THROUGH or not node.args or not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
    return node


# The compiled frame's local that holds the root module: ``L['self']``, or ``L['args'][0]`` where the compiled frame
# is a wrapper of the model's forward that takes the module among its positional arguments (transformers' decorators).
_ROOT = re.compile(r"^L\['args'\]\[\d+\]\.?|^L\['[^']*'\]\.?")
_ITEM = re.compile(r"\[(\d+)\]|\.?_modules\['([^']*)'\]|\['([^']*)'\]")


def module_name(path: str) -> str:
    """A dynamo module path (``L['self'].blocks[0].attn``) as a qualified name relative to the compiled
    module (``blocks.0.attn``)."""
    path = _ROOT.sub("", path)
    path = _ITEM.sub(lambda m: "." + next(g for g in m.groups() if g is not None), path)
    # a compiled bound method (``block.forward``) or a compiled module's wrapper
    return ".".join(p for p in path.split(".") if p and p not in ("__self__", "_orig_mod"))


def modules_of(node) -> list[str]:
    """The module that made ``node`` and those whose ops used it in the forward graph, innermost first."""
    names: list[str] = []
    for n in (node, *node.users):
        stack = n.meta.get("nn_module_stack") if hasattr(n, "meta") else None
        if stack:
            name = module_name(list(stack.values())[-1][0])
            if name not in names:
                names.append(name)
    return names


def hoist(fw_graph, start: int) -> None:
    """Move the pack nodes of one save (inlined at the end of the forward graph, from position ``start``
    to before the output) to right after what they read. At the end, they would hold every saved tensor in
    full until the forward ends: the forward's peak would be plain PyTorch's."""
    nodes = list(fw_graph.nodes)
    block = nodes[start:-1]
    inside = set(block)
    order = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    inputs = [a for n in block for a in n.all_input_nodes if a not in inside]
    anchor = max((*inputs, *placeholders[-1:]), key=order.__getitem__, default=None)
    if anchor is None:
        return
    for n in block:
        anchor.append(n)
        anchor = n


def sink(bw_graph, name: str) -> None:
    """Move the nodes that decode save ``name`` (those computed from its ``{name}_hook_*`` inputs alone, and from
    constants, such as the shifts a decoding makes with ``arange``, which stay where they are) to right before the
    first node that uses what they decode."""
    prefix = f"{name}_hook_"
    nodes = list(bw_graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    block: set = {n for n in nodes if n.op == "placeholder" and (n.name.startswith(prefix) or n.name == name)}
    inputs = set(block)
    constants = constant_nodes(nodes)
    for n in nodes:
        if (
            n.op not in ("placeholder", "output")
            and n not in constants
            and all(a in block or a in constants for a in n.all_input_nodes)
        ):
            block.add(n)
    block -= inputs
    users = [u for n in block for u in n.users if u not in block]
    if not block or not users:
        return
    first = min(users, key=order.__getitem__)
    for n in sorted(block, key=order.__getitem__):
        first.prepend(n)


def constant_nodes(nodes) -> set:
    """The nodes of ``nodes`` (in graph order) computed from no input of the graph: constants a graph makes, such as
    an ``arange`` and what follows from it alone."""
    constants: set = set()
    for n in nodes:
        if n.op == "call_function" and all(a in constants for a in n.all_input_nodes):
            constants.add(n)
    return constants
