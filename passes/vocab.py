"""Cross-entropy split across ranks: along its classes (vocabulary-parallel), and a mean
loss along its rows.

Takes nothing at import. ``class_split`` and ``row_split`` give passes/strategies the
strategies that split the four ops a cross-entropy traces into, and ``exact`` drops those
of DTensor's that are not the op; ``reductions`` and ``count_reductions`` give passes/solve
the collectives such a strategy runs inside its op; ``run_local`` gives passes/codegen the
op on this rank's classes and rows. DTensor has no rule that splits a softmax along the dim
it normalises (each rank would normalise its own classes alone), so without this the logits
of a column-parallel output head are all-gathered before the loss: [N, V] values, where the
split loss reduces [N] of them.

Classes. With the classes of ``x`` [N, C] split over one mesh axis of n ranks, rank c
holding the run of classes [o_c, o_c + C/n) (``local_offset``), and every other placement
as DTensor's rule for the op (or ``row_split``) gives it:

    _log_softmax(x, dim)                              x, out: Shard(dim)
        m = max over the axis of (max over my classes of x)        (all-reduce max, [N])
        s = sum over the axis of (sum over my classes of exp(x - m))   (all-reduce sum, [N])
        out = x - m - log s
    _log_softmax_backward_data(g, out, dim)           g, out, grad_x: Shard(dim)
        grad_x = g - exp(out) * (sum over the axis of (sum over my classes of g))
                                                                    (all-reduce sum, [N])
    nll_loss_forward(lp, t, None, reduction, ignore)  lp: Shard(class); t, total: Replicate;
                                                      loss: Partial(sum)
        each rank picks -lp[i, t_i] where t_i is one of its classes, else 0: the sum over
        the axis is the whole loss (``mean`` divides by the count of targets other than
        ``ignore``, the same on every rank of the axis: still a sum)
    nll_loss_backward(g, lp, t, None, ...)            g, t, total: Replicate;
                                                      lp, grad_lp: Shard(class)
        grad_lp[i, t_i - o_c] = -g_i (/ total for ``mean``) where t_i is one of my classes;
        no collective (a class weight: below)

Rows. A ``mean`` loss over rows split across the ranks of some axes (the batch split: lp
and t ``Shard(0)`` there) is not the mean of the ranks' means where they ignore different
counts of targets (a padded batch): with s_r the sum of rank r's picked -lp[i, t_i] and k_r
its count of targets other than ``ignore``, the loss is (sum_r s_r) / (sum_r k_r), where
the ranks' means average to (1/n) sum_r s_r / k_r. So (``row_split``):

    nll_loss_forward(lp, t, None, mean, ignore)       lp, t: Shard(0) on the row axes;
                                                      loss: Partial(sum) there; total:
                                                      Replicate
        K = sum over the row axes of k_r              (all-reduce sum of one count per
                                                      row axis, ``count_reductions``)
        loss_r = s_r / K: the sum over the axes is the whole loss, and total = K is the
        whole op's
    nll_loss_backward(g, lp, t, None, mean, ignore, K)    g, K: Replicate; lp, t, grad_lp:
                                                      Shard(0) on the row axes
        grad_lp[i, t_i] = -g / K on each rank's rows: the op on the local rows, exact; no
        collective

DTensor's rule for the forward (torch 2.13) offers the batch split with the loss
``Partial(avg)``, the ranks' means averaged, which is the loss only where every rank
ignores as many targets; ``exact`` drops it (torch 2.14 offers none for ``mean``, which
without ``row_split`` replicates the loss and gathers the logits of a data-parallel step).
``sum`` and ``none`` keep DTensor's rules, which are exact. With the rows and the classes
both split (on different axes) the loss is ``Partial(sum)`` on each and the count is
reduced over the row axes alone.

The reductions of the softmax run in float32 at least (``acc_dtype``: float64 stays
float64), over rows of [N] values: 8 bytes a row forward and 4 backward, where the gather
of float32 logits moves 4 C bytes a row; the count is one int64. Each is waited for at once
(the op needs its result), so passes/solve adds them to the op's time
(passes/pricing ``inner_collectives``) and core/schedule draws them inside it.

A class weight w (``weight`` not None, [C]) is whole on every rank (``Replicate``): each
rank weights the targets it picks by their class's weight, w[t_i] (indexed by the global
class, whichever rank holds it), and a ``mean`` divides by the targets' summed weights,
sum_i w[t_i] over the targets other than ``ignore``, in place of their count: the whole
op's ``total``. Along the classes that sum is each rank's alone (the targets are whole
there); along split rows it is k_r, all-reduced as the count is, in float64 (8 bytes, as
the count's int64). The backward scales each row's -g by w[t_i]. (Weighted, the ranks'
means differ even where every rank ignores as many targets: DTensor's batch split of a
weighted ``mean`` is inexact with or without ignored targets.) The classes are
split over one mesh axis at most, and only where the axis's size divides them
(``core.placements.divides``): a vocabulary of 50257 is not split; the rows over any set
of axes whose sizes divide them.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.core import Collective, Strategy, divides

__all__ = [
    "CLASS_OPS",
    "acc_dtype",
    "class_split",
    "count_reductions",
    "exact",
    "reductions",
    "row_axes",
    "row_split",
    "run_local",
    "split_axis",
]

_aten = torch.ops.aten
_LOG_SOFTMAX = _aten._log_softmax.default
_LOG_SOFTMAX_BACKWARD = _aten._log_softmax_backward_data.default
_NLL = _aten.nll_loss_forward.default
_NLL_BACKWARD = _aten.nll_loss_backward.default
_MEAN, _SUM = 1, 2  # torch's Reduction enum (0 is none)

# op -> (the tensor inputs split along the classes, by position among the tensor inputs;
#        the placement of each output on the split axis, Shard meaning along the classes)
CLASS_OPS: dict[object, tuple[tuple[int, ...], tuple[str, ...]]] = {
    _LOG_SOFTMAX: ((0,), ("shard",)),
    _LOG_SOFTMAX_BACKWARD: ((0, 1), ("shard",)),
    _NLL: ((0,), ("partial", "replicate")),
    _NLL_BACKWARD: ((1,), ("shard",)),
}
"""The ops of a cross-entropy that split along the classes (module docstring)."""


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the split softmax reduces in: float32, or ``dtype`` where it is wider."""
    return torch.promote_types(dtype, torch.float32)


