//! Block transactions for clients in other processes (`floe gateway --tx-listen`;
//! Isotope, thesis chapter 4): the gateway holding a volume's lease runs one
//! `TxVolume` over it and serves begin, read, commit and abort
//! (`floe_protocol::transaction`) on a listener of the cluster protocol (TLS and
//! certificates as its other cluster connections: `admin` and `client` roles, and
//! the `--nbd-access` list, which must grant `rw`).
//!
//! A volume served for transactions is held alone (`Volumes::open_alone`): refused
//! while NBD clients have it open, and no NBD client opens it until it closes, since
//! NBD writes would bypass the transactions' log and NBD reads could see a commit
//! half applied. It closes once no transaction has been open on it for [`IDLE_CLOSE`].
//! A transaction belongs to its connection: ended (aborted) when the connection
//! closes, unless released (thesis 4.1): then it waits, detached, for another
//! connection to take it over with the handle its release answered, and is aborted
//! if none does within [`RELEASED_FOR`]. A volume whose session moves to another gateway ends its transactions,
//! each answered at its next request with where the volume went.

use crate::access::AccessList;
use crate::volumes::Alone;
use crate::Volumes;
use floe_blockdev::BlockDevice;
use floe_isotope::{Outcome, Transaction, TxError, TxVolume};
use floe_protocol::frame::{Frame, FrameError, Status};
use floe_protocol::server::Session;
use floe_protocol::tls::{Identity, Role};
use floe_protocol::transaction::{TxChange, TxReply, TxRequest};
use floe_protocol::Response;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::time::Instant;

/// A volume with no transaction open this long closes (its lease released).
const IDLE_CLOSE: Duration = Duration::from_secs(10);
/// Transactions one connection holds open at most.
const OPEN_PER_CONNECTION_MAX: usize = 256;
/// How long a released transaction waits to be taken over before it is aborted.
const RELEASED_FOR: Duration = Duration::from_secs(60);
/// Released transactions the gateway holds at most.
const RELEASED_MAX: usize = 1024;
/// The `connection` of a released transaction (connections count from 1).
const DETACHED: u64 = 0;
/// How long a volume moving away waits for its transactions' requests in flight.
const GIVE_UP_WAIT_MAX: Duration = Duration::from_secs(10);

/// A volume open for transactions.
struct Served {
    volume: TxVolume,
    _alone: Alone,
}

/// A transaction held for a client, or why it ended under it.
enum Slot {
    Open(Transaction),
    Ended(String),
}

struct Entry {
    /// The connection holding it, or [`DETACHED`].
    connection: u64,
    volume: String,
    slot: Arc<tokio::sync::Mutex<Slot>>,
    /// For a released transaction: its handle, and when it was released.
    released: Option<(u64, Instant)>,
}

/// The transactions of every connection, and the volumes they run on.
pub struct Transactions {
    volumes: Arc<Volumes>,
    access: Option<AccessList>,
    /// Volumes open for transactions, with when a transaction last began there.
    served: tokio::sync::Mutex<BTreeMap<String, (Arc<Served>, Instant)>>,
    open: Mutex<BTreeMap<u64, Entry>>,
    next_id: AtomicU64,
}

impl Transactions {
    pub(crate) fn new(volumes: Arc<Volumes>, access: Option<AccessList>) -> Arc<Transactions> {
        Arc::new(Transactions {
            volumes,
            access,
            served: Default::default(),
            open: Default::default(),
            next_id: AtomicU64::new(1),
        })
    }

    /// Serves transactions on `listener` until it fails; closes idle volumes.
    pub(crate) async fn serve(self: Arc<Self>, listener: TcpListener) {
        let address = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        tracing::info!(%address, "gateway serving transactions");
        let idle = tokio::spawn(self.clone().close_idle());
        let open = || {
            Arc::new(Connection {
                service: self.clone(),
                id: self.next_id.fetch_add(1, Ordering::Relaxed),
            })
        };
        if let Err(e) = floe_protocol::server::serve_sessions(listener, open).await {
            tracing::error!(%address, "the transaction listener failed: {e}");
        }
        idle.abort();
    }

