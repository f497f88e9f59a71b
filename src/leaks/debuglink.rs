//! A module's `.gnu_debuglink`: the separate debug file it names, found where gdb (and the
//! `backtrace` crate) look, and whether that file is of this very build. gdb checks the
//! link's CRC of the whole file; without the check a debug file left from an earlier build
//! named every frame with that build's lines, silently (review helper 114).

use std::ffi::OsStr;
use std::fs::File;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Where distributions install separate debug files (by build id under `.build-id`, or by
/// the module's own directory).
pub const DEBUG_ROOT: &str = "/usr/lib/debug";

/// The debug file `name` that the module at `path` links to: next to it, in its `.debug`
/// directory, or under [`DEBUG_ROOT`] by the module's directory (gdb's order).
pub fn locate(path: &Path, name: &[u8]) -> Option<PathBuf> {
    let name = Path::new(OsStr::from_bytes(name));
    let dir = path.parent()?;
    let under_root = Path::new(DEBUG_ROOT).join(dir.strip_prefix("/").unwrap_or(dir)).join(name);
    [dir.join(name), dir.join(".debug").join(name), under_root]
        .into_iter()
        .find(|candidate| candidate != path && candidate.is_file())
}

/// The path of the debug file of build id `id` under [`DEBUG_ROOT`].
pub fn by_build_id(id: &[u8]) -> Option<PathBuf> {
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    (hex.len() > 2).then(|| Path::new(DEBUG_ROOT).join(format!(".build-id/{}/{}.debug", &hex[..2], &hex[2..])))
}

/// Whether the file at `path` has the CRC-32 that a debuglink gives for it. Reads the whole
/// file, as gdb does; a file that cannot be read does not match.
pub fn crc_matches(path: &Path, crc: u32) -> bool {
    let Ok(mut file) = File::open(path) else { return false };
    let mut hasher = crc32fast::Hasher::new();
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        match file.read(&mut buffer) {
            Ok(0) => return hasher.finalize() == crc,
            Ok(n) => hasher.update(&buffer[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
}

/// Whether the `backtrace` crate would name the frames of the module at `path` from a debug
/// file of another build: it reads the debug file of the module's build id under
/// [`DEBUG_ROOT`] if there is one (the id vouches for it), else the one its debuglink names,
/// without checking the link's CRC.
pub(crate) fn links_a_stale_file(path: &str) -> bool {
    use object::Object;
    let Ok(file) = File::open(path) else { return false };
    let cache = object::ReadCache::new(file);
    let Ok(module) = object::File::parse(&cache) else { return false };
    if let Ok(Some(id)) = module.build_id()
        && by_build_id(id).is_some_and(|debug| debug.is_file())
    {
        return false;
    }
    let Ok(Some((name, crc))) = module.gnu_debuglink() else { return false };
    // Found from the module's real directory, as `backtrace` looks.
    let Ok(real) = std::fs::canonicalize(path) else { return false };
    locate(&real, name).is_some_and(|debug| !crc_matches(&debug, crc))
}

/// The separate debug file to read the frames of the module at `path` from, when the module
/// has no DWARF of its own: by its build id, else by its debuglink (a file carrying the same
/// build id, or the link's CRC). The leak report reads a library unloaded before it from
/// its file, where `addr2line` follows no link: a stripped library's frames had no lines
/// (review helper 114).
pub(crate) fn separate_file(path: &str) -> Option<PathBuf> {
    use object::{Object, ObjectSection};
    let module_file = File::open(path).ok()?;
    let cache = object::ReadCache::new(module_file);
    let module = object::File::parse(&cache).ok()?;
    // A separate debug file keeps the sections' headers with no contents: DWARF is there
    // only when the section has bytes in the file.
    if module.section_by_name(".debug_info").is_some_and(|s| s.file_range().is_some_and(|r| r.1 > 0)) {
        return None;
    }
    let id = module.build_id().ok().flatten();
    let link = module.gnu_debuglink().ok().flatten();
    find(&std::fs::canonicalize(path).ok()?, id, link)
}

/// The separate debug file of the module at `path` whose build id is `id` and whose
/// debuglink is `link` (name, CRC): by build id under [`DEBUG_ROOT`], else the linked file if
/// it carries that build id or, without one, the link's CRC.
pub fn find(path: &Path, id: Option<&[u8]>, link: Option<(&[u8], u32)>) -> Option<PathBuf> {
    if let Some(debug) = id.and_then(by_build_id).filter(|d| d.is_file()) {
        return Some(debug);
    }
    let (name, crc) = link?;
    let candidate = locate(path, name)?;
    let same_build = match id {
        Some(id) => build_id_of(&candidate).as_deref() == Some(id),
        None => crc_matches(&candidate, crc),
    };
    same_build.then_some(candidate)
}

/// The build id of the ELF file at `path`, reading only its headers and notes.
fn build_id_of(path: &Path) -> Option<Vec<u8>> {
    use object::Object;
    let cache = object::ReadCache::new(File::open(path).ok()?);
    object::File::parse(&cache).ok()?.build_id().ok().flatten().map(<[u8]>::to_vec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crc_is_gnu_debuglinks() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f.debug");
        std::fs::write(&file, b"123456789").unwrap();
        // CRC-32 (ISO-HDLC, as zlib's and the GNU debuglink's) of "123456789".
        assert!(crc_matches(&file, 0xCBF4_3926));
        assert!(!crc_matches(&file, 0xCBF4_3927));
        assert!(!crc_matches(&dir.path().join("missing"), 0));
    }

    #[test]
    fn a_link_is_found_beside_the_module_or_in_its_debug_directory() {
        let dir = tempfile::tempdir().unwrap();
        let module = dir.path().join("prog");
        std::fs::write(&module, b"").unwrap();
        assert_eq!(locate(&module, b"prog.debug"), None);
        std::fs::create_dir(dir.path().join(".debug")).unwrap();
        std::fs::write(dir.path().join(".debug/prog.debug"), b"").unwrap();
        assert_eq!(locate(&module, b"prog.debug"), Some(dir.path().join(".debug/prog.debug")));
        std::fs::write(dir.path().join("prog.debug"), b"").unwrap();
        assert_eq!(locate(&module, b"prog.debug"), Some(dir.path().join("prog.debug")));
        assert_eq!(locate(&module, b"prog"), None, "not the module itself");
    }
}
