//! The modules mapped into the process, as the trace records them for offline symbolization.

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

/// What the trace needs of an ELF file: the virtual address of its first loadable segment
/// (page-rounded), that segment's file offset (page-rounded), and its build id.
type ElfFacts = (u64, u64, Vec<u8>);

/// The [`ElfFacts`] of the file at `path`, if it is a 64-bit little-endian ELF file.
fn elf_facts(path: &[u8]) -> Option<ElfFacts> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(std::ffi::OsStr::from_bytes(path)).ok()?;
    let mut ehdr = [0u8; 64];
    file.read_exact_at(&mut ehdr, 0).ok()?;
    // 64-bit little-endian ELF only (the platforms the interposer is built for).
    if &ehdr[..4] != b"\x7fELF" || ehdr[4] != 2 || ehdr[5] != 1 {
        return None;
    }
    let u16_at = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]) as u64;
    let u32_at = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let (phoff, phentsize, phnum) = (u64_at(&ehdr, 0x20), u16_at(&ehdr, 0x36) as usize, u16_at(&ehdr, 0x38) as usize);
    if phentsize < 56 || phnum == 0 || phnum > 256 {
        return None;
    }
    let mut phdrs = vec![0u8; phentsize * phnum];
    file.read_exact_at(&mut phdrs, phoff).ok()?;
    let page = crate::os::page_size() as u64;
    let mut first_load = None;
    let mut build = Vec::new();
    for ph in phdrs.chunks_exact(phentsize) {
        let (kind, offset, vaddr, filesz) = (u32_at(ph, 0), u64_at(ph, 8), u64_at(ph, 16), u64_at(ph, 32));
        if kind == libc::PT_LOAD && first_load.is_none() {
            first_load = Some((vaddr & !(page - 1), offset & !(page - 1)));
        } else if kind == libc::PT_NOTE && build.is_empty() && filesz <= 1 << 20 {
            let mut notes = vec![0u8; filesz as usize];
            if file.read_exact_at(&mut notes, offset).is_ok() {
                build = build_id(&notes).unwrap_or_default();
            }
        }
    }
    let (vaddr, offset) = first_load?;
    Some((vaddr, offset, build))
}

/// What the map adds to the path of a file deleted or replaced since it was mapped.
const GONE: &[u8] = b" (deleted)";

/// The [`ElfFacts`] of the file of mapping `m` of process `pid` when the map says it is gone
/// (deleted, or replaced: a program rebuilt while it runs), read through the mapping itself
/// (`/proc/PID/map_files`, where the kernel lets us) or, for the program's own file, through
/// `/proc/PID/exe`, which still opens it. Such a module was left out of the trace, and every
/// frame of the program was a bare address (review helper 75).
fn elf_facts_of_gone(pid: u32, m: &Mapping) -> Option<ElfFacts> {
    use std::os::unix::fs::MetadataExt;
    if !m.path.ends_with(GONE) {
        return None;
    }
    let mapped = format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end);
    elf_facts(mapped.as_bytes()).or_else(|| {
        let exe = format!("/proc/{pid}/exe");
        let same_file = std::fs::metadata(&exe).is_ok_and(|f| f.ino() == m.file.1);
        same_file.then(|| elf_facts(exe.as_bytes())).flatten()
    })
}

/// One line of `/proc/PID/maps`.
struct Mapping<'a> {
    start: u64,
    end: u64,
    executable: bool,
    offset: u64,
    /// The file's device and inode, as the map gives them.
    file: (&'a [u8], u64),
    /// The file's path, as bytes: a path need not be UTF-8.
    path: &'a [u8],
}

fn mapping(line: &[u8]) -> Option<Mapping<'_>> {
    let mut fields = line.splitn(6, |&c| c == b' ');
    let (range, perms, offset, dev, inode) =
        (fields.next()?, fields.next()?, fields.next()?, fields.next()?, fields.next()?);
    let path = fields.next()?.trim_ascii_start();
    let hex = |h: &[u8]| u64::from_str_radix(core::str::from_utf8(h).ok()?, 16).ok();
    let (start, end) = range.split_at(range.iter().position(|&c| c == b'-')?);
    Some(Mapping {
        start: hex(start)?,
        end: hex(&end[1..])?,
        executable: perms.get(2) == Some(&b'x'),
        offset: hex(offset)?,
        file: (dev, core::str::from_utf8(inode).ok()?.parse().ok()?),
        path,
    })
}

/// What [`elf_facts`] found in each file, by device and inode: the writer reads the map
/// again each time a stack names unknown code, and a program that loads and unloads a
/// library in a loop makes it do so at each `dlclose` (see [`crate::dl_close`]).
#[derive(Default)]
pub(crate) struct ElfCache(crate::fixed_hash::HashMap<(Vec<u8>, u64), Option<ElfFacts>>);

