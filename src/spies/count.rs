//! `spy=count`: calls per entry point, bytes requested and failures, as one JSON line at exit.
//!
//! An observer only (it never changes a request). Counters are per thread slot and
//! single-writer, so counting costs plain loads and stores, no atomic read-modify-write; the
//! report sums the slots.

use core::fmt::Write;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU64, Ordering};

use crate::line::Line;
use crate::spy::{Call, Entry, MallocSpy, Role};
use crate::thread_records::bump;
use crate::threads::{self, MAX_THREADS};

/// A thread's calls per entry point: two lines, and 2 MiB for all the slots (with the bytes
/// and failures in the same lines, 16 entry points made it 3 MiB, which the pool rounds up
/// to 4). C23's sized frees count as `free`: two more lines for them would double it.
#[repr(C, align(64))]
struct Calls([AtomicU64; COUNTED]);

/// The entry points counted apart: [`Entry::ALL`] up to the sized frees.
const COUNTED: usize = 16;

/// The counter of `entry`'s calls.
fn counter(entry: Entry) -> usize {
    match entry {
        Entry::FreeSized | Entry::FreeAlignedSized => Entry::Free as usize,
        entry => entry as usize,
    }
}

/// A thread's bytes requested and failed calls, on a line of their own (1 MiB for all the
/// slots): four threads' side by side in one line made every call of each a write to a line
/// the others were writing, and two threads calling `malloc` and `free` in a loop ran 12
/// times slower than natively.
#[repr(C, align(64))]
struct Amounts {
    bytes: AtomicU64,
    failed: AtomicU64,
}

/// One thread's counters.
struct Counters<'a> {
    calls: &'a Calls,
    amounts: &'a Amounts,
}

const _: () = assert!(core::mem::size_of::<Calls>() == 128 && core::mem::size_of::<Amounts>() == 64);

/// Totals over all threads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub calls: [u64; COUNTED],
    pub bytes_requested: u64,
    pub failed: u64,
}

/// The counting spy.
pub(crate) struct CountSpy {
    /// `[Calls; MAX_THREADS]` in an anonymous mapping, indexed by thread slot.
    calls: NonNull<Calls>,
    /// `[Amounts; MAX_THREADS]`, likewise.
    amounts: NonNull<Amounts>,
    /// For calls from a thread that has no slot of this module (never the case for the
    /// built-in spy of the shim; kept so the spy is correct anywhere).
    shared: (Calls, Amounts),
    /// The calls that had gone unspied for want of a thread slot when counting began (at the
    /// start, or in a forked child): more at the end, and the counts are not complete.
    unspied_before: AtomicU64,
}

// SAFETY: the mapping is shared memory of atomics; each slot's counters are written only by
// the thread owning the slot, and read by anyone.
unsafe impl Send for CountSpy {}
// SAFETY: as above.
unsafe impl Sync for CountSpy {}

const fn zeroed() -> (Calls, Amounts) {
    (Calls([const { AtomicU64::new(0) }; COUNTED]), Amounts { bytes: AtomicU64::new(0), failed: AtomicU64::new(0) })
}

impl CountSpy {
    /// A spy with zeroed counters; `None` if the counter table cannot be mapped.
    pub(crate) fn new() -> Option<Self> {
        Some(Self {
            calls: threads::map_per_thread::<Calls>()?,
            amounts: threads::map_per_thread::<Amounts>()?,
            shared: zeroed(),
            unspied_before: AtomicU64::new(threads::unspied_calls()),
        })
    }

