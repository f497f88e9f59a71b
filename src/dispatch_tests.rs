//! The dispatcher in-process, over glibc, with recording and header spies. (The exported
//! symbols and real programs are tested by the integration tests, under LD_PRELOAD.)

use super::*;
use crate::spies::leaks::LeakTracker;
use crate::spy::CallScratch;
use core::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// glibc, called directly.
struct Glibc;

// SAFETY: forwards to glibc's functions of the same names.
unsafe impl Heap for Glibc {
    fn malloc(&self, size: usize) -> *mut c_void {
        // SAFETY: plain libc call.
        unsafe { libc::malloc(size) }
    }
    fn calloc(&self, nmemb: usize, size: usize) -> *mut c_void {
        // SAFETY: plain libc call.
        unsafe { libc::calloc(nmemb, size) }
    }
    unsafe fn realloc(&self, ptr: *mut c_void, size: usize) -> *mut c_void {
        // SAFETY: the caller's guarantee.
        unsafe { libc::realloc(ptr, size) }
    }
    unsafe fn free(&self, ptr: *mut c_void) {
        // SAFETY: the caller's guarantee.
        unsafe { libc::free(ptr) }
    }
    fn memalign(&self, align: usize, size: usize) -> *mut c_void {
        // SAFETY: plain libc call.
        unsafe { libc::memalign(align, size) }
    }
    fn aligned_alloc(&self, align: usize, size: usize) -> *mut c_void {
        // SAFETY: plain libc call.
        unsafe { libc::aligned_alloc(align, size) }
    }
    unsafe fn posix_memalign(&self, out: *mut *mut c_void, align: usize, size: usize) -> c_int {
        // SAFETY: the caller's guarantee.
        unsafe { libc::posix_memalign(out, align, size) }
    }
    fn valloc(&self, size: usize) -> *mut c_void {
        self.memalign(4096, size)
    }
    fn pvalloc(&self, size: usize) -> *mut c_void {
        self.memalign(4096, size.next_multiple_of(4096).max(4096))
    }
    unsafe fn usable_size(&self, ptr: *mut c_void) -> usize {
        // SAFETY: the caller's guarantee.
        unsafe { libc::malloc_usable_size(ptr) }
    }
    fn trim(&self, pad: usize) -> c_int {
        // SAFETY: plain libc call.
        unsafe { libc::malloc_trim(pad) }
    }
    fn realloc_zero_frees(&self) -> bool {
        true
    }
}

/// Records what it saw.
#[derive(Default)]
struct Log {
    calls: AtomicUsize,
    post_alloc: AtomicUsize,
    spied_frees: AtomicUsize,
    unspied_frees: AtomicUsize,
    dropped: AtomicUsize,
}

/// A 16-byte header (holding the size) and an 8-byte trailer, like IMallocSpy samples.
struct HeaderSpy {
    log: Arc<Log>,
    /// pre_alloc returns 0 (forced failure) for this size.
    fail_size: usize,
    /// Panics in pre_alloc for this size.
    panic_size: usize,
}

impl HeaderSpy {
    fn new(log: &Arc<Log>) -> Self {
        Self::with(log, usize::MAX, usize::MAX)
    }

    fn with(log: &Arc<Log>, fail_size: usize, panic_size: usize) -> Self {
        Self { log: log.clone(), fail_size, panic_size }
    }

    /// Writes the header (size, offset from the real block) and returns the caller's pointer.
    fn lay_out(actual: *mut c_void, offset: usize) -> *mut c_void {
        let p = actual.wrapping_byte_add(offset);
        // SAFETY: the real block holds offset + size + 8 bytes, offset >= 16.
        unsafe {
            (p.wrapping_byte_sub(16) as *mut u64).write(CallScratch::get(0));
            (p.wrapping_byte_sub(8) as *mut u64).write(offset as u64);
        }
        p
    }

    /// The real block of a spied caller pointer.
    fn real(request: *mut c_void) -> *mut c_void {
        // SAFETY: spied blocks carry their offset 8 bytes before the caller's pointer.
        let offset = unsafe { (request.wrapping_byte_sub(8) as *const u64).read() } as usize;
        request.wrapping_byte_sub(offset)
    }
}

impl Drop for HeaderSpy {
    fn drop(&mut self) {
        self.log.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

impl MallocSpy for HeaderSpy {
    fn pre_alloc(&self, size: usize) -> usize {
        self.pre_alloc_aligned(size, 16)
    }
    fn post_alloc(&self, actual: *mut c_void) -> *mut c_void {
        self.post_alloc_aligned(actual, 16)
    }
    fn pre_alloc_aligned(&self, size: usize, align: usize) -> usize {
        assert!(size != self.panic_size, "spy bug");
        if size == self.fail_size {
            return 0;
        }
        let offset = align.max(16);
        CallScratch::set(0, size as u64);
        CallScratch::set(1, offset as u64);
        size.checked_add(offset + 8).unwrap_or(0)
    }
    fn post_alloc_aligned(&self, actual: *mut c_void, _align: usize) -> *mut c_void {
        self.log.post_alloc.fetch_add(1, Ordering::SeqCst);
        if actual.is_null() { actual } else { Self::lay_out(actual, CallScratch::get(1) as usize) }
    }
    fn pre_free(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        if spied {
            self.log.spied_frees.fetch_add(1, Ordering::SeqCst);
            Self::real(request)
        } else {
            self.log.unspied_frees.fetch_add(1, Ordering::SeqCst);
            request
        }
    }
    fn pre_realloc(&self, request: *mut c_void, size: usize, spied: bool) -> (*mut c_void, usize) {
        // Only 16-byte headers are moved by realloc in this spy.
        CallScratch::set(0, size as u64);
        if spied { (Self::real(request), size + 24) } else { (request, size) }
    }
    fn post_realloc(&self, actual: *mut c_void, spied: bool) -> *mut c_void {
        if actual.is_null() || !spied { actual } else { Self::lay_out(actual, 16) }
    }
    fn pre_get_size(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        if !spied {
            return request;
        }
        // SAFETY: spied blocks carry their size 16 bytes before the caller's pointer.
        CallScratch::set(0, unsafe { (request.wrapping_byte_sub(16) as *const u64).read() });
        Self::real(request)
    }
    fn post_get_size(&self, actual: usize, spied: bool) -> usize {
        if spied { CallScratch::get(0) as usize } else { actual }
    }
    // Maps the caller's pointer back to the real block, as in every Pre method (the README's
    // and COM's PreDidAlloc).
    fn pre_did_alloc(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        if spied { Self::real(request) } else { request }
    }
    fn after_call(&self, _call: &Call) {
        self.log.calls.fetch_add(1, Ordering::SeqCst);
    }
}

/// Held by every test here. Their interposers share the process's thread slots, so a hook of
/// one test that waits for the hooks in flight (a retire, a revoke from a spy method, a
/// panic's disable) waits for the other tests' hooks too; two such waits at once, in two
/// tests, would wait for each other. One process has one interposer, whose spies follow each
/// other, and does not meet this (see the note on `threads::quiesce`).
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn fresh() -> Interposer<Glibc> {
    Interposer::new(Glibc)
}

#[test]
fn without_a_spy_everything_passes_through() {
    let _serial = serial();
    let ip = fresh();
    let p = ip.malloc(100);
    assert!(!p.is_null());
    // SAFETY: p is a live glibc block.
    unsafe {
        assert!(libc::malloc_usable_size(p) >= 100);
        ip.free(p);
    }
    assert_eq!(ip.did_alloc(core::ptr::null_mut()), DidAlloc::No);
    assert_eq!(ip.revoke(), Err(SpyError::NotRegistered));
}

#[test]
fn any_allocation_under_a_spy_marks_the_interposer_reached_and_none_before() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    let before = ip.malloc(10);
    assert!(!ip.reached_a_spy(), "no spy yet");
    ip.register(|| Box::new(HeaderSpy::new(&log))).unwrap();
    // SAFETY: `before` is a live block of this interposer, freed once.
    unsafe {
        assert!(ip.malloc_usable_size(before) >= 10);
        ip.free(before);
    }
    assert!(!ip.reached_a_spy(), "neither a free nor a size query is an allocation");
    // The first allocation of a thread need not be a malloc.
    let z = ip.calloc(4, 4);
    assert!(ip.reached_a_spy());
    // SAFETY: a live block of this interposer.
    unsafe { ip.free(z) };
    assert_eq!(ip.revoke(), Ok(()));
}

#[test]
fn header_spy_keeps_every_entry_point_correct() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    let before = ip.malloc(10); // allocated before the spy: unspied
    ip.register(|| Box::new(HeaderSpy::new(&log))).unwrap();
    // A refused spy is dropped, as the API's is (built before: its role is asked first).
    let refused = Arc::new(Log::default());
    assert_eq!(ip.register(|| Box::new(HeaderSpy::new(&refused))), Err(SpyError::AlreadyRegistered));
    assert_eq!(refused.dropped.load(Ordering::SeqCst), 1);

