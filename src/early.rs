//! The blocks allocated before mallocspy's constructor ran, kept for the leak tracker.
//!
//! A preloaded library is initialised after the libraries of the program (the loader runs
//! the constructors of a program's dependencies first, and nothing depends on the shim), so
//! their constructors allocate before any spy is registered: `ps` got its text domain's
//! list from libgpg-error's constructor, and the next node, allocated by `ps` itself and
//! reachable only from that untracked block, was reported definitely lost (valgrind sees the
//! first block, LeakSanitizer initialises on the first call). curl made 1,300 calls before
//! ours, gdb 1,400.
//!
//! So, from the process's first call until the first spy is registered, the real
//! allocator's entry points stay the `*_first` functions of `heap.rs` (its `noted` does the
//! same for the aligned allocations), which note each block's address, size, entry point and
//! caller (the address the call returns to: the stack cannot be walked yet) in a table from
//! mallocspy's own memory, and forget it when it is freed. The first registration ends that
//! ([`stop`]); the leak tracker adopts the blocks still live. A process that never registers
//! a spy (one that uses mallocspy's API with an interposer of its own, and no spy yet) stops
//! after [`MAX_CALLS`] calls.
//!
//! The table is lock-free (open addressing on the address, tombstones for frees): the
//! constructors of several libraries may run threads.

use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use crate::pool;
use crate::spy::Entry;

/// Slots of the first table (a power of two, 24 bytes each, touched as they fill); each
/// next table has twice as many. A fixed table of 16k slots missed the nodes of a list of
/// 20,000 that a constructor built: the list broke there, and its tail was called lost.
const FIRST_SLOTS: usize = 1 << 12;
/// Tables at most: 4096 x (2^13 - 1) slots in all.
const TABLES: usize = 13;
/// Slots of a table looked at for an address before the next table is.
const PROBES: usize = 32;
/// Calls noted at most, should no spy ever be registered.
const MAX_CALLS: usize = 1 << 20;
/// A freed slot's address.
const TOMBSTONE: u64 = 1;

#[repr(C)]
struct Slot {
    addr: AtomicU64,
    /// Size in the high 56 bits, entry point in the low 8 (as the leak tracker's records).
    size_entry: AtomicU64,
    caller: AtomicU64,
}

static RECORDING: AtomicBool = AtomicBool::new(true);
static TABLE: [AtomicPtr<Slot>; TABLES] = [const { AtomicPtr::new(core::ptr::null_mut()) }; TABLES];
static CALLS: AtomicUsize = AtomicUsize::new(0);
/// Blocks not noted: every table was full around their address, or mallocspy's memory was.
static MISSED: AtomicUsize = AtomicUsize::new(0);
/// What the calls noted amount to (the leak tracker's totals start from them).
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);
static FREES: AtomicU64 = AtomicU64::new(0);
/// The calls noted by entry point (a `free` of a noted block is one too), and the allocations
/// and their bytes by the ticks spy's kinds (small, large, aligned): `spy=count`'s and the
/// ticks spy's exact totals start from them, as the leak tracker's do.
static ENTRY_CALLS: [AtomicU64; Entry::ALL.len()] = [const { AtomicU64::new(0) }; Entry::ALL.len()];
static KIND_ALLOCS: [AtomicU64; 3] = [const { AtomicU64::new(0) }; 3];
static KIND_BYTES: [AtomicU64; 3] = [const { AtomicU64::new(0) }; 3];

/// Whether calls are still noted.
#[inline]
pub(crate) fn recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

fn slots_of(k: usize) -> usize {
    FIRST_SLOTS << k
}

