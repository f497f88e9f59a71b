//! The trace writer: a process of mallocspy's own that turns the hook path's queue into trace
//! records, adds the stacks' frames and the modules, and writes them out.
//!
//! Not a thread: a second thread in the program, even one asleep, turns glibc's malloc from
//! its single-thread fast path to locking every call (a quarter more time on a one-thread
//! allocation loop). The writer is forked twice at start-up (a forked child's when it first
//! has something to write: [`Writer::after_fork_child`]), with no exit signal, so that the
//! program never sees it as its child: no `SIGCHLD`, nothing for its `wait` (one fork with no
//! exit signal hides it from `wait` but not from `__WALL`: a preloaded `strace`, which waits
//! so, waited for it forever; the middle process, reaped at once, sent a `SIGCHLD` while it
//! had an exit signal). A child subreaper forks it once (see `launch`). It runs in a session
//! of its own (a `^C` at the terminal does not cut the trace short), with every descriptor but
//! the trace file and its end of a socket pair closed (a program's reader waiting for end of
//! file on a pipe is not kept waiting). The queue lives
//! in shared memory ([`super::ring`]).
//!
//! The hook path never writes, formats or waits: it queues messages. The writer drains the
//! queue every `stats_interval_ms` while messages come (sooner when a producer finds it past
//! half full) and writes them with one `write(2)`; when the queue stays empty it sleeps until
//! the next message wakes it (one byte on the socket): an idle program is not woken for us.
//! At exit the program queues the last statistics and the end and waits, a few seconds at
//! most, for the writer to close its end.
//! If the program dies instead, the writer sees its end close, drains what was queued
//! (shared memory outlives the program) and leaves: a crash loses nothing already queued.
//! A program can also close the socket itself (daemons and `closefrom`-style loops close
//! every descriptor they did not open): then the queue is still mapped in the program, and
//! the writer drains it on its own (at once again while messages come, every
//! [`IDLE_POLL_MS`] for a while after, then every `stats_interval_ms`, or when the program
//! nudges a futex in the queue's memory: at its exit, before it unmaps a library, when the
//! queue fills) until the program has gone (it no longer maps the queue: it exited, or
//! `exec`'d).

use crate::fixed_hash::HashSet;
use core::sync::atomic::{AtomicPtr, AtomicU32, Ordering};
use std::sync::OnceLock;

use super::file::{HeaderWrite, create, is_own, name_owner_for_descendants, remove_if_idle_before_exec, remove_trace};
use super::message;
use super::ring::{Ring, slots_for};
use super::{Event, Header, HeapStats, Module, modules, write_event, write_header};
use crate::kept_fd::{self, KeptFd};
use crate::os::close;
use crate::spies::ticks::TickSpy;
use crate::{options, os, process_mark, sink, tls};

/// Slots of the queue (64 bytes each).
const QUEUE_SLOTS: usize = 1 << 15;
/// Longest the program waits at exit for the writer to finish the trace.
const FINISH_WAIT_MS: i32 = 10_000;
/// How often a writer that the program can no longer wake (it closed the writer's socket:
/// `closefrom`, a daemon closing every descriptor) looks at a queue that just went quiet, for
/// [`QUIET_POLLS`] looks; then every `stats_interval_ms`.
const IDLE_POLL_MS: i32 = 10;
const QUIET_POLLS: u32 = 10;

/// The program's end of the socket pair to the writer, if it has one.
static WAKE: KeptFd = KeptFd::strict();

/// Before a seccomp filter that may kill the program for a call it does not expect (see
/// `crate::seccomp`): the writer is woken through the queue's futex from now on, not by a
/// `send` on the socket, whose check (`fstat`) and `send` the filter may not allow.
pub(crate) fn before_filter() {
    WAKE.release();
}

/// Before a seccomp filter that may kill the program for a call the queue's producers make
/// (the queue's futex, the heap statistics' CPU clock): nothing more is queued, and the trace
/// ends at the program's last message before the filter, without an end, as a crash's does.
/// ctags's sandbox, which allows neither, died of SIGSYS when its run outlasted the
/// statistics' interval (CI at 90dbc8c; 2 runs in 3 with `stats_interval_ms=1`).
pub(crate) fn stop_queueing() {
    if let Some(writer) = writer() {
        writer.spy.set_ring(None);
    }
}