    let p = ip.malloc(40) as *mut u8;
    assert_eq!(p as usize % 16, 0);
    assert_eq!(ip.did_alloc(p.cast()), DidAlloc::Yes);
    // SAFETY: p is a live block of 40 bytes for the caller.
    unsafe {
        assert_eq!(ip.malloc_usable_size(p.cast()), 40);
        p.write_bytes(0xAB, 40);
        let q = ip.realloc(p.cast(), 4000) as *mut u8;
        assert!((0..40).all(|i| *q.add(i) == 0xAB), "realloc copies the caller's bytes");
        assert_eq!(ip.malloc_usable_size(q.cast()), 4000);
        let z = ip.calloc(100, 10) as *mut u8;
        assert!((0..1000).all(|i| *z.add(i) == 0), "calloc zeroes the caller's bytes");
        ip.free(z.cast());
        ip.free(q.cast());
        ip.free(before);
    }
    assert_eq!(log.spied_frees.load(Ordering::SeqCst), 2);
    assert_eq!(log.unspied_frees.load(Ordering::SeqCst), 1);
    assert!(log.calls.load(Ordering::SeqCst) >= 7);
    assert_eq!(ip.revoke(), Ok(()));
    assert_eq!(log.dropped.load(Ordering::SeqCst), 1);
}

#[test]
fn forced_failure_skips_post_and_sets_enomem() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    ip.register(|| Box::new(HeaderSpy::with(&log, 77, usize::MAX))).unwrap();
    os::set_errno(0);
    assert!(ip.malloc(77).is_null());
    assert_eq!(os::errno(), libc::ENOMEM);
    assert_eq!(log.post_alloc.load(Ordering::SeqCst), 0);
    // A real failure does reach post_alloc, with NULL.
    assert!(ip.malloc(usize::MAX - 10).is_null());
    assert_eq!(log.post_alloc.load(Ordering::SeqCst), 0, "size + 24 overflows: forced failure too");
    assert!(ip.malloc(1 << 62).is_null());
    assert_eq!(os::errno(), libc::ENOMEM);
    assert_eq!(log.post_alloc.load(Ordering::SeqCst), 1);
    assert_eq!(ip.revoke(), Ok(()));
}

/// glibc, noting the largest request it was asked for, and how many.
#[derive(Default)]
struct Asked {
    largest: AtomicUsize,
    requests: AtomicUsize,
}

impl Asked {
    fn note(&self, size: usize) {
        self.largest.fetch_max(size, Ordering::SeqCst);
        self.requests.fetch_add(1, Ordering::SeqCst);
    }
}

// SAFETY: glibc's functions, through `Glibc`.
unsafe impl Heap for Asked {
    fn malloc(&self, size: usize) -> *mut c_void {
        self.note(size);
        Glibc.malloc(size)
    }
    fn calloc(&self, nmemb: usize, size: usize) -> *mut c_void {
        self.note(nmemb.saturating_mul(size));
        Glibc.calloc(nmemb, size)
    }
    unsafe fn realloc(&self, ptr: *mut c_void, size: usize) -> *mut c_void {
        self.note(size);
        // SAFETY: the caller's guarantee.
        unsafe { Glibc.realloc(ptr, size) }
    }
    unsafe fn free(&self, ptr: *mut c_void) {
        // SAFETY: the caller's guarantee.
        unsafe { Glibc.free(ptr) }
    }
    fn memalign(&self, align: usize, size: usize) -> *mut c_void {
        self.note(size);
        Glibc.memalign(align, size)
    }
    fn aligned_alloc(&self, align: usize, size: usize) -> *mut c_void {
        self.note(size);
        Glibc.aligned_alloc(align, size)
    }
    unsafe fn posix_memalign(&self, out: *mut *mut c_void, align: usize, size: usize) -> c_int {
        self.note(size);
        // SAFETY: the caller's guarantee.
        unsafe { Glibc.posix_memalign(out, align, size) }
    }
    fn valloc(&self, size: usize) -> *mut c_void {
        self.note(size);
        Glibc.valloc(size)
    }
    fn pvalloc(&self, size: usize) -> *mut c_void {
        self.note(size);
        Glibc.pvalloc(size)
    }
    unsafe fn usable_size(&self, ptr: *mut c_void) -> usize {
        // SAFETY: the caller's guarantee.
        unsafe { Glibc.usable_size(ptr) }
    }
    fn trim(&self, pad: usize) -> c_int {
        Glibc.trim(pad)
    }
    fn realloc_zero_frees(&self) -> bool {
        true
    }
}

#[test]
fn a_refused_request_is_not_allocated_to_find_its_error() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = Interposer::new(Asked::default());
    const GIB: usize = 1 << 30;
    ip.register(|| Box::new(HeaderSpy::with(&log, GIB, usize::MAX))).unwrap();
    os::set_errno(0);
    assert!(ip.malloc(GIB).is_null());
    assert_eq!(os::errno(), libc::ENOMEM);
    assert!(ip.calloc(1 << 15, 1 << 15).is_null());
    assert_eq!(os::errno(), libc::ENOMEM);
    let mut q = core::ptr::null_mut();
    // An alignment every allocator takes is not even probed (one byte at a terabyte's
    // alignment maps two), and errno is set as glibc's posix_memalign sets it.
    os::set_errno(0);
    // SAFETY: q is a local.
    assert_eq!(unsafe { ip.posix_memalign(&mut q, 64, GIB) }, libc::ENOMEM);
    assert_eq!(os::errno(), libc::ENOMEM);
    assert!(ip.memalign(1 << 40, GIB).is_null());
    assert_eq!(ip.heap.requests.load(Ordering::SeqCst), 0, "the real allocator was asked");
    // The real allocator's verdict on a bad alignment is still the caller's error.
    // SAFETY: as above.
    assert_eq!(unsafe { ip.posix_memalign(&mut q, 24, GIB) }, libc::EINVAL);
    // SAFETY: as above.
    assert_eq!(unsafe { ip.posix_memalign(&mut q, 0, GIB) }, libc::EINVAL);
    assert!(ip.aligned_alloc(4096, GIB).is_null());
    assert_eq!(os::errno(), libc::ENOMEM);
    let largest = ip.heap.largest.load(Ordering::SeqCst);
    assert!(largest <= 1, "the real allocator was asked for {largest} bytes");
    assert_eq!(log.post_alloc.load(Ordering::SeqCst), 0);
    assert_eq!(ip.revoke(), Ok(()));
}

