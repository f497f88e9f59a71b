//! Allocation ticks in a trace file: the format (shared by the preloaded writer and the
//! `mallocspy report` reader), the queue from the hook path, its messages, and the writer
//! process.

mod file;
mod format;
pub(crate) mod message;
pub(crate) mod modules;
pub(crate) mod ring;
pub(crate) mod writer;

pub use crate::spies::ticks::StatsCallback;
pub use format::*;
pub use modules::this_executable;

/// Held by the tests that fork (the child holds a copy of every descriptor, and so every
/// trace file's lock, until it exits) and by those of the trace file's locking, which a child
/// of another test running meanwhile made see a free path as taken.
#[cfg(test)]
pub(crate) static FORKING_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());
