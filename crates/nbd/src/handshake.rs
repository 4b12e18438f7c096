//! Fixed newstyle handshake and option haggling, ending in a [`Session`] for the
//! transmission phase.

use crate::input::Input;
use crate::proto::*;
use crate::reply::truncate;
use crate::security::Transport;
use crate::{Client, Exports, Refusal};
use bytes::{Buf, BufMut, BytesMut};
use floe_blockdev::BlockDevice;
use std::io;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

/// Option data above this is refused by disconnecting: an honest client never comes
/// close (strings are at most 4 KiB), and the data would have to be read to skip it.
const MAX_OPTION_LEN: u32 = 64 * 1024;

/// What option haggling settled, for the transmission phase.
pub(crate) struct Session {
    pub(crate) name: String,
    pub(crate) device: Arc<dyn BlockDevice>,
    pub(crate) structured: bool,
    /// base:allocation was selected for this export.
    pub(crate) base_allocation: bool,
    /// Other contexts selected for this export.
    pub(crate) contexts: Vec<Context>,
}

/// A selected meta context other than base:allocation: its id, and the ranges
/// (offset, length) where its state is 1.
pub(crate) type Context = (u32, Arc<Vec<(u64, u64)>>);

/// The transmission flags of every export. CAN_MULTI_CONN rests on the device
/// contract: a write, trim or write_zeroes is durable once it returns, and connections
/// to one export share the device, so a FLUSH on one covers writes completed on
/// another. FAST_ZERO: a zero never costs more than writing the zeroes would (see
/// `Command::parse`), so a client may rely on it instead of writing them itself.
fn transmission_flags(structured: bool) -> u16 {
    let flags = FLAG_HAS_FLAGS
        | FLAG_SEND_FLUSH
        | FLAG_SEND_FUA
        | FLAG_SEND_TRIM
        | FLAG_SEND_WRITE_ZEROES
        | FLAG_SEND_FAST_ZERO
        | FLAG_SEND_CACHE
        | FLAG_CAN_MULTI_CONN;
    // DF only means something with structured replies (proto.md requires it clear
    // otherwise); every READ is answered with one chunk anyway.
    if structured {
        flags | FLAG_SEND_DF
    } else {
        flags
    }
}

fn violation(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// How option haggling ended.
pub(crate) enum Negotiated {
    /// The client picked an export.
    Session(Session),
    /// The client asked for TLS and was told yes: the caller starts TLS on the socket
    /// and haggles again over it.
    StartTls,
    /// The client aborted or left.
    Left,
}

/// Option haggling state: forgotten at STARTTLS (what was said in the clear does not
/// count), except the client's flags.
#[derive(Default)]
pub(crate) struct Haggle {
    no_zeroes: bool,
    structured: bool,
    /// The export meta contexts were last selected for.
    meta_export: Option<String>,
    base_allocation: bool,
    contexts: Vec<Context>,
}

/// Greets the client and reads its flags; `None` if it left. Errors are protocol
/// violations or I/O failures; the caller drops the connection.
pub(crate) async fn greet<R, W>(input: &mut Input<R>, out: &mut W) -> io::Result<Option<Haggle>>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut greeting = BytesMut::with_capacity(18);
    greeting.put_u64(NBDMAGIC);
    greeting.put_u64(IHAVEOPT);
    greeting.put_u16(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    out.write_all(&greeting).await?;

    let Some(mut client_flags) = input.message(4).await? else {
        return Ok(None);
    };
    let client_flags = client_flags.get_u32();
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(violation(format!("unknown client flags {client_flags:#x}")));
    }
    Ok(Some(Haggle {
        no_zeroes: client_flags & FLAG_C_NO_ZEROES != 0,
        ..Haggle::default()
    }))
}

