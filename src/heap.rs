//! The real allocator: the [`Heap`] interface the dispatcher forwards to, and [`NextHeap`], the
//! next allocator in the dynamic linker's lookup order.
//!
//! Forwarding to `__libc_malloc` would break targets that link or preload another allocator
//! (a jemalloc-linked program crashed when memory came from glibc); `dlsym(RTLD_NEXT, ...)`
//! finds whichever allocator comes after the interposer, so mallocspy composes with jemalloc
//! and tcmalloc. Lookup is lazy, on the first call: the dynamic loader and the constructors of
//! libraries initialised before ours allocate before any constructor of ours runs.
//!
//! Every function is taken from the module that provides `malloc`. One the module lacks
//! (jemalloc has no `pvalloc`) is built from the ones it has, never taken from another
//! allocator: a block from glibc freed by jemalloc would corrupt both.

use core::cell::UnsafeCell;
use core::ffi::{CStr, c_int, c_void};
use core::sync::atomic::{AtomicPtr, AtomicU8, AtomicUsize, Ordering, fence};

use crate::spy::Entry;
use crate::tls::in_real_allocator;
use crate::{bootstrap, early, os, sink};

/// The allocator underneath the spy. Implementations have the C functions' semantics.
///
/// # Safety
/// Implementations must behave as the C functions of the same names: blocks from any of the
/// allocating functions may be passed to `free`, `realloc` and `usable_size` of the same heap.
pub(crate) unsafe trait Heap: Sync {
    fn malloc(&self, size: usize) -> *mut c_void;
    fn calloc(&self, nmemb: usize, size: usize) -> *mut c_void;
    /// # Safety
    /// `ptr` is NULL or a live block of this heap.
    unsafe fn realloc(&self, ptr: *mut c_void, size: usize) -> *mut c_void;
    /// # Safety
    /// `ptr` is NULL or a live block of this heap, which is dead afterwards.
    unsafe fn free(&self, ptr: *mut c_void);
    fn memalign(&self, align: usize, size: usize) -> *mut c_void;
    fn aligned_alloc(&self, align: usize, size: usize) -> *mut c_void;
    /// Returns 0 or an error number; stores the block in `*out` on success.
    ///
    /// # Safety
    /// `out` is valid for a write.
    unsafe fn posix_memalign(&self, out: *mut *mut c_void, align: usize, size: usize) -> c_int;
    fn valloc(&self, size: usize) -> *mut c_void;
    fn pvalloc(&self, size: usize) -> *mut c_void;
    /// # Safety
    /// `ptr` is NULL or a live block of this heap.
    unsafe fn usable_size(&self, ptr: *mut c_void) -> usize;
    fn trim(&self, pad: usize) -> c_int;
    /// C++'s `operator new` (`entry`) with no spy registered: `malloc`, or `memalign` for a
    /// non-zero `align`.
    fn operator_new(&self, _entry: Entry, size: usize, align: usize) -> *mut c_void {
        if align == 0 { self.malloc(size) } else { self.memalign(align, size) }
    }
    /// Whether `realloc(p, 0)` frees `p` and returns NULL (glibc's choice) rather than
    /// returning a minimum-size block.
    fn realloc_zero_frees(&self) -> bool;
}

type MallocFn = unsafe extern "C" fn(usize) -> *mut c_void;
type CallocFn = unsafe extern "C" fn(usize, usize) -> *mut c_void;
type ReallocFn = unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void);
type AlignFn = unsafe extern "C" fn(usize, usize) -> *mut c_void;
type PosixMemalignFn = unsafe extern "C" fn(*mut *mut c_void, usize, usize) -> c_int;
type UsableSizeFn = unsafe extern "C" fn(*mut c_void) -> usize;
type TrimFn = unsafe extern "C" fn(usize) -> c_int;

