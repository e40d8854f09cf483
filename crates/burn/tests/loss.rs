//! headkl's loss inside burn: against the f64 reference and headkl outside
//! burn (the conformance tolerances), against the loss written the burn way
//! (unfused), its gradient through burn's autodiff, top-k, the binding of
//! burn's buffers, and bad input.

use burn::prelude::{Int, Tensor};
use burn::tensor::{DType, FloatDType, TensorData};
use headkl_burn::{unfused, DeviceOptions, HeadKl, LossOptions, SharedDevice, Teacher};
use headkl_core::{
    Engine, Error, HeadData, HeadWeights, Hidden, LossOptions as HostLossOptions, SliceOptions, TopkOptions,
};
use headkl_reference::conformance::open_or_skip;
use headkl_reference::direct::{head_kl_f64, topk_f64, DirectLoss};
use headkl_reference::Tolerance;

/// Uniform values in [-scale, scale), xorshift64* from `seed`.
fn uniform(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
            (r as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A small problem: head `[V][hs]`, hidden `[ntok][hs]`, a teacher with
/// distinct ids per row, weights.
struct Case {
    vocab: usize,
    hs: usize,
    ntok: usize,
    k: usize,
    head: Vec<f32>,
    hidden: Vec<f32>,
    ids: Vec<u32>,
    probs: Vec<f32>,
    weights: Vec<f32>,
}

impl Case {
    fn new(seed: u64) -> Self {
        // 13 is prime to 300, so ids (7t + 13j) mod V are distinct in a row.
        let (vocab, hs, ntok, k) = (300, 40, 19, 8);
        let ids = (0..ntok * k)
            .map(|i| ((7 * (i / k) + 13 * (i % k)) % vocab) as u32)
            .collect();
        let probs = uniform(ntok * k, seed + 3, 1.0)
            .iter()
            .map(|u| u.abs() + 0.01)
            .collect();
        let mut weights: Vec<f32> = uniform(ntok, seed + 4, 1.0).iter().map(|u| u.abs() * 2.0).collect();
        weights[3] = 0.0;
        Self {
            vocab,
            hs,
            ntok,
            k,
            head: uniform(vocab * hs, seed + 1, 0.5),
            hidden: uniform(ntok * hs, seed + 2, 1.0),
            ids,
            probs,
            weights,
        }
    }

    fn head(&self) -> HeadWeights<'_> {
        HeadWeights::new(HeadData::F32(&self.head), self.vocab, self.hs).expect("head")
    }

    fn teacher(&self, device: &burn::tensor::Device) -> Teacher {
        let ids: Vec<i32> = self.ids.iter().map(|&i| i as i32).collect();
        Teacher {
            ids: Tensor::<2, Int>::from_data(TensorData::new(ids, [self.ntok, self.k]), device),
            probs: Tensor::from_data(TensorData::new(self.probs.clone(), [self.ntok, self.k]), device),
        }
    }

    fn hidden(&self, device: &burn::tensor::Device) -> Tensor<2> {
        Tensor::from_data(TensorData::new(self.hidden.clone(), [self.ntok, self.hs]), device)
    }

    fn weights(&self, device: &burn::tensor::Device) -> Tensor<1> {
        Tensor::from_data(TensorData::new(self.weights.clone(), [self.ntok]), device)
    }

    /// The f64 reference of DESIGN §1 on the f16-rounded head and rows.
    fn reference(&self, weights: bool, total: Option<f32>) -> DirectLoss {
        let hidden = Hidden::f32(&self.hidden, self.ntok, self.hs).expect("hidden");
        let teacher =
            headkl_core::Teacher::new(&self.ids, &self.probs, self.ntok, self.k, self.vocab).expect("teacher");
        let opts = HostLossOptions {
            weights: weights.then(|| self.weights.clone()),
            total,
            ..HostLossOptions::default()
        };
        let resolved = opts.resolve(self.ntok).expect("options");
        head_kl_f64(&self.head(), &hidden, &teacher, &resolved)
    }
}

fn open() -> Option<SharedDevice> {
    open_or_skip("wgpu", || SharedDevice::open(&DeviceOptions::default()))
}

fn host_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().expect("f32 data")
}

