//! Stopping the other threads with ptrace, as LeakSanitizer's `StopTheWorld` does: a tracer
//! task that shares the process's memory, but is a process of its own (no thread may trace
//! its own process's threads), seizes and interrupts each thread, reads its registers, and
//! lets them all go when the check says so.
//!
//! Why not the signal of `stop.rs` alone: running a handler ends the system call it
//! interrupts, and `sleep`, `pause`, `nanosleep`, `poll` or `epoll_wait` then fail with EINTR
//! whatever `SA_RESTART` says. The handler makes such a call again (`restart.rs`) only at
//! the process's end, and a thread that blocks the signal is not stopped at all. A ptrace
//! stop runs no handler and stops every thread, and the kernel restarts the call where it
//! was, with what was left of its timeout. Only `epoll_wait`, `io_uring_enter` and a few
//! other calls fail with EINTR after such a stop: the tracer has the kernel make them again.
//!
//! The tracer is a raw `clone` without `CLONE_THREAD` or a thread pointer of its own, and
//! with exit signal 0, so that the program's `wait` never sees it. It runs on the caller's
//! thread pointer while the caller waits, so it makes raw system calls (no `errno`),
//! allocates nothing and takes no lock: the threads it stops may hold any. Its stack is
//! mallocspy's own memory, which the scan leaves out, and the registers it reads go to
//! statics, not to that stack. Where ptrace is refused (a debugger already traces the
//! process, a seccomp filter, Yama's `ptrace_scope` 3), the caller falls back to the signal.

use core::cell::UnsafeCell;
use core::ffi::{c_int, c_void};
use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use super::restart;
use super::stop::{MAX_PARKED, Parked};
use crate::{os, pool};

/// The tracer's stack: its frames are a few hundred bytes.
const STACK: usize = 64 << 10;

/// How long the tracer waits for the threads to stop, in all.
const STOP_PATIENCE_NS: u64 = 500_000_000;

// Phases of a stop, in the futex word both sides wait on.
/// The caller is setting up (names the tracer its ptracer where Yama asks for it).
const SETTING_UP: u32 = 0;
/// The tracer may attach.
const GO: u32 = 1;
/// The threads are stopped and their slots written.
const STOPPED: u32 = 2;
/// ptrace was refused: nothing is stopped, the tracer leaves.
const REFUSED: u32 = 3;
/// The check is over: the tracer lets the threads go and leaves.
const RESUME: u32 = 4;

// What the tracer knows of each thread it was given.
const NOT_SEIZED: u32 = 0;
const SEIZED: u32 = 1;
/// Stopped; the signal it stopped for, if any, is `state - STOPPED_FOR`.
const STOPPED_FOR: u32 = 2;

struct Shared {
    phase: AtomicU32,
    /// Whether the check is the process's last (`restart.rs`).
    ending: AtomicBool,
    pid: AtomicU32,
    /// Threads given in `tids`.
    given: AtomicUsize,
    /// Slots written.
    stopped: AtomicUsize,
    /// Threads seized that did not stop in time.
    missing: AtomicUsize,
    /// Written by the caller before the tracer starts.
    tids: UnsafeCell<[u32; MAX_PARKED]>,
    /// The tracer's alone.
    state: UnsafeCell<[u32; MAX_PARKED]>,
    /// `PTRACE_GETREGS`'s buffer: not on the tracer's stack, where a pointer read from a
    /// thread's registers would be left for the scan to find.
    regs: UnsafeCell<libc::user_regs_struct>,
    /// The tracer's alone: whether the stop cut each thread's call short (`restart.rs`).
    cut: UnsafeCell<[bool; MAX_PARKED]>,
}

// SAFETY: `tids` is written by the caller before `clone` and only read after; `state`,
// `regs` and `cut` are the tracer's alone; the slots it writes are read after the Release
// store of STOPPED (see `trace`).
unsafe impl Sync for Shared {}

static SHARED: Shared = Shared {
    phase: AtomicU32::new(SETTING_UP),
    ending: AtomicBool::new(false),
    pid: AtomicU32::new(0),
    given: AtomicUsize::new(0),
    stopped: AtomicUsize::new(0),
    missing: AtomicUsize::new(0),
    tids: UnsafeCell::new([0; MAX_PARKED]),
    state: UnsafeCell::new([NOT_SEIZED; MAX_PARKED]),
    // SAFETY: user_regs_struct is plain integers, for which zero is valid.
    regs: UnsafeCell::new(unsafe { core::mem::zeroed() }),
    cut: UnsafeCell::new([false; MAX_PARKED]),
};

