//! Seccomp filters the program installs on itself (`prctl(PR_SET_SECCOMP)`, libseccomp's
//! `seccomp_load`, both wrapped). A filter that kills for an unexpected system call (sshd's
//! privilege separation, a sandbox's) killed the program at its exit: the leak check and the
//! trace's end make calls its own exit does not (`sigaltstack`, `openat` of `/proc`,
//! `process_vm_readv`, a CPU clock), and the process died of `SIGSYS` where natively it exited.
//! Such a filter is seen before it is in force, while every call is still allowed: mallocspy
//! says then, in one line, that the exit reports are given up, hands the ending signals back
//! to the program, and wakes the trace writer through the queue's futex alone. A filter that
//! answers with an errno (`SECCOMP_RET_ERRNO`, as container runtimes' do) changes nothing: the
//! reports go on, and what cannot be read is said. Filters installed by raw system calls (the
//! `syscall` function, Chromium's own) or inherited at start are not seen.

use core::ffi::{c_int, c_ulong, c_void};
use core::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use crate::os;

/// Whether a filter that may kill the process on an unexpected call was installed.
static MAY_KILL: AtomicBool = AtomicBool::new(false);

static NEXT_PRCTL: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());
static NEXT_SECCOMP_LOAD: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

/// Whether the exit reports are given up (see the module's docs).
pub(crate) fn may_kill() -> bool {
    MAY_KILL.load(Ordering::Acquire)
}

/// Looks up libc's `prctl` at start (see [`crate::program_mappings::warm_up`]).
pub(crate) fn warm_up() {
    os::next_symbol_cached(&NEXT_PRCTL, c"prctl");
}

/// `prctl`: a filter that may kill is noted before libc's installs it.
///
/// # Safety
/// As `prctl` with these arguments.
pub(crate) unsafe fn prctl(option: c_int, a2: c_ulong, a3: c_ulong, a4: c_ulong, a5: c_ulong) -> c_int {
    if option == libc::PR_SET_SECCOMP {
        let program = a3 as *const libc::sock_fprog;
        // SAFETY: for a filter, the caller passes a valid `sock_fprog` (or the kernel refuses).
        let filter_may_kill = a2 != libc::SECCOMP_MODE_FILTER as c_ulong || unsafe { may_kill_by(program) };
        if filter_may_kill {
            give_up_reports();
        }
    }
    let f = os::next_symbol_cached(&NEXT_PRCTL, c"prctl");
    if f.is_null() {
        os::set_errno(libc::ENOSYS);
        return -1;
    }
    type Prctl = unsafe extern "C" fn(c_int, c_ulong, c_ulong, c_ulong, c_ulong) -> c_int;
    // SAFETY: libc's prctl takes its arguments as five words; the caller's guarantee covers
    // them.
    unsafe { core::mem::transmute::<*mut c_void, Prctl>(f)(option, a2, a3, a4, a5) }
}

/// libseccomp's `seccomp_load`: its filter is opaque, so taken as one that may kill.
///
/// # Safety
/// As `seccomp_load`.
pub(crate) unsafe fn seccomp_load(context: *mut c_void) -> c_int {
    let f = os::next_symbol_cached(&NEXT_SECCOMP_LOAD, c"seccomp_load");
    if f.is_null() {
        // No libseccomp after us: the program's call reached a name it does not define.
        return -libc::ENOSYS;
    }
    give_up_reports();
    type Load = unsafe extern "C" fn(*mut c_void) -> c_int;
    // SAFETY: libseccomp's seccomp_load has this signature; the caller's guarantee.
    unsafe { core::mem::transmute::<*mut c_void, Load>(f)(context) }
}

