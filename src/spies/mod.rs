//! The built-in spies, chosen by `MALLOCSPY_OPTIONS` (see [`crate::options`]).

pub(crate) mod count;
pub(crate) mod finding_sites;
pub(crate) mod guard;
pub(crate) mod handler_frees;
pub(crate) mod leaks;
pub(crate) mod sampled;
pub(crate) mod stack;
pub(crate) mod ticks;
