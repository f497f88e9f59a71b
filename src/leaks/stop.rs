//! Stopping the world for a leak check: every other thread of the process stopped, its
//! registers, stack pointer and thread pointer noted, until the scan is over.
//!
//! With ptrace where the system allows it (`tracer.rs`): a ptrace stop leaves the thread's
//! system call as it was. Otherwise with a signal, as without ptrace it must be: each other
//! thread is sent a real-time signal nobody uses, its handler records the registers the
//! signal interrupted and waits on a futex until the scan is over (a `sleep` or `pause` it
//! interrupts fails with EINTR, but at the process's end, where it is made again:
//! `restart.rs`). Nothing may allocate between stopping and resuming (a stopped thread may
//! hold the allocator's lock), so every buffer the scan needs is reserved before.

use core::ffi::{c_int, c_void};
use core::sync::atomic::{AtomicU8, AtomicU32, AtomicUsize, Ordering};

use super::restart;
use super::roots::parse_hex;
use super::tracer::{self, Tracer};
use crate::options::StopThreads;
use crate::os;

/// What a stopped thread left: its registers, stack pointer and thread pointer.
#[derive(Clone, Copy, Default)]
pub(crate) struct Parked {
    pub regs: [u64; 23],
    pub sp: u64,
    pub bp: u64,
    /// Where the thread was stopped: the instruction it goes on with.
    pub pc: u64,
    pub tp: u64,
    pub tid: u32,
}

pub(super) const MAX_PARKED: usize = 4096;

/// The slots parked threads write their context into.
struct Slots(core::cell::UnsafeCell<[Parked; MAX_PARKED]>);

// SAFETY: each slot is written by the one thread the counter handed it to, and read only
// after that thread published it (see `park` and `Stopped::parked`).
unsafe impl Sync for Slots {}

static PARKED: Slots =
    Slots(core::cell::UnsafeCell::new([Parked { regs: [0; 23], sp: 0, bp: 0, pc: 0, tp: 0, tid: 0 }; MAX_PARKED]));
static NEXT: AtomicUsize = AtomicUsize::new(0);
static ARRIVED: AtomicUsize = AtomicUsize::new(0);
static LEFT: AtomicUsize = AtomicUsize::new(0);
/// Futex word: 0 while the world is stopped.
static RESUME: AtomicU32 = AtomicU32::new(0);

extern "C" fn park(sig: c_int, _info: *mut libc::siginfo_t, uc: *mut c_void) {
    let saved = os::errno();
    let i = NEXT.fetch_add(1, Ordering::AcqRel);
    if i < MAX_PARKED {
        // SAFETY: the kernel passes the interrupted context; slot i is this thread's alone
        // (handed out by the counter) until ARRIVED publishes it.
        unsafe {
            let gregs = (*(uc as *const libc::ucontext_t)).uc_mcontext.gregs;
            let slot = &mut (*PARKED.0.get())[i];
            slot.regs = gregs.map(|r| r as u64);
            slot.sp = gregs[libc::REG_RSP as usize] as u64;
            slot.bp = gregs[libc::REG_RBP as usize] as u64;
            slot.pc = gregs[libc::REG_RIP as usize] as u64;
            slot.tp = os::thread_pointer();
            slot.tid = os::gettid();
        }
    }
    ARRIVED.fetch_add(1, Ordering::Release);
    while RESUME.load(Ordering::Acquire) == 0 {
        // SAFETY: futex wait on a static word; spurious wake-ups loop.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                RESUME.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                0,
                core::ptr::null::<libc::timespec>(),
            )
        };
    }
    // SAFETY: the kernel passes the interrupted context, which this thread alone returns to;
    // the first word of its signal mask is the kernel's 64 signals.
    unsafe {
        let uc = &mut *(uc as *mut libc::ucontext_t);
        let mask = *(&raw const uc.uc_sigmask).cast::<u64>();
        restart::restart_in_context(&mut uc.uc_mcontext.gregs, mask, os::gettid(), 1 << (sig - 1));
    }
    LEFT.fetch_add(1, Ordering::Release);
    os::set_errno(saved);
}

/// Other threads, stopped until this is dropped.
pub(crate) struct Stopped {
    how: How,
    /// Threads that were sent the signal, or seized, and did not stop in time (stuck in the
    /// kernel), and threads past the slots.
    missing: usize,
    /// Threads not sent the signal because it could not reach them: blocked, or stopped by
    /// a job-control signal or a tracer.
    unreachable: usize,
    /// Whether the main thread is alive, not the caller, and so should be stopped.
    main_alive: bool,
    /// The threads stopped: freed once they are let go, as freeing takes mallocspy's heap,
    /// whose lock a stopped thread may hold (another thread's check was allocating: the two
    /// checks hung, one on the heap and the other stopped inside it).
    _threads: Vec<u32>,
    /// Dropped last, once the threads are let go.
    _turn: Turn,
}