#[repr(C)]
struct Fns {
    // The most called first (they share the interposer's first cache line).
    free: FreeFn,
    malloc: MallocFn,
    realloc: ReallocFn,
    calloc: CallocFn,
    memalign: Option<AlignFn>,
    aligned_alloc: Option<AlignFn>,
    posix_memalign: Option<PosixMemalignFn>,
    valloc: Option<MallocFn>,
    pvalloc: Option<MallocFn>,
    usable_size: Option<UsableSizeFn>,
    trim: Option<TrimFn>,
}

const UNRESOLVED: u8 = 0;
const RESOLVING: u8 = 1;
const READY: u8 = 2;
const FAILED: u8 = 3;

/// The allocator that comes after the interposer in the lookup order.
///
/// `repr(C)`: the real `free` and `malloc`, and the state the other calls check before
/// theirs, come first, on the interposer's first cache line.
///
/// There is one: [`crate::global::GLOBAL`]'s. Its four most called functions start as the
/// `*_first` functions below, which look the real allocator up, and become the real ones: a
/// call loads one word and jumps, with nothing to check first. `free` and `realloc` must
/// also recognise the blocks of the bootstrap arena; they go straight to the real functions
/// only while the arena has handed out none (see [`NextHeap::alloc_from_arena`]), which is the
/// usual case: the arena serves only the calls made while the lookup runs, and glibc's
/// `dlsym` makes none.
#[repr(C)]
pub(crate) struct NextHeap {
    free_fn: AtomicPtr<()>,
    malloc_fn: AtomicPtr<()>,
    realloc_fn: AtomicPtr<()>,
    calloc_fn: AtomicPtr<()>,
    state: AtomicU8,
    fns: UnsafeCell<Option<Fns>>,
    /// What `realloc(p, 0)` does, asked on first need (asking allocates, and a pass-through
    /// must not disturb the heap it forwards to): 0 unknown, 1 frees, 2 allocates.
    realloc_zero: AtomicU8,
}

/// The process's next heap, which the `*_first` functions resolve.
fn next_heap() -> &'static NextHeap {
    &crate::global::GLOBAL.heap
}

/// The first `malloc`, and every `malloc` until a spy is registered (see `early.rs`):
/// resolves the real functions (see [`NextHeap`]). Entered by a jump from the export, with
/// the caller's return address on top of the stack, which it passes on.
#[unsafe(naked)]
extern "C" fn malloc_first(size: usize) -> *mut c_void {
    core::arch::naked_asm!("mov rsi, qword ptr [rsp]", "jmp {malloc}", malloc = sym malloc_first_for)
}

/// [`malloc_first`], told where the call returns to.
extern "C" fn malloc_first_for(size: usize, caller: u64) -> *mut c_void {
    noted(next_heap().malloc_unresolved(size), size, Entry::Malloc, || caller)
}

/// The first `calloc`, and every `calloc` until a spy is registered.
extern "C" fn calloc_first(nmemb: usize, size: usize) -> *mut c_void {
    let p = next_heap().calloc_unresolved(nmemb, size);
    noted(p, nmemb.saturating_mul(size), Entry::Calloc, early::caller_of_hook)
}

/// The first `realloc`, and every `realloc` until a spy is registered or while the arena is
/// in use.
///
/// # Safety
/// `ptr` is NULL or a live block of the next heap (or of the arena).
unsafe extern "C" fn realloc_first(ptr: *mut c_void, size: usize) -> *mut c_void {
    // Forgotten before the block moves: once it has, its old address may be another
    // thread's new block, whose entry this would erase.
    let old = early::freed(ptr);
    // SAFETY: the caller's guarantee.
    let p = unsafe { next_heap().realloc_unresolved(ptr, size) };
    if p.is_null() && size != 0 {
        // Failed: the block is still there.
        if let Some(old) = old {
            early::restore(ptr, old);
        }
    } else {
        noted(p, size, Entry::Realloc, early::caller_of_hook);
    }
    p
}

