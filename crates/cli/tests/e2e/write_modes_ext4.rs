//! ext4 on a flush-epoch or a log-commit volume (nbdfuse, loop mount, as in ext4.rs)
//! stays consistent when its gateway is killed in the middle of a copy workload.
//!
//! Each round copies a tree of files again and again (`cp -a` of one top-level entry
//! at a time, each followed by `sync -f`; the copies before the last removed), kills
//! the gateway (kill -9) at a random moment once a copy is done, tears the dead mount
//! down and starts a new gateway. Through it the kernel mounts the file system, which
//! replays the journal as after a crash; the file system is unmounted and `e2fsck -f
//! -n` must find nothing to repair. That is the check of crash consistency: ext4
//! orders its writes with FLUSH (a commit record after the blocks it covers, in-place
//! metadata after the commit), and the volume keeps a prefix of the epochs between
//! FLUSHes, so the replayed journal must give a consistent file system. (`e2fsck -f -y`
//! would repair what it finds and prove nothing; `e2fsck -n` before a replay reports
//! the unreplayed journal's work as damage.) Every file the recovered copies hold must
//! also hold its source's first bytes, nothing else: the file system is mounted
//! data=ordered with `dioread_lock`, so a new block is allocated in the transaction
//! whose commit waits for its data. (With the default `dioread_nolock` a new block is
//! an unwritten extent, converted once its data is written: a crash may leave a file
//! its full size with unwritten extents, reading zeroes, as ext4 allows; seen here.)
//! Nothing is checked for presence: a FLUSH of a flush-epoch or log-commit volume is
//! an ordering point, not a durability point.
//!
//! The journal is the smallest (4 MiB), so checkpoints (in-place metadata) come every
//! few copies, and the volume is rate-limited below the copy's pace, so the kill finds
//! many epochs unretired (up to the layer's 64 MiB). With the epoch rule taken out of
//! the layer, e2fsck found damage in the first or third round of each of 3 runs.
//! `FLOE_EPOCH_EXT4_ROUNDS` sets the rounds (default 3), `FLOE_EPOCH_SEED` replays the
//! kill moments.

use crate::cluster::{free_ports, ok, output, Cluster};
use crate::ext4::{LoopMount, NbdFuse};
use crate::write_modes::Gateway;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The demo volume's size.
const SIZE: u64 = 1 << 30;
/// Failure bound of a copy (the first one fills the layer, the rest go at the limit).
const COPY_LIMIT: Duration = Duration::from_secs(300);
/// data=ordered (the default) without unwritten extents for new blocks: a block is
/// then allocated in the transaction whose commit waits for its data.
const MOUNT_OPTIONS: &str = "loop,data=ordered,dioread_lock";
/// The smallest journal (1024 blocks): checkpoints, the in-place metadata writes that
/// follow a commit, come every few copies. In a large journal the metadata of the
/// whole run stays in the journal, which the replay restores in any case.
const JOURNAL: &str = "size=4";
/// Below the copy's pace: the layer fills, and the replicas lag by many epochs.
const BANDWIDTH: &str = "8M";