/// The one stop of the world at a time: two checks at once (the exit report and a
/// `leak_check` of another thread's) would share the slots and the tracer's state, and each
/// stop the other's tracer's caller.
struct Turn;

/// The thread whose stop it is, or 0.
static TURN: AtomicU32 = AtomicU32::new(0);

/// Threads between the prepare handler of a `fork` and its parent handler: they hold locks
/// of mallocspy's (its own heap's among them), which a check stopping them would then wait
/// for forever (every run of helper 23's program forking on four threads while the main one
/// checked). A stop waits until none is, and no `fork` enters that window during a stop.
static FORKING: AtomicU32 = AtomicU32::new(0);

/// Whether thread `tid` of process `pid` (this one) is alive.
fn alive(pid: u32, tid: u32) -> bool {
    // SAFETY: signal 0 to a thread of this process only checks that it exists.
    let r = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, 0) };
    r == 0 || os::errno() != libc::ESRCH
}

/// `fork`'s prepare handler, before any lock is taken: waits out another thread's stop.
pub(crate) fn fork_prepare() {
    let (me, pid) = (os::gettid(), os::getpid());
    loop {
        FORKING.fetch_add(1, Ordering::SeqCst);
        let holder = TURN.load(Ordering::SeqCst);
        if holder == 0 || holder == me || !alive(pid, holder) {
            return;
        }
        FORKING.fetch_sub(1, Ordering::SeqCst);
        while TURN.load(Ordering::SeqCst) == holder && alive(pid, holder) {
            os::yield_now();
        }
    }
}

/// Whether a thread is between the prepare and parent handlers of a `fork`.
pub(crate) fn forking() -> bool {
    FORKING.load(Ordering::Relaxed) != 0
}

/// `fork`'s parent handler, once every lock is released.
pub(crate) fn fork_parent() {
    FORKING.fetch_sub(1, Ordering::SeqCst);
}

/// `fork`'s child handler: the child's one thread is the forking one, done forking.
pub(crate) fn fork_child() {
    FORKING.store(0, Ordering::SeqCst);
}

impl Turn {
    /// Waits for the turn; `None` for a check run by a signal handler that interrupted this
    /// thread's own (the world is stopped already). A turn held by a thread this process does
    /// not have is taken over: the child of a `fork` made during another thread's check
    /// inherits that thread's turn, and its exit report waited for it forever.
    fn take() -> Option<Turn> {
        let (me, pid) = (os::gettid(), os::getpid());
        let mut holder = 0;
        loop {
            match TURN.compare_exchange(holder, me, Ordering::SeqCst, Ordering::Relaxed) {
                Ok(_) if FORKING.load(Ordering::SeqCst) == 0 => return Some(Turn),
                Ok(_) => {
                    // A fork is in its window: let it end first.
                    TURN.store(0, Ordering::SeqCst);
                    while FORKING.load(Ordering::SeqCst) != 0 {
                        os::yield_now();
                    }
                    holder = 0;
                }
                Err(h) if h == me => return None,
                Err(h) => {
                    let gone = !alive(pid, h);
                    holder = if gone { h } else { 0 };
                    if !gone {
                        os::yield_now();
                    }
                }
            }
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        TURN.store(0, Ordering::Release);
    }
}

enum How {
    /// By a tracer (ptrace).
    Traced(Tracer),
    /// By `signal`, whose disposition was `old`: the threads are parked in its handler.
    Signalled { signal: c_int, old: libc::sigaction },
}

/// What `/proc` says of a thread about to be stopped.
#[derive(Debug, PartialEq)]
enum Reach {
    /// Will run the handler.
    Signal,
    /// Blocks the signal, or is stopped (`T`, `t`): waiting for it would be waiting for
    /// nothing. Its stack is scanned whole, its registers are not read.
    Unreachable,
    /// Has exited (a zombie: the main thread after `pthread_exit`, a thread not yet
    /// joined): nothing of it is live.
    Gone,
}

/// How `signal` would reach a thread, from its `status` text.
fn reach(status: &[u8], signal: c_int) -> Reach {
    let field = |name: &[u8]| status_field(status, name);
    match field(b"State:").and_then(|v| v.first()) {
        Some(b'Z' | b'X') => return Reach::Gone,
        Some(b'T' | b't') => return Reach::Unreachable,
        _ => {}
    }
    let blocked = field(b"SigBlk:").and_then(parse_hex).unwrap_or(0);
    if blocked & (1u64 << (signal - 1)) != 0 { Reach::Unreachable } else { Reach::Signal }
}

/// The value of the field `name` (with its colon) of a `/proc` status text.
fn status_field<'a>(status: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    status.split(|&c| c == b'\n').find_map(|line| line.strip_prefix(name)).map(|v| v.trim_ascii())
}