/// Wakes the writer, which sleeps for want of messages or waits for its next drain. Called by
/// a producer that saw the ring's idle flag (once per sleep) or found it filling (at most
/// eight times a lap): a `send` that never blocks and never raises `SIGPIPE`, or, once the
/// program has closed the socket, a nudge of the queue's futex, on which the writer then
/// sleeps. `false` when there is no writer.
pub(crate) fn wake() -> bool {
    if let Some(fd) = WAKE.get() {
        os::send(fd, b"w", libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
        return true;
    }
    match writer().and_then(Writer::ring) {
        Some(ring) => {
            ring.nudge();
            true
        }
        None => false,
    }
}

/// What only the writer process touches.
struct State {
    /// The traced process, as `/proc` names it (see [`os::proc_pid`]).
    proc_pid: u32,
    fd: i32,
    /// Bytes of the trace written so far.
    written: u64,
    buf: Vec<u8>,
    /// The queue, shared with the program.
    ring: &'static Ring,
    /// Stacks whose frames are written.
    stacks: HashSet<u64>,
    modules: Vec<Module>,
    elf: modules::ElfCache,
    next_module: u64,
    /// Whether the modules the process started with are written (see [`Writer::begin`]).
    begun: bool,
    /// Whether a record of the program's own work is written (see [`is_own`]).
    own: bool,
    /// The trace's path when the writer started (see [`remove_if_idle_before_exec`]).
    first_name: Option<String>,
    ended: bool,
}

/// The process's trace writer.
pub(crate) struct Writer {
    spy: &'static TickSpy,
    /// `trace=` as given (`%p` for the pid).
    template: String,
    /// `trace_owner`: the process that took `template` (without `%p`) first, as this process's
    /// environment names it (this one after an `exec`, an ancestor, or 0 for none; see [`super::file`]).
    owner: u32,
    /// The header, but for the pid and the start time of each process.
    header: Header,
    interval_ms: u64,
    /// The queue of the current writer process (a leaked `Ring`).
    ring: AtomicPtr<Ring>,
    /// The pid whose trace this process's events go to: a forked child names it as the
    /// parent its sampled blocks came from (`getppid` names init once the parent has left,
    /// as a daemon's does at once).
    traced_pid: AtomicU32,
}

static WRITER: OnceLock<&'static Writer> = OnceLock::new();

/// The process's writer, if one was started.
pub(crate) fn writer() -> Option<&'static Writer> {
    WRITER.get().copied()
}

/// The pid of a forked child whose writer waits to start (see [`Writer::after_fork_child`]);
/// 0 when none waits. A pid, not a flag: a `vfork`ed child shares the memory (and the mark
/// of [`process_mark`]) of a child that waits, and is not it.
static DEFERRED: AtomicU32 = AtomicU32::new(0);

/// The path of the trace this process's writer writes (a leaked C string), and the pid it is
/// that process's for (a forked child has its parent's until its own writer starts).
static TRACE_PATH: AtomicPtr<libc::c_char> = AtomicPtr::new(core::ptr::null_mut());
static TRACE_PATH_PID: AtomicU32 = AtomicU32::new(0);

/// Gives the calling process's trace file to user `uid`, before the process becomes that user:
/// a worker that drops its privileges and `exec`s leaves the trace to the new image, which
/// replaces it (as the user it now is: in a sticky directory only the file's owner may remove
/// it, and the new image ran without a trace; review helper 152).
pub(crate) fn hand_trace_to(uid: u32) {
    let path = TRACE_PATH.load(Ordering::Acquire);
    if !path.is_null() && TRACE_PATH_PID.load(Ordering::Acquire) == os::getpid() {
        // SAFETY: a NUL-terminated path leaked by `launch`; chown takes no memory of ours. A
        // refusal (another file system's) leaves the file as it is.
        unsafe { libc::chown(path, uid, u32::MAX) };
    }
}

/// The pid of this process's writer where it is its child (forked once, by a subreaper: see
/// [`Writer::launch`]); 0 otherwise.
static CHILD_WRITER: AtomicU32 = AtomicU32::new(0);

/// Whether process `pid` is this process's own writer, its child: one just forked may not have
/// run yet, to take its name (see `kill_all.rs`). A writer forked twice has it from the middle
/// process, which is gone by the time the program goes on.
pub(crate) fn is_child_writer(pid: u32) -> bool {
    pid != 0 && CHILD_WRITER.load(Ordering::Relaxed) == pid
}

/// The thread starting a deferred writer (0: none).
static STARTING: AtomicU32 = AtomicU32::new(0);

/// How long the exit waits for another thread to start the writer, for the trace to end.
const START_WAIT_NS: u64 = 2_000_000_000;

/// Whether this process is a forked child whose writer has not started yet.
#[inline]
pub(crate) fn deferred() -> bool {
    let pid = DEFERRED.load(Ordering::Acquire);
    pid != 0 && process_mark::set_up_here() && pid == os::getpid()
}

