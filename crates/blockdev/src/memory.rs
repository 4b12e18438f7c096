//! A RAM-backed device with 4 KiB allocation granularity: the reference model that
//! tests of upper layers (NBD, stripe) compare against.

use crate::{check_range, BlockDevice, Extent, IoError};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use std::collections::BTreeMap;
use std::sync::Mutex;

const BLOCK: u64 = 4096;

pub struct MemoryDevice {
    size: u64,
    blocks: Mutex<BTreeMap<u64, Box<[u8]>>>,
}

impl MemoryDevice {
    pub fn new(size: u64) -> Self {
        Self {
            size,
            blocks: Mutex::new(BTreeMap::new()),
        }
    }

    fn zero_range(&self, offset: u64, length: u64, punch: bool) {
        let mut blocks = self.blocks.lock().unwrap();
        let mut pos = offset;
        let end = offset + length;
        while pos < end {
            let index = pos / BLOCK;
            let in_block = (pos % BLOCK) as usize;
            let n = ((BLOCK - pos % BLOCK).min(end - pos)) as usize;
            if punch && in_block == 0 && n == BLOCK as usize {
                blocks.remove(&index);
            } else if let Some(b) = blocks.get_mut(&index) {
                b[in_block..in_block + n].fill(0);
            } else if !punch {
                blocks.insert(index, vec![0; BLOCK as usize].into_boxed_slice());
            }
            pos += n as u64;
        }
    }
}

#[async_trait]
impl BlockDevice for MemoryDevice {
    fn size(&self) -> u64 {
        self.size
    }

    async fn read(&self, offset: u64, length: u32) -> Result<Bytes, IoError> {
        check_range(self.size, offset, length as u64)?;
        let blocks = self.blocks.lock().unwrap();
        let mut out = BytesMut::zeroed(length as usize);
        let mut pos = offset;
        let end = offset + length as u64;
        while pos < end {
            let in_block = (pos % BLOCK) as usize;
            let n = ((BLOCK - pos % BLOCK).min(end - pos)) as usize;
            if let Some(b) = blocks.get(&(pos / BLOCK)) {
                let at = (pos - offset) as usize;
                out[at..at + n].copy_from_slice(&b[in_block..in_block + n]);
            }
            pos += n as u64;
        }
        Ok(out.freeze())
    }

    async fn write(&self, offset: u64, data: Bytes, _fua: bool) -> Result<(), IoError> {
        check_range(self.size, offset, data.len() as u64)?;
        let mut blocks = self.blocks.lock().unwrap();
        let mut pos = offset;
        let end = offset + data.len() as u64;
        while pos < end {
            let in_block = (pos % BLOCK) as usize;
            let n = ((BLOCK - pos % BLOCK).min(end - pos)) as usize;
            let b = blocks
                .entry(pos / BLOCK)
                .or_insert_with(|| vec![0; BLOCK as usize].into_boxed_slice());
            let at = (pos - offset) as usize;
            b[in_block..in_block + n].copy_from_slice(&data[at..at + n]);
            pos += n as u64;
        }
        Ok(())
    }

    async fn flush(&self) -> Result<(), IoError> {
        Ok(())
    }

    async fn trim(&self, offset: u64, length: u64) -> Result<(), IoError> {
        check_range(self.size, offset, length)?;
        self.zero_range(offset, length, true);
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, length: u64, may_punch: bool) -> Result<(), IoError> {
        check_range(self.size, offset, length)?;
        self.zero_range(offset, length, may_punch);
        Ok(())
    }

    async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError> {
        check_range(self.size, offset, length)?;
        let blocks = self.blocks.lock().unwrap();
        let mut out: Vec<Extent> = Vec::new();
        let mut pos = offset;
        let end = offset + length;
        while pos < end {
            let n = (BLOCK - pos % BLOCK).min(end - pos);
            let hole = !blocks.contains_key(&(pos / BLOCK));
            match out.last_mut() {
                Some(last) if last.hole == hole => last.length += n,
                _ => out.push(Extent { length: n, hole }),
            }
            pos += n;
        }
        Ok(out)
    }
}
