//! The NFSv3 file system over the listing: image files whose bytes are the volumes'.
//!
//! A volume opens (through [`Volumes`], writable: it takes the lease as the NBD
//! gateway does) on its first READ, WRITE or COMMIT, not on LOOKUP or GETATTR, so
//! listing the directory opens nothing. An UNSTABLE write is the NBD write (early
//! acknowledgement where the volume's write mode allows it) and COMMIT is the NBD
//! FLUSH; a DATA_SYNC or FILE_SYNC write is a write with FUA. The names are the
//! cluster's: creating, removing or renaming a file, and changing a file's size, are
//! refused with `NFS3ERR_ACCES` (volumes are made with `floe volume`).

use crate::listing::{Entry, Listing, ROOT};
use bytes::Bytes;
use floe_blockdev::{BlockDevice, IoError};
use floe_gateway::Volumes;
use nfs3_server::nfs3_types::nfs3::{
    createverf3, fattr3, filename3, ftype3, nfspath3, nfsstat3, nfstime3, post_op_attr, sattr3,
    specdata3, stable_how, FSINFO3resok, Nfs3Option, FSF3_CANSETTIME, FSF3_HOMOGENEOUS,
};
use nfs3_server::vfs::{
    DirEntryPlus, FileHandleU64, NextResult, NfsFileSystem, NfsReadFileSystem, ReadDirPlusIterator,
};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

#[derive(Clone)]
pub struct Files(Arc<Inner>);

struct Inner {
    listing: Listing,
    volumes: Volumes,
    /// Open volumes by file id. These are the only long-lived holders of the stacks:
    /// dropping one (idle, or at exit) releases the volume's lease.
    open: Mutex<BTreeMap<u64, Held>>,
    /// Opens one at a time, so two requests to a closed volume share one stack.
    opening: tokio::sync::Mutex<()>,
}

struct Held {
    name: String,
    device: Arc<dyn BlockDevice>,
    used: Instant,
}

/// When the server started: the directory's times (volumes carry none of their own).
fn started() -> nfstime3 {
    static STARTED: std::sync::OnceLock<nfstime3> = std::sync::OnceLock::new();
    *STARTED.get_or_init(|| nfstime3::try_from(SystemTime::now()).unwrap_or_default())
}

fn attributes(fileid: u64, type_: ftype3, mode: u32, size: u64) -> fattr3 {
    fattr3 {
        type_,
        mode,
        nlink: if type_ == ftype3::NF3DIR { 2 } else { 1 },
        uid: 0,
        gid: 0,
        size,
        used: size,
        rdev: specdata3::default(),
        fsid: 0,
        fileid,
        atime: started(),
        mtime: started(),
        ctime: started(),
    }
}

fn root_attributes() -> fattr3 {
    attributes(ROOT, ftype3::NF3DIR, 0o755, 0)
}

fn file_attributes(entry: &Entry) -> fattr3 {
    let mode = if entry.writable { 0o644 } else { 0o444 };
    attributes(entry.fileid, ftype3::NF3REG, mode, entry.size_bytes)
}

/// A failed device request as NFS tells it.
fn status(error: &IoError) -> nfsstat3 {
    match error {
        IoError::InvalidRange(_) => nfsstat3::NFS3ERR_INVAL,
        IoError::NoSpace(_) => nfsstat3::NFS3ERR_NOSPC,
        IoError::ReadOnly => nfsstat3::NFS3ERR_ROFS,
        IoError::Io(_) => nfsstat3::NFS3ERR_IO,
    }
}

fn master_unreachable(error: String) -> nfsstat3 {
    tracing::warn!("{error}");
    nfsstat3::NFS3ERR_IO
}

/// Refuses a change to the directory, saying why in the log (the client only sees
/// "permission denied").
fn refused(what: &str, name: &filename3<'_>) -> nfsstat3 {
    let name = String::from_utf8_lossy(name.as_ref());
    tracing::warn!(
        name = %name,
        "refused to {what}: files are the cluster's volumes (see `floe volume`)"
    );
    nfsstat3::NFS3ERR_ACCES
}

impl Files {
    pub fn new(listing: Listing, volumes: Volumes) -> Files {
        Files(Arc::new(Inner {
            listing,
            volumes,
            open: Mutex::new(BTreeMap::new()),
            opening: tokio::sync::Mutex::new(()),
        }))
    }

    /// The file behind `id`; the directory is not one.
    async fn entry(&self, id: &FileHandleU64) -> Result<Entry, nfsstat3> {
        if id.as_u64() == ROOT {
            return Err(nfsstat3::NFS3ERR_ISDIR);
        }
        self.0
            .listing
            .by_id(id.as_u64())
            .await
            .map_err(master_unreachable)?
            .ok_or(nfsstat3::NFS3ERR_STALE)
    }

