//! Fast seeded random data for benchmarks and the `lm` data
//! ([`crate::lm`]): xorshift64* streams, one per fixed-size block, filled
//! on every core. The result depends only on the seed, not on the number of
//! threads.

/// Elements per independently seeded block.
const BLOCK: usize = 1 << 16;

/// A xorshift64* generator.
#[derive(Clone, Debug)]
pub struct XorShift64(u64);

impl XorShift64 {
    /// A generator for `seed` (mixed with splitmix64, so nearby seeds give
    /// unrelated streams and 0 is fine).
    pub fn new(seed: u64) -> Self {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Self(if z == 0 { 0x2545_F491_4F6C_DD1D } else { z })
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in `(0, 1)`: never 0, so its logarithm is finite.
    pub fn unit_open(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 0.5) * (1.0 / (1u64 << 24) as f32)
    }

    /// Standard normal (Box–Muller on two [`Self::unit_open`] draws).
    pub fn normal(&mut self) -> f32 {
        let (u, v) = (self.unit_open(), self.unit_open());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }

    /// Uniform in `[-a, a)`.
    pub fn symmetric(&mut self, a: f32) -> f32 {
        (self.unit() * 2.0 - 1.0) * a
    }

    /// Uniform in `[0, n)` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// Fills `out` with `gen` on every core; block `b` draws from
/// `XorShift64::new(seed ^ b·φ)`.
pub fn fill_parallel<T: Send>(out: &mut [T], seed: u64, gen: impl Fn(&mut XorShift64) -> T + Sync) {
    headkl_core::toolkit::host::par_chunks(out, BLOCK, |b, block| {
        let mut rng = XorShift64::new(seed ^ (b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for v in block.iter_mut() {
            *v = gen(&mut rng);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_roughly_uniform() {
        let mut a = vec![0f32; 3 * BLOCK + 17];
        let mut b = vec![0f32; 3 * BLOCK + 17];
        fill_parallel(&mut a, 7, |r| r.symmetric(1.0));
        fill_parallel(&mut b, 7, |r| r.symmetric(1.0));
        assert_eq!(a, b);
        let mean = a.iter().map(|&v| f64::from(v)).sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        // Distinct blocks draw distinct streams.
        assert_ne!(a[..16], a[BLOCK..BLOCK + 16]);
        let mut r = XorShift64::new(0);
        assert!((0..1000).all(|_| r.below(10) < 10));
    }
}
