//! headkl's loss inside burn: against the f64 reference and headkl outside
//! burn (the conformance tolerances), against the loss written the burn way
//! (unfused), its gradient through burn's autodiff (the mean's and the
//! per-token loss's), top-k with log-probabilities, and the binding of
//! burn's buffers.

use burn::prelude::Tensor;
use burn::tensor::{DType, FloatDType, TensorData};
use headkl_burn::prelude::*;
use headkl_burn::unfused;
use headkl_core::LossOptions as HostLossOptions;
use headkl_reference::direct::{topk_f64, DirectLoss};
use headkl_reference::Tolerance;

mod common;

use common::{host_f32, open, open_case, relative_l2, Case};

#[test]
fn loss_in_burn_matches_the_reference_and_headkl_outside_burn() {
    let Some((case, device, mut head)) = open_case(1) else {
        return;
    };
    let out = case.loss(&mut head, &device, true, &LossConfig::default());
    let per_token = host_f32(out.per_token);
    let mean = f64::from(host_f32(out.loss)[0]);
    let dx = host_f32(out.dx);
    head.wait().expect("device status");

    let tol = Tolerance::default();
    let want = case.reference(true, None);
    tol.check_loss(&per_token, mean, &want)
        .expect("loss against the f64 reference");
    tol.check_dx_rows(&dx, &want.dx, Some(case.shape.hs))
        .expect("dx against the f64 reference");

    // headkl outside burn: its own wgpu backend, the host path, same data.
    let outside = case
        .host_engine()
        .head_kl(
            &case.host_hidden(),
            &case.host_teacher(),
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
    tol.check_dx_rows(&dx, &outside_f64.dx, Some(case.shape.hs))
        .expect("dx against headkl outside burn");
}

/// The loss options pass through: the reverse KL with `reduction = sum`
/// gives the f64 reference's per-token losses, their weighted sum as
/// `loss` and the sum's gradient as dx; a total beside the sum is headkl's
/// typed error.
#[test]
fn reduction_and_divergence_reach_the_device() {
    let Some((case, device, mut head)) = open_case(3) else {
        return;
    };
    let terms = LossTerms {
        divergence: Divergence::Reverse,
        ..LossTerms::default()
    };
    let opts = LossConfig {
        reduction: Reduction::Sum,
        terms,
        ..LossConfig::default()
    };
    let out = case.loss(&mut head, &device, true, &opts);
    let (per_token, sum, dx) = (
        host_f32(out.per_token),
        f64::from(host_f32(out.loss)[0]),
        host_f32(out.dx),
    );
    head.wait().expect("device status");
    let resolved = HostLossOptions {
        config: LossConfig {
            reduction: Reduction::Sum,
            terms,
            ..LossConfig::default()
        },
        weights: Some(case.weights.clone()),
        ..HostLossOptions::default()
    }
    .resolve(case.shape.ntok)
    .expect("options");
    let want =
        headkl_reference::direct::head_kl_f64(&case.head(), &case.host_hidden(), &case.host_teacher(), &resolved);
    let tol = Tolerance::default();
    tol.check_loss(&per_token, sum, &want).expect("reverse KL, summed");
    tol.check_dx_rows(&dx, &want.dx, Some(case.shape.hs))
        .expect("the sum's dx");
    let forward = case.reference(true, None);
    assert!(
        (want.loss[0] - forward.loss[0]).abs() > 1e-4,
        "the reverse KL equals the forward one: the test checks nothing"
    );
    let refused = head.loss(
        &case.hidden(&device),
        &case.teacher(&device),
        None,
        &LossConfig {
            total: Some(2.0),
            ..opts
        },
    );
    assert!(
        matches!(
            refused,
            Err(Error::Headkl(headkl_core::Error::TotalWithReduction { .. }))
        ),
        "{refused:?}"
    );
}

#[test]
fn backward_puts_dx_times_the_upstream_gradient_into_hidden() {
    let Some((case, device, mut head)) = open_case(2) else {
        return;
    };
    let device = device.autodiff();
    let hidden = case.hidden(&device).require_grad();
    let out = head
        .loss(&hidden, &case.teacher(&device), None, &LossConfig::default())
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
    let Some((case, device, mut head)) = open_case(3) else {
        return;
    };
    let device = device.autodiff();
    // The burn loss on the f16-rounded head and rows, as headkl's operands.
    let burn_way = case.burn_way(&device);
    for (weights, total) in [(false, None), (true, None), (true, Some(5.0))] {
        let w = weights.then(|| case.weights(&device));
        let (h1, ours) = burn_way.tracked_loss(&mut head, w.as_ref(), total);
        let g1 = host_f32(h1.grad(&ours.loss.clone().backward()).expect("grad"));
        let h2 = burn_way.rows.clone().require_grad();
        let (theirs, _) = unfused::loss(h2.clone(), &burn_way.head, &burn_way.unfused_teacher, w, total, 1.0);
        let g2 = host_f32(h2.grad(&theirs.clone().backward()).expect("grad"));
        let (a, b) = (host_f32(ours.loss)[0], host_f32(theirs)[0]);
        assert!(
            (a - b).abs() <= 1e-3 * b.abs(),
            "weights {weights} total {total:?}: headkl {a}, burn {b}"
        );
        let rel = relative_l2(&g1, &g2);
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
    let Some((case, device, mut head)) = open_case(4) else {
        return;
    };
    let device = device.autodiff();
    let teacher = case.teacher(&device);
    let want = case.reference(false, None);
    let hidden = case.hidden(&device).cast(FloatDType::F16).require_grad();
    let out = head
        .loss(&hidden, &teacher, None, &LossConfig::default())
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
    let Some((case, device, mut head)) = open_case(5) else {
        return;
    };
    let first = case.loss(&mut head, &device, false, &LossConfig::default());
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
    let mut head = case.head_kl(&trainers);
    let mut copied = 0;
    for _ in 0..3 {
        let out = case.loss(&mut head, &trainer_device, false, &LossConfig::default());
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
    let Some((case, device, mut head)) = open_case(6) else {
        return;
    };
    let top = head
        .topk(&case.hidden(&device), &TopkOptions::new(case.shape.k))
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
    let want = topk_f64(&case.head(), &case.host_hidden(), case.shape.k, 1.0);
    Tolerance::default().check_topk(&ids, &probs, &want).expect("top-k");
}

#[test]
fn topk_log_probabilities_are_the_host_paths() {
    let Some((case, device, mut head)) = open_case(8) else {
        return;
    };
    let opts = TopkOptions {
        logprobs: true,
        temperature: 0.8,
        ..TopkOptions::new(case.shape.k)
    };
    let top = head.topk(&case.hidden(&device), &opts).expect("topk");
    let logprobs = host_f32(top.logprobs.expect("log-probabilities were asked for"));
    let probs = host_f32(top.probs);
    head.wait().expect("device status");
    let want = case.host_engine().topk(&case.host_hidden(), &opts).expect("host topk");
    for (i, (g, w)) in logprobs.iter().zip(&want.logprobs).enumerate() {
        assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "logprobs[{i}] {g}, host {w}");
        assert!(*g <= 0.0, "logprobs[{i}] = {g} > 0");
    }
    for (i, (g, w)) in probs.iter().zip(&want.probs).enumerate() {
        assert!((g - w).abs() <= 1e-5, "probs[{i}] {g}, host {w}");
    }
}

#[test]
fn the_per_token_loss_backpropagates_like_burns_own() {
    let Some((case, device, mut head)) = open_case(9) else {
        return;
    };
    let device = device.autodiff();
    let burn_way = case.burn_way(&device);
    // A reduction of the caller's own: per-token factors, one of them 0.
    let mut factors = common::uniform(case.shape.ntok, 91, 2.0);
    factors[4] = 0.0;
    let u = Tensor::<1>::from_data(TensorData::new(factors, [case.shape.ntok]), &device);
    // Weights (row 3 has weight 0: masked, no gradient through per_token),
    // and a `total`, which per_token's gradient must not depend on.
    for (weights, total) in [(false, None), (true, None), (true, Some(7.0))] {
        let w = weights.then(|| case.weights(&device));
        let (h1, ours) = burn_way.tracked_loss(&mut head, w.as_ref(), total);
        let g1 = host_f32(h1.grad(&(ours.per_token * u.clone()).sum().backward()).expect("grad"));
        let h2 = burn_way.rows.clone().require_grad();
        let (_, theirs) = unfused::loss(h2.clone(), &burn_way.head, &burn_way.unfused_teacher, None, None, 1.0);
        let mut mask = vec![1f32; case.shape.ntok];
        if weights {
            for (m, &wt) in mask.iter_mut().zip(&case.weights) {
                *m = if wt > 0.0 { 1.0 } else { 0.0 };
            }
        }
        let masked = u.clone() * Tensor::<1>::from_data(TensorData::new(mask, [case.shape.ntok]), &device);
        let g2 = host_f32(h2.grad(&(theirs * masked).sum().backward()).expect("grad"));
        let rel = relative_l2(&g1, &g2);
        assert!(
            rel <= 3e-3,
            "weights {weights} total {total:?}: relative L2 error {rel}"
        );
        if weights {
            let row3 = &g1[3 * case.shape.hs..4 * case.shape.hs];
            assert!(row3.iter().all(|&g| g == 0.0), "row 3 has weight 0: {row3:?}");
        }
    }
    head.wait().expect("device status");
}

#[test]
fn a_head_from_a_burn_tensor_is_the_head_from_the_host() {
    let Some(shared) = open() else { return };
    let case = Case::new(10);
    let device = shared.device();
    let opts = LossConfig::default();
    let mut from_host = HeadKl::new(&shared, &case.head(), &Default::default()).expect("HeadKl::new");
    let w = Tensor::<2>::from_data(
        TensorData::new(case.head.clone(), [case.shape.vocab, case.shape.hs]),
        &device.clone().autodiff(),
    );
    let mut from_tensor = HeadKl::from_tensor(&shared, &w, &Default::default()).expect("HeadKl::from_tensor");
    let made = from_tensor.last_binding();
    assert_eq!((made.in_place, made.copied), (0, 1), "{made:?}");
    assert_eq!(
        (from_tensor.vocab(), from_tensor.hs()),
        (case.shape.vocab, case.shape.hs)
    );
    let (a, b) = (
        case.loss(&mut from_host, &device, true, &opts),
        case.loss(&mut from_tensor, &device, true, &opts),
    );
    assert_eq!(
        host_f32(a.per_token),
        host_f32(b.per_token),
        "the same f16 planes, the same loss"
    );
    assert_eq!(host_f32(a.dx), host_f32(b.dx));
    let k = TopkOptions::new(case.shape.k);
    let (ta, tb) = (
        from_host.topk(&case.hidden(&device), &k).expect("topk"),
        from_tensor.topk(&case.hidden(&device), &k).expect("topk"),
    );
    assert_eq!(host_f32(ta.probs), host_f32(tb.probs));
    from_host.wait().expect("device status");
    from_tensor.wait().expect("device status");

    // A value f16 cannot hold is refused before anything is uploaded.
    let mut values = case.head.clone();
    values[7 * case.shape.hs + 3] = 1e6;
    let big = Tensor::<2>::from_data(TensorData::new(values, [case.shape.vocab, case.shape.hs]), &device);
    let e = HeadKl::from_tensor(&shared, &big, &Default::default())
        .err()
        .expect("out of f16's range");
    assert!(
        matches!(
            e,
            Error::Headkl(headkl_core::Error::HeadOutOfF16Range { row: 7, col: 3, .. })
        ),
        "{e}"
    );
}
