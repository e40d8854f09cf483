//! The GEMMs through cuBLASLt: core's row-major `C (+)= alpha · A · op(B)`
//! ([`GemmDesc`]) as cuBLASLt's column-major product, one plan (layouts,
//! operation and the heuristic's algorithm) per shape, kept for the next
//! call.
//!
//! Row-major `X[r][c]` with row stride `ld` is column-major `Xᵀ` with the
//! same stride, so `C = A · op(B)` is computed as `Cᵀ = op(B)ᵀ · Aᵀ`:
//! cuBLASLt's A is the head plane (transposed for the logits, whose plane is
//! `[n][k]`; as stored for dx, whose plane is `[k][n]`), its B the rows.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as lts;
use cudarc::driver::result;
use cudarc::driver::sys;
use headkl_core::toolkit::split::k_part_range;
use headkl_core::toolkit::{GemmDesc, HeadLayout};
use headkl_core::{Error, Result};

use crate::conv::{alloc, cublas, driver, BACKEND};
use crate::picks::Picks;

/// cublasOperation_t's values (cuBLAS's header; cudarc's cuBLASLt
/// bindings leave the enum out): as stored, and transposed.
const CUBLAS_OP_N: i32 = 0;
const CUBLAS_OP_T: i32 = 1;

/// cuBLASLt's workspace: what its fastest kernels for these shapes ask.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// Algorithms the heuristic is asked for per shape; each is timed on the
/// shape's first call and the fastest kept (the heuristic's first pick was
/// up to 17% slower than another candidate at the dx GEMM of shape A).
pub const CANDIDATES: usize = 6;

/// Timed runs of each candidate (after one untimed run).
const TIMED_RUNS: usize = 2;

/// One GEMM shape as cuBLASLt plans it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    /// Whether the head is `[n][k]` (the logits) rather than `[k][n]`.
    logits: bool,
    /// Whether our A is stored `[k][m]` ([`GemmDesc::a_columns`]).
    a_columns: bool,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
    /// Each operand's address alignment (bytes, a power of two ≤ 256):
    /// the heuristic must only pick algorithms that accept it.
    align: [u32; 3],
    /// Whether alpha and beta are read from device memory ([`Alpha::Device`]).
    alpha_on_device: bool,
}

/// Where a GEMM's alpha comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alpha {
    /// [`GemmDesc::alpha`], from the host.
    Host,
    /// The f32 at [`Gemm::device_alpha`] (`GemmDesc::alpha` folded in by
    /// whoever wrote it): cuBLASLt's device pointer mode takes beta from
    /// the device too, from words of ours holding 0 and 1.
    Device,
}

/// A call's alpha and beta as cuBLASLt takes them: values, or the
/// addresses of device words.
#[derive(Clone, Copy, Debug)]
enum Scalars {
    Host(f32, f32),
    Device(u64, u64),
}

impl Key {
    /// The shape as the kept picks name it ([`Picks`]).
    fn text(&self) -> String {
        let [a, b, c] = self.align;
        format!(
            "{}{}{} GEMM {}x{}x{} lda {} ldb {} ldc {} align {a}/{b}/{c}",
            if self.logits { "logits" } else { "dx" },
            if self.a_columns { " (A as columns)" } else { "" },
            if self.alpha_on_device {
                " (alpha on the device)"
            } else {
                ""
            },
            self.m,
            self.n,
            self.k,
            self.lda,
            self.ldb,
            self.ldc
        )
    }
}

/// A plan: cuBLASLt's descriptors and chosen algorithm for one [`Key`].
struct Plan {
    desc: lts::cublasLtMatmulDesc_t,
    a: lts::cublasLtMatrixLayout_t,
    b: lts::cublasLtMatrixLayout_t,
    c: lts::cublasLtMatrixLayout_t,
    algo: lts::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created for this plan and is
        // destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.c);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// cuBLASLt's handle, its workspace, the plans made so far and the picks
/// kept between processes.
pub struct Gemm {
    handle: lts::cublasLtHandle_t,
    workspace: sys::CUdeviceptr,
    /// Four f32 words: a device alpha ([`Alpha::Device`]), 0 and 1 (its
    /// betas), and a spare.
    scalars: sys::CUdeviceptr,
    plans: Mutex<HashMap<Key, Plan>>,
    picks: Picks,
}

// SAFETY: the handle and plans are used with the context current and the
// plans behind their lock; cuBLASLt handles are thread-safe for matmul.
unsafe impl Send for Gemm {}
// SAFETY: as above.
unsafe impl Sync for Gemm {}

impl std::fmt::Debug for Gemm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gemm").field("workspace", &WORKSPACE_BYTES).finish()
    }
}

