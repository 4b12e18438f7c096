//! One log file, the data directory's write-ahead log or a journal: its header, where
//! the next batch goes, and the sequence numbers it holds (see [`crate::wal`]).

use crate::direct_log::{Batch, DirectWrites};
use crate::disk::{self, Disk, FileRef};
use crate::error::StoreError;
use crate::layout::CHUNK_BYTES_MAX;
use crate::wal::{self, HeaderError, Kind, RecordHeader, RECORD_HEADER_BYTES};
use std::io;
use std::path::{Path, PathBuf};

pub(crate) struct LogFile {
    pub(crate) file: FileRef,
    pub(crate) path: PathBuf,
    /// Format 5 (journal data on sector boundaries) or 2 (packed).
    pub(crate) aligned: bool,
    /// Where the next batch is appended.
    pub(crate) position: u64,
    /// Bytes the file may fill before a checkpoint (the plain log) or an overflow.
    pub(crate) quota: u64,
    /// Bytes allocated up front, so appends below never fail for space.
    pub(crate) allocated: u64,
    /// The header's start sequence; `None` for a new file without a header yet.
    pub(crate) start_seq: Option<u64>,
    /// Sequence numbers of the first and last record since the header was written.
    pub(crate) seqs: Option<(u64, u64)>,
    /// Synced appends bypass the page cache (see [`crate::direct_log`]).
    pub(crate) direct: Option<DirectWrites>,
    /// A batch went through the page cache since [`LogFile::take_buffered`].
    buffered: bool,
}

impl LogFile {
    pub(crate) fn open(
        disk: &dyn Disk,
        path: &Path,
        aligned: bool,
        quota: u64,
    ) -> Result<LogFile, StoreError> {
        let file = disk.open(path, true)?;
        let mut head = vec![0u8; wal::HEADER_BYTES as usize];
        let read = file.read_at(&mut head, 0)?;
        let start_seq = match wal::decode_header(&head[..read], aligned) {
            Ok(seq) => Some(seq),
            // A new file whose first header write was lost in a power cut (size
            // extended, sectors not written): no record follows a header before it
            // is synced, so it holds nothing.
            Err(_) if head[..read].iter().all(|&b| b == 0) => None,
            Err(HeaderError::NotALog) => {
                return Err(StoreError::Io(format!(
                    "{} is not a Floe write-ahead log (bad header); refusing to overwrite it",
                    path.display()
                )))
            }
            Err(HeaderError::Format(version)) => {
                return Err(StoreError::Io(format!(
                    "{} is a write-ahead log of format {version}, which this Floe cannot read \
                     as a {}; start the chunk server of the Floe version (or with the journal \
                     options) that wrote it to drain it",
                    path.display(),
                    if aligned { "journal" } else { "log" }
                )))
            }
        };
        Ok(LogFile {
            file,
            path: path.to_path_buf(),
            aligned,
            position: wal::HEADER_BYTES,
            quota,
            allocated: 0,
            start_seq,
            seqs: None,
            direct: None,
            buffered: false,
        })
    }

    /// From now on appends bypass the page cache, where the file system allows it.
    pub(crate) fn write_directly(&mut self, disk: &dyn Disk) -> Result<(), StoreError> {
        match disk.open_direct(&self.path)? {
            Some(file) => {
                let in_sector = self.position % wal::SECTOR_BYTES;
                let mut tail = vec![0u8; in_sector as usize];
                disk::read_at(&*self.file, &mut tail, self.position - in_sector)?;
                self.direct = Some(DirectWrites::new(file, tail, self.position));
            }
            None => tracing::warn!(
                path = %self.path.display(),
                "the file system refuses direct writes (O_DIRECT): the log is written \
                 through the page cache"
            ),
        }
        Ok(())
    }

    /// Clears `buffer` and starts a batch of `bytes` record bytes in it, to be
    /// appended at `position`.
    pub(crate) fn start_batch(&self, buffer: &mut Vec<u8>, bytes: usize) -> Batch {
        match &self.direct {
            Some(direct) => direct.start(buffer, self.position, bytes),
            None => {
                buffer.clear();
                Batch {
                    base: self.position,
                    from: 0,
                    records: 0,
                }
            }
        }
    }

