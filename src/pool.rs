//! mallocspy's own memory: regions of anonymous mappings, leased and returned like the slabs
//! of Kestrel's `MemoryPool` (a lease takes a region from the pool, or maps a new one when
//! the pool has none of that size; a return puts it back for the next lease).
//!
//! Nothing of mallocspy's bookkeeping (live-block tables, stack tables, per-thread records)
//! comes from the heap it watches, so watching never changes the target's heap layout, and
//! the memory mallocspy costs is counted here, exactly. Regions are carved from a few large
//! reservations (arenas, mapped with `MAP_NORESERVE`, so untouched pages cost nothing), which
//! also lets the leak scan recognise mallocspy's own memory and leave it out of the roots. The
//! pool is bounded: past
//! [`set_limit`] bytes a lease fails, and the caller degrades (the leak tracker stops
//! recording new blocks and says so in its report; a thread that gets no slot or record goes
//! unspied) instead of growing without end. The first refusal is said on the report's output.

use core::fmt::Write;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::line::Line;
use crate::sync::SpinLock;
use crate::{os, sink};

/// Smallest region: one page.
const MIN_SHIFT: u32 = 12;
/// Size classes: 4 KiB, 8 KiB, ... 2^(MIN_SHIFT + CLASSES - 1).
const CLASSES: usize = 36;

struct Class {
    lock: SpinLock,
    /// Free regions of this size, linked through their first word.
    free: AtomicUsize,
}

static FREE: [Class; CLASSES] = [const { Class { lock: SpinLock::new(), free: AtomicUsize::new(0) } }; CLASSES];

/// Size of the first arena; each next one is twice the last, up to [`MAX_ARENA`] (a region
/// larger than its arena gets an arena of its own). What is reserved and not yet carved is
/// then about as much as what is carved at most: a limit the program sets on its address
/// space or data while it runs (`setrlimit`, `ulimit -v` in a forked shell) counts the
/// reservations, and one of 1 GiB left the program no room under any limit below about
/// 1.1 GB (review helper 128: python3 limited to 1 GiB raised `MemoryError` at once).
const FIRST_ARENA: usize = 4 << 20;
/// Largest arena.
const MAX_ARENA: usize = 1 << 30;
/// Size of an arena once the address space is limited (see [`carve`]).
pub(crate) const SMALL_ARENA: usize = 2 << 20;
/// Set once the kernel refused an arena (see [`carve`]).
static SMALL_ARENAS: AtomicBool = AtomicBool::new(false);
const MAX_ARENAS: usize = 1024;

/// The reservations regions are carved from: `(start, length)`, published by `ARENAS_LEN`.
static ARENA_START: [AtomicUsize; MAX_ARENAS] = [const { AtomicUsize::new(0) }; MAX_ARENAS];
static ARENA_LEN: [AtomicUsize; MAX_ARENAS] = [const { AtomicUsize::new(0) }; MAX_ARENAS];
static ARENAS_LEN: AtomicUsize = AtomicUsize::new(0);
/// Bytes carved from the current (last) arena, under `CARVE`.
static CARVE: SpinLock = SpinLock::new();
static CARVED: AtomicUsize = AtomicUsize::new(0);
/// Bytes mapped by the pool (leased or free).
static MAPPED: AtomicUsize = AtomicUsize::new(0);
/// Bytes leased and not returned.
static LEASED: AtomicUsize = AtomicUsize::new(0);
static LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);
/// Set at the first lease the limit refused.
static REFUSED: AtomicBool = AtomicBool::new(false);
/// Set while the spies are made: a refusal is then left to [`unsaid`]'s caller to say.
static QUIET: AtomicBool = AtomicBool::new(false);
/// Set when the limit refused a lease while [`QUIET`] was.
static REFUSED_QUIETLY: AtomicBool = AtomicBool::new(false);

/// The region size and class a request of `bytes` gets.
fn class_of(bytes: usize) -> Option<(usize, usize)> {
    let size = bytes.max(1).checked_next_power_of_two()?.max(1 << MIN_SHIFT);
    let class = (size.trailing_zeros() - MIN_SHIFT) as usize;
    (class < CLASSES).then_some((size, class))
}

