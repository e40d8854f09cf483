//! The `auto` policy: a pure function over the enumerated devices, which
//! picks the best usable one and says why.

use headkl_core::DeviceInfo;

use crate::kind::BackendKind;

/// The `auto` policy in words, for `--help` and `headkl devices`.
pub const AUTO_POLICY: &str = "\
auto picks the first usable device in this order:
  1. CUDA (an NVIDIA GPU from Ampere on, with the driver and cuBLASLt 12
     or 13 found: cuBLASLt's GEMMs outrun what Vulkan may launch there)
  2. Vulkan with matrix units (cooperative matrices)
  3. wgpu with matrix units
  4. Vulkan without matrix units (tiled fallback GEMM)
  5. wgpu without matrix units
  6. reference (the f64 CPU backend; always there, so auto never fails)
Within one step a discrete GPU beats an integrated one, which beats a
virtual one; then the lower index. A software rasterizer (device type cpu:
lavapipe/llvmpipe, SwiftShader) is never picked: it runs the same work on
the same CPU several times slower than the reference (measured 4-5x on
lavapipe). --device N restricts auto to devices with index N.";

/// One device a backend enumerated.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Its backend.
    pub kind: BackendKind,
    /// Its index within the backend (what `--device` takes).
    pub index: usize,
    /// What it offers.
    pub info: DeviceInfo,
}

/// What `auto` chose and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AutoPick {
    /// The backend.
    pub kind: BackendKind,
    /// The device index within it.
    pub index: usize,
    /// Why, in words.
    pub reason: String,
}

/// Rank of a device type within one step of the policy (lower is better).
fn type_rank(device_type: &str) -> u8 {
    match device_type.to_ascii_lowercase().as_str() {
        t if t.contains("discrete") => 0,
        t if t.contains("integrated") => 1,
        t if t.contains("virtual") => 2,
        t if t.contains("cpu") => 4,
        _ => 3,
    }
}

/// Whether a device is a software rasterizer (lavapipe/llvmpipe,
/// SwiftShader): Vulkan and wgpu report those as device type CPU.
pub fn is_software(info: &DeviceInfo) -> bool {
    info.device_type.to_ascii_lowercase().contains("cpu")
}

/// Why `auto` passes over a usable software device, in words.
pub const SOFTWARE_REASON: &str =
    "a software rasterizer: the CPU reference runs the same work several times faster (4-5x measured on lavapipe)";

/// The policy step of a usable GPU candidate (lower is better), or `None`
/// for the reference backend, an unusable device, or a software
/// rasterizer (which ranks below the reference).
fn step(c: &Candidate) -> Option<u8> {
    if c.info.unusable.is_some() || is_software(&c.info) {
        return None;
    }
    match (c.kind, c.info.matrix_units) {
        (BackendKind::Cuda, _) => Some(0),
        (BackendKind::Vulkan, true) => Some(1),
        (BackendKind::Wgpu, true) => Some(2),
        (BackendKind::Vulkan, false) => Some(3),
        (BackendKind::Wgpu, false) => Some(4),
        (BackendKind::Reference, _) => None,
    }
}

/// The best usable GPU candidate among `candidates` (all backends, or those
/// of one backend), honouring a device filter.
pub fn best_gpu(candidates: &[Candidate], device: Option<usize>) -> Option<&Candidate> {
    candidates
        .iter()
        .filter(|c| device.is_none_or(|d| c.index == d))
        .filter_map(|c| step(c).map(|s| (s, type_rank(&c.info.device_type), c.index, c)))
        .min_by_key(|&(s, t, i, c)| (s, t, c.kind, i))
        .map(|(_, _, _, c)| c)
}

/// The `auto` policy: a pure function of the enumerated candidates (see
/// [`AUTO_POLICY`]). Falls back to the reference backend, so it never fails.
pub fn auto_pick(candidates: &[Candidate], device: Option<usize>) -> AutoPick {
    if let Some(c) = best_gpu(candidates, device) {
        let name = &c.info.device_name;
        let reason = if c.kind == BackendKind::Cuda {
            format!("cuda device {} ({name}) opens: CUDA comes first on NVIDIA", c.index)
        } else if c.info.matrix_units {
            let shapes: Vec<String> = c
                .info
                .matrix_shapes
                .iter()
                .map(|(m, n, k)| format!("{m}x{n}x{k}"))
                .collect();
            format!(
                "{} device {} ({name}) has matrix units ({}); {}",
                c.kind,
                c.index,
                shapes.join(", "),
                if c.kind == BackendKind::Vulkan {
                    "no CUDA device; Vulkan with matrix units comes next"
                } else {
                    "no Vulkan device with matrix units"
                }
            )
        } else {
            format!(
                "no usable device has matrix units; {} device {} ({name}) is the best {} device without them",
                c.kind, c.index, c.kind
            )
        };
        return AutoPick {
            kind: c.kind,
            index: c.index,
            reason,
        };
    }
    let software = candidates
        .iter()
        .any(|c| c.kind != BackendKind::Reference && c.info.unusable.is_none() && is_software(&c.info));
    let why = match (device, software) {
        (Some(d), _) => format!("no usable CUDA, Vulkan or wgpu GPU with index {d}"),
        (None, true) => "the only Vulkan/wgpu devices are software rasterizers, slower than the reference".to_string(),
        (None, false) => "no usable CUDA, Vulkan or wgpu device".to_string(),
    };
    AutoPick {
        kind: BackendKind::Reference,
        index: 0,
        reason: format!("{why}; the CPU reference always runs"),
    }
}

