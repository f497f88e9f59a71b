//! The C ABI (`include/mallocspy.h`): spies as a table of function pointers plus a context
//! pointer, COM-style status codes, and the API table every interposer exports as
//! `mallocspy_api_v1`.
//!
//! The registry lives in the active interposer (the module whose `malloc` the process uses).
//! Any other module — the executable, a library preloaded beside the shim, a plugin opened
//! with `dlopen`, a Rust program using this crate — finds it with
//! `dlsym(RTLD_DEFAULT, "mallocspy_api_v1")` and registers through it, so there is one spy per
//! process whoever registers it. A Rust spy registered from another module crosses this ABI
//! through a table of trampolines that catch its panics.

use core::ffi::{c_int, c_void};
use core::panic::AssertUnwindSafe;

use crate::spy::{Call, DidAlloc, Entry, MallocSpy, Role, SpyError};

/// `S_OK`.
pub const S_OK: i32 = 0;
/// `CO_E_OBJISREG`: a spy is already registered.
pub const CO_E_OBJISREG: i32 = 0x8004_01FC_u32 as i32;
/// `E_INVALIDARG`: not a usable spy.
pub const E_INVALIDARG: i32 = 0x8007_0057_u32 as i32;
/// `CO_E_OBJNOTREG`: no spy is registered.
pub const CO_E_OBJNOTREG: i32 = 0x8004_01FB_u32 as i32;
/// `E_ACCESSDENIED`: the spy's blocks are still live; the revoke is pending.
pub const E_ACCESSDENIED: i32 = 0x8007_0005_u32 as i32;
/// `E_NOINTERFACE`, used for: mallocspy is not the process's allocator.
pub const MALLOCSPY_E_NOT_INTERPOSED: i32 = 0x8000_4002_u32 as i32;

/// Version of [`SpyVtable`] and [`Api`].
pub const ABI_VERSION: u32 = 1;

/// A spy for the C ABI: `struct mallocspy_spy_vtable`. NULL members are pass-through.
/// `spied` arguments are 0 or 1; `ctx` is the pointer given at registration.
#[repr(C)]
#[allow(missing_docs)]
pub struct SpyVtable {
    /// [`ABI_VERSION`].
    pub version: u32,
    /// `sizeof(struct mallocspy_spy_vtable)`.
    pub size: u32,
    pub pre_alloc: Option<unsafe extern "C" fn(ctx: *mut c_void, size: usize) -> usize>,
    pub post_alloc: Option<unsafe extern "C" fn(ctx: *mut c_void, actual: *mut c_void) -> *mut c_void>,
    pub pre_alloc_aligned: Option<unsafe extern "C" fn(ctx: *mut c_void, size: usize, align: usize) -> usize>,
    pub post_alloc_aligned:
        Option<unsafe extern "C" fn(ctx: *mut c_void, actual: *mut c_void, align: usize) -> *mut c_void>,
    pub pre_free: Option<unsafe extern "C" fn(ctx: *mut c_void, request: *mut c_void, spied: c_int) -> *mut c_void>,
    pub post_free: Option<unsafe extern "C" fn(ctx: *mut c_void, spied: c_int)>,
    pub pre_realloc: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            request: *mut c_void,
            size: usize,
            new_request: *mut *mut c_void,
            spied: c_int,
        ) -> usize,
    >,
    pub post_realloc: Option<unsafe extern "C" fn(ctx: *mut c_void, actual: *mut c_void, spied: c_int) -> *mut c_void>,
    pub pre_get_size: Option<unsafe extern "C" fn(ctx: *mut c_void, request: *mut c_void, spied: c_int) -> *mut c_void>,
    pub post_get_size: Option<unsafe extern "C" fn(ctx: *mut c_void, actual: usize, spied: c_int) -> usize>,
    pub pre_did_alloc:
        Option<unsafe extern "C" fn(ctx: *mut c_void, request: *mut c_void, spied: c_int) -> *mut c_void>,
    pub post_did_alloc:
        Option<unsafe extern "C" fn(ctx: *mut c_void, request: *mut c_void, spied: c_int, actual: c_int) -> c_int>,
    pub pre_heap_minimize: Option<unsafe extern "C" fn(ctx: *mut c_void)>,
    pub post_heap_minimize: Option<unsafe extern "C" fn(ctx: *mut c_void)>,
    pub before_release: Option<unsafe extern "C" fn(ctx: *mut c_void, entry: c_int, ptr: *mut c_void, spied: c_int)>,
    pub after_call: Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const Call)>,
    /// Called once when the spy is dropped (after revocation and the last spied free).
    pub release: Option<unsafe extern "C" fn(ctx: *mut c_void)>,
    /// [`OBSERVE`] for a spy that only observes ([`Role::Observe`]); 0 for one that
    /// interposes, like IMallocSpy. A table that ends before it (an older header's) is 0.
    pub flags: u32,
}

