"""``PlannedCollective``: one collective a plan runs per step, as ``Plan.collectives`` holds it.

Three stages make these records, each a kind of entry:

    a reshard or a gradient     ``Plan.from_solution``: ``edge``, ``module`` (a reshard:
    reduction (one edge)        the module path of the node it feeds) or ``param`` (a
                                gradient's reduction: its parameter's name), ``kind``,
                                ``axis``, ``nbytes``, ``group_size``, ``time_s``
    a gradient bucket           passes/buckets: ``param`` (a text naming the first member),
                                ``params``, the six above, ``bucket``, ``dtype``, ``op``,
                                ``overlap``; a bucket of several steps ``step`` and
                                ``steps``, and on CUDA ``step_after``; a one-step
                                reduce-scatter bucket on CUDA ``wait_after``
    a reshard issued early      passes/prefetch: a reshard's with ``issue_after``

A field a kind does not have is None. ``to_dict`` writes the fields that are not None, in
the order of the fields: that is each producer's key order, so a plan's JSON is the same
text as when these were dicts.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PlannedCollective"]


@dataclass(frozen=True, slots=True)
class PlannedCollective:
    """One collective the plan runs per step, predicted.

    Attributes:
        edge: the graph edge it runs on: ``producer->consumer`` node names (``a->b``; into a
            recomputed copy ``a->b (recomputed)``; an op's own exchanges ``n->n``; a
            gradient's reduction ``a->output[3] (as primals_3)``; a bucket
            ``<node>->output[<positions>] (bucket k: n gradients)``).
        kind: ``all_gather``, ``reduce_scatter``, ``all_reduce`` or ``all_to_all``.
        axis: the mesh axis's name.
        nbytes: the bytes it moves as cost_models/comm prices it (the gathered tensor of an
            all-gather, the input of a reduce-scatter, the tensor of an all-reduce, one
            rank's buffer of an all-to-all).
        group_size: the ranks on ``axis``.
        time_s: its predicted seconds.
        module: a reshard's: the module path of the node it feeds (``(step output)`` for
            an edge into the step's outputs that reduces no gradient).
        param: a gradient reduction's: the parameter's name; a bucket's: ``n gradients
            (<first>, ...)``.
        params: a bucket's: its members' parameter names, in the order made.
        bucket: a bucket's index (passes/buckets), in the order the buckets are issued.
        dtype: a bucket's dtype (``float32``).
        op: a bucket's reduce op (``sum``, ``avg``).
        overlap: a bucket's: whether the device overlaps collectives (CUDA), so that it is
            waited for later than it is issued.
        step, steps: a bucket of several collectives (``steps``): this one's index.
        step_after: a bucket's step ``step >= 1`` on CUDA: the node after which it is
            issued (the step before waited for there).
        wait_after: a one-step reduce-scatter bucket on CUDA: the node after which it is
            waited for (where the next such bucket on its axis is issued).
        issue_after: a reshard issued ahead of its consumer (passes/prefetch): the node
            after which it is issued.
    """

    edge: str
    kind: str
    axis: str
    nbytes: int
    group_size: int
    time_s: float
    module: str | None = None
    param: str | None = None
    params: tuple[str, ...] | None = None
    bucket: int | None = None
    dtype: str | None = None
    op: str | None = None
    overlap: bool | None = None
    step: int | None = None
    steps: int | None = None
    step_after: str | None = None
    wait_after: str | None = None
    issue_after: str | None = None

    def to_dict(self) -> dict:
        """The entry as ``Plan.to_json`` writes it: the fields that are not None, ``edge``,
        ``module``, ``param`` and ``params`` first, then the collective, then the
        bucket's and the prefetch's (module docstring)."""
        d: dict = {"edge": self.edge}
        # (each tested, not looped over the fields: thousands per plan)
        if self.module is not None:
            d["module"] = self.module
        if self.param is not None:
            d["param"] = self.param
        if self.params is not None:
            d["params"] = list(self.params)
        d["kind"] = self.kind
        d["axis"] = self.axis
        d["nbytes"] = self.nbytes
        d["group_size"] = self.group_size
        d["time_s"] = self.time_s
        if self.bucket is not None:
            d["bucket"] = self.bucket
        if self.dtype is not None:
            d["dtype"] = self.dtype
        if self.op is not None:
            d["op"] = self.op
        if self.overlap is not None:
            d["overlap"] = self.overlap
        if self.step is not None:
            d["step"] = self.step
        if self.steps is not None:
            d["steps"] = self.steps
        if self.step_after is not None:
            d["step_after"] = self.step_after
        if self.wait_after is not None:
            d["wait_after"] = self.wait_after
        if self.issue_after is not None:
            d["issue_after"] = self.issue_after
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PlannedCollective:
        """The record of an entry ``to_dict`` wrote (``params`` as a tuple)."""
        params = d.get("params")
        return cls(**{**d, "params": None if params is None else tuple(params)})
