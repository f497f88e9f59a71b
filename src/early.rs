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

use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use crate::pool;
use crate::spy::Entry;

/// Slots of the table (a power of two): 24 bytes each, touched as they fill.
const SLOTS: usize = 1 << 14;
/// Slots looked at for an address before giving up.
const PROBES: usize = 64;
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
static TABLE: AtomicPtr<Slot> = AtomicPtr::new(core::ptr::null_mut());
static CALLS: AtomicUsize = AtomicUsize::new(0);
/// Blocks not noted: the table was full around their address.
static MISSED: AtomicUsize = AtomicUsize::new(0);
/// What the calls noted amount to (the leak tracker's totals start from them).
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);
static FREES: AtomicU64 = AtomicU64::new(0);

/// Whether calls are still noted.
#[inline]
pub(crate) fn recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

fn table() -> Option<&'static [Slot]> {
    let mut t = TABLE.load(Ordering::Acquire);
    if t.is_null() {
        let (region, _) = pool::lease_unbounded(SLOTS * core::mem::size_of::<Slot>())?;
        match TABLE.compare_exchange(core::ptr::null_mut(), region.as_ptr().cast(), Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => t = region.as_ptr().cast(),
            Err(other) => {
                // SAFETY: the region was never published.
                unsafe { pool::give_back(region, SLOTS * core::mem::size_of::<Slot>()) };
                t = other;
            }
        }
    }
    // SAFETY: a zeroed region of SLOTS slots (all-zero atomics are valid), never given back
    // while recording (see `stop`).
    Some(unsafe { core::slice::from_raw_parts(t, SLOTS) })
}

fn home(addr: u64) -> usize {
    (addr >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) as usize >> (usize::BITS - SLOTS.trailing_zeros())
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
    let Some(table) = table() else { return };
    let start = home(addr);
    let note = |slot: &Slot| {
        slot.size_entry.store((size as u64) << 8 | entry as u64, Ordering::Relaxed);
        slot.caller.store(caller, Ordering::Release);
    };
    // Noted already (a `realloc` of a bootstrap block allocates through `malloc`): once only,
    // or a free would leave a second entry for a block that is gone.
    let probes = || (0..PROBES).map(|i| &table[(start + i) % SLOTS]);
    if let Some(slot) =
        probes().take_while(|s| s.addr.load(Ordering::Relaxed) != 0).find(|s| s.addr.load(Ordering::Relaxed) == addr)
    {
        return note(slot);
    }
    for slot in probes() {
        let seen = slot.addr.load(Ordering::Relaxed);
        let free = seen == 0 || seen == TOMBSTONE;
        if free && slot.addr.compare_exchange(seen, addr, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            return note(slot);
        }
    }
    MISSED.fetch_add(1, Ordering::Relaxed);
}

/// Forgets the block at `ptr`, freed (or moved by `realloc`).
pub(crate) fn freed(ptr: *mut core::ffi::c_void) {
    let addr = ptr as u64;
    if addr <= TOMBSTONE || !recording() || !counted() {
        return;
    }
    let Some(table) = table() else { return };
    let start = home(addr);
    for i in 0..PROBES {
        let slot = &table[(start + i) % SLOTS];
        match slot.addr.load(Ordering::Relaxed) {
            0 => return,
            a if a == addr => {
                if slot.addr.compare_exchange(addr, TOMBSTONE, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                    FREES.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
            _ => {}
        }
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
    let table = NonNull::new(TABLE.load(Ordering::Acquire))?;
    Some(Live { table })
}

/// The blocks noted and still live when noting ended; gives the table back when dropped.
pub(crate) struct Live {
    table: NonNull<Slot>,
}

impl Live {
    /// Each block: address, size, entry point (as a byte of [`Entry`]), caller.
    pub(crate) fn for_each(&self, mut visit: impl FnMut(u64, u64, u8, u64)) {
        // SAFETY: the table's SLOTS slots stay leased until `self` is dropped.
        let slots = unsafe { core::slice::from_raw_parts(self.table.as_ptr(), SLOTS) };
        for slot in slots {
            let addr = slot.addr.load(Ordering::Acquire);
            let size_entry = slot.size_entry.load(Ordering::Relaxed);
            if addr > TOMBSTONE && size_entry != 0 {
                visit(addr, size_entry >> 8, size_entry as u8, slot.caller.load(Ordering::Acquire));
            }
        }
    }

    /// Blocks that could not be noted (the table was full around their address).
    pub(crate) fn missed(&self) -> usize {
        MISSED.load(Ordering::Relaxed)
    }

    /// Allocations, bytes allocated and frees of noted blocks, those freed included.
    pub(crate) fn totals(&self) -> (u64, u64, u64) {
        (ALLOCS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed), FREES.load(Ordering::Relaxed))
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        // A thread may still be noting a block (it read RECORDING just before `stop`): the
        // table stays leased, its pages given back to the system.
        let bytes = SLOTS * core::mem::size_of::<Slot>();
        // SAFETY: a range of the leased region; MADV_DONTNEED on private anonymous memory
        // only zeroes it.
        unsafe { libc::madvise(self.table.as_ptr().cast(), bytes, libc::MADV_DONTNEED) };
    }
}
