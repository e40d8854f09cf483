//! The logical device: one compute queue, the features headkl enables, the
//! memory counters, and buffers waiting to be freed once the GPU is done
//! with them.

use std::ffi::CStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ash::vk;
use headkl_core::{MemoryStats, Result};

use crate::adapter::{Adapter, Caps, Source};
use crate::conv::vk_error;
use crate::instance::Instance;
use crate::memory::RawBuffer;

/// What was enabled at device creation.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Enabled {
    /// `VK_KHR_cooperative_matrix` with the Vulkan memory model.
    pub(crate) cooperative_matrix: bool,
    /// `subgroupSizeControl`: pipelines may pin their subgroup size.
    pub(crate) subgroup_size_control: bool,
    /// `computeFullSubgroups`: pipelines may require full subgroups.
    pub(crate) full_subgroups: bool,
    /// `shaderZeroInitializeWorkgroupMemory` (else naga polyfills it).
    pub(crate) zero_initialize_workgroup_memory: bool,
    /// `pipelineExecutableInfo`, asked for by `HEADKL_PIPELINE_STATS=1`:
    /// each new pipeline's statistics are printed to stderr.
    pub(crate) pipeline_stats: bool,
    /// `VK_NVX_binary_import` and `bufferDeviceAddress`: the PTX GEMM
    /// tiles can be launched (device buffers get device addresses).
    pub(crate) ptx: bool,
    /// `VK_KHR_external_memory_fd`, `VK_KHR_external_semaphore_fd` and
    /// timeline semaphores: buffers and a timeline CUDA can import.
    pub(crate) external_fd: bool,
}

/// Bytes of buffer memory held now and at peak.
#[derive(Default)]
pub(crate) struct MemoryCounters {
    current: AtomicU64,
    peak: AtomicU64,
}

impl MemoryCounters {
    pub(crate) fn add(&self, bytes: u64) {
        let now = self.current.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }

    pub(crate) fn sub(&self, bytes: u64) {
        self.current.fetch_sub(bytes, Ordering::SeqCst);
    }

    pub(crate) fn stats(&self) -> MemoryStats {
        MemoryStats {
            current: self.current.load(Ordering::SeqCst),
            peak: self.peak.load(Ordering::SeqCst),
        }
    }

