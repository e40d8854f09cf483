#!/usr/bin/env bash
# The README's burn section as a new user meets it: a fresh cargo project
# whose Cargo.toml holds the section's [dependencies] lines (the checkout's
# path put in for /path/to/headkl) and whose src/main.rs is the section's
# Rust block, built and run; it must print `loss: first <f> last <f>` with
# the loss fallen. It follows the section's tip and starts from
# crates/burn/Cargo.lock, and builds in headkl-burn's target folder, so
# burn's stack, built there already by headkl-burn's tests, is not built
# twice. Arguments go to `cargo run` (e.g. --quiet).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
target="${CARGO_TARGET_DIR:-$root/crates/burn/target}"
project="$target/readme-burn"
rm -rf "$project"
mkdir -p "$project/src"

# The section's first toml and first rust blocks.
block() {
    awk -v lang="$1" '
        /^## / { inside = ($0 == "## Use it from burn") }
        inside && !done && $0 == "```" lang { grab = 1; next }
        grab && $0 == "```" { grab = 0; done = 1 }
        grab { print }
    ' README.md
}
deps=$(block toml)
main=$(block rust)
[ -n "$deps" ] || { echo "burn_readme: README's burn section has no toml block" >&2; exit 1; }
[ -n "$main" ] || { echo "burn_readme: README's burn section has no rust block" >&2; exit 1; }
grep -q '/path/to/headkl/crates/burn' <<<"$deps" || {
    echo "burn_readme: the toml block does not name /path/to/headkl/crates/burn" >&2
    exit 1
}

{
    printf '[package]\nname = "readme-burn"\nversion = "0.1.0"\nedition = "2021"\n\n'
    printf '%s\n' "${deps//\/path\/to\/headkl/$root}"
    # A workspace of its own, wherever the target folder lies.
    printf '\n[workspace]\n'
} >"$project/Cargo.toml"
printf '%s\n' "$main" >"$project/src/main.rs"
cp crates/burn/Cargo.lock "$project/Cargo.lock"

echo "+ cargo run --release --manifest-path $project/Cargo.toml $*"
out=$(CARGO_TARGET_DIR="$target" cargo run --release --manifest-path "$project/Cargo.toml" "$@")
echo "$out" | tail -n 1
echo "$out" | awk '/^loss: first/ { ok = ($5 < $3) } END { if (!ok) { print "burn_readme: the loss did not fall" > "/dev/stderr"; exit 1 } }'
