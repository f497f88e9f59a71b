//! The dispatcher: each entry point of the malloc family as guard, spy Pre, real allocator,
//! spy Post, events.
//!
//! The order of operations is fixed:
//! * no spy registered: straight to the real allocator (one load and one branch; the
//!   process's `malloc` and `free` ask the gate first, in assembly: `fast_path.rs`);
//! * a sampling spy alone: a call it would only count is counted by the gate ([`Gate`]) and
//!   goes to the real allocator;
//! * a call from inside a hook (the spy allocating, a signal handler that interrupted a hook)
//!   goes to the real allocator unseen (a handler's allocations are counted, for the report
//!   to say what it missed: [`crate::signal_frames`]); its frees of spied blocks are parked
//!   in [`DeferredFrees`] because only the spy knows where their real block starts;
//! * otherwise: enter the hook (re-entrancy guard, in-flight mark), Pre, real call, Post,
//!   record the block as spied, `after_call`.
//!
//! A block is removed from the spied table *before* the real allocator gets it back, and
//! inserted *after* the real allocator handed it out: in between, another thread may get the
//! same address.
//!
//! `errno`: allocating calls leave it as the real allocator left it (the spy's own calls may
//! not disturb it); `free` preserves it.

use core::ffi::{c_int, c_void};
use core::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crate::deferred::DeferredFrees;
use crate::gate::{self, Gate};
use crate::heap::Heap;
use crate::live_table::{LiveTable, Lookup};
use crate::pins::Pins;
use crate::registry::{self, Registry, SpyCell, SpyRef};
use crate::spy::{Call, DidAlloc, Entry, MallocSpy, Role, SpyError};
use crate::threads::{self, InFlight};
use crate::tls::{self, ThreadState};
use crate::{os, sink};

/// Which real function serves an allocating call.
#[derive(Clone, Copy)]
enum Kind {
    Malloc,
    Calloc { nmemb: usize, elem: usize },
    Memalign,
    AlignedAlloc,
    PosixMemalign,
    Valloc,
    Pvalloc,
}

/// An allocating call as the caller made it.
#[derive(Clone, Copy)]
struct AllocRequest {
    entry: Entry,
    kind: Kind,
    /// Bytes the caller may use (pvalloc: rounded up to pages).
    size: usize,
    /// Bytes the caller asked for (reported in `Call::size`).
    asked: usize,
    /// 0 for the unaligned functions.
    align: usize,
}

/// Result of an allocating call: the block (or NULL) and an error number (0 on success).
#[derive(Clone, Copy)]
struct Outcome {
    ptr: *mut c_void,
    err: c_int,
}

impl Outcome {
    const fn failed(err: c_int) -> Self {
        Self { ptr: core::ptr::null_mut(), err }
    }
}

/// Lowers the hook depth when dropped.
struct Depth(&'static ThreadState);

impl Drop for Depth {
    #[inline]
    fn drop(&mut self) {
        self.0.depth.set(0);
        crate::ending_signals::after_hook();
    }
}

/// Runs `f`, in which a spy takes its tables' locks to follow a release made where no spy code
/// ran: by a tick callback (program code the ticks spy runs inside a hook, outside its tables'
/// critical sections), or outside any hook (on an alternate signal stack with little room left,
/// by a thread without a slot: the leak tracker reported such a block lost, the ticks spy kept
/// its sample live). Meanwhile the thread counts as inside a hook and no callback, so that a
/// signal handler's release interrupting `f` leaves the tables alone (one waited for its own
/// thread's lock for good: review helper 122). `None` inside a hook otherwise: a signal handler
/// that interrupted one, whose tables may be mid-change (its release is not followed; parking
/// it instead moves the real free out of the handler, into code the handler may interrupt,
/// which can break a program whose handler and main loop keep to separate bins of glibc's
/// cache, as `signal_frees.c` does).
pub(crate) fn following_unseen<T>(f: impl FnOnce() -> T) -> Option<T> {
    let ts = tls::state();
    let (in_callback, depth) = (ts.in_tick_callback.get(), ts.depth.get());
    if in_callback == 0 && depth != 0 {
        return None;
    }
    ts.in_tick_callback.set(0);
    ts.depth.set(depth.max(1));
    let r = f();
    ts.depth.set(depth);
    ts.in_tick_callback.set(in_callback);
    if depth == 0 {
        crate::ending_signals::after_hook();
    }
    Some(r)
}

/// Proof that the calling thread is inside a top-level hook: its nested allocator calls go
/// straight to the real allocator, and spy code it runs is waited for before a spy is dropped.
pub(crate) struct Scope {
    slot: u32,
    // Field order matters: the in-flight mark must end before the depth drops, or a signal
    // handler running a hook in between would share the mark.
    _in_flight: InFlight,
    _depth: Depth,
}

impl Scope {
    /// Enters a top-level hook, or `None` for a nested call (or a thread without a slot).
    #[inline(always)]
    pub(crate) fn enter() -> Option<Scope> {
        let ts = tls::state();
        if ts.depth.get() != 0 && !give_up_a_hook_left_by_a_jump() {
            return None;
        }
        let sp = crate::unwind::current_sp();
        if crate::alt_stack::little_room(ts, sp) {
            return None;
        }
        ts.depth.set(1);
        let depth = Depth(ts);
        // Where the caller's stack starts, for spies that capture it. The trampoline's record
        // is trusted only if it lies above this frame (a signal handler could have run an
        // export of its own in between, deeper on the stack).
        let entry = ts.entry_sp.get();
        ts.scope_sp.set(sp);
        let valid = entry > sp;
        ts.hook_sp.set(if valid { entry } else { 0 });
        ts.hook_bp.set(ts.entry_bp.get());
        if valid {
            // SAFETY: `entry` is above this frame on the live stack: the caller's return
            // address, pushed by its call of the export.
            ts.hook_ret.set(unsafe { (entry as *const u64).read() });
        }
        let slot = threads::current(ts)?;
        Some(Scope { slot, _in_flight: InFlight::enter(slot, ts), _depth: depth })
    }

    /// The calling thread's slot.
    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }
}

/// Gives up the top-level hook in progress on this thread if a `siglongjmp` out of a signal
/// handler that interrupted it in the real allocator abandoned it, and says whether it did.
/// Otherwise the hook stayed in progress for good: every later call of the thread went
/// unspied, and its exit wrote no report (review helper 92). A call from inside a hook, or
/// from a handler that interrupted it, runs below the hook's frames, which are intact; a call
/// made after the jump finds the return address the hook's caller left overwritten, or runs
/// at or above the hook's own stack pointer. Not when the hook was in mallocspy's own code,
/// which may hold a lock of its own that nothing would release: that thread stays unspied, as
/// before.
pub(crate) fn give_up_a_hook_left_by_a_jump() -> bool {
    let ts = tls::state();
    let (scope_sp, hook_sp) = (ts.scope_sp.get(), ts.hook_sp.get());
    if ts.depth.get() != tls::IN_REAL_ALLOCATOR || scope_sp == 0 || hook_sp == 0 {
        return false;
    }
    let sp = crate::unwind::current_sp();
    // Read through the kernel: the hook may have run on a stack since freed (a coroutine's).
    let mut ret = [0u64; 1];
    let overwritten = !os::read_own(hook_sp as usize, &mut ret) || ret[0] != ts.hook_ret.get();
    // The stack's bounds last: a handler on a small alternate stack is below the hook, or on
    // a stack of its own, and has little room for finding them.
    let on_the_hooks_stack = || {
        let (low, high) = crate::unwind::stack_bounds();
        (low..high).contains(&sp) && (low..high).contains(&scope_sp)
    };
    if !(overwritten || sp >= scope_sp && on_the_hooks_stack()) {
        return false;
    }
    threads::leave_abandoned_hook(ts);
    ts.depth.set(0);
    // What an abandoned `delete` noted for its block is not put back by it.
    ts.delete_ptr.set(0);
    true
}

