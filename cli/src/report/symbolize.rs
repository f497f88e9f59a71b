//! Return addresses to functions, files and lines, offline, from the modules the trace lists.
//!
//! The trace holds raw return addresses and, per module, its path, load bias, executable
//! ranges and build id: everything needed to symbolize later, on this machine, as long as the
//! files are still there. A module's DWARF comes from the file itself or from its separate debug
//! file (found by build id or `.gnu_debuglink` under `/usr/lib/debug`, as gdb looks, with the
//! `.gnu_debugaltlink` file that `dwz` makes); its symbol table names what DWARF does not cover.
//! A module whose file is missing or was rebuilt since (another build id; without build ids, a
//! file modified after the run began) names its frames `module+0xOFFSET`, never a wrong
//! function, and the report says which files it could not trust.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use addr2line::Loader;
use mallocspy::leaks::debuglink;
use mallocspy::leaks::{SIGNAL_FRAME, is_signal_trampoline_in};
use mallocspy::trace::Module;
use object::{Object, ObjectSection, ObjectSegment};

use super::profile::{Profile, RawFrame};
use super::progress::Progress;
use super::text::printable;

/// One function of a resolved address: the address's own, or one inlined into it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SymFrame {
    /// The demangled function name; `module+0xOFFSET` (or the bare address) when unknown.
    pub function: String,
    /// The source file of the call (or of the allocation, innermost).
    pub file: Option<String>,
    /// Its line.
    pub line: Option<u32>,
}

/// A resolved return address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The return address.
    pub address: u64,
    /// Its module (index into [`Profile::modules`]).
    pub module: Option<usize>,
    /// Whether a function name was found (else `frames` holds one frame named by the address).
    pub symbolized: bool,
    /// The innermost inlined call first, the function the code is in last; never empty.
    pub frames: Vec<SymFrame>,
}

/// The resolved addresses of a profile's stacks (none by default).
#[derive(Default)]
pub struct Symbols {
    locations: HashMap<RawFrame, Location>,
    /// Each module's file name, for `module+0xOFFSET`.
    module_names: Vec<String>,
    /// The files that are not the ones that ran, each with why: their frames are named by
    /// offset.
    changed_files: Vec<(String, &'static str)>,
}

impl Symbols {
    /// Resolves every frame of every stack, opening each module's files once.
    pub fn resolve(profile: &Profile, progress: &mut Progress) -> Symbols {
        // C++ names as `c++filt` gives them (see `mallocspy::leaks::demangle`).
        mallocspy::leaks::load_cxx_runtime_demangler();
        // Names as shown: a trace's paths and a file's symbols may hold anything.
        let module_names: Vec<String> = profile.modules.iter().map(|m| shown_file_name(&m.path)).collect();
        // Each once, as they are gathered: a copy of every frame of every stack took 24 bytes
        // a frame beside the stacks' own (970 MB for a 21 MB trace of deep stacks).
        let frames: std::collections::HashSet<RawFrame> =
            profile.stacks.iter().flat_map(|s| s.frames.iter().copied()).collect();
        let mut frames: Vec<RawFrame> = frames.into_iter().collect();
        let file_of = files_of(&profile.modules);
        frames.sort_unstable_by_key(|f| (f.module.map(|m| file_of[m]), f.address, f.module));
        progress.stage("symbolizing", frames.len() as u64);
        let mut locations = HashMap::with_capacity(frames.len());
        let started = profile.header.start_unix_ns;
        let mut open: Option<(usize, DebugInfo)> = None;
        let mut changed_files = Vec::new();
        for (done, frame) in frames.into_iter().enumerate() {
            if done % 256 == 0 {
                progress.set(done as u64);
            }
            let Some(m) = frame.module else {
                let name = format!("{:#x}", frame.address);
                locations.insert(frame, Location::unknown(frame, name));
                continue;
            };
            let module = &profile.modules[m];
            if open.as_ref().is_none_or(|(file, _)| *file != file_of[m]) {
                let debug = DebugInfo::open(module, started);
                if let Some(why) = debug.changed {
                    changed_files.push((module.path.clone(), why));
                }
                open = Some((file_of[m], debug));
            }
            let debug = &open.as_ref().expect("opened above").1;
            let fallback = format!("{}+{:#x}", module_names[m], frame.address.wrapping_sub(module.base));
            let probe = probe_of(frame.address, module.base);
            let found = probe.map(|probe| debug.frames(probe)).unwrap_or_default();
            let location = if found.is_empty() && probe.is_some_and(|probe| debug.is_signal_trampoline(probe)) {
                let frames = vec![SymFrame { function: SIGNAL_FRAME.to_owned(), file: None, line: None }];
                Location { address: frame.address, module: Some(m), symbolized: true, frames }
            } else if found.is_empty() {
                Location::unknown(frame, fallback)
            } else {
                let frames = found
                    .into_iter()
                    .map(|(function, file, line)| SymFrame {
                        function: function.map_or_else(|| fallback.clone(), |f| printable(&f)),
                        file: file.map(|f| printable(&f)),
                        line,
                    })
                    .collect();
                Location { address: frame.address, module: Some(m), symbolized: true, frames }
            };
            locations.insert(frame, location);
        }
        Symbols { locations, module_names, changed_files }
    }

