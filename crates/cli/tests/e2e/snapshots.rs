//! Snapshots: write A, snapshot, write B: the snapshot export `demo@one` reads A
//! (qemu-img compare) while fio writes B over it, through kill -9 of a chunk server
//! and the repair after it; a snapshot taken while the gateway writes is taken once
//! the gateway switched epochs, and reads the same twice; bad names, duplicate and
//! unknown snapshots and writes to a snapshot are refused with clear errors; a
//! snapshot reads the same across a kill -9 of the writing gateway. An
//! incremental backup (scripts/copy-changed.py over floe:changed-since) copies only
//! what changed; a rollback is refused while the volume is open, then brings the
//! snapshot back and leaves newer snapshots as they were. A clone reads its parent
//! snapshot, diverges, and once flattened reads the same without it. A log-commit
//! volume's snapshot reads its log as it was; a rollback brings it back.

use crate::cluster::{free_ports, nbdsh, ok, output, random_file, Cluster, TestDir};
use crate::expand::{await_new_servers, expand_command, moves, Extra, MOVE_TIMEOUT};
use crate::fio_job::{assert_clean, FioJob, Verify};
use crate::io_helpers::{floe_output, kill9, text, wait_until};
use crate::write_modes::Gateway;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const A_BYTES: usize = 64 << 20;
const VOLUME_BYTES: u64 = 1 << 30;

/// A: random bytes over the volume's first 64 MiB (chunks 0-3 of the demo's layout),
/// written through `uri`; the file of A, and an image of the whole volume holding A.
fn write_a(uri: &str, work: &Path) -> (PathBuf, PathBuf) {
    let a = work.join("a.raw");
    random_file(&a, A_BYTES);
    ok(Command::new("nbdcopy").arg(&a).arg(uri));
    let expected = work.join("expected-a.raw");
    std::fs::copy(&a, &expected).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&expected)
        .unwrap()
        .set_len(VOLUME_BYTES)
        .unwrap();
    (a, expected)
}

/// `qemu-img compare` of an image file with an export; true when identical.
fn same(image: &Path, uri: &str) -> bool {
    let out = output(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(image)
            .arg(uri),
    );
    match out.status.code() {
        Some(0) => true,
        Some(1) => false,
        _ => panic!("qemu-img compare {uri} failed: {}", text(&out)),
    }
}

/// Copies an export to `to` with nbdcopy; its first `A_BYTES` (where the writes go).
fn copy(uri: &str, to: &Path) -> Vec<u8> {
    ok(Command::new("nbdcopy").arg(uri).arg(to));
    let mut head = std::fs::read(to).unwrap();
    head.truncate(A_BYTES);
    head
}

