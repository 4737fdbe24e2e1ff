"""Frequent-subgraph folding: group the repeated layers of a step graph (TAP).

Takes: a ``StepGraph`` (passes/trace). Returns: a ``FoldedGraph``: for every node its
representative (itself when it is not folded), the groups of isomorphic regions, and a
report. It changes nothing in the graph; passes/strategies builds one strategy list per
representative and passes/solve gives a representative's variables to all its instances.
It folds nothing in a graph without repeated layers (every node is its own representative).

A transformer's joint graph is a handful of distinct subgraphs repeated many times. Folding
finds them in three steps:

1. Propose regions from module paths (``region_of_path``): a node belongs to region
   ``prefix.i`` when the path of the module it came from starts with a numbered child
   ``prefix.i`` (the i-th entry of a ``ModuleList`` / ``Sequential``); parameters and
   buffers by their names. Forward and backward nodes of a layer share its path, so a
   region holds both. Operators the tracer could not attribute (the additions that
   accumulate a residual's gradient) join a region by their neighbours
   (``_attach_unattributed``): the one region all their attributed inputs come from, or,
   for a node fed from several regions, the one region all their attributed users lie in.
2. Label every region by its canonical form (``_canonical``): its nodes in graph order,
   each with its op, role, output shapes and dtypes, non-tensor arguments, and for each
   tensor argument either the index of the producing node inside the region or the
   shape of the outside value it reads; plus which graph outputs it feeds and how.
3. Regions whose attributed nodes (the core) have equal canonical forms are isomorphic as
   labelled graphs (the node order is the isomorphism): they form a group. Its
   representative is the first region whose whole form (core and attached nodes) is the
   most common in the group; node ``j`` of a region with that whole form maps to node
   ``j`` of the representative, and of any other region only its core maps (the first
   and last layers often differ in attached nodes: the embedding's gradient, say). Only
   equality of the form folds two regions, so layers of different widths or kinds never
   fold; a region whose core form no other region shares stays unfolded.

Folding is a restriction, not an approximation of the cost: all instances of a group take
the same strategies (as hand-written plans do: every layer sharded alike), and the solver
still counts the cost of each instance and of each edge between them.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import cast

import torch

from autopar.core import roles

from .trace import StepGraph

__all__ = ["FoldGroup", "FoldedGraph", "fold_regions", "layer_regions", "region_of_path"]


@dataclass(frozen=True, slots=True)
class FoldGroup:
    """Regions with one canonical form.

    Attributes:
        instances: region names (module paths such as ``model.layers.3``), the
            representative first.
        nodes: nodes per region.
        signature: a short hash of the canonical form.
    """

    instances: tuple[str, ...]
    nodes: int
    signature: str

    def __post_init__(self):
        if len(self.instances) < 2:
            raise ValueError("a fold group has at least two regions")

    def name(self) -> str:
        """``model.layers.{0..31}`` / ``layers.{0,2,4}``-style text for the report."""
        prefixes = {r.rsplit(".", 1)[0] for r in self.instances}
        if len(prefixes) != 1:
            return ", ".join(self.instances)
        idx = sorted(int(r.rsplit(".", 1)[1]) for r in self.instances)
        runs: list[list[int]] = []
        for i in idx:
            if runs and i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        parts = [f"{r[0]}..{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs]
        return f"{prefixes.pop()}.{{{','.join(parts)}}}"


@dataclass
class FoldedGraph:
    """A step graph and the representative of each of its nodes.

    Attributes:
        step: the step graph folded.
        rep: node name -> the node whose strategy it takes (itself if not folded).
        groups: the folded groups of isomorphic regions.
        unfolded: regions proposed that no other region matched.
        region: node name -> region name ("" outside every region).
        fold_s: seconds the pass took.
    """

    step: StepGraph
    rep: dict[str, str]
    groups: tuple[FoldGroup, ...] = ()
    unfolded: tuple[str, ...] = ()
    region: dict[str, str] = field(default_factory=dict)
    fold_s: float = 0.0

    @property
    def n_nodes(self) -> int:
        return len(self.rep)

    @property
    def n_representatives(self) -> int:
        """Nodes the solver sees: the graph's nodes less the folded instances."""
        return sum(1 for n, r in self.rep.items() if n == r)

    def stats(self) -> dict:
        """For ``plan.stats``: regions folded, nodes folded away, and each group."""
        return {
            "fold_regions": sum(len(g.instances) for g in self.groups),
            "folded_nodes": self.n_nodes - self.n_representatives,
            "fold_groups": [
                {"regions": g.name(), "instances": len(g.instances), "nodes": g.nodes}
                for g in self.groups
            ],
        }

    def report(self) -> str:
        """What was folded, in a few lines."""
        lines = [
            f"{self.n_nodes} nodes -> {self.n_representatives} after folding "
            f"({len(self.groups)} group(s))"
        ]
        for g in self.groups:
            lines.append(
                f"  folded {len(g.instances)} x {g.nodes} nodes: {g.name()} [{g.signature}]"
            )
        if self.unfolded:
            lines.append("  not folded (no isomorphic peer): " + ", ".join(self.unfolded))
        if not self.groups:
            lines.append("  nothing folded: no repeated regions")
        return "\n".join(lines)


