//! The problem a call poses, validated: hidden rows, the teacher's top-k
//! and the options of each job (here), the loss terms ([`terms`]), the
//! vocabulary filter ([`filter`]), the vocabulary's slices and order
//! ([`slicing`], [`vocab_order`]), the float views inputs arrive in
//! ([`floats`]) and a problem's extents ([`shape`]). Everything is
//! checked here, once, before any device sees it. This is the floor the toolkit and the engine stand on: it imports
//! only the error type.

pub mod filter;
pub mod floats;
pub mod grad_type;
pub mod shape;
pub mod slicing;
pub mod terms;
pub mod vocab_order;

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::problem::terms::{labels_to_u32, LossTerms, TailMode, TeacherForm, MASS_TOLERANCE, NO_LABEL};

/// Largest k the top-k kernels support.
pub const MAX_K: usize = 2048;

/// Default device-memory budget for scratch buffers: 2 GiB.
pub const DEFAULT_BUDGET_BYTES: u64 = 2 << 30;

/// The element type and data of hidden rows: a bf16 value past f16's
/// range becomes ±inf on the way up, which the row kernels flag.
pub type HiddenData<'a> = crate::problem::floats::FloatSlice<'a>;

/// Hidden rows `x` `[ntok][hs]`, already normed. Their values are not
/// scanned on the host: the row kernels flag a row whose logits are not
/// finite.
#[derive(Clone, Copy, Debug)]
pub struct Hidden<'a> {
    data: HiddenData<'a>,
    ntok: usize,
    hs: usize,
}

impl<'a> Hidden<'a> {
    /// Checks `data.len() == ntok · hs`, `ntok > 0` and `hs > 0`.
    pub fn new(data: HiddenData<'a>, ntok: usize, hs: usize) -> Result<Self> {
        data.check_shape(ntok, hs, Error::NoTokens, crate::error::Field::Hidden)?;
        Ok(Self { data, ntok, hs })
    }

    /// f32 rows.
    pub fn f32(data: &'a [f32], ntok: usize, hs: usize) -> Result<Self> {
        Self::new(HiddenData::F32(data), ntok, hs)
    }

    /// f16 rows.
    pub fn f16(data: &'a [f16], ntok: usize, hs: usize) -> Result<Self> {
        Self::new(HiddenData::F16(data), ntok, hs)
    }

    /// bf16 rows.
    pub fn bf16(data: &'a [bf16], ntok: usize, hs: usize) -> Result<Self> {
        Self::new(HiddenData::Bf16(data), ntok, hs)
    }

    /// The rows.
    pub fn data(&self) -> HiddenData<'a> {
        self.data
    }

    /// Number of tokens.
    pub fn ntok(&self) -> usize {
        self.ntok
    }

    /// Hidden size.
    pub fn hs(&self) -> usize {
        self.hs
    }

    /// Row `t` as f32 (rounded to f16 first when the data is f32, so the
    /// values are what the device multiplies).
    pub fn row_f16_rounded(&self, t: usize) -> Vec<f32> {
        self.data.f16_rounded(t * self.hs..(t + 1) * self.hs)
    }
}

/// The teacher's top-k `[ntok][k]`: distinct ids per row, each `< V`, and
/// probabilities: renormalized over the k in [`TailMode::Renormalize`]
/// (the default), as given (a share of the full vocabulary, mass at most
/// 1) in the other tail modes.
#[derive(Clone, Debug, PartialEq)]
pub struct Teacher {
    ids: Vec<u32>,
    probs: Vec<f32>,
    ntok: usize,
    k: usize,
    tail: TailMode,
}

impl Teacher {
    /// Validates and renormalizes: ids distinct per row and `< vocab`,
    /// probabilities non-negative and finite, each row with positive mass.
    pub fn new(ids: &[u32], probs: &[f32], ntok: usize, k: usize, vocab: usize) -> Result<Self> {
        let ids: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
        Self::with_form(&ids, probs, ntok, k, vocab, TeacherForm::Probs, TailMode::Renormalize)
    }

    /// As [`Teacher::new`], from i64 ids (a negative id is out of range).
    pub fn from_i64(ids: &[i64], probs: &[f32], ntok: usize, k: usize, vocab: usize) -> Result<Self> {
        Self::with_form(ids, probs, ntok, k, vocab, TeacherForm::Probs, TailMode::Renormalize)
    }