#[test]
fn loss_in_burn_matches_the_reference_and_headkl_outside_burn() {
    let Some(shared) = open() else { return };
    let case = Case::new(1);
    let device = shared.device();
    let mut head = HeadKl::new(&shared, &case.head(), &Default::default()).expect("HeadKl");
    let out = head
        .loss(
            &case.hidden(&device),
            &case.teacher(&device),
            Some(&case.weights(&device)),
            &LossOptions::default(),
        )
        .expect("loss");
    let per_token = host_f32(out.per_token);
    let mean = f64::from(host_f32(out.loss)[0]);
    let dx = host_f32(out.dx);
    head.wait().expect("device status");

    let tol = Tolerance::default();
    let want = case.reference(true, None);
    tol.check_loss(&per_token, mean, &want)
        .expect("loss against the f64 reference");
    tol.check_dx_rows(&dx, &want.dx, Some(case.hs))
        .expect("dx against the f64 reference");

    // headkl outside burn: its own wgpu backend, the host path, same data.
    let backend = headkl_wgpu::WgpuBackend::open(None).expect("wgpu backend");
    let mut engine = Engine::new(backend, &case.head(), SliceOptions::default()).expect("engine");
    let outside = engine
        .head_kl(
            &Hidden::f32(&case.hidden, case.ntok, case.hs).expect("hidden"),
            &headkl_core::Teacher::new(&case.ids, &case.probs, case.ntok, case.k, case.vocab).expect("teacher"),
            &HostLossOptions {
                weights: Some(case.weights.clone()),
                ..HostLossOptions::default()
            },
        )
        .expect("host head_kl");
    let f64s = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
    let outside_f64 = DirectLoss {
        loss: f64s(&outside.loss),
        mean: outside.mean,
        dx: f64s(&outside.dx),
        lse: f64s(&outside.lse),
        soft: f64s(&outside.soft),
        hard: f64s(&outside.hard),
    };
    tol.check_loss(&per_token, mean, &outside_f64)
        .expect("loss against headkl outside burn");
    tol.check_dx_rows(&dx, &outside_f64.dx, Some(case.hs))
        .expect("dx against headkl outside burn");
}

#[test]
fn backward_puts_dx_times_the_upstream_gradient_into_hidden() {
    let Some(shared) = open() else { return };
    let case = Case::new(2);
    let device = shared.device().autodiff();
    let mut head = HeadKl::new(&shared, &case.head(), &Default::default()).expect("HeadKl");
    let hidden = case.hidden(&device).require_grad();
    let out = head
        .loss(&hidden, &case.teacher(&device), None, &LossOptions::default())
        .expect("loss");
    // Upstream gradient 3: the loss scaled before backward.
    let grads = out.loss.clone().mul_scalar(3.0).backward();
    let grad = host_f32(hidden.grad(&grads).expect("hidden has a gradient"));
    let dx = host_f32(out.dx);
    head.wait().expect("device status");
    assert_eq!(grad.len(), dx.len());
    for (i, (g, d)) in grad.iter().zip(&dx).enumerate() {
        assert!(
            (g - 3.0 * d).abs() <= 1e-6 * (1.0 + d.abs()),
            "[{i}] grad {g}, 3·dx {}",
            3.0 * d
        );
    }
    assert!(dx.iter().any(|d| d.abs() > 1e-4), "dx is all but zero");
}

#[test]
fn agrees_with_the_loss_written_the_burn_way() {
    let Some(shared) = open() else { return };
    let case = Case::new(3);
    let device = shared.device().autodiff();
    let mut head = HeadKl::new(&shared, &case.head(), &Default::default()).expect("HeadKl");
    // The burn loss on the f16-rounded head and rows, as headkl's operands.
    let round = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect() };
    let head_t = Tensor::<2>::from_data(TensorData::new(round(&case.head), [case.vocab, case.hs]), &device);
    let hidden_rounded = Tensor::<2>::from_data(TensorData::new(round(&case.hidden), [case.ntok, case.hs]), &device);
    let teacher = case.teacher(&device);
    let unfused_teacher = unfused::UnfusedTeacher {
        ids: teacher.ids.clone(),
        probs: teacher.probs.clone(),
    };
    for (weights, total) in [(false, None), (true, None), (true, Some(5.0))] {
        let w = weights.then(|| case.weights(&device));
        let h1 = hidden_rounded.clone().require_grad();
        let ours = head
            .loss(
                &h1,
                &teacher,
                w.as_ref(),
                &LossOptions {
                    total,
                    ..LossOptions::default()
                },
            )
            .expect("loss");
        let g1 = host_f32(h1.grad(&ours.loss.clone().backward()).expect("grad"));
        let h2 = hidden_rounded.clone().require_grad();
        let (theirs, _) = unfused::loss(h2.clone(), &head_t, &unfused_teacher, w, total, 1.0);
        let g2 = host_f32(h2.grad(&theirs.clone().backward()).expect("grad"));
        let (a, b) = (host_f32(ours.loss)[0], host_f32(theirs)[0]);
        assert!(
            (a - b).abs() <= 1e-3 * b.abs(),
            "weights {weights} total {total:?}: headkl {a}, burn {b}"
        );
        let num: f32 = g1.iter().zip(&g2).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f32 = g2.iter().map(|y| y * y).sum();
        let rel = (num / den).sqrt();
        assert!(
            rel <= 3e-3,
            "weights {weights} total {total:?}: gradient relative L2 error {rel}"
        );
    }
    head.wait().expect("device status");
}

