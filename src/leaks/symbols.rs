//! Return addresses to functions, files and lines, at report time only (the hook path keeps
//! raw addresses). Inlined calls become frames of their own, as in memcheck's reports.

use std::collections::HashMap;
use std::ffi::CStr;

use serde::Serialize;

/// One frame of a reported stack.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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
}

/// Resolves addresses, remembering each answer.
#[derive(Default)]
pub(crate) struct Symbolizer {
    cache: HashMap<u64, Vec<Frame>>,
}

fn module_of(addr: u64) -> Option<String> {
    // SAFETY: Dl_info is plain data; dladdr only writes it.
    let mut info: libc::Dl_info = unsafe { core::mem::zeroed() };
    // SAFETY: any address may be asked about.
    if unsafe { libc::dladdr(addr as *const libc::c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returns a NUL-terminated path owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    if name.is_empty() {
        std::fs::read_link("/proc/self/exe").ok().map(|p| p.display().to_string())
    } else {
        Some(name)
    }
}

impl Symbolizer {
    /// The frames (innermost inlined call first) of return address `addr`.
    pub(crate) fn frames(&mut self, addr: u64) -> &[Frame] {
        self.cache.entry(addr).or_insert_with(|| {
            let module = module_of(addr);
            let mut frames = Vec::new();
            // A return address points after the call; the call's line is one byte earlier.
            backtrace::resolve((addr - 1) as *mut core::ffi::c_void, |sym| {
                frames.push(Frame {
                    address: format!("{addr:#x}"),
                    // `{:#}`: demangled, without the hash suffix of Rust symbols.
                    function: sym.name().map(|n| format!("{n:#}")),
                    file: sym.filename().map(|p| p.display().to_string()),
                    line: sym.lineno(),
                    module: module.clone(),
                });
            });
            if frames.is_empty() {
                frames.push(Frame { address: format!("{addr:#x}"), function: None, file: None, line: None, module });
            }
            frames
        })
    }
}
