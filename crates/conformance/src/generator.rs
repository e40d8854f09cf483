//! The conformance cases and how they are drawn (DESIGN §6).
//!
//! [`draw_case_params`] draws a few knobs ([`CaseParams`]: shape, flags, a
//! data seed) from one seed with the crate's own small generator, and
//! [`Case::from_params`] expands them deterministically into the head,
//! hidden rows and teacher; the same seed gives the same case. No proptest
//! here (the shipped `headkl check` runs the suite); `headkl-reference`'s
//! property tests wrap [`draw_case_params`] in a proptest strategy. What
//! gets drawn:
//! - V and hs that are not multiples of 16 or 128, and some that are; ntok
//!   not a multiple of the chunk; k from 1 to 2048 (k > 256 only with small
//!   hs and few tokens), always `k ≤ V`;
//! - peaked, flat and random teacher distributions (with exact zeros, and
//!   raw sums other than 1: the teacher renormalizes);
//! - large-magnitude logits (W or x scaled so logits reach about ±60);
//! - ties: duplicated head rows give bitwise-equal logits, at the top of
//!   the ranking and at the k-th boundary;
//! - all top ids in one residue class mod 256: the teacher's ids for
//!   `head_kl`, and for `topk` boosted head rows whose logits lead;
//! - masked tokens (weight 0), τ ≠ 1, f16 hidden rows;
//! - several vocabulary slices (`max_rows_per_slice` 128..=512 with V up to
//!   1500) and several token chunks (`max_rows_per_chunk` 16..=48 with ntok
//!   up to 100).
//!
//! Every case keeps `V·hs·ntok ≤` [`MAX_WORK`], `V ≤ 4096`, `hs ≤ 320` and
//! `k ≤ 2048`, so it fits a device whose largest binding is
//! [`MIN_BINDING_BYTES`].

use std::fmt;

use half::f16;
use headkl_core::{
    Error, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, LossTerms, Reduction, Result, SliceOptions,
    TailMode, Teacher, TeacherForm, TopkOptions, MAX_K,
};

/// Largest `V·hs·ntok` a drawn case has: the f64 reference and lavapipe each
/// run one in well under a second.
pub const MAX_WORK: usize = 20_000_000;

/// Largest vocabulary a drawn case has.
pub const MAX_VOCAB: usize = 4096;

/// Largest hidden size a drawn case has.
pub const MAX_HS: usize = 320;

/// Smallest largest-binding every drawn case fits: 16 token rows of
/// `MAX_VOCAB` f32 logits (and of 2048 ids), and 128 head rows of
/// `MAX_HS` padded f16 values.
pub const MIN_BINDING_BYTES: u64 = 256 << 10;

/// Which job a case exercises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaseKind {
    /// `Engine::head_kl` against [`headkl_reference::direct::head_kl_f64`].
    HeadKl,
    /// `Engine::topk` against [`headkl_reference::direct::topk_f64`].
    Topk,
}

impl fmt::Display for CaseKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CaseKind::HeadKl => "head_kl",
            CaseKind::Topk => "topk",
        })
    }
}

/// The teacher distribution's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TeacherShape {
    /// One dominant entry, the rest tiny or exactly 0.
    Peaked,
    /// All k entries equal.
    Flat,
    /// Random weights with some exact zeros.
    Random,
}

/// The knobs a case is expanded from.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseParams {
    /// Which job.
    pub kind: CaseKind,
    /// Which draw profile produced it (for the name).
    pub profile: &'static str,
    /// Vocabulary size V.
    pub vocab: usize,
    /// Hidden size.
    pub hs: usize,
    /// Tokens.
    pub ntok: usize,
    /// Teacher entries (`head_kl`) or entries to select (`topk`).
    pub k: usize,
    /// Seed of the data (head, rows, teacher, weights).
    pub data_seed: u64,
    /// Teacher distribution (`head_kl`).
    pub teacher: TeacherShape,
    /// Scale W or x so that logits reach about ±60.
    pub large: bool,
    /// Duplicate head rows (exact ties).
    pub ties: bool,
    /// Put the top ids in one residue class mod 256.
    pub residue: bool,
    /// Give some tokens weight 0 and the rest varied weights (`head_kl`).
    pub masked: bool,
    /// Temperature τ.
    pub temperature: f32,
    /// Pass hidden rows as f16.
    pub hidden_as_f16: bool,
    /// Force vocabulary slices of at most this many rows.
    pub max_rows_per_slice: Option<usize>,
    /// Force token chunks of at most this many rows.
    pub max_rows_per_chunk: Option<usize>,
}

