# Sourced by the other scripts: one place for build settings.
# Eryx 0.10 / wasmtime 50 declare a newer rust-version than the pinned 1.95 toolchain but
# compile on it (ARCHITECTURE.md, "Toolchain"); every cargo call passes --ignore-rust-version.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/sandcell-target}"
export SANDCELL_CACHE="${SANDCELL_CACHE:-/var/tmp/sandcell-cache}"
export SANDCELL_TEST_PYTHON_RUNTIME="${SANDCELL_TEST_PYTHON_RUNTIME:-$SANDCELL_CACHE/python-runtime}"
CARGO_FLAGS=(--release --ignore-rust-version --locked)
BIN="$CARGO_TARGET_DIR/release"
