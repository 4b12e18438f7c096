//! The host's file system: each operation is the syscall the store made before the
//! disk seam existed.

use super::{Disk, DiskFile, FileRef, FsSpace};
use std::fs::{File, OpenOptions};
use std::io::{self, ErrorKind};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Copy, Default)]
pub struct RealDisk;

impl Disk for RealDisk {
    fn open(&self, path: &Path, create: bool) -> io::Result<FileRef> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .open(path)?;
        Ok(Arc::new(file))
    }

    fn open_direct(&self, path: &Path) -> io::Result<Option<FileRef>> {
        let opened = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path);
        match opened {
            Ok(file) => Ok(Some(Arc::new(file))),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_dir_all(path)
    }

    fn exists(&self, path: &Path) -> io::Result<bool> {
        path.try_exists()
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(path)? {
            if let Ok(name) = entry?.file_name().into_string() {
                names.push(name);
            }
        }
        Ok(names)
    }

    fn allocated_bytes(&self, path: &Path) -> io::Result<u64> {
        Ok(std::fs::metadata(path)?.blocks() * 512)
    }

    fn space(&self, path: &Path) -> io::Result<FsSpace> {
        let device = std::fs::metadata(path)?.dev();
        let name = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(ErrorKind::InvalidInput, e))?;
        // SAFETY: `name` is a NUL-terminated path; `stat` is written by the call.
        let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(name.as_ptr(), &mut stat) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let unit = stat.f_frsize as u64;
        Ok(FsSpace {
            total_bytes: stat.f_blocks as u64 * unit,
            free_bytes: stat.f_bavail as u64 * unit,
            device,
        })
    }
}

impl DiskFile for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        FileExt::read_at(self, buf, offset)
    }

    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        FileExt::write_all_at(self, data, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        File::sync_data(self)
    }

    fn start_writeback(&self, range: u64, pause: Duration) -> io::Result<()> {
        let size = DiskFile::size(self)?;
        for offset in (0..size).step_by(range as usize) {
            // SAFETY: plain syscall on an open descriptor; no memory is passed.
            let rc = unsafe {
                libc::sync_file_range(
                    self.as_raw_fd(),
                    offset as libc::off64_t,
                    range as libc::off64_t,
                    libc::SYNC_FILE_RANGE_WRITE,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            std::thread::sleep(pause);
        }
        Ok(())
    }

    /// Falls back to writing zeroes where fallocate is unsupported.
    fn zero_range(&self, offset: u64, length: u64, punch: bool) -> io::Result<()> {
        let mode = libc::FALLOC_FL_KEEP_SIZE
            | if punch {
                libc::FALLOC_FL_PUNCH_HOLE
            } else {
                libc::FALLOC_FL_ZERO_RANGE
            };
        // SAFETY: plain syscall on an open descriptor; no memory is passed.
        let rc = unsafe {
            libc::fallocate(
                self.as_raw_fd(),
                mode,
                offset as libc::off_t,
                length as libc::off_t,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(e);
        }
        let zeroes = vec![0u8; 1 << 20];
        let mut at = offset;
        let end = offset + length;
        while at < end {
            let n = (end - at).min(zeroes.len() as u64) as usize;
            FileExt::write_all_at(self, &zeroes[..n], at)?;
            at += n as u64;
        }
        Ok(())
    }

    fn set_len(&self, length: u64) -> io::Result<()> {
        File::set_len(self, length)
    }

    fn allocate(&self, length: u64) -> io::Result<()> {
        // SAFETY: plain syscall on an open descriptor; no memory is passed.
        let rc = unsafe { libc::fallocate(self.as_raw_fd(), 0, 0, length as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(e);
        }
        // No fallocate here: at least the size, written as zeroes where it grows.
        let size = self.metadata()?.len();
        let zeroes = vec![0u8; 1 << 20];
        let mut at = size;
        while at < length {
            let n = (length - at).min(zeroes.len() as u64) as usize;
            FileExt::write_all_at(self, &zeroes[..n], at)?;
            at += n as u64;
        }
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn extents(&self) -> io::Result<Vec<(u64, u64)>> {
        let seek = |offset: u64, whence| {
            // SAFETY: plain syscall on an open descriptor; no memory is passed.
            let at = unsafe { libc::lseek(self.as_raw_fd(), offset as libc::off_t, whence) };
            if at >= 0 {
                Ok(Some(at as u64))
            } else {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::ENXIO) => Ok(None), // no data after `offset`
                    _ => Err(e),
                }
            }
        };
        let mut out = Vec::new();
        let mut at = 0;
        while let Some(start) = seek(at, libc::SEEK_DATA)? {
            let end = seek(start, libc::SEEK_HOLE)?.expect("a file ends in a hole");
            out.push((start, end - start));
            at = end;
        }
        Ok(out)
    }

    fn try_lock(&self) -> io::Result<bool> {
        // SAFETY: plain syscall on an open descriptor.
        if unsafe { libc::flock(self.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            ErrorKind::WouldBlock => Ok(false),
            _ => Err(e),
        }
    }
}