#[test]
fn revoke_is_deferred_until_the_last_spied_block_is_freed() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    ip.register(|| Box::new(HeaderSpy::new(&log))).unwrap();
    let blocks: Vec<_> = (0..3).map(|i| ip.malloc(10 + i) as usize).collect();
    assert_eq!(ip.revoke(), Err(SpyError::AccessDenied));
    assert_eq!(ip.revoke(), Err(SpyError::NotRegistered), "already pending");
    let refused = Arc::new(Log::default());
    assert_eq!(ip.register(|| Box::new(HeaderSpy::new(&refused))), Err(SpyError::AlreadyRegistered));
    // New blocks are no longer spied.
    let unspied = ip.malloc(5);
    assert_eq!(log.post_alloc.load(Ordering::SeqCst), 3);
    for (n, &b) in blocks.iter().enumerate() {
        assert_eq!(log.dropped.load(Ordering::SeqCst), 0, "dropped after {n} of 3 frees");
        // SAFETY: b is a live spied block.
        unsafe { ip.free(b as *mut c_void) };
    }
    assert_eq!(log.dropped.load(Ordering::SeqCst), 1, "dropped right after the last free");
    assert_eq!(log.spied_frees.load(Ordering::SeqCst), 3);
    // SAFETY: unspied is a live real block.
    unsafe { ip.free(unspied) };
    assert_eq!(ip.register(|| Box::new(HeaderSpy::new(&log))), Ok(()));
    assert_eq!(ip.revoke(), Ok(()));
}

/// glibc, keeping the real blocks it handed out: a free of any other pointer is recorded as
/// wild instead of reaching glibc (where a caller's pointer past a spy's header aborts).
#[derive(Default)]
struct Tracked {
    live: std::sync::Mutex<Vec<usize>>,
    wild: std::sync::Mutex<Vec<usize>>,
}

impl Tracked {
    fn keep(&self, ptr: *mut c_void) -> *mut c_void {
        self.live.lock().unwrap().push(ptr as usize);
        ptr
    }
}

// SAFETY: glibc's functions, through `Glibc`; a pointer it did not hand out is never passed on.
unsafe impl Heap for Tracked {
    fn malloc(&self, size: usize) -> *mut c_void {
        self.keep(Glibc.malloc(size))
    }
    fn calloc(&self, nmemb: usize, size: usize) -> *mut c_void {
        self.keep(Glibc.calloc(nmemb, size))
    }
    unsafe fn realloc(&self, ptr: *mut c_void, size: usize) -> *mut c_void {
        let mut live = self.live.lock().unwrap();
        let Some(at) = live.iter().position(|&p| p == ptr as usize) else {
            self.wild.lock().unwrap().push(ptr as usize);
            return core::ptr::null_mut();
        };
        // SAFETY: a block glibc handed out, live.
        let moved = unsafe { Glibc.realloc(ptr, size) };
        if !moved.is_null() {
            live[at] = moved as usize;
        }
        moved
    }
    unsafe fn free(&self, ptr: *mut c_void) {
        let mut live = self.live.lock().unwrap();
        match live.iter().position(|&p| p == ptr as usize) {
            // SAFETY: a block glibc handed out, freed once.
            Some(at) => unsafe { Glibc.free(live.swap_remove(at) as *mut c_void) },
            None => self.wild.lock().unwrap().push(ptr as usize),
        }
    }
    fn memalign(&self, align: usize, size: usize) -> *mut c_void {
        self.keep(Glibc.memalign(align, size))
    }
    fn aligned_alloc(&self, align: usize, size: usize) -> *mut c_void {
        self.keep(Glibc.aligned_alloc(align, size))
    }
    unsafe fn posix_memalign(&self, out: *mut *mut c_void, align: usize, size: usize) -> c_int {
        let block = self.memalign(align, size);
        // SAFETY: the caller's guarantee.
        unsafe { *out = block };
        if block.is_null() { libc::ENOMEM } else { 0 }
    }
    fn valloc(&self, size: usize) -> *mut c_void {
        self.keep(Glibc.valloc(size))
    }
    fn pvalloc(&self, size: usize) -> *mut c_void {
        self.keep(Glibc.pvalloc(size))
    }
    unsafe fn usable_size(&self, ptr: *mut c_void) -> usize {
        // SAFETY: the caller's guarantee.
        unsafe { Glibc.usable_size(ptr) }
    }
    fn trim(&self, pad: usize) -> c_int {
        Glibc.trim(pad)
    }
    fn realloc_zero_frees(&self) -> bool {
        true
    }
}

/// The block whose free pauses right after taking it out of the spied table (0: none), and
/// the two sides of the pause: reached, and go on.
static PAUSE_AT: AtomicUsize = AtomicUsize::new(0);
static PAUSED: AtomicBool = AtomicBool::new(false);
static RESUME: AtomicBool = AtomicBool::new(false);

/// Called by `free_spied` between taking a block out of the spied table and releasing it.
pub(super) fn after_taking(ptr: *mut c_void) {
    if !ptr.is_null() && PAUSE_AT.load(Ordering::SeqCst) == ptr as usize {
        PAUSED.store(true, Ordering::SeqCst);
        while !RESUME.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
    }
}

/// Whether the next count of a revoked spy's live blocks pauses between the table and the
/// reallocs in flight, and the two sides of the pause.
static COUNT_PAUSE_ARMED: AtomicBool = AtomicBool::new(false);
static COUNT_PAUSED: AtomicBool = AtomicBool::new(false);
static COUNT_RESUME: AtomicBool = AtomicBool::new(false);

/// Called by `live_blocks` between counting the table and the reallocs in flight.
pub(super) fn after_counting_the_table() {
    if COUNT_PAUSE_ARMED.swap(false, Ordering::SeqCst) {
        COUNT_PAUSED.store(true, Ordering::SeqCst);
        while !COUNT_RESUME.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
    }
}

