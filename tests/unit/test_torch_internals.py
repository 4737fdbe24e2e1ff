"""The private torch internals autopar leans on are still where it expects them.

Each entry is used where torch has no public way to do the same (the comment at the place
of use says why). If a torch release moves one, this test says which, by name, instead of a
plan going silently wrong.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch.distributed.tensor import DTensor, _collective_utils
from torch.distributed.tensor._ops import single_dim_strategy
from torch.distributed.tensor._sharding_prop import _expand_single_dim_strategy_to_mesh


def test_dtensor_rule_internals_the_planner_calls():
    prop = DTensor._op_dispatcher.sharding_propagator
    assert isinstance(prop.op_strategy_funcs, dict) and prop.op_strategy_funcs
    assert isinstance(prop.op_single_dim_strategy_funcs, dict)
    # passes/strategies._planning_rules widens this collection and switches off this pricing
    assert list(inspect.signature(single_dim_strategy._get_unique_placements).parameters) == [
        "op_schema"
    ]
    assert callable(_collective_utils.redistribute_cost)
    # called positionally as (mesh, op_schema, rule, output meta)
    assert len(inspect.signature(_expand_single_dim_strategy_to_mesh).parameters) >= 4


def test_aot_joint_state_codegen_swaps_for_the_local_graph():
    model = nn.Linear(4, 4)
    with contextlib.ExitStack() as stack:
        jd = aot_export_joint_with_descriptors(stack, model, (torch.randn(2, 4),))
        # passes/codegen.compile_local_step writes these
        assert isinstance(jd.graph_module, torch.fx.GraphModule)
        assert jd._aot_graph_capture.graph_module is jd.graph_module
        flat_args, tangents = jd._aot_graph_capture.updated_flat_args
        assert len(jd._aot_state.flat_args) == len(flat_args)
        assert hasattr(jd._aot_state.fw_metadata, "traced_tangents")
        assert hasattr(jd._aot_state.fw_metadata, "subclass_tangent_meta")


def test_default_store_of_the_process_group():
    # autopar.api._plan_on_rank0 sends the plan through the default group's store
    assert callable(dist.distributed_c10d._get_default_store)


def test_dispatch_mode_the_memory_probe_subclasses():
    # autopar.verify.LiveStorages counts every op's outputs through it
    from torch.utils._python_dispatch import TorchDispatchMode

    assert hasattr(TorchDispatchMode, "__torch_dispatch__")
    seen = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Probe():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen


def test_the_boxed_compiler_codegen_and_calibrate_run_graphs_with():
    # passes/codegen compiles the partitioned graphs with it, autopar/calibration/host.py
    # times ops through it
    from torch._dynamo.backends.debugging import boxed_nop

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (x, x)))
    run = boxed_nop(torch.fx.GraphModule(nn.Module(), graph), [torch.ones(2)])
    args = [torch.full((2,), 3.0)]
    assert getattr(run, "_boxed_call", False)
    assert torch.equal(run(args), torch.full((2,), 9.0))
    assert args == []  # the inputs are dropped, so they can be freed before the graph ends


def test_op_schemas_say_what_aliases_and_what_writes():
    # passes/remat.is_alias (a view shares its input's storage: passes/memory) and
    # passes/order (an op writing an input keeps its place) read an op's schema
    view = torch.ops.aten.view.default._schema
    assert view.returns[0].alias_info is not None
    assert torch.ops.aten.mm.default._schema.returns[0].alias_info is None
    add_ = torch.ops.aten.add_.Tensor._schema
    assert add_.arguments[0].alias_info is not None and add_.arguments[0].alias_info.is_write
    assert torch.Tag.nondeterministic_seeded in torch.ops.aten.bernoulli.default.tags


def test_functional_collectives_codegen_traces_exchanges_with():
    # passes/codegen._Rows: the pairwise exchanges of load-balanced attention rows
    import torch.distributed._functional_collectives as funcol

    params = list(inspect.signature(funcol.all_to_all_single).parameters)
    assert params[:4] == ["self", "output_split_sizes", "input_split_sizes", "group"]
    assert callable(funcol.wait_tensor)


def test_functional_collective_ops_ring_attention_issues_and_waits_apart():
    # passes/codegen._Ring calls the ops under funcol itself, so that a shift's wait can
    # come after the step's kernels (funcol waits where it issues, under tracing)
    c10d = torch.ops._c10d_functional
    args = [a.name for a in c10d.all_to_all_single.default._schema.arguments]
    assert args == ["input", "output_split_sizes", "input_split_sizes", "group_name"]
    assert [a.name for a in c10d.wait_tensor.default._schema.arguments] == ["tensor"]


def test_partitioner_keeps_nodes_tagged_must_be_in_forward_or_backward_where_they_are():
    # passes/codegen.pin_collectives: the tags aot_autograd's partitioner reads
    from torch._functorch import partitioners

    g = torch.fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(torch.ops.aten.relu.default, (x,))
    assert not partitioners._must_be_in_forward(n)
    n.meta["partitioner_tag"] = "must_be_in_forward"
    assert partitioners._must_be_in_forward(n)
    assert not partitioners._must_be_in_backward(n)
    n.meta["partitioner_tag"] = "must_be_in_backward"
    assert partitioners._must_be_in_backward(n)
    n.meta["partitioner_tag"] = "is_forward"
    assert partitioners._has_tag_is_forward(n)


def test_make_fx_records_which_interpreted_node_made_each_node():
    """passes/codegen.hoist_prefetched finds a reshard's ops by the step node whose
    interpretation made them: ``from_node``, which ``preserve_node_meta`` records."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with fx_traceback.preserve_node_meta():
        local = make_fx(torch.fx.Interpreter(gm).run)(torch.randn(2, 4))
    made = {
        n.name: n.meta["from_node"][-1].name for n in local.graph.nodes if n.op == "call_function"
    }
    first = next(n for n in local.graph.nodes if n.op == "call_function")
    assert isinstance(first.meta["from_node"][-1], fx_traceback.NodeSource)
    names = {n.name for n in gm.graph.nodes}
    assert made and set(made.values()) <= names
    assert "_0" in set(made.values()) and "_1" in set(made.values())  # the linear, the relu


