"""Choose one strategy per node: an integer linear program over the strategy space.

Takes: a ``StrategySpace`` (passes/strategies) and the device profile of its mesh.
Returns: a ``Solution`` (core/space.py): the chosen strategy of every node, the predicted
collectives, the cost breakdown and the solver's statistics. Only this pass imports the
cost models.

``solve`` = ``build_ilp`` (the terms below, one ``IlpBuilder`` method each) -> HiGHS
(``_run``) -> ``read_solution``.

The ILP (Alpa's intra-operator formulation):

    variables
        x[v,k] in {0,1}        node v takes its k-th strategy          (``node_variables``)
        e[u,p,v,q] in [0,1]    edge u->v carries placement p at u's output
                               and placement q at v's input            (``edge_variables``,
                                                                        ``_pair_variables``)
    constraints
        sum_k x[v,k] = 1                                 one strategy per node
        sum_q e[u,p,v,q] = Y[u,p] := sum_{k: out_k = p} x[u,k]         (``out_group``)
        sum_p e[u,p,v,q] = Z[v,q] := sum_{k: in_k  = q} x[v,k]         (``in_group``)
        e[u,p,v,q] absent       when DTensor cannot go from p to q (e.g. Shard -> Partial)
        Z[a,q] = Z[b,q]         for tied nodes (tied parameters; the inputs and outputs of
                               a model without a loss)                  (``tie_constraints``)
        bytes(i) <= budget      at the points i of the step that the loop below adds
                               (``memory_cut``; "Memory")
        r[g] in {0,1}           fold group g's layers recompute their activations in the
                               backward ("Checkpointing")
        sum_{k in A(v)} x[v,k] = 1
                               for each pinned node v (passes/pins: A(v) the strategies
                               whose placements agree with the pin; ``pin_node``)
        sum_{(v,k) in F} x[v,k] <= |F| - 1
                               for each forbidden choice F (``forbid``: a set of nodes each
                               with the strategies of one output placement; not all of them
                               may keep it: ``autopar explain``)
    objective (seconds)                                                 (``objective``)
        min  sum_{v,k} C[v,k] x[v,k]  +  sum_{edges} R(p, q) e[u,p,v,q]  +  sum_g t[g]
             (where buckets and prefetches overlap the compute: each H_pa at a
             share, "Overlap")

``Solution.objective_s`` adds the host's fixed time per step where the profile prices one
on the step's one clock (``DeviceProfile.step_overhead`` + ``param_overhead`` per
parameter: a calibrated CPU; ``Solution.runtime_s``), a constant no choice changes. Where
the host runs ahead of the device on its own clock (``DeviceProfile.host_clock``: a
calibrated GPU), C[v,k] is the device's time alone, each node's host time is
``Solution.host_s`` (cost_models.compute.host_time, the same under every strategy), and
the runtime's time goes on the host's clock at the step's start and end (core/schedule
runs the two clocks); ``objective_s`` is then the larger of the step the ILP minimized
and the host's whole time, a bound no choice changes either.

``C[v,k]`` is the roofline time of node v's op on the local shapes of strategy k (for a
batch input: the time to read its local part, bytes / memory bandwidth)
(``cost_models.compute.compute_time``, in ``_node_costs``), plus the collectives the op runs
inside itself (a load-balanced, rows-split attention's exchanges: passes/rules,
``balance_exchanges``; a class-split cross-entropy's all-reduces of its rows:
passes/vocab, ``reductions``; a row-split mean loss's all-reduce of its count,
``count_reductions``; ``_inner_collectives``). A ring attention (passes/rules,
``ring``) computes on every key in turn, so its kernels are priced on the keys gathered
(``rules.keys_gathered``), and its shifts overlap them: with c that time and m_i the
shifts in flight during step i of n (``rules.ring_steps``),

    C = sum_i max(c / n, m_i) + m_tail        (``_ring_time``)

where the step can overlap them (``DeviceProfile.overlaps_collectives``: CUDA), and
C = c + sum_i m_i + m_tail where each is waited for at once (gloo on CPU, as codegen emits it).

``R(p, q)`` the alpha-beta time
of the collectives that redistribute the tensor from p to q
(``cost_models.comm.reshard_time``, in ``_edge_cost``: DTensor's collectives, or a
hierarchical reduction of a Partial summed over several axes where it is faster). Graph
outputs are edges into fixed or tied placements (``Sink``, ``output_terms``): the loss
into Replicate on every axis, a gradient into its parameter's placement. Since x is
one-hot, the margins of each edge's e are one-hot, which forces e to the single pair (p, q)
chosen, so e needs no integrality.

Overlap. Where the device overlaps collectives (CUDA), the emitted step runs some of them
beside the compute, each on its mesh axis's stream, one after another:
    - a gradient's reduction in a bucket (passes/buckets: one all-reduce, or one
      reduce-scatter into a sharded parameter, on one axis; ``_bucket``), issued as soon as
      the bucket's gradients are made, beside the rest of the backward; a bucket of
      reductions over several axes (``chain``: each axis's collective in turn, or a
      hierarchical reduction) runs its later steps each a bucket later, passes/buckets:
      the ILP counts those whole, in W (below), and the step's length T (``overlap``) has
      each of their steps beside the compute on its axis, as the hiding terms
      (``multi_coef``; W_p and B_pa without their pairs);
    - a reshard of the model's state (passes/prefetch: an edge out of a parameter or a node
      made of parameters alone, passes/order ``ready_nodes``, into a node that reads it
      once, running one collective on one axis), issued while the layer before its
      consumer runs (FSDP's all-gathers, ahead of their layer).
``hides`` says which of these the emitted step has (a skipped stage has none). With W every
term above but these (``coef``), W_p the share of part p (forward, backward) of it (its
nodes and the edges into them; ``forward_coef``), H_pa those of part p on axis a
(``hide_coef``, by kind) and B_pa the part's other collectives on axis a (``axis_coef``:
the edges whose pair changes axis a from a Shard or a Partial; they are in W, waited for
where they are read, and the axis's stream runs them between the others), the step lasts

    T = W + sum_p max_a max(0, H_pa - (W_p - B_pa))                   (``overlap``)

what hides behind the compute of its part up to that compute's length, and counts in full
beyond it. The max is not what the ILP minimizes (as a variable h >= each term, for the
buckets alone, it solved ~13x slower on Llama-3-8B's bf16 step over (8,8), 66 s); instead
each H_pa enters the objective at a share s_pa (``hide_scale``). The first solve counts an
all-reduce bucket at a quarter (1 - ``GRAD_OVERLAP``) and the others whole
(``FIRST_SHARE``): the plan of the search as it was before it counted them. Then, solved,
each share becomes the share the plan leaves unhidden, max(0, 1 - (W_p - B_pa) / H_pa),
and where the plan has none of H_pa, half the share counted (taken as 0, an axis whose
weights are replicated has no gathers, so the next plan gathers every weight: Llama-3-8B on
(16, 8) in bf16 went 194.1, 271.4, 166.3, 153.8 ms as emitted, where halving went to
sharded weights in one round, 150.5 ms). The ILP is solved again, ``OVERLAP_ROUNDS``
solves at most, until the shares settle or a round gives no shorter step (the rounds then
swing: GPT-3 over (8,8), 2601.6, 2908.9, then 9086.4 ms as emitted, where the third
round's shares, low from the second's well-hidden plan, let the ILP pile its collectives
on them). The rounds keep the plan whose step is the shortest: as the emitted step
simulated where the caller gives ``assess`` (passes/pipeline: the plan ordered, bucketed
and prefetched as the later stages will, a later round's in the traced order where the
first's keeps it, core/schedule), else by T. T is a bound on each stream's busy time, not
a schedule: a gather queued behind a scatter on its axis waits, and
the first plan counted whole showed it (GPT-3 over (8,8), reduce-scatters counted hidden:
T 2628 ms, emitted 2895 ms). Comparing the rounds by the emitted step keeps such a plan
out, and the first round, counted as before, bounds what the rounds can lose. Where the
plan kept has a part with nothing to hide (a forward with no gathers ahead: data
parallelism) and the memory budget does not bind, the rounds judged that part from a plan
without it; one last round counts every part at an all-reduce bucket's share, alike, and
is kept where its step is shorter (Llama-3.2-1B over (8,) in bf16: the rounds kept data
parallelism, 96.4 ms, never pricing the sharded weights' gathers below half; the last
round shards and gathers them, each cast to bf16 on its shard, 95.3 ms). A round's plan
is read once per solution (``IlpBuilder._once``: its choice and overlap, which the memory
check, the simulation and the plan each read); without a memory budget no round's step
memory is measured, only the kept plan's. ``Solution.objective_s`` is T. On gloo there is
no overlap (codegen waits for each collective where it is issued) and the objective is W.

The buckets' chains over several axes stay whole in the ILP, and T alone credits them.
Credited in the ILP's rounds (as hiding terms from the first solve, or in up to three
more rounds kept where their step is shorter, from several starting shares), they moved
the pinned expert plans (``autopar.evaluate``) as much as autopar's: each of six variants
lost one of two cases. On Llama-3.2-1B over (2, 4) in bf16 autopar's plan went from
100.7 ms to 96.0-99.7 ms, but its pinned Megatron plan went from 103.0 to 96.3 ms (its
weights sharded over tp and gathered ahead, data parallel over both axes), ahead of
autopar's in two of the three variants both were run in; on
tests/unit/test_megatron_plan's Llama, autopar took data parallelism over both axes,
8.573 ms as emitted, where the pinned Megatron plan reached 8.337 ms. The emitted step
waits for a chain's steps a bucket later, and its last bucket after the backward, which
no share of a linear term prices. With T crediting them, a plan of data parallelism over
both axes of a (2, 4) H100 mesh is within 10% of its emitted step (it was 1.7-2.1x).

Memory. bytes(i), the bytes one rank holds after node i (passes/memory), is linear in the
variables: a storage live at i made by output o of node v adds size(o under k) to x[v,k];
a parameter adds its optimizer state the same way; an input of node i redistributed from p
to q adds its buffers to e[u,p,v,q] (``memory_point``). Not linear: how long a reshard into
a view holds its buffer, and the storage it views lives, when a view of it is redistributed
into too (passes/memory, "Reshards into a view"); the rows bound those from above (the
buffer to its longest life; the storage through one auxiliary variable per chain of views).
Bounding every point would add one constraint per node with a term per live tensor and
strategy; instead (cutting planes):

    solve; measure the plan's bytes(i) at every i (passes/memory.measure, the model the
    memory stage reports); where the peak exceeds the budget, add bytes(i) <= budget at
    the peak, at the highest point of the other half of the step (forward, backward),
    and at the highest point of each of ``CUT_SPANS`` equal spans of it, where above the
    budget; solve again; stop when the plan fits (``_bounded``, at most ``MAX_ROUNDS``
    rounds)

Each cut is the same model (not a linearization of it), exact but where it bounds the
reshards into views from above, so a plan that passes the last check fits, and every plan
that fits satisfies every cut but one those bounds overstate: the loop loses no other. A
budget that binds costs a few rounds, each a whole solve; the spans' cuts bound in one
round the points a plan moves its peak to when the peak alone is bounded (GPT (2 layers)
unfolded on (4,) at 30% of one device's bytes, h100 profile: ILP 19.6 s instead of 21.9 s,
and 26.5 s instead of 50.4 s with checkpointing). Unbound, it costs one measurement; an
overlap round solved beside costs none where a bound of its peak fits: the last measured
plan's peak, plus the optimizer state's change and each storage's, reshard's and graph
output's growth over the nodes whose strategy changed (passes/memory ``peak_bound``; at
every point the total changes by the sum of their changes there), so no cut binds it; the
kept round is measured (``_PeakBound``). ``memory_budget`` defaults
(pipeline) to the device profile's ``usable_memory`` (capacity less a stated reserve).
An impossible budget is reported with the smallest one that fits and the category that
dominates it (``smallest_budget``: min M over the same ILP with bytes(i) <= M at the points
the same loop adds). A budget below the model's state is reported before any ILP is built:
every point holds each parameter and its optimizer state, and no placement holds less of a
tensor on every rank than an equal share over all the mesh's ranks, so no plan's peak goes
below

    floor = sum over parameters p of ceil(numel(p) / ranks) * (bytes per element of p
            + the optimizer's state bytes per element)                    (``state_floor``)

and a budget under it has no plan: the error names the floor and the fewest ranks the whole
state needs at that budget (GPT-3 in bf16 mixed precision over (2,4): ``autopar.plan`` says
so in 29.5 s, its trace included, where the rounds of cuts and the smallest-budget ILP after
them took it 317.5 s). A parameter the constraints pin counts at what its placement holds
on a rank, not an equal share (pinned replicated, as data parallelism pins it: the whole of
it), and the error names the pins instead of a larger mesh, which does not shrink a replica.

Checkpointing (passes/remat; ``checkpointing=True``, with a budget). Each fold group g
whose layers can recompute something gets a boolean r[g] (every instance alike), made when
a memory cut first needs it (``remat_var``). The plans are measured on the step as traced
until one exceeds the budget; from then on (``_Lives``) passes/memory's liveness holds the
step in which any group may be checkpointed (remat.candidates; its points are the traced
step's and the copies', and a plan that checkpoints nothing has the same bytes at the traced
ones: finding the candidates and their points took ~0.15 s of a 96-layer plan whose budget
never binds): the copies' points, and storages that live only when
r[g] = 1 (the copies, an input a copy reads later than anything else does) or only when
r[g] = 0 (an original's life after its last forward read; the whole life of one that then
runs only in the backward). At a cut, with S the bytes of one such part (linear in x and
e) and M its largest value (each storage's largest size, each edge's largest buffer):

    live when r[g] = 0:  S - a,  0 <= a <= S,  a <= M r[g]
    live when r[g] = 1:  a,      a >= S - M (1 - r[g]),  a >= 0

The cut bounds bytes(i) <= budget, so a takes its largest (first form) or smallest
(second) value, and both are exact for r in {0, 1}. The time: t[g] >= F_g(x, e) - M_F (1 -
r[g]), t[g] >= 0 in the objective, F_g the compute time C of every copy (a node that then
runs only in the backward costs nothing more) and the redistributions R(p, q) of their
inputs, summed over the group's layers; also exact. A layer is checkpointed only where a
cut makes it pay: without a budget no r is made.

The ILP with r is solved in branches on r, not whole (``_by_checkpointing``): its big-M
terms make the relaxation weak (at r = 0.01 a group's saved activations shrink by a
hundredth of M for a hundredth of its recompute time), and the solver spent most of its
time closing that. Each branch fixes every r; its relaxation bounds its plans. With one
group (the layers of a folded model), the relaxations at r = 0 and at r = 1, solved beside
each other, order the two branches: the ILP of the lower is solved, and the other's only
where its bound is below that plan's objective (within the gap); the better plan is kept.
With several, the ILP with every r = 0 is solved first; beside it, for each group, the
relaxation with its r = 1 (the others free), a bound on every plan that checkpoints the
group. A group whose bound is not below the first plan's objective stays at 0; where one
group is left, the ILP with its r = 1 and the others 0 is the second branch; where two or
more are left, the ILP is solved whole. Each branch is exact for its r, so the optimum is
the whole ILP's. Llama-3-8B in bf16 mixed precision over (2, 4), H100, where the budget
binds (three cuts): the round with the cuts took 43.0 s solved whole, 20.0 s in branches
(the relaxations, 2.5 s, put r = 0 first: 487.0 against 579.3 ms; r = 1's bound is above
the r = 0 plan's 487.5 ms, and no layer is checkpointed); 17.6 s when r = 0 was solved
first with r = 1's relaxation beside it, and nothing before it. Where checkpointing pays,
the order saves the other ILP: the (2, 2) GPT of tests/distributed/test_training (2
layers, float64, CPU profile, half of one device's step memory) has r = 0's relaxation at
1774.0 us, above the r = 1 plan's 1689.4 us, and the round took 7.8 s instead of 18.8 s
with r = 0 solved first (a bf16 one, tests/distributed/test_mixed_precision: 1246.0
against 1117.1 us, 18.0 s instead of 33.6 s).

Mixed precision (``StrategySpace.reduce_at``, from passes/trace): a parameter's gradient
reaches it through a cast from the compute dtype; ``reduce_dtype`` says on which side of
the cast the gradient is reduced across ranks. "after": the pairs of the edge into the cast
that turn a Partial into anything else are left out (the cast takes the partial sum, the
reduction happens in the parameter's dtype, at the graph output); "before": the pairs that
deliver a Partial into the cast are left out (it is reduced in the compute dtype, and that
edge gets the gradient-overlap discount of a graph output). Such a cast is never merged
(simplification 1), so that its edge exists. For "after", the gradient's transposes and
views between the op that makes it and the cast (``_gradient_chains``: each a following
node, the only consumer of its input) keep a Partial the same way: their edges leave out
the pairs that reduce one, so no reduction of the gradient runs in the compute dtype before
the cast. (Without this, the ILP reduced Llama-3.2-1B's gradients on (2, 4) in bf16 right
after the matmul that made them, a reduction ``reduce_dtype`` float32 forbids: the
torchtitan TP + FSDP plan, solved without merging, was costed 106.3 ms for it, 113.9 ms
kept to float32.)

Folding (passes/fold, ``StrategySpace.rep``; ``_Folding``): the instances of a folded
region take their representative's strategy, so only representatives have variables. With
r(v) the representative of v:

    x[v,k] = x[r(v),k]
    C[r,k] is counted n_r times, n_r = |{v : r(v) = r}|
    an edge u->v becomes the edge r(u)->r(v); the m graph edges that map onto one such edge
        (the same edge in every layer, the edge from one layer into the next, the edges
        from one shared producer into every layer) share its variables e and count m times
    memory: bytes(i) sums over every instance's live storages, each on x[r(v),k]: a
        representative's bytes count once per instance live at i
    ties: between representatives

so the objective is still that of the whole graph, for plans in which every instance does
as its representative. Unfolded, r is the identity and this is the ILP above.

Simplifications (each loses optimality only in the case it names):
    1. Following nodes (Alpa's; ``merge``): a node that only follows its single tensor
       input (a view, an elementwise op of one tensor, a getitem: ``_follows``) and whose
       output has one consumer (``IlpBuilder._following``) is not resharded right before
       it when it accepts its producer's placement: pairs (p, q != p) are left out.
       Where it accepts every placement its producer can give, it is merged into the
       producer (``IlpBuilder.merge_source``): no variables and no edge of its own,
       x[v,k] = Y[u, ins_k], and C[v,k] is added to the producer's variables that give
       ins_k (folded: when every instance of v follows an instance of one representative
       u). Loses where resharding right before such a node beats resharding later. A node
       read by several consumers is left out of it: resharded before it, its output is
       resharded once, not once per consumer (a weight's transpose, read by the forward's
       and the backward's matmul, is gathered once). Llama-3.2-1B on (2, 4), H100, bf16
       mixed precision: 111.7 ms when those were merged, 108.4 ms not, 106.1 ms with no
       merging at all (the ILP: 45k, 56k and 78k variables; 6.7 s, 8.1 s and 15.5 s); what
       is left is a change of two mesh axes made as two one-axis changes, one on each side
       of a following node (simplification 2 allows no other way). ``merge=False`` solves
       without it. On the zoo's GPT (2 layers, (2, 2), H100) both give the same objective
       (tests/unit/test_fold.py::test_merging_following_nodes_keeps_the_optimum).
    2. One axis per edge: an edge between two operators changes the placement on at most
       ``reshard_axes`` mesh axes (default 1); pairs differing on more axes are left out
       (graph outputs, e.g. a gradient all-reduced over every axis, keep all pairs). On a
       2-D mesh this cuts the edge variables about 6x; on the zoo's 2-layer GPT on (2, 2)
       with a parameter budget of half the model (cpu profile, measured before the
       gradient-overlap term above) the objective rose 3.4% (4.548 -> 4.705 ms) while
       the solve dropped from 115 s to 13 s.

Constraints (``pins``, ``frozen`` axes, ``forbid``) can need what the simplifications leave
out (a pinned parameter resharded on two axes into its consumer): an ILP they make
infeasible is solved again without merging, and with every pair on the edges out of a
parameter, its casts and views (pins ``parameter_uses``; ``IlpBuilder.wide``); where still
infeasible, with every pair on every edge (``SIMPLIFICATIONS``; ``stats["unsimplified"]``,
and a warning), so no constraint is refused because of them. The expert plans' pins need
the first as a rule, and it costs them what the exact ILP does. In bf16 mixed precision,
``autopar.evaluate`` with the device's budget: Llama-3.2-1B over (2, 4), FSDP over both
axes and Megatron TP with FSDP (with and without SP), 104.08, 100.85 and 105.26 ms either
way; Llama-3-8B over (2, 4), Megatron TP + SP with FSDP, 477.89 ms either way; GPT-3 over
(2, 4), FSDP over both axes, 8089.59 against 8089.60 ms. Without merging alone (one axis
per edge out of a parameter too) the last two came to 480.9 and 8380.0 ms. With the
simplified ILP tried first, the 1B's three solve in 10.1-11.4 s, where the exact ILP as
the retry (179k variables against 85k) took them to 17.8-19.4 s (without a budget; the
trace and strategies not counted). ``stats["unsimplified"]`` names the retries asked
(``SIMPLIFICATIONS``' first names), "merge" for the first.

What the solve reports (``solve``, ``read_solution``): ``status`` "optimal" (within the gap);
"time_limit" when the clock stopped HiGHS with a plan in hand (the incumbent, the best bound
and the gap go into the stats, and a warning into the plan); no plan at the time limit is a
``SolveError`` that says to raise ``time_limit_s``; an impossible budget, one that names the
smallest feasible budget (or, at once, the model state's floor above it). Every node may
replicate everything (passes/strategies), so without a budget the ILP always has a solution.

Solved to within ``mip_gap`` (default ``MIP_GAP``, 0.01%) of the optimum with HiGHS through
OR-Tools' ``pywraplp`` (single thread: deterministic). Each solve first solves the linear
relaxation (every variable continuous, ``_relaxed``): where every integer variable comes
out integral, that is the ILP's optimum, exactly, and the ILP is not solved; elsewhere the
ILP is solved, in what is left of the time limit (an ILP with checkpointing flags is solved
in branches on them instead, each without its relaxation first: "Checkpointing"). The
search's relaxation is integral as a rule: Llama-3-8B's bf16 step over (8,8), 8011 integer
variables, solved in 1.1 s against 3.5 s as an ILP, with the same objective; with its four
rounds so solved, the plan went from 34 s to 27-30 s. Where the ILP has no memory cut, the
relaxation runs without HiGHS's presolve, which took longer than the simplex it spared
(``_relax_presolve``). The overlap rounds ("Overlap") solve on two threads where they can:
a round whose shares are known is solved on a copy of the ILP beside the simulation of
the round before (``_SolveBeside``), with the same model and objective as in place, so the
same plan. The first solve runs on a thread too, while this one makes what the memory
check and the caller's later stages read of the step whatever the plan (``meanwhile``: the
liveness the solver measures on, passes/order's storage graph and units; ~0.26 s of a
96-layer GPT's step, hidden behind a ~0.33 s solve). Where this thread would wait for a
round solved beside, it does the caller's ``idle`` work instead (passes/pipeline: the step
memory of the shortest plan so far, which the memory stage takes where that plan is kept).
Ties in the objective are broken towards the earlier strategy: x[v,k] costs
``TIE_BREAK_US`` * k / K_v * n_v microseconds more (K_v strategies; n_v instances, so that
the folded and the unfolded ILP prefer alike and pick the same plan). 1e-4 us per node
stands above HiGHS's absolute gap (1e-6) and far below any cost that matters (at most
~2 us over the 18k nodes of a 96-layer GPT).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from ortools.linear_solver import linear_solver_pb2, pywraplp
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_map

from autopar.core import (
    Collective,
    Edge,
    Mesh,
    Placements,
    Recompute,
    Solution,
    Strategy,
    StrategySpace,
    TensorInput,
    local_shape,
    placement_str,
    reduction,
    reductions,
    roles,
)
from autopar.cost_models import (
    DeviceProfile,
    collectives_time,
    compute_time,
    get_profile,
    host_time,
    redistribute_collectives,
    reshard_collectives,
    reshard_time,
)

from . import remat, rules, vocab
from .memory import (
    Liveness,
    MemoryReport,
    Storage,
    liveness,
    local_bytes,
    measure,
    optimizer_bytes,
    peak_bound,
    reshard_bytes,
    state_bytes_per_element,
)
from .order import ready_nodes
from .pins import SEALED, Pin, check_folding, parameter_uses

__all__ = [
    "DEVICE_BUDGET",
    "MIP_GAP",
    "IlpBuilder",
    "SolveError",
    "collective_s",
    "overlaps_collectives",
    "smallest_budget",
    "solve",
    "state_floor",
    "within",
]


class SolveError(RuntimeError):
    """The ILP has no solution or the solver failed. ``least_bytes``: where no plan fits
    the memory budget, the smallest budget per rank that one fits (else None).
    ``floor_bytes``: where the model's state alone is above the budget (``state_floor``),
    that floor, and no solve was run (else None)."""

    def __init__(
        self, message: str, least_bytes: int | None = None, floor_bytes: int | None = None
    ):
        super().__init__(message)
        self.least_bytes = least_bytes
        self.floor_bytes = floor_bytes


GRAD_OVERLAP = 0.75  # the share of all-reduce buckets first counted as hidden ("Overlap")
# per kind of hiding term, the share the first solve counts: an all-reduce bucket's at a
# quarter, a reduce-scatter bucket's and a prefetch's whole (the plan without their overlap)
FIRST_SHARE = {"all_reduce": 1.0 - GRAD_OVERLAP, "reduce_scatter": 1.0, "prefetch": 1.0}
MULTI = "multi_axis"  # a bucket's reduction over several axes (passes/buckets ``chain``)
OVERLAP_ROUNDS = 3  # solves at most, each re-pricing what may hide at the last one's overlap
PARTS = ("forward", "backward")
HIDES = frozenset(FIRST_SHARE) | {MULTI}  # the kinds of overlap the emitted step has (all)
MIP_GAP = 1e-4  # stop within 0.01% of the optimum (HiGHS's own default)

SIMPLIFICATIONS: tuple[tuple[str, str, Callable[[StrategySpace], dict]], ...] = (
    (
        "merge",
        "right before a following node or out of a parameter on several axes",
        lambda space: {"merge": False, "wide": parameter_uses(space)},
    ),
    ("reshard_axes", "on several axes anywhere", lambda space: {"reshard_axes": space.mesh.ndim}),
)
"""The ILP's simplifications (module docstring) in the order an ILP that constraints make
infeasible is solved without them: the name of each, the resharding it leaves out (as the
warning says it), and the options that leave it out."""
log = logging.getLogger("autopar")

_SCALE = 1e6  # seconds -> microseconds inside the ILP, to keep coefficients well scaled
TIE_BREAK_US = 1e-4  # preference for earlier strategies, microseconds per node
_MIB = 2**20  # bytes -> MiB in the smallest-budget ILP's objective

_STATE_ROLES = (roles.PARAM, roles.BUFFER, roles.INPUT, roles.TARGET, roles.TANGENT)


def _node_costs(space: StrategySpace, name: str, profile: DeviceProfile) -> list[float]:
    """C[v,k] for every strategy k of node ``name`` (seconds)."""
    target = space.targets[name]
    strats = space.strategies[name]
    if target == "placeholder" and space.roles[name] in roles.BATCH_ROLES:
        # the batch is read into device memory: each rank reads its local part
        shape, dtype = space.tensor(name)
        sizes = [
            math.prod(local_shape(shape, s.output(), space.mesh.shape)) * dtype.itemsize
            for s in strats
        ]
        return [n / profile.bandwidth(n) for n in sizes]
    if target == "placeholder" or not isinstance(target, torch._ops.OpOverload):
        return [0.0] * len(strats)
    args, kwargs = space.calls[name]
    in_shapes = [space.tensor(src, src_out) for src, src_out in space.in_sources[name]]
    outs = space.shapes[name]
    dtype = next((sd[1] for sd in outs if sd is not None), torch.float32)
    mesh_shape = space.mesh.shape
    cache: dict = {}
    local_cost: dict[tuple, float] = {}
    costs = []
    for s in strats:
        key = (s.ins, s.out)
        if key in cache:
            costs.append(cache[key])
            continue

        # a ring's kernels read every key in turn: priced on the keys gathered
        ins = rules.keys_gathered(target, s.ins)
        lins = tuple(
            torch.Size(local_shape(sd[0], ps, mesh_shape)) for sd, ps in zip(in_shapes, ins)
        )
        lout = tuple(
            None if sd is None or ps is None else torch.Size(local_shape(sd[0], ps, mesh_shape))
            for sd, ps in zip(outs, s.out)
        )
        # the kernel's time is its local shapes': strategies that give the same (a shard
        # over either axis of a square mesh) are priced once
        c = local_cost.get((lins, lout))
        if c is None:
            c = local_cost[(lins, lout)] = _local_time(
                profile, target, args, kwargs, lins, lout, dtype
            )
        ring = _ring_steps(space, name, s)
        if ring is not None:
            c = _ring_time(c, ring[0], ring[1], space.mesh, profile)
        inner = _balance_exchanges(space, name, s) + _class_reductions(space, name, s)
        if inner:
            c += collectives_time(inner, space.mesh, profile)
        cache[key] = c
        costs.append(c)
    return costs


def _local_time(profile: DeviceProfile, target, args, kwargs, lins, lout, dtype) -> float:
    """The compute time of ``target`` called on one rank: its tensor inputs
    (``TensorInput`` in ``args``/``kwargs``) of shapes ``lins``, its outputs ``lout``."""

    def local(a):
        return lins[a.index] if isinstance(a, TensorInput) else a

    largs, lkwargs = tree_map(local, args), tree_map(local, kwargs)
    out = lout[0] if len(lout) == 1 else lout
    try:
        return compute_time(profile, target, largs, lkwargs, out, dtype)
    except Exception:  # noqa: BLE001 - a formula that cannot price it: price by bytes
        return compute_time(profile, torch.ops.aten.add.Tensor, (), {}, out if out else (), dtype)


def _host_times(space: StrategySpace, profile: DeviceProfile) -> dict[str, float]:
    """The host's seconds to issue each node, where the profile runs the host on its own
    clock (``DeviceProfile.host_clock``; cost_models.compute.host_time): the nodes that
    cost any, whatever their strategy (a node runs the same op on any shapes)."""
    if not profile.host_clock:
        return {}
    out = {}
    by_op: dict[object, float] = {}
    for name, target in space.targets.items():
        if isinstance(target, torch._ops.OpOverload):
            t = by_op.get(target)
            if t is None:
                t = by_op[target] = host_time(profile, target)
            if t > 0:
                out[name] = t
    return out


def collective_s(mesh, kind: str, axis: int, nbytes: int) -> float:
    """One collective of ``kind`` moving ``nbytes`` over mesh ``axis``, priced as the
    solver prices every collective (cost_models/comm on the mesh's profile): for the
    passes that regroup collectives after the search (passes/buckets)."""
    return collectives_time(
        [Collective(kind, axis, int(nbytes), mesh.shape[axis])], mesh, get_profile(mesh.device)
    )


def overlaps_collectives(mesh) -> bool:
    """Whether the step on ``mesh``'s profile runs collectives beside its kernels
    (``DeviceProfile.overlaps_collectives``: CUDA streams, not gloo)."""
    return bool(get_profile(mesh.device).overlaps_collectives)


def _inner_collectives(space: StrategySpace, name: str, s: Strategy) -> list[Collective]:
    """The collectives node ``name`` runs inside its op under strategy ``s``: a causal
    attention whose query rows are split, load-balanced over their axis, and a ring
    attention's shifts (passes/rules), and a class-split loss's reductions (passes/vocab)."""
    out = _balance_exchanges(space, name, s) + _class_reductions(space, name, s)
    ring = _ring_steps(space, name, s)
    if ring is not None:
        steps, tail = ring
        out += [c for step in steps for c in step] + tail
    return out


def _class_reductions(space: StrategySpace, name: str, s: Strategy) -> list[Collective]:
    """The all-reduces of a cross-entropy op that splits its classes, or a ``mean`` loss's
    rows (its count of targets) (passes/vocab)."""
    target = space.targets[name]
    if target not in vocab.CLASS_OPS:
        return []
    args, _ = space.calls[name]
    in_shapes = [space.tensor(src, i)[0] for src, i in space.in_sources[name]]
    out = vocab.count_reductions(target, args, s.ins, in_shapes, space.mesh.shape)
    split = vocab.split_axis(target, args, s.ins, in_shapes)
    if split is None:
        return out
    axis, cdim, pos = split
    shape, dtype = space.tensor(*space.in_sources[name][pos])
    local = local_shape(shape, s.ins[pos], space.mesh.shape)
    return out + vocab.reductions(target, local, cdim, dtype, axis, space.mesh.shape[axis])


def _balance_exchanges(space: StrategySpace, name: str, s: Strategy) -> list[Collective]:
    target = space.targets[name]
    at = rules.ATTENTION_Q.get(target)
    if at is None:
        return []
    axes = rules.sequence_axes(s.ins[at])
    if not axes:
        return []
    args, _ = space.calls[name]
    q_shape, dtype = space.tensor(*space.in_sources[name][at])
    v_shape, _ = space.tensor(*space.in_sources[name][at + 2])
    ranks = space.mesh.shape[axes[0]]
    local_q = local_shape(q_shape, s.ins[at], space.mesh.shape)
    return rules.balance_exchanges(
        target, rules.is_causal(target, args), local_q, v_shape[-1], dtype, axes[0], ranks
    )


def _ring_steps(
    space: StrategySpace, name: str, s: Strategy
) -> tuple[list[list[Collective]], list[Collective]] | None:
    """``rules.ring_steps`` of a ring attention strategy, else None."""
    target = space.targets[name]
    if rules.context_variant(target, s.ins) != "ring":
        return None
    at = rules.ATTENTION_Q[target]
    (axis,) = rules.sequence_axes(s.ins[at])
    if space.mesh.shape[axis] == 1:  # a ring of one: every key at home, nothing shifts
        return None
    k_shape, dtype = space.tensor(*space.in_sources[name][at + 1])
    v_shape, _ = space.tensor(*space.in_sources[name][at + 2])
    local_k = local_shape(k_shape, s.ins[at + 1], space.mesh.shape)
    return rules.ring_steps(target, local_k, v_shape[-1], dtype, axis, space.mesh.shape[axis])


def _ring_time(
    compute_s: float,
    steps: list[list[Collective]],
    tail: list[Collective],
    mesh: Mesh,
    profile: DeviceProfile,
) -> float:
    """A ring attention's time (passes/rules, ``ring``): each of its n steps the longer of
    its kernels (``compute_s`` / n, the blocks alike) and the shifts in flight, then the
    shifts after the last step; kernels plus every shift where the profile does not overlap
    collectives (gloo waits for each at once)."""
    block = compute_s / len(steps)
    times = [collectives_time(step, mesh, profile) for step in steps]
    if not profile.overlaps_collectives:  # each shift waited for at once (gloo)
        return compute_s + sum(times) + collectives_time(tail, mesh, profile)
    return sum(max(block, t) for t in times) + collectives_time(tail, mesh, profile)


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS prints a banner on the process's stdout (fd 1), below Python's reach."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _follows(space: StrategySpace, name: str) -> bool:
    """A node that only follows its single tensor input: a view, an elementwise op of one
    tensor, a getitem. Its strategy is a function of its input's placement."""
    strats = space.strategies[name]
    if any(len(s.ins) != 1 for s in strats):
        return False
    return len({s.ins[0] for s in strats}) == len(strats)


def _consumers(space: StrategySpace) -> dict[tuple[str, int], int]:
    """How many edges and graph outputs read each node's output, by ``(node, output)``."""
    uses: dict[tuple[str, int], int] = defaultdict(int)
    for e in space.edges:
        uses[(e.src, e.src_out)] += 1
    for sink in space.sinks:
        uses[(sink.src, sink.src_out)] += 1
    return uses


def _gradient_chains(space: StrategySpace, uses: dict[tuple[str, int], int]) -> set[str]:
    """The following nodes between the op that makes a parameter's gradient and its cast
    whose ``reduce_at`` is "after" (a transpose or view of the gradient, each the only
    consumer of its input): the edges into them keep a Partial unreduced, as the edge into
    the cast does ("Mixed precision")."""
    into: dict[str, list[Edge]] = defaultdict(list)
    for e in space.edges:
        into[e.dst].append(e)
    chain: set[str] = set()
    for cast, side in space.reduce_at.items():
        if side != "after" or len(into[cast]) != 1:
            continue
        e = into[cast][0]
        while (
            uses[(e.src, e.src_out)] == 1
            and len(into[e.src]) == 1
            and _follows(space, e.src)
            and space.roles.get(e.src) not in _STATE_ROLES
        ):
            chain.add(e.src)
            e = into[e.src][0]
    return chain


def _edge_cost(src_ps, dst_ps, shape_dtype, mesh, profile) -> float | None:
    """R(p, q) in seconds; None where DTensor cannot redistribute p -> q."""
    if src_ps == dst_ps:
        return 0.0
    if any(type(p) is _StridedShard for p in src_ps + dst_ps):
        # NOTE: DTensor redistributes a _StridedShard with data-dependent indexing that
        # make_fx cannot trace; strided placements only flow between ops that take them.
        return None
    try:
        return reshard_time(src_ps, dst_ps, shape_dtype[0], shape_dtype[1], mesh, profile)
    except ValueError:
        return None


def _first_share(ilp: IlpBuilder, key: tuple[str, int]) -> float:
    """The share the first solve counts of a part's and axis's hiding terms: the largest
    ``FIRST_SHARE`` of the kinds it has."""
    return max(FIRST_SHARE[kind] for kind, part, axis in ilp.hide_coef if (part, axis) == key)


def chain(steps: Sequence[tuple[str, Any]], scattered: Mapping[Any, int | None]) -> str | None:
    """``direct`` or ``hierarchical`` where a gradient's collectives (``steps``: ``(kind,
    axis)`` in order) are a reduction over the axes of ``scattered`` (axis -> scatter dim,
    None: reduced into Replicate; ``core.reductions``) that a bucket can run on one flat
    tensor (passes/buckets); else None. Axes by name or by index, alike in both."""
    kinds = [k for k, _ in steps]
    axes = [a for _, a in steps]
    if (
        len(steps) >= 3
        and kinds[0] == "reduce_scatter"
        and kinds[-1] == "all_gather"
        and axes[0] == axes[-1]
        and all(k == "all_reduce" for k in kinds[1:-1])
        and len(set(axes[:-1])) == len(axes) - 1
        and set(axes) == set(scattered)
        and all(d is None for d in scattered.values())
    ):
        return "hierarchical"
    if len(set(axes)) != len(axes) or set(axes) != set(scattered):
        return None
    wanted = {a: ("all_reduce" if d is None else "reduce_scatter") for a, d in scattered.items()}
    return "direct" if all(wanted[a] == k for k, a in steps) else None


def splits_evenly(
    made: Sequence[int],
    steps: Sequence[tuple[str, Any]],
    scattered: Mapping[Any, int | None],
    size: Mapping[Any, int],
) -> bool:
    """Each reduce-scatter of ``steps`` splits what the ones before it left of the local
    shape ``made`` evenly (a bucket's flat tensor is the members' equal chunks, rank by
    rank); ``size``: each axis's ranks."""
    local = list(made)
    for kind, axis in steps:
        d = scattered[axis]
        if kind == "reduce_scatter" and d is not None:
            if local[d] % size[axis]:
                return False
            local[d] //= size[axis]
    return True


def _bucket(src_ps, dst_ps, shape_dtype, cost_s: float, mesh: Mesh, profile: DeviceProfile):
    """The collectives of a gradient's reduction that passes/buckets buckets, each ``(kind,
    axis, seconds)`` ("Overlap"): one all-reduce or one reduce-scatter on one axis (its
    seconds ``cost_s``, the edge's); over several axes, the chain a bucket runs (``chain``,
    ``splits_evenly``), each step of kind ``MULTI`` on its axis, the edge's seconds split
    over the steps as each step's own time is of their sum. None where no bucket runs it."""
    one = reduction(src_ps, dst_ps)
    if one is not None:
        return [("all_reduce" if one[1] is None else "reduce_scatter", one[0], cost_s)]
    scattered = reductions(src_ps, dst_ps)
    if scattered is None:
        return None
    shape, dtype = shape_dtype
    colls = reshard_collectives(src_ps, dst_ps, shape, dtype, mesh, profile)
    steps = [(c.kind, c.axis) for c in colls]
    how = chain(steps, scattered)
    if how is None:
        return None
    made = local_shape(tuple(shape), src_ps, mesh.shape)
    if how == "direct" and not splits_evenly(made, steps, scattered, dict(enumerate(mesh.shape))):
        return None
    times = [collectives_time([c], mesh, profile) for c in colls]
    whole = sum(times)
    if whole <= 0:
        return None
    # the edge's seconds, so that counted whole (the first solve) the chain is the edge
    return [(MULTI, c.axis, cost_s * t / whole) for c, t in zip(colls, times)]


def _collective_axes(src_ps, dst_ps) -> list[int]:
    """The mesh axes on which ``src -> dst`` runs a collective: those it changes from a
    ``Shard`` or a ``Partial`` (from ``Replicate`` the change is a local chunk)."""
    return [
        i for i, (a, b) in enumerate(zip(src_ps, dst_ps)) if a != b and not isinstance(a, Replicate)
    ]


def _reduces_as(src_ps, dst_ps, reduce: str) -> bool:
    """Whether p -> q keeps to a gradient cast's ``reduce_at`` (``_pair_variables``)."""
    if reduce == "before":
        return not any(isinstance(b, Partial) for b in dst_ps)
    return not any(
        isinstance(a, Partial) and not isinstance(b, Partial) for a, b in zip(src_ps, dst_ps)
    )


@dataclass
class _Folding:
    """Representatives (module docstring, "Folding"): r(v), n_r, and the producers of each
    representative's inputs where every instance agrees on them."""

    rep_of: dict[str, str]
    count: dict[str, int]
    reps: list[str]
    qsrc: dict[str, tuple | None]

    @classmethod
    def of(cls, space: StrategySpace) -> _Folding:
        rep_of = space.rep
        count: dict[str, int] = defaultdict(int)
        for name in space.order:
            count[rep_of.get(name, name)] += 1
        reps = [n for n in space.order if rep_of.get(n, n) == n]
        # None where the instances' producers differ: such a node is not merged
        qsrc: dict[str, tuple | None] = {}
        for name in space.order:
            srcs = tuple((rep_of.get(s, s), so) for s, so in space.in_sources[name])
            r = rep_of.get(name, name)
            if r not in qsrc:
                qsrc[r] = srcs
            elif qsrc[r] != srcs:
                qsrc[r] = None
        return cls(rep_of, count, reps, qsrc)

    def rep(self, name: str) -> str:
        return self.rep_of.get(name, name)


@dataclass
class _EdgeTerm:
    """A priced pair of an edge: the variables that are 1 when it is taken, and its cost."""

    labels: list[str]
    var: Any  # one e variable, or a list of x variables (a sink into a fixed placement)
    src_ps: tuple
    dst_ps: tuple
    cost_s: float
    shape_dtype: tuple


class IlpBuilder:
    """The ILP of the module docstring over ``space``, built one family of terms at a time.

    ``build_ilp`` calls the methods in order; ``read_solution`` reads the result back.
    Objective coefficients gather in ``coef`` (variable -> microseconds) until
    ``objective`` sets them.
    """

    def __init__(
        self,
        space: StrategySpace,
        profile: DeviceProfile,
        *,
        solver: str,
        merge: bool = True,
        reshard_axes: int | None = 1,
        wide: Collection[str] = frozenset(),
        optimizer: str = "adamw",
        hides: Collection[str] = HIDES,
    ):
        self.space = space
        self.wide = frozenset(wide)  # sources whose edges keep every pair (``SIMPLIFICATIONS``)
        self.hides = frozenset(hides) if profile.overlaps_collectives else frozenset()
        self.profile = profile
        self.merge = merge
        self.reshard_axes = reshard_axes
        self.optimizer = optimizer
        self.solver = solver
        with _quiet_stdout():
            lp = pywraplp.Solver.CreateSolver(solver)
        if lp is None:
            raise SolveError(f"OR-Tools has no {solver} solver in this build")
        lp.SetNumThreads(1)
        lp.SuppressOutput()
        self.lp = lp
        self.folding = _Folding.of(space)
        # x[name][k]: the base variables whose sum is x[v,k] (a merged node has none of its
        # own: its entries are its producer's, ``merge_source``)
        self.x: dict[str, list[list[Any]]] = {}
        self.coef: dict = defaultdict(float)
        self.ties: dict = defaultdict(float)  # the tie-break, apart: no part of a time
        # the overlap terms ("Overlap"): the forward's share of ``coef``; per (kind, part,
        # mesh axis) the collectives that may run beside the compute (kept out of ``coef``)
        self.forward_coef: dict = defaultdict(float)
        self.hide_coef: dict[tuple[str, str, int], dict] = defaultdict(lambda: defaultdict(float))
        # per (part, mesh axis), the part's other collectives on it (in ``coef``): they share
        # the axis's stream with those that hide
        self.axis_coef: dict[tuple[str, int], dict] = defaultdict(lambda: defaultdict(float))
        # per (part, axis), the share of its hiding terms the objective counts (the rest
        # hidden); before the first solve, each kind's ``FIRST_SHARE``
        self.hide_scale: dict[tuple[str, int], float] = {}
        # per (part, axis), the steps of the buckets' chains over several axes on it: in
        # the objective whole (their pairs in ``coef`` and ``axis_coef``), in the step's
        # length (``overlap``) beside the compute
        self.multi_coef: dict[tuple[str, int], dict] = defaultdict(lambda: defaultdict(float))
        self.early = ready_nodes(space)
        self.node_cost: dict[str, list[float]] = {}
        self.merged: set[str] = set()
        uses = _consumers(space)
        self.chain = _gradient_chains(space, uses)
        # nodes whose output has several consumers (a following one is not merged)
        self.shared = {n for (n, _), k in uses.items() if k > 1}
        self.edge_terms: list[_EdgeTerm] = []
        # (r(u), output, r(v), input) -> its pairs (e, p, q): where collective buffers live
        self.pairs: dict[tuple, list[tuple[Any, tuple, tuple]]] = {}
        # graph outputs: (r(u), output, its pairs (variable, p, q), how many outputs)
        self.sink_pairs: list[tuple[str, int, list, int]] = []
        self.n_edge_vars = 0
        self.cuts: list[int] = []
        self.times: dict[str, float] = {}
        # e variable -> R(p, q) of its pair (seconds, once)
        self.pair_cost: dict[Any, float] = {}
        # fold group -> (r, t, its recompute time: node part, edge part) ("Checkpointing")
        self.remat: dict[str, tuple[Any, Any, dict, dict]] = {}
        # (storage, output, chain of views) -> its h (``_held_var``)
        self.viewed_held: dict[tuple, Any] = {}
        self._active: dict | None = None
        self.var_index: dict = {}  # variable -> its index in the model, where read
        # a solution kept by ``hold`` (variable index -> value; objective, best bound),
        # read in place of the solver's until the next solve
        self.held: tuple[list[float], float, float] | None = None
        # variable -> its index (OR-Tools' ``index()`` is a wrapped call, ten times a dict
        # lookup: a held solution is read by index hundreds of thousands of times a plan)
        self._index: dict[Any, int] = {}
        # what ``choice`` and ``overlap`` read of the held solution, made once per solution
        # (each is linear in the step's nodes; a round reads both two or three times)
        self._read_of: tuple[tuple | None, int, dict[str, Any]] = (None, 0, {})
        self.lv: Liveness | None = None  # the liveness the memory cuts are made on
        # the last plan ``evaluate`` measured: (its liveness, layers checkpointed, choice,
        # peak), which ``peak_bound`` bounds the next from
        self._measured: tuple[Liveness, set[str], dict[str, int], int] | None = None
        self.rounds: list[float] = []  # each overlap round's step, seconds ("Overlap")
        # the kept round's solution as its step was judged (read_solution ``like``), where
        # the rounds read one: the values held are restored, so it is the plan read again
        self.kept: Solution | None = None
        # ``_texts`` and ``_edge_cost``'s: id of a placement tuple -> (it, its texts); R(p, q)
        self._placement_texts: dict[int, tuple[tuple, tuple[str, ...]]] = {}
        self._inner_names: list[str] | None = None
        self._edge_costs: dict[tuple, float | None] = {}

    # -- margins ---------------------------------------------------------------------------

    def _texts(self, ps: tuple) -> tuple[str, ...]:
        """``ps``'s placement texts (``placement_str``), made once per tuple object (the
        strategies share theirs; the tuple is kept, so its id is not reused)."""
        made = self._placement_texts.get(id(ps))
        if made is None:
            made = self._placement_texts[id(ps)] = (ps, tuple(placement_str(p) for p in ps))
        return made[1]

    def _edge_cost(self, p: tuple, pt: tuple, q: tuple, qt: tuple, shape_dtype) -> float | None:
        """``_edge_cost`` of p -> q (texts ``pt``, ``qt``) for a tensor of ``shape_dtype``,
        priced once per (texts, shape, dtype): a fold's and a layer's edges repeat them."""
        if pt == qt:
            return 0.0
        key = (pt, qt, tuple(shape_dtype[0]), shape_dtype[1])
        if key not in self._edge_costs:
            self._edge_costs[key] = _edge_cost(p, q, shape_dtype, self.space.mesh, self.profile)
        return self._edge_costs[key]

    def out_group(self, name: str, idx: int) -> dict:
        """Y[u, p]: the x variables of ``name`` whose output ``idx`` is placed p, by p."""
        g = defaultdict(list)
        for k, s in enumerate(self.space.strategies[name]):
            if s.out[idx] is not None:
                g[s.out[idx]].extend(self.x[name][k])
        return g

    def in_group(self, name: str, j: int) -> dict:
        """Z[v, q]: the x variables of ``name`` whose input ``j`` is placed q, by q."""
        g = defaultdict(list)
        for k, s in enumerate(self.space.strategies[name]):
            g[s.ins[j]].extend(self.x[name][k])
        return g

    # -- x, one-hot, C -------------------------------------------------------------------

    def merge_source(self, name: str) -> tuple[str, int] | None:
        """The producer (representative, output) node ``name`` is merged into, if any."""
        if not self.merge:
            return None
        if self.space.roles.get(name) in _STATE_ROLES or name in self.space.reduce_at:
            return None
        if not self._following(name):
            return None
        srcs = self.folding.qsrc[name]
        return srcs[0] if srcs is not None and len(srcs) == 1 else None

    def _following(self, name: str) -> bool:
        """Simplification 1 applies to ``name``: it follows its input and its output has
        one consumer."""
        return name not in self.shared and _follows(self.space, name)

    def node_variables(self) -> None:
        """x[v,k] with sum_k x[v,k] = 1 for every representative, and C[v,k] * n_v.

        A follower is made after its producer. Folding can order a representative before
        the producer it merges into (a layer's input comes from the previous layer): walk
        the chain of producers first; a chain that closes on itself is cut (the node gets
        variables)."""
        visiting: set[str] = set()
        for name in self.folding.reps:
            chain = []
            v = name
            while v not in self.x and v not in visiting:
                visiting.add(v)
                chain.append(v)
                src = self.merge_source(v)
                if src is None:
                    break
                v = src[0]
            for w in reversed(chain):
                self._node(w)

    def _node(self, name: str) -> None:
        strats = self.space.strategies[name]
        if not strats:
            sp = self.space
            raise SolveError(
                f"node {name} ({sp.targets[name]}, module {sp.modules[name] or '<top level>'}) "
                "has no strategy: passes/strategies offered none"
            )
        costs = _node_costs(self.space, name, self.profile)
        self.node_cost[name] = costs
        src = self.merge_source(name)
        groups = self.out_group(*src) if src and src[0] in self.x else None
        if groups is not None and set(groups) <= {st.ins[0] for st in strats}:
            self.x[name] = [list(groups.get(st.ins[0], [])) for st in strats]
            self.merged.add(name)
        else:
            vs = [self.lp.BoolVar(f"x_{name}_{k}") for k in range(len(strats))]
            self.lp.Add(sum(vs) == 1)
            self.x[name] = [[v] for v in vs]
            for k, v in enumerate(vs):
                # tie-break: prefer earlier strategies by a hair, once per instance
                self.ties[v] += TIE_BREAK_US * k / len(vs) * self.folding.count[name]
        forward = self.space.roles[name] != roles.BACKWARD
        for k, c in enumerate(costs):
            for v in self.x[name][k]:
                self.coef[v] += c * self.folding.count[name] * _SCALE
                if forward:
                    self.forward_coef[v] += c * self.folding.count[name] * _SCALE

    # -- e, margins, R ---------------------------------------------------------------------

    def _pair_variables(
        self,
        labels,
        src,
        src_out,
        dst_groups: dict,
        *,
        follow=False,
        max_axes=None,
        forward=False,
        bucket=None,
        prefetch=False,
        reduce: str | None = None,
    ) -> list[tuple[Any, tuple, tuple]]:
        """e[u,p,v,q] for every allowed pair, tied to Y[u,p] and Z[v,q]; R(p,q) * m in the
        objective (``forward``: in the forward's share too), or in the hiding terms of
        its part and axes ("Overlap"): where ``bucket`` (``_bucket``) gives the collectives
        a bucket runs, each in its kind's and axis's term, or where ``prefetch`` and p -> q
        runs a collective on one axis.
        ``reduce`` (a gradient cast's ``reduce_at``): "after" leaves out the pairs that
        reduce a Partial, "before" those that deliver one. Returns the pairs as
        ``(e, p, q)``."""
        space = self.space
        shape_dtype = space.tensor(src, src_out)
        src_groups = self.out_group(src, src_out)
        pair_vars_p = defaultdict(list)
        pair_vars_q = defaultdict(list)
        pairs = []
        # (each placement tuple's texts compared, not its placements: torch's placements
        # compare in Python, and a 12-layer step's ILP compares ~350,000 pairs)
        texts = self._texts
        dst = [(q, texts(q)) for q in dst_groups]
        for p in src_groups:
            pt = texts(p)
            # following: only the pair that keeps p, where the consumer can take p
            same = [(q, qt) for q, qt in dst if qt == pt] if follow else []
            for q, qt in same or dst:
                if max_axes is not None and sum(a != b for a, b in zip(pt, qt)) > max_axes:
                    continue
                if reduce is not None and not _reduces_as(p, q, reduce):
                    continue
                c = self._edge_cost(p, pt, q, qt, shape_dtype)
                if c is None:
                    continue
                ev = self.lp.NumVar(0.0, 1.0, "")
                self.pair_cost[ev] = c
                self.n_edge_vars += 1
                pairs.append((ev, p, q))
                pair_vars_p[p].append(ev)
                pair_vars_q[q].append(ev)
                if c > 0:
                    part = "forward" if forward else "backward"
                    axes = _collective_axes(p, q)
                    hides = None
                    if bucket is not None:
                        hides = bucket(p, q, shape_dtype, c, space.mesh, self.profile)
                    if hides is None and prefetch and len(axes) == 1:
                        hides = [("prefetch", axes[0], c)]
                    if hides is not None and hides[0][0] in self.hides and hides[0][0] != MULTI:
                        ((kind, axis, _),) = hides
                        self.hide_coef[(kind, part, axis)][ev] += c * len(labels) * _SCALE
                    else:
                        self.coef[ev] += c * len(labels) * _SCALE
                        if forward:
                            self.forward_coef[ev] += c * len(labels) * _SCALE
                        if self.profile.overlaps_collectives:
                            for a in axes:
                                self.axis_coef[(part, a)][ev] += c * len(labels) * _SCALE
                        if hides is not None and hides[0][0] == MULTI and MULTI in self.hides:
                            # a bucket's chain over several axes: whole in W, its steps
                            # beside the compute in the step's length ("Overlap")
                            for _, axis, s in hides:
                                self.multi_coef[(part, axis)][ev] += s * len(labels) * _SCALE
                    self.edge_terms.append(_EdgeTerm(labels, ev, p, q, c, shape_dtype))
        for p, xs in src_groups.items():
            self._equal(pair_vars_p[p], xs)
        for q, xs in dst_groups.items():
            self._equal(pair_vars_q[q], xs)
        return pairs

    def _equal(self, a: Sequence, b: Sequence) -> None:
        """sum(a) == sum(b), one row set coefficient by coefficient (OR-Tools' expression
        API builds and walks a tree of Python objects per row: ~0.3 s of a 12-layer step's
        ILP)."""
        coeffs: dict = defaultdict(float)
        for v in a:
            coeffs[v] += 1.0
        for v in b:
            coeffs[v] -= 1.0
        row = self.lp.RowConstraint(0.0, 0.0, "")
        for v, c in coeffs.items():
            row.SetCoefficient(v, c)

    def edge_variables(self) -> None:
        """The edges between representatives, each standing for the m graph edges onto it."""
        space, rep_of, merged = self.space, self.folding.rep_of, self.merged
        q_edges: dict[tuple, list[str]] = defaultdict(list)
        for e in space.edges:
            dst = rep_of.get(e.dst, e.dst)
            if dst in merged:
                continue
            key = (rep_of.get(e.src, e.src), e.src_out, dst, e.dst_in)
            q_edges[key].append(f"{e.src}->{e.dst}")
        for key, labels in q_edges.items():
            src, src_out, dst, dst_in = key
            cast = space.reduce_at.get(dst)
            reduce = "after" if cast is None and dst in self.chain else cast
            once = sum(s == src for s, _ in space.in_sources[dst]) == 1
            self.pairs[key] = self._pair_variables(
                labels,
                src,
                src_out,
                self.in_group(dst, dst_in),
                follow=self.merge and cast is None and self._following(dst),
                max_axes=None if src in self.wide else self.reshard_axes,
                reduce=reduce,
                forward=space.roles[dst] != roles.BACKWARD,
                prefetch=src in self.early and once,
            )

    def output_terms(self) -> None:
        """Graph outputs: the loss into Replicate, a gradient into its parameter's placement
        (a bucketed reduction in its axis's bucket terms, "Overlap")."""
        space, f = self.space, self.folding
        rep_ps = (Replicate(),) * space.mesh.ndim
        q_sinks: dict[tuple, list[str]] = defaultdict(list)
        for sink in space.sinks:
            like = None if sink.like is None else f.rep(sink.like)
            label = f"{sink.src}->output[{sink.position}]"
            if sink.like is not None:
                label += f" (as {sink.like})"
            q_sinks[(f.rep(sink.src), sink.src_out, like)].append(label)
        for (src, src_out, like), labels in q_sinks.items():
            if like is None:
                # a fixed target (the loss: Replicate): priced on the producer's variables
                shape_dtype = space.tensor(src, src_out)
                groups = self.out_group(src, src_out)
                self.sink_pairs.append(
                    (src, src_out, [(x, p, rep_ps) for p, xs in groups.items() for x in xs], 1)
                )
                for p, xs in groups.items():
                    c = _edge_cost(p, rep_ps, shape_dtype, space.mesh, self.profile)
                    if c is None:
                        self.lp.Add(sum(xs) == 0)
                    elif c > 0:
                        for v in xs:
                            self.coef[v] += c * len(labels) * _SCALE
                        self.edge_terms.append(_EdgeTerm(labels, xs, p, rep_ps, c, shape_dtype))
                continue
            # a gradient's reduction that codegen buckets overlaps the rest of the backward
            # pass where the device overlaps collectives ("Overlap"); the others run at its end
            grad = space.roles[like] == roles.PARAM and self.profile.overlaps_collectives
            pairs = self._pair_variables(
                labels, src, src_out, self.out_group(like, 0),
                bucket=_bucket if grad else None,
            )  # fmt: skip
            self.sink_pairs.append((src, src_out, pairs, len(labels)))

    # -- ties and memory -------------------------------------------------------------------

    def tie_constraints(self) -> None:
        """Z[a,q] = Z[b,q] for every tied pair of representatives."""
        f = self.folding
        for a, b in dict.fromkeys((f.rep(a), f.rep(b)) for a, b in self.space.ties):
            if a == b:
                continue
            ga, gb = self.out_group(a, 0), self.out_group(b, 0)
            for q in set(ga) | set(gb):
                self._equal(ga.get(q, []), gb.get(q, []))

    def memory_point(self, lv: Liveness, i: int) -> dict:
        """bytes(i) of passes/memory as a linear expression: base variable -> MiB.

        A live storage made by node v's output o adds size(o under strategy k) to x[r(v),k]
        (once per instance: folded, the representative's variables gather every instance's
        bytes); a parameter adds its optimizer state the same way; a tensor input of node i
        redistributed from p to q adds its buffers (``reshard_bytes``) to its edge's
        e[u,p,v,q], and into a view's first input, size(q) at every point its buffer is
        the view's storage (``Liveness.viewed``; to its longest life); a storage that
        one chain of views alone reads past a point (``Storage.held_by``) adds, past it,
        its variable h >= size - M * (the chain's redistributing pairs) (``_held_var``)
        in place of its size; at the return
        (``i == len(lv.order)``), each graph output that leaves with q != p adds size(q) to
        its sink's pair (a fixed target: to the producer's x). What lives only when a fold
        group is, or is not, checkpointed goes through that group's r ("Checkpointing")."""
        space, rep = self.space, self.folding.rep
        mesh_shape = tuple(space.mesh.shape)
        params = set(lv.params)
        coef: dict = defaultdict(float)
        cond: dict[tuple[str, bool], dict] = defaultdict(lambda: defaultdict(float))
        most: dict[tuple[str, bool], float] = defaultdict(float)  # each part's largest value
        for s in lv.live_at(i):
            r = rep(s.owner)
            into = coef if s.when is None else cond[s.when]
            held = s.held_by()
            if held is not None and i > held[1]:
                # read past here through one chain of views alone: live only where none
                # of them has its input redistributed
                a = self._held_var(s, held[0])
                if a is not None:
                    into[a] += 1.0
                    continue
            top = 0.0
            for k, st in enumerate(space.strategies[r]):
                ps = st.out[s.out]
                b = s.nbytes(ps, mesh_shape)
                if s.owner in params:
                    b += optimizer_bytes(s, ps, mesh_shape, self.optimizer)
                top = max(top, b / _MIB)
                if b:
                    for v in self.x[r][k]:
                        into[v] += b / _MIB
            if s.when is not None:
                most[s.when] += top
        for h in lv.viewed_at(i):  # a reshard into a view, held as the view's storage
            into = coef if h.when is None else cond[h.when]
            shape, dtype = space.tensor(h.src, h.out)
            sizes = [0.0]
            for ev, p, q in self.pairs.get((rep(h.src), h.out, rep(h.node), 0), ()):
                if p != q:
                    sizes.append(local_bytes(shape, dtype, q, mesh_shape) / _MIB)
                    into[ev] += sizes[-1]
            if h.when is not None:
                most[h.when] += max(sizes)
        if i == len(lv.order):  # the return: each output redistributed to where it leaves
            for src, so, pairs, count in self.sink_pairs:
                shape, dtype = space.tensor(src, so)
                for v, p, q in pairs:
                    if p != q:
                        coef[v] += count * local_bytes(shape, dtype, q, mesh_shape) / _MIB
            return coef
        name, g = lv.node_at[i], lv.unit_at[i]
        if space.targets[name] != "placeholder":
            into = coef if g is None else cond[(g, True)]
            for j, src, so in lv.reshard_inputs(i):
                shape, dtype = space.tensor(src, so)
                layout = space.layouts.get((src, so))
                sizes = [0.0]
                for ev, p, q in self.pairs.get((rep(src), so, rep(name), j), ()):
                    if p != q:
                        b = reshard_bytes(shape, dtype, p, q, mesh_shape, layout)
                        sizes.append(b / _MIB)
                        into[ev] += sizes[-1]
                if g is not None:
                    most[(g, True)] += max(sizes)
        for (group, on), expr in cond.items():
            big = most[(group, on)]
            if big <= 0:
                continue
            r = self.remat_var(lv, group)
            a = self.lp.NumVar(0.0, self.lp.infinity(), "")
            if on:  # counted when r = 1: a >= expr - big (1 - r), a >= 0
                ct = self.lp.Constraint(-big, self.lp.infinity())
                ct.SetCoefficient(a, 1.0)
                ct.SetCoefficient(r, -big)
                for v, c in expr.items():
                    ct.SetCoefficient(v, -c)
                coef[a] += 1.0
            else:  # counted when r = 0: expr - a, a <= expr, a <= big r
                ct = self.lp.Constraint(0.0, self.lp.infinity())
                ct.SetCoefficient(a, -1.0)
                for v, c in expr.items():
                    ct.SetCoefficient(v, c)
                    coef[v] += c
                self.lp.Add(a <= big * r)
                coef[a] -= 1.0
        return coef

    def _held_var(self, s: Storage, chain: tuple[str, ...]):
        """h >= size(s under x) - M * (the pairs that redistribute into any view of
        ``chain``), h >= 0, in MiB: storage ``s``'s bytes where it is read through
        ``chain`` alone (passes/memory, ``Storage.held_by``); the memory rows' h is as
        small as they let it be. None where no view of the chain may be redistributed."""
        key = (s.owner, s.out, chain)
        if key in self.viewed_held:
            return self.viewed_held[key]
        rep, views = self.folding.rep, remat.view_inputs(self.space)
        mesh_shape = tuple(self.space.mesh.shape)
        moved = [
            ev
            for v in chain
            for ev, p, q in self.pairs.get((rep(views[v][0]), views[v][1], rep(v), 0), ())
            if p != q
        ]
        h = None
        if moved:
            r = rep(s.owner)
            sizes = [s.nbytes(st.out[s.out], mesh_shape) / _MIB for st in self.space.strategies[r]]
            h = self.lp.NumVar(0.0, self.lp.infinity(), "")
            ct = self.lp.Constraint(0.0, self.lp.infinity())
            ct.SetCoefficient(h, 1.0)
            for k, b in enumerate(sizes):
                for x in self.x[r][k]:
                    ct.SetCoefficient(x, ct.GetCoefficient(x) - b)
            for ev in moved:
                ct.SetCoefficient(ev, ct.GetCoefficient(ev) + max(sizes, default=0.0))
        self.viewed_held[key] = h
        return h

    def remat_var(self, lv: Liveness, group: str):
        """r of fold group ``group`` ("Checkpointing"): made at its first use, with t >= its
        layers' recompute time F(x, e) - M (1 - r), t in the objective."""
        if group in self.remat:
            return self.remat[group][0]
        rep = self.folding.rep
        r = self.lp.BoolVar(f"r_{group}")
        t = self.lp.NumVar(0.0, self.lp.infinity(), f"t_{group}")
        nodes: dict = defaultdict(float)
        edges: dict = defaultdict(float)
        big = 0.0
        for rec in lv.groups[group]:
            for n in rec.nodes:
                rn = rep(n)
                costs = self.node_cost[rn] if n not in rec.moved else []
                for k, c in enumerate(costs):
                    for v in self.x[rn][k]:
                        nodes[v] += c * _SCALE
                big += max(costs, default=0.0) * _SCALE
                for j, (src, so) in enumerate(self.space.in_sources[n]):
                    pairs = self.pairs.get((rep(src), so, rn, j), ())
                    cs = [self.pair_cost.get(ev, 0.0) * _SCALE for ev, _, _ in pairs]
                    for (ev, _, _), c in zip(pairs, cs):
                        if c:
                            edges[ev] += c
                    big += max(cs, default=0.0)
        ct = self.lp.Constraint(-big, self.lp.infinity())  # t - F - big r >= -big
        ct.SetCoefficient(t, 1.0)
        ct.SetCoefficient(r, -big)
        for part in (nodes, edges):
            for v, c in part.items():
                ct.SetCoefficient(v, ct.GetCoefficient(v) - c)
        self.remat[group] = (r, t, nodes, edges)
        self.coef[t] += 1.0
        if self._active is self.coef:
            self.lp.Objective().SetCoefficient(t, 1.0)
        return r

    def recomputed(self) -> set[str]:
        """The fold groups the solver checkpointed."""
        return {g for g, (r, *_) in self.remat.items() if self.value(r) > 0.5}

    def memory_cut(self, lv: Liveness, i: int, bound) -> None:
        """bytes(i) <= bound (bytes, or a variable in MiB): one point of the step bounded."""
        self.lv = lv
        expr = self.memory_point(lv, i)
        rhs = bound if not isinstance(bound, (int, float)) else float(bound) / _MIB
        self.lp.Add(sum(c * v for v, c in expr.items()) <= rhs)
        self.cuts.append(i)

    def evaluate(self, lv: Liveness) -> MemoryReport:
        """The step memory (passes/memory) of the strategies the solver set: its peak and
        timeline, not laid out (the rounds read the peak alone)."""
        choice, recompute = self.choice(), self.recomputed()
        report = measure(lv, *self._placements(choice), self.optimizer, recompute, layout=False)
        self._measured = (lv, recompute, choice, report.peak_bytes)
        return report

    def peak_bound(self, lv: Liveness) -> int | None:
        """At least the step memory's peak of the strategies the solver set (passes/memory
        ``peak_bound``), from the last plan ``evaluate`` measured on ``lv`` with the same
        layers checkpointed: its sums run over what the nodes whose strategy changed touch
        (an overlap round's plan changes 1-2% of a deep step's), not over the step's points.
        None where there is no such plan."""
        if self._measured is None:
            return None
        was_lv, was_recompute, was, peak = self._measured
        recompute = self.recomputed()
        if was_lv is not lv or was_recompute != recompute or lv.early:
            return None
        choice = self.choice()
        changed = [n for n, k in choice.items() if was[n] != k]
        before, after = self._placements(was), self._placements(choice)
        return peak_bound(lv, before, after, changed, peak, self.optimizer, recompute)

    def _placements(self, choice: Mapping[str, int]) -> tuple[Callable, Callable]:
        """The placements of the plan ``choice`` as passes/memory reads them."""
        strats = self.space.strategies  # (read where asked: a bound reads few nodes)
        return (lambda n, o: strats[n][choice[n]].out[o]), (
            lambda n, j: strats[n][choice[n]].ins[j]
        )

    def objective(self, coef: dict | None = None) -> None:
        """min sum of the coefficients gathered (``coef``: use these instead), the hiding
        terms of each part and axis counted at its ``hide_scale`` ("Overlap")."""
        obj = self.lp.Objective()
        obj.Clear()
        self._active = self.coef if coef is None else coef
        terms = self.objective_terms(self.hide_scale) if coef is None else coef
        for v, c in terms.items():
            obj.SetCoefficient(v, c)
        obj.SetMinimization()

    def model_at(
        self, hide_scale: Mapping[tuple[str, int], float]
    ) -> linear_solver_pb2.MPModelProto:
        """A copy of the model as it stands, minimizing the objective with the hiding terms
        at ``hide_scale`` (``objective_terms``), its variables set by index (read once)."""
        model = linear_solver_pb2.MPModelProto()
        self.lp.ExportModelToProto(model)
        variables = model.variable
        if self._active is not self.coef:  # (else the model's coefficients are the terms')
            for var in variables:
                var.objective_coefficient = 0.0
        index = self.var_index
        for v, c in self.objective_terms(hide_scale).items():
            i = index.get(v)
            if i is None:
                i = index[v] = v.index()
            variables[i].objective_coefficient = c
        model.maximize = False
        return model

    def objective_terms(self, hide_scale: Mapping[tuple[str, int], float]) -> dict:
        """The objective's coefficient of each variable, the hiding terms at ``hide_scale``."""
        terms: dict = defaultdict(float, self.coef)
        for v, c in self.ties.items():
            terms[v] += c
        for (kind, part, axis), pool in self.hide_coef.items():
            share = hide_scale.get((part, axis), FIRST_SHARE[kind])
            for v, c in pool.items():
                terms[v] += share * c
        return terms

    def _once(self, what: str, make: Callable[[], Any]) -> Any:
        """``make()`` read of the held solution, made once while it is held (and no variable
        is added: a checkpointed group's time enters the objective's coefficients)."""
        if self.held is None:
            return make()
        held, count, made = self._read_of
        if held is not self.held or count != self.lp.NumVariables():
            made = {}
            self._read_of = (self.held, self.lp.NumVariables(), made)
        if what not in made:
            made[what] = make()
        return made[what]

    def overlap(self) -> tuple[float, dict[tuple[str, int], float | None]]:
        """At the solution: the step's length (seconds) with what may hide beside the
        compute of its part, W + sum over parts of max_a max(0, H_pa - (W_p - B_pa)), and
        the share of each H_pa that is not hidden (None where the plan has none of it:
        "Overlap")."""
        return self._once("overlap", self._overlap)

    def _overlap(self) -> tuple[float, dict[tuple[str, int], float | None]]:

        # the choice variables rounded (the solver's tolerance leaves 1e-7 on a continuous
        # e; the plan is the rounded choice); a checkpointed group's time t as it is
        times = {t for _, t, _, _ in self.remat.values()}

        def value(part: dict) -> float:
            return (
                sum(
                    c * (self.value(v) if v in times else round(self.value(v)))
                    for v, c in part.items()
                )
                / _SCALE
            )

        whole, forward = value(self.coef), value(self.forward_coef)
        length = {"forward": forward, "backward": whole - forward}
        hides: dict[tuple[str, int], float] = defaultdict(float)
        for (_, part, axis), pool in self.hide_coef.items():
            hides[(part, axis)] += value(pool)
        others = {k: value(pool) for k, pool in self.axis_coef.items()}
        exposed = dict.fromkeys(PARTS, 0.0)
        scales = {}
        for (part, axis), h in hides.items():
            shown = max(0.0, h - (length[part] - others.get((part, axis), 0.0)))
            exposed[part] = max(exposed[part], shown)
            scales[(part, axis)] = shown / h if h > 0 else None
        # the step's length has each step of the buckets' chains over several axes beside
        # the compute on its axis, as the hiding terms; the shares are those of the plan
        # with the chains whole (the ILP counts them so, "Overlap")
        multi = {k: value(pool) for k, pool in self.multi_coef.items()}
        if not any(multi.values()):
            return whole + sum(exposed.values()), scales
        # (B_pa without the chains: their pairs' whole time on each axis they run on)
        chains = {v for pool in self.multi_coef.values() for v in pool}
        for key, pool in self.axis_coef.items():
            others[key] -= value({v: c for v, c in pool.items() if v in chains})
        chained = dict.fromkeys(PARTS, 0.0)
        for (part, _), h in multi.items():
            chained[part] += h
        length = {p: length[p] - chained[p] for p in PARTS}
        exposed = dict.fromkeys(PARTS, 0.0)
        for key in set(hides) | set(multi):
            part = key[0]
            h = hides.get(key, 0.0) + multi.get(key, 0.0)
            exposed[part] = max(exposed[part], h - (length[part] - others.get(key, 0.0)))
        return whole - sum(chained.values()) + sum(exposed.values()), scales

    # -- reading back ------------------------------------------------------------------------

    def value(self, v) -> float:
        """Variable ``v`` in the solution: the last solve's, or the one ``restore`` set (0
        for a variable made after it was held: a later round's memory cuts make a fold
        group's r at its first use, ``remat_var``, and the held plan checkpoints none of
        what it did not have)."""
        if self.held is None:
            return v.solution_value()
        values = self.held[0]
        i = self._index.get(v)
        if i is None:
            i = self._index[v] = v.index()
        return values[i] if i < len(values) else 0.0

    def objective_value(self) -> tuple[float, float]:
        """The solution's objective and the solver's best bound, in the objective's units."""
        if self.held is not None:
            return self.held[1], self.held[2]
        obj = self.lp.Objective()
        return obj.Value(), obj.BestBound()

    def hold(self) -> tuple[list[float], float, float]:
        """The solution as it stands, to ``restore`` after a later solve."""
        if self.held is not None:
            return self.held
        return ([v.solution_value() for v in self.lp.variables()], *self.objective_value())

    def restore(self, held: tuple[list[float], float, float]) -> None:
        """Read ``held`` as the solution (no solve)."""
        self.held = held

    def inner_names(self) -> list[str]:
        """The names of the nodes whose op can run collectives inside itself under some
        strategy (``_inner_collectives``: an attention kernel's forward and backward, a
        cross-entropy's ops), sorted (made once: two a layer at most, of the ~190 nodes of
        a GPT layer's step)."""
        if self._inner_names is None:
            targets = self.space.targets
            self._inner_names = sorted(
                n
                for n in self.space.order
                if targets[n] in rules.ATTENTION_Q or targets[n] in vocab.CLASS_OPS
            )
        return self._inner_names

    def choice(self) -> dict[str, int]:
        """Node name -> the index of the strategy the solver set (every node; one dict per
        held solution, read only)."""
        return self._once("choice", self._choice)

    def _choice(self) -> dict[str, int]:
        rep_choice = {}
        for name, vs in self.x.items():
            vals = [sum(self.value(v) for v in group) for group in vs]
            rep_choice[name] = max(range(len(vals)), key=lambda k: vals[k])
        rep_of = self.folding.rep_of
        return {name: rep_choice[rep_of.get(name, name)] for name in self.space.order}


def build_ilp(
    space: StrategySpace,
    profile: DeviceProfile,
    *,
    solver: str,
    **options,
) -> IlpBuilder:
    """The whole ILP of the module docstring: variables, constraints and objective.

    ``ilp.times`` gets ``cost_s`` (the node variables, where the cost model prices every
    strategy) and ``build_s`` (the rest)."""
    t0 = time.perf_counter()
    ilp = IlpBuilder(space, profile, solver=solver, **options)
    ilp.node_variables()
    t_nodes = time.perf_counter()
    ilp.edge_variables()
    ilp.output_terms()
    ilp.tie_constraints()
    ilp.objective()
    ilp.times = {
        "cost_s": round(t_nodes - t0, 6),
        "build_s": round(time.perf_counter() - t_nodes, 6),
    }
    return ilp


def _text(ps) -> str | None:
    return None if ps is None else ",".join(placement_str(p) for p in ps)


def pin_node(ilp: IlpBuilder, pin: Pin) -> None:
    """``pin.node`` takes one of the strategies that agree with ``pin``: its first output
    placed as ``pin.out`` (and its inputs as ``pin.ins``, when given)."""
    space, r = ilp.space, ilp.folding.rep(pin.node)
    if pin.node not in space.strategies:
        raise ValueError(f"pin: no node {pin.node!r} in the step graph")
    ks = [
        k
        for k, st in enumerate(space.strategies[r])
        if st.out and _text(st.out[0]) == pin.out
        and (pin.ins is None or tuple(_text(i) for i in st.ins) == pin.ins)
    ]  # fmt: skip
    if not ks:
        offered = sorted(
            {str(_text(st.out[0])) for st in space.strategies[r] if st.out and st.out[0]}
        )
        raise ValueError(
            f"{pin.why or pin.node}: no strategy places it {pin.out}"
            + ("" if pin.ins is None else f" from inputs {pin.ins}")
            + f"; it may take {', '.join(str(o) for o in offered)}"
        )
    chosen = list(dict.fromkeys(v for k in ks for v in ilp.x[r][k]))
    ilp.lp.Add(sum(chosen) == 1)


def freeze_axes(ilp: IlpBuilder, frozen: Mapping[int, Collection[str]]) -> None:
    """No edge between operators runs a collective on a frozen mesh axis, but those out of
    the axis's allowed nodes, those of a scalar (a mean loss's token count, which the
    backward needs whole) and the reductions of a gradient before its cast (its pairs that
    would are fixed to 0); the step's outputs stay free, but on an axis whose allowed nodes
    hold ``SEALED``, where none runs one either (every rank runs the whole step)."""
    space = ilp.space

    def close(axis: int, pairs, tensor: tuple[str, int]) -> None:
        """Each of ``pairs`` (variable, p, q) whose collectives run on ``axis``: never."""
        shape, dtype = space.tensor(*tensor)
        for var, p, q in pairs:
            if p[axis] == q[axis]:
                continue
            colls = redistribute_collectives(p, q, shape, dtype, space.mesh.shape)
            if any(c.axis == axis for c in colls):
                var.SetUb(0.0)

    for axis, allowed in frozen.items():
        if SEALED in allowed:
            for src, src_out, pairs, _ in ilp.sink_pairs:
                close(axis, pairs, (src, src_out))
    for (src, src_out, dst, _), pairs in ilp.pairs.items():
        if space.reduce_at.get(dst) is not None:
            continue
        if math.prod(space.tensor(src, src_out)[0]) <= 1:
            continue  # a scalar: the loss's token count (DDP reduces it too)
        for axis, allowed in frozen.items():
            if src not in allowed:
                close(axis, pairs, (src, src_out))


def forbid_choice(ilp: IlpBuilder, choice: Sequence[tuple[str, str]]) -> None:
    """Not all of ``choice``'s nodes keep their placement (``solve``'s ``forbid``).

    A node's placement is the text of its first output's placements (``"S(0),R"``); the
    nodes of one fold group share their variables, so each group counts once."""
    space, rep = ilp.space, ilp.folding.rep
    terms: dict[str, list] = {}
    for node, text in choice:
        if node not in space.strategies:
            raise ValueError(f"forbid: no node {node!r} in the step graph")
        r = rep(node)
        if r in terms:
            continue
        ks = [k for k, st in enumerate(space.strategies[r]) if st.out and _text(st.out[0]) == text]
        if not ks:
            raise ValueError(f"forbid: node {node!r} has no strategy placing its output {text}")
        terms[r] = list(dict.fromkeys(v for k in ks for v in ilp.x[r][k]))
    ilp.lp.Add(sum(v for vs in terms.values() for v in vs) <= len(terms) - 1)


def _parameters(
    lp: pywraplp.Solver, solver: str, mip_gap: float, *, quiet: bool = False
) -> pywraplp.MPSolverParameters:
    """The solve's parameters: the gap, and (``quiet``) no output from HiGHS itself."""
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, mip_gap)
    if solver.upper() == "HIGHS":
        # NOTE: OR-Tools' HiGHS interface drops RELATIVE_MIP_GAP (it keeps no parameters of
        # its own, and answers False here) but hands this string to HiGHS, which reads it
        # before it prints anything (tests/unit/test_solve.py: a bad value is refused)
        lp.SetSolverSpecificParametersAsString(
            f"mip_rel_gap={mip_gap!r}" + (",output_flag=false" if quiet else "")
        )
    return params


