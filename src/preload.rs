//! Start-up and exit of the preloaded shim: read `MALLOCSPY_OPTIONS`, register the built-in
//! spies, write their reports as late as the process allows.
//!
//! The reports run after everything else: the shim's `.fini_array` entry runs inside the
//! dynamic loader's `_dl_fini`, and registers [`report_at_exit`] with `atexit` from there.
//! glibc runs handlers registered while exit handlers run, so it comes after `_dl_fini` has
//! run the destructors of every module, including those initialised before the shim (a
//! library that frees its caches in a destructor is then not reported as leaking). A program
//! that leaves by `_exit` gets the same report from the shim's `_exit`, one that leaves by
//! `quick_exit` from an `at_quick_exit` handler.

use core::fmt::Write;
use core::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::sync::OnceLock;

use crate::global::{self, GLOBAL};
use crate::leaks::{self, Caller, StackOptions, Suppressions};
use crate::line::Line;
use crate::options::{DEFAULT_MAX_MEMORY, Options, ReportFormat, expand_path};
use crate::spies::count::CountSpy;
use crate::spies::guard::GuardSpy;
use crate::spies::leaks::LeakTracker;
use crate::spies::stack::SpyStack;
use crate::spies::ticks::{self, TickSpy};
use crate::spy::MallocSpy;
use crate::trace::writer;
use crate::{os, pool, sink, tls};

/// The built-in spies of this process and how to report them.
struct Builtins {
    count: Option<&'static CountSpy>,
    guard: Option<&'static GuardSpy>,
    leaks: Option<&'static LeakTracker>,
    ticks: Option<&'static TickSpy>,
    options: Options,
    suppressions: Suppressions,
}

/// How long the exit reports wait for mallocspy's own heap, which another thread holds.
const HEAP_PATIENCE_MS: u64 = 2_000;

static BUILTINS: OnceLock<Builtins> = OnceLock::new();
/// The process the reports belong to (a `vfork` child shares our memory but is not us).
static OWNER: AtomicU32 = AtomicU32::new(0);

/// Whether this process writes the reports of this memory's spies: not a `vfork` child, which
/// shares its parent's memory (and runs no `fork` handler).
pub(crate) fn owns_the_reports() -> bool {
    OWNER.load(Ordering::Relaxed) == os::getpid()
}
static REPORTED: AtomicBool = AtomicBool::new(false);
/// Whether the built-in spies were registered: only then do they report, and a forked child
/// get a trace writer of its own.
static BUILTINS_REGISTERED: AtomicBool = AtomicBool::new(false);
/// Where `malloc` resolved at start, when not to mallocspy ([`bypassed_note`]).
static MALLOC_ELSEWHERE: OnceLock<String> = OnceLock::new();

/// Says in the report's place, to its log, why there is none: as a JSON object (`{"error":
/// "mallocspy: ..."}`) if the leak report would have been JSON, so that a reader of one value
/// per process still reads one. `reason` needs no escaping in JSON. Put together on the stack,
/// as [`say`] does.
fn no_report(reason: &str) {
    debug_assert!(!reason.contains(['"', '\\']));
    let json = BUILTINS.get().is_some_and(|b| b.options.report_format == ReportFormat::Json);
    let (open, close): (&[u8], &[u8]) =
        if json { (b"{\"error\":\"mallocspy: ", b"\"}\n") } else { (b"mallocspy: ", b"\n") };
    let mut line = [0u8; 512];
    let mut at = 0;
    for part in [open, reason.as_bytes(), close] {
        let n = part.len().min(line.len() - at);
        line[at..at + n].copy_from_slice(&part[..n]);
        at += n;
    }
    sink::write(&line[..at]);
}

