//! The command line's fuzz body (`cli_args`), run by the unit tests over
//! its committed corpus (`crates/cli/corpus/cli_args`) under the fuzz
//! targets' allocation cap (`headkl_files::fuzz::run_capped`).
//!
//! The other targets (safetensors, teacher files, the tune cache, the
//! settings, vocabulary orders) are `headkl_files::fuzz`'s, which the afl.rs
//! harness (`crates/fuzz`) runs. This one needs the command's clap parser,
//! and the harness does not depend on the command, so it left the harness:
//! its corpus, from the campaigns it ran in before, is replayed here.

use std::path::{Path, PathBuf};

use clap::Parser;

/// Where the committed corpus lives.
fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/cli_args")
}

/// The arguments, separated by NUL bytes: clap's parse with every value
/// parser; help and version exit 0, every refusal 2.
fn cli_args(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let args = std::iter::once("headkl").chain(text.split('\0'));
    if let Err(e) = crate::Cli::try_parse_from(args) {
        // Help and version exit 0; every refusal exits 2.
        let expected = if e.use_stderr() { 2 } else { 0 };
        assert_eq!(e.exit_code(), expected, "{e}");
    }
}

/// Command lines that parse, one per subcommand's kind of options.
fn cli_args_seeds() -> Vec<(String, Vec<u8>)> {
    let lines: [(&str, &[&str]); 7] = [
        (
            "bench",
            &[
                "bench",
                "--shape",
                "8192:151936:896:64",
                "--budget",
                "2GiB",
                "--filter-eps",
                "auto",
            ],
        ),
        (
            "bench-order",
            &[
                "bench",
                "--data",
                "lm",
                "--vocab-order",
                "prior",
                "--shards",
                "2",
                "--resident",
            ],
        ),
        (
            "loss",
            &[
                "loss",
                "--head",
                "h.safetensors",
                "--hidden",
                "x.safetensors",
                "--teacher",
                "t.safetensors",
                "--out",
                "o.safetensors",
                "--tail",
                "bucket",
                "--temperature",
                "2",
            ],
        ),
        (
            "topk",
            &[
                "topk",
                "--head",
                "h",
                "--hidden",
                "x",
                "-k",
                "64",
                "--out",
                "o",
                "--logprobs",
            ],
        ),
        (
            "tune",
            &[
                "tune",
                "--kernels",
                "glsl:bm128.bk64.s1,staged:bk32:r4:s1:pf",
                "--no-save",
            ],
        ),
        (
            "check",
            &["check", "--backend", "vulkan", "--cases", "8", "--seed", "0x11"],
        ),
        ("soak", &["--quiet", "soak", "--calls", "10", "--threads", "2"]),
    ];
    lines
        .iter()
        .map(|(name, args)| (name.to_string(), args.join("\0").into_bytes()))
        .collect()
}

mod tests {
    use headkl_files::fuzz::run_capped;

    use super::*;

    #[test]
    fn seeds_parse_and_known_bad_lines_are_refused_as_bad_input() {
        for (name, bytes) in cli_args_seeds() {
            run_capped(&bytes, cli_args);
            let text = String::from_utf8_lossy(&bytes);
            assert!(
                crate::Cli::try_parse_from(std::iter::once("headkl").chain(text.split('\0'))).is_ok(),
                "seed {name} does not parse"
            );
        }
        run_capped(b"bench\0--shape\x000:0:0:0", cli_args);
        run_capped(b"--help", cli_args);
    }

    /// CI's replay: every committed input, through the body.
    #[test]
    fn committed_corpus_replays() {
        let mut replayed = 0;
        for entry in std::fs::read_dir(corpus_dir()).expect("the cli_args corpus") {
            let path = entry.expect("a readable corpus folder").path();
            if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
                continue;
            }
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            run_capped(&bytes, cli_args);
            replayed += 1;
        }
        assert!(replayed > 0, "no corpus under {}", corpus_dir().display());
        eprintln!("cli_args replay: {replayed} inputs");
    }
}