#[test]
fn f16_rows_read_in_place_and_get_an_f16_gradient() {
    // (burn's wgpu backend compiles WGSL, which has no bf16: burn cannot
    // hold bf16 tensors there, so only f16 is tried.)
    let Some(shared) = open() else { return };
    let case = Case::new(4);
    let device = shared.device().autodiff();
    let mut head = HeadKl::new(&shared, &case.head(), &Default::default()).expect("HeadKl");
    let teacher = case.teacher(&device);
    let want = case.reference(false, None);
    let hidden = case.hidden(&device).cast(FloatDType::F16).require_grad();
    let out = head
        .loss(&hidden, &teacher, None, &LossOptions::default())
        .expect("loss");
    let grads = out.loss.clone().backward();
    let grad = hidden.grad(&grads).expect("grad");
    assert_eq!(grad.dtype(), DType::F16, "the gradient comes back in the rows' dtype");
    let mean = f64::from(host_f32(out.loss)[0]);
    let rel = (mean - want.mean).abs() / want.mean.abs();
    assert!(rel <= 1e-4, "mean {mean}, reference {}", want.mean);
    head.wait().expect("device status");
}

#[test]
fn burns_buffers_are_bound_in_place_or_copied_on_a_less_aligned_device() {
    let Some(shared) = open() else { return };
    let case = Case::new(5);
    let device = shared.device();
    let mut head = HeadKl::new(&shared, &case.head(), &Default::default()).expect("HeadKl");
    let first = head
        .loss(
            &case.hidden(&device),
            &case.teacher(&device),
            None,
            &LossOptions::default(),
        )
        .expect("loss");
    let bound = head.last_binding();
    assert_eq!((bound.in_place, bound.copied), (5, 0), "{bound:?}");
    let want = host_f32(first.per_token);
    head.wait().expect("device status");

    // A trainer's own device at the adapter's alignments: where those are
    // below 256, burn places tensors at offsets headkl cannot bind, and
    // they go through a device copy.
    let (instance, adapter) = headkl_wgpu::choose_adapter(None).expect("adapter");
    let mut desc = headkl_burn::device_descriptor(&adapter);
    desc.required_limits.min_storage_buffer_offset_alignment = adapter.limits().min_storage_buffer_offset_alignment;
    desc.required_limits.min_uniform_buffer_offset_alignment = adapter.limits().min_uniform_buffer_offset_alignment;
    let aligned = desc
        .required_limits
        .min_storage_buffer_offset_alignment
        .max(desc.required_limits.min_uniform_buffer_offset_alignment);
    let (wgpu_device, queue) = headkl_wgpu::request_device(&adapter, &desc, Default::default()).expect("device");
    let setup = burn::tensor::wgpu::WgpuSetup {
        instance,
        backend: adapter.get_info().backend,
        adapter: adapter.clone(),
        device: wgpu_device,
        queue,
    };
    let trainer_device = burn::tensor::Device::wgpu_options()
        .setup(setup.clone())
        .init()
        .expect("burn device");
    let trainers = SharedDevice::from_setup(&setup, trainer_device.clone());
    let mut head = HeadKl::new(&trainers, &case.head(), &Default::default()).expect("HeadKl");
    let mut copied = 0;
    for _ in 0..3 {
        let out = head
            .loss(
                &case.hidden(&trainer_device),
                &case.teacher(&trainer_device),
                None,
                &LossOptions::default(),
            )
            .expect("loss");
        copied += head.last_binding().copied;
        assert_eq!(host_f32(out.per_token), want, "the same loss, bound in place or copied");
    }
    head.wait().expect("device status");
    eprintln!("trainer's device: offset alignment {aligned}, {copied} tensors copied in 3 calls");
    if aligned < 256 {
        assert!(copied > 0, "alignment {aligned}: no tensor was copied");
    } else {
        assert_eq!(copied, 0);
    }
}

