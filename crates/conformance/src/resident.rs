//! The device-resident entry points ([`headkl_core::Engine::head_kl_device`],
//! [`headkl_core::Engine::topk_device`]) held to the same results as the host path and
//! the f64 reference, and bad data on the device held to the host path's
//! errors. Generic over a [`ResidentBackend`]; a backend crate instantiates
//! it with [`crate::resident_conformance_tests!`].
//!
//! - **cases**: the drawn driver cases (the same seeds as
//!   [`super::Part::DriverCases`]) with inputs uploaded to device buffers,
//!   hidden rows as f32, f16 or bf16; `head_kl` also accumulated into its
//!   own dx (which must double), and compared with the host path;
//! - **errors**: each kind of bad teacher row, weight and hidden row on the
//!   device must give exactly the error the host path gives for the same
//!   data, at [`headkl_core::Engine::wait_device`] (or at once in checked mode), leave no
//!   validation message, and leave the engine usable. A `head_kl` error
//!   case also holds the call's outputs to DESIGN §8 against its clean
//!   twin (the same data with the bad values replaced by good ones): each
//!   row the device flags has a NaN loss and terms and a zero dx row, adds
//!   nothing to an accumulated dx (with the block filter on), and every
//!   other row is the twin's, bit for bit ([`check_flagged_rows`]);
//!   `loss_out` run directly does not report a flagged row as bad logits
//!   ([`check_loss_out_flags`]).

use half::{bf16, f16};
use headkl_core::resident::status::{self, FLAGGED_ROW, NONE, S_DX_MUL, S_LOGITS};
use headkl_core::toolkit::{Launch, LossOutDesc};
use headkl_core::{
    DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, DxSplit, Engine, Error, Hidden, HiddenDtype,
    LossConfig, LossOptions, ResidentBackend, TailMode, TeacherForm, ALIGN, NO_LABEL,
};

use super::{driver_case, engine_for, run_one, CaseErrors, CaseOutcome, Recorder, SuiteConfig, SuiteReport};
use crate::generator::{Case, CaseKind, CaseParams};
use headkl_reference::direct;
use headkl_reference::tolerance::Tolerance;

/// Uploads `data` into a fresh device buffer.
pub(super) fn device_buffer<B: ResidentBackend + ?Sized>(
    backend: &B,
    data: &[u8],
    what: &'static str,
) -> Result<B::Buffer, String> {
    let b = backend
        .alloc(data.len().max(4) as u64, what)
        .map_err(|e| format!("alloc {what}: {e}"))?;
    backend.upload(&b, 0, data).map_err(|e| format!("upload {what}: {e}"))?;
    Ok(b)
}

/// `n` f32 values from the start of `b`.
pub(super) fn download_f32<B: ResidentBackend + ?Sized>(
    backend: &B,
    b: &B::Buffer,
    n: usize,
) -> Result<Vec<f32>, String> {
    let mut out = vec![0f32; n];
    backend
        .download(b, 0, bytemuck::cast_slice_mut(&mut out))
        .map_err(|e| format!("download: {e}"))?;
    Ok(out)
}

/// A resident call's per-token losses (and their mean) and dx (`hs` per
/// row) against the f64 reference: the loss and dx errors.
fn check_vs_reference(
    tol: &Tolerance,
    (got_loss, mean): (&[f32], f64),
    got_dx: &[f32],
    want: &direct::DirectLoss,
    hs: usize,
) -> Result<(f64, f64), String> {
    let loss = tol
        .check_loss(got_loss, mean, want)
        .map_err(|e| format!("resident vs reference: {e}"))?;
    let dx = tol
        .check_dx_rows(got_dx, &want.dx, Some(hs))
        .map_err(|e| format!("resident vs reference: {e}"))?;
    Ok((loss, dx))
}

/// The same loss through the host path (`engine.head_kl`), its dx checked
/// against the resident call's `got_dx` (`hs` per row): the host output and
/// its dx in f64.
fn check_vs_host_path<B: ResidentBackend + ?Sized>(
    engine: &mut Engine<&B>,
    rows: &Hidden<'_>,
    teacher: &headkl_core::Teacher,
    opts: &LossOptions,
    got_dx: &[f32],
    hs: usize,
    tol: &Tolerance,
) -> Result<(headkl_core::LossOutput, Vec<f64>), String> {
    let host = engine
        .head_kl(rows, teacher, opts)
        .map_err(|e| format!("host head_kl: {e}"))?;
    let host_dx: Vec<f64> = host.dx.iter().map(|&v| f64::from(v)).collect();
    tol.check_dx_rows(got_dx, &host_dx, Some(hs))
        .map_err(|e| format!("resident vs host path: {e}"))?;
    Ok((host, host_dx))
}

/// Values of rows `width` wide against the host path's, each within
/// 1e-5 relative (equal infinities pass): the first that is not, named
/// `what[row][col]` (`what[row]` when `width` is 1).
fn check_close_to_host(what: &str, got: &[f32], host: &[f32], width: usize) -> Result<(), String> {
    let close = |got: f32, want: f32| got == want || (got - want).abs() <= 1e-5 * (1.0 + want.abs());
    if got.len() != host.len() {
        return Err(format!("{what}: {} values, the host path's {}", got.len(), host.len()));
    }
    match (0..got.len()).find(|&i| !close(got[i], host[i])) {
        None => Ok(()),
        Some(i) if width == 1 => Err(format!("{what}[{i}] = {}, the host path's {}", got[i], host[i])),
        Some(i) => Err(format!(
            "{what}[{}][{}] = {}, the host path's {}",
            i / width,
            i % width,
            got[i],
            host[i]
        )),
    }
}

/// A case's hidden rows uploaded as `dtype` to a fresh device buffer, and
/// the f32 values they hold (what the reference and the host path get).
struct DeviceRows<Buf> {
    buffer: Buf,
    dtype: HiddenDtype,
    values: Vec<f32>,
}

impl<Buf> DeviceRows<Buf> {
    fn upload<B: ResidentBackend<Buffer = Buf> + ?Sized>(
        backend: &B,
        case: &Case,
        dtype: HiddenDtype,
    ) -> Result<Self, String> {
        let (bytes, values) = match dtype {
            HiddenDtype::F32 => (bytemuck::cast_slice(&case.hidden).to_vec(), case.hidden.clone()),
            HiddenDtype::F16 => {
                let h: Vec<f16> = case.hidden.iter().map(|&v| f16::from_f32(v)).collect();
                let vals = h.iter().map(|v| v.to_f32()).collect();
                (bytemuck::cast_slice(&h).to_vec(), vals)
            }
            HiddenDtype::Bf16 => {
                let h: Vec<bf16> = case.hidden.iter().map(|&v| bf16::from_f32(v)).collect();
                let vals = h.iter().map(|v| v.to_f32()).collect();
                (bytemuck::cast_slice(&h).to_vec(), vals)
            }
        };
        Ok(Self {
            buffer: device_buffer(backend, &bytes, "x")?,
            dtype,
            values,
        })
    }

    /// The rows as the resident calls take them.
    fn hidden(&self) -> DeviceHidden<'_, Buf> {
        DeviceHidden {
            buffer: &self.buffer,
            dtype: self.dtype,
        }
    }
}

/// The dtype drawn case `index` sends its hidden rows as.
fn dtype_for(case: &Case, index: usize) -> HiddenDtype {
    if case.hidden_as_f16 {
        HiddenDtype::F16
    } else if index.is_multiple_of(4) {
        HiddenDtype::Bf16
    } else {
        HiddenDtype::F32
    }
}

/// The dx split of drawn case `index`: a third each automatic, 2 and 3
/// parts, so the resident path's split-K partials (in its logits scratch)
/// run on every backend.
fn split_for(index: usize) -> DxSplit {
    match index % 3 {
        0 => DxSplit::Auto,
        r => DxSplit::Parts(r + 1),
    }
}

fn nan_bytes(n: usize) -> Vec<u8> {
    bytemuck::cast_slice(&vec![f32::NAN; n]).to_vec()
}

