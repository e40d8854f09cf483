//! The provenance records: how a headkl output file was made, kept in its
//! safetensors `__metadata__`, and the checks `loss` makes of a teacher
//! file against its own run.
//!
//! `topk` records the temperature, k, V, hs, whether the probabilities are
//! renormalized over the k, the softcap, and which head it used (file,
//! tensor and a hash of the tensor's bytes). `loss` reads that back and
//! refuses a teacher made at another temperature, over another vocabulary
//! or from another head (exit 2, both values named) unless
//! `--allow-teacher-mismatch`; a file without the metadata (made elsewhere)
//! is used as it is, with a note. `loss` records its mean and options in
//! its own output the same way.
//!
//! Keys are `headkl.*`; every value is a string (safetensors' rule).
//! [`FORMAT_VERSION`] changes when a key's meaning does.

use headkl_core::{LossTerms, TailMode, TeacherForm};
use std::collections::HashMap;
use std::path::Path;

use crate::error::FilesError;

/// The metadata format this build writes and reads.
pub const FORMAT_VERSION: &str = "1";

/// The key every headkl file carries; its value is [`FORMAT_VERSION`].
const FORMAT: &str = "headkl.format";

/// The flag that accepts a teacher file whose metadata does not match.
pub const ALLOW_MISMATCH_FLAG: &str = "--allow-teacher-mismatch";

/// Name of the head hash's function, stored in front of its value.
const HASH_NAME: &str = "fold64";

/// A 64-bit non-cryptographic hash of `bytes`: four lanes of 8-byte
/// little-endian words, each multiplied and rotated, folded with the
/// length at the end. It reads every byte (several GB/s, about the speed
/// the head is read for its upload anyway) and is the same on every
/// platform and build; it tells heads apart, it does not resist a forgery.
pub fn fold64(bytes: &[u8]) -> u64 {
    const P1: u64 = 0x9E37_79B1_85EB_CA87;
    const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    let word = |b: &[u8]| {
        let mut w = [0u8; 8];
        w[..b.len()].copy_from_slice(b);
        u64::from_le_bytes(w)
    };
    let mix = |lane: u64, w: u64| (lane ^ w.wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1);
    let mut lanes = [P1, P2, P1 ^ P2, P1.wrapping_add(P2)];
    let mut blocks = bytes.chunks_exact(32);
    for block in &mut blocks {
        for (i, lane) in lanes.iter_mut().enumerate() {
            *lane = mix(*lane, word(&block[i * 8..i * 8 + 8]));
        }
    }
    for (i, tail) in blocks.remainder().chunks(8).enumerate() {
        lanes[i] = mix(lanes[i], word(tail));
    }
    let mut h = bytes.len() as u64;
    for lane in lanes {
        h = (h ^ lane.wrapping_mul(P2)).rotate_left(27).wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P1);
    h ^ (h >> 32)
}

/// Which head a file was made from.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadIdentity {
    /// The head's file, as it was named on the command line.
    pub file: String,
    /// The tensor in it.
    pub tensor: String,
    /// `fold64:<16 hex digits>` of the tensor's bytes (dtype as stored).
    pub hash: String,
}

impl HeadIdentity {
    /// The identity of tensor `tensor` of `file`, whose bytes are `bytes`.
    pub fn of(file: &Path, tensor: &str, bytes: &[u8]) -> Self {
        Self {
            file: file.display().to_string(),
            tensor: tensor.to_string(),
            hash: format!("{HASH_NAME}:{:016x}", fold64(bytes)),
        }
    }

    fn describe(&self) -> String {
        format!("{} `{}` ({})", self.file, self.tensor, self.hash)
    }

    fn write(&self, m: &mut HashMap<String, String>) {
        m.insert("headkl.head.file".into(), self.file.clone());
        m.insert("headkl.head.tensor".into(), self.tensor.clone());
        m.insert("headkl.head.hash".into(), self.hash.clone());
    }
}

/// What `topk` records about a teacher file.
#[derive(Clone, Debug, PartialEq)]
pub struct TeacherRecord {
    /// Temperature τ of the probabilities.
    pub temperature: f32,
    /// Entries per row.
    pub k: usize,
    /// Vocabulary size of the head.
    pub vocab: usize,
    /// Hidden size.
    pub hs: usize,
    /// Tokens.
    pub ntok: usize,
    /// Whether `probs` are renormalized over the k (sum to 1 per row).
    pub renormalized: bool,
    /// The logit softcap the logits were capped with, if any (`None`: no
    /// softcap; recorded as `none`).
    pub softcap: Option<f32>,
    /// The logit scale S the logits were made with (`z = S·x·Wᵀ`; a file
    /// without the key was made at 1). The teacher's own: a student's
    /// `--logit-scale` need not match it.
    pub logit_scale: f32,
    /// The head.
    pub head: HeadIdentity,
}

