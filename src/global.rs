//! The process-wide interposer of this module, and how other modules reach the active one.

use core::ffi::{c_int, c_void};
use core::sync::atomic::{AtomicPtr, AtomicU8, Ordering};

use crate::dispatch::Interposer;
use crate::ffi::{self, Api, SpyVtable};
use crate::heap::NextHeap;
use crate::pins::Pins;
use crate::spy::{MallocSpy, Role, SpyError};
use crate::{os, threads, tls};

/// This module's interposer. It serves the malloc family only where
/// [`crate::export_interposer!`] exports it. Named for the exported `malloc` and `free`, whose
/// assembly reads it (and makes the name hidden: it is not exported from the shim).
#[unsafe(export_name = "__mallocspy_global")]
pub(crate) static GLOBAL: Interposer<NextHeap> = Interposer::new(NextHeap::new());

const UNKNOWN: u8 = 0;
const YES: u8 = 1;
const NO: u8 = 2;
static ACTIVE_HERE: AtomicU8 = AtomicU8::new(UNKNOWN);

/// Whether this module provides the process's `malloc`, i.e. whether [`GLOBAL`] is the
/// registry in use. Fixed once the program has started, so it is computed once. Not under
/// valgrind, whose tool replaces the malloc family by the code whatever the lookup finds: a
/// spy registered there was never called (review helper 164).
pub(crate) fn is_active_here() -> bool {
    match ACTIVE_HERE.load(Ordering::Relaxed) {
        YES => true,
        NO => false,
        _ => {
            // SAFETY: the name is NUL-terminated; RTLD_DEFAULT searches the global scope.
            let malloc = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"malloc".as_ptr()) };
            let here = os::module_of((&GLOBAL as *const Interposer<NextHeap>).cast());
            let yes = !malloc.is_null() && here != 0 && os::module_of(malloc) == here && !os::running_on_valgrind();
            ACTIVE_HERE.store(if yes { YES } else { NO }, Ordering::Relaxed);
            yes
        }
    }
}

/// The API table of the active interposer when it is another module.
pub(crate) fn remote_api() -> Option<&'static Api> {
    // SAFETY: the name is NUL-terminated; RTLD_DEFAULT searches the global scope.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"mallocspy_api_v1".as_ptr()) } as *const Api;
    // SAFETY: a symbol of that name is an `Api` exported by `export_interposer!`, static.
    let api = unsafe { sym.as_ref() }?;
    if api.version != ffi::ABI_VERSION || (api.size as usize) < core::mem::size_of::<Api>() {
        return None;
    }
    ((api.is_active)() != 0).then_some(api)
}

/// A function run in the child after `fork`, for the built-in spies' own state.
static CHILD_HOOK: AtomicPtr<()> = AtomicPtr::new(core::ptr::null_mut());

/// Sets the function [`GLOBAL`]'s fork handler runs in the child.
pub(crate) fn set_fork_child_hook(hook: fn()) {
    CHILD_HOOK.store(hook as *mut (), Ordering::Release);
}

/// `fork`'s prepare handler: no thread inside mallocspy, and its locks held, while the memory
/// is copied (also around the trace writer's own fork: `trace::writer`).
pub(crate) extern "C" fn fork_prepare() {
    crate::leaks::stop::fork_prepare();
    threads::fork_prepare();
    // Before mallocspy's own heap: a change of the list allocates from it.
    crate::leaks::unloaded::fork_prepare();
    crate::own_heap::fork_prepare();
}

/// `fork`'s parent handler: the locks [`fork_prepare`] took let go, the threads let back in.
pub(crate) extern "C" fn fork_parent() {
    crate::own_heap::fork_release();
    crate::leaks::unloaded::fork_release();
    threads::fork_parent();
    crate::leaks::stop::fork_parent();
}

