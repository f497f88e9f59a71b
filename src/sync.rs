//! A spin lock that never allocates and knows its owner.
//!
//! `std::sync::Mutex` is not usable on the hook path: nothing about it is wrong in itself, but a
//! lock whose owner cannot be asked "is it me?" deadlocks when a signal handler re-enters the
//! allocator on the thread that holds it. This lock records the owning thread, so such a
//! re-entry can back off instead ([`SpinLock::try_lock`] returns [`SelfHeld`]). Fork safety is
//! not this lock's business: no thread is inside a hook when `fork` runs (see
//! [`crate::threads::quiesce`]).

use core::sync::atomic::{AtomicUsize, Ordering};

use crate::{os, tls};

/// A mutual-exclusion lock for short critical sections of the hook path.
pub(crate) struct SpinLock {
    /// 0 when free, else the owner's [`tls::thread_key`].
    owner: AtomicUsize,
}

/// [`SpinLock::try_lock`] failed because the calling thread itself holds the lock (a signal
/// handler interrupted the critical section): waiting would deadlock.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SelfHeld;

impl SpinLock {
    /// A free lock.
    pub(crate) const fn new() -> Self {
        Self { owner: AtomicUsize::new(0) }
    }

    /// Takes the lock, spinning (then yielding) while another thread holds it.
    ///
    /// Must not be called by a thread that may already hold it; the hook path guarantees that
    /// by routing nested calls to [`SpinLock::try_lock`].
    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_> {
        let me = tls::thread_key();
        let mut spins = 0u32;
        loop {
            if self.owner.compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return SpinGuard { lock: self };
            }
            spins += 1;
            if spins < 64 {
                core::hint::spin_loop();
            } else {
                os::yield_now();
            }
        }
    }

    /// Takes the lock if that can be done without deadlock: waits for other threads, but
    /// fails at once when the caller itself holds it.
    pub(crate) fn try_lock(&self) -> Result<SpinGuard<'_>, SelfHeld> {
        let me = tls::thread_key();
        let mut spins = 0u32;
        loop {
            match self.owner.compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Ok(SpinGuard { lock: self }),
                Err(owner) if owner == me => return Err(SelfHeld),
                Err(_) => {
                    spins += 1;
                    if spins < 64 {
                        core::hint::spin_loop();
                    } else {
                        os::yield_now();
                    }
                }
            }
        }
    }

    /// Releases the lock whoever holds it. Only for the child of `fork`, where the holder
    /// may be a thread that no longer exists.
    pub(crate) fn force_unlock(&self) {
        self.owner.store(0, Ordering::Release);
    }

    /// Whether no thread holds the lock now.
    pub(crate) fn is_free(&self) -> bool {
        self.owner.load(Ordering::Acquire) == 0
    }
}

/// Proof that the lock is held; releases it when dropped.
pub(crate) struct SpinGuard<'a> {
    lock: &'a SpinLock,
}

impl Drop for SpinGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        self.lock.owner.store(0, Ordering::Release);
    }
}