fn say(message: &str) {
    // Put together on the stack, not formatted: the line may be the one that says memory ran
    // out (under `ulimit -v`), and a failed allocation aborts the program.
    let mut line = [0u8; 1024];
    let parts = [b"mallocspy: ".as_slice(), message.as_bytes(), b"\n"];
    let len: usize = parts.iter().map(|p| p.len()).sum();
    if len > line.len() {
        parts.iter().for_each(|p| sink::to_stderr(p));
        return;
    }
    let mut at = 0;
    for part in parts {
        line[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    sink::to_stderr(&line[..at]);
}

/// Why the built-in spies are not there: the program's spy came first (one at a time; it may
/// have been revoked since, and wait for its blocks to go).
const ALREADY_REGISTERED: &str =
    "cannot register the built-in spies: the program registered a malloc spy first; no mallocspy report";

fn leak<T>(value: T) -> &'static T {
    Box::leak(Box::new(value))
}

/// Reads `MALLOCSPY_OPTIONS` and registers the spies it names. Called once by the shim's
/// constructor. A malformed value is reported in one line and the program runs unspied.
pub fn init() {
    // The program's `errno` is its own: C has it 0 when `main` starts (the trace writer's
    // start left EAGAIN there: review helper 128).
    let errno = os::errno();
    register_spies();
    // Unspied, the blocks allocated so far are noted no more (see `early.rs`).
    drop(crate::early::stop());
    os::set_errno(errno);
}

fn register_spies() {
    GLOBAL.heap.warm_up();
    crate::thread_create::warm_up();
    // The wrappers' libc functions too: looked up at the program's first call, each cleared
    // its `dlerror` state (a failed `dlopen`'s message, then NULL).
    crate::program_mappings::warm_up();
    crate::ending_signals::warm_up();
    crate::alt_stack::warm_up();
    crate::seccomp::warm_up();
    crate::credentials::warm_up();
    crate::kill_all::warm_up();
    os::warm_up_clock();
    // The main thread's stack, from the stack itself: a hook in a handler on an alternate
    // signal stack cannot find it (review helper 97).
    crate::unwind::stack_bounds();
    os::next_symbol_cached(&NEXT_CXA_AT_QUICK_EXIT, c"__cxa_at_quick_exit");
    // Spied or not: the program's `reallocarray` and sized frees must reach the allocator
    // ahead of us.
    if let Some(realloc) = served_elsewhere(c"realloc") {
        crate::interpose::note_realloc_ahead(realloc);
    }
    if let Some(free) = served_elsewhere(c"free") {
        crate::interpose::note_free_ahead(free);
    }
    // mallocspy's own heap, which reading the options starts, must be able to grow: a failed
    // allocation of its aborts the program (under `ulimit -v` of about 9 MB: review helper 82).
    if !pool::has_room(pool::SMALL_ARENA) {
        return say("cannot map memory for mallocspy (an address-space limit?); running unspied");
    }
    let options = match std::env::var("MALLOCSPY_OPTIONS") {
        Ok(text) => match Options::parse(&text) {
            Ok(o) => o,
            Err(e) => return say(&format!("MALLOCSPY_OPTIONS: {e}; running unspied")),
        },
        Err(std::env::VarError::NotPresent) => Options::default(),
        Err(std::env::VarError::NotUnicode(_)) => return say("MALLOCSPY_OPTIONS is not valid UTF-8; running unspied"),
    };
    if options.spies.is_empty() {
        // A pure pass-through: no reports, so no report file or copy of stderr either.
        return;
    }
    if GLOBAL.has_spy() {
        // Asked before anything is made (a trace file, reports that would read as a clean
        // bill: "0 allocs"): a library's constructor that ran before ours registered its own.
        return say(ALREADY_REGISTERED);
    }
    leaks::stop::set_stop_threads(options.stop_threads);
    if let Some(owner) = malloc_served_elsewhere() {
        let _ = MALLOC_ELSEWHERE.set(owner);
    } else if os::running_on_valgrind() {
        // Its tool replaces the malloc family by the code, whatever the lookup finds: the
        // report read as a clean bill for the tool's own executable (review helper 103).
        let _ = MALLOC_ELSEWHERE.set("valgrind's replacements (the program runs under valgrind)".to_owned());
    }
    match &options.log_path {
        Some(path) => {
            if let Err(e) = sink::use_path(path) {
                say(&format!("{e}; reports go to stderr"));
            }
        }
        None => sink::use_stderr(),
    }
    let suppressions = match &options.suppressions {
        None => Suppressions::default(),
        Some(path) => match Suppressions::read(path)
            .map_err(|e| e.to_string())
            .and_then(|t| Suppressions::parse(&t).map_err(|e| e.to_string()))
        {
            Ok(s) => s,
            Err(e) => {
                say(&format!("suppressions file '{path}': {e}; reporting without suppressions"));
                Suppressions::default()
            }
        },
    };
    let (limit, from_rlimit) = memory_limit(options.max_memory);
    pool::set_limit(limit, from_rlimit);
    let (builtins, refused) = pool::unsaid(|| {
        // No spy without the threads' slots.
        let slots = crate::threads::map_tables();
        Builtins {
            count: (slots && options.spies.count).then(CountSpy::new).flatten().map(leak),
            guard: (slots && options.spies.guard)
                .then(|| GuardSpy::new(crate::global::GLOBAL.heap.is_glibc(), options.show_mismatched_frees))
                .flatten()
                .map(leak),
            leaks: (slots && options.spies.leaks).then(|| LeakTracker::new(options.stack_depth)).flatten().map(leak),
            ticks: (slots && options.spies.ticks).then(|| TickSpy::new(tick_config(&options))).flatten().map(leak),
            suppressions,
            options,
        }
    });
    let s = &builtins.options.spies;
    if s.count != builtins.count.is_some()
        || s.guard != builtins.guard.is_some()
        || s.leaks != builtins.leaks.is_some()
        || s.ticks != builtins.ticks.is_some()
    {
        if !refused {
            return say("cannot map memory for the spies; running unspied");
        }
        let mut line = Line::<300>::new();
        let _ = write!(line, "mallocspy: ");
        pool::write_limit(&mut line);
        let _ = write!(line, " is less than");
        let not_made = [
            (s.leaks && builtins.leaks.is_none(), "leaks"),
            (s.ticks && builtins.ticks.is_none(), "ticks"),
            (s.count && builtins.count.is_none(), "count"),
            (s.guard && builtins.guard.is_none(), "guard"),
        ];
        let mut missing = 0;
        for (_, name) in not_made.iter().filter(|(missing, _)| *missing) {
            let _ = write!(line, "{}{name}", if missing == 0 { " spy=" } else { "," });
            missing += 1;
        }
        // The others run: one spy's need turned them all off (`spy=leaks,guard,ticks:
        // max_memory=1m` ran with no leak check, where `spy=leaks,guard` tracked up to the
        // bound: review helper 121).
        let asked = [s.leaks, s.ticks, s.count, s.guard].into_iter().filter(|&asked| asked).count();
        let unspied = missing == asked;
        let running = if unspied {
            "unspied"
        } else if missing == 1 {
            "without it"
        } else {
            "without them"
        };
        let _ = writeln!(line, " needs; running {running}");
        sink::to_stderr(line.as_bytes());
        if unspied {
            return;
        }
    }
    if refused {
        // Made, with less than they asked for: said as any later refusal is.
        pool::say_refused();
    }
    // Observers outermost, so they see the caller's pointers and sizes.
    let mut layers: Vec<&'static dyn MallocSpy> = Vec::new();
    if let Some(leaks) = builtins.leaks {
        layers.push(leaks);
    }
    if let Some(ticks) = builtins.ticks {
        layers.push(ticks);
    }
    if let Some(count) = builtins.count {
        layers.push(count);
    }
    if let Some(guard) = builtins.guard {
        layers.push(guard);
    }
    if let Some(tracker) = builtins.leaks {
        crate::spies::leaks::set_tracker(tracker);
    }
    if is_a_go_program() {
        say("this is a Go program, which leaves by the exit system call, past C's exit: its reports and its \
             trace's end are written only if a signal ends it or it calls C's exit (from cgo)");
    }
    if !s.ticks && builtins.options.trace.is_some() {
        // Asked for and silently not made, the trace looked lost.
        say("trace is written by spy=ticks only, which is not among the spies; no trace");
    }
    if let Some(spy) = builtins.ticks {
        ticks::set_spy(spy);
        if let Some(trace) = builtins.options.trace.as_deref() {
            let text = std::env::var("MALLOCSPY_OPTIONS").unwrap_or_default();
            // Asked before the trace replaces or truncates the file.
            if sink::leave_file(&expand_path(trace, os::getpid())) {
                say("log_path and trace name the same file; reports go to stderr");
            }
            let o = &builtins.options;
            if let Err(e) = writer::start(spy, trace, o.trace_owner, &text, o.stats_interval_ms) {
                say(&format!("{e}; sampling without a trace"));
            }
        }
    }
    if BUILTINS.set(builtins).is_err() {
        return;
    }
    OWNER.store(os::getpid(), Ordering::Relaxed);
    global::set_fork_child_hook(after_fork_child);
    report_at_quick_exit();
    if BUILTINS.get().is_some_and(|b| b.options.report_on_signal) {
        crate::ending_signals::enable();
    }
    if let (Some(live), Some(b)) = (crate::early::stop(), BUILTINS.get()) {
        if let Some(tracker) = b.leaks {
            tracker.adopt(&live);
        }
        if let Some(count) = b.count {
            count.count_before(&live);
        }
        if let Some(ticks) = b.ticks {
            ticks.count_before(&live);
        }
    }
    let alone = layers.len() == 1;
    let spy: &'static dyn MallocSpy = if alone { layers[0] } else { leak(SpyStack::new(layers)) };
    if global::register_static_here(spy).is_err() {
        // Another thread registered a spy since `has_spy` was asked: end the trace begun.
        if let (Some(spy), Some(w)) = (BUILTINS.get().and_then(|b| b.ticks), writer::writer()) {
            w.finish(&spy.stats_now());
        }
        return say(ALREADY_REGISTERED);
    }
    BUILTINS_REGISTERED.store(true, Ordering::Release);
    let b = BUILTINS.get();
    global::built_ins_registered(b.is_some_and(|b| b.leaks.is_some()), b.is_some_and(|b| b.ticks.is_some()));
    if let (Some(ticks), true) = (BUILTINS.get().and_then(|b| b.ticks), alone) {
        ticks.open_gate(&GLOBAL.gate);
    }
}

fn after_fork_child() {
    if !BUILTINS_REGISTERED.load(Ordering::Acquire) {
        return;
    }
    sink::after_fork_child();
    crate::ending_signals::after_fork_child();
    OWNER.store(os::getpid(), Ordering::Relaxed);
    if let Some(b) = BUILTINS.get() {
        if let Some(count) = b.count {
            count.reset();
        }
        if let Some(leaks) = b.leaks {
            leaks.after_fork_child();
        }
        if let Some(spy) = b.ticks {
            spy.after_fork_child();
            if let Some(w) = writer::writer() {
                w.after_fork_child();
            }
        }
    }
}

/// The function `name` resolves to in the process, when it is not mallocspy's: another
/// allocator's preloaded before the shim, a wrapper's that passes calls on, or the program's
/// own.
fn served_elsewhere(name: &core::ffi::CStr) -> Option<*mut core::ffi::c_void> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    let own = os::module_of(init as *const () as *const core::ffi::c_void);
    (!f.is_null() && os::module_of(f) != own).then_some(f)
}