/// Waits, a minute at most, for `done`; `false` if it never came.
fn within_a_minute(done: impl Fn() -> bool) -> bool {
    let start = std::time::Instant::now();
    while !done() {
        if start.elapsed() > std::time::Duration::from_secs(60) {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

/// A header spy, revoked while two of its blocks live (the revoke pending), and the pauses
/// reset: the interposer, the spy's log and the two blocks.
fn revoked_spy_with_two_blocks() -> (&'static Interposer<Tracked>, Arc<Log>, usize, usize) {
    let log = Arc::new(Log::default());
    let ip: &'static Interposer<Tracked> = Box::leak(Box::new(Interposer::new(Tracked::default())));
    ip.register(|| Box::new(HeaderSpy::new(&log))).unwrap();
    let (first, second) = (ip.malloc(24) as usize, ip.malloc(24) as usize);
    assert_eq!(ip.revoke(), Err(SpyError::AccessDenied), "pending while two blocks live");
    for flag in [&PAUSED, &RESUME, &COUNT_PAUSED, &COUNT_RESUME] {
        flag.store(false, Ordering::SeqCst);
    }
    (ip, log, first, second)
}

/// After [`revoked_spy_with_two_blocks`] and the last block's free: nothing of the caller's
/// reached the real allocator, the spy was dropped once, every real block was freed.
fn assert_all_given_back(ip: &Interposer<Tracked>, log: &Log) {
    assert_eq!(*ip.heap.wild.lock().unwrap(), Vec::<usize>::new(), "no caller's pointer reached the real allocator");
    assert_eq!(log.dropped.load(Ordering::SeqCst), 1, "dropped after the last block");
    assert!(ip.heap.live.lock().unwrap().is_empty(), "every real block freed");
}

/// Two threads free a revoked spy's last two blocks at once. The second finds the table empty
/// and takes the spy out of the registry; the first, which had taken its block out of the
/// table just before, must still give it back through the spy. It looked the spy up only
/// after taking the block, found none, and passed the caller's pointer (past the spy's
/// header) to the real allocator: glibc aborted with `double free or corruption`.
#[test]
fn a_block_taken_from_the_table_goes_back_through_its_spy_when_another_free_retires_it() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip: &'static Interposer<Tracked> = Box::leak(Box::new(Interposer::new(Tracked::default())));
    ip.register(|| Box::new(HeaderSpy::new(&log))).unwrap();
    let (first, second) = (ip.malloc(24) as usize, ip.malloc(24) as usize);
    assert_eq!(ip.revoke(), Err(SpyError::AccessDenied), "pending while two blocks live");
    PAUSED.store(false, Ordering::SeqCst);
    RESUME.store(false, Ordering::SeqCst);
    PAUSE_AT.store(first, Ordering::SeqCst);
    // SAFETY: a live spied block, freed once.
    let pausing = std::thread::spawn(move || unsafe { ip.free(first as *mut c_void) });
    assert!(within_a_minute(|| PAUSED.load(Ordering::SeqCst)));
    // SAFETY: as above.
    let retiring = std::thread::spawn(move || unsafe { ip.free(second as *mut c_void) });
    assert!(within_a_minute(|| ip.registry.is_empty()), "the second free takes the spy out of the registry");
    RESUME.store(true, Ordering::SeqCst);
    pausing.join().unwrap();
    retiring.join().unwrap();
    PAUSE_AT.store(0, Ordering::SeqCst);
    assert_eq!(*ip.heap.wild.lock().unwrap(), Vec::<usize>::new(), "no caller's pointer reached the real allocator");
    assert_eq!(log.spied_frees.load(Ordering::SeqCst), 2, "both blocks went back through the spy");
    assert_eq!(log.dropped.load(Ordering::SeqCst), 1, "dropped once, after both");
    assert!(ip.heap.live.lock().unwrap().is_empty(), "both real blocks freed");
}

/// A realloc holds a revoked spy's block out of the table while the spy lays out its
/// successor. Another thread's free of the spy's only other block found the table empty and
/// dropped the spy; the block the realloc then recorded outlived it, and its free passed the
/// caller's pointer, past the header, to the real allocator.
#[test]
fn a_block_held_by_a_realloc_keeps_its_revoked_spy() {
    let _serial = serial();
    let (ip, log, moved, freed) = revoked_spy_with_two_blocks();
    PAUSE_AT.store(moved, Ordering::SeqCst);
    // SAFETY: a live spied block, reallocated once.
    let reallocating = std::thread::spawn(move || unsafe { ip.realloc(moved as *mut c_void, 4000) as usize });
    assert!(within_a_minute(|| PAUSED.load(Ordering::SeqCst)));
    // SAFETY: a live spied block, freed once.
    let freeing = std::thread::spawn(move || unsafe { ip.free(freed as *mut c_void) });
    // The free either returns, the spy kept, or takes the spy out and waits for the realloc.
    let start = std::time::Instant::now();
    while !freeing.is_finished() && !ip.registry.is_empty() && start.elapsed().as_secs() < 5 {
        std::thread::yield_now();
    }
    RESUME.store(true, Ordering::SeqCst);
    let block = reallocating.join().unwrap();
    freeing.join().unwrap();
    PAUSE_AT.store(0, Ordering::SeqCst);
    assert!(!ip.registry.is_empty(), "the realloc's block keeps the spy");
    // SAFETY: the live block the realloc returned, freed once.
    unsafe { ip.free(block as *mut c_void) };
    assert_all_given_back(ip, &log);
}

/// A revoked spy's last two blocks: one is freed while a realloc moves the other. The free
/// counted the table while the realloc held its block out (so not there), and the reallocs
/// in flight after the realloc had ended (so none): no block, and the spy was dropped with
/// the realloc's new block live; its free then reached the real allocator past the header
/// (review helper 64, who met it with a race of shards: the table's count is a sum, and a
/// block moved from one not yet summed into one summed already was counted nowhere).
#[test]
fn a_realloc_that_ends_while_a_free_counts_the_blocks_keeps_its_revoked_spy() {
    let _serial = serial();
    let (ip, log, moved, freed) = revoked_spy_with_two_blocks();
    PAUSE_AT.store(moved, Ordering::SeqCst);
    // SAFETY: a live spied block, reallocated once.
    let reallocating = std::thread::spawn(move || unsafe { ip.realloc(moved as *mut c_void, 4000) as usize });
    assert!(within_a_minute(|| PAUSED.load(Ordering::SeqCst)));
    // The free counts the table with the realloc's block out of it, and waits.
    COUNT_PAUSE_ARMED.store(true, Ordering::SeqCst);
    // SAFETY: a live spied block, freed once.
    let freeing = std::thread::spawn(move || unsafe { ip.free(freed as *mut c_void) });
    assert!(within_a_minute(|| COUNT_PAUSED.load(Ordering::SeqCst)));
    // The realloc ends: its block is back in the table, and it no longer counts in flight.
    RESUME.store(true, Ordering::SeqCst);
    let block = reallocating.join().unwrap();
    COUNT_RESUME.store(true, Ordering::SeqCst);
    freeing.join().unwrap();
    PAUSE_AT.store(0, Ordering::SeqCst);
    assert!(!ip.registry.is_empty(), "the realloc's block keeps the spy");
    assert_eq!(log.dropped.load(Ordering::SeqCst), 0);
    // SAFETY: the live block the realloc returned, freed once.
    unsafe { ip.free(block as *mut c_void) };
    assert_all_given_back(ip, &log);
}

/// Hands over to a successor from its drop (a C spy's `release`): registers `next`, or
/// revokes whatever is registered, and records the answer.
struct HandingOver {
    ip: &'static Interposer<Glibc>,
    log: Arc<Log>,
    register_next: bool,
    answer: Arc<std::sync::Mutex<Option<Result<(), SpyError>>>>,
}

impl MallocSpy for HandingOver {}

impl Drop for HandingOver {
    fn drop(&mut self) {
        let answer = if self.register_next {
            self.ip.register(|| Box::new(HeaderSpy::new(&self.log)))
        } else {
            self.ip.revoke()
        };
        *self.answer.lock().unwrap() = Some(answer);
    }
}

/// A spy's drop may call the registration API: it ran with the registry's lock held, which
/// the call took again, and the program hung at its first revoke.
#[test]
fn a_spy_dropped_by_a_revoke_may_register_its_successor_or_revoke() {
    let _serial = serial();
    for register_next in [true, false] {
        let log = Arc::new(Log::default());
        let ip: &'static Interposer<Glibc> = Box::leak(Box::new(fresh()));
        let answer = Arc::new(std::sync::Mutex::new(None));
        let spy = HandingOver { ip, log: log.clone(), register_next, answer: answer.clone() };
        ip.register(|| Box::new(spy)).unwrap();
        let revoking = std::thread::spawn(move || ip.revoke());
        assert!(within_a_minute(|| revoking.is_finished()), "the revoke returns");
        assert_eq!(revoking.join().unwrap(), Ok(()));
        let answer = answer.lock().unwrap().take();
        if register_next {
            assert_eq!(answer, Some(Ok(())), "the successor is registered");
            let p = ip.malloc(8);
            assert_eq!(log.post_alloc.load(Ordering::SeqCst), 1, "and spies");
            // SAFETY: a live spied block.
            unsafe { ip.free(p) };
            assert_eq!(ip.revoke(), Ok(()));
        } else {
            assert_eq!(answer, Some(Err(SpyError::NotRegistered)), "nothing is registered any more");
        }
    }
}

/// Calls the registration API from inside its `pre_alloc` once told to, and says when it is
/// inside.
struct RevokingInside {
    ip: &'static Interposer<Glibc>,
    inside: Arc<AtomicBool>,
    answer: Arc<std::sync::Mutex<Option<Result<(), SpyError>>>>,
}

impl MallocSpy for RevokingInside {
    fn pre_alloc(&self, size: usize) -> usize {
        if size == 1234 {
            self.inside.store(true, Ordering::SeqCst);
            // Until the other thread's revoke has claimed the spy and waits for this call.
            while self.ip.registry.current().is_some_and(|c| c.is_active()) {
                std::thread::yield_now();
            }
            *self.answer.lock().unwrap() = Some(self.ip.revoke());
        }
        size
    }
}

/// One thread revokes while another, inside one of the spy's methods, revokes too. The first
/// waited for the second's call to end while holding the registry's lock, which the second
/// waited for: both hung.
#[test]
fn a_revoke_from_inside_a_spy_method_while_another_thread_revokes_returns() {
    let _serial = serial();
    let ip: &'static Interposer<Glibc> = Box::leak(Box::new(fresh()));
    let (inside, answer) = (Arc::new(AtomicBool::new(false)), Arc::new(std::sync::Mutex::new(None)));
    let spy = RevokingInside { ip, inside: inside.clone(), answer: answer.clone() };
    ip.register(|| Box::new(spy)).unwrap();
    let allocating = std::thread::spawn(move || ip.malloc(1234) as usize);
    assert!(within_a_minute(|| inside.load(Ordering::SeqCst)));
    let revoking = std::thread::spawn(move || ip.revoke());
    assert!(within_a_minute(|| allocating.is_finished() && revoking.is_finished()), "both return");
    let block = allocating.join().unwrap();
    assert_eq!(*answer.lock().unwrap(), Some(Err(SpyError::NotRegistered)), "the other revoke has it");
    assert_eq!(revoking.join().unwrap(), Err(SpyError::AccessDenied), "the block allocated meanwhile");
    // SAFETY: a live block allocated under the spy.
    unsafe { ip.free(block as *mut c_void) };
    assert!(ip.registry.is_empty());
}

/// Inside the free of its block `at`, waits until another thread's free has taken this
/// (revoked) spy out of the registry, then registers a successor and revokes it.
struct RegisteringWhileRetired {
    ip: &'static Interposer<Glibc>,
    log: Arc<Log>,
    at: Arc<AtomicUsize>,
    inside: Arc<AtomicBool>,
    answers: Arc<std::sync::Mutex<Vec<Result<(), SpyError>>>>,
}

impl MallocSpy for RegisteringWhileRetired {
    fn pre_free(&self, request: *mut c_void, _spied: bool) -> *mut c_void {
        if request as usize == self.at.load(Ordering::SeqCst) {
            self.inside.store(true, Ordering::SeqCst);
            while !self.ip.registry.is_empty() {
                std::thread::yield_now();
            }
            let registered = self.ip.register(|| Box::new(HeaderSpy::new(&self.log)));
            let revoked = self.ip.revoke();
            self.answers.lock().unwrap().extend([registered, revoked]);
        }
        request
    }
}

/// One thread frees a revoked spy's last block and waits, before dropping it, for the hooks
/// in flight; one of them, inside the spy's `pre_free`, registered a successor and revoked it,
/// and waited in turn for the first thread's hook: both hung. A spy being dropped now holds
/// the registry until the wait is over.
#[test]
fn a_spy_registered_while_its_predecessor_is_dropped_cannot_hang_the_dropping_thread() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip: &'static Interposer<Glibc> = Box::leak(Box::new(fresh()));
    let (at, inside, answers) = (Arc::default(), Arc::new(AtomicBool::new(false)), Arc::default());
    let spy = RegisteringWhileRetired {
        ip,
        log: log.clone(),
        at: Arc::clone(&at),
        inside: Arc::clone(&inside),
        answers: Arc::clone(&answers),
    };
    ip.register(|| Box::new(spy)).unwrap();
    let (last, held) = (ip.malloc(16) as usize, ip.malloc(16) as usize);
    at.store(held, Ordering::SeqCst);
    assert_eq!(ip.revoke(), Err(SpyError::AccessDenied), "pending while two blocks live");
    // SAFETY: live blocks allocated under a spy that laid nothing out, each freed once.
    let holding = std::thread::spawn(move || unsafe { ip.free(held as *mut c_void) });
    assert!(within_a_minute(|| inside.load(Ordering::SeqCst)));
    // SAFETY: as above.
    let retiring = std::thread::spawn(move || unsafe { ip.free(last as *mut c_void) });
    assert!(within_a_minute(|| holding.is_finished() && retiring.is_finished()), "neither free hangs");
    holding.join().unwrap();
    retiring.join().unwrap();
    assert_eq!(
        *answers.lock().unwrap(),
        [Err(SpyError::AlreadyRegistered), Err(SpyError::NotRegistered)],
        "no successor while the revoked spy is being dropped"
    );
    assert_eq!(ip.register(|| Box::new(HeaderSpy::new(&log))), Ok(()), "the registry is free afterwards");
    assert_eq!(ip.revoke(), Ok(()));
}

/// Registers a successor from its drop and revokes it at once: from inside the free that
/// drops this spy, a hook of this spy's.
struct RevokingItsSuccessor {
    ip: &'static Interposer<Glibc>,
    log: Arc<Log>,
    answers: Arc<std::sync::Mutex<Vec<Result<(), SpyError>>>>,
}

impl MallocSpy for RevokingItsSuccessor {}

impl Drop for RevokingItsSuccessor {
    fn drop(&mut self) {
        let registered = self.ip.register(|| Box::new(HeaderSpy::new(&self.log)));
        let revoked = self.ip.revoke();
        self.answers.lock().unwrap().extend([registered, revoked]);
    }
}

/// A spy revoked from inside a hook of another spy is left to that hook's end, which retires
/// only its own spy: with no block live, the revoked one stayed registered for good, and every
/// later registration failed (`E_OBJISREG`). The next spied call now retires it.
#[test]
fn a_spy_revoked_from_another_spys_hook_is_retired_by_the_next_call() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip: &'static Interposer<Glibc> = Box::leak(Box::new(fresh()));
    let answers = Arc::new(std::sync::Mutex::new(Vec::new()));
    let spy = RevokingItsSuccessor { ip, log: log.clone(), answers: answers.clone() };
    ip.register(|| Box::new(spy)).unwrap();
    let block = ip.malloc(16);
    assert_eq!(ip.revoke(), Err(SpyError::AccessDenied), "pending while its block lives");
    // SAFETY: a live block allocated under the spy, which laid nothing out.
    unsafe { ip.free(block) };
    assert_eq!(*answers.lock().unwrap(), [Ok(()), Ok(())], "the successor registered and revoked");
    let later = ip.malloc(8);
    assert_eq!(log.dropped.load(Ordering::SeqCst), 1, "the successor is dropped");
    assert_eq!(ip.register(|| Box::new(HeaderSpy::new(&log))), Ok(()), "the registry is free again");
    // SAFETY: a live real block, allocated while no spy was active.
    unsafe { ip.free(later) };
    assert_eq!(ip.revoke(), Ok(()));
}

