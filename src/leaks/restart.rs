//! Restarting the waits a stop cut short, so that a leak check leaves a program's `sleep`,
//! `pause`, `poll` or `epoll_wait` as it found them.
//!
//! A thread waiting in such a call is woken by the stop: by the signal's handler, which ends
//! `pause`, `sleep`, `poll`, `select`, `epoll_wait`, `sigsuspend` and timed futex waits with
//! EINTR whatever `SA_RESTART` says, and by a tracer's interrupt, which so ends `epoll_wait`
//! and `io_uring_enter`. A `main` woken so while another thread's `exit` wrote the report
//! returned 0 and ended the process: its status and its report were lost, every run.
//!
//! The kernel restarts a call that a stop cut short by pointing the thread back at its
//! `syscall` instruction with the call's number in `rax`: the arguments are still in their
//! registers. The tracer has the kernel do so: it sets `rax` to `-ERESTARTNOHAND`, and the
//! kernel, letting the thread go, makes the call again, or fails it with EINTR if a signal's
//! handler is to run, as it decides for its own stops. The signal's handler points the
//! context it returns to back at the call itself. It has no `orig_rax`: the call's number is
//! read from `/proc` before the signal is sent, and used only if the thread is still in that
//! call, and no signal of the program's with a handler is pending as the thread is let go.
//!
//! How much is made again depends on the check:
//! - At the end of the process (the exit report), every call that waits and has done nothing
//!   when it fails with EINTR (not `close`, whose descriptor is gone by then). A call with a
//!   relative timeout then waits it whole again, but the process is ending.
//! - In a check of a process that goes on (`leak_check`), with ptrace only, and only calls
//!   without a relative timeout, or whose timeout counts down in place (`select`, glibc's
//!   `sleep`): made again, a timed wait would end late, and under checks more frequent than
//!   its timeout never. The signal's handler makes nothing again there: a signal of the
//!   program's that came between its look at what was pending and its return would run its
//!   handler and then find the wait made again, for ever.
//!
//! Never a call made by `int 0x80` (another table of numbers), nor, with the signal, a timed
//! wait the kernel was making again with `restart_syscall` (after a job-control or ptrace
//! stop): the call's own number is gone, and `sigreturn` ends what `restart_syscall` would
//! go on with.
//!
//! The handler makes no system call of its own for this: under a seccomp filter that traps
//! a call (Chromium's), the trap's `SIGSYS`, blocked in the handler, would kill the process.

use core::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::stop::MAX_PARKED;
use crate::os;

/// A call's `rax` when it failed with EINTR.
pub(super) const EINTR: i64 = -(libc::EINTR as i64);

/// x86-64's `io_pgetevents`, which the libc crate does not name.
const SYS_IO_PGETEVENTS: libc::c_long = 333;

/// The calls restarted: those that wait, end with EINTR (or restart) when a stop interrupts
/// them, and have done nothing when they so end.
const RESTARTED: [libc::c_long; 36] = [
    libc::SYS_pause,
    libc::SYS_rt_sigsuspend,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_select,
    libc::SYS_pselect6,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_futex,
    libc::SYS_futex_waitv,
    libc::SYS_semop,
    libc::SYS_semtimedop,
    libc::SYS_msgrcv,
    libc::SYS_msgsnd,
    libc::SYS_io_getevents,
    SYS_IO_PGETEVENTS,
    libc::SYS_io_uring_enter,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_recvmmsg,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_sendmmsg,
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_write,
    libc::SYS_writev,
];

/// Whether call `nr` with arguments `args`, failed with EINTR after a stop, is made again, at
/// the process's end (`ending`) or in a check it goes on from (see the module's docs).
pub(super) fn to_restart(nr: i64, args: [u64; 6], ending: bool) -> bool {
    RESTARTED.contains(&nr) && (ending || !waits_again(nr, args))
}

