"""Attention with its query rows split over one mesh axis (passes/rules, the ``sequence``
entry), on one rank's local tensors, as passes/localize runs such a node.

Takes: this rank's coordinate on the rows' axis, the axis's size and process group, this
rank's first row (its offset in the sequence) and its local q, k, v (``_Ring``: the block of
keys and values this rank holds). Returns: this rank's rows of the output and its
log-sum-exp (``forward``), or the gradients of q, k and v (``backward``), made by
``autopar::sdpa*`` ops and functional collectives that ``make_fx`` records.

Causal rows are load-balanced between partner ranks (passes/rules; ``_Rows``): rank r keeps
the first half of its run of rows and computes the second half of rank n - 1 - r's, the
halves exchanged by functional ``all_to_all_single`` over the rows' axis. The ``ring``
variant (keys split as the rows) runs as ring attention (``_Ring``): n steps, each
``autopar::sdpa`` on the block of keys this rank holds (``core.ops.key_blocks`` for its
causal part) merged online (``core.ops.merge_partial``), the block shifted to the next rank
meanwhile by ``all_to_all_single`` with one nonzero split; its backward passes the blocks
again with a gradient accumulator one step behind. On CUDA each shift's wait comes after the
step's kernels (overlapped, as passes/solve prices it); on gloo it is waited for at once. A
shift whose block this rank's rows do not read is kept in the graph by ``autopar::after``
(else the partitioner drops it on that rank alone, and its peer's send never matches).

NOTE: ``torch.distributed._functional_collectives`` is the traceable collectives API DTensor
itself emits; no public module offers it (tests/unit/test_torch_internals.py).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from autopar.core import ops


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
