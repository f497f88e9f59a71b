//! One spy per process: registration, revocation deferred while its blocks live, and the
//! panic firewall around every call into it.
//!
//! `CoRegisterMallocSpy` semantics: registering while a spy is registered (or a revoked one
//! still has live blocks) fails with [`SpyError::AlreadyRegistered`]; revoking while blocks
//! allocated under the spy are live fails with [`SpyError::AccessDenied`] and leaves the revoke
//! pending: the spy keeps receiving the frees and reallocs of its blocks, and is dropped right
//! after the last one is freed.
//!
//! Dropping must also wait for threads still running the spy's code (a Pre method on another
//! core): [`threads::quiesce`] provides that grace period.

use core::panic::AssertUnwindSafe;
use core::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use crate::spy::{MallocSpy, Role, SpyError};
use crate::sync::SpinLock;
use crate::{sink, threads, tls};

/// A spy to register: owned (dropped when the registration ends) or static (the built-in
/// spies, which outlive it for their exit reports).
pub(crate) enum SpyRef {
    Owned(Box<dyn MallocSpy>),
    Static(&'static dyn MallocSpy),
}

/// The registered spy and its lifecycle flags.
pub(crate) struct SpyCell {
    /// The spy itself (a raw pointer so that static and owned spies are called alike, with one
    /// indirect call); owned when `owned`, and then freed by the cell's drop.
    spy: *const dyn MallocSpy,
    owned: bool,
    /// [`MallocSpy::role`] is [`Role::Observe`] (asked once).
    pub(crate) observes: bool,
    /// No new blocks, no calls for unspied blocks: revoked by the program or after a panic.
    revoked: AtomicBool,
    /// The revoke's grace period is over: every allocation that could still add a spied block
    /// has finished, so a live count of zero is final.
    settled: AtomicBool,
    /// Set once by whoever drops the cell.
    retiring: AtomicBool,
    panic_reported: AtomicBool,
    misalign_reported: AtomicBool,
}

/// A spy method panicked; the spy is being disabled.
pub(crate) struct Panicked;

// SAFETY: the spy is `Send + Sync` (the trait's bounds); the flags are atomics.
unsafe impl Send for SpyCell {}
// SAFETY: as above.
unsafe impl Sync for SpyCell {}

impl Drop for SpyCell {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: an owned spy came from Box::into_raw in `register`, and the cell is its
            // only owner.
            drop(unsafe { Box::from_raw(self.spy.cast_mut()) });
        }
    }
}

impl SpyCell {
    /// Whether new calls may use the spy.
    #[inline]
    pub(crate) fn is_active(&self) -> bool {
        !self.revoked.load(Ordering::Acquire)
    }

    /// Runs `f` on the spy, catching a panic: the panic is reported once and the caller falls
    /// back to what it would do without the spy (and disables it).
    #[inline(always)]
    pub(crate) fn call<R>(&self, f: impl FnOnce(&dyn MallocSpy) -> R) -> Result<R, Panicked> {
        // SAFETY: the spy lives as long as the cell (static, or freed by the cell's drop).
        let spy = unsafe { &*self.spy };
        match std::panic::catch_unwind(AssertUnwindSafe(|| f(spy))) {
            // A spy behind the C ABI (a Rust one in another module included, whose panic was
            // caught there) says it failed through the API: as a panic, its answer is unusable.
            // Only a registered spy can: the built-in ones never touch that line of the TLS
            // (it cost the ticks spy a cache miss per sample).
            Ok(_) if self.owned && tls::state().spy_failed.replace(0) != 0 => {
                if !self.panic_reported.swap(true, Ordering::Relaxed) {
                    sink::to_stderr(
                        b"mallocspy: the registered spy failed; it is revoked and the program goes on unspied\n",
                    );
                }
                Err(Panicked)
            }
            Ok(r) => Ok(r),
            Err(payload) => {
                // The payload's own Drop could panic again; a few leaked bytes are the safe side.
                core::mem::forget(payload);
                if !self.panic_reported.swap(true, Ordering::Relaxed) {
                    sink::to_stderr(
                        b"mallocspy: the registered spy panicked; it is revoked and the program goes on unspied\n",
                    );
                }
                Err(Panicked)
            }
        }
    }

    /// Reports once that the spy returned a pointer weaker aligned than the caller is owed.
    pub(crate) fn report_misaligned(&self) {
        if !self.misalign_reported.swap(true, Ordering::Relaxed) {
            sink::to_stderr(
                b"mallocspy: the registered spy returned a misaligned pointer; such allocations are served unspied\n",
            );
        }
    }
}

/// The process's one registration slot.
pub(crate) struct Registry {
    lock: SpinLock,
    cell: AtomicPtr<SpyCell>,
}

impl Registry {
    /// Where the registered spy's pointer lies in a registry (null: none, see
    /// [`Registry::is_empty`]), for the assembly of [`crate::fast_path`].
    pub(crate) const CELL_OFFSET: usize = core::mem::offset_of!(Registry, cell);

    pub(crate) const fn new() -> Self {
        Self { lock: SpinLock::new(), cell: AtomicPtr::new(core::ptr::null_mut()) }
    }