/// Process `pid`'s memory map. `/proc/PID/maps` is the main thread's view, and it reads
/// empty once the main thread has ended by `pthread_exit` while others live on; then any
/// live thread's map is the same map. Bytes, not text: one file mapped under a name that is
/// not UTF-8 must not hide the others.
fn maps_of(pid: u32) -> Vec<u8> {
    let maps = std::fs::read(format!("/proc/{pid}/maps")).unwrap_or_default();
    if !maps.is_empty() {
        return maps;
    }
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return maps };
    tasks
        .filter_map(|task| std::fs::read(task.ok()?.path().join("maps")).ok())
        .find(|maps| !maps.is_empty())
        .unwrap_or_default()
}

/// A file's path as a process's memory map spells it, as the file is named: the kernel writes a
/// newline in a path as `\012` (the only character it escapes there), and that spelling opens
/// nothing (a program in such a directory had every frame unnamed: review helper 106). A file
/// whose name holds `\012` itself keeps it.
pub(crate) fn unescaped_map_path(path: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    use std::os::unix::ffi::OsStrExt;
    const NEWLINE: &[u8] = b"\\012";
    if !path.windows(NEWLINE.len()).any(|w| w == NEWLINE)
        || std::path::Path::new(std::ffi::OsStr::from_bytes(path)).exists()
    {
        return path.into();
    }
    let mut out = Vec::with_capacity(path.len());
    let mut rest = path;
    while !rest.is_empty() {
        if rest.starts_with(NEWLINE) {
            out.push(b'\n');
            rest = &rest[NEWLINE.len()..];
        } else {
            out.push(rest[0]);
            rest = &rest[1..];
        }
    }
    out.into()
}

/// The modules mapped into process `pid` now, from its memory map and their files (ids
/// left 0, for the caller to number). The writer process reads another process's map this
/// way; a module whose file is gone or is not ELF is left out. Empty when the process is
/// gone.
pub(crate) fn of_process(pid: u32, cache: &mut ElfCache) -> Vec<Module> {
    let maps = maps_of(pid);
    let mut list: Vec<Module> = Vec::new();
    let mut seen: Vec<&[u8]> = Vec::new();
    let lines: Vec<_> = maps.split(|&c| c == b'\n').filter_map(mapping).filter(|m| m.path.starts_with(b"/")).collect();
    for m in &lines {
        let path = m.path;
        if seen.contains(&path) {
            continue;
        }
        seen.push(path);
        // Only a file with code mapped is a module: a data file (the locale archive, the
        // trace's queue, shown as `/dev/zero (deleted)`) is not opened.
        if !lines.iter().any(|other| other.path == path && other.executable) {
            continue;
        }
        let key = (m.file.0.to_vec(), m.file.1);
        let named = unescaped_map_path(path);
        let facts = cache.0.entry(key).or_insert_with(|| elf_facts(&named).or_else(|| elf_facts_of_gone(pid, m)));
        let Some((vaddr, offset, build_id)) = facts.clone() else { continue };
        let mine = || lines.iter().filter(move |m| m.path == path);
        let Some(first) = mine().find(|m| m.offset == offset) else { continue };
        let ranges: Vec<(u64, u64)> = mine().filter(|m| m.executable).map(|m| (m.start, m.end)).collect();
        if ranges.is_empty() {
            continue;
        }
        // A path that is not UTF-8 is listed as near as text can say it: the report cannot
        // open that spelling, and names the module's frames by offset. A file gone since it
        // was mapped is listed under its path: put back, or found by its build id, it names
        // the frames again (and a different file there is told apart by the report).
        let path = String::from_utf8_lossy(named.strip_suffix(GONE).unwrap_or(&named)).into_owned();
        list.push(Module { id: 0, path, base: first.start.wrapping_sub(vaddr), ranges, build_id });
    }
    list
}

