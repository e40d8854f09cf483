//! The fuzz targets' bodies, one per parser of what other programs write:
//! safetensors files, teacher files, the tune cache, the `HEADKL_*`
//! settings and vocabulary-order files. (The tune cache's parser is in
//! `headkl-core`, the settings' in `headkl-runtime` and the conformance
//! suite; their targets are here too, so that the harness stands on this
//! crate alone.)
//!
//! Each body takes any bytes and asserts what every input must give: no
//! panic; an error that is bad input ([`FilesError::is_input`]: exit 2 in
//! the command), on one line, naming the file or option; results that
//! agree with an independent reading (the `safetensors` crate, a round
//! trip, a permutation's inverse). The harness (`crates/fuzz`, afl.rs)
//! calls them under [`CappedAlloc`], which aborts on any allocation larger
//! than the input justifies, and the unit tests replay the committed
//! corpora (`crates/fuzz/corpus/TARGET`, `crates/fuzz/regressions/TARGET`)
//! through the same bodies.
//!
//! The command line's target (`cli_args`) needs the command's clap parser,
//! so it is not here: `headkl-cli`'s unit tests run its body over its
//! committed corpus under the same cap ([`run_capped`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use half::{bf16, f16};
use headkl_core::toolkit::settings::{Env, REMOVED, VARIABLES};
use headkl_core::toolkit::tune_cache::TuneCache;
use headkl_core::{GemmChoice, LossConfig, LossOptions, LossTerms, TailMode, Teacher, TeacherForm};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::error::FilesError;
use crate::inputs::{check_loss_options, read_labels, read_teacher, read_weights};
use crate::provenance::{LossRun, TeacherRecord};
use crate::sources::Sources;
use crate::tensors::{TensorFile, TensorRef};

/// The fuzz targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The safetensors reader, against the `safetensors` crate.
    Safetensors,
    /// A teacher file (`ids`, `probs` or `logprobs`, `weights`, `labels`)
    /// checked as `headkl loss` checks it; the first byte picks the form,
    /// the tail mode and `--allow-teacher-mismatch`.
    Teacher,
    /// The tune cache's text.
    TuneCache,
    /// `HEADKL_*` settings, one `NAME=VALUE` a line.
    Settings,
    /// A `--vocab-order` file.
    VocabOrder,
}

impl Target {
    /// Every target.
    pub const ALL: [Target; 5] = [
        Target::Safetensors,
        Target::Teacher,
        Target::TuneCache,
        Target::Settings,
        Target::VocabOrder,
    ];