/// The system calls the reports at the end make (`strace` of every spy's exit report and
/// trace end, a signal's included), by their x86_64 numbers.
const REPORTS_CALL: [libc::c_long; 36] = [
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_pread64,
    libc::SYS_openat,
    libc::SYS_close,
    libc::SYS_lseek,
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

/// Whether the classic BPF `program` kills or traps (`KILL_PROCESS`, `KILL_THREAD`, `TRAP`,
/// whose `SIGSYS` a program's handler answers for the calls it expects, not for ours) one of
/// [`REPORTS_CALL`], run as the kernel runs it, with the calls' arguments taken as 0. A deny
/// list that kills `clone` or `ptrace` passes (the reports then make neither); an allow list of
/// the program's own calls does not.
///
/// # Safety
/// `program` is null or a valid `sock_fprog` whose `filter` holds `len` instructions.
unsafe fn may_kill_by(program: *const libc::sock_fprog) -> bool {
    // SAFETY: the caller's guarantee.
    let Some(program) = (unsafe { program.as_ref() }) else { return true };
    if program.filter.is_null() {
        return true;
    }
    // SAFETY: as above: `len` instructions at `filter`.
    let filter = unsafe { core::slice::from_raw_parts(program.filter, program.len as usize) };
    REPORTS_CALL.iter().any(|&nr| run(filter, nr as u32).is_none_or(kills))
}

/// Whether a filter's return value kills or traps (see [`may_kill_by`]).
fn kills(action: u32) -> bool {
    const ACTION: u32 = 0xffff_0000;
    const KILL_PROCESS: u32 = 0x8000_0000;
    const KILL_THREAD: u32 = 0x0000_0000;
    const TRAP: u32 = 0x0003_0000;
    matches!(action & ACTION, KILL_PROCESS | KILL_THREAD | TRAP)
}

/// Runs a seccomp filter on the x86_64 system call `nr` with its arguments and instruction
/// pointer 0: what it returns, or `None` for a program the kernel would not have taken (an
/// unknown instruction, a load out of `seccomp_data`, a jump past the end).
fn run(filter: &[libc::sock_filter], nr: u32) -> Option<u32> {
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    // `struct seccomp_data`: nr, arch, instruction_pointer, args[6], as 32-bit words.
    let mut data = [0u32; 16];
    data[0] = nr;
    data[1] = AUDIT_ARCH_X86_64;
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
                a = match i.code & 0xf0 {
                    0x00 => a.wrapping_add(src),
                    0x10 => a.wrapping_sub(src),
                    0x20 => a.wrapping_mul(src),
                    0x30 => a.checked_div(src)?,
                    0x40 => a | src,
                    0x50 => a & src,
                    0x60 => a.checked_shl(src).unwrap_or(0),
                    0x70 => a.checked_shr(src).unwrap_or(0),
                    0x80 => a.wrapping_neg(),
                    0x90 => a.checked_rem(src)?,
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

/// Once: says so, hands the ending signals back, moves the trace writer's wake-ups to the
/// futex.
fn give_up_reports() {
    if MAY_KILL.swap(true, Ordering::AcqRel) {
        return;
    }
    crate::sink::write(
        b"mallocspy: the program puts itself under a seccomp filter that may kill it for a system call it \
          does not expect; the reports at its end make such calls, so they are given up\n",
    );
    crate::ending_signals::give_back();
    crate::trace::writer::before_filter();
}

#[cfg(test)]
mod tests {
    use super::*;

    const LD_NR: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS, k = 0
    const JEQ: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const RET: u16 = 0x06; // BPF_RET | BPF_K
    const ALLOW: u32 = 0x7fff_0000;
    const KILL: u32 = 0x8000_0000;
    const EPERM: u32 = 0x0005_0001;

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
        let program = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr().cast_mut() };
        // SAFETY: `program` holds `filter`, alive for the call.
        unsafe { may_kill_by(&program) }
    }

    #[test]
    fn filters_that_kill_a_call_of_the_reports_may_kill_and_others_do_not() {
        let mallocs = [libc::SYS_brk, libc::SYS_mmap, libc::SYS_munmap, libc::SYS_write, libc::SYS_exit_group];
        assert!(may_kill(&allow_list(&mallocs, KILL)), "sshd's kind: the program's own calls only");
        assert!(!may_kill(&allow_list(&mallocs, EPERM)), "the same, refusing with an errno");
        assert!(!may_kill(&allow_list(&REPORTS_CALL, KILL)), "every call the reports make allowed");
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
        assert!(may_kill(&[op(0xff, 0, 0, 0)]), "an instruction the kernel would refuse");
        assert!(may_kill(&[op(LD_NR, 0, 0, 0)]), "runs past its end");
    }
}
