//! Where work runs: every backend's devices, and the [`Target`] a caller's
//! choice (a backend or `auto`, and a device index) resolves to.

use std::sync::Arc;

use headkl_core::DeviceInfo;

use crate::backend::{on_kind, RuntimeBackend, Visit};
use crate::error::{Error, Field};
use crate::kind::{BackendArg, BackendKind};
use crate::policy::{auto_pick, best_gpu, Candidate};
use crate::settings::Settings;

/// What a caller chose: a backend (or `auto`) and a device index, either
/// left out for the settings (`HEADKL_BACKEND`, `HEADKL_DEVICE`) to fill in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// The backend (`None`: the settings', else `auto`).
    pub backend: Option<BackendArg>,
    /// The device index within the backend (`None`: the settings', else
    /// the backend's best).
    pub device: Option<usize>,
}

impl Selection {
    /// The selection with `HEADKL_BACKEND` and `HEADKL_DEVICE` filled in
    /// where the caller left them out (the caller wins).
    pub fn with_settings(self, settings: &Settings) -> Self {
        Self {
            backend: self.backend.or(settings.backend),
            device: self.device.or(settings.device()),
        }
    }
}

/// Every backend's devices, and the backends whose enumeration failed.
#[derive(Clone, Debug, Default)]
pub struct Enumeration {
    /// Devices found, backend by backend in policy order.
    pub candidates: Vec<Candidate>,
    /// Backends that could not enumerate, with why.
    pub failures: Vec<(BackendKind, String)>,
}

impl Enumeration {
    /// Why `kind` has no devices, if its enumeration failed.
    pub fn failure(&self, kind: BackendKind) -> Option<&str> {
        self.failures
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, why)| why.as_str())
    }
}

/// Lists one backend's devices, as opening it would use them with the
/// settings (`HEADKL_NO_COOPMAT` turns matrix units off in the listing).
pub fn enumerate_backend(kind: BackendKind, settings: &Settings) -> headkl_core::Result<Vec<DeviceInfo>> {
    struct List<'a>(&'a Settings);
    impl Visit for List<'_> {
        type Output = headkl_core::Result<Vec<DeviceInfo>>;
        fn visit<B: RuntimeBackend>(self) -> Self::Output {
            B::enumerate(self.0)
        }
    }
    let mut infos = on_kind(kind, List(settings))?;
    if settings.force_fallback() {
        for info in &mut infos {
            info.matrix_units = false;
        }
    }
    Ok(infos)
}

/// Lists every backend's devices; a backend that cannot enumerate is
/// recorded with why (a machine without a Vulkan loader still lists the
/// reference).
pub fn enumerate_all(settings: &Settings) -> Enumeration {
    let mut e = Enumeration::default();
    for kind in BackendKind::ALL {
        match enumerate_backend(kind, settings) {
            Ok(infos) if infos.is_empty() => e.failures.push((kind, "no devices found".into())),
            Ok(infos) => {
                e.candidates.extend(
                    infos
                        .into_iter()
                        .enumerate()
                        .map(|(index, info)| Candidate { kind, index, info }),
                )
            }
            Err(why) => e.failures.push((kind, why.to_string())),
        }
    }
    e
}

/// A backend and device to open, with the settings it opens with.
#[derive(Clone, Debug)]
pub struct Target {
    /// The backend.
    pub kind: BackendKind,
    /// The device index (`None`: the backend's default).
    pub device: Option<usize>,
    /// Why `auto` chose it, when it did.
    pub auto_reason: Option<String>,
    /// The settings (the backends' options among them).
    pub settings: Arc<Settings>,
}

impl Target {
    /// The same backend and settings on device `device`.
    pub fn on_device(&self, device: Option<usize>) -> Target {
        Target { device, ..self.clone() }
    }
}

