//! Block transactions served by the gateway that holds a volume's lease (Isotope,
//! thesis chapter 4): the requests of a remote client (`floe_isotope::remote`) and
//! their replies, in frames of their own kind, on the gateway's transaction listener.
//!
//! A transaction's writes and marks are buffered by the client and sent with its next
//! read or its commit ([`TxRequest::Read`], [`TxRequest::Commit`]), in the order the
//! application made them, so a transaction costs a round trip per block read rather
//! than per call. The gateway applies them to the transaction it holds, in order,
//! before it reads or commits; any error ends the transaction there.
//!
//! Binary, little-endian, data last, like the data path: a request is an op byte, the
//! transaction's id, then its fields; a change list is a count and the changes.

use crate::connection::{CallError, Connection};
use crate::frame::{Frame, FrameError, Status};
use crate::message::{Fields, KIND_TRANSACTION};
use bytes::{BufMut, Bytes, BytesMut};

/// Changes one request carries at most (a peer is not trusted to send fewer).
pub const CHANGES_MAX: usize = 4096;

const BEGIN: u8 = 1;
const READ: u8 = 2;
const APPLY: u8 = 3;
const COMMIT: u8 = 4;
const ABORT: u8 = 5;
const RELEASE: u8 = 6;
const TAKE_OVER: u8 = 7;

const BEGUN: u8 = 1;
const BLOCK: u8 = 2;
const DONE: u8 = 3;
const COMMITTED: u8 = 4;
const CONFLICT: u8 = 5;
const RELEASED: u8 = 6;

const WRITE: u8 = 1;
const MARK: u8 = 2;

/// What a transaction guarantees (chosen per volume, or per transaction).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isolation {
    /// A transaction commits only if nothing it read changed since it began: the
    /// commits are equivalent to running one at a time in commit order.
    StrictSerializable,
    /// A transaction reads its snapshot and commits unless a concurrent commit wrote
    /// what it wrote: write skew is allowed.
    Snapshot,
}

impl std::str::FromStr for Isolation {
    type Err = String;
    fn from_str(text: &str) -> Result<Isolation, String> {
        match text {
            "ss" | "strict-serializable" => Ok(Isolation::StrictSerializable),
            "si" | "snapshot" => Ok(Isolation::Snapshot),
            _ => Err(format!(
                "{text:?}: isolation is ss (strict serializability) or si (snapshot isolation)"
            )),
        }
    }
}

/// A call the client made but did not send yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxChange {
    Write {
        block: u64,
        data: Bytes,
    },
    Mark {
        block: u64,
        offset: u32,
        length: u32,
    },
}