    /// Writes the batch encoded in `buffer` after the log's records; directly if the
    /// log is written so and the batch is to be synced at once. Unsynced batches (the
    /// fast write modes) go through the page cache: waiting for the device at each
    /// cost write-back 15-19% of its IOPS, and the next sync flushes them anyway.
    pub(crate) fn write_batch(
        &mut self,
        buffer: &mut Vec<u8>,
        batch: Batch,
        sync: bool,
    ) -> io::Result<()> {
        let end = self.position + (buffer.len() - batch.records) as u64 + wal::SECTOR_BYTES;
        if let Some(direct) = &mut self.direct {
            // Before buffered batches too: zeroes must never land on records.
            let written = direct
                .zero_ahead(end, self.allocated)
                .and_then(|()| match sync {
                    true => direct.write(buffer, batch).map(|()| true),
                    false => Ok(false),
                });
            match written {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                // The file system took the open but not the write (its alignment).
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(
                        path = %self.path.display(),
                        "a direct write to the log was refused ({e}): the log is written \
                         through the page cache from now on"
                    );
                    self.direct = None;
                }
                Err(e) => return Err(e),
            }
        }
        self.buffered = true;
        self.file
            .write_all_at(&buffer[batch.records..], self.position)
    }

    /// Whether the file may hold dirty pages of batches written since the last call.
    pub(crate) fn take_buffered(&mut self) -> bool {
        std::mem::take(&mut self.buffered)
    }

    /// The batch in `buffer` is written (and synced as its caller needs): the log goes
    /// on after it.
    pub(crate) fn batch_written(&mut self, buffer: &[u8], batch: Batch) {
        self.position += (buffer.len() - batch.records) as u64;
        if let Some(direct) = &mut self.direct {
            direct.written(buffer, batch);
        }
    }

    /// Allocates the file's quota and `room` past it (see [`LogFile::allocated`]).
    pub(crate) fn allocate(&mut self, room: u64) -> Result<(), StoreError> {
        let bytes = self.quota + room;
        self.file.allocate(bytes).map_err(|e| {
            crate::error::io_error(
                &e,
                format!(
                    "cannot allocate {bytes} bytes for {}: {e}",
                    self.path.display()
                ),
            )
        })?;
        self.allocated = bytes;
        Ok(())
    }

    /// Visits every valid record after the header, in order, with the position of its
    /// data, stopping at the first that is torn, stale or absent; leaves `position`
    /// after the last.
    pub(crate) fn scan(
        &mut self,
        mut visit: impl FnMut(&RecordHeader, u64, &[u8]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut next_seq = self.start_seq.unwrap_or(1);
        let mut raw = [0u8; RECORD_HEADER_BYTES];
        let mut data = Vec::new();
        loop {
            if !disk::read_exact_at(&*self.file, &mut raw, self.position)? {
                break;
            }
            let Some((header, crc)) = RecordHeader::decode(&raw, next_seq) else {
                break;
            };
            data.resize(header.data_len(), 0);
            let data_at = header.data_at(self.position, self.aligned);
            if !disk::read_exact_at(&*self.file, &mut data, data_at)?
                || !RecordHeader::check(&raw, &data, crc)
            {
                break;
            }
            assert_in_chunk(&header);
            visit(&header, data_at, &data)?;
            self.position = data_at + data.len() as u64;
            self.appended(header.seq, header.seq);
            next_seq = header.seq + 1;
        }
        Ok(())
    }

    /// Notes records `first..=last` appended after the ones the file holds.
    pub(crate) fn appended(&mut self, first: u64, last: u64) {
        assert!(
            first >= self.next_seq() && last >= first,
            "{}: records {first}..={last} appended after {:?} (start {:?}): sequences \
             never go back",
            self.path.display(),
            self.seqs,
            self.start_seq
        );
        self.seqs = Some((self.seqs.map_or(first, |s| s.0), last));
    }

    /// The sequence number the next record needs to be at least.
    pub(crate) fn next_seq(&self) -> u64 {
        self.seqs
            .map_or(self.start_seq.unwrap_or(1), |(_, last)| last + 1)
    }

    /// Forgets every record: a new header whose start sequence is past all of them.
    pub(crate) fn reset(&mut self, next_seq: u64) -> Result<(), StoreError> {
        assert!(
            next_seq >= self.next_seq(),
            "{}: reset to start {next_seq} below its records {:?}",
            self.path.display(),
            self.seqs
        );
        self.file
            .write_all_at(&wal::encode_header(next_seq, self.aligned), 0)?;
        self.file.sync_data()?;
        self.position = wal::HEADER_BYTES;
        if let Some(direct) = &mut self.direct {
            direct.restarted();
        }
        self.start_seq = Some(next_seq);
        self.seqs = None;
        Ok(())
    }
}

/// A record's range lies inside its chunk: checked before a record goes to disk and
/// after it comes back, so no layer applies a change outside a chunk file's bounds.
pub(crate) fn assert_in_chunk(header: &RecordHeader) {
    // Their offset and length name no range (see `Kind`).
    if !matches!(header.kind, Kind::DeleteVolume | Kind::Release) {
        assert!(
            header
                .offset
                .checked_add(header.length)
                .is_some_and(|end| end <= CHUNK_BYTES_MAX),
            "record {header:?} reaches outside its chunk"
        );
    }
}
