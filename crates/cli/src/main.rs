//! `headkl`: everything is in the library (`lib.rs`), so the fuzz targets
//! parse exactly what the command parses.

fn main() -> std::process::ExitCode {
    headkl_cli::main()
}
