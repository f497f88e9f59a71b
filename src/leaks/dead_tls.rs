//! The dynamic TLS of threads that exited. A `dlopen`ed library's `thread_local`s live in
//! blocks the dynamic loader allocates for each thread (its "dynamic TLS"), listed in the
//! thread's dtv, which the loader allocates too. glibc keeps an exited thread's stack, and with
//! it its control block, dtv and dynamic TLS, for a thread to come, and frees them only then
//! (or in `__libc_freeres`, which memcheck calls before its leak check). The loader's blocks
//! are roots (see `by_loader` in [`super::check`]): a leak held only by a `thread_local` of a
//! thread long gone read as still reachable, where memcheck calls it lost and the same
//! library linked in (static TLS) lost too (review helper 93). Those blocks are taken for
//! freed instead.
//!
//! glibc's layout (x86-64): the thread pointer points at its `tcbhead_t`, whose second word
//! is the dtv; the dtv points one entry (16 bytes) into its block, whose first entry holds
//! the number of entries after the generation count; each entry is a pointer to the module's
//! TLS and, for dynamic TLS, the block it was allocated as (`to_free`).

use crate::os;

/// Most dtv entries read per thread: `dlopen` allows a few thousand modules at most.
const MAX_ENTRIES: u64 = 1 << 16;

/// Adds to `out` (within its capacity) the start of the dtv's block and of each dynamic TLS
/// block of the thread whose thread pointer is `tp`. Read through the kernel: the memory may
/// be gone (a stack glibc unmapped) or reused.
fn tls_blocks_of(tp: u64, out: &mut Vec<u64>) {
    let mut dtv = [0u64; 1];
    if tp == 0 || !os::read_own(tp as usize + 8, &mut dtv) || dtv[0] < 16 || !dtv[0].is_multiple_of(8) {
        return;
    }
    let entries = dtv[0];
    let mut length = [0u64; 1];
    if !os::read_own((entries - 16) as usize, &mut length) || length[0] > MAX_ENTRIES {
        return;
    }
    if out.len() < out.capacity() {
        out.push(entries - 16);
    }
    // Entries 1..=length: (pointer to the TLS, block to free), read a bufferful at a time.
    let mut buffer = [0u64; 64];
    let mut next = 1;
    while next <= length[0] {
        let count = (length[0] + 1 - next).min(buffer.len() as u64 / 2);
        let words = &mut buffer[..2 * count as usize];
        if !os::read_own((entries + 16 * next) as usize, words) {
            return;
        }
        for pair in words.chunks_exact(2) {
            if pair[1] != 0 && out.len() < out.capacity() {
                out.push(pair[1]);
            }
        }
        next += count;
    }
}

/// The blocks of the dtvs and dynamic TLS of the threads that exited (`exited`, their thread
/// pointers), sorted, into `dead`; not one that a live thread's (`live`) names too, as a block
/// freed and allocated again may be: `scratch` (as large as `dead`) holds those. Only blocks
/// the dynamic loader allocated (`by_loader`, sorted) are kept. Allocates nothing.
pub(crate) fn dead_tls_blocks(
    exited: &[u64],
    live: &[u64],
    by_loader: &[u64],
    dead: &mut Vec<u64>,
    scratch: &mut Vec<u64>,
) {
    dead.clear();
    scratch.clear();
    for &tp in exited.iter().filter(|tp| !live.contains(tp)) {
        tls_blocks_of(tp, dead);
    }
    for &tp in live {
        tls_blocks_of(tp, scratch);
    }
    scratch.sort_unstable();
    dead.sort_unstable();
    dead.dedup();
    dead.retain(|b| by_loader.binary_search(b).is_ok() && scratch.binary_search(b).is_err());
}
