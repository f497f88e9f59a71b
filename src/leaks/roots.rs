//! Where the program keeps its pointers: the writable data of every loaded module, and each
//! thread's registers, stack and static TLS, read while the other threads are stopped
//! (`stop.rs`), so that what the scan reads is one moment of the program.

use core::ffi::c_void;

use super::kept;
use super::scan::{FileKind, Memory};
use crate::os;

/// A range of the address space.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mapping {
    pub start: u64,
    pub end: u64,
    pub readable: bool,
    /// Writable memory not special (`[heap]`, `[stack]`, ...) nor a device's: what a program
    /// maps for itself (arenas, caches, dead threads' stacks, shared memory), a writable
    /// mapping of a file (a module's data segment among them), or an allocator's heap; see
    /// [`data`].
    pub writable_data: bool,
    /// The main arena's heap (`[heap]`, after the program's data: what `brk` grows).
    pub brk_heap: bool,
    /// What a file mapped read-only holds: constants and vtables (`.rodata`, and
    /// `.data.rel.ro` once relocated), or code.
    pub file: FileKind,
}

/// `/proc/thread-self/maps`, read without allocating into buffers reserved beforehand.
/// (`/proc/self/maps` reads empty once the main thread has called `pthread_exit`.)
pub(crate) struct Maps {
    text: Vec<u8>,
    pub list: Vec<Mapping>,
    /// The main thread's stack (`[stack]`), which is not anonymous data.
    pub main_stack: Option<(u64, u64)>,
}

pub(super) fn parse_hex(s: &[u8]) -> Option<u64> {
    let mut v: u64 = 0;
    for &c in s {
        let d = (c as char).to_digit(16)?;
        v = v.checked_mul(16)?.checked_add(d as u64)?;
    }
    Some(v)
}

/// Whether a writable mapping of this path (as the map names it) is data a program may keep
/// pointers in: memory it got for itself (no path, a name given with `PR_SET_VMA_ANON_NAME`,
/// private or shared, shared anonymous memory `/dev/zero (deleted)`, a System V segment, a
/// memfd), or a file's, POSIX shared memory (`/dev/shm`) included. Not a device's (a GPU's
/// buffers, a frame buffer), whose reads may do something: memcheck leaves those out too.
fn data(path: &[u8]) -> bool {
    const KINDS: [&[u8]; 5] = [b"[anon:", b"[anon_shmem:", b"/dev/zero", b"/SYSV", b"/memfd:"];
    path.is_empty()
        || KINDS.iter().any(|kind| path.starts_with(kind))
        || path.starts_with(b"/") && (!path.starts_with(b"/dev/") || path.starts_with(b"/dev/shm/"))
}

impl Maps {
    /// Buffers sized for the current map, with room to grow.
    pub(crate) fn reserve() -> Self {
        let len = std::fs::read("/proc/thread-self/maps").map_or(64 << 10, |t| t.len());
        Self {
            text: Vec::with_capacity(len * 2 + 4096),
            list: Vec::with_capacity(len / 40 * 2 + 256),
            main_stack: None,
        }
    }

