//! Return addresses to functions, files and lines, at report time only (the hook path keeps
//! raw addresses). Inlined calls become frames of their own, as in memcheck's reports.

use crate::fixed_hash::HashMap;
use std::ffi::CStr;

use serde::Serialize;

/// One frame of a reported stack.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Frame {
    /// The return address, `0x...`.
    pub address: String,
    /// Demangled function name, when known.
    pub function: Option<String>,
    /// Source file, when the module has line information.
    pub file: Option<String>,
    /// Source line.
    pub line: Option<u32>,
    /// The module's path.
    pub module: Option<String>,
    /// Where the address lies in the module's file (its `p_vaddr`, what `addr2line -e` takes),
    /// given when nothing names the frame (a stripped module).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// The module was unloaded (`dlclose`) before the report; its frames were read from its
    /// file. In JSON only when true.
    #[serde(skip_serializing_if = "core::ops::Not::not")]
    pub unloaded: bool,
}

/// A function's name as a symbol table or DWARF gives it: glibc's hidden alias of a function
/// (`__GI_setlocale`, its debug information's linkage name, and its symbol table's at the
/// same address as `setlocale`) reads as the name programs call; then demangled.
pub fn symbol_name(name: &str) -> String {
    demangle(name.strip_prefix("__GI_").filter(|rest| !rest.is_empty()).unwrap_or(name))
}

/// A symbol's name, demangled if it is mangled: C++ and legacy Rust names start with `_Z`,
/// Rust v0 names with `_R`. Any other name is a C function's, as written: the C++ demangler
/// would read a short one as a type's code (`f` as `float`).
///
/// A C++ name is demangled by the C++ runtime's own `__cxa_demangle` (what `c++filt` and
/// gdb print) where the process has it: the `cpp_demangle` crate, used otherwise, drops or
/// misreads parameters of templated constructors and forwarding references
/// (`basic_string<…>(char, …)` for `(unsigned long, char, …)`) and gives up on some names.
pub fn demangle(name: &str) -> String {
    if !(name.starts_with("_Z") || name.starts_with("_R")) {
        return name.to_owned();
    }
    if name.starts_with("_Z")
        && !is_legacy_rust(name)
        && let Some(demangled) = cxx_runtime_demangle(name)
    {
        return demangled;
    }
    addr2line::demangle_auto(name.into(), None).into_owned()
}

/// A function's name from DWARF: its linkage name demangled, or else its plain name.
pub fn function_name(function: &addr2line::FunctionName<impl gimli::Reader>) -> Option<String> {
    function.raw_name().ok().map(|name| symbol_name(&name))
}

/// The name of the function code is in, from its symbol, where DWARF gives only its own
/// name: GCC writes no linkage name for a lambda's `operator()` nor for a function templated
/// on a lambda (`_M_invoke`, `__invoke_impl<void, main()::<lambda()>&>`), and every lambda
/// read `operator()` (review helper 86). `dwarf` is the name of an outermost frame DWARF gives
/// with a source `file`; `symbol`, the symbol table's name at its address, asked for only
/// for C++ (not for a `.c` file) when `dwarf` is unqualified and no linkage name, and taken
/// when it qualifies `dwarf`'s name (up to its template arguments) with a scope.
pub fn qualified_name(dwarf: &str, file: &str, symbol: impl FnOnce() -> Option<String>) -> Option<String> {
    let own = dwarf.split('<').next().unwrap_or(dwarf);
    // A parameter list: DWARF's linkage name, demangled, and whole. The symbol table's name
    // may be another function's, folded into the same code (`--icf`: review helper 88).
    let linkage = own.replace("operator()", "").contains('(');
    if linkage || own.contains("::") || file.ends_with(".c") {
        return None;
    }
    let member = format!("::{own}");
    let symbol = symbol().filter(|symbol| symbol.contains(&member))?;
    // GCC's copies of a function (`[clone .constprop.0]`, `.isra.0`) are the function: its
    // name stays the same from one build to the next, for the grouping and the suppressions.
    let mut name = symbol.as_str();
    while let Some(cut) = name.strip_suffix(']').and_then(|n| n.rfind(" [clone ")) {
        name = &name[..cut];
    }
    Some(name.to_owned())
}

