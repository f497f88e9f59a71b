//! The process interposer's `malloc` and `free` (and C++'s `operator delete`, which is `free`
//! under its twelve names), sampling gate first, in assembly.
//!
//! The other allocating exports are trampolines: they note the stack and frame pointer the
//! caller left, then jump to Rust (see [`crate::export_interposer!`]), because Rust cannot
//! promise that code run before the spy's stack capture leaves the stack pointer where the
//! caller left it. Under a sampling spy those notes, the jump and the registry check before
//! the gate made up half of what an unsampled `malloc` cost (24 instructions; python3 makes
//! 4 million such calls and as many frees in a 0.6 s run). Here the two commonest calls run
//! the gate's test first, on the process's interposer `GLOBAL` and without touching the
//! stack, in the same steps as the Rust gate's `pass_small` and `pass_free` (`gate.rs`):
//! a call the gate lets through is counted and goes to the real allocator. Any other call
//! goes to the real allocator when no spy is registered, and otherwise (a `malloc` after
//! noting the stack and frame pointer) continues on the spied path in Rust, which takes it
//! as it takes a call the Rust gate did not let through.
//!
//! Sound as the Rust gate is: the words read are atomics of `GLOBAL` read with plain loads
//! (relaxed on x86_64), the calling thread's own TLS block and the spy's record for this
//! thread (which the spy sets before it marks the thread with the gate's key, and never
//! unmaps); the only writes are to this thread's countdown and counters, which only it
//! writes. Nothing is locked, nothing allocated, the stack untouched, and every path ends in
//! a jump (or `ret`) with the caller's registers and stack as the callee expects them.
//!
//! Kept in step with the Rust gate: the offsets are the structures' own (`offset_of!`), and
//! `tests/ticks.rs` checks that a traced run's exact totals are what `spy=count` counts.

use core::ffi::c_void;

use crate::dispatch::Interposer;
use crate::gate::{self, Gate, TickCounters};
use crate::global::GLOBAL;
use crate::heap::NextHeap;
use crate::registry::Registry;
use crate::spy::Entry;
use crate::tls::ThreadState;

// Where the words the assembly reads and writes lie: in `GLOBAL` (`__mallocspy_global`),
// in the thread's state (`fs:` + the block's offset) and in the spy's record for the thread.
pub const REGISTRY: usize = core::mem::offset_of!(Interposer<NextHeap>, registry) + Registry::CELL_OFFSET;
pub const KEY: usize = core::mem::offset_of!(Interposer<NextHeap>, gate) + Gate::KEY_OFFSET;
pub const BITMAP: usize = core::mem::offset_of!(Interposer<NextHeap>, gate) + Gate::BITMAP_OFFSET;
pub const TLS: usize = core::mem::offset_of!(Interposer<NextHeap>, gate) + Gate::TLS_OFFSET;
pub const REAL_MALLOC: usize = core::mem::offset_of!(Interposer<NextHeap>, heap) + NextHeap::MALLOC_FN_OFFSET;
pub const REAL_FREE: usize = core::mem::offset_of!(Interposer<NextHeap>, heap) + NextHeap::FREE_FN_OFFSET;
pub const LARGE_BYTES: usize = gate::LARGE_BYTES;
pub const UNTIL: usize = core::mem::offset_of!(ThreadState, tick_until) + gate::SMALL * 8;
pub const RECORD: usize = core::mem::offset_of!(ThreadState, tick_record);
pub const ALLOCS: usize = core::mem::offset_of!(TickCounters, allocs) + gate::SMALL * 8;
pub const BYTES: usize = core::mem::offset_of!(TickCounters, bytes) + gate::SMALL * 8;
pub const FREES: usize = core::mem::offset_of!(TickCounters, frees);

