//! Reports for a process that a signal ends: `HUP`, `INT`, `PIPE`, `QUIT` and `TERM`, whose
//! default action ends the process without `exit`, so that no exit report would be written. A
//! server stopped by its supervisor, a program stopped with `^C`, the writer of a pipeline
//! whose reader left (`prog | head`): memcheck reports then too (LeakSanitizer does not).
//!
//! At start, each of these signals whose action is the default gets a handler of mallocspy's,
//! which writes the reports and then ends the process by the same signal, as it would have
//! ended (the exit status, the core dump of `QUIT`). The program does not see it: `sigaction`
//! and the `signal` family (`bsd_signal`, `ssignal`, `sysv_signal`, `sigset`) say the action
//! is the default while ours is in place; a handler the program sets, or `SIG_IGN`, replaces
//! ours; setting the default puts ours back. A signal ignored at start (a background job's
//! `INT`) stays ignored. A second signal while the report is written ends the process at
//! once, as the first would have natively, should the report be stuck on a lock the
//! interrupted code holds; but not one within [`DUPLICATE_NS`] of the first: that is the same
//! signal come twice (sent to the process and to its group, as `timeout` and `kill -- -PGID`
//! do, when `mallocspy run` also passes it on), which killed the report half-written. The
//! first signal during the reports of a process that is leaving by `exit` or `_exit` is let
//! go: the process leaves as it was leaving. A signal that comes inside a hook waits for the
//! hook's end, [`HOOK_PATIENCE_S`] at most, then comes again as a second request.
//! Python, which installs its own `INT` handler when it finds the default, still raises
//! `KeyboardInterrupt`.
//!
//! A handler the program sets with `SA_RESETHAND` (node's for `INT` and `TERM`, every one
//! `sysv_signal` sets) goes back to the default when it runs, by the kernel, behind
//! `sigaction`'s back: the program's handler then raises the signal again to die by it, and
//! died without the report. Such a handler is installed behind a trampoline of mallocspy's
//! ([`on_oneshot`]), which puts mallocspy's handler back, as the kernel would the default,
//! and calls the program's.

use core::ffi::{c_int, c_void};
use core::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use crate::os;

/// The signals handled.
const SIGNALS: [c_int; 5] = [libc::SIGHUP, libc::SIGINT, libc::SIGPIPE, libc::SIGQUIT, libc::SIGTERM];

/// Whether this process reports when one of [`SIGNALS`] ends it (set once, at start).
static ENABLED: AtomicBool = AtomicBool::new(false);

static NEXT_SIGACTION: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());
static NEXT_SIGNAL: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());
static NEXT_SYSV_SIGNAL: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());
static NEXT_SIGSET: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

/// Looks up libc's functions at start, not at the program's first call, which would clear
/// its `dlerror` state (see [`crate::program_mappings::warm_up`]).
pub(crate) fn warm_up() {
    let functions = [
        (&NEXT_SIGACTION, c"sigaction"),
        (&NEXT_SIGNAL, c"signal"),
        (&NEXT_SYSV_SIGNAL, c"sysv_signal"),
        (&NEXT_SIGSET, c"sigset"),
    ];
    for (next, name) in functions {
        os::next_symbol_cached(next, name);
    }
}

type Sigaction = unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int;
type Signal = unsafe extern "C" fn(c_int, libc::sighandler_t) -> libc::sighandler_t;

fn handled(signal: c_int) -> bool {
    SIGNALS.contains(&signal) && ENABLED.load(Ordering::Relaxed)
}