    /// The files that are not the ones that ran (rebuilt, or changed since), each with why.
    pub fn changed_files(&self) -> &[(String, &'static str)] {
        &self.changed_files
    }

    /// The resolution of a frame of one of the profile's stacks.
    pub fn location(&self, frame: RawFrame) -> &Location {
        // `resolve` went through every frame of every stack.
        &self.locations[&frame]
    }

    /// A module's file name.
    pub fn module_name(&self, module: usize) -> &str {
        &self.module_names[module]
    }
}

/// For each module, the first module of the same file and build: each file's debug
/// information is opened, used and dropped in turn, once for all its loads (a library loaded
/// and unloaded a thousand times). A file is known by its canonical path: a damaged or crafted
/// trace that spelled one file a thousand ways had it parsed a thousand times.
fn files_of(modules: &[Module]) -> Vec<usize> {
    let mut first_load: HashMap<(PathBuf, &[u8]), usize> = HashMap::new();
    let mut canonical: HashMap<&str, PathBuf> = HashMap::new();
    (modules.iter().enumerate())
        .map(|(i, m)| {
            let file = canonical
                .entry(m.path.as_str())
                .or_insert_with(|| std::fs::canonicalize(&m.path).unwrap_or_else(|_| PathBuf::from(&m.path)));
            *first_load.entry((file.clone(), m.build_id.as_slice())).or_insert(i)
        })
        .collect()
}

/// The file address to look up for a return address in a module loaded at `base`: the call's,
/// one byte earlier. `None` for an address at or below the base, which no call returns to.
fn probe_of(address: u64, base: u64) -> Option<u64> {
    address.checked_sub(1)?.checked_sub(base)
}

impl Location {
    fn unknown(frame: RawFrame, name: String) -> Location {
        Location {
            address: frame.address,
            module: frame.module,
            symbolized: false,
            frames: vec![SymFrame { function: name, file: None, line: None }],
        }
    }
}

/// The last component of a path that has one, else `??` (a damaged trace's `/` or empty
/// path named its frames `+0x3000`).
fn file_name(path: &str) -> &str {
    path.rsplit('/').find(|part| !part.is_empty()).unwrap_or("??")
}

/// The longest file name a Linux file system holds (`NAME_MAX`).
const NAME_MAX: usize = 255;

/// A module's file name as frames show it (`name+0xOFFSET`): printable, and cut at
/// [`NAME_MAX`] bytes. A longer one comes from a damaged or crafted trace, and repeated in
/// each of its frames' names it made a 318 KB trace of 4 KiB names need 2.5 GB.
fn shown_file_name(path: &str) -> String {
    let name = printable(file_name(path));
    if name.len() <= NAME_MAX {
        return name;
    }
    let cut = (0..=NAME_MAX).rev().find(|&i| name.is_char_boundary(i)).unwrap_or(0);
    format!("{}…", &name[..cut])
}

/// One module's debug information.
struct DebugInfo {
    /// Its DWARF (and symbol table): the module's own or its debug file's.
    dwarf: Option<Loader>,
    /// The module file's symbol table, when the DWARF came from a separate file.
    symbols: Option<Loader>,
    /// The module's file, if it is the one that ran.
    file: Option<PathBuf>,
    /// Its unwind tables, read at the first frame nothing names.
    unwind_tables: std::cell::OnceCell<Option<UnwindTables>>,
    /// Why the module's file on disk is not the one that ran, when it is there but is not.
    changed: Option<&'static str>,
}

/// A file's `.eh_frame_hdr` and `.eh_frame`, each with its file address.
struct UnwindTables {
    eh_frame_hdr: (Vec<u8>, u64),
    eh_frame: (Vec<u8>, u64),
}

impl UnwindTables {
    fn read(path: &Path) -> Option<UnwindTables> {
        let cache = object::ReadCache::new(File::open(path).ok()?);
        let file = object::File::parse(&cache).ok()?;
        let section = |name: &str| {
            let section = file.section_by_name(name)?;
            Some((section.data().ok()?.to_vec(), section.address()))
        };
        Some(UnwindTables { eh_frame_hdr: section(".eh_frame_hdr")?, eh_frame: section(".eh_frame")? })
    }
}

/// A file's loaded segments: file address, size in memory, offset in the file.
type Segments = Vec<(u64, u64, u64)>;

/// What the ELF file says about where its debug information is.
struct ElfFacts {
    build_id: Option<Vec<u8>>,
    /// The debug file's name and CRC-32.
    debuglink: Option<(Vec<u8>, u32)>,
    altlink: Option<(Vec<u8>, Vec<u8>)>,
    has_dwarf: bool,
    segments: Segments,
    /// When the file was last modified, in ns since the epoch.
    modified_unix_ns: Option<u64>,
}

impl ElfFacts {
    /// Reads only the headers and notes it needs (a library may be hundreds of megabytes).
    fn read(path: &Path) -> Option<ElfFacts> {
        // A path the trace names may be anything now: a FIFO or a terminal would block the open.
        if !path.is_file() {
            return None;
        }
        let opened = File::open(path).ok()?;
        let modified_unix_ns = opened
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos() as u64);
        let cache = object::ReadCache::new(opened);
        let file = object::File::parse(&cache).ok()?;
        // A separate debug file keeps the sections' headers with no contents (NOBITS): DWARF
        // is there only when the section has bytes in the file.
        let has_dwarf = file.section_by_name(".debug_info").is_some_and(|s| s.file_range().is_some_and(|r| r.1 > 0));
        Some(ElfFacts {
            build_id: file.build_id().ok().flatten().map(<[u8]>::to_vec),
            debuglink: file.gnu_debuglink().ok().flatten().map(|(name, crc)| (name.to_vec(), crc)),
            altlink: file.gnu_debugaltlink().ok().flatten().map(|(name, id)| (name.to_vec(), id.to_vec())),
            has_dwarf,
            segments: file.segments().map(|s| (s.address(), s.size(), s.file_range().0)).collect(),
            modified_unix_ns,
        })
    }

