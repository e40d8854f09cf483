//! Running work on a target: open its backend, hand it to generic code.

use headkl_core::{Backend, GemmChoice, ResidentBackend};

use crate::backend::{on_kind, RuntimeBackend, Visit};
use crate::error::{Error, Field};
use crate::target::Target;

/// Work that runs on one opened backend. Generic over the backend, so each
/// backend's buffer type stays static (no trait objects).
pub trait Job: Sized {
    /// What the job returns.
    type Output;

    /// Runs the job on a backend without device buffers (the CPU
    /// reference), or on any backend where [`Job::run_resident`] says so.
    fn run<B: Backend<Buffer: Send> + Sync>(self, backend: B) -> Self::Output;

    /// Runs the job on a backend that works on device buffers (every GPU
    /// backend): by default, as [`Job::run`].
    fn run_resident<B: ResidentBackend<Buffer: Send> + Sync>(self, backend: B) -> Self::Output {
        self.run(backend)
    }
}

/// Work that runs on several devices of one backend (vocabulary shards).
pub trait ShardsJob {
    /// What the job returns.
    type Output;
    /// Runs the job on the opened backends, one per device, in the order
    /// they were given.
    fn run<B: RuntimeBackend>(self, backends: &[B]) -> Self::Output;
}

/// Opens `target`'s backend with the GEMM kernels `gemm` (`None`: the
/// backend's own choice) and runs `job` on it.
pub fn open_and_run<J: Job>(target: &Target, gemm: Option<GemmChoice>, job: J) -> Result<J::Output, Error> {
    struct OpenRun<'a, J> {
        target: &'a Target,
        gemm: Option<GemmChoice>,
        job: J,
    }
    impl<J: Job> Visit for OpenRun<'_, J> {
        type Output = Result<J::Output, Error>;
        fn visit<B: RuntimeBackend>(self) -> Self::Output {
            Ok(B::open(self.target, self.gemm)?.accept(self.job))
        }
    }
    on_kind(target.kind, OpenRun { target, gemm, job })
}

/// Opens `target`'s backend once per entry of `devices` (`None`: the
/// backend's default device) and runs `job` on them all.
pub fn open_and_run_shards<J: ShardsJob>(
    target: &Target,
    devices: &[Option<usize>],
    job: J,
) -> Result<J::Output, Error> {
    struct OpenEach<'a, J> {
        target: &'a Target,
        devices: &'a [Option<usize>],
        job: J,
    }
    impl<J: ShardsJob> Visit for OpenEach<'_, J> {
        type Output = Result<J::Output, Error>;
        fn visit<B: RuntimeBackend>(self) -> Self::Output {
            let backends = self
                .devices
                .iter()
                .map(|&d| B::open(&self.target.on_device(d), None).map_err(for_devices))
                .collect::<Result<Vec<B>, Error>>()?;
            Ok(self.job.run(&backends))
        }
    }
    on_kind(target.kind, OpenEach { target, devices, job })
}

/// A bad device index among a sharded run's devices is a bad `--devices`.
fn for_devices(e: Error) -> Error {
    match e {
        Error::BadOption {
            field: Field::Device,
            message,
        } => Error::BadOption {
            field: Field::Devices,
            message,
        },
        other => other,
    }
}

/// Opens `target`'s backend and hands it to `visit` (with its type):
/// what a caller that keeps the backend (an engine it holds) uses.
pub fn open_backend<V: OpenVisit>(target: &Target, visit: V) -> Result<V::Output, Error> {
    struct Opening<'a, V> {
        target: &'a Target,
        visit: V,
    }
    impl<V: OpenVisit> Visit for Opening<'_, V> {
        type Output = Result<V::Output, Error>;
        fn visit<B: RuntimeBackend>(self) -> Self::Output {
            Ok(self.visit.opened(B::open(self.target, None)?))
        }
    }
    on_kind(target.kind, Opening { target, visit })
}

/// What [`open_backend`] does with the backend it opened.
pub trait OpenVisit {
    /// What it returns.
    type Output;
    /// Takes the opened backend.
    fn opened<B: RuntimeBackend>(self, backend: B) -> Self::Output;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::kind::BackendKind;
    use crate::settings::Settings;

    /// Which of the job's two entries ran, and on what.
    struct Which;
    impl Job for Which {
        type Output = (&'static str, &'static str);
        fn run<B: Backend<Buffer: Send> + Sync>(self, backend: B) -> Self::Output {
            ("run", backend.info().backend)
        }
        fn run_resident<B: ResidentBackend<Buffer: Send> + Sync>(self, backend: B) -> Self::Output {
            ("run_resident", backend.info().backend)
        }
    }

    struct Count;
    impl ShardsJob for Count {
        type Output = usize;
        fn run<B: RuntimeBackend>(self, backends: &[B]) -> usize {
            backends.len()
        }
    }

    fn reference(device: Option<usize>) -> Target {
        Target {
            kind: BackendKind::Reference,
            device,
            auto_reason: None,
            settings: Arc::new(Settings::default()),
        }
    }

    #[test]
    fn the_reference_runs_the_host_entry() {
        assert_eq!(
            open_and_run(&reference(None), None, Which).unwrap(),
            ("run", "reference")
        );
        let e = open_and_run(&reference(Some(1)), None, Which).unwrap_err();
        assert!(
            matches!(
                e,
                Error::BadOption {
                    field: Field::Device,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn shards_open_one_backend_a_device_and_name_devices_in_errors() {
        assert_eq!(
            open_and_run_shards(&reference(None), &[None, Some(0), None], Count).unwrap(),
            3
        );
        let e = open_and_run_shards(&reference(None), &[Some(0), Some(2)], Count).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("--devices: the reference backend has one device"),
            "{e}"
        );
    }
}
