//! The element type a gradient is handed out in ([`GradType`]) and its
//! values in that type ([`GradValues`]): f32 as the engine computes it, or
//! a head's own 16-bit type, as a trainer's `.grad` is, each value rounded
//! once to nearest even.

use half::{bf16, f16};

use crate::error::{Error, Result};

/// The element type of a gradient handed out ([`GradValues::convert`],
/// [`crate::LossOutput::take_head_grad`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GradType {
    /// As computed (f32 accumulation): no rounding.
    #[default]
    F32,
    /// IEEE half: a value past ±65504 is an error, never an infinity.
    F16,
    /// bfloat16: f32's range, 8 significant bits.
    Bf16,
}

/// A gradient `[rows][cols]` in one element type.
#[derive(Clone, Debug, PartialEq)]
pub enum GradValues {
    /// f32 values.
    F32(Vec<f32>),
    /// f16 values.
    F16(Vec<f16>),
    /// bf16 values.
    Bf16(Vec<bf16>),
}

impl GradValues {
    /// `values` (`[rows][cols]`, named `field` in an error) in `to`: f32
    /// as they are, f16 and bf16 each rounded once to nearest even. A
    /// value f16 cannot hold (past ±65504, or one f32 holds as infinite)
    /// is [`Error::GradOutOfF16Range`], naming its row and column, rather
    /// than an infinity in the output.
    pub fn convert(values: &[f32], cols: usize, to: GradType, field: &'static str) -> Result<Self> {
        match to {
            GradType::F32 => Ok(GradValues::F32(values.to_vec())),
            GradType::Bf16 => Ok(GradValues::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect())),
            GradType::F16 => {
                let halves: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
                // Checked on what was written: the rounding decides.
                match halves.iter().position(|h| h.is_infinite()) {
                    Some(i) => Err(Error::GradOutOfF16Range {
                        field,
                        row: i / cols.max(1),
                        col: i % cols.max(1),
                        value: values[i],
                    }),
                    None => Ok(GradValues::F16(halves)),
                }
            }
        }
    }

    /// The element type.
    pub fn grad_type(&self) -> GradType {
        match self {
            GradValues::F32(_) => GradType::F32,
            GradValues::F16(_) => GradType::F16,
            GradValues::Bf16(_) => GradType::Bf16,
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            GradValues::F32(v) => v.len(),
            GradValues::F16(v) => v.len(),
            GradValues::Bf16(v) => v.len(),
        }
    }

    /// Whether it holds no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values' bytes in the machine's order (little-endian on every
    /// target headkl builds for), as a file such as safetensors stores
    /// them.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            GradValues::F32(v) => bytemuck::cast_slice(v),
            GradValues::F16(v) => bytemuck::cast_slice(v),
            GradValues::Bf16(v) => bytemuck::cast_slice(v),
        }
    }

    /// Value `i` widened to f32 (exact).
    pub fn get_f32(&self, i: usize) -> Option<f32> {
        match self {
            GradValues::F32(v) => v.get(i).copied(),
            GradValues::F16(v) => v.get(i).map(|h| h.to_f32()),
            GradValues::Bf16(v) => v.get(i).map(|h| h.to_f32()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_type_rounds_once_to_nearest_even() {
        // 1 + 2^-11 is halfway between two f16 values and 1 + 2^-8 between
        // two bf16 values: nearest even rounds both down to 1.
        let values = vec![1.0 + 2f32.powi(-11), 1.0 + 2f32.powi(-8), -3.0e38, 0.5];
        let f16s = GradValues::convert(&[values[0], values[3]], 2, GradType::F16, "g").unwrap();
        assert_eq!(f16s, GradValues::F16(vec![f16::ONE, f16::from_f32(0.5)]));
        let bf16s = GradValues::convert(&values, 2, GradType::Bf16, "g").unwrap();
        assert_eq!(bf16s.get_f32(1), Some(1.0));
        assert_eq!(bf16s.get_f32(2), Some(bf16::from_f32(-3.0e38).to_f32()));
        assert!(bf16s.get_f32(2).unwrap().is_finite());
        assert_eq!(
            (bf16s.grad_type(), bf16s.len(), bf16s.as_bytes().len()),
            (GradType::Bf16, 4, 8)
        );
        let f32s = GradValues::convert(&values, 2, GradType::F32, "g").unwrap();
        assert_eq!(f32s.as_bytes(), bytemuck::cast_slice::<f32, u8>(&values));
    }

    #[test]
    fn a_value_f16_cannot_hold_is_an_error_naming_its_place() {
        // 65519 rounds to 65504; 65520 rounds to infinity.
        let held = GradValues::convert(&[0.5, 65519.0], 2, GradType::F16, "head_grad").unwrap();
        assert_eq!(held.get_f32(1), Some(65504.0));
        let err = GradValues::convert(&[0.5, -1.0, 2.0, -65520.0], 2, GradType::F16, "head_grad").unwrap_err();
        assert_eq!(
            err,
            Error::GradOutOfF16Range {
                field: "head_grad",
                row: 1,
                col: 1,
                value: -65520.0
            }
        );
        assert_eq!(
            err.to_string(),
            "head_grad[1][1] = -6.552e4 is past f16's range (±65504): ask for bf16 or f32"
        );
        assert_eq!(err.kind(), crate::ErrorKind::Input);
    }

    #[test]
    fn a_loss_output_hands_its_head_gradient_out_in_the_type_asked_for() {
        // Two tokens of hs 3, so the gradient `[2][3]` is named by hs 3.
        let output = |head_grad: Vec<f32>| crate::LossOutput {
            loss: vec![0.0; 2],
            dx: vec![0.0; 6],
            head_grad,
            ..Default::default()
        };
        let mut out = output(vec![1.0, -2.5, 3.0e-3, 7.0e4, 0.25, 1.0e-9]);
        let err = out.take_head_grad(GradType::F16).unwrap_err();
        assert!(matches!(err, Error::GradOutOfF16Range { row: 1, col: 0, .. }), "{err}");
        assert_eq!(out.head_grad.len(), 6, "a failed conversion keeps the f32 values");
        let bf16s = out.take_head_grad(GradType::Bf16).unwrap();
        assert_eq!(
            bf16s,
            GradValues::convert(&[1.0, -2.5, 3.0e-3, 7.0e4, 0.25, 1.0e-9], 3, GradType::Bf16, "g").unwrap()
        );
        assert!(out.head_grad.is_empty());
        let mut out = output(vec![0.5; 6]);
        assert_eq!(
            out.take_head_grad(GradType::F32).unwrap(),
            GradValues::F32(vec![0.5; 6])
        );
        assert!(out.head_grad.is_empty());
    }
}
