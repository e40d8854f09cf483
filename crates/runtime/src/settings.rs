//! The `HEADKL_*` settings the backends open with and the engines run
//! with, read once: each section parsed by the crate that owns it (the
//! backends' options), the engine's switches here. The one list of
//! variables is `headkl_core::toolkit::settings`.

use headkl_core::toolkit::settings::{self, Env};
use headkl_core::DxSplit;

use crate::kind::BackendArg;

/// Every setting the runtime reads, parsed.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// `HEADKL_BACKEND`.
    pub backend: Option<BackendArg>,
    /// `HEADKL_TRACE`: log each head_kl call's host phases.
    pub trace: bool,
    /// `HEADKL_DX_SPLIT`.
    pub dx_split: DxSplit,
    /// `HEADKL_NO_ROW_STATS`: the KL rows fold the logits themselves.
    pub no_row_stats: bool,
    /// The wgpu backend's options (`HEADKL_DEVICE`, `HEADKL_NO_COOPMAT`,
    /// `HEADKL_CHECKED`, `HEADKL_GEMM`, `HEADKL_QUEUE`, the tune cache).
    pub wgpu: headkl_wgpu::OpenOptions,
    /// The Vulkan backend's: the same, and its own switches.
    pub vulkan: headkl_vulkan::VulkanOptions,
    /// The CUDA backend's: the shared options (its GEMMs are cuBLASLt's).
    pub cuda: headkl_cuda::CudaOptions,
}

impl Settings {
    /// Parses every section from `env`; a value that does not parse is an
    /// error naming it.
    pub fn from_env(env: &Env) -> headkl_core::Result<Self> {
        let backend = match env.text(settings::BACKEND)? {
            None => None,
            Some(v) => Some(BackendArg::parse(&v, true).map_err(|why| settings::invalid(settings::BACKEND, &v, &why))?),
        };
        // The options both backends share (HEADKL_GEMM among them) are
        // parsed once, with the Vulkan backend's, and handed to wgpu.
        let vulkan = headkl_vulkan::VulkanOptions::from_env(env)?;
        let wgpu = headkl_wgpu::OpenOptions {
            common: vulkan.common.clone(),
        };
        let cuda = headkl_cuda::CudaOptions {
            common: vulkan.common.clone(),
        };
        Ok(Self {
            backend,
            trace: env.flag(settings::TRACE)?,
            dx_split: env
                .text(settings::DX_SPLIT)?
                .map(|v| DxSplit::parse(settings::DX_SPLIT, &v))
                .transpose()?
                .unwrap_or_default(),
            no_row_stats: env.flag(settings::NO_ROW_STATS)?,
            wgpu,
            vulkan,
            cuda,
        })
    }

    /// `HEADKL_DEVICE` (both backends' options hold the same).
    pub fn device(&self) -> Option<usize> {
        self.wgpu.common.device
    }

    /// Whether `HEADKL_NO_COOPMAT` turns the matrix units off (both
    /// backends' options hold the same).
    pub fn force_fallback(&self) -> bool {
        self.wgpu.common.force_fallback
    }

    /// The engine switches these settings hold, applied to `engine`.
    pub fn apply<B: headkl_core::Backend>(&self, engine: &mut headkl_core::Engine<B>) {
        engine.set_trace(self.trace);
        engine.set_dx_split(self.dx_split);
        engine.set_row_stats(!self.no_row_stats);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kind::BackendKind;

    #[test]
    fn the_settings_parse_and_bad_values_name_them() {
        let env = Env::from_pairs([
            (settings::BACKEND, "Vulkan"),
            (settings::DEVICE, "2"),
            (settings::TRACE, "1"),
            (settings::DX_SPLIT, "3"),
            (settings::PIPELINE_STATS, "on"),
        ]);
        let s = Settings::from_env(&env).unwrap();
        assert_eq!(s.backend, Some(BackendArg::Named(BackendKind::Vulkan)));
        assert_eq!(s.device(), Some(2));
        assert_eq!(s.vulkan.common, s.wgpu.common);
        assert!(s.trace && s.vulkan.pipeline_stats && !s.vulkan.validation);
        assert_eq!(s.dx_split, DxSplit::Parts(3));
        for (name, bad) in [
            (settings::BACKEND, "metal"),
            (settings::DX_SPLIT, "17"),
            (settings::DX_SPLIT, "0"),
            (settings::VALIDATION, "maybe"),
        ] {
            let e = Settings::from_env(&Env::from_pairs([(name, bad)]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(name) && e.contains(bad), "{name}={bad}: {e}");
        }
    }
}