/// libc's `sigaction`.
///
/// # Safety
/// As `sigaction`.
unsafe fn next_sigaction(signal: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int {
    let f = os::next_symbol_cached(&NEXT_SIGACTION, c"sigaction");
    if f.is_null() {
        os::set_errno(libc::ENOSYS);
        return -1;
    }
    // SAFETY: libc's sigaction has this signature; the caller's guarantee covers the arguments.
    unsafe { core::mem::transmute::<*mut c_void, Sigaction>(f)(signal, act, old) }
}

/// Makes mallocspy's handler the action of `signal`.
fn arm(signal: c_int) -> bool {
    // SAFETY: zero is a valid sigaction (empty mask, no flags).
    let mut act: libc::sigaction = unsafe { core::mem::zeroed() };
    act.sa_sigaction = on_signal as *const () as usize;
    // Not SA_RESETHAND: the handler itself tells a second request from the same signal come
    // twice. SA_NODEFER: a signal during the report reaches the handler.
    act.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
    // SAFETY: a valid action whose handler has the SA_SIGINFO signature.
    unsafe { next_sigaction(signal, &act, core::ptr::null_mut()) == 0 }
}

/// Whether [`enable`] left the signals alone because the process is the init of its PID
/// namespace, for its forked children to take them.
static LEFT_TO_INIT: AtomicBool = AtomicBool::new(false);

/// At start: reports when one of [`SIGNALS`] ends the process, for each whose action is the
/// default now.
///
/// Not in the init of a PID namespace (a container's entrypoint, `unshare --pid --fork`): the
/// kernel does not deliver it a signal whose action is the default (pid_namespaces(7)), so a
/// handler of ours made `TERM` end a program that natively ignores it (`docker stop` then
/// stopped it at once instead of after its grace period). Its children take them.
pub(crate) fn enable() {
    if os::getpid() == 1 {
        LEFT_TO_INIT.store(true, Ordering::Relaxed);
        return;
    }
    ENABLED.store(true, Ordering::Relaxed);
    for signal in SIGNALS {
        // SAFETY: zero is a valid sigaction; a query changes nothing.
        let mut now: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { next_sigaction(signal, core::ptr::null(), &mut now) } == 0 && now.sa_sigaction == libc::SIG_DFL {
            arm(signal);
        }
    }
}

/// In a forked child of an init that [`enable`] left alone: the child is not an init.
pub(crate) fn after_fork_child() {
    if LEFT_TO_INIT.swap(false, Ordering::Relaxed) {
        enable();
    }
}

/// Before a seccomp filter that may kill the program (see `crate::seccomp`): the reports are
/// given up, so each signal's action goes back to what the program sees (the default, or its
/// own `SA_RESETHAND` handler), which the kernel then carries out by itself.
pub(crate) fn give_back() {
    ENABLED.store(false, Ordering::Relaxed);
    for signal in SIGNALS {
        // SAFETY: zero is a valid sigaction; a query changes nothing.
        let mut now: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { next_sigaction(signal, core::ptr::null(), &mut now) } != 0 {
            continue;
        }
        let ours = is_ours(now.sa_sigaction) || now.sa_sigaction == on_oneshot as *const () as usize;
        if ours {
            as_seen(signal, &mut now);
            // SAFETY: the action the program set (or the default), as it would be natively.
            unsafe { next_sigaction(signal, &now, core::ptr::null_mut()) };
        }
    }
}

/// A signal that came while its thread was inside a hook, for the hook's end to take.
static DEFERRED: AtomicI32 = AtomicI32::new(0);

/// When the first ending signal came (monotonic ns, at least 1), 0 before.
static FIRST_NS: AtomicU64 = AtomicU64::new(0);

/// A signal this soon after the first is the same one come twice, not a second request.
const DUPLICATE_NS: u64 = 300_000_000;

/// For each signal (by number), the program's `SA_RESETHAND` handler behind [`on_oneshot`]
/// until it runs (0: none), and its flags as the program gave them.
static ONESHOT: [AtomicUsize; 32] = [const { AtomicUsize::new(0) }; 32];
static ONESHOT_FLAGS: [AtomicI32; 32] = [const { AtomicI32::new(0) }; 32];

/// The program's `SA_RESETHAND` handler of `signal`, run once: as the kernel resets the action
/// to the default before the handler runs, this puts mallocspy's back (the default, as the
/// program sees it), then calls the program's handler. A program that then raises the signal
/// again to die by it (node) dies by mallocspy's handler, with the reports.
extern "C" fn on_oneshot(signal: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    let Some(slot) = ONESHOT.get(signal as usize) else { return };
    let handler = slot.swap(0, Ordering::AcqRel);
    if handler == 0 || !arm(signal) {
        // It ran already, on another thread (its signal came twice at once): this one finds
        // the default, as it would natively.
        return on_signal(signal, info, context);
    }
    if ONESHOT_FLAGS[signal as usize].load(Ordering::Relaxed) & libc::SA_SIGINFO != 0 {
        // SAFETY: the program gave this handler with SA_SIGINFO: its signature is this one.
        let f =
            unsafe { core::mem::transmute::<usize, extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void)>(handler) };
        f(signal, info, context);
    } else {
        // SAFETY: the program gave this handler without SA_SIGINFO: a plain handler.
        let f = unsafe { core::mem::transmute::<usize, extern "C" fn(c_int)>(handler) };
        f(signal);
    }
}