    /// Re-reads the map into the reserved buffers (what does not fit is dropped, which only
    /// makes less memory readable). Raw system calls: safe while other threads are stopped.
    /// When `/proc` cannot be opened, reads the map [`kept`] from the start; the `errno` of
    /// the open when neither gives a map.
    pub(crate) fn read(&mut self) -> Result<(), i32> {
        self.text.clear();
        self.list.clear();
        self.main_stack = None;
        let fd = os::open(c"/proc/thread-self/maps", libc::O_RDONLY | libc::O_CLOEXEC);
        let (fd, owned) = match fd {
            -1 => {
                let refused = os::errno();
                (kept::map().ok_or(refused)?, false)
            }
            fd => (fd, true),
        };
        let mut refused = libc::EIO;
        loop {
            let room = self.text.capacity() - self.text.len();
            if room == 0 {
                break;
            }
            let at = self.text.len();
            // SAFETY: writes at most `room` bytes into the reserved, unused tail; a read from
            // offset 0 starts the map over (the kept descriptor has been read before).
            let n = unsafe { libc::pread(fd, self.text.as_mut_ptr().add(at).cast(), room, at as libc::off_t) };
            if n <= 0 {
                refused = if n < 0 { os::errno() } else { refused };
                break;
            }
            // SAFETY: pread(2) initialised n more bytes.
            unsafe { self.text.set_len(at + n as usize) };
        }
        if owned {
            os::close(fd);
        }
        if self.text.is_empty() {
            return Err(refused);
        }
        for line in self.text.split(|&c| c == b'\n') {
            if self.list.len() == self.list.capacity() {
                break;
            }
            let mut fields = line.split(|&c| c == b' ');
            let (Some(range), Some(perms)) = (fields.next(), fields.next()) else { continue };
            let Some(dash) = range.iter().position(|&c| c == b'-') else { continue };
            let (Some(start), Some(end)) = (parse_hex(&range[..dash]), parse_hex(&range[dash + 1..])) else { continue };
            // [vvar] and friends are readable in name only.
            let special = line.ends_with(b"[vvar]") || line.ends_with(b"[vvar_vclock]");
            let readable = perms.first() == Some(&b'r') && !special;
            // Fields after the permissions: offset, device, inode, then the path if any.
            let path = fields.filter(|f| !f.is_empty()).nth(3).unwrap_or(b"");
            let writable = perms.get(1) == Some(&b'w');
            let writable_data = readable && writable && data(path);
            if path == b"[stack]" {
                self.main_stack = Some((start, end));
            }
            let file = match (readable && !writable && path.starts_with(b"/"), perms.get(2) == Some(&b'x')) {
                (true, true) => FileKind::Code,
                (true, false) => FileKind::Constants,
                (false, _) => FileKind::Other,
            };
            let brk_heap = readable && writable && path == b"[heap]";
            self.list.push(Mapping { start, end, readable, writable_data, brk_heap, file });
        }
        Ok(())
    }

    /// The end of the readable mapping holding `addr`. (Thread stacks are one mapping each,
    /// stack and thread control block; neighbouring mappings are someone else's.)
    pub(crate) fn end_of(&self, addr: u64) -> Option<u64> {
        self.extent_of(addr).map(|(_, end)| end)
    }

    /// The start and end of the readable mapping holding `addr`.
    pub(crate) fn extent_of(&self, addr: u64) -> Option<(u64, u64)> {
        let m = self.list.get(self.list.partition_point(|m| m.end <= addr))?;
        (m.start <= addr && m.readable).then_some((m.start, m.end))
    }
}

