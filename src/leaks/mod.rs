//! Leak reports: which live blocks are lost at exit (or on demand), how, and where they were
//! allocated. `scan` classifies, `roots` finds where the program's pointers live while `stop`
//! holds the other threads still (with ptrace: `tracer`), `report` aggregates and renders.

mod dead_tls;
pub mod debuglink;
pub(crate) mod kept;
pub(crate) mod report;
mod restart;
pub(crate) mod roots;
pub(crate) mod scan;
pub(crate) mod stop;
pub(crate) mod suppress;
pub(crate) mod symbols;
mod tracer;
pub(crate) mod unloaded;

pub(crate) use report::StackOptions;
pub use report::{LeakRecord, LeakReport, Summary, Tally, grouped};
pub use scan::LeakKind;
pub use suppress::{SuppressionError, Suppressions};
pub use symbols::{Frame, demangle, function_name, load_cxx_runtime_demangler, qualified_name, symbol_name};

use crate::fixed_hash::HashMap;
use crate::spies::leaks::LeakTracker;
use crate::{os, tls};
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use report::Classified;
use roots::{Maps, ProcessMemory};
use scan::{Heap, Hop, Scratch};
use symbols::Symbolizer;

/// How the reports name the frame of a signal trampoline (glibc's `__restore_rt`), which the
/// stacks go through to the code a signal interrupted: as gdb names it.
pub const SIGNAL_FRAME: &str = crate::unwind::SIGNAL_FRAME;

/// Whether a file's name is a dynamic loader's (glibc's `ld-linux-*.so.*` and `ld.so`, musl's
/// `ld-musl-*.so.*`): run as a command (`ld.so ./prog`), it is the process's executable, and
/// the program is the file it loads.
pub fn is_dynamic_loader_name(file_name: &str) -> bool {
    file_name == "ld.so" || (file_name.starts_with("ld-") && file_name.contains(".so"))
}

/// Whether file address `address` of an ELF file lies in a signal trampoline, by the file's
/// `.eh_frame_hdr` and `.eh_frame` sections, each given with its file address.
pub fn is_signal_trampoline_in(eh_frame_hdr: (&[u8], u64), eh_frame: (&[u8], u64), address: u64) -> bool {
    crate::unwind::is_signal_trampoline_in(eh_frame_hdr, eh_frame, address)
}

/// What a root region is, for retention paths.
#[derive(Clone, Copy)]
enum Root {
    Global,
    Stack(u32),
    Tls(u32),
    Anonymous,
}

/// Takes `holes` (sorted, disjoint) out of the root `regions`, keeping `kinds` in step: a
/// region with a hole inside is cut in two, the part above it added at the end; kept whole
/// when there is no room for it (a root too large only makes blocks reachable).
fn cut_out(regions: &mut Vec<(u64, u64)>, kinds: &mut Vec<Root>, holes: &[(u64, u64)]) {
    let mut i = 0;
    while i < regions.len() {
        let (start, end) = regions[i];
        let Some(&(s, e)) = holes.get(holes.partition_point(|h| h.1 <= start)).filter(|h| h.0 < end) else {
            i += 1;
            continue;
        };
        match (start < s, e < end) {
            (true, true) if regions.len() == regions.capacity() => i += 1,
            (true, true) => {
                regions[i] = (start, s);
                regions.push((e, end));
                kinds.push(kinds[i]);
            }
            (true, false) => regions[i] = (start, s),
            (false, true) => regions[i] = (e, end),
            (false, false) => {
                regions.swap_remove(i);
                kinds.swap_remove(i);
            }
        }
    }
}

/// Hops of a retention path shown per still-reachable record: its root and those nearest the block.
const PATH_HOPS: usize = 6;

