//! The driver's scratch buffers, from one list: [`RowBytes`] gives every
//! buffer's bytes per token row, and both the chunk plan ([`RowBytes::costs`])
//! and the allocations come from it. The buffers are grouped by who needs
//! them, so a call takes exactly the groups its job and input need and no
//! "missing buffer" case exists: every job takes [`RowScratch`], `head_kl`
//! also [`LossScratch`], and f32 input its `x32` buffer ([`Input::F32`]).

use half::{bf16, f16};

use crate::error::Result;
use crate::toolkit::backend::Backend;
use crate::toolkit::chunking::RowCost;

/// Which job a scratch set is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Job {
    Loss,
    /// `head_kl` with the dx GEMM's block filter: grad has room for the
    /// block mask after its rows.
    LossFiltered,
    Topk,
}

impl Job {
    /// A `head_kl` job (with or without the filter).
    pub fn is_loss(self) -> bool {
        matches!(self, Job::Loss | Job::LossFiltered)
    }

    /// The `head_kl` job with the filter's ε (or without it).
    pub fn loss(filter_eps: Option<f32>) -> Self {
        match filter_eps {
            Some(_) => Job::LossFiltered,
            None => Job::Loss,
        }
    }
}

/// What the cached scratch was sized for; a call with another key frees
/// it all before allocating, so the new set can use its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ScratchKey {
    job: Job,
    rows: usize,
    k: usize,
    f32_input: bool,
}

/// Bytes per token row of every scratch buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowBytes {
    /// f32 hidden rows as given (`hs` wide), for f32 input.
    pub x32: u64,
    /// f16 hidden rows, padded: the logits GEMM's A.
    pub x16: u64,
    /// f32 logits, padded vocabulary; for `head_kl`, at least the dx
    /// GEMM's split-K partial blocks (`hs_padded` f32 per row each), which
    /// live in the logits buffer once `kl_rows` has read it.
    pub logits: u64,
    /// Teacher (or top-k) ids.
    pub ids: u64,
    /// Teacher (or top-k) probabilities.
    pub probs: u64,
    /// Per-row inputs of the KL kernel: coefficient and label
    /// (`head_kl`).
    pub row_in: u64,
    /// Per-row outputs of the KL kernel: loss, lse, soft and hard parts
    /// (`head_kl`).
    pub loss: u64,
    /// f16 logit gradient, padded vocabulary, and with the filter the
    /// block mask (`crate::problem::filter`) (`head_kl`).
    pub grad: u64,
    /// f32 input gradient, padded hidden size (`head_kl`).
    pub dx: u64,
    /// The buffers the host path's transfers touch (the hidden rows'
    /// upload buffer, dx) come in two, by chunk parity
    /// ([`Backend::transfers_overlap`]).
    pub doubled: bool,
}

impl RowBytes {
    /// The sizes for a head of `vocab_padded × hs_padded` (real hidden size
    /// `hs`), `k` teacher entries and at most `dx_blocks` split-K partial
    /// blocks of dx (0 where the dx GEMM writes dx directly), with room
    /// for the block filter's mask when `mask`.
    pub fn new(vocab_padded: usize, hs: usize, hs_padded: usize, k: usize, dx_blocks: usize, mask: bool) -> Self {
        let mask_halves = match mask {
            true => crate::problem::filter::mask_halves(1, vocab_padded) as u64,
            false => 0,
        };
        let (v, h, k) = (vocab_padded as u64, hs_padded as u64, k as u64);
        Self {
            x32: hs as u64 * 4,
            x16: h * 2,
            logits: v.max(dx_blocks as u64 * h) * 4,
            ids: k * 4,
            probs: k * 4,
            row_in: 8,
            loss: 16,
            grad: (v + mask_halves) * 2,
            dx: h * 4,
            doubled: false,
        }
    }