/// Data mappings to scan as roots, as memcheck scans the memory a program maps for itself
/// (GCC's garbage-collected pages and Python's arenas hold pointers to heap blocks, and so
/// may a file or shared memory mapped writable; see [`data`]). Left out: mappings holding a
/// live block (an allocator's heap: its free chunks are not roots), mallocspy's own memory (its
/// spare stack included), the mappings of live threads' stacks (scanned from
/// their stack pointers only: what lies below is dead frames), the stacks glibc keeps of
/// exited threads (`exited`: a stack pointer of each, sorted, outside the program's own mappings;
/// what is left there is stale, and memcheck calls a block held only there lost), and the
/// zero-filled tails (`.bss`) of the modules' data segments, which are
/// module data: scanned as such, or mallocspy's own (800 KiB of it, read word by word in
/// every report, made `/bin/true`'s exit report cost a millisecond).
///
/// The kernel merges neighbouring anonymous mappings: of one left out, the parts the program
/// mapped itself (`noted.program`: see [`crate::program_mappings`]) are still roots when
/// they hold no block. What an allocator preloaded after mallocspy mapped inside its calls
/// (`noted.allocator`) is its heap, whether it holds a block or its metadata.
///
/// `heaps_too`: the allocator's heaps are roots as well, when some blocks were not tracked
/// (`max_memory` reached): a block reachable only through one of those would otherwise be
/// called lost (review helper 91). Every pointer in the heap then keeps a block, a stale one
/// in a free chunk or one in a lost block included: only what nothing points to is lost.
#[allow(clippy::too_many_arguments)]
pub(crate) fn anonymous_roots(
    maps: &Maps,
    heaps_too: bool,
    block_starts: &[u64],
    stack_pointers: &[u64],
    modules: &ModuleData,
    noted: &crate::program_mappings::Snapshot,
    exited: &[u64],
    out: &mut Vec<(u64, u64)>,
) {
    let program = &noted.program[..];
    let allocators = |start: u64, end: u64| {
        let first = noted.allocator.partition_point(|r| r.1 <= start);
        noted.allocator.get(first).is_some_and(|r| r.0 < end)
    };
    // A stack glibc freed may have been reused by the program for a mapping of its own.
    let in_program = |sp: u64| program.get(program.partition_point(|r| r.1 <= sp)).is_some_and(|r| r.0 <= sp);
    let root = |start: u64, end: u64| {
        let holds_block = block_starts.get(block_starts.partition_point(|&b| b < start)).is_some_and(|&b| b < end);
        let holds_stack = stack_pointers.iter().any(|&sp| start <= sp && sp < end);
        let exited_stack = exited[exited.partition_point(|&sp| sp < start)..]
            .iter()
            .take_while(|&&sp| sp < end)
            .any(|&sp| !in_program(sp));
        let module_data =
            modules.roots.iter().chain(&modules.allocator).chain(&modules.own).any(|&(s, e)| start < e && s < end);
        let heap = holds_block || allocators(start, end) || glibc_thread_heap(maps, start, end);
        (!heap || heaps_too)
            && !holds_stack
            && !exited_stack
            && !module_data
            && !crate::pool::owns(start, end)
            && !crate::spare_stack::owns(start, end)
            && !os::owns_shared(start as usize, end as usize)
    };
    for m in maps.list.iter().filter(|m| m.writable_data || heaps_too && m.brk_heap) {
        if root(m.start, m.end) {
            if out.len() < out.capacity() {
                out.push((m.start, m.end));
            }
            continue;
        }
        let first = program.partition_point(|r| r.1 <= m.start);
        for &(s, e) in program[first..].iter().take_while(|r| r.0 < m.end) {
            let (s, e) = (s.max(m.start), e.min(m.end));
            if s < e && root(s, e) && out.len() < out.capacity() {
                out.push((s, e));
            }
        }
    }
}

/// The reach of a heap of one of glibc's arenas for threads (`HEAP_MAX_SIZE` on 64-bit),
/// which is mapped at a multiple of it.
const GLIBC_HEAP_MAX: u64 = 64 << 20;

/// Whether the writable mapping `[start, end)` is a heap of one of glibc's arenas for threads,
/// which glibc maps for itself: one whose blocks were all freed holds no live block to leave
/// it out by, and as a root its free chunks' stale pointers kept blocks leaked since
/// "reachable" (review helper 83). glibc reserves such a heap whole, inaccessible, and makes
/// its start writable as it grows: the rest of the reservation follows the mapping. It starts
/// with glibc's `heap_info`: its arena (in this heap or another, just after that one's
/// `heap_info`), the previous heap (0 or another such heap), its size, and the size made
/// writable, which the mapping is.
fn glibc_thread_heap(maps: &Maps, start: u64, end: u64) -> bool {
    let reserved = start + GLIBC_HEAP_MAX;
    if !start.is_multiple_of(GLIBC_HEAP_MAX) || end > reserved {
        return false;
    }
    let rest = maps.list.get(maps.list.partition_point(|m| m.start < end));
    if end < reserved && !rest.is_some_and(|m| m.start == end && m.end <= reserved && !m.readable) {
        return false;
    }
    let mut header = [0u64; 4];
    let read = match ProcessMemory::read_chunk(&mut header, start, start + 32) {
        Some(n) => n == header.len(),
        None => {
            // SAFETY: a readable anonymous mapping of at least a page: its first 32 bytes.
            header = unsafe { core::ptr::read_volatile(start as *const [u64; 4]) };
            true
        }
    };
    let [arena, previous, size, writable] = header;
    read && arena != 0
        && arena % GLIBC_HEAP_MAX < 0x100
        && previous.is_multiple_of(GLIBC_HEAP_MAX)
        && size <= writable
        && writable == end - start
}