    /// The teacher from `values` in `form` (probabilities, or
    /// log-probabilities over the full vocabulary: each `≤ 0`, not NaN,
    /// `-inf` meaning probability 0), read in tail mode `tail`: renormalized
    /// over the k, or kept as given with the row's mass checked to be at
    /// most 1 (beyond [`MASS_TOLERANCE`]).
    pub fn with_form(
        ids: &[i64],
        values: &[f32],
        ntok: usize,
        k: usize,
        vocab: usize,
        form: TeacherForm,
        tail: TailMode,
    ) -> Result<Self> {
        let ids_len = ids.len();
        let field = match form {
            TeacherForm::Probs => crate::error::Field::Probs,
            TeacherForm::Logprobs => crate::error::Field::Logprobs,
        };
        if ntok == 0 {
            return Err(Error::NoTokens);
        }
        check_k(k, vocab)?;
        let expected = ntok * k;
        crate::error::Field::Ids.check_len(expected, ids_len)?;
        field.check_len(expected, values.len())?;
        let mut out_ids = Vec::with_capacity(expected);
        for (i, &id) in ids.iter().enumerate() {
            if id < 0 || id as u64 >= vocab as u64 {
                return Err(Error::IdOutOfRange {
                    row: i / k,
                    col: i % k,
                    id,
                    vocab,
                });
            }
            out_ids.push(id as u32);
        }
        let mut sorted: Vec<(u32, usize)> = Vec::with_capacity(k);
        let mut out_probs = Vec::with_capacity(expected);
        for row in 0..ntok {
            let ids_row = &out_ids[row * k..(row + 1) * k];
            sorted.clear();
            sorted.extend(ids_row.iter().enumerate().map(|(c, &id)| (id, c)));
            sorted.sort_unstable();
            for w in sorted.windows(2) {
                if w[0].0 == w[1].0 {
                    let (first, second) = (w[0].1.min(w[1].1), w[0].1.max(w[1].1));
                    return Err(Error::DuplicateId {
                        row,
                        id: i64::from(w[0].0),
                        first,
                        second,
                    });
                }
            }
            let v_row = &values[row * k..(row + 1) * k];
            let first = out_probs.len();
            let mut sum = 0f64;
            for (col, &value) in v_row.iter().enumerate() {
                let p = match form {
                    TeacherForm::Probs => {
                        if !value.is_finite() {
                            return Err(Error::NonFiniteProbability { row, col, value });
                        }
                        if value < 0.0 {
                            return Err(Error::NegativeProbability { row, col, value });
                        }
                        f64::from(value)
                    }
                    TeacherForm::Logprobs => {
                        if value.is_nan() || value > 0.0 {
                            return Err(Error::InvalidLogProbability { row, col, value });
                        }
                        f64::from(value).exp()
                    }
                };
                sum += p;
                out_probs.push(p as f32);
            }
            if !(sum > 0.0 && sum.is_finite()) {
                return Err(Error::ProbabilityRowSum { row, sum });
            }
            match tail {
                TailMode::Renormalize => {
                    // From the f64 values: exp of a log-probability is not
                    // rounded to f32 before the division.
                    for (o, &v) in out_probs[first..].iter_mut().zip(v_row) {
                        let p = match form {
                            TeacherForm::Probs => f64::from(v),
                            TeacherForm::Logprobs => f64::from(v).exp(),
                        };
                        *o = (p / sum) as f32;
                    }
                }
                TailMode::Bucket | TailMode::Unnormalized => {
                    if sum > 1.0 + MASS_TOLERANCE {
                        return Err(Error::TeacherMassAboveOne {
                            row,
                            sum,
                            tolerance: MASS_TOLERANCE,
                            tail: tail.name(),
                        });
                    }
                }
            }
        }
        Ok(Self {
            ids: out_ids,
            probs: out_probs,
            ntok,
            k,
            tail,
        })
    }

    /// How the soft term reads the probabilities' mass outside the k.
    pub fn tail(&self) -> TailMode {
        self.tail
    }

    /// Ids `[ntok][k]`.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Probabilities `[ntok][k]` (renormalized in
    /// [`TailMode::Renormalize`]).
    pub fn probs(&self) -> &[f32] {
        &self.probs
    }

    /// Number of tokens.
    pub fn ntok(&self) -> usize {
        self.ntok
    }