/// Where the process's `malloc` resolves, when not to mallocspy (see [`served_elsewhere`]),
/// and what would bring its calls to mallocspy: said at exit should none come.
fn malloc_served_elsewhere() -> Option<String> {
    let malloc = served_elsewhere(c"malloc")?;
    // The executable's own allocator comes before anything preloaded: no order helps.
    // SAFETY: getauxval only reads the auxiliary vector the kernel gave the process.
    let entry = os::module_of(unsafe { libc::getauxval(libc::AT_ENTRY) } as *const core::ffi::c_void);
    if entry != 0 && os::module_of(malloc) == entry {
        let exe = std::fs::read_link("/proc/thread-self/exe").map_or_else(|_| "?".into(), |p| p.display().to_string());
        return Some(format!(
            "the program's own ({exe}), which no preloaded library comes before: mallocspy cannot see its allocations"
        ));
    }
    // SAFETY: Dl_info is plain data, for which zero is a valid value.
    let mut info: libc::Dl_info = unsafe { core::mem::zeroed() };
    // SAFETY: dladdr only writes `info`, for an address of a loaded module.
    let found = unsafe { libc::dladdr(malloc, &mut info) } != 0 && !info.dli_fname.is_null();
    // SAFETY: dladdr set dli_fname to the module's NUL-terminated path, kept while it is loaded.
    let path = found
        .then(|| unsafe { core::ffi::CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned())
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| format!("{malloc:p}"));
    Some(format!("{path}, ahead of mallocspy (put libmallocspy_preload.so first in LD_PRELOAD)"))
}

