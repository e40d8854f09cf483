//! What the burn tests share: a small problem, the device, host copies.

#![allow(dead_code, reason = "each test binary uses part of this")]

use burn::prelude::{Int, Tensor};
use burn::tensor::TensorData;
use headkl_burn::prelude::*;
use headkl_burn::unfused::UnfusedTeacher;
use headkl_conformance::open_or_skip;
use headkl_core::{Engine, Hidden, LossOptions as HostLossOptions, Shape, SliceOptions};
use headkl_reference::direct::{head_kl_f64, DirectLoss};
use headkl_wgpu::WgpuBackend;

#[path = "../../../backend-wgpu/examples/common/mod.rs"]
#[allow(
    clippy::duplicate_mod,
    reason = "the tests that include an example load this module there too"
)]
mod example_common;

pub use example_common::uniform;

/// A small problem: head `[V][hs]`, hidden `[ntok][hs]`, a teacher with
/// distinct ids per row, weights.
pub struct Case {
    pub shape: Shape,
    pub head: Vec<f32>,
    pub hidden: Vec<f32>,
    pub ids: Vec<u32>,
    pub probs: Vec<f32>,
    pub weights: Vec<f32>,
}

impl Case {
    pub fn new(seed: u64) -> Self {
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
            shape: Shape::new(ntok, vocab, hs, k),
            head: uniform(vocab * hs, seed + 1, 0.5),
            hidden: uniform(ntok * hs, seed + 2, 1.0),
            ids,
            probs,
            weights,
        }
    }

    pub fn head(&self) -> HeadWeights<'_> {
        HeadWeights::new(HeadData::F32(&self.head), self.shape.vocab, self.shape.hs).expect("head")
    }

    pub fn teacher(&self, device: &burn::tensor::Device) -> Teacher {
        let ids: Vec<i32> = self.ids.iter().map(|&i| i as i32).collect();
        self.teacher_of(ids, self.probs.clone(), device)
    }

    /// A teacher of this case's shape `[ntok][k]` with these ids and
    /// probabilities.
    pub fn teacher_of(&self, ids: Vec<i32>, probs: Vec<f32>, device: &burn::tensor::Device) -> Teacher {
        Teacher {
            ids: Tensor::<2, Int>::from_data(TensorData::new(ids, [self.shape.ntok, self.shape.k]), device),
            probs: Tensor::from_data(TensorData::new(probs, [self.shape.ntok, self.shape.k]), device),
        }
    }

    pub fn hidden(&self, device: &burn::tensor::Device) -> Tensor<2> {
        Tensor::from_data(
            TensorData::new(self.hidden.clone(), [self.shape.ntok, self.shape.hs]),
            device,
        )
    }

    pub fn weights(&self, device: &burn::tensor::Device) -> Tensor<1> {
        Tensor::from_data(TensorData::new(self.weights.clone(), [self.shape.ntok]), device)
    }

    /// The hidden rows as headkl outside burn takes them.
    pub fn host_hidden(&self) -> Hidden<'_> {
        Hidden::f32(&self.hidden, self.shape.ntok, self.shape.hs).expect("hidden")
    }

    /// The teacher as headkl outside burn takes it.
    pub fn host_teacher(&self) -> headkl_core::Teacher {
        headkl_core::Teacher::new(&self.ids, &self.probs, self.shape.ntok, self.shape.k, self.shape.vocab)
            .expect("teacher")
    }

    /// headkl outside burn: its own wgpu backend, the host path, this head.
    pub fn host_engine(&self) -> Engine<WgpuBackend> {
        let backend = WgpuBackend::open(None).expect("wgpu backend");
        Engine::new(backend, &self.head(), SliceOptions::default()).expect("engine")
    }

    /// The head uploaded to `shared`.
    pub fn head_kl(&self, shared: &SharedDevice) -> HeadKl {
        HeadKl::new(shared, &self.head(), &Default::default()).expect("HeadKl")
    }

    /// `head`'s loss of these rows and teacher on `device`, with the
    /// weights where `weights` says.
    pub fn loss(
        &self,
        head: &mut HeadKl,
        device: &burn::tensor::Device,
        weights: bool,
        opts: &LossConfig,
    ) -> LossOutput {
        // Made in the order of the call's arguments, as the tests did.
        let (hidden, teacher) = (self.hidden(device), self.teacher(device));
        let w = weights.then(|| self.weights(device));
        head.loss(&hidden, &teacher, w.as_ref(), opts).expect("loss")
    }

    /// What the loss written the burn way takes on `device`: the head and
    /// the rows rounded to f16 (headkl's operands), and the teacher.
    pub fn burn_way(&self, device: &burn::tensor::Device) -> BurnWay {
        let round = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect() };
        let head = Tensor::from_data(
            TensorData::new(round(&self.head), [self.shape.vocab, self.shape.hs]),
            device,
        );
        let rows = Tensor::from_data(
            TensorData::new(round(&self.hidden), [self.shape.ntok, self.shape.hs]),
            device,
        );
        let teacher = self.teacher(device);
        BurnWay {
            head,
            rows,
            unfused_teacher: UnfusedTeacher::from(&teacher),
            teacher,
        }
    }

    /// The f64 reference of DESIGN §1 on the f16-rounded head and rows.
    pub fn reference(&self, weights: bool, total: Option<f32>) -> DirectLoss {
        let hidden = self.host_hidden();
        let teacher = self.host_teacher();
        let opts = HostLossOptions {
            config: LossConfig {
                total,
                ..LossConfig::default()
            },
            weights: weights.then(|| self.weights.clone()),
            ..HostLossOptions::default()
        };
        let resolved = opts.resolve(self.shape.ntok).expect("options");
        head_kl_f64(&self.head(), &hidden, &teacher, &resolved)
    }
}

/// A [`Case`] as both losses take it: headkl's (`teacher`) and the one
/// written the burn way (`head`, `unfused_teacher`), on the same rows.
pub struct BurnWay {
    pub head: Tensor<2>,
    pub rows: Tensor<2>,
    pub teacher: Teacher,
    pub unfused_teacher: UnfusedTeacher,
}

impl BurnWay {
    /// headkl's loss of fresh tracked copies of the rows with these
    /// `weights` and `total`: the tracked rows and the output.
    pub fn tracked_loss(
        &self,
        head: &mut HeadKl,
        weights: Option<&Tensor<1>>,
        total: Option<f32>,
    ) -> (Tensor<2>, LossOutput) {
        let rows = self.rows.clone().require_grad();
        let opts = LossConfig {
            total,
            ..LossConfig::default()
        };
        let out = head.loss(&rows, &self.teacher, weights, &opts).expect("loss");
        (rows, out)
    }
}

/// `‖a − b‖ / ‖b‖`.
pub fn relative_l2(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

/// The shared device, or `None` where no wgpu device could start (and
/// `HEADKL_REQUIRE` does not name wgpu: the harness's rule).
pub fn open() -> Option<SharedDevice> {
    open_or_skip("wgpu", || {
        SharedDevice::open(&DeviceOptions::default()).map_err(|e| match e {
            Error::Headkl(e) => e,
            other => headkl_core::Error::Backend {
                backend: headkl_burn::BACKEND,
                message: other.to_string(),
            },
        })
    })
}

/// What most tests start with: [`open`]'s device (`None` where it gives
/// none), case `seed` and its head there.
pub fn open_case(seed: u64) -> Option<(Case, burn::tensor::Device, HeadKl)> {
    let shared = open()?;
    let case = Case::new(seed);
    let head = case.head_kl(&shared);
    Some((case, shared.device(), head))
}

pub fn host_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().expect("f32 data")
}