/// A head_kl case's teacher and weights uploaded to fresh device buffers,
/// and its outputs, NaN until written.
struct HeadKlBuffers<Buf> {
    ids: Buf,
    probs: Buf,
    /// How `probs` holds the teacher, and its tail mode (the case's).
    form: TeacherForm,
    tail: TailMode,
    weights: Option<Buf>,
    /// u32 labels (`NO_LABEL` for a negative one).
    labels: Option<Buf>,
    loss: Buf,
    dx: Buf,
    /// `[ntok][3]`: lse, soft, hard.
    terms_out: Buf,
}

impl<Buf> HeadKlBuffers<Buf> {
    fn upload<B: ResidentBackend<Buffer = Buf> + ?Sized>(backend: &B, case: &Case) -> Result<Self, String> {
        // The teacher's values in its form, as the host path reads them.
        let values: Vec<f32> = match case.teacher_form {
            TeacherForm::Probs => case.teacher_probs.clone(),
            TeacherForm::Logprobs => case.teacher_probs.iter().map(|&p| p.ln()).collect(),
        };
        let labels: Option<Vec<u32>> = case
            .labels
            .as_ref()
            .map(|l| l.iter().map(|&v| u32::try_from(v).unwrap_or(NO_LABEL)).collect());
        Ok(Self {
            ids: device_buffer(backend, bytemuck::cast_slice(&case.teacher_ids), "ids")?,
            probs: device_buffer(backend, bytemuck::cast_slice(&values), "probs")?,
            form: case.teacher_form,
            tail: case.tail,
            weights: match &case.weights {
                Some(w) => Some(device_buffer(backend, bytemuck::cast_slice(w), "weights")?),
                None => None,
            },
            labels: match &labels {
                Some(l) => Some(device_buffer(backend, bytemuck::cast_slice(l), "labels")?),
                None => None,
            },
            loss: device_buffer(backend, &nan_bytes(case.ntok), "loss")?,
            dx: device_buffer(backend, &nan_bytes(case.ntok * case.hs), "dx")?,
            terms_out: device_buffer(backend, &nan_bytes(case.ntok * 3), "terms_out")?,
        })
    }

    /// [`Self::options`] with `edit` made to their config.
    fn options_with(&self, case: &Case, edit: impl FnOnce(&mut LossConfig)) -> DeviceLossOptions<'_, Buf> {
        let mut opts = self.options(case);
        edit(&mut opts.config);
        opts
    }

    /// The resident options carrying the case's terms and these buffers.
    fn options(&self, case: &Case) -> DeviceLossOptions<'_, Buf> {
        DeviceLossOptions {
            config: LossConfig {
                temperature: case.temperature,
                max_rows_per_chunk: case.max_rows_per_chunk,
                terms: case.terms,
                reduction: case.reduction,
                ..LossConfig::default()
            },
            weights: self.weights.as_ref(),
            labels: self.labels.as_ref(),
            terms_out: Some(&self.terms_out),
            ..DeviceLossOptions::default()
        }
    }

    fn teacher(&self, k: usize) -> DeviceTeacher<'_, Buf> {
        DeviceTeacher {
            form: self.form,
            tail: self.tail,
            ..DeviceTeacher::new(&self.ids, &self.probs, k)
        }
    }

    fn output(&self) -> DeviceLossOutput<'_, Buf> {
        DeviceLossOutput {
            loss: &self.loss,
            dx: &self.dx,
        }
    }
}

/// One drawn case through the resident path, against the reference and the
/// host path.
fn check_resident_case<B: ResidentBackend + ?Sized>(
    backend: &B,
    case: &Case,
    (dtype, split): (HiddenDtype, DxSplit),
    tol: &Tolerance,
) -> Result<CaseErrors, String> {
    let mut engine = engine_for(backend, case)?;
    engine.set_dx_split(split);
    let head = case.head_weights().map_err(|e| format!("case head: {e}"))?;
    let rows = DeviceRows::upload(backend, case, dtype)?;
    let host_hidden = Hidden::f32(&rows.values, case.ntok, case.hs).map_err(|e| format!("hidden: {e}"))?;
    let hidden = rows.hidden();
    match case.kind {
        CaseKind::HeadKl => {
            let (ntok, hs) = (case.ntok, case.hs);
            let bufs = HeadKlBuffers::upload(backend, case)?;
            let mut opts = bufs.options(case);
            let (teacher, out) = (bufs.teacher(case.k), bufs.output());
            engine
                .head_kl_device(ntok, &hidden, &teacher, &out, &opts)
                .map_err(|e| format!("head_kl_device: {e}"))?;
            engine.wait_device().map_err(|e| format!("wait_device: {e}"))?;
            let got_loss = download_f32(backend, &bufs.loss, ntok)?;
            let got_dx = download_f32(backend, &bufs.dx, ntok * hs)?;

            let host_teacher = case.teacher().map_err(|e| format!("case teacher: {e}"))?;
            let host_opts = case.loss_options();
            let resolved = host_opts.resolve(ntok).map_err(|e| format!("case options: {e}"))?;
            let mean = resolved.mean_of(&got_loss);
            let want = direct::head_kl_f64(&head, &host_hidden, &host_teacher, &resolved);
            let (loss_err, dx_err) = check_vs_reference(tol, (&got_loss, mean), &got_dx, &want, hs)?;

            // bf16 rows go through the host path as bf16 too.
            let rows_bf16: Vec<bf16> = case.hidden.iter().map(|&v| bf16::from_f32(v)).collect();
            let host_rows = if dtype == HiddenDtype::Bf16 {
                Hidden::bf16(&rows_bf16, ntok, hs).map_err(|e| format!("hidden: {e}"))?
            } else {
                host_hidden
            };
            let (host, host_dx) =
                check_vs_host_path(&mut engine, &host_rows, &host_teacher, &host_opts, &got_dx, hs, tol)?;
            let host_loss = direct::DirectLoss {
                loss: host.loss.iter().map(|&l| f64::from(l)).collect(),
                mean: host.mean,
                dx: host_dx,
                ..direct::DirectLoss::of_losses(Vec::new())
            };
            tol.check_loss(&got_loss, mean, &host_loss)
                .map_err(|e| format!("resident vs host path: {e}"))?;
            // The optional per-token terms against the host path's.
            let terms = download_f32(backend, &bufs.terms_out, ntok * 3)?;
            for (c, (name, host_part)) in [("lse", &host.lse), ("soft", &host.soft), ("hard", &host.hard)]
                .into_iter()
                .enumerate()
            {
                let got: Vec<f32> = (0..ntok).map(|t| terms[t * 3 + c]).collect();
                let want = direct::DirectLoss::of_losses(host_part.iter().map(|&v| f64::from(v)).collect());
                let got_mean = got.iter().map(|&v| f64::from(v)).sum::<f64>() / ntok as f64;
                tol.check_loss(&got, got_mean, &want)
                    .map_err(|e| format!("resident {name} vs host path: {e}"))?;
            }

            // Accumulated into its own output: dx doubles.
            opts.accumulate_dx = true;
            engine
                .head_kl_device(ntok, &hidden, &teacher, &out, &opts)
                .map_err(|e| format!("head_kl_device (accumulate): {e}"))?;
            engine.wait_device().map_err(|e| format!("wait_device: {e}"))?;
            let doubled = download_f32(backend, &bufs.dx, ntok * hs)?;
            let twice: Vec<f64> = got_dx.iter().map(|&v| 2.0 * f64::from(v)).collect();
            tol.check_dx_rows(&doubled, &twice, Some(hs))
                .map_err(|e| format!("accumulate_dx: {e}"))?;
            Ok(CaseErrors {
                loss: Some(loss_err),
                dx: Some(dx_err),
                ..CaseErrors::default()
            })
        }
        CaseKind::Topk => {
            let (ntok, k) = (case.ntok, case.k);
            let ids = device_buffer(backend, &vec![0xffu8; ntok * k * 4], "ids")?;
            let probs = device_buffer(backend, &nan_bytes(ntok * k), "probs")?;
            engine
                .topk_device(ntok, &hidden, &ids, &probs, &case.topk_options())
                .map_err(|e| format!("topk_device: {e}"))?;
            engine.wait_device().map_err(|e| format!("wait_device: {e}"))?;
            let mut got_ids = vec![0u32; ntok * k];
            backend
                .download(&ids, 0, bytemuck::cast_slice_mut(&mut got_ids))
                .map_err(|e| format!("download: {e}"))?;
            let got_probs = download_f32(backend, &probs, ntok * k)?;
            let want = direct::topk_f64(&head, &host_hidden, k, case.topk_temperature());
            let prob = tol
                .check_topk(&got_ids, &got_probs, &want)
                .map_err(|e| format!("resident vs reference: {e}"))?;
            let host = engine
                .topk(&host_hidden, &case.topk_options())
                .map_err(|e| format!("host topk: {e}"))?;
            if host.ids != got_ids {
                let t = host.ids.iter().zip(&got_ids).position(|(a, b)| a != b).unwrap_or(0) / k;
                return Err(format!("resident ids differ from the host path's first at token {t}"));
            }
            // Log-probabilities under a softcap: the host path's too.
            let lp_opts = headkl_core::TopkOptions {
                logprobs: true,
                softcap: Some(3.0),
                ..case.topk_options()
            };
            engine
                .topk_device(ntok, &hidden, &ids, &probs, &lp_opts)
                .map_err(|e| format!("topk_device (logprobs, softcap): {e}"))?;
            engine.wait_device().map_err(|e| format!("wait_device: {e}"))?;
            backend
                .download(&ids, 0, bytemuck::cast_slice_mut(&mut got_ids))
                .map_err(|e| format!("download: {e}"))?;
            let got_lp = download_f32(backend, &probs, ntok * k)?;
            let host = engine
                .topk(&host_hidden, &lp_opts)
                .map_err(|e| format!("host topk (logprobs, softcap): {e}"))?;
            if host.ids != got_ids {
                return Err("resident ids under a softcap differ from the host path's".into());
            }
            check_close_to_host("resident logprobs", &got_lp, &host.logprobs, k)?;
            check_gather_device(backend, &mut engine, (&hidden, &host_hidden), &got_ids, &lp_opts)?;
            Ok(CaseErrors {
                prob: Some(prob),
                ..CaseErrors::default()
            })
        }
    }
}