/// Process memory, read only where the map says it is readable. Root regions are read
/// through `process_vm_readv` into a buffer: a page the map calls readable may still fault
/// (a file mapping past the end of its truncated file, a region a runtime such as valgrind
/// keeps from its client), and the kernel reports that as a short read instead of a signal.
/// Blocks are read directly: they are heap memory, and one system call per block would
/// cost seconds for a million blocks. Where the call is refused (a seccomp filter), roots
/// are read directly too.
///
/// Pages never touched are skipped: a program may map gigabytes it never uses (a 16 GiB
/// `MAP_NORESERVE` reservation took 12.7 s to read), and such a page reads as zeros. Where
/// a range is long, `/proc/self/pagemap` says which pages are present or swapped out; the
/// others are not read.
pub(crate) struct ProcessMemory<'a> {
    maps: &'a Maps,
    buffer: core::cell::RefCell<Vec<u64>>,
    direct: core::cell::Cell<bool>,
    /// The other threads run again ([`ProcessMemory::others_run`]): nothing is read directly.
    others_run: core::cell::Cell<bool>,
    /// `/proc/self/pagemap`, or -1.
    pagemap: i32,
    pages: core::cell::RefCell<Vec<u64>>,
    /// The readable mapping that held the last block read: the next block is mostly in it
    /// too, which spares a search of the map per block (a million blocks, a million
    /// searches).
    block_mapping: core::cell::Cell<(u64, u64)>,
}

/// Words read per `process_vm_readv` call: the length of [`ScanBuffers::words`].
const CHUNK_WORDS: usize = 8192;
/// Pagemap entries read per `pread`: the length of [`ScanBuffers::pages`] (32 MiB of
/// address space).
const PAGEMAP_ENTRIES: usize = 8192;
const PAGE: u64 = 4096;
/// Ranges shorter than this are read whole, without asking which pages are populated.
const SPARSE_MIN: u64 = 64 * PAGE;
/// Pagemap entry bits: the page is in memory, or in swap.
const PAGE_PRESENT: u64 = 1 << 63;
const PAGE_SWAPPED: u64 = 1 << 62;

/// The buffers a scan reads through, to allocate before the other threads are stopped
/// (allocating while they are could wait for a lock one of them holds).
pub(crate) struct ScanBuffers {
    words: Vec<u64>,
    pages: Vec<u64>,
}

impl<'a> ProcessMemory<'a> {
    /// The other threads run again: a block may be freed and unmapped from here on, so blocks
    /// are read through `process_vm_readv` only (a page gone reads as nothing), and not at all
    /// where the call is refused.
    pub(crate) fn others_run(&self) {
        self.others_run.set(true);
    }

    /// The read buffers.
    pub(crate) fn buffers() -> ScanBuffers {
        ScanBuffers { words: vec![0; CHUNK_WORDS], pages: vec![0; PAGEMAP_ENTRIES] }
    }

