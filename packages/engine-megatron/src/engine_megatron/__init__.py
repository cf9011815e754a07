"""engine-megatron."""

import warnings

# megatron-core warns, in every process and at import, that it falls back to torch without transformer-engine or
# apex, and about deprecations inside its own code; none of it is the user's to act on. What the engine runs
# (attention "local" or "transformer_engine", the fusions on) is logged once as its resolved config instead.
for _message in (r"Transformer Engine and Apex are not installed", r"Apex is not installed",
                 r"full scope is deprecated", r"`load_state_dict` is deprecated",
                 r"Please use DTensor instead and we are deprecating ShardedTensor"):
    warnings.filterwarnings("ignore", message=_message)