def test_the_attention_kernels_autopar_sdpa_calls_take_what_core_ops_passes():
    # core/ops.py calls the device's kernels by their ATen names: torch's public attention
    # returns no log-sum-exp, which the backward and the ring's merges read
    aten = torch.ops.aten

    def args(op):
        return [a.name for a in op.default._schema.arguments]

    assert args(aten._scaled_dot_product_flash_attention)[:5] == [
        "query", "key", "value", "dropout_p", "is_causal"
    ]  # fmt: skip
    assert [r.name for r in aten._scaled_dot_product_flash_attention.default._schema.returns][
        :2
    ] == ["output", "logsumexp"]
    assert args(aten._scaled_dot_product_flash_attention_backward) == [
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
        "max_q", "max_k", "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale",
    ]  # fmt: skip
    assert args(aten._scaled_dot_product_efficient_attention)[:7] == [
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal"
    ]  # fmt: skip
    assert args(aten._scaled_dot_product_efficient_attention_backward)[:9] == [
        "grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed",
        "philox_offset",
    ]  # fmt: skip
    assert args(aten._scaled_dot_product_flash_attention_for_cpu)[:5] == [
        "query", "key", "value", "dropout_p", "is_causal"
    ]  # fmt: skip


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this pytest process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_dtensor_spec_and_constructor_the_runtime_wraps_gradients_with(fake_world):
    # runtime/parallel_module._LocalShards reads each parameter's ``_spec`` and builds its
    # gradient with DTensor's own constructor; it must be what DTensor.from_local makes
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from autopar.runtime.parallel_module import _LocalShards

    mesh = init_device_mesh("cpu", (2, 2))
    params = [
        nn.Parameter(
            DTensor.from_local(
                torch.randn(3, 4), mesh, (Shard(0), Replicate()), shape=(5, 4), stride=(4, 1)
            )
        ),
        nn.Parameter(DTensor.from_local(torch.randn(2, 3).t(), mesh, (Replicate(), Shard(1)))),
    ]
    for p in params:
        assert p._spec.placements == p.placements
        assert tuple(p._spec.tensor_meta.shape) == tuple(p.shape)
    local = _LocalShards.apply(mesh, *params)
    sum((t * (i + 2)).sum() for i, t in enumerate(local)).backward()
    for i, p in enumerate(params):
        ref = DTensor.from_local(
            torch.full_like(p.to_local(), i + 2.0),
            mesh,
            p.placements,
            shape=p.shape,
            stride=p.stride(),
        )
        g = p.grad
        assert type(g) is DTensor and g.requires_grad is False
        assert (g.placements, g.shape, g.stride(), g.dtype) == (
            ref.placements,
            ref.shape,
            ref.stride(),
            ref.dtype,
        )
        assert torch.equal(g.to_local(), ref.to_local())


def test_dtensor_constructor_codegen_wraps_local_shards_with(fake_world):
    # passes/codegen._Localizer._run_op wraps each local input with DTensor's own constructor
    # and its spec (codegen._spec), and reads each output's local tensor under no_grad; it
    # must be what DTensor.from_local makes, without from_local's view of its input
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from autopar.passes.codegen import _spec

    mesh = init_device_mesh("cpu", (2, 2))
    local = torch.randn(3, 4)
    whole = torch.empty(6, 4)  # the global value the plan's node holds
    ps = (Shard(0), Replicate())
    made = DTensor(local, _spec(mesh, ps, whole), requires_grad=False)
    ref = DTensor.from_local(local, mesh, ps, run_check=False, shape=(6, 4), stride=(4, 1))
    assert (made.placements, made.shape, made.stride(), made.dtype) == (
        ref.placements,
        ref.shape,
        ref.stride(),
        ref.dtype,
    )
    with torch.no_grad():
        assert made.to_local() is local  # the tensor itself, no view to trace
    assert torch.equal((made * 2).to_local(), (ref * 2).to_local())
