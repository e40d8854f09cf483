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
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
    /// Each operand's address alignment (bytes, a power of two ≤ 256):
    /// the heuristic must only pick algorithms that accept it.
    align: [u32; 3],
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

/// cuBLASLt's handle, its workspace and the plans made so far.
pub struct Gemm {
    handle: lts::cublasLtHandle_t,
    workspace: sys::CUdeviceptr,
    plans: Mutex<HashMap<Key, Plan>>,
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

fn alignment(address: u64) -> u32 {
    if address == 0 {
        256
    } else {
        1u32 << address.trailing_zeros().min(8)
    }
}

impl Gemm {
    /// A handle and workspace (the context must be current).
    pub fn new() -> Result<Self> {
        let handle = lt::create_handle().map_err(|e| cublas("creating a cuBLASLt handle", e))?;
        // SAFETY: the context is current; freed by drop.
        let workspace = unsafe { result::malloc_sync(WORKSPACE_BYTES) }
            .map_err(|e| alloc("cuBLASLt workspace", WORKSPACE_BYTES as u64, e))?;
        Ok(Self {
            handle,
            workspace,
            plans: Mutex::new(HashMap::new()),
        })
    }

    /// Queues `desc` on `stream` over the buffers at `a`, `b` and `c`
    /// (their device addresses), split-K parts and all. Row statistics are
    /// the caller's (cuBLASLt has no such epilogue).
    pub fn run(&self, stream: sys::CUstream, a: u64, b: u64, c: u64, desc: &GemmDesc) -> Result<()> {
        let (m, n, k) = (desc.m, desc.n, desc.k);
        if m == 0 || n == 0 {
            return Ok(());
        }
        for part in 0..desc.k_parts.max(1) {
            let range = k_part_range(k, desc.k_parts.max(1), part);
            let (k0, kk) = (range.start, range.len());
            let c_at = c + 4 * (desc.c_offset + part * desc.c_part_stride) as u64;
            if kk == 0 {
                // An empty part writes alpha · 0.
                if !desc.accumulate {
                    // SAFETY: the descriptor check put C's m rows of n
                    // columns, ldc apart, inside its buffer.
                    unsafe { sys::cuMemsetD2D32Async(c_at, desc.ldc * 4, 0, n, m, stream) }
                        .result()
                        .map_err(|e| driver("zeroing an empty split-K part", e))?;
                }
                continue;
            }
            let a_at = a + 2 * (desc.a_offset + k0) as u64;
            let b_at = match desc.b_layout {
                HeadLayout::Logits => b + 2 * k0 as u64,
                HeadLayout::Dx => b + 2 * (k0 * desc.ldb) as u64,
            };
            let key = Key {
                logits: desc.b_layout == HeadLayout::Logits,
                m,
                n,
                k: kk,
                lda: desc.lda,
                ldb: desc.ldb,
                ldc: desc.ldc,
                align: [alignment(a_at), alignment(b_at), alignment(c_at)],
            };
            self.matmul(stream, key, a_at, b_at, c_at, desc.alpha, desc.accumulate)?;
        }
        Ok(())
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the three operands, the scale and the mode of one call"
    )]
    fn matmul(
        &self,
        stream: sys::CUstream,
        key: Key,
        a: u64,
        b: u64,
        c: u64,
        alpha: f32,
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
                e.insert(self.plan(&key, stream, (a, b, timing_c, alpha))?)
            }
        };
        let beta: f32 = if accumulate { 1.0 } else { 0.0 };
        // SAFETY: the plan's layouts describe the operands at these
        // addresses, which the descriptor check put inside their buffers;
        // the workspace is ours; C is both input and output, as cuBLASLt
        // allows when their layouts agree.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b as *const c_void,
                plan.a,
                a as *const c_void,
                plan.b,
                c as *const c_void,
                plan.c,
                c as *mut c_void,
                plan.c,
                &plan.algo,
                self.workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream as lts::cudaStream_t,
            )
        }
        .map_err(|e| {
            let name = if key.logits { "logits" } else { "dx" };
            cublas(format_args!("cuBLASLt {name} GEMM {}x{}x{}", key.m, key.n, key.k), e)
        })
    }

    /// The plan for `key`: cuBLASLt's descriptors and, of the heuristic's
    /// candidates, the one that ran fastest on the call's own operands `a`
    /// and `b`, into `c` (a C the call overwrites next) or, where that is
    /// `None`, a scratch C.
    fn plan(&self, key: &Key, stream: sys::CUstream, (a, b, c, alpha): (u64, u64, Option<u64>, f32)) -> Result<Plan> {
        let name = if key.logits { "logits" } else { "dx" };
        let what = |step: &str| format!("planning the {name} GEMM {}x{}x{}: {step}", key.m, key.n, key.k);
        use lts::cudaDataType_t::{CUDA_R_16F, CUDA_R_32F};
        // cuBLASLt's A: the head plane, stored `[n][k]` (logits) or `[k][n]`
        // (dx); its B: the rows `[m][k]`; its C: `[m][n]`, all row-major.
        let (op_a, a_rows, a_cols) = match key.logits {
            true => (CUBLAS_OP_T, key.k, key.n),
            false => (CUBLAS_OP_N, key.n, key.k),
        };
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
        let op_b = CUBLAS_OP_N;
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
        }
        plan.a = lt::create_matrix_layout(CUDA_R_16F, a_rows as u64, a_cols as u64, key.ldb as i64)
            .map_err(|e| cublas(what("head layout"), e))?;
        plan.b = lt::create_matrix_layout(CUDA_R_16F, key.k as u64, key.m as u64, key.lda as i64)
            .map_err(|e| cublas(what("rows layout"), e))?;
        plan.c = lt::create_matrix_layout(CUDA_R_32F, key.n as u64, key.m as u64, key.ldc as i64)
            .map_err(|e| cublas(what("output layout"), e))?;
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
            several => self.fastest(&plan, several, stream, (a, b, c, alpha), key)?,
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
        (a, b, c, alpha): (u64, u64, Option<u64>, f32),
        key: &Key,
    ) -> Result<lts::cublasLtMatmulAlgo_t> {
        let times = match c {
            Some(c) => self.time_each(plan, algos, stream, (a, b, c, alpha))?,
            None => {
                let bytes = 4 * (key.ldc * (key.m - 1) + key.n);
                // SAFETY: the context is current; freed below.
                let scratch =
                    unsafe { result::malloc_sync(bytes) }.map_err(|e| alloc("GEMM timing scratch", bytes as u64, e))?;
                let timed = self.time_each(plan, algos, stream, (a, b, scratch, alpha));
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
        (a, b, c, alpha): (u64, u64, u64, f32),
    ) -> Result<Vec<f32>> {
        let event = || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| driver("creating a timing event", e))
        };
        let (start, end) = (event()?, event()?);
        let beta = 0f32;
        let mut times = Vec::with_capacity(algos.len());
        for algo in algos {
            // SAFETY: as in `matmul`, into the scratch C of C's extent.
            let run = || unsafe {
                lt::matmul(
                    self.handle,
                    plan.desc,
                    &alpha as *const f32 as *const c_void,
                    &beta as *const f32 as *const c_void,
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
            };
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1010), 16);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0), 256);
    }
}