/// That the reports saw nothing of the program's heap because its `malloc` is another
/// module's: an allocator preloaded before the shim serves every call itself, and the reports
/// would otherwise read as a clean bill ("0 allocs"). Only when no allocation reached the
/// spies: a wrapper that passes calls on to the next `malloc` (heaptrack's preload, a
/// program's own `malloc`) is spied on as ever. Switching mallocspy off at start on the lookup
/// alone took such wrappers for allocators.
fn bypassed_note() -> Option<String> {
    let elsewhere = MALLOC_ELSEWHERE.get().filter(|_| !GLOBAL.reached_a_spy())?;
    Some(format!(
        "no allocation reached mallocspy: malloc resolves to {elsewhere}; mallocspy saw none of the program's heap"
    ))
}

/// Said when allocations were made from inside mallocspy's hooks, by a signal handler that
/// interrupted one (no spy code may run then: the hook it interrupted may hold the locks it
/// would take), or by a handler on an alternate signal stack with little room left (see
/// `alt_stack.rs`).
fn unseen_note() -> Option<String> {
    let (calls, bytes) = GLOBAL.unseen();
    (calls > 0).then(|| {
        format!(
            "{} allocation(s) of {} bytes were made by signal handlers while mallocspy's hooks ran, \
             which they interrupted, or on a small alternate signal stack: not tracked, their leaks not reported",
            crate::leaks::report::grouped(calls),
            crate::leaks::report::grouped(bytes)
        )
    })
}

