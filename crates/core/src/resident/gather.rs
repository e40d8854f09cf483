//! `Engine::logprobs_at_device`: the gather on buffers a trainer holds on
//! its device. Per chunk: the hidden rows into the f16 operand and the
//! logits GEMM (as `topk_device`), the caller's ids into the top-k
//! kernel's gather rows (`GatherIn`, which flags an id past V), the
//! kernel's gather mode, and its values out (`GatherOut`); at the end the
//! status kernel describes a flagged id, so `wait_device` returns the host
//! path's error for it.

use super::{elements, GatherRowsDesc, ResidentBackend, StatusDetailDesc};
use crate::engine::head_planes::Scaling;
use crate::engine::scratch::RowScratch;
use crate::engine::Engine;
use crate::error::Result;
use crate::problem::terms::{TailMode, TeacherForm};
use crate::problem::TopkOptions;
use crate::resident::DeviceHidden;
use crate::toolkit::backend::TopkDesc;
use crate::toolkit::chunking::{ChunkPlan, ChunkTransfers, Rows};
use crate::toolkit::launch::{Kernels, Launch};

impl<B: ResidentBackend> Engine<B> {
    /// [`Engine::logprobs_at`] on device buffers: reads `ntok` hidden rows
    /// from `hidden` and `opts.k` ids a token from `ids` (u32 `[ntok][k]`;
    /// `0xffffffff`, an i32 −1, is none and gets `-inf`), writes the
    /// log-probabilities at τ over the full vocabulary f32 `[ntok][k]` into
    /// `logprobs` and each token's lse f32 `[ntok]` into `lse`. Records and
    /// submits without waiting; [`Engine::wait_device`] reports an id at or
    /// past V ([`crate::error::Error::IdOutOfRange`], as the host path; the id is
    /// read as none meanwhile) or a row whose logits were not finite.
    pub fn logprobs_at_device(
        &mut self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        ids: &B::Buffer,
        (logprobs, lse): (&B::Buffer, &B::Buffer),
        opts: &TopkOptions,
    ) -> Result<()> {
        let entries = self.check_topk_call(ntok, hidden, ids, opts)?;
        let k = opts.k;
        self.check_view("logprobs", logprobs, entries, 4)?;
        self.check_view("lse", lse, ntok, 4)?;
        // The kernel's columns: the ids, then the lse.
        self.resident_row_call((ntok, k + 1), opts, |e, plan, scratch| {
            e.record_gather(ntok, hidden, (ids, logprobs, lse), opts, plan, scratch)
        })
    }

    /// Records [`Engine::logprobs_at_device`]'s kernels (its checks done)
    /// and submits them.
    fn record_gather(
        &self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        (ids, logprobs, lse): (&B::Buffer, &B::Buffer, &B::Buffer),
        opts: &TopkOptions,
        plan: &ChunkPlan,
        (status, s): (&B::Buffer, &RowScratch<B>),
    ) -> Result<()> {
        let (k, vocab) = (opts.k, self.head.vocab());
        let b = &self.backend;
        for Rows { start, rows } in plan.chunk_rows(ntok, ChunkTransfers::Resident) {
            self.resident_logits(s, hidden, (start, rows), Scaling::top_k(opts), None)?;
            let desc = GatherRowsDesc {
                rows,
                k,
                vocab,
                token0: start,
                ids_offset: elements("ids", start, k)?,
                out_offset: elements("logprobs", start, k)?,
            };
            b.dispatch(Launch::GatherIn {
                ids,
                status,
                ids_chunk: &s.ids,
                desc,
            })?;
            let rows_desc = TopkDesc {
                cap: opts.softcap.map(|c| c / opts.temperature),
                gather: true,
                ..TopkDesc::plain(rows, vocab, self.head.vocab_padded(), k + 1)
            };
            b.topk_rows(&s.logits, &s.ids, &s.probs, &rows_desc)?;
            b.dispatch(Launch::GatherOut {
                values_chunk: &s.probs,
                status,
                logprobs,
                lse,
                desc,
            })?;
        }
        // The status kernel records a flagged id's detail (its other
        // buffers are the ids again: only a teacher's flags read them).
        b.dispatch(Launch::StatusDetail {
            ids,
            probs: ids,
            weights: ids,
            status,
            labels: ids,
            desc: StatusDetailDesc {
                rows: ntok,
                k,
                has_weights: false,
                form: TeacherForm::Probs,
                tail: TailMode::Renormalize,
                has_labels: false,
            },
        })?;
        b.submit()
    }
}
