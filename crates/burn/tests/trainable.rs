//! A trainable head ([`HeadKl::loss_with_head`]): the head's gradient
//! against the loss written the burn way (unfused), through the mean and
//! through the per-token loss; a student whose embedding is also its head
//! (tied) trained step for step against the same student through the
//! unfused loss; a frozen head gets no gradient; the head is read again on
//! every call, and a bad one is headkl's typed error.

use burn::module::{Module, Param};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::{Int, Tensor};
use burn::tensor::{activation, DType, Device, FloatDType, TensorData};
use headkl_burn::prelude::*;
use headkl_burn::unfused;

mod common;

use common::{host_f32, open, relative_l2, uniform, BurnWay, Case};

/// The largest `|a − b|`.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// `t`'s values rounded to f16 (headkl's operands), its gradient passed
/// through in f32.
fn f16_operand<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    let rounded = t.clone().cast(FloatDType::F16).cast(FloatDType::F32);
    t.clone() + (rounded - t).detach()
}

/// The case's (f16-rounded) head as headkl's engine, from the burn tensor.
fn engine_of(shared: &SharedDevice, burn_way: &BurnWay) -> HeadKl {
    HeadKl::from_tensor(shared, &burn_way.head, &Default::default()).expect("HeadKl::from_tensor")
}