    /// The name the harness, the corpus folders and the script use.
    pub fn name(self) -> &'static str {
        match self {
            Target::Safetensors => "safetensors",
            Target::Teacher => "teacher",
            Target::TuneCache => "tune_cache",
            Target::Settings => "settings",
            Target::VocabOrder => "vocab_order",
        }
    }

    /// The target called `name`.
    pub fn from_name(name: &str) -> Option<Target> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Runs the body on `data` with allocations capped at what its size
    /// justifies; panics where a property fails.
    pub fn run(self, data: &[u8]) {
        let body = match self {
            Target::Safetensors => safetensors_reader,
            Target::Teacher => teacher_file,
            Target::TuneCache => tune_cache,
            Target::Settings => settings,
            Target::VocabOrder => vocab_order,
        };
        run_capped(data, body);
    }

    /// Valid inputs to start a campaign from: small heads in bf16, f16 and
    /// f32, teacher files in both forms with and without metadata, and so on.
    pub fn seeds(self) -> Vec<(String, Vec<u8>)> {
        match self {
            Target::Safetensors => safetensors_seeds(),
            Target::Teacher => teacher_seeds(),
            Target::TuneCache => tune_cache_seeds(),
            Target::Settings => settings_seeds(),
            Target::VocabOrder => vec![
                ("natural".into(), b"0 1 2 3 4 5 6 7".to_vec()),
                ("lines".into(), b"3\n0\n2\n1\n".to_vec()),
                ("tabs".into(), b"1\t0\r\n".to_vec()),
            ],
        }
    }

    /// The format's keys and tokens, for the fuzzer's dictionary.
    pub fn dictionary(self) -> Vec<String> {
        let mut words: Vec<String> = match self {
            Target::Safetensors | Target::Teacher => [
                "\"dtype\"",
                "\"shape\"",
                "\"data_offsets\"",
                "\"__metadata__\"",
                "\"F32\"",
                "\"F16\"",
                "\"BF16\"",
                "\"I64\"",
                "\"I32\"",
                "\"U32\"",
                "\"F64\"",
                "\"U8\"",
                "\"BOOL\"",
                "\"ids\"",
                "\"probs\"",
                "\"logprobs\"",
                "\"weights\"",
                "\"labels\"",
                "\"weight\"",
                "\"hidden\"",
                "\"headkl.format\"",
                "\"headkl.temperature\"",
                "\"headkl.vocab\"",
                "\"headkl.k\"",
                "\"headkl.softcap\"",
                "\"headkl.head.hash\"",
                "\"none\"",
                "18446744073709551615",
                "4294967296",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            Target::TuneCache => [
                "\t", "#", "direct", "glsl:", "wgmma:", "staged:", "logits=", "dx=", ",", "bm128", "bm96", "bk64",
                "bk32", "s1", "s2", "r4", ":pf", ".ws", ".c4", "vulkan", "wgpu",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            Target::Settings => {
                let mut w: Vec<String> = VARIABLES.iter().map(|v| format!("{}=", v.name)).collect();
                w.extend(REMOVED.iter().map(|(name, _)| format!("{name}=")));
                w.extend(
                    [
                        "1",
                        "off",
                        "yes",
                        "0x",
                        "auto",
                        "universal",
                        "direct",
                        "glsl:",
                        "wgmma:",
                        "staged:",
                        "logits=",
                        "dx=",
                        "bm128.bk64.s1",
                        "bk32:r4:s1:pf",
                        "\n",
                    ]
                    .iter()
                    .map(|s| s.to_string()),
                );
                w
            }
            Target::VocabOrder => [" ", "\n", "4294967295", "0", "+1"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        };
        words.sort();
        words.dedup();
        words
    }
}

/// Runs `body` on `data` with allocations capped at what the input's size
/// justifies (under [`CappedAlloc`]): what [`Target::run`] does, for a
/// body outside this crate (the command line's, in `headkl-cli`).
pub fn run_capped(data: &[u8], body: impl FnOnce(&[u8])) {
    let _cap = AllocCap::set(ALLOC_BASE_BYTES + ALLOC_BYTES_PER_INPUT_BYTE * data.len());
    body(data);
}

/// Bytes any input may allocate at once, whatever its size: parsing state,
/// the fixture (and, for the command line's body, clap's command).
const ALLOC_BASE_BYTES: usize = 4 << 20;
/// And per byte of input: a tensor's elements copied out of a misaligned
/// file (at most 2× for i32 → i64), a vocabulary order's inverse (4 bytes a
/// position, at least 2 input bytes an id), a lossy UTF-8 copy.
const ALLOC_BYTES_PER_INPUT_BYTE: usize = 16;

thread_local! {
    /// The largest allocation this thread may make (`usize::MAX`: any).
    static CAP: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The system allocator with a per-thread cap on one allocation's size,
/// set while a fuzz body runs: a header claiming a 1 TB tensor in a 1 KB
/// file must be refused before anything is allocated for it. Past the cap
/// it reports and aborts.
pub struct CappedAlloc;

impl CappedAlloc {
    fn check(size: usize) {
        // A failed property's report (message, backtrace) is not the input's.
        if std::thread::panicking() {
            return;
        }
        let cap = CAP.try_with(Cell::get).unwrap_or(usize::MAX);
        if size > cap {
            // Lift the cap so the report itself can allocate.
            let _ = CAP.try_with(|c| c.set(usize::MAX));
            // Straight to stderr, not the log: the process aborts next, and
            // afl keeps the input; no logger is installed in the harness.
            eprintln!("fuzz: an allocation of {size} bytes, over the input's cap of {cap}");
            std::process::abort();
        }
    }
}

// SAFETY: every method forwards to `System` with the caller's layout
// unchanged; the cap only aborts before forwarding.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::check(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::check(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::check(new_size);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// The cap while it lives; the previous one after.
struct AllocCap(usize);

impl AllocCap {
    fn set(bytes: usize) -> Self {
        Self(CAP.with(|c| c.replace(bytes)))
    }
}

impl Drop for AllocCap {
    fn drop(&mut self) {
        CAP.with(|c| c.set(self.0));
    }
}

/// What every refused input must give: bad input (exit 2) and one line.
fn assert_input_error(e: &FilesError, names: &str) {
    let text = e.to_string();
    assert!(e.is_input(), "not a bad-input error: {text}");
    assert!(!text.contains('\n'), "more than one line: {text:?}");
    assert!(text.contains(names), "does not name {names}: {text}");
}

const FILE_NAME: &str = "fuzz.safetensors";

fn safetensors_reader(data: &[u8]) {
    let ours = TensorFile::from_bytes(Path::new(FILE_NAME), data.to_vec());
    let theirs = SafeTensors::deserialize(data);
    let (file, st) = match (ours, theirs) {
        (Ok(file), Ok(st)) => (file, st),
        (Err(e), Err(_)) => return assert_input_error(&e, FILE_NAME),
        (Ok(_), Err(e)) => panic!("headkl accepted a file the safetensors crate refuses: {e}"),
        (Err(e), Ok(_)) => panic!("headkl refused a file the safetensors crate accepts: {e}"),
    };
    let mut their_names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    their_names.sort();
    assert_eq!(file.names(), their_names);
    for name in &their_names {
        let t = file
            .tensor(name)
            .unwrap_or_else(|e| panic!("listed tensor {name}: {e}"));
        let v = st.tensor(name).unwrap_or_else(|e| panic!("listed tensor {name}: {e}"));
        assert_eq!(t.dtype(), v.dtype(), "{name}");
        assert_eq!(t.shape(), v.shape(), "{name}");
        assert_eq!(t.bytes(), v.data(), "{name}");
        read_every_way(&t, v.shape().iter().product());
    }
    match file.tensor("\u{1}absent") {
        Err(e) => assert_input_error(&e, FILE_NAME),
        Ok(_) => panic!("found a tensor the file does not name"),
    }
}

/// Reads `t` as each consumer would, checking the element counts and
/// the dimension errors.
fn read_every_way(t: &TensorRef<'_>, elems: usize) {
    match t.dtype() {
        Dtype::F32 => assert_eq!(t.f32s().len(), elems),
        Dtype::F16 => assert_eq!(t.f16s().len(), elems),
        Dtype::BF16 => assert_eq!(t.bf16s().len(), elems),
        _ => {}
    }
    match t.ids_i64() {
        Ok(ids) => assert_eq!(ids.len(), elems),
        Err(e) => assert_input_error(&e, FILE_NAME),
    }
    match (t.shape().len(), t.matrix("[a][b]"), t.vector("[n]")) {
        (2, Ok((rows, cols)), Err(e)) => {
            assert_eq!(rows * cols, elems);
            assert_input_error(&e, FILE_NAME);
        }
        (1, Err(e), Ok(len)) => {
            assert_eq!(len, elems);
            assert_input_error(&e, FILE_NAME);
        }
        (_, Err(a), Err(b)) => {
            assert_input_error(&a, FILE_NAME);
            assert_input_error(&b, FILE_NAME);
        }
        (n, m, v) => panic!(
            "{n} dimensions read as matrix {:?} and vector {:?}",
            m.is_ok(),
            v.is_ok()
        ),
    }
}

/// The head and hidden rows a teacher file is checked against.
const FIXTURE_VOCAB: usize = 16;
const FIXTURE_HS: usize = 8;
const FIXTURE_NTOK: usize = 4;
const FIXTURE_K: usize = 3;

struct Fixture {
    head: TensorFile,
    hidden: TensorFile,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let head: Vec<f32> = (0..FIXTURE_VOCAB * FIXTURE_HS).map(|i| (i % 7) as f32 * 0.25).collect();
        let hidden: Vec<f32> = (0..FIXTURE_NTOK * FIXTURE_HS).map(|i| (i % 5) as f32 - 2.0).collect();
        let file = |name: &str, values: &[f32], shape: Vec<usize>| {
            let bytes = serialize(
                vec![(name, Dtype::F32, shape, bytemuck::cast_slice(values).to_vec())],
                None,
            );
            TensorFile::from_bytes(Path::new(&format!("{name}.safetensors")), bytes).expect("the fixture parses")
        };
        Fixture {
            head: file("weight", &head, vec![FIXTURE_VOCAB, FIXTURE_HS]),
            hidden: file("hidden", &hidden, vec![FIXTURE_NTOK, FIXTURE_HS]),
        }
    })
}

fn teacher_file(data: &[u8]) {
    let Some((&options, bytes)) = data.split_first() else {
        return;
    };
    let form = if options & 1 == 0 {
        TeacherForm::Probs
    } else {
        TeacherForm::Logprobs
    };
    let tail = [TailMode::Renormalize, TailMode::Bucket, TailMode::Unnormalized][usize::from(options >> 1) % 3];
    let allow_mismatch = options & 0x10 != 0;
    let path = Path::new(FILE_NAME);
    let result = (|| -> Result<(), FilesError> {
        let fixture = fixture();
        let head_t = fixture.head.tensor("weight")?;
        let hidden_t = fixture.hidden.tensor("hidden")?;
        let file = TensorFile::from_bytes(path, bytes.to_vec())?;
        let ids_t = file.tensor("ids")?;
        let values_name = match form {
            TeacherForm::Probs => "probs",
            TeacherForm::Logprobs => "logprobs",
        };
        let probs_t = file.tensor(values_name)?;
        let head = head_t.identity();
        let run = LossRun {
            temperature: 1.0,
            temperature_option: "--temperature",
            vocab: FIXTURE_VOCAB,
            head: &head,
            softcap: None,
        };
        let input = read_teacher(
            path,
            &file,
            &ids_t,
            &probs_t,
            &run,
            allow_mismatch,
            (&hidden_t, FIXTURE_NTOK),
        )?;
        let weights_t = file.tensor_if_present("weights")?;
        let labels_t = file.tensor_if_present("labels")?;
        let sources =
            Sources::new(&head_t, &hidden_t).with_teacher(&ids_t, &probs_t, weights_t.as_ref(), labels_t.as_ref());
        Teacher::with_form(
            &input.ids,
            &input.probs,
            FIXTURE_NTOK,
            input.k,
            FIXTURE_VOCAB,
            form,
            tail,
        )
        .map_err(|e| sources.map(e, "teacher"))?;
        let weights = weights_t.as_ref().map(|w| read_weights(w, FIXTURE_NTOK)).transpose()?;
        let labels = labels_t.as_ref().map(|l| read_labels(l, FIXTURE_NTOK)).transpose()?;
        let hard = labels.is_some();
        let opts = LossOptions {
            config: LossConfig {
                terms: LossTerms {
                    hard_weight: if hard { 0.5 } else { 0.0 },
                    ..LossTerms::default()
                },
                ..LossConfig::default()
            },
            weights,
            labels,
            ..LossOptions::default()
        };
        check_loss_options(&opts, FIXTURE_NTOK, FIXTURE_VOCAB, &sources).map(drop)
    })();
    if let Err(e) = result {
        let text = e.to_string();
        assert!(e.is_input(), "not a bad-input error: {text}");
        assert!(!text.contains('\n'), "more than one line: {text:?}");
        assert!(
            text.contains(FILE_NAME) || text.starts_with("--"),
            "names neither the file nor an option: {text}"
        );
    }
}

fn tune_cache(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let cache = TuneCache::parse(&text);
    for entry in &cache.entries {
        let again = GemmChoice::parse(&entry.choice.to_string(), GemmChoice::PORTABLE)
            .unwrap_or_else(|e| panic!("`{}` does not read back: {e}", entry.choice));
        assert_eq!(again, entry.choice);
        assert!(
            cache.lookup(&entry.backend, &entry.device, &entry.driver).is_some(),
            "an entry that cannot be looked up: {entry:?}"
        );
    }
    for failed in &cache.failed {
        assert!(
            cache
                .failed_tiles(&failed.backend, &failed.device, &failed.driver)
                .contains(&failed),
            "a failed tile that cannot be looked up: {failed:?}"
        );
    }
    // What headkl writes reads back the same.
    let written = cache.to_text();
    assert_eq!(TuneCache::parse(&written), cache, "{written:?}");
}

fn settings(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let pairs: Vec<(&str, &str)> = text.lines().filter_map(|line| line.split_once('=')).collect();
    // The sections `headkl`'s settings hold, in its order (its
    // `environment::Settings::from_env`): the runtime's, then the
    // conformance suite's. The command exits 2 with the message as it is.
    let env = Env::from_pairs(pairs.iter().copied());
    let parsed =
        headkl_runtime::Settings::from_env(&env).and_then(|_| headkl_conformance::SuiteSettings::from_env(&env));
    match parsed {
        Ok(_) => {}
        Err(e) => {
            let message = e.to_string();
            assert!(!message.contains('\n'), "more than one line: {message:?}");
            assert!(
                pairs.iter().any(|(name, _)| message.contains(name)),
                "names no variable that was set: {message}"
            );
        }
    }
}

fn vocab_order(data: &[u8]) {
    let path = Path::new("order.txt");
    let text = String::from_utf8_lossy(data);
    match crate::vocab_order::parse(path, &text) {
        Ok(order) => {
            assert_eq!(order.len(), text.split_whitespace().count());
            for p in 0..order.len() as u32 {
                assert_eq!(order.position(order.id(p)), p);
            }
        }
        Err(e) => assert_input_error(&e, "order.txt"),
    }
}

type Tensor<'a> = (&'a str, Dtype, Vec<usize>, Vec<u8>);