/// A system call of the tracer's: raw, `-errno` on failure.
fn sys(nr: libc::c_long, args: [usize; 6]) -> isize {
    // SAFETY: each caller passes a call and arguments valid for the tracer (see its uses).
    unsafe { os::raw_syscall(nr, args) }
}

fn ptrace(request: libc::c_uint, tid: u32, data: usize) -> isize {
    sys(libc::SYS_ptrace, [request as usize, tid as usize, 0, data, 0, 0])
}

/// Waits while the phase is `phase`, at most `timeout_ns` (0: without end).
fn wait_while(phase: u32, timeout_ns: u64) {
    let start = os::monotonic_ns();
    while SHARED.phase.load(Ordering::Acquire) == phase {
        let waited = os::monotonic_ns() - start;
        if timeout_ns != 0 && waited >= timeout_ns {
            return;
        }
        // Woken by the other side; a bounded wait also notices a parent gone (see `trace`).
        let left = if timeout_ns == 0 { 100_000_000 } else { (timeout_ns - waited).min(100_000_000) };
        let ts = libc::timespec { tv_sec: 0, tv_nsec: left as _ };
        sys(
            libc::SYS_futex,
            [
                SHARED.phase.as_ptr() as usize,
                (libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG) as usize,
                phase as usize,
                &ts as *const _ as usize,
                0,
                0,
            ],
        );
        if timeout_ns == 0 && sys(libc::SYS_getppid, [0; 6]) != SHARED.pid.load(Ordering::Relaxed) as isize {
            return;
        }
    }
}

fn publish(phase: u32) {
    SHARED.phase.store(phase, Ordering::Release);
    sys(
        libc::SYS_futex,
        [SHARED.phase.as_ptr() as usize, (libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG) as usize, 1, 0, 0, 0],
    );
}

/// The tracer (glibc's `clone` makes the `exit` system call with what it returns; the kernel
/// then lets go of any thread still seized). `slots` is where the registers go.
extern "C" fn trace(slots: *mut c_void) -> c_int {
    let slots = slots.cast::<Parked>();
    let pid = SHARED.pid.load(Ordering::Relaxed);
    // Killed with the thread that made it, never left tracing for a check that is gone.
    sys(libc::SYS_prctl, [libc::PR_SET_PDEATHSIG as usize, libc::SIGKILL as usize, 0, 0, 0, 0]);
    if sys(libc::SYS_getppid, [0; 6]) != pid as isize {
        return 0;
    }
    wait_while(SETTING_UP, 0);
    let given = SHARED.given.load(Ordering::Relaxed).min(MAX_PARKED);
    // SAFETY: `tids` was written before this task started; `state` and `cut` are the
    // tracer's alone.
    let (tids, state, cut) = unsafe { (&*SHARED.tids.get(), &mut *SHARED.state.get(), &mut *SHARED.cut.get()) };
    let mut seized = 0;
    for ((tid, state), cut) in tids.iter().zip(state.iter_mut()).zip(cut.iter_mut()).take(given) {
        *state = NOT_SEIZED;
        *cut = false;
        match ptrace(libc::PTRACE_SEIZE, *tid, 0) {
            0 => {
                ptrace(libc::PTRACE_INTERRUPT, *tid, 0);
                *state = SEIZED;
                seized += 1;
            }
            // Gone since it was listed.
            r if r == -(libc::ESRCH as isize) => {}
            _ => {
                publish(REFUSED);
                return 0;
            }
        }
    }
    let deadline = os::monotonic_ns() + STOP_PATIENCE_NS;
    let mut stopped = 0;
    while seized > 0 {
        let mut status: c_int = 0;
        let flags = (libc::__WALL | libc::WNOHANG) as usize;
        // Any of the seized threads: one system call per stop, not one per thread and pass.
        let r = sys(libc::SYS_wait4, [-1isize as usize, &raw mut status as usize, flags, 0, 0, 0]);
        if r < 0 {
            break;
        }
        if r == 0 {
            if os::monotonic_ns() >= deadline {
                break;
            }
            let pause = libc::timespec { tv_sec: 0, tv_nsec: 50_000 };
            sys(libc::SYS_nanosleep, [&pause as *const _ as usize, 0, 0, 0, 0, 0]);
            continue;
        }
        let Some(at) = tids.iter().take(given).position(|&tid| tid as isize == r) else { continue };
        let (Some(&tid), Some(seen)) = (tids.get(at), state.get_mut(at)) else { continue };
        if *seen != SEIZED {
            continue;
        }
        seized -= 1;
        if !libc::WIFSTOPPED(status) {
            // Exited meanwhile.
            *seen = NOT_SEIZED;
            continue;
        }
        // A signal-delivery stop (no event in the high bits) holds back the signal: it is
        // passed on when the thread is let go.
        let signal = if status >> 16 == 0 { libc::WSTOPSIG(status) as u32 } else { 0 };
        *seen = STOPPED_FOR + signal;
        let regs = SHARED.regs.get();
        if stopped < MAX_PARKED && ptrace(libc::PTRACE_GETREGS, tid, regs as usize) == 0 {
            // SAFETY: `regs` was just written by the kernel and is the tracer's alone; slot
            // `stopped` is below MAX_PARKED and not read before STOPPED.
            unsafe {
                let r = &*regs;
                let slot = &mut *slots.add(stopped);
                slot.regs = [0; 23];
                let words = [
                    r.r15, r.r14, r.r13, r.r12, r.rbp, r.rbx, r.r11, r.r10, r.r9, r.r8, r.rax, r.rcx, r.rdx, r.rsi,
                    r.rdi, r.rip, r.rsp,
                ];
                slot.regs[..words.len()].copy_from_slice(&words);
                slot.sp = r.rsp;
                slot.bp = r.rbp;
                slot.pc = r.rip;
                slot.tp = r.fs_base;
                slot.tid = tid;
            }
            if let Some(cut) = cut.get_mut(at) {
                // Not at a signal-delivery stop: the program's signal is what ends its call.
                *cut = signal == 0 && cut_short(tid);
            }
            stopped += 1;
        }
    }
    SHARED.stopped.store(stopped, Ordering::Relaxed);
    SHARED.missing.store(seized, Ordering::Relaxed);
    publish(STOPPED);
    wait_while(STOPPED, 0);
    for ((tid, state), cut) in tids.iter().zip(state.iter()).zip(cut.iter()).take(given) {
        if *state >= STOPPED_FOR {
            if *cut {
                restart(*tid);
            }
            ptrace(libc::PTRACE_DETACH, *tid, (*state - STOPPED_FOR) as usize);
        }
    }
    0
}

