//! The loss as a node of burn's autodiff graph.
//!
//! headkl computes `dx = ∂L/∂x` in the same pass as the loss, so the node's
//! state is `dx` itself and its backward step is one broadcast multiply by
//! the upstream gradient (a scalar: the loss is a mean), cast to the
//! hidden rows' dtype.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::{Autodiff, Cube, GradientCheckpointingStrategy};
use burn::prelude::Tensor;
use burn::tensor::{FloatDType, Shape};

use crate::bridge::{AdTensor, Fused};

/// The backward step: `grad_x = dx · g`, `g` the upstream gradient of the
/// mean loss.
#[derive(Debug)]
struct HeadKlBackward;

impl Backward<Cube, 1> for HeadKlBackward {
    /// `dx` (f32 `[ntok][hs]`) and the hidden rows' float dtype.
    type State = (Fused, FloatDType);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [parent] = ops.parents;
        let upstream = grads.consume::<Cube>(&ops.node);
        let Some(parent) = parent else {
            return;
        };
        let (dx, dtype) = ops.state;
        let upstream = Cube::float_reshape(upstream, Shape::new([1, 1]));
        let mut grad = Cube::float_mul(dx, upstream);
        if dtype != FloatDType::F32 {
            grad = Cube::float_cast(grad, dtype);
        }
        grads.register::<Cube>(parent.id, grad);
    }
}

fn attach_with<C: CheckpointStrategy>(hidden: AdTensor, dx: Fused, dtype: FloatDType, mean: Fused) -> Tensor<1>
where
    burn::backend::DispatchTensor: burn::backend::DispatchKindConversion<Autodiff<Cube, C>>,
{
    let (_, node) = hidden.into_parts();
    let out = match HeadKlBackward.prepare::<C>([node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((dx, dtype), mean),
        OpsKind::UnTracked(prep) => prep.finish(mean),
    };
    Tensor::from_primitive::<Autodiff<Cube, C>>(out)
}

/// `mean` (shape `[1]`) as the output of a graph node whose parent is
/// `hidden` and whose backward step delivers `dx` scaled by the upstream
/// gradient.
pub(crate) fn attach(
    hidden: AdTensor,
    strategy: GradientCheckpointingStrategy,
    dx: Fused,
    dtype: FloatDType,
    mean: Fused,
) -> Tensor<1> {
    match strategy {
        GradientCheckpointingStrategy::Balanced => attach_with::<BalancedCheckpointing>(hidden, dx, dtype, mean),
        GradientCheckpointingStrategy::Disabled => attach_with::<NoCheckpointing>(hidden, dx, dtype, mean),
    }
}