/// Puts the program's action of `signal` behind [`on_oneshot`] if it is a handler with
/// `SA_RESETHAND`, after the program set it (by `sigaction` or libc's `signal` family).
fn take_over_oneshot(signal: c_int) {
    // SAFETY: zero is a valid sigaction; a query changes nothing.
    let mut now: libc::sigaction = unsafe { core::mem::zeroed() };
    // SAFETY: a query into our buffer.
    if unsafe { next_sigaction(signal, core::ptr::null(), &mut now) } != 0
        || now.sa_flags & libc::SA_RESETHAND == 0
        || [libc::SIG_DFL, libc::SIG_IGN, libc::SIG_ERR].contains(&now.sa_sigaction)
        || is_ours(now.sa_sigaction)
        || now.sa_sigaction == on_oneshot as *const () as usize
    {
        return;
    }
    let Some(slot) = ONESHOT.get(signal as usize) else { return };
    ONESHOT_FLAGS[signal as usize].store(now.sa_flags, Ordering::Relaxed);
    slot.store(now.sa_sigaction, Ordering::Release);
    // Its mask, its other flags; the trampoline takes the three arguments.
    now.sa_sigaction = on_oneshot as *const () as usize;
    now.sa_flags = (now.sa_flags & !libc::SA_RESETHAND) | libc::SA_SIGINFO;
    // SAFETY: a valid action whose handler has the SA_SIGINFO signature.
    unsafe { next_sigaction(signal, &now, core::ptr::null_mut()) };
}

/// The handler: the reports, then the end the signal would have brought. Inside a hook of
/// this thread, which holds locks and half-made changes every report needs, that waits for
/// the hook's end ([`after_hook`]): a program stopped in a loop of allocations is mostly there.
extern "C" fn on_signal(signal: c_int, _info: *mut libc::siginfo_t, context: *mut c_void) {
    let now = os::monotonic_ns().max(1);
    if let Err(first) = FIRST_NS.compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire) {
        if now.saturating_sub(first) < DUPLICATE_NS {
            return;
        }
        // A second request: end at once, should the report wait on a lock the interrupted
        // code holds.
        die_by(signal);
    }
    if crate::preload::writing_reports() {
        // The exit reports: the program has left, and its status is its own. Natively it
        // would be gone before the signal came; here it ended the report half-written, the
        // exit's flush of stdio undone, and turned a worker's `exit(0)` into death by the
        // signal (a `multiprocessing` pool terminating workers that were leaving). A second
        // request still ends it at once. Once the reports are written, what the exit still
        // does (the flush) is the program's, and the signal ends it as it would have.
        return;
    }
    if crate::tls::state().depth.get() != 0 {
        DEFERRED.store(signal, Ordering::Relaxed);
        send_again_later(signal);
        return;
    }
    // SAFETY: an SA_SIGINFO handler's third argument is the interrupted context, a
    // `ucontext_t` the kernel wrote on this stack, valid while the handler runs.
    let interrupted = unsafe { (context as *const libc::ucontext_t).as_ref() }.map(crate::leaks::Caller::interrupted);
    end_by(signal, interrupted);
}

/// Where a hook's depth is back to 0: ends the process by the signal that came during it.
#[inline(always)]
pub(crate) fn after_hook() {
    if DEFERRED.load(Ordering::Relaxed) != 0 {
        take_deferred();
    }
}

#[cold]
#[inline(never)]
fn take_deferred() {
    match DEFERRED.swap(0, Ordering::Relaxed) {
        0 => {}
        signal => {
            // The reports may take longer than the patience: the hook ended, no need for it.
            cancel_sending_again();
            end_by(signal, None)
        }
    }
}

/// How long a signal deferred to a hook's end waits for it. A hook that never ends (the
/// program deadlocked in its allocator, by its own fault) kept a process that natively died
/// of one SIGTERM alive for good: `timeout` without `-k` waited for ever (review helper 92).
/// The signal comes again then, a second request, which ends the process without the reports.
const HOOK_PATIENCE_S: i64 = 2;

/// The kernel timer that sends the deferred signal again (-1: none).
static SEND_AGAIN: AtomicI32 = AtomicI32::new(-1);