/// [`SpyVtable::flags`]: the spy only observes (`MALLOCSPY_OBSERVE`).
pub const OBSERVE: u32 = 1;

/// The least size of a usable table: up to `release` (tables from before `flags` included).
const MIN_VTABLE_SIZE: usize = core::mem::offset_of!(SpyVtable, flags);

/// The functions an interposer exports as `mallocspy_api_v1` (`struct mallocspy_api`).
#[repr(C)]
pub struct Api {
    /// [`ABI_VERSION`].
    pub version: u32,
    /// `sizeof(struct mallocspy_api)`.
    pub size: u32,
    /// `CoRegisterMallocSpy`.
    pub register_spy: unsafe extern "C" fn(vtable: *const SpyVtable, ctx: *mut c_void) -> i32,
    /// `CoRevokeMallocSpy`.
    pub revoke_spy: extern "C" fn() -> i32,
    /// `IMalloc::DidAlloc`: 1, 0 or -1.
    pub did_alloc: unsafe extern "C" fn(ptr: *mut c_void) -> c_int,
    /// The calling thread's [`crate::CallScratch`] words.
    pub call_scratch: extern "C" fn() -> *mut u64,
    /// 1 when this interposer is the process's allocator (its registry is the one in use).
    pub is_active: extern "C" fn() -> c_int,
    /// The leak tracker's totals; `CO_E_OBJNOTREG` when no tracker runs.
    pub heap_stats: unsafe extern "C" fn(out: *mut crate::HeapStats) -> i32,
    /// A leak check now: the report goes to the log, the summary to `out`.
    pub leak_check: unsafe extern "C" fn(out: *mut crate::leaks::Summary) -> i32,
    /// The leak tracker's own memory.
    pub tracker_memory: unsafe extern "C" fn(out: *mut crate::TrackerMemory) -> i32,
    /// Sets (or clears, with `None`) the function called for every allocation tick;
    /// `CO_E_OBJNOTREG` when no ticks spy runs.
    pub on_allocation_tick: extern "C" fn(callback: Option<crate::TickCallback>) -> i32,
    /// Sets (or clears) the function called for every heap statistics event.
    pub on_heap_stats: extern "C" fn(callback: Option<crate::trace::StatsCallback>) -> i32,
    /// Called by a spy's method, on the calling thread, when it cannot do its work (a Rust
    /// spy of another module that panicked): what the method returns is not used, the call
    /// goes on as without the spy, and the spy is revoked, as after a panic in-process.
    pub spy_failed: extern "C" fn(),
    /// Number of live blocks allocated under the current spy (a pending revoke waits for them).
    pub spied_blocks: extern "C" fn() -> u64,
}

/// A spy registered through the C ABI: a copy of its table (fields past the end of an older
/// header's table left NULL and 0), and its context.
struct CSpy {
    vtable: SpyVtable,
    ctx: *mut c_void,
}

