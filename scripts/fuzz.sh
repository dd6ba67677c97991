#!/usr/bin/env bash
# Coverage-guided fuzzing of sandcelld's decoders (fuzz/, libFuzzer through libfuzzer-sys).
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Builds the targets (stable Rust: SanitizerCoverage through -Cpasses=sancov-module, no
# sanitizer, debug assertions and overflow checks on), replays every committed regression
# input (fuzz/regressions/<target>/), then fuzzes each target for its share of SECONDS
# (default 60, split evenly) starting from the committed seeds (fuzz/corpus/<target>/) and a
# working corpus kept outside the tree. A crash leaves its input in the artifact directory
# and is copied to fuzz/regressions/<target>/. Prints one closing line
# `fuzz: E executions, C crashes` and exits non-zero on a crash or a build failure.
#
# Environment: SANDCELL_FUZZ_TARGET_DIR (build directory, default /var/tmp/sandcell-fuzz-target),
# SANDCELL_FUZZ_WORK (working corpora and artifacts, default /var/tmp/sandcell-fuzz-work),
# SANDCELL_FUZZ_JOBS (cargo build jobs, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
seconds=${1:-60}
shift || true
all=(varlink_message varlink_transport kernel_params worker_reply file_name config text egress_request)
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=("${all[@]}")
[[ $seconds =~ ^[0-9]+$ ]] || { echo "fuzz: SECONDS must be a whole number" >&2; exit 2; }

export CARGO_TARGET_DIR=${SANDCELL_FUZZ_TARGET_DIR:-/var/tmp/sandcell-fuzz-target}
work=${SANDCELL_FUZZ_WORK:-/var/tmp/sandcell-fuzz-work}
host=$(rustc -vV | sed -n 's/^host: //p')
# The flags cargo-fuzz passes for `--sanitizer none`; all of them are stable rustc options.
# --target keeps them off build scripts and proc macros (which are not linked with libFuzzer).
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
mkdir -p "$work"
echo "== fuzz: building ${#targets[@]} targets in $CARGO_TARGET_DIR"
t0=$(date +%s)
build() {
    nice -n 19 cargo build --manifest-path fuzz/Cargo.toml --release --ignore-rust-version \
        --target "$host" -j "${SANDCELL_FUZZ_JOBS:-2}" --bins "$@"
}
if ! build --locked 2>"$work/build.log"; then
    if grep -q -e 'needs to be updated' -e 'lock file' "$work/build.log"; then
        # A dependency of the daemon changed: take the workspace's resolution, add
        # libfuzzer-sys to it, and build again.
        echo "fuzz: fuzz/Cargo.lock is stale; refreshing it from Cargo.lock"
        cp Cargo.lock fuzz/Cargo.lock
        build
    else
        cat "$work/build.log" >&2
        echo "fuzz: the fuzz targets do not build (see above)" >&2
        exit 1
    fi
fi
echo "fuzz: build took $(($(date +%s) - t0)) s"
bin="$CARGO_TARGET_DIR/$host/release"

execs=0
crashes=0
per=$((seconds / ${#targets[@]}))
[[ $per -ge 1 ]] || per=1
for t in "${targets[@]}"; do
    seeds="$root/fuzz/corpus/$t"
    regress="$root/fuzz/regressions/$t"
    corpus="$work/corpus/$t"
    art="$work/artifacts/$t"
    mkdir -p "$corpus" "$art"
    # Replay the regression inputs once each (libFuzzer runs file arguments and exits).
    if compgen -G "$regress/*" >/dev/null; then
        if ! "$bin/$t" -runs=1 "$regress"/* >"$art/regressions.log" 2>&1; then
            echo "fuzz: $t: a regression input fails again:"
            tail -n 30 "$art/regressions.log"
            crashes=$((crashes + 1))
        fi
    fi
    log="$art/run.log"
    set +e
    nice -n 19 "$bin/$t" -max_total_time="$per" -timeout=10 -rss_limit_mb=2048 -max_len=8192 \
        -print_final_stats=1 -artifact_prefix="$art/" "$corpus" "$seeds" >"$log" 2>&1
    rc=$?
    set -e
    n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    n=${n:-0}
    execs=$((execs + n))
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 || true)
    if [[ $rc -ne 0 ]]; then
        crashes=$((crashes + 1))
        echo "fuzz: $t: CRASH after $n executions (exit $rc); log $log:"
        grep -E -A 12 'panicked|ERROR: libFuzzer|SUMMARY' "$log" | head -n 40
        mkdir -p "$regress"
        for f in "$art"/crash-* "$art"/timeout-* "$art"/oom-*; do
            [[ -e $f ]] || continue
            cp "$f" "$regress/"
            echo "fuzz: $t: input saved as fuzz/regressions/$t/$(basename "$f")"
        done
    else
        echo "fuzz: $t: $n executions in ${per} s, $cov, corpus $(find "$corpus" -type f | wc -l) inputs"
    fi
done
echo "fuzz: $execs executions, $crashes crashes"
[[ $crashes -eq 0 ]]