    fn held(&self, fileid: u64) -> Option<Arc<dyn BlockDevice>> {
        let mut open = self.0.open.lock().unwrap();
        let held = open.get_mut(&fileid)?;
        held.used = Instant::now();
        Some(held.device.clone())
    }

    /// The open stack of `entry`, opened now if it is not.
    async fn device(&self, entry: &Entry) -> Result<Arc<dyn BlockDevice>, nfsstat3> {
        if let Some(device) = self.held(entry.fileid) {
            return Ok(device);
        }
        let _opening = self.0.opening.lock().await;
        if let Some(device) = self.held(entry.fileid) {
            return Ok(device);
        }
        let device = self
            .0
            .volumes
            .open(&entry.name, entry.writable)
            .await
            .map_err(|e| {
                // E.g. another gateway holds the lease: the client sees EIO, the log says
                // who holds it.
                tracing::error!(volume = %entry.name, "cannot open: {e}");
                nfsstat3::NFS3ERR_IO
            })?;
        let held = Held {
            name: entry.name.clone(),
            device: device.clone(),
            used: Instant::now(),
        };
        self.0.open.lock().unwrap().insert(entry.fileid, held);
        Ok(device)
    }

    /// Flushes and closes the volumes no request touched for `idle`, releasing their
    /// leases for another gateway.
    pub async fn close_idle(&self, idle: Duration) {
        let quiet: Vec<u64> = {
            let open = self.0.open.lock().unwrap();
            open.iter()
                .filter(|(_, held)| held.used.elapsed() >= idle)
                .map(|(fileid, _)| *fileid)
                .collect()
        };
        for fileid in quiet {
            // Not while a request holds the stack: it would outlive the lease.
            let unused =
                |held: &Held| held.used.elapsed() >= idle && Arc::strong_count(&held.device) == 1;
            self.close(fileid, unused).await;
        }
    }

    /// Flushes and closes every open volume (the process is stopping).
    pub async fn close_all(&self) {
        let all: Vec<u64> = self.0.open.lock().unwrap().keys().copied().collect();
        for fileid in all {
            self.close(fileid, |_| true).await;
        }
    }

    /// Closes `fileid` if `still` holds, after a flush: an UNSTABLE write not yet
    /// committed is flushed before the lease goes. A flush that fails keeps the volume
    /// open, so the client's COMMIT still learns of it.
    async fn close(&self, fileid: u64, still: impl Fn(&Held) -> bool) {
        let held = {
            let mut open = self.0.open.lock().unwrap();
            match open.get(&fileid) {
                Some(held) if still(held) => open.remove(&fileid),
                _ => None,
            }
        };
        let Some(held) = held else { return };
        match held.device.flush().await {
            Ok(()) => {
                tracing::info!(volume = %held.name, "closed (idle or stopping): lease released")
            }
            Err(e) => {
                tracing::error!(volume = %held.name, "flush before closing failed, kept open: {e}");
                self.0.open.lock().unwrap().entry(fileid).or_insert(held);
            }
        }
    }
}

impl NfsReadFileSystem for Files {
    type Handle = FileHandleU64;

    fn root_dir(&self) -> FileHandleU64 {
        FileHandleU64::new(ROOT)
    }

    async fn lookup(
        &self,
        dirid: &FileHandleU64,
        filename: &filename3<'_>,
    ) -> Result<FileHandleU64, nfsstat3> {
        if dirid.as_u64() != ROOT {
            return Err(nfsstat3::NFS3ERR_NOTDIR);
        }
        let name = std::str::from_utf8(filename.as_ref()).map_err(|_| nfsstat3::NFS3ERR_NOENT)?;
        if name == "." || name == ".." {
            return Ok(self.root_dir());
        }
        let entry = self.0.listing.by_name(name).await;
        match entry.map_err(master_unreachable)? {
            Some(entry) => Ok(FileHandleU64::new(entry.fileid)),
            None => Err(nfsstat3::NFS3ERR_NOENT),
        }
    }

    async fn getattr(&self, id: &FileHandleU64) -> Result<fattr3, nfsstat3> {
        match self.entry(id).await {
            Err(nfsstat3::NFS3ERR_ISDIR) => Ok(root_attributes()),
            entry => Ok(file_attributes(&entry?)),
        }
    }

