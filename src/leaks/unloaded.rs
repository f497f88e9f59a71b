//! Libraries unloaded while the leak tracker ran, so that the report still names their code.
//!
//! The report symbolizes stacks when it is written, from the modules loaded then. A block
//! allocated by a plugin that was `dlclose`d since keeps return addresses into a range that is
//! unmapped, or mapped by another library by then: they read as `??`, or as the wrong
//! library's functions. So the `dlclose` wrapper notes each library that a call really
//! unloads (its path, load bias and code range) with the id the next interned stack will get
//! (not only the library the handle names: every one loaded when the call began and gone when
//! it ended, the ones it alone needed and those whose `dlclose` from a destructor only dropped
//! a reference, the outer call unloading them; unless a call on another thread overlapped it):
//! a frame of an earlier stack that lies in that range is the unloaded library's, and is read
//! from its file. heaptrack records module loads and unloads in its trace for the same reason.
//!
//! Two threads may unload libraries from one place at once, one loading where the other's
//! was: the list is kept in the order in which the calls began (each notes its library
//! before its `dlclose`, while the library is still where it was), not the order in which
//! they ended, so that the first entry that covers a frame is the library that was there.
//!
//! The list's lock is held across `fork` (taken in the prepare handler), so that a child
//! never inherits it held, nor the list half changed, by a thread that does not exist there:
//! the child's report reads the list.

use core::cell::UnsafeCell;
use core::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::os::{self, ModuleCode};
use crate::sync::SpinLock;

/// A library that was unloaded.
#[derive(Clone, Debug)]
pub(crate) struct Unloaded {
    /// Its path, as the loader named it.
    pub path: Arc<str>,
    /// Its load bias: the file address of a code address is `address - bias`.
    pub bias: u64,
    /// Its executable segments' extent.
    start: u64,
    end: u64,
    /// Stacks interned before the unload have ids below this.
    stacks_before: u32,
    /// Its `dlclose` call's place in the order in which they began.
    begun: u64,
}

/// The unloads so far, and the `dlclose` calls in flight.
struct Unloads {
    /// The libraries unloaded, in the order their `dlclose` calls began.
    libraries: Vec<Unloaded>,
    /// Their paths, each once (a plugin reloaded in a loop has many entries).
    paths: Vec<Arc<str>>,
    /// How many calls have begun: the next one's place in that order.
    begun: u64,
    /// The calls that noted their library and have not yet said what became of it: where
    /// each began, and its library's code.
    in_flight: Vec<InFlight>,
}

/// A `dlclose` call under way.
struct InFlight {
    begun: u64,
    start: u64,
    end: u64,
    /// Its thread (`pthread_self`).
    thread: usize,
    /// Whether a call on another thread began while it was under way.
    overlapped: bool,
}

/// The unloads, under their lock.
struct List {
    lock: SpinLock,
    unloads: UnsafeCell<Unloads>,
}

// SAFETY: `unloads` is only reached through `List::locked` and `List::try_locked`, under `lock`.
unsafe impl Sync for List {}

static UNLOADED: List = List {
    lock: SpinLock::new(),
    unloads: UnsafeCell::new(Unloads { libraries: Vec::new(), paths: Vec::new(), begun: 0, in_flight: Vec::new() }),
};

impl List {
    /// Runs `f` on the unloads under their lock.
    fn locked<T>(&self, f: impl FnOnce(&mut Unloads) -> T) -> T {
        let _guard = self.lock.lock();
        // SAFETY: the lock is held: no other reference to the unloads exists.
        f(unsafe { &mut *self.unloads.get() })
    }

    /// Runs `f` on the unloads under their lock, unless the calling thread holds it already.
    fn try_locked<T>(&self, f: impl FnOnce(&mut Unloads) -> T) -> Option<T> {
        let _guard = self.lock.try_lock().ok()?;
        // SAFETY: the lock is held: no other reference to the unloads exists.
        Some(f(unsafe { &mut *self.unloads.get() }))
    }
}

/// Whether the prepare handler took the lock (not when the forking thread held it already:
/// a signal handler that forked, whose thread releases it when the handler returns).
static TAKEN_FOR_FORK: AtomicBool = AtomicBool::new(false);

