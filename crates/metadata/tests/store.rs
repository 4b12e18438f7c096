//! One suite, run against both back ends: they must be interchangeable.

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use floe_metadata::{open, MetaError, MetaStore, Op};

fn put(key: &str, value: &str) -> Op {
    Op::Put {
        key: key.into(),
        value: value.into(),
    }
}

fn del(key: &str) -> Op {
    Op::Delete { key: key.into() }
}

fn del_prefix(prefix: &str) -> Op {
    Op::DeletePrefix {
        prefix: prefix.into(),
    }
}

async fn get(store: &dyn MetaStore, key: &str) -> Option<String> {
    let value = store.get(key).await.unwrap();
    value.map(|v| String::from_utf8(v).unwrap())
}

async fn scan(store: &dyn MetaStore, prefix: &str) -> Vec<(String, String)> {
    let pairs = store.scan_prefix(prefix).await.unwrap();
    pairs
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8(v).unwrap()))
        .collect()
}

fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
    expected
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Opens `address`, checks the store's semantics, then reopens it to check persistence.
/// Expects an empty store.
async fn suite(address: &str) {
    let store = open(address).await.unwrap();
    semantics(store.as_ref()).await;
    // Reopening sees everything committed.
    drop(store);
    let store = open(address).await.unwrap();
    assert_eq!(scan(store.as_ref(), "").await, after_semantics());
}

/// What [`semantics`] leaves in the store.
fn after_semantics() -> Vec<(String, String)> {
    pairs(&[
        ("a/c", "3"),
        ("a0", "6"),
        ("vol/x", "meta"),
        ("vol/x/chunk/0", "c0"),
    ])
}

/// Checks a store's semantics on an empty store.
async fn semantics(s: &dyn MetaStore) {
    // put / get / overwrite / delete
    assert_eq!(get(s, "k").await, None);
    s.apply(vec![put("k", "1")]).await.unwrap();
    assert_eq!(get(s, "k").await.as_deref(), Some("1"));
    s.apply(vec![put("k", "2")]).await.unwrap();
    assert_eq!(get(s, "k").await.as_deref(), Some("2"));
    s.apply(vec![del("k")]).await.unwrap();
    assert_eq!(get(s, "k").await, None);
    s.apply(vec![del("never-existed")]).await.unwrap();
    s.apply(vec![]).await.unwrap();

    // Values are opaque bytes.
    let binary = vec![0u8, 255, 10, 0];
    s.apply(vec![Op::Put {
        key: "bin".into(),
        value: binary.clone(),
    }])
    .await
    .unwrap();
    assert_eq!(s.get("bin").await.unwrap(), Some(binary));
    s.apply(vec![del("bin")]).await.unwrap();

    // Scan is in key order whatever the insertion order, and prefixes are plain strings.
    s.apply(vec![
        put("a/c", "3"),
        put("a/bc", "2"),
        put("a/b", "1"),
        put("a/b/x", "4"),
    ])
    .await
    .unwrap();
    s.apply(vec![put("a", "0"), put("b/a", "5"), put("a0", "6")])
        .await
        .unwrap();
    assert_eq!(
        scan(s, "a/").await,
        pairs(&[("a/b", "1"), ("a/b/x", "4"), ("a/bc", "2"), ("a/c", "3")])
    );
    assert_eq!(
        scan(s, "a/b").await,
        pairs(&[("a/b", "1"), ("a/b/x", "4"), ("a/bc", "2")])
    );
    assert_eq!(scan(s, "a/b/").await, pairs(&[("a/b/x", "4")]));
    assert_eq!(scan(s, "zzz").await, pairs(&[]));
    assert_eq!(scan(s, "").await.len(), 7);

    // Deleting prefix "a/b/" leaves "a/b" and "a/bc" alone.
    s.apply(vec![del_prefix("a/b/")]).await.unwrap();
    assert_eq!(
        scan(s, "a/").await,
        pairs(&[("a/b", "1"), ("a/bc", "2"), ("a/c", "3")])
    );
    // Prefix "a/b" is a string prefix: it takes "a/bc" too, but not "a/c".
    s.apply(vec![del_prefix("a/b")]).await.unwrap();
    assert_eq!(scan(s, "a/").await, pairs(&[("a/c", "3")]));
    assert_eq!(get(s, "a").await.as_deref(), Some("0"));
    assert_eq!(get(s, "a0").await.as_deref(), Some("6"));
    s.apply(vec![del_prefix("nothing/")]).await.unwrap();

    // A batch applies as if in order, even when ops overlap: the last op on a key wins.
    s.apply(vec![
        put("v/1", "old"),
        put("v/2", "old"),
        put("v/3", "x"),
        put("w", "x"),
        del_prefix("v/"),
        put("v/2", "new"),
        put("v/2", "newer"),
        put("v/4", "new"),
        del("v/4"),
        del("w"),
        del("w"),
        put("w", "back"),
    ])
    .await
    .unwrap();
    assert_eq!(scan(s, "v/").await, pairs(&[("v/2", "newer")]));
    assert_eq!(get(s, "w").await.as_deref(), Some("back"));
    s.apply(vec![del_prefix("v/"), del("w")]).await.unwrap();

    // Atomic batch: puts and deletes land together.
    s.apply(vec![
        put("vol/x", "meta"),
        put("vol/x/chunk/0", "c0"),
        del("a"),
        del_prefix("b/"),
    ])
    .await
    .unwrap();
    assert_eq!(scan(s, "").await, after_semantics());
}

