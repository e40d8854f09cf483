//! The bench's data: the head, hidden rows and teacher of a shape (`random` or `lm`), labels, the vocabulary order and the full-vocabulary teacher's rows.

use std::path::PathBuf;
use std::time::Instant;

use half::f16;
use headkl_core::{Backend, DeviceHidden, DeviceLossOutput, DeviceTeacher, HiddenDtype, Teacher, VocabOrder};
use headkl_reference::rng::{fill_parallel, XorShift64};

use super::{Shape, DATA_SEED};
use crate::error::CliError;
use crate::text::fmt_bytes;

/// The tokens' labels for `--labels random`: uniform over the vocabulary,
/// from a fixed seed (so runs compare).
pub(super) fn random_labels(shape: Shape) -> Vec<i64> {
    let mut rng = XorShift64::new(DATA_SEED + 3);
    (0..shape.ntok).map(|_| rng.below(shape.vocab as u64) as i64).collect()
}

/// `--vocab-order`: `natural`, `prior` (the `lm` generator's unigram prior,
/// likely tokens first) or a file of token ids in the order to store them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VocabOrderArg {
    /// The head as given.
    Natural,
    /// By the `lm` data's prior (`--data lm` only).
    Prior,
    /// Token ids, whitespace-separated, position by position.
    File(PathBuf),
}

impl VocabOrderArg {
    /// Parses `natural`, `prior` or a path.
    pub fn parse(s: &str) -> Result<Self, String> {
        Ok(match s.trim() {
            "natural" => VocabOrderArg::Natural,
            "prior" => VocabOrderArg::Prior,
            "" => return Err("natural, prior or a file of token ids".into()),
            path => VocabOrderArg::File(PathBuf::from(path)),
        })
    }

    /// The order for `data`, or `None` for the natural one.
    pub(super) fn resolve(&self, data: &BenchData) -> Result<Option<VocabOrder>, CliError> {
        let order = match self {
            VocabOrderArg::Natural => return Ok(None),
            VocabOrderArg::Prior => {
                let prior = data.log_prior.as_ref().ok_or_else(|| {
                    CliError::option("--vocab-order", "prior needs --data lm (the generator's unigram prior)")
                })?;
                VocabOrder::by_score(prior)
            }
            VocabOrderArg::File(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| CliError::option("--vocab-order", format!("{}: {e}", path.display())))?;
                // The file's error, under the option that named it.
                let order = headkl_files::vocab_order::parse(path, &text)
                    .map_err(|e| CliError::option("--vocab-order", e.to_string()))?;
                if order.len() != data.shape.vocab {
                    return Err(CliError::option(
                        "--vocab-order",
                        format!(
                            "{}: {} token ids, but the head has V = {}",
                            path.display(),
                            order.len(),
                            data.shape.vocab
                        ),
                    ));
                }
                return Ok(Some(order));
            }
        };
        order
            .map(Some)
            .map_err(|e| CliError::option("--vocab-order", e.to_string()))
    }
}

/// What data the bench makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// Uniform head and hidden rows, a random teacher: flat logits, where
    /// the block filter skips nothing.
    Random,
    /// `headkl_reference::lm`: logits like a trained LM's.
    Lm,
}

impl DataKind {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DataKind::Random => "random",
            DataKind::Lm => "lm",
        }
    }
}

/// The device buffers of one resident `head_kl` call over [`BenchData`]:
/// its hidden rows and teacher, and zeroed loss and dx outputs.
pub(crate) struct LossBuffers<Buf> {
    pub(crate) x: Buf,
    pub(crate) ids: Buf,
    pub(crate) probs: Buf,
    pub(crate) loss: Buf,
    pub(crate) dx: Buf,
}

impl<Buf> LossBuffers<Buf> {
    /// The buffers as a resident `head_kl` call takes them: f16 hidden rows,
    /// a teacher of `k` entries a token, and the outputs.
    pub(crate) fn views(&self, k: usize) -> (DeviceHidden<'_, Buf>, DeviceTeacher<'_, Buf>, DeviceLossOutput<'_, Buf>) {
        let hidden = DeviceHidden {
            buffer: &self.x,
            dtype: HiddenDtype::F16,
        };
        let teacher = DeviceTeacher::new(&self.ids, &self.probs, k);
        let out = DeviceLossOutput {
            loss: &self.loss,
            dx: &self.dx,
        };
        (hidden, teacher, out)
    }
}