def _run(ilp: IlpBuilder, time_limit_s: float, mip_gap: float) -> int:
    ilp.held = None
    model = linear_solver_pb2.MPModelProto()
    ilp.lp.ExportModelToProto(model)
    t0 = time.perf_counter()
    # a fold group's checkpointing flag: branches on it, each an ILP (``_by_checkpointing``);
    # the relaxation with the flags free is not tried first (its big-M terms are not
    # integral where a cut binds; Llama-3-8B over (2, 4): 1.7 s of the round's 43.0 s)
    flags = [r.index() for r, *_ in ilp.remat.values()]
    split = _by_checkpointing(model, flags, ilp.solver, time_limit_s, mip_gap)
    if split is not None:
        status, held = split
        if held is not None:
            ilp.restore(held)
        return status
    held = _relaxed(model, ilp.solver, time_limit_s, presolve=_relax_presolve(ilp))
    if held is not None:
        ilp.restore(held)
        return pywraplp.Solver.OPTIMAL
    ilp.lp.SetTimeLimit(_left_ms(time_limit_s, t0))
    params = _parameters(ilp.lp, ilp.solver, mip_gap)
    with _quiet_stdout():
        status = ilp.lp.Solve(params)
    if _solved(status):  # (held: what each round reads of it is made once, ``_once``)
        ilp.restore(ilp.hold())
    return status


