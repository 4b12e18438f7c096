#!/usr/bin/env bash
# Runs every test: unit, property and end-to-end (real processes, real NBD clients).
set -euo pipefail
cd "$(dirname "$0")"
scripts/install-deps.sh --test
# Each end-to-end test starts a whole cluster (8 processes); two at a time suits 2 cores.
cargo test --workspace -- --test-threads=2 "$@"