    /// Entries per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Checks that the teacher was built for vocabulary `vocab` (its ids
    /// are below it).
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        check_k(self.k, vocab)?;
        match self.ids.iter().position(|&i| i as usize >= vocab) {
            Some(i) => Err(Error::IdOutOfRange {
                row: i / self.k,
                col: i % self.k,
                id: i64::from(self.ids[i]),
                vocab,
            }),
            None => Ok(()),
        }
    }
}

/// Checks `1 ≤ k ≤ min(vocab, 2048)`.
pub fn check_k(k: usize, vocab: usize) -> Result<()> {
    if vocab == 0 {
        return Err(Error::VocabZero);
    }
    if k == 0 {
        return Err(Error::KZero);
    }
    let max = vocab.min(MAX_K);
    if k > max {
        return Err(Error::KTooLarge { k, vocab, max });
    }
    Ok(())
}

fn check_temperature(t: f32) -> Result<()> {
    if t > 0.0 && t.is_finite() {
        Ok(())
    } else {
        Err(Error::InvalidTemperature { value: t })
    }
}

/// `total`, unless it is not positive and finite.
pub(crate) fn check_total(total: f32) -> Result<f32> {
    if total > 0.0 && total.is_finite() {
        Ok(total)
    } else {
        Err(Error::TotalNotPositive { value: total })
    }
}

/// `gscale`, unless it is not positive and finite.
pub(crate) fn check_gscale(gscale: f32) -> Result<f32> {
    if gscale > 0.0 && gscale.is_finite() {
        Ok(gscale)
    } else {
        Err(Error::InvalidGradScale { value: gscale })
    }
}

/// How the per-token losses `w_t·L_t` reduce to the call's loss, as
/// PyTorch's `reduction` argument; dx is always the reduced loss's
/// gradient.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    /// `Σ w_t L_t / total`, `total` the caller's or `Σ w_t`:
    /// `F.cross_entropy`'s mean, the weights a mask.
    #[default]
    Mean,
    /// `Σ w_t L_t`.
    Sum,
    /// `Σ w_t L_t / ntok`: `F.kl_div(…, reduction="batchmean")` over
    /// `[ntok, V]` rows (its `"mean"` is this over `V` more).
    BatchMean,
    /// The per-token losses themselves ([`crate::engine::LossOutput::loss`]); the
    /// call's loss and dx are the sum's, as autograd gives them from a
    /// gradient of ones.
    None,
}

impl Reduction {
    /// Every reduction, by name.
    pub const ALL: [Reduction; 4] = [Self::Mean, Self::Sum, Self::BatchMean, Self::None];

    /// PyTorch's name: `mean`, `sum`, `batchmean` or `none`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Mean => "mean",
            Self::Sum => "sum",
            Self::BatchMean => "batchmean",
            Self::None => "none",
        }
    }

    /// The reduction named `name`, if there is one.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The total the weighted sum divides by over `ntok` tokens: the
    /// caller's `given` total (mean only) or, `None`, the weights' sum.
    pub(crate) fn total(self, given: Option<f32>, ntok: usize) -> Result<Option<f32>> {
        match (self, given) {
            (Self::Mean, given) => Ok(given),
            (reduction, Some(value)) => Err(Error::TotalWithReduction {
                reduction: reduction.name(),
                value,
            }),
            (Self::Sum | Self::None, None) => Ok(Some(1.0)),
            (Self::BatchMean, None) => Ok(Some(ntok as f32)),
        }
    }
}

