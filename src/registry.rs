//! One spy per process: registration, revocation deferred while its blocks live, and the
//! panic firewall around every call into it.
//!
//! `CoRegisterMallocSpy` semantics: registering while a spy is registered (or a revoked one
//! still has live blocks, or is still being dropped) fails with
//! [`SpyError::AlreadyRegistered`]; revoking while blocks allocated under the spy are live
//! fails with [`SpyError::AccessDenied`] and leaves the revoke pending: the spy keeps
//! receiving the frees and reallocs of its blocks, and is dropped right after the last one is
//! freed.
//!
//! Dropping must also wait for threads still running the spy's code (a Pre method on another
//! core): [`threads::quiesce`] provides that grace period. Two threads waiting for it from
//! inside hooks would wait for each other forever; the registry rules that out (see
//! [`Registry::retire_if_unused`]).

use core::panic::AssertUnwindSafe;
use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicUsize, Ordering};

use crate::pins::Pins;
use crate::spy::{MallocSpy, Role, SpyError};
use crate::sync::SpinLock;
use crate::{os, sink, threads, tls};

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
    /// The modules of the spy's code, when it came through the C ABI: kept loaded until the
    /// spy is dropped (a field, so dropped after it: its `release` runs first).
    _pins: Pins,
    /// No new blocks, no calls for unspied blocks: revoked by the program or after a panic.
    revoked: AtomicBool,
    /// The revoke's grace period is over: every allocation that could still add a spied block
    /// has finished, so a live count of zero is final.
    settled: AtomicBool,
    /// The slot (plus one; 0: none) of the thread whose hook revoked the spy (or whose spy
    /// failed in it): that hook may still add a block, so the cell is settled at its end
    /// ([`SpyCell::settle_if_hook_ends`]).
    settles_at_end_of: AtomicU32,
    /// Set once by whoever drops the cell.
    retiring: AtomicBool,
    panic_reported: AtomicBool,
    misalign_reported: AtomicBool,
}

/// A spy method panicked; the spy is being disabled.
pub(crate) struct Panicked;

// SAFETY: the spy is `Send + Sync` (the trait's bounds); the flags are atomics; the pins are
// loader handles, which any thread may close.
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

/// Set in `tls::State::calling_cell` beside the cell (aligned, so its low bit is free) while
/// the spy's method belongs to a call that returns a block under it.
pub(crate) const CALL_ADDS_A_BLOCK: usize = 1;

impl SpyCell {
    /// Whether the spy outlives its registration (the built-in spies).
    pub(crate) fn is_static(&self) -> bool {
        !self.owned
    }

    /// Whether new calls may use the spy.
    #[inline]
    pub(crate) fn is_active(&self) -> bool {
        !self.revoked.load(Ordering::Acquire)
    }

    /// Runs `f` on the spy, catching a panic: the panic is reported once and the caller falls
    /// back to what it would do without the spy (and disables it).
    #[inline(always)]
    pub(crate) fn call<R>(&self, f: impl FnOnce(&dyn MallocSpy) -> R) -> Result<R, Panicked> {
        self.call_marked(0, f)
    }

    /// [`call`](Self::call) for a method of a call that returns a block to the program
    /// (`pre_alloc`, `post_realloc`, ...): a revoke from inside it is pending on that block
    /// (see [`CALL_ADDS_A_BLOCK`]).
    #[inline(always)]
    pub(crate) fn call_adding<R>(&self, f: impl FnOnce(&dyn MallocSpy) -> R) -> Result<R, Panicked> {
        self.call_marked(CALL_ADDS_A_BLOCK, f)
    }