/// `Engine::logprobs_at_device` at `top` (a top-k's ids; none, `u32::MAX`,
/// in the last column when k > 1) against the host path's
/// `Engine::logprobs_at` on the same rows; then an id past V planted in
/// the middle token: `wait_device` names it as the host path would, and
/// the engine runs the clean ids again.
fn check_gather_device<B: ResidentBackend + ?Sized>(
    backend: &B,
    engine: &mut Engine<&B>,
    (hidden, host_hidden): (&DeviceHidden<'_, B::Buffer>, &Hidden<'_>),
    top: &[u32],
    opts: &headkl_core::TopkOptions,
) -> Result<(), String> {
    let (ntok, k, vocab) = (host_hidden.ntok(), opts.k, engine.vocab());
    let mut ids = top.to_vec();
    if k > 1 {
        ids.iter_mut().skip(k - 1).step_by(k).for_each(|id| *id = u32::MAX);
    }
    let ids_buf = device_buffer(backend, bytemuck::cast_slice(&ids), "gather ids")?;
    let logprobs = device_buffer(backend, &nan_bytes(ntok * k), "gather logprobs")?;
    let lse = device_buffer(backend, &nan_bytes(ntok), "gather lse")?;
    let run = |engine: &mut Engine<&B>| {
        engine
            .logprobs_at_device(ntok, hidden, &ids_buf, (&logprobs, &lse), opts)
            .and_then(|()| engine.wait_device())
    };
    run(engine).map_err(|e| format!("logprobs_at_device: {e}"))?;
    let (got, got_lse) = (
        download_f32(backend, &logprobs, ntok * k)?,
        download_f32(backend, &lse, ntok)?,
    );
    let host_ids: Vec<i64> = ids
        .iter()
        .map(|&id| if id == u32::MAX { -1 } else { i64::from(id) })
        .collect();
    let host = engine
        .logprobs_at(host_hidden, &host_ids, opts)
        .map_err(|e| format!("host logprobs_at: {e}"))?;
    check_close_to_host("resident gather", &got, &host.logprobs, k)?;
    check_close_to_host("resident gather lse", &got_lse, &host.lse, 1)?;
    let (row, bad) = (ntok / 2, vocab as u32 + 5);
    let mut planted = ids.clone();
    planted[row * k] = bad;
    backend
        .upload(&ids_buf, 0, bytemuck::cast_slice(&planted))
        .map_err(|e| format!("upload: {e}"))?;
    match run(engine) {
        Err(Error::IdOutOfRange { row: r, col: 0, id, .. }) if r == row && id == i64::from(bad) => {}
        other => return Err(format!("an id past V at [{row}][0]: {other:?}, want IdOutOfRange")),
    }
    backend
        .upload(&ids_buf, 0, bytemuck::cast_slice(&ids))
        .map_err(|e| format!("upload: {e}"))?;
    run(engine).map_err(|e| format!("logprobs_at_device after the error: {e}"))
}

/// The error cases: name, what they show.
pub(crate) const RESIDENT_ERROR_CASES: &[(&str, &str)] = &[
    ("id_out_of_range", "ids[21][2] = V + 5, chunks of 16"),
    ("id_is_vocab", "ids[14][0] = V"),
    ("id_minus_one", "ids[22][1] = -1 (0xffffffff as u32)"),
    ("row_of_huge_ids", "every id of row 37 is 0xffffffff"),
    ("duplicate_id", "ids[33][3] repeats ids[33][1]"),
    ("negative_prob", "probs[17][3] = -0.5"),
    ("nan_prob", "probs[2][0] = NaN"),
    ("inf_prob", "probs[39][1] = +inf"),
    ("zero_row", "row 5 of probs is all 0"),
    ("negative_weight", "weights[30] = -1"),
    ("nan_weight", "weights[8] = NaN"),
    ("all_masked", "every weight 0: total = 0"),
    ("nan_hidden", "NaN in hidden row 25"),
    (
        "first_of_two",
        "ids[30][0] out of range and probs[3][1] negative: the host names the id first",
    ),
    ("topk_nan_hidden", "topk: +inf in hidden row 19"),
    ("logprob_positive", "log-probabilities: logprobs[12][1] = 0.5"),
    ("logprob_nan", "log-probabilities: logprobs[3][0] = NaN"),
    ("mass_above_one", "tail bucket: row 9 holds 1.25 of the mass"),
    ("label_out_of_range", "hard term: labels[27] = V + 3"),
    ("checked_mode", "checked mode: the call itself returns the error"),
];

fn error_base() -> Case {
    resident_base(300, 24)
}

/// [`error_base`]'s case with `vocab` rows of `hs` hidden columns.
fn resident_base(vocab: usize, hs: usize) -> Case {
    let mut case = Case::from_params(&CaseParams {
        profile: "resident-errors",
        max_rows_per_slice: Some(128),
        max_rows_per_chunk: Some(16),
        ..super::cases::params(CaseKind::HeadKl, vocab, hs, 40, 4, 77)
    });
    case.weights = Some((0..case.ntok).map(|t| 0.5 + (t % 3) as f32).collect());
    case
}

/// The host path's error for `case` (what the resident path must return).
fn host_error<B: ResidentBackend + ?Sized>(backend: &B, case: &Case) -> Result<Error, String> {
    let teacher = match case.teacher() {
        Ok(t) => t,
        Err(e) => return Ok(e),
    };
    let opts: LossOptions = case.loss_options();
    if let Err(e) = opts.resolve(case.ntok) {
        return Ok(e);
    }
    let mut engine = engine_for(backend, case)?;
    let hidden = Hidden::f32(&case.hidden, case.ntok, case.hs).map_err(|e| e.to_string())?;
    match case.kind {
        CaseKind::HeadKl => engine.head_kl(&hidden, &teacher, &opts).err(),
        CaseKind::Topk => engine.topk(&hidden, &case.topk_options()).err(),
    }
    .ok_or_else(|| "the host path accepted the bad data".to_string())
}