    /// Reads through `buffers` where `maps` allows.
    pub(crate) fn new(maps: &'a Maps, buffers: ScanBuffers) -> Self {
        // SAFETY: a NUL-terminated path; the descriptor is closed on drop.
        let pagemap = unsafe { libc::open(c"/proc/thread-self/pagemap".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        Self {
            maps,
            buffer: core::cell::RefCell::new(buffers.words),
            direct: core::cell::Cell::new(false),
            others_run: core::cell::Cell::new(false),
            pagemap,
            pages: core::cell::RefCell::new(buffers.pages),
            block_mapping: core::cell::Cell::new((0, 0)),
        }
    }

    /// Calls `read(from, to)` on the parts of `[from, to)` whose pages are populated (present
    /// or swapped out): on all of it when it is short or the pagemap cannot be read.
    fn populated(&self, from: u64, to: u64, read: &mut dyn FnMut(u64, u64)) {
        if self.pagemap < 0 || to - from < SPARSE_MIN {
            return read(from, to);
        }
        let mut entries = self.pages.borrow_mut();
        let (mut page, end_page) = (from / PAGE, to.div_ceil(PAGE));
        let mut run: Option<u64> = None;
        let mut flush = |run: &mut Option<u64>, until: u64| {
            if let Some(start) = run.take() {
                read((start * PAGE).max(from), (until * PAGE).min(to));
            }
        };
        while page < end_page {
            let want = entries.len().min((end_page - page) as usize);
            // SAFETY: reads at most `want` entries into the buffer, which holds that many.
            let got = unsafe { libc::pread(self.pagemap, entries.as_mut_ptr().cast(), want * 8, (page * 8) as i64) };
            if got < 8 {
                // Unreadable from here on: read the rest whole.
                run.get_or_insert(page);
                break;
            }
            for (k, &entry) in entries[..got as usize / 8].iter().enumerate() {
                let p = page + k as u64;
                if entry & (PAGE_PRESENT | PAGE_SWAPPED) != 0 {
                    run.get_or_insert(p);
                } else {
                    flush(&mut run, p);
                }
            }
            page += got as u64 / 8;
        }
        flush(&mut run, end_page);
    }

    /// Calls `read(from, to)` on each readable part of `[start, end)` (8-aligned bounds).
    fn readable(&self, start: u64, end: u64, mut read: impl FnMut(u64, u64)) {
        let mut addr = start.next_multiple_of(8);
        let maps = &self.maps.list;
        let mut i = maps.partition_point(|m| m.end <= addr);
        while addr + 8 <= end {
            let Some(m) = maps.get(i) else { return };
            if m.start >= end {
                return;
            }
            if m.readable {
                let from = addr.max(m.start).next_multiple_of(8);
                let to = end.min(m.end) & !7;
                if from < to {
                    read(from, to);
                }
            }
            addr = m.end;
            i += 1;
        }
    }

    /// Calls `f` on the words of `[addr, to)`, read through `process_vm_readv` a bufferful at
    /// a time, pages that fault skipped. Returns where it stopped: `to`, or where the kernel
    /// refused to read at all.
    fn read_via_kernel(buf: &mut [u64], mut addr: u64, to: u64, f: &mut dyn FnMut(u64, &[u64])) -> u64 {
        while addr < to {
            match Self::read_chunk(buf, addr, to) {
                Some(0) => addr = (addr + 1).next_multiple_of(PAGE).min(to),
                Some(n) => {
                    f(addr, &buf[..n]);
                    addr += n as u64 * 8;
                }
                None => break,
            }
        }
        addr
    }

    /// Reads the words of `[addr, end)` into `buf`: how many could be read, or `None` when
    /// the kernel refuses to read at all.
    fn read_chunk(buf: &mut [u64], addr: u64, end: u64) -> Option<usize> {
        let len = ((end - addr) as usize).min(buf.len() * 8);
        let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: len };
        let remote = libc::iovec { iov_base: addr as *mut c_void, iov_len: len };
        // SAFETY: both iovecs describe memory of the right length; the kernel checks the
        // remote one and the local one is our buffer.
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        if n >= 0 {
            return Some(n as usize / 8);
        }
        (os::errno() == libc::EFAULT).then_some(0)
    }
}

/// Calls `f` on the words of `[from, to)`, copied a bufferful at a time (volatile reads:
/// a thread that could not be stopped may be writing them).
///
/// # Safety
/// The range is readable memory of this process that stays mapped meanwhile.
unsafe fn read_directly(from: u64, to: u64, buf: &mut [u64], f: &mut dyn FnMut(u64, &[u64])) {
    let mut addr = from;
    while addr < to {
        let n = (((to - addr) / 8) as usize).min(buf.len());
        for (k, word) in buf[..n].iter_mut().enumerate() {
            // SAFETY: the caller's guarantee; addr + 8k < to.
            *word = unsafe { core::ptr::read_volatile((addr + 8 * k as u64) as *const u64) };
        }
        f(addr, &buf[..n]);
        addr += 8 * n as u64;
    }
}

impl Memory for ProcessMemory<'_> {
    fn words(&self, start: u64, end: u64, f: &mut dyn FnMut(u64, &[u64])) {
        let mut buf = self.buffer.borrow_mut();
        self.readable(start, end, |from, to| {
            self.populated(from, to, &mut |addr, to| {
                let addr = if self.direct.get() { addr } else { Self::read_via_kernel(&mut buf, addr, to, f) };
                if addr < to {
                    // The kernel refuses to read at all (a seccomp filter): directly from now on.
                    self.direct.set(true);
                    // SAFETY: a readable mapping of this process, which stays mapped: the other
                    // threads are stopped and this one does not unmap.
                    unsafe { read_directly(addr, to, &mut buf, f) };
                }
            })
        });
    }