    /// The buffers a call of `job` allocates, with their bytes per row: what
    /// the chunk plan budgets.
    pub fn costs(&self, job: Job, f32_input: bool) -> Vec<RowCost> {
        let cost = |what, bytes_per_row| RowCost { what, bytes_per_row };
        let mut c = vec![
            cost("x16", self.x16),
            cost("logits", self.logits),
            cost("ids", self.ids),
            cost("probs", self.probs),
        ];
        if f32_input {
            c.push(cost("x32", self.x32));
        }
        if self.doubled {
            c.push(if f32_input {
                cost("x32 (odd chunks)", self.x32)
            } else {
                cost("x16 (odd chunks)", self.x16)
            });
            if job.is_loss() {
                c.push(cost("dx (odd chunks)", self.dx));
            }
        }
        if job.is_loss() {
            c.extend([
                cost("row_in", self.row_in),
                cost("loss", self.loss),
                cost("grad", self.grad),
                cost("dx", self.dx),
            ]);
        }
        c
    }
}

/// The buffers every job uses.
pub(crate) struct RowScratch<B: Backend> {
    pub x16: B::Buffer,
    /// Odd chunks' `x16` where it is uploaded to ([`RowBytes::doubled`],
    /// input other than f32).
    x16_odd: Option<B::Buffer>,
    pub logits: B::Buffer,
    pub ids: B::Buffer,
    pub probs: B::Buffer,
}

impl<B: Backend> RowScratch<B> {
    pub fn alloc(b: &B, sizes: &RowBytes, rows: usize, f32_input: bool) -> Result<Self> {
        let r = rows as u64;
        Ok(Self {
            x16: b.alloc(r * sizes.x16, "x16")?,
            x16_odd: match sizes.doubled && !f32_input {
                true => Some(b.alloc(r * sizes.x16, "x16 (odd chunks)")?),
                false => None,
            },
            logits: b.alloc(r * sizes.logits, "logits")?,
            ids: b.alloc(r * sizes.ids, "ids")?,
            probs: b.alloc(r * sizes.probs, "probs")?,
        })
    }

    /// Chunk `chunk`'s f16 hidden rows.
    pub fn x16_for(&self, chunk: usize) -> &B::Buffer {
        odd_or(&self.x16, self.x16_odd.as_ref(), chunk)
    }
}

/// `odd` for odd chunks where there is one, else `even`.
fn odd_or<'a, T>(even: &'a T, odd: Option<&'a T>, chunk: usize) -> &'a T {
    match odd {
        Some(o) if chunk % 2 == 1 => o,
        _ => even,
    }
}

/// The buffers only `head_kl` uses.
pub(crate) struct LossScratch<B: Backend> {
    pub row_in: B::Buffer,
    pub loss: B::Buffer,
    pub grad: B::Buffer,
    pub dx: B::Buffer,
    /// Odd chunks' dx ([`RowBytes::doubled`]).
    dx_odd: Option<B::Buffer>,
}

impl<B: Backend> LossScratch<B> {
    pub fn alloc(b: &B, sizes: &RowBytes, rows: usize) -> Result<Self> {
        let r = rows as u64;
        Ok(Self {
            row_in: b.alloc(r * sizes.row_in, "row_in")?,
            loss: b.alloc(r * sizes.loss, "loss")?,
            grad: b.alloc(r * sizes.grad, "grad")?,
            dx: b.alloc(r * sizes.dx, "dx")?,
            dx_odd: match sizes.doubled {
                true => Some(b.alloc(r * sizes.dx, "dx (odd chunks)")?),
                false => None,
            },
        })
    }

    /// Chunk `chunk`'s dx.
    pub fn dx_for(&self, chunk: usize) -> &B::Buffer {
        odd_or(&self.dx, self.dx_odd.as_ref(), chunk)
    }
}

