//! The tune cache: where `headkl tune` keeps each device's fastest GEMM
//! choice, one line per `(backend, device, driver)`, and the tiles that
//! failed there (a PTX module the driver refused, a device lost under
//! them), so that no default picks them again until a re-tune.

use std::path::Path;

use crate::toolkit::gemm_choice::{CoopGemm, GemmChoice};

/// The environment variable that moves the tune cache's folder (read by
/// [`crate::toolkit::settings`], which also finds the default folder).
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

/// A tile that failed on a device: not picked by a default or a cached
/// choice there until `headkl tune` runs again (an explicit choice still
/// runs it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedTile {
    /// Backend name.
    pub backend: String,
    /// Device name.
    pub device: String,
    /// Driver name and version.
    pub driver: String,
    /// The tile.
    pub tile: CoopGemm,
    /// What happened, as the error said it.
    pub reason: String,
}

/// The tune cache: one line per `(backend, device, driver)`, tab-separated,
/// with the choice last; a failed tile's line has `failed:<tile>` in the
/// choice's place and the reason after it. Unreadable lines are skipped (a
/// cache never stops a run); writing replaces the file whole.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TuneCache {
    /// Entries in file order.
    pub entries: Vec<TuneEntry>,
    /// Failed tiles in file order.
    pub failed: Vec<FailedTile>,
}

/// The prefix of a failed tile's line in the choice's column.
const FAILED: &str = "failed:";

/// A cache field: no tabs or line breaks (a parsed field has none).
fn clean(text: &str) -> String {
    text.replace(['\t', '\n'], " ")
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
        let mut cache = Self::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let mut f = line.split('\t');
            let (Some(backend), Some(device), Some(driver), Some(choice)) = (f.next(), f.next(), f.next(), f.next())
            else {
                continue;
            };
            let (backend, device, driver) = (backend.to_string(), device.to_string(), driver.to_string());
            if let Some(tile) = choice.strip_prefix(FAILED) {
                // One tile names the kernel for both layouts.
                if let Ok(named) = GemmChoice::parse(tile, GemmChoice::PORTABLE) {
                    cache.failed.push(FailedTile {
                        backend,
                        device,
                        driver,
                        tile: named.logits,
                        // Written back without the line's last carriage return.
                        reason: f.next().unwrap_or("").trim_end_matches('\r').to_string(),
                    });
                }
            } else if let Ok(choice) = GemmChoice::parse(choice, GemmChoice::PORTABLE) {
                // Entries name both layouts, so the base is never used.
                cache.entries.push(TuneEntry {
                    backend,
                    device,
                    driver,
                    choice,
                });
            }
        }
        cache
    }

    /// The tiles marked failed on a device.
    pub fn failed_tiles(&self, backend: &str, device: &str, driver: &str) -> Vec<&FailedTile> {
        let (backend, device, driver) = (clean(backend), clean(device), clean(driver));
        self.failed
            .iter()
            .filter(|f| f.backend == backend && f.device == device && f.driver == driver)
            .collect()
    }

    /// Marks `tile` failed on a device with `reason`, replacing an earlier
    /// mark of it.
    pub fn mark_failed(&mut self, backend: &str, device: &str, driver: &str, tile: CoopGemm, reason: &str) {
        let (backend, device, driver) = (clean(backend), clean(device), clean(driver));
        self.failed
            .retain(|f| !(f.backend == backend && f.device == device && f.driver == driver && f.tile == tile));
        self.failed.push(FailedTile {
            backend,
            device,
            driver,
            tile,
            reason: clean(reason).trim_end_matches('\r').to_string(),
        });
    }

    /// The choice recorded for a device, if any.
    pub fn lookup(&self, backend: &str, device: &str, driver: &str) -> Option<GemmChoice> {
        self.entries
            .iter()
            .rev()
            .find(|e| e.backend == backend && e.device == device && e.driver == driver)
            .map(|e| e.choice)
    }

    /// Records `choice` for a device (a tune's result), replacing any
    /// earlier entry and clearing the device's failed tiles: the tune ran
    /// them again.
    pub fn insert(&mut self, backend: &str, device: &str, driver: &str, choice: GemmChoice) {
        let (backend, device, driver) = (clean(backend), clean(device), clean(driver));
        self.entries
            .retain(|e| !(e.backend == backend && e.device == device && e.driver == driver));
        self.failed
            .retain(|f| !(f.backend == backend && f.device == device && f.driver == driver));
        self.entries.push(TuneEntry {
            backend,
            device,
            driver,
            choice,
        });
    }

    /// The file's text.
    pub fn to_text(&self) -> String {
        let mut text = String::from(
            "# headkl tune cache: backend, device, driver, GEMM choice (written by `headkl tune`), \
             or failed:<tile> and why (written where a tile failed; `headkl tune` clears them)\n",
        );
        for e in &self.entries {
            text.push_str(&format!("{}\t{}\t{}\t{}\n", e.backend, e.device, e.driver, e.choice));
        }
        for f in &self.failed {
            text.push_str(&format!(
                "{}\t{}\t{}\t{FAILED}{}\t{}\n",
                f.backend, f.device, f.driver, f.tile, f.reason
            ));
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
    fn failed_tiles_round_trip_and_a_tune_clears_them() {
        let wgmma = GemmChoice::WGMMA_DEFAULT;
        let mut cache = TuneCache::default();
        cache.insert("vulkan", "NVIDIA H200", "580", GemmChoice::GLSL_DEFAULT);
        cache.mark_failed(
            "vulkan",
            "NVIDIA H200",
            "580",
            wgmma.logits,
            "VK_ERROR_DEVICE_LOST\tin\nthe call",
        );
        cache.mark_failed("vulkan", "NVIDIA H200", "580", wgmma.dx, "refused");
        cache.mark_failed("vulkan", "NVIDIA H200", "580", wgmma.dx, "refused again");
        cache.mark_failed("vulkan", "Other", "580", wgmma.dx, "x");
        let back = TuneCache::parse(&cache.to_text());
        assert_eq!(back, cache);
        let marked = back.failed_tiles("vulkan", "NVIDIA H200", "580");
        let named: Vec<_> = marked.iter().map(|f| (f.tile, f.reason.as_str())).collect();
        assert_eq!(
            named,
            [
                (wgmma.logits, "VK_ERROR_DEVICE_LOST in the call"),
                (wgmma.dx, "refused again")
            ]
        );
        // The choice is untouched by the marks; a tune's result clears the
        // device's marks, not another device's.
        assert_eq!(
            back.lookup("vulkan", "NVIDIA H200", "580"),
            Some(GemmChoice::GLSL_DEFAULT)
        );
        let mut tuned = back.clone();
        tuned.insert("vulkan", "NVIDIA H200", "580", wgmma);
        assert!(tuned.failed_tiles("vulkan", "NVIDIA H200", "580").is_empty());
        assert_eq!(tuned.failed_tiles("vulkan", "Other", "580").len(), 1);
        // A mark naming no tile of this build is skipped, as a bad entry is.
        let odd = TuneCache::parse("vulkan\tX\tY\tfailed:wgmma:bm8\twhy\n");
        assert!(odd.failed.is_empty() && odd.entries.is_empty());
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