def _run_beside(
    ilp: IlpBuilder, time_limit_s: float, mip_gap: float, meanwhile: Callable[[], Any] | None
) -> int:
    """``_run``; ``meanwhile``: the caller's work, done on this thread while the solve runs
    on another (the solver holds no lock of Python's: the two overlap on two cores). What
    it prints to the process's stdout is lost: the solve holds fd 1 (``_quiet_stdout``)."""
    if meanwhile is None:
        return _run(ilp, time_limit_s, mip_gap)
    return _beside(lambda: _run(ilp, time_limit_s, mip_gap), meanwhile)


def _beside(run: Callable[[], Any], meanwhile: Callable[[], Any]) -> Any:
    """``run()`` on a thread while ``meanwhile()`` runs on this one; ``run``'s result (its
    exception raised here)."""
    out: list = []

    def target() -> None:
        try:
            out.append((True, run()))
        except BaseException as e:  # raised again on the caller's thread
            out.append((False, e))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        meanwhile()
    finally:
        thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


INTEGRAL_TOL = 1e-9  # how far from 0 or 1 an integer variable of the relaxation may lie


def _relax_presolve(ilp: IlpBuilder) -> bool:
    """Whether the relaxation tried before the ILP (``_relaxed``) runs HiGHS's presolve:
    only where the ILP has memory cuts. Without them HiGHS's presolve took longer than the
    simplex it spared: the search's relaxations (search_scaling's GPT at 12 and 96 layers
    over (8, 8); GPT-3 over (16, 8); Llama-3-8B over (8) and (2, 4), bf16, H100; the tests'
    GPTs) solved in 0.012-0.56 s without it against 0.022-1.28 s with it, to the same
    objective and an integral solution each time; Llama-3-8B's search over (8, 8) (bf16,
    traced once) took 4.9-5.5 s instead of 7.8-8.4 s, the same plan. With cuts it is kept:
    the relaxations of GPT-3's and the tests' cut rounds took 1.4-2.4 times as long
    without it (Llama-3-8B's over (2, 4) took less, 0.79-2.22 s against 1.59-2.35 s)."""
    return bool(ilp.cuts)


