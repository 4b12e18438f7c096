//! Sessions moving between gateways (Strata, FAST'14 sections 4 and 6;
//! `floe volume move-session`). Gateways name themselves in a long-poll
//! (`GatewayPoll`), which is also how the master knows they are alive; a move is
//! recorded here and brought to both gateways by their polls: the holder finishes
//! its clients' requests, makes them durable, releases the lease and closes their
//! connections, and the target takes the lease.
//!
//! While a move lives, only its target may take the volume's lease: anyone else is
//! refused at once with `Moved`, naming the target. It ends when the target's lease
//! ends (released or run out: the target is gone, so others may serve the volume
//! again), or when the target stops polling before it took the lease. Kept in
//! memory only: after a master failover the gateways poll the new leader within a
//! few seconds, and a move under way is forgotten (its target still takes the
//! volume when the client reconnects there).

use crate::lease::Lease;
use crate::state::State;
use crate::{Failure, Master, Reply};
use floe_protocol::{GatewayInfo, MasterResponse, SessionInfo, SessionMove, Status};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

/// A gateway not heard from for this long is gone: a move to it is given up, and
/// moves to it are refused. Gateways poll at least every `crate::WATCH_WAIT_MAX`.
pub const GATEWAY_GONE: Duration = Duration::from_secs(10);

#[derive(Default)]
pub(crate) struct Sessions {
    gateways: BTreeMap<String, Gateway>,
    /// By volume id.
    moves: BTreeMap<u64, Move>,
}

struct Gateway {
    address: String,
    holder: String,
    seen: Instant,
}

struct Move {
    session: SessionMove,
    /// The target's lease generation, once it took the volume.
    taken: Option<u32>,
}

/// Whether `lease` is alive: neither released nor run out.
fn alive(lease: &Lease, now: Instant) -> bool {
    !lease.revoked && lease.expires.is_some_and(|e| e > now)
}

impl Sessions {
    fn gone(gateway: &Gateway, now: Instant) -> bool {
        now.saturating_duration_since(gateway.seen) > GATEWAY_GONE
    }

    /// The gateway whose leases are taken as `holder`.
    fn gateway_of(&self, holder: &str) -> Option<&str> {
        self.gateways
            .iter()
            .find(|(_, g)| g.holder == holder)
            .map(|(name, _)| name.as_str())
    }

    /// Drops the moves that ended: the target's lease ended, or the target went
    /// away before it took the volume.
    fn prune(&mut self, state: &State) {
        let now = Instant::now();
        let gateways = &self.gateways;
        self.moves.retain(|volume_id, m| {
            let lease = state.leases.get(volume_id);
            let live = match m.taken {
                Some(generation) => {
                    lease.is_some_and(|l| l.generation == generation && alive(l, now))
                }
                None => gateways.get(&m.session.to).is_some_and(|g| !Sessions::gone(g, now)),
            };
            if !live {
                tracing::info!(volume = %m.session.volume, to = %m.session.to, taken = ?m.taken, "session move over");
            }
            live
        });
    }

    /// A gateway's poll: it is alive. Refused if another live gateway has its name.
    fn seen(&mut self, name: &str, address: &str, holder: &str) -> Result<(), Failure> {
        let now = Instant::now();
        if let Some(other) = self.gateways.get(name) {
            if other.holder != holder && !Sessions::gone(other, now) {
                return Err((
                    Status::AlreadyExists,
                    format!(
                        "gateway name {name} is taken by {} (NBD at {}); give each gateway its own --name",
                        other.holder, other.address
                    ),
                ));
            }
        }
        let gateway = Gateway {
            address: address.to_string(),
            holder: holder.to_string(),
            seen: now,
        };
        self.gateways.insert(name.to_string(), gateway);
        Ok(())
    }

    /// The moves gateway `name` takes part in that its target has not completed.
    fn moves_of(&self, name: &str) -> Vec<SessionMove> {
        self.moves
            .values()
            .filter(|m| m.taken.is_none() && (m.session.from == name || m.session.to == name))
            .map(|m| m.session.clone())
            .collect()
    }

    fn info(&self, state: &State, name: &str, volume_id: u64) -> SessionInfo {
        let lease = state
            .leases
            .get(&volume_id)
            .filter(|l| alive(l, Instant::now()));
        SessionInfo {
            volume: name.to_string(),
            holder: lease.map(|l| l.holder.clone()),
            generation: lease.map_or(0, |l| l.generation),
            gateway: lease.and_then(|l| self.gateway_of(&l.holder).map(str::to_string)),
            moving: self.moves.get(&volume_id).map(|m| m.session.clone()),
        }
    }

    /// Whether `holder` may take volume `name`'s lease: not while it moves to
    /// another gateway.
    pub(crate) fn admit(&mut self, state: &State, name: &str, holder: &str) -> Result<(), Failure> {
        self.prune(state);
        let Some(volume) = state.volumes.get(name) else {
            return Ok(());
        };
        let Some(m) = self.moves.get(&volume.id) else {
            return Ok(());
        };
        if self.gateway_of(holder) == Some(m.session.to.as_str()) {
            return Ok(());
        }
        let address = self
            .gateways
            .get(&m.session.to)
            .map_or("?", |g| g.address.as_str());
        Err((
            Status::Moved,
            format!(
                "volume {name} was moved to gateway {} (NBD at {address}) by `floe volume move-session`: open it there",
                m.session.to
            ),
        ))
    }

