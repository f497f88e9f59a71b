//! The addresses the program frees while a leak check runs, from its snapshot of the live
//! blocks until it looks back at them after the scan.
//!
//! The other threads run on until they are stopped, and again once resumed: a block of the
//! snapshot that one of them freed meanwhile has no pointer left at the scan, and is no leak.
//! Its record being gone says so, unless the address was handed out again to the same call
//! site, size and thread, whose new record is the snapshot's to the bit: a loop of
//! `aligned_alloc(4096, 4096)` gets one address back and back, and a program calling `exit`
//! while its threads ran such loops was told of blocks "definitely lost" that it had freed.
//! So while a check runs, every free notes its address here (one load of a flag otherwise).

use core::ptr::NonNull;
use core::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use crate::{pool, threads};

/// Addresses noted per check at most; past them, a check can no longer tell.
const CAPACITY: usize = 1 << 15;

/// [`FreedMeanwhile::state`]: the checks running above this bit, the frees noted below it.
const WATCHER_SHIFT: u32 = 48;
const WATCHER: u64 = 1 << WATCHER_SHIFT;
const NOTED_MASK: u64 = WATCHER - 1;

/// The frees of the running leak checks' time.
pub(crate) struct FreedMeanwhile {
    /// Leak checks running (frees are noted while there is one) and frees noted since the
    /// first of them began (beyond `CAPACITY` too), in one word: a check that starts when
    /// none runs sets both at once. Reset apart, after the count went up, a free noted in
    /// between was overwritten by the next (CI, 2026-12-05: a block freed meanwhile called
    /// lost).
    state: AtomicU64,
    /// `[AtomicUsize; CAPACITY]`, leased at the first check; null until then, or if it could
    /// not be mapped.
    addresses: AtomicPtr<AtomicUsize>,
}

impl FreedMeanwhile {
    pub(crate) const fn new() -> Self {
        Self { state: AtomicU64::new(0), addresses: AtomicPtr::new(core::ptr::null_mut()) }
    }

    /// Notes the free of `ptr` if a check is running. For the hook path: no lock, no
    /// allocation. Called after the free is queued or applied: a check that began after
    /// this load saw it (see [`Self::watch`]).
    #[inline(always)]
    pub(crate) fn note(&self, ptr: usize) {
        threads::light_fence();
        if self.state.load(Ordering::Relaxed) >= WATCHER {
            self.push(ptr);
        }
    }

    #[inline(never)]
    fn push(&self, ptr: usize) {
        let before = self.state.fetch_add(1, Ordering::AcqRel);
        let i = (before & NOTED_MASK) as usize;
        let addresses = self.addresses.load(Ordering::Acquire);
        // A free whose check ended meanwhile notes nothing (it counted in a word the next
        // check resets).
        if before >= WATCHER && i < CAPACITY && !addresses.is_null() {
            // SAFETY: a non-null array has CAPACITY entries (leased in `watch`, never freed).
            unsafe { (*addresses.add(i)).store(ptr, Ordering::Release) };
        }
    }

    /// Starts noting frees, for a check about to take its snapshot. Leases the array the
    /// first time (an `mmap`: not from inside a hook). A free made before this returns and not
    /// noted was queued or applied before its note looked ([`Self::note`]): the snapshot, taken
    /// after, sees it (the asymmetric fence of `threads.rs`; a free that looked before the
    /// count went up and queued after the snapshot was read was called lost).
    pub(crate) fn watch(&self) -> Watch<'_> {
        if self.addresses.load(Ordering::Acquire).is_null()
            && let Some(array) = pool::lease(CAPACITY * core::mem::size_of::<AtomicUsize>())
        {
            // Another check may have leased one first: its array stays, this one is unused.
            let _ = self.addresses.compare_exchange(
                core::ptr::null_mut(),
                array.cast().as_ptr(),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        let mut state = self.state.load(Ordering::Acquire);
        loop {
            let started = if state < WATCHER { WATCHER } else { state + WATCHER };
            match self.state.compare_exchange_weak(state, started, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => state = now,
            }
        }
        threads::heavy_fence();
        Watch { log: self }
    }

    /// The child side of `fork`: a check of the parent's other threads does not go on here.
    pub(crate) fn after_fork_child(&self) {
        self.state.store(0, Ordering::Relaxed);
    }
}

/// A running check's view of [`FreedMeanwhile`].
pub(crate) struct Watch<'a> {
    log: &'a FreedMeanwhile,
}

impl Watch<'_> {
    /// How many frees were noted so far: [`Self::end`] takes those. A check takes them when
    /// it lets the other threads go on: a block they free from then on was not lost at the
    /// scan (it had a pointer, which the scan saw), and while the scan of a large heap runs, a
    /// loop of frees went past the capacity (a lost block whose address came back was then
    /// reported: CI, 2026-12-05). Reads a word: allocates nothing, for a stopped world.
    pub(crate) fn noted(&self) -> usize {
        (self.log.state.load(Ordering::Acquire) & NOTED_MASK) as usize
    }

    /// Stops watching: the first `noted` addresses freed since [`FreedMeanwhile::watch`]
    /// (another check running at once may add some of its own time), sorted; `None` if there
    /// were more than could be noted.
    pub(crate) fn end(self, noted: usize) -> Option<Vec<u64>> {
        let addresses = NonNull::new(self.log.addresses.load(Ordering::Acquire));
        let freed = match addresses {
            Some(array) if noted <= CAPACITY => {
                // SAFETY: the array has CAPACITY entries; each read is atomic (a free noted
                // just now may read 0, which no block has).
                let entries = unsafe { core::slice::from_raw_parts(array.as_ptr(), noted) };
                let mut freed: Vec<u64> = entries.iter().map(|a| a.load(Ordering::Acquire) as u64).collect();
                freed.sort_unstable();
                Some(freed)
            }
            _ => None,
        };
        drop(self);
        freed
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        self.log.state.fetch_sub(WATCHER, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frees_are_noted_only_while_a_check_watches() {
        let log = FreedMeanwhile::new();
        log.note(0x1000);
        let watch = log.watch();
        log.note(0x3000);
        log.note(0x2000);
        let noted = watch.noted();
        log.note(0x5000);
        assert_eq!(watch.end(noted), Some(vec![0x2000, 0x3000]), "those noted before the threads went on");
        log.note(0x4000);
        let watch = log.watch();
        assert_eq!(watch.noted(), 0, "a new check starts with nothing noted");
        let other = log.watch();
        log.note(0x6000);
        drop(other);
        assert_eq!(watch.end(1), Some(vec![0x6000]), "a check that starts while one runs resets nothing");
    }

    #[test]
    fn a_check_that_saw_more_frees_than_it_could_note_cannot_tell() {
        let log = FreedMeanwhile::new();
        let watch = log.watch();
        (1..=CAPACITY + 1).for_each(|i| log.note(i * 16));
        let noted = watch.noted();
        assert_eq!(watch.end(noted), None);
    }
}
