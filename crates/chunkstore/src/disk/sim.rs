//! A simulated disk in memory, for crash tests that need to see what a process kill
//! cannot show: writes the page cache held but never synced.
//!
//! Every file keeps its content as the process sees it plus what changed since its
//! last `sync_data` (the durable pages it overwrote, and the changes in order); every
//! directory keeps its entries as the process sees them plus its entries as of its
//! last `sync_dir`, and the changes since. A [`SimDisk::power_cut`] keeps a random
//! part of each: any subset of a file's unsynced changes, writes torn at sector
//! granularity, applied in order over its durable content; any subset of a
//! directory's unsynced entry changes (a rename is one change). A [`SimDisk::crash`]
//! (a process kill) keeps everything. Both end the process's view of the disk: its
//! [`SimDisk::mount`] and every file opened through it fail from then on, so a
//! store left running by the dead process can never write again.
//!
//! Results depend only on the operations and the seed: the state is kept in ordered
//! maps and the randomness comes from the seed alone.

use super::hdd::splitmix64;
use super::{Disk, DiskFile, FileRef, FsSpace};
use std::collections::BTreeMap;
use std::io::{self, ErrorKind};
use std::path::{Component, Path};
use std::sync::{Arc, Mutex, MutexGuard};

const PAGE_BYTES: u64 = 4096;
/// The unit a power cut tears writes at.
const SECTOR_BYTES: u64 = 512;
const ROOT: u64 = 0;

type Page = Box<[u8; PAGE_BYTES as usize]>;

/// A file's bytes: pages that were never written (or punched) are holes.
#[derive(Default)]
struct Content {
    pages: BTreeMap<u64, Page>,
    len: u64,
}

/// A change to a file's content.
enum Change {
    Write { offset: u64, data: Vec<u8> },
    Zero { offset: u64, length: u64 },
    SetLen(u64),
}

impl Content {
    fn read(&self, buf: &mut [u8], offset: u64) -> usize {
        if offset >= self.len {
            return 0;
        }
        let n = (self.len - offset).min(buf.len() as u64) as usize;
        let buf = &mut buf[..n];
        buf.fill(0);
        let end = offset + n as u64;
        for (&page, bytes) in self
            .pages
            .range(offset / PAGE_BYTES..end.div_ceil(PAGE_BYTES))
        {
            let start = page * PAGE_BYTES;
            let from = start.max(offset);
            let to = (start + PAGE_BYTES).min(end);
            buf[(from - offset) as usize..(to - offset) as usize]
                .copy_from_slice(&bytes[(from - start) as usize..(to - start) as usize]);
        }
        n
    }

    /// The pages a change touches, for undo: existing ones, and for a write the ones
    /// it creates.
    fn touched(&self, change: &Change) -> Vec<u64> {
        let (first, end) = match *change {
            Change::Write { offset, ref data } => {
                return (offset / PAGE_BYTES..(offset + data.len() as u64).div_ceil(PAGE_BYTES))
                    .collect();
            }
            Change::Zero { offset, length } => {
                (offset / PAGE_BYTES, (offset + length).div_ceil(PAGE_BYTES))
            }
            Change::SetLen(len) => (len / PAGE_BYTES, u64::MAX),
        };
        self.pages
            .range(first..end)
            .map(|(&page, _)| page)
            .collect()
    }

    fn apply(&mut self, change: &Change) {
        match *change {
            Change::Write { offset, ref data } => {
                let end = offset + data.len() as u64;
                let mut at = offset;
                while at < end {
                    let page = at / PAGE_BYTES;
                    let start = page * PAGE_BYTES;
                    let to = (start + PAGE_BYTES).min(end);
                    let bytes = self
                        .pages
                        .entry(page)
                        .or_insert_with(|| Box::new([0; PAGE_BYTES as usize]));
                    bytes[(at - start) as usize..(to - start) as usize]
                        .copy_from_slice(&data[(at - offset) as usize..(to - offset) as usize]);
                    at = to;
                }
                self.len = self.len.max(end);
            }
            // Zeroing and punching differ only in allocation, which nothing reads back
            // but `extents`; both leave holes here (a superset of the data either way).
            Change::Zero { offset, length } => {
                let end = offset + length;
                let pages: Vec<u64> = self
                    .pages
                    .range(offset / PAGE_BYTES..end.div_ceil(PAGE_BYTES))
                    .map(|(&page, _)| page)
                    .collect();
                for page in pages {
                    let start = page * PAGE_BYTES;
                    let (from, to) = (start.max(offset), (start + PAGE_BYTES).min(end));
                    if from == start && to == start + PAGE_BYTES {
                        self.pages.remove(&page);
                    } else {
                        self.pages.get_mut(&page).expect("listed")
                            [(from - start) as usize..(to - start) as usize]
                            .fill(0);
                    }
                }
            }
            Change::SetLen(len) => {
                if len < self.len {
                    self.apply(&Change::Zero {
                        offset: len,
                        length: self.len.next_multiple_of(PAGE_BYTES) - len,
                    });
                }
                self.len = len;
            }
        }
    }

