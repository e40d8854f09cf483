//! The PTX tiles' failures on a device, kept in the tune cache
//! ([`headkl_core::toolkit::tune_cache::FailedTile`]). Read at open: a default or
//! cached choice whose PTX tile failed on this device and driver before
//! runs the GLSL tiles instead, until `headkl tune` runs them again (an
//! explicit choice still runs them). Written where the driver refuses the
//! module, or the device is lost under a call that ran them.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use headkl_core::toolkit::tune_cache::{FailedTile, TuneCache};
use headkl_core::toolkit::CoopGemm;
use headkl_core::{ChoiceSource, Error, GemmChoice, Result};

use crate::adapter::Caps;
use crate::conv::BACKEND;

/// The first mark on a PTX tile of `choice` in the cache at `cache`, for a
/// choice from `source` that is not explicit.
pub(crate) fn marked(
    choice: GemmChoice,
    source: &ChoiceSource,
    cache: Option<&Path>,
    caps: &Caps,
) -> Option<FailedTile> {
    if source.is_explicit() || !choice.uses_ptx() {
        return None;
    }
    let cache = TuneCache::load(cache?);
    let kernels = choice.kernels();
    cache
        .failed_tiles(BACKEND, &caps.name, &caps.driver)
        .into_iter()
        .find(|f| kernels.contains(&f.tile))
        .cloned()
}

/// Marks the PTX tiles of `choice` failed on the device in the cache at
/// `cache`, with `reason`. Returns what happened, in words, for the error
/// that reports the failure.
pub(crate) fn mark(cache: Option<&Path>, caps: &Caps, choice: GemmChoice, reason: &str) -> String {
    let tiles: Vec<CoopGemm> = choice
        .kernels()
        .into_iter()
        .filter(|k| matches!(k, CoopGemm::Wgmma(_)))
        .collect();
    let names = tiles.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
    let Some(path) = cache else {
        return format!("the PTX tiles {names} ran; no tune cache to mark them failed in");
    };
    let mut failures = TuneCache::load(path);
    for &tile in &tiles {
        failures.mark_failed(BACKEND, &caps.name, &caps.driver, tile, reason);
    }
    match failures.save(path) {
        Ok(()) => format!(
            "the PTX tiles {names} ran: marked failed for this device in {}, so no default picks them \
             here until `headkl tune` runs them again",
            path.display()
        ),
        Err(e) => {
            log::warn!("could not mark {names} failed in {}: {e}", path.display());
            format!(
                "the PTX tiles {names} ran; marking them failed in {} did not work: {e}",
                path.display()
            )
        }
    }
}

/// `error` with `said` (what [`mark`] did) after its message, where the
/// error carries one; device loss stays device loss.
pub(crate) fn explained(error: Error, said: &str) -> Error {
    match error {
        Error::DeviceLost(m) => Error::DeviceLost(format!("{m}; {said}")),
        Error::Backend { backend, message } => Error::Backend {
            backend,
            message: format!("{message}; {said}"),
        },
        other => {
            log::warn!("{other}; {said}");
            other
        }
    }
}