/// A record's metadata, begun: the format version and the `command` (with
/// this build's version) that made the file.
fn metadata_made_by(command: &str) -> HashMap<String, String> {
    let mut m = HashMap::new();
    m.insert(FORMAT.into(), FORMAT_VERSION.into());
    m.insert(
        "headkl.made_by".into(),
        // The workspace's version, which every headkl crate shares.
        format!("headkl {command} {}", env!("CARGO_PKG_VERSION")),
    );
    m
}

fn fmt_softcap(softcap: Option<f32>) -> String {
    softcap.map_or_else(|| "none".to_string(), |c| c.to_string())
}

impl TeacherRecord {
    /// The record as safetensors metadata.
    pub fn to_metadata(&self) -> HashMap<String, String> {
        let mut m = metadata_made_by("topk");
        m.insert("headkl.temperature".into(), self.temperature.to_string());
        m.insert("headkl.k".into(), self.k.to_string());
        m.insert("headkl.vocab".into(), self.vocab.to_string());
        m.insert("headkl.hs".into(), self.hs.to_string());
        m.insert("headkl.ntok".into(), self.ntok.to_string());
        m.insert("headkl.renormalized".into(), self.renormalized.to_string());
        m.insert("headkl.softcap".into(), fmt_softcap(self.softcap));
        m.insert("headkl.logit_scale".into(), self.logit_scale.to_string());
        self.head.write(&mut m);
        m
    }

    /// Reads a record back: `Ok(None)` for a file with no headkl metadata,
    /// an error naming the key for one that is there but unreadable.
    pub fn from_metadata(m: Option<&HashMap<String, String>>) -> Result<Option<Self>, String> {
        let Some(m) = m.filter(|m| m.contains_key(FORMAT)) else {
            return Ok(None);
        };
        let get = |key: &str| {
            m.get(key)
                .map(String::as_str)
                .ok_or_else(|| format!("metadata key `{key}` is missing"))
        };
        fn parse<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, String> {
            value
                .parse()
                .map_err(|_| format!("metadata `{key}` = `{value}` does not parse"))
        }
        let format = get(FORMAT)?;
        if format != FORMAT_VERSION {
            return Err(format!(
                "metadata format {format}, but this headkl reads format {FORMAT_VERSION}"
            ));
        }
        let softcap = match get("headkl.softcap") {
            Err(_) | Ok("none") => None,
            Ok(v) => Some(parse("headkl.softcap", v)?),
        };
        let logit_scale = match get("headkl.logit_scale") {
            Err(_) => 1.0,
            Ok(v) => parse("headkl.logit_scale", v)?,
        };
        Ok(Some(Self {
            temperature: parse("headkl.temperature", get("headkl.temperature")?)?,
            k: parse("headkl.k", get("headkl.k")?)?,
            vocab: parse("headkl.vocab", get("headkl.vocab")?)?,
            hs: parse("headkl.hs", get("headkl.hs")?)?,
            ntok: parse("headkl.ntok", get("headkl.ntok")?)?,
            renormalized: parse("headkl.renormalized", get("headkl.renormalized")?)?,
            softcap,
            logit_scale,
            head: HeadIdentity {
                file: get("headkl.head.file")?.to_string(),
                tensor: get("headkl.head.tensor")?.to_string(),
                hash: get("headkl.head.hash")?.to_string(),
            },
        }))
    }
}

/// What a `loss` run would use a teacher file with.
pub struct LossRun<'a> {
    /// The temperature the teacher should have been made at:
    /// `--teacher-temperature`, else `--temperature`.
    pub temperature: f32,
    /// The option that set it.
    pub temperature_option: &'static str,
    /// The head's vocabulary size.
    pub vocab: usize,
    /// The head.
    pub head: &'a HeadIdentity,
    /// The run's softcap (`None`: none).
    pub softcap: Option<f32>,
}

