//! Registration from Rust: `CoRegisterMallocSpy`, `CoRevokeMallocSpy` and `IMalloc::DidAlloc`,
//! routed to whichever interposer is the process's allocator.

use core::ffi::c_void;
use std::panic::AssertUnwindSafe;

use crate::ffi;
use crate::global::{self, GLOBAL};
use crate::leaks::Summary;
use crate::spies::leaks::{HeapStats, TrackerMemory};
use crate::spies::ticks::TickCallback;
use crate::spy::{DidAlloc, MallocSpy, SpyError};
use crate::trace::{Sampling, StatsCallback};

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
/// incompatible ABI version) or the spy's [`role`](MallocSpy::role) panics. A refused spy is
/// dropped.
pub fn register_malloc_spy(spy: impl MallocSpy + 'static) -> Result<(), SpyError> {
    let target = target()?;
    // Asked once, here, outside the registry's lock: a `role` that called the API waited on
    // that lock for good (review helper 164).
    let Ok(role) = std::panic::catch_unwind(AssertUnwindSafe(|| spy.role())) else {
        let _ = std::panic::catch_unwind(AssertUnwindSafe(move || drop(spy)));
        return Err(SpyError::InvalidArgument);
    };
    match target {
        Target::Here => global::register_here(crate::pins::Pins::default(), role, move || Box::new(spy)),
        Target::Remote(api) => ffi::register_remote(api, Box::new(spy), role),
    }
}

/// Revokes the registered spy (`CoRevokeMallocSpy`).
///
/// # Errors
/// [`SpyError::NotRegistered`] when none is registered, a spy that panicked included (it was
/// revoked then, and its blocks still reach it; see [`MallocSpy`]), and while a revoke is
/// pending (the spy is no longer registered). [`SpyError::AccessDenied`] while
/// blocks allocated under the spy are live (from the spy's own allocation or `realloc` method,
/// the block that call returns among them): the revoke is then pending, the spy keeps
/// receiving the frees and reallocs of those blocks and is dropped right after the last one
/// is freed. [`SpyError::NotInterposed`] as for [`register_malloc_spy`].
///
/// Some blocks live as long as the process or a thread: a revoke may then stay pending for
/// good, and every later registration answer `AlreadyRegistered`. Any global made lazily
/// while the spy is registered keeps its block for good: stdout's buffer at the first
/// `println!`, a `OnceLock` or `lazy_static` first touched, and so on (touch them before
/// registering). Each thread whose stack glibc has not cached yet leaves a few (among them
/// glibc's TLS vector for it, kept with the cached stack), and so does the main thread's first
/// blocking receive on a std channel. Spawning, before registering, as many threads at once as
/// will run at once under the spy, and joining them, keeps the threads' blocks unspied (one
/// thread spawned first is not enough for four: review helper 137).
pub fn revoke_malloc_spy() -> Result<(), SpyError> {
    match target()? {
        Target::Here => global::revoke_here(),
        Target::Remote(api) => SpyError::from_status((api.revoke_spy)()),
    }
}

/// Whether `ptr` is a live block of the process's heap (`IMalloc::DidAlloc`).
///
/// [`DidAlloc::Yes`] for a block allocated while an interposing spy ([`crate::Role::Interpose`])
/// was registered and not yet freed; [`DidAlloc::No`] for NULL and for pointers no block can
/// start at (those not 16-aligned); [`DidAlloc::Unknown`] otherwise: mallocspy keeps no record
/// of blocks allocated while no spy, or an observing one, was registered, and cannot tell a
/// stack address or a pointer already freed from such a block (COM's `DidAlloc` answers 0 for
/// a freed one).
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

/// Number of live blocks allocated under the current spy, or under a revoked one whose revoke
/// is pending (0 when mallocspy is not the process's allocator).
pub fn spied_blocks() -> usize {
    match target() {
        Ok(Target::Here) => GLOBAL.spied_blocks(),
        Ok(Target::Remote(api)) => (api.spied_blocks)() as usize,
        Err(_) => 0,
    }
}

