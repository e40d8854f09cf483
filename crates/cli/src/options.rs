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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_default_is_cores() {
        assert_eq!(crate::text::parse_bytes(BUDGET_DEFAULT_TEXT), Ok(DEFAULT_BUDGET_BYTES));
    }
}