    /// Not into the buffer, which the marking that asks is reading into: directly from a
    /// block's mapping, through `process_vm_readv` from a file's (which may fault past the
    /// file's end).
    fn word(&self, addr: u64) -> Option<u64> {
        if !addr.is_multiple_of(8) {
            return None;
        }
        let m = self.mapping(addr)?;
        if m.file == FileKind::Other {
            // SAFETY: an aligned word inside one readable mapping of the map, which was read
            // after the other threads stopped: it stays mapped (as for `block_words`).
            return Some(unsafe { (addr as *const u64).read_volatile() });
        }
        let mut word = [0u64];
        (Self::read_chunk(&mut word, addr, addr + 8) == Some(1)).then_some(word[0])
    }

    fn file_kind(&self, addr: u64) -> FileKind {
        self.mapping(addr).map_or(FileKind::Other, |m| m.file)
    }

    fn block_words(&self, start: u64, end: u64, f: &mut dyn FnMut(u64, &[u64])) {
        let mut buf = self.buffer.borrow_mut();
        let (from, to) = (start.next_multiple_of(8), end & !7);
        if from >= to {
            return;
        }
        if self.others_run.get() {
            Self::read_via_kernel(&mut buf, from, to, f);
            return;
        }
        let (low, high) = self.block_mapping.get();
        if !(low <= from && to <= high)
            && let Some(mapping) = self.mapping_of(from, to)
        {
            self.block_mapping.set(mapping);
        }
        let (low, high) = self.block_mapping.get();
        if low <= from && to <= high && to - from < SPARSE_MIN {
            // SAFETY: inside one readable mapping of the map, which was read after the other
            // threads stopped: it stays mapped.
            return unsafe { read_directly(from, to, &mut buf, f) };
        }
        self.readable(start, end, |from, to| {
            self.populated(from, to, &mut |a, t| {
                // SAFETY: as above (a block freed and unmapped since the snapshot is not in
                // the map, which was read after the other threads stopped).
                unsafe { read_directly(a, t, &mut buf, f) }
            })
        });
    }
}

impl ProcessMemory<'_> {
    /// The readable mapping of the map holding `[from, to)`.
    fn mapping_of(&self, from: u64, to: u64) -> Option<(u64, u64)> {
        let i = self.maps.list.partition_point(|m| m.end <= from);
        self.maps.list.get(i).filter(|m| m.readable && m.start <= from && to <= m.end).map(|m| (m.start, m.end))
    }

    /// The readable mapping holding the word at `addr`.
    fn mapping(&self, addr: u64) -> Option<&Mapping> {
        let i = self.maps.list.partition_point(|m| m.end <= addr);
        self.maps.list.get(i).filter(|m| m.readable && m.start <= addr && addr + 8 <= m.end)
    }
}

impl Drop for ProcessMemory<'_> {
    fn drop(&mut self) {
        if self.pagemap >= 0 {
            // SAFETY: our descriptor.
            unsafe { libc::close(self.pagemap) };
        }
    }
}

/// The writable segments of the loaded modules.
pub(crate) struct ModuleData {
    /// Every module's but mallocspy's own and the real allocator's: roots.
    pub roots: Vec<(u64, u64)>,
    /// The real allocator's (glibc's, jemalloc's): roots for pointers to a block's start only.
    /// Its own state points into blocks: glibc's top chunk starts inside the newest block
    /// whenever that block's size is 1 to 8 bytes past a multiple of 16, which made a lost
    /// block "possibly lost".
    pub allocator: Vec<(u64, u64)>,
    /// mallocspy's own: not roots (its tables hold addresses of blocks, not references to
    /// them, and its threads' parked registers are scanned as registers).
    pub own: Vec<(u64, u64)>,
}

