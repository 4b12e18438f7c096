//! Transmission-phase replies (simple and structured) and their encoding into a list
//! of buffers that one vectored write sends.

use crate::proto::*;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use floe_blockdev::IoError;
use std::collections::VecDeque;
use std::io::IoSlice;

/// Payloads at most this long are copied next to their header; longer ones are sent
/// from the device's buffer by the vectored write.
const COPY_MAX: usize = 8 * 1024;

pub(crate) enum Reply {
    /// A simple reply; `data` is only for a successful READ without structured replies.
    Simple {
        handle: u64,
        error: u32,
        data: Option<Bytes>,
    },
    /// A whole READ as one NBD_REPLY_TYPE_OFFSET_DATA chunk: the data is complete before
    /// the chunk is sent, so no error can follow and it may carry the DONE flag.
    Data {
        handle: u64,
        offset: u64,
        data: Bytes,
    },
    /// NBD_REPLY_TYPE_ERROR, ending the reply.
    Error {
        handle: u64,
        error: u32,
        message: String,
    },
    /// One NBD_REPLY_TYPE_BLOCK_STATUS chunk of (length, flags) descriptors per
    /// selected meta context; the last ends the reply.
    BlockStatus {
        handle: u64,
        contexts: Vec<(u32, Vec<(u32, u32)>)>,
    },
}

impl Reply {
    pub(crate) fn ok(handle: u64) -> Self {
        Reply::Simple {
            handle,
            error: 0,
            data: None,
        }
    }

    /// A failed request: structured when negotiated, because then the client sees
    /// the message too (and a READ must not get a simple reply).
    pub(crate) fn error(handle: u64, structured: bool, error: u32, message: String) -> Self {
        if structured {
            Reply::Error {
                handle,
                error,
                message,
            }
        } else {
            Reply::Simple {
                handle,
                error,
                data: None,
            }
        }
    }

    pub(crate) fn read(handle: u64, structured: bool, offset: u64, data: Bytes) -> Self {
        if structured {
            Reply::Data {
                handle,
                offset,
                data,
            }
        } else {
            Reply::Simple {
                handle,
                error: 0,
                data: Some(data),
            }
        }
    }

    pub(crate) fn encode(self, out: &mut Segments) {
        match self {
            Reply::Simple {
                handle,
                error,
                data,
            } => {
                out.tail.put_u32(SIMPLE_REPLY_MAGIC);
                out.tail.put_u32(error);
                out.tail.put_u64(handle);
                if let Some(data) = data {
                    out.put_data(data);
                }
            }
            Reply::Data {
                handle,
                offset,
                data,
            } => {
                structured_header(out, REPLY_TYPE_OFFSET_DATA, handle, 8 + data.len());
                out.tail.put_u64(offset);
                out.put_data(data);
            }
            Reply::Error {
                handle,
                error,
                message,
            } => {
                let message = truncate(&message, MAX_STRING);
                structured_header(out, REPLY_TYPE_ERROR, handle, 6 + message.len());
                out.tail.put_u32(error);
                out.tail.put_u16(message.len() as u16);
                out.tail.put_slice(message.as_bytes());
            }
            Reply::BlockStatus { handle, contexts } => {
                let last = contexts.len().saturating_sub(1);
                for (i, (context_id, descriptors)) in contexts.into_iter().enumerate() {
                    let length = 4 + 8 * descriptors.len();
                    let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
                    chunk_header(out, flags, REPLY_TYPE_BLOCK_STATUS, handle, length);
                    out.tail.put_u32(context_id);
                    for (length, flags) in descriptors {
                        out.tail.put_u32(length);
                        out.tail.put_u32(flags);
                    }
                }
            }
        }
    }
}

fn structured_header(out: &mut Segments, kind: u16, handle: u64, length: usize) {
    chunk_header(out, REPLY_FLAG_DONE, kind, handle, length);
}

/// A structured reply chunk's header; `flags` has DONE on the reply's last chunk.
fn chunk_header(out: &mut Segments, flags: u16, kind: u16, handle: u64, length: usize) {
    out.tail.put_u32(STRUCTURED_REPLY_MAGIC);
    out.tail.put_u16(flags);
    out.tail.put_u16(kind);
    out.tail.put_u64(handle);
    // Fits: payloads are bounded by MAX_BLOCK and the descriptor cap.
    out.tail.put_u32(length as u32);
}

