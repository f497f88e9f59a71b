//! The program's own anonymous mappings, noted as it makes them (`mmap`, `munmap` and
//! `mremap` are wrapped), for the leak scan's roots.
//!
//! The scan takes anonymous memory from `/proc/self/maps` as roots (Python's arenas, a
//! garbage collector's pages, cached thread stacks hold pointers to heap blocks), but leaves
//! out any mapping that holds a live block: that is an allocator's heap, whose free chunks
//! are not roots. The kernel, though, merges neighbouring anonymous mappings of the same
//! protection into one: a program's mapping next to one of glibc's `mmap`ped chunks is one
//! mapping in `/proc/self/maps`, which holds a block, and was left out whole. python3
//! leaving by `os._exit` with 300 bytearrays of 200 KB had all 60 MB of them reported
//! definitely lost (pymalloc's arenas, holding the bytearray objects, lay between the
//! chunks); memcheck, which follows `mmap` calls, calls them still reachable.
//!
//! What the program maps through these functions is its own memory: glibc's allocator maps
//! its chunks and heaps with internal calls, which do not come here, and mallocspy maps its
//! own with the system call. An allocator preloaded after mallocspy does come here: what it
//! maps while a hook is in it is noted as its own, no root (its chunks hold blocks; its
//! metadata, stale addresses of blocks). Noted only while the leak tracker runs, up to
//! [`CAPACITY`] ranges; beyond that, and for a mapping made by a signal handler that
//! interrupted this bookkeeping, the scan falls back on the kernel's map alone.

use core::cell::UnsafeCell;
use core::ffi::c_void;
use core::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use crate::sync::SpinLock;

/// Ranges noted at most: 4 GiB of Python's 1 MiB arenas. The table is static (64 KiB), so
/// that noting never allocates; every process pays its address space, which a program under
/// a tight `ulimit -v` counts (at 256 KiB, `thread_stacks` no longer fitted in 200 MB).
pub(crate) const CAPACITY: usize = 4096;

/// Ranges of the allocator's own noted at most: jemalloc maps its metadata and its chunks a
/// few MiB at a time. Beyond it, a mapping of the allocator's that holds no live block is a
/// root again, as before it was told apart.
const ALLOCATOR_CAPACITY: usize = 256;

/// Page ranges `[start, end)`, in no order.
struct Ranges<const N: usize> {
    list: [(usize, usize); N],
    len: usize,
}

impl<const N: usize> Ranges<N> {
    const EMPTY: Self = Self { list: [(0, 0); N], len: 0 };

    fn noted(&self) -> &[(usize, usize)] {
        &self.list[..self.len]
    }

    /// Notes `[start, end)`, in place of what was noted there (a `MAP_FIXED` mapping replaces
    /// what was mapped).
    fn note(&mut self, start: usize, end: usize) {
        self.forget(start, end);
        self.push((start, end));
    }

    fn push(&mut self, range: (usize, usize)) {
        if self.len < N {
            self.list[self.len] = range;
            self.len += 1;
        } else {
            OVERFLOWED.store(true, Ordering::Relaxed);
        }
    }

    /// Forgets `[start, end)`: ranges inside it go, ranges across its ends are cut.
    fn forget(&mut self, start: usize, end: usize) {
        let mut i = 0;
        while i < self.len {
            let (s, e) = self.list[i];
            if e <= start || end <= s {
                i += 1;
                continue;
            }
            match (s < start, end < e) {
                (false, false) => {
                    self.len -= 1;
                    self.list[i] = self.list[self.len];
                    continue;
                }
                (true, false) => self.list[i].1 = start,
                (false, true) => self.list[i].0 = end,
                (true, true) => {
                    self.list[i].1 = start;
                    self.push((end, e));
                }
            }
            i += 1;
        }
    }

    fn holds(&self, addr: usize) -> bool {
        self.noted().iter().any(|&(s, e)| s <= addr && addr < e)
    }
}

/// The program's mappings, and the allocator's.
struct Noted {
    program: Ranges<CAPACITY>,
    /// Mapped by the allocator after mallocspy while a hook was in it.
    allocator: Ranges<ALLOCATOR_CAPACITY>,
}

struct Table {
    lock: SpinLock,
    noted: UnsafeCell<Noted>,
}

// SAFETY: `noted` is read and written only under `lock`.
unsafe impl Sync for Table {}