def _left_ms(time_limit_s: float, t0: float) -> int:
    """Milliseconds left of ``time_limit_s`` since ``t0`` (the relaxation took the rest), at
    least one second's."""
    return int(max(time_limit_s - (time.perf_counter() - t0), 1.0) * 1000)


def _relaxation(
    model: linear_solver_pb2.MPModelProto,
    solver: str,
    time_limit_s: float,
    *,
    presolve: bool = True,
) -> tuple[int, list[float], float]:
    """The linear relaxation of ``model`` (every variable continuous), solved: its status,
    its values and its objective (``math.inf`` where infeasible, ``-math.inf`` where
    unsolved: a minimization's bound either way). ``presolve``: False solves it without
    HiGHS's presolve (``_relax_presolve``)."""
    relaxed = linear_solver_pb2.MPModelProto()
    relaxed.CopyFrom(model)
    for v in relaxed.variable:
        v.is_integer = False
    lp = pywraplp.Solver.CreateSolver(solver)
    if lp is None or lp.LoadModelFromProto(relaxed):
        return pywraplp.Solver.NOT_SOLVED, [], -math.inf
    lp.SuppressOutput()
    if solver.upper() == "HIGHS":
        # (not _quiet_stdout: a solve beside the caller's runs this on another thread, and
        # two threads swapping fd 1 can leave it closed; HiGHS reads this before its banner)
        lp.SetSolverSpecificParametersAsString(
            "output_flag=false" + ("" if presolve else ",presolve=off")
        )
    lp.SetTimeLimit(int(time_limit_s * 1000))
    status = lp.Solve()
    if status != pywraplp.Solver.OPTIMAL:
        return status, [], math.inf if status == pywraplp.Solver.INFEASIBLE else -math.inf
    return status, [v.solution_value() for v in lp.variables()], lp.Objective().Value()