    async fn close_idle(self: Arc<Self>) {
        loop {
            tokio::time::sleep(IDLE_CLOSE / 4).await;
            // Released transactions nobody took over abort (dropped).
            self.open.lock().unwrap().retain(|_, e| {
                e.released
                    .is_none_or(|(_, released)| released.elapsed() < RELEASED_FOR)
            });
            let idle: Vec<(String, Arc<Served>)> = {
                let mut served = self.served.lock().await;
                let open = self.open.lock().unwrap();
                let names: Vec<String> = served
                    .iter()
                    .filter(|(volume, (_, began))| {
                        began.elapsed() >= IDLE_CLOSE
                            && !open.values().any(|e| &e.volume == *volume)
                    })
                    .map(|(volume, _)| volume.clone())
                    .collect();
                let mut closing = |name: String| served.remove(&name).map(|(v, _)| (name, v));
                names.into_iter().filter_map(&mut closing).collect()
            };
            for (name, volume) in idle {
                settle(&name, &volume).await;
            }
        }
    }

    /// The volume's `TxVolume`, opened (alone) if it is not.
    async fn volume(&self, name: &str) -> Result<Arc<Served>, String> {
        let mut served = self.served.lock().await;
        if let Some((volume, began)) = served.get_mut(name) {
            *began = Instant::now();
            return Ok(volume.clone());
        }
        let (device, alone) = self.volumes.open_alone(name).await?;
        let volume = TxVolume::open(device, floe_isotope::Isolation::StrictSerializable)
            .await
            .map_err(|e| format!("cannot open volume {name} for transactions: {e}"))?;
        let opened = Arc::new(Served {
            volume,
            _alone: alone,
        });
        served.insert(name.to_string(), (opened.clone(), Instant::now()));
        Ok(opened)
    }

    /// Ends every transaction on `volume` with `why`, closes it, and waits (bounded)
    /// until nothing holds it: its session moves to another gateway, or it stopped
    /// taking commits (the next begin opens it again, replaying its log). Each
    /// transaction's next request is answered `why`.
    pub(crate) async fn give_up(&self, volume: &str, why: String) -> bool {
        let Some((served, _)) = self.served.lock().await.remove(volume) else {
            return false;
        };
        let device: Weak<dyn BlockDevice> = Arc::downgrade(&served.volume.device());
        let slots: Vec<_> = {
            let open = self.open.lock().unwrap();
            let on = open.values().filter(|e| e.volume == volume);
            on.map(|e| e.slot.clone()).collect()
        };
        tracing::info!(
            volume,
            transactions = slots.len(),
            "ending the volume's transactions: {why}"
        );
        for slot in slots {
            *slot.lock().await = Slot::Ended(why.clone());
        }
        // Commits under way finish first, then everything committed goes in place.
        let give_up = Instant::now() + GIVE_UP_WAIT_MAX;
        while Arc::strong_count(&served) > 1 && Instant::now() < give_up {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        settle(volume, &served).await;
        drop(served);
        while device.strong_count() > 0 && Instant::now() < give_up {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }
}

/// Writes every commit of a volume this gateway lets go in place (they are answered
/// once logged): a plain reader of it (NBD, here or at the next holder) then sees
/// them all without replaying the log.
async fn settle(name: &str, served: &Served) {
    if let Err(e) = served.volume.settle().await {
        tracing::warn!(
            volume = name,
            "commits not all in place as the volume closes: {e}; its next transactional open replays them"
        );
    }
}

impl Transactions {
    /// Gives up every volume: the gateway stops or upgrades in place.
    pub(crate) async fn give_up_all(&self, why: &str) {
        let volumes: Vec<String> = self.served.lock().await.keys().cloned().collect();
        for volume in volumes {
            self.give_up(&volume, format!("{why}: begin the transaction again"))
                .await;
        }
    }
}

/// One client connection's transactions.
struct Connection {
    service: Arc<Transactions>,
    id: u64,
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Its transactions abort with it.
        let mut open = self.service.open.lock().unwrap();
        open.retain(|_, entry| entry.connection != self.id);
    }
}

fn too_many_open() -> Refusal {
    (
        Status::BadRequest,
        format!("{OPEN_PER_CONNECTION_MAX} transactions are open on this connection: commit or abort some first"),
    )
}

fn refused(e: TxError) -> Refusal {
    let status = match e {
        TxError::Stopped(_) | TxError::Remote(_) => Status::Unavailable,
        TxError::Io(_) => Status::Io,
        _ => Status::BadRequest,
    };
    (status, e.to_string())
}

type Refusal = (Status, String);
type Answer = Result<TxReply, Refusal>;
type Held = Arc<tokio::sync::Mutex<Slot>>;

impl Connection {
    async fn begin(&self, volume: String, isolation: Option<floe_isotope::Isolation>) -> Answer {
        let mine = {
            let open = self.service.open.lock().unwrap();
            open.values().filter(|e| e.connection == self.id).count()
        };
        if mine >= OPEN_PER_CONNECTION_MAX {
            return Err(too_many_open());
        }
        let served = self
            .service
            .volume(&volume)
            .await
            .map_err(|e| (Status::Unavailable, e))?;
        let begun = match isolation {
            Some(isolation) => served.volume.begin_with(isolation),
            None => served.volume.begin(),
        };
        let mut tx = begun.map_err(refused)?;
        let start_version = tx.start_version();
        let data_blocks = served.volume.data_blocks();
        let id = self.service.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            connection: self.id,
            volume,
            slot: Arc::new(tokio::sync::Mutex::new(Slot::Open(tx))),
            released: None,
        };
        self.service.open.lock().unwrap().insert(id, entry);
        Ok(TxReply::Begun {
            tx: id,
            start_version,
            data_blocks,
        })
    }