/// One conformance case: the inputs of a `head_kl` or `topk` call.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// Short name with the draw's flags, e.g. `head_kl/general[peaked,large]`.
    pub name: String,
    /// Which job.
    pub kind: CaseKind,
    /// Vocabulary size V.
    pub vocab: usize,
    /// Hidden size.
    pub hs: usize,
    /// Tokens.
    pub ntok: usize,
    /// Teacher entries per row (`head_kl`) or entries to select (`topk`).
    pub k: usize,
    /// The head `[V][hs]` (f32, rounded to f16 on upload).
    pub head: Vec<f32>,
    /// Hidden rows `[ntok][hs]`.
    pub hidden: Vec<f32>,
    /// Pass the hidden rows as f16 instead of f32.
    pub hidden_as_f16: bool,
    /// Teacher ids `[ntok][k]` (`head_kl`; empty for `topk`).
    pub teacher_ids: Vec<u32>,
    /// Teacher probabilities `[ntok][k]`, not necessarily normalized
    /// (`head_kl`; empty for `topk`).
    pub teacher_probs: Vec<f32>,
    /// Per-token weights (`head_kl`); `None` means all 1.
    pub weights: Option<Vec<f32>>,
    /// Temperature τ.
    pub temperature: f32,
    /// Force vocabulary slices of at most this many rows.
    pub max_rows_per_slice: Option<usize>,
    /// Force token chunks of at most this many rows.
    pub max_rows_per_chunk: Option<usize>,
    /// How the teacher's probabilities reach [`Teacher::with_form`]
    /// (`head_kl`): as given, or as their logarithms.
    pub teacher_form: TeacherForm,
    /// The teacher's tail mode (`head_kl`).
    pub tail: TailMode,
    /// The loss terms (`head_kl`).
    pub terms: LossTerms,
    /// Labels `[ntok]` of the hard term (`head_kl`; negative: none).
    pub labels: Option<Vec<i64>>,
    /// How the per-token losses reduce (`head_kl`).
    pub reduction: Reduction,
}