/// Whether call `nr` with arguments `args` has a relative timeout that it would wait whole
/// again if made again. EINTR from a socket call or a `read` means one: the socket's
/// `SO_RCVTIMEO` or `SO_SNDTIMEO` (without one, the kernel makes such a call again itself).
fn waits_again(nr: i64, [a0, a1, a2, a3, a4, _]: [u64; 6]) -> bool {
    const FUTEX_WAIT: u64 = 0;
    const IORING_ENTER_EXT_ARG: u64 = 8;
    match nr {
        // glibc's `sleep` gives the same `timespec` for the time left, which counts down.
        libc::SYS_nanosleep => a0 != a1,
        libc::SYS_clock_nanosleep => a1 & libc::TIMER_ABSTIME as u64 == 0 && a2 != a3,
        libc::SYS_poll => (a2 as i32) > 0,
        libc::SYS_epoll_wait | libc::SYS_epoll_pwait => (a3 as i32) > 0,
        libc::SYS_epoll_pwait2 => a3 != 0,
        // FUTEX_WAIT's timeout is relative; the other waits' are absolute.
        libc::SYS_futex => a3 != 0 && a1 & 0x7f == FUTEX_WAIT,
        libc::SYS_rt_sigtimedwait => a2 != 0,
        libc::SYS_semtimedop => a3 != 0,
        libc::SYS_io_getevents | SYS_IO_PGETEVENTS => a4 != 0,
        // The extended argument may hold a timeout (not read: it is the program's memory).
        libc::SYS_io_uring_enter => a3 & IORING_ENTER_EXT_ARG != 0,
        libc::SYS_accept
        | libc::SYS_accept4
        | libc::SYS_connect
        | libc::SYS_recvfrom
        | libc::SYS_recvmsg
        | libc::SYS_recvmmsg
        | libc::SYS_sendto
        | libc::SYS_sendmsg
        | libc::SYS_sendmmsg
        | libc::SYS_read
        | libc::SYS_readv
        | libc::SYS_write
        | libc::SYS_writev => true,
        // `select`'s and `pselect6`'s and `ppoll`'s timeouts count down in place; `pause`,
        // `sigsuspend`, the IPC calls and the waits for children have none.
        _ => false,
    }
}

/// Whether `insn` are the bytes of `syscall` (not `int 0x80`, two bytes as well).
pub(super) fn is_syscall(insn: [u8; 2]) -> bool {
    insn == [0x0f, 0x05]
}

/// The signals pending for thread `tid` of process `pid` (its own and the process's), and
/// those the process has handlers for, from its `status`; `None` if that cannot be read.
fn signals_of(pid: u32, tid: u32) -> Option<(u64, u64)> {
    let mut path = [0u8; 64];
    let path = os::task_path(&mut path, pid, tid, b"status")?;
    let mut text = [0u8; 8192];
    let text = os::read_file(path, &mut text)?;
    let field = |name: &[u8]| {
        let line = text.split(|&c| c == b'\n').find_map(|line| line.strip_prefix(name))?;
        super::roots::parse_hex(line.trim_ascii())
    };
    Some((field(b"SigPnd:")? | field(b"ShdPnd:")?, field(b"SigCgt:")?))
}

/// A thread blocked in a call when the signal was sent, as `/proc/<tid>/syscall` showed it,
/// and the signals pending for it when it was let go. Atomics: a handler that answers late
/// (after the stop gave up on it) may read its entry while the next stop writes the table.
struct Waiting {
    tid: AtomicU32,
    nr: AtomicI64,
    args: [AtomicU64; 6],
    sp: AtomicU64,
    pc: AtomicU64,
    pending: AtomicU64,
}

impl Waiting {
    const fn new() -> Self {
        Waiting {
            tid: AtomicU32::new(0),
            nr: AtomicI64::new(-1),
            args: [const { AtomicU64::new(0) }; 6],
            sp: AtomicU64::new(0),
            pc: AtomicU64::new(0),
            pending: AtomicU64::new(u64::MAX),
        }
    }
}

static TABLE: [Waiting; MAX_PARKED] = [const { Waiting::new() }; MAX_PARKED];
/// Entries of this stop; written by the stopping thread (the holder of the stop's turn).
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// Forgets the threads noted for the last stop.
pub(super) fn clear() {
    WAITING.store(0, Ordering::Release);
}

/// Notes the call thread `tid` is blocked in, if it is one to restart at the process's end,
/// just before it is sent the signal. Allocates nothing: threads signalled before may hold
/// the allocator's lock.
pub(super) fn note_waiting(tid: u32) {
    let pid = os::getpid();
    let mut path = [0u8; 64];
    let mut text = [0u8; 256];
    let Some(call) = os::task_path(&mut path, pid, tid, b"syscall").and_then(|p| os::read_file(p, &mut text)) else {
        return;
    };
    let Some((nr, args, sp, pc)) = parse(call) else { return };
    if !to_restart(nr, args, true) || !syscall_before(pc) {
        return;
    }
    let n = WAITING.load(Ordering::Relaxed);
    let Some(entry) = TABLE.get(n) else { return };
    entry.tid.store(tid, Ordering::Relaxed);
    entry.nr.store(nr, Ordering::Relaxed);
    for (to, from) in entry.args.iter().zip(args) {
        to.store(from, Ordering::Relaxed);
    }
    entry.sp.store(sp, Ordering::Relaxed);
    entry.pc.store(pc, Ordering::Relaxed);
    entry.pending.store(u64::MAX, Ordering::Relaxed);
    WAITING.store(n + 1, Ordering::Release);
}