/// What a loss call is asked on every path: the host call
/// ([`LossOptions::config`]), the call on device buffers
/// ([`crate::resident::DeviceLossOptions::config`]) and headkl-burn's `HeadKl::loss`
/// take it whole, and [`LossConfig::check`] holds it to its ranges in one
/// place. What differs between the paths (weights and labels on the host
/// or in device buffers) is beside it in each path's options.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossConfig {
    /// Temperature τ (default 1).
    pub temperature: f32,
    /// The weight the step averages over; `None` means `Σ w_t` (summed on
    /// the device on the device path). Only with [`Reduction::Mean`].
    pub total: Option<f32>,
    /// How the per-token losses reduce (default: the mean).
    pub reduction: Reduction,
    /// Scale of the f16 gradient; `None` means `2^14 · total / max_t w_t`,
    /// divided by [`LossTerms::grad_bound`] when the hard term is on.
    pub gscale: Option<f32>,
    /// The terms: the soft term's divergence and weight, the hard term's
    /// weight and label smoothing, the z-loss, the softcap and the logit
    /// scale (default: the forward KL alone).
    pub terms: LossTerms,
    /// The dx GEMM's block filter (`crate::problem::filter`; off by default): skip
    /// each block of the dx GEMM whose `|∂L/∂s|` entries are all at most ε
    /// in every row of a GEMM row tile (`crate::problem::filter::AUTO_EPS` is Cut
    /// Cross-Entropy's 2⁻¹⁵). The loss stays exact; dx drops the skipped
    /// products, and on the host path [`crate::engine::LossOutput::filter`] says
    /// how many and bounds what they were. `Some(0.0)` skips only all-zero
    /// blocks: dx bit for bit as without the filter.
    pub filter_eps: Option<f32>,
    /// Also compute the head's gradient `∂mean/∂W` (`[V][hs]`, f32) into
    /// [`crate::engine::LossOutput::head_grad`] (off by default: a frozen
    /// head costs nothing more). It goes through the same logits gradient
    /// as dx, so every term, divergence, weight and reduction gives it;
    /// the block filter does not apply to it (it is exact). The host
    /// entry points return it; the device-resident loss writes it into
    /// [`crate::resident::DeviceLossOptions::head_grad_out`]; the shards
    /// refuse it ([`crate::Error::ShardUnsupported`]).
    pub head_grad: bool,
    /// Device-memory budget for scratch buffers, in bytes.
    pub budget_bytes: u64,
    /// Test knob: at most this many tokens per chunk.
    pub max_rows_per_chunk: Option<usize>,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            total: None,
            reduction: Reduction::Mean,
            gscale: None,
            terms: LossTerms::default(),
            filter_eps: None,
            head_grad: false,
            budget_bytes: DEFAULT_BUDGET_BYTES,
            max_rows_per_chunk: None,
        }
    }
}

impl LossConfig {
    /// Checks the values every path checks first, in this order: τ, the
    /// budget, the terms, labels where the hard term needs them
    /// (`has_labels`: the call brought some), the block filter's ε. A given
    /// `total` and `gscale` are checked once the call knows its tokens
    /// ([`LossConfig::total_for`]; the host path also derives them from
    /// the weights).
    pub fn check(&self, has_labels: bool) -> Result<()> {
        check_temperature(self.temperature)?;
        if self.budget_bytes == 0 {
            return Err(Error::BudgetZero);
        }
        self.terms.check()?;
        if self.terms.hard_on() && !has_labels {
            return Err(Error::HardWeightWithoutLabels {
                value: self.terms.hard_weight,
            });
        }
        self.filter_eps.map(crate::problem::filter::check_eps).transpose()?;
        Ok(())
    }

    /// The total the weighted sum divides by over `ntok` tokens, checked:
    /// the given one (mean only), the reduction's, or `None` for the
    /// weights' sum.
    pub fn total_for(&self, ntok: usize) -> Result<Option<f32>> {
        self.reduction.total(self.total, ntok)?.map(check_total).transpose()
    }
}

/// Options of `head_kl`: the call's [`LossConfig`], and its weights and
/// labels on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct LossOptions {
    /// τ, the reduction, the terms, the budget: what every path takes.
    pub config: LossConfig,
    /// Per-token weights `w_t ≥ 0` (0 masks a token); `None` means all 1.
    pub weights: Option<Vec<f32>>,
    /// Labels `[ntok]` of the hard term (a negative label, or one equal to
    /// `ignore_index`: none), needed when `config.terms.hard_weight > 0`.
    pub labels: Option<Vec<i64>>,
    /// The label that means none (default −100, PyTorch's `ignore_index`;
    /// any negative label is none too).
    pub ignore_index: i64,
    /// Drop the tokens without a label (ignored or negative) from every
    /// term, not only the hard one: their weight becomes 0, so they leave
    /// the mean's `Σ w` too, as Liger's `shift_labels` does. Needs
    /// `labels`; works with the hard term off.
    pub ignore_mask: bool,
}

impl Default for LossOptions {
    fn default() -> Self {
        Self {
            config: LossConfig::default(),
            weights: None,
            labels: None,
            ignore_index: DEFAULT_IGNORE_INDEX,
            ignore_mask: false,
        }
    }
}

impl From<LossConfig> for LossOptions {
    /// The options of a call without weights or labels.
    fn from(config: LossConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }
}

/// PyTorch's default `ignore_index`.
pub const DEFAULT_IGNORE_INDEX: i64 = -100;