    fn extents(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for &page in self.pages.keys() {
            let start = page * PAGE_BYTES;
            let length = PAGE_BYTES.min(self.len.saturating_sub(start));
            match out.last_mut() {
                Some((o, l)) if *o + *l == start => *l += length,
                _ if length > 0 => out.push((start, length)),
                _ => {}
            }
        }
        out
    }
}

#[derive(Default)]
struct Inode {
    content: Content,
    /// Durable pages overwritten since the last sync (`None`: a hole), and the
    /// durable length.
    undo: BTreeMap<u64, Option<Page>>,
    durable_len: Option<u64>,
    /// Changes since the last sync, in order.
    unsynced: Vec<Change>,
    /// Bytes allocated up front ([`DiskFile::allocate`]): writes below take no space.
    allocated: u64,
}

impl Inode {
    /// Space the file takes: what was allocated up front, and pages past it.
    fn used_bytes(&self) -> u64 {
        let past = self
            .content
            .pages
            .range(self.allocated / PAGE_BYTES..)
            .count() as u64;
        self.allocated + past * PAGE_BYTES
    }

    /// Pages a write would add past the allocated part.
    fn new_pages(&self, offset: u64, length: u64) -> u64 {
        let first = (offset / PAGE_BYTES).max(self.allocated.div_ceil(PAGE_BYTES));
        let end = (offset + length).div_ceil(PAGE_BYTES);
        (first..end)
            .filter(|page| !self.content.pages.contains_key(page))
            .count() as u64
    }

    fn change(&mut self, change: Change) {
        for page in self.content.touched(&change) {
            let old = self.content.pages.get(&page).cloned();
            self.undo.entry(page).or_insert(old);
        }
        self.durable_len.get_or_insert(self.content.len);
        self.content.apply(&change);
        self.unsynced.push(change);
    }

    fn sync(&mut self) {
        self.undo.clear();
        self.durable_len = None;
        self.unsynced.clear();
    }

