//! The few operating-system services the hook path needs, as thin wrappers that never allocate.
//!
//! Everything here is async-signal-safe and may run before libc has finished initialising:
//! raw system calls, `errno`, anonymous mappings and the page size. The one exception,
//! [`next_symbol_cached`] (`dlsym`), serves the wrappers of libc functions, outside the hooks.

use core::ffi::{CStr, c_int, c_void};
use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

/// The calling thread's `errno`.
#[inline]
pub(crate) fn errno() -> c_int {
    // SAFETY: the calling thread's errno slot, valid for the thread's life.
    unsafe { *errno_slot() }
}

/// Sets the calling thread's `errno`.
#[inline]
pub(crate) fn set_errno(value: c_int) {
    // SAFETY: as in `errno`.
    unsafe { *errno_slot() = value }
}

/// The calling thread's `errno` slot, asked of the C library once per thread: a hook keeps
/// the program's `errno` across the spy's code, and two calls of `__errno_location` through
/// the PLT were 7% of what a call under `spy=count` cost.
#[inline]
fn errno_slot() -> *mut c_int {
    let state = crate::tls::state();
    let mut at = state.errno_at.get();
    if at == 0 {
        // SAFETY: `__errno_location` takes nothing and returns the calling thread's slot.
        at = unsafe { libc::__errno_location() } as usize;
        state.errno_at.set(at);
    }
    at as *mut c_int
}

/// Maps `len` bytes of zeroed, private, anonymous memory; `None` when the kernel refuses.
///
/// `MAP_NORESERVE`: pages cost memory only once touched, so tables may reserve generously.
pub(crate) fn map(len: usize) -> Option<NonNull<u8>> {
    map_anonymous(len, libc::MAP_PRIVATE | libc::MAP_NORESERVE)
}

/// Maps `len` bytes of zeroed anonymous memory shared with the processes forked from now on
/// (the trace writer); `None` when the kernel refuses.
pub(crate) fn map_shared(len: usize) -> Option<NonNull<u8>> {
    let p = map_anonymous(len, libc::MAP_SHARED)?;
    let start = p.as_ptr() as usize;
    // A forked child keeps its parents' queues mapped beside its own: a few per process.
    if let Some(slot) =
        OWN_SHARED.iter().find(|s| s.0.compare_exchange(0, start, Ordering::AcqRel, Ordering::Relaxed).is_ok())
    {
        slot.1.store(start + len, Ordering::Release);
    }
    Some(p)
}

/// mallocspy's shared mappings (the trace queues, whose slots hold sampled blocks'
/// addresses): the kernel names them as it names a program's shared anonymous memory, which
/// the leak scan takes as roots; these it must not.
static OWN_SHARED: [(AtomicUsize, AtomicUsize); 16] = [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; 16];

/// Bytes of mallocspy's shared mappings (see [`map_shared`]), a forked child's parents'
/// included.
pub(crate) fn shared_bytes() -> usize {
    OWN_SHARED.iter().map(|(s, e)| e.load(Ordering::Acquire).saturating_sub(s.load(Ordering::Acquire))).sum()
}

/// Whether `[start, end)` overlaps one of mallocspy's shared mappings (see [`map_shared`]).
pub(crate) fn owns_shared(start: usize, end: usize) -> bool {
    OWN_SHARED.iter().any(|(s, e)| {
        let (s, e) = (s.load(Ordering::Acquire), e.load(Ordering::Acquire));
        s != 0 && start < e && s < end
    })
}

fn map_anonymous(len: usize, flags: c_int) -> Option<NonNull<u8>> {
    // The system call, not libc's `mmap`, which this module exports too: mallocspy's memory
    // is not the program's (see `program_mappings`).
    // Every argument a full register: `libc::syscall` is variadic, and an `int` passed as its
    // sixth (the offset, on the stack) left half of it unwritten (memcheck saw it).
    let args =
        [0, len, (libc::PROT_READ | libc::PROT_WRITE) as usize, (flags | libc::MAP_ANONYMOUS) as usize, usize::MAX, 0];
    // SAFETY: an anonymous mapping at an address of the kernel's choosing aliases nothing.
    let p = unsafe { raw_syscall(libc::SYS_mmap, args) };
    // A failure is -errno, in [-4095, -1].
    if (-4095..0).contains(&p) { None } else { NonNull::new(p as *mut u8) }
}

/// Unmaps `len` bytes at `start`, a mapping of [`map`]'s.
///
/// # Safety
/// Nothing uses the range any more.
pub(crate) unsafe fn unmap(start: NonNull<u8>, len: usize) {
    // SAFETY: the system call, as in `map_anonymous`; the caller gives up the range.
    unsafe { libc::syscall(libc::SYS_munmap, start.as_ptr(), len) };
}

static PAGE_SIZE: AtomicUsize = AtomicUsize::new(0);

/// Whether the page holding `addr` is mapped (`mincore` fails with ENOMEM on a hole).
pub(crate) fn is_mapped(addr: usize) -> bool {
    let page = addr & !(page_size() - 1);
    let mut resident = 0u8;
    // SAFETY: mincore writes one byte per page of the one-page range into `resident`.
    unsafe { libc::mincore(page as *mut c_void, 1, &mut resident) == 0 }
}

/// `fstat(2)` of `fd` by the system call, sets `errno` on failure. Not libc's: another
/// preloaded library after mallocspy's (libfaketime wraps the `stat` family) would take the
/// call, and at exit, its own destructor run, crashed in it (review helper 103).
pub(crate) fn fstat(fd: c_int) -> Option<libc::stat> {
    // SAFETY: stat is plain data, valid when zeroed.
    let mut st: libc::stat = unsafe { core::mem::zeroed() };
    // SAFETY: fstat writes only the stat buffer; a bad descriptor only fails.
    let r = unsafe { libc::syscall(libc::SYS_fstat, fd, &mut st as *mut libc::stat) };
    (r == 0).then_some(st)
}

/// Whether the file open as `fd` has no name left (deleted, or its directory removed).
pub(crate) fn is_unlinked(fd: i32) -> bool {
    fstat(fd).is_some_and(|st| st.st_nlink == 0)
}

/// Reads `words.len()` words of this process's memory at `addr` through the kernel
/// (`process_vm_readv`), which says EFAULT where nothing readable is, rather than fault;
/// `false` when not all of them could be read.
pub(crate) fn read_own(addr: usize, words: &mut [u64]) -> bool {
    let len = core::mem::size_of_val(words);
    // SAFETY: the words' bytes, which any value fills.
    read_own_bytes(addr, unsafe { core::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) })
}

