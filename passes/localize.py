"""The global step graph run on one rank's local tensors: ``_Localizer``, the interpreter
whose run passes/codegen traces (``make_fx``) into the local joint graph.

Takes: the step's joint ``GraphModule`` (in the plan's order, with the copies of its
checkpointed layers: passes/order, passes/remat; ``copy_of``: each copy's original), the
``Plan`` and a torch ``DeviceMesh`` with its process groups. Run (``Interpreter.run``) on
this rank's local shards of the placeholders, it returns the step's outputs as this rank
leaves with them (the loss Replicate, each gradient in its parameter's placement), and
lists the nodes whose op came out placed otherwise than planned (``mismatches``). Each op it
runs, a redistribution's collectives among them, is a node of the traced local graph.

For each node, with strategy ``s``:

    1. each tensor input arrives with its producer's output placement ``p`` and is
       redistributed to ``s.ins[j]`` (``_redistribute``: DTensor's ``redistribute_local_tensor``,
       which emits one functional collective per mesh axis that changes);
    2. the op runs through DTensor on the redistributed inputs (``_run_op``): DTensor's own
       dispatch turns global shape arguments (view sizes, expand sizes, factory sizes) into
       local ones, and runs the local kernel. Its output placement is checked against
       ``s.out``; a mismatch is redistributed and counted (``mismatches``);
    3. ops without a rule, ops without tensor inputs, and ops whose strategy replicates every
       input and output run as they are, on whole tensors; ``new_zeros`` and its kind (a
       tensor of a given size) are made at their planned local size;
    4. attention with its query rows split (the ``sequence`` entry of passes/rules) runs as
       ``autopar::sdpa_rows`` (and its backward) with this rank's first row, its offset in the
       sequence (``core.local_offset`` at the rank's mesh coordinate; ``_rows_attention``):
       DTensor's dispatch would run the plain kernel, which aligns a causal mask to the local
       rows. Causal rows are load-balanced between partner ranks, and the ``ring`` variant
       runs as ring attention (passes/local_attention: ``_Rows``, ``_Ring``).
    5. a cross-entropy op with its classes split (passes/vocab) runs on this rank's classes,
       from its first class (``core.local_offset``; ``_split_loss``): the softmax's max and
       sum, and its backward's sum, all-reduced over the classes' axis and waited for at
       once; and a ``mean`` loss with its rows split runs on this rank's rows, its count of
       targets all-reduced over the rows' axes (passes/vocab, "Rows"); DTensor's dispatch
       has no rule for these strategies.

At the graph outputs the loss is redistributed to Replicate, each gradient to its
parameter's placement. (``_run_op`` wraps and unwraps local shards without the views that
``DTensor.from_local`` and ``to_local`` make.)

The gradients the plan buckets (passes/buckets) are reduced earlier: right after the node
that makes a bucket's last gradient, its members are flattened into one tensor and
all-reduced, or (a bucket of reduce-scatters into sharded parameters) laid out rank-major,
each rank's chunk of every member in turn, and reduce-scattered (``_issue``); each output
is a view of the result (``_bucketed``). On
CUDA an all-reduce bucket is waited for at the graph's end, so it overlaps the rest of the
backward, and a reduce-scatter bucket where the next one on its axis is issued (the entry's
``wait_after``: its input, G times its output, is held until the wait); on gloo a bucket is
waited for at once, one collective in flight per group as with the ring's shifts.

NOTE: an earlier version issued each gradient's reduction right after it with every wait
at the end, on gloo too; one CI run (the LSTM zoo case, under load) died of heap corruption
("malloc(): unaligned tcache chunk") with 6 collectives in flight on one gloo group. gloo
runs the collectives in flight on one group on several threads, and two in flight to one
peer can mix their messages (``_Ring``); so on gloo a bucket is waited for where it is
issued.
"""

from __future__ import annotations

import functools
import math
import operator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.utils._pytree import tree_flatten, tree_map

from autopar.core import (
    PlannedCollective,
    contiguous_stride,
    hierarchical_axes,
    local_offset,
    local_shape,
    ops,
    parse_placements,
    reductions,
)
from autopar.core.schedule import bucket_site, edge_ends