/// Has the kernel send `signal` to this thread again in [`HOOK_PATIENCE_S`] seconds. From the
/// handler: raw system calls only.
fn send_again_later(signal: c_int) {
    // SAFETY: zero is a valid sigevent; the fields set say: this signal, to this thread.
    let mut event: libc::sigevent = unsafe { core::mem::zeroed() };
    event.sigev_signo = signal;
    event.sigev_notify = libc::SIGEV_THREAD_ID;
    event.sigev_notify_thread_id = os::gettid() as c_int;
    let mut timer: c_int = -1;
    // SAFETY: the kernel reads the event and writes the timer's id (an int) into `timer`.
    let created = unsafe {
        os::raw_syscall(
            libc::SYS_timer_create,
            [libc::CLOCK_MONOTONIC as usize, &raw const event as usize, &raw mut timer as usize, 0, 0, 0],
        )
    };
    if created != 0 || SEND_AGAIN.compare_exchange(-1, timer, Ordering::AcqRel, Ordering::Relaxed).is_err() {
        // No timer, or one already armed (the first deferred signal's).
        if created == 0 {
            delete_timer(timer);
        }
        return;
    }
    let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    let when = libc::itimerspec { it_interval: zero, it_value: libc::timespec { tv_sec: HOOK_PATIENCE_S, tv_nsec: 0 } };
    // SAFETY: the kernel reads `when`; the timer is ours.
    unsafe {
        os::raw_syscall(libc::SYS_timer_settime, [timer as usize, 0, &raw const when as usize, 0, 0, 0]);
    }
}

/// Disarms the timer of [`send_again_later`], if one is armed.
fn cancel_sending_again() {
    let timer = SEND_AGAIN.swap(-1, Ordering::AcqRel);
    if timer >= 0 {
        delete_timer(timer);
    }
}

fn delete_timer(timer: c_int) {
    // SAFETY: deleting a timer of ours; the kernel checks the id.
    unsafe { os::raw_syscall(libc::SYS_timer_delete, [timer as usize, 0, 0, 0, 0, 0]) };
}

/// The reports, then the end `signal` brings by default. `interrupted`: the program's context
/// the signal interrupted, when the handler runs there.
fn end_by(signal: c_int, interrupted: Option<crate::leaks::Caller>) -> ! {
    crate::preload::report_at_signal(signal, interrupted);
    die_by(signal)
}

/// The end `signal` brings by default.
fn die_by(signal: c_int) -> ! {
    // SAFETY: zero is a valid sigaction, here SIG_DFL with an empty mask; the set is ours.
    unsafe {
        let dfl: libc::sigaction = core::mem::zeroed();
        next_sigaction(signal, &dfl, core::ptr::null_mut());
        let mut set: libc::sigset_t = core::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, signal);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, core::ptr::null_mut());
        libc::raise(signal);
    }
    // Still here: another handler took the signal meanwhile. Leave as its default would.
    loop {
        // SAFETY: exit_group ends the process and does not return.
        unsafe { libc::syscall(libc::SYS_exit_group, 128 + signal) };
    }
}

/// Whether `handler` is mallocspy's: only then is an action shown to the program as the
/// default. (Not a flag of ours: the program may have replaced our handler by a way that is
/// not wrapped, a raw system call or glibc's own `system`, and its handler must show.)
fn is_ours(handler: libc::sighandler_t) -> bool {
    handler == on_signal as *const () as usize
}

/// What the program sees of an action of ours: the default; of `signal`'s trampoline
/// ([`on_oneshot`]), the handler and flags it gave.
fn as_seen(signal: c_int, action: &mut libc::sigaction) {
    if is_ours(action.sa_sigaction) {
        // SAFETY: zero is a valid sigaction: SIG_DFL with an empty mask.
        *action = unsafe { core::mem::zeroed() };
    } else if action.sa_sigaction == on_oneshot as *const () as usize
        && let Some(slot) = ONESHOT.get(signal as usize)
    {
        match slot.load(Ordering::Acquire) {
            // Run since: the reset, which puts ours back, the default, is about to show.
            // SAFETY: zero is a valid sigaction: SIG_DFL with an empty mask.
            0 => *action = unsafe { core::mem::zeroed() },
            handler => {
                action.sa_sigaction = handler;
                action.sa_flags = ONESHOT_FLAGS[signal as usize].load(Ordering::Relaxed);
            }
        }
    }
}

/// The name of one of the signals handled, for the report's note.
pub(crate) fn name(signal: c_int) -> &'static str {
    match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// `sigaction`, for the program: mallocspy's handler looks like the default action.