/// The first `free`, and every `free` until a spy is registered or while the arena is in
/// use.
///
/// # Safety
/// `ptr` is NULL or a live block of the next heap (or of the arena), dead afterwards.
unsafe extern "C" fn free_first(ptr: *mut c_void) {
    if early::freed(ptr).is_some() {
        early::freed_by_free();
    }
    // SAFETY: the caller's guarantee.
    unsafe { next_heap().free_unresolved(ptr) }
}

/// `p`, noted as a block of `size` bytes from `entry` for `caller` while no spy is
/// registered yet (see `early.rs`). The caller is found only then: the aligned family passes
/// through here on every call.
fn noted(p: *mut c_void, size: usize, entry: Entry, caller: impl FnOnce() -> u64) -> *mut c_void {
    if early::recording() && !bootstrap::contains(p) {
        early::allocated(p, size, entry, caller());
    }
    p
}

// SAFETY: `fns` is written once, by the thread that moved `state` to RESOLVING, before it
// publishes READY with Release; it is read only after an Acquire load sees READY.
unsafe impl Sync for NextHeap {}

/// Looks `name` up after the calling module.
fn next_symbol(name: &CStr) -> *mut c_void {
    // SAFETY: name is NUL-terminated; RTLD_NEXT is valid from a module loaded by ld.so.
    unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) }
}

/// The C library's module: the one of its `exit` (0 if unknown). Asks the loader.
fn libc_module() -> usize {
    os::module_of(libc::exit as *const c_void)
}

/// Resolves the allocator after ours, keeping to the module that provides `malloc`.
fn resolve() -> Option<Fns> {
    let mut malloc = next_symbol(c"malloc");
    let mut prefix_libc = false;
    if malloc.is_null() {
        malloc = next_symbol(c"__libc_malloc");
        prefix_libc = true;
    }
    if malloc.is_null() {
        return None;
    }
    let home = os::module_of(malloc);
    let same_module = |name: &CStr| -> *mut c_void {
        let f = next_symbol(name);
        if f.is_null() || (home != 0 && os::module_of(f) != home) { core::ptr::null_mut() } else { f }
    };
    let (calloc, realloc, free) = if prefix_libc {
        (same_module(c"__libc_calloc"), same_module(c"__libc_realloc"), same_module(c"__libc_free"))
    } else {
        (same_module(c"calloc"), same_module(c"realloc"), same_module(c"free"))
    };
    if calloc.is_null() || realloc.is_null() || free.is_null() {
        return None;
    }
    let memalign = same_module(if prefix_libc { c"__libc_memalign" } else { c"memalign" });
    // glibc's C library never defines C++'s operators, and a C program loads no module that
    // does: asking for a name no module defines makes `dlsym` allocate its error's state, from
    // the bootstrap arena at this point, and then every `free` and `realloc` of the run went
    // through the arena's check (`free_first`: 13 instructions more per allocator call of
    // churn, sqlite3 and python3 under `spy=ticks`, cachegrind; from 8d04ba0 until this check).
    if home != libc_module() && !same_module(c"_Znwm").is_null() {
        let (low, high) = os::module_span(malloc);
        ALLOCATOR_WITH_OPERATORS[0].store(low, Ordering::Relaxed);
        ALLOCATOR_WITH_OPERATORS[1].store(high, Ordering::Relaxed);
    }
    // SAFETY: each pointer is the address of the C function of that name, whose C signature
    // is the target type; null pointers become None.
    let fns = unsafe {
        Fns {
            malloc: core::mem::transmute::<*mut c_void, MallocFn>(malloc),
            calloc: core::mem::transmute::<*mut c_void, CallocFn>(calloc),
            realloc: core::mem::transmute::<*mut c_void, ReallocFn>(realloc),
            free: core::mem::transmute::<*mut c_void, FreeFn>(free),
            memalign: core::mem::transmute::<*mut c_void, Option<AlignFn>>(memalign),
            aligned_alloc: core::mem::transmute::<*mut c_void, Option<AlignFn>>(same_module(c"aligned_alloc")),
            posix_memalign: core::mem::transmute::<*mut c_void, Option<PosixMemalignFn>>(same_module(
                c"posix_memalign",
            )),
            valloc: core::mem::transmute::<*mut c_void, Option<MallocFn>>(same_module(c"valloc")),
            pvalloc: core::mem::transmute::<*mut c_void, Option<MallocFn>>(same_module(c"pvalloc")),
            usable_size: core::mem::transmute::<*mut c_void, Option<UsableSizeFn>>(same_module(c"malloc_usable_size")),
            trim: core::mem::transmute::<*mut c_void, Option<TrimFn>>(same_module(c"malloc_trim")),
        }
    };
    Some(fns)
}

