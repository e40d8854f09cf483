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

#[cfg(test)]
mod tests {
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
