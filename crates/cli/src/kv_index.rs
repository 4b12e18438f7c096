//! `floe kv --index`: which of Isotope's example structures holds a volume's pairs:
//! the hash table (`floe_isotope::kv`, the default: a key's slot in one block) or the
//! B-tree (`floe_isotope::btree`: keys in order, scans read only the range). A volume
//! holds one or the other; the other refuses it.

use floe_isotope::btree::{Tree, TreeError};
use floe_isotope::kv::{Kv, KvError};
use floe_isotope::Blocks;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Index {
    /// The hash table (keys up to 60 bytes, values up to 192).
    Hash,
    /// The B-tree (keys up to 32 bytes, values up to 64).
    Btree,
}

/// The pairs of a volume, within one transaction.
pub enum Store<'t, T: Blocks> {
    Hash(Kv<'t, T>),
    Tree(Tree<'t, T>),
}

type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// Why an operation failed, in either structure.
#[derive(Debug)]
pub enum StoreError {
    Hash(KvError),
    Tree(TreeError),
}

impl From<KvError> for StoreError {
    fn from(e: KvError) -> StoreError {
        StoreError::Hash(e)
    }
}

impl From<TreeError> for StoreError {
    fn from(e: TreeError) -> StoreError {
        StoreError::Tree(e)
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Hash(e) => write!(f, "{e}"),
            StoreError::Tree(e) => write!(f, "{e}"),
        }
    }
}

impl<'t, T: Blocks> Store<'t, T> {
    /// The structure `index` names in `tx`'s volume (created in `tx` if the volume
    /// reads as zeroes); the tree's header is data block 0, its nodes the rest.
    pub async fn attach(index: Index, tx: &'t mut T, data_blocks: u64) -> Result<Self, StoreError> {
        Ok(match index {
            Index::Hash => Store::Hash(Kv::attach(tx, data_blocks).await?),
            Index::Btree => Store::Tree(Tree::attach(tx, 0, data_blocks).await?),
        })
    }

    pub async fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        match self {
            Store::Hash(kv) => Ok(kv.get(key).await?.map(|v| v.to_vec())),
            Store::Tree(tree) => Ok(tree.get(key).await?),
        }
    }

    pub async fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        match self {
            Store::Hash(kv) => Ok(kv.put(key, value).await?),
            Store::Tree(tree) => Ok(tree.put(key, value).await?),
        }
    }

    /// Whether the key was there.
    pub async fn delete(&mut self, key: &[u8]) -> Result<bool, StoreError> {
        match self {
            Store::Hash(kv) => Ok(kv.delete(key).await?),
            Store::Tree(tree) => Ok(tree.delete(key).await?),
        }
    }

    /// The pairs whose key starts with `prefix`, in key order.
    pub async fn scan(&mut self, prefix: &[u8]) -> Result<Pairs, StoreError> {
        match self {
            Store::Hash(kv) => {
                let pairs = kv.scan(prefix).await?;
                Ok(pairs
                    .into_iter()
                    .map(|(k, v)| (k.to_vec(), v.to_vec()))
                    .collect())
            }
            Store::Tree(tree) => {
                let end = prefix_end(prefix);
                Ok(tree.range(prefix, &end, usize::MAX).await?)
            }
        }
    }
}

/// The least key above every key starting with `prefix` (empty: none is).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return end;
        }
    }
    end
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn a_prefix_ends_below_its_successor() {
        assert_eq!(prefix_end(b"fruit/"), b"fruit0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"");
        assert_eq!(prefix_end(b""), b"");
    }
}