/// Where the next allocator's module lies, when it defines C++'s operators too (tcmalloc,
/// jemalloc): `[low, high)`, else empty.
static ALLOCATOR_WITH_OPERATORS: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

/// Whether `code` is the next allocator's, when that allocator defines C++'s operators too.
/// Its own calls of `operator new` then go to its own operator, unseen, as they did before
/// the shim exported one: tcmalloc's start-up `new`s a default `MallocExtension` that it
/// overwrites, a leak of its own in every program's report. `code` is asked for only then.
#[inline(always)]
pub(crate) fn is_code_of_an_allocator_with_operators(code: impl FnOnce() -> u64) -> bool {
    // Resolved first: the allocator's first call may be its own `new`.
    let _ = next_heap().fns();
    let high = ALLOCATOR_WITH_OPERATORS[1].load(Ordering::Relaxed);
    high != 0 && (ALLOCATOR_WITH_OPERATORS[0].load(Ordering::Relaxed)..high).contains(&(code() as usize))
}

/// Asks the allocator what `realloc(p, 0)` does, so that a spied `realloc(p, 0)` does the same.
fn probe_realloc_zero(fns: &Fns) -> bool {
    // SAFETY: the functions belong to one allocator; the block is ours from malloc to free.
    unsafe {
        let p = (fns.malloc)(1);
        if p.is_null() {
            return true;
        }
        let q = (fns.realloc)(p, 0);
        if q.is_null() {
            return true;
        }
        (fns.free)(q);
        false
    }
}

impl NextHeap {
    /// Where the real `malloc` and `free` lie in a `NextHeap`, for the assembly of
    /// [`crate::fast_path`].
    pub(crate) const MALLOC_FN_OFFSET: usize = core::mem::offset_of!(NextHeap, malloc_fn);
    pub(crate) const FREE_FN_OFFSET: usize = core::mem::offset_of!(NextHeap, free_fn);

    pub(crate) const fn new() -> Self {
        Self {
            free_fn: AtomicPtr::new(free_first as *mut ()),
            malloc_fn: AtomicPtr::new(malloc_first as *mut ()),
            realloc_fn: AtomicPtr::new(realloc_first as *mut ()),
            calloc_fn: AtomicPtr::new(calloc_first as *mut ()),
            state: AtomicU8::new(UNRESOLVED),
            fns: UnsafeCell::new(None),
            realloc_zero: AtomicU8::new(0),
        }
    }

    /// The real `malloc`'s address, once resolved: it tells which module is the allocator.
    pub(crate) fn real_malloc(&self) -> Option<*const c_void> {
        self.fns().map(|f| f.malloc as *const c_void)
    }

    /// Whether the real allocator is glibc's: its `malloc` lies in the module of the C
    /// library's `exit`. Asks the loader: not from a hook.
    pub(crate) fn is_glibc(&self) -> bool {
        let libc = libc_module();
        self.real_malloc().is_some_and(|malloc| libc != 0 && os::module_of(malloc) == libc)
    }