    /// Back to the durable content, plus a random part of the unsynced changes.
    fn cut(&mut self, random: &mut Random) {
        for (page, old) in std::mem::take(&mut self.undo) {
            match old {
                Some(bytes) => self.content.pages.insert(page, bytes),
                None => self.content.pages.remove(&page),
            };
        }
        if let Some(len) = self.durable_len.take() {
            self.content.len = len;
        }
        for change in std::mem::take(&mut self.unsynced) {
            match random.below(3) {
                0 => {}
                1 => self.content.apply(&change),
                _ => match change {
                    Change::Write { offset, data } => {
                        // Torn: each sector written or not.
                        let end = offset + data.len() as u64;
                        let mut at = offset;
                        while at < end {
                            let to = (at / SECTOR_BYTES + 1) * SECTOR_BYTES;
                            let to = to.min(end);
                            if random.below(2) == 0 {
                                self.content.apply(&Change::Write {
                                    offset: at,
                                    data: data[(at - offset) as usize..(to - offset) as usize]
                                        .to_vec(),
                                });
                            }
                            at = to;
                        }
                    }
                    other => self.content.apply(&other),
                },
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    File(u64),
    Dir(u64),
}

/// Entry changes made at once (a rename within a directory is one).
type EntryChange = Vec<(String, Option<Node>)>;

#[derive(Default)]
struct Dir {
    entries: BTreeMap<String, Node>,
    durable: BTreeMap<String, Node>,
    unsynced: Vec<EntryChange>,
}

impl Dir {
    fn set(&mut self, change: EntryChange) {
        for (name, node) in &change {
            match node {
                Some(node) => self.entries.insert(name.clone(), *node),
                None => self.entries.remove(name),
            };
        }
        self.unsynced.push(change);
    }

    fn sync(&mut self) {
        self.durable = self.entries.clone();
        self.unsynced.clear();
    }

    fn cut(&mut self, random: &mut Random) {
        self.entries = self.durable.clone();
        for change in std::mem::take(&mut self.unsynced) {
            if random.below(2) == 0 {
                for (name, node) in change {
                    match node {
                        Some(node) => self.entries.insert(name, node),
                        None => self.entries.remove(&name),
                    };
                }
            }
        }
        self.durable = self.entries.clone();
    }
}

struct Random(u64);

impl Random {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = splitmix64(self.0);
        self.0 % n
    }
}

struct State {
    /// Bumped by every crash and power cut; views and files of an older one fail.
    generation: u64,
    next_id: u64,
    dirs: BTreeMap<u64, Dir>,
    files: BTreeMap<u64, Inode>,
    /// Changes left before the disk stops taking any (see [`SimDisk::fail_after`]).
    changes_left: Option<u64>,
    /// Changes made since the disk was created.
    changes: u64,
    capacity: u64,
}

/// A simulated disk; clones share it (the same physical disk across a restart).
#[derive(Clone)]
pub struct SimDisk {
    state: Arc<Mutex<State>>,
}

impl Default for SimDisk {
    fn default() -> Self {
        SimDisk::new()
    }
}

impl std::fmt::Debug for SimDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.lock().unwrap();
        f.debug_struct("SimDisk")
            .field("generation", &state.generation)
            .field("files", &state.files.len())
            .field("changes", &state.changes)
            .finish()
    }
}

fn stale() -> io::Error {
    io::Error::other("simulated disk: opened before a crash or power cut")
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        ErrorKind::NotFound,
        format!("{}: not found", path.display()),
    )
}

fn names(path: &Path) -> io::Result<Vec<&str>> {
    let mut out = Vec::new();
    for component in path.components() {
        match component {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(name) => out.push(name.to_str().ok_or_else(|| {
                io::Error::new(ErrorKind::InvalidInput, "simulated disk: non-UTF-8 name")
            })?),
            _ => {
                return Err(io::Error::new(
                    ErrorKind::InvalidInput,
                    format!("simulated disk: unsupported path {}", path.display()),
                ))
            }
        }
    }
    Ok(out)
}

impl State {
    fn lookup(&self, path: &Path) -> io::Result<Option<Node>> {
        let mut node = Node::Dir(ROOT);
        for name in names(path)? {
            let Node::Dir(dir) = node else {
                return Ok(None);
            };
            match self.dirs[&dir].entries.get(name) {
                Some(next) => node = *next,
                None => return Ok(None),
            }
        }
        Ok(Some(node))
    }