/// Starts a forked child's writer, if it waits to: at the child's first record of its own,
/// before its first other thread, or at its exit (see [`Writer::after_fork_child`]). The
/// child's other threads (ones it made without `pthread_create`: glibc's timer threads) are
/// kept out of the hooks until the trace has the blocks the child inherited and the queue is
/// published: they neither sample nor free a sampled block meanwhile. One already inside a
/// hook when the start began may not wait for it (the start waits for it to leave): it goes
/// on without the writer (a sample is then not taken: see `TickSpy::sample`). The exit waits
/// (`at_exit`).
pub(crate) fn start_deferred(at_exit: bool) {
    if !deferred() {
        return;
    }
    let tid = os::gettid();
    match STARTING.compare_exchange(0, tid, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            // As inside a hook, where most starts are: our own calls, and a signal handler's
            // on this thread, go straight to the real allocator (a handler's would otherwise
            // wait at the hooks' door for this start to end).
            let ts = tls::state();
            let depth = ts.depth.replace(ts.depth.get().max(1));
            crate::threads::fork_prepare();
            // Unless a thread started it between our look and our turn (it cleared the pid
            // before it let go of its turn): a second start took the first's trace for an
            // earlier image's, and left it as `.before-exec`.
            if DEFERRED.load(Ordering::Acquire) != 0
                && let Some(w) = writer()
            {
                w.start_child();
            }
            DEFERRED.store(0, Ordering::Release);
            crate::threads::fork_parent();
            STARTING.store(0, Ordering::Release);
            ts.depth.set(depth);
        }
        Err(starter) if starter != tid && at_exit => {
            let since = os::monotonic_ns();
            while DEFERRED.load(Ordering::Acquire) != 0 && os::monotonic_ns() - since < START_WAIT_NS {
                os::yield_now();
            }
        }
        Err(_) => {}
    }
}

fn command_line() -> Vec<String> {
    let raw = std::fs::read("/proc/self/cmdline").unwrap_or_default();
    raw.split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .take(super::MAX_ARGS)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

pub(super) fn unix_now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// `fork` without the program's `pthread_atfork` handlers (ours included): the writer
/// process is not a copy of the program for the program's purposes. Nor a child it hears of:
/// with no exit signal, the program gets no SIGCHLD when it ends (a handler counted one, a
/// `sigwaitinfo` for its own child's got it), and a plain `wait` never sees it
/// (`waitpid` with `__WALL` does). The child's pid, 0 in the child, or -errno.
fn raw_fork() -> i32 {
    // SAFETY: clone with no flag, the same stack and exit signal 0 is fork without SIGCHLD;
    // the child continues with a copy of the calling thread only, which is all the writer
    // uses. Raw, with full registers: `libc::syscall` is variadic, and an `int` 0 for the
    // stack pointer may reach the kernel with its upper half unset.
    unsafe { crate::os::raw_syscall(libc::SYS_clone, [0; 6]) as i32 }
}

/// Reaps our child `pid`, whatever its exit signal: its exit status, or `None` if another
/// thread of the program's reaped it first (one that waits for any child with `__WALL`).
fn reap(pid: i32) -> Option<i32> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid writes the status into an int of ours.
        if unsafe { libc::waitpid(pid, &mut status, libc::__WALL) } == pid {
            return libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
        }
        if os::errno() != libc::EINTR {
            return None;
        }
    }
}

/// Leaves the writer process without running anything of the program's (no atexit
/// handlers, no stdio flush of the program's copied buffers). Closes `fds` first: a program
/// waiting at exit for the socket to close goes on then, not once the kernel has also torn
/// down this process's copy of its memory (which it does before closing what is left open).
fn leave(fds: &[i32]) -> ! {
    leave_with(fds, 0)
}

/// [`leave`] with an exit status.
fn leave_with(fds: &[i32], status: i32) -> ! {
    for &fd in fds.iter().filter(|&&fd| fd >= 0) {
        close(fd);
    }
    loop {
        // SAFETY: exit_group ends the process.
        unsafe { libc::syscall(libc::SYS_exit_group, status) };
    }
}

impl Writer {
    /// Writes the modules the process started with, once, before the first record that names
    /// code (a stack, an unload). Not at the writer's start: most short processes (a shell's
    /// child between its `fork` and its `exec`, `ls`, `true`) take no sample, and at their
    /// exit they waited for their writer to have read the map and every module's file, for
    /// records that nothing in their trace names.
    fn begin(&self, st: &mut State) {
        if st.begun {
            return;
        }
        st.begun = true;
        // The modules the process starts with were there from its start (a forked child's
        // too: stamped when the writer got to them, they came after a short child's end).
        // Read from this process's own map, the program's as it was at the fork: by the time
        // the writer gets here, a program may have `exec`d another, whose map the program's
        // pid now shows (or ended, and shows none: its trace began without modules, one
        // stressed run in 40 of a shell's pipeline).
        self.rescan_modules(st, os::proc_pid(), 0, Some(0));
    }

    fn flush(&self, st: &mut State) {
        if st.fd >= 0 && !st.buf.is_empty() {
            match os::write_whole(st.fd, &st.buf) {
                Ok(()) => st.written += st.buf.len() as u64,
                Err((errno, done)) => {
                    // A full disk: stop writing, the program goes on and says so at its exit.
                    st.ring.note_write_error(errno, st.written + done as u64);
                    close(st.fd);
                    st.fd = -1;
                }
            }
        }
        st.buf.clear();
    }