#[test]
fn the_heads_gradient_through_the_mean_is_burns() {
    let Some(shared) = open() else { return };
    let case = Case::new(21);
    let device = shared.device().autodiff();
    let burn_way = case.burn_way(&device);
    let mut head = engine_of(&shared, &burn_way);
    // (weights, total, τ, the upstream gradient)
    let options = [
        (false, None, 1.0, 1.0),
        (true, None, 1.0, 3.0),
        (true, Some(5.0), 0.7, 1.0),
    ];
    for (weights, total, temperature, upstream) in options {
        let what = format!("weights {weights} total {total:?} τ {temperature} upstream {upstream}");
        let w = weights.then(|| case.weights(&device));
        let opts = LossConfig {
            total,
            temperature,
            ..LossConfig::default()
        };
        let (x1, w1) = (
            burn_way.rows.clone().require_grad(),
            burn_way.head.clone().require_grad(),
        );
        let ours = head
            .loss_with_head(&x1, &w1, &burn_way.teacher, w.as_ref(), &opts)
            .expect("loss_with_head");
        let grads = ours.loss.clone().mul_scalar(upstream).backward();
        let gx1 = host_f32(x1.grad(&grads).expect("the rows' gradient"));
        let gw1 = host_f32(w1.grad(&grads).expect("the head's gradient"));
        let dw = host_f32(ours.head_grad.clone().expect("out.head_grad"));

        let (x2, w2) = (
            burn_way.rows.clone().require_grad(),
            burn_way.head.clone().require_grad(),
        );
        let (theirs, _) = unfused::loss(x2.clone(), &w2, &burn_way.unfused_teacher, w, total, temperature);
        let grads = theirs.clone().mul_scalar(upstream).backward();
        let gx2 = host_f32(x2.grad(&grads).expect("grad"));
        let gw2 = host_f32(w2.grad(&grads).expect("grad"));

        let (a, b) = (host_f32(ours.loss)[0], host_f32(theirs)[0]);
        assert!((a - b).abs() <= 1e-3 * b.abs(), "{what}: headkl {a}, burn {b}");
        let rel_x = relative_l2(&gx1, &gx2);
        let rel_w = relative_l2(&gw1, &gw2);
        eprintln!("{what}: rows' gradient rel L2 {rel_x:.2e}, head's {rel_w:.2e}");
        assert!(rel_x <= 3e-3, "{what}: the rows' gradient, relative L2 error {rel_x}");
        assert!(rel_w <= 3e-3, "{what}: the head's gradient, relative L2 error {rel_w}");
        // The head's gradient is out.head_grad times the upstream.
        for (i, (g, d)) in gw1.iter().zip(&dw).enumerate() {
            let want = upstream as f32 * d;
            assert!(
                (g - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{what}: [{i}] {g}, {want}"
            );
        }
    }
    head.wait().expect("device status");
}

#[test]
fn the_heads_gradient_through_the_per_token_loss_is_burns() {
    let Some(shared) = open() else { return };
    let case = Case::new(22);
    let device = shared.device().autodiff();
    let burn_way = case.burn_way(&device);
    let mut head = engine_of(&shared, &burn_way);
    // A reduction of the caller's own, of both signs, one factor 0.
    let mut factors = uniform(case.shape.ntok, 92, 2.0);
    factors[4] = 0.0;
    let u = Tensor::<1>::from_data(TensorData::new(factors, [case.shape.ntok]), &device);
    // (weights, another head read between forward and backward, the
    // mean's gradient in the same backward)
    for (weights, another_head, with_mean) in [(false, false, false), (true, false, false), (true, true, true)] {
        let what = format!("weights {weights} another head {another_head} with the mean {with_mean}");
        let w = weights.then(|| case.weights(&device));
        let (x1, w1) = (
            burn_way.rows.clone().require_grad(),
            burn_way.head.clone().require_grad(),
        );
        let ours = head
            .loss_with_head(&x1, &w1, &burn_way.teacher, w.as_ref(), &LossConfig::default())
            .expect("loss_with_head");
        if another_head {
            // The engine reads another head: the backward step's call must
            // read the forward call's again.
            let other = burn_way.head.clone().mul_scalar(0.5);
            head.loss_with_head(&burn_way.rows, &other, &burn_way.teacher, None, &LossConfig::default())
                .expect("another head");
        }
        let mut objective = (ours.per_token.clone() * u.clone()).sum();
        if with_mean {
            objective = objective + ours.loss.clone().mul_scalar(2.0);
        }
        let grads = objective.backward();
        let gx1 = host_f32(x1.grad(&grads).expect("the rows' gradient"));
        let gw1 = host_f32(w1.grad(&grads).expect("the head's gradient"));

        let (x2, w2) = (
            burn_way.rows.clone().require_grad(),
            burn_way.head.clone().require_grad(),
        );
        let (mean, per_token) = unfused::loss(x2.clone(), &w2, &burn_way.unfused_teacher, w, None, 1.0);
        // Rows of weight 0 get nothing through the per-token loss.
        let mut mask = vec![1f32; case.shape.ntok];
        if weights {
            for (m, &wt) in mask.iter_mut().zip(&case.weights) {
                *m = if wt > 0.0 { 1.0 } else { 0.0 };
            }
        }
        let masked = u.clone() * Tensor::<1>::from_data(TensorData::new(mask, [case.shape.ntok]), &device);
        let mut objective = (per_token * masked).sum();
        if with_mean {
            objective = objective + mean.mul_scalar(2.0);
        }
        let grads = objective.backward();
        let gx2 = host_f32(x2.grad(&grads).expect("grad"));
        let gw2 = host_f32(w2.grad(&grads).expect("grad"));
        let rel_x = relative_l2(&gx1, &gx2);
        let rel_w = relative_l2(&gw1, &gw2);
        eprintln!("{what}: rows' gradient rel L2 {rel_x:.2e}, head's {rel_w:.2e}");
        assert!(rel_x <= 3e-3, "{what}: the rows' gradient, relative L2 error {rel_x}");
        assert!(rel_w <= 3e-3, "{what}: the head's gradient, relative L2 error {rel_w}");
    }
    // The backward steps' calls are numbered and waited for like the others.
    head.wait().expect("device status");
}

/// A student whose embedding table is also its head.
#[derive(Module, Debug)]
struct Tied {
    /// `[vocab][hs]`: the input tokens' rows, and the head.
    embed: Param<Tensor<2>>,
    /// `[hs][hs]`.
    mix: Param<Tensor<2>>,
}

const VOCAB: usize = 256;
const HS: usize = 32;
const NTOK: usize = 64;
const K: usize = 8;
const STEPS: usize = 30;
const LR: f64 = 1e-2;

impl Tied {
    fn new(device: &Device) -> Self {
        let matrix = |rows, cols, seed, scale| {
            Tensor::<2>::from_data(TensorData::new(uniform(rows * cols, seed, scale), [rows, cols]), device)
        };
        Self {
            embed: Param::from_tensor(matrix(VOCAB, HS, 31, 1.0)),
            mix: Param::from_tensor(matrix(HS, HS, 32, 1.0 / (HS as f32).sqrt())),
        }
    }

    /// Hidden rows `[ntok][hs]` of `tokens`: the embedding plus a layer.
    fn forward(&self, tokens: Tensor<1, Int>) -> Tensor<2> {
        let x = self.embed.val().select(0, tokens);
        x.clone() + activation::tanh(x.matmul(self.mix.val()))
    }
}

/// Every step's loss and the final weights (embedding, mix) of the tied
/// student trained `STEPS` Adam steps through headkl's loss or, with
/// `unfused`, through the loss written the burn way on the same f16
/// operands.
fn train_tied(shared: &SharedDevice, unfused: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let device = shared.device().autodiff();
    let plain = shared.device();
    // The teacher: a fixed head's top-k of fixed rows.
    let teacher_w = uniform(VOCAB * HS, 33, 1.0);
    let mut teacher_head = HeadKl::new(
        shared,
        &HeadWeights::new(HeadData::F32(&teacher_w), VOCAB, HS).expect("teacher head"),
        &Default::default(),
    )
    .expect("teacher HeadKl");
    let teacher_rows = Tensor::<2>::from_data(TensorData::new(uniform(NTOK * HS, 34, 2.0), [NTOK, HS]), &plain);
    let top = teacher_head.topk(&teacher_rows, &TopkOptions::new(K)).expect("topk");
    teacher_head.wait().expect("teacher status");
    let teacher = Teacher {
        ids: top.ids,
        probs: top.probs,
    };
    let unfused_teacher = unfused::UnfusedTeacher::from(&teacher);
    let tokens: Vec<i32> = (0..NTOK).map(|t| ((t * 37 + 11) % VOCAB) as i32).collect();
    let tokens = Tensor::<1, Int>::from_data(TensorData::new(tokens, [NTOK]), &plain);

    let mut student = Tied::new(&device);
    let mut head = HeadKl::from_tensor(shared, &student.embed.val(), &Default::default()).expect("HeadKl");
    let mut optim = AdamConfig::new().init();
    let mut losses = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let hidden = student.forward(tokens.clone());
        let embed = student.embed.val();
        let loss = if unfused {
            unfused::loss(
                f16_operand(hidden),
                &f16_operand(embed),
                &unfused_teacher,
                None,
                None,
                1.0,
            )
            .0
        } else {
            head.loss_with_head(&hidden, &embed, &teacher, None, &LossConfig::default())
                .expect("loss_with_head")
                .loss
        };
        losses.push(loss.clone().detach());
        let grads = GradientsParams::from_grads(loss.backward(), &student);
        student = optim.step(LR, student, grads);
    }
    head.wait().expect("device status");
    let losses = host_f32(Tensor::cat(losses, 0));
    (losses, host_f32(student.embed.val()), host_f32(student.mix.val()))
}

