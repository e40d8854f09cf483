//! The Vulkan instance: the loader (found at run time), the optional
//! validation layer and the debug messenger that collects its messages.

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use ash::{ext, khr, vk};
use headkl_core::Result;

use crate::conv::{no_device, version_string, vk_error};

/// The Khronos validation layer's name.
pub(crate) const VALIDATION_LAYER: &CStr = c"VK_LAYER_KHRONOS_validation";

/// The newest API version headkl uses; a device that supports more is
/// driven at this version.
const MAX_API_VERSION: u32 = vk::API_VERSION_1_3;

/// Whether the "layer loaded" line was printed in this process.
static LAYER_LINE_PRINTED: AtomicBool = AtomicBool::new(false);

/// Validation messages that mean something went wrong, collected by the
/// debug messenger until [`Diagnostics::take`].
#[derive(Default)]
pub(crate) struct Diagnostics {
    messages: Mutex<Vec<String>>,
}

impl Diagnostics {
    /// Takes and clears the collected messages.
    pub(crate) fn take(&self) -> Vec<String> {
        match self.messages.lock() {
            Ok(mut m) => std::mem::take(&mut *m),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        }
    }

    /// The collected messages, left in place.
    pub(crate) fn peek(&self) -> Vec<String> {
        match self.messages.lock() {
            Ok(m) => m.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn push(&self, message: String) {
        match self.messages.lock() {
            Ok(mut m) => m.push(message),
            Err(poisoned) => poisoned.into_inner().push(message),
        }
    }
}

/// Called by the validation layer for every message.
///
/// Errors are recorded, and so are validation-type warnings (they flag
/// undefined behaviour the spec permits but a correct program avoids);
/// performance hints and informational messages are not.
unsafe extern "system" fn debug_callback(
    severity: vk::DebugUtilsMessageSeverityFlagsEXT,
    types: vk::DebugUtilsMessageTypeFlagsEXT,
    data: *const vk::DebugUtilsMessengerCallbackDataEXT<'_>,
    user: *mut c_void,
) -> vk::Bool32 {
    let is_error = severity.contains(vk::DebugUtilsMessageSeverityFlagsEXT::ERROR);
    let is_validation_warning = severity.contains(vk::DebugUtilsMessageSeverityFlagsEXT::WARNING)
        && types.contains(vk::DebugUtilsMessageTypeFlagsEXT::VALIDATION);
    if !(is_error || is_validation_warning) || user.is_null() || data.is_null() {
        return vk::FALSE;
    }
    // SAFETY: the layer passes a valid callback-data struct for the duration
    // of the call; its strings are NUL-terminated or null (checked by the
    // `_as_c_str` accessors).
    let (id, message) = unsafe {
        let d = &*data;
        (
            d.message_id_name_as_c_str()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
            d.message_as_c_str()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
        )
    };
    let level = if is_error { "error" } else { "warning" };
    // SAFETY: `user` is the `Diagnostics` pointer registered with the
    // messenger; the `Instance` keeps that `Arc` alive until after the
    // messenger is destroyed.
    let diagnostics = unsafe { &*(user as *const Diagnostics) };
    diagnostics.push(format!("validation {level} [{id}]: {message}"));
    vk::FALSE
}

/// An instance with its entry points, kept alive (through `Arc`s) by every
/// device made from it.
pub(crate) struct Instance {
    pub(crate) entry: ash::Entry,
    pub(crate) raw: ash::Instance,
    /// The API version the application asked for (≤ 1.3).
    pub(crate) api_version: u32,
    /// The debug messenger, when validation is on.
    messenger: Option<(ext::debug_utils::Instance, vk::DebugUtilsMessengerEXT)>,
    pub(crate) diagnostics: Arc<Diagnostics>,
    /// The validation layer's version line, when it is loaded.
    pub(crate) validation_layer: Option<String>,
    /// Whether headkl created the instance (and destroys it); a caller's
    /// instance is theirs to destroy.
    pub(crate) owned: bool,
}

/// A bare instance (no layers, no extensions) made once per process and
/// never destroyed, with the loader that made it.
///
/// The Vulkan loader unloads a driver's libraries with the last instance
/// that loaded them, and NVIDIA's driver cannot be loaded again and again:
/// on the H200, after 28 backends opened and dropped one after another
/// (`headkl tune` opens one per kernel), the next `vkCreateInstance`
/// failed with "no compatible Vulkan driver". With this instance alive the
/// driver stays loaded and every later instance reuses it. The cost is one
/// idle instance per process; failing to make it changes nothing else.
static DRIVER_ANCHOR: OnceLock<Option<(ash::Entry, ash::Instance)>> = OnceLock::new();

fn anchor_driver(entry: &ash::Entry) {
    DRIVER_ANCHOR.get_or_init(|| {
        let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_1);
        let info = vk::InstanceCreateInfo::default().application_info(&app);
        // SAFETY: valid entry and create info; the instance is never
        // destroyed, so nothing made from it can outlive it.
        let raw = unsafe { entry.create_instance(&info, None) }.ok()?;
        Some((entry.clone(), raw))
    });
}

impl Instance {
    /// Loads the Vulkan loader and creates an instance. With `validation`,
    /// the Khronos validation layer must be present (else an error says so).
    pub(crate) fn new(validation: bool) -> Result<Arc<Self>> {
        // SAFETY: loading the system's Vulkan loader runs its initialisers;
        // that is what every Vulkan application does, and nothing else in
        // this process is expected to unload it.
        let entry = unsafe { ash::Entry::load() }
            .map_err(|e| no_device(format!("the Vulkan loader (libvulkan) could not be loaded: {e}")))?;
        // SAFETY: `entry` holds valid global entry points.
        let loader_version = unsafe { entry.try_enumerate_instance_version() }
            .map_err(|e| no_device(format!("vkEnumerateInstanceVersion failed: {e}")))?
            .unwrap_or(vk::API_VERSION_1_0);
        anchor_driver(&entry);
        if loader_version < vk::API_VERSION_1_1 {
            return Err(no_device(format!(
                "the Vulkan loader offers version {}; headkl needs 1.1 or newer",
                version_string(loader_version)
            )));
        }
        let api_version = loader_version.min(MAX_API_VERSION);

        // SAFETY: valid entry; the returned structs are plain data.
        let layers = unsafe { entry.enumerate_instance_layer_properties() }
            .map_err(|e| vk_error(e, "vkEnumerateInstanceLayerProperties"))?;
        // SAFETY: valid entry; plain data back.
        let extensions = unsafe { entry.enumerate_instance_extension_properties(None) }
            .map_err(|e| vk_error(e, "vkEnumerateInstanceExtensionProperties"))?;
        let has_extension = |name: &CStr| extensions.iter().any(|e| e.extension_name_as_c_str() == Ok(name));

        let mut layer_names = Vec::new();
        let mut extension_names = Vec::new();
        let mut validation_layer = None;
        let mut sync_validation = false;
        if validation {
            let Some(layer) = layers.iter().find(|l| l.layer_name_as_c_str() == Ok(VALIDATION_LAYER)) else {
                return Err(no_device(
                    "validation was requested (HEADKL_VALIDATION=1 or VulkanOptions::validation) but the Khronos \
                     validation layer VK_LAYER_KHRONOS_validation is not installed (Debian/Ubuntu: \
                     vulkan-validationlayers)",
                ));
            };
            validation_layer = Some(format!(
                "VK_LAYER_KHRONOS_validation {} (implementation {})",
                version_string(layer.spec_version),
                layer.implementation_version
            ));
            layer_names.push(VALIDATION_LAYER.as_ptr());
            // The layer provides debug_utils itself even if the loader's
            // list did not show it.
            extension_names.push(ext::debug_utils::NAME.as_ptr());
            // SAFETY: valid entry and layer name; plain data back.
            let layer_extensions =
                unsafe { entry.enumerate_instance_extension_properties(Some(VALIDATION_LAYER)) }.unwrap_or_default();
            if layer_extensions
                .iter()
                .any(|e| e.extension_name_as_c_str() == Ok(ext::validation_features::NAME))
            {
                extension_names.push(ext::validation_features::NAME.as_ptr());
                sync_validation = true;
            }
        }
        let mut flags = vk::InstanceCreateFlags::empty();
        if has_extension(khr::portability_enumeration::NAME) {
            extension_names.push(khr::portability_enumeration::NAME.as_ptr());
            flags |= vk::InstanceCreateFlags::ENUMERATE_PORTABILITY_KHR;
        }

        let diagnostics = Arc::new(Diagnostics::default());
        let app = vk::ApplicationInfo::default()
            .application_name(c"headkl")
            .engine_name(c"headkl-vulkan")
            .api_version(api_version);
        let mut messenger_info = vk::DebugUtilsMessengerCreateInfoEXT::default()
            .message_severity(
                vk::DebugUtilsMessageSeverityFlagsEXT::ERROR | vk::DebugUtilsMessageSeverityFlagsEXT::WARNING,
            )
            .message_type(
                vk::DebugUtilsMessageTypeFlagsEXT::GENERAL
                    | vk::DebugUtilsMessageTypeFlagsEXT::VALIDATION
                    | vk::DebugUtilsMessageTypeFlagsEXT::PERFORMANCE,
            )
            .pfn_user_callback(Some(debug_callback))
            .user_data(Arc::as_ptr(&diagnostics) as *mut c_void);
        let mut create_info = vk::InstanceCreateInfo::default()
            .application_info(&app)
            .enabled_layer_names(&layer_names)
            .enabled_extension_names(&extension_names)
            .flags(flags);
        // Synchronization validation flags missing or wrong barriers between
        // dispatches and transfers (hazards are reported as errors).
        let enables = [vk::ValidationFeatureEnableEXT::SYNCHRONIZATION_VALIDATION];
        let mut features = vk::ValidationFeaturesEXT::default().enabled_validation_features(&enables);
        if validation {
            // Also catches messages from vkCreateInstance/vkDestroyInstance.
            create_info = create_info.push_next(&mut messenger_info);
            if sync_validation {
                create_info = create_info.push_next(&mut features);
            }
        }
        // SAFETY: every pointer in `create_info` (names, app info, messenger
        // info with its user data) outlives the call.
        let raw = unsafe { entry.create_instance(&create_info, None) }.map_err(|e| match e {
            vk::Result::ERROR_LAYER_NOT_PRESENT => {
                no_device("vkCreateInstance: the validation layer is listed but failed to load")
            }
            vk::Result::ERROR_INCOMPATIBLE_DRIVER => no_device("vkCreateInstance: no compatible Vulkan driver"),
            other => no_device(format!("vkCreateInstance failed: {other}")),
        })?;

        let messenger = if validation {
            let loader = ext::debug_utils::Instance::new(&entry, &raw);
            // SAFETY: valid instance with debug_utils enabled; the info's
            // user data (the diagnostics) outlives the messenger.
            match unsafe { loader.create_debug_utils_messenger(&messenger_info, None) } {
                Ok(m) => Some((loader, m)),
                Err(e) => {
                    // SAFETY: the instance was created above and nothing
                    // else uses it yet.
                    unsafe { raw.destroy_instance(None) };
                    return Err(vk_error(e, "vkCreateDebugUtilsMessengerEXT"));
                }
            }
        } else {
            None
        };
        if let Some(line) = validation_layer.as_mut() {
            if sync_validation {
                line.push_str(", synchronization validation on");
            }
            if !LAYER_LINE_PRINTED.swap(true, Ordering::Relaxed) {
                log::info!("validation layer loaded: {line}; debug messenger collecting errors");
            }
        }
        Ok(Arc::new(Self {
            entry,
            raw,
            api_version,
            messenger,
            diagnostics,
            validation_layer,
            owned: true,
        }))
    }

    /// Wraps a caller's instance, created at `api_version`; it is never
    /// destroyed here.
    pub(crate) fn external(entry: ash::Entry, raw: ash::Instance, api_version: u32) -> Arc<Self> {
        Arc::new(Self {
            entry,
            raw,
            api_version: api_version.min(MAX_API_VERSION),
            messenger: None,
            diagnostics: Arc::new(Diagnostics::default()),
            validation_layer: None,
            owned: false,
        })
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        // Messages that arrived after the last `take_diagnostics` (object
        // leaks reported at vkDestroyDevice, say) would otherwise be lost.
        for message in self.diagnostics.peek() {
            log::warn!("at shutdown: {message}");
        }
        // SAFETY: every device made from this instance holds an `Arc` to it,
        // so none is left; the messenger was made from this instance.
        unsafe {
            if let Some((loader, messenger)) = self.messenger.take() {
                loader.destroy_debug_utils_messenger(messenger, None);
            }
            if self.owned {
                self.raw.destroy_instance(None);
            }
        }
    }
}