/// The writable segments of every loaded module, `own` being an address in mallocspy's and
/// `allocator` one in the real allocator's (if known).
pub(crate) fn module_data(own: *const c_void, allocator: Option<*const c_void>) -> ModuleData {
    // dl_phdr_info's dlpi_addr is the load bias, module_of's the lowest mapped address: for a
    // shared object both are the start of its first segment (p_vaddr 0). None matches MAX.
    let base = |addr: *const c_void| match os::module_of(addr) {
        0 => u64::MAX,
        base => base as u64,
    };
    let own = base(own);
    let allocator = allocator.map_or(u64::MAX, base);
    let mut out = ModuleData { roots: Vec::new(), allocator: Vec::new(), own: Vec::new() };
    os::each_module(|m| {
        let list = if m.bias == own {
            &mut out.own
        } else if m.bias == allocator {
            &mut out.allocator
        } else {
            &mut out.roots
        };
        list.extend(m.segments(libc::PF_W));
        false
    });
    out
}

/// The dynamic loader's code. Blocks it allocates (the DTV of each thread's TLS, among
/// others) are referenced from loader structures outside every root (a cached thread
/// stack's TCB): like LeakSanitizer, the scan treats them as roots themselves.
pub(crate) fn loader_text() -> Option<(u64, u64)> {
    // SAFETY: getauxval reads the auxiliary vector; AT_BASE is the interpreter's load address.
    let base = unsafe { libc::getauxval(libc::AT_BASE) };
    if base == 0 {
        return None;
    }
    os::code_extent(base)
}

/// Where a thread's static TLS lies around its thread pointer (glibc, x86_64: the TLS blocks
/// below it, the control block, `struct pthread`, from it up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StaticTls {
    /// Bytes of TLS blocks below the thread pointer.
    pub below: u64,
    /// Bytes of the control block from the thread pointer up.
    pub control_block: u64,
}

/// What glibc does not say: a page each side.
const UNKNOWN_TLS: StaticTls = StaticTls { below: 4096, control_block: 4096 };

/// The static TLS layout (glibc's private accessors), or a page each side when unknown.
/// Asked once, when a leak tracker is made ([`warm_up`]) and not in the check: a successful
/// `dlsym` clears the calling thread's `dlerror` state, which frees the blocks holding it, the
/// program's; in the check those frees went unseen after the snapshot, and the state a failed
/// `dlopen` leaves was reported as lost (memcheck and LeakSanitizer report nothing: the
/// thread's TLS points to it).
pub(crate) fn static_tls() -> StaticTls {
    static LAYOUT: std::sync::OnceLock<StaticTls> = std::sync::OnceLock::new();
    *LAYOUT.get_or_init(ask_static_tls)
}

/// Asks the loader what [`static_tls`] keeps, where asking is safe: not inside a hook,
/// where `dlsym` would wait for the loader's lock wherever the program holds it.
pub(crate) fn warm_up() {
    if crate::tls::state().depth.get() == 0 {
        static_tls();
    }
}

