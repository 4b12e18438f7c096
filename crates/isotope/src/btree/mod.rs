//! A transactional B-tree on a transaction volume (IsoBT, thesis 4.4): ordered keys,
//! range scans, no locks and no log of its own; every operation runs in the caller's
//! transaction. Nodes split on the way down (a full node is split before an insert
//! passes through it), so an insert writes each node once. Deleting removes the
//! entry from its leaf; nodes are not merged.
//!
//! Data block `base` holds the header (`FLOEIBT1`, root block, next free block);
//! nodes are allocated upward from `base + 1`, never freed.

pub mod node;

use crate::{Blocks, Transaction, TxError, BLOCK_BYTES};
use bytes::BytesMut;
use node::{Node, KEY_BYTES_MAX, VALUE_BYTES_MAX};

const MAGIC: &[u8; 8] = b"FLOEIBT1";
/// Tree height at most: a bound on every descent (41-way nodes: billions of keys).
const DEPTH_MAX: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TreeError {
    Tx(TxError),
    KeyLength(usize),
    ValueTooLong(usize),
    /// No block left for a new node.
    Full,
    /// The header block is neither zeroes nor a tree header.
    NotATree,
}

impl From<TxError> for TreeError {
    fn from(e: TxError) -> TreeError {
        TreeError::Tx(e)
    }
}

impl std::fmt::Display for TreeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TreeError::Tx(e) => write!(f, "{e}"),
            TreeError::KeyLength(n) => {
                write!(f, "a key of {n} bytes: keys are 1 to {KEY_BYTES_MAX} bytes")
            }
            TreeError::ValueTooLong(n) => {
                write!(
                    f,
                    "a value of {n} bytes: values are at most {VALUE_BYTES_MAX} bytes"
                )
            }
            TreeError::Full => write!(f, "no block left for a B-tree node"),
            TreeError::NotATree => write!(f, "the volume holds no B-tree there"),
        }
    }
}

impl std::error::Error for TreeError {}

/// The tree at data block `base`, within one transaction.
pub struct Tree<'t, T: Blocks = Transaction> {
    tx: &'t mut T,
    base: u64,
    blocks_end: u64,
    root: u64,
    next_free: u64,
}