#[test]
fn a_tied_embedding_student_trains_step_for_step_like_burns_loss() {
    let Some(shared) = open() else { return };
    let (ours, our_embed, our_mix) = train_tied(&shared, false);
    let (theirs, their_embed, their_mix) = train_tied(&shared, true);
    assert_eq!(ours.len(), STEPS);
    let worst_loss = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs() / b.abs())
        .fold(0.0, f32::max);
    let (embed_abs, mix_abs) = (
        max_abs_diff(&our_embed, &their_embed),
        max_abs_diff(&our_mix, &their_mix),
    );
    let (embed_rel, mix_rel) = (relative_l2(&our_embed, &their_embed), relative_l2(&our_mix, &their_mix));
    eprintln!(
        "{STEPS} Adam steps, tied head: loss {} -> {} (burn {} -> {}); worst relative loss difference {worst_loss:.2e}; \
         final weights: embedding max |diff| {embed_abs:.2e} (rel L2 {embed_rel:.2e}), mix max |diff| {mix_abs:.2e} (rel L2 {mix_rel:.2e})",
        ours[0],
        ours[STEPS - 1],
        theirs[0],
        theirs[STEPS - 1]
    );
    for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!((a - b).abs() <= 1e-3 * b.abs(), "step {step}: headkl {a}, burn {b}");
    }
    assert!(
        ours[STEPS - 1] < 0.7 * ours[0],
        "the tied student does not learn: {ours:?}"
    );
    assert!(
        embed_rel <= 1e-3 && embed_abs <= 2e-3,
        "the embedding (and head) differ: {embed_abs}, {embed_rel}"
    );
    assert!(
        mix_rel <= 1e-3 && mix_abs <= 2e-3,
        "the mix differs: {mix_abs}, {mix_rel}"
    );
}

