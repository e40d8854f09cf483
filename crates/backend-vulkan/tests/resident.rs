//! The device-resident entry points on the Vulkan backend: the shared
//! resident conformance cases with the Khronos validation layer on (bad
//! data on the device must give the host path's error and no validation
//! message), and the backend on a caller's own ash device with views of the
//! caller's `vk::Buffer`s.

use ash::vk;
use headkl_conformance::open_or_skip;
use headkl_conformance::trainer::{TrainerCase, TrainerOperand};
use headkl_core::{Backend, Error};
use headkl_vulkan::{ExternalVulkan, VulkanBackend, VulkanOptions};

headkl_conformance::resident_conformance_tests!(
    "vulkan",
    VulkanBackend::open_with(&VulkanOptions {
        validation: true,
        ..VulkanOptions::from_env(&headkl_conformance::harness_env()).expect("a HEADKL_* setting does not parse")
    })
);

/// The trainer's side: its own instance and device, made with ash.
struct Trainer {
    entry: ash::Entry,
    instance: ash::Instance,
    physical: vk::PhysicalDevice,
    device: ash::Device,
    family: u32,
}

impl Trainer {
    fn new() -> headkl_core::Result<Self> {
        let no = |why: String| Error::NoDevice {
            backend: "vulkan",
            reason: why,
        };
        // SAFETY: loading the system's Vulkan loader, as every Vulkan program does.
        let entry = unsafe { ash::Entry::load() }.map_err(|e| no(format!("loader: {e}")))?;
        let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_2);
        // SAFETY: valid entry and create info.
        let instance =
            unsafe { entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None) }
                .map_err(|e| no(format!("vkCreateInstance: {e}")))?;
        // SAFETY: valid instance.
        let physicals = unsafe { instance.enumerate_physical_devices() }.map_err(|e| no(format!("{e}")))?;
        let Some(&physical) = physicals.first() else {
            return Err(no("no physical device".into()));
        };
        // SAFETY: valid instance and physical device.
        let families = unsafe { instance.get_physical_device_queue_family_properties(physical) };
        let family = families
            .iter()
            .position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE))
            .ok_or_else(|| no("no compute queue".into()))? as u32;
        let priorities = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&priorities)];
        let mut v11 = vk::PhysicalDeviceVulkan11Features::default()
            .storage_buffer16_bit_access(true)
            .uniform_and_storage_buffer16_bit_access(true);
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default().shader_float16(true);
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .push_next(&mut v11)
            .push_next(&mut v12);
        // SAFETY: valid physical device; the features are core in 1.2.
        let device =
            unsafe { instance.create_device(physical, &info, None) }.map_err(|e| no(format!("vkCreateDevice: {e}")))?;
        Ok(Self {
            entry,
            instance,
            physical,
            device,
            family,
        })
    }

    /// A device-local storage buffer with `data` at `offset`.
    fn buffer(&self, bytes: u64) -> (vk::Buffer, vk::DeviceMemory) {
        let usage = vk::BufferUsageFlags::STORAGE_BUFFER
            | vk::BufferUsageFlags::TRANSFER_SRC
            | vk::BufferUsageFlags::TRANSFER_DST;
        // SAFETY: valid device and create info.
        let buffer = unsafe {
            self.device
                .create_buffer(&vk::BufferCreateInfo::default().size(bytes).usage(usage), None)
        }
        .expect("vkCreateBuffer");
        // SAFETY: valid buffer.
        let req = unsafe { self.device.get_buffer_memory_requirements(buffer) };
        // SAFETY: valid instance and physical device.
        let props = unsafe { self.instance.get_physical_device_memory_properties(self.physical) };
        let index = (0..props.memory_type_count)
            .find(|&i| req.memory_type_bits & (1 << i) != 0)
            .expect("a memory type");
        let alloc = vk::MemoryAllocateInfo::default()
            .allocation_size(req.size)
            .memory_type_index(index);
        // SAFETY: valid device; the memory is bound once, at offset 0.
        let memory = unsafe { self.device.allocate_memory(&alloc, None) }.expect("vkAllocateMemory");
        // SAFETY: fresh buffer and memory, large enough.
        unsafe { self.device.bind_buffer_memory(buffer, memory, 0) }.expect("vkBindBufferMemory");
        (buffer, memory)
    }
}

#[test]
fn head_kl_on_the_trainers_device_and_buffers() {
    let Some(trainer) = open_or_skip("vulkan", Trainer::new) else {
        return;
    };
    let ext = ExternalVulkan {
        entry: trainer.entry.clone(),
        instance: trainer.instance.clone(),
        api_version: vk::API_VERSION_1_2,
        physical_device: trainer.physical,
        device: trainer.device.clone(),
        queue: (trainer.family, 0),
        matrix_units: false,
    };
    let case = TrainerCase::new();
    let at = case.layout();
    let (inputs, in_mem) = trainer.buffer(at.input_bytes);
    let (outputs, out_mem) = trainer.buffer(at.output_bytes);
    {
        // SAFETY: the trainer's handles are valid and outlive the backend
        // (destroyed at the end of this test, after it); the device has the
        // 16-bit storage and f16 features; no other thread uses the queue.
        let backend = unsafe { VulkanBackend::from_raw(ext, &VulkanOptions::default()) }.expect("from_raw");
        let view = |op: TrainerOperand| {
            let (offset, bytes) = case.place(op);
            let buffer = if op.in_inputs() { inputs } else { outputs };
            // SAFETY: the buffers are the trainer's, made on this device with
            // storage and transfer usage, alive until the end of the test.
            unsafe { backend.wrap_buffer(buffer, offset, bytes) }.expect("view")
        };
        // The trainer's writes, through the views (its memory need not be
        // host-visible); the output buffer starts zeroed.
        for (op, bytes) in case.input_writes() {
            backend.upload(&view(op), 0, bytes).expect("upload");
        }
        let zeros = vec![0u8; at.loss as usize];
        backend
            .upload(&view(TrainerOperand::BeforeOutputs), 0, &zeros)
            .expect("zero");
        let mut engine = case.engine(&backend).expect("engine");
        case.check(&mut engine, view).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            matches!(engine.backend().take_diagnostics().as_slice(), []),
            "diagnostics"
        );
    }
    // SAFETY: the backend and every view are gone and the device is idle
    // (the backend waited when it was dropped).
    unsafe {
        trainer.device.destroy_buffer(inputs, None);
        trainer.device.destroy_buffer(outputs, None);
        trainer.device.free_memory(in_mem, None);
        trainer.device.free_memory(out_mem, None);
        trainer.device.destroy_device(None);
        trainer.instance.destroy_instance(None);
    }
}