/// Answers options until the client picks an export, starts TLS or leaves.
pub(crate) async fn negotiate<R, W>(
    input: &mut Input<R>,
    out: &mut W,
    exports: &dyn Exports,
    state: &mut Haggle,
    transport: &Transport,
    client: &Client,
) -> io::Result<Negotiated>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    loop {
        let Some(mut head) = input.message(16).await? else {
            return Ok(Negotiated::Left);
        };
        let magic = head.get_u64();
        let option = head.get_u32();
        let len = head.get_u32();
        if magic != IHAVEOPT {
            return Err(violation(format!("bad option magic {magic:#x}")));
        }
        if len > MAX_OPTION_LEN {
            return Err(violation(format!("option {option} carries {len} bytes")));
        }
        let data = input.take(len as usize).await?;
        let mut replies = BytesMut::new();
        let refusal = transport.refusal();
        let session = match option {
            OPT_STARTTLS => {
                match (transport.offers_tls(), transport.secured, data.is_empty()) {
                    (_, _, false) => error_reply(
                        &mut replies,
                        option,
                        REP_ERR_INVALID,
                        "unexpected option data",
                    ),
                    (_, true, _) => {
                        error_reply(&mut replies, option, REP_ERR_INVALID, "TLS is already on")
                    }
                    (false, false, _) => error_reply(
                        &mut replies,
                        option,
                        REP_ERR_POLICY,
                        "this server has no certificate or keys for TLS",
                    ),
                    (true, false, _) => {
                        option_reply(&mut replies, option, REP_ACK, &[]);
                        out.write_all(&replies).await?;
                        out.flush().await?;
                        return Ok(Negotiated::StartTls);
                    }
                }
                None
            }
            OPT_ABORT => {
                option_reply(&mut replies, option, REP_ACK, &[]);
                // The client may already be gone; it is leaving either way.
                let _ = out.write_all(&replies).await;
                return Ok(Negotiated::Left);
            }
            OPT_EXPORT_NAME if refusal.is_some() => {
                // This option cannot carry an error back: refusing means hanging up.
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    refusal.unwrap_or_default(),
                ));
            }
            _ if refusal.is_some() => {
                let why = refusal.unwrap_or_default();
                error_reply(&mut replies, option, REP_ERR_TLS_REQD, why);
                None
            }
            OPT_EXPORT_NAME => {
                let name = String::from_utf8(data.to_vec())
                    .map_err(|_| violation("export name is not UTF-8".into()))?;
                // This option cannot carry an error back: refusing means hanging up.
                let device = exports.open(&name, client).await.map_err(|e| {
                    io::Error::new(io::ErrorKind::NotFound, format!("export {name:?}: {e}"))
                })?;
                replies.put_u64(device.size());
                replies.put_u16(transmission_flags(state.structured));
                if !state.no_zeroes {
                    replies.put_bytes(0, 124);
                }
                Some(state.session(name, device))
            }
            OPT_LIST => {
                list(&mut replies, &data, exports).await;
                None
            }
            OPT_INFO | OPT_GO => info(&mut replies, option, &data, state, exports, client)
                .await
                .filter(|_| option == OPT_GO)
                .map(|(name, device)| state.session(name, device)),
            OPT_STRUCTURED_REPLY => {
                if data.is_empty() {
                    state.structured = true;
                    option_reply(&mut replies, option, REP_ACK, &[]);
                } else {
                    error_reply(
                        &mut replies,
                        option,
                        REP_ERR_INVALID,
                        "unexpected option data",
                    );
                }
                None
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                meta_context(&mut replies, option, &data, state, exports).await;
                None
            }
            _ => {
                error_reply(&mut replies, option, REP_ERR_UNSUP, "option not supported");
                None
            }
        };
        out.write_all(&replies).await?;
        if let Some(session) = session {
            return Ok(Negotiated::Session(session));
        }
    }
}

impl Haggle {
    /// What survives STARTTLS: the client's flags.
    pub(crate) fn forget(&mut self) {
        *self = Haggle {
            no_zeroes: self.no_zeroes,
            ..Haggle::default()
        };
    }

    fn session(&self, name: String, device: Arc<dyn BlockDevice>) -> Session {
        let selected = self.meta_export.as_deref() == Some(name.as_str());
        Session {
            name,
            device,
            structured: self.structured,
            base_allocation: selected && self.base_allocation,
            contexts: if selected {
                self.contexts.clone()
            } else {
                Vec::new()
            },
        }
    }
}

fn option_reply(out: &mut BytesMut, option: u32, kind: u32, data: &[u8]) {
    out.put_u64(OPTION_REPLY_MAGIC);
    out.put_u32(option);
    out.put_u32(kind);
    out.put_u32(data.len() as u32);
    out.put_slice(data);
}

fn error_reply(out: &mut BytesMut, option: u32, kind: u32, message: &str) {
    option_reply(out, option, kind, truncate(message, MAX_STRING).as_bytes());
}

async fn list(out: &mut BytesMut, data: &[u8], exports: &dyn Exports) {
    if !data.is_empty() {
        return error_reply(out, OPT_LIST, REP_ERR_INVALID, "unexpected option data");
    }
    match exports.list().await {
        Ok(names) => {
            for name in names {
                let mut entry = BytesMut::with_capacity(4 + name.len());
                entry.put_u32(name.len() as u32);
                entry.put_slice(name.as_bytes());
                option_reply(out, OPT_LIST, REP_SERVER, &entry);
            }
            option_reply(out, OPT_LIST, REP_ACK, &[]);
        }
        Err(e) => error_reply(out, OPT_LIST, REP_ERR_POLICY, &e),
    }
}

