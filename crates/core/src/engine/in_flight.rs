//! The host path's chunks in flight, for the [`crate::engine::Engine`] and the
//! shard engine alike: chunk i's outputs start their copy out before chunk
//! i−1's are waited for and read, so the device always has queued work
//! while the host reads. Downloads go through
//! [`Backend::download_begin`]/[`Backend::download_end`], the path every
//! backend keeps safe for engines on several threads.
//!
//! Every download begun is ended exactly once: what a reader does not take
//! (it returned an error, or the call ended early) is drained when its
//! [`Copying`] drops, so no copy outlives the call and its staging is free
//! when the call returns.

use crate::error::{Error, Field, Result};
use crate::toolkit::backend::{Backend, PendingDownload};

/// One output to copy out: a buffer, a byte offset in it and a length.
pub(crate) type Output<'b, B> = (&'b <B as Backend>::Buffer, u64, usize);

/// One chunk's outputs being copied out: its token range and its
/// downloads, read in the order they were listed.
pub(crate) struct Copying<'a, B: Backend> {
    backend: &'a B,
    /// The chunk's first token.
    pub(crate) start: usize,
    /// Its rows.
    pub(crate) rows: usize,
    /// The downloads in the order listed; `None` once read.
    pending: Vec<Option<PendingDownload>>,
    /// The next one to read.
    next: usize,
}

impl<'a, B: Backend> Copying<'a, B> {
    /// Starts copying out chunk `[start, start + rows)`'s `outputs`, the
    /// smallest first. A backend may submit the chunk's work when a large
    /// download begins (the Vulkan backend's copy lane); a small copy
    /// recorded after that would go out with the next chunk's work, and
    /// reading it would wait for that chunk too, emptying the device's
    /// queue. If one cannot start, those begun are drained.
    pub(crate) fn begin(backend: &'a B, (start, rows): (usize, usize), outputs: &[Output<'_, B>]) -> Result<Self> {
        let mut copying = Self {
            backend,
            start,
            rows,
            pending: Vec::with_capacity(outputs.len()),
            next: 0,
        };
        copying.begin_more(outputs)?;
        Ok(copying)
    }

    /// Starts copying out more of the chunk's outputs (after a kernel that
    /// overwrites a buffer already being copied: the copies run in stream
    /// order), the smallest first; they are read after those begun before.
    pub(crate) fn begin_more(&mut self, outputs: &[Output<'_, B>]) -> Result<()> {
        let first = self.pending.len();
        self.pending.extend(outputs.iter().map(|_| None));
        let mut order: Vec<usize> = (0..outputs.len()).collect();
        order.sort_by_key(|&i| outputs[i].2);
        for i in order {
            let (buffer, offset, len) = outputs[i];
            // On an error, those begun are drained when `self` drops.
            self.pending[first + i] = Some(self.backend.download_begin(buffer, offset, len)?);
        }
        Ok(())
    }

    /// The byte length of the next download to read, if any is left.
    pub(crate) fn next_len(&self) -> Option<usize> {
        self.pending
            .get(self.next)
            .and_then(|p| p.as_ref())
            .map(PendingDownload::len)
    }

    /// Waits for the next download and copies it into `out` (its length
    /// exactly).
    pub(crate) fn read_next(&mut self, out: &mut [u8]) -> Result<()> {
        let pending = self.pending.get_mut(self.next).and_then(Option::take);
        self.next += 1;
        let Some(pending) = pending else {
            return Err(Error::LengthMismatch {
                field: Field::DownloadOutput,
                expected: out.len(),
                got: 0,
            });
        };
        self.backend.download_end(pending, out)
    }
}

impl<B: Backend> Drop for Copying<'_, B> {
    fn drop(&mut self) {
        for pending in self.pending.drain(..).flatten() {
            let mut sink = vec![0u8; pending.len()];
            // An error is on its way out already, or the bytes are not
            // wanted; this one adds nothing.
            let _ = self.backend.download_end(pending, &mut sink);
        }
    }
}

/// The chunks in flight: at most one waits to be read while the next is
/// recorded. Dropping it (an error path) drains the one waiting.
pub(crate) struct InFlight<'a, B: Backend> {
    waiting: Option<Copying<'a, B>>,
}

impl<'a, B: Backend> InFlight<'a, B> {
    pub(crate) fn new() -> Self {
        Self { waiting: None }
    }

