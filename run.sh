#!/usr/bin/env bash
# Builds Floe, puts `floe` on the PATH (a link in ~/.cargo/bin, where rustup puts
# cargo; FLOE_BIN_DIR names another directory) and starts a local demo cluster with a
# ready volume; Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install-deps.sh
cargo build --release -p floe-cli
floe="$(pwd)/${CARGO_TARGET_DIR:-target}/release/floe"
case "${CARGO_TARGET_DIR:-}" in /*) floe="$CARGO_TARGET_DIR/release/floe" ;; esac
bin_dir="${FLOE_BIN_DIR:-${CARGO_HOME:-$HOME/.cargo}/bin}"
mkdir -p "$bin_dir"
# A link, so a rebuild is what `floe` runs.
ln -sf "$floe" "$bin_dir/floe"
case ":$PATH:" in
  *":$bin_dir:"*) echo "floe: $bin_dir/floe (try \`. floe-data/env; floe status\` in another terminal)" ;;
  *) echo "floe: $bin_dir/floe; $bin_dir is not on your PATH: add it, or run $floe" ;;
esac
exec "$floe" demo "$@"