fn serialize(tensors: Vec<Tensor<'_>>, metadata: Option<HashMap<String, String>>) -> Vec<u8> {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (
                *name,
                TensorView::new(*dtype, shape.clone(), bytes).expect("a seed's tensor is consistent"),
            )
        })
        .collect();
    safetensors::serialize(views, metadata).expect("a seed serializes")
}

fn le_bytes<T: bytemuck::Pod>(values: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(values).to_vec()
}

fn safetensors_seeds() -> Vec<(String, Vec<u8>)> {
    let values: Vec<f32> = (0..6 * 4).map(|i| i as f32 * 0.5 - 3.0).collect();
    let f16s: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
    let bf16s: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
    let ids: Vec<i64> = (0..12).collect();
    let ids32: Vec<i32> = (0..12).collect();
    vec![
        (
            "head-f32".into(),
            serialize(vec![("weight", Dtype::F32, vec![6, 4], le_bytes(&values))], None),
        ),
        (
            "head-f16".into(),
            serialize(vec![("weight", Dtype::F16, vec![6, 4], le_bytes(&f16s))], None),
        ),
        (
            "head-bf16".into(),
            serialize(
                vec![("lm_head.weight", Dtype::BF16, vec![6, 4], le_bytes(&bf16s))],
                None,
            ),
        ),
        (
            "mixed".into(),
            serialize(
                vec![
                    ("ids", Dtype::I64, vec![4, 3], le_bytes(&ids)),
                    ("labels", Dtype::I32, vec![12], le_bytes(&ids32)),
                    ("half", Dtype::F16, vec![3], le_bytes(&f16s[..3])),
                ],
                Some(HashMap::from([("headkl.format".to_string(), "1".to_string())])),
            ),
        ),
        ("empty".into(), serialize(Vec::new(), None)),
    ]
}