extern "C" fn fork_child() {
    crate::leaks::stop::fork_child();
    crate::own_heap::fork_release();
    crate::leaks::unloaded::fork_release();
    crate::leaks::unloaded::fork_child();
    crate::pool::force_unlock();
    crate::spare_stack::after_fork_child();
    crate::program_mappings::after_fork_child();
    crate::leaks::kept::after_fork_child();
    crate::loader::after_fork_child();
    GLOBAL.after_fork_child();
    threads::fork_child();
    let hook = CHILD_HOOK.load(Ordering::Acquire);
    if !hook.is_null() {
        // SAFETY: only `set_fork_child_hook` stores here, always a `fn()`.
        let hook: fn() = unsafe { core::mem::transmute::<*mut (), fn()>(hook) };
        hook();
    }
}

/// Installs the `fork` handlers once: no thread may be inside a spied hook while the address
/// space is copied, or the child would inherit its locks held.
pub(crate) fn ensure_fork_handlers() {
    static DONE: AtomicU8 = AtomicU8::new(0);
    if DONE.swap(1, Ordering::AcqRel) == 0 {
        // SAFETY: the handlers are `extern "C" fn()` that never unwind.
        unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child)) };
    }
}

/// Registers a spy with [`GLOBAL`].
pub(crate) fn register_here(pins: Pins, role: Role, make: impl FnOnce() -> Box<dyn MallocSpy>) -> Result<(), SpyError> {
    ensure_fork_handlers();
    GLOBAL.heap.warm_up();
    GLOBAL.register_from(pins, role, make)
}

/// Registers a spy that outlives its registration with [`GLOBAL`] (the built-in spies).
pub(crate) fn register_static_here(spy: &'static dyn MallocSpy) -> Result<(), SpyError> {
    ensure_fork_handlers();
    GLOBAL.heap.warm_up();
    GLOBAL.register_static(spy)
}

// ---- the C API of this module -------------------------------------------------------------

unsafe extern "C" fn api_register(vtable: *const SpyVtable, ctx: *mut c_void) -> i32 {
    if !is_active_here() {
        return ffi::MALLOCSPY_E_NOT_INTERPOSED;
    }
    // SAFETY: the caller's guarantee (header contract): NULL or a table living until release.
    let registered = unsafe { ffi::validate(vtable) }.and_then(|()| {
        // SAFETY: validated; the rest is the caller's guarantee.
        let pins = Pins::of(unsafe { ffi::addresses_of(vtable, ctx) });
        // SAFETY: validated.
        let role = unsafe { ffi::role_of(vtable) };
        // SAFETY: as above.
        register_here(pins, role, || unsafe { ffi::c_spy(vtable, ctx) })
    });
    ffi::status(registered)
}

extern "C" fn api_revoke() -> i32 {
    if !is_active_here() {
        return ffi::MALLOCSPY_E_NOT_INTERPOSED;
    }
    let status = ffi::status(revoke_here());
    crate::pins::close_left();
    status
}

/// Whether the leak tracker and the ticks spy this module started last (the preloaded shim's,
/// or [`crate::start_leak_tracking`]'s and [`crate::start_allocation_ticks`]'s) are
/// registered: the API's queries of each answer only then (a revoked one has not seen what
/// the program did since, and one whose registration failed never saw anything).
static TRACKER_RUNS: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);
static TICKS_RUN: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);

/// Notes which built-in spies the registration that just succeeded holds.
pub(crate) fn built_ins_registered(tracker: bool, ticks: bool) {
    TRACKER_RUNS.store(tracker, core::sync::atomic::Ordering::Release);
    TICKS_RUN.store(ticks, core::sync::atomic::Ordering::Release);
}

/// Revokes this module's registered spy (`CoRevokeMallocSpy`).
pub(crate) fn revoke_here() -> Result<(), SpyError> {
    let revoked = GLOBAL.revoke();
    if revoked.is_ok() {
        // Whichever spy it was, none runs now.
        built_ins_registered(false, false);
    }
    revoked
}

/// The leak tracker, while it is registered.
fn running_tracker() -> Option<&'static crate::spies::leaks::LeakTracker> {
    crate::spies::leaks::tracker().filter(|_| TRACKER_RUNS.load(core::sync::atomic::Ordering::Acquire))
}