/// With the address folded, `f = addr ^ addr >> FOLD_SHIFT`, its bitmap word is
/// `(f >> WORD_SHIFT) & WORD_MASK` in its part, `(addr >> PART_WORD_SHIFT) & PART_WORD_MASK`,
/// and its bit in the word `(f >> LINE_SHIFT) % 64` (what `bt` takes of a register offset):
/// `gate::bit_of`.
pub const FOLD_SHIFT: u32 = gate::FOLD_SHIFT;
pub const WORD_SHIFT: u32 = gate::LINE_SHIFT + 6;
pub const WORD_MASK: usize = gate::PART_BITS / 64 - 1;
pub const PART_WORD_SHIFT: u32 = gate::PART_SHIFT + 6;
pub const PART_WORD_MASK: usize = (gate::BITS - gate::PART_BITS) / 64;
pub const LINE_SHIFT: u32 = gate::LINE_SHIFT;
// The two masks split the word index between them, and fit `and`'s 32-bit immediate.
const _: () = assert!(WORD_MASK & PART_WORD_MASK == 0 && (WORD_MASK | PART_WORD_MASK) == gate::BITS / 64 - 1);
const _: () = assert!(gate::BITS / 64 <= i32::MAX as usize);
// Every word of `GLOBAL` a call reads is on its first line.
const _: () = assert!(core::mem::align_of::<Interposer<NextHeap>>() >= 64);
const _: () = assert!(REGISTRY < 64 && KEY < 64 && TLS < 64 && BITMAP < 64 && REAL_MALLOC < 64 && REAL_FREE < 64);

// The gate compares the first word of the thread's state (`tick_seen`, `depth`) with its key.
const _: () = assert!(core::mem::offset_of!(ThreadState, tick_seen) == 0);

/// Defines the exported `malloc` and `free` of [`crate::export_interposer!`] in the crate that
/// expands it. The export is the assembly itself: a `jmp` from the export to a function of
/// this crate cost a taken branch and another line of code per call. Each function ends by
/// aligning its own section to a line, so that the fast path (all of `malloc`'s, and `free`'s
/// first 64 bytes) starts one: python3 spent 3.7% of its time in them, against 4.0% before
/// (`perf`, five alternating runs each, 2026-12-02).
#[doc(hidden)]
#[macro_export]
macro_rules! __fast_path {
    () => {
        /// C `malloc`: the gate first (see `fast_path.rs`).
        #[unsafe(naked)]
        #[unsafe(no_mangle)]
        pub extern "C" fn malloc(size: usize) -> *mut ::core::ffi::c_void {
            ::core::arch::naked_asm!(
                $crate::__cfi_start!(),
                ".hidden __mallocspy_global",
                // The gate is open, the spy set this thread up under this opening and the
                // call comes from outside the hooks: one compare (`seen_and_depth`). The
                // block's offset is the gate's copy, 0 until the first opening: the compare
                // then reads the thread pointer itself, never equal to a key.
                "mov rax, qword ptr [rip + __mallocspy_global + {tls}]",
                "mov rcx, qword ptr [rip + __mallocspy_global + {key}]",
                "cmp qword ptr fs:[rax], rcx",
                "jne 2f",
                // A small request that leaves bytes on the countdown: counted, and the real
                // malloc's.
                "cmp rdi, {large}",
                "jae 2f",
                "mov rcx, qword ptr fs:[rax + {until}]",
                "sub rcx, rdi",
                "jle 2f",
                "mov qword ptr fs:[rax + {until}], rcx",
                "mov rcx, qword ptr fs:[rax + {record}]",
                "add qword ptr [rcx + {allocs}], 1",
                "add qword ptr [rcx + {bytes}], rdi",
                "jmp qword ptr [rip + __mallocspy_global + {real}]",
                "2:",
                "cmp qword ptr [rip + __mallocspy_global + {registry}], 0",
                "jne 3f",
                "jmp qword ptr [rip + __mallocspy_global + {real}]",
                "3:",
                // The spied path: where the caller's stack starts, for the spy's stack
                // capture (the block's offset from the GOT: the gate's copy may still be 0).
                "mov rax, qword ptr [rip + __mallocspy_thread_state@GOTTPOFF]",
                "mov qword ptr fs:[rax + {sp}], rsp",
                "mov qword ptr fs:[rax + {bp}], rbp",
                $crate::__jump_aligned!(),
                // Raises the alignment of the function's own section to a line (the padding
                // after it never runs): the hot path above is then one line from its start.
                ".p2align 6",
                key = const $crate::fast_path::KEY,
                tls = const $crate::fast_path::TLS,
                registry = const $crate::fast_path::REGISTRY,
                real = const $crate::fast_path::REAL_MALLOC,
                large = const $crate::fast_path::LARGE_BYTES,
                until = const $crate::fast_path::UNTIL,
                record = const $crate::fast_path::RECORD,
                allocs = const $crate::fast_path::ALLOCS,
                bytes = const $crate::fast_path::BYTES,
                sp = const $crate::interpose::ENTRY_SP_OFFSET,
                bp = const $crate::interpose::ENTRY_BP_OFFSET,
                target = sym $crate::fast_path::malloc_spied,
            )
        }

        $crate::__release_fast_path!(free, $crate::fast_path::free_spied);
    };
}

