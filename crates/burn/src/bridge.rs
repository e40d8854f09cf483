//! burn tensors to headkl's buffer views and back.
//!
//! A burn tensor on the wgpu device is, under its dispatch and autodiff
//! layers, a fusion tensor; resolving it through the fusion client runs the
//! operations still queued for it and gives the cubecl tensor, whose handle
//! the cubecl client turns into the `wgpu::Buffer`, offset and size it
//! occupies. headkl views that range in place when its offset is a multiple
//! of [`BIND_ALIGN`]; otherwise the range is copied on the device into a
//! headkl-owned staging buffer (inputs before headkl's work, outputs after).

use std::any::Any;
use std::collections::HashMap;

#[cfg(feature = "fusion")]
use burn::backend::TensorMetadata;
use burn::backend::{BackendTensor, Cube, DispatchAutodiffContext, DispatchTensor, DispatchTensorKind};
use burn::prelude::{Int, Tensor};
use burn_cubecl::tensor::CubeTensor;
#[cfg(feature = "fusion")]
use burn_cubecl::CubeBackend;
#[cfg(feature = "fusion")]
use burn_fusion::{stream::StreamId, FusionTensor, NoOp};
#[cfg(feature = "fusion")]
use burn_ir::{BackendIr, InitOperationIr, OperationIr};
use cubecl::wgpu::{AutoCompiler, WgpuServer};
use headkl_core::{Error, Result};
use headkl_wgpu::{WgpuBackend, WgpuBuffer};

use crate::device::BIND_ALIGN;

/// The primitive every float and int tensor on the wgpu device is: with
/// burn's fusion, a fusion tensor over the cubecl tensor.
#[cfg(feature = "fusion")]
pub(crate) type Primitive = FusionTensor<burn_cubecl::fusion::FusionCubeRuntime>;
/// The primitive every float and int tensor on the wgpu device is: without
/// burn's fusion, the cubecl tensor itself.
#[cfg(not(feature = "fusion"))]
pub(crate) type Primitive = CubeTensor;

/// An autodiff float primitive over [`Cube`].
pub(crate) type AdTensor = <burn::backend::Autodiff<Cube> as burn::backend::BackendTypes>::FloatTensorPrimitive;

pub(crate) fn backend_error(what: &str, err: impl std::fmt::Display) -> Error {
    Error::Backend {
        backend: crate::BACKEND,
        message: format!("{what}: {err}"),
    }
}

fn not_here(field: &'static str, what: &str) -> Error {
    Error::DeviceBuffer {
        field,
        reason: format!("is {what}, not a tensor of burn's wgpu backend"),
    }
}

/// A float tensor taken apart: its fusion primitive and, for a tensor of
/// an autodiff device, its autodiff primitive (the graph node) and
/// checkpointing strategy.
pub(crate) struct FloatParts {
    pub inner: Primitive,
    pub autodiff: Option<(AdTensor, burn::backend::GradientCheckpointingStrategy)>,
}

pub(crate) fn float_parts<const D: usize>(tensor: Tensor<D>, field: &'static str) -> Result<FloatParts> {
    let dispatch: DispatchTensor = tensor.into_dispatch();
    let context = dispatch.autodiff;
    match dispatch.kind {
        DispatchTensorKind::Cube(BackendTensor::Float(inner)) => Ok(FloatParts { inner, autodiff: None }),
        DispatchTensorKind::Autodiff(boxed) => match *boxed {
            DispatchTensorKind::Cube(BackendTensor::Autodiff(ad)) => {
                let DispatchAutodiffContext::Enabled(strategy) = context else {
                    return Err(not_here(field, "an autodiff tensor without an autodiff context"));
                };
                let inner = ad.primitive().clone();
                Ok(FloatParts {
                    inner,
                    autodiff: Some((ad, strategy)),
                })
            }
            #[allow(
                unreachable_patterns,
                reason = "other backends exist when burn's features enable them"
            )]
            _ => Err(not_here(field, "an autodiff tensor of another backend")),
        },
        #[allow(
            unreachable_patterns,
            reason = "other backends exist when burn's features enable them"
        )]
        _ => Err(not_here(field, "not a float tensor of the cubecl backend")),
    }
}

