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
        survive (``_allowed``), and only shardings that divide every sharded dim
        (``_divides``).
        ``_StridedShard`` is kept only on the views and batched matmuls of ``STRIDED_OPS``
        (it is what lets attention keep heads sharded through [B, h, S, D] -> [B*h, S, D]);
        offered everywhere it multiplies the strategy space several times over.
    operator with no tensor input (``arange``, ``full``, ...): replicated.
    operator with no rule: replicated, with a warning that names the op and the module path
        (``fallbacks``); the result is still correct, only slower.

Tied parameters (one tensor under two names) are two graph inputs tied to one placement.

Folded regions (passes/fold): the rules run once per representative; its instances share
the list (``StrategySpace.rep`` maps each instance to its representative).

Graph outputs (``Sink``): the loss must be ``Replicate`` (every rank returns the same loss);
the gradient of a parameter must have the parameter's placement; a model output (no loss)
must have the placement of the first input (the local batch in, the local batch out).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import operator
import warnings
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._pytree import tree_flatten, tree_map

from autopar.mesh import Mesh

from .fold import FoldedGraph
from .trace import StepGraph

__all__ = [
    "Strategy",
    "Edge",
    "Sink",
    "TensorInput",
    "contiguous_stride",
    "local_shape",
    "StrategySpace",
    "NoRuleWarning",
    "build_strategies",
    "placement_str",
    "parse_placement",
    "planning_device_mesh",
]

log = logging.getLogger(__name__)

Placements = tuple[Placement, ...]


class NoRuleWarning(UserWarning):
    """An op has no sharding rule and is replicated."""


def placement_str(p: Placement) -> str:
    """``S(0)``, ``R``, ``P(sum)``, ``SS(0,4)``: the short, stable text of a placement."""
    if type(p) is _StridedShard:
        return f"SS({p.dim},{p.split_factor})"
    if type(p) is Shard:
        return f"S({p.dim})"
    if type(p) is Replicate:
        return "R"
    if type(p) is Partial:
        return f"P({p.reduce_op})"
    raise ValueError(f"placement {p!r} is not one autopar plans with")


def parse_placement(s: str) -> Placement:
    if s == "R":
        return Replicate()
    if s.startswith("SS("):
        d, f = s[3:-1].split(",")
        return _StridedShard(int(d), split_factor=int(f))
    if s.startswith("S("):
        return Shard(int(s[2:-1]))
    if s.startswith("P("):
        return Partial(s[2:-1])
    raise ValueError(f"cannot parse placement {s!r}")


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run a node: placements of its outputs and of its tensor inputs.

    ``out[i]`` is a tuple of placements (one per mesh axis) for output ``i`` (``None`` for a
    non-tensor output); ``ins[j]`` the same for the node's ``j``-th tensor input, in the order
    of ``tree_flatten((node.args, node.kwargs))``.
    """

    out: tuple[Placements | None, ...]
    ins: tuple[Placements, ...]

    def __post_init__(self):
        for ps in self.out + self.ins:
            if ps is not None and not all(_allowed(p) for p in ps):
                raise ValueError(f"strategy has a placement autopar does not plan with: {ps}")

    def text(self) -> str:
        def f(ps):
            return "-" if ps is None else "(" + ",".join(placement_str(p) for p in ps) + ")"

        ins = " ".join(f(p) for p in self.ins)
        outs = " ".join(f(p) for p in self.out)
        return f"{ins} -> {outs}" if ins else outs


@dataclass(frozen=True, slots=True)
class Edge:
    """Output ``src_out`` of node ``src`` feeds tensor input ``dst_in`` of node ``dst``."""

    src: str
    src_out: int
    dst: str
    dst_in: int


@dataclass(frozen=True, slots=True)
class Sink:
    """A graph output: output ``src_out`` of ``src`` must end with a given placement.

    ``like`` names a node whose output-0 placement the sink must match (a parameter for its
    gradient, the first input for a model output); ``like=None`` means ``Replicate`` on
    every axis (the loss).
    """

    src: str
    src_out: int
    like: str | None
    position: int


@dataclass(frozen=True, slots=True)
class TensorInput:
    """Stands for the ``index``-th tensor input of a node in ``StrategySpace.calls``."""

    index: int


@dataclass
class StrategySpace:
    """Everything the solver chooses from.

    Attributes:
        mesh: the mesh planned for.
        order: node names in graph (topological) order, placeholders first.
        strategies: node name -> candidate strategies.
        edges: tensor edges between nodes.
        sinks: constraints at the graph outputs.
        ties: pairs of nodes that must take the same output placement.
        shapes: node name -> per output (global shape, dtype) or None.
        targets: node name -> op (OpOverload or callable) or "placeholder".
        roles / modules: node name -> role and module path (from passes/trace).
        fallbacks: node name -> the warning given for an op without a rule.
        calls: node name -> (args, kwargs) of the op with its ``j``-th tensor input replaced
            by ``TensorInput(j)`` (what a cost model needs to price the op on local shapes).
        aliases: placeholders of tied parameters other than the first (same memory).
        rep: node name -> its representative (passes/fold): the node whose strategy it takes;
            a node missing here represents itself. Instances share their representative's
            strategy list (the same list object).
    """

    mesh: Mesh
    order: list[str]
    strategies: dict[str, list[Strategy]]
    edges: list[Edge]
    sinks: list[Sink]
    ties: list[tuple[str, str]] = field(default_factory=list)
    shapes: dict[str, list[tuple[tuple[int, ...], torch.dtype] | None]] = field(
        default_factory=dict
    )
    targets: dict[str, object] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    calls: dict[str, tuple] = field(default_factory=dict)
    aliases: set[str] = field(default_factory=set)
    rep: dict[str, str] = field(default_factory=dict)

    @functools.cached_property
    def in_sources(self) -> dict[str, list[tuple[str, int]]]:
        """Node name -> (producer, output index) of each of its tensor inputs, in order."""
        ins: dict[str, list] = {n: [] for n in self.order}
        for e in self.edges:
            ins[e.dst].append((e.dst_in, e.src, e.src_out))
        return {n: [(src, so) for _, src, so in sorted(v)] for n, v in ins.items()}

    def n_strategies(self) -> int:
        return sum(len(s) for s in self.strategies.values())


def planning_device_mesh(mesh: Mesh):
    """A torch ``DeviceMesh`` with no process group behind it, for DTensor's rules."""
    from torch.distributed.device_mesh import DeviceMesh

    with unset_fake_temporarily():
        return DeviceMesh(
            "cpu",
            torch.arange(mesh.size).view(mesh.shape),
            mesh_dim_names=mesh.axis_names,
            _init_backend=False,
            _rank=0,
        )