/// [`read_own`], of bytes.
pub(crate) fn read_own_bytes(addr: usize, bytes: &mut [u8]) -> bool {
    let len = bytes.len();
    let local = libc::iovec { iov_base: bytes.as_mut_ptr().cast(), iov_len: len };
    let remote = libc::iovec { iov_base: addr as *mut c_void, iov_len: len };
    // SAFETY: the kernel writes at most `len` bytes into `bytes` and only reads at `addr`.
    let read = unsafe {
        raw_syscall(
            libc::SYS_process_vm_readv,
            [getpid() as usize, &raw const local as usize, 1, &raw const remote as usize, 1, 0],
        )
    };
    read == len as isize
}

/// Reads the two words at each of `places` of this process's memory into `out` (as many as
/// `places`), with one `process_vm_readv`, which stops at the first place nothing readable
/// is: returns how many places were read, from the first.
pub(crate) fn read_own_pairs(places: &[usize], out: &mut [[u64; 2]]) -> usize {
    // The guard's places of a header under a block: one per alignment, 16 bytes to 2^47.
    const MOST: usize = 44;
    let n = places.len().min(out.len()).min(MOST);
    let remote: [libc::iovec; MOST] = core::array::from_fn(|i| libc::iovec {
        iov_base: places.get(i).map_or(core::ptr::null_mut(), |&a| a as *mut c_void),
        iov_len: 16,
    });
    let local = libc::iovec { iov_base: out.as_mut_ptr().cast(), iov_len: 16 * n };
    // SAFETY: the kernel writes at most 16 * n bytes into `out` and only reads at `places`.
    let read = unsafe {
        raw_syscall(
            libc::SYS_process_vm_readv,
            [getpid() as usize, &raw const local as usize, 1, remote.as_ptr() as usize, n, 0],
        )
    };
    if read < 0 { 0 } else { read as usize / 16 }
}

/// Whether the process runs on valgrind's synthetic CPU: valgrind's `RUNNING_ON_VALGRIND`
/// client request, the instruction sequence `valgrind.h` defines, which a real CPU runs as
/// rotations that leave `rdi` as it was and an exchange of `rbx` with itself (the default
/// answer, 0, stays in `rdx`).
pub(crate) fn running_on_valgrind() -> bool {
    const RUNNING_ON_VALGRIND: u64 = 0x1001;
    let request: [u64; 6] = [RUNNING_ON_VALGRIND, 0, 0, 0, 0, 0];
    let mut answer: u64 = 0;
    // SAFETY: rotations of rdi by 128 bits in all, which restore it, and `xchg rbx, rbx`: no
    // register or memory changes on a real CPU; valgrind reads the request and writes rdx.
    unsafe {
        core::arch::asm!(
            "rol rdi, 3",
            "rol rdi, 13",
            "rol rdi, 61",
            "rol rdi, 51",
            "xchg rbx, rbx",
            inout("rdx") answer,
            in("rax") request.as_ptr(),
            out("rdi") _,
        )
    };
    answer != 0
}

/// The system page size (cached; `getauxval` works before libc is initialised).
#[inline]
pub(crate) fn page_size() -> usize {
    let cached = PAGE_SIZE.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    // SAFETY: getauxval only reads the auxiliary vector the kernel gave the process.
    let mut size = unsafe { libc::getauxval(libc::AT_PAGESZ) } as usize;
    if !size.is_power_of_two() {
        size = 4096;
    }
    PAGE_SIZE.store(size, Ordering::Relaxed);
    size
}

// glibc's `open`, `read`, `write`, `close` and `send` are cancellation points: a thread with a
// cancellation pending (deferred, the default) that makes one inside a hook starts unwinding
// there, through the spy's `catch_unwind`, and glibc aborts the process ("FATAL: exception not
// rethrown"), where natively the thread would have gone on to its next cancellation point. The
// system calls themselves are not cancellation points, so the code a hook may run makes them
// directly (`malloc` itself is not one: a program may count on that).

/// The calling thread's cancellation disabled while this lives (see [`SpyCell::call`]).
///
/// [`SpyCell::call`]: crate::registry::SpyCell::call
pub(crate) struct Uncancellable(c_int);

// glibc's values (the libc crate has neither for Linux).
const PTHREAD_CANCEL_ENABLE: c_int = 0;
const PTHREAD_CANCEL_DISABLE: c_int = 1;

unsafe extern "C" {
    fn pthread_setcancelstate(state: c_int, old: *mut c_int) -> c_int;
}

impl Uncancellable {
    pub(crate) fn new() -> Self {
        let mut old = PTHREAD_CANCEL_ENABLE;
        // SAFETY: a valid out-pointer; the state is the calling thread's own.
        unsafe { pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &mut old) };
        Self(old)
    }
}

impl Drop for Uncancellable {
    fn drop(&mut self) {
        // SAFETY: restores the state `new` found; the old state's out-pointer may be null.
        unsafe { pthread_setcancelstate(self.0, core::ptr::null_mut()) };
    }
}

/// `open(2)` of `path` with `flags` (no `O_CREAT`), without the cancellation point.
pub(crate) fn open(path: &CStr, flags: c_int) -> c_int {
    // SAFETY: openat reads the NUL-terminated path and nothing else.
    unsafe { libc::syscall(libc::SYS_openat, libc::AT_FDCWD, path.as_ptr(), flags, 0) as c_int }
}

/// `read(2)` into `buf`, without the cancellation point.
pub(crate) fn read(fd: c_int, buf: &mut [u8]) -> isize {
    // SAFETY: read writes at most buf.len() bytes into buf.
    unsafe { libc::syscall(libc::SYS_read, fd, buf.as_mut_ptr(), buf.len()) as isize }
}

/// `write(2)` of `bytes`, without the cancellation point.
pub(crate) fn write(fd: c_int, bytes: &[u8]) -> isize {
    // SAFETY: write reads at most bytes.len() bytes from bytes.
    unsafe { libc::syscall(libc::SYS_write, fd, bytes.as_ptr(), bytes.len()) as isize }
}

/// `send(2)` of `bytes` with `flags`, without the cancellation point.
pub(crate) fn send(fd: c_int, bytes: &[u8], flags: c_int) -> isize {
    // SAFETY: sendto reads at most bytes.len() bytes from bytes; no address is given.
    unsafe { libc::syscall(libc::SYS_sendto, fd, bytes.as_ptr(), bytes.len(), flags, 0usize, 0usize) as isize }
}

/// `close(2)` of a descriptor the caller owns, without the cancellation point.
pub(crate) fn close(fd: c_int) {
    // SAFETY: close takes no memory; the caller owns fd.
    unsafe { libc::syscall(libc::SYS_close, fd) };
}

