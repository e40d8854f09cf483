//! A training step that learns, entirely on the GPU: a student (a learned
//! linear map from fixed random features to hidden rows, followed by the
//! frozen head) distilled from a fixed teacher's top-k with headkl's
//! device-resident `head_kl` and plain SGD in a small WGSL kernel.
//!
//! ```sh
//! cargo run --release -p headkl-wgpu --example distill_step -- --steps 40
//! ```
//!
//! The trainer opens its own wgpu device; headkl runs on it
//! ([`WgpuBackend::from_device`]) and reads and writes the trainer's
//! buffers ([`WgpuBackend::wrap_buffer`]). Every step is recorded and
//! submitted without a host round trip: forward, `head_kl_device`, SGD, and
//! the step's mean loss into a history buffer. The host waits once, at the
//! end, then prints one line per step and `loss: first <f> last <f>`.

use std::error::Error;

use headkl_core::{
    DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, Engine, HeadData, HeadWeights, HiddenDtype,
    QueueChoice, SliceOptions, TopkOptions,
};
use headkl_wgpu::{OpenOptions, WgpuBackend};

#[path = "common/mod.rs"]
#[macro_use]
mod common;

use common::{each_flag, parsed, uniform};

/// Sizes and knobs of a run.
#[derive(Clone, Debug)]
pub struct Config {
    /// SGD steps.
    pub steps: usize,
    /// Tokens per step.
    pub ntok: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size.
    pub hs: usize,
    /// Features per token (rows of the learned map).
    pub features: usize,
    /// Teacher top-k.
    pub k: usize,
    /// Learning rate.
    pub lr: f32,
    /// Seed of the head, the features and the teacher's map.
    pub seed: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            steps: 40,
            ntok: 256,
            vocab: 2048,
            hs: 128,
            features: 32,
            k: 32,
            lr: 0.5,
            seed: 1,
        }
    }
}

impl Config {
    /// `--steps N` and the other `--name value` flags.
    pub fn from_args(args: impl Iterator<Item = String>) -> Result<Self, String> {
        let mut cfg = Config::default();
        field_flags!(args, cfg, [steps, ntok, vocab, hs, features, k, lr, seed])?;
        if cfg.steps == 0 {
            return Err("--steps must be at least 1".into());
        }
        Ok(cfg)
    }
}

/// The block `distill_step.wgsl` reads.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct StepParams {
    ntok: u32,
    d: u32,
    hs: u32,
    step: u32,
    lr: f32,
    pad: [f32; 3],
}

/// The trainer's side of the example: its device, buffers and kernels.
struct Trainer {
    device: wgpu::Device,
    queue: wgpu::Queue,
    layout: wgpu::BindGroupLayout,
    forward: wgpu::ComputePipeline,
    sgd: wgpu::ComputePipeline,
    record: wgpu::ComputePipeline,
    params: wgpu::Buffer,
    stride: u64,
}

impl Trainer {
    fn buffer(&self, label: &str, bytes: usize, data: Option<&[f32]>) -> wgpu::Buffer {
        let b = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (bytes as u64).next_multiple_of(256),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if let Some(d) = data {
            self.queue.write_buffer(&b, 0, bytemuck::cast_slice(d));
        }
        b
    }

    fn bind(&self, buffers: [&wgpu::Buffer; 5]) -> wgpu::BindGroup {
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &self.params,
                offset: 0,
                size: wgpu::BufferSize::new(size_of::<StepParams>() as u64),
            }),
        }];
        for (i, b) in buffers.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: b.as_entire_binding(),
            });
        }
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("distill_step"),
            layout: &self.layout,
            entries: &entries,
        })
    }

    /// Submits `pipeline` over `invocations` (64 per workgroup) at `step`.
    fn run(&self, pipeline: &wgpu::ComputePipeline, group: &wgpu::BindGroup, step: usize, invocations: usize) {
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, group, &[(step as u64 * self.stride) as u32]);
            pass.dispatch_workgroups(invocations.div_ceil(64) as u32, 1, 1);
        }
        self.queue.submit([enc.finish()]);
    }
}

fn open_trainer(cfg: &Config) -> Result<(wgpu::Adapter, Trainer), Box<dyn Error>> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    }))?;
    // The trainer asks for what headkl needs beside its own needs.
    let features = WgpuBackend::required_features(&adapter);
    // headkl's request_device opens it on a compute-only queue family where
    // the adapter has one (faster on NVIDIA than wgpu's graphics family).
    let (device, queue) = headkl_wgpu::request_device(
        &adapter,
        &wgpu::DeviceDescriptor {
            label: Some("trainer"),
            required_features: features,
            required_limits: adapter.limits(),
            experimental_features: WgpuBackend::experimental_features(features),
            ..Default::default()
        },
        QueueChoice::Auto,
    )?;
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("distill_step.wgsl"),
        source: wgpu::ShaderSource::Wgsl(include_str!("distill_step.wgsl").into()),
    });
    let storage = |binding: u32, read_only: bool| wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    };
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some("distill_step"),
        entries: &[
            wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: true,
                    min_binding_size: None,
                },
                count: None,
            },
            storage(1, true),
            storage(2, false),
            storage(3, false),
            storage(4, false),
            storage(5, false),
        ],
    });
    let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some("distill_step"),
        bind_group_layouts: &[Some(&layout)],
        immediate_size: 0,
    });
    let pipeline = |entry: &str| {
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(entry),
            layout: Some(&pipeline_layout),
            module: &module,
            entry_point: Some(entry),
            compilation_options: wgpu::PipelineCompilationOptions::default(),
            cache: None,
        })
    };
    let (forward, sgd, record) = (pipeline("forward"), pipeline("sgd"), pipeline("record_loss"));
    // One parameter block per step, written once: no upload inside the loop.
    let stride = u64::from(device.limits().min_uniform_buffer_offset_alignment).max(size_of::<StepParams>() as u64);
    let params = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("step params"),
        size: stride * cfg.steps as u64,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    for step in 0..cfg.steps {
        let p = StepParams {
            ntok: cfg.ntok as u32,
            d: cfg.features as u32,
            hs: cfg.hs as u32,
            step: step as u32,
            lr: cfg.lr,
            pad: [0.0; 3],
        };
        queue.write_buffer(&params, step as u64 * stride, bytemuck::bytes_of(&p));
    }
    let trainer = Trainer {
        device,
        queue,
        layout,
        forward,
        sgd,
        record,
        params,
        stride,
    };
    Ok((adapter, trainer))
}

