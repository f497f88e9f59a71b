//! Seccomp filters the program installs on itself with `prctl(PR_SET_SECCOMP)` or the
//! `seccomp` system call made by libc's `syscall` (libseccomp's `seccomp_load`; both wrapped). A
//! filter that kills for an unexpected system call (sshd's privilege separation, a sandbox's)
//! killed the program at its exit: the leak check and the trace's end make calls its own exit
//! does not (`sigaltstack`, `openat` of `/proc`, `process_vm_readv`, a CPU clock), and the
//! process died of `SIGSYS` where natively it exited. Such a filter is seen before it is in
//! force, while every call is still allowed: mallocspy says then, in one line, that the exit
//! reports are given up, hands the ending signals back to the program, and wakes the trace
//! writer through the queue's futex alone; should the kernel refuse the filter, the reports are
//! back, and a second line says so. A filter that answers with an errno (`SECCOMP_RET_ERRNO`,
//! as container runtimes' do) changes nothing: the reports go on, and what cannot be read is
//! said; one that refuses the calls that wake the trace writer through its socket has it woken
//! through the queue's futex from then on. Not seen: filters installed by a system call
//! instruction of the program's own (Chromium's sandbox), or inherited at start. A filter
//! installed on one thread gives up the whole process's reports.

use core::ffi::{c_int, c_long, c_ulong, c_void};
use core::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use crate::{os, tls};

/// Whether a filter that may kill the process on an unexpected call was installed.
static MAY_KILL: AtomicBool = AtomicBool::new(false);

static NEXT_PRCTL: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

/// Whether the exit reports are given up (see the module's docs).
pub(crate) fn may_kill() -> bool {
    MAY_KILL.load(Ordering::Acquire)
}

/// Looks up libc's `prctl` and `syscall` at start (see [`crate::program_mappings::warm_up`]).
pub(crate) fn warm_up() {
    os::next_symbol_cached(&NEXT_PRCTL, c"prctl");
    os::next_symbol_cached(&crate::interpose::NEXT_SYSCALL, c"syscall");
}

type Prctl = unsafe extern "C" fn(c_int, c_ulong, c_ulong, c_ulong, c_ulong) -> c_int;

/// libc's `prctl`, or null.
fn next_prctl() -> Option<Prctl> {
    let f = os::next_symbol_cached(&NEXT_PRCTL, c"prctl");
    // SAFETY: libc's prctl takes its arguments as five words.
    (!f.is_null()).then(|| unsafe { core::mem::transmute::<*mut c_void, Prctl>(f) })
}

/// `prctl`: a filter that may kill is noted before libc's installs it, and the note is taken
/// back if the kernel refuses it.
///
/// # Safety
/// As `prctl` with these arguments.
pub(crate) unsafe fn prctl(option: c_int, a2: c_ulong, a3: c_ulong, a4: c_ulong, a5: c_ulong) -> c_int {
    let Some(next) = next_prctl() else {
        os::set_errno(libc::ENOSYS);
        return -1;
    };
    let mode = match (option, a2) {
        (libc::PR_SET_SECCOMP, m) if m == libc::SECCOMP_MODE_STRICT as c_ulong => Some(Mode::Strict),
        (libc::PR_SET_SECCOMP, m) if m == libc::SECCOMP_MODE_FILTER as c_ulong => {
            Some(Mode::Filter { program: a3, listener: false })
        }
        _ => None,
    };
    // SAFETY: the caller's guarantee covers the arguments.
    let call = || unsafe { next(option, a2, a3, a4, a5) };
    let r = match mode {
        Some(mode) => install(mode, || {
            let r = call();
            (r, r == 0)
        }),
        None => call(),
    };
    if r == 0 && option == libc::PR_SET_TSC && a2 == libc::PR_TSC_SIGSEGV as c_ulong {
        let errno = os::errno();
        os::clocks_without_tsc();
        os::set_errno(errno);
    }
    r
}

/// The `seccomp` system call made through libc's `syscall` (libseccomp's `seccomp_load`), as
/// [`prctl`]'s `PR_SET_SECCOMP`: `operation` 0 is strict mode, 1 a filter at `args`. `make`
/// makes the call; it succeeded if it returned 0, or a descriptor with
/// `SECCOMP_FILTER_FLAG_NEW_LISTENER` (with `SECCOMP_FILTER_FLAG_TSYNC` a thread's id is a
/// failure).
pub(crate) fn seccomp(operation: c_ulong, flags: c_ulong, args: c_ulong, make: impl FnOnce() -> c_long) -> c_long {
    const SET_MODE_STRICT: c_ulong = 0;
    const SET_MODE_FILTER: c_ulong = 1;
    const FLAG_NEW_LISTENER: c_ulong = 8;
    let mode = match operation {
        // With flags or arguments, strict mode is refused (libseccomp asks so, to learn
        // whether the call exists).
        SET_MODE_STRICT if flags == 0 && args == 0 => Mode::Strict,
        SET_MODE_FILTER => Mode::Filter { program: args, listener: flags & FLAG_NEW_LISTENER != 0 },
        _ => return make(),
    };
    install(mode, || {
        let r = make();
        (r, r == 0 || r > 0 && flags & FLAG_NEW_LISTENER != 0)
    })
}