/// Whether the interrupt cut short the call of stopped thread `tid`, whose registers are in
/// `SHARED.regs`: one to make again (`restart.rs`) failed with EINTR by a `syscall`.
fn cut_short(tid: u32) -> bool {
    // SAFETY: `regs` is the tracer's alone and holds the thread's registers.
    let r = unsafe { &*SHARED.regs.get() };
    let args = [r.rdi, r.rsi, r.rdx, r.r10, r.r8, r.r9];
    r.rax as i64 == restart::EINTR
        && restart::to_restart(r.orig_rax as i64, args, SHARED.ending.load(Ordering::Relaxed))
        && instruction_before(tid, r.rip).is_some_and(restart::is_syscall)
}

/// The two bytes before `pc` in stopped thread `tid`'s memory, read with `PTRACE_PEEKTEXT`
/// a whole aligned word at a time (no word read crosses into a page of its own).
fn instruction_before(tid: u32, pc: u64) -> Option<[u8; 2]> {
    let peek = |addr: u64| {
        let mut word: u64 = 0;
        // The system call (unlike glibc's wrapper) stores the word at `data`.
        let r = sys(
            libc::SYS_ptrace,
            [libc::PTRACE_PEEKTEXT as usize, tid as usize, addr as usize, &raw mut word as usize, 0, 0],
        );
        (r == 0).then_some(word.to_le_bytes())
    };
    let at = pc.checked_sub(2)?;
    let (word, offset) = (at & !7, (at & 7) as usize);
    let bytes = peek(word)?;
    if offset < 7 { Some([bytes[offset], bytes[offset + 1]]) } else { Some([bytes[7], peek(word + 8)?[0]]) }
}

/// Has the kernel make the call the interrupt cut short again as it lets thread `tid` go,
/// unless a signal's handler is to run then, which the call then fails with EINTR for: the
/// kernel's choice for a call that a stop of its own interrupted (`-ERESTARTNOHAND`).
fn restart(tid: u32) {
    const ERESTARTNOHAND: i64 = 514;
    let regs = SHARED.regs.get();
    if ptrace(libc::PTRACE_GETREGS, tid, regs as usize) != 0 {
        return;
    }
    // SAFETY: `regs` is the tracer's alone and was just written by the kernel.
    let r = unsafe { &mut *regs };
    r.rax = (-ERESTARTNOHAND) as u64;
    ptrace(libc::PTRACE_SETREGS, tid, regs as usize);
}