    /// The directory holding `path`'s entry, and the entry's name.
    fn parent<'a>(&self, path: &'a Path) -> io::Result<(u64, &'a str)> {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| not_found(path))?;
        match self.lookup(path.parent().ok_or_else(|| not_found(path))?)? {
            Some(Node::Dir(dir)) => Ok((dir, name)),
            _ => Err(not_found(path)),
        }
    }

    /// Space the files an entry reaches take (a removed file's space comes back at
    /// once: the store keeps no handle to what it removes).
    fn used_bytes(&self) -> u64 {
        let mut dirs = vec![ROOT];
        let mut used = 0;
        while let Some(dir) = dirs.pop() {
            for node in self.dirs[&dir].entries.values() {
                match *node {
                    Node::Dir(d) => dirs.push(d),
                    Node::File(f) => used += self.files[&f].used_bytes(),
                }
            }
        }
        used
    }

    /// Fails with ENOSPC unless `bytes` more fit.
    fn take(&self, bytes: u64) -> io::Result<()> {
        if self.used_bytes() + bytes > self.capacity {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        Ok(())
    }

    /// Counts a change to the disk; fails once the disk stopped taking them.
    fn change(&mut self) -> io::Result<()> {
        if self.changes_left == Some(0) {
            return Err(io::Error::other("simulated disk: power is failing"));
        }
        if let Some(left) = &mut self.changes_left {
            *left -= 1;
        }
        self.changes += 1;
        Ok(())
    }

    fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Drops directories and files no entry reaches any more (no handle can either:
    /// this runs only when handles have just been invalidated).
    fn collect(&mut self) {
        let mut dirs = vec![ROOT];
        let mut reached_dirs = std::collections::BTreeSet::new();
        let mut reached_files = std::collections::BTreeSet::new();
        while let Some(dir) = dirs.pop() {
            reached_dirs.insert(dir);
            // Durable entries too: after a crash, a removal not yet synced may revert.
            let entries = &self.dirs[&dir];
            for node in entries.entries.values().chain(entries.durable.values()) {
                match *node {
                    Node::Dir(d) if !reached_dirs.contains(&d) => dirs.push(d),
                    Node::File(f) => {
                        reached_files.insert(f);
                    }
                    Node::Dir(_) => {}
                }
            }
            for change in &entries.unsynced {
                for (_, node) in change {
                    match *node {
                        Some(Node::Dir(d)) if !reached_dirs.contains(&d) => dirs.push(d),
                        Some(Node::File(f)) => {
                            reached_files.insert(f);
                        }
                        _ => {}
                    }
                }
            }
        }
        self.dirs.retain(|id, _| reached_dirs.contains(id));
        self.files.retain(|id, _| reached_files.contains(id));
    }
}

impl SimDisk {
    /// An empty disk holding only the root directory.
    pub fn new() -> SimDisk {
        SimDisk {
            state: Arc::new(Mutex::new(State {
                generation: 0,
                next_id: ROOT,
                dirs: BTreeMap::from([(ROOT, Dir::default())]),
                files: BTreeMap::new(),
                changes_left: None,
                changes: 0,
                capacity: SimDisk::CAPACITY_BYTES,
            })),
        }
    }

    /// The simulated file system's size unless [`SimDisk::set_capacity`] says
    /// otherwise.
    pub const CAPACITY_BYTES: u64 = 1 << 40;

    /// Makes the file system this size: writes that would take more fail with
    /// ENOSPC, as a full disk's do.
    pub fn set_capacity(&self, bytes: u64) {
        self.state.lock().unwrap().capacity = bytes;
    }

    /// Bytes the files take now.
    pub fn used_bytes(&self) -> u64 {
        self.state.lock().unwrap().used_bytes()
    }

    /// The disk as one process sees it, to open a store on: it and every file opened
    /// through it fail after the next [`SimDisk::crash`] or [`SimDisk::power_cut`].
    pub fn mount(&self) -> Arc<dyn Disk> {
        Arc::new(Mount {
            state: self.state.clone(),
            generation: self.state.lock().unwrap().generation,
        })
    }

    /// A process kill: everything written stays (the page cache survives, synced or
    /// not), the dead process's handles fail.
    pub fn crash(&self) {
        let mut state = self.state.lock().unwrap();
        state.generation += 1;
        state.changes_left = None;
    }

    /// A power cut: each file keeps its synced content plus a random subset of the
    /// changes made since, in order, writes torn at 512-byte sectors; each directory
    /// keeps its synced entries plus a random subset of the changes since (so a file
    /// created or renamed but not synced in its directory may vanish or revert). The
    /// same seed after the same operations gives the same disk. Handles opened before
    /// fail.
    pub fn power_cut(&self, seed: u64) {
        let mut state = self.state.lock().unwrap();
        let mut random = Random(seed);
        for file in state.files.values_mut() {
            file.cut(&mut random);
        }
        for dir in state.dirs.values_mut() {
            dir.cut(&mut random);
        }
        state.collect();
        state.generation += 1;
        state.changes_left = None;
    }

    /// Lets `changes` more changes (writes, syncs, creates, renames, removes) through,
    /// then fails every operation until the next crash or power cut: the instant the
    /// power goes, at any point of the store's work (mid-batch, between a sync and the
    /// next write).
    pub fn fail_after(&self, changes: u64) {
        self.state.lock().unwrap().changes_left = Some(changes);
    }

    /// Changes made so far (what [`SimDisk::fail_after`] counts).
    pub fn changes(&self) -> u64 {
        self.state.lock().unwrap().changes
    }
}

/// One process's view of a [`SimDisk`].
struct Mount {
    state: Arc<Mutex<State>>,
    generation: u64,
}

fn lock(state: &Mutex<State>, generation: u64) -> io::Result<MutexGuard<'_, State>> {
    let state = state.lock().unwrap();
    if state.generation != generation {
        return Err(stale());
    }
    if state.changes_left == Some(0) {
        return Err(io::Error::other("simulated disk: power is failing"));
    }
    Ok(state)
}