// SAFETY: the C side promises (header contract) that its functions may be called from any
// thread, concurrently, with its context pointer.
unsafe impl Send for CSpy {}
// SAFETY: as above.
unsafe impl Sync for CSpy {}

impl CSpy {
    fn v(&self) -> &SpyVtable {
        &self.vtable
    }
}

fn flag(b: bool) -> c_int {
    b as c_int
}

// Every call below: the function pointer comes from a validated table whose owner keeps it and
// `ctx` alive until `release`, and promises the C signature declared in `SpyVtable`.
impl MallocSpy for CSpy {
    fn pre_alloc(&self, size: usize) -> usize {
        // SAFETY: a validated table's function, with its own context (see above).
        self.v().pre_alloc.map_or(size, |f| unsafe { f(self.ctx, size) })
    }
    fn post_alloc(&self, actual: *mut c_void) -> *mut c_void {
        // SAFETY: a validated table's function, with its own context (see above).
        self.v().post_alloc.map_or(actual, |f| unsafe { f(self.ctx, actual) })
    }
    fn pre_alloc_aligned(&self, size: usize, align: usize) -> usize {
        match self.v().pre_alloc_aligned {
            // SAFETY: a validated table's function, with its own context (see above).
            Some(f) => unsafe { f(self.ctx, size, align) },
            None => self.pre_alloc(size),
        }
    }
    fn post_alloc_aligned(&self, actual: *mut c_void, align: usize) -> *mut c_void {
        match self.v().post_alloc_aligned {
            // SAFETY: a validated table's function, with its own context (see above).
            Some(f) => unsafe { f(self.ctx, actual, align) },
            None => self.post_alloc(actual),
        }
    }
    fn pre_free(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        // SAFETY: a validated table's function, with its own context (see above).
        self.v().pre_free.map_or(request, |f| unsafe { f(self.ctx, request, flag(spied)) })
    }
    fn post_free(&self, spied: bool) {
        if let Some(f) = self.v().post_free {
            // SAFETY: a validated table's function, with its own context (see above).
            unsafe { f(self.ctx, flag(spied)) }
        }
    }
    fn pre_realloc(&self, request: *mut c_void, size: usize, spied: bool) -> (*mut c_void, usize) {
        match self.v().pre_realloc {
            Some(f) => {
                let mut new_request = request;
                // SAFETY: a validated table's function, with its own context (see above).
                let size = unsafe { f(self.ctx, request, size, &mut new_request, flag(spied)) };
                (new_request, size)
            }
            None => (request, size),
        }
    }
    fn post_realloc(&self, actual: *mut c_void, spied: bool) -> *mut c_void {
        // SAFETY: a validated table's function, with its own context (see above).
        self.v().post_realloc.map_or(actual, |f| unsafe { f(self.ctx, actual, flag(spied)) })
    }
    fn pre_get_size(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        // SAFETY: a validated table's function, with its own context (see above).
        self.v().pre_get_size.map_or(request, |f| unsafe { f(self.ctx, request, flag(spied)) })
    }
    fn post_get_size(&self, actual: usize, spied: bool) -> usize {
        // SAFETY: a validated table's function, with its own context (see above).
        self.v().post_get_size.map_or(actual, |f| unsafe { f(self.ctx, actual, flag(spied)) })
    }
    fn pre_did_alloc(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        // SAFETY: a validated table's function, with its own context (see above).
        self.v().pre_did_alloc.map_or(request, |f| unsafe { f(self.ctx, request, flag(spied)) })
    }
    fn post_did_alloc(&self, request: *mut c_void, spied: bool, actual: DidAlloc) -> DidAlloc {
        match self.v().post_did_alloc {
            // SAFETY: a validated table's function, with its own context (see above).
            Some(f) => DidAlloc::from_int(unsafe { f(self.ctx, request, flag(spied), actual.as_int()) }),
            None => actual,
        }
    }
    fn pre_heap_minimize(&self) {
        if let Some(f) = self.v().pre_heap_minimize {
            // SAFETY: a validated table's function, with its own context (see above).
            unsafe { f(self.ctx) }
        }
    }
    fn post_heap_minimize(&self) {
        if let Some(f) = self.v().post_heap_minimize {
            // SAFETY: a validated table's function, with its own context (see above).
            unsafe { f(self.ctx) }
        }
    }
    fn before_release(&self, entry: Entry, ptr: *mut c_void, spied: bool) {
        if let Some(f) = self.v().before_release {
            // SAFETY: a validated table's function, with its own context (see above).
            unsafe { f(self.ctx, entry as c_int, ptr, flag(spied)) }
        }
    }
    fn after_call(&self, call: &Call) {
        if let Some(f) = self.v().after_call {
            // SAFETY: a validated table's function, with its own context (see above).
            unsafe { f(self.ctx, call) }
        }
    }
    fn role(&self) -> Role {
        if self.v().flags & OBSERVE != 0 { Role::Observe } else { Role::Interpose }
    }
}