/// The ticks spy, while it is registered.
pub(crate) fn running_ticks() -> Option<&'static crate::spies::ticks::TickSpy> {
    crate::spies::ticks::spy().filter(|_| TICKS_RUN.load(core::sync::atomic::Ordering::Acquire))
}

unsafe extern "C" fn api_did_alloc(ptr: *mut c_void) -> c_int {
    GLOBAL.did_alloc(ptr).as_int()
}

extern "C" fn api_call_scratch() -> *mut u64 {
    tls::state().scratch.as_ptr() as *mut u64
}

extern "C" fn api_is_active() -> c_int {
    is_active_here() as c_int
}

/// Writes `value` to `out` when this module runs a leak tracker.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn with_tracker<T>(out: *mut T, value: impl FnOnce(&crate::spies::leaks::LeakTracker) -> T) -> i32 {
    let Some(tracker) = running_tracker() else { return ffi::CO_E_OBJNOTREG };
    if out.is_null() {
        return ffi::E_INVALIDARG;
    }
    // SAFETY: the caller's guarantee.
    unsafe { out.write(value(tracker)) };
    ffi::S_OK
}

unsafe extern "C" fn api_heap_stats(out: *mut crate::HeapStats) -> i32 {
    // SAFETY: the caller's guarantee (header contract).
    unsafe { with_tracker(out, |t| t.stats()) }
}

unsafe extern "C" fn api_leak_check(out: *mut crate::leaks::Summary) -> i32 {
    let caller = crate::leaks::Caller::here();
    // SAFETY: the caller's guarantee (header contract).
    unsafe { with_tracker(out, |t| crate::preload::write_leak_report(t, caller)) }
}

unsafe extern "C" fn api_tracker_memory(out: *mut crate::TrackerMemory) -> i32 {
    // SAFETY: the caller's guarantee (header contract).
    unsafe { with_tracker(out, |t| t.memory()) }
}

extern "C" fn api_on_allocation_tick(callback: Option<crate::TickCallback>) -> i32 {
    match running_ticks() {
        Some(spy) => {
            // A thread may be calling the callback (or its predecessor) at any time.
            Pins::forever(callback.map_or(0, |f| f as usize));
            spy.set_callback(callback);
            ffi::S_OK
        }
        None => ffi::CO_E_OBJNOTREG,
    }
}

extern "C" fn api_on_heap_stats(callback: Option<crate::trace::StatsCallback>) -> i32 {
    match running_ticks() {
        Some(spy) => {
            // As in `api_on_allocation_tick`.
            Pins::forever(callback.map_or(0, |f| f as usize));
            spy.set_stats_callback(callback);
            ffi::S_OK
        }
        None => ffi::CO_E_OBJNOTREG,
    }
}

extern "C" fn api_spy_failed() {
    crate::tls::state().spy_failed.set(1);
}

extern "C" fn api_spied_blocks() -> u64 {
    if is_active_here() { GLOBAL.spied_blocks() as u64 } else { 0 }
}

/// This module's API table, for the Rust API when this module is the interposer.
pub(crate) static LOCAL_API: Api = API;

/// The table [`crate::export_interposer!`] exports as `mallocspy_api_v1`.
#[doc(hidden)]
pub const API: Api = Api {
    version: ffi::ABI_VERSION,
    size: core::mem::size_of::<Api>() as u32,
    register_spy: api_register,
    revoke_spy: api_revoke,
    did_alloc: api_did_alloc,
    call_scratch: api_call_scratch,
    is_active: api_is_active,
    heap_stats: api_heap_stats,
    leak_check: api_leak_check,
    tracker_memory: api_tracker_memory,
    on_allocation_tick: api_on_allocation_tick,
    on_heap_stats: api_on_heap_stats,
    spy_failed: api_spy_failed,
    spied_blocks: api_spied_blocks,
};
