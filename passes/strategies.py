"""Candidate sharding strategies for every node of a step graph.

Takes: a ``StepGraph`` (passes/trace) and a ``Mesh``. Returns: a ``StrategySpace``: for each
node the list of ``Strategy`` it may take, the graph's tensor edges, and the constraints at
the graph's outputs. It chooses nothing and costs nothing: the solver does both.

A strategy fixes, on every mesh axis, the placement of each output of the node and the
placement each tensor input must have when the op runs (``torch.distributed.tensor``
placements: ``Shard(dim)``, ``Replicate()``, ``Partial(op)``, and ``_StridedShard``, which
DTensor produces when a view flattens a dim that is sharded inside another).

Where the strategies come from, per node kind:
    placeholder (param, buffer, input, target): every combination, one per axis, of
        ``Replicate()`` and ``Shard(d)`` whose shard count divides the dim
        (``_placeholder_strategies``); no ``Partial`` (a stored tensor is whole).
    tangent of a scalar loss: ``Replicate()`` on every axis.
    operator: DTensor's own sharding rules (``_dtensor_rule``): the op's strategy function,
        its single-dim strategy expanded to the mesh, given for each tensor argument the
        placements its producer may output (a rule that raises on that is asked again with
        one candidate at a time: ``_rule_per_candidate``). Only standard placement types
        survive (``core.placements.is_planned``), and only shardings that divide every
        sharded dim (``core.placements.divides``).
        ``_StridedShard`` is kept only on the views and batched matmuls of ``STRIDED_OPS``
        (it is what lets attention keep heads sharded through [B, h, S, D] -> [B*h, S, D]);
        offered everywhere it multiplies the strategy space several times over.
    attention (passes/rules): its query rows split over one mesh axis at most
        (``rules.split_once``).
    cross-entropy (``_log_softmax``, ``nll_loss_forward`` and their backward): also its
        classes split over one mesh axis where DTensor's strategy replicates everything
        (passes/vocab, ``class_split``): the loss of a column-parallel output head; and a
        ``mean`` loss's rows split over any axes, its count of targets reduced over them
        (``row_split``), where DTensor's rule averages the ranks' means, which is not the
        loss where they ignore different counts of targets (``exact`` drops that).
    operator with no tensor input (``arange``, ``full``, ...): replicated.
    every operator: also all-Replicate where its rule does not offer it (the op as on one
        device), so that the all-replicated plan is always feasible: the ILP never lacks a
        solution for want of a rule, only for a memory budget.
    operator with no rule: replicated, with a warning that names the op and the module path
        (``fallbacks``); the result is still correct, only slower.

``build_strategies`` walks the graph once (``_SpaceBuilder``): ``placeholder`` for graph
inputs, ``call`` for operators (``getitem`` for the picking of one output of a multi-output
op, ``_rule_strategies`` asking DTensor for the rest), then ``graph_outputs`` for the
sinks, the ties and the tied parameters.

Tied parameters (one tensor under two names) are two graph inputs tied to one placement.

Folded regions (passes/fold): the rules run once per representative; its instances share
the list (``StrategySpace.rep`` maps each instance to its representative).

Graph outputs (``Sink``): the loss must be ``Replicate`` (every rank returns the same loss);
the gradient of a parameter must have the parameter's placement, and the new value of a
buffer updated in place the buffer's; a model output (no loss)
must have the placement of the first input (the local batch in, the local batch out).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import sys
import warnings
from collections.abc import Sequence
from typing import cast

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, _collective_utils
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops import single_dim_strategy as sds
from torch.distributed.tensor._sharding_prop import _expand_single_dim_strategy_to_mesh
from torch.distributed.tensor.placement_types import Placement
from torch.fx.node import map_arg
from torch.utils._pytree import tree_flatten, tree_map

from autopar.core import (
    Edge,
    Mesh,
    Placements,
    Sink,
    Strategy,
    StrategySpace,
    TensorInput,
    contiguous_stride,
    divides,
    is_planned,
    is_strided,
    ops,
    roles,
)

# (importing rules registers autopar's own rules with DTensor)
from . import rules, vocab
from .fold import FoldedGraph, layer_regions
from .trace import StepGraph

__all__ = [
    "STRIDED_OPS",
    "NoRuleWarning",
    "build_strategies",
    "planning_device_mesh",
]


class NoRuleWarning(UserWarning):
    """An op has no sharding rule and is replicated."""


def planning_device_mesh(mesh: Mesh) -> DeviceMesh:
    """A torch ``DeviceMesh`` with no process group behind it, for DTensor's rules."""
    with unset_fake_temporarily():
        return DeviceMesh(
            "cpu",
            torch.arange(mesh.size).view(mesh.shape),
            mesh_dim_names=mesh.axis_names,
            _init_backend=False,
            _rank=0,
        )