/// Labels of [`LossBuffers`]' buffers in the device's debug tools, in the
/// order x, ids, probs, loss, dx.
pub(crate) type LossBufferLabels = [&'static str; 5];

/// A device buffer of `data`'s size holding `data`.
pub(crate) fn upload_buffer<B: Backend>(
    backend: &B,
    data: &[u8],
    label: &'static str,
) -> Result<B::Buffer, headkl_core::Error> {
    let buffer = backend.alloc(data.len() as u64, label)?;
    backend.upload(&buffer, 0, data)?;
    Ok(buffer)
}

/// The data of one shape: f16 head and hidden rows, and a teacher.
pub(crate) struct BenchData {
    pub(crate) shape: Shape,
    pub(super) kind: DataKind,
    /// The `lm` data's log prior over the vocabulary (`--vocab-order prior`).
    log_prior: Option<Vec<f32>>,
    pub(crate) head: Vec<f16>,
    pub(crate) hidden: Vec<f16>,
    pub(crate) teacher: Teacher,
}

impl BenchData {
    /// Uploads the hidden rows and teacher, and zeroed outputs, for a
    /// resident `head_kl` call.
    pub(crate) fn upload_loss_buffers<B: Backend>(
        &self,
        backend: &B,
        [x, ids, probs, loss, dx]: LossBufferLabels,
    ) -> Result<LossBuffers<B::Buffer>, headkl_core::Error> {
        let (ntok, hs) = (self.shape.ntok, self.shape.hs);
        Ok(LossBuffers {
            x: upload_buffer(backend, bytemuck::cast_slice(&self.hidden), x)?,
            ids: upload_buffer(backend, bytemuck::cast_slice(self.teacher.ids()), ids)?,
            probs: upload_buffer(backend, bytemuck::cast_slice(self.teacher.probs()), probs)?,
            loss: upload_buffer(backend, &vec![0u8; ntok * 4], loss)?,
            dx: upload_buffer(backend, &vec![0u8; ntok * hs * 4], dx)?,
        })
    }

    /// Generates the data on every core. Head values have standard
    /// deviation 0.02 and hidden values 1 (the anchors' scales), so logits
    /// are O(1) as in a real model.
    pub(crate) fn generate(shape: Shape, kind: DataKind) -> Result<Self, CliError> {
        if kind == DataKind::Lm {
            return Self::generate_lm(shape);
        }
        let start = Instant::now();
        log::info!(
            "bench: generating {shape} data (head {})",
            fmt_bytes((shape.vocab * shape.hs * 2) as u64)
        );
        let head_a = 0.02 * 3f32.sqrt();
        let mut head = vec![f16::ZERO; shape.vocab * shape.hs];
        fill_parallel(&mut head, DATA_SEED, |r| f16::from_f32(r.symmetric(head_a)));
        let mut hidden = vec![f16::ZERO; shape.ntok * shape.hs];
        fill_parallel(&mut hidden, DATA_SEED + 1, |r| f16::from_f32(r.symmetric(3f32.sqrt())));
        let (ntok, k, vocab) = (shape.ntok, shape.k, shape.vocab);
        let mut ids = vec![0u32; ntok * k];
        let mut probs = vec![0f32; ntok * k];
        let mut rng = XorShift64::new(DATA_SEED + 2);
        for t in 0..ntok {
            let row = &mut ids[t * k..(t + 1) * k];
            let mut q = 0;
            while q < k {
                let id = rng.below(vocab as u64) as u32;
                // k ≤ 2048 and ≤ V: a linear scan is cheap next to the GEMMs.
                if !row[..q].contains(&id) {
                    row[q] = id;
                    q += 1;
                }
            }
            for p in &mut probs[t * k..(t + 1) * k] {
                *p = (3.0 * rng.unit()).exp();
            }
        }
        let teacher = Teacher::new(&ids, &probs, ntok, k, vocab)
            .map_err(|e| CliError::device("generating the benchmark teacher", e))?;
        log::info!("bench: data ready in {:.1} s", start.elapsed().as_secs_f64());
        Ok(Self {
            shape,
            kind,
            log_prior: None,
            head,
            hidden,
            teacher,
        })
    }

    /// `--data lm`: `headkl_reference::lm`'s generator with its calibrated
    /// defaults, and its statistics printed beside the published ones.
    fn generate_lm(shape: Shape) -> Result<Self, CliError> {
        use headkl_reference::lm;
        let start = Instant::now();
        log::info!(
            "bench: generating {shape} lm data (head {})",
            fmt_bytes((shape.vocab * shape.hs * 2) as u64)
        );
        let spec = lm::LmSpec::new(shape.vocab, shape.hs, shape.ntok, shape.k, DATA_SEED);
        let d = lm::generate(&spec).map_err(|e| CliError::option("--data lm", e))?;
        let teacher = Teacher::new(&d.ids, &d.probs, shape.ntok, shape.k, shape.vocab)
            .map_err(|e| CliError::device("generating the lm teacher", e))?;
        for line in d.report().lines() {
            eprintln!("bench: {line}");
        }
        log::info!("bench: data ready in {:.1} s", start.elapsed().as_secs_f64());
        Ok(Self {
            shape,
            kind: DataKind::Lm,
            log_prior: Some(d.log_prior),
            head: d.head,
            hidden: d.hidden,
            teacher,
        })
    }
}

/// `--teacher-hs N`: a random teacher head `[V][N]` and hidden rows
/// `[ntok][N]` at the student's scales (seeded apart from its data).
pub(super) fn teacher_data(shape: Shape, teacher_hs: usize) -> (Vec<f16>, Vec<f16>) {
    let head_a = 0.02 * 3f32.sqrt();
    let mut head = vec![f16::ZERO; shape.vocab * teacher_hs];
    fill_parallel(&mut head, DATA_SEED + 10, |r| f16::from_f32(r.symmetric(head_a)));
    let mut hidden = vec![f16::ZERO; shape.ntok * teacher_hs];
    fill_parallel(&mut hidden, DATA_SEED + 11, |r| f16::from_f32(r.symmetric(3f32.sqrt())));
    (head, hidden)
}