fn teacher_seeds() -> Vec<(String, Vec<u8>)> {
    let fixture = fixture();
    let head = fixture
        .head
        .tensor("weight")
        .map(|t| t.identity())
        .unwrap_or_else(|e| panic!("the fixture: {e}"));
    let record = |renormalized| TeacherRecord {
        temperature: 1.0,
        k: FIXTURE_K,
        vocab: FIXTURE_VOCAB,
        hs: FIXTURE_HS,
        ntok: FIXTURE_NTOK,
        renormalized,
        softcap: None,
        logit_scale: 1.0,
        head: head.clone(),
    };
    let ids: Vec<i64> = (0..FIXTURE_NTOK * FIXTURE_K)
        .map(|i| (i * 5 % FIXTURE_VOCAB) as i64)
        .collect();
    let ids32: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    let probs: Vec<f32> = (0..FIXTURE_NTOK).flat_map(|_| [0.5f32, 0.3, 0.2]).collect();
    let partial: Vec<f32> = (0..FIXTURE_NTOK).flat_map(|_| [0.4f32, 0.2, 0.1]).collect();
    let logprobs: Vec<f32> = partial.iter().map(|p| p.ln()).collect();
    let weights = vec![1.0f32, 0.5, 0.0, 2.0];
    let labels: Vec<i64> = vec![3, 0, 15, 7];
    let shape = vec![FIXTURE_NTOK, FIXTURE_K];
    let with_options = |options: u8, bytes: Vec<u8>| [vec![options], bytes].concat();
    vec![
        (
            "probs-renormalize".into(),
            with_options(
                0,
                serialize(
                    vec![
                        ("ids", Dtype::I64, shape.clone(), le_bytes(&ids)),
                        ("probs", Dtype::F32, shape.clone(), le_bytes(&probs)),
                    ],
                    Some(record(true).to_metadata()),
                ),
            ),
        ),
        (
            "logprobs-bucket".into(),
            with_options(
                1 | 2,
                serialize(
                    vec![
                        ("ids", Dtype::U32, shape.clone(), le_bytes(&ids32)),
                        ("logprobs", Dtype::F32, shape.clone(), le_bytes(&logprobs)),
                    ],
                    Some(record(false).to_metadata()),
                ),
            ),
        ),
        (
            "probs-weights-labels".into(),
            with_options(
                4,
                serialize(
                    vec![
                        ("ids", Dtype::I64, shape.clone(), le_bytes(&ids)),
                        ("probs", Dtype::F32, shape.clone(), le_bytes(&partial)),
                        ("weights", Dtype::F32, vec![FIXTURE_NTOK], le_bytes(&weights)),
                        ("labels", Dtype::I64, vec![FIXTURE_NTOK], le_bytes(&labels)),
                    ],
                    None,
                ),
            ),
        ),
    ]
}