    /// Why this file is not the one that ran as `module` in a run that began at
    /// `started_unix_ns` (0: unknown), or `None` when it is: the same build id; without one
    /// in the trace, not modified since the run began (a program rebuilt without build ids
    /// had every frame named after whatever function of the new build lay at its offset).
    fn differs_from(&self, module: &Module, started_unix_ns: u64) -> Option<&'static str> {
        if !module.build_id.is_empty() {
            return (self.build_id.as_deref() != Some(module.build_id.as_slice()))
                .then_some("rebuilt since the run: another build id");
        }
        (started_unix_ns != 0 && self.modified_unix_ns.is_some_and(|m| m > started_unix_ns))
            .then_some("modified since the run began, and no build id tells whether it is the same")
    }
}

/// The offsets in modules' files of the bytes loaded at addresses, which pprof's mappings
/// give and profiling servers (Parca, Pyroscope) turn back into file addresses through the
/// files' segments. Each file's segments are read once: a trace may load a library tens of
/// thousands of times (review helper 162: 40,000 loads took 6.9 s, a read each).
pub(crate) struct FileOffsets {
    started_unix_ns: u64,
    /// By path and build id: the segments of the file there, if it is the one that ran.
    segments: HashMap<(String, Vec<u8>), Option<Segments>>,
}