static TABLE: Table =
    Table { lock: SpinLock::new(), noted: UnsafeCell::new(Noted { program: Ranges::EMPTY, allocator: Ranges::EMPTY }) };
/// Whether a range could not be noted (the table was full). For a debugger's eyes.
static OVERFLOWED: AtomicBool = AtomicBool::new(false);

/// Runs `f` on the table, unless the calling thread holds its lock already (a signal handler
/// interrupted it): then the change is not noted.
fn with_table<R>(f: impl FnOnce(&mut Noted) -> R) -> Option<R> {
    let _guard = TABLE.lock.try_lock().ok()?;
    // SAFETY: the lock is held.
    Some(f(unsafe { &mut *TABLE.noted.get() }))
}

fn page_end(start: usize, len: usize) -> usize {
    start.saturating_add(len).next_multiple_of(crate::os::page_size())
}

fn tracking() -> bool {
    crate::spies::leaks::tracker().is_some()
}

/// Notes that `[start, start + len)` was mapped, anonymous and private: by the allocator
/// after mallocspy when a hook is in it on this thread (its metadata: jemalloc's thread
/// caches keep the addresses of blocks they handed out, stale, and as roots they kept blocks
/// leaked since "reachable"), else by the program.
pub(crate) fn mapped(start: usize, len: usize) {
    if !tracking() {
        return;
    }
    let end = page_end(start, len);
    // Not under glibc, whose allocator maps with internal calls: a mapping made there inside
    // an allocator call is a signal handler's that interrupted it (a profiler's buffer), and
    // the program's (review helper 98).
    let by_allocator =
        crate::tls::state().depth.get() == crate::tls::IN_REAL_ALLOCATOR && !crate::global::GLOBAL.heap.is_glibc();
    with_table(|noted| {
        if by_allocator {
            noted.program.forget(start, end);
            noted.allocator.note(start, end);
        } else {
            noted.allocator.forget(start, end);
            noted.program.note(start, end);
        }
    });
}

/// Notes that `[start, start + len)` was unmapped (or a file mapped over it).
pub(crate) fn unmapped(start: usize, len: usize) {
    if !tracking() {
        return;
    }
    let end = page_end(start, len);
    with_table(|noted| {
        noted.program.forget(start, end);
        noted.allocator.forget(start, end);
    });
}

/// The ranges noted, each list sorted.
#[derive(Default)]
pub(crate) struct Snapshot {
    /// Mapped by the program.
    pub program: Vec<(u64, u64)>,
    /// Mapped by the allocator after mallocspy, inside an allocator call.
    pub allocator: Vec<(u64, u64)>,
}

/// The ranges noted. Takes the table's lock: not while other threads are stopped.
pub(crate) fn snapshot() -> Snapshot {
    let sorted = |ranges: &[(usize, usize)]| {
        let mut out: Vec<(u64, u64)> = ranges.iter().map(|&(s, e)| (s as u64, e as u64)).collect();
        out.sort_unstable();
        out
    };
    with_table(|noted| Snapshot { program: sorted(noted.program.noted()), allocator: sorted(noted.allocator.noted()) })
        .unwrap_or_default()
}

/// Child side of `fork`: a thread that held the lock is not in the child.
pub(crate) fn after_fork_child() {
    TABLE.lock.force_unlock();
}

type Mmap = unsafe extern "C" fn(*mut c_void, usize, i32, i32, i32, i64) -> *mut c_void;
type Munmap = unsafe extern "C" fn(*mut c_void, usize) -> i32;
type Mremap = unsafe extern "C" fn(*mut c_void, usize, usize, i32, *mut c_void) -> *mut c_void;

static NEXT_MMAP: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());
static NEXT_MUNMAP: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());
static NEXT_MREMAP: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

/// Looks up libc's functions at start: a successful `dlsym` clears the thread's `dlerror`
/// state, and a lookup at the program's first `mmap` lost the message of a `dlopen` that
/// had just failed.
pub(crate) fn warm_up() {
    for (next, name) in [(&NEXT_MMAP, c"mmap"), (&NEXT_MUNMAP, c"munmap"), (&NEXT_MREMAP, c"mremap")] {
        crate::os::next_symbol_cached(next, name);
    }
}