impl Drop for CSpy {
    fn drop(&mut self) {
        if let Some(f) = self.v().release {
            // SAFETY: called once, as the table's contract says, after the last use.
            unsafe { f(self.ctx) }
        }
    }
}

/// Checks that a C table is one this ABI can use.
///
/// # Safety
/// `vtable` is NULL or points to a readable table.
pub(crate) unsafe fn validate(vtable: *const SpyVtable) -> Result<(), SpyError> {
    if vtable.is_null() {
        return Err(SpyError::InvalidArgument);
    }
    // SAFETY: the caller's guarantee: a readable table, its first two words at least (an
    // older header's table is shorter than ours: no reference to the whole is made).
    let (version, size) = unsafe { ((*vtable).version, (*vtable).size) };
    if version != ABI_VERSION || (size as usize) < MIN_VTABLE_SIZE {
        return Err(SpyError::InvalidArgument);
    }
    // A flag this interposer does not know (a newer header's) asks for what it cannot do: the
    // spy would run in a role it was not written for.
    if size as usize >= core::mem::size_of::<SpyVtable>() {
        // SAFETY: the size says the whole table, `flags` included, is readable.
        if unsafe { (*vtable).flags } & !OBSERVE != 0 {
            return Err(SpyError::InvalidArgument);
        }
    }
    Ok(())
}

/// Wraps a validated C table as a spy.
///
/// # Safety
/// `vtable` passed [`validate`], and it and `ctx` live until the table's `release` is called;
/// its functions honour the header's contract.
pub(crate) unsafe fn c_spy(vtable: *const SpyVtable, ctx: *mut c_void) -> Box<dyn MallocSpy> {
    // SAFETY: the caller's guarantee.
    Box::new(CSpy { vtable: unsafe { copy_of(vtable) }, ctx })
}

/// The role a C spy's table says (its `flags`).
///
/// # Safety
/// `vtable` passed [`validate`].
pub(crate) unsafe fn role_of(vtable: *const SpyVtable) -> Role {
    // SAFETY: the caller's guarantee.
    if unsafe { copy_of(vtable) }.flags & OBSERVE != 0 { Role::Observe } else { Role::Interpose }
}

