//! The bulk PTX tiles (`headkl_core::toolkit::WgmmaFeed::Bulk`) on this backend:
//! each GEMM as the pack and GEMM launches of `headkl_core::toolkit::wgmma_tile::
//! bulk_plan`, through two pack buffers of `BULK_PACK_BYTES` each (A's and
//! B's) that the backend makes on the first bulk launch and keeps. Every
//! launch is ordered after the one before it (the stream's barrier), so
//! the pieces can reuse the buffers.

use headkl_core::toolkit::params::GemmParams;
use headkl_core::toolkit::wgmma_tile::{bulk_plan, BulkStep, PackKind, BULK_PACK_BYTES};
use headkl_core::toolkit::{fold_workgroups, HeadLayout, WgmmaTile};
use headkl_core::Result;

use crate::conv::backend_error;
use crate::memory::VulkanBuffer;
use crate::nvx::PtxLaunch;

/// The bulk tiles' packed operands: A's and B's, [`BULK_PACK_BYTES`] each.
pub(crate) struct PackBuffers {
    a: VulkanBuffer,
    b: VulkanBuffer,
}

impl crate::VulkanBackend {
    /// Records bulk tile `tile`'s GEMM of `layout` on `[a, b, c]`, `params`
    /// its checked block: the GEMMs timed under `label`, the packs under
    /// [`headkl_core::toolkit::KernelId::pack_label`]'s (so the kernel times show
    /// both, and `headkl tune` adds them).
    pub(crate) fn bulk_dispatch(
        &self,
        tile: WgmmaTile,
        layout: HeadLayout,
        [a, b, c]: [&VulkanBuffer; 3],
        params: &GemmParams,
        label: &'static str,
    ) -> Result<()> {
        let what = headkl_core::toolkit::CoopGemm::Wgmma(tile).to_string();
        let pack_label = headkl_core::toolkit::KernelId::gemm(layout).pack_label();
        let steps =
            bulk_plan(layout, params, BULK_PACK_BYTES).map_err(|why| backend_error(format!("{what}: {why}")))?;
        let mut pack = self
            .pack
            .lock()
            .map_err(|_| backend_error("the pack buffers' lock was poisoned by a panic"))?;
        if pack.is_none() {
            *pack = Some(PackBuffers {
                a: VulkanBuffer::new(&self.device, BULK_PACK_BYTES, "wgmma pack A")?,
                b: VulkanBuffer::new(&self.device, BULK_PACK_BYTES, "wgmma pack B")?,
            });
        }
        let Some(pack) = pack.as_ref() else {
            return Err(backend_error(format!("{what}: no pack buffers")));
        };
        let (a_at, b_at, c_at) = (a.device_address()?, b.device_address()?, c.device_address()?);
        let (pack_a, pack_b) = (pack.a.device_address()?, pack.b.device_address()?);
        for step in steps {
            match step {
                BulkStep::Pack {
                    kind,
                    src_offset,
                    params,
                } => {
                    let (src, src_at, dst, dst_at) = match kind {
                        PackKind::A => (a, a_at, &pack.a, pack_a),
                        PackKind::LogitsB | PackKind::DxB => (b, b_at, &pack.b, pack_b),
                    };
                    let grid = fold_workgroups(kind.blocks(params.rows, params.kdim));
                    let params = params.with_grid(grid.0);
                    let launch = PtxLaunch {
                        entry: kind.entry(),
                        params: bytemuck::bytes_of(&params),
                        // f16 elements: two bytes each.
                        addresses: [src_at + 2 * src_offset, dst_at, dst_at],
                        grid,
                        threads: PackKind::THREADS,
                    };
                    self.ptx_launch(&what, &launch, &[src.into(), dst.into()], pack_label)?;
                }
                BulkStep::Gemm(piece) => {
                    let tiles = u64::from(piece.m.div_ceil(tile.bm)) * u64::from(piece.n.div_ceil(tile.bn()));
                    let grid = fold_workgroups(tiles);
                    let piece = piece.with_grid(grid.0);
                    let launch = PtxLaunch {
                        entry: tile.entry(layout),
                        params: bytemuck::bytes_of(&piece),
                        addresses: [pack_a, pack_b, c_at],
                        grid,
                        threads: tile.invocations(),
                    };
                    self.ptx_launch(&what, &launch, &[(&pack.a).into(), (&pack.b).into(), c.into()], label)?;
                }
            }
        }
        Ok(())
    }
}
