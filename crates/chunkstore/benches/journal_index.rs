//! The journal-index experiment of URSA §6.2 (Fig. 10): insert 700,000 random ranges
//! (start in [0, 2^20), length in [1, 2^6] sectors), then run 100,000 random range
//! queries, against
//! - `JournalIndex` (composite keys, tree + packed array),
//! - a `BTreeMap` with one entry per sector (offset -> journal position),
//! - redb with one key per sector, standing in for the paper's PebblesDB.
//!
//! Every structure returns the same journal pieces and holes for each query (checked).
//! Prints a table with ratios and writes JSON to `target/journal_index_bench.json`.
//!
//! Environment: `JI_INSERTS`, `JI_QUERIES` override the operation counts;
//! `JI_KV_FRACTION` (default 10) runs redb on the first 1/N of both: at one write
//! transaction per range it needs about 0.2 ms per insert, minutes for the full run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use floe_chunkstore::journal_index::{JournalIndex, Piece, DEFAULT_MERGE_THRESHOLD};
use rand::{rngs::StdRng, Rng, SeedableRng};
use redb::{Database, Durability, TableDefinition};

const SPACE: u64 = 1 << 20;
const MAX_LEN: u64 = 1 << 6;
const TABLE: TableDefinition<u64, u64> = TableDefinition::new("journal_index");

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().expect(name))
        .unwrap_or(default)
}

fn ranges(rng: &mut StdRng, n: usize) -> Vec<(u64, u64)> {
    (0..n)
        .map(|_| (rng.gen_range(0..SPACE), rng.gen_range(1..=MAX_LEN)))
        .collect()
}

/// Builds query pieces from per-sector `(offset, journal)` pairs in offset order,
/// joining neighbours whose journal positions are contiguous, as the index does.
fn pieces_from_sectors(
    offset: u64,
    len: u64,
    sectors: impl Iterator<Item = (u64, u64)>,
) -> Vec<Piece> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut at = offset;
    for (s, j) in sectors {
        if s > at {
            pieces.push(Piece::Hole {
                offset: at,
                len: s - at,
            });
        }
        match pieces.last_mut() {
            Some(Piece::Journal {
                offset: o,
                len: l,
                journal,
            }) if *o + *l == s && *journal + *l == j => *l += 1,
            _ => pieces.push(Piece::Journal {
                offset: s,
                len: 1,
                journal: j,
            }),
        }
        at = s + 1;
    }
    if at < offset + len {
        pieces.push(Piece::Hole {
            offset: at,
            len: offset + len - at,
        });
    }
    pieces
}

/// Joins contiguous journal pieces: the index may keep adjacent entries separate.
fn normalise(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for p in pieces {
        if let (
            Some(Piece::Journal {
                offset: o,
                len: l,
                journal: j,
            }),
            Piece::Journal {
                offset: po,
                len: pl,
                journal: pj,
            },
        ) = (out.last_mut(), p)
        {
            if *o + *l == po && *j + *l == pj {
                *l += pl;
                continue;
            }
        }
        out.push(p);
    }
    out
}

struct Run {
    name: &'static str,
    inserts: usize,
    queries: usize,
    insert: Duration,
    query: Duration,
    /// Query results, kept to check that every structure answers alike.
    answers: Vec<Vec<Piece>>,
}

impl Run {
    fn insert_ns(&self) -> f64 {
        self.insert.as_nanos() as f64 / self.inserts as f64
    }

    fn query_ns(&self) -> f64 {
        self.query.as_nanos() as f64 / self.queries as f64
    }
}

fn run_index(inserts: &[(u64, u64)], queries: &[(u64, u64)]) -> (Run, JournalIndex) {
    let mut index = JournalIndex::new(SPACE + MAX_LEN).unwrap();
    let start = Instant::now();
    let mut journal = 0;
    for &(o, l) in inserts {
        index.insert(o, l, journal).unwrap();
        journal += l;
    }
    let insert = start.elapsed();
    let start = Instant::now();
    let answers: Vec<_> = queries
        .iter()
        .map(|&(o, l)| index.query(o, l).unwrap())
        .collect();
    let query = start.elapsed();
    let run = Run {
        name: "journal_index",
        inserts: inserts.len(),
        queries: queries.len(),
        insert,
        query,
        answers,
    };
    (run, index)
}

fn run_btree(inserts: &[(u64, u64)], queries: &[(u64, u64)]) -> Run {
    let mut map = BTreeMap::new();
    let start = Instant::now();
    let mut journal = 0;
    for &(o, l) in inserts {
        for i in 0..l {
            map.insert(o + i, journal + i);
        }
        journal += l;
    }
    let insert = start.elapsed();
    let start = Instant::now();
    let answers: Vec<_> = queries
        .iter()
        .map(|&(o, l)| pieces_from_sectors(o, l, map.range(o..o + l).map(|(&s, &j)| (s, j))))
        .collect();
    let query = start.elapsed();
    Run {
        name: "btreemap_per_sector",
        inserts: inserts.len(),
        queries: queries.len(),
        insert,
        query,
        answers,
    }
}