/// Calls a C API query that fills a `T`.
fn query<T: Default>(f: impl FnOnce(&'static ffi::Api) -> unsafe extern "C" fn(*mut T) -> i32) -> Result<T, SpyError> {
    let api: &'static ffi::Api = match target()? {
        Target::Here => &global::LOCAL_API,
        Target::Remote(api) => api,
    };
    let mut out = T::default();
    // SAFETY: `out` is a valid, initialised T for the call to write.
    SpyError::from_status(unsafe { f(api)(&mut out) })?;
    Ok(out)
}

/// The leak tracker's heap statistics: live blocks and bytes, peak, totals — the dhat-rs
/// idea of heap-usage testing (take two readings around the code under test).
///
/// # Errors
/// [`SpyError::NotRegistered`] when no leak tracker runs (`spy=leaks`, the preloaded shim's
/// default, or [`start_leak_tracking`]); [`SpyError::NotInterposed`].
pub fn heap_stats() -> Result<HeapStats, SpyError> {
    query(|api| api.heap_stats)
}

/// Runs a leak check now (as LeakSanitizer's `__lsan_do_recoverable_leak_check`): the report
/// goes to the log, the summary is returned, the program goes on.
///
/// # Errors
/// As [`heap_stats`].
pub fn leak_check() -> Result<Summary, SpyError> {
    query(|api| api.leak_check)
}

/// The leak tracker's own memory (all from mallocspy's pool, none from the watched heap).
///
/// # Errors
/// As [`heap_stats`].
pub fn tracker_memory() -> Result<TrackerMemory, SpyError> {
    query(|api| api.tracker_memory)
}

/// Starts leak tracking in a program that is its own interposer (the `interpose` feature):
/// registers a new tracker as the process's spy, capturing `stack_depth` frames per block.
///
/// A tracker started again after a revoke is a new one: what the tracker before it recorded
/// it knows nothing of (that one did not see the frees made while it was revoked), and the
/// memory of the one before is not given back.
///
/// # Errors
/// [`SpyError::NotInterposed`] when this module is not the interposer (a preloaded shim
/// tracks by itself); [`SpyError::AlreadyRegistered`] when a spy is registered (or its revoke
/// is pending): nothing is started then.
pub fn start_leak_tracking(stack_depth: usize) -> Result<(), SpyError> {
    if !global::is_active_here() {
        return Err(SpyError::NotInterposed);
    }
    let _one_at_a_time = STARTING.lock().unwrap_or_else(|e| e.into_inner());
    if !GLOBAL.registry.is_empty() {
        return Err(SpyError::AlreadyRegistered);
    }
    let tracker = crate::spies::leaks::LeakTracker::new(stack_depth).ok_or(SpyError::InvalidArgument)?;
    let tracker: &'static crate::spies::leaks::LeakTracker = Box::leak(Box::new(tracker));
    crate::spies::leaks::set_tracker(tracker);
    if let Some(live) = crate::early::stop() {
        tracker.adopt(&live);
    }
    // A spy another thread registered since (with `register_malloc_spy`) makes this fail:
    // the queries then still say no tracker runs.
    global::register_static_here(tracker)?;
    global::built_ins_registered(true, false);
    Ok(())
}

/// Held while a built-in spy is started: two starts at once both found no spy registered, and
/// the one whose registration then failed had installed its spy and taken the early blocks.
static STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn api_table() -> Result<&'static ffi::Api, SpyError> {
    Ok(match target()? {
        Target::Here => &global::LOCAL_API,
        Target::Remote(api) => api,
    })
}