    async fn read(
        &self,
        id: &FileHandleU64,
        offset: u64,
        count: u32,
    ) -> Result<(Vec<u8>, bool), nfsstat3> {
        let entry = self.entry(id).await?;
        let size = entry.size_bytes;
        if offset >= size {
            return Ok((Vec::new(), true));
        }
        // NFS reads may ask past the end: they get what there is, and EOF.
        let length = u64::from(count).min(size - offset);
        let device = self.device(&entry).await?;
        let data = device
            .read(offset, length as u32)
            .await
            .map_err(|e| status(&e))?;
        Ok((data.to_vec(), offset + length == size))
    }

    async fn readdirplus(
        &self,
        dirid: &FileHandleU64,
        cookie: u64,
    ) -> Result<impl ReadDirPlusIterator<FileHandleU64>, nfsstat3> {
        if dirid.as_u64() != ROOT {
            return Err(nfsstat3::NFS3ERR_NOTDIR);
        }
        let entries = self.0.listing.entries().await.map_err(master_unreachable)?;
        Ok(Directory {
            entries,
            next: usize::try_from(cookie).unwrap_or(usize::MAX),
        })
    }

    async fn readlink(&self, _id: &FileHandleU64) -> Result<nfspath3<'_>, nfsstat3> {
        Err(nfsstat3::NFS3ERR_INVAL)
    }

    /// The library's defaults but for the largest file: a volume may be larger than its
    /// 128 GiB, and clients refuse offsets beyond `maxfilesize` themselves.
    async fn fsinfo(&self, root: &FileHandleU64) -> Result<FSINFO3resok, nfsstat3> {
        const MAX_TRANSFER_BYTES: u32 = 1 << 20;
        Ok(FSINFO3resok {
            obj_attributes: post_op_attr::Some(self.getattr(root).await?),
            rtmax: MAX_TRANSFER_BYTES,
            rtpref: MAX_TRANSFER_BYTES,
            rtmult: 4096,
            wtmax: MAX_TRANSFER_BYTES,
            wtpref: MAX_TRANSFER_BYTES,
            wtmult: 4096,
            dtpref: MAX_TRANSFER_BYTES,
            maxfilesize: i64::MAX as u64,
            time_delta: nfstime3 {
                seconds: 1,
                nseconds: 0,
            },
            // No symlinks, no hard links.
            properties: FSF3_HOMOGENEOUS | FSF3_CANSETTIME,
        })
    }
}

impl NfsFileSystem for Files {
    /// Attributes other than the size are accepted and ignored (a copy tool setting
    /// times or modes must not fail); the size is the volume's.
    async fn setattr(&self, id: &FileHandleU64, setattr: sattr3) -> Result<fattr3, nfsstat3> {
        let attributes = self.getattr(id).await?;
        match setattr.size {
            Nfs3Option::Some(size) if size != attributes.size => {
                tracing::warn!(
                    fileid = id.as_u64(),
                    size,
                    "refused to change an image file's size: resize the volume with \
                     `floe volume resize`"
                );
                Err(nfsstat3::NFS3ERR_ACCES)
            }
            _ => Ok(attributes),
        }
    }

    async fn write(
        &self,
        id: &FileHandleU64,
        offset: u64,
        data: &[u8],
        stable: stable_how,
    ) -> Result<(fattr3, stable_how), nfsstat3> {
        let entry = self.entry(id).await.map_err(|e| match e {
            nfsstat3::NFS3ERR_ISDIR => nfsstat3::NFS3ERR_INVAL,
            e => e,
        })?;
        if !entry.writable {
            return Err(nfsstat3::NFS3ERR_ROFS);
        }
        let end = offset.checked_add(data.len() as u64);
        if end.is_none_or(|end| end > entry.size_bytes) {
            tracing::warn!(
                volume = %entry.name,
                offset,
                length = data.len(),
                size = entry.size_bytes,
                "refused a write past the end: image files keep their volume's size"
            );
            return Err(nfsstat3::NFS3ERR_FBIG);
        }
        let device = self.device(&entry).await?;
        let fua = stable != stable_how::UNSTABLE;
        device
            .write(offset, Bytes::copy_from_slice(data), fua)
            .await
            .map_err(|e| status(&e))?;
        let committed = if fua {
            stable_how::FILE_SYNC
        } else {
            stable_how::UNSTABLE
        };
        Ok((file_attributes(&entry), committed))
    }

    /// CREATE of an existing volume (UNCHECKED, as `open(O_CREAT)` sends it) opens it;
    /// a new name is refused.
    async fn create(
        &self,
        dirid: &FileHandleU64,
        filename: &filename3<'_>,
        attr: sattr3,
    ) -> Result<(FileHandleU64, fattr3), nfsstat3> {
        let id = match self.lookup(dirid, filename).await {
            Ok(id) if id.as_u64() != ROOT => id,
            Ok(_) => return Err(nfsstat3::NFS3ERR_EXIST),
            Err(nfsstat3::NFS3ERR_NOENT) => return Err(refused("create", filename)),
            Err(e) => return Err(e),
        };
        Ok((id, self.setattr(&id, attr).await?))
    }