#[test]
fn a_frozen_head_gets_no_gradient() {
    let Some(shared) = open() else { return };
    let case = Case::new(23);
    let device = shared.device().autodiff();
    let burn_way = case.burn_way(&device);
    // The engine made from a tracked tensor, then the frozen call.
    let w = burn_way.head.clone().require_grad();
    let mut head = HeadKl::from_tensor(&shared, &w, &Default::default()).expect("HeadKl::from_tensor");
    let x = burn_way.rows.clone().require_grad();
    let frozen = head
        .loss(&x, &burn_way.teacher, None, &LossConfig::default())
        .expect("loss");
    let bound = head.last_binding();
    assert_eq!((bound.in_place, bound.copied), (5, 0), "the frozen call: {bound:?}");
    assert!(frozen.head_grad.is_none());
    let grads = frozen.loss.clone().backward();
    assert!(x.grad(&grads).is_some(), "the rows get their gradient");
    assert!(w.grad(&grads).is_none(), "a frozen head got a gradient");

    // A head outside the graph through loss_with_head: read, the same loss
    // and rows' gradient, and no head gradient.
    let x2 = burn_way.rows.clone().require_grad();
    let untracked = head
        .loss_with_head(&x2, &burn_way.head, &burn_way.teacher, None, &LossConfig::default())
        .expect("loss_with_head");
    assert!(untracked.head_grad.is_none());
    let g2 = host_f32(x2.grad(&untracked.loss.clone().backward()).expect("grad"));
    let g1 = host_f32(x.grad(&grads).expect("grad"));
    assert_eq!(host_f32(untracked.per_token), host_f32(frozen.per_token));
    assert_eq!(g2, g1);
    head.wait().expect("device status");
}