impl Case {
    /// One line: name, shape and knobs, for failure and replay messages.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{} V={} hs={} ntok={} k={} tau={}",
            self.name, self.vocab, self.hs, self.ntok, self.k, self.temperature
        );
        s.push_str(if self.hidden_as_f16 { " x=f16" } else { " x=f32" });
        if let Some(w) = &self.weights {
            let masked = w.iter().filter(|&&v| v == 0.0).count();
            s.push_str(&format!(" weights(masked {masked}/{})", w.len()));
        }
        if let Some(r) = self.max_rows_per_slice {
            s.push_str(&format!(" slice<={r}"));
        }
        if let Some(r) = self.max_rows_per_chunk {
            s.push_str(&format!(" chunk<={r}"));
        }
        if self.kind == CaseKind::Topk && self.terms.logit_scale != 1.0 {
            s.push_str(&format!(" logit_scale={}", self.terms.logit_scale));
        }
        if self.reduction != Reduction::Mean {
            s.push_str(&format!(" reduction={}", self.reduction.name()));
        }
        if self.kind == CaseKind::HeadKl
            && (self.terms != LossTerms::default() || self.tail != TailMode::Renormalize || self.labels.is_some())
        {
            s.push_str(&format!(
                " teacher={} tail={} {:?}",
                self.teacher_form.name(),
                self.tail.name(),
                self.terms
            ));
        }
        s
    }

    /// `V·hs·ntok`, the case's cost.
    pub fn work(&self) -> usize {
        self.vocab * self.hs * self.ntok
    }

    /// The head as the engine and the reference take it.
    pub fn head_weights(&self) -> Result<HeadWeights<'_>> {
        HeadWeights::new(HeadData::F32(&self.head), self.vocab, self.hs)
    }

    /// The hidden rows converted to f16 (what [`Case::hidden_rows`] borrows
    /// when `hidden_as_f16`).
    pub fn hidden_f16(&self) -> Vec<f16> {
        if self.hidden_as_f16 {
            self.hidden.iter().map(|&v| f16::from_f32(v)).collect()
        } else {
            Vec::new()
        }
    }

    /// The hidden rows, as f32 or (when `hidden_as_f16`) from `f16_rows`,
    /// the output of [`Case::hidden_f16`].
    pub fn hidden_rows<'a>(&'a self, f16_rows: &'a [f16]) -> Result<Hidden<'a>> {
        if self.hidden_as_f16 {
            Hidden::f16(f16_rows, self.ntok, self.hs)
        } else {
            Hidden::f32(&self.hidden, self.ntok, self.hs)
        }
    }

    /// The validated teacher in the case's form and tail mode (`head_kl`).
    pub fn teacher(&self) -> Result<Teacher> {
        let ids: Vec<i64> = self.teacher_ids.iter().map(|&i| i64::from(i)).collect();
        let values: Vec<f32> = match self.teacher_form {
            TeacherForm::Probs => self.teacher_probs.clone(),
            TeacherForm::Logprobs => self.teacher_probs.iter().map(|&p| p.ln()).collect(),
        };
        let (ntok, k, vocab) = (self.ntok, self.k, self.vocab);
        Teacher::with_form(&ids, &values, ntok, k, vocab, self.teacher_form, self.tail)
    }

    /// Slicing options.
    pub fn slice_options(&self) -> SliceOptions {
        SliceOptions {
            max_rows_per_slice: self.max_rows_per_slice,
        }
    }

    /// `head_kl` options.
    pub fn loss_options(&self) -> LossOptions {
        LossOptions {
            config: LossConfig {
                temperature: self.temperature,
                max_rows_per_chunk: self.max_rows_per_chunk,
                terms: self.terms,
                reduction: self.reduction,
                ..LossConfig::default()
            },
            weights: self.weights.clone(),
            labels: self.labels.clone(),
            ..LossOptions::default()
        }
    }

    /// `topk` options.
    pub fn topk_options(&self) -> TopkOptions {
        TopkOptions {
            temperature: self.temperature,
            max_rows_per_chunk: self.max_rows_per_chunk,
            logit_scale: self.terms.logit_scale,
            ..TopkOptions::new(self.k)
        }
    }

    /// The temperature the f64 reference's top-k takes for this case: with
    /// no softcap, softmax(S·z/τ) is softmax(z/(τ/S)).
    pub fn topk_temperature(&self) -> f32 {
        self.temperature / self.terms.logit_scale
    }

    /// Checks the case's own consistency (lengths, `k ≤ min(V, 2048)`).
    pub fn validate(&self) -> Result<()> {
        self.head_weights()?;
        self.hidden_rows(&self.hidden_f16())?;
        if self.kind == CaseKind::HeadKl {
            self.teacher()?;
            self.loss_options().resolve(self.ntok)?;
        } else {
            self.topk_options().check(self.vocab)?;
        }
        if self.k > MAX_K {
            return Err(Error::KTooLarge {
                k: self.k,
                vocab: self.vocab,
                max: MAX_K.min(self.vocab),
            });
        }
        Ok(())
    }

    /// Expands drawn knobs into a case (deterministic in `p`).
    pub fn from_params(p: &CaseParams) -> Case {
        build(p)
    }
}

/// SplitMix64: small, fast, and reproducible everywhere.
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub(crate) fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Standard normal (Box–Muller).
    pub(crate) fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// `count` distinct values of `0..n`, in random order (`count ≤ n`).
    pub(crate) fn distinct(&mut self, n: usize, count: usize) -> Vec<usize> {
        if count * 4 >= n {
            let mut all: Vec<usize> = (0..n).collect();
            for i in 0..count {
                let j = i + self.below(n - i);
                all.swap(i, j);
            }
            all.truncate(count);
            all
        } else {
            let mut seen = std::collections::HashSet::with_capacity(count);
            let mut out = Vec::with_capacity(count);
            while out.len() < count {
                let v = self.below(n);
                if seen.insert(v) {
                    out.push(v);
                }
            }
            out
        }
    }
}