/// What of a C spy must stay mapped while it is registered: its table's functions and its
/// context (see [`crate::pins`]); 0 for each absent function.
///
/// # Safety
/// `vtable` passed [`validate`].
pub(crate) unsafe fn addresses_of(vtable: *const SpyVtable, ctx: *mut c_void) -> [usize; 18] {
    // SAFETY: the caller's guarantee.
    let v = unsafe { copy_of(vtable) };
    [
        v.pre_alloc.map_or(0, |f| f as usize),
        v.post_alloc.map_or(0, |f| f as usize),
        v.pre_alloc_aligned.map_or(0, |f| f as usize),
        v.post_alloc_aligned.map_or(0, |f| f as usize),
        v.pre_free.map_or(0, |f| f as usize),
        v.post_free.map_or(0, |f| f as usize),
        v.pre_realloc.map_or(0, |f| f as usize),
        v.post_realloc.map_or(0, |f| f as usize),
        v.pre_get_size.map_or(0, |f| f as usize),
        v.post_get_size.map_or(0, |f| f as usize),
        v.pre_did_alloc.map_or(0, |f| f as usize),
        v.post_did_alloc.map_or(0, |f| f as usize),
        v.pre_heap_minimize.map_or(0, |f| f as usize),
        v.post_heap_minimize.map_or(0, |f| f as usize),
        v.before_release.map_or(0, |f| f as usize),
        v.after_call.map_or(0, |f| f as usize),
        v.release.map_or(0, |f| f as usize),
        ctx as usize,
    ]
}

/// The caller's table, as much of it as its size says it has, the rest zero (NULL members, no
/// flags).
///
/// # Safety
/// `vtable` passed [`validate`].
unsafe fn copy_of(vtable: *const SpyVtable) -> SpyVtable {
    // SAFETY: validated: at least MIN_VTABLE_SIZE readable bytes, the whole table when its
    // size says so.
    let size = unsafe { (*vtable).size } as usize;
    let bytes =
        if size >= core::mem::size_of::<SpyVtable>() { core::mem::size_of::<SpyVtable>() } else { MIN_VTABLE_SIZE };
    let mut copy = core::mem::MaybeUninit::<SpyVtable>::zeroed();
    // SAFETY: `bytes` are readable at `vtable` (above) and fit the copy; all zeroes is a valid
    // table (NULL members, no flags), and the copied prefix holds the caller's valid fields.
    unsafe {
        core::ptr::copy_nonoverlapping(vtable.cast::<u8>(), copy.as_mut_ptr().cast::<u8>(), bytes);
        copy.assume_init()
    }
}

/// Encodes a registration result as a status code.
pub(crate) fn status(r: Result<(), SpyError>) -> i32 {
    match r {
        Ok(()) => S_OK,
        Err(e) => e.status(),
    }
}

// ---- a Rust spy seen through the C ABI --------------------------------------------------------

/// What a remote registry holds for a Rust spy of this module: the spy, and the API to say
/// that it panicked.
struct Remote {
    spy: Box<dyn MallocSpy>,
    api: &'static Api,
}

impl Remote {
    /// Runs `f` on the spy. A panic yields `fallback` and is told to the registry
    /// (`spy_failed`), which then ignores the answer, as it does after a panic in-process:
    /// a fallback taken for the spy's answer (an allocation's size without the header its
    /// Post method then lays out) corrupted the heap.
    fn run<R>(ctx: *mut c_void, fallback: R, f: impl FnOnce(&dyn MallocSpy) -> R) -> R {
        // SAFETY: ctx is the Box<Remote> leaked by `register_remote`, alive until `release`.
        let remote = unsafe { &*(ctx as *const Remote) };
        match std::panic::catch_unwind(AssertUnwindSafe(|| f(&*remote.spy))) {
            Ok(r) => r,
            Err(payload) => {
                core::mem::forget(payload);
                (remote.api.spy_failed)();
                fallback
            }
        }
    }
}

fn spied_arg(spied: c_int) -> bool {
    spied != 0
}