/// Leases a zeroed region of at least `bytes`; `None` past the limit or when the kernel
/// refuses. Return it with [`give_back`] and the same `bytes`.
pub(crate) fn lease(bytes: usize) -> Option<NonNull<u8>> {
    lease_region(bytes, true).map(|(region, _)| region)
}

/// Leases a zeroed region of at least `bytes`, past the limit too (for mallocspy's own heap,
/// whose reports must not fail); also returns its size. `None` when the kernel refuses.
pub(crate) fn lease_unbounded(bytes: usize) -> Option<(NonNull<u8>, usize)> {
    lease_region(bytes, false)
}

fn lease_region(bytes: usize, bounded: bool) -> Option<(NonNull<u8>, usize)> {
    let (size, class) = class_of(bytes)?;
    let c = &FREE[class];
    {
        let _guard = c.lock.lock();
        let head = c.free.load(Ordering::Relaxed);
        if let Some(region) = NonNull::new(head as *mut u8) {
            // SAFETY: a free region's first word links to the next free region of its class.
            let next = unsafe { *(head as *const usize) };
            c.free.store(next, Ordering::Relaxed);
            // SAFETY: the region is ours alone now; zero it as a fresh mapping would be (its
            // pages were released on return, so only the first is touched).
            unsafe { *(head as *mut usize) = 0 };
            LEASED.fetch_add(size, Ordering::Relaxed);
            return Some((region, size));
        }
    }
    if bounded && MAPPED.load(Ordering::Relaxed).saturating_add(size) > LIMIT.load(Ordering::Relaxed) {
        say_refused();
        return None;
    }
    let region = carve(size)?;
    MAPPED.fetch_add(size, Ordering::Relaxed);
    LEASED.fetch_add(size, Ordering::Relaxed);
    Some((region, size))
}

/// Cuts a fresh page-aligned region of `size` bytes from the current arena, reserving a new
/// one when it is full.
fn carve(size: usize) -> Option<NonNull<u8>> {
    let _guard = CARVE.lock();
    let n = ARENAS_LEN.load(Ordering::Relaxed);
    if n > 0 {
        let (start, len) = (ARENA_START[n - 1].load(Ordering::Relaxed), ARENA_LEN[n - 1].load(Ordering::Relaxed));
        let carved = CARVED.load(Ordering::Relaxed);
        if carved + size <= len {
            CARVED.store(carved + size, Ordering::Relaxed);
            return NonNull::new((start + carved) as *mut u8);
        }
    }
    if n == MAX_ARENAS {
        return None;
    }
    // A limit on the address space (`ulimit -v`) may refuse a whole arena, although it costs
    // no memory until touched. Then every arena is only as large as its lease needs (or
    // SMALL_ARENA): failing mallocspy's own allocations aborted every process under
    // `ulimit -v 400000`, and reserving whatever the limit still allows would leave the
    // program none. So too under any limit: an arena the limit allowed took that much of
    // the program's room (under `ulimit -v 1200000`, a program that allocates 100 MiB
    // blocks until refused got one, where it gets eleven natively: review helper 115).
    let small = |size: usize| size.max(SMALL_ARENA);
    // Not asked under a seccomp filter that may kill the process for the `prlimit64` the
    // question takes: a program under an allow list (sshd's privilege separation) died of
    // SIGSYS when a sample after its filter grew a table (3 runs in 60). A map the limit
    // refuses then falls back to a small arena, below.
    if !SMALL_ARENAS.load(Ordering::Relaxed) && !crate::seccomp::may_kill() && os::address_space_limit().is_some() {
        SMALL_ARENAS.store(true, Ordering::Relaxed);
    }
    let next = FIRST_ARENA << n.min(MAX_ARENA.trailing_zeros() as usize - FIRST_ARENA.trailing_zeros() as usize);
    let mut len = if SMALL_ARENAS.load(Ordering::Relaxed) { small(size) } else { size.max(next) };
    let arena = match os::map(len) {
        Some(arena) => arena,
        None if len > small(size) => {
            SMALL_ARENAS.store(true, Ordering::Relaxed);
            len = small(size);
            os::map(len)?
        }
        None => return None,
    };
    // Small pages only, no `MADV_HUGEPAGE`: with the kernel's default `defrag=madvise`, a
    // fault in an advised region compacts and zeroes a whole 2 MiB page then and there, in
    // whichever allocator call of the program first touched it. Measured on the benchmarks'
    // machine, advised arenas made `spy=leaks` on python3 22% slower and sqlite3 3%
    // (`spy=ticks` on sqlite3 4%), stalled the first samples of a short run by 30 ms, one run
    // in two, and the exit report of a million blocks by 1.5 s, one run in five; the fewer
    // TLB misses saved 15% of that report's median at best.
    ARENA_START[n].store(arena.as_ptr() as usize, Ordering::Relaxed);
    ARENA_LEN[n].store(len, Ordering::Relaxed);
    ARENAS_LEN.store(n + 1, Ordering::Release);
    CARVED.store(size, Ordering::Relaxed);
    Some(arena)
}