/// Checks the teacher file `teacher`'s metadata against the run: a file
/// made at another temperature or softcap, over another vocabulary, or
/// from another head is an error naming both values (exit 2), unless
/// `allow` (`--allow-teacher-mismatch`), when it is a warning. A file with
/// no headkl metadata is used as it is, with a note.
pub fn check_teacher(
    teacher: &Path,
    metadata: Option<&HashMap<String, String>>,
    run: &LossRun<'_>,
    allow: bool,
) -> Result<(), FilesError> {
    let refuse = |problem: String| {
        if allow {
            log::warn!("{}: {problem} (used anyway: {ALLOW_MISMATCH_FLAG})", teacher.display());
            Ok(())
        } else {
            Err(FilesError::file(
                teacher,
                format!("{problem} (pass {ALLOW_MISMATCH_FLAG} to use it anyway)"),
            ))
        }
    };
    let record = match TeacherRecord::from_metadata(metadata) {
        Ok(Some(record)) => record,
        Ok(None) => {
            log::info!(
                "headkl: {}: no headkl metadata (made elsewhere?): its temperature, vocabulary and head are not checked",
                teacher.display()
            );
            return Ok(());
        }
        Err(problem) => return refuse(problem),
    };
    let mut problems = Vec::new();
    if record.temperature != run.temperature {
        problems.push(format!(
            "made at temperature {}, but {} is {}",
            record.temperature, run.temperature_option, run.temperature
        ));
    }
    if record.softcap != run.softcap {
        problems.push(format!(
            "made with softcap {}, but this run's softcap is {}",
            fmt_softcap(record.softcap),
            fmt_softcap(run.softcap)
        ));
    }
    if record.vocab != run.vocab {
        problems.push(format!(
            "made over V = {}, but the head has V = {}",
            record.vocab, run.vocab
        ));
    } else if record.head.hash != run.head.hash {
        problems.push(format!(
            "made from head {}, but --head is {}",
            record.head.describe(),
            run.head.describe()
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        refuse(problems.join("; "))
    }
}

/// What `loss` records about its output.
pub struct LossRecord<'a> {
    /// The loss `Σ w_t L_t / total`, at full precision.
    pub mean: f64,
    /// How the per-token losses reduced (it set `total`).
    pub reduction: headkl_core::Reduction,
    /// Temperature.
    pub temperature: f32,
    /// The weight the mean averages over (given or `Σ w`).
    pub total: f32,
    /// The f16 gradient's scale (given or the default).
    pub gscale: f32,
    /// Tokens, vocabulary, hidden size and entries per teacher row.
    pub shape: headkl_core::Shape,
    /// The softcap (`None`: none).
    pub softcap: Option<f32>,
    /// The loss terms (weights, smoothing, z-loss).
    pub terms: &'a LossTerms,
    /// How the teacher file held its values.
    pub teacher_form: TeacherForm,
    /// The teacher's tail mode.
    pub tail: TailMode,
    /// The head.
    pub head: &'a HeadIdentity,
    /// The teacher file.
    pub teacher: &'a Path,
    /// The weights file, if any.
    pub weights: Option<&'a Path>,
    /// The labels file, if any.
    pub labels: Option<&'a Path>,
}

impl LossRecord<'_> {
    /// The record as safetensors metadata.
    pub fn to_metadata(&self) -> HashMap<String, String> {
        let mut m = metadata_made_by("loss");
        // f64's Display is the shortest string that reads back the same.
        m.insert("headkl.mean".into(), self.mean.to_string());
        m.insert("headkl.reduction".into(), self.reduction.name().to_string());
        m.insert("headkl.temperature".into(), self.temperature.to_string());
        m.insert("headkl.total".into(), self.total.to_string());
        m.insert("headkl.gscale".into(), self.gscale.to_string());
        m.insert("headkl.k".into(), self.shape.k.to_string());
        m.insert("headkl.vocab".into(), self.shape.vocab.to_string());
        m.insert("headkl.hs".into(), self.shape.hs.to_string());
        m.insert("headkl.ntok".into(), self.shape.ntok.to_string());
        m.insert("headkl.softcap".into(), fmt_softcap(self.softcap));
        m.insert("headkl.soft_weight".into(), self.terms.soft_weight.to_string());
        m.insert("headkl.hard_weight".into(), self.terms.hard_weight.to_string());
        m.insert("headkl.label_smoothing".into(), self.terms.label_smoothing.to_string());
        m.insert("headkl.z_loss".into(), self.terms.z_loss.to_string());
        m.insert("headkl.divergence".into(), self.terms.divergence.name().to_string());
        if let headkl_core::Divergence::Jsd { beta } = self.terms.divergence {
            m.insert("headkl.beta".into(), beta.to_string());
        }
        m.insert("headkl.teacher_form".into(), self.teacher_form.name().to_string());
        m.insert("headkl.tail".into(), self.tail.name().to_string());
        m.insert("headkl.teacher.file".into(), self.teacher.display().to_string());
        for (key, file) in [
            ("headkl.weights.file", self.weights),
            ("headkl.labels.file", self.labels),
        ] {
            m.insert(
                key.into(),
                file.map_or_else(|| "none".to_string(), |f| f.display().to_string()),
            );
        }
        self.head.write(&mut m);
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> TeacherRecord {
        TeacherRecord {
            temperature: 2.0,
            k: 4,
            vocab: 300,
            hs: 24,
            ntok: 5,
            renormalized: true,
            softcap: None,
            logit_scale: 1.0,
            head: HeadIdentity::of(Path::new("head.safetensors"), "weight", &[1, 2, 3]),
        }
    }

    #[test]
    fn fold64_sees_every_byte_and_the_length() {
        let base: Vec<u8> = (0..100u8).collect();
        let h = fold64(&base);
        for i in [0, 31, 32, 63, 96, 99] {
            let mut changed = base.clone();
            changed[i] ^= 1;
            assert_ne!(fold64(&changed), h, "byte {i}");
        }
        assert_ne!(fold64(&base[..99]), h);
        assert_ne!(fold64(&[0u8; 8]), fold64(&[0u8; 16]));
        // Stable across builds: files written today are read tomorrow.
        assert_eq!(fold64(b""), fold64(b""));
        assert_eq!(format!("{:016x}", fold64(b"headkl")).len(), 16);
    }

    #[test]
    fn teacher_record_round_trips() {
        let r = record();
        let m = r.to_metadata();
        assert_eq!(TeacherRecord::from_metadata(Some(&m)), Ok(Some(r.clone())));
        let capped = TeacherRecord {
            softcap: Some(30.0),
            logit_scale: 0.125,
            ..r.clone()
        };
        assert_eq!(
            TeacherRecord::from_metadata(Some(&capped.to_metadata())),
            Ok(Some(capped))
        );
        // A file from before the key: made at S = 1.
        let mut older = r.to_metadata();
        older.remove("headkl.logit_scale");
        assert_eq!(TeacherRecord::from_metadata(Some(&older)), Ok(Some(r.clone())));
        assert_eq!(TeacherRecord::from_metadata(None), Ok(None));
        assert_eq!(TeacherRecord::from_metadata(Some(&HashMap::new())), Ok(None));
    }

    #[test]
    fn unreadable_metadata_names_the_key() {
        let mut m = record().to_metadata();
        m.insert("headkl.temperature".into(), "warm".into());
        let e = TeacherRecord::from_metadata(Some(&m)).unwrap_err();
        assert!(e.contains("headkl.temperature") && e.contains("warm"), "{e}");
        m.insert(FORMAT.into(), "99".into());
        let e = TeacherRecord::from_metadata(Some(&m)).unwrap_err();
        assert!(e.contains("99"), "{e}");
    }

    #[test]
    fn mismatches_name_both_values() {
        let r = record();
        let m = r.to_metadata();
        let other_head = HeadIdentity::of(Path::new("other.safetensors"), "weight", &[9]);
        let run = |temperature, vocab, head| LossRun {
            temperature,
            temperature_option: "--temperature",
            vocab,
            head,
            softcap: None,
        };
        let t = Path::new("t.safetensors");
        assert!(check_teacher(t, Some(&m), &run(2.0, 300, &r.head), false).is_ok());
        let e = check_teacher(t, Some(&m), &run(1.0, 300, &r.head), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("temperature 2") && e.contains("--temperature is 1"), "{e}");
        assert!(e.contains(ALLOW_MISMATCH_FLAG), "{e}");
        let e = check_teacher(t, Some(&m), &run(2.0, 301, &r.head), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("V = 300") && e.contains("V = 301"), "{e}");
        let e = check_teacher(t, Some(&m), &run(2.0, 300, &other_head), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&r.head.hash) && e.contains(&other_head.hash), "{e}");
        // The override accepts each of them; no metadata is no check.
        assert!(check_teacher(t, Some(&m), &run(1.0, 301, &other_head), true).is_ok());
        assert!(check_teacher(t, None, &run(1.0, 301, &other_head), false).is_ok());
    }
}