/// NBD_OPT_INFO / NBD_OPT_GO: describes the export; on success returns it so GO can
/// enter transmission.
async fn info(
    out: &mut BytesMut,
    option: u32,
    data: &[u8],
    state: &Haggle,
    exports: &dyn Exports,
    client: &Client,
) -> Option<(String, Arc<dyn BlockDevice>)> {
    let Some((name, requests)) = parse_info_request(data) else {
        error_reply(out, option, REP_ERR_INVALID, "malformed info request");
        return None;
    };
    let device = match exports.open(&name, client).await {
        Ok(device) => device,
        Err(Refusal::Unknown(e)) => {
            error_reply(out, option, REP_ERR_UNKNOWN, &e);
            return None;
        }
        Err(Refusal::Denied(e)) => {
            error_reply(out, option, REP_ERR_POLICY, &e);
            return None;
        }
    };
    let mut info = BytesMut::new();
    info.put_u16(INFO_EXPORT);
    info.put_u64(device.size());
    info.put_u16(transmission_flags(state.structured));
    option_reply(out, option, REP_INFO, &info.split());
    if requests.contains(&INFO_NAME) {
        info.put_u16(INFO_NAME);
        info.put_slice(name.as_bytes());
        option_reply(out, option, REP_INFO, &info.split());
    }
    // Sent even unrequested: with a minimum of 1 it constrains no client, and it tells
    // those that care the preferred and maximum sizes.
    info.put_u16(INFO_BLOCK_SIZE);
    info.put_u32(MIN_BLOCK);
    info.put_u32(PREFERRED_BLOCK);
    info.put_u32(MAX_BLOCK);
    option_reply(out, option, REP_INFO, &info.split());
    option_reply(out, option, REP_ACK, &[]);
    Some((name, device))
}

/// Splits a length-prefixed string off `data`.
fn take_string(data: &mut &[u8]) -> Option<String> {
    if data.remaining() < 4 {
        return None;
    }
    let len = data.get_u32() as usize;
    if data.remaining() < len {
        return None;
    }
    let s = std::str::from_utf8(&data[..len]).ok()?.to_owned();
    data.advance(len);
    Some(s)
}

/// Export name and requested info types of NBD_OPT_INFO / NBD_OPT_GO.
fn parse_info_request(mut data: &[u8]) -> Option<(String, Vec<u16>)> {
    let name = take_string(&mut data)?;
    if data.remaining() < 2 {
        return None;
    }
    let count = data.get_u16() as usize;
    if data.remaining() != 2 * count {
        return None;
    }
    Some((name, (0..count).map(|_| data.get_u16()).collect()))
}

/// Export name and queries of NBD_OPT_{LIST,SET}_META_CONTEXT.
fn parse_meta_request(mut data: &[u8]) -> Option<(String, Vec<String>)> {
    let name = take_string(&mut data)?;
    if data.remaining() < 4 {
        return None;
    }
    let count = data.get_u32();
    // No preallocation from `count`: the data length bounds the loop instead.
    let mut queries = Vec::new();
    for _ in 0..count {
        queries.push(take_string(&mut data)?);
    }
    data.is_empty().then_some((name, queries))
}

/// NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT: base:allocation, which every
/// export has (so the export is not opened for it; GO checks that the selection was
/// made for the export it opens), and the contexts `exports` offers for the export,
/// each asked for by its full name.
async fn meta_context(
    out: &mut BytesMut,
    option: u32,
    data: &[u8],
    state: &mut Haggle,
    exports: &dyn Exports,
) {
    if !state.structured {
        return error_reply(
            out,
            option,
            REP_ERR_INVALID,
            "structured replies not negotiated",
        );
    }
    let Some((name, queries)) = parse_meta_request(data) else {
        return error_reply(
            out,
            option,
            REP_ERR_INVALID,
            "malformed meta context request",
        );
    };
    let set = option == OPT_SET_META_CONTEXT;
    // LIST with no queries lists everything, and "base:" is the whole namespace; SET
    // selects exactly what it names.
    let base_allocation = if set {
        queries.iter().any(|q| q == BASE_ALLOCATION)
    } else {
        queries.is_empty() || queries.iter().any(|q| q == BASE_ALLOCATION || q == "base:")
    };
    let mut reply = |id: u32, context: &str| {
        let mut body = BytesMut::with_capacity(4 + context.len());
        body.put_u32(id);
        body.put_slice(context.as_bytes());
        option_reply(out, option, REP_META_CONTEXT, &body);
    };
    if base_allocation {
        reply(if set { BASE_ALLOCATION_ID } else { 0 }, BASE_ALLOCATION);
    }
    let mut contexts = Vec::new();
    for query in queries.iter().filter(|q| !q.starts_with("base:")) {
        if let Some(ranges) = exports.meta_context(&name, query).await {
            let id = BASE_ALLOCATION_ID + 1 + contexts.len() as u32;
            reply(if set { id } else { 0 }, query);
            contexts.push((id, Arc::new(ranges)));
        }
    }
    if set {
        // SET replaces the previous selection, including with nothing.
        state.meta_export = Some(name);
        state.base_allocation = base_allocation;
        state.contexts = contexts;
    }
    option_reply(out, option, REP_ACK, &[]);
}