    pub(crate) fn reset_peak(&self) {
        self.peak.store(self.current.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

/// The queues the stream's copy lanes submit to.
pub(crate) struct CopyQueues {
    pub(crate) family: u32,
    /// Uploads' queue, and downloads' (another queue of the family where it
    /// has two, so an upload never waits in line behind a download that
    /// waits for kernels; else the same).
    pub(crate) up: vk::Queue,
    pub(crate) down: vk::Queue,
}

/// A logical device shared (through `Arc`) by the backend and every buffer,
/// so a buffer outliving the backend still frees itself correctly.
pub(crate) struct Device {
    pub(crate) raw: ash::Device,
    pub(crate) queue: vk::Queue,
    pub(crate) family: u32,
    /// Where large copies run beside the kernels (`None`: in line).
    pub(crate) copy_queues: Option<CopyQueues>,
    /// The families every buffer is shared by (`CONCURRENT`) where copies
    /// run on another family than the kernels; empty: `EXCLUSIVE`.
    pub(crate) sharing: Vec<u32>,
    pub(crate) caps: Caps,
    pub(crate) memory_properties: vk::PhysicalDeviceMemoryProperties,
    pub(crate) enabled: Enabled,
    pub(crate) counters: MemoryCounters,
    /// The stream's submissions are numbered from 1: the last one that may
    /// use a buffer dropped now (the one being recorded, else the last
    /// submitted), and every one up to which has finished (or was
    /// abandoned on a lost device). A buffer dropped while `last_use` is
    /// ahead of `finished` is parked in `garbage`, tagged with `last_use`,
    /// until `finished` reaches the tag.
    pub(crate) last_use: AtomicU64,
    pub(crate) finished: AtomicU64,
    garbage: Mutex<Vec<(u64, RawBuffer)>>,
    /// Whether headkl created the device (and destroys it).
    owned: bool,
    /// Declared last: dropped after the device is destroyed.
    pub(crate) instance: Arc<Instance>,
}

impl Device {
    /// Creates the logical device on `adapter` with every feature headkl
    /// uses that the device has; `want_coop` enables the cooperative-matrix
    /// path's features; `options` asks for pipeline statistics and robust
    /// buffer access.
    pub(crate) fn new(
        instance: Arc<Instance>,
        adapter: &Adapter,
        want_coop: bool,
        options: &crate::VulkanOptions,
    ) -> Result<Arc<Self>> {
        let caps = adapter.caps.clone();
        let family = options.common.queue.pick(&caps.queue_families, false)?;
        let f = caps.features;
        let s = caps.sources;
        let coop = want_coop && caps.coop_capable();
        // The PTX tiles are matrix-unit GEMMs: only where those run.
        let ptx = coop && caps.ptx_capable();
        let size_control = f.subgroup_size_control;
        let full_subgroups = f.compute_full_subgroups;
        let zero_init = f.zero_initialize_workgroup_memory;
        let pipeline_stats = options.pipeline_stats;
        if pipeline_stats && !f.pipeline_executable_info {
            log::warn!(
                "HEADKL_PIPELINE_STATS: {} has no pipelineExecutableInfo \
                 (VK_KHR_pipeline_executable_properties); no statistics",
                caps.name
            );
        }
        let pipeline_stats = pipeline_stats && f.pipeline_executable_info;
        // For comparing with wgpu, which turns these on: drivers bounds-check
        // every buffer access.
        let robust = options.robust_access;
        let robust2 = robust && f.robust_buffer_access2;

        let mut extensions: Vec<&'static CStr> = Vec::new();
        let mut need = |source: Source| {
            if let Source::Extension(name) = source {
                if !extensions.contains(&name) {
                    extensions.push(name);
                }
            }
        };
        need(s.float16_int8);
        if size_control || full_subgroups {
            need(s.subgroup_size_control);
        }
        if f.maintenance4 {
            need(s.maintenance4);
        }
        if zero_init {
            need(s.zero_initialize_workgroup_memory);
        }
        if coop {
            need(s.memory_model);
            need(s.cooperative_matrix);
        }
        if pipeline_stats {
            need(s.pipeline_executable_properties);
        }
        if robust2 {
            need(s.robustness2);
        }
        if ptx {
            extensions.push(ash::nvx::binary_import::NAME);
        }
        let external_fd = caps.external_fd && caps.timeline_semaphore;
        if external_fd {
            extensions.push(ash::khr::external_memory_fd::NAME);
            extensions.push(ash::khr::external_semaphore_fd::NAME);
        }
        let extension_ptrs: Vec<_> = extensions.iter().map(|e| e.as_ptr()).collect();

        let mut storage16 = vk::PhysicalDevice16BitStorageFeatures::default()
            .storage_buffer16_bit_access(true)
            .uniform_and_storage_buffer16_bit_access(true);
        let mut float16 = vk::PhysicalDeviceShaderFloat16Int8Features::default().shader_float16(true);
        let mut size_control_features = vk::PhysicalDeviceSubgroupSizeControlFeatures::default()
            .subgroup_size_control(size_control)
            .compute_full_subgroups(full_subgroups);
        let mut maintenance4 = vk::PhysicalDeviceMaintenance4Features::default().maintenance4(true);
        let mut zero = vk::PhysicalDeviceZeroInitializeWorkgroupMemoryFeatures::default()
            .shader_zero_initialize_workgroup_memory(true);
        // naga's cooperative-matrix SPIR-V uses the Vulkan memory model, and
        // its storage accesses then carry device scope.
        let mut memory_model = vk::PhysicalDeviceVulkanMemoryModelFeatures::default()
            .vulkan_memory_model(true)
            .vulkan_memory_model_device_scope(true);
        let mut coop_features = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default().cooperative_matrix(true);
        let mut executable =
            vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default().pipeline_executable_info(true);
        let mut robustness2 = vk::PhysicalDeviceRobustness2FeaturesEXT::default().robust_buffer_access2(true);
        let core_features = vk::PhysicalDeviceFeatures::default().robust_buffer_access(robust);

        // Copy lanes: a transfer-only family's queues (two where it has
        // them), or the kernels' own queue for `CopyQueue::Compute`.
        let copy_family = match options.copy_queue {
            _ if !caps.timeline_semaphore => None,
            crate::CopyQueue::Off => None,
            crate::CopyQueue::Compute => Some((family, 1)),
            crate::CopyQueue::Auto => caps
                .transfer_family
                .filter(|&(f, _)| f != family)
                .map(|(f, count)| (f, count.min(2))),
        };
        let priorities = [1.0f32; 2];
        let mut queue_info = vec![vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&priorities[..1])];
        if let Some((f, count)) = copy_family.filter(|&(f, _)| f != family) {
            queue_info.push(
                vk::DeviceQueueCreateInfo::default()
                    .queue_family_index(f)
                    .queue_priorities(&priorities[..count as usize]),
            );
        }
        let mut timeline = vk::PhysicalDeviceTimelineSemaphoreFeatures::default().timeline_semaphore(true);
        let mut device_address = vk::PhysicalDeviceBufferDeviceAddressFeatures::default().buffer_device_address(true);
        let mut info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queue_info)
            .enabled_extension_names(&extension_ptrs)
            .enabled_features(&core_features)
            .push_next(&mut storage16)
            .push_next(&mut float16);
        if size_control || full_subgroups {
            info = info.push_next(&mut size_control_features);
        }
        if f.maintenance4 {
            info = info.push_next(&mut maintenance4);
        }
        if zero_init {
            info = info.push_next(&mut zero);
        }
        if coop {
            info = info.push_next(&mut memory_model).push_next(&mut coop_features);
        }
        if pipeline_stats {
            info = info.push_next(&mut executable);
        }
        if robust2 {
            info = info.push_next(&mut robustness2);
        }
        if copy_family.is_some() || external_fd {
            info = info.push_next(&mut timeline);
        }
        if ptx {
            info = info.push_next(&mut device_address);
        }
        // SAFETY: every chained struct is core at the device's API version or
        // its extension is in the enabled list; every feature set to true is
        // reported supported by the device; all pointers outlive the call.
        let raw = unsafe { instance.raw.create_device(adapter.raw, &info, None) }
            .map_err(|e| vk_error(e, "vkCreateDevice"))?;
        // SAFETY: the family was created with one queue.
        let queue = unsafe { raw.get_device_queue(family, 0) };
        let copy_queues = copy_family.map(|(f, count)| CopyQueues {
            family: f,
            up: if f == family {
                queue
            } else {
                // SAFETY: the family was created with `count` ≥ 1 queues.
                unsafe { raw.get_device_queue(f, 0) }
            },
            down: if f == family {
                queue
            } else {
                // SAFETY: as above; index `count − 1` exists.
                unsafe { raw.get_device_queue(f, count - 1) }
            },
        });
        let sharing = match &copy_queues {
            Some(c) if c.family != family => vec![family, c.family],
            _ => Vec::new(),
        };
        // SAFETY: valid instance and device; plain data back.
        let memory_properties = unsafe { instance.raw.get_physical_device_memory_properties(adapter.raw) };
        Ok(Arc::new(Self {
            raw,
            queue,
            family,
            copy_queues,
            sharing,
            caps,
            memory_properties,
            enabled: Enabled {
                cooperative_matrix: coop,
                subgroup_size_control: size_control,
                full_subgroups,
                zero_initialize_workgroup_memory: zero_init,
                pipeline_stats,
                ptx,
                external_fd,
            },
            counters: MemoryCounters::default(),
            last_use: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            garbage: Mutex::new(Vec::new()),
            owned: true,
            instance,
        }))
    }

    /// Valid bits of the queue's timestamps (0: it cannot time kernels).
    /// They follow the family opened (a caller's own, for an external
    /// device), not the one the listing shows.
    pub(crate) fn timestamp_valid_bits(&self) -> u32 {
        self.caps
            .queue_families
            .get(self.family as usize)
            .map_or(0, |f| f.timestamp_bits)
    }

    /// The queue's family in words (`family 2 (compute)`), with where
    /// large copies run.
    pub(crate) fn queue_description(&self) -> String {
        let kernels = headkl_core::toolkit::QueueFamily::describe_in(&self.caps.queue_families, self.family);
        match &self.copy_queues {
            None => kernels,
            Some(c) if c.family == self.family => format!("{kernels}; copies in submissions of their own"),
            Some(c) => format!(
                "{kernels}; copies on family {} (transfer, {})",
                c.family,
                if c.up == c.down {
                    "one queue"
                } else {
                    "uploads and downloads on two queues"
                }
            ),
        }
    }

    /// Wraps a caller's device and its queue `(family, index)`, with the
    /// features the caller says it enabled; it is never destroyed here.
    pub(crate) fn external(
        instance: Arc<Instance>,
        physical: vk::PhysicalDevice,
        caps: Caps,
        raw: ash::Device,
        queue: (u32, u32),
        enabled: Enabled,
    ) -> Arc<Self> {
        // SAFETY: the caller guarantees (VulkanBackend::from_raw) that the
        // device was created with this queue.
        let handle = unsafe { raw.get_device_queue(queue.0, queue.1) };
        // SAFETY: valid instance and physical device; plain data back.
        let memory_properties = unsafe { instance.raw.get_physical_device_memory_properties(physical) };
        Arc::new(Self {
            raw,
            queue: handle,
            family: queue.0,
            // The caller created the device: no other queue is headkl's.
            copy_queues: None,
            sharing: Vec::new(),
            caps,
            memory_properties,
            enabled,
            counters: MemoryCounters::default(),
            last_use: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            garbage: Mutex::new(Vec::new()),
            owned: false,
            instance,
        })
    }

    /// Frees `buffer` now, or parks it until the submissions that may use
    /// it have finished.
    pub(crate) fn release(&self, buffer: RawBuffer) {
        let last_use = self.last_use.load(Ordering::SeqCst);
        if self.finished.load(Ordering::SeqCst) >= last_use {
            // SAFETY: every submission that may use it has finished.
            unsafe { buffer.destroy(self) };
            return;
        }
        match self.garbage.lock() {
            Ok(mut g) => g.push((last_use, buffer)),
            Err(p) => p.into_inner().push((last_use, buffer)),
        }
    }

    /// Frees the parked buffers whose submissions have finished; called
    /// after each wait.
    pub(crate) fn collect_garbage(&self) {
        self.collect_garbage_through(self.finished.load(Ordering::SeqCst));
    }

    /// Frees the parked buffers last used by submission `n` or earlier.
    fn collect_garbage_through(&self, n: u64) {
        let due: Vec<RawBuffer> = {
            let mut parked = match self.garbage.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            let (due, kept) = std::mem::take(&mut *parked).into_iter().partition(|(tag, _)| *tag <= n);
            *parked = kept;
            due.into_iter().map(|(_, b)| b).collect()
        };
        for buffer in due {
            // SAFETY: the submissions that may use it have finished (the
            // caller waited for them, or for the whole device).
            unsafe { buffer.destroy(self) };
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: the last `Arc` is gone, so no buffer, stream or pipeline
        // uses the device; waiting for idle makes destroying it safe. A wait
        // failure (device lost) leaves nothing running either.
        unsafe {
            let _ = self.raw.device_wait_idle();
        }
        self.collect_garbage_through(u64::MAX);
        if self.owned {
            // SAFETY: every child object was destroyed above or by its owner.
            unsafe { self.raw.destroy_device(None) };
        }
    }
}