/// One retention path per still-reachable allocation stack (its first block's), described;
/// `describe` is told each hop and the block it points at, when the path shows it.
fn retention_paths(
    blocks: &[Classified],
    scratch: &Scratch,
    symbols: &mut Symbolizer,
    describe: impl Fn(&mut Symbolizer, Hop, Option<usize>) -> String,
) -> HashMap<u32, Vec<String>> {
    let mut paths = HashMap::default();
    for (i, b) in blocks.iter().enumerate() {
        if b.kind == LeakKind::StillReachable && !paths.contains_key(&b.stack) {
            let path = scratch.retention_path(i, PATH_HOPS);
            let next = |k: usize| match path.get(k + 1) {
                None => Some(i),
                Some(&Hop::Block { index, .. }) => Some(index),
                Some(_) => None,
            };
            let described = path.iter().enumerate().map(|(k, &hop)| describe(symbols, hop, next(k))).collect();
            paths.insert(b.stack, described);
        }
    }
    paths
}

/// The last two components of a path (`dir/file.c`).
fn short_path(path: &str) -> &str {
    let mut cut = path.rmatch_indices('/').map(|(i, _)| i + 1);
    cut.nth(1).map_or(path, |i| &path[i..])
}

/// Where the reporting thread's scan starts: its stack pointer and the registers that may
/// hold the program's pointers, taken where the report starts so that the report's own
/// frames are not scanned, or where an ending signal interrupted the program.
#[derive(Clone, Copy)]
pub(crate) struct Caller {
    pub sp: u64,
    /// Of the report's caller, the callee-saved ones (rbx, rbp, r12-r15; the rest 0); of an
    /// interrupted context, all sixteen.
    pub regs: [u64; 16],
    /// Where the registers were read, and the frame pointer there (for a walk out of that
    /// frame).
    pub pc: u64,
    pub bp: u64,
    /// The frames between here and the program's first are dead to the program (`exit`'s, the
    /// loader's and mallocspy's own): the scan starts at the program's. Not so at the end of
    /// a hook an ending signal interrupted, whose frames hold that call's block, nor in the
    /// context a signal interrupted, whose frames are all live.
    pub skip_to_program: bool,
}

impl Caller {
    /// The calling function's view. Always inlined, so that it is the caller's stack pointer.
    #[inline(always)]
    pub(crate) fn here() -> Self {
        let (sp, rbx, rbp, r12, r13, r14, r15, pc): (u64, u64, u64, u64, u64, u64, u64, u64);
        // SAFETY: reads registers.
        unsafe {
            core::arch::asm!(
                "mov {}, rsp", "mov {}, rbx", "mov {}, rbp", "mov {}, r12", "mov {}, r13", "mov {}, r14", "mov {}, r15",
                "lea {}, [rip]",
                out(reg) sp, out(reg) rbx, out(reg) rbp, out(reg) r12, out(reg) r13, out(reg) r14, out(reg) r15, out(reg) pc,
                options(nomem, nostack, preserves_flags)
            )
        };
        let mut regs = [0; 16];
        regs[..6].copy_from_slice(&[rbx, rbp, r12, r13, r14, r15]);
        Self { sp, regs, pc, bp: rbp, skip_to_program: true }
    }

    /// The program's context that a signal interrupted, as its handler got it: what the
    /// program had live is there and in the frames from its stack pointer out. The handler's
    /// frames below reuse the stack where the program's earlier calls ran, and scanning them
    /// found what those calls left (the lost block of an allocation returned long before).
    pub(crate) fn interrupted(context: &libc::ucontext_t) -> Self {
        let gregs = &context.uc_mcontext.gregs;
        let mut regs = [0; 16];
        // R8 to RSP, in the kernel's order: every general register.
        for (r, &g) in regs.iter_mut().zip(&gregs[..16]) {
            *r = g as u64;
        }
        let at = |reg: libc::c_int| gregs[reg as usize] as u64;
        Self { sp: at(libc::REG_RSP), regs, pc: at(libc::REG_RIP), bp: at(libc::REG_RBP), skip_to_program: false }
    }
}

/// Stack words below a thread's stack pointer that may still be live (the x86_64 red zone).
const RED_ZONE: u64 = 128;