/// Asks `did_alloc` about another pointer than the caller's: the first block it saw, or NULL.
struct Redirecting {
    to: AtomicUsize,
}

impl MallocSpy for Redirecting {
    fn pre_did_alloc(&self, _request: *mut c_void, _spied: bool) -> *mut c_void {
        self.to.load(Ordering::SeqCst) as *mut c_void
    }
}

/// `pre_did_alloc` says which pointer the lookup is for, as its contract and COM's say: what it
/// returned was ignored.
#[test]
fn did_alloc_looks_up_the_pointer_pre_did_alloc_returns() {
    let _serial = serial();
    let ip: &'static Interposer<Glibc> = Box::leak(Box::new(fresh()));
    let spy: &'static Redirecting = Box::leak(Box::new(Redirecting { to: AtomicUsize::new(0) }));
    ip.register_static(spy).unwrap();
    let block = ip.malloc(32);
    assert_eq!(ip.did_alloc(block), DidAlloc::No, "NULL: no block");
    spy.to.store(block as usize, Ordering::SeqCst);
    let mut local = 0u64;
    assert_eq!(ip.did_alloc(&mut local as *mut u64 as *mut c_void), DidAlloc::Yes, "the block's answer");
    // SAFETY: a live block allocated under the spy, which laid nothing out.
    unsafe { ip.free(block) };
    assert_eq!(ip.revoke(), Ok(()));
}