/// Whether `name` is a legacy Rust symbol: `_ZN...17h<16 hex digits>E`, then its end or a
/// `.suffix` (`.llvm.N`). Not cut at the first `.`: a Rust path holds them (`..` for `::`).
fn is_legacy_rust(name: &str) -> bool {
    // Bytes: a C++ name may hold UTF-8 identifiers, and a cut inside a character panicked.
    let name = name.as_bytes();
    name.starts_with(b"_ZN")
        && name.windows(20).enumerate().any(|(at, w)| {
            w.starts_with(b"17h")
                && w[3..19].iter().all(u8::is_ascii_hexdigit)
                && w[19] == b'E'
                && name.get(at + 20).is_none_or(|&next| next == b'.')
        })
}

type CxaDemangle = unsafe extern "C" fn(
    *const core::ffi::c_char,
    *mut core::ffi::c_char,
    *mut usize,
    *mut core::ffi::c_int,
) -> *mut core::ffi::c_char;

/// The C++ runtime's `__cxa_demangle` (libstdc++'s, or libc++abi's), looked up once.
static CXA_DEMANGLE: std::sync::OnceLock<Option<CxaDemangle>> = std::sync::OnceLock::new();

/// Makes [`demangle`] use libstdc++'s demangler, loading the library if the process has not
/// (the report command; a spied program's own reports use its C++ runtime, if it has one).
/// Call it before the first [`demangle`].
pub fn load_cxx_runtime_demangler() {
    // SAFETY: a NUL-terminated name; loading libstdc++ runs only its own constructors.
    unsafe { libc::dlopen(c"libstdc++.so.6".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
}

/// `name` demangled by the process's C++ runtime, if it has one and it can.
fn cxx_runtime_demangle(name: &str) -> Option<String> {
    let found = CXA_DEMANGLE.get_or_init(|| {
        // SAFETY: a NUL-terminated name, looked up in the process's global scope.
        let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"__cxa_demangle".as_ptr()) };
        // SAFETY: `__cxa_demangle` has this signature (the Itanium C++ ABI).
        (!f.is_null()).then(|| unsafe { core::mem::transmute::<*mut libc::c_void, CxaDemangle>(f) })
    });
    let cxa_demangle = (*found)?;
    let mangled = std::ffi::CString::new(name).ok()?;
    let mut status = 0;
    // SAFETY: a NUL-terminated name; no buffer given, so the result is malloc'd (or null).
    let out = unsafe { cxa_demangle(mangled.as_ptr(), core::ptr::null_mut(), core::ptr::null_mut(), &mut status) };
    if out.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string from `__cxa_demangle`, ours to free.
    let demangled = (status == 0).then(|| unsafe { CStr::from_ptr(out) }.to_string_lossy().into_owned());
    // SAFETY: allocated by `__cxa_demangle` with malloc, freed once.
    unsafe { libc::free(out.cast()) };
    demangled
}

/// Resolves addresses, remembering each answer.
#[derive(Default)]
pub(crate) struct Symbolizer {
    cache: HashMap<u64, Vec<Frame>>,
    /// Frames in libraries unloaded since, by path and file address.
    unloaded_cache: HashMap<(String, u64), Vec<Frame>>,
    /// The debug information of each file read directly so far (`None`: unreadable): unloaded
    /// libraries, libraries loaded by a relative path, modules whose symbol table names a
    /// function better than DWARF ([`qualified_name`]).
    files: HashMap<String, Option<addr2line::Loader>>,
    /// Data symbols of each module (`(start, end, name)` sorted, link-time addresses).
    data_symbols: HashMap<String, Vec<(u64, u64, String)>>,
    /// The program's file, once asked for (see `program_file`).
    program_file: Option<Option<addr2line::Loader>>,
    /// Whether each module's debuglink names a debug file of another build, once asked.
    stale_debuglinks: HashMap<String, bool>,
}

/// The data symbols (objects with a size) of the ELF file at `path`, from its full symbol
/// table: a program's globals are rarely in the dynamic one that `dladdr` reads.
fn read_data_symbols(path: &str) -> Vec<(u64, u64, String)> {
    use object::{Object, ObjectSymbol, SymbolKind};
    let Ok(bytes) = std::fs::read(path) else { return Vec::new() };
    let Ok(file) = object::File::parse(&*bytes) else { return Vec::new() };
    let data = |s: &object::Symbol| {
        (s.kind() == SymbolKind::Data && s.size() > 0)
            .then(|| Some((s.address(), s.address() + s.size(), s.name().ok()?.to_owned())))
            .flatten()
    };
    let mut out: Vec<(u64, u64, String)> =
        file.symbols().chain(file.dynamic_symbols()).filter_map(|s| data(&s)).collect();
    // A stripped library's static data is named in its separate debug file (Debian's -dbg packages).
    if let Ok(Some(id)) = file.build_id()
        && let Some(debug) = super::debuglink::by_build_id(id)
        && let Ok(bytes) = std::fs::read(debug)
        && let Ok(file) = object::File::parse(&*bytes)
    {
        out.extend(file.symbols().filter_map(|s| data(&s)));
    }
    out.sort_unstable();
    out.dedup_by(|a, b| a.0 == b.0);
    out
}