from . import buckets, rules, vocab
from .local_attention import _Ring, _Rows

__all__ = ["redistribute_local"]

_aten = torch.ops.aten
# factories that take their dtype and device from a tensor and their size from an argument
_NEW_FACTORIES = {_aten.new_zeros, _aten.new_ones, _aten.new_empty, _aten.new_full}
_SDPA = torch.ops.autopar.sdpa.default


def _spec(dmesh, placements, val, shape=None) -> DTensorSpec:
    """The spec of ``val`` placed ``placements`` (of global ``shape``, where given)."""
    shape = val.shape if shape is None else torch.Size(shape)
    return DTensorSpec(
        dmesh, tuple(placements), tensor_meta=TensorMeta(shape, contiguous_stride(shape), val.dtype)
    )


def redistribute_local(t: torch.Tensor, src_ps, dst_ps, val, dmesh) -> torch.Tensor:
    """This rank's shard ``t`` of the global ``val`` placed ``src_ps``, redistributed to
    ``dst_ps`` on ``dmesh`` (DTensor's collectives), in ``val``'s layout.

    A permutation of a dense tensor (a transposed weight) is redistributed in the order
    its elements lie in memory: the collective reads the source itself and its result is
    in the source's layout. (Made contiguous first and copied back to the layout after, it
    would hold two more buffers of the result's size, which passes/memory does not
    count.)"""
    order = ops.dense_order(t) or list(range(t.dim()))
    inverse = [order.index(d) for d in range(t.dim())]
    src_in, dst_in = _permuted(src_ps, inverse), _permuted(dst_ps, inverse)
    if order != sorted(order) and src_in is not None and dst_in is not None:
        shape = [val.shape[d] for d in order]
        out = redistribute_local_tensor(
            t.permute(order), _spec(dmesh, src_in, val, shape), _spec(dmesh, dst_in, val, shape)
        ).permute(inverse)
    else:
        out = redistribute_local_tensor(
            t.contiguous(), _spec(dmesh, src_ps, val), _spec(dmesh, dst_ps, val)
        )
    # a collective writes a contiguous tensor; the graph's views may need the layout the
    # value has in the global graph (a transposed key gradient, viewed back to the
    # projection's [B, S, K * D])
    return ops.in_layout_of(out, val)


def _permuted(placements, inverse: list[int]):
    """``placements`` of a tensor whose dim d is dim ``inverse[d]`` after a permute (None
    where one of them is not a plain ``Shard``, ``Replicate`` or ``Partial``)."""
    out = []
    for p in placements:
        if type(p) is Shard:
            out.append(Shard(inverse[p.dim]))
        elif p.is_replicate() or p.is_partial():
            out.append(p)
        else:
            return None
    return tuple(out)