/// Cuts `s` to at most `max` bytes on a character boundary.
pub(crate) fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The NBD error value for a device error.
pub(crate) fn errno(error: &IoError) -> u32 {
    match error {
        IoError::InvalidRange(_) => EINVAL,
        IoError::NoSpace(_) => ENOSPC,
        IoError::ReadOnly => EPERM,
        IoError::Io(_) => EIO,
    }
}

/// Encoded replies waiting to be written: sealed buffers in order, plus a tail that
/// collects headers and small payloads so they share one buffer.
#[derive(Default)]
pub(crate) struct Segments {
    sealed: VecDeque<Bytes>,
    sealed_len: usize,
    tail: BytesMut,
}

impl Segments {
    /// Bytes encoded and not yet written.
    pub(crate) fn len(&self) -> usize {
        self.sealed_len + self.tail.len()
    }

    fn put_data(&mut self, data: Bytes) {
        if data.len() <= COPY_MAX {
            self.tail.put_slice(&data);
        } else {
            self.seal();
            self.push(data);
        }
    }

    /// Moves the tail into the sealed list; only sealed bytes are written.
    pub(crate) fn seal(&mut self) {
        if !self.tail.is_empty() {
            let tail = self.tail.split().freeze();
            self.push(tail);
        }
    }

    fn push(&mut self, bytes: Bytes) {
        self.sealed_len += bytes.len();
        self.sealed.push_back(bytes);
    }
}

/// Lets `write_all_buf` hand all sealed buffers to one `writev`.
impl Buf for Segments {
    fn remaining(&self) -> usize {
        self.sealed_len
    }

    fn chunk(&self) -> &[u8] {
        self.sealed.front().map_or(&[], |b| b.chunk())
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let mut n = 0;
        for (slot, bytes) in dst.iter_mut().zip(&self.sealed) {
            *slot = IoSlice::new(bytes);
            n += 1;
        }
        n
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(
            cnt <= self.sealed_len,
            "advance past the end of the segments"
        );
        self.sealed_len -= cnt;
        while cnt > 0 {
            let front = self.sealed.front_mut().expect("checked against sealed_len");
            if cnt < front.len() {
                front.advance(cnt);
                return;
            }
            cnt -= front.len();
            self.sealed.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(replies: Vec<Reply>) -> Vec<u8> {
        let mut out = Segments::default();
        for reply in replies {
            reply.encode(&mut out);
        }
        out.seal();
        let mut bytes = vec![0; out.remaining()];
        out.copy_to_slice(&mut bytes);
        bytes
    }

    #[test]
    fn large_payloads_stay_separate_and_order_is_kept() {
        let big = Bytes::from(vec![7u8; COPY_MAX + 1]);
        let mut out = Segments::default();
        Reply::read(1, false, 0, Bytes::from_static(b"abc")).encode(&mut out);
        Reply::read(2, true, 512, big.clone()).encode(&mut out);
        Reply::ok(3).encode(&mut out);
        out.seal();
        // header+small data, structured header, big data, last simple reply
        assert_eq!(out.sealed.len(), 3);
        assert_eq!(
            out.sealed[1].as_ptr(),
            big.as_ptr(),
            "large data must not be copied"
        );

        let mut flat = vec![0; out.remaining()];
        out.copy_to_slice(&mut flat);
        assert_eq!(&flat[..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&flat[16..19], b"abc");
        assert_eq!(&flat[19..23], &STRUCTURED_REPLY_MAGIC.to_be_bytes());
        let tail = &flat[flat.len() - 16..];
        assert_eq!(&tail[8..], &3u64.to_be_bytes());
        assert_eq!(out.remaining(), 0);
    }

    #[test]
    fn error_reply_layout_and_truncation() {
        let bytes = encoded(vec![Reply::error(9, true, EIO, "é".repeat(3000))]);
        let message_len = u16::from_be_bytes([bytes[24], bytes[25]]) as usize;
        assert!(message_len <= MAX_STRING);
        assert_eq!(bytes.len(), 20 + 6 + message_len);
        assert_eq!(
            u32::from_be_bytes(bytes[16..20].try_into().unwrap()),
            6 + message_len as u32
        );
        assert!(std::str::from_utf8(&bytes[26..]).is_ok());
    }
}