/// What the loader knows of `addr`: its module's path and load address, its nearest
/// dynamic symbol.
fn dl_info(addr: u64) -> Option<libc::Dl_info> {
    // SAFETY: Dl_info is plain data; dladdr only writes it.
    let mut info: libc::Dl_info = unsafe { core::mem::zeroed() };
    // SAFETY: any address may be asked about.
    (unsafe { libc::dladdr(addr as *const libc::c_void, &mut info) } != 0).then_some(info)
}

fn module_of(addr: u64) -> Option<String> {
    let info = dl_info(addr).filter(|i| !i.dli_fname.is_null())?;
    // SAFETY: dladdr returns a NUL-terminated path owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    // The loader names the program by its `argv[0]` ("git", "./prog", or whatever `exec -a`
    // gave): its file, as the kernel maps it, is what `addr2line -e` needs (not
    // `/proc/self/exe`, which is the loader for a program it was asked to run).
    match program() {
        Some((base, file)) if name.is_empty() || info.dli_fbase as u64 == *base => Some(file.clone()),
        _ if !name.is_empty() && !name.starts_with('/') => {
            Some(absolute_path_of(info.dli_fbase as u64, addr).unwrap_or(name))
        }
        _ => Some(name).filter(|n| !n.is_empty()),
    }
}

/// The path of the file mapped at `addr`, in the module loaded at `base` that the loader
/// names by a relative path (`dlopen("./plugin.so")`), as the kernel's map names it: the
/// relative one opens nothing once the program has changed directory (a daemon's `chdir("/")`),
/// and its frames were `??` (review helper 77). Once per module.
fn absolute_path_of(base: u64, addr: u64) -> Option<String> {
    static PATHS: std::sync::Mutex<Vec<(u64, Option<String>)>> = std::sync::Mutex::new(Vec::new());
    let mut paths = PATHS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, path)) = paths.iter().find(|(b, _)| *b == base) {
        return path.clone();
    }
    let path = mapped_file(addr);
    paths.push((base, path.clone()));
    path
}

/// Whether the loader names the module holding `addr` by a relative path, which the
/// symbolizer of `backtrace` opens as given.
fn loaded_by_relative_path(addr: u64) -> bool {
    dl_info(addr).filter(|i| !i.dli_fname.is_null()).is_some_and(|info| {
        // SAFETY: dladdr returns a NUL-terminated path owned by the loader.
        let name = unsafe { CStr::from_ptr(info.dli_fname) }.to_bytes();
        !name.is_empty() && !name.starts_with(b"/")
    })
}

/// Where the program is loaded (its lowest mapped address, as `dladdr`'s `dli_fbase` says) and
/// its mapped file: looked up once, not once a frame (a read of the whole map each time).
fn program() -> &'static Option<(u64, String)> {
    static PROGRAM: std::sync::OnceLock<Option<(u64, String)>> = std::sync::OnceLock::new();
    PROGRAM.get_or_init(|| {
        let mut base = None;
        // The loader lists the program first.
        crate::os::each_module(|m| {
            base = m.segments(0).map(|(start, _)| start).min();
            true
        });
        let base = base? & !(crate::os::page_size() as u64 - 1);
        Some((base, mapped_file(base)?))
    })
}

/// The program's file, as the kernel maps it.
pub(super) fn program_file() -> Option<String> {
    program().as_ref().map(|(_, file)| file.clone())
}

/// The file mapped at `addr`, as the kernel's map names it (" (deleted)" included). The map of
/// this thread: `/proc/self/maps` reads empty once the main thread has called `pthread_exit`.
pub(super) fn mapped_file(addr: u64) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/thread-self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut fields = line.split_ascii_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let (start, end) = (u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?);
        let path = fields.nth(4)?;
        // A path may hold spaces: the rest of the line from the path's start.
        let path = &line[line.find(path)?..];
        (start <= addr && addr < end && path.starts_with('/'))
            .then(|| String::from_utf8_lossy(&crate::trace::modules::unescaped_map_path(path.as_bytes())).into_owned())
    })
}

/// The load bias of the module holding `addr` (a `p_vaddr` plus it is an address).
fn load_bias(addr: u64) -> Option<u64> {
    let mut found = None;
    crate::os::each_module(|m| {
        if m.segments(0).any(|(start, end)| start <= addr && addr < end) {
            found = Some(m.bias);
        }
        found.is_some()
    });
    found
}