    #[inline(always)]
    fn call_marked<R>(&self, mark: usize, f: impl FnOnce(&dyn MallocSpy) -> R) -> Result<R, Panicked> {
        // SAFETY: the spy lives as long as the cell (static, or freed by the cell's drop).
        let spy = unsafe { &*self.spy };
        let ts = tls::state();
        let outer = if self.owned {
            // Only a failure said during this call counts: one said outside any spy method (or
            // in a `release`) would otherwise blame the next call, of this spy or the next one.
            ts.spy_failed.set(0);
            ts.calling_cell.replace(self as *const SpyCell as usize | mark)
        } else {
            0
        };
        // A registered spy's code may make a cancellation point (a `write`, a `printf`): a
        // cancellation pending on the thread would start there, unwind through the hook and
        // abort the process, where natively `malloc` is no cancellation point. It waits for the
        // thread's next one, outside the hook.
        let _uncancellable = self.owned.then(os::Uncancellable::new);
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| f(spy)));
        if self.owned {
            ts.calling_cell.set(outer);
        }
        match result {
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

    /// Settles the cell if the hook of slot `me`, which is ending, revoked it (or disabled it):
    /// the block that hook was allocating is in the table now.
    pub(crate) fn settle_if_hook_ends(&self, me: u32) {
        if self.settles_at_end_of.load(Ordering::Relaxed) == me + 1 {
            self.settles_at_end_of.store(0, Ordering::Relaxed);
            self.settled.store(true, Ordering::SeqCst);
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

/// Orders registrations and revokes: one lock for every registry of the process (there is one
/// but in tests), as they are rare, and a registry's words share the line every call reads.
static LOCK: SpinLock = SpinLock::new();

/// The process's one registration slot.
pub(crate) struct Registry {
    cell: AtomicPtr<SpyCell>,
    /// Retirers between taking their cell out of `cell` and being done waiting for the hooks
    /// in flight: no spy may be registered meanwhile.
    retiring: AtomicUsize,
}

impl Registry {
    /// Where the registered spy's pointer lies in a registry (null: none, see
    /// [`Registry::is_empty`]), for the assembly of [`crate::fast_path`].
    pub(crate) const CELL_OFFSET: usize = core::mem::offset_of!(Registry, cell);

    pub(crate) const fn new() -> Self {
        Self { cell: AtomicPtr::new(core::ptr::null_mut()), retiring: AtomicUsize::new(0) }
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

    /// Registers the spy `make` builds, of `role`, whose modules `pins` keeps loaded; `make`
    /// runs only once the slot is known to be free, so a refused spy is never built (a C spy's
    /// `release` is not called for nothing). The role is asked by the caller, before the lock:
    /// a spy's `role` that called the API waited on the lock for good (review helper 164).
    pub(crate) fn register(&self, make: impl FnOnce() -> SpyRef, role: Role, pins: Pins) -> Result<(), SpyError> {
        // The blocks allocated before the first spy are no longer noted (a leak tracker
        // adopts them before it is registered: see `early.rs`).
        drop(crate::early::stop());
        let _guard = LOCK.lock();
        if !self.cell.load(Ordering::SeqCst).is_null() || self.retiring.load(Ordering::SeqCst) != 0 {
            return Err(SpyError::AlreadyRegistered);
        }
        let (spy, owned): (*const dyn MallocSpy, bool) = match make() {
            SpyRef::Owned(b) => (Box::into_raw(b), true),
            SpyRef::Static(s) => (s, false),
        };
        let cell = Box::new(SpyCell {
            spy,
            owned,
            observes: role == Role::Observe,
            _pins: pins,
            revoked: AtomicBool::new(false),
            settled: AtomicBool::new(false),
            settles_at_end_of: AtomicU32::new(0),
            retiring: AtomicBool::new(false),
            panic_reported: AtomicBool::new(false),
            misalign_reported: AtomicBool::new(false),
        });
        self.cell.store(Box::into_raw(cell), Ordering::Release);
        Ok(())
    }

    /// Claims the registered spy for a revoke: new calls stop using it, and the caller is the
    /// one to settle it (see [`Registry::settle_then`]).
    ///
    /// The lock orders revokes against registrations, and is held for that alone: not while
    /// other threads are waited for (one inside a spy method that calls the API meanwhile
    /// would wait for the lock in turn), nor while the spy is dropped (its `release` may
    /// register a successor).
    pub(crate) fn claim_revoke(&self) -> Result<*const SpyCell, SpyError> {
        let _guard = LOCK.lock();
        let Some(cell) = self.current() else { return Err(SpyError::NotRegistered) };
        if cell.revoked.swap(true, Ordering::SeqCst) {
            return Err(SpyError::NotRegistered);
        }
        Ok(cell)
    }

    /// Stops new calls from using `cell` and waits for those in flight. Used after a panic,
    /// inside the hook of slot `me`; the caller then calls [`Registry::retire_if_unused`] once
    /// it no longer uses `cell`.
    pub(crate) fn disable(&self, cell: &SpyCell, me: u32) {
        if !cell.revoked.swap(true, Ordering::SeqCst) {
            Self::settle_at_hook_end(cell, me);
        }
    }

    /// [`Registry::settle_then`] for a revoke from a method of `cell`'s spy (or its failure)
    /// inside the hook of slot `me`: waits for the other threads' allocations, but not for
    /// that hook's own, which may still add a block (a spy's `pre_alloc` that revokes it): the
    /// cell is settled when that hook ends with its `retire`, as every hook that ran a method
    /// of the spy does ([`SpyCell::settle_if_hook_ends`]). Settled at once, it was retired by
    /// another thread's free of the spy's last block while the hook went on to add one, whose
    /// header then reached the real allocator (review helper 125: SIGSEGV in `_int_free`).
    /// Not for a revoke from elsewhere in a hook (a `release` that registers a successor and
    /// revokes it): no `retire` of that cell follows there, and it was never settled, every
    /// later registration refused (review helper 127).
    pub(crate) fn settle_at_hook_end(cell: &SpyCell, me: u32) {
        threads::quiesce(Some(me));
        cell.settles_at_end_of.store(me + 1, Ordering::Relaxed);
    }

    /// Waits for the allocations that saw `cell` active before it was revoked, which may still
    /// add blocks; then runs `enter` and marks the cell settled, after which a live count of
    /// zero is final and a free of its last block drops it. `enter` is where a caller outside
    /// any hook marks itself in flight, so that such a drop waits for it to be done with the
    /// cell; only the caller that revoked the cell may call this, and the cell lives until then.
    pub(crate) fn settle_then<G>(cell: &SpyCell, me: Option<u32>, enter: impl FnOnce() -> G) -> G {
        threads::quiesce(me);
        let guard = enter();
        cell.settled.store(true, Ordering::SeqCst);
        guard
    }

    /// Drops `cell` if it is revoked, settled and has no live block. Called after each free
    /// of a spied block while the revoke is pending, and after a panic disabled the spy.
    /// Returns whether the cell is retired (by this call or by another thread's).
    ///
    /// The caller is in flight: inside a hook (its slot in `me`), or marked for this call
    /// alone by `in_flight`, which is dropped (and `me` must then be `None`) once the cell is
    /// this call's to drop, before waiting for the hooks in flight: two callers in flight that
    /// each waited for the other would wait forever. The caller must not use `cell` afterwards
    /// (hence a raw pointer: a reference argument would outlive the referent).
    pub(crate) fn retire_if_unused<G>(
        &self,
        cell: *const SpyCell,
        live: &impl Fn() -> usize,
        me: Option<u32>,
        in_flight: G,
    ) -> bool {
        {
            // SAFETY: a cell is dropped only after a grace period that outlasts the caller,
            // which is in flight.
            let flags = unsafe { &*cell };
            // A free that removed the last block, then read `settled` as false, leaves the
            // spy to its revoker, which stores `settled` and then reads the live count: each
            // side must see the other's store, which takes a full fence between its store and
            // its load (the table's removals are relaxed stores; `live` fences only before its
            // own loads).
            core::sync::atomic::fence(Ordering::SeqCst);
            if !flags.settled.load(Ordering::SeqCst) || live() != 0 {
                return false;
            }
            if flags.retiring.swap(true, Ordering::SeqCst) {
                return true;
            }
        }
        let ptr = cell.cast_mut();
        // Counted before the cell leaves the registry, so that a registration that finds the
        // registry empty also finds the count. A spy registered while this call waits could
        // revoke itself (or panic) from inside a hook, and wait from there for this caller's
        // hook, which waits for it: both would hang. The wait below is thus the only one from
        // inside a hook: the settling of a revoke ends before its cell can retire, and a cell
        // is claimed and retired once.
        self.retiring.fetch_add(1, Ordering::SeqCst);
        let taken = self.cell.compare_exchange(ptr, core::ptr::null_mut(), Ordering::SeqCst, Ordering::Acquire);
        if taken.is_ok() {
            drop(in_flight);
            // Threads may still be inside the spy's methods (an unspied free that looked
            // before the revoke); wait for them before dropping.
            threads::quiesce(me);
        }
        // Before the drop: the spy's `release` may register its successor.
        self.retiring.fetch_sub(1, Ordering::SeqCst);
        if taken.is_err() {
            return true;
        }
        // SAFETY: `ptr` came from Box::into_raw in register; it is no longer reachable from
        // the registry, `retiring` makes this the only drop, and quiesce has waited out every
        // hook that could still hold a reference.
        let cell = unsafe { Box::from_raw(ptr) };
        if std::panic::catch_unwind(AssertUnwindSafe(move || drop(cell))).is_err() {
            sink::to_stderr(b"mallocspy: the revoked spy panicked while being dropped\n");
        }
        true
    }

    /// Child side of `fork`, where only the forking thread lives on. The thread that held the
    /// lock, retirers that were waiting (their cells are out of the registry, and stay
    /// undropped), and a revoker that had claimed the cell and was waiting to settle it do not
    /// exist there: the cell is settled now (no hook is in flight), or every later
    /// registration would fail. Returns whether it was: the caller then has the next call
    /// retire it if it has no live block (a free of its last block does otherwise).
    pub(crate) fn after_fork_child(&self) -> bool {
        LOCK.force_unlock();
        self.retiring.store(0, Ordering::SeqCst);
        match self.current() {
            Some(cell) if !cell.is_active() && !cell.settled.load(Ordering::SeqCst) => {
                cell.settled.store(true, Ordering::SeqCst);
                true
            }
            _ => false,
        }
    }
}
