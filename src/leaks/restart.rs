//! Restarting the waits a stop cut short, so that a leak check leaves a program's `sleep`,
//! `pause`, `poll` or `epoll_wait` as it found them.
//!
//! A thread waiting in such a call is woken by the stop: by the signal's handler, which ends
//! `pause`, `sleep`, `poll`, `select`, `epoll_wait`, `sigsuspend` and timed futex waits with
//! EINTR whatever `SA_RESTART` says, and by a tracer's interrupt, which so ends
//! `epoll_wait`. A `main` woken so while another thread's `exit` wrote the report returned
//! 0 and ended the process: its status and its report were lost, every run.
//!
//! The kernel restarts a call that a stop cut short by pointing the thread back at its
//! `syscall` instruction with the call's number in `rax`: the arguments are still in their
//! registers. mallocspy does the same for the calls that ended with EINTR because of it: the
//! tracer in the registers it sets, the signal's handler in the context it returns to. The
//! handler has no `orig_rax`, so the call's number is read from `/proc` before the signal
//! is sent, and used only where the thread is still in that call.
//!
//! Only calls that wait and have done nothing when they fail with EINTR are restarted (not
//! `close`, whose descriptor is gone by then). A restarted call with a relative timeout waits
//! its whole timeout again, where the kernel's own restart waits out what was left.

use core::cell::UnsafeCell;
use core::sync::atomic::{AtomicUsize, Ordering};

use super::stop::MAX_PARKED;
use crate::os;

/// The calls restarted: those that wait, end with EINTR (or restart) when a stop interrupts
/// them, and have done nothing when they so end.
const RESTARTED: [libc::c_long; 34] = [
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
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_write,
    libc::SYS_writev,
];

/// x86-64's `io_pgetevents`, which the libc crate does not name.
const SYS_IO_PGETEVENTS: libc::c_long = 333;

/// The two bytes of `syscall`.
const SYSCALL: [u8; 2] = [0x0f, 0x05];

/// Whether a thread whose `rax` is `ret` just after its call `nr` ended at `pc` was cut
/// short by a stop and should make the call again. Reads the instruction before `pc` with
/// `process_vm_readv` (no fault if it is gone), and makes raw system calls only: the tracer
/// calls this on the caller's thread pointer.
pub(super) fn cut_short(nr: i64, ret: i64, pc: u64) -> bool {
    if ret != -(libc::EINTR as i64) || !RESTARTED.contains(&nr) {
        return false;
    }
    // A call made by `int 0x80` (two bytes as well) has another table of numbers.
    let mut insn = [0u8; 2];
    let local = libc::iovec { iov_base: insn.as_mut_ptr().cast(), iov_len: 2 };
    let remote = libc::iovec { iov_base: pc.wrapping_sub(2) as *mut _, iov_len: 2 };
    // SAFETY: getpid has no preconditions (the tracer's own id names the same memory); the
    // kernel writes the two bytes of `insn` and reads the process's memory, failing (EFAULT)
    // where nothing is mapped.
    let read = unsafe {
        let pid = os::raw_syscall(libc::SYS_getpid, [0; 6]) as usize;
        os::raw_syscall(
            libc::SYS_process_vm_readv,
            [pid, &raw const local as usize, 1, &raw const remote as usize, 1, 0],
        )
    };
    read == 2 && insn == SYSCALL
}

/// A thread blocked in a call when the signal was sent, as `/proc/<tid>/syscall` showed it.
#[derive(Clone, Copy)]
struct Waiting {
    tid: u32,
    nr: i64,
    args: [u64; 6],
    sp: u64,
    pc: u64,
}

struct Table(UnsafeCell<[Waiting; MAX_PARKED]>);

// SAFETY: entries below WAITING are written by the stopping thread before it publishes them
// (Release) and signals their thread; handlers read them after an Acquire load.
unsafe impl Sync for Table {}

static TABLE: Table = Table(UnsafeCell::new([Waiting { tid: 0, nr: -1, args: [0; 6], sp: 0, pc: 0 }; MAX_PARKED]));
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// Forgets the threads noted for the last stop.
pub(super) fn clear() {
    WAITING.store(0, Ordering::Release);
}

/// Notes the call thread `tid` is blocked in, if any, just before it is sent the signal.
/// Allocates nothing: threads signalled before may hold the allocator's lock.
pub(super) fn note_waiting(tid: u32) {
    let Some(waiting) = blocked_call(tid) else { return };
    let n = WAITING.load(Ordering::Relaxed);
    if n >= MAX_PARKED {
        return;
    }
    // SAFETY: entry n is above every published one, so no handler reads it; only the
    // stopping thread (holder of the stop's turn) writes the table.
    unsafe { (*TABLE.0.get())[n] = waiting };
    WAITING.store(n + 1, Ordering::Release);
}