/// A failure said outside any spy method (`spy_failed` in the C API) blames no later spy: it
/// revoked the next spy registered at its first call.
#[test]
fn a_failure_said_outside_a_spy_method_blames_no_spy() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    tls::state().spy_failed.set(1);
    ip.register(|| Box::new(HeaderSpy::new(&log))).unwrap();
    let p = ip.malloc(8);
    // SAFETY: a live spied block.
    unsafe { ip.free(p) };
    assert_eq!(log.spied_frees.load(Ordering::SeqCst), 1, "still registered after its first calls");
    assert_eq!(ip.revoke(), Ok(()));
}

/// Revokes itself from its first `pre_alloc`: what it got back, and whether any of its methods
/// ran after its drop.
struct SelfRevoking {
    ip: &'static Interposer<Glibc>,
    log: Arc<Log>,
    revoked: Arc<std::sync::Mutex<Option<Result<(), SpyError>>>>,
}

impl SelfRevoking {
    fn ran(&self) {
        if self.log.dropped.load(Ordering::SeqCst) != 0 {
            self.log.unspied_frees.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Drop for SelfRevoking {
    fn drop(&mut self) {
        self.log.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

impl MallocSpy for SelfRevoking {
    fn pre_alloc(&self, size: usize) -> usize {
        self.ran();
        let mut revoked = self.revoked.lock().unwrap();
        if revoked.is_none() {
            *revoked = Some(self.ip.revoke());
        }
        size
    }
    fn post_alloc(&self, actual: *mut c_void) -> *mut c_void {
        self.ran();
        self.log.post_alloc.fetch_add(1, Ordering::SeqCst);
        actual
    }
}

/// A spy that revokes itself from inside one of its methods, with no block live: the revoke
/// is pending on the block that call returns (it said S_OK, released, review helper 129), the
/// call's Post method still runs, and the spy is dropped once it is no longer in use: after
/// the free of that block. Never under its feet: it was dropped inside the revoke, and the
/// Post method then ran on freed memory.
#[test]
fn a_spy_revoking_itself_from_its_own_method_is_dropped_once_unused() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip: &'static Interposer<Glibc> = Box::leak(Box::new(fresh()));
    let revoked = Arc::new(std::sync::Mutex::new(None));
    let spy = SelfRevoking { ip, log: log.clone(), revoked: revoked.clone() };
    ip.register(|| Box::new(spy)).unwrap();
    let p = ip.malloc(40);
    assert_eq!(*revoked.lock().unwrap(), Some(Err(SpyError::AccessDenied)), "pending on the block returned");
    assert_eq!(log.post_alloc.load(Ordering::SeqCst), 1, "the Post method of the call in progress ran");
    assert_eq!(log.dropped.load(Ordering::SeqCst), 0, "the block that call allocated keeps the spy");
    let later = ip.malloc(8);
    assert!(!later.is_null());
    assert_eq!(log.post_alloc.load(Ordering::SeqCst), 1, "later calls are not spied");
    // SAFETY: later is a live real block.
    unsafe { ip.free(later) };
    // SAFETY: p is a live spied block.
    unsafe { ip.free(p) };
    assert_eq!(log.dropped.load(Ordering::SeqCst), 1, "dropped after the free of that block");
    assert_eq!(log.unspied_frees.load(Ordering::SeqCst), 0, "no method ran after the drop");
    assert_eq!(ip.register(|| Box::new(HeaderSpy::new(&log))), Ok(()), "the registry is free again");
    assert_eq!(ip.revoke(), Ok(()));
}

#[test]
fn a_panicking_spy_is_revoked_and_the_call_still_succeeds() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    ip.register(|| Box::new(HeaderSpy::with(&log, usize::MAX, 33))).unwrap();
    let spied = ip.malloc(8);
    let p = ip.malloc(33);
    assert!(!p.is_null(), "served unspied after the panic");
    assert_eq!(log.dropped.load(Ordering::SeqCst), 0, "a spied block is still live");
    // SAFETY: both are live blocks; the spy still frees its own.
    unsafe {
        ip.free(p);
        ip.free(spied);
    }
    assert_eq!(log.dropped.load(Ordering::SeqCst), 1);
    assert!(ip.registry.is_empty());
}

/// A [`HeaderSpy`] whose `pre_realloc` or `post_realloc` panics, or whose `post_realloc` lays
/// its header out 24 bytes into the real block, so that the caller's pointer is 8 bytes off a
/// 16-byte boundary.
struct ReallocGoesWrong {
    header: HeaderSpy,
    panics: bool,
    pre_panics: bool,
}

impl MallocSpy for ReallocGoesWrong {
    fn pre_alloc(&self, size: usize) -> usize {
        self.header.pre_alloc(size)
    }
    fn post_alloc(&self, actual: *mut c_void) -> *mut c_void {
        self.header.post_alloc(actual)
    }
    fn pre_free(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        self.header.pre_free(request, spied)
    }
    fn pre_realloc(&self, request: *mut c_void, size: usize, spied: bool) -> (*mut c_void, usize) {
        assert!(!self.pre_panics, "spy bug");
        let (real, real_size) = self.header.pre_realloc(request, size, spied);
        (real, real_size + 8)
    }
    fn post_realloc(&self, actual: *mut c_void, spied: bool) -> *mut c_void {
        assert!(!self.panics, "spy bug");
        if actual.is_null() || !spied {
            return actual;
        }
        // The caller's bytes came over at the old header's offset, 16: they move to 24.
        let size = CallScratch::get(0) as usize;
        // SAFETY: the real block holds 24 + size + 8 bytes (`pre_realloc`).
        unsafe { core::ptr::copy(actual.byte_add(16).cast::<u8>(), actual.byte_add(24).cast::<u8>(), size) };
        HeaderSpy::lay_out(actual, 24)
    }
}

/// Grows a 32-byte block of `spy`'s to 100,000 bytes (a move: glibc cannot grow a 32-byte
/// chunk that far in place) and checks that the caller's bytes came along; gives the new block,
/// still live.
fn grow_under(ip: &Interposer<Glibc>, spy: ReallocGoesWrong) -> *mut c_void {
    ip.register(|| Box::new(spy)).unwrap();
    let p = ip.malloc(32);
    let pattern: Vec<u8> = (1..=32).collect();
    // SAFETY: p is a live block of 32 bytes; q one of 100,000.
    unsafe {
        core::ptr::copy_nonoverlapping(pattern.as_ptr(), p.cast::<u8>(), 32);
        let q = ip.realloc(p, 100_000);
        assert!(!q.is_null(), "errno {}", os::errno());
        assert_eq!(core::slice::from_raw_parts(q.cast::<u8>(), 32), &pattern[..]);
        assert!(libc::malloc_usable_size(q) >= 100_000);
        q
    }
}

/// The caller's bytes survive a realloc whose `post_realloc` panics: the real block, handed over
/// as it was, began with the spy's header (review helper 78).
#[test]
fn a_realloc_whose_post_realloc_panics_keeps_the_callers_bytes() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    let q = grow_under(&ip, ReallocGoesWrong { header: HeaderSpy::new(&log), panics: true, pre_panics: false });
    // SAFETY: q is a live block.
    unsafe { ip.free(q) };
    assert!(ip.registry.is_empty(), "the spy is revoked");
}

/// A realloc whose `pre_realloc` panics still succeeds, with the caller's bytes, and the old
/// block goes back through the spy: it failed (ENOMEM), and a Rust program whose `Vec` grew
/// then aborted (review helper 94).
#[test]
fn a_realloc_whose_pre_realloc_panics_still_succeeds() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    let q = grow_under(&ip, ReallocGoesWrong { header: HeaderSpy::new(&log), panics: false, pre_panics: true });
    assert!(!ip.registry.is_empty(), "the old block is still the spy's to free");
    // SAFETY: q is a live block.
    unsafe { ip.free(q) };
    assert_eq!(log.spied_frees.load(Ordering::SeqCst), 1, "the old block went back through the spy");
    assert!(ip.registry.is_empty(), "the spy is revoked, and gone with its last block");
}

/// A spy that lays out aligned blocks as any other (a 16-byte header): misaligned past 16.
struct IgnoresAlignment(HeaderSpy);

impl MallocSpy for IgnoresAlignment {
    fn pre_alloc(&self, size: usize) -> usize {
        self.0.pre_alloc(size)
    }
    fn post_alloc(&self, actual: *mut c_void) -> *mut c_void {
        self.0.post_alloc(actual)
    }
    fn pre_free(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        self.0.pre_free(request, spied)
    }
    fn after_call(&self, call: &Call) {
        self.0.after_call(call)
    }
}

/// An aligned allocation the spy laid out misaligned goes to the caller unspied, and the spy's
/// `after_call` sees it, as it sees its free (it saw the free alone: review helper 129).
#[test]
fn an_allocation_served_unspied_is_seen_by_after_call() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    ip.register(|| Box::new(IgnoresAlignment(HeaderSpy::new(&log)))).unwrap();
    let mut q = core::ptr::null_mut();
    // SAFETY: q is a local out-pointer.
    assert_eq!(unsafe { ip.posix_memalign(&mut q, 64, 10) }, 0);
    assert_eq!(q as usize % 64, 0);
    assert_eq!(log.calls.load(Ordering::SeqCst), 1, "after_call saw the allocation");
    // SAFETY: a live block.
    unsafe { ip.free(q) };
    assert_eq!(log.calls.load(Ordering::SeqCst), 2, "and its free");
    assert_eq!(log.spied_frees.load(Ordering::SeqCst), 1, "only the spy's own misaligned block was spied");
    assert_eq!(ip.revoke(), Ok(()));
}