#[test]
fn a_snapshot_reads_the_volume_as_it_was_while_writes_kills_and_repairs_go_on() {
    let dir = TestDir::new();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    let snapshot = |name: &str| format!("{uri}@{name}");

    let (a, expected) = write_a(&uri, work.path());

    // No gateway holds the lease between connections: taken at once.
    let created = cluster.floe(&["snapshot", "create", "demo@one"]);
    assert!(created.contains("taken"), "{created}");
    assert!(
        same(&expected, &snapshot("one")),
        "snapshot one differs from A at rest"
    );

    // B: fio's random writes over A's range, verified, while a second snapshot is
    // taken, the first one read, and a chunk server killed.
    let fio = FioJob::random_4k(&uri, work.path(), 11)
        .size("64M")
        .runtime(25)
        .verify(Verify::WriteAndRead)
        .spawn();
    std::thread::sleep(Duration::from_secs(3));
    let started = Instant::now();
    let created = cluster.floe(&["snapshot", "create", "demo@two"]);
    assert!(created.contains("taken"), "{created}");
    eprintln!(
        "snapshot taken under writes in {:?} (CLI start included)",
        started.elapsed()
    );
    assert!(
        same(&expected, &snapshot("one")),
        "snapshot one differs from A while B is written"
    );
    kill9(cluster.info.chunkserver_pids[1]);
    let two_first = copy(&snapshot("two"), &work.path().join("two-1.raw"));
    assert_clean(&fio.wait_with_output().unwrap(), "fio writing B");
    cluster.wait_for_redundancy(Duration::from_secs(240));

    assert!(
        same(&expected, &snapshot("one")),
        "snapshot one differs from A after the kill and repair"
    );
    assert!(!same(&expected, &uri), "the volume should hold B, not A");
    let two_again = copy(&snapshot("two"), &work.path().join("two-2.raw"));
    assert!(
        two_first == two_again,
        "snapshot two changed between two reads"
    );
    assert!(
        two_first != std::fs::read(&a).unwrap(),
        "snapshot two, taken 3 s into B, holds none of B"
    );
    let list = cluster.floe(&["snapshot", "list", "demo"]);
    assert!(
        list.contains("one") && list.contains("two") && list.contains("ready"),
        "{list}"
    );
    // Deltas allocated while the server was down may still be recovering: scrub
    // skips (and fails on) degraded chunks.
    cluster.wait_for_redundancy(Duration::from_secs(240));
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(!scrub.contains("LOST"), "{scrub}");

    // Bad input: each refused in one line, the cluster serving on.
    for (args, expect) in [
        (&["snapshot", "create", "demo@one"][..], "already exists"),
        (
            &["snapshot", "create", "demo@a/b"][..],
            "must be 1-128 characters",
        ),
        (&["snapshot", "create", "nope@x"][..], "nope"),
        (&["snapshot", "create", "demo"][..], "VOLUME@SNAPSHOT"),
        (&["snapshot", "delete", "demo@missing"][..], "no snapshot"),
    ] {
        let out = floe_output(&cluster, args);
        assert!(
            !out.status.success() && text(&out).contains(expect),
            "{args:?}: {}",
            text(&out)
        );
    }
    let write = output(
        Command::new("qemu-io")
            .args(["-f", "raw", "-c", "write 0 4k"])
            .arg(snapshot("one")),
    );
    let said = text(&write);
    assert!(
        said.contains("failed") || !write.status.success(),
        "a write to a snapshot: {said}"
    );
    let missing = output(Command::new("nbdinfo").arg(snapshot("missing")));
    assert!(!missing.status.success(), "{}", text(&missing));

    // Deleting the older snapshot leaves the newer one as it was.
    cluster.floe(&["snapshot", "delete", "demo@one"]);
    let list = cluster.floe(&["snapshot", "list", "demo"]);
    assert!(!list.contains("one ") && list.contains("two"), "{list}");
    let two_after = copy(&snapshot("two"), &work.path().join("two-3.raw"));
    assert!(
        two_first == two_after,
        "snapshot two changed when one was deleted"
    );

    // The writer killed (-9) while it preserves and overwrites: a snapshot read before
    // the kill reads the same after it, from another gateway.
    let fio = FioJob::random_4k(&uri, work.path(), 12)
        .size("64M")
        .runtime(20)
        .spawn();
    std::thread::sleep(Duration::from_secs(2));
    cluster.floe(&["snapshot", "create", "demo@three"]);
    let three_before = copy(&snapshot("three"), &work.path().join("three-1.raw"));
    std::thread::sleep(Duration::from_secs(2));
    kill9(cluster.info.gateway_pid);
    let _ = fio.wait_with_output();
    let gateway = Gateway::start(&cluster.info.master, &work.path().join("gateway.log"));
    let other = |name: &str| format!("{}@{name}", gateway.uri);
    assert!(
        three_before == copy(&other("three"), &work.path().join("three-2.raw")),
        "snapshot three changed across a kill -9 of the writer"
    );
    assert!(
        two_first == copy(&other("two"), &work.path().join("two-4.raw")),
        "snapshot two changed across a kill -9 of the writer"
    );
}

/// Bytes the chunk files of volume 1's delta chunks of `epoch` take on disk, on every
/// demo chunk server (delta chunk `epoch << 40 | index`; checksum files left out).
fn delta_bytes_on_disk(cluster: &Cluster, epoch: u64) -> u64 {
    use std::os::unix::fs::MetadataExt;
    (0..6)
        .filter_map(|n| {
            std::fs::read_dir(cluster.dir.join(format!("cs-{n}/chunks/0000000000000001"))).ok()
        })
        .flatten()
        .map(|entry| entry.unwrap())
        .filter(|entry| {
            let name = entry.file_name().into_string().unwrap();
            u64::from_str_radix(&name, 16).is_ok_and(|index| index >> 40 == epoch)
        })
        .map(|entry| entry.metadata().unwrap().blocks() * 512)
        .sum()
}