/// The call thread `tid` of this process is blocked in, from `/proc/self/task/<tid>/syscall`.
fn blocked_call(tid: u32) -> Option<Waiting> {
    let mut path = [0u8; 48];
    let mut len = 0;
    let mut push = |bytes: &[u8]| {
        path[len..len + bytes.len()].copy_from_slice(bytes);
        len += bytes.len();
    };
    push(b"/proc/self/task/");
    let mut digits = [0u8; 10];
    let mut i = digits.len();
    let mut t = tid;
    loop {
        i -= 1;
        digits[i] = b'0' + (t % 10) as u8;
        t /= 10;
        if t == 0 {
            break;
        }
    }
    push(&digits[i..]);
    push(b"/syscall\0");
    let path = core::ffi::CStr::from_bytes_with_nul(&path[..len]).ok()?;
    let fd = os::open(path, libc::O_RDONLY | libc::O_CLOEXEC);
    if fd < 0 {
        return None;
    }
    let mut text = [0u8; 256];
    let n = os::read(fd, &mut text);
    os::close(fd);
    parse(tid, text.get(..usize::try_from(n).ok()?)?)
}

/// A `/proc/<tid>/syscall` text: the call's number, its six arguments, the stack pointer
/// and the address after the call, or `running`, or `-1` and two addresses (blocked outside a
/// call).
fn parse(tid: u32, text: &[u8]) -> Option<Waiting> {
    let mut fields = text.trim_ascii().split(|&c| c == b' ');
    let nr = core::str::from_utf8(fields.next()?).ok()?.parse::<i64>().ok().filter(|&nr| nr >= 0)?;
    let mut words = [0u64; 8];
    for word in &mut words {
        *word = super::roots::parse_hex(fields.next()?.strip_prefix(b"0x")?)?;
    }
    let [a0, a1, a2, a3, a4, a5, sp, pc] = words;
    fields.next().is_none().then_some(Waiting { tid, nr, args: [a0, a1, a2, a3, a4, a5], sp, pc })
}

/// In the signal's handler: makes the interrupted context go back into the call the signal cut
/// short, if this thread was noted blocked in it and the context is that call's end.
pub(super) fn restart_in_context(gregs: &mut [libc::greg_t; 23], tid: u32) {
    let n = WAITING.load(Ordering::Acquire).min(MAX_PARKED);
    // SAFETY: entries below n were written before their Release store and are not written
    // again during this stop.
    let table = unsafe { &(&*TABLE.0.get())[..n] };
    let Some(waiting) = table.iter().find(|w| w.tid == tid) else { return };
    let reg = |r: core::ffi::c_int| gregs[r as usize] as u64;
    let args = [libc::REG_RDI, libc::REG_RSI, libc::REG_RDX, libc::REG_R10, libc::REG_R8, libc::REG_R9].map(reg);
    let same_call = reg(libc::REG_RIP) == waiting.pc && reg(libc::REG_RSP) == waiting.sp && args == waiting.args;
    if same_call && cut_short(waiting.nr, gregs[libc::REG_RAX as usize], waiting.pc) {
        gregs[libc::REG_RAX as usize] = waiting.nr;
        gregs[libc::REG_RIP as usize] = (waiting.pc - 2) as libc::greg_t;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocked_call_is_read_with_its_arguments_stack_and_address() {
        let text = b"232 0x4 0x7ffc1 0x1 0xffffffffffffffff 0x0 0x8 0x7ffd663f86c8 0x7f279495e2ad\n";
        let w = parse(7, text).unwrap();
        assert_eq!((w.tid, w.nr), (7, 232));
        assert_eq!(w.args, [4, 0x7ffc1, 1, u64::MAX, 0, 8]);
        assert_eq!((w.sp, w.pc), (0x7ffd663f86c8, 0x7f279495e2ad));
    }

    #[test]
    fn a_running_thread_or_one_blocked_outside_a_call_has_none() {
        assert!(parse(7, b"running\n").is_none());
        assert!(parse(7, b"-1 0x7ffd663f86c8 0x7f279495e2ad\n").is_none());
        assert!(parse(7, b"232 0x4 0x7ffc1\n").is_none());
        assert!(parse(7, b"").is_none());
    }

    #[test]
    fn only_waits_cut_short_by_eintr_after_a_syscall_instruction_restart() {
        // A `syscall` instruction of this test's own code, and the address after it.
        let code: &[u8] = &[0x90, 0x0f, 0x05, 0x90];
        let pc = code.as_ptr() as u64 + 3;
        let eintr = -(libc::EINTR as i64);
        assert!(cut_short(libc::SYS_epoll_wait, eintr, pc));
        assert!(cut_short(libc::SYS_pause, eintr, pc));
        assert!(!cut_short(libc::SYS_close, eintr, pc), "close's descriptor is gone");
        assert!(!cut_short(libc::SYS_epoll_wait, -(libc::EAGAIN as i64), pc));
        assert!(!cut_short(libc::SYS_epoll_wait, 0, pc));
        assert!(!cut_short(libc::SYS_epoll_wait, eintr, pc + 1), "not after a syscall instruction");
        assert!(!cut_short(libc::SYS_epoll_wait, eintr, 2), "nothing mapped there");
    }
}
