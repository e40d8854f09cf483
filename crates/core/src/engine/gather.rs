//! `Engine::logprobs_at`: the log-probabilities over the full vocabulary at
//! ids the caller gives (the teacher's side of on-policy distillation: the
//! student's top-k ids, scored by the teacher), with each token's lse. The
//! logits GEMM as `topk` runs it, then the top-k kernel's gather mode
//! ([`TopkDesc::gather`]): no `[ntok][V]` tensor leaves the device.

use super::{Engine, Error, Result};
use crate::engine::head_planes::Scaling;
use crate::engine::in_flight::{Copying, InFlight};
use crate::problem::{Hidden, TopkOptions};
use crate::toolkit::backend::{Backend, TopkDesc};
use crate::toolkit::chunking::{ChunkTransfers, Rows};
use crate::toolkit::launch::Kernels;

/// Result of [`Engine::logprobs_at`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Gathered {
    /// `log p^τ` over the full vocabulary at each given id `[ntok][k]`
    /// (`-inf` where the id was none).
    pub logprobs: Vec<f32>,
    /// Each token's `lse` of its (capped, scaled) logits at τ `[ntok]`.
    pub lse: Vec<f32>,
    /// Tokens.
    pub ntok: usize,
    /// Ids per token.
    pub k: usize,
}

/// An id the kernel reads as none (past any vocabulary).
const NONE: u32 = u32::MAX;

/// The checks [`Engine::logprobs_at`] makes on its ids, for a caller to
/// make before anything is uploaded: `ntok · k` of them, each negative
/// (none) or below `vocab`.
pub fn check_gather_ids(ids: &[i64], ntok: usize, k: usize, vocab: usize) -> Result<()> {
    crate::error::Field::Ids.check_len(ntok * k, ids.len())?;
    match ids.iter().position(|&id| id >= 0 && id as u64 >= vocab as u64) {
        Some(i) => Err(Error::IdOutOfRange {
            row: i / k,
            col: i % k,
            id: ids[i],
            vocab,
        }),
        None => Ok(()),
    }
}

impl<B: Backend> Engine<B> {
    /// The log-probabilities at τ over the full vocabulary of the logits
    /// `z = S·x·Wᵀ` (softcapped if asked: `opts` as for [`Engine::topk`],
    /// whose `k` is the ids per token and whose `logprobs` plays no part)
    /// at `ids` `[ntok][k]` (a negative id is none and gets `-inf`), and
    /// each token's lse: what `torch.log_softmax(c·tanh(z/c)/τ, -1)
    /// .gather(-1, ids)` gives. Ids are checked before anything reaches the
    /// device.
    pub fn logprobs_at(&mut self, hidden: &Hidden<'_>, ids: &[i64], opts: &TopkOptions) -> Result<Gathered> {
        self.head.check_hidden(hidden)?;
        self.resident.release_scratch();
        let vocab = self.head.vocab();
        opts.check(vocab)?;
        let (ntok, k) = (hidden.ntok(), opts.k);
        check_gather_ids(ids, ntok, k, vocab)?;
        // The head's rows may be stored in another order.
        let positions: Vec<u32> = ids
            .iter()
            .map(|&id| match u32::try_from(id) {
                Ok(id) => self.head.order().map_or(id, |o| o.position(id)),
                Err(_) => NONE,
            })
            .collect();
        // The kernel's columns: the ids, then the lse.
        let cols = k + 1;
        let (plan, input, s) = self.begin_row_job(hidden, cols, opts)?;
        let mut out = Gathered {
            logprobs: vec![0f32; ntok * k],
            lse: vec![0f32; ntok],
            ntok,
            k,
        };
        let b = &self.backend;
        let mut run = || -> Result<()> {
            // Two chunks in flight, as in `topk`: a chunk's values are read
            // while the next one runs.
            let mut pipe = InFlight::new();
            let mut values = Vec::new();
            let mut read = |mut done: Copying<'_, B>, out: &mut Gathered| -> Result<()> {
                let (start, rows) = (done.start, done.rows);
                values.resize(rows * cols, 0f32);
                done.read_next(bytemuck::cast_slice_mut(&mut values))?;
                for (t, row) in values.chunks_exact(cols).enumerate() {
                    // NaN in the first value (or the lse): a non-finite logit.
                    if row[0].is_nan() || !row[k].is_finite() {
                        return Err(Error::NonFiniteHidden { token: start + t });
                    }
                    let token = start + t;
                    out.logprobs[token * k..(token + 1) * k].copy_from_slice(&row[..k]);
                    out.lse[token] = row[k];
                }
                self.report(rows);
                Ok(())
            };
            let mut row_ids = Vec::new();
            for (chunk, Rows { start, rows }) in plan.chunk_rows(ntok, ChunkTransfers::Host).into_iter().enumerate() {
                let x16 = s.x16_for(chunk);
                self.head
                    .chunk_logits(b, &input, x16, (chunk, start, rows), &s.logits, Scaling::top_k(opts))?;
                row_ids.clear();
                for t in start..start + rows {
                    row_ids.extend_from_slice(&positions[t * k..(t + 1) * k]);
                    row_ids.push(NONE);
                }
                b.upload(&s.ids, 0, bytemuck::cast_slice(&row_ids))?;
                let desc = TopkDesc {
                    cap: opts.softcap.map(|c| c / opts.temperature),
                    gather: true,
                    ..TopkDesc::plain(rows, vocab, self.head.vocab_padded(), cols)
                };
                b.topk_rows(&s.logits, &s.ids, &s.probs, &desc)?;
                let copying = Copying::begin(b, (start, rows), &[(&s.probs, 0, rows * cols * 4)])?;
                if let Some(done) = pipe.push(copying) {
                    read(done, &mut out)?;
                }
            }
            if let Some(done) = pipe.pop() {
                read(done, &mut out)?;
            }
            Ok(())
        };
        let result = run();
        self.scratch.put_back(s, None, input);
        result.map(|()| out)
    }
}
