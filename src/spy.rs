//! The spy contract: [`MallocSpy`], the IMallocSpy of this crate, and the types it speaks in.

use core::ffi::c_void;
use core::fmt;

use crate::tls::{self, SCRATCH_WORDS};

/// An exported entry point of the malloc family. Not exhaustive: the C library may add more, as
/// C23 added the sized frees.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Entry {
    /// `malloc`
    Malloc = 0,
    /// `calloc`
    Calloc,
    /// `realloc`
    Realloc,
    /// `reallocarray`
    Reallocarray,
    /// `free`
    Free,
    /// `posix_memalign`
    PosixMemalign,
    /// `aligned_alloc`
    AlignedAlloc,
    /// `memalign`
    Memalign,
    /// `valloc`
    Valloc,
    /// `pvalloc`
    Pvalloc,
    /// `malloc_usable_size`
    MallocUsableSize,
    /// `malloc_trim`
    MallocTrim,
    /// C++'s `operator new(size_t)`, and its `nothrow` and aligned (`std::align_val_t`) forms
    OperatorNew,
    /// C++'s `operator new[](size_t)`, and its `nothrow` and aligned forms
    OperatorNewArray,
    /// C++'s `operator delete(void*)`, and its sized, `nothrow` and aligned forms
    OperatorDelete,
    /// C++'s `operator delete[](void*)`, and its sized, `nothrow` and aligned forms
    OperatorDeleteArray,
    /// C23's `free_sized(ptr, size)`: `free`, told the size the block was allocated with
    FreeSized,
    /// C23's `free_aligned_sized(ptr, alignment, size)`: `free` of an `aligned_alloc` block,
    /// told its alignment and size
    FreeAlignedSized,
}

impl Entry {
    /// Every entry point, in export order.
    pub const ALL: [Entry; 18] = [
        Entry::Malloc,
        Entry::Calloc,
        Entry::Realloc,
        Entry::Reallocarray,
        Entry::Free,
        Entry::PosixMemalign,
        Entry::AlignedAlloc,
        Entry::Memalign,
        Entry::Valloc,
        Entry::Pvalloc,
        Entry::MallocUsableSize,
        Entry::MallocTrim,
        Entry::OperatorNew,
        Entry::OperatorNewArray,
        Entry::OperatorDelete,
        Entry::OperatorDeleteArray,
        Entry::FreeSized,
        Entry::FreeAlignedSized,
    ];

    /// The function's name in C (C++ for the operators).
    pub const fn name(self) -> &'static str {
        match self {
            Entry::Malloc => "malloc",
            Entry::Calloc => "calloc",
            Entry::Realloc => "realloc",
            Entry::Reallocarray => "reallocarray",
            Entry::Free => "free",
            Entry::PosixMemalign => "posix_memalign",
            Entry::AlignedAlloc => "aligned_alloc",
            Entry::Memalign => "memalign",
            Entry::Valloc => "valloc",
            Entry::Pvalloc => "pvalloc",
            Entry::MallocUsableSize => "malloc_usable_size",
            Entry::MallocTrim => "malloc_trim",
            Entry::OperatorNew => "operator new",
            Entry::OperatorNewArray => "operator new[]",
            Entry::OperatorDelete => "operator delete",
            Entry::OperatorDeleteArray => "operator delete[]",
            Entry::FreeSized => "free_sized",
            Entry::FreeAlignedSized => "free_aligned_sized",
        }
    }

    /// Whether the function only gives a block back: `free`, the sized frees and `operator
    /// delete`.
    pub const fn only_releases(self) -> bool {
        matches!(
            self,
            Entry::Free
                | Entry::FreeSized
                | Entry::FreeAlignedSized
                | Entry::OperatorDelete
                | Entry::OperatorDeleteArray
        )
    }

    pub(crate) fn from_index(i: u8) -> Entry {
        Entry::ALL.get(i as usize).copied().unwrap_or(Entry::Malloc)
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What one call of an entry point did, as the caller saw it; given to [`MallocSpy::after_call`].
/// (`#[repr(C)]`: C spies read it as `struct mallocspy_call`.) Made by mallocspy only, and not
/// exhaustive: a later version may tell more of a call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Call {
    /// The function called.
    pub entry: Entry,
    /// Bytes the caller asked for: `calloc`'s and `reallocarray`'s product (saturated on
    /// overflow), `pvalloc`'s size before rounding; 0 for `free`, `malloc_usable_size` and
    /// `malloc_trim`.
    pub size: usize,
    /// Alignment the caller asked for; 0 for the unaligned functions.
    pub align: usize,
    /// The block passed in (`free`, `realloc`, `reallocarray`, `malloc_usable_size`), else null.
    pub ptr: *mut c_void,
    /// The block handed back (allocating functions), else null.
    pub result: *mut c_void,
    /// The call reported an error to the caller (NULL with `errno`, or an error code).
    pub failed: bool,
}