/// Whether `posix_memalign` takes `align`: a power of two, a multiple of `sizeof(void *)`.
#[inline(always)]
fn alignment_accepted(align: usize) -> bool {
    align.is_power_of_two() && align >= core::mem::size_of::<*mut c_void>()
}

/// Blocks [`Interposer::served_unseen`] keeps for the spy at most between two hooks: more
/// than a tick callback allocates on one sample, as a rule.
const SERVED_UNSEEN: usize = 1024;

/// The malloc family over a real heap `H`, with an optional registered spy.
///
/// `repr(C)`, fields in this order: what every call reads (the registry's pointer, the gate,
/// the real allocator's functions, whether frees are parked) shares the first cache lines.
#[repr(C)]
pub(crate) struct Interposer<H: Heap> {
    pub(crate) registry: Registry,
    /// Lets the calls a sampling spy would only count bypass it.
    pub(crate) gate: Gate,
    pub(crate) heap: H,
    deferred: DeferredFrees,
    /// Caller pointer of every block allocated under the spy -> the size the caller may use.
    spied: LiveTable<usize>,
    /// Whether an allocation ever reached a registered spy ([`Self::reached_a_spy`]).
    reached: AtomicBool,
    /// Whether `spied` could not grow (said once: under a small `max_memory` every allocation
    /// after that said so, 1.4 million lines).
    table_full: AtomicBool,
    /// Whether the program revoked a spy registered as static: the built-in ones, whose
    /// reports then cover only what came before ([`Self::builtin_revoked`]).
    builtin_revoked: AtomicBool,
    /// A revoke from inside a hook left a spy with no live block to that hook's end, which
    /// retires only the spy the hook used (or a fork's child settled a revoke another thread
    /// had begun): the next allocation retires it if it is still there.
    revoked_in_hook: AtomicBool,
    /// Reallocs between taking a spied block out of the table and putting its successor (or
    /// itself, on failure) in: counted as live blocks, or a revoked spy whose table read empty
    /// in that window was dropped, and the block the realloc then recorded outlived it (its
    /// free went to the real allocator past the spy's header).
    reallocating: AtomicUsize,
    /// Reallocs that have ended (see [`Self::live_blocks`]).
    reallocs_done: AtomicUsize,
    /// Allocations made by signal handlers that interrupted a hook, which no spy saw: calls
    /// and bytes ([`Self::unseen`]).
    unseen_calls: AtomicU64,
    unseen_bytes: AtomicU64,
    /// Blocks served where no spy code could run, for the spy's `served_unspied`
    /// ([`Self::served_unseen`]): a ring apart from `deferred`, whose frees they crowded out
    /// (review helper 132: 2,000 of 2,000 frees leaked under a callback allocating 300 blocks).
    served: DeferredFrees<SERVED_UNSEEN>,
    /// Blocks `served` had no room for ([`Self::untold_blocks`]).
    untold: AtomicUsize,
    /// Whether the spy registered last lays blocks out (an observer has no use for
    /// `served_unspied`: the blocks are not kept for it).
    spy_interposes: AtomicBool,
}

/// The smallest power of two `>= align` (`align` itself when it is one), saturating.
fn align_pow2(align: usize) -> usize {
    align.checked_next_power_of_two().unwrap_or(1 << (usize::BITS - 1))
}

/// Whether the spy's pointer `p` keeps the alignment the caller is owed: what it asked for
/// (at least 16, malloc's guarantee on x86_64) as far as the real block `real` had it.
fn keeps_alignment(p: *mut c_void, real: *mut c_void, align: usize) -> bool {
    let owed = align_pow2(align.max(16));
    let real_align = 1usize.checked_shl((real as usize).trailing_zeros()).unwrap_or(owed);
    (p as usize).is_multiple_of(owed.min(real_align))
}

impl<H: Heap> Interposer<H> {
    pub(crate) const fn new(heap: H) -> Self {
        Self {
            registry: Registry::new(),
            gate: Gate::new(),
            heap,
            deferred: DeferredFrees::new(),
            spied: LiveTable::new(),
            reached: AtomicBool::new(false),
            table_full: AtomicBool::new(false),
            builtin_revoked: AtomicBool::new(false),
            revoked_in_hook: AtomicBool::new(false),
            unseen_calls: AtomicU64::new(0),
            unseen_bytes: AtomicU64::new(0),
            reallocating: AtomicUsize::new(0),
            reallocs_done: AtomicUsize::new(0),
            served: DeferredFrees::new(),
            untold: AtomicUsize::new(0),
            spy_interposes: AtomicBool::new(false),
        }
    }

    // ---- the entry points ------------------------------------------------------------------

    /// `malloc` and [`Interposer::free`] in Rust, for the tests' interposers: the process's
    /// are [`crate::fast_path`]'s assembly, which takes the same steps.
    #[cfg(test)]
    #[inline]
    pub(crate) fn malloc(&self, size: usize) -> *mut c_void {
        if self.registry.is_empty() || self.gate.pass_small(size) {
            return self.heap.malloc(size);
        }
        self.malloc_slow(size)
    }

    /// `malloc` through the spy, out of line: the fast path above then needs no stack frame
    /// and ends in a tail call to the real allocator (the process's interposer has that fast
    /// path in assembly, [`crate::fast_path`], which comes here too). `extern "C"`, so that it
    /// cannot unwind: the entry points, which must not unwind either, then reach it by a jump
    /// too, rather than a call wrapped in an abort-on-unwind frame.
    #[inline(never)]
    pub(crate) extern "C" fn malloc_slow(&self, size: usize) -> *mut c_void {
        self.alloc(AllocRequest { entry: Entry::Malloc, kind: Kind::Malloc, size, asked: size, align: 0 }).ptr
    }

    #[inline]
    pub(crate) fn calloc(&self, nmemb: usize, elem: usize) -> *mut c_void {
        if self.registry.is_empty() {
            return self.heap.calloc(nmemb, elem);
        }
        match nmemb.checked_mul(elem) {
            Some(size) => {
                if self.gate.pass_small(size) {
                    return self.heap.calloc(nmemb, elem);
                }
                self.calloc_slow(nmemb, elem, size)
            }
            None => self.calloc_overflow(nmemb, elem),
        }
    }

    /// `calloc` through the spy, out of line (see [`Self::malloc_slow`]).
    #[inline(never)]
    extern "C" fn calloc_slow(&self, nmemb: usize, elem: usize, size: usize) -> *mut c_void {
        let kind = Kind::Calloc { nmemb, elem };
        self.alloc(AllocRequest { entry: Entry::Calloc, kind, size, asked: size, align: 0 }).ptr
    }

    /// A spied `calloc` whose size overflows: the real allocator has the last word on an
    /// impossible request (and its errno), and the spy hears of the failure.
    #[cold]
    #[inline(never)]
    extern "C" fn calloc_overflow(&self, nmemb: usize, elem: usize) -> *mut c_void {
        let p = self.heap.calloc(nmemb, elem);
        if p.is_null() { self.reject(Entry::Calloc, usize::MAX, 0, os::errno()) } else { p }
    }

    /// # Safety
    /// `ptr` is NULL or a live block of this allocator.
    #[inline]
    pub(crate) unsafe fn realloc(&self, ptr: *mut c_void, size: usize) -> *mut c_void {
        if self.registry.is_empty() || (size != 0 && self.gate.pass_realloc(ptr as usize, size)) {
            // SAFETY: the caller's guarantee; with no spy every block is a real block.
            return unsafe { self.heap.realloc(ptr, size) };
        }
        // SAFETY: the caller's guarantee.
        unsafe { self.realloc_slow(ptr, size) }
    }

    /// `realloc` through the spy, out of line (see [`Self::malloc_slow`]).
    ///
    /// # Safety
    /// `ptr` is NULL or a live block of this allocator.
    #[inline(never)]
    unsafe extern "C" fn realloc_slow(&self, ptr: *mut c_void, size: usize) -> *mut c_void {
        // SAFETY: the caller's guarantee.
        unsafe { self.realloc_spied(Entry::Realloc, ptr, size) }
    }