/// `_dl_get_tls_static_info`'s size counts the control block too, which lies above the
/// thread pointer: taken all for TLS below it, the main thread's range started 2,368 bytes
/// before its TLS, in the memory mapped before it (`libthread_db` reads the control block's
/// size from `_thread_db_sizeof_pthread`).
fn ask_static_tls() -> StaticTls {
    type GetInfo = unsafe extern "C" fn(*mut usize, *mut usize);
    // SAFETY: a NUL-terminated name.
    let get_info = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_dl_get_tls_static_info".as_ptr()) };
    // SAFETY: a NUL-terminated name.
    let sizeof_pthread = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_thread_db_sizeof_pthread".as_ptr()) };
    if get_info.is_null() {
        return UNKNOWN_TLS;
    }
    // SAFETY: glibc's `void _dl_get_tls_static_info (size_t *sizep, size_t *alignp)`.
    let get: GetInfo = unsafe { core::mem::transmute::<*mut c_void, GetInfo>(get_info) };
    let (mut size, mut align) = (0usize, 0usize);
    // SAFETY: two valid out-pointers.
    unsafe { get(&mut size, &mut align) };
    let control_block = if sizeof_pthread.is_null() {
        0
    } else {
        // SAFETY: glibc's `const uint32_t _thread_db_sizeof_pthread`.
        u64::from(unsafe { sizeof_pthread.cast::<u32>().read() })
    };
    match (size as u64).checked_sub(control_block) {
        Some(below) if control_block > 0 => StaticTls { below, control_block },
        _ => StaticTls { below: size as u64, control_block: UNKNOWN_TLS.control_block },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The TLS range below a thread pointer, glibc's size less the control block above it,
    /// holds every module's TLS block, on a thread's stack as on another thread's.
    #[test]
    fn the_static_tls_range_holds_every_modules_block() {
        unsafe extern "C" fn visit(info: *mut libc::dl_phdr_info, _: usize, data: *mut c_void) -> libc::c_int {
            // SAFETY: dl_iterate_phdr's info, valid during the call; data is the Vec below.
            let (info, blocks) = unsafe { (&*info, &mut *data.cast::<Vec<(u64, u64)>>()) };
            // SAFETY: dlpi_phdr points to dlpi_phnum headers during the call.
            let headers = unsafe { core::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
            if let Some(tls) = headers.iter().find(|p| p.p_type == libc::PT_TLS) {
                let start = info.dlpi_tls_data as u64;
                blocks.push((start, start + tls.p_memsz));
            }
            0
        }
        let layout = static_tls();
        assert!(layout.control_block < 4096, "glibc did not say its control block's size: {layout:?}");
        let check = move || {
            let mut blocks: Vec<(u64, u64)> = Vec::new();
            // SAFETY: the callback matches dl_iterate_phdr's contract.
            unsafe { libc::dl_iterate_phdr(Some(visit), (&raw mut blocks).cast()) };
            let tp = os::thread_pointer();
            assert!(!blocks.is_empty(), "no module has TLS");
            for (start, end) in blocks {
                assert!(
                    tp - layout.below <= start && end <= tp,
                    "{start:#x}-{end:#x} outside {layout:?} below {tp:#x}"
                );
            }
        };
        check();
        std::thread::Builder::new().stack_size(64 << 10).spawn(check).unwrap().join().unwrap();
    }

    /// glibc puts the control block of a thread on a stack the program gives it at the top of
    /// that stack, the thread pointer at its start, and the static TLS right below, above the
    /// thread's first frame: the control block is what lies above, and the TLS range reaches
    /// no frame (the size glibc gives, taken all for TLS, reached 2,188 bytes into them).
    #[test]
    fn the_tls_range_is_what_glibc_puts_between_the_first_frame_and_the_thread_pointer() {
        extern "C" fn thread_pointer_and_frame(out: *mut c_void) -> *mut c_void {
            let local = 0u64;
            // SAFETY: `out` is the [u64; 2] the test passes.
            unsafe { out.cast::<[u64; 2]>().write([os::thread_pointer(), (&raw const local) as u64]) };
            core::hint::black_box(&local);
            core::ptr::null_mut()
        }
        const LEN: usize = 256 << 10;
        let mut stack = vec![0u8; LEN + 4096];
        let start = stack.as_mut_ptr().wrapping_add(stack.as_ptr().align_offset(4096));
        let end = start as u64 + LEN as u64;
        let mut seen = [0u64; 2];
        // SAFETY: attributes made and destroyed here; the stack outlives the joined thread,
        // which writes `seen` only.
        unsafe {
            let mut attr: libc::pthread_attr_t = core::mem::zeroed();
            assert_eq!(libc::pthread_attr_init(&mut attr), 0);
            assert_eq!(libc::pthread_attr_setstack(&mut attr, start.cast(), LEN), 0);
            let mut thread: libc::pthread_t = 0;
            let out = (&raw mut seen).cast();
            assert_eq!(libc::pthread_create(&mut thread, &attr, thread_pointer_and_frame, out), 0);
            assert_eq!(libc::pthread_join(thread, core::ptr::null_mut()), 0);
            libc::pthread_attr_destroy(&mut attr);
        }
        let ([tp, frame], layout) = (seen, static_tls());
        assert_eq!(tp + layout.control_block, end, "{layout:?}");
        assert!(frame < tp - layout.below, "a frame at {frame:#x} in {layout:?} below {tp:#x}");
    }
}