/// Writes all of `bytes` to `fd`, retrying on `EINTR` and short writes. Preserves `errno`.
/// Returns false when the descriptor refuses the data. See [`without_write_signals`] for why
/// no signal comes of it.
pub(crate) fn write_all(fd: c_int, bytes: &[u8]) -> bool {
    let saved = errno();
    let ok = without_write_signals(|| write_all_of(fd, bytes));
    set_errno(saved);
    ok
}

fn write_all_of(fd: c_int, bytes: &[u8]) -> bool {
    if is_pipe(fd) {
        // Processes writing reports to one pipe at once (`make -j`, `xargs -P` into a log):
        // a write of at most PIPE_BUF bytes is never mixed with another's, so whole lines go
        // a few kilobytes at a time, and no line is spliced into another's.
        line_chunks(bytes, libc::PIPE_BUF).all(|chunk| write_whole(fd, chunk).is_ok())
    } else {
        // A file appends each write whole: the report stays in one piece.
        write_whole(fd, bytes).is_ok()
    }
}

/// Runs `f`, which writes mallocspy's own output, with SIGPIPE and SIGXFSZ blocked on this
/// thread, and takes back those `f` raised (one already pending stays the program's). Both
/// would end the program for output that is ours: a pipe whose reader has gone
/// (`mallocspy run -- prog 2>&1 | head -1` ended `prog` by SIGPIPE at its exit report), a file
/// past `RLIMIT_FSIZE` (`prlimit --fsize=0` ended it by SIGXFSZ before its stdout was
/// flushed). Blocked, the write fails instead (`EPIPE`, `EFBIG`).
pub(crate) fn without_write_signals<R>(f: impl FnOnce() -> R) -> R {
    const SIGNALS: [c_int; 2] = [libc::SIGPIPE, libc::SIGXFSZ];
    // SAFETY: signal sets are plain data set up by sigemptyset/sigaddset; the mask's system
    // call, sigpending and sigtimedwait (with a zero timeout) only read and write them, and
    // are async-signal-safe, as this runs in signal handlers too.
    unsafe {
        let mut blocked: libc::sigset_t = core::mem::zeroed();
        libc::sigemptyset(&mut blocked);
        for signal in SIGNALS {
            libc::sigaddset(&mut blocked, signal);
        }
        let mut old: libc::sigset_t = core::mem::zeroed();
        thread_sigmask(libc::SIG_BLOCK, &blocked, &mut old);
        let mut pending: libc::sigset_t = core::mem::zeroed();
        libc::sigpending(&mut pending);
        let mut ours: libc::sigset_t = core::mem::zeroed();
        libc::sigemptyset(&mut ours);
        for signal in SIGNALS {
            if libc::sigismember(&pending, signal) != 1 {
                libc::sigaddset(&mut ours, signal);
            }
        }
        let r = f();
        let now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // Standard signals queue once each: two takes at most.
        for _ in SIGNALS {
            if libc::sigtimedwait(&ours, core::ptr::null_mut(), &now) < 0 {
                break;
            }
        }
        thread_sigmask(libc::SIG_SETMASK, &old, core::ptr::null_mut());
        r
    }
}

/// `pthread_sigmask` by the system call. glibc's leaves the two signals it reserves (32 and
/// 33) out of every set it is given: a mask taken and put back through it unblocked them in
/// a thread that had them blocked. glibc's timer thread (`SIGEV_THREAD`) waits for its
/// signal, 32, blocked: in a hook there, it then took the timer's next one unblocked, and
/// the process died of it (review helper 146).
///
/// # Safety
/// `set` and `old` are null or point to signal sets.
unsafe fn thread_sigmask(how: c_int, set: *const libc::sigset_t, old: *mut libc::sigset_t) {
    // The kernel's set: the first 8 bytes of glibc's.
    const KERNEL_SET: usize = 8;
    // SAFETY: rt_sigprocmask reads and writes at most 8 bytes through the caller's pointers.
    unsafe { libc::syscall(libc::SYS_rt_sigprocmask, how, set, old, KERNEL_SET) };
}

fn is_pipe(fd: c_int) -> bool {
    fstat(fd).is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFIFO)
}

/// `bytes` in pieces of at most `max` bytes that end at line ends, but for a line longer than
/// `max`, which is a piece of its own.
fn line_chunks(bytes: &[u8], max: usize) -> impl Iterator<Item = &[u8]> {
    let mut rest = bytes;
    core::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let line_end = |from: &[u8]| from.iter().position(|&b| b == b'\n').map_or(from.len(), |i| i + 1);
        let mut end = line_end(rest);
        while end < rest.len() && end + line_end(&rest[end..]) <= max {
            end += line_end(&rest[end..]);
        }
        let (chunk, tail) = rest.split_at(end);
        rest = tail;
        Some(chunk)
    })
}

/// Writes all of `bytes` to `fd`, retrying on `EINTR` and short writes; on failure the error
/// number (`ENOSPC` for a write that wrote nothing) and the bytes written before it.
pub(crate) fn write_whole(fd: c_int, bytes: &[u8]) -> Result<(), (c_int, usize)> {
    let mut done = 0;
    while done < bytes.len() {
        match write(fd, &bytes[done..]) {
            n if n > 0 => done += n as usize,
            0 => return Err((libc::ENOSPC, done)),
            _ if errno() == libc::EINTR => {}
            _ => return Err((errno(), done)),
        }
    }
    Ok(())
}

/// The device and inode of the file behind `fd`: whether a descriptor kept is still the file
/// it was (a program may close it and reuse its number).
pub(crate) fn file_identity(fd: c_int) -> Option<(u64, u64)> {
    fstat(fd).map(|st| (st.st_dev, st.st_ino))
}

/// Whether `fd` is the file `id` (see [`file_identity`]). An open descriptor that cannot be
/// asked (a seccomp filter answering `fstat` with EPERM) counts as the same: the last lines of
/// a process under such a filter still go out, where they were all dropped.
pub(crate) fn is_file(fd: c_int, id: (u64, u64)) -> bool {
    match file_identity(fd) {
        Some(now) => now == id,
        None => errno() != libc::EBADF,
    }
}

/// Monotonic nanoseconds.
pub(crate) fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// When the calling process was created (its `fork`; an `exec` keeps it), as Unix time in ns,
/// to the kernel's clock tick (rounded down); `None` if `/proc` does not say.
pub(crate) fn process_start_unix_ns() -> Option<u64> {
    let ticks = process_start_ticks()?;
    // SAFETY: sysconf reads a constant.
    let per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok().filter(|&t| t > 0)?;
    let since_boot = ticks.checked_mul(1_000_000_000)? / per_second;
    let ago = clock_ns(libc::CLOCK_BOOTTIME).checked_sub(since_boot)?;
    clock_ns(libc::CLOCK_REALTIME).checked_sub(ago)
}

