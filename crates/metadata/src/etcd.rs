//! etcd v3 back end: the production store, shared by several masters, which elect one
//! leader through etcd's election API on a lease of [`LEADER_TTL`].

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, Txn, TxnOp,
};
use tokio::time::Instant;

use crate::{Election, MetaError, MetaStore, Op};

/// The leader's etcd lease: a standby takes over this long after the leader's last
/// keep-alive.
const LEADER_TTL: i64 = 3;
const KEEP_ALIVE_EVERY: Duration = Duration::from_millis(500);
/// A leader whose keep-alives have not been answered for this long stops leading
/// (before its lease can run out at etcd and a standby be elected).
const LEADER_GIVE_UP: Duration = Duration::from_secs(2);
/// The election's key, under the store's prefix.
const ELECTION: &str = "master-election";

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// A stalled etcd or a partition must not hang the master, so every call has a deadline.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Keys per scan request: keeps each response well under gRPC's 4 MiB message limit.
const SCAN_PAGE: i64 = 1000;

pub struct EtcdStore {
    client: Client,
    /// Prepended to every key: `"floe/"`, or empty for none.
    prefix: String,
    /// For error messages.
    endpoints: String,
    election: Arc<EtcdElection>,
}

/// The masters' election, sharing the store's client.
pub struct EtcdElection {
    client: Client,
    name: Vec<u8>,
    /// While this master leads: its election key and that key's create revision, on
    /// which every batch it applies is conditional.
    leading: Mutex<Option<(Vec<u8>, i64)>>,
}

impl EtcdStore {
    /// Connects to etcd and checks that it answers. Keys live under `prefix/` (no prefix if
    /// `prefix` is empty), so several clusters can share one etcd.
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<Self, MetaError> {
        let joined = endpoints.join(",");
        let unreachable =
            |why: String| MetaError::Backend(format!("cannot reach etcd at {joined}: {why}"));
        let options = ConnectOptions::new().with_connect_timeout(CONNECT_TIMEOUT);
        // The client connects lazily, so probe with a request to fail fast on a dead address.
        let probe = async {
            let mut client = Client::connect(endpoints, Some(options)).await?;
            client.status().await?;
            Ok::<_, etcd_client::Error>(client)
        };
        let client = match tokio::time::timeout(CONNECT_TIMEOUT, probe).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(unreachable(e.to_string())),
            Err(_) => return Err(unreachable(format!("no answer within {CONNECT_TIMEOUT:?}"))),
        };
        let prefix = prefix.trim_matches('/');
        let prefix = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        let election = Arc::new(EtcdElection {
            client: client.clone(),
            name: format!("{prefix}{ELECTION}").into_bytes(),
            leading: Mutex::new(None),
        });
        Ok(Self {
            client,
            prefix,
            endpoints: joined,
            election,
        })
    }

    fn full_key(&self, key: &str) -> Vec<u8> {
        format!("{}{key}", self.prefix).into_bytes()
    }

    async fn call<T>(
        &self,
        what: &str,
        f: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, MetaError> {
        let endpoints = &self.endpoints;
        match tokio::time::timeout(REQUEST_TIMEOUT, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(MetaError::Backend(format!(
                "etcd {what} at {endpoints}: {e}"
            ))),
            Err(_) => Err(MetaError::Backend(format!(
                "etcd {what} at {endpoints}: no answer within {REQUEST_TIMEOUT:?} (outcome unknown)"
            ))),
        }
    }
}

/// Smallest key greater than every key starting with `prefix`; `[0]` means "no upper bound".
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Smallest key greater than `key`.
fn successor(key: &[u8]) -> Vec<u8> {
    let mut next = key.to_vec();
    next.push(0);
    next
}

/// etcd rejects a txn that puts one key twice or puts a key inside a range it also deletes,
/// so the ordered batch is reduced to its net effect: the surviving puts, plus deletions
/// (single keys, and prefix ranges split around those puts) that never touch them.
fn txn_ops(ops: Vec<Op>, store_prefix: &str) -> Vec<TxnOp> {
    let full = |key: &str| format!("{store_prefix}{key}").into_bytes();
    let mut puts: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let mut deleted_keys = Vec::new();
    let mut deleted_ranges = Vec::new();
    for op in ops {
        match op {
            Op::Put { key, value } => {
                puts.insert(full(&key), value);
            }
            Op::Delete { key } => {
                let key = full(&key);
                puts.remove(&key);
                deleted_keys.push(key);
            }
            Op::DeletePrefix { prefix } => {
                let start = full(&prefix);
                let end = prefix_end(&start);
                puts.retain(|k, _| !k.starts_with(&start));
                // etcd wants a non-empty start key; "\0" is the smallest one.
                deleted_ranges.push((if start.is_empty() { vec![0] } else { start }, end));
            }
        }
    }
    let mut out = Vec::new();
    for key in deleted_keys {
        if !puts.contains_key(&key) {
            out.push(TxnOp::delete(key, None));
        }
    }
    for (start, end) in deleted_ranges {
        let unbounded = end == [0];
        let survivors = puts
            .keys()
            .filter(|k| *k >= &start && (unbounded || *k < &end));
        let mut from = start.clone();
        for key in survivors {
            if from < *key {
                out.push(TxnOp::delete(
                    from,
                    Some(DeleteOptions::new().with_range(key.clone())),
                ));
            }
            from = successor(key);
        }
        out.push(TxnOp::delete(
            from,
            Some(DeleteOptions::new().with_range(end)),
        ));
    }
    out.extend(puts.into_iter().map(|(k, v)| TxnOp::put(k, v, None)));
    out
}

