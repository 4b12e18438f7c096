//! Block transactions served by a gateway (`floe gateway --tx-listen`) to clients in
//! other processes: several `floe kv bank --gateway` processes through one gateway
//! keep the bank's invariant, also through kill -9 of the gateway at random moments
//! (every transfer all or nothing, checked against the shared ledger after the
//! volume is reopened); and the bad input of the issue, through the remote client:
//! a transaction larger than the gateway takes, marks outside the block, a commit
//! after the volume's session moved to another gateway (nothing of it applied, as
//! that gateway's NBD export shows), and NBD opens of a volume serving transactions.
//! `FLOE_KV_ROUNDS` sets the kill rounds (default 3), `FLOE_KV_SEED` replays a run.

use crate::cluster::{free_ports, nbdsh, ok, output, Cluster, Spawned, FLOE};
use crate::fencing::signal;
use crate::io_helpers::{text, wait_for_file, wait_until};
use crate::nbd_raw::wait_for_nbd_server;
use crate::transactions::{
    check_bank_via, kill_rounds, ledger_lines, start_with_bank_volume, ACCOUNTS,
    FIRST_TRANSFERS_TIMEOUT,
};
use bytes::Bytes;
use floe_isotope::remote::RemoteVolume;
use floe_isotope::{Blocks, Outcome, Transactions};
use rand::Rng;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Bank client processes through the gateway, and transfers each runs at once.
const PROCESSES: usize = 3;
const CLIENTS: &str = "3";
/// Bounds only a gateway that never serves, however busy the machine.
const START_LIMIT: Duration = Duration::from_secs(60);
/// Bounds only a client that hangs after its gateway died.
const CLIENT_EXIT_LIMIT: Duration = Duration::from_secs(30);
/// Where the data blocks start: the transaction log takes the volume's first 16 MiB.
const DATA_OFFSET: u64 = 16 << 20;

/// `floe gateway --name NAME` serving NBD on `port` and transactions on `port + 1`
/// (with the demo's gateway certificate when the cluster runs TLS), logging to
/// DIR/NAME.log; the transaction address.
fn gateway(cluster: &Cluster, dir: &Path, name: &str, port: u16) -> (Spawned, String) {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))
        .unwrap();
    let tx_address = format!("127.0.0.1:{}", port + 1);
    let child = cluster
        .command_as("gateway")
        .args(["gateway", "--name", name])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--tx-listen", &tx_address, "--metrics-listen", "off"])
        .stderr(log)
        .spawn()
        .unwrap();
    wait_for_nbd_server(port, START_LIMIT);
    (Spawned(child), tx_address)
}

fn bank(cluster: &Cluster, gateway: &str, ledger: &Path, transfers: Option<&str>) -> Child {
    let accounts = ACCOUNTS.to_string();
    let mut command = cluster.command_as("admin");
    command
        .args(["kv", "bank", "--volume", "bank", "--gateway", gateway])
        .args(["--accounts", &accounts, "--clients", CLIENTS])
        .args(transfers.iter().flat_map(|t| ["--transfers", t]))
        .arg("--ledger")
        .arg(ledger)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    command.spawn().expect("floe kv bank starts")
}