/// What a call asks to put in force.
#[derive(Clone, Copy)]
enum Mode {
    Strict,
    /// A filter, at the address of its `sock_fprog`; with a listener, its `USER_NOTIF`
    /// calls wait for the program's supervisor (without, they fail with ENOSYS).
    Filter {
        program: c_ulong,
        listener: bool,
    },
}

/// Puts a filter in force by `make` (its result, and whether the kernel took it): noted first
/// if it may kill, the note taken back if the kernel refused it. `errno` is the call's alone.
fn install<R>(mode: Mode, make: impl FnOnce() -> (R, bool)) -> R {
    // The program's, for a call that succeeds (and sets none).
    let errno = os::errno();
    // Not in a `vfork` child: the state is its parent's. Asked before the call: in strict mode
    // the question's `getpid` would kill the thread.
    let owns_the_reports = crate::preload::owns_the_reports();
    if owns_the_reports {
        // A forked child's trace writer starts while the child may still fork, make a socket
        // and open its trace (see `Writer::after_fork_child`).
        crate::trace::writer::start_deferred(false);
    }
    let (kills, refuses_wakes) = if owns_the_reports { judge(mode) } else { (false, false) };
    let gives_up = kills && !may_kill();
    if gives_up {
        give_up_reports();
    } else if refuses_wakes {
        // Its `sendto` refused with an errno (man-db's sandbox answers ENOSYS), the writer
        // slept on for want of a wake, and the exit waited 10 s for it (review helper 149).
        crate::trace::writer::before_filter();
    }
    os::set_errno(errno);
    let (r, took) = make();
    let errno = os::errno();
    if gives_up && !took {
        take_back(errno);
    }
    // Not in a `vfork` child, whose thread state is its parent's (the parent went unspied,
    // its exit without a report: review helper 127).
    if took && matches!(mode, Mode::Strict) && owns_the_reports {
        // This thread may make no system call but `read`, `write`, `exit` and `sigreturn`
        // from now on, nor read the time-stamp counter: a sample's clock raised SIGSEGV, its
        // thread's first record a `gettid` that killed it (review helper 124).
        let ts = tls::state();
        if ts.depth.get() == 0 {
            ts.depth.set(tls::UNSPIED);
        }
    }
    os::set_errno(errno);
    r
}

/// What putting `mode` in force would do: whether it may kill a call of the reports (strict
/// mode kills all but four calls; a filter may, see [`may_kill_by`]), and whether it refuses
/// one of the calls that wake the trace writer through its socket ([`refuses_wakes`]). Neither
/// for a call the kernel will refuse at once (a filter that cannot be read, that the kernel's
/// checks refuse, or from a process with neither `no_new_privs` nor `CAP_SYS_ADMIN`).
fn judge(mode: Mode) -> (bool, bool) {
    match mode {
        Mode::Strict => (true, true),
        Mode::Filter { program, listener } => {
            // SAFETY: a query, with no pointer.
            let no_new_privs =
                unsafe { os::raw_syscall(libc::SYS_prctl, [libc::PR_GET_NO_NEW_PRIVS as usize, 0, 0, 0, 0, 0]) } == 1;
            if !no_new_privs && !has_sys_admin() {
                return (false, false);
            }
            let traced = crate::leaks::stop::tracer_under_filter(no_new_privs);
            read_filter(program)
                .map_or((false, false), |filter| (may_kill_by(&filter, traced, listener), refuses_wakes(&filter)))
        }
    }
}

/// Whether the calling thread has `CAP_SYS_ADMIN` in effect (`capget`, version 3).
fn has_sys_admin() -> bool {
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_SYS_ADMIN: u32 = 21;
    let mut header = [VERSION_3, 0u32];
    // Two sets of (effective, permitted, inheritable).
    let mut data = [0u32; 6];
    // SAFETY: capget writes the two sets into `data`; pid 0 is the caller.
    let r = unsafe { libc::syscall(libc::SYS_capget, header.as_mut_ptr(), data.as_mut_ptr()) };
    r == 0 && data[0] & (1 << CAP_SYS_ADMIN) != 0
}