/// A misaligned block from `post_realloc` is not given out: the caller gets an aligned, unspied
/// copy, and the spy's block goes back through the spy (it was handed over misaligned, though
/// the message said such allocations were served unspied; review helper 78).
#[test]
fn a_misaligned_block_from_post_realloc_is_served_unspied() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    ip.register(|| Box::new(ReallocGoesWrong { header: HeaderSpy::new(&log), panics: false, pre_panics: false }))
        .unwrap();
    let p = ip.malloc(32);
    let pattern: Vec<u8> = (1..=32).collect();
    // SAFETY: p is a live block of 32 bytes; q one of 64.
    unsafe {
        core::ptr::copy_nonoverlapping(pattern.as_ptr(), p.cast::<u8>(), 32);
        let q = ip.realloc(p, 64);
        assert!(!q.is_null());
        assert_eq!(q as usize % 16, 0, "aligned as malloc's blocks are");
        assert_eq!(core::slice::from_raw_parts(q.cast::<u8>(), 32), &pattern[..]);
        assert_eq!(log.spied_frees.load(Ordering::SeqCst), 1, "the spy's misaligned block went back through it");
        ip.free(q);
    }
    assert_eq!(log.spied_frees.load(Ordering::SeqCst), 1, "the copy is no block of the spy's");
    assert_eq!(ip.revoke(), Ok(()));
}

#[test]
fn aligned_allocations_reach_the_spy_and_stay_aligned() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    ip.register(|| Box::new(HeaderSpy::new(&log))).unwrap();
    for align in [16usize, 32, 64, 256, 4096] {
        let p = ip.memalign(align, 100);
        assert_eq!(p as usize % align, 0, "memalign({align})");
        let mut q = core::ptr::null_mut();
        // SAFETY: q is a local out-pointer.
        assert_eq!(unsafe { ip.posix_memalign(&mut q, align, 100) }, 0);
        assert_eq!(q as usize % align, 0, "posix_memalign({align})");
        // SAFETY: live spied blocks.
        unsafe {
            assert_eq!(ip.malloc_usable_size(p), 100);
            ip.free(p);
            ip.free(q);
        }
    }
    // glibc's memalign rounds an alignment up to a power of two, and the spy is given that one:
    // given the caller's 24, a spy's header of that size left the block misaligned, which was
    // then served unspied (review helper 81).
    for align in [24usize, 48, 100, 4097] {
        let p = ip.memalign(align, 100);
        assert_eq!(p as usize % align.next_power_of_two(), 0, "memalign({align})");
        // SAFETY: a live block.
        unsafe {
            assert_eq!(ip.malloc_usable_size(p), 100, "memalign({align}) is spied");
            ip.free(p);
        }
    }
    let mut q = core::ptr::null_mut();
    // SAFETY: q is a local out-pointer.
    assert_eq!(unsafe { ip.posix_memalign(&mut q, 24, 100) }, libc::EINVAL);
    assert_eq!(log.post_alloc.load(Ordering::SeqCst), 15, "EINVAL reaches post_alloc with NULL");
    assert_eq!(log.spied_frees.load(Ordering::SeqCst), 14);
    assert_eq!(ip.revoke(), Ok(()));
}

#[test]
fn calls_from_inside_a_hook_go_to_the_real_heap_and_spied_frees_wait_for_the_next_hook() {
    let _serial = serial();
    let log = Arc::new(Log::default());
    let ip = fresh();
    ip.register(|| Box::new(HeaderSpy::new(&log))).unwrap();
    let spied = ip.malloc(24) as *mut u8;
    let moved_out = ip.malloc(8) as *mut u8;
    // SAFETY: live spied blocks of 24 and 8 bytes.
    unsafe {
        spied.write_bytes(7, 24);
        moved_out.write_bytes(9, 8);
    }
    {
        // As a signal handler that interrupted a hook would: the thread is inside a hook.
        let _inside = Scope::enter().unwrap();
        let raw = ip.malloc(16);
        assert_eq!(log.post_alloc.load(Ordering::SeqCst), 2, "nested allocation is unspied");
        // SAFETY: `raw` is a real block, `spied`/`moved_out` live spied blocks.
        unsafe {
            ip.free(raw);
            ip.free(spied.cast());
            let copy = ip.realloc(moved_out.cast(), 100) as *mut u8;
            assert!((0..8).all(|i| *copy.add(i) == 9), "a spied block reallocated from inside a hook is copied");
            assert!(libc::malloc_usable_size(copy.cast()) >= 100, "into an unspied block");
            ip.free(copy.cast());
        }
        assert_eq!(log.spied_frees.load(Ordering::SeqCst), 0, "spied frees wait: the spy may not run here");
        assert!(ip.deferred.has_pending());
    }
    // The next hook finishes them through the spy.
    let p = ip.malloc(1);
    assert_eq!(log.spied_frees.load(Ordering::SeqCst), 2);
    assert!(!ip.deferred.has_pending());
    // SAFETY: p is a live spied block.
    unsafe { ip.free(p) };
    assert_eq!(ip.revoke(), Ok(()));
}