/// Where the own stack of `parked` resumes when it was stopped on another stack (a handler on
/// its alternate signal stack): see [`crate::unwind::resumes_off`]. Its own stack is `[stack]`
/// for the main thread (`pid`), and the mapping of its thread pointer for any other, which
/// glibc puts at the top of the thread's stack. Main's is no anonymous mapping, scanned whole
/// when no stack pointer lies in it, as another thread's is: a block only main's frames held
/// was "definitely lost" while its handler waited on an alternate stack.
fn resumes_off_own_stack(maps: &Maps, parked: &stop::Parked, pid: u32) -> Option<u64> {
    let own = if parked.tid == pid { maps.main_stack } else { maps.extent_of(parked.tp) };
    if own.is_some_and(|(start, end)| (start..end).contains(&parked.sp)) {
        return None;
    }
    crate::unwind::resumes_off((parked.pc, parked.sp, parked.bp), maps.extent_of(parked.sp)?)
}

/// Where the thread whose thread pointer is `tp` left its own stack for a spare one
/// ([`tls::ThreadState::spare_from_sp`]); 0 when it is on its own, or unknown.
fn spare_from_sp(tp: u64) -> u64 {
    if tp == 0 {
        return 0;
    }
    let at = tls::block_of(tp).0 + tls::SPARE_FROM_SP_OFFSET as u64;
    // SAFETY: a word of the TLS block of a live thread, stopped: mapped while it lives, and
    // written only by that thread, before it stopped.
    unsafe { (at as *const u64).read_volatile() }
}

/// Where the reporting thread's live frames start: at the first frame out from the report that
/// is the program's (its locals, and those of every frame further out, are live), which is
/// `_start`'s once `main` has returned, or at the C library's start of the thread when no
/// frame of the program is left on it. The frames in between, the C library's `exit`, the
/// loader's and mallocspy's own, reuse the stack where the program's last calls ran, and the
/// words they never write still hold what those calls left there: the shim's frames of the
/// program's last allocations kept a lost block "still reachable" (`p = malloc(100); p = 0;`
/// at -O0). `None` when the walk cannot tell (code it cannot unwind through): scan from the
/// report's caller then. Only for a caller whose frames up to the program's are dead
/// ([`Caller::skip_to_program`]).
fn live_frames_start(caller: &Caller) -> Option<u64> {
    use crate::unwind::WalkOut;
    if !caller.skip_to_program {
        return None;
    }
    let base = |addr: u64| os::module_of(addr as *const core::ffi::c_void);
    let own = base(check as *const () as u64);
    let libc = base(libc::exit as *const () as u64);
    let loader = roots::loader_text().unwrap_or((0, 0));
    let walk = crate::unwind::walk_out((caller.pc, caller.sp, caller.bp), |pc, sp| {
        let module = base(pc);
        let theirs = module != 0 && module != own && module != libc && !(loader.0 <= pc && pc < loader.1);
        theirs.then_some(sp)
    });
    match walk {
        WalkOut::Answer(sp) => Some(sp),
        // The thread's outermost frame, the C library's: nothing of the program's is live.
        WalkOut::Ends { pc, sp } if base(pc) == libc && libc != 0 => Some(sp),
        _ => None,
    }
}

/// Whether mallocspy's pool can supply what a check of `blocks` live blocks may need: its
/// tables (a few words a block), the roots' words, the report, and the modules' debug
/// information that names its frames. Under a low address-space limit set before the program
/// started (`ulimit -v`, where the pool reserves little at a time) or a strict commit limit,
/// a check that ran out of memory aborted the program at its exit; now it is not run.
pub(crate) fn room_for_check(blocks: usize) -> bool {
    crate::pool::has_room((16 << 20) + blocks.saturating_mul(128))
}

/// While a check takes its snapshot and stops the world: how many checks are in that window.
/// The other threads' allocations and frees wait at the leak tracker's door while it is not
/// zero. Made in that window, a block was in no snapshot, and the blocks only it pointed to
/// were called lost; freed there, it took its children's only pointer with it (threads still
/// allocating at `exit`: review helper 83). Counted, not flagged: two threads may check at
/// once (`mallocspy_leak_check`), and the first to finish must not release the other's hold.
static HOLDERS: AtomicU32 = AtomicU32::new(0);

/// The time (monotonic, ns) after which the waiting threads go on even though a hold remains:
/// a thread the check would wait for cannot hang it. Meaningful only while [`HOLDERS`] is not
/// zero; each hold pushes it later, none takes it back.
static HOLD_UNTIL: AtomicU64 = AtomicU64::new(0);