/// The instructions of the `sock_fprog` at `address`, read as the kernel reads them: a bad
/// pointer (the program's mistake, which the kernel answers with EFAULT) gives `None`, not a
/// crash.
fn read_filter(address: c_ulong) -> Option<Vec<libc::sock_filter>> {
    const BPF_MAXINSNS: usize = 4096;
    // SAFETY: sock_fprog is plain data, valid when zeroed.
    let mut program: libc::sock_fprog = unsafe { core::mem::zeroed() };
    // SAFETY: the bytes of `program`, written by the kernel only.
    let header = unsafe {
        core::slice::from_raw_parts_mut(
            (&mut program as *mut libc::sock_fprog).cast::<u8>(),
            size_of::<libc::sock_fprog>(),
        )
    };
    if !os::read_own_bytes(address as usize, header) {
        return None;
    }
    let len = program.len as usize;
    if len == 0 || len > BPF_MAXINSNS {
        return None;
    }
    let mut filter = vec![libc::sock_filter { code: 0, jt: 0, jf: 0, k: 0 }; len];
    // SAFETY: the bytes of `filter`'s `len` instructions, written by the kernel only.
    let bytes = unsafe {
        core::slice::from_raw_parts_mut(filter.as_mut_ptr().cast::<u8>(), len * size_of::<libc::sock_filter>())
    };
    os::read_own_bytes(program.filter as usize, bytes).then_some(filter)
}

/// The system calls the reports at the end make (`strace` of every spy's exit report and
/// trace end, a signal's included), by their x86_64 numbers.
const REPORTS_CALL: [libc::c_long; 37] = [
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_pread64,
    libc::SYS_openat,
    libc::SYS_close,
    libc::SYS_lseek,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_fcntl,
    libc::SYS_flock,
    libc::SYS_getdents64,
    libc::SYS_readlink,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigpending,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_tgkill,
    libc::SYS_kill,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_process_vm_readv,
    libc::SYS_sendto,
    libc::SYS_wait4,
    libc::SYS_exit_group,
];

/// The calls the check's tracer adds (see `leaks::stop::tracer_under_filter`).
const TRACER_CALLS: [libc::c_long; 4] = [libc::SYS_clone, libc::SYS_ptrace, libc::SYS_wait4, libc::SYS_prctl];

/// Whether the seccomp `filter` kills, traps (`TRAP`, whose `SIGSYS` a program's handler
/// answers for the calls it expects, not for ours) or, with a `listener`, hands to the
/// program's supervisor (see [`kills`]) one of [`REPORTS_CALL`] (and of
/// [`TRACER_CALLS`] when `traced`), run as the kernel runs it, with the calls' arguments 0, then
/// a first argument of a descriptor numbered high (mallocspy's, see `kept_fd::move_high`). A deny
/// list that kills `clone` or `ptrace` passes when no tracer will be made; an allow list of the
/// program's own calls does not. A filter the kernel would refuse (see [`run`]) does not.
fn may_kill_by(filter: &[libc::sock_filter], traced: bool, listener: bool) -> bool {
    let tracer: &[libc::c_long] = if traced { &TRACER_CALLS } else { &[] };
    let mut kills_one = false;
    for &nr in REPORTS_CALL.iter().chain(tracer) {
        for first in [0, 1000] {
            match run(filter, nr as u32, first) {
                None => return false,
                Some(action) => kills_one |= kills(action, listener),
            }
        }
    }
    kills_one
}

/// A filter's return value: its action (`& ACTION`), and the actions that do not end the call
/// at once.
const ACTION: u32 = 0xffff_0000;
const ERRNO: u32 = 0x0005_0000;
const USER_NOTIF: u32 = 0x7fc0_0000;
const TRACE: u32 = 0x7ff0_0000;
const LOG: u32 = 0x7ffc_0000;
const ALLOW: u32 = 0x7fff_0000;

/// The calls that wake the trace writer through its socket and wait for its end there (see
/// `trace::writer::wake`).
const WAKE_CALLS: [libc::c_long; 4] = [libc::SYS_sendto, libc::SYS_recvfrom, libc::SYS_poll, libc::SYS_fstat];

/// Whether the seccomp `filter` does not run one of [`WAKE_CALLS`] on a descriptor numbered high
/// (a filter the kernel would refuse does not count).
fn refuses_wakes(filter: &[libc::sock_filter]) -> bool {
    let mut refuses_one = false;
    for nr in WAKE_CALLS {
        match run(filter, nr as u32, 1000) {
            None => return false,
            Some(action) => refuses_one |= !matches!(action & ACTION, LOG | ALLOW),
        }
    }
    refuses_one
}

