//! The modules mapped into the process, as the trace records them for offline symbolization.

use core::ffi::{c_int, c_void};

use super::Module;

/// `NT_GNU_BUILD_ID`.
const NT_GNU_BUILD_ID: u32 = 3;

/// The GNU build id in a `PT_NOTE` segment's notes, if there is one.
fn build_id(notes: &[u8]) -> Option<Vec<u8>> {
    let mut at = 0;
    let word = |at: usize| notes.get(at..at + 4).map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")));
    while at + 12 <= notes.len() {
        let (name_len, desc_len, kind) = (word(at)? as usize, word(at + 4)? as usize, word(at + 8)?);
        let name_at = at + 12;
        let desc_at = name_at + name_len.next_multiple_of(4);
        let end = desc_at + desc_len.next_multiple_of(4);
        if kind == NT_GNU_BUILD_ID && notes.get(name_at..name_at + name_len) == Some(b"GNU\0") {
            return notes.get(desc_at..desc_at + desc_len).map(<[u8]>::to_vec);
        }
        at = end;
    }
    None
}

unsafe extern "C" fn collect(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
    // SAFETY: dl_iterate_phdr passes a valid info for the duration of the callback; `data` is
    // the Vec passed by `loaded`.
    let (info, list) = unsafe { (&*info, &mut *(data as *mut Vec<Module>)) };
    if info.dlpi_phdr.is_null() {
        return 0;
    }
    // SAFETY: dlpi_phdr points to dlpi_phnum program headers.
    let phdrs = unsafe { core::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
    let base = info.dlpi_addr;
    let mut module = Module { base, ..Module::default() };
    for ph in phdrs {
        let start = base + ph.p_vaddr;
        if ph.p_type == libc::PT_LOAD && ph.p_flags & libc::PF_X != 0 {
            module.ranges.push((start, start + ph.p_memsz));
        } else if ph.p_type == libc::PT_NOTE && module.build_id.is_empty() {
            // SAFETY: a PT_NOTE segment is mapped (it lies in a loaded segment).
            let notes = unsafe { core::slice::from_raw_parts(start as *const u8, ph.p_memsz as usize) };
            module.build_id = build_id(notes).unwrap_or_default();
        }
    }
    if module.ranges.is_empty() {
        return 0;
    }
    module.path = if info.dlpi_name.is_null() {
        String::new()
    } else {
        // SAFETY: the loader's names are NUL-terminated and live while the module is loaded.
        unsafe { core::ffi::CStr::from_ptr(info.dlpi_name) }.to_string_lossy().into_owned()
    };
    if module.path.is_empty() && list.is_empty() {
        // The first entry is the executable, which the loader leaves unnamed.
        module.path = std::fs::read_link("/proc/self/exe").map(|p| p.display().to_string()).unwrap_or_default();
    }
    if !module.path.is_empty() {
        list.push(module);
    }
    0
}

/// The modules loaded now (ids left 0, for the caller to number).
pub(crate) fn loaded() -> Vec<Module> {
    let mut list: Vec<Module> = Vec::with_capacity(64);
    // SAFETY: the callback matches dl_iterate_phdr's contract and only touches `list`.
    unsafe { libc::dl_iterate_phdr(Some(collect), &mut list as *mut Vec<Module> as *mut c_void) };
    list
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_test_program_and_libc_are_listed_with_their_code() {
        let here = loaded as *const () as u64;
        let list = loaded();
        let exe = list.iter().find(|m| m.ranges.iter().any(|&(s, e)| s <= here && here < e)).expect("own module");
        assert_eq!(std::path::Path::new(&exe.path), std::fs::read_link("/proc/self/exe").unwrap());
        assert!(list.iter().any(|m| m.path.contains("libc.so")), "libc in {list:?}");
        let libc = list.iter().find(|m| m.path.contains("libc.so")).unwrap();
        assert_eq!(libc.build_id.len(), 20, "Debian's libc has a SHA-1 build id");
    }
}