/// Whether the tracer's `clone` may kill the process: under a seccomp filter that the program
/// (or its launcher) installed unprivileged, with `no_new_privs` set, as Chromium's and
/// Firefox's sandboxes do, and systemd's `SystemCallFilter=` for a service with a `User=`.
/// Such a filter's action for a `clone` that makes no thread is often to kill, and no trial
/// call can tell without dying of it. The filters a container runtime installs (Docker's,
/// Podman's profiles) refuse with an errno, which the tracer survives, and are installed
/// without `no_new_privs`. A status that cannot be read counts as such a filter.
fn tracer_may_be_killed() -> bool {
    // The tracer inherits the calling thread's filters.
    let status = std::fs::read("/proc/thread-self/status").or_else(|_| std::fs::read("/proc/self/status"));
    let Ok(status) = status else { return true };
    let set = |name: &[u8]| status_field(&status, name).is_none_or(|value| value != b"0");
    set(b"Seccomp:") && set(b"NoNewPrivs:")
}

/// How checks stop the other threads (`stop_threads`), as [`StopThreads`] numbers it.
static STOP_THREADS: AtomicU8 = AtomicU8::new(StopThreads::Auto as u8);

/// Sets how checks stop the other threads from now on.
pub(crate) fn set_stop_threads(how: StopThreads) {
    STOP_THREADS.store(how as u8, Ordering::Relaxed);
}

/// Whether to stop the other threads with a tracer.
fn use_tracer() -> bool {
    const SIGNAL: u8 = StopThreads::Signal as u8;
    const PTRACE: u8 = StopThreads::Ptrace as u8;
    match STOP_THREADS.load(Ordering::Relaxed) {
        SIGNAL => false,
        PTRACE => true,
        _ => !tracer_may_be_killed(),
    }
}

/// Whether checks will stop the other threads with a tracer once a seccomp filter is in force,
/// installed with `no_new_privs` or not (see [`tracer_may_be_killed`]).
pub(crate) fn tracer_under_filter(no_new_privs: bool) -> bool {
    const SIGNAL: u8 = StopThreads::Signal as u8;
    const PTRACE: u8 = StopThreads::Ptrace as u8;
    match STOP_THREADS.load(Ordering::Relaxed) {
        SIGNAL => false,
        PTRACE => true,
        _ => !no_new_privs,
    }
}

/// How `signal` would reach thread `tid` of this process (a thread that has gone from
/// `/proc` meanwhile is `Gone`).
fn reach_thread(tid: u32, signal: c_int) -> Reach {
    match std::fs::read(format!("/proc/self/task/{tid}/status")) {
        Ok(status) => reach(&status, signal),
        Err(_) => Reach::Gone,
    }
}

