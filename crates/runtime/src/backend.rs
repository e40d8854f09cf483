//! The backends the runtime opens, and the one match that turns a
//! [`BackendKind`] into a backend's type ([`on_kind`]): everything else in
//! the runtime, and every caller's work, is generic over [`RuntimeBackend`].

use std::panic::{self, AssertUnwindSafe};

use headkl_core::toolkit::settings::CommonOptions;
use headkl_core::{Backend, DeviceInfo, GemmChoice};
use headkl_cuda::CudaBackend;
use headkl_reference::CpuBackend;
use headkl_vulkan::VulkanBackend;
use headkl_wgpu::WgpuBackend;

use crate::error::{Error, Field};
use crate::kind::BackendKind;
use crate::run::Job;
use crate::settings::Settings;
use crate::target::Target;

/// A backend the runtime can list, open and run work on.
pub trait RuntimeBackend: Backend<Buffer: Send> + Send + Sync + Sized + 'static {
    /// Which backend this is.
    const KIND: BackendKind;

    /// The backend's devices, as opening with `settings` would see them.
    fn enumerate(settings: &Settings) -> headkl_core::Result<Vec<DeviceInfo>>;

    /// Opens the backend on `target`'s device with the GEMM kernels `gemm`
    /// (`None`: the backend's own choice: `HEADKL_GEMM`, the tune cache,
    /// the default); its other options come from `target`'s settings.
    fn open(target: &Target, gemm: Option<GemmChoice>) -> Result<Self, Error>;

    /// Runs `job` on this backend: [`Job::run_resident`] where the backend
    /// works on device buffers, else [`Job::run`].
    fn accept<J: Job>(self, job: J) -> J::Output;
}

/// Work that names a backend's type: [`on_kind`] calls `visit` with the
/// type of the backend a [`BackendKind`] names.
pub trait Visit {
    /// What the work returns.
    type Output;
    /// Does the work on backend type `B`.
    fn visit<B: RuntimeBackend>(self) -> Self::Output;
}

/// The one match over the backends: `visit` with `kind`'s type.
pub fn on_kind<V: Visit>(kind: BackendKind, visit: V) -> V::Output {
    match kind {
        BackendKind::Cuda => visit.visit::<CudaBackend>(),
        BackendKind::Vulkan => visit.visit::<VulkanBackend>(),
        BackendKind::Wgpu => visit.visit::<WgpuBackend>(),
        BackendKind::Reference => visit.visit::<CpuBackend>(),
    }
}

/// Runs `f`, turning a panic inside a backend's enumeration or start-up
/// (a driver a backend does not expect) into [`headkl_core::Error::Backend`]
/// instead of a crash. The panic message still goes through the process's
/// hook (no hook swapping: tests run in parallel).
pub fn contained<T>(backend: &'static str, f: impl FnOnce() -> headkl_core::Result<T>) -> headkl_core::Result<T> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let msg = headkl_core::toolkit::panic_message(&*payload);
            Err(headkl_core::Error::Backend {
                backend,
                message: format!("panicked: {msg}"),
            })
        }
    }
}

impl RuntimeBackend for CpuBackend {
    const KIND: BackendKind = BackendKind::Reference;

    fn enumerate(_: &Settings) -> headkl_core::Result<Vec<DeviceInfo>> {
        Ok(vec![CpuBackend::new().info().clone()])
    }

    fn open(target: &Target, _: Option<GemmChoice>) -> Result<Self, Error> {
        if target.device.is_some_and(|d| d != 0) {
            return Err(Error::option(
                Field::Device,
                "the reference backend has one device, index 0",
            ));
        }
        Ok(CpuBackend::new())
    }

    fn accept<J: Job>(self, job: J) -> J::Output {
        job.run(self)
    }
}

/// Opens a GPU backend on `target` with `options`, the settings' options
/// of that backend: the target's device and the GEMM kernels `gemm` laid
/// over them, a panic inside contained.
fn open_gpu<B, O: Clone>(
    target: &Target,
    gemm: Option<GemmChoice>,
    options: &O,
    common: impl FnOnce(&mut O) -> &mut CommonOptions,
    open: impl FnOnce(&O) -> headkl_core::Result<B>,
    kind: BackendKind,
) -> Result<B, Error> {
    let mut options = options.clone();
    let shared = common(&mut options);
    shared.device = target.device.or(shared.device);
    shared.gemm = gemm;
    contained(kind.name(), || open(&options)).map_err(|source| Error::Start { kind, source })
}

/// [`RuntimeBackend`] for the GPU backend `$backend` of kind `$kind`,
/// whose options are the settings' field `$options` and whose devices
/// `$enumerate` lists: the GPU backends differ only in these.
macro_rules! gpu_backend {
    ($backend:ty, $kind:expr, $options:ident, $enumerate:expr) => {
        impl RuntimeBackend for $backend {
            const KIND: BackendKind = $kind;

            fn enumerate(settings: &Settings) -> headkl_core::Result<Vec<DeviceInfo>> {
                let list: fn(&Settings) -> headkl_core::Result<Vec<DeviceInfo>> = $enumerate;
                contained(Self::KIND.name(), || list(settings))
            }

            fn open(target: &Target, gemm: Option<GemmChoice>) -> Result<Self, Error> {
                let options = &target.settings.$options;
                open_gpu(
                    target,
                    gemm,
                    options,
                    |o| &mut o.common,
                    <$backend>::open_with,
                    Self::KIND,
                )
            }

            fn accept<J: Job>(self, job: J) -> J::Output {
                job.run_resident(self)
            }
        }
    };
}

gpu_backend!(CudaBackend, BackendKind::Cuda, cuda, |_| headkl_cuda::enumerate());
gpu_backend!(WgpuBackend, BackendKind::Wgpu, wgpu, |_| headkl_wgpu::enumerate());
gpu_backend!(VulkanBackend, BackendKind::Vulkan, vulkan, |settings| {
    headkl_vulkan::enumerate_with(&settings.vulkan.common.gemm_sources)
});

#[cfg(test)]
mod tests {
    use super::*;

    /// The type `on_kind` hands over for each kind is that kind's backend.
    struct Kind;
    impl Visit for Kind {
        type Output = BackendKind;
        fn visit<B: RuntimeBackend>(self) -> BackendKind {
            B::KIND
        }
    }

    #[test]
    fn every_kind_visits_its_own_backend() {
        for kind in BackendKind::ALL {
            assert_eq!(on_kind(kind, Kind), kind);
        }
    }

    #[test]
    fn contained_turns_panics_into_errors() {
        let r: headkl_core::Result<()> = contained("probe", || panic!("boom"));
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("probe") && msg.contains("panicked: boom"), "{msg}");
        assert_eq!(contained("probe", || Ok(3)).ok(), Some(3));
    }
}