/// Whether the two bytes before `pc` are a `syscall` instruction. Read with
/// `process_vm_readv`, which fails (EFAULT) where nothing is mapped, in the stopping thread,
/// where a seccomp filter's `SIGSYS` reaches the program's handler.
fn syscall_before(pc: u64) -> bool {
    syscall_at(pc.wrapping_sub(2))
}

/// Whether a thread stopped at `pc` was stopped in a system call: the kernel lets it go on
/// after its `syscall` instruction, or, to make the call again, at it. Read as
/// [`syscall_before`] reads.
pub(super) fn stopped_in_a_call(pc: u64) -> bool {
    syscall_before(pc) || syscall_at(pc)
}

/// Whether the two bytes at `at` are a `syscall` instruction.
fn syscall_at(at: u64) -> bool {
    let mut insn = [0u8; 2];
    let local = libc::iovec { iov_base: insn.as_mut_ptr().cast(), iov_len: 2 };
    let remote = libc::iovec { iov_base: at as *mut _, iov_len: 2 };
    let pid = os::getpid() as usize;
    // SAFETY: the kernel writes the two bytes of `insn` and reads this process's memory.
    let read = unsafe {
        os::raw_syscall(
            libc::SYS_process_vm_readv,
            [pid, &raw const local as usize, 1, &raw const remote as usize, 1, 0],
        )
    };
    read == 2 && is_syscall(insn)
}

/// Notes, just before the threads are let go, the signals pending for each thread noted
/// waiting that have a handler: a call with one of them to run is not restarted (one without
/// is thrown away, as a `SIGCHLD` nobody catches).
pub(super) fn note_pending() {
    let pid = os::getpid();
    let n = WAITING.load(Ordering::Acquire).min(MAX_PARKED);
    for entry in &TABLE[..n] {
        let signals = signals_of(pid, entry.tid.load(Ordering::Relaxed));
        let pending = signals.map_or(u64::MAX, |(pending, caught)| pending & caught);
        entry.pending.store(pending, Ordering::Release);
    }
}

/// A `/proc/<tid>/syscall` text: the call's number, its six arguments, the stack pointer and
/// the address after the call (not `running`, nor `-1` and two addresses: blocked outside a
/// call).
fn parse(text: &[u8]) -> Option<(i64, [u64; 6], u64, u64)> {
    let mut fields = text.trim_ascii().split(|&c| c == b' ');
    let nr = core::str::from_utf8(fields.next()?).ok()?.parse::<i64>().ok().filter(|&nr| nr >= 0)?;
    let mut words = [0u64; 8];
    for word in &mut words {
        *word = super::roots::parse_hex(fields.next()?.strip_prefix(b"0x")?)?;
    }
    let [a0, a1, a2, a3, a4, a5, sp, pc] = words;
    fields.next().is_none().then_some((nr, [a0, a1, a2, a3, a4, a5], sp, pc))
}