/// `fork`'s prepare handler: waits for a change of the list in progress, and holds the lock.
pub(crate) fn fork_prepare() {
    if let Ok(guard) = UNLOADED.lock.try_lock() {
        core::mem::forget(guard);
        TAKEN_FOR_FORK.store(true, Ordering::Relaxed);
    }
}

/// `fork`'s parent and child handlers: releases the lock the prepare handler took.
pub(crate) fn fork_release() {
    if TAKEN_FOR_FORK.swap(false, Ordering::Relaxed) {
        UNLOADED.lock.force_unlock();
    }
}

/// `fork`'s child handler, after [`fork_release`]: the calls in flight on other threads will
/// never end here. Not when the forking thread holds the lock (a signal handler that forked
/// inside a change of the list): they stay, and only keep later unloads from being merged.
pub(crate) fn fork_child() {
    UNLOADED.try_locked(|unloads| unloads.in_flight.clear());
}

/// At most this many unloads are remembered (plugins unloaded in turn from one place, in a
/// loop: each unload is an entry; a plugin reloaded alone counts once).
const MAX_UNLOADED: usize = 16_384;

/// Unloads past [`MAX_UNLOADED`], not remembered.
static FORGOTTEN: AtomicUsize = AtomicUsize::new(0);

/// A `dlclose` call under way: its library, and every one loaded when it began.
pub(crate) struct Closing {
    begun: u64,
    stacks_before: u32,
    /// The library of the handle (by its place in `loaded`).
    library: usize,
    loaded: Vec<ModuleCode>,
    /// The path, as the kernel's map names it, of each of `loaded` that the loader names by a
    /// relative one (`dlopen("./plugin.so")`): that one opens nothing at exit once the program
    /// has changed directory (review helper 77).
    absolute: Vec<Option<String>>,
    /// Whether no call on another thread was under way when this one began.
    began_alone: bool,
}

/// Notes the library behind `handle`, and the libraries `loaded` with it, before `dlclose`
/// runs (their headers are gone after).
pub(crate) fn before_dlclose(
    handle: *mut libc::c_void,
    loaded: Vec<ModuleCode>,
    next_stack_id: u32,
) -> Option<Closing> {
    let mut map: *mut libc::c_void = core::ptr::null_mut();
    // SAFETY: RTLD_DI_LINKMAP writes the handle's `struct link_map *` into `map`; a bad handle
    // makes it fail (dlclose will then fail too).
    if handle.is_null() || unsafe { libc::dlinfo(handle, libc::RTLD_DI_LINKMAP, (&raw mut map).cast()) } != 0 {
        return None;
    }
    // SAFETY: glibc's link_map starts with `l_addr` (the load bias) and `l_name`.
    let (bias, name) = unsafe { (*(map as *const u64), *(map as *const *const libc::c_char).add(1)) };
    if name.is_null() {
        return None;
    }
    // SAFETY: the loader's NUL-terminated name of a loaded library.
    let name = unsafe { std::ffi::CStr::from_ptr(name) };
    let library = loaded.iter().position(|m| m.bias == bias && m.name.as_c_str() == name)?;
    let (start, end) = (loaded[library].start, loaded[library].end);
    // SAFETY: pthread_self has no preconditions.
    let thread = unsafe { libc::pthread_self() } as usize;
    let (begun, began_alone) = UNLOADED.locked(|unloads| {
        unloads.begun += 1;
        let mut alone = true;
        for other in unloads.in_flight.iter_mut().filter(|c| c.thread != thread) {
            other.overlapped = true;
            alone = false;
        }
        unloads.in_flight.push(InFlight { begun: unloads.begun, start, end, thread, overlapped: false });
        (unloads.begun, alone)
    });
    let absolute = loaded
        .iter()
        .map(|m| {
            let relative = !m.name.is_empty() && !m.name.as_bytes().starts_with(b"/");
            relative.then(|| super::symbols::mapped_file(m.start)).flatten()
        })
        .collect();
    Some(Closing { begun, stacks_before: next_stack_id, library, loaded, absolute, began_alone })
}