    /// The resolved functions; `None` while another call on this or another thread is still
    /// resolving them (serve it from the bootstrap arena then).
    #[inline(always)]
    fn fns(&self) -> Option<&Fns> {
        if self.state.load(Ordering::Acquire) == READY {
            // SAFETY: READY was published after `fns` was written, and it is never written again.
            return unsafe { (*self.fns.get()).as_ref() };
        }
        self.resolve_slow()
    }

    #[cold]
    fn resolve_slow(&self) -> Option<&Fns> {
        match self.state.compare_exchange(UNRESOLVED, RESOLVING, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                let fns = resolve();
                let ok = fns.is_some();
                // SAFETY: only the thread that moved the state to RESOLVING writes, once,
                // before publishing; no reader looks before READY.
                unsafe { *self.fns.get() = fns };
                if ok {
                    self.state.store(READY, Ordering::Release);
                    // The other half of `early::stop`'s handshake: it ends the noting, then
                    // installs the real functions if they are known.
                    fence(Ordering::SeqCst);
                    if !early::recording() {
                        self.install_resolved();
                    }
                    // SAFETY: just written and published.
                    unsafe { (*self.fns.get()).as_ref() }
                } else {
                    self.state.store(FAILED, Ordering::Release);
                    let msg = b"mallocspy: cannot find the real allocator (dlsym RTLD_NEXT malloc failed); serving from a static arena\n";
                    sink::to_stderr(msg);
                    None
                }
            }
            Err(READY) => {
                // SAFETY: READY seen with Acquire.
                unsafe { (*self.fns.get()).as_ref() }
            }
            Err(_) => None,
        }
    }

    /// Makes the real functions the entry points, once known: a call then loads one word and
    /// jumps (`free` and `realloc` keep checking the arena while it holds blocks).
    pub(crate) fn install_resolved(&self) {
        if self.state.load(Ordering::Acquire) != READY {
            return;
        }
        // SAFETY: READY seen with Acquire.
        let Some(f) = (unsafe { (*self.fns.get()).as_ref() }) else { return };
        // A function's address is all its caller needs: no ordering to keep.
        self.malloc_fn.store(f.malloc as *mut (), Ordering::Relaxed);
        self.calloc_fn.store(f.calloc as *mut (), Ordering::Relaxed);
        self.free_fn.store(f.free as *mut (), Ordering::Relaxed);
        self.realloc_fn.store(f.realloc as *mut (), Ordering::Relaxed);
        // The other half of the handshake of `alloc_from_arena`.
        fence(Ordering::SeqCst);
        if bootstrap::in_use() {
            self.keep_checking_arena();
        }
    }

    /// A block of the bootstrap arena, for a call made before the real functions are known.
    ///
    /// The resolver lets `free` and `realloc` skip the arena's check when the arena is empty;
    /// a block handed out while it looks (by another thread, which saw the lookup under way)
    /// must still be recognised. A Dekker handshake through two SeqCst fences settles it: the
    /// resolver publishes READY and the real functions and then reads whether the arena is
    /// in use; this reserves its block and then reads the state. One of them sees the other's
    /// write, and that one sends `free` and `realloc` back through the arena's check, after
    /// the resolver's own stores in their modification order (the fences order them).
    fn alloc_from_arena(&self, size: usize, align: usize) -> *mut c_void {
        let p = bootstrap::alloc(size, align);
        fence(Ordering::SeqCst);
        if self.state.load(Ordering::Relaxed) == READY {
            self.keep_checking_arena();
        }
        p
    }

    /// Sends `free` and `realloc` through the functions that recognise the arena's blocks.
    fn keep_checking_arena(&self) {
        self.free_fn.store(free_first as *mut (), Ordering::Relaxed);
        self.realloc_fn.store(realloc_first as *mut (), Ordering::Relaxed);
    }

    /// `malloc` before the real functions are known (or while they are being looked up).
    fn malloc_unresolved(&self, size: usize) -> *mut c_void {
        match self.fns() {
            // SAFETY: the real malloc has no preconditions.
            Some(f) => unsafe { (f.malloc)(size) },
            None => self.alloc_from_arena(size, 16),
        }
    }

    /// `calloc` before the real functions are known.
    fn calloc_unresolved(&self, nmemb: usize, size: usize) -> *mut c_void {
        match self.fns() {
            // SAFETY: the real calloc has no preconditions.
            Some(f) => unsafe { (f.calloc)(nmemb, size) },
            None => nmemb.checked_mul(size).map_or(core::ptr::null_mut(), |n| self.alloc_from_arena(n, 16)),
        }
    }

    /// `realloc` of a bootstrap block, or before the real functions are known.
    ///
    /// # Safety
    /// `ptr` is NULL or a live block of this allocator.
    unsafe fn realloc_unresolved(&self, ptr: *mut c_void, size: usize) -> *mut c_void {
        if bootstrap::contains(ptr) {
            // SAFETY: ptr is a bootstrap block (its size is in front of it).
            let old = unsafe { bootstrap::size_of(ptr) };
            let new = self.malloc(size.max(1));
            if !new.is_null() {
                // SAFETY: both blocks hold at least min(old, size) bytes and are distinct.
                unsafe { core::ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast::<u8>(), old.min(size)) };
            }
            return new;
        }
        match self.fns() {
            // SAFETY: the caller guarantees ptr is NULL or a live block of this allocator.
            Some(f) => unsafe { (f.realloc)(ptr, size) },
            None => core::ptr::null_mut(),
        }
    }

    /// `free` of a bootstrap block (ignored), or before the real functions are known.
    ///
    /// # Safety
    /// `ptr` is NULL or a live block of this allocator.
    unsafe fn free_unresolved(&self, ptr: *mut c_void) {
        if bootstrap::contains(ptr) {
            return;
        }
        if let Some(f) = self.fns() {
            // SAFETY: the caller's guarantee.
            unsafe { (f.free)(ptr) }
        }
    }

    fn memalign_raw(&self, align: usize, size: usize) -> *mut c_void {
        let Some(f) = self.fns() else { return self.alloc_from_arena(size, align) };
        // SAFETY: the real functions have no preconditions; `out` is a local.
        unsafe {
            if let Some(memalign) = f.memalign {
                return memalign(align, size);
            }
            if let Some(aligned_alloc) = f.aligned_alloc {
                return aligned_alloc(align, size);
            }
            if let Some(posix_memalign) = f.posix_memalign {
                let align = align.max(core::mem::size_of::<usize>()).checked_next_power_of_two().unwrap_or(0);
                let mut out = core::ptr::null_mut();
                let rc = posix_memalign(&mut out, align, size);
                if rc != 0 {
                    os::set_errno(rc);
                    return core::ptr::null_mut();
                }
                return out;
            }
            os::set_errno(libc::ENOMEM);
            core::ptr::null_mut()
        }
    }

    fn aligned_alloc_raw(&self, align: usize, size: usize) -> *mut c_void {
        match self.fns().and_then(|f| f.aligned_alloc) {
            // SAFETY: the real aligned_alloc has no preconditions.
            Some(aligned_alloc) => unsafe { aligned_alloc(align, size) },
            None => self.memalign_raw(align, size),
        }
    }

    /// # Safety
    /// `out` is valid for a write.
    unsafe fn posix_memalign_raw(&self, out: *mut *mut c_void, align: usize, size: usize) -> c_int {
        if let Some(posix_memalign) = self.fns().and_then(|f| f.posix_memalign) {
            // SAFETY: the caller guarantees `out` is writable.
            return unsafe { posix_memalign(out, align, size) };
        }
        // POSIX: a power of two multiple of sizeof(void *).
        if !align.is_multiple_of(core::mem::size_of::<usize>())
            || !(align / core::mem::size_of::<usize>()).is_power_of_two()
        {
            return libc::EINVAL;
        }
        let saved = os::errno();
        let p = self.memalign_raw(align, size);
        if p.is_null() {
            let err = os::errno();
            os::set_errno(saved);
            return if err == 0 { libc::ENOMEM } else { err };
        }
        // SAFETY: the caller guarantees `out` is writable.
        unsafe { *out = p };
        0
    }

    fn valloc_raw(&self, size: usize) -> *mut c_void {
        match self.fns().and_then(|f| f.valloc) {
            // SAFETY: the real valloc has no preconditions.
            Some(valloc) => unsafe { valloc(size) },
            None => self.memalign_raw(os::page_size(), size),
        }
    }

    fn pvalloc_raw(&self, size: usize) -> *mut c_void {
        match self.fns().and_then(|f| f.pvalloc) {
            // SAFETY: the real pvalloc has no preconditions.
            Some(pvalloc) => unsafe { pvalloc(size) },
            None => match page_round_up(size.max(1)) {
                Some(rounded) => self.memalign_raw(os::page_size(), rounded),
                None => {
                    os::set_errno(libc::ENOMEM);
                    core::ptr::null_mut()
                }
            },
        }
    }

    /// Resolves now if nothing has yet (called at initialisation, so that the first hooked
    /// call does not pay for it).
    pub(crate) fn warm_up(&self) {
        let _ = self.fns();
    }
}

