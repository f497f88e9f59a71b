//! Interned call stacks: each distinct stack is stored once and named by a 32-bit id.
//!
//! The hook path hashes the return addresses it captured and looks the hash up in a
//! [`LiveTable`]; only a stack never seen before takes the store's lock and is appended.
//! Frames live in chunks leased from [`crate::pool`], never moved, so a stack read at report
//! time is a plain slice. Ids start at 1 (0 means "no stack").

use core::ptr::NonNull;
use core::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use crate::live_table::LiveTable;
use crate::pool;
use crate::sync::SpinLock;

/// Frames per chunk of the store.
const CHUNK_FRAMES: usize = 1 << 16;
/// Most chunks (so at most 64 Mi frames: far beyond any program's distinct stacks).
const MAX_CHUNKS: usize = 1024;
/// Most stacks (the index is leased whole, its pages touched as it fills).
const MAX_STACKS: usize = 1 << 24;

/// Where a stack's frames are: chunk, offset, length.
#[derive(Clone, Copy, Default)]
struct Location {
    chunk: u16,
    len: u16,
    offset: u32,
}

/// The table of interned stacks.
pub(crate) struct Stacks {
    by_hash: LiveTable<u32>,
    lock: SpinLock,
    /// Chunk base addresses (`[u64; CHUNK_FRAMES]` each), `[usize; MAX_CHUNKS]`.
    chunks: AtomicUsize,
    chunk_count: AtomicUsize,
    /// Frames used in the last chunk.
    used: AtomicUsize,
    /// `[Location; MAX_STACKS]`, indexed by id.
    index: AtomicUsize,
    next_id: AtomicU32,
}

/// FNV-1a over the addresses, never 0 (a table key).
fn hash(frames: &[u64]) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &f in frames {
        h = (h ^ f).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= frames.len() as u64;
    (h.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1) as usize
}

impl Stacks {
    pub(crate) const fn new() -> Self {
        Self {
            by_hash: LiveTable::new(),
            lock: SpinLock::new(),
            chunks: AtomicUsize::new(0),
            chunk_count: AtomicUsize::new(0),
            used: AtomicUsize::new(CHUNK_FRAMES),
            index: AtomicUsize::new(0),
            next_id: AtomicU32::new(1),
        }
    }

    /// The id of `frames` (at most `u16::MAX` of them), interning it if new; 0 when mallocspy's
    /// memory is exhausted.
    #[inline]
    pub(crate) fn intern(&self, frames: &[u64]) -> u32 {
        let h = hash(frames);
        if let Some(id) = self.by_hash.get(h) {
            return id;
        }
        self.add(h, frames)
    }

    #[cold]
    fn add(&self, h: usize, frames: &[u64]) -> u32 {
        let _guard = self.lock.lock();
        if let Some(id) = self.by_hash.get(h) {
            return id;
        }
        let len = frames.len().min(u16::MAX as usize);
        let id = self.next_id.load(Ordering::Relaxed);
        if id as usize >= MAX_STACKS {
            return 0;
        }
        if self.index.load(Ordering::Relaxed) == 0 {
            let (Some(index), Some(chunks)) = (
                pool::lease(MAX_STACKS * core::mem::size_of::<Location>()),
                pool::lease(MAX_CHUNKS * core::mem::size_of::<usize>()),
            ) else {
                return 0;
            };
            self.chunks.store(chunks.as_ptr() as usize, Ordering::Release);
            self.index.store(index.as_ptr() as usize, Ordering::Release);
        }
        let mut used = self.used.load(Ordering::Relaxed);
        if used + len > CHUNK_FRAMES {
            let count = self.chunk_count.load(Ordering::Relaxed);
            let Some(chunk) = (count < MAX_CHUNKS).then(|| pool::lease(CHUNK_FRAMES * 8)).flatten() else { return 0 };
            // SAFETY: count < MAX_CHUNKS, the chunk table's length; the lock is held.
            unsafe { *(self.chunks.load(Ordering::Relaxed) as *mut usize).add(count) = chunk.as_ptr() as usize };
            self.chunk_count.store(count + 1, Ordering::Release);
            used = 0;
        }
        let chunk = self.chunk_count.load(Ordering::Relaxed) - 1;
        let Some(base) = self.chunk_base(chunk) else { return 0 };
        // SAFETY: used + len <= CHUNK_FRAMES, inside the chunk; these frames are not yet
        // published, so nobody reads them.
        unsafe { core::ptr::copy_nonoverlapping(frames.as_ptr(), base.as_ptr().add(used), len) };
        let location = Location { chunk: chunk as u16, len: len as u16, offset: used as u32 };
        // SAFETY: id < MAX_STACKS, the index's length; published below with Release.
        unsafe { *(self.index.load(Ordering::Relaxed) as *mut Location).add(id as usize) = location };
        self.used.store(used + len, Ordering::Relaxed);
        self.next_id.store(id + 1, Ordering::Release);
        if !self.by_hash.insert(h, id) {
            return 0;
        }
        id
    }

    fn chunk_base(&self, chunk: usize) -> Option<NonNull<u64>> {
        // SAFETY: chunk < chunk_count <= MAX_CHUNKS, and published chunk slots hold leased,
        // never-returned chunks.
        let addr = unsafe { *(self.chunks.load(Ordering::Acquire) as *const usize).add(chunk) };
        NonNull::new(addr as *mut u64)
    }

    /// The frames of stack `id` (empty for 0 or an unknown id).
    pub(crate) fn frames(&self, id: u32) -> &[u64] {
        if id == 0 || id >= self.next_id.load(Ordering::Acquire) {
            return &[];
        }
        // SAFETY: id was published (next_id is stored after its location, with Release).
        let location = unsafe { *(self.index.load(Ordering::Acquire) as *const Location).add(id as usize) };
        let Some(base) = self.chunk_base(location.chunk as usize) else { return &[] };
        // SAFETY: the frames were written before the id was published and are never changed.
        unsafe { core::slice::from_raw_parts(base.as_ptr().add(location.offset as usize), location.len as usize) }
    }

    /// Number of distinct stacks.
    pub(crate) fn count(&self) -> usize {
        self.next_id.load(Ordering::Acquire) as usize - 1
    }

    /// Bytes of pool memory the stored frames and the hash index hold (the id index is
    /// counted by the pages it touches: 8 bytes a stack).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.chunk_count.load(Ordering::Relaxed) * CHUNK_FRAMES * 8 + self.count() * 8 + self.by_hash.memory_bytes()
    }

    /// Child side of `fork`.
    pub(crate) fn force_unlock(&self) {
        self.lock.force_unlock();
        self.by_hash.force_unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interns_each_distinct_stack_once() {
        let s = Stacks::new();
        let a = s.intern(&[1, 2, 3]);
        let b = s.intern(&[1, 2, 4]);
        assert_ne!(a, b);
        assert_eq!(s.intern(&[1, 2, 3]), a);
        assert_eq!(s.frames(a), &[1, 2, 3]);
        assert_eq!(s.frames(b), &[1, 2, 4]);
        assert_eq!(s.frames(0), &[] as &[u64]);
        let many: Vec<u32> = (0..100_000u64).map(|i| s.intern(&[i, i * 3, 7])).collect();
        assert_eq!(s.count(), 2 + 100_000);
        assert_eq!(s.frames(many[77_777]), &[77_777, 233_331, 7]);
    }
}