/// After `dlclose`: remembers the libraries it unloaded, if it unloaded any (`unloaded`: a
/// `dlclose` mostly drops a reference). `loaded` is what is loaded now (`None`: not known,
/// each library is looked for). By name as well as place: another thread may have loaded
/// another library where one was meanwhile (whose code then read as this one's, or this
/// one's as it).
///
/// The handle's library, if it is gone; with it, the other libraries gone since the call
/// began, if no call on another thread was under way meanwhile (that one may have unloaded
/// them, and only it knows what was there before). A `dlclose` from a destructor that this
/// call runs is on this thread: it leaves its library to this call to unload.
pub(crate) fn after_dlclose(closing: Closing, unloaded: bool, loaded: Option<&[ModuleCode]>) {
    let is_gone = |m: &ModuleCode| match loaded {
        Some(loaded) => !loaded.iter().any(|l| l.bias == m.bias && l.name == m.name),
        None => !os::is_loaded(m.bias, &m.name),
    };
    let Closing { begun, stacks_before, library, loaded: before, absolute, began_alone } = closing;
    // Before the list's lock: `is_loaded` takes the loader's, which a `dlclose` from a
    // destructor holds while it waits for the list's. The program (no name) is never unloaded.
    let gone: Vec<(usize, &ModuleCode)> = match unloaded {
        true => before.iter().enumerate().filter(|(_, m)| !m.name.is_empty() && is_gone(m)).collect(),
        false => Vec::new(),
    };
    UNLOADED.locked(|Unloads { libraries: list, paths, in_flight, .. }| {
        let overlapped = match in_flight.iter().position(|c| c.begun == begun) {
            Some(i) => in_flight.swap_remove(i).overlapped,
            None => true,
        };
        let alone = began_alone && !overlapped;
        for &(i, m) in gone.iter().filter(|&&(i, _)| i == library || alone) {
            let there = |start: u64, end: u64| start < m.end && m.start < end;
            let at = list.iter().rposition(|u| u.begun < begun).map_or(0, |i| i + 1);
            // The same library unloaded from where it was before, with nothing else unloaded
            // from there since (a plugin reloaded in a loop): its entry names the stacks
            // interned until this unload too. Each unload had an entry of its own, and past
            // the limit a reloaded plugin's leaks read as `??`. Not once an unload was
            // forgotten: it may have been from there (its stacks were named after the library
            // unloaded next); nor while a call that began before this one, of a library that
            // was there, is in flight: it will be listed before this one.
            let merge = FORGOTTEN.load(Ordering::Relaxed) == 0
                && !in_flight.iter().any(|c| c.begun < begun && there(c.start, c.end));
            let path = absolute[i].as_deref().map_or_else(|| m.name.to_string_lossy(), std::borrow::Cow::Borrowed);
            let last_there = list[..at].iter_mut().rev().find(|u| there(u.start, u.end));
            if let Some(last) = last_there.filter(|_| merge)
                && (&*last.path, last.bias, last.start, last.end) == (&*path, m.bias, m.start, m.end)
            {
                last.stacks_before = stacks_before;
            } else if list.len() < MAX_UNLOADED {
                let path = match paths.iter().find(|p| ***p == *path) {
                    Some(p) => p.clone(),
                    None => {
                        paths.push(Arc::from(&*path));
                        paths[paths.len() - 1].clone()
                    }
                };
                list.insert(at, Unloaded { path, bias: m.bias, start: m.start, end: m.end, stacks_before, begun });
            } else {
                FORGOTTEN.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
}

/// What the leak report says when unloads were not remembered, if any were not.
pub(crate) fn forgotten_note() -> Option<String> {
    let forgotten = FORGOTTEN.load(Ordering::Relaxed);
    (forgotten > 0).then(|| {
        format!(
            "{forgotten} library unload(s) past the first {MAX_UNLOADED} were not remembered: frames in code \
             they unmapped may read as ??"
        )
    })
}

/// The unloaded library that frame `address` of stack `stack` was in, if any: the first one
/// unloaded after the stack was interned whose code covered the address.
pub(crate) fn covering(stack: u32, address: u64) -> Option<Unloaded> {
    UNLOADED.locked(|unloads| {
        unloads.libraries.iter().find(|u| stack < u.stacks_before && u.start <= address && address < u.end).cloned()
    })
}