/// `dladdr1`'s request for the symbol table entry (`<dlfcn.h>`'s `RTLD_DL_SYMENT`).
const RTLD_DL_SYMENT: libc::c_int = 1;

/// What `dladdr1` finds for an address: the nearest dynamic symbol at or below it (its name,
/// start and size) and the load address of its library.
struct DynamicSymbol {
    name: Option<String>,
    start: u64,
    size: u64,
    base: u64,
}

fn dynamic_symbol(addr: u64) -> Option<DynamicSymbol> {
    // SAFETY: Dl_info is plain data; dladdr1 writes it and a pointer to the symbol's entry.
    let mut info: libc::Dl_info = unsafe { core::mem::zeroed() };
    let mut symbol: *const libc::Elf64_Sym = core::ptr::null();
    // SAFETY: any address may be asked about; `symbol` receives a pointer into the loader's
    // (read-only, mapped) symbol table.
    let found =
        unsafe { libc::dladdr1(addr as *const libc::c_void, &mut info, (&raw mut symbol).cast(), RTLD_DL_SYMENT) };
    if found == 0 || symbol.is_null() {
        return None;
    }
    // SAFETY: dladdr returns a NUL-terminated name owned by the loader, or null.
    let name =
        (!info.dli_sname.is_null()).then(|| unsafe { CStr::from_ptr(info.dli_sname) }.to_string_lossy().into_owned());
    // SAFETY: dladdr1 pointed `symbol` at the symbol's entry in the library's mapped table.
    let size = unsafe { (*symbol).st_size };
    Some(DynamicSymbol { name, start: info.dli_saddr as u64, size, base: info.dli_fbase as u64 })
}

/// The exported function of the library holding `addr` whose code covers it, and its address.
fn exported_function(addr: u64) -> Option<(String, u64)> {
    let symbol = dynamic_symbol(addr)?;
    (addr.wrapping_sub(symbol.start) < symbol.size).then_some((symbol.name?, symbol.start))
}

/// The address of `name` in the loaded library at `path`.
fn library_symbol(path: &str, name: &str) -> Option<u64> {
    let (path, name) = (std::ffi::CString::new(path).ok()?, std::ffi::CString::new(name).ok()?);
    // SAFETY: NUL-terminated strings; RTLD_NOLOAD only finds a library already loaded (the
    // reference it takes is not given back: the C library is never unloaded).
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    // SAFETY: a live handle and a NUL-terminated name.
    let found = unsafe { libc::dlsym(handle, name.as_ptr()) };
    (!found.is_null()).then_some(found as u64)
}

/// A frame of the C library, named by its dynamic symbol table: the name a program calls it by
/// (`strdup`, where its debug file says `__GI___strdup`), without a line. Reading the C
/// library's debug information cost every process 40 ms at exit (150 ms under load: a build's
/// every process whose report showed one such frame). Its own functions that it does not
/// export are named from the debug information still.
fn c_library_frame(addr: u64, module: &Option<String>) -> Option<Frame> {
    let path = module.as_deref()?;
    if !path.rsplit('/').next().is_some_and(|name| name.starts_with("libc.so")) {
        return None;
    }
    // A return address follows its call: the call's last byte is the function's.
    let (name, start) = exported_function(addr - 1)?;
    // The loader gives one of a function's aliases (`__strdup`): the public one if it has it.
    let public = name.trim_start_matches('_');
    let name =
        if public.len() < name.len() && library_symbol(path, public) == Some(start) { public.to_owned() } else { name };
    let module = module.clone();
    Some(Frame {
        address: format!("{addr:#x}"),
        function: Some(name),
        file: None,
        line: None,
        module,
        offset: None,
        unloaded: false,
    })
}

/// The code of `__libc_start_main` (`[start, end)`) and the load address of its library.
fn libc_start_main() -> Option<(u64, u64, u64)> {
    // SAFETY: the name is NUL-terminated; dlsym only looks it up.
    let start = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"__libc_start_main".as_ptr()) } as u64;
    if start == 0 {
        return None;
    }
    let symbol = dynamic_symbol(start)?;
    Some((start, start + symbol.size.max(1), symbol.base))
}

