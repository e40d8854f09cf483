//! The backends' names: the concrete backends, and what a caller may name
//! (a backend, or `auto`).

use std::fmt;

/// A backend a caller names (`--backend`, `HEADKL_BACKEND`, Python's
/// `backend=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendArg {
    /// The best usable device (see [`crate::AUTO_POLICY`]).
    Auto,
    /// One backend.
    Named(BackendKind),
}

impl BackendArg {
    /// Every name a caller may give, `auto` first.
    pub fn names() -> Vec<&'static str> {
        std::iter::once("auto")
            .chain(BackendKind::ALL.iter().map(|k| k.name()))
            .collect()
    }

    /// The backend named `name` (any case where `ignore_case`), or
    /// `expected one of …` naming them all.
    pub fn parse(name: &str, ignore_case: bool) -> Result<Self, String> {
        let same = |known: &str| {
            if ignore_case {
                known.eq_ignore_ascii_case(name)
            } else {
                known == name
            }
        };
        if same("auto") {
            return Ok(BackendArg::Auto);
        }
        BackendKind::ALL
            .iter()
            .find(|k| same(k.name()))
            .map(|&k| BackendArg::Named(k))
            .ok_or_else(|| format!("expected one of {}", Self::names().join(", ")))
    }
}

/// A concrete backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// NVIDIA's CUDA: cuBLASLt and the CUDA C kernels.
    Cuda,
    /// Raw Vulkan through ash.
    Vulkan,
    /// wgpu.
    Wgpu,
    /// The f64 CPU reference.
    Reference,
}

impl BackendKind {
    /// Every backend, in the `auto` policy's order.
    pub const ALL: [BackendKind; 4] = [
        BackendKind::Cuda,
        BackendKind::Vulkan,
        BackendKind::Wgpu,
        BackendKind::Reference,
    ];

    /// The backend's name as `--backend` and `HEADKL_REQUIRE` spell it.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Vulkan => "vulkan",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Reference => "reference",
        }
    }

    /// Whether the backend works on device buffers (the resident calls):
    /// every GPU backend.
    pub fn has_device_buffers(self) -> bool {
        self != BackendKind::Reference
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for kind in BackendKind::ALL {
            assert_eq!(BackendArg::parse(kind.name(), false), Ok(BackendArg::Named(kind)));
        }
        assert_eq!(BackendArg::parse("auto", false), Ok(BackendArg::Auto));
        assert_eq!(
            BackendArg::parse("Vulkan", true),
            Ok(BackendArg::Named(BackendKind::Vulkan))
        );
        let why = BackendArg::parse("Vulkan", false).unwrap_err();
        assert_eq!(why, "expected one of auto, cuda, vulkan, wgpu, reference");
        assert_eq!(
            BackendArg::parse("CUDA", true),
            Ok(BackendArg::Named(BackendKind::Cuda))
        );
        assert!(BackendArg::parse("metal", true).is_err());
        // HEADKL_REQUIRE's names (the suite's) are these backends'.
        assert_eq!(
            BackendKind::ALL.map(BackendKind::name),
            headkl_conformance::BACKEND_NAMES
        );
    }
}
