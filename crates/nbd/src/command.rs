//! Transmission-phase requests: the wire header, validation against what was
//! negotiated, and execution on the block device.

use crate::handshake::Session;
use crate::proto::*;
use crate::reply::{errno, Reply};
use bytes::{Buf, Bytes};
use floe_blockdev::{Extent, IoError};
use std::io;

/// Caps one block status reply; the spec lets the server describe less than asked,
/// and clients simply ask again from where the reply ended.
const MAX_DESCRIPTORS: usize = 1024;

/// A request header as sent by the client (the WRITE payload follows it).
pub(crate) struct Header {
    pub(crate) flags: u16,
    pub(crate) kind: u16,
    pub(crate) handle: u64,
    pub(crate) offset: u64,
    pub(crate) length: u32,
}

impl Header {
    pub(crate) const LEN: usize = 28;

    /// A bad magic means request boundaries are lost: the caller must disconnect.
    pub(crate) fn parse(mut buf: impl Buf) -> io::Result<Header> {
        let magic = buf.get_u32();
        if magic != REQUEST_MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad request magic {magic:#010x}"),
            ));
        }
        Ok(Header {
            flags: buf.get_u16(),
            kind: buf.get_u16(),
            handle: buf.get_u64(),
            offset: buf.get_u64(),
            length: buf.get_u32(),
        })
    }
}

/// Why a request is refused before it reaches the device.
pub(crate) struct Rejection {
    pub(crate) error: u32,
    pub(crate) message: String,
}

fn reject<T>(error: u32, message: String) -> Result<T, Rejection> {
    Err(Rejection { error, message })
}

/// A validated request, except NBD_CMD_DISC which the request loop handles itself.
pub(crate) enum Command {
    Read {
        offset: u64,
        length: u32,
    },
    Write {
        offset: u64,
        data: Bytes,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        length: u32,
    },
    Cache,
    WriteZeroes {
        offset: u64,
        length: u32,
        may_punch: bool,
    },
    BlockStatus {
        offset: u64,
        length: u32,
        req_one: bool,
    },
}

impl Command {
    /// Checks flags, length and range. `payload` is the WRITE data (empty otherwise,
    /// or if it was too long to keep).
    pub(crate) fn parse(
        header: &Header,
        payload: Bytes,
        session: &Session,
    ) -> Result<Command, Rejection> {
        let Header {
            flags,
            kind,
            offset,
            length,
            ..
        } = *header;
        // FUA is accepted on every command: clients are known to set it everywhere.
        // FAST_ZERO asks for ENOTSUP at once if zeroing is no faster than writing
        // zeroes; it never is slower here, so it is always honoured: a zero carries
        // no data (offset and length only) down to the chunk servers, which punch or
        // zero the range in place; a partial 4 KiB block at either end is read and
        // rewritten there as a partial write's would be, and a snapshot's
        // copy-on-write costs a zero what it costs a write.
        let allowed = CMD_FLAG_FUA
            | match kind {
                CMD_READ if session.structured => CMD_FLAG_DF,
                CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
                _ => 0,
            };
        if flags & !allowed != 0 {
            return reject(
                EINVAL,
                format!("flags {flags:#x} not valid for command {kind}"),
            );
        }
        if kind == CMD_FLUSH {
            if offset != 0 || length != 0 {
                return reject(EINVAL, "flush must have offset and length 0".into());
            }
            return Ok(Command::Flush);
        }
        if !matches!(
            kind,
            CMD_READ | CMD_WRITE | CMD_TRIM | CMD_CACHE | CMD_WRITE_ZEROES | CMD_BLOCK_STATUS
        ) {
            return reject(EINVAL, format!("unknown command {kind}"));
        }
        if length == 0 {
            return reject(EINVAL, "zero-length request".into());
        }
        if matches!(kind, CMD_READ | CMD_WRITE) && length > MAX_BLOCK {
            return reject(
                EINVAL,
                format!("request of {length} bytes exceeds the maximum of {MAX_BLOCK}"),
            );
        }
        let size = session.device.size();
        if offset
            .checked_add(length as u64)
            .is_none_or(|end| end > size)
        {
            // proto.md: ENOSPC for writes past the end; EINVAL for the rest.
            let error = if matches!(kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES) {
                ENOSPC
            } else {
                EINVAL
            };
            return reject(
                error,
                format!("offset {offset} + length {length} is beyond the export size {size}"),
            );
        }
        Ok(match kind {
            CMD_READ => Command::Read { offset, length },
            CMD_WRITE => Command::Write {
                offset,
                data: payload,
                fua: flags & CMD_FLAG_FUA != 0,
            },
            CMD_TRIM => Command::Trim { offset, length },
            CMD_CACHE => Command::Cache,
            CMD_WRITE_ZEROES => Command::WriteZeroes {
                offset,
                length,
                may_punch: flags & CMD_FLAG_NO_HOLE == 0,
            },
            _ => {
                if !session.base_allocation && session.contexts.is_empty() {
                    return reject(EINVAL, "no meta context was negotiated".into());
                }
                Command::BlockStatus {
                    offset,
                    length,
                    req_one: flags & CMD_FLAG_REQ_ONE != 0,
                }
            }
        })
    }