def region_of_path(path: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``model.layers.3``; "" without a numbered child."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def _nodes(step: StepGraph) -> list[torch.fx.Node]:
    return [n for n in step.gm.graph.nodes if n.op != "output"]


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return list(dict.fromkeys(node.all_input_nodes))


def _attach_unattributed(nodes, region: dict[str, str], free: set[str]) -> None:
    """Give operators without a module path the region of their neighbours (in place)."""

    def regions(ns):
        return {region[n.name] for n in ns if region.get(n.name)}

    pending = [n for n in nodes if n.name in free]
    while pending:
        changed = False
        for n in pending:  # from the inputs, in graph order (a chain settles in one sweep)
            rs = regions(_tensor_inputs(n))
            if len(rs) == 1:
                region[n.name] = rs.pop()
                changed = True
        pending = [n for n in pending if not region.get(n.name)]
        if changed:
            continue
        for n in reversed(pending):  # fed from several regions: the one its users lie in
            if len(regions(_tensor_inputs(n))) < 2:
                continue
            rs = regions(n.users)
            if len(rs) == 1:
                region[n.name] = rs.pop()
                changed = True
        pending = [n for n in pending if not region.get(n.name)]
        if not changed:
            break


@functools.cache
def _dtype_text(dtype) -> str:
    return str(dtype)


def _shape_key(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), _dtype_text(v.dtype))
    if isinstance(v, (list, tuple)):
        return tuple(_shape_key(x) for x in v)
    return type(v).__name__


@functools.cache
def _target_text(target) -> str:
    return str(target)


_Node = torch.fx.Node


def _form_of(a, local: dict, ext: dict):
    """An argument's form in ``_canonical``: an input from inside the region its position
    there (``local``), one from outside its shape (made once per node, ``ext``), a literal
    its text."""
    kind = type(a)
    if kind is _Node or isinstance(a, _Node):
        at = local.get(a)
        if at is not None:
            return at
        made = ext.get(a)
        if made is None:
            made = ext[a] = ("ext", _shape_key(a.meta.get("val")))
        return made
    if kind is tuple or kind is list or isinstance(a, (list, tuple)):
        return (kind.__name__, *[_form_of(b, local, ext) for b in a])
    if isinstance(a, dict):
        return ("dict",) + tuple((k, _form_of(v, local, ext)) for k, v in a.items())
    return repr(a)  # (a str: never equal to an input's position)


def _args_of(args: tuple, local: dict, ext: dict) -> tuple:
    """``_form_of(args)`` less its tag, the common kinds inline."""
    out = []
    for a in args:
        kind = type(a)
        if kind is _Node:
            at = local.get(a)
            out.append(_form_of(a, local, ext) if at is None else at)
        elif kind is int or kind is float or kind is bool or a is None:
            out.append(repr(a))
        elif kind is list and all(type(x) is int for x in a):
            out.append(("ints", *a))  # (a shape, a dim list: not a list of inputs)
        else:
            out.append(_form_of(a, local, ext))
    return tuple(out)


def _canonical(
    members: list[torch.fx.Node],
    out_kind: dict[str, list],
    attached: AbstractSet[str] = frozenset(),
    outside: dict[torch.fx.Node, tuple] | None = None,
) -> tuple:
    """The labelled graph of a region as a tuple: equal tuples, isomorphic regions.

    Nodes in ``attached`` (joined by their neighbours, not by a module path) are marked. A
    node's input from inside the region is its position there (an int), one from outside
    its shape (``outside``: those made, by node, shared by the regions' calls). (No
    closures: a recursive one is a reference cycle per region.)"""
    local = {n: i for i, n in enumerate(members)}
    named: dict[str, int] = {}  # (by name: the parameters the gradients are like)
    ext = {} if outside is None else outside
    form = []
    for n in members:
        args: tuple
        meta = n.meta
        if n.op == "placeholder":
            head = ("placeholder", meta.get(roles.META_ROLE, ""))
            args = ()
        else:
            head = (_target_text(n.target), meta.get(roles.META_ROLE, ""))
            kwargs = _form_of(n.kwargs, local, ext) if n.kwargs else ()
            args = (_args_of(n.args, local, ext), kwargs)
        kinds = out_kind.get(n.name)
        outs: tuple = ()
        if kinds:
            if not named:
                named.update((m.name, i) for i, m in enumerate(members))
            outs = tuple(("grad", named.get(like, "ext")) if like else ("plain",) for like in kinds)
        form.append((head, n.name in attached, _shape_key(meta.get("val")), args, outs))
    return tuple(form)


