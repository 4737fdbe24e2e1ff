"""The plans people write by hand, as constraint sets for ``autopar.plan`` and ``autopar.evaluate``.

Each function returns ``{pattern: placements text}`` (passes/pins): the placements of the
parameters and of the batch, and the rules of the data-parallel axes, as the expert plan
fixes them; the solver places what is left (the activations between) at least cost.
``autopar.evaluate(model, mesh, inputs, experts.megatron(model, mesh), ...)`` then costs
the expert plan with the cost model that costs autopar's own, so the two compare.

    - ``dp``: every parameter replicated, the batch sharded along dim 0 over the data axes,
      which carry nothing but the gradients' all-reduces (DDP);
    - ``fsdp``: every parameter sharded along dim 0 over the data axes, all-gathered where it
      is used (forward and backward) and its gradient reduce-scattered; the batch as in
      ``dp`` (FSDP2, ZeRO-3);
    - ``megatron``: tensor parallelism over ``tp`` as Megatron-LM writes it: the linear
      layers that open a block (attention's q/k/v, the MLP's first) split their outputs
      (column-parallel), those that close it split their inputs (row-parallel), the
      embedding and the output head split the vocabulary; with ``dp``, data parallel
      over that axis as well; with ``fsdp=True`` too, the parameters also sharded over
      ``dp`` (torchtitan's FSDP + TP), each along the dim that ``tp`` leaves whole (a
      column-parallel bias, whose one dim ``tp`` splits, replicated over ``dp``). That
      layout needs reshards the solver's simplifications leave out, so it is solved as
      the exact ILP (passes/solve, "Constraints"); with ``sequence_parallel=True``,
      Megatron's sequence parallelism (the norms' outputs split along the sequence).

Which linear opens and which closes a block is read from the module's name (``column`` and
``row``: ``fnmatch`` patterns over the last name of the module path, defaults for the usual
names of GPT-2, Llama, Mistral, Qwen, Gemma and BERT models) and its type: ``nn.Linear``
keeps its weight as ``[out, in]``, Hugging Face's ``Conv1D`` (GPT-2) as ``[in, out]``.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from .core import Mesh

__all__ = ["COLUMN", "ROW", "dp", "fsdp", "megatron"]

COLUMN = (
    "q", "k", "v", "q_proj", "k_proj", "v_proj", "qkv", "qkv_proj", "c_attn", "query", "key",
    "value", "wq", "wk", "wv", "fc1", "c_fc", "gate_proj", "up_proj", "gate_up_proj", "w1",
    "w3", "intermediate.dense", "lm_head", "head",
)  # fmt: skip
"""Linear layers that open a block: column-parallel (their output features split)."""

ROW = ("o", "o_proj", "out_proj", "wo", "dense", "fc2", "c_proj", "down_proj", "w2",
       "output.dense")  # fmt: skip
"""Linear layers that close a block: row-parallel (their input features split)."""


def _axes(mesh: Mesh, axes) -> list[str]:
    if axes is None:
        return [mesh.axis_names[0]]
    axes = [axes] if isinstance(axes, str) else list(axes)
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(f"no mesh axis {a!r}: the mesh's axes are {mesh.axis_names}")
    return axes


def _text(mesh: Mesh, per_axis: dict[str, str]) -> str:
    return ",".join(per_axis.get(a, "R") for a in mesh.axis_names)


def _batch(mesh: Mesh, data: list[str]) -> dict[str, str]:
    return {"input:*": _text(mesh, {a: "S(0)" for a in data})}


def dp(mesh: Mesh, axes=None) -> dict[str, str]:
    """Data parallelism over ``axes`` (default: the mesh's first axis; the others are the
    solver's). Over several axes the batch is split over all of them, and each gradient
    summed over all of them: as DTensor does it, one all-reduce per axis, or hierarchically
    where the cost model prices that faster (cost_models/comm)."""
    data = _axes(mesh, axes)
    return {
        "*": _text(mesh, {}),
        **_batch(mesh, data),
        **{f"reshard:{a}": "none" for a in data},
    }


def fsdp(mesh: Mesh, axes=None) -> dict[str, str]:
    """Fully sharded data parallelism over ``axes`` (default: the mesh's first axis; as
    ``dp``)."""
    data = _axes(mesh, axes)
    return {
        "*": _text(mesh, {a: "S(0)" for a in data}),
        **_batch(mesh, data),
        **{f"reshard:{a}": "params" for a in data},
    }


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or name.endswith("." + p) for p in patterns)


def megatron(
    model: nn.Module,
    mesh: Mesh,
    *,
    tp: str = "tp",
    dp: str | None = None,
    fsdp: bool = False,
    sequence_parallel: bool = False,
    column=COLUMN,
    row=ROW,
) -> dict[str, str]:
    """Megatron-LM tensor parallelism over ``tp`` (module docstring); with ``dp``, data
    parallelism over that axis too, and with ``fsdp`` the parameters sharded over it. With
    ``sequence_parallel``, Megatron's sequence parallelism: the output of every norm (a
    module whose class name ends in ``Norm``: LayerNorm, RMSNorm, ``LlamaRMSNorm``) split
    along the sequence (dim 1 of [batch, sequence, hidden]) over ``tp``, so that the
    regions between blocks run on a share of the tokens; the solver then all-gathers each
    block's input and reduce-scatters its output."""
    if fsdp and not dp:
        raise ValueError("megatron(fsdp=True) shards the parameters over dp: name the dp axis")
    _axes(mesh, [tp] + ([dp] if dp else []))

    def place(tp_dim: str, dp_dim: str) -> str:
        return _text(mesh, {tp: tp_dim, **({dp: dp_dim} if fsdp and dp else {})})

    out: dict[str, str] = {}
    for path, module in model.named_modules():
        leaf = path.rpartition(".")[2]
        prefix = f"{path}." if path else ""
        if isinstance(module, nn.Embedding):
            out[f"{prefix}weight"] = place("S(0)", "S(1)")  # vocabulary-parallel
            continue
        if not (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"):
            continue
        # nn.Linear: weight [out, in]; Conv1D: weight [in, out]
        out_dim, in_dim = ("S(0)", "S(1)") if isinstance(module, nn.Linear) else ("S(1)", "S(0)")
        # with fsdp, dp shards the dim tp leaves whole (one dim over two axes nests)
        if _matches(path, column) or _matches(leaf, column):
            out[f"{prefix}weight"] = place(out_dim, in_dim)
            out[f"{prefix}bias"] = place("S(0)", "R")
        elif _matches(path, row) or _matches(leaf, row):
            out[f"{prefix}weight"] = place(in_dim, out_dim)
            out[f"{prefix}bias"] = place("R", "S(0)")
    if not out:
        raise ValueError(
            "megatron: no embedding and no linear layer named as column- or row-parallel in "
            f"this model: pass column=... and row=... (patterns over module names; defaults "
            f"{COLUMN[:4]}..., {ROW[:4]}...)"
        )
    # what no rule names (norms, the biases of row-parallel layers): replicated over tp
    # every name of a tied weight (GPT-2's head is its token embedding): the catch-all below
    # would otherwise place the second name apart from the first, which no plan can hold
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    constraints = {k: v for k, v in out.items() if k in params}
    constraints["*"] = place("R", "S(0)")
    if sequence_parallel:
        rows = _text(mesh, {tp: "S(1)", **({dp: "S(0)"} if dp else {})})
        for path, module in model.named_modules():
            if path and type(module).__name__.endswith("Norm"):
                constraints[f"output:{path}"] = rows
    if dp:
        constraints.update(_batch(mesh, [dp]))
        constraints[f"reshard:{dp}"] = "params" if fsdp else "none"
    return constraints