def class_dim(target, args, ndim: int) -> int | None:
    """The class dim of a call to one of ``CLASS_OPS`` whose class-split input has ``ndim``
    dims (``args`` its arguments)."""
    if target == _LOG_SOFTMAX:
        return args[1] % ndim
    if target == _LOG_SOFTMAX_BACKWARD:
        return args[2] % ndim
    if target in (_NLL, _NLL_BACKWARD):
        return 1 if ndim == 2 else 0
    return None


def class_split(target, args, in_shapes, strategies, mesh_shape) -> list[Strategy]:
    """The strategies of one call that split its classes over one mesh axis: each of
    ``strategies`` (DTensor's) that replicates everything on an axis, with the classes split
    there (module docstring). ``in_shapes`` the global shapes of the tensor inputs."""
    entry = CLASS_OPS.get(target)
    if entry is None:
        return []
    split, outs = entry
    cdim = class_dim(target, args, len(in_shapes[split[0]]))
    if cdim is None:
        return []
    weight = _WEIGHT_AT.get(target) if _weight(target, args) is not None else None
    out: list[Strategy] = []
    for s in strategies:
        if weight is not None and any(p != Replicate() for p in s.ins[weight]):
            continue  # (a class weight is whole on every rank: indexed by the global class)
        for a in range(len(mesh_shape)):
            if mesh_shape[a] == 1 or any(
                ps is not None and ps[a] != Replicate() for ps in s.ins + s.out
            ):
                continue

            def at(ps, p, a=a):
                return ps[:a] + (p,) + ps[a + 1 :]

            ins = tuple(at(ps, Shard(cdim)) if j in split else ps for j, ps in enumerate(s.ins))
            if not all(divides(ins[j], tuple(in_shapes[j]), mesh_shape) for j in split):
                continue
            new_out = tuple(
                None if ps is None else at(ps, _placement(kind, cdim))
                for ps, kind in zip(s.out, outs)
            )
            out.append(Strategy(out=new_out, ins=ins))
    return list(dict.fromkeys(out))


def _placement(kind: str, cdim: int):
    """An output's placement on the classes' axis."""
    if kind == "shard":
        return Shard(cdim)
    if kind == "replicate":
        return Replicate()
    return Partial("sum")


