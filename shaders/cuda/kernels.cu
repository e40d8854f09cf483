// The CUDA backend's kernels (crates/backend-cuda): every kernel of the
// catalogue (headkl_core::toolkit::KernelId) but the GEMMs, which run on
// cuBLASLt. Each is the CUDA C twin of its WGSL kernel in shaders/: the same
// entry name, block size (WG), bindings and parameter block, so core's
// launches drive both. Entry points take the parameter block by value, then
// the buffers in binding order. scripts/ptx.sh compiles this file and the
// headers beside it into kernels.ptx. See shaders/README.md, "CUDA kernels".
#include "common.cuh"
#include "small.cuh"
#include "kl_rows.cuh"
#include "topk_rows.cuh"
#include "resident.cuh"