/// The epoch of a snapshot, from `floe snapshot create`'s answer.
fn taken_epoch(said: &str) -> u64 {
    let epoch = said
        .split("(epoch ")
        .nth(1)
        .and_then(|rest| rest.split(')').next());
    epoch
        .and_then(|e| e.parse().ok())
        .unwrap_or_else(|| panic!("no epoch in {said:?}"))
}

/// Deleting a snapshot returns at once; the master frees the delta chunks only it
/// read in the background (counted in `floe status`), their files give their space
/// back on every replica, and the snapshot left reads as before.
#[test]
fn deleting_a_snapshot_frees_its_preserved_blocks_in_the_background() {
    let dir = TestDir::new();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    write_a(&uri, work.path());
    let one = taken_epoch(&cluster.floe(&["snapshot", "create", "demo@one"]));
    // B over all of A: every block of chunks 0-3 is preserved into epoch one's deltas.
    let b = work.path().join("b.raw");
    random_file(&b, A_BYTES);
    ok(Command::new("nbdcopy").arg(&b).arg(&uri));
    let two = taken_epoch(&cluster.floe(&["snapshot", "create", "demo@two"]));
    let c = work.path().join("c.raw");
    random_file(&c, A_BYTES / 4);
    ok(Command::new("nbdcopy").arg(&c).arg(&uri));
    let two_before = copy(&format!("{uri}@two"), &work.path().join("two-1.raw"));
    // Hybrid backups reach their chunk files when their journals replay.
    wait_until(
        "epoch one's deltas on disk",
        Duration::from_secs(60),
        || delta_bytes_on_disk(&cluster, one) >= 3 * A_BYTES as u64,
    );
    let list = cluster.floe(&["snapshot", "list", "demo"]);
    assert!(!list.contains("being freed"), "{list}");

    let deleted = cluster.floe(&["snapshot", "delete", "demo@one"]);
    assert!(deleted.contains("freed in the background"), "{deleted}");
    cluster.wait_for_status(
        "snapshot space: nothing to free; 4 delta chunks freed",
        Duration::from_secs(60),
    );
    wait_until(
        "epoch one's deltas freed on disk",
        Duration::from_secs(60),
        || delta_bytes_on_disk(&cluster, one) == 0,
    );
    assert!(
        delta_bytes_on_disk(&cluster, two) > 0,
        "snapshot two's deltas were freed with one's"
    );
    assert!(
        two_before == copy(&format!("{uri}@two"), &work.path().join("two-2.raw")),
        "snapshot two changed when one's space was freed"
    );
}

/// A snapshot taken while the writing gateway is stalled (SIGSTOP) is taken once its
/// lease runs out, and the lease is revoked with it: when the gateway wakes, its
/// writes are refused (a renewal would let it write on in the epoch before the
/// snapshot, without preserving), and the snapshot keeps what was there.
#[test]
fn a_snapshot_taken_while_the_writer_is_stalled_revokes_its_lease() {
    use crate::fencing::{read_byte, signal, StalledClient};
    let dir = TestDir::new();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    let client = StalledClient::start(&uri);

    signal(cluster.info.gateway_pid, libc::SIGSTOP);
    let started = Instant::now();
    let created = cluster.floe(&["snapshot", "create", "demo@stalled"]);
    assert!(created.contains("taken"), "{created}");
    eprintln!(
        "snapshot taken {:?} after the writer stalled",
        started.elapsed()
    );
    signal(cluster.info.gateway_pid, libc::SIGCONT);
    client.assert_writes_refused();
    let snapshot = format!("{uri}@stalled");
    assert!(
        read_byte(&snapshot, 0).contains("aa"),
        "the snapshot lost 0xaa at 0"
    );
    assert!(
        !read_byte(&snapshot, 65536).contains("cc"),
        "a write of the revoked writer reached the snapshot"
    );
    let log = std::fs::read_to_string(dir.path().join("logs").join("gateway.log")).unwrap();
    assert!(
        log.contains("snapshots were taken without its holder"),
        "{log}"
    );
}

const COPY_CHANGED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/copy-changed.py");