def _propose(step: StepGraph):
    """Step 1 of the module docstring: every node's region ("" outside every region), the
    unattributed nodes, and the placeholder of each parameter and buffer."""
    nodes = _nodes(step)
    region: dict[str, str] = {}
    free: set[str] = set()
    pi = bi = 0
    param_node: dict[str, str] = {}
    buffer_node: dict[str, str] = {}
    of_path: dict[str, str] = {}  # (a layer's nodes share a few module paths)
    for n in nodes:
        role = n.meta.get(roles.META_ROLE, "")
        if n.op == "placeholder":
            if role == roles.PARAM:
                param_node[step.param_names[pi]] = n.name
                region[n.name] = region_of_path(step.param_names[pi])
                pi += 1
            elif role == roles.BUFFER:
                buffer_node[step.buffer_names[bi]] = n.name
                region[n.name] = region_of_path(step.buffer_names[bi])
                bi += 1
            else:
                region[n.name] = ""
            continue
        path = n.meta.get(roles.META_MODULE, "")
        r = of_path.get(path)
        if r is None:
            r = of_path[path] = region_of_path(path)
        region[n.name] = r
        if not path:
            free.add(n.name)
    _attach_unattributed(nodes, region, free)
    return region, free, param_node, buffer_node


def layer_regions(step: StepGraph) -> dict[str, str]:
    """Node name -> its region, for the nodes in one (step 1 of the module docstring)."""
    return {k: v for k, v in _propose(step)[0].items() if v}


def fold_regions(step: StepGraph) -> FoldedGraph:
    """Group the isomorphic regions of ``step`` (module docstring)."""
    t0 = time.perf_counter()
    nodes = _nodes(step)
    region, free, param_node, buffer_node = _propose(step)

    # which graph outputs a node feeds: a gradient (of which parameter), a buffer's new
    # value (of which buffer) or a plain output
    out_kind: dict[str, list] = defaultdict(list)
    for pos, a in enumerate(cast(Sequence, step.output_node().args[0])):
        if isinstance(a, torch.fx.Node):
            like = None
            if pos in step.grad_of:
                like = param_node.get(step.grad_of[pos])
            elif pos in step.mutated_buffers:
                like = buffer_node.get(step.mutated_buffers[pos])
            out_kind[a.name].append(like)

    members: dict[str, list[torch.fx.Node]] = defaultdict(list)
    for n in nodes:
        if region[n.name]:
            members[region[n.name]].append(n)
    # Regions group by the form of their attributed nodes (the core); the operators attached
    # by their neighbours fold too where the whole form matches the representative's.
    # (a form is a deep tuple, hashed afresh at every lookup: each is numbered once, and
    # the regions' forms compared by their numbers)
    by_core: dict[int, list[str]] = defaultdict(list)
    core: dict[str, list[torch.fx.Node]] = {}
    full: dict[str, int] = {}  # a region -> the number of its whole form
    numbered: dict[tuple, int] = {}  # a whole form -> its number
    cores: dict[tuple, int] = {}  # a core form -> its number
    core_of: dict[int, int] = {}  # a whole form's number -> its core's
    outside: dict[torch.fx.Node, tuple] = {}  # (an input from outside: its form, by node)
    for r, ms in members.items():
        core[r] = [n for n in ms if n.name not in free]
        form = _canonical(ms, out_kind, attached=free, outside=outside)
        i = full[r] = numbered.setdefault(form, len(numbered))
        # the whole form, its attached nodes marked, says which are the core's and what
        # each reads: equal whole forms, equal cores (one made per whole form)
        c = core_of.get(i)
        if c is None:
            c = core_of[i] = cores.setdefault(
                _canonical(core[r], out_kind, outside=outside), len(cores)
            )
        by_core[c].append(r)
    core_forms = {c: form for form, c in cores.items()}

    rep = {n.name: n.name for n in nodes}
    groups, alone = [], []
    for c, regions in by_core.items():
        if len(regions) < 2:
            alone.extend(regions)
            continue
        form = core_forms[c]
        counts = Counter(full[r] for r in regions)
        head = max(regions, key=lambda r: counts[full[r]])  # the first of the most common
        regions = [head] + [r for r in regions if r != head]
        for r in regions[1:]:
            whole = full[r] == full[head]
            for a, b in zip(
                members[r] if whole else core[r], members[head] if whole else core[head]
            ):
                rep[a.name] = b.name
        sig = hashlib.sha256(repr(form).encode()).hexdigest()[:12]
        groups.append(FoldGroup(instances=tuple(regions), nodes=len(members[head]), signature=sig))
    return FoldedGraph(
        step=step,
        rep=rep,
        groups=tuple(groups),
        unfolded=tuple(alone),
        region={k: v for k, v in region.items() if v},
        fold_s=time.perf_counter() - t0,
    )