///
/// # Safety
/// As `sigaction`.
pub unsafe fn sigaction(signal: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int {
    if !handled(signal) {
        // SAFETY: the caller's guarantee.
        return unsafe { next_sigaction(signal, act, old) };
    }
    // SAFETY: a non-null `act` is the caller's valid action.
    if !act.is_null() && unsafe { (*act).sa_sigaction } == libc::SIG_DFL {
        // The default: ours (what the program sees as the default) unless it is there.
        // SAFETY: zero is a valid sigaction.
        let mut now: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: a query into our buffer.
        let status = unsafe { next_sigaction(signal, core::ptr::null(), &mut now) };
        if status != 0 || !(is_ours(now.sa_sigaction) || arm(signal)) {
            // SAFETY: the caller's guarantee.
            return unsafe { next_sigaction(signal, act, old) };
        }
        as_seen(signal, &mut now);
        if !old.is_null() {
            // SAFETY: the caller's buffer.
            unsafe { old.write(now) };
        }
        return 0;
    }
    // A query, or the program's own action, which replaces ours.
    // SAFETY: the caller's guarantee.
    let status = unsafe { next_sigaction(signal, act, old) };
    if status == 0 && !old.is_null() {
        // SAFETY: the caller's buffer, which libc has just filled.
        as_seen(signal, unsafe { &mut *old });
    }
    if status == 0 && !act.is_null() {
        take_over_oneshot(signal);
    }
    status
}

/// `signal`, for the program: as [`sigaction`].
///
/// # Safety
/// As `signal`.
pub unsafe fn signal(signal: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    if handled(signal) && handler == libc::SIG_DFL {
        // SAFETY: zero is a valid sigaction: SIG_DFL (the flags and mask of the default
        // action do not matter).
        let act: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: as above.
        let mut old: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: a valid action and buffer.
        return if unsafe { sigaction(signal, &act, &mut old) } == 0 { old.sa_sigaction } else { libc::SIG_ERR };
    }
    // The program's own action: libc's `signal` sets it (BSD's semantics, and
    // `siginterrupt`'s choices).
    // SAFETY: libc's `signal`; the caller's guarantee covers the arguments.
    unsafe { set_by_libc(&NEXT_SIGNAL, c"signal", signal, handler) }
}

/// `sysv_signal`, for the program: as [`signal`].
///
/// # Safety
/// As `sysv_signal`.
pub unsafe fn sysv_signal(signal: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: the caller's guarantee.
    unsafe { set_by_libc(&NEXT_SYSV_SIGNAL, c"sysv_signal", signal, handler) }
}

/// `sigset`, for the program: as [`signal`] (`SIG_HOLD` too is libc's business).
///
/// # Safety
/// As `sigset`.
pub unsafe fn sigset(signal: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: the caller's guarantee.
    unsafe { set_by_libc(&NEXT_SIGSET, c"sigset", signal, handler) }
}

/// Sets `handler` by libc's function `name` (of `signal`'s signature), which keeps its own
/// semantics (flags, the mask `sigset` changes); the default puts ours back right after, and
/// ours is shown as the default. Between the two a signal ends the process as it would have
/// natively, only without the report.
///
/// # Safety
/// `name` has `signal`'s signature; the arguments are valid for it.
unsafe fn set_by_libc(
    next: &AtomicPtr<c_void>,
    name: &core::ffi::CStr,
    signal: c_int,
    handler: libc::sighandler_t,
) -> libc::sighandler_t {
    let f = os::next_symbol_cached(next, name);
    if f.is_null() {
        os::set_errno(libc::ENOSYS);
        return libc::SIG_ERR;
    }
    // SAFETY: the caller's guarantee: libc's function has this signature.
    let old = unsafe { core::mem::transmute::<*mut c_void, Signal>(f)(signal, handler) };
    // What the program sees of the old action, before a new one-shot handler takes its slot
    // (`sysv_signal` returned the handler it had just set: review helper 98).
    // SAFETY: zero is a valid sigaction.
    let mut seen: libc::sigaction = unsafe { core::mem::zeroed() };
    seen.sa_sigaction = old;
    as_seen(signal, &mut seen);
    if old != libc::SIG_ERR && handled(signal) {
        if handler == libc::SIG_DFL {
            arm(signal);
        } else {
            take_over_oneshot(signal);
        }
    }
    seen.sa_sigaction
}
