//! Where the guard's findings were made: each distinct call stack of a finding, with its kind
//! and how often, kept as raw return addresses for the exit report to name.
//!
//! A finding is reported in a hook, where nothing may be symbolized (the symbolizer allocates,
//! reads files and takes locks: see `interposer-pitfalls.md`), so the line said then names
//! only the calling module and offset; the stacks are named once, at exit, as valgrind and
//! AddressSanitizer name theirs. Recording takes no lock: a site is claimed by a
//! compare-and-swap of its key, and filled before it is marked ready.

use core::ptr::NonNull;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::pool;

/// Distinct sites kept; findings at further sites are counted, not located.
const SITES: usize = 256;
/// Frames kept of each site's stack, innermost first.
pub(crate) const DEPTH: usize = 24;

#[repr(C)]
struct Site {
    /// A hash of the kind and the frames; 0 while the site is free.
    key: AtomicU64,
    count: AtomicU64,
    /// The order of the site's first finding among all findings (for the report's order).
    first: AtomicU64,
    /// 1 once `kind`, `depth` and `frames` are written.
    ready: AtomicU32,
    kind: AtomicU32,
    depth: AtomicU32,
    frames: [AtomicU64; DEPTH],
    /// Each frame's module when it was found, as [`Module`] says.
    modules: [[AtomicU64; 2]; DEPTH],
}

/// Which module held a frame when it was found: its load bias and a hash of its name; `(0, 0)`
/// when not known. A library unloaded since, or another loaded where it was, does not name it.
pub(crate) type Module = (u64, u64);

/// A site as the report reads it.
pub(crate) struct SiteView {
    pub kind: u32,
    pub count: u64,
    pub frames: Vec<u64>,
    pub modules: Vec<Module>,
}

/// The table of finding sites, in a region of mallocspy's pool (zeroed: every site free).
pub(crate) struct FindingSites {
    sites: NonNull<Site>,
    /// Findings whose site found no room.
    unplaced: AtomicU64,
}

// SAFETY: the sites are atomics in a mapping that lives as long as the table.
unsafe impl Send for FindingSites {}
// SAFETY: as above.
unsafe impl Sync for FindingSites {}

impl FindingSites {
    /// An empty table; `None` when its memory cannot be had.
    pub(crate) fn new() -> Option<Self> {
        let sites = pool::lease(SITES * core::mem::size_of::<Site>())?.cast::<Site>();
        Some(Self { sites, unplaced: AtomicU64::new(0) })
    }

    fn site(&self, i: usize) -> &Site {
        // SAFETY: `i % SITES` is inside the leased array, whose zeroed bytes are valid atomics.
        unsafe { &*self.sites.as_ptr().add(i % SITES) }
    }

    /// Counts a finding of `kind` at the stack `frames` (innermost first, at most [`DEPTH`]
    /// kept), whose modules are `modules` (one a frame); `order` is its rank among all findings.
    pub(crate) fn record(&self, kind: u32, frames: &[u64], modules: &[Module], order: u64) {
        let frames = &frames[..frames.len().min(DEPTH)];
        let key = (crate::stacks::hash(frames) ^ u64::from(kind).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
        let at = (key >> 32) as usize;
        for i in at..at + SITES {
            let site = self.site(i);
            let claimed = match site.key.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    site.first.store(order, Ordering::Relaxed);
                    site.kind.store(kind, Ordering::Relaxed);
                    site.depth.store(frames.len() as u32, Ordering::Relaxed);
                    for (slot, &frame) in site.frames.iter().zip(frames) {
                        slot.store(frame, Ordering::Relaxed);
                    }
                    for (slot, &(bias, name)) in site.modules.iter().zip(modules) {
                        slot[0].store(bias, Ordering::Relaxed);
                        slot[1].store(name, Ordering::Relaxed);
                    }
                    site.ready.store(1, Ordering::Release);
                    true
                }
                Err(found) => found == key,
            };
            if claimed {
                site.count.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        self.unplaced.fetch_add(1, Ordering::Relaxed);
    }

    /// The sites recorded, in the order of their first findings, and the findings that found
    /// no site.
    pub(crate) fn sites(&self) -> (Vec<SiteView>, u64) {
        let mut sites: Vec<(u64, SiteView)> = (0..SITES)
            .map(|i| self.site(i))
            .filter(|s| s.ready.load(Ordering::Acquire) == 1)
            .map(|s| {
                let depth = (s.depth.load(Ordering::Relaxed) as usize).min(DEPTH);
                let frames = s.frames[..depth].iter().map(|f| f.load(Ordering::Relaxed)).collect();
                let modules = s.modules[..depth]
                    .iter()
                    .map(|[b, n]| (b.load(Ordering::Relaxed), n.load(Ordering::Relaxed)))
                    .collect();
                let (kind, count) = (s.kind.load(Ordering::Relaxed), s.count.load(Ordering::Relaxed));
                let view = SiteView { kind, count, frames, modules };
                (s.first.load(Ordering::Relaxed), view)
            })
            .collect();
        sites.sort_by_key(|&(first, _)| first);
        (sites.into_iter().map(|(_, view)| view).collect(), self.unplaced.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sites_are_counted_by_kind_and_stack_in_order_of_first_finding() {
        let sites = FindingSites::new().unwrap();
        let m = [(0x7000, 1), (0x8000, 2)];
        sites.record(2, &[0x30, 0x40], &m, 0);
        sites.record(1, &[0x10, 0x20], &m, 1);
        sites.record(2, &[0x30, 0x40], &m, 2);
        sites.record(1, &[0x30, 0x40], &m, 3);
        let (seen, unplaced) = sites.sites();
        let seen: Vec<_> = seen.iter().map(|s| (s.kind, s.count, s.frames.clone())).collect();
        assert_eq!(seen, [(2, 2, vec![0x30, 0x40]), (1, 1, vec![0x10, 0x20]), (1, 1, vec![0x30, 0x40])]);
        assert_eq!(unplaced, 0);
        assert!(sites.sites().0.iter().all(|s| s.modules == m));
    }

    #[test]
    fn findings_past_the_last_site_are_counted() {
        let sites = FindingSites::new().unwrap();
        for i in 0..SITES as u64 + 5 {
            sites.record(0, &[i + 1], &[(0, 0)], i);
        }
        let (seen, unplaced) = sites.sites();
        assert_eq!((seen.len(), unplaced), (SITES, 5));
        assert!(seen.iter().enumerate().all(|(i, s)| s.frames == [i as u64 + 1] && s.count == 1));
    }
}