def _mean_rows(target, args) -> int | None:
    """The position, among the tensor inputs, of the log-probabilities of a ``mean`` NLL
    (forward or backward); None for any other call."""
    if target == _NLL:
        reduction, pos = args[3], 0
    elif target == _NLL_BACKWARD:
        reduction, pos = args[4], 1
    else:
        return None
    return pos if reduction == _MEAN else None


def exact(target, args, strategies: list[Strategy]) -> list[Strategy]:
    """``strategies`` less those of a ``mean`` NLL that average the ranks' means
    (``Partial(avg)``: DTensor's batch split, module docstring "Rows"), with a class weight
    too (its mean divides by the targets' summed weights, which differ as the counts do)."""
    if target != _NLL or args[3] != _MEAN:
        return strategies
    return [s for s in strategies if Partial("avg") not in (s.out[0] or ())]


def row_split(target, args, in_shapes, mesh_shape) -> list[Strategy]:
    """The strategies of a ``mean`` NLL, forward or backward, with its rows split over each
    set of mesh axes whose sizes divide them (module docstring, "Rows"), a class weight
    replicated; ``in_shapes`` the global shapes of the tensor inputs."""
    pos = _mean_rows(target, args)
    if pos is None or len(in_shapes[pos]) != 2:
        return []
    rep = (Replicate(),) * len(mesh_shape)
    weight = (rep,) if _weight(target, args) is not None else ()
    axes = [a for a, size in enumerate(mesh_shape) if size > 1]
    out: list[Strategy] = []
    for k in range(1, len(axes) + 1):
        for chosen in itertools.combinations(axes, k):

            def on_rows(p, chosen=chosen):
                return tuple(p if a in chosen else Replicate() for a in range(len(rep)))

            rows = on_rows(Shard(0))
            if not divides(rows, tuple(in_shapes[pos]), mesh_shape):
                continue
            if target == _NLL:
                ins = (rows, rows, *weight)
                out.append(Strategy(out=(on_rows(Partial("sum")), rep), ins=ins))
            else:
                out.append(Strategy(out=(rows,), ins=(rep, rows, rows, *weight, rep)))
    return out


_WEIGHT_AT = {_NLL: 2, _NLL_BACKWARD: 3}
"""A NLL's class weight's position among its arguments, and among its tensor inputs where
it has one (every argument before it is a tensor)."""


def _weight(target, args):
    """A NLL call's class weight (its argument), None where it has none or is no NLL."""
    at = _WEIGHT_AT.get(target)
    return None if at is None else args[at]


def row_axes(target, args, ins, in_shapes) -> tuple[int, ...]:
    """The mesh axes over which a ``mean`` NLL's forward, its tensor inputs of global shapes
    ``in_shapes`` placed ``ins``, splits its rows: its count is reduced over them (module
    docstring, "Rows")."""
    if target != _NLL or _mean_rows(target, args) is None or len(in_shapes[0]) != 2:
        return ()
    return tuple(a for a, p in enumerate(ins[0]) if p == Shard(0))


def count_reductions(target, args, ins, in_shapes, mesh_shape) -> list[Collective]:
    """The all-reduces of the count of a row-split ``mean`` NLL: one int64 per row axis (a
    float64, the targets' summed class weights, where it has a class weight)."""
    axes = row_axes(target, args, ins, in_shapes)
    return [Collective("all_reduce", a, 8, mesh_shape[a]) for a in axes]


def split_axis(target, args, ins, in_shapes) -> tuple[int, int, int] | None:
    """``(axis, class dim, input position)`` where a call of one of ``CLASS_OPS`` (its
    arguments ``args``, its tensor inputs of global shapes ``in_shapes`` placed ``ins``)
    splits its classes, else None."""
    entry = CLASS_OPS.get(target)
    if entry is None:
        return None
    pos = entry[0][0]
    cdim = class_dim(target, args, len(in_shapes[pos]))
    if cdim is None:
        return None
    axes = [a for a, p in enumerate(ins[pos]) if p == Shard(cdim)]
    return (axes[0], cdim, pos) if axes else None