fn build(p: &CaseParams) -> Case {
    let (vocab, hs, ntok, k) = (p.vocab, p.hs, p.ntok, p.k);
    let mut rng = Rng::new(p.data_seed);
    let boost = p.kind == CaseKind::Topk && (p.ties || p.residue);
    // Logits s = x·Wᵀ/τ have standard deviation `spread` (after τ), so
    // "large" means about ±60 whatever τ: an f32 device's accumulation error
    // grows with the logits' magnitude, and DESIGN §5's 1e-4 on
    // probabilities is an absolute bound of about 1e-4 on logit differences.
    // Before τ that is S = spread·τ = a·b with x ~ a·N(0,1), W ~ (b/√hs)·N(0,1).
    let spread = match (p.large, boost) {
        (false, _) => 0.5 + 3.5 * rng.uniform(),
        (true, false) => 8.0 + 6.0 * rng.uniform(),
        // boosted rows lead at up to 5.5 spreads
        (true, true) => 8.0 + 3.0 * rng.uniform(),
    };
    let scale = spread * f64::from(p.temperature);
    let (a, b) = if p.large && rng.below(2) == 0 {
        (scale, 1.0)
    } else {
        (1.0, scale)
    };
    let w_sd = b / (hs as f64).sqrt();
    let mut head: Vec<f32> = (0..vocab * hs).map(|_| (w_sd * rng.normal()) as f32).collect();
    let mut hidden: Vec<f32> = (0..ntok * hs).map(|_| (a * rng.normal()) as f32).collect();

    // topk with ties or residue: boosted rows lead every token's ranking.
    // The last column of x is the constant `a`; a boosted row is `level·b`
    // there and small elsewhere, so its logit is about `level·S`, above the
    // ~4·S of the rest. (Last, so an in-order f32 sum meets the large term
    // at its end and rounds at its magnitude once, not hs times.)
    if boost {
        let last = hs - 1;
        for t in 0..ntok {
            hidden[t * hs + last] = a as f32;
        }
        let ids = if p.residue {
            residue_ids(&mut rng, vocab, (k + 2).min(vocab))
        } else {
            rng.distinct(vocab, (k + 2).min(vocab))
        };
        let n = ids.len();
        for (rank, &j) in ids.iter().enumerate() {
            let level = 4.5 + (n - rank) as f64 / n as f64;
            let row = &mut head[j * hs..(j + 1) * hs];
            for v in &mut row[..last] {
                *v *= 0.05;
            }
            row[last] = (level * b) as f32;
        }
        if p.ties {
            // Exact ties among the leaders, one of them across the k-th boundary.
            let mut pairs: Vec<(usize, usize)> = Vec::new();
            if n > k && k >= 1 {
                pairs.push((ids[k - 1], ids[k]));
            }
            for _ in 0..(n / 4).min(16) {
                let (i, j) = (rng.below(n), rng.below(n));
                if i != j {
                    pairs.push((ids[i], ids[j]));
                }
            }
            for (src, dst) in pairs {
                copy_row(&mut head, hs, src, dst);
            }
        }
    } else if p.ties {
        // Duplicated rows anywhere: exact ties in every token's logits.
        for _ in 0..(vocab / 8).clamp(1, 64) {
            let (src, dst) = (rng.below(vocab), rng.below(vocab));
            copy_row(&mut head, hs, src, dst);
        }
    }

    let (mut teacher_ids, mut teacher_probs, mut weights) = (Vec::new(), Vec::new(), None);
    if p.kind == CaseKind::HeadKl {
        teacher_ids.reserve(ntok * k);
        teacher_probs.reserve(ntok * k);
        for _ in 0..ntok {
            let ids = if p.residue {
                residue_ids(&mut rng, vocab, k)
            } else {
                rng.distinct(vocab, k)
            };
            teacher_ids.extend(ids.iter().map(|&i| i as u32));
            teacher_probs.extend(teacher_row(&mut rng, p.teacher, k));
        }
        if p.masked {
            let mut w: Vec<f32> = (0..ntok)
                .map(|_| {
                    if rng.below(10) < 3 {
                        0.0
                    } else {
                        (0.5 + 1.5 * rng.uniform()) as f32
                    }
                })
                .collect();
            if w.iter().all(|&v| v == 0.0) {
                let t = rng.below(ntok);
                w[t] = 1.0;
            }
            weights = Some(w);
        }
    }

    let mut flags = vec![p.profile.to_string()];
    if p.kind == CaseKind::HeadKl {
        flags.push(
            match p.teacher {
                TeacherShape::Peaked => "peaked",
                TeacherShape::Flat => "flat",
                TeacherShape::Random => "random",
            }
            .into(),
        );
    }
    for (on, name) in [
        (p.large, "large"),
        (p.ties, "ties"),
        (p.residue, "residue256"),
        (p.masked && p.kind == CaseKind::HeadKl, "masked"),
    ] {
        if on {
            flags.push(name.into());
        }
    }
    flags.push(format!("seed={:#x}", p.data_seed));
    Case {
        name: format!("{}[{}]", p.kind, flags.join(",")),
        kind: p.kind,
        vocab,
        hs,
        ntok,
        k,
        head,
        hidden,
        hidden_as_f16: p.hidden_as_f16,
        teacher_ids,
        teacher_probs,
        weights,
        temperature: p.temperature,
        max_rows_per_slice: p.max_rows_per_slice,
        max_rows_per_chunk: p.max_rows_per_chunk,
        teacher_form: TeacherForm::Probs,
        tail: TailMode::Renormalize,
        terms: LossTerms::default(),
        labels: None,
        reduction: Reduction::Mean,
    }
}