/// One step of a [`GemmDesc`] on cuBLASLt, at device addresses.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Call {
    /// An empty split-K part without accumulation: C's block is `alpha · 0`.
    Zero { c: u64, ldc: usize, n: usize, m: usize },
    /// One product, laid out as `key` says, on the operands at `a`, `b`, `c`.
    Matmul { key: Key, a: u64, b: u64, c: u64 },
}

/// The steps of `desc` on the buffers at `(a, b, c)`: one product per
/// split-K part, each on its slice of K and into its own C block.
fn calls(desc: &GemmDesc, (a, b, c): (u64, u64, u64), alpha_on_device: bool) -> Vec<Call> {
    let (m, n, k) = (desc.m, desc.n, desc.k);
    if m == 0 || n == 0 {
        return Vec::new();
    }
    let parts = desc.k_parts.max(1);
    let mut out = Vec::with_capacity(parts);
    for part in 0..parts {
        let range = k_part_range(k, parts, part);
        let (k0, kk) = (range.start, range.len());
        let c_at = c + 4 * (desc.c_offset + part * desc.c_part_stride) as u64;
        if kk == 0 {
            if !desc.accumulate {
                out.push(Call::Zero {
                    c: c_at,
                    ldc: desc.ldc,
                    n,
                    m,
                });
            }
            continue;
        }
        let a_at = match desc.a_columns {
            true => a + 2 * (desc.a_offset + k0 * desc.lda) as u64,
            false => a + 2 * (desc.a_offset + k0) as u64,
        };
        let b_at = match desc.b_layout {
            HeadLayout::Logits => b + 2 * k0 as u64,
            HeadLayout::Dx => b + 2 * (k0 * desc.ldb) as u64,
        };
        let key = Key {
            logits: desc.b_layout == HeadLayout::Logits,
            a_columns: desc.a_columns,
            m,
            n,
            k: kk,
            lda: desc.lda,
            ldb: desc.ldb,
            ldc: desc.ldc,
            align: [alignment(a_at), alignment(b_at), alignment(c_at)],
            alpha_on_device,
        };
        out.push(Call::Matmul {
            key,
            a: a_at,
            b: b_at,
            c: c_at,
        });
    }
    out
}

/// cuBLASLt's view of a [`Key`]: its operations on A and B, and the stored
/// shape `(rows, columns, leading dimension)` of its A (our head), B (our
/// rows) and C, all column-major.
struct Layouts {
    op_a: i32,
    op_b: i32,
    a: (usize, usize, usize),
    b: (usize, usize, usize),
    c: (usize, usize, usize),
}

impl Key {
    fn layouts(&self) -> Layouts {
        // The head plane is stored `[n][k]` (logits: column-major k × n,
        // transposed) or `[k][n]` (dx: column-major n × k, as it is).
        let (op_a, a) = match self.logits {
            true => (CUBLAS_OP_T, (self.k, self.n, self.ldb)),
            false => (CUBLAS_OP_N, (self.n, self.k, self.ldb)),
        };
        // Our A `[m][k]` is column-major k × m as it is; stored `[k][m]`,
        // it is column-major m × k, transposed.
        let (op_b, b) = match self.a_columns {
            false => (CUBLAS_OP_N, (self.k, self.m, self.lda)),
            true => (CUBLAS_OP_T, (self.m, self.k, self.lda)),
        };
        Layouts {
            op_a,
            op_b,
            a,
            b,
            c: (self.n, self.m, self.ldc),
        }
    }
}

fn alignment(address: u64) -> u32 {
    if address == 0 {
        256
    } else {
        1u32 << address.trailing_zeros().min(8)
    }
}