impl FileOffsets {
    /// For a run that began at `started_unix_ns` (0: unknown), which tells a file modified
    /// since from the one that ran.
    pub(crate) fn new(started_unix_ns: u64) -> FileOffsets {
        FileOffsets { started_unix_ns, segments: HashMap::new() }
    }

    /// The offset in `module`'s file of the byte loaded at `address`. Without the file that
    /// ran, the file address itself: the two are equal in the executable segment of a shared
    /// library or position-independent executable as the GNU linker lays them out, not in a
    /// fixed-address executable (0x401000 against 0x1000).
    pub(crate) fn of(&mut self, module: &Module, address: u64) -> u64 {
        let file_address = address.wrapping_sub(module.base);
        let started_unix_ns = self.started_unix_ns;
        self.segments
            .entry((module.path.clone(), module.build_id.clone()))
            .or_insert_with(|| {
                ElfFacts::read(Path::new(&module.path))
                    .filter(|f| f.differs_from(module, started_unix_ns).is_none())
                    .map(|f| f.segments)
            })
            .as_ref()
            .and_then(|segments| {
                let &(start, _, offset) = segments
                    .iter()
                    .find(|&&(start, size, _)| (start..start.saturating_add(size)).contains(&file_address))?;
                Some(file_address - start + offset)
            })
            .unwrap_or(file_address)
    }
}

fn os_path(bytes: &[u8]) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    PathBuf::from(std::ffi::OsStr::from_bytes(bytes))
}

impl DebugInfo {
    fn open(module: &Module, started_unix_ns: u64) -> DebugInfo {
        let path = Path::new(&module.path);
        let facts = ElfFacts::read(path);
        // The file on disk is the one that ran, unless its build id or its age says otherwise.
        let changed = facts.as_ref().and_then(|f| f.differs_from(module, started_unix_ns));
        let current = facts.is_some() && changed.is_none();
        let file = current.then(|| path.to_path_buf());
        let unwind_tables = std::cell::OnceCell::new();
        if current
            && facts.as_ref().is_some_and(|f| f.has_dwarf)
            && let Ok(loader) = Loader::new(path)
        {
            return DebugInfo { dwarf: Some(loader), symbols: None, file, unwind_tables, changed };
        }
        let build_id = match &facts {
            _ if !module.build_id.is_empty() => Some(module.build_id.clone()),
            Some(f) => f.build_id.clone(),
            None => None,
        };
        let link = facts.and_then(|f| f.debuglink).filter(|_| current);
        // A debug file left from an earlier build gave that build's lines without a word
        // (review helper 114): the linked one must carry the build id, or the link's CRC.
        let link = link.as_ref().map(|(name, crc)| (name.as_slice(), *crc));
        let dwarf = debuglink::find(path, build_id.as_deref(), link).and_then(|d| open_debug_file(&d));
        let symbols = if current { Loader::new(path).ok() } else { None };
        // Its frames go by offset then, as a rebuilt file's do, and said as those are (review
        // helper 135: a library removed since the run was named by offset without a word).
        let changed = match changed {
            None if dwarf.is_none() && symbols.is_none() && path.is_absolute() => {
                Some(if !path.exists() { "gone since the run (no such file)" } else { "not a readable ELF file" })
            }
            changed => changed,
        };
        DebugInfo { dwarf, symbols, file, unwind_tables, changed }
    }

    /// Whether file address `probe` lies in a signal trampoline (glibc's `__restore_rt`, which
    /// no symbol names), by the unwind tables of the file that ran.
    fn is_signal_trampoline(&self, probe: u64) -> bool {
        let tables = self.unwind_tables.get_or_init(|| self.file.as_deref().and_then(UnwindTables::read));
        tables.as_ref().is_some_and(|t| {
            let (hdr, eh_frame) = (&t.eh_frame_hdr, &t.eh_frame);
            is_signal_trampoline_in((&hdr.0, hdr.1), (&eh_frame.0, eh_frame.1), probe)
        })
    }