def _tensor_meta(v) -> TensorMeta | None:
    if isinstance(v, torch.Tensor):
        return TensorMeta(v.shape, v.stride(), v.dtype)
    return None


def _shape_of(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype)
    return None


def _outputs(node: torch.fx.Node) -> list:
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        return list(v)
    return [v]


def _placeholder_strategies(shape, mesh: Mesh, *, batch_only: bool = False) -> list[Strategy]:
    """Every combination, one per axis, of Replicate and a Shard that divides the dim."""
    per_axis: list[list[Placement]] = []
    for _ in mesh.shape:
        opts: list[Placement] = [Replicate()]
        dims = [0] if batch_only else range(len(shape))
        opts += [Shard(d) for d in dims if len(shape) > d]
        per_axis.append(opts)
    out = []
    for combo in itertools.product(*per_axis):
        if divides(combo, shape, mesh.shape):
            out.append(Strategy(out=(tuple(combo),), ins=()))
    return out


def _replicated(node: torch.fx.Node, n_in: int, mesh: Mesh) -> Strategy:
    rep = (Replicate(),) * mesh.ndim
    outs = tuple(rep if isinstance(v, torch.Tensor) else None for v in _outputs(node))
    return Strategy(out=outs, ins=(rep,) * n_in)


def _spec_placements(spec) -> Placements | None:
    if spec is None:
        return None
    return tuple(spec.placements)


_dtensor_names: tuple[int, list[str]] = (0, [])  # (len(sys.modules) when read, the names)


def _dtensor_modules() -> list:
    """DTensor's modules (``torch.distributed.tensor*``), their names read again only where
    modules were imported since (each rule's call reads them: ~1,000 calls a plan, and a
    walk of every module took ~0.3 s of them)."""
    global _dtensor_names
    if _dtensor_names[0] != len(sys.modules):
        names = [n for n in list(sys.modules) if n.startswith("torch.distributed.tensor")]
        _dtensor_names = (len(sys.modules), names)
    return [m for n in _dtensor_names[1] if (m := sys.modules.get(n)) is not None]


@contextlib.contextmanager
def _planning_rules():
    """Let DTensor's single-dim expansion see every candidate placement of each input.

    At run time DTensor expands a single-dim rule for the one placement each input has; it
    collects the shard kinds it must expand placeholders into from those inputs and asserts
    there is one candidate per input. Planning offers all candidates at once, so the
    collection is widened to their union.
    """

    def unique(op_schema):
        found: set[Placement] = set()

        def visit(obj):
            if isinstance(obj, DTensorSpec):
                found.update(obj.placements)
            elif isinstance(obj, OpStrategy):
                for s in obj.strategies:
                    found.update(s.output_spec.placements)
            elif isinstance(obj, TupleStrategy):
                for c in obj.children:
                    visit(c)
            elif isinstance(obj, (list, tuple)):
                for c in obj:
                    visit(c)

        for obj in op_schema.args_schema:
            visit(obj)
        for obj in op_schema.kwargs_schema.values():
            visit(obj)
        return found

    # NOTE: DTensor's rules also price every input candidate against every strategy
    # (``redistribute_cost``) to pick one at run time. The planner prices redistributions
    # itself (cost_models/comm.py), and with dozens of candidates per input that pricing
    # dominates, so it is switched off while planning.
    real_cost = _collective_utils.redistribute_cost
    patched = [m for m in _dtensor_modules() if getattr(m, "redistribute_cost", None) is real_cost]
    original = sds._get_unique_placements
    sds._get_unique_placements = unique
    for m in patched:
        setattr(m, "redistribute_cost", _zero_cost)  # noqa: B010 - a module, not a class
    try:
        yield
    finally:
        sds._get_unique_placements = original
        for m in patched:
            setattr(m, "redistribute_cost", real_cost)  # noqa: B010


