//! Allocation ticks in a trace file: the format (shared by the preloaded writer and the
//! `mallocspy report` reader), the queue from the hook path, its messages, and the writer
//! process.

mod format;
pub(crate) mod message;
pub(crate) mod modules;
pub(crate) mod ring;
pub(crate) mod writer;

pub use crate::spies::ticks::StatsCallback;
pub use format::*;
pub use modules::this_executable;