#[test]
fn bank_clients_through_a_gateway_keep_the_invariant_through_kill_9_of_the_gateway() {
    let (rounds, mut rng) = kill_rounds("remote_transactions");
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let ledger = work.path().join("ledger");
    let cluster = start_with_bank_volume(dir.path());
    let port = free_ports();
    let mut counter = 0;
    for round in 0..rounds {
        // A name of its own: the killed one's stays known to the master a while.
        let name = format!("tx{round}");
        let (gateway_process, address) = gateway(&cluster, work.path(), &name, port);
        let before = ledger_lines(&ledger);
        let mut clients: Vec<Child> = (0..PROCESSES)
            .map(|_| bank(&cluster, &address, &ledger, None))
            .collect();
        wait_for_file(&ledger, FIRST_TRANSFERS_TIMEOUT, |t| {
            t.lines().count() >= before + 10
        });
        assert!(
            ledger_lines(&ledger) >= before + 10,
            "round {round}: no transfers acknowledged"
        );
        std::thread::sleep(Duration::from_millis(rng.gen_range(100..1500)));
        for client in &mut clients {
            assert!(
                client.try_wait().unwrap().is_none(),
                "round {round}: a client died by itself"
            );
        }
        signal(gateway_process.0.id(), libc::SIGKILL);
        drop(gateway_process);
        // Each client fails with its gateway: a commit in flight has no answer.
        for client in clients {
            let pid = client.id();
            wait_until("a bank client to exit", CLIENT_EXIT_LIMIT, || {
                !crate::io_helpers::alive(pid)
            });
            let out = client.wait_with_output().unwrap();
            assert!(!out.status.success(), "round {round}: a client went on");
            let message = String::from_utf8_lossy(&out.stderr);
            assert!(
                message.contains("127.0.0.1"),
                "names the gateway: {message}"
            );
        }
        eprintln!(
            "remote_transactions: round {round}: killed the gateway, {} transfers acknowledged",
            ledger_lines(&ledger) - before
        );
        // Read here once the gateway's lease ran out: opening replays the log.
        let now = check_bank_via(&cluster, &[], &ledger, &format!("round {round}"));
        assert!(now > counter, "round {round}: the counter did not move");
        counter = now;
    }
    // Uninterrupted: every transfer committed is acknowledged, and no more.
    let (_gateway, address) = gateway(&cluster, work.path(), "tx-last", port);
    let before = ledger_lines(&ledger);
    let clients: Vec<Child> = (0..PROCESSES)
        .map(|_| bank(&cluster, &address, &ledger, Some("20")))
        .collect();
    for client in clients {
        let out = client.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
    }
    let via = ["--gateway", address.as_str()];
    let now = check_bank_via(&cluster, &via, &ledger, "uninterrupted");
    assert_eq!(
        now - counter,
        (ledger_lines(&ledger) - before) as u64,
        "transfers committed but not acknowledged, or the reverse"
    );
}

/// The remote client against `address`, on a runtime of the test's own.
fn remote<T>(address: &str, volume: &str, run: impl AsyncFnOnce(RemoteVolume) -> T) -> T {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let volume = RemoteVolume::connect(address, volume).await.unwrap();
        run(volume).await
    })
}

fn block(byte: u8) -> Bytes {
    Bytes::from(vec![byte; 4096])
}

/// `message` of the error a commit got, which must hold `expected`.
fn refused(outcome: Result<Outcome, floe_isotope::TxError>, expected: &str) {
    let message = match outcome {
        Ok(outcome) => panic!("expected {expected:?}, the commit answered {outcome:?}"),
        Err(e) => e.to_string(),
    };
    assert!(
        message.contains(expected),
        "expected {expected:?}: {message}"
    );
    eprintln!("remote_transactions: refused: {message}");
}

/// Whether data block `block` of the export reads as `byte` throughout.
fn block_reads(uri: &str, block: u64, byte: u8) -> bool {
    let offset = DATA_OFFSET + 4096 * block;
    let check = format!(
        "import sys; sys.exit(0 if h.pread(4096, {offset}) == bytes([{byte}]) * 4096 else 3)"
    );
    let out = output(nbdsh().args(["-u", uri, "-c", &check]));
    match out.status.code() {
        Some(0) => true,
        Some(3) => false,
        _ => panic!("nbdsh {uri}: {}", text(&out)),
    }
}