    /// `(function, file, line)` of the functions at file address `probe`, innermost inlined
    /// call first; the function is `None` where neither DWARF nor a symbol table names it.
    fn frames(&self, probe: u64) -> Vec<(Option<String>, Option<String>, Option<u32>)> {
        let mut out = Vec::new();
        if let Some(dwarf) = &self.dwarf
            && let Ok(mut frames) = dwarf.find_frames(probe)
        {
            while let Ok(Some(frame)) = frames.next() {
                let function = frame.function.as_ref().and_then(mallocspy::leaks::function_name);
                let (file, line) = frame.location.map_or((None, None), |l| (l.file.map(str::to_owned), l.line));
                out.push((function, file, line));
            }
        }
        // The outermost frame is the function the code is in: the symbol table names it when
        // DWARF does not cover the address (stripped libraries, assembly).
        let symbol = || {
            let name = self.dwarf.iter().chain(&self.symbols).find_map(|l| l.find_symbol(probe))?;
            Some(mallocspy::leaks::symbol_name(name))
        };
        match out.last_mut() {
            Some(last) if last.0.is_none() => last.0 = symbol(),
            Some((Some(name), Some(file), _)) => {
                if let Some(full) = mallocspy::leaks::qualified_name(name, file, symbol) {
                    *name = full;
                }
            }
            Some(_) => {}
            None => {
                if let Some(name) = symbol() {
                    out.push((Some(name), None, None));
                }
            }
        }
        if out.iter().all(|f| f.0.is_none()) {
            out.clear();
        }
        out
    }
}

/// A loader for a debug file, with the supplementary file `dwz` moved shared DWARF into.
fn open_debug_file(debug: &Path) -> Option<Loader> {
    let sup = ElfFacts::read(debug).and_then(|f| f.altlink).and_then(|(name, id)| {
        let named = debug.parent().map_or_else(|| os_path(&name), |dir| dir.join(os_path(&name)));
        [Some(named), debuglink::by_build_id(&id)].into_iter().flatten().find(|p| p.is_file())
    });
    match sup {
        Some(sup) => Loader::new_with_sup(debug, Some(&sup)).or_else(|_| Loader::new(debug)).ok(),
        None => Loader::new(debug).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_spelled_two_ways_is_one_file_and_another_build_is_not() {
        let exe = std::env::current_exe().unwrap().canonicalize().unwrap();
        let (dir, name) = (exe.parent().unwrap().display().to_string(), exe.file_name().unwrap().to_string_lossy());
        let module = |path: String, build_id: &[u8]| Module { path, build_id: build_id.to_vec(), ..Module::default() };
        let modules = [
            module(exe.display().to_string(), b"a"),
            module(format!("{dir}/./{name}"), b"a"),
            module(format!("{dir}//{name}"), b"b"),
            module("/nonexistent/lib.so".into(), b""),
            module("/nonexistent/lib.so".into(), b""),
        ];
        assert_eq!(files_of(&modules), [0, 0, 2, 3, 3]);
    }

    #[test]
    fn a_modules_shown_name_is_its_last_component_cut_to_name_max() {
        assert_eq!(shown_file_name("/usr/lib/libc.so.6"), "libc.so.6");
        assert_eq!(shown_file_name("/opt/app/"), "app");
        assert_eq!(shown_file_name("/"), "??");
        assert_eq!(shown_file_name(""), "??");
        let long = format!("/lib/{}", "é".repeat(200));
        let shown = shown_file_name(&long);
        assert_eq!(shown, format!("{}…", "é".repeat(127)));
        assert!(shown.len() <= NAME_MAX + '…'.len_utf8());
    }

    #[test]
    fn an_address_at_or_below_its_modules_base_has_no_probe() {
        assert_eq!(probe_of(0x1235, 0x1000), Some(0x234));
        assert_eq!(probe_of(0x1001, 0x1000), Some(0));
        assert_eq!(probe_of(0x1000, 0x1000), None);
        assert_eq!(probe_of(0x10, 0x1000), None);
        assert_eq!(probe_of(0, 0), None);
    }
}