/// The answer of [`crate::did_alloc`]: IMalloc::DidAlloc's 1, 0 and -1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DidAlloc {
    /// A live block of this heap.
    Yes,
    /// Not a block of this heap (null, or a pointer no block can start at).
    No,
    /// Cannot tell: the block was not allocated while a spy was registered.
    Unknown,
}

impl DidAlloc {
    /// IMalloc::DidAlloc's encoding: 1, 0, -1.
    pub const fn as_int(self) -> i32 {
        match self {
            DidAlloc::Yes => 1,
            DidAlloc::No => 0,
            DidAlloc::Unknown => -1,
        }
    }

    /// Decodes IMalloc::DidAlloc's encoding (any positive value is yes, any negative unknown).
    pub const fn from_int(v: i32) -> Self {
        if v > 0 {
            DidAlloc::Yes
        } else if v == 0 {
            DidAlloc::No
        } else {
            DidAlloc::Unknown
        }
    }
}

/// Why registering or revoking a spy failed. Each mirrors a COM status code; not exhaustive, as
/// COM has more (match with a `_` arm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpyError {
    /// A spy is already registered, or a revoked one still has live blocks or is being
    /// dropped on another thread (`CO_E_OBJISREG`).
    AlreadyRegistered,
    /// The argument cannot be a usable spy (`E_INVALIDARG`): from C, a null or malformed
    /// table; from Rust, a spy the active interposer cannot use (an ABI version it does not
    /// know).
    InvalidArgument,
    /// No spy is registered (`CO_E_OBJNOTREG`).
    NotRegistered,
    /// Blocks allocated under the spy are still live (`E_ACCESSDENIED`). The revoke is
    /// pending: the spy keeps receiving the frees and reallocs of those blocks and is dropped
    /// right after the last one is freed.
    AccessDenied,
    /// mallocspy is not the process's allocator: preload `libmallocspy_preload.so`, or build
    /// the program with the `interpose` feature. Under valgrind it never is: the tool's
    /// replacements serve the malloc family.
    NotInterposed,
}

impl SpyError {
    /// The HRESULT-style status code of the C API (`include/mallocspy.h`).
    pub const fn status(self) -> i32 {
        match self {
            SpyError::AlreadyRegistered => crate::ffi::CO_E_OBJISREG,
            SpyError::InvalidArgument => crate::ffi::E_INVALIDARG,
            SpyError::NotRegistered => crate::ffi::CO_E_OBJNOTREG,
            SpyError::AccessDenied => crate::ffi::E_ACCESSDENIED,
            SpyError::NotInterposed => crate::ffi::MALLOCSPY_E_NOT_INTERPOSED,
        }
    }

    /// Decodes a status code of the C API; `Ok(())` for `S_OK`.
    pub const fn from_status(status: i32) -> Result<(), SpyError> {
        match status {
            crate::ffi::S_OK => Ok(()),
            crate::ffi::CO_E_OBJISREG => Err(SpyError::AlreadyRegistered),
            crate::ffi::CO_E_OBJNOTREG => Err(SpyError::NotRegistered),
            crate::ffi::E_ACCESSDENIED => Err(SpyError::AccessDenied),
            crate::ffi::MALLOCSPY_E_NOT_INTERPOSED => Err(SpyError::NotInterposed),
            _ => Err(SpyError::InvalidArgument),
        }
    }
}

impl fmt::Display for SpyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SpyError::AlreadyRegistered => "a malloc spy is already registered",
            SpyError::InvalidArgument => "the argument is not a usable malloc spy",
            SpyError::NotRegistered => "no malloc spy is registered",
            SpyError::AccessDenied => "blocks allocated under the spy are still live; the revoke is pending",
            SpyError::NotInterposed => {
                "mallocspy is not this process's allocator (LD_PRELOAD the shim or use the `interpose` feature)"
            }
        })
    }
}

impl std::error::Error for SpyError {}

/// Per-call scratch words for a spy, private to the calling thread.
///
/// IMallocSpy implementations keep state between a Pre method and its Post method (the size
/// asked for, where the header went) in member variables, because COM serialises the pair.
/// mallocspy does not serialise calls: that would be a process-wide lock on every allocation.
/// Instead each thread has [`CallScratch::WORDS`] words that live from the Pre method to the
/// matching Post method of the call in progress on that thread.
pub struct CallScratch;

impl CallScratch {
    /// Number of words.
    pub const WORDS: usize = SCRATCH_WORDS;

    /// Reads word `i` (0 when out of range).
    #[inline]
    pub fn get(i: usize) -> u64 {
        tls::state().scratch.get(i).map_or(0, |c| c.get())
    }