#[test]
fn gateway_transactions_refuse_bad_input_a_moved_lease_and_nbd_clients() {
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    cluster.floe(&["volume", "create", "bad", "--size", "64M"]);
    let port = free_ports();
    let (_a, at_a) = gateway(&cluster, work.path(), "a", port);
    let (_b, _) = gateway(&cluster, work.path(), "b", port + 2);
    let (nbd_a, nbd_b) = (
        format!("nbd://127.0.0.1:{port}/bad"),
        format!("nbd://127.0.0.1:{}/bad", port + 2),
    );
    remote(&at_a, "bad", async |volume| {
        // Larger than the gateway takes: refused at the commit, nothing changed.
        let mut tx = volume.begin_with(None).await.unwrap();
        for b in 0..257 {
            tx.write(10 + b, block(1)).await.unwrap();
        }
        refused(tx.commit().await, "transaction too large");
        let mut tx = volume.begin_with(None).await.unwrap();
        tx.write(3, Bytes::from(vec![1u8; 100])).await.unwrap();
        refused(tx.commit().await, "whole 4096-byte blocks");
        for (offset, length) in [(4090, 16), (0, 0), (4096, 1)] {
            let mut tx = volume.begin_with(None).await.unwrap();
            tx.read(1).await.unwrap();
            tx.mark_accessed(1, offset, length).await.unwrap();
            refused(tx.commit().await, "outside the block");
        }
        let mut tx = volume.begin_with(None).await.unwrap();
        let past = tx.read(volume.data_blocks()).await.unwrap_err().to_string();
        assert!(past.contains("past the volume's"), "{past}");
        // The connection serves on: a transaction commits.
        let mut tx = volume.begin_with(None).await.unwrap();
        tx.write(2, block(0xa2)).await.unwrap();
        assert!(matches!(tx.commit().await, Ok(Outcome::Committed { .. })));
        // Released by a client that then goes away, a transaction is taken over by
        // another, writes included, and committed there; its handle serves once.
        let other = RemoteVolume::connect(&at_a, "bad").await.unwrap();
        let mut tx = other.begin_with(None).await.unwrap();
        tx.write(5, block(0xc5)).await.unwrap();
        let handle = tx.release().await.unwrap();
        drop(other);
        let mut tx = volume.take_over(handle).await.unwrap();
        assert_eq!(tx.read(5).await.unwrap(), block(0xc5));
        assert!(matches!(tx.commit().await, Ok(Outcome::Committed { .. })));
        let again = volume
            .take_over(handle)
            .await
            .err()
            .expect("taken over twice");
        assert!(
            again.to_string().contains("no released transaction"),
            "{again}"
        );
        // An NBD client may not open the volume while it serves transactions (qemu
        // prints the gateway's reason).
        let _open = volume.begin_with(None).await.unwrap();
        let out = output(Command::new("qemu-img").args(["info", &nbd_a]));
        assert!(
            !out.status.success() && text(&out).contains("serves transactions"),
            "NBD opened a transaction volume: {}",
            text(&out)
        );
        eprintln!(
            "remote_transactions: NBD refused: {}",
            text(&out).trim_end()
        );
    });
    // Nothing the refused transactions wrote reached the volume: NBD at gateway a,
    // once its transactions ended and the volume closed (idle).
    wait_until("the idle volume to close at gateway a", START_LIMIT, || {
        output(Command::new("nbdinfo").arg(&nbd_a)).status.success()
    });
    assert!(block_reads(&nbd_a, 2, 0xa2));
    assert!(
        block_reads(&nbd_a, 5, 0xc5),
        "the taken-over commit is missing"
    );
    for b in [3, 10, 100, 266] {
        assert!(block_reads(&nbd_a, b, 0), "block {b} was written");
    }
    // An NBD client holding the volume: no transactions meanwhile.
    let holder = crate::fencing::StalledClient::start(&nbd_a);
    let out = output(cluster.command_as("admin").args([
        "kv",
        "get",
        "--volume",
        "bad",
        "--gateway",
        &at_a,
        "k",
    ]));
    assert!(
        !out.status.success() && text(&out).contains("open over NBD"),
        "{}",
        text(&out)
    );
    drop(holder);

    // A commit after the volume's session moved to gateway b: refused, not applied.
    wait_until(
        "gateway a to serve transactions on bad",
        START_LIMIT,
        || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(RemoteVolume::connect(&at_a, "bad"))
                .is_ok()
        },
    );
    remote(&at_a, "bad", async |volume| {
        let mut tx = volume.begin_with(None).await.unwrap();
        tx.read(4).await.unwrap();
        tx.write(4, block(0xb4)).await.unwrap();
        ok(cluster
            .command_as("admin")
            .args(["volume", "move-session", "bad", "--to", "b"]));
        refused(tx.commit().await, "moved to gateway b");
        let again = volume.begin_with(None).await;
        assert!(again.is_err(), "gateway a still serves the moved volume");
    });
    assert!(block_reads(&nbd_b, 2, 0xa2));
    assert!(block_reads(&nbd_b, 4, 0), "the refused commit was applied");
}

#[test]
fn gateway_transactions_take_the_clusters_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start_tls(dir.path());
    cluster.floe(&["volume", "create", "kv", "--size", "64M"]);
    let (_gateway, address) = gateway(&cluster, work.path(), "tls", free_ports());
    let put = [
        "kv",
        "put",
        "--volume",
        "kv",
        "--gateway",
        &address,
        "k",
        "v",
    ];
    ok(cluster.command_as("admin").args(put));
    let get = ["kv", "get", "--volume", "kv", "--gateway", &address, "k"];
    assert_eq!(ok(cluster.command_as("admin").args(get)), "v\n");
    // A process of the cluster that is no client, and one without a certificate.
    let out = output(cluster.command_as("chunkserver-0").args(get));
    assert!(
        !out.status.success() && text(&out).contains("runs no transactions"),
        "{}",
        text(&out)
    );
    let out = output(
        Command::new(FLOE)
            .args(["--master", &cluster.info.master])
            .args(get),
    );
    assert!(
        !out.status.success() && text(&out).contains("--ca and --cert"),
        "{}",
        text(&out)
    );
    eprintln!(
        "remote_transactions: without a certificate: {}",
        text(&out).trim_end()
    );
}