    /// # Safety
    /// `ptr` is NULL or a live block of this allocator.
    #[inline]
    pub(crate) unsafe fn reallocarray(&self, ptr: *mut c_void, nmemb: usize, elem: usize) -> *mut c_void {
        let Some(size) = nmemb.checked_mul(elem) else {
            if self.registry.is_empty() {
                os::set_errno(libc::ENOMEM);
                return core::ptr::null_mut();
            }
            return self.reject(Entry::Reallocarray, usize::MAX, 0, libc::ENOMEM);
        };
        if self.registry.is_empty() || (size != 0 && self.gate.pass_realloc(ptr as usize, size)) {
            // SAFETY: the caller's guarantee.
            return unsafe { self.heap.realloc(ptr, size) };
        }
        // SAFETY: the caller's guarantee.
        unsafe { self.realloc_spied(Entry::Reallocarray, ptr, size) }
    }

    /// # Safety
    /// `ptr` is NULL or a live block of this allocator, dead afterwards.
    #[cfg(test)]
    #[inline]
    pub(crate) unsafe fn free(&self, ptr: *mut c_void) {
        if self.registry.is_empty() || self.gate.pass_free(ptr as usize) {
            // SAFETY: the caller's guarantee; with no spy every block is a real block.
            return unsafe { self.heap.free(ptr) };
        }
        // SAFETY: the caller's guarantee.
        unsafe { self.free_slow(ptr) }
    }

    /// `free` through the spy, out of line so that the fast paths above (and
    /// [`crate::fast_path`]'s) stay small.
    ///
    /// # Safety
    /// `ptr` is NULL or a live block of this allocator, dead afterwards.
    #[inline(never)]
    pub(crate) unsafe extern "C" fn free_slow(&self, ptr: *mut c_void) {
        // SAFETY: the caller's guarantee.
        unsafe { self.release_slow(Entry::Free, ptr) }
    }

    /// C++'s `operator new` (`entry`: [`Entry::OperatorNew`] or [`Entry::OperatorNewArray`])
    /// in every form: `malloc`'s steps, or `memalign`'s for a non-zero `align`, under the
    /// operator's name. NULL when out of memory: the caller (`interpose.rs`) runs the
    /// program's new-handler and tries again, or throws `bad_alloc`.
    #[inline]
    pub(crate) fn operator_new(&self, entry: Entry, size: usize, align: usize) -> *mut c_void {
        if self.registry.is_empty() {
            return self.heap.operator_new(entry, size, align);
        }
        if align == 0 {
            if self.gate.pass_small(size) {
                return self.heap.malloc(size);
            }
            return self.alloc(AllocRequest { entry, kind: Kind::Malloc, size, asked: size, align: 0 }).ptr;
        }
        if self.gate.pass_alloc(size, gate::ALIGNED) {
            return self.unless_failed(self.heap.memalign(align, size), size);
        }
        self.alloc(AllocRequest { entry, kind: Kind::Memalign, size, asked: size, align }).ptr
    }

    /// A release by `entry` (`free`, or C++'s `operator delete`, whose exports are `free`'s
    /// assembly, [`crate::fast_path`]) through the spy, `errno` kept.
    ///
    /// # Safety
    /// `ptr` is NULL or a live block of this allocator, dead afterwards.
    #[inline(never)]
    pub(crate) unsafe fn release_slow(&self, entry: Entry, ptr: *mut c_void) {
        let saved = os::errno();
        // SAFETY: the caller's guarantee.
        unsafe { self.free_spied(entry, ptr) };
        os::set_errno(saved);
    }

    /// # Safety
    /// `out` is valid for a write.
    #[inline]
    pub(crate) unsafe fn posix_memalign(&self, out: *mut *mut c_void, align: usize, size: usize) -> c_int {
        // An alignment the allocator refuses takes the spied path, which counts only what
        // succeeds; the gate counts before the call (review helper 67).
        if self.registry.is_empty() || (alignment_accepted(align) && self.gate.pass_alloc(size, gate::ALIGNED)) {
            // SAFETY: the caller's guarantee.
            let err = unsafe { self.heap.posix_memalign(out, align, size) };
            if err != 0 {
                self.gate.failed_after_pass(size);
            }
            return err;
        }
        let r = self.alloc(AllocRequest {
            entry: Entry::PosixMemalign,
            kind: Kind::PosixMemalign,
            size,
            asked: size,
            align,
        });
        if r.err == 0 {
            // SAFETY: the caller's guarantee.
            unsafe { *out = r.ptr };
        }
        r.err
    }

    /// `ptr`, the real allocator's answer to an aligned request the gate let through: a
    /// failure is not counted.
    #[inline(always)]
    fn unless_failed(&self, ptr: *mut c_void, size: usize) -> *mut c_void {
        if ptr.is_null() {
            self.gate.failed_after_pass(size);
        }
        ptr
    }

    #[inline]
    pub(crate) fn aligned_alloc(&self, align: usize, size: usize) -> *mut c_void {
        // As `posix_memalign`: glibc 2.38 refuses an alignment that is no power of two (and
        // takes a small one for 8 or 16).
        if self.registry.is_empty() || (align.is_power_of_two() && self.gate.pass_alloc(size, gate::ALIGNED)) {
            return self.unless_failed(self.heap.aligned_alloc(align, size), size);
        }
        self.alloc(AllocRequest { entry: Entry::AlignedAlloc, kind: Kind::AlignedAlloc, size, asked: size, align }).ptr
    }

    #[inline]
    pub(crate) fn memalign(&self, align: usize, size: usize) -> *mut c_void {
        if self.registry.is_empty() || self.gate.pass_alloc(size, gate::ALIGNED) {
            return self.unless_failed(self.heap.memalign(align, size), size);
        }
        self.alloc(AllocRequest { entry: Entry::Memalign, kind: Kind::Memalign, size, asked: size, align }).ptr
    }

    #[inline]
    pub(crate) fn valloc(&self, size: usize) -> *mut c_void {
        if self.registry.is_empty() || self.gate.pass_alloc(size, gate::ALIGNED) {
            return self.unless_failed(self.heap.valloc(size), size);
        }
        let align = os::page_size();
        self.alloc(AllocRequest { entry: Entry::Valloc, kind: Kind::Valloc, size, asked: size, align }).ptr
    }

    #[inline]
    pub(crate) fn pvalloc(&self, size: usize) -> *mut c_void {
        if self.registry.is_empty() || self.gate.pass_alloc(size, gate::ALIGNED) {
            return self.unless_failed(self.heap.pvalloc(size), size);
        }
        let align = os::page_size();
        match size.checked_next_multiple_of(align) {
            // pvalloc(0) stays 0: glibc's own rounding makes it a minimal block, not a page (an
            // observer's real call asked for a page: review helper 72).
            Some(rounded) => {
                self.alloc(AllocRequest {
                    entry: Entry::Pvalloc,
                    kind: Kind::Pvalloc,
                    size: rounded,
                    asked: size,
                    align,
                })
                .ptr
            }
            None => self.reject(Entry::Pvalloc, size, align, libc::ENOMEM),
        }
    }

    /// # Safety
    /// `ptr` is NULL or a live block of this allocator.
    #[inline]
    pub(crate) unsafe fn malloc_usable_size(&self, ptr: *mut c_void) -> usize {
        if self.registry.is_empty() {
            // SAFETY: the caller's guarantee.
            return unsafe { self.heap.usable_size(ptr) };
        }
        let saved = os::errno();
        // SAFETY: the caller's guarantee.
        let size = unsafe { self.usable_size_spied(ptr) };
        os::set_errno(saved);
        size
    }

    #[inline]
    pub(crate) fn malloc_trim(&self, pad: usize) -> c_int {
        if self.registry.is_empty() {
            return self.heap.trim(pad);
        }
        let Some(scope) = Scope::enter() else { return self.heap.trim(pad) };
        let Some(cell) = self.registry.current().filter(|c| c.is_active()) else { return self.heap.trim(pad) };
        let interposes = !cell.observes;
        let pre = if interposes { cell.call(|spy| spy.pre_heap_minimize()) } else { Ok(()) };
        let r = self.heap.trim(pad);
        let post = if interposes { cell.call(|spy| spy.post_heap_minimize()) } else { Ok(()) };
        if pre.is_err() || post.is_err() {
            self.disable(cell, &scope);
        }
        self.observe(
            cell,
            &scope,
            Call { entry: Entry::MallocTrim, size: 0, align: 0, ptr: null(), result: null(), failed: false },
        );
        self.retire(cell, &scope);
        r
    }