/// [`LossOptions`] resolved against a token count: every default filled in
/// and every value checked.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedLoss {
    /// Temperature τ.
    pub temperature: f32,
    /// Weights `[ntok]`.
    pub weights: Vec<f32>,
    /// The averaging weight.
    pub total: f32,
    /// The f16 gradient scale.
    pub gscale: f32,
    /// Per-token KL-kernel coefficient `gscale · w_t / total`.
    pub coef: Vec<f32>,
    /// The terms, checked.
    pub terms: LossTerms,
    /// Labels `[ntok]` ([`NO_LABEL`]: none); all [`NO_LABEL`] when none
    /// were given. Not yet checked against the vocabulary
    /// ([`ResolvedLoss::check_labels`]).
    pub labels: Vec<u32>,
    /// The block filter's ε, checked.
    pub filter_eps: Option<f32>,
}

impl ResolvedLoss {
    /// The call's mean loss: the per-token `loss` weighted, over the total.
    pub fn mean_of(&self, loss: &[f32]) -> f64 {
        let weighted: f64 = loss
            .iter()
            .zip(&self.weights)
            .map(|(&l, &w)| f64::from(l) * f64::from(w))
            .sum();
        weighted / f64::from(self.total)
    }

    /// Checks the labels against a vocabulary of `vocab`.
    pub fn check_labels(&self, vocab: usize) -> Result<()> {
        match self.labels.iter().position(|&l| l != NO_LABEL && l as usize >= vocab) {
            Some(row) => Err(Error::LabelOutOfRange {
                row,
                label: i64::from(self.labels[row]),
                vocab,
            }),
            None => Ok(()),
        }
    }
}

impl LossOptions {
    /// Checks every option and fills in the defaults for `ntok` tokens.
    pub fn resolve(&self, ntok: usize) -> Result<ResolvedLoss> {
        let config = &self.config;
        config.check(self.labels.is_some())?;
        let labels = match &self.labels {
            // The vocabulary is checked by the engine (it knows V); the
            // ignored label is none whatever its value.
            Some(l) => {
                crate::error::Field::Labels.check_len(ntok, l.len())?;
                let ignore = self.ignore_index;
                let mapped: Vec<i64> = l.iter().map(|&v| if v == ignore { -1 } else { v }).collect();
                labels_to_u32(&mapped, NO_LABEL as usize)?
            }
            None if self.ignore_mask => return Err(Error::IgnoreMaskWithoutLabels),
            None => vec![NO_LABEL; ntok],
        };
        let mut weights = match &self.weights {
            None => vec![1.0; ntok],
            Some(w) => {
                crate::error::Field::Weights.check_len(ntok, w.len())?;
                for (row, &value) in w.iter().enumerate() {
                    if !value.is_finite() {
                        return Err(Error::NonFiniteWeight { row, value });
                    }
                    if value < 0.0 {
                        return Err(Error::NegativeWeight { row, value });
                    }
                }
                w.clone()
            }
        };
        if self.ignore_mask {
            for (w, &label) in weights.iter_mut().zip(&labels) {
                if label == NO_LABEL {
                    *w = 0.0;
                }
            }
        }
        let total = match config.reduction.total(config.total, ntok)? {
            Some(t) => t,
            None => weights.iter().map(|&w| f64::from(w)).sum::<f64>() as f32,
        };
        let total = check_total(total)?;
        let max_w = weights.iter().copied().fold(0f32, f32::max);
        let gscale = match config.gscale {
            Some(g) => g,
            // Every |g| stays under 2^14, small probabilities out of f16's
            // subnormals (the extra terms' share of |g| is bounded by
            // `grad_bound`). All tokens masked: the gradient is 0 whatever the scale.
            None if max_w > 0.0 => {
                let bound = config.terms.grad_bound(config.temperature);
                ((1u32 << 14) as f64 * f64::from(total) / (f64::from(max_w) * bound)) as f32
            }
            None => 1.0,
        };
        let gscale = check_gscale(gscale)?;
        let coef = weights
            .iter()
            .map(|&w| (f64::from(gscale) * f64::from(w) / f64::from(total)) as f32)
            .collect();
        Ok(ResolvedLoss {
            temperature: config.temperature,
            weights,
            total,
            gscale,
            coef,
            terms: config.terms,
            labels,
            filter_eps: config.filter_eps,
        })
    }
}