/// Delta chunks move with their live chunks: a CRUSH expansion that moves chunks
/// while B is written leaves the snapshot reading A, and scrub clean.
#[test]
fn a_snapshot_reads_the_same_after_an_expansion_moved_its_chunks() {
    let dir = TestDir::new();
    let work = tempfile::tempdir().unwrap();
    let crush = vec!["--placement".to_string(), "crush".to_string()];
    let cluster = Cluster::start_with(dir.path(), free_ports(), None, crush);
    let uri = cluster.uri().to_string();
    let (_, expected) = write_a(&uri, work.path());
    cluster.floe(&["snapshot", "create", "demo@before"]);

    let _servers = Extra::new_servers(&cluster, dir.path());
    await_new_servers(&cluster);
    let fio = FioJob::random_4k(&uri, work.path(), 13)
        .size("64M")
        .runtime(20)
        .verify(Verify::WriteAndRead)
        .spawn();
    std::thread::sleep(Duration::from_secs(3));
    expand_command(&cluster);
    cluster.wait_for_status("every chunk is where the map places it", MOVE_TIMEOUT);
    assert_clean(
        &fio.wait_with_output().unwrap(),
        "fio writing B during the expansion",
    );
    cluster.wait_for_status("every chunk is where the map places it", MOVE_TIMEOUT);
    let (moved, bytes) = moves(&cluster);
    assert!(moved > 0, "the expansion moved no chunk");
    assert!(
        same(&expected, &format!("{uri}@before")),
        "the snapshot differs from A after {moved} chunks moved"
    );
    assert!(!same(&expected, &uri), "the volume should hold B, not A");
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains(" 0 differences"), "{scrub}");
    eprintln!(
        "snapshot read A after {moved} chunks ({:.0} MiB) moved under writes; scrub clean",
        bytes / 1048576.0
    );
}

#[test]
fn an_incremental_backup_copies_only_what_changed_and_a_rollback_brings_the_snapshot_back() {
    let dir = TestDir::new();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    let (_, expected) = write_a(&uri, work.path());
    cluster.floe(&["snapshot", "create", "demo@monday"]);
    let backup = work.path().join("backup.raw");
    ok(Command::new("nbdcopy")
        .arg(format!("{uri}@monday"))
        .arg(&backup));

    // 2048 distinct 4 KiB blocks (fio's random map), over chunks A wrote.
    let written: u64 = 8 << 20;
    let fio = FioJob::random_4k(&uri, work.path(), 5).io_size("8M").run();
    assert_clean(&fio, "fio's random writes");
    cluster.floe(&["snapshot", "create", "demo@tuesday"]);

    let tuesday = format!("{uri}@tuesday");
    let copied = ok(Command::new("/usr/bin/python3")
        .arg(COPY_CHANGED)
        .arg(&tuesday)
        .arg("floe:changed-since:monday")
        .arg(&backup));
    let copied: u64 = copied.trim().parse().unwrap();
    assert!(
        same(&backup, &tuesday),
        "the incremental backup differs from tuesday"
    );
    eprintln!("incremental backup: {copied} bytes copied for {written} written");
    assert!(
        copied >= written && copied <= written + written / 10,
        "{copied} bytes copied for {written} written"
    );
    let diff = cluster.floe(&["volume", "diff", "demo@monday", "demo@tuesday", "--json"]);
    let diff: serde_json::Value = serde_json::from_str(&diff).unwrap();
    assert_eq!(diff["changed_bytes"].as_u64(), Some(copied), "{diff}");
    let list = cluster.floe(&["snapshot", "list", "demo"]);
    let monday = list
        .lines()
        .find(|l| l.starts_with("monday"))
        .unwrap_or_default();
    assert!(
        monday.contains("8.0 MiB"),
        "monday preserved the 8 MiB overwritten:\n{list}"
    );
    // Since monday, to the volume now: the same blocks, nothing written since.
    let now = cluster.floe(&["volume", "diff", "demo@monday", "--json"]);
    let now: serde_json::Value = serde_json::from_str(&now).unwrap();
    assert_eq!(now["changed_bytes"].as_u64(), Some(copied), "{now}");

    // Rollback: refused while a client has the volume open, then back to A.
    let mut holder = hold_open(&uri);
    let refused = floe_output(&cluster, &["volume", "rollback", "demo@monday"]);
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(
        !refused.status.success() && text(&refused).contains("in use"),
        "{}",
        text(&refused)
    );
    let rolled = cluster.floe(&["volume", "rollback", "demo@monday"]);
    assert!(rolled.contains("rolled demo back"), "{rolled}");
    assert!(
        same(&expected, &uri),
        "the volume differs from monday after the rollback"
    );
    assert!(same(&backup, &tuesday), "tuesday changed with the rollback");
}

