#!/usr/bin/env bash
# Sets up the machine (scripts/setup.sh), then runs formatting and lint checks and every test
# tier that runs here: unit tests, and integration tests with real Eryx, R, cgroups, Landlock,
# seccomp and socket activation. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
bash scripts/setup.sh
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (warnings denied)"
cargo clippy "${CARGO_FLAGS[@]}" --workspace --all-targets -- -D warnings
echo "== cargo test"
cargo test "${CARGO_FLAGS[@]}" --workspace -- --test-threads=2
