//! The command's `HEADKL_*` settings, read once at start-up
//! ([`headkl_core::Settings`] holds the one list and the parsers).

use std::sync::OnceLock;

use headkl_core::Settings;

use crate::error::CliError;

static SETTINGS: OnceLock<Settings> = OnceLock::new();

/// Reads the environment once: gives the process a private runtime folder
/// where `XDG_RUNTIME_DIR` is unset (before anything loads Vulkan), then
/// parses every variable. A value that does not parse is a bad setting
/// (exit 2), named with its value.
pub fn init() -> Result<(), CliError> {
    headkl_reference::conformance::ensure_runtime_dir();
    let settings = Settings::from_env().map_err(CliError::Setting)?;
    // A second call keeps the first reading: the environment is read once.
    let _ = SETTINGS.set(settings);
    Ok(())
}

/// The settings [`init`] read (the defaults before it, as in unit tests).
pub fn get() -> &'static Settings {
    SETTINGS.get_or_init(Settings::default)
}
