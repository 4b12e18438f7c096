//! NBD server (fixed newstyle handshake, simple and structured replies) that serves
//! [`floe_blockdev::BlockDevice`]s. Protocol: NetworkBlockDevice/nbd doc/proto.md.
//!
//! Modules:
//! - `server`: the accept loop ([`serve`]), one task per client, graceful shutdown.
//! - `handover`: parking attached clients for the next process of an upgrade.
//! - `closing`: closing one export's connections (its volume moved elsewhere).
//! - `handshake`: fixed newstyle greeting and option haggling (EXPORT_NAME, ABORT,
//!   LIST, INFO, GO, STRUCTURED_REPLY, LIST/SET_META_CONTEXT for `base:allocation`
//!   and the contexts [`Exports::meta_context`] offers, STARTTLS).
//! - `security`: what a connection must do before it may haggle: TLS, required of
//!   clients not on loopback unless plain NBD is allowed ([`Security`]).
//! - `psk`: TLS-PSK handshakes (OpenSSL), told apart from X.509 ones by the ClientHello.
//! - `transmission`: the request loop, with bounded requests and bytes in flight.
//! - `command`: request header parsing, validation and execution on the device.
//! - `reply`: simple and structured reply encoding into vectored-write segments.
//! - `writer`: the per-connection task batching ready replies into one socket write.
//! - `input`: buffered socket reads; write payloads are split off without a copy.
//! - `proto`: wire constants and the limits the server advertises.
mod closing;
mod command;
mod handover;
mod handshake;
mod input;
mod proto;
mod psk;
mod reply;
mod security;
mod server;
mod transmission;
mod writer;

use async_trait::async_trait;
use floe_blockdev::BlockDevice;
use std::sync::Arc;

pub use closing::{Closed, Closing};
pub use handover::{Handover, Parked, Stop};
pub use psk::PskKeys;
pub use security::Security;
pub use server::serve;

/// Why an export was not opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No such export, or it cannot be opened now (NBD_REP_ERR_UNKNOWN).
    Unknown(String),
    /// This client may not open it (NBD_REP_ERR_POLICY).
    Denied(String),
}

impl From<String> for Refusal {
    fn from(message: String) -> Refusal {
        Refusal::Unknown(message)
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Unknown(message) | Refusal::Denied(message) => f.write_str(message),
        }
    }
}

/// The client opening an export, as far as the server knows it.
#[derive(Debug, Clone, Default)]
pub struct Client {
    /// The certificate it presented over TLS (DER), if any.
    pub certificate: Option<Vec<u8>>,
    /// The identity it proved with a pre-shared key (TLS-PSK), if it did.
    pub psk_identity: Option<String>,
    /// Whether the connection is TLS.
    pub tls: bool,
}

/// Where the server finds its exports; the gateway implements it over the master.
#[async_trait]
pub trait Exports: Send + Sync + 'static {
    /// Names for NBD_OPT_LIST.
    async fn list(&self) -> Result<Vec<String>, String>;
    /// Opens an export by name for `client`; the refusal's one-line message goes to
    /// the client.
    async fn open(&self, name: &str, client: &Client) -> Result<Arc<dyn BlockDevice>, Refusal>;
    /// A meta context of `export` besides `base:allocation` (e.g. the gateway's
    /// `floe:changed-since:SNAPSHOT`): the ranges (offset, length) where its state is
    /// 1, as of when the client selects it; `None` if there is no such context.
    async fn meta_context(&self, export: &str, context: &str) -> Option<Vec<(u64, u64)>> {
        let _ = (export, context);
        None
    }
    /// The exports whose connections are to be closed now (none by default).
    fn closing(&self) -> Closing {
        Closing::default()
    }
}