/// A log-commit volume's chunks hold a log, which its snapshot export recovers as
/// after a crash at that moment: every write a completed FUA write covers, a prefix
/// of the rest. Write A, end it with a FUA write, snapshot, write B over part of A
/// through a kill -9 of a chunk server and its repair: the snapshot reads A, the
/// volume does not; what changed is refused (not known per block); a rollback
/// compares every piece and brings A back; a clone reads A, then diverges.
#[test]
fn a_log_commit_volume_has_snapshots_that_read_its_log_as_it_was() {
    let dir = TestDir::new();
    let work = tempfile::tempdir().unwrap();
    let args = vec!["--write-mode".to_string(), "log-commit".to_string()];
    let cluster = Cluster::start_with(dir.path(), free_ports(), None, args);
    let uri = cluster.uri().to_string();
    let (a, expected) = write_a(&uri, work.path());
    // Its last block again, FUA: answered once every earlier write is durable.
    let last = A_BYTES - 4096;
    let script = format!(
        "h.pwrite(open({:?}, 'rb').read()[{last}:], {last}, nbd.CMD_FLAG_FUA)",
        a.display().to_string()
    );
    ok(nbdsh().args(["-u", &uri, "-c", &script]));
    cluster.floe(&["snapshot", "create", "demo@one"]);
    // B over A, through a kill -9 of a chunk server and the repair after it.
    let fio = FioJob::random_4k(&uri, work.path(), 5)
        .size("64M")
        .runtime(10)
        .spawn();
    std::thread::sleep(Duration::from_secs(3));
    kill9(cluster.info.chunkserver_pids[1]);
    assert_clean(&fio.wait_with_output().unwrap(), "fio's random writes");
    cluster.wait_for_redundancy(Duration::from_secs(240));
    let one = format!("{uri}@one");
    assert!(same(&expected, &one), "the snapshot differs from A");
    assert!(
        !same(&expected, &uri),
        "fio's writes did not change the volume"
    );
    let refused = floe_output(&cluster, &["volume", "diff", "demo@one"]);
    assert!(
        !refused.status.success() && text(&refused).contains("not known per block"),
        "{}",
        text(&refused)
    );
    let rolled = cluster.floe(&["volume", "rollback", "demo@one"]);
    assert!(rolled.contains("rolled demo back"), "{rolled}");
    assert!(
        same(&expected, &uri),
        "the volume differs from the snapshot after the rollback"
    );
    assert!(
        same(&expected, &one),
        "the snapshot changed with the rollback"
    );

    // A clone of it is a log-commit volume whose log starts as the snapshot's.
    cluster.floe(&["volume", "clone", "demo@one", "vm2"]);
    let vm2 = uri.replace("/demo", "/vm2");
    assert!(same(&expected, &vm2), "the clone does not read as A");
    let fio = FioJob::random_4k(&vm2, work.path(), 3)
        .size("64M")
        .io_size("4M")
        .verify(Verify::WriteAndRead)
        .run();
    assert_clean(&fio, "fio writing the clone");
    assert!(!same(&expected, &vm2), "the clone did not diverge");
    assert!(
        same(&expected, &one),
        "the clone's writes changed its parent snapshot"
    );
}

/// A client holding export `uri` open (kill it to close).
fn hold_open(uri: &str) -> std::process::Child {
    const HOLD_OPEN: &str = "import nbd, sys, time
h = nbd.NBD()
h.connect_uri(sys.argv[1])
h.pread(4096, 0)
print('open', flush=True)
time.sleep(120)";
    let mut holder = Command::new("/usr/bin/python3")
        .args(["-c", HOLD_OPEN, uri])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(holder.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "open");
    holder
}

