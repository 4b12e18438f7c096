#!/usr/bin/env bash
# Runs every test: unit, property and end-to-end (real processes, real NBD clients).
# Arguments go to each test program (a name filter, --nocapture...). Ends with one
# summary line; exits non-zero if any test failed.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install-deps.sh --test
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# --no-fail-fast: one failing test program must not hide the state of the ones after
# it. Each end-to-end test starts a whole cluster (8 processes); two at a time suits
# 2 cores.
status=0
cargo test --workspace --no-fail-fast -- --test-threads=2 "$@" 2>&1 | tee "$log" || status=$?
# Counts from each program's "test result:" line; failed names from the list libtest
# prints just before it (the last "failures:" block: the first one holds their output).
summary=$(awk -v elapsed="$((SECONDS / 60))m$((SECONDS % 60))s" '
    /^failures:$/ { listing = 1; names = ""; next }
    listing && /^    [^ ]+$/ { names = names (names == "" ? "" : ", ") substr($0, 5); next }
    /^test result: / {
        for (i = 1; i <= NF; i++) {
            if ($(i + 1) ~ /^passed;?$/) passed += $i
            if ($(i + 1) ~ /^failed;?$/) failed += $i
            if ($(i + 1) ~ /^ignored;?$/) ignored += $i
        }
        if (listing && names != "") failures = failures (failures == "" ? "" : ", ") names
        listing = 0
    }
    END {
        line = sprintf("tests: %d passed, %d failed, %d ignored in %s", passed, failed, ignored, elapsed)
        if (failures != "") line = line "; failed: " failures
        print line
    }' "$log")
if [ "$status" -ne 0 ] && [[ "$summary" != *"; failed: "* ]]; then
    # No test failed, yet cargo did: a build error, or a test program that crashed.
    summary="$summary; cargo failed (exit $status) outside any test: see above"
fi
echo "$summary"
exit "$status"