/// A real-time signal with the default disposition (nobody uses it), if any.
fn free_signal() -> Option<c_int> {
    (libc::SIGRTMIN() + 4..=libc::SIGRTMAX() - 1).rev().find(|&sig| {
        // SAFETY: sigaction is plain data.
        let mut old: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: querying a disposition writes only `old`.
        unsafe { libc::sigaction(sig, core::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_DFL }
    })
}

/// Stops every other thread of the process: with ptrace, else with a signal. Allocates
/// (thread list) before stopping anyone.
pub(crate) fn stop_the_world() -> Option<Stopped> {
    stop_the_world_by(use_tracer(), crate::preload::writing_reports())
}

/// [`stop_the_world`], trying ptrace first only if `tracer`; `ending`: whether the check is
/// the process's last, after which the waits it cuts short are all made again (`restart.rs`).
fn stop_the_world_by(tracer: bool, ending: bool) -> Option<Stopped> {
    let turn = Turn::take()?;
    let me = os::gettid();
    let tids: Vec<u32> = std::fs::read_dir("/proc/self/task")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&t| t != me)
        .collect();
    let signal = free_signal()?;
    let pid = os::getpid();
    // Reached by the signal first, then unreachable: allocated before anyone is stopped.
    let mut threads = Vec::with_capacity(tids.len());
    let (mut unreached, mut main_alive) = (Vec::new(), false);
    for tid in tids {
        let reach = reach_thread(tid, signal);
        main_alive |= tid == pid && reach != Reach::Gone;
        match reach {
            Reach::Signal => threads.push(tid),
            Reach::Unreachable => unreached.push(tid),
            Reach::Gone => {}
        }
    }
    let (targets, unreachable) = (threads.len(), unreached.len());
    threads.append(&mut unreached);
    drop(unreached);
    // A tracer stops a thread whatever signals it blocks (one stopped by a job-control signal
    // or traced already makes it give up). None is made for a process of one thread, nor under
    // a sandbox's seccomp filter: one that kills on `clone` killed programs at exit.
    let traced = if threads.is_empty() || !tracer {
        None
    } else {
        // SAFETY: the slots are read only through `Stopped::parked` until the tracer is
        // dropped, and no signal parks a thread meanwhile.
        unsafe { tracer::stop(&threads, PARKED.0.get().cast(), ending) }
    };
    if let Some(tracer) = traced {
        let missing = tracer.missing() + threads.len().saturating_sub(MAX_PARKED);
        let how = How::Traced(tracer);
        return Some(Stopped { how, missing, unreachable: 0, main_alive, _threads: threads, _turn: turn });
    }
    NEXT.store(0, Ordering::Relaxed);
    ARRIVED.store(0, Ordering::Relaxed);
    LEFT.store(0, Ordering::Relaxed);
    RESUME.store(0, Ordering::Release);
    // SAFETY: sigaction structs are plain data; the handler is an async-signal-safe
    // `extern "C"` fn with the SA_SIGINFO signature.
    let old = unsafe {
        let mut act: libc::sigaction = core::mem::zeroed();
        act.sa_sigaction = park as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        libc::sigfillset(&mut act.sa_mask);
        let mut old: libc::sigaction = core::mem::zeroed();
        if libc::sigaction(signal, &act, &mut old) != 0 {
            return None;
        }
        old
    };
    restart::clear();
    let mut sent = 0;
    for &tid in &threads[..targets] {
        if ending {
            restart::note_waiting(tid);
        }
        // SAFETY: tgkill to a thread of this process; a thread that exited meanwhile is ESRCH.
        if unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, signal) } == 0 {
            sent += 1;
        }
    }
    let deadline = os::monotonic_ns() + 500_000_000;
    while ARRIVED.load(Ordering::Acquire) < sent && os::monotonic_ns() < deadline {
        os::yield_now();
    }
    let arrived = ARRIVED.load(Ordering::Acquire);
    Some(Stopped {
        how: How::Signalled { signal, old },
        missing: sent - arrived.min(sent),
        unreachable,
        main_alive,
        _threads: threads,
        _turn: turn,
    })
}

impl Stopped {
    /// The registers, stack and thread pointers of the stopped threads.
    pub(crate) fn parked(&self) -> &[Parked] {
        let n = match &self.how {
            How::Traced(tracer) => tracer.stopped(),
            How::Signalled { .. } => ARRIVED.load(Ordering::Acquire),
        };
        // SAFETY: slots below that count were written before it was published (the tracer's
        // Release store of its phase, the handlers' Release increments of ARRIVED) and are
        // not written again until the next stop.
        unsafe { &(&*PARKED.0.get())[..n.min(MAX_PARKED)] }
    }

    /// Whether the threads were stopped with ptrace, their system calls left as they were.
    #[cfg(test)]
    pub(crate) fn traced(&self) -> bool {
        matches!(self.how, How::Traced(_))
    }

    /// Live threads whose registers were not read: their stacks are scanned whole.
    pub(crate) fn unstopped(&self) -> usize {
        self.missing + self.unreachable
    }

    /// Whether the main thread is alive but not stopped (it blocks the signal): its stack,
    /// which is no anonymous mapping, must then be added whole.
    pub(crate) fn main_unstopped(&self) -> bool {
        let pid = os::getpid();
        self.main_alive && !self.parked().iter().any(|p| p.tid == pid)
    }
}