def _relaxed(
    model: linear_solver_pb2.MPModelProto,
    solver: str,
    time_limit_s: float,
    *,
    presolve: bool = True,
) -> tuple[list[float], float, float] | None:
    """The ILP's linear relaxation solved (every variable continuous): its solution, held
    (``IlpBuilder.hold``), where every integer variable came out integral, which makes it
    the ILP's optimum; else None (the ILP is solved as one; module docstring).
    ``presolve``: as ``_relaxation``'s."""
    status, values, value = _relaxation(model, solver, time_limit_s, presolve=presolve)
    if status != pywraplp.Solver.OPTIMAL:
        return None
    integer = [i for i, v in enumerate(model.variable) if v.is_integer]
    if any(abs(values[i] - round(values[i])) > INTEGRAL_TOL for i in integer):
        return None
    for i in integer:
        values[i] = float(round(values[i]))
    return values, value, value


def _fixed(
    model: linear_solver_pb2.MPModelProto, values: Mapping[int, float]
) -> linear_solver_pb2.MPModelProto:
    """A copy of ``model`` with each variable of ``values`` (its index) fixed at its value."""
    out = linear_solver_pb2.MPModelProto()
    out.CopyFrom(model)
    for i, value in values.items():
        out.variable[i].lower_bound = out.variable[i].upper_bound = value
    return out