/// Said when the program revoked the built-in spies (`revoke_spy` in the C API): the reports
/// cover only what came before.
fn revoked_note() -> Option<String> {
    GLOBAL
        .builtin_revoked()
        .then(|| "the program revoked mallocspy's spies (revoke_spy): they saw nothing it did afterwards".to_string())
}

/// The bound on mallocspy's own memory, and whether an address-space limit set it: the
/// `max_memory` given; by default [`DEFAULT_MAX_MEMORY`], but no more than a quarter of what
/// the process may map (`ulimit -v`, and `ulimit -d`, which counts private writable mappings
/// too): under such a limit the tracker took the program's room, and its `malloc` failed
/// where it succeeds natively (review helper 91).
/// Whether the program is Go's (with cgo: one without is linked statically and loads no
/// preload library). Go's runtime ends the process with a raw `exit_group`, on a return from
/// `main` and in `os.Exit`, and no exit handler, mallocspy's reports included, runs: the
/// program ended without a word of them (review helper 96).
/// Known by the Go build ID note (owner "Go", type 4) among the program's notes, which are
/// in its loaded segments: a `dlsym` for a symbol of the runtime's, when it failed, left its
/// error for the program's `dlerror` and two blocks of the loader's in every leak report.
fn is_a_go_program() -> bool {
    let mut go = false;
    // The first module is the program.
    os::each_module(|program| {
        go = program.headers.iter().filter(|h| h.p_type == libc::PT_NOTE).any(|h| {
            // SAFETY: a PT_NOTE segment of the program lies in its loaded segments, mapped.
            has_go_note(unsafe {
                core::slice::from_raw_parts((program.bias + h.p_vaddr) as *const u8, h.p_memsz as usize)
            })
        });
        true
    });
    go
}

/// Whether `notes`, the contents of a `PT_NOTE` segment, hold Go's build ID note.
fn has_go_note(mut notes: &[u8]) -> bool {
    let word = |bytes: &[u8], at: usize| bytes.get(at..at + 4).map(|w| u32::from_ne_bytes([w[0], w[1], w[2], w[3]]));
    while let (Some(name_size), Some(desc_size), Some(kind)) = (word(notes, 0), word(notes, 4), word(notes, 8)) {
        // "Go", NUL-padded (Go's linker writes it in 4 bytes).
        let name = notes.get(12..12 + name_size as usize).and_then(|n| n.split(|&b| b == 0).next());
        if kind == 4 && name == Some(b"Go".as_slice()) {
            return true;
        }
        let next = 12 + (name_size as usize).next_multiple_of(4) + (desc_size as usize).next_multiple_of(4);
        let Some(rest) = notes.get(next..) else { return false };
        notes = rest;
    }
    false
}

fn memory_limit(given: Option<usize>) -> (usize, bool) {
    if let Some(given) = given {
        return (given, false);
    }
    match os::address_space_limit().map(|room| room / 4).filter(|&quarter| quarter < DEFAULT_MAX_MEMORY) {
        Some(quarter) => (quarter, true),
        None => (DEFAULT_MAX_MEMORY, false),
    }
}

fn tick_config(options: &Options) -> ticks::Config {
    let seed = options.sample_seed.unwrap_or_else(|| os::monotonic_ns() ^ (os::getpid() as u64) << 32);
    ticks::Config {
        sampling: options.sampling,
        interval: options.sample_interval,
        depth: options.stack_depth,
        seed,
        stats_interval_ns: options.stats_interval_ms.saturating_mul(1_000_000),
    }
}

/// Called by the shim's `.fini_array` entry: defer the reports past every other destructor.
pub fn fini() {
    unsafe extern "C" {
        fn __cxa_atexit(
            f: extern "C" fn(*mut core::ffi::c_void),
            arg: *mut core::ffi::c_void,
            dso: *mut core::ffi::c_void,
        ) -> core::ffi::c_int;
    }
    extern "C" fn report(_: *mut core::ffi::c_void) {
        report_at_exit();
    }
    // Not `atexit`: that ties the handler to this library, whose own finalisation (this very
    // call) would run it at once. A null DSO handle puts it in the process's list.
    // SAFETY: registers an `extern "C"` function that never unwinds, with no argument.
    if unsafe { __cxa_atexit(report, core::ptr::null_mut(), core::ptr::null_mut()) } != 0 {
        report_at_exit();
    }
}

