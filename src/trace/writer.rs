//! The trace writer: a thread of mallocspy's own that turns the hook path's queue into trace
//! records, adds heap statistics, stacks and modules, and writes them out.
//!
//! The hook path never writes, formats or waits: it queues fixed-size events
//! ([`super::ring`]). The writer wakes every `stats_interval_ms` while the program allocates,
//! drains the queue, emits a statistics event and writes what it has with one `write(2)`, so a
//! crash loses at most the last interval. When a whole interval passes without an allocator
//! call it sleeps on a futex until the next tick wakes it: an idle program is not woken for
//! us. The writer's own allocations go straight to the real allocator (its hook depth is
//! raised for good). At exit the exiting thread takes the writer's lock and writes the last
//! events, the final statistics and the end record itself.

use core::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::collections::HashSet;
use std::sync::OnceLock;

use super::ring::{Raw, RawTag};
use super::{Event, Header, HeapStats, Module, Tick, modules, write_event, write_header};
use crate::spies::ticks::TickSpy;
use crate::{os, sink, tls};

/// 1 while the writer sleeps until woken.
static IDLE: AtomicU32 = AtomicU32::new(0);

/// A function called with every heap statistics event (see [`crate::on_heap_stats`]).
pub type StatsCallback = extern "C" fn(&HeapStats);

/// Wakes the writer if it sleeps for want of events. One load when it does not.
#[inline]
pub(crate) fn wake() {
    if IDLE.load(Ordering::Relaxed) != 0 && IDLE.swap(0, Ordering::AcqRel) != 0 {
        // SAFETY: FUTEX_WAKE on a static word.
        unsafe { libc::syscall(libc::SYS_futex, IDLE.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, 1) };
    }
}

/// What only the lock holder touches.
struct State {
    fd: i32,
    buf: Vec<u8>,
    emitted_stacks: HashSet<u32>,
    modules: Vec<Module>,
    next_module: u64,
    peak: u64,
    /// Ticks seen, and the last statistics (for the summary of a run without a file).
    ticks: u64,
    last_stats: HeapStats,
    last_calls: u64,
    last_stats_ns: u64,
    ended: bool,
}

/// The process's writer.
pub(crate) struct Writer {
    spy: &'static TickSpy,
    /// `trace=` as given (`%p` for the pid); `None`: statistics for the callbacks only.
    template: Option<String>,
    header: Header,
    interval_ns: u64,
    lock: AtomicBool,
    state: core::cell::UnsafeCell<State>,
    stats_callback: AtomicUsize,
}

// SAFETY: `state` is touched only by the holder of `lock`; the rest is read-only or atomic.
unsafe impl Sync for Writer {}
// SAFETY: as above.
unsafe impl Send for Writer {}

static WRITER: OnceLock<&'static Writer> = OnceLock::new();

/// The process's writer, if one runs.
pub(crate) fn writer() -> Option<&'static Writer> {
    WRITER.get().copied()
}

/// Raises the calling thread's hook depth while `f` runs: its allocations are mallocspy's
/// own, not the program's.
fn unspied<R>(f: impl FnOnce() -> R) -> R {
    let ts = tls::state();
    let depth = ts.depth.get();
    ts.depth.set(depth + 1);
    let r = f();
    ts.depth.set(depth);
    r
}

