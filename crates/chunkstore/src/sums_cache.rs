//! Pages of block checksums kept in memory, so that a read checks its blocks without
//! a syscall for their checksums (a 4 KiB random read would otherwise pay a second
//! pread). A page is 1024 checksums, the blocks of 4 MiB of a chunk; every store
//! shares one budget of pages, and a file that would pass it stops caching (its reads
//! go to the file again) until pages are freed. Writes go through to the file and to
//! the cached pages alike, except in write-back caches (plain mode): there a write into
//! cached pages stays in memory until [`SumsCache::flush`], which a checkpoint calls
//! before it syncs the file; after a crash, replay of the log rewrites the checksum of
//! every block changed since the last checkpoint, so the file may lag until then. That
//! saves a chunk server one `pwrite` per change.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Checksums in a cached page.
pub(crate) const PAGE_SUMS: u64 = 1024;
/// Pages cached at most, over every chunk file of a store: 64 MiB of memory for the
/// checksums of 64 GiB of chunk data.
const PAGES_MAX: usize = 16 << 10;

/// The pages every chunk file of a store caches, counted.
#[derive(Default)]
pub(crate) struct Budget {
    pages: AtomicUsize,
}

/// One chunk file's cached pages.
pub(crate) struct SumsCache {
    pages: Mutex<Pages>,
    budget: Arc<Budget>,
    /// Writes into cached pages wait for [`SumsCache::flush`].
    write_back: bool,
}

#[derive(Default)]
struct Pages {
    sums: BTreeMap<u64, Box<[u32]>>,
    /// Pages changed in memory and not yet in the file; never dropped from `sums`.
    dirty: BTreeSet<u64>,
}

impl SumsCache {
    pub(crate) fn new(budget: Arc<Budget>, write_back: bool) -> SumsCache {
        SumsCache {
            pages: Mutex::default(),
            budget,
            write_back,
        }
    }

    /// Fills `out` with checksums `within..` of page `page`, from memory, else from
    /// `load` (the page read from the file), cached budget permitting. The lock is
    /// held across the load, as across a write: a page read while a write changes it
    /// is never cached stale.
    pub(crate) fn read(
        &self,
        page: u64,
        within: usize,
        out: &mut [u32],
        load: impl FnOnce() -> io::Result<Vec<u32>>,
    ) -> io::Result<()> {
        let mut pages = self.pages.lock().unwrap();
        if let Some(sums) = pages.sums.get(&page) {
            out.copy_from_slice(&sums[within..within + out.len()]);
            return Ok(());
        }
        let sums = load()?;
        assert_eq!(sums.len() as u64, PAGE_SUMS, "a page is read whole");
        out.copy_from_slice(&sums[within..within + out.len()]);
        if self.budget.pages.fetch_add(1, Ordering::Relaxed) < PAGES_MAX {
            pages.sums.insert(page, sums.into());
        } else {
            self.budget.pages.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Checksums `first..` become `sums`: `write` puts them in the file, and the
    /// cached pages follow. In a write-back cache whose pages hold them all, they stay
    /// in memory, and `write` is not called.
    pub(crate) fn write(
        &self,
        first: u64,
        sums: &[u32],
        write: impl FnOnce() -> io::Result<()>,
    ) -> io::Result<()> {
        let mut pages = self.pages.lock().unwrap();
        let touched = first / PAGE_SUMS..=(first + sums.len() as u64 - 1) / PAGE_SUMS;
        let deferred = self.write_back && touched.clone().all(|p| pages.sums.contains_key(&p));
        if deferred {
            pages.dirty.extend(touched);
        } else {
            write()?;
        }
        for (i, sum) in sums.iter().enumerate() {
            let at = first + i as u64;
            if let Some(page) = pages.sums.get_mut(&(at / PAGE_SUMS)) {
                page[(at % PAGE_SUMS) as usize] = *sum;
            }
        }
        Ok(())
    }

    /// Writes every page changed in memory with `write(page, sums)`; on error the rest
    /// stay dirty for the next flush.
    pub(crate) fn flush(
        &self,
        mut write: impl FnMut(u64, &[u32]) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut pages = self.pages.lock().unwrap();
        while let Some(&page) = pages.dirty.first() {
            write(page, &pages.sums[&page])?;
            pages.dirty.remove(&page);
        }
        Ok(())
    }

    /// Holds changes the file does not have yet.
    pub(crate) fn is_dirty(&self) -> bool {
        !self.pages.lock().unwrap().dirty.is_empty()
    }

    /// Checksums `first..first + count` become 0: `zero` does it in the file, and
    /// the cached pages follow.
    pub(crate) fn zero(
        &self,
        first: u64,
        count: u64,
        zero: impl FnOnce() -> io::Result<()>,
    ) -> io::Result<()> {
        let mut pages = self.pages.lock().unwrap();
        zero()?;
        for (&page, sums) in pages.sums.iter_mut() {
            let start = (page * PAGE_SUMS).max(first);
            let end = ((page + 1) * PAGE_SUMS).min(first + count);
            if start < end {
                sums[(start - page * PAGE_SUMS) as usize..(end - page * PAGE_SUMS) as usize]
                    .fill(0);
            }
        }
        Ok(())
    }
}

impl Drop for SumsCache {
    fn drop(&mut self) {
        let pages = self.pages.get_mut().unwrap().sums.len();
        self.budget.pages.fetch_sub(pages, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_follow_writes_and_give_their_budget_back() {
        let budget = Arc::new(Budget::default());
        let cache = SumsCache::new(budget.clone(), false);
        let page = || Ok(vec![5; PAGE_SUMS as usize]);
        let mut out = [0u32; 2];
        cache.read(1, 3, &mut out, page).unwrap();
        assert_eq!(out, [5, 5]);
        cache.write(PAGE_SUMS + 3, &[7, 8], || Ok(())).unwrap();
        cache.zero(PAGE_SUMS + 4, 1, || Ok(())).unwrap();
        let unused = || panic!("the page is cached");
        cache.read(1, 3, &mut out, unused).unwrap();
        assert_eq!(out, [7, 0]);
        assert_eq!(budget.pages.load(Ordering::Relaxed), 1);
        drop(cache);
        assert_eq!(budget.pages.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_write_back_cache_keeps_cached_pages_until_flushed() {
        let cache = SumsCache::new(Arc::new(Budget::default()), true);
        let mut out = [0u32; 1];
        cache
            .read(0, 0, &mut out, || Ok(vec![0; PAGE_SUMS as usize]))
            .unwrap();
        let unused = || panic!("a cached page is written at flush");
        cache.write(5, &[9], unused).unwrap();
        assert!(cache.is_dirty());
        // A page not cached is written through.
        let mut written = false;
        cache
            .write(PAGE_SUMS, &[1], || {
                written = true;
                Ok(())
            })
            .unwrap();
        assert!(written);
        let mut flushed = Vec::new();
        cache
            .flush(|page, sums| {
                flushed.push((page, sums[5]));
                Ok(())
            })
            .unwrap();
        assert_eq!(flushed, [(0, 9)]);
        assert!(!cache.is_dirty());
    }
}