/// When the calling process began (its `fork`; an `exec` keeps it), in clock ticks since boot
/// (`/proc/self/stat`'s `starttime`); `None` if `/proc` does not say.
pub(crate) fn process_start_ticks() -> Option<u64> {
    stat_field(&std::fs::read_to_string("/proc/self/stat").ok()?, 22)
}

/// Field `n` (from 1, at least 3) of a `/proc/PID/stat` line, as a number: counted from the
/// 3rd, the first after the command's last `)` (a command may hold spaces and parentheses).
fn stat_field(stat: &str, n: usize) -> Option<u64> {
    stat.rsplit_once(')')?.1.split_whitespace().nth(n.checked_sub(3)?)?.parse().ok()
}

/// The inode of the calling process's pid namespace (`/proc/self/ns/pid` reads `pid:[N]`);
/// `None` if `/proc` does not say.
pub(crate) fn pid_namespace() -> Option<u64> {
    let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
    link.to_str()?.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// 64 random bits from the kernel (the clock's nanoseconds where it has none to give).
pub(crate) fn random_u64() -> u64 {
    let mut bits = [0u8; 8];
    // SAFETY: getrandom writes at most the 8 bytes of `bits`.
    let got = unsafe { libc::getrandom(bits.as_mut_ptr().cast(), bits.len(), libc::GRND_NONBLOCK) };
    if got == bits.len() as isize { u64::from_ne_bytes(bits) } else { monotonic_ns() }
}

/// The CPU time the calling thread has used, in ns (a system call: for rare measurements).
pub(crate) fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// The vDSO's `clock_gettime` (null: not looked up yet, or not found): not the one the
/// process's lookup order finds, which a library preloaded after mallocspy's may define
/// (libfaketime: the trace's times then ran ten times fast under `faketime x10`, and at exit,
/// its destructor run, its wrappers crashed).
static VDSO_CLOCK_GETTIME: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

/// Looks up [`VDSO_CLOCK_GETTIME`], at start: the vDSO's `__vdso_clock_gettime`, which
/// glibc's calls, found in the image the kernel maps (no `dlopen`, whose block of the loader's
/// the leak report counted as the program's, and which a child forked during another thread's
/// `dlopen` must not make).
/// Not when the thread may not read the time-stamp counter, which the vDSO's clocks read: then
/// the system call.
pub(crate) fn warm_up_clock() {
    let vdso = if tsc_readable() { vdso_symbol(b"__vdso_clock_gettime") } else { core::ptr::null_mut() };
    VDSO_CLOCK_GETTIME.store(vdso, Ordering::Release);
}

/// The program made the time-stamp counter unreadable on a thread (`prctl(PR_SET_TSC,
/// PR_TSC_SIGSEGV)`): the clocks are read by the system call from now on, in every thread and
/// for good. The setting is per thread and inherited by the threads it creates: a thread that
/// turned it back on for itself switched the vDSO back in for the others too, and the next
/// sample of a thread it had created died of SIGSEGV (review helper 127). The system call
/// costs only the clocks' readings, a sample's and a statistics event's.
pub(crate) fn clocks_without_tsc() {
    VDSO_CLOCK_GETTIME.store(core::ptr::null_mut(), Ordering::Release);
}

/// Whether the calling thread may read the time-stamp counter: not after `prctl(PR_SET_TSC,
/// PR_TSC_SIGSEGV)` (record-and-replay tools and timing sandboxes use it; a forked child and
/// an `exec`ed image keep it), where reading it raises `SIGSEGV`: every spy's exit killed such
/// a program, in the vDSO's `clock_gettime` (review helper 124).
fn tsc_readable() -> bool {
    let mut state: c_int = 0;
    // SAFETY: PR_GET_TSC writes an int through its pointer; the system call, not the wrapped
    // `prctl`.
    let r = unsafe { libc::syscall(libc::SYS_prctl, libc::PR_GET_TSC, &mut state as *mut c_int) };
    r != 0 || state != libc::PR_TSC_SIGSEGV
}

/// The address of the vDSO's symbol `name`, or null. Read in place, allocating nothing (a
/// process may start under an address-space limit that leaves mallocspy no room).
fn vdso_symbol(name: &[u8]) -> *mut c_void {
    const SHT_DYNSYM: u32 = 11;
    // SAFETY: getauxval only reads the auxiliary vector.
    let base = unsafe { libc::getauxval(libc::AT_SYSINFO_EHDR) } as usize;
    if base == 0 {
        return core::ptr::null_mut();
    }
    // SAFETY: the kernel maps the vDSO whole (its ELF header, program headers, sections and
    // section headers), readable for the process's life; the offsets below are the image's own.
    unsafe {
        let header = &*(base as *const libc::Elf64_Ehdr);
        let at = |offset: u64| base + offset as usize;
        let phdrs = core::slice::from_raw_parts(at(header.e_phoff) as *const libc::Elf64_Phdr, header.e_phnum as usize);
        let Some(linked_at) = phdrs.iter().filter(|p| p.p_type == libc::PT_LOAD).map(|p| p.p_vaddr).min() else {
            return core::ptr::null_mut();
        };
        // The section headers are read only if the pages the kernel mapped hold them.
        let page = page_size() as u64;
        let image_end = phdrs
            .iter()
            .filter(|p| p.p_type == libc::PT_LOAD)
            .map(|p| (p.p_offset + p.p_filesz).div_ceil(page) * page)
            .max();
        let headers_end = header.e_shoff + header.e_shnum as u64 * core::mem::size_of::<libc::Elf64_Shdr>() as u64;
        if header.e_shoff == 0 || image_end.is_none_or(|end| headers_end > end) {
            return core::ptr::null_mut();
        }
        let shdrs = core::slice::from_raw_parts(at(header.e_shoff) as *const libc::Elf64_Shdr, header.e_shnum as usize);
        for dynsym in shdrs.iter().filter(|s| s.sh_type == SHT_DYNSYM) {
            let Some(strtab) = shdrs.get(dynsym.sh_link as usize) else { continue };
            let count = dynsym.sh_size as usize / core::mem::size_of::<libc::Elf64_Sym>();
            let symbols = core::slice::from_raw_parts(at(dynsym.sh_offset) as *const libc::Elf64_Sym, count);
            for symbol in symbols.iter().filter(|s| s.st_value != 0 && (s.st_name as u64) < strtab.sh_size) {
                let symbol_name =
                    CStr::from_ptr(at(strtab.sh_offset + symbol.st_name as u64) as *const core::ffi::c_char);
                if symbol_name.to_bytes() == name {
                    return (base as u64 + symbol.st_value - linked_at) as *mut c_void;
                }
            }
        }
    }
    core::ptr::null_mut()
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    type ClockGettime = unsafe extern "C" fn(libc::clockid_t, *mut libc::timespec) -> c_int;
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    let f = VDSO_CLOCK_GETTIME.load(Ordering::Acquire);
    // SAFETY: clock_gettime writes the timespec; the clocks used here always exist; `f` is
    // the vDSO's clock_gettime, of this signature (it makes the system call for the clocks it
    // does not keep).
    unsafe {
        if f.is_null() {
            // Until then, the kernel's clock itself: the same clock, a little slower.
            libc::syscall(libc::SYS_clock_gettime, clock, &mut ts as *mut libc::timespec);
        } else {
            core::mem::transmute::<*mut c_void, ClockGettime>(f)(clock, &mut ts);
        }
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The process id, straight from the kernel (no libc cache to go stale across `fork`).
#[inline]
pub(crate) fn getpid() -> u32 {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::syscall(libc::SYS_getpid) as u32 }
}

/// This process's pid as `/proc` names it (`/proc/self`): in a pid namespace of its own whose
/// `/proc` is still its parent's (`unshare -pf` without `--mount-proc`), `getpid` gives the
/// pid inside, and `/proc/1` is another process. `getpid`'s where `/proc` says nothing.
pub(crate) fn proc_pid() -> u32 {
    std::fs::read_link("/proc/self").ok().and_then(|pid| pid.to_str()?.parse().ok()).unwrap_or_else(getpid)
}

/// Writes `title` over this process's command line (`/proc/self/cmdline`: what `ps`, `pgrep -f`,
/// `pkill -f` and `pidof` match), cut to the room the arguments had and padded with NULs. For a
/// process forked from another, whose command line is its parent's copy: a forked child's
/// private memory is its own. Nothing changes where `/proc/self/stat` does not say where the
/// arguments lie, or where that is not private writable memory: `PR_SET_MM_ARG_START` may have
/// put them in a read-only mapping, or a shared one, the parent's too.
pub(crate) fn set_command_line(title: &[u8]) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return };
    // The arguments' start and end.
    let (Some(start), Some(end)) = (stat_field(&stat, 48), stat_field(&stat, 49)) else { return };
    let (start, end) = (start as usize, end as usize);
    if start == 0 || end <= start || !private_writable(start, end) {
        return;
    }
    let kept = title.len().min(end - start - 1);
    // SAFETY: [start, end) holds this process's argument strings, in one private writable
    // mapping of its own (checked above), which nothing else here reads.
    unsafe {
        let area = core::slice::from_raw_parts_mut(start as *mut u8, end - start);
        area[..kept].copy_from_slice(&title[..kept]);
        area[kept..].fill(0);
    }
}