/// Options of `topk`.
#[derive(Clone, Debug, PartialEq)]
pub struct TopkOptions {
    /// Entries per row, `1 ≤ k ≤ min(V, 2048)`.
    pub k: usize,
    /// Temperature τ of the probabilities (default 1).
    pub temperature: f32,
    /// Device-memory budget for scratch buffers, in bytes.
    pub budget_bytes: u64,
    /// Test knob: at most this many tokens per chunk.
    pub max_rows_per_chunk: Option<usize>,
    /// The logit softcap `c` (`c·tanh(z/c)` before τ; default none).
    pub softcap: Option<f32>,
    /// Logit scale S: z = S·x·Wᵀ before the softcap and τ (default 1), as
    /// [`LossTerms::logit_scale`] for the loss.
    pub logit_scale: f32,
    /// Also return the k log-probabilities over the full vocabulary at τ
    /// ([`crate::engine::TopK::logprobs`]), as a stored teacher would be.
    pub logprobs: bool,
}

impl TopkOptions {
    /// `k` entries at τ = 1 and the default budget.
    pub fn new(k: usize) -> Self {
        Self {
            k,
            temperature: 1.0,
            budget_bytes: DEFAULT_BUDGET_BYTES,
            max_rows_per_chunk: None,
            softcap: None,
            logit_scale: 1.0,
            logprobs: false,
        }
    }

    /// Checks the options against a vocabulary size.
    pub fn check(&self, vocab: usize) -> Result<()> {
        check_k(self.k, vocab)?;
        check_temperature(self.temperature)?;
        LossTerms {
            softcap: self.softcap,
            logit_scale: self.logit_scale,
            ..LossTerms::default()
        }
        .check()?;
        if self.budget_bytes == 0 {
            return Err(Error::BudgetZero);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ignored label (and any negative one) is no label; with the mask
    /// its token's weight is 0 and leaves the mean's total; the mask needs
    /// labels.
    #[test]
    fn ignore_index_and_mask() {
        let opts = |ignore_mask| LossOptions {
            weights: Some(vec![1.0, 2.0, 0.5, 1.0]),
            labels: Some(vec![7, 50_000, -1, 3]),
            ignore_index: 50_000,
            ignore_mask,
            ..LossOptions::default()
        };
        let kept = opts(false).resolve(4).unwrap();
        assert_eq!(kept.labels, vec![7, NO_LABEL, NO_LABEL, 3]);
        assert_eq!((kept.weights[1], kept.total), (2.0, 4.5));
        let masked = opts(true).resolve(4).unwrap();
        assert_eq!(masked.labels, kept.labels);
        assert_eq!(masked.weights, vec![1.0, 0.0, 0.0, 1.0]);
        assert_eq!(masked.total, 2.0);
        assert_eq!(masked.coef[1], 0.0);
        let no_labels = LossOptions {
            ignore_mask: true,
            ..LossOptions::default()
        };
        assert_eq!(no_labels.resolve(4), Err(Error::IgnoreMaskWithoutLabels));
    }

    /// Each reduction's total, from the weights and the token count alone;
    /// a total given beside a reduction other than the mean is refused.
    #[test]
    fn reductions_set_the_total() {
        let opts = |reduction, total| LossOptions {
            config: LossConfig {
                total,
                reduction,
                ..LossConfig::default()
            },
            weights: Some(vec![0.5, 0.0, 2.0, 1.0]),
            ..LossOptions::default()
        };
        let total = |reduction, given| opts(reduction, given).resolve(4).map(|r| r.total);
        assert_eq!(total(Reduction::Mean, None), Ok(3.5));
        assert_eq!(total(Reduction::Mean, Some(7.0)), Ok(7.0));
        assert_eq!(total(Reduction::Sum, None), Ok(1.0));
        assert_eq!(total(Reduction::None, None), Ok(1.0));
        assert_eq!(total(Reduction::BatchMean, None), Ok(4.0));
        assert_eq!(
            total(Reduction::Sum, Some(2.0)),
            Err(Error::TotalWithReduction {
                reduction: "sum",
                value: 2.0
            })
        );
        // The per-token coefficient is gscale·w/total.
        let r = opts(Reduction::Sum, None).resolve(4).unwrap();
        assert_eq!(r.coef[2], r.gscale * 2.0);
        for reduction in Reduction::ALL {
            assert_eq!(Reduction::from_name(reduction.name()), Some(reduction));
        }
        assert_eq!(Reduction::from_name("elementwise_mean"), None);
    }
}
