"""Rewrite the global step graph into the local step graph one rank runs.

Takes: the ``StepGraph`` (passes/trace), a ``Plan`` and a torch ``DeviceMesh`` with its
process groups. Returns: a ``CompiledStep`` (core/compiled.py) for the runtime: the local
joint ``GraphModule`` over local shards, with functional collectives (``_c10d_functional.*``)
where the plan redistributes (``build_local_graph``), partitioned and compiled by
aot_autograd (``compile_local_step``). ``codegen`` does both.

How: an ``fx.Interpreter`` runs the global graph on local tensors, node by node (in the
plan's order, passes/order), and
``make_fx`` records what it does. For each node, with strategy ``s``:

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
       rows. Causal rows are load-balanced between partner ranks (passes/rules; ``_Rows``),
       the halves exchanged by functional ``all_to_all_single`` over the rows' axis. The
       ``ring`` variant (keys split as the rows) runs as ring attention (``_Ring``): n steps,
       each ``autopar::sdpa`` on the block of keys this rank holds (``core.ops.key_blocks``
       for its causal part) merged online (``core.ops.merge_partial``), the block shifted to
       the next rank meanwhile by ``all_to_all_single`` with one nonzero split; its backward
       passes the blocks again with a gradient accumulator one step behind. On CUDA each
       shift's wait comes after the step's kernels (overlapped, as passes/solve prices it);
       on gloo it is waited for at once. A shift whose block this rank's rows do not read is
       kept in the graph by ``autopar::after`` (else the partitioner drops it on that rank
       alone, and its peer's send never matches).
       NOTE: ``torch.distributed._functional_collectives`` is the traceable collectives API
       DTensor itself emits; no public module offers it (tests/unit/test_torch_internals.py).
    5. a cross-entropy op with its classes split (passes/vocab) runs on this rank's classes,
       from its first class (``core.local_offset``; ``_split_loss``): the softmax's max and
       sum, and its backward's sum, all-reduced over the classes' axis and waited for at
       once; and a ``mean`` loss with its rows split runs on this rank's rows, its count of
       targets all-reduced over the rows' axes (passes/vocab, "Rows"); DTensor's dispatch
       has no rule for these strategies.

At the graph outputs the loss is redistributed to Replicate, each gradient to its
parameter's placement. Nothing is done when the plan replicates everything (the local graph
is then the global graph, plus nothing). A view to the shape its input already has is
replaced by its input (``drop_identity_views``): a redistribution or DTensor's dispatch
may leave one, a call of the step that the plan has no node for and the cost model does
not price. (``_run_op`` wraps and unwraps local shards without the views that
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

On CUDA a reshard the plan issues ahead of its consumer (passes/prefetch: the entry's
``issue_after``) is traced where its consumer reads it, then moved with the ops that
prepare its input to right after the node it is issued after (``hoist_prefetched``); its
wait stays before the consumer, so the collective runs beside the nodes between.

The compiled forward and backward graphs are kept in ``CompiledStep.graphs``. Before
aot_autograd partitions the local graph, each collective is pinned to the graph that holds
it (``pin_collectives``): its default partition would otherwise run a collective twice
wherever the other graph can rebuild its input, so that the step ran more than the plan.

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
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F

# NOTE: torch.compile's aot_eager compiler: no public function compiles an fx graph to its
# boxed Python code (tests/unit/test_torch_internals.py)
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch._aot_autograd.subclass_utils import create_subclass_meta
from torch._functorch.aot_autograd import aot_compile_joint_with_descriptors
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_map

from autopar.core import (
    CompiledStep,
    Plan,
    contiguous_stride,
    hierarchical_axes,
    local_offset,
    local_shape,
    ops,
    parse_placements,
    reductions,
    roles,
)
from autopar.core.schedule import bucket_site, edge_ends

from . import buckets, order, remat, rules, vocab
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


class _Rows:
    """The query rows one rank computes for a rows-split attention node (passes/rules).

    Load-balanced causal rows: this rank keeps the first half of its run of ``rows`` and
    computes its partner's second half, exchanged with one all_to_all each way (``swap``);
    the middle rank of an odd axis is its own partner. Otherwise its own run. ``forward``
    and ``backward`` hand ``attend`` the row sets, each with its first row's offset in the
    sequence, and join what comes back into this rank's rows."""

    def __init__(self, me: int, ranks: int, group, offset: int, rows: int, balanced: bool):
        self.me, self.ranks, self.group = me, ranks, group
        self.partner = ranks - 1 - me if balanced else me
        self.half = rows // 2
        self.offset = offset
        # the partner's run starts (partner - me) runs away; its second half, half further
        self.theirs = offset + (self.partner - me) * rows + self.half

    def swap(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` to the partner; the partner's ``t`` back."""
        # a copy always: ``contiguous`` is traced as nothing where ``t`` is contiguous at
        # trace time, which a kernel's output need not be when the step runs
        flat = t.clone(memory_format=torch.contiguous_format).view(-1)
        splits = [flat.numel() if r == self.partner else 0 for r in range(self.ranks)]
        got = funcol.all_to_all_single(flat, splits, splits, self.group)
        return funcol.wait_tensor(got).view(t.shape)

    def _split(self, t):
        return t[:, :, : self.half], t[:, :, self.half :]

    def forward(self, attend, q):
        """``attend([(q, offset), ...]) -> [(out, lse), ...]`` over this rank's row sets."""
        if self.partner == self.me:
            return attend([(q, self.offset)])[0]
        qa, qb = self._split(q)
        mine, theirs = attend([(qa, self.offset), (self.swap(qb), self.theirs)])
        out = torch.cat([mine[0], self.swap(theirs[0])], dim=2)
        return out, torch.cat([mine[1], self.swap(theirs[1])], dim=2)

    def backward(self, attend, grad_out, q, out, lse):
        """``attend([(grad_out, q, out, lse, offset), ...]) -> ([dq, ...], dk, dv)``."""
        if self.partner == self.me:
            (dq,), dk, dv = attend([(grad_out, q, out, lse, self.offset)])
            return dq, dk, dv
        (go_a, go_b), (q_a, q_b), (o_a, o_b) = map(self._split, (grad_out, q, out))
        (lse_a, lse_b) = self._split(lse)
        e, d = grad_out.shape[-1], q.shape[-1]
        packed = self.swap(torch.cat([go_b, q_b, o_b], dim=-1))
        go_t, q_t, o_t = torch.split(packed, [e, d, e], dim=-1)
        lse_t = self.swap(lse_b)
        sets = [(go_a, q_a, o_a, lse_a, self.offset), (go_t, q_t, o_t, lse_t, self.theirs)]
        (dq_a, dq_t), dk, dv = attend(sets)
        return torch.cat([dq_a, self.swap(dq_t)], dim=2), dk, dv


class _Ring:
    """Ring attention over one mesh axis (passes/rules, ``ring``): this rank holds the keys
    and values of positions [me * keys, (me + 1) * keys); the blocks pass to the next rank
    one step at a time, the next block's shift in flight while the kernels run on this one.

    With ``overlap`` False (gloo) each shift is sent after the step's kernels and waited for
    at once: gloo runs the collectives in flight on one group on several threads, and two
    shifts in flight to one peer mix their messages ("Received data size doesn't match
    expected size" on a ring of four).

    NOTE: ``torch.ops._c10d_functional`` directly, not ``funcol``: under tracing ``funcol``
    waits for each collective where it is issued, and the overlap needs the wait after the
    step's kernels (tests/unit/test_torch_internals.py)."""

    def __init__(
        self, me: int, ranks: int, group, keys: int, mask, is_causal: bool, scale, overlap: bool
    ):
        self.overlap = overlap
        self.me, self.ranks, self.keys = me, ranks, keys
        self.group_name = group.group_name
        self.mask, self.is_causal, self.scale = mask, is_causal, scale
        self.to = [(me + 1) % ranks == r for r in range(ranks)]
        self.frm = [(me - 1) % ranks == r for r in range(ranks)]

    def _send(self, t: torch.Tensor):
        """Start sending ``t`` to the next rank (and receiving the previous rank's)."""
        # (unlike ``_Rows.swap``'s kernel outputs, ``t`` is made by ``cat``, ``add`` or a
        # received view here: contiguous when the step runs as when it was traced)
        flat = t.contiguous().view(-1)
        n = flat.numel()
        ins = [n if r else 0 for r in self.to]
        outs = [n if r else 0 for r in self.frm]
        c10d = torch.ops._c10d_functional
        return c10d.all_to_all_single(flat, outs, ins, self.group_name), t.shape

    @staticmethod
    def _received(sent) -> torch.Tensor:
        handle, shape = sent
        return torch.ops._c10d_functional.wait_tensor(handle).view(shape)

    @staticmethod
    def _done(sent):
        """``sent``, waited for now (its tensor stands in for the handle)."""
        handle, shape = sent
        return torch.ops._c10d_functional.wait_tensor(handle), shape

    def _blocks(self, step: int, offset: int, rows: int):
        """The parts of step ``step``'s block that rows from ``offset`` read, each with its
        mask columns."""
        k_offset = (self.me - step) % self.ranks * self.keys
        for start, end, causal in ops.key_blocks(offset, rows, k_offset, self.keys, self.is_causal):
            yield start, end, causal, ops.mask_cols(self.mask, k_offset + start, k_offset + end)

    def forward(self, k, v, sets):
        """``[(out, lse), ...]`` of each ``(q, offset)`` row set against every key."""
        d = k.shape[-1]
        kv = torch.cat([k, v], dim=-1)
        accs: list = [None] * len(sets)
        for step in range(self.ranks):
            last = step == self.ranks - 1
            sent = self._send(kv) if self.overlap and not last else None
            read = False
            for j, (q, offset) in enumerate(sets):
                for start, end, causal, m in self._blocks(step, offset, q.shape[2]):
                    kb, vb = kv[:, :, start:end, :d], kv[:, :, start:end, d:]
                    part = torch.ops.autopar.sdpa(q, kb, vb, m, causal, self.scale)
                    accs[j] = ops.merge_partial(accs[j], *part)
                    read = True
            if not last:
                kv = self._received(sent or self._send(kv))
        if not read:
            # the last block, unread: its shift stays in the forward graph (ops.after), tied
            # to the output the forward returns (the lse only the backward reads, and a
            # partitioner would move it there, on this rank alone)
            accs[0] = (torch.ops.autopar.after(accs[0][0], kv), accs[0][1])
        return [(acc[0].to(q.dtype), acc[1]) for acc, (q, _) in zip(accs, sets)]

    def backward(self, k, v, sets):
        """``([dq, ...], dk, dv)`` of ``(grad_out, q, out, lse, offset)`` row sets: each
        block's gradients gathered in an accumulator that follows it around, one step
        behind, and is home after the last step."""
        d = k.shape[-1]
        kv = torch.cat([k, v], dim=-1)
        acc_dtype = ops.lse_dtype(k.dtype)
        dqs: list = [None] * len(sets)
        coming = None  # the previous rank's accumulator of the block this rank now holds
        for step in range(self.ranks):
            last = step == self.ranks - 1
            sent = self._send(kv) if self.overlap and not last else None
            grads = torch.zeros(kv.shape, dtype=acc_dtype, device=kv.device)
            read = False
            for j, (go, q, out, lse, offset) in enumerate(sets):
                for start, end, causal, m in self._blocks(step, offset, q.shape[2]):
                    kb, vb = kv[:, :, start:end, :d], kv[:, :, start:end, d:]
                    dq, dk, dv = torch.ops.autopar.sdpa_backward(
                        go, q, kb, vb, out, lse, m, causal, self.scale
                    )
                    dqs[j] = dq if dqs[j] is None else dqs[j] + dq
                    part = torch.cat([dk, dv], dim=-1).to(acc_dtype)
                    grads = grads + F.pad(part, (0, 0, start, self.keys - end))
                    read = True
            if not read:  # a block this rank's rows do not see: its shift stays (ops.after)
                grads = torch.ops.autopar.after(grads, kv)
            if coming is not None:
                grads = grads + self._received(coming)
            coming = self._send(grads)
            if not self.overlap:
                coming = self._done(coming)
            if not last:
                kv = self._received(sent or self._send(kv))
        home = self._received(coming)
        dqs = [torch.zeros_like(q) if dq is None else dq for dq, (_, q, *_rest) in zip(dqs, sets)]
        dk, dv = home[..., :d].to(k.dtype), home[..., d:].to(v.dtype)
        return dqs, dk, dv


class _Localizer(torch.fx.Interpreter):
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
        self.steps: dict[int, list[dict]] = {}  # bucket -> its collectives, in order
        self.issued_at: dict[str, list[dict]] = {}  # node -> the steps issued after it
        self.waits: dict[str, list[int]] = {}  # node -> buckets waited for after it
        self.overlap = dmesh.device_type != "cpu"
        for c in plan.collectives:
            if "bucket" not in c:
                continue
            self.steps.setdefault(c["bucket"], []).append(c)
            if c.get("step", 0) == 0:
                self.issued_at.setdefault(bucket_site(c)[0], []).append(c)
            elif self.overlap and "step_after" in c:
                self.issued_at.setdefault(c["step_after"], []).append(c)
            if "wait_after" in c:
                self.waits.setdefault(c["wait_after"], []).append(c["bucket"])
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
            if "bucket" not in c:
                axes_of.setdefault(self._orig(edge_ends(c["edge"])), []).append(c["axis"])
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
            if c.get("step", 0) == 0:
                self._issue(c, n, out)
            else:
                self._advance(c["bucket"])
        return out

    def _issue(self, bucket: dict, node, value) -> None:
        """One bucket of gradient reductions (passes/buckets): the members flattened into
        one tensor and its first step issued. A direct bucket lays the members out
        rank-major over each reduce-scatter's axis in turn (each rank's chunk of every
        member, within it each chunk of the next reduce-scatter's axis, ...); a
        hierarchical one flat, padded to a multiple of its inner axis's size. On gloo every
        step runs and is waited for at once (two collectives in flight on one gloo group
        can mix their messages, ``_Ring``); on CUDA the next step is issued after the node
        its entry's ``step_after`` names (``_advance``), and the last waited for after the
        node its entry's ``wait_after`` names (``run_node``) or at the first read."""
        k = bucket["bucket"]
        steps = self.steps[k]
        names = self.plan.mesh.axis_names
        listed = tuple((c["kind"], c["axis"]) for c in steps)
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

    def _collective(self, c: dict, x: torch.Tensor) -> torch.Tensor:
        """One step of a bucket, issued (not waited for)."""
        c10d = torch.ops._c10d_functional
        axis = self.plan.mesh.axis_names.index(c["axis"])
        size, group = self.dmesh.size(axis), self.dmesh.get_group(axis).group_name
        if c["kind"] == "reduce_scatter":
            return c10d.reduce_scatter_tensor(x, c["op"], size, group)
        if c["kind"] == "all_gather":
            return c10d.all_gather_into_tensor(x, size, group)
        return c10d.all_reduce(x, c["op"], group)

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

    A redistribution (``_redistribute``) or DTensor's dispatch on local shards
    (``_run_op``) may leave one: 9, 18 and 25 on the zoo's hf-llama, bert and hf-gpt2 at
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
        if "issue_after" not in c:
            continue
        src, dst = c["edge"].split("->")
        at = c["issue_after"]
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
