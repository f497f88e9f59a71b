//! `libmallocspy_preload.so`: the malloc family for `LD_PRELOAD`, forwarding to
//! [`mallocspy`]'s dispatcher. Everything that is not an export lives in the core crate.

#![forbid(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

mallocspy::export_interposer!();

/// The shim's own Rust allocations come from mallocspy's own heap: never through the hooks,
/// never from the program's heap.
#[global_allocator]
static OWN: mallocspy::OwnHeap = mallocspy::OwnHeap;

#[ctor::ctor(unsafe)]
fn init() {
    mallocspy::preload::init();
}

/// Runs from `.fini_array`: after every `atexit` handler, and after the destructors of the
/// modules initialised after this one (the program and most of its libraries).
extern "C" fn fini() {
    mallocspy::preload::fini();
}

#[used]
#[unsafe(link_section = ".fini_array")]
static FINI: extern "C" fn() = fini;
