//! A burn student that learns through headkl's loss: token embeddings and
//! a two-layer MLP (burn's autodiff, burn's Adam) distilled from a fixed
//! teacher network's top-k, computed with headkl's top-k on the same
//! device, through the frozen vocabulary head.
//!
//! ```sh
//! cargo run --release --manifest-path crates/burn/Cargo.toml --example distill_burn -- --steps 30
//! ```
//!
//! Every step's loss stays on the device; the host reads them once at the
//! end, then prints one line per step and `loss: first <f> last <f>`.

use std::error::Error;

use burn::module::{Module, Param};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::{Int, Tensor};
use burn::tensor::{activation, Device, TensorData};
use headkl_burn::prelude::*;
use headkl_burn::unfused;

#[path = "../../backend-wgpu/examples/common/mod.rs"]
#[macro_use]
mod common;

use common::{each_flag, parsed, uniform};

/// Sizes and knobs of a run.
#[derive(Clone, Debug)]
pub struct Config {
    /// Adam steps.
    pub steps: usize,
    /// Tokens per step.
    pub ntok: usize,
    /// Distinct input tokens.
    pub inputs: usize,
    /// Vocabulary size of the head.
    pub vocab: usize,
    /// Hidden size.
    pub hs: usize,
    /// Embedding width.
    pub embed: usize,
    /// MLP width.
    pub mlp: usize,
    /// Teacher top-k.
    pub k: usize,
    /// Adam's learning rate.
    pub lr: f64,
    /// Seed of the head, the teacher, the student's start and the tokens.
    pub seed: u64,
    /// The loss written the burn way (unfused) instead of headkl's.
    pub unfused: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            steps: 30,
            ntok: 128,
            inputs: 64,
            vocab: 1024,
            hs: 64,
            embed: 32,
            mlp: 128,
            k: 16,
            lr: 0.02,
            seed: 1,
            unfused: false,
        }
    }
}

impl Config {
    /// `--steps N` and the other `--name value` flags.
    pub fn from_args(args: impl Iterator<Item = String>) -> Result<Self, String> {
        let mut cfg = Config::default();
        field_flags!(
            args,
            cfg,
            [steps, ntok, inputs, vocab, hs, embed, mlp, k, lr, seed],
            "--unfused" => cfg.unfused = true
        )?;
        if cfg.steps == 0 {
            return Err("--steps must be at least 1".into());
        }
        Ok(cfg)
    }
}

fn matrix(rows: usize, cols: usize, seed: u64, scale: f32, device: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(uniform(rows * cols, seed, scale), [rows, cols]), device)
}

/// The student: an embedding table and a two-layer MLP to the hidden rows.
#[derive(Module, Debug)]
pub struct Student {
    embed: Param<Tensor<2>>,
    w1: Param<Tensor<2>>,
    b1: Param<Tensor<1>>,
    w2: Param<Tensor<2>>,
}

impl Student {
    fn new(cfg: &Config, device: &Device) -> Self {
        let s = cfg.seed.wrapping_mul(1000);
        Self {
            embed: Param::from_tensor(matrix(cfg.inputs, cfg.embed, s + 1, 1.0, device)),
            w1: Param::from_tensor(matrix(
                cfg.embed,
                cfg.mlp,
                s + 2,
                1.0 / (cfg.embed as f32).sqrt(),
                device,
            )),
            b1: Param::from_tensor(Tensor::zeros([cfg.mlp], device)),
            w2: Param::from_tensor(matrix(cfg.mlp, cfg.hs, s + 3, 0.1 / (cfg.mlp as f32).sqrt(), device)),
        }
    }

    /// Hidden rows `[ntok][hs]` of `tokens` `[ntok]`.
    pub fn forward(&self, tokens: Tensor<1, Int>) -> Tensor<2> {
        let x = self.embed.val().select(0, tokens);
        let h = activation::relu(x.matmul(self.w1.val()) + self.b1.val().unsqueeze::<2>());
        h.matmul(self.w2.val())
    }
}

/// The fixed teacher network's hidden rows: `3·tanh(E[token]·W)`.
fn teacher_hidden(cfg: &Config, tokens: Tensor<1, Int>, device: &Device) -> Tensor<2> {
    let s = cfg.seed.wrapping_mul(2000);
    let e = matrix(cfg.inputs, cfg.embed, s + 1, 1.0, device);
    let w = matrix(cfg.embed, cfg.hs, s + 2, 1.0 / (cfg.embed as f32).sqrt(), device);
    activation::tanh(e.select(0, tokens).matmul(w)).mul_scalar(3.0)
}