/// Where the C library's start-up lies, below `main`: the program's entry point (`_start`),
/// the code of `__libc_start_main`, which it calls, the library that holds it, and the return
/// address into the function of that library that calls `main` (glibc 2.34 and later:
/// `__libc_start_call_main`), once a stack has shown it. Found from the auxiliary vector, the
/// dynamic symbol table and the stacks themselves: naming those frames from their debug
/// information is what their leaving out spares.
#[derive(Clone, Copy)]
pub(crate) struct StartUp {
    entry: u64,
    libc_start_main: Option<(u64, u64, u64)>,
    calls_main: u64,
}

impl StartUp {
    /// The process's start-up code; `None` when the auxiliary vector names no entry point.
    pub(crate) fn find() -> Option<Self> {
        // SAFETY: getauxval only reads the auxiliary vector the kernel gave the process.
        let entry = unsafe { libc::getauxval(libc::AT_ENTRY) };
        (entry != 0).then(|| StartUp { entry, libc_start_main: libc_start_main(), calls_main: 0 })
    }

    fn in_start_main(&self, addr: u64) -> bool {
        self.libc_start_main.is_some_and(|(start, end, _)| (start..end).contains(&addr))
    }

    fn in_libc(&self, addr: u64) -> bool {
        self.libc_start_main.is_some_and(|(_, _, base)| dl_info(addr).is_some_and(|i| i.dli_fbase as u64 == base))
    }

    /// Learns, from a stack (innermost first) that runs down through `__libc_start_main`, the
    /// return address into the function that called `main`: the frame of the C library just
    /// above, when the one above that is the program's.
    pub(crate) fn learn(&mut self, addrs: &[u64]) {
        if self.calls_main != 0 {
            return;
        }
        let Some(at) = addrs.iter().rposition(|&a| self.in_start_main(a)) else { return };
        if at >= 2 && self.in_libc(addrs[at - 1]) && !self.in_libc(addrs[at - 2]) {
            self.calls_main = addrs[at - 1];
        }
    }

    /// How many of a stack's return addresses (innermost first) lie above the start-up, that
    /// is, above `main`. At its outer end, a stack loses its frame in the entry point (whose
    /// call of `__libc_start_main` returns a few dozen bytes in), in `__libc_start_main`, and
    /// in the function that called `main` (learnt, or the frame of the C library just above
    /// `__libc_start_main` when the one above that is the program's). A stack cut short by
    /// `stack_depth` within the start-up loses what it has of it; others, a thread's, are whole.
    pub(crate) fn frames_above(&self, addrs: &[u64]) -> usize {
        let mut n = addrs.len();
        if n > 0 && addrs[n - 1].wrapping_sub(self.entry) < 64 {
            n -= 1;
        }
        let below_start_main = n > 0 && self.in_start_main(addrs[n - 1]);
        if below_start_main {
            n -= 1;
        }
        let calls_main = |a: u64| {
            if self.calls_main != 0 { a == self.calls_main } else { below_start_main && self.in_libc(a) }
        };
        if n >= 2 && calls_main(addrs[n - 1]) && !self.in_libc(addrs[n - 2]) {
            n -= 1;
        }
        n
    }
}

impl Symbolizer {
    /// `name (module)` of the global variable holding `addr`, or `module+0xoffset`.
    pub(crate) fn global(&mut self, addr: u64) -> String {
        let Some(info) = dl_info(addr) else { return format!("{addr:#x}") };
        let base = info.dli_fbase as u64;
        let Some(module) = module_of(addr) else { return format!("{addr:#x}") };
        let symbols = self.data_symbols.entry(module.clone()).or_insert_with(|| read_data_symbols(&module));
        // Executables linked at a fixed address carry absolute symbol values.
        let fixed = symbols.first().is_some_and(|s| s.0 >= base);
        let at = if fixed { addr } else { addr - base };
        let i = symbols.partition_point(|s| s.0 <= at);
        match i.checked_sub(1).map(|i| &symbols[i]).filter(|s| at < s.1) {
            // Demangled here, not when read: a library has thousands, a report names a few.
            Some((start, _, name)) if *start == at => format!("{} ({module})", demangle(name)),
            Some((start, _, name)) => format!("{}+{:#x} ({module})", demangle(name), at - start),
            None => format!("{module}+{:#x}", addr - base),
        }
    }

    /// The frames of return address `addr` of stack `stack` (an id of the stack table): from
    /// the file of the library it was in if that library was unloaded since.
    pub(crate) fn frames_of_stack(&mut self, stack: u32, addr: u64) -> &[Frame] {
        match super::unloaded::covering(stack, addr) {
            Some(library) => self.unloaded_frames(&library, addr),
            None => self.frames(addr),
        }
    }