    /// Adds the chunk just recorded; hands back the one before it, now due
    /// to be read.
    pub(crate) fn push(&mut self, chunk: Copying<'a, B>) -> Option<Copying<'a, B>> {
        self.waiting.replace(chunk)
    }

    /// The last chunk, after the loop.
    pub(crate) fn pop(&mut self) -> Option<Copying<'a, B>> {
        self.waiting.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::toolkit::backend::{DeviceBuffer, DeviceInfo, MemoryStats};
    use crate::toolkit::launch::Launch;
    use std::cell::RefCell;

    struct Buf(u64);

    impl DeviceBuffer for Buf {
        fn len(&self) -> u64 {
            self.0
        }
    }

    /// A backend that only copies out: each download's bytes are its
    /// length, repeated; it records the lengths begun, in order, and how
    /// many ended. The `fail_at`-th begin fails.
    struct Copier {
        info: DeviceInfo,
        begun: RefCell<Vec<usize>>,
        ended: RefCell<usize>,
        fail_at: Option<usize>,
    }

    impl Copier {
        fn new(fail_at: Option<usize>) -> Self {
            Self {
                info: DeviceInfo {
                    backend: "copier",
                    device_name: String::new(),
                    driver: String::new(),
                    device_type: "cpu".into(),
                    matrix_units: false,
                    gemm: None,
                    queue: None,
                    matrix_shapes: Vec::new(),
                    shader_f16: false,
                    subgroup_size: None,
                    max_binding_bytes: 1 << 20,
                    max_buffer_bytes: 1 << 20,
                    memory_bytes: None,
                    unusable: None,
                },
                begun: RefCell::new(Vec::new()),
                ended: RefCell::new(0),
                fail_at,
            }
        }
    }

    impl Backend for Copier {
        type Buffer = Buf;
        fn info(&self) -> &DeviceInfo {
            &self.info
        }
        fn alloc(&self, bytes: u64, _: &'static str) -> Result<Buf> {
            Ok(Buf(bytes))
        }
        fn upload(&self, _: &Buf, _: u64, _: &[u8]) -> Result<()> {
            Ok(())
        }
        fn download(&self, _: &Buf, _: u64, out: &mut [u8]) -> Result<()> {
            out.fill(out.len() as u8);
            Ok(())
        }
        fn download_begin(&self, src: &Buf, offset: u64, len: usize) -> Result<PendingDownload> {
            if self.fail_at == Some(self.begun.borrow().len()) {
                return Err(Error::DeviceLost("planted".into()));
            }
            self.begun.borrow_mut().push(len);
            let mut bytes = vec![0u8; len];
            self.download(src, offset, &mut bytes)?;
            Ok(PendingDownload::ready(bytes))
        }
        fn download_end(&self, pending: PendingDownload, out: &mut [u8]) -> Result<()> {
            *self.ended.borrow_mut() += 1;
            match pending.into_parts() {
                (_, Some(bytes)) if bytes.len() == out.len() => {
                    out.copy_from_slice(&bytes);
                    Ok(())
                }
                _ => Err(Error::LengthMismatch {
                    field: Field::DownloadOutput,
                    expected: out.len(),
                    got: 0,
                }),
            }
        }
        fn dispatch(&self, _: Launch<'_, Buf>) -> Result<()> {
            Err(Error::DeviceLost("the copier runs no kernels".into()))
        }
        fn finish(&self) -> Result<()> {
            Ok(())
        }
        fn memory(&self) -> MemoryStats {
            MemoryStats::default()
        }
        fn reset_peak_memory(&self) {}
    }

    #[test]
    fn downloads_begin_smallest_first_and_read_in_the_order_listed() {
        let b = Copier::new(None);
        let buf = Buf(64);
        let mut c = Copying::begin(&b, (8, 3), &[(&buf, 0, 12), (&buf, 0, 3), (&buf, 0, 7)]).unwrap();
        c.begin_more(&[(&buf, 0, 5), (&buf, 0, 2)]).unwrap();
        assert_eq!(*b.begun.borrow(), [3, 7, 12, 2, 5]);
        assert_eq!((c.start, c.rows), (8, 3));
        for len in [12usize, 3, 7, 5, 2] {
            assert_eq!(c.next_len(), Some(len));
            let mut out = vec![0u8; len];
            c.read_next(&mut out).unwrap();
            assert!(out.iter().all(|&v| usize::from(v) == len), "{out:?}");
        }
        assert_eq!(c.next_len(), None);
        assert!(matches!(c.read_next(&mut [0u8; 4]), Err(Error::LengthMismatch { .. })));
        drop(c);
        assert_eq!(*b.ended.borrow(), 5);
    }

    #[test]
    fn what_is_not_read_is_drained_and_a_failed_begin_drains_those_begun() {
        let b = Copier::new(None);
        let buf = Buf(64);
        let mut pipe = InFlight::new();
        let first = Copying::begin(&b, (0, 2), &[(&buf, 0, 4), (&buf, 0, 8)]).unwrap();
        assert!(pipe.push(first).is_none());
        let second = Copying::begin(&b, (2, 2), &[(&buf, 0, 4)]).unwrap();
        let mut due = pipe.push(second).expect("the first chunk is due");
        assert_eq!(due.start, 0);
        due.read_next(&mut [0u8; 4]).unwrap();
        // An error while reading: the rest of the chunk and the chunk
        // waiting behind it are drained when they drop.
        drop(due);
        drop(pipe);
        assert_eq!((b.begun.borrow().len(), *b.ended.borrow()), (3, 3));

        // The third begin fails: the two begun are drained.
        let b = Copier::new(Some(2));
        let failed = Copying::begin(&b, (0, 1), &[(&buf, 0, 1), (&buf, 0, 2), (&buf, 0, 3)]);
        assert!(matches!(failed, Err(Error::DeviceLost(_))));
        assert_eq!((b.begun.borrow().len(), *b.ended.borrow()), (2, 2));
    }
}
