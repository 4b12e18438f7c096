//! What the network sees, checked as it happens: lease grants (for the split-brain
//! check) and the changes replicas acknowledge, by chunk and version (a version must
//! never stand for two different changes). An unsynced write (write-back) a replica
//! acknowledged counts towards committing its version only once that replica
//! answered a `ReplicaRequest::Sync` covering it: until then a power cut may take it.

use floe_protocol::{
    ChunkId, MasterRequest, MasterResponse, ReplicaRequest, ReplicaResponse, Request, Response,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// A lease the master granted: from `at` the volume's writes belong to `holder`.
#[derive(Debug, Clone)]
pub struct Grant {
    pub at: Duration,
    pub holder: String,
    pub generation: u32,
}

/// What one acknowledged change wrote: offset, length and a checksum of its bytes
/// (`None` for a zero).
type Change = (u64, u64, Option<u32>);

pub struct Observations {
    start: Instant,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    grants: Vec<Grant>,
    changes: BTreeMap<(ChunkId, u64), Change>,
    /// The replicas (by address) that acknowledged each change durably.
    acked_by: BTreeMap<(ChunkId, u64), BTreeSet<String>>,
    /// The replicas (by address) that acknowledged each change unsynced.
    acked_unsynced: BTreeMap<(ChunkId, u64), BTreeSet<String>>,
    /// The highest version of each chunk a replica (by address) answered a `Sync`
    /// for: every change it acknowledged up to there is durable.
    synced: BTreeMap<(ChunkId, String), u64>,
    violations: Vec<String>,
}

impl Observations {
    pub fn new(start: Instant) -> Observations {
        Observations {
            start,
            inner: Mutex::default(),
        }
    }

    /// A request was served with `response`.
    pub fn reply(&self, request: &Request, response: &Response, server: &str) {
        let at = self.start.elapsed();
        let mut inner = self.inner.lock().unwrap();
        match (request, response) {
            (
                Request::Master(MasterRequest::AcquireLease { holder, .. }),
                Response::Master(MasterResponse::Lease { generation, .. }),
            ) => {
                // A resent request's answer: the same grant again.
                let last = inner.grants.last();
                if last.is_some_and(|g| (g.generation, &g.holder) == (*generation, holder)) {
                    return;
                }
                if let Some(last) = last.filter(|g| g.generation >= *generation) {
                    let message = format!(
                        "lease generation {generation} granted to {holder} at {at:?}, after \
                         generation {} went to {}",
                        last.generation, last.holder
                    );
                    inner.violations.push(message);
                }
                inner.grants.push(Grant {
                    at,
                    holder: holder.clone(),
                    generation: *generation,
                })
            }
            (
                Request::Write {
                    chunk,
                    stamp,
                    offset,
                    data,
                    unsynced,
                    ..
                },
                Response::Done,
            ) => {
                let change = (*offset, data.len() as u64, Some(crc32c::crc32c(data)));
                if *unsynced {
                    inner
                        .acked_unsynced
                        .entry((*chunk, stamp.version))
                        .or_default()
                        .insert(server.to_string());
                    inner.known(*chunk, stamp.version, change);
                } else {
                    inner.change(*chunk, stamp.version, change, server)
                }
            }
            (
                Request::Replica(ReplicaRequest::Sync { chunk, version }),
                Response::Replica(ReplicaResponse::Done) | Response::Done,
            ) => {
                let synced = inner
                    .synced
                    .entry((*chunk, server.to_string()))
                    .or_default();
                *synced = (*synced).max(*version);
            }
            (
                Request::Zero {
                    chunk,
                    stamp,
                    offset,
                    length,
                    ..
                },
                Response::Done,
            ) => inner.change(*chunk, stamp.version, (*offset, *length, None), server),
            _ => {}
        }
    }

    pub fn grants(&self) -> Vec<Grant> {
        self.inner.lock().unwrap().grants.clone()
    }

    /// The newest version of `chunk` that at least `majority` replicas acknowledged
    /// durably (an unsynced write's acknowledgment counts once its replica synced it):
    /// committed, so every replica of a healed chunk must hold it.
    /// Returns the version and the replicas that acknowledged it.
    pub fn committed(&self, chunk: ChunkId, majority: usize) -> (u64, Vec<String>) {
        let inner = self.inner.lock().unwrap();
        let range = (chunk, 0)..=(chunk, u64::MAX);
        let versions: BTreeSet<u64> = (inner.acked_by.range(range.clone()))
            .chain(inner.acked_unsynced.range(range.clone()))
            .map(|((_, version), _)| *version)
            .collect();
        versions
            .into_iter()
            .rev()
            .map(|version| {
                let durable = inner.acked_by.get(&(chunk, version)).into_iter().flatten();
                let synced = (inner.acked_unsynced.get(&(chunk, version)).into_iter())
                    .flatten()
                    .filter(|server| {
                        inner
                            .synced
                            .get(&(chunk, server.to_string()))
                            .is_some_and(|&synced| synced >= version)
                    });
                let servers: BTreeSet<String> = durable.chain(synced).cloned().collect();
                (version, servers)
            })
            .find(|(_, servers)| servers.len() >= majority)
            .map(|(version, servers)| (version, servers.into_iter().collect()))
            .unwrap_or_default()
    }

    /// The holder of the latest grant.
    pub fn holder(&self) -> Option<String> {
        let inner = self.inner.lock().unwrap();
        inner.grants.last().map(|g| g.holder.clone())
    }

    pub fn violation(&self, what: String) {
        self.inner.lock().unwrap().violations.push(what);
    }

    pub fn violations(&self) -> Vec<String> {
        self.inner.lock().unwrap().violations.clone()
    }
}

impl Inner {
    /// A replica acknowledged `change` durably as `version` of `chunk`.
    fn change(&mut self, chunk: ChunkId, version: u64, change: Change, server: &str) {
        self.acked_by
            .entry((chunk, version))
            .or_default()
            .insert(server.to_string());
        self.known(chunk, version, change);
    }

    /// A replica acknowledged `change` as `version` of `chunk`: no other change may
    /// have that version.
    fn known(&mut self, chunk: ChunkId, version: u64, change: Change) {
        let known = *self.changes.entry((chunk, version)).or_insert(change);
        if known != change {
            self.violations.push(format!(
                "chunk {chunk:?} version {version:#x} acknowledged for two different changes: \
                 {known:?} and {change:?}"
            ));
        }
    }
}