fn command_line() -> Vec<String> {
    let raw = std::fs::read("/proc/self/cmdline").unwrap_or_default();
    raw.split(|&b| b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect()
}

fn unix_now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Opens the trace file of this process (truncating it).
fn open(template: &str) -> Result<i32, String> {
    let path = sink::expand(template, os::getpid());
    sink::open_path(&path, false).map_err(|e| format!("cannot open trace '{path}': {e}"))
}

fn fresh_state(fd: i32) -> State {
    State {
        fd,
        buf: Vec::with_capacity(1 << 16),
        emitted_stacks: HashSet::new(),
        modules: Vec::new(),
        next_module: 0,
        peak: 0,
        ticks: 0,
        last_stats: HeapStats::default(),
        last_calls: u64::MAX,
        last_stats_ns: 0,
        ended: false,
    }
}

impl Writer {
    /// Takes the lock (spinning: holders only drain and write).
    fn locked<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        while self.lock.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            os::yield_now();
        }
        // SAFETY: the lock makes this the only reference.
        let r = f(unsafe { &mut *self.state.get() });
        self.lock.store(false, Ordering::Release);
        r
    }

    /// Writes the header and the modules loaded now.
    fn begin(&self, st: &mut State) {
        let header = Header { pid: os::getpid(), start_unix_ns: unix_now_ns(), ..self.header.clone() };
        write_header(&mut st.buf, &header);
        self.rescan_modules(st);
        self.flush(st);
    }

    fn flush(&self, st: &mut State) {
        if st.fd >= 0 && !st.buf.is_empty() && !os::write_all(st.fd, &st.buf) {
            // A full disk or a closed descriptor: stop writing, keep the program going.
            // SAFETY: our descriptor.
            unsafe { libc::close(st.fd) };
            st.fd = -1;
        }
        st.buf.clear();
    }

    fn rescan_modules(&self, st: &mut State) {
        let now = modules::loaded();
        let time_ns = self.spy.elapsed_ns();
        let same = |a: &Module, b: &Module| a.path == b.path && a.base == b.base;
        let (kept, gone): (Vec<Module>, Vec<Module>) =
            core::mem::take(&mut st.modules).into_iter().partition(|m| now.iter().any(|n| same(m, n)));
        for m in gone {
            write_event(&mut st.buf, &Event::ModuleUnload { time_ns, id: m.id });
        }
        st.modules = kept;
        for mut m in now {
            if !st.modules.iter().any(|k| same(k, &m)) {
                m.id = st.next_module;
                st.next_module += 1;
                write_event(&mut st.buf, &Event::ModuleLoad { time_ns, module: m.clone() });
                st.modules.push(m);
            }
        }
    }

    fn known(&self, st: &State, pc: u64) -> bool {
        st.modules.iter().any(|m| m.ranges.iter().any(|&(s, e)| s <= pc && pc < e))
    }

    fn event(&self, st: &mut State, raw: Raw) {
        let event = match raw.tag {
            RawTag::Tick => {
                if st.emitted_stacks.insert(raw.stack) {
                    let frames = self.spy.stacks.frames(raw.stack).to_vec();
                    // Code of a library loaded since the last look: record it before its stack.
                    if frames.iter().any(|&pc| !self.known(st, pc)) {
                        self.rescan_modules(st);
                    }
                    write_event(&mut st.buf, &Event::Stack { id: raw.stack as u64, frames });
                }
                Event::Tick(Tick {
                    time_ns: raw.time_ns,
                    thread: raw.thread,
                    kind: raw.kind,
                    entry: raw.entry,
                    size: raw.size,
                    address: raw.address,
                    weight: raw.weight,
                    stack: raw.stack as u64,
                })
            }
            RawTag::Free => Event::Free { time_ns: raw.time_ns, thread: raw.thread, address: raw.address },
            RawTag::ThreadStart => {
                Event::ThreadStart { time_ns: raw.time_ns, thread: raw.thread, tid: raw.size as u32 }
            }
            RawTag::ThreadExit => Event::ThreadExit { time_ns: raw.time_ns, thread: raw.thread },
        };
        write_event(&mut st.buf, &event);
    }

    /// Drains the queue, adds statistics when due (or `force`), writes. Returns whether the
    /// program did anything since the last statistics.
    fn cycle(&self, st: &mut State, force: bool) -> bool {
        let Some(ring) = &self.spy.ring else { return false };
        let mut drained = 0;
        while let Some(raw) = ring.pop() {
            drained += 1;
            st.ticks += (raw.tag == RawTag::Tick) as u64;
            if st.fd >= 0 {
                self.event(st, raw);
            }
        }
        let lost = ring.take_dropped();
        if lost > 0 && st.fd >= 0 {
            write_event(&mut st.buf, &Event::Lost { time_ns: self.spy.elapsed_ns(), events: lost });
        }
        let now = self.spy.elapsed_ns();
        let calls = self.spy.calls();
        let active = calls != st.last_calls || drained > 0;
        if force || (active && now.saturating_sub(st.last_stats_ns) >= self.interval_ns) {
            let mut stats = self.spy.stats();
            stats.time_ns = now;
            st.peak = st.peak.max(stats.live_bytes());
            stats.peak_live_bytes = st.peak;
            st.last_stats_ns = now;
            st.last_calls = calls;
            st.last_stats = stats;
            if st.fd >= 0 {
                write_event(&mut st.buf, &Event::HeapStats(stats));
            }
            let callback = self.stats_callback.load(Ordering::Acquire);
            if callback != 0 {
                // SAFETY: only `set_stats_callback` stores here, always a StatsCallback.
                let f: StatsCallback = unsafe { core::mem::transmute::<usize, StatsCallback>(callback) };
                f(&stats);
            }
        }
        self.flush(st);
        active
    }

    fn run(&'static self) {
        tls::state().depth.set(1);
        let sleep = libc::timespec {
            tv_sec: (self.interval_ns / 1_000_000_000) as i64,
            tv_nsec: (self.interval_ns % 1_000_000_000) as i64,
        };
        loop {
            let (active, ended) = self.locked(|st| (st.ended || self.cycle(st, false), st.ended));
            if ended {
                return;
            }
            if active {
                // SAFETY: nanosleep with a valid request and no remainder wanted.
                unsafe { libc::nanosleep(&sleep, core::ptr::null_mut()) };
            } else {
                IDLE.store(1, Ordering::Release);
                // Nothing for a whole interval: sleep until a tick wakes us (a wake between the
                // store and the wait makes the wait return at once).
                // SAFETY: FUTEX_WAIT on a static word, no timeout.
                unsafe {
                    libc::syscall(
                        libc::SYS_futex,
                        IDLE.as_ptr(),
                        libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                        1,
                        core::ptr::null::<libc::timespec>(),
                    )
                };
            }
        }
    }

    /// Starts the writer thread with every signal blocked: the program's signals (a timer's
    /// SIGALRM, a SIGCHLD) must reach the program's own threads, whose handlers may expect to
    /// interrupt only code of theirs, never ours in the middle of an allocation.
    fn spawn(&'static self) -> bool {
        // SAFETY: sigset_t is plain data; sigfillset initialises it; pthread_sigmask swaps the
        // calling thread's mask, restored right after the new thread has inherited it.
        unsafe {
            let mut all: libc::sigset_t = core::mem::zeroed();
            let mut old: libc::sigset_t = core::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
            let spawned = std::thread::Builder::new().name("mallocspy-trace".into()).spawn(move || self.run()).is_ok();
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, core::ptr::null_mut());
            spawned
        }
    }

    /// At exit: the last events, the final statistics and the end record. Returns the number
    /// of ticks and the final statistics (once; `None` after).
    pub(crate) fn finish(&self) -> Option<(u64, HeapStats)> {
        let done = unspied(|| {
            self.locked(|st| {
                if st.ended {
                    return None;
                }
                self.cycle(st, true);
                st.ended = true;
                if st.fd >= 0 {
                    write_event(&mut st.buf, &Event::End { time_ns: self.spy.elapsed_ns() });
                    self.flush(st);
                    // SAFETY: our descriptor.
                    unsafe { libc::close(st.fd) };
                    st.fd = -1;
                }
                Some((st.ticks, st.last_stats))
            })
        });
        wake();
        done
    }

    /// Whether a trace file was asked for.
    pub(crate) fn has_file(&self) -> bool {
        self.template.is_some()
    }

    /// Child side of `fork`: the writer thread did not come along. With `%p` in the path the
    /// child traces into a file of its own; without, it stops tracing (the file is the
    /// parent's).
    pub(crate) fn after_fork_child(&'static self) {
        unspied(|| {
            self.lock.store(false, Ordering::Release);
            IDLE.store(0, Ordering::Relaxed);
            let fd = match &self.template {
                Some(t) if t.contains("%p") => open(t).unwrap_or(-1),
                _ => -1,
            };
            // The parent's state may have been mid-change in its writer thread: start afresh
            // (the old one is left behind, a few KiB).
            let fresh = fresh_state(fd);
            // SAFETY: no other thread exists in the child yet.
            unsafe { core::ptr::write(self.state.get(), fresh) };
            self.locked(|st| self.begin(st));
            self.spawn();
        });
    }

    /// Calls `f` with every statistics event from now on.
    pub(crate) fn set_stats_callback(&self, f: Option<StatsCallback>) {
        self.stats_callback.store(f.map_or(0, |f| f as usize), Ordering::Release);
    }
}