    /// Runs the request on the device. FUA needs no extra work for TRIM and
    /// WRITE_ZEROES: the device contract makes every completed change durable; WRITE
    /// passes it on for devices that acknowledge early.
    pub(crate) async fn apply(self, handle: u64, session: &Session) -> Reply {
        let device = &session.device;
        let result = match self {
            Command::Read { offset, length } => match device.read(offset, length).await {
                // A short read would desynchronise a simple-reply stream.
                Ok(data) if data.len() != length as usize => Err(IoError::Io(format!(
                    "device returned {} bytes for a {length}-byte read",
                    data.len()
                ))),
                Ok(data) => return Reply::read(handle, session.structured, offset, data),
                Err(e) => Err(e),
            },
            Command::Write { offset, data, fua } => device.write(offset, data, fua).await,
            Command::Flush => device.flush().await,
            Command::Trim { offset, length } => device.trim(offset, length as u64).await,
            // Validated already; there is no cache to warm below the device trait.
            Command::Cache => Ok(()),
            Command::WriteZeroes {
                offset,
                length,
                may_punch,
            } => device.write_zeroes(offset, length as u64, may_punch).await,
            Command::BlockStatus {
                offset,
                length,
                req_one,
            } => {
                let mut contexts = Vec::new();
                let allocation = match session.base_allocation {
                    true => match device.extents(offset, length as u64).await {
                        Ok(extents) => descriptors(&extents, length, req_one)
                            .ok_or_else(|| IoError::Io("device described no extents".into()))
                            .map(|d| contexts.push((BASE_ALLOCATION_ID, d))),
                        Err(e) => Err(e),
                    },
                    false => Ok(()),
                };
                for (id, ranges) in &session.contexts {
                    contexts.push((*id, range_descriptors(ranges, offset, length, req_one)));
                }
                match allocation {
                    Ok(()) => return Reply::BlockStatus { handle, contexts },
                    Err(e) => Err(e),
                }
            }
        };
        match result {
            Ok(()) => Reply::ok(handle),
            Err(e) => {
                if matches!(e, IoError::Io(_)) {
                    tracing::warn!(handle, "device error: {e}");
                } else {
                    tracing::debug!(handle, "request failed: {e}");
                }
                Reply::error(handle, session.structured, errno(&e), e.to_string())
            }
        }
    }
}

/// Descriptors of `offset..offset + length` for a context whose state is 1 in
/// `ranges` (sorted, disjoint) and 0 elsewhere.
fn range_descriptors(
    ranges: &[(u64, u64)],
    offset: u64,
    length: u32,
    req_one: bool,
) -> Vec<(u32, u32)> {
    let end = offset + length as u64;
    let mut out: Vec<(u32, u32)> = Vec::new();
    let mut push = |len: u64, state: u32| match out.last_mut() {
        Some(last) if last.1 == state => last.0 += len as u32,
        _ => out.push((len as u32, state)),
    };
    let mut at = offset;
    let first = ranges.partition_point(|(o, l)| o + l <= offset);
    for &(o, l) in &ranges[first..] {
        if o >= end {
            break;
        }
        if o > at {
            push(o - at, 0);
        }
        let stop = (o + l).min(end);
        push(stop - at.max(o), 1);
        at = stop;
    }
    if at < end {
        push(end - at, 0);
    }
    if req_one {
        out.truncate(1);
    }
    out.truncate(MAX_DESCRIPTORS);
    out
}

/// base:allocation descriptors for `extents`, clamped to `length`, with neighbours of
/// equal status merged; `None` if nothing is described.
fn descriptors(extents: &[Extent], length: u32, req_one: bool) -> Option<Vec<(u32, u32)>> {
    let limit = if req_one { 1 } else { MAX_DESCRIPTORS };
    let mut left = length as u64;
    let mut out: Vec<(u32, u32)> = Vec::new();
    for extent in extents {
        let len = extent.length.min(left) as u32;
        if len == 0 {
            if left == 0 {
                break;
            }
            continue;
        }
        let flags = if extent.hole {
            STATE_HOLE | STATE_ZERO
        } else {
            0
        };
        if let Some(last) = out.last_mut().filter(|last| last.1 == flags) {
            last.0 += len;
        } else if out.len() < limit {
            out.push((len, flags));
        } else {
            break;
        }
        left -= len as u64;
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(length: u64, hole: bool) -> Extent {
        Extent { length, hole }
    }

    #[test]
    fn descriptors_are_clamped_merged_and_capped() {
        let extents = [
            ext(100, false),
            ext(50, false),
            ext(1000, true),
            ext(10, false),
        ];
        assert_eq!(descriptors(&extents, 120, false), Some(vec![(120, 0)]));
        assert_eq!(
            descriptors(&extents, 400, false),
            Some(vec![(150, 0), (250, 3)])
        );
        assert_eq!(descriptors(&extents, 400, true), Some(vec![(150, 0)]));
        assert_eq!(
            descriptors(&extents, 10_000, false),
            Some(vec![(150, 0), (1000, 3), (10, 0)])
        );
        assert_eq!(descriptors(&[ext(0, true)], 10, false), None);
        let many: Vec<Extent> = (0..5000).map(|i| ext(1, i % 2 == 0)).collect();
        assert_eq!(
            descriptors(&many, 5000, false).unwrap().len(),
            MAX_DESCRIPTORS
        );
    }
}