impl Mount {
    fn lock(&self) -> io::Result<MutexGuard<'_, State>> {
        lock(&self.state, self.generation)
    }
}

impl Disk for Mount {
    fn open(&self, path: &Path, create: bool) -> io::Result<FileRef> {
        let mut state = self.lock()?;
        let inode = match state.lookup(path)? {
            Some(Node::File(inode)) => inode,
            Some(Node::Dir(_)) => {
                return Err(io::Error::other(format!(
                    "{} is a directory",
                    path.display()
                )))
            }
            None if create => {
                let (dir, name) = state.parent(path)?;
                state.change()?;
                let inode = state.new_id();
                state.files.insert(inode, Inode::default());
                let entry = vec![(name.to_string(), Some(Node::File(inode)))];
                state.dirs.get_mut(&dir).expect("looked up").set(entry);
                inode
            }
            None => return Err(not_found(path)),
        };
        Ok(Arc::new(SimFile {
            state: self.state.clone(),
            generation: self.generation,
            inode,
        }))
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut state = self.lock()?;
        let mut dir = ROOT;
        for name in names(path)? {
            dir = match state.dirs[&dir].entries.get(name) {
                Some(Node::Dir(next)) => *next,
                Some(Node::File(_)) => {
                    return Err(io::Error::other(format!(
                        "{}: a file is in the way",
                        path.display()
                    )))
                }
                None => {
                    state.change()?;
                    let next = state.new_id();
                    state.dirs.insert(next, Dir::default());
                    let entry = vec![(name.to_string(), Some(Node::Dir(next)))];
                    state.dirs.get_mut(&dir).expect("walked").set(entry);
                    next
                }
            };
        }
        Ok(())
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        let mut state = self.lock()?;
        let Some(Node::Dir(dir)) = state.lookup(path)? else {
            return Err(not_found(path));
        };
        state.change()?;
        state.dirs.get_mut(&dir).expect("looked up").sync();
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut state = self.lock()?;
        let node = state.lookup(from)?.ok_or_else(|| not_found(from))?;
        let (from_dir, from_name) = state.parent(from)?;
        let (to_dir, to_name) = state.parent(to)?;
        state.change()?;
        let removal = (from_name.to_string(), None);
        let addition = (to_name.to_string(), Some(node));
        if from_dir == to_dir {
            state
                .dirs
                .get_mut(&to_dir)
                .unwrap()
                .set(vec![removal, addition]);
        } else {
            state.dirs.get_mut(&from_dir).unwrap().set(vec![removal]);
            state.dirs.get_mut(&to_dir).unwrap().set(vec![addition]);
        }
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.remove(path, false)
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        self.remove(path, true)
    }

    fn exists(&self, path: &Path) -> io::Result<bool> {
        Ok(self.lock()?.lookup(path)?.is_some())
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let state = self.lock()?;
        match state.lookup(path)? {
            Some(Node::Dir(dir)) => Ok(state.dirs[&dir].entries.keys().cloned().collect()),
            _ => Err(not_found(path)),
        }
    }

    fn allocated_bytes(&self, path: &Path) -> io::Result<u64> {
        let state = self.lock()?;
        match state.lookup(path)? {
            Some(Node::File(inode)) => {
                Ok(state.files[&inode].content.pages.len() as u64 * PAGE_BYTES)
            }
            _ => Err(not_found(path)),
        }
    }

    fn space(&self, _path: &Path) -> io::Result<FsSpace> {
        let state = self.lock()?;
        Ok(FsSpace {
            total_bytes: state.capacity,
            free_bytes: state.capacity.saturating_sub(state.used_bytes()),
            device: 0,
        })
    }
}

