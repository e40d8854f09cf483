//! The device-resident entry points on the wgpu backend: the shared
//! resident conformance cases (crates/conformance), and the backend on a
//! caller's device with views of the caller's buffers.

use headkl_conformance::open_or_skip;
use headkl_conformance::trainer::{TrainerCase, TrainerOperand};
use headkl_core::Error;
use headkl_wgpu::{OpenOptions, WgpuBackend};

headkl_conformance::resident_conformance_tests!(
    "wgpu",
    WgpuBackend::open_with(
        &OpenOptions::from_env(&headkl_conformance::harness_env()).expect("a HEADKL_* setting does not parse")
    )
);

/// The trainer's side: an adapter and a device it opened itself.
fn trainer_device(
    features: impl Fn(&wgpu::Adapter) -> wgpu::Features,
) -> headkl_core::Result<(wgpu::Adapter, wgpu::Device, wgpu::Queue)> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter =
        pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions::default())).map_err(|e| {
            Error::NoDevice {
                backend: "wgpu",
                reason: format!("request_adapter: {e}"),
            }
        })?;
    let required_features = features(&adapter);
    let desc = wgpu::DeviceDescriptor {
        label: Some("trainer"),
        required_features,
        required_limits: adapter.limits(),
        experimental_features: WgpuBackend::experimental_features(required_features),
        ..wgpu::DeviceDescriptor::default()
    };
    let (device, queue) = pollster::block_on(adapter.request_device(&desc)).map_err(|e| Error::NoDevice {
        backend: "wgpu",
        reason: format!("request_device: {e}"),
    })?;
    Ok((adapter, device, queue))
}

fn storage(device: &wgpu::Device, bytes: u64) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("trainer buffer"),
        size: bytes,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

#[test]
fn missing_f16_is_a_typed_error() {
    let Some((adapter, device, queue)) = open_or_skip("wgpu", || trainer_device(|_| wgpu::Features::empty())) else {
        return;
    };
    match WgpuBackend::from_device(&adapter, device, queue, &OpenOptions::default()) {
        Err(Error::MissingFeature(what)) => assert!(what.contains("SHADER_F16"), "{what}"),
        other => panic!("expected MissingFeature naming SHADER_F16, got {other:?}"),
    }
}

#[test]
fn wrap_checks_usage_and_range() {
    let Some((adapter, device, queue)) = open_or_skip("wgpu", || trainer_device(WgpuBackend::required_features)) else {
        return;
    };
    let backend =
        WgpuBackend::from_device(&adapter, device.clone(), queue, &OpenOptions::default()).expect("from_device");
    let uniform = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 256,
        usage: wgpu::BufferUsages::UNIFORM,
        mapped_at_creation: false,
    });
    assert!(matches!(
        backend.wrap_buffer(&uniform, 0, 256),
        Err(Error::DeviceBuffer { .. })
    ));
    let b = storage(&device, 1024);
    assert!(matches!(
        backend.wrap_buffer(&b, 512, 1024),
        Err(Error::DeviceBuffer { .. })
    ));
    assert!(matches!(backend.wrap_buffer(&b, 2, 8), Err(Error::DeviceBuffer { .. })));
    let view = backend.wrap_buffer(&b, 256, 512).expect("a view inside the buffer");
    assert_eq!((view.offset(), headkl_core::DeviceBuffer::len(&view)), (256, 512));
}

/// head_kl on the trainer's own device, every operand a view at a non-zero
/// offset of one of the trainer's buffers, written by the trainer's queue
/// (the shared [`TrainerCase`]).
#[test]
fn head_kl_on_the_trainers_device_and_buffers() {
    let Some((adapter, device, queue)) = open_or_skip("wgpu", || trainer_device(WgpuBackend::required_features)) else {
        return;
    };
    let backend = WgpuBackend::from_device(&adapter, device.clone(), queue.clone(), &OpenOptions::default())
        .expect("from_device");
    let case = TrainerCase::new();
    let at = case.layout();
    let inputs = storage(&device, at.input_bytes);
    let outputs = storage(&device, at.output_bytes);
    for (op, bytes) in case.input_writes() {
        queue.write_buffer(&inputs, case.place(op).0, bytes);
    }
    let view = |op: TrainerOperand| {
        let (offset, bytes) = case.place(op);
        let buffer = if op.in_inputs() { &inputs } else { &outputs };
        backend.wrap_buffer(buffer, offset, bytes).expect("view")
    };
    let mut engine = case.engine(&backend).expect("engine");
    case.check(&mut engine, view).unwrap_or_else(|e| panic!("{e}"));
}

/// A trainer that passes `required_features` with matrix units must also
/// opt in to wgpu's experimental features, or wgpu refuses the device
/// (seen on the H200; lavapipe never offers the feature, so the example's
/// run here cannot catch it).
#[test]
fn matrix_units_come_with_the_experimental_opt_in() {
    let coop = wgpu::Features::SHADER_F16 | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
    assert!(WgpuBackend::experimental_features(coop).is_enabled());
    assert!(!WgpuBackend::experimental_features(wgpu::Features::SHADER_F16).is_enabled());
}

/// The resident head gradient of a head whose f32 gradient is past the
/// largest binding (lavapipe: 128 MiB) is written into the caller's buffer
/// through windows of it, against the f64 reference and the host path; a
/// GPU's binding of GiBs would need GiBs of host memory, so there it says
/// so and skips.
#[test]
fn resident_head_grad_past_the_binding_limit_goes_through_windows() {
    let Some(b) = open_or_skip("wgpu", || {
        WgpuBackend::open_with(
            &OpenOptions::from_env(&headkl_conformance::harness_env()).expect("a HEADKL_* setting does not parse"),
        )
    }) else {
        return;
    };
    headkl_conformance::resident::test_head_grad_past_the_binding(&b);
}