#[test]
fn topk_matches_the_reference() {
    let Some(shared) = open() else { return };
    let case = Case::new(6);
    let device = shared.device();
    let mut head = HeadKl::new(&shared, &case.head(), &Default::default()).expect("HeadKl");
    let top = head
        .topk(&case.hidden(&device), &TopkOptions::new(case.k))
        .expect("topk");
    let ids: Vec<u32> = top
        .ids
        .into_data()
        .convert::<i32>()
        .try_to_vec::<i32>()
        .expect("ids")
        .iter()
        .map(|&i| i as u32)
        .collect();
    let probs = host_f32(top.probs);
    head.wait().expect("device status");
    let hidden = Hidden::f32(&case.hidden, case.ntok, case.hs).expect("hidden");
    let want = topk_f64(&case.head(), &hidden, case.k, 1.0);
    Tolerance::default().check_topk(&ids, &probs, &want).expect("top-k");
}

#[test]
fn bad_input_is_a_typed_error() {
    let Some(shared) = open() else { return };
    let case = Case::new(7);
    let device = shared.device();
    let mut head = HeadKl::new(&shared, &case.head(), &Default::default()).expect("HeadKl");
    let teacher = case.teacher(&device);
    let opts = LossOptions::default();

    let wide = Tensor::<2>::zeros([case.ntok, case.hs + 1], &device);
    let e = head.loss(&wide, &teacher, None, &opts).expect_err("hs");
    assert!(matches!(e, Error::HiddenSizeMismatch { expected: 40, got: 41 }), "{e}");

    let short = case.hidden(&device).slice([0..case.ntok - 1, 0..case.hs]);
    let e = head.loss(&short, &teacher, None, &opts).expect_err("rows");
    assert!(
        matches!(
            e,
            Error::LengthMismatch {
                field: headkl_core::Field::Ids,
                ..
            }
        ),
        "{e}"
    );

    let w = Tensor::<1>::ones([case.ntok + 2], &device);
    let e = head
        .loss(&case.hidden(&device), &teacher, Some(&w), &opts)
        .expect_err("weights");
    assert!(
        matches!(
            e,
            Error::LengthMismatch {
                field: headkl_core::Field::Weights,
                ..
            }
        ),
        "{e}"
    );

    let f64_rows = case.hidden(&device).cast(FloatDType::F64);
    let e = head.loss(&f64_rows, &teacher, None, &opts).expect_err("dtype");
    assert!(matches!(e, Error::DeviceBuffer { field: "hidden", .. }), "{e}");

    let e = head
        .loss(
            &case.hidden(&device),
            &teacher,
            None,
            &LossOptions {
                temperature: 0.0,
                ..LossOptions::default()
            },
        )
        .expect_err("temperature");
    assert!(matches!(e, Error::InvalidTemperature { .. }), "{e}");

    // A tensor on another device.
    let other = SharedDevice::open(&DeviceOptions::default()).expect("second device");
    let elsewhere = case.hidden(&other.device());
    let e = head.loss(&elsewhere, &teacher, None, &opts).expect_err("device");
    assert!(matches!(e, Error::DeviceBuffer { field: "hidden", .. }), "{e}");

    // Bad data on the device comes back from wait: an id past the vocabulary.
    let mut ids: Vec<i32> = case.ids.iter().map(|&i| i as i32).collect();
    ids[5 * case.k + 2] = case.vocab as i32 + 4;
    let bad = Teacher {
        ids: Tensor::<2, Int>::from_data(TensorData::new(ids, [case.ntok, case.k]), &device),
        probs: teacher.probs.clone(),
    };
    head.loss(&case.hidden(&device), &bad, None, &opts).expect("recorded");
    let e = head.wait().expect_err("status");
    assert!(matches!(e, Error::IdOutOfRange { row: 5, col: 2, .. }), "{e}");
    head.wait().expect("the status is cleared");
}
