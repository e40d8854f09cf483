//! The loss as nodes of burn's autodiff graph.
//!
//! headkl computes `dx = ∂L/∂x` in the same pass as the loss, so a node's
//! state is `dx` itself and its backward step is one broadcast multiply by
//! the upstream gradient, cast to the hidden rows' dtype. The mean's node
//! takes a scalar upstream; the per-token node an upstream per row, times
//! a per-row factor that turns the mean's `dx` row (`w_t/total · ∂L_t/∂x_t`)
//! back into `∂L_t/∂x_t`.
//!
//! A trainable head's nodes have two parents, the rows and the head. The
//! mean's node keeps the call's head gradient `dW` and scales it as it
//! scales `dx`. The per-token node cannot: `Σ_t u_t ∂L_t/∂W` for an
//! upstream `u` per row is not a multiple of the mean's `dW`, and a loss
//! call takes only weights `≥ 0`. Its backward step makes two more loss
//! calls of the same rows and teacher, reduced by the sum, with weights
//! `max(u_t, 0)` and `max(−u_t, 0)` (0 on the rows the per-token node
//! masks), and takes the difference of their head gradients. (One call
//! with `u` shifted to be non-negative, the mean's `dW` making up the
//! shift, is cheaper but cancels: with uneven weights the shift is large
//! and the head's gradient loses digits.)

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::{Autodiff, Cube, GradientCheckpointingStrategy};
use burn::prelude::Tensor;
use burn::tensor::{FloatDType, Shape};
use headkl_core::{LossConfig, Reduction};

use crate::bridge::{self, AdTensor, Primitive};
use crate::engine::{LossInputs, SharedCore};
use crate::{head, Error, Result};

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
        grads.register::<Cube>(parent.id, rows_grad(dx, how, upstream, dtype));
    }
}

/// The rows' gradient: `dx` times the upstream as `how` says, in `dtype`.
fn rows_grad(dx: Primitive, how: Upstream, upstream: Primitive, dtype: FloatDType) -> Primitive {
    let per_row = match how {
        Upstream::Scalar => Cube::float_reshape(upstream, Shape::new([1, 1])),
        Upstream::PerRow { factor, ntok } => {
            Cube::float_reshape(Cube::float_mul(upstream, *factor), Shape::new([ntok, 1]))
        }
    };
    cast(Cube::float_mul(dx, per_row), dtype)
}

fn cast(grad: Primitive, dtype: FloatDType) -> Primitive {
    if dtype == FloatDType::F32 {
        grad
    } else {
        Cube::float_cast(grad, dtype)
    }
}

/// Where a trainable head's node gets the head's gradient.
#[derive(Clone, Debug)]
pub(crate) enum HeadGradOf {
    /// The call's `∂loss/∂W` (f32 `[V][hs]`), for the mean's node: times
    /// its scalar upstream.
    Call(Box<Primitive>),
    /// The per-token node's: made in backward for its upstream.
    PerToken(Box<PerTokenHead>),
}

/// What the per-token node of a trainable head keeps for its backward
/// step's loss calls (see the module's notes).
#[derive(Clone, Debug)]
pub(crate) struct PerTokenHead {
    /// The engine the calls run on.
    pub core: SharedCore,
    /// The forward call's inputs (their weights are replaced).
    pub inputs: LossInputs,
    /// The forward call's options (the reduction is replaced by the sum).
    pub config: LossConfig,
    /// The head the forward call read (read again if the engine has read
    /// another since) and its version.
    pub head: Primitive,
    pub version: u64,
    /// 1 on rows of positive weight, 0 on the others, f32 `[ntok]`.
    pub mask: Primitive,
}

impl PerTokenHead {
    /// `Σ_t u_t ∂L_t/∂W` over the rows of positive weight, f32 `[V][hs]`,
    /// for the upstream `u` (`[ntok]`); on failure, the error is kept for
    /// the next wait and the head gets nothing.
    fn head_grad(&self, upstream: Primitive) -> Option<Primitive> {
        match self.try_head_grad(upstream) {
            Ok(grad) => Some(grad),
            Err(e) => {
                log::error!("headkl-burn: the head's gradient in a backward step: {e}");
                self.core.lock().deferred = Some(Error::Backward { source: Box::new(e) });
                None
            }
        }
    }