fn copy_row(head: &mut [f32], hs: usize, src: usize, dst: usize) {
    if src != dst {
        head.copy_within(src * hs..(src + 1) * hs, dst * hs);
    }
}

/// `count` distinct ids `≡ r (mod 256)` below `vocab`, in random order,
/// for the largest class that has room (`r` drawn among the classes with
/// at least `count` members).
pub(crate) fn residue_ids(rng: &mut Rng, vocab: usize, count: usize) -> Vec<usize> {
    // Class r has ⌈(vocab − r)/256⌉ members; classes r < vocab mod 256 (or all,
    // when 256 divides vocab) have the most.
    let members = vocab.div_ceil(256);
    let full = match vocab % 256 {
        0 => 256.min(vocab),
        m => m,
    };
    if count > members {
        // Not enough room in any class: fall back to distinct ids.
        return rng.distinct(vocab, count);
    }
    let r = rng.below(full);
    let class_size = (vocab - r).div_ceil(256);
    rng.distinct(class_size, count)
        .into_iter()
        .map(|m| r + 256 * m)
        .collect()
}

fn teacher_row(rng: &mut Rng, shape: TeacherShape, k: usize) -> Vec<f32> {
    let mut row: Vec<f32> = match shape {
        TeacherShape::Flat => vec![1.0; k],
        TeacherShape::Peaked => {
            let top = rng.below(k);
            (0..k)
                .map(|q| {
                    if q == top {
                        0.9
                    } else if rng.below(4) == 0 {
                        0.0
                    } else {
                        (1e-3 * rng.uniform()) as f32
                    }
                })
                .collect()
        }
        TeacherShape::Random => (0..k)
            .map(|_| {
                if rng.below(10) == 0 {
                    0.0
                } else {
                    rng.uniform().powi(3) as f32
                }
            })
            .collect(),
    };
    if row.iter().all(|&v| v == 0.0) {
        row[0] = 0.5;
    }
    row
}

/// Shape and slicing/chunking knobs of one profile.
#[derive(Clone, Debug)]
struct Dims {
    profile: &'static str,
    vocab: usize,
    hs: usize,
    ntok: usize,
    k: usize,
    residue: bool,
    max_rows_per_slice: Option<usize>,
    max_rows_per_chunk: Option<usize>,
}