/// The device of `kind` to run on when no `auto` is involved: the best
/// usable one (or the one `device` names), or why there is none. A device
/// index the backend does not have is a bad option.
pub fn target_for(kind: BackendKind, device: Option<usize>, settings: &Arc<Settings>) -> Result<Target, Error> {
    let target = |device| Target {
        kind,
        device,
        auto_reason: None,
        settings: settings.clone(),
    };
    if kind == BackendKind::Reference {
        check_index(kind, device, 1)?;
        return Ok(target(device));
    }
    let candidates: Vec<Candidate> = enumerate_backend(kind, settings)
        .map_err(|source| Error::Start { kind, source })?
        .into_iter()
        .enumerate()
        .map(|(index, info)| Candidate { kind, index, info })
        .collect();
    if !candidates.is_empty() {
        check_index(kind, device, candidates.len())?;
    }
    let usable = |c: &&Candidate| c.info.unusable.is_none() && device.is_none_or(|d| c.index == d);
    // A named backend runs where it can, software rasterizers included.
    if let Some(c) = best_gpu(&candidates, device).or_else(|| candidates.iter().find(usable)) {
        return Ok(target(Some(c.index)));
    }
    let why: Vec<String> = candidates
        .iter()
        .filter(|c| device.is_none_or(|d| c.index == d))
        .map(|c| {
            format!(
                "device {} ({}): {}",
                c.index,
                c.info.device_name,
                c.info.unusable.as_deref().unwrap_or("not usable")
            )
        })
        .collect();
    Err(Error::Start {
        kind,
        source: headkl_core::Error::NoDevice {
            backend: kind.name(),
            reason: if why.is_empty() {
                "no devices found".into()
            } else {
                why.join("; ")
            },
        },
    })
}

/// `device` within `count` devices of `kind`, else a bad option.
fn check_index(kind: BackendKind, device: Option<usize>, count: usize) -> Result<(), Error> {
    match device {
        Some(d) if d >= count => Err(Error::option(
            Field::Device,
            format!(
                "{kind} has no device {d} ({count} device{}; `headkl devices` lists them)",
                if count == 1 { "" } else { "s" }
            ),
        )),
        _ => Ok(()),
    }
}

/// The target `selection` runs on: the named backend, or `auto`'s pick
/// (the settings fill in what the selection leaves out). A device index
/// that no backend in question has is a bad option.
pub fn resolve(selection: Selection, settings: &Arc<Settings>) -> Result<Target, Error> {
    let selection = selection.with_settings(settings);
    match selection.backend.unwrap_or(BackendArg::Auto) {
        BackendArg::Auto => {
            let e = enumerate_all(settings);
            if let Some(d) = selection.device {
                if !e.candidates.iter().any(|c| c.index == d) {
                    return Err(Error::option(
                        Field::Device,
                        format!("no backend has a device {d} (`headkl devices` lists them)"),
                    ));
                }
            }
            let pick = auto_pick(&e.candidates, selection.device);
            Ok(Target {
                kind: pick.kind,
                device: Some(pick.index),
                auto_reason: Some(pick.reason),
                settings: settings.clone(),
            })
        }
        BackendArg::Named(kind) => {
            let count = match kind {
                BackendKind::Reference => Some(1),
                // A backend that cannot enumerate fails at open, with why.
                _ => enumerate_backend(kind, settings)
                    .ok()
                    .map(|infos| infos.len())
                    .filter(|&n| n > 0),
            };
            if let Some(count) = count {
                check_index(kind, selection.device, count)?;
            }
            Ok(Target {
                kind,
                device: selection.device,
                auto_reason: None,
                settings: settings.clone(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_resolves_without_a_device_and_refuses_a_second() {
        let settings = Arc::new(Settings::default());
        let reference = Selection {
            backend: Some(BackendArg::Named(BackendKind::Reference)),
            device: None,
        };
        let t = resolve(reference, &settings).unwrap();
        assert_eq!((t.kind, t.device), (BackendKind::Reference, None));
        let e = resolve(
            Selection {
                device: Some(1),
                ..reference
            },
            &settings,
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::BadOption { field: Field::Device, message } if message.contains("no device 1")),
            "{e}"
        );
        assert!(e.to_string().starts_with("--device: reference has no device 1"), "{e}");
        let e = target_for(BackendKind::Reference, Some(4), &settings).unwrap_err();
        assert!(e.to_string().contains("no device 4"), "{e}");
    }

    #[test]
    fn the_settings_fill_in_what_the_selection_leaves_out() {
        let settings = Settings {
            backend: Some(BackendArg::Named(BackendKind::Wgpu)),
            ..Settings::default()
        };
        let given = Selection {
            backend: Some(BackendArg::Auto),
            device: None,
        };
        assert_eq!(given.with_settings(&settings).backend, Some(BackendArg::Auto));
        assert_eq!(
            Selection::default().with_settings(&settings).backend,
            Some(BackendArg::Named(BackendKind::Wgpu))
        );
    }
}