/// Describes a device in one line for progress messages.
pub fn describe(info: &DeviceInfo) -> String {
    format!(
        "{} on {} ({}, matrix units {})",
        info.backend,
        info.device_name,
        info.device_type,
        if info.matrix_units { "on" } else { "off" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(backend: &'static str, name: &str, ty: &str, mu: bool, unusable: Option<&str>) -> DeviceInfo {
        DeviceInfo {
            backend,
            device_name: name.into(),
            driver: "test".into(),
            device_type: ty.into(),
            matrix_units: mu,
            gemm: None,
            queue: None,
            matrix_shapes: if mu { vec![(16, 16, 16)] } else { vec![] },
            shader_f16: true,
            subgroup_size: Some(32),
            max_binding_bytes: 1 << 30,
            max_buffer_bytes: 1 << 30,
            memory_bytes: None,
            unusable: unusable.map(String::from),
        }
    }

    fn cand(kind: BackendKind, index: usize, info: DeviceInfo) -> Candidate {
        Candidate { kind, index, info }
    }

    fn reference() -> Candidate {
        cand(BackendKind::Reference, 0, info("reference", "cpu", "cpu", false, None))
    }

    #[test]
    fn vulkan_with_matrix_units_first() {
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "llvmpipe", "cpu", false, None)),
            cand(BackendKind::Vulkan, 1, info("vulkan", "H200", "discrete", true, None)),
            cand(BackendKind::Wgpu, 0, info("wgpu", "H200", "discrete", true, None)),
            reference(),
        ];
        let p = auto_pick(&c, None);
        assert_eq!((p.kind, p.index), (BackendKind::Vulkan, 1));
        assert!(p.reason.contains("matrix units"), "{}", p.reason);
    }

    #[test]
    fn wgpu_with_matrix_units_beats_vulkan_without() {
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "gpu", "discrete", false, None)),
            cand(BackendKind::Wgpu, 0, info("wgpu", "gpu", "discrete", true, None)),
            reference(),
        ];
        let p = auto_pick(&c, None);
        assert_eq!((p.kind, p.index), (BackendKind::Wgpu, 0));
    }

    #[test]
    fn vulkan_without_beats_wgpu_without_and_unusable_devices_are_skipped() {
        let c = vec![
            cand(
                BackendKind::Vulkan,
                0,
                info("vulkan", "old", "discrete", true, Some("no shaderFloat16")),
            ),
            cand(BackendKind::Wgpu, 0, info("wgpu", "igpu", "integrated", false, None)),
            cand(
                BackendKind::Vulkan,
                1,
                info("vulkan", "igpu", "integrated", false, None),
            ),
            reference(),
        ];
        let p = auto_pick(&c, None);
        assert_eq!((p.kind, p.index), (BackendKind::Vulkan, 1));
        assert!(p.reason.contains("no usable device has matrix units"), "{}", p.reason);
    }

    #[test]
    fn discrete_beats_integrated_within_a_step() {
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "vgpu", "virtual", false, None)),
            cand(
                BackendKind::Vulkan,
                1,
                info("vulkan", "igpu", "integrated", false, None),
            ),
            cand(BackendKind::Vulkan, 2, info("vulkan", "dgpu", "discrete", false, None)),
        ];
        assert_eq!(auto_pick(&c, None).index, 2);
        assert_eq!(auto_pick(&c, Some(0)).index, 0);
    }

    #[test]
    fn falls_back_to_reference() {
        let p = auto_pick(&[reference()], None);
        assert_eq!((p.kind, p.index), (BackendKind::Reference, 0));
        let p = auto_pick(&[], None);
        assert_eq!(p.kind, BackendKind::Reference);
        let c = vec![cand(
            BackendKind::Wgpu,
            0,
            info("wgpu", "gpu", "discrete", true, Some("missing f16")),
        )];
        let p = auto_pick(&c, None);
        assert_eq!(p.kind, BackendKind::Reference);
        assert!(p.reason.contains("reference"), "{}", p.reason);
        let c = vec![cand(BackendKind::Wgpu, 0, info("wgpu", "gpu", "discrete", true, None))];
        assert_eq!(auto_pick(&c, Some(3)).kind, BackendKind::Reference);
    }

    #[test]
    fn software_rasterizers_rank_below_the_reference() {
        // lavapipe on both GPU backends: auto runs the reference, and says why.
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "llvmpipe", "cpu", false, None)),
            cand(BackendKind::Wgpu, 0, info("wgpu", "llvmpipe", "Cpu", false, None)),
            reference(),
        ];
        let p = auto_pick(&c, None);
        assert_eq!(p.kind, BackendKind::Reference, "{}", p.reason);
        assert!(p.reason.contains("software rasterizers"), "{}", p.reason);
        // Even with matrix units claimed, a CPU-type device is not a GPU.
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "SwiftShader", "cpu", true, None)),
            reference(),
        ];
        assert_eq!(auto_pick(&c, None).kind, BackendKind::Reference);
        // A real GPU still wins over the reference.
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "llvmpipe", "cpu", false, None)),
            cand(
                BackendKind::Vulkan,
                1,
                info("vulkan", "igpu", "integrated", false, None),
            ),
            reference(),
        ];
        assert_eq!(
            (auto_pick(&c, None).kind, auto_pick(&c, None).index),
            (BackendKind::Vulkan, 1)
        );
    }
}
