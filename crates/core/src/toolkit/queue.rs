//! Which queue family a GPU backend opens its device on (`HEADKL_QUEUE`),
//! chosen once here for both backends.
//!
//! Why it matters: on NVIDIA's driver (H200, 580.159.04) the same compute
//! pipelines run up to 2.6× slower when submitted to the graphics family
//! than to the compute-only one; kernels with several workgroups an SM and
//! much workgroup memory lose most (docs/PERFORMANCE.md, row 33). wgpu
//! opens every Vulkan device on family 0, the graphics one there.

use std::fmt;

use crate::error::{Error, Result};
use crate::toolkit::settings::QUEUE;

/// Which queue family to open the device on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QueueChoice {
    /// A family with compute and without graphics where the device has one
    /// (with timestamps where the backend times kernels), else the first
    /// family with compute.
    #[default]
    Auto,
    /// The first family with both graphics and compute (what wgpu picks on
    /// its own), else the first with compute.
    Universal,
    /// This family index; it must have compute.
    Family(u32),
}

/// What the backend reads of one queue family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueFamily {
    /// Whether it runs compute work.
    pub compute: bool,
    /// Whether it runs graphics work.
    pub graphics: bool,
    /// Its timestamps' valid bits (0: no timestamps).
    pub timestamp_bits: u32,
    /// How many queues it has.
    pub count: u32,
}

impl QueueChoice {
    /// Parses `auto`, `universal` or a family index, as `HEADKL_QUEUE` (or
    /// the option `name`) gives it.
    pub fn parse(name: &'static str, value: &str) -> Result<Self> {
        let t = value.trim().to_ascii_lowercase();
        match t.as_str() {
            "auto" => Ok(Self::Auto),
            "universal" => Ok(Self::Universal),
            _ => t.parse::<u32>().map(Self::Family).map_err(|_| Error::InvalidSetting {
                name,
                value: value.to_string(),
                reason: "expected auto, universal or a queue family index".into(),
            }),
        }
    }

    /// The family to open among `families` (in the driver's order).
    /// `timestamps`: the backend times kernels there, so `Auto` prefers a
    /// compute-only family that has timestamps. A `Family` index the device
    /// lacks, or one without compute, is [`Error::InvalidSetting`] naming
    /// `HEADKL_QUEUE`; a device without any compute family is
    /// [`Error::MissingFeature`].
    pub fn pick(self, families: &[QueueFamily], timestamps: bool) -> Result<u32> {
        let usable = |f: &QueueFamily| f.compute && f.count > 0;
        let first =
            |want: &dyn Fn(&QueueFamily) -> bool| families.iter().position(|f| usable(f) && want(f)).map(|i| i as u32);
        let any_compute =
            || first(&|_| true).ok_or_else(|| Error::MissingFeature("no queue family with compute".into()));
        match self {
            Self::Auto => match first(&|f| !f.graphics && (!timestamps || f.timestamp_bits > 0)) {
                Some(i) => Ok(i),
                None => any_compute(),
            },
            Self::Universal => match first(&|f| f.graphics) {
                Some(i) => Ok(i),
                None => any_compute(),
            },
            Self::Family(i) => match families.get(i as usize) {
                Some(f) if usable(f) => Ok(i),
                Some(_) => Err(self.invalid("that family has no compute queue")),
                None => Err(self.invalid(&match families.len() {
                    0 => "the device has no queue families".to_string(),
                    1 => "the device has 1 queue family (0)".to_string(),
                    n => format!("the device has {n} queue families (0 to {})", n - 1),
                })),
            },
        }
    }

    fn invalid(self, reason: &str) -> Error {
        Error::InvalidSetting {
            name: QUEUE,
            value: self.to_string(),
            reason: reason.to_string(),
        }
    }
}

impl QueueFamily {
    /// A family from its `VkQueueFamilyProperties` fields: `queueFlags` as
    /// raw bits, `timestampValidBits`, `queueCount`. Both GPU backends read
    /// Vulkan's families through this.
    pub fn from_vulkan(queue_flags: u32, timestamp_bits: u32, count: u32) -> Self {
        // VK_QUEUE_GRAPHICS_BIT and VK_QUEUE_COMPUTE_BIT.
        const GRAPHICS: u32 = 0x1;
        const COMPUTE: u32 = 0x2;
        Self {
            compute: queue_flags & COMPUTE != 0,
            graphics: queue_flags & GRAPHICS != 0,
            timestamp_bits,
            count,
        }
    }

    /// Family `index` of `families` in words (`family 2 (compute)`), or
    /// just its index where the list lacks it.
    pub fn describe_in(families: &[QueueFamily], index: u32) -> String {
        match families.get(index as usize) {
            Some(f) => f.describe(index),
            None => format!("family {index}"),
        }
    }

