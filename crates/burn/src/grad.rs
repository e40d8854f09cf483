//! The loss as nodes of burn's autodiff graph.
//!
//! headkl computes `dx = ∂L/∂x` in the same pass as the loss, so a node's
//! state is `dx` itself and its backward step is one broadcast multiply by
//! the upstream gradient, cast to the hidden rows' dtype. The mean's node
//! takes a scalar upstream; the per-token node an upstream per row, times
//! a per-row factor that turns the mean's `dx` row (`w_t/total · ∂L_t/∂x_t`)
//! back into `∂L_t/∂x_t`.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::{Autodiff, Cube, GradientCheckpointingStrategy};
use burn::prelude::Tensor;
use burn::tensor::{FloatDType, Shape};

use crate::bridge::{AdTensor, Primitive};

/// How a node's upstream gradient reaches the rows.
#[derive(Clone, Debug)]
pub(crate) enum Upstream {
    /// The output is the mean (shape `[1]`): `grad_x = dx · g`.
    Scalar,
    /// The output is per token (shape `[ntok]`): `grad_x[t] = dx[t] ·
    /// g[t] · factor[t]`, `factor` f32 `[ntok]`.
    PerRow { factor: Box<Primitive>, ntok: usize },
}

/// The backward step of either node.
#[derive(Debug)]
struct HeadKlBackward;

impl Backward<Cube, 1> for HeadKlBackward {
    /// `dx` (f32 `[ntok][hs]`), how the upstream reaches it, and the
    /// hidden rows' float dtype.
    type State = (Primitive, Upstream, FloatDType);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [parent] = ops.parents;
        let upstream = grads.consume::<Cube>(&ops.node);
        let Some(parent) = parent else {
            return;
        };
        let (dx, how, dtype) = ops.state;
        let per_row = match how {
            Upstream::Scalar => Cube::float_reshape(upstream, Shape::new([1, 1])),
            Upstream::PerRow { factor, ntok } => {
                Cube::float_reshape(Cube::float_mul(upstream, *factor), Shape::new([ntok, 1]))
            }
        };
        let mut grad = Cube::float_mul(dx, per_row);
        if dtype != FloatDType::F32 {
            grad = Cube::float_cast(grad, dtype);
        }
        grads.register::<Cube>(parent.id, grad);
    }
}

fn attach_with<C: CheckpointStrategy, const D: usize>(
    hidden: AdTensor,
    state: (Primitive, Upstream, FloatDType),
    out: Primitive,
) -> Tensor<D>
where
    burn::backend::DispatchTensor: burn::backend::DispatchKindConversion<Autodiff<Cube, C>>,
{
    let (_, node) = hidden.into_parts();
    let out = match HeadKlBackward.prepare::<C>([node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(state, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    Tensor::from_primitive::<Autodiff<Cube, C>>(out)
}

/// `out` as the output of a graph node whose parent is `hidden` and whose
/// backward step delivers `dx` scaled as `upstream` says.
pub(crate) fn attach<const D: usize>(
    hidden: AdTensor,
    strategy: GradientCheckpointingStrategy,
    dx: Primitive,
    upstream: Upstream,
    dtype: FloatDType,
    out: Primitive,
) -> Tensor<D> {
    let state = (dx, upstream, dtype);
    match strategy {
        GradientCheckpointingStrategy::Balanced => attach_with::<BalancedCheckpointing, D>(hidden, state, out),
        GradientCheckpointingStrategy::Disabled => attach_with::<NoCheckpointing, D>(hidden, state, out),
    }
}
