#!/usr/bin/env bash
# Builds Floe and starts a local demo cluster with a ready volume; Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install-deps.sh
cargo build --release -p floe-cli
exec ./target/release/floe demo "$@"