    /// IMalloc::DidAlloc: whether `ptr` is a live block of this heap, as far as can be told.
    ///
    /// The heap's own answer comes from the table of blocks allocated under the spy, keyed by
    /// the caller's pointer; the spy's `pre_did_alloc` is called as the contract says (a spy
    /// that moves pointers maps the caller's back to its real block, which is live when the
    /// caller's is), and its `post_did_alloc` has the last word.
    pub(crate) fn did_alloc(&self, ptr: *mut c_void) -> DidAlloc {
        let plain = |p: *mut c_void, spied: bool| {
            if spied {
                DidAlloc::Yes
            } else if p.is_null() || !(p as usize).is_multiple_of(16) {
                DidAlloc::No
            } else {
                DidAlloc::Unknown
            }
        };
        if self.registry.is_empty() || ptr.is_null() {
            return plain(ptr, false);
        }
        let Some(scope) = Scope::enter() else {
            return plain(ptr, matches!(self.spied.try_get(ptr as usize), Lookup::Found(_)));
        };
        let spied = self.is_spied(ptr);
        let Some(cell) = self.registry.current().filter(|c| !c.observes && (spied || c.is_active())) else {
            return plain(ptr, spied);
        };
        let answer = match cell.call(|spy| spy.pre_did_alloc(ptr, spied)) {
            Ok(lookup) => {
                // The pointer the spy asks about, as COM's heap looks up what PreDidAlloc
                // returns (NULL: none). For a block of the spy's, any other pointer is its
                // real block, mapped back as in every Pre method: this heap knows it by the
                // caller's (it was -1, "cannot tell", for every live block of such a spy).
                let actual = if lookup == ptr || spied && !lookup.is_null() {
                    plain(ptr, spied)
                } else {
                    plain(lookup, self.is_spied(lookup))
                };
                cell.call(|spy| spy.post_did_alloc(ptr, spied, actual)).map_err(|e| (e, actual))
            }
            Err(panicked) => Err((panicked, plain(ptr, spied))),
        };
        let answer = answer.unwrap_or_else(|(_, actual)| {
            self.disable(cell, &scope);
            actual
        });
        self.retire(cell, &scope);
        answer
    }

    // ---- registration ----------------------------------------------------------------------

    #[cfg(test)]
    pub(crate) fn register(&self, make: impl FnOnce() -> Box<dyn MallocSpy>) -> Result<(), SpyError> {
        let spy = make();
        self.register_from(Pins::default(), spy.role(), move || spy)
    }

    /// Registers a spy of `role` (asked of it before: see [`Registry::register`]) whose
    /// modules `pins` keeps loaded while it is registered.
    pub(crate) fn register_from(
        &self,
        pins: Pins,
        role: Role,
        make: impl FnOnce() -> Box<dyn MallocSpy>,
    ) -> Result<(), SpyError> {
        self.retire_orphan();
        let made = || {
            self.spy_interposes.store(role != Role::Observe, Ordering::Relaxed);
            SpyRef::Owned(make())
        };
        self.registry.register(made, role, pins)
    }

    /// Registers a spy that outlives its registration (the built-in spies).
    pub(crate) fn register_static(&self, spy: &'static dyn MallocSpy) -> Result<(), SpyError> {
        self.retire_orphan();
        let role = spy.role();
        let made = || {
            self.spy_interposes.store(role != Role::Observe, Ordering::Relaxed);
            SpyRef::Static(spy)
        };
        self.registry.register(made, role, Pins::default())
    }

    /// Retires a revoked spy left to the next call with no live block (see `revoked_in_hook`)
    /// before a registration looks at the registry: a program that only registers (a fork's
    /// child retrying) makes no such call.
    fn retire_orphan(&self) {
        let Some(scope) = Scope::enter() else { return };
        if let Some(cell) = self.take_orphan() {
            self.registry.retire_if_unused(cell, &|| self.live_blocks(), None, scope);
        }
    }

    /// The revoked spy left to the next call (see `revoked_in_hook`), to one caller only. The
    /// caller is in flight.
    #[inline(always)]
    fn take_orphan(&self) -> Option<&SpyCell> {
        let left = self.revoked_in_hook.load(Ordering::Relaxed) && self.revoked_in_hook.swap(false, Ordering::Relaxed);
        if left { self.registry.current() } else { None }
    }

    pub(crate) fn revoke(&self) -> Result<(), SpyError> {
        // The gate counts for the sampling spy only: the next spy sees every call.
        self.gate.close();
        let live = || self.live_blocks();
        let cell = self.registry.claim_revoke()?;
        // SAFETY: claimed by this revoke: it lives until settled (see `settle_then`).
        if unsafe { &*cell }.is_static() {
            self.builtin_revoked.store(true, Ordering::Relaxed);
        }
        if tls::state().depth.get() != 0 {
            // From inside a hook: not waiting for ourselves, and leaving the spy to the hook's
            // end (`retire`), since its Post method may follow; from one of its own methods,
            // settled only then, as that hook may add a block.
            let me = threads::current_index();
            let calling = tls::state().calling_cell.get();
            let in_its_method = calling & !registry::CALL_ADDS_A_BLOCK == cell as usize;
            match me.filter(|_| in_its_method) {
                // SAFETY: as above.
                Some(me) => Registry::settle_at_hook_end(unsafe { &*cell }, me),
                // SAFETY: as above.
                None => Registry::settle_then(unsafe { &*cell }, me, || ()),
            }
            // From its own `pre_alloc` or `post_realloc`, the block that call returns keeps the
            // spy too (CoRevokeMallocSpy's E_ACCESSDENIED: released at its free). S_OK said it
            // was released (review helper 129); a call that then fails releases it at its end.
            let adds_a_block = in_its_method && calling & registry::CALL_ADDS_A_BLOCK != 0;
            if adds_a_block || live() != 0 {
                return Err(SpyError::AccessDenied);
            }
            self.revoked_in_hook.store(true, Ordering::Relaxed);
            return Ok(());
        }
        // In flight from the end of the wait until the spy is retired or left pending, as a
        // hook is: another thread's free of the spy's last block, which drops it, waits for
        // this revoke. Not while waiting: two revokers that waited in flight would wait for
        // each other.
        // SAFETY: as above.
        let scope = Registry::settle_then(unsafe { &*cell }, None, Scope::enter);
        if self.registry.retire_if_unused(cell, &live, None, scope) { Ok(()) } else { Err(SpyError::AccessDenied) }
    }

    /// The blocks a revoked spy still has, or more: those in its table, and those a realloc
    /// holds out of it. (The table first: a realloc counts itself before it takes its block
    /// out.) The table's count is a sum over its shards, not a snapshot: a realloc that took
    /// its block out of a shard already summed and put it back into one not yet summed, and
    /// ended before `reallocating` was read, was counted nowhere, and a revoked spy was dropped
    /// with a block live (review helper 64: its free then reached the real allocator past the
    /// spy's header). Such a realloc ended during the count: it is then taken as one block
    /// more. That realloc looks for the spy's release itself when it ends, with a count of
    /// its own.
    fn live_blocks(&self) -> usize {
        let done = self.reallocs_done.load(Ordering::SeqCst);
        let in_table = self.spied.len();
        #[cfg(test)]
        tests::after_counting_the_table();
        let in_flight = self.reallocating.load(Ordering::SeqCst);
        let moved = self.reallocs_done.load(Ordering::SeqCst) != done;
        in_table + in_flight + usize::from(moved)
    }

    /// Number of live blocks allocated under the current spy.
    pub(crate) fn spied_blocks(&self) -> usize {
        self.spied.len()
    }