    /// True when no spy is registered and none is pending: the allocator is a pass-through.
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.cell.load(Ordering::Relaxed).is_null()
    }

    /// The registered (or pending) spy. The reference is valid while the caller is inside a
    /// hook marked with [`threads::InFlight`]: dropping waits for such hooks to end.
    #[inline(always)]
    pub(crate) fn current(&self) -> Option<&SpyCell> {
        // SAFETY: a non-null cell is a leaked Box that is freed only after a grace period that
        // outlasts every in-flight hook, which the caller is inside.
        unsafe { self.cell.load(Ordering::Acquire).as_ref() }
    }

    /// Registers the spy `make` builds; `make` runs only once the slot is known to be free,
    /// so a refused spy is never built (a C spy's `release` is not called for nothing).
    pub(crate) fn register(&self, make: impl FnOnce() -> SpyRef) -> Result<(), SpyError> {
        let _guard = self.lock.lock();
        if !self.cell.load(Ordering::Acquire).is_null() {
            return Err(SpyError::AlreadyRegistered);
        }
        let (spy, owned): (*const dyn MallocSpy, bool) = match make() {
            SpyRef::Owned(b) => (Box::into_raw(b), true),
            SpyRef::Static(s) => (s, false),
        };
        // SAFETY: just made from a live Box or a static reference.
        let observes = unsafe { (*spy).role() } == Role::Observe;
        let cell = Box::new(SpyCell {
            spy,
            owned,
            observes,
            revoked: AtomicBool::new(false),
            settled: AtomicBool::new(false),
            retiring: AtomicBool::new(false),
            panic_reported: AtomicBool::new(false),
            misalign_reported: AtomicBool::new(false),
        });
        self.cell.store(Box::into_raw(cell), Ordering::Release);
        Ok(())
    }

    /// Revokes the registered spy. `live` counts the blocks allocated under it; `in_hook`
    /// says the caller is inside a hook (one of the spy's methods, or a callback it runs),
    /// `me` is then its thread slot.
    pub(crate) fn revoke(&self, live: impl Fn() -> usize, in_hook: bool, me: Option<u32>) -> Result<(), SpyError> {
        let _guard = self.lock.lock();
        let Some(cell) = self.current() else { return Err(SpyError::NotRegistered) };
        if !cell.is_active() {
            return Err(SpyError::NotRegistered);
        }
        self.disable(cell, me);
        if in_hook {
            // The hook in progress still uses the spy (its Post method may follow): the spy is
            // dropped when that hook ends (`Interposer::retire`), not here under its feet.
            return if live() == 0 { Ok(()) } else { Err(SpyError::AccessDenied) };
        }
        let cell: *const SpyCell = cell;
        self.retire_if_unused(cell, &live, me);
        if core::ptr::eq(self.cell.load(Ordering::Acquire), cell) { Err(SpyError::AccessDenied) } else { Ok(()) }
    }

    /// Stops new calls from using `cell` and waits for those in flight. Used by revoke and
    /// after a panic; the caller then calls [`Registry::retire_if_unused`] once it no longer
    /// uses `cell`.
    pub(crate) fn disable(&self, cell: &SpyCell, me: Option<u32>) {
        if cell.revoked.swap(true, Ordering::SeqCst) {
            return;
        }
        // Allocations that saw the spy active before the store above may still add blocks.
        threads::quiesce(me);
        cell.settled.store(true, Ordering::SeqCst);
    }

    /// Drops `cell` if it is revoked, settled and has no live block. Called after each free
    /// of a spied block while the revoke is pending, and after a panic disabled the spy.
    /// Nobody may use `cell` afterwards (hence a raw pointer: a reference argument would
    /// outlive the referent).
    pub(crate) fn retire_if_unused(&self, cell: *const SpyCell, live: &impl Fn() -> usize, me: Option<u32>) {
        {
            // SAFETY: still registered: retiring is decided below, by one caller only.
            let flags = unsafe { &*cell };
            if !flags.settled.load(Ordering::SeqCst) || live() != 0 || flags.retiring.swap(true, Ordering::SeqCst) {
                return;
            }
        }
        let ptr = cell.cast_mut();
        if self.cell.compare_exchange(ptr, core::ptr::null_mut(), Ordering::AcqRel, Ordering::Acquire).is_err() {
            return;
        }
        // Threads may still be inside the spy's methods (an unspied free that looked before
        // the revoke); wait for them before dropping.
        threads::quiesce(me);
        // SAFETY: `ptr` came from Box::into_raw in register; it is no longer reachable from
        // the registry, `retiring` makes this the only drop, and quiesce has waited out every
        // hook that could still hold a reference.
        let cell = unsafe { Box::from_raw(ptr) };
        if std::panic::catch_unwind(AssertUnwindSafe(move || drop(cell))).is_err() {
            sink::to_stderr(b"mallocspy: the revoked spy panicked while being dropped\n");
        }
    }

    /// Child side of `fork`: the thread that held the lock does not exist there.
    pub(crate) fn force_unlock(&self) {
        self.lock.force_unlock();
    }
}