    fn unloaded_frames(&mut self, library: &super::unloaded::Unloaded, addr: u64) -> &[Frame] {
        let probe = addr - library.bias - 1;
        let loader = self.files.entry(library.path.to_string()).or_insert_with(|| {
            // A stripped library's lines are in its separate debug file.
            let file = super::debuglink::separate_file(&library.path);
            file.map_or_else(|| addr2line::Loader::new(&*library.path), addr2line::Loader::new).ok()
        });
        self.unloaded_cache.entry((library.path.to_string(), probe)).or_insert_with(|| {
            let module = Some(library.path.to_string());
            let frame = |function: Option<String>, file: Option<String>, line: Option<u32>| Frame {
                address: format!("{addr:#x}"),
                offset: function.is_none().then_some(addr - library.bias),
                function,
                file,
                line,
                module: module.clone(),
                unloaded: true,
            };
            let mut frames = loader.as_ref().map_or_else(Vec::new, |loader| frames_in_file(loader, probe, frame));
            if frames.is_empty() {
                frames.push(frame(None, None, None));
            }
            frames
        })
    }

    /// The frames (innermost inlined call first) of return address `addr`.
    pub(crate) fn frames(&mut self, addr: u64) -> &[Frame] {
        if !self.cache.contains_key(&addr) {
            let frames = self.resolve(addr);
            self.cache.insert(addr, frames);
        }
        &self.cache[&addr]
    }

    fn resolve(&mut self, addr: u64) -> Vec<Frame> {
        let module = module_of(addr);
        if let Some(frame) = c_library_frame(addr, &module) {
            return vec![frame];
        }
        let mut frames = Vec::new();
        let stale = module.as_deref().is_some_and(|path| {
            *self.stale_debuglinks.entry(path.to_owned()).or_insert_with(|| super::debuglink::links_a_stale_file(path))
        });
        // A return address points after the call; the call's line is one byte earlier. Not
        // from a debug file of another build: from the module's own file, below.
        backtrace::resolve((addr - 1) as *mut core::ffi::c_void, |sym| {
            if stale {
                return;
            }
            frames.push(Frame {
                address: format!("{addr:#x}"),
                // `{:#}`: demangled, without the hash suffix of Rust symbols.
                function: sym.name().map(|n| n.as_str().map_or_else(|| format!("{n:#}"), demangle)),
                file: sym.filename().map(|p| p.display().to_string()),
                line: sym.lineno(),
                module: module.clone(),
                offset: None,
                unloaded: false,
            });
        });
        let offset = load_bias(addr).map(|bias| addr - bias);
        if let Some(outermost) = frames.last_mut()
            && let (Some(name), Some(file), Some(offset), Some(path)) =
                (&outermost.function, &outermost.file, offset, module.as_deref())
            && let Some(full) = qualified_name(name, file, || self.symbol_in(path, offset - 1))
        {
            outermost.function = Some(full);
        }
        if frames.is_empty()
            && let (Some(offset), Some(file)) = (offset, self.file_behind(&module, addr, stale))
        {
            let frame = |function, file, line| Frame {
                address: format!("{addr:#x}"),
                offset: None,
                function,
                file,
                line,
                module: module.clone(),
                unloaded: false,
            };
            frames = frames_in_file(file, offset - 1, frame);
        }
        if frames.is_empty() && crate::unwind::is_signal_return(addr) {
            // glibc's `__restore_rt` has no symbol of its own: `??` said nothing.
            let (address, function) = (format!("{addr:#x}"), Some(super::SIGNAL_FRAME.to_owned()));
            frames.push(Frame { address, function, file: None, line: None, module, offset: None, unloaded: false });
        } else if frames.is_empty() {
            // Nothing names it (a stripped module): where it is in its file, as `addr2line
            // -e` takes it.
            let address = format!("{addr:#x}");
            frames.push(Frame { address, function: None, file: None, line: None, module, offset, unloaded: false });
        }
        frames
    }

    /// The symbol table's name of file address `probe` in the module at `path`.
    fn symbol_in(&mut self, path: &str, probe: u64) -> Option<String> {
        let loader = self.files.entry(path.to_owned()).or_insert_with(|| addr2line::Loader::new(path).ok());
        loader.as_ref()?.find_symbol(probe).map(symbol_name)
    }