#[async_trait]
impl MetaStore for EtcdStore {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError> {
        let mut client = self.client.clone();
        let resp = self
            .call("get", client.get(self.full_key(key), None))
            .await?;
        Ok(resp.kvs().first().map(|kv| kv.value().to_vec()))
    }

    async fn scan_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, MetaError> {
        let start = self.full_key(prefix);
        let end = prefix_end(&start);
        let mut from = if start.is_empty() { vec![0] } else { start };
        // Later pages read at the first page's revision, so the scan is one consistent snapshot.
        let mut revision = 0;
        let mut out = Vec::new();
        loop {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(SCAN_PAGE)
                .with_revision(revision);
            let mut client = self.client.clone();
            let mut resp = self
                .call("scan", client.get(from.clone(), Some(options)))
                .await?;
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
            }
            let more = resp.more();
            for kv in resp.take_kvs() {
                let (key, value) = kv.into_key_value();
                from = successor(&key);
                let key = String::from_utf8(key).map_err(|e| {
                    MetaError::Backend(format!("etcd at {}: key is not UTF-8: {e}", self.endpoints))
                })?;
                out.push((key[self.prefix.len()..].to_string(), value));
            }
            if !more {
                return Ok(out);
            }
        }
    }

    async fn apply(&self, ops: Vec<Op>) -> Result<(), MetaError> {
        let ops = txn_ops(ops, &self.prefix);
        if ops.is_empty() {
            return Ok(());
        }
        let mut client = self.client.clone();
        let leading = self.election.leading.lock().unwrap().clone();
        let txn = match &leading {
            Some((key, revision)) => Txn::new()
                .when(vec![Compare::create_revision(
                    key.clone(),
                    CompareOp::Equal,
                    *revision,
                )])
                .and_then(ops),
            None => Txn::new().and_then(ops),
        };
        let applied = self.call("txn", client.txn(txn)).await?;
        if leading.is_some() && !applied.succeeded() {
            return Err(MetaError::Deposed);
        }
        Ok(())
    }

    fn election(&self) -> Option<Arc<dyn Election>> {
        Some(self.election.clone())
    }
}

#[async_trait]
impl Election for EtcdElection {
    async fn campaign(
        &self,
        address: &str,
    ) -> Result<tokio::sync::oneshot::Receiver<String>, MetaError> {
        let failed = |what: &str, e: etcd_client::Error| {
            MetaError::Backend(format!("etcd election ({what}): {e}"))
        };
        let mut client = self.client.clone();
        let lease = client
            .lease_grant(LEADER_TTL, None)
            .await
            .map_err(|e| failed("lease", e))?
            .id();
        let (mut keeper, mut answers) = client
            .lease_keep_alive(lease)
            .await
            .map_err(|e| failed("keep-alive", e))?;
        // Kept alive while this master stands by too: its candidacy stays queued.
        let (lost, hear) = tokio::sync::oneshot::channel();
        let mut answered = Instant::now();
        let election = self.name.clone();
        let mut campaign = client.clone();
        let elected = campaign.campaign(election, address.to_string(), lease);
        let mut keep = Box::pin(async move {
            loop {
                tokio::time::sleep(KEEP_ALIVE_EVERY).await;
                let sent = Instant::now();
                let renewed = async {
                    keeper.keep_alive().await?;
                    answers.message().await
                };
                match tokio::time::timeout(KEEP_ALIVE_EVERY, renewed).await {
                    Ok(Ok(Some(answer))) if answer.ttl() > 0 => answered = sent,
                    other => tracing::warn!("etcd lease keep-alive failed: {other:?}"),
                }
                if answered.elapsed() >= LEADER_GIVE_UP {
                    return format!(
                        "its etcd lease was not renewed for {:?}",
                        answered.elapsed()
                    );
                }
            }
        });
        let key = tokio::select! {
            why = &mut keep => return Err(MetaError::Backend(format!("etcd election: {why}"))),
            elected = elected => elected.map_err(|e| failed("campaign", e))?,
        };
        let Some(key) = key.leader() else {
            return Err(MetaError::Backend("etcd election: no leader key".into()));
        };
        // Kept once lost too: a deposed master's batches must keep failing.
        *self.leading.lock().unwrap() = Some((key.key().to_vec(), key.rev()));
        tokio::spawn(async move {
            let why = keep.await;
            let _ = lost.send(why);
        });
        Ok(hear)
    }

    async fn leader(&self) -> Option<String> {
        let mut client = self.client.clone();
        let found = tokio::time::timeout(REQUEST_TIMEOUT, client.leader(self.name.clone())).await;
        let kv = found.ok()?.ok()?.take_kv()?;
        kv.value_str().ok().map(String::from)
    }
}