pub(crate) fn int_inner<const D: usize>(tensor: Tensor<D, Int>, field: &'static str) -> Result<Primitive> {
    match tensor.into_dispatch().kind {
        DispatchTensorKind::Cube(BackendTensor::Int(inner)) => Ok(inner),
        #[allow(
            unreachable_patterns,
            reason = "other backends exist when burn's features enable them"
        )]
        _ => Err(not_here(field, "not an int tensor of the cubecl backend")),
    }
}

/// Runs what is queued for `t` and returns its cubecl tensor (`t` stays
/// valid: a clone is resolved).
#[cfg(feature = "fusion")]
pub(crate) fn resolve_float(t: &Primitive) -> CubeTensor {
    t.client.resolve_tensor_float::<CubeBackend>(t.clone())
}

#[cfg(feature = "fusion")]
pub(crate) fn resolve_int(t: &Primitive) -> CubeTensor {
    t.client.resolve_tensor_int::<CubeBackend>(t.clone())
}

/// `t`'s cubecl tensor (without fusion nothing is queued apart from it).
#[cfg(not(feature = "fusion"))]
pub(crate) fn resolve_float(t: &Primitive) -> CubeTensor {
    t.clone()
}

#[cfg(not(feature = "fusion"))]
pub(crate) fn resolve_int(t: &Primitive) -> CubeTensor {
    t.clone()
}

/// A cubecl tensor headkl wrote as burn's primitive (registered with the
/// fusion client).
#[cfg(feature = "fusion")]
fn register(t: CubeTensor, float: bool) -> Result<Primitive> {
    let client = burn_fusion::get_client::<CubeBackend>(&t.device);
    let (shape, dtype) = (t.shape(), t.dtype);
    let handle = if float {
        CubeBackend::float_tensor_handle(t)
    } else {
        CubeBackend::int_tensor_handle(t)
    };
    let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(StreamId::current(), OperationIr::Init(desc), NoOp::<CubeBackend>::new())
        .pop()
        .ok_or_else(|| backend_error("registering an output with burn's fusion", "no tensor came back"))
}

/// A cubecl tensor headkl wrote as burn's primitive.
#[cfg(not(feature = "fusion"))]
fn register(t: CubeTensor, _float: bool) -> Result<Primitive> {
    Ok(t)
}

/// A cubecl tensor headkl wrote as a burn float tensor.
pub(crate) fn float_tensor<const D: usize>(t: CubeTensor) -> Result<Tensor<D>> {
    Ok(Tensor::from_primitive::<Cube>(register(t, true)?))
}

/// A cubecl tensor headkl wrote as a burn int tensor.
pub(crate) fn int_tensor<const D: usize>(t: CubeTensor) -> Result<Tensor<D, Int>> {
    Ok(Tensor::from_primitive::<Cube>(register(t, false)?))
}

/// Copies `bytes` bytes of `t` (contiguous) into `dst` at `dst_offset` on
/// the device, after burn's queued work.
pub(crate) fn copy_into(
    t: &CubeTensor,
    (device, queue): (&wgpu::Device, &wgpu::Queue),
    dst: &wgpu::Buffer,
    dst_offset: u64,
    bytes: u64,
) -> Result<()> {
    let managed = t
        .client
        .get_resource::<WgpuServer<AutoCompiler>>(t.handle.clone())
        .map_err(|e| backend_error("head", e))?;
    t.client
        .flush()
        .map_err(|e| backend_error("flushing burn's queued work", e))?;
    let resource = managed.resource();
    let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
        label: Some("headkl-burn head"),
    });
    enc.copy_buffer_to_buffer(&resource.buffer, resource.offset, dst, dst_offset, bytes);
    queue.submit([enc.finish()]);
    Ok(())
}

/// How a call's tensors reached headkl.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Binding {
    /// Tensors headkl read or wrote in place, in burn's own buffers.
    pub in_place: usize,
    /// Tensors copied on the device through a staging buffer (an offset
    /// that is not a multiple of [`BIND_ALIGN`]).
    pub copied: usize,
    /// Bytes those copies moved.
    pub copied_bytes: u64,
}

/// headkl-owned staging buffers, one per role, grown as needed and kept
/// across calls.
#[derive(Default)]
pub(crate) struct Staging {
    buffers: HashMap<&'static str, wgpu::Buffer>,
}

impl Staging {
    fn get(&mut self, device: &wgpu::Device, role: &'static str, bytes: u64) -> wgpu::Buffer {
        if let Some(b) = self.buffers.get(role) {
            if b.size() >= bytes {
                return b.clone();
            }
        }
        let b = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(role),
            size: bytes.next_multiple_of(BIND_ALIGN),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.buffers.insert(role, b.clone());
        b
    }
}