impl Gemm {
    /// A handle and workspace (the context must be current), taking the
    /// algorithms `picks` kept for shapes timed before.
    pub fn new(picks: Picks) -> Result<Self> {
        let handle = lt::create_handle().map_err(|e| cublas("creating a cuBLASLt handle", e))?;
        // SAFETY: the context is current; freed by drop.
        let workspace = unsafe { result::malloc_sync(WORKSPACE_BYTES) }
            .map_err(|e| alloc("cuBLASLt workspace", WORKSPACE_BYTES as u64, e))?;
        // SAFETY: as above.
        let scalars = unsafe { result::malloc_sync(16) }.map_err(|e| alloc("device GEMM scalars", 16, e))?;
        let words = [0f32, 0.0, 1.0, 0.0];
        // SAFETY: 16 bytes at our new allocation, from a live array.
        unsafe { result::memcpy_htod_sync(scalars, &words) }.map_err(|e| driver("writing the GEMM scalars", e))?;
        Ok(Self {
            handle,
            workspace,
            scalars,
            plans: Mutex::new(HashMap::new()),
            picks,
        })
    }

    /// The device word a GEMM with [`Alpha::Device`] takes its alpha from:
    /// written by a kernel queued before it.
    pub fn device_alpha(&self) -> u64 {
        self.scalars
    }

    /// The device word holding beta: 1 to add into C, 0 to overwrite it
    /// (the scalars' second and third words).
    fn device_beta(&self, accumulate: bool) -> u64 {
        self.scalars + if accumulate { 8 } else { 4 }
    }

    /// Queues `desc` on `stream` over the buffers at `a`, `b` and `c`
    /// (their device addresses), split-K parts and all. Row statistics are
    /// the caller's (cuBLASLt has no such epilogue).
    pub fn run(&self, stream: sys::CUstream, (a, b, c): (u64, u64, u64), desc: &GemmDesc, alpha: Alpha) -> Result<()> {
        for call in calls(desc, (a, b, c), alpha != Alpha::Host) {
            match call {
                Call::Zero { c, ldc, n, m } => {
                    // SAFETY: the descriptor check put C's m rows of n
                    // columns, ldc apart, inside its buffer.
                    unsafe { sys::cuMemsetD2D32Async(c, ldc * 4, 0, n, m, stream) }
                        .result()
                        .map_err(|e| driver("zeroing an empty split-K part", e))?;
                }
                Call::Matmul { key, a, b, c } => {
                    let scalars = match alpha {
                        Alpha::Host => Scalars::Host(desc.alpha, if desc.accumulate { 1.0 } else { 0.0 }),
                        Alpha::Device => Scalars::Device(self.scalars, self.device_beta(desc.accumulate)),
                    };
                    self.matmul(stream, key, (a, b, c), scalars, desc.accumulate)?
                }
            }
        }
        Ok(())
    }

