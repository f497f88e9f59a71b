//! Where `--output` goes, made ready before the trace is read: an output that cannot be
//! written fails at once, not after a minute of reading and symbolizing.
//!
//! A regular file is replaced whole: the report goes to a new file beside it, given the old
//! one's mode, and renamed over it once written. Written in place, a report that failed half
//! way (a full disk, a file size limit) left neither the old contents nor the new. Anything
//! else is written in place, as `std::fs::write` does: a device or `/dev/stdout`, a FIFO, a
//! file with other hard links (a new file would leave them the old report), and a symbolic
//! link to nothing yet (written through, the link kept). A link to a file replaces the file
//! it points to, not the link.

use std::fs::{File, OpenOptions, Permissions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::text::path_shown;

/// An `--output` ready to take the report.
pub struct Output {
    /// As the user named it, for messages.
    shown: String,
    how: How,
}

enum How {
    /// Written in place.
    InPlace(PathBuf),
    /// Written to `temp`, then renamed over `target`.
    Replace { temp: PathBuf, file: Option<File>, target: PathBuf, mode: Option<Permissions> },
}

impl Output {
    /// Makes `file` ready: the new file beside it made, or, for one written in place that does
    /// not exist yet, its directory checked.
    ///
    /// # Errors
    /// One line for the user.
    pub fn prepare(file: &Path) -> Result<Output, String> {
        let shown = path_shown(file);
        let failed = |e: std::io::Error| format!("{shown}: {e}");
        let how = match std::fs::metadata(file) {
            Ok(m) if m.is_file() && m.nlink() == 1 => {
                let target = std::fs::canonicalize(file).map_err(failed)?;
                Self::beside(target, Some(m.permissions())).map_err(failed)?
            }
            Ok(m) if m.is_dir() => return Err(format!("{shown}: it is a directory")),
            Ok(_) => How::InPlace(file.to_path_buf()),
            // A link to nothing yet: written through.
            Err(e) if e.kind() == ErrorKind::NotFound && std::fs::symlink_metadata(file).is_ok() => {
                How::InPlace(file.to_path_buf())
            }
            Err(e) if e.kind() == ErrorKind::NotFound => Self::beside(file.to_path_buf(), None).map_err(failed)?,
            Err(e) => return Err(failed(e)),
        };
        Ok(Output { shown, how })
    }

    /// A new file beside `target`, to be renamed over it.
    fn beside(target: PathBuf, mode: Option<Permissions>) -> std::io::Result<How> {
        let name = target.file_name().map_or_else(|| "report".into(), |n| n.to_string_lossy().into_owned());
        let temp = target.with_file_name(format!(".{name}.mallocspy-report-{}", std::process::id()));
        let file = OpenOptions::new().write(true).create_new(true).open(&temp)?;
        Ok(How::Replace { temp, file: Some(file), target, mode })
    }

    /// Writes the report; the old contents stay if that fails.
    ///
    /// # Errors
    /// One line for the user.
    pub fn write(mut self, bytes: &[u8]) -> Result<(), String> {
        let shown = &self.shown;
        let failed = |e: std::io::Error| format!("{shown}: {e}");
        match &mut self.how {
            How::InPlace(path) => std::fs::write(path, bytes).map_err(failed),
            How::Replace { temp, file, target, mode } => {
                let mut file = file.take().expect("written once");
                file.write_all(bytes).and_then(|()| file.sync_all()).map_err(failed)?;
                if let Some(mode) = mode.take() {
                    file.set_permissions(mode).map_err(failed)?;
                }
                drop(file);
                std::fs::rename(&*temp, &*target).map_err(failed)?;
                // Renamed: nothing left to remove.
                *temp = PathBuf::new();
                Ok(())
            }
        }
    }
}

impl Drop for Output {
    /// A report not written (the trace was corrupt, or the write failed) leaves no new file.
    fn drop(&mut self) {
        if let How::Replace { temp, .. } = &self.how
            && !temp.as_os_str().is_empty()
        {
            let _ = std::fs::remove_file(temp);
        }
    }
}
