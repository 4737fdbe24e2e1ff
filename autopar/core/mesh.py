"""``Mesh``: the device mesh a plan is made for, without processes.

A mesh is a shape (one size per axis), the axis names, the name of a device profile
(``cost_models.devices.PROFILES``) and optionally how many ranks share a node. Axes are
laid out row-major over the ranks, so the last axis is the innermost: its ranks are
neighbours (same node), which is how the cost model decides which link an axis uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Mesh"]


@dataclass(frozen=True, slots=True)
class Mesh:
    """A device mesh described for planning.

    Attributes:
        shape: size of each mesh axis, e.g. ``(2, 4)``.
        axis_names: one name per axis, e.g. ``("dp", "tp")``.
        device: name of the device profile the cost model uses (``"h100"``, ``"cpu"``).
        ranks_per_node: how many ranks share a node (fast links); None takes the
            profile's. Axes whose groups span nodes use the inter-node link.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device: str = "h100"
    ranks_per_node: int | None = None

    def __init__(self, shape, axis_names=None, device: str = "h100", ranks_per_node=None):
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if axis_names is None:
            axis_names = tuple(f"axis{i}" for i in range(len(shape)))
        axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", axis_names)
        object.__setattr__(self, "device", str(device))
        object.__setattr__(
            self, "ranks_per_node", None if ranks_per_node is None else int(ranks_per_node)
        )
        self.__post_init__()

    def __post_init__(self):
        if not self.shape or any(s < 1 for s in self.shape):
            raise ValueError(
                f"mesh shape must be a non-empty tuple of sizes >= 1, got {self.shape}"
            )
        if len(self.axis_names) != len(self.shape):
            raise ValueError(
                f"mesh has {len(self.shape)} axes {self.shape} but {len(self.axis_names)} "
                f"axis names {self.axis_names}: give one name per axis"
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis names must be distinct, got {self.axis_names}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis(self, name_or_index: str | int) -> int:
        if isinstance(name_or_index, int):
            return name_or_index
        try:
            return self.axis_names.index(name_or_index)
        except ValueError:
            raise KeyError(
                f"mesh has no axis {name_or_index!r}; axes are {self.axis_names}"
            ) from None

    def to_dict(self) -> dict:
        return {
            "shape": list(self.shape),
            "axis_names": list(self.axis_names),
            "device": self.device,
            "ranks_per_node": self.ranks_per_node,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Mesh:
        return cls(
            tuple(d["shape"]),
            tuple(d["axis_names"]),
            d.get("device", "h100"),
            d.get("ranks_per_node"),
        )

    @classmethod
    def from_device_mesh(cls, device_mesh, device: str | None = None) -> Mesh:
        """Describe a torch ``DeviceMesh``; the profile defaults to h100 on cuda, cpu otherwise."""
        names = device_mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(device_mesh.ndim))
        if device is None:
            device = "h100" if device_mesh.device_type == "cuda" else "cpu"
        return cls(tuple(device_mesh.mesh.shape), tuple(names), device)

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        node = f", {self.ranks_per_node}/node" if self.ranks_per_node else ""
        return f"Mesh({axes}; {self.device}{node})"