/// Table `k`, if made; made now if `make`.
fn table(k: usize, make: bool) -> Option<&'static [Slot]> {
    let bytes = slots_of(k) * core::mem::size_of::<Slot>();
    let mut t = TABLE[k].load(Ordering::Acquire);
    if t.is_null() {
        if !make {
            return None;
        }
        let (region, _) = pool::lease_unbounded(bytes)?;
        match TABLE[k].compare_exchange(
            core::ptr::null_mut(),
            region.as_ptr().cast(),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => t = region.as_ptr().cast(),
            Err(other) => {
                // SAFETY: the region was never published.
                unsafe { pool::give_back(region, bytes) };
                t = other;
            }
        }
    }
    // SAFETY: a zeroed region of this table's slots (all-zero atomics are valid), never
    // given back (see `Live`'s drop).
    Some(unsafe { core::slice::from_raw_parts(t, slots_of(k)) })
}

/// The slots `addr` may lie in, in table `t`.
fn probes(t: &[Slot], addr: u64) -> impl Iterator<Item = &Slot> {
    let home = (addr >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) as usize >> (usize::BITS - t.len().trailing_zeros());
    (0..PROBES).map(move |i| &t[(home + i) & (t.len() - 1)])
}

/// The slot noting `addr`, if any.
fn find(addr: u64) -> Option<&'static Slot> {
    (0..TABLES).map_while(|k| table(k, false)).find_map(|t| {
        probes(t, addr)
            .take_while(|s| s.addr.load(Ordering::Relaxed) != 0)
            .find(|s| s.addr.load(Ordering::Relaxed) == addr)
    })
}

/// Counts a call; stops recording past [`MAX_CALLS`].
fn counted() -> bool {
    if CALLS.fetch_add(1, Ordering::Relaxed) < MAX_CALLS {
        return true;
    }
    stop();
    false
}

/// Notes a block of `size` bytes at `ptr` (NULL: none), allocated by `entry` for `caller`.
pub(crate) fn allocated(ptr: *mut core::ffi::c_void, size: usize, entry: Entry, caller: u64) {
    let addr = ptr as u64;
    if addr <= TOMBSTONE || !recording() || !counted() {
        return;
    }
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(size as u64, Ordering::Relaxed);
    ENTRY_CALLS[entry as usize].fetch_add(1, Ordering::Relaxed);
    let aligned =
        matches!(entry, Entry::PosixMemalign | Entry::AlignedAlloc | Entry::Memalign | Entry::Valloc | Entry::Pvalloc);
    let kind = if aligned { crate::gate::ALIGNED } else { crate::gate::kind_of(size) };
    KIND_ALLOCS[kind].fetch_add(1, Ordering::Relaxed);
    KIND_BYTES[kind].fetch_add(size as u64, Ordering::Relaxed);
    note(addr, (size as u64) << 8 | entry as u64, caller);
}

/// Counts a `free` of a block [`freed`] forgot (a `realloc`'s frees are its own call).
pub(crate) fn freed_by_free() {
    ENTRY_CALLS[Entry::Free as usize].fetch_add(1, Ordering::Relaxed);
}

fn note(addr: u64, size_entry: u64, caller: u64) {
    let fill = |slot: &Slot| {
        slot.size_entry.store(size_entry, Ordering::Relaxed);
        slot.caller.store(caller, Ordering::Release);
    };
    // Noted already (a `realloc` of a bootstrap block allocates through `malloc`): once only,
    // or a free would leave a second entry for a block that is gone.
    if let Some(slot) = find(addr) {
        return fill(slot);
    }
    for t in (0..TABLES).map_while(|k| table(k, true)) {
        for slot in probes(t, addr) {
            let seen = slot.addr.load(Ordering::Relaxed);
            let free = seen == 0 || seen == TOMBSTONE;
            if free && slot.addr.compare_exchange(seen, addr, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                return fill(slot);
            }
        }
    }
    MISSED.fetch_add(1, Ordering::Relaxed);
}

/// Forgets the block at `ptr`, freed; returns what was noted of it (size and entry,
/// caller).
pub(crate) fn freed(ptr: *mut core::ffi::c_void) -> Option<(u64, u64)> {
    let addr = ptr as u64;
    if addr <= TOMBSTONE || !recording() || !counted() {
        return None;
    }
    let slot = find(addr)?;
    let noted = (slot.size_entry.load(Ordering::Relaxed), slot.caller.load(Ordering::Acquire));
    slot.addr.compare_exchange(addr, TOMBSTONE, Ordering::AcqRel, Ordering::Relaxed).ok()?;
    FREES.fetch_add(1, Ordering::Relaxed);
    Some(noted)
}