    /// Writes word `i` (ignored when out of range).
    #[inline]
    pub fn set(i: usize, value: u64) {
        if let Some(c) = tls::state().scratch.get(i) {
            c.set(value)
        }
    }
}

/// What a spy does with the calls it sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// IMallocSpy: every Pre and Post method runs, the spy may change sizes and pointers, the
    /// blocks allocated under it are recorded (that record is `spied`, what
    /// [`crate::did_alloc`] answers from, and what defers a revoke while they live; it costs a
    /// hash table insert and remove per block).
    Interpose,
    /// A pure observer, like an ETW listener: only [`MallocSpy::before_release`] and
    /// [`MallocSpy::after_call`] run, nothing is changed or recorded, `spied` is always false
    /// and revoking takes effect at once. The cheapest kind of spy.
    Observe,
}

/// A malloc spy: code that runs around every call of the process's allocator, and may change
/// what is allocated and what the caller gets, as COM's `IMallocSpy` may.
///
/// # Contract
///
/// For each call of an entry point, the matching Pre method runs just before the real
/// allocator and the Post method just after:
///
/// | entry points | Pre | real call | Post |
/// |---|---|---|---|
/// | `malloc`, `calloc`, `realloc(NULL, n)`, `operator new` | [`pre_alloc`](Self::pre_alloc) | `malloc`/`calloc` | [`post_alloc`](Self::post_alloc) |
/// | `memalign`, `aligned_alloc`, `posix_memalign`, `valloc`, `pvalloc`, aligned `operator new` | [`pre_alloc_aligned`](Self::pre_alloc_aligned) | the same function | [`post_alloc_aligned`](Self::post_alloc_aligned) |
/// | `free`, `realloc(p, 0)`, `operator delete` | [`pre_free`](Self::pre_free) | `free` | [`post_free`](Self::post_free) |
/// | `realloc`, `reallocarray` | [`pre_realloc`](Self::pre_realloc) | `realloc` | [`post_realloc`](Self::post_realloc) |
/// | `malloc_usable_size` | [`pre_get_size`](Self::pre_get_size) | `malloc_usable_size` | [`post_get_size`](Self::post_get_size) |
/// | [`crate::did_alloc`] | [`pre_did_alloc`](Self::pre_did_alloc) | live-block lookup | [`post_did_alloc`](Self::post_did_alloc) |
/// | `malloc_trim` | [`pre_heap_minimize`](Self::pre_heap_minimize) | `malloc_trim` | [`post_heap_minimize`](Self::post_heap_minimize) |
///
/// * A spy may enlarge a request and hand the caller a pointer inside the real block (a
///   header before, a trailer after). `spied` tells the free-side methods whether the block
///   was allocated while this spy was registered, i.e. whether it has the spy's layout. Every
///   block a successful allocation or reallocation returns while the spy is registered is
///   spied, including one that `realloc` moved from an unspied block.
/// * Returning 0 from `pre_alloc`, `pre_alloc_aligned` or `pre_realloc` for a non-zero
///   request makes the call fail (NULL with `ENOMEM`; `EINVAL` for an alignment the real
///   allocator rejects) without calling the Post method, or asking the real allocator for the
///   refused bytes. A real allocation failure calls the Post method with NULL.
/// * Aligned allocations: IMallocSpy has no room for an alignment, so mallocspy adds the
///   `_aligned` pair, which gets it. Their defaults call `pre_alloc`/`post_alloc`, which is right
///   for spies that do not move the pointer. A spy that moves it must keep the caller's pointer
///   aligned; if it does not, the call is undone through `pre_free` and served unspied, and the
///   spy is reported once.
/// * The dispatcher keeps `calloc` zeroing (it asks the real allocator for zeroed memory of the
///   enlarged size), copies on `realloc`, and `errno` as the real allocator left it; `free`
///   preserves `errno`.
/// * Per-call state between a Pre and a Post method goes in [`CallScratch`].
/// * Calls of the allocator made by the spy itself go straight to the real allocator and are
///   not seen by the spy, so a spy may allocate, format and collect. The same holds for calls
///   made by a signal handler that interrupted a hook.
/// * A spy must not block (waiting for another thread to allocate would deadlock) and should
///   be quick: it runs on every allocation of the process.
/// * A panic in any method is caught: it is reported once, the spy is revoked (it keeps
///   receiving the frees of its live blocks) and the program goes on. The call goes on as
///   without the spy, but for what only the spy knows: a block of its own whose
///   [`pre_free`](Self::pre_free) panicked is never freed (where it really starts is the
///   spy's answer), and one whose [`pre_realloc`](Self::pre_realloc) panicked is copied to a
///   new block of the real allocator's, the old one going back through the spy's `pre_free`
///   later.
/// * Calls on different threads run concurrently; a Pre method and its Post method run on the
///   same thread, with no other call of that thread in between.
///
/// Two observation points complete the picture for spies that watch rather than change:
/// [`before_release`](Self::before_release) runs before the real allocator gets a block back
/// (its address may be reused by another thread right after), and
/// [`after_call`](Self::after_call) runs once after every call of an entry point, with the
/// caller's view of it.
#[allow(unused_variables)]
pub trait MallocSpy: Send + Sync {
    /// Before an allocation of `size` bytes: returns the size to really allocate
    /// (0 for a non-zero `size` fails the call).
    fn pre_alloc(&self, size: usize) -> usize {
        size
    }

