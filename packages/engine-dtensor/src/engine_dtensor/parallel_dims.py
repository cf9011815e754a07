"""`ParallelDims`: the data- and tensor-parallel degrees of one run and the DeviceMesh they form.

Owns the check that the degrees multiply to the world size and the mesh layout (`dp` outer, `tp`
inner, so a TP group is made of neighbouring ranks, i.e. one node's GPUs). Does not own process-group
initialisation (engine.py) or how the model is sharded (parallelize.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    dp: int
    tp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ValueError(f"parallel degrees must be >= 1; got dp={self.dp}, tp={self.tp}")
        if self.dp * self.tp != self.world_size:
            raise ValueError(
                f"Invalid parallel dims: dp({self.dp}) * tp({self.tp}) != WORLD_SIZE({self.world_size}); "
                "policy.dtensor_cfg.tensor_parallel_size must divide the number of ranks"
            )

    @classmethod
    def from_world(cls, world_size: int, tp: int) -> ParallelDims:
        """dp is whatever is left of the world after TP."""
        if world_size % tp:
            raise ValueError(
                f"policy.dtensor_cfg.tensor_parallel_size={tp} does not divide the world size {world_size}"
            )
        return cls(dp=world_size // tp, tp=tp, world_size=world_size)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A 2-D ("dp", "tp") mesh; FSDP shards over "dp", DTensor TP over "tp". Needs a process group."""
        self._mesh = init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        return self._mesh

    def get_mesh(self, name: str) -> DeviceMesh:
        """The "dp" or "tp" sub-mesh (after build_mesh)."""
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must run before get_mesh()")
        return self._mesh[name]