impl TxChange {
    /// Bytes it takes in a request.
    pub fn encoded_bytes(&self) -> usize {
        match self {
            TxChange::Write { data, .. } => 13 + data.len(),
            TxChange::Mark { .. } => 17,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxRequest {
    /// Begins a transaction on `volume`, with the volume's isolation unless given.
    Begin {
        volume: String,
        isolation: Option<Isolation>,
    },
    /// Applies `changes`, then reads `block` as of the transaction's start.
    Read {
        tx: u64,
        changes: Vec<TxChange>,
        block: u64,
    },
    /// Applies `changes` (the client's buffer is full).
    Apply {
        tx: u64,
        changes: Vec<TxChange>,
    },
    /// Applies `changes`, then commits.
    Commit {
        tx: u64,
        changes: Vec<TxChange>,
    },
    Abort {
        tx: u64,
    },
    /// Applies `changes`, then detaches the transaction from this connection (thesis
    /// 4.1's release): another connection takes it over with the handle answered.
    Release {
        tx: u64,
        changes: Vec<TxChange>,
    },
    /// Takes over a released transaction; answered as a begin, with its id here.
    TakeOver {
        handle: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxReply {
    Begun {
        tx: u64,
        start_version: u64,
        data_blocks: u64,
    },
    Block(Bytes),
    Done,
    Committed {
        version: u64,
    },
    Conflict,
    /// The handle of a released transaction (unguessable: whoever holds it may take
    /// the transaction over).
    Released {
        handle: u64,
    },
}

fn put_changes(out: &mut BytesMut, changes: &[TxChange]) {
    out.put_u32_le(changes.len() as u32);
    for change in changes {
        match change {
            TxChange::Write { block, data } => {
                out.put_u8(WRITE);
                out.put_u64_le(*block);
                out.put_u32_le(data.len() as u32);
                out.put_slice(data);
            }
            TxChange::Mark {
                block,
                offset,
                length,
            } => {
                out.put_u8(MARK);
                out.put_u64_le(*block);
                out.put_u32_le(*offset);
                out.put_u32_le(*length);
            }
        }
    }
}

fn changes(r: &mut Fields) -> Result<Vec<TxChange>, FrameError> {
    let count = r.u32()? as usize;
    if count > CHANGES_MAX {
        return Err(FrameError::Malformed(r.what));
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        out.push(match r.u8()? {
            WRITE => {
                let block = r.u64()?;
                let length = r.u32()? as usize;
                r.need(length)?;
                let data = r.buf.split_to(length);
                TxChange::Write { block, data }
            }
            MARK => TxChange::Mark {
                block: r.u64()?,
                offset: r.u32()?,
                length: r.u32()?,
            },
            _ => return Err(FrameError::Malformed(r.what)),
        });
    }
    Ok(out)
}

fn frame(fields: BytesMut, request_id: u64) -> Frame {
    Frame {
        kind: KIND_TRANSACTION,
        status: Status::Ok as u16,
        request_id,
        fields: fields.freeze(),
        data: Bytes::new(),
    }
}

impl TxRequest {
    pub fn encode(&self, request_id: u64) -> Frame {
        let mut f = BytesMut::new();
        match self {
            TxRequest::Begin { volume, isolation } => {
                f.put_u8(BEGIN);
                f.put_u8(match isolation {
                    None => 0,
                    Some(Isolation::StrictSerializable) => 1,
                    Some(Isolation::Snapshot) => 2,
                });
                f.put_slice(volume.as_bytes());
            }
            TxRequest::Read { tx, changes, block } => {
                f.put_u8(READ);
                f.put_u64_le(*tx);
                f.put_u64_le(*block);
                put_changes(&mut f, changes);
            }
            TxRequest::Apply { tx, changes }
            | TxRequest::Commit { tx, changes }
            | TxRequest::Release { tx, changes } => {
                let op = match self {
                    TxRequest::Apply { .. } => APPLY,
                    TxRequest::Commit { .. } => COMMIT,
                    _ => RELEASE,
                };
                f.put_u8(op);
                f.put_u64_le(*tx);
                put_changes(&mut f, changes);
            }
            TxRequest::Abort { tx } => {
                f.put_u8(ABORT);
                f.put_u64_le(*tx);
            }
            TxRequest::TakeOver { handle } => {
                f.put_u8(TAKE_OVER);
                f.put_u64_le(*handle);
            }
        }
        frame(f, request_id)
    }

    pub fn decode(frame: Frame) -> Result<TxRequest, FrameError> {
        if frame.kind != KIND_TRANSACTION {
            return Err(FrameError::UnknownKind(frame.kind));
        }
        let mut r = Fields {
            buf: frame.fields,
            what: "transaction request",
        };
        let request = match r.u8()? {
            BEGIN => {
                let isolation = match r.u8()? {
                    0 => None,
                    1 => Some(Isolation::StrictSerializable),
                    2 => Some(Isolation::Snapshot),
                    _ => return Err(FrameError::Malformed(r.what)),
                };
                let volume = String::from_utf8(std::mem::take(&mut r.buf).to_vec())
                    .map_err(|_| FrameError::Malformed(r.what))?;
                TxRequest::Begin { volume, isolation }
            }
            READ => TxRequest::Read {
                tx: r.u64()?,
                block: r.u64()?,
                changes: changes(&mut r)?,
            },
            APPLY => TxRequest::Apply {
                tx: r.u64()?,
                changes: changes(&mut r)?,
            },
            COMMIT => TxRequest::Commit {
                tx: r.u64()?,
                changes: changes(&mut r)?,
            },
            ABORT => TxRequest::Abort { tx: r.u64()? },
            RELEASE => TxRequest::Release {
                tx: r.u64()?,
                changes: changes(&mut r)?,
            },
            TAKE_OVER => TxRequest::TakeOver { handle: r.u64()? },
            _ => return Err(FrameError::Malformed(r.what)),
        };
        r.end()?;
        Ok(request)
    }

    /// The transaction it names (none for a `Begin` or a `TakeOver`).
    pub fn tx(&self) -> Option<u64> {
        match self {
            TxRequest::Begin { .. } | TxRequest::TakeOver { .. } => None,
            TxRequest::Read { tx, .. }
            | TxRequest::Apply { tx, .. }
            | TxRequest::Commit { tx, .. }
            | TxRequest::Release { tx, .. }
            | TxRequest::Abort { tx } => Some(*tx),
        }
    }
}

impl TxReply {
    pub fn encode(&self, request_id: u64) -> Frame {
        let mut f = BytesMut::new();
        match self {
            TxReply::Begun {
                tx,
                start_version,
                data_blocks,
            } => {
                f.put_u8(BEGUN);
                f.put_u64_le(*tx);
                f.put_u64_le(*start_version);
                f.put_u64_le(*data_blocks);
            }
            TxReply::Block(data) => {
                f.put_u8(BLOCK);
                f.put_slice(data);
            }
            TxReply::Done => f.put_u8(DONE),
            TxReply::Committed { version } => {
                f.put_u8(COMMITTED);
                f.put_u64_le(*version);
            }
            TxReply::Conflict => f.put_u8(CONFLICT),
            TxReply::Released { handle } => {
                f.put_u8(RELEASED);
                f.put_u64_le(*handle);
            }
        }
        frame(f, request_id)
    }

    /// A reply, or the error the gateway answered instead.
    pub fn decode(frame: Frame) -> Result<Result<TxReply, (Status, String)>, FrameError> {
        if frame.status != Status::Ok as u16 {
            let message = String::from_utf8_lossy(&frame.fields).into_owned();
            return Ok(Err((Status::from_u16(frame.status), message)));
        }
        let mut r = Fields {
            buf: frame.fields,
            what: "transaction reply",
        };
        let reply = match r.u8()? {
            BEGUN => TxReply::Begun {
                tx: r.u64()?,
                start_version: r.u64()?,
                data_blocks: r.u64()?,
            },
            BLOCK => TxReply::Block(std::mem::take(&mut r.buf)),
            DONE => TxReply::Done,
            COMMITTED => TxReply::Committed { version: r.u64()? },
            CONFLICT => TxReply::Conflict,
            RELEASED => TxReply::Released { handle: r.u64()? },
            _ => return Err(FrameError::Malformed(r.what)),
        };
        r.end()?;
        Ok(Ok(reply))
    }
}

/// Sends `request` on `connection` (a gateway's transaction listener) and waits for
/// its reply; an error answered becomes `CallError::Remote`.
pub async fn call(connection: &Connection, request: TxRequest) -> Result<TxReply, CallError> {
    let frame = connection.call_frame(|id| request.encode(id)).await?;
    let bad = |reason: String| CallError::BadReply {
        address: connection.address().to_string(),
        reason,
    };
    if frame.kind != KIND_TRANSACTION {
        return Err(bad(format!("reply kind {} to a transaction", frame.kind)));
    }
    match TxReply::decode(frame).map_err(|e| bad(e.to_string()))? {
        Ok(reply) => Ok(reply),
        Err((status, message)) => Err(CallError::Remote { status, message }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame as read from a socket: the whole payload in `fields`.
    fn received(frame: Frame) -> Frame {
        let mut all = BytesMut::from(&frame.fields[..]);
        all.extend_from_slice(&frame.data);
        Frame {
            fields: all.freeze(),
            data: Bytes::new(),
            ..frame
        }
    }

    #[test]
    fn requests_and_replies_round_trip() {
        let changes = vec![
            TxChange::Write {
                block: 7,
                data: Bytes::from(vec![9u8; 4096]),
            },
            TxChange::Mark {
                block: 7,
                offset: 16,
                length: 32,
            },
        ];
        let requests = [
            TxRequest::Begin {
                volume: "bank".into(),
                isolation: Some(Isolation::Snapshot),
            },
            TxRequest::Begin {
                volume: "kv".into(),
                isolation: None,
            },
            TxRequest::Read {
                tx: 3,
                changes: changes.clone(),
                block: 12,
            },
            TxRequest::Apply {
                tx: 3,
                changes: changes.clone(),
            },
            TxRequest::Release {
                tx: 3,
                changes: changes.clone(),
            },
            TxRequest::Commit { tx: 3, changes },
            TxRequest::Abort { tx: 4 },
            TxRequest::TakeOver { handle: 1 << 60 },
        ];
        for request in requests {
            let frame = received(request.encode(5));
            assert_eq!(TxRequest::decode(frame).unwrap(), request);
        }
        let replies = [
            TxReply::Begun {
                tx: 1,
                start_version: 2,
                data_blocks: 3,
            },
            TxReply::Block(Bytes::from(vec![1u8; 4096])),
            TxReply::Done,
            TxReply::Committed { version: 8 },
            TxReply::Conflict,
            TxReply::Released { handle: u64::MAX },
        ];
        for reply in replies {
            let frame = received(reply.encode(5));
            assert_eq!(TxReply::decode(frame).unwrap(), Ok(reply));
        }
    }

    #[test]
    fn malformed_requests_are_refused() {
        let commit = TxRequest::Commit {
            tx: 1,
            changes: vec![TxChange::Mark {
                block: 1,
                offset: 0,
                length: 16,
            }],
        };
        let whole = received(commit.encode(1));
        let cut = Frame {
            fields: whole.fields.slice(..whole.fields.len() - 1),
            ..whole.clone()
        };
        assert!(TxRequest::decode(cut).is_err());
        let mut too_many = BytesMut::new();
        too_many.put_u8(COMMIT);
        too_many.put_u64_le(1);
        too_many.put_u32_le(CHANGES_MAX as u32 + 1);
        assert!(TxRequest::decode(frame(too_many, 1)).is_err());
        let other_kind = Frame { kind: 5, ..whole };
        assert!(TxRequest::decode(other_kind).is_err());
    }
}
