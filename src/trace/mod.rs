//! Allocation ticks in a trace file: the format (shared by the preloaded writer and the
//! `mallocspy report` reader), the queue from the hook path and the writer thread.

mod format;
pub(crate) mod modules;
pub(crate) mod ring;
pub(crate) mod writer;

pub use format::*;
pub use writer::StatsCallback;