/// Starts the process's writer for `spy`: into `template` (`%p` = pid) if given, else for
/// the statistics callbacks only. When the file cannot be opened the writer still runs (for
/// the callbacks and the exit summary) and the one-line error is returned beside it.
pub(crate) fn start(
    spy: &'static TickSpy,
    template: Option<&str>,
    options: &str,
    stats_interval_ms: u64,
) -> (Option<&'static Writer>, Option<String>) {
    let (fd, error) = match template.map(open) {
        Some(Ok(fd)) => (fd, None),
        Some(Err(e)) => (-1, Some(e)),
        None => (-1, None),
    };
    let header = Header {
        pid: os::getpid(),
        command: command_line(),
        options: options.to_string(),
        sampling: spy.config.sampling,
        interval: spy.config.interval,
        stats_interval_ms,
        start_unix_ns: 0,
    };
    let writer = Writer {
        spy,
        template: template.filter(|_| fd >= 0).map(str::to_string),
        header,
        interval_ns: stats_interval_ms.max(1) * 1_000_000,
        lock: AtomicBool::new(false),
        state: core::cell::UnsafeCell::new(fresh_state(fd)),
        stats_callback: AtomicUsize::new(0),
    };
    let writer: &'static Writer = Box::leak(Box::new(writer));
    if WRITER.set(writer).is_err() {
        return (None, Some("a trace writer already runs".into()));
    }
    writer.locked(|st| writer.begin(st));
    if !writer.spawn() {
        return (Some(writer), Some("cannot start the trace writer thread; statistics only at exit".into()));
    }
    (Some(writer), error)
}
