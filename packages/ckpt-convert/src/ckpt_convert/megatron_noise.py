"""Silence what megatron-core prints at import that no user can act on.

megatron-core warns, in every process and at import, that it falls back to torch without transformer-engine or apex,
and about deprecations inside its own code (torch's collectives it calls by their old names included); torch's C++
extension loader, which megatron imports, logs on a machine without CUDA that it found no CUDA runtime. Every package
that imports megatron (this converter, engine-megatron) calls `silence()` first; what the engine runs (attention
"local" or "transformer_engine", the fusions on) is logged once as its resolved config instead.
"""

from __future__ import annotations

import logging
import warnings

_MESSAGES = (
    r"Transformer Engine and Apex are not installed", r"Apex is not installed",
    r"full scope is deprecated", r"`load_state_dict` is deprecated",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
)


def silence() -> None:
    """Install the warning filters and logger levels; idempotent, cheap, imports nothing."""
    for message in _MESSAGES:
        warnings.filterwarnings("ignore", message=message)
    # megatron's optimizer reads `.grad` of Float16Module's views (torch warns: not a leaf); megatron's line only
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf",
                            module=r"megatron\.")
    # "No CUDA runtime is found, using CUDA_HOME=..." at import on a CPU machine; errors still show
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # megatron-core logs its own configs and, per gradient bucket, every parameter's name at INFO (thousands of lines
    # on a real model, from every rank); `logging.getLogger("megatron.core").setLevel(logging.INFO)` brings them back
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