impl Mount {
    fn remove(&self, path: &Path, dir: bool) -> io::Result<()> {
        let mut state = self.lock()?;
        match state.lookup(path)? {
            Some(Node::Dir(_)) if !dir => {
                return Err(io::Error::other(format!(
                    "{} is a directory",
                    path.display()
                )))
            }
            Some(_) => {}
            None => return Err(not_found(path)),
        }
        let (parent, name) = state.parent(path)?;
        state.change()?;
        // A removed directory's own entries stay as they were: if the removal is lost
        // in a power cut, the directory comes back with its durable entries.
        state
            .dirs
            .get_mut(&parent)
            .unwrap()
            .set(vec![(name.to_string(), None)]);
        Ok(())
    }
}

/// A file opened through a [`Mount`].
struct SimFile {
    state: Arc<Mutex<State>>,
    generation: u64,
    inode: u64,
}

impl SimFile {
    fn change(&self, change: Change) -> io::Result<()> {
        let mut state = lock(&self.state, self.generation)?;
        state.change()?;
        state
            .files
            .get_mut(&self.inode)
            .expect("open file")
            .change(change);
        Ok(())
    }

    fn inode<T>(&self, f: impl FnOnce(&Inode) -> T) -> io::Result<T> {
        let state = lock(&self.state, self.generation)?;
        Ok(f(&state.files[&self.inode]))
    }
}