/// Has `quick_exit` write the reports: glibc's ends with its own internal `_exit`, which no
/// preloaded `_exit` sees. The handler is registered before any other (at start, or at the
/// first registration of the process, which may come from a library's constructor run before
/// the shim's: see [`cxa_at_quick_exit`]), so it runs after them all (they run in reverse
/// order), as the exit reports run after the program's `atexit` handlers.
fn report_at_quick_exit() {
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    extern "C" fn report() {
        LEAVING_BY_EXIT_NOW.store(true, Ordering::Relaxed);
        report_at_exit();
    }
    if !REGISTERED.swap(true, Ordering::AcqRel) {
        // SAFETY: registers an `extern "C"` function that never unwinds, for the process (no
        // DSO handle). A refusal (no memory) only costs the report at `quick_exit`.
        unsafe { next_cxa_at_quick_exit(Some(report), core::ptr::null_mut()) };
    }
}

type AtQuickExit = unsafe extern "C" fn(Option<extern "C" fn()>, *mut core::ffi::c_void) -> core::ffi::c_int;

static NEXT_CXA_AT_QUICK_EXIT: core::sync::atomic::AtomicPtr<core::ffi::c_void> =
    core::sync::atomic::AtomicPtr::new(core::ptr::null_mut());

/// libc's `__cxa_at_quick_exit`.
///
/// # Safety
/// As `__cxa_at_quick_exit`.
unsafe fn next_cxa_at_quick_exit(f: Option<extern "C" fn()>, dso: *mut core::ffi::c_void) -> core::ffi::c_int {
    let next = os::next_symbol_cached(&NEXT_CXA_AT_QUICK_EXIT, c"__cxa_at_quick_exit");
    if next.is_null() {
        return -1;
    }
    // SAFETY: libc's function of this signature; the caller's guarantee covers the arguments.
    unsafe { core::mem::transmute::<*mut core::ffi::c_void, AtQuickExit>(next)(f, dso) }
}

/// `__cxa_at_quick_exit`, which `at_quick_exit` calls: the reports' handler is registered
/// first (`report_at_quick_exit`).
///
/// # Safety
/// As `__cxa_at_quick_exit`.
pub unsafe fn cxa_at_quick_exit(f: Option<extern "C" fn()>, dso: *mut core::ffi::c_void) -> core::ffi::c_int {
    report_at_quick_exit();
    // SAFETY: the caller's guarantee.
    unsafe { next_cxa_at_quick_exit(f, dso) }
}

/// Writes every report, once per process. Runs last at exit, or from `_exit`.
pub extern "C" fn report_at_exit() {
    report_all(Caller::here());
}

/// The process whose reports are being written now (its pid; 0 when none is): not a child
/// forked meanwhile, and not once they are written (the exit's flush of stdio comes after).
static WRITING_REPORTS: AtomicU32 = AtomicU32::new(0);

/// Every report, once per process, the leak check's scan of this thread starting at `caller`.
fn report_all(caller: Caller) {
    // Under a filter that may kill, not even `getpid` (see `seccomp.rs`); nor without spies,
    // whose process does not note a filter (`spy=none` died of SIGSYS at exit under
    // universal-ctags's sandbox).
    if crate::seccomp::may_kill() || OWNER.load(Ordering::Relaxed) == 0 {
        return;
    }
    let pid = os::getpid();
    if OWNER.load(Ordering::Relaxed) != pid || REPORTED.swap(true, Ordering::AcqRel) {
        return;
    }
    WRITING_REPORTS.store(pid, Ordering::Release);
    let mut caller = Some(caller);
    crate::spare_stack::with_room(&mut || caller.take().into_iter().for_each(write_reports));
    WRITING_REPORTS.store(0, Ordering::Release);
}

/// Whether this process is writing its reports now.
pub(crate) fn writing_reports() -> bool {
    WRITING_REPORTS.load(Ordering::Acquire) == os::getpid()
}