    /// Reads the program's modules again, from the map of process `pid` as `/proc` names it
    /// (the program's, or this one's): an unload record (at `unloaded_ns`) for each module
    /// gone, and a load record (at `loaded_ns`, or now) for each new one.
    fn rescan_modules(&self, st: &mut State, pid: u32, unloaded_ns: u64, loaded_ns: Option<u64>) {
        let now = modules::of_process(pid, &mut st.elf);
        if now.is_empty() {
            // The program has ended (a live process has its executable mapped at least):
            // its modules were not unloaded.
            return;
        }
        let time_ns = loaded_ns.unwrap_or_else(|| self.spy.elapsed_ns());
        let same = |a: &Module, b: &Module| a.path == b.path && a.base == b.base;
        let (kept, gone): (Vec<Module>, Vec<Module>) =
            core::mem::take(&mut st.modules).into_iter().partition(|m| now.iter().any(|n| same(m, n)));
        for m in gone {
            write_event(&mut st.buf, &Event::ModuleUnload { time_ns: unloaded_ns.min(time_ns), id: m.id });
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

    /// Writes `event`, after the stack a tick names if its `frames` are new here.
    fn event(&self, st: &mut State, event: Event, frames: Vec<u64>) {
        if let Event::Tick(tick) = &event
            && !frames.is_empty()
            && st.stacks.insert(tick.stack)
        {
            self.begin(st);
            // Libraries unloaded since the last look, and code of a library loaded since:
            // recorded before the stack. A library loaded where an unloaded one was is known
            // by its addresses alone, under the unloaded one's name.
            self.note_unloads(st);
            if frames.iter().any(|&pc| !self.known(st, pc)) {
                self.rescan_modules(st, st.proc_pid, self.spy.elapsed_ns(), None);
            }
            write_event(&mut st.buf, &Event::Stack { id: tick.stack, frames });
        }
        if matches!(event, Event::End { .. }) {
            self.note_unloads(st);
            st.ended = true;
        }
        st.own |= is_own(&event);
        write_event(&mut st.buf, &event);
    }

    /// After the program unloaded libraries (`dlclose`): their unload records, in the trace
    /// even when no later stack makes the writer read the modules again.
    fn note_unloads(&self, st: &mut State) {
        if let Some(unloaded_ns) = st.ring.take_unloaded() {
            self.begin(st);
            self.rescan_modules(st, st.proc_pid, unloaded_ns, None);
        }
    }

    /// Writes what the queue holds (up to the end). Returns the number of messages.
    fn drain(&self, st: &mut State, ring: &Ring) -> usize {
        let mut words = Vec::with_capacity(message::MAX_WORDS);
        let mut drained = 0;
        while !st.ended && ring.pop(&mut words, message::words_of) {
            drained += 1;
            if let Some((event, frames)) = message::decode(&words) {
                self.event(st, event, frames);
            }
            if st.ended {
                // A program that cannot see our socket close waits for this mark instead.
                self.flush(st);
                if st.fd >= 0 && os::is_unlinked(st.fd) {
                    ring.note_unlinked();
                }
                // A regular file only: a device (`trace=/dev/null`) or a FIFO has no size.
                let regular_and_short =
                    |f: libc::stat| f.st_mode & libc::S_IFMT == libc::S_IFREG && (f.st_size as u64) < st.written;
                if st.fd >= 0 && os::fstat(st.fd).is_some_and(regular_and_short) {
                    ring.note_cut();
                }
            }
            ring.mark_done();
            words.clear();
        }
        if !st.ended {
            self.note_unloads(st);
        }
        let lost = ring.take_dropped();
        if lost > 0 {
            st.own = true;
            write_event(&mut st.buf, &Event::Lost { time_ns: self.spy.elapsed_ns(), events: lost });
        }
        self.flush(st);
        drained
    }

    /// The writer process's life: write until the program's end message, or until its end
    /// of the socket closes (it died or exec'd), then leave.
    #[allow(clippy::too_many_arguments)]
    fn serve(
        &self,
        header: &Header,
        proc_pid: u32,
        trace_fd: i32,
        first_name: Option<String>,
        header_write: HeaderWrite,
        socket: i32,
        ring: &'static Ring,
    ) -> ! {
        tls::state().depth.set(1);
        tls::state().scope_sp.set(0);
        // SAFETY: plain system calls on this process: a session of its own, every signal
        // blocked (it leaves when the program's end closes).
        unsafe {
            libc::setsid();
            let mut all: libc::sigset_t = core::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::sigprocmask(libc::SIG_BLOCK, &all, core::ptr::null_mut());
        }
        // Its command line was the program's: `pgrep -f`, `pkill -f` and `pidof` took it for
        // another copy of the program (`pkill -f` killed its own writer: review helper 153).
        os::set_command_line(b"mallocspy-trace");
        keep_only(&[trace_fd, socket]);
        let (fd, written) = match header_write {
            HeaderWrite::ByWriter => (trace_fd, 0),
            HeaderWrite::Written(bytes) => (trace_fd, bytes),
            HeaderWrite::Failed { errno, written } => {
                // A full disk: as a failed write of the events (see `flush`).
                ring.note_write_error(errno, written);
                close(trace_fd);
                (-1, written)
            }
        };
        let mut st = State {
            proc_pid,
            fd,
            written,
            buf: Vec::with_capacity(1 << 16),
            ring,
            stacks: HashSet::default(),
            modules: Vec::new(),
            elf: modules::ElfCache::default(),
            next_module: 0,
            begun: false,
            own: false,
            first_name,
            ended: false,
        };
        if let HeaderWrite::ByWriter = header_write {
            write_header(&mut st.buf, header);
        }
        self.flush(&mut st);
        let interval = self.interval_ms.clamp(1, i32::MAX as u64) as i32;
        // -1 once the program has closed its end but runs on: nothing can wake us then.
        let mut socket = socket;
        let mut gone = false;
        // Drains in a row that found nothing, once the socket is closed.
        let mut quiet = 0;
        loop {
            // Read before the queue: a nudge during the drain ends the sleep after it at once.
            let nudges = ring.nudges();
            let drained = self.drain(&mut st, ring);
            if st.ended || gone {
                if let Some(first_name) = st.first_name.as_deref().filter(|_| gone && !st.own && st.fd >= 0) {
                    remove_if_idle_before_exec(st.fd, first_name);
                }
                leave(&[st.fd, socket]);
            }
            quiet = if drained > 0 { 0 } else { quiet + 1 };
            let timeout = if socket < 0 {
                // Nothing can wake us: look again at once while the program keeps the queue
                // busy (sleeping a whole interval after a full queue dropped half of a busy
                // run's events), soon after it goes quiet, and then every interval: a daemon
                // that sleeps for hours is not polled a hundred times a second.
                match quiet {
                    0 => 1,
                    1..QUIET_POLLS => interval.min(IDLE_POLL_MS),
                    _ => interval,
                }
            } else if drained > 0 {
                interval
            } else if ring.go_idle() {
                -1
            } else if ring.has_message() {
                0
            } else {
                // Claimed but not yet published: its producer is between the two steps, or
                // was preempted there. Look again shortly rather than spin.
                1
            };
            if timeout != 0 && socket < 0 {
                // The program's `wake` nudges the queue's futex instead (at its exit, before
                // it unmaps a library): with only the timeout, a program that had closed the
                // socket waited at exit for up to `stats_interval_ms`.
                ring.sleep_unless_nudged(nudges, timeout);
            } else if timeout != 0 {
                let mut pfd = libc::pollfd { fd: socket, events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut pfd, 1, timeout) };
            }
            if socket < 0 {
                // Only once the queue is quiet (a program that has gone adds nothing): reading
                // its maps a thousand times a second would contend for its memory map's lock.
                if quiet > 0 {
                    gone = !maps_queue(st.proc_pid, ring.address());
                }
            } else if program_gone(socket) {
                gone = !maps_queue(st.proc_pid, ring.address());
                if !gone {
                    close(socket);
                    socket = -1;
                }
            }
        }
    }

    /// The queue of the current writer process, if one runs.
    fn ring(&self) -> Option<&'static Ring> {
        // SAFETY: only `launch`, `finish` and `after_fork_child` store here: null or a leaked ring.
        unsafe { self.ring.load(Ordering::Acquire).as_ref() }
    }

