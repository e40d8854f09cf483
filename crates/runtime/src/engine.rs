//! An engine whose backend is chosen at run time: the head uploaded once
//! to whichever backend a [`Target`] names (the whole head, or one
//! vocabulary shard of it), and the host calls on it behind one erased
//! trait, [`HostEngine`]. What a program that holds an engine between
//! calls (the Python package) keeps.

use std::any::Any;

use headkl_core::shard::{HeadShard, LossPartials, LossStats, ShardEngine};
use headkl_core::{
    Backend, DeviceInfo, Engine, Gathered, HeadWeights, Hidden, LossOptions, LossOutput, MemoryStats, SliceOptions,
    Teacher, TopK, TopkOptions,
};

use crate::backend::RuntimeBackend;
use crate::error::Error;
use crate::run::{open_backend, OpenVisit};
use crate::target::Target;

/// The host calls of an engine, whatever its backend.
pub trait HostEngine: Send {
    /// The device it runs on.
    fn info(&self) -> &DeviceInfo;
    /// The device memory the backend holds now and at its peak.
    fn memory(&self) -> MemoryStats;
    /// Restarts the peak memory count.
    fn reset_peak_memory(&self);
    /// The loss and its gradient against a top-k teacher, into `out`.
    fn head_kl_into(
        &mut self,
        hidden: &Hidden<'_>,
        teacher: &Teacher,
        opts: &LossOptions,
        out: &mut LossOutput,
    ) -> headkl_core::Result<()>;
    /// Uploads the teacher's head for the full-vocabulary loss.
    fn set_teacher_head(&mut self, head: &HeadWeights<'_>, slicing: SliceOptions) -> headkl_core::Result<()>;
    /// The exact full-vocabulary loss against the teacher's hidden rows.
    fn head_kl_full_vocab_into(
        &mut self,
        hidden: &Hidden<'_>,
        teacher_hidden: &Hidden<'_>,
        opts: &LossOptions,
        out: &mut LossOutput,
    ) -> headkl_core::Result<()>;
    /// The exact top-k.
    fn topk(&mut self, hidden: &Hidden<'_>, opts: &TopkOptions) -> headkl_core::Result<TopK>;
    /// The log-probabilities at the given ids.
    fn logprobs_at(&mut self, hidden: &Hidden<'_>, ids: &[i64], opts: &TopkOptions) -> headkl_core::Result<Gathered>;
    /// The engine itself, for a caller that knows its backend's type
    /// (`Engine<B>` for a whole head, `ShardEngine<B>` for a shard).
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// The sharded loss's two phases on one vocabulary shard, whatever its
/// backend.
pub trait HostShard: HostEngine {
    /// The shard's rows.
    fn shard(&self) -> HeadShard;
    /// Phase one: this shard's partials.
    fn loss_partials(
        &mut self,
        hidden: &Hidden<'_>,
        teacher: &Teacher,
        opts: &LossOptions,
    ) -> headkl_core::Result<LossPartials>;
    /// Phase two, from the merged statistics.
    fn loss_finish(&mut self, hidden: &Hidden<'_>, stats: &LossStats, out: &mut LossOutput) -> headkl_core::Result<()>;
}

/// [`HostEngine`] for an engine type whose [`Engine`] `$engine` reaches.
macro_rules! host_engine {
    ($ty:ty, $self:ident => $engine:expr, $engine_mut:expr) => {
        impl<B: RuntimeBackend> HostEngine for $ty {
            fn info(&self) -> &DeviceInfo {
                let $self = self;
                $engine.backend().info()
            }
            fn memory(&self) -> MemoryStats {
                let $self = self;
                $engine.backend().memory()
            }
            fn reset_peak_memory(&self) {
                let $self = self;
                $engine.backend().reset_peak_memory()
            }
            fn head_kl_into(
                &mut self,
                hidden: &Hidden<'_>,
                teacher: &Teacher,
                opts: &LossOptions,
                out: &mut LossOutput,
            ) -> headkl_core::Result<()> {
                let $self = self;
                $engine_mut.head_kl_into(hidden, teacher, opts, out)
            }
            fn set_teacher_head(&mut self, head: &HeadWeights<'_>, slicing: SliceOptions) -> headkl_core::Result<()> {
                let $self = self;
                $engine_mut.set_teacher_head(head, slicing)
            }
            fn head_kl_full_vocab_into(
                &mut self,
                hidden: &Hidden<'_>,
                teacher_hidden: &Hidden<'_>,
                opts: &LossOptions,
                out: &mut LossOutput,
            ) -> headkl_core::Result<()> {
                let $self = self;
                $engine_mut.head_kl_full_vocab_into(hidden, teacher_hidden, opts, out)
            }
            fn topk(&mut self, hidden: &Hidden<'_>, opts: &TopkOptions) -> headkl_core::Result<TopK> {
                let $self = self;
                $engine_mut.topk(hidden, opts)
            }
            fn logprobs_at(
                &mut self,
                hidden: &Hidden<'_>,
                ids: &[i64],
                opts: &TopkOptions,
            ) -> headkl_core::Result<Gathered> {
                let $self = self;
                $engine_mut.logprobs_at(hidden, ids, opts)
            }
            fn as_any_mut(&mut self) -> &mut dyn Any {
                self
            }
        }
    };
}

host_engine!(Engine<B>, e => e, e);
host_engine!(ShardEngine<B>, s => s.engine(), s.engine_mut());

impl<B: RuntimeBackend> HostShard for ShardEngine<B> {
    fn shard(&self) -> HeadShard {
        ShardEngine::shard(self)
    }
    fn loss_partials(
        &mut self,
        hidden: &Hidden<'_>,
        teacher: &Teacher,
        opts: &LossOptions,
    ) -> headkl_core::Result<LossPartials> {
        ShardEngine::loss_partials(self, hidden, teacher, opts)
    }
    fn loss_finish(&mut self, hidden: &Hidden<'_>, stats: &LossStats, out: &mut LossOutput) -> headkl_core::Result<()> {
        ShardEngine::loss_finish(self, hidden, stats, out)
    }
}

/// An engine on the backend a [`Target`] names: the whole head, or one
/// vocabulary shard of it.
pub enum AnyEngine {
    /// The whole head.
    Whole(Box<dyn HostEngine>),
    /// One vocabulary shard.
    Shard(Box<dyn HostShard>),
}

impl AnyEngine {
    /// Opens `target`'s backend and uploads `head` (with `shard`, the rows
    /// of the head that `head` holds alone); the target's settings'
    /// engine switches (`HEADKL_TRACE`, `HEADKL_DX_SPLIT`,
    /// `HEADKL_NO_ROW_STATS`) applied.
    pub fn open(target: &Target, head: &HeadWeights<'_>, shard: Option<HeadShard>) -> Result<Self, Error> {
        struct Upload<'a, 'h> {
            target: &'a Target,
            head: &'a HeadWeights<'h>,
            shard: Option<HeadShard>,
        }
        impl OpenVisit for Upload<'_, '_> {
            type Output = headkl_core::Result<AnyEngine>;
            fn opened<B: RuntimeBackend>(self, backend: B) -> Self::Output {
                let slicing = SliceOptions::default();
                let settings = &self.target.settings;
                Ok(match self.shard {
                    None => {
                        let mut engine = Engine::new(backend, self.head, slicing)?;
                        settings.apply(&mut engine);
                        AnyEngine::Whole(erase(engine))
                    }
                    Some(shard) => {
                        let mut engine = ShardEngine::new(backend, self.head, shard, slicing)?;
                        settings.apply(engine.engine_mut());
                        AnyEngine::Shard(erase_shard(engine))
                    }
                })
            }
        }
        open_backend(target, Upload { target, head, shard })?.map_err(|source| Error::Engine { source })
    }

    /// The engine's host calls.
    pub fn engine(&mut self) -> &mut dyn HostEngine {
        match self {
            AnyEngine::Whole(e) => e.as_mut(),
            AnyEngine::Shard(s) => s.as_mut(),
        }
    }

    /// The shard's two phases, or `None` for the whole head.
    pub fn shard(&mut self) -> Option<&mut dyn HostShard> {
        match self {
            AnyEngine::Whole(_) => None,
            AnyEngine::Shard(s) => Some(s.as_mut()),
        }
    }

    /// The whole head's engine on backend `B`, where that is what this is.
    pub fn whole_on<B: Backend + 'static>(&mut self) -> Option<&mut Engine<B>> {
        match self {
            AnyEngine::Whole(e) => e.as_any_mut().downcast_mut::<Engine<B>>(),
            AnyEngine::Shard(_) => None,
        }
    }
}

fn erase<B: RuntimeBackend>(engine: Engine<B>) -> Box<dyn HostEngine> {
    Box::new(engine)
}

fn erase_shard<B: RuntimeBackend>(engine: ShardEngine<B>) -> Box<dyn HostShard> {
    Box::new(engine)
}