#[test]
fn a_clone_reads_its_parent_snapshot_and_diverges_from_it() {
    let dir = TestDir::new();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    let (a, expected) = write_a(&uri, work.path());
    cluster.floe(&["snapshot", "create", "demo@base"]);
    let made = cluster.floe(&["volume", "clone", "demo@base", "vm2"]);
    assert!(made.contains("clone of demo@base"), "{made}");
    let info = cluster.floe(&["volume", "info", "vm2"]);
    assert!(info.contains("clone of:      demo@base"), "{info}");
    let vm2 = uri.replace("/demo", "/vm2");
    assert!(
        same(&expected, &vm2),
        "the clone does not read as its parent snapshot"
    );

    // The clone diverges: fio's verified random writes (whole blocks), a 512-byte
    // write inside a block the parent holds, and zeroes over a parent's range.
    let fio = FioJob::random_4k(&vm2, work.path(), 3)
        .size("64M")
        .io_size("4M");
    assert_clean(
        &fio.clone().verify(Verify::WriteAndRead).run(),
        "fio on the clone",
    );
    assert_clean(
        &fio.verify(Verify::Read { load_state: false }).run(),
        "fio's writes read back from the clone",
    );
    let block = (60 << 20) as u64;
    crate::io_helpers::qemu_io(
        &vm2,
        &[
            &format!("write -P 0x3c {} 512", block + 1024),
            &format!("write -z {} 1M", 62 << 20),
        ],
    );
    let head = output(
        Command::new("qemu-io")
            .args(["-f", "raw", "-c", &format!("read -v {block} 4096")])
            .arg(&vm2),
    );
    let a_bytes = std::fs::read(&a).unwrap();
    let shown = hexdump_bytes(&text(&head));
    let mut wanted = a_bytes[block as usize..block as usize + 4096].to_vec();
    wanted[1024..1536].fill(0x3c);
    assert_eq!(
        shown, wanted,
        "a partial write in a clone keeps the parent's bytes around it"
    );
    crate::io_helpers::qemu_io(&vm2, &[&format!("read -P 0 {} 1M", 62 << 20)]);

    // The parent and its snapshot stay as they were.
    assert!(same(&expected, &uri), "the parent volume changed");
    assert!(
        same(&expected, &format!("{uri}@base")),
        "the parent snapshot changed"
    );
    for (args, expect) in [
        (
            &["snapshot", "delete", "demo@base"][..],
            "parent of clone vm2",
        ),
        (&["volume", "delete", "demo"][..], "has a clone, vm2"),
        (&["volume", "clone", "demo@nope", "vm3"][..], "no snapshot"),
    ] {
        let out = floe_output(&cluster, args);
        assert!(
            !out.status.success() && text(&out).contains(expect),
            "{args:?}: {}",
            text(&out)
        );
    }

    // Flatten: refused while the clone is open; then the clone reads the same without
    // its parent, and the parent snapshot can go.
    let before = work.path().join("vm2.raw");
    copy(&vm2, &before);
    let mut holder = hold_open(&vm2);
    let refused = floe_output(&cluster, &["volume", "flatten", "vm2"]);
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(
        !refused.status.success() && text(&refused).contains("needs the volume closed"),
        "{}",
        text(&refused)
    );
    let flattened = cluster.floe(&["volume", "flatten", "vm2", "--rate", "0"]);
    assert!(flattened.contains("flattened vm2"), "{flattened}");
    let info = cluster.floe(&["volume", "info", "vm2"]);
    assert!(!info.contains("clone of"), "{info}");
    cluster.floe(&["snapshot", "delete", "demo@base"]);
    assert!(
        same(&before, &vm2),
        "the flattened clone reads differently once its parent snapshot is gone"
    );
    let again = floe_output(&cluster, &["volume", "flatten", "vm2"]);
    assert!(
        !again.status.success() && text(&again).contains("not a clone"),
        "{}",
        text(&again)
    );
    cluster.floe(&["volume", "delete", "vm2"]);
}

/// Writes `byte` over `length` bytes at `at` of image file `image`.
fn fill_image(image: &Path, at: u64, length: usize, byte: u8) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new().write(true).open(image).unwrap();
    file.write_all_at(&vec![byte; length], at).unwrap();
}

/// The same writes through qemu-io to `uri` and into image file `image`.
fn write_both(uri: &str, image: &Path, writes: &[(u64, usize, u8)]) {
    let commands: Vec<String> = writes
        .iter()
        .map(|(at, length, byte)| format!("write -P {byte:#x} {at} {length}"))
        .collect();
    let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
    crate::io_helpers::qemu_io(uri, &commands);
    for (at, length, byte) in writes {
        fill_image(image, *at, *length, *byte);
    }
}

