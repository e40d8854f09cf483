//! Host-side helpers the backends share.

/// Copies `src` into `dst` (equal lengths), on several threads when it is
/// large: one thread's memcpy into or out of a mapping runs at a few GB/s,
/// and the hidden rows and dx of a call are tens of MB.
pub fn parallel_copy(src: &[u8], dst: &mut [u8]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "parallel_copy: source and destination lengths differ"
    );
    const PIECE: usize = 4 << 20;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    if src.len() < 2 * PIECE || threads < 2 {
        dst.copy_from_slice(src);
        return;
    }
    let per_thread = src.len().div_ceil(threads).div_ceil(64) * 64;
    std::thread::scope(|scope| {
        for (s, d) in src.chunks(per_thread).zip(dst.chunks_mut(per_thread)) {
            scope.spawn(move || d.copy_from_slice(s));
        }
    });
}

/// Runs `f(index, chunk)` over `out` in chunks of `chunk` elements on every
/// core; chunk `i` is the same whatever the thread count. Threads take the
/// chunks in turn, and a thread that cannot start leaves its share to the
/// others (this one always works).
pub fn par_chunks<T: Send>(out: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    /// A chunk not yet taken by a thread.
    type Slot<'a, T> = Mutex<Option<(usize, &'a mut [T])>>;
    let slots: Vec<Slot<'_, T>> = out
        .chunks_mut(chunk.max(1))
        .enumerate()
        .map(|c| Mutex::new(Some(c)))
        .collect();
    let next = AtomicUsize::new(0);
    let work = || {
        while let Some(slot) = slots.get(next.fetch_add(1, Ordering::Relaxed)) {
            // A poisoned slot (a panic elsewhere) is left as it is.
            if let Some((i, c)) = slot.lock().map(|mut g| g.take()).unwrap_or(None) {
                f(i, c);
            }
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads.min(slots.len()) {
            // A failed spawn leaves the work to the threads that did start.
            let _ = std::thread::Builder::new().spawn_scoped(scope, work);
        }
        work();
    });
}

/// Idle host staging buffers a backend's downloads reuse, by size.
///
/// A `head_kl` chunk downloads its per-row outputs (bytes), dx (tens of
/// MB) and, with the block filter, its mask (a few MB), and two chunks are
/// in flight. A download takes the smallest idle buffer that holds it, so
/// a small download never takes the buffer dx needs (which the next dx
/// would then allocate, and the pool free, on every chunk: allocating and
/// freeing tens of MB of mapped memory costs milliseconds).
pub struct StagingPool<T> {
    idle: Vec<T>,
    size_of: fn(&T) -> u64,
}

impl<T> StagingPool<T> {
    /// Idle buffers kept: two chunks in flight with three downloads each.
    pub const CAPACITY: usize = 6;

    /// An empty pool of buffers whose byte size `size_of` gives.
    pub fn new(size_of: fn(&T) -> u64) -> Self {
        Self {
            idle: Vec::new(),
            size_of,
        }
    }

    /// The smallest idle buffer of at least `bytes`, if any.
    pub fn take(&mut self, bytes: u64) -> Option<T> {
        let size_of = self.size_of;
        let best = self
            .idle
            .iter()
            .enumerate()
            .filter(|(_, b)| size_of(b) >= bytes)
            .min_by_key(|(_, b)| size_of(b))
            .map(|(i, _)| i)?;
        Some(self.idle.swap_remove(best))
    }

    /// Keeps `buffer` for reuse. Over [`Self::CAPACITY`] the smallest idle
    /// buffer (the cheapest to make again) comes back, for the caller to
    /// free.
    pub fn give(&mut self, buffer: T) -> Option<T> {
        self.idle.push(buffer);
        if self.idle.len() <= Self::CAPACITY {
            return None;
        }
        let size_of = self.size_of;
        let smallest = self
            .idle
            .iter()
            .enumerate()
            .min_by_key(|(_, b)| size_of(b))
            .map(|(i, _)| i)?;
        Some(self.idle.swap_remove(smallest))
    }

    /// Every idle buffer, leaving the pool empty.
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.idle.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::StagingPool;

    #[test]
    fn staging_pool_gives_the_smallest_buffer_that_fits_and_frees_the_smallest() {
        let mut pool = StagingPool::new(|b: &u64| *b);
        assert_eq!(pool.take(1), None);
        for size in [64u64 << 10, 20 << 20, 1 << 20, 20 << 20] {
            assert_eq!(pool.give(size), None);
        }
        // A 16 KB download takes the 64 KiB buffer, a 1 MB one the 1 MiB
        // buffer: both 20 MiB buffers stay for dx.
        assert_eq!(pool.take(16_000), Some(64 << 10));
        assert_eq!(pool.take(1_000_000), Some(1 << 20));
        assert_eq!(pool.take(20 << 20), Some(20 << 20));
        assert_eq!(pool.take(21 << 20), None);
        for size in [1u64, 2, 3, 4, 5] {
            assert_eq!(pool.give(size << 20), None);
        }
        // Seven idle: the smallest goes back to be freed.
        assert_eq!(pool.give(6 << 20), Some(1 << 20));
        assert_eq!(pool.drain().count(), StagingPool::<u64>::CAPACITY);
    }

    #[test]
    fn par_chunks_visits_every_chunk_once_by_index() {
        let mut out = vec![0usize; 10_007];
        super::par_chunks(&mut out, 100, |i, c| c.iter_mut().for_each(|v| *v += i + 1));
        assert!(out.iter().enumerate().all(|(j, &v)| v == j / 100 + 1));
    }

    #[test]
    fn parallel_copy_copies_every_byte() {
        for len in [0, 1, 1000, (8 << 20) + 13, 20 << 20] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            super::parallel_copy(&src, &mut dst);
            assert!(src == dst, "len {len}");
        }
    }
}