/// Whether `bytes` more could be leased now: the current arena has that much left to carve,
/// or the kernel would map that much more (a mapping made and unmapped at once, untouched).
/// Only a limited address space (`ulimit -v`) or a strict commit limit says no.
pub(crate) fn has_room(bytes: usize) -> bool {
    {
        let _guard = CARVE.lock();
        let n = ARENAS_LEN.load(Ordering::Relaxed);
        if n > 0 && ARENA_LEN[n - 1].load(Ordering::Relaxed).saturating_sub(CARVED.load(Ordering::Relaxed)) >= bytes {
            return true;
        }
    }
    let Some(room) = os::map(bytes) else { return false };
    // SAFETY: the mapping was made just above, and nothing else knows of it.
    unsafe { os::unmap(room, bytes) };
    true
}

/// Whether `[start, end)` overlaps memory of the pool.
pub(crate) fn owns(start: u64, end: u64) -> bool {
    (0..ARENAS_LEN.load(Ordering::Acquire)).any(|i| {
        let (s, l) = (ARENA_START[i].load(Ordering::Relaxed) as u64, ARENA_LEN[i].load(Ordering::Relaxed) as u64);
        start < s + l && s < end
    })
}

/// The lowest address of the pool's memory strictly between `start` and `end`, if any: where
/// a range reaching up from `start` must stop to leave mallocspy's memory out.
pub(crate) fn first_owned_above(start: u64, end: u64) -> Option<u64> {
    (0..ARENAS_LEN.load(Ordering::Acquire))
        .map(|i| ARENA_START[i].load(Ordering::Relaxed) as u64)
        .filter(|&s| start < s && s < end)
        .min()
}

/// Returns a region leased for `bytes`. Its pages go back to the kernel (but under a seccomp
/// filter that may kill); the mapping stays in the pool for the next lease of its size.
///
/// # Safety
/// `region` came from [`lease`] with the same `bytes` and nothing uses it any more.
pub(crate) unsafe fn give_back(region: NonNull<u8>, bytes: usize) {
    let Some((size, class)) = class_of(bytes) else { return };
    // Not under a filter that may kill for `madvise` (universal-ctags's sandbox, where a free
    // under the guard died of SIGSYS); and it fails on locked pages (`mlockall`) or under a
    // filter that refuses it: the pages then stay, zeroed by hand for the next lease (the
    // `bytes` its lease asked for: no more was written).
    // SAFETY: the caller's guarantee: the whole region is ours and unused.
    if crate::seccomp::may_kill() || unsafe { libc::madvise(region.as_ptr().cast(), size, libc::MADV_DONTNEED) } != 0 {
        // SAFETY: as above.
        unsafe { core::ptr::write_bytes(region.as_ptr(), 0, bytes.min(size)) };
    }
    let c = &FREE[class];
    let _guard = c.lock.lock();
    // SAFETY: as above; the first word becomes the free-list link.
    unsafe { *(region.as_ptr() as *mut usize) = c.free.load(Ordering::Relaxed) };
    c.free.store(region.as_ptr() as usize, Ordering::Relaxed);
    LEASED.fetch_sub(size, Ordering::Relaxed);
}

