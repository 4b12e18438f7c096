//! ext4 on the volume: nbdfuse turns the export into a file, the kernel loop-mounts it.
//! The file system is checked by e2fsck and read back through a fresh nbdfuse, so what
//! comes back was stored by the cluster, not kept in a page cache.

use crate::cluster::{ok, output, Cluster};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `nbdfuse MOUNTPOINT/disk URI`; unmounted and stopped on drop, even on panic.
pub struct NbdFuse {
    child: Child,
    mountpoint: PathBuf,
}

impl NbdFuse {
    pub fn start(mountpoint: &Path, uri: &str, size: u64) -> NbdFuse {
        let child = Command::new("nbdfuse")
            .arg(mountpoint.join("disk"))
            .arg(uri)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run nbdfuse: {e}"));
        let mut fuse = NbdFuse {
            child,
            mountpoint: mountpoint.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        // nbdfuse stays in the foreground; the file appears once it is connected.
        while std::fs::metadata(fuse.file()).map(|m| m.len()).ok() != Some(size) {
            if let Ok(Some(status)) = fuse.child.try_wait() {
                panic!("nbdfuse exited early: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "nbdfuse did not expose {uri} in time"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        fuse
    }

    pub fn file(&self) -> PathBuf {
        self.mountpoint.join("disk")
    }
}

impl Drop for NbdFuse {
    fn drop(&mut self) {
        let unmounted = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.mountpoint)
            .stdin(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !unmounted {
            // Busy (a loop device still open): detach lazily so the tempdir can go.
            let _ = Command::new("fusermount3")
                .arg("-uz")
                .arg(&self.mountpoint)
                .status();
        }
        // nbdfuse exits once unmounted; give it a moment, then kill it by PID.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `mount -o loop IMAGE TARGET`; unmounted and its loop device detached on drop.
pub struct LoopMount {
    image: PathBuf,
    target: PathBuf,
    mounted: bool,
}

impl LoopMount {
    pub fn mount(image: &Path, target: &Path) -> LoopMount {
        LoopMount::mount_with(image, target, "loop")
    }

    /// `mount -o OPTIONS` (which must include `loop`).
    pub fn mount_with(image: &Path, target: &Path, options: &str) -> LoopMount {
        let mut guard = LoopMount {
            image: image.to_path_buf(),
            target: target.to_path_buf(),
            mounted: true,
        };
        let out = output(
            Command::new("mount")
                .args(["-t", "ext4", "-o", options])
                .arg(image)
                .arg(target),
        );
        guard.mounted = out.status.success();
        assert!(
            guard.mounted,
            "mount failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        guard
    }

    pub fn unmount(&mut self) {
        ok(Command::new("umount").arg(&self.target));
        self.mounted = false;
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        if self.mounted {
            let clean = Command::new("umount")
                .arg(&self.target)
                .status()
                .is_ok_and(|s| s.success());
            if !clean {
                let _ = Command::new("umount").arg("-l").arg(&self.target).status();
            }
        }
        // `mount -o loop` autoclears, but a failed mount or lazy unmount can leave one.
        if let Ok(out) = Command::new("losetup").arg("-j").arg(&self.image).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if let Some((device, _)) = line.split_once(':') {
                    let _ = Command::new("losetup").args(["-d", device]).status();
                }
            }
        }
    }
}

/// A few hundred files of random sizes (some empty, some of megabytes) in nested dirs.
fn generate_tree(root: &Path, rng: &mut StdRng) -> u64 {
    let mut total = 0;
    for i in 0..320 {
        let depth = rng.gen_range(0..4);
        let mut dir = root.to_path_buf();
        for level in 0..depth {
            dir.push(format!("d{level}-{}", rng.gen_range(0..4)));
        }
        std::fs::create_dir_all(&dir).unwrap();
        let size = match rng.gen_range(0..20) {
            0 => 0,
            1 | 2 => rng.gen_range(256 << 10..3 << 20),
            _ => rng.gen_range(1..64 << 10),
        };
        let mut data = vec![0u8; size];
        rng.fill_bytes(&mut data);
        std::fs::write(dir.join(format!("f{i}.bin")), &data).unwrap();
        total += size as u64;
    }
    total
}

/// Relative paths of the regular files under `root`, sorted.
fn files(root: &Path, relative: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(root.join(relative)).unwrap() {
        let entry = entry.unwrap();
        let path = relative.join(entry.file_name());
        let kind = entry.file_type().unwrap();
        if kind.is_dir() {
            files(root, &path, out);
        } else {
            assert!(kind.is_file(), "unexpected {}", path.display());
            out.push(path);
        }
    }
}

/// `sha256sum` of every file under `root`, one "hash  path" line each, in path order.
fn checksums(root: &Path) -> Vec<String> {
    let mut list = Vec::new();
    files(root, Path::new(""), &mut list);
    list.sort();
    assert!(!list.is_empty(), "no files under {}", root.display());
    let sums = ok(Command::new("sha256sum").current_dir(root).args(&list));
    sums.lines().map(str::to_string).collect()
}

fn assert_same(expected: &[String], actual: &[String], when: &str) {
    let missing: Vec<_> = expected.iter().filter(|l| !actual.contains(l)).collect();
    let extra: Vec<_> = actual.iter().filter(|l| !expected.contains(l)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{when}: {} files differ or are missing, {} unexpected\nmissing: {missing:?}\nunexpected: {extra:?}",
        missing.len(),
        extra.len()
    );
}

#[test]
fn ext4_on_nbdfuse_loop_mount() {
    let dir = tempfile::tempdir().unwrap();
    let source = tempfile::tempdir().unwrap();
    let fuse_dir = tempfile::tempdir().unwrap();
    let mount_dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let size = 1u64 << 30;

    let mut rng = StdRng::seed_from_u64(0xf10e);
    let bytes = generate_tree(source.path(), &mut rng);
    assert!(
        bytes > 8 << 20,
        "tree too small to span stripe units: {bytes}"
    );
    let expected = checksums(source.path());

    let fuse = NbdFuse::start(fuse_dir.path(), cluster.uri(), size);
    ok(Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(fuse.file()));
    let mut mount = LoopMount::mount(&fuse.file(), mount_dir.path());
    let tree = mount_dir.path().join("tree");
    std::fs::create_dir(&tree).unwrap();
    ok(Command::new("cp")
        .arg("-a")
        .arg(source.path().join("."))
        .arg(&tree));
    assert_same(&expected, &checksums(&tree), "after copy");
    mount.unmount();
    // fsync the file: nbdfuse turns it into an NBD flush.
    ok(Command::new("sync").arg(fuse.file()));
    ok(Command::new("e2fsck").args(["-f", "-n"]).arg(fuse.file()));

    // A fresh nbdfuse has no cached pages: everything below is read from the cluster.
    drop(fuse);
    let fuse = NbdFuse::start(fuse_dir.path(), cluster.uri(), size);
    ok(Command::new("e2fsck").args(["-f", "-n"]).arg(fuse.file()));
    let mut mount = LoopMount::mount(&fuse.file(), mount_dir.path());
    assert_same(&expected, &checksums(&tree), "after remount");
    mount.unmount();
}