/// In the signal's handler, as it lets the thread go: points the interrupted context back
/// into the call the signal cut short, if this thread was noted waiting in it, the context
/// is that call's end, and no signal of the program's would run its handler on return (the
/// ones `mask`, the context's, lets through; `own` is the stop's).
pub(super) fn restart_in_context(gregs: &mut [libc::greg_t; 23], mask: u64, tid: u32, own: u64) {
    let n = WAITING.load(Ordering::Acquire).min(MAX_PARKED);
    let Some(entry) = TABLE[..n].iter().find(|w| w.tid.load(Ordering::Relaxed) == tid) else { return };
    let reg = |r: core::ffi::c_int| gregs[r as usize] as u64;
    let args = [libc::REG_RDI, libc::REG_RSI, libc::REG_RDX, libc::REG_R10, libc::REG_R8, libc::REG_R9].map(reg);
    let pc = entry.pc.load(Ordering::Relaxed);
    let same_call = reg(libc::REG_RIP) == pc
        && reg(libc::REG_RSP) == entry.sp.load(Ordering::Relaxed)
        && args.iter().zip(&entry.args).all(|(a, b)| *a == b.load(Ordering::Relaxed));
    let signalled = entry.pending.load(Ordering::Acquire) & !mask & !own != 0;
    if same_call && gregs[libc::REG_RAX as usize] == EINTR && !signalled {
        gregs[libc::REG_RAX as usize] = entry.nr.load(Ordering::Relaxed);
        gregs[libc::REG_RIP as usize] = pc.wrapping_sub(2) as libc::greg_t;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocked_call_is_read_with_its_arguments_stack_and_address() {
        let text = b"232 0x4 0x7ffc1 0x1 0xffffffffffffffff 0x0 0x8 0x7ffd663f86c8 0x7f279495e2ad\n";
        let (nr, args, sp, pc) = parse(text).unwrap();
        assert_eq!(nr, 232);
        assert_eq!(args, [4, 0x7ffc1, 1, u64::MAX, 0, 8]);
        assert_eq!((sp, pc), (0x7ffd663f86c8, 0x7f279495e2ad));
    }

    #[test]
    fn a_running_thread_or_one_blocked_outside_a_call_has_none() {
        assert!(parse(b"running\n").is_none());
        assert!(parse(b"-1 0x7ffd663f86c8 0x7f279495e2ad\n").is_none());
        assert!(parse(b"232 0x4 0x7ffc1\n").is_none());
        assert!(parse(b"").is_none());
    }

    #[test]
    fn waits_restart_at_the_end_and_those_without_a_timeout_to_run_again_in_any_check() {
        let forever = (-1i32) as u32 as u64;
        for (ending, restarted) in [(true, true), (false, false)] {
            assert!(to_restart(libc::SYS_epoll_wait, [3, 0x1000, 1, 1000, 0, 0], ending) == restarted);
            assert!(to_restart(libc::SYS_poll, [0x1000, 1, 1000, 0, 0, 0], ending) == restarted);
            assert!(to_restart(libc::SYS_nanosleep, [0x1000, 0, 0, 0, 0, 0], ending) == restarted);
            assert!(to_restart(libc::SYS_recvfrom, [3, 0x1000, 16, 0, 0, 0], ending) == restarted);
            assert!(to_restart(libc::SYS_pause, [0; 6], ending));
            assert!(to_restart(libc::SYS_epoll_wait, [3, 0x1000, 1, forever, 0, 0], ending));
            assert!(to_restart(libc::SYS_poll, [0x1000, 1, forever, 0, 0, 0], ending));
            // glibc's `sleep`: the time left counts down in the one `timespec`.
            assert!(to_restart(libc::SYS_clock_nanosleep, [0, 0, 0x1000, 0x1000, 0, 0], ending));
            assert!(to_restart(libc::SYS_clock_nanosleep, [0, 1, 0x1000, 0, 0, 0], ending), "absolute");
            assert!(to_restart(libc::SYS_select, [0, 0, 0, 0, 0x1000, 0], ending));
            assert!(to_restart(libc::SYS_futex, [0x1000, 9, 0, 0x2000, 0, 0], ending), "WAIT_BITSET, absolute");
            assert!(to_restart(libc::SYS_futex, [0x1000, 128, 0, 0, 0, 0], ending), "WAIT, no timeout");
            assert!(!to_restart(libc::SYS_close, [3, 0, 0, 0, 0, 0], ending), "close's descriptor is gone");
        }
    }

    #[test]
    fn only_waits_after_a_syscall_instruction_restart() {
        // A `syscall` instruction of this test's own code, and the address after it.
        let code: &[u8] = &[0x90, 0x0f, 0x05, 0x90];
        let pc = code.as_ptr() as u64 + 3;
        assert!(syscall_before(pc));
        assert!(!syscall_before(pc + 1), "not after a syscall instruction");
        assert!(!syscall_before(2), "nothing mapped there");
        assert!(!is_syscall([0xcd, 0x80]), "int 0x80");
    }

    #[test]
    fn a_threads_pending_and_caught_signals_are_read_from_its_status() {
        let (pid, tid) = (os::getpid(), os::gettid());
        let mut path = [0u8; 64];
        let expected = format!("/proc/{pid}/task/{tid}/status");
        assert_eq!(os::task_path(&mut path, pid, tid, b"status").unwrap().to_str().unwrap(), expected);
        let (pending, caught) = signals_of(pid, tid).unwrap();
        assert_eq!(pending, 0);
        // Rust's runtime catches SIGSEGV, to tell a stack overflow.
        assert_ne!(caught & (1u64 << (libc::SIGSEGV - 1)), 0);
        os::with_signals_blocked(|| {
            // SAFETY: raising a blocked signal leaves it pending, and it is taken back below.
            unsafe { libc::raise(libc::SIGUSR2) };
            let (pending, _) = signals_of(pid, tid).unwrap();
            let usr2 = 1u64 << (libc::SIGUSR2 - 1);
            assert_eq!(pending & usr2, usr2);
            // SAFETY: sigset_t is plain data, valid when zeroed.
            let mut set: libc::sigset_t = unsafe { core::mem::zeroed() };
            // SAFETY: the set is initialised by sigemptyset; sigwait takes the pending signal.
            unsafe {
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGUSR2);
                let mut sig = 0;
                libc::sigwait(&set, &mut sig);
            }
        });
    }
}