def _allowed(p: Placement) -> bool:
    if type(p) in (Shard, Replicate, _StridedShard):
        return True
    return type(p) is Partial and p.reduce_op in ("sum", "avg")


def _divides(placements: Placements, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    factor = [1] * len(shape)
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, (Shard, _StridedShard)):
            if p.dim >= len(shape) or p.dim < -len(shape):
                return False
            factor[p.dim] *= size
    return all(f == 1 or (s % f == 0 and s >= f) for s, f in zip(shape, factor))


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
    per_axis: list[list[Placement]] = []
    for _ in mesh.shape:
        opts: list[Placement] = [Replicate()]
        dims = [0] if batch_only else range(len(shape))
        opts += [Shard(d) for d in dims if len(shape) > d]
        per_axis.append(opts)
    out = []
    for combo in itertools.product(*per_axis):
        if _divides(combo, shape, mesh.shape):
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


@contextlib.contextmanager
def _planning_rules():
    """Let DTensor's single-dim expansion see every candidate placement of each input.

    At run time DTensor expands a single-dim rule for the one placement each input has; it
    collects the shard kinds it must expand placeholders into from those inputs and asserts
    there is one candidate per input. Planning offers all candidates at once, so the
    collection is widened to their union.
    """
    from torch.distributed.tensor._ops import single_dim_strategy as sds

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

    import sys

    from torch.distributed.tensor import _collective_utils

    # NOTE: DTensor's rules also price every input candidate against every strategy
    # (``redistribute_cost``) to pick one at run time. The planner prices redistributions
    # itself (cost_models/comm.py), and with dozens of candidates per input that pricing
    # dominates, so it is switched off while planning.
    real_cost = _collective_utils.redistribute_cost
    patched = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("torch.distributed.tensor")
        and getattr(m, "redistribute_cost", None) is real_cost
    ]
    original = sds._get_unique_placements
    sds._get_unique_placements = unique
    for m in patched:
        m.redistribute_cost = _zero_cost
    try:
        yield
    finally:
        sds._get_unique_placements = original
        for m in patched:
            m.redistribute_cost = real_cost


def _zero_cost(*_args, **_kwargs) -> float:
    return 0.0


