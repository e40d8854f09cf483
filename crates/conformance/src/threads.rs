//! Several engines on one device, driven at once from several threads, and
//! one engine called many times: the same answers as one engine alone, and
//! memory that stays flat. Written once here, run on every backend whose
//! device can be shared across threads ([`threads_tests!`]).

use headkl_core::{
    Backend, Engine, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, LossOutput, SliceOptions, TopK,
    TopkOptions,
};

use crate::generator::Rng;

/// The problem every engine solves: a head of several slices (so each call
/// runs several GEMMs a chunk) and a few chunks of tokens.
const NTOK: usize = 40;
const VOCAB: usize = 1000;
const HS: usize = 48;
const K: usize = 8;

/// Seeded inputs: the head, the teacher's and the student's hidden rows.
struct Inputs {
    head: Vec<f32>,
    teacher_x: Vec<f32>,
    student_x: Vec<f32>,
}

impl Inputs {
    fn new(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut fill = |n: usize, scale: f32| (0..n).map(|_| (rng.uniform() as f32 * 2.0 - 1.0) * scale).collect();
        Self {
            head: fill(VOCAB * HS, 0.5),
            teacher_x: fill(NTOK * HS, 1.0),
            student_x: fill(NTOK * HS, 1.0),
        }
    }
}

/// Small slices: the multi-slice path.
fn slicing() -> SliceOptions {
    SliceOptions {
        max_rows_per_slice: Some(384),
    }
}

/// Small chunks: the multi-chunk path (two chunks in flight).
const ROWS_PER_CHUNK: Option<usize> = Some(16);

fn loss_options() -> LossOptions {
    LossOptions::from(LossConfig {
        max_rows_per_chunk: ROWS_PER_CHUNK,
        ..LossConfig::default()
    })
}

/// One engine's teacher top-k, then the student's loss against it.
fn solve<B: Backend>(engine: &mut Engine<B>, x: &Inputs) -> headkl_core::Result<(TopK, LossOutput)> {
    let topk = TopkOptions {
        max_rows_per_chunk: ROWS_PER_CHUNK,
        ..TopkOptions::new(K)
    };
    let top = engine.topk(&Hidden::f32(&x.teacher_x, NTOK, HS)?, &topk)?;
    let teacher = headkl_core::Teacher::new(&top.ids, &top.probs, NTOK, K, VOCAB)?;
    let mut out = LossOutput::default();
    engine.head_kl_into(
        &Hidden::f32(&x.student_x, NTOK, HS)?,
        &teacher,
        &loss_options(),
        &mut out,
    )?;
    Ok((top, out))
}

/// `THREADS` engines on `backend`, each on its own thread, each solving the
/// problem `ROUNDS` times at once with the others: every answer equals, bit
/// for bit, what one engine alone computed (the kernels are deterministic:
/// fixed summation orders, no atomics).
pub fn engines_on_threads_agree<B: Backend + Sync>(backend: &B) {
    const THREADS: usize = 3;
    const ROUNDS: usize = 3;
    let x = Inputs::new(0x7468_7265_6164_7301);
    let head = HeadWeights::new(HeadData::F32(&x.head), VOCAB, HS).expect("head");
    let alone = {
        let mut engine = Engine::new(backend, &head, slicing()).expect("engine");
        solve(&mut engine, &x).expect("one engine")
    };
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (x, head) = (&x, &head);
                s.spawn(move || {
                    let mut engine = Engine::new(backend, head, slicing()).expect("engine");
                    (0..ROUNDS)
                        .map(|round| solve(&mut engine, x).unwrap_or_else(|e| panic!("thread {t} round {round}: {e}")))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for (t, worker) in workers.into_iter().enumerate() {
            let answers = worker.join().unwrap_or_else(|_| panic!("thread {t} panicked"));
            for (round, (top, out)) in answers.iter().enumerate() {
                let at = format!("thread {t} round {round}");
                assert_eq!(top.ids, alone.0.ids, "{at}: top-k ids");
                assert_eq!(bits(&top.probs), bits(&alone.0.probs), "{at}: top-k probabilities");
                assert_eq!(bits(&out.loss), bits(&alone.1.loss), "{at}: loss");
                assert_eq!(bits(&out.dx), bits(&alone.1.dx), "{at}: dx");
                assert_eq!(out.mean.to_bits(), alone.1.mean.to_bits(), "{at}: mean");
            }
        }
    });
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// What a soak measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Soak {
    /// Calls made.
    pub calls: usize,
    /// Device bytes the backend holds after the first call and after the last.
    pub device_bytes: (u64, u64),
    /// The process's resident host memory after the first call and after the
    /// last (0 where the platform does not say).
    pub host_bytes: (u64, u64),
}