    /// Calls `f` with the caller pointer of every block allocated under the spy and still
    /// live, each while its part of the table is locked, so that no thread frees it meanwhile.
    /// `f` must neither allocate nor free.
    pub(crate) fn each_spied_block(&self, f: &mut dyn FnMut(usize)) {
        self.spied.for_each(|p, _| f(p));
    }

    /// Blocks leaked because their free could not be deferred (the parking ring was full).
    pub(crate) fn leaked_frees(&self) -> usize {
        self.deferred.leaked()
    }

    /// Child side of `fork`: release locks whose holders did not survive, and finish what the
    /// registry's other threads had begun (see [`Registry::after_fork_child`]).
    pub(crate) fn after_fork_child(&self) {
        if self.registry.after_fork_child() {
            self.revoked_in_hook.store(true, Ordering::Relaxed);
        }
        self.spied.force_unlock();
    }

    // ---- the spied paths -------------------------------------------------------------------

    /// A call rejected before any allocation (arithmetic overflow): the spy only observes it.
    #[cold]
    fn reject(&self, entry: Entry, size: usize, align: usize, err: c_int) -> *mut c_void {
        if let Some(scope) = Scope::enter()
            && let Some(cell) = self.registry.current().filter(|c| c.is_active())
        {
            self.observe(cell, &scope, Call { entry, size, align, ptr: null(), result: null(), failed: true });
            self.retire(cell, &scope);
        }
        os::set_errno(err);
        null()
    }

    /// `after_call`, with the panic firewall.
    #[inline(always)]
    fn observe(&self, cell: &SpyCell, scope: &Scope, call: Call) {
        if cell.call(|spy| spy.after_call(&call)).is_err() {
            self.disable(cell, scope);
        }
    }

    /// Revokes `cell` after one of its methods panicked. The caller ends with [`Self::retire`].
    #[cold]
    fn disable(&self, cell: &SpyCell, scope: &Scope) {
        self.registry.disable(cell, scope.slot());
    }

    /// Drops `cell` if it is revoked and none of its blocks is live. Must be the caller's
    /// last use of `cell`.
    #[inline(always)]
    fn retire(&self, cell: *const SpyCell, scope: &Scope) {
        // SAFETY: the caller is inside a hook that found `cell` registered; a cell is freed
        // only after every such hook has ended (see Registry::retire_if_unused).
        if unsafe { (*cell).is_active() } {
            return;
        }
        // SAFETY: as above.
        unsafe { (*cell).settle_if_hook_ends(scope.slot()) };
        self.registry.retire_if_unused(cell, &|| self.live_blocks(), Some(scope.slot()), ());
    }

    /// Whether the current spy has its blocks recorded (an empty table needs no lookups).
    #[inline(always)]
    fn tracking(&self) -> bool {
        self.registry.current().is_some_and(|c| !c.observes)
    }

    /// Whether `ptr` is a live block recorded for the spy.
    #[inline(always)]
    fn is_spied(&self, ptr: *mut c_void) -> bool {
        !ptr.is_null() && self.tracking() && self.spied.get(ptr as usize).is_some()
    }

    /// Removes `ptr` from the blocks recorded for `cell`'s spy (the current one, looked up
    /// before: see [`Self::free_spied`]), returning its size if it was one.
    #[inline(always)]
    fn take_spied(&self, cell: Option<&SpyCell>, ptr: *mut c_void) -> Option<usize> {
        if ptr.is_null() || cell.is_none_or(|c| c.observes) { None } else { self.spied.remove(ptr as usize) }
    }

    /// Finishes frees that were parked by nested calls.
    #[cold]
    fn drain_deferred(&self, scope: &Scope) {
        // The blocks served unseen first: a parked free may be of one of them.
        if self.served.has_pending() {
            self.served.drain(|ptr, _| {
                if let Some(cell) = self.registry.current()
                    && cell.call(|spy| spy.served_unspied(ptr)).is_err()
                {
                    self.disable(cell, scope);
                }
            });
        }
        if !self.deferred.has_pending() {
            return;
        }
        self.deferred.drain(|ptr, entry| {
            // Looked up for each block: releasing the last one may have retired the spy.
            let cell = self.registry.current();
            let spied = self.take_spied(cell, ptr).is_some();
            // SAFETY: parked pointers are blocks a caller freed; they are still live until now.
            unsafe { self.release(scope, cell, entry, ptr, spied, false) }
        });
    }

    /// Whether a free or a block served unseen waits for a hook (two relaxed loads).
    #[inline(always)]
    fn has_parked(&self) -> bool {
        self.deferred.has_pending() || self.served.has_pending()
    }