def _dtensor_rule(node, args_schema, kwargs_schema, dmesh) -> list[OpSpec] | None:
    """The OpSpecs DTensor's sharding rules offer for ``node``; None when it has no rule."""
    prop = DTensor._op_dispatcher.sharding_propagator
    op = node.target
    schema = OpSchema(op, tuple(args_schema), dict(kwargs_schema))
    single = prop.op_single_dim_strategy_funcs.get(op)
    func = prop.op_strategy_funcs.get(op)
    if single is not None:
        from torch.distributed.tensor._sharding_prop import _expand_single_dim_strategy_to_mesh

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
        children = result.children
        if not children or not all(isinstance(c, OpStrategy) for c in children):
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


def build_strategies(
    step: StepGraph, mesh: Mesh, *, dmesh=None, folded: FoldedGraph | None = None
) -> StrategySpace:
    """Enumerate the candidate strategies of every node of ``step`` on ``mesh``.

    With ``folded`` (passes/fold), the instances of a folded region take the strategy list
    of the first of them met in graph order: DTensor's rules run once per representative.
    """
    rep = folded.rep if folded is not None else {}
    done: dict[str, list[Strategy]] = {}  # representative -> the list its instances share
    fallback_of: dict[str, str] = {}
    if dmesh is None:
        dmesh = planning_device_mesh(mesh)
    gm = step.gm
    strategies: dict[str, list[Strategy]] = {}
    edges: list[Edge] = []
    sinks: list[Sink] = []
    ties: list[tuple[str, str]] = []
    shapes, targets, roles, modules, fallbacks, calls = {}, {}, {}, {}, {}, {}
    order: list[str] = []
    first_input: str | None = None

    def out_specs(name: str, idx: int) -> OpStrategy:
        shape_dtype = shapes[name][idx]
        seen, specs = set(), []
        for s in strategies[name]:
            ps = s.out[idx]
            if ps is None or ps in seen:
                continue
            seen.add(ps)
            meta = TensorMeta(
                torch.Size(shape_dtype[0]), contiguous_stride(shape_dtype[0]), shape_dtype[1]
            )
            specs.append(OpSpec(DTensorSpec(dmesh, ps, tensor_meta=meta)))
        return OpStrategy(specs)

    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        name = node.name
        order.append(name)
        outs = _outputs(node)
        shapes[name] = [_shape_of(v) for v in outs]
        roles[name] = node.meta.get("autopar_role", "")
        modules[name] = node.meta.get("autopar_module", "")
        if node.op == "placeholder":
            targets[name] = "placeholder"
            shape = shapes[name][0][0] if shapes[name][0] else ()
            role = roles[name]
            if role == "tangent" and step.has_loss:
                strategies[name] = [Strategy(out=((Replicate(),) * mesh.ndim,), ins=())]
            elif not step.has_loss and role in ("input", "target", "tangent"):
                strategies[name] = _placeholder_strategies(shape, mesh, batch_only=True)
                if first_input is None:
                    first_input = name
                else:
                    ties.append((first_input, name))
            else:
                strategies[name] = _placeholder_strategies(shape, mesh)
            continue
        if node.op != "call_function":
            raise ValueError(f"unexpected node {node.format_node()} in the step graph")
        targets[name] = node.target
        key = rep.get(name, name)
        if key == name:
            flat, treespec = tree_flatten((node.args, node.kwargs))
            in_nodes = [a for a in flat if isinstance(a, torch.fx.Node)]
            counter = iter(range(len(in_nodes)))
            calls[name] = treespec.unflatten(
                [TensorInput(next(counter)) if isinstance(a, torch.fx.Node) else a for a in flat]
            )
        else:  # an instance: the solver prices its representative's call only
            in_nodes = _input_nodes((node.args, node.kwargs))

        if node.target is operator.getitem:
            src, idx = node.args
            edges.append(Edge(src.name, idx, name, 0))
            if key in done:
                strategies[name] = done[key]
                continue
            strats = []
            for ps in dict.fromkeys(s.out[idx] for s in strategies[src.name]):
                if ps is not None:
                    strats.append(Strategy(out=(ps,), ins=(ps,)))
            strategies[name] = done[key] = strats
            continue

        for j, a in enumerate(in_nodes):
            src_out = 0
            edges.append(Edge(a.name, src_out, name, j))
        if key in done:
            # NOTE: an instance's producers may offer other placements than those of the
            # node the list was built for; the solver's edges reshard between them.
            strategies[name] = done[key]
            if key in fallback_of:
                fallbacks[name] = fallback_of[key]
            continue

        if not in_nodes:
            strategies[name] = done[key] = [_replicated(node, 0, mesh)]
            continue

        def to_schema(a):
            if isinstance(a, torch.fx.Node):
                return out_specs(a.name, 0)
            return a

        args_schema = _tensor_lists(tree_map(to_schema, node.args))
        kwargs_schema = tree_map(to_schema, node.kwargs)
        specs = None
        err = None
        if isinstance(node.target, torch._ops.OpOverload):
            specs, err = _rule_per_candidate(node, args_schema, kwargs_schema, dmesh)
        strats = []
        for spec in specs or []:
            s = _from_opspec(spec, node, in_nodes, shapes, mesh)
            if s is not None:
                strats.append(s)
        strats = list(dict.fromkeys(strats))
        if not strats:
            where = modules[name] or "<top level>"
            why = "its sharding rule failed: " + err if err else "it has no sharding rule"
            msg = (
                f"{node.target} ({where}, node {name}): {why}; replicated on every mesh axis. "
                "Add a rule in passes/strategies.py to shard it."
            )
            fallbacks[name] = fallback_of[key] = msg
            warnings.warn(msg, NoRuleWarning, stacklevel=2)
            strats = [_replicated(node, len(in_nodes), mesh)]
        strategies[name] = done[key] = strats

    out_node = next(iter(gm.graph.find_nodes(op="output")))
    param_node = {
        n.meta["desc"].target.removeprefix("model."): n.name
        for n in gm.graph.find_nodes(op="placeholder")
        if n.meta.get("autopar_role") == "param"
    }
    aliases = set()
    for alias, first in step.alias_of.items():
        if alias in param_node and first in param_node:
            ties.append((param_node[first], param_node[alias]))
            aliases.add(param_node[alias])
    for pos, a in enumerate(out_node.args[0]):
        if not isinstance(a, torch.fx.Node):
            continue
        if pos in step.grad_of:
            sinks.append(Sink(a.name, 0, param_node[step.grad_of[pos]], pos))
        elif step.has_loss:
            sinks.append(Sink(a.name, 0, None, pos))
        else:
            sinks.append(Sink(a.name, 0, first_input, pos))
    return StrategySpace(
        mesh=mesh,
        order=order,
        strategies=strategies,
        edges=edges,
        sinks=sinks,
        ties=ties,
        shapes=shapes,
        targets=targets,
        roles=roles,
        modules=modules,
        fallbacks=fallbacks,
        calls=calls,
        aliases=aliases,
        rep={n: r for n, r in rep.items() if n != r},
    )


