//! Single-file back end on redb: no setup, one machine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use redb::{Database, ReadableTable, TableDefinition};

use crate::{MetaError, MetaStore, Op};

const TABLE: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

/// Boxed because redb's error enums are large; any of them converts with `?`.
type DbResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

pub struct EmbeddedStore {
    db: Arc<Database>,
    path: Arc<PathBuf>,
}

impl EmbeddedStore {
    /// Opens the store at `path`, creating the file and its parent directory if missing.
    pub fn open(path: &Path) -> Result<Self, MetaError> {
        let fail = |e: &dyn std::fmt::Display| backend_error(path, e);
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| fail(&e))?;
        }
        let db = Database::create(path).map_err(|e| fail(&e))?;
        // Create the table up front so readers never see "table does not exist".
        (|| -> DbResult<()> {
            let txn = db.begin_write()?;
            txn.open_table(TABLE)?;
            txn.commit()?;
            Ok(())
        })()
        .map_err(|e| fail(&e))?;
        Ok(Self {
            db: Arc::new(db),
            path: Arc::new(path.to_path_buf()),
        })
    }

    /// Runs a redb closure off the async runtime: redb calls block on disk I/O and fsync.
    async fn blocking<T, F>(&self, f: F) -> Result<T, MetaError>
    where
        T: Send + 'static,
        F: FnOnce(&Database) -> DbResult<T> + Send + 'static,
    {
        let db = self.db.clone();
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || f(&db).map_err(|e| backend_error(&path, &e)))
            .await
            .map_err(|e| backend_error(&self.path, &e))?
    }
}

fn backend_error(path: &Path, e: &dyn std::fmt::Display) -> MetaError {
    MetaError::Backend(format!("{}: {e}", path.display()))
}

#[async_trait]
impl MetaStore for EmbeddedStore {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError> {
        let key = key.to_string();
        self.blocking(move |db| {
            let table = db.begin_read()?.open_table(TABLE)?;
            Ok(table.get(key.as_str())?.map(|v| v.value().to_vec()))
        })
        .await
    }

    async fn scan_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, MetaError> {
        let prefix = prefix.to_string();
        self.blocking(move |db| {
            let table = db.begin_read()?.open_table(TABLE)?;
            let mut out = Vec::new();
            for entry in table.range(prefix.as_str()..)? {
                let (k, v) = entry?;
                if !k.value().starts_with(prefix.as_str()) {
                    break;
                }
                out.push((k.value().to_string(), v.value().to_vec()));
            }
            Ok(out)
        })
        .await
    }

    async fn apply(&self, ops: Vec<Op>) -> Result<(), MetaError> {
        self.blocking(move |db| {
            // Dropping an uncommitted transaction aborts it, so an error leaves nothing behind.
            let txn = db.begin_write()?;
            {
                let mut table = txn.open_table(TABLE)?;
                for op in &ops {
                    match op {
                        Op::Put { key, value } => {
                            table.insert(key.as_str(), value.as_slice())?;
                        }
                        Op::Delete { key } => {
                            table.remove(key.as_str())?;
                        }
                        Op::DeletePrefix { prefix } => {
                            let mut doomed = Vec::new();
                            for entry in table.range(prefix.as_str()..)? {
                                let key = entry?.0.value().to_string();
                                if !key.starts_with(prefix.as_str()) {
                                    break;
                                }
                                doomed.push(key);
                            }
                            for key in doomed {
                                table.remove(key.as_str())?;
                            }
                        }
                    }
                }
            }
            txn.commit()?;
            Ok(())
        })
        .await
    }
}