    fn matmul(
        &self,
        stream: sys::CUstream,
        key: Key,
        (a, b, c): (u64, u64, u64),
        scalars: Scalars,
        accumulate: bool,
    ) -> Result<()> {
        let mut plans = self.plans.lock().map_err(|_| Error::Backend {
            backend: BACKEND,
            message: "the GEMM plans' lock was poisoned by a panic".into(),
        })?;
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                // Without accumulation the call overwrites C next, so the
                // candidates may write there; else they get a scratch C.
                let timing_c = (!accumulate).then_some(c);
                e.insert(self.plan(&key, stream, (a, b, timing_c), scalars)?)
            }
        };
        // SAFETY: the plan's layouts describe the operands at these
        // addresses, which the descriptor check put inside their buffers.
        unsafe { self.launch(plan, &plan.algo, stream, (a, b, c), scalars) }.map_err(|e| {
            let name = if key.logits { "logits" } else { "dx" };
            cublas(format_args!("cuBLASLt {name} GEMM {}x{}x{}", key.m, key.n, key.k), e)
        })
    }

    /// Queues `plan` with `algo` on `stream`: `C = alpha · A · op(B) + beta
    /// · C` on our operands at `(a, b, c)` (cuBLASLt's A is our head `b`,
    /// its B our rows `a`; C is both input and output, as cuBLASLt allows
    /// when their layouts agree), in our workspace.
    ///
    /// # Safety
    ///
    /// The plan's layouts must describe live device memory at these
    /// addresses, with the context current.
    unsafe fn launch(
        &self,
        plan: &Plan,
        algo: &lts::cublasLtMatmulAlgo_t,
        stream: sys::CUstream,
        (a, b, c): (u64, u64, u64),
        scalars: Scalars,
    ) -> std::result::Result<(), cudarc::cublaslt::result::CublasError> {
        // Host values are read during the call; device words when the
        // GEMM runs (the plan's pointer mode says which).
        let values;
        let (alpha, beta) = match scalars {
            Scalars::Host(alpha, beta) => {
                values = [alpha, beta];
                (
                    &values[0] as *const f32 as *const c_void,
                    &values[1] as *const f32 as *const c_void,
                )
            }
            Scalars::Device(alpha, beta) => (alpha as *const c_void, beta as *const c_void),
        };
        // SAFETY: the caller's contract; the scalars live through the call.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                alpha,
                beta,
                b as *const c_void,
                plan.a,
                a as *const c_void,
                plan.b,
                c as *const c_void,
                plan.c,
                c as *mut c_void,
                plan.c,
                algo,
                self.workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream as lts::cudaStream_t,
            )
        }
    }

    /// The plan for `key`: cuBLASLt's descriptors and, of the heuristic's
    /// candidates, the one that ran fastest on the call's own operands `a`
    /// and `b`, into `c` (a C the call overwrites next) or, where that is
    /// `None`, a scratch C.
    fn plan(
        &self,
        key: &Key,
        stream: sys::CUstream,
        (a, b, c): (u64, u64, Option<u64>),
        scalars: Scalars,
    ) -> Result<Plan> {
        let name = if key.logits { "logits" } else { "dx" };
        let what = |step: &str| format!("planning the {name} GEMM {}x{}x{}: {step}", key.m, key.n, key.k);
        use lts::cudaDataType_t::{CUDA_R_16F, CUDA_R_32F};
        // cuBLASLt's A: the head plane; its B: the rows `[m][k]`; its C:
        // `[m][n]`, all row-major (Key::layouts).
        let layouts = key.layouts();
        let op_a = layouts.op_a;
        let desc = lt::create_matmul_desc(lts::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F)
            .map_err(|e| cublas(what("matmul descriptor"), e))?;
        let mut plan = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            // SAFETY: a plain C struct of integers, filled by the heuristic.
            algo: unsafe { std::mem::zeroed() },
        };
        let op_b = layouts.op_b;
        // SAFETY: the descriptor is live; each attribute is the size the
        // API states (a cublasOperation_t).
        unsafe {
            lt::set_matmul_desc_attribute(
                plan.desc,
                lts::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &op_a as *const _ as *const c_void,
                std::mem::size_of_val(&op_a),
            )
            .map_err(|e| cublas(what("TRANSA"), e))?;
            lt::set_matmul_desc_attribute(
                plan.desc,
                lts::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &op_b as *const _ as *const c_void,
                std::mem::size_of_val(&op_b),
            )
            .map_err(|e| cublas(what("TRANSB"), e))?;
            if key.alpha_on_device {
                let mode = lts::cublasLtPointerMode_t::CUBLASLT_POINTER_MODE_DEVICE as i32;
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    lts::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_POINTER_MODE,
                    &mode as *const i32 as *const c_void,
                    std::mem::size_of_val(&mode),
                )
                .map_err(|e| cublas(what("POINTER_MODE"), e))?;
            }
        }
        let layout = |ty, (rows, cols, ld): (usize, usize, usize)| {
            lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
        };
        plan.a = layout(CUDA_R_16F, layouts.a).map_err(|e| cublas(what("head layout"), e))?;
        plan.b = layout(CUDA_R_16F, layouts.b).map_err(|e| cublas(what("rows layout"), e))?;
        plan.c = layout(CUDA_R_32F, layouts.c).map_err(|e| cublas(what("output layout"), e))?;
        let pref = lt::create_matmul_pref().map_err(|e| cublas(what("preference"), e))?;
        let workspace = WORKSPACE_BYTES as u64;
        // cuBLASLt's A is our B (the head), its B our A (the rows).
        let aligns = [
            (
                lts::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                key.align[1],
            ),
            (
                lts::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                key.align[0],
            ),
            (
                lts::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                key.align[2],
            ),
            (
                lts::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                key.align[2],
            ),
        ];
        // SAFETY: the preference is live; each attribute has the size the
        // API states (u64 workspace, u32 alignments); destroyed below.
        let heuristic = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                lts::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &workspace as *const u64 as *const c_void,
                8,
            )
            .and_then(|()| {
                aligns.iter().try_for_each(|(attr, bytes)| {
                    lt::set_matmul_pref_attribute(pref, *attr, bytes as *const u32 as *const c_void, 4)
                })
            });
            let mut found: [lts::cublasLtMatmulHeuristicResult_t; CANDIDATES] = std::mem::zeroed();
            let mut count = 0;
            let asked = set.and_then(|()| {
                lts::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    plan.desc,
                    plan.a,
                    plan.b,
                    plan.c,
                    plan.c,
                    pref,
                    CANDIDATES as i32,
                    found.as_mut_ptr(),
                    &mut count,
                )
                .result()
            });
            let _ = lt::destroy_matmul_pref(pref);
            asked.map_err(|e| cublas(what("cublasLtMatmulAlgoGetHeuristic"), e))?;
            let usable: Vec<lts::cublasLtMatmulAlgo_t> = found[..count.clamp(0, CANDIDATES as i32) as usize]
                .iter()
                .filter(|h| h.state == lts::cublasStatus_t::CUBLAS_STATUS_SUCCESS && h.workspaceSize <= WORKSPACE_BYTES)
                .map(|h| h.algo)
                .collect();
            usable
        };
        plan.algo = match heuristic.as_slice() {
            [] => {
                return Err(Error::Backend {
                    backend: BACKEND,
                    message: what("cuBLASLt has no algorithm for it"),
                })
            }
            [only] => *only,
            several => {
                let shape = key.text();
                let data: Vec<_> = several.iter().map(|algo| algo.data).collect();
                match self.picks.kept(&shape, &data) {
                    Some(i) => {
                        log::info!("cuda: {shape}: cuBLASLt candidate #{i}, kept from an earlier timing");
                        several[i]
                    }
                    None => {
                        let algo = self.fastest(&plan, several, stream, (a, b, c), scalars, key)?;
                        self.picks.keep(&shape, algo.data);
                        algo
                    }
                }
            }
        };
        Ok(plan)
    }

    /// Of `algos`, the one that runs `plan` fastest on `a` and `b` into
    /// `c`, or a scratch C where that is `None` (timed with events on
    /// `stream`, which the host waits for: once per shape).
    fn fastest(
        &self,
        plan: &Plan,
        algos: &[lts::cublasLtMatmulAlgo_t],
        stream: sys::CUstream,
        (a, b, c): (u64, u64, Option<u64>),
        scalars: Scalars,
        key: &Key,
    ) -> Result<lts::cublasLtMatmulAlgo_t> {
        // The candidates overwrite C (beta 0).
        let scalars = match scalars {
            Scalars::Host(alpha, _) => Scalars::Host(alpha, 0.0),
            Scalars::Device(alpha, _) => Scalars::Device(alpha, self.device_beta(false)),
        };
        let times = match c {
            Some(c) => self.time_each(plan, algos, stream, (a, b, c), scalars)?,
            None => {
                let bytes = 4 * (key.ldc * (key.m - 1) + key.n);
                // SAFETY: the context is current; freed below.
                let scratch =
                    unsafe { result::malloc_sync(bytes) }.map_err(|e| alloc("GEMM timing scratch", bytes as u64, e))?;
                let timed = self.time_each(plan, algos, stream, (a, b, scratch), scalars);
                // SAFETY: our allocation; the timing waited for the stream.
                let _ = unsafe { result::free_sync(scratch) };
                timed?
            }
        };
        let best = times
            .iter()
            .enumerate()
            .filter(|(_, t)| t.is_finite())
            .min_by(|x, y| x.1.total_cmp(y.1))
            .map_or(0, |(i, _)| i);
        log::info!(
            "cuda: {} GEMM {}x{}x{}: {} cuBLASLt candidates timed ({} ms), kept #{best}",
            if key.logits { "logits" } else { "dx" },
            key.m,
            key.n,
            key.k,
            algos.len(),
            times.iter().map(|t| format!("{t:.2}")).collect::<Vec<_>>().join(" ")
        );
        Ok(algos[best])
    }

    /// Each algorithm's mean ms over [`TIMED_RUNS`] after one untimed run
    /// (infinite where it failed to launch).
    fn time_each(
        &self,
        plan: &Plan,
        algos: &[lts::cublasLtMatmulAlgo_t],
        stream: sys::CUstream,
        (a, b, c): (u64, u64, u64),
        scalars: Scalars,
    ) -> Result<Vec<f32>> {
        let event = || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| driver("creating a timing event", e))
        };
        let (start, end) = (event()?, event()?);
        let mut times = Vec::with_capacity(algos.len());
        for algo in algos {
            // SAFETY: as in `matmul`, into a C of the call's C's extent.
            let run = || unsafe { self.launch(plan, algo, stream, (a, b, c), scalars) };
            if run().is_err() {
                times.push(f32::INFINITY);
                continue;
            }
            // SAFETY: live events on the stream.
            unsafe { result::event::record(start, stream) }.map_err(|e| driver("recording a timing event", e))?;
            let ran = (0..TIMED_RUNS).try_for_each(|_| run());
            // SAFETY: as above; the host waits for the runs once.
            let ms = unsafe {
                result::event::record(end, stream).map_err(|e| driver("recording a timing event", e))?;
                result::event::synchronize(end).map_err(|e| driver("timing cuBLASLt's candidates", e))?;
                result::event::elapsed(start, end).map_err(|e| driver("timing cuBLASLt's candidates", e))?
            };
            times.push(if ran.is_ok() {
                ms / TIMED_RUNS as f32
            } else {
                f32::INFINITY
            });
        }
        // SAFETY: ours, no longer recorded.
        unsafe {
            let _ = result::event::destroy(start);
            let _ = result::event::destroy(end);
        }
        Ok(times)
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        // SAFETY: created by `new`, destroyed once, with the context
        // current (the backend drops this while bound).
        unsafe {
            let _ = lt::destroy_handle(self.handle);
            let _ = result::free_sync(self.workspace);
            let _ = result::free_sync(self.scalars);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLASLt's product as its documentation defines it, on f64 copies
    /// of our buffers `rows` (our A), `head` (our B) and `c` (element `i`
    /// of a buffer at byte `i · size`): `D = alpha · op(A) · B + beta · C`,
    /// column-major, D over C, where cuBLASLt's A is the head and its B
    /// the rows.
    fn emulate(call: &Call, (rows, head, c): (&[f64], &[f64], &mut [f64]), alpha: f64, beta: f64) {
        match *call {
            Call::Zero { c: at, ldc, n, m } => {
                for j in 0..m {
                    for i in 0..n {
                        c[at as usize / 4 + i + j * ldc] = 0.0;
                    }
                }
            }
            Call::Matmul {
                key,
                a: a_at,
                b: b_at,
                c: c_at,
            } => {
                let l = key.layouts();
                let (rows0, head0, c0) = (a_at as usize / 2, b_at as usize / 2, c_at as usize / 4);
                // op(A) is n × k; op(B) is k × m; D is n × m.
                let op_a = |i: usize, p: usize| match l.op_a {
                    CUBLAS_OP_T => head[head0 + p + i * l.a.2],
                    _ => head[head0 + i + p * l.a.2],
                };
                let op_b = |p: usize, j: usize| match l.op_b {
                    CUBLAS_OP_T => rows[rows0 + j + p * l.b.2],
                    _ => rows[rows0 + p + j * l.b.2],
                };
                for j in 0..key.m {
                    for i in 0..key.n {
                        let dot: f64 = (0..key.k).map(|p| op_a(i, p) * op_b(p, j)).sum();
                        let at = c0 + i + j * l.c.2;
                        c[at] = alpha * dot + beta * c[at];
                    }
                }
            }
        }
    }

    /// The calls of a descriptor compute core's row-major product, split-K
    /// parts (one of them empty), offsets, strides, accumulation and A
    /// stored as columns included: exact small integers, each case against
    /// the definition.
    #[test]
    fn the_calls_compute_cores_row_major_product() {
        for (layout, k_parts, accumulate, a_columns) in [
            (HeadLayout::Logits, 1, false, false),
            (HeadLayout::Dx, 1, true, false),
            (HeadLayout::Logits, 3, true, false),
            (HeadLayout::Dx, 4, false, false),
            (HeadLayout::Dx, 1, true, true),
            (HeadLayout::Dx, 1, false, true),
        ] {
            // K 150: parts of 64 (core's split rounds up to a multiple of 64),
            // so 3 parts are 64, 64, 22 and 4 parts leave the last empty.
            let (m, n, k) = (5, 7, 150);
            // A `[m][k]`, or as columns `[k][m]`, with room past each row.
            let a_rows = if a_columns { k } else { m };
            let desc = GemmDesc {
                a_offset: 8,
                lda: if a_columns { m + 8 + 3 } else { k + 8 + 16 },
                a_columns,
                ldb: match layout {
                    HeadLayout::Logits => k + 16,
                    HeadLayout::Dx => n + 9,
                },
                c_offset: 4,
                ldc: n + 3,
                alpha: 0.5,
                accumulate,
                k_parts,
                c_part_stride: 64,
                ..GemmDesc::dense(m, n, k, layout)
            };
            let value = |i: usize| ((i * 7 + 3) % 11) as f64 - 5.0;
            let a: Vec<f64> = (0..desc.lda * a_rows + 64).map(value).collect();
            let b: Vec<f64> = (0..desc.ldb * k.max(n) + 64).map(|i| value(i + 5)).collect();
            let c_len = desc.c_offset + (k_parts - 1) * desc.c_part_stride + desc.ldc * m;
            let c0: Vec<f64> = (0..c_len).map(|i| value(i + 2)).collect();
            let mut c = c0.clone();
            let beta = if accumulate { 1.0 } else { 0.0 };
            let steps = calls(&desc, (0, 0, 0), false);
            for call in &steps {
                emulate(call, (&a, &b, &mut c), f64::from(desc.alpha), beta);
            }
            for part in 0..k_parts {
                let range = k_part_range(k, k_parts, part);
                for i in 0..m {
                    for j in 0..n {
                        let dot: f64 = range
                            .clone()
                            .map(|p| {
                                let head = match layout {
                                    HeadLayout::Logits => b[j * desc.ldb + p],
                                    HeadLayout::Dx => b[p * desc.ldb + j],
                                };
                                let at = match a_columns {
                                    true => desc.a_offset + p * desc.lda + i,
                                    false => desc.a_offset + i * desc.lda + p,
                                };
                                a[at] * head
                            })
                            .sum();
                        let at = desc.c_offset + part * desc.c_part_stride + i * desc.ldc + j;
                        let want = 0.5 * dot + beta * c0[at];
                        assert_eq!(c[at], want, "{layout:?} parts {k_parts} part {part} C[{i}][{j}]");
                    }
                }
            }
            // An empty part is zeroed, or left alone when adding.
            let zeros = steps.iter().filter(|s| matches!(s, Call::Zero { .. })).count();
            let empty = (0..k_parts).filter(|&p| k_part_range(k, k_parts, p).is_empty()).count();
            assert_eq!(zeros, if accumulate { 0 } else { empty }, "{layout:?} {k_parts}");
        }
        assert_eq!(k_part_range(150, 4, 3).len(), 0, "the case has an empty part");
        let empty = GemmDesc::dense(0, 8, 16, HeadLayout::Dx);
        assert!(calls(&empty, (0, 0, 0), false).is_empty());
    }

    /// A device alpha is part of the plan's key and of the kept pick's
    /// name: cuBLASLt's algorithms are chosen per pointer mode.
    #[test]
    fn a_device_alpha_is_its_own_shape() {
        let desc = GemmDesc::dense(64, 32, 48, HeadLayout::Dx);
        let key = |on_device| match calls(&desc, (0, 0, 0), on_device).as_slice() {
            [Call::Matmul { key, .. }] => *key,
            other => panic!("{other:?}"),
        };
        let (host, device) = (key(false), key(true));
        assert_ne!(host, device);
        assert!(!host.text().contains("alpha on the device"), "{}", host.text());
        assert!(device.text().contains("(alpha on the device)"), "{}", device.text());
    }

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1010), 16);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0), 256);
    }
}