/// The suite's own seeded draws: a few helpers over [`Rng`], so the
/// conformance suite (and `headkl check`, which ships it) needs no proptest.
impl Rng {
    /// Uniform in `lo..=hi` (`lo ≤ hi`).
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// An index into `weights`, each drawn in proportion to its weight.
    fn weighted(&mut self, weights: &[usize]) -> usize {
        let mut x = self.below(weights.iter().sum());
        for (i, &w) in weights.iter().enumerate() {
            if x < w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }

    /// True with probability `p`.
    fn chance(&mut self, p: f64) -> bool {
        self.uniform() < p
    }

    /// The `(u8, u64)` pair [`k_of`] takes.
    fn knob(&mut self) -> (u8, u64) {
        (self.next_u64() as u8, self.next_u64())
    }
}

/// V: any, or a multiple of 16, or of 128.
fn vocab_in(rng: &mut Rng, max: usize) -> usize {
    match rng.weighted(&[3, 1, 1]) {
        0 => rng.range(1, max),
        1 => 16 * rng.range(1, max / 16),
        _ => 128 * rng.range(1, (max / 128).max(1)),
    }
}

/// hs: any, or a multiple of 16, or of 128.
fn hs_in(rng: &mut Rng, max: usize) -> usize {
    match rng.weighted(&[3, 1, 1]) {
        0 => rng.range(1, max),
        1 => 16 * rng.range(1, (max / 16).max(1)),
        _ => 128 * rng.range(1, (max / 128).max(1)),
    }
}

/// k in `1..=cap`: 1, the cap (k = V when V is small), or any between.
fn k_of(cap: usize, draw: (u8, u64)) -> usize {
    match draw.0 % 8 {
        0 => 1,
        1 => cap,
        _ => 1 + (draw.1 % cap as u64) as usize,
    }
}

/// Caps ntok so that `V·hs·ntok ≤ MAX_WORK`.
fn cap_tokens(vocab: usize, hs: usize, ntok: usize) -> usize {
    ntok.min((MAX_WORK / (vocab * hs)).max(1))
}

/// The shape of a case: one of five profiles, weighted 5 (general), 1
/// (big k), 2 (residue), 2 (several slices), 2 (several chunks).
fn dims(rng: &mut Rng) -> Dims {
    match rng.weighted(&[5, 1, 2, 2, 2]) {
        0 => {
            let (vocab, hs, ntok) = (vocab_in(rng, 1500), hs_in(rng, MAX_HS), rng.range(1, 100));
            let kd = rng.knob();
            let which = rng.below(8);
            let (slice, chunk) = (rng.range(128, 512), rng.range(16, 48));
            Dims {
                profile: "general",
                vocab,
                hs,
                ntok: cap_tokens(vocab, hs, ntok),
                k: k_of(vocab.min(64), kd),
                residue: false,
                max_rows_per_slice: (which == 0).then_some(slice),
                max_rows_per_chunk: (which == 1).then_some(chunk),
            }
        }
        1 => {
            let (k, vd, hs, ntok) = (rng.range(257, MAX_K), rng.next_u64(), rng.range(1, 32), rng.range(1, 4));
            let vocab = k + (vd % (MAX_VOCAB - k + 1) as u64) as usize;
            Dims {
                profile: "big_k",
                vocab,
                hs,
                ntok: cap_tokens(vocab, hs, ntok),
                k,
                residue: false,
                max_rows_per_slice: None,
                max_rows_per_chunk: None,
            }
        }
        2 => {
            let (k, vd, hs, ntok) = (rng.range(1, 14), rng.next_u64(), rng.range(1, 64), rng.range(1, 32));
            // room for k ids in one class mod 256, plus the two boosted extras of topk
            let min_vocab = 256 * (k + 1) + 1;
            let vocab = min_vocab + (vd % (MAX_VOCAB - min_vocab + 1) as u64) as usize;
            Dims {
                profile: "residue",
                vocab,
                hs,
                ntok: cap_tokens(vocab, hs, ntok),
                k,
                residue: true,
                max_rows_per_slice: None,
                max_rows_per_chunk: None,
            }
        }
        3 => {
            let (vocab, hs, ntok) = (rng.range(600, 1500), hs_in(rng, 200), rng.range(1, 40));
            let kd = rng.knob();
            let (slice, chunked) = (rng.range(128, 512), rng.chance(0.5));
            Dims {
                profile: "slices",
                vocab,
                hs,
                ntok: cap_tokens(vocab, hs, ntok),
                k: k_of(vocab.min(64), kd),
                residue: false,
                max_rows_per_slice: Some(slice),
                max_rows_per_chunk: chunked.then_some(16),
            }
        }
        _ => {
            let (vocab, hs, ntok) = (vocab_in(rng, 600), hs_in(rng, 128), rng.range(40, 100));
            let kd = rng.knob();
            let (chunk, sliced) = (rng.range(16, 48), rng.chance(0.5));
            Dims {
                profile: "chunks",
                vocab,
                hs,
                ntok: cap_tokens(vocab, hs, ntok),
                k: k_of(vocab.min(32), kd),
                residue: false,
                max_rows_per_slice: sliced.then_some(128),
                max_rows_per_chunk: Some(chunk),
            }
        }
    }
}

/// τ: 1 (weight 3), one of a few values (2), or any in `[0.25, 4)` (1).
fn temperature(rng: &mut Rng) -> f32 {
    match rng.weighted(&[3, 2, 1]) {
        0 => 1.0,
        1 => [0.5f32, 0.7, 1.3, 2.0, 3.5][rng.below(5)],
        _ => (0.25 + 3.75 * rng.uniform()) as f32,
    }
}

/// The knobs of a case of `kind`, drawn from `seed`: the same seed gives
/// the same knobs everywhere (the suite's replays rest on it).
pub fn draw_case_params(kind: CaseKind, seed: u64) -> CaseParams {
    let rng = &mut Rng::new(seed);
    let d = dims(rng);
    let teacher = [TeacherShape::Peaked, TeacherShape::Flat, TeacherShape::Random][rng.below(3)];
    CaseParams {
        kind,
        profile: d.profile,
        vocab: d.vocab,
        hs: d.hs,
        ntok: d.ntok,
        k: d.k,
        data_seed: rng.next_u64(),
        teacher,
        large: rng.chance(0.25),
        ties: rng.chance(0.3),
        residue: d.residue,
        masked: rng.chance(0.4),
        temperature: temperature(rng),
        hidden_as_f16: rng.chance(0.5),
        max_rows_per_slice: d.max_rows_per_slice,
        max_rows_per_chunk: d.max_rows_per_chunk,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawn_cases_are_valid_and_bounded() {
        let mut seen_big_k = false;
        let mut seen_residue = false;
        let mut profiles = std::collections::BTreeSet::new();
        for i in 0..400u64 {
            let kind = if i % 2 == 0 { CaseKind::HeadKl } else { CaseKind::Topk };
            let p = draw_case_params(kind, 3 + i.wrapping_mul(0x9E37_79B9));
            profiles.insert(p.profile);
            let c = Case::from_params(&p);
            c.validate().unwrap_or_else(|e| panic!("{}: {e}", c.describe()));
            assert!(c.work() <= MAX_WORK, "{}", c.describe());
            assert!(
                c.vocab <= MAX_VOCAB && c.hs <= MAX_HS && c.k <= c.vocab.min(MAX_K),
                "{}",
                c.describe()
            );
            if c.k > 256 {
                seen_big_k = true;
                assert!(c.hs <= 32 && c.ntok <= 4, "{}", c.describe());
            }
            if p.residue && kind == CaseKind::HeadKl {
                seen_residue = true;
                for row in c.teacher_ids.chunks_exact(c.k) {
                    assert!(row.iter().all(|&id| id % 256 == row[0] % 256), "{}", c.describe());
                }
            }
        }
        assert!(seen_big_k && seen_residue);
        assert_eq!(profiles.len(), 5, "{profiles:?}");
    }

    #[test]
    fn the_same_seed_draws_the_same_case() {
        let p = draw_case_params(CaseKind::Topk, 9);
        assert_eq!(p, draw_case_params(CaseKind::Topk, 9));
        assert_eq!(Case::from_params(&p), Case::from_params(&p));
        assert_ne!(p, draw_case_params(CaseKind::Topk, 10));
    }

    #[test]
    fn residue_ids_share_a_class() {
        let mut rng = Rng::new(5);
        for vocab in [257usize, 512, 1000, 4096, 3841] {
            let members = vocab.div_ceil(256);
            let ids = residue_ids(&mut rng, vocab, members);
            assert_eq!(ids.len(), members);
            assert!(
                ids.iter().all(|&i| i < vocab && i % 256 == ids[0] % 256),
                "{vocab}: {ids:?}"
            );
        }
    }
}