    /// Transaction `id` of this connection, taken out of the open ones if `remove`.
    fn entry(&self, id: u64, remove: bool) -> Result<(Held, String), Refusal> {
        let mut open = self.service.open.lock().unwrap();
        let unknown = || {
            (
                Status::NotFound,
                format!("no open transaction {id} on this connection"),
            )
        };
        let entry = open
            .get(&id)
            .filter(|e| e.connection == self.id)
            .ok_or_else(unknown)?;
        let found = (entry.slot.clone(), entry.volume.clone());
        if remove {
            open.remove(&id);
        }
        Ok(found)
    }

    /// Serves a request on transaction `id`; an error ends the transaction.
    async fn on(&self, id: u64, request: TxRequest) -> Answer {
        let commit = matches!(request, TxRequest::Commit { .. } | TxRequest::Abort { .. });
        let (slot, volume) = self.entry(id, commit)?;
        let mut slot = slot.lock().await;
        let tx = match &mut *slot {
            Slot::Open(tx) => tx,
            Slot::Ended(why) => {
                let why = why.clone();
                self.service.open.lock().unwrap().remove(&id);
                return Err((Status::Moved, why));
            }
        };
        let answer = match request {
            TxRequest::Read { changes, block, .. } => match apply(tx, changes) {
                Ok(()) => tx.read(block).await.map(TxReply::Block).map_err(refused),
                Err(e) => Err(e),
            },
            TxRequest::Apply { changes, .. } => apply(tx, changes).map(|()| TxReply::Done),
            TxRequest::Commit { changes, .. } => {
                let Slot::Open(tx) = std::mem::replace(&mut *slot, Slot::Ended("committed".into()))
                else {
                    unreachable!("matched open above")
                };
                self.commit(tx, changes, &volume).await
            }
            TxRequest::Abort { .. } => Ok(TxReply::Done),
            TxRequest::Release { changes, .. } => match apply(tx, changes) {
                Ok(()) => self.release(id),
                Err(e) => Err(e),
            },
            TxRequest::Begin { .. } | TxRequest::TakeOver { .. } => {
                unreachable!("names no transaction")
            }
        };
        if answer.is_err() {
            *slot = Slot::Ended("ended by an error".into());
            self.service.open.lock().unwrap().remove(&id);
        }
        answer
    }

    /// Detaches transaction `id` from this connection under a fresh handle.
    fn release(&self, id: u64) -> Answer {
        let mut open = self.service.open.lock().unwrap();
        if open.values().filter(|e| e.released.is_some()).count() >= RELEASED_MAX {
            return Err((
                Status::Busy,
                format!("{RELEASED_MAX} released transactions wait to be taken over: take some over first"),
            ));
        }
        let handle = rand::random::<u64>();
        let entry = open.get_mut(&id).expect("served under its entry");
        entry.connection = DETACHED;
        entry.released = Some((handle, Instant::now()));
        Ok(TxReply::Released { handle })
    }

