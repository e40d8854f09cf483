//! The tune cache: where `headkl tune` keeps each device's fastest GEMM
//! choice, one line per `(backend, device, driver)`.

use std::path::Path;

use crate::gemm_choice::GemmChoice;

/// The environment variable that moves the tune cache's folder (read by
/// [`crate::settings`], which also finds the default folder).
pub const CACHE_DIR_ENV: &str = "HEADKL_CACHE_DIR";
/// The tune cache's file name within its folder.
pub const CACHE_FILE: &str = "gemm-tune.tsv";

/// One entry of the tune cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TuneEntry {
    /// Backend name.
    pub backend: String,
    /// Device name.
    pub device: String,
    /// Driver name and version.
    pub driver: String,
    /// The fastest kernels measured there.
    pub choice: GemmChoice,
}

/// The tune cache: one line per `(backend, device, driver)`, tab-separated,
/// with the choice last. Unreadable lines are skipped (a cache never stops
/// a run); writing replaces the file whole.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TuneCache {
    /// Entries in file order.
    pub entries: Vec<TuneEntry>,
}

impl TuneCache {
    /// Reads `path`; a missing or unreadable file is an empty cache.
    pub fn load(path: &Path) -> Self {
        std::fs::read_to_string(path)
            .map(|t| Self::parse(&t))
            .unwrap_or_default()
    }

    /// Parses the cache's text.
    pub fn parse(text: &str) -> Self {
        let entries = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|line| {
                let mut f = line.split('\t');
                let (backend, device, driver, choice) = (f.next()?, f.next()?, f.next()?, f.next()?);
                Some(TuneEntry {
                    backend: backend.to_string(),
                    device: device.to_string(),
                    driver: driver.to_string(),
                    // Entries name both layouts, so the base is never used.
                    choice: GemmChoice::parse(choice, GemmChoice::PORTABLE).ok()?,
                })
            })
            .collect();
        Self { entries }
    }

    /// The choice recorded for a device, if any.
    pub fn lookup(&self, backend: &str, device: &str, driver: &str) -> Option<GemmChoice> {
        self.entries
            .iter()
            .rev()
            .find(|e| e.backend == backend && e.device == device && e.driver == driver)
            .map(|e| e.choice)
    }

    /// Records `choice` for a device, replacing any earlier entry.
    pub fn insert(&mut self, backend: &str, device: &str, driver: &str, choice: GemmChoice) {
        let clean = |s: &str| s.replace(['\t', '\n'], " ");
        let (backend, device, driver) = (clean(backend), clean(device), clean(driver));
        self.entries
            .retain(|e| !(e.backend == backend && e.device == device && e.driver == driver));
        self.entries.push(TuneEntry {
            backend,
            device,
            driver,
            choice,
        });
    }

    /// The file's text.
    pub fn to_text(&self) -> String {
        let mut text =
            String::from("# headkl tune cache: backend, device, driver, GEMM choice (written by `headkl tune`)\n");
        for e in &self.entries {
            text.push_str(&format!("{}\t{}\t{}\t{}\n", e.backend, e.device, e.driver, e.choice));
        }
        text
    }

    /// Writes the cache to `path` (through a temporary file, renamed).
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension("tsv.tmp");
        std::fs::write(&tmp, self.to_text())?;
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_keeps_one_entry_per_device_and_skips_bad_lines() {
        let mut cache = TuneCache::default();
        let a = GemmChoice::PORTABLE;
        let b = GemmChoice::parse("direct", a).unwrap();
        cache.insert("vulkan", "NVIDIA H200", "580.159.04", a);
        cache.insert("wgpu", "NVIDIA H200", "580.159.04", a);
        cache.insert("vulkan", "NVIDIA H200", "580.159.04", b);
        assert_eq!(cache.entries.len(), 2);
        let text = cache.to_text() + "garbage line\nvulkan\tX\tY\tnot-a-kernel\n";
        let back = TuneCache::parse(&text);
        assert_eq!(back.entries.len(), 2);
        assert_eq!(back.lookup("vulkan", "NVIDIA H200", "580.159.04"), Some(b));
        assert_eq!(back.lookup("vulkan", "NVIDIA H200", "other"), None);

        let dir = std::env::temp_dir().join(format!("headkl-tune-test-{}", std::process::id()));
        let path = dir.join(CACHE_FILE);
        back.save(&path).unwrap();
        assert_eq!(TuneCache::load(&path), back);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(TuneCache::load(&path), TuneCache::default());
    }

    #[test]
    fn a_glsl_pick_round_trips_through_the_cache() {
        let mut cache = TuneCache::default();
        let glsl = GemmChoice::parse(
            "logits=glsl:bm128.bk64.s1,dx=staged:bk32:r4:s1:pf",
            GemmChoice::PORTABLE,
        )
        .unwrap();
        cache.insert("wgpu", "NVIDIA H200", "580.159.04", glsl);
        let back = TuneCache::parse(&(cache.to_text() + "vulkan\tX\tY\tglsl:bm96.bk32.s2\n"));
        assert_eq!(back.lookup("wgpu", "NVIDIA H200", "580.159.04"), Some(glsl));
        // A tile this build does not make is a bad line, skipped.
        assert_eq!(back.lookup("vulkan", "X", "Y"), None);
    }
}