/// A call's hidden rows with the buffer their upload needs.
pub(crate) enum Input<'a, B: Backend> {
    /// f32 rows, converted on the device through `x32` (odd chunks
    /// through `x32_odd` where there is one, [`RowBytes::doubled`]).
    F32 {
        data: &'a [f32],
        x32: B::Buffer,
        x32_odd: Option<B::Buffer>,
    },
    /// f16 rows, uploaded as they are.
    F16(&'a [f16]),
    /// bf16 rows, rounded to f16 on the host as they go up.
    Bf16(&'a [bf16]),
}

/// The scratch an [`crate::engine::Engine`] keeps between calls.
pub(crate) struct ScratchCache<B: Backend> {
    key: Option<ScratchKey>,
    rows: Option<RowScratch<B>>,
    loss: Option<LossScratch<B>>,
    x32: Option<(B::Buffer, Option<B::Buffer>)>,
}

impl<B: Backend> Default for ScratchCache<B> {
    fn default() -> Self {
        Self {
            key: None,
            rows: None,
            loss: None,
            x32: None,
        }
    }
}

impl<B: Backend> ScratchCache<B> {
    /// Starts a call of `job` over chunks of `rows` rows (freeing
    /// everything sized for another call first) and takes what every job
    /// needs: the hidden rows' upload buffer and the row buffers.
    pub fn begin<'a>(
        &mut self,
        b: &B,
        job: Job,
        sizes: &RowBytes,
        (rows, k): (usize, usize),
        hidden: crate::problem::HiddenData<'a>,
    ) -> Result<(Input<'a, B>, RowScratch<B>)> {
        let f32_input = matches!(hidden, crate::problem::HiddenData::F32(_));
        let key = ScratchKey {
            job,
            rows,
            k,
            f32_input,
        };
        if self.key != Some(key) {
            *self = Self::default();
            self.key = Some(key);
        }
        let input = self.take_input(b, sizes, rows, hidden)?;
        Ok((input, self.take_rows(b, sizes, rows, f32_input)?))
    }

    /// The row buffers for the call begun (kept, or made).
    fn take_rows(&mut self, b: &B, sizes: &RowBytes, rows: usize, f32_input: bool) -> Result<RowScratch<B>> {
        match self.rows.take() {
            Some(s) => Ok(s),
            None => RowScratch::alloc(b, sizes, rows, f32_input),
        }
    }

    /// The loss buffers for the call begun.
    pub fn take_loss(&mut self, b: &B, sizes: &RowBytes, rows: usize) -> Result<LossScratch<B>> {
        match self.loss.take() {
            Some(s) => Ok(s),
            None => LossScratch::alloc(b, sizes, rows),
        }
    }

    /// `data` with the buffer its upload needs.
    fn take_input<'a>(
        &mut self,
        b: &B,
        sizes: &RowBytes,
        rows: usize,
        data: crate::problem::HiddenData<'a>,
    ) -> Result<Input<'a, B>> {
        use crate::problem::HiddenData;
        Ok(match data {
            HiddenData::F32(data) => {
                let (x32, x32_odd) = match self.x32.take() {
                    Some(x) => x,
                    None => {
                        let bytes = rows as u64 * sizes.x32;
                        let odd = match sizes.doubled {
                            true => Some(b.alloc(bytes, "x32 (odd chunks)")?),
                            false => None,
                        };
                        (b.alloc(bytes, "x32")?, odd)
                    }
                };
                Input::F32 { data, x32, x32_odd }
            }
            HiddenData::F16(data) => Input::F16(data),
            HiddenData::Bf16(data) => Input::Bf16(data),
        })
    }

    /// Keeps the buffers for the next call.
    pub fn put_back(&mut self, rows: RowScratch<B>, loss: Option<LossScratch<B>>, input: Input<'_, B>) {
        self.rows = Some(rows);
        self.loss = loss;
        if let Input::F32 { x32, x32_odd, .. } = input {
            self.x32 = Some((x32, x32_odd));
        }
    }
}

/// Scratch of the resident entry points, kept across calls: the host
/// path's groups (`crate::engine::scratch`), from the same sizes, for the key it
/// was made for.
pub(crate) struct ResidentScratch<B: Backend> {
    pub(crate) key: (Job, usize, usize),
    pub(crate) rows: RowScratch<B>,
    /// `head_kl_device`'s (a scratch made for `topk_device` has none).
    pub(crate) loss: Option<LossScratch<B>>,
}

/// What an [`crate::engine::Engine`] keeps for the resident entry points: scratch, the
/// status buffer, and whether work is in flight since the last wait.
pub(crate) struct ResidentState<B: Backend> {
    pub(crate) scratch: Option<ResidentScratch<B>>,
    pub(crate) status: Option<B::Buffer>,
    pub(crate) pending: bool,
    pub(crate) checked: bool,
}

impl<B: Backend> ResidentState<B> {
    pub(crate) fn new() -> Self {
        Self {
            scratch: None,
            status: None,
            pending: false,
            checked: false,
        }
    }

    /// Whether every call waits (checked mode).
    pub(crate) fn checked(&self) -> bool {
        self.checked
    }

    pub(crate) fn release_scratch(&mut self) {
        self.scratch = None;
    }
}