def _solve_copy(
    model: linear_solver_pb2.MPModelProto,
    solver: str,
    time_limit_s: float,
    mip_gap: float,
    *,
    relax_first: bool = True,
    presolve: bool = True,
) -> tuple[int, tuple[list[float], float, float] | None]:
    """``model`` solved on a solver of its own: its relaxation (``relax_first``; with
    HiGHS's presolve or not, ``presolve``), then the ILP itself, loaded only where that
    is not integral. ``(status, held)``, ``held`` as
    ``IlpBuilder.hold`` gives it (None where there is no plan). Prints nothing (the
    process's stdout is left alone: ``_SolveBeside``'s copies run beside the caller's
    thread)."""
    t0 = time.perf_counter()
    if relax_first:
        relaxed = _relaxed(model, solver, time_limit_s, presolve=presolve)
        if relaxed is not None:
            return pywraplp.Solver.OPTIMAL, relaxed
    lp = pywraplp.Solver.CreateSolver(solver)
    error = lp.LoadModelFromProto(model)
    if error:
        raise RuntimeError(f"the ILP's copy did not load: {error}")
    lp.SuppressOutput()
    params = _parameters(lp, solver, mip_gap, quiet=True)
    lp.SetTimeLimit(_left_ms(time_limit_s, t0))
    status = lp.Solve(params)
    if not _solved(status):
        return status, None
    obj = lp.Objective()
    return status, ([v.solution_value() for v in lp.variables()], obj.Value(), obj.BestBound())


def _by_checkpointing(
    model: linear_solver_pb2.MPModelProto,
    flags: Sequence[int],
    solver: str,
    time_limit_s: float,
    mip_gap: float,
) -> tuple[int, tuple[list[float], float, float] | None] | None:
    """The ILP ``model`` solved as branches on its fold groups' checkpointing flags r
    (``flags``: their indices; "Checkpointing", module docstring), each branch an ILP with
    every r fixed. A relaxation bounds each branch: with one group, the relaxations at r = 0
    and at r = 1 (solved beside each other, ``BESIDE_SOLVERS``) order the two branches, and
    the ILP of the lower is solved first; the other's is solved only where its bound is
    below that plan's objective (within ``mip_gap``), and the better plan of the two is the
    ILP's. With several groups, the ILP with every r = 0 is solved first, and beside it,
    for each group, the relaxation with its r = 1 (the others free), a bound on every plan
    that checkpoints the group; a group whose bound is not below the first plan's objective
    is not checkpointed; where one group is left, the ILP with its r = 1 and the others 0
    is the second branch. ``(status, held)`` as ``_solve_copy`` gives them, the best bound
    the least of the branches'; None where there is no r, or two groups or more are left
    (the ILP is solved whole). The branches' ILPs are solved without trying their
    relaxation first: under memory cuts it is seldom integral."""
    if not flags:
        return None
    deadline = time.perf_counter() + time_limit_s

    def left() -> float:
        return max(deadline - time.perf_counter(), 1.0)

    def branch(ones: Collection[int]) -> tuple[int, tuple[list[float], float, float] | None]:
        """The ILP with the flags of ``ones`` at 1 and the others at 0."""
        fixed = _fixed(model, {i: float(i in ones) for i in flags})
        return _solve_copy(fixed, solver, left(), mip_gap, relax_first=False)

    def bound(values: Mapping[int, float]) -> float:
        return _relaxation(_fixed(model, values), solver, left())[2]

    def both(run: Callable[[], Any], meanwhile: Callable[[], Any]) -> Any:
        """``run()``, with ``meanwhile()`` beside it where the solver allows (else after)."""
        if solver.upper() in BESIDE_SOLVERS:
            return _beside(run, meanwhile)
        out = run()
        meanwhile()
        return out

    # the branches not solved first: the flags each sets to 1, and its relaxation's bound
    rest: list[tuple[tuple[int, ...], float]] = []
    if len(flags) == 1:
        (flag,) = flags
        zero: list[float] = []
        one = both(lambda: bound({flag: 1.0}), lambda: zero.append(bound({flag: 0.0})))
        # the lower bound first (r = 0 where they tie); a branch without a plan is +inf
        (first, _), other = sorted([((), zero[0]), ((flag,), one)], key=lambda b: b[1])
        rest.append(other)
        status, held = branch(first)
    else:
        ones: list[float] = []
        status, held = both(lambda: branch(()), lambda: ones.extend(bound({i: 1.0}) for i in flags))
        rest += [((i,), b) for i, b in zip(flags, ones)]
    if held is None and status != pywraplp.Solver.INFEASIBLE:
        return status, None  # (the clock stopped it with no plan in hand)
    best = math.inf if held is None else held[1]
    cutoff = best if math.isinf(best) else best - mip_gap * abs(best)
    bounds = [math.inf if held is None else held[2]]  # each branch's, or a left-out one's
    left_open = [(o, b) for o, b in rest if b < cutoff]
    bounds += [b for _, b in rest if b >= cutoff]
    if len(left_open) > 1:
        return None
    if not left_open:
        if held is None:
            return pywraplp.Solver.INFEASIBLE, None
        return status, (held[0], held[1], min(bounds))
    ((second, open_bound),) = left_open
    status1, held1 = branch(second)
    if held1 is not None:
        bounds.append(held1[2])
    elif status1 != pywraplp.Solver.INFEASIBLE:
        bounds.append(open_bound)  # (stopped by the clock: its relaxation bounds it)
    plans = [h for h in (held, held1) if h is not None]
    if not plans:
        both_infeasible = status == status1 == pywraplp.Solver.INFEASIBLE
        return (pywraplp.Solver.INFEASIBLE if both_infeasible else status1), None
    values, value, _ = min(plans, key=lambda h: h[1])
    exact = {status, status1} <= {pywraplp.Solver.OPTIMAL, pywraplp.Solver.INFEASIBLE}
    status = pywraplp.Solver.OPTIMAL if exact else pywraplp.Solver.FEASIBLE
    return status, (values, value, min(bounds))


BESIDE_SOLVERS = ("HIGHS",)
"""Solvers whose rounds run on threads beside each other (``_SolveBeside``): HiGHS lets go
of Python's lock while it solves and takes ``output_flag`` before it prints its banner, so
a copy solves without the process's stdout sent to /dev/null (``_quiet_stdout``)."""