def reductions(
    target, local_shape: tuple[int, ...], cdim: int, dtype: torch.dtype, axis: int, ranks: int
) -> list[Collective]:
    """The all-reduces a class-split call runs inside its op (module docstring), given the
    local shape of its class-split input: two of the rows forward, one backward."""
    rows = 1
    for d, size in enumerate(local_shape):
        if d != cdim:
            rows *= size
    nbytes = rows * acc_dtype(dtype).itemsize
    count = {_LOG_SOFTMAX: 2, _LOG_SOFTMAX_BACKWARD: 1}.get(target, 0)
    return [Collective("all_reduce", axis, nbytes, ranks) for _ in range(count)]


def _all_reduce(t: torch.Tensor, op: str, group: str) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(t, op, group))


def _mine(target: torch.Tensor, ignore_index: int, offset: int, classes: int):
    """Which targets are this rank's classes, and each one's index among them (0 where not)."""
    local = target - offset
    mine = (target != ignore_index) & (local >= 0) & (local < classes)
    return mine, torch.where(mine, local, 0)


def _target_weights(weight, target: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """Each target's class weight (``weight`` indexed by the target's class, whichever rank
    holds it: the weight is whole on every rank), 0 where the target is ignored; None
    without a weight."""
    if weight is None:
        return None
    kept = target != ignore_index
    w = weight[torch.where(kept, target, 0)]
    return torch.where(kept, w, torch.zeros_like(w))


def run_local(target, args, offset: int = 0, group: str = "", count_groups: tuple = ()):
    """One split call on this rank's classes and rows (module docstring): ``offset`` its
    first class and ``group`` the classes' axis's process group name (0 and unused where
    the classes are whole), ``count_groups`` the process group names of the axes a ``mean``
    NLL's rows are split over (``row_axes``); its local outputs."""
    if target == _LOG_SOFTMAX:
        x, dim, half_to_float = args
        acc = acc_dtype(x.dtype)
        xf = x.to(acc)
        m = _all_reduce(xf.amax(dim, keepdim=True), "max", group)
        shifted = xf - m
        s = _all_reduce(shifted.exp().sum(dim, keepdim=True), "sum", group)
        out = shifted - s.log()
        return out if half_to_float else out.to(x.dtype)
    if target == _LOG_SOFTMAX_BACKWARD:
        g, out, dim, input_dtype = args
        acc = acc_dtype(g.dtype)
        gf = g.to(acc)
        total = _all_reduce(gf.sum(dim, keepdim=True), "sum", group)
        return (gf - out.to(acc).exp() * total).to(input_dtype)
    if target == _NLL:
        lp, t, weight, reduction, ignore_index = args
        cdim = 1 if lp.dim() == 2 else 0
        mine, idx = _mine(t, ignore_index, offset, lp.shape[cdim])
        picked = lp.gather(cdim, idx.unsqueeze(cdim)).squeeze(cdim)
        w = _target_weights(weight, t, ignore_index)
        if w is not None:
            picked = picked * w.to(picked.dtype)
        result = torch.where(mine, -picked, torch.zeros_like(picked))
        if reduction == 0 and lp.dim() > 1:
            return result, lp.new_zeros(())
        # the targets' count, or their summed class weights (in float64: 8 bytes, as the
        # count's), over the axes that split the rows
        count = (t != ignore_index).sum() if w is None else w.to(torch.float64).sum()
        for name in count_groups:
            count = _all_reduce(count, "sum", name)
        acc = acc_dtype(lp.dtype)
        if reduction == _SUM:
            result = result.to(acc).sum().to(lp.dtype)
        elif reduction == _MEAN:
            result = (result.to(acc).sum() / count.to(acc)).to(lp.dtype)
        return result, count.to(lp)
    if target == _NLL_BACKWARD:
        g, lp, t, weight, reduction, ignore_index, total = args
        cdim = 1 if lp.dim() == 2 else 0
        mine, idx = _mine(t, ignore_index, offset, lp.shape[cdim])
        if reduction == _MEAN:
            g = g / total
        w = _target_weights(weight, t, ignore_index)
        if w is not None:
            g = g * w.to(g.dtype)
        value = torch.where(mine, -g, torch.zeros_like(g)).to(lp.dtype)
        value = value.expand(idx.shape)
        return torch.zeros_like(lp).scatter(cdim, idx.unsqueeze(cdim), value.unsqueeze(cdim))
    raise ValueError(f"{target} does not split its classes")