/// The error a resident call on bad data gave: the call's own in checked
/// mode, else the next wait's.
fn error_of<B: ResidentBackend + ?Sized>(
    engine: &mut Engine<&B>,
    checked: bool,
    call: headkl_core::Result<()>,
) -> Result<Error, String> {
    match (checked, call) {
        (true, Err(e)) => Ok(e),
        (true, Ok(())) => Err("checked mode: the call returned Ok on bad data".into()),
        (false, Err(e)) => Err(format!("the call failed before the device ran: {e}")),
        (false, Ok(())) => engine
            .wait_device()
            .err()
            .ok_or_else(|| "wait_device returned Ok on bad data".to_string()),
    }
}

/// Runs the bad case on the resident path: the error `wait_device` (or,
/// checked, the call) returns; a `head_kl` call's outputs held to its clean
/// twin's ([`check_flagged_rows`]); and then a clean call on the same
/// engine must pass.
fn resident_error<B: ResidentBackend + ?Sized>(backend: &B, ec: &ErrorCase) -> Result<Error, String> {
    let case = &ec.bad;
    let mut engine = engine_for(backend, case)?;
    engine.set_checked(ec.checked);
    let rows = DeviceRows::upload(backend, case, HiddenDtype::F32)?;
    let hidden = rows.hidden();
    let (ntok, k) = (case.ntok, case.k);
    let err = match case.kind {
        CaseKind::HeadKl => {
            let bufs = HeadKlBuffers::upload(backend, case)?;
            let opts = bufs.options(case);
            let call = engine.head_kl_device(ntok, &hidden, &bufs.teacher(k), &bufs.output(), &opts);
            let err = error_of(&mut engine, ec.checked, call)?;
            check_flagged_rows(backend, &mut engine, ec, (&hidden, &bufs), &err)?;
            err
        }
        CaseKind::Topk => {
            let ids = device_buffer(backend, &vec![0u8; ntok * k * 4], "ids")?;
            let probs = device_buffer(backend, &nan_bytes(ntok * k), "probs")?;
            let call = engine.topk_device(ntok, &hidden, &ids, &probs, &case.topk_options());
            error_of(&mut engine, ec.checked, call)?
        }
    };
    // The status is cleared: the next wait reports nothing, and a clean call
    // on the same engine matches the reference.
    engine
        .wait_device()
        .map_err(|e| format!("a second wait still reports: {e}"))?;
    let clean = error_base();
    check_resident_case(
        backend,
        &clean,
        (HiddenDtype::F32, DxSplit::Auto),
        &Tolerance::default(),
    )
    .map_err(|e| format!("clean call after the error: {e}"))?;
    Ok(err)
}

/// A resident error case: the bad data, its clean twin (the same data with
/// each bad value replaced by a good one: the base case's, and a bad weight
/// by 0, so the weights' `total` and `gscale` are the bad call's), and
/// whether the engine runs in checked mode.
struct ErrorCase {
    bad: Case,
    clean: Case,
    checked: bool,
}

impl ErrorCase {
    /// The rows whose teacher row, weight or label differ between the twins
    /// (as bits): the rows the device must flag.
    fn flagged_rows(&self) -> Vec<usize> {
        let (a, b, k) = (&self.bad, &self.clean, self.bad.k);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let weight = |c: &Case, t: usize| c.weights.as_ref().map(|w| w[t].to_bits());
        let label = |c: &Case, t: usize| c.labels.as_ref().map(|l| l[t]);
        (0..a.ntok)
            .filter(|&t| {
                let row = t * k..(t + 1) * k;
                a.teacher_ids[row.clone()] != b.teacher_ids[row.clone()]
                    || bits(&a.teacher_probs[row.clone()]) != bits(&b.teacher_probs[row])
                    || weight(a, t) != weight(b, t)
                    || label(a, t) != label(b, t)
            })
            .collect()
    }

    /// The rows neither flagged nor of another hidden row in the twin:
    /// the rows that must equal the twin's.
    fn same_rows(&self) -> Vec<usize> {
        let (a, b, hs) = (&self.bad, &self.clean, self.bad.hs);
        let flagged = self.flagged_rows();
        let row_bits = |c: &Case, t: usize| {
            c.hidden[t * hs..(t + 1) * hs]
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        };
        (0..a.ntok)
            .filter(|t| !flagged.contains(t) && row_bits(a, *t) == row_bits(b, *t))
            .collect()
    }
}

/// The value an accumulated dx starts at, element `i` (exact in f32).
fn dx_fill(i: usize) -> f32 {
    0.25 + (i % 7) as f32 * 0.125
}