    /// Attaches the released transaction `handle` names to this connection.
    async fn take_over(&self, handle: u64) -> Answer {
        let (id, slot, volume) = {
            let mut open = self.service.open.lock().unwrap();
            let mine = open.values().filter(|e| e.connection == self.id).count();
            if mine >= OPEN_PER_CONNECTION_MAX {
                return Err(too_many_open());
            }
            let found = open
                .iter_mut()
                .find(|(_, e)| e.released.is_some_and(|(h, _)| h == handle));
            let Some((id, entry)) = found else {
                return Err((
                    Status::NotFound,
                    "no released transaction has this handle (taken over already, or aborted after waiting)".into(),
                ));
            };
            entry.connection = self.id;
            entry.released = None;
            (*id, entry.slot.clone(), entry.volume.clone())
        };
        let start_version = match &mut *slot.lock().await {
            Slot::Open(tx) => tx.start_version(),
            Slot::Ended(why) => {
                self.service.open.lock().unwrap().remove(&id);
                return Err((Status::Moved, why.clone()));
            }
        };
        let data_blocks = self
            .service
            .volume(&volume)
            .await
            .map_err(|e| (Status::Unavailable, e))?
            .volume
            .data_blocks();
        Ok(TxReply::Begun {
            tx: id,
            start_version,
            data_blocks,
        })
    }

    async fn commit(&self, mut tx: Transaction, changes: Vec<TxChange>, volume: &str) -> Answer {
        apply(&mut tx, changes)?;
        match tx.commit().await {
            Ok(Outcome::Committed { version }) => Ok(TxReply::Committed { version }),
            Ok(Outcome::Conflict) => Ok(TxReply::Conflict),
            Err(e) => {
                if let TxError::Stopped(why) = &e {
                    let why =
                        format!("volume {volume} stopped taking commits ({why}): begin again");
                    self.service.give_up(volume, why).await;
                }
                Err(refused(e))
            }
        }
    }
}

/// The client's buffered calls, in its order.
fn apply(tx: &mut Transaction, changes: Vec<TxChange>) -> Result<(), Refusal> {
    for change in changes {
        match change {
            TxChange::Write { block, data } => tx.write(block, data),
            TxChange::Mark {
                block,
                offset,
                length,
            } => tx.mark_accessed(block, offset as usize, length as usize),
        }
        .map_err(refused)?;
    }
    Ok(())
}

impl Session for Connection {
    type Request = TxRequest;

    fn decode(frame: Frame) -> Result<TxRequest, FrameError> {
        TxRequest::decode(frame)
    }

    fn permits(&self, peer: &Identity, request: &TxRequest) -> Result<(), String> {
        if !matches!(peer.role, Role::Admin | Role::Client) {
            return Err(format!(
                "a {} certificate runs no transactions (admin and client ones do)",
                peer.role
            ));
        }
        let taken_over = |handle: u64| {
            let open = self.service.open.lock().unwrap();
            let mut released = open.values();
            released
                .find(|e| e.released.is_some_and(|(h, _)| h == handle))
                .map(|e| e.volume.clone())
        };
        let volume = match request {
            TxRequest::Begin { volume, .. } => Some(volume.clone()),
            TxRequest::TakeOver { handle } => taken_over(*handle),
            _ => None,
        };
        match (volume, &self.service.access) {
            (Some(volume), Some(access)) => match access.grant(Some(&peer.name), &volume) {
                Some(true) => Ok(()),
                _ => Err(format!(
                    "client {} may not write volume {volume} (the gateway's access list)",
                    peer.name
                )),
            },
            _ => Ok(()),
        }
    }

    async fn serve(self: Arc<Self>, request: TxRequest, kind: u16, request_id: u64) -> Frame {
        let answer = match request {
            TxRequest::Begin { volume, isolation } => self.begin(volume, isolation).await,
            TxRequest::TakeOver { handle } => self.take_over(handle).await,
            other => {
                let id = other.tx().expect("only a begin names no transaction");
                self.on(id, other).await
            }
        };
        match answer {
            Ok(reply) => reply.encode(request_id),
            Err((status, message)) => Response::error(status, message).encode(kind, request_id),
        }
    }
}
