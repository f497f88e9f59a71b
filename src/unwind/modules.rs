//! The loaded modules and where their unwind tables are, for the unwinder's misses.
//!
//! Built with `dl_iterate_phdr` from each module's program headers: the executable segment
//! (code) and `PT_GNU_EH_FRAME` (`.eh_frame_hdr`, whose binary-search table leads to the FDE
//! of an address in `.eh_frame`). The list is immutable once published; a refresh after a
//! `dlopen` publishes a new one and leaks the old one (a few hundred bytes per refresh), so
//! that readers never wait and never see a freed list.

use crate::os;
use core::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

/// One loaded module's code and unwind tables (addresses as mapped).
#[derive(Clone, Copy)]
pub(crate) struct Module {
    /// Executable range.
    pub text: (u64, u64),
    /// `.eh_frame_hdr`, as mapped.
    pub eh_frame_hdr: (u64, u64),
    /// `.eh_frame` from its start to the end of the segment holding it (the header gives
    /// its start, not its length; FDEs are found by offset, so a longer view is harmless).
    pub eh_frame: (u64, u64),
}

/// The published module list, sorted by text start.
pub(crate) struct Modules {
    pub list: Vec<Module>,
    /// Bumped on every refresh: unwind rules cached under an older generation are stale.
    pub generation: u32,
    /// The loader's counts of objects loaded and unloaded when the list was read.
    pub loader_counts: (u64, u64),
}

static CURRENT: AtomicPtr<Modules> = AtomicPtr::new(core::ptr::null_mut());
static GENERATION: AtomicU32 = AtomicU32::new(0);

/// Reads `.eh_frame_hdr`'s `eh_frame_ptr` (always `DW_EH_PE_pcrel | DW_EH_PE_sdata4` on Linux).
///
/// # Safety
/// `hdr` is the address of a mapped `.eh_frame_hdr`.
unsafe fn eh_frame_from_hdr(hdr: u64) -> Option<u64> {
    let h = hdr as *const u8;
    // SAFETY: the header's first 8 bytes are mapped (version, 3 encodings, the pointer).
    let (version, encoding, rel) = unsafe { (*h, *h.add(1), (h.add(4) as *const i32).read_unaligned()) };
    (version == 1 && encoding == 0x1b).then(|| (hdr as i64 + 4 + rel as i64) as u64)
}

/// The unwind facts of a loaded module: its code and its `.eh_frame_hdr` and `.eh_frame`.
fn unwind_module(m: &os::LoadedModule) -> Option<Module> {
    let in_memory = |ph: &libc::Elf64_Phdr, len: u64| (m.bias + ph.p_vaddr, m.bias + ph.p_vaddr + len);
    let text = m.segments(libc::PF_X).last()?;
    let hdr = m.headers.iter().rfind(|ph| ph.p_type == libc::PT_GNU_EH_FRAME).map(|ph| in_memory(ph, ph.p_memsz))?;
    // SAFETY: PT_GNU_EH_FRAME is mapped.
    let eh_frame = unsafe { eh_frame_from_hdr(hdr.0) }?;
    // `.eh_frame` runs to the end of the file's part of the segment that holds it.
    let (_, end) = m
        .headers
        .iter()
        .filter(|ph| ph.p_type == libc::PT_LOAD)
        .map(|ph| in_memory(ph, ph.p_filesz))
        .find(|&(start, end)| start <= eh_frame && eh_frame < end)?;
    Some(Module { text, eh_frame_hdr: hdr, eh_frame: (eh_frame, end) })
}

/// Re-reads the module list (after a `dlopen`, or the first time). May allocate: call it
/// where allocations go to the real allocator (inside a hook, or at start-up).
///
/// In the child of a `fork` whose loader no longer answers ([`crate::loader`]), the list
/// stays as the parent left it: code loaded since is not unwound through.
pub(crate) fn refresh() -> &'static Modules {
    let mut list: Vec<Module> = Vec::with_capacity(64);
    // Before the list: a library loaded in between makes the next look read it again.
    let loader_counts = os::objects_loaded_and_unloaded();
    if crate::loader::usable() {
        os::each_module(|m| {
            list.extend(unwind_module(m));
            false
        });
    } else {
        // SAFETY: a published list is never freed.
        if let Some(kept) = unsafe { CURRENT.load(Ordering::Acquire).as_ref() } {
            return kept;
        }
    }
    list.sort_by_key(|m| m.text.0);
    let generation = GENERATION.fetch_add(1, Ordering::Relaxed) + 1;
    let fresh = Box::into_raw(Box::new(Modules { list, generation, loader_counts }));
    // The old list stays allocated: other threads may be reading it.
    CURRENT.store(fresh, Ordering::Release);
    // SAFETY: just published, never freed.
    unsafe { &*fresh }
}

/// The current module list (read on the first use of the unwinder).
pub(crate) fn current() -> &'static Modules {
    // SAFETY: a published list is never freed.
    match unsafe { CURRENT.load(Ordering::Acquire).as_ref() } {
        Some(m) => m,
        None => refresh(),
    }
}

impl Modules {
    /// Whether the loader has loaded or unloaded something since the list was read: an
    /// address outside every module may then be in a new one. Code that no module holds (a
    /// JIT's) is found outside at every walk: read the list again each time, and node's
    /// walks through its JIT frames (by their frame pointers) hung for minutes.
    pub(crate) fn stale(&self) -> bool {
        crate::loader::usable() && os::objects_loaded_and_unloaded() != self.loader_counts
    }

    /// The module whose code contains `pc`.
    pub(crate) fn find(&self, pc: u64) -> Option<&Module> {
        let i = self.list.partition_point(|m| m.text.0 <= pc);
        let m = self.list.get(i.checked_sub(1)?)?;
        (pc < m.text.1).then_some(m)
    }
}