/// A releasing export of [`crate::export_interposer!`] in assembly: `free`'s fast path (the
/// gate's test of the sampled blocks' bitmap, then the real `free`), under the name `$name`,
/// continuing in `$target` on the spied path. C++'s `operator delete` in all its forms is
/// `free` under another name: through Rust it cost a C++ program 0.4 ns a call more than
/// libstdc++'s operator calling this `free` had (a loop of `new` and `delete` under
/// `spy=ticks`).
#[doc(hidden)]
#[macro_export]
macro_rules! __release_fast_path {
    ($name:ident, $target:path) => {
        /// The function of this name: `free`'s steps, the gate first (see `fast_path.rs`).
        ///
        /// # Safety
        /// `ptr` is NULL or a live block of the malloc family.
        #[unsafe(naked)]
        #[unsafe(no_mangle)]
        #[allow(non_snake_case)]
        pub unsafe extern "C" fn $name(ptr: *mut ::core::ffi::c_void) {
            ::core::arch::naked_asm!(
                $crate::__cfi_start!(),
                ".hidden __mallocspy_global",
                "mov rax, qword ptr [rip + __mallocspy_global + {tls}]",
                "mov rcx, qword ptr [rip + __mallocspy_global + {key}]",
                "cmp qword ptr fs:[rax], rcx",
                "jne 2f",
                // NULL: nothing to free, nothing to count.
                "test rdi, rdi",
                "jz 1f",
                // The address's bit in the bitmap of sampled blocks: set, and the block may
                // be one.
                // (In registers that carry no argument: a sized or aligned `delete` takes
                // its size and alignment, in rsi and rdx, to its spied path.)
                "mov rcx, qword ptr [rip + __mallocspy_global + {bitmap}]",
                "mov r9, rdi",
                "shr r9, {fold_shift}",
                "xor r9, rdi",
                "mov r10, r9",
                "shr r10, {word_shift}",
                "and r10d, {word_mask}",
                "mov r11, rdi",
                "shr r11, {part_word_shift}",
                "and r11d, {part_word_mask}",
                "or r10, r11",
                "mov r10, qword ptr [rcx + 8 * r10]",
                "shr r9, {line_shift}",
                "bt r10, r9",
                "jc 2f",
                "mov rcx, qword ptr fs:[rax + {record}]",
                "add qword ptr [rcx + {frees}], 1",
                "jmp qword ptr [rip + __mallocspy_global + {real}]",
                "1:",
                "ret",
                "2:",
                "cmp qword ptr [rip + __mallocspy_global + {registry}], 0",
                "jne 3f",
                "jmp qword ptr [rip + __mallocspy_global + {real}]",
                "3:",
                // The spied path: where the caller's stack starts, as for `malloc` (the guard
                // names the caller of a bad free; left stale, the entry of an earlier call
                // named the caller's caller).
                "mov rax, qword ptr [rip + __mallocspy_thread_state@GOTTPOFF]",
                "mov qword ptr fs:[rax + {sp}], rsp",
                "mov qword ptr fs:[rax + {bp}], rbp",
                $crate::__jump_aligned!(),
                ".p2align 6",
                key = const $crate::fast_path::KEY,
                tls = const $crate::fast_path::TLS,
                registry = const $crate::fast_path::REGISTRY,
                bitmap = const $crate::fast_path::BITMAP,
                real = const $crate::fast_path::REAL_FREE,
                fold_shift = const $crate::fast_path::FOLD_SHIFT,
                word_shift = const $crate::fast_path::WORD_SHIFT,
                word_mask = const $crate::fast_path::WORD_MASK,
                part_word_shift = const $crate::fast_path::PART_WORD_SHIFT,
                part_word_mask = const $crate::fast_path::PART_WORD_MASK,
                line_shift = const $crate::fast_path::LINE_SHIFT,
                record = const $crate::fast_path::RECORD,
                frees = const $crate::fast_path::FREES,
                sp = const $crate::interpose::ENTRY_SP_OFFSET,
                bp = const $crate::interpose::ENTRY_BP_OFFSET,
                target = sym $target,
            )
        }
    };
}