fn page_round_up(size: usize) -> Option<usize> {
    size.checked_next_multiple_of(os::page_size())
}

// SAFETY: every function forwards to the C function of the same name of one allocator (or
// builds it from that allocator's memalign); bootstrap blocks are recognised by free, realloc
// and usable_size.
unsafe impl Heap for NextHeap {
    #[inline(always)]
    fn malloc(&self, size: usize) -> *mut c_void {
        // SAFETY: `malloc_fn` holds `malloc_first` or the real malloc: a C malloc.
        in_real_allocator(|| unsafe {
            core::mem::transmute::<*mut (), MallocFn>(self.malloc_fn.load(Ordering::Relaxed))(size)
        })
    }

    #[inline(always)]
    fn calloc(&self, nmemb: usize, size: usize) -> *mut c_void {
        // SAFETY: `calloc_fn` holds `calloc_first` or the real calloc: a C calloc.
        in_real_allocator(|| unsafe {
            core::mem::transmute::<*mut (), CallocFn>(self.calloc_fn.load(Ordering::Relaxed))(nmemb, size)
        })
    }

    #[inline(always)]
    unsafe fn realloc(&self, ptr: *mut c_void, size: usize) -> *mut c_void {
        let f = self.realloc_fn.load(Ordering::Relaxed);
        // SAFETY: `realloc_fn` holds `realloc_first` or, while the arena holds no block, the
        // real realloc; the caller guarantees ptr is NULL or a live block of this allocator.
        in_real_allocator(|| unsafe { core::mem::transmute::<*mut (), ReallocFn>(f)(ptr, size) })
    }