    async fn create_exclusive(
        &self,
        dirid: &FileHandleU64,
        filename: &filename3<'_>,
        _createverf: createverf3,
    ) -> Result<FileHandleU64, nfsstat3> {
        match self.lookup(dirid, filename).await {
            Ok(_) => Err(nfsstat3::NFS3ERR_EXIST),
            Err(nfsstat3::NFS3ERR_NOENT) => Err(refused("create", filename)),
            Err(e) => Err(e),
        }
    }

    async fn mkdir(
        &self,
        _dirid: &FileHandleU64,
        dirname: &filename3<'_>,
    ) -> Result<(FileHandleU64, fattr3), nfsstat3> {
        Err(refused("make a directory", dirname))
    }

    async fn remove(
        &self,
        _dirid: &FileHandleU64,
        filename: &filename3<'_>,
    ) -> Result<(), nfsstat3> {
        Err(refused("remove", filename))
    }

    async fn rename<'a>(
        &self,
        _from_dirid: &FileHandleU64,
        from_filename: &filename3<'a>,
        _to_dirid: &FileHandleU64,
        _to_filename: &filename3<'a>,
    ) -> Result<(), nfsstat3> {
        Err(refused("rename", from_filename))
    }

    async fn symlink<'a>(
        &self,
        _dirid: &FileHandleU64,
        linkname: &filename3<'a>,
        _symlink: &nfspath3<'a>,
        _attr: &sattr3,
    ) -> Result<(FileHandleU64, fattr3), nfsstat3> {
        Err(refused("make a symlink", linkname))
    }

    /// The volume's FLUSH: what was written UNSTABLE is durable as the write mode
    /// makes a flushed write durable. A volume not open has nothing uncommitted:
    /// closing flushed it.
    async fn commit(&self, id: &FileHandleU64, _offset: u64, _count: u32) -> Result<(), nfsstat3> {
        let entry = self.entry(id).await?;
        let Some(device) = self.held(entry.fileid) else {
            return Ok(());
        };
        device.flush().await.map_err(|e| {
            tracing::error!(volume = %entry.name, "commit failed: {e}");
            status(&e)
        })
    }
}

/// One READDIRPLUS pass over a listing; cookie `n` resumes after its `n`th entry.
struct Directory {
    entries: Arc<Vec<Entry>>,
    next: usize,
}

impl ReadDirPlusIterator<FileHandleU64> for Directory {
    async fn next(&mut self) -> NextResult<DirEntryPlus<FileHandleU64>> {
        let Some(entry) = self.entries.get(self.next) else {
            return NextResult::Eof;
        };
        self.next += 1;
        NextResult::Ok(DirEntryPlus {
            fileid: entry.fileid,
            name: entry.name.as_bytes().to_vec().into(),
            cookie: self.next as u64,
            name_attributes: Some(file_attributes(entry)),
            name_handle: Some(FileHandleU64::new(entry.fileid)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(fileid: u64, name: &str) -> Entry {
        Entry {
            fileid,
            name: name.to_string(),
            size_bytes: 1 << 20,
            writable: !name.contains('@'),
        }
    }

    /// A READDIRPLUS resumed at a cookie continues after the entry that cookie came
    /// with; snapshots are read-only files.
    #[test]
    fn a_listing_resumes_after_its_cookie() {
        let entries = Arc::new(vec![entry(2, "a"), entry(3, "a@s"), entry(4, "b")]);
        let names = |cookie: u64| {
            let mut directory = Directory {
                entries: entries.clone(),
                next: cookie as usize,
            };
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            let mut seen = Vec::new();
            while let NextResult::Ok(e) = runtime.block_on(directory.next()) {
                let attributes = e.name_attributes.expect("attributes");
                let name = String::from_utf8(e.name.as_ref().to_vec()).unwrap();
                seen.push((name, e.cookie, attributes.mode, attributes.size));
            }
            seen
        };
        let all = names(0);
        assert_eq!(
            all.iter()
                .map(|(n, c, ..)| (n.as_str(), *c))
                .collect::<Vec<_>>(),
            [("a", 1), ("a@s", 2), ("b", 3)]
        );
        assert_eq!(all[1].2, 0o444);
        assert_eq!(all[0].2, 0o644);
        assert!(all.iter().all(|(.., size)| *size == 1 << 20));
        assert_eq!(names(all[0].1), all[1..]);
        assert!(names(3).is_empty());
    }
}