fn tune_cache_seeds() -> Vec<(String, Vec<u8>)> {
    let mut cache = TuneCache::default();
    for (device, choice) in [
        ("NVIDIA H200", "logits=glsl:bm128.bk64.s1,dx=glsl:bm128.bk32.s2"),
        ("llvmpipe (LLVM 15.0.6, 256 bits)", "direct"),
        ("AMD Radeon", "dx=staged:bk32:r4:s1:pf"),
    ] {
        if let Ok(choice) = GemmChoice::parse(choice, GemmChoice::PORTABLE) {
            cache.insert("vulkan", device, "580.159.04", choice);
        }
    }
    cache.mark_failed(
        "vulkan",
        "NVIDIA H200",
        "580.159.04",
        GemmChoice::WGMMA_DEFAULT.dx,
        "device lost: vkQueueSubmit: VK_ERROR_DEVICE_LOST",
    );
    vec![("cache".into(), cache.to_text().into_bytes())]
}

fn settings_seeds() -> Vec<(String, Vec<u8>)> {
    [
        (
            "gemm",
            "HEADKL_GEMM=logits=glsl:bm128.bk64.s1,dx=staged:bk32:r4:s1:pf\nHEADKL_NO_COOPMAT=0\n",
        ),
        (
            "device",
            "HEADKL_DEVICE=0x1\nHEADKL_QUEUE=universal\nHEADKL_CHECKED=yes\n",
        ),
        (
            "suite",
            "HEADKL_CASES=8\nHEADKL_SEED=0x4845\nHEADKL_REQUIRE=wgpu,vulkan\n",
        ),
        (
            "backend",
            "HEADKL_BACKEND=vulkan\nHEADKL_TRACE=1\nHEADKL_CACHE_DIR=/tmp/x\n",
        ),
    ]
    .iter()
    .map(|(name, text)| (name.to_string(), text.as_bytes().to_vec()))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the committed corpora and regression inputs live.
    fn fuzz_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
    }

    #[test]
    fn seeds_pass_their_targets_and_cover_what_they_claim() {
        for target in Target::ALL {
            let seeds = target.seeds();
            assert!(!seeds.is_empty(), "{}", target.name());
            for (name, bytes) in seeds {
                target.run(&bytes);
                // A seed is a valid input: it parses all the way.
                let valid = match target {
                    Target::Safetensors => TensorFile::from_bytes(Path::new("s"), bytes.clone()).is_ok(),
                    Target::VocabOrder => {
                        crate::vocab_order::parse(Path::new("o"), &String::from_utf8_lossy(&bytes)).is_ok()
                    }
                    Target::TuneCache => !TuneCache::parse(&String::from_utf8_lossy(&bytes)).entries.is_empty(),
                    _ => true,
                };
                assert!(valid, "{} seed {name} is not valid", target.name());
            }
        }
    }

    #[test]
    fn bodies_refuse_known_bad_inputs_as_bad_input() {
        // A header claiming a 1 TB tensor in a tiny file.
        let header = br#"{"x":{"dtype":"F32","shape":[262144,1048576],"data_offsets":[0,1099511627776]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        Target::Safetensors.run(&file);
        let e = TensorFile::from_bytes(Path::new("big"), file).err().expect("refused");
        assert!(e.is_input(), "{e}");
        // A teacher file with an id past V, then one whose probs are NaN.
        for seed in teacher_seeds() {
            let mut bytes = seed.1.clone();
            Target::Teacher.run(&bytes);
            bytes.truncate(bytes.len() - 3);
            Target::Teacher.run(&bytes);
        }
        Target::VocabOrder.run(b"0 1 1");
        Target::VocabOrder.run(b"0 7");
        Target::VocabOrder.run(b"-1");
        Target::Settings.run(b"HEADKL_GEMM=glsl:bm7\nHEADKL_DEVICE=-1");
    }

    #[test]
    fn the_allocation_cap_holds_only_while_set() {
        {
            let _cap = AllocCap::set(1 << 10);
            assert_eq!(CAP.with(Cell::get), 1 << 10);
        }
        assert_eq!(CAP.with(Cell::get), usize::MAX);
    }

    /// CI's replay: every committed corpus input and regression case,
    /// through its target's body.
    #[test]
    fn committed_corpora_and_regressions_replay() {
        let mut replayed = 0;
        for target in Target::ALL {
            for kind in ["corpus", "regressions"] {
                let dir = fuzz_dir().join(kind).join(target.name());
                let Ok(entries) = std::fs::read_dir(&dir) else {
                    continue;
                };
                for entry in entries {
                    let path = entry.expect("a readable corpus folder").path();
                    if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
                        continue;
                    }
                    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                    target.run(&bytes);
                    replayed += 1;
                }
            }
        }
        assert!(replayed > 0, "no corpus under {}", fuzz_dir().display());
        eprintln!("fuzz replay: {replayed} inputs");
    }

    #[test]
    fn every_target_has_a_committed_corpus() {
        for target in Target::ALL {
            let dir = fuzz_dir().join("corpus").join(target.name());
            let count = std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
            assert!(count > 0, "{}: no corpus", dir.display());
        }
        // And every folder there is a target's: none left behind that
        // nothing replays.
        for kind in ["corpus", "regressions"] {
            for entry in std::fs::read_dir(fuzz_dir().join(kind)).expect("the fuzz folders") {
                let name = entry.expect("a readable fuzz folder").file_name();
                let name = name.to_string_lossy();
                assert!(Target::from_name(&name).is_some(), "{kind}/{name}: no such target");
            }
        }
    }
}
