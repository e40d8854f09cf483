#!/usr/bin/env bash
# A fuzz campaign over headkl's parsers with afl.rs (AFL++ under cargo-afl,
# on stable Rust): each target of crates/fuzz (headkl_files::fuzz:
# safetensors, teacher, tune_cache, settings, vocab_order), MINUTES of wall
# time, JOBS targets at once, then the corpus minimized into
# crates/fuzz/corpus and the figures appended to crates/fuzz/campaign.tsv
# (CPU seconds, executions, edges covered, crashes and hangs).
#
#   scripts/fuzz.sh [TARGET...]      (default: every target)
#
# The command line's target (cli_args) is not fuzzed here: it needs the
# command's clap parser and the harness stands on headkl-files alone. The
# command's unit tests replay its corpus (crates/cli/corpus/cli_args:
# `cargo test -p headkl-cli --lib fuzz`).
#
#   MINUTES=60  wall minutes per target (afl's -V)
#   JOBS=2      targets fuzzed at once
#   NICE=10     nice level, so a campaign yields to builds and tests
#
# Runs resume: crates/fuzz/out/TARGET (not committed) keeps afl's state,
# and a rerun goes on from it. Crashes and hangs land in
# crates/fuzz/out/TARGET/default/{crashes,hangs}; replay one with
#   crates/fuzz/target/release/headkl-fuzz replay TARGET FILE
# and, once fixed, commit it under crates/fuzz/regressions/TARGET (the unit
# tests replay those and the corpus: `cargo test -p headkl-files --lib fuzz`).
#
# Needs a C compiler, make and LLVM (for cargo-afl's runtime); installs
# cargo-afl if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
fuzz=$root/crates/fuzz
minutes=${MINUTES:-60}
jobs=${JOBS:-2}
nice_level=${NICE:-10}
all="safetensors teacher tune_cache settings vocab_order"
targets=${*:-$all}
for t in $targets; do
    [[ " $all " == *" $t "* ]] || { echo "fuzz.sh: no target '$t' (targets: $all)" >&2; exit 2; }
done

if ! cargo afl --version >/dev/null 2>&1; then
    cargo install cargo-afl --locked
fi
# Builds AFL++'s runtime for this rustc once; a second call says it exists.
cargo afl config --build >/dev/null 2>&1 || true
cargo afl build --release --manifest-path "$fuzz/Cargo.toml"
bin=$fuzz/target/release/headkl-fuzz
# AFL++'s tools as `cargo afl config --build` installed them.
aflbin=$(dirname "$(find "${XDG_DATA_HOME:-$HOME/.local/share}/afl.rs" -name afl-cmin.bash | head -n 1)")
ledger=$fuzz/campaign.tsv
[[ -f $ledger ]] || printf 'date\ttarget\twall_s\tcpu_s\texecs\tedges_found\ttotal_edges\tbitmap_cvg\tcorpus\tcrashes\thangs\n' >"$ledger"

run_target() {
    local t=$1 out=$fuzz/out/$1 seeds=$fuzz/out/$1.seeds
    mkdir -p "$out" "$seeds"
    "$bin" seeds "$t" "$seeds"
    "$bin" dict "$t" "$fuzz/out/$t.dict"
    if [[ -d $fuzz/corpus/$t ]]; then cp "$fuzz/corpus/$t"/* "$seeds"/ 2>/dev/null || true; fi
    local stats=$out/default/fuzzer_stats before=0
    # A resumed run's stats carry on from the last run's: count the difference.
    if [[ -f $stats ]]; then before=$(awk -F' *: *' '$1 == "execs_done" {print $2}' "$stats"); fi
    # CPU time: afl kills the target's processes without reaping them, so
    # time(1) misses most of it. Every 2 s, read the user + system ticks of
    # each process whose command line names this target (afl-fuzz, its fork
    # server, the persistent children) and keep each one's last reading.
    local ticks=$fuzz/out/$t.ticks started
    : >"$ticks"
    started=$(date +%s)
    AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_AUTORESUME=1 AFL_NO_AFFINITY=1 \
        AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 \
        nice -n "$nice_level" cargo afl fuzz -V $((minutes * 60)) -t 2000 -m none \
        -i "$seeds" -o "$out" -x "$fuzz/out/$t.dict" -- "$bin" "$t" >"$fuzz/out/$t.log" 2>&1 &
    local afl=$!
    while kill -0 "$afl" 2>/dev/null; do
        for pid in $(pgrep -f "headkl-fuzz $t\$"); do
            # Fields 14 and 15 of /proc/PID/stat, after the command in parentheses.
            sed -E 's/^[0-9]+ \(.*\) //' "/proc/$pid/stat" 2>/dev/null |
                awk -v pid="$pid" '{print pid, $12 + $13}' >>"$ticks"
        done
        sleep 2
    done
    wait "$afl" || true
    local wall=$(($(date +%s) - started)) cpu
    cpu=$(awk -v hz="$(getconf CLK_TCK)" '{last[$1] = $2} END {for (p in last) s += last[p]; printf "%.0f", s / hz}' "$ticks")
    if [[ ! -f $stats ]]; then
        echo "fuzz.sh: $t: afl wrote no stats; see $fuzz/out/$t.log" >&2
        return 1
    fi
    stat() { awk -F' *: *' -v k="$1" '$1 == k {print $2}' "$stats"; }
    # The corpus, minimized to the inputs that keep its coverage.
    local min=$fuzz/out/$t.cmin
    rm -rf "$min"
    # The bash afl-cmin: the Python one (what `cargo afl cmin` runs) reads
    # no coverage from afl.rs's persistent binary and keeps nothing.
    AFL_SKIP_BIN_CHECK=1 "$aflbin/afl-cmin.bash" -i "$out/default/queue" -o "$min" -- "$bin" "$t" \
        >"$fuzz/out/$t.cmin.log" 2>&1 || true
    if compgen -G "$min/*" >/dev/null; then
        rm -rf "$fuzz/corpus/$t"
        mkdir -p "$fuzz/corpus/$t"
        local i=0
        for f in "$min"/*; do cp "$f" "$fuzz/corpus/$t/$(printf '%04d' $i)"; i=$((i + 1)); done
    fi
    local crashes hangs corpus
    crashes=$(find "$out/default/crashes" -name 'id:*' 2>/dev/null | wc -l)
    hangs=$(find "$out/default/hangs" -name 'id:*' 2>/dev/null | wc -l)
    corpus=$(find "$fuzz/corpus/$t" -type f 2>/dev/null | wc -l)
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%F)" "$t" "$wall" "$cpu" \
        "$(($(stat execs_done) - before))" "$(stat edges_found)" "$(stat total_edges)" "$(stat bitmap_cvg)" \
        "$corpus" "$crashes" "$hangs" >>"$ledger"
    echo "fuzz.sh: $t: $wall s wall, $cpu CPU-s, $(($(stat execs_done) - before)) execs, edges $(stat edges_found)/$(stat total_edges), crashes $crashes, hangs $hangs"
}

running=0
for t in $targets; do
    run_target "$t" &
    running=$((running + 1))
    if ((running >= jobs)); then
        wait -n || true
        running=$((running - 1))
    fi
done
wait
echo "fuzz.sh: CPU seconds per target so far (crates/fuzz/campaign.tsv):"
awk -F'\t' 'NR > 1 {cpu[$2] += $4; ex[$2] += $5} END {for (t in cpu) printf "  %-12s %7d CPU-s  %12d execs\n", t, cpu[t], ex[t]}' "$ledger"