unsafe extern "C" fn tr_pre_alloc(ctx: *mut c_void, size: usize) -> usize {
    Remote::run(ctx, size, |s| s.pre_alloc(size))
}
unsafe extern "C" fn tr_post_alloc(ctx: *mut c_void, actual: *mut c_void) -> *mut c_void {
    Remote::run(ctx, actual, |s| s.post_alloc(actual))
}
unsafe extern "C" fn tr_pre_alloc_aligned(ctx: *mut c_void, size: usize, align: usize) -> usize {
    Remote::run(ctx, size, |s| s.pre_alloc_aligned(size, align))
}
unsafe extern "C" fn tr_post_alloc_aligned(ctx: *mut c_void, actual: *mut c_void, align: usize) -> *mut c_void {
    Remote::run(ctx, actual, |s| s.post_alloc_aligned(actual, align))
}
unsafe extern "C" fn tr_pre_free(ctx: *mut c_void, request: *mut c_void, spied: c_int) -> *mut c_void {
    // On a panic the real start of a spied block is unknown: free nothing (leak).
    let fallback = if spied_arg(spied) { core::ptr::null_mut() } else { request };
    Remote::run(ctx, fallback, |s| s.pre_free(request, spied_arg(spied)))
}
unsafe extern "C" fn tr_post_free(ctx: *mut c_void, spied: c_int) {
    Remote::run(ctx, (), |s| s.post_free(spied_arg(spied)))
}
unsafe extern "C" fn tr_pre_realloc(
    ctx: *mut c_void,
    request: *mut c_void,
    size: usize,
    new_request: *mut *mut c_void,
    spied: c_int,
) -> usize {
    // On a panic: fail the call, the old block stays the caller's.
    let (p, n) = Remote::run(ctx, (request, 0), |s| s.pre_realloc(request, size, spied_arg(spied)));
    // SAFETY: the dispatcher passes a valid out-pointer.
    unsafe { *new_request = p };
    n
}
unsafe extern "C" fn tr_post_realloc(ctx: *mut c_void, actual: *mut c_void, spied: c_int) -> *mut c_void {
    Remote::run(ctx, actual, |s| s.post_realloc(actual, spied_arg(spied)))
}
unsafe extern "C" fn tr_pre_get_size(ctx: *mut c_void, request: *mut c_void, spied: c_int) -> *mut c_void {
    Remote::run(ctx, request, |s| s.pre_get_size(request, spied_arg(spied)))
}
unsafe extern "C" fn tr_post_get_size(ctx: *mut c_void, actual: usize, spied: c_int) -> usize {
    Remote::run(ctx, actual, |s| s.post_get_size(actual, spied_arg(spied)))
}
unsafe extern "C" fn tr_pre_did_alloc(ctx: *mut c_void, request: *mut c_void, spied: c_int) -> *mut c_void {
    Remote::run(ctx, request, |s| s.pre_did_alloc(request, spied_arg(spied)))
}
unsafe extern "C" fn tr_post_did_alloc(ctx: *mut c_void, request: *mut c_void, spied: c_int, actual: c_int) -> c_int {
    Remote::run(ctx, actual, |s| s.post_did_alloc(request, spied_arg(spied), DidAlloc::from_int(actual)).as_int())
}
unsafe extern "C" fn tr_pre_heap_minimize(ctx: *mut c_void) {
    Remote::run(ctx, (), |s| s.pre_heap_minimize())
}
unsafe extern "C" fn tr_post_heap_minimize(ctx: *mut c_void) {
    Remote::run(ctx, (), |s| s.post_heap_minimize())
}
unsafe extern "C" fn tr_before_release(ctx: *mut c_void, entry: c_int, ptr: *mut c_void, spied: c_int) {
    let entry = Entry::from_index(entry as u8);
    Remote::run(ctx, (), |s| s.before_release(entry, ptr, spied_arg(spied)))
}
unsafe extern "C" fn tr_after_call(ctx: *mut c_void, call: *const Call) {
    // SAFETY: the dispatcher passes a valid Call for the duration of the callback.
    let call = unsafe { &*call };
    Remote::run(ctx, (), |s| s.after_call(call))
}
unsafe extern "C" fn tr_release(ctx: *mut c_void) {
    // SAFETY: ctx is the Box<Remote> leaked by `register_remote`; release is called once.
    let remote = unsafe { Box::from_raw(ctx as *mut Remote) };
    let _ = std::panic::catch_unwind(AssertUnwindSafe(move || drop(remote)));
}

