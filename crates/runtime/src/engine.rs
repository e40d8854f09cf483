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

/// A loss call's teacher, as [`HostEngine::loss_into`] takes it.
#[derive(Clone, Copy)]
pub enum LossTeacher<'a> {
    /// Its top-k ([`Engine::head_kl_into`]).
    TopK(&'a Teacher),
    /// Its own hidden rows, through the head [`HostEngine::set_teacher_head`]
    /// uploaded: the exact full-vocabulary loss
    /// ([`Engine::head_kl_full_vocab_into`]).
    Hidden(&'a Hidden<'a>),
}

/// A loss call: the student's hidden rows, the teacher and the options.
#[derive(Clone, Copy)]
pub struct LossCall<'a> {
    /// The student's hidden rows.
    pub hidden: &'a Hidden<'a>,
    /// The teacher.
    pub teacher: LossTeacher<'a>,
    /// The loss options.
    pub opts: &'a LossOptions,
}

impl<'a> LossCall<'a> {
    /// The call of `hidden` against `teacher` with `opts`.
    pub fn new(hidden: &'a Hidden<'a>, teacher: LossTeacher<'a>, opts: &'a LossOptions) -> Self {
        Self { hidden, teacher, opts }
    }
}

/// The host calls of an engine, whatever its backend.
pub trait HostEngine: Send {
    /// The device it runs on.
    fn info(&self) -> &DeviceInfo;
    /// The device memory the backend holds now and at its peak.
    fn memory(&self) -> MemoryStats;
    /// Restarts the peak memory count.
    fn reset_peak_memory(&self);
    /// The loss and its gradient, into `out`.
    fn loss_into(&mut self, call: LossCall<'_>, out: &mut LossOutput) -> headkl_core::Result<()>;
    /// Uploads the teacher's head for the full-vocabulary loss.
    fn set_teacher_head(&mut self, head: &HeadWeights<'_>, slicing: SliceOptions) -> headkl_core::Result<()>;
    /// The exact top-k.
    fn topk(&mut self, hidden: &Hidden<'_>, opts: &TopkOptions) -> headkl_core::Result<TopK>;
    /// The log-probabilities at the given ids.
    fn logprobs_at(&mut self, hidden: &Hidden<'_>, ids: &[i64], opts: &TopkOptions) -> headkl_core::Result<Gathered>;
    /// The engine itself, for a caller that knows its backend's type
    /// (`Engine<B>`).
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// The sharded loss's two phases on one vocabulary shard, whatever its
/// backend.
pub trait HostShard: Send {
    /// The shard's rows.
    fn shard(&self) -> HeadShard;
    /// The shard's engine, for the calls a shard answers alone (its
    /// top-k candidates, its device and memory).
    fn engine(&mut self) -> &mut dyn HostEngine;
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

impl<B: RuntimeBackend> HostEngine for Engine<B> {
    fn info(&self) -> &DeviceInfo {
        self.backend().info()
    }
    fn memory(&self) -> MemoryStats {
        self.backend().memory()
    }
    fn reset_peak_memory(&self) {
        self.backend().reset_peak_memory()
    }
    fn loss_into(&mut self, call: LossCall<'_>, out: &mut LossOutput) -> headkl_core::Result<()> {
        match call.teacher {
            LossTeacher::TopK(teacher) => self.head_kl_into(call.hidden, teacher, call.opts, out),
            LossTeacher::Hidden(rows) => self.head_kl_full_vocab_into(call.hidden, rows, call.opts, out),
        }
    }
    fn set_teacher_head(&mut self, head: &HeadWeights<'_>, slicing: SliceOptions) -> headkl_core::Result<()> {
        Engine::set_teacher_head(self, head, slicing)
    }
    fn topk(&mut self, hidden: &Hidden<'_>, opts: &TopkOptions) -> headkl_core::Result<TopK> {
        Engine::topk(self, hidden, opts)
    }
    fn logprobs_at(&mut self, hidden: &Hidden<'_>, ids: &[i64], opts: &TopkOptions) -> headkl_core::Result<Gathered> {
        Engine::logprobs_at(self, hidden, ids, opts)
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl<B: RuntimeBackend> HostShard for ShardEngine<B> {
    fn shard(&self) -> HeadShard {
        ShardEngine::shard(self)
    }
    fn engine(&mut self) -> &mut dyn HostEngine {
        self.engine_mut()
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
            AnyEngine::Shard(s) => s.engine(),
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