def _input_nodes(args) -> list[torch.fx.Node]:
    """The fx nodes in ``args``, in ``tree_flatten`` order (a fast path for large graphs)."""
    out: list[torch.fx.Node] = []

    def visit(a):
        if isinstance(a, torch.fx.Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                visit(b)
        elif isinstance(a, dict):
            for b in a.values():
                visit(b)

    visit(args)
    return out


def contiguous_stride(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


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


def _strided(ps) -> bool:
    return ps is not None and any(type(p) is _StridedShard for p in ps)


def _from_opspec(spec: OpSpec, node, in_nodes, shapes, mesh: Mesh) -> Strategy | None:
    """Turn DTensor's OpSpec into a Strategy, or None if autopar cannot use it."""
    outs = spec.output_specs
    out_list = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    node_shapes = shapes[node.name]
    if len(out_list) != len(node_shapes):
        return None
    out_ps = []
    for o, sd in zip(out_list, node_shapes):
        if sd is None:
            out_ps.append(None)
            continue
        if o is None:
            return None
        ps = tuple(o.placements)
        if not all(_allowed(p) for p in ps) or not _divides(ps, sd[0], mesh.shape):
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
        ps = tuple(s.placements)
        sd = shapes[a.name][0]
        if not all(_allowed(p) for p in ps) or (sd and not _divides(ps, sd[0], mesh.shape)):
            return None
        in_ps.append(ps)
    if node.target not in STRIDED_OPS and any(_strided(ps) for ps in out_ps + in_ps):
        return None
    return Strategy(out=tuple(out_ps), ins=tuple(in_ps))


def local_shape(shape: tuple[int, ...], placements: Placements, mesh_shape) -> tuple[int, ...]:
    """The shape one rank holds of a tensor of global ``shape`` placed by ``placements``."""
    out = list(shape)
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, (Shard, _StridedShard)):
            out[p.dim] = math.ceil(out[p.dim] / size)
    return tuple(out)