def _zero_cost(*_args, **_kwargs) -> float:
    return 0.0


def _dtensor_rule(node, args_schema, kwargs_schema, dmesh) -> list[OpSpec] | None:
    """The OpSpecs DTensor's sharding rules offer for ``node``; None when it has no rule."""
    prop = DTensor._op_dispatcher.sharding_propagator
    op = node.target
    single = prop.op_single_dim_strategy_funcs.get(op)
    func = prop.op_strategy_funcs.get(op)
    # the rule's own schema info, as DTensor's dispatch passes it: without it a rule does not
    # look inside list arguments (index's indices, cat's tensors)
    info = (
        prop.op_to_schema_info_for_single_dim_strategy.get(op)
        if single is not None
        else prop.op_to_schema_info.get(op)
    )
    schema = OpSchema(op, tuple(args_schema), dict(kwargs_schema), schema_info=info)
    if single is not None:
        outs = _outputs(node)
        out_meta = _tensor_meta(outs[0]) if len(outs) == 1 else [_tensor_meta(v) for v in outs]
        fn = _expand_single_dim_strategy_to_mesh(dmesh, schema, single, out_meta)
        result = fn(op, schema.args_meta, schema.kwargs_meta)
    elif func is not None:
        result = func(schema)
    else:
        return None
    if isinstance(result, OpStrategy):
        return list(result.strategies)
    if isinstance(result, TupleStrategy):
        # One child per output: merge the i-th OpSpec of every child when they agree on
        # the inputs (split, unbind, ...), so that a strategy covers all outputs at once.
        children = [c for c in result.children if isinstance(c, OpStrategy)]
        if not children or len(children) != len(result.children):
            return None
        n = len(children[0].strategies)
        if any(len(c.strategies) != n for c in children):
            return None
        merged = []
        for i in range(n):
            specs = [c.strategies[i] for c in children]
            ins0 = [_spec_placements(s) for s in (specs[0].input_specs or [])]
            if any([_spec_placements(s) for s in (o.input_specs or [])] != ins0 for o in specs):
                return None
            merged.append(
                OpSpec(
                    output_specs=tuple(o.output_spec for o in specs),
                    input_specs=specs[0].input_specs,
                )
            )
        return merged
    return None


def _tensor_lists(args):
    """A list of tensors is a TupleStrategy to DTensor's rules (``cat``, ``stack``, ...)."""
    out = []
    for a in args:
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, OpStrategy) for x in a):
            out.append(TupleStrategy(tuple(a)))
        else:
            out.append(a)
    return tuple(out)


def _rule_per_candidate(node, args_schema, kwargs_schema, dmesh):
    """Ask DTensor's rule with every candidate at once; if that raises, ask again with fewer.

    First one candidate of the first tensor argument at a time (the others keep all theirs).
    If that finds nothing: some rules index every argument's list by the position in one
    of them (``nll_loss_backward``), so each candidate of each tensor argument is asked with
    every other tensor argument cut to its first candidate (the rule derives the others'
    placements from the one it follows)."""
    try:
        with unset_fake_temporarily(), _planning_rules():
            return _dtensor_rule(node, args_schema, kwargs_schema, dmesh), None
    except Exception as e:  # noqa: BLE001 - a rule that fails is a rule we lack
        err = f"{type(e).__name__}: {e}"
    flat, spec = tree_flatten(args_schema)
    tensors = [i for i, a in enumerate(flat) if isinstance(a, OpStrategy)]
    if not tensors:
        return None, err

    def ask(changes: dict) -> list[OpSpec]:
        one = list(flat)
        for i, v in changes.items():
            one[i] = v
        try:
            with unset_fake_temporarily(), _planning_rules():
                return _dtensor_rule(node, spec.unflatten(one), kwargs_schema, dmesh) or []
        except Exception:  # noqa: BLE001
            return []

    found: list[OpSpec] = []
    first = tensors[0]
    for cand in flat[first].strategies:
        found.extend(ask({first: OpStrategy([cand])}))
    if found:
        return found, None
    heads = {i: OpStrategy([flat[i].strategies[0]]) for i in tensors}
    for i in tensors:
        for cand in flat[i].strategies:
            found.extend(ask({**heads, i: OpStrategy([cand])}))
    return (found or None), (None if found else err)


