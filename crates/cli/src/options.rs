//! Options more than one subcommand takes, each written once and
//! flattened into the subcommands' argument structs.

use headkl_core::DEFAULT_BUDGET_BYTES;

/// `--budget`: the device memory a job's scratch may take.
#[derive(clap::Args, Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetArg {
    /// Device-memory budget for scratch, bytes (K/M/G suffixes)
    #[arg(id = "budget", long = "budget", value_name = "BYTES", value_parser = crate::text::parse_bytes,
          default_value = BUDGET_DEFAULT_TEXT)]
    pub bytes: u64,
}

/// [`DEFAULT_BUDGET_BYTES`] as `--help` shows it.
const BUDGET_DEFAULT_TEXT: &str = "2G";

impl Default for BudgetArg {
    fn default() -> Self {
        Self {
            bytes: DEFAULT_BUDGET_BYTES,
        }
    }
}

/// The most vocabulary shards `--shards` takes: each is an engine and a
/// thread.
pub const MAX_SHARDS: usize = 256;

/// `--shards N`'s value, for every subcommand that takes it: 1 to
/// [`MAX_SHARDS`].
pub fn parse_shard_count(s: &str) -> Result<usize, String> {
    let n: usize = s
        .trim()
        .parse()
        .map_err(|e| format!("`{s}`: {e} (a number of shards, 1 to {MAX_SHARDS})"))?;
    if (1..=MAX_SHARDS).contains(&n) {
        Ok(n)
    } else {
        Err(format!("`{s}`: must be 1 to {MAX_SHARDS}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_counts_are_one_to_the_most() {
        assert_eq!(parse_shard_count("1"), Ok(1));
        assert_eq!(parse_shard_count(" 256 "), Ok(MAX_SHARDS));
        for bad in ["0", "257", "-1", "x", ""] {
            assert!(parse_shard_count(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_budget_default_is_cores() {
        assert_eq!(crate::text::parse_bytes(BUDGET_DEFAULT_TEXT), Ok(DEFAULT_BUDGET_BYTES));
    }
}
