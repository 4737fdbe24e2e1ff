"""Rewrite the global step graph into the local step graph one rank runs.

Takes: the ``StepGraph`` (passes/trace), a ``Plan`` and a torch ``DeviceMesh`` with its
process groups. Returns: a ``CompiledStep`` (core/compiled.py) for the runtime: the local
joint ``GraphModule`` over local shards, with functional collectives (``_c10d_functional.*``)
where the plan redistributes (``build_local_graph``), partitioned and compiled by
aot_autograd (``compile_local_step``). ``codegen`` does both.

How: an ``fx.Interpreter`` runs the global graph on local tensors, node by node (in the
plan's order, passes/order), and ``make_fx`` records what it does: each tensor input
redistributed to the placement its node runs it with, the op run through DTensor on local
shards, the attention and loss ops with split rows or classes run on this rank's part, the
gradients' buckets reduced where the plan issues them, and the outputs redistributed to
the placements they leave with (passes/localize, ``_Localizer``, with the steps one by one).

Nothing is done when the plan replicates everything (the local graph is then the global
graph, plus nothing). A view to the shape its input already has is replaced by its input
(``drop_identity_views``): a redistribution or DTensor's dispatch may leave one, a call of
the step that the plan has no node for and the cost model does not price.

On CUDA a reshard the plan issues ahead of its consumer (passes/prefetch: the entry's
``issue_after``) is traced where its consumer reads it, then moved with the ops that
prepare its input to right after the node it is issued after (``hoist_prefetched``); its
wait stays before the consumer, so the collective runs beside the nodes between.

The compiled forward and backward graphs are kept in ``CompiledStep.graphs``. Before
aot_autograd partitions the local graph, each collective is pinned to the graph that holds
it (``pin_collectives``): its default partition would otherwise run a collective twice
wherever the other graph can rebuild its input, so that the step ran more than the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx.traceback as fx_traceback

# NOTE: torch.compile's aot_eager compiler: no public function compiles an fx graph to its
# boxed Python code (tests/unit/test_torch_internals.py)
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch._aot_autograd.subclass_utils import create_subclass_meta
from torch._functorch.aot_autograd import aot_compile_joint_with_descriptors
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.core import CompiledStep, Plan, local_shape, roles

from . import order, remat
from .localize import _Localizer, redistribute_local
from .localize import _spec as _spec  # (tests/unit/test_torch_internals.py builds a DTensor by it)
from .trace import StepGraph

__all__ = [
    "LocalStep",
    "build_local_graph",
    "codegen",
    "compile_local_step",
    "count_collectives",
    "pin_collectives",
    "redistribute_local",
]


@dataclass
class LocalStep:
    """The local joint graph and how it was made.

    Attributes:
        gm: the local joint graph (placeholders in the global graph's order).
        mismatches: nodes whose op, run through DTensor, came out with another placement
            than planned (redistributed to the plan's; each costs an extra collective).
        compiled: the forward and backward graphs aot_autograd partitioned ``gm`` into,
            once ``compile_local_step`` has run (``"forward"``, ``"backward"``).
    """

    gm: torch.fx.GraphModule
    mismatches: list[str] = field(default_factory=list)
    compiled: dict[str, torch.fx.GraphModule] = field(default_factory=dict)


_aten = torch.ops.aten


def build_local_graph(step: StepGraph, plan: Plan, dmesh) -> LocalStep:
    """Trace the local step graph of ``plan`` on ``dmesh`` (see the module docstring)."""
    gm, copy_of = remat.checkpointed(order.apply(step.gm, plan.order), plan.recompute)
    interp = _Localizer(gm, plan, dmesh, copy_of)
    local_args = []
    for n in step.placeholders():
        val = n.meta["val"]
        ps = plan.placements_of(n.name)
        shape = local_shape(tuple(val.shape), ps, dmesh.shape)
        local_args.append(torch.empty(shape, dtype=val.dtype, device=val.device))
    with fx_traceback.preserve_node_meta():
        gm = make_fx(interp.run)(*local_args)
    gm.graph.eliminate_dead_code()
    # placeholders keep the global graph's names and descriptors: aot_autograd's partitioner
    # finds tangents by name
    old = [n for n in step.gm.graph.nodes if n.op in ("placeholder", "output")]
    new = [n for n in gm.graph.nodes if n.op in ("placeholder", "output")]
    for a, b in zip(old, new):
        if "desc" in a.meta:
            b.meta["desc"] = a.meta["desc"]
        if b.op == "placeholder":
            with gm.graph.inserting_before(b):
                p = gm.graph.placeholder(a.name)
            p.meta.update(b.meta)
            b.replace_all_uses_with(p)
            gm.graph.erase_node(b)
    drop_identity_views(gm)
    if interp.overlap:
        hoist_prefetched(gm, plan)
    gm.graph.lint()
    gm.recompile()
    return LocalStep(gm=gm, mismatches=interp.mismatches)


_VIEWS = (_aten.view.default, _aten._unsafe_view.default)


def drop_identity_views(gm: torch.fx.GraphModule) -> int:
    """Replace each view to the shape its input already has by its input; returns how many.

    A redistribution (passes/localize, ``_Localizer._redistribute``) or DTensor's dispatch
    on local shards (``_run_op``) may leave one: 9, 18 and 25 on the zoo's hf-llama, bert and hf-gpt2 at
    (2, 2) with half a device. (Most of them came from ``DTensor.from_local`` and
    ``to_local``, which ``_run_op`` no longer calls: 935 of the 1,024 views of the zoo
    Llama's local graphs on 2 ranks, and that gloo step took 33-34 ms with them and
    26-29 ms without.) Each is a call of the generated code and a dispatch that the plan
    has no node for and the cost model does not price. A view keeps its input's strides
    when the shape is the same, so its input serves every reader. Kept: a view the graph
    outputs (aot_autograd tracks an output's aliasing of an input), and one an op
    mutates."""
    dropped = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _VIEWS:
            continue
        src = n.args[0]
        before, after = getattr(src, "meta", {}).get("val"), n.meta.get("val")
        if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
            continue
        if before.shape != after.shape or before.stride() != after.stride():
            continue
        if any(u.op == "output" or _mutates(u) for u in n.users):
            continue
        n.replace_all_uses_with(src)
        gm.graph.erase_node(n)
        dropped += 1
    return dropped


def _mutates(n: torch.fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _made_by(n: torch.fx.Node) -> str | None:
    """The step graph's node whose interpretation made local node ``n`` (a placeholder:
    its own name).

    NOTE: ``from_node`` (a list of ``torch.fx.traceback.NodeSource``, which
    ``preserve_node_meta`` records on every node make_fx creates) is the only record of it;
    tests/unit/test_torch_internals.py fails if torch stops writing it."""
    if n.op == "placeholder":
        return n.name
    source = n.meta.get("from_node")
    return source[-1].name if source else None


def hoist_prefetched(gm: torch.fx.GraphModule, plan: Plan) -> int:
    """Move each prefetched reshard's collective (passes/prefetch: ``issue_after``), with
    the ops its consumer's interpretation made to prepare its input, to right after the
    last op of the node it is issued after (after the placeholders, for a placeholder); its
    wait stays before the consumer, which the collective then runs ahead of. Returns how
    many moved (a reshard whose input is made after that point stays where it is)."""
    nodes = list(gm.graph.nodes)
    position: dict[torch.fx.Node, float] = {n: i for i, n in enumerate(nodes)}
    made: dict[str, list[torch.fx.Node]] = {}
    for n in nodes:
        name = _made_by(n)
        if name is not None:
            made.setdefault(name, []).append(n)
    last_placeholder = max((n for n in nodes if n.op == "placeholder"), key=position.__getitem__)
    moved = 0
    for c in plan.collectives:
        at = c.issue_after
        if at is None:
            continue
        src, dst = c.edge.split("->")
        anchor = made.get(at, [None])[-1]
        if anchor is None:
            continue
        if anchor.op == "placeholder":
            anchor = last_placeholder
        mine = set(made.get(dst, ()))
        for coll in made.get(dst, ()):
            if not _is_collective(coll):
                continue
            # the collective and what the consumer's interpretation made for its input
            block, stack = set(), [coll]
            while stack:
                n = stack.pop()
                if n in block:
                    continue
                block.add(n)
                stack.extend(a for a in n.all_input_nodes if a in mine)
            outside = {a for n in block for a in n.all_input_nodes if a not in block}
            if not any(_made_by(a) == src for a in outside):
                continue  # another input's reshard
            if any(position[a] > position[anchor] for a in outside):
                break  # its input is made later: issued where it is
            base, ranked = position[anchor], sorted(block, key=position.__getitem__)
            for k, n in enumerate(ranked):
                anchor.append(n)
                anchor = n
                position[n] = base + (k + 1) / (len(ranked) + 1)  # (between, as now)
            moved += 1
            break
    return moved


def _is_collective(n: torch.fx.Node) -> bool:
    target = n.target
    return (
        n.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == "_c10d_functional"
        and target is not torch.ops._c10d_functional.wait_tensor.default
    )


def pin_collectives(gm: torch.fx.GraphModule) -> None:
    """Tag each collective ``must_be_in_forward`` or ``must_be_in_backward``, by where the
    local graph runs it, so that the partitioned graphs run each one once, where it is.

    aot_autograd's default partition builds each graph by copying every node it can compute
    from that graph's inputs, then drops the dead ones; but its first pass keeps a dead
    ``wait_tensor`` (impure), and its second keeps every dead node that is not a collective.
    So a collective ran twice wherever the other graph could compute its input:
      - a forward collective in the backward, rebuilt from saved values (a load-balanced
        attention's swap of q from the saved q, with the attention kernel after it;
        qwen2-moe's all-gathers before its experts);
      - a backward collective that reads no gradient in the forward (a ring attention's
        backward shifts of the keys, rebuilt from the weights).
    A tagged node cannot be copied into the other graph, nor anything after it; what the
    backward reads of a forward collective is saved (the partitioner saves each one).

    NOTE: ``partitioner_tag`` is aot_autograd's node-meta key for this, with no public API
    (tests/unit/test_torch_internals.py fails if the partitioner stops reading it)."""
    nodes = list(gm.graph.nodes)
    forward = [i for i, n in enumerate(nodes) if n.meta.get("partitioner_tag") == "is_forward"]
    if not forward:
        return
    last = forward[-1]  # (it keeps its tag: the partitioner ends the forward there)
    for i, n in enumerate(nodes):
        target = n.target
        if (
            n.op != "call_function"
            or not isinstance(target, torch._ops.OpOverload)
            or target.namespace != "_c10d_functional"
            or target is torch.ops._c10d_functional.wait_tensor.default
        ):
            continue
        tag = n.meta.get("partitioner_tag")
        if i < last and tag == "is_forward":
            n.meta["partitioner_tag"] = "must_be_in_forward"
        elif i > last and tag == "is_backward":
            # (not the untagged collectives at the graph's end: the loss's, which the
            # forward returns, is one)
            n.meta["partitioner_tag"] = "must_be_in_backward"


def compile_local_step(step: StepGraph, local: LocalStep):
    """Swap the local graph into aot_autograd's joint and compile forward and backward.

    NOTE: aot_autograd has no public way to compile a joint graph other than the one it
    exported; the graph and the state derived from the global arguments (``_aot_state``,
    ``_aot_graph_capture``) are swapped for the local ones. tests/unit/test_torch_internals.py
    fails if these attributes move.
    """
    jd = step.joint
    gm = local.gm
    pin_collectives(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    new_args = [n.meta["val"] for n in placeholders]
    jd.graph_module = gm
    jd._aot_graph_capture.graph_module = gm
    flat = []
    for orig, new in zip(jd._aot_state.flat_args, new_args):
        flat.append(torch.nn.Parameter(new) if isinstance(orig, torch.nn.Parameter) else new)
    tangents = new_args[len(jd._aot_state.flat_args) :]
    jd._aot_graph_capture.updated_flat_args = (flat, tangents)
    jd._aot_state.flat_args = flat
    meta = jd._aot_state.fw_metadata
    meta.traced_tangents = tangents
    # the expected size and stride of each tangent are checked at backward time: local ones
    meta.subclass_tangent_meta = create_subclass_meta(
        tangents, count_symints=False, with_memory_format=True
    )

    # the partitioned graphs, kept for inspection, run as the Python code fx generates for
    # them, each input dropped at its last use (torch.compile's aot_eager does the same).
    # NOTE: aot_autograd's default runs them in an fx Interpreter that sets each node's
    # metadata as current (for error messages): ~60 us of Python per node on the CI
    # machine, several times the ops' own time in a small step
    # (benchmarks/cost_fidelity.py).
    def keep(kind: str):
        def compiler(g: torch.fx.GraphModule, example_inputs):
            local.compiled[kind] = g
            return boxed_nop(g, example_inputs)

        return compiler

    return aot_compile_joint_with_descriptors(
        jd, fw_compiler=keep("forward"), bw_compiler=keep("backward")
    )


COLLECTIVE_OPS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}
"""``_c10d_functional`` op name -> the collective kind the plan names it by."""


def collective_kind(op) -> str | None:
    """The plan's kind of a functional collective op (``COLLECTIVE_OPS``), else None."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "_c10d_functional":
        return None
    return COLLECTIVE_OPS.get(op._opname)


def group_axes(dmesh) -> dict[str, str]:
    """``{process group name: mesh axis name}`` of ``dmesh``'s axes."""
    names = dmesh.mesh_dim_names or tuple(f"axis{i}" for i in range(dmesh.ndim))
    return {dmesh.get_group(i).group_name: name for i, name in enumerate(names)}


def count_collectives(gm: torch.fx.GraphModule, dmesh) -> dict[tuple[str, str], int]:
    """``{(kind, axis name): count}`` of the functional collectives in ``gm``."""
    group_axis = group_axes(dmesh)
    counts: dict[tuple[str, str], int] = {}
    for n in gm.graph.nodes:
        kind = collective_kind(n.target) if n.op == "call_function" else None
        if kind is None:
            continue
        group = n.args[-1]
        key = (kind, group_axis.get(group, str(group)))
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def codegen(step: StepGraph, plan: Plan, dmesh) -> CompiledStep:
    """The compiled local step of ``plan`` on ``dmesh``, as the runtime takes it."""
    local = build_local_graph(step, plan, dmesh)
    fn = compile_local_step(step, local)
    batch = [n for n in step.placeholders() if n.meta[roles.META_ROLE] in roles.BATCH_ROLES]
    return CompiledStep(
        fn=fn,
        gm=local.gm,
        param_names=list(step.param_names),
        buffer_names=list(step.buffer_names),
        alias_of=dict(step.alias_of),
        input_shapes=[tuple(n.meta["val"].shape) for n in batch],
        input_dtypes=[n.meta["val"].dtype for n in batch],
        collective_counts=count_collectives(local.gm, dmesh),
        mismatches=list(local.mismatches),
        graphs=dict(local.compiled),
        constants=dict(step.constants),
    )