/// Says, once, that the limit refused a lease. What a caller then leaves out (a thread with no
/// slot or record is not spied at all, so `spy=ticks` under a small `max_memory` counted no
/// allocation) would otherwise go without a word.
pub(crate) fn say_refused() {
    if QUIET.load(Ordering::Relaxed) {
        REFUSED_QUIETLY.store(true, Ordering::Relaxed);
        return;
    }
    if !REFUSED.swap(true, Ordering::Relaxed) {
        let mut line = Line::<200>::new();
        let _ = write!(line, "mallocspy: ");
        write_limit(&mut line);
        let _ = writeln!(line, " reached: what does not fit from here on goes unspied");
        sink::write(line.as_bytes());
    }
}

/// Writes the limit as the lines about it name it: `max_memory (N bytes...)`.
pub(crate) fn write_limit(out: &mut impl Write) {
    let why = match LIMIT_FROM_RLIMIT.load(Ordering::Relaxed) {
        true => ", a quarter of the process's address-space limit (ulimit -v or -d)",
        false => "",
    };
    let _ = write!(out, "max_memory ({} bytes{why})", LIMIT.load(Ordering::Relaxed));
}

/// Runs `make` with the limit's refusals unsaid, and says whether it refused one meanwhile:
/// the spies are made so, and when they do not fit in the limit the caller says that in one
/// line, not in a line about the limit and another about the spies.
pub(crate) fn unsaid<T>(make: impl FnOnce() -> T) -> (T, bool) {
    QUIET.store(true, Ordering::Relaxed);
    let made = make();
    QUIET.store(false, Ordering::Relaxed);
    (made, REFUSED_QUIETLY.swap(false, Ordering::Relaxed))
}

/// Caps the bytes the pool may map (leases past it fail); `from_rlimit`: the cap is a share
/// of the process's address-space limit, not a `max_memory` given.
pub(crate) fn set_limit(bytes: usize, from_rlimit: bool) {
    LIMIT.store(bytes, Ordering::Relaxed);
    LIMIT_FROM_RLIMIT.store(from_rlimit, Ordering::Relaxed);
}

/// Whether [`LIMIT`] is a share of the process's address-space limit.
static LIMIT_FROM_RLIMIT: AtomicBool = AtomicBool::new(false);

/// Bytes mapped by the pool, and bytes of them leased.
pub(crate) fn usage() -> (usize, usize) {
    (MAPPED.load(Ordering::Relaxed), LEASED.load(Ordering::Relaxed))
}

/// Child side of `fork`: no other thread survived to hold a class lock.
pub(crate) fn force_unlock() {
    for c in &FREE {
        c.lock.force_unlock();
    }
    CARVE.force_unlock();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_reused_after_return_and_counted() {
        let a = lease(5000).unwrap();
        // SAFETY: a is an 8 KiB region of ours.
        unsafe { a.as_ptr().write_bytes(7, 8192) };
        let (_, leased) = usage();
        assert!(leased >= 8192);
        // SAFETY: a came from lease(5000) and is unused now.
        unsafe { give_back(a, 5000) };
        let b = lease(8000).unwrap();
        assert_eq!(a, b, "the returned region is leased again");
        // SAFETY: b is an 8 KiB region of ours.
        assert!(unsafe { core::slice::from_raw_parts(b.as_ptr(), 8192) }.iter().all(|&x| x == 0), "zeroed");
        // SAFETY: as above.
        unsafe { give_back(b, 8000) };
        assert!(owns(b.as_ptr() as u64, b.as_ptr() as u64 + 1));
        assert!(!owns(0x1000, 0x2000));
        assert_eq!(class_of(1), Some((4096, 0)));
        assert_eq!(class_of(4097), Some((8192, 1)));
    }

    #[test]
    fn a_range_reaching_into_the_pool_stops_where_its_memory_starts() {
        // An arena, for sure.
        lease(4096).unwrap();
        let arena = ARENA_START[0].load(Ordering::Relaxed) as u64;
        assert_eq!(first_owned_above(arena - 4096, arena + 4096), Some(arena));
        assert_eq!(first_owned_above(arena - 4096, arena), None, "ends below it");
        assert_eq!(first_owned_above(arena, arena + 4096), None, "starts in it");
    }
}
