//! The afl.rs harness over `headkl_files::fuzz`'s targets (safetensors,
//! teacher, tune_cache, settings, vocab_order).
//!
//! - `headkl-fuzz TARGET`: the fuzzed program (`cargo afl fuzz … -- headkl-fuzz TARGET`);
//! - `headkl-fuzz seeds TARGET DIR`: writes the target's seed inputs;
//! - `headkl-fuzz dict TARGET FILE`: writes its afl dictionary;
//! - `headkl-fuzz replay TARGET FILE…`: runs inputs through the body, e.g. a crash.
//!
//! `scripts/fuzz.sh` drives a campaign with these.

use std::path::Path;
use std::process::ExitCode;

use headkl_files::fuzz::{CappedAlloc, Target};

#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

const USAGE: &str = "usage: headkl-fuzz TARGET | seeds TARGET DIR | dict TARGET FILE | replay TARGET FILE...";

fn target(name: &str) -> Result<Target, String> {
    Target::from_name(name).ok_or_else(|| {
        let names: Vec<&str> = Target::ALL.iter().map(|t| t.name()).collect();
        format!("no target `{name}` (targets: {})", names.join(", "))
    })
}

/// One afl dictionary entry: printable ASCII as is, the rest as `\xNN`.
fn dict_entry(word: &str) -> String {
    let mut out = String::from("\"");
    for b in word.bytes() {
        match b {
            b'"' | b'\\' => out.push_str(&format!("\\{}", b as char)),
            0x20..=0x7e => out.push(b as char),
            _ => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    out.push('"');
    out
}

fn run(args: &[String]) -> Result<(), String> {
    match args {
        [cmd, name, dir] if cmd == "seeds" => {
            let dir = Path::new(dir);
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            for (seed, bytes) in target(name)?.seeds() {
                let path = dir.join(seed);
                std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
            }
            Ok(())
        }
        [cmd, name, file] if cmd == "dict" => {
            let text: String = target(name)?
                .dictionary()
                .iter()
                .map(|w| dict_entry(w) + "\n")
                .collect();
            std::fs::write(file, text).map_err(|e| format!("{file}: {e}"))
        }
        [cmd, name, files @ ..] if cmd == "replay" => {
            let target = target(name)?;
            for file in files {
                let bytes = std::fs::read(file).map_err(|e| format!("{file}: {e}"))?;
                target.run(&bytes);
                eprintln!("{file}: passed");
            }
            Ok(())
        }
        [name] => {
            let target = target(name)?;
            afl::fuzz!(|data: &[u8]| {
                target.run(data);
            });
            Ok(())
        }
        _ => Err(USAGE.to_string()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("headkl-fuzz: {e}");
            ExitCode::from(2)
        }
    }
}