/// A `head_kl` call on bad data (its error `err` already returned; `bufs`
/// its outputs) against DESIGN §8: each flagged row has a NaN loss and
/// terms and a zero dx row; the call again, accumulated into a dx holding
/// [`dx_fill`] and with the block filter, returns the same error, adds
/// nothing to a flagged row's dx and gives the same losses (bit for bit);
/// the clean twin's call on the same engine gives every other row (its
/// hidden row the same too) the same loss, terms and dx, bit for bit, and
/// the accumulated filtered dx within the dx tolerance. Fails if a kernel
/// ignores the flag (the flagged row's loss would be finite).
fn check_flagged_rows<B: ResidentBackend + ?Sized>(
    backend: &B,
    engine: &mut Engine<&B>,
    ec: &ErrorCase,
    (hidden, bufs): (&DeviceHidden<'_, B::Buffer>, &HeadKlBuffers<B::Buffer>),
    err: &Error,
) -> Result<(), String> {
    let (case, clean) = (&ec.bad, &ec.clean);
    let (ntok, hs, k) = (case.ntok, case.hs, case.k);
    let (flagged, same) = (ec.flagged_rows(), ec.same_rows());
    let loss = download_f32(backend, &bufs.loss, ntok)?;
    let dx = download_f32(backend, &bufs.dx, ntok * hs)?;
    let terms = download_f32(backend, &bufs.terms_out, ntok * 3)?;

    // Again, accumulated and filtered.
    let fill: Vec<f32> = (0..ntok * hs).map(dx_fill).collect();
    let acc_dx_buf = device_buffer(backend, bytemuck::cast_slice(&fill), "dx (accumulated)")?;
    let acc_loss_buf = device_buffer(backend, &nan_bytes(ntok), "loss (filtered)")?;
    let opts = DeviceLossOptions {
        accumulate_dx: true,
        ..bufs.options_with(case, |c| c.filter_eps = Some(headkl_core::problem::filter::AUTO_EPS))
    };
    let acc_out = DeviceLossOutput {
        loss: &acc_loss_buf,
        dx: &acc_dx_buf,
    };
    let call = engine.head_kl_device(ntok, hidden, &bufs.teacher(k), &acc_out, &opts);
    let again = error_of(engine, ec.checked, call)?;
    if format!("{again:?}") != format!("{err:?}") {
        return Err(format!("accumulated and filtered: {again:?}, the first call {err:?}"));
    }
    let acc_dx = download_f32(backend, &acc_dx_buf, ntok * hs)?;
    let acc_loss = download_f32(backend, &acc_loss_buf, ntok)?;

    // The clean twin on the same engine.
    let x = device_buffer(backend, bytemuck::cast_slice(&clean.hidden), "x (clean twin)")?;
    let twin = HeadKlBuffers::upload(backend, clean)?;
    engine
        .head_kl_device(
            ntok,
            &DeviceHidden {
                buffer: &x,
                dtype: HiddenDtype::F32,
            },
            &twin.teacher(k),
            &twin.output(),
            &twin.options(clean),
        )
        .map_err(|e| format!("the clean twin: {e}"))?;
    engine.wait_device().map_err(|e| format!("the clean twin: {e}"))?;
    let want_loss = download_f32(backend, &twin.loss, ntok)?;
    let want_dx = download_f32(backend, &twin.dx, ntok * hs)?;
    let want_terms = download_f32(backend, &twin.terms_out, ntok * 3)?;

    for &t in &flagged {
        if !loss[t].is_nan() {
            return Err(format!("flagged row {t}: loss {}, want NaN", loss[t]));
        }
        // The marker came through kl_rows and loss_out bit for bit (what
        // keeps loss_out from reading the row as bad logits).
        if loss[t].to_bits() != FLAGGED_ROW {
            return Err(format!(
                "flagged row {t}: loss bits {:#x}, want FLAGGED_ROW's {FLAGGED_ROW:#x}",
                loss[t].to_bits()
            ));
        }
        if !terms[t * 3..t * 3 + 3].iter().all(|v| v.is_nan()) {
            return Err(format!(
                "flagged row {t}: terms {:?}, want NaN",
                &terms[t * 3..t * 3 + 3]
            ));
        }
        for c in 0..hs {
            let i = t * hs + c;
            if dx[i] != 0.0 {
                return Err(format!("flagged row {t}: dx[{t}][{c}] = {}, want 0", dx[i]));
            }
            if acc_dx[i].to_bits() != fill[i].to_bits() {
                return Err(format!(
                    "flagged row {t}: accumulated dx[{t}][{c}] = {}, want {} (nothing added)",
                    acc_dx[i], fill[i]
                ));
            }
        }
    }
    if let Some(t) = (0..ntok).find(|&t| acc_loss[t].to_bits() != loss[t].to_bits()) {
        return Err(format!(
            "row {t}: loss with the filter {} differs from the first call's {}",
            acc_loss[t], loss[t]
        ));
    }
    let differs = |what: &str, t: usize, got: &[f32], want: &[f32]| -> Result<(), String> {
        if got.iter().map(|v| v.to_bits()).eq(want.iter().map(|v| v.to_bits())) {
            Ok(())
        } else {
            Err(format!(
                "row {t} (not flagged): {what} {got:?} differs from the clean twin's {want:?}"
            ))
        }
    };
    for &t in &same {
        differs("loss", t, &loss[t..=t], &want_loss[t..=t])?;
        differs("terms", t, &terms[t * 3..t * 3 + 3], &want_terms[t * 3..t * 3 + 3])?;
        differs("dx", t, &dx[t * hs..(t + 1) * hs], &want_dx[t * hs..(t + 1) * hs])?;
    }
    if !same.is_empty() {
        let rows = |v: &[f32]| -> Vec<f32> { same.iter().flat_map(|&t| v[t * hs..(t + 1) * hs].to_vec()).collect() };
        let added: Vec<f32> = rows(&acc_dx).iter().zip(rows(&fill)).map(|(a, f)| a - f).collect();
        let want: Vec<f64> = rows(&want_dx).iter().map(|&v| f64::from(v)).collect();
        Tolerance::default()
            .check_dx_rows(&added, &want, Some(hs))
            .map_err(|e| format!("accumulated and filtered, the rows not flagged: {e}"))?;
    }
    Ok(())
}

fn error_case(name: &str) -> Result<ErrorCase, String> {
    let mut case = error_base();
    let k = case.k;
    let v = case.vocab as u32;
    // What the clean twin shares: the job, the teacher's form and tail mode,
    // the terms and the labels.
    match name {
        "topk_nan_hidden" => case.kind = CaseKind::Topk,
        "logprob_positive" | "logprob_nan" => {
            // Each row a share of the vocabulary.
            normalize_rows(&mut case, 0.5);
            case.teacher_form = TeacherForm::Logprobs;
            case.tail = TailMode::Bucket;
        }
        "mass_above_one" => {
            normalize_rows(&mut case, 0.8);
            case.tail = TailMode::Bucket;
        }
        "label_out_of_range" => {
            case.terms.hard_weight = 0.5;
            let mut labels: Vec<i64> = (0..case.ntok as i64).map(|t| t * 7 % 300).collect();
            labels[4] = -1;
            case.labels = Some(labels);
        }
        _ => {}
    }
    let mut clean = case.clone();
    let mut checked = false;
    match name {
        "id_out_of_range" => case.teacher_ids[21 * k + 2] = v + 5,
        "id_is_vocab" => case.teacher_ids[14 * k] = v,
        "id_minus_one" => case.teacher_ids[22 * k + 1] = u32::MAX,
        "row_of_huge_ids" => case.teacher_ids[37 * k..38 * k].fill(u32::MAX),
        "duplicate_id" => case.teacher_ids[33 * k + 3] = case.teacher_ids[33 * k + 1],
        "negative_prob" => case.teacher_probs[17 * k + 3] = -0.5,
        "nan_prob" => case.teacher_probs[2 * k] = f32::NAN,
        "inf_prob" => case.teacher_probs[39 * k + 1] = f32::INFINITY,
        "zero_row" => case.teacher_probs[5 * k..6 * k].fill(0.0),
        // The twin masks the token: the same total and gscale.
        "negative_weight" => {
            set_weight(&mut case, 30, -1.0);
            set_weight(&mut clean, 30, 0.0);
        }
        "nan_weight" => {
            set_weight(&mut case, 8, f32::NAN);
            set_weight(&mut clean, 8, 0.0);
        }
        "all_masked" => case.weights = Some(vec![0.0; case.ntok]),
        "nan_hidden" => case.hidden[25 * case.hs + 3] = f32::NAN,
        "first_of_two" => {
            case.teacher_ids[30 * k] = v;
            case.teacher_probs[3 * k + 1] = -1.0;
        }
        "topk_nan_hidden" => case.hidden[19 * case.hs] = f32::INFINITY,
        "checked_mode" => {
            case.teacher_ids[12 * k + 1] = v + 100;
            checked = true;
        }
        // ln(e^0.5) = 0.5 and ln(NaN) = NaN once the case takes logs: no
        // log-probability.
        "logprob_positive" => case.teacher_probs[12 * k + 1] = 0.5f32.exp(),
        "logprob_nan" => case.teacher_probs[3 * k] = f32::NAN,
        "mass_above_one" => case.teacher_probs[9 * k..10 * k]
            .iter_mut()
            .for_each(|p| *p *= 1.25 / 0.8),
        "label_out_of_range" => {
            if let Some(labels) = case.labels.as_mut() {
                labels[27] = i64::from(v) + 3;
            }
        }
        other => return Err(format!("unknown resident error case {other}")),
    }
    Ok(ErrorCase {
        bad: case,
        clean,
        checked,
    })
}

/// Scales every teacher row to hold `mass` of the probability.
fn normalize_rows(case: &mut Case, mass: f32) {
    for row in case.teacher_probs.chunks_exact_mut(case.k) {
        let sum: f32 = row.iter().sum();
        row.iter_mut().for_each(|p| *p *= mass / sum);
    }
}

fn set_weight(case: &mut Case, t: usize, value: f32) {
    if let Some(w) = case.weights.as_mut() {
        w[t] = value;
    }
}

fn check_error_case<B: ResidentBackend + ?Sized>(backend: &B, name: &str) -> Result<CaseErrors, String> {
    let ec = error_case(name)?;
    let want = host_error(backend, &ec.bad)?;
    let got = resident_error(backend, &ec)?;
    // The device sums a row's mass in f32: the same error up to that rounding.
    if let (
        Error::TeacherMassAboveOne { row, sum, tail, .. },
        Error::TeacherMassAboveOne {
            row: want_row,
            sum: want_sum,
            tail: want_tail,
            ..
        },
    ) = (&got, &want)
    {
        if row == want_row && tail == want_tail && (sum - want_sum).abs() <= 1e-5 * want_sum {
            return Ok(CaseErrors::default());
        }
    }
    // Compared as text: a NaN value in an error is never equal to itself.
    if format!("{got:?}") != format!("{want:?}") {
        return Err(format!("resident path: {got:?}\n    host path:     {want:?}"));
    }
    Ok(CaseErrors::default())
}

/// The regression cases ([`super::cases`]) the resident path runs too:
/// every loss-term and reduction case, and these, over chunks and slices.
const RESIDENT_ALSO: &[&str] = &[
    "logit_scale_chunks_topk",
    "divergence_reverse_bucket_logprobs_chunks_head_kl",
    "divergence_jsd_bucket_everything_slices_head_kl",
    "divergence_reverse_renormalize_head_kl",
];

/// [`RESIDENT_ALSO`] and every `terms_…` and `reduction_…` regression
/// case, in the regression order.
pub(crate) fn resident_term_cases() -> impl Iterator<Item = &'static str> {
    super::cases::regression_names()
        .iter()
        .copied()
        .filter(|name| name.starts_with("terms_") || name.starts_with("reduction_") || RESIDENT_ALSO.contains(name))
}

/// Cases [`run_resident`] runs for `cfg`.
pub fn resident_case_count(cfg: &SuiteConfig) -> usize {
    cfg.cases + resident_term_cases().count() + 4 + RESIDENT_ERROR_CASES.len()
}

