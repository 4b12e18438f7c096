//! An in-memory store: the metadata service of the deterministic simulator, where
//! a master that restarts must find what its predecessor stored (clones share the
//! contents, as masters share an etcd cluster).

use crate::{MetaError, MetaStore, Op};
use async_trait::async_trait;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
pub struct MemoryStore {
    pairs: Arc<Mutex<BTreeMap<String, Vec<u8>>>>,
}

#[async_trait]
impl MetaStore for MemoryStore {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError> {
        Ok(self.pairs.lock().unwrap().get(key).cloned())
    }

    async fn scan_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, MetaError> {
        let pairs = self.pairs.lock().unwrap();
        Ok(pairs
            .range(prefix.to_string()..)
            .take_while(|(key, _)| key.starts_with(prefix))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect())
    }

    async fn apply(&self, ops: Vec<Op>) -> Result<(), MetaError> {
        let mut pairs = self.pairs.lock().unwrap();
        for op in ops {
            match op {
                Op::Put { key, value } => {
                    pairs.insert(key, value);
                }
                Op::Delete { key } => {
                    pairs.remove(&key);
                }
                Op::DeletePrefix { prefix } => {
                    pairs.retain(|key, _| !key.starts_with(&prefix));
                }
            }
        }
        Ok(())
    }
}