/// The other threads, stopped by a tracer until this is dropped.
pub(super) struct Tracer {
    pid: c_int,
    stack: NonNull<u8>,
    stack_size: usize,
}

/// Whether Yama lets a process trace only its descendants unless it names its tracer.
fn yama_asks_for_a_ptracer() -> bool {
    std::fs::read("/proc/sys/kernel/yama/ptrace_scope").is_ok_and(|t| t.trim_ascii() == b"1")
}

/// Stops the threads `tids` (not the caller's) with a tracer, their registers written to
/// `slots`; `None` when ptrace or the tracer is refused, and nothing is stopped. `ending`:
/// whether the check is the process's last.
///
/// # Safety
/// `slots` points to [`MAX_PARKED`] slots that nothing else writes or reads until the
/// result is dropped (and that are read only through [`Tracer::stopped`] meanwhile).
pub(super) unsafe fn stop(tids: &[u32], slots: *mut Parked, ending: bool) -> Option<Tracer> {
    let named = yama_asks_for_a_ptracer();
    SHARED.ending.store(ending, Ordering::Relaxed);
    let (stack, stack_size) = pool::lease_unbounded(STACK)?;
    SHARED.phase.store(SETTING_UP, Ordering::Relaxed);
    SHARED.pid.store(os::getpid(), Ordering::Relaxed);
    SHARED.given.store(tids.len().min(MAX_PARKED), Ordering::Relaxed);
    SHARED.stopped.store(0, Ordering::Relaxed);
    SHARED.missing.store(0, Ordering::Relaxed);
    // SAFETY: no tracer runs (the last one was reaped before its stop was dropped).
    let list = unsafe { &mut *SHARED.tids.get() };
    for (slot, tid) in list.iter_mut().zip(tids) {
        *slot = *tid;
    }
    // No CLONE_THREAD: a process of its own, which may trace this one's threads. Exit signal
    // 0: no SIGCHLD, and invisible to the program's `wait` (only `__WALL` sees it).
    let flags = libc::CLONE_VM | libc::CLONE_FS | libc::CLONE_FILES | libc::CLONE_UNTRACED;
    // Every signal blocked in the tracer, which inherits the mask: a handler of the program's
    // run there would run on the caller's thread pointer.
    let pid = os::with_signals_blocked(|| {
        // SAFETY: `trace` runs on the top of the leased stack, which outlives it (given back
        // only once the tracer is reaped), with `slots` valid as the caller promised.
        unsafe { libc::clone(trace, stack.as_ptr().add(stack_size).cast(), flags, slots.cast()) }
    });
    let tracer = Tracer { pid, stack, stack_size };
    if pid <= 0 {
        // SAFETY: no task uses the stack.
        unsafe { pool::give_back(stack, stack_size) };
        core::mem::forget(tracer);
        return None;
    }
    if named {
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_PTRACER, pid as libc::c_ulong, 0, 0, 0) };
    }
    publish(GO);
    wait_while(GO, 2 * STOP_PATIENCE_NS);
    // Dropped, a tracer that refused or did not answer is reaped (killed if need be).
    (SHARED.phase.load(Ordering::Acquire) == STOPPED).then_some(tracer)
}

impl Tracer {
    /// How many threads are stopped (the first slots).
    pub(super) fn stopped(&self) -> usize {
        SHARED.stopped.load(Ordering::Relaxed)
    }

    /// Threads seized that did not stop in time (stuck in the kernel): they run on.
    pub(super) fn missing(&self) -> usize {
        SHARED.missing.load(Ordering::Relaxed)
    }
}

impl Drop for Tracer {
    /// Lets the threads go and reaps the tracer.
    ///
    /// The tracer leaves once it has detached every thread (one that has not answered is
    /// killed: the kernel lets its threads go when it dies). A program thread that waits for
    /// any child with `__WALL` (exit signal 0 hides the tracer from a plain `wait`) may reap
    /// it first: a limit (README).
    fn drop(&mut self) {
        let phase = SHARED.phase.load(Ordering::Acquire);
        let answered = phase == STOPPED || phase == REFUSED;
        if !answered {
            // Attaching still (it did not answer in time): it would never see RESUME.
            // SAFETY: kill of our own child.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
        publish(RESUME);
        let mut status: c_int = 0;
        // SAFETY: waits for our own clone child; `status` is a valid out-pointer. ECHILD if
        // the program reaped it.
        unsafe { libc::waitpid(self.pid, &mut status, libc::__WALL) };
        // SAFETY: the tracer is gone: nothing runs on its stack.
        unsafe { pool::give_back(self.stack, self.stack_size) };
    }
}