/// `loss_out` dispatched directly on a chunk of four rows: good, flagged
/// (its loss word [`FLAGGED_ROW`]'s bits) with a finite lse, flagged with
/// a NaN lse (bad logits too), good. A flagged row's loss and terms come
/// out NaN, the good rows' as the chunk holds them; the status names as
/// non-finite logits only the row whose lse is NaN: over the first two
/// rows it names none.
fn check_loss_out_flags<B: ResidentBackend + ?Sized>(backend: &B) -> Result<CaseErrors, String> {
    let marker = f32::from_bits(FLAGGED_ROW);
    let nan = f32::NAN;
    #[rustfmt::skip]
    let chunk: [f32; 16] = [
        1.5, 2.0, 1.5, 0.0,
        marker, 3.0, 0.25, 0.5,
        marker, nan, nan, nan,
        2.5, 1.0, 2.5, 0.0,
    ];
    let flagged = [false, true, true, false];
    let (hs, ld, token0) = (8usize, 16usize, 5usize);
    let ntok = token0 + 4;
    let dx_chunk: Vec<f32> = (0..4 * ld).map(|i| i as f32 * 0.5).collect();
    for (rows, want_logits) in [(2usize, NONE), (4, token0 as u32 + 2)] {
        let mut words = status::cleared();
        words[S_DX_MUL] = 1f32.to_bits();
        let status_buf = device_buffer(backend, bytemuck::cast_slice(&words), "status")?;
        let loss_chunk = device_buffer(backend, bytemuck::cast_slice(&chunk), "loss chunk")?;
        let dx_chunk_buf = device_buffer(backend, bytemuck::cast_slice(&dx_chunk), "dx chunk")?;
        let loss = device_buffer(backend, &nan_bytes(ntok), "loss")?;
        let dx = device_buffer(backend, &nan_bytes(ntok * hs), "dx")?;
        let terms = device_buffer(backend, &nan_bytes(ntok * 3), "terms")?;
        backend
            .dispatch(Launch::LossOut {
                loss_chunk: &loss_chunk,
                dx_chunk: &dx_chunk_buf,
                status: &status_buf,
                loss: &loss,
                dx: &dx,
                terms: &terms,
                desc: LossOutDesc {
                    rows,
                    hs,
                    ld,
                    token0,
                    loss_offset: token0,
                    dx_offset: token0 * hs,
                    accumulate: false,
                    write_terms: true,
                },
            })
            .map_err(|e| format!("loss_out: {e}"))?;
        backend.submit().map_err(|e| format!("submit: {e}"))?;
        backend.finish().map_err(|e| format!("finish: {e}"))?;
        let mut got = [0u32; status::WORDS];
        backend
            .download(&status_buf, 0, bytemuck::cast_slice_mut(&mut got))
            .map_err(|e| format!("download: {e}"))?;
        if got[S_LOGITS] != want_logits {
            return Err(format!(
                "{rows} rows: status S_LOGITS = {:#x}, want {want_logits:#x} (a flagged row is bad logits only with a NaN lse)",
                got[S_LOGITS]
            ));
        }
        let (got_loss, got_terms) = (
            download_f32(backend, &loss, ntok)?,
            download_f32(backend, &terms, ntok * 3)?,
        );
        for r in 0..rows {
            let t = token0 + r;
            let (l, tr) = (got_loss[t], &got_terms[t * 3..t * 3 + 3]);
            let ok = if flagged[r] {
                l.is_nan() && tr.iter().all(|v| v.is_nan())
            } else {
                l.to_bits() == chunk[r * 4].to_bits()
                    && tr
                        .iter()
                        .zip(&chunk[r * 4 + 1..r * 4 + 4])
                        .all(|(a, b)| a.to_bits() == b.to_bits())
            };
            if !ok {
                return Err(format!(
                    "{rows} rows: row {r} (flagged {}): loss {l}, terms {tr:?}; the chunk holds {:?}",
                    flagged[r],
                    &chunk[r * 4..r * 4 + 4]
                ));
            }
        }
    }
    Ok(CaseErrors::default())
}

/// The block filter on the resident path (`LossConfig::filter_eps` in `DeviceLossOptions`)
/// on lm-like data.
fn check_resident_filter<B: ResidentBackend + ?Sized>(backend: &B, tol: &Tolerance) -> Result<CaseErrors, String> {
    let case = super::cases::lm_case(80, Some(1536), Some(48))?;
    let mut engine = engine_for(backend, &case)?;
    let (ntok, hs) = (case.ntok, case.hs);
    let rows = DeviceRows::upload(backend, &case, HiddenDtype::F32)?;
    let hidden = rows.hidden();
    let bufs = HeadKlBuffers::upload(backend, &case)?;
    let eps = headkl_core::problem::filter::AUTO_EPS;
    let mut run = |filter_eps| -> Result<(Vec<f32>, Vec<f32>), String> {
        let opts = bufs.options_with(&case, |c| c.filter_eps = filter_eps);
        engine
            .head_kl_device(ntok, &hidden, &bufs.teacher(case.k), &bufs.output(), &opts)
            .map_err(|e| format!("head_kl_device: {e}"))?;
        engine.wait_device().map_err(|e| format!("wait_device: {e}"))?;
        Ok((
            download_f32(backend, &bufs.loss, ntok)?,
            download_f32(backend, &bufs.dx, ntok * hs)?,
        ))
    };
    let (loss0, _) = run(None)?;
    let (got_loss, got_dx) = run(Some(eps))?;
    if got_loss
        .iter()
        .map(|v| v.to_bits())
        .ne(loss0.iter().map(|v| v.to_bits()))
    {
        return Err("the loss with the filter differs from the unfiltered resident call's".into());
    }
    let head = case.head_weights().map_err(|e| format!("case head: {e}"))?;
    let host_hidden = Hidden::f32(&rows.values, ntok, hs).map_err(|e| format!("hidden: {e}"))?;
    let teacher = case.teacher().map_err(|e| format!("case teacher: {e}"))?;
    let host_opts = headkl_core::LossOptions {
        config: headkl_core::LossConfig {
            filter_eps: Some(eps),
            ..case.loss_options().config
        },
        ..case.loss_options()
    };
    let resolved = host_opts.resolve(ntok).map_err(|e| format!("case options: {e}"))?;
    let want = direct::head_kl_f64(&head, &host_hidden, &teacher, &resolved);
    let mean = got_loss.iter().map(|&l| f64::from(l)).sum::<f64>() / f64::from(resolved.total);
    let (loss_err, dx_err) = check_vs_reference(tol, (&got_loss, mean), &got_dx, &want, hs)?;
    check_vs_host_path(&mut engine, &host_hidden, &teacher, &host_opts, &got_dx, hs, tol)?;
    // An engine with a vocabulary order refuses the resident entry points
    // (their ids in device buffers are not mapped), before any work.
    let reversed = headkl_core::VocabOrder::new((0..case.vocab as u32).rev().collect()).map_err(|e| e.to_string())?;
    let mut ordered = headkl_core::Engine::with_vocab_order(backend, &head, case.slice_options(), Some(reversed))
        .map_err(|e| format!("Engine::with_vocab_order: {e}"))?;
    match ordered.head_kl_device(
        ntok,
        &hidden,
        &bufs.teacher(case.k),
        &bufs.output(),
        &bufs.options(&case),
    ) {
        Err(headkl_core::Error::VocabOrderUnsupported { .. }) => {}
        other => {
            return Err(format!(
                "head_kl_device with a vocabulary order: {other:?}, want VocabOrderUnsupported"
            ))
        }
    }
    Ok(CaseErrors {
        loss: Some(loss_err),
        dx: Some(dx_err),
        ..CaseErrors::default()
    })
}