class _SpaceBuilder:
    """Builds a ``StrategySpace`` one node at a time, in graph order (``build_strategies``)."""

    def __init__(self, step: StepGraph, mesh: Mesh, dmesh, rep: dict[str, str]):
        self.step = step
        self.mesh = mesh
        self.dmesh = dmesh
        self.rep = rep
        self.done: dict[str, list[Strategy]] = {}  # representative -> the list it shares
        self.fallback_of: dict[str, str] = {}
        self.space = StrategySpace(
            mesh=mesh, order=[], strategies={}, edges=[], sinks=[], has_loss=step.has_loss
        )
        self.first_input: str | None = None
        self.param_nodes: dict[str, str] = {}
        self.buffer_nodes: dict[str, str] = {}
        self.stored: dict[tuple, list[Strategy]] = {}  # a stored tensor's strategies, by shape

    # -- graph inputs --------------------------------------------------------------------

    def placeholder(self, node: torch.fx.Node) -> None:
        """Stored tensors: any divisible Shard/Replicate per axis; the loss's tangent: R."""
        sp, name = self.space, node.name
        sp.targets[name] = "placeholder"
        sd = sp.shapes[name][0]
        shape = sd[0] if sd else ()
        role = sp.roles[name]
        if role == roles.PARAM:
            pname = self.step.param_names[len(sp.params)]
            sp.params[pname] = self.param_nodes[pname] = name
        elif role == roles.BUFFER:
            bname = self.step.buffer_names[len(sp.buffers)]
            sp.buffers[bname] = self.buffer_nodes[bname] = name
        elif role in roles.BATCH_ROLES:
            sp.inputs.append(name)
        if role == roles.TANGENT and self.step.has_loss:
            sp.strategies[name] = [Strategy(out=((Replicate(),) * self.mesh.ndim,), ins=())]
        elif not self.step.has_loss and role in (*roles.BATCH_ROLES, roles.TANGENT):
            # a model without a loss: the local batch in, the local batch out
            sp.strategies[name] = _placeholder_strategies(shape, self.mesh, batch_only=True)
            if self.first_input is None:
                self.first_input = name
            else:
                sp.ties.append((self.first_input, name))
        else:
            # (one list per shape: a deep step's layers have the same parameters' shapes)
            key = tuple(shape)
            made = self.stored.get(key)
            if made is None:
                made = self.stored[key] = _placeholder_strategies(shape, self.mesh)
            sp.strategies[name] = made

    # -- operators -----------------------------------------------------------------------

    def call(self, node: torch.fx.Node) -> None:
        """An operator: its edges, then its strategies (shared by a folded instance)."""
        sp, name = self.space, node.name
        sp.targets[name] = node.target
        key = self.rep.get(name, name)
        if key == name:
            in_nodes = self._call_template(node)
        else:  # an instance: the solver prices its representative's call only
            in_nodes = _input_nodes(node)
        if node.target is operator.getitem:
            self.getitem(node, key)
            return
        for j, a in enumerate(in_nodes):
            sp.edges.append(Edge(a.name, 0, name, j))
        if key in self.done:
            # NOTE: an instance's producers may offer other placements than those of the
            # node the list was built for; the solver's edges reshard between them.
            sp.strategies[name] = self.done[key]
            if key in self.fallback_of:
                sp.fallbacks[name] = self.fallback_of[key]
            return
        if not in_nodes:  # a factory (arange, full, ...): replicated
            strats = [_replicated(node, 0, self.mesh)]
        else:
            strats = self._rule_strategies(node, key, in_nodes)
            strats = [s for s in strats if rules.split_once(node.target, s.ins)]
            if node.target in vocab.CLASS_OPS:
                shapes = [self.space.tensor(a.name)[0] for a in in_nodes]
                args, mesh_shape = node.args, self.mesh.shape
                strats = vocab.exact(node.target, args, strats)
                rows = vocab.row_split(node.target, args, shapes, mesh_shape)
                strats = list(dict.fromkeys(strats + rows))
                strats += vocab.class_split(node.target, args, shapes, strats, mesh_shape)
        sp.strategies[name] = self.done[key] = strats

    def _call_template(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """Record the call with its tensor inputs as ``TensorInput``s; return those inputs."""
        flat, treespec = tree_flatten((node.args, node.kwargs))
        in_nodes = [a for a in flat if isinstance(a, torch.fx.Node)]
        counter = iter(range(len(in_nodes)))
        self.space.calls[node.name] = treespec.unflatten(
            [TensorInput(next(counter)) if isinstance(a, torch.fx.Node) else a for a in flat]
        )
        return in_nodes

    def getitem(self, node: torch.fx.Node, key: str) -> None:
        """Output ``idx`` of a multi-output op: it follows that output's placement."""
        sp, name = self.space, node.name
        src, idx = cast(torch.fx.Node, node.args[0]), cast(int, node.args[1])
        sp.edges.append(Edge(src.name, idx, name, 0))
        if key in self.done:
            sp.strategies[name] = self.done[key]
            return
        strats = []
        for ps in dict.fromkeys(s.out[idx] for s in sp.strategies[src.name]):
            if ps is not None:
                strats.append(Strategy(out=(ps,), ins=(ps,)))
        sp.strategies[name] = self.done[key] = strats

    def _out_specs(self, name: str, idx: int) -> OpStrategy:
        """The placements node ``name``'s output ``idx`` may have, as DTensor's rules read them."""
        shape_dtype = self.space.tensor(name, idx)
        seen, specs = set(), []
        for s in self.space.strategies[name]:
            ps = s.out[idx]
            if ps is None or ps in seen:
                continue
            seen.add(ps)
            meta = TensorMeta(
                torch.Size(shape_dtype[0]), contiguous_stride(shape_dtype[0]), shape_dtype[1]
            )
            specs.append(OpSpec(DTensorSpec(self.dmesh, ps, tensor_meta=meta)))
        return OpStrategy(specs)

    def _rule_strategies(self, node, key: str, in_nodes) -> list[Strategy]:
        """DTensor's rule on every candidate of each input; Replicate with a warning if none."""
        sp, name = self.space, node.name

        def to_schema(a):
            return self._out_specs(a.name, 0) if isinstance(a, torch.fx.Node) else a

        args_schema = _tensor_lists(tree_map(to_schema, node.args))
        kwargs_schema = tree_map(to_schema, node.kwargs)
        specs, err = None, None
        if isinstance(node.target, torch._ops.OpOverload):
            specs, err = _rule_per_candidate(node, args_schema, kwargs_schema, self.dmesh)
        strats = []
        for spec in specs or []:
            s = _from_opspec(spec, node, in_nodes, sp.shapes, self.mesh)
            if s is not None:
                strats.append(s)
        strats = list(dict.fromkeys(strats))
        if strats:
            # NOTE: whole tensors in, whole tensors out is always correct (it is the op on
            # one device); offered where the rule's list lacks it, so that no choice of the
            # neighbours leaves a node without a strategy and the ILP without a solution
            replicated = _replicated(node, len(in_nodes), self.mesh)
            return strats if replicated in strats else [*strats, replicated]
        where = sp.modules[name] or "<top level>"
        why = "its sharding rule failed: " + err if err else "it has no sharding rule"
        msg = (
            f"{node.target} ({where}, node {name}): {why}; replicated on every mesh axis. "
            "Add a rule in passes/rules.py (register_sharding) to shard it."
        )
        sp.fallbacks[name] = self.fallback_of[key] = msg
        warnings.warn(msg, NoRuleWarning, stacklevel=4)
        return [_replicated(node, len(in_nodes), self.mesh)]

    # -- graph outputs -------------------------------------------------------------------

    def graph_outputs(self) -> None:
        """Sinks (the loss Replicate, a gradient as its parameter, a model output as the
        first input) and the ties between the names of a tied parameter."""
        sp, step = self.space, self.step
        outputs = cast(Sequence, step.output_node().args[0])
        sp.n_outputs = len(outputs)
        for alias, first in step.alias_of.items():
            if alias in self.param_nodes and first in self.param_nodes:
                sp.ties.append((self.param_nodes[first], self.param_nodes[alias]))
                sp.aliases.add(self.param_nodes[alias])
        for pos, a in enumerate(outputs):
            if not isinstance(a, torch.fx.Node):
                continue
            if pos in step.grad_of:
                sp.sinks.append(Sink(a.name, 0, self.param_nodes[step.grad_of[pos]], pos))
            elif pos in step.mutated_buffers:
                # a buffer's new value goes back into the buffer: its placement
                sp.sinks.append(Sink(a.name, 0, self.buffer_nodes[step.mutated_buffers[pos]], pos))
            elif step.has_loss:
                sp.sinks.append(Sink(a.name, 0, None, pos))
            else:
                sp.sinks.append(Sink(a.name, 0, self.first_input, pos))


def build_strategies(
    step: StepGraph, mesh: Mesh, *, dmesh=None, folded: FoldedGraph | None = None
) -> StrategySpace:
    """Enumerate the candidate strategies of every node of ``step`` on ``mesh``.

    With ``folded`` (passes/fold), the instances of a folded region take the strategy list
    of the first of them met in graph order: DTensor's rules run once per representative.
    """
    rules.register_library_rules()
    rep = folded.rep if folded is not None else {}
    b = _SpaceBuilder(step, mesh, dmesh if dmesh is not None else planning_device_mesh(mesh), rep)
    sp = b.space
    for node in step.gm.graph.nodes:
        if node.op == "output":
            continue
        sp.order.append(node.name)
        sp.shapes[node.name] = [_shape_of(v) for v in _outputs(node)]
        for idx, v in enumerate(_outputs(node)):
            if isinstance(v, torch.Tensor):
                # (codegen redistributes such a tensor in this order; others contiguous)
                dims = ops.dense_order(v)
                if dims is not None and dims != sorted(dims):
                    sp.layouts[(node.name, idx)] = tuple(dims)
        sp.roles[node.name] = node.meta.get(roles.META_ROLE, "")
        sp.modules[node.name] = node.meta.get(roles.META_MODULE, "")
        if node.op == "placeholder":
            b.placeholder(node)
        elif node.op == "call_function":
            b.call(node)
        else:
            raise ValueError(f"unexpected node {node.format_node()} in the step graph")
    b.graph_outputs()
    sp.rep = {n: r for n, r in rep.items() if n != r}
    if folded is not None:
        sp.regions = dict(folded.region)
        sp.region_groups = {r: g.instances[0] for g in folded.groups for r in g.instances}
    else:
        sp.regions = layer_regions(step)
    sp.notes = list(step.notes)
    sp.reduce_at = dict(step.reduce_at)
    return sp


def _input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The fx nodes ``node`` reads, in ``tree_flatten`` order and with repeats, as
    ``_call_template`` numbers them (``map_arg`` walks the arguments in C: a deep step's
    instances are most of its nodes)."""
    out: list[torch.fx.Node] = []
    map_arg(node.args, out.append)
    if node.kwargs:
        map_arg(node.kwargs, out.append)
    return out


_aten = torch.ops.aten
# Ops that may take or give a _StridedShard: the views that flatten a sharded inner dim
# (attention's [B, heads, S, D] -> [B*heads, S, D]), the batched matmuls between them, and
# the views that undo the flattening. Everywhere else a strided placement is not offered.
STRIDED_OPS = {
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.transpose.int,
    _aten.expand.default,
    _aten.clone.default,
    _aten.detach.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    operator.getitem,
}


def _from_opspec(spec: OpSpec, node, in_nodes, shapes, mesh: Mesh) -> Strategy | None:
    """Turn DTensor's OpSpec into a Strategy, or None if autopar cannot use it."""
    outs = spec.output_specs
    out_list = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    node_shapes = shapes[node.name]
    if len(out_list) != len(node_shapes):
        return None
    out_ps: list[Placements | None] = []
    for o, sd in zip(out_list, node_shapes):
        if sd is None:
            out_ps.append(None)
            continue
        if o is None:
            return None
        ps = tuple(o.placements)
        if not all(is_planned(p) for p in ps) or not divides(ps, sd[0], mesh.shape):
            return None
        out_ps.append(ps)
    if spec.input_specs is None:
        in_specs = [out_list[0]] * len(in_nodes)
    else:
        in_specs = list(spec.input_specs)
    if len(in_specs) != len(in_nodes):
        return None
    in_ps = []
    for s, a in zip(in_specs, in_nodes):
        if s is None:
            return None
        ps = tuple(s.placements)
        sd = shapes[a.name][0]
        if not all(is_planned(p) for p in ps) or (sd and not divides(ps, sd[0], mesh.shape)):
            return None
        in_ps.append(ps)
    if node.target not in STRIDED_OPS and any(is_strided(ps) for ps in out_ps + in_ps):
        return None
    return Strategy(out=tuple(out_ps), ins=tuple(in_ps))
