//! What the burn tests share: a small problem, the device, host copies.

#![allow(dead_code, reason = "each test binary uses part of this")]

use burn::prelude::{Int, Tensor};
use burn::tensor::TensorData;
use headkl_burn::prelude::*;
use headkl_core::{Hidden, LossOptions as HostLossOptions};
use headkl_reference::conformance::open_or_skip;
use headkl_reference::direct::{head_kl_f64, DirectLoss};

/// Uniform values in [-scale, scale), xorshift64* from `seed`.
pub fn uniform(n: usize, seed: u64, scale: f32) -> Vec<f32> {
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
pub struct Case {
    pub vocab: usize,
    pub hs: usize,
    pub ntok: usize,
    pub k: usize,
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

    pub fn head(&self) -> HeadWeights<'_> {
        HeadWeights::new(HeadData::F32(&self.head), self.vocab, self.hs).expect("head")
    }

    pub fn teacher(&self, device: &burn::tensor::Device) -> Teacher {
        let ids: Vec<i32> = self.ids.iter().map(|&i| i as i32).collect();
        Teacher {
            ids: Tensor::<2, Int>::from_data(TensorData::new(ids, [self.ntok, self.k]), device),
            probs: Tensor::from_data(TensorData::new(self.probs.clone(), [self.ntok, self.k]), device),
        }
    }

    pub fn hidden(&self, device: &burn::tensor::Device) -> Tensor<2> {
        Tensor::from_data(TensorData::new(self.hidden.clone(), [self.ntok, self.hs]), device)
    }

    pub fn weights(&self, device: &burn::tensor::Device) -> Tensor<1> {
        Tensor::from_data(TensorData::new(self.weights.clone(), [self.ntok]), device)
    }

    /// The f64 reference of DESIGN §1 on the f16-rounded head and rows.
    pub fn reference(&self, weights: bool, total: Option<f32>) -> DirectLoss {
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

pub fn host_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().expect("f32 data")
}
