"""grpo_app: the GRPO trainer (see main.py).

Ray reads RAY_ENABLE_UV_RUN_RUNTIME_ENV when it is imported: under `uv run` it would otherwise rebuild the
whole workspace into a fresh venv for its workers (minutes at startup); the driver's venv is already the
right one for every worker on this machine. Set here, before any module of this package imports ray.
Also read at import: how long a GCS connection may take (Ray's 30 s, retried 20 times, let a
`cluster.address` that answers TCP but is no Ray hang for minutes; a local Ray's own processes keep
Ray's default, see grpo_app.cluster.start_ray).
"""

import os

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
GCS_TIMEOUT_ENV, JOIN_GCS_TIMEOUT_S = "RAY_py_gcs_connect_timeout_s", "10"
os.environ.setdefault(GCS_TIMEOUT_ENV, JOIN_GCS_TIMEOUT_S)
