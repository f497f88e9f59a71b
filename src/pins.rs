//! References on the modules whose code mallocspy may still call: a registered spy's, a
//! callback's.
//!
//! A plugin may register a spy and be `dlclose`d while the spy is registered; unmapped, its
//! code would be called at the next allocation (the program died of SIGSEGV inside `dlclose`,
//! in the loader's own `free`). The module's own reference count keeps it: registering takes
//! a reference on every module holding a function of the spy's table (or its context), as
//! `dlopen(RTLD_NOLOAD)` of the same file does, and the spy's drop gives them back. The
//! program's `dlclose` then does what it always does (a library opened twice needs two), a
//! spy's code in a dependency of the closed library is kept too, and the library goes when
//! the spy does.
//!
//! Neither is done inside a hook: taking or giving back a reference takes the loader's lock,
//! which a thread may hold while it waits for the hooks in flight to end (revoking a spy from
//! a library's constructor, inside `dlopen`). A spy registered from inside a hook (by a spy's
//! `release`) is not pinned; one dropped inside a hook (by the free of its last block) leaves
//! its references to the next registration, revoke, drop or `dlclose` outside any hook.

use core::ffi::{CStr, c_int, c_void};
use core::ptr::NonNull;
use core::sync::atomic::{AtomicPtr, Ordering};

/// `RTLD_DL_LINKMAP` (`dlfcn.h`), which the libc crate lacks: `dladdr1` then gives the
/// module's `struct link_map`, which is also what glibc's `dlopen` returns as its handle.
const RTLD_DL_LINKMAP: c_int = 2;

/// Modules held loaded until this is dropped.
#[derive(Default)]
pub(crate) struct Pins(Vec<NonNull<c_void>>);

impl Pins {
    /// References the module holding each of `addresses` (code or data; an address in no
    /// module, such as a heap block's, needs none), each module once. The program itself is
    /// never unloaded and is not referenced. None inside a hook.
    pub(crate) fn of(addresses: impl IntoIterator<Item = usize>) -> Self {
        let mut pins = Pins::default();
        if in_hook() {
            return pins;
        }
        close_left();
        for address in addresses {
            if let Some(handle) = reference(address, &pins.0) {
                pins.0.push(handle);
            }
        }
        pins
    }

    /// References the module holding `address` for the rest of the process's life: a
    /// callback's, which a thread may be calling at any time. Not inside a hook.
    pub(crate) fn forever(address: usize) {
        if !in_hook() {
            reference(address, &[]);
        }
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        if in_hook() {
            self.0.drain(..).for_each(leave_for_later);
            return;
        }
        for handle in self.0.drain(..) {
            // SAFETY: a reference `reference` took, given back once.
            unsafe { crate::dl_close::dlclose(handle.as_ptr()) };
        }
        close_left();
    }
}

/// Whether the calling thread is inside a hook of the allocator.
fn in_hook() -> bool {
    crate::tls::state().depth.get() != 0
}

/// References dropped inside hooks, to give back outside one ([`close_left`]). A reference
/// that finds no room here is kept for good: its module stays loaded.
static LEFT: [AtomicPtr<c_void>; 64] = [const { AtomicPtr::new(core::ptr::null_mut()) }; 64];

fn leave_for_later(handle: NonNull<c_void>) {
    let free = |slot: &AtomicPtr<c_void>| {
        slot.compare_exchange(core::ptr::null_mut(), handle.as_ptr(), Ordering::AcqRel, Ordering::Relaxed).is_ok()
    };
    let _kept_for_good = !LEFT.iter().any(free);
}

/// Gives back the references dropped inside hooks, when called outside one.
pub(crate) fn close_left() {
    if in_hook() {
        return;
    }
    for slot in &LEFT {
        let handle = slot.swap(core::ptr::null_mut(), Ordering::AcqRel);
        if !handle.is_null() {
            // SAFETY: a reference `reference` took, which `leave_for_later` left here; the
            // swap makes this its only close.
            unsafe { crate::dl_close::dlclose(handle) };
        }
    }
}

/// A new reference on the module holding `address`, unless it is the program itself or one of
/// `held`.
fn reference(address: usize, held: &[NonNull<c_void>]) -> Option<NonNull<c_void>> {
    if address == 0 {
        return None;
    }
    // SAFETY: Dl_info is plain data, for which zero is a valid value.
    let mut info: libc::Dl_info = unsafe { core::mem::zeroed() };
    let mut map: *mut c_void = core::ptr::null_mut();
    // SAFETY: dladdr1 with RTLD_DL_LINKMAP writes the info and one pointer; it only looks the
    // address up among the loaded modules.
    let found = unsafe { libc::dladdr1(address as *const c_void, &mut info, &mut map, RTLD_DL_LINKMAP) } != 0;
    if !found || map.is_null() || info.dli_fname.is_null() || held.iter().any(|h| h.as_ptr() == map) {
        return None;
    }
    // SAFETY: dlopen(NULL) gives the program's own handle (its count does not matter: no
    // dlclose unloads the program); RTLD_NOLOAD loads nothing.
    let program = unsafe { libc::dlopen(core::ptr::null(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    // SAFETY: dladdr1 set a NUL-terminated name.
    if map == program || unsafe { CStr::from_ptr(info.dli_fname) }.is_empty() {
        return None;
    }
    // SAFETY: the module's own name, already loaded: RTLD_NOLOAD only counts a reference.
    let handle = unsafe { libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    if handle != map {
        // Another module of the same name (another namespace): not the one to keep.
        // SAFETY: the reference just taken, which nothing else uses.
        unsafe { crate::dl_close::dlclose(handle) };
        return None;
    }
    NonNull::new(handle)
}