    /// `holder` took volume `volume_id`'s lease at `generation`: if it is the target
    /// of the volume's move, the move is complete.
    pub(crate) fn granted(&mut self, volume_id: u64, holder: &str, generation: u32) {
        let target = self.gateway_of(holder).map(str::to_string);
        if let Some(m) = self.moves.get_mut(&volume_id) {
            if m.taken.is_none() && target.as_deref() == Some(m.session.to.as_str()) {
                m.taken = Some(generation);
                tracing::info!(volume = %m.session.volume, to = %m.session.to, generation, "session moved");
            }
        }
    }

    fn gateways(&self, state: &State) -> Vec<GatewayInfo> {
        let now = Instant::now();
        self.gateways
            .iter()
            .map(|(name, g)| GatewayInfo {
                name: name.clone(),
                address: g.address.clone(),
                holder: g.holder.clone(),
                seen_ms_ago: now.saturating_duration_since(g.seen).as_millis() as u64,
                volumes: state
                    .volumes
                    .values()
                    .filter(|v| {
                        let lease = state.leases.get(&v.id);
                        lease.is_some_and(|l| l.holder == g.holder && alive(l, now))
                    })
                    .map(|v| v.spec.name.clone())
                    .collect(),
            })
            .collect()
    }
}

impl Master {
    /// A gateway's long-poll for the moves it takes part in.
    pub(crate) async fn gateway_poll(
        &self,
        gateway: [String; 3],
        known: Vec<SessionMove>,
        wait: Duration,
    ) -> Reply {
        let [name, address, holder] = gateway;
        let moves = crate::long_poll(&self.sessions_changed, wait, || {
            let state = self.state();
            let mut sessions = self.sessions.lock().unwrap();
            sessions.seen(&name, &address, &holder)?;
            sessions.prune(&state);
            let moves = sessions.moves_of(&name);
            let news = moves != known;
            Ok((moves, news))
        });
        Ok(MasterResponse::Moves {
            moves: moves.await?,
        })
    }

    /// `floe volume move-session NAME --to TO`: records the move; the gateways'
    /// polls carry it out.
    pub(crate) fn move_session(&self, name: &str, to: &str) -> Reply {
        let state = self.state();
        let volume = state.volume(name)?;
        let mut sessions = self.sessions.lock().unwrap();
        sessions.prune(&state);
        let now = Instant::now();
        let reachable = |gateway: &str| -> Result<(), Failure> {
            let Some(g) = sessions.gateways.get(gateway) else {
                let known: Vec<&str> = sessions.gateways.keys().map(String::as_str).collect();
                return Err((
                    Status::NotFound,
                    format!(
                        "no gateway named {gateway} (gateways the master knows: {})",
                        if known.is_empty() {
                            "none".to_string()
                        } else {
                            known.join(", ")
                        }
                    ),
                ));
            };
            if Sessions::gone(g, now) {
                return Err((
                    Status::Unavailable,
                    format!(
                        "gateway {gateway} (NBD at {}) is not reachable: the master has not heard from it for {:.1} s",
                        g.address,
                        now.saturating_duration_since(g.seen).as_secs_f64()
                    ),
                ));
            }
            Ok(())
        };
        reachable(to)?;
        let Some(lease) = state.leases.get(&volume.id).filter(|l| alive(l, now)) else {
            return Err((
                Status::BadRequest,
                format!("volume {name} is not open on any gateway: there is no session to move (a client opens it through gateway {to} directly)"),
            ));
        };
        let Some(from) = sessions.gateway_of(&lease.holder).map(str::to_string) else {
            return Err((
                Status::BadRequest,
                format!(
                    "volume {name} is held by {}, not by a gateway: only a gateway's session moves",
                    lease.holder
                ),
            ));
        };
        if let Some(m) = sessions.moves.get(&volume.id) {
            if m.taken.is_none() && m.session.to != to {
                return Err((
                    Status::Busy,
                    format!(
                        "volume {name} is moving to gateway {} already; move it again once there",
                        m.session.to
                    ),
                ));
            }
        }
        if from != to {
            reachable(&from)?;
            let session = SessionMove {
                volume: name.to_string(),
                from,
                to: to.to_string(),
            };
            tracing::info!(volume = %name, from = %session.from, to, "moving the session");
            let taken = None;
            sessions.moves.insert(volume.id, Move { session, taken });
            self.sessions_changed.notify_waiters();
        }
        Ok(MasterResponse::Session(
            sessions.info(&state, name, volume.id),
        ))
    }

    /// Who serves volume `name`, once that differs from `known` (or after `wait`).
    pub(crate) async fn watch_session(
        &self,
        name: &str,
        known: Option<SessionInfo>,
        wait: Duration,
    ) -> Reply {
        let session = crate::long_poll(&self.sessions_changed, wait, || {
            let state = self.state();
            let volume = state.volume(name)?;
            let mut sessions = self.sessions.lock().unwrap();
            sessions.prune(&state);
            let now = sessions.info(&state, name, volume.id);
            let news = Some(&now) != known.as_ref();
            Ok((now, news))
        });
        Ok(MasterResponse::Session(session.await?))
    }

    /// The gateways, for `floe status`.
    pub(crate) fn gateways(&self, state: &State) -> Vec<GatewayInfo> {
        self.sessions.lock().unwrap().gateways(state)
    }
}