/// How long the other threads are held at most.
const HOLD_NS: u64 = 1_000_000_000;

/// One check's share of the hold, given up when dropped.
struct Hold;

impl Hold {
    fn start() -> Self {
        HOLD_UNTIL.fetch_max(os::monotonic_ns() + HOLD_NS, Ordering::AcqRel);
        HOLDERS.fetch_add(1, Ordering::AcqRel);
        Hold
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        // Not below 0: a child forked during the check starts with none (`after_fork_child`).
        let _ = HOLDERS.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

/// Waits, in the leak tracker's hooks, while a check starts (see [`HOLDERS`]). Without a
/// cancellation point: a thread cancelled in a hook would leave its locks held.
#[inline]
pub(crate) fn wait_while_a_check_starts() {
    if HOLDERS.load(Ordering::Relaxed) != 0 {
        wait_for_the_check();
    }
}

#[cold]
fn wait_for_the_check() {
    // A thread forking waits for the threads inside hooks (this one), and the check for
    // the fork: the hold gives way (review helper 84 saw every check take the full second).
    while HOLDERS.load(Ordering::Acquire) != 0
        && os::monotonic_ns() < HOLD_UNTIL.load(Ordering::Acquire)
        && !stop::forking()
    {
        os::yield_now();
    }
}

/// Child side of `fork`: no check runs in the child, whose threads must not wait for one.
pub(crate) fn after_fork_child() {
    HOLDERS.store(0, Ordering::Relaxed);
}

/// Runs a leak check now: snapshot, stop the other threads, scan, resume, report.
/// `reachable_stacks`: symbolize the still-reachable records too (a text report hides them).
/// `Err(errno)`: the process map could not be read (see [`Maps::read`]), and nothing was
/// classified.
pub(crate) fn check(
    tracker: &LeakTracker,
    stacks: StackOptions,
    reachable_stacks: bool,
    caller: Caller,
) -> Result<LeakReport, i32> {
    // Allocations made by libc on our behalf from here on are not the program's.
    let ts = tls::state();
    let depth = ts.depth.replace(ts.depth.get().max(1));
    // The check's own calls into the C library are not a signal handler's.
    let scope_sp = ts.scope_sp.replace(0);

    // What takes the loader's lock comes before the hold: a thread held in `dlopen`'s malloc
    // keeps it.
    let modules = roots::module_data(check as *const core::ffi::c_void, crate::global::GLOBAL.heap.real_malloc());
    let tls = roots::static_tls();
    let loader = roots::loader_text().unwrap_or((0, 0));
    // This thread's own frames, walked while the loader may still be asked about them.
    let caller_start = live_frames_start(&caller).unwrap_or(caller.sp);
    let caller_resumes = crate::unwind::own_stack_resumes_at((caller.pc, caller.sp, caller.bp));
    let hold = Hold::start();
    let mut blocks = tracker.snapshot();
    blocks.sort_unstable_by_key(|b| b.0);
    // A record whose block overlaps the previous one is stale (its free went unseen).
    let mut last_end = 0;
    blocks.retain(|(addr, r)| {
        let keep = *addr >= last_end;
        if keep {
            last_end = addr + r.size().max(1);
        }
        keep
    });
    let spans: Vec<(u64, u64)> = blocks.iter().map(|(a, r)| (*a, r.size())).collect();
    let starts: Vec<u64> = spans.iter().map(|s| s.0).collect();
    let heap = Heap::new(&spans);
    let mut scratch = Scratch::for_blocks(spans.len());
    let mut maps = Maps::reserve();
    let mappings = crate::program_mappings::snapshot();
    let mut regions: Vec<(u64, u64)> =
        Vec::with_capacity(modules.roots.len() + 3 * 4096 + 4 + maps.list.capacity() + mappings.program.len());
    // mallocspy's own block in each thread's static TLS, which keeps copies of the program's
    // registers (the frame pointer at the last allocator call, which optimized code uses as
    // any other register) and the spy's words: no root, wherever it lies.
    let mut own_blocks: Vec<(u64, u64)> = Vec::with_capacity(4098);
    let mut region_kinds: Vec<Root> = Vec::with_capacity(regions.capacity());
    let mut stack_pointers: Vec<u64> = Vec::with_capacity(4098);
    // The stack the check runs on, when it is not the caller's (a mapping of
    // `spare_stack.rs`, an alternate signal stack): its frames hold the blocks' addresses.
    stack_pointers.push(crate::unwind::current_sp());
    let mut words: Vec<u64> = Vec::with_capacity(24 * 4096 + caller.regs.len() + blocks.len());
    let own_tp = os::thread_pointer();
    let by_loader: Vec<u64> = blocks
        .iter()
        .filter(|(_, r)| tracker.stacks.frames(r.stack).first().is_some_and(|&f| loader.0 <= f && f < loader.1))
        .map(|(addr, _)| *addr)
        .collect();

    let mut exited: Vec<u64> = Vec::with_capacity(crate::threads::EXITED_KEPT);
    // The dynamic TLS of the exited threads, which glibc frees only when a thread reuses their
    // stacks (see `dead_tls`), and of the live ones, whose thread pointers are gathered.
    let mut exited_tps: Vec<u64> = Vec::with_capacity(crate::threads::EXITED_KEPT);
    let mut live_tps: Vec<u64> = Vec::with_capacity(4098);
    live_tps.push(own_tp);
    let mut dead_tls: Vec<u64> = Vec::with_capacity(by_loader.len());
    let mut live_tls: Vec<u64> = Vec::with_capacity(by_loader.len());
    let buffers = ProcessMemory::buffers();
    // From here until the threads resume, nothing is allocated or freed (see `_threads` in
    // `stop::Stopped`).
    let stopped = stop::stop_the_world();
    // The threads held are stopped with the others (or, when none could be, go on).
    drop(hold);
    // Until they resume, a stopped thread may hold the loader's locks: the unwinder's walks
    // out of alternate stacks below use the module list as it is.
    crate::loader::world_stopped(stopped.is_some());
    if let Err(errno) = maps.read() {
        crate::loader::world_stopped(false);
        drop(stopped);
        leave_check(ts, scope_sp, depth);
        return Err(errno);
    }
    regions.extend_from_slice(&modules.roots);
    region_kinds.extend(modules.roots.iter().map(|_| Root::Global));
    // A stack the program gave a thread from the heap (`pthread_attr_setstack` on a block,
    // a coroutine's) ends with its block, not its mapping: the rest of the heap is not stack,
    // nor, where glibc put the thread's TLS and control block at its top, TLS.
    let block_holding = |addr: u64| {
        let at = spans.partition_point(|s| s.0 <= addr).checked_sub(1)?;
        let (start, size) = spans[at];
        (addr < start + size).then_some((start, start + size))
    };
    // The `thread`-th thread's stack from `sp` and its TLS (`tp` 0: none); `red_zone`: the
    // words below the stack pointer a leaf function may still use.
    let add_thread =
        |thread: u32, sp: u64, red_zone: u64, tp: u64, regions: &mut Vec<(u64, u64)>, kinds: &mut Vec<Root>| {
            if let Some(end) = maps.end_of(sp) {
                let end = block_holding(sp).map_or(end, |(_, block_end)| block_end.min(end));
                regions.push((sp.saturating_sub(red_zone), end));
                kinds.push(Root::Stack(thread));
            }
            if tp != 0 {
                let (start, end) = (tp.saturating_sub(tls.below), tp + tls.control_block);
                let (start, end) = block_holding(tp).map_or((start, end), |(s, e)| (start.max(s), end.min(e)));
                // Within the mapping glibc put the TLS in. Its layout rounded up where glibc
                // does not tell it reached past the mapping's end (when mallocspy's memory came
                // next, the check's own arrays of block addresses were read as the thread's, and
                // every block was still reachable), or before its start (the main thread's
                // TLS, which the loader maps for itself, began in the mapping before it).
                let (start, end) = maps.extent_of(tp).map_or((start, end), |(s, e)| (start.max(s), end.min(e)));
                let end = crate::pool::first_owned_above(start, end).unwrap_or(end);
                // Where glibc does not tell the control block's size, the range starts below the
                // TLS, in the top of the thread's stack, which glibc carves out right under it:
                // below the stack pointer, dead frames.
                let start = if start < sp && sp < tp { start.max(sp.saturating_sub(red_zone)) } else { start };
                regions.push((start, end));
                kinds.push(Root::Tls(thread));
            }
        };
    // Interrupted in a system call (a `pause` an ending signal broke), it used no red zone
    // either, as a stopped thread (below): the 128 bytes under its stack pointer, what earlier
    // calls left, held a block the program had dropped, "still reachable" (6 runs in 40 of
    // `strict_c_signal` under SIGINT).
    let caller_red_zone = if !caller.skip_to_program && restart::stopped_in_a_call(caller.pc) { 0 } else { RED_ZONE };
    add_thread(1, caller_start, caller_red_zone, own_tp, &mut regions, &mut region_kinds);
    own_blocks.push(tls::block_of(own_tp));
    stack_pointers.push(caller.sp);
    // Made on an alternate signal stack: the thread's own stack is live from where the signal
    // struck.
    if let Some(from) = caller_resumes {
        add_thread(1, from, RED_ZONE, 0, &mut regions, &mut region_kinds);
        stack_pointers.push(from);
    }
    words.extend_from_slice(&caller.regs);
    let mut unstopped = 0;
    if let Some(stopped) = &stopped {
        let pid = os::getpid();
        for (thread, p) in (2..).zip(stopped.parked()) {
            if regions.len() + 2 <= regions.capacity() && words.len() + p.regs.len() <= words.capacity() {
                // A thread stopped in a system call uses no red zone: what lies below its
                // stack pointer is what the calls before it left, the allocator's frames
                // among them (a block allocated and dropped just before a wait was still
                // reachable from there, where memcheck, whose allocator leaves other words,
                // calls it lost).
                let red_zone = if restart::stopped_in_a_call(p.pc) { 0 } else { RED_ZONE };
                add_thread(thread, p.sp, red_zone, p.tp, &mut regions, &mut region_kinds);
                if p.tp != 0 && own_blocks.len() < own_blocks.capacity() {
                    own_blocks.push(tls::block_of(p.tp));
                }
                if live_tps.len() < live_tps.capacity() {
                    live_tps.push(p.tp);
                }
                words.extend_from_slice(&p.regs);
                if stack_pointers.len() < stack_pointers.capacity() {
                    stack_pointers.push(p.sp);
                }
                // Stopped on a spare stack (`spare_stack.rs`): its own stack's frames start
                // where it left them, not at its stack pointer. Stopped in a handler on an
                // alternate signal stack: where the signal struck.
                let from = match spare_from_sp(p.tp) {
                    0 => resumes_off_own_stack(&maps, p, pid).unwrap_or(0),
                    from => from,
                };
                if from != 0 && regions.len() < regions.capacity() {
                    add_thread(thread, from, RED_ZONE, 0, &mut regions, &mut region_kinds);
                    if stack_pointers.len() < stack_pointers.capacity() {
                        stack_pointers.push(from);
                    }
                }
            }
        }
        unstopped = stopped.unstopped();
        if let Some(stack) = maps.main_stack.filter(|_| stopped.main_unstopped()) {
            let thread = stopped.parked().len() as u32 + 2;
            regions.push(stack);
            region_kinds.push(Root::Stack(thread));
        }
    }
    crate::threads::exited_stacks(&mut exited);
    // Not when a thread could not be stopped: its dynamic TLS is live, and unknown.
    if unstopped == 0 && live_tps.len() < live_tps.capacity() {
        crate::threads::exited_thread_pointers(&mut exited_tps);
        dead_tls::dead_tls_blocks(&exited_tps, &live_tps, &by_loader, &mut dead_tls, &mut live_tls);
    }
    words.extend(by_loader.iter().filter(|b| dead_tls.binary_search(b).is_err()));
    for &block in &dead_tls {
        if let Ok(i) = blocks.binary_search_by_key(&block, |(start, _)| *start) {
            scratch.forget(i);
        }
    }
    // Some blocks were not tracked: one of the others may be reachable through them alone.
    let (untracked, unspied) = (tracker.untracked(), crate::threads::unspied_calls());
    let heaps_too = untracked + unspied > 0;
    roots::anonymous_roots(&maps, heaps_too, &starts, &stack_pointers, &modules, &mappings, &exited, &mut regions);
    region_kinds.resize(regions.len(), Root::Anonymous);
    own_blocks.sort_unstable();
    cut_out(&mut regions, &mut region_kinds, &own_blocks);
    let memory = ProcessMemory::new(&maps, buffers);
    scan::classify(&heap, &regions, &modules.allocator, &words, &memory, &mut scratch);
    // Said before the threads go: one that resumes and checks at once must find the loader
    // usable (it read "this process was forked while another thread held the loader's lock").
    crate::loader::world_stopped(false);
    drop(stopped);
    memory.others_run();
    // Suppressions, as LeakSanitizer has them: a suppressed leak takes with it what it reaches.
    let frames_of = |id| tracker.stacks.frames(id).to_vec();
    let stack_ids: Vec<u32> = blocks.iter().map(|(_, r)| r.stack).collect();
    let mut namer = report::Namer::new(stacks, &stack_ids, &frames_of);
    let lost_stacks = blocks.iter().zip(scratch.kinds()).filter(|(_, k)| *k != LeakKind::StillReachable);
    let patterns = report::suppression_patterns(
        &mut namer,
        lost_stacks.map(|((_, r), _)| r.stack),
        &frames_of,
        stacks.suppressions,
    );
    if !patterns.is_empty() {
        scan::suppress(&heap, &memory, &mut scratch, |i| patterns.contains_key(&blocks[i].1.stack));
    }
    drop(memory);

    let mut notes = Vec::new();
    if unstopped > 0 {
        notes.push(format!(
            "{unstopped} thread(s) could not be stopped (signals blocked, or no answer in 500 ms): \
             their registers were not read and their stacks were scanned whole"
        ));
    }
    if untracked > 0 {
        let why = if crate::stacks::was_full() {
            "mallocspy's store of call stacks was full (512 MiB of distinct stacks), or its memory limit (max_memory) was reached"
        } else {
            "mallocspy's memory limit (max_memory) was reached"
        };
        notes.push(format!("{untracked} allocation(s) were not tracked: {why}"));
    }
    let unfollowed = tracker.unfollowed_frees();
    if unfollowed > 0 {
        notes.push(format!(
            "{unfollowed} free(s) made by signal handlers went unseen (each interrupted mallocspy while \
             it held the lock of the block's record, and the queue for such frees was full): up to \
             {unfollowed} of the blocks reported were freed"
        ));
    }
    if unspied > 0 {
        notes.push(format!(
            "{unspied} allocator call(s) went unspied: their threads got no slot (mallocspy's memory limit, \
             max_memory, was reached, or more threads lived at once than it tracks)"
        ));
    }
    if heaps_too {
        notes.push(
            "the heap was scanned whole for pointers, as the blocks not tracked may hold some: a block \
             is lost only when nothing points to it (one that only lost blocks point to reads as reachable)"
                .to_owned(),
        );
    }
    let mut classified: Vec<Classified> = blocks
        .iter()
        .zip(scratch.kinds())
        .enumerate()
        .map(|(i, ((_, r), kind))| {
            let suppressed_by = scratch.suppressed_by(i).map(|by| blocks[by].1.stack);
            let group_leader = scratch.group_leader(i).map(|leader| blocks[leader].1.stack);
            Classified { size: r.size(), stack: r.stack, entry: r.entry(), kind, suppressed_by, group_leader }
        })
        .collect();
    // The other threads ran on between the snapshot and their stop, and again once resumed: a
    // block one of them freed meanwhile has no pointer left and would be called lost. A lost
    // block is the program's only while its record is still the one taken (a free is applied
    // before the next record, and a new block at the address has another serial).
    tracker.apply_all_pending();
    let freed_meanwhile: Vec<bool> = blocks
        .iter()
        .zip(&classified)
        .map(|((addr, r), c)| c.kind != LeakKind::StillReachable && tracker.live.get(*addr as usize) != Some(*r))
        .collect();
    let stats = tracker.stats();
    let retained = if reachable_stacks {
        let describe = |symbols: &mut Symbolizer, hop: Hop, next: Option<usize>| match hop {
            // The dynamic loader's blocks are root words too (see `by_loader`).
            Hop::Root(0) if next.is_some_and(|j| by_loader.binary_search(&blocks[j].0).is_ok()) => {
                "the dynamic loader's own block (kept as a root, as LeakSanitizer keeps them)".to_owned()
            }
            Hop::Root(0) => "a thread's registers".to_owned(),
            Hop::Elided(n) => format!("... {n} more blocks ..."),
            Hop::Root(at) => {
                let region = regions.iter().position(|&(s, e)| s <= at && at < e);
                match region.map(|r| region_kinds[r]) {
                    Some(Root::Global) | None => format!("global {}", symbols.global(at)),
                    Some(Root::Stack(t)) => format!("the stack of thread {t} (at {at:#x})"),
                    Some(Root::Tls(t)) => format!("thread-local storage of thread {t} (at {at:#x})"),
                    Some(Root::Anonymous) => format!("mapped memory at {at:#x}"),
                }
            }
            Hop::Block { index, via } => {
                let (start, r) = &blocks[index];
                let site = tracker
                    .stacks
                    .frames(r.stack)
                    .first()
                    .and_then(|&f| symbols.frames_of_stack(r.stack, f).first().cloned());
                let site = site.map(|f| match (f.function, f.file, f.line) {
                    (Some(func), Some(file), Some(line)) => format!(" from {func} ({}:{line})", short_path(&file)),
                    (Some(func), _, _) => format!(" from {func}"),
                    _ => String::new(),
                });
                format!("block {start:#x} ({} bytes{}) at offset {}", r.size(), site.unwrap_or_default(), via - start)
            }
        };
        Some(retention_paths(&classified, &scratch, &mut Symbolizer::default(), describe))
    } else {
        None
    };
    // Freed meanwhile, or taken for freed (the exited threads' dynamic TLS).
    let mut freed = freed_meanwhile.into_iter().enumerate();
    classified.retain(|_| freed.next().is_none_or(|(i, freed)| !freed && !scratch.forgotten(i)));
    let report = report::build(
        os::getpid(),
        &classified,
        (stats.total_allocs, stats.total_frees, stats.total_bytes),
        frames_of,
        &mut namer,
        &patterns,
        retained.as_ref(),
        notes,
    );
    leave_check(ts, scope_sp, depth);
    Ok(report)
}

/// Gives the thread back the hook state [`check`] found.
fn leave_check(ts: &tls::ThreadState, scope_sp: u64, depth: u32) {
    ts.scope_sp.set(scope_sp);
    ts.depth.set(depth);
    if depth == 0 {
        crate::ending_signals::after_hook();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_blocks_are_cut_out_of_the_roots_and_the_kinds_keep_in_step() {
        let holes = [(0x1100, 0x1200), (0x1800, 0x1900), (0x3000, 0x3100)];
        let mut regions = Vec::with_capacity(8);
        regions.extend([(0x1000, 0x2000), (0x3000, 0x3100), (0x4000, 0x5000), (0x2f00, 0x3080)]);
        let mut kinds: Vec<Root> = (1..=4).map(Root::Stack).collect();
        cut_out(&mut regions, &mut kinds, &holes);
        let mut got: Vec<((u64, u64), u32)> =
            regions.iter().zip(&kinds).map(|(&r, k)| (r, if let Root::Stack(n) = k { *n } else { 0 })).collect();
        got.sort_unstable();
        let want = [
            ((0x1000, 0x1100), 1),
            ((0x1200, 0x1800), 1),
            ((0x1900, 0x2000), 1),
            ((0x2f00, 0x3000), 4),
            ((0x4000, 0x5000), 3),
        ];
        assert_eq!(got, want);
        // Without room for the part above, the region stays whole.
        let mut full = vec![(0x1000, 0x2000)];
        full.shrink_to_fit();
        let mut kinds = vec![Root::Global];
        cut_out(&mut full, &mut kinds, &holes[..1]);
        assert_eq!((full.as_slice(), kinds.len()), (&[(0x1000, 0x2000)][..], 1));
    }
}