class _Localizer(torch.fx.Interpreter):
    """The interpreter of the module docstring: ``gm`` run node by node on local tensors.

    Takes the step's joint graph ``gm`` (in the plan's order, with its checkpointed
    layers' copies), the ``plan``, the ``dmesh`` and ``copy_of`` (a copy's node -> its
    original, whose strategy it runs). ``run(*local_placeholders)`` returns the step's
    outputs as this rank leaves with them; under ``make_fx`` it is traced into the local
    joint graph. After the run, ``mismatches`` lists each node whose op came out placed
    otherwise than planned (``"<node>: <got> vs planned <want>"``). ``overlap`` (a mesh not
    on CPU) leaves the buckets' collectives in flight past their issue (and passes/codegen
    then hoists the prefetched reshards)."""

    def __init__(self, gm: torch.fx.GraphModule, plan, dmesh, copy_of: dict[str, str]):
        super().__init__(gm, garbage_collect_values=True)
        self.plan = plan
        self.copy_of = copy_of
        self.dmesh = dmesh
        self.placed: dict[str, tuple] = {}
        self.mismatches: list[str] = []
        self.rep = (Replicate(),) * dmesh.ndim
        self.param_nodes = {n: name for name, n in plan.params.items()}
        # gradient buckets (passes/buckets): issued after the node that makes the last
        # gradient, each output position then read from its bucket; a bucket of several
        # steps runs them one after another, on CUDA each after the node its entry's
        # ``step_after`` names (else at the first read)
        # bucket -> its collectives, in order
        self.steps: dict[int, list[PlannedCollective]] = {}
        # node -> the steps issued after it
        self.issued_at: dict[str, list[PlannedCollective]] = {}
        self.waits: dict[str, list[int]] = {}  # node -> buckets waited for after it
        self.overlap = dmesh.device_type != "cpu"
        for c in plan.collectives:
            if c.bucket is None:
                continue
            self.steps.setdefault(c.bucket, []).append(c)
            if not c.step:
                self.issued_at.setdefault(bucket_site(c)[0], []).append(c)
            elif self.overlap and c.step_after is not None:
                self.issued_at.setdefault(c.step_after, []).append(c)
            if c.wait_after is not None:
                self.waits.setdefault(c.wait_after, []).append(c.bucket)
        self.outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self.reduced: dict[int, tuple] = {}  # output position -> (bucket, offset, shape)
        self.pending: dict[int, torch.Tensor] = {}  # bucket -> its last step, not waited for
        self.next_step: dict[int, int] = {}  # bucket -> its next step to issue
        self.done: dict[int, torch.Tensor] = {}  # bucket -> its reduced flat tensor
        # edges the plan reduces hierarchically (cost_models/comm): their listed collectives
        # use one mesh axis twice (a reduce-scatter and an all-gather), which DTensor's
        # one collective per axis never does
        axes_of: dict[tuple[str, str], list[str]] = {}
        for c in plan.collectives:
            if c.bucket is None:
                axes_of.setdefault(self._orig(edge_ends(c.edge)), []).append(c.axis)
        self.tiered = {e for e, axes in axes_of.items() if len(set(axes)) < len(axes)}

    def _choice(self, name):
        return self.plan.nodes[self.copy_of.get(name, name)]

    def _ps(self, texts):
        return parse_placements(texts)

    def _redistribute(self, t, src_ps, dst_ps, val, edge=None):
        if src_ps == dst_ps or not isinstance(t, torch.Tensor):
            return t
        axes = hierarchical_axes(src_ps, dst_ps)
        if axes is not None and edge is not None and self._orig(edge) in self.tiered:
            return ops.in_layout_of(self._hierarchical(t, *axes), val)
        return redistribute_local(t, src_ps, dst_ps, val, self.dmesh)

    def _orig(self, edge: tuple[str, str]) -> tuple[str, str]:
        """An edge between the global graph's nodes (a recomputed copy's, its original's)."""
        src, dst = edge
        dst = dst.removeprefix("recompute:")
        return self.copy_of.get(src, src), self.copy_of.get(dst, dst)

    def _hierarchical(self, t: torch.Tensor, inner: int, outer: tuple[int, ...]):
        """A Partial(sum) over several axes reduced into Replicate as the plan lists it
        (cost_models/comm, hierarchical reductions): reduce-scattered over ``inner`` (flat,
        padded to a multiple of its size), all-reduced over each of ``outer``, all-gathered
        over ``inner``; each waited for at once."""
        c10d = torch.ops._c10d_functional
        n = self.dmesh.size(inner)
        flat = t.contiguous().reshape(-1)
        pad = -flat.numel() % n
        if pad:
            flat = F.pad(flat, (0, pad))
        group = self.dmesh.get_group(inner).group_name
        shard = c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, "sum", n, group))
        for a in outer:
            shard = c10d.wait_tensor(
                c10d.all_reduce(shard, "sum", self.dmesh.get_group(a).group_name)
            )
        whole = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, n, group))
        return whole[: t.numel()].view(t.shape)

    def run_node(self, n):
        self._node = n
        out = super().run_node(n)
        for k in self.waits.get(n.name, ()) if self.overlap else ():  # before the next
            self.done[k] = torch.ops._c10d_functional.wait_tensor(self.pending.pop(k))
        for c in self.issued_at.get(n.name, ()):
            if not c.step:
                self._issue(c, n, out)
            else:
                assert c.bucket is not None
                self._advance(c.bucket)
        return out

    def _issue(self, bucket: PlannedCollective, node, value) -> None:
        """One bucket of gradient reductions (passes/buckets): the members flattened into
        one tensor and its first step issued. A direct bucket lays the members out
        rank-major over each reduce-scatter's axis in turn (each rank's chunk of every
        member, within it each chunk of the next reduce-scatter's axis, ...); a
        hierarchical one flat, padded to a multiple of its inner axis's size. On gloo every
        step runs and is waited for at once (two collectives in flight on one gloo group
        can mix their messages, ``_Ring``); on CUDA the next step is issued after the node
        its entry's ``step_after`` names (``_advance``), and the last waited for after the
        node its entry's ``wait_after`` names (``run_node``) or at the first read."""
        k = bucket.bucket
        assert k is not None
        steps = self.steps[k]
        names = self.plan.mesh.axis_names
        listed = tuple((c.kind, c.axis) for c in steps)
        tiered = listed[-1][0] == "all_gather"
        positions = bucket_site(bucket)[1]
        members, offset = [], 0
        for pos in positions:
            src = self.outputs[pos]
            t = value if src is node else self.env[src]
            src_ps = self.placed[src.name][0]
            want = self._ps(self.plan.output_placements[pos])
            reduced = reductions(src_ps, want)
            scattered = None if reduced is None else {names[a]: d for a, d in reduced.items()}
            if scattered is None or buckets.chain(listed, scattered) is None:
                raise RuntimeError(
                    f"bucket {k}: output {pos} ({src.name}) is {src_ps}, to leave as {want}; "
                    f"the plan bucketed it as {listed}"
                )
            pieces = [t]
            for kind, axis in listed if not tiered else ():
                if kind == "reduce_scatter":
                    n, d = self.dmesh.size(names.index(axis)), scattered[axis]
                    pieces = [c for p in pieces for c in p.chunk(n, d)]
            members.append(pieces)
            self.reduced[pos] = (k, offset, pieces[0].shape)
            offset += pieces[0].numel()
        flat = [p.reshape(-1) for r in range(len(members[0])) for p in (m[r] for m in members)]
        # (one member of an all-reduce: its own flat view, or a copy where it is not
        # contiguous)
        joined = torch.cat(flat) if len(flat) > 1 else flat[0]
        if tiered:
            pad = -joined.numel() % self.dmesh.size(names.index(listed[0][1]))
            joined = F.pad(joined, (0, pad)) if pad else joined
        self.pending[k] = self._collective(steps[0], joined)
        self.next_step[k] = 1
        if not self.overlap:
            while self.next_step[k] < len(steps):
                self._advance(k)
            self.done[k] = torch.ops._c10d_functional.wait_tensor(self.pending.pop(k))

    def _collective(self, c: PlannedCollective, x: torch.Tensor) -> torch.Tensor:
        """One step of a bucket, issued (not waited for)."""
        c10d = torch.ops._c10d_functional
        axis = self.plan.mesh.axis_names.index(c.axis)
        size, group = self.dmesh.size(axis), self.dmesh.get_group(axis).group_name
        if c.kind == "reduce_scatter":
            return c10d.reduce_scatter_tensor(x, c.op, size, group)
        if c.kind == "all_gather":
            return c10d.all_gather_into_tensor(x, size, group)
        return c10d.all_reduce(x, c.op, group)

    def _advance(self, k: int) -> None:
        """Bucket ``k``'s next step: the one before waited for, this one issued on its
        output."""
        i = self.next_step[k]
        x = torch.ops._c10d_functional.wait_tensor(self.pending.pop(k))
        self.pending[k] = self._collective(self.steps[k][i], x)
        self.next_step[k] = i + 1

    def _bucketed(self, pos: int, val) -> torch.Tensor:
        """Output ``pos``'s reduced gradient: a view of its bucket's reduced tensor (the
        steps not yet issued, issued first)."""
        k, offset, shape = self.reduced[pos]
        if k not in self.done:
            while self.next_step[k] < len(self.steps[k]):
                self._advance(k)
            self.done[k] = torch.ops._c10d_functional.wait_tensor(self.pending.pop(k))
        out = self.done[k].narrow(0, offset, math.prod(shape)).view(shape)
        return ops.in_layout_of(out, val)

    def placeholder(self, target, args, kwargs):
        out = super().placeholder(target, args, kwargs)
        self.placed[self._node.name] = (self._ps(self._choice(self._node.name).out[0]),)
        return out

    def call_function(self, target, args, kwargs):
        node = self._node
        choice = self._choice(node.name)
        out_ps = tuple(None if o is None else self._ps(o) for o in choice.out)
        self.placed[node.name] = out_ps
        if target is operator.getitem:
            src, idx = node.args
            t = args[0][idx]
            src_ps = self.placed[src.name][idx]
            return self._redistribute(
                t, src_ps, self._ps(choice.ins[0]), node.meta["val"], (src.name, node.name)
            )

        flat_nodes, _ = tree_flatten((node.args, node.kwargs))
        in_nodes = [a for a in flat_nodes if isinstance(a, torch.fx.Node)]
        flat_vals, spec = tree_flatten((args, kwargs))
        j = 0
        dst_all = []
        new_vals = []
        for a, v in zip(flat_nodes, flat_vals):
            if isinstance(a, torch.fx.Node):
                dst = self._ps(choice.ins[j])
                src_ps = self.placed[a.name][0]
                new_vals.append(
                    self._redistribute(v, src_ps, dst, a.meta["val"], (a.name, node.name))
                )
                dst_all.append((dst, a.meta["val"]))
                j += 1
            else:
                new_vals.append(v)
        args, kwargs = spec.unflatten(new_vals)
        replicated = all(ps == self.rep for ps, _ in dst_all) and all(
            ps is None or ps == self.rep for ps in out_ps
        )
        if not in_nodes or replicated or node.name in self.plan.fallback_nodes:
            # whole tensors in, whole tensors out: the op itself, as on one device
            return target(*args, **kwargs)
        if getattr(target, "overloadpacket", None) in _NEW_FACTORIES and out_ps[0] is not None:
            # a new tensor of a given size: made at its planned local size, whatever the
            # placement of the tensor it takes its dtype and device from
            size = local_shape(tuple(node.meta["val"].shape), out_ps[0], self.dmesh.shape)
            return target(args[0], list(size), *args[2:], **kwargs)
        in_ps, in_shapes = [ps for ps, _ in dst_all], [tuple(v.shape) for _, v in dst_all]
        split = vocab.split_axis(target, args, in_ps, in_shapes)
        rows = vocab.row_axes(target, args, in_ps, in_shapes)
        if split is not None or rows:
            return self._split_loss(target, args, dst_all, split, rows)
        at = rules.ATTENTION_Q.get(target)
        if at is not None and rules.sequence_axes(dst_all[at][0]):
            return self._rows_attention(target, args, dst_all)
        return self._run_op(node, target, args, kwargs, in_nodes, dst_all, out_ps)

    def _split_loss(self, target, args, placed, split, rows):
        """A cross-entropy op on this rank's classes and rows (module docstring, 5)."""
        offset, group = 0, ""
        if split is not None:
            axis, cdim, pos = split
            ps, val = placed[pos]
            coordinate = self.dmesh.get_coordinate()
            offset = local_offset(tuple(val.shape), ps, self.dmesh.shape, coordinate)[cdim]
            group = self.dmesh.get_group(axis).group_name
        counts = tuple(self.dmesh.get_group(a).group_name for a in rows)
        out = vocab.run_local(target, args, offset, group, counts)
        metas = self._node.meta["val"]
        if isinstance(out, tuple):
            return tuple(ops.in_layout_of(t, v) for t, v in zip(out, metas))
        return ops.in_layout_of(out, metas)

    def _rows_attention(self, target, args, placed):
        """A sequence-sharded attention node on this rank's rows (module docstring, 4)."""
        at = rules.ATTENTION_Q[target]
        ps, q_val = placed[at]
        coordinate = self.dmesh.get_coordinate()
        offset = local_offset(tuple(q_val.shape), ps, self.dmesh.shape, coordinate)[2]
        forward = target == _SDPA
        (axis,) = rules.sequence_axes(ps)
        ranks = self.dmesh.shape[axis]
        group = self.dmesh.get_group(axis)
        rows = local_shape(tuple(q_val.shape), ps, self.dmesh.shape)[2]
        causal = rules.is_causal(target, args)
        split = _Rows(
            coordinate[axis], ranks, group, offset, rows, rules.balanced(causal, rows, ranks)
        )
        if forward:
            q, k, v, mask, _, scale = args
        else:
            grad_out, q, k, v, out, lse, mask, _, scale = args
        if split.partner != split.me and mask is not None and mask.shape[-2] > 1:
            raise NotImplementedError("load-balanced causal rows with a mask of rows")
        # (a ring of one holds every key: run as gathered)
        if ranks > 1 and rules.context_variant(target, [p for p, _ in placed]) == "ring":
            overlap = self.dmesh.device_type != "cpu"
            ring = _Ring(coordinate[axis], ranks, group, k.shape[2], mask, causal, scale, overlap)
            if forward:
                outs = split.forward(lambda sets: ring.forward(k, v, sets), q)
            else:
                outs = split.backward(lambda sets: ring.backward(k, v, sets), grad_out, q, out, lse)
        elif forward:

            def gathered(sets):
                return [
                    torch.ops.autopar.sdpa_rows(r, k, v, mask, causal, scale, o) for r, o in sets
                ]

            outs = split.forward(gathered, q)
        else:

            def gathered_backward(sets):
                rows_backward = torch.ops.autopar.sdpa_rows_backward
                grads = [
                    rows_backward(go, r, k, v, o, lse_r, mask, causal, scale, off)
                    for go, r, o, lse_r, off in sets
                ]
                dk = functools.reduce(operator.add, [g[1] for g in grads])
                dv = functools.reduce(operator.add, [g[2] for g in grads])
                return [g[0] for g in grads], dk, dv

            outs = split.backward(gathered_backward, grad_out, q, out, lse)
        # each output in the memory layout the global graph's views expect of it
        return tuple(ops.in_layout_of(t, v) for t, v in zip(outs, self._node.meta["val"]))

    def _run_op(self, node, target, args, kwargs, in_nodes, dst_all, out_ps):
        it = iter(dst_all)

        def wrap(v):
            if isinstance(v, torch.Tensor):
                ps, val = next(it)
                # NOTE: DTensor's own constructor is private (its docstring), as in
                # runtime/parallel_module._as_grad. ``DTensor.from_local`` makes the same
                # DTensor through an autograd Function that views its input (and
                # ``to_local`` with grad on views its output), and the trace records every
                # view: 602 on test_training's GPT at (2, 2), half of the ops traced, and 18
                # survived into the compiled backward. Without them, building that local
                # graph took 0.41-0.60 s against 0.79-1.19 s. The trace needs no autograd:
                # the graph is the joint one. tests/unit/test_torch_internals.py checks the
                # two agree.
                return DTensor(v, _spec(self.dmesh, ps, val), requires_grad=False)
            return v

        dargs, dkwargs = tree_map(wrap, (args, kwargs))
        out = target(*dargs, **dkwargs)
        vals = node.meta["val"]
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        metas = list(vals) if isinstance(vals, (tuple, list)) else [vals]
        local = []
        for o, want, meta in zip(outs, out_ps, metas):
            if isinstance(o, DTensor):
                got = tuple(o.placements)
                with torch.no_grad():  # the local tensor itself, not a view (wrap's note)
                    t = o.to_local()
                if want is not None and got != want:
                    self.mismatches.append(f"{node.name}: {got} vs planned {want}")
                    t = self._redistribute(t, got, want, meta)
                local.append(t)
            else:
                local.append(o)
        if isinstance(out, (tuple, list)):
            return type(out)(local) if isinstance(out, tuple) else local
        return local[0]

    def output(self, target, args, kwargs):
        (outs,) = args
        node = self._node
        new = []
        for pos, (a, v) in enumerate(zip(node.args[0], outs)):
            if not isinstance(a, torch.fx.Node) or not isinstance(v, torch.Tensor):
                new.append(v)
                continue
            if pos in self.reduced:
                new.append(self._bucketed(pos, a.meta["val"]))
                continue
            src_ps = self.placed[a.name][0]
            want = self.plan.output_placements[pos]
            edge = (a.name, f"output[{pos}]")
            new.append(self._redistribute(v, src_ps, self._ps(want), a.meta["val"], edge))
        return type(outs)(new) if isinstance(outs, tuple) else new