/// The reports of [`report_all`].
fn write_reports(caller: Caller) {
    if tls::state().depth.get() != 0 && !crate::dispatch::give_up_a_hook_left_by_a_jump() {
        // A signal handler that interrupted a hook of this thread called `exit`: the hook
        // holds locks (and half-made changes) that every report needs, and waiting for them
        // would hang the exit. Nothing that allocates or locks may run here.
        if ENDING_SIGNAL.load(Ordering::Relaxed) != 0 {
            no_report("the signal ending the process interrupted mallocspy; no report");
        } else if tls::state().in_tick_callback.get() != 0 {
            // The program's callback called `exit`, or left its hook by a jump earlier.
            no_report("the process exited inside (or after a jump out of) a tick or statistics callback; no report");
        } else {
            no_report("the process exited from a signal handler that interrupted mallocspy; no report");
        }
        return;
    }
    if !crate::own_heap::free_within(HEAP_PATIENCE_MS) {
        // Every report allocates from that heap: waiting for it would hang the exit.
        no_report(
            "a thread stopped inside mallocspy holds its memory (interrupted by a signal handler that never returned?); no report",
        );
        return;
    }
    let leaked = GLOBAL.leaked_frees();
    if leaked > 0 {
        say(&format!("{leaked} free(s) made inside a hook could not be completed; their blocks were leaked"));
    }
    let untold = GLOBAL.untold_blocks();
    if untold > 0 {
        say(&format!(
            "{untold} block(s) allocated inside a hook (a tick callback's, say) were served while the spy could not \
             be told: a double free the guard found at one of their addresses may be none"
        ));
    }
    let Some(b) = BUILTINS.get().filter(|_| BUILTINS_REGISTERED.load(Ordering::Acquire)) else { return };
    // A leak report carries these as notes (its JSON stays JSON); the other reports get a line.
    for note in bypassed_note().into_iter().chain(revoked_note()).filter(|_| b.leaks.is_none()) {
        sink::write(format!("mallocspy: {note}\n").as_bytes());
    }
    if let Some(count) = b.count {
        sink::write(count.report().as_bytes());
    }
    // Not once the program revoked the guard: the blocks listed may then be another spy's.
    if let Some(guard) = b.guard.filter(|_| !GLOBAL.builtin_revoked()) {
        // With the leak tracker, a damaged block is named by the stack that allocated it.
        let allocated_at = |p: usize| b.leaks.and_then(|tracker| tracker.allocation(p));
        guard.check_live_blocks(|f| GLOBAL.each_spied_block(f), &allocated_at);
    }
    if let Some(mut summary) = b.guard.and_then(|g| g.report_summary()) {
        sink::write(summary.as_bytes());
        // Naming the stacks needs the loader (see `write_leak_report`).
        if let Some(guard) = b.guard.filter(|_| crate::loader::usable()) {
            sink::write(guard.sites_report(b.options.show_below_main).as_bytes());
        }
    }
    if let Some(spy) = b.ticks
        && let stats = spy.stats_to_callback()
        && !writer::writer().is_some_and(|w| w.finish(&stats))
    {
        let ticks = spy.ticks();
        let (calls, bytes) = stats.kinds.iter().fold((0, 0), |(c, b), k| (c + k.allocs, b + k.bytes));
        let c = &spy.config;
        // With a `trace` that could not be started (said then), no advice to give one.
        let advice = if b.options.trace.is_none() { " (give trace=PATH to keep the samples)" } else { "" };
        sink::write(
            format!(
                "mallocspy: ticks: {ticks} sample{} ({}, every {} bytes on average) of {calls} allocations, \
                 {bytes} bytes; estimated peak live {} bytes{advice}\n",
                if ticks == 1 { "" } else { "s" },
                c.sampling.name(),
                c.interval,
                stats.peak_live_bytes
            )
            .as_bytes(),
        );
    }
    if let Some(spy) = b.ticks
        && let uncounted = spy.uncounted()
        && uncounted > 0
    {
        sink::write(
            format!(
                "mallocspy: ticks: {uncounted} allocation(s) were not counted: their threads got no record \
                 (mallocspy's memory limit, max_memory, was reached)\n"
            )
            .as_bytes(),
        );
    }
    let lost = b.leaks.map_or(0, |tracker| write_leak_report(tracker, caller).lost_blocks());
    // As valgrind's `--error-exitcode`, the guard's findings fail the run too.
    let found = b.guard.map_or(0, |guard| guard.findings());
    // Not at `_exit`, which skips the program's cleanup: a forked child leaving so must not
    // flush its parent's buffered output a second time, nor change the status its parent
    // waits for (LeakSanitizer checks only at `exit`).
    if let Some(code) = b.options.exitcode
        && lost + found > 0
        && ENDING_SIGNAL.load(Ordering::Relaxed) == 0
        && !LEAVING_BY_EXIT_NOW.load(Ordering::Relaxed)
    {
        // SAFETY: flushes stdio (the program's buffered output must not be lost), then
        // leaves with the failure status, as LSan's exitcode does.
        unsafe {
            libc::fflush(core::ptr::null_mut());
            libc::syscall(libc::SYS_exit_group, code as libc::c_int);
        }
    }
}