/// Copies `$1` to `$2/copy-N` from N = `$4` on, an entry of `$1` at a time, each
/// followed by a syncfs (its data, a journal commit, a FLUSH: many epochs a copy);
/// removes the copies before the last; writes the number of copies done to `$3`.
const WORKLOAD: &str = r#"set -e
src=$1 mnt=$2 progress=$3 i=$4
while true; do
    mkdir "$mnt/copy-$i"
    for entry in "$src"/*; do
        cp -a "$entry" "$mnt/copy-$i/"
        sync -f "$mnt"
    done
    for old in "$mnt"/copy-*; do
        if [ "${old##*-}" -lt $((i - 1)) ]; then rm -rf "$old"; fi
    done
    i=$((i + 1))
    echo $i > "$progress.new"
    mv "$progress.new" "$progress"
done"#;

/// 200 files in nested directories, mostly small, some of up to 512 KiB: about 8 MiB.
fn generate_tree(root: &Path, rng: &mut StdRng) -> u64 {
    let mut total = 0;
    for i in 0..200 {
        let mut dir = root.to_path_buf();
        for level in 0..rng.gen_range(0..4) {
            dir.push(format!("d{level}-{}", rng.gen_range(0..3)));
        }
        std::fs::create_dir_all(&dir).unwrap();
        let size = match rng.gen_range(0..20) {
            0 => 0,
            1 | 2 => rng.gen_range(64 << 10..512 << 10),
            _ => rng.gen_range(1..32 << 10),
        };
        let mut data = vec![0u8; size];
        rng.fill_bytes(&mut data);
        std::fs::write(dir.join(format!("f{i}.bin")), &data).unwrap();
        total += size as u64;
    }
    total
}

/// The copy workload, in its own process group so that it is killed whole.
struct Workload {
    child: Option<Child>,
}

impl Workload {
    fn start(source: &Path, mount: &Path, progress: &Path, first: u64) -> Workload {
        let child = Command::new("bash")
            .args(["-c", WORKLOAD, "workload"])
            .arg(source)
            .arg(mount)
            .arg(progress)
            .arg(first.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("bash starts");
        Workload { child: Some(child) }
    }

    /// Panics, with its output, if the workload ended (it runs until stopped).
    fn assert_running(&mut self, when: &str) {
        let child = self.child.as_mut().expect("running");
        if let Ok(Some(_)) = child.try_wait() {
            let out = self.child.take().unwrap().wait_with_output().unwrap();
            panic!(
                "the copy workload ended {when}: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// Kills the whole process group; how it had ended, for the log.
    fn kill(mut self) -> String {
        let child = self.child.take().expect("running");
        // SAFETY: kill(2) on our own child's process group.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        match err.lines().last() {
            Some(last) => format!("{}, last: {last}", out.status),
            None => out.status.to_string(),
        }
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: as above.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
        }
    }
}

fn read_progress(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// What the recovered copies hold.
#[derive(Debug, Default)]
struct Recovered {
    copies: usize,
    whole: usize,
    /// Shorter than their source (written back in part, or not at all).
    short: usize,
    bad: Vec<String>,
}

/// Checks every file of every `copy-N` under `mount` against its source: it must hold
/// the source's first bytes, up to its length. A directory or file that cannot be read
/// is bad too.
fn check_copies(mount: &Path, source: &Path) -> Recovered {
    let mut out = Recovered::default();
    let top = match std::fs::read_dir(mount) {
        Ok(top) => top,
        Err(e) => {
            out.bad.push(format!("/: {e}"));
            return out;
        }
    };
    for entry in top {
        let name = match entry {
            Ok(entry) => entry.file_name().to_string_lossy().into_owned(),
            Err(e) => {
                out.bad.push(format!("/: {e}"));
                continue;
            }
        };
        if name == "lost+found" {
            continue;
        }
        if !name.starts_with("copy-") {
            out.bad.push(format!("unexpected {name}"));
            continue;
        }
        out.copies += 1;
        let mut list = Vec::new();
        walk(&mount.join(&name), Path::new(""), &mut list, &mut out.bad);
        for relative in list {
            let path = Path::new(&name).join(&relative);
            let got = match std::fs::read(mount.join(&path)) {
                Ok(got) => got,
                Err(e) => {
                    out.bad.push(format!("{}: {e}", path.display()));
                    continue;
                }
            };
            let Ok(want) = std::fs::read(source.join(&relative)) else {
                out.bad.push(format!("{}: no such source", path.display()));
                continue;
            };
            if got.len() > want.len() || got[..] != want[..got.len()] {
                out.bad.push(format!(
                    "{}: {} bytes, not the source's first ones ({} bytes): {}",
                    path.display(),
                    got.len(),
                    want.len(),
                    differences(&got, &want)
                ));
            } else if got.len() == want.len() {
                out.whole += 1;
            } else {
                out.short += 1;
            }
        }
    }
    out
}

/// The regular files under `root`/`relative` into `out`; what cannot be read, or is
/// neither a file nor a directory, into `bad`.
fn walk(root: &Path, relative: &Path, out: &mut Vec<PathBuf>, bad: &mut Vec<String>) {
    let entries = match std::fs::read_dir(root.join(relative)) {
        Ok(entries) => entries,
        Err(e) => {
            bad.push(format!("{}/: {e}", root.join(relative).display()));
            return;
        }
    };
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => {
                bad.push(format!("{}/: {e}", root.join(relative).display()));
                continue;
            }
        };
        let path = relative.join(entry.file_name());
        match entry.file_type() {
            Ok(kind) if kind.is_dir() => walk(root, &path, out, bad),
            Ok(kind) if kind.is_file() => out.push(path),
            other => bad.push(format!("{}: {other:?}", root.join(&path).display())),
        }
    }
}

/// Where `got` differs from `want`, by 4 KiB block: "zeroes" or "other data".
fn differences(got: &[u8], want: &[u8]) -> String {
    let mut out = Vec::new();
    for (i, block) in got.chunks(4096).enumerate() {
        let at = i * 4096;
        let expected = &want[at.min(want.len())..(at + block.len()).min(want.len())];
        if block != expected {
            let what = if block.iter().all(|&b| b == 0) {
                "zeroes"
            } else {
                "other data"
            };
            out.push(format!("block {i} {what}"));
        }
    }
    out.join(", ")
}

/// The highest N of the `copy-N` directories under `mount`.
fn last_copy(mount: &Path) -> Option<u64> {
    std::fs::read_dir(mount)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_prefix("copy-")?
                .parse()
                .ok()
        })
        .max()
}

#[test]
fn ext4_on_a_flush_epoch_volume_is_consistent_after_its_gateway_is_killed_mid_copy() {
    ext4_is_consistent_after_its_gateway_is_killed_mid_copy("flush-epoch");
}

/// The same on a log-commit volume: its writes land out of order, and recovery keeps
/// a prefix of them.
#[test]
fn ext4_on_a_log_commit_volume_is_consistent_after_its_gateway_is_killed_mid_copy() {
    ext4_is_consistent_after_its_gateway_is_killed_mid_copy("log-commit");
}

fn ext4_is_consistent_after_its_gateway_is_killed_mid_copy(write_mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let mount_dir = tempfile::tempdir().unwrap();
    let args = vec!["--write-mode".to_string(), write_mode.to_string()];
    let cluster = Cluster::start_with(dir.path(), free_ports(), None, args);
    let info = cluster.floe(&["volume", "info", "demo"]);
    assert!(
        info.contains(&format!("write mode:    {write_mode}")),
        "{info}"
    );

    let rounds: u64 = std::env::var("FLOE_EPOCH_EXT4_ROUNDS").map_or(3, |r| r.parse().unwrap());
    let seed: u64 =
        std::env::var("FLOE_EPOCH_SEED").map_or_else(|_| rand::random(), |s| s.parse().unwrap());
    eprintln!("ext4 on {write_mode}: seed {seed} (FLOE_EPOCH_SEED replays), {rounds} rounds");
    let mut rng = StdRng::seed_from_u64(seed);
    let source = work.path().join("source");
    let bytes = generate_tree(&source, &mut StdRng::seed_from_u64(0xe9_0c4));
    let entries = std::fs::read_dir(&source).unwrap().count();
    let progress = work.path().join("progress");
    let started = Instant::now();

    let fuse_mount = |round: u64| {
        let path = work.path().join(format!("fuse-{round}"));
        std::fs::create_dir(&path).unwrap();
        path
    };
    let mut fuse = NbdFuse::start(&fuse_mount(0), cluster.uri(), SIZE);
    // Inode tables and journal written now, not by the kernel's lazy init later.
    ok(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-J", JOURNAL])
        .args(["-E", "lazy_itable_init=0,lazy_journal_init=0"])
        .arg(fuse.file()));
    let mut victim = cluster.info.gateway_pid;
    let mut gateway: Option<Gateway> = None;
    let mut next_copy = 0;
    for round in 0..rounds {
        cluster.floe(&["volume", "set-qos", "demo", "--bandwidth", BANDWIDTH]);
        let mount = LoopMount::mount_with(&fuse.file(), mount_dir.path(), MOUNT_OPTIONS);
        let _ = std::fs::remove_file(&progress);
        let mut workload = Workload::start(&source, mount_dir.path(), &progress, next_copy);
        let deadline = Instant::now() + COPY_LIMIT;
        while read_progress(&progress).is_none() {
            workload.assert_running("before its first copy was done");
            assert!(Instant::now() < deadline, "no copy done in {COPY_LIMIT:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..4_000)));
        workload.assert_running("before the kill");
        let done = read_progress(&progress).unwrap() - next_copy;
        // SAFETY: kill(2) on a gateway this test (or its demo) started.
        assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
        // The dead file system goes: writes to it fail, it is unmounted (lazily if
        // busy), nbdfuse stops. Nothing of it can reach the new gateway.
        let ended = workload.kill();
        drop(mount);
        drop(fuse);
        drop(gateway.take());

        // A new gateway, unthrottled, reads the volume as the crash left it.
        cluster.floe(&["volume", "set-qos", "demo", "--bandwidth", "0"]);
        let next = Gateway::start(
            &cluster.info.master,
            &dir.path().join(format!("gateway-{round}.log")),
        );
        fuse = NbdFuse::start(&fuse_mount(round + 1), &next.uri, SIZE);
        let header = ok(Command::new("dumpe2fs").arg("-h").arg(fuse.file()));
        let replay = header.contains("needs_recovery");
        // Mounting replays the journal; the copies are checked; unmounted, with the
        // file fsynced (an NBD flush), the file system must check clean.
        let mut mount = LoopMount::mount(&fuse.file(), mount_dir.path());
        let recovered = check_copies(mount_dir.path(), &source);
        next_copy = last_copy(mount_dir.path()).map_or(0, |n| n + 1);
        mount.unmount();
        ok(Command::new("sync").arg(fuse.file()));
        let fsck = output(Command::new("e2fsck").args(["-f", "-n"]).arg(fuse.file()));
        assert!(
            fsck.status.success() && recovered.bad.is_empty(),
            "round {round}: after the journal replay, e2fsck {}:\n{}{}\nfiles of the recovered copies that differ from their sources or cannot be read:\n{}",
            fsck.status,
            String::from_utf8_lossy(&fsck.stdout),
            String::from_utf8_lossy(&fsck.stderr),
            recovered.bad.join("\n")
        );
        eprintln!(
            "round {round}: gateway killed after {done} copies of {:.1} MiB in {entries} syncs each (workload then: {ended}); \
             journal {}; {} copies recovered, {} files whole, {} short; e2fsck clean ({:.0?} so far)",
            bytes as f64 / (1 << 20) as f64,
            if replay { "replayed" } else { "clean, nothing to replay" },
            recovered.copies,
            recovered.whole,
            recovered.short,
            started.elapsed()
        );
        victim = next.child.id();
        gateway = Some(next);
    }
}