#[test]
fn leak_tracker_counts_exactly_when_a_freed_address_returns_before_its_record_goes() {
    let _serial = serial();
    let ip = fresh();
    let tracker: &'static LeakTracker = Box::leak(Box::new(LeakTracker::new(8).unwrap()));
    ip.register_static(tracker).unwrap();
    // glibc's tcache hands a freed address straight back, unless something else of this thread
    // took it in between (the unwinder's first look at a module may allocate): try again.
    let (mut p, mut allocs, mut frees) = (ip.malloc(100), 1, 0);
    let q = loop {
        // SAFETY: p is a live block; its free is queued, its record stays for a while.
        unsafe { ip.free(p) };
        let q = ip.malloc(100);
        (allocs, frees) = (allocs + 1, frees + 1);
        if q == p || allocs == 20 {
            break q;
        }
        p = q;
    };
    assert_eq!(q, p, "the freed address came back");
    let s = tracker.stats();
    assert_eq!((s.live_blocks, s.live_bytes, s.total_allocs, s.total_frees), (1, 100, allocs, frees));
    // SAFETY: q is live; then each of `others` is.
    unsafe { ip.free(q) };
    let others: Vec<_> = (0..10).map(|i| ip.malloc(1000 + i)).collect();
    for o in others {
        // SAFETY: as above.
        unsafe { ip.free(o) };
    }
    let s = tracker.stats();
    assert_eq!((s.live_blocks, s.live_bytes, s.total_allocs, s.total_frees), (0, 0, allocs + 10, frees + 11));
    assert_eq!(s.peak_bytes, (1000..1010).sum::<u64>(), "the ten blocks at once; queued frees do not count");
    assert_eq!(ip.revoke(), Ok(()));
}

/// A storm of signal handlers, each freeing a block while the hook it interrupted holds the
/// lock of the block's shard: every such free is queued, and the thread's next free removes the
/// records. A thread could queue 4 once: under CPU load `handler_frees.c` had records outlive
/// their blocks, reported lost. Past the queue's page of slots the records stay, counted for
/// the report's note.
#[test]
fn frees_by_signal_handlers_inside_a_hook_holding_their_shard_lock_take_their_records() {
    use crate::spies::handler_frees::SLOTS;
    let _serial = serial();
    let ip = fresh();
    let tracker: &'static LeakTracker = Box::leak(Box::new(LeakTracker::new(8).unwrap()));
    ip.register_static(tracker).unwrap();
    let blocks: Vec<usize> = (0..80_000).map(|i| ip.malloc(40 + i % 8) as usize).collect();
    let first = blocks[0];
    let (shard, others): (Vec<usize>, Vec<usize>) = blocks.iter().partition(|&&b| tracker.live.same_shard(first, b));
    let (queued, unfollowed) = (SLOTS, 10);
    let (storm, rest) = shard.split_at(queued + unfollowed);
    let before = tracker.stats();
    tracker.live.with_shard_locked(first, || {
        for (i, &b) in storm.iter().enumerate() {
            assert_eq!(tracker.free_in_handler(b).is_some(), i < queued, "free {i} of the storm");
        }
        // Given out again unseen (a handler's own `malloc` inside the hook) and freed again:
        // queued once.
        assert!(tracker.free_in_handler(storm[0]).is_none());
    });
    for &b in storm {
        // SAFETY: a live block of the real allocator, as the handler frees it.
        unsafe { libc::free(b as *mut c_void) };
    }
    // SAFETY: a live block.
    unsafe { ip.free(others[0] as *mut c_void) };
    let recorded = |bs: &[usize]| bs.iter().filter(|&&b| tracker.live.get(b).is_some()).count();
    assert_eq!((recorded(&storm[..queued]), recorded(&storm[queued..])), (0, unfollowed), "applied by the free");
    assert_eq!(tracker.unfollowed_frees(), unfollowed as u64);
    let after = tracker.stats();
    assert_eq!(
        (after.live_blocks, after.total_frees),
        (before.live_blocks - queued as u64 - 1, before.total_frees + queued as u64 + 1)
    );
    for &b in rest.iter().chain(&others[1..]) {
        // SAFETY: live blocks.
        unsafe { ip.free(b as *mut c_void) };
    }
    assert_eq!(ip.revoke(), Ok(()));
}

/// A block freed and allocated again at its address, by the same call with the same size on
/// the same thread, gets a record of its own: the leak check takes a block whose record is
/// unchanged for the one it scanned, and such a block, freed while the exit's check ran, was
/// called lost (CI, twice).
#[test]
fn an_address_allocated_again_from_the_same_call_gets_a_record_of_its_own() {
    let _serial = serial();
    let ip = fresh();
    let tracker: &'static LeakTracker = Box::leak(Box::new(LeakTracker::new(8).unwrap()));
    ip.register_static(tracker).unwrap();
    let mut seen: Vec<(usize, crate::spies::leaks::Record)> = Vec::new();
    for _ in 0..20 {
        let p = ip.malloc(4096);
        tracker.apply_all_pending();
        seen.push((p as usize, tracker.live.get(p as usize).expect("recorded")));
        // SAFETY: p is a live block.
        unsafe { ip.free(p) };
    }
    let (first, again) = (seen[0], seen.iter().skip(1).find(|(p, _)| *p == seen[0].0).expect("the address came back"));
    assert!(first.1.stack == again.1.stack && first.1.size() == again.1.size(), "the same call, the same size");
    assert!(first.1 != again.1, "another record");
    assert_eq!(ip.revoke(), Ok(()));
}

/// An observer counting the allocations it is shown.
struct Seen(AtomicUsize);

impl MallocSpy for Seen {
    fn role(&self) -> crate::spy::Role {
        crate::spy::Role::Observe
    }
    fn after_call(&self, call: &Call) {
        if call.entry == Entry::Malloc {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A ticks spy whose countdowns never run out in a test: after a thread's first call, which
/// sets the thread up, it leaves every call to the gate.
fn ticks_spy_that_never_samples() -> &'static crate::spies::ticks::TickSpy {
    use crate::spies::ticks::{Config, TickSpy};
    let config = Config {
        sampling: crate::trace::Sampling::Poisson,
        interval: 1 << 40,
        depth: 8,
        seed: 1,
        stats_interval_ns: u64::MAX,
    };
    Box::leak(Box::new(TickSpy::new(config).unwrap()))
}

#[test]
fn the_sampling_gate_counts_unsampled_calls_and_closes_with_its_spy() {
    let _serial = serial();
    let ip = fresh();
    let ticks = ticks_spy_that_never_samples();
    ip.register_static(ticks).unwrap();
    ticks.open_gate(&ip.gate);
    // The first call of the thread goes to the spy (which starts the countdown); the rest are
    // counted by the gate alone, and the totals agree.
    for _ in 0..100 {
        // SAFETY: a block just allocated.
        unsafe { ip.free(ip.malloc(64)) };
    }
    let stats = ticks.stats_now();
    assert_eq!((stats.kinds[0].allocs, stats.kinds[0].bytes, stats.frees), (100, 6400, 100));
    assert_eq!(ip.revoke(), Ok(()));
    let seen: &'static Seen = Box::leak(Box::new(Seen(AtomicUsize::new(0))));
    ip.register_static(seen).unwrap();
    // SAFETY: a block just allocated.
    unsafe { ip.free(ip.malloc(64)) };
    assert_eq!(seen.0.load(Ordering::Relaxed), 1, "the next spy sees every call");
    assert_eq!(ip.revoke(), Ok(()));
}

#[test]
fn a_reopened_gate_counts_for_the_new_sampling_spy_only() {
    let _serial = serial();
    let ip = fresh();
    let (first, second) = (ticks_spy_that_never_samples(), ticks_spy_that_never_samples());
    let allocs = |spy: &crate::spies::ticks::TickSpy| spy.stats_now().kinds[0].allocs;
    ip.register_static(first).unwrap();
    first.open_gate(&ip.gate);
    for _ in 0..10 {
        // SAFETY: a block just allocated.
        unsafe { ip.free(ip.malloc(64)) };
    }
    assert_eq!(ip.revoke(), Ok(()));
    // This thread's countdown and record were set up by the first spy, and its countdown is
    // far from running out: the reopened gate must still send the next call to the second
    // spy, which sets the thread up for itself, rather than count into the first one's record.
    ip.register_static(second).unwrap();
    second.open_gate(&ip.gate);
    for _ in 0..10 {
        // SAFETY: a block just allocated.
        unsafe { ip.free(ip.malloc(64)) };
    }
    assert_eq!((allocs(first), allocs(second)), (10, 10));
    assert_eq!(ip.revoke(), Ok(()));
}