/// One non-durable write transaction per inserted range, like an unsynced put batch.
fn run_redb(inserts: &[(u64, u64)], queries: &[(u64, u64)]) -> Run {
    let file = tempfile::NamedTempFile::new().unwrap();
    let db = Database::create(file.path()).unwrap();
    let start = Instant::now();
    let mut journal = 0;
    for &(o, l) in inserts {
        let mut tx = db.begin_write().unwrap();
        tx.set_durability(Durability::None);
        {
            let mut table = tx.open_table(TABLE).unwrap();
            for i in 0..l {
                table.insert(o + i, journal + i).unwrap();
            }
        }
        tx.commit().unwrap();
        journal += l;
    }
    let insert = start.elapsed();
    let start = Instant::now();
    let tx = db.begin_read().unwrap();
    let table = tx.open_table(TABLE).unwrap();
    let answers: Vec<_> = queries
        .iter()
        .map(|&(o, l)| {
            let sectors = table.range(o..o + l).unwrap().map(|r| {
                let (k, v) = r.unwrap();
                (k.value(), v.value())
            });
            pieces_from_sectors(o, l, sectors)
        })
        .collect();
    let query = start.elapsed();
    Run {
        name: "redb_per_sector",
        inserts: inserts.len(),
        queries: queries.len(),
        insert,
        query,
        answers,
    }
}

fn main() {
    let n_inserts = env_or("JI_INSERTS", 700_000);
    let n_queries = env_or("JI_QUERIES", 100_000);
    let kv_fraction = env_or("JI_KV_FRACTION", 10).max(1);
    let mut rng = StdRng::seed_from_u64(0x0a5a);
    let inserts = ranges(&mut rng, n_inserts);
    let queries = ranges(&mut rng, n_queries);

    let (index_run, index) = run_index(&inserts, &queries);
    let btree = run_btree(&inserts, &queries);
    let kv_inserts = &inserts[..n_inserts / kv_fraction];
    let kv_queries = &queries[..n_queries / kv_fraction];
    let redb = run_redb(kv_inserts, kv_queries);

    // Same answers everywhere; redb saw a prefix of the inserts, so compare it with an
    // index built from that prefix.
    let answers: Vec<_> = index_run.answers.iter().cloned().map(normalise).collect();
    assert_eq!(answers, btree.answers, "BTreeMap disagrees with the index");
    let (prefix, _) = run_index(kv_inserts, kv_queries);
    let prefix: Vec<_> = prefix.answers.into_iter().map(normalise).collect();
    assert_eq!(prefix, redb.answers, "redb disagrees with the index");

    println!(
        "journal index bench: {n_inserts} inserts, {n_queries} queries (redb: 1/{kv_fraction}), \
         merge threshold {DEFAULT_MERGE_THRESHOLD}; index ends with {} tree + {} array entries",
        index.tree_len(),
        index.array_len()
    );
    println!(
        "{:<22} {:>12} {:>12} {:>12} {:>12} {:>10} {:>10}",
        "structure", "insert s", "ns/insert", "query s", "ns/query", "ins ratio", "qry ratio"
    );
    let runs = [&index_run, &btree, &redb];
    let mut json = Vec::new();
    for r in runs {
        let insert_ratio = r.insert_ns() / index_run.insert_ns();
        let query_ratio = r.query_ns() / index_run.query_ns();
        println!(
            "{:<22} {:>12.3} {:>12.1} {:>12.3} {:>12.1} {:>10.1} {:>10.1}",
            r.name,
            r.insert.as_secs_f64(),
            r.insert_ns(),
            r.query.as_secs_f64(),
            r.query_ns(),
            insert_ratio,
            query_ratio
        );
        json.push(format!(
            "{{\"structure\":\"{}\",\"inserts\":{},\"queries\":{},\"insert_s\":{:.6},\
             \"query_s\":{:.6},\"ns_per_insert\":{:.1},\"ns_per_query\":{:.1},\
             \"insert_ratio_vs_index\":{:.2},\"query_ratio_vs_index\":{:.2}}}",
            r.name,
            r.inserts,
            r.queries,
            r.insert.as_secs_f64(),
            r.query.as_secs_f64(),
            r.insert_ns(),
            r.query_ns(),
            insert_ratio,
            query_ratio
        ));
    }
    println!("(ratios: time per operation relative to journal_index; > 1 means slower)");
    let json = format!("[{}]\n", json.join(","));
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
    let path = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or(dir)
        .join("journal_index_bench.json");
    std::fs::write(&path, &json).unwrap();
    print!("{json}");
    println!("written to {}", path.canonicalize().unwrap().display());
}
