//! The device-resident entry points on the CUDA backend: the shared
//! resident conformance cases (bad data on the device gives the host path's
//! error).

headkl_conformance::resident_conformance_tests!(
    "cuda",
    headkl_cuda::CudaBackend::open_with(&headkl_cuda::CudaOptions {
        common: headkl_core::toolkit::settings::CommonOptions::from_env(&headkl_conformance::harness_env())
            .expect("a HEADKL_* setting does not parse"),
    })
);