class _SolveBeside:
    """The ILP as it stands with its hiding terms at other shares, solved on a thread beside
    the caller's own work: a copy of the model, which a second core solves while the first
    solves or simulates another round ("Overlap"). ``result`` waits for it and gives
    ``(status, held)``, ``held`` as ``IlpBuilder.hold`` gives it (None where unsolved). A
    copy no round reads is left to finish on its own (a daemon thread, printing nothing).
    The caller's thread only copies the model and sets the objective; the thread solves the
    relaxation, and loads and solves the ILP itself only where that is not integral."""

    def __init__(
        self,
        ilp: IlpBuilder,
        hide_scale: Mapping[tuple[str, int], float],
        time_limit_s: float,
        mip_gap: float,
    ):
        self.solver, self._model = ilp.solver, ilp.model_at(hide_scale)
        self._mip_gap, self._presolve = mip_gap, _relax_presolve(ilp)
        self._out: tuple[int, tuple[list[float], float, float] | None] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._solve, args=(time_limit_s,), daemon=True)
        self._thread.start()

    def _solve(self, time_limit_s: float) -> None:
        try:
            self._out = _solve_copy(
                self._model, self.solver, time_limit_s, self._mip_gap, presolve=self._presolve
            )
        except BaseException as e:  # raised again by result, on the caller's thread
            self._error = e

    def result(
        self, idle: Callable[[], Any] | None = None
    ) -> tuple[int, tuple[list[float], float, float] | None]:
        """``(status, held)``; ``idle`` is run first where the solve has not ended."""
        if idle is not None and self._thread.is_alive():
            idle()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out


def _solved(status: int) -> bool:
    return status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)


def read_solution(
    ilp: IlpBuilder, status: int, stats: dict, time_limit_s: float, like: Solution | None = None
) -> Solution:
    """The chosen strategies, their compute time, and the collectives of the chosen edges.

    A solve stopped by the time limit (status FEASIBLE) is said so: ``stats["status"]`` is
    ``time_limit``, with the incumbent and the best bound, and the solution carries a
    warning. ``like``: this solution as read before, from the same values (an overlap
    round's, held and restored: ``IlpBuilder.kept``); its plan is taken, and only the
    statistics and warnings are made again (reading one is linear in the step's nodes)."""
    read = _read(ilp) if like is None else like
    warnings = []
    extra = {k: read.stats[k] for k in ("recompute_s", "recomputed_layers") if k in read.stats}
    if status != pywraplp.Solver.OPTIMAL:
        incumbent, bound = (v / _SCALE for v in ilp.objective_value())
        gap = (incumbent - bound) / incumbent if incumbent > 0 else 0.0
        extra.update(incumbent=incumbent, best_bound=bound, gap=gap)
        warnings.append(
            f"the solver stopped at its time limit of {time_limit_s:.0f} s with a plan of "
            f"{incumbent * 1e3:.4f} ms, at most {gap:.1%} above the best bound "
            f"({bound * 1e3:.4f} ms): raise time_limit_s for a better plan"
        )
    stats = {
        "solver": ilp.solver,
        "status": "optimal" if status == pywraplp.Solver.OPTIMAL else "time_limit",
        "solver_nodes": len(ilp.folding.reps),
        "merged_nodes": len(ilp.merged),
        "edge_variables": ilp.n_edge_vars,
        "variables": ilp.lp.NumVariables(),
        "constraints": ilp.lp.NumConstraints(),
        **extra,
        **stats,
    }
    return replace(read, stats=stats, warnings=warnings)


def _read(ilp: IlpBuilder) -> Solution:
    """``read_solution``'s plan of the held values: its statistics only the recomputed
    layers' (``recompute_s``, ``recomputed_layers``), no warnings."""
    mesh, profile = ilp.space.mesh, ilp.profile
    choice = dict(ilp.choice())
    rep_of, node_cost = ilp.folding.rep_of, ilp.node_cost
    node_cost_s = {n: node_cost[rep_of.get(n, n)][k] for n, k in choice.items()}
    compute_s = sum(node_cost_s.values())
    collectives: list[tuple[str, Collective, float]] = []
    comm_s = 0.0
    for t in ilp.edge_terms:
        var = t.var
        val = sum(ilp.value(v) for v in var) if isinstance(var, list) else ilp.value(var)
        if val > 0.5:
            comm_s += t.cost_s * len(t.labels)
            colls = reshard_collectives(
                t.src_ps, t.dst_ps, t.shape_dtype[0], t.shape_dtype[1], mesh, profile
            )
            # (priced once for the term's edges: a fold group's, one per instance)
            priced = [(coll, collectives_time([coll], mesh, profile)) for coll in colls]
            for label in t.labels:
                collectives.extend((label, coll, time_s) for coll, time_s in priced)
    # an instance of a fold group runs what its representative's call runs (priced once
    # per representative and strategy); the nodes in name order
    inner: dict[tuple[str, int], list[tuple[Collective, float]]] = {}
    for n in ilp.inner_names():
        r, k = rep_of.get(n, n), choice[n]
        runs = inner.get((r, k))
        if runs is None:
            runs = inner[(r, k)] = [
                (coll, collectives_time([coll], mesh, profile))
                for coll in _inner_collectives(ilp.space, r, ilp.space.strategies[n][k])
            ]
        if runs:
            collectives.extend((f"{n}->{n}", coll, t) for coll, t in runs)
    chosen = ilp.recomputed()
    recompute: list[Recompute] = []
    recompute_s = 0.0
    for g in sorted(chosen):
        _, _, nodes, edges = ilp.remat[g]
        compute_s += sum(c * ilp.value(v) for v, c in nodes.items()) / _SCALE
        comm_s += sum(c * ilp.value(v) for v, c in edges.items()) / _SCALE
        recompute_s += sum(c * ilp.value(v) for part in (nodes, edges) for v, c in part.items())
        for rec in ilp.lv.groups[g] if ilp.lv is not None else ():
            recompute.append(rec)
            collectives.extend(_recomputed_collectives(ilp, rec))
    stats = {}
    if chosen:
        stats["recompute_s"] = recompute_s / _SCALE
        stats["recomputed_layers"] = len(recompute)
    # where buckets overlap the backward, the step's length with them ("Overlap")
    step_s = ilp.overlap()[0] if ilp.hide_coef else compute_s + comm_s
    params = len(set(ilp.space.params.values()))
    host = _host_times(ilp.space, profile)
    if profile.host_clock:  # the host's own clock (core/schedule), no choice changes it
        runtime_s = 0.0
        host_start_s = profile.step_overhead
        host_end_s = profile.param_overhead * params
        objective_s = max(step_s, host_start_s + sum(host.values()) + host_end_s)
    else:  # the host's fixed time per step on the step's one clock (the CPU's)
        runtime_s = profile.step_overhead + profile.param_overhead * params
        host_start_s = host_end_s = 0.0
        objective_s = step_s + runtime_s
    return Solution(
        runtime_s=runtime_s,
        host_s=host,
        host_start_s=host_start_s,
        host_end_s=host_end_s,
        choice=choice,
        objective_s=objective_s,
        compute_s=compute_s,
        comm_s=comm_s,
        collectives=collectives,
        node_cost_s=node_cost_s,
        stats=stats,
        recompute=recompute,
    )


def _recomputed_collectives(ilp: IlpBuilder, rec: Recompute) -> list[tuple[str, Collective, float]]:
    """The collectives the copies of ``rec``'s nodes run again: the chosen pairs of the
    edges into them."""
    space, rep = ilp.space, ilp.folding.rep
    found = []
    for n in rec.nodes:
        for j, (src, so) in enumerate(space.in_sources[n]):
            for ev, p, q in ilp.pairs.get((rep(src), so, rep(n), j), ()):
                if p == q or ilp.value(ev) < 0.5:
                    continue
                shape, dtype = space.tensor(src, so)
                for coll in reshard_collectives(p, q, shape, dtype, space.mesh, ilp.profile):
                    t = collectives_time([coll], space.mesh, ilp.profile)
                    found.append((f"{src}->{n} (recomputed)", coll, t))
    return found


MAX_ROUNDS = 16
"""Rounds of the cutting-plane loop (module docstring, "Memory")."""


def within(budget: float) -> float:
    """What a plan may exceed a memory bound by: the solver's feasibility tolerance, in
    bytes."""
    return 1e-9 * budget + 64


CUT_SPANS = 4
"""A round bounds the highest point of each of this many equal spans of the step, besides
the peak and the other half's highest point (module docstring, "Memory")."""


