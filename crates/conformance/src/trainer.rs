//! The trainer's-buffers case: a small `head_kl` whose every operand is a
//! view, at a non-zero offset, into one of two buffers a trainer made on its
//! own device, checked against the host path. Written once here; each GPU
//! backend's test makes the trainer's device and buffers its own way (ash,
//! wgpu), writes [`TrainerCase::input_writes`] into the input buffer and
//! calls [`TrainerCase::check`] with a function that wraps a view of
//! either buffer where [`TrainerCase::place`] says.

use headkl_core::{
    Backend, DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, Engine, HeadData, HeadWeights, Hidden,
    HiddenDtype, LossConfig, LossOptions, ResidentBackend, SliceOptions, Teacher,
};

use headkl_reference::tolerance::Tolerance;

/// The case's data: exact small patterns, no randomness.
#[derive(Clone, Debug)]
pub struct TrainerCase {
    /// Vocabulary rows of the head.
    pub vocab: usize,
    /// Hidden size.
    pub hs: usize,
    /// Token rows.
    pub ntok: usize,
    /// Teacher entries per row.
    pub k: usize,
    head: Vec<f32>,
    hidden: Vec<f32>,
    ids: Vec<u32>,
    probs: Vec<f32>,
    weights: Vec<f32>,
}

/// Where each operand sits in the trainer's two buffers, in bytes: every
/// offset a multiple of 256 and none at 0, so a kernel that ignored a
/// view's offset would read or write the wrong bytes.
#[derive(Clone, Copy, Debug)]
pub struct TrainerLayout {
    /// Hidden rows f32 `[ntok][hs]` in the input buffer.
    pub hidden: u64,
    /// Teacher ids u32 `[ntok][k]` in the input buffer.
    pub ids: u64,
    /// Teacher probabilities f32 `[ntok][k]` in the input buffer.
    pub probs: u64,
    /// Token weights f32 `[ntok]` in the input buffer.
    pub weights: u64,
    /// Size of the input buffer.
    pub input_bytes: u64,
    /// Per-token loss f32 `[ntok]` in the output buffer.
    pub loss: u64,
    /// dx f32 `[ntok][hs]` in the output buffer.
    pub dx: u64,
    /// Size of the output buffer.
    pub output_bytes: u64,
}

/// One view the case needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainerOperand {
    /// Hidden rows (input buffer).
    Hidden,
    /// Teacher ids (input buffer).
    Ids,
    /// Teacher probabilities (input buffer).
    Probs,
    /// Token weights (input buffer).
    Weights,
    /// Per-token loss (output buffer).
    Loss,
    /// dx (output buffer).
    Dx,
    /// The output buffer's bytes before the loss view, which must stay
    /// zero.
    BeforeOutputs,
}

impl TrainerOperand {
    /// Whether it lies in the input buffer (else in the output buffer).
    pub fn in_inputs(self) -> bool {
        matches!(self, Self::Hidden | Self::Ids | Self::Probs | Self::Weights)
    }
}

fn aligned(bytes: usize) -> u64 {
    (bytes as u64).next_multiple_of(256)
}

impl Default for TrainerCase {
    fn default() -> Self {
        Self::new()
    }
}