/// The head's gradient asked of the resident loss: refused with
/// [`Error::HeadGradUnsupported`] before anything is recorded (the
/// outputs keep their NaN), and the same call without it then matches the
/// host path.
fn check_resident_head_grad_refused<B: ResidentBackend + ?Sized>(
    backend: &B,
    tol: &Tolerance,
) -> Result<CaseErrors, String> {
    let case = error_base();
    let mut engine = engine_for(backend, &case)?;
    let (ntok, hs) = (case.ntok, case.hs);
    let rows = DeviceRows::upload(backend, &case, HiddenDtype::F32)?;
    let hidden = rows.hidden();
    let bufs = HeadKlBuffers::upload(backend, &case)?;
    let asked = bufs.options_with(&case, |c| c.head_grad = true);
    match engine.head_kl_device(ntok, &hidden, &bufs.teacher(case.k), &bufs.output(), &asked) {
        Err(Error::HeadGradUnsupported { .. }) => {}
        Err(other) => {
            return Err(format!(
                "head_kl_device with head_grad: {other}, want HeadGradUnsupported"
            ))
        }
        Ok(()) => return Err("head_kl_device with head_grad: accepted, want HeadGradUnsupported".into()),
    }
    engine
        .wait_device()
        .map_err(|e| format!("wait_device after the refusal: {e}"))?;
    let untouched = download_f32(backend, &bufs.loss, ntok)?;
    if let Some(t) = untouched.iter().position(|v| !v.is_nan()) {
        return Err(format!("the refused call wrote loss[{t}] = {}", untouched[t]));
    }
    engine
        .head_kl_device(
            ntok,
            &hidden,
            &bufs.teacher(case.k),
            &bufs.output(),
            &bufs.options(&case),
        )
        .map_err(|e| format!("head_kl_device after the refusal: {e}"))?;
    engine.wait_device().map_err(|e| format!("wait_device: {e}"))?;
    let got_dx = download_f32(backend, &bufs.dx, ntok * hs)?;
    let host_hidden = Hidden::f32(&rows.values, ntok, hs).map_err(|e| format!("hidden: {e}"))?;
    let teacher = case.teacher().map_err(|e| format!("case teacher: {e}"))?;
    let (host, _) = check_vs_host_path(
        &mut engine,
        &host_hidden,
        &teacher,
        &case.loss_options(),
        &got_dx,
        hs,
        tol,
    )?;
    check_close_to_host("loss", &download_f32(backend, &bufs.loss, ntok)?, &host.loss, 1)?;
    Ok(CaseErrors::default())
}

