//! Client sessions moving between gateways (Strata, FAST'14 sections 4 and 6): any
//! gateway may serve any volume, and `floe volume move-session` hands a volume's
//! lease from the gateway that holds it to another. Gateways name themselves to the
//! master in a long-poll ([`crate::MasterRequest::GatewayPoll`]) that also brings
//! them the moves they take part in.

use serde::{Deserialize, Serialize};

/// A move under way, as the gateways in it learn it: `from` finishes what its
/// clients sent, makes it durable, releases the lease and closes their
/// connections; `to` takes the lease and serves the volume to them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionMove {
    pub volume: String,
    pub from: String,
    pub to: String,
}

/// Who serves a volume, and the move under way, for the CLI.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub volume: String,
    /// The live lease's holder (a gateway's holder names the gateway) and generation.
    pub holder: Option<String>,
    pub generation: u32,
    /// The gateway holding the lease, by name, when a gateway holds it.
    pub gateway: Option<String>,
    pub moving: Option<SessionMove>,
}

/// A gateway the master hears from, for `floe status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatewayInfo {
    pub name: String,
    /// Where it serves NBD.
    pub address: String,
    /// The holder name its leases are taken in.
    pub holder: String,
    /// Since its last poll.
    pub seen_ms_ago: u64,
    /// Volumes it holds the lease of.
    pub volumes: Vec<String>,
}
