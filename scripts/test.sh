#!/usr/bin/env bash
# Every test lane. Lane 1: the uv workspace (all packages, apps, cross-package tests).
set -euo pipefail
cd "$(dirname "$0")/.."
uv run --locked pytest "$@"