    /// The family in words, for logs and reports: `family 2 (compute)`.
    pub fn describe(&self, index: u32) -> String {
        let kind = match (self.graphics, self.compute) {
            (true, true) => "graphics + compute",
            (false, true) => "compute",
            (true, false) => "graphics",
            (false, false) => "transfer",
        };
        format!("family {index} ({kind})")
    }
}

impl fmt::Display for QueueChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Universal => f.write_str("universal"),
            Self::Family(i) => write!(f, "{i}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRAPHICS: QueueFamily = QueueFamily {
        compute: true,
        graphics: true,
        timestamp_bits: 64,
        count: 16,
    };
    const TRANSFER: QueueFamily = QueueFamily {
        compute: false,
        graphics: false,
        timestamp_bits: 64,
        count: 2,
    };
    const COMPUTE: QueueFamily = QueueFamily {
        compute: true,
        graphics: false,
        timestamp_bits: 64,
        count: 8,
    };

    #[test]
    fn auto_takes_the_compute_only_family() {
        // NVIDIA's layout: graphics 0, transfer 1, compute 2.
        let nvidia = [GRAPHICS, TRANSFER, COMPUTE];
        assert_eq!(QueueChoice::Auto.pick(&nvidia, true).unwrap(), 2);
        assert_eq!(QueueChoice::Universal.pick(&nvidia, true).unwrap(), 0);
        assert_eq!(QueueChoice::Family(2).pick(&nvidia, false).unwrap(), 2);
        // lavapipe's: one family for everything.
        assert_eq!(QueueChoice::Auto.pick(&[GRAPHICS], true).unwrap(), 0);
        // A compute family without timestamps serves only untimed backends.
        let untimed = QueueFamily {
            timestamp_bits: 0,
            ..COMPUTE
        };
        assert_eq!(QueueChoice::Auto.pick(&[GRAPHICS, untimed], true).unwrap(), 0);
        assert_eq!(QueueChoice::Auto.pick(&[GRAPHICS, untimed], false).unwrap(), 1);
        // Universal falls back to a compute-only device's family.
        assert_eq!(QueueChoice::Universal.pick(&[TRANSFER, COMPUTE], true).unwrap(), 1);
    }

    #[test]
    fn bad_families_are_typed_errors() {
        let nvidia = [GRAPHICS, TRANSFER, COMPUTE];
        for (choice, why) in [
            (QueueChoice::Family(1), "no compute"),
            (QueueChoice::Family(7), "3 queue families"),
        ] {
            match choice.pick(&nvidia, true) {
                Err(Error::InvalidSetting { name, value, reason }) => {
                    assert_eq!(name, QUEUE);
                    assert_eq!(value, choice.to_string());
                    assert!(reason.contains(why), "{reason}");
                }
                other => panic!("{choice}: {other:?}"),
            }
        }
        assert!(matches!(
            QueueChoice::Auto.pick(&[TRANSFER], true),
            Err(Error::MissingFeature(_))
        ));
    }

    #[test]
    fn parses_and_prints() {
        for (text, choice) in [
            ("auto", QueueChoice::Auto),
            (" Universal ", QueueChoice::Universal),
            ("2", QueueChoice::Family(2)),
        ] {
            assert_eq!(QueueChoice::parse(QUEUE, text).unwrap(), choice);
            assert_eq!(QueueChoice::parse(QUEUE, &choice.to_string()).unwrap(), choice);
        }
        let e = QueueChoice::parse(QUEUE, "graphics").unwrap_err();
        assert!(matches!(e, Error::InvalidSetting { name, .. } if name == QUEUE));
        assert_eq!(COMPUTE.describe(2), "family 2 (compute)");
        assert_eq!(
            QueueFamily::describe_in(&[GRAPHICS], 0),
            "family 0 (graphics + compute)"
        );
        assert_eq!(QueueFamily::describe_in(&[GRAPHICS], 3), "family 3");
        // NVIDIA's families as the driver reports them: graphics + compute
        // + transfer + sparse (0xf), transfer + sparse (0xc), compute +
        // transfer + sparse (0xe).
        assert_eq!(QueueFamily::from_vulkan(0xf, 64, 16), GRAPHICS);
        assert_eq!(QueueFamily::from_vulkan(0xc, 64, 2), TRANSFER);
        assert_eq!(QueueFamily::from_vulkan(0xe, 64, 8), COMPUTE);
        assert_eq!(GRAPHICS.describe(0), "family 0 (graphics + compute)");
    }
}
