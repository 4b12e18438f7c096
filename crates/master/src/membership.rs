//! Chunk servers: registration, heartbeats and liveness, and `floe chunkserver
//! mark-lost`. A server is up while its heartbeats arrive within
//! [`HEARTBEAT_TIMEOUT`]; heartbeats take no lock a metadata write holds, so a slow
//! store never makes a live server look down, and time the master itself stalled
//! does not count against them.

use crate::state::{put, server_key, State};
use crate::{Failure, Master, Reply};
use floe_protocol::{
    FsUsage, JournalUsage, MasterResponse, Registration, ServerId, ServerInfo, Status,
};
use std::time::Duration;
use tokio::time::Instant;

/// A chunk server silent for this long is considered down.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);

fn not_registered(id: ServerId) -> Failure {
    (
        Status::NotFound,
        format!("chunk server {id} is not registered"),
    )
}

impl State {
    pub(crate) fn refresh_liveness(&mut self) {
        let now = Instant::now();
        for server in self.servers.values_mut() {
            server.up = self
                .last_heartbeat
                .get(&server.id)
                .is_some_and(|t| now.duration_since(*t) < HEARTBEAT_TIMEOUT);
        }
    }

    /// The master itself ran `stall` late (a paused process, an overloaded host):
    /// heartbeats sent meanwhile may still wait in its sockets, so the stall does not
    /// count against the servers.
    pub(crate) fn excuse_stall(&mut self, stall: Duration) {
        let now = Instant::now();
        for heard in self.last_heartbeat.values_mut() {
            *heard = (*heard + stall).min(now);
        }
        self.refresh_liveness();
    }

    pub(crate) fn live_hosts(&self) -> usize {
        let mut hosts: Vec<&str> = self
            .servers
            .values()
            .filter(|s| s.up)
            .map(|s| s.host.as_str())
            .collect();
        hosts.sort_unstable();
        hosts.dedup();
        hosts.len()
    }
}

impl Master {
    pub(crate) async fn register(&self, registration: Registration) -> Reply {
        let Registration {
            uuid,
            address,
            host,
            class,
            emulated,
            capacity_bytes,
        } = registration;
        let id = self
            .change(
                |state| {
                    // A server that registers again (restarted) keeps its id.
                    let existing = state.servers.values().find(|s| s.uuid == uuid);
                    let (id, new_id) = match existing {
                        // Its replicas were given up: data it still holds must not count.
                        Some(server) if server.lost => {
                            return Err((
                                Status::Fenced,
                                format!(
                                    "chunk server {} was marked lost; to join again, start it \
                                     on an empty data directory (it then joins as a new server)",
                                    server.id
                                ),
                            ))
                        }
                        Some(server) => (server.id, None),
                        None => {
                            let id = state.last_server_id + 1;
                            (id as ServerId, Some(id))
                        }
                    };
                    let server = ServerInfo {
                        id,
                        uuid,
                        address,
                        host,
                        class,
                        emulated,
                        capacity_bytes,
                        used_bytes: 0,
                        up: true,
                        corrupt_blocks: 0,
                        lost: false,
                        fs: None,
                    };
                    let mut ops = vec![put(server_key(id), &server)];
                    ops.extend(new_id.map(|n| put("counter/server".into(), &n)));
                    Ok((ops, (server, new_id)))
                },
                |state, (server, new_id)| {
                    tracing::info!(id = server.id, address = %server.address, host = %server.host, class = %server.device(), "chunk server registered");
                    if let Some(id) = new_id {
                        assert!(
                            id > state.last_server_id,
                            "server id {id} handed out after {}",
                            state.last_server_id
                        );
                        state.last_server_id = id;
                    }
                    state.last_heartbeat.insert(server.id, Instant::now());
                    let id = server.id;
                    state.servers.insert(id, server);
                    id
                },
            )
            .await?;
        Ok(MasterResponse::Registered { id })
    }

    /// `corrupt_blocks`: blocks the server found failing their checksums since its
    /// last heartbeat.
    pub(crate) fn heartbeat(
        &self,
        id: ServerId,
        used_bytes: u64,
        journal: JournalUsage,
        corrupt_blocks: u64,
        fs: Option<FsUsage>,
    ) -> Reply {
        let mut state = self.state();
        let server = state
            .servers
            .get_mut(&id)
            .ok_or_else(|| not_registered(id))?;
        server.used_bytes = used_bytes;
        if let Some(fs) = fs {
            let was_short = server.fs.is_some_and(|f| f.short);
            if fs.short && !was_short {
                tracing::warn!(
                    id,
                    free_bytes = fs.free_bytes,
                    "chunk server is short of space: new copies go elsewhere"
                );
            } else if was_short && !fs.short {
                tracing::info!(
                    id,
                    free_bytes = fs.free_bytes,
                    "chunk server has room again"
                );
            }
            server.fs = Some(fs);
        }
        server.corrupt_blocks += corrupt_blocks;
        server.up = true;
        state.last_heartbeat.insert(id, Instant::now());
        state.journals.insert(id, journal);
        Ok(MasterResponse::HeartbeatAck {
            deleted_volumes: state.deleted_volumes.clone(),
            leases: state
                .leases
                .iter()
                .map(|(volume_id, lease)| (*volume_id, lease.generation))
                .collect(),
            snapshots: state.snapshot_readers(),
        })
    }

    pub(crate) async fn mark_lost(&self, id: ServerId) -> Reply {
        self.change(
            |state| {
                let mut server = state
                    .servers
                    .get(&id)
                    .cloned()
                    .ok_or_else(|| not_registered(id))?;
                if server.up {
                    return Err((
                        Status::BadRequest,
                        format!("chunk server {id} is up (heartbeating); only a failed server can be marked lost"),
                    ));
                }
                server.lost = true;
                let mut ops = vec![put(server_key(id), &server)];
                // Out of the map: CRUSH places its share elsewhere for good.
                let map = if state.map.placer.contains(id) && !state.map.map.out.contains(&id) {
                    let map = state.next_map(|map| map.out.push(id))?;
                    ops.push(map.op());
                    Some(map)
                } else {
                    None
                };
                Ok((ops, map))
            },
            |state, map| {
                tracing::warn!(id, "chunk server marked lost by an operator");
                if let Some(server) = state.servers.get_mut(&id) {
                    server.lost = true;
                }
                if let Some(map) = map {
                    state.set_map(map);
                }
            },
        )
        .await?;
        Ok(MasterResponse::Done)
    }
}