    fn slot(&self, index: u32) -> Counters<'_> {
        debug_assert!((index as usize) < MAX_THREADS);
        // SAFETY: index < MAX_THREADS, the mappings' length; zeroed memory is valid atomics.
        unsafe {
            Counters {
                calls: &*self.calls.as_ptr().add(index as usize),
                amounts: &*self.amounts.as_ptr().add(index as usize),
            }
        }
    }

    fn shared(&self) -> Counters<'_> {
        Counters { calls: &self.shared.0, amounts: &self.shared.1 }
    }

    /// Counts the calls made before any spy was registered (the constructors of the program's
    /// libraries run before the shim's: curl makes 1,300 of its 4,606 calls there), as the leak
    /// tracker's totals do: the one allocation of libstdc++'s constructor (72,704 bytes) was
    /// missing from a C++ program's.
    pub(crate) fn count_before(&self, live: &crate::early::Live) {
        let (calls, amounts) = &self.shared;
        for (sum, n) in calls.0.iter().zip(live.calls()) {
            sum.fetch_add(n, Ordering::Relaxed);
        }
        amounts.bytes.fetch_add(live.totals().1, Ordering::Relaxed);
    }

    /// Sums every thread's counters (approximate while other threads still count).
    pub(crate) fn totals(&self) -> Totals {
        let mut t = Totals::default();
        let mut add = |c: Counters| {
            for (sum, n) in t.calls.iter_mut().zip(&c.calls.0) {
                *sum += n.load(Ordering::Relaxed);
            }
            t.bytes_requested = t.bytes_requested.saturating_add(c.amounts.bytes.load(Ordering::Relaxed));
            t.failed += c.amounts.failed.load(Ordering::Relaxed);
        };
        for index in 0..threads::high_water() as u32 {
            add(self.slot(index));
        }
        add(self.shared());
        t
    }

    /// Child side of `fork`: the child counts its own calls.
    pub(crate) fn reset(&self) {
        for c in (0..threads::high_water() as u32).map(|index| self.slot(index)).chain([self.shared()]) {
            let amounts = [&c.amounts.bytes, &c.amounts.failed];
            c.calls.0.iter().chain(amounts).for_each(|n| n.store(0, Ordering::Relaxed));
        }
        self.unspied_before.store(threads::unspied_calls(), Ordering::Relaxed);
    }

    /// The exit report: one JSON object on one line.
    pub(crate) fn report(&self) -> Line<1024> {
        let t = self.totals();
        let mut line = Line::new();
        let _ = line.write_str("{\"calls\":{");
        for (i, entry) in Entry::ALL[..COUNTED].iter().enumerate() {
            let _ = write!(line, "{}\"{}\":{}", if i == 0 { "" } else { "," }, entry.name(), t.calls[i]);
        }
        let _ = write!(line, "}},\"bytes_requested\":{},\"failed\":{}", t.bytes_requested, t.failed);
        // Under a `max_memory` too small, threads with no slot went uncounted: all zeros read
        // as a program that allocated nothing.
        let complete = threads::unspied_calls() == self.unspied_before.load(Ordering::Relaxed);
        let _ = writeln!(line, "{}}}", if complete { "" } else { ",\"complete\":false" });
        line
    }
}

impl MallocSpy for CountSpy {
    fn role(&self) -> Role {
        Role::Observe
    }

    #[inline]
    fn after_call(&self, call: &Call) {
        let bytes = if call.failed { 0 } else { call.size as u64 };
        // SAFETY: a read of a field of a live reference. Volatile so that it stays one byte:
        // LLVM widened it to the word's four, a load the byte just stored cannot forward to.
        let entry = unsafe { core::ptr::read_volatile(&call.entry) };
        match threads::current_index() {
            Some(index) => {
                let c = self.slot(index);
                bump(&c.calls.0[counter(entry)], 1);
                bump(&c.amounts.bytes, bytes);
                if call.failed {
                    bump(&c.amounts.failed, 1);
                }
            }
            None => {
                let (calls, amounts) = &self.shared;
                calls.0[counter(entry)].fetch_add(1, Ordering::Relaxed);
                amounts.bytes.fetch_add(bytes, Ordering::Relaxed);
                amounts.failed.fetch_add(call.failed as u64, Ordering::Relaxed);
            }
        }
    }
}