#[test]
fn the_head_is_read_again_on_every_call() {
    let Some(shared) = open() else { return };
    let case = Case::new(24);
    let device = shared.device().autodiff();
    let burn_way = case.burn_way(&device);
    let mut head = engine_of(&shared, &burn_way);
    // A second head, as an optimizer step leaves it.
    let new_values: Vec<f32> = case
        .head
        .iter()
        .zip(uniform(case.shape.vocab * case.shape.hs, 241, 0.1))
        .map(|(w, d)| half::f16::from_f32(w + d).to_f32())
        .collect();
    let new_head = Tensor::<2>::from_data(
        TensorData::new(new_values.clone(), [case.shape.vocab, case.shape.hs]),
        &device,
    );
    let from_host = |values: &[f32]| {
        HeadKl::new(
            &shared,
            &HeadWeights::new(HeadData::F32(values), case.shape.vocab, case.shape.hs).expect("head"),
            &Default::default(),
        )
        .expect("HeadKl::new")
    };
    let mut fresh = from_host(&new_values);
    let want = host_f32(
        fresh
            .loss(&burn_way.rows, &burn_way.teacher, None, &LossConfig::default())
            .expect("loss")
            .per_token,
    );
    fresh.wait().expect("device status");

    let x = burn_way.rows.clone().require_grad();
    let tracked = new_head.clone().require_grad();
    let out = head
        .loss_with_head(&x, &tracked, &burn_way.teacher, None, &LossConfig::default())
        .expect("loss_with_head");
    let bound = head.last_binding();
    assert_eq!(bound.copied, 1, "the head's copy: {bound:?}");
    assert!(
        bound.copied_bytes >= (case.shape.vocab * case.shape.hs * 2) as u64,
        "{bound:?}"
    );
    assert_eq!(host_f32(out.per_token), want, "the head read, bit for bit");
    // The engine keeps it: the frozen call after uses it.
    let after = head
        .loss(&burn_way.rows, &burn_way.teacher, None, &LossConfig::default())
        .expect("loss");
    assert_eq!(host_f32(after.per_token), want);
    // And an f16 head is read as well, its gradient in f16.
    let f16_head = new_head.cast(FloatDType::F16).require_grad();
    let out = head
        .loss_with_head(&x, &f16_head, &burn_way.teacher, None, &LossConfig::default())
        .expect("f16 head");
    assert_eq!(host_f32(out.per_token.clone()), want);
    let grad = f16_head.grad(&out.loss.backward()).expect("the f16 head's gradient");
    assert_eq!(grad.dtype(), DType::F16);
    head.wait().expect("device status");
}

#[test]
fn a_bad_trainable_head_is_a_typed_error_and_leaves_the_engines_head() {
    let Some(shared) = open() else { return };
    let case = Case::new(25);
    let device = shared.device().autodiff();
    let burn_way = case.burn_way(&device);
    let mut head = engine_of(&shared, &burn_way);
    let opts = LossConfig::default();
    let before = host_f32(
        head.loss(&burn_way.rows, &burn_way.teacher, None, &opts)
            .expect("loss")
            .per_token,
    );
    let x = burn_way.rows.clone().require_grad();
    let call = |head: &mut HeadKl, w: &Tensor<2>| head.loss_with_head(&x, w, &burn_way.teacher, None, &opts);

    let narrow = burn_way
        .head
        .clone()
        .slice([0..case.shape.vocab, 0..case.shape.hs - 1])
        .require_grad();
    let e = call(&mut head, &narrow).expect_err("shape");
    assert_eq!(e.to_string(), "head is [300][39], the engine's head [300][40]");

    let with = |row: usize, col: usize, value: f32| {
        let mut values = host_f32(burn_way.head.clone());
        values[row * case.shape.hs + col] = value;
        Tensor::<2>::from_data(TensorData::new(values, [case.shape.vocab, case.shape.hs]), &device).require_grad()
    };
    let e = call(&mut head, &with(11, 5, f32::NAN)).expect_err("NaN");
    assert!(
        matches!(
            e,
            Error::Headkl(headkl_core::Error::NonFiniteHead { row: 11, col: 5, .. })
        ),
        "{e}"
    );
    let e = call(&mut head, &with(250, 39, -7e4)).expect_err("past f16");
    assert!(
        matches!(
            e,
            Error::Headkl(headkl_core::Error::HeadOutOfF16Range { row: 250, col: 39, .. })
        ),
        "{e}"
    );
    let f64_head = burn_way.head.clone().cast(FloatDType::F64);
    let e = call(&mut head, &f64_head).expect_err("dtype");
    assert!(matches!(e, Error::Dtype { input: "head", .. }), "{e}");

    // Nothing was read: the engine's head is the one before.
    let after = host_f32(
        head.loss(&burn_way.rows, &burn_way.teacher, None, &opts)
            .expect("loss")
            .per_token,
    );
    assert_eq!(after, before);
    head.wait().expect("device status");
}
