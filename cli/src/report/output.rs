//! Where `--output` goes, checked before the trace is read: an output that cannot be written
//! fails at once, not after a minute of reading and symbolizing.
//!
//! The report is written in place, as `std::fs::write` (and a shell's `>`) does: a device or
//! `/dev/stdout`, a FIFO, a symbolic link, the file's owner, mode, hard links and attributes
//! keep what they were. A new file renamed over the old one would keep the old contents when
//! the write fails (a full disk), but it replaced the file a redirected `/dev/stdout` named,
//! failed in a directory the user cannot write, and lost the file's owner (review helper 38).

use std::fs::OpenOptions;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use super::text::path_shown;

/// An `--output` that looked writable before the trace was read.
pub struct Output {
    path: PathBuf,
}

impl Output {
    /// Checks `file` without changing it: an existing regular file opens for writing (not
    /// emptied), and a new one's directory exists. A device, a FIFO (opening one would wait
    /// for its reader) and a link to nothing yet are left to the write.
    ///
    /// # Errors
    /// One line for the user.
    pub fn prepare(file: &Path) -> Result<Output, String> {
        let shown = path_shown(file);
        // A name ending in `/` is a directory's, existing or not (`open` says EISDIR): asked
        // after the trace was read, where this took its parent for the file's (review helper 123).
        if file.as_os_str().as_encoded_bytes().ends_with(b"/") {
            return Err(format!("{shown}: it is a directory"));
        }
        match std::fs::metadata(file) {
            Ok(m) if m.is_dir() => return Err(format!("{shown}: it is a directory")),
            Ok(m) if m.is_file() => {
                OpenOptions::new().write(true).open(file).map_err(|e| format!("{shown}: {e}"))?;
            }
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NotFound && std::fs::symlink_metadata(file).is_err() => {
                let dir = match file.parent() {
                    Some(dir) if !dir.as_os_str().is_empty() => dir,
                    _ => Path::new("."),
                };
                std::fs::metadata(dir).map_err(|e| format!("{shown}: {e}"))?;
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{shown}: {e}")),
        }
        Ok(Output { path: file.to_path_buf() })
    }

    /// Writes the report in place.
    ///
    /// # Errors
    /// One line for the user.
    pub fn write(self, bytes: &[u8]) -> Result<(), String> {
        std::fs::write(&self.path, bytes).map_err(|e| format!("{}: {e}", path_shown(&self.path)))
    }
}
