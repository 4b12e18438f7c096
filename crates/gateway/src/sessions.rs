//! Sessions moving between gateways (`floe volume move-session`; Strata, FAST'14
//! sections 4 and 6). The gateway names itself to the master in a long-poll that
//! brings the moves it takes part in:
//! - moving a volume away, it closes the export's NBD connections at request
//!   boundaries (each answers what it read: `floe_nbd::Closing`), flushes what was
//!   acknowledged, drops the stack (retiring early-acknowledged writes) and releases
//!   the lease; the clients reconnect (to the service address, which moves with
//!   the session) and resend what was never read;
//! - taking a volume, it opens it at once (waiting for the release) and holds it
//!   open for [`HOLD`] while the clients reconnect; after that the volume closes
//!   with its last connection, as any other.
//!
//! Meanwhile the master refuses the volume to every other gateway, naming the target.

use crate::transactions::Transactions;
use crate::Volumes;
use floe_blockdev::BlockDevice;
use floe_protocol::{MasterRequest, MasterResponse, SessionMove};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// How long one poll waits at the master for a move (it caps it at 3 s).
const POLL_WAIT: Duration = Duration::from_secs(3);
/// A target holds a moved volume open this long for its clients to reconnect.
const HOLD: Duration = Duration::from_secs(30);
/// How long a target keeps trying to open a moved volume (the holder drains first).
const TAKE_FOR: Duration = Duration::from_secs(30);
/// How long a moving export waits for its connections to answer what they read
/// before it flushes anyway (its lease is then released with the last of them).
const CLOSE_WAIT_MAX: Duration = Duration::from_secs(30);

/// Who this gateway is to the master.
pub struct Identity {
    pub name: String,
    /// Where it serves NBD.
    pub address: String,
    /// The holder name its leases are taken in.
    pub holder: String,
}

/// Polls the master for session moves and carries out this gateway's part, until
/// dropped (moves under way are then abandoned with it).
pub(crate) async fn follow(
    volumes: Arc<Volumes>,
    transactions: Option<Arc<Transactions>>,
    me: Identity,
) {
    let mut known: Vec<SessionMove> = Vec::new();
    let mut moving = JoinSet::new();
    // Volumes taken and held open for their clients, by name: a move away ends the
    // hold, or the stack would outlive the release.
    let mut holding: BTreeMap<String, tokio::task::AbortHandle> = BTreeMap::new();
    let mut failing = false;
    loop {
        while moving.try_join_next().is_some() {}
        let poll = MasterRequest::GatewayPoll {
            name: me.name.clone(),
            address: me.address.clone(),
            holder: me.holder.clone(),
            known: known.clone(),
            wait_ms: POLL_WAIT.as_millis() as u64,
        };
        match volumes.master.call_within(poll, POLL_WAIT * 2).await {
            Ok(MasterResponse::Moves { moves }) => {
                if std::mem::take(&mut failing) {
                    tracing::info!(gateway = %me.name, "the master hears this gateway again");
                }
                for m in moves.iter().filter(|m| !known.contains(m)) {
                    if m.from == me.name {
                        if let Some(hold) = holding.remove(&m.volume) {
                            hold.abort();
                        }
                        let transactions = transactions.clone();
                        moving.spawn(release(volumes.clone(), transactions, m.clone()));
                    } else if m.to == me.name {
                        let hold = moving.spawn(take(volumes.clone(), m.clone()));
                        holding.insert(m.volume.clone(), hold);
                    }
                }
                known = moves;
            }
            Ok(other) => tracing::warn!("unexpected reply to a gateway poll: {other:?}"),
            Err(e) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(gateway = %me.name, "cannot poll the master for session moves: {e}");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// Hands volume `m.volume` over: its transactions ended, its connections closed,
/// what they were answered made durable, its lease released.
async fn release(volumes: Arc<Volumes>, transactions: Option<Arc<Transactions>>, m: SessionMove) {
    let started = Instant::now();
    let (volume, to) = (&m.volume, &m.to);
    let mut transacting = false;
    if let Some(transactions) = transactions {
        let why =
            format!("volume {volume} moved to gateway {to}: begin the transaction again there");
        transacting = transactions.give_up(volume, why).await;
    }
    let closed = volumes.closing.begin(volume);
    let Some(device) = volumes.take(volume).await else {
        if transacting {
            floe_client::lease::releases_answered().await;
            tracing::info!(volume, to, elapsed = ?started.elapsed(), "transactions ended, lease released");
            return;
        }
        tracing::warn!(
            volume,
            to,
            "asked to move a volume this gateway has not open"
        );
        return;
    };
    tracing::info!(
        volume,
        to,
        "moving the session: closing its NBD connections at request boundaries"
    );
    let give_up = started + CLOSE_WAIT_MAX;
    // Every connection holds the stack until its replies are sent.
    while Arc::strong_count(&device) > 1 && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if Arc::strong_count(&device) > 1 {
        tracing::error!(volume, "connections still answering after {CLOSE_WAIT_MAX:?}: the lease is released when they end");
    }
    if let Err(e) = device.flush().await {
        tracing::error!(volume, to, "flushing before the move failed: {e}");
    }
    drop(device);
    floe_client::draining::drained_volume(volume).await;
    floe_client::lease::releases_answered().await;
    drop(closed);
    tracing::info!(volume, to, elapsed = ?started.elapsed(), "session handed over: lease released");
}

/// Takes volume `m.volume` as it arrives, and holds it open for its clients.
async fn take(volumes: Arc<Volumes>, m: SessionMove) {
    let give_up = Instant::now() + TAKE_FOR;
    let (volume, from) = (&m.volume, &m.from);
    let device: Arc<dyn BlockDevice> = loop {
        // Waits (up to a lease term) for the holder to release it.
        match volumes.open(volume, true).await {
            Ok(device) => break device,
            Err(e) if Instant::now() < give_up => {
                tracing::debug!(volume, from, "taking the moved volume: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => {
                tracing::warn!(volume, from, "could not take the moved volume: {e}");
                return;
            }
        }
    };
    tracing::info!(volume, from, "took the moved session: serving it");
    tokio::time::sleep(HOLD).await;
    drop(device);
}
