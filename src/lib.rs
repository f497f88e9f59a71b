//! # mallocspy: COM's `IMallocSpy` for Linux
//!
//! mallocspy runs code of yours — a *spy* — around every call of the process's malloc family,
//! in programs you do not rebuild. A spy sees each call before and after the real allocator,
//! and may change what is allocated and what the caller gets (headers, trailers), exactly as
//! `IMallocSpy` may under `CoRegisterMallocSpy`.
//!
//! Two ways in:
//!
//! * **Preload** `libmallocspy_preload.so` (built from `cdylib-shim/`) into an unmodified
//!   program. It exports `malloc, calloc, realloc, reallocarray, free, posix_memalign,
//!   aligned_alloc, memalign, valloc, pvalloc, malloc_usable_size, malloc_trim` (and C23's
//!   `free_sized`, `free_aligned_sized`) and forwards to
//!   the next allocator in the lookup order (glibc, or jemalloc/tcmalloc preloaded after it).
//!   `MALLOCSPY_OPTIONS` picks built-in spies (see [`options`]); any module of the process
//!   registers its own spy through [`register_malloc_spy`] or the C header
//!   `include/mallocspy.h`.
//! * **Be your own interposer**: with the `interpose` feature a Rust program exports the
//!   malloc family itself, and its spy sees the allocations of the C libraries it calls too.
//!
//! ```no_run
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use mallocspy::{register_malloc_spy, revoke_malloc_spy, MallocSpy};
//!
//! /// Counts allocations, and makes each one 16 bytes larger than asked (the caller's
//! /// pointer is the real one: nothing else to map).
//! struct Padding(AtomicUsize);
//!
//! impl MallocSpy for Padding {
//!     fn pre_alloc(&self, size: usize) -> usize {
//!         self.0.fetch_add(1, Ordering::Relaxed);
//!         size.checked_add(16).unwrap_or(0) // 0: fail the call
//!     }
//! }
//!
//! register_malloc_spy(Padding(AtomicUsize::new(0)))?;
//! let v = vec![1u8; 100]; // Rust's allocator calls malloc: spied
//! drop(v);
//! revoke_malloc_spy()?; // Ok, or AccessDenied while blocks allocated under it live (revoke pending)
//! # Ok::<(), mallocspy::SpyError>(())
//! ```
//!
//! The example registers only under the shim and with no built-in spy (one is a registered
//! spy too): `LD_PRELOAD=libmallocspy_preload.so MALLOCSPY_OPTIONS=spy=none`
//! (without the shim, [`SpyError::NotInterposed`]; under the default leak tracker,
//! [`SpyError::AlreadyRegistered`]); or in a program built with the `interpose` feature.
//!
//! A spy that moves the caller's pointer (a header before each block) maps it back in every
//! Pre method that takes one and keeps the alignment of aligned requests: the README's
//! `Header` spy is a complete one, run as written by the tests.
//!
//! The contract every spy lives by — what runs when, what a spy may change, re-entrancy,
//! panics, threads — is on [`MallocSpy`].

#![forbid(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod alt_stack;
mod api;
mod bootstrap;
mod credentials;
mod deferred;
mod delete_hint;
mod dispatch;
mod dl_close;
mod early;
mod ending_signals;
#[doc(hidden)]
pub mod fast_path;
pub mod ffi;
mod fixed_hash;
mod gate;
mod global;
mod heap;
#[doc(hidden)]
pub mod interpose;
mod kept_fd;
mod kill_all;
pub mod leaks;
mod line;
mod live_table;
mod loader;
pub mod options;
mod os;
mod own_heap;
mod pins;
mod pool;
mod prefetch;
#[doc(hidden)]
pub mod preload;
mod process_mark;
mod program_mappings;
mod registry;
mod seccomp;
mod signal_frames;
mod sink;
mod spare_stack;
mod spies;
mod spy;
mod stacks;
mod sync;
mod thread_create;
mod thread_records;
mod threads;
mod tls;
pub mod trace;
mod unwind;

pub use api::{
    did_alloc, heap_stats, leak_check, on_allocation_tick, on_heap_stats, register_malloc_spy, revoke_malloc_spy,
    spied_blocks, start_allocation_ticks, start_leak_tracking, tracker_memory,
};
pub use own_heap::OwnHeap;
pub use spies::leaks::{HeapStats, TrackerMemory};
pub use spies::ticks::{AllocationTick, TickCallback};
pub use spy::{Call, CallScratch, DidAlloc, Entry, MallocSpy, Role, SpyError};
pub use threads::MAX_THREADS;

#[cfg(feature = "interpose")]
export_interposer!();