    fn try_head_grad(&self, upstream: Primitive) -> Result<Primitive> {
        let ntok = self.inputs.ntok;
        let mask = Tensor::<1>::from_primitive::<Cube>(self.mask.clone());
        let u = Tensor::<1>::from_primitive::<Cube>(upstream)
            .reshape([ntok])
            .cast(FloatDType::F32)
            * mask;
        let config = LossConfig {
            reduction: Reduction::Sum,
            total: None,
            gscale: None,
            head_grad: true,
            ..self.config
        };
        let mut core = self.core.lock();
        if core.head_version != self.version {
            core.read_head(&head::plain(self.head.clone()), self.version)?;
        }
        let mut head_grad_of = |weights: Tensor<1>| -> Result<Tensor<2>> {
            let inputs = LossInputs {
                weights: Some(bridge::float_parts(weights, "head gradient weights")?.inner),
                ..self.inputs.clone()
            };
            let dw = core
                .loss_call("head gradient", &inputs, config, true)?
                .head_grad
                .ok_or_else(|| bridge::backend_error("the head's gradient", "the call wrote none"))?;
            Ok(bridge::float_tensor(dw)?)
        };
        let up = head_grad_of(u.clone().clamp_min(0.0))?;
        let down = head_grad_of(u.neg().clamp_min(0.0))?;
        drop(core);
        Ok(bridge::float_parts(up - down, "head gradient")?.inner)
    }
}

/// The backward step of a trainable head's nodes: the rows get `dx` as
/// the frozen head's nodes give it, the head its gradient.
#[derive(Debug)]
struct TrainableBackward;

/// `dx`, how the upstream reaches it and the rows' dtype; the head's
/// gradient and the head's dtype.
type TrainableState = (Primitive, Upstream, FloatDType, HeadGradOf, FloatDType);

impl Backward<Cube, 2> for TrainableBackward {
    type State = TrainableState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [rows, head] = ops.parents;
        let upstream = grads.consume::<Cube>(&ops.node);
        let (dx, how, dtype, head_grad, head_dtype) = ops.state;
        if let Some(head) = head {
            let grad = match head_grad {
                HeadGradOf::Call(dw) => Some(Cube::float_mul(
                    *dw,
                    Cube::float_reshape(upstream.clone(), Shape::new([1, 1])),
                )),
                HeadGradOf::PerToken(p) => p.head_grad(upstream.clone()),
            };
            if let Some(grad) = grad {
                grads.register::<Cube>(head.id, cast(grad, head_dtype));
            }
        }
        if let Some(rows) = rows {
            grads.register::<Cube>(rows.id, rows_grad(dx, how, upstream, dtype));
        }
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

fn attach_trainable_with<C: CheckpointStrategy, const D: usize>(
    (rows, head): (AdTensor, AdTensor),
    state: TrainableState,
    out: Primitive,
) -> Tensor<D>
where
    burn::backend::DispatchTensor: burn::backend::DispatchKindConversion<Autodiff<Cube, C>>,
{
    let (_, rows) = rows.into_parts();
    let (_, head) = head.into_parts();
    let out = match TrainableBackward.prepare::<C>([rows, head]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(state, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    Tensor::from_primitive::<Autodiff<Cube, C>>(out)
}

/// `out` as the output of a graph node whose parents are the rows and a
/// trainable head: the rows get `dx` scaled as `upstream` says (in
/// `dtype`), the head the gradient `head_grad` gives (in `head_dtype`).
pub(crate) fn attach_trainable<const D: usize>(
    parents: (AdTensor, AdTensor),
    strategy: GradientCheckpointingStrategy,
    (dx, upstream, dtype): (Primitive, Upstream, FloatDType),
    (head_grad, head_dtype): (HeadGradOf, FloatDType),
    out: Primitive,
) -> Tensor<D> {
    let state = (dx, upstream, dtype, head_grad, head_dtype);
    match strategy {
        GradientCheckpointingStrategy::Balanced => {
            attach_trainable_with::<BalancedCheckpointing, D>(parents, state, out)
        }
        GradientCheckpointingStrategy::Disabled => attach_trainable_with::<NoCheckpointing, D>(parents, state, out),
    }
}