impl DiskFile for SimFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.inode(|inode| inode.content.read(buf, offset))
    }

    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        {
            let state = lock(&self.state, self.generation)?;
            let pages = state.files[&self.inode].new_pages(offset, data.len() as u64);
            state.take(pages * PAGE_BYTES)?;
        }
        self.change(Change::Write {
            offset,
            data: data.to_vec(),
        })
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut state = lock(&self.state, self.generation)?;
        state.change()?;
        state.files.get_mut(&self.inode).expect("open file").sync();
        Ok(())
    }

    fn zero_range(&self, offset: u64, length: u64, _punch: bool) -> io::Result<()> {
        self.change(Change::Zero { offset, length })
    }

    fn set_len(&self, length: u64) -> io::Result<()> {
        self.change(Change::SetLen(length))
    }

    /// Counted as taken at once (pages are kept only once written, to spare memory).
    fn allocate(&self, length: u64) -> io::Result<()> {
        {
            let mut state = lock(&self.state, self.generation)?;
            let inode = &state.files[&self.inode];
            let more = length.saturating_sub(inode.allocated);
            let written_past = inode
                .content
                .pages
                .range(inode.allocated / PAGE_BYTES..length.div_ceil(PAGE_BYTES))
                .count() as u64;
            state.take(more.saturating_sub(written_past * PAGE_BYTES))?;
            let inode = state.files.get_mut(&self.inode).expect("open file");
            inode.allocated = inode.allocated.max(length);
        }
        if self.size()? < length {
            self.change(Change::SetLen(length))?;
        }
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        self.inode(|inode| inode.content.len)
    }

    fn extents(&self) -> io::Result<Vec<(u64, u64)>> {
        self.inode(|inode| inode.content.extents())
    }

    fn try_lock(&self) -> io::Result<bool> {
        // One process per disk at a time: older ones are cut off by generation.
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(disk: &dyn Disk, path: &str) -> Option<Vec<u8>> {
        crate::disk::read_file(disk, Path::new(path)).unwrap()
    }

    /// A synced file overwritten without a sync, and a synced file whose entry was
    /// never synced, cut with `seed`.
    fn cut(seed: u64) -> SimDisk {
        let sim = SimDisk::new();
        let disk = sim.mount();
        disk.create_dir_all(Path::new("/d")).unwrap();
        disk.sync_dir(Path::new("/")).unwrap();
        let file = disk.open(Path::new("/d/f"), true).unwrap();
        file.write_all_at(&[1; 1000], 0).unwrap();
        file.sync_data().unwrap();
        disk.sync_dir(Path::new("/d")).unwrap();
        file.write_all_at(&[2; 1000], 0).unwrap();
        let other = disk.open(Path::new("/d/g"), true).unwrap();
        other.write_all_at(&[3; 10], 0).unwrap();
        other.sync_data().unwrap();
        sim.power_cut(seed);
        assert!(file.read_at(&mut [0; 1], 0).is_err(), "old handles fail");
        assert!(disk.exists(Path::new("/d")).is_err(), "the old mount fails");
        sim
    }

    #[test]
    fn a_power_cut_keeps_synced_data_and_any_part_of_the_rest() {
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..256 {
            let disk = cut(seed).mount();
            let f = read(&*disk, "/d/f").expect("synced entry");
            assert_eq!(f.len(), 1000);
            // Each sector holds the synced or the newer unsynced bytes, whole.
            for sector in f.chunks(512) {
                assert!(sector.iter().all(|&b| b == sector[0]));
                assert!(sector[0] == 1 || sector[0] == 2);
            }
            seen.insert((f[0], f[999], read(&*disk, "/d/g").is_some()));
        }
        assert_eq!(seen.len(), 8, "every combination turns up: {seen:?}");
        let again = |seed| read(&*cut(seed).mount(), "/d/f");
        assert!(
            (0..16).all(|seed| again(seed) == again(seed)),
            "deterministic"
        );
    }

    #[test]
    fn a_crash_keeps_everything_and_a_lost_removal_brings_the_directory_back() {
        let sim = SimDisk::new();
        let disk = sim.mount();
        disk.create_dir_all(Path::new("/v")).unwrap();
        let file = disk.open(Path::new("/v/f"), true).unwrap();
        file.write_all_at(b"abc", 0).unwrap();
        file.sync_data().unwrap();
        disk.sync_dir(Path::new("/v")).unwrap();
        disk.sync_dir(Path::new("/")).unwrap();
        disk.remove_dir_all(Path::new("/v")).unwrap();
        sim.crash();
        assert!(file.write_all_at(b"x", 0).is_err(), "zombie handles fail");
        let disk = sim.mount();
        assert!(
            !disk.exists(Path::new("/v")).unwrap(),
            "the page cache survives"
        );
        let kept = (0..32).any(|seed| {
            let sim = SimDisk::new();
            let disk = sim.mount();
            disk.create_dir_all(Path::new("/v")).unwrap();
            let file = disk.open(Path::new("/v/f"), true).unwrap();
            file.write_all_at(b"abc", 0).unwrap();
            file.sync_data().unwrap();
            disk.sync_dir(Path::new("/v")).unwrap();
            disk.sync_dir(Path::new("/")).unwrap();
            disk.remove_dir_all(Path::new("/v")).unwrap();
            sim.power_cut(seed);
            read(&*sim.mount(), "/v/f").is_some_and(|f| f == b"abc")
        });
        assert!(kept, "an unsynced removal may be lost");
    }

    #[test]
    fn fail_after_stops_the_disk_at_a_given_change() {
        let sim = SimDisk::new();
        let disk = sim.mount();
        let file = disk.open(Path::new("/f"), true).unwrap();
        sim.fail_after(2);
        file.write_all_at(b"a", 0).unwrap();
        file.sync_data().unwrap();
        assert!(file.write_all_at(b"b", 0).is_err());
        assert!(file.read_at(&mut [0; 1], 0).is_err(), "the power is going");
        disk.sync_dir(Path::new("/")).unwrap_err();
        sim.power_cut(1);
        let disk = sim.mount();
        // The file's entry was never synced: it may be gone, never different.
        if let Some(f) = read(&*disk, "/f") {
            assert_eq!(f, b"a");
        }
    }

    #[test]
    fn content_punches_and_truncates_by_page() {
        let mut content = Content::default();
        content.apply(&Change::Write {
            offset: 100,
            data: vec![7; 3 * PAGE_BYTES as usize],
        });
        assert_eq!(content.extents(), vec![(0, 3 * PAGE_BYTES + 100)]);
        content.apply(&Change::Zero {
            offset: 10,
            length: 2 * PAGE_BYTES,
        });
        assert_eq!(
            content.extents(),
            vec![(0, PAGE_BYTES), (2 * PAGE_BYTES, PAGE_BYTES + 100)]
        );
        let mut buf = [9; 8];
        assert_eq!(content.read(&mut buf, PAGE_BYTES + 5), 8);
        assert_eq!(buf, [0; 8]);
        content.apply(&Change::SetLen(2 * PAGE_BYTES + 20));
        assert_eq!(content.read(&mut buf, 2 * PAGE_BYTES + 16), 4);
        assert_eq!(buf[..4], [7; 4]);
        content.apply(&Change::SetLen(3 * PAGE_BYTES));
        assert_eq!(content.read(&mut buf, 2 * PAGE_BYTES + 16), 8);
        assert_eq!(buf, [7, 7, 7, 7, 0, 0, 0, 0], "a shrink drops the tail");
    }
}