    #[inline(always)]
    unsafe fn free(&self, ptr: *mut c_void) {
        let f = self.free_fn.load(Ordering::Relaxed);
        // SAFETY: `free_fn` holds `free_first` or, while the arena holds no block, the real
        // free; the caller guarantees ptr is NULL or a live block of this allocator.
        in_real_allocator(|| unsafe { core::mem::transmute::<*mut (), FreeFn>(f)(ptr) })
    }

    fn memalign(&self, align: usize, size: usize) -> *mut c_void {
        noted(in_real_allocator(|| self.memalign_raw(align, size)), size, Entry::Memalign, early::caller_of_hook)
    }

    /// Before a spy, the block is noted as the operator's, allocated by the caller its
    /// trampoline noted (`malloc_first` takes the return address on top of the stack, which
    /// from here is mallocspy's own).
    fn operator_new(&self, entry: Entry, size: usize, align: usize) -> *mut c_void {
        if !early::recording() {
            return if align == 0 { self.malloc(size) } else { self.memalign(align, size) };
        }
        let allocate = || if align == 0 { self.malloc_unresolved(size) } else { self.memalign_raw(align, size) };
        noted(in_real_allocator(allocate), size, entry, early::caller_of_hook)
    }

    fn aligned_alloc(&self, align: usize, size: usize) -> *mut c_void {
        let block = in_real_allocator(|| self.aligned_alloc_raw(align, size));
        noted(block, size, Entry::AlignedAlloc, early::caller_of_hook)
    }