/// Whether a filter's return value ends the call other than by running it or failing it: the
/// kernel kills the process for every action but these (an unknown one included). With a
/// `listener`, `USER_NOTIF` waits for the program's supervisor, which need not answer calls it
/// does not expect: the exit reports' `getpid` hung for good, and the SIGTERM that should have
/// ended the program hung in its reports too (review helper 150).
fn kills(action: u32, listener: bool) -> bool {
    match action & ACTION {
        USER_NOTIF => listener,
        action => !matches!(action, ERRNO | TRACE | LOG | ALLOW),
    }
}

/// Runs a seccomp filter on the x86_64 system call `nr` with `first` as its first argument
/// (its low word), the others and the instruction pointer 0: what it returns, or `None` for a
/// program the kernel would not have taken (an unknown instruction, a load out of
/// `seccomp_data`, a jump past the end).
fn run(filter: &[libc::sock_filter], nr: u32, first: u32) -> Option<u32> {
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    // `struct seccomp_data`: nr, arch, instruction_pointer, args[6], as 32-bit words.
    let mut data = [0u32; 16];
    data[0] = nr;
    data[1] = AUDIT_ARCH_X86_64;
    data[4] = first;
    let (mut a, mut x, mut mem, mut pc) = (0u32, 0u32, [0u32; 16], 0usize);
    loop {
        let i = filter.get(pc)?;
        let k = i.k;
        let src = if i.code & 0x08 != 0 { x } else { k };
        pc += 1;
        match i.code & 0x07 {
            // BPF_LD, BPF_LDX (32-bit words only).
            0x00 | 0x01 => {
                let value = match i.code & 0xe0 {
                    0x00 => k,
                    0x20 if k % 4 == 0 => *data.get(k as usize / 4)?,
                    0x60 => *mem.get(k as usize)?,
                    0x80 => 64,
                    _ => return None,
                };
                if i.code & 0x18 != 0 {
                    return None;
                }
                if i.code & 0x07 == 0x00 { a = value } else { x = value }
            }
            // BPF_ST, BPF_STX.
            0x02 => *mem.get_mut(k as usize)? = a,
            0x03 => *mem.get_mut(k as usize)? = x,
            // BPF_ALU.
            0x04 => {
                let by_k = i.code & 0x08 == 0;
                // The kernel's checks refuse a division by a constant 0 and a constant shift
                // of 32 or more.
                if by_k
                    && (matches!(i.code & 0xf0, 0x30 | 0x90) && k == 0
                        || matches!(i.code & 0xf0, 0x60 | 0x70) && k >= 32)
                {
                    return None;
                }
                a = match i.code & 0xf0 {
                    0x00 => a.wrapping_add(src),
                    0x10 => a.wrapping_sub(src),
                    0x20 => a.wrapping_mul(src),
                    // By zero: the kernel's filter returns 0 (KILL_THREAD).
                    0x30 => match a.checked_div(src) {
                        Some(q) => q,
                        None => return Some(0),
                    },
                    0x40 => a | src,
                    0x50 => a & src,
                    // As the kernel's: the count taken modulo 32.
                    0x60 => a.wrapping_shl(src),
                    0x70 => a.wrapping_shr(src),
                    0x80 => a.wrapping_neg(),
                    0x90 => match a.checked_rem(src) {
                        Some(r) => r,
                        None => return Some(0),
                    },
                    0xa0 => a ^ src,
                    _ => return None,
                }
            }
            // BPF_JMP: forward only, so the run ends.
            0x05 => {
                let taken = match i.code & 0xf0 {
                    0x00 => {
                        pc = pc.checked_add(k as usize)?;
                        continue;
                    }
                    0x10 => a == src,
                    0x20 => a > src,
                    0x30 => a >= src,
                    0x40 => a & src != 0,
                    _ => return None,
                };
                pc += usize::from(if taken { i.jt } else { i.jf });
            }
            // BPF_RET: K, or A.
            0x06 => {
                return match i.code & 0x18 {
                    0x00 => Some(k),
                    0x10 => Some(a),
                    _ => None,
                };
            }
            // BPF_MISC: TAX, TXA.
            _ => match i.code & 0xf8 {
                0x00 => x = a,
                0x80 => a = x,
                _ => return None,
            },
        }
    }
}

/// Says so, hands the ending signals back, moves the trace writer's wake-ups to the futex.
fn give_up_reports() {
    MAY_KILL.store(true, Ordering::Release);
    crate::sink::write(
        b"mallocspy: the program puts itself under a seccomp filter that may kill it for a system call it \
          does not expect; the reports at its end make such calls, so they are given up\n",
    );
    crate::ending_signals::give_back();
    crate::trace::writer::before_filter();
    crate::trace::writer::stop_queueing();
}