/// Runs a leak check and writes its report to the log, with the options of the shim (or
/// the defaults). Returns the summary.
pub(crate) fn write_leak_report(tracker: &LeakTracker, caller: Caller) -> leaks::Summary {
    let default = Options::default();
    let none = Suppressions::default();
    let (options, suppressions) = BUILTINS.get().map_or((&default, &none), |b| (&b.options, &b.suppressions));
    if !crate::loader::usable() {
        // The scan and the names need the loader, whose locks a thread that did not survive
        // the fork holds (see `loader.rs`): waiting for them would hang the process.
        no_report(
            "this process was forked while another thread held the dynamic loader's lock; \
             asking the loader would wait forever, so no leak report",
        );
        return leaks::Summary::default();
    }
    if !leaks::room_for_check(tracker.memory().live_blocks as usize) {
        no_report(
            "the leak check needs more memory than this process may map \
             (its address-space limit, ulimit -v, or the system's commit limit); no leak report",
        );
        return leaks::Summary::default();
    }
    let reachable_stacks = options.report_format == ReportFormat::Json || options.show_reachable;
    let stacks = StackOptions { suppressions, below_main: options.show_below_main };
    let mut report = match leaks::check(tracker, stacks, reachable_stacks, caller) {
        Ok(report) => report,
        Err(errno) => {
            no_report(&format!(
                "cannot read /proc/thread-self/maps ({}); without it nothing tells the program's memory \
                 from the rest, so no leak report",
                std::io::Error::from_raw_os_error(errno)
            ));
            return leaks::Summary::default();
        }
    };
    report.notes.extend(bypassed_note());
    report.notes.extend(revoked_note());
    report.notes.extend(unseen_note());
    report.notes.extend(leaks::unloaded::forgotten_note());
    let signal = ENDING_SIGNAL.load(Ordering::Relaxed);
    if signal != 0 {
        report
            .notes
            .push(format!("the process is ending by signal {signal} ({})", crate::ending_signals::name(signal)));
    }
    sink::write_parts(&mut |emit| match options.report_format {
        ReportFormat::Text => report.write_text(options.show_reachable, &mut |part| emit(part.as_bytes())),
        ReportFormat::Json => report.write_json(emit),
    });
    report.summary
}

/// The signal ending the process, whose handler writes the reports (0: none).
static ENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// From the handler of a signal that ends the process ([`crate::ending_signals`]): every
/// report, once per process, with a note of the signal. The process then dies of it, not of
/// `exitcode`: whoever sent it sees what they expect.
/// `interrupted`: the program's context the signal interrupted, when the handler runs there;
/// `None` at the end of the hook the signal interrupted (`ending_signals::after_hook`), whose
/// frames hold that call's block.
pub(crate) fn report_at_signal(signal: core::ffi::c_int, interrupted: Option<Caller>) {
    ENDING_SIGNAL.store(signal, Ordering::Relaxed);
    report_all(interrupted.unwrap_or(Caller { skip_to_program: false, ..Caller::here() }));
}

/// The process is leaving by `_exit`, `_Exit` ([`exit_now`]) or `quick_exit`.
static LEAVING_BY_EXIT_NOW: AtomicBool = AtomicBool::new(false);

/// C `daemon`, as glibc's (`misc/daemon.c`) does it, but for the parent's exit: glibc's calls
/// its own `_exit`, which skipped [`exit_now`], and the parent wrote no exit report, and its
/// trace neither exit statistics nor an end.
#[doc(hidden)]
pub fn daemon(nochdir: core::ffi::c_int, noclose: core::ffi::c_int) -> core::ffi::c_int {
    // SAFETY: plain system calls and libc's fork (its handlers, mallocspy's included, run).
    unsafe {
        match libc::fork() {
            -1 => return -1,
            0 => {}
            _ => exit_now(0),
        }
        if libc::setsid() == -1 {
            return -1;
        }
        if nochdir == 0 {
            libc::chdir(c"/".as_ptr());
        }
        if noclose == 0 {
            let fd = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            if fd == -1 {
                return -1;
            }
            let mut st: libc::stat = core::mem::zeroed();
            // As glibc: descriptors 0 to 2 go to /dev/null only if it is the null device (else
            // ENODEV), and the close keeps the errno said.
            if libc::fstat(fd, &mut st) != 0 {
                let errno = os::errno();
                libc::close(fd);
                os::set_errno(errno);
                return -1;
            }
            if st.st_mode & libc::S_IFMT != libc::S_IFCHR || st.st_rdev != libc::makedev(1, 3) {
                libc::close(fd);
                os::set_errno(libc::ENODEV);
                return -1;
            }
            for target in 0..3 {
                libc::dup2(fd, target);
            }
            if fd > 2 {
                libc::close(fd);
            }
        }
    }
    0
}

/// `_exit` and `_Exit`: report, then leave with the program's status.
pub fn exit_now(status: core::ffi::c_int) -> ! {
    LEAVING_BY_EXIT_NOW.store(true, Ordering::Relaxed);
    report_at_exit();
    loop {
        // SAFETY: exit_group ends the process and does not return.
        unsafe { libc::syscall(libc::SYS_exit_group, status) };
    }
}