/// Resident host memory of this process, from `/proc/self/statm` (0 where
/// there is none).
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .map_or(0, |pages| pages * 4096)
}

/// `calls` `head_kl_into` calls on one engine with one kept output (one
/// slice, one chunk: the calls are many, so each is kept small): the device
/// memory the backend holds and the process's host memory after the first
/// call and after the last.
pub fn soak<B: Backend>(backend: &B, calls: usize) -> Soak {
    let x = Inputs::new(0x736f_616b_0000_0001);
    let head = HeadWeights::new(HeadData::F32(&x.head), VOCAB, HS).expect("head");
    let mut engine = Engine::new(backend, &head, SliceOptions::default()).expect("engine");
    let top = engine
        .topk(
            &Hidden::f32(&x.teacher_x, NTOK, HS).expect("hidden"),
            &TopkOptions::new(K),
        )
        .expect("top-k");
    let teacher = headkl_core::Teacher::new(&top.ids, &top.probs, NTOK, K, VOCAB).expect("teacher");
    let hidden = Hidden::f32(&x.student_x, NTOK, HS).expect("hidden");
    let mut out = LossOutput::default();
    let mut call = |i: usize, out: &mut LossOutput| {
        engine
            .head_kl_into(&hidden, &teacher, &LossOptions::default(), out)
            .unwrap_or_else(|e| panic!("call {i}: {e}"));
    };
    call(0, &mut out);
    let first = (backend.memory().current, resident_bytes());
    let want = bits(&out.dx);
    for i in 1..calls {
        call(i, &mut out);
        assert_eq!(bits(&out.dx), want, "call {i}: dx changed");
    }
    Soak {
        calls,
        device_bytes: (first.0, backend.memory().current),
        host_bytes: (first.1, resident_bytes()),
    }
}

/// [`soak`] with its checks: device memory exactly flat, host memory within
/// 8 MiB (allocator noise; a leak of one chunk's buffers a call would be
/// megabytes over the calls).
pub fn soak_stays_flat<B: Backend>(backend: &B, calls: usize) -> Soak {
    let s = soak(backend, calls);
    assert_eq!(s.device_bytes.0, s.device_bytes.1, "device memory grew: {s:?}");
    assert!(
        s.host_bytes.1 <= s.host_bytes.0 + (8 << 20),
        "host memory grew by more than 8 MiB: {s:?}"
    );
    s
}

/// Whether this test process runs one test alone (`--exact` among its
/// arguments, as [`run_alone`] starts it).
pub fn running_alone() -> bool {
    std::env::args().any(|a| a == "--exact")
}

/// Runs test `name` of this test binary in a process of its own and fails
/// unless it passes there, with its output. For a test that measures the
/// process (its host memory), which the binary's other tests, running at
/// the same time, would disturb.
pub fn run_alone(name: &str) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .output()
        .expect("starting the test binary again");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{name}, alone in its own process, failed:\n{text}"
    );
    assert!(
        text.contains("1 passed"),
        "{name} did not run in its own process:\n{text}"
    );
    // What it printed (its figures), for --nocapture.
    for line in text.lines().filter(|l| l.contains(": soak ")) {
        println!("{line}");
    }
}

/// Instantiates the thread and soak tests for a backend: `$open` is an
/// expression giving `headkl_core::Result<B>`, opened through
/// [`super::open_or_skip`] (a backend that cannot start is skipped with
/// its reason, or fails when `HEADKL_REQUIRE` names it).
#[macro_export]
macro_rules! threads_tests {
    ($name:literal, $open:expr $(,)?) => {
        #[test]
        fn engines_on_threads_agree_with_one_engine() {
            if let Some(backend) = $crate::open_or_skip($name, || $open) {
                $crate::threads::engines_on_threads_agree(&backend);
                let diagnostics = headkl_core::Backend::take_diagnostics(&backend);
                assert!(diagnostics.is_empty(), "{}", diagnostics.join("\n"));
            }
        }

        #[test]
        fn soak_of_many_calls_keeps_memory_flat() {
            // Host memory is the whole process's, and the binary's other
            // tests run beside this one: the soak runs in a test process of
            // its own (this test alone, `--exact`), which this one waits for.
            if !$crate::threads::running_alone() {
                $crate::threads::run_alone("soak_of_many_calls_keeps_memory_flat");
                return;
            }
            if let Some(backend) = $crate::open_or_skip($name, || $open) {
                let s = $crate::threads::soak_stays_flat(&backend, 1000);
                println!("{}: soak {s:?}", $name);
                let diagnostics = headkl_core::Backend::take_diagnostics(&backend);
                assert!(diagnostics.is_empty(), "{}", diagnostics.join("\n"));
            }
        }
    };
}