    /// The file to read the frames of `addr` in `module` from where `backtrace` found none: a
    /// library's that the loader names by a relative path, by the path of the kernel's map
    /// (`module`'s: the relative one opens nothing after a `chdir`), or the program's own
    /// ([`Symbolizer::program_file`]), or any module's whose debuglink is `stale` (names a
    /// debug file of another build, which `backtrace` was not let read).
    fn file_behind(&mut self, module: &Option<String>, addr: u64, stale: bool) -> Option<&addr2line::Loader> {
        match module.as_deref() {
            Some(path) if stale || (path.starts_with('/') && loaded_by_relative_path(addr)) => {
                self.files.entry(path.to_owned()).or_insert_with(|| addr2line::Loader::new(path).ok()).as_ref()
            }
            _ => self.program_file(module),
        }
    }

    /// The program's file, when `module` is the program and `backtrace` named none of its
    /// frames: it reads the program through `/proc/self/exe`, which reads nothing once the
    /// main thread has called `pthread_exit` (review helper 80). A file deleted or replaced
    /// since the program started (the map names it "PATH (deleted)", which no one can open) is
    /// read through `/proc/thread-self/exe`, which still reads the file that runs; not when
    /// that link is another file (the loader, for a program it was asked to run).
    fn program_file(&mut self, module: &Option<String>) -> Option<&addr2line::Loader> {
        let module = module.as_deref()?;
        program().as_ref().filter(|(_, file)| file == module)?;
        self.program_file
            .get_or_insert_with(|| {
                if !module.ends_with(" (deleted)") {
                    return addr2line::Loader::new(module).ok();
                }
                let exe = std::fs::read_link("/proc/thread-self/exe").ok()?;
                (exe.as_os_str() == module).then(|| addr2line::Loader::new("/proc/thread-self/exe").ok()).flatten()
            })
            .as_ref()
    }
}