/// A snapshot of a clone keeps what the clone read when it was taken: its own
/// blocks, its parent's where it had not written (blocks it later copies up, chunks
/// it allocates later), through writes and a snapshot taken under fio; a clone of
/// that snapshot reads the same; the snapshot is deleted only once that clone is, and
/// the clone is flattened only once it has no snapshots.
#[test]
fn a_snapshot_of_a_clone_keeps_what_the_clone_read() {
    let dir = TestDir::new();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    let (_, base) = write_a(&uri, work.path());
    cluster.floe(&["snapshot", "create", "demo@base"]);
    cluster.floe(&["volume", "clone", "demo@base", "vm2"]);
    let vm2 = uri.replace("/demo", "/vm2");
    // The clone's own blocks: some over the parent's data, some past it (chunks the
    // parent never allocated).
    let s1 = work.path().join("s1.raw");
    std::fs::copy(&base, &s1).unwrap();
    write_both(&vm2, &s1, &[(0, 1 << 20, 0x11), (300 << 20, 1 << 20, 0x22)]);
    let made = cluster.floe(&["snapshot", "create", "vm2@s1"]);
    assert!(made.contains("taken"), "{made}");

    // After s1: over its own blocks and the parent's at once, over a parent-only
    // block, over its own block past the parent, and in a chunk born after s1.
    let now = work.path().join("now.raw");
    std::fs::copy(&s1, &now).unwrap();
    write_both(
        &vm2,
        &now,
        &[
            (512 << 10, 1 << 20, 0x33),
            (10 << 20, 64 << 10, 0x44),
            (300 << 20, 4096, 0x55),
            (600 << 20, 64 << 10, 0x66),
        ],
    );
    assert!(
        same(&s1, &format!("{vm2}@s1")),
        "vm2@s1 changed with vm2's writes"
    );
    assert!(same(&now, &vm2), "vm2 does not hold its writes");
    assert!(same(&base, &format!("{uri}@base")), "demo@base changed");

    // A clone of the clone's snapshot reads it.
    cluster.floe(&["volume", "clone", "vm2@s1", "vm3"]);
    let vm3 = uri.replace("/demo", "/vm3");
    assert!(
        same(&s1, &vm3),
        "vm3, a clone of vm2@s1, does not read as vm2@s1"
    );
    for (args, expect) in [
        (&["snapshot", "delete", "vm2@s1"][..], "parent of clone vm3"),
        (&["volume", "flatten", "vm2"][..], "has snapshots"),
    ] {
        let out = floe_output(&cluster, args);
        assert!(
            !out.status.success() && text(&out).contains(expect),
            "{args:?}: {}",
            text(&out)
        );
    }

    // A snapshot of the clone under fio's random writes over parent and own blocks.
    let fio = FioJob::random_4k(&vm2, work.path(), 21)
        .size("64M")
        .runtime(8)
        .verify(Verify::WriteAndRead)
        .spawn();
    std::thread::sleep(Duration::from_secs(3));
    let made = cluster.floe(&["snapshot", "create", "vm2@s2"]);
    assert!(made.contains("taken"), "{made}");
    let s2 = copy(&format!("{vm2}@s2"), &work.path().join("s2-1.raw"));
    assert_clean(
        &fio.wait_with_output().unwrap(),
        "fio on vm2 under a snapshot",
    );
    assert!(
        s2 == copy(&format!("{vm2}@s2"), &work.path().join("s2-2.raw")),
        "vm2@s2 changed with the writes after it"
    );
    assert!(same(&s1, &format!("{vm2}@s1")), "vm2@s1 changed under fio");
    assert!(same(&s1, &vm3), "vm3 changed with vm2's writes");

    // Once its clone and snapshots are gone, vm2 flattens and reads the same.
    cluster.floe(&["volume", "delete", "vm3"]);
    cluster.floe(&["snapshot", "delete", "vm2@s1"]);
    cluster.floe(&["snapshot", "delete", "vm2@s2"]);
    let before = work.path().join("vm2.raw");
    copy(&vm2, &before);
    let flattened = cluster.floe(&["volume", "flatten", "vm2", "--rate", "0"]);
    assert!(flattened.contains("flattened vm2"), "{flattened}");
    cluster.floe(&["snapshot", "delete", "demo@base"]);
    assert!(same(&before, &vm2), "vm2 reads differently once flattened");
}

/// The bytes of `qemu-io -c "read -v ..."` output (offset: 16 hex bytes  text).
fn hexdump_bytes(dump: &str) -> Vec<u8> {
    dump.lines()
        .filter_map(|line| line.split_once(": "))
        .flat_map(|(_, rest)| {
            rest.split_whitespace()
                .take(16)
                .filter_map(|h| u8::from_str_radix(h, 16).ok())
                .collect::<Vec<_>>()
        })
        .collect()
}