/// The running program's own module, as a trace records it (id 0): for writing a trace by
/// hand whose frames are the program's own functions, as the report's tests do.
pub fn this_executable() -> Option<Module> {
    let exe = std::fs::read_link("/proc/self/exe").ok()?;
    of_process(std::process::id(), &mut ElfCache::default()).into_iter().find(|m| std::path::Path::new(&m.path) == exe)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held by the tests that map a file or read the map twice: the map must not change
    /// between the two readings of one.
    static MAP: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// The executable's load bias, as the loader knows it (it lists the executable first).
    fn exe_bias() -> u64 {
        let mut bias = 0u64;
        crate::os::each_module(|m| {
            bias = m.bias;
            true
        });
        bias
    }

    #[test]
    fn this_test_program_and_libc_are_listed_with_their_code_bias_and_build_id() {
        let _alone = MAP.lock().unwrap_or_else(|e| e.into_inner());
        let here = of_process as *const () as u64;
        let mut cache = ElfCache::default();
        let list = of_process(std::process::id(), &mut cache);
        let exe = list.iter().find(|m| m.ranges.iter().any(|&(s, e)| s <= here && here < e)).expect("own module");
        assert_eq!(std::path::Path::new(&exe.path), std::fs::read_link("/proc/self/exe").unwrap());
        assert_eq!(exe.base, exe_bias(), "the loader's bias");
        let libc = list.iter().find(|m| m.path.contains("libc.so")).expect("libc listed");
        assert_eq!(libc.build_id.len(), 20, "Debian's libc has a SHA-1 build id");
        assert!(of_process(u32::MAX, &mut cache).is_empty(), "no such process: nothing");
        assert_eq!(of_process(std::process::id(), &mut cache), list, "the same again, from the cache");
        assert_eq!(this_executable().as_ref(), Some(exe));
    }

    /// A program whose file was deleted while it runs is listed under the file's path, with
    /// its build id: it was left out, and the report named its frames by bare addresses.
    #[test]
    fn a_program_whose_file_was_deleted_is_listed_with_its_build_id() {
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("sleeper");
        std::fs::copy("/bin/sleep", &copy).unwrap();
        let mut child = std::process::Command::new(&copy).arg("30").spawn().unwrap();
        // Its code mapped: `/proc/PID/exe` names the new program before the kernel maps it.
        let path = copy.display().to_string();
        let mapped =
            |maps: &[u8]| String::from_utf8_lossy(maps).lines().any(|l| l.ends_with(&path) && l.contains(" r-xp "));
        let started = std::time::Instant::now();
        while !mapped(&maps_of(child.id())) {
            assert!(started.elapsed().as_secs() < 10, "the copy did not start");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        std::fs::remove_file(&copy).unwrap();
        let list = of_process(child.id(), &mut ElfCache::default());
        let maps = String::from_utf8_lossy(&maps_of(child.id())).into_owned();
        child.kill().unwrap();
        child.wait().unwrap();
        let listed = list.iter().find(|m| std::path::Path::new(&m.path) == copy);
        let listed = listed.unwrap_or_else(|| panic!("the deleted program, in {list:?}\n{maps}"));
        let (_, _, build_id) = elf_facts(b"/bin/sleep").unwrap();
        assert!(!build_id.is_empty(), "Debian's sleep has a build id");
        assert_eq!(listed.build_id, build_id);
        assert!(!listed.ranges.is_empty());
    }

    #[test]
    fn a_file_mapped_under_a_name_that_is_not_utf8_hides_no_module() {
        let _alone = MAP.lock().unwrap_or_else(|e| e.into_inner());
        use std::os::fd::AsRawFd;
        use std::os::unix::ffi::OsStrExt;
        // An ELF file (this test program) under a Latin-1 name, mapped as code.
        let dir = tempfile::tempdir().unwrap();
        let odd = dir.path().join(std::ffi::OsStr::from_bytes(b"caf\xe9.so"));
        std::fs::copy(std::fs::read_link("/proc/self/exe").unwrap(), &odd).unwrap();
        let file = std::fs::File::open(&odd).unwrap();
        let (prot, len) = (libc::PROT_READ | libc::PROT_EXEC, 4096);
        // SAFETY: maps the file's first page privately; unmapped before the test ends.
        let at = unsafe { libc::mmap(core::ptr::null_mut(), len, prot, libc::MAP_PRIVATE, file.as_raw_fd(), 0) };
        assert_ne!(at, libc::MAP_FAILED);
        let list = of_process(std::process::id(), &mut ElfCache::default());
        // SAFETY: the mapping made above, used by nothing else.
        unsafe { libc::munmap(at, len) };
        assert!(list.iter().any(|m| m.path.contains("libc.so")), "the other modules are listed: {list:?}");
        let named = list.iter().find(|m| m.path.ends_with("/caf\u{FFFD}.so")).expect("the odd file, named lossily");
        assert_eq!(named.ranges, [(at as u64, at as u64 + len as u64)]);
        assert_eq!(named.base, at as u64, "its first segment lies at file offset 0 and address 0");
    }

    /// The kernel's map writes a newline in a path as `\012`: the file is found under its name
    /// (its frames were bare addresses), and a file named with `\012` itself keeps it.
    #[test]
    fn a_newline_in_a_mapped_path_is_the_files_own() {
        let dir = tempfile::tempdir().unwrap();
        let with_newline = dir.path().join("a\nb");
        std::fs::write(&with_newline, b"").unwrap();
        let spelled = format!("{}/a\\012b", dir.path().display());
        assert_eq!(&*unescaped_map_path(spelled.as_bytes()), with_newline.as_os_str().as_encoded_bytes());
        std::fs::write(&spelled, b"").unwrap();
        assert_eq!(&*unescaped_map_path(spelled.as_bytes()), spelled.as_bytes(), "a real `\\012` stays");
        let plain = format!("{}/plain", dir.path().display());
        assert_eq!(&*unescaped_map_path(plain.as_bytes()), plain.as_bytes());
    }
}