    /// After the real allocation: `actual` is the real block (NULL if it failed); returns the
    /// pointer the caller gets.
    fn post_alloc(&self, actual: *mut c_void) -> *mut c_void {
        actual
    }

    /// Before an aligned allocation of `size` bytes at `align`: the caller's alignment rounded
    /// up to a power of two, as glibc's `memalign` rounds it (an alignment `posix_memalign` or
    /// `aligned_alloc` refuses still fails the call: the real allocator judges the caller's).
    /// Defaults to [`pre_alloc`](Self::pre_alloc).
    fn pre_alloc_aligned(&self, size: usize, align: usize) -> usize {
        self.pre_alloc(size)
    }

    /// After the real aligned allocation. Defaults to [`post_alloc`](Self::post_alloc).
    fn post_alloc_aligned(&self, actual: *mut c_void, align: usize) -> *mut c_void {
        self.post_alloc(actual)
    }

    /// Before a free of the caller's `request`: returns the real block to free (NULL frees
    /// nothing: a spy that finds the block corrupt may leak it rather than crash).
    fn pre_free(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        request
    }

    /// After the real free.
    fn post_free(&self, spied: bool) {}

    /// Before a reallocation of the caller's `request` to `size` bytes: returns the real block
    /// and the size to pass to the real `realloc` (size 0 for a non-zero `size` fails the call).
    fn pre_realloc(&self, request: *mut c_void, size: usize, spied: bool) -> (*mut c_void, usize) {
        (request, size)
    }

    /// After the real reallocation: `actual` is the new real block (NULL if it failed, in which
    /// case the old block is unchanged); returns the pointer the caller gets.
    fn post_realloc(&self, actual: *mut c_void, spied: bool) -> *mut c_void {
        actual
    }

    /// Before `malloc_usable_size(request)`: returns the real block to measure.
    fn pre_get_size(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        request
    }

    /// After the real `malloc_usable_size`: returns the size the caller may use.
    fn post_get_size(&self, actual: usize, spied: bool) -> usize {
        actual
    }

    /// Before [`crate::did_alloc`]: returns the pointer to look up among the live blocks; NULL
    /// for none, whose answer is [`DidAlloc::No`]. A spy that moves pointers maps a block of
    /// its own (`spied`) back to the real block, as in every Pre method; `request` itself,
    /// the default, asks about the caller's block all the same.
    fn pre_did_alloc(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        request
    }

    /// After the lookup: returns the answer the caller gets.
    fn post_did_alloc(&self, request: *mut c_void, spied: bool, actual: DidAlloc) -> DidAlloc {
        actual
    }

    /// Before `malloc_trim`.
    fn pre_heap_minimize(&self) {}

    /// After `malloc_trim`.
    fn post_heap_minimize(&self) {}

    /// What the spy does (asked once, before registering, outside any lock: it may call the
    /// API): interpose like IMallocSpy (the default), or only observe.
    fn role(&self) -> Role {
        Role::Interpose
    }

    /// An allocating call of `entry` is about to run [`pre_alloc`](Self::pre_alloc) or
    /// [`pre_alloc_aligned`](Self::pre_alloc_aligned) (not for an observing spy). IMallocSpy's
    /// Pre methods do not say which function allocates; a spy that tells C++'s `new` from
    /// `malloc` notes it here.
    fn before_alloc(&self, entry: Entry) {}

    /// A block the caller had is about to go back to the real allocator (by `free`,
    /// `operator delete`, or by `realloc` before it runs). `ptr` is the caller's pointer.
    fn before_release(&self, entry: Entry, ptr: *mut c_void, spied: bool) {}

    /// A call of an entry point completed (or failed), as the caller saw it.
    fn after_call(&self, call: &Call) {}

    /// The dispatcher gave the caller `ptr`, a block of the real allocator, without the spy
    /// (it could not record one the spy laid out; or no spy code could run where it was asked
    /// for, inside a hook or a signal handler on a little stack: told at the next hook, before
    /// the block can come back): a spy that keeps addresses of blocks freed under it forgets
    /// this one, whose free is no double free.
    fn served_unspied(&self, ptr: *mut c_void) {}
}