/// `mmap`: libc's, then the range is noted if it is anonymous and private, and forgotten if
/// a file or shared memory was mapped over it.
///
/// # Safety
/// As `mmap`.
pub(crate) unsafe fn mmap(addr: *mut c_void, len: usize, prot: i32, flags: i32, fd: i32, offset: i64) -> *mut c_void {
    let f = crate::os::next_symbol_cached(&NEXT_MMAP, c"mmap");
    let p = if f.is_null() {
        // SAFETY: the raw system call, with the caller's arguments.
        unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, offset) as *mut c_void }
    } else {
        // SAFETY: libc's mmap has this signature; the caller's guarantee covers the arguments.
        unsafe { core::mem::transmute::<*mut c_void, Mmap>(f)(addr, len, prot, flags, fd, offset) }
    };
    if p != libc::MAP_FAILED {
        let private_anonymous = libc::MAP_ANONYMOUS | libc::MAP_PRIVATE;
        if flags & private_anonymous == private_anonymous {
            mapped(p as usize, len);
        } else if flags & libc::MAP_FIXED != 0 {
            unmapped(p as usize, len);
        }
    }
    p
}

/// `munmap`: libc's, then the range is forgotten.
///
/// # Safety
/// As `munmap`.
pub(crate) unsafe fn munmap(addr: *mut c_void, len: usize) -> i32 {
    let f = crate::os::next_symbol_cached(&NEXT_MUNMAP, c"munmap");
    let status = if f.is_null() {
        // SAFETY: the raw system call, with the caller's arguments.
        unsafe { libc::syscall(libc::SYS_munmap, addr, len) as i32 }
    } else {
        // SAFETY: libc's munmap has this signature; the caller's guarantee covers the arguments.
        unsafe { core::mem::transmute::<*mut c_void, Munmap>(f)(addr, len) }
    };
    if status == 0 {
        unmapped(addr as usize, len);
    }
    status
}

/// `mremap`: libc's, then a noted range moves or changes size with its mapping.
/// `new_address` is the variadic argument, read by libc only with `MREMAP_FIXED` (on x86_64
/// a variadic integer argument arrives in the register a fifth parameter does).
///
/// # Safety
/// As `mremap`.
pub(crate) unsafe fn mremap(
    old: *mut c_void,
    old_len: usize,
    new_len: usize,
    flags: i32,
    new_address: *mut c_void,
) -> *mut c_void {
    let f = crate::os::next_symbol_cached(&NEXT_MREMAP, c"mremap");
    let p = if f.is_null() {
        // SAFETY: the raw system call, with the caller's arguments.
        unsafe { libc::syscall(libc::SYS_mremap, old, old_len, new_len, flags, new_address) as *mut c_void }
    } else {
        // SAFETY: libc's mremap has this signature for these arguments; the caller's
        // guarantee covers them.
        unsafe { core::mem::transmute::<*mut c_void, Mremap>(f)(old, old_len, new_len, flags, new_address) }
    };
    if p != libc::MAP_FAILED && tracking() {
        let (old, new) = (old as usize, p as usize);
        let was_noted = with_table(|noted| noted.program.holds(old) || noted.allocator.holds(old)).unwrap_or(false);
        if flags & libc::MREMAP_DONTUNMAP == 0 {
            unmapped(old, old_len);
        }
        if was_noted {
            mapped(new, new_len);
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn after_forget(list: &[(usize, usize)], start: usize, end: usize) -> Vec<(usize, usize)> {
        let mut ranges = Ranges::<CAPACITY>::EMPTY;
        list.iter().for_each(|&r| ranges.push(r));
        ranges.forget(start, end);
        let mut v = ranges.noted().to_vec();
        v.sort_unstable();
        v
    }

    #[test]
    fn forgetting_a_range_removes_cuts_or_splits_the_ranges_it_meets() {
        let list = [(0x1000, 0x3000), (0x5000, 0x9000), (0xa000, 0xb000)];
        assert_eq!(after_forget(&list, 0x5000, 0x9000), [(0x1000, 0x3000), (0xa000, 0xb000)]);
        assert_eq!(after_forget(&list, 0x2000, 0x6000), [(0x1000, 0x2000), (0x6000, 0x9000), (0xa000, 0xb000)]);
        assert_eq!(
            after_forget(&list, 0x6000, 0x7000),
            [(0x1000, 0x3000), (0x5000, 0x6000), (0x7000, 0x9000), (0xa000, 0xb000)]
        );
        assert_eq!(after_forget(&list, 0, 0x10000), []);
        assert_eq!(after_forget(&list, 0x3000, 0x5000), list);
    }
}