/// Whether `[start, end)` lies in one private writable mapping, as `/proc/self/maps` says.
fn private_writable(start: usize, end: usize) -> bool {
    let Ok(maps) = std::fs::read("/proc/self/maps") else { return false };
    maps.split(|&c| c == b'\n').any(|line| {
        let mut fields = line.split(|&c| c == b' ');
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else { return false };
        let Some(dash) = range.iter().position(|&c| c == b'-') else { return false };
        let hex = |s: &[u8]| usize::from_str_radix(core::str::from_utf8(s).ok()?, 16).ok();
        let (Some(from), Some(to)) = (hex(&range[..dash]), hex(&range[dash + 1..])) else { return false };
        from <= start && end <= to && perms.starts_with(b"rw") && perms.get(3) == Some(&b'p')
    })
}

/// The calling thread's kernel id.
#[inline]
pub(crate) fn gettid() -> u32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

/// The definition of `name` in the modules loaded after the caller's (`RTLD_NEXT`), looked
/// up once and kept in `slot`; null if there is none. For the wrappers of libc functions.
pub(crate) fn next_symbol_cached(slot: &AtomicPtr<c_void>, name: &CStr) -> *mut c_void {
    let mut f = slot.load(Ordering::Acquire);
    if f.is_null() {
        // SAFETY: a NUL-terminated name; RTLD_NEXT is valid from a module loaded by ld.so.
        f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
        slot.store(f, Ordering::Release);
    }
    f
}

/// The calling thread's thread pointer.
pub(crate) fn thread_pointer() -> u64 {
    let tp: u64;
    // SAFETY: reads fs:0, the thread pointer, on x86_64 Linux.
    unsafe { core::arch::asm!("mov {}, qword ptr fs:[0]", out(reg) tp, options(nostack, readonly)) };
    tp
}

/// System call `nr` with up to six arguments, without libc: the result, or `-errno` (nothing
/// is written to `errno`, which is thread-local: for code that runs on another task's thread
/// pointer, see `leaks/tracer.rs`).
///
/// # Safety
/// The call, with these arguments, must be sound to make (as for `libc::syscall`).
#[inline]
pub(crate) unsafe fn raw_syscall(nr: libc::c_long, args: [usize; 6]) -> isize {
    let ret: isize;
    // SAFETY: the x86_64 Linux system call convention; the kernel clobbers rcx and r11 only.
    // The caller answers for the call itself.
    unsafe {
        core::arch::asm!(
            "syscall",
            inlateout("rax") nr as isize => ret,
            in("rdi") args[0],
            in("rsi") args[1],
            in("rdx") args[2],
            in("r10") args[3],
            in("r8") args[4],
            in("r9") args[5],
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        )
    };
    ret
}

/// Runs `f` with every signal blocked on the calling thread, then restores its mask.
pub(crate) fn with_signals_blocked<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: sigset_t is plain data; the masks are set and read by the system calls.
    unsafe {
        let mut all: libc::sigset_t = core::mem::zeroed();
        let mut old: libc::sigset_t = core::mem::zeroed();
        libc::sigfillset(&mut all);
        // Added to, not set: glibc's full set lacks the two signals it reserves, which the
        // thread may have blocked (see `thread_sigmask`).
        thread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        let out = f();
        thread_sigmask(libc::SIG_SETMASK, &old, core::ptr::null_mut());
        out
    }
}

