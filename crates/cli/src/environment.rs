//! The command's `HEADKL_*` settings, read once at start-up: the runtime's
//! (the backends' options and the engine's switches) and the conformance
//! suite's. `headkl_core::toolkit::settings` holds the one list of
//! variables.

use std::sync::Arc;

use headkl_conformance::SuiteSettings;
use headkl_core::toolkit::settings::Env;

use crate::error::CliError;

/// Every setting the command reads, parsed.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// The runtime's: `HEADKL_BACKEND`, the backends' options, the engine's
    /// switches.
    pub runtime: Arc<headkl_runtime::Settings>,
    /// The conformance suite's (`HEADKL_CASES`, `HEADKL_SEED`,
    /// `HEADKL_REQUIRE`).
    pub suite: SuiteSettings,
}

impl Settings {
    /// Parses every section from `env`; a value that does not parse is an
    /// error naming it. (The `settings` fuzz target, in
    /// `headkl_files::fuzz`, parses the same sections in the same order: a
    /// section added here goes there too.)
    pub fn from_env(env: &Env) -> headkl_core::Result<Self> {
        Ok(Self {
            runtime: Arc::new(headkl_runtime::Settings::from_env(env)?),
            suite: SuiteSettings::from_env(env)?,
        })
    }
}

/// Reads the environment once, at start-up: gives the process a private
/// runtime folder where `XDG_RUNTIME_DIR` is unset (before anything loads
/// Vulkan), then parses every variable. A value that does not parse is a
/// bad setting (exit 2), named with its value. The command passes the
/// result down to what needs it; nothing reads it from a global.
pub fn read() -> Result<Settings, CliError> {
    headkl_conformance::ensure_runtime_dir();
    Settings::from_env(&Env::process()).map_err(CliError::Setting)
}

#[cfg(test)]
mod tests {
    use headkl_core::toolkit::settings;
    use headkl_runtime::{BackendArg, BackendKind};

    use super::*;

    #[test]
    fn the_command_line_settings_parse_and_bad_values_name_them() {
        let env = Env::from_pairs([
            (settings::BACKEND, "Vulkan"),
            (settings::DEVICE, "2"),
            (settings::REQUIRE, "wgpu"),
        ]);
        let s = Settings::from_env(&env).unwrap();
        assert_eq!(s.runtime.backend, Some(BackendArg::Named(BackendKind::Vulkan)));
        assert_eq!(s.runtime.device(), Some(2));
        assert!(s.suite.requires("wgpu"));
        for (name, bad) in [(settings::BACKEND, "metal"), (settings::REQUIRE, "metal")] {
            let e = Settings::from_env(&Env::from_pairs([(name, bad)]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(name) && e.contains(bad), "{name}={bad}: {e}");
        }
    }
}
