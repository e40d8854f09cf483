//! The device-resident kernels (`shaders/resident_*.wgsl`) and the backend
//! trait that runs them.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::params::ResidentParams;

use crate::kernels::{Access, Shader};
use Access::{Read, ReadWrite};

macro_rules! resident_shader {
    ($file:literal) => {
        Shader {
            file: $file,
            text: concat!(
                include_str!("../../../../shaders/resident_common.wgsl"),
                include_str!(concat!("../../../../shaders/", $file))
            ),
            params: ResidentParams::BLOCK,
        }
    };
}

/// One device-resident kernel: its shader, entry point, workgroup size and
/// storage bindings (1.. in order), as [`crate::kernels`] describes the
/// driver's kernels. Every one takes [`ResidentParams`] at binding 0 (the
/// declaration generated into `resident_common.wgsl`'s marker), and its
/// shader is `shaders/resident_common.wgsl` followed by its own file (WGSL
/// has no include).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResidentKernel {
    /// Weights → total, gscale and the KL and dx coefficients; bad weights
    /// flagged. One workgroup.
    WeightStats,
    /// The caller's teacher rows (probabilities or log-probabilities)
    /// checked, clamped and renormalized (in the renormalize tail mode) into
    /// scratch, with each row's KL coefficient.
    TeacherRows,
    /// The caller's labels checked into the KL kernel's per-row inputs
    /// (none where no labels are given).
    LabelsIn,
    /// The caller's f32, f16 or bf16 hidden rows into the padded f16 operand.
    HiddenIn,
    /// A chunk's loss and dx into the caller's buffers.
    LossOut,
    /// A chunk's top-k ids and probabilities into the caller's buffers.
    TopkOut,
    /// The first flagged row described for the host's error. One invocation.
    StatusDetail,
}

impl ResidentKernel {
    /// Every kernel.
    pub const ALL: [ResidentKernel; 7] = [
        ResidentKernel::WeightStats,
        ResidentKernel::TeacherRows,
        ResidentKernel::LabelsIn,
        ResidentKernel::HiddenIn,
        ResidentKernel::LossOut,
        ResidentKernel::TopkOut,
        ResidentKernel::StatusDetail,
    ];

    /// Its shader: `resident_common.wgsl` then its own file; build it from
    /// [`Shader::source`].
    pub const fn shader(self) -> Shader {
        match self {
            ResidentKernel::WeightStats => resident_shader!("resident_stats.wgsl"),
            ResidentKernel::TeacherRows => resident_shader!("resident_teacher.wgsl"),
            ResidentKernel::LabelsIn => resident_shader!("resident_labels.wgsl"),
            ResidentKernel::HiddenIn => resident_shader!("resident_hidden.wgsl"),
            ResidentKernel::LossOut => resident_shader!("resident_loss_out.wgsl"),
            ResidentKernel::TopkOut => resident_shader!("resident_topk_out.wgsl"),
            ResidentKernel::StatusDetail => resident_shader!("resident_status.wgsl"),
        }
    }

    /// Its own shader file in `shaders/` (after `resident_common.wgsl`).
    pub const fn file(self) -> &'static str {
        self.shader().file
    }

    /// The entry point.
    pub fn entry(self) -> &'static str {
        match self {
            ResidentKernel::WeightStats => "weight_stats",
            ResidentKernel::TeacherRows => "teacher_rows",
            ResidentKernel::LabelsIn => "labels_in",
            ResidentKernel::HiddenIn => "hidden_in",
            ResidentKernel::LossOut => "loss_out",
            ResidentKernel::TopkOut => "topk_out",
            ResidentKernel::StatusDetail => "status_detail",
        }
    }

    /// Invocations per workgroup.
    pub fn workgroup_size(self) -> u32 {
        match self {
            ResidentKernel::StatusDetail => 1,
            _ => 256,
        }
    }

    /// Storage bindings 1.., in order.
    pub fn bindings(self) -> &'static [Access] {
        match self {
            ResidentKernel::WeightStats => &[Read, ReadWrite],
            ResidentKernel::TeacherRows => &[Read, Read, Read, ReadWrite, ReadWrite, ReadWrite, ReadWrite],
            ResidentKernel::LabelsIn => &[Read, ReadWrite, ReadWrite],
            ResidentKernel::HiddenIn => &[Read, ReadWrite],
            ResidentKernel::LossOut => &[Read, Read, ReadWrite, ReadWrite, ReadWrite, ReadWrite],
            ResidentKernel::TopkOut => &[Read, Read, ReadWrite, ReadWrite, ReadWrite],
            ResidentKernel::StatusDetail => &[Read, Read, Read, ReadWrite, Read],
        }
    }

    /// Checks that a dispatch on `backend` brings one buffer for each of
    /// its bindings.
    pub fn check_buffers(self, backend: &'static str, buffers: usize) -> Result<()> {
        let bindings = self.bindings().len();
        if buffers != bindings {
            return Err(Error::Backend {
                backend,
                message: format!("{}: {buffers} buffers for {bindings} bindings", self.entry()),
            });
        }
        Ok(())
    }
}

/// A backend that can run the device-resident entry points
/// ([`crate::Engine::head_kl_device`], [`crate::Engine::topk_device`]) on
/// buffers the caller owns.
///
/// A caller's buffer is the backend's buffer type wrapping the caller's
/// device buffer with a byte offset and length (a view); the backend binds
/// exactly that view, so a view must start at a multiple of 256 bytes (the
/// largest storage-binding offset alignment Vulkan allows) and its length
/// must be a multiple of 4.
pub trait ResidentBackend: Backend {
    /// Bytes a buffer (or a view of a caller's buffer) spans.
    fn buffer_len(&self, buffer: &Self::Buffer) -> u64;

    /// Byte offset of a view inside the caller's buffer (0 for the
    /// backend's own buffers).
    fn buffer_offset(&self, buffer: &Self::Buffer) -> u64;

    /// Records one dispatch of `kernel` over `workgroups` workgroups
    /// (folded by the backend, which fills `params.grid_x`), with `buffers`
    /// at bindings 1.. as [`ResidentKernel::bindings`] lists them.
    fn resident_dispatch(
        &self,
        kernel: ResidentKernel,
        buffers: &[&Self::Buffer],
        params: &ResidentParams,
        workgroups: u64,
    ) -> Result<()>;

    /// Submits everything recorded so far to the device without waiting.
    fn submit(&self) -> Result<()>;
}

/// A shared reference to a resident backend is one.
impl<T: ResidentBackend + ?Sized> ResidentBackend for &T {
    fn buffer_len(&self, buffer: &Self::Buffer) -> u64 {
        (**self).buffer_len(buffer)
    }
    fn buffer_offset(&self, buffer: &Self::Buffer) -> u64 {
        (**self).buffer_offset(buffer)
    }
    fn resident_dispatch(
        &self,
        kernel: ResidentKernel,
        buffers: &[&Self::Buffer],
        params: &ResidentParams,
        workgroups: u64,
    ) -> Result<()> {
        (**self).resident_dispatch(kernel, buffers, params, workgroups)
    }
    fn submit(&self) -> Result<()> {
        (**self).submit()
    }
}