/// Trains for `cfg.steps` steps; returns the mean loss of each step.
pub fn run(cfg: &Config) -> Result<Vec<f32>, Box<dyn Error>> {
    let (ntok, vocab, hs, d, k) = (cfg.ntok, cfg.vocab, cfg.hs, cfg.features, cfg.k);
    let (adapter, tr) = open_trainer(cfg)?;
    let backend = WgpuBackend::from_device(&adapter, tr.device.clone(), tr.queue.clone(), &OpenOptions::default())?;

    // The frozen head and the fixed data (seeded).
    let w = uniform(vocab * hs, cfg.seed, 0.5);
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs)?;
    let mut engine = Engine::new(&backend, &head, SliceOptions::default())?;
    let feats = tr.buffer("features", ntok * d * 4, Some(&uniform(ntok * d, cfg.seed + 1, 1.0)));
    let teacher_map = tr.buffer("teacher map", d * hs * 4, Some(&uniform(d * hs, cfg.seed + 2, 0.5)));
    let student_map = tr.buffer("student map", d * hs * 4, Some(&vec![0.0; d * hs]));
    let teacher_hidden = tr.buffer("teacher hidden", ntok * hs * 4, None);
    let hidden = tr.buffer("hidden", ntok * hs * 4, None);
    let dx = tr.buffer("dx", ntok * hs * 4, None);
    let loss = tr.buffer("loss", ntok * 4, None);
    let history = tr.buffer("history", cfg.steps * 4, None);
    let ids = tr.buffer("teacher ids", ntok * k * 4, None);
    let probs = tr.buffer("teacher probs", ntok * k * 4, None);

    // headkl's views of the trainer's buffers.
    let view = |b: &wgpu::Buffer, bytes: usize| backend.wrap_buffer(b, 0, bytes as u64);
    let (teacher_hidden_v, hidden_v) = (view(&teacher_hidden, ntok * hs * 4)?, view(&hidden, ntok * hs * 4)?);
    let (ids_v, probs_v) = (view(&ids, ntok * k * 4)?, view(&probs, ntok * k * 4)?);
    let (dx_v, loss_v) = (view(&dx, ntok * hs * 4)?, view(&loss, ntok * 4)?);

    // The teacher: its hidden rows through the same head, top-k on the device.
    let teacher_group = tr.bind([&feats, &teacher_map, &teacher_hidden, &loss, &history]);
    tr.run(&tr.forward, &teacher_group, 0, ntok * hs);
    let f32_rows = |buffer| DeviceHidden {
        buffer,
        dtype: HiddenDtype::F32,
    };
    engine.topk_device(
        ntok,
        &f32_rows(&teacher_hidden_v),
        &ids_v,
        &probs_v,
        &TopkOptions::new(k),
    )?;

    let forward_group = tr.bind([&feats, &student_map, &hidden, &loss, &history]);
    let sgd_group = tr.bind([&feats, &student_map, &dx, &loss, &history]);
    let teacher = DeviceTeacher::new(&ids_v, &probs_v, k);
    let out = DeviceLossOutput {
        loss: &loss_v,
        dx: &dx_v,
    };
    for step in 0..cfg.steps {
        tr.run(&tr.forward, &forward_group, step, ntok * hs);
        engine.head_kl_device(
            ntok,
            &f32_rows(&hidden_v),
            &teacher,
            &out,
            &DeviceLossOptions::default(),
        )?;
        tr.run(&tr.sgd, &sgd_group, step, d * hs);
        tr.run(&tr.record, &forward_group, step, 64);
    }
    // The one wait: bad data anywhere in the run would be reported here.
    engine.wait_device()?;
    let history_v = view(&history, cfg.steps * 4)?;
    let mut losses = vec![0f32; cfg.steps];
    headkl_core::Backend::download(&backend, &history_v, 0, bytemuck::cast_slice_mut(&mut losses))?;
    Ok(losses)
}

fn main() {
    let d = Config::default();
    let help = format!(
        "distill_step: train a small student against a fixed teacher's top-k on the GPU\n\n\
         Flags (each takes a value):\n  \
         --steps N     SGD steps (default {})\n  \
         --ntok N      tokens per step (default {})\n  \
         --vocab N     vocabulary size (default {})\n  \
         --hs N        hidden size (default {})\n  \
         --features N  features per token, rows of the learned map (default {})\n  \
         --k N         teacher top-k (default {})\n  \
         --lr F        learning rate (default {})\n  \
         --seed N      seed of the head, features and teacher map (default {})\n\n\
         Prints one line per step, then `loss: first <f> last <f>`.",
        d.steps, d.ntok, d.vocab, d.hs, d.features, d.k, d.lr, d.seed
    );
    common::example_main("distill_step", &help, Config::from_args, run, common::print_losses);
}