/// `/proc/PID/task/TID/LEAF`, NUL-terminated, in `buf`.
pub(crate) fn task_path<'a>(buf: &'a mut [u8; 64], pid: u32, tid: u32, leaf: &[u8]) -> Option<&'a CStr> {
    let (mut p, mut t) = ([0u8; 10], [0u8; 10]);
    proc_path(buf, &[b"/proc/", decimal(pid, &mut p), b"/task/", decimal(tid, &mut t), b"/", leaf])
}

/// `/proc/PID/LEAF`, NUL-terminated, in `buf`.
pub(crate) fn process_path<'a>(buf: &'a mut [u8; 64], pid: u32, leaf: &[u8]) -> Option<&'a CStr> {
    let mut p = [0u8; 10];
    proc_path(buf, &[b"/proc/", decimal(pid, &mut p), b"/", leaf])
}

/// `n` in decimal digits, written at the end of `out`.
fn decimal(mut n: u32, out: &mut [u8; 10]) -> &[u8] {
    let mut i = out.len();
    loop {
        i -= 1;
        out[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &out[i..];
        }
    }
}

/// `parts` one after another, NUL-terminated, in `buf`.
fn proc_path<'a>(buf: &'a mut [u8; 64], parts: &[&[u8]]) -> Option<&'a CStr> {
    let mut len = 0;
    for part in parts {
        buf.get_mut(len..len + part.len())?.copy_from_slice(part);
        len += part.len();
    }
    *buf.get_mut(len)? = 0;
    CStr::from_bytes_with_nul(&buf[..=len]).ok()
}

/// Reads the file at `path` into `buf`: its length, if it opens. Raw system calls only
/// (nothing allocated, no `errno` written), for the tracer too.
pub(crate) fn read_file<'a>(path: &CStr, buf: &'a mut [u8]) -> Option<&'a [u8]> {
    let raw = |nr, args| {
        // SAFETY: openat reads the NUL-terminated path; read writes at most buf.len() bytes
        // into buf; close closes the descriptor opened here (see the calls below).
        unsafe { raw_syscall(nr, args) }
    };
    let flags = (libc::O_RDONLY | libc::O_CLOEXEC) as usize;
    let fd = raw(libc::SYS_openat, [libc::AT_FDCWD as usize, path.as_ptr() as usize, flags, 0, 0, 0]);
    if fd < 0 {
        return None;
    }
    let n = raw(libc::SYS_read, [fd as usize, buf.as_mut_ptr() as usize, buf.len(), 0, 0, 0]);
    raw(libc::SYS_close, [fd as usize, 0, 0, 0, 0, 0]);
    buf.get(..usize::try_from(n).ok()?)
}

/// Gives up the processor while spinning on a lock or a quiescence wait.
#[inline]
pub(crate) fn yield_now() {
    // SAFETY: sched_yield has no preconditions.
    unsafe { libc::sched_yield() };
}

/// Sleeps for about `us` microseconds (a bounded wait's pause between two looks).
pub(crate) fn pause_us(us: u32) {
    let pause =
        libc::timespec { tv_sec: (us / 1_000_000) as libc::time_t, tv_nsec: (us % 1_000_000) as libc::c_long * 1000 };
    // SAFETY: nanosleep with a valid request; no remainder wanted. The system call: libc's
    // may be another preloaded library's (see [`fstat`]).
    unsafe {
        libc::syscall(libc::SYS_nanosleep, &pause as *const libc::timespec, core::ptr::null_mut::<libc::timespec>())
    };
}

/// A loaded module (executable or shared object) as `dl_iterate_phdr` lists it.
pub(crate) struct LoadedModule<'a> {
    /// The load bias: a segment's `p_vaddr` plus this is its address.
    pub bias: u64,
    /// The program headers.
    pub headers: &'a [libc::Elf64_Phdr],
    /// The loader's name of it (its path; empty for the program).
    pub name: &'a core::ffi::CStr,
}

impl LoadedModule<'_> {
    /// `(start, end)` in memory of each `PT_LOAD` segment that has all of `flags` (`PF_X`,
    /// `PF_W`, or 0 for every one).
    pub(crate) fn segments(&self, flags: u32) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.headers.iter().filter(move |p| p.p_type == libc::PT_LOAD && p.p_flags & flags == flags).map(|p| {
            let start = self.bias.wrapping_add(p.p_vaddr);
            (start, start.wrapping_add(p.p_memsz))
        })
    }

    /// The extent of its executable segments, if it has some.
    pub(crate) fn code_extent(&self) -> Option<(u64, u64)> {
        self.segments(libc::PF_X).reduce(|(s, e), (start, end)| (s.min(start), e.max(end)))
    }
}

/// Calls `visit` with each loaded module, in the loader's order, until it returns `true`.
/// Allocates nothing (the loader holds its lock meanwhile: `visit` must not `dlopen`).
pub(crate) fn each_module(mut visit: impl FnMut(&LoadedModule) -> bool) {
    type Visit<'v> = &'v mut dyn FnMut(&LoadedModule) -> bool;
    unsafe extern "C" fn call(info: *mut libc::dl_phdr_info, _: usize, data: *mut core::ffi::c_void) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid info for the duration of the call; data is
        // the `Visit` below.
        let (info, visit) = unsafe { (&*info, &mut *(data as *mut Visit)) };
        if info.dlpi_phdr.is_null() {
            return 0;
        }
        // SAFETY: dlpi_phdr points to dlpi_phnum program headers, valid during the call.
        let headers = unsafe { core::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
        let name = if info.dlpi_name.is_null() {
            c""
        } else {
            // SAFETY: the loader's NUL-terminated name of the module, valid during the call.
            unsafe { core::ffi::CStr::from_ptr(info.dlpi_name) }
        };
        visit(&LoadedModule { bias: info.dlpi_addr, headers, name }) as c_int
    }
    let mut visit: Visit = &mut visit;
    // SAFETY: the callback matches dl_iterate_phdr's contract and only calls `visit`.
    unsafe { libc::dl_iterate_phdr(Some(call), (&raw mut visit).cast()) };
}

/// How many objects the loader has unloaded so far: glibc's `dlpi_subs`, which the `libc`
/// crate's `dl_phdr_info` leaves out; 0 when the loader does not say.
pub(crate) fn objects_unloaded() -> u64 {
    objects_loaded_and_unloaded().1
}