impl Drop for Stopped {
    /// Lets the stopped threads go (the tracer's drop does, for ptrace), and restores the
    /// signal's disposition once they left the handler.
    fn drop(&mut self) {
        let How::Signalled { signal, old } = &self.how else { return };
        restart::note_pending();
        RESUME.store(1, Ordering::Release);
        // SAFETY: futex wake on a static word.
        unsafe {
            libc::syscall(libc::SYS_futex, RESUME.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, i32::MAX)
        };
        // Late arrivals also see RESUME set and leave at once.
        let deadline = os::monotonic_ns() + 500_000_000;
        while LEFT.load(Ordering::Acquire) < ARRIVED.load(Ordering::Acquire) && os::monotonic_ns() < deadline {
            os::yield_now();
        }
        // A thread that has not answered may still get the signal later: under the default
        // disposition that would kill the process, so the handler then stays (it returns at
        // once now that RESUME is set).
        if self.missing == 0 {
            // SAFETY: restores the disposition saved in stop_the_world.
            unsafe { libc::sigaction(*signal, old, core::ptr::null_mut()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn status(state: &str, blocked: &str) -> Vec<u8> {
        format!("Name:\tworker\nUmask:\t0022\nState:\t{state}\nTgid:\t7\nSigQ:\t0/127\nSigPnd:\t0000000000000000\nSigBlk:\t{blocked}\nSigIgn:\t0000000000001000\n").into_bytes()
    }

    /// Stops the world once (with ptrace first if `tracer`) while another thread sleeps 300 ms
    /// in `nanosleep`: whether the threads were traced, and what the sleep returned and how
    /// long it took.
    fn stop_a_sleeper(tracer: bool, ending: bool) -> (bool, libc::c_int, Duration) {
        // One at a time: each test's stop stops the other's sleeper too, and a ptrace stop
        // leaves a sleep in `restart_syscall`, which the signal's handler cannot make again.
        static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let (tx, rx) = std::sync::mpsc::channel();
        let sleeper = std::thread::spawn(move || {
            tx.send(os::gettid()).unwrap();
            let nap = libc::timespec { tv_sec: 0, tv_nsec: 300_000_000 };
            let start = Instant::now();
            // SAFETY: a valid timespec; no remainder asked for.
            let r = unsafe { libc::nanosleep(&nap, core::ptr::null_mut()) };
            (r, start.elapsed())
        });
        let tid = rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let stopped = stop_the_world_by(tracer, ending).expect("the world stopped");
        let traced = stopped.traced();
        let parked = stopped.parked().iter().find(|p| p.tid == tid).copied();
        drop(stopped);
        let parked = parked.expect("the sleeper stopped");
        assert!(parked.sp != 0 && parked.tp != 0);
        let (r, slept) = sleeper.join().unwrap();
        (traced, r, slept)
    }

    /// Stopped with ptrace, a thread's `nanosleep` goes on as if nothing happened.
    #[test]
    fn a_thread_stopped_with_ptrace_sleeps_on_as_if_never_stopped() {
        if std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").is_ok_and(|s| s.trim() == "3") {
            eprintln!("skipped: ptrace is disabled here (Yama ptrace_scope 3)");
            return;
        }
        let (traced, r, slept) = stop_a_sleeper(true, false);
        assert!(traced);
        assert_eq!(r, 0, "nanosleep interrupted");
        assert!(slept >= Duration::from_millis(300), "{slept:?}");
    }

    /// Stopped with the signal at the process's end, a thread's `nanosleep` is made again:
    /// it returned early with EINTR. In a check the process goes on from, it still does.
    #[test]
    fn a_thread_stopped_with_the_signal_at_the_end_sleeps_on() {
        let (traced, r, slept) = stop_a_sleeper(false, true);
        assert!(!traced);
        assert_eq!(r, 0, "nanosleep interrupted");
        assert!(slept >= Duration::from_millis(300), "{slept:?}");
        let (_, r, slept) = stop_a_sleeper(false, false);
        assert_eq!(r, -1, "nanosleep made again with its whole timeout");
        assert!(slept < Duration::from_millis(300), "{slept:?}");
    }

    #[test]
    fn a_signal_reaches_a_thread_that_runs_or_sleeps_with_it_unblocked() {
        assert_eq!(reach(&status("S (sleeping)", "0000000000000000"), 60), Reach::Signal);
        assert_eq!(reach(&status("R (running)", "0000000000014000"), 60), Reach::Signal);
    }

    #[test]
    fn a_blocked_signal_or_a_stopped_thread_is_unreachable_and_a_zombie_is_gone() {
        // sigfillset as glibc's pthread_sigmask leaves it: all but the two it reserves.
        assert_eq!(reach(&status("S (sleeping)", "fffffffe7ffbfeff"), 61), Reach::Unreachable);
        assert_eq!(reach(&status("S (sleeping)", "1000000000000000"), 61), Reach::Unreachable);
        assert_eq!(reach(&status("t (tracing stop)", "0"), 61), Reach::Unreachable);
        assert_eq!(reach(&status("T (stopped)", "0"), 61), Reach::Unreachable);
        assert_eq!(reach(&status("Z (zombie)", "fffffffe7ffbfeff"), 61), Reach::Gone);
    }
}