/// The head's gradient from the device-resident loss (several slices and
/// chunks, per-token weights, f32, bf16 and f16 rows in turn): written
/// into a NaN-poisoned `[V][hs]` buffer, it is within the tolerance of the
/// f64 reference and of the host path's, a second call overwrites it with
/// the same bits, the loss is the call's without it, bit for bit, and dx
/// within the dx tolerance of that call's (where dx waits for one GEMM
/// over every token, its rounding differs from the chunks' GEMMs').
/// At V 300, hs 24 the rows and the vocabulary are padded, so the gradient
/// is built in pieces of the engine's own; at V 304, where the backend
/// can ([`ResidentBackend::defers_head_grad`]), in the caller's buffer
/// itself: at hs 32 the rows' tail would be past the scratch, so each
/// chunk's gradient is copied there in a block per part (three parts); at
/// hs 64 `kl_rows` parks the 40 tokens' gradient rows there, and the head's
/// gradient and dx of the first 32 tokens wait for the last chunk (two
/// parts, the last read from the scratch; a GEMM a vocabulary slice); at
/// hs 16 nothing fits (a GEMM per chunk). All read their alpha from the
/// device.
fn check_resident_head_grad<B: ResidentBackend + ?Sized>(backend: &B, tol: &Tolerance) -> Result<CaseErrors, String> {
    let mut worst = CaseErrors::default();
    for (vocab, hs) in [(300, 24), (304, 32), (304, 64), (304, 16)] {
        let errors = check_resident_head_grad_at(backend, &resident_base(vocab, hs), ALL_DTYPES, tol)
            .map_err(|e| format!("V {vocab}, hs {hs}: {e}"))?;
        worst.head_grad = match (worst.head_grad, errors.head_grad) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
    Ok(worst)
}

/// The hidden rows' types [`check_resident_head_grad`] runs in turn.
const ALL_DTYPES: &[HiddenDtype] = &[HiddenDtype::F32, HiddenDtype::Bf16, HiddenDtype::F16];

/// [`check_resident_head_grad`] on one case, on rows of each of `dtypes`.
fn check_resident_head_grad_at<B: ResidentBackend + ?Sized>(
    backend: &B,
    case: &Case,
    dtypes: &[HiddenDtype],
    tol: &Tolerance,
) -> Result<CaseErrors, String> {
    let mut engine = engine_for(backend, case)?;
    let (ntok, hs, vocab) = (case.ntok, case.hs, case.vocab);
    let head = case.head_weights().map_err(|e| format!("case head: {e}"))?;
    let teacher = case.teacher().map_err(|e| format!("case teacher: {e}"))?;
    let resolved = case
        .loss_options()
        .resolve(ntok)
        .map_err(|e| format!("case options: {e}"))?;
    let bufs = HeadKlBuffers::upload(backend, case)?;
    let poison = vec![f32::NAN; vocab * hs];
    let dw = device_buffer(backend, bytemuck::cast_slice(&poison), "head_grad_out")?;
    let mut worst = CaseErrors::default();
    for &dtype in dtypes {
        let rows = DeviceRows::upload(backend, case, dtype)?;
        let hidden = rows.hidden();
        let mut run = |with_grad: bool| -> Result<(Vec<f32>, Vec<f32>), String> {
            let opts = DeviceLossOptions {
                head_grad_out: with_grad.then_some(&dw),
                ..bufs.options_with(case, |c| c.head_grad = with_grad)
            };
            engine
                .head_kl_device(ntok, &hidden, &bufs.teacher(case.k), &bufs.output(), &opts)
                .map_err(|e| format!("{dtype:?}: head_kl_device (head_grad {with_grad}): {e}"))?;
            engine
                .wait_device()
                .map_err(|e| format!("{dtype:?}: wait_device: {e}"))?;
            let loss = download_f32(backend, &bufs.loss, ntok)?;
            let dx = download_f32(backend, &bufs.dx, ntok * hs)?;
            Ok((loss, dx))
        };
        let plain = run(false)?;
        let with = run(true)?;
        if with
            .0
            .iter()
            .map(|v| v.to_bits())
            .ne(plain.0.iter().map(|v| v.to_bits()))
        {
            return Err(format!("{dtype:?}: the loss changed with the head's gradient"));
        }
        let plain_dx: Vec<f64> = plain.1.iter().map(|&v| f64::from(v)).collect();
        tol.check_dx_rows(&with.1, &plain_dx, Some(hs))
            .map_err(|m| format!("{dtype:?}: dx with the head's gradient against dx without: {m}"))?;
        let got = download_f32(backend, &dw, vocab * hs)?;
        run(true)?;
        if download_f32(backend, &dw, vocab * hs)?
            .iter()
            .map(|v| v.to_bits())
            .ne(got.iter().map(|v| v.to_bits()))
        {
            return Err(format!("{dtype:?}: a second call gave another head gradient"));
        }
        let host_hidden = Hidden::f32(&rows.values, ntok, hs).map_err(|e| format!("hidden: {e}"))?;
        let (_, want) = direct::head_kl_and_head_grad_f64(&head, &host_hidden, &teacher, &resolved);
        let err = tol
            .check_head_grad(&got, &want, hs)
            .map_err(|m| format!("{dtype:?}: against the f64 reference: {m}"))?;
        let host_opts = LossOptions {
            config: LossConfig {
                head_grad: true,
                ..case.loss_options().config
            },
            ..case.loss_options()
        };
        let host = engine
            .head_kl(&host_hidden, &teacher, &host_opts)
            .map_err(|e| format!("{dtype:?}: host head_kl: {e}"))?;
        let host_dw: Vec<f64> = host.head_grad.iter().map(|&v| f64::from(v)).collect();
        tol.check_head_grad(&got, &host_dw, hs)
            .map_err(|m| format!("{dtype:?}: against the host path: {m}"))?;
        worst.head_grad = Some(worst.head_grad.map_or(err, |w: f64| w.max(err)));
    }
    Ok(worst)
}

/// Runs the resident cases (`cfg.cases` drawn ones) and the resident error
/// cases on `backend`.
pub fn run_resident<B: ResidentBackend + ?Sized>(
    backend: &B,
    cfg: &SuiteConfig,
    progress: &mut dyn FnMut(&CaseOutcome),
) -> SuiteReport {
    let mut rec = Recorder::new(backend.info(), progress);
    let tol = Tolerance::default();
    for index in 0..cfg.cases {
        let outcome = match driver_case(cfg.seed, index) {
            Ok(case) => {
                let dtype = dtype_for(&case, index);
                let split = split_for(index);
                let name = format!("resident#{index} {} x={dtype:?} dx_split={split}", case.name);
                run_one(backend, name, case.describe(), cfg.seed, || {
                    check_resident_case(backend, &case, (dtype, split), &tol)
                })
            }
            Err(message) => CaseOutcome::unbuilt(format!("resident#{index}"), cfg.seed, message),
        };
        rec.push(outcome);
    }
    for (i, name) in resident_term_cases().enumerate() {
        let outcome = match super::cases::regression(name) {
            Ok(r) => {
                let case = r.case;
                // f32, f16 and bf16 rows in turn.
                let dtype = [HiddenDtype::F32, HiddenDtype::Bf16, HiddenDtype::F16][i % 3];
                run_one(backend, format!("resident_terms/{name}"), case.describe(), 0, || {
                    check_resident_case(backend, &case, (dtype, DxSplit::Auto), &tol)
                })
            }
            Err(message) => CaseOutcome::unbuilt(format!("resident_terms/{name}"), 0, message),
        };
        rec.push(outcome);
    }
    let what = "lm-like data (V=4096, hs=32, 80 tokens, 3 slices, chunks of 48), the dx block filter at \
                ε = 2^-15: the loss bit-identical to the unfiltered resident call's, dx within the dx tolerance \
                of the f64 reference and of the host path with the filter; an engine with a vocabulary order \
                refuses the resident call";
    rec.push(run_one(backend, "resident_filter/lm".into(), what.into(), 0, || {
        check_resident_filter(backend, &tol)
    }));
    let what = "loss_out on rows flagged by their loss word (FLAGGED_ROW): NaN loss and terms, and non-finite \
                logits in the status only where the lse is NaN too";
    rec.push(run_one(
        backend,
        "resident_flagged/loss_out".into(),
        what.into(),
        0,
        || check_loss_out_flags(backend),
    ));
    let what = "LossConfig::head_grad with the device-resident loss: head_kl_device refuses it \
                (HeadGradUnsupported) before any work (its outputs untouched), and the engine then runs the \
                call without it against the host path";
    rec.push(run_one(
        backend,
        "resident_head_grad/refused".into(),
        what.into(),
        0,
        || check_resident_head_grad_refused(backend, &tol),
    ));
    let what = "the head's gradient from head_kl_device (DeviceLossOptions::head_grad_out) on f32, bf16 and f16 \
                rows, 3 slices, chunks of 16, weighted: against the f64 reference and the host path, the same \
                bits on a second call, loss and dx as without it";
    rec.push(run_one(
        backend,
        "resident_head_grad/matches".into(),
        what.into(),
        0,
        || check_resident_head_grad(backend, &tol),
    ));
    for &(name, what) in RESIDENT_ERROR_CASES {
        let outcome = run_one(backend, format!("resident_errors/{name}"), what.to_string(), 0, || {
            check_error_case(backend, name)
        });
        rec.push(outcome);
    }
    rec.report
}

/// The suite's `resident_head_grad/matches` on a backend whose largest
/// binding is smaller than the case's `[V][hs]` f32 gradient and whose
/// largest buffer is not: the resident call then writes the gradient
/// through windows of the caller's buffer
/// ([`headkl_core::toolkit::ResidentBackend::window`]) or fails. An error
/// where the gradient fits one binding (the windows would go untested).
pub fn check_head_grad_through_windows<B: ResidentBackend + ?Sized>(backend: &B) -> Result<(), String> {
    let case = error_base();
    let bytes = (case.vocab * case.hs * std::mem::size_of::<f32>()) as u64;
    let info = backend.info();
    if bytes <= info.max_binding_bytes || bytes > info.max_buffer_bytes {
        return Err(format!(
            "the case's gradient ({bytes} bytes) must be past one binding ({} bytes) and within one buffer ({} bytes)",
            info.max_binding_bytes, info.max_buffer_bytes
        ));
    }
    check_resident_head_grad(backend, &Tolerance::default()).map(|_| ())
}

/// `resident_head_grad/matches` at the backend's own largest binding: a
/// head of hs 2048 whose f32 gradient is about 3% past that binding (two
/// windows of the caller's buffer) while the f16 head stays within one,
/// 40 tokens of f32 rows in chunks of 16, against the f64 reference and
/// the host path. Where that gradient would be past `max_grad_bytes` (a
/// GPU's binding is GiBs; the case is for a CPU device's), `Ok` with the
/// reason it was not run, which the caller prints; `Ok(None)` where it ran
/// and passed.
pub fn check_head_grad_past_the_binding<B: ResidentBackend + ?Sized>(
    backend: &B,
    max_grad_bytes: u64,
) -> Result<Option<String>, String> {
    let info = backend.info();
    let hs = 2048;
    let row_bytes = (hs * std::mem::size_of::<f32>()) as u64;
    let vocab = ((info.max_binding_bytes * 103 / 100).div_ceil(row_bytes) as usize).next_multiple_of(ALIGN);
    let bytes = vocab as u64 * row_bytes;
    if bytes > max_grad_bytes || bytes > info.max_buffer_bytes {
        return Ok(Some(format!(
            "a head past the {}-byte binding needs a {bytes}-byte gradient, past {} bytes",
            info.max_binding_bytes,
            max_grad_bytes.min(info.max_buffer_bytes)
        )));
    }
    let mut case = Case::from_params(&CaseParams {
        profile: "resident-past-binding",
        max_rows_per_chunk: Some(16),
        ..super::cases::params(CaseKind::HeadKl, vocab, hs, 40, 4, 78)
    });
    case.weights = Some((0..case.ntok).map(|t| 0.5 + (t % 3) as f32).collect());
    check_resident_head_grad_at(backend, &case, &[HiddenDtype::F32], &Tolerance::default())
        .map(|_| None)
        .map_err(|e| format!("V {vocab}, hs {hs}: {e}"))
}

/// The test body of [`check_head_grad_past_the_binding`] on a GPU
/// backend's tests (within 1 GiB of host memory): panics on a failure,
/// prints why where it did not run.
pub fn test_head_grad_past_the_binding<B: ResidentBackend + ?Sized>(backend: &B) {
    match check_head_grad_past_the_binding(backend, 1 << 30) {
        Ok(None) => {}
        Ok(Some(reason)) => eprintln!("SKIPPED: {reason}"),
        Err(e) => panic!("{e}"),
    }
}

/// The body of the test [`crate::resident_conformance_tests!`] generates.
pub fn run_resident_test<B: ResidentBackend>(backend_name: &str, open: impl FnOnce() -> headkl_core::Result<B>) {
    let cfg = SuiteConfig::default();
    let name = "resident";
    let Some(report) = super::harness::run_recorded(backend_name, open, name, name, |backend, progress| {
        run_resident(backend, &cfg, progress)
    }) else {
        return;
    };
    let failures: Vec<String> = report
        .failures
        .iter()
        .map(|f| format!("- {}: {}\n    {}", f.name, f.description, f.message))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} resident cases failed on {} (HEADKL_SEED={:#x} HEADKL_CASES={}):\n{}",
        failures.len(),
        report.cases,
        report.backend,
        cfg.seed,
        cfg.cases,
        failures.join("\n")
    );
    assert!(report.cases >= RESIDENT_ERROR_CASES.len(), "no resident cases ran");
}

/// Instantiates the resident conformance cases as one `#[test]`
/// (`conformance_resident`) for a backend implementing
/// [`headkl_core::ResidentBackend`].
///
/// ```text
/// headkl_conformance::resident_conformance_tests!("wgpu", headkl_wgpu::WgpuBackend::open(None));
/// ```
#[macro_export]
macro_rules! resident_conformance_tests {
    ($name:literal, $open:expr $(,)?) => {
        #[test]
        fn conformance_resident() {
            $crate::resident::run_resident_test($name, || $open);
        }
    };
}