/// How many objects the loader has loaded and unloaded so far (glibc's `dlpi_adds` and
/// `dlpi_subs`): a change says the module list changed. `(0, 0)` when the loader does not say.
pub(crate) fn objects_loaded_and_unloaded() -> (u64, u64) {
    unsafe extern "C" fn call(info: *mut libc::dl_phdr_info, size: usize, data: *mut core::ffi::c_void) -> c_int {
        // glibc's layout: dlpi_addr, dlpi_name, dlpi_phdr, dlpi_phnum (padded to 8 bytes),
        // dlpi_adds, dlpi_subs.
        const ADDS: usize = 32;
        if size >= ADDS + 16 {
            // SAFETY: `size` says the structure dl_iterate_phdr passes holds the words at ADDS
            // and after; `data` is the pair below.
            unsafe {
                let at = (info as *const u8).add(ADDS) as *const u64;
                *(data as *mut (u64, u64)) = (at.read_unaligned(), at.add(1).read_unaligned());
            }
        }
        1
    }
    let mut counts = (0u64, 0u64);
    // SAFETY: the callback matches dl_iterate_phdr's contract and writes only `counts`.
    unsafe { libc::dl_iterate_phdr(Some(call), (&raw mut counts).cast()) };
    counts
}

/// Where a loaded module's code lies, and which module it is: two libraries loaded one after
/// the other at one place may have the same extent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ModuleCode {
    /// Its load bias.
    pub bias: u64,
    /// Its executable segments' extent.
    pub start: u64,
    pub end: u64,
    /// The loader's name of it.
    pub name: std::ffi::CString,
}

/// The code of each loaded module that has some, in the loader's order; `None` when more came
/// than room was made for (a `dlopen` meanwhile, on another thread). Room is made first, names
/// included: nothing allocates while the loader holds its lock.
pub(crate) fn modules_code() -> Option<Vec<ModuleCode>> {
    let (mut modules, mut name_bytes) = (0, 0);
    each_module(|m| {
        modules += 1;
        name_bytes += m.name.to_bytes_with_nul().len();
        false
    });
    // Each module's extent and where its name lies in `names`.
    let mut found: Vec<(u64, u64, u64, core::ops::Range<usize>)> = Vec::with_capacity(modules + 16);
    let mut names: Vec<u8> = Vec::with_capacity(name_bytes + 4096);
    let mut complete = true;
    each_module(|m| {
        let Some((start, end)) = m.code_extent() else { return false };
        let name = m.name.to_bytes_with_nul();
        complete = found.len() < found.capacity() && names.capacity() - names.len() >= name.len();
        if complete {
            found.push((m.bias, start, end, names.len()..names.len() + name.len()));
            names.extend_from_slice(name);
        }
        !complete
    });
    complete.then(|| {
        found
            .into_iter()
            .filter_map(|(bias, start, end, name)| {
                let name = core::ffi::CStr::from_bytes_with_nul(&names[name]).ok()?.to_owned();
                Some(ModuleCode { bias, start, end, name })
            })
            .collect()
    })
}

/// The extent of the executable segments of the module loaded with bias `bias`, if one is.
pub(crate) fn code_extent(bias: u64) -> Option<(u64, u64)> {
    let mut extent = None;
    each_module(|m| {
        if m.bias != bias {
            return false;
        }
        extent = m.code_extent();
        true
    });
    extent
}

/// Whether the module named `name` is loaded with bias `bias` (another one may be loaded
/// there since it was unloaded).
pub(crate) fn is_loaded(bias: u64, name: &core::ffi::CStr) -> bool {
    let mut loaded = false;
    each_module(|m| {
        loaded = m.bias == bias && m.name == name;
        loaded
    });
    loaded
}

/// The lowest mapped address of the module (executable or shared object) that contains
/// `addr`, or 0: equal for two addresses of one module.
///
/// From the loaded segments that `dl_iterate_phdr` lists, not `dladdr`, which also looks for
/// the nearest symbol: a linear search of the module's symbols, some 75,000 instructions in
/// libc.
pub(crate) fn module_of(addr: *const core::ffi::c_void) -> usize {
    module_span(addr).0 & !(page_size() - 1)
}

/// The most address space the process may map, when limited: `ulimit -v`, and `ulimit -d`,
/// which counts private writable mappings too.
pub(crate) fn address_space_limit() -> Option<usize> {
    [libc::RLIMIT_AS, libc::RLIMIT_DATA]
        .into_iter()
        .filter_map(|resource| {
            let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: getrlimit writes the one struct it is given.
            let known = unsafe { libc::getrlimit(resource, &mut limit) } == 0;
            (known && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur as usize)
        })
        .min()
}

/// glibc's `_dl_find_object` (2.35 and later), once [`look_up_objects_later`] found it.
static FIND_OBJECT: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

/// glibc's `struct dl_find_object`, with room to spare: its reserved words are part of it.
#[repr(C)]
struct FoundObject {
    flags: u64,
    map_start: u64,
    map_end: u64,
    link_map: *const u64,
    reserved: [u64; 12],
}

/// Looks up what [`object_at`] calls, where `dlsym` may run (the `dlclose` wrapper): once,
/// found or not (a failed `dlsym` allocates, and leaves its message for the program's next
/// `dlerror`).
pub(crate) fn look_up_objects_later() {
    static LOOKED: AtomicBool = AtomicBool::new(false);
    if !LOOKED.swap(true, Ordering::AcqRel) {
        next_symbol_cached(&FIND_OBJECT, c"_dl_find_object");
    }
}

/// The loaded object whose mapping holds `addr`: its extent, and a hash of which object it is
/// (its load bias, extent and path: the same file loaded again at the same place hashes the
/// same). `None` before [`look_up_objects_later`], under a C library without the lookup,
/// where no object is mapped, and for an object the loader names by a relative path, which
/// names another file from another directory (review helper 130: two `./plug.so` loaded in
/// turn at one place had their stacks merged, and one's leaks named after the other).
/// glibc's lookup for unwinders: no lock, no allocation, safe in a signal handler and in a
/// library's constructor, so the hook path may ask.
pub(crate) fn object_at(addr: u64) -> Option<(u64, u64, u64)> {
    type FindObject = unsafe extern "C" fn(*const c_void, *mut FoundObject) -> c_int;
    let f = FIND_OBJECT.load(Ordering::Acquire);
    if f.is_null() {
        return None;
    }
    let mut found = FoundObject { flags: 0, map_start: 0, map_end: 0, link_map: core::ptr::null(), reserved: [0; 12] };
    // SAFETY: `f` is glibc's `_dl_find_object`, which writes its result into `found` (larger
    // than its structure) and reads nothing else of ours.
    if unsafe { core::mem::transmute::<*mut c_void, FindObject>(f)(addr as *const c_void, &mut found) } != 0
        || found.link_map.is_null()
    {
        return None;
    }
    // SAFETY: glibc's `link_map` starts with `l_addr` (the load bias) and `l_name`, a
    // NUL-terminated string the loader keeps while the object is loaded, as it is: it holds
    // `addr`, which is in a frame of the calling thread's stack.
    let (bias, name) = unsafe { (*found.link_map, *(found.link_map.add(1)) as *const u8) };
    // SAFETY: the loader's name, NUL-terminated (its first byte at least is readable).
    if name.is_null() || unsafe { *name } != b'/' {
        return None;
    }
    let mut hash = 0xCBF2_9CE4_8422_2325u64 ^ bias ^ found.map_start.rotate_left(21) ^ found.map_end.rotate_left(42);
    // FNV-1a over the name, bounded in case the loader's string is not what we think.
    for i in 0..4096 {
        // SAFETY: within the NUL-terminated name (the loop ends at its NUL).
        let byte = unsafe { *name.add(i) };
        if byte == 0 {
            break;
        }
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01B3);
    }
    Some((found.map_start, found.map_end, hash))
}