/// Notes again a block [`freed`] forgot, whose `realloc` failed (it is still live).
pub(crate) fn restore(ptr: *mut core::ffi::c_void, (size_entry, caller): (u64, u64)) {
    if recording() {
        FREES.fetch_sub(1, Ordering::Relaxed);
        note(ptr as u64, size_entry, caller);
    }
}

/// Where the call in progress returns to, for a call that came through an export's
/// trampoline (which notes the caller's stack pointer: the return address is there).
pub(crate) fn caller_of_hook() -> u64 {
    let sp = crate::tls::state().entry_sp.get();
    if sp == 0 {
        return 0;
    }
    // SAFETY: the trampoline of the export in progress on this thread noted its caller's
    // stack pointer, where the call pushed the return address; the stack is live.
    unsafe { *(sp as *const u64) }
}

/// Ends the noting (the first spy is registered), and lets the allocator's entry points be
/// the real functions. Returns the blocks still live, to be adopted; `None` when noting had
/// already ended.
pub(crate) fn stop() -> Option<Live> {
    if !RECORDING.swap(false, Ordering::AcqRel) {
        return None;
    }
    // The other half of the resolver's handshake (`NextHeap::resolve_slow`).
    core::sync::atomic::fence(Ordering::SeqCst);
    crate::global::GLOBAL.heap.install_resolved();
    table(0, false)?;
    Some(Live(()))
}

/// The blocks noted and still live when noting ended; gives the tables' pages back when
/// dropped.
pub(crate) struct Live(());

impl Live {
    /// Each block: address, size, entry point (as a byte of [`Entry`]), caller.
    pub(crate) fn for_each(&self, mut visit: impl FnMut(u64, u64, u8, u64)) {
        for t in (0..TABLES).map_while(|k| table(k, false)) {
            for slot in t {
                let addr = slot.addr.load(Ordering::Acquire);
                let size_entry = slot.size_entry.load(Ordering::Relaxed);
                if addr > TOMBSTONE && size_entry != 0 {
                    visit(addr, size_entry >> 8, size_entry as u8, slot.caller.load(Ordering::Acquire));
                }
            }
        }
    }

    /// Blocks that could not be noted (every table was full around their address).
    pub(crate) fn missed(&self) -> usize {
        MISSED.load(Ordering::Relaxed)
    }

    /// Allocations, bytes allocated and frees of noted blocks, those freed included.
    pub(crate) fn totals(&self) -> (u64, u64, u64) {
        (ALLOCS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed), FREES.load(Ordering::Relaxed))
    }

    /// The calls noted, by entry point (indexed as [`Entry::ALL`]).
    pub(crate) fn calls(&self) -> [u64; Entry::ALL.len()] {
        ENTRY_CALLS.each_ref().map(|n| n.load(Ordering::Relaxed))
    }

    /// The allocations noted and their bytes, by the ticks spy's kinds (small, large, aligned).
    pub(crate) fn kinds(&self) -> ([u64; 3], [u64; 3]) {
        (
            KIND_ALLOCS.each_ref().map(|n| n.load(Ordering::Relaxed)),
            KIND_BYTES.each_ref().map(|n| n.load(Ordering::Relaxed)),
        )
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        // A thread may still be noting a block (it read RECORDING just before `stop`): the
        // tables stay leased, their pages given back to the system.
        for (k, t) in (0..TABLES).map_while(|k| table(k, false)).enumerate() {
            let bytes = slots_of(k) * core::mem::size_of::<Slot>();
            // SAFETY: the leased region of table k; MADV_DONTNEED on private anonymous
            // memory only zeroes it.
            unsafe { libc::madvise(t.as_ptr() as *mut libc::c_void, bytes, libc::MADV_DONTNEED) };
        }
    }
}