/// A `malloc` the assembly did not let through, with a spy registered.
pub extern "C" fn malloc_spied(size: usize) -> *mut c_void {
    GLOBAL.malloc_slow(size)
}

/// A `free` the assembly did not let through, with a spy registered.
///
/// # Safety
/// `ptr` is NULL or a live block of the malloc family.
pub unsafe extern "C" fn free_spied(ptr: *mut c_void) {
    // SAFETY: the caller's guarantee.
    unsafe { release_spied(Entry::Free, ptr) }
}

/// Defines the spied path of `operator delete` forms: `$name(ptr, ...)` gives `ptr` back as
/// `$entry`, with what the form says of the object (its size, its alignment; the plain forms
/// say it is default-aligned) noted for the spy (see `delete_hint.rs`).
macro_rules! told_delete {
    ($(#[$doc:meta])* $name:ident, $entry:ident, ($($arg:ident),*), $size:expr, $align:expr) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `ptr` is NULL or a live block of the malloc family.
        pub unsafe extern "C" fn $name(ptr: *mut c_void, $($arg: usize),*) {
            crate::delete_hint::while_told(ptr, $size, $align, || {
                // SAFETY: the caller's guarantee.
                unsafe { release_spied(Entry::$entry, ptr) }
            })
        }
    };
}

told_delete!(
    /// `operator delete(void*)` (and its `nothrow` form) the assembly did not let through.
    delete_spied, OperatorDelete, (), None, None
);
told_delete!(
    /// `operator delete[](void*)` (and its `nothrow` form) the assembly did not let through.
    delete_array_spied, OperatorDeleteArray, (), None, None
);
told_delete!(
    /// `operator delete(void*, size_t)` the assembly did not let through.
    delete_sized_spied, OperatorDelete, (size), Some(size), None
);
told_delete!(
    /// `operator delete[](void*, size_t)` the assembly did not let through.
    delete_array_sized_spied, OperatorDeleteArray, (size), Some(size), None
);
told_delete!(
    /// `operator delete(void*, align_val_t)` (and its `nothrow` form) the assembly did not let
    /// through.
    delete_aligned_spied, OperatorDelete, (align), None, Some(align)
);
told_delete!(
    /// `operator delete[](void*, align_val_t)` (and its `nothrow` form) the assembly did not
    /// let through.
    delete_array_aligned_spied, OperatorDeleteArray, (align), None, Some(align)
);
told_delete!(
    /// `operator delete(void*, size_t, align_val_t)` the assembly did not let through.
    delete_sized_aligned_spied, OperatorDelete, (size, align), Some(size), Some(align)
);
told_delete!(
    /// `operator delete[](void*, size_t, align_val_t)` the assembly did not let through.
    delete_array_sized_aligned_spied, OperatorDeleteArray, (size, align), Some(size), Some(align)
);

/// # Safety
/// `ptr` is NULL or a live block of the malloc family.
#[inline(always)]
unsafe fn release_spied(entry: Entry, ptr: *mut c_void) {
    if GLOBAL.gate.is_open() {
        // The bitmap said the block may be sampled (or the thread is not set up yet).
        crate::spies::ticks::prefetch_sampled(ptr as usize);
    }
    // SAFETY: the caller's guarantee.
    unsafe { GLOBAL.release_slow(entry, ptr) }
}