    /// Opens the trace (`forked`: in the child of a fork; see [`super::file`]), makes a queue and
    /// forks the writer process for this process.
    fn launch(&self, forked: bool) -> Result<&'static Ring, String> {
        // Its events' times count from the spy's start (a child's from its fork), however
        // much later the writer starts.
        let start_unix_ns = unix_now_ns().saturating_sub(self.spy.elapsed_ns());
        let header = Header {
            pid: os::getpid(),
            start_unix_ns,
            pid_namespace: os::pid_namespace().unwrap_or(0),
            process_start_ticks: os::process_start_ticks().unwrap_or(0),
            ..self.header.clone()
        };
        let descendant = forked || (self.owner != 0 && self.owner != header.pid);
        let (trace_fd, path, header_write) = create(&self.template, descendant, &header)?;
        if let Ok(c) = std::ffi::CString::new(path.as_str()) {
            TRACE_PATH.store(c.into_raw(), Ordering::Release);
            TRACE_PATH_PID.store(header.pid, Ordering::Release);
        }
        let took_the_path =
            !options::names_pid(&self.template) && path == options::expand_path(&self.template, header.pid);
        if took_the_path && self.owner != header.pid {
            name_owner_for_descendants(header.pid);
        }
        // A writer that cannot start leaves no empty trace behind.
        let give_up = |fds: &[i32], why: String| {
            fds.iter().for_each(|&fd| close(fd));
            remove_trace(&path);
            Err(why)
        };
        let mut fds = [-1; 2];
        // SAFETY: socketpair writes two descriptors into the array.
        if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) } != 0
        {
            let error = std::io::Error::last_os_error();
            return give_up(&[trace_fd], format!("cannot make the writer's socket: {error}"));
        }
        let (ours, its) = (fds[0], fds[1]);
        // Its name now, before the program can `exec`: a writer that read it once started
        // found the name a slow start had let the next image rename it to (the next image
        // kept a trace of a header alone as `.before-exec`, 4 runs in 13 of a Java program
        // spawning 40 children; review helper 148). Absolute, as the descriptor's link was.
        let first_name = std::path::absolute(&path).ok().and_then(|p| p.into_os_string().into_string().ok());
        let proc_pid = os::proc_pid();
        let Some(ring) = Ring::new_shared(QUEUE_SLOTS) else {
            return give_up(&[trace_fd, ours, its], "cannot map the trace queue".into());
        };
        // Shared with the writer process for as long as this process lives (unmapped by
        // nothing, not even should the fork below fail).
        let ring: &'static Ring = Box::leak(Box::new(ring));
        // A process orphaned by the middle one goes to the nearest child subreaper (or the
        // init of the PID namespace), with SIGCHLD as its exit signal again: a subreaper's own
        // writer then is its child for `wait`, and one that reaps until it has no child left
        // waited for it forever (a container's init too: review helper 108). Its writer is
        // forked once, and stays its child with no exit signal.
        let subreaper = os::getpid() == 1 || {
            let mut flag: libc::c_int = 0;
            // SAFETY: PR_GET_CHILD_SUBREAPER writes one int.
            unsafe { libc::prctl(libc::PR_GET_CHILD_SUBREAPER, &mut flag) == 0 && flag != 0 }
        };
        // As `fork`'s handlers do: no other thread inside mallocspy while the memory is
        // copied. A forked child's writer may start while the child has threads it made
        // without `pthread_create` (glibc's timer threads); the copy of a lock one of them
        // held (the pool's) kept the writer spinning for good (review helper 146).
        crate::global::fork_prepare();
        let child = raw_fork();
        // In the middle process too: its one thread is the one that held them.
        crate::global::fork_parent();
        if child == 0 {
            crate::pool::force_unlock();
            // Named before the writer is forked, which takes the name: `kill(-1, ...)` tells
            // writers by their names, and one the program made just before such a call was
            // killed still named as the program (see `kill_all.rs`).
            // SAFETY: prctl names the calling thread from a NUL-terminated string.
            unsafe { libc::prctl(libc::PR_SET_NAME, c"mallocspy-trace".as_ptr()) };
            let writer = if subreaper { 0 } else { raw_fork() };
            if writer == 0 {
                self.serve(&header, proc_pid, trace_fd, first_name, header_write, its, ring);
            }
            // The middle process: its exit status is the error of the writer's fork (at the
            // user's process limit, `RLIMIT_NPROC`, the second fork of two may fail alone).
            leave_with(&[], (-writer).max(0));
        }
        // The short-lived middle process, our child, which only `__WALL` waits for (a thread
        // of the program's that waits for any child with it may reap it first: its status is
        // then unknown, and the writer taken to have started).
        let failed = match child {
            ..0 => -child,
            _ if subreaper => {
                CHILD_WRITER.store(child as u32, Ordering::Relaxed);
                0
            }
            _ => reap(child).unwrap_or(0),
        };
        if failed != 0 {
            let error = std::io::Error::from_raw_os_error(failed);
            return give_up(&[trace_fd, ours, its], format!("cannot start the trace writer: {error}"));
        }
        close(its);
        close(trace_fd);
        // Out of the way of the descriptors the program numbers from the bottom up, however
        // low its limit.
        let ours = kept_fd::move_high(ours);
        // SAFETY: fcntl on our own descriptor.
        unsafe { libc::fcntl(ours, libc::F_SETFL, libc::O_NONBLOCK) };
        WAKE.keep(ours);
        self.ring.store(ring as *const Ring as *mut Ring, Ordering::Release);
        self.traced_pid.store(header.pid, Ordering::Relaxed);
        Ok(ring)
    }

    /// At exit: the last statistics `stats` and the end message, then wait (bounded) for the
    /// writer to close its end. Returns whether this process had a trace to finish.
    pub(crate) fn finish(&self, stats: &HeapStats) -> bool {
        // A child that queued nothing yet still ends with its statistics.
        start_deferred(true);
        self.spy.set_ring(None);
        let fd = WAKE.take();
        // SAFETY: only `launch` stores here: null or a leaked ring.
        let Some(ring) = (unsafe { self.ring.swap(core::ptr::null_mut(), Ordering::AcqRel).as_ref() }) else {
            return false;
        };
        let finished = self.end_and_wait(fd, ring, stats);
        let lost = ring.dropped_total();
        let write_error = ring.write_error();
        if let Some((errno, written)) = write_error {
            let error = std::io::Error::from_raw_os_error(errno);
            // The events queued after it are lost for that, not for a writer that fell behind.
            let later = if lost > 0 { format!("; {lost} later trace event(s) were lost") } else { String::new() };
            sink::write(
                format!("mallocspy: the trace stops at byte {written}, where writing it failed: {error}{later}\n")
                    .as_bytes(),
            );
        }
        // Each said in one line: nothing said a writer stopped (SIGSTOP) for the program's last
        // ten seconds, nor a trace whose directory was removed (review helper 91).
        if lost > 0 && write_error.is_none() {
            sink::write(
                format!(
                    "mallocspy: {lost} trace event(s) were lost: the trace writer fell behind the program \
                     (the trace counts them)\n"
                )
                .as_bytes(),
            );
        }
        if !finished {
            sink::write(
                format!(
                    "mallocspy: the trace writer did not finish the trace within {} s (stopped, or killed?): \
                     it may end before the program's last events, without an end\n",
                    FINISH_WAIT_MS / 1000
                )
                .as_bytes(),
            );
        } else if ring.unlinked() {
            sink::write(b"mallocspy: the trace file was deleted while it was written (its directory removed?)\n");
        } else if ring.cut() {
            // Appended to after the cut, it starts mid-stream: no report reads it (review
            // helper 105).
            sink::write(
                b"mallocspy: the trace file was truncated while it was written (logrotate's copytruncate?): \
                  it no longer starts with its header, and cannot be read\n",
            );
        }
        true
    }

    /// Queues the last statistics and the end message, and waits (bounded) for the writer to
    /// have written them. Returns whether it did.
    fn end_and_wait(&self, fd: i32, ring: &Ring, stats: &HeapStats) -> bool {
        let stats = message::stats(stats);
        let end = message::end(self.spy.elapsed_ns());
        // A full queue: the writer is draining it. A second at most, for room for both
        // (each is pushed once: a push that finds no room counts as a lost event).
        let mut waited_ms = 0;
        let mut wait_for_room = |slots: usize| {
            while !ring.has_room(slots) && waited_ms < 1000 {
                waited_ms += 1;
                if WAKE.is(fd) {
                    os::send(fd, b"w", libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
                }
                os::pause_us(1000);
            }
        };
        wait_for_room(slots_for(stats.len()));
        ring.push(&stats, &[]);
        wait_for_room(1);
        ring.push_one(&end);
        // Done up to here: the end written (or dropped, and counted).
        let claimed = ring.claimed();
        if !WAKE.is(fd) {
            // The program closed our socket: the writer, nudged, drains the queue and marks
            // the end done once it is written.
            ring.nudge();
            let limit = (2 * self.interval_ms).clamp(1000, FINISH_WAIT_MS as u64);
            for _ in 0..limit {
                if ring.done(claimed) {
                    return true;
                }
                os::pause_us(1000);
            }
            return false;
        }
        ring.take_idle();
        // SAFETY: one byte to our own socket.
        unsafe { libc::send(fd, b"w".as_ptr().cast(), 1, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        let mut waited = 0;
        while waited < FINISH_WAIT_MS {
            let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            let ready = unsafe { libc::poll(&mut pfd, 1, 100) };
            if ready > 0 && program_gone(fd) {
                break;
            }
            waited += 100;
        }
        close(fd);
        // Not only gone: a writer killed leaves too, its socket closed by the kernel.
        ring.done(claimed)
    }

    /// After the program unloaded a library (`dlclose` succeeded): the writer reads the
    /// program's modules again at its next drain, for the unload record. Not waited for.
    pub(crate) fn after_unload(&self) {
        if let Some(ring) = self.ring() {
            ring.note_unloaded(self.spy.elapsed_ns());
        }
    }

    /// Before the program unmaps a library (`dlclose`): waits until the writer has dealt
    /// with every message queued so far, reading the program's modules again if a stack
    /// names code it does not know, while the library's code is still mapped. A second at
    /// most: a writer that does not answer by then is not waited for again.
    pub(crate) fn sync_before_unload(&self) {
        static UNRESPONSIVE: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);
        let Some(ring) = self.ring() else { return };
        let claimed = ring.claimed();
        if ring.done(claimed) || UNRESPONSIVE.load(Ordering::Relaxed) {
            return;
        }
        // Wake the writer even when it is not asleep: between two drains it waits on the
        // socket for up to `stats_interval_ms`.
        ring.take_idle();
        if !wake() {
            return;
        }
        // The writer usually catches up within tens of microseconds: yield the processor to it
        // for the first hundred, and only then sleep (a sleep takes a hundred at least).
        let start = os::monotonic_ns();
        while !ring.done(claimed) {
            let waited = os::monotonic_ns() - start;
            if waited > 1_000_000_000 {
                UNRESPONSIVE.store(true, Ordering::Relaxed);
                return;
            }
            if waited < 100_000 {
                os::yield_now();
            } else {
                os::pause_us(100);
            }
        }
    }

    /// Child side of `fork`: the parent's writer is the parent's; the child gets a writer and
    /// a trace of its own (without `%p` in the path, `PATH.PID`: see [`super::file`]), once it has
    /// something to put in it: at its first sample, the first free of a sampled block or its
    /// first heap statistics, before it starts a thread (the writer is forked from a process
    /// of one thread, as a rule), installs a seccomp filter (by `prctl`, or `seccomp`
    /// through `syscall`: it may forbid the calls that start it) or changes its user or root
    /// (which may refuse it the trace's directory: see `credentials.rs`), or at its exit. Not at the fork: a shell's child that
    /// `exec`s at once (every command of a script) waited for a writer that had nothing to
    /// write (0.3 ms, or 1 ms when the machine woke an idle processor for the middle
    /// process), and left its trace to be removed.
    pub(crate) fn after_fork_child(&'static self) {
        // The parent's writer waits for the parent's end alone to close.
        WAKE.release();
        self.ring.store(core::ptr::null_mut(), Ordering::Release);
        // The child ran its atfork handlers: it is set up here, its writer to come.
        process_mark::set_here();
        STARTING.store(0, Ordering::Relaxed);
        CHILD_WRITER.store(0, Ordering::Relaxed);
        DEFERRED.store(os::getpid(), Ordering::Release);
    }

    /// Starts a forked child's writer (see [`Writer::after_fork_child`]): its trace begins
    /// with the sampled blocks it inherited, from the nearest ancestor that has a trace.
    fn start_child(&'static self) {
        let parent = self.traced_pid.load(Ordering::Relaxed);
        match self.launch(true) {
            Ok(ring) => {
                self.spy.send_inherited(ring, parent);
                self.spy.set_ring(Some(ring));
            }
            Err(e) => {
                sink::to_stderr(format!("mallocspy: {e}; the child runs without a trace\n").as_bytes());
            }
        }
    }
}

/// Whether process `pid` still maps the queue at `address`: `false` once it has exited (a
/// zombie maps nothing) or `exec`'d. Read from `/proc/PID/maps`, or from a live thread's
/// when the main thread has left by `pthread_exit` (the process's own then reads empty).
fn maps_queue(pid: u32, address: usize) -> bool {
    let line_start = format!("{address:x}-");
    let holds = |path: &str| {
        std::fs::read(path)
            .ok()
            .filter(|m| !m.is_empty())
            .map(|m| m.split(|&c| c == b'\n').any(|line| line.starts_with(line_start.as_bytes())))
    };
    if let Some(found) = holds(&format!("/proc/{pid}/maps")) {
        return found;
    }
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks
        .filter_map(|t| t.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find_map(|tid| holds(&format!("/proc/{pid}/task/{tid}/maps")))
        .unwrap_or(false)
}

/// Whether the other end of `socket` closed (reading the wake-up bytes that came).
fn program_gone(socket: i32) -> bool {
    let mut buf = [0u8; 64];
    loop {
        // SAFETY: reads into a local buffer of its length.
        let n = unsafe { libc::recv(socket, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n == 0 {
            return true;
        }
        if n < 0 {
            return os::errno() != libc::EAGAIN && os::errno() != libc::EINTR;
        }
    }
}

/// Closes every descriptor but `keep`, and points 0, 1 and 2 at /dev/null.
fn keep_only(keep: &[i32]) {
    if !close_all_but(keep) {
        close_listed_but(keep);
    }
    // SAFETY: opening /dev/null and duplicating it onto the standard descriptors.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for std_fd in 0..3 {
                if !keep.contains(&std_fd) {
                    libc::dup2(null, std_fd);
                }
            }
            if null > 2 {
                libc::close(null);
            }
        }
    }
}

/// Closes every descriptor but `keep` (at most two) with `close_range` (Linux 5.9), which
/// allocates nothing: the C library's `opendir` does, and a writer forked from a child with
/// threads may find the C library's heap locked by one of them. False if the kernel lacks it.
fn close_all_but(keep: &[i32]) -> bool {
    let mut kept = [-1; 2];
    if keep.len() > kept.len() {
        return false;
    }
    kept[..keep.len()].copy_from_slice(keep);
    kept.sort_unstable();
    let mut from = 0u32;
    for &fd in kept.iter().filter(|&&fd| fd >= 0) {
        let fd = fd as u32;
        // SAFETY: close_range closes descriptors of this process only.
        if fd > from && unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0) } != 0 {
            return false;
        }
        from = fd + 1;
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0) == 0 }
}