/// The kernel refused the filter ([`give_up_reports`] came first): the reports are back.
fn take_back(errno: c_int) {
    MAY_KILL.store(false, Ordering::Release);
    crate::ending_signals::enable();
    let error = std::io::Error::from_raw_os_error(errno);
    crate::sink::write(
        format!("mallocspy: the seccomp filter was refused ({error}); the reports are back\n").as_bytes(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const LD_NR: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS, k = 0
    const JEQ: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const RET: u16 = 0x06; // BPF_RET | BPF_K
    const KILL: u32 = 0x8000_0000;
    const EPERM: u32 = ERRNO | 1;

    fn op(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
        libc::sock_filter { code, jt, jf, k }
    }

    /// Kills (or returns `default`) for every call but `allowed`.
    fn allow_list(allowed: &[libc::c_long], default: u32) -> Vec<libc::sock_filter> {
        let mut filter = vec![op(LD_NR, 0, 0, 0)];
        for &nr in allowed {
            filter.extend([op(JEQ, 0, 1, nr as u32), op(RET, 0, 0, ALLOW)]);
        }
        filter.push(op(RET, 0, 0, default));
        filter
    }

    fn may_kill(filter: &[libc::sock_filter]) -> bool {
        may_kill_by(filter, false, false)
    }

    #[test]
    fn filters_that_kill_a_call_of_the_reports_may_kill_and_others_do_not() {
        let mallocs = [libc::SYS_brk, libc::SYS_mmap, libc::SYS_munmap, libc::SYS_write, libc::SYS_exit_group];
        assert!(may_kill(&allow_list(&mallocs, KILL)), "sshd's kind: the program's own calls only");
        assert!(!may_kill(&allow_list(&mallocs, EPERM)), "the same, refusing with an errno");
        assert!(!may_kill(&allow_list(&REPORTS_CALL, KILL)), "every call the reports make allowed");
        let notify = allow_list(&mallocs, USER_NOTIF);
        assert!(may_kill_by(&notify, false, true), "handed to a supervisor that need not answer");
        assert!(!may_kill_by(&notify, false, false), "without a listener the calls fail with ENOSYS");
        // man-db's kind: the network's calls refused with ENOSYS.
        let no_network = [op(LD_NR, 0, 0, 0), op(JEQ, 0, 1, libc::SYS_sendto as u32), op(RET, 0, 0, 0x0005_0026)]
            .into_iter()
            .chain([op(RET, 0, 0, ALLOW)])
            .collect::<Vec<_>>();
        assert!(!may_kill(&no_network) && refuses_wakes(&no_network));
        assert!(!refuses_wakes(&allow_list(&WAKE_CALLS, KILL)));
        let deny_clone =
            [op(LD_NR, 0, 0, 0), op(JEQ, 0, 1, libc::SYS_clone as u32), op(RET, 0, 0, KILL), op(RET, 0, 0, ALLOW)];
        assert!(!may_kill(&deny_clone), "a deny list of a call the reports do not make");
        // The architecture checked first, as filters should: x86_64 is what runs.
        let arch_first = [
            op(0x20, 0, 0, 4),
            op(JEQ, 1, 0, 0xc000_003e),
            op(RET, 0, 0, KILL),
            op(LD_NR, 0, 0, 0),
            op(JEQ, 0, 1, libc::SYS_openat as u32),
            op(RET, 0, 0, 0x0003_0000),
            op(RET, 0, 0, ALLOW),
        ];
        assert!(may_kill(&arch_first), "TRAP on openat");
        assert!(!may_kill(&arch_first[..3].iter().copied().chain([op(RET, 0, 0, ALLOW)]).collect::<Vec<_>>()));
        assert!(may_kill(&[op(0x16, 0, 0, 0)]), "returns A, 0 here: KILL_THREAD");
        assert!(!may_kill(&[op(0xff, 0, 0, 0)]), "an instruction the kernel refuses: no filter");
        assert!(!may_kill(&[op(LD_NR, 0, 0, 0)]), "runs past its end: refused too");
        assert!(may_kill(&[op(LD_NR, 0, 0, 0), op(0x3c, 0, 0, 0), op(0x16, 0, 0, 0)]), "divides by X = 0: returns 0");
        assert!(!may_kill(&[op(LD_NR, 0, 0, 0), op(0x34, 0, 0, 0), op(0x16, 0, 0, 0)]), "by a constant 0: refused");
    }
}