/// The table of a remote Rust spy whose role has `flags`.
const fn remote_vtable_with(flags: u32) -> SpyVtable {
    SpyVtable {
        version: ABI_VERSION,
        size: core::mem::size_of::<SpyVtable>() as u32,
        pre_alloc: Some(tr_pre_alloc),
        post_alloc: Some(tr_post_alloc),
        pre_alloc_aligned: Some(tr_pre_alloc_aligned),
        post_alloc_aligned: Some(tr_post_alloc_aligned),
        pre_free: Some(tr_pre_free),
        post_free: Some(tr_post_free),
        pre_realloc: Some(tr_pre_realloc),
        post_realloc: Some(tr_post_realloc),
        pre_get_size: Some(tr_pre_get_size),
        post_get_size: Some(tr_post_get_size),
        pre_did_alloc: Some(tr_pre_did_alloc),
        post_did_alloc: Some(tr_post_did_alloc),
        pre_heap_minimize: Some(tr_pre_heap_minimize),
        post_heap_minimize: Some(tr_post_heap_minimize),
        before_release: Some(tr_before_release),
        after_call: Some(tr_after_call),
        release: Some(tr_release),
        flags,
    }
}

static REMOTE_VTABLE: SpyVtable = remote_vtable_with(0);
static REMOTE_OBSERVER_VTABLE: SpyVtable = remote_vtable_with(OBSERVE);

/// The table that carries this module's Rust spies of `role` to another module's registry.
pub(crate) fn remote_vtable(role: Role) -> &'static SpyVtable {
    match role {
        Role::Interpose => &REMOTE_VTABLE,
        Role::Observe => &REMOTE_OBSERVER_VTABLE,
    }
}

/// Registers a Rust spy with the registry behind `api` (another module's).
pub(crate) fn register_remote(api: &'static Api, spy: Box<dyn MallocSpy>, role: Role) -> Result<(), SpyError> {
    let vtable = remote_vtable(role);
    let ctx = Box::into_raw(Box::new(Remote { spy, api })) as *mut c_void;
    // SAFETY: the table is static and the context lives until tr_release.
    let status = unsafe { (api.register_spy)(vtable, ctx) };
    let result = SpyError::from_status(status);
    if result.is_err() {
        // Not registered: nobody else will release the context.
        // SAFETY: ctx was leaked just above and the registry did not keep it.
        drop(unsafe { Box::from_raw(ctx as *mut Remote) });
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of an older header, which ends before `flags`, is still a spy that interposes;
    /// one that says `MALLOCSPY_OBSERVE` observes; a shorter or foreign one is refused.
    #[test]
    fn tables_with_and_without_flags() {
        let mut table = remote_vtable_with(OBSERVE);
        table.release = None;
        // SAFETY: a whole, readable table.
        let spy = unsafe {
            validate(&table).unwrap();
            c_spy(&table, core::ptr::null_mut())
        };
        assert_eq!(spy.role(), Role::Observe);
        table.size = MIN_VTABLE_SIZE as u32;
        // SAFETY: as above; its size says it ends before `flags`.
        let spy = unsafe {
            validate(&table).unwrap();
            c_spy(&table, core::ptr::null_mut())
        };
        assert_eq!(spy.role(), Role::Interpose, "flags past the table's end are not read");
        table.size -= 8;
        // SAFETY: as above.
        assert_eq!(unsafe { validate(&table) }, Err(SpyError::InvalidArgument));
        table.size = MIN_VTABLE_SIZE as u32;
        table.version = ABI_VERSION + 1;
        // SAFETY: as above.
        assert_eq!(unsafe { validate(&table) }, Err(SpyError::InvalidArgument));
        // SAFETY: NULL is allowed.
        assert_eq!(unsafe { validate(core::ptr::null()) }, Err(SpyError::InvalidArgument));
    }
}
