"""Choose one strategy per node: an integer linear program over the strategy space.

Takes: a ``StrategySpace`` (passes/strategies). Returns: a ``Solution`` (core/space.py): the
chosen strategy of every node, the predicted collectives, the cost breakdown and the
solver's statistics. Prices come from passes/pricing, the one module that reads the cost
models. The measurements behind each choice below are in docs/solver-notes.md.

``solve`` (driver.py) = ``build_ilp`` (ilp.py, one ``IlpBuilder`` method per family of
terms) -> HiGHS (backend.py, highs.py; branches.py) -> ``read_solution`` (readout.py), in
rounds where memory binds (cuts.py) and where collectives overlap the compute (overlap.py).

The ILP (Alpa's intra-operator formulation)
-------------------------------------------

    variables
        x[v,k] in {0,1}        node v takes its k-th strategy
                                   -> IlpBuilder.node_variables
        e[u,p,v,q] in [0,1]    edge u->v carries placement p at u's output and q at v's
                               input  -> IlpBuilder.edge_variables, _pair_variables
    constraints
        sum_k x[v,k] = 1                                one strategy per node
        sum_q e[u,p,v,q] = Y[u,p] := sum_{k: out_k = p} x[u,k]   -> IlpBuilder.out_group
        sum_p e[u,p,v,q] = Z[v,q] := sum_{k: in_k  = q} x[v,k]   -> IlpBuilder.in_group
        e[u,p,v,q] absent      where DTensor cannot go from p to q (Shard -> Partial)
        Z[a,q] = Z[b,q]        tied nodes (tied parameters; the inputs and outputs of a
                               model without a loss)       -> IlpBuilder.tie_constraints
        bytes(i) <= budget     at the points i the cut loop adds ("Memory")
                                   -> memory_rows.memory_cut
        r[g] in {0,1}          fold group g's layers recompute their activations in the
                               backward ("Checkpointing")  -> memory_rows.remat_var
        sum_{k in A(v)} x[v,k] = 1
                               each pinned node v, A(v) the strategies that agree with the
                               pin (passes/pins)            -> ilp.pin_node
        sum_{(v,k) in F} x[v,k] <= |F| - 1
                               each forbidden choice F (a set of nodes, each with the
                               strategies of one output placement; ``autopar explain``)
                                   -> ilp.forbid_choice
        e[u,p,v,q] = 0         pairs that run a collective on a frozen axis
                                   -> ilp.freeze_axes
    objective (seconds)                                    -> IlpBuilder.objective
        min  sum_{v,k} C[v,k] x[v,k] + sum_{edges} R(p, q) e[u,p,v,q] + sum_g t[g]
             (the overlapped collectives' terms at a share each: "Overlap")

Since x is one-hot, the margins of each edge's e are one-hot, which forces e to the single
pair (p, q) chosen, so e needs no integrality.

C[v,k] is the roofline time of v's op on the local shapes of strategy k (a batch input: its
local bytes over memory bandwidth), plus the collectives the op runs inside itself (a
load-balanced rows-split attention's exchanges, a class-split cross-entropy's reductions, a
row-split mean loss's count)                 -> pricing.node_costs, pricing.inner_collectives
A ring attention computes on every key in turn, its kernels priced on the keys gathered;
with c that time and m_i the shifts in flight during step i of n,

    C = sum_i max(c / n, m_i) + m_tail       where the step overlaps collectives (CUDA)
    C = c + sum_i m_i + m_tail               where each is waited for at once (gloo)
                                                               -> pricing.ring_time

R(p, q) is the alpha-beta time of the collectives that redistribute the tensor from p to q
(DTensor's, or a hierarchical reduction of a Partial summed over several axes where that is
faster)                                                        -> pricing.edge_cost
Graph outputs are edges into fixed or tied placements: the loss into Replicate on every
axis, a gradient into its parameter's placement               -> IlpBuilder.output_terms

``Solution.objective_s`` adds the host's fixed time per step where the profile prices one on
the step's one clock (``step_overhead + param_overhead * parameters``: a calibrated CPU); on
a profile whose host runs ahead on its own clock (``host_clock``: a calibrated GPU) C is the
device's time alone and ``objective_s`` is the larger of the ILP's step and the host's whole
time; neither depends on a choice                  -> readout._read, pricing.host_times

Overlap
-------

Where the device overlaps collectives (CUDA) the emitted step runs some of them beside the
compute, each on its mesh axis's stream:

    - a gradient's reduction in a bucket (passes/buckets: an all-reduce, or a reduce-scatter
      into a sharded parameter, on one axis), issued when the bucket's gradients are made;
      a reduction over several axes (``buckets.chain``) runs its later steps each a bucket
      later                                                     -> ilp._bucket
    - a reshard of the model's state (passes/prefetch: an edge out of a parameter or a node
      made of parameters alone, into a node that reads it once, one collective on one
      axis), issued while the layer before its consumer runs.

With W every term but these (``coef``), W_p the share of part p (forward, backward)
(``forward_coef``), H_pa the overlapped collectives of part p on axis a (``hide_coef``, by
kind), B_pa the part's other collectives on axis a (``axis_coef``: they share the axis's
stream), and the buckets' multi-axis chains counted whole in W but beside the compute in T
(``multi_coef``), the step lasts

    T = W + sum_p max_a max(0, H_pa - (W_p - B_pa))               -> overlap.overlap

The max is not linear; each H_pa enters the objective at a share s_pa instead
(``hide_scale``; overlap.objective_terms). The first solve counts an all-reduce bucket at
1 - ``GRAD_OVERLAP`` and the others whole (``FIRST_SHARE``). Each later round sets

    s_pa = max(0, 1 - (W_p - B_pa) / H_pa)      (half the last share where the plan has
                                                 none of H_pa)

and solves again, ``OVERLAP_ROUNDS`` solves at most, until the shares settle or a round's
step is no shorter; the shortest step is kept, judged as the emitted step simulated where
the caller gives an emitter (``StepJudge``: passes/emit orders, buckets and prefetches each
round's plan as the later stages will, core/schedule runs it), else by T. Where the kept
plan has a part with nothing to hide and no memory cut binds, one last round counts every
share at an all-reduce bucket's, kept where shorter          -> overlap.OverlapRounds
A round whose shares are known is solved on a copy of the model beside the judging of the
round before, the same model and objective, so the same plan    -> backend.SolveBeside
On gloo there is no overlap and the objective is W.

Memory
------

bytes(i), the bytes one rank holds after node i (passes/memory), is linear in the
variables: a storage live at i made by output o of node v adds size(o under k) to x[v,k]; a
parameter adds its optimizer state alike; an input of node i redistributed from p to q adds
its buffers to e[u,p,v,q]; at the return, each output that leaves resharded adds its size to
its sink's pair                                               -> memory_rows.memory_point
Not linear, and bounded from above: how long a reshard into a view holds its buffer (to its
longest life), and the storage it views when a view of it is redistributed into (one
variable per chain of views, h >= size - M * (the chain's redistributing pairs))
                                                              -> memory_rows._held_var
Cutting planes bound only the points that need it:

    solve; measure bytes(i) at every i (passes/memory.measure); where the peak exceeds the
    budget, add bytes(i) <= budget at the peak, at the highest point of the other half of
    the step, and at the highest point of each of ``CUT_SPANS`` equal spans above the
    budget; solve again; stop when the plan fits, ``MAX_ROUNDS`` rounds at most
                                                     -> cuts._bounded, cuts._new_cuts

Each cut is the memory model itself, so a plan that passes the last check fits, and every
plan that fits satisfies every cut but where the view bounds above overstate it. An overlap
round solved beside is not measured where a bound of its peak from the last measured plan
(plus the changes of the nodes whose strategy changed) fits       -> memory_rows.peak_bound
An impossible budget is reported with the smallest that fits: min M subject to
bytes(i) <= M at the points the same loop adds                    -> cuts.smallest_budget
No plan's peak goes below the model state split evenly over every rank (a pinned parameter
at what its pin holds on a rank):

    floor = sum_params ceil(numel / ranks) * (bytes per element + optimizer state bytes)
                                                                  -> floor.state_floor

and a budget under it is refused before any ILP is built, naming the ranks it needs.

Checkpointing
-------------

Each fold group g whose layers can recompute something (passes/remat) gets r[g], made when
a cut first needs it. From the first plan over budget on, the step measured is the one in
which any group may be checkpointed (``cuts._Lives``): the copies' points, and storages live
only when r[g] = 1 or only when r[g] = 0. At a cut, with S the bytes of one such part (linear
in x and e) and M its largest value:

    live when r[g] = 0:  S - a,  0 <= a <= S,  a <= M r[g]
    live when r[g] = 1:  a,      a >= S - M (1 - r[g]),  a >= 0

exact for r in {0, 1}. The time: t[g] >= F_g(x, e) - M_F (1 - r[g]), t[g] >= 0 in the
objective, F_g the compute C of every copy and the redistributions R of their inputs,
summed over the group's layers                                -> memory_rows.remat_var
The ILP with r is solved in branches on r, not whole (its big-M relaxation is weak): each
branch fixes every r, and its relaxation bounds it. With one group the relaxations at r = 0
and r = 1 order the two branches and the second is solved only where its bound is below
the first's plan; with several, r = 0 everywhere first, then the one group whose bound is
below that plan (two or more left: the ILP whole). Each branch is exact for its r, so the
optimum is the whole ILP's                                  -> branches.by_checkpointing

Mixed precision
---------------

A parameter's gradient reaches it through a cast from the compute dtype
(``StrategySpace.reduce_at``). "after": the edge into the cast keeps a Partial (the pairs
that reduce one are left out), and so do the edges into the transposes and views between
the op that makes the gradient and the cast; "before": the pairs that deliver a Partial
into the cast are left out                  -> ilp._reduces_as, ilp._gradient_chains

Folding
-------

The instances of a folded region take their representative's strategy (passes/fold); with
r(v) the representative of v:

    x[v,k] = x[r(v),k]
    C[r,k] counted n_r = |{v : r(v) = r}| times
    the m graph edges onto one edge r(u)->r(v) share its e and count m times
    bytes(i) sums every instance's live storages on x[r(v),k]
    ties between representatives                                  -> ilp._Folding

so the objective is that of the whole graph for plans in which every instance does as its
representative. Unfolded, r is the identity.

Simplifications
---------------

Each loses optimality only in the case it names:

    1. Following nodes (Alpa's merge): a node that only follows its single tensor input
       and whose output has one consumer is not resharded right before it where it takes
       its producer's placement; where it takes every placement its producer gives, it is
       merged into the producer: x[v,k] = Y[u, ins_k], C[v,k] added to the producer's
       variables (``merge=False`` solves without)  -> IlpBuilder.merge_source, _following
    2. One axis per edge: an edge between operators changes at most ``reshard_axes`` mesh
       axes (graph outputs keep every pair)               -> IlpBuilder._pair_variables

An ILP that constraints make infeasible is solved again without merging and with every pair
on the edges out of a parameter, then with every pair everywhere, so no constraint is
refused because of them                           -> driver.SIMPLIFICATIONS, driver.solve

Solving
-------

HiGHS through OR-Tools, one thread (deterministic), to within ``mip_gap`` (``MIP_GAP``) of
the optimum. Each solve first solves the linear relaxation: where every integer variable is
integral it is the ILP's optimum and the ILP is not solved (HiGHS's presolve only where the
ILP has memory cuts)                      -> highs.relaxed, backend.run, backend.relax_presolve
Ties are broken towards the earlier strategy: x[v,k] costs ``TIE_BREAK_US * k / K_v * n_v``
microseconds more, alike folded and unfolded                     -> IlpBuilder._node
A time limit with a plan in hand is status "time_limit" with the incumbent, the bound and
the gap; without one, a ``SolveError`` that says what to raise   -> readout.read_solution
"""

from __future__ import annotations

from .cuts import MAX_ROUNDS, smallest_budget, within
from .driver import SIMPLIFICATIONS, solve
from .errors import SolveError
from .floor import state_floor
from .ilp import IlpBuilder, build_ilp, forbid_choice, freeze_axes, pin_node
from .readout import read_solution
from .rounds import OverlapRounds, StepJudge
from .settings import FIRST_SHARE, HIDES, MIP_GAP, MULTI, hidden_kinds

__all__ = [
    "FIRST_SHARE",
    "HIDES",
    "MAX_ROUNDS",
    "MIP_GAP",
    "MULTI",
    "SIMPLIFICATIONS",
    "IlpBuilder",
    "SolveError",
    "StepJudge",
    "OverlapRounds",
    "build_ilp",
    "forbid_choice",
    "freeze_axes",
    "hidden_kinds",
    "pin_node",
    "read_solution",
    "smallest_budget",
    "solve",
    "state_floor",
    "within",
]