impl<'t, T: Blocks> Tree<'t, T> {
    /// The tree whose header is data block `base` (a zero block gets an empty tree,
    /// created in `tx`); nodes go in blocks `base + 1 .. blocks_end`.
    pub async fn attach(
        tx: &'t mut T,
        base: u64,
        blocks_end: u64,
    ) -> Result<Tree<'t, T>, TreeError> {
        let header = tx.read(base).await?;
        let u64_at = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap());
        let mut tree = Tree {
            tx,
            base,
            blocks_end,
            root: 0,
            next_free: 0,
        };
        if &header[..8] == MAGIC {
            (tree.root, tree.next_free) = (u64_at(8), u64_at(16));
            assert!(
                tree.root > base && tree.next_free <= blocks_end,
                "tree header"
            );
        } else if header.iter().all(|b| *b == 0) {
            tree.next_free = base + 1;
            tree.root = tree.allocate()?;
            let empty = Node {
                leaf: true,
                entries: Vec::new(),
            };
            tree.tx.write(tree.root, empty.encode()).await?;
            tree.write_header().await?;
        } else {
            return Err(TreeError::NotATree);
        }
        Ok(tree)
    }

    fn allocate(&mut self) -> Result<u64, TreeError> {
        if self.next_free >= self.blocks_end {
            return Err(TreeError::Full);
        }
        self.next_free += 1;
        Ok(self.next_free - 1)
    }

    async fn write_header(&mut self) -> Result<(), TreeError> {
        let mut header = BytesMut::zeroed(BLOCK_BYTES);
        header[..8].copy_from_slice(MAGIC);
        header[8..16].copy_from_slice(&self.root.to_le_bytes());
        header[16..24].copy_from_slice(&self.next_free.to_le_bytes());
        self.tx.write(self.base, header.freeze()).await?;
        Ok(())
    }

    async fn node(&mut self, block: u64) -> Result<Node, TreeError> {
        Ok(Node::decode(&self.tx.read(block).await?))
    }

    pub async fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, TreeError> {
        check_key(key)?;
        let mut block = self.root;
        for _ in 0..DEPTH_MAX {
            let node = self.node(block).await?;
            if node.leaf {
                let found = node
                    .entries
                    .binary_search_by(|(k, _)| k.as_slice().cmp(key));
                return Ok(found.ok().map(|i| node.entries[i].1.clone()));
            }
            block = node.child(node.child_for(key));
        }
        panic!("a B-tree deeper than {DEPTH_MAX}");
    }

    pub async fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), TreeError> {
        check_key(key)?;
        if value.len() > VALUE_BYTES_MAX {
            return Err(TreeError::ValueTooLong(value.len()));
        }
        let mut root = self.node(self.root).await?;
        if root.full() {
            // A new root above the old one, then split as any full child.
            let old = self.root;
            let smallest = root.entries[0].0.clone();
            root = Node {
                leaf: false,
                entries: vec![(smallest, old.to_le_bytes().to_vec())],
            };
            self.root = self.allocate()?;
            self.split_child(&mut root, 0).await?;
            self.tx.write(self.root, root.encode()).await?;
            self.write_header().await?;
        }
        let (mut block, mut node) = (self.root, root);
        for _ in 0..DEPTH_MAX {
            if node.leaf {
                match node
                    .entries
                    .binary_search_by(|(k, _)| k.as_slice().cmp(key))
                {
                    Ok(i) => node.entries[i].1 = value.to_vec(),
                    Err(i) => node.entries.insert(i, (key.to_vec(), value.to_vec())),
                }
                self.tx.write(block, node.encode()).await?;
                return Ok(());
            }
            let mut entry = node.child_for(key);
            if key < node.entries[entry].0.as_slice() {
                // A key below every one the tree has seen: the first subtree takes it.
                node.entries[entry].0 = key.to_vec();
                self.tx.write(block, node.encode()).await?;
            }
            let child = self.node(node.child(entry)).await?;
            if child.full() {
                self.split_child(&mut node, entry).await?;
                self.tx.write(block, node.encode()).await?;
                entry = node.child_for(key);
            }
            block = node.child(entry);
            node = self.node(block).await?;
        }
        panic!("a B-tree deeper than {DEPTH_MAX}");
    }

    /// Splits `parent`'s full child `entry` in two, adding the new half to `parent`
    /// (which has room: full nodes are split before they are entered).
    async fn split_child(&mut self, parent: &mut Node, entry: usize) -> Result<(), TreeError> {
        let left_block = parent.child(entry);
        let mut left = self.node(left_block).await?;
        let right = left.split();
        let right_block = self.allocate()?;
        self.tx.write(left_block, left.encode()).await?;
        self.tx.write(right_block, right.encode()).await?;
        let right_key = right.entries[0].0.clone();
        parent
            .entries
            .insert(entry + 1, (right_key, right_block.to_le_bytes().to_vec()));
        self.write_header().await
    }

    /// Whether the key was there.
    pub async fn delete(&mut self, key: &[u8]) -> Result<bool, TreeError> {
        check_key(key)?;
        let mut block = self.root;
        for _ in 0..DEPTH_MAX {
            let mut node = self.node(block).await?;
            if node.leaf {
                let Ok(i) = node
                    .entries
                    .binary_search_by(|(k, _)| k.as_slice().cmp(key))
                else {
                    return Ok(false);
                };
                node.entries.remove(i);
                self.tx.write(block, node.encode()).await?;
                return Ok(true);
            }
            block = node.child(node.child_for(key));
        }
        panic!("a B-tree deeper than {DEPTH_MAX}");
    }

    /// The pairs with `from <= key < to` (`to` empty: no upper bound), in key order,
    /// at most `limit`.
    pub async fn range(
        &mut self,
        from: &[u8],
        to: &[u8],
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>, TreeError> {
        let mut out = Vec::new();
        let below_to = |k: &[u8]| to.is_empty() || k < to;
        // Depth-first, children in key order: (block, depth).
        let mut stack = vec![(self.root, 0)];
        while let Some((block, depth)) = stack.pop() {
            assert!(depth < DEPTH_MAX, "a B-tree deeper than {DEPTH_MAX}");
            let node = self.node(block).await?;
            if node.leaf {
                let pairs = node.entries.into_iter();
                for (k, v) in pairs.filter(|(k, _)| k.as_slice() >= from && below_to(k)) {
                    if out.len() == limit {
                        return Ok(out);
                    }
                    out.push((k, v));
                }
                continue;
            }
            let first = node.child_for(from);
            let children = (first..node.entries.len()).filter(|i| below_to(&node.entries[*i].0));
            let children: Vec<u64> = children.map(|i| node.child(i)).collect();
            stack.extend(children.into_iter().rev().map(|c| (c, depth + 1)));
        }
        Ok(out)
    }
}

fn check_key(key: &[u8]) -> Result<(), TreeError> {
    match key.len() {
        1..=KEY_BYTES_MAX => Ok(()),
        n => Err(TreeError::KeyLength(n)),
    }
}