/// The lowest and highest mapped addresses of the module that contains `addr`, or `(0, 0)`.
pub(crate) fn module_span(addr: *const core::ffi::c_void) -> (usize, usize) {
    let addr = addr as u64;
    let mut span = (0, 0);
    each_module(|m| {
        if !m.segments(0).any(|(start, end)| start <= addr && addr < end) {
            return false;
        }
        let low = m.segments(0).map(|(start, _)| start).min().unwrap_or(m.bias);
        let high = m.segments(0).map(|(_, end)| end).max().unwrap_or(m.bias);
        span = (low as usize, high as usize);
        true
    });
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command with spaces and parentheses of its own does not shift the fields after it.
    #[test]
    fn stat_fields_count_from_the_commands_last_parenthesis() {
        let stat = "4242 (a) b (c) S 1 4242 0 0";
        assert_eq!((stat_field(stat, 4), stat_field(stat, 5), stat_field(stat, 3)), (Some(1), Some(4242), None));
        assert_eq!(stat_field(stat, 2), None);
        let own = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert_eq!(stat_field(&own, 4), Some(u64::from(std::os::unix::process::parent_id())));
    }

    /// The writer's command line is written only in private writable memory: not in a
    /// read-only mapping, nor in a shared one, which its parent sees too.
    #[test]
    fn only_private_writable_memory_takes_a_command_line() {
        let local = [0u8; 64];
        let at = local.as_ptr() as usize;
        assert!(private_writable(at, at + local.len()));
        let constant: &'static [u8] = b"in a read-only segment";
        let at = constant.as_ptr() as usize;
        assert!(!private_writable(at, at + constant.len()));
        // SAFETY: a fresh shared anonymous page, unmapped below.
        let shared = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(shared, libc::MAP_FAILED);
        assert!(!private_writable(shared as usize, shared as usize + 64));
        // SAFETY: the page mapped above.
        unsafe { libc::munmap(shared, 4096) };
    }

    #[test]
    fn the_vdso_clock_is_found_and_reads_the_clocks_libc_reads() {
        warm_up_clock();
        assert!(!VDSO_CLOCK_GETTIME.load(Ordering::Acquire).is_null(), "no __vdso_clock_gettime");
        let libc_ns = |clock| {
            let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // SAFETY: clock_gettime writes the timespec.
            unsafe { libc::clock_gettime(clock, &mut ts) };
            ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
        };
        for clock in [libc::CLOCK_MONOTONIC, libc::CLOCK_REALTIME, libc::CLOCK_THREAD_CPUTIME_ID] {
            let before = libc_ns(clock);
            let ours = clock_ns(clock);
            let after = libc_ns(clock);
            assert!(before <= ours && ours <= after, "clock {clock}: {before} {ours} {after}");
        }
    }

    #[test]
    fn the_process_started_before_now_and_after_boot() {
        let start = process_start_unix_ns().expect("/proc/self/stat");
        let now = clock_ns(libc::CLOCK_REALTIME);
        assert!(start <= now && now - start < 3_600 * 1_000_000_000, "{start} {now}");
        let booted = now - clock_ns(libc::CLOCK_BOOTTIME);
        assert!(start + 1_000_000_000 >= booted, "{start} {booted}");
    }

    /// The trace's queue is mallocspy's memory too (review helper 67: the heap statistics'
    /// `own_bytes` left its 2 MiB out).
    #[test]
    fn shared_mappings_count_as_own_memory() {
        let before = shared_bytes();
        let mapped = map_shared(1 << 20).expect("a shared mapping");
        assert!(owns_shared(mapped.as_ptr() as usize, mapped.as_ptr() as usize + 1));
        assert!(shared_bytes() >= before + (1 << 20), "{before} then {}", shared_bytes());
    }

    fn dladdr_base(addr: *const core::ffi::c_void) -> usize {
        // SAFETY: Dl_info is plain data; dladdr only writes it.
        let mut info: libc::Dl_info = unsafe { core::mem::zeroed() };
        // SAFETY: any address and a valid out-pointer.
        assert_ne!(unsafe { libc::dladdr(addr, &mut info) }, 0);
        info.dli_fbase as usize
    }

    #[test]
    fn pipe_writes_are_whole_lines_of_at_most_the_atomic_size() {
        fn chunks(text: &str, max: usize) -> Vec<&str> {
            line_chunks(text.as_bytes(), max).map(|c| std::str::from_utf8(c).unwrap()).collect()
        }
        assert_eq!(chunks("ab\ncd\nef\n", 6), ["ab\ncd\n", "ef\n"]);
        assert_eq!(chunks("ab\ncd\nef", 5), ["ab\n", "cd\nef"]);
        assert_eq!(chunks("a very long line\nx\n", 4), ["a very long line\n", "x\n"]);
        assert_eq!(chunks("", 4), Vec::<&str>::new());
    }

    #[test]
    fn module_of_names_a_module_by_its_lowest_address_as_dladdr_does() {
        static IN_THE_TEST_BINARY: u64 = 7;
        let ours = module_of(module_of as *const core::ffi::c_void);
        let libc_malloc = libc::malloc as *const core::ffi::c_void;
        assert_eq!(ours, dladdr_base(module_of as *const core::ffi::c_void));
        assert_eq!(module_of(&IN_THE_TEST_BINARY as *const u64 as *const core::ffi::c_void), ours);
        assert_eq!(module_of(libc_malloc), dladdr_base(libc_malloc));
        assert_ne!(module_of(libc_malloc), ours);
        let local = 0u64;
        assert_eq!(module_of(&local as *const u64 as *const core::ffi::c_void), 0, "the stack is no module");
        assert_eq!(module_of(core::ptr::null()), 0);
    }
}
