//! Hash maps whose hasher needs no random seed. std's `RandomState` asks the kernel for one
//! (`getrandom`) and panics when refused: under a seccomp filter answering `EPERM`, the leak
//! report at exit aborted the program. The keys are addresses and mallocspy's own ids, not
//! an attacker's choosing, so a fixed SipHash key is enough.

use std::hash::{BuildHasherDefault, DefaultHasher};

/// A hasher with a fixed key.
pub(crate) type FixedState = BuildHasherDefault<DefaultHasher>;
/// `std::collections::HashMap` with a [`FixedState`] (made with `default()`).
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, FixedState>;
/// `std::collections::HashSet` with a [`FixedState`] (made with `default()`).
pub(crate) type HashSet<T> = std::collections::HashSet<T, FixedState>;