/// The head `[V][hs]` as host values (for headkl, and the unfused loss).
pub fn head_values(cfg: &Config) -> Vec<f32> {
    uniform(
        cfg.vocab * cfg.hs,
        cfg.seed.wrapping_mul(3000) + 1,
        3.0 / (cfg.hs as f32).sqrt(),
    )
}

/// Trains for `cfg.steps` steps; every step's mean loss.
pub fn run(cfg: &Config) -> Result<Vec<f32>, Box<dyn Error>> {
    let shared = SharedDevice::open(&DeviceOptions::default())?;
    run_on(&shared, cfg)
}

/// [`run`] on an opened device.
pub fn run_on(shared: &SharedDevice, cfg: &Config) -> Result<Vec<f32>, Box<dyn Error>> {
    let plain = shared.device();
    let device = plain.clone().autodiff();
    let w = head_values(cfg);
    let mut head = HeadKl::new(
        shared,
        &HeadWeights::new(HeadData::F32(&w), cfg.vocab, cfg.hs)?,
        &Default::default(),
    )?;
    let head_tensor = Tensor::<2>::from_data(TensorData::new(w.clone(), [cfg.vocab, cfg.hs]), &device);

    let token_values: Vec<i32> = uniform(cfg.ntok, cfg.seed.wrapping_mul(4000) + 1, 1.0)
        .iter()
        .map(|u| (((u + 1.0) * 0.5 * cfg.inputs as f32) as usize).min(cfg.inputs - 1) as i32)
        .collect();
    let tokens = Tensor::<1, Int>::from_data(TensorData::new(token_values, [cfg.ntok]), &plain);

    // The teacher's top-k, on the device, once.
    let top = head.topk(&teacher_hidden(cfg, tokens.clone(), &plain), &TopkOptions::new(cfg.k))?;
    let teacher = Teacher {
        ids: top.ids,
        probs: top.probs,
    };
    let unfused_teacher = unfused::UnfusedTeacher {
        ids: teacher.ids.clone(),
        probs: teacher.probs.clone(),
    };

    let mut student = Student::new(cfg, &device);
    let mut optim = AdamConfig::new().init();
    let mut losses = Vec::with_capacity(cfg.steps);
    for _ in 0..cfg.steps {
        let hidden = student.forward(tokens.clone());
        let loss = if cfg.unfused {
            unfused::loss(hidden, &head_tensor, &unfused_teacher, None, None, 1.0).0
        } else {
            head.loss(&hidden, &teacher, None, &LossConfig::default())?.loss
        };
        losses.push(loss.clone().detach());
        let grads = GradientsParams::from_grads(loss.backward(), &student);
        student = optim.step(cfg.lr, student, grads);
    }
    // The one host wait: the losses, and whatever the device flagged.
    let values = Tensor::cat(losses, 0).into_data().try_to_vec::<f32>()?;
    head.wait()?;
    Ok(values)
}

fn main() {
    let d = Config::default();
    let help = format!(
        "distill_burn: train a small burn student against a fixed teacher's top-k through headkl's loss\n\n\
         Flags (each takes a value, but --unfused):\n  \
         --steps N   Adam steps (default {})\n  \
         --ntok N    tokens per step (default {})\n  \
         --inputs N  distinct input tokens (default {})\n  \
         --vocab N   vocabulary size of the head (default {})\n  \
         --hs N      hidden size (default {})\n  \
         --embed N   embedding width (default {})\n  \
         --mlp N     MLP width (default {})\n  \
         --k N       teacher top-k (default {})\n  \
         --lr F      Adam's learning rate (default {})\n  \
         --seed N    seed (default {})\n  \
         --unfused   the loss written the burn way (matmul, log_softmax, gather) instead of headkl's\n\n\
         Prints one line per step, then `loss: first <f> last <f>`.",
        d.steps, d.ntok, d.inputs, d.vocab, d.hs, d.embed, d.mlp, d.k, d.lr, d.seed
    );
    common::example_main("distill_burn", &help, Config::from_args, run, common::print_losses);
}