/// The frames of file address `probe` in the file `loader` read (innermost inlined call
/// first), each made by `frame` from its function, file and line; none if nothing names it.
fn frames_in_file(
    loader: &addr2line::Loader,
    probe: u64,
    frame: impl Fn(Option<String>, Option<String>, Option<u32>) -> Frame,
) -> Vec<Frame> {
    let mut frames = Vec::new();
    if let Ok(mut found) = loader.find_frames(probe) {
        while let Ok(Some(f)) = found.next() {
            let function = f.function.as_ref().and_then(function_name);
            let (file, line) = f.location.map_or((None, None), |l| (l.file.map(str::to_owned), l.line));
            frames.push(frame(function, file, line));
        }
    }
    if let Some(outermost) = frames.last_mut()
        && let (Some(name), Some(file)) = (&outermost.function, &outermost.file)
        && let Some(full) = qualified_name(name, file, || loader.find_symbol(probe).map(symbol_name))
    {
        outermost.function = Some(full);
    }
    // The symbol table names the function where DWARF does not cover the address.
    if frames.last().is_none_or(|f| f.function.is_none())
        && let Some(name) = loader.find_symbol(probe)
    {
        let name = symbol_name(name);
        match frames.last_mut() {
            Some(last) => last.function = Some(name),
            None => frames.push(frame(Some(name), None, None)),
        }
    }
    frames
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_function_dwarf_names_unqualified_takes_the_symbols_name() {
        let lambda = "main::{lambda(int)#1}::operator()(int) const [clone .constprop.0] [clone .isra.0]";
        let named = |dwarf, file, symbol: &str| qualified_name(dwarf, file, || Some(symbol.to_owned()));
        assert_eq!(
            named("operator()", "a.cpp", lambda).as_deref(),
            Some("main::{lambda(int)#1}::operator()(int) const")
        );
        let invoke = "void std::__invoke_impl<void, main::{lambda()#1}&>(std::__invoke_other, main::{lambda()#1}&)";
        assert_eq!(named("__invoke_impl<void, main()::<lambda()>&>", "invoke.h", invoke).as_deref(), Some(invoke));
        // A linkage name is whole: an alias folded into the same code is another function.
        assert_eq!(named("run(int)", "icf.cpp", "A::S::run(int)"), None);
        // Not a member of that symbol's scope, a C file, a qualified name.
        assert_eq!(named("through", "a.cpp", "through(std::function<void ()> const&)"), None);
        assert_eq!(named("operator()", "a.c", lambda), None);
        assert_eq!(named("A::f", "a.cpp", "A::f()"), None);
    }

    #[test]
    fn only_mangled_names_are_demangled() {
        load_cxx_runtime_demangler();
        // Short C names are valid C++ type codes: `f` is `float`, `i` is `int`, `Pc` is `char*`.
        for c_name in ["f", "i", "Pc", "main", "sqlite3_malloc", "__libc_start_main"] {
            assert_eq!(demangle(c_name), c_name);
        }
        assert_eq!(demangle("_Z3fooi"), "foo(int)");
        assert_eq!(demangle("_ZN5tokio4task5spawn17h0123456789abcdefE"), "tokio::task::spawn");
        assert_eq!(demangle("_RNvCs1234_7mycrate3foo"), "mycrate::foo");
    }

    #[test]
    fn glibcs_hidden_aliases_read_as_the_functions_programs_call() {
        assert_eq!(symbol_name("__GI_setlocale"), "setlocale");
        assert_eq!(symbol_name("__GI___libc_malloc"), "__libc_malloc");
        assert_eq!(symbol_name("__GI__IO_doallocbuf"), "_IO_doallocbuf");
        assert_eq!(symbol_name("__GI_"), "__GI_");
        assert_eq!(symbol_name("_Z3fooi"), "foo(int)");
    }

    /// As `c++filt` reads them: the `cpp_demangle` crate dropped the first parameter of a
    /// templated constructor, turned `void (&)()` into `&&`, and left the last one mangled.
    #[test]
    fn cxx_names_read_as_the_cxx_runtime_reads_them() {
        load_cxx_runtime_demangler();
        for (mangled, demangled) in [
            (
                "_ZNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEC2IS3_EEmcRKS3_",
                "std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >::basic_string<std::allocator<char> >(unsigned long, char, std::allocator<char> const&)",
            ),
            ("_ZNSt6threadC2IRFvvEJEvEEOT_DpOT0_", "std::thread::thread<void (&)(), , void>(void (&)())"),
            (
                "_ZSt11make_sharedISt5arrayIcLm200EEJEESt10shared_ptrINSt9enable_ifIXntsrSt8is_arrayIT_E5valueES5_E4typeEEDpOT0_",
                "std::shared_ptr<std::enable_if<!std::is_array<std::array<char, 200ul> >::value, std::array<char, 200ul> >::type> std::make_shared<std::array<char, 200ul>>()",
            ),
        ] {
            assert_eq!(demangle(mangled), demangled);
        }
        // An identifier in UTF-8 (GCC writes its bytes as they are): the Rust test cut a
        // character in two, and the panic aborted the program at exit.
        assert_eq!(demangle("_Z1fN2ns21XééééééééééE"), "f(ns::Xéééééééééé)");
        // A trait's impl, whose path holds dots (`..` is `::`): Rust's, not read as C++.
        let rust = "_ZN88_$LT$app..Cache$LT$fn$LP$u32$RP$$u20$.$GT$$u20$u32$GT$$u20$as$u20$core..clone..Clone$GT$5clone17hbe35a1c2d3e4f567E";
        assert!(demangle(rust).starts_with("<app::Cache<fn(u32) "), "{}", demangle(rust));
        assert!(demangle(rust).ends_with(" u32> as core::clone::Clone>::clone"), "{}", demangle(rust));
        // Legacy Rust names stay Rust's (without their hash), even where C++ reads them too.
        assert_eq!(demangle("_ZN9mallocspy5leaks5check17h0123456789abcdefE.llvm.42"), "mallocspy::leaks::check");
    }

    #[test]
    fn only_a_stack_ending_in_the_entry_point_loses_the_start_up_frames() {
        let start_up = StartUp::find().expect("an entry point");
        let above_start_up = |addrs: &[u64]| start_up.frames_above(addrs);
        let entry = start_up.entry;
        let (start, _, _) = start_up.libc_start_main.expect("glibc exports __libc_start_main");
        let in_libc = libc::strlen as *const () as u64 + 1;
        let mine = only_a_stack_ending_in_the_entry_point_loses_the_start_up_frames as *const () as u64 + 1;
        // glibc 2.34 and later: main <- __libc_start_call_main <- __libc_start_main <- _start.
        assert_eq!(above_start_up(&[mine, mine, in_libc, start + 1, entry + 0x25]), 2);
        // Before: main <- __libc_start_main <- _start.
        assert_eq!(above_start_up(&[mine, mine, start + 1, entry + 0x25]), 2);
        // Cut short by the depth within the start-up.
        assert_eq!(above_start_up(&[mine, mine, in_libc, start + 1]), 2);
        // The C library's own start-up allocations keep their frames in it.
        assert_eq!(above_start_up(&[in_libc, start + 1, entry + 0x25]), 1);
        assert_eq!(above_start_up(&[in_libc + 1, in_libc, start + 1, entry + 0x25]), 2);
        // A thread's stack is whole.
        assert_eq!(above_start_up(&[mine, in_libc, in_libc]), 3);
        assert_eq!(above_start_up(&[mine, entry + 0x1000]), 2);
        assert_eq!(above_start_up(&[]), 0);
    }
}