/// Direction of a binding.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flow {
    In,
    Out,
}

/// One call's views: the cubecl resources they hold (kept until the work
/// is submitted), and the device copies to record around headkl's work.
pub(crate) struct Binder<'a> {
    device: &'a wgpu::Device,
    queue: &'a wgpu::Queue,
    staging: &'a mut Staging,
    keep: Vec<Box<dyn Any>>,
    copy_in: Vec<(wgpu::Buffer, u64, wgpu::Buffer, u64)>,
    copy_out: Vec<(wgpu::Buffer, wgpu::Buffer, u64, u64)>,
    pub stats: Binding,
}

impl<'a> Binder<'a> {
    /// A binder whose count starts from `earlier`, the call's copies made
    /// before binding (into contiguous tensors).
    pub fn new(device: &'a wgpu::Device, queue: &'a wgpu::Queue, staging: &'a mut Staging, earlier: Binding) -> Self {
        Self {
            device,
            queue,
            staging,
            keep: Vec::new(),
            copy_in: Vec::new(),
            copy_out: Vec::new(),
            stats: earlier,
        }
    }

    /// A view of `bytes` bytes of `t` (contiguous, row-major) for headkl.
    pub fn bind(
        &mut self,
        backend: &WgpuBackend,
        field: &'static str,
        t: &CubeTensor,
        bytes: u64,
        flow: Flow,
    ) -> Result<WgpuBuffer> {
        if !t.is_contiguous() {
            return Err(Error::DeviceBuffer {
                field,
                reason: "is not contiguous (burn's into_contiguous first)".into(),
            });
        }
        let managed = t
            .client
            .get_resource::<WgpuServer<AutoCompiler>>(t.handle.clone())
            .map_err(|e| backend_error(field, e))?;
        let resource = managed.resource();
        let (buffer, offset) = (resource.buffer.clone(), resource.offset);
        // Views and copies move whole 4-byte words; burn's allocations are
        // padded to its alignment, so the word past an odd f16 tail is
        // still the tensor's allocation.
        let view_bytes = bytes.next_multiple_of(4);
        let room = offset.checked_add(view_bytes).is_some_and(|end| end <= buffer.size());
        if !room || !offset.is_multiple_of(4) {
            return Err(Error::DeviceBuffer {
                field,
                reason: format!(
                    "view of {view_bytes} bytes at byte {offset} of a {}-byte buffer: not word-aligned or past its end",
                    buffer.size()
                ),
            });
        }
        self.keep.push(Box::new(managed));
        if offset.is_multiple_of(BIND_ALIGN) {
            self.stats.in_place += 1;
            return backend.wrap_buffer(&buffer, offset, view_bytes);
        }
        let staging = self.staging.get(self.device, field, view_bytes);
        match flow {
            Flow::In => self.copy_in.push((buffer, offset, staging.clone(), view_bytes)),
            Flow::Out => self.copy_out.push((staging.clone(), buffer, offset, view_bytes)),
        }
        self.stats.copied += 1;
        self.stats.copied_bytes += view_bytes;
        backend.wrap_buffer(&staging, 0, view_bytes)
    }

    /// Flushes burn's queued work (what wrote the inputs) through the
    /// client of `any_input`, so it reaches the queue before headkl's, then
    /// submits the copies into staging.
    pub fn submit_inputs(&mut self, any_input: &CubeTensor) -> Result<()> {
        any_input
            .client
            .flush()
            .map_err(|e| backend_error("flushing burn's queued work", e))?;
        if self.copy_in.is_empty() {
            return Ok(());
        }
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("headkl-burn in"),
        });
        for (src, offset, dst, bytes) in self.copy_in.drain(..) {
            enc.copy_buffer_to_buffer(&src, offset, &dst, 0, bytes);
        }
        self.queue.submit([enc.finish()]);
        Ok(())
    }

    /// Submits the copies out of staging (after headkl's work) and lets
    /// the resources go: later burn work is queued after all of it.
    pub fn finish(mut self) -> Binding {
        if !self.copy_out.is_empty() {
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("headkl-burn out"),
            });
            for (src, dst, offset, bytes) in self.copy_out.drain(..) {
                enc.copy_buffer_to_buffer(&src, 0, &dst, offset, bytes);
            }
            self.queue.submit([enc.finish()]);
        }
        self.keep.clear();
        self.stats
    }
}