    unsafe fn posix_memalign(&self, out: *mut *mut c_void, align: usize, size: usize) -> c_int {
        // SAFETY: the caller's guarantee.
        let rc = in_real_allocator(|| unsafe { self.posix_memalign_raw(out, align, size) });
        if rc == 0 {
            // SAFETY: written on success.
            noted(unsafe { *out }, size, Entry::PosixMemalign, early::caller_of_hook);
        }
        rc
    }

    fn valloc(&self, size: usize) -> *mut c_void {
        noted(in_real_allocator(|| self.valloc_raw(size)), size, Entry::Valloc, early::caller_of_hook)
    }

    fn pvalloc(&self, size: usize) -> *mut c_void {
        noted(in_real_allocator(|| self.pvalloc_raw(size)), size, Entry::Pvalloc, early::caller_of_hook)
    }

    unsafe fn usable_size(&self, ptr: *mut c_void) -> usize {
        if bootstrap::contains(ptr) {
            // SAFETY: a bootstrap block has its size in front of it.
            return unsafe { bootstrap::size_of(ptr) };
        }
        match self.fns().and_then(|f| f.usable_size) {
            // SAFETY: the caller guarantees ptr is NULL or a live block of this allocator.
            Some(usable_size) => unsafe { usable_size(ptr) },
            None => 0,
        }
    }

    fn trim(&self, pad: usize) -> c_int {
        match self.fns().and_then(|f| f.trim) {
            // SAFETY: the real malloc_trim has no preconditions.
            Some(trim) => unsafe { trim(pad) },
            None => 0,
        }
    }

    fn realloc_zero_frees(&self) -> bool {
        match self.realloc_zero.load(Ordering::Relaxed) {
            1 => true,
            2 => false,
            _ => {
                let frees = self.fns().is_none_or(probe_realloc_zero);
                self.realloc_zero.store(if frees { 1 } else { 2 }, Ordering::Relaxed);
                frees
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checks_the_arena(h: &NextHeap) -> bool {
        h.free_fn.load(Ordering::Relaxed) == free_first as *mut ()
            && h.realloc_fn.load(Ordering::Relaxed) == realloc_first as *mut ()
    }

    #[test]
    fn free_and_realloc_recognise_arena_blocks_whether_handed_out_before_or_after_the_lookup() {
        let before = NextHeap::new();
        let block = before.alloc_from_arena(24, 16);
        assert!(bootstrap::contains(block));
        before.warm_up();
        // What `early::stop` does at the first registration: in a test process that registered
        // nothing yet, the noting is still on and the lookup left the entry points alone.
        before.install_resolved();
        assert_ne!(before.malloc_fn.load(Ordering::Relaxed), malloc_first as *mut (), "resolved");
        assert!(checks_the_arena(&before), "the lookup saw the block");

        // A lookup that found the arena empty, then a block from a call that saw it under way.
        let after = NextHeap::new();
        after.warm_up();
        // SAFETY: only compared, never called.
        let real = unsafe { (*after.fns.get()).as_ref() }.expect("resolved").free as *mut ();
        after.free_fn.store(real, Ordering::Relaxed);
        after.realloc_fn.store(real, Ordering::Relaxed);
        after.alloc_from_arena(8, 16);
        assert!(checks_the_arena(&after), "the block's call saw the lookup done");
    }
}
