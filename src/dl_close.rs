//! `dlclose`, wrapped so that the trace writer knows a library's code before it is unmapped.
//!
//! The writer process learns the program's modules by reading its memory map, when a stack
//! names code it does not know yet. It reads the queue a little behind the program, so a
//! library that allocates and is unloaded at once would be gone from the map by the time its
//! stacks are read: the trace would name none of its functions. The wrapper lets the writer
//! catch up first (heaptrack's preload library wraps `dlclose` for the same reason, to
//! refresh its module list), and after the call it reads them again, so that the trace says
//! when the library went. The leak tracker notes what the call unloads
//! ([`crate::leaks::unloaded`]).

use core::ffi::{c_int, c_void};
use core::sync::atomic::AtomicPtr;

type Close = unsafe extern "C" fn(*mut c_void) -> c_int;

static NEXT: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

/// `dlclose(handle)`: the writer catches up, then libc's `dlclose` runs.
///
/// # Safety
/// As `dlclose`.
pub(crate) unsafe fn dlclose(handle: *mut c_void) -> c_int {
    if let Some(writer) = crate::trace::writer::writer() {
        writer.sync_before_unload();
    }
    let f = crate::os::next_symbol_cached(&NEXT, c"dlclose");
    if f.is_null() {
        // Nothing to forward to (no libdl after us): as dlclose does for a bad handle.
        return -1;
    }
    let loaded_before = crate::os::modules_code();
    // The leak report must still name the code of the libraries this call unloads.
    let closing = crate::spies::leaks::tracker()
        .zip(loaded_before.clone())
        .and_then(|(tracker, loaded)| crate::leaks::unloaded::before_dlclose(handle, loaded, tracker.stacks.next_id()));
    let unloaded_before = crate::os::objects_unloaded();
    // SAFETY: libc's dlclose has this signature; the caller's guarantee covers the handle.
    let status = unsafe { core::mem::transmute::<*mut c_void, Close>(f)(handle) };
    // Whether something was unmapped: a `dlclose` mostly drops a reference (one from a
    // library's destructor, inside this one, leaves the unloading to this one).
    let unloaded = crate::os::objects_unloaded() != unloaded_before;
    let loaded_after = if unloaded { crate::os::modules_code() } else { None };
    if let Some(closing) = closing {
        crate::leaks::unloaded::after_dlclose(closing, unloaded, loaded_after.as_deref());
    }
    if unloaded {
        // Stacks through the code it unmapped get ids of their own from now on. By name too:
        // a library that another thread loaded meanwhile may lie where this one was, with
        // the same extent.
        let unmapped = loaded_before.zip(loaded_after).map(|(before, after)| {
            before.into_iter().filter(|m| !after.contains(m)).map(|m| (m.start, m.end)).collect::<Vec<_>>()
        });
        crate::stacks::after_unload(unmapped.as_deref());
    }
    if status == 0
        && let Some(writer) = crate::trace::writer::writer()
    {
        writer.after_unload();
    }
    // A spy released inside a hook left its library to give back; the program closing it is
    // waiting for it to go.
    crate::pins::close_left();
    status
}
