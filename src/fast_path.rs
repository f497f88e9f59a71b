//! The process interposer's `malloc` and `free`, sampling gate first, in assembly.
//!
//! The other allocating exports are trampolines: they note the stack and frame pointer the
//! caller left, then jump to Rust (see [`crate::export_interposer!`]), because Rust cannot
//! promise that code run before the spy's stack capture leaves the stack pointer where the
//! caller left it. Under a sampling spy those notes, the jump and the registry check before
//! the gate made up half of what an unsampled `malloc` cost (24 instructions; python3 makes
//! 4 million such calls and as many frees in a 0.6 s run). Here the two commonest calls run
//! the gate's test first, on the process's interposer [`GLOBAL`] and without touching the
//! stack, in the same steps as the Rust gate's `pass_small` and `pass_free` ([`crate::gate`]):
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
use crate::tls::ThreadState;

/// Offsets in [`GLOBAL`] of the words the assembly reads.
const REGISTRY: usize = core::mem::offset_of!(Interposer<NextHeap>, registry) + Registry::CELL_OFFSET;
const KEY: usize = core::mem::offset_of!(Interposer<NextHeap>, gate) + Gate::KEY_OFFSET;
const BITMAP: usize = core::mem::offset_of!(Interposer<NextHeap>, gate) + Gate::BITMAP_OFFSET;
const REAL_MALLOC: usize = core::mem::offset_of!(Interposer<NextHeap>, heap) + NextHeap::MALLOC_FN_OFFSET;
const REAL_FREE: usize = core::mem::offset_of!(Interposer<NextHeap>, heap) + NextHeap::FREE_FN_OFFSET;

/// The bitmap word of an address is `(addr >> WORD_SHIFT) & WORD_MASK`, its bit in the word
/// `(addr >> LINE_SHIFT) % 64` (what `bt` takes of a register offset): [`gate::bit_of`].
const WORD_SHIFT: u32 = gate::LINE_SHIFT + 6;
const WORD_MASK: usize = gate::BITS / 64 - 1;
const _: () = assert!(WORD_MASK <= i32::MAX as usize);

// The gate compares the first word of the thread's state (`tick_seen`, `depth`) with its key.
const _: () = assert!(core::mem::offset_of!(ThreadState, tick_seen) == 0);

/// `malloc` of the process's interposer (the export `malloc` jumps here).
#[unsafe(naked)]
pub extern "C" fn malloc(size: usize) -> *mut c_void {
    core::arch::naked_asm!(
        "mov rax, qword ptr [rip + __mallocspy_thread_state@GOTTPOFF]",
        // The gate is open, the spy set this thread up under this opening and the call comes
        // from outside the hooks: one compare (`ThreadState::seen_and_depth`).
        "mov rcx, qword ptr [rip + {global} + {key}]",
        "cmp qword ptr fs:[rax], rcx",
        "jne 2f",
        // A small request that leaves bytes on the countdown: counted, and the real malloc's.
        "cmp rdi, {large}",
        "jae 2f",
        "mov rcx, qword ptr fs:[rax + {until}]",
        "sub rcx, rdi",
        "jle 2f",
        "mov qword ptr fs:[rax + {until}], rcx",
        "mov rcx, qword ptr fs:[rax + {record}]",
        "add qword ptr [rcx + {allocs}], 1",
        "add qword ptr [rcx + {bytes}], rdi",
        "jmp qword ptr [rip + {global} + {real}]",
        "2:",
        "cmp qword ptr [rip + {global} + {registry}], 0",
        "jne 3f",
        "jmp qword ptr [rip + {global} + {real}]",
        "3:",
        // The spied path: where the caller's stack starts, for the spy's stack capture.
        "mov qword ptr fs:[rax + {sp}], rsp",
        "mov qword ptr fs:[rax + {bp}], rbp",
        "jmp {spied}",
        global = sym GLOBAL,
        key = const KEY,
        registry = const REGISTRY,
        real = const REAL_MALLOC,
        large = const gate::LARGE_BYTES,
        until = const core::mem::offset_of!(ThreadState, tick_until) + gate::SMALL * 8,
        record = const core::mem::offset_of!(ThreadState, tick_record),
        allocs = const core::mem::offset_of!(TickCounters, allocs) + gate::SMALL * 8,
        bytes = const core::mem::offset_of!(TickCounters, bytes) + gate::SMALL * 8,
        sp = const core::mem::offset_of!(ThreadState, entry_sp),
        bp = const core::mem::offset_of!(ThreadState, entry_bp),
        spied = sym malloc_spied,
    )
}

/// `free` of the process's interposer (the export `free` jumps here).
///
/// # Safety
/// `ptr` is NULL or a live block of the malloc family.
#[unsafe(naked)]
pub unsafe extern "C" fn free(ptr: *mut c_void) {
    core::arch::naked_asm!(
        "mov rax, qword ptr [rip + __mallocspy_thread_state@GOTTPOFF]",
        "mov rcx, qword ptr [rip + {global} + {key}]",
        "cmp qword ptr fs:[rax], rcx",
        "jne 2f",
        // NULL: nothing to free, nothing to count.
        "test rdi, rdi",
        "jz 1f",
        // The address's bit in the bitmap of sampled blocks: set, and the block may be one.
        "mov rcx, qword ptr [rip + {global} + {bitmap}]",
        "mov rdx, rdi",
        "shr rdx, {word_shift}",
        "and edx, {word_mask}",
        "mov rdx, qword ptr [rcx + 8 * rdx]",
        "mov rcx, rdi",
        "shr rcx, {line_shift}",
        "bt rdx, rcx",
        "jc 2f",
        "mov rcx, qword ptr fs:[rax + {record}]",
        "add qword ptr [rcx + {frees}], 1",
        "jmp qword ptr [rip + {global} + {real}]",
        "1:",
        "ret",
        "2:",
        "cmp qword ptr [rip + {global} + {registry}], 0",
        "jne {spied}",
        "jmp qword ptr [rip + {global} + {real}]",
        global = sym GLOBAL,
        key = const KEY,
        registry = const REGISTRY,
        bitmap = const BITMAP,
        real = const REAL_FREE,
        word_shift = const WORD_SHIFT,
        word_mask = const WORD_MASK,
        line_shift = const gate::LINE_SHIFT,
        record = const core::mem::offset_of!(ThreadState, tick_record),
        frees = const core::mem::offset_of!(TickCounters, frees),
        spied = sym free_spied,
    )
}

/// A `malloc` the assembly did not let through, with a spy registered.
extern "C" fn malloc_spied(size: usize) -> *mut c_void {
    GLOBAL.malloc_slow(size)
}

/// A `free` the assembly did not let through, with a spy registered.
///
/// # Safety
/// `ptr` is NULL or a live block of the malloc family.
unsafe extern "C" fn free_spied(ptr: *mut c_void) {
    // SAFETY: the caller's guarantee.
    unsafe { GLOBAL.free_slow(ptr) }
}
