#!/usr/bin/env bash
# The README's test command: every test of the workspace, in the release
# profile the main job (`cargo run --release -p headkl-cli -- bench`) builds,
# so the two commands share one build. Then one line per backend: where its
# conformance suite ran and how many cases passed, or why it was skipped.
# libtest hides what passing tests print, so the tests leave those lines in
# target/release/headkl-tests/ (crates/conformance/src/harness.rs)
# and this prints them. Arguments go to `cargo test` (e.g. `-- --nocapture`).
set -uo pipefail
cd "$(dirname "$0")/.."
records="${CARGO_TARGET_DIR:-target}/release/headkl-tests"
rm -rf "$records"

cargo test --release --workspace "$@"
status=$?

echo "backends:"
if compgen -G "$records/*.tsv" >/dev/null; then
    # Per backend: the devices it ran on with the cases passed over every
    # suite, then each distinct reason it was skipped.
    cat "$records"/*.tsv | awk -F '\t' '
        $2 == "ran" {
            key = $1 SUBSEP $3
            if (!(key in cases)) { order[++n] = key }
            suites[key]++; passed[key] += $5; cases[key] += $6
            seen[$1] = 1
        }
        $2 == "skipped" {
            key = $1 SUBSEP "skip" SUBSEP $3
            if (!(key in skip)) { skip[key] = 1; skips[++m] = key }
        }
        END {
            for (i = 1; i <= n; i++) {
                split(order[i], p, SUBSEP)
                printf "  %s: ran on %s: %d suites, %d/%d cases passed\n", p[1], p[2], suites[order[i]], passed[order[i]], cases[order[i]]
            }
            for (i = 1; i <= m; i++) {
                split(skips[i], p, SUBSEP)
                printf "  %s: skipped%s: %s\n", p[1], (p[1] in seen) ? " in some tests" : "", p[3]
            }
        }' | sort
else
    echo "  none: no conformance test ran (filtered out, or the build failed)"
fi
exit $status