    /// A block the real allocator gave a caller where no spy code may run (inside a hook: a
    /// tick callback's; a signal handler's on a little stack), for the spy's
    /// [`MallocSpy::served_unspied`] at the next hook that runs one, before any call could
    /// give the block back. The guard lists addresses of blocks freed under it, and the real
    /// allocator hands them out again: the program's free, `realloc` and
    /// `malloc_usable_size` of such a block were double frees (review helper 129: thousands
    /// of findings in a correct program, each `realloc` refused, the blocks leaked). With
    /// the ring full the spy is not told, and the block is counted ([`Self::untold_blocks`]).
    /// Not for an observing spy, which keeps no block.
    fn served_unseen(&self, ptr: *mut c_void) {
        if self.has_spy() && self.spy_interposes.load(Ordering::Relaxed) && !self.served.park(ptr, Entry::Malloc) {
            self.untold.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Blocks served where no spy code could run that the spy was not told of (the ring was
    /// full): said at exit, as a guard's findings about them may be wrong.
    pub(crate) fn untold_blocks(&self) -> usize {
        self.untold.load(Ordering::Relaxed)
    }

    /// The real call behind an allocating request of `size` real bytes.
    #[inline(always)]
    fn real_alloc(&self, req: &AllocRequest, size: usize) -> Outcome {
        let ptr = match req.kind {
            Kind::Malloc => self.heap.malloc(size),
            Kind::Calloc { nmemb, elem } => {
                if size == req.size {
                    self.heap.calloc(nmemb, elem)
                } else {
                    self.heap.calloc(1, size)
                }
            }
            Kind::Memalign => self.heap.memalign(req.align, size),
            Kind::AlignedAlloc => self.heap.aligned_alloc(req.align, size),
            Kind::Valloc => self.heap.valloc(size),
            Kind::Pvalloc => self.heap.pvalloc(size),
            Kind::PosixMemalign => {
                let mut out = null();
                // SAFETY: `out` is a local.
                let rc = unsafe { self.heap.posix_memalign(&mut out, req.align, size) };
                return if rc == 0 { Outcome { ptr: out, err: 0 } } else { Outcome::failed(rc) };
            }
        };
        Outcome { ptr, err: if ptr.is_null() { os::errno() } else { 0 } }
    }

    /// The error of a request that a spy refused: ENOMEM, unless the caller chose an alignment
    /// (`align` 0 included) that the real allocator rejects. It is asked for one byte at that
    /// alignment, not the refused size: refusing a gigabyte allocated one, and a huge `calloc`
    /// was zeroed, only to learn the error. Not for a power of two from 8 up, which every
    /// allocator takes: one byte at a terabyte's alignment maps two (review helper 81).
    fn refusal_error(&self, req: &AllocRequest) -> c_int {
        let accepted_everywhere = alignment_accepted(req.align);
        if accepted_everywhere || !matches!(req.kind, Kind::Memalign | Kind::AlignedAlloc | Kind::PosixMemalign) {
            return libc::ENOMEM;
        }
        let probe = self.real_alloc(req, 1);
        // SAFETY: the probe block (or NULL) was just allocated by the real heap, never shared.
        unsafe { self.heap.free(probe.ptr) };
        if probe.ptr.is_null() { probe.err } else { libc::ENOMEM }
    }

    /// An allocating call served by the real allocator alone, after spy code may have
    /// disturbed errno.
    fn alloc_unspied(&self, req: &AllocRequest, saved_errno: c_int) -> Outcome {
        os::set_errno(saved_errno);
        self.real_alloc(req, req.size)
    }

    /// Reports a failed allocating call: errno, or the return value of posix_memalign, which
    /// sets errno too when memory runs out (glibc's does, by way of its allocator) and leaves it
    /// for a bad alignment.
    fn fail(&self, req: &AllocRequest, err: c_int) -> Outcome {
        if !matches!(req.kind, Kind::PosixMemalign) || err == libc::ENOMEM {
            os::set_errno(err);
        }
        Outcome::failed(err)
    }

    /// Whether a spy is registered, or a revoked one still pending.
    pub(crate) fn has_spy(&self) -> bool {
        !self.registry.is_empty()
    }

    /// Whether an allocation ever reached a registered spy. Every thread's first allocation
    /// under a spy comes this way, whatever the entry (the gate lets a thread through only
    /// once the spy has set it up here); none does when another module's malloc family comes
    /// first in the process's lookup order and serves the calls itself.
    pub(crate) fn reached_a_spy(&self) -> bool {
        self.reached.load(Ordering::Relaxed)
    }

    /// Whether a revoke took the built-in spies (see `builtin_revoked`).
    pub(crate) fn builtin_revoked(&self) -> bool {
        self.builtin_revoked.load(Ordering::Relaxed)
    }

    /// Allocations made by signal handlers inside a hook so far, which no spy saw: calls and
    /// bytes.
    pub(crate) fn unseen(&self) -> (u64, u64) {
        (self.unseen_calls.load(Ordering::Relaxed), self.unseen_bytes.load(Ordering::Relaxed))
    }

    /// Counts an allocation of `size` bytes that no spy sees, if a signal handler that
    /// interrupted a hook made it, or one on a small alternate stack (not mallocspy's own, nor
    /// one on a thread without a slot: [`crate::threads::unspied_calls`] counts those).
    fn note_unseen(&self, size: usize) {
        let ts = tls::state();
        if ts.depth.get() == tls::UNSPIED {
            // Looking for a signal frame makes system calls, which kill this thread.
            return;
        }
        // Above every frame of the hook: the caller's stack pointer at the export, if known.
        let hook_sp = match ts.scope_sp.get() {
            0 => 0,
            scope_sp => scope_sp.max(ts.hook_sp.get()),
        };
        let interrupted_a_hook = ts.depth.get() != 0 && crate::signal_frames::handler_interrupted(hook_sp);
        if interrupted_a_hook || crate::alt_stack::little_room(ts, crate::unwind::current_sp()) {
            self.unseen_calls.fetch_add(1, Ordering::Relaxed);
            self.unseen_bytes.fetch_add(size as u64, Ordering::Relaxed);
        }
    }

    /// An allocating call while a spy may be registered.
    fn alloc(&self, req: AllocRequest) -> Outcome {
        let Some(scope) = Scope::enter() else {
            let out = self.real_alloc(&req, req.size);
            if !out.ptr.is_null() {
                self.note_unseen(req.size);
                self.served_unseen(out.ptr);
            }
            return out;
        };
        if self.has_parked() {
            self.drain_deferred(&scope);
        }
        let Some(cell) = self.registry.current().filter(|c| c.is_active()) else {
            // One revoked from another spy's method (or from a signal handler) would otherwise
            // stay registered for good: see `revoked_in_hook`.
            if let Some(revoked) = self.take_orphan() {
                self.retire(revoked, &scope);
            }
            return self.real_alloc(&req, req.size);
        };
        // Read first: the line stays shared between the threads, written once.
        if !self.reached.load(Ordering::Relaxed) {
            self.reached.store(true, Ordering::Relaxed);
        }
        let out =
            if cell.observes { self.alloc_observed(cell, &scope, &req) } else { self.alloc_with(cell, &scope, &req) };
        self.retire(cell, &scope);
        out
    }

    /// An allocating call under an observing spy: the real call, then `after_call`.
    fn alloc_observed(&self, cell: &SpyCell, scope: &Scope, req: &AllocRequest) -> Outcome {
        let r = self.real_alloc(req, req.size);
        let err = os::errno();
        let call = Call {
            entry: req.entry,
            size: req.asked,
            align: req.align,
            ptr: null(),
            result: r.ptr,
            failed: r.ptr.is_null(),
        };
        self.observe(cell, scope, call);
        os::set_errno(err);
        r
    }

    fn alloc_with(&self, cell: &SpyCell, scope: &Scope, req: &AllocRequest) -> Outcome {
        let saved = os::errno();
        let aligned = req.align != 0;
        let call =
            |result, failed| Call { entry: req.entry, size: req.asked, align: req.align, ptr: null(), result, failed };

        // The alignment the block gets: glibc's memalign rounds the caller's up to a power of
        // two (and posix_memalign and aligned_alloc refuse one that is not).
        let align = align_pow2(req.align);
        let pre = cell.call_adding(|spy| {
            spy.before_alloc(req.entry);
            if aligned { spy.pre_alloc_aligned(req.size, align) } else { spy.pre_alloc(req.size) }
        });
        let Ok(size) = pre else {
            self.disable(cell, scope);
            return self.alloc_unspied(req, saved);
        };
        if size == 0 && req.size != 0 {
            os::set_errno(saved);
            let err = self.refusal_error(req);
            self.observe(cell, scope, call(null(), true));
            return self.fail(req, err);
        }

        os::set_errno(saved);
        let real = self.real_alloc(req, size);
        let post =
            cell.call_adding(
                |spy| if aligned { spy.post_alloc_aligned(real.ptr, align) } else { spy.post_alloc(real.ptr) },
            );
        let Ok(ptr) = post else {
            // The spy's layout is unknown: the real block goes to the caller, unspied.
            self.disable(cell, scope);
            return if real.ptr.is_null() { self.fail(req, real.err) } else { real };
        };
        if ptr.is_null() {
            self.observe(cell, scope, call(null(), true));
            return self.fail(req, if real.ptr.is_null() { real.err } else { libc::ENOMEM });
        }
        let aligned_ok = keeps_alignment(ptr, real.ptr, req.align);
        if !aligned_ok || !self.spied.insert(ptr as usize, req.size) {
            if aligned_ok {
                self.say_table_full();
            } else {
                cell.report_misaligned();
            }
            self.undo(cell, ptr);
            let unspied = self.alloc_unspied(req, saved);
            if !unspied.ptr.is_null() && cell.call(|spy| spy.served_unspied(unspied.ptr)).is_err() {
                self.disable(cell, scope);
            }
            // As the caller saw it, as a `realloc` served so is: `after_call` saw the block's
            // free and not its allocation (review helper 129).
            let err = os::errno();
            self.observe(cell, scope, call(unspied.ptr, unspied.ptr.is_null()));
            os::set_errno(err);
            return unspied;
        }
        self.observe(cell, scope, call(ptr, false));
        os::set_errno(saved);
        Outcome { ptr, err: 0 }
    }

    /// Says, once, that the table of spied blocks could not grow.
    fn say_table_full(&self) {
        if !self.table_full.swap(true, Ordering::Relaxed) {
            sink::to_stderr(
                b"mallocspy: no room left for the live-block table: blocks allocated or reallocated from now on \
                  may go unspied\n",
            );
        }
    }

    /// Gives a block the spy laid out back through the spy (it never reached the caller).
    fn undo(&self, cell: &SpyCell, ptr: *mut c_void) {
        if let Ok(real) = cell.call(|spy| spy.pre_free(ptr, true)) {
            // SAFETY: `real` is the spy's answer for a block it just laid out.
            unsafe { self.heap.free(real) };
            let _ = cell.call(|spy| spy.post_free(true));
        }
    }

    /// `free` (or `operator delete`: `entry`) while a spy may be registered. errno is restored
    /// by the caller.
    ///
    /// # Safety
    /// `ptr` is NULL or a live block of this allocator.
    unsafe fn free_spied(&self, entry: Entry, ptr: *mut c_void) {
        let Some(scope) = Scope::enter() else {
            // SAFETY: the caller's guarantee.
            return unsafe { self.free_nested(entry, ptr) };
        };
        if self.has_parked() {
            self.drain_deferred(&scope);
        }
        // The spy is looked up before the block leaves the table. Once it has, another thread's
        // free of a revoked spy's last block may take the spy out of the registry (and wait for
        // this hook to end before dropping it); a block the spy laid out must still go back
        // through it, not to the real allocator at the caller's pointer.
        let cell = self.registry.current();
        let spied = self.take_spied(cell, ptr).is_some();
        #[cfg(test)]
        tests::after_taking(ptr);
        // SAFETY: the caller's guarantee.
        unsafe { self.release(&scope, cell, entry, ptr, spied, true) }
    }

    /// Returns `ptr`, already removed from the spied table of `cell` (the spy current before
    /// it was; `spied` says whether it was in it), to the real allocator through the spy, as
    /// `entry` (free, or realloc to 0). `observe`: report the call with `after_call` (not for
    /// frees parked by nested calls).
    ///
    /// # Safety
    /// `ptr` is NULL or a live block of this allocator, dead afterwards.
    unsafe fn release(
        &self,
        scope: &Scope,
        cell: Option<&SpyCell>,
        entry: Entry,
        ptr: *mut c_void,
        spied: bool,
        observe: bool,
    ) {
        let Some(cell) = cell.filter(|c| spied || c.is_active()) else {
            // SAFETY: unspied block: a real block.
            return unsafe { self.heap.free(ptr) };
        };
        if cell.observes {
            if !ptr.is_null() && cell.call(|spy| spy.before_release(entry, ptr, false)).is_err() {
                self.disable(cell, scope);
            }
            // SAFETY: nothing changes pointers under an observer: a real block.
            unsafe { self.heap.free(ptr) };
        } else {
            // SAFETY: the caller's guarantee.
            unsafe { self.release_with(cell, scope, entry, ptr, spied) };
        }
        if observe {
            self.observe(cell, scope, Call { entry, size: 0, align: 0, ptr, result: null(), failed: false });
        }
        self.retire(cell, scope);
    }

    /// # Safety
    /// As [`Self::release`].
    unsafe fn release_with(&self, cell: &SpyCell, scope: &Scope, entry: Entry, ptr: *mut c_void, spied: bool) {
        if ptr.is_null() {
            return;
        }
        let before = cell.call(|spy| spy.before_release(entry, ptr, spied));
        let real = cell.call(|spy| spy.pre_free(ptr, spied));
        match real {
            // SAFETY: the spy's answer for a block of its own, or the caller's block.
            Ok(real) => unsafe { self.heap.free(real) },
            // SAFETY: unspied: the caller's pointer is the real one (the caller's guarantee).
            Err(_) if !spied => unsafe { self.heap.free(ptr) },
            // Spied: its real start is unknown; leaking it is the safe side.
            Err(_) => {}
        }
        let after = cell.call(|spy| spy.post_free(spied));
        if before.is_err() || real.is_err() || after.is_err() {
            self.disable(cell, scope);
        }
    }

    /// A free from inside a hook, or from a thread without a slot: no spy code may run.
    ///
    /// # Safety
    /// `ptr` is NULL or a live block of this allocator.
    unsafe fn free_nested(&self, entry: Entry, ptr: *mut c_void) {
        if ptr.is_null() {
            return;
        }
        match self.spied.try_get(ptr as usize) {
            Lookup::Absent => {
                crate::spies::ticks::released_unseen(ptr as usize);
                crate::spies::leaks::released_unseen(ptr as usize);
                // SAFETY: unspied: a real block.
                unsafe { self.heap.free(ptr) }
            }
            Lookup::Found(_) | Lookup::Busy => {
                self.deferred.push(ptr, entry);
            }
        }
    }

    /// `realloc`/`reallocarray` while a spy may be registered.
    ///
    /// # Safety
    /// `ptr` is NULL or a live block of this allocator.
    unsafe fn realloc_spied(&self, entry: Entry, ptr: *mut c_void, size: usize) -> *mut c_void {
        if ptr.is_null() {
            return self.alloc(AllocRequest { entry, kind: Kind::Malloc, size, asked: size, align: 0 }).ptr;
        }
        let saved = os::errno();
        let Some(scope) = Scope::enter() else {
            // SAFETY: the caller's guarantee.
            return unsafe { self.realloc_nested(ptr, size) };
        };
        if self.has_parked() {
            self.drain_deferred(&scope);
        }
        // Looked up before the block leaves the table, as in `free_spied`.
        let cell = self.registry.current();
        let held = (size != 0).then(|| Reallocating::new(&self.reallocating, &self.reallocs_done));
        let old_size = self.take_spied(cell, ptr);
        #[cfg(test)]
        tests::after_taking(ptr);
        let spied = old_size.is_some();
        if size == 0 && self.heap.realloc_zero_frees() {
            // As the real realloc(p, 0) does: free, return NULL.
            // SAFETY: the caller's guarantee.
            unsafe { self.release(&scope, cell, entry, ptr, spied, true) };
            os::set_errno(saved);
            return null();
        }
        let Some(cell) = cell.filter(|c| spied || c.is_active()) else {
            // Not a block of the revoked spy's: no longer in flight. The spy's last free may
            // have counted this call among its live blocks and left the release to it.
            drop(held);
            if let Some(revoked) = cell {
                self.retire(revoked, &scope);
            }
            // SAFETY: unspied: a real block.
            return unsafe { self.heap.realloc(ptr, size) };
        };
        let new = if cell.observes {
            // SAFETY: the caller's guarantee.
            unsafe { self.realloc_observed(cell, &scope, entry, ptr, size) }
        } else {
            // SAFETY: the caller's guarantee.
            unsafe { self.realloc_with(cell, &scope, entry, ptr, size, old_size, saved) }
        };
        drop(held);
        self.retire(cell, &scope);
        new
    }

    /// `realloc` under an observing spy: `before_release`, the real call, `after_call`.
    ///
    /// # Safety
    /// `ptr` is a live block of this allocator.
    unsafe fn realloc_observed(
        &self,
        cell: &SpyCell,
        scope: &Scope,
        entry: Entry,
        ptr: *mut c_void,
        size: usize,
    ) -> *mut c_void {
        if cell.call(|spy| spy.before_release(entry, ptr, false)).is_err() {
            self.disable(cell, scope);
        }
        // SAFETY: the caller's guarantee; under an observer every block is a real block.
        let new = unsafe { self.heap.realloc(ptr, size) };
        let err = os::errno();
        self.observe(cell, scope, Call { entry, size, align: 0, ptr, result: new, failed: new.is_null() });
        os::set_errno(err);
        new
    }

    /// # Safety
    /// `ptr` is a live block of this allocator, removed from the spied table (`old_size` is
    /// its entry).
    #[allow(clippy::too_many_arguments)]
    unsafe fn realloc_with(
        &self,
        cell: &SpyCell,
        scope: &Scope,
        entry: Entry,
        ptr: *mut c_void,
        size: usize,
        old_size: Option<usize>,
        saved: c_int,
    ) -> *mut c_void {
        let spied = old_size.is_some();
        // The old block stays the caller's whenever the call fails.
        let keep_old = || {
            if let Some(old) = old_size {
                self.spied.insert(ptr as usize, old);
            }
        };
        let failed = |err: c_int| {
            self.observe(cell, scope, Call { entry, size, align: 0, ptr, result: null(), failed: true });
            os::set_errno(err);
            null()
        };
        let unspied = || {
            keep_old();
            self.disable(cell, scope);
            if !spied {
                // SAFETY: unspied: a real block (the caller's guarantee).
                return unsafe { self.heap.realloc(ptr, size) };
            }
            // Where the spy laid the block out is its own knowledge: the caller's bytes move
            // to a real block, and the old one goes back through the spy with the parked
            // frees (a spy that fails again there leaks it). The call failed instead, and a
            // Rust program aborts when `realloc` fails (review helper 94).
            // SAFETY: the caller's guarantee; the block is in the table again.
            unsafe { self.realloc_nested(ptr, size) }
        };

        if cell.call(|spy| spy.before_release(entry, ptr, spied)).is_err() {
            return unspied();
        }
        let Ok((real, real_size)) = cell.call_adding(|spy| spy.pre_realloc(ptr, size, spied)) else { return unspied() };
        if real_size == 0 && size != 0 {
            keep_old();
            return failed(libc::ENOMEM);
        }
        os::set_errno(saved);
        // SAFETY: `real` is the spy's real block for the caller's live block.
        let moved = unsafe { self.heap.realloc(real, real_size) };
        let err = if moved.is_null() { os::errno() } else { 0 };
        let Ok(new) = cell.call_adding(|spy| spy.post_realloc(moved, spied)) else {
            if moved.is_null() {
                keep_old();
                self.disable(cell, scope);
                return failed(err);
            }
            self.disable(cell, scope);
            // The real block goes to the caller, unspied. Its layout is the spy's, unknown but
            // for where `pre_realloc` said the caller's bytes began in the old block: at the
            // same offset in this one. Moved to its start, they are the caller's again (handed
            // over as it was, the block began with the spy's header, and every byte the
            // caller read was shifted).
            let offset = (ptr as usize).wrapping_sub(real as usize);
            if offset != 0 && offset < real_size {
                let kept = size.min(real_size - offset).min(old_size.unwrap_or(usize::MAX));
                // SAFETY: `moved` holds `real_size` bytes, of which `kept` from `offset` on.
                unsafe { core::ptr::copy(moved.cast::<u8>().add(offset), moved.cast::<u8>(), kept) };
            }
            return moved;
        };
        if new.is_null() {
            if moved.is_null() {
                keep_old();
            }
            return failed(if moved.is_null() { err } else { libc::ENOMEM });
        }
        let aligned_ok = keeps_alignment(new, moved, 0);
        let mut new = new;
        // A misaligned block is not given out, as an allocation's is not: it was, though the
        // message said it was served unspied. No room to record the block either: kept in the
        // spy's layout and unknown here, its free reached the real allocator at the spy's
        // offset, and glibc aborted (review helper 38). Either way the caller gets an unspied
        // copy, and the spy's block goes back through the spy.
        if !aligned_ok || !self.spied.insert(new as usize, size) {
            if aligned_ok {
                self.say_table_full();
            } else {
                cell.report_misaligned();
            }
            let copy = self.heap.malloc(size);
            if !copy.is_null() {
                // SAFETY: the spy laid out `new` with `size` bytes for the caller, and `copy`
                // is a fresh real block of `size` bytes: distinct, both that large.
                unsafe { core::ptr::copy_nonoverlapping(new.cast::<u8>(), copy.cast::<u8>(), size) };
                self.undo(cell, new);
                if cell.call(|spy| spy.served_unspied(copy)).is_err() {
                    self.disable(cell, scope);
                }
                new = copy;
            } else if !aligned_ok {
                // No copy to give: the spy's block after all, recorded so that its free goes
                // back through the spy.
                self.spied.insert(new as usize, size);
            }
        }
        self.observe(cell, scope, Call { entry, size, align: 0, ptr, result: new, failed: false });
        os::set_errno(saved);
        new
    }

    /// `realloc` from inside a hook or a thread without a slot: no spy code may run, so a
    /// spied block is copied into an unspied one and its free is parked.
    ///
    /// # Safety
    /// `ptr` is a live block of this allocator.
    unsafe fn realloc_nested(&self, ptr: *mut c_void, size: usize) -> *mut c_void {
        match self.spied.try_get(ptr as usize) {
            Lookup::Absent => {
                let record = crate::spies::leaks::released_unseen(ptr as usize);
                // SAFETY: unspied: a real block.
                let new = unsafe { self.heap.realloc(ptr, size) };
                if !new.is_null() || size == 0 {
                    crate::spies::ticks::released_unseen(ptr as usize);
                } else {
                    crate::spies::leaks::restore_unseen(record);
                }
                if ptr.is_null() && !new.is_null() {
                    self.note_unseen(size);
                }
                if !new.is_null() {
                    self.served_unseen(new);
                }
                new
            }
            Lookup::Found(old) => {
                if size == 0 && self.heap.realloc_zero_frees() {
                    self.deferred.push(ptr, Entry::Free);
                    return null();
                }
                let new = self.heap.malloc(size);
                if !new.is_null() {
                    self.note_unseen(size);
                    // SAFETY: the old block holds `old` caller bytes, the new one `size`.
                    unsafe { core::ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast::<u8>(), old.min(size)) };
                    self.deferred.push(ptr, Entry::Free);
                    self.served_unseen(new);
                }
                new
            }
            Lookup::Busy => {
                os::set_errno(libc::ENOMEM);
                null()
            }
        }
    }

    /// `malloc_usable_size` while a spy may be registered.
    ///
    /// # Safety
    /// `ptr` is NULL or a live block of this allocator.
    unsafe fn usable_size_spied(&self, ptr: *mut c_void) -> usize {
        let Some(scope) = Scope::enter() else {
            return match self.spied.try_get(ptr as usize) {
                Lookup::Found(size) => size,
                // SAFETY: unspied: a real block.
                Lookup::Absent => unsafe { self.heap.usable_size(ptr) },
                Lookup::Busy => 0,
            };
        };
        if self.has_parked() {
            // A block served where no spy could run may be the one measured.
            self.drain_deferred(&scope);
        }
        let recorded = if ptr.is_null() || !self.tracking() { None } else { self.spied.get(ptr as usize) };
        let spied = recorded.is_some();
        let Some(cell) = self.registry.current().filter(|c| spied || c.is_active()) else {
            // SAFETY: unspied: a real block.
            return unsafe { self.heap.usable_size(ptr) };
        };
        let size = if cell.observes {
            // SAFETY: the caller's guarantee; under an observer every block is a real block.
            unsafe { self.heap.usable_size(ptr) }
        } else {
            // SAFETY: the caller's guarantee.
            unsafe { self.usable_size_with(cell, &scope, ptr, spied, recorded) }
        };
        self.observe(
            cell,
            &scope,
            Call { entry: Entry::MallocUsableSize, size: 0, align: 0, ptr, result: null(), failed: false },
        );
        self.retire(cell, &scope);
        size
    }

    /// # Safety
    /// `ptr` is NULL or a live block of this allocator.
    unsafe fn usable_size_with(
        &self,
        cell: &SpyCell,
        scope: &Scope,
        ptr: *mut c_void,
        spied: bool,
        recorded: Option<usize>,
    ) -> usize {
        if ptr.is_null() {
            return 0;
        }
        let Ok(real) = cell.call(|spy| spy.pre_get_size(ptr, spied)) else {
            self.disable(cell, scope);
            // SAFETY: unspied: a real block. Spied: the recorded size is what the caller may use.
            return recorded.unwrap_or_else(|| unsafe { self.heap.usable_size(ptr) });
        };
        // SAFETY: the spy's real block for the caller's live block.
        let actual = unsafe { self.heap.usable_size(real) };
        cell.call(|spy| spy.post_get_size(actual, spied)).unwrap_or_else(|_| {
            self.disable(cell, scope);
            recorded.unwrap_or(actual)
        })
    }
}

/// A realloc counted in `Interposer::reallocating` while it lives; at its end, counted in
/// `Interposer::reallocs_done` first.
struct Reallocating<'a> {
    count: &'a AtomicUsize,
    done: &'a AtomicUsize,
}

impl<'a> Reallocating<'a> {
    fn new(count: &'a AtomicUsize, done: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self { count, done }
    }
}

impl Drop for Reallocating<'_> {
    fn drop(&mut self) {
        self.done.fetch_add(1, Ordering::SeqCst);
        self.count.fetch_sub(1, Ordering::SeqCst);
    }
}

#[inline(always)]
const fn null() -> *mut c_void {
    core::ptr::null_mut()
}

#[cfg(test)]
#[path = "dispatch_tests.rs"]
mod tests;
