//! NBD server (fixed newstyle handshake, simple and structured replies) that serves
//! [`floe_blockdev::BlockDevice`]s. Protocol: NetworkBlockDevice/nbd doc/proto.md.
//!
//! Modules:
//! - `server`: the accept loop ([`serve`]), one task per client, graceful shutdown.
//! - `handshake`: fixed newstyle greeting and option haggling (EXPORT_NAME, ABORT,
//!   LIST, INFO, GO, STRUCTURED_REPLY, LIST/SET_META_CONTEXT for `base:allocation`
//!   and the contexts [`Exports::meta_context`] offers).
//! - `transmission`: the request loop, with bounded requests and bytes in flight.
//! - `command`: request header parsing, validation and execution on the device.
//! - `reply`: simple and structured reply encoding into vectored-write segments.
//! - `writer`: the per-connection task batching ready replies into one socket write.
//! - `input`: buffered socket reads; write payloads are split off without a copy.
//! - `proto`: wire constants and the limits the server advertises.
mod command;
mod handshake;
mod input;
mod proto;
mod reply;
mod server;
mod transmission;
mod writer;

use async_trait::async_trait;
use floe_blockdev::BlockDevice;
use std::sync::Arc;

pub use server::serve;

/// Where the server finds its exports; the gateway implements it over the master.
#[async_trait]
pub trait Exports: Send + Sync + 'static {
    /// Names for NBD_OPT_LIST.
    async fn list(&self) -> Result<Vec<String>, String>;
    /// Opens an export by name; `Err` carries a one-line message sent to the client
    /// with NBD_REP_ERR_UNKNOWN.
    async fn open(&self, name: &str) -> Result<Arc<dyn BlockDevice>, String>;
    /// A meta context of `export` besides `base:allocation` (e.g. the gateway's
    /// `floe:changed-since:SNAPSHOT`): the ranges (offset, length) where its state is
    /// 1, as of when the client selects it; `None` if there is no such context.
    async fn meta_context(&self, export: &str, context: &str) -> Option<Vec<(u64, u64)>> {
        let _ = (export, context);
        None
    }
}