/// `result`, where a device lost while the GEMM runs `choice` with PTX
/// tiles marks them failed ([`mark`]) the first time (`blamed` remembers)
/// and says so in the error.
pub(crate) fn blame_loss<T>(
    result: Result<T>,
    choice: Option<GemmChoice>,
    blamed: &AtomicBool,
    cache: Option<&Path>,
    caps: &Caps,
) -> Result<T> {
    let lost = matches!(result, Err(Error::DeviceLost(_)));
    match (result, choice.filter(|c| c.uses_ptx())) {
        (Err(e), Some(choice)) if lost && !blamed.swap(true, Ordering::Relaxed) => {
            let said = mark(cache, caps, choice, &e.to_string());
            Err(explained(e, &said))
        }
        (result, _) => result,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn h200() -> Caps {
        Caps {
            name: "NVIDIA H200".into(),
            driver: "NVIDIA 580.159.04".into(),
            ..Caps::default()
        }
    }

    #[test]
    fn a_mark_keeps_defaults_and_cached_choices_off_the_tile_until_a_tune() {
        let dir = std::env::temp_dir().join(format!("headkl-tile-faults-{}", std::process::id()));
        let path = dir.join(headkl_core::toolkit::tune_cache::CACHE_FILE);
        let caps = h200();
        let wgmma = GemmChoice::WGMMA_DEFAULT;
        let cached = ChoiceSource::Cache(PathBuf::from("x"));
        assert_eq!(marked(wgmma, &ChoiceSource::Default, Some(&path), &caps), None);

        let said = mark(Some(&path), &caps, wgmma, "vkQueueSubmit: VK_ERROR_DEVICE_LOST");
        assert!(
            said.contains(&wgmma.logits.to_string()) && said.contains("marked failed"),
            "{said}"
        );
        for source in [ChoiceSource::Default, cached.clone()] {
            let m = marked(wgmma, &source, Some(&path), &caps).expect("marked");
            assert_eq!(m.reason, "vkQueueSubmit: VK_ERROR_DEVICE_LOST");
        }
        // A choice the user named runs regardless; GLSL tiles, another
        // device or driver, or no cache are not marked.
        assert_eq!(marked(wgmma, &ChoiceSource::Environment, Some(&path), &caps), None);
        assert_eq!(
            marked(GemmChoice::GLSL_DEFAULT, &ChoiceSource::Default, Some(&path), &caps),
            None
        );
        let other = Caps {
            driver: "NVIDIA 590".into(),
            ..h200()
        };
        assert_eq!(marked(wgmma, &ChoiceSource::Default, Some(&path), &other), None);
        assert_eq!(marked(wgmma, &ChoiceSource::Default, None, &caps), None);

        // A tune's result clears the marks.
        let mut cache = TuneCache::load(&path);
        cache.insert(BACKEND, &caps.name, &caps.driver, wgmma);
        cache.save(&path).unwrap();
        assert_eq!(marked(wgmma, &cached, Some(&path), &caps), None);

        // No cache: the error says so.
        assert!(mark(None, &caps, wgmma, "x").contains("no tune cache"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_device_lost_under_the_ptx_tiles_marks_them_once() {
        let dir = std::env::temp_dir().join(format!("headkl-tile-loss-{}", std::process::id()));
        let path = dir.join(headkl_core::toolkit::tune_cache::CACHE_FILE);
        let caps = h200();
        let wgmma = GemmChoice::WGMMA_DEFAULT;
        let lost = || -> Result<()> { Err(Error::DeviceLost("vkQueueSubmit: VK_ERROR_DEVICE_LOST".into())) };
        let blamed = AtomicBool::new(false);
        let count = || {
            TuneCache::load(&path)
                .failed_tiles(BACKEND, &caps.name, &caps.driver)
                .len()
        };

        // Other errors, and a loss under the GLSL tiles, mark nothing.
        let other: Result<()> = Err(Error::Backend {
            backend: BACKEND,
            message: "x".into(),
        });
        assert!(blame_loss(other, Some(wgmma), &blamed, Some(&path), &caps).is_err());
        let e = blame_loss(lost(), Some(GemmChoice::GLSL_DEFAULT), &blamed, Some(&path), &caps).unwrap_err();
        assert!(!e.to_string().contains("marked"), "{e}");
        assert!(blame_loss(Ok(()), Some(wgmma), &blamed, Some(&path), &caps).is_ok());
        assert_eq!(count(), 0);

        // A loss under the PTX tiles stays a device loss, names the tiles
        // and marks both, once.
        let e = blame_loss(lost(), Some(wgmma), &blamed, Some(&path), &caps).unwrap_err();
        assert!(matches!(e, Error::DeviceLost(_)), "{e:?}");
        let text = e.to_string();
        for tile in wgmma.kernels() {
            assert!(text.contains(&tile.to_string()), "{text}");
        }
        assert!(text.contains("marked failed"), "{text}");
        assert_eq!(count(), 2);
        let again = blame_loss(lost(), Some(wgmma), &blamed, Some(&path), &caps).unwrap_err();
        assert!(!again.to_string().contains("marked"), "{again}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
