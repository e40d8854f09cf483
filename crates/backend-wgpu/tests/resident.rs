//! The device-resident entry points on the wgpu backend: the shared
//! resident conformance cases (crates/reference), and the backend on a
//! caller's device with views of the caller's buffers.

use headkl_core::{
    DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, Engine, Error, HeadData, HeadWeights, Hidden,
    HiddenDtype, LossOptions, SliceOptions, Teacher,
};
use headkl_reference::conformance::open_or_skip;
use headkl_reference::Tolerance;
use headkl_wgpu::{OpenOptions, WgpuBackend};

headkl_reference::resident_conformance_tests!(
    "wgpu",
    WgpuBackend::open_with(&OpenOptions::from_settings(
        &headkl_reference::conformance::harness_settings(),
        None
    ))
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
/// offset of one of the trainer's buffers, against the host path.
#[test]
fn head_kl_on_the_trainers_device_and_buffers() {
    let Some((adapter, device, queue)) = open_or_skip("wgpu", || trainer_device(WgpuBackend::required_features)) else {
        return;
    };
    let backend = WgpuBackend::from_device(&adapter, device.clone(), queue.clone(), &OpenOptions::default())
        .expect("from_device");
    let (vocab, hs, ntok, k) = (500usize, 40usize, 37usize, 8usize);
    let w: Vec<f32> = (0..vocab * hs)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 200.0)
        .collect();
    let x: Vec<f32> = (0..ntok * hs).map(|i| ((i * 13 % 29) as f32 - 14.0) / 10.0).collect();
    let ids: Vec<u32> = (0..ntok * k)
        .map(|i| ((i / k) * 7 + (i % k) * 61) as u32 % vocab as u32)
        .collect();
    let probs: Vec<f32> = (0..ntok * k).map(|i| 1.0 + (i % k) as f32).collect();
    let weights: Vec<f32> = (0..ntok).map(|t| (t % 4) as f32).collect();
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).expect("head");
    let mut engine = Engine::new(
        &backend,
        &head,
        SliceOptions {
            max_rows_per_slice: Some(128),
        },
    )
    .expect("engine");

    // One trainer buffer holding every input at 256-byte aligned offsets.
    let at = |bytes: usize| (bytes as u64).next_multiple_of(256);
    let (x_off, ids_off) = (256u64, 256 + at(ntok * hs * 4));
    let probs_off = ids_off + at(ntok * k * 4);
    let w_off = probs_off + at(ntok * k * 4);
    let inputs = storage(&device, w_off + at(ntok * 4));
    queue.write_buffer(&inputs, x_off, bytemuck::cast_slice(&x));
    queue.write_buffer(&inputs, ids_off, bytemuck::cast_slice(&ids));
    queue.write_buffer(&inputs, probs_off, bytemuck::cast_slice(&probs));
    queue.write_buffer(&inputs, w_off, bytemuck::cast_slice(&weights));
    let outputs = storage(&device, 512 + at(ntok * 4) + at(ntok * hs * 4));
    let (loss_off, dx_off) = (512u64, 512 + at(ntok * 4));
    let view = |b: &wgpu::Buffer, off: u64, bytes: usize| backend.wrap_buffer(b, off, bytes as u64).expect("view");
    let xv = view(&inputs, x_off, ntok * hs * 4);
    let idv = view(&inputs, ids_off, ntok * k * 4);
    let pv = view(&inputs, probs_off, ntok * k * 4);
    let wv = view(&inputs, w_off, ntok * 4);
    let lv = view(&outputs, loss_off, ntok * 4);
    let dv = view(&outputs, dx_off, ntok * hs * 4);
    engine
        .head_kl_device(
            ntok,
            &DeviceHidden {
                buffer: &xv,
                dtype: HiddenDtype::F32,
            },
            &DeviceTeacher {
                ids: &idv,
                probs: &pv,
                k,
            },
            &DeviceLossOutput { loss: &lv, dx: &dv },
            &DeviceLossOptions {
                weights: Some(&wv),
                max_rows_per_chunk: Some(16),
                ..DeviceLossOptions::default()
            },
        )
        .expect("head_kl_device");
    engine.wait_device().expect("wait");
    let read = |off: u64, n: usize| {
        let own = backend.wrap_buffer(&outputs, off, (n * 4) as u64).expect("view");
        let mut out = vec![0f32; n];
        headkl_core::Backend::download(&backend, &own, 0, bytemuck::cast_slice_mut(&mut out)).expect("download");
        out
    };
    let (loss, dx) = (read(loss_off, ntok), read(dx_off, ntok * hs));

    let teacher = Teacher::new(&ids, &probs, ntok, k, vocab).expect("teacher");
    let opts = LossOptions {
        weights: Some(weights.clone()),
        ..LossOptions::default()
    };
    let host = engine
        .head_kl(&Hidden::f32(&x, ntok, hs).expect("hidden"), &teacher, &opts)
        .expect("host head_kl");
    let tol = Tolerance::default();
    let host_dx: Vec<f64> = host.dx.iter().map(|&v| f64::from(v)).collect();
    tol.check_dx_rows(&dx, &host_dx, Some(hs))
        .expect("dx matches the host path");
    for (t, (a, b)) in loss.iter().zip(&host.loss).enumerate() {
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1e-3), "loss[{t}]: {a} vs host {b}");
    }
    // The bytes before the views are untouched.
    let before = read(0, 64);
    assert!(
        before.iter().all(|&v| v == 0.0),
        "a kernel wrote before the dx/loss views"
    );
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