/// Calls `callback` for every allocation tick of the ticks spy (`spy=ticks`, or
/// [`start_allocation_ticks`]); `None` stops the calls.
///
/// The callback runs **inside the allocator**, on the allocating thread, right after the
/// sampled allocation: its own allocations go straight to the real allocator (neither sampled
/// nor counted in the totals, no recursion), and a sampled block it frees or reallocates ends
/// its sample as any free does. It must not block, and it must be quick (it runs once per
/// ~interval bytes allocated). It must not panic either: a panic cannot leave an `extern "C"`
/// function, and aborts the process. Nor may it leave by a jump (`longjmp` from C): the hook
/// it runs in, abandoned half done, may hold mallocspy's state, so its thread's calls go
/// unspied from then on, and the process exits without its reports. The frames it is shown are valid only during the call.
/// The library holding it stays loaded until the process ends: another thread may be calling
/// it at any time.
///
/// # Errors
/// [`SpyError::NotRegistered`] when no ticks spy runs; [`SpyError::NotInterposed`].
pub fn on_allocation_tick(callback: Option<TickCallback>) -> Result<(), SpyError> {
    SpyError::from_status((api_table()?.on_allocation_tick)(callback))
}

/// Calls `callback` with every heap statistics event: at the first sampled allocation once
/// `stats_interval_ms` has passed since the last event, and at exit (after the `atexit`
/// handlers registered after the spy started). Like the tick callback
/// it runs **inside the allocator**, on the allocating thread (its own allocations go
/// straight to the real allocator, unsampled); it must not block, nor panic (a panic aborts
/// the process, as the tick callback's does). `None` stops the calls.
///
/// # Errors
/// As [`on_allocation_tick`].
pub fn on_heap_stats(callback: Option<StatsCallback>) -> Result<(), SpyError> {
    SpyError::from_status((api_table()?.on_heap_stats)(callback))
}

/// Starts allocation ticks in a program that is its own interposer (the `interpose`
/// feature): registers a new ticks spy, sampling as `sampling` says every `interval` bytes on
/// average, with heap statistics every `stats_interval_ms` (no trace file). Started again
/// after a revoke, it is a new spy, with these arguments (the callbacks are to be set again).
///
/// # Errors
/// [`SpyError::NotInterposed`] when this module is not the interposer (a preloaded shim
/// takes `spy=ticks`); [`SpyError::AlreadyRegistered`] when a spy is registered (or its
/// revoke is pending): nothing is started then; [`SpyError::InvalidArgument`] for a zero
/// `interval` or `stats_interval_ms`, or an `interval` above 2^62 bytes (as the
/// `sample_interval` option).
pub fn start_allocation_ticks(sampling: Sampling, interval: u64, stats_interval_ms: u64) -> Result<(), SpyError> {
    use crate::spies::ticks::{self, TickSpy};
    if !global::is_active_here() {
        return Err(SpyError::NotInterposed);
    }
    if interval == 0 || interval > crate::options::MAX_SAMPLE_INTERVAL as u64 || stats_interval_ms == 0 {
        return Err(SpyError::InvalidArgument);
    }
    let _one_at_a_time = STARTING.lock().unwrap_or_else(|e| e.into_inner());
    if !GLOBAL.registry.is_empty() {
        return Err(SpyError::AlreadyRegistered);
    }
    let config = ticks::Config {
        sampling,
        interval,
        depth: crate::spies::leaks::DEFAULT_DEPTH,
        seed: crate::os::monotonic_ns() | 1,
        stats_interval_ns: stats_interval_ms.saturating_mul(1_000_000),
    };
    let spy: &'static TickSpy = Box::leak(Box::new(TickSpy::new(config).ok_or(SpyError::InvalidArgument)?));
    ticks::set_spy(spy);
    global::register_static_here(spy)?;
    global::built_ins_registered(false, true);
    spy.open_gate(&GLOBAL.gate);
    stats_at_exit();
    Ok(())
}

/// Has the running ticks spy's heap statistics taken at exit, for its callback (a preloaded
/// shim's exit reports do so for the spy of `spy=ticks`). Registered once, at the first start.
fn stats_at_exit() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    extern "C" fn at_exit() {
        if let Some(spy) = global::running_ticks() {
            spy.stats_to_callback();
        }
    }
    // SAFETY: registers an `extern "C"` function that never unwinds; a refusal (no memory)
    // only costs the exit's event.
    REGISTERED.call_once(|| unsafe {
        libc::atexit(at_exit);
    });
}
