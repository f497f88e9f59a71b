//! Registration from Rust: `CoRegisterMallocSpy`, `CoRevokeMallocSpy` and `IMalloc::DidAlloc`,
//! routed to whichever interposer is the process's allocator.

use core::ffi::c_void;

use crate::ffi;
use crate::global::{self, GLOBAL};
use crate::spy::{DidAlloc, MallocSpy, SpyError};

/// Where the process's registry is.
enum Target {
    /// In this module: it is the interposer (`interpose` feature or `export_interposer!`).
    Here,
    /// In another module (the preloaded shim), reached through its C API.
    Remote(&'static ffi::Api),
}

fn target() -> Result<Target, SpyError> {
    if global::is_active_here() {
        Ok(Target::Here)
    } else {
        global::remote_api().map(Target::Remote).ok_or(SpyError::NotInterposed)
    }
}

/// Registers `spy` as the process's malloc spy (`CoRegisterMallocSpy`).
///
/// From then on every call of the malloc family, from any code in the process, runs through
/// its hooks (see [`MallocSpy`]'s contract).
///
/// # Errors
/// [`SpyError::AlreadyRegistered`] while another spy is registered or a revoked one still has
/// live blocks; [`SpyError::NotInterposed`] when mallocspy is not the process's allocator;
/// [`SpyError::InvalidArgument`] when the interposer cannot use a spy from this module (an
/// incompatible ABI version). A refused spy is dropped.
pub fn register_malloc_spy(spy: impl MallocSpy + 'static) -> Result<(), SpyError> {
    match target()? {
        Target::Here => global::register_here(move || Box::new(spy)),
        Target::Remote(api) => ffi::register_remote(api, Box::new(spy)),
    }
}

/// Revokes the registered spy (`CoRevokeMallocSpy`).
///
/// # Errors
/// [`SpyError::NotRegistered`] when none is registered. [`SpyError::AccessDenied`] while
/// blocks allocated under the spy are live: the revoke is then pending, the spy keeps
/// receiving the frees and reallocs of those blocks and is dropped right after the last one
/// is freed. [`SpyError::NotInterposed`] as for [`register_malloc_spy`].
pub fn revoke_malloc_spy() -> Result<(), SpyError> {
    match target()? {
        Target::Here => GLOBAL.revoke(),
        Target::Remote(api) => SpyError::from_status((api.revoke_spy)()),
    }
}

/// Whether `ptr` is a live block of the process's heap (`IMalloc::DidAlloc`).
///
/// [`DidAlloc::Yes`] for a block allocated while a spy was registered and not yet freed;
/// [`DidAlloc::No`] for NULL and for pointers no block can start at; [`DidAlloc::Unknown`]
/// otherwise (mallocspy keeps no record of blocks allocated while no spy was registered).
pub fn did_alloc(ptr: *const c_void) -> DidAlloc {
    let ptr = ptr as *mut c_void;
    match target() {
        Ok(Target::Here) => GLOBAL.did_alloc(ptr),
        // SAFETY: the API's did_alloc accepts any pointer value.
        Ok(Target::Remote(api)) => DidAlloc::from_int(unsafe { (api.did_alloc)(ptr) }),
        Err(_) if ptr.is_null() => DidAlloc::No,
        Err(_) => DidAlloc::Unknown,
    }
}

/// Number of live blocks allocated under the current spy of this module's interposer
/// (0 when this module is not the interposer).
pub fn spied_blocks() -> usize {
    if global::is_active_here() { GLOBAL.spied_blocks() } else { 0 }
}
