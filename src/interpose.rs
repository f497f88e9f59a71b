//! The exported malloc family: the whole override surface, one short forward per function.
//!
//! [`crate::export_interposer!`] expands to the `#[no_mangle]` definitions in the crate that
//! invokes it (the preload shim, or a program that wants to be its own interposer). They are
//! not defined in this crate directly because a crate that exports `malloc` runs its own test
//! harness on it (see `interposer-pitfalls.md` section 3); the `interpose` feature expands the
//! macro here for programs that depend on this crate.

use core::ffi::{c_int, c_void};
use core::sync::atomic::{AtomicPtr, Ordering};

use crate::global::GLOBAL;
use crate::heap::Heap;
use crate::spy::Entry;

/// Defines the twelve C entry points of the malloc family, C++'s twenty forms of `operator
/// new` and `operator delete`, `_exit`/`_Exit` and
/// `__cxa_at_quick_exit` (so that exit reports are written), `pthread_create` (so that a new thread notes its stack before its
/// routine runs, see `thread_create.rs`), `dlclose` (so that a trace names an unloaded
/// library's code, see `dl_close.rs`), `mmap`/`mmap64`/`munmap`/`mremap` (so that the leak
/// scan knows the program's own mappings, see `program_mappings.rs`), `sigaction`/`signal`
/// (so that a signal ending the process writes the reports, see `ending_signals.rs`), `prctl`
/// and `syscall` (so that a seccomp filter is seen before it is in force, see `seccomp.rs`),
/// the `setuid` family, `setgroups` and `chroot` (so that a forked child's trace writer starts
/// first, see `credentials.rs`), `kill` (so that `kill(-1, ...)` spares the trace writers, see
/// `kill_all.rs`) and the `mallocspy_api_v1` table in the invoking
/// crate, forwarding to this crate's process-wide interposer.
///
/// The allocating entry points are naked trampolines: they note the stack and frame pointer
/// the caller left (the caller's return address is on top) in thread-local storage and jump
/// to the implementation. Stack capture then starts right at the caller, without walking
/// mallocspy's own frames. `malloc` and `free` are the assembly of `fast_path.rs`, which
/// notes them only for a call that goes on to the spy. Every export reaches Rust through
/// [`__jump_aligned!`](crate::__jump_aligned), which aligns a stack the caller left misaligned.
///
/// Invoke it once, at the root of a `cdylib` to preload, or of a program that should be its
/// own interposer (or enable the `interpose` feature instead).
#[macro_export]
macro_rules! export_interposer {
    () => {
        $crate::__fast_path!();
        $crate::__trampoline!(calloc, $crate::interpose::calloc, (nmemb: usize, size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!(realloc, $crate::interpose::realloc, (ptr: *mut ::core::ffi::c_void, size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!(reallocarray, $crate::interpose::reallocarray, (ptr: *mut ::core::ffi::c_void, nmemb: usize, size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!(posix_memalign, $crate::interpose::posix_memalign, (memptr: *mut *mut ::core::ffi::c_void, align: usize, size: usize) -> ::core::ffi::c_int);
        $crate::__trampoline!(aligned_alloc, $crate::interpose::aligned_alloc, (align: usize, size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!(memalign, $crate::interpose::memalign, (align: usize, size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!(valloc, $crate::interpose::valloc, (size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!(pvalloc, $crate::interpose::pvalloc, (size: usize) -> *mut ::core::ffi::c_void);
        $crate::__jump!(malloc_usable_size, $crate::interpose::malloc_usable_size, (ptr: *mut ::core::ffi::c_void) -> usize);
        // glibc's names of its functions, which programs call too (one that defines `malloc`
        // may serve it with `__libc_malloc`): a block they give is freed by `free`, and theirs
        // free what `malloc` gave, so they go where those go (valgrind's replacements too).
        $crate::__trampoline!(__libc_malloc, $crate::interpose::libc_malloc, (size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!(__libc_free, $crate::interpose::libc_free, (ptr: *mut ::core::ffi::c_void) -> ());
        $crate::__trampoline!(__libc_calloc, $crate::interpose::calloc, (nmemb: usize, size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!(__libc_realloc, $crate::interpose::realloc, (ptr: *mut ::core::ffi::c_void, size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!(__libc_memalign, $crate::interpose::memalign, (align: usize, size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!(__libc_valloc, $crate::interpose::valloc, (size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!(__libc_pvalloc, $crate::interpose::pvalloc, (size: usize) -> *mut ::core::ffi::c_void);
        // C23's sized frees (glibc 2.43): a program built against them gave spied blocks to
        // glibc's, behind the spies' backs (the guard's header blocks abort glibc there).
        $crate::__trampoline!(free_sized, $crate::interpose::free_sized, (ptr: *mut ::core::ffi::c_void, size: usize) -> ());
        $crate::__trampoline!(free_aligned_sized, $crate::interpose::free_aligned_sized, (ptr: *mut ::core::ffi::c_void, align: usize, size: usize) -> ());
        $crate::__jump!(malloc_trim, $crate::interpose::malloc_trim, (pad: usize) -> ::core::ffi::c_int);
        // The new thread notes its stack before the routine runs.
        $crate::__jump!(pthread_create, $crate::interpose::pthread_create, (thread: *mut ::core::ffi::c_void, attr: *const ::core::ffi::c_void, routine: ::core::option::Option<$crate::interpose::Routine>, arg: *mut ::core::ffi::c_void) -> ::core::ffi::c_int);
        // The trace writer sees the library's code before it is unmapped.
        $crate::__jump!(dlclose, $crate::interpose::dlclose, (handle: *mut ::core::ffi::c_void) -> ::core::ffi::c_int);
        // The leak scan notes the program's own anonymous mappings, and forgets them.
        $crate::__jump!(mmap, $crate::interpose::mmap, (addr: *mut ::core::ffi::c_void, len: usize, prot: ::core::ffi::c_int, flags: ::core::ffi::c_int, fd: ::core::ffi::c_int, offset: i64) -> *mut ::core::ffi::c_void);
        $crate::__jump!(mmap64, $crate::interpose::mmap, (addr: *mut ::core::ffi::c_void, len: usize, prot: ::core::ffi::c_int, flags: ::core::ffi::c_int, fd: ::core::ffi::c_int, offset: i64) -> *mut ::core::ffi::c_void);
        $crate::__jump!(munmap, $crate::interpose::munmap, (addr: *mut ::core::ffi::c_void, len: usize) -> ::core::ffi::c_int);
        // Variadic in C: the fifth argument is read only with `MREMAP_FIXED`.
        $crate::__jump!(mremap, $crate::interpose::mremap, (old: *mut ::core::ffi::c_void, old_len: usize, new_len: usize, flags: ::core::ffi::c_int, new_address: *mut ::core::ffi::c_void) -> *mut ::core::ffi::c_void);
        // mallocspy's handler of the signals that end a process looks like the default action
        // (see `ending_signals.rs`); the `signal` family as `sigaction` (`bsd_signal` and
        // `ssignal` are glibc's `signal` under other names).
        $crate::__jump!(sigaction, $crate::interpose::sigaction, (signal: ::core::ffi::c_int, act: *const $crate::interpose::SigAction, old: *mut $crate::interpose::SigAction) -> ::core::ffi::c_int);
        $crate::__jump!(signal, $crate::interpose::signal, (signal: ::core::ffi::c_int, handler: usize) -> usize);
        $crate::__jump!(bsd_signal, $crate::interpose::signal, (signal: ::core::ffi::c_int, handler: usize) -> usize);
        $crate::__jump!(ssignal, $crate::interpose::signal, (signal: ::core::ffi::c_int, handler: usize) -> usize);
        $crate::__jump!(sysv_signal, $crate::interpose::sysv_signal, (signal: ::core::ffi::c_int, handler: usize) -> usize);
        // What `signal` is in strict C (`-std=c99`, `-ansi`): glibc's headers rename it.
        $crate::__jump!(__sysv_signal, $crate::interpose::sysv_signal, (signal: ::core::ffi::c_int, handler: usize) -> usize);
        $crate::__jump!(sigset, $crate::interpose::sigset, (signal: ::core::ffi::c_int, handler: usize) -> usize);
        // A hook on a small alternate signal stack goes straight to the real allocator.
        $crate::__jump!(sigaltstack, $crate::interpose::sigaltstack, (stack: *const $crate::interpose::StackT, old: *mut $crate::interpose::StackT) -> ::core::ffi::c_int);
        // A seccomp filter that may kill is seen before it is in force (see `seccomp.rs`).
        $crate::__jump!(prctl, $crate::interpose::prctl, (option: ::core::ffi::c_int, a2: ::core::ffi::c_ulong, a3: ::core::ffi::c_ulong, a4: ::core::ffi::c_ulong, a5: ::core::ffi::c_ulong) -> ::core::ffi::c_int);
        // So is one the `seccomp` system call installs, made through `syscall` (libseccomp's).
        $crate::__syscall!();
        // A forked child's trace writer starts before the child changes its user, root or
        // namespaces (see `credentials.rs`).
        $crate::__credential_calls!($crate::__credentials);
        // `kill(-1, ...)` leaves the trace writers out (see `kill_all.rs`).
        $crate::__jump!(kill, $crate::interpose::kill, (pid: ::core::ffi::c_int, signal: ::core::ffi::c_int) -> ::core::ffi::c_int);
        // `_exit` and `_Exit` write the exit reports first (nothing else would); glibc's
        // `daemon` leaves the parent by its own `_exit`, not this one.
        $crate::__jump!(_exit, $crate::interpose::exit_now, (status: ::core::ffi::c_int) -> !);
        $crate::__jump!(_Exit, $crate::interpose::exit_now, (status: ::core::ffi::c_int) -> !);
        $crate::__jump!(daemon, $crate::interpose::daemon, (nochdir: ::core::ffi::c_int, noclose: ::core::ffi::c_int) -> ::core::ffi::c_int);
        // C++'s operators (Itanium C++ ABI names, `size_t` as `m`): the blocks they give are
        // named as theirs, and a mismatched release (`free` of a `new` block, `delete` of a
        // `new[]` one) is one of the guard's findings.
        // `new` unwinds: out of memory, it throws `bad_alloc` by the C++ runtime's function.
        // Every `delete` is `free`'s assembly under its name; on the spied path, the forms that
        // say the object's size or alignment tell the spy (the guard checks them).
        $crate::__trampoline!("C-unwind", _Znwm, $crate::interpose::operator_new, (size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!("C-unwind", _Znam, $crate::interpose::operator_new_array, (size: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!("C-unwind", _ZnwmRKSt9nothrow_t, $crate::interpose::operator_new_nothrow, (size: usize, nothrow: *const ::core::ffi::c_void) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!("C-unwind", _ZnamRKSt9nothrow_t, $crate::interpose::operator_new_array_nothrow, (size: usize, nothrow: *const ::core::ffi::c_void) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!("C-unwind", _ZnwmSt11align_val_t, $crate::interpose::operator_new_aligned, (size: usize, align: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!("C-unwind", _ZnamSt11align_val_t, $crate::interpose::operator_new_array_aligned, (size: usize, align: usize) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!("C-unwind", _ZnwmSt11align_val_tRKSt9nothrow_t, $crate::interpose::operator_new_aligned_nothrow, (size: usize, align: usize, nothrow: *const ::core::ffi::c_void) -> *mut ::core::ffi::c_void);
        $crate::__trampoline!("C-unwind", _ZnamSt11align_val_tRKSt9nothrow_t, $crate::interpose::operator_new_array_aligned_nothrow, (size: usize, align: usize, nothrow: *const ::core::ffi::c_void) -> *mut ::core::ffi::c_void);
        $crate::__release_fast_path!(_ZdlPv, $crate::fast_path::delete_spied);
        $crate::__release_fast_path!(_ZdlPvm, $crate::fast_path::delete_sized_spied);
        $crate::__release_fast_path!(_ZdlPvRKSt9nothrow_t, $crate::fast_path::delete_spied);
        $crate::__release_fast_path!(_ZdlPvSt11align_val_t, $crate::fast_path::delete_aligned_spied);
        $crate::__release_fast_path!(_ZdlPvmSt11align_val_t, $crate::fast_path::delete_sized_aligned_spied);
        $crate::__release_fast_path!(_ZdlPvSt11align_val_tRKSt9nothrow_t, $crate::fast_path::delete_aligned_spied);
        $crate::__release_fast_path!(_ZdaPv, $crate::fast_path::delete_array_spied);
        $crate::__release_fast_path!(_ZdaPvm, $crate::fast_path::delete_array_sized_spied);
        $crate::__release_fast_path!(_ZdaPvRKSt9nothrow_t, $crate::fast_path::delete_array_spied);
        $crate::__release_fast_path!(_ZdaPvSt11align_val_t, $crate::fast_path::delete_array_aligned_spied);
        $crate::__release_fast_path!(_ZdaPvmSt11align_val_t, $crate::fast_path::delete_array_sized_aligned_spied);
        $crate::__release_fast_path!(_ZdaPvSt11align_val_tRKSt9nothrow_t, $crate::fast_path::delete_array_aligned_spied);
        // What `at_quick_exit` calls: the exit reports' handler is registered first, to run
        // after every other.
        $crate::__jump!(__cxa_at_quick_exit, $crate::interpose::cxa_at_quick_exit, (f: Option<extern "C" fn()>, dso: *mut ::core::ffi::c_void) -> ::core::ffi::c_int);
        /// The C API of this interposer (`include/mallocspy.h`).
        #[unsafe(no_mangle)]
        pub static mallocspy_api_v1: $crate::ffi::Api = $crate::interpose::API;
    };
}

/// One naked trampoline of [`export_interposer!`], `extern "C"` unless an ABI comes first
/// (C++'s `operator new`, whose target unwinds: `"C-unwind"`).
#[doc(hidden)]
#[macro_export]
macro_rules! __trampoline {
    ($name:ident, $target:path, $($signature:tt)*) => {
        $crate::__trampoline!("C", $name, $target, $($signature)*);
    };
    ($abi:literal, $name:ident, $target:path, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        /// The function of this name (see `export_interposer!`).
        #[unsafe(naked)]
        #[unsafe(no_mangle)]
        #[allow(non_snake_case)]
        pub extern $abi fn $name($($arg: $ty),*) -> $ret {
            ::core::arch::naked_asm!(
                $crate::__cfi_start!(),
                "mov rax, qword ptr [rip + __mallocspy_thread_state@GOTTPOFF]",
                "mov qword ptr fs:[rax + {sp}], rsp",
                "mov qword ptr fs:[rax + {bp}], rbp",
                $crate::__jump_aligned!(),
                sp = const $crate::interpose::ENTRY_SP_OFFSET,
                bp = const $crate::interpose::ENTRY_BP_OFFSET,
                target = sym $target,
            )
        }
    };
}

/// One naked jump of [`export_interposer!`], to a target that needs no note of the stack.
#[doc(hidden)]
#[macro_export]
macro_rules! __jump {
    ($name:ident, $target:path, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        /// The C function of this name (see `export_interposer!`).
        #[unsafe(naked)]
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($($arg: $ty),*) -> $ret {
            ::core::arch::naked_asm!($crate::__cfi_start!(), $crate::__jump_aligned!(), target = sym $target)
        }
    };
}

/// The assembly that ends an export's naked code: a jump to `{target}` (a `sym` operand),
/// through a frame that aligns the stack when the caller left it misaligned.
///
/// The ABI has `rsp + 8` on a 16-byte boundary at a function's entry, and compiled Rust
/// relies on it (`movaps` to and from the stack). glibc's allocator happens not to, so
/// hand-written assembly that calls `malloc` with the stack 8 bytes off runs natively; it
/// crashed on every spied path. Such a call goes through `push rbp` / `and rsp, -16` /
/// `call` / `leave`: `rax` is free to test with (no target is variadic, and its notes of the
/// caller's stack are taken before), and an aligned call pays three instructions.
///
/// It ends the function's unwind information, which [`__cfi_start!`](crate::__cfi_start) begins:
/// debuggers, profilers and `backtrace()` walk through the realigned frame as through any.
/// The first line of an export's naked code: the start of its unwind information (the
/// caller's frame is at `rsp + 8` until [`__jump_aligned!`](crate::__jump_aligned) says
/// otherwise).
#[doc(hidden)]
#[macro_export]
macro_rules! __cfi_start {
    () => {
        ".cfi_startproc"
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __jump_aligned {
    () => {
        concat!(
            "lea rax, [rsp + 8]\n",
            "test al, 15\n",
            "jnz 9f\n",
            "jmp {target}\n",
            "9:\n",
            "push rbp\n",
            ".cfi_adjust_cfa_offset 8\n",
            ".cfi_offset rbp, -16\n",
            "mov rbp, rsp\n",
            ".cfi_def_cfa_register rbp\n",
            "and rsp, -16\n",
            "call {target}\n",
            "leave\n",
            ".cfi_def_cfa rsp, 8\n",
            ".cfi_restore rbp\n",
            "ret\n",
            ".cfi_endproc\n",
        )
    };
}

#[doc(hidden)]
pub use crate::tls::{ENTRY_BP_OFFSET, ENTRY_SP_OFFSET};

#[doc(hidden)]
pub use crate::global::API;

/// `__libc_malloc`: `malloc`'s steps in Rust (the exported `malloc` is reached through the
/// process's lookup order, where a program's own `malloc` may come first and call this).
#[doc(hidden)]
pub extern "C" fn libc_malloc(size: usize) -> *mut c_void {
    if GLOBAL.has_spy() { GLOBAL.malloc_slow(size) } else { GLOBAL.heap.malloc(size) }
}

/// `__libc_free`, as [`libc_malloc`].
///
/// # Safety
/// `ptr` is NULL or a live block of the malloc family.
#[doc(hidden)]
pub unsafe extern "C" fn libc_free(ptr: *mut c_void) {
    if GLOBAL.has_spy() {
        // SAFETY: the caller's guarantee.
        unsafe { GLOBAL.free_slow(ptr) }
    } else {
        // SAFETY: the caller's guarantee; with no spy every block is a real block.
        unsafe { GLOBAL.heap.free(ptr) }
    }
}

/// The `free` that a malloc family ahead of ours in the process's lookup order defines, or
/// null: see [`free_sized`].
static FREE_AHEAD: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

/// Notes `free`, the function the process's `free` resolves to, when it is not ours.
pub(crate) fn note_free_ahead(free: *mut c_void) {
    FREE_AHEAD.store(free, Ordering::Relaxed);
}

/// C23's `free_sized(ptr, size)`: `free(ptr)` by the process's `free`, told the size the
/// block was allocated with (the guard checks it, as a sized `delete`'s).
///
/// # Safety
/// `ptr` is NULL or a live block of the malloc family.
#[doc(hidden)]
pub unsafe extern "C" fn free_sized(ptr: *mut c_void, size: usize) {
    // SAFETY: the caller's guarantee.
    unsafe { free_told(Entry::FreeSized, ptr, size, None) }
}

/// C23's `free_aligned_sized(ptr, alignment, size)`: as [`free_sized`], told the alignment
/// too.
///
/// # Safety
/// `ptr` is NULL or a live block of the malloc family.
#[doc(hidden)]
pub unsafe extern "C" fn free_aligned_sized(ptr: *mut c_void, align: usize, size: usize) {
    // SAFETY: the caller's guarantee.
    unsafe { free_told(Entry::FreeAlignedSized, ptr, size, Some(align)) }
}

/// A sized free (`entry`), which the standard allows to be `free(ptr)`: by the process's
/// `free` when an allocator ahead of ours serves it.
///
/// # Safety
/// `ptr` is NULL or a live block of the malloc family.
unsafe fn free_told(entry: Entry, ptr: *mut c_void, size: usize, align: Option<usize>) {
    let ahead = FREE_AHEAD.load(Ordering::Relaxed);
    if !ahead.is_null() {
        // An allocator preloaded before us (jemalloc 5 has no sized frees) served the block:
        // ours would give it to glibc, which aborts (review helper 139), as `reallocarray`.
        // SAFETY: a `free` of the process, from dlsym: the C signature.
        let free: unsafe extern "C" fn(*mut c_void) = unsafe { core::mem::transmute(ahead) };
        // SAFETY: the caller's guarantee.
        return unsafe { free(ptr) };
    }
    if !GLOBAL.has_spy() {
        // SAFETY: the caller's guarantee; with no spy every block is a real block.
        return unsafe { GLOBAL.heap.free(ptr) };
    }
    crate::delete_hint::while_told(ptr, Some(size), align, || {
        // SAFETY: the caller's guarantee.
        unsafe { GLOBAL.release_slow(entry, ptr) }
    })
}

#[doc(hidden)]
pub extern "C" fn calloc(nmemb: usize, size: usize) -> *mut c_void {
    GLOBAL.calloc(nmemb, size)
}

/// # Safety
/// `ptr` is NULL or a live block of the malloc family.
#[doc(hidden)]
pub unsafe extern "C" fn realloc(ptr: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: the caller's guarantee.
    unsafe { GLOBAL.realloc(ptr, size) }
}

/// The `realloc` that a malloc family ahead of ours in the process's lookup order defines
/// (another allocator preloaded before the shim), or null: see [`reallocarray`].
static REALLOC_AHEAD: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

/// Notes `realloc`, the function the process's `realloc` resolves to, when it is not ours.
pub(crate) fn note_realloc_ahead(realloc: *mut c_void) {
    REALLOC_AHEAD.store(realloc, Ordering::Relaxed);
}

/// # Safety
/// `ptr` is NULL or a live block of the malloc family.
#[doc(hidden)]
pub unsafe extern "C" fn reallocarray(ptr: *mut c_void, nmemb: usize, size: usize) -> *mut c_void {
    let ahead = REALLOC_AHEAD.load(Ordering::Relaxed);
    if !ahead.is_null() {
        // jemalloc and tcmalloc define no `reallocarray`, so the program's calls come here
        // even when they serve everything else; glibc's, which they would reach without us,
        // calls `realloc` by name. Ours took `realloc` from glibc, and handed it jemalloc's
        // blocks: `sort` crashed. A forwarding wrapper's `realloc` comes back to ours.
        let Some(bytes) = nmemb.checked_mul(size) else {
            crate::os::set_errno(libc::ENOMEM);
            return core::ptr::null_mut();
        };
        // SAFETY: a `realloc` of the process, from dlsym: the C signature; the caller's
        // guarantee for `ptr`.
        let realloc: unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void = unsafe { core::mem::transmute(ahead) };
        // SAFETY: as above.
        return unsafe { realloc(ptr, bytes) };
    }
    // SAFETY: the caller's guarantee.
    unsafe { GLOBAL.reallocarray(ptr, nmemb, size) }
}

/// Defines the Rust side of one form of C++'s `operator new`: the block from
/// [`Interposer::operator_new`](crate::dispatch::Interposer::operator_new), with what C++
/// callers rely on when there is none: while a new-handler is installed it is called and the
/// allocation tried again; without one, `nothrow` gives NULL and the others throw `bad_alloc`,
/// by the C++ runtime's own function. The loop runs here, not in the runtime's operator,
/// whose retries go through our `malloc`: a block it got once the handler had freed memory was
/// named `malloc`'s, and its `delete` was a mismatch. A `nothrow` form whose handler may throw
/// goes to the runtime's, which catches (and calls our throwing form). A call from an
/// allocator that defines the operators itself goes to its own, unseen
/// ([`crate::heap::is_code_of_an_allocator_with_operators`]).
macro_rules! operator_new {
    ($name:ident, $symbol:literal, $entry:ident, ($($arg:ident: $ty:ty),*), $align:expr, nothrow: $nothrow:literal) => {
        #[doc(hidden)]
        pub extern "C-unwind" fn $name(size: usize $(, $arg: $ty)*) -> *mut c_void {
            static NEXT: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());
            let next = || {
                let next = next_definition(&NEXT, $symbol);
                // SAFETY: the next definition of this operator: the same signature.
                (!next.is_null()).then(|| unsafe {
                    core::mem::transmute::<*mut c_void, extern "C-unwind" fn(usize $(, $ty)*) -> *mut c_void>(next)
                })
            };
            if crate::heap::is_code_of_an_allocator_with_operators(crate::early::caller_of_hook) {
                return next().map_or(core::ptr::null_mut(), |next| next(size $(, $arg)*));
            }
            loop {
                let block = GLOBAL.operator_new(Entry::$entry, size, $align);
                if !block.is_null() {
                    return block;
                }
                let Some(handler) = new_handler() else { break };
                if $nothrow {
                    return next().map_or(core::ptr::null_mut(), |next| next(size $(, $arg)*));
                }
                call_new_handler(handler);
            }
            if $nothrow {
                return core::ptr::null_mut();
            }
            throw_bad_alloc();
            next().map_or(core::ptr::null_mut(), |next| next(size $(, $arg)*))
        }
    };
}

operator_new!(operator_new, c"_Znwm", OperatorNew, (), 0, nothrow: false);
operator_new!(operator_new_array, c"_Znam", OperatorNewArray, (), 0, nothrow: false);
operator_new!(operator_new_nothrow, c"_ZnwmRKSt9nothrow_t", OperatorNew, (nothrow: *const c_void), 0, nothrow: true);
operator_new!(
    operator_new_array_nothrow,
    c"_ZnamRKSt9nothrow_t",
    OperatorNewArray,
    (nothrow: *const c_void),
    0,
    nothrow: true
);
operator_new!(operator_new_aligned, c"_ZnwmSt11align_val_t", OperatorNew, (align: usize), align, nothrow: false);
operator_new!(
    operator_new_array_aligned,
    c"_ZnamSt11align_val_t",
    OperatorNewArray,
    (align: usize),
    align,
    nothrow: false
);
operator_new!(
    operator_new_aligned_nothrow,
    c"_ZnwmSt11align_val_tRKSt9nothrow_t",
    OperatorNew,
    (align: usize, nothrow: *const c_void),
    align,
    nothrow: true
);
operator_new!(
    operator_new_array_aligned_nothrow,
    c"_ZnamSt11align_val_tRKSt9nothrow_t",
    OperatorNewArray,
    (align: usize, nothrow: *const c_void),
    align,
    nothrow: true
);

/// The definition of `symbol` after ours in the process's lookup order (the C++ runtime's),
/// looked up once; NULL when there is none.
fn next_definition(cache: &AtomicPtr<c_void>, symbol: &core::ffi::CStr) -> *mut c_void {
    let mut next = cache.load(Ordering::Relaxed);
    if next.is_null() {
        // SAFETY: a NUL-terminated name. Outside any hook: a failing lookup's `dlerror`
        // allocation comes back through the allocator, as any call.
        next = unsafe { libc::dlsym(libc::RTLD_NEXT, symbol.as_ptr()) };
        cache.store(next, Ordering::Relaxed);
    }
    next
}

/// The program's new-handler (`std::get_new_handler()`, the same name in libstdc++ and
/// libc++), if one is installed.
fn new_handler() -> Option<extern "C-unwind" fn()> {
    static GET: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());
    let get = next_definition(&GET, c"_ZSt15get_new_handlerv");
    if get.is_null() {
        return None;
    }
    // SAFETY: `std::new_handler std::get_new_handler() noexcept`: a pointer to a function
    // taking nothing and returning nothing (which may throw), or NULL.
    let get = unsafe { core::mem::transmute::<*mut c_void, extern "C" fn() -> Option<extern "C-unwind" fn()>>(get) };
    get()
}

/// Calls the program's new-handler, keeping the notes of the caller's stack, which its own
/// calls of the allocator (a `free` of memory kept in reserve) overwrite: the retry's stack
/// was walked from a dead frame (review helper 116).
fn call_new_handler(handler: extern "C-unwind" fn()) {
    let state = crate::tls::state();
    let (sp, bp) = (state.entry_sp.get(), state.entry_bp.get());
    handler();
    state.entry_sp.set(sp);
    state.entry_bp.set(bp);
}

/// Throws `std::bad_alloc` by the C++ runtime's own function (libstdc++'s, libc++'s); returns
/// only when there is none, and the caller then leaves it to the runtime's operator.
fn throw_bad_alloc() {
    static THROW: [AtomicPtr<c_void>; 2] = [const { AtomicPtr::new(core::ptr::null_mut()) }; 2];
    for (cache, symbol) in THROW.iter().zip([c"_ZSt17__throw_bad_allocv", c"_ZNSt3__117__throw_bad_allocEv"]) {
        let throw = next_definition(cache, symbol);
        if !throw.is_null() {
            // SAFETY: `[[noreturn]] void std::__throw_bad_alloc()`.
            let throw = unsafe { core::mem::transmute::<*mut c_void, extern "C-unwind" fn() -> !>(throw) };
            throw();
        }
    }
}

#[doc(hidden)]
pub use crate::thread_create::Routine;

#[doc(hidden)]
pub extern "C" fn exit_now(status: c_int) -> ! {
    crate::preload::exit_now(status)
}

#[doc(hidden)]
pub extern "C" fn daemon(nochdir: c_int, noclose: c_int) -> c_int {
    crate::preload::daemon(nochdir, noclose)
}

/// # Safety
/// As `__cxa_at_quick_exit`.
#[doc(hidden)]
pub unsafe extern "C" fn cxa_at_quick_exit(f: Option<extern "C" fn()>, dso: *mut c_void) -> c_int {
    // SAFETY: the caller's guarantee.
    unsafe { crate::preload::cxa_at_quick_exit(f, dso) }
}

/// # Safety
/// As `pthread_create`.
#[doc(hidden)]
pub unsafe extern "C" fn pthread_create(
    thread: *mut c_void,
    attr: *const c_void,
    routine: Option<Routine>,
    arg: *mut c_void,
) -> c_int {
    // SAFETY: the caller's guarantee.
    unsafe { crate::thread_create::create(thread, attr, routine, arg) }
}

/// # Safety
/// As `mmap`.
#[doc(hidden)]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    offset: i64,
) -> *mut c_void {
    // SAFETY: the caller's guarantee.
    unsafe { crate::program_mappings::mmap(addr, len, prot, flags, fd, offset) }
}

/// C's `stack_t`, for [`export_interposer!`].
#[doc(hidden)]
pub type StackT = libc::stack_t;

/// # Safety
/// As `sigaltstack`.
#[doc(hidden)]
pub unsafe extern "C" fn sigaltstack(stack: *const libc::stack_t, old: *mut libc::stack_t) -> c_int {
    // SAFETY: the caller's guarantee.
    unsafe { crate::alt_stack::sigaltstack(stack, old) }
}

/// # Safety
/// As `prctl` with these arguments.
#[doc(hidden)]
pub unsafe extern "C" fn prctl(
    option: c_int,
    a2: core::ffi::c_ulong,
    a3: core::ffi::c_ulong,
    a4: core::ffi::c_ulong,
    a5: core::ffi::c_ulong,
) -> c_int {
    // SAFETY: the caller's guarantee.
    unsafe { crate::seccomp::prctl(option, a2, a3, a4, a5) }
}

/// As `kill`.
///
/// # Safety
/// None beyond C's: the arguments are plain integers.
#[doc(hidden)]
pub unsafe extern "C" fn kill(pid: c_int, signal: c_int) -> c_int {
    // SAFETY: the caller's guarantee.
    unsafe { crate::kill_all::kill(pid, signal) }
}

/// The exports of `credentials.rs`'s wrappers, each as three words to an `int`.
#[doc(hidden)]
#[macro_export]
macro_rules! __credentials {
    ($($name:ident: $euid:expr),*) => {
        $($crate::__jump!($name, $crate::interpose::$name, (a: usize, b: usize, c: usize) -> ::core::ffi::c_int);)*
    };
}

/// The wrappers of `credentials.rs`, for [`export_interposer!`].
macro_rules! credential_wrappers {
    ($($name:ident: $euid:expr),*) => {
        $(
            /// # Safety
            /// As the C function of this name with these arguments.
            #[doc(hidden)]
            pub unsafe extern "C" fn $name(a: usize, b: usize, c: usize) -> c_int {
                // SAFETY: the caller's guarantee.
                unsafe { crate::credentials::$name(a, b, c) }
            }
        )*
    };
}
crate::__credential_calls!(credential_wrappers);

/// The `syscall` of the library after this one (libc's), which the exported `syscall` jumps to
/// for every call but `seccomp`'s; null until looked up at start (`seccomp::warm_up`), and the
/// export makes the call itself meanwhile.
#[doc(hidden)]
pub static NEXT_SYSCALL: AtomicPtr<c_void> = AtomicPtr::new(core::ptr::null_mut());

#[doc(hidden)]
pub use libc::__errno_location as errno_location;

/// The system call's number on x86_64, which the exported `syscall` compares with.
#[doc(hidden)]
pub const SYS_SECCOMP: core::ffi::c_long = libc::SYS_seccomp;

/// C's `syscall` (variadic), defined by [`export_interposer!`]: the `seccomp` system call goes to
/// [`syscall_seccomp`]; every other call jumps to the next library's `syscall` with the
/// registers (but the scratch `r11`) and stack as the caller left them (its sixth argument is
/// on the stack), or,
/// before that was looked up, is made here as glibc makes it. No Rust frame on that path: a
/// `syscall(SYS_vfork)` or `syscall(SYS_clone)` child returns through it as through libc's.
#[doc(hidden)]
#[macro_export]
macro_rules! __syscall {
    () => {
        /// C's `syscall` (see `interpose::__syscall!`).
        ///
        /// # Safety
        /// As `syscall` with these arguments.
        #[unsafe(naked)]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn syscall(
            nr: ::core::ffi::c_long,
            a1: ::core::ffi::c_long,
            a2: ::core::ffi::c_long,
            a3: ::core::ffi::c_long,
            a4: ::core::ffi::c_long,
            a5: ::core::ffi::c_long,
            a6: ::core::ffi::c_long,
        ) -> ::core::ffi::c_long {
            ::core::arch::naked_asm!(
                $crate::__cfi_start!(),
                "cmp rdi, {seccomp}",
                "je 8f",
                // r11, not rax: a variadic callee reads `al` (the count of vector registers).
                "mov r11, qword ptr [rip + {next}]",
                "test r11, r11",
                "jz 7f",
                "jmp r11",
                "7:",
                "mov rax, rdi",
                "mov rdi, rsi",
                "mov rsi, rdx",
                "mov rdx, rcx",
                "mov r10, r8",
                "mov r8, r9",
                "mov r9, qword ptr [rsp + 8]",
                "syscall",
                "cmp rax, -4095",
                "jae 6f",
                "ret",
                "6:",
                "neg eax",
                "push rax",
                ".cfi_adjust_cfa_offset 8",
                "call {errno}@PLT",
                "pop rcx",
                ".cfi_adjust_cfa_offset -8",
                "mov dword ptr [rax], ecx",
                "mov rax, -1",
                "ret",
                "8:",
                $crate::__jump_aligned!(),
                seccomp = const $crate::interpose::SYS_SECCOMP,
                next = sym $crate::interpose::NEXT_SYSCALL,
                errno = sym $crate::interpose::errno_location,
                target = sym $crate::interpose::syscall_seccomp,
            )
        }
    };
}

/// The exported `syscall`'s `seccomp` calls (see `seccomp.rs`).
///
/// # Safety
/// As `syscall(SYS_seccomp, operation, flags, args)`.
#[doc(hidden)]
pub unsafe extern "C" fn syscall_seccomp(
    nr: core::ffi::c_long,
    operation: core::ffi::c_ulong,
    flags: core::ffi::c_ulong,
    args: core::ffi::c_ulong,
) -> core::ffi::c_long {
    crate::seccomp::seccomp(operation, flags, args, || {
        let next = NEXT_SYSCALL.load(Ordering::Acquire);
        if next.is_null() {
            // SAFETY: the caller's guarantee covers the call.
            let r = unsafe { crate::os::raw_syscall(nr, [operation as usize, flags as usize, args as usize, 0, 0, 0]) };
            if (-4095..0).contains(&r) {
                crate::os::set_errno(-r as c_int);
                return -1;
            }
            return r as core::ffi::c_long;
        }
        type Syscall = unsafe extern "C" fn(
            core::ffi::c_long,
            core::ffi::c_ulong,
            core::ffi::c_ulong,
            core::ffi::c_ulong,
        ) -> core::ffi::c_long;
        // SAFETY: the next `syscall` takes its arguments as words (the fourth on is unread by
        // this call); the caller's guarantee covers the call.
        unsafe { core::mem::transmute::<*mut c_void, Syscall>(next)(nr, operation, flags, args) }
    })
}

/// C's `struct sigaction`, for [`export_interposer!`].
#[doc(hidden)]
pub type SigAction = libc::sigaction;

/// # Safety
/// As `sigaction`.
#[doc(hidden)]
pub unsafe extern "C" fn sigaction(signal: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int {
    crate::signal_frames::handlers_may_change();
    // SAFETY: the caller's guarantee.
    unsafe { crate::ending_signals::sigaction(signal, act, old) }
}

/// # Safety
/// As `signal`.
#[doc(hidden)]
pub unsafe extern "C" fn signal(signal: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    crate::signal_frames::handlers_may_change();
    // SAFETY: the caller's guarantee.
    unsafe { crate::ending_signals::signal(signal, handler) }
}

/// # Safety
/// As `sysv_signal`.
#[doc(hidden)]
pub unsafe extern "C" fn sysv_signal(signal: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    crate::signal_frames::handlers_may_change();
    // SAFETY: the caller's guarantee.
    unsafe { crate::ending_signals::sysv_signal(signal, handler) }
}

/// # Safety
/// As `sigset`.
#[doc(hidden)]
pub unsafe extern "C" fn sigset(signal: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    crate::signal_frames::handlers_may_change();
    // SAFETY: the caller's guarantee.
    unsafe { crate::ending_signals::sigset(signal, handler) }
}

/// # Safety
/// As `munmap`.
#[doc(hidden)]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> c_int {
    // SAFETY: the caller's guarantee.
    unsafe { crate::program_mappings::munmap(addr, len) }
}

/// # Safety
/// As `mremap`.
#[doc(hidden)]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: usize,
    new_len: usize,
    flags: c_int,
    new_address: *mut c_void,
) -> *mut c_void {
    // SAFETY: the caller's guarantee.
    unsafe { crate::program_mappings::mremap(old, old_len, new_len, flags, new_address) }
}

/// # Safety
/// As `dlclose`.
#[doc(hidden)]
pub unsafe extern "C" fn dlclose(handle: *mut c_void) -> c_int {
    // SAFETY: the caller's guarantee.
    unsafe { crate::dl_close::dlclose(handle) }
}

/// # Safety
/// `memptr` is valid for a write.
#[doc(hidden)]
pub unsafe extern "C" fn posix_memalign(memptr: *mut *mut c_void, align: usize, size: usize) -> c_int {
    // SAFETY: the caller's guarantee.
    unsafe { GLOBAL.posix_memalign(memptr, align, size) }
}

#[doc(hidden)]
pub extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    GLOBAL.aligned_alloc(align, size)
}

#[doc(hidden)]
pub extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    GLOBAL.memalign(align, size)
}

#[doc(hidden)]
pub extern "C" fn valloc(size: usize) -> *mut c_void {
    GLOBAL.valloc(size)
}

#[doc(hidden)]
pub extern "C" fn pvalloc(size: usize) -> *mut c_void {
    GLOBAL.pvalloc(size)
}

/// # Safety
/// `ptr` is NULL or a live block of the malloc family.
#[doc(hidden)]
pub unsafe extern "C" fn malloc_usable_size(ptr: *mut c_void) -> usize {
    // SAFETY: the caller's guarantee.
    unsafe { GLOBAL.malloc_usable_size(ptr) }
}

#[doc(hidden)]
pub extern "C" fn malloc_trim(pad: usize) -> c_int {
    GLOBAL.malloc_trim(pad)
}