impl TrainerCase {
    /// 37 tokens over a 500 × 40 head, k = 8, weights 0 to 3 (some rows
    /// weigh nothing), chunks of 16 rows and head slices of 128 (see
    /// [`Self::engine`] and [`Self::check`]): several of each.
    pub fn new() -> Self {
        let (vocab, hs, ntok, k) = (500usize, 40usize, 37usize, 8usize);
        Self {
            vocab,
            hs,
            ntok,
            k,
            head: (0..vocab * hs)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 200.0)
                .collect(),
            hidden: (0..ntok * hs).map(|i| ((i * 13 % 29) as f32 - 14.0) / 10.0).collect(),
            ids: (0..ntok * k)
                .map(|i| ((i / k) * 7 + (i % k) * 61) as u32 % vocab as u32)
                .collect(),
            probs: (0..ntok * k).map(|i| 1.0 + (i % k) as f32).collect(),
            weights: (0..ntok).map(|t| (t % 4) as f32).collect(),
        }
    }

    /// The offsets of every operand in the trainer's buffers.
    pub fn layout(&self) -> TrainerLayout {
        let (ntok, hs, k) = (self.ntok, self.hs, self.k);
        let hidden = 256;
        let ids = hidden + aligned(ntok * hs * 4);
        let probs = ids + aligned(ntok * k * 4);
        let weights = probs + aligned(ntok * k * 4);
        let loss = 512;
        let dx = loss + aligned(ntok * 4);
        TrainerLayout {
            hidden,
            ids,
            probs,
            weights,
            input_bytes: weights + aligned(ntok * 4),
            loss,
            dx,
            output_bytes: dx + aligned(ntok * hs * 4),
        }
    }

    /// Where `op` lies in its buffer: `(offset, bytes)`.
    pub fn place(&self, op: TrainerOperand) -> (u64, u64) {
        let at = self.layout();
        let (ntok, hs, k) = (self.ntok as u64, self.hs as u64, self.k as u64);
        match op {
            TrainerOperand::Hidden => (at.hidden, ntok * hs * 4),
            TrainerOperand::Ids => (at.ids, ntok * k * 4),
            TrainerOperand::Probs => (at.probs, ntok * k * 4),
            TrainerOperand::Weights => (at.weights, ntok * 4),
            TrainerOperand::Loss => (at.loss, ntok * 4),
            TrainerOperand::Dx => (at.dx, ntok * hs * 4),
            TrainerOperand::BeforeOutputs => (0, at.loss),
        }
    }

    /// What the trainer writes into its input buffer, at [`Self::place`].
    pub fn input_writes(&self) -> [(TrainerOperand, &[u8]); 4] {
        [
            (TrainerOperand::Hidden, bytemuck::cast_slice(&self.hidden)),
            (TrainerOperand::Ids, bytemuck::cast_slice(&self.ids)),
            (TrainerOperand::Probs, bytemuck::cast_slice(&self.probs)),
            (TrainerOperand::Weights, bytemuck::cast_slice(&self.weights)),
        ]
    }

    /// An engine on `backend` with the case's head, in slices of 128 rows.
    pub fn engine<B: Backend>(&self, backend: B) -> headkl_core::Result<Engine<B>> {
        let head = HeadWeights::new(HeadData::F32(&self.head), self.vocab, self.hs)?;
        Engine::new(
            backend,
            &head,
            SliceOptions {
                max_rows_per_slice: Some(128),
            },
        )
    }

    /// Runs `head_kl_device` on the views `view` wraps (weights on the
    /// device, chunks of 16 rows) and holds dx and the loss to the host
    /// path's `head_kl` on the same engine; the output buffer's bytes before
    /// the loss view must be untouched (the trainer made it zeroed).
    pub fn check<B: ResidentBackend>(
        &self,
        engine: &mut Engine<B>,
        view: impl Fn(TrainerOperand) -> B::Buffer,
    ) -> Result<(), String> {
        let (ntok, hs, k) = (self.ntok, self.hs, self.k);
        let (hidden, ids, probs, weights) = (
            view(TrainerOperand::Hidden),
            view(TrainerOperand::Ids),
            view(TrainerOperand::Probs),
            view(TrainerOperand::Weights),
        );
        let (loss_view, dx_view, before_view) = (
            view(TrainerOperand::Loss),
            view(TrainerOperand::Dx),
            view(TrainerOperand::BeforeOutputs),
        );
        engine
            .head_kl_device(
                ntok,
                &DeviceHidden {
                    buffer: &hidden,
                    dtype: HiddenDtype::F32,
                },
                &DeviceTeacher::new(&ids, &probs, k),
                &DeviceLossOutput {
                    loss: &loss_view,
                    dx: &dx_view,
                },
                &DeviceLossOptions {
                    config: LossConfig {
                        max_rows_per_chunk: Some(16),
                        ..LossConfig::default()
                    },
                    weights: Some(&weights),
                    ..DeviceLossOptions::default()
                },
            )
            .map_err(|e| format!("head_kl_device: {e}"))?;
        engine.wait_device().map_err(|e| format!("wait_device: {e}"))?;
        let read = |view: &B::Buffer, n: usize| -> Result<Vec<f32>, String> {
            let mut out = vec![0f32; n];
            engine
                .backend()
                .download(view, 0, bytemuck::cast_slice_mut(&mut out))
                .map_err(|e| format!("download: {e}"))?;
            Ok(out)
        };
        let (loss, dx) = (read(&loss_view, ntok)?, read(&dx_view, ntok * hs)?);
        let before = read(&before_view, (self.layout().loss / 4) as usize)?;

        let teacher = Teacher::new(&self.ids, &self.probs, ntok, k, self.vocab).map_err(|e| format!("teacher: {e}"))?;
        let hidden = Hidden::f32(&self.hidden, ntok, hs).map_err(|e| format!("hidden: {e}"))?;
        let opts = LossOptions {
            weights: Some(self.weights.clone()),
            ..LossOptions::default()
        };
        let host = engine
            .head_kl(&hidden, &teacher, &opts)
            .map_err(|e| format!("host head_kl: {e}"))?;
        let host_dx: Vec<f64> = host.dx.iter().map(|&v| f64::from(v)).collect();
        Tolerance::default()
            .check_dx_rows(&dx, &host_dx, Some(hs))
            .map_err(|m| format!("dx against the host path: {m}"))?;
        for (t, (a, b)) in loss.iter().zip(&host.loss).enumerate() {
            if (a - b).abs() > 1e-4 * b.abs().max(1e-3) || !a.is_finite() {
                return Err(format!("loss[{t}]: {a} on the device, {b} on the host path"));
            }
        }
        if let Some(i) = before.iter().position(|&v| v != 0.0) {
            return Err(format!(
                "a kernel wrote before the loss view (f32 {i} is {})",
                before[i]
            ));
        }
        Ok(())
    }
}