/// [`close_all_but`] by the list in `/proc/self/fd`, on an older kernel.
fn close_listed_but(keep: &[i32]) {
    let open: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    for fd in open {
        if !keep.contains(&fd) {
            close(fd);
        }
    }
}

/// Starts the process's writer for `spy` into `template` (`%p` = pid). On success the spy
/// queues its messages for it.
pub(crate) fn start(
    spy: &'static TickSpy,
    template: &str,
    owner: u32,
    options: &str,
    stats_interval_ms: u64,
) -> Result<&'static Writer, String> {
    let header = Header {
        pid: os::getpid(),
        command: command_line(),
        options: options.to_string(),
        sampling: spy.config.sampling,
        interval: spy.config.interval,
        stats_interval_ms,
        start_unix_ns: 0,
        pid_namespace: 0,
        process_start_ticks: 0,
    };
    let writer = Writer {
        spy,
        template: template.to_string(),
        owner,
        header,
        interval_ms: stats_interval_ms.max(1),
        ring: AtomicPtr::new(core::ptr::null_mut()),
        traced_pid: AtomicU32::new(0),
    };
    let writer: &'static Writer = Box::leak(Box::new(writer));
    if WRITER.set(writer).is_err() {
        return Err("a trace writer already runs".into());
    }
    let ring = writer.launch(false)?;
    spy.set_ring(Some(ring));
    Ok(writer)
}
