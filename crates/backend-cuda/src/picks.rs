//! cuBLASLt's picks kept between processes: `cublaslt-picks.tsv` in the
//! tune cache's folder holds, for each device, driver and cuBLASLt build
//! and each GEMM shape, the heuristic's candidate that ran fastest when the
//! shape was first timed. A later engine takes it without timing, so every
//! engine on the machine runs a shape with the same algorithm: timed afresh
//! from a cold clock, engines picked differently and the same GEMM took up
//! to 28% longer from one engine to the next (docs/PERFORMANCE.md, row
//! 64). A kept pick is used only where it is again one of the heuristic's
//! candidates for the shape. Deleting the file times every shape afresh.
//!
//! One line per pick: the scope (device, driver, cuBLASLt), the shape and
//! the algorithm's 64 bytes in hex, tab-separated. Lines are appended
//! whole; a later line for the same shape wins; unreadable lines are
//! skipped. A file that cannot be read or written costs a warning, never
//! the call.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The file's name, beside the tune cache's.
pub const PICKS_FILE: &str = "cublaslt-picks.tsv";

/// An algorithm as cuBLASLt stores it (`cublasLtMatmulAlgo_t::data`).
pub type AlgoBytes = [u64; 8];

/// The picks of one scope, as read at open, and where new ones go.
#[derive(Debug)]
pub struct Picks {
    /// The file; `None`: nothing is kept (no cache folder).
    path: Option<PathBuf>,
    /// The device, driver and cuBLASLt build the picks hold for.
    scope: String,
    /// Shape → algorithm, the file's lines of this scope and this
    /// engine's picks since.
    kept: Mutex<HashMap<String, AlgoBytes>>,
}

/// A field of a line: no tabs or line breaks.
fn clean(text: &str) -> String {
    text.replace(['\t', '\n', '\r'], " ")
}

fn to_hex(algo: &AlgoBytes) -> String {
    algo.iter().map(|w| format!("{w:016x}")).collect()
}

fn from_hex(text: &str) -> Option<AlgoBytes> {
    if text.len() != 128 || !text.is_ascii() {
        return None;
    }
    let mut algo = [0u64; 8];
    for (i, word) in algo.iter_mut().enumerate() {
        *word = u64::from_str_radix(&text[16 * i..16 * (i + 1)], 16).ok()?;
    }
    Some(algo)
}

impl Picks {
    /// The picks of `scope` in `folder`'s file (none kept where `folder`
    /// is `None`).
    pub fn open(folder: Option<&Path>, scope: &str) -> Self {
        let scope = clean(scope);
        let path = folder.map(|f| f.join(PICKS_FILE));
        let mut kept = HashMap::new();
        if let Some(text) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
            for line in text.lines() {
                let mut fields = line.split('\t');
                let (Some(s), Some(shape), Some(hex), None) =
                    (fields.next(), fields.next(), fields.next(), fields.next())
                else {
                    continue;
                };
                if s == scope {
                    if let Some(algo) = from_hex(hex) {
                        kept.insert(shape.to_string(), algo);
                    }
                }
            }
        }
        Self {
            path,
            scope,
            kept: Mutex::new(kept),
        }
    }

    /// The index in `candidates` of the pick kept for `shape`, where it is
    /// one of them.
    pub fn kept(&self, shape: &str, candidates: &[AlgoBytes]) -> Option<usize> {
        let kept = self.kept.lock().ok()?;
        let algo = kept.get(shape)?;
        candidates.iter().position(|c| c == algo)
    }

    /// Keeps `algo` as `shape`'s pick, in memory and in the file.
    pub fn keep(&self, shape: &str, algo: AlgoBytes) {
        if let Ok(mut kept) = self.kept.lock() {
            kept.insert(shape.to_string(), algo);
        }
        let Some(path) = &self.path else {
            return;
        };
        let line = format!("{}\t{}\t{}\n", self.scope, clean(shape), to_hex(&algo));
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::OpenOptions::new().create(true).append(true).open(path))
            // One write of the whole line: appends from other processes
            // land between lines, not inside one.
            .and_then(|mut file| file.write_all(line.as_bytes()));
        if let Err(e) = written {
            log::warn!("cuda: could not keep a cuBLASLt pick in {}: {e}", path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("headkl-picks-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn algo(seed: u64) -> AlgoBytes {
        std::array::from_fn(|i| seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(i as u32 * 7) ^ i as u64)
    }

    #[test]
    fn a_pick_kept_is_found_by_the_next_engine_of_its_scope_only() {
        let dir = folder("scope");
        let first = Picks::open(Some(&dir), "H100 | 580 | cuBLASLt 13.1");
        assert_eq!(first.kept("dx m1024", &[algo(1), algo(2)]), None);
        first.keep("dx m1024", algo(2));
        assert_eq!(first.kept("dx m1024", &[algo(1), algo(2)]), Some(1));

        let next = Picks::open(Some(&dir), "H100 | 580 | cuBLASLt 13.1");
        assert_eq!(next.kept("dx m1024", &[algo(2), algo(3)]), Some(0));
        assert_eq!(next.kept("logits m1024", &[algo(2)]), None, "another shape");
        // Not among this shape's candidates any more (another build of the
        // heuristic, say): not used.
        assert_eq!(next.kept("dx m1024", &[algo(1), algo(3)]), None);

        let other = Picks::open(Some(&dir), "H200 | 580 | cuBLASLt 13.1");
        assert_eq!(other.kept("dx m1024", &[algo(2)]), None, "another device");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_last_line_of_a_shape_wins_and_bad_lines_are_skipped() {
        let dir = folder("lines");
        std::fs::create_dir_all(&dir).unwrap();
        let scope = "dev";
        let text = format!(
            "garbage\n{scope}\tdx\tnot-hex\n{scope}\tdx\t{}\n{scope}\tdx\t{}\textra\n{scope}\tdx\t{}\n",
            to_hex(&algo(4)),
            to_hex(&algo(5)),
            to_hex(&algo(6)),
        );
        std::fs::write(dir.join(PICKS_FILE), text).unwrap();
        let picks = Picks::open(Some(&dir), scope);
        let candidates = [algo(4), algo(5), algo(6)];
        assert_eq!(picks.kept("dx", &candidates), Some(2));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn without_a_folder_picks_live_in_memory_and_tabs_cannot_break_a_line() {
        let picks = Picks::open(None, "a\tb");
        picks.keep("dx", algo(7));
        assert_eq!(picks.kept("dx", &[algo(7)]), Some(0));

        let dir = folder("tabs");
        let tabbed = Picks::open(Some(&dir), "dev\twith\ttabs");
        tabbed.keep("shape\tx", algo(8));
        let again = Picks::open(Some(&dir), "dev\twith\ttabs");
        assert_eq!(
            again.kept("shape\tx", &[algo(8)]),
            None,
            "the shape was written cleaned"
        );
        assert_eq!(again.kept("shape x", &[algo(8)]), Some(0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn hex_round_trips() {
        let a = algo(9);
        assert_eq!(from_hex(&to_hex(&a)), Some(a));
        assert_eq!(from_hex("12"), None);
        assert_eq!(from_hex(&"g".repeat(128)), None);
    }
}