#[tokio::test]
async fn memory_store_and_its_clones_share_contents() {
    let store = floe_metadata::memory::MemoryStore::default();
    semantics(&store).await;
    // A restarted master holds a clone, as masters share an etcd cluster.
    let clone = store.clone();
    drop(store);
    assert_eq!(scan(&clone, "").await, after_semantics());
}

#[tokio::test]
async fn embedded_store() {
    let dir = tempfile::tempdir().unwrap();
    // A missing parent directory is created.
    let path = dir.path().join("sub/dir/meta.redb");
    suite(&format!("embedded:{}", path.display())).await;
}

#[tokio::test]
async fn embedded_error_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    // The "file" is a directory, so redb cannot open it.
    let path = dir.path().display().to_string();
    let Err(MetaError::Backend(message)) = open(&format!("embedded:{path}")).await else {
        panic!("opening a directory as a store should fail");
    };
    assert!(message.contains(&path), "{message}");
}

#[tokio::test]
async fn bad_address() {
    for address in ["nonsense", "", "redis://x", "embedded", "etcd:/x"] {
        let result = open(address).await;
        assert!(matches!(result, Err(MetaError::BadAddress(_))), "{address}");
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A throwaway single-node etcd, killed on drop so a failing test does not leak it.
struct Etcd {
    child: Child,
    client_port: u16,
    _data: tempfile::TempDir,
}

impl Etcd {
    fn start() -> Etcd {
        const ETCD: &str = "/usr/bin/etcd";
        assert!(
            Path::new(ETCD).exists(),
            "{ETCD} not found: install Debian's etcd-server to run the etcd tests"
        );
        let data = tempfile::tempdir().unwrap();
        let client_port = free_port();
        let peer = format!("http://127.0.0.1:{}", free_port());
        let client = format!("http://127.0.0.1:{client_port}");
        let child = Command::new(ETCD)
            .arg("--name=floe-test")
            .arg(format!("--data-dir={}", data.path().display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=floe-test={peer}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {ETCD}: {e}"));
        let mut etcd = Etcd {
            child,
            client_port,
            _data: data,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", client_port)).is_err() {
            if let Some(status) = etcd.child.try_wait().unwrap() {
                panic!("etcd exited during startup: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not listen on {client_port} within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        etcd
    }

    fn address(&self, prefix: &str) -> String {
        format!("etcd://127.0.0.1:{}/{prefix}", self.client_port)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        // Child::kill signals this child's PID only.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn etcd_store() {
    let etcd = Etcd::start();
    suite(&etcd.address("floe")).await;

    // Keys live under the store prefix, visible to a store without one.
    let raw = open(&etcd.address("")).await.unwrap();
    let keys: Vec<String> = scan(raw.as_ref(), "")
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        keys,
        ["floe/a/c", "floe/a0", "floe/vol/x", "floe/vol/x/chunk/0"]
    );

    // Stores under different prefixes do not see or delete each other's keys.
    let other = open(&etcd.address("floe2")).await.unwrap();
    assert_eq!(scan(other.as_ref(), "").await, pairs(&[]));
    other
        .apply(vec![put("vol/y", "m"), del_prefix("")])
        .await
        .unwrap();
    assert_eq!(scan(raw.as_ref(), "").await.len(), 4);

    // Scans page through results larger than one etcd request.
    let many: Vec<Op> = (0..2500).map(|i| put(&format!("n/{i:05}"), "v")).collect();
    for batch in many.chunks(100) {
        other.apply(batch.to_vec()).await.unwrap();
    }
    let scanned = scan(other.as_ref(), "n/").await;
    assert_eq!(scanned.len(), 2500);
    assert!(scanned.windows(2).all(|w| w[0].0 < w[1].0));
}

#[tokio::test]
async fn etcd_unreachable_fails_fast() {
    let port = free_port(); // nothing listens here once the listener is dropped
    let started = Instant::now();
    let result = open(&format!("etcd://127.0.0.1:{port}/floe")).await;
    let Err(MetaError::Backend(message)) = result else {
        panic!("connecting to a dead port should fail");
    };
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        message.contains(&format!("cannot reach etcd at http://127.0.0.1:{port}")),
        "{message}"
    );
}