def _new_cuts(ilp: IlpBuilder, report: MemoryReport, bound: float) -> list[int]:
    """Points of ``report`` above ``bound`` to bound next: the peak, the highest point of
    the other half of the step (forward, backward), and the highest of each of
    ``CUT_SPANS`` spans of it, if not bounded yet."""
    space = ilp.space
    totals = [t for _, t in report.timeline]
    backward = [space.roles.get(n, roles.BACKWARD) == roles.BACKWARD for n, _ in report.timeline]
    peak = report.peak_index
    other = [k for k in range(len(totals)) if backward[k] != backward[peak]]
    ks = [peak]
    if other:
        ks.append(max(other, key=lambda k: totals[k]))
    n = len(totals)
    for j in range(CUT_SPANS):
        span = range(j * n // CUT_SPANS, (j + 1) * n // CUT_SPANS)
        if len(span):
            ks.append(max(span, key=lambda k: totals[k]))
    points = dict.fromkeys(report.points[k] for k in ks if totals[k] > bound)
    return [i for i in points if i not in ilp.cuts]


class _Lives:
    """The step the solver measures its plans on ("Checkpointing"): as traced, until a plan
    exceeds the budget (``widen``); then, where the solver may checkpoint, the step in
    which any layer may be (passes/remat ``candidates``), kept from then on."""

    def __init__(self, space: StrategySpace, checkpointing: bool) -> None:
        self.space, self.checkpointing, self.wide = space, checkpointing, False
        self._now: Liveness | None = None

    @property
    def now(self) -> Liveness:
        """The step measured now (made where first read: ``solve`` reads it while its
        first solve runs)."""
        if self._now is None:
            self._now = liveness(self.space)
        return self._now

    def widen(self) -> bool:
        """Whether the step measured changed (the candidates added: measure again)."""
        if self.wide or not self.checkpointing:
            return False
        self.wide = True
        self._now = liveness(self.space, remat.candidates(self.space))
        return True


@dataclass(frozen=True)
class _PeakBound:
    """In place of a round's ``MemoryReport`` where a bound of its peak fits the budget
    (``IlpBuilder.peak_bound``): at least its peak, not measured."""

    peak_bytes: int


def _bounded(
    ilp: IlpBuilder,
    lives: _Lives,
    budget: float,
    time_limit_s: float,
    mip_gap: float,
    meanwhile: Callable[[], Any] | None = None,
) -> tuple[int, MemoryReport | None]:
    """Solve, then bound the points where the plan's step memory exceeds ``budget`` and solve
    again, until it fits (module docstring, "Memory"). Returns the last status and the
    plan's memory (None if the solver found no plan). ``meanwhile``: done while the first
    solve runs (``_run``)."""
    deadline = time.perf_counter() + time_limit_s
    report = None
    for round_ in range(MAX_ROUNDS):
        status = _run_beside(ilp, max(deadline - time.perf_counter(), 1.0), mip_gap, meanwhile)
        meanwhile = None
        if not _solved(status):
            return status, None
        report = ilp.evaluate(lives.now)
        points = _new_cuts(ilp, report, budget)
        if points and lives.widen():  # the cuts are made on the step that may checkpoint
            report = ilp.evaluate(lives.now)
            points = _new_cuts(ilp, report, budget)
        value, best_bound = ilp.objective_value()
        log.info(
            "autopar: solve round %d: %.4f ms (bound %.4f ms), peak %.2f of %.2f MiB "
            "per rank%s; %d variables, %d constraints",
            round_ + 1,
            value / _SCALE * 1e3,
            best_bound / _SCALE * 1e3,
            report.peak_bytes / _MIB,
            budget / _MIB,
            f": bounding {len(points)} more points" if points else ": fits",
            ilp.lp.NumVariables(),
            ilp.lp.NumConstraints(),
        )
        if not points:
            return status, report
        for i in points:
            ilp.memory_cut(lives.now, i, budget)
    return status, report


def smallest_budget(
    space: StrategySpace,
    profile: DeviceProfile,
    lv: Liveness,
    *,
    solver: str,
    time_limit_s: float,
    optimizer: str = "adamw",
    **options,
) -> MemoryReport | None:
    """The step memory of the plan with the smallest peak per rank the ILP allows: the
    ILP without a budget, minimizing a bound M on bytes(i) at the points the loop adds
    (module docstring, "Memory"). None if the solver finds no plan in ``time_limit_s``."""
    ilp = build_ilp(space, profile, solver=solver, optimizer=optimizer, **options)
    bound = ilp.lp.NumVar(0.0, ilp.lp.infinity(), "peak_mib")
    ilp.objective({bound: 1.0})
    deadline = time.perf_counter() + time_limit_s
    best = None
    for _ in range(4 * MAX_ROUNDS):
        if not _solved(_run(ilp, max(deadline - time.perf_counter(), 1.0), 0.0)):
            return best
        report = ilp.evaluate(lv)
        if best is None or report.peak_bytes < best.peak_bytes:
            best = report
        points = _new_cuts(ilp, report, ilp.value(bound) * _MIB)
        if not points:
            return best
        for i in points:
            ilp.memory_cut(lv, i, bound)
    return best


def state_floor(space: StrategySpace, optimizer: str = "adamw", pins: Sequence[Pin] = ()) -> int:
    """Bytes per rank below which no plan's step memory goes, whatever its placements: the
    parameters and their optimizer state ("Memory", module docstring: passes/memory holds
    every parameter through the whole step and counts its state at every point), each
    tensor at the least a rank can hold of it, an equal share over every rank of the mesh
    (a placement holds at least ceil(numel / ranks) of its elements on some rank); a
    parameter ``pins`` place, at what its placement holds on a rank."""
    return _state_share(space, optimizer, math.prod(space.mesh.shape), _pinned(space, pins))


def _pinned(space: StrategySpace, pins: Sequence[Pin]) -> dict[str, Placements]:
    """The placements ``pins`` give the step's parameters (the first pin of each)."""
    out: dict[str, Placements] = {}
    for pin in pins:
        if pin.node in out or space.roles.get(pin.node) != roles.PARAM:
            continue
        for st in space.strategies.get(pin.node, ()):
            ps = st.out[0] if st.out else None
            if ps is not None and _text(ps) == pin.out:
                out[pin.node] = ps
                break
    return out


def _state_share(
    space: StrategySpace,
    optimizer: str,
    ranks: int,
    pinned: Mapping[str, Placements] | None = None,
) -> int:
    """The parameters and their optimizer state, each split evenly over ``ranks``, or as
    ``pinned`` places it."""
    per_element = state_bytes_per_element(optimizer)
    mesh_shape = tuple(space.mesh.shape)
    share = 0
    for node in dict.fromkeys(space.params.values()):
        if node in space.aliases or space.roles[node] != roles.PARAM:
            continue  # (a tied parameter is stored once)
        shape, dtype = space.tensor(node)
        if pinned and node in pinned:
            elements = local_bytes(shape, dtype, pinned[node], mesh_shape) // dtype.itemsize
        else:
            elements = -(-math.prod(shape) // ranks)
        share += elements * (dtype.itemsize + per_element)
    return share


def _floor_error(
    budget: float, floor: int, space: StrategySpace, optimizer: str, pins: Sequence[Pin] = ()
) -> SolveError:
    ranks = math.prod(space.mesh.shape)
    pinned = _pinned(space, pins)
    if pinned:
        held = _state_share(space, optimizer, ranks, pinned) - _state_share(space, optimizer, ranks)
        how = (
            f"the {len(pinned)} pinned parameters as pinned ({held / _MIB:.1f} MiB more than "
            f"split evenly) and the others split evenly over all {ranks} ranks of the mesh"
        )
        advice = "shard the pinned parameters over more of the mesh, or use a larger budget"
    else:
        # (n ranks hold at least the whole state / n each: fewer than this cannot fit)
        whole = _state_share(space, optimizer, 1)
        more = f"a mesh of at least {math.ceil(whole / budget)} ranks, or " if budget > 0 else ""
        how = f"each split evenly over all {ranks} ranks of the mesh"
        advice = f"use {more}a larger budget"
    return SolveError(
        f"no plan fits the memory budget of {budget / _MIB:.1f} MiB per rank: the parameters "
        f"and their {optimizer} state alone take at least {floor / _MIB:.1f} MiB ({floor} "
        f"bytes) per rank, {how}, before any activation; {advice}",
        floor_bytes=floor,
    )


def _budget_error(
    budget: float, least: MemoryReport | None, time_limit_s: float, checkpointing: bool
) -> SolveError:
    if least is None:
        return SolveError(
            f"no plan fits the memory budget of {budget / _MIB:.1f} MiB per rank, and the "
            f"solver found none without it within {time_limit_s:.0f} s: raise time_limit_s, "
            "or the budget"
        )
    top = least.dominant()
    return SolveError(
        f"no plan fits the memory budget of {budget / _MIB:.1f} MiB per rank (the step's "
        f"peak, {least.optimizer} state included): the smallest budget that fits is "
        f"{least.peak_bytes / _MIB:.1f} MiB ({least.peak_bytes} bytes), whose largest part "
        f"is {top.replace('_', ' ')} ({least.at_peak[top] / _MIB:.1f} MiB at node "
        f"{least.peak_node}); raise the budget to at least that, "
        + (
            "or use a larger mesh" if checkpointing else "allow checkpointing, or use a larger mesh"
        ),
        least_bytes=least.peak_bytes,
    )


DEVICE_BUDGET = "device"
"""``memory_budget`` for the device profile's usable memory (``DeviceProfile.usable_memory``)."""


def solve(
    space: StrategySpace,
    *,
    time_limit_s: float = 600.0,
    solver: str | None = None,
    memory_budget: float | str | None = None,
    memory_fraction: float | None = None,
    optimizer: str = "adamw",
    reshard_axes: int | None = 1,
    merge: bool = True,
    mip_gap: float = MIP_GAP,
    checkpointing: bool = True,
    forbid: Sequence[Sequence[tuple[str, str]]] = (),
    pins: Sequence[Pin] = (),
    frozen: Mapping[int, Collection[str]] | None = None,
    assess: Callable[[Solution], float] | None = None,
    hides: Collection[str] = HIDES,
    meanwhile: Callable[[], Any] | None = None,
    idle: Callable[[], Any] | None = None,
) -> Solution:
    """Solve the ILP of the module docstring for ``space``.

    ``memory_budget``: the most bytes one rank may hold at any point of the step
    (passes/memory: parameters, gradients, ``optimizer`` state, activations, temporaries,
    collective buffers, inputs); ``DEVICE_BUDGET`` for the device profile's usable memory;
    None for no bound. ``memory_fraction``: instead, that fraction of what one device holds
    running the whole step (the plan that replicates everything).
    ``reshard_axes``: the most mesh axes an edge between two operators may change at once
    (None: no limit); graph outputs may always change every axis.
    ``merge``: simplification 1 (following nodes: a smaller ILP that can lose, module
    docstring); False gives every node its own variables and every edge all its pairs.
    ``mip_gap``: stop once the incumbent is within this fraction of the best bound.
    ``checkpointing``: the solver may recompute layers' activations in the backward where
    the budget binds ("Checkpointing"); False keeps every activation.
    ``forbid``: choices the plan may not make, each a sequence of ``(node, placements)``
    (the node's first output placement as text per mesh axis, ``"S(0),R"``): the plan
    changes at least one of them (``forbid_choice``). ``pins``: placements fixed before
    the search (passes/pins; ``pin_node``). ``frozen``: mesh axes on which no edge between
    operators runs a collective, but those out of the given nodes (``freeze_axes``).
    ``assess``: the length of the step a solution emits (seconds), by which the overlap's
    rounds are compared ("Overlap"); without it, by the objective's bound. ``hides``: the
    kinds of overlap the emitted step has (``FIRST_SHARE``'s keys: the buckets' kinds,
    where passes/buckets runs, and ``prefetch``, where passes/prefetch does).
    ``meanwhile``: the caller's work that reads no solution (what later stages make of the
    step alone), done on this thread while the first solve runs on another. ``idle``: the
    caller's work done on this thread where it would wait for an overlap round solved
    beside (passes/pipeline: what the memory stage makes of the shortest plan so far).
    """
    solver = solver or os.environ.get("AUTOPAR_SOLVER", "HIGHS")
    options = dict(merge=merge, reshard_axes=reshard_axes, hides=hides)
    profile = get_profile(space.mesh.device)
    bounded = memory_budget is not None or memory_fraction is not None
    lives = _Lives(space, checkpointing and bounded)
    budget: float | None
    if memory_fraction is not None:
        if memory_budget is not None:
            raise ValueError("give memory_budget or memory_fraction, not both")
        if not 0 < memory_fraction:
            raise ValueError(f"memory_fraction must be > 0, got {memory_fraction}")
        # nothing checkpointed: the whole step as one device runs it
        whole = measure(lives.now, lambda n, o: None, lambda n, j: None, optimizer).peak_bytes
        budget = memory_fraction * whole
    elif memory_budget == DEVICE_BUDGET:
        budget = profile.usable_memory
    elif isinstance(memory_budget, str):
        raise ValueError(f"memory_budget: bytes, {DEVICE_BUDGET!r} or None; got {memory_budget!r}")
    else:
        budget = None if memory_budget is None else float(memory_budget)
    if budget is not None:
        # a budget below the model's state is said at once, not after the rounds of cuts
        # and the smallest-budget ILP find that nothing fits ("Memory")
        floor = state_floor(space, optimizer, pins)
        if floor > budget + within(budget):
            raise _floor_error(budget, floor, space, optimizer, pins)

    def attempt(options: dict) -> tuple[IlpBuilder, int, MemoryReport | None]:
        ilp = build_ilp(space, profile, solver=solver, optimizer=optimizer, **options)
        check_folding(space, ilp.folding.rep, list(pins))
        for pin in pins:
            pin_node(ilp, pin)
        if frozen:
            freeze_axes(ilp, frozen)
        for choice in forbid:
            forbid_choice(ilp, choice)
        status, report = once(ilp)
        if ilp.hide_coef and _solved(status):
            # "Overlap": re-price what may hide at the share the last plan leaves unhidden;
            # keep the plan whose step (as emitted, where ``assess`` says) is the shortest
            step, scales = ilp.overlap()
            ilp, status, report = rounds_from(ilp, step, scales, status, report)
        if report is None and _solved(status):  # (no budget: the kept plan's, measured once)
            report = ilp.evaluate(lives.now)
        return ilp, status, report

    def rounds_from(
        ilp: IlpBuilder,
        step: float,
        scales: dict[tuple[str, int], float | None],
        status: int,
        report: MemoryReport | _PeakBound | None,
    ) -> tuple[IlpBuilder, int, MemoryReport | None]:
        """The overlap rounds after the first solve (``step``, ``scales``: its overlap).
        Where the solver can (``BESIDE_SOLVERS``), a round whose shares are known is solved
        beside the rounds before it are judged: the next round's once a round is solved,
        and the last round's (below) once the first is, where the first plan hides nothing
        in a part; each is read where the rounds reach it (``take``), as solved in place,
        and dropped where they stop before."""

        read: list[Solution | None] = [None]  # the last round's, as ``length`` read it

        def length(step: float) -> float:
            read[0] = None
            if assess is None:
                return step
            # (the solver's peak: passes/buckets measures only where buckets may pass it)
            stats = {"memory_budget": budget}
            if report is not None:
                stats["peak_bytes"] = report.peak_bytes
            solution = read[0] = read_solution(ilp, status, stats, time_limit_s)
            return assess(solution)

        def next_shares(scales: dict) -> dict[tuple[str, int], float] | None:
            counted = {k: ilp.hide_scale.get(k, _first_share(ilp, k)) for k in scales}
            # where the plan has none of it, halfway to nothing unhidden: taken whole, that
            # share (0) swings the plan from one extreme to the other
            shares = {k: counted[k] / 2 if v is None else v for k, v in scales.items()}
            if all(abs(shares[k] - counted[k]) < 0.05 for k in scales):
                return None  # settled
            return shares

        def ahead(shares: Mapping[tuple[str, int], float] | None) -> _SolveBeside | None:
            if shares is None or ilp.cuts or ilp.solver.upper() not in BESIDE_SOLVERS:
                return None  # (a memory cut: the rounds after solve with more of them)
            return _SolveBeside(ilp, shares, time_limit_s, mip_gap)

        last = {k: FIRST_SHARE["all_reduce"] for k in scales}
        shares = next_shares(scales) if OVERLAP_ROUNDS > 1 else None
        # the last round is read only where the kept plan hides nothing in a part: started
        # ahead where the first plan has such a part (in the zoo's and the tests' plans, a
        # first plan without one never kept one), else solved in place if it comes to it
        hides_nothing = any(v is None for v in scales.values())
        beside, beside_last = ahead(shares), ahead(last) if hides_nothing else None
        best = (length(step), ilp.hold(), dict(ilp.hide_scale), status, report, read[0])
        best_scales = scales
        rounds = [best[0]]
        for i in range(OVERLAP_ROUNDS - 1):
            if shares is None:
                break
            ilp.hide_scale = shares
            ilp.objective()
            status, report = once(ilp) if beside is None else take(ilp, beside)
            if not _solved(status):
                break
            step, scales = ilp.overlap()
            shares = next_shares(scales) if i + 2 < OVERLAP_ROUNDS else None
            beside = ahead(shares)
            rounds.append(length(step))
            if rounds[-1] >= best[0] * (1 - 1e-6):
                break  # no shorter: the rounds swing; the shortest so far is kept
            best = (rounds[-1], ilp.hold(), dict(ilp.hide_scale), status, report, read[0])
            best_scales = scales
        if not ilp.cuts and any(v is None for v in best_scales.values()):
            # where the kept plan hides nothing in a part of the step (no gathers ahead in
            # the forward: data parallelism), the rounds judged that part's share from a
            # plan without it; one more round prices every part's at an all-reduce
            # bucket's share, all alike, and is kept where its step is shorter. Not where
            # the memory budget binds (the ILP has cuts): there each round is several
            # solves (a golden plan's 46 s went to 72 s), and the plan shards already
            ilp.hide_scale = last
            ilp.objective()
            status, report = once(ilp) if beside_last is None else take(ilp, beside_last)
            if _solved(status):
                step, _ = ilp.overlap()
                rounds.append(length(step))
                if rounds[-1] < best[0] * (1 - 1e-6):
                    best = (rounds[-1], ilp.hold(), dict(ilp.hide_scale), status, report, read[0])
        _, solution, ilp.hide_scale, status, report, ilp.kept = best
        ilp.objective()
        ilp.restore(solution)
        ilp.rounds = rounds
        if isinstance(report, _PeakBound):  # (the kept plan's step memory, measured)
            report = ilp.evaluate(lives.now)
        return ilp, status, report

    def take(ilp: IlpBuilder, beside: _SolveBeside) -> tuple[int, MemoryReport | _PeakBound | None]:
        """The round solved beside, as ``once`` would have solved it in place: its plan,
        where no memory cut binds it, else the round solved here. Its step memory is the
        bound from the last plan measured where that fits the budget (``_PeakBound``:
        then no cut binds), else measured."""
        status, held = beside.result(idle)
        if held is None:
            return once(ilp)
        ilp.restore(held)
        if budget is None:
            return status, None
        # where a bound from the last plan measured fits, no cut can bind: measured only
        # where the rounds keep it (``rounds_from``)
        bound = ilp.peak_bound(lives.now)
        if bound is not None and bound <= budget:
            return status, _PeakBound(bound)
        report = ilp.evaluate(lives.now)
        if _new_cuts(ilp, report, budget):
            return once(ilp)
        return status, report

    def once(ilp: IlpBuilder) -> tuple[int, MemoryReport | None]:
        """A solve in place: its status and, under a budget, the step memory of its plan
        (passes/memory). Without one, no report: the rounds compare their steps' lengths
        alone, and ``attempt`` measures the plan it keeps (each is linear in the step's
        nodes)."""
        work = pending.pop() if pending else None
        if budget is None:
            return _run_beside(ilp, time_limit_s, mip_gap, work), None
        return _bounded(ilp, lives, budget, time_limit_s, mip_gap, work)

    def warm() -> None:
        """What the first solve leaves this thread free for: the step the solver measures
        its plans on, and the caller's ``meanwhile``."""
        lives.now  # noqa: B018 (made where first read)
        if meanwhile is not None:
            meanwhile()

    pending = [warm]  # done while the first solve runs, once

    t0 = time.perf_counter()
    ilp, status, report = attempt(options)
    retried: list[tuple[str, str]] = []  # the simplifications left out, and what they leave out
    constrained = pins or frozen or forbid
    for name, what, without in SIMPLIFICATIONS:
        if not constrained or status != pywraplp.Solver.INFEASIBLE:
            break
        loosened = dict(options, **without(space))
        if loosened == options:
            continue
        # NOTE: the simplifications (module docstring) leave out pairs that a constrained
        # plan may need (a pinned parameter resharded on two axes into its consumer, a
        # following node resharded right before it): constraints are never infeasible
        # because of them, so the ILP without them is asked, one at a time, before saying no
        log.info("the constraints admit no plan of the simplified ILP: resharding %s too", what)
        ilp, status, report = attempt(loosened)
        retried.append((name, what))
        options = loosened
    ilp_s = round(time.perf_counter() - t0, 6)
    if status == pywraplp.Solver.NOT_SOLVED:
        size = f"{ilp.lp.NumVariables()} variables, {ilp.lp.NumConstraints()} constraints"
        if ilp_s < 0.9 * time_limit_s:  # the solver gave up on its own, not at the limit
            raise SolveError(
                f"the solver ({solver}) stopped without a plan after {ilp_s:.1f} s, before "
                f"its time limit of {time_limit_s:.0f} s ({size}): please report it with "
                "the model; another solver may solve it (AUTOPAR_SOLVER=SCIP)"
            )
        raise SolveError(
            f"the solver found no plan within its time limit of {time_limit_s:.0f} s "
            f"({size}): raise time_limit_s (autopar.plan(..., time_limit_s=...))"
            + ("" if budget is None else ", or the memory budget")
        )
    if not _solved(status):
        if (pins or frozen) and status == pywraplp.Solver.INFEASIBLE:
            held = [f"{len(pins)} pinned nodes"] if pins else []
            held += [f"no reshard on axis {space.mesh.axis_names[a]}" for a in frozen or {}]
            raise SolveError(
                f"no plan keeps the constraints ({', '.join(held)})"
                + ("" if budget is None else f" within a memory budget of {budget / _MIB:,.2f} MiB")
                + ": loosen them (fewer patterns, or a 'reshard:AXIS' of 'params' for 'none')"
                + ("" if budget is None else ", or raise the budget")
            )
        if budget is not None and status == pywraplp.Solver.INFEASIBLE:
            lives.widen()
            least = smallest_budget(
                space, profile, lives.now, solver=solver, time_limit_s=time_limit_s,
                optimizer=optimizer, **options,
            )  # fmt: skip
            raise _budget_error(budget, least, time_limit_s, checkpointing)
        # NOTE: every node may replicate everything (passes/strategies), so without a budget
        # the all-replicated plan is always a solution: this is a bug, not the model's fault
        raise SolveError(
            f"the sharding ILP has no solution (solver status {status}) although the "
            "all-replicated plan should be one: please report it with the model"
        )
    assert report is not None
    stats: dict[str, Any] = {**ilp.times, "ilp_s": ilp_s}
    if ilp.rounds:
        stats["overlap_rounds"] = ilp.rounds
    warnings = []
    if retried:
        stats["unsimplified"] = [name for name, _ in retried]
        warnings.append(
            "the constraints admit no plan without resharding "
            f"{' or '.join(what for _, what in retried)}: "
            f"solved without {'those simplifications' if len(retried) > 1 else 'that simplification'}"
        )
    if budget is not None:
        stats.update(memory_budget=int(budget), memory_cuts=len(ilp.cuts))
        if report.peak_bytes > budget + within(budget):
            warnings.append(
                f"the plan's step memory ({report.peak_bytes / _MIB:.1f} MiB per rank at "
                f"{report.peak_node}) is above the budget of {budget / _MIB:.1f} MiB: the "
                f"solver stopped after {MAX_ROUNDS} rounds of bounding it"
            )
    stats["peak_bytes"] = report.peak_bytes
    sol = read_solution(ilp, status, stats, time_limit_s, like=ilp.kept)
    sol.warnings.extend(warnings)
    return sol
