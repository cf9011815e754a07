"""engine-megatron."""

import logging
import warnings

# megatron-core warns, in every process and at import, that it falls back to torch without transformer-engine or
# apex, and about deprecations inside its own code (torch's collectives it calls by their old names included); none
# of it is the user's to act on. What the engine runs (attention "local" or "transformer_engine", the fusions on) is
# logged once as its resolved config instead.
for _message in (r"Transformer Engine and Apex are not installed", r"Apex is not installed",
                 r"full scope is deprecated", r"`load_state_dict` is deprecated",
                 r"Please use DTensor instead and we are deprecating ShardedTensor",
                 r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"):
    warnings.filterwarnings("ignore", message=_message)
# megatron's optimizer reads `.grad` of Float16Module's views (torch warns: not a leaf); attributed to megatron's line
warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf", module=r"megatron\.")
# megatron-core logs its own configs and, per gradient bucket, every parameter's name at INFO (thousands of lines on a
# real model, from every rank); `logging.getLogger("megatron.core").setLevel(logging.INFO)` brings them back
logging.getLogger("megatron.core").setLevel(logging.WARNING)
